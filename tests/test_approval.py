"""A person in the loop, through the real socket: a hand-written MCP server (``tests/mcpservers.py
raw acting``) with a tool that acts (``write_note``, which appends to a file the test reads) and a
read-only one (``read_notes``); the fake router scripts the model's calls to them."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from client import Wire, of_type
from selfcheck.fakerouter import FakeRouter, Reply
from tests.conftest import RunningDaemon
from tests.test_chat import Terminal as ChatTerminal
from tests.test_client import cli
from tests.test_mcp_host import SERVERS, call, hosted_config, tool_messages, write_config

pytestmark = pytest.mark.asyncio

WRITE = "notes__write_note"
READ = "notes__read_notes"


def notes_server(notes: Path) -> str:
    """The acting server, asking before ``write_note`` runs (the default ``approval``)."""
    return (f'command = {json.dumps(sys.executable)}\nargs = [{json.dumps(str(SERVERS))}, "raw", "acting"]\n'
            f"env = {{ MCP_TEST_NOTES = {json.dumps(str(notes))} }}\n")


@pytest.fixture
def notes(tmp_path: Path) -> Path:
    return tmp_path / "notes.txt"


@pytest_asyncio.fixture
async def start(tmp_path: Path, router: FakeRouter, notes: Path,
                monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    """A daemon hosting the acting server: ``await start(**settings)`` gives it and a connection to it."""
    running: list[RunningDaemon] = []
    wires: list[Wire] = []

    async def started(**settings: Any) -> tuple[RunningDaemon, Wire]:
        write_config(tmp_path, {"notes": notes_server(notes)})
        daemon = RunningDaemon(dataclasses.replace(hosted_config(router, monkeypatch), **settings))
        await daemon.start()
        running.append(daemon)
        wires.append(await daemon.connect())
        return daemon, wires[-1]

    yield started
    for wire in wires:
        await wire.close()
    for daemon in running:
        await daemon.stop()


def written(notes: Path) -> list[str]:
    return notes.read_text().splitlines() if notes.exists() else []


async def approval_of(wire: Wire, rid: Any) -> dict[str, Any]:
    """The ask's events up to its first ``approval``: that event."""
    return (await wire.until(rid, ("approval", "done", "error")))[-1]


async def change_of(wire: Wire, rid: Any, kind: str) -> dict[str, Any]:
    """The watch's first ``changed`` event of ``kind``."""
    async for event in wire.stream(rid):
        if event["type"] == "changed" and event["kind"] == kind:
            return event
    raise AssertionError("stream() ends only by raising")  # pragma: no cover


async def test_an_acting_call_runs_once_allowed_and_never_when_denied(
    start: Any, router: FakeRouter, notes: Path
) -> None:
    daemon, asker = await start()
    other = await daemon.connect()  # a second client of the same user: the canvas, say
    watching = await other.send({"type": "watch"})
    await other.until(watching, ("watching",))
    router.script(call(WRITE, {"text": "one"}), Reply(text="noted"))
    rid = await asker.send({"type": "ask", "text": "note one"})
    asked = await approval_of(asker, rid)
    assert {k: asked[k] for k in ("conversation", "turn", "call", "name", "server", "tool", "arguments")} == {
        "conversation": 1, "turn": 1, "call": "1.1", "name": WRITE, "server": "notes", "tool": "write_note",
        "arguments": {"text": "one"},
    }
    assert asked["annotations"] == {"destructiveHint": False}
    progress = [e["stage"] for e in of_type(asker.events, "progress") if e.get("id") == rid]
    assert progress[-1] == "approval" and written(notes) == []  # it waits, and nothing ran
    [running] = (await other.request({"type": "status"}))["running"]
    assert running["stage"] == "approval"
    following = await other.request({"type": "follow", "conversation": 1})  # joining late: the question too
    assert [(e["type"], e["call"], e["arguments"]) for e in following["approvals"]] == [
        ("approval", "1.1", {"text": "one"})]
    changed = await change_of(other, watching, "approval")
    assert changed["action"] == "asked" and changed["call"] == "1.1" and changed["arguments"] == {"text": "one"}

    answer = {"type": "approve", "conversation": 1, "call": "1.1", "allow": True}
    assert (await other.request(answer))["type"] == "approved"
    again = await asker.request(answer)  # once: a second answer is refused
    assert again["code"] == "not_pending" and "already answered (allowed)" in again["message"]
    events = await asker.until(rid)
    [tool] = of_type(events, "tool")
    assert tool["ok"] and tool["approval"]["allowed"] and tool["approval"]["by"] == "user"
    assert isinstance(tool["approval"]["client"], str)  # the program that answered
    assert events[-1]["type"] == "done" and written(notes) == ["one"]  # run once

    # denied: never runs; the model is told, and the turn goes on to an answer. The read-only
    # tool in the same round runs without asking
    router.script(Reply(tool_calls=[{"id": "a", "name": WRITE, "arguments": '{"text": "two"}'},
                                    {"id": "b", "name": READ, "arguments": "{}"}]), Reply(text="as you wish"))
    rid = await asker.send({"type": "ask", "text": "note two", "conversation": 1})
    asked = await approval_of(asker, rid)
    assert asked["name"] == WRITE and asked["call"] == "2.1"  # one question: the reader is not asked about
    await asker.request({"type": "approve", "conversation": 1, "call": "2.1", "allow": False})
    events = await asker.until(rid)
    denied, read = of_type(events, "tool")
    assert not denied["ok"] and denied["approval"]["by"] == "user" and not denied["approval"]["allowed"]
    assert read["ok"] and "approval" not in read and len(of_type(events, "approval")) == 1
    told = tool_messages(router.requests[-1])[-2:]  # this turn's, after the first turn's
    assert told[0]["content"].startswith("Error: the user declined this call. It did not run.")
    assert told[1]["content"] == "one\n"
    assert events[-1]["type"] == "done" and events[-1]["text"] == "as you wish" and written(notes) == ["one"]

    # the record stays with each turn; a finished turn, an unknown call, an unknown conversation
    turns = (await other.request({"type": "open", "conversation": 1}))["turns"]
    assert [(a["call"], a["allowed"], a["by"], a["arguments"]) for t in turns for a in t["approvals"]] == [
        ("1.1", True, "user", {"text": "one"}), ("2.1", False, "user", {"text": "two"}),
    ]
    late = await other.request({"type": "approve", "conversation": 1, "call": "2.1", "allow": True})
    assert late["code"] == "not_pending" and "no turn of conversation 1 is running" in late["message"]
    gone = await other.request({"type": "approve", "conversation": 9, "call": "1.1", "allow": True})
    assert gone["code"] == "not_found"
    await other.close()


async def test_remember_approves_the_tool_for_the_conversation_until_revoked(
    start: Any, router: FakeRouter, notes: Path
) -> None:
    _daemon, wire = await start()
    router.script(call(WRITE, {"text": "a"}), Reply(text="ok"))
    rid = await wire.send({"type": "ask", "text": "note a"})
    await approval_of(wire, rid)
    unknown = await wire.request({"type": "approve", "conversation": 1, "call": "9.9", "allow": True})
    assert unknown["code"] == "not_pending" and "waiting: 1.1" in unknown["message"]
    answered = await wire.request({"type": "approve", "conversation": 1, "call": "1.1", "allow": True,
                                   "remember": "conversation"})
    assert answered["remember"] == "conversation"
    await wire.until(rid)
    shown = await wire.request({"type": "settings", "conversation": 1})
    assert shown["settings"]["approved_tools"] == [WRITE]

    router.script(call(WRITE, {"text": "b"}), Reply(text="ok"))  # remembered: not asked again
    events = await wire.ask("note b", conversation=1)
    assert not of_type(events, "approval") and of_type(events, "tool")[0]["approval"]["by"] == "conversation"
    assert written(notes) == ["a", "b"]
    router.script(call(WRITE, {"text": "c"}), Reply(text="ok"))  # another conversation asks
    rid = await wire.send({"type": "ask", "text": "note c"})
    assert (await approval_of(wire, rid))["conversation"] == 2
    await wire.request({"type": "approve", "conversation": 2, "call": "1.1", "allow": False})
    await wire.until(rid)

    code, out, _err = await cli("settings", "1", "--revoke", WRITE)  # the command line's way
    assert code == 0 and "tools approved for this conversation: none" in out
    revoked = await wire.request({"type": "settings", "conversation": 1})
    assert "approved_tools" not in revoked["settings"]
    router.script(call(WRITE, {"text": "d"}), Reply(text="ok"))
    rid = await wire.send({"type": "ask", "text": "note d", "conversation": 1})
    assert (await approval_of(wire, rid))["call"] == "3.1"  # asked again
    await wire.request({"type": "approve", "conversation": 1, "call": "3.1", "allow": False})
    await wire.until(rid)
    assert written(notes) == ["a", "b"]


async def test_no_answer_in_time_denies(start: Any, router: FakeRouter, notes: Path) -> None:
    _daemon, wire = await start(approval_timeout=0.2)
    router.script(call(WRITE, {"text": "late"}), Reply(text="never mind"))
    events = await wire.ask("note it")
    [tool] = of_type(events, "tool")
    assert (tool["ok"], tool["approval"]["by"]) == (False, "timeout")
    assert "did not answer in time" in tool_messages(router.requests[-1])[0]["content"]
    assert events[-1]["text"] == "never mind" and written(notes) == []


async def test_an_asker_gone_a_cancel_and_a_stop_deny(start: Any, router: FakeRouter, notes: Path) -> None:
    daemon, asker = await start(shutdown_grace=30.0)
    # the asker shuts its writing side (it can read, not answer) with nobody watching: denied at once
    router.script(call(WRITE, {"text": "x"}), Reply(text="fine"))
    rid = await asker.send({"type": "ask", "text": "note x"})
    await approval_of(asker, rid)
    asker.writer.write_eof()
    events = await asker.until(rid)
    assert of_type(events, "tool")[0]["approval"]["by"] == "gone" and events[-1]["type"] == "done"
    await asker.close()

    # ... but not while a watcher could still answer
    asker, watcher = await daemon.connect(), await daemon.connect()
    await watcher.until(await watcher.send({"type": "watch"}), ("watching",))
    router.script(call(WRITE, {"text": "y"}), Reply(text="fine"))
    rid = await asker.send({"type": "ask", "text": "note y"})
    asked = await approval_of(asker, rid)
    asker.writer.write_eof()
    assert (await watcher.request({"type": "approve", "conversation": asked["conversation"],
                                   "call": asked["call"], "allow": True}))["type"] == "approved"
    assert of_type(await asker.until(rid), "tool")[0]["approval"]["by"] == "user"
    assert written(notes) == ["y"]
    await asker.close()

    # a cancel: the turn stops, the call never runs, the denial is kept with the turn
    router.script(call(WRITE, {"text": "z"}))  # it asks nothing after the call
    rid = await watcher.send({"type": "ask", "text": "note z"})
    asked = await approval_of(watcher, rid)
    await watcher.request({"type": "cancel", "conversation": asked["conversation"]})
    done = (await watcher.until(rid))[-1]
    assert done["finish_reason"] == "cancelled"
    opened = await watcher.request({"type": "open", "conversation": asked["conversation"]})
    assert [(a["by"], a["allowed"]) for a in opened["turns"][0]["approvals"]] == [("cancel", False)]

    # the daemon stopping: denied, and the turn goes on to its answer
    router.script(call(WRITE, {"text": "w"}), Reply(text="stopping, then"))
    rid = await watcher.send({"type": "ask", "text": "note w"})
    await approval_of(watcher, rid)
    stopping = asyncio.create_task(daemon.stop())
    events = await watcher.until(rid)
    assert of_type(events, "tool")[0]["approval"]["by"] == "shutdown"
    assert events[-1]["type"] == "done" and events[-1]["text"] == "stopping, then"
    await stopping
    await watcher.close()
    assert written(notes) == ["y"]


async def test_ask_without_a_terminal_denies_unless_told_to_approve(
    start: Any, router: FakeRouter, notes: Path
) -> None:
    await start()
    router.script(call(WRITE, {"text": "piped\nline"}), Reply(text="could not"))
    code, out, err = await cli("ask", "note it")
    assert code == 0 and out == "could not\n"
    assert 'the model wants to run write_note (MCP server notes)' in err and 'text: "piped\\nline"' in err
    assert "[denied: no terminal to ask at" in err and "[denied]" not in err and written(notes) == []
    router.script(call(WRITE, {"text": "by name"}), Reply(text="done"))
    assert (await cli("ask", "note it", "--approve", WRITE))[0] == 0
    router.script(call(WRITE, {"text": "all"}), Reply(text="done"))
    assert (await cli("ask", "note it", "--approve-all"))[0] == 0
    assert written(notes) == ["by name", "all"]
    code, out, _err = await cli("open", "1")
    assert "denied: notes__write_note" in out and "nobody could be asked" not in out and "by you" in out


async def test_chat_asks_at_the_terminal(start: Any, router: FakeRouter, notes: Path) -> None:
    _daemon, wire = await start()
    chat = ChatTerminal.spawn("chat")
    try:
        await chat.expect("> ")
        router.script(call(WRITE, {"text": "x" * 500}), Reply(text="written down"))
        chat.type("note five hundred x\n")
        shown = await chat.expect("Allow? [y/N/a(lways in this conversation)] ")
        assert "write_note (MCP server notes)" in shown and "(502 characters)" in shown
        chat.type("y\n")
        await chat.expect("written down")
        await chat.expect("> ")
        router.script(call(WRITE, {"text": "no"}), Reply(text="left alone"))
        chat.type("note no\n")
        await chat.expect("Allow?")
        chat.type("n\n")
        await chat.expect("[denied]")
        await chat.expect("left alone")
        await chat.expect("> ")
        # Ctrl-C at the question: denied, and the reply stopped (the chat goes on)
        router.script(call(WRITE, {"text": "stop"}))
        chat.type("note stop\n")
        await chat.expect("Allow?")
        chat.type("\x03")
        await chat.expect("[cancelled; the partial reply is kept]")
        await chat.expect("> ")
        chat.type("exit\n")
        assert await chat.exit_code() == 0
    finally:
        chat.close()
    assert written(notes) == ["x" * 500]
    turns = (await wire.request({"type": "open", "conversation": 1}))["turns"]
    assert [(a["allowed"], a["by"]) for t in turns for a in t["approvals"]] == [
        (True, "user"), (False, "user"), (False, "cancel"),
    ]


async def test_the_openai_door_denies_an_acting_tool_and_runs_a_reading_one(
    start: Any, router: FakeRouter, notes: Path
) -> None:
    """An OpenAI client cannot be asked: a tool that may act is denied unless approved in advance."""
    import openai

    daemon, wire = await start(openai_listen="127.0.0.1:0")
    host, port = daemon.server.door.address
    key = (daemon.config.data_dir / "openai_key").read_text().strip()
    router.script(Reply(tool_calls=[{"id": "w", "name": WRITE, "arguments": json.dumps({"text": "rm -rf"})},
                                    {"id": "r", "name": READ, "arguments": "{}"}]), Reply(text="I may not."))
    client = openai.AsyncOpenAI(base_url=f"http://{host}:{port}/v1", api_key=key, max_retries=0)
    answer = await client.chat.completions.create(model="fake-text", messages=[{"role": "user", "content": "note it"}])
    assert answer.choices[0].message.content == "I may not." and written(notes) == []
    denied, read = tool_messages(router.requests[-1])
    assert "none can be asked here. It did not run" in denied["content"], denied
    assert read["content"] == "(no notes)"  # read-only: ran without asking
    [turn] = (await wire.request({"type": "open", "conversation": 1}))["turns"]
    assert [(a["name"], a["allowed"], a["by"]) for a in turn["approvals"]] == [(WRITE, False, "policy")]
