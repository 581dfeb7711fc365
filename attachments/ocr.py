"""Scanned pages and screenshots read by tesseract, for models that cannot see images.

The rules (docs/DESIGN.md, "Attachments"): a PDF page without a text layer, for a model
without image input, is rendered by ``pdftoppm`` and read by ``tesseract``; the model
gets its text in the page's place, marked as read by OCR.  For a vision model the page
goes as an image and is read beside the reply (``extract.read_sent_pages``), its text kept
for recall and search all the same.

How, and why:

- tesseract runs through ``pdf.run_tool`` (the daemon's launcher), under the same bounds as
  poppler: a timeout (killed and reaped, also on cancel), capped output, the rendered
  page (itself capped) written to its input.  ``OMP_THREAD_LIMIT=1``: tesseract's own
  threads fight for the cores the pages already share (``bench/bench_ocr.py``).
- At most ``OCR_CONCURRENCY`` pages are read at once, daemon-wide (up to 4, one a core),
  and at most ``pdf.MAX_OCR_PAGES`` pages of one PDF for a question (``KB_OCR_PAGES`` for a
  knowledge base); further pages are listed as not read.
- What a page read is kept per file hash, page and languages in ``<data dir>/ocr``
  (``CACHE_BYTES`` at most, least recently used first out), so a later turn, a re-read or
  a knowledge base over the same file runs tesseract again for nothing.
- Whether OCR is available is asked of tesseract once (``--list-langs``): the binary and
  every configured language (``ocr_languages``) must be there, else the refusal and
  ``status`` name the Debian package to install.  Only a positive answer is kept, so a
  package installed while the daemon runs is seen at the next question.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import FileRefused

from . import pdf
from .imagecache import evict_least_used
from .tasks import gather_all

__all__ = [
    "KB_OCR_PAGES",
    "OCR_PAGE_CHARS",
    "Ocr",
    "OcrProgress",
    "OcrSupport",
]

logger = logging.getLogger(__name__)

OCR_TOOL = "tesseract"
DEFAULT_LANGUAGES = "eng"
# pages of one PDF read by OCR for a knowledge base: an ingest runs in the background
KB_OCR_PAGES = 200
# characters an estimate counts for a page it would read by OCR (a typed page holds 1,500-3,000)
OCR_PAGE_CHARS = 2000
# pages read at once, daemon-wide: one a core, at most four
OCR_CONCURRENCY = max(1, min(4, os.cpu_count() or 1))
OCR_TIMEOUT = 60.0  # seconds for one page before tesseract is killed
LIST_TIMEOUT = 10.0  # seconds for ``tesseract --list-langs``
MAX_OCR_OUTPUT = 1024 * 1024  # bytes of text kept from one page: far beyond any page
CACHE_BYTES = 32 * 1024 * 1024
CACHE_VERSION = 1  # part of each entry's name: a change in how pages are read starts afresh


@dataclass(frozen=True)
class OcrSupport:
    """Whether pages can be read by OCR, in which languages, and if not, what to install."""

    available: bool
    languages: tuple[str, ...]  # the configured ones
    installed: tuple[str, ...] = ()  # what tesseract has
    note: str | None = None  # why not, naming the Debian packages to install
    images: bool = False  # whether image files are read for models without vision (``ocr_images``)

    def to_json(self) -> dict[str, Any]:
        """``status``'s ``ocr``."""
        return {"available": self.available, "languages": list(self.languages),
                "installed": list(self.installed), "images": self.images, "note": self.note}


def package_of(language: str) -> str:
    """The Debian package of a tesseract language (``chi_sim`` is ``tesseract-ocr-chi-sim``)."""
    return "tesseract-ocr-" + language.lower().replace("_", "-")


def _installed_languages() -> tuple[str, ...] | None:
    """The languages in tesseract's data folder (``$TESSDATA_PREFIX``, else where the Debian and
    upstream packages put it), None when there is no such folder (blocking). Looking costs far
    less than starting tesseract, so ``status`` answers at once."""
    prefix = os.environ.get("TESSDATA_PREFIX")
    places = [Path(prefix), Path(prefix) / "tessdata"] if prefix else [
        *sorted(Path("/usr/share/tesseract-ocr").glob("*/tessdata"), reverse=True),
        Path("/usr/share/tessdata"), Path("/usr/local/share/tessdata"),
    ]
    for place in places:
        found = sorted(entry.name.removesuffix(".traineddata") for entry in _entries(place)
                       if entry.name.endswith(".traineddata"))
        if found:
            return tuple(found)
    return None


def _entries(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


class OcrProgress:
    """Counts a question's pages read by OCR and reports ``(done, total)`` on each change."""

    def __init__(self, report: Callable[[int, int], None] | None = None) -> None:
        self.report = report
        self.done = 0
        self.total = 0

    def planned(self, pages: int) -> None:
        if pages:
            self.total += pages
            self._tell()

    def finished(self) -> None:
        self.done += 1
        self._tell()

    def _tell(self) -> None:
        if self.report is not None:
            self.report(self.done, self.total)


def _clean(output: bytes) -> str:
    """tesseract's text: its form feed (page end) dropped, which would split pages in the text
    kept for recall (``pdf.PAGE_BREAK``), and trailing blanks trimmed."""
    text = output.decode("utf-8", "replace").replace(pdf.PAGE_BREAK, "").replace("\x00", "")
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


class Ocr:
    """Tesseract for the daemon: its languages, the cache of pages read and the bound on pages
    read at once. Made once at start by the server and handed to what reads files."""

    def __init__(self, folder: Path | None = None, languages: str = DEFAULT_LANGUAGES, images: bool = False) -> None:
        """Read in ``languages`` (tesseract's ``eng+deu``), keep pages read in ``folder`` (made 0700
        when missing; None keeps none); ``images``: read image files for models without vision."""
        self.languages = languages
        self.images = images
        self.cache_dir: Path | None = None
        self._support: OcrSupport | None = None  # kept once available
        self._limit: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        if folder is not None:
            try:
                folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                self.cache_dir = folder
            except OSError as exc:
                logger.warning("cannot use %s (%s): scanned pages are read again on every turn", folder, exc)

    async def support(self) -> OcrSupport:
        """Whether tesseract and the configured languages are installed (asked once it is)."""
        if self._support is not None:
            return self._support
        wanted = tuple(self.languages.split("+"))
        packages = " and ".join(["tesseract-ocr", *map(package_of, wanted)])
        binary = shutil.which(OCR_TOOL)
        if binary is None:
            why = f"tesseract is not installed: install {packages} to read scanned pages"
            return OcrSupport(False, wanted, note=why, images=self.images)
        installed = await asyncio.to_thread(_installed_languages)
        if installed is None:  # its data is not where a package puts it: tesseract says where
            try:
                out, _ = await pdf.run_tool([binary, "--list-langs"], name=OCR_TOOL, timeout=LIST_TIMEOUT,
                                           max_output=MAX_OCR_OUTPUT)
            except FileRefused as exc:
                why = f"tesseract does not answer ({exc.message}); reinstall {packages}"
                return OcrSupport(False, wanted, note=why, images=self.images)
            installed = tuple(line.strip() for line in out.decode("utf-8", "replace").splitlines()[1:] if line.strip())
        missing = [language for language in wanted if language not in installed]
        if missing:
            return OcrSupport(False, wanted, installed, note=(
                f"tesseract has no {'+'.join(missing)} language data: install "
                f"{' and '.join(map(package_of, missing))} to read scanned pages"), images=self.images)
        self._support = OcrSupport(True, wanted, installed, images=self.images)
        return self._support

    def _bound(self) -> asyncio.Semaphore:
        """The daemon-wide bound on pages read at once (one per event loop: the tests run many)."""
        loop = asyncio.get_running_loop()
        if self._limit is None or self._loop is not loop:
            self._limit, self._loop = asyncio.Semaphore(OCR_CONCURRENCY), loop
        return self._limit

    def _entry(self, sha256: str, page: int) -> Path | None:
        if self.cache_dir is None:
            return None
        return self.cache_dir / f"{sha256}.p{page}.{self.languages}.v{CACHE_VERSION}"

    def _cached(self, sha256: str, page: int) -> str | None:
        """A page's text as read before, if the cache holds it (blocking)."""
        entry = self._entry(sha256, page)
        if entry is None:
            return None
        try:
            text = entry.read_text("utf-8")
            os.utime(entry)  # recently used: evicted last
        except (OSError, ValueError):
            return None
        return text

    def _store(self, sha256: str, page: int, text: str) -> None:
        """Keep a page's text; a failure (a full disk) only costs reading it again later (blocking)."""
        entry = self._entry(sha256, page)
        if entry is None:
            return
        temporary = entry.with_suffix(".tmp")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
            os.replace(temporary, entry)
        except OSError as exc:
            logger.debug("ocr cache: %s page %d not kept (%s)", sha256, page, exc)
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
            return
        evict_least_used(entry.parent, CACHE_BYTES)

    async def cached(self, sha256: str, pages: Sequence[int]) -> dict[int, str]:
        """The text of those ``pages`` read before (the cache holds it), reading none."""
        found = {page: await asyncio.to_thread(self._cached, sha256, page) for page in pages}
        return {page: text for page, text in found.items() if text is not None}

    async def _read_page(self, path: str, name: str, page: int, size: tuple[float, float] | None) -> str:
        """One PDF page rendered in grey and read; raises FileRefused when either tool fails."""
        async with self._bound():
            gray = await pdf.render_gray(path, name, page, size)
            return await _tesseract(gray, name, self.languages)

    async def read_pages(
        self, path: str, name: str, sha256: str, pages: Sequence[int], sizes: dict[int, tuple[float, float]],
        progress: OcrProgress | None = None,
    ) -> dict[int, str | None]:
        """The OCR text of ``pages`` of a PDF (None for a page tesseract could not read), from the
        cache when it holds them."""
        found: dict[int, str | None] = {}
        for page in pages:
            if (text := await asyncio.to_thread(self._cached, sha256, page)) is not None:
                found[page] = text
        missing = [page for page in pages if page not in found]
        if progress is not None:
            progress.planned(len(missing))

        async def one(page: int) -> str | None:
            try:
                text = await self._read_page(path, name, page, sizes.get(page))
            except FileRefused as exc:  # the page is listed as not read; the others still count
                logger.info("OCR of %s page %d failed: %s", name, page, exc.message)
                return None
            finally:
                if progress is not None:
                    progress.finished()
            await asyncio.to_thread(self._store, sha256, page, text)
            return text

        read = await gather_all(one(page) for page in missing)
        found.update(zip(missing, read))
        return {page: found[page] for page in pages}

    async def page_texts(
        self, path: str, name: str, sha256: str, text: pdf.PdfText, limit: int = KB_OCR_PAGES
    ) -> list[str]:
        """A PDF's page texts with its first ``limit`` pages without a text layer read by OCR (after
        ``pdf.OCR_MARK``) when OCR is available: what a knowledge base indexes."""
        scanned, _rest = pdf.pages_to_show(text, limit)
        if not scanned or not (await self.support()).available:
            return text.page_texts
        found = await self.read_pages(path, name, sha256, scanned, text.sizes)
        return [f"{pdf.OCR_MARK}\n{read}" if (read := found.get(number)) else page
                for number, page in enumerate(text.page_texts, start=1)]

    async def read_image(
        self, image: bytes, name: str, sha256: str, progress: OcrProgress | None = None
    ) -> str | None:
        """The OCR text of an image file (``image``: what the model would be sent, at most 2048 px);
        None when tesseract cannot read it."""
        if (text := await asyncio.to_thread(self._cached, sha256, 0)) is not None:
            return text
        if progress is not None:
            progress.planned(1)
        try:
            async with self._bound():
                text = await _tesseract(image, name, self.languages)
        except FileRefused as exc:  # said in the file's block, as for a page
            logger.info("OCR of %s failed: %s", name, exc.message)
            return None
        finally:
            if progress is not None:
                progress.finished()
        await asyncio.to_thread(self._store, sha256, 0, text)
        return text


async def _tesseract(image: bytes, name: str, languages: str) -> str:
    """The text tesseract reads in one image (a PNM, PNG or JPEG), within the daemon's bound."""
    binary = shutil.which(OCR_TOOL) or OCR_TOOL
    env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
    out, _cut = await pdf.run_tool([binary, "stdin", "stdout", "-l", languages], name=name,
                                   timeout=OCR_TIMEOUT, max_output=MAX_OCR_OUTPUT, stdin=image, env=env)
    return _clean(out)
