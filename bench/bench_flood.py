#!/usr/bin/env python3
"""One client's flood of lines must not slow the others: ``status`` latency under a flood.

The daemon runs as a child with the fake router (``python -m selfcheck.fakerouter``). A
quiet client asks ``status`` over and over, each timed from its line to its answer,
first alone, then while a second client writes ``--megabytes`` of blank lines (the
issue's case: 20 MB) as fast as the socket takes them, then while it writes as many
bad JSON lines (each answered with an ``error`` event the flooder never reads).
Target: ``status`` p50 under a flood ≤ 20 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time

from benchlib import (
    Daemon,
    fake_router_process,
    header,
    median,
    ms,
    p90,
    statuses,
    temp_dir,
    terminate_on_sigterm,
    verdict,
)

from client import Wire

TARGET_P50 = 0.020  # seconds
WRITE_CHUNK = 1 << 16


async def flood(path: str, line: bytes, megabytes: int) -> tuple[float, bool]:
    """Write ``megabytes`` of ``line`` as fast as the daemon takes them: the seconds it took, and
    whether the daemon dropped the flooder first (it does once its unread errors pass the cap)."""
    _reader, writer = await asyncio.open_unix_connection(path)
    chunk = line * (WRITE_CHUNK // len(line))
    started = time.perf_counter()
    try:
        for _ in range(megabytes * (1 << 20) // len(chunk)):
            writer.write(chunk)
            await writer.drain()
    except ConnectionError:
        return time.perf_counter() - started, True
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
    return time.perf_counter() - started, False


async def run(args: argparse.Namespace, daemon: Daemon) -> bool:
    client = await Wire.open(daemon.socket_path, keep=False)
    ok = True
    try:
        alone = await statuses(client, None, 200)
        print(f"status alone:                 p50 {ms(median(alone))}, p90 {ms(p90(alone))} ({len(alone)} asks)")
        for name, line in (("blank lines", b"\n"), ("bad JSON lines", b"{nope\n")):
            flooding = asyncio.ensure_future(flood(str(daemon.socket_path), line, args.megabytes))
            under = await statuses(client, flooding, 0)
            took, dropped = await flooding
            print(f"status under {args.megabytes} MB of {name:15} p50 {ms(median(under))}, p90 {ms(p90(under))} "
                  f"({len(under)} asks; the flood took {took:.2f} s"
                  f"{', then the daemon dropped the flooder' if dropped else ''})")
            ok = ok and median(under) <= TARGET_P50
            print(f"target: status p50 under a flood of {name} <= {ms(TARGET_P50)}: "
                  f"{ms(median(under))} {verdict(median(under) <= TARGET_P50)}")
    finally:
        await client.close()
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=20, help="the size of each flood (default 20)")
    args = parser.parse_args(argv)
    terminate_on_sigterm()
    header("bench_flood: status latency while another client floods the daemon with lines")
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(fake_router_process())
        work = stack.enter_context(temp_dir("flood"))
        daemon = stack.enter_context(Daemon(work, url))
        asyncio.run(run(args, daemon))  # a missed target is a finding, not a failure of the benchmark
    return 0


if __name__ == "__main__":
    sys.exit(main())
