#!/usr/bin/env python3
"""``open`` of a long conversation must not stall the other clients: ``status`` round trips
while another client opens it.

The daemon runs as a child with the fake router (``python -m selfcheck.fakerouter``), over
a history written before it starts: one conversation of ``--turns`` turns whose replies
are ``--reply-kb`` KB each (defaults: 1,000 x 12 KB, a 12 MB ``conversation`` event). A
quiet client times ``status`` round trips one after the other, first alone, then while a
second client, a process of its own, opens the conversation ``--opens`` times. The slowest round trip during the
opens is how long the daemon's event loop stood still for everyone else.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import socket
import sys
import time

from benchlib import (
    Daemon,
    fake_router_process,
    header,
    median,
    ms,
    open_client,
    p90,
    statuses,
    temp_dir,
    terminate_on_sigterm,
    write_history,
)

READ_CHUNK = 1 << 20


def opens(path: str, cid: int, count: int, out: multiprocessing.connection.Connection) -> None:
    """Child process (its reading must not slow the status client): open the conversation
    ``count`` times, each timed from its line to the event read whole; the times go to ``out``."""
    times = []
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        for n in range(count):
            time.sleep(0.05)  # the status client runs alone a moment between opens
            started = time.perf_counter()
            sock.sendall(b'{"type":"open","conversation":%d,"id":%d}\n' % (cid, n))
            chunks = [sock.recv(READ_CHUNK)]
            if not chunks[0].startswith(b'{"type":"conversation"'):
                raise RuntimeError(f"open answered {chunks[0][:200]!r}")
            while not chunks[-1].endswith(b"\n"):
                chunks.append(sock.recv(READ_CHUNK))
            times.append(time.perf_counter() - started)
    out.send(times)


async def run(args: argparse.Namespace, daemon: Daemon, cid: int) -> None:
    client = await open_client(daemon.socket_path)
    try:
        await statuses(client, None, 50)  # warm-up: the first round trips of a fresh daemon are slow
        alone = await statuses(client, None, 200)
        receiver, sender = multiprocessing.Pipe(duplex=False)
        opener = multiprocessing.get_context("spawn").Process(
            target=opens, args=(str(daemon.socket_path), cid, args.opens, sender)
        )
        opener.start()
        opening = asyncio.ensure_future(asyncio.to_thread(receiver.recv))
        during = await statuses(client, opening, 0)
        took = await opening
        opener.join()
    finally:
        await client.close()
    print(f"open of {args.turns} turns x {args.reply_kb} KB: median {ms(median(took))} ({args.opens} opens)")
    print(f"status alone:       p50 {ms(median(alone))}, p90 {ms(p90(alone))}, max {ms(max(alone))}")
    print(f"status during opens: p50 {ms(median(during))}, p90 {ms(p90(during))}, max {ms(max(during))} "
          f"({len(during)} round trips)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=1000, help="turns of the conversation (default 1000)")
    parser.add_argument("--reply-kb", type=int, default=12, help="KB of each reply (default 12)")
    parser.add_argument("--opens", type=int, default=5, help="times it is opened (default 5)")
    args = parser.parse_args(argv)
    terminate_on_sigterm()
    header("bench_open: status round trips while another client opens a long conversation")
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(fake_router_process())
        work = stack.enter_context(temp_dir("open"))
        [cid] = write_history(work / "data" / "history.db", 1, args.turns, filler=args.reply_kb * 1024)
        daemon = stack.enter_context(Daemon(work, url))
        asyncio.run(run(args, daemon, cid))
    return 0


if __name__ == "__main__":
    sys.exit(main())
