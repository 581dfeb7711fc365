#!/usr/bin/env python3
"""Attachments: how long a question with a PDF takes to reach the router, and peak memory with 8 big files.

Timing.  Two PDFs are built with ``selfcheck/samples.py``: 200 text pages, and 20
scanned pages (``Scan(grain=True)``: pictures only, as costly to encode as a
real scan).  Each is attached to an ``ask`` (model ``fake-vision``, a new
conversation each time) and timed from the ask line to the moment the chat
request has fully arrived at the router.  The router is ``selfcheck.fakerouter.FakeRouter``
run in this process's thread (a real HTTP server on loopback), subclassed only
to note ``perf_counter()`` when a chat request's body has been read, before it
is parsed; the daemon is its own process, so nothing timed in it shares a GIL
with the router or the client.  The same is timed for an ask without files (the
daemon's own floor).  Each daemon run alternates with a bare poppler run on the
same file:

- ``pdftotext -layout FILE -`` over the whole 200-page document (one call);
  target: the daemon within 1.25x of it;
- ``pdftoppm -png -r 150 -scale-to 1600 -f 1 -l 4`` (the four pages the daemon
  sends) into a temporary folder, ``--png-runs`` times (seconds each); target:
  the daemon's request, with its four page images, at the router within 1 s.
  The same call without ``-png`` (PPM, no encoding) shows what rendering costs.

Memory.  For each case a fresh daemon attaches 8 large files to one ask (after a
warm-up with a small file); the figure is its peak RSS (``VmHWM`` in
``/proc/PID/status``) before and after, beside the files' total size.  Cases:
text files with a real ASCII head (larger than the daemon reads) followed by a
hole, at ``--size-mib`` and at ``--scale`` times that size; sparse files that
are all NULs (read as U+FFFD, two bytes a character in Python: the costly
case); and 8 copies of a ``--pdf-pages``-page text PDF.  Poppler's processes
are not part of the daemon's RSS.  Target: the peak does not grow with the
files' size.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib import (
    Daemon,
    header,
    median,
    ms,
    open_client,
    print_profile,
    profile_prefix,
    temp_dir,
    terminate_on_sigterm,
    verdict,
)

from attachments.budget import FULL_TEXT_CAP, budget_chars
from client import Wire
from selfcheck.fakerouter import FakeRouter, Reply
from selfcheck.samples import Scan, make_pdf, make_sparse

VISION_MODEL = "fake-vision"  # sees images; n_ctx 8192, so a budget of 12,288 characters
TEXT_PAGES = 200
SCAN_PAGES = 20
SHOWN_PAGES = 4  # attachments/pdf.py MAX_PAGE_IMAGES
TARGET_TEXT_RATIO = 1.25
TARGET_SCAN = 1.0  # seconds
MEMORY_FILES = 8  # attachments/extract.py MAX_FILES
HEAD_BYTES = 12 * 1024 * 1024  # real text at the start of each big file: more than FULL_TEXT_CAP characters
GROWTH_SLACK_KIB = 16 * 1024  # the large case may peak this much above the small one and still pass
ASK_TIMEOUT = 60.0
QUESTION = "What does this file say?"
LINE = "The quick brown fox jumps over the lazy dog; page {page} line {line} of the benchmark text."
LOG_LINE = "2024-05-01T12:{m:02d}:{s:02d} INFO worker-{w} finished request {n} in {ms} ms status=200\n"


# -- the router ----------------------------------------------------------------------------


class StampingRouter(FakeRouter):
    """The fake router, noting when each chat request's body has arrived (before it is parsed)."""

    def __init__(self) -> None:
        super().__init__()
        self.stamps: list[tuple[float, int]] = []  # (perf_counter, body bytes) of each chat request

    async def _chat(self, request: Any, reader: Any, writer: Any) -> bool:
        self.stamps.append((time.perf_counter(), len(request.body)))
        return await super()._chat(request, reader, writer)


def vision_ctx(router: FakeRouter) -> int:
    """The context size the fake router reports for the vision model."""
    return next(m.n_ctx for m in router.models if m.id == VISION_MODEL)


# -- samples ---------------------------------------------------------------------------------


def text_pages(count: int) -> list[str]:
    """``count`` pages of 45 lines each (about 3,800 characters a page)."""
    return ["\n".join(LINE.format(page=p, line=n) for n in range(1, 46)) for p in range(1, count + 1)]


def log_head(size: int) -> bytes:
    """``size`` bytes of ASCII log lines."""
    out = bytearray()
    n = 0
    while len(out) < size:
        n += 1
        out += LOG_LINE.format(m=n // 60 % 60, s=n % 60, w=n % 7, n=n, ms=n % 997).encode()
    return bytes(out[:size])


def gib(size: int) -> str:
    return f"{size / (1 << 30):.1f} GiB" if size >= 1 << 30 else f"{size / (1 << 20):.0f} MiB"


def mb(kib: int) -> str:
    return f"{kib / 1024:.1f} MB"


# -- timing ----------------------------------------------------------------------------------


@dataclass
class Ask:
    """One timed ask: seconds from the ask line to each stage, and what the router got."""

    extracting: float | None = None  # the daemon's "extracting" progress event
    user: float | None = None  # the user event: files prepared and the question stored
    arrived: float = 0.0  # the chat request fully read by the router
    body_bytes: int = 0
    done: float = 0.0
    chips: list[dict[str, Any]] = field(default_factory=list)


async def timed_ask(client: Wire, router: StampingRouter, files: list[str], reply: str = "Read it.") -> Ask:
    """Ask about ``files`` in a new conversation; time it until the router has the request."""
    router.script(Reply(text=reply))
    seen = len(router.stamps)
    request: dict[str, Any] = {"type": "ask", "text": QUESTION, "model": VISION_MODEL}
    if files:
        request["files"] = files
    out = Ask()
    started = time.perf_counter()
    rid = await client.send(request)
    while True:
        event = await client.read()
        if event.get("id") != rid:
            continue
        now = time.perf_counter() - started
        kind = event["type"]
        if kind == "progress" and event.get("stage") == "extracting" and out.extracting is None:
            out.extracting = now
        elif kind == "user":
            out.user = now
            out.chips = event.get("files") or []
        elif kind == "done":
            out.done = now
            break
        elif kind == "error":
            raise RuntimeError(f"the daemon answered with an error: {event}")
    if len(router.stamps) != seen + 1:
        raise RuntimeError(f"expected one chat request at the router, got {len(router.stamps) - seen}")
    at, size = router.stamps[-1]
    out.arrived, out.body_bytes = at - started, size
    return out


def last_user_parts(router: StampingRouter) -> list[dict[str, Any]]:
    content = [m for m in router.requests[-1]["messages"] if m["role"] == "user"][-1]["content"]
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


def check_text_request(router: StampingRouter, name: str) -> None:
    text = "".join(p.get("text", "") for p in last_user_parts(router))
    if f"--- file: {name} ({TEXT_PAGES} pages" not in text or "[page 1]" not in text:
        raise RuntimeError(f"the router's request lacks the PDF's block: {text[:300]!r}")


def check_scan_request(router: StampingRouter) -> None:
    images = [p for p in last_user_parts(router) if p.get("type") == "image_url"]
    if len(images) != SHOWN_PAGES:
        raise RuntimeError(f"the router got {len(images)} page images, expected {SHOWN_PAGES}")


def bare(args: list[str]) -> float:
    """Seconds of one tool run, its output read in full."""
    started = time.perf_counter()
    subprocess.run(args, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def bare_pages(pdf: Path, out: Path, png: bool) -> float:
    """One bare pdftoppm call rendering the first pages into ``out``: PNG files, or PPM (no encoding)."""
    for old in out.iterdir():
        old.unlink()
    seconds = bare(["pdftoppm", *(["-png"] if png else []), "-r", "150", "-scale-to", "1600",
                    "-f", "1", "-l", str(SHOWN_PAGES), str(pdf), str(out / "p")])
    if len(list(out.iterdir())) != SHOWN_PAGES:
        raise RuntimeError(f"pdftoppm wrote {len(list(out.iterdir()))} pages, expected {SHOWN_PAGES}")
    return seconds


def spread(values: list[float]) -> str:
    """Median, with the range when there are several values."""
    if len(values) < 2:
        return ms(values[0])
    return f"{ms(median(values))} ({min(values) * 1000:.1f}-{max(values) * 1000:.1f})"


@dataclass
class Case:
    name: str
    asks: list[Ask] = field(default_factory=list)
    bare: list[float] = field(default_factory=list)
    ppm: list[float] = field(default_factory=list)

    def stage(self, attr: str) -> float:
        return median([getattr(a, attr) for a in self.asks])

    def arrivals(self) -> list[float]:
        return [a.arrived for a in self.asks]


async def measure_timing(args: argparse.Namespace, daemon: Daemon, router: StampingRouter,
                         text_pdf: Path, scan_pdf: Path, pages_dir: Path) -> list[Case]:
    totext = ["pdftotext", "-layout", str(text_pdf), "-"]
    plain, text, scan = Case("no files"), Case(f"text PDF, {TEXT_PAGES} pages"), Case(f"scanned PDF, {SCAN_PAGES} pages")
    client = await open_client(daemon.socket_path)
    try:
        async with asyncio.timeout(ASK_TIMEOUT * 3):
            # warm-up: the model list, the daemon's imports, the page cache, poppler's own start
            await timed_ask(client, router, [])
            await timed_ask(client, router, [str(text_pdf)])
            await timed_ask(client, router, [str(scan_pdf)])
            bare(totext)
            bare_pages(scan_pdf, pages_dir, png=False)
            for _ in range(args.runs):
                plain.asks.append(await timed_ask(client, router, []))
            for i in range(args.runs):
                if i % 2 == 0:  # alternate which goes first
                    text.bare.append(bare(totext))
                    text.asks.append(await timed_ask(client, router, [str(text_pdf)]))
                else:
                    text.asks.append(await timed_ask(client, router, [str(text_pdf)]))
                    text.bare.append(bare(totext))
                check_text_request(router, text_pdf.name)
            for i in range(args.runs):
                scan.asks.append(await timed_ask(client, router, [str(scan_pdf)]))
                check_scan_request(router)
                scan.ppm.append(bare_pages(scan_pdf, pages_dir, png=False))
                if i < args.png_runs:  # pdftoppm -png takes seconds: fewer runs
                    scan.bare.append(bare_pages(scan_pdf, pages_dir, png=True))
    finally:
        await client.close()
    return [plain, text, scan]


def report_timing(args: argparse.Namespace, cases: list[Case], text_pdf: Path, scan_pdf: Path) -> None:
    plain, text, scan = cases
    print(f"files: {text_pdf.name} {text_pdf.stat().st_size / 1e6:.2f} MB; {scan_pdf.name} "
          f"{scan_pdf.stat().st_size / 1e6:.2f} MB (grain); model {VISION_MODEL}; {args.runs} asks each, medians "
          f"(min-max); bare pdftotext {len(text.bare)} runs, pdftoppm PPM {len(scan.ppm)}, PNG {len(scan.bare)}")
    print(f"{'ask with':24} {'extracting':>11} {'user event':>11} {'at router':>30} {'request':>10} {'done':>11}")
    for case in cases:
        print(f"{case.name:24} {ms(case.stage('extracting')) if case.asks[0].extracting else '-':>11} "
              f"{ms(case.stage('user')):>11} {spread(case.arrivals()):>30} "
              f"{median([a.body_bytes for a in case.asks]) / 1e6:>7.2f} MB {ms(case.stage('done')):>11}")
    print(f"chips: text {text.asks[-1].chips}; scanned {scan.asks[-1].chips}")
    base = plain.stage("arrived")
    t_daemon, t_bare = text.stage("arrived"), median(text.bare)
    print(f"bare pdftotext -layout FILE - (whole file, one call): {spread(text.bare)}, {TEXT_PAGES / t_bare:.0f} pages/s; "
          f"daemon {ms(t_daemon)}, {ms(t_daemon - base)} over an ask without files")
    s_daemon, s_bare = scan.stage("arrived"), median(scan.bare)
    print(f"bare pdftoppm -r 150 -scale-to 1600, {SHOWN_PAGES} pages in one call: -png {spread(scan.bare)}, "
          f"{ms(s_bare / SHOWN_PAGES)} a page; PPM (no encoding) {spread(scan.ppm)}; "
          f"daemon {ms(s_daemon)} = {s_daemon / s_bare:.2f}x the -png call")
    ratio = t_daemon / t_bare
    print(f"target: text PDF ({TEXT_PAGES} pages) ask -> request at the router within {TARGET_TEXT_RATIO}x "
          f"one bare pdftotext -layout: {ms(t_daemon)} / {ms(t_bare)} = {ratio:.2f}x {verdict(ratio <= TARGET_TEXT_RATIO)}")
    print(f"target: scanned PDF ({SCAN_PAGES} pages) ask -> request with {SHOWN_PAGES} page images at the router "
          f"< {TARGET_SCAN:g} s: {ms(s_daemon)} {verdict(s_daemon < TARGET_SCAN)}")
    sys.stdout.flush()


def timing(args: argparse.Namespace) -> None:
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(temp_dir("att"))
        built = time.perf_counter()
        text_pdf = make_pdf(work / "text200.pdf", text_pages(TEXT_PAGES))
        scan_pdf = make_pdf(work / "scan20.pdf", [Scan(f"scanned page {p}", grain=True) for p in range(1, SCAN_PAGES + 1)])
        pages_dir = work / "pages"
        pages_dir.mkdir()
        print(f"samples built in {time.perf_counter() - built:.2f} s")
        router = StampingRouter()
        stack.enter_context(router)
        profile = work / "daemon.prof"
        daemon = stack.enter_context(Daemon(work / "d", router.url, prefix=profile_prefix(profile) if args.profile else ()))
        cases = asyncio.run(measure_timing(args, daemon, router, text_pdf, scan_pdf, pages_dir))
        report_timing(args, cases, text_pdf, scan_pdf)
        if args.profile:
            daemon.stop()
            print_profile(profile)


# -- memory ----------------------------------------------------------------------------------


@dataclass
class Peak:
    name: str
    total: int  # bytes of the files attached
    before: int  # VmHWM KiB after the warm-up
    after: int  # VmHWM KiB after the ask
    rss: int  # VmRSS KiB after the ask
    ask: Ask

    @property
    def growth(self) -> int:
        return self.after - self.before


async def attach_peak(daemon: Daemon, router: StampingRouter, files: list[Path], small: Path) -> tuple[int, int, int, Ask]:
    """VmHWM after a warm-up, then VmHWM and VmRSS after one ask with ``files`` (KiB), and that ask."""
    client = await open_client(daemon.socket_path)
    try:
        async with asyncio.timeout(ASK_TIMEOUT):
            await timed_ask(client, router, [])
            await timed_ask(client, router, [str(small)])
            before = daemon.rss_kib("VmHWM")
            ask = await timed_ask(client, router, [str(f) for f in files])
            return before, daemon.rss_kib("VmHWM"), daemon.rss_kib(), ask
    finally:
        await client.close()


def memory_case(name: str, files: list[Path], small: Path, router: StampingRouter) -> Peak:
    """A fresh daemon attaches ``files`` to one ask; print and return its peak memory."""
    total = sum(f.stat().st_size for f in files)
    with temp_dir("attm") as where, Daemon(where, router.url) as daemon:
        before, after, rss, ask = asyncio.run(attach_peak(daemon, router, files, small))
    print(f"{name:34} {gib(total):>9} {mb(before):>10} {mb(after):>10} {mb(after - before):>10} "
          f"{mb(rss):>10} {ask.user:>9.2f} s {ask.arrived:>7.2f} s {ask.done:>7.2f} s")
    sys.stdout.flush()
    if not all(chip.get("truncated") for chip in ask.chips):
        print(f"  note: not every chip is truncated: {ask.chips}")
    return Peak(name, total, before, after, rss, ask)


def memory(args: argparse.Namespace) -> None:
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(temp_dir("att"))
        router = StampingRouter()
        stack.enter_context(router)
        built = time.perf_counter()
        small = work / "small.txt"
        small.write_text("a small file\n" * 100)
        head = log_head(HEAD_BYTES)
        size = args.size_mib << 20
        logs = []
        for i in range(MEMORY_FILES):
            path = work / f"big{i}.log"
            make_sparse(path, size, head=head)  # real text first, then a hole: no disk used past the head
            logs.append(path)
        sparse = [make_sparse(work / f"nul{i}.log", size) for i in range(MEMORY_FILES)]
        pdf0 = make_pdf(work / "big0.pdf", text_pages(args.pdf_pages))
        pdfs = [pdf0]
        for i in range(1, MEMORY_FILES):
            os.link(pdf0, work / f"big{i}.pdf")
            pdfs.append(work / f"big{i}.pdf")
        print(f"files built in {time.perf_counter() - built:.2f} s; each text file has {HEAD_BYTES >> 20} MiB of "
              f"ASCII log lines, then a hole; the PDF is {args.pdf_pages} text pages, {pdf0.stat().st_size / 1e6:.1f} MB")
        print(f"{'8 files attached to one ask':34} {'total':>9} {'HWM before':>10} {'HWM after':>10} "
              f"{'growth':>10} {'RSS after':>10} {'user event':>11} {'at router':>9} {'done':>9}")
        small_case = memory_case(f"text, {MEMORY_FILES} x {gib(size)}", logs, small, router)
        for path in logs:
            os.truncate(path, size * args.scale)
        large_case = memory_case(f"text, {MEMORY_FILES} x {gib(size * args.scale)}", logs, small, router)
        memory_case(f"all NUL (U+FFFD), {MEMORY_FILES} x {gib(size)}", sparse, small, router)
        memory_case(f"PDF, {MEMORY_FILES} x {args.pdf_pages} pages", pdfs, small, router)
        extra = large_case.after - small_case.after
        ok = extra <= GROWTH_SLACK_KIB
        per_file = small_case.growth / MEMORY_FILES / 1024
        print(f"bound: this ask's text budget is {budget_chars(vision_ctx(router), 0):,} characters, but up to "
              f"FULL_TEXT_CAP = {FULL_TEXT_CAP:,} characters of each file are read and kept for recall "
              f"(attachments/budget.py): {per_file:.1f} MB of peak a text file, "
              f"{per_file * (1 << 20) / FULL_TEXT_CAP:.1f} bytes a kept character")
        print(f"target: peak memory attaching {MEMORY_FILES} files does not grow with their size: "
              f"{mb(small_case.growth)} at {gib(small_case.total)}, {mb(large_case.growth)} at "
              f"{gib(large_case.total)} (peak {mb(extra)} higher, slack {mb(GROWTH_SLACK_KIB)}) {verdict(ok)}")


# -- launching a tool ------------------------------------------------------------------------


async def _launch_times(pdf: Path, runs: int) -> tuple[list[float], list[float]]:
    """``pdfinfo`` on ``pdf`` through the daemon's launcher and through the loop's
    ``subprocess_exec`` (what attachments used before), alternately: seconds each."""
    from core import process

    tool = shutil.which("pdfinfo") or "pdfinfo"
    launcher: list[float] = []
    loop_exec: list[float] = []
    for _ in range(runs):
        started = time.perf_counter()
        ended = await process.run_tool([tool, str(pdf)], keep=1 << 20, timeout=30)
        launcher.append(time.perf_counter() - started)
        assert ended.returncode == 0 and ended.stdout
        started = time.perf_counter()
        child = await asyncio.create_subprocess_exec(tool, str(pdf), stdout=asyncio.subprocess.PIPE,
                                                     stderr=asyncio.subprocess.PIPE)
        out, _err = await child.communicate()
        loop_exec.append(time.perf_counter() - started)
        assert child.returncode == 0 and out
    return launcher, loop_exec


def launch(args: argparse.Namespace) -> None:
    """One poppler tool started by the daemon's launcher against the loop's own subprocess, in this
    process (its memory as the daemon's is, some tens of MB) on the daemon's event loop."""
    from daemon.server import new_event_loop

    with temp_dir("asst-bench-launch-") as folder:
        pdf = make_pdf(folder / "one.pdf", ["one page"])
        loop = new_event_loop()
        try:
            launcher, loop_exec = loop.run_until_complete(_launch_times(pdf, args.launch_runs))
        finally:
            loop.close()
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    print(f"pdfinfo on a one-page PDF, {args.launch_runs} runs each, alternately, from this process "
          f"(loop: {type(loop).__module__}, RSS {rss:.0f} MB):")
    print(f"  core.process.run_tool (vfork, pidfd):    {ms(median(launcher))} median ({ms(min(launcher))}-{ms(max(launcher))})")
    print(f"  loop.subprocess_exec (what it replaced): {ms(median(loop_exec))} median ({ms(min(loop_exec))}-{ms(max(loop_exec))})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="asks per case (default 7)")
    parser.add_argument("--png-runs", type=int, default=3,
                        help="bare pdftoppm -png runs, 4-8 s each on 2 cores (default 3)")
    parser.add_argument("--size-mib", type=int, default=1024, help="size of each big text file (default 1024)")
    parser.add_argument("--scale", type=int, default=8, help="the second text case's files are this much larger (default 8)")
    parser.add_argument("--pdf-pages", type=int, default=2000, help="pages of the big PDF (default 2000)")
    parser.add_argument("--launch-runs", type=int, default=50, help="tool starts each way for --part launch (default 50)")
    parser.add_argument("--part", choices=("all", "timing", "memory", "launch"), default="all")
    parser.add_argument("--profile", action="store_true", help="run the timing daemon under cProfile and print its hot spots")
    args = parser.parse_args(argv)
    if args.runs < 1 or not 1 <= args.png_runs <= args.runs:
        parser.error("--runs must be at least 1 and --png-runs between 1 and --runs")
    terminate_on_sigterm()
    header("bench_attachments: PDF ask -> request at the router; peak memory with 8 big files")
    if args.part in ("all", "timing"):
        timing(args)
    if args.part in ("all", "memory"):
        memory(args)
    if args.part in ("all", "launch"):
        launch(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
