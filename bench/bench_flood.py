#!/usr/bin/env python3
"""One client's flood of lines must not slow the others: ``status`` latency under a flood.

The daemon runs as a child with the fake router (``python -m selfcheck.fakerouter``). A
quiet client asks ``status`` over and over, each timed from its line to its answer,
first alone, then while a second client writes ``--megabytes`` of blank lines (the
issue's case: 20 MB) as fast as the socket takes them, then while it writes as many
bad JSON lines (each answered with an ``error`` event the flooder never reads).
Target: ``status`` p50 under a flood ≤ 20 ms. Then, for each kind of request, one client
writes ``--requests`` lines of it and reads nothing (requests that wait on earlier ones once
held every earlier one: 10,000 ``settings`` took 11 GB): the daemon's RSS growth must stay
≤ 100 MB and ``status`` from the quiet client ≤ 100 ms p95.
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
TARGET_UNREAD_P95 = 0.100  # seconds, status beside a flood of unread requests
TARGET_UNREAD_RSS_MB = 100
WRITE_CHUNK = 1 << 16
UNREAD = {  # a line of each kind of request, flooded unread
    "settings": b'{"type":"settings","conversation":1,"title":"t"}\n',
    "cancel": b'{"type":"cancel","conversation":1}\n',
    "delete": b'{"type":"delete","conversation":99}\n',
    "open": b'{"type":"open","conversation":1}\n',
    "search": b'{"type":"search","query":"hello"}\n',
    "kb_remove": b'{"type":"kb_remove","kb":"none"}\n',
    "status": b'{"type":"status"}\n',
}


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
        await client.ask("hello")  # conversation 1, which the flooded requests name
        for kind, line in UNREAD.items():
            ok = await unread_flood(client, daemon, kind, line, args.requests) and ok
    finally:
        await client.close()
    return ok


async def unread_flood(client: Wire, daemon: Daemon, kind: str, line: bytes, count: int) -> bool:
    """``count`` lines of one request, written and never read, beside the quiet client's statuses."""
    before = daemon.rss_kib()
    peak = before
    _reader, writer = await asyncio.open_unix_connection(str(daemon.socket_path))
    try:
        writer.write(line * count)
        drained = asyncio.ensure_future(writer.drain())
        under: list[float] = []
        for _ in range(10):  # a second of the flood, and what follows it, 100 statuses at a time
            under += await statuses(client, None, 100)
            peak = max(peak, daemon.rss_kib())
        drained.cancel()
    finally:
        writer.close()
    grew = (peak - before) / 1024
    p95 = sorted(under)[int(len(under) * 0.95)]
    fine = grew <= TARGET_UNREAD_RSS_MB and p95 <= TARGET_UNREAD_P95
    print(f"{count} unread {kind:10} RSS +{grew:6.1f} MB, status p50 {ms(median(under))}, p95 {ms(p95)} "
          f"{verdict(fine)}")
    return fine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=20, help="the size of each flood (default 20)")
    parser.add_argument("--requests", type=int, default=10_000, help="lines of each unread flood (default 10,000)")
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
