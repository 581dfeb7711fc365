"""Answering the daemon's ``approval`` events: a tool that may act waits for a person.

``Approver.decide`` answers one event: a tool named by ``--approve`` (or every one, with
``--approve-all``) is allowed at once; else, on a terminal, the call is shown (its tool, its
server, its arguments escaped and long values cut with their length) and the person asked
``Allow? [y/N/a(lways in this conversation)]``; without a terminal (stderr, where the question
shows, and the keyboard: stdin, or the controlling terminal when text was piped in) it is denied. The answer
is read from the keyboard with the event loop running (``add_reader`` on the terminal in its
line mode), so a Ctrl-C there (``Interrupts``) can deny it and stop the reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Iterable
from typing import Any

from .terminal import Terminal

__all__ = ["Approver", "describe_call"]

PROMPT = "Allow? [y/N/a(lways in this conversation)] "
MAX_VALUE_CHARS = 200  # of one argument's value shown; the rest is counted, not shown
READ_BYTES = 4096


def _shown(value: Any) -> str:
    """One argument's value as JSON (quotes, newlines and control characters escaped), cut."""
    text = json.dumps(value, ensure_ascii=False)
    if len(text) <= MAX_VALUE_CHARS:
        return text
    return f"{text[:MAX_VALUE_CHARS]}… ({len(text):,} characters)"


def describe_call(event: dict[str, Any]) -> list[str]:
    """An ``approval`` event for a person: the tool, its server, each argument on a line."""
    where = f" (MCP server {event['server']})" if event.get("server") else ""
    lines = [f"[the model wants to run {event['tool']}{where}, which may change things]"]
    arguments = event.get("arguments") or {}
    lines += [f"  {key}: {_shown(value)}" for key, value in arguments.items()] or ["  (no arguments)"]
    return lines


class Approver:
    """Decides the approval events of the turns a command shows."""

    def __init__(self, terminal: Terminal, *, approve_all: bool = False, approve: Iterable[str] = ()) -> None:
        self.terminal = terminal
        self.approve_all = approve_all
        self.approve = set(approve)  # tool names, as offered (SERVER__TOOL) or as on their server
        self._answer: asyncio.Future[str] | None = None  # the keyboard's answer being waited for

    async def decide(self, event: dict[str, Any]) -> tuple[bool, str]:
        """Whether to allow the call, and for how long (``once`` or ``conversation``; ``unasked``:
        denied with nobody to ask)."""
        if self.approve_all or {event.get("name"), event.get("tool")} & self.approve:
            return True, "once"
        for line in describe_call(event):
            self.terminal.note(line)
        keyboard = _keyboard() if self.terminal.interactive else None  # asked where it is seen
        if keyboard is None:
            return False, "unasked"
        with keyboard as fd:
            answer = (await self._read(fd)).strip().lower()
        if answer in ("a", "always"):
            return True, "conversation"
        return answer in ("y", "yes"), "once"

    def interrupt(self) -> bool:
        """Ctrl-C: deny the call being asked about (False when none is)."""
        if self._answer is None or self._answer.done():
            return False
        self.terminal.note("")
        self._answer.set_result("")
        return True

    async def _read(self, fd: int) -> str:
        """One line typed (the terminal's line mode gives it whole); "" at its end."""
        loop = asyncio.get_running_loop()
        answer = self._answer = loop.create_future()  # before the question shows: a Ctrl-C at once denies
        self.terminal.err.write(PROMPT)
        self.terminal.err.flush()

        def readable() -> None:
            try:
                data = os.read(fd, READ_BYTES)
            except OSError:
                data = b""
            if not answer.done():
                answer.set_result(data.decode("utf-8", "replace"))

        loop.add_reader(fd, readable)
        try:
            return await answer
        finally:
            loop.remove_reader(fd)
            self._answer = None


def _keyboard() -> contextlib.AbstractContextManager[int] | None:
    """The terminal to ask at: stdin when it is one, else the controlling terminal (text was piped
    in); None without either."""
    try:
        if sys.stdin is not None and sys.stdin.isatty():
            return contextlib.nullcontext(sys.stdin.fileno())
    except (ValueError, OSError):
        pass
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return None
    return _closing(fd)


@contextlib.contextmanager
def _closing(fd: int) -> Any:
    try:
        yield fd
    finally:
        os.close(fd)
