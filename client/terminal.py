"""Terminal manners: what goes where, Ctrl-C, stdin, and a pipe that closes.

- The reply's text goes to stdout; everything else (progress, tool calls, errors, the
  context meter) to stderr, each on a line of its own: when stdout and stderr end in the
  same place (a terminal, or ``> log 2>&1``) a note first ends the reply's line.
- Progress is shown only when stderr is a terminal, as one status line redrawn in place
  and erased before anything else is written.
- ``Interrupts``: the first Ctrl-C while the daemon works asks it to stop (a ``cancel``:
  the partial reply or the files added are kept) and waits for its answer; a second one
  stops waiting.
- ``piped_stdin``: text piped or redirected in is part of the question (as llm does).
- A reply's control characters (ESC, CR, ...) are shown as ``\\x1b`` on a terminal, and
  go out as they are into a file or a pipe; any other text (titles, names, a server's
  descriptions) is always shown, never obeyed.
"""

from __future__ import annotations

import asyncio
import io
import os
import select
import shutil
import signal
import stat
import sys
from collections.abc import Callable
from typing import Any, TextIO

from common import MAX_REQUEST_BYTES

from .render import Printable
from .wire import Unsendable

__all__ = [
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_NO_DAEMON",
    "EXIT_OK",
    "EXIT_USAGE",
    "Interrupts",
    "ProgressBar",
    "Terminal",
    "piped_stdin",
    "reattach_terminal",
]

EXIT_OK = 0
EXIT_ERROR = 1  # the daemon answered with an error
EXIT_USAGE = 2  # argparse's own
EXIT_NO_DAEMON = 3  # no daemon answers, or the socket path cannot be one
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
# seconds a socket on stdin has to show text (or its end) before the client goes on without
# it: a parent writes what it pipes as it starts the client, which takes longer than this to start
SOCKET_GRACE = 0.1
ERASE_LINE = "\r\x1b[K"


def _same_place(a: TextIO, b: TextIO) -> bool:
    """Whether two streams write to the same file or terminal."""
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (sa.st_dev, sa.st_ino, sa.st_rdev) == (sb.st_dev, sb.st_ino, sb.st_rdev)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (ValueError, AttributeError):
        return False


class Terminal:
    """The client's two outputs: ``text`` (the reply, stdout) and ``note`` (stderr, own lines)."""

    def __init__(self, out: TextIO, err: TextIO, *, quiet: bool = False) -> None:
        for stream in (out, err):  # a character the locale cannot show is a "?", not a traceback
            if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
                stream.reconfigure(errors="replace")
        self.out = Printable(out)
        # a reply's control characters are shown on a terminal, never obeyed; into a file or a
        # pipe, the model's bytes go out exactly (what it wrote is what is saved)
        self.reply: TextIO | Printable = self.out if _isatty(out) else out
        self.err = Printable(err)
        self.raw_err = err  # the status line is drawn with \r, which Printable would show
        self.interactive = _isatty(err)
        self.quiet = quiet  # --quiet: no progress, no context meter
        self.shared = _same_place(out, err)
        self.mid_line = False  # the reply's last text did not end its line
        self.status_shown = False

    def text(self, text: str) -> None:
        """Reply text, as it streams."""
        if not text:
            return
        self.clear_status()
        self.reply.write(text)
        self.reply.flush()
        self.mid_line = not text.endswith("\n")

    def end_text(self) -> None:
        """End the reply's line, if it is open."""
        if self.mid_line:
            self.out.write("\n")
            self.out.flush()
            self.mid_line = False

    def note(self, line: str) -> None:
        """A line on stderr, never glued to the reply's text."""
        self.clear_status()
        if self.shared:  # one destination: what stdout holds goes first
            self.end_text()
            self.out.flush()
        self.err.write(line + "\n")
        self.err.flush()

    def status(self, line: str) -> None:
        """A passing state (waiting for the model, running a tool), on a terminal only."""
        if not self.interactive or self.quiet:
            return
        if self.shared:
            self.end_text()
        width = max(shutil.get_terminal_size().columns - 1, 10)
        self.clear_status()
        self.raw_err.write(line.translate(_CONTROLS_IN_STATUS)[:width])
        self.raw_err.flush()
        self.status_shown = True

    def clear_status(self) -> None:
        if self.status_shown:
            self.raw_err.write(ERASE_LINE)
            self.raw_err.flush()
            self.status_shown = False


# C0, DEL and C1 (U+009B is CSI, U+009D OSC to a terminal that reads 8-bit controls)
_CONTROLS_IN_STATUS = {c: " " for c in (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0))}


class ProgressBar:
    """One line on a terminal, redrawn in place: ``reading  [#####     ] 12/40``."""

    WIDTH = 30

    def __init__(self, terminal: Terminal) -> None:
        self.terminal = terminal

    def update(self, event: dict[str, Any]) -> None:
        done, total = event.get("done", 0), max(event.get("total", 0), 1)
        filled = self.WIDTH * min(done, total) // total
        bar = "#" * filled + " " * (self.WIDTH - filled)
        self.terminal.status(f"{event.get('phase', ''):<9} [{bar}] {done}/{total}")


class Interrupts:
    """Ctrl-C while the daemon works: the first calls ``first`` (a cancel) and the command goes
    on to the daemon's answer; a second one cancels the waiting task (the command stops)."""

    def __init__(self, first: Callable[[], None]) -> None:
        self.first = first
        self.count = 0
        self._task: asyncio.Task[Any] | None = None

    def __enter__(self) -> Interrupts:
        self._task = asyncio.current_task()
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, self._interrupted)
        return self

    def __exit__(self, *exc_info: object) -> None:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)

    def _interrupted(self) -> None:
        self.count += 1
        if self.count == 1:
            self.first()
        elif self._task is not None:
            self._task.cancel()


def piped_stdin() -> str | None:
    """The text piped or redirected into the client; None when stdin is a terminal, absent,
    a device (/dev/null), or a socket with nothing to say, none of which is waited on.
    ``Unsendable`` past ``MAX_REQUEST_BYTES``, read no further (a gigabyte piped in by mistake).

    A socket is how some parents pipe (Node's ``child_process`` and uvloop's subprocesses
    hand a socketpair): it is read when it has text, or has ended, within ``SOCKET_GRACE``
    seconds, so text given that way is part of the question; a socket left open and silent
    (Node's ``exec`` never closes the stdin it makes) is not waited on.
    """
    stream = sys.stdin
    try:
        if stream is None or stream.isatty():
            return None
        fd = stream.fileno()
        mode = os.fstat(fd).st_mode
        if stat.S_ISSOCK(mode) and not select.select([fd], [], [], SOCKET_GRACE)[0]:
            return None
    except (OSError, ValueError):
        return None
    if not (stat.S_ISFIFO(mode) or stat.S_ISREG(mode) or stat.S_ISSOCK(mode)):
        return None
    data = stream.buffer.read(MAX_REQUEST_BYTES + 1)  # no more than a request may carry
    if len(data) > MAX_REQUEST_BYTES:
        raise Unsendable(
            f"stdin holds more than the {MAX_REQUEST_BYTES:,} bytes a question may have; "
            "send long text as a file (ask -f FILE)", "too_long",
        )
    return data.decode("utf-8", "replace")


def reattach_terminal() -> bool:
    """After reading piped stdin, read the keyboard again (``/dev/tty``); False when there is none."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY)
    except OSError:
        return False
    os.dup2(fd, sys.stdin.fileno())
    os.close(fd)
    sys.stdin = os.fdopen(sys.stdin.fileno(), "r", closefd=False)
    return True
