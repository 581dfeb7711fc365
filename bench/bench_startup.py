#!/usr/bin/env python3
"""Start-up time and idle memory of the daemon.

Start-up is spawn (``python assistant.py``) to the ``READY=1`` datagram on a
``NOTIFY_SOCKET`` the benchmark binds: ``--starts`` times with a fresh data
directory each, then a few times on an existing history of ``--turns`` turns. Our
modules are compiled first (``make bytecode``, as any install has them): where Python
may not write bytecode (PYTHONDONTWRITEBYTECODE) it would otherwise compile them at
every start.
For context it also shows the interpreter's own start (``python -c pass``),
the import of the daemon's modules (``-X importtime`` of ``import assistant``)
and the daemon's own "ready in N ms" (socket, history, router client).
Idle memory is VmRSS from ``/proc/PID/status`` once ready, and again after a
few requests (asks, a list, an open), with the peak (VmHWM).
Targets: start-up under 200 ms, idle RSS under 60 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import (
    DEFAULT_QUESTION,
    ROOT,
    Daemon,
    answer,
    fake_router_process,
    header,
    median,
    open_client,
    temp_dir,
    terminate_on_sigterm,
    verdict,
    write_history,
)

TARGET_STARTUP = 0.200  # seconds, median
TARGET_RSS_KIB = 60 * 1024
REQUESTS_TIMEOUT = 30.0
# what make bytecode compiles (the Makefile's PACKAGES)
PACKAGES = ("core", "history", "attachments", "recall", "kbinject", "daemon", "mcphost", "mcpserve", "selfcheck",
            "assistant.py")
HISTORY_STARTS = 3
HISTORY_CONVERSATIONS = 10


def compile_sources() -> None:
    """Our modules as bytecode (``make bytecode``), as an installed daemon has them."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", *PACKAGES], cwd=ROOT, check=True)


def interpreter_seconds(code: str, times: int) -> float:
    """Median wall time of ``python -c code`` run from the repository."""
    values = []
    for _ in range(times):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
        values.append(time.perf_counter() - started)
    return median(values)


def import_seconds(times: int) -> float:
    """Median cumulative time of ``import assistant`` as ``-X importtime`` reports it."""
    values = []
    for _ in range(times):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", "import assistant"],
            cwd=ROOT, check=True, capture_output=True, text=True,
        )
        for line in done.stderr.splitlines():
            fields = line.split("|")
            if len(fields) == 3 and fields[2].strip() == "assistant" and not fields[2].startswith("  "):
                values.append(int(fields[1]) / 1e6)
    if not values:
        raise RuntimeError("python -X importtime reported no 'assistant' import")
    return median(values)


def start_stop(work: Path, url: str, data_dir: Path) -> tuple[float, float | None, float]:
    """One start to READY=1 and stop: (start-up s, the daemon's own ready ms, stop s)."""
    daemon = Daemon(work, url, data_dir=data_dir).start()
    try:
        own = daemon.self_reported_ready_ms()
    finally:
        stopped = daemon.stop()
    return daemon.startup, own, stopped


async def exercise(daemon: Daemon, asks: int) -> None:
    """A few ordinary requests: asks in new and in one conversation, a list, an open."""
    async with asyncio.timeout(REQUESTS_TIMEOUT):
        client = await open_client(daemon.socket_path)
        try:
            await answer(client, await client.send({"type": "status"}), ("status",))
            await answer(client, await client.send({"type": "models"}), ("models",))
            cid: int | None = None
            for i in range(asks):
                request: dict[str, Any] = {"type": "ask", "text": f"{DEFAULT_QUESTION} ({i})"}
                if i % 2 and cid is not None:
                    request["conversation"] = cid
                done = await answer(client, await client.send(request), ("done",))
                cid = cid or int(done["conversation"])
            await answer(client, await client.send({"type": "conversations"}), ("conversations",))
            await answer(client, await client.send({"type": "open", "conversation": cid}), ("conversation",))
        finally:
            await client.close()


def mib(kib: int) -> str:
    return f"{kib / 1024:.1f} MB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=10, help="fresh starts (default 10)")
    parser.add_argument("--turns", type=int, default=1000, help="turns in the existing history (default 1000)")
    parser.add_argument("--asks", type=int, default=6, help="asks before the second RSS reading (default 6)")
    args = parser.parse_args(argv)
    terminate_on_sigterm()
    header("bench_startup: daemon start-up to READY=1, and idle RSS")
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(fake_router_process())
        work = stack.enter_context(temp_dir("start"))

        compile_sources()
        bare = interpreter_seconds("pass", 5)
        imports = import_seconds(5)

        fresh = [start_stop(work / f"f{i}", url, work / f"f{i}" / "data") for i in range(args.starts)]

        hist_dir = work / "h" / "data"
        per_conv = max(1, args.turns // HISTORY_CONVERSATIONS)
        conversations = max(1, args.turns // per_conv)
        write_history(hist_dir / "history.db", conversations, per_conv)
        with_history = [start_stop(work / "h", url, hist_dir) for _ in range(HISTORY_STARTS)]

        # memory: a fresh daemon once ready, then after a few requests
        daemon = stack.enter_context(Daemon(work / "m", url))
        rss_ready = daemon.rss_kib()
        asyncio.run(exercise(daemon, args.asks))
        rss_used, rss_peak = daemon.rss_kib(), daemon.rss_kib("VmHWM")
        daemon.stop()

        hist_daemon = stack.enter_context(Daemon(work / "h", url, data_dir=hist_dir))
        rss_hist = hist_daemon.rss_kib()
        hist_daemon.stop()

    starts = [s for s, _, _ in fresh]
    own = [o for _, o, _ in fresh if o is not None]
    print(
        f"python -c pass (start and exit): {bare * 1000:.1f} ms; import assistant (-X importtime, cumulative): "
        f"{imports * 1000:.1f} ms (medians of 5)"
    )
    print(
        f"fresh data dir, {len(starts)} starts: median {median(starts) * 1000:.1f} ms, "
        f"min {min(starts) * 1000:.1f}, max {max(starts) * 1000:.1f} ms "
        f"(each: {', '.join(f'{s * 1000:.0f}' for s in starts)})"
    )
    if own:
        print(
            f"  parts (each measured its own way, so they only roughly add up): interpreter ~{bare * 1000:.0f} ms, "
            f"imports ~{imports * 1000:.0f} ms, serve() to ready (the daemon's own 'ready in', median) {median(own):.1f} ms"
        )
    print(f"  stop (SIGTERM to exit): median {median([s for _, _, s in fresh]) * 1000:.1f} ms")
    hist_starts = [s for s, _, _ in with_history]
    print(
        f"existing history ({conversations} conversations x {per_conv} turns), {len(hist_starts)} starts: "
        f"median {median(hist_starts) * 1000:.1f} ms ({', '.join(f'{s * 1000:.0f}' for s in hist_starts)}); "
        f"the daemon's own 'ready in' {median([o for _, o, _ in with_history if o is not None] or [0]):.1f} ms"
    )
    print(
        f"RSS: ready {mib(rss_ready)}; after {args.asks} asks, a list and an open {mib(rss_used)} "
        f"(peak VmHWM {mib(rss_peak)}); ready on the existing history {mib(rss_hist)}"
    )
    print(f"target: start-up median < {TARGET_STARTUP * 1000:.0f} ms: {median(starts) * 1000:.1f} ms {verdict(median(starts) < TARGET_STARTUP)}")
    worst = max(rss_ready, rss_used, rss_hist)
    print(f"target: idle RSS < {mib(TARGET_RSS_KIB)}: {mib(worst)} (highest reading) {verdict(worst < TARGET_RSS_KIB)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
