#!/usr/bin/env python3
"""The OpenAI door: what it adds to a first token and to a reply, and many clients at once.

The fake router (``python -m selfcheck.fakerouter``, its own process) echoes each question
in word chunks, so the same request is answered identically. The daemon runs as a child
process with ``openai_listen`` on a free loopback port. Cases, each pair in alternating
order:

- (a) first token of a new conversation: a streaming ``POST /v1/chat/completions`` to the
  door (httpx, ``Connection: close``, one user message) against the very body the daemon
  then sent to the router (``/debug/last-chat``) posted to the router directly; and the same
  question as an ``ask`` on the socket, so that the door's own part shows apart from the
  daemon's. Overhead is the door's median minus the direct median; budget 5 ms (the
  daemon's, README "Performance").
- (b) relay: a question of ``--words`` words, echoed back as as many chunks: the time from
  the first chunk to ``[DONE]`` through the door and directly, as chunks a second.
- (c) ``--clients`` clients asking at once, each a new conversation, ``--rounds`` times:
  every answer whole, and the first-token median under that load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import time
from typing import Any

import httpx
from benchlib import (
    DEFAULT_QUESTION,
    Daemon,
    fake_router_process,
    header,
    median,
    ms,
    open_client,
    p90,
    temp_dir,
    terminate_on_sigterm,
    verdict,
)

from client import Wire

TARGET_OVERHEAD = 0.005  # seconds, median, first token through the door over direct
KEY = "bench-key-of-the-door-0123"  # the door wants 16 characters or more
RELAY_MODEL = "fake-vision"  # the fake's larger context: a long question, echoed, fits it and the reply's cap
RUN_TIMEOUT = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def stream_timed(http: httpx.AsyncClient, url: str, body: dict[str, Any],
                       headers: dict[str, str]) -> tuple[float, float, int]:
    """Seconds to the first content chunk and to the stream's end, and the content chunks read."""
    started = time.perf_counter()
    first: float | None = None
    chunks = 0
    async with http.stream("POST", url, json=body, headers={"Connection": "close", **headers}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or ()
            if choices and (choices[0].get("delta") or {}).get("content"):
                chunks += 1
                first = first if first is not None else time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"no content chunk from {url}")
    return first, time.perf_counter() - started, chunks


async def last_chat(http: httpx.AsyncClient, router: str) -> dict[str, Any]:
    response = await http.get(f"{router}/debug/last-chat", headers={"Connection": "close"})
    body: dict[str, Any] = response.json()
    for key in ("path", "_arrived"):
        body.pop(key, None)
    return body


async def socket_ttft(client: Wire, question: str) -> float:
    started = time.perf_counter()
    rid = await client.send({"type": "ask", "text": question})
    first: float | None = None
    while True:
        event = await client.read()
        if event.get("id") != rid:
            continue
        if event["type"] == "delta" and first is None:
            first = time.perf_counter() - started
        elif event["type"] in ("done", "error"):
            break
    if first is None:
        raise RuntimeError(f"the socket's ask ended without a delta: {event}")
    return first


def chat_body(question: str, model: str = "fake-text") -> dict[str, Any]:
    return {"model": model, "stream": True, "messages": [{"role": "user", "content": question}]}


async def first_tokens(args: argparse.Namespace, http: httpx.AsyncClient, door: str, router: str,
                       client: Wire) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"direct": [], "door": [], "socket": []}
    auth = {"Authorization": f"Bearer {KEY}"}
    for i in range(args.warmup + args.runs):
        door_first, _, _ = await stream_timed(http, f"{door}/chat/completions", chat_body(DEFAULT_QUESTION), auth)
        sent = await last_chat(http, router)
        direct_first, _, _ = await stream_timed(http, f"{router}/chat/completions", sent, {})
        via_socket = await socket_ttft(client, DEFAULT_QUESTION)
        if i >= args.warmup:
            times["door"].append(door_first)
            times["direct"].append(direct_first)
            times["socket"].append(via_socket)
    return times


async def relay(args: argparse.Namespace, http: httpx.AsyncClient, door: str, router: str) -> dict[str, float]:
    question = " ".join(f"word{n}" for n in range(args.words))
    auth = {"Authorization": f"Bearer {KEY}"}
    rates: dict[str, list[float]] = {"door": [], "direct": []}
    for _ in range(args.relay_runs):
        first, total, chunks = await stream_timed(http, f"{door}/chat/completions", chat_body(question, RELAY_MODEL), auth)
        rates["door"].append(chunks / (total - first))
        sent = await last_chat(http, router)
        first, total, chunks = await stream_timed(http, f"{router}/chat/completions", sent, {})
        rates["direct"].append(chunks / (total - first))
    return {path: median(values) for path, values in rates.items()}


async def concurrent(args: argparse.Namespace, http: httpx.AsyncClient, door: str) -> tuple[list[float], float]:
    auth = {"Authorization": f"Bearer {KEY}"}
    firsts: list[float] = []
    started = time.perf_counter()
    for _ in range(args.rounds):
        results = await asyncio.gather(*(
            stream_timed(http, f"{door}/chat/completions", chat_body(f"{DEFAULT_QUESTION} {n}"), auth)
            for n in range(args.clients)))
        firsts += [first for first, _total, _chunks in results]
    return firsts, time.perf_counter() - started


async def run(args: argparse.Namespace, router: str, daemon: Daemon, door: str) -> bool:
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with asyncio.timeout(RUN_TIMEOUT), httpx.AsyncClient(timeout=30.0, trust_env=False, limits=limits) as http:
        client = await open_client(daemon.socket_path)
        try:
            times = await first_tokens(args, http, door, router, client)
        finally:
            await client.close()
        rates = await relay(args, http, door, router)
        firsts, wall = await concurrent(args, http, door)
    overhead = median(times["door"]) - median(times["direct"])
    print(f"(a) first token, new conversation, {args.runs} samples a path:")
    for path in ("direct", "socket", "door"):
        print(f"    {path:7} median {ms(median(times[path]))}  p90 {ms(p90(times[path]))}")
    print(f"    door over direct {ms(overhead)}; door over the socket's ask "
          f"{ms(median(times['door']) - median(times['socket']))}")
    print(f"(b) relay of {args.words} chunks: door {rates['door']:,.0f}/s, direct {rates['direct']:,.0f}/s")
    print(f"(c) {args.clients} clients at once x {args.rounds}: {args.clients * args.rounds} answers whole in "
          f"{wall:.2f} s; first token median {ms(median(firsts))}, p90 {ms(p90(firsts))}")
    ok = overhead <= TARGET_OVERHEAD
    print(f"target: first token through the door over direct <= {ms(TARGET_OVERHEAD)}: {ms(overhead)} {verdict(ok)}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="first-token samples a path (default 100)")
    parser.add_argument("--warmup", type=int, default=10, help="unrecorded rounds first (default 10)")
    parser.add_argument("--words", type=int, default=1000, help="chunks of the relayed reply (default 1000)")
    parser.add_argument("--relay-runs", type=int, default=5, help="relayed replies a path (default 5)")
    parser.add_argument("--clients", type=int, default=8, help="clients asking at once (default 8)")
    parser.add_argument("--rounds", type=int, default=5, help="times they ask at once (default 5)")
    args = parser.parse_args(argv)
    terminate_on_sigterm()
    header("bench_openai: the OpenAI door's overhead and concurrent clients")
    with contextlib.ExitStack() as stack:
        router = stack.enter_context(fake_router_process())
        work = stack.enter_context(temp_dir("openai"))
        port = free_port()
        settings = {"ASSISTANT_OPENAI_LISTEN": f"127.0.0.1:{port}", "ASSISTANT_OPENAI_KEY": KEY}
        daemon = stack.enter_context(Daemon(work, router, settings=settings))
        asyncio.run(run(args, router, daemon, f"http://127.0.0.1:{port}/v1"))  # a missed target is a finding
    return 0


if __name__ == "__main__":
    sys.exit(main())
