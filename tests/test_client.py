"""The command-line client, run as a real process against the real daemon."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core import Config
from selfcheck.fakerouter import FakeRouter, Reply
from tests.conftest import RunningDaemon

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def bare_python() -> tuple[str, ...]:
    """A Python without the venv, as a checkout's user runs the client: the system's ``python3``
    (this venv's own interpreter where that is older than 3.11). ``-S``: no site-packages at all,
    so the standard library and the checkout are all it can import (``-I`` would hide the
    checkout too: it implies ``-P``); ``-E``: no ``PYTHON*`` variables; ``-B``: no bytecode
    written into the checkout."""
    flags = ("-S", "-E", "-B")
    system = shutil.which("python3", path="/usr/bin:/bin")
    if system is not None:
        new_enough = [system, "-c", "import sys; sys.exit(sys.version_info < (3, 11))"]
        if subprocess.run(new_enough, capture_output=True, timeout=60).returncode == 0:
            return (system, *flags)
    return (getattr(sys, "_base_executable", sys.executable), *flags)


def piped(text: str) -> int:
    """The read end of a pipe holding ``text``, as a shell's ``|`` gives a command (the loop's
    own subprocess pipes may be socketpairs, uvloop's are; test_cli.py tries those)."""
    data = text.encode()
    assert len(data) < 65536, "more than a pipe holds unread"
    read_end, write_end = os.pipe()
    os.write(write_end, data)
    os.close(write_end)
    return read_end


async def cli(
    *args: str, env: dict[str, str] | None = None, stdin: str | None = None, python: tuple[str, ...] = (sys.executable,)
) -> tuple[int, str, str]:
    """Run the client; ``stdin`` is piped to it (else it reads /dev/null, which it never waits on)."""
    source = piped(stdin) if stdin is not None else asyncio.subprocess.DEVNULL
    try:
        proc = await asyncio.create_subprocess_exec(
            *python, str(ROOT / "assistant.py"), *args,
            cwd=ROOT, env={**os.environ, **(env or {})},
            stdin=source, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
    finally:
        if stdin is not None:
            os.close(source)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_ask_streams_the_reply(daemon: RunningDaemon, router: FakeRouter) -> None:
    router.script(Reply(chunks=["Paris ", "is the capital."]))
    code, out, err = await cli("ask", "capital", "of", "France?")
    assert code == 0, err
    assert out.strip() == "Paris is the capital."
    assert "conversation 1, turn 1" in err
    assert router.requests[-1]["messages"][-1]["content"] == "capital of France?"


async def test_ask_continues_a_conversation(daemon: RunningDaemon, router: FakeRouter) -> None:
    await cli("ask", "first")
    code, out, err = await cli("ask", "--cid", "1", "second")
    assert code == 0, err
    assert "turn 2" in err
    code, out, err = await cli("ask", "--continue", "third")
    assert "conversation 1, turn 3" in err
    code, out, err = await cli("ask", "--new", "fresh")
    assert "conversation 2, turn 1" in err


async def test_the_client_runs_on_the_system_python_without_the_venv(
    daemon: RunningDaemon, router: FakeRouter
) -> None:
    """From a checkout, on a Python that has only its standard library: help, a question
    streamed, a listing, and the daemon gone."""
    python = bare_python()
    code, out, err = await cli("--help", python=python)
    assert code == 0 and "ask" in out and "kb" in out, err
    router.script(Reply(chunks=["Paris ", "is the capital."]))
    code, out, err = await cli("ask", "capital", "of", "France?", stdin="geography\n", python=python)
    assert code == 0, err
    assert out.strip() == "Paris is the capital." and "conversation 1, turn 1" in err
    code, out, err = await cli("conversations", "--json", python=python)
    assert code == 0, err
    assert [item["conversation"] for item in json.loads(out)["items"]] == [1]
    await daemon.stop()
    code, out, err = await cli("status", python=python)
    assert code == 3 and "no daemon answers" in err


async def test_ask_json_prints_every_event(daemon: RunningDaemon) -> None:
    code, out, _ = await cli("ask", "--json", "hi")
    events = [json.loads(line) for line in out.splitlines()]
    assert [e["type"] for e in events][0] == "user"
    assert events[-1]["type"] == "done"
    assert events[-1]["text"] == "You said: hi"


async def test_ask_error_exits_non_zero(daemon: RunningDaemon) -> None:
    code, out, err = await cli("ask", "--cid", "77", "hello?")
    assert code == 1
    assert "error (not_found) in conversation 77" in err


async def test_conversations_open_delete(daemon: RunningDaemon) -> None:
    await cli("ask", "what is a daemon")
    code, out, _ = await cli("conversations")
    assert code == 0
    assert "what is a daemon" in out and "1 turn " in out
    code, out, _ = await cli("open", "1")
    assert "you: what is a daemon" in out
    assert "assistant: You said: what is a daemon" in out
    code, out, _ = await cli("open", "1", "--json")
    assert json.loads(out)["turns"][0]["reply"] == "You said: what is a daemon"
    code, out, _ = await cli("delete", "1")
    assert code == 0 and "deleted conversation 1" in out
    code, out, err = await cli("open", "1")
    assert code == 1 and "not_found" in err


async def test_models_and_status(daemon: RunningDaemon, router: FakeRouter) -> None:
    code, out, _ = await cli("models")
    assert code == 0
    assert "* fake-text  ctx 4096  inputs text" in out
    assert "fake-vision" in out and "image" in out
    code, out, _ = await cli("status")
    assert code == 0
    assert f"router {router.url} (reachable)" in out
    code, out, _ = await cli("status", "--json")
    assert json.loads(out)["router_reachable"] is True


async def test_an_interrupted_turn_is_marked_in_open(daemon: RunningDaemon, router: FakeRouter) -> None:
    router.script(Reply(status=503, error="loading model"))
    await cli("ask", "too early")
    code, out, _ = await cli("open", "1")
    assert "[error: " in out and "loading model" in out


async def test_no_daemon_is_a_clear_message(tmp_path: Path) -> None:
    code, out, err = await cli("status", env={"ASSISTANT_SOCKET": str(tmp_path / "none.sock")})
    assert code == 3
    assert "no daemon answers" in err and "make run" in err


async def test_ask_with_files(daemon: RunningDaemon, router: FakeRouter, tmp_path: Path) -> None:
    from selfcheck.samples import make_pdf, make_png

    pdf = make_pdf(tmp_path / "a.pdf", ["alpha beta gamma"])
    png = make_png(tmp_path / "b.png")
    code, out, err = await cli("ask", "what are these", "-f", str(pdf), "-f", str(png), "-m", "fake-vision")
    assert code == 0, err
    sent = router.requests[-1]["messages"][-1]["content"]
    assert any("alpha beta gamma" in p.get("text", "") for p in sent)
    assert any(p["type"] == "image_url" for p in sent)
    code, out, _ = await cli("open", "1")
    assert "file: a.pdf (pdf)" in out and "file: b.png (image)" in out


async def test_ask_with_a_relative_file_path(daemon: RunningDaemon, router: FakeRouter, tmp_path: Path) -> None:
    (tmp_path / "rel.txt").write_text("relative content")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "assistant.py"), "ask", "read", "-f", "rel.txt",
        cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    _out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert "relative content" in router.requests[-1]["messages"][-1]["content"][0]["text"]


async def test_search_command(daemon: RunningDaemon) -> None:
    await cli("ask", "where do penguins live")
    code, out, _ = await cli("search", "penguins")
    assert code == 0
    assert "where do penguins live" in out and "[penguins]" in out.lower()
    code, out, err = await cli("search", "zebras")
    assert code == 1 and "nothing found for 'zebras'" in err  # as grep: stderr, exit status 1


async def test_the_client_needs_only_the_standard_library() -> None:
    # the canvas may call `assistant ask` with the system Python, which has no httpx or Pillow
    code = "import sys, assistant; heavy = {'httpx', 'PIL', 'pypdf', 'numpy'} & set(sys.modules); print(sorted(heavy))"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    assert out.decode().strip() == "[]"


async def test_ask_stats_shows_what_the_server_read_and_reused(daemon: RunningDaemon, router: FakeRouter) -> None:
    await cli("ask", "first question")
    code, _out, err = await cli("ask", "--continue", "--stats", "second question")
    assert code == 0, err
    timings = router.timings[-1]
    assert timings is not None and timings["cache_n"] > 0
    assert f"prompt: {timings['prompt_n']} tokens read, {timings['cache_n']} reused from the server's cache" in err
    assert "reply: 50.0 tokens/s" in err
    code, _out, err = await cli("ask", "third question")
    assert "tokens read" not in err  # only when asked for


async def test_ask_stats_says_when_the_server_reports_none(config: Config) -> None:
    with FakeRouter(mode="ollama") as ollama:  # Ollama sends no timings
        running = RunningDaemon(dataclasses.replace(config, router_url=ollama.url))
        await running.start()
        try:
            code, _out, err = await cli("ask", "--stats", "a question")
        finally:
            await running.stop()
    assert code == 0, err
    assert "(the model server reported no timings)" in err


async def test_a_reply_into_a_pipe_is_the_models_bytes_and_other_text_is_shown(
    daemon: RunningDaemon, router: FakeRouter
) -> None:
    """Into a file or a pipe the reply goes out exactly (a terminal shows it escaped: test_chat.py);
    titles and the like are shown, never obeyed, wherever they go."""
    router.script(Reply(chunks=["red \x1b[31mtext\x1b[0m", " and a\rrewrite\x00\r\n"]))
    code, out, err = await cli("ask", "colour \x1b[2Jme")
    assert code == 0, err
    assert out == "red \x1b[31mtext\x1b[0m and a\rrewrite\x00\r\n"
    assert "\x1b" not in err
    code, out, _ = await cli("conversations")
    assert "\x1b" not in out and "colour \\x1b[2Jme" in out  # the title, as the question made it
