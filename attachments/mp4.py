"""An MP4's (or MOV's, M4V's) facts read from its boxes: ``video_to_audio`` without ffprobe.

``video_to_audio`` chooses the container of a copied track by its codec, and reports progress
against the duration: ffprobe says both, but starting it costs as much as the copy itself
(0.2 s, most of a sub-second operation: bench/bench_convert.py). For the ISO base media
files phones and screen recorders write, the ``moov`` box says both in a few reads: the
movie's duration (``mvhd``) and the first sound track's sample entry (``stsd``: ``mp4a``
with the MPEG-4 object type telling AAC from MP3, ``alac``, ``Opus``, ``fLaC``, ``.mp3``).
``video_to_gif`` reads there whether there is a picture (a ``vide`` track) and the duration.
A video attached to a question (``video.py``) gets its duration and picture size from the
movie header and the first ``vide`` track's header (``tkhd``). Anything else, or anything
unexpected in the boxes, is ``None``: the caller asks ffprobe. A file is read a few boxes at a
time (seeks and reads of 16 bytes to a few KiB), never whole.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

__all__ = ["Mp4Movie", "Mp4Sound", "read_movie", "read_picture", "read_sound"]

MAX_BOXES = 4096  # boxes looked at per file: a damaged or hostile file cannot keep the reading going
MAX_ENTRY = 4096  # bytes of a sample entry read (its esds is in the first hundred)
SAMPLE_ENTRIES = {b"alac": "alac", b"Opus": "opus", b"fLaC": "flac", b".mp3": "mp3"}
# MPEG-4 objectTypeIndication: AAC (MPEG-4, MPEG-2 main/LC/SSR), MP3 (MPEG-2, MPEG-1 layer 3)
OBJECT_TYPES = {0x40: "aac", 0x66: "aac", 0x67: "aac", 0x68: "aac", 0x69: "mp3", 0x6B: "mp3"}


@dataclass(frozen=True)
class Mp4Sound:
    """What the boxes say: the duration in seconds, the first sound track's codec (None: no sound)."""

    duration: float
    audio: str | None


@dataclass(frozen=True)
class Mp4Movie:
    """What the boxes say of a movie: its duration in seconds, its picture's width and height."""

    duration: float
    width: int
    height: int


class _Unknown(Exception):
    """Something the boxes do not say plainly: ask ffprobe."""


def _boxes(handle: BinaryIO, start: int, end: int, budget: list[int]) -> Iterator[tuple[bytes, int, int]]:
    """The boxes between ``start`` and ``end``: (type, payload start, box end)."""
    at = start
    while at + 8 <= end:
        budget[0] -= 1
        if budget[0] < 0:
            raise _Unknown
        handle.seek(at)
        header = handle.read(16)
        if len(header) < 8:
            raise _Unknown
        size, kind = struct.unpack(">I4s", header[:8])
        head = 8
        if size == 1 and len(header) == 16:
            size, head = struct.unpack(">Q", header[8:])[0], 16
        elif size == 0:
            size = end - at
        if size < head or at + size > end:
            raise _Unknown
        yield kind, at + head, at + size
        at += size


def _child(handle: BinaryIO, start: int, end: int, kind: bytes, budget: list[int]) -> tuple[int, int]:
    for found, payload, stop in _boxes(handle, start, end, budget):
        if found == kind:
            return payload, stop
    raise _Unknown


def _path(handle: BinaryIO, start: int, end: int, kinds: list[bytes], budget: list[int]) -> tuple[int, int]:
    for kind in kinds:
        start, end = _child(handle, start, end, kind, budget)
    return start, end


def _duration(handle: BinaryIO, start: int) -> float:
    handle.seek(start)
    head = handle.read(32)
    if head[:1] == b"\x01":
        timescale, length = struct.unpack(">IQ", head[20:32])
    else:
        timescale, length = struct.unpack(">II", head[12:20])
    if not timescale:
        raise _Unknown
    return length / timescale


def _codec(entry: bytes) -> str:
    """The codec of a sound sample entry (its bytes, from its size field on)."""
    fourcc = entry[4:8]
    if fourcc in SAMPLE_ENTRIES:
        return SAMPLE_ENTRIES[fourcc]
    if fourcc != b"mp4a" or (at := entry.find(b"esds")) < 0:
        raise _Unknown
    # esds: version and flags, then the ES descriptor (tag 3) holding the decoder config (tag 4)
    data = entry[at + 8 :]
    at = _descriptor(data, 0, 0x03) + 2  # past the ES_ID
    flags = data[at]
    at += 1
    if flags & 0x80:  # streamDependenceFlag: a dependsOn_ES_ID
        at += 2
    if flags & 0x40:  # URL_Flag: a URL, after its length
        at += 1 + data[at]
    if flags & 0x20:  # OCRstreamFlag: an OCR_ES_ID
        at += 2
    kind = OBJECT_TYPES.get(data[_descriptor(data, at, 0x04)])
    if kind is None:
        raise _Unknown
    return kind


def _descriptor(data: bytes, at: int, tag: int) -> int:
    """Where the body of the MPEG-4 descriptor ``tag`` at ``at`` starts (its length is one to four
    bytes, each but the last with its top bit set)."""
    if data[at] != tag:
        raise _Unknown
    at += 1
    for _ in range(4):
        at += 1
        if not data[at - 1] & 0x80:
            return at
    raise _Unknown


def _tracks(
    handle: BinaryIO, start: int, end: int, budget: list[int]
) -> Iterator[tuple[bytes, int, int, int, int]]:
    """Each track's handler (``soun``, ``vide``, ...), its ``mdia`` box and its ``trak`` box
    (payload start, end of each)."""
    for kind, payload, stop in _boxes(handle, start, end, budget):
        if kind != b"trak":
            continue
        media, media_end = _child(handle, payload, stop, b"mdia", budget)
        handler, _ = _child(handle, media, media_end, b"hdlr", budget)
        handle.seek(handler + 8)
        yield handle.read(4), media, media_end, payload, stop


def _first_sound(handle: BinaryIO, start: int, end: int, budget: list[int]) -> str | None:
    for handler, media, media_end, _, _ in _tracks(handle, start, end, budget):
        if handler != b"soun":
            continue
        table, _ = _path(handle, media, media_end, [b"minf", b"stbl", b"stsd"], budget)
        handle.seek(table + 8)  # version and flags, entry count
        return _codec(handle.read(MAX_ENTRY))
    return None


def _movie(handle: BinaryIO, budget: list[int]) -> tuple[int, int, float]:
    """The ``moov`` box (payload start, end) and the movie's duration."""
    end = handle.seek(0, 2)
    handle.seek(4)
    if handle.read(4) != b"ftyp":
        raise _Unknown
    movie, movie_end = _child(handle, 0, end, b"moov", budget)
    header, _ = _child(handle, movie, movie_end, b"mvhd", budget)
    return movie, movie_end, _duration(handle, header)


def read_sound(handle: BinaryIO) -> Mp4Sound | None:
    """The duration and sound codec of an ISO base media file, or None when the boxes do not say."""
    budget = [MAX_BOXES]
    try:
        movie, movie_end, duration = _movie(handle, budget)
        return Mp4Sound(duration, _first_sound(handle, movie, movie_end, budget))
    except (_Unknown, struct.error, IndexError, OSError):
        return None


def read_picture(handle: BinaryIO) -> float | None:
    """The duration of an ISO base media file with a video track (``video_to_gif``'s checks), or
    None when the boxes do not say so plainly (no video track, no duration, odd boxes)."""
    budget = [MAX_BOXES]
    try:
        movie, movie_end, duration = _movie(handle, budget)
        pictured = any(track[0] == b"vide" for track in _tracks(handle, movie, movie_end, budget))
    except (_Unknown, struct.error, IndexError, OSError):
        return None
    return duration if pictured and duration > 0 else None


def _picture_size(handle: BinaryIO, start: int, end: int, budget: list[int]) -> tuple[int, int]:
    """The width and height of the first ``vide`` track, from its ``tkhd`` (16.16 fixed point,
    the header's last eight bytes)."""
    for handler, _, _, track, track_end in _tracks(handle, start, end, budget):
        if handler != b"vide":
            continue
        header, header_end = _child(handle, track, track_end, b"tkhd", budget)
        handle.seek(header_end - 8)
        width, height = struct.unpack(">II", handle.read(8))
        if width >> 16 and height >> 16:
            return width >> 16, height >> 16
        raise _Unknown
    raise _Unknown


def read_movie(handle: BinaryIO) -> Mp4Movie | None:
    """The duration and picture size of an ISO base media file with a video track, or None when
    the boxes do not say so plainly."""
    budget = [MAX_BOXES]
    try:
        movie, movie_end, duration = _movie(handle, budget)
        width, height = _picture_size(handle, movie, movie_end, budget)
    except (_Unknown, struct.error, IndexError, OSError):
        return None
    return Mp4Movie(duration, width, height) if duration > 0 else None
