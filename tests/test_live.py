"""Many surfaces, one live state (issue 30): ``watch``, ``follow``, what runs, an ask's ``ref``.

Two clients through the real socket: one changes things or asks, the other watches the
changes and follows the running reply, also across a ``kill -9`` of the daemon.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import socket
from pathlib import Path
from typing import Any

import pytest

from client import Wire
from client.wire import DaemonGone, reply_text
from core import Config
from daemon import live as live_module
from daemon.connection import Connection, Replier
from daemon.protocol import Request
from selfcheck.fakerouter import FakeRouter, Reply
from tests.conftest import EVENT_TIMEOUT, RunningDaemon, serving
from tests.contract import check_event
from tests.test_lifecycle import DaemonProcess, spawned, start

__all__ = ["spawned"]  # the fixture, used here as there

pytestmark = pytest.mark.asyncio


async def changes(wire: Wire, rid: Any, n: int) -> list[dict[str, Any]]:
    """The next ``n`` events answering the watch ``rid`` (taken, so a later call reads on)."""
    got: list[dict[str, Any]] = []
    async for event in wire.stream(rid):
        wire.events.remove(event)
        if event["type"] != "watching":
            got.append(event)
        if len(got) == n:
            return got
    raise AssertionError("stream() ends only by raising")  # pragma: no cover


async def watching(wire: Wire) -> Any:
    rid = await wire.send({"type": "watch"})
    answer = await wire.until(rid, ("watching",))
    wire.events.remove(answer[-1])
    return rid


async def test_a_watcher_hears_of_every_change_another_client_makes(
    daemon: RunningDaemon, wire: Wire, tmp_path: Path
) -> None:
    watcher = await daemon.connect()
    rid = await watching(watcher)
    events = await wire.ask("what is a pipe?", ref="canvas-1")
    cid = events[0]["conversation"]
    created, started, ended = await changes(watcher, rid, 3)
    assert created == {"type": "changed", "id": rid, "seq": 1, "kind": "conversation", "action": "created",
                       "conversation": cid, "title": "what is a pipe?", "model": None}
    assert started["kind"] == "turn" and started["action"] == "started"
    assert (started["conversation"], started["turn"], started["text"], started["ref"], started["files"]) == (
        cid, 1, "what is a pipe?", "canvas-1", [])
    done = events[-1]
    assert ended["action"] == "ended" and ended["ref"] == "canvas-1" and ended["saved"] is True
    assert (ended["status"], ended["finish_reason"], ended["usage"], ended["ctx_used"]) == (
        "complete", "stop", done["usage"], done["ctx_used"])
    # enough to keep a list in order without a read: the model that answered, the conversation's updated_at
    listed = (await wire.request({"type": "conversations"}))["items"][0]
    assert (ended["model"], ended["updated_at"]) == (done["model"], listed["updated_at"]) == ("fake-text",
                                                                                             listed["updated_at"])

    await wire.request({"type": "settings", "conversation": cid, "title": "Pipes", "kb_injection": "off"})
    (updated,) = await changes(watcher, rid, 1)
    assert (updated["action"], updated["title"], updated["settings"]) == ("updated", "Pipes", {"kb_injection": "off"})

    (tmp_path / "notes.md").write_text("# Notes\n\nPipes carry bytes.\n")
    add = await wire.send({"type": "kb_add", "kb": "notes", "paths": [str(tmp_path / "notes.md")]})
    await wire.until(add, ("kb", "error"))
    await wire.request({"type": "kb_link", "kb": "notes", "conversation": cid})
    again = await wire.send({"type": "kb_add", "kb": "notes", "paths": [str(tmp_path / "notes.md")]})
    await wire.until(again, ("kb", "error"))  # nothing changed: its progress alone is told
    await wire.request({"type": "kb_remove", "kb": "notes"})
    await wire.request({"type": "delete", "conversation": cid})
    told = []
    while not told or told[-1]["action"] != "deleted":
        told += await changes(watcher, rid, 1)
    assert [e["seq"] for e in told] == list(range(5, 5 + len(told)))  # one a change, none skipped
    steps = [(e["kb"], e["phase"], e["done"], e["total"]) for e in told if e["action"] == "progress"]
    # another client's add, told as it goes (issue 46 item 5): each file read, in both adds
    assert steps == [("notes", "reading", 0, 1), ("notes", "reading", 1, 1)] * 2
    added, linked, removed, deleted = [e for e in told if e["action"] != "progress"]
    assert (added["kind"], added["action"], added["kb"], added["documents"]) == ("kb", "added", "notes", 1)
    assert (linked["action"], linked["conversation"], linked["linked"]) == ("linked", cid, True)
    assert (removed["action"], removed["kb"]) == ("removed", "notes")
    assert (deleted["kind"], deleted["action"], deleted["conversation"]) == ("conversation", "deleted", cid)
    # a later watch starts from the last change
    assert (await wire.request({"type": "watch"}))["seq"] == deleted["seq"] == 12
    await watcher.close()


async def test_a_watcher_hears_of_the_models_title(config: Config, router: FakeRouter) -> None:
    async with serving(dataclasses.replace(config, auto_title=True)) as (running, client):
        watcher = await running.connect()
        rid = await watching(watcher)
        cid = (await client.ask("name me"))[0]["conversation"]
        found = await changes(watcher, rid, 4)
        # the same fields as every ``updated`` change, whoever made it (daemon/events.py)
        assert {k: v for k, v in found[-1].items() if k not in ("id", "seq")} == {
            "type": "changed", "kind": "conversation", "action": "updated", "conversation": cid,
            "title": "Fake title", "model": None, "model_name": None, "system": None, "settings": {}}
        await watcher.close()


async def test_a_follower_gets_the_reply_so_far_from_memory_then_the_rest(
    daemon: RunningDaemon, wire: Wire, router: FakeRouter
) -> None:
    words = [f" word{n}" for n in range(40)]
    router.script(Reply(chunks=["Once", *words], reasoning=["thinking first"], delay=0.01))
    rid = await wire.send({"type": "ask", "text": "tell me", "ref": "mine"})
    first = await wire.until(rid, ("delta",))
    cid = first[0]["conversation"]
    follower = await daemon.connect()
    fid = await follower.send({"type": "follow", "conversation": cid})
    followed = await follower.until(fid)
    following = followed[0]
    assert following["type"] == "following"
    assert (following["turn"], following["text"], following["ref"], following["files"]) == (1, "tell me", "mine", [])
    assert following["reasoning"] == "thinking first" and following["model"] == "fake-text"
    assert following["reply"].startswith("Once")  # what the asker had seen at least, from memory
    done = followed[-1]
    assert done["type"] == "done" and done["id"] == fid
    asked = await wire.until(rid)
    stored = (await wire.request({"type": "open", "conversation": cid}))["turns"][0]
    # the text so far and the deltas after it are the reply, byte for byte
    assert following["reply"] + reply_text(followed) == done["text"] == stored["reply"] == reply_text(asked)
    assert stored["ref"] == "mine"
    await follower.close()


async def test_follow_when_nothing_runs_and_of_no_conversation(wire: Wire) -> None:
    cid = (await wire.ask("hello"))[0]["conversation"]
    assert await wire.request({"type": "follow", "conversation": cid}) == {
        "type": "following", "conversation": cid, "turn": None, "id": "r2"}
    missing = await wire.request({"type": "follow", "conversation": 99})
    assert missing["type"] == "error" and missing["code"] == "not_found"
    bad = await wire.request({"type": "follow"})
    assert bad["type"] == "error" and bad["code"] == "bad_request" and "'conversation'" in bad["message"]


async def test_a_follower_that_leaves_does_not_touch_the_turn(
    daemon: RunningDaemon, wire: Wire, router: FakeRouter
) -> None:
    router.script(Reply(chunks=["one", " two", " three"], delay=0.05))
    rid = await wire.send({"type": "ask", "text": "count"})
    cid = (await wire.until(rid, ("delta",)))[0]["conversation"]
    follower = await daemon.connect()
    fid = await follower.send({"type": "follow", "conversation": cid})
    await follower.until(fid, ("following",))
    await follower.close()  # gone mid-reply
    events = await wire.until(rid)
    assert events[-1]["type"] == "done" and events[-1]["text"] == "one two three"


async def test_status_and_conversations_say_what_runs(wire: Wire, router: FakeRouter) -> None:
    router.script(Reply(chunks=["a long story"], hang=True))
    rid = await wire.send({"type": "ask", "text": "a story", "ref": "story-1"})
    cid = (await wire.until(rid, ("delta",)))[0]["conversation"]
    status = await wire.request({"type": "status"})
    (running,) = status["running"]
    assert (running["conversation"], running["turn"], running["stage"], running["model"]) == (
        cid, 1, "replying", "fake-text")
    assert (running["text"], running["ref"]) == ("a story", "story-1")  # what it is, without a follow
    listed = await wire.request({"type": "conversations"})
    assert [(i["conversation"], i["running"]) for i in listed["items"]] == [(cid, True)]
    await wire.request({"type": "cancel", "conversation": cid})
    assert (await wire.request({"type": "status"}))["running"] == []
    assert (await wire.request({"type": "conversations"}))["items"][0]["running"] is False


async def test_an_asks_ref_is_checked_stored_and_shown(wire: Wire) -> None:
    too_long = await wire.ask("hi", ref="r" * 129)
    assert too_long[-1]["code"] == "bad_request" and "at most 128 characters" in too_long[-1]["message"]
    not_text = await wire.ask("hi", ref=7)
    assert not_text[-1]["code"] == "bad_request" and "'ref' must be a string" in not_text[-1]["message"]
    assert (await wire.request({"type": "conversations"}))["items"] == []  # refused: nothing stored
    events = await wire.ask("hi", ref="r" * 128)
    assert events[0]["type"] == "user" and events[0]["ref"] == "r" * 128
    cid = events[0]["conversation"]
    await wire.ask("again", conversation=cid)
    turns = (await wire.request({"type": "open", "conversation": cid}))["turns"]
    assert [t["ref"] for t in turns] == ["r" * 128, None]


class RawLines:
    """A connection read only when asked to: what it does not read stays with the daemon."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.sock.setblocking(False)
        self.buffer = b""

    async def send(self, data: bytes) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def read(self) -> dict[str, Any]:
        while b"\n" not in self.buffer:
            chunk = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(self.sock, 65536), EVENT_TIMEOUT)
            assert chunk, "the daemon hung up"
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        event: dict[str, Any] = json.loads(line)
        return event

    def close(self) -> None:
        self.sock.close()


async def test_a_watcher_that_never_reads_is_bounded_and_told_what_it_missed(
    daemon: RunningDaemon, wire: Wire, monkeypatch: pytest.MonkeyPatch
) -> None:
    bound = 64 * 1024
    monkeypatch.setattr(live_module, "WATCH_BACKLOG", bound)
    # a plain socket: an asyncio stream would read on in the background, into its own buffer
    stalled = RawLines(daemon.config.socket_path)
    await stalled.send(b'{"type": "watch", "id": "w"}\n')
    seen = [await stalled.read()]
    assert (seen[0]["type"], seen[0]["seq"], seen[0]["id"]) == ("watching", 0, "w")  # and from here on it reads nothing
    # each question is told to the watcher (a turn-started change carries it); a new conversation
    # each, so that every one fits the fake model's context
    question = "x" * 8_000
    for _ in range(60):  # far more than the socket's own buffers and the bound hold
        assert (await wire.ask(question))[-1]["type"] == "done"  # the others are served
    assert daemon.server is not None
    held = max(c.backlog for c in daemon.server._connections)
    assert 0 < held <= bound + 2 * len(question)  # the bound and one event, not sixty questions
    # it reads at last: the changes up to the bound, then one missed event, then nothing
    while seen[-1]["type"] != "missed":
        seen.append(await stalled.read())
    for event in seen:
        check_event(event, "watch")
    told = [e["seq"] for e in seen[1:-1]]
    assert told == list(range(1, len(told) + 1)) and seen[-1]["seq"] == len(told) + 1
    # changes reach it again once it has read what waited
    await wire.request({"type": "settings", "conversation": 1, "title": "later"})
    after = await stalled.read()
    check_event(after, "watch")
    assert after["action"] == "updated" and after["title"] == "later" and after["seq"] > seen[-1]["seq"]
    stalled.close()


async def test_a_follower_across_a_kill_9_sees_the_stored_reply_interrupted(
    spawned: list[DaemonProcess], config: Config, router: FakeRouter, tmp_path: Path
) -> None:
    router.script(Reply(chunks=["before ", "the crash"], hang=True))
    await start(spawned, tmp_path)
    asker = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    canvas = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    wid = await watching(canvas)
    rid = await asker.send({"type": "ask", "text": "will you crash?", "ref": "canvas-9"})
    created, started = await changes(canvas, wid, 2)
    cid = started["conversation"]
    assert created["conversation"] == cid and started["ref"] == "canvas-9"
    fid = await canvas.send({"type": "follow", "conversation": cid})
    # what the follower is shown: the reply so far (``following``), then the deltas after it; the
    # chunks may all have gone out before the follow, and then no delta comes at all
    followed: list[dict[str, Any]] = []
    async for event in canvas.stream(fid):
        followed.append(event)
        if followed[0]["reply"] + reply_text(followed) == "before the crash":
            break
    shown = followed[0]["reply"] + reply_text(followed)
    assert followed[0]["type"] == "following" and shown == "before the crash"
    await asker.until_reply(rid, "before the crash")
    # the streaming reply is checkpointed soon after its last delta; wait for that, then kill
    for _ in range(200):
        turn = (await asker.request({"type": "open", "conversation": cid}))["turns"][0]
        if turn["reply"] == shown:
            break
        await asyncio.sleep(0.05)
    await spawned[-1].stop(signal.SIGKILL)
    with pytest.raises(DaemonGone):
        await canvas.until(fid)  # the follower learns the daemon is gone
    await asker.close()
    await canvas.close()
    await start(spawned, tmp_path)
    canvas = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    # the recipe after every (re)connect: watch, follow what was shown, read what is stored
    assert (await canvas.request({"type": "watch"}))["seq"] > 2  # numbered on, past what a crash may have used
    assert (await canvas.request({"type": "follow", "conversation": cid}))["turn"] is None
    turn = (await canvas.request({"type": "open", "conversation": cid, "turn": 1}))["turns"][0]
    assert (turn["status"], turn["reply"], turn["ref"]) == ("interrupted", shown, "canvas-9")
    await canvas.close()


class ScriptedTransport:
    """A transport that keeps what is written until the test says the client read it."""

    def __init__(self) -> None:
        self.unread = 0

    def get_write_buffer_size(self) -> int:
        return self.unread

    def writelines(self, parts: list[bytes]) -> None:
        self.unread += sum(map(len, parts))

    def is_closing(self) -> bool:
        return False


class ScriptedWriter:
    def __init__(self) -> None:
        self.transport = ScriptedTransport()


async def test_a_watcher_reading_a_large_event_misses_nothing_and_one_that_stops_is_told() -> None:
    writer = ScriptedWriter()
    connection = Connection(asyncio.StreamReader(), writer, handler=None, tasks=set())  # type: ignore[arg-type]
    sent: list[dict[str, Any]] = []
    real_send = connection.send
    connection.send = lambda event: (sent.append(event), real_send(event))[1]  # type: ignore[method-assign]
    live = live_module.Live()
    emit = Replier(connection, Request(type="watch", id="w", has_id=True))
    live.watch(emit)
    assert sent[-1] == {"type": "watching", "seq": 0, "epoch": live.epoch, "first": 1, "id": "w"}
    await asyncio.sleep(0)  # the answer goes out with this turn of the loop
    writer.transport.unread = 0  # and is read
    connection.send({"type": "conversation", "turns": "x" * (4 * live_module.WATCH_BACKLOG)})  # an open, being read
    live.publish("conversation", "deleted", conversation=1)
    assert sent[-1]["type"] == "changed" and sent[-1]["seq"] == 1  # not missed: the open is one event
    for n in range(2, 1000):  # it stops reading: changes pile up past the bound
        live.publish("conversation", "updated", conversation=1, title="t" * 1000)
        if sent[-1]["type"] == "missed":
            break
    assert sent[-1] == {"type": "missed", "seq": n, "message": sent[-1]["message"], "id": "w"}
    assert n > live_module.WATCH_BACKLOG // 1200  # the bound's worth (changes of about 1.1 KB) was sent first
    live.publish("conversation", "deleted", conversation=2)
    assert sent[-1]["type"] == "missed"  # nothing more while it does not read
    writer.transport.unread = 0  # it read everything
    live.publish("conversation", "deleted", conversation=3)
    assert (sent[-1]["type"], sent[-1]["seq"], sent[-1]["conversation"]) == ("changed", n + 2, 3)


async def test_an_ask_whose_connection_dropped_is_found_by_its_ref(
    daemon: RunningDaemon, wire: Wire, router: FakeRouter
) -> None:
    canvas = await daemon.connect()
    wid = await watching(canvas)
    await wire.ask("an older question", ref="lost-1")  # the same ref earlier: the newest is found
    router.script(Reply(chunks=["the answer"], delay=0.05))
    asker = await daemon.connect()
    await asker.send({"type": "ask", "text": "where am I?", "ref": "lost-1"})
    await asker.close()  # gone before its user event
    found = await changes(canvas, wid, 5)
    started = found[-1]
    assert (started["action"], started["ref"]) == ("started", "lost-1")
    opened = await wire.request({"type": "open", "ref": "lost-1"})
    assert opened["type"] == "conversation" and opened["conversation"] == started["conversation"]
    assert [(t["turn"], t["text"], t["ref"]) for t in opened["turns"]] == [(1, "where am I?", "lost-1")]
    assert opened["total"] == 1
    missing = await wire.request({"type": "open", "ref": "never-sent"})
    assert missing["type"] == "error" and missing["code"] == "not_found" and "ask again" in missing["message"]
    both = await wire.request({"type": "open", "ref": "lost-1", "conversation": 1})
    assert both["type"] == "error" and both["code"] == "bad_request" and "'ref' alone" in both["message"]
    neither = await wire.request({"type": "open"})
    assert neither["type"] == "error" and neither["code"] == "bad_request" and "'ref'" in neither["message"]
    await wire.request({"type": "delete", "conversation": started["conversation"]})
    older = await wire.request({"type": "open", "ref": "lost-1"})  # the deleted one is not found
    assert older["turns"][0]["text"] == "an older question"
    await canvas.close()
