"""Preparing a question's files for the model: check, classify, extract, budget.

``prepare_files`` runs in three steps, and any refusal in any step refuses the
whole question before anything is sent (docs/DESIGN.md, "Attachments"):

1. Stage: each path is checked (``files.check_path``), its first 8 KiB read
   and classified, and an image's size checked against the 20 MB limit.  More
   than ``MAX_FILES`` paths, or an image for a model without vision, is refused
   here, before any extraction work.
2. Extract, all files concurrently: text files are read in bounded chunks in
   a worker thread, up to ``FULL_TEXT_CAP`` characters (never the whole of a
   huge log); PDFs go through ``pdf.py``; images through ``images.py``.  A PDF
   that needs page images for a model without vision is refused here, as soon
   as its text layer shows it.
3. Budget: the text budget is shared by water-filling (``budget.py``) and each
   block cut to its share; a cut block says so in its header and its chip.

A text file's ``sha256`` is computed while it is read, so it is known only when
the file was read whole (up to ``FULL_TEXT_CAP``); hashing a 10 GB log to attach
its first pages would cost a minute of disk reads.  Images and PDFs are always
hashed: their image references need it.

``estimate_files`` answers the ``estimate`` request with the same staging and
refusals but cheap extraction: text files by size, PDFs by their text layer
(no rendering), images at a flat token cost; all cut to the same shares.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import dataclasses
import hashlib
import json
import logging
import math
import mimetypes
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.errors import LIST_MODELS, NoVision, TooManyFiles, UnsupportedKind
from core.files import check_path, open_regular, read_head, sha256_file
from core.filethreads import FILE_THREADS
from core.tokens import CHARS_PER_TOKEN, DEFAULT_IMAGE_TOKENS, cut_to_weight, text_weight

from . import office, pdf
from .budget import FULL_TEXT_CAP, budget_chars, fair_shares
from .classify import Classified, Kind, classify, is_code, suffix_of
from .images import MAX_IMAGE_BYTES, Probe, probe_image, too_large
from .ocr import OCR_PAGE_CHARS, Ocr, OcrProgress
from .readers import FileReaders
from .tasks import gather_all
from .video import VideoFacts, is_video, probe_video, video_line

__all__ = [
    "MAX_FILES",
    "Chip",
    "ImageAttachment",
    "Prepared",
    "estimate_files",
    "prepare_files",
    "read_sent_pages",
    "read_text_file",
    "too_many_files",
]

logger = logging.getLogger(__name__)

# at most 8 files per question (docs/DESIGN.md, "Attachments")
MAX_FILES = 8
# bytes read per step from a text file: keeps memory flat however big the file
TEXT_READ_CHUNK = 1024 * 1024


@dataclass
class Chip:
    """What the canvas draws for one attached file."""

    name: str
    kind: Kind
    pages: int | None
    truncated: bool
    path: str = ""
    size: int = 0  # bytes
    sha256: str | None = None  # None: a text file too large to be read whole was not hashed
    thumbnail: str | None = None  # an image's thumbnail in the data dir (None: none could be made)
    video: VideoFacts | None = None  # a video's duration and picture size

    def to_json(self) -> dict[str, Any]:
        """The chip as the protocol sends it (``pages`` only for a PDF, ``thumbnail`` only for an
        image, ``duration``, ``width`` and ``height`` only for a video whose header says them)."""
        data: dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.pages is not None:
            data["pages"] = self.pages
        data["truncated"] = self.truncated
        data.update(path=self.path, size=self.size, sha256=self.sha256)
        if self.kind == "image":
            data["thumbnail"] = self.thumbnail
        if self.video is not None:
            facts = {"duration": self.video.duration, "width": self.video.width, "height": self.video.height}
            data.update((key, value) for key, value in facts.items() if value is not None)
        return data


@dataclass
class ImageAttachment:
    """One image for the model: an image file, or a rendered PDF page (``page`` set)."""

    name: str
    path: str
    sha256: str
    page: int | None
    data_url: str
    mime: str
    width: int
    height: int

    def label(self) -> str:
        """The text part naming the image just before it."""
        return f"[image: {self.name}]" if self.page is None else f"[image: {self.name}, page {self.page}]"

    def url_part(self) -> dict[str, Any]:
        """The OpenAI ``image_url`` content part."""
        return {"type": "image_url", "image_url": {"url": self.data_url}}


@dataclass
class Prepared:
    """One attached file, extracted and cut to its share of the budget.

    ``text_block`` is the ``--- file: NAME ---`` block the model gets (text and
    PDF; None for an image).  ``full_text`` is the whole extracted text for the
    recall tools, at most ``FULL_TEXT_CAP`` characters (a note ends it when
    cut); for a PDF ``full_text.split(pdf.PAGE_BREAK)[n - 1]`` is page n.
    ``sha256`` is None for a text file too large to have been read whole, and for a video
    (never read whole: ``video.py``).
    """

    path: str
    name: str
    kind: Kind
    size_bytes: int
    sha256: str | None
    mime: str
    chip: Chip
    text_block: str | None
    images: list[ImageAttachment] = field(default_factory=list)
    full_text: str | None = None
    pages: int | None = None
    scanned: bool = False  # a PDF with pages without a text layer
    read_by_ocr: bool = False  # what the model gets of it was read by OCR (pages or the image)
    # pages sent as images to be read by OCR after the question is sent (``read_sent_pages``)
    read_later: dict[int, tuple[float, float] | None] = field(default_factory=dict)

    @property
    def sent_whole(self) -> bool:
        """Whether the question carries all of its text: a text block not cut to the budget, and no
        page whose text OCR reads only after the question went (``read_later``)."""
        return self.text_block is not None and not self.chip.truncated and not self.read_later

    def preset_kinds(self) -> frozenset[str]:
        """Its kinds as presets name them (core/presets.py): ``code`` or ``text`` for a text file,
        ``pdf`` and, with a page without a text layer, ``scanned`` for a PDF."""
        if self.kind == "text":
            return frozenset({"code" if is_code(self.name) else "text"})
        if self.kind == "pdf":
            return frozenset({"pdf", "scanned"} if self.scanned else {"pdf"})
        if self.kind in office.DOCUMENT_KINDS:
            return frozenset({"text"})  # a document's text is prose, as a text file's
        if self.kind == "video":
            return frozenset({"video"})
        return frozenset({"image"})

    def with_attachment_id(self, attachment: int) -> Prepared:
        """A video with its stored attachment id in the line the model gets (the line names it once
        it is known; the record stored with the question keeps the line without it)."""
        if self.chip.video is None or self.text_block is None:
            return self
        header = self.text_block.partition("\n")[0]
        line = video_line(self.chip.video, self.size_bytes, attachment)
        return dataclasses.replace(self, text_block=f"{header}\n{line}\n")


@dataclass
class _Staged:
    """A checked and classified file, before extraction."""

    path: str
    name: str
    kind: Kind
    mime: str
    size: int


@dataclass
class _Extracted:
    """A file's extraction before the budget cuts it."""

    body: str | None
    need: int
    full_text: str | None
    sha256: str | None
    total: int
    unit: str
    images: list[ImageAttachment] = field(default_factory=list)
    pages: int | None = None
    truncated: bool = False
    thumbnail: str | None = None
    scanned: bool = False
    read_by_ocr: bool = False
    read_later: dict[int, tuple[float, float] | None] = field(default_factory=dict)
    video: VideoFacts | None = None


def _classify(path: str, name: str) -> Classified:
    """A file's kind: a document's by its content (office.py), else as ``classify`` says."""
    head = read_head(path)
    document = office.sniff(path, name, suffix_of(name), head)
    if document is not None:
        return Classified(document, office.MIME_TYPES[document])
    try:
        return classify(name, head)
    except UnsupportedKind:
        if is_video(suffix_of(name)):
            return Classified("video", mimetypes.guess_type(name, strict=False)[0] or "video/" + suffix_of(name))
        raise office.unsupported(name) from None


def _stage_file(path: str) -> _Staged:
    """Check, sniff and classify one path (blocking; runs in a worker thread)."""
    info = check_path(path)
    name = os.path.basename(path)
    found = _classify(path, name)
    if found.kind == "image" and info.st_size > MAX_IMAGE_BYTES:
        raise too_large(name, info.st_size)
    return _Staged(path, name, found.kind, found.mime, info.st_size)


def too_many_files(count: int) -> TooManyFiles:
    """The one refusal of too many files, for ``ask`` and ``estimate`` alike."""
    return TooManyFiles(f"at most {MAX_FILES} files can go with one question; you sent {count}, send fewer")


async def _stage_all(paths: Sequence[str], ocr: Ocr, *, model: str, vision: bool) -> list[_Staged]:
    """Stage every path, refusing too many files, and images for a blind model unless they are
    read by OCR (``ocr_images``)."""
    if len(paths) > MAX_FILES:
        raise too_many_files(len(paths))
    staged = await gather_all(FILE_THREADS.run(str(path), _stage_file, path) for path in paths)
    if not vision and any(item.kind == "image" for item in staged):
        if not ocr.images:
            raise _no_vision(model, hint=OCR_IMAGES_CURE)
        if not (support := await ocr.support()).available:
            raise _no_vision(model, hint=support.note)
    return staged


# the configuration's cure for an image refused for a text-only model (README, "Configuration")
OCR_IMAGES_CURE = "or set ocr_images = true in config.toml to read its text instead, as for a screenshot"


def _no_vision(model: str, why: str = "", what: str = "the image", hint: str | None = None) -> NoVision:
    """The refusal of images (files or PDF pages) for a model that cannot see them; ``hint``
    says what to install for them to be read by OCR."""
    return NoVision(f"{model} cannot see images{why}; ask a model that can {LIST_MODELS}, "
                    f"or leave {what} out" + (f" ({hint})" if hint else ""))


@dataclass
class _PagePlan:
    """What becomes of a PDF's pages without a text layer."""

    shown: list[int]  # sent as images
    read: list[int]  # read by OCR for a model without vision: their text goes in the block
    hidden: list[int]  # only listed
    later: list[int] = field(default_factory=list)  # shown, and read by OCR once the question is sent


async def _plan_pages(text: pdf.PdfText, ocr: Ocr, *, name: str, model: str, vision: bool) -> _PagePlan:
    """A PDF's pages to send as images, to read by OCR and only to list; NoVision when a blind
    model needs pages that cannot be read by OCR (tesseract or its language missing)."""
    shown, hidden = pdf.pages_to_show(text)
    if not shown:
        return _PagePlan([], [], hidden)
    support = await ocr.support()
    if vision:
        return _PagePlan(shown, [], hidden, shown if support.available else [])
    if not support.available:
        scanned = len(shown) + len(hidden)
        pages = "page" if scanned == 1 else "pages"
        raise _no_vision(model, f", and {name} has {scanned} scanned {pages} (no text to read)", name, support.note)
    read, hidden = pdf.pages_to_show(text, pdf.MAX_OCR_PAGES)
    return _PagePlan([], read, hidden)


def read_text_file(path: str) -> tuple[str, bool, str | None]:
    """Up to ``FULL_TEXT_CAP`` characters of a text file, whether that is all of it, and its hash if so.

    Blocking; runs in a worker thread.  Reads ``TEXT_READ_CHUNK`` bytes at a time
    and stops as soon as it holds more than the cap, so memory stays bounded
    however large the file.
    """
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    digest = hashlib.sha256()
    parts: list[str] = []
    count = 0
    with open_regular(path) as handle:
        while True:
            chunk = handle.read(TEXT_READ_CHUNK)
            final = not chunk
            digest.update(chunk)
            # NUL has no place in text and trips C-string code down the line
            piece = decoder.decode(chunk, final=final).replace("\x00", "\ufffd")
            if count == 0 and piece.startswith("\ufeff"):
                piece = piece[1:]  # a UTF-8 byte order mark is not content
            if count + len(piece) > FULL_TEXT_CAP:
                parts.append(piece[: FULL_TEXT_CAP - count])
                return "".join(parts), False, None
            parts.append(piece)
            count += len(piece)
            if final:
                return "".join(parts), True, digest.hexdigest()


async def _extract_text(item: _Staged) -> _Extracted:
    """A text file's extraction."""
    text, complete, sha256 = await FILE_THREADS.run(item.path, read_text_file, item.path)
    if complete:
        return _Extracted(text, text_weight(text), text, sha256, len(text), "characters")
    # the budget never reaches past the cap, and the header gives the size in bytes
    full = text + f"\n[… the file is longer: only the first {FULL_TEXT_CAP} characters are kept]"
    return _Extracted(text, max(text_weight(text) + 1, item.size), full, None, item.size, "bytes", truncated=True)


async def _extract_image(
    item: _Staged, probe: Probe, readers: FileReaders, *, vision: bool, progress: OcrProgress
) -> _Extracted:
    """An image file's extraction: the data URL the model sees (decoded once, see imagecache.py),
    or for a model without vision the text OCR reads in it (``ocr_images``)."""
    encoded = await readers.images.encode(probe, item.name)
    shown = await readers.images.thumbnail(probe.sha256, encoded)
    if not vision:
        raw = base64.b64decode(encoded.data_url.partition(",")[2])
        found = await readers.ocr.read_image(raw, item.name, probe.sha256, progress)
        if found is None:
            body = f"{pdf.OCR_MARK} (tesseract could not read the image)"
        else:
            body = f"{pdf.OCR_MARK}\n{found}" if found.strip() else f"{pdf.OCR_MARK} (no text found in the image)"
        return _Extracted(body, text_weight(body), body, probe.sha256, len(body), "characters", thumbnail=shown,
                          read_by_ocr=True)
    image = ImageAttachment(item.name, item.path, probe.sha256, None, encoded.data_url, encoded.mime,
                            encoded.width, encoded.height)
    return _Extracted(None, 0, None, probe.sha256, 0, "characters", images=[image], thumbnail=shown)


async def _extract_pdf(
    item: _Staged, ocr: Ocr, *, model: str, vision: bool, limit: asyncio.Semaphore, progress: OcrProgress
) -> _Extracted:
    """A PDF's extraction: its text layer, and its pages without text rendered or read by OCR."""
    hashing = asyncio.ensure_future(FILE_THREADS.run(item.path, sha256_file, item.path))
    pending: list[asyncio.Future[Any]] = [hashing]
    try:
        text = await pdf.read_text(item.path, item.name)
        plan = await _plan_pages(text, ocr, name=item.name, model=model, vision=vision)
        # pages render while tesseract reads (the file's hash is the OCR cache's key)
        rendering = asyncio.ensure_future(gather_all(
            pdf.render_page(item.path, item.name, page, text.sizes.get(page), limit) for page in plan.shown
        ))
        pending.append(rendering)
        sha256 = await hashing
        found = await ocr.read_pages(item.path, item.name, sha256, plan.read, text.sizes, progress)
        rendered = await rendering
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    images = [
        ImageAttachment(item.name, item.path, sha256, page, encoded.data_url, encoded.mime,
                        encoded.width, encoded.height)
        for page, encoded in zip(plan.shown, rendered)
    ]
    body = pdf.pdf_body(text, plan.shown, found if plan.read else None)
    cut = bool(plan.hidden) or text.cut or len(text.page_texts) < text.total_pages
    return _Extracted(body, text_weight(body), pdf.pdf_full_text(text, found), sha256, len(body), "characters",
                      images=images, pages=text.total_pages, truncated=cut, scanned=bool(text.blank_pages()),
                      read_by_ocr=bool(plan.read), read_later={page: text.sizes.get(page) for page in plan.later})


async def _extract_video(item: _Staged) -> _Extracted:
    """A video's line (``video.py``): its facts from its header, its bytes never read."""
    facts = await probe_video(item.path, item.name)
    line = video_line(facts, item.size, None)
    return _Extracted(line, text_weight(line), line, None, len(line), "characters", video=facts)


async def _extract_document(item: _Staged) -> _Extracted:
    """A document's extraction (office.py), read and hashed side by side in worker threads."""
    document, sha256 = await asyncio.gather(
        FILE_THREADS.run(item.path, office.read_document, item.path, item.name, item.kind),
        FILE_THREADS.run(item.path, sha256_file, item.path),
    )
    body = office.document_body(document)
    pages = len(document.pages) if document.paged else None
    return _Extracted(body, text_weight(body), office.document_full_text(document), sha256, len(body),
                      "characters", pages=pages, truncated=document.cut)


def _header(name: str, pages: int | None, note: str | None, unit: str = "page") -> str:
    """The ``--- file: NAME (facts) ---`` line that opens a block (``unit``: what ``pages`` counts)."""
    facts = []
    if pages is not None:
        facts.append(f"{pages} {unit}" + ("" if pages == 1 else "s"))
    if note:
        facts.append(note)
    # the name is the user's file's: a newline in it must not open a line of its own
    # in the prompt (it could pass for the end of the block, or an instruction)
    name = json.dumps(name, ensure_ascii=False)[1:-1] if not name.isprintable() else name
    return f"--- file: {name} ({'; '.join(facts)}) ---" if facts else f"--- file: {name} ---"


def _finish(item: _Staged, done: _Extracted, share: int) -> Prepared:
    """The Prepared file: its block cut to ``share`` characters and marked when cut."""
    block = None
    cut = done.truncated
    if done.body is not None:
        body = done.body
        note = None
        if share < done.need:
            body = cut_to_weight(body, share)
            cut = True
            if done.unit == "bytes":
                note = f"truncated: first {len(body)} characters of {done.total} bytes"
            else:
                note = f"truncated: first {len(body)} of {done.total} characters"
        elif not body:
            note = "empty"
        ending = "" if not body or body.endswith("\n") else "\n"
        unit = office.UNITS.get(item.kind, "page")
        block = _header(item.name, done.pages, note, unit) + "\n" + body + ending
    return Prepared(
        path=item.path,
        name=item.name,
        kind=item.kind,
        size_bytes=item.size,
        sha256=done.sha256,
        mime=item.mime,
        chip=Chip(item.name, item.kind, done.pages, cut, item.path, item.size, done.sha256, done.thumbnail,
                  done.video),
        text_block=block,
        images=done.images,
        full_text=done.full_text,
        pages=done.pages,
        scanned=done.scanned,
        read_by_ocr=done.read_by_ocr,
        read_later=done.read_later,
    )


async def _extract(
    item: _Staged, readers: FileReaders, *, model: str, vision: bool, limit: asyncio.Semaphore,
    probe: Probe | None, progress: OcrProgress,
) -> _Extracted:
    """Extract one staged file by its kind (an image probed already)."""
    if item.kind == "text":
        return await _extract_text(item)
    if item.kind in office.DOCUMENT_KINDS:
        return await _extract_document(item)
    if item.kind == "video":
        return await _extract_video(item)
    if probe is not None:
        return await _extract_image(item, probe, readers, vision=vision, progress=progress)
    return await _extract_pdf(item, readers.ocr, model=model, vision=vision, limit=limit, progress=progress)


async def prepare_files(
    paths: Sequence[str], readers: FileReaders, *, model: str, vision: bool, ctx_max: int, ctx_used: int,
    on_ocr: Callable[[int, int], None] | None = None,
) -> list[Prepared]:
    """Check, extract and budget a question's files, in the order given; ``on_ocr(done, total)``
    is told of the pages (and images) read by OCR as they are.

    Raises FileRefused (or its TooManyFiles, UnsupportedKind, NoVision) for the
    first file that cannot be used; then nothing should be sent.
    """
    started = time.monotonic()
    staged = await _stage_all(paths, readers.ocr, model=model, vision=vision)
    limit = asyncio.Semaphore(pdf.RENDER_CONCURRENCY)
    progress = OcrProgress(on_ocr)
    # images are read, hashed and sized first: their pixels are reserved together
    probes = await gather_all(_probe(item) for item in staged)
    async with readers.images.reserve_pixels([p for p in probes if p is not None], "the images of this question"):
        extracted = await gather_all(
            _extract(item, readers, model=model, vision=vision, limit=limit, probe=probe, progress=progress)
            for item, probe in zip(staged, probes)
        )
    shares = fair_shares([done.need for done in extracted], budget_chars(ctx_max, ctx_used))
    prepared = [_finish(item, done, share) for item, done, share in zip(staged, extracted, shares)]
    logger.debug("prepared %d files (%d images) in %.3f s", len(prepared),
                 sum(len(item.images) for item in prepared), time.monotonic() - started)
    return prepared


async def read_sent_pages(prepared: Prepared, ocr: Ocr) -> tuple[str, dict[int, str]]:
    """Read by OCR the scanned pages a vision model was sent as images (``read_later``), after
    the question went: the file's recall text with their text, and the text of each page."""
    assert prepared.sha256 is not None and prepared.full_text is not None
    pages = list(prepared.read_later)
    sizes = {page: size for page, size in prepared.read_later.items() if size is not None}
    found = await ocr.read_pages(prepared.path, prepared.name, prepared.sha256, pages, sizes)
    read = {page: text for page, text in found.items() if text}
    return pdf.with_ocr_text(prepared.full_text, read), read


async def _probe(item: _Staged) -> Probe | None:
    if item.kind != "image":
        return None
    probe = await FILE_THREADS.run(item.path, probe_image, item.path, item.name)
    assert probe is not None  # no hash was expected
    return probe


async def _estimate_one(item: _Staged, ocr: Ocr, *, model: str, vision: bool) -> tuple[int, int, bool]:
    """A staged file's text need (characters), image count, and whether page images are left
    out (a PDF with more scanned pages than are shown), without rendering anything."""
    if item.kind == "text":
        if item.size:
            return item.size, 0, False
        # a file that says it is empty may not be (/proc and /sys files report 0 bytes):
        # count what ask would read
        read, _whole, _sha = await FILE_THREADS.run(item.path, read_text_file, item.path)
        return text_weight(read), 0, False
    if item.kind in office.DOCUMENT_KINDS:
        document = await FILE_THREADS.run(item.path, office.read_document, item.path, item.name, item.kind)
        return len(office.document_body(document)), 0, False
    if item.kind == "video":
        return len(video_line(VideoFacts(None, None, None), item.size, None)), 0, False
    if item.kind == "image":
        # read by OCR for a model without vision (staging refused it otherwise)
        return (OCR_PAGE_CHARS, 0, False) if not vision else (0, 1, False)
    text = await pdf.read_text(item.path, item.name)
    plan = await _plan_pages(text, ocr, name=item.name, model=model, vision=vision)
    if plan.read:  # pages read before count their text; the others a typed page's
        sha256 = await FILE_THREADS.run(item.path, sha256_file, item.path)
        read = await ocr.cached(sha256, plan.read)
        body = pdf.pdf_body(text, [], {page: read.get(page, "") for page in plan.read})
        return len(body) + OCR_PAGE_CHARS * (len(plan.read) - len(read)), 0, bool(plan.hidden)
    return len(pdf.pdf_body(text, plan.shown)), len(plan.shown), bool(plan.hidden)


async def estimate_files(
    paths: Sequence[str],
    readers: FileReaders,
    *,
    image_tokens: int = DEFAULT_IMAGE_TOKENS,
    model: str = "",
    vision: bool = True,
    ctx_max: int = 0,
    ctx_used: int = 0,
) -> list[dict[str, Any]]:
    """``[{name, kind, tokens, truncated}]`` for the ``estimate`` request: what sending these files
    would cost, and whether each would be cut to fit (as its chip would say).

    Text is counted at the estimate rate, ``CHARS_PER_TOKEN`` (4) characters a token
    (not the budget's cautious 3: this is a forecast, not a limit), cut to the same shares
    of the budget ``prepare_files`` would give; each image or PDF page image
    costs ``image_tokens``.  Raises the same refusals as ``prepare_files`` for
    paths, kinds, sizes and vision; damaged images are only found by
    ``prepare_files``, which decodes them.
    """
    staged = await _stage_all(paths, readers.ocr, model=model, vision=vision)
    counted = await gather_all(_estimate_one(item, readers.ocr, model=model, vision=vision) for item in staged)
    shares = fair_shares([need for need, _, _ in counted], budget_chars(ctx_max, ctx_used))
    return [
        {
            "name": item.name,
            "kind": item.kind,
            "tokens": math.ceil(share / CHARS_PER_TOKEN) + images * image_tokens,
            "truncated": share < need or hidden,
        }
        for item, (need, images, hidden), share in zip(staged, counted, shares)
    ]
