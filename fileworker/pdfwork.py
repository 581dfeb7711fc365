"""PDFs merged and cut with pypdf, images made pages with Pillow (run by the worker, not the daemon)."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError
from pypdf import PdfReader, PdfWriter
from pypdf.errors import PyPdfError

from .failure import OutputTooLarge, WorkFailed

__all__ = ["merge_pdfs", "parse_pages", "select_pages"]

Progress = Callable[[int, int], None]
IMAGE_DPI = 150.0  # an image becomes a page of its pixels at this resolution (A4-ish for a phone photo)


def merge_pdfs(request: dict[str, Any], progress: Progress) -> None:
    """``files`` (PDFs, and images each as a page) in their order into ``output``."""
    writer = PdfWriter()
    files: list[str] = request["files"]
    for done, path in enumerate(files):
        reader = _image_pdf(path) if request["kinds"][done] == "image" else _open_pdf(path)
        for page in reader.pages:
            writer.add_page(page)
        progress(done + 1, len(files))
    _write(writer, request)


def select_pages(request: dict[str, Any], progress: Progress) -> None:
    """The ``pages`` of ``files[0]`` (all when empty), each turned by ``rotate``, into ``output``."""
    path = request["files"][0]
    reader = _open_pdf(path)
    numbers = parse_pages(request["options"]["pages"], len(reader.pages), Path(path).name)
    writer = PdfWriter()
    for done, number in enumerate(numbers, start=1):
        page = writer.add_page(reader.pages[number - 1])
        if request["options"]["rotate"]:
            page.rotate(request["options"]["rotate"])
        progress(done, len(numbers))
    _write(writer, request)


def parse_pages(spec: str, total: int, name: str) -> list[int]:
    """``"1-3,5,7-"`` as page numbers in that order; ``""`` is every page."""
    if not spec.strip():
        return list(range(1, total + 1))
    numbers: list[int] = []
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            start = int(first) if first else 1
            end = (int(last) if last else total) if dash else start
        except ValueError:
            raise WorkFailed(f"pages {spec!r}: write page numbers and ranges, such as 1-3,5") from None
        if not 1 <= start <= end <= total:
            raise WorkFailed(f"{name} has {total} pages: pages {part.strip()!r} is not within 1-{total}")
        numbers.extend(range(start, end + 1))
    return numbers


def _open_pdf(path: str) -> PdfReader:
    name = Path(path).name
    try:
        reader = PdfReader(path)
        if reader.is_encrypted:
            raise WorkFailed(f"{name}: the PDF is password-protected; use an unlocked copy")
        len(reader.pages)  # a damaged page tree shows here, not at the first page
    except (PyPdfError, ValueError, KeyError, OSError) as exc:
        raise WorkFailed(f"{name}: not a readable PDF ({exc}); check that the file is whole") from None
    return reader


def _image_pdf(path: str) -> PdfReader:
    """An image as a one-page PDF of its pixels."""
    try:
        with Image.open(path) as image:
            buffer = io.BytesIO()
            image.convert("RGB").save(buffer, "PDF", resolution=IMAGE_DPI)
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise WorkFailed(f"{Path(path).name}: not a readable image ({exc}); check that the file is whole") from None
    return PdfReader(buffer)


def _write(writer: PdfWriter, request: dict[str, Any]) -> None:
    buffer = io.BytesIO()
    writer.write(buffer)
    if buffer.tell() > request["max_bytes"]:
        raise OutputTooLarge(f"the PDF would take {buffer.tell()} bytes, past convert_max_bytes "
                             f"({request['max_bytes']}); raise it or merge fewer files")
    Path(request["output"]).write_bytes(buffer.getvalue())
