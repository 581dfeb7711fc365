#!/usr/bin/env python3
"""OCR: four scanned pages made ready for a text-only model, cold and cached, against a direct run.

A PDF of four scanned pages is built with ``selfcheck/samples.py`` (``Scan``: 150 dpi
pictures of a few lines of text each, ``grain`` for a scanner's noise, no text layer).
Each run makes it ready for a model without vision the way a question does:
``attachments.prepare_files(..., vision=False)``, in this process, which renders
each page with ``pdftoppm`` and reads it with ``tesseract`` (``attachments/ocr.py``):

- **cold**: a fresh OCR cache every run; target: within 1.2x of the direct run;
- **cached**: the same file again with the cache of the run before; target: 50 ms.

The direct run is what a person would type: ``pdftoppm -r 150 -gray FILE PREFIX`` over
the four pages (one call), then ``tesseract PAGE stdout`` on each page in turn, tesseract
with its defaults (its own threads on every core).  Runs alternate, ``--runs`` of each;
the medians are compared.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchlib import header, median, ms, temp_dir, terminate_on_sigterm, verdict

from attachments import FileReaders, Ocr, prepare_files
from selfcheck.samples import Scan, make_pdf

PAGES = 4
LINES = (
    "Invoice {n} from the kestrel aviary",
    "Seed mix, twelve sacks, delivered on Friday",
    "Perches and nesting boxes, repaired",
    "Total due within thirty days of this letter",
)


def scanned_pdf(path: Path) -> Path:
    text = "\n".join(LINES).format(n=48210)
    return make_pdf(path, [Scan(text.replace("48210", str(48210 + n)), grain=True, font_px=32) for n in range(PAGES)])


def direct(pdf: Path, scratch: Path) -> float:
    """pdftoppm over the pages, then tesseract on each in turn: seconds."""
    started = time.perf_counter()
    subprocess.run(["pdftoppm", "-r", "150", "-gray", str(pdf), str(scratch / "page")], check=True)
    for page in sorted(scratch.glob("page-*.pgm")):
        subprocess.run(["tesseract", str(page), "stdout"], check=True, capture_output=True)
    return time.perf_counter() - started


async def ready(pdf: Path, cache: Path) -> tuple[float, str]:
    """The PDF prepared for a text-only model, with ``cache`` as the OCR cache: seconds, its block."""
    readers = FileReaders(ocr=Ocr(cache))
    started = time.perf_counter()
    [prepared] = await prepare_files([str(pdf)], readers, model="text-only", vision=False, ctx_max=32768, ctx_used=0)
    return time.perf_counter() - started, prepared.text_block or ""


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    terminate_on_sigterm()
    header("OCR: four scanned pages for a text-only model")
    if not shutil.which("tesseract"):
        print("tesseract is not installed (apt-get install tesseract-ocr tesseract-ocr-eng): nothing to measure")
        return 0
    cold: list[float] = []
    cached: list[float] = []
    baseline: list[float] = []
    with temp_dir("ocr") as tmp:
        pdf = scanned_pdf(tmp / "scans.pdf")
        for run in range(args.runs):
            pages = tmp / f"direct-{run}"
            pages.mkdir()
            baseline.append(direct(pdf, pages))
            cache = tmp / f"cache-{run}"
            seconds, block = await ready(pdf, cache)
            cold.append(seconds)
            if run == 0:
                read = sum(f"Invoice {48210 + n}" in block for n in range(PAGES))
                print(f"pages whose invoice number OCR read right: {read} of {PAGES}")
            cached.append((await ready(pdf, cache))[0])
    print(f"direct (pdftoppm + tesseract): median {ms(median(baseline))} of {args.runs}")
    print(f"daemon, cold:                  median {ms(median(cold))}  ({median(cold) / median(baseline):.2f}x)")
    print(f"daemon, cached:                median {ms(median(cached))}")
    print(f"target: cold within 1.2x of the direct run: {verdict(median(cold) <= 1.2 * median(baseline))}")
    print(f"target: cached within 50 ms: {verdict(median(cached) <= 0.050)}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
