"""Videos on a question: attached and named to the model, never read into the prompt.

The rules (docs/DESIGN.md, "Videos on a question"): a model cannot watch a video, so a video
dropped on a question is a chip (name, size, duration and picture size when its header says)
and one line in the prompt naming it, its attachment id and what ``file_convert`` can make of
it (its sound, a GIF, a crop). Its bytes are never read whole: the facts come from an MP4's
boxes (``mp4.py``, a few small reads) or else from ``ffprobe`` (its header, within
``PROBE_TIMEOUT`` and ``PROBE_BYTES`` of answer), and the file is neither hashed nor copied;
its record keeps its path and size, which ``file_convert`` checks before it runs.

A sound file ``file_convert`` made (``video_to_audio``) is stored with a line of the same shape
(``audio_line``: its duration, from an M4A's boxes or ffprobe within the same bounds, and size),
so the manifest of folded files and ``attachment_recall`` say what it is, not "no text".
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from typing import Any

from core import process
from core.errors import FileRefused, ToolMissing
from core.files import size_label
from core.filethreads import FILE_THREADS

from .mp4 import read_movie, read_sound

__all__ = ["VIDEO_SUFFIXES", "VideoFacts", "audio_line", "is_video", "probe_sound", "probe_video", "read_video_facts",
           "video_facts_said", "video_line", "video_line_naming"]

logger = logging.getLogger(__name__)

# the video suffixes the file operations take (fileops/options.py) but ``ts``: a .ts file is
# TypeScript first (classify.py), so only its content could tell, and a stream is rare on a question
VIDEO_SUFFIXES = frozenset({"mp4", "m4v", "mkv", "webm", "mov", "avi", "ogv", "mpg", "mpeg", "flv", "wmv", "3gp"})
PROBE_TIMEOUT = 15.0  # seconds for ffprobe to read a header; past it the file is refused
PROBE_BYTES = 1024 * 1024  # bytes of ffprobe's answer kept: a header's streams and format fit in far less
# where a line made before the video had its id sends the model (the record stored with it keeps that line)
UNNAMED = "its attachment id is in attachment_recall's list"
# what the model can have made of a video, named in its line
CONVERSIONS = ("file_convert can turn it into its sound track (video_to_audio), a GIF (video_to_gif) "
               "or a crop that follows what moves (trackcrop)")
# what it can have made of a sound file: nothing, said so that it does not try
SOUND_CONVERSIONS = "file_convert takes PDFs, images and videos, not sound"


@dataclass(frozen=True)
class VideoFacts:
    """What a video's header says: its duration in seconds and picture size (None: not said)."""

    duration: float | None
    width: int | None
    height: int | None


def is_video(suffix: str) -> bool:
    """Whether a file's suffix (lower case, no dot) names a video."""
    return suffix in VIDEO_SUFFIXES


def read_video_facts(path: str) -> VideoFacts | None:
    """An MP4's facts from its boxes (blocking); None when they do not say."""
    try:
        with open(path, "rb") as handle:
            movie = read_movie(handle)
    except OSError:
        return None
    return None if movie is None else VideoFacts(movie.duration, movie.width, movie.height)


def read_sound_length(path: str) -> float | None:
    """An M4A's (any MP4's) duration from its boxes (blocking); None when they do not say."""
    try:
        with open(path, "rb") as handle:
            found = read_sound(handle)
    except OSError:
        return None
    return found.duration if found is not None and found.duration > 0 else None


async def probe_video(path: str, name: str) -> VideoFacts:
    """The facts of the video at ``path``: from its boxes, else from ffprobe. A file ffprobe cannot
    read is refused, naming it; without ffprobe the video is attached without its facts."""
    found = await FILE_THREADS.run(path, read_video_facts, path)
    if found is not None:
        return found
    return await _probed(path, name)


async def probe_sound(path: str, name: str) -> float | None:
    """The duration of the sound file at ``path`` (an output of ours): from an M4A's boxes, else
    from ffprobe within a video's bounds; None when neither says (no ffprobe, an odd file)."""
    try:
        found = await FILE_THREADS.run(path, read_sound_length, path)
        return found if found is not None else (await _probed(path, name)).duration
    except FileRefused as exc:
        logger.info("%s stored without its duration: %s", name, exc.message)
        return None


async def _probed(path: str, name: str) -> VideoFacts:
    """ffprobe's account of a file's header, bounded in time and answer (see ``probe_video``)."""
    try:
        tool = process.need_tool("ffprobe")
        ended = await process.run_tool([tool, "-v", "error", "-print_format", "json", "-show_streams",
                                        "-show_format", path], keep=PROBE_BYTES, timeout=PROBE_TIMEOUT)
    except ToolMissing as exc:
        logger.info("%s attached without its duration and size: %s", name, exc.message)
        return VideoFacts(None, None, None)
    except TimeoutError:
        raise FileRefused(f"{name}: reading the video's header took too long (ffprobe ran over "
                          f"{PROBE_TIMEOUT:g} s); check the file or attach another copy") from None
    if ended.returncode != 0 or ended.cut:
        said = [line.strip() for line in ended.stderr.decode("utf-8", "replace").splitlines() if line.strip()]
        detail = said[-1][:200] if said else f"exit status {ended.returncode}"
        raise FileRefused(f"{name}: not a readable video (ffprobe: {detail}); check the file or attach another copy")
    return _facts(ended.stdout, name)


def _facts(answer: bytes, name: str) -> VideoFacts:
    """The facts in ffprobe's JSON; a file of neither picture nor sound is refused."""
    try:
        data = json.loads(answer or b"{}")
        streams: list[dict[str, Any]] = data.get("streams", [])
    except (ValueError, AttributeError):
        streams, data = [], {}
    picture = next((s for s in streams if s.get("codec_type") == "video"), None)
    if picture is None and not any(s.get("codec_type") == "audio" for s in streams):
        raise FileRefused(f"{name}: not a readable video (ffprobe finds no picture or sound in it); "
                          "check the file or attach another copy")
    duration = _positive(data.get("format", {}).get("duration"))
    if picture is None:
        return VideoFacts(duration, None, None)
    width, height = _positive(picture.get("width")), _positive(picture.get("height"))
    return VideoFacts(duration, int(width) if width else None, int(height) if height else None)


def _positive(value: Any) -> float | None:
    """A number ffprobe gave (as a number or a string), None when it gave none or ``N/A``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


def _clock(seconds: float) -> str:
    """A duration as a player shows it: ``0:05``, ``12:03``, ``1:02:03``."""
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def video_line(facts: VideoFacts, size: int, attachment: int | None) -> str:
    """The line the model gets in a video's place: what it is, that it cannot be watched, its
    attachment id (None before it is stored: the list names it) and what can be made of it."""
    said = ["video"]
    if facts.duration is not None:
        said.append(_clock(facts.duration))
    if facts.width and facts.height:
        said.append(f"{facts.width}x{facts.height}")
    said.append(size_label(size))
    which = _named(attachment) if attachment is not None else UNNAMED
    return f"[{', '.join(said)}; you cannot watch it, but {which}, and {CONVERSIONS}]"


def audio_line(duration: float | None, size: int, attachment: int | None) -> str:
    """The line a sound file (``video_to_audio``'s output) is stored with, in the shape of a
    video's: what it is, that it is not played to the model, its id (None: not yet known) and
    that ``file_convert`` has nothing for it."""
    said = ["audio", *([_clock(duration)] if duration is not None else []), size_label(size)]
    which = _named(attachment) if attachment is not None else UNNAMED
    return f"[{', '.join(said)}; you cannot hear it, but {which}; {SOUND_CONVERSIONS}]"


def video_line_naming(stored: str, attachment: int) -> str:
    """A video's (or sound file's) line as stored with it (made before its id was known), naming its id."""
    return stored.replace(UNNAMED, _named(attachment), 1)


def video_facts_said(stored: str) -> str:
    """What a video's (or sound file's) stored line says of it: ``video, 0:02, 160x120, 33.1 kB``."""
    return stored.removeprefix("[").partition("; ")[0]


def _named(attachment: int) -> str:
    return f"it is attachment {attachment}"
