"""PDFs: the text layer through ``pdftotext``, pages without text rendered as images.

The rules (docs/DESIGN.md, "Attachments"): ``pdftotext -layout`` per page in one
block; a page with no text (whitespace only) is rendered at 150 dpi, lowered so
its longest side stays within 1600 px (never raised), and sent as an image; at
most four such pages, further ones listed as not shown.

How, and why:

- Text comes from ONE ``pdftotext -layout`` run over the whole document (at most
  ``MAX_TEXT_PAGES`` pages), split at the form feeds poppler ends every page
  with.  One process is far cheaper than one per page.  ``pdfinfo`` runs beside
  it for the page count and page sizes.
- A page is rendered with ``pdftoppm`` to PPM on stdout, and Pillow encodes the
  PNG at ``compress_level`` 1: ``pdftoppm -png`` spends most of its time in zlib at
  the default level, several times what rendering to PPM takes
  (``bench/bench_attachments.py``).  Pages render
  ``RENDER_CONCURRENCY`` (2) at a time per question, which keeps two cores busy
  without crowding the rest of the daemon.
- The resolution is chosen from the page size ``pdfinfo`` reports: 150 dpi, or
  ``-scale-to 1600`` when 150 dpi would pass 1600 px.  Pillow scales down
  whatever still comes out larger (a crop box and media box that disagree).
- Every poppler call runs through the daemon's launcher (``core.process``: started
  without forking the daemon, in a process group of its own) under a timeout; on
  timeout or cancel the group is killed and the file refused ("took too long").
  Output is capped (the tool stopped past it), so a hostile PDF cannot fill memory.
- Without poppler (``pdftotext``, ``pdftoppm`` or ``pdfinfo`` missing from
  ``PATH``) the text comes from pypdf in a worker thread, one warning is logged,
  and pages without text are listed as not shown: nothing can render them.
"""

from __future__ import annotations

import asyncio
import io
import logging
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field

from core import process
from core.errors import FileRefused, ToolMissing
from core.files import open_regular

from .budget import FULL_TEXT_CAP
from .images import EncodedImage, encode_png, pillow
from .tasks import gather_all

__all__ = [
    "MAX_OCR_PAGES",
    "MAX_PAGE_IMAGES",
    "MAX_PAGE_SIDE",
    "OCR_MARK",
    "MAX_TEXT_PAGES",
    "PAGE_BREAK",
    "PAGE_MARKER",
    "RENDER_CONCURRENCY",
    "RENDER_DPI",
    "PdfText",
    "poppler_available",
    "read_text",
    "render_gray",
    "render_page",
]

logger = logging.getLogger(__name__)

POPPLER_TOOLS = ("pdftotext", "pdftoppm", "pdfinfo")
# between two pages: pdftotext ends every page with a form feed, and the full text
# stored for recall keeps one between pages, so split(PAGE_BREAK)[n - 1] is page n
PAGE_BREAK = "\f"
# the line before each page's text in a PDF's block (and in a whole PDF read again)
PAGE_MARKER = "[page {n}]"
# text is extracted from at most this many pages; the block says when more exist
MAX_TEXT_PAGES = 2000
# page images sent per PDF: about 3,000 tokens at the flat image cost
MAX_PAGE_IMAGES = 4
# pages of one PDF read by OCR for a question (tesseract takes about a second a page a core: ocr.py)
MAX_OCR_PAGES = 16
# opens the OCR text of a page (or an image) wherever it is kept
OCR_MARK = "[read by OCR]"
# render at 150 dpi, lowered to keep the longest side within 1600 px (vision encoders
# resize to about 1000 px anyway; images.py)
RENDER_DPI = 150
MAX_PAGE_SIDE = 1600
POINTS_PER_INCH = 72
# pages rendered at once within one question (two cores' worth)
RENDER_CONCURRENCY = 2
# zlib level for rendered pages: level 1 is several times faster than the default
PAGE_PNG_LEVEL = 1
# seconds before a poppler call is killed and the file refused
TEXT_TIMEOUT = 60.0
INFO_TIMEOUT = 30.0
RENDER_TIMEOUT = 30.0
PYPDF_TIMEOUT = 120.0
# bytes of pdftotext output kept: enough for FULL_TEXT_CAP characters of UTF-8
MAX_TEXT_OUTPUT = 4 * FULL_TEXT_CAP
# bytes of one rendered PPM: a 1600 px page is under 8 MB; this allows a mismatched box
MAX_RENDER_OUTPUT = 64 * 1024 * 1024
# bytes of pdfinfo's answer for one page
INFO_OUTPUT = 16 * 1024

_PAGES = re.compile(rb"^Pages:\s+(\d+)", re.MULTILINE)
_PAGE_SIZE = re.compile(rb"^Page\s+(\d+)\s+size:\s+([\d.]+)\s+x\s+([\d.]+)", re.MULTILINE)

_warned_no_poppler = False


@dataclass
class PdfText:
    """A PDF's text layer, page by page, and what is known of its pages."""

    page_texts: list[str]
    total_pages: int
    sizes: dict[int, tuple[float, float]] = field(default_factory=dict)
    cut: bool = False
    renderable: bool = True

    def blank_pages(self) -> list[int]:
        """1-based numbers of the read pages whose text is whitespace only."""
        return [number for number, text in enumerate(self.page_texts, start=1) if not text.strip()]


def poppler_available() -> bool:
    """Whether all of poppler's tools are on PATH; warn once (per process) when not."""
    global _warned_no_poppler
    if all(shutil.which(tool) for tool in POPPLER_TOOLS):
        return True
    if not _warned_no_poppler:
        _warned_no_poppler = True
        logger.warning(
            "poppler (pdftotext, pdftoppm, pdfinfo) is not installed: PDF text comes from pypdf "
            "and scanned PDF pages cannot be rendered; install poppler-utils"
        )
    return False


async def run_tool(
    args: list[str], *, name: str, timeout: float, max_output: int, stdin: bytes | None = None,
    env: dict[str, str] | None = None,
) -> tuple[bytes, bool]:
    """Run a poppler tool (or tesseract: ``ocr.py``) through the daemon's launcher
    (``core.process``); return its stdout (at most ``max_output`` bytes: past them the tool is
    stopped) and whether it was cut. ``stdin`` is written to the tool's input.

    Raises FileRefused when the tool times out, fails or cannot be started.
    """
    tool = args[0].rsplit("/", 1)[-1]
    try:
        ended = await process.run_tool(args, keep=max_output, stdin=stdin, timeout=timeout, env=env)
    except TimeoutError:
        raise FileRefused(
            f"{name}: reading the PDF took too long ({tool} ran over {timeout:g} s); "
            "try a smaller PDF or split it"
        ) from None
    except ToolMissing as exc:
        raise FileRefused(f"{name}: {exc.message}") from None
    except OSError as exc:
        package = process.PACKAGES.get(tool, tool)
        raise FileRefused(
            f"{name}: {tool} could not be started ({exc.strerror}); check the {package} installation"
        ) from None
    if ended.stderr:
        logger.debug("%s on %s said: %s", tool, name, ended.stderr.decode("utf-8", "replace").strip())
    if ended.returncode != 0 and not ended.cut:
        raise _failed(name, tool, ended.stderr, ended.returncode)
    return ended.stdout, ended.cut


def _failed(name: str, tool: str, stderr: bytes, returncode: int) -> FileRefused:
    """The refusal of a PDF a poppler tool could not read."""
    lines = [line.strip() for line in stderr.decode("utf-8", "replace").splitlines() if line.strip()]
    if any("password" in line.lower() for line in lines):
        return FileRefused(f"{name}: the PDF is password-protected; attach an unlocked copy")
    detail = lines[-1][:200] if lines else f"exit status {returncode}"
    return FileRefused(f"{name}: not a readable PDF ({tool}: {detail}); check the file or attach another copy")


def _split_pages(output: bytes, cut: bool) -> tuple[list[str], bool]:
    """pdftotext's output as one string per page; whether it was cut."""
    text = output.decode("utf-8", "replace")
    if len(text) > FULL_TEXT_CAP:
        text, cut = text[:FULL_TEXT_CAP], True
    pages = text.split(PAGE_BREAK)
    # every page ends with a form feed, so a complete output ends with an empty piece
    if pages and pages[-1] == "" and not cut:
        pages.pop()
    return pages, cut


def _parse_info(output: bytes) -> tuple[int | None, dict[int, tuple[float, float]]]:
    """The page count and per-page sizes (points) from ``pdfinfo -f 1 -l N``."""
    count = _PAGES.search(output)
    sizes = {int(m[1]): (float(m[2]), float(m[3])) for m in _PAGE_SIZE.finditer(output)}
    return (int(count[1]) if count else None), sizes


async def _poppler_text(path: str, name: str) -> PdfText:
    """The text layer through one pdftotext run, with pdfinfo's facts beside it."""
    last = str(MAX_TEXT_PAGES)
    text_call = run_tool(
        [shutil.which("pdftotext") or "pdftotext", "-layout", "-enc", "UTF-8", "-l", last, path, "-"],
        name=name, timeout=TEXT_TIMEOUT, max_output=MAX_TEXT_OUTPUT,
    )
    info_call = run_tool(
        [shutil.which("pdfinfo") or "pdfinfo", "-f", "1", "-l", last, path],
        name=name, timeout=INFO_TIMEOUT, max_output=MAX_TEXT_OUTPUT,
    )
    (text_out, text_cut), (info_out, _) = await gather_all([text_call, info_call])
    pages, cut = _split_pages(text_out, text_cut)
    count, sizes = _parse_info(info_out)
    total = max(count or 0, len(pages))
    return PdfText(pages, total, sizes, cut=cut, renderable=True)


def _pypdf_text(path: str, name: str) -> PdfText:
    """The text layer through pypdf (blocking; poppler is missing)."""
    from pypdf import PdfReader

    texts: list[str] = []
    length = 0
    cut = False
    with open_regular(path) as handle:
        try:
            reader = PdfReader(handle)
            if reader.is_encrypted and not reader.decrypt(""):
                raise FileRefused(f"{name}: the PDF is password-protected; attach an unlocked copy")
            total = len(reader.pages)
            for index in range(min(total, MAX_TEXT_PAGES)):
                page = reader.pages[index].extract_text() or ""
                texts.append(page)
                length += len(page)
                if length > FULL_TEXT_CAP:
                    cut = True
                    break
        except FileRefused:
            raise
        except Exception as exc:  # pypdf raises many kinds on damaged input
            logger.debug("pypdf could not read %s", name, exc_info=True)
            raise FileRefused(
                f"{name}: not a readable PDF ({type(exc).__name__}); check the file or attach another copy"
            ) from None
    return PdfText(texts, total, cut=cut, renderable=False)


async def read_text(path: str, name: str) -> PdfText:
    """The PDF's text layer, through poppler when installed, else pypdf."""
    if poppler_available():
        return await _poppler_text(path, name)
    try:
        return await asyncio.wait_for(asyncio.to_thread(_pypdf_text, path, name), PYPDF_TIMEOUT)
    except TimeoutError:
        raise FileRefused(
            f"{name}: reading the PDF took too long (over {PYPDF_TIMEOUT:.0f} s); try a smaller PDF or split it"
        ) from None


def _scale_args(size: tuple[float, float] | None) -> list[str]:
    """pdftoppm's resolution options: 150 dpi, or fit 1600 px when 150 dpi would pass it."""
    if size is not None and max(size) / POINTS_PER_INCH * RENDER_DPI > MAX_PAGE_SIDE:
        return ["-scale-to", str(MAX_PAGE_SIDE)]
    return ["-r", str(RENDER_DPI)]


def _encode_ppm(ppm: bytes, name: str) -> EncodedImage:
    """A rendered PPM page as a PNG data URL within ``MAX_PAGE_SIDE`` (blocking)."""
    try:
        with pillow().open(io.BytesIO(ppm)) as image:
            image.load()
            return encode_png(image, MAX_PAGE_SIDE, PAGE_PNG_LEVEL)
    except (OSError, SyntaxError, ValueError) as exc:
        raise FileRefused(f"{name}: a page could not be rendered ({exc}); check the PDF") from None


async def render_page(
    path: str,
    name: str,
    page: int,
    size: tuple[float, float] | None,
    limit: asyncio.Semaphore,
) -> EncodedImage:
    """Render ``page`` (1-based) of the PDF at ``path`` as a PNG data URL.

    ``size`` is the page size in points (from pdfinfo) when known; ``limit``
    bounds how many pages render at once.
    """
    async with limit:
        ppm = await _render(path, name, page, size)
        return await asyncio.to_thread(_encode_ppm, ppm, name)


async def render_gray(path: str, name: str, page: int, size: tuple[float, float] | None) -> bytes:
    """``page`` rendered in grey as a PGM (for tesseract: ``ocr.py``), at ``render_page``'s scale."""
    return await _render(path, name, page, size, "-gray")


async def _render(path: str, name: str, page: int, size: tuple[float, float] | None, *options: str) -> bytes:
    """``page`` as pdftoppm renders it (PPM, or PGM with ``-gray``), within the output cap."""
    args = [shutil.which("pdftoppm") or "pdftoppm", *options, *_scale_args(size), "-f", str(page), "-l", str(page),
            path]
    image, cut = await run_tool(args, name=name, timeout=RENDER_TIMEOUT, max_output=MAX_RENDER_OUTPUT)
    if cut:
        raise FileRefused(f"{name}: page {page} is too large to render; attach a smaller PDF")
    if not image:
        raise FileRefused(f"{name}: page {page} does not exist or could not be rendered; check the PDF")
    return image


async def page_size(path: str, name: str, page: int) -> tuple[float, float] | None:
    """The size in points of one page, from pdfinfo (None when it does not say)."""
    info, _ = await run_tool(
        [shutil.which("pdfinfo") or "pdfinfo", "-f", str(page), "-l", str(page), path],
        name=name, timeout=INFO_TIMEOUT, max_output=INFO_OUTPUT,
    )
    return _parse_info(info)[1].get(page)


def pages_to_show(text: PdfText, limit: int = MAX_PAGE_IMAGES) -> tuple[list[int], list[int]]:
    """The pages without text split into those sent as images (or read by OCR, ``limit``
    ``MAX_OCR_PAGES``) and those only listed."""
    blank = text.blank_pages()
    if not text.renderable:
        return [], blank
    return blank[:limit], blank[limit:]


def pdf_body(text: PdfText, shown: list[int], read: Mapping[int, str | None] | None = None) -> str:
    """The page-marked text of a PDF's block: ``PAGE_MARKER`` before each page's text.

    ``read``: the pages read by OCR for a model without vision (None for a page tesseract
    could not read); given, pages past them are listed as not read by OCR.
    """
    parts: list[str] = []
    for number, page in enumerate(text.page_texts, start=1):
        if page.strip():
            parts.append(f"{PAGE_MARKER.format(n=number)}\n{page.rstrip()}\n")
        elif number in shown:
            parts.append(f"[page {number}: no text layer, sent as an image]\n")
        elif read is not None and number in read:
            parts.append(_ocr_page(number, read[number]))
        elif read is not None:
            parts.append(f"[page {number}: scanned, not read — only {MAX_OCR_PAGES} pages are read by OCR]\n")
        elif text.renderable:
            parts.append(
                f"[page {number}: scanned, not shown — only {MAX_PAGE_IMAGES} page images are sent]\n"
            )
        else:
            parts.append(f"[page {number}: scanned, not shown — poppler is not installed to render it]\n")
    if text.cut:
        parts.append("[the text stops here: the document's text passed the size limit]\n")
    elif len(text.page_texts) < text.total_pages:
        parts.append(
            f"[pages {len(text.page_texts) + 1}–{text.total_pages} not read: "
            f"text is taken from the first {MAX_TEXT_PAGES} pages only]\n"
        )
    # a blank line between pages keeps the markers easy to see
    return "\n".join(parts)


def _ocr_page(number: int, found: str | None) -> str:
    """A scanned page's place in a PDF's block for a model without vision."""
    if found is None:
        return f"[page {number}: scanned, could not be read by OCR]\n"
    if not found.strip():
        return f"[page {number}: scanned; OCR found no text on it]\n"
    return f"[page {number}, {OCR_MARK[1:-1]}]\n{found}\n"


def pdf_full_text(text: PdfText, read: Mapping[int, str | None] | None = None) -> str:
    """The text kept for recall: the pages joined by ``PAGE_BREAK``, as pdftotext separates them.

    ``full_text.split(PAGE_BREAK)[n - 1]`` is page n; a page without a text layer that was
    read by OCR (``read``) holds its OCR text after ``OCR_MARK``.  A note closes it when
    pages or text were left out.
    """
    full = with_ocr_text(PAGE_BREAK.join(text.page_texts), read or {})
    if text.cut:
        full += f"\n[… the text stops here: only the first {FULL_TEXT_CAP} characters are kept]"
    elif len(text.page_texts) < text.total_pages:
        full += f"\n[… pages {len(text.page_texts) + 1}–{text.total_pages} were not read]"
    return full


def with_ocr_text(full: str, read: Mapping[int, str | None]) -> str:
    """A PDF's recall text (pages joined by ``PAGE_BREAK``) with the OCR text of its pages
    without a text layer (``read``, by page) after ``OCR_MARK``."""
    return PAGE_BREAK.join(
        f"{OCR_MARK}\n{found}" if not page.strip() and (found := read.get(number)) else page
        for number, page in enumerate(full.split(PAGE_BREAK), start=1)
    )


async def render_pdf_page(path: str, name: str, page: int, limit: asyncio.Semaphore) -> EncodedImage:
    """Render one page as ``prepare`` does, asking pdfinfo for its size first (for image refs)."""
    if not poppler_available():
        raise FileRefused(f"{name}: page {page} cannot be rendered: poppler is not installed")
    return await render_page(path, name, page, await page_size(path, name, page), limit)
