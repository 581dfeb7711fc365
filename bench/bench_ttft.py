#!/usr/bin/env python3
"""Time to first token: what the daemon adds over talking to the router directly.

The fake router (``python -m tests.fakerouter``, its own process) answers every
stream with its default reply, an echo of the question in word chunks, so each
request is answered identically.  Each sample is a pair, in alternating order:

- direct: an httpx streaming POST to ``/v1/chat/completions`` with the very
  messages the daemon would send, timed until the first content chunk;
- daemon: an ``ask`` line on the socket, timed until the first ``delta`` event.

Two cases: (a) a new conversation; (b) a conversation with ``--history`` turns
already stored (written through ``HistoryStore`` before the daemon starts; the
samples are spread over ``--conversations`` such conversations, so each grows by
only a few turns and the direct request replays each one's exact messages).
Overhead is the daemon median minus the direct median.  Target: under 2 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchlib import (
    DEFAULT_QUESTION,
    FAKE_MODEL,
    SYSTEM_PROMPT,
    Client,
    Daemon,
    fake_router_process,
    header,
    history_messages,
    median,
    ms,
    p90,
    print_profile,
    profile_prefix,
    temp_dir,
    terminate_on_sigterm,
    verdict,
    write_history,
)

TARGET_OVERHEAD = 0.002  # seconds, median
RUN_TIMEOUT = 90.0  # the whole measurement, whatever --runs says


@dataclass
class Samples:
    """First-token times of one case, both paths, in seconds."""

    name: str
    direct: list[float] = field(default_factory=list)
    daemon: list[float] = field(default_factory=list)

    @property
    def overhead(self) -> float:
        return median(self.daemon) - median(self.direct)


async def direct_ttft(http: httpx.AsyncClient, url: str, messages: list[dict[str, Any]]) -> float:
    """Seconds from the POST to the first content chunk; the body is read to its end (keep-alive)."""
    body = {"model": FAKE_MODEL, "messages": messages, "stream": True, "stream_options": {"include_usage": True}}
    first: float | None = None
    started = time.perf_counter()
    # as the daemon does: a fresh connection per stream (llama-server and the fake close it after)
    async with http.stream("POST", f"{url}/chat/completions", json=body, headers={"Connection": "close"}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or ()
                if choices and (choices[0].get("delta") or {}).get("content"):
                    first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("the router's reply had no content chunk")
    return first


async def daemon_ttft(client: Client, question: str, conversation: int | None) -> tuple[float, str]:
    """Seconds from the ask line to the first ``delta``; then reads through ``done``. Also the reply."""
    request: dict[str, Any] = {"type": "ask", "text": question}
    if conversation is not None:
        request["conversation"] = conversation
    first: float | None = None
    started = time.perf_counter()
    rid = await client.send(request)
    while True:
        event = await client.event()
        if event.get("id") != rid:
            continue
        kind = event["type"]
        if kind == "delta" and first is None:
            first = time.perf_counter() - started
        elif kind == "done":
            break
        elif kind == "error":
            raise RuntimeError(f"the daemon answered with an error: {event}")
    if first is None:
        raise RuntimeError("the daemon's reply had no delta")
    return first, event["text"]


async def measure(
    samples: Samples | None,
    runs: int,
    http: httpx.AsyncClient,
    url: str,
    client: Client,
    histories: dict[int, list[dict[str, str]]] | None,
) -> None:
    """``runs`` pairs (direct, daemon); ``samples`` None is a warm-up. Histories grow as asked."""
    ids = list(histories) if histories else []
    for i in range(runs):
        cid = ids[i % len(ids)] if ids else None
        past = histories[cid] if histories and cid is not None else []
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, *past, {"role": "user", "content": DEFAULT_QUESTION}]
        if i % 2 == 0:  # alternate which path goes first, so neither always meets a warmer cache
            direct = await direct_ttft(http, url, messages)
            through, reply = await daemon_ttft(client, DEFAULT_QUESTION, cid)
        else:
            through, reply = await daemon_ttft(client, DEFAULT_QUESTION, cid)
            direct = await direct_ttft(http, url, messages)
        if histories is not None and cid is not None:
            histories[cid].extend(history_messages(DEFAULT_QUESTION, reply))
        if samples is not None:
            samples.direct.append(direct)
            samples.daemon.append(through)


async def run(args: argparse.Namespace, url: str, daemon: Daemon, histories: dict[int, list[dict[str, str]]]) -> list[Samples]:
    results = [Samples("(a) new conversation"), Samples(f"(b) {args.history} turns of history")]
    limits = httpx.Limits(max_keepalive_connections=1)
    async with asyncio.timeout(RUN_TIMEOUT), httpx.AsyncClient(limits=limits, timeout=10.0) as http:
        client = await Client.open(daemon.socket_path)
        try:
            for samples, hist in ((results[0], None), (results[1], histories)):
                await measure(None, args.warmup, http, url, client, hist)
                await measure(samples, args.runs, http, url, client, hist)
        finally:
            await client.close()
    return results


def report(args: argparse.Namespace, results: list[Samples]) -> bool:
    print(f"samples: {args.runs} per path and case (after {args.warmup} warm-up pairs); question {DEFAULT_QUESTION!r}")
    print(f"{'case':34} {'direct med':>12} {'direct p90':>12} {'daemon med':>12} {'daemon p90':>12} {'overhead med':>13} {'overhead p90':>13}")
    ok = True
    for s in results:
        over_p90 = p90(s.daemon) - p90(s.direct)
        print(
            f"{s.name:34} {ms(median(s.direct)):>12} {ms(p90(s.direct)):>12} {ms(median(s.daemon)):>12} "
            f"{ms(p90(s.daemon)):>12} {ms(s.overhead):>13} {ms(over_p90):>13}"
        )
        ok = ok and s.overhead < TARGET_OVERHEAD
    for s in results:
        print(f"target: {s.name} overhead median < {ms(TARGET_OVERHEAD)}: {ms(s.overhead)} {verdict(s.overhead < TARGET_OVERHEAD)}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="samples per path and case (default 200)")
    parser.add_argument("--warmup", type=int, default=10, help="unrecorded pairs before each case (default 10)")
    parser.add_argument("--history", type=int, default=200, help="turns of history in case (b) (default 200)")
    parser.add_argument(
        "--conversations", type=int, default=20,
        help="case (b) spreads its samples over this many such conversations (default 20)",
    )
    parser.add_argument("--profile", action="store_true", help="run the daemon under cProfile and print its hot spots")
    args = parser.parse_args(argv)
    terminate_on_sigterm()
    header("bench_ttft: daemon overhead on time to first token")
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(fake_router_process())
        work = stack.enter_context(temp_dir("ttft"))
        built = time.perf_counter()
        histories = write_history(work / "data" / "history.db", args.conversations, args.history)
        print(f"history: {args.conversations} conversations x {args.history} turns written in {time.perf_counter() - built:.2f} s")
        profile = work / "daemon.prof"
        daemon = stack.enter_context(Daemon(work, url, prefix=profile_prefix(profile) if args.profile else ()))
        results = asyncio.run(run(args, url, daemon, histories))
        report(args, results)
        if args.profile:
            daemon.stop()
            print_profile(profile)  # a missed target is a finding, not a failure of the benchmark
    return 0


if __name__ == "__main__":
    sys.exit(main())
