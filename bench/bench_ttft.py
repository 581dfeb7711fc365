#!/usr/bin/env python3
"""Time to first token: what the daemon adds over talking to the router directly.

The fake router (``python -m selfcheck.fakerouter``, its own process) answers every
stream with its default reply, an echo of the question in word chunks, so each
request is answered identically.  Each sample is a pair, in alternating order:

- direct: a streaming POST to ``/v1/chat/completions`` from a plain
  ``httpx.AsyncClient`` with the daemon's very request body, encoded as the daemon
  encodes it (``core.router.json_content``, nothing encoded earlier: a client sending
  its prompt encodes all of it) and with its ``Connection: close``, timed until the
  first content chunk;
- daemon: an ``ask`` line on the socket, timed until the first ``delta`` event.

The direct body is the daemon's last request in that conversation (the fake serves
it at ``/debug/last-chat``) extended by the answer and the new question: exactly what
a cache-friendly daemon sends next.  Each daemon request is checked against that
prediction and the mismatches are counted (0 expected: a mismatch is a prompt the
model server could not reuse).

Two cases: (a) a new conversation; (b) conversations with ``--history`` turns
already stored (written through ``HistoryStore`` before the daemon starts; the
samples are spread over ``--conversations`` of them, each visited once unrecorded
first, when the daemon compacts it).  Overhead is the daemon median minus the direct
median.  Budget: 5 ms for a new conversation and at 200 turns, 10 ms from 2,000 turns
on, judged as the range over several runs.  ``--old-model-list`` cuts the daemon's
``MODELS_TTL`` to ``OLD_LIST_TTL`` and puts pairs that far apart, so each question finds
the model list old, as one after a minute's pause does: the list is fetched again
before the turn, and the overhead includes that. ``--new-questions`` makes every ask a new
question ("Tell me about my item zqNx.", its last word new each time), so no stored question
asks it again and the search of other conversations ranks every stored one holding "item" (each
says something of the user, "my item": history/fts.py ``only_asks``), and recalls three;
the direct body is then the daemon's own request, sent after it (what recall added to it
is not predicted, so prompts are not checked).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import string
import sys
import time
from dataclasses import dataclass, field
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
    print_profile,
    profile_prefix,
    temp_dir,
    terminate_on_sigterm,
    verdict,
    write_history,
)

from client import Wire
from core.router import json_content

TARGET_OVERHEAD = 0.005  # seconds, median: a new conversation, and 200 turns of history
TARGET_LONG = 0.010  # seconds, median, from LONG_HISTORY turns on
LONG_HISTORY = 2000
VERBOSE = False
RUN_TIMEOUT = 90.0  # the whole measurement, whatever --runs says
# --old-model-list: the daemon's list trusted this long, and pairs this far apart, so that each
# question finds it old once, as after a pause (not twice, as a TTL of 0 would: a turn in a
# conversation asks for its model again once the question is stored)
OLD_LIST_TTL = 0.05
# interpreter arguments that run the daemon (the script named next) with that TTL
OLD_MODEL_LIST = ["-c", f"import runpy, sys; import core.router; core.router.MODELS_TTL = {OLD_LIST_TTL}; "
                  "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"]


@dataclass
class Samples:
    """First-token times of one case, both paths, in seconds."""

    name: str
    direct: list[float] = field(default_factory=list)
    daemon: list[float] = field(default_factory=list)
    # from the send to the moment the fake had read the request's body: the daemon's own part
    direct_to_router: list[float] = field(default_factory=list)
    daemon_to_router: list[float] = field(default_factory=list)

    @property
    def overhead(self) -> float:
        return median(self.daemon) - median(self.direct)


async def direct_ttft(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[float, float]:
    """Seconds from the POST to the first content chunk (the body is read to its end), and
    the wall-clock time of the POST."""
    first: float | None = None
    wall = time.time()
    started = time.perf_counter()
    content = json_content(body)  # as the daemon sends it, and so timed
    content["headers"]["Connection"] = "close"
    async with http.stream("POST", url, **content) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or ()
                if choices and (choices[0].get("delta") or {}).get("content"):
                    first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("the router's reply had no content chunk")
    return first, wall


async def last_request(http: httpx.AsyncClient, url: str) -> tuple[dict[str, Any], float]:
    """The body of the last chat request, as the fake received it, and when it had it."""
    # not kept: a direct chat request connects anew, as each of the daemon's does
    response = await http.get(f"{url}/debug/last-chat", headers={"Connection": "close"})
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    body.pop("path", None)
    return body, float(body.pop("_arrived"))


def next_body(last: dict[str, Any], reply: str, question: str) -> dict[str, Any]:
    """What a daemon that keeps its prompt's prefix sends after ``last`` was answered with ``reply``."""
    messages = [*last["messages"], {"role": "assistant", "content": reply}, {"role": "user", "content": question}]
    return {**last, "messages": messages}


async def daemon_ttft(client: Wire, question: str, conversation: int | None) -> tuple[float, str, float]:
    """Seconds from the ask line to the first ``delta`` (then it reads through ``done``), the
    reply, and the wall-clock time of the ask."""
    request: dict[str, Any] = {"type": "ask", "text": question}
    if conversation is not None:
        request["conversation"] = conversation
    first: float | None = None
    wall = time.time()
    started = time.perf_counter()
    rid = await client.send(request)
    while True:
        event = await client.read()
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
    return first, event["text"], wall


@dataclass
class Conversations:
    """The conversations a case asks in, and the next body each one's direct request sends."""

    ids: list[int | None]
    bodies: dict[int | None, dict[str, Any]] = field(default_factory=dict)
    mismatches: int = 0
    new_questions: random.Random | None = None  # --new-questions: each ask's new word drawn here

    def new(self) -> bool:
        return self.ids == [None]

    def question(self) -> str:
        if self.new_questions is None:
            return DEFAULT_QUESTION
        return f"Tell me about my item {''.join(self.new_questions.choices(string.ascii_letters, k=4))}."

    def predicted(self, cid: int | None, actual: dict[str, Any], reply: str) -> dict[str, Any] | None:
        """The next direct body for ``cid`` after ``actual`` was answered with ``reply``; None when it
        is the daemon's own request, sent after it (a new conversation's, or a new question's)."""
        if self.new_questions is not None:
            return None
        return actual if self.new() else next_body(actual, reply, DEFAULT_QUESTION)


async def measure(
    samples: Samples | None, runs: int, http: httpx.AsyncClient, url: str, client: Wire, convs: Conversations,
    pause: float,
) -> None:
    """``runs`` pairs (direct, daemon), ``pause`` seconds apart; ``samples`` None is a warm-up
    (it also learns each body)."""
    chat = f"{url}/chat/completions"
    for i in range(runs):
        await asyncio.sleep(pause)
        cid = convs.ids[i % len(convs.ids)]
        body = convs.bodies.get(cid)
        question = convs.question()
        direct: tuple[float, float] | None = None
        if body is not None and i % 2 == 0:  # alternate which path goes first: neither always meets a warmer cache
            direct = await direct_ttft(http, chat, body)
            direct_arrived = (await last_request(http, url))[1]
        through, reply, asked = await daemon_ttft(client, question, cid)
        actual, daemon_arrived = await last_request(http, url)
        if direct is None and (body is not None or convs.new_questions is not None):
            direct = await direct_ttft(http, chat, actual)
            direct_arrived = (await last_request(http, url))[1]
        if body is not None and actual != body:
            convs.mismatches += 1
            if VERBOSE:
                diff = next((n for n, (a, b) in enumerate(zip(actual["messages"], body["messages"])) if a != b), None)
                print("mismatch", cid, diff, len(actual["messages"]), len(body["messages"]),
                      {k for k in actual if actual[k] != body.get(k)}, file=sys.stderr)
        if (predicted := convs.predicted(cid, actual, reply)) is not None:
            convs.bodies[cid] = predicted
        if samples is not None and direct is not None:
            samples.direct.append(direct[0])
            samples.daemon.append(through)
            samples.direct_to_router.append(direct_arrived - direct[1])
            samples.daemon_to_router.append(daemon_arrived - asked)


async def run(args: argparse.Namespace, url: str, daemon: Daemon, histories: list[int]) -> list[tuple[Samples, Conversations]]:
    drawn = random.Random(1) if args.new_questions else None
    cases = [
        (Samples("(a) new conversation"), Conversations([None], new_questions=drawn)),
        (Samples(f"(b) {args.history} turns of history"), Conversations(list(histories), new_questions=drawn)),
    ]
    pause = OLD_LIST_TTL if args.old_model_list else 0.0
    async with asyncio.timeout(RUN_TIMEOUT), httpx.AsyncClient(timeout=10.0, trust_env=False) as http:
        client = await open_client(daemon.socket_path)
        try:
            for samples, convs in cases:
                await measure(None, len(convs.ids) + args.warmup, http, url, client, convs, pause)
                convs.mismatches = 0  # a first ask may compact: only the measured ones count
                await measure(samples, args.runs, http, url, client, convs, pause)
        finally:
            await client.close()
    return cases


def report(args: argparse.Namespace, cases: list[tuple[Samples, Conversations]]) -> bool:
    asked = "a new one each ask, 'Tell me about my item zqNx.'" if args.new_questions else repr(DEFAULT_QUESTION)
    print(f"samples: {args.runs} per path and case (after warm-up pairs); question {asked}")
    print(f"{'case':34} {'direct med':>12} {'direct p90':>12} {'daemon med':>12} {'daemon p90':>12} {'overhead med':>13} {'overhead p90':>13}")
    ok = True
    target_b = TARGET_LONG if args.history >= LONG_HISTORY else TARGET_OVERHEAD
    for (s, convs), target in zip(cases, (TARGET_OVERHEAD, target_b)):
        over_p90 = p90(s.daemon) - p90(s.direct)
        print(
            f"{s.name:34} {ms(median(s.direct)):>12} {ms(p90(s.direct)):>12} {ms(median(s.daemon)):>12} "
            f"{ms(p90(s.daemon)):>12} {ms(s.overhead):>13} {ms(over_p90):>13}"
        )
        ok = ok and s.overhead <= target and convs.mismatches == 0
    print("to the router (until the fake had read the request's body; the rest is the reply's way back):")
    for s, _convs in cases:
        print(f"  {s.name:32} direct {ms(median(s.direct_to_router))}, daemon {ms(median(s.daemon_to_router))} "
              f"(the daemon's own part: {ms(median(s.daemon_to_router) - median(s.direct_to_router))})")
    for (s, convs), target in zip(cases, (TARGET_OVERHEAD, target_b)):
        print(f"target: {s.name} overhead median <= {ms(target)}: {ms(s.overhead)} {verdict(s.overhead <= target)}")
        if not args.new_questions:  # then each direct body is the daemon's own request: nothing to check
            print(f"target: {s.name} prompts that extend the last one: {args.runs - convs.mismatches}/{args.runs} "
                  f"{verdict(convs.mismatches == 0)}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="samples per path and case (default 200)")
    parser.add_argument("--warmup", type=int, default=10, help="unrecorded pairs before each case (default 10)")
    parser.add_argument("--history", type=int, default=200, help="turns of history in case (b) (default 200; try 2000)")
    parser.add_argument(
        "--conversations", type=int, default=20,
        help="case (b) spreads its samples over this many such conversations (default 20)",
    )
    parser.add_argument("--profile", action="store_true", help="run the daemon under cProfile and print its hot spots")
    parser.add_argument(
        "--old-model-list", action="store_true",
        help="the daemon's model list older than MODELS_TTL at every question (a question after a pause)",
    )
    parser.add_argument("--new-questions", action="store_true",
                        help="a new question each ask ('Tell me about my item zqNx.'), none asked before")
    args = parser.parse_args(argv)
    if args.profile and args.old_model_list:
        parser.error("--profile and --old-model-list each run the daemon their own way; pick one")
    terminate_on_sigterm()
    header("bench_ttft: daemon overhead on time to first token")
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(fake_router_process())
        work = stack.enter_context(temp_dir("ttft"))
        built = time.perf_counter()
        histories = list(write_history(work / "data" / "history.db", args.conversations, args.history))
        print(f"history: {args.conversations} conversations x {args.history} turns written in {time.perf_counter() - built:.2f} s")
        profile = work / "daemon.prof"
        prefix = profile_prefix(profile) if args.profile else OLD_MODEL_LIST if args.old_model_list else ()
        daemon = stack.enter_context(Daemon(work, url, prefix=prefix))
        results = asyncio.run(run(args, url, daemon, histories))
        report(args, results)
        if args.profile:
            daemon.stop()
            print_profile(profile)  # a missed target is a finding, not a failure of the benchmark
    return 0


if __name__ == "__main__":
    sys.exit(main())
