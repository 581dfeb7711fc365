"""Images for the model: checked with Pillow, sent as base64 data URLs.

Every image is verified and fully decoded before it is sent, so a damaged file
or a decompression bomb is refused with a clear message instead of failing on
the model server.  ``Image.MAX_IMAGE_PIXELS`` is set explicitly to
``MAX_IMAGE_PIXELS``; Pillow raises ``DecompressionBombError`` over twice that
and warns over it, and we refuse both (and check the size ourselves, so the
refusal does not depend on how warnings are filtered).

What is sent:

- a PNG or a JPEG no larger than ``MAX_SIDE`` on its longest side goes as its
  original bytes, untouched;
- anything else is re-encoded: larger images are scaled down to ``MAX_SIDE``
  (2048 px: more than vision encoders use, which tile or resize to about
  1000 px, while keeping small print legible); WebP and GIF are re-encoded
  because not every server decodes them (llama.cpp's loader has no WebP, and
  an animated GIF becomes its first frame); a JPEG whose EXIF says "rotated"
  is turned upright, because servers ignore EXIF orientation; CMYK and other
  unusual modes become RGB.  Pictures with transparency become PNG, photos
  (JPEG and WebP sources) JPEG.

Decoding costs what is sent, not what the file holds: a large image is decoded at
reduced size where the format allows it (a JPEG's ``draft``: 1/2, 1/4 or 1/8 of its
pixels), scaled down before anything else is done to it (``thumbnail`` reduces by
whole factors first), and only then turned upright and converted; ``decode_pixels``
says what a decode will hold, for the daemon-wide budget in ``imagecache.py``.

Everything here is blocking CPU work: call it from a worker thread.
"""

from __future__ import annotations

import base64
import hashlib
import functools
import io
import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from core.errors import FileRefused
from core.files import open_regular, size_label

if TYPE_CHECKING:
    from PIL import Image

__all__ = [
    "ACCEPTED_FORMATS",
    "EncodedImage",
    "MAX_IMAGE_BYTES",
    "MAX_IMAGE_PIXELS",
    "MAX_SIDE",
    "encode_image",
    "Probe",
    "decode_pixels",
    "encode_png",
    "probe_data",
    "probe_image",
    "too_large",
]

logger = logging.getLogger(__name__)

# an image file over 20 MB is refused (docs/DESIGN.md, "Attachments"): all of it is read
# and decoded in memory before anything is sent
MAX_IMAGE_BYTES = 20 * 1024 * 1024
# about 8000 x 8000: far beyond any photo a model needs, far below a bomb's billions
MAX_IMAGE_PIXELS = 64_000_000
# longest side sent to the model; larger images are scaled down (see the docstring)
MAX_SIDE = 2048
# the formats chat takes (docs/DESIGN.md, "Attachments"), as Pillow names them
ACCEPTED_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "MPO"})
# a JPEG: MPO is one with more pictures after the first (phones' cameras), which is sent
JPEG_FORMATS = frozenset({"JPEG", "MPO"})
# formats every OpenAI-compatible server decodes, so they may go as they are
PASS_THROUGH_FORMATS = frozenset({"PNG", "JPEG"})
# modes those servers decode without surprises
PASS_THROUGH_MODES = frozenset({"1", "L", "LA", "P", "RGB", "RGBA", "I;16"})
JPEG_QUALITY = 90
EXIF_ORIENTATION = 0x0112

# What Pillow raises for a damaged or truncated file, by format plugin.
_DAMAGED = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError)


@functools.cache
def pillow() -> ModuleType:
    """Pillow's ``PIL.Image``, with our pixel limit: loaded on first use (in the worker thread
    reading a file), so a daemon start does not pay its import."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
    return Image


def _bomb_errors() -> tuple[type[Exception], ...]:
    """Over MAX_IMAGE_PIXELS Pillow warns, over twice that it raises; where warnings are
    errors (the test suite) the warning arrives as an exception as well."""
    image = pillow()
    return image.DecompressionBombError, image.DecompressionBombWarning


@dataclass
class EncodedImage:
    """An image ready for the model: its data URL and the pixel size it has there."""

    data_url: str
    mime: str
    width: int
    height: int
    reencoded: bool


def too_large(name: str, size: int) -> FileRefused:
    """The refusal of an image file over ``MAX_IMAGE_BYTES``."""
    return FileRefused(
        f"{name}: the image is {size_label(size)}, over the 20 MB limit; "
        "attach a smaller or scaled-down copy"
    )


def _data_url(mime: str, data: bytes) -> str:
    """A base64 ``data:`` URL of ``data``."""
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def _bomb(name: str, width: int, height: int) -> FileRefused:
    """The refusal of an image with too many pixels."""
    return FileRefused(
        f"{name}: the image claims {width} x {height} pixels, more than the "
        f"{MAX_IMAGE_PIXELS // 1_000_000} megapixels allowed (it may be a decompression bomb); "
        "attach a scaled-down copy"
    )


def _damaged(name: str) -> FileRefused:
    """The refusal of an image Pillow cannot decode."""
    return FileRefused(f"{name}: the image is damaged or incomplete and cannot be decoded; attach an intact copy")


def _open_checked(data: bytes, name: str) -> Image.Image:
    """Open ``data`` with Pillow, refusing unsupported formats and too many pixels."""
    try:
        image = pillow().open(io.BytesIO(data))
    except _bomb_errors():
        raise FileRefused(
            f"{name}: the image has far too many pixels (a decompression bomb?); attach a scaled-down copy"
        ) from None
    except pillow().UnidentifiedImageError:
        raise FileRefused(
            f"{name}: not a PNG, JPEG, WebP or GIF image Pillow can read; attach one of those"
        ) from None
    except _DAMAGED:
        raise _damaged(name) from None
    if image.format not in ACCEPTED_FORMATS:
        fmt = image.format
        image.close()
        raise FileRefused(
            f"{name}: a {fmt} image; chat supports text, images (PNG, JPEG, WebP, GIF), PDF and documents — convert it first"
        )
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        image.close()
        raise _bomb(name, width, height)
    return image


@dataclass
class Probe:
    """An image file read and hashed, its header checked, nothing decoded yet."""

    data: bytes
    sha256: str
    width: int
    height: int
    format: str
    pass_through: bool  # sent as its own bytes once it decodes cleanly


def decode_pixels(probe: Probe) -> int:
    """The pixels ``encode_image`` holds decoded at once for this image (a JPEG decodes reduced)."""
    pixels = probe.width * probe.height
    if probe.pass_through or probe.format != "JPEG":
        return pixels
    fits = min(probe.width // MAX_SIDE, probe.height // MAX_SIDE)  # as Pillow's JPEG draft picks its scale
    scale = next(s for s in (8, 4, 2, 1) if fits >= s or s == 1)
    return pixels // (scale * scale)


def _needs_reencode(image: Image.Image) -> bool:
    """Whether ``image`` must be re-encoded before a server can take it as it is."""
    if image.format not in PASS_THROUGH_FORMATS or image.mode not in PASS_THROUGH_MODES:
        return True
    if max(image.size) > MAX_SIDE:
        return True
    if image.format == "JPEG" and image.getexif().get(EXIF_ORIENTATION, 1) != 1:
        return True
    return False


# modes that scale well as they are; others (palettes, 1-bit, 16-bit) are converted first
SCALABLE_MODES = frozenset({"RGB", "RGBA", "L", "LA"})


REDUCE_STRIP = 256  # rows of the source reduced at a time (a multiple of the factor is used)


def _reduce(image: Image.Image) -> Image.Image:
    """``image`` shrunk by the whole factor that keeps its longest side at least ``MAX_SIDE``
    (box averaging, as ``thumbnail``'s reducing step), a strip at a time: Pillow reduces and
    resizes RGBA through a premultiplied copy of the whole image (256 MB more at 8000 x
    8000), a strip's copy is a few MB."""
    factor = max(image.size) // MAX_SIDE
    if factor < 2:
        return image
    width, height = image.size
    out = pillow().new(image.mode, (-(-width // factor), -(-height // factor)))
    rows = max(REDUCE_STRIP // factor, 1) * factor
    for top in range(0, height, rows):
        strip = image.crop((0, top, width, min(top + rows, height)))
        out.paste(strip.reduce(factor), (0, top // factor))
    return out


def _reencode(image: Image.Image) -> tuple[bytes, str, Image.Image]:
    """``image`` (loaded) within ``MAX_SIDE``, upright, as PNG (transparency) or JPEG (photos).

    Scaled first, in place, so the conversions work on the small copy.
    """
    source_format = image.format
    transparent = image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info
    exif = image.getexif()  # read before scaling: the orientation is the file's
    if image.mode not in SCALABLE_MODES:
        image = image.convert("RGBA" if transparent else "RGB")
    image = _reduce(image)
    image.thumbnail((MAX_SIDE, MAX_SIDE), pillow().Resampling.LANCZOS)
    if exif.get(EXIF_ORIENTATION, 1) != 1:
        from PIL import ImageOps

        image = ImageOps.exif_transpose(image.copy()) or image
    if transparent:
        converted = image if image.mode == "RGBA" else image.convert("RGBA")
    elif image.mode in ("L", "1"):
        converted = image if image.mode == "L" else image.convert("L")
    else:
        converted = image if image.mode == "RGB" else image.convert("RGB")
    buffer = io.BytesIO()
    if not transparent and (source_format in JPEG_FORMATS or source_format == "WEBP"):
        converted.save(buffer, "JPEG", quality=JPEG_QUALITY)
        return buffer.getvalue(), "image/jpeg", converted
    converted.save(buffer, "PNG", compress_level=6)
    return buffer.getvalue(), "image/png", converted


def encode_image(data: bytes, name: str) -> EncodedImage:
    """Check ``data`` (a whole image file) and make it the data URL the model gets.

    Raises FileRefused for an unsupported format, a bomb or a damaged file.
    """
    with _open_checked(data, name) as probe:
        pass_through = not _needs_reencode(probe)
        if pass_through:  # sent as it is: check the whole file, not just what decoding reads
            try:
                probe.verify()
            except _DAMAGED:
                raise _damaged(name) from None
    with _open_checked(data, name) as image:
        width, height = image.size
        try:
            if image.format in JPEG_FORMATS and not pass_through:
                image.draft(None, (MAX_SIDE, MAX_SIDE))  # decode at 1/2, 1/4 or 1/8 where that suffices
            image.load()
        except _bomb_errors():
            raise _bomb(name, *image.size) from None
        except _DAMAGED:
            raise _damaged(name) from None
        if pass_through:
            mime = pillow().MIME.get(image.format or "", "image/png")
            return EncodedImage(_data_url(mime, data), mime, image.width, image.height, reencoded=False)
        try:
            encoded, mime, result = _reencode(image)
        except _DAMAGED:
            raise _damaged(name) from None
        logger.debug("re-encoded %s: %s %dx%d -> %s %dx%d", name, image.format, width,
                     height, mime, result.width, result.height)
        return EncodedImage(_data_url(mime, encoded), mime, result.width, result.height, reencoded=True)


def read_image(path: str, name: str) -> bytes:
    """The bytes of the image file at ``path``: at most ``MAX_IMAGE_BYTES``, a regular file."""
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > MAX_IMAGE_BYTES:
            raise too_large(name, size)
        # one byte more than allowed tells a file that grew since it was checked
        try:
            data = handle.read(MAX_IMAGE_BYTES + 1)
        except OSError as exc:
            raise FileRefused(f"{path}: cannot be read ({exc.strerror}); check the file") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise too_large(name, len(data))
    return data


def probe_image(path: str, name: str, expected: str | None = None) -> Probe | None:
    """Read and hash the image at ``path`` and check its header; None when its hash is not
    ``expected`` (a replaced file is never decoded). Refusals raise FileRefused."""
    data = read_image(path, name)
    sha256 = hashlib.sha256(data).hexdigest()
    if expected is not None and sha256 != expected:
        return None
    return probe_data(data, name, sha256)


def probe_data(data: bytes, name: str, sha256: str | None = None) -> Probe:
    """Check the header of ``data``, a whole image (FileRefused when it cannot be used)."""
    if len(data) > MAX_IMAGE_BYTES:
        raise too_large(name, len(data))
    with _open_checked(data, name) as image:
        digest = sha256 or hashlib.sha256(data).hexdigest()
        return Probe(data, digest, image.width, image.height, image.format or "", not _needs_reencode(image))


def encode_png(image: Image.Image, max_side: int, compress_level: int = 1) -> EncodedImage:
    """``image`` scaled down to ``max_side`` if larger, as a PNG data URL.

    A low ``compress_level`` is deliberate: for rendered pages, zlib at its
    default level costs several times the rendering itself, and the data URL
    only crosses loopback.
    """
    if max(image.size) > max_side:
        image.thumbnail((max_side, max_side), pillow().Resampling.LANCZOS)
    buffer = io.BytesIO()
    image.save(buffer, "PNG", compress_level=compress_level)
    return EncodedImage(_data_url("image/png", buffer.getvalue()), "image/png", image.width, image.height, True)
