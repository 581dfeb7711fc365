#!/usr/bin/env python3
"""A follow-up asked right after a new conversation's first reply, against a real llama-server.

After the first reply the daemon asks the model for the conversation's title (``auto_title``).
The title request holds the server's copy of the conversation (its slot) for a few tokens;
a follow-up sent beside it can land on another slot and be read from its first token. The
daemon makes such a follow-up wait for the title (``TurnRunner._titling``). This prints the
follow-up's time to first token with titles off, and on.

llama-server with SmolLM2 135M (``scripts/llama.py``, compiled once like ``bench_e2e.py``)
runs on a free loopback port, ``--temp 0``. Each sample: a new conversation with a long
system prompt (``--rules`` lines, about 12 tokens each), its first question answered, then
at once a follow-up in it, timed from the ``ask`` line to its first ``delta``; ``--pause``
seconds between samples. Not part of ``make bench``: it needs the compiled server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time

from benchlib import ROOT, Daemon, header, median, ms, open_client, temp_dir, terminate_on_sigterm

sys.path.insert(0, str(ROOT))
from tests.e2e.realserver import llama  # noqa: E402  (scripts/llama.py, loaded by path)


def system_prompt(rules: int) -> str:
    return "You are a helpful assistant. " + " ".join(
        f"Rule {n}: answer briefly and name colours plainly." for n in range(rules)
    )


async def follow_ups(daemon: Daemon, runs: int, system: str, pause: float) -> list[float]:
    """Seconds from each follow-up's ``ask`` to its first ``delta``."""
    client = await open_client(daemon.socket_path)
    times = []
    try:
        for n in range(runs):
            first = await client.ask(f"Name a colour, number {n}.", system=system)
            cid = first[-1]["conversation"]
            started = time.perf_counter()
            rid = await client.send({"type": "ask", "text": "And another one?", "conversation": cid})
            ttft = None
            async with contextlib.aclosing(client.stream(rid)) as events:
                async for event in events:
                    if event["type"] == "delta" and ttft is None:
                        ttft = time.perf_counter() - started
                    if event["type"] in ("done", "error"):
                        break
            if ttft is None:
                raise RuntimeError(f"the follow-up had no reply: {event}")
            times.append(ttft)
            await asyncio.sleep(pause)
    finally:
        await client.close()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8, help="follow-ups per setting (default 8)")
    parser.add_argument("--rules", type=int, default=120, help="lines of system prompt (default 120: ~1,500 tokens)")
    parser.add_argument("--pause", type=float, default=1.5, help="seconds between samples (default 1.5)")
    args = parser.parse_args(argv)
    terminate_on_sigterm()
    header("bench_follow_up: a follow-up right after the first reply, titles off and on")
    state = llama.install()
    with llama.running_server(state, extra=("--temp", "0")) as server:
        for auto_title in ("false", "true"):
            with contextlib.ExitStack() as stack:
                work = stack.enter_context(temp_dir("follow-up"))
                daemon = stack.enter_context(Daemon(work, server.v1, settings={"ASSISTANT_AUTO_TITLE": auto_title}))
                times = asyncio.run(follow_ups(daemon, args.runs, system_prompt(args.rules), args.pause))
            slowest = sorted(times)
            print(f"auto_title={auto_title:5}  follow-up first token: median {ms(median(times))}, "
                  f"min {ms(slowest[0])}, max {ms(slowest[-1])}  ({len(times)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
