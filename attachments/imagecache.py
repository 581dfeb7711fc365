"""Images for the model at what they weigh on screen: a pixel budget and a cache.

An image file of 250 KB may hold 8000 x 8000 pixels, 256 MB decoded. So:

- **Checked before decoding**: the file is read (at most 20 MB) and hashed, and its
  header gives its size and format; a file whose hash is not the one history holds
  is never decoded (``probe_image``).
- **Decoded once**: what the model was sent (the data URL, scaled to 2048 px) is kept
  per file hash in ``cache_dir`` (``<data dir>/images``), so a later turn resends it
  without decoding, also after a restart. A file sent as it is (a small PNG or JPEG)
  keeps only a note that it decoded cleanly: the cache holds no copy of it. The
  cache keeps at most ``CACHE_BYTES``, the least recently used entries going first;
  one that cannot be written (a full disk) is only a miss next time.
- **One image decoded at a time, daemon-wide**, on a thread of its own
  (``DECODE_THREAD``): eight such images cost one image's memory, not eight. One
  thread also keeps the memory in one malloc arena: decodes spread over the worker
  threads each left their own 256 MB arena behind (``bench/bench_images.py``). The
  others wait on the event loop, not in a worker thread.
- **A thumbnail per image file**, for the canvas's chip: made once per file hash from
  what the model is sent (at most 2048 px, so never a full-size decode), on the same
  decode thread, and kept in ``thumbnails_dir`` (``<data dir>/thumbnails``); the same
  file attached again reuses it. One that cannot be made leaves the chip without.
- **A pixel budget per question and across questions**: the pixels one question's
  images will decode are reserved together before any is decoded, and a question
  that would take the pixels waiting across all questions past
  ``MAX_WAITING_PIXELS`` is refused (``too_many_pixels``) instead of queueing
  without end.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

from core.errors import TooManyPixels
from core.filethreads import FILE_THREADS

from .images import MAX_IMAGE_PIXELS, EncodedImage, Probe, _data_url, decode_pixels, encode_image, pillow, probe_data, probe_image

__all__ = ["CACHE_BYTES", "MAX_WAITING_PIXELS", "THUMBNAIL_PX", "ImageCache", "evict_least_used"]

logger = logging.getLogger(__name__)

DECODE_THREAD = "image"
MAX_WAITING_PIXELS = 16 * MAX_IMAGE_PIXELS  # two questions of eight images at the limit
CACHE_BYTES = 256 * 1024 * 1024
CACHE_VERSION = 1  # part of each entry's name: a change in how images are encoded starts afresh
THUMBNAIL_PX = 256  # a thumbnail's longest side: a chip's picture, not the image


RELEASE_PIXELS = 16_000_000  # after decoding an image this large, freed memory goes back to the system


def _encode(probe: Probe, name: str) -> EncodedImage:
    try:
        return encode_image(probe.data, name)
    finally:
        if decode_pixels(probe) >= RELEASE_PIXELS:
            _release_memory()


def _release_memory() -> None:
    """Give freed heap memory back to the system (glibc keeps it in its arenas otherwise: a
    decoded 8000 x 8000 image would stay in the daemon's RSS for its whole life)."""
    import ctypes  # only once a large image was decoded: it is not needed at start-up

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def evict_least_used(folder: Path, limit: int) -> None:
    """Drop the least recently used entries of a cache folder while it holds more than ``limit``
    bytes (an entry's mtime is when it was last used)."""
    try:
        entries = [(e.stat().st_mtime, e.stat().st_size, e) for e in folder.iterdir() if e.is_file()]
    except OSError:
        return
    total = sum(size for _, size, _ in entries)
    for _, size, entry in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        entry.unlink(missing_ok=True)
        total -= size


def _make_thumbnail(encoded: EncodedImage, path: Path) -> bool:
    """Write a PNG of at most ``THUMBNAIL_PX`` a side at ``path`` (blocking); False if it cannot."""
    import io

    image_module = pillow()
    raw = base64.b64decode(encoded.data_url.partition(",")[2])
    temporary = path.with_suffix(".tmp")
    try:
        with image_module.open(io.BytesIO(raw)) as image:
            image.draft("RGB", (THUMBNAIL_PX, THUMBNAIL_PX))  # a JPEG decodes at a fraction of its size
            image.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
            alpha = image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info
            small = image.convert("RGBA" if alpha else "RGB")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            small.save(handle, format="PNG", optimize=True)
        os.replace(temporary, path)
    except (OSError, ValueError, SyntaxError) as exc:  # Pillow's errors of a bad image, or a full disk
        logger.debug("no thumbnail at %s (%s)", path, exc)
        temporary.unlink(missing_ok=True)
        return False
    return True


def _folder(folder: Path | None, without: str) -> Path | None:
    if folder is not None:
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            logger.warning("cannot use %s (%s): %s", folder, exc, without)
            return None
    return folder


class ImageCache:
    """The daemon's images: the cache of what the model was sent, chips' thumbnails, the one
    decode thread and the pixel budget across questions. Made once at start by the server and
    handed to what reads files."""

    def __init__(self, folder: Path | None = None, thumbnails: Path | None = None) -> None:
        """Keep encoded images in ``folder`` and chips' thumbnails in ``thumbnails`` (each made 0700
        when missing); None keeps none."""
        self.cache_dir = _folder(folder, "images are decoded on every turn")
        self.thumbnails_dir = _folder(thumbnails, "image chips have no thumbnail")
        self.waiting = 0  # pixels reserved by questions, not yet decoded
        self.decodes = 0  # images decoded since start: a resend from the cache adds none
        self._decoder: ThreadPoolExecutor | None = None  # made on the first decode

    def close(self) -> None:
        """Let the decode thread end once what it was given is done."""
        if self._decoder is not None:
            self._decoder.shutdown(wait=False)
            self._decoder = None

    @asynccontextmanager
    async def reserve_pixels(self, probes: Sequence[Probe], what: str) -> AsyncIterator[None]:
        """Reserve the pixels ``probes`` will decode, together, for as long as the block runs;
        ``TooManyPixels`` when the pixels waiting across questions would pass ``MAX_WAITING_PIXELS``."""
        pixels = sum(decode_pixels(p) for p in probes)
        if self.waiting and self.waiting + pixels > MAX_WAITING_PIXELS:
            raise TooManyPixels(
                f"{what}: other questions are still decoding {self.waiting // 1_000_000} megapixels of images, "
                f"and these add {pixels // 1_000_000}; ask again in a moment, or attach scaled-down copies"
            )
        self.waiting += pixels
        try:
            yield
        finally:
            self.waiting -= pixels

    def _entry(self, sha256: str) -> Path | None:
        return self.cache_dir / f"{sha256}.v{CACHE_VERSION}" if self.cache_dir is not None else None

    def cached_image(self, probe: Probe) -> EncodedImage | None:
        """What the model was sent for this file before, if the cache holds it (blocking)."""
        entry = self._entry(probe.sha256)
        if entry is None:
            return None
        try:
            with open(entry, "rb") as handle:
                meta = json.loads(handle.readline())
                body = handle.read()
            os.utime(entry)  # recently used: evicted last
        except (OSError, ValueError):
            return None
        if meta.get("reencoded"):
            url = f"data:{meta['mime']};base64,{base64.b64encode(body).decode('ascii')}"
        else:
            url = _data_url(meta["mime"], probe.data)
        return EncodedImage(url, meta["mime"], meta["width"], meta["height"], bool(meta.get("reencoded")))

    def _store(self, probe: Probe, encoded: EncodedImage) -> None:
        """Keep ``encoded`` for later turns; a failure (a full disk) only costs a decode later."""
        entry = self._entry(probe.sha256)
        if entry is None:
            return
        meta = {"mime": encoded.mime, "width": encoded.width, "height": encoded.height, "reencoded": encoded.reencoded}
        body = base64.b64decode(encoded.data_url.partition(",")[2]) if encoded.reencoded else b""
        temporary = entry.with_suffix(".tmp")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(json.dumps(meta).encode() + b"\n" + body)
            os.replace(temporary, entry)
        except OSError as exc:
            logger.debug("image cache: %s not kept (%s)", probe.sha256, exc)
            temporary.unlink(missing_ok=True)
            return
        evict_least_used(entry.parent, CACHE_BYTES)

    def _thread(self) -> ThreadPoolExecutor:
        if self._decoder is None:
            self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix=DECODE_THREAD)
        return self._decoder

    async def encode(self, probe: Probe, name: str) -> EncodedImage:
        """The image the model gets for ``probe``: from the cache, else decoded within the budget."""
        cached = await asyncio.to_thread(self.cached_image, probe)
        if cached is not None:
            return cached
        encoded = await asyncio.get_running_loop().run_in_executor(self._thread(), _encode, probe, name)
        self.decodes += 1
        await asyncio.to_thread(self._store, probe, encoded)
        return encoded

    async def thumbnail(self, sha256: str, encoded: EncodedImage) -> str | None:
        """The path of the thumbnail of the image file of hash ``sha256``, made from ``encoded`` (what
        the model is sent) unless it exists; None when there is no folder for it or it cannot be made."""
        if self.thumbnails_dir is None:
            return None
        path = self.thumbnails_dir / f"{sha256}.png"
        if await asyncio.to_thread(path.is_file):
            return str(path)  # the same file attached before
        made = await asyncio.get_running_loop().run_in_executor(self._thread(), _make_thumbnail, encoded, path)
        return str(path) if made else None

    async def image_data_url(self, data: bytes, name: str) -> str:
        """An image handed over whole (an MCP tool's result) as the model gets it: checked, decoded
        within the pixel budget and scaled down as an attached file is; FileRefused when it cannot be
        used (not an image, damaged, a bomb, over 20 MB)."""
        probe = await asyncio.to_thread(probe_data, data, name)
        async with self.reserve_pixels([probe], name):
            return (await self.encode(probe, name)).data_url

    async def load_image(self, path: str, name: str, expected: str | None = None) -> tuple[EncodedImage, str] | None:
        """The image at ``path`` for the model and its hash; None when its hash is not ``expected``.

        Raises FileRefused for a file that cannot be used.
        """
        probe = await FILE_THREADS.run(path, probe_image, path, name, expected)
        if probe is None:
            return None
        async with self.reserve_pixels([probe], name):
            return await self.encode(probe, name), probe.sha256
