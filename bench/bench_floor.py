#!/usr/bin/env python3
"""The floor under ``bench_ttft.py``: what the daemon's hops cost with none of its logic.

``bench_ttft.py`` measures what the daemon adds to a first token. Part of that is the
shape of any daemon like ours, not its code: the question crosses a Unix socket, waits
for one trip to the SQLite thread that stores it, goes out on a connection opened
meanwhile, and the first token comes back through the daemon's process and the socket
again. This benchmark runs that shape alone: a relay process on the daemon's event loop
(uvloop) that, for each ``ask`` line, opens the router connection ahead
(``OneShotTransport.connect_ahead``), stores the question with the daemon's own store
call (``HistoryStore.begin_turn`` through ``AsyncHistory``), sends a ``user`` event, POSTs
a fixed body through the daemon's HTTP client (httpx on ``core.transport``), sends a
``progress`` event once the request is out, and relays each content chunk as a
``delta``. No validation, model list, prompt building, tools or budgets.

Each sample is a pair in alternating order: the relay, and the same body sent directly
(``bench_ttft.direct_ttft``), each timed to its first content. The relay's overhead
is the least the daemon can add on this machine; ``bench_ttft.py``'s overhead minus it
is what the daemon's own code costs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from benchlib import (
    DEFAULT_QUESTION,
    FAKE_MODEL,
    ROOT,
    SYSTEM_PROMPT,
    START_TIMEOUT,
    fake_router_process,
    header,
    median,
    ms,
    p90,
    read_line,
    stop_process,
    temp_dir,
    terminate_on_sigterm,
)
from bench_ttft import direct_ttft  # the direct request as bench_ttft.py times it

from client import Wire
from core.transport import AHEAD, SENT, Client, OneShotTransport
from history import AsyncHistory

RUN_TIMEOUT = 90.0  # the whole measurement, whatever --runs says


def request_body() -> dict[str, Any]:
    """What both paths send: a new conversation's question, streamed."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": DEFAULT_QUESTION}]
    return {"model": FAKE_MODEL, "messages": messages, "stream": True}


def first_content(line: str) -> str | None:
    """The text of a streamed chat chunk line, None for any other line."""
    if not line.startswith("data: {"):
        return None
    choices = json.loads(line[6:]).get("choices") or ()
    return (choices[0].get("delta") or {}).get("content") if choices else None


# -- the relay (a child process) -------------------------------------------------------------


async def relay(socket_path: str, url: str, db: Path) -> None:
    transport = OneShotTransport()
    http = Client(transport=transport, timeout=10.0)
    history = await AsyncHistory.open(db)
    chat = httpx.URL(f"{url}/chat/completions")
    body = request_body()

    async def one(ask: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        def event(value: dict[str, Any]) -> None:
            writer.write(json.dumps({**value, "id": ask["id"]}).encode() + b"\n")

        transport.connect_ahead(str(chat))
        question = {"role": "user", "content": ask["text"]}
        turn, _context = await history.run(
            lambda s: s.begin_turn(None, ask["text"], [question], [], FAKE_MODEL, ask["text"][:40])
        )
        where = {"conversation": turn.conversation_id, "turn": turn.turn}
        event({"type": "user", **where, "text": ask["text"], "files": []})
        sent = {AHEAD: True, SENT: lambda: event({"type": "progress", **where, "stage": "waiting", "detail": "waiting"})}
        async with http.stream("POST", chat, json=body, extensions=sent) as response:
            async for line in response.aiter_lines():
                if text := first_content(line):
                    event({"type": "delta", **where, "text": text})
        event({"type": "done", **where})

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            await one(json.loads(line), writer)

    async with await asyncio.start_unix_server(client, socket_path):
        print("ready", flush=True)
        await asyncio.Event().wait()


def run_relay(argv: list[str]) -> None:
    from daemon.server import new_event_loop  # the daemon's loop: uvloop's where installed

    socket_path, url, db = argv
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(relay(socket_path, url, Path(db)))


# -- the measurement -------------------------------------------------------------------------


async def relay_ttft(client: Wire) -> float:
    first: float | None = None
    started = time.perf_counter()
    rid = await client.send({"type": "ask", "text": DEFAULT_QUESTION})
    while (event := await client.read())["type"] != "done" or event.get("id") != rid:
        if event["type"] == "delta" and first is None:
            first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("the relay sent no delta")
    return first


async def measure(url: str, socket_path: Path, runs: int, warmup: int) -> tuple[list[float], list[float]]:
    direct: list[float] = []
    relayed: list[float] = []
    chat = httpx.URL(f"{url}/chat/completions")
    body = request_body()
    async with asyncio.timeout(RUN_TIMEOUT), Client(transport=OneShotTransport(), timeout=10.0) as http:
        client = await Wire.open(socket_path, keep=False)
        try:
            for i in range(warmup + runs):
                if i % 2 == 0:  # alternate which path goes first: neither always meets a warmer cache
                    straight, _ = await direct_ttft(http, chat, body)
                    through = await relay_ttft(client)
                else:
                    through = await relay_ttft(client)
                    straight, _ = await direct_ttft(http, chat, body)
                if i >= warmup:
                    direct.append(straight)
                    relayed.append(through)
        finally:
            await client.close()
    return direct, relayed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--relay"]:
        run_relay(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="samples per path (default 200)")
    parser.add_argument("--warmup", type=int, default=10, help="unrecorded pairs first (default 10)")
    args = parser.parse_args(argv)
    terminate_on_sigterm()
    header("bench_floor: the daemon's hops, none of its logic, on time to first token")
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(fake_router_process())
        work = stack.enter_context(temp_dir("floor"))
        socket_path = work / "relay.sock"
        proc = subprocess.Popen(
            [sys.executable, __file__, "--relay", str(socket_path), url, str(work / "history.db")],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )
        stack.callback(stop_process, proc)
        if (said := read_line(proc, START_TIMEOUT)) != "ready":
            raise RuntimeError(f"the relay printed {said!r} instead of ready")
        direct, relayed = asyncio.run(measure(url, socket_path, args.runs, args.warmup))
    print(f"samples: {args.runs} per path (after {args.warmup} warm-up pairs); question {DEFAULT_QUESTION!r}")
    print(f"{'path':8} {'median':>10} {'p90':>10}")
    print(f"{'direct':8} {ms(median(direct)):>10} {ms(p90(direct)):>10}")
    print(f"{'relay':8} {ms(median(relayed)):>10} {ms(p90(relayed)):>10}")
    print(f"floor: the relay's overhead, median {ms(median(relayed) - median(direct))} "
          "(compare bench_ttft.py's new-conversation overhead)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
