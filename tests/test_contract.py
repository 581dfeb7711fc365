"""The protocol as a contract (issue 14): requests take effect in the order sent, refusals
name their turn, fields mean what docs/PROTOCOL.md says, and docs/protocol.schema.json
covers every request, event and error code (tests/contract.py checks every line)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from client import Wire, of_type
from core import Config, errors
from daemon.protocol import MAX_LINE_BYTES, REQUESTS
from history import HistoryStore
from selfcheck.fakerouter import FakeModel, FakeRouter, Reply
from tests import contract
from tests.conftest import RunningDaemon

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parent.parent


def lines(*requests: dict[str, Any]) -> bytes:
    """Several requests in one write: the daemon reads them back to back."""
    return b"".join(json.dumps(r).encode() + b"\n" for r in requests)


async def new_conversation(wire: Wire, text: str = "hello") -> int:
    events = await wire.ask(text)
    assert events[-1]["type"] == "done", events[-1]
    cid: int = events[0]["conversation"]
    return cid


# -- order ------------------------------------------------------------------------------------


async def test_settings_then_ask_back_to_back_asks_with_the_new_model(wire: Wire, router: FakeRouter) -> None:
    cid = await new_conversation(wire)
    await wire.send_raw(lines(
        {"type": "settings", "id": "s", "conversation": cid, "model": "fake-vision"},
        {"type": "ask", "id": "a", "conversation": cid, "text": "which model?"},
    ))
    assert (await wire.until("a"))[-1]["type"] == "done"
    assert router.requests[-1]["model"] == "fake-vision"
    assert [e["type"] for e in wire.events if e.get("id") == "s"] == ["settings"]


async def test_settings_then_ask_back_to_back_offers_the_kb_tool(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    notes = tmp_path / "notes.md"
    notes.write_text("The lighthouse keeper feeds the cat at dawn.\n")
    cid = await new_conversation(wire)
    assert (await wire.until(await wire.send({"type": "kb_add", "kb": "notes", "paths": [str(notes)]}), ("kb", "error")))[-1]["type"] == "kb"
    await wire.request({"type": "kb_link", "kb": "notes", "conversation": cid})
    await wire.request({"type": "settings", "conversation": cid, "kb_injection": "off"})
    await wire.send_raw(lines(
        {"type": "settings", "id": "s", "conversation": cid, "kb_injection": "tool_only"},
        {"type": "ask", "id": "a", "conversation": cid, "text": "who feeds the cat?"},
    ))
    assert (await wire.until("a"))[-1]["type"] == "done"
    offered = [t["function"]["name"] for t in router.requests[-1].get("tools") or []]
    assert "kb_search" in offered


async def test_cancel_then_ask_back_to_back_is_not_busy(wire: Wire, router: FakeRouter) -> None:
    router.script(Reply(chunks=["never ", "ends"], hang=True))
    first = await wire.send({"type": "ask", "text": "long story"})
    cid = (await wire.until_reply(first, "never ends"))[0]["conversation"]
    await wire.send_raw(lines(
        {"type": "cancel", "id": "c", "conversation": cid},
        {"type": "ask", "id": "a", "conversation": cid, "text": "short one"},
    ))
    events = await wire.until("a")
    assert events[-1]["type"] == "done" and events[0]["turn"] == 2
    # the cancel was answered once the turn it stopped had ended
    order = [(e["id"], e["type"]) for e in wire.events if e["type"] in ("done", "cancelled")]
    assert order.index((first, "done")) < order.index(("c", "cancelled"))
    assert [e for e in wire.events if e.get("id") == "c"][0]["turn"] == 1


async def test_kb_add_then_kb_link_back_to_back_finds_the_new_kb(wire: Wire, tmp_path: Path) -> None:
    notes = tmp_path / "notes.md"
    notes.write_text("Bread rises when the yeast is warm.\n")
    await wire.send_raw(lines(
        {"type": "kb_add", "id": "add", "kb": "baking", "paths": [str(notes)]},
        {"type": "kb_link", "id": "link", "kb": "baking"},
    ))
    linked = (await wire.until("link", ("kb", "error")))[-1]
    assert linked["type"] == "kb" and linked["linked_all"] is True


async def test_kb_link_then_kb_remove_then_kb_list_back_to_back_lists_none(wire: Wire, tmp_path: Path) -> None:
    # no add of the KB under way: each change is answered before any later line starts
    notes = tmp_path / "notes.md"
    notes.write_text("Bread rises when the yeast is warm.\n")
    added = (await wire.until(await wire.send({"type": "kb_add", "kb": "baking", "paths": [str(notes)]}), ("kb",)))
    assert added[-1]["type"] == "kb"
    await wire.send_raw(lines(
        {"type": "kb_link", "id": "link", "kb": "baking"},
        {"type": "kb_remove", "id": "remove", "kb": "baking"},
        {"type": "kb_list", "id": "list"},
    ))
    answers: dict[str, dict[str, Any]] = {}
    while len(answers) < 3:  # in the order they come
        event = await wire.read()
        if event.get("id") in ("link", "remove", "list"):
            answers[event["id"]] = event
    assert list(answers) == ["link", "remove", "list"]
    assert answers["list"]["type"] == "kbs" and answers["list"]["items"] == []


async def test_delete_then_ask_back_to_back_finds_no_conversation(wire: Wire, router: FakeRouter) -> None:
    cid = await new_conversation(wire)
    await wire.send_raw(lines(
        {"type": "delete", "id": "d", "conversation": cid},
        {"type": "ask", "id": "a", "conversation": cid, "text": "still there?"},
    ))
    assert (await wire.until("a"))[-1]["code"] == "not_found"
    assert len(router.requests) == 1


# -- errors of an ask name its conversation and turn ------------------------------------------


@pytest.mark.parametrize(
    "fields, conversation, turn",
    [
        ({"text": 5}, "cid", 2),
        ({"text": "hi", "files": "/etc/passwd"}, "cid", 2),
        ({"text": "hi", "model": 7}, "cid", 2),
        ({"text": 5}, None, 1),
        ({"text": "hi", "conversation": "1"}, None, None),
        ({"text": 5, "conversation": 4242}, 4242, None),
    ],
)
async def test_a_mistyped_ask_names_its_conversation_and_turn(
    wire: Wire, fields: dict[str, Any], conversation: str | int | None, turn: int | None
) -> None:
    cid = await new_conversation(wire)
    if conversation == "cid":
        fields, conversation = {**fields, "conversation": cid}, cid
    error = (await wire.until(await wire.send({"type": "ask", **fields})))[-1]
    assert error["code"] == "bad_request"
    assert (error["conversation"], error["turn"]) == (conversation, turn)


async def test_busy_names_no_turn_so_the_running_one_is_not_failed(wire: Wire, router: FakeRouter) -> None:
    router.script(Reply(chunks=["working"], hang=True))
    first = await wire.send({"type": "ask", "text": "slow"})
    cid = (await wire.until_reply(first, "working"))[0]["conversation"]
    busy = (await wire.ask("again", conversation=cid))[-1]
    assert (busy["code"], busy["conversation"], busy["turn"]) == ("busy", cid, None)
    await wire.request({"type": "cancel", "conversation": cid})


async def test_shutting_down_names_the_turn_it_would_have_been(config: Config, router: FakeRouter) -> None:
    running = RunningDaemon(dataclasses.replace(config, shutdown_grace=60.0))
    await running.start()
    wire = await running.connect()
    try:
        cid = await new_conversation(wire)
        router.script(Reply(chunks=["holding"], hang=True))
        holder = await wire.send({"type": "ask", "text": "hold the daemon open"})
        held = (await wire.until_reply(holder, "holding"))[0]["conversation"]
        assert running.server is not None and running.server.engine is not None
        running.server.request_stop()
        while running.server.engine.accepting:
            await asyncio.sleep(0.01)
        refused = (await wire.ask("one more", conversation=cid))[-1]
        assert (refused["code"], refused["conversation"], refused["turn"]) == ("shutting_down", cid, 2)
        await wire.request({"type": "cancel", "conversation": held})  # lets the shutdown finish
    finally:
        await wire.close()
        await running.stop()


@pytest.mark.parametrize("existing", [True, False])
async def test_a_stop_while_the_question_is_stored_keeps_the_turn_and_says_so(
    config: Config, router: FakeRouter, monkeypatch: pytest.MonkeyPatch, existing: bool
) -> None:
    running = RunningDaemon(dataclasses.replace(config, shutdown_grace=0.2))
    await running.start()
    wire = await running.connect()
    cid = await new_conversation(wire) if existing else None
    entered = threading.Event()
    begin_turn = HistoryStore.begin_turn

    def slowly(store: HistoryStore, *args: Any, **kwargs: Any) -> Any:
        entered.set()
        time.sleep(1.0)  # a busy history thread: the stop comes while the question is on its way
        return begin_turn(store, *args, **kwargs)

    monkeypatch.setattr(HistoryStore, "begin_turn", slowly)
    try:
        rid = await wire.send({"type": "ask", "text": "stored?", **({"conversation": cid} if cid else {})})
        await asyncio.to_thread(entered.wait, 30)
        await running.stop()
        events = await wire.until(rid)
    finally:
        await wire.close()
    # the question is stored: the client is told of its turn, ended as interrupted, as stored
    assert [e["type"] for e in events] == ["user", "done"] and events[-1]["finish_reason"] == "interrupted"
    with contextlib.closing(sqlite3.connect(config.db_path)) as db:
        rows = db.execute("SELECT conversation_id, turn, status FROM turns WHERE text = 'stored?'").fetchall()
    assert rows == [(events[-1]["conversation"], events[-1]["turn"], "interrupted")]


async def test_requests_cut_short_by_a_stop_are_told_so(config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    from daemon import server

    monkeypatch.setattr(server, "REQUEST_GRACE", 0.01)  # what the settings request is given before it is cut
    with FakeRouter(models=[FakeModel("a"), FakeModel("b")], models_format="bare") as fake:
        running = RunningDaemon(dataclasses.replace(config, router_url=fake.url, shutdown_grace=0.2))
        await running.start()
        wire = await running.connect()
        try:
            cid = await new_conversation(wire)
            fake.props_delay = 30.0  # the settings wait for the new model's size; the ask waits for them
            await wire.send_raw(lines(
                {"type": "settings", "id": "s", "conversation": cid, "model": "b"},
                {"type": "ask", "id": "a", "text": "q", "conversation": cid},
            ))
            async with asyncio.timeout(30):
                while fake.hits["/props"] < 2:
                    await asyncio.sleep(0.02)
            assert running.server is not None
            running.server.request_stop()
            settings = (await wire.until("s", ("error",)))[-1]
            asked = (await wire.until("a", ("error",)))[-1]
        finally:
            await wire.close()
            await running.stop()
    assert settings["code"] == "shutting_down"
    assert (asked["code"], asked["conversation"], asked["turn"]) == ("shutting_down", cid, None)


# -- fields mean what the document says ----------------------------------------------------------


async def test_a_turn_cancelled_before_the_model_keeps_ctx_used(wire: Wire, router: FakeRouter) -> None:
    router.script(Reply(chunks=["hi"], usage={"prompt_tokens": 40, "completion_tokens": 3}))
    cid = await new_conversation(wire)
    await wire.send_raw(lines(
        {"type": "ask", "id": "a", "conversation": cid, "text": "never sent"},
        {"type": "cancel", "id": "c", "conversation": cid},
    ))
    done = (await wire.until("a"))[-1]
    assert (done["finish_reason"], done["ctx_used"]) == ("cancelled", 43)
    assert (await wire.request({"type": "open", "conversation": cid}))["ctx_used"] == 43
    assert (await wire.until("c", ("cancelled",)))[-1]["turn"] == 2  # stored, then stopped


async def test_open_shows_the_usage_of_a_failed_turn_as_an_object(wire: Wire, router: FakeRouter) -> None:
    router.script(Reply(status=500, error="boom"))
    cid = (await wire.ask("fail"))[0]["conversation"]
    [turn] = (await wire.request({"type": "open", "conversation": cid}))["turns"]
    assert turn["status"] == "error"
    assert turn["usage"] == {"prompt_tokens": None, "completion_tokens": None}


async def test_status_names_the_default_model_while_the_router_is_down(wire: Wire, router: FakeRouter) -> None:
    assert (await wire.request({"type": "status"}))["model"] == "fake-text"
    router.stop()
    status = await wire.request({"type": "status"})
    assert (status["router_reachable"], status["model"], status["ctx_max"]) == (False, "fake-text", None)


async def test_search_total_counts_the_hits_sent_and_more_says_there_are_others(wire: Wire) -> None:
    for n in range(3):
        await wire.ask(f"walrus number {n}")
    capped = await wire.request({"type": "search", "query": "walrus", "limit": 2})
    assert (capped["total"], capped["more"]) == (2, True)
    assert sum(len(c["hits"]) for c in capped["conversations"]) == 2
    whole = await wire.request({"type": "search", "query": "walrus", "limit": 50})
    assert whole["more"] is False and whole["total"] == sum(len(c["hits"]) for c in whole["conversations"]) >= 3


async def test_kb_truncated_is_a_boolean_like_a_chips(wire: Wire, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("apples are red\n")
    kb = (await wire.until(await wire.send({"type": "kb_add", "kb": "fruit", "paths": [str(tmp_path / "a.txt")]}),
                           ("kb", "error")))[-1]
    assert kb["truncated"] is False and kb["truncated_documents"] == []


async def test_kb_progress_says_why_nothing_was_added(wire: Wire, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("apples are red\n")
    await wire.until(await wire.send({"type": "kb_add", "kb": "fruit", "paths": [str(tmp_path / "a.txt")]}),
                     ("kb", "error"))
    await wire.request({"type": "kb_link", "kb": "fruit"})
    events = await wire.ask("tell me about submarines")
    kb = [e for e in of_type(events, "progress") if e["stage"] == "kb"]
    assert [e["detail"] for e in kb] == ["no knowledge-base passage matched the question"]


async def test_what_the_schema_takes_the_daemon_takes(wire: Wire) -> None:
    cid = await new_conversation(wire)
    # an integer written with a zero fraction is one to JSON Schema, and so to the daemon
    listed = await wire.request({"type": "conversations", "limit": 50.0})
    assert listed["type"] == "conversations" and [c["conversation"] for c in listed["items"]] == [cid]
    assert (await wire.request({"type": "open", "conversation": float(cid)}))["type"] == "conversation"
    # an id is measured as compact JSON: this one is 231 characters so, 310 with spaces
    rid = list(range(80))
    assert (await wire.request({"type": "status", "id": rid}))["id"] == rid
    # a KB name with whitespace around it is the name, as the schema's pattern says
    refused = await wire.request({"type": "cancel", "kb": "\tnotes ", "conversation": None})
    assert refused["code"] == "not_found" and "'notes'" in refused["message"]  # taken, and no such KB


async def test_a_before_in_other_digits_is_no_updated_at(wire: Wire) -> None:
    before = "٢٠٢٦-١١-٢٩T٢٠:٠٤:٣٠.٤٥٤٧٥٣Z"  # Arabic-Indic digits: not what updated_at is
    refused = await wire.request({"type": "conversations", "before": before})
    assert refused["code"] == "bad_request"


@pytest.mark.parametrize("rid", [None, 0, "", False])
async def test_every_id_is_echoed_null_included(wire: Wire, rid: Any) -> None:
    assert (await wire.request({"type": "status", "id": rid}))["id"] == rid
    error = await wire.request({"type": "open", "id": rid})  # refused: its field is missing
    assert error["code"] == "bad_request" and "id" in error and error["id"] == rid


@pytest.mark.parametrize(
    "request_, words",
    [
        ({"type": "kb_add", "kb": "empty", "paths": []}, "at least one file or folder"),
        ({"type": "conversations", "before": "yesterday"}, "'before' must be an updated_at"),
        ({"type": "settings", "conversation": 1, "title": "  "}, "'title' needs some text"),
    ],
)
async def test_requests_that_would_do_nothing_useful_are_refused(
    wire: Wire, request_: dict[str, Any], words: str
) -> None:
    await new_conversation(wire)
    error = await wire.request(request_)
    assert error["code"] == "bad_request" and words in error["message"]
    assert (await wire.request({"type": "kb_list"}))["items"] == []
    assert (await wire.request({"type": "conversations"}))["items"][0]["title"] == "hello"


async def test_the_documents_example_error_is_what_the_daemon_sends(wire: Wire) -> None:
    text = (ROOT / "docs" / "PROTOCOL.md").read_text()
    example = re.search(r"^> hello\n(.*)$", text, re.MULTILINE)
    assert example is not None
    await wire.send_raw(b"hello\n")
    assert await wire.read() == json.loads(example.group(1))


async def test_a_line_of_exactly_one_mib_is_read_and_the_refusal_says_so(wire: Wire) -> None:
    head = b'{"type":"status","id":"edge","pad":"'
    line = head + b"p" * (MAX_LINE_BYTES - len(head) - 2) + b'"}'
    assert len(line) == MAX_LINE_BYTES
    await wire.send_raw(line + b"\n")
    assert (await wire.read())["type"] == "status"
    await wire.send_raw(line + b" \n")
    refused = await wire.read()
    assert refused["code"] == "line_too_long"
    assert f"at most {MAX_LINE_BYTES} bytes" in refused["message"]


async def test_extracting_names_the_turn_the_question_will_be(wire: Wire, tmp_path: Path) -> None:
    note = tmp_path / "note.txt"
    note.write_text("a note\n")
    first = await wire.ask("read this", files=[str(note)])
    extracting = of_type(first, "progress")[0]
    assert (extracting["stage"], extracting["conversation"], extracting["turn"]) == ("extracting", None, 1)
    cid = of_type(first, "user")[0]["conversation"]
    again = of_type(await wire.ask("and again", files=[str(note)], conversation=cid), "progress")[0]
    assert (again["stage"], again["conversation"], again["turn"]) == ("extracting", cid, 2)


async def test_too_many_files_reads_the_same_for_ask_and_estimate(wire: Wire, tmp_path: Path) -> None:
    paths = []
    for n in range(9):
        (tmp_path / f"{n}.txt").write_text("x")
        paths.append(str(tmp_path / f"{n}.txt"))
    asked = (await wire.ask("many", files=paths))[-1]
    estimated = await wire.request({"type": "estimate", "files": paths})
    assert asked["code"] == estimated["code"] == "too_many_files"
    assert asked["message"] == estimated["message"]


async def test_kb_link_to_a_missing_conversation_says_where_to_look(wire: Wire, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("apples\n")
    await wire.until(await wire.send({"type": "kb_add", "kb": "fruit", "paths": [str(tmp_path / "a.txt")]}),
                     ("kb", "error"))
    error = await wire.request({"type": "kb_link", "kb": "fruit", "conversation": 4242})
    assert error["code"] == "not_found" and "conversations request" in error["message"]


# -- the schema itself ---------------------------------------------------------------------------


async def test_the_schema_covers_every_request_type_and_error_code() -> None:
    defs = contract.schema()["$defs"]
    for kind in REQUESTS:
        assert f"request.{kind}" in defs and f"answers.{kind}" in defs, kind
    codes = {cls.code for cls in vars(errors).values()
             if isinstance(cls, type) and issubclass(cls, errors.AssistantError)} - {"error", "startup"}
    assert set(defs["error_code"]["enum"]) == codes | {"forbidden"}


async def test_the_hook_fails_an_event_the_schema_does_not_list() -> None:
    contract.check_event({"type": "delta", "conversation": 1, "turn": 1, "text": "x"}, "ask")
    with pytest.raises(AssertionError, match="schema"):
        contract.check_event({"type": "delta", "conversation": 1, "turn": 1, "text": "x", "extra": 1}, "ask")
    with pytest.raises(AssertionError, match="schema"):  # an ask's error must name its turn
        contract.check_event({"type": "error", "code": "busy", "message": "m"}, "ask")
    assert not contract.check_request({"type": "ask", "text": "   "})
    assert contract.check_request({"type": "ask", "text": "hi", "colour": "blue"})  # unknown fields are ignored


async def test_the_schema_parses_strictly_with_no_key_twice_in_an_object() -> None:
    # a strict parser (as a client's may be) refuses an object with a key twice: the suite reads
    # the schema so, and so must every client's
    with pytest.raises(ValueError, match="duplicate key"):
        contract.strict_json('{"description": "a", "oneOf": [], "description": "b"}')
    assert contract.strict_json('{"a": {"description": "x"}, "b": {"description": "y"}}')
    assert "request.cancel" in contract.strict_json(contract.SCHEMA_PATH.read_text())["$defs"]


async def test_the_documents_example_events_keep_to_the_schema() -> None:
    # every event line of docs/PROTOCOL.md's examples is what a client author copies from
    text = (ROOT / "docs" / "PROTOCOL.md").read_text()
    lines = [line for line in text.splitlines() if line.startswith('{"type":')]
    assert len(lines) > 10
    for line in lines:
        contract.check_event(contract.strict_json(line))


@pytest.mark.parametrize("event", [
    {"type": "changed", "seq": 1, "kind": "turn", "action": "ended", "conversation": 1, "turn": 1},  # bare
    {"type": "changed", "seq": 1, "kind": "conversation", "action": "deleted", "conversation": 1, "title": "x"},
    {"type": "changed", "seq": 1, "kind": "kb", "action": "removed", "kb": "k", "documents": 1},
    {"type": "user", "conversation": 1, "turn": 1, "text": "", "ref": None,  # a PDF chip with a thumbnail
     "files": [{"name": "a.pdf", "kind": "pdf", "pages": 1, "truncated": False, "thumbnail": None}]},
    {"type": "user", "conversation": 1, "turn": 1, "text": "", "ref": None,  # a text chip with pages
     "files": [{"name": "a.txt", "kind": "text", "pages": 1, "truncated": False}]},
])
async def test_the_schema_holds_each_change_to_its_own_fields(event: dict[str, Any]) -> None:
    """Each changed kind and action requires its own fields and takes no other (issue 46)."""
    with pytest.raises(AssertionError, match="breaks docs/protocol.schema.json"):
        contract.check_event(event, "event")
