"""The operations on videos, run by ffmpeg: sound track, GIF, and the tracking crop's render.

Each reads ffprobe's account of the input first (a damaged file fails there, named; an MP4's
sound track, and for a GIF its picture and duration, are read from its boxes instead,
``mp4.py``) and reports ffmpeg's own progress (``-progress pipe:1``: the seconds of output done) against
the input's duration. ffmpeg's ``-fs`` stops it writing at the size bound; an output that
reached the bound is refused, naming it.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import BadOption, ConvertFailed, OutputTooLarge

from .job import Job
from attachments import read_picture, read_sound
from .process import need_tool, run_tool, worker_args

__all__ = ["trackcrop", "video_to_audio", "video_to_gif"]

PROBE_BYTES = 1024 * 1024
# an audio codec, and the file it is copied into without re-encoding
COPY_CONTAINERS = {"aac": ".m4a", "alac": ".m4a", "mp3": ".mp3", "opus": ".opus", "vorbis": ".ogg", "flac": ".flac"}
ENCODERS = {"opus": ("libopus", "128k", ".opus"), "mp3": ("libmp3lame", "192k", ".mp3")}


@dataclass
class Probe:
    """What ffprobe says of a video: duration, frame size and rate, audio codec."""

    duration: float
    width: int
    height: int
    fps: float
    audio: str | None  # the first audio track's codec; None: no sound


async def probe(path: Path) -> Probe:
    found = await run_tool([need_tool("ffprobe"), "-v", "error", "-print_format", "json", "-show_streams",
                            "-show_format", str(path)], name=path.name, keep=PROBE_BYTES)
    data = json.loads(found.stdout or b"{}")
    streams: list[dict[str, Any]] = data.get("streams", [])
    video = next((s for s in streams if s.get("codec_type") == "video"), None)
    audio = next((s for s in streams if s.get("codec_type") == "audio"), None)
    if video is None and audio is None:
        raise ConvertFailed(f"{path.name}: ffprobe finds no video or sound in it; check that the file is whole")
    duration = float(data.get("format", {}).get("duration") or 0.0)
    fps = _rate((video or {}).get("avg_frame_rate", "0/1")) or _rate((video or {}).get("r_frame_rate", "0/1"))
    return Probe(duration, int((video or {}).get("width", 0)), int((video or {}).get("height", 0)), fps,
                 audio.get("codec_name") if audio else None)


def _mp4_sound(path: Path) -> tuple[float, str | None] | None:
    """An MP4's duration and first sound codec from its boxes (blocking); None when they do not say."""
    try:
        with open(path, "rb") as handle:
            found = read_sound(handle)
    except OSError:
        return None
    return None if found is None else (found.duration, found.audio)


async def sound_track(path: Path) -> tuple[float, str | None]:
    """The duration and the first sound track's codec (None: no sound): read from an MP4's boxes
    (``mp4.py``: no ffprobe to start, which costs as much as copying the track), else from ffprobe."""
    found = await asyncio.to_thread(_mp4_sound, path)
    if found is not None:
        return found
    probed = await probe(path)
    return probed.duration, probed.audio


async def picture_length(path: Path) -> float:
    """The duration of a video with a picture (``ConvertFailed`` if it has none): read from an
    MP4's boxes (``mp4.py``: no ffprobe to start, a sixth of a short GIF's time), else ffprobe."""
    found = await asyncio.to_thread(_mp4_picture, path)
    if found is not None:
        return found
    probed = await probe(path)
    if probed.width == 0:
        raise ConvertFailed(f"{path.name} has no picture; there is nothing to make a GIF of")
    return probed.duration


def _mp4_picture(path: Path) -> float | None:
    try:
        with open(path, "rb") as handle:
            return read_picture(handle)
    except OSError:
        return None


def _rate(text: str) -> float:
    top, _, bottom = text.partition("/")
    try:
        return float(top) / float(bottom or 1)
    except (ValueError, ZeroDivisionError):
        return 0.0


async def _ffmpeg(job: Job, inputs: list[str], outputs: list[str], total: float, name: str,
                  cwd: str | None = None) -> None:
    """ffmpeg with its progress on stdout reported as seconds done of ``total``."""
    args = [need_tool("ffmpeg"), "-v", "error", "-nostdin", "-nostats", "-progress", "pipe:1", *inputs, *outputs]

    def on_line(line: bytes) -> None:
        key, _, value = line.decode("ascii", "replace").strip().partition("=")
        if key == "out_time_us" and value.lstrip("-").isdigit():
            job.report(round(min(max(int(value), 0) / 1e6, total), 3), total or None, "seconds")

    await run_tool(args, name=name, on_line=on_line, cwd=cwd)


def _bounded(path: Path, bound: int, setting: str, advice: str) -> None:
    """Refuse an output ffmpeg stopped at ``-fs`` (it reached the bound)."""
    if path.stat().st_size >= bound:
        raise OutputTooLarge(f"the output reached {setting} ({bound} bytes) and was not kept; {advice}")


async def video_to_audio(job: Job) -> None:
    """The sound track: copied into a container of its codec, else (or when asked) encoded."""
    length, audio = await sound_track(job.first)
    if audio is None:
        raise ConvertFailed(f"{job.first.name} has no sound track; there is nothing to extract")
    wanted = job.options["format"]
    if wanted == "auto" and audio in COPY_CONTAINERS:
        codec, suffix = ["-c:a", "copy"], COPY_CONTAINERS[audio]
    else:
        encoder, rate, suffix = ENCODERS["opus" if wanted == "auto" else wanted]
        codec = ["-c:a", encoder, "-b:a", rate]
    staged = job.stage(job.first.stem + suffix)
    await _ffmpeg(job, ["-i", str(job.first)], ["-vn", "-sn", "-dn", "-map", "0:a:0", *codec,
                                                 "-fs", str(job.max_bytes), "-y", str(staged.temporary)],
                  length, job.first.name)
    _bounded(staged.temporary, job.max_bytes, "convert_max_bytes", "raise it, or convert a shorter video")


async def video_to_gif(job: Job) -> None:
    """A clip as a GIF: one pass that builds the clip's palette and maps its frames to it."""
    lasts = await picture_length(job.first)
    start, duration = job.options["start"], job.options["duration"]
    if lasts and start >= lasts:
        raise ConvertFailed(f"{job.first.name} lasts {lasts:g} s: start {start:g} is past its end")
    length = min(duration, lasts - start) if lasts else duration
    graph = (f"fps={job.options['fps']},scale={job.options['width']}:-2:flags=lanczos,"
             "split[a][b];[a]palettegen=stats_mode=diff[p];[b][p]paletteuse=dither=bayer")
    staged = job.stage(job.first.stem + ".gif")
    await _ffmpeg(job, ["-ss", f"{start:g}", "-t", f"{duration:g}", "-i", str(job.first)],
                  ["-an", "-filter_complex", graph, "-loop", "0", "-fs", str(job.gif_max_bytes), "-y",
                   str(staged.temporary)], length, job.first.name)
    _bounded(staged.temporary, job.gif_max_bytes, "gif_max_bytes",
             "shorten duration, lower fps or width, or raise gif_max_bytes")


def crop_size(width: int, height: int, aspect: str) -> tuple[int, int]:
    """The largest window of ``aspect`` (``"9:16"``) in the frame, in even pixels (for H.264)."""
    top, _, bottom = aspect.partition(":")
    try:
        ratio = float(top) / float(bottom)
        if not 0.05 <= ratio <= 20:
            raise ValueError(aspect)
    except (ValueError, ZeroDivisionError):
        raise BadOption(f"option 'aspect'' must be width:height, such as 9:16 or 1:1, not {aspect!r}") from None
    if width / height > ratio:  # the frame is wider: full height, the window moves along x
        return int(height * ratio) // 2 * 2, height // 2 * 2
    return width // 2 * 2, int(width / ratio) // 2 * 2


async def trackcrop(job: Job) -> None:
    """Measure the motion (the worker), then render the window's path with ffmpeg's crop."""
    need_tool("ffmpeg")
    found = await probe(job.first)
    if found.width == 0 or found.fps <= 0:
        raise ConvertFailed(f"{job.first.name} has no picture; there is nothing to crop")
    crop_w, crop_h = crop_size(found.width, found.height, job.options["aspect"])
    frames = max(1, round(found.duration * found.fps))
    label = job.options["aspect"].replace(":", "x")
    staged = job.stage(f"{job.first.stem} {label}.mp4")
    with tempfile.TemporaryDirectory(prefix="trackcrop-") as scratch:
        commands = Path(scratch) / "window.cmd"
        request = {"files": [str(job.first)], "output": str(commands), "options": job.options,
                   "geometry": {"width": found.width, "height": found.height, "crop_w": crop_w, "crop_h": crop_h,
                                "fps": found.fps, "frames": frames}}

        def on_line(line: bytes) -> None:
            step = json.loads(line)
            job.report(step["done"], step["total"], "frames")

        await run_tool(worker_args("trackcrop", json.dumps(request)), name=job.first.name, on_line=on_line)
        # the commands' file by a plain name in ffmpeg's working folder: no filter-graph escaping
        graph = f"sendcmd=f=window.cmd,crop={crop_w}:{crop_h}:0:0"
        await _ffmpeg(job, ["-i", str(job.first)],
                      ["-vf", graph, "-c:v", "libx264", "-preset", "veryfast", "-crf", "20", "-pix_fmt", "yuv420p",
                       "-c:a", "aac", "-fs", str(job.max_bytes), "-y", str(staged.temporary)],
                      found.duration, job.first.name, cwd=scratch)
    _bounded(staged.temporary, job.max_bytes, "convert_max_bytes", "raise it, or crop a shorter video")
