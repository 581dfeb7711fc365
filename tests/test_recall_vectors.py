"""Recall injection with vectors (issue 49 item 1, issue 48's example), through the real socket
and the fake router, with an embedding model configured.

The fake router embeds a text as a hashed bag of its words (``fake_embedding``): texts that
share words point alike, stop words included, which the keywords' floor does not count.
So "What tyre size does my bike take?" and "My bike is a 2019 Brompton." are near (they
share "my" and "bike": cosine 0.41 at 512 dimensions), while the passage holds one keyword
of the question's four, under the keywords' floor (two): found through the vector alone.
"12 times 12" shares no word with it. The vectors are made in the background; a test waits
for that (``settled``) before it asks.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from client import Wire
from core import Config
from kbinject import recallvec
from kbinject.archive import BLOCK_HEADER, ELSEWHERE_HEADER
from kbinject.elsewhere import day_label
from selfcheck.fakerouter import FakeRouter, Reply
from tests.conftest import RunningDaemon, serving
from tests.test_memory_recall import FILLER, NOVEMBER, past
from tests.test_recall_injection import LOCKER, archived, last_request, question_text, recall_events

pytestmark = pytest.mark.asyncio

BIKE = "My bike is a 2019 Brompton."
TYRES = "What tyre size does my bike take?"


@pytest.fixture
def embedding(router: FakeRouter) -> Iterator[None]:
    router.embed_dim = 512  # few hash collisions between words
    yield


@asynccontextmanager
async def vectored(config: Config) -> AsyncIterator[tuple[RunningDaemon, Wire]]:
    """A daemon with an embedding model, once what it found to embed at its start is embedded."""
    async with serving(dataclasses.replace(config, embedding_model="fake-embed")) as (running, wire):
        await settled(running)
        yield running, wire


async def settled(running: RunningDaemon) -> None:
    assert running.server is not None
    await running.server._kbs.recall.settled()


def vector_rows(config: Config, conversation: int | None = None) -> int:
    with sqlite3.connect(config.db_path) as db:
        if conversation is None:
            return int(db.execute("SELECT count(*) FROM recall_vectors WHERE length(vector) > 0").fetchone()[0])
        return int(db.execute("SELECT count(*) FROM recall_vectors WHERE conversation_id = ?",
                              (conversation,)).fetchone()[0])


async def test_another_conversations_fact_is_found_by_its_vector_alone(
    config: Config, router: FakeRouter, embedding: None
) -> None:
    bike = past(config, "Bike fitting", [FILLER[0], (BIKE, "A fine folding bike.")], NOVEMBER)
    # keywords alone: one keyword of four is under the floor, nothing is recalled
    async with serving(config) as (_, wire):
        router.script(Reply(text="No idea."))
        events = await wire.ask(TYRES)
        assert question_text(last_request(router)) == TYRES
        assert recall_events(events) == []
    async with vectored(config) as (_, wire):
        assert vector_rows(config, bike) == 4  # its questions and answers; what the tool said is not searched
        router.script(Reply(text="16 inch."))
        events = await wire.ask(TYRES)
        assert events[-1]["type"] == "done", events[-1]
        first = last_request(router)
        text = question_text(first)
        assert text.startswith(ELSEWHERE_HEADER)
        assert f"in “Bike fitting”, {day_label(NOVEMBER)}: you said: {BIKE}\n" in text
        assert "tea" not in text.lower()
        [shown] = recall_events(events)
        assert shown["sources"][0]["conversation"] == bike
        # a question that shares no word with it gets nothing, and the passage is not replayed
        router.script(Reply(text="144."))
        events = await wire.ask("what is 12 times 12?", conversation=events[0]["conversation"])
        sent = last_request(router)
        assert question_text(sent) == "what is 12 times 12?"
        assert not any("Brompton" in str(m) for m in sent["messages"][:-1])
        # the prompt up to the last answer is the same bytes, the question as asked (cache-friendly)
        asked = len(first["messages"]) - 1
        assert sent["messages"][:asked] == first["messages"][:asked]
        assert sent["messages"][asked] == {"role": "user", "content": TYRES}
        assert recall_events(events) == []


async def test_the_asking_conversations_own_vectors_crowd_out_no_other_conversation(
    config: Config, router: FakeRouter, embedding: None
) -> None:
    bike = past(config, "Bike fitting", [FILLER[0], (BIKE, "A fine folding bike.")], NOVEMBER)
    # ninety messages nearer the question than the bike (by its stop words, so none of its keywords
    # grows common), all of the asking conversation: the other conversations' search looks past them
    turns = [(f"What does my {n} say?", f"What does my {n} mean?") for n in range(45)]
    cid = past(config, "Tyres", turns, NOVEMBER)
    async with vectored(config) as (_, wire):
        router.script(Reply(text="16 inch."))
        events = await wire.ask(TYRES, conversation=cid)
        assert events[-1]["type"] == "done", events[-1]
        text = question_text(last_request(router))
        assert f"in “Bike fitting”, {day_label(NOVEMBER)}: you said: {BIKE}\n" in text
        assert [s["conversation"] for s in recall_events(events)[0]["sources"]] == [bike]


async def test_a_folded_passage_of_the_conversation_is_found_by_its_vector(
    config: Config, router: FakeRouter, embedding: None
) -> None:
    cid = archived(config, [FILLER[0], (BIKE, "Noted."), *FILLER[1:]], through=3)
    async with vectored(config) as (_, wire):
        router.script(Reply(text="16 inch."))
        events = await wire.ask(TYRES, conversation=cid)
        text = question_text(last_request(router))
        assert text.startswith(BLOCK_HEADER)
        assert f"turn 2, you said: {BIKE}\n" in text
        assert [s["turn"] for s in recall_events(events)[0]["sources"]] == [2]


async def test_with_the_embedder_down_a_turn_recalls_by_keywords_and_vectors_catch_up_later(
    config: Config, router: FakeRouter, embedding: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recallvec, "RETRY_AFTER", 0.0)  # the next turn tries the embedder again
    router.embed_fail = True
    cid = archived(config, [FILLER[0], LOCKER, (BIKE, "Noted."), *FILLER[1:]], through=4)
    async with vectored(config) as (running, wire):
        assert vector_rows(config) == 0
        router.script(Reply(text="4711."))
        events = await wire.ask("What is my locker code?", conversation=cid)
        assert events[-1]["type"] == "done", events[-1]
        assert LOCKER[0] in question_text(last_request(router))  # the keywords found it
        await settled(running)
        assert vector_rows(config) == 0
        router.embed_fail = False
        router.script(Reply(text="Fine."))
        await wire.ask("Thanks, that helps.", conversation=cid)  # stored: the embedding goes on
        await settled(running)
        assert vector_rows(config, cid) > 0
        router.script(Reply(text="16 inch."))
        await wire.ask(TYRES, conversation=cid)
        assert f"you said: {BIKE}" in question_text(last_request(router))


async def test_deleting_a_conversation_removes_its_vectors_and_an_incognito_one_gets_none(
    config: Config, router: FakeRouter, embedding: None
) -> None:
    bike = past(config, "Bike fitting", [(BIKE, "A fine folding bike.")], NOVEMBER)
    hidden = past(config, "Secret", [("My boat is a 1970 Folkboat.", "Nice.")], NOVEMBER, {"memory": "off"})
    async with vectored(config) as (_, wire):
        assert vector_rows(config, bike) == 2
        assert vector_rows(config, hidden) == 0
        await wire.request({"type": "delete", "conversation": bike})
        assert vector_rows(config, bike) == 0
        router.script(Reply(text="No idea."))
        events = await wire.ask(TYRES)
        assert question_text(last_request(router)) == TYRES
        assert recall_events(events) == []


async def test_an_edited_memory_is_found_by_its_new_text_and_a_forgotten_one_not_at_all(
    config: Config, router: FakeRouter, embedding: None
) -> None:
    async with vectored(config) as (running, wire):
        router.script(Reply(text="Hello."))
        events = await wire.ask("Hello there.")  # its system prompt froze no memory
        cid = events[0]["conversation"]
        added = await wire.request({"type": "memory_add", "text": "My car is a 2015 Volvo."})
        memory = added["memory"]["id"]
        await wire.request({"type": "memory_edit", "memory": memory, "text": BIKE})
        await settled(running)
        router.script(Reply(text="16 inch."))
        events = await wire.ask(TYRES, conversation=cid)
        text = question_text(last_request(router))
        assert f"you asked me to remember (" in text and BIKE in text and "Volvo" not in text
        assert [s.get("memory") for s in recall_events(events)[0]["sources"]] == [memory]
        # forgotten: its vector goes with it
        await wire.request({"type": "memory_forget", "memory": memory})
        router.script(Reply(text="No idea."))
        events = await wire.ask(TYRES, conversation=cid)
        assert question_text(last_request(router)) == TYRES
        assert vector_rows(config, 0) == 0


async def test_an_embedder_that_does_not_answer_holds_up_no_turn(
    config: Config, router: FakeRouter, embedding: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recallvec, "QUERY_TIMEOUT", 0.2)  # the bound a turn waits out, made short
    cid = archived(config, [FILLER[0], LOCKER, (BIKE, "Noted."), *FILLER[1:]], through=4)
    router.embeddings_open.clear()  # every embedding request waits (the catch-up's too)
    try:
        async with serving(dataclasses.replace(config, embedding_model="fake-embed")) as (_, wire):
            router.script(Reply(text="4711."))
            events = await wire.ask("What is my locker code?", conversation=cid)
            assert events[-1]["type"] == "done", events[-1]
            assert LOCKER[0] in question_text(last_request(router))  # by its keywords
            assert router.embedding_requests  # the question was sent to the embedder, which kept it
    finally:
        router.embeddings_open.set()


async def test_a_never_said_fact_gets_no_look_alike_by_its_vector(
    config: Config, router: FakeRouter, embedding: None
) -> None:
    # five codes said, each "My ... code is N." as the question is worded: near by vector, and
    # holding "code", but "code" is what all the matches hold: it tells none of them apart
    for i, thing in enumerate(["gym locker", "garage door", "office safe", "bike lock", "club gate"]):
        past(config, f"codes {i}", [(f"My {thing} code is {4000 + i}.", "Noted.")], NOVEMBER)
    for i in range(10):  # enough else that "code" is not too common to search by
        past(config, f"chat {i}", FILLER, NOVEMBER)
    async with vectored(config) as (_, wire):
        router.script(Reply(text="I don't know."))
        events = await wire.ask("What is my harbour kayak code?")
        assert question_text(last_request(router)) == "What is my harbour kayak code?"
        assert recall_events(events) == []
        router.script(Reply(text="4003."))
        await wire.ask("What is my bike lock code?")  # said: found (by its keywords)
        assert "My bike lock code is 4003." in question_text(last_request(router))


async def test_a_turn_embeds_its_question_once_for_the_knowledge_bases_and_recall(
    config: Config, router: FakeRouter, embedding: None, tmp_path: Path
) -> None:
    past(config, "Bike fitting", [(BIKE, "A fine folding bike.")], NOVEMBER)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "tyres.md").write_text("# Tyres\n\nFolding bikes take 16 inch tyres, size 35-349.\n")
    async with vectored(config) as (running, wire):
        rid = await wire.send({"type": "kb_add", "kb": "manuals", "paths": [str(tmp_path / "docs")]})
        assert (await wire.until(rid, ("kb", "error")))[-1]["type"] == "kb"
        await wire.request({"type": "kb_link", "kb": "manuals"})
        router.script(Reply(text="16 inch."))
        events = await wire.ask(TYRES)
        assert [e["stage"] for e in events if e["type"] == "progress" and e["stage"] in ("kb", "recall")] == [
            "kb", "recall"]
        text = question_text(last_request(router))
        assert "35-349" in text and BIKE in text  # both searches used the question's vector
        await settled(running)
        # the question as a query, once; as a stored message (with its answer) once more, after the turn
        queries = [r["input"] for r in router.embedding_requests if len(r["input"]) == 1 and TYRES in r["input"][0]]
        assert queries == [[TYRES]]
