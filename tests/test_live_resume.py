"""A watcher that reconnects (issue 46): ``watch`` with ``since`` sends what it missed, from
the journal, across a restart of the daemon too; or ``missed`` when the journal no longer
holds it. Three connections through the real socket: one changes things, one watches
throughout (what was missed is what it saw), one hangs up and comes back.
"""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path
from typing import Any

import pytest

from client import Wire
from core import Config
from daemon import health as health_module
from daemon import live as live_module
from selfcheck.fakerouter import FakeRouter
from tests.conftest import EVENT_TIMEOUT, RunningDaemon, serving
from tests.test_lifecycle import DaemonProcess, spawned, start
from tests.test_live import changes

__all__ = ["spawned"]  # the fixture, used here as there

pytestmark = pytest.mark.asyncio


async def watch(wire: Wire, since: int | None = None) -> tuple[Any, dict[str, Any]]:
    """A watch (from ``since``): its id and its ``watching`` answer."""
    request: dict[str, Any] = {"type": "watch"}
    if since is not None:
        request["since"] = since
    rid = await wire.send(request)
    answer = (await wire.until(rid, ("watching", "error")))[-1]
    wire.events.remove(answer)
    assert answer["type"] == "watching", answer
    return rid, answer


def bare(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The changes without the watch's id: what two watchers are told alike."""
    return [{k: v for k, v in e.items() if k != "id"} for e in events]


async def make_changes(wire: Wire, title: str) -> int:
    """Four changes: a conversation created, its turn started and ended, its title set."""
    cid: int = (await wire.ask("what is a pipe?", ref=title[:128]))[0]["conversation"]
    await wire.request({"type": "settings", "conversation": cid, "title": title})
    return cid


async def test_a_watcher_back_with_since_gets_exactly_what_it_missed(daemon: RunningDaemon, wire: Wire) -> None:
    canvas = await daemon.connect()  # watches throughout
    cid, seen = await watch(canvas)
    widget = await daemon.connect()  # hangs up, comes back
    wid, first = await watch(widget)
    assert first["seq"] == seen["seq"] == 0 and first["epoch"] == seen["epoch"] and first["first"] == 1
    await make_changes(wire, "one")
    got = await changes(widget, wid, 4)
    await widget.close()  # gone at the fourth change
    await make_changes(wire, "two")
    told = await changes(canvas, cid, 8)
    assert [e["seq"] for e in told] == list(range(1, 9))

    widget = await daemon.connect()
    wid, back = await watch(widget, since=got[-1]["seq"])
    assert (back["seq"], back["epoch"], back["first"]) == (8, seen["epoch"], 1)
    resumed = await changes(widget, wid, 4)
    assert bare(resumed) == bare(told[4:])  # in order, none left out
    assert all(e["id"] == wid for e in resumed)
    await wire.request({"type": "delete", "conversation": told[0]["conversation"]})
    (after,) = await changes(widget, wid, 1)  # the next change live: nothing sent twice
    assert (after["seq"], after["action"]) == (9, "deleted")
    assert bare([after]) == bare(await changes(canvas, cid, 1))
    assert widget.events == []
    # up to date: no change is sent again
    again = await daemon.connect()
    aid, _ = await watch(again, since=9)
    await wire.request({"type": "settings", "conversation": told[4]["conversation"], "title": "x"})
    (only,) = await changes(again, aid, 1)
    assert only["seq"] == 10
    for conn in (canvas, widget, again):
        await conn.close()


async def test_a_since_past_the_journal_is_missed(config: Config, router: FakeRouter) -> None:
    async with serving(dataclasses.replace(config, watch_journal=3)) as (running, wire):
        await make_changes(wire, "one")
        await make_changes(wire, "two")  # eight changes; the journal holds the last three
        widget = await running.connect()
        wid, back = await watch(widget, since=2)
        assert (back["seq"], back["first"]) == (8, 6)
        (missed,) = await changes(widget, wid, 1)
        assert (missed["type"], missed["seq"]) == ("missed", 3)  # the first change not sent
        await wire.request({"type": "settings", "conversation": 1, "title": "later"})
        (after,) = await changes(widget, wid, 1)
        assert (after["type"], after["seq"]) == ("changed", 9)  # changes go on
        # from the journal's first on (now 7), it is sent
        other = await running.connect()
        oid, _ = await watch(other, since=6)
        assert [e["seq"] for e in await changes(other, oid, 3)] == [7, 8, 9]
        refused = await wire.request({"type": "watch", "since": -1})
        assert refused["type"] == "error" and refused["code"] == "bad_request" and "'since'" in refused["message"]
        await widget.close()
        await other.close()


async def test_a_watcher_resumes_across_a_restart_and_a_crash_is_missed(
    spawned: list[DaemonProcess], config: Config, router: FakeRouter, tmp_path: Path
) -> None:
    await start(spawned, tmp_path)
    wire = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    widget = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    wid, before = await watch(widget)
    await make_changes(wire, "one")
    got = await changes(widget, wid, 4)
    await widget.close()
    cid = await make_changes(wire, "two")  # changes 5 to 8, missed
    await wire.close()
    code, err = await spawned[-1].stop()  # a clean stop: the journal is kept
    assert code == 0, err
    await start(spawned, tmp_path)
    wire = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    canvas = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    cwid, now = await watch(canvas)
    assert now["seq"] == 8 and now["epoch"] != before["epoch"]  # numbered on; another run
    await wire.request({"type": "delete", "conversation": cid})  # change 9, after the restart
    (deleted,) = await changes(canvas, cwid, 1)
    widget = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    wid, back = await watch(widget, since=got[-1]["seq"])
    assert back["epoch"] == now["epoch"] and back["first"] == 1
    resumed = await changes(widget, wid, 5)
    assert [e["seq"] for e in resumed] == [5, 6, 7, 8, 9]
    assert [(e["kind"], e["action"]) for e in resumed] == [
        ("conversation", "created"), ("turn", "started"), ("turn", "ended"), ("conversation", "updated"),
        ("conversation", "deleted")]
    assert resumed[-1] == {**deleted, "id": wid} and resumed[3]["title"] == "two"
    await widget.close()
    await canvas.close()
    await wire.close()

    await spawned[-1].stop(signal.SIGKILL)  # a crash: nothing saved
    await start(spawned, tmp_path)
    widget = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    wid, after = await watch(widget, since=9)
    assert after["seq"] > 9 and after["epoch"] != now["epoch"]  # never numbered again
    (missed,) = await changes(widget, wid, 1)
    assert (missed["type"], missed["seq"]) == ("missed", 10)  # it re-reads what it shows
    await widget.close()


async def test_a_clean_restart_with_nothing_changed_misses_nothing(
    spawned: list[DaemonProcess], config: Config, router: FakeRouter, tmp_path: Path
) -> None:
    await start(spawned, tmp_path)
    wire = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    _rid, before = await watch(wire)
    await make_changes(wire, "one")
    await wire.close()
    assert (await spawned[-1].stop())[0] == 0
    await start(spawned, tmp_path)
    wire = await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT)
    rid, back = await watch(wire, since=4)
    assert back["seq"] == 4 and back["epoch"] != before["epoch"]  # restarted, nothing missed
    await wire.request({"type": "delete", "conversation": 1})
    (deleted,) = await changes(wire, rid, 1)
    assert (deleted["type"], deleted["seq"]) == ("changed", 5)
    await wire.close()


async def test_a_router_that_goes_away_and_comes_back_is_told_twice(
    daemon: RunningDaemon, wire: Wire, router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Health changes pushed (issue 46 item 4): the watchers are told, with the new values."""
    monkeypatch.setattr(health_module, "HEALTH_SECONDS", 0.05)
    canvas = await daemon.connect()
    cid, _ = await watch(canvas)
    other = await daemon.connect()
    oid, _ = await watch(other)
    assert (await wire.request({"type": "status"}))["router_reachable"] is True  # seen up: what changes is told
    router.stop()
    (gone,) = await changes(canvas, cid, 1)
    assert (gone["kind"], gone["action"]) == ("daemon", "health")
    assert (gone["router_reachable"], gone["model"], gone["ctx_max"], gone["ctx_source"]) == (
        False, "fake-text", None, None)
    assert gone["mcp"] == [] and gone["ocr"]["available"] in (True, False)
    back_router = FakeRouter(port=router.port).start()  # the same address, answering again
    try:
        (back,) = await changes(canvas, cid, 1)
        assert (back["router_reachable"], back["model"], back["ctx_source"]) == (True, "fake-text", "models")
        assert back["seq"] == gone["seq"] + 1 and back["ctx_max"] == 4096
        # each watcher is told the same
        assert bare(await changes(other, oid, 2)) == bare([gone, back])
        status = await wire.request({"type": "status"})
        assert status["router_reachable"] is True and status["ctx_max"] == back["ctx_max"]
    finally:
        back_router.stop()
    await canvas.close()
    await other.close()


async def test_another_clients_kb_add_is_told_as_it_goes(daemon: RunningDaemon, wire: Wire, tmp_path: Path) -> None:
    """A kb_add's progress reaches the watchers, not only its end (issue 46 item 5)."""
    folder = tmp_path / "many"
    folder.mkdir()
    for n in range(150):
        (folder / f"note{n}.md").write_text(f"# Note {n}\n\nword{n} is here.\n")
    canvas = await daemon.connect()
    try:
        cid, _ = await watch(canvas)
        rid = await wire.send({"type": "kb_add", "kb": "many", "paths": [str(folder)]})
        answered = await wire.until(rid, ("kb", "error"))
        asker = [(e["phase"], e["done"], e["total"]) for e in answered if e["type"] == "progress"]
        told = []
        while not told or told[-1]["action"] != "added":
            told += await changes(canvas, cid, 1)
        steps = [(e["phase"], e["done"], e["total"]) for e in told if e["action"] == "progress"]
        assert steps == asker and steps[-1] == ("reading", 150, 150)  # at most a step a percent
        assert all(e["kb"] == "many" for e in told) and told[-1]["documents"] == 150
    finally:
        await canvas.close()


async def test_a_replay_is_sent_whole_and_the_journal_is_bounded_in_bytes(
    daemon: RunningDaemon, wire: Wire, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live_module, "WATCH_BACKLOG", 1024)  # a replay is not cut at a watcher's bound
    await make_changes(wire, "one" * 200)
    await make_changes(wire, "two" * 200)  # eight changes, over the bound in all
    widget = await daemon.connect()
    wid, _ = await watch(widget, since=0)
    assert [e["seq"] for e in await changes(widget, wid, 8)] == list(range(1, 9))
    monkeypatch.setattr(live_module, "JOURNAL_BYTES", 2000)  # the next change trims the journal to it
    await wire.request({"type": "settings", "conversation": 1, "title": "three"})
    other = await daemon.connect()
    oid, back = await watch(other, since=0)
    assert back["first"] > 2
    (missed,) = await changes(other, oid, 1)
    assert (missed["type"], missed["seq"]) == ("missed", 1)
    await widget.close()
    await other.close()
