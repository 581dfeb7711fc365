"""trackcrop's measure: where the moving subject is, frame by frame, and a window that follows it.

ffmpeg decodes the video scaled down to ``ANALYSIS_WIDTH`` pixels wide and grey, as raw bytes
on a pipe; numpy takes each frame's difference from the one before, and the centre of the
pixels that changed (past ``MOTION_LEVEL``) along the axis the window moves on. A frame
without motion keeps the last centre. The path is smoothed by a moving average over
``smooth`` seconds, so the window glides instead of jittering, and clamped to the frame.
The worker writes it as ffmpeg ``sendcmd`` commands for the ``crop`` filter, which the
daemon's render (``video.trackcrop``) reads.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .failure import WorkFailed

__all__ = ["filled", "smooth_path", "track_window", "window_path"]

ANALYSIS_WIDTH = 160  # pixels: motion is coarse, and small frames keep the measure fast
MOTION_LEVEL = 24  # a grey level's change that counts as motion, over the noise of a codec
MIN_MOVING = 4  # pixels that must change before a frame's centre moves


def track_window(request: dict[str, Any], progress: Callable[[int, int], None]) -> None:
    """Measure ``files[0]`` and write the crop window's commands to ``output`` (``sendcmd`` text)."""
    geometry = request["geometry"]  # from the daemon's probe: width, height, crop w/h, frames
    width, height = geometry["width"], geometry["height"]
    small_w = min(ANALYSIS_WIDTH, width) // 2 * 2
    small_h = max(2, round(height * small_w / width) // 2 * 2)
    horizontal = geometry["crop_w"] < width  # the window moves along x, else along y
    centres = _centres(request["files"][0], small_w, small_h, horizontal, geometry["frames"], progress)
    scale = (width / small_w) if horizontal else (height / small_h)
    window = geometry["crop_w"] if horizontal else geometry["crop_h"]
    limit = (width if horizontal else height) - window
    fps = geometry["fps"]
    path = np.asarray(filled(centres, (small_w if horizontal else small_h) / 2)) * scale
    offsets = window_path(path, window, limit, max(1, round(request["options"]["smooth"] * fps)))
    axis = "x" if horizontal else "y"
    lines = [f"{index / fps:.4f} crop {axis} {int(offset)};" for index, offset in enumerate(offsets)]
    Path(request["output"]).write_text("\n".join(lines) + "\n")


def filled(centres: list[float | None], middle: float) -> list[float]:
    """Each frame's centre, a frame without motion holding the last one; those before the first
    motion take the first (the subject was there before it moved); no motion at all: the middle."""
    first = next((centre for centre in centres if centre is not None), middle)
    out: list[float] = []
    for centre in centres:
        out.append(centre if centre is not None else (out[-1] if out else first))
    return out


def window_path(centres: np.ndarray, window: int, limit: int, span: int) -> np.ndarray:
    """The window's offset for each frame: centred on the smoothed subject, within the frame."""
    smoothed = smooth_path(centres, span)
    return np.clip(np.round(smoothed - window / 2), 0, max(0, limit)).astype(int)


def smooth_path(values: np.ndarray, span: int) -> np.ndarray:
    """A centred moving average over ``span`` frames, the ends padded with their own values."""
    if len(values) == 0 or span <= 1:
        return values.astype(float)
    half = span // 2
    padded = np.concatenate([np.full(half, values[0]), values, np.full(span - half - 1, values[-1])])
    return np.convolve(padded, np.ones(span) / span, mode="valid")


def _centres(path: str, small_w: int, small_h: int, horizontal: bool, frames: int,
             progress: Callable[[int, int], None]) -> list[float | None]:
    """The subject's centre along the window's axis, in small-frame pixels, for every frame
    (None: nothing moved since the frame before)."""
    args = ["ffmpeg", "-v", "error", "-nostdin", "-i", path, "-an", "-vf", f"scale={small_w}:{small_h},format=gray",
            "-f", "rawvideo", "-pix_fmt", "gray", "pipe:1"]
    size = small_w * small_h
    centres: list[float | None] = []
    previous: np.ndarray | None = None
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as decoder:
        assert decoder.stdout is not None
        while len(raw := decoder.stdout.read(size)) == size:
            frame = np.frombuffer(raw, np.uint8).reshape(small_h, small_w).astype(np.int16)
            centres.append(None if previous is None else _moving_centre(frame, previous, horizontal))
            previous = frame
            if len(centres) % 10 == 0:
                progress(len(centres), frames)
        _stderr = decoder.stderr.read() if decoder.stderr else b""
    if decoder.returncode != 0 or not centres:
        said = _stderr.decode("utf-8", "replace").strip().splitlines()
        raise WorkFailed(f"{Path(path).name}: ffmpeg could not decode it ({said[-1] if said else 'no frames'}); "
                            "check that the file is whole")
    progress(len(centres), len(centres))
    return centres


def _moving_centre(frame: np.ndarray, previous: np.ndarray, horizontal: bool) -> float | None:
    """The centre of the pixels that changed since ``previous``, or None when few did."""
    moving = np.abs(frame - previous) > MOTION_LEVEL
    profile = moving.sum(axis=0 if horizontal else 1)
    total = int(profile.sum())
    if total < MIN_MOVING:
        return None
    return float((profile * np.arange(len(profile))).sum() / total)
