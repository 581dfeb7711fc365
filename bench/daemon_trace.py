#!/usr/bin/env python3
"""Run the daemon with a stopwatch on each stage of a question's way to its first token.

``python bench/daemon_trace.py assistant.py`` (``bench_ttft.py --trace`` starts the daemon
so): it wraps a few of the daemon's methods, and for every ``ask`` line notes when each
stage was first reached, in nanoseconds from the moment the line was read (its own cost
included: a few microseconds a stage), and when Python's cyclic garbage collector ran and
for how long. On exit it writes one JSON line per ask to the file named by ``TTFT_TRACE``:
``{"stages": {name: ns}, "gc": [[generation, start, duration, freed], ...]}``, the
collections from that ask's line to the next ask's, their start counted from the line (in
ns, as the stages), ``freed`` the objects they freed.

The wrapped names are the daemon's internals: one renamed makes this script fail at start,
saying which (the benchmark then fails at its first ask).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import runpy
import sys
import time
from collections.abc import Callable
from typing import Any

STAGES = (  # (stage, what it marks), in the order a plain question reaches them
    ("line", "the ask line read"),
    ("handler", "its request task started"),
    ("connecting", "the connection to the router opened ahead"),
    ("connect sent", "its connect under way"),
    ("store", "the question handed to the history thread"),
    ("store runs", "the history thread starts on it"),
    ("store done", "the history thread is done"),
    ("stored", "the event loop has the answer"),
    ("user", "the user event sent"),
    ("prompt", "the prompt being built"),
    ("prompt built", "the prompt built"),
    ("to httpx", "the request handed to httpx"),
    ("written", "the request written to the router"),
    ("answer head", "the router's answer begun"),
    ("first chunk", "its first body bytes read"),
    ("delta", "the first delta sent to the client"),
)

now = time.perf_counter_ns
asks: list[dict[str, Any]] = []  # per ask: {"stages": {...}, "gc": [...]}
current: dict[str, Any] | None = None
gc_started = 0


def mark(stage: str) -> None:
    if current is not None and stage not in current["stages"]:
        current["stages"][stage] = now() - current["at"]


def on_gc(phase: str, info: dict[str, Any]) -> None:
    global gc_started
    if phase == "start":
        gc_started = now()
    elif current is not None:
        current["gc"].append([info["generation"], gc_started - current["at"], now() - gc_started, info["collected"]])


def wrap(owner: Any, name: str, before: str | None = None, after: str | None = None) -> None:
    """Mark ``before`` as ``owner.name`` is called and ``after`` as it returns (or, for a
    coroutine function, as the awaited call returns)."""
    original = getattr(owner, name, None)
    if original is None:
        sys.exit(f"daemon_trace: {owner.__name__}.{name} is gone; update bench/daemon_trace.py")
    import inspect

    if inspect.iscoroutinefunction(original):
        async def traced_async(*args: Any, **kwargs: Any) -> Any:
            if before:
                mark(before)
            result = await original(*args, **kwargs)
            if after:
                mark(after)
            return result

        setattr(owner, name, traced_async)
        return

    def traced(*args: Any, **kwargs: Any) -> Any:
        if before:
            mark(before)
        result = original(*args, **kwargs)
        if after:
            mark(after)
        return result

    setattr(owner, name, traced)


def install() -> None:
    import core.router
    import core.transport
    import daemon.connection
    import daemon.context
    import daemon.runner
    import history.aio

    connection = daemon.connection.Connection
    start, send = connection._start, connection.send

    def started(self: Any, line: bytes) -> None:
        global current
        if b'"ask"' in line:
            current = {"at": now(), "stages": {"line": 0}, "gc": []}
            asks.append(current)
        start(self, line)

    def sent(self: Any, event: dict[str, Any]) -> None:
        if event.get("type") in ("user", "delta"):
            mark(event["type"])
        send(self, event)

    connection._start, connection.send = started, sent  # type: ignore[method-assign]
    wrap(daemon.runner.TurnRunner, "run", before="handler")
    wrap(core.router.RouterClient, "connect_ahead", before="connecting", after="connect sent")
    wrap(history.aio.AsyncHistory, "run", after="stored")
    wrap(daemon.context.ContextBuilder, "build", before="prompt", after="prompt built")

    submit = history.aio.HistoryThread.submit

    def submitted(self: Any, fn: Callable[[], Any]) -> Any:
        mark("store")

        def traced() -> Any:
            mark("store runs")
            try:
                return fn()
            finally:
                mark("store done")

        return submit(self, traced)

    history.aio.HistoryThread.submit = submitted  # type: ignore[method-assign]
    stream_chat = core.router.RouterClient.stream_chat

    def streaming(self: Any, *args: Any, sent: Callable[[], None] | None = None, **kwargs: Any) -> Any:
        mark("to httpx")

        def written() -> None:
            mark("written")
            if sent is not None:
                sent()

        return stream_chat(self, *args, sent=written, **kwargs)

    core.router.RouterClient.stream_chat = streaming  # type: ignore[method-assign]
    wrap(core.transport, "_read_head", after="answer head")
    wrap(core.transport._Body, "_read", after="first chunk")
    gc.callbacks.append(on_gc)


def dump() -> None:
    path = os.environ.get("TTFT_TRACE")
    if not path:
        return
    with open(path, "w") as out:
        for ask in asks:
            out.write(json.dumps({"stages": ask["stages"], "gc": ask["gc"]}) + "\n")


if __name__ == "__main__":
    sys.argv = sys.argv[1:]  # the daemon's script, as if run directly
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    install()
    atexit.register(dump)
    runpy.run_path(sys.argv[0], run_name="__main__")
