"""HistoryStore and AsyncHistory: every method, the FTS index kept in step, quoting."""

from __future__ import annotations

import asyncio
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from core.errors import StartupError
from history import (
    AsyncHistory,
    Conversation,
    HistoryStore,
    NewAttachment,
    NewTurn,
    SUMMARY_SLOT,
    SearchHit,
    Turn,
    TurnOutcome,
    conversation_rowid_range,
    message_rowid,
    quote_fts,
    split_rowid,
    thread_digest,
    turn_rowid_range,
)
from history import fts as history_fts
from history import search as history_search
from history import store as history_store
from history.records import parse_timestamp


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "data" / "history.db"


@pytest.fixture
def store(db_path: Path) -> Iterator[HistoryStore]:
    with HistoryStore(db_path) as s:
        yield s


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def ask(store: HistoryStore, cid: int | None, question: str, answer: str) -> Turn:
    """A whole completed turn: start it, then finish it with the answer."""
    conversation, turn = store.start_turn(NewTurn(cid, question, [user(question)], [], "m", "t"))
    return store.finish_turn(
        conversation.id,
        turn.turn,
        messages=[user(question), assistant(answer)],
        reply=answer,
        status="complete",
        finish_reason="stop",
    )


def fts_rows(path: Path, cid: int) -> list[tuple[int, str, str]]:
    """(rowid, role, body) of a conversation's index rows, read by another connection."""
    lo, hi = conversation_rowid_range(cid)
    with closing(sqlite3.connect(path)) as conn:
        return conn.execute(
            "SELECT rowid, role, body FROM message_fts WHERE rowid BETWEEN ? AND ?"
            " ORDER BY rowid",
            (lo, hi),
        ).fetchall()


# -- opening ---------------------------------------------------------------------------


def test_open_creates_private_directory_and_file_in_wal_mode(db_path: Path) -> None:
    with HistoryStore(db_path) as store:
        assert store._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 4000
    assert stat.S_IMODE(db_path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(db_path.stat().st_mode) == 0o600
    with closing(sqlite3.connect(db_path)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_data_survives_reopen(db_path: Path) -> None:
    with HistoryStore(db_path) as store:
        ask(store, None, "persist me", "persisted")
    with HistoryStore(db_path) as store:
        (turn,) = store.turns(1)
        assert (turn.text, turn.reply, turn.status) == ("persist me", "persisted", "complete")
        assert store.search_all("persisted")[0].conversation_id == 1


# -- conversations ---------------------------------------------------------------------


def test_create_and_get_conversation(store: HistoryStore) -> None:
    created = store.create_conversation("Plans", model="gemma")
    assert isinstance(created, Conversation)
    assert (created.title, created.model, created.settings, created.ctx_used, created.turns) == (
        "Plans", "gemma", {}, 0, 0,
    )
    parse_timestamp(created.created_at)
    assert created.created_at.endswith("Z") and len(created.created_at) == 27
    assert store.get_conversation(created.id) == created
    assert store.get_conversation(created.id + 1) is None
    default = store.create_conversation()
    assert (default.title, default.model) == ("", None)
    assert default.id != created.id


def test_conversation_to_json(store: HistoryStore) -> None:
    conversation, _ = store.start_turn(NewTurn(None, "q", [user("q")], [], None, "Title"))
    assert conversation.to_json() == {
        "conversation": conversation.id,
        "title": "Title",
        "updated_at": conversation.updated_at,
        "turns": 1,
    }


def test_update_conversation(store: HistoryStore) -> None:
    created = store.create_conversation("Old", model="gemma")
    cid = created.id

    renamed = store.update_conversation(cid, title="New")
    assert renamed is not None
    assert (renamed.title, renamed.model) == ("New", "gemma")  # model left out: kept
    # Settings changes do not reorder the conversation list.
    assert renamed.updated_at == created.updated_at

    store.update_conversation(cid, settings={"kb_injection": "off", "x": 1})
    merged = store.update_conversation(cid, settings={"kb_injection": "auto"})
    assert merged is not None
    assert merged.settings == {"kb_injection": "auto", "x": 1}
    assert merged.title == "New"

    other = store.update_conversation(cid, model="qwen")
    assert other is not None and other.model == "qwen"
    reset = store.update_conversation(cid, model=None)  # back to the daemon default
    assert reset is not None and reset.model is None

    assert store.update_conversation(cid + 100, title="x") is None
    store.delete_conversation(cid)
    assert store.update_conversation(cid, title="x") is None


def test_delete_conversation(store: HistoryStore, db_path: Path) -> None:
    keep = ask(store, None, "keep this hedgehog", "hedgehog kept").conversation_id
    gone = ask(store, None, "delete this hedgehog", "hedgehog deleted").conversation_id
    ask(store, gone, "second hedgehog turn", "more hedgehog")
    assert len(fts_rows(db_path, gone)) == 4

    assert store.delete_conversation(gone) is True
    assert store.delete_conversation(gone) is False  # already deleted
    assert store.delete_conversation(9999) is False  # never existed

    assert store.get_conversation(gone) is None
    assert [c.id for c in store.list_conversations()] == [keep]
    assert store.turns(gone) == []
    assert store.turn(gone, 1) is None
    # gone from search at once; its rows are dropped after, a batch at a time
    assert store.search_conversation(gone, "hedgehog") == []
    assert {h.conversation_id for h in store.search_all("hedgehog")} == {keep}
    assert store.deleted_but_indexed() == [gone]
    assert [store.unindex_deleted(gone, limit=3) for _ in range(3)] == [3, 1, 0]
    assert fts_rows(db_path, gone) == [] and store.deleted_but_indexed() == []
    # The neighbour's index rows are untouched by the range delete.
    assert len(fts_rows(db_path, keep)) == 2
    with pytest.raises(LookupError):
        store.start_turn(NewTurn(gone, "again", [user("again")], [], None))


def test_search_never_shows_a_deleted_conversation(store: HistoryStore, db_path: Path) -> None:
    cid = ask(store, None, "q", "a stale capybara").conversation_id
    store.delete_conversation(cid)
    assert store.search_all("capybara") == []  # its rows not dropped yet
    while store.unindex_deleted(cid):
        pass
    # Rows left behind by some older bug or a hand edit must still stay invisible.
    with closing(sqlite3.connect(db_path)) as conn, conn:
        conn.execute(
            "INSERT INTO message_fts (rowid, body, role) VALUES (?, 'stale capybara', 'user')",
            (message_rowid(cid, 1, 0),),
        )
    assert store.search_all("capybara") == []
    assert store.search_conversation(cid, "capybara") == []


def test_timestamps_strictly_increase_under_a_stuck_clock(
    store: HistoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    moment = datetime(2026, 11, 29, 19, 50, 19, 999999, tzinfo=UTC) - datetime(1970, 1, 1, tzinfo=UTC)
    last_of_a_second = moment // timedelta(microseconds=1) * 1000  # in nanoseconds
    readings = iter([last_of_a_second, last_of_a_second, last_of_a_second - 5 * 10**9])  # stuck, then back

    class StuckClock:
        time_ns = staticmethod(lambda: next(readings))
        strftime, gmtime = staticmethod(time.strftime), staticmethod(time.gmtime)

    monkeypatch.setattr(history_store, "time", StuckClock)
    stamps = [store.create_conversation().updated_at for _ in range(3)]
    assert stamps == [
        "2026-11-29T19:50:19.999999Z",
        "2026-11-29T19:50:20.000000Z",  # into the next second, formatted anew
        "2026-11-29T19:50:20.000001Z",
    ]
    # So the `before` cursor neither skips nor repeats one.
    first = store.list_conversations(limit=1)
    assert [c.id for c in store.list_conversations(before=first[0].updated_at)] == [2, 1]


# -- turns -----------------------------------------------------------------------------


def test_start_turn_creates_conversation(store: HistoryStore, db_path: Path) -> None:
    files = [{"name": "report.pdf", "kind": "pdf", "pages": 3, "truncated": False}]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What changed in the report?"},
                {"type": "image_ref", "name": "p2.png", "path": "/r.pdf", "sha256": "ab",
                 "page": 2},
            ],
        }
    ]
    conversation, turn = store.start_turn(NewTurn(
        None, "What changed?", messages, files, "gemma", "Report changes"
    ))
    assert (conversation.title, conversation.turns, conversation.model) == (
        "Report changes", 1, None,
    )
    assert (turn.conversation_id, turn.turn, turn.status) == (conversation.id, 1, "running")
    assert (turn.text, turn.files, turn.messages, turn.model) == (
        "What changed?", files, messages, "gemma",
    )
    assert turn.reply == "" and turn.usage is None
    assert conversation.updated_at == turn.created_at
    # The question is indexed with its reply when the turn ends, not before; the image
    # part adds no text.
    assert fts_rows(db_path, conversation.id) == []
    store.finish_turn(conversation.id, 1, messages=messages, reply="", status="error")
    assert fts_rows(db_path, conversation.id) == [
        (message_rowid(conversation.id, 1, 0), "user", "What changed in the report?")
    ]


def test_start_turn_numbers_turns_and_touches_conversation(store: HistoryStore) -> None:
    first = ask(store, None, "one", "1")
    cid = first.conversation_id
    before = store.get_conversation(cid)
    assert before is not None
    conversation, second = store.start_turn(NewTurn(cid, "two", [user("two")], [], None, "ignored"))
    assert second.turn == 2
    assert conversation.turns == 2
    assert conversation.title == "t"  # title only names a new conversation
    assert conversation.updated_at > before.updated_at


@pytest.mark.parametrize("with_file", [True, False])
@pytest.mark.parametrize("new", [True, False])
def test_begin_turn_returns_what_it_stored_and_what_a_read_gives(
    store: HistoryStore, new: bool, with_file: bool
) -> None:
    """begin_turn builds the turn and, for a conversation it creates, the conversation and
    the context without reading them back: all must be what reading them gives."""
    kb, _ = store.kb.ensure("everywhere")
    store.kb.set_link("everywhere", None, True)  # linked to every conversation, new ones included
    doc = NewAttachment(name="a.txt", path="/a.txt", kind="text", content_type="text/plain", size_bytes=2,
                        sha256="ab" * 32, full_text="hi")
    cid = None if new else ask(store, None, "one", "1").conversation_id
    files = [{"name": "a.txt", "kind": "text"}] if with_file else []
    messages = [{"role": "user", "content": [{"type": "text", "text": "two"}]}]
    asked = NewTurn(cid, "two", messages, files, "m", "Two", attachments=[doc] if with_file else [],
                    conversation_model="own", system_prompt="Answer in French.")
    turn, context = store.begin_turn(asked)
    assert turn == store.turn(context.conversation.id, turn.turn)
    assert context == store.turn_context(context.conversation.id, before=turn.turn)
    assert context.has_attachments == with_file and context.kb_ids == [kb.id]
    assert context.conversation == store.get_conversation(context.conversation.id)
    assert context.conversation.updated_at == turn.created_at and context.conversation.turns == turn.turn
    assert context.conversation.system_prompt == ("Answer in French." if new else None)


def test_start_turn_on_missing_conversation_writes_nothing(store: HistoryStore) -> None:
    with pytest.raises(LookupError):
        store.start_turn(NewTurn(42, "lost", [user("lost")], [], None))
    assert store.list_conversations() == []
    assert store.turns(42) == []
    assert store.search_all("lost") == []


def test_save_partial_checkpoints_running_turn_only(store: HistoryStore) -> None:
    conversation, turn = store.start_turn(NewTurn(None, "q", [user("q")], [], None))
    store.save_partial(conversation.id, 1, "Half an ans")
    checkpoint = store.turn(conversation.id, 1)
    assert checkpoint is not None
    assert (checkpoint.reply, checkpoint.status) == ("Half an ans", "running")
    assert checkpoint.messages == turn.messages
    assert store.search_all("ans") == []  # checkpoints are not indexed

    store.finish_turn(
        conversation.id, 1, messages=[user("q"), assistant("Full answer")],
        reply="Full answer", status="complete",
    )
    store.save_partial(conversation.id, 1, "late checkpoint")
    final = store.turn(conversation.id, 1)
    assert final is not None and final.reply == "Full answer"


def test_finish_turn(store: HistoryStore) -> None:
    conversation, started = store.start_turn(NewTurn(None, "q", [user("q")], [], "gemma"))
    cid = conversation.id
    finished = store.finish_turn(
        cid, 1,
        messages=[user("q"), assistant("answer")],
        reply="answer",
        status="complete",
        finish_reason="stop",
        prompt_tokens=120,
        completion_tokens=30,
        ctx_used=150,
    )
    assert finished == store.turn(cid, 1)
    assert (finished.reply, finished.status, finished.finish_reason) == (
        "answer", "complete", "stop",
    )
    assert finished.usage == {"prompt_tokens": 120, "completion_tokens": 30}
    assert finished.messages == [user("q"), assistant("answer")]
    assert finished.created_at == started.created_at
    assert finished.updated_at > started.updated_at
    after = store.get_conversation(cid)
    assert after is not None
    assert after.ctx_used == 150
    assert after.updated_at == finished.updated_at

    # ctx_used left out keeps the last known value.
    _, second = store.start_turn(NewTurn(cid, "q2", [user("q2")], [], None))
    errored = store.finish_turn(
        cid, 2, messages=[user("q2")], reply="", status="error",
        error="The router did not answer.", error_code="router_unreachable",
    )
    assert (errored.status, errored.error, errored.error_code) == (
        "error", "The router did not answer.", "router_unreachable",
    )
    still = store.get_conversation(cid)
    assert still is not None and still.ctx_used == 150


def test_finish_turn_rejects_unknown_turn_and_status(store: HistoryStore) -> None:
    conversation, _ = store.start_turn(NewTurn(None, "q", [user("q")], [], None))
    with pytest.raises(LookupError):
        store.finish_turn(conversation.id, 2, messages=[], reply="", status="complete")
    with pytest.raises(ValueError):
        store.finish_turn(
            conversation.id, 1, messages=[], reply="", status="done"  # type: ignore[arg-type]
        )
    turn = store.turn(conversation.id, 1)
    assert turn is not None and turn.status == "running"


def test_finish_after_delete_saves_but_does_not_index(
    store: HistoryStore, db_path: Path
) -> None:
    conversation, _ = store.start_turn(NewTurn(None, "q", [user("q")], [], None))
    store.delete_conversation(conversation.id)
    turn = store.finish_turn(
        conversation.id, 1, messages=[user("q"), assistant("walrus")], reply="walrus",
        status="cancelled", finish_reason="cancelled",
    )
    assert (turn.reply, turn.status) == ("walrus", "cancelled")
    assert fts_rows(db_path, conversation.id) == []
    assert store.search_all("walrus") == []


def test_turns_and_turn(store: HistoryStore) -> None:
    cid = ask(store, None, "first", "a").conversation_id
    ask(store, cid, "second", "b")
    ask(store, cid, "third", "c")
    ask(store, None, "elsewhere", "d")
    assert [(t.turn, t.text) for t in store.turns(cid)] == [
        (1, "first"), (2, "second"), (3, "third"),
    ]
    found = store.turn(cid, 2)
    assert found is not None and found.reply == "b"
    assert store.turn(cid, 4) is None
    assert store.turn(cid, 0) is None
    assert store.turns(999) == []


def test_turn_to_json_derives_tools(store: HistoryStore) -> None:
    messages = [
        user("find the budget"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "conversation_search", "arguments": '{"query": "budget"}'}},
                {"id": "c2", "type": "function",
                 "function": {"name": "attachment_recall", "arguments": "{not json"}},
                {"id": "c3", "type": "function",
                 "function": {"name": "kb_search", "arguments": '{"query": "x"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"results": []}',
         "ok": True, "summary": "0 results"},
        {"role": "tool", "tool_call_id": "c2", "content": "Error: bad arguments",
         "ok": False, "summary": "bad arguments"},
        assistant("The budget is 12k."),
    ]
    conversation, _ = store.start_turn(NewTurn(None, "find the budget", [user("find the budget")],
                                       [{"name": "b.txt", "kind": "text"}], "gemma"))
    denied = {"call": "1.1", "name": "files__write", "server": "files", "tool": "write", "arguments": {"text": "x"},
              "allowed": False, "by": "user", "at": "2026-12-03T20:00:00.000000Z", "remember": False, "client": "python3"}
    turn = store.finish_turn(
        conversation.id, 1, messages=messages, reply="The budget is 12k.",
        status="complete", finish_reason="stop", prompt_tokens=9, completion_tokens=4, approvals=[denied],
    )
    assert store.turn(conversation.id, 1).approvals == [denied]  # as read back, not only as written
    assert turn.to_json() == {
        "turn": 1,
        "text": "find the budget",
        "files": [{"name": "b.txt", "kind": "text"}],
        "reply": "The budget is 12k.",
        "tools": [
            {"name": "conversation_search", "arguments": {"query": "budget"}, "ok": True,
             "summary": "0 results", "server": None, "tool": "conversation_search"},
            {"name": "attachment_recall", "arguments": "{not json", "ok": False,
             "summary": "bad arguments", "server": None, "tool": "attachment_recall"},
            # Cancelled before its result arrived.
            {"name": "kb_search", "arguments": {"query": "x"}, "ok": False,
             "summary": "no result", "server": None, "tool": "kb_search"},
        ],
        "status": "complete",
        "error": None,
        "finish_reason": "stop",
        "model": "gemma",
        "usage": {"prompt_tokens": 9, "completion_tokens": 4},
        "sources": [],
        "recalled": [],
        "created_at": turn.created_at,
        "ref": None,
        "approvals": [denied],
    }


def test_damaged_json_columns_read_as_empty(store: HistoryStore, db_path: Path) -> None:
    a, _ = store.start_turn(NewTurn(None, "q", [user("q")], [{"name": "f"}], None))
    b, _ = store.start_turn(NewTurn(None, "q", [user("q")], [], None))
    with closing(sqlite3.connect(db_path)) as conn, conn:
        conn.execute("UPDATE conversations SET settings = '{broken'")
        conn.execute("UPDATE turns SET files = '{}', messages = '\"text\"'")

    first, second = store.turn(a.id, 1), store.turn(b.id, 1)
    assert first is not None and second is not None
    assert (first.files, first.messages) == ([], [])
    conversation = store.get_conversation(a.id)
    assert conversation is not None and conversation.settings == {}
    first.files.append({"name": "x"})  # each row gets its own empty list
    assert second.files == []


def test_interrupt_running(store: HistoryStore) -> None:
    done = ask(store, None, "done", "fine")
    a, _ = store.start_turn(NewTurn(None, "crashed question", [user("crashed question")], [], None))
    store.save_partial(a.id, 1, "partial words")
    b, _ = store.start_turn(NewTurn(done.conversation_id, "also running", [user("x")], [], None))

    assert store.interrupt_running() == 2
    crashed = store.turn(a.id, 1)
    assert crashed is not None
    assert (crashed.status, crashed.text, crashed.reply) == (
        "interrupted", "crashed question", "partial words",
    )
    second = store.turn(b.id, 2)
    assert second is not None and second.status == "interrupted"
    # a crash came before they were indexed: they are now, question and words shown
    assert {h.turn for h in store.search_conversation(a.id, "crashed")} == {1}
    assert {h.turn for h in store.search_conversation(a.id, "partial")} == {1}
    assert {h.conversation_id for h in store.search_all("x")} == {b.id}
    untouched = store.turn(done.conversation_id, 1)
    assert untouched is not None and untouched.status == "complete"
    assert store.interrupt_running() == 0


def test_list_conversations_order_and_pagination(store: HistoryStore) -> None:
    ids = [store.create_conversation(f"c{i}").id for i in range(6)]
    # Activity moves a conversation to the top.
    ask(store, ids[1], "bump", "bumped")
    store.delete_conversation(ids[4])

    listed = store.list_conversations()
    assert [c.id for c in listed] == [ids[1], ids[5], ids[3], ids[2], ids[0]]
    assert [c.turns for c in listed] == [1, 0, 0, 0, 0]
    stamps = [c.updated_at for c in listed]
    assert stamps == sorted(stamps, reverse=True) and len(set(stamps)) == len(stamps)

    pages: list[list[int]] = []
    before: str | None = None
    while page := store.list_conversations(limit=2, before=before):
        pages.append([c.id for c in page])
        before = page[-1].updated_at
    assert pages == [[ids[1], ids[5]], [ids[3], ids[2]], [ids[0]]]
    assert store.list_conversations(limit=0) == []


# -- the index -------------------------------------------------------------------------


def test_index_holds_the_searchable_text_of_each_message(
    store: HistoryStore, db_path: Path
) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [
            {"type": "text", "text": "Look at"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "this chart"},
        ]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "attachment_recall", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "chart.png: a bar chart"},
        {"role": "assistant", "content": "It is a bar chart."},
        {"role": "system", "content": "never indexed"},
    ]
    conversation, _ = store.start_turn(NewTurn(None, "Look at this chart", messages[:1], [], None))
    store.finish_turn(conversation.id, 1, messages=messages, reply="It is a bar chart.",
                      status="complete")
    cid = conversation.id
    assert fts_rows(db_path, cid) == [
        (message_rowid(cid, 1, 0), "user", "Look at\nthis chart"),
        (message_rowid(cid, 1, 2), "tool", "chart.png: a bar chart"),
        (message_rowid(cid, 1, 3), "assistant", "It is a bar chart."),
    ]
    assert {h.role for h in store.search_conversation(cid, "bar chart")} == {"tool", "assistant"}


def test_search_follows_finish_turn(store: HistoryStore, db_path: Path) -> None:
    conversation, _ = store.start_turn(NewTurn(None, "tell me", [user("tell me")], [], None))
    cid = conversation.id
    assert store.search_conversation(cid, "platypus") == []
    store.finish_turn(cid, 1, messages=[user("tell me"), assistant("A platypus lays eggs")],
                      reply="A platypus lays eggs", status="complete")
    (hit,) = store.search_conversation(cid, "platypus")
    assert (hit.conversation_id, hit.turn, hit.role) == (cid, 1, "assistant")

    # A turn's messages replaced: the old text is gone from the index, not duplicated.
    store.finish_turn(cid, 1, messages=[user("tell me"), assistant("An echidna too")],
                      reply="An echidna too", status="complete")
    assert store.search_conversation(cid, "platypus") == []
    assert store.search_all("platypus") == []
    assert len(store.search_conversation(cid, "echidna")) == 1
    assert len(fts_rows(db_path, cid)) == 2


def test_search_hit_fields(store: HistoryStore) -> None:
    filler = " ".join(f"word{i}" for i in range(40))
    turn = ask(store, None, "q", f"{filler} the narwhal surfaced {filler}")
    (hit,) = store.search_conversation(turn.conversation_id, "NARWHAL")
    assert isinstance(hit, SearchHit)
    assert "[narwhal]" in hit.excerpt
    assert hit.excerpt.startswith("…") and hit.excerpt.endswith("…")
    assert hit.created_at == turn.created_at
    assert isinstance(hit.rank, float) and hit.rank > 0


def test_search_ignores_diacritics_and_case(store: HistoryStore) -> None:
    turn = ask(store, None, "Café crème", "ok")
    assert [h.turn for h in store.search_conversation(turn.conversation_id, "cafe CREME")] == [1]


def test_search_ranks_by_bm25(store: HistoryStore) -> None:
    cid = ask(store, None, "unrelated filler one", "nothing here").conversation_id
    for i in range(6):
        ask(store, cid, f"more filler {i}", f"still nothing {i}")
    ask(store, cid, "ibex once", "ok")
    ask(store, cid, "ibex ibex ibex twice more", "ok")
    hits = store.search_conversation(cid, "ibex")
    assert [h.turn for h in hits] == [9, 8]
    assert hits[0].rank > hits[1].rank
    assert [h.turn for h in store.search_conversation(cid, "ibex", limit=1)] == [9]
    assert store.search_conversation(cid, "ibex", limit=0) == []


def test_search_terms_are_anded(store: HistoryStore) -> None:
    cid = ask(store, None, "red apple", "ok").conversation_id
    ask(store, cid, "green apple", "ok")
    assert [h.turn for h in store.search_conversation(cid, "apple green")] == [2]


def test_search_role_filter(store: HistoryStore) -> None:
    turn = ask(store, None, "ask about lemurs", "lemurs live in Madagascar")
    cid = turn.conversation_id
    assert {h.role for h in store.search_conversation(cid, "lemurs")} == {"user", "assistant"}
    assert [h.role for h in store.search_conversation(cid, "lemurs", role="user")] == ["user"]
    assert [h.role for h in store.search_conversation(cid, "lemurs", role="assistant")] == [
        "assistant"
    ]
    assert len(store.search_conversation(cid, "lemurs", role="all")) == 2


def test_search_is_scoped_to_the_conversation(store: HistoryStore) -> None:
    one = ask(store, None, "shared word okapi", "okapi in one").conversation_id
    two = ask(store, None, "only here: quokka", "quokka and okapi").conversation_id
    assert one + 1 == two  # adjacent rowid ranges: the bounds must be exact
    assert store.search_conversation(one, "quokka") == []
    assert {h.conversation_id for h in store.search_conversation(two, "quokka")} == {two}
    assert {h.conversation_id for h in store.search_conversation(one, "okapi")} == {one}
    assert {h.conversation_id for h in store.search_all("okapi")} == {one, two}
    assert store.search_conversation(999, "okapi") == []


def test_search_all_limit_and_order(store: HistoryStore) -> None:
    for i in range(5):
        ask(store, None, f"gecko {i}", "ok")
    ask(store, None, "gecko gecko gecko", "ok")
    hits = store.search_all("gecko", limit=3)
    assert len(hits) == 3
    assert hits[0].conversation_id == 6
    assert [h.rank for h in hits] == sorted((h.rank for h in hits), reverse=True)


NASTY_QUERIES = [
    '"', '""', '"unbalanced', "*", "foo*", "NOT", "a NOT b", "NOT a", "NEAR(",
    "NEAR(a b)", "a:b", "body:foo", "role:user", "(", ")", "((a", "a)", "a OR", "AND",
    "OR b", "^a", "-a", "+", "\\", "'", "col:", "{body}: x", "a AND (b", '"a" "b',
    "\x00", "😀", "a\tb\nc",
]


@pytest.mark.parametrize("query", NASTY_QUERIES)
def test_nasty_queries_never_raise(store: HistoryStore, query: str) -> None:
    turn = ask(store, None, "plain question", "plain answer")
    assert isinstance(store.search_conversation(turn.conversation_id, query), list)
    assert isinstance(store.search_all(query), list)


def test_query_syntax_is_searched_as_text(store: HistoryStore) -> None:
    cid = ask(store, None, "Do NOT panic", "ratio a:b is NEAR( ten").conversation_id
    ask(store, cid, "something else", "unrelated")
    assert [h.role for h in store.search_conversation(cid, "NOT")] == ["user"]
    assert [h.turn for h in store.search_conversation(cid, "a:b")] == [1]
    assert [h.turn for h in store.search_conversation(cid, "NEAR(")] == [1]
    assert [h.turn for h in store.search_conversation(cid, 'panic"')] == [1]
    assert store.search_conversation(cid, "*") == []
    assert store.search_conversation(cid, "pan*") == []  # no prefix operator


@pytest.mark.parametrize("query", ["", "   ", "\n\t"])
def test_empty_query_returns_nothing(store: HistoryStore, query: str) -> None:
    cid = ask(store, None, "anything", "anything").conversation_id
    assert store.search_conversation(cid, query) == []
    assert store.search_all(query) == []


def test_quote_fts() -> None:
    assert quote_fts("hello world") == '"hello" "world"'
    assert quote_fts('say "hi"') == '"say" """hi"""'
    assert quote_fts("NEAR( a:b *") == '"NEAR(" "a:b" "*"'
    assert quote_fts("  ") == ""
    assert quote_fts("a\x00b") == '"a" "b"'


def test_rowid_helpers() -> None:
    assert message_rowid(1, 1, 0) == (1 << 32) | (1 << 8)
    assert message_rowid(3, 7, 5) == (3 << 32) | (7 << 8) | 5
    assert split_rowid(message_rowid(123456, 70000, 254)) == (123456, 70000, 254)
    lo, hi = conversation_rowid_range(2)
    assert (lo, hi) == (2 << 32, (2 << 32) | 0xFFFFFFFF)
    assert conversation_rowid_range(1)[1] + 1 == lo
    assert turn_rowid_range(2, 3) == (message_rowid(2, 3, 0), message_rowid(2, 3, SUMMARY_SLOT))
    assert lo < message_rowid(2, 1, 0) and message_rowid(2, (1 << 24) - 1, 255) == hi
    for bad in [(0, 1, 0), (1, 0, 0), (1, 1 << 24, 0), (1, 1, 256), (1 << 31, 1, 0)]:
        with pytest.raises(ValueError):
            message_rowid(*bad)


def test_overlong_turn_indexes_what_fits(store: HistoryStore, db_path: Path) -> None:
    messages = [user(f"msg{i}") for i in range(300)]
    conversation, _ = store.start_turn(NewTurn(None, "q", messages, [], None))
    store.finish_turn(conversation.id, 1, messages=messages, reply="", status="error")
    rows = fts_rows(db_path, conversation.id)
    assert len(rows) == 255
    assert split_rowid(rows[-1][0])[2] == 254  # the summary slot stays free
    turn = store.turn(conversation.id, 1)
    assert turn is not None and len(turn.messages) == 300  # nothing lost from the turn


# -- AsyncHistory ----------------------------------------------------------------------


def history_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("history")]


@pytest.mark.asyncio
async def test_async_history_runs_everything_on_one_thread(db_path: Path) -> None:
    history = await AsyncHistory.open(db_path)
    try:
        def where() -> tuple[int, str]:
            current = threading.current_thread()
            return current.ident or 0, current.name

        new = NewTurn(None, "async wombat", [user("async wombat")], [], None)
        conversation, _ = await history.run(HistoryStore.start_turn, new)
        places = await asyncio.gather(*(history._thread.submit(where) for _ in range(20)))
        assert len(set(places)) == 1
        ident, name = places[0]
        assert name.startswith("history")
        assert ident != threading.get_ident()
        assert [t.ident for t in history_threads()] == [ident]

        turns = await history.run(HistoryStore.turns, conversation.id)
        assert [t.text for t in turns] == ["async wombat"]
        assert await history.finish(TurnOutcome(conversation.id, 1, [user("async wombat")], "", "error"))
        hits = await history.run(HistoryStore.search_all, "wombat")
        assert [h.conversation_id for h in hits] == [conversation.id]
        # The connection was made on the history thread: this thread may not use it.
        with pytest.raises(sqlite3.ProgrammingError):
            history._store.get_conversation(conversation.id)
    finally:
        await history.close()

    assert history_threads() == []
    with pytest.raises(RuntimeError):
        await history.run(HistoryStore.list_conversations)
    await history.close()  # twice is harmless


@pytest.mark.asyncio
async def test_async_history_keeps_call_order(db_path: Path) -> None:
    history = await AsyncHistory.open(db_path)
    try:
        created = await asyncio.gather(*(history.run(HistoryStore.create_conversation, f"c{i}") for i in range(10)))
        assert [c.title for c in created] == [f"c{i}" for i in range(10)]
        assert [c.id for c in created] == list(range(1, 11))
    finally:
        await history.close()


@pytest.mark.asyncio
async def test_a_cancelled_caller_still_has_its_call_run(db_path: Path) -> None:
    history = await AsyncHistory.open(db_path)
    release = threading.Event()
    try:
        blocker = history._thread.submit(lambda: release.wait(5))
        queued = asyncio.ensure_future(history.run(HistoryStore.create_conversation, "sent, then abandoned"))
        await asyncio.sleep(0.05)  # both sent; the second waits behind the first
        blocker.cancel()
        queued.cancel()
        release.set()
        titles = [c.title for c in await history.run(HistoryStore.list_conversations)]
        assert titles == ["sent, then abandoned"]
        assert queued.cancelled()
    finally:
        await history.close()


@pytest.mark.asyncio
async def test_async_history_propagates_errors(db_path: Path) -> None:
    history = await AsyncHistory.open(db_path)
    try:
        with pytest.raises(LookupError):
            await history.run(HistoryStore.start_turn, NewTurn(7, "q", [user("q")], [], None))
        assert await history.run(HistoryStore.list_conversations) == []
    finally:
        await history.close()


@pytest.mark.asyncio
async def test_async_history_open_failure_leaves_no_thread(tmp_path: Path) -> None:
    directory = tmp_path / "a-directory"
    directory.mkdir()
    with pytest.raises(StartupError) as refused:
        await AsyncHistory.open(directory)
    assert isinstance(refused.value.__cause__, sqlite3.OperationalError)
    assert str(directory) in refused.value.message and "move it aside" in refused.value.message
    await asyncio.sleep(0)
    for thread in history_threads():
        thread.join(timeout=2)
    assert history_threads() == []


def test_attachments_are_stored_with_their_turn_and_scoped(store: HistoryStore) -> None:
    doc = NewAttachment(name="report.pdf", path="/home/u/report.pdf", kind="pdf",
                        content_type="application/pdf", size_bytes=4520, sha256="ab" * 32,
                        pages=3, full_text="[page 1]\nhello")
    pic = NewAttachment(name="cat.png", path="/home/u/cat.png", kind="image",
                        content_type="image/png", size_bytes=99, sha256="cd" * 32)
    conv, turn = store.start_turn(NewTurn(None, "look", [user("look")], [], None, "t", attachments=[doc, pic]))
    other, _ = store.start_turn(NewTurn(None, "other", [user("other")], [], None, "t2"))
    listed = store.attachments(conv.id)
    assert [a.name for a in listed] == ["report.pdf", "cat.png"]
    assert listed[0].turn == turn.turn and listed[0].pages == 3
    assert listed[0].has_text is True and listed[1].has_text is False
    assert listed[0].full_text is None  # the list never carries the text
    assert listed[0].to_json()["filename"] == "report.pdf"
    assert store.has_attachments(conv.id) and not store.has_attachments(other.id)
    loaded = store.attachment(conv.id, listed[0].id)
    assert loaded is not None and loaded.full_text == "[page 1]\nhello"
    # the same id through another conversation is not found
    assert store.attachment(other.id, listed[0].id) is None
    assert store.attachments(other.id) == []
    store.delete_conversation(conv.id)
    assert store.attachments(conv.id) == [] and not store.has_attachments(conv.id)
    assert store.attachment(conv.id, listed[0].id) is None


def test_reindexing_a_turn_rewrites_only_what_changed(store: HistoryStore, db_path: Path) -> None:
    conversation, _ = store.start_turn(NewTurn(None, "q", [user("first question")], [], None))
    cid = conversation.id
    store.finish_turn(cid, 1, messages=[user("first question")], reply="", status="error")
    with closing(sqlite3.connect(db_path)) as conn, conn:
        conn.execute("BEGIN IMMEDIATE")
        same = [user("first question"), assistant("an answer"), assistant("more")]
        assert history_fts.index_turn(conn, cid, 1, same) == 2  # the question was already there
        assert history_fts.index_turn(conn, cid, 1, same) == 0
        changed = [user("first question, edited"), assistant("an answer")]
        assert history_fts.index_turn(conn, cid, 1, changed) == 1
        conn.commit()
    assert [row[2] for row in fts_rows(db_path, cid)] == ["first question, edited", "an answer"]
    # what the user said follows the question, the replies never in it; a question that only asks leaves it
    assert said_rows(db_path) == ["first question, edited"]
    with closing(sqlite3.connect(db_path)) as conn, conn:
        history_fts.index_turn(conn, cid, 1, [user("Only asking? Really?"), assistant("an answer")])
    assert said_rows(db_path) == []


def said_rows(db_path: Path) -> list[str]:
    with closing(sqlite3.connect(db_path)) as conn:
        return [row[0] for row in conn.execute("SELECT body FROM said_fts ORDER BY rowid")]


def test_before_turn_leaves_out_the_running_turn(store: HistoryStore) -> None:
    cid = ask(store, None, "the walrus question", "walrus answer").conversation_id
    ask(store, cid, "walrus again", "ok")
    store.start_turn(NewTurn(cid, "where was the walrus", [user("where was the walrus")], [], None))
    assert {h.turn for h in store.search_conversation(cid, "walrus")} == {1, 2}  # indexed once it ends
    store.finish_turn(cid, 3, messages=[user("where was the walrus")], reply="", status="cancelled")
    assert {h.turn for h in store.search_conversation(cid, "walrus")} == {1, 2, 3}
    assert {h.turn for h in store.search_conversation(cid, "walrus", before_turn=3)} == {1, 2}
    assert store.search_conversation(cid, "walrus", before_turn=1) == []
    assert len(store.search_conversation(cid, "walrus", before_turn=10**9)) == 4  # turn 1 twice


@pytest.fixture
def few_frequent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A phrase in more than 3 messages counts as frequent, as one in 100,000 does at scale."""
    monkeypatch.setattr(history_search, "FREQUENT_DOCS", 3)


@pytest.mark.usefixtures("few_frequent")
def test_frequent_words_filter_but_do_not_rank(store: HistoryStore) -> None:
    cid = ask(store, None, "common filler", "common words here").conversation_id
    ask(store, cid, "common heron", "common")
    ask(store, cid, "heron heron heron", "no")  # the best heron match, but not "common"
    ask(store, cid, "common heron heron", "common")
    hits = store.search_conversation(cid, "common heron")
    # every hit holds both words; ranked by "heron" alone (two of them beat one)
    assert [(h.turn, h.role) for h in hits] == [(4, "user"), (2, "user")]
    assert hits[0].rank > hits[1].rank > 0
    alone = {(h.turn, h.role): h.rank for h in store.search_conversation(cid, "heron")}
    assert hits[0].rank == alone[(4, "user")]  # "common" added nothing to the score
    assert "[common]" in hits[0].excerpt and "[heron]" in hits[0].excerpt


@pytest.mark.usefixtures("few_frequent")
def test_a_query_of_frequent_words_lists_newest_first(store: HistoryStore) -> None:
    cid = ask(store, None, "common common common", "x").conversation_id
    for i in range(4):
        ask(store, cid, f"common {i}", "y")
    ask(store, cid, "nothing", "common answer")
    hits = store.search_conversation(cid, "common", limit=3)
    assert [(h.turn, h.role) for h in hits] == [(6, "assistant"), (5, "user"), (4, "user")]
    assert [h.rank for h in hits] == [0.0, 0.0, 0.0]
    assert [h.turn for h in store.search_conversation(cid, "common", role="user", limit=2)] == [5, 4]
    assert [h.turn for h in store.search_all("common", limit=1)] == [6]


def test_only_the_newest_matches_are_ranked(store: HistoryStore, monkeypatch: pytest.MonkeyPatch) -> None:
    cid = ask(store, None, "tapir tapir tapir", "x").conversation_id  # the best, but oldest
    ask(store, cid, "tapir once", "y")
    ask(store, cid, "tapir twice tapir", "z")
    assert store.search_conversation(cid, "tapir", limit=1)[0].turn == 1
    monkeypatch.setattr(history_search, "CONVERSATION_CAP", 2)
    assert [h.turn for h in store.search_conversation(cid, "tapir")] == [3, 2]
    monkeypatch.setattr(history_search, "ALL_CAP", 1)
    assert [h.turn for h in store.search_all("tapir")] == [3]


def test_phrase_classes_are_remembered(store: HistoryStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history_search, "FREQUENT_DOCS", 2)
    cid = ask(store, None, "stoat", "stoat").conversation_id
    counts: list[str] = []
    store._conn.set_trace_callback(
        lambda sql: counts.append(sql) if "LIMIT" in sql and "count(*)" in sql else None
    )
    store.search_conversation(cid, "stoat")
    store.search_conversation(cid, "stoat")
    assert len(counts) == 1  # weighed (2 rows), and 0 rows indexed since
    ask(store, cid, "a stoat", "b")  # one more row holding it: it may be frequent now
    hits = store.search_conversation(cid, "stoat")
    assert len(counts) == 2 and [h.rank for h in hits] == [0.0, 0.0, 0.0]  # 3 rows: frequent
    store.search_conversation(cid, "stoat")
    assert len(counts) == 2  # frequent stays frequent...
    other = ask(store, None, "x", "y").conversation_id
    store.delete_conversation(other)
    store.unindex_deleted(other)
    store.search_conversation(cid, "stoat")
    assert len(counts) == 3  # ...until rows are deleted


def test_answered_turns_start_after_a_compaction(store: HistoryStore) -> None:
    first = ask(store, None, "one", "first answer")
    cid = first.conversation_id
    _, failed = store.start_turn(NewTurn(cid, "two", [user("two")], [], None))
    store.finish_turn(cid, failed.turn, messages=[user("two")], reply="", status="error", error="boom")
    ask(store, cid, "three", "third answer")
    ask(store, cid, "four", "fourth answer")
    assert [(n, m[0]["content"]) for n, m in store.answered_turns(cid, 5)] == [
        (1, "one"), (3, "three"), (4, "four"),
    ]
    assert [n for n, _ in store.answered_turns(cid, 4, after=1)] == [3]
    assert store.answered_turns(cid, 5, after=4) == []
    store.delete_conversation(cid)
    assert store.answered_turns(cid, 5) == []


def test_a_turn_keeps_the_ref_its_ask_carried(tmp_path: Path) -> None:
    with HistoryStore(tmp_path / "history.db") as store:
        conversation, started = store.start_turn(NewTurn(None, "q", [user("q")], [], None, ref="canvas-7"))
        _, plain = store.start_turn(NewTurn(conversation.id, "q2", [user("q2")], [], None))
        assert started.ref == "canvas-7"
        assert [t.ref for t in store.turns(conversation.id)] == ["canvas-7", None]
        assert store.turn(conversation.id, 1).to_json()["ref"] == "canvas-7"  # type: ignore[union-attr]
        assert plain.to_json()["ref"] is None


def test_a_refused_import_is_discarded_only_while_it_is_all_imported(store: HistoryStore) -> None:
    turns = [("q1", "a1"), ("q2", "a2")]
    made = store.import_conversation(turns, thread_digest(turns, "Be terse."), title="q1", model=None,
                                     system_prompt="Be terse.")
    assert store.thread_conversation(thread_digest(turns, "Be terse.")) == made.id
    assert store.thread_conversation(thread_digest(turns)) is None  # another system prompt, another thread
    assert store.search_all("q1") != []
    assert store.discard_import(made.id)
    assert store.get_conversation(made.id) is None and store.search_all("q1") == []
    assert store.thread_conversation(thread_digest(turns, "Be terse.")) is None

    kept = store.import_conversation(turns, thread_digest(turns), title="q1", model=None, system_prompt=None)
    ask(store, kept.id, "q3", "a3")  # a question went on with it meanwhile
    assert not store.discard_import(kept.id)
    assert store.get_conversation(kept.id) is not None
