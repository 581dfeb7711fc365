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
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

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
    try:
        process = _start(args, cwd)
    except FileNotFoundError:
        need_tool(tool)  # gone from PATH since it was found: say which package
        raise
    loop = asyncio.get_running_loop()
    exited = _exit_of(loop, process)
    transports: list[asyncio.BaseTransport] = []
    said: asyncio.Task[bytes] | None = None
    try:
        stdout = await _stream(loop, process.stdout, transports)
        said = asyncio.create_task(_tail(await _stream(loop, process.stderr, transports)))
        out = await _read(stdout, on_line, keep, name)
        await asyncio.shield(exited)
        err = await said
    finally:
        await asyncio.shield(_reap(process, exited, transports, said))
    if process.returncode != 0:
        raise _failed(tool, name, err, process.returncode)
    return ToolRun(out)


def _start(args: list[str], cwd: str | None) -> subprocess.Popen[bytes]:
    """The tool started by ``subprocess`` (vfork, then exec), not by the event loop: uvloop's
    ``subprocess_exec`` forks, which copies the daemon's page tables, a cost that grows with
    its memory (some 10 ms at 200 MB) and that a tool run from a shell does not pay."""
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, cwd=cwd)


def _exit_of(loop: asyncio.AbstractEventLoop, process: subprocess.Popen[bytes]) -> asyncio.Future[Any]:
    """A future done when ``process`` has ended (not yet reaped, so its group can still be
    killed): its pidfd turns readable. Without pidfds (Linux before 5.3) a thread waits."""
    try:
        handle = os.pidfd_open(process.pid)
    except (AttributeError, OSError):
        return loop.run_in_executor(None, process.wait)
    exited: asyncio.Future[Any] = loop.create_future()

    def ready() -> None:
        loop.remove_reader(handle)
        os.close(handle)
        exited.set_result(None)

    loop.add_reader(handle, ready)
    return exited


async def _stream(loop: asyncio.AbstractEventLoop, pipe: IO[bytes] | None,
                  transports: list[asyncio.BaseTransport]) -> asyncio.StreamReader:
    """``pipe`` read by the event loop; its transport (which then owns it) joins ``transports``."""
    assert pipe is not None
    reader = asyncio.StreamReader(limit=LINE_LIMIT, loop=loop)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe)
    transports.append(transport)
    return reader


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


async def _reap(process: subprocess.Popen[bytes], exited: asyncio.Future[Any],
                transports: list[asyncio.BaseTransport], said: asyncio.Task[bytes] | None) -> None:
    """Kill the tool's whole group if it still runs (ffmpeg under the worker dies with it), close
    its pipes and reap it, so nothing is left running or open."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # ended or not: what it left goes too
        os.killpg(process.pid, signal.SIGKILL)
    if said is not None:
        said.cancel()
        await asyncio.gather(said, return_exceptions=True)
    owned = [transport.get_extra_info("pipe") for transport in transports]
    for transport in transports:
        transport.close()
    for pipe in (process.stdout, process.stderr):  # one not yet handed to a transport
        if pipe is not None and pipe not in owned:
            pipe.close()
    await exited  # killed, it ends at once
    process.wait()


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
