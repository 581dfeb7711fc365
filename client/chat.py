"""``assistant chat``: an interactive conversation over the socket.

A new conversation, or one continued (``-c`` the latest, ``--cid N``); text piped in (and
words given) is its first message, after which the keyboard is read again from the
terminal. Each reply streams as ``ask``'s does. Ctrl-C while a reply streams cancels it (the
daemon stops the turn and keeps the partial reply) and comes back to the prompt; Ctrl-C at
the prompt clears the line; Ctrl-D, ``exit`` or ``quit`` leave. A chat that loses the
daemon (a restart) connects again: a question not yet sent goes to it, and a reply being
shown is followed from where it was. A line ending in ``\\``
goes on on the next line, and ``\"\"\"`` opens and closes a block of lines (recalled from the
history as one entry); a bracketed paste of several lines is one message. The /commands
(``HELP``) attach files (Tab completes their paths), change the model or the system prompt,
start a new conversation, ask the last question again, edit it in ``$EDITOR``, save the
conversation as Markdown; ``//`` starts a message with a slash. Line editing and a history
kept between sessions come from the standard library's ``readline`` where it is present.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from .render import error_text
from .terminal import EXIT_ERROR, EXIT_OK, EXIT_USAGE, Terminal, piped_stdin, reattach_terminal
from .turn import Turn, chosen_conversation, compose_question, file_paths, set_system
from .wire import DaemonGone, Wire

__all__ = ["Chat"]

PROMPT = "> "
CONTINUATION = "... "
BLOCK = '"""'
LEAVE = frozenset({"exit", "quit", "/exit", "/quit"})
HISTORY_LENGTH = 1000
RECONNECT_PAUSE = 0.2  # seconds between attempts to reach a daemon that went away
HELP = """\
  /file PATH...  attach files to the next question (Tab completes)   /file  list them   /drop  forget them
  /model [NAME]  the model of the next questions (alone: which)      /system TEXT  the system prompt
  /new           a new conversation from the next question           /retry  ask the last question again
  /remember TEXT keep TEXT in the saved memories (assistant memory list shows them)
  /edit          the last question in $EDITOR, then ask it           /save FILE  the conversation as Markdown
  \"\"\"            start (and end) several lines                      a line ending in \\ goes on below
  //text         a message that starts with /                        Ctrl-C  stop the reply (it is kept)
  Ctrl-D or exit leave"""
COMMANDS = ("/file", "/drop", "/model", "/system", "/remember", "/new", "/retry", "/edit", "/save", "/help", "/exit", "/quit")


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
    # CPython turns bracketed paste off; on, a paste of several lines is one message (mode 2004)
    readline.parse_and_bind("set enable-bracketed-paste on")
    readline.set_completer_delims(" \t\n")
    readline.set_completer(complete)
    readline.parse_and_bind("tab: complete")

    def save() -> None:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)

    return save


def complete(text: str, state: int) -> str | None:
    """Tab: a /command's name, or a path after ``/file``."""
    import readline

    line = readline.get_line_buffer()
    if line.startswith("/file "):
        found = sorted(glob.glob(os.path.expanduser(text) + "*"))
        options = [f + "/" if os.path.isdir(f) else f for f in found]
    elif " " not in line and text.startswith("/"):
        options = [c for c in COMMANDS if c.startswith(text)]
    else:
        options = []
    return options[state] if state < len(options) else None


def remember(since: int, message: str) -> None:
    """A message typed over several lines is recalled as one history entry, not line by line."""
    try:
        import readline
    except ImportError:
        return
    while readline.get_current_history_length() > since:
        readline.remove_history_item(readline.get_current_history_length() - 1)
    readline.add_history(message)


def history_length() -> int:
    try:
        import readline
    except ImportError:
        return 0
    return readline.get_current_history_length()


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
        self.last: tuple[str, list[str]] | None = None  # the last question and its files (/retry, /edit)

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
                if not await self._command(message):
                    await self._ask(message[1:] if message.startswith("//") else message)
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
        if self.conversation is None and self.args.incognito:
            request["memory"] = "off"
        if self.args.model:
            request["model"] = self.args.model
        request.update(self.args.options)
        self.last = (text, list(self.staged))
        if self.staged:
            request["files"], self.staged = self.staged, []
        turn = Turn(self.client, self.terminal, as_json=self.args.json)
        try:
            status = await turn.run(request)
        except DaemonGone:
            if self.reconnect is None:
                raise
            unplaced = turn.sent and (turn.conversation is None or turn.turn is None)
            await self._reconnect()
            if unplaced and not await turn.find(self.client):
                raise  # it may have reached the daemon, and is not found stored: never asked twice
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
        """A new connection to the daemon, waiting as long as it takes for one to answer (socket
        activation, a restart), and saying so; Ctrl-C stops waiting, and the chat."""
        assert self.reconnect is not None
        await self.client.close()
        told = False
        while True:
            try:
                self.client = await self.reconnect()
                break
            except DaemonGone as exc:
                if not told:
                    self.terminal.note(f"[{exc}; waiting for it to start again (Ctrl-C leaves)]")
                    told = True
                await asyncio.sleep(RECONNECT_PAUSE)
        self.terminal.note("[reconnected to the daemon]")

    def _read_message(self) -> str | None:
        """The next message typed; None to leave."""
        while True:
            since = history_length()
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
            if history_length() > since + 1:
                remember(since, line)
            if line.strip():
                return line

    @staticmethod
    def _read_block() -> str:
        lines: list[str] = []
        while (line := read_line(CONTINUATION)).strip() != BLOCK:
            lines.append(line)
        return "\n".join(lines)

    async def _command(self, line: str) -> bool:
        """Run a /command; False when the line is a message (``//`` is one, starting with /)."""
        if not line.startswith("/") or line.startswith("//"):
            return False
        try:
            name, *words = shlex.split(line)
        except ValueError as exc:
            self.terminal.note(f"{exc}; quote paths with spaces")
            return True
        commands = {"/file": self._file, "/drop": self._drop, "/model": self._model, "/system": self._system,
                    "/new": self._new, "/retry": self._retry, "/edit": self._edit, "/save": self._save,
                    "/help": self._help, "/remember": self._remember}
        command = commands.get(name)
        if command is None:
            self.terminal.note(f"unknown command {name}; /help lists them (// starts a message with /)")
        else:
            await command(words)
        return True

    async def _file(self, words: list[str]) -> None:
        for path in file_paths(words):
            if os.path.isfile(path):
                self.staged.append(path)
            else:
                self.terminal.note(f"no such file: {path}")
        listed = ", ".join(os.path.basename(p) for p in self.staged) or "none"
        self.terminal.note(f"files for the next question: {listed}")

    async def _drop(self, words: list[str]) -> None:
        self.staged = []
        self.terminal.note("files for the next question: none")

    async def _remember(self, words: list[str]) -> None:
        answer = await self.client.request({"type": "memory_add", "text": " ".join(words)})
        if answer["type"] == "error":
            self.terminal.note(error_text(answer))
        else:
            memory = answer["memory"]
            self.terminal.note(f"remembered: {memory['text']} (memory {memory['id']})")

    async def _help(self, words: list[str]) -> None:
        self.terminal.note(HELP)

    async def _model(self, words: list[str]) -> None:
        if words:
            self.args.model = words[0]
        self.terminal.note(f"model: {self.args.model or 'that of the conversation, else the default'}")

    async def _system(self, words: list[str]) -> None:
        text = " ".join(words)
        if self.conversation is None:
            self.system = text  # sent with the ask that makes the conversation
        elif not await set_system(self.client, self.conversation, text, self.terminal):
            return
        self.terminal.note(f"system prompt: {text!r}" if text else "system prompt: none")

    async def _new(self, words: list[str]) -> None:
        self.conversation, self.system, self.last = None, None, None
        self.terminal.note("a new conversation starts with the next question")

    async def _retry(self, words: list[str]) -> None:
        if self.last is None:
            self.terminal.note("nothing to ask again yet")
            return
        text, self.staged = self.last
        await self._ask(text)

    async def _edit(self, words: list[str]) -> None:
        """The last question (or nothing) in ``$EDITOR``; what is saved is asked."""
        with tempfile.NamedTemporaryFile("w+", suffix=".md", prefix="assistant-") as draft:
            draft.write(self.last[0] if self.last else "")
            draft.flush()
            editor = shlex.split(os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi")
            try:
                done = subprocess.run([*editor, draft.name], check=False)
            except OSError as exc:
                self.terminal.note(f"cannot run {editor[0]} ({exc.strerror}); set EDITOR to your editor")
                return
            with open(draft.name, encoding="utf-8", errors="replace") as edited:
                text = edited.read().strip()
        if done.returncode != 0 or not text:
            self.terminal.note("nothing asked (the editor failed, or left the text empty)")
            return
        await self._ask(text)

    async def _save(self, words: list[str]) -> None:
        if len(words) != 1:
            self.terminal.note("/save FILE: one file to write the conversation to")
            return
        if self.conversation is None:
            self.terminal.note("nothing to save yet: ask a first question")
            return
        event = await self.client.request({"type": "open", "conversation": self.conversation})
        if event["type"] == "error":
            self.terminal.note(f"assistant: {error_text(event)}")
            return
        path = os.path.abspath(os.path.expanduser(words[0]))
        try:
            with open(path, "w", encoding="utf-8") as out:
                out.write(as_markdown(event))
        except OSError as exc:
            self.terminal.note(f"cannot write {path} ({exc.strerror})")
            return
        self.terminal.note(f"saved conversation {self.conversation} ({len(event['turns'])} turns) to {path}")


def as_markdown(conversation: dict[str, Any]) -> str:
    """A conversation as ``open`` gives it, as Markdown: a heading per question and per reply."""
    parts = [f"# {conversation['title']}\n"]
    if conversation.get("system"):
        parts.append(f"*System prompt:* {conversation['system']}\n")
    for turn in conversation["turns"]:
        files = "".join(f"\n- file: {chip['name']}" for chip in turn.get("files") or ())
        parts.append(f"## You\n\n{turn['text']}{files}\n")
        stopped = "" if turn.get("status") == "complete" else f"\n\n*({turn.get('status')})*"
        parts.append(f"## Assistant\n\n{turn['reply'] or ''}{stopped}\n")
    return "\n".join(parts)
