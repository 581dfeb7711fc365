"""The command line as people use it, as a real process against the real daemon: pipes,
llm's flags, exit statuses, ``| head``, settings and estimate, kb add, Ctrl-C.

(The chat mode, under a pseudo-terminal, is in test_chat.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from client.render import FOR_THE_COMMAND_LINE
from common import ADVICE, __version__
from core.tools import TOOL_GUIDANCE
from core import Config
from selfcheck.fakerouter import FakeRouter, Reply
from selfcheck.samples import make_png
from tests.conftest import RunningDaemon
from client import Wire
from client import commands as client_commands
from tests.test_client import ROOT, bare_python, cli

pytestmark = pytest.mark.asyncio

ASSISTANT = [sys.executable, str(ROOT / "assistant.py")]


def question_sent(router: FakeRouter) -> object:
    return router.requests[-1]["messages"][-1]["content"]


# -- stdin ----------------------------------------------------------------------------------


async def test_piped_text_comes_first_then_the_question(daemon: RunningDaemon, router: FakeRouter) -> None:
    code, out, err = await cli("ask", "summarise", stdin="some text\nover two lines\n")
    assert code == 0, err
    assert question_sent(router) == "some text\nover two lines\n\nsummarise"


async def test_ask_puts_a_ref_on_its_ask(daemon: RunningDaemon, router: FakeRouter) -> None:
    """Writing a client says the command line's asks carry a ref: they do (issue 46)."""
    code, _out, err = await cli("ask", "what is a pipe?")
    assert code == 0, err
    wire = await daemon.connect()
    (turn,) = (await wire.request({"type": "open", "conversation": 1}))["turns"]
    assert turn["ref"].startswith("cli-") and len(turn["ref"]) <= 128
    await wire.close()


async def test_a_question_may_be_stdin_alone(daemon: RunningDaemon, router: FakeRouter) -> None:
    code, out, err = await cli("ask", stdin="# Notes\n\nwhat do they say?\n")
    assert code == 0, err
    assert question_sent(router) == "# Notes\n\nwhat do they say?"
    assert out.strip() == "You said: # Notes\n\nwhat do they say?"


async def test_a_reply_cut_short_by_another_client_is_not_a_success(daemon: RunningDaemon, router: FakeRouter) -> None:
    router.script(Reply(chunks=["partial words"], hang=True))
    proc = await asyncio.create_subprocess_exec(
        *ASSISTANT, "ask", "tell me", cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert await asyncio.wait_for(proc.stdout.readexactly(13), 60) == b"partial words"
    other = await daemon.connect()
    await other.request({"type": "cancel", "conversation": 1})
    await other.close()
    _out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1 and "[stopped by another client: cancelled (the partial reply is kept)" in err.decode()


async def test_a_reply_the_locale_cannot_show_is_shown_as_it_can(daemon: RunningDaemon, router: FakeRouter) -> None:
    router.script(Reply(text="café ☕ done"))
    proc = await asyncio.create_subprocess_exec(
        *ASSISTANT, "ask", "coffee?", cwd=ROOT, env={**os.environ, "PYTHONIOENCODING": "latin-1"},
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err
    assert out.decode("latin-1").strip() == "café ? done" and b"Traceback" not in err


@pytest.mark.parametrize("args", [("conversations", "-n", "0"), ("search", "x", "-n", "501"), ("kb", "search", "k", "x", "-n", "many")])
async def test_a_limit_the_daemon_would_refuse_is_a_usage_error(args: tuple[str, ...]) -> None:
    code, _out, err = await cli(*args, env={"ASSISTANT_SOCKET": "/nonexistent/a.sock"})  # no daemon needed
    assert code == 2 and "-n/--limit" in err


async def test_a_question_over_the_line_limit_is_a_usage_error(
    daemon: RunningDaemon, router: FakeRouter, tmp_path: Path
) -> None:
    big = tmp_path / "big.txt"
    big.write_text("a" * (1 << 20))  # redirected in: the daemon reads 1 MiB a line
    with big.open("rb") as text:
        proc = await asyncio.create_subprocess_exec(
            *ASSISTANT, "ask", "summarise", cwd=ROOT, stdin=text, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        _out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert "over the 1,048,576 the daemon reads; send long text as a file (ask -f FILE)" in err.decode()
    assert router.requests == []  # nothing was sent


async def test_stdin_that_never_ends_is_refused_at_the_limit() -> None:
    """A gigabyte piped in was read whole before it was refused (3 GB of memory): the client
    stops at the limit, so even a pipe that never ends gets its answer."""
    read_end, write_end = os.pipe()

    def endless() -> None:
        chunk = b"y" * 65536
        with contextlib.suppress(OSError), os.fdopen(write_end, "wb") as pipe:
            while True:
                pipe.write(chunk)

    writer = threading.Thread(target=endless, daemon=True)
    writer.start()
    try:
        proc = await asyncio.create_subprocess_exec(
            *ASSISTANT, "ask", "summarise", cwd=ROOT, stdin=read_end, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
    finally:
        os.close(read_end)  # the client holds its own copy; when it exits, the writer's pipe breaks
    _out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert "stdin holds more than the 1,048,576 bytes a question may have" in err.decode()
    await asyncio.to_thread(writer.join, 30)
    assert not writer.is_alive()


async def test_a_file_name_that_is_not_utf8_is_a_usage_error(daemon: RunningDaemon, tmp_path: Path) -> None:
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/caf\xe9.txt")  # as the shell passes such a name
    code, _out, err = await cli("ask", "hi", "-f", odd)
    assert code == 2 and "not UTF-8 text" in err and "Traceback" not in err


async def run_with_socket_stdin(*args: str, text: bytes | None) -> tuple[int, str, str]:
    """The client with one end of a socketpair for stdin, as Node's child_process gives it:
    ``text`` written and the socket closed, or (None) the socket left open and silent."""
    parent, child = socket_pair()
    try:
        proc = await asyncio.create_subprocess_exec(
            *ASSISTANT, *args, cwd=ROOT, stdin=child.fileno(),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        child.close()
        if text is not None:
            parent.sendall(text)
            parent.close()
        out, err = await asyncio.wait_for(proc.communicate(), 60)  # only a hang's guard
    finally:
        parent.close()
        child.close()
    return proc.returncode or 0, out.decode(), err.decode()


def socket_pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


async def test_text_piped_through_a_socket_is_read(daemon: RunningDaemon, router: FakeRouter) -> None:
    code, _out, err = await run_with_socket_stdin("ask", "summarise", text=b"some text\n")
    assert code == 0, err
    assert question_sent(router) == "some text\n\nsummarise"


async def test_a_silent_socket_on_stdin_is_not_waited_on(daemon: RunningDaemon, router: FakeRouter) -> None:
    # Node's exec makes a stdin socket and never closes it: the client goes on without it
    code, out, err = await run_with_socket_stdin("ask", "hello", text=None)
    assert code == 0, err
    assert question_sent(router) == "hello" and out.strip() == "You said: hello"


async def test_files_without_a_question(daemon: RunningDaemon, router: FakeRouter, tmp_path: Path) -> None:
    (tmp_path / "tool.py").write_text("print('hello')\n")
    code, out, err = await cli("ask", "-f", str(tmp_path / "tool.py"))
    assert code == 0, err
    [part] = question_sent(router)  # type: ignore[misc]
    assert "print('hello')" in part["text"]


# -- llm's flags ----------------------------------------------------------------------------


async def test_continue_is_the_latest_conversation_and_cid_names_one(daemon: RunningDaemon) -> None:
    await cli("ask", "first")
    await cli("ask", "second, a new conversation")
    code, _, err = await cli("ask", "-c", "third")
    assert code == 0 and "(conversation 2, turn 2," in err
    code, _, err = await cli("ask", "--cid", "1", "fourth")
    assert code == 0 and "(conversation 1, turn 2," in err
    code, _, err = await cli("ask", "--continue", "fifth")
    assert "(conversation 1, turn 3," in err  # conversation 1 is now the latest


async def test_model_and_system_prompt(daemon: RunningDaemon, router: FakeRouter) -> None:
    code, _, err = await cli("ask", "-m", "fake-vision", "-s", "Answer in French.", "hello")
    assert code == 0, err
    assert router.requests[-1]["model"] == "fake-vision"
    assert router.requests[-1]["messages"][0] == {"role": "system", "content": f"Answer in French.\n\n{TOOL_GUIDANCE}"}
    code, _, err = await cli("ask", "-c", "-s", "Answer in German.", "again")
    assert code == 0, err
    assert router.requests[-1]["messages"][0] == {"role": "system", "content": f"Answer in German.\n\n{TOOL_GUIDANCE}"}
    code, out, _ = await cli("settings", "1")
    assert "system prompt: 'Answer in German.'" in out and "model: fake-vision" in out


async def test_no_stream_prints_the_whole_reply_once(daemon: RunningDaemon, router: FakeRouter) -> None:
    router.script(Reply(chunks=["one ", "two ", "three"]))
    code, out, err = await cli("ask", "--no-stream", "count")
    assert code == 0, err
    assert out == "one two three\n"


async def test_version_and_global_options_on_either_side(daemon: RunningDaemon, config: Config) -> None:
    code, out, _ = await cli("--version")
    assert code == 0 and out.strip() == f"assistant {__version__}"
    elsewhere = {"ASSISTANT_SOCKET": "/nonexistent/a.sock"}  # only --socket can find the daemon
    for args in (("--socket", str(config.socket_path), "status"), ("status", "--socket", str(config.socket_path)),
                 ("--json", "--socket", str(config.socket_path), "models")):
        code, out, err = await cli(*args, env=elsewhere)
        assert code == 0, (args, err)
    assert out.startswith('{"type": "models"')
    code, out, _ = await cli("models")
    assert code == 0 and out.splitlines() == [
        "* fake-text  ctx 4096  inputs text", "  fake-vision  ctx 8192  inputs text, image (an image counts 765)"]


# -- exit statuses and manners --------------------------------------------------------------


async def test_exit_statuses(daemon: RunningDaemon, config: Config, tmp_path: Path) -> None:
    assert (await cli("ask", "fine"))[0] == 0
    code, _, err = await cli("open", "99")
    assert code == 1 and "error (not_found)" in err
    code, _, err = await cli("ask", "--cid", "99", "hello?")  # no such conversation: its turn is null, not shown
    assert code == 1 and err.startswith("assistant: error (not_found) in conversation 99: conversation 99 does not")
    code, _, err = await cli("ask")
    assert code == 2 and "ask needs a question" in err
    code, _, err = await cli("ask", "--no-such-flag", "x")
    assert code == 2 and "usage:" in err
    code, _, err = await cli("status", env={"ASSISTANT_SOCKET": str(tmp_path / "gone.sock")})
    assert code == 3 and "no daemon answers" in err
    code, _, err = await cli("status", env={"ASSISTANT_SOCKET": "/etc/passwd/a.sock"})
    assert code == 3 and err.strip() == (
        "assistant: cannot reach a daemon at /etc/passwd/a.sock (Not a directory); check ASSISTANT_SOCKET"
    )
    long = "/tmp/" + "d" * 120 + "/a.sock"
    code, _, err = await cli("status", env={"ASSISTANT_SOCKET": long})
    assert code == 3 and "Traceback" not in err
    assert err.strip() == (f"assistant: the socket path {long} is 132 bytes, over the 107 a Unix socket allows; "
                           "set ASSISTANT_SOCKET to a shorter path")


async def test_an_unknown_variable_is_named_with_the_closest_one(daemon: RunningDaemon) -> None:
    code, _, err = await cli("status", env={"ASSISTANT_SOCKETT": "/tmp/x.sock"})
    assert code == 0
    assert "warning: ASSISTANT_SOCKETT is not a setting and is ignored; did you mean ASSISTANT_SOCKET?" in err


async def test_an_error_mid_reply_is_on_its_own_line_with_the_conversation(
    daemon: RunningDaemon, router: FakeRouter
) -> None:
    router.script(Reply(chunks=["half a ", "reply"], error="the model crashed"))
    code, out, err = await cli("ask", "go")
    assert code == 1
    assert out == "half a reply\n"
    [line] = [ln for ln in err.splitlines() if "error" in ln]
    assert line.startswith("assistant: error (router_error) in conversation 1, turn 1: ")
    assert "the model crashed" in line


async def test_stdout_and_stderr_into_one_file_keep_their_lines(
    daemon: RunningDaemon, router: FakeRouter, tmp_path: Path
) -> None:
    router.script(Reply(chunks=["no newline at the end"], error="cut"))
    log = tmp_path / "log"
    with log.open("w") as both:
        proc = await asyncio.create_subprocess_exec(*ASSISTANT, "ask", "x", stdin=subprocess.DEVNULL,
                                                    stdout=both, stderr=both, cwd=ROOT)
        assert await proc.wait() == 1
    lines = log.read_text().splitlines()
    assert lines[0] == "no newline at the end"
    assert lines[1].startswith("assistant: error (router_error) in conversation 1, turn 1:")


async def run_into_closed_pipe(*args: str) -> tuple[int, str]:
    """Run the client with stdout a pipe whose reader is already gone (what ``| head`` leaves)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = await asyncio.create_subprocess_exec(*ASSISTANT, *args, stdin=subprocess.DEVNULL, stdout=write,
                                                    stderr=asyncio.subprocess.PIPE, cwd=ROOT)
    finally:
        os.close(write)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, err.decode()


async def test_a_reader_that_leaves_ends_the_client_quietly(daemon: RunningDaemon, router: FakeRouter) -> None:
    await cli("ask", "something to list")
    for args in (("conversations",), ("open", "1"), ("ask", "a question"), ("models", "--json")):
        code, err = await run_into_closed_pipe(*args)
        assert code == 0, (args, err)
        assert "Traceback" not in err and "BrokenPipe" not in err, args


async def test_head_takes_the_start_of_a_long_reply(daemon: RunningDaemon, router: FakeRouter) -> None:
    router.script(Reply(chunks=[f"line {i}\n" for i in range(20000)]))
    script = f"set -o pipefail; {sys.executable} assistant.py ask long </dev/null | head -c 50"
    proc = await asyncio.create_subprocess_exec("bash", "-c", script, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert out.decode() == "".join(f"line {i}\n" for i in range(20000))[:50]
    assert b"Traceback" not in err


async def test_ctrl_c_cancels_the_turn_and_keeps_the_partial_reply(daemon: RunningDaemon, router: FakeRouter) -> None:
    router.script(Reply(chunks=["the start of it"], hang=True))
    proc = await asyncio.create_subprocess_exec(*ASSISTANT, "ask", "tell me", stdin=subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                cwd=ROOT)
    assert proc.stdout is not None
    assert await asyncio.wait_for(proc.stdout.read(15), 30) == b"the start of it"
    proc.send_signal(signal.SIGINT)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 130
    assert "[cancelled; the partial reply is kept]" in err.decode() and "Traceback" not in err.decode()
    code, opened, _ = await cli("open", "1")
    assert "assistant: the start of it  [cancelled]" in opened


async def test_json_lines_stay_json_with_control_characters(daemon: RunningDaemon, router: FakeRouter) -> None:
    router.script(Reply(chunks=["esc \x1b[31m, del \x7f, csi \x9b"]))
    code, out, err = await cli("ask", "--json", "colour")
    assert code == 0, err
    assert "\x1b" not in out and "\x7f" not in out and "\x9b" not in out
    events = [json.loads(line) for line in out.splitlines()]
    assert events[-1]["text"] == "esc \x1b[31m, del \x7f, csi \x9b"


# -- settings and estimate ------------------------------------------------------------------


async def test_settings_command(daemon: RunningDaemon, router: FakeRouter) -> None:
    await cli("ask", "hello")
    code, out, err = await cli("settings", "1", "--title", "Greetings", "-m", "fake-vision", "--kb", "off",
                               "--recall", "tool_only", "-s", "Be brief.")
    assert code == 0, err
    assert out.splitlines() == [
        "conversation 1: Greetings", "  model: fake-vision", "  system prompt: 'Be brief.'", "  kb_injection: off",
        "  recall_injection: tool_only", "  temperature: the default", "  top_p: the default",
        "  tools approved for this conversation: none",
    ]
    code, out, _ = await cli("settings", "1", "--default-model", "--default-system")
    assert "  model: the default" in out and "  system prompt: the default" in out
    code, _, err = await cli("settings", "1", "-m", "no-such-model")
    assert code == 1 and "error (not_found)" in err


async def test_estimate_command(daemon: RunningDaemon, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("word " * 400)
    code, out, err = await cli("estimate", "what", "is", "this?", "-f", str(tmp_path / "notes.txt"))
    assert code == 0, err
    first, second = out.splitlines()
    assert first.startswith("about ") and ", notes.txt (text) " in first
    # a new conversation's system message and tools are in its first prompt before the question
    used = re.match(r"context: (\d+) of 4096 used; with this question about ", second)
    assert used and int(used[1]) > 0, second
    code, out, _ = await cli("estimate", "--json", stdin="piped words")
    assert '"type": "estimate"' in out and '"tokens": 3' in out


# -- kb add -----------------------------------------------------------------------------------


async def test_kb_add_summarises_what_it_left_out_and_fails_when_nothing_was_added(
    daemon: RunningDaemon, tmp_path: Path
) -> None:
    folder = tmp_path / "pics"
    folder.mkdir()
    for i in range(5):
        (folder / f"p{i}.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    code, out, err = await cli("kb", "add", "pics", str(folder), str(tmp_path / "missing"))
    assert code == 1
    assert "skipped: 5 file(s): an image: knowledge bases index text and PDF only" in out
    assert "  ... and 2 more" in out
    assert "not added: 1 file(s): no such file or folder; check the path" in out
    assert "nothing was added" in err
    (folder / "note.md").write_text("# A note\n\ntext\n")
    code, out, err = await cli("kb", "add", "pics", str(folder))
    assert code == 0, err
    assert "pics: 1 documents" in out and "(1 added, 0 updated, 0 unchanged)" in out


async def test_kb_search_shows_the_passages_the_model_would_get(daemon: RunningDaemon, tmp_path: Path) -> None:
    (tmp_path / "bread.md").write_text("# Bread\n\nBread rises when the yeast is warm.\n")
    code, _, err = await cli("kb", "add", "baking", str(tmp_path / "bread.md"))
    assert code == 0, err
    code, out, err = await cli("kb", "search", "baking", "yeast", "warm", "-n", "3")
    assert code == 0, err
    assert "bread.md (passage 1 of 1, keywords" in out and "yeast is warm" in out
    code, out, err = await cli("kb", "search", "pastry", "yeast")
    assert code == 1 and "not_found" in err


async def embedding_asked(router: FakeRouter) -> None:
    while not router.embedding_requests:  # the reading phase is over: the add is embedding
        await asyncio.sleep(0.05)


@pytest_asyncio.fixture
async def embedding_daemon(config: Config) -> AsyncIterator[RunningDaemon]:
    running = RunningDaemon(dataclasses.replace(config, embedding_model="fake-embed"))
    await running.start()
    yield running
    await running.stop()


async def test_ctrl_c_stops_a_kb_add_in_the_daemon(
    embedding_daemon: RunningDaemon, router: FakeRouter, tmp_path: Path
) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(3):
        (folder / f"d{i}.txt").write_text(f"document number {i}\n")
    router.embed_delay = 60.0
    proc = await asyncio.create_subprocess_exec(*ASSISTANT, "kb", "add", "docs", str(folder),
                                                stdin=subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, cwd=ROOT)
    await asyncio.wait_for(embedding_asked(router), 30)
    proc.send_signal(signal.SIGINT)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 130, err.decode()
    text = out.decode()
    assert "docs: 3 documents" in text and "(3 added, 0 updated, 0 unchanged)" in text
    assert "cancelled: 0 file(s) left unread; the files added before are kept" in text
    assert "3 passage(s) not yet embedded: the next add embeds them" in text
    code, out2, _ = await cli("kb", "list")
    assert "docs  3 documents" in out2


# -- what a user is told ----------------------------------------------------------------------


async def test_a_file_cut_to_fit_is_said_in_ask_open_and_estimate(
    daemon: RunningDaemon, router: FakeRouter, tmp_path: Path
) -> None:
    log = tmp_path / "big.log"
    log.write_text("line of log text\n" * 5000)  # far over the 6,144 characters files may take here
    code, out, err = await cli("estimate", "what?", "-f", str(log))
    assert code == 0 and "big.log (text, cut to fit)" in out, (out, err)
    code, _, err = await cli("ask", "what failed?", "-f", str(log))
    assert code == 0 and "[big.log (text, cut to fit): only part of it fits the context" in err, err
    code, opened, _ = await cli("open", "1")
    assert "file: big.log (text, cut to fit)" in opened
    (tmp_path / "small.txt").write_text("short\n")
    code, _, err = await cli("ask", "and this?", "-f", str(tmp_path / "small.txt"))
    assert code == 0 and "cut to fit" not in err


async def test_cancel_stops_a_reply_whose_ask_was_left_behind(daemon: RunningDaemon, router: FakeRouter) -> None:
    router.script(Reply(chunks=["left ", "running"], hang=True))
    left = await daemon.connect()  # a terminal closed on its ask: nobody will press Ctrl-C
    rid = await left.send({"type": "ask", "text": "a long story"})
    await left.until_reply(rid, "left running")
    code, out, err = await cli("cancel", "1")
    assert code == 0 and out.strip() == "conversation 1: turn 1 stopped; its partial reply is kept", (out, err)
    code, out, _ = await cli("cancel", "1")
    assert code == 0 and out.strip() == "conversation 1: nothing was running"
    code, opened, _ = await cli("open", "1")
    assert "assistant: left running  [cancelled]" in opened
    code, _, err = await cli("cancel", "7")
    assert code == 1 and "not_found" in err
    await left.close()


async def test_refusals_name_this_clients_commands(daemon: RunningDaemon, router: FakeRouter, tmp_path: Path) -> None:
    code, _, err = await cli("open", "99")
    assert code == 1 and err.strip() == (
        "assistant: error (not_found): conversation 99 does not exist; list them with: assistant conversations")
    code, _, err = await cli("kb", "search", "nosuch", "x")
    assert code == 1 and "assistant kb list shows the ones there are" in err, err
    code, _, err = await cli("kb", "link", "nosuch", "--all")
    assert code == 1 and "assistant kb add creates one" in err, err
    code, _, err = await cli("ask", "what is it?", "-m", "fake-text", "-f", str(make_png(tmp_path / "cat.png")))
    assert code == 1 and "(assistant models lists them)" in err, err
    # and every piece of advice the daemon gives has this client's words
    assert {said for said, _ in FOR_THE_COMMAND_LINE} == set(ADVICE)


async def test_kb_link_says_what_it_linked(daemon: RunningDaemon, router: FakeRouter, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("apples are red\n")
    assert (await cli("kb", "add", "fruit", str(tmp_path / "a.txt")))[0] == 0
    code, _, err = await cli("kb", "link", "fruit")
    assert code == 2 and "no conversations to link yet" in err and "--all" in err
    await cli("ask", "hello")
    await cli("ask", "another")
    code, out, _ = await cli("kb", "link", "fruit")  # the latest, as open and cancel
    assert code == 0 and out.splitlines()[0] == "fruit: linked to conversation 2"
    code, out, _ = await cli("kb", "link", "fruit", "--all")
    assert code == 0 and out.splitlines()[0] == "fruit: linked to every conversation"
    code, out, _ = await cli("kb", "link", "fruit", "--cid", "1", "--unlink")
    assert code == 0 and out.splitlines()[0] == "fruit: unlinked from conversation 1"
    code, out, _ = await cli("conversations")
    assert "  1 turn " in out


async def test_the_status_line_obeys_no_control_character() -> None:
    """A status line is drawn raw (it needs its \\r): C1 controls (U+009B is CSI to a terminal
    that reads 8-bit controls) are blanked there as C0 ones are."""
    from client.terminal import Terminal

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    err = Tty()
    Terminal(io.StringIO(), err).status("tool: \x9b2J\x9d0;title\x07\x1b[31m wiped")
    assert not any(0x80 <= ord(c) < 0xA0 or ord(c) < 0x20 and c != "\r" for c in err.getvalue().replace("\r\x1b[K", ""))


async def test_doctor_checks_the_set_up_one_line_each(
    daemon: RunningDaemon, router: FakeRouter, config: Config, tmp_path: Path
) -> None:
    code, out, err = await cli("doctor")
    assert code == 0, out + err
    lines = {line[6:20].strip(): line for line in out.splitlines()}
    assert "FAIL" not in out and out.endswith("9 of 9 checks passed\n"), out
    assert lines["ffmpeg"].endswith("ffmpeg, ffprobe")
    assert lines["ocr"].endswith("tesseract reads eng")
    assert f"on {config.socket_path}" in lines["daemon"]
    assert f"{router.url}: fake-text (ctx 4096, tools yes); fake-vision (ctx 8192, vision)" in lines["router"]
    assert router.requests[-1]["tools"][0]["function"]["name"] == "ping" and router.requests[-1]["max_tokens"] == 1
    broken = tmp_path / "broken.toml"
    broken.write_text("kb_top_k = 'many'\n")
    code, out, _ = await cli("doctor", env={"ASSISTANT_CONFIG": str(broken), "ASSISTANT_SOCKET": "/nonexistent/a.sock"})
    assert code == 1 and "FAIL  configuration  " in out and "kb_top_k must be an int" in out
    assert "1 of 2 checks passed; fix the 1 above" in out  # nothing else can be checked without it


async def test_llms_habits_a_bare_prompt_options_extract_and_the_latest(daemon: RunningDaemon, router: FakeRouter) -> None:
    code, out, err = await cli("what is a socket")  # no command: a question
    assert code == 0 and out == "You said: what is a socket\n", err
    code, out, err = await cli(stdin="piped alone\n")  # no command, text piped in: a question, not a daemon
    assert code == 0 and question_sent(router) == "piped alone", err
    router.script(Reply(text="Here:\n\n```python\nprint('hi')\n```\n\nand more."))
    code, out, err = await cli("-c", "-o", "temperature", "0.2", "-x", "code please")
    assert code == 0, err
    assert out == "print('hi')\n" and "(conversation 2, turn 2," in err
    assert router.requests[-1]["temperature"] == 0.2
    code, _, err = await cli("ask", "-o", "heat", "1", "x")
    assert code == 2 and "-o heat: not a model option; the options are temperature, top_p" in err
    code, out, err = await cli("settings", "2", "--temperature", "0.5", "-o", "top_p", "0.9")
    assert code == 0 and "temperature: 0.5" in out and "top_p: 0.9" in out, err
    await cli("ask", "-c", "sampled?")
    assert (router.requests[-1]["temperature"], router.requests[-1]["top_p"]) == (0.5, 0.9)
    code, out, _ = await cli("open")  # the latest
    assert code == 0 and out.startswith("# ") and "(conversation 2," in out and "[3] you: sampled?" in out
    code, out, _ = await cli("cancel")
    assert code == 0 and out == "conversation 2: nothing was running\n"
    code, _, err = await cli("-q", "ask", "-m", "no-such-model", "hi")
    assert code == 1 and "in a new conversation, turn 1: " in err and "conversation new" not in err
    code, _, err = await cli("--quiet", "ask", "quietly")
    assert code == 0 and "context" not in err


async def test_without_the_venv_the_daemon_says_what_to_run(tmp_path: Path) -> None:
    for args in (("--test",), ("mcp", "serve"), ("serve",)):
        code, out, err = await cli(*args, python=bare_python(), env={"ASSISTANT_SOCKET": str(tmp_path / "a.sock")})
        assert code == 78 and "Traceback" not in err, (args, err)
        assert "has no" in err and "run `make setup` once, then use" in err and len(err.splitlines()) == 1, err


async def test_kb_and_search_output(daemon: RunningDaemon, router: FakeRouter, config: Config, tmp_path: Path) -> None:
    code, _, err = await cli("kb", "add", "ghost", str(tmp_path / "missing"))
    assert code == 1 and "nothing was added: no such file or folder; check the path" in err
    code, out, _ = await cli("kb", "list")
    assert "ghost" not in out  # a failed add leaves no empty knowledge base
    (tmp_path / "a.md").write_text("# Pipes\n\nA pipe joins two processes.\n")
    await cli("kb", "add", "docs", str(tmp_path / "a.md"))
    code, out, err = await cli("kb", "search", "docs", "zebra")
    assert code == 1 and out == "" and "nothing found in docs for 'zebra'" in err
    code, out, _ = await cli("kb", "remove", "docs")
    assert code == 0 and out.startswith("removed knowledge base docs: 1 documents")
    await cli("ask", "line one\nline two about pipes")
    code, out, err = await cli("search", "pipes")
    assert code == 0 and "line one line two about pipes" in out, err
    code, out, err = await cli("search", "zebra")
    assert code == 1 and out == "" and err == "nothing found for 'zebra'\n"


async def test_conversations_n_pages_past_the_daemons_limit(
    daemon: RunningDaemon, config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    wire = await daemon.connect()
    try:
        for n in range(5):
            await wire.ask(f"question {n}")
        monkeypatch.setattr(client_commands, "MAX_LIST_LIMIT", 2)  # pages of 2, as of 500 for the daemon
        listed = await client_commands._conversations(Wire(wire.reader, wire.writer, keep=False), 4)
    finally:
        await wire.close()
    assert [item["conversation"] for item in listed["items"]] == [5, 4, 3, 2]


async def test_tool_calls_are_told_on_stderr_without_a_terminal(daemon: RunningDaemon, router: FakeRouter) -> None:
    """A turn's facts (the tools it called) go to stderr whatever it is; only progress needs a terminal."""
    await cli("ask", "the first question")
    router.script(Reply(tool_calls=[{"id": "c1", "name": "conversation_search", "arguments": '{"query": "first"}'}]),
                  Reply(text="found it"))
    code, out, err = await cli("ask", "-c", "what did I ask first?")
    assert code == 0 and out == "found it\n"
    assert "[tool conversation_search: " in err, err
