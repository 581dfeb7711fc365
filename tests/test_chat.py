"""``assistant chat`` under a pseudo-terminal, as a person uses it: typing, Ctrl-C while a
reply streams, multi-line input, /file, Ctrl-D; and with text piped in."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import re
import subprocess
import sys
import termios
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from client import Wire
from core.tools import TOOL_GUIDANCE
from daemon import events as daemon_events
from selfcheck.fakerouter import FakeRouter, Reply
from tests.conftest import RunningDaemon
from tests.test_client import ROOT, cli, piped

pytestmark = pytest.mark.asyncio

WAIT = 30.0  # seconds for any expected output: a hang fails the test instead of stalling it
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


class Terminal:
    """The client as a child on a pseudo-terminal that is its controlling terminal, so that
    Ctrl-C (\\x03) typed on it sends SIGINT as a real one does."""

    def __init__(self, proc: subprocess.Popen[bytes], master: int) -> None:
        self.proc = proc
        self.master = master
        self.seen = b""  # everything read, escapes removed
        self.raw = b""  # everything read, as it was
        self._unread = 0  # where the next expect() starts

    @classmethod
    def spawn(cls, *args: str) -> Terminal:
        master, slave = pty.openpty()
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "assistant.py"), *args], cwd=ROOT, stdin=slave, stdout=slave, stderr=slave,
            env={**os.environ, "TERM": "dumb", "XDG_STATE_HOME": os.environ["HOME"] + "/state"},
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )
        os.close(slave)
        os.set_blocking(master, False)
        return cls(proc, master)

    async def expect(self, text: str) -> str:
        """Read until ``text`` appears after what earlier calls matched; the output up to it."""
        wanted = text.encode()
        loop = asyncio.get_running_loop()
        while (at := self.seen.find(wanted, self._unread)) < 0:
            ready = loop.create_future()
            loop.add_reader(self.master, lambda: ready.done() or ready.set_result(None))
            try:
                await asyncio.wait_for(ready, WAIT)
            except asyncio.TimeoutError:
                raise AssertionError(f"{text!r} never came; the terminal showed {self.seen.decode()!r}") from None
            finally:
                loop.remove_reader(self.master)
            try:
                read = os.read(self.master, 65536)
                self.raw += read
                self.seen += ANSI.sub(b"", read).replace(b"\r", b"")
            except OSError:  # EIO: the child closed the terminal
                raise AssertionError(f"{text!r} never came; the terminal showed {self.seen.decode()!r}") from None
        start, self._unread = self._unread, at + len(wanted)
        return self.seen[start:self._unread].decode(errors="replace")

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    async def reading_keys(self) -> None:
        """Wait until the chat sleeps in the line editor's wait for a key (/proc/PID/syscall).

        CPython's readline checks for signals only when that wait is interrupted: a Ctrl-C
        landing while it handles the keys before is noticed at the next key, so a test that
        types Ctrl-C after text must wait for this first (the echo alone comes too early).
        """
        waits = {"7", "23", "270", "271"}  # poll, select, pselect6, ppoll on x86_64
        async with asyncio.timeout(WAIT):
            while True:
                with open(f"/proc/{self.proc.pid}/syscall") as current:
                    if current.read().split(" ", 1)[0] in waits:
                        return
                await asyncio.sleep(0.005)

    async def say(self, line: str, reply: str) -> str:
        """Type a line, see ``reply``, and return what came up to the next prompt."""
        self.type(line + "\n")
        await self.expect(reply)
        return await self.expect("> ")

    async def exit_code(self) -> int:
        code = await asyncio.wait_for(asyncio.to_thread(self.proc.wait), WAIT)
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


@pytest_asyncio.fixture
async def term(daemon: RunningDaemon) -> AsyncIterator[list[Terminal]]:
    spawned: list[Terminal] = []
    yield spawned
    for terminal in spawned:
        terminal.close()


async def test_a_conversation_typed_at_the_prompt(
    term: list[Terminal], router: FakeRouter, monkeypatch: pytest.MonkeyPatch, daemon: RunningDaemon
) -> None:
    # in the C locale a byte that is not UTF-8 reaches the chat as a surrogate (readline under
    # UTF-8 drops it)
    monkeypatch.setenv("LC_ALL", "C")
    chat = Terminal.spawn("chat")
    term.append(chat)
    await chat.expect("a new conversation")
    await chat.expect("> ")
    assert "(conversation 1, turn 1, context" in await chat.say("what is a pipe?", "You said: what is a pipe?")
    os.write(chat.master, b"caf\xe9 au lait\n")  # a line in Latin-1: said so, and the chat stays
    await chat.expect("that line is not UTF-8 text, so it was not sent; type it again")
    await chat.expect("> ")
    assert "(conversation 1, turn 2, context" in await chat.say("and a socket?", "You said: and a socket?")
    chat.type("exit\n")
    assert await chat.exit_code() == 0
    assert [m["content"] for m in router.requests[-1]["messages"] if m["role"] == "user"] == [
        "what is a pipe?", "and a socket?",
    ]
    # each ask carries a ref of its own, by which a lost connection finds its turn (issue 46)
    wire = await daemon.connect()
    refs = [t["ref"] for t in (await wire.request({"type": "open", "conversation": 1}))["turns"]]
    assert len(set(refs)) == 2 and all(ref.startswith("cli-") for ref in refs)
    assert (await wire.request({"type": "open", "ref": refs[1]}))["turns"][0]["text"] == "and a socket?"
    await wire.close()


async def test_ctrl_c_stops_the_reply_and_comes_back_to_the_prompt(term: list[Terminal], router: FakeRouter) -> None:
    router.script(Reply(chunks=["a long story begins"], hang=True))
    chat = Terminal.spawn("chat")
    term.append(chat)
    await chat.expect("> ")
    chat.type("tell me a story\n")
    await chat.expect("a long story begins")
    chat.type("\x03")  # Ctrl-C
    await chat.expect("[cancelled; the partial reply is kept]")
    await chat.expect("> ")
    assert chat.proc.poll() is None  # still there
    await chat.say("go on", "You said: go on")
    chat.type("\x04")  # Ctrl-D leaves
    assert await chat.exit_code() == 0
    _, opened, _ = await cli("open", "1")
    assert "[1] assistant: a long story begins  [cancelled]" in opened
    assert "[2] you: go on" in opened


async def test_ctrl_c_at_the_prompt_clears_the_line(term: list[Terminal], router: FakeRouter) -> None:
    chat = Terminal.spawn("chat")
    term.append(chat)
    await chat.expect("> ")
    chat.type("half a thought")
    await chat.expect("half a thought")  # echoed: the line editor has it
    await chat.reading_keys()  # and waits for more
    chat.type("\x03")
    await chat.expect("> ")
    await chat.say("a whole one", "You said: a whole one")
    chat.type("quit\n")
    assert await chat.exit_code() == 0
    assert [r["messages"][-1]["content"] for r in router.requests] == ["a whole one"]


async def test_several_lines_and_files(term: list[Terminal], router: FakeRouter, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("the notes say forty-two\n")
    chat = Terminal.spawn("chat")
    term.append(chat)
    await chat.expect("> ")
    await chat.say('"""\nfirst line\nsecond line\n"""', "You said: first line\nsecond line")
    await chat.say("one \\\ntwo", "You said: one \ntwo")
    chat.type(f"/file {tmp_path / 'notes.txt'}\n")
    await chat.expect("files for the next question: notes.txt")
    chat.type("/file /no/such/file\n")
    await chat.expect("no such file: /no/such/file")
    chat.type("what do they say?\n")
    await chat.expect("(conversation 1, turn 3,")
    sent = router.requests[-1]["messages"][-1]["content"]
    assert sent[0]["text"].startswith("what do they say?") and "the notes say forty-two" in sent[0]["text"]
    chat.type("/nonsense\n")
    await chat.expect("unknown command /nonsense")
    chat.type("exit\n")
    assert await chat.exit_code() == 0


async def test_continue_the_latest_conversation_with_a_system_prompt(term: list[Terminal], router: FakeRouter) -> None:
    await cli("ask", "an earlier question")
    chat = Terminal.spawn("chat", "-c", "-s", "Be terse.")
    term.append(chat)
    await chat.expect("chat: conversation 1")
    await chat.expect("> ")
    assert "(conversation 1, turn 2," in await chat.say("more", "You said: more")
    assert router.requests[-1]["messages"][0] == {"role": "system", "content": f"Be terse.\n\n{TOOL_GUIDANCE}"}
    chat.type("exit\n")
    assert await chat.exit_code() == 0


async def test_line_editing_and_a_history_kept_between_sessions(term: list[Terminal], router: FakeRouter) -> None:
    chat = Terminal.spawn("chat")
    term.append(chat)
    await chat.expect("> ")
    await chat.say("remember me", "You said: remember me")
    chat.type("exit\n")
    assert await chat.exit_code() == 0
    history = Path(os.environ["HOME"]) / "state" / "assistant" / "chat_history"
    assert "remember me" in history.read_text()
    again = Terminal.spawn("chat", "-c")
    term.append(again)
    await again.expect("> ")
    again.type("\x10\x10\n")  # Ctrl-P twice: back past "exit" to the question of the last session
    await again.expect("(conversation 1, turn 2,")
    assert router.requests[-1]["messages"][-1]["content"] == "remember me"
    again.type("exit\n")
    assert await again.exit_code() == 0


async def test_progress_shows_on_a_terminal(term: list[Terminal], router: FakeRouter) -> None:
    ask = Terminal.spawn("ask", "anything")
    term.append(ask)
    await ask.expect("waiting: waiting for fake-text")
    await ask.expect("You said: anything")
    assert await ask.exit_code() == 0


async def test_piped_text_is_the_first_message(daemon: RunningDaemon, router: FakeRouter) -> None:
    # no terminal to read more from (a new session has none): the reply, then the end
    notes = piped("a page of notes\n")
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(ROOT / "assistant.py"), "chat", "summarise", cwd=ROOT, start_new_session=True,
            stdin=notes, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
    finally:
        os.close(notes)
    out, err = await asyncio.wait_for(proc.communicate(), WAIT)
    assert proc.returncode == 0, err.decode()
    assert router.requests[-1]["messages"][-1]["content"] == "a page of notes\n\nsummarise"
    assert out.decode() == "You said: a page of notes\n\nsummarise\n"


async def test_chat_without_a_terminal_or_a_question_is_a_usage_error(daemon: RunningDaemon, router: FakeRouter) -> None:
    code, _, err = await cli("chat")  # stdin is /dev/null, and no terminal to read from
    assert code == 2 and "chat reads from a terminal" in err
    assert router.requests == []


async def test_a_restart_of_the_daemon_between_questions_is_not_the_chats_end(
    term: list[Terminal], daemon: RunningDaemon, router: FakeRouter
) -> None:
    chat = Terminal.spawn("chat")
    term.append(chat)
    await chat.expect("> ")
    await chat.say("first question", "You said: first question")
    await daemon.stop()
    chat.type("second question\n")  # no daemon answers: the chat says so and waits for one
    await chat.expect("waiting for it to start again (Ctrl-C leaves)]")
    await daemon.start()  # systemctl --user restart assistant, or socket activation
    await chat.expect("[reconnected to the daemon]")
    await chat.expect("You said: second question")
    turns = (await (wire := await daemon.connect()).request({"type": "open", "conversation": 1}))["turns"]
    await wire.close()
    assert [t["text"] for t in turns] == ["first question", "second question"]  # asked once, in its conversation


async def test_a_chat_that_loses_the_daemon_mid_reply_follows_the_reply_again(
    term: list[Terminal], daemon: RunningDaemon, router: FakeRouter
) -> None:
    words = ["alpha", " bravo", " charlie", " delta", " echo", " foxtrot"]
    router.script(Reply(chunks=words, delay=0.2))
    chat = Terminal.spawn("chat")
    term.append(chat)
    await chat.expect("> ")
    chat.type("spell it\n")
    await chat.expect("alpha")
    assert daemon.server is not None
    for connection in list(daemon.server._connections):  # the chat's: lost, as in a network hiccup
        connection._writer.transport.abort()
    await chat.expect("[reconnected to the daemon]")
    rest = await chat.expect("(conversation 1, turn 1")
    await chat.expect("> ")
    # the rest of the reply, each word once: followed from where it was shown, not asked again
    assert "foxtrot" in rest
    assert [chat.seen.count(word.strip().encode()) for word in words] == [1] * len(words)
    chat.type("exit\n")
    assert await chat.exit_code() == 0
    assert len([r for r in router.requests if r["path"].endswith("/chat/completions")]) == 1


async def test_a_chat_that_loses_the_daemon_before_its_user_event_finds_its_turn_by_ref(
    term: list[Terminal], daemon: RunningDaemon, router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The question reached the daemon and was stored, but its ``user`` event was lost with the
    connection: the chat finds the turn by its ask's ref and follows it (issue 46), asking nothing twice."""
    words = ["alpha", " bravo", " charlie"]
    router.script(Reply(chunks=words, delay=0.2))
    real_user = daemon_events.user
    dropped: list[bool] = []

    def user_after_a_hiccup(*args: Any, **kwargs: Any) -> dict[str, Any]:
        assert daemon.server is not None
        if not dropped:  # the chat's connection is lost as its question is stored
            dropped.append(True)
            for connection in list(daemon.server._connections):
                connection._writer.transport.abort()
        return real_user(*args, **kwargs)

    monkeypatch.setattr(daemon_events, "user", user_after_a_hiccup)
    chat = Terminal.spawn("chat")
    term.append(chat)
    await chat.expect("> ")
    chat.type("spell it\n")
    await chat.expect("[reconnected to the daemon]")
    rest = await chat.expect("(conversation 1, turn 1")
    assert "charlie" in rest and dropped
    chat.type("exit\n")
    assert await chat.exit_code() == 0
    assert len([r for r in router.requests if r["path"].endswith("/chat/completions")]) == 1  # asked once


async def test_a_reply_that_ended_while_the_chat_was_away_is_shown_as_stored(
    term: list[Terminal], daemon: RunningDaemon, router: FakeRouter
) -> None:
    words = ["alpha", " bravo", " charlie", " delta"]
    router.script(Reply(chunks=words, delay=0.2))
    chat = Terminal.spawn("chat")
    term.append(chat)
    await chat.expect("> ")
    chat.type("spell it\n")
    await chat.expect("alpha")
    assert daemon.server is not None
    socket_path = daemon.config.socket_path
    aside = socket_path.with_name("aside.sock")
    socket_path.rename(aside)  # the chat cannot connect again until the reply has ended
    for connection in list(daemon.server._connections):
        connection._writer.transport.abort()
    wire = await Wire.open(aside, timeout=30.0)
    follow = await wire.send({"type": "follow", "conversation": 1})
    if (await wire.until(follow, ("following",)))[-1]["turn"] is not None:
        assert (await wire.until(follow))[-1]["type"] == "done"  # it ends while the chat is away
    await wire.close()
    aside.rename(socket_path)
    await chat.expect("[reconnected to the daemon]")
    rest = await chat.expect("(conversation 1, turn 1)")
    assert "delta" in rest
    assert [chat.seen.count(word.strip().encode()) for word in words] == [1] * len(words)
    chat.type("exit\n")
    assert await chat.exit_code() == 0


async def test_a_paste_of_several_lines_is_one_question_and_a_reply_is_shown_not_obeyed(
    term: list[Terminal], router: FakeRouter
) -> None:
    router.script(Reply(text="red \x1b[31malert"))
    chat = Terminal.spawn("chat")
    term.append(chat)
    await chat.expect("> ")
    assert b"\x1b[?2004h" in chat.raw  # the terminal is asked to mark a paste (CPython turns it off)
    chat.type("\x1b[200~first line\nsecond line\nthird line\x1b[201~\n")  # as a terminal sends a paste
    await chat.expect("red \\x1b[31malert")  # on a terminal, the reply's escapes are shown
    await chat.expect("(conversation 1, turn 1,")
    await chat.expect("> ")
    await chat.say("after", "You said: after")
    assert [r["messages"][-1]["content"] for r in router.requests] == ["first line\nsecond line\nthird line", "after"]
    chat.type("exit\n")
    assert await chat.exit_code() == 0


async def test_the_chat_commands(
    term: list[Terminal], router: FakeRouter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "notes.txt").write_text("forty-two\n")
    monkeypatch.setenv("EDITOR", "sed -i s/second/edited/")
    chat = Terminal.spawn("chat", "-o", "temperature", "0.1")
    term.append(chat)
    await chat.expect("> ")
    await chat.say('"""\nfirst\nsecond\n"""', "You said: first\nsecond")
    chat.type("\x10\n")  # Ctrl-P: the block comes back as one entry, asked again as it was
    await chat.expect("(conversation 1, turn 2,")
    assert router.requests[-1]["messages"][-1]["content"] == "first\nsecond"
    assert router.requests[-1]["temperature"] == 0.1  # -o: for each question of the chat
    await chat.say("/retry", "(conversation 1, turn 3,")
    await chat.say("/edit", "You said: first\nedited")
    await chat.say("//etc/hosts?", "You said: /etc/hosts?")
    chat.type(f"/file {tmp_path}/no\t\n")  # Tab completes the path
    await chat.expect("files for the next question: notes.txt")
    await chat.say("/model fake-vision", "model: fake-vision")
    await chat.say("with the file", "(conversation 1, turn 6,")
    assert router.requests[-1]["model"] == "fake-vision" and "forty-two" in str(router.requests[-1]["messages"][-1])
    await chat.say(f"/save {tmp_path}/chat.md", "saved conversation 1 (6 turns)")
    saved = (tmp_path / "chat.md").read_text()
    assert saved.startswith("# ") and "## You\n\nfirst\nedited\n" in saved and "- file: notes.txt" in saved
    await chat.say("/new", "a new conversation starts with the next question")
    await chat.say("/system Be brief.", "system prompt: 'Be brief.'")
    await chat.say("hello", "(conversation 2, turn 1,")
    assert router.requests[-1]["messages"][0]["content"].startswith("Be brief.")
    await chat.say("/help", "/save FILE")
    chat.type("exit\n")
    assert await chat.exit_code() == 0


async def test_remember_saves_a_memory_and_an_incognito_chat_reads_none(
    term: list[Terminal], router: FakeRouter
) -> None:
    chat = Terminal.spawn("chat", "--incognito")
    term.append(chat)
    await chat.expect("> ")
    chat.type("/remember I am vegetarian\n")
    await chat.expect("remembered: I am vegetarian (memory 1)")
    await chat.expect("> ")
    await chat.say("what shall I cook?", "You said: what shall I cook?")
    assert "vegetarian" not in json.dumps(router.requests[-1]["messages"][0])  # incognito: none read
    chat.type("exit\n")
    assert await chat.exit_code() == 0
    code, out, _ = await cli("memory", "list")
    assert code == 0 and "I am vegetarian" in out
    code, _, _ = await cli("ask", "and now?")
    assert "I am vegetarian" in router.requests[-1]["messages"][0]["content"]  # a conversation that reads them
