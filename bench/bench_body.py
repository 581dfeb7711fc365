#!/usr/bin/env python3
"""A chat request's body: the event loop's time to make it, httpx's ``json=`` against ours
(``core.router.json_content``).

Photos: a prompt replays every image of its conversation on every turn, as a data URL of
the file as it was sent (a PNG photo within 2048 px goes as it is). ``--images`` such URLs
of ``--size`` MB of random base64 each are put in one request; each sample builds the
request as httpx sends it through the daemon's transport: httpx's ``json=`` encodes the
whole body and the transport joins it to the head; ours encodes the text around the URLs
and writes the URLs as they are.

Text: ``--turns`` replayed turns (a question of 200 characters, a reply of ``--reply``)
and a new question.  httpx's ``json=`` encodes them all; ours splices the JSON text the
replay cache made once per turn (``core.jsontext.FrozenJSON``).  Samples are taken
``GAP`` apart, as a daemon between two questions: what is measured is the cold cost a
question pays before its first token.

Median and p90 of ``--runs`` samples each way, alternating.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
from benchlib import header, median, ms, p90

from core.jsontext import FrozenJSON, json_parts
from core.router import json_content

URL = "http://127.0.0.1:8080/v1/chat/completions"
GAP = 0.005  # seconds between text samples: the caches a question meets are not warm


def body_of(images: int, size_mb: float) -> dict[str, Any]:
    raw = os.urandom(int(size_mb * 1024 * 1024 * 3 / 4))
    urls = ["data:image/png;base64," + base64.b64encode(raw[n:] + raw[:n]).decode() for n in range(images)]
    content = [{"type": "text", "text": "and these?"}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "vision", "messages": [{"role": "user", "content": content}], "stream": True}


def conversation_of(turns: int, reply_chars: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same body twice: plain messages, and the replayed ones frozen as the replay cache holds them."""
    words = "the quick brown fox jumps over the lazy dog, \u00e9t\u00e9 \u2603 "
    messages = []
    for n in range(turns):
        messages += [{"role": "user", "content": f"question {n}: " + (words * 5)[:200]},
                     {"role": "assistant", "content": f"answer {n}: " + (words * (reply_chars // len(words) + 1))[:reply_chars]}]
    question = {"role": "user", "content": "and now?"}
    plain = {"model": "m", "messages": [*messages, question], "stream": True}
    frozen = {**plain, "messages": [*(FrozenJSON(m) for m in messages), question]}
    return plain, frozen


def httpx_json(body: dict[str, Any]) -> float:
    started = time.perf_counter()
    request = httpx.Request("POST", URL, json=body)
    _ = b"POST head" + request.read()  # the transport wrote head and body in one piece
    return time.perf_counter() - started


def ours(body: dict[str, Any]) -> float:
    started = time.perf_counter()
    httpx.Request("POST", URL, **json_content(body))
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
        body = body_of(args.images, args.size)
        print(f"photos: {args.images} data URLs of {args.size:g} MB; {args.runs} samples each way")
        show(compare([("httpx json=", httpx_json, body), ("json_content pieces", ours, body)], args.runs, 0.0))
    if args.turns:
        plain, frozen = conversation_of(args.turns, args.reply)
        runs = args.runs * 20
        size = sum(map(len, json_parts(frozen)))
        print(f"text: {args.turns} replayed turns, replies of {args.reply} characters ({size / 1e6:.2f} MB of JSON); "
              f"{runs} samples each way, {GAP * 1e3:g} ms apart")
        show(compare([("httpx json=", httpx_json, plain), ("json_content, nothing frozen", ours, plain),
                      ("json_content, turns frozen", ours, frozen)], runs, GAP))
    return 0


Way = tuple[str, Callable[[dict[str, Any]], float], dict[str, Any]]


def compare(ways: list[Way], runs: int, gap: float) -> dict[str, list[float]]:
    """``runs`` samples each way, the order turned round each time; ``gap`` seconds before each."""
    samples: dict[str, list[float]] = {name: [] for name, _, _ in ways}
    for n in range(runs):
        for name, make, body in ways[n % len(ways):] + ways[:n % len(ways)]:
            time.sleep(gap)
            samples[name].append(make(body))
    return samples


def show(samples: dict[str, list[float]]) -> None:
    for name, times in samples.items():
        print(f"  {name:30} median {ms(median(times))}  p90 {ms(p90(times))}")


if __name__ == "__main__":
    sys.exit(main())
