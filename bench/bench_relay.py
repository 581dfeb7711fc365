#!/usr/bin/env python3
"""Relay throughput: deltas per second the daemon passes on from a router streaming flat out.

A FakeRouter in a child process (it scripts itself: ``python -m selfcheck.fakerouter``
has no way to ask for a long reply) answers each stream with ``--chunks``
one-word content chunks, unpaced, so it writes them as fast as the socket takes
them.  Each run asks the daemon in a new conversation and counts ``delta``
events until ``done``, checking the count and the final text.  For comparison
the same reply is streamed straight from the router with httpx (``aiter_lines``
and a ``json.loads`` per chunk, the least any consumer does).  Direct and daemon
runs alternate.  Rates are taken from the first delta to ``done``; the router
builds the whole reply before sending it, which the end-to-end figure includes.
Target: over 10,000 deltas/s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass

import httpx
from benchlib import (
    FAKE_MODEL,
    Daemon,
    answer,
    header,
    median,
    open_client,
    print_profile,
    profile_prefix,
    scripted_router_process,
    temp_dir,
    terminate_on_sigterm,
    verdict,
)

from client import Wire

TARGET_RATE = 10_000.0  # deltas per second
RUN_TIMEOUT = 100.0  # the whole measurement
READ_SIZE = 1 << 18
DELTA_PREFIX = b'{"type":"delta"'  # encode_event keeps key order: a cheap test before json.loads
QUESTION = "Stream as fast as you can."


@dataclass
class Run:
    """One streamed reply: how many deltas, how many bytes, and when."""

    deltas: int
    socket_bytes: int  # event lines as received (daemon) or SSE body (direct)
    text_bytes: int
    first: float  # seconds from the request to the first delta
    total: float  # seconds from the request to the end

    @property
    def relay_seconds(self) -> float:
        return self.total - self.first

    @property
    def rate(self) -> float:
        return self.deltas / self.relay_seconds

    @property
    def end_to_end_rate(self) -> float:
        return self.deltas / self.total

    @property
    def mb_per_s(self) -> float:
        return self.socket_bytes / self.relay_seconds / 1e6

    @property
    def text_mb_per_s(self) -> float:
        return self.text_bytes / self.relay_seconds / 1e6


def make_chunks(n: int) -> list[str]:
    return [f" w{i % 1000}" for i in range(n)]


async def direct_run(http: httpx.AsyncClient, url: str, expected: str) -> Run:
    body = {
        "model": FAKE_MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    deltas = size = 0
    parts: list[str] = []
    first: float | None = None
    started = time.perf_counter()
    # as the daemon does: a fresh connection per stream (llama-server and the fake close it after)
    async with http.stream("POST", f"{url}/chat/completions", json=body, headers={"Connection": "close"}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            size += len(line) + 1
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or ()
            content = (choices[0].get("delta") or {}).get("content") if choices else None
            if content:
                if first is None:
                    first = time.perf_counter() - started
                deltas += 1
                parts.append(content)
    total = time.perf_counter() - started
    text = "".join(parts)
    if text != expected or first is None:
        raise RuntimeError(f"direct: got {deltas} chunks, text {'matches' if text == expected else 'differs'}")
    return Run(deltas, size, len(text.encode()), first, total)


async def daemon_run(client: Wire, expected: str) -> Run:
    """One ask; deltas are counted from the raw lines, everything else is parsed."""
    deltas = size = text_bytes = 0
    first: float | None = None
    done: dict[str, object] | None = None
    pending = b""
    started = time.perf_counter()
    rid = await client.send({"type": "ask", "text": QUESTION})
    while done is None:
        data = await client.reader.read(READ_SIZE)
        if not data:
            raise ConnectionError("the daemon closed the connection")
        size += len(data)
        lines = (pending + data).split(b"\n") if pending else data.split(b"\n")
        pending = lines.pop()
        for line in lines:
            if line.startswith(DELTA_PREFIX):
                if first is None:
                    first = time.perf_counter() - started
                deltas += 1
                continue
            event = json.loads(line)
            if event.get("id") != rid:
                continue
            if event["type"] == "delta":  # should the key order ever change
                first = first if first is not None else time.perf_counter() - started
                deltas += 1
            elif event["type"] == "done":
                done = event
            elif event["type"] == "error":
                raise RuntimeError(f"the daemon answered with an error: {event}")
    total = time.perf_counter() - started
    text = done.get("text")
    if text != expected or first is None:
        raise RuntimeError(f"daemon: got {deltas} deltas, final text {'matches' if text == expected else 'differs'}")
    text_bytes = len(expected.encode())
    return Run(deltas, size, text_bytes, first, total)


async def measure(args: argparse.Namespace, url: str, daemon: Daemon, expected: str) -> tuple[list[Run], list[Run]]:
    direct: list[Run] = []
    through: list[Run] = []
    async with asyncio.timeout(RUN_TIMEOUT), httpx.AsyncClient(timeout=30.0) as http:
        client = await open_client(daemon.socket_path)
        try:
            # warm-up without using a scripted reply: the daemon fetches the model list and connects
            await answer(client, await client.send({"type": "status"}), ("status",))
            await answer(client, await client.send({"type": "models"}), ("models",))
            for _ in range(args.runs):
                direct.append(await direct_run(http, url, expected))
                through.append(await daemon_run(client, expected))
        finally:
            await client.close()
    return direct, through


def report(args: argparse.Namespace, direct: list[Run], through: list[Run]) -> None:
    print(f"reply: {args.chunks} one-word chunks ({len(''.join(make_chunks(args.chunks)).encode())} bytes of text); {args.runs} runs each")
    print(f"{'path':22} {'deltas/s (median)':>18} {'runs':>30} {'MB/s wire':>10} {'MB/s text':>10} {'end-to-end/s':>13} {'1st delta':>10}")
    for name, runs in (("router direct (httpx)", direct), ("through the daemon", through)):
        rates = ", ".join(f"{r.rate:,.0f}" for r in runs)
        mid = sorted(runs, key=lambda r: r.rate)[len(runs) // 2]
        print(
            f"{name:22} {median([r.rate for r in runs]):>18,.0f} {rates:>30} {mid.mb_per_s:>10.2f} "
            f"{mid.text_mb_per_s:>10.3f} {median([r.end_to_end_rate for r in runs]):>13,.0f} "
            f"{median([r.first for r in runs]) * 1000:>8.1f}ms"
        )
    rate = median([r.rate for r in through])
    print(f"target: daemon relay > {TARGET_RATE:,.0f} deltas/s: {rate:,.0f} {verdict(rate > TARGET_RATE)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=50_000, help="chunks in the reply (default 50000)")
    parser.add_argument("--runs", type=int, default=3, help="runs per path (default 3)")
    parser.add_argument("--profile", action="store_true", help="run the daemon under cProfile and print its hot spots")
    args = parser.parse_args(argv)
    terminate_on_sigterm()
    header("bench_relay: deltas per second relayed by the daemon")
    chunks = make_chunks(args.chunks)
    expected = "".join(chunks)
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(scripted_router_process(chunks, repeat=2 * args.runs))
        work = stack.enter_context(temp_dir("relay"))
        profile = work / "daemon.prof"
        daemon = stack.enter_context(Daemon(work, url, prefix=profile_prefix(profile) if args.profile else ()))
        direct, through = asyncio.run(measure(args, url, daemon, expected))
        report(args, direct, through)
        if args.profile:
            daemon.stop()
            print_profile(profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
