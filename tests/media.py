"""Small media made for the file operations' tests: PDFs with headings, videos from ffmpeg's lavfi."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np

BOX = 30  # the moving box's side, pixels
CANVAS = (320, 180)


def styled_pdf(path: Path, pages: list[list[tuple[int, str]]]) -> Path:
    """A PDF with one page per list of ``(font size, line)``, top to bottom: a real text layer."""
    objects: list[bytes] = []

    def add(body: bytes) -> int:
        objects.append(body)
        return len(objects)

    catalog, tree = add(b""), add(b"")
    font = add(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>")
    kids = []
    for lines in pages:
        ops, top = [b"BT"], 720
        for size, text in lines:
            ops.append(b"/F1 %d Tf 1 0 0 1 72 %d Tm (%s) Tj" % (size, top, text.encode("latin-1")))
            top -= size * 2
        data = b"\n".join([*ops, b"ET"])
        contents = add(b"<< /Length %d >>\nstream\n" % len(data) + data + b"\nendstream")
        kids.append(add(b"<< /Type /Page /Parent %d 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 %d 0 R "
                        b">> >> /Contents %d 0 R >>" % (tree, font, contents)))
    objects[catalog - 1] = b"<< /Type /Catalog /Pages %d 0 R >>" % tree
    objects[tree - 1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (b" ".join(b"%d 0 R" % k for k in kids), len(kids))
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root %d 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, catalog, xref)
    path.write_bytes(bytes(out))
    return path


def _ffmpeg(*args: str) -> None:
    subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-y", *args], check=True, timeout=60)


def make_clip(path: Path, seconds: int = 2) -> Path:
    """A 160x120, 10 fps test pattern with a 440 Hz tone (AAC in MP4)."""
    _ffmpeg("-f", "lavfi", "-i", f"testsrc=size=160x120:rate=10:duration={seconds}", "-f", "lavfi",
            "-i", f"sine=frequency=440:duration={seconds}", "-c:v", "libx264", "-pix_fmt", "yuv420p", "-c:a", "aac",
            "-shortest", str(path))
    return path


def make_box_video(path: Path) -> Path:
    """A white box crossing a grey 320x180 frame left to right in 2 seconds at 10 fps, no sound."""
    width, height = CANVAS
    graph = (f"color=c=gray:s={width}x{height}:r=10:d=2[bg];color=c=white:s={BOX}x{BOX}:r=10[box];"
             f"[bg][box]overlay=x='10+t*130':y=70:shortest=1")
    _ffmpeg("-f", "lavfi", "-i", graph, "-c:v", "libx264", "-pix_fmt", "yuv420p", str(path))
    return path


def duration(path: Path) -> float:
    done = subprocess.run(["ffprobe", "-v", "error", "-print_format", "json", "-show_format", str(path)],
                          capture_output=True, check=True, timeout=60)
    return float(json.loads(done.stdout)["format"]["duration"])


def gray_frames(path: Path) -> np.ndarray:
    """Every frame of a video, grey, as (frames, height, width)."""
    info = subprocess.run(["ffprobe", "-v", "error", "-print_format", "json", "-show_streams", str(path)],
                          capture_output=True, check=True, timeout=60)
    video = next(s for s in json.loads(info.stdout)["streams"] if s["codec_type"] == "video")
    raw = subprocess.run(["ffmpeg", "-v", "error", "-i", str(path), "-f", "rawvideo", "-pix_fmt", "gray", "pipe:1"],
                         capture_output=True, check=True, timeout=60).stdout
    return np.frombuffer(raw, np.uint8).reshape(-1, video["height"], video["width"])


def make_sound(path: Path, codec: str, seconds: int = 1, video: bool = False) -> Path:
    """A tone encoded with ``codec`` (an ffmpeg encoder) in the container ``path``'s suffix names;
    with ``video``, under a test pattern."""
    picture = ["-f", "lavfi", "-i", f"testsrc=size=64x48:rate=5:duration={seconds}"] if video else []
    _ffmpeg(*picture, "-f", "lavfi", "-i", f"sine=frequency=440:duration={seconds}",
            *(["-c:v", "libx264", "-pix_fmt", "yuv420p"] if video else []), "-c:a", codec, "-strict", "-2",
            "-shortest", str(path))
    return path


def sound_codec(path: Path) -> str | None:
    """The first sound track's codec as ffprobe names it (None: no sound)."""
    done = subprocess.run(["ffprobe", "-v", "error", "-print_format", "json", "-show_streams", str(path)],
                          capture_output=True, check=True, timeout=60)
    streams = json.loads(done.stdout)["streams"]
    return next((s["codec_name"] for s in streams if s["codec_type"] == "audio"), None)
