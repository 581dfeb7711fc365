#!/usr/bin/env python3
"""convert: each file operation through the daemon against the same work run directly.

Inputs are made once per run in a temporary folder: a 50-page text PDF
(``selfcheck/samples.py``) and a 60-second 1280x720 30 fps video with sound (ffmpeg's
``testsrc2`` and ``sine``). The daemon is its own process (``benchlib.Daemon``); each
operation is a ``convert`` on its socket, timed from the request line to ``converted``.
The direct run is what a person would type for the same output:

- ``pdf_merge`` (the PDF twice), ``pdf_pages`` (``2-40``, turned 90°): the same pypdf
  calls in a fresh ``python -c`` (the daemon's worker is such a process too);
- ``pdf_to_markdown``: ``pdftohtml -xml -i -stdout`` (as the daemon runs it), then the same
  Markdown build (``fileops.markdown``) in this process and the ``.md`` written: the daemon
  makes the Markdown, so a direct run of ``pdftohtml`` alone did less than it (until
  2026-12-07 it was the baseline);
- ``video_to_audio``: ``ffmpeg -i V -vn -c:a copy A.m4a``;
- ``video_to_gif`` (5 s at 10 fps, 480 px): the same one-pass palette command;
- ``trackcrop`` (9:16): the same measure (``fileworker.tracking``: ffmpeg's 160 px grey
  frames into numpy) called in this process, with the video's geometry known (no ffprobe,
  no worker to start), then the same render of that window's path (``sendcmd`` and
  ``crop``). Until 2026-12-07 the direct run decoded to ``/dev/null`` without numpy and
  rendered a fixed window, which x264 encodes in less time than a panning one: a
  different output.

Runs alternate, the daemon's then the direct one; the medians are compared. How many pairs
an operation gets is set by its cost: as many as the median of its pairs so far fits in
``--budget`` seconds (10), at least ``MIN_RUNS`` (3) and at most ``MAX_RUNS`` (101), so
``pdf_to_markdown``, a job of milliseconds whose direct run alone varies too much at 3 runs to
tell 1.1x (bench/RESULTS.md), gets 101, while trackcrop, seconds a run, gets 3. ``--runs N``
gives every operation N.
Target: the daemon within 1.1x of the direct run (issue 47).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchlib import Daemon, fake_router_process, header, median, temp_dir, terminate_on_sigterm, verdict

from client import Wire
from fileops.markdown import pages_markdown, parse_pages
from fileops.video import crop_size
from fileworker.tracking import track_window
from selfcheck.samples import make_pdf

TARGET = 1.1
BUDGET = 10.0  # seconds of pairs per operation, by default
MIN_RUNS = 3  # an operation of seconds a run still gets a median of three
MAX_RUNS = 101  # a job of milliseconds: enough to resolve a few percent
PAGES = 50
SECONDS = 60
WIDTH, HEIGHT, FPS = 1280, 720, 30
ASPECT = "9:16"
MERGE = """import sys
from pypdf import PdfReader, PdfWriter
w = PdfWriter()
for p in sys.argv[2:]:
    for page in PdfReader(p).pages: w.add_page(page)
w.write(sys.argv[1])
"""
PAGES_CODE = """import sys
from pypdf import PdfReader, PdfWriter
w = PdfWriter()
for page in PdfReader(sys.argv[2]).pages[1:40]: w.add_page(page).rotate(90)
w.write(sys.argv[1])
"""


def make_inputs(folder: Path) -> tuple[Path, Path]:
    pdf = make_pdf(folder / "doc.pdf", [f"Page {n}\n" + "A line of text on the page.\n" * 30 for n in range(PAGES)])
    video = folder / "clip.mp4"
    picture = f"testsrc2=size={WIDTH}x{HEIGHT}:rate={FPS}:duration={SECONDS}"
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", picture,
                    "-f", "lavfi", "-i", f"sine=frequency=440:duration={SECONDS}", "-c:v", "libx264", "-preset",
                    "ultrafast", "-pix_fmt", "yuv420p", "-c:a", "aac", "-shortest", str(video)], check=True)
    return pdf, video


def direct_runs(pdf: Path, video: Path, out: Path) -> dict[str, Callable[[], None]]:
    def run(*args: str, cwd: Path | None = None) -> None:
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL, cwd=cwd)

    def markdown() -> None:
        xml = subprocess.run(["pdftohtml", "-xml", "-i", "-stdout", "-q", "-nodrm", str(pdf)], check=True,
                             capture_output=True).stdout
        pages = pages_markdown(parse_pages(xml))  # then joined as fileops.pdfops joins them
        (out / "doc.md").write_bytes(("\n\n".join(text for text in pages if text).strip() + "\n").encode())

    def trackcrop() -> None:
        crop_w, crop_h = crop_size(WIDTH, HEIGHT, ASPECT)
        track_window({"files": [str(video)], "output": str(out / "window.cmd"), "options": {"smooth": 1.0},
                      "geometry": {"width": WIDTH, "height": HEIGHT, "crop_w": crop_w, "crop_h": crop_h, "fps": FPS,
                                   "frames": SECONDS * FPS}}, lambda done, total: None)
        window = f"sendcmd=f=window.cmd,crop={crop_w}:{crop_h}:0:0"  # as fileops.video.trackcrop renders it
        run("ffmpeg", "-v", "error", "-nostdin", "-i", str(video), "-vf", window, "-c:v", "libx264", "-preset",
            "veryfast", "-crf", "20", "-pix_fmt", "yuv420p", "-c:a", "aac", "-y", str(out / "crop.mp4"), cwd=out)

    gif = ("fps=10,scale=480:-2:flags=lanczos,split[a][b];[a]palettegen=stats_mode=diff[p];"
           "[b][p]paletteuse=dither=bayer")
    return {
        "pdf_merge": lambda: run(sys.executable, "-c", MERGE, str(out / "m.pdf"), str(pdf), str(pdf)),
        "pdf_pages": lambda: run(sys.executable, "-c", PAGES_CODE, str(out / "p.pdf"), str(pdf)),
        "pdf_to_markdown": markdown,
        "video_to_audio": lambda: run("ffmpeg", "-v", "error", "-nostdin", "-i", str(video), "-vn", "-c:a", "copy",
                                      "-y", str(out / "a.m4a")),
        "video_to_gif": lambda: run("ffmpeg", "-v", "error", "-nostdin", "-ss", "0", "-t", "5", "-i", str(video), "-an",
                                    "-filter_complex", gif, "-loop", "0", "-y", str(out / "g.gif")),
        "trackcrop": trackcrop,
    }


def requests(pdf: Path, video: Path, out: Path) -> dict[str, dict[str, Any]]:
    def convert(operation: str, files: list[Path], **options: Any) -> dict[str, Any]:
        return {"type": "convert", "operation": operation, "files": [str(f) for f in files], "options": options,
                "output_dir": str(out)}

    return {
        "pdf_merge": convert("pdf_merge", [pdf, pdf]),
        "pdf_pages": convert("pdf_pages", [pdf], pages="2-40", rotate=90),
        "pdf_to_markdown": convert("pdf_to_markdown", [pdf]),
        "video_to_audio": convert("video_to_audio", [video]),
        "video_to_gif": convert("video_to_gif", [video], duration=5),
        "trackcrop": convert("trackcrop", [video], aspect=ASPECT, smooth=1.0),
    }


async def through_daemon(wire: Wire, request: dict[str, Any]) -> float:
    started = time.perf_counter()
    rid = await wire.send(request)
    end = (await wire.until(rid, ("converted", "error")))[-1]
    took = time.perf_counter() - started
    if end["type"] != "converted":
        raise RuntimeError(f"{request['operation']}: {end}")
    for chip in end["outputs"]:
        Path(chip["path"]).unlink()  # the next run writes the same name, not "name (1)"
    return took


def runs_for(done: list[float], budget: float) -> int:
    """How many pairs an operation gets: as many as the median of those ``done`` (seconds each) fit
    in ``budget``, from ``MIN_RUNS`` to ``MAX_RUNS``; one to start with. A median, not the first
    pair alone: a cold first run would cut a short job's count."""
    if not done:
        return 1
    return max(MIN_RUNS, min(MAX_RUNS, math.ceil(budget / max(median(done), 1e-6))))


async def pairs(wire: Wire, request: dict[str, Any], direct: Callable[[], None],
                runs: int | None, budget: float) -> tuple[list[float], list[float]]:
    """The daemon's times and the direct run's, alternated: ``runs`` pairs, else as many as the
    operation's cost lets ``budget`` hold (``runs_for``)."""
    ours: list[float] = []
    theirs: list[float] = []
    while len(ours) < (runs or runs_for([a + b for a, b in zip(ours, theirs)], budget)):
        ours.append(await through_daemon(wire, request))
        started = time.perf_counter()
        await asyncio.to_thread(direct)
        theirs.append(time.perf_counter() - started)
    return ours, theirs


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, help="pairs of each operation (default: as many as fit --budget)")
    parser.add_argument("--budget", type=float, default=BUDGET,
                        help=f"seconds of pairs per operation when --runs is not given ({BUDGET:g}; "
                             f"{MIN_RUNS} to {MAX_RUNS} pairs)")
    parser.add_argument("--only", help="one operation")
    args = parser.parse_args()
    terminate_on_sigterm()
    header("convert: each operation through the daemon against the same work run directly")
    with temp_dir("conv") as work, fake_router_process() as url, Daemon(work / "d", url) as daemon:
        out = work / "out"
        out.mkdir()
        pdf, video = make_inputs(work)
        direct, asked = direct_runs(pdf, video, out), requests(pdf, video, out)
        wire = await Wire.open(daemon.socket_path, timeout=600)
        ok = True
        for operation in [args.only] if args.only else list(asked):
            ours, theirs = await pairs(wire, asked[operation], direct[operation], args.runs, args.budget)
            ratio = median(ours) / median(theirs)
            ok &= ratio <= TARGET
            each = sorted(a / b for a, b in zip(ours, theirs))  # run by run, the pair run back to back
            print(f"{operation:16} daemon {median(ours):7.3f} s  direct {median(theirs):7.3f} s  "
                  f"ratio {ratio:.2f} ({len(ours)} runs: {each[0]:.2f}-{each[-1]:.2f})  {verdict(ratio <= TARGET)}", flush=True)
        await wire.close()
    print(f"target: every operation within {TARGET}x of the direct run: {verdict(ok)}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
