"""The tools an operation runs (ffmpeg, poppler, our own worker), each in its own process group.

A tool runs as a child of the daemon in a new session, so the whole group (ffmpeg, or the
worker and the ffmpeg it starts) is killed with one ``killpg`` when the operation is
cancelled, runs past its time bound, or the daemon shuts down. Its stdout is read line by
line for progress (ffmpeg's ``-progress pipe:1``, the worker's JSON lines) or kept whole
(``pdftohtml -stdout``, up to a bound); its stderr's last lines explain a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

from core.errors import ConvertFailed, OutputTooLarge, ToolMissing

__all__ = ["ToolRun", "need_tool", "run_tool", "worker_args"]

logger = logging.getLogger(__name__)

STDERR_KEEP = 16 * 1024  # the tail of a tool's stderr kept to explain its failure
LINE_LIMIT = 1024 * 1024  # one progress line (the worker's JSON lines are short)
# the Debian package of each tool an operation runs: a missing tool's error names it
PACKAGES = {"ffmpeg": "ffmpeg", "ffprobe": "ffmpeg", "pdftohtml": "poppler-utils", "pdfinfo": "poppler-utils"}


def need_tool(tool: str) -> str:
    """The path of ``tool`` on PATH, or ``ToolMissing`` naming the Debian package to install."""
    found = shutil.which(tool)
    if found is None:
        package = PACKAGES.get(tool, tool)
        raise ToolMissing(f"{tool} is not installed; install the Debian package {package} "
                          f"(sudo apt install {package}, or make setup) and try again")
    return found


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
    """Run ``args`` in a process group of its own until it ends; kill the group if cancelled.

    Each stdout line goes to ``on_line``; or, with ``keep``, stdout is kept whole up to ``keep``
    bytes (more is ``OutputTooLarge``). A failure is ``ConvertFailed`` naming ``name`` (the
    input) and what the tool said; a tool not installed is ``ToolMissing``.
    """
    tool = os.path.basename(args[0])
    starting = asyncio.ensure_future(asyncio.create_subprocess_exec(
        *args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, start_new_session=True, cwd=cwd, limit=LINE_LIMIT))
    try:
        process = await asyncio.shield(starting)
    except FileNotFoundError:
        need_tool(tool)  # gone from PATH since it was found: say which package
        raise
    except asyncio.CancelledError:  # cancelled while it started: once it has, it is stopped
        with contextlib.suppress(OSError):
            await asyncio.shield(_reap(await starting, None))
        raise
    assert process.stdout is not None and process.stderr is not None
    stderr = asyncio.create_task(_tail(process.stderr))
    try:
        out = await _read(process.stdout, on_line, keep, name)
        returncode = await process.wait()
        err = await stderr
    finally:
        await asyncio.shield(_reap(process, stderr))
    if returncode != 0:
        raise _failed(tool, name, err, returncode)
    return ToolRun(out)


async def _read(stream: asyncio.StreamReader, on_line: Callable[[bytes], None] | None, keep: int,
                name: str) -> bytes:
    if on_line is None:
        kept = bytearray()
        while chunk := await stream.read(65536):
            if keep:
                kept += chunk
                if len(kept) > keep:
                    raise OutputTooLarge(f"{name}: the output passed convert_max_bytes ({keep} bytes); "
                                         "raise convert_max_bytes or convert a smaller file")
        return bytes(kept)
    while line := await stream.readline():
        on_line(line)
    return b""


async def _tail(stream: asyncio.StreamReader) -> bytes:
    kept = b""
    while chunk := await stream.read(65536):
        kept = (kept + chunk)[-STDERR_KEEP:]
    return kept


async def _reap(process: asyncio.subprocess.Process, stderr: asyncio.Task[bytes] | None) -> None:
    """Kill the tool's whole group if it still runs (ffmpeg under the worker dies with it), drain
    its pipes and wait for it, so nothing is left running or open."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    if stderr is not None:
        stderr.cancel()
        await asyncio.gather(stderr, return_exceptions=True)
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            with contextlib.suppress(Exception):
                while await stream.read(65536):
                    pass
    await process.wait()


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
