"""Compaction: the plan; the summary, from an in-process fake model (and once through the
router client and the fake router on loopback); and its storage."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from core import Config
from core.errors import RouterError, RouterUnreachable
from core.router import RouterClient
from history import HistoryStore, NewTurn, SUMMARY_SLOT, message_rowid
from recall import plan_compaction, summarize, summary_message, transcript
from recall.compaction import SUMMARY_INSTRUCTIONS
from selfcheck.fakerouter import FakeRouter, Reply
from tests.fakemodel import FakeModel

# -- plan_compaction ---------------------------------------------------------------------

TURNS = [(1, 400), (2, 300), (3, 200), (4, 100), (5, 100)]  # 1,100 tokens


def test_nothing_to_fold_when_the_prompt_fits() -> None:
    assert plan_compaction(TURNS, fixed_tokens=400, ctx_max=2000, compact_at=0.75) is None  # 1,500 = limit
    assert plan_compaction([], fixed_tokens=100, ctx_max=2000, compact_at=0.75) is None


def test_folds_the_fewest_oldest_turns_that_make_it_fit() -> None:
    # 1,100 + 500 = 1,600 > 1,500: turn 1 (400) is enough
    assert plan_compaction(TURNS, fixed_tokens=500, ctx_max=2000, compact_at=0.75) == 1
    # 1,100 + 1,200 = 2,300: 400 and 300 leave 1,600, so 200 must go too
    assert plan_compaction(TURNS, fixed_tokens=1200, ctx_max=2000, compact_at=0.75) == 3


def test_the_last_turns_are_never_folded() -> None:
    # 1,100 + 1,300: even folding turns 1-3 leaves 1,500 > 1,000; that is as far as it goes
    assert plan_compaction(TURNS, fixed_tokens=1300, ctx_max=2000, compact_at=0.5) == 3
    assert plan_compaction(TURNS, fixed_tokens=1300, ctx_max=2000, compact_at=0.5, keep_last=4) == 1
    assert plan_compaction(TURNS, fixed_tokens=1300, ctx_max=2000, compact_at=0.5, keep_last=0) == 5
    # nothing may be folded: only the kept turns are there
    assert plan_compaction(TURNS[:2], fixed_tokens=5000, ctx_max=2000, compact_at=0.75) is None
    assert plan_compaction(TURNS, fixed_tokens=5000, ctx_max=2000, compact_at=0.75, keep_last=5) is None


def test_turn_numbers_need_not_be_consecutive() -> None:
    gappy = [(2, 500), (5, 500), (9, 100), (12, 100)]  # turns without a reply are not replayed
    assert plan_compaction(gappy, fixed_tokens=300, ctx_max=1000, compact_at=1.0) == 2
    assert plan_compaction(gappy, fixed_tokens=400, ctx_max=1000, compact_at=1.0) == 5


def test_an_unknown_context_size_plans_nothing() -> None:
    assert plan_compaction(TURNS, fixed_tokens=10**6, ctx_max=0, compact_at=0.75) is None


@pytest.mark.parametrize(("compact_at", "keep_last"), [(0.0, 2), (1.5, 2), (-0.1, 2), (0.75, -1)])
def test_bad_plan_parameters(compact_at: float, keep_last: int) -> None:
    with pytest.raises(ValueError):
        plan_compaction(TURNS, fixed_tokens=0, ctx_max=1000, compact_at=compact_at, keep_last=keep_last)


# -- summarize -------------------------------------------------------------------------------


@pytest.fixture
def model() -> FakeModel:
    return FakeModel()


MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": [
        {"type": "text", "text": "Plan my trip to Lisbon, budget 900 euros.\n\n--- file: flights.csv ---\nTAP,189"},
        {"type": "text", "text": "[image: map.png]"},
        {"type": "image_ref", "name": "map.png", "path": "/home/u/map.png", "sha256": "ab"},
    ]},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "attachment_recall", "arguments": '{"action": "list"}'}},
    ]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"attachments": [], "count": 0}'},
    {"role": "assistant", "content": "Fly TAP for 189 euros; stay in Alfama."},
]


@pytest.mark.asyncio
async def test_summarize_asks_the_model_and_returns_its_summary(model: FakeModel) -> None:
    model.enqueue("- Trip to Lisbon, budget 900 euros.\n")
    summary = await summarize(model, "fake-text", None, MESSAGES, max_tokens=300)
    assert summary == "- Trip to Lisbon, budget 900 euros."

    (asked,) = model.completions
    assert (asked.model, asked.max_tokens, asked.params) == ("fake-text", 300, {})
    system, user = asked.messages
    assert system == {"role": "system", "content": SUMMARY_INSTRUCTIONS}
    for kept in ("decisions", "names", "numbers", "open", "file attached"):
        assert kept in system["content"]
    text = user["content"]
    assert "User: Plan my trip to Lisbon, budget 900 euros." in text
    assert "--- file: flights.csv ---" in text and "[image: map.png]" in text
    assert 'Assistant called attachment_recall({"action": "list"})' in text
    assert 'Tool result: {"attachments": [], "count": 0}' in text
    assert "Assistant: Fly TAP for 189 euros; stay in Alfama." in text
    assert "Summary of the conversation before" not in text


@pytest.mark.asyncio
async def test_summarize_leaves_out_the_models_thinking(model: FakeModel) -> None:
    model.enqueue("<think>let me see</think>\n- Trip to Lisbon.\n")
    assert await summarize(model, "fake-text", None, MESSAGES, max_tokens=50) == "- Trip to Lisbon."


@pytest.mark.asyncio
async def test_summarize_merges_the_previous_summary(model: FakeModel) -> None:
    model.enqueue("Merged.")
    assert await summarize(model, "fake-text", "Earlier: the user is Ana.", MESSAGES[-1:], max_tokens=50) == "Merged."
    text = model.completions[0].messages[1]["content"]
    assert text.index("Earlier: the user is Ana.") < text.index("Assistant: Fly TAP")
    assert "merging the earlier summary in" in text


@pytest.mark.asyncio
async def test_summarize_cuts_long_messages(model: FakeModel) -> None:
    document = "HEAD " + "x" * 50_000 + " TAIL"
    model.enqueue("ok")
    await summarize(model, "fake-text", None, [{"role": "user", "content": document}], max_tokens=50, max_input_chars=3000)
    text = model.completions[0].messages[1]["content"]
    assert len(text) < 3500
    assert "HEAD" in text and "TAIL" in text and "characters left out" in text


@pytest.mark.asyncio
@pytest.mark.parametrize("answer", ["", "   \n", "<think>hmm</think>   ", "<think>still thinking when max_tokens ran out"])
async def test_an_empty_summary_is_an_error(model: FakeModel, answer: str) -> None:
    model.enqueue(answer)
    with pytest.raises(RouterError, match="empty summary"):
        await summarize(model, "fake-text", None, MESSAGES, max_tokens=50)


@pytest.mark.asyncio
@pytest.mark.parametrize("error", [RouterError("model crashed"), RouterUnreachable("cannot connect")])
async def test_what_the_completer_raises_reaches_the_caller(model: FakeModel, error: Exception) -> None:
    model.enqueue(error)
    with pytest.raises(type(error), match=str(error)):
        await summarize(model, "fake-text", None, MESSAGES, max_tokens=50)


# the whole way once: the router client, HTTP on loopback, the fake router's answer


@pytest_asyncio.fixture
async def client(config: Config) -> AsyncIterator[RouterClient]:
    router_client = RouterClient(config)
    yield router_client
    await router_client.aclose()


@pytest.mark.asyncio
async def test_summarize_through_the_router_client(client: RouterClient, router: FakeRouter) -> None:
    router.script_complete(Reply(text="<think>let me see</think>\n- Trip to Lisbon, budget 900 euros.\n"))
    summary = await summarize(client, "fake-text", None, MESSAGES, max_tokens=300)
    assert summary == "- Trip to Lisbon, budget 900 euros."
    (request,) = [r for r in router.requests if not r.get("stream")]
    assert (request["model"], request["max_tokens"], request["stream"]) == ("fake-text", 300, False)
    assert [m["role"] for m in request["messages"]] == ["system", "user"]
    assert "User: Plan my trip to Lisbon" in request["messages"][1]["content"]

    router.script_complete(Reply(status=500, error="model crashed"))
    with pytest.raises(RouterError, match="model crashed"):
        await summarize(client, "fake-text", None, MESSAGES, max_tokens=50)


def test_transcript_skips_what_has_no_words() -> None:
    messages: list[Any] = [
        {"role": "assistant", "content": None},
        {"role": "tool", "content": ""},
        "not a message",
        {"role": "user", "content": [{"type": "image_ref", "name": "scan.pdf", "page": 3}]},
    ]
    assert transcript(messages) == "User: [image: scan.pdf, page 3]"


def test_summary_message_stands_for_the_folded_turns() -> None:
    message = summary_message("The user is Ana.", 7)
    assert message["role"] == "system"
    assert "turns 1-7" in message["content"] and message["content"].endswith("\nThe user is Ana.")
    assert "conversation_search" in message["content"] and "attachment_recall" in message["content"]
    assert "turn 1," in summary_message("x", 1)["content"]


# -- storage -----------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[HistoryStore]:
    with HistoryStore(tmp_path / "history.db") as opened:
        yield opened


def turns(store: HistoryStore, count: int) -> int:
    cid: int | None = None
    for n in range(count):
        question = {"role": "user", "content": f"question {n + 1}"}
        conversation, turn = store.start_turn(NewTurn(cid, question["content"], [question], [], None))
        cid = conversation.id
        store.finish_turn(cid, turn.turn, messages=[question, {"role": "assistant", "content": "answer"}],
                          reply="answer", status="complete")
    assert cid is not None
    return cid


def summary_rows(store: HistoryStore, cid: int) -> list[tuple[int, str, str]]:
    lo = message_rowid(cid, 1, 0)
    return [
        (row[0], row[1], row[2])
        for row in store._conn.execute(
            "SELECT rowid, role, body FROM message_fts WHERE rowid BETWEEN ? AND ? AND role = 'summary'",
            (lo, lo | 0xFFFFFFFF),
        )
    ]


def test_a_compaction_is_stored_and_findable(store: HistoryStore) -> None:
    cid = turns(store, 4)
    assert store.latest_compaction(cid) is None
    stored = store.add_compaction(cid, 2, "Ana plans a trip to Porto.")
    assert (stored.conversation_id, stored.through_turn, stored.summary) == (cid, 2, "Ana plans a trip to Porto.")
    assert store.latest_compaction(cid) == stored
    assert summary_rows(store, cid) == [(message_rowid(cid, 2, SUMMARY_SLOT), "summary", "Ana plans a trip to Porto.")]
    (hit,) = store.search_conversation(cid, "Porto")
    assert (hit.turn, hit.role, hit.created_at) == (2, "summary", stored.created_at)
    # the originals stay whole, in history and in the index
    assert [t.text for t in store.turns(cid)] == ["question 1", "question 2", "question 3", "question 4"]
    assert {h.turn for h in store.search_conversation(cid, "question")} == {1, 2, 3, 4}


def test_a_new_compaction_replaces_the_findable_summary(store: HistoryStore) -> None:
    cid = turns(store, 5)
    first = store.add_compaction(cid, 2, "First summary about Porto.")
    second = store.add_compaction(cid, 4, "Second summary about Porto and Braga.")
    assert store.latest_compaction(cid) == second
    assert [row[0] for row in summary_rows(store, cid)] == [message_rowid(cid, 4, SUMMARY_SLOT)]
    assert [h.turn for h in store.search_conversation(cid, "Porto")] == [4]
    rows = store._conn.execute("SELECT id FROM compactions WHERE conversation_id = ? ORDER BY id", (cid,))
    assert [row[0] for row in rows] == [first.id, second.id]  # the record keeps both


def test_refinishing_a_turn_keeps_its_summary(store: HistoryStore) -> None:
    cid = turns(store, 3)
    store.add_compaction(cid, 3, "About otters.")
    store.finish_turn(cid, 3, messages=[{"role": "user", "content": "question 3"}], reply="", status="error")
    assert [h.role for h in store.search_conversation(cid, "otters")] == ["summary"]


def test_compaction_of_a_missing_conversation_or_turn(store: HistoryStore) -> None:
    cid = turns(store, 2)
    with pytest.raises(LookupError, match="no turn 3"):
        store.add_compaction(cid, 3, "too far")
    with pytest.raises(LookupError, match="not found"):
        store.add_compaction(cid + 1, 1, "nobody")
    store.add_compaction(cid, 1, "About deleted things.")
    store.delete_conversation(cid)
    assert store.latest_compaction(cid) is None
    assert store.search_all("deleted") == []
    with pytest.raises(LookupError):
        store.add_compaction(cid, 1, "after the delete")
