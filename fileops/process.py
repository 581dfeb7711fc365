"""The tools an operation runs (ffmpeg, poppler, our own worker), through the daemon's launcher.

``core.process`` starts each in a process group of its own and kills the group when the
operation is cancelled, runs past its time bound, or the daemon shuts down. Here a tool's
end is said in the operations' words: its stdout read line by line for progress (ffmpeg's
``-progress pipe:1``, the worker's JSON lines) or kept whole (``pdftohtml -stdout``, up to
a bound); its stderr's last lines explain a failure.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from core import process
from core.errors import ConvertFailed, OutputTooLarge
from core.process import need_tool

__all__ = ["ToolRun", "need_tool", "run_tool", "worker_args"]

logger = logging.getLogger(__name__)


def worker_args(operation: str, request: str) -> list[str]:
    """The command line of the worker (``fileworker/worker.py``) doing ``operation`` on ``request``
    (JSON): the PDF and the tracking operations, in a process of their own so they can be killed."""
    return [sys.executable, "-m", "fileworker.worker", operation, request]


@dataclass
class ToolRun:
    """What a tool that ended well left: its stdout when kept (``keep``), else empty."""

    stdout: bytes


async def run_tool(
    args: list[str], *, name: str, on_line: Callable[[bytes], None] | None = None, keep: int = 0,
    cwd: str | None = None,
) -> ToolRun:
    """Run ``args`` until it ends; its group is killed if the operation is cancelled.

    Each stdout line goes to ``on_line``; or, with ``keep``, stdout is kept whole up to ``keep``
    bytes (more is ``OutputTooLarge``). A failure is ``ConvertFailed`` naming ``name`` (the
    input) and what the tool said; a tool not installed is ``ToolMissing``.
    """
    ended = await process.run_tool(args, keep=keep, on_line=on_line, cwd=cwd)
    if ended.cut:
        raise OutputTooLarge(f"{name}: the output passed convert_max_bytes ({keep} bytes); "
                             "raise convert_max_bytes or convert a smaller file")
    if ended.returncode != 0:
        raise _failed(os.path.basename(args[0]), name, ended.stderr, ended.returncode)
    return ToolRun(ended.stdout)


def _failed(tool: str, name: str, stderr: bytes, returncode: int) -> ConvertFailed:
    """The error of a tool that failed: its own last words, which name what it could not read."""
    lines = [line.strip() for line in stderr.decode("utf-8", "replace").splitlines() if line.strip()]
    logger.debug("%s on %s failed (%s): %s", tool, name, returncode, lines[-5:])
    for line in reversed(lines):  # the worker says it in one line for the user
        if line.startswith("fileops: "):
            code, _, message = line.removeprefix("fileops: ").partition(" ")
            return (OutputTooLarge if code == OutputTooLarge.code else ConvertFailed)(message)
    detail = lines[-1][:300] if lines else f"exit status {returncode}"
    return ConvertFailed(f"{name}: {tool} could not read it ({detail}); check that the file is whole, "
                         "or convert another copy")
