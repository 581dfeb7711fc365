"""``assistant chat``: an interactive conversation over the socket.

A new conversation, or one continued (``-c`` the latest, ``--cid N``); text piped in (and
words given) is its first message, after which the keyboard is read again from the
terminal. Each reply streams as ``ask``'s does. Ctrl-C while a reply streams cancels it (the
daemon stops the turn and keeps the partial reply) and comes back to the prompt; Ctrl-C at
the prompt clears the line; Ctrl-D, ``exit`` or ``quit`` leave. A chat that loses the
daemon (a restart) connects again: a question not yet sent goes to it, and a reply being
shown is followed from where it was. A line ending in ``\\``
goes on on the next line, and ``\"\"\"`` opens and closes a block of lines. ``/file PATH``
attaches files to the next question. Line editing and a history kept between sessions come
from the standard library's ``readline`` where it is present.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from .terminal import EXIT_ERROR, EXIT_OK, EXIT_USAGE, Terminal, piped_stdin, reattach_terminal
from .turn import Turn, chosen_conversation, compose_question, file_paths, set_system
from .wire import DaemonGone, Wire

__all__ = ["Chat"]

PROMPT = "> "
CONTINUATION = "... "
BLOCK = '"""'
LEAVE = frozenset({"exit", "quit", "/exit", "/quit"})
HISTORY_LENGTH = 1000
RECONNECT_FOR = 30.0  # seconds a chat waits for its daemon to come back (a restart) before it gives up
RECONNECT_PAUSE = 0.2  # seconds between attempts
HELP = """\
  /file PATH...  attach files to the next question      /file  list them    /drop  forget them
  \"\"\"            start (and end) several lines           a line ending in \\ goes on below
  Ctrl-C         stop the reply (it is kept)             Ctrl-D or exit     leave"""


def history_file() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "assistant" / "chat_history"


def setup_readline() -> Callable[[], None]:
    """Line editing and a history between sessions, where ``readline`` exists; the saver."""
    try:
        import readline
    except ImportError:  # not built on this system: plain input() still works
        return lambda: None
    path = history_file()
    with contextlib.suppress(OSError):
        readline.read_history_file(path)
    readline.set_history_length(HISTORY_LENGTH)

    def save() -> None:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)

    return save


def read_line(prompt: str) -> str:
    """One line from the keyboard; Ctrl-C raises KeyboardInterrupt here (and only here)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return input(prompt)
    finally:
        signal.signal(signal.SIGINT, previous)


def _utf8(line: str) -> bool:
    try:
        line.encode()
    except UnicodeEncodeError:
        return False
    return True


class Chat:
    """One chat session on one connection."""

    def __init__(
        self, client: Wire, args: argparse.Namespace, terminal: Terminal,
        reconnect: Callable[[], Awaitable[Wire]] | None = None,
    ) -> None:
        self.client = client
        self.reconnect = reconnect  # a new connection, once the daemon restarted under the chat
        self.args = args
        self.terminal = terminal
        self.conversation: int | None = None
        self.system: str | None = None  # for the ask that starts a new conversation
        self.staged: list[str] = []

    async def run(self) -> int:
        if not await self._choose_conversation():
            return EXIT_ERROR
        self.staged = file_paths(self.args.file)
        piped = piped_stdin()
        first = compose_question(self.args.text, piped)
        interactive = sys.stdin.isatty() if piped is None else reattach_terminal()
        if not interactive:  # the first question is all there is
            if first.strip() or self.staged:
                return await self._ask(first)
            self.terminal.note("assistant: chat reads from a terminal; without one, give the question as words "
                               "or on stdin (or use ask)")
            return EXIT_USAGE
        where = f"conversation {self.conversation}" if self.conversation else "a new conversation"
        self.terminal.note(f"chat: {where}; Ctrl-C stops a reply, Ctrl-D or exit leaves, /help for more")
        if first.strip():  # files given without a question wait for the first one typed
            await self._ask(first)
        save = setup_readline()
        try:
            while (message := self._read_message()) is not None:
                if not self._command(message):
                    await self._ask(message)
        finally:
            save()
        return EXIT_OK

    async def _choose_conversation(self) -> bool:
        """The conversation to continue (None: a new one) and its system prompt; False on an error."""
        self.conversation = await chosen_conversation(self.client, self.args)
        if self.args.system is None:
            return True
        if self.conversation is None:
            self.system = self.args.system  # sent with the ask that creates it
            return True
        return await set_system(self.client, self.conversation, self.args.system, self.terminal)

    async def _ask(self, text: str) -> int:
        request: dict[str, Any] = {"type": "ask", "text": text}
        if self.conversation is not None:
            request["conversation"] = self.conversation
        elif self.system is not None:
            request["system"] = self.system
        if self.args.model:
            request["model"] = self.args.model
        if self.staged:
            request["files"], self.staged = self.staged, []
        turn = Turn(self.client, self.terminal, as_json=self.args.json)
        try:
            status = await turn.run(request)
        except DaemonGone:
            if self.reconnect is None or turn.sent and (turn.conversation is None or turn.turn is None):
                raise  # it may have reached the daemon, with no turn to find it by: never asked twice
            await self._reconnect()
            if turn.sent:
                status = await self._rejoin(turn)
            else:
                # the daemon went away while the chat waited for a question (a restart): the
                # question goes to the daemon there now
                turn = Turn(self.client, self.terminal, as_json=self.args.json)
                status = await turn.run(request)
        if turn.conversation is not None:
            self.conversation = turn.conversation
        return status

    async def _rejoin(self, turn: Turn) -> int:
        """Follow the reply being shown on a new connection, as often as the daemon goes away."""
        while True:
            try:
                return await turn.rejoin(self.client)
            except DaemonGone:
                await self._reconnect()

    async def _reconnect(self) -> None:
        """A new connection to the daemon, waiting for it to be back (``RECONNECT_FOR`` at most)."""
        assert self.reconnect is not None
        await self.client.close()
        deadline = asyncio.get_running_loop().time() + RECONNECT_FOR
        while True:
            try:
                self.client = await self.reconnect()
                break
            except DaemonGone:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(RECONNECT_PAUSE)
        self.terminal.note("[reconnected to the daemon]")

    def _read_message(self) -> str | None:
        """The next message typed; None to leave."""
        while True:
            try:
                line = read_line(PROMPT)
                if line.strip() in LEAVE:
                    return None
                if line.strip() == BLOCK:
                    line = self._read_block()
                while line.endswith("\\"):
                    line = line[:-1] + "\n" + read_line(CONTINUATION)
            except KeyboardInterrupt:
                self.terminal.note("")  # ^C at the prompt: a fresh prompt, as a shell gives
                continue
            except EOFError:
                self.terminal.note("")
                return None
            except UnicodeDecodeError:  # a strict reader of a line that is not UTF-8
                line = "\udcff"
            if not _utf8(line):  # bytes that are not UTF-8 come as surrogates: they cannot be sent
                self.terminal.note("assistant: that line is not UTF-8 text, so it was not sent; type it again")
                continue
            if line.strip():
                return line

    @staticmethod
    def _read_block() -> str:
        lines: list[str] = []
        while (line := read_line(CONTINUATION)).strip() != BLOCK:
            lines.append(line)
        return "\n".join(lines)

    def _command(self, line: str) -> bool:
        """Run a /command; False when the line is a message."""
        if not line.startswith("/"):
            return False
        try:
            name, *words = shlex.split(line)
        except ValueError as exc:
            self.terminal.note(f"{exc}; quote paths with spaces")
            return True
        if name == "/file":
            for path in file_paths(words):
                if os.path.isfile(path):
                    self.staged.append(path)
                else:
                    self.terminal.note(f"no such file: {path}")
            listed = ", ".join(os.path.basename(p) for p in self.staged) or "none"
            self.terminal.note(f"files for the next question: {listed}")
        elif name == "/drop":
            self.staged = []
            self.terminal.note("files for the next question: none")
        elif name == "/help":
            self.terminal.note(HELP)
        else:
            self.terminal.note(f"unknown command {name}; /help lists them (a message cannot start with /)")
        return True
