"""A full disk, made for real: the data dir on a small tmpfs that the test fills.

Mounting needs root (CI and the project's machines run as root); elsewhere these tests
are skipped with the reason. A filler file takes every free page of the tmpfs, so
SQLite's next write fails with SQLITE_FULL exactly as on a full disk; deleting it
gives the space back.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import errno
import os
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from client import Wire, of_type, reply_text
from core import Config, load_config
from core.errors import StartupError
from history import HistoryStore, NewTurn
from selfcheck.fakerouter import FakeRouter, Reply
from tests.conftest import RunningDaemon

pytestmark = pytest.mark.asyncio

DISK_SIZE = "4m"
WORDS = " ".join(f"word{i}" for i in range(40))  # the reply, streamed a word at a time
SETTLE_SECONDS = 30.0  # how long a kept reply may take to land once there is room (far less, when idle)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a real full disk) needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE},mode=0700", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def config(small_disk: Path, config: Config, monkeypatch: pytest.MonkeyPatch) -> Config:
    """conftest's config (and so its ``daemon``), with the data dir on the small disk."""
    monkeypatch.setenv("ASSISTANT_DATA_DIR", str(small_disk / "assistant"))
    return load_config()


def fill(folder: Path) -> Path:
    """Take every free byte of the file system holding ``folder``; the filler's path."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 16, 4096, 1):
            block = b"\0" * chunk
            while True:
                try:
                    os.write(fd, block)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)
    assert os.statvfs(folder).f_bavail == 0
    return filler


def stored_turn(db: Path, cid: int, turn: int) -> tuple[str, str]:
    """(status, reply) of a turn as history.db holds it, read by a connection of our own."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT status, reply FROM turns WHERE conversation_id = ? AND turn = ?",
                           (cid, turn)).fetchone()
    finally:
        conn.close()
    return tuple(row)


async def fill_mid_reply(wire: Wire, router: FakeRouter, config: Config) -> tuple[list[dict], Path]:
    """Ask for a reply, fill the disk once it streams, then let the rest come; the turn's events
    and the filler."""
    rest = threading.Event()
    router.script(Reply(text=WORDS, hold=rest))
    rid = await wire.send({"type": "ask", "text": "Tell me forty words"})
    async for event in wire.stream(rid):
        if event["type"] == "delta":
            break
    filler = fill(config.data_dir.parent)
    rest.set()
    return await wire.until(rid), filler  # every event of the turn, those read already too


async def test_a_full_disk_refuses_a_turn_before_the_model_is_asked(
    daemon: RunningDaemon, router: FakeRouter
) -> None:
    wire = await daemon.connect()
    filler = fill(daemon.config.data_dir.parent)
    events = await wire.ask("Hello?")
    assert [e["type"] for e in events] == ["error"]
    assert events[0]["code"] == "disk_full"
    assert "free some space" in events[0]["message"]
    assert not [r for r in router.requests if r["path"].endswith("/chat/completions")]
    filler.unlink()
    events = await wire.ask("Hello again?")
    assert of_type(events, "done")
    await wire.close()


async def test_a_reply_the_full_disk_cannot_take_is_kept_and_written_when_room_returns(
    daemon: RunningDaemon, router: FakeRouter
) -> None:
    config = daemon.config
    wire = await daemon.connect()
    watcher = await daemon.connect()
    watch = await watcher.send({"type": "watch"})
    await watcher.until(watch, ("watching",))
    events, filler = await fill_mid_reply(wire, router, config)
    assert reply_text(events) == WORDS  # the client saw the whole reply
    end = events[-1]
    # done, with what a canvas shows of it (usage, ctx_used), and word that it is not saved yet
    assert end["type"] == "done" and end["saved"] is False and end["text"] == WORDS
    assert end["finish_reason"] == "stop" and end["ctx_used"] > 0 and end["model"] == "fake-text"
    assert "kept in memory" in end["note"] and "free some space" in end["note"]
    cid, turn = end["conversation"], end["turn"]
    # not running: open shows the outcome kept in memory
    opened = await wire.request({"type": "open", "conversation": cid})
    assert opened["running"] is None
    assert opened["turns"][0]["status"] == "complete"
    assert opened["turns"][0]["reply"] == WORDS
    assert stored_turn(config.db_path, cid, turn)[0] == "running"  # the disk really took nothing
    filler.unlink()
    # retried with back-off, without anyone asking; a watcher is told when it is saved at last
    told: list[tuple[str, bool | None, str | None]] = []
    async with asyncio.timeout(SETTLE_SECONDS):
        async for event in watcher.stream(watch):
            if event["type"] == "changed" and event["kind"] == "turn":
                told.append((event["action"], event.get("saved"), event.get("status")))
                if event["action"] == "saved":
                    break
    assert told == [("started", None, None), ("ended", False, "complete"), ("saved", None, "complete")]
    assert stored_turn(config.db_path, cid, turn) == ("complete", WORDS)
    events = await wire.ask("And now?", conversation=cid)
    assert of_type(events, "done")
    await wire.close()
    await watcher.close()


async def test_a_reply_that_fails_on_a_full_disk_keeps_its_own_error(daemon: RunningDaemon, router: FakeRouter) -> None:
    wire = await daemon.connect()
    router.script(Reply(text=WORDS, delay=0.03, error="the model crashed"))  # an error after the words
    rid = await wire.send({"type": "ask", "text": "Tell me forty words"})
    async for event in wire.stream(rid):
        if event["type"] == "delta":
            break
    filler = fill(daemon.config.data_dir.parent)
    end = (await wire.until(rid))[-1]
    # the turn failed for its own reason: that stays its code, and its message says the disk is full too
    assert end["type"] == "error" and end["code"] == "router_error", end
    assert "the model crashed" in end["message"] and "kept in memory" in end["message"]
    filler.unlink()
    await wire.close()


async def test_a_kept_reply_is_written_before_the_next_turn_starts(
    daemon: RunningDaemon, router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    from history import aio

    monkeypatch.setattr(aio, "RETRY_FIRST", 3600.0)  # no retry comes before the next ask
    config = daemon.config
    wire = await daemon.connect()
    events, filler = await fill_mid_reply(wire, router, config)
    cid = events[-1]["conversation"]
    refused = await wire.ask("Still full?", conversation=cid)
    assert [e["type"] for e in refused] == ["error"] and refused[0]["code"] == "disk_full"
    assert "wait in memory" in refused[0]["message"]
    filler.unlink()
    router.script(Reply(text="Second answer"))
    events = await wire.ask("Room now?", conversation=cid)
    assert reply_text(events) == "Second answer"
    assert stored_turn(config.db_path, cid, 1) == ("complete", WORDS)
    # the model heard the first exchange: the kept reply was in history before the prompt was built
    prompt = router.requests[-1]["messages"]
    assert {"role": "assistant", "content": WORDS} in prompt
    await wire.close()


async def test_a_kept_reply_is_written_at_shutdown(
    config: Config, router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    from history import aio

    monkeypatch.setattr(aio, "RETRY_FIRST", 3600.0)  # only the shutdown writes it
    daemon = RunningDaemon(config)
    await daemon.start()
    wire = await daemon.connect()
    events, filler = await fill_mid_reply(wire, router, config)
    cid, turn = events[-1]["conversation"], events[-1]["turn"]
    assert stored_turn(config.db_path, cid, turn)[0] == "running"
    filler.unlink()
    await wire.close()
    await daemon.stop()
    assert stored_turn(config.db_path, cid, turn) == ("complete", WORDS)


async def test_start_up_on_a_full_disk_after_a_crash_serves_what_it_can(
    config: Config, router: FakeRouter
) -> None:
    daemon = RunningDaemon(config)
    await daemon.start()
    wire = await daemon.connect()
    events = await wire.ask("Remember this")
    cid = events[-1]["conversation"]
    await wire.close()
    await daemon.stop()
    # a crash leaves a turn running, and the WAL files open: this connection keeps them
    with HistoryStore(config.db_path) as store:
        cut = "cut by a crash"
        store.start_turn(NewTurn(cid, cut, [{"role": "user", "content": cut}], [], "fake-text"))
        fill(config.data_dir.parent)
        await daemon.start()  # marking the cut turn interrupted fails: it is served all the same
        wire = await daemon.connect()
        opened = await wire.request({"type": "open", "conversation": cid})
        assert [t["text"] for t in opened["turns"]] == ["Remember this", "cut by a crash"]
        # not shown running (nothing runs it): shown as the next start will store it
        assert opened["running"] is None and opened["turns"][1]["status"] == "interrupted"
        listed = await wire.request({"type": "conversations"})
        assert [c["conversation"] for c in listed["items"]] == [cid]
        refused = await wire.ask("More?", conversation=cid)
        assert [e["type"] for e in refused] == ["error"] and refused[0]["code"] == "disk_full"
        await wire.close()
        await daemon.stop()


async def test_start_up_on_a_full_disk_that_cannot_open_the_history_is_one_clear_line(
    config: Config, router: FakeRouter
) -> None:
    with HistoryStore(config.db_path):
        pass  # closed cleanly: the WAL files are gone, and opening must make them anew
    fill(config.data_dir.parent)
    daemon = RunningDaemon(config)
    with pytest.raises(StartupError) as refused:
        await daemon.start()
    message = refused.value.message
    assert "is full; free some space and start again" in message
    assert "move it aside" not in message  # nothing is wrong with the file


async def test_knowledge_base_work_on_a_full_disk_stops_with_disk_full(
    daemon: RunningDaemon, router: FakeRouter, tmp_path: Path
) -> None:
    """kb_add once went on through every file, each "could not be indexed (DiskFull)"; kb_remove
    answered disk_full for a removal it had committed."""
    wire = await daemon.connect()
    docs = tmp_path / "docs"
    docs.mkdir()
    for n in range(12):
        (docs / f"note{n}.txt").write_text(f"note {n}: " + " ".join(f"w{n}x{i}" for i in range(6000)))
    rid = await wire.send({"type": "kb_add", "kb": "big", "paths": [str(docs / "note0.txt"), str(docs / "note1.txt")]})
    assert (await wire.until(rid, ("kb", "error")))[-1]["type"] == "kb"
    rid = await wire.send({"type": "kb_add", "kb": "small", "paths": [str(docs / "note2.txt")]})
    assert (await wire.until(rid, ("kb", "error")))[-1]["type"] == "kb"
    filler = fill(daemon.config.data_dir.parent)
    try:
        rid = await wire.send({"type": "kb_add", "kb": "small", "paths": [str(docs)]})
        answer = (await wire.until(rid, ("kb", "error")))[-1]
        assert answer["type"] == "error" and answer["code"] == "disk_full", answer
        removed = await wire.request({"type": "kb_remove", "kb": "big"})
        names = [kb["kb"] for kb in (await wire.request({"type": "kb_list"}))["items"]]
        # an answer that says what happened: removed and gone, or refused and still there
        assert (removed["type"], "big" in names) in (("kb", False), ("error", True)), (removed, names)
    finally:
        filler.unlink()
    await wire.close()


async def test_a_door_question_with_a_file_on_a_full_disk_is_507_and_leaves_nothing(
    config: Config, router: FakeRouter
) -> None:
    """Its file cannot be written: the door says the disk is full (not a 500), and no part of the
    file, nor a conversation, is left behind."""
    running = RunningDaemon(dataclasses.replace(config, openai_listen="127.0.0.1:0"))
    await running.start()
    try:
        assert running.server is not None and running.server.door is not None
        host, port = running.server.door.address or ("", 0)
        key = (config.data_dir / "openai_key").read_text().strip()
        filler = fill(config.data_dir)
        data = base64.b64encode(b"x" * 200_000).decode()
        body = {"model": "fake-text", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "read this"},
            {"type": "file", "file": {"filename": "big.txt", "file_data": data}}]}]}
        async with httpx.AsyncClient() as client:
            answer = await client.post(f"http://{host}:{port}/v1/chat/completions", json=body,
                                       headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert answer.status_code == 507, answer.text
        assert answer.json()["error"]["code"] == "disk_full" and "free some space" in answer.json()["error"]["message"]
        assert not [p for p in (config.data_dir / "uploads").rglob("*") if p.is_file()]
        filler.unlink()
        wire = await running.connect()
        try:
            assert (await wire.request({"type": "conversations"}))["items"] == []
        finally:
            await wire.close()
    finally:
        await running.stop()
