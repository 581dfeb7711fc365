#!/usr/bin/env python3
"""A chat request's body: the event loop's time to make it, httpx's ``json=`` against ours
(``core.router.json_content``).

Photos: a prompt replays every image of its conversation on every turn, as a data URL of
the file as it was sent (a PNG photo within 2048 px goes as it is). ``--images`` such URLs
of ``--size`` MB of random base64 each are put in one request; each sample builds the
``httpx.Request`` with its body: httpx's ``json=`` encodes the whole body; ours encodes
the text around the URLs and writes the URLs as they are.

Text: ``--turns`` replayed turns (a question of 200 characters, a reply of ``--reply``)
and a new question.  httpx's ``json=`` encodes them all; ours too with nothing encoded
earlier, and with the replayed turns given as an ``EncodedPrefix``, made as
``daemon/replay.py`` makes it (each turn's JSON once, when it was first replayed; the
prefix joined per prompt, which is timed), after checking that it is httpx's very JSON.
Samples are taken ``GAP`` apart, as a daemon between two questions: what is measured is
the cold cost a question pays before its first token.  Target: ours at 2,000 turns of
300-character replies within 3 ms (median).

Median and p90 of ``--runs`` samples each way, alternating.
"""

from __future__ import annotations

import argparse
import base64
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from benchlib import SYSTEM_PROMPT, header, median, ms, p90, verdict

from core.jsontext import EncodedPrefix, json_body
from core.router import json_content
from daemon.replay import ReplayCache, ReplayedTurn, encoded_prefix

URL = "http://127.0.0.1:8080/v1/chat/completions"
GAP = 0.005  # seconds between text samples: the caches a question meets are not warm
TARGET = 0.003  # seconds, median: ours with the turns encoded, at 2,000 turns of 300-character replies
TARGET_TURNS, TARGET_REPLY = 2000, 300
SYSTEM = [{"role": "system", "content": SYSTEM_PROMPT}]


def body_of(images: int, size_mb: float) -> dict[str, Any]:
    raw = os.urandom(int(size_mb * 1024 * 1024 * 3 / 4))
    urls = ["data:image/png;base64," + base64.b64encode(raw[n:] + raw[:n]).decode() for n in range(images)]
    content = [{"type": "text", "text": "and these?"}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "vision", "messages": [{"role": "user", "content": content}], "stream": True}


def conversation_of(turns: int, reply_chars: int) -> tuple[dict[str, Any], list[ReplayedTurn]]:
    """The body of the next question, and its replayed turns as the daemon's replay cache holds them."""
    words = "the quick brown fox jumps over the lazy dog, \u00e9t\u00e9 \u2603 "
    exchanges = [
        (n + 1, [{"role": "user", "content": f"question {n}: " + (words * 5)[:200]},
                 {"role": "assistant", "content": f"answer {n}: " + (words * (reply_chars // len(words) + 1))[:reply_chars]}])
        for n in range(turns)
    ]
    cache = ReplayCache(lambda messages, image_tokens: 0)
    entry = cache.start(1, None, (1 << 30, False, 0))  # a context nothing is cut to fit
    cache.add(entry, exchanges, turns, 1 << 30)
    messages = [*SYSTEM, *(m for turn in entry.turns for m in turn.sent or ()), {"role": "user", "content": "and now?"}]
    body = {"model": "m", "messages": messages, "stream": True, "stream_options": {"include_usage": True}}
    return body, entry.turns


def httpx_json(body: dict[str, Any]) -> float:
    started = time.perf_counter()
    httpx.Request("POST", URL, json=body).read()
    return time.perf_counter() - started


def ours(body: dict[str, Any], turns: Sequence[ReplayedTurn] | None = None) -> float:
    """``json_content`` of the body; with ``turns``, their prefix made first, as the daemon does per prompt."""
    started = time.perf_counter()
    encoded: EncodedPrefix | None = encoded_prefix(SYSTEM, turns) if turns is not None else None
    httpx.Request("POST", URL, **json_content(body, encoded))
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8, help="data URLs in the photos' prompt (default 8; 0: none)")
    parser.add_argument("--size", type=float, default=9.7, help="MB of base64 each (default 9.7: a 7.3 MB PNG)")
    parser.add_argument("--turns", type=int, default=200, help="replayed turns in the text prompt (default 200; 0: none)")
    parser.add_argument("--reply", type=int, default=1500, help="characters of each replayed reply (default 1500)")
    parser.add_argument("--runs", type=int, default=10, help="samples each way (default 10; text: 20x that)")
    args = parser.parse_args(argv)
    header("bench_body: a chat request's body, made on the event loop")
    if args.images:
        photos = body_of(args.images, args.size)
        print(f"photos: {args.images} data URLs of {args.size:g} MB; {args.runs} samples each way")
        show(compare([("httpx json=", functools.partial(httpx_json, photos)),
                      ("json_content", functools.partial(ours, photos))], args.runs, 0.0))
    if args.turns:
        body, turns = conversation_of(args.turns, args.reply)
        runs = args.runs * 20
        plain = httpx.Request("POST", URL, json=body).read()
        if b"".join(json_body(body, encoded_prefix(SYSTEM, turns))) != plain:
            raise AssertionError("json_body with the turns encoded is not the JSON httpx makes")
        size = len(plain)
        print(f"text: {args.turns} replayed turns, replies of {args.reply} characters ({size / 1e6:.2f} MB of JSON); "
              f"{runs} samples each way, {GAP * 1e3:g} ms apart")
        samples = compare([("httpx json=", functools.partial(httpx_json, body)),
                           ("json_content, nothing encoded", functools.partial(ours, body)),
                           ("json_content, turns encoded", functools.partial(ours, body, turns))], runs, GAP)
        show(samples)
        if (args.turns, args.reply) == (TARGET_TURNS, TARGET_REPLY):
            took = median(samples["json_content, turns encoded"])
            print(f"target: json_content with the turns encoded at {args.turns} turns median <= {ms(TARGET)}: "
                  f"{ms(took)} {verdict(took <= TARGET)}")
    return 0


Way = tuple[str, Callable[[], float]]


def compare(ways: list[Way], runs: int, gap: float) -> dict[str, list[float]]:
    """``runs`` samples each way, the order turned round each time; ``gap`` seconds before each."""
    samples: dict[str, list[float]] = {name: [] for name, _ in ways}
    for n in range(runs):
        for name, make in ways[n % len(ways):] + ways[:n % len(ways)]:
            time.sleep(gap)
            samples[name].append(make())
    return samples


def show(samples: dict[str, list[float]]) -> None:
    for name, times in samples.items():
        print(f"  {name:30} median {ms(median(times))}  p90 {ms(p90(times))}")


if __name__ == "__main__":
    sys.exit(main())
