"""The user message's content, and image references in history.

``user_content`` builds the new user message twice: for the router, with the
images as ``image_url`` data URLs, and for storage, with each image as an
``image_ref`` part (docs/DESIGN.md, "Attachments"): ``{"type": "image_ref", "name",
"path", "sha256"}``, plus ``"page"`` for a rendered PDF page, where path and
hash are the PDF's, and ``"ocr"`` for such a page's OCR text, added once read after the
question went (searched; given to a text-only model the conversation moves to, in the
image's place).  Extracted text is inline in both, so a reopened
conversation still has it.

Content order: one text part with the user's text, then each file's block;
then, per image, a short text label naming it (``[image: NAME]`` or
``[image: NAME, page 3]``) followed by the image, so the model can tell which
picture is which file.  With empty ``text`` the model gets the files alone.

``resolve_image_refs`` turns stored history back into what the router takes:
each ``image_ref`` becomes the ``image_url`` again when the path still holds a
file with that hash (PDF pages are re-rendered), else the text
``[image NAME is no longer available]``.  Within one call each (path, hash,
page) is resolved once and each path hashed once, in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

from core.errors import FileRefused
from core.files import check_path, sha256_file
from core.filethreads import FILE_THREADS

from . import pdf
from .pdf import OCR_MARK
from .extract import Prepared
from .imagecache import ImageCache
from .images import EncodedImage

__all__ = ["attached_image", "image_ref", "resolve_image_refs", "user_content"]

logger = logging.getLogger(__name__)

_RefKey = tuple[str, str, int | None]


async def attached_image(path: str, name: str, sha256: str, images: ImageCache) -> EncodedImage | None:
    """An image attached earlier, as it was sent then (re-encoded alike; the cache keeps it);
    None when the file has changed. Raises ``FileRefused`` when it cannot be read.

    An image is at most 20 MB: it is read once, and hashed before anything is decoded (a
    replaced file is never decoded).
    """
    await FILE_THREADS.run(path, check_path, path)
    loaded = await images.load_image(path, name, expected=sha256)
    return loaded[0] if loaded is not None else None


def image_ref(name: str, path: str, sha256: str, page: int | None = None) -> dict[str, Any]:
    """The ``image_ref`` content part stored in history in place of an image (a scanned page's
    gains ``ocr`` once read: ``history`` ``add_page_text``)."""
    ref: dict[str, Any] = {"type": "image_ref", "name": name, "path": path, "sha256": sha256}
    if page is not None:
        ref["page"] = page
    return ref


def user_content(text: str, prepared: Sequence[Prepared]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The new user message's content: (for the router, for storage).

    Both hold the same text parts; the router's has ``image_url`` parts where
    storage has ``image_ref`` parts.
    """
    pieces = [text] if text else []
    pieces.extend(item.text_block for item in prepared if item.text_block is not None)
    to_router: list[dict[str, Any]] = []
    to_store: list[dict[str, Any]] = []
    if pieces:
        part = {"type": "text", "text": "\n\n".join(pieces)}
        to_router.append(part)
        to_store.append(dict(part))
    for item in prepared:
        for image in item.images:
            label = {"type": "text", "text": image.label()}
            to_router += [label, image.url_part()]
            to_store += [dict(label), image_ref(image.name, image.path, image.sha256, image.page)]
    return to_router, to_store


def _unavailable(ref: dict[str, Any], reason: str = "is no longer available") -> dict[str, Any]:
    """The text that replaces an image that cannot be shown."""
    name = ref.get("name") or os.path.basename(str(ref.get("path", ""))) or "image"
    page = ref.get("page")
    what = f"{name}" if page is None else f"{name} (page {page})"
    return {"type": "text", "text": f"[image {what} {reason}]"}


def _is_ref(part: object) -> bool:
    """Whether a content part is an ``image_ref``."""
    return isinstance(part, dict) and part.get("type") == "image_ref"


class _Resolver:
    """Resolves the image refs of one ``resolve_image_refs`` call, with its caches."""

    def __init__(self, images: ImageCache) -> None:
        self.images = images
        self.hashes: dict[str, asyncio.Future[str | None]] = {}
        self.parts: dict[_RefKey, asyncio.Future[dict[str, Any]]] = {}
        self.limit = asyncio.Semaphore(pdf.RENDER_CONCURRENCY)

    async def _hash(self, path: str) -> str | None:
        """The current hash of the regular file at ``path``, or None when it is gone or unusable."""
        try:
            await FILE_THREADS.run(path, check_path, path)
            return await FILE_THREADS.run(path, sha256_file, path)
        except FileRefused as refused:
            logger.debug("image ref %s: %s", path, refused.message)
            return None

    def hash_of(self, path: str) -> asyncio.Future[str | None]:
        """The hash of ``path``, computed once per call (a PDF's pages share it)."""
        if path not in self.hashes:
            self.hashes[path] = asyncio.ensure_future(self._hash(path))
        return self.hashes[path]

    async def _resolve(self, ref: dict[str, Any]) -> dict[str, Any]:
        """One ref as an ``image_url`` part, or the unavailable text."""
        path, sha256, page = str(ref.get("path", "")), str(ref.get("sha256", "")), ref.get("page")
        name = str(ref.get("name") or os.path.basename(path))
        if not os.path.isabs(path) or not sha256:
            return _unavailable(ref)
        try:
            if isinstance(page, int):
                if await self.hash_of(path) != sha256:
                    return _unavailable(ref)
                encoded = await pdf.render_pdf_page(path, name, page, self.limit)
            else:
                image = await attached_image(path, name, sha256, self.images)
                if image is None:
                    return _unavailable(ref)
                encoded = image
        except FileRefused as refused:
            logger.debug("image ref %s: %s", path, refused.message)
            return _unavailable(ref)
        return {"type": "image_url", "image_url": {"url": encoded.data_url}}

    def resolve(self, ref: dict[str, Any]) -> asyncio.Future[dict[str, Any]]:
        """The part for ``ref``, resolved once per (path, hash, page) within the call."""
        page = ref.get("page")
        key = (str(ref.get("path", "")), str(ref.get("sha256", "")), page if isinstance(page, int) else None)
        if key not in self.parts:
            self.parts[key] = asyncio.ensure_future(self._resolve(ref))
        return self.parts[key]

    async def close(self) -> None:
        """Cancel and collect whatever still runs (when the caller was cancelled or failed)."""
        pending: list[asyncio.Future[Any]] = [*self.hashes.values(), *self.parts.values()]
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def resolve_image_refs(
    messages: Sequence[dict[str, Any]], images: ImageCache, *, vision: bool = True
) -> list[dict[str, Any]]:
    """``messages`` with every ``image_ref`` part resolved; the input is not modified.

    With ``vision`` False (the conversation moved to a text-only model), each
    ref becomes ``[image NAME not shown: the model cannot see images]`` without
    the files being touched.
    """
    resolver = _Resolver(images)
    futures: dict[tuple[int, int], asyncio.Future[dict[str, Any]]] = {}
    try:
        for m_index, message in enumerate(messages):
            content = message.get("content")
            if vision and isinstance(content, list):
                for p_index, part in enumerate(content):
                    if _is_ref(part):
                        futures[m_index, p_index] = resolver.resolve(part)
        await asyncio.gather(*futures.values())
    finally:
        await resolver.close()
    result: list[dict[str, Any]] = []
    for m_index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list) or not any(_is_ref(part) for part in content):
            result.append(message)
            continue
        parts = []
        for p_index, part in enumerate(content):
            if (m_index, p_index) in futures:
                parts.append(futures[m_index, p_index].result())
            elif _is_ref(part) and part.get("ocr"):  # a scanned page: its text, read by OCR
                parts.append({"type": "text", "text": f"{_unavailable(part, OCR_MARK[1:-1])['text']}\n{part['ocr']}"})
            elif _is_ref(part):
                parts.append(_unavailable(part, "not shown: the model cannot see images"))
            else:
                parts.append(part)
        result.append({**message, "content": parts})
    return result
