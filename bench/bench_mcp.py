#!/usr/bin/env python3
"""An MCP tool round trip: what the daemon adds over calling the same server with the SDK.

One stdio MCP server (``bench/mcp_echo_server.py``, an ``echo`` tool) runs twice: as the
daemon's hosted server (``[mcp.servers.bench]``), and as a child of this process driven
by the SDK's own client (``stdio_client`` + ``ClientSession``). Both are started and
warmed up before timing. Each sample is a pair, in alternating order:

- direct: ``session.call_tool("echo", ...)``, timed until its result;
- daemon: a turn in which the model (the fake router, scripted in its own process)
  calls ``bench__echo``; timed on the socket from the ``progress`` event that says the
  call is running to the ``tool`` event that reports its result — the daemon's whole
  handling of the call (the toolbox, the host, our stdio framing, the SDK's session,
  the result's conversion) and the relay of one event.

Overhead is the daemon median minus the direct median. Target: 2 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing.connection
import sys
import time
from pathlib import Path

from benchlib import (
    ROOT,
    Daemon,
    header,
    median,
    ms,
    open_client,
    p90,
    router_process,
    temp_dir,
    terminate_on_sigterm,
    verdict,
)

TARGET = 0.002
SERVER = ROOT / "bench" / "mcp_echo_server.py"
TEXT = "the quick brown fox jumps over the lazy dog " * 4


def _tool_router(conn: multiprocessing.connection.Connection, turns: int) -> None:
    """Child process: a FakeRouter whose every turn is one call to bench__echo, then an answer."""
    from selfcheck.fakerouter import FakeRouter, Reply

    call = {"id": "call_1", "name": "bench__echo", "arguments": json.dumps({"text": TEXT})}
    with FakeRouter() as fake:
        for _ in range(turns):
            fake.script(Reply(tool_calls=[call]), Reply(text="done"))
        conn.send(fake.url)
        with contextlib.suppress(EOFError, KeyboardInterrupt):
            conn.recv()


async def daemon_call(client: object, conversation: int | None) -> tuple[float, int]:
    """Seconds from the tool's ``progress`` event to its ``tool`` event, and the conversation."""
    from client import Wire

    assert isinstance(client, Wire)
    request: dict[str, object] = {"type": "ask", "text": "echo it"}
    if conversation is not None:
        request["conversation"] = conversation
    rid = await client.send(request)
    started: float | None = None
    took: float | None = None
    while True:
        event = await client.read()
        if event.get("id") != rid:
            continue
        if event["type"] == "progress" and event.get("stage") == "tool":
            started = time.perf_counter()
        elif event["type"] == "tool":
            assert started is not None and event["ok"], event
            took = time.perf_counter() - started
        elif event["type"] == "done":
            assert took is not None
            return took, event["conversation"]
        elif event["type"] == "error":
            raise RuntimeError(f"the daemon answered with an error: {event}")


async def measure(socket: Path, samples: int, warmup: int) -> tuple[list[float], list[float]]:
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(command=sys.executable, args=[str(SERVER)])
    direct: list[float] = []
    daemon: list[float] = []
    client = await open_client(socket)
    try:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            conversation: int | None = None
            for n in range(warmup + samples):
                order = ("direct", "daemon") if n % 2 else ("daemon", "direct")
                for path in order:
                    if path == "direct":
                        started = time.perf_counter()
                        result = await session.call_tool("echo", {"text": TEXT})
                        took = time.perf_counter() - started
                        assert result.content[0].text == TEXT  # type: ignore[union-attr]
                        if n >= warmup:
                            direct.append(took)
                    else:
                        took, conversation = await daemon_call(client, conversation if n % 20 else None)
                        if n >= warmup:
                            daemon.append(took)
    finally:
        await client.close()
    return direct, daemon


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    terminate_on_sigterm()
    header("MCP tool round trip: through the daemon vs the SDK directly")
    turns = args.samples + args.warmup
    with temp_dir("mcp") as workdir, router_process(_tool_router, turns) as url:
        config = workdir / "config.toml"
        config.write_text(
            f"[mcp.servers.bench]\ncommand = {json.dumps(sys.executable)}\nargs = [{json.dumps(str(SERVER))}]\n"
            'approval = "auto"\n'  # the round trip, not a person's answer, is measured
        )
        with Daemon(workdir, url, settings={"ASSISTANT_CONFIG": str(config)}) as daemon:
            direct, hosted = asyncio.run(measure(daemon.socket_path, args.samples, args.warmup))
    overhead = median(hosted) - median(direct)
    print(f"samples: {len(direct)} pairs (after {args.warmup} warm-up pairs), alternating order")
    print(f"direct (SDK client):  median {ms(median(direct))}, p90 {ms(p90(direct))}")
    print(f"through the daemon:   median {ms(median(hosted))}, p90 {ms(p90(hosted))}")
    print(f"target: overhead {ms(overhead)} median (<= {ms(TARGET)}) {verdict(overhead <= TARGET)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
