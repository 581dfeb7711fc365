"""Build real sample files from Python: PDFs poppler reads, images Pillow reads.

The tests and ``assistant.py --test`` use these instead of shipping binaries or
calling ``magick`` (which may be absent).  ``make_pdf`` writes the PDF by hand
with a correct cross-reference table, so its text pages carry a real text layer
(Helvetica, WinAnsi) that ``pdftotext`` and pypdf extract, while a ``Scan`` page
holds nothing but a picture of its text, the way a scanner's page does.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

__all__ = [
    "LETTER",
    "Scan",
    "make_bomb_png",
    "make_corrupt_png",
    "make_gif",
    "make_jpeg",
    "make_pdf",
    "make_png",
    "make_sparse",
    "make_webp",
    "picture",
]

# US Letter in PDF points (1/72 inch): at 150 dpi, 1275 x 1650 px
LETTER = (612.0, 792.0)
# how many pixels per point a Scan page's picture has (150 dpi)
SCAN_SCALE = 150 / 72


@dataclass
class Scan:
    """A page that is only a picture of ``text``: no text layer, as a scanner makes it.

    ``grain`` adds a scanner's noise, which makes the page as costly to encode
    as a real scan (benchmarks); plain pages are cheap.  ``font_px`` draws the text
    in Pillow's default font at that size, large enough for OCR to read (0: the
    tiny bitmap font, a mark that the page carries something).
    """

    text: str = "scanned page"
    grain: bool = False
    font_px: int = 0


def picture(size: tuple[int, int], text: str = "", colour: str = "white", font_px: int = 0) -> Image.Image:
    """An RGB image of ``size`` with ``text`` drawn dark near its top left corner (in Pillow's
    default font at ``font_px``, else its small bitmap font)."""
    image = Image.new("RGB", size, colour)
    if text:
        font = ImageFont.load_default(size=font_px) if font_px else None
        ImageDraw.Draw(image).text((10, 10) if not font_px else (font_px, font_px * 4), text, fill="black", font=font)
    return image


def make_png(path: Path, size: tuple[int, int] = (64, 48), text: str = "", font_px: int = 0) -> Path:
    """A real PNG of ``size`` pixels (``text`` in ``font_px``: ``picture``)."""
    picture(size, text, font_px=font_px).save(path, "PNG")
    return path


def make_jpeg(path: Path, size: tuple[int, int] = (64, 48), text: str = "") -> Path:
    """A real JPEG of ``size`` pixels."""
    picture(size, text, "lightblue").save(path, "JPEG", quality=85)
    return path


def make_webp(path: Path, size: tuple[int, int] = (64, 48)) -> Path:
    """A real WebP of ``size`` pixels."""
    picture(size, "", "lightgreen").save(path, "WEBP")
    return path


def make_gif(path: Path, size: tuple[int, int] = (64, 48)) -> Path:
    """A real GIF of ``size`` pixels."""
    picture(size, "", "yellow").save(path, "GIF")
    return path


def make_mpo(path: Path, size: tuple[int, int] = (64, 48)) -> Path:
    """A real MPO of two ``size`` pictures: the JPEG a phone's camera writes with a second one."""
    picture(size, "", "orange").save(path, "MPO", save_all=True, append_images=[picture(size, "", "purple")])
    return path


def make_corrupt_png(path: Path) -> Path:
    """A PNG whose header is right but whose image data is cut off half-way."""
    buffer = io.BytesIO()
    picture((200, 200), "corrupt").save(buffer, "PNG")
    data = buffer.getvalue()
    path.write_bytes(data[: len(data) // 2])
    return path


def make_bomb_png(path: Path, width: int = 100_000, height: int = 100_000) -> Path:
    """A tiny PNG whose header claims ``width`` x ``height`` pixels: a decompression bomb."""
    buffer = io.BytesIO()
    Image.new("L", (1, 1)).save(buffer, "PNG")
    data = bytearray(buffer.getvalue())
    # IHDR is the first chunk: 8-byte signature, length, b"IHDR", then width and height
    ihdr = 8 + 4
    data[ihdr + 4 : ihdr + 12] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr : ihdr + 4 + 13]))
    data[ihdr + 4 + 13 : ihdr + 4 + 13 + 4] = struct.pack(">I", crc)
    path.write_bytes(bytes(data))
    return path


def make_sparse(path: Path, size: int, head: bytes = b"") -> Path:
    """A file of ``size`` bytes that takes no disk space: ``head``, then a hole of zeros."""
    with open(path, "wb") as handle:
        handle.write(head)
        handle.truncate(size)
    return path


def _pdf_string(text: str) -> bytes:
    """``text`` as a PDF literal string in WinAnsi (Latin-1), with its delimiters escaped."""
    escaped = text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
    return b"(" + escaped.encode("latin-1", "replace") + b")"


def _text_stream(text: str, height: float) -> bytes:
    """A content stream that writes ``text`` line by line in 12 pt Helvetica."""
    lines = [b"BT", b"/F1 12 Tf", b"14 TL", f"72 {height - 72:.2f} Td".encode()]
    for line in text.split("\n"):
        lines.append(_pdf_string(line) + b" Tj T*")
    lines.append(b"ET")
    return b"\n".join(lines)


def _scan_image(scan: Scan, size: tuple[float, float]) -> tuple[bytes, int, int]:
    """The JPEG of a Scan page at 150 dpi, with its pixel width and height."""
    width, height = round(size[0] * SCAN_SCALE), round(size[1] * SCAN_SCALE)
    image = picture((width, height), scan.text, "white", scan.font_px)
    if scan.grain:
        noise = Image.effect_noise((width, height), 40).point(lambda value: 200 + value // 5)
        image = Image.merge("RGB", (noise, noise, noise))
        ImageDraw.Draw(image).text((10, 10), scan.text, fill="black")
    # big dark text, so the rendered page obviously carries something
    ImageDraw.Draw(image).rectangle((40, 80, width - 40, 120), fill="black")
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=80)
    return buffer.getvalue(), width, height


def make_pdf(
    path: Path,
    pages: Sequence[str | Scan | None],
    page_size: tuple[float, float] = LETTER,
) -> Path:
    """A PDF with one page per entry: text (a real text layer), ``None`` (blank) or a ``Scan``.

    ``page_size`` is in points; every page has it.  The file is written with a
    correct xref table, so poppler and pypdf read it without repairing it.
    """
    width, height = page_size
    objects: list[bytes] = []  # objects[i] is object number i + 1

    def add(body: bytes) -> int:
        objects.append(body)
        return len(objects)

    def stream(header: bytes, data: bytes) -> bytes:
        return b"<< " + header + b" /Length %d >>\nstream\n" % len(data) + data + b"\nendstream"

    catalog = add(b"")  # filled once the page tree's number is known
    tree = add(b"")
    font = add(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>")
    kids: list[int] = []
    for entry in pages:
        resources = b"<< /Font << /F1 %d 0 R >> >>" % font
        if isinstance(entry, Scan):
            jpeg, px_w, px_h = _scan_image(entry, page_size)
            image = add(stream(
                b"/Type /XObject /Subtype /Image /Width %d /Height %d "
                b"/ColorSpace /DeviceRGB /BitsPerComponent 8 /Filter /DCTDecode" % (px_w, px_h),
                jpeg,
            ))
            resources = b"<< /XObject << /Im1 %d 0 R >> >>" % image
            content = f"q {width:.2f} 0 0 {height:.2f} 0 0 cm /Im1 Do Q".encode()
        elif entry is None:
            content = b""
        else:
            content = _text_stream(entry, height)
        contents = add(stream(b"", content))
        kids.append(add(
            b"<< /Type /Page /Parent %d 0 R /MediaBox [0 0 %.2f %.2f] /Resources %s /Contents %d 0 R >>"
            % (tree, width, height, resources, contents)
        ))
    objects[catalog - 1] = b"<< /Type /Catalog /Pages %d 0 R >>" % tree
    objects[tree - 1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (
        b" ".join(b"%d 0 R" % kid for kid in kids), len(kids))

    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    for offset in offsets:
        out += b"%010d 00000 n \n" % offset
    out += b"trailer\n<< /Size %d /Root %d 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1, catalog, xref)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(bytes(out))
    os.replace(tmp, path)
    return path
