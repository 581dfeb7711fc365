"""The operations on PDFs: merge and pages by the worker (pypdf), Markdown by poppler's XML."""

from __future__ import annotations

import asyncio
import hashlib
import json

from core.errors import OutputTooLarge

from .job import Job, ProgressUnit
from .markdown import pages_markdown, parse_pages
from .process import need_tool, run_tool, worker_args

__all__ = ["pdf_merge", "pdf_pages", "pdf_to_markdown"]


async def _worker(job: Job, operation: str, name: str, unit: ProgressUnit) -> None:
    staged = job.stage(name)
    request = {"files": [str(path) for path, _ in job.inputs], "kinds": [kind for _, kind in job.inputs],
               "options": job.options, "output": str(staged.temporary), "max_bytes": job.max_bytes}

    def on_line(line: bytes) -> None:
        step = json.loads(line)
        job.report(step["done"], step["total"], unit)

    await run_tool(worker_args(operation, json.dumps(request)), name=job.first.name, on_line=on_line)


async def pdf_merge(job: Job) -> None:
    await _worker(job, "pdf_merge", f"{job.first.stem} merged.pdf", "files")


async def pdf_pages(job: Job) -> None:
    pages = job.options["pages"].replace(" ", "")
    await _worker(job, "pdf_pages", f"{job.first.stem} {'pages ' + pages if pages else 'pages'}.pdf", "pages")


async def pdf_to_markdown(job: Job) -> None:
    """The text layer as Markdown; pages without one read by OCR when tesseract is installed."""
    path = job.first
    xml = await run_tool([need_tool("pdftohtml"), "-xml", "-i", "-stdout", "-q", "-nodrm", str(path)],
                         name=path.name, keep=job.max_bytes)
    pages = await asyncio.to_thread(lambda: pages_markdown(parse_pages(xml.stdout)))
    job.report(len(pages), len(pages), "pages")
    scanned = [number for number, text in enumerate(pages, start=1) if not text]
    if scanned and (await job.ocr.support()).available:
        sha256 = await asyncio.to_thread(lambda: hashlib.sha256(path.read_bytes()).hexdigest())
        read = await job.ocr.read_pages(str(path), path.name, sha256, scanned, {})
        pages = [text or (read.get(number) or "").strip() for number, text in enumerate(pages, start=1)]
    document = "\n\n".join(text for text in pages if text).strip() + "\n"
    data = document.encode()
    if len(data) > job.max_bytes:
        raise OutputTooLarge(f"the Markdown would take {len(data)} bytes, past convert_max_bytes ({job.max_bytes})")
    staged = job.stage(path.stem + ".md")
    await asyncio.to_thread(staged.write, data)  # its digest taken from the bytes in hand, not read back
