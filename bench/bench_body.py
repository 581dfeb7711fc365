#!/usr/bin/env python3
"""A chat request's body with photos: the event loop's time to make it, httpx's ``json=``
against ours (``core.router.json_content``: each long data URL a piece of its own).

A prompt replays every image of its conversation on every turn, as a data URL of the file
as it was sent (a PNG photo within 2048 px goes as it is). ``--images`` such URLs of
``--size`` MB of random base64 each are put in one request; each sample builds the request
as httpx sends it through the daemon's transport: httpx's ``json=`` encodes the whole body
and the transport joins it to the head; ours encodes the text around the URLs and writes
the URLs as they are. Median and p90 of ``--runs`` samples each way, alternating.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import time
from typing import Any

import httpx
from benchlib import header, median, ms, p90

from core.router import json_content

URL = "http://127.0.0.1:8080/v1/chat/completions"


def body_of(images: int, size_mb: float) -> dict[str, Any]:
    raw = os.urandom(int(size_mb * 1024 * 1024 * 3 / 4))
    urls = ["data:image/png;base64," + base64.b64encode(raw[n:] + raw[:n]).decode() for n in range(images)]
    content = [{"type": "text", "text": "and these?"}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "vision", "messages": [{"role": "user", "content": content}], "stream": True}


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
    parser.add_argument("--images", type=int, default=8, help="data URLs in the prompt (default 8)")
    parser.add_argument("--size", type=float, default=9.7, help="MB of base64 each (default 9.7: a 7.3 MB PNG)")
    parser.add_argument("--runs", type=int, default=10, help="samples each way (default 10)")
    args = parser.parse_args(argv)
    header("bench_body: a request with photos, made on the event loop")
    body = body_of(args.images, args.size)
    theirs, mine = [], []
    for n in range(args.runs):
        pair = (httpx_json, ours) if n % 2 == 0 else (ours, httpx_json)
        for make in pair:
            (theirs if make is httpx_json else mine).append(make(body))
    print(f"body: {args.images} data URLs of {args.size:g} MB; {args.runs} samples each way")
    print(f"httpx json=          median {ms(median(theirs))}  p90 {ms(p90(theirs))}")
    print(f"json_content pieces  median {ms(median(mine))}  p90 {ms(p90(mine))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
