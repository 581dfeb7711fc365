"""The socket protocol through the real daemon: framing, validation, every request type."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sqlite3
import threading
import time

import pytest

from client import Wire, of_type, reply_text
from core import Config
from daemon import connection
from daemon.connection import read_lines
from daemon.protocol import encode_event
from history import HistoryStore, NewTurn, TurnOutcome
from selfcheck.fakerouter import FakeModel, FakeRouter, Reply
from tests.conftest import RunningDaemon, serving

pytestmark = pytest.mark.asyncio


async def test_status_answers_with_the_request_id(wire: Wire, router: FakeRouter) -> None:
    event = await wire.request({"type": "status", "id": {"any": ["json", 1]}})
    assert event["type"] == "status"
    assert event["id"] == {"any": ["json", 1]}
    assert event["router_url"] == router.url
    assert event["router_reachable"] is True
    assert event["model"] == "fake-text"
    assert event["turns_running"] == 0


async def test_not_json_gets_an_error_and_the_connection_lives(wire: Wire) -> None:
    await wire.send_raw(b"this is not json\n")
    event = await wire.read()
    assert event["type"] == "error"
    assert event["code"] == "bad_request"
    assert "JSON" in event["message"]
    assert (await wire.request({"type": "status"}))["type"] == "status"


async def test_a_json_value_that_is_not_an_object_is_refused(wire: Wire) -> None:
    await wire.send_raw(b"[1, 2]\n")
    event = await wire.read()
    assert event["code"] == "bad_request"


async def test_line_over_one_mib_is_refused_and_skipped(wire: Wire) -> None:
    huge = json.dumps({"type": "ask", "text": "x" * (1 << 20) + "y"}).encode()
    await wire.send_raw(huge[: len(huge) // 2])
    await wire.send_raw(huge[len(huge) // 2 :] + b"\n")
    event = await wire.read()
    assert event["type"] == "error"
    assert event["code"] == "line_too_long"
    # the rest of the long line was skipped, not parsed as a request
    status = await wire.request({"type": "status"})
    assert status["type"] == "status"
    assert wire.events == [event]


async def test_line_just_under_the_limit_is_parsed(wire: Wire) -> None:
    padding = "p" * ((1 << 20) - 100)
    rid = await wire.send({"type": "status", "pad": padding})
    events = await wire.until(rid, ("status", "error"))
    assert events[-1]["type"] == "status"


async def test_unknown_type_names_the_known_ones(wire: Wire) -> None:
    event = await wire.request({"type": "fly", "id": 7})
    assert event["code"] == "unknown_type"
    assert event["id"] == 7
    assert "ask" in event["message"]


async def test_missing_type_is_a_bad_request(wire: Wire) -> None:
    event = await wire.request({"id": 3, "text": "hello"})
    assert event["code"] == "bad_request"
    assert event["id"] == 3


@pytest.mark.parametrize(
    "request_, field",
    [
        ({"type": "ask", "text": 5}, "text"),
        ({"type": "ask", "text": "hi", "conversation": "1"}, "conversation"),
        ({"type": "ask", "text": "hi", "conversation": True}, "conversation"),
        ({"type": "ask", "text": "hi", "files": "/etc/passwd"}, "files"),
        ({"type": "open"}, "conversation"),
        ({"type": "conversations", "limit": 0}, "limit"),
        ({"type": "settings", "conversation": 1, "kb_injection": "sometimes"}, "kb_injection"),
    ],
)
async def test_wrongly_typed_fields_are_named(wire: Wire, request_: dict, field: str) -> None:
    event = await wire.request(request_)
    assert event["type"] == "error"
    assert event["code"] == "bad_request"
    assert repr(field) in event["message"]


async def test_unknown_fields_are_ignored(wire: Wire) -> None:
    event = await wire.request({"type": "status", "colour": "blue"})
    assert event["type"] == "status"


async def test_ask_streams_and_is_stored(wire: Wire, router: FakeRouter) -> None:
    router.script(Reply(chunks=["Hel", "lo ", "there"], usage={"prompt_tokens": 21, "completion_tokens": 3}))
    events = await wire.ask("hi", id="a1")
    kinds = [e["type"] for e in events]
    assert kinds[0] == "user"
    assert kinds[-1] == "done"
    assert all(e["id"] == "a1" for e in events)
    user = events[0]
    assert user["text"] == "hi" and user["files"] == [] and user["turn"] == 1
    assert reply_text(events) == "Hello there"
    done = events[-1]
    assert done["text"] == "Hello there"
    assert done["finish_reason"] == "stop"
    assert done["usage"] == {"prompt_tokens": 21, "completion_tokens": 3}
    assert done["ctx_used"] == 24
    assert done["ctx_max"] == 4096
    assert done["conversation"] == user["conversation"]
    sent = router.requests[-1]
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["messages"][-1] == {"role": "user", "content": "hi"}
    assert sent["messages"][0]["role"] == "system"

    opened = await wire.request({"type": "open", "conversation": user["conversation"]})
    assert opened["type"] == "conversation"
    assert opened["ctx_used"] == 24
    [turn] = opened["turns"]
    assert turn["text"] == "hi" and turn["reply"] == "Hello there" and turn["status"] == "complete"
    assert turn["turn"] == 1 and turn["tools"] == [] and turn["files"] == []


async def test_open_encodes_the_turns_off_the_event_loop_into_the_same_line(
    wire: Wire, router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    from history.records import Turn

    router.script(Reply(chunks=["Grüße, ", "東京 🌸"]), Reply(chunks=["second"]))
    cid = (await wire.ask("première question"))[0]["conversation"]
    await wire.ask("and then?", conversation=cid)
    threads = []
    to_json = Turn.to_json

    def recorded(turn: Turn) -> dict[str, object]:
        threads.append(threading.get_ident())
        return to_json(turn)

    monkeypatch.setattr(Turn, "to_json", recorded)
    await wire.send({"type": "open", "conversation": cid, "id": "o1"})
    line = await wire.reader.readline()
    # a long conversation's turns held the loop while they were encoded (bench/bench_open.py)
    assert len(threads) == 2 and threading.get_ident() not in threads
    # the line is the one encoding the whole event gives: the turns in their place, before the id
    event = json.loads(line)
    assert line == encode_event(event) and list(event)[-2:] == ["turns", "id"]
    assert [t["reply"] for t in event["turns"]] == ["Grüße, 東京 🌸", "second"]
    assert "Grüße, 東京 🌸".encode() in line  # UTF-8, not escaped


async def test_a_later_barrier_is_answered_after_an_open_still_encoding(
    wire: Wire, router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    from daemon import handlers

    cid = (await wire.ask("remember this"))[0]["conversation"]
    encode_list = handlers.encode_list

    def slowly(items: object) -> object:  # a long conversation's turns take a while to encode
        time.sleep(0.3)
        return encode_list(items)  # type: ignore[arg-type]

    monkeypatch.setattr(handlers, "encode_list", slowly)
    lines = [{"type": "open", "conversation": cid, "id": "o"},
             {"type": "settings", "conversation": cid, "title": "renamed", "id": "s"},
             {"type": "delete", "conversation": cid, "id": "d"}]
    await wire.send_raw(b"".join(json.dumps(line).encode() + b"\n" for line in lines))  # back to back
    got = [await wire.read() for _ in lines]
    # in the order sent: the open shows the conversation as it was before the lines after it
    assert [(e["id"], e["type"]) for e in got] == [("o", "conversation"), ("s", "settings"), ("d", "deleted")]
    assert got[0]["title"] != "renamed"


async def test_open_says_running_of_the_turn_it_shows_running(
    daemon: RunningDaemon, wire: Wire, router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    from daemon import handlers

    cid = (await wire.ask("first"))[0]["conversation"]
    router.script(Reply(chunks=["slow ", "reply"], delay=0.15))
    rid = await wire.send({"type": "ask", "text": "second", "conversation": cid})
    await wire.until(rid, ("user",))  # stored, running
    encode_list = handlers.encode_list

    def slowly(items: object) -> object:  # the turn ends while the open encodes its turns
        time.sleep(0.6)
        return encode_list(items)  # type: ignore[arg-type]

    monkeypatch.setattr(handlers, "encode_list", slowly)
    other = await daemon.connect()
    opened = await other.request({"type": "open", "conversation": cid})
    await other.close()
    assert (await wire.until(rid))[-1]["type"] == "done"
    shown = [t["turn"] for t in opened["turns"] if t["status"] == "running"]
    assert shown == [2] and opened["running"] == 2  # one snapshot: the turn as read, and running


async def test_open_of_one_turn(wire: Wire, router: FakeRouter) -> None:
    cid = (await wire.ask("first"))[0]["conversation"]
    rest = threading.Event()  # the second turn runs until the opens are done
    router.script(Reply(chunks=["slow ", "reply"], hold=rest))
    rid = await wire.send({"type": "ask", "text": "second", "conversation": cid})
    await wire.until(rid, ("user",))
    whole = await wire.request({"type": "open", "conversation": cid})
    first = await wire.request({"type": "open", "conversation": cid, "turn": 1})
    assert first["turns"] == whole["turns"][:1] and first["running"] is None
    assert {k: v for k, v in first.items() if k not in ("turns", "running", "id")} == {
        k: v for k, v in whole.items() if k not in ("turns", "running", "id")}
    second = await wire.request({"type": "open", "conversation": cid, "turn": 2})
    assert [t["status"] for t in second["turns"]] == ["running"] and second["running"] == 2
    missing = await wire.request({"type": "open", "conversation": cid, "turn": 3})
    assert (missing["code"], missing["message"]) == ("not_found", f"conversation {cid} has no turn 3; it has 2")
    bad = await wire.request({"type": "open", "conversation": cid, "turn": 0})
    assert bad["code"] == "bad_request" and "'turn'" in bad["message"]
    rest.set()
    assert (await wire.until(rid))[-1]["type"] == "done"


async def test_reasoning_streams_separately(wire: Wire, router: FakeRouter) -> None:
    router.script(Reply(reasoning=["think ", "hard"], chunks=["answer"]))
    events = await wire.ask("why?")
    assert "".join(e["text"] for e in of_type(events, "reasoning")) == "think hard"
    assert reply_text(events) == "answer"


async def test_continued_conversation_sends_history(wire: Wire, router: FakeRouter) -> None:
    first = await wire.ask("one")
    cid = first[0]["conversation"]
    second = await wire.ask("two", conversation=cid)
    assert second[0]["turn"] == 2 and second[0]["conversation"] == cid
    sent = router.requests[-1]["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[1]["content"] == "one"
    assert sent[2]["content"] == "You said: one"
    assert sent[3]["content"] == "two"


async def test_ask_refuses_empty_text(wire: Wire, router: FakeRouter) -> None:
    events = await wire.ask("   ")
    assert events[-1]["code"] == "bad_request"
    assert router.requests == []


async def test_ask_on_a_missing_conversation(wire: Wire) -> None:
    events = await wire.ask("hi", conversation=999)
    assert events[-1]["code"] == "not_found"
    assert events[-1]["conversation"] == 999 and events[-1]["turn"] is None


async def test_ask_with_an_unknown_model_names_the_models(wire: Wire, router: FakeRouter) -> None:
    events = await wire.ask("hi", model="gpt-17")
    assert events[-1]["code"] == "not_found"
    assert "fake-text" in events[-1]["message"]
    assert router.requests == []


async def test_ask_uses_the_requested_model(wire: Wire, router: FakeRouter) -> None:
    events = await wire.ask("hi", model="fake-vision")
    assert events[-1]["ctx_max"] == 8192
    assert router.requests[-1]["model"] == "fake-vision"


async def test_a_model_named_on_an_ask_beats_the_conversations_own(wire: Wire, router: FakeRouter) -> None:
    cid = (await wire.ask("hi", model="fake-vision"))[0]["conversation"]  # its own model from now on
    events = await wire.ask("and in a smaller one?", conversation=cid, model="fake-text")
    assert events[-1]["ctx_max"] == 4096 and router.requests[-1]["model"] == "fake-text"
    events = await wire.ask("and again", conversation=cid)  # the ask names none: its own
    assert events[-1]["ctx_max"] == 8192 and router.requests[-1]["model"] == "fake-vision"


async def test_several_requests_in_flight_on_one_connection(wire: Wire, router: FakeRouter) -> None:
    router.script(Reply(chunks=["slow ", "part"], hang=True))
    slow = await wire.send({"type": "ask", "text": "slow one"})
    started = await wire.until_reply(slow, "slow part")
    cid = started[0]["conversation"]
    # while the first turn is still streaming, a second conversation and a status both answer
    fast = await wire.ask("fast one")
    assert fast[-1]["type"] == "done"
    status = await wire.request({"type": "status"})
    assert status["turns_running"] == 1
    busy = await wire.ask("again", conversation=cid)
    assert busy[-1]["code"] == "busy"
    assert busy[-1]["conversation"] == cid
    cancelled = await wire.request({"type": "cancel", "conversation": cid})
    assert cancelled == {"type": "cancelled", "conversation": cid, "turn": 1, "id": cancelled["id"]}
    events = await wire.until(slow)
    assert events[-1]["type"] == "done"
    assert events[-1]["finish_reason"] == "cancelled"
    assert events[-1]["text"] == "slow part"


async def test_cancel_keeps_the_partial_reply(wire: Wire, router: FakeRouter) -> None:
    router.script(Reply(chunks=["partial ", "words"], hang=True))
    rid = await wire.send({"type": "ask", "text": "tell me"})
    events = await wire.until_reply(rid, "partial words")
    cid = events[0]["conversation"]
    await wire.request({"type": "cancel", "conversation": cid})
    done = (await wire.until(rid))[-1]
    assert done["finish_reason"] == "cancelled"
    # the router saw the stream closed: generation stops there
    async with asyncio.timeout(60):  # only stops a hang
        while not router.disconnects:
            await asyncio.sleep(0.05)
    assert router.disconnects == 1
    turn = (await wire.request({"type": "open", "conversation": cid}))["turns"][0]
    assert turn["status"] == "cancelled"
    assert turn["reply"] == "partial words"
    # the next question sees the partial answer as history
    await wire.ask("go on", conversation=cid)
    assert router.requests[-1]["messages"][2] == {"role": "assistant", "content": "partial words"}


async def test_cancel_when_nothing_runs(wire: Wire) -> None:
    cid = (await wire.ask("hi"))[0]["conversation"]
    event = await wire.request({"type": "cancel", "conversation": cid})
    assert event["type"] == "cancelled" and event["turn"] is None
    missing = await wire.request({"type": "cancel", "conversation": 4242})
    assert missing["code"] == "not_found"


async def test_router_unreachable_keeps_the_question(daemon: RunningDaemon, router: FakeRouter) -> None:
    wire = await daemon.connect()
    router.stop()
    try:
        events = await wire.ask("are you there?")
        assert [e["type"] for e in events] == ["user", "error"]
        error = events[-1]
        assert error["code"] == "router_unreachable"
        assert router.url in error["message"]
        assert error["turn"] == 1
        opened = await wire.request({"type": "open", "conversation": error["conversation"]})
        [turn] = opened["turns"]
        assert turn["text"] == "are you there?"
        assert turn["status"] == "error"
        assert turn["reply"] == ""
        assert "router" in turn["error"] or router.url in turn["error"]
    finally:
        await wire.close()


async def test_waiting_is_said_once_the_request_has_left(wire: Wire, router: FakeRouter) -> None:
    router.script(Reply(text="one", delay=0.05))
    first = await wire.ask("first")
    kinds = [e["type"] if e["type"] != "progress" else e["stage"] for e in first]
    assert kinds.index("waiting") < kinds.index("delta") and kinds.count("waiting") == 1
    router.stop()  # the model list is cached: the next turn gets as far as sending its request
    second = await wire.ask("second", conversation=first[0]["conversation"])
    assert [e["type"] for e in second] == ["user", "error"]  # nothing was waited for
    assert second[-1]["code"] == "router_unreachable"


async def test_router_error_carries_the_servers_message(wire: Wire, router: FakeRouter) -> None:
    router.script(Reply(status=500, error="model failed to load: out of memory"))
    events = await wire.ask("hi")
    assert events[0]["type"] == "user"
    assert events[-1]["code"] == "router_error"
    assert "model failed to load: out of memory" in events[-1]["message"]
    turn = (await wire.request({"type": "open", "conversation": events[0]["conversation"]}))["turns"][0]
    assert turn["status"] == "error" and turn["text"] == "hi"


async def test_a_reply_with_lone_surrogates_is_streamed_and_stored(wire: Wire, router: FakeRouter) -> None:
    # a server that cuts an emoji between its UTF-16 halves sends each as an escape of its own
    router.script(Reply(chunks=["Hello \ud83d", "\ude00 world"]))
    events = await wire.ask("hi")
    assert events[-1]["type"] == "done", events[-1]
    deltas = "".join(e["text"] for e in events if e["type"] == "delta")
    assert deltas == events[-1]["text"] == "Hello \ufffd\ufffd world"
    turn = (await wire.request({"type": "open", "conversation": events[0]["conversation"]}))["turns"][0]
    assert turn["status"] == "complete" and turn["reply"] == "Hello \ufffd\ufffd world"


async def test_a_reply_another_program_keeps_from_the_database_is_kept_and_saved_later(
    config: Config, router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    from history import connection as history_connection

    pragmas = tuple(p.replace("busy_timeout = 5000", "busy_timeout = 200") for p in history_connection.CONNECTION_PRAGMAS)
    monkeypatch.setattr(history_connection, "CONNECTION_PRAGMAS", pragmas)  # a lock is waited on 0.2 s
    running = RunningDaemon(config)
    await running.start()
    wire = await running.connect()
    try:
        rest = threading.Event()
        router.script(Reply(chunks=["partial ", "words"], hold=rest))
        rid = await wire.send({"type": "ask", "text": "tell me"})
        cid = (await wire.until_reply(rid, "partial "))[0]["conversation"]
        # the sqlite3 tool in a write transaction, while the reply ends
        other = sqlite3.connect(config.db_path, timeout=0.1, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        rest.set()
        try:
            end = (await wire.until(rid))[-1]
            # the reply is done (its usage and ctx_used with it), and not saved yet
            assert end["type"] == "done" and end["saved"] is False and end["text"] == "partial words", end
            assert "the history database cannot be written now (database is locked)" in end["note"]
            opened = await wire.request({"type": "open", "conversation": cid})
            assert opened["running"] is None  # not shown running: the outcome kept in memory is
            assert (opened["turns"][0]["status"], opened["turns"][0]["reply"]) == ("complete", "partial words")
        finally:
            other.execute("ROLLBACK")
            other.close()

        def stored() -> tuple[str, str]:
            with contextlib.closing(sqlite3.connect(config.db_path)) as db:
                return db.execute("SELECT status, reply FROM turns WHERE conversation_id = ?", (cid,)).fetchone()

        async with asyncio.timeout(30):  # written once the lock is gone, unasked
            while stored() != ("complete", "partial words"):
                await asyncio.sleep(0.05)
    finally:
        await wire.close()
        await running.stop()


async def test_router_failing_mid_reply_keeps_the_partial(wire: Wire, router: FakeRouter) -> None:
    router.script(Reply(chunks=["half ", "an ", "answer", "never"], drop_after=3))
    events = await wire.ask("explain")
    assert events[-1]["type"] == "error"
    assert events[-1]["code"] in ("router_error", "router_unreachable")
    assert reply_text(events) == "half an answer"
    turn = (await wire.request({"type": "open", "conversation": events[0]["conversation"]}))["turns"][0]
    assert turn["status"] == "error"
    assert turn["reply"] == "half an answer"
    assert turn["error"]


async def test_failed_turns_are_left_out_of_the_next_prompt(wire: Wire, router: FakeRouter) -> None:
    first = await wire.ask("one")
    cid = first[0]["conversation"]
    router.script(Reply(status=500, error="boom"))
    await wire.ask("two", conversation=cid)
    await wire.ask("three", conversation=cid)
    roles = [m["role"] for m in router.requests[-1]["messages"]]
    assert roles == ["system", "user", "assistant", "user"]  # no orphan "two"


async def test_conversations_list_newest_first_and_paginates(wire: Wire) -> None:
    ids = [(await wire.ask(f"question {i}"))[0]["conversation"] for i in range(3)]
    listed = await wire.request({"type": "conversations"})
    assert [i["conversation"] for i in listed["items"]] == ids[::-1]
    item = listed["items"][0]
    assert item["title"] == "question 2" and item["turns"] == 1 and item["updated_at"]
    page = await wire.request({"type": "conversations", "limit": 1, "before": item["updated_at"]})
    assert [i["conversation"] for i in page["items"]] == [ids[1]]


async def test_delete_hides_a_conversation_everywhere(wire: Wire) -> None:
    cid = (await wire.ask("secret"))[0]["conversation"]
    deleted = await wire.request({"type": "delete", "conversation": cid})
    assert deleted["type"] == "deleted" and deleted["conversation"] == cid
    assert (await wire.request({"type": "open", "conversation": cid}))["code"] == "not_found"
    assert (await wire.request({"type": "conversations"}))["items"] == []
    assert (await wire.ask("more", conversation=cid))[-1]["code"] == "not_found"
    assert (await wire.request({"type": "delete", "conversation": cid}))["code"] == "not_found"


async def test_delete_stops_a_running_turn(wire: Wire, router: FakeRouter) -> None:
    router.script(Reply(chunks=["x"], hang=True))
    rid = await wire.send({"type": "ask", "text": "long"})
    cid = (await wire.until(rid, ("delta",)))[0]["conversation"]
    deleted = await wire.request({"type": "delete", "conversation": cid})
    assert deleted["type"] == "deleted"
    assert (await wire.until(rid))[-1]["finish_reason"] == "cancelled"
    assert (await wire.request({"type": "open", "conversation": cid}))["code"] == "not_found"


async def test_settings_title_and_model(wire: Wire, router: FakeRouter) -> None:
    cid = (await wire.ask("hi"))[0]["conversation"]
    event = await wire.request({"type": "settings", "conversation": cid, "title": "  My chat ", "model": "fake-vision",
                                "kb_injection": "both"})
    assert event["type"] == "settings"
    assert event["title"] == "My chat" and event["model"] == "fake-vision"
    assert event["settings"]["kb_injection"] == "both"
    await wire.ask("again", conversation=cid)
    assert router.requests[-1]["model"] == "fake-vision"
    bad = await wire.request({"type": "settings", "conversation": cid, "model": "nope"})
    assert bad["code"] == "not_found"
    reset = await wire.request({"type": "settings", "conversation": cid, "model": None})
    assert reset["model"] is None and reset["title"] == "My chat"
    opened = await wire.request({"type": "open", "conversation": cid})
    assert opened["title"] == "My chat" and opened["model"] is None
    missing = await wire.request({"type": "settings", "conversation": 999, "title": "x"})
    assert missing["code"] == "not_found"


async def test_models_lists_capabilities_and_default(wire: Wire) -> None:
    event = await wire.request({"type": "models"})
    assert event["default"] == "fake-text"
    by_id = {m["id"]: m for m in event["items"]}
    assert by_id["fake-text"] == {"id": "fake-text", "name": "fake-text", "input_modalities": ["text"], "ctx_max": 4096, "ctx_source": "models",
                                  "image_tokens": 765}
    assert by_id["fake-vision"]["input_modalities"] == ["text", "image"]
    assert by_id["fake-vision"]["ctx_max"] == 8192


async def test_models_asks_the_server_now(wire: Wire, router: FakeRouter) -> None:
    """A model list asked for is the server's as it is now, not the one kept for turns (MODELS_TTL)."""
    assert [m["id"] for m in (await wire.request({"type": "models"}))["items"]] == ["fake-text", "fake-vision"]
    router.models = router.models[:1]
    assert [m["id"] for m in (await wire.request({"type": "models"}))["items"]] == ["fake-text"]
    router.stop()
    assert (await wire.request({"type": "models"}))["code"] == "router_unreachable"


async def test_models_when_the_router_is_down(config: Config, router: FakeRouter) -> None:
    router.stop()  # before the start: no list learned (one learned is kept MODELS_TTL)
    async with serving(config) as (_, wire):
        event = await wire.request({"type": "models"})
        assert event["code"] == "router_unreachable"
        status = await wire.request({"type": "status"})
        assert status["router_reachable"] is False


async def test_history_survives_a_restart(daemon: RunningDaemon, router: FakeRouter) -> None:
    wire = await daemon.connect()
    cid = (await wire.ask("remember me"))[0]["conversation"]
    await wire.ask("and this", conversation=cid)
    await wire.close()
    await daemon.stop()
    await daemon.start()
    wire = await daemon.connect()
    try:
        opened = await wire.request({"type": "open", "conversation": cid})
        assert [t["text"] for t in opened["turns"]] == ["remember me", "and this"]
        assert [t["reply"] for t in opened["turns"]] == ["You said: remember me", "You said: and this"]
    finally:
        await wire.close()


async def test_a_client_that_leaves_does_not_lose_the_turn(daemon: RunningDaemon, router: FakeRouter) -> None:
    router.script(Reply(chunks=["still ", "stored"], delay=0.05))
    wire = await daemon.connect()
    rid = await wire.send({"type": "ask", "text": "bye"})
    cid = (await wire.until(rid, ("user",)))[0]["conversation"]
    await wire.close()
    other = await daemon.connect()
    try:
        for _ in range(200):
            opened = await other.request({"type": "open", "conversation": cid})
            if opened["turns"][0]["status"] != "running":
                break
            await asyncio.sleep(0.05)
        assert opened["turns"][0]["status"] == "complete"
        assert opened["turns"][0]["reply"] == "still stored"
    finally:
        await other.close()


async def test_cancel_right_after_ask_stops_it_as_soon_as_it_is_stored(wire: Wire, router: FakeRouter) -> None:
    cid = (await wire.ask("first"))[0]["conversation"]
    # both lines in one write: the cancel arrives while the ask is still starting
    await wire.send_raw(
        json.dumps({"type": "ask", "id": "a", "text": "second", "conversation": cid}).encode() + b"\n"
        + json.dumps({"type": "cancel", "id": "c", "conversation": cid}).encode() + b"\n"
    )
    events = await wire.until("a")
    assert events[-1]["type"] == "done" and events[-1]["finish_reason"] == "cancelled"
    turns = (await wire.request({"type": "open", "conversation": cid}))["turns"]
    assert [t["status"] for t in turns] == ["complete", "cancelled"]
    assert turns[1]["text"] == "second"
    assert len(router.requests) == 1  # the second question never reached the router


async def test_a_deleted_conversations_search_rows_go_after_the_answer_and_after_a_stop(
    config: Config, router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    from daemon import server
    from history import store as history_store

    monkeypatch.setattr(history_store, "UNINDEX_BATCH", 1)  # a row a trip, each 50 ms: the stop comes mid-way
    monkeypatch.setattr(server, "REQUEST_GRACE", 0.01)
    unindex = HistoryStore.unindex_deleted

    def slowly(store: HistoryStore, cid: int, limit: int | None = None) -> int:
        time.sleep(0.05)
        return unindex(store, cid, limit)

    monkeypatch.setattr(HistoryStore, "unindex_deleted", slowly)

    def rows(cid: int) -> int:
        lo = cid << 32
        with contextlib.closing(sqlite3.connect(config.db_path)) as db:
            return db.execute("SELECT count(*) FROM message_fts WHERE rowid BETWEEN ? AND ?", (lo, lo | 0xFFFFFFFF)).fetchone()[0]

    async with serving(config) as (_daemon, wire):
        cid = (await wire.ask("the otter " + "word " * 5))[0]["conversation"]
        for n in range(10):
            await wire.ask(f"otter {n}", conversation=cid)
        before = rows(cid)
        assert before == 22
        await wire.send({"type": "delete", "id": "d", "conversation": cid})
        assert (await wire.until("d", ("deleted",)))[-1]["type"] == "deleted"  # answered at once
        found = await wire.request({"type": "search", "query": "otter"})
        assert found["conversations"] == []  # gone from search before its rows are
        assert (await wire.request({"type": "conversations"}))["items"] == []
    assert 0 < rows(cid) < before  # the stop came while they went
    monkeypatch.setattr(HistoryStore, "unindex_deleted", unindex)  # the rest goes at full speed
    async with serving(config) as (_daemon, wire):  # the next start drops the rest
        async with asyncio.timeout(30):
            while rows(cid):
                await asyncio.sleep(0.05)


async def test_delete_right_after_ask_leaves_nothing_behind(wire: Wire, router: FakeRouter) -> None:
    cid = (await wire.ask("first"))[0]["conversation"]
    router.script(Reply(chunks=["never"], hang=True))  # the reply cannot end before the delete lands
    await wire.send_raw(
        json.dumps({"type": "ask", "id": "a", "text": "second", "conversation": cid}).encode() + b"\n"
        + json.dumps({"type": "delete", "id": "d", "conversation": cid}).encode() + b"\n"
    )
    deleted = (await wire.until("d", ("deleted", "error")))[-1]
    assert deleted["type"] == "deleted"
    assert (await wire.until("a"))[-1]["finish_reason"] == "cancelled"
    assert (await wire.request({"type": "open", "conversation": cid}))["code"] == "not_found"
    assert (await wire.request({"type": "conversations"}))["items"] == []


async def test_a_client_that_half_closes_still_gets_its_answers(wire: Wire) -> None:
    # what `echo '{"type":"ask",...}' | socat - UNIX-CONNECT:...` does
    await wire.send_raw(b'{"type":"status","id":1}\n{"type":"ask","id":2,"text":"hi"}\n')
    wire.writer.write_eof()
    events = await wire.until(2)
    assert events[-1]["type"] == "done" and events[-1]["text"] == "You said: hi"
    assert [e for e in wire.events if e.get("id") == 1][0]["type"] == "status"
    assert await wire.reader.read() == b""  # then the daemon hangs up


@pytest.mark.parametrize(
    "line, words",
    [
        (b"[" * 200_000, "nests too deeply"),
        (b'{"type":"status","id":NaN}', "not valid JSON"),
        (b'{"type":"status","id":1e400}', "not valid JSON"),  # infinity: no event could carry it back
        (b'{"type":"status","id":{"deep":[1e400]}}', "not valid JSON"),
        (b'{"type":"status","id":"' + b"x" * 300 + b'"}', "id is over 256 characters"),
        (b'{"type":"search","query":"x","limit":-1e999}', "not valid JSON"),
        (b'{"type":"ask","text":"\\ud800"}', "not valid JSON"),
        (b'{"type":"open","conversation":99999999999999999999999}', "'conversation' must be an integer from 1"),
        (b'{"type":"open","conversation":0}', "'conversation' must be an integer from 1"),
        (b'{"type":"open","conversation":1.5}', "'conversation' must be an integer"),
    ],
)
async def test_odd_json_is_refused_and_the_connection_lives(wire: Wire, line: bytes, words: str) -> None:
    await wire.send_raw(line + b"\n")
    event = await wire.read()
    assert event["type"] == "error" and event["code"] == "bad_request"
    assert words in event["message"]
    assert (await wire.request({"type": "status"}))["type"] == "status"


async def test_asks_still_starting_at_shutdown_are_told(config: Config) -> None:
    # a router whose /props is slow keeps a new ask in its start (the model lookup)
    with FakeRouter(models=[FakeModel("slow")], models_format="bare") as slow:
        slow.props_delay = 5.0
        running = RunningDaemon(dataclasses.replace(config, router_url=slow.url, shutdown_grace=0.2))
        await running.start()
        wire = await running.connect()
        rid = await wire.send({"type": "ask", "text": "hello?"})
        async with asyncio.timeout(60):  # until the daemon is waiting on /props
            while not slow.hits["/props"]:
                await asyncio.sleep(0.02)
        await running.stop()
        events = await wire.until(rid)
        await wire.close()
    assert events[-1]["type"] == "error" and events[-1]["code"] == "shutting_down"


async def test_every_request_type_has_a_handler() -> None:
    from daemon.handlers import Handlers
    from daemon.kb_handlers import KbHandlers
    from daemon.protocol import REQUESTS

    groups = (Handlers, KbHandlers)  # Handlers.__call__ finds a request's method in each
    missing = [kind for kind in REQUESTS if not any(callable(getattr(g, "on_" + kind, None)) for g in groups)]
    assert missing == []


async def test_a_model_named_by_its_path_is_shown_by_its_name(config: Config) -> None:
    # llama-server without --alias names its model by the GGUF's path
    with FakeRouter(models=[FakeModel("/home/u/models/Qwen3-8B-Q4_K_M.gguf")]) as plain:
        running = RunningDaemon(dataclasses.replace(config, router_url=plain.url))
        await running.start()
        wire = await running.connect()
        try:
            events = await wire.ask("hi")
            waiting = [e for e in of_type(events, "progress") if e["stage"] == "waiting"][0]
            assert waiting["detail"] == "waiting for Qwen3-8B-Q4_K_M"
            assert plain.requests[-1]["model"] == "/home/u/models/Qwen3-8B-Q4_K_M.gguf"  # sent as listed
        finally:
            await wire.close()
            await running.stop()


async def test_a_conversations_own_model_is_used_and_its_loss_is_an_error_kept(
    wire: Wire, router: FakeRouter, config: Config
) -> None:
    cid = (await wire.ask("hello", model="fake-vision"))[0]["conversation"]
    await wire.ask("again", conversation=cid)
    assert router.requests[-1]["model"] == "fake-vision"  # read with the question, in one trip
    with sqlite3.connect(config.db_path) as conn:  # a model the server no longer has
        conn.execute("UPDATE conversations SET model = 'gone-model' WHERE id = ?", (cid,))
    conn.close()
    events = await wire.ask("still there?", conversation=cid)
    assert [e["type"] for e in events] == ["user", "error"]
    assert events[-1]["code"] == "not_found" and "gone-model" in events[-1]["message"]
    assert events[-1]["turn"] == 3
    turn = (await wire.request({"type": "open", "conversation": cid}))["turns"][-1]
    assert turn["text"] == "still there?" and turn["status"] == "error"


async def test_a_flood_of_blank_lines_costs_no_step_per_line() -> None:
    """20 MB of blank lines once slowed every other client: each was a step of the loop."""
    reader = asyncio.StreamReader()
    reader.feed_data(b"\n" * 3_000_000 + b"  \r\n\t\n" + b'{"type":"status"}\n' + b"\n" * 1000 + b'  {"type":"models"}')
    reader.feed_eof()
    lines = [line async for line in read_lines(reader)]
    assert lines == [b'{"type":"status"}', b'{"type":"models"}']


async def test_blank_lines_before_a_request_are_ignored_through_the_socket(wire: Wire) -> None:
    await wire.send_raw(b"\n" * 2_000_000 + b'\r\n  {"type":"status","id":"after"}\n')
    event = await wire.read()
    assert event["type"] == "status" and event["id"] == "after"  # no error for the blank lines


async def test_a_client_that_stops_reading_is_dropped_at_the_cap(
    daemon: RunningDaemon, router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What waits for a stalled client is bounded by the cap, checked before each write, and
    the connection is dropped (not closed gently, which would keep the buffer to send)."""
    monkeypatch.setattr(connection, "MAX_WRITE_BUFFER", 1 << 20)
    router.script(Reply(chunks=["x" * 6000] * 1000))  # 6 MB of deltas
    reader, writer = await asyncio.open_unix_connection(str(daemon.config.socket_path))
    writer.write(b'{"type":"ask","id":"flood","text":"flood me"}\n')
    await writer.drain()
    other = await daemon.connect()
    try:
        # the turn goes on without its client, and is stored whole; the deadline only stops a
        # hang (6 MB through the fake takes far longer on a loaded machine than on an idle one)
        async with asyncio.timeout(120):
            while (await other.request({"type": "status"}))["turns_running"] or not router.requests:
                await asyncio.sleep(0.05)
            # the outcome's write may still be queued on the store's thread
            while (opened := await other.request({"type": "open", "conversation": 1}))["turns"][0]["status"] == "running":
                await asyncio.sleep(0.05)
        assert len(opened["turns"][0]["reply"]) == 6_000_000, repr({k: v for k, v in opened["turns"][0].items() if k not in ("reply", "text", "files", "tools")})
        received = 0
        try:
            while chunk := await asyncio.wait_for(reader.read(1 << 16), 10):
                received += len(chunk)
        except ConnectionError:
            pass
        assert received < 1 << 20  # the kernel's socket buffer at most: the rest was discarded
    finally:
        writer.close()
        await other.close()


async def test_a_client_that_reads_gets_an_event_over_the_cap_and_the_events_after_it(
    daemon: RunningDaemon, router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection, "MAX_WRITE_BUFFER", 64 << 10)
    reply = "long " * 200_000  # 1 MB: the conversation's open is one event over the cap

    assert daemon.server is not None and daemon.server.engine is not None
    history = daemon.server.engine.history
    question = {"role": "user", "content": "write a lot"}
    new = NewTurn(None, "write a lot", [question], [], "fake-text")
    conversation, turn = await history.run(HistoryStore.start_turn, new)
    answer = {"role": "assistant", "content": reply}
    assert await history.finish(TurnOutcome(conversation.id, turn.turn, [question, answer], reply, "complete"))
    long = conversation.id
    router.script(Reply(chunks=["tick "] * 100, delay=0.005))  # deltas while the open is read
    reader, writer = await asyncio.open_unix_connection(str(daemon.config.socket_path))
    try:
        writer.write(b'{"type":"ask","id":"a","text":"count slowly"}\n')
        await reader.readuntil(b'"type":"delta"')  # the turn streams
        await reader.readuntil(b"\n")
        writer.write(json.dumps({"type": "open", "id": "o", "conversation": long}).encode() + b"\n")
        data = bytearray()
        async with asyncio.timeout(60):  # a reader, if a slow one: 64 KiB every 2 ms
            while b'"type":"done"' not in data or b'"id":"o"' not in data:
                chunk = await reader.read(64 << 10)
                assert chunk, "the daemon dropped a client that reads"
                data += chunk
                await asyncio.sleep(0.002)
        events = [json.loads(line) for line in data.split(b"\n") if line.strip()]
        [opened] = [e for e in events if e.get("id") == "o"]
        assert opened["type"] == "conversation" and opened["turns"][0]["reply"] == reply
        assert [e["type"] for e in events if e.get("id") == "a"][-1] == "done"
    finally:
        writer.close()


async def test_an_oversize_id_is_not_echoed(wire: Wire) -> None:
    await wire.send_raw(b'{"type":"status","id":"' + b"x" * 300 + b'"}\n')
    event = await wire.read()
    assert event["code"] == "bad_request" and "id" not in event
    assert (await wire.request({"type": "status", "id": "y" * 250}))["type"] == "status"


async def test_events_are_strict_json() -> None:
    with pytest.raises(ValueError):
        encode_event({"type": "status", "uptime": float("inf")})
    # a lone surrogate that got past where it came in is sent as U+FFFD, not a failed event
    assert encode_event({"type": "delta", "text": "a\ud800b"}) == '{"type":"delta","text":"a\ufffdb"}\n'.encode()


async def test_requests_waiting_in_order_are_bounded_and_each_waits_on_a_few(
    daemon: RunningDaemon, wire: Wire, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unread barriers once each held every earlier one (10,000 `settings` lines: 11 GB). Each
    request now waits on a few tasks however many came before it, and a connection past its
    bound of requests in flight is refused line by line, with nothing of those lines done."""
    monkeypatch.setattr(connection, "MAX_PENDING_REQUESTS", 40)
    cid = (await wire.ask("hold on"))[0]["conversation"]
    assert daemon.server is not None and daemon.server._handlers is not None
    handlers = daemon.server._handlers
    gate = asyncio.Event()
    settings = handlers.on_settings

    async def gated(request: object, emit: object) -> None:
        await gate.wait()
        await settings(request, emit)  # type: ignore[arg-type]

    monkeypatch.setattr(handlers, "on_settings", gated)
    kinds = ["settings", "cancel", "delete", "open", "status", "kb_remove"] * 10
    lines = [{"type": "settings", "conversation": cid, "title": "t0", "id": 0}]
    for n, kind in enumerate(kinds, 1):
        line = {"type": kind, "id": n}
        line.update({"settings": {"conversation": cid, "title": f"t{n}"}, "cancel": {"conversation": cid},
                     "delete": {"conversation": cid + 1000}, "open": {"conversation": cid},
                     "kb_remove": {"kb": "none"}}.get(kind, {}))
        lines.append(line)
    await wire.send_raw(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    refused = [await wire.read() for _ in range(len(lines) - 40)]  # all before anything else: the gate holds
    assert {e["code"] for e in refused} == {"too_many_requests"}
    assert [e["id"] for e in refused] == list(range(40, len(lines)))
    waiting = [t for t in asyncio.all_tasks() if t.get_name().startswith("request-")]
    assert len(waiting) == 40
    # what a task's end wakes: its own bookkeeping and the few requests that wait on it by name,
    # not every later one (the held lines cost in proportion to their number)
    woken = sum(len(t._callbacks or ()) for t in waiting)  # type: ignore[attr-defined]
    assert woken <= 6 * len(waiting)
    gate.set()
    answered = [await wire.read() for _ in range(40)]
    assert [e["id"] for e in answered if e["type"] == "settings"] == [0] + [n for n in range(1, 40) if n % 6 == 1]
    final = await wire.request({"type": "open", "conversation": cid})
    assert final["title"] == "t37"  # the last settings accepted; none refused took effect


async def test_statuses_at_once_share_one_look_at_the_router(wire: Wire, router: FakeRouter) -> None:
    """Each status asked the router for its models: 10,000 statuses were as many requests."""
    before = router.models_answered
    lines = [{"type": "status", "id": n} for n in range(50)]
    await wire.send_raw(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    answers = [await wire.read() for _ in lines]
    assert {e["type"] for e in answers} == {"status"} and all(e["router_reachable"] for e in answers)
    asked = router.models_answered - before
    assert 1 <= asked < 10, asked


async def test_an_error_repeats_a_few_of_the_clients_names_not_all(wire: Wire) -> None:
    cid = (await wire.ask("hello"))[0]["conversation"]
    names = [f"server{n}" for n in range(20_000)]
    refused = await wire.request({"type": "settings", "conversation": cid, "mcp_servers": names})
    assert refused["code"] == "not_found" and "server0, server1" in refused["message"]
    assert "and 19995 more" in refused["message"] and len(refused["message"]) < 300
    refused = await wire.request({"type": "x" * 100_000})
    assert refused["code"] == "unknown_type" and len(refused["message"]) < 400


async def test_a_turns_events_read_back_as_the_records_they_were_built_from() -> None:
    """Each event a turn sends, built by its constructor, reads back (``events.read_turn``) as the
    record of the same fields, and that record writes the same JSON: what the OpenAI door's relay
    reads is what the socket's clients get."""
    from core.errors import BadRequest
    from core.router import ToolCall, Usage
    from daemon import events

    call = ToolCall("call_1", "lookup", "{}", from_text=True)
    built = [
        events.user(1, 2, "hi", [{"name": "a.txt"}], "r1"),
        events.delta(1, 2, "Hel"),
        events.reasoning(1, 2, "think"),
        events.tool(1, 2, call, server=None, own="lookup", arguments={}, ok=False, summary="no", approval=None),
        events.done(1, 2, "Hello", "tool_calls", usage=Usage(3, 4), ctx_used=7, ctx_max=100, timings=None,
                    model="m", title=None, saved=False, client_calls=[call], note="kept in memory"),
        events.error_event(BadRequest("no"), conversation=1, turn=2),
    ]
    kinds = [events.Began, events.Delta, events.Reasoning, events.ToolRan, events.Done, events.Failed]
    for event, kind in zip(built, kinds, strict=True):
        record = events.read_turn(event)
        assert isinstance(record, kind)
        assert record.to_json() == event
    done = events.read_turn(built[4])
    assert isinstance(done, events.Done)
    assert (done.prompt_tokens, done.completion_tokens, done.tool_calls[0]["id"]) == (3, 4, "call_1")
    assert events.read_turn(events.progress(1, 2, "kb", "searching")) is None
