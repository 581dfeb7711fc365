"""The tools the daemon runs on files (poppler, tesseract, ffmpeg, the file worker), each in a
process group of its own.

One launcher for the attachments (``attachments/pdf.py``, ``attachments/ocr.py``) and the file
operations (``fileops/``); each says in its own words what a failure means
(docs/DESIGN.md, "One launcher for the tools").

- A tool is started by ``subprocess.Popen`` (vfork, then exec), not by the event loop: uvloop's
  ``subprocess_exec`` forks, which copies the daemon's page tables, a cost that grows with its
  memory and that a tool run from a shell does not pay (``bench/bench_attachments.py``).
- It runs in a new session, so one ``killpg`` stops it and whatever it started (ffmpeg under the
  worker, ``sleep`` under a wrapper script) on a cancel, on its time bound, or when its output
  passes the bound the caller keeps; the group is killed and the tool reaped on every way out,
  so nothing is left running and no zombie stays.
- Its end is awaited on a pidfd the loop watches (a thread waits where Linux has no pidfds);
  its pipes are the loop's transports: stdin fed from memory without blocking, stdout kept up to
  a bound or read line by line, the last ``STDERR_KEEP`` bytes of stderr kept to explain a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import IO, Any

from .errors import ToolMissing

__all__ = ["PACKAGES", "ToolExit", "need_tool", "run_tool"]

STDERR_KEEP = 16 * 1024  # the tail of a tool's stderr kept to explain its failure
LINE_LIMIT = 1024 * 1024  # one progress line (ffmpeg's and the worker's lines are short)
READ_CHUNK = 64 * 1024
# the Debian package of each tool the daemon runs: a missing tool's error names it
PACKAGES = {
    "ffmpeg": "ffmpeg", "ffprobe": "ffmpeg", "pdftohtml": "poppler-utils", "pdfinfo": "poppler-utils",
    "pdftotext": "poppler-utils", "pdftoppm": "poppler-utils", "tesseract": "tesseract-ocr",
}


def need_tool(tool: str) -> str:
    """The path of ``tool`` on PATH, or ``ToolMissing`` naming the Debian package to install."""
    found = shutil.which(tool)
    if found is None:
        package = PACKAGES.get(tool, tool)
        raise ToolMissing(f"{tool} is not installed; install the Debian package {package} "
                          f"(sudo apt install {package}, or make setup) and try again")
    return found


@dataclass
class ToolExit:
    """How a tool ended: its exit status (negative: the signal that killed it), what it wrote to
    stdout (kept up to the caller's bound, ``cut`` when it wrote more and was stopped there) and
    the tail of its stderr."""

    returncode: int
    stdout: bytes
    cut: bool
    stderr: bytes


async def run_tool(
    args: list[str], *, keep: int = 0, on_line: Callable[[bytes], None] | None = None,
    stdin: bytes | None = None, timeout: float | None = None, env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> ToolExit:
    """Run ``args`` in a process group of its own until it ends, at most ``timeout`` seconds
    (``TimeoutError`` past it); the group is killed when it is cancelled or times out.

    Each stdout line goes to ``on_line``; without it, stdout is kept up to ``keep`` bytes, and a
    tool writing more is stopped there (``cut``). ``stdin`` is written to the tool's input. A
    tool not installed is ``ToolMissing`` naming its Debian package.
    """
    try:
        process = _start(args, stdin is not None, env, cwd)
    except FileNotFoundError:
        need_tool(os.path.basename(args[0]))  # not on PATH (or gone since it was found): say which package
        raise
    loop = asyncio.get_running_loop()
    exited = _exit_of(loop, process)
    pipes = _Pipes()
    try:
        async with asyncio.timeout(timeout):
            if stdin is not None:
                await pipes.feed(loop, process.stdin, stdin)
            stdout = await pipes.reader(loop, process.stdout)
            pipes.said = asyncio.create_task(_tail(await pipes.reader(loop, process.stderr)))
            out, cut = await _read(stdout, on_line, keep, process)
            await asyncio.shield(exited)
            err = await pipes.said
    finally:
        await asyncio.shield(_reap(process, exited, pipes))
    return ToolExit(process.returncode, out, cut, err)


def _start(args: list[str], feed: bool, env: dict[str, str] | None, cwd: str | None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, stdin=subprocess.PIPE if feed else subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, env=env, cwd=cwd)


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


class _Feeding(asyncio.BaseProtocol):
    """The protocol of a tool's stdin: whether the pipe is closed already (all of it written, or
    the tool gone), after which its transport must not be touched (asyncio's then has no loop)."""

    def __init__(self) -> None:
        self.closed = False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True


class _Pipes:
    """A tool's pipes as the loop's transports (which then own them), closed by ``_reap``."""

    def __init__(self) -> None:
        self.transports: list[asyncio.BaseTransport] = []
        self.writer: asyncio.WriteTransport | None = None  # stdin's, when fed
        self.feeding = _Feeding()
        self.said: asyncio.Task[bytes] | None = None  # the reading of stderr's tail
        self.handed: list[IO[bytes]] = []  # the pipes handed to the loop, its own from then on
        self.closed = False

    async def reader(self, loop: asyncio.AbstractEventLoop, pipe: IO[bytes] | None) -> asyncio.StreamReader:
        assert pipe is not None
        reader = asyncio.StreamReader(limit=LINE_LIMIT, loop=loop)
        await self._hand(pipe, loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe))
        return reader

    async def feed(self, loop: asyncio.AbstractEventLoop, pipe: IO[bytes] | None, data: bytes) -> None:
        """``data`` handed to the loop, which writes it as the tool reads and then closes the
        pipe; a tool that stops reading (it failed, or was killed) only ends the writing."""
        assert pipe is not None
        self.writer = await self._hand(pipe, loop.connect_write_pipe(lambda: self.feeding, pipe))
        self.writer.write(data)
        self.writer.write_eof()

    async def _hand(self, pipe: IO[bytes], connect: Awaitable[tuple[Any, Any]]) -> Any:
        """``pipe``'s transport, once the loop has it. A cancel does not cut the hand-over short:
        uvloop then closes the descriptor but not the pipe's file object, which closing here
        failed on (and left the next pipe open), and which warned when collected; the
        transport made is closed with the others."""
        self.handed.append(pipe)
        made = asyncio.ensure_future(connect)
        made.add_done_callback(self._made)
        transport, _ = await asyncio.shield(made)
        return transport

    def _made(self, made: asyncio.Future[tuple[Any, Any]]) -> None:
        if made.cancelled() or made.exception() is not None:
            return
        transport = made.result()[0]
        self.transports.append(transport)
        if self.closed:  # made after the tool's reap began
            transport.close()

    def close(self, process: subprocess.Popen[bytes]) -> None:
        self.closed = True
        for transport in self.transports:
            if transport is self.writer and not self.feeding.closed:
                transport.abort()  # what the tool did not read is dropped, not waited for
            else:
                transport.close()
        for pipe in (process.stdin, process.stdout, process.stderr):  # one not handed to the loop
            if pipe is not None and pipe not in self.handed:
                pipe.close()


async def _read(stream: asyncio.StreamReader, on_line: Callable[[bytes], None] | None, keep: int,
                process: subprocess.Popen[bytes]) -> tuple[bytes, bool]:
    """The tool's stdout, each line to ``on_line``, or kept up to ``keep`` bytes; past those, the
    tool is stopped (more is useless, and would fill memory) and the output said to be cut."""
    if on_line is not None:
        while line := await stream.readline():
            on_line(line)
        return b"", False
    kept = bytearray()
    while chunk := await stream.read(READ_CHUNK):
        if len(kept) + len(chunk) > keep:
            kept += chunk[:keep - len(kept)]
            _kill(process)
            return bytes(kept), True
        kept += chunk
    return bytes(kept), False


async def _tail(stream: asyncio.StreamReader) -> bytes:
    kept = b""
    while chunk := await stream.read(READ_CHUNK):
        kept = (kept + chunk)[-STDERR_KEEP:]
    return kept


def _kill(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL to the tool's whole group: ended or not (not yet reaped, its pid is still its own),
    what it started goes too."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


async def _reap(process: subprocess.Popen[bytes], exited: asyncio.Future[Any], pipes: _Pipes) -> None:
    """Kill the tool's group if anything of it still runs, close its pipes and reap it, so nothing
    is left running or open."""
    _kill(process)
    try:
        try:
            if pipes.said is not None:
                pipes.said.cancel()
                await asyncio.gather(pipes.said, return_exceptions=True)
        finally:
            pipes.close(process)
        await exited  # killed, it ends at once
    finally:
        # reaped even when this is cancelled (a loop closing cancels what is left of a reap under
        # way): a Popen dropped unreaped leaves a zombie and warns; killed, the wait is short
        process.wait()
