#!/usr/bin/env python3
"""Images: peak memory of one ask with 8 PNGs of 8000 x 8000 RGBA, and what a later turn costs.

Eight compressible PNGs of 8000 x 8000 RGBA (about 250 KB each on disk, 256 MB each
decoded; each a different colour, so eight different hashes) are attached to one
``ask`` (model ``fake-vision``) of a fresh daemon, after a text-only warm-up. The
figures are the daemon's peak RSS (``VmHWM`` in ``/proc/PID/status``) before and after
that ask, and its duration. Then a text-only turn of the same conversation (which
replays the eight images) is timed while a thread samples ``VmRSS`` every 2 ms; the
growth is the highest sample over the RSS before it. The same turn is measured again
after a restart of the daemon (the encoded images come from the cache in the data
dir). The fake router runs in its own process.

Targets (issue 11): the ask's peak ≤ 500 MB over idle; a later text-only turn adds
≤ 50 MB and takes ≤ 0.2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path

from benchlib import Daemon, answer, fake_router_process, header, open_client, temp_dir, terminate_on_sigterm, verdict
from PIL import Image, ImageDraw

SIDE = 8000
FILES = 8
PEAK_TARGET_MB = 500
LATER_TARGET_MB = 50
LATER_TARGET_S = 0.2
ASK_TIMEOUT = 300.0


def make_pngs(folder: Path, count: int, side: int) -> list[Path]:
    paths = []
    for i in range(count):
        image = Image.new("RGBA", (side, side), (30 * i % 256, 80, 160, 255))
        draw = ImageDraw.Draw(image)
        for k in range(0, side, side // 16):  # some structure, still compressible
            draw.line([(k, 0), (side - k, side)], fill=(255, 255, 255, 128), width=9)
        path = folder / f"huge{i}.png"
        image.save(path, "PNG", compress_level=9)
        paths.append(path)
        del image, draw
    return paths


class Sampler:
    """The highest VmRSS of a process seen while it runs, sampled every ``period`` seconds."""

    def __init__(self, daemon: Daemon, period: float = 0.002) -> None:
        self.daemon, self.period = daemon, period
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.daemon.rss_kib())
            time.sleep(self.period)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.daemon.rss_kib())


async def ask(daemon: Daemon, text: str, **fields: object) -> tuple[dict, float]:
    client = await open_client(daemon.socket_path)
    try:
        started = time.perf_counter()
        rid = await client.send({"type": "ask", "text": text, "model": "fake-vision", **fields})
        async with asyncio.timeout(ASK_TIMEOUT):
            done = await answer(client, rid, ("done",))
        return done, time.perf_counter() - started
    finally:
        await client.close()


def later_turn(daemon: Daemon, cid: int, label: str) -> bool:
    before = daemon.rss_kib()
    with Sampler(daemon) as sampler:
        _done, seconds = asyncio.run(ask(daemon, "And in one word?", conversation=cid))
    grew = (sampler.peak - before) / 1024
    ok = grew <= LATER_TARGET_MB and seconds <= LATER_TARGET_S
    print(f"{label:44} {seconds:8.3f} s  RSS {before / 1024:7.1f} MB, +{grew:6.1f} MB at most  "
          f"(≤ {LATER_TARGET_MB} MB, ≤ {LATER_TARGET_S} s) {verdict(ok)}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=SIDE, help=f"pixels a side (default {SIDE})")
    args = parser.parse_args(argv)
    terminate_on_sigterm()
    header("bench_images: 8 PNGs of 8000 x 8000 RGBA on one ask; a later text-only turn")
    with temp_dir("img") as work, fake_router_process() as url:
        built = time.perf_counter()
        pngs = make_pngs(work, FILES, args.side)
        sizes = ", ".join(f"{p.stat().st_size // 1024}" for p in pngs)
        print(f"{FILES} PNGs of {args.side} x {args.side} RGBA built in {time.perf_counter() - built:.1f} s "
              f"({sizes} KB)")
        data = work / "data"
        with Daemon(work / "d1", url, data_dir=data) as daemon:
            asyncio.run(ask(daemon, "warm up"))
            idle = daemon.rss_kib("VmHWM")
            done, seconds = asyncio.run(ask(daemon, "What are these?", files=[str(p) for p in pngs]))
            peak = daemon.rss_kib("VmHWM")
            grew = (peak - idle) / 1024
            ok_peak = grew <= PEAK_TARGET_MB
            print(f"{'ask with the 8 PNGs':44} {seconds:8.3f} s  peak {peak / 1024:7.1f} MB, "
                  f"+{grew:6.1f} MB over idle (≤ {PEAK_TARGET_MB} MB) {verdict(ok_peak)}")
            cid = done["conversation"]
            ok_later = later_turn(daemon, cid, "later text-only turn (replays the 8 images)")
        with Daemon(work / "d2", url, data_dir=data) as daemon:
            asyncio.run(ask(daemon, "warm up"))
            ok_restart = later_turn(daemon, cid, "the same after a restart (from the cache)")
    print(f"command: {sys.executable} bench/bench_images.py" + (f" --side {args.side}" if args.side != SIDE else ""))
    print("targets: all met" if ok_peak and ok_later and ok_restart else "targets: some missed (see FAIL above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
