"""Recall injection across conversations (issue 48 items 2 and 3), through the real socket and
the fake router: the user's other conversations and the saved memories searched before each
turn, their passages labelled with where and when they were said, the newest nearest the
question, never an incognito conversation's (docs/MEMORY.md, docs/DESIGN.md "Recall injection").

The other conversations are written by the store, dated as a test needs, so each question
costs one model request.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from typing import Any

import pytest

from core import Config, estimate_text
from history import ArchiveHit, ElsewhereHit, HistoryStore
from kbinject.archive import BLOCK_FOOTER, ELSEWHERE_HEADER, Passage, fit, format_block
from kbinject.elsewhere import MAX_PASSAGE_CHARS, ElsewherePassage, asks_again, day_label
from selfcheck.fakerouter import FakeRouter, Reply
from tests.conftest import serving
from tests.test_recall_injection import archived, last_request, question_text, recall_events

pytestmark = pytest.mark.asyncio

OCTOBER = "2026-10-05T09:00:00.000000Z"
NOVEMBER = "2026-11-02T18:30:00.000000Z"
FILLER = [("Tell me about tea.", "Tea is a drink made from leaves."), ("And the weather?", "It looks sunny.")]


BROMPTON = "My bike is a 2019 Brompton with 16 inch tyres."


def past(
    config: Config, title: str, turns: list[tuple[str, str]], at: str, settings: dict[str, Any] | None = None
) -> int:
    """A conversation of ``turns`` the store keeps, dated ``at``."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    with HistoryStore(config.db_path) as store:
        conv = store.import_conversation(turns, f"digest-{title}-{at}", title=title, model=None, system_prompt=None,
                                         at=at)
        if settings:
            store.update_conversation(conv.id, settings=settings)
    return conv.id


async def test_another_conversations_fact_reaches_a_new_conversation_labelled_with_title_and_date(
    config: Config, router: FakeRouter
) -> None:
    bike = past(config, "Bike fitting", [FILLER[0], (BROMPTON, "A fine folding bike.")], NOVEMBER)
    async with serving(config) as (_, wire):
        router.script(Reply(text="16 inch."))
        events = await wire.ask("What size are my bike tyres?")
        assert events[-1]["type"] == "done", events[-1]
        cid = events[0]["conversation"]
        text = question_text(last_request(router))
        assert text.startswith(ELSEWHERE_HEADER)
        assert f"in “Bike fitting”, {day_label(NOVEMBER)}: you said: {BROMPTON}\n" in text
        assert text.endswith(f"{BLOCK_FOOTER}\n\nWhat size are my bike tyres?")
        assert "tea" not in text.lower()  # only what bears on the question
        source = {"recall": "conversation", "conversation": bike, "title": "Bike fitting", "date": "2026-11-02",
                  "turn": 2, "role": "user"}
        [shown] = recall_events(events)
        assert shown["sources"][0] == source
        assert shown["detail"].startswith(f"recalled: “Bike fitting” {day_label(NOVEMBER)}")
        opened = await wire.request({"type": "open", "conversation": cid})
        assert opened["turns"][-1]["recalled"][0] == source
        # a question the past says nothing of gets nothing; the passage is not replayed
        router.script(Reply(text="144."))
        events = await wire.ask("what is 12 times 12?", conversation=cid)
        sent = last_request(router)
        assert question_text(sent) == "what is 12 times 12?"
        assert not any("Brompton" in json.dumps(m) for m in sent["messages"][:-1])
        assert recall_events(events) == []  # other conversations searched in vain: no progress


async def test_a_conversation_whose_settings_are_damaged_is_recalled_from_as_one_of_no_setting(
    config: Config, router: FakeRouter
) -> None:
    bike = past(config, "Bike fitting", [FILLER[0], (BROMPTON, "A fine folding bike.")], NOVEMBER)
    with sqlite3.connect(config.db_path) as db:  # hand-edited: the store reads it as {} (memory on)
        db.execute("UPDATE conversations SET settings = '{\"memory\": ' WHERE id = ?", (bike,))
    async with serving(config) as (_, wire):
        router.script(Reply(text="16 inch."))
        events = await wire.ask("What size are my bike tyres?")
        assert events[-1]["type"] == "done", events[-1]
        text = question_text(last_request(router))
        assert f"in “Bike fitting”, {day_label(NOVEMBER)}: you said: {BROMPTON}\n" in text
        assert "recall failed" not in json.dumps(recall_events(events))


async def test_the_later_fact_stands_nearest_the_question(config: Config, router: FakeRouter) -> None:
    # the newer conversation written first: the order is the dates', not the ids'
    past(config, "Moving", [("I moved: I live in Porto now.", "Congratulations on the move.")], NOVEMBER)
    past(config, "Trams", [("I live in Lisbon and ride tram 28.", "A famous line.")], OCTOBER)
    async with serving(config) as (_, wire):
        router.script(Reply(text="Porto."))
        events = await wire.ask("Which city do I live in?")
        assert events[-1]["type"] == "done"
        text = question_text(last_request(router))
        lisbon = text.index(f"in “Trams”, {day_label(OCTOBER)}: you said: I live in Lisbon")
        porto = text.index(f"in “Moving”, {day_label(NOVEMBER)}: you said: I moved: I live in Porto now.")
        assert lisbon < porto < text.index(BLOCK_FOOTER)  # the newest nearest the question
        assert [s["date"] for s in recall_events(events)[0]["sources"]] == ["2026-10-05", "2026-11-02"]


async def test_a_memory_saved_after_the_conversation_began_is_injected_but_not_its_frozen_ones(
    config: Config, router: FakeRouter
) -> None:
    async with serving(config) as (_, wire):
        await wire.request({"type": "memory_add", "text": "I am vegetarian and cook Italian food"})
        cid = (await wire.ask("hello"))[0]["conversation"]
        saved = (await wire.request({"type": "memory_add", "text": "I am allergic to peanuts"}))["memory"]
        router.script(Reply(text="Skip the satay."))
        events = await wire.ask("Am I allergic to the peanuts in satay?", conversation=cid)
        text = question_text(last_request(router))
        assert f"you asked me to remember ({day_label(saved['updated_at'])}): I am allergic to peanuts\n" in text
        assert recall_events(events)[0]["sources"] == [
            {"recall": "memory", "memory": saved["id"], "date": saved["updated_at"][:10]}]
        router.script(Reply(text="Yes."))
        events = await wire.ask("Should my Italian food stay vegetarian?", conversation=cid)
        assert "vegetarian" in json.dumps(last_request(router)["messages"][0])  # its system prompt holds it
        assert question_text(last_request(router)) == "Should my Italian food stay vegetarian?"  # not again


async def test_an_incognito_conversation_neither_reads_nor_is_read(config: Config, router: FakeRouter) -> None:
    past(config, "Secret", [("My safe combination is 31-47-02.", "Kept.")], OCTOBER, settings={"memory": "off"})
    past(config, "Bike", [(BROMPTON, "Nice.")], OCTOBER)
    async with serving(config) as (_, wire):
        router.script(Reply(text="I do not know."))
        events = await wire.ask("What is my safe combination?")
        assert question_text(last_request(router)) == "What is my safe combination?"
        assert recall_events(events) == []
        router.script(Reply(text="I do not know."))
        events = await wire.ask("What size are my bike tyres?", memory="off")
        assert question_text(last_request(router)) == "What size are my bike tyres?"
        assert recall_events(events) == []


async def test_the_settings_turn_the_cross_conversation_part_off(config: Config, router: FakeRouter) -> None:
    past(config, "Bike", [(BROMPTON, "Nice.")], OCTOBER)
    async with serving(config) as (_, wire):
        cid = (await wire.ask("hello"))[0]["conversation"]
        await wire.request({"type": "settings", "conversation": cid, "recall_injection": "tool_only"})
        router.script(Reply(text="?"))
        await wire.ask("What size are my bike tyres?", conversation=cid)
        assert "Brompton" not in question_text(last_request(router))
        await wire.request({"type": "settings", "conversation": cid, "recall_injection": "auto"})
        router.script(Reply(text="16 inch."))
        await wire.ask("What size are my bike tyres?", conversation=cid)
        assert "Brompton" in question_text(last_request(router))  # the same question, with it on
    async with serving(dataclasses.replace(config, memory="off")) as (_, wire):
        router.script(Reply(text="?"))
        await wire.ask("What size are my bike tyres?")
        assert "Brompton" not in question_text(last_request(router))
    async with serving(dataclasses.replace(config, recall_injection="off")) as (_, wire):
        router.script(Reply(text="?"))
        await wire.ask("What size are my bike tyres?")
        assert "Brompton" not in question_text(last_request(router))


async def test_the_conversations_own_passage_ranks_first_and_all_stand_by_date(
    config: Config, router: FakeRouter
) -> None:
    past(config, "Gym", [("My gym locker code is 9021.", "Noted.")], OCTOBER)
    cid = archived(config, [FILLER[0], ("My office locker code is 4711.", "Noted."), *FILLER, *FILLER], through=5)
    async with serving(config) as (_, wire):
        router.script(Reply(text="4711 at the office, 9021 at the gym."))
        events = await wire.ask("What is my locker code?", conversation=cid)
        text = question_text(last_request(router))
        assert text.startswith(ELSEWHERE_HEADER)
        gym = text.index(f"in “Gym”, {day_label(OCTOBER)}: you said: My gym locker code is 9021.")
        office = text.index("turn 2, you said: My office locker code is 4711.")
        assert gym < office  # October before this conversation's turn of today
        sources = recall_events(events)[0]["sources"]
        assert [s["recall"] for s in sources] == ["conversation", "turn"]


async def test_a_fact_restated_in_a_later_conversation_replaces_the_older(
    config: Config, router: FakeRouter
) -> None:
    """bench_memory_model's "updated" kind: shown both, the real 1.5B model answered the older
    value 5 times of 10; shown the later alone, 10 of 10 (docs/DESIGN.md, "The later fact wins")."""
    past(config, "Music", [("My harbour guitar code is 8393.", "Noted.")], OCTOBER)
    past(config, "Errands", [("My harbour guitar code changed: now it is 6344.", "Noted.")], NOVEMBER)
    async with serving(config) as (_, wire):
        router.script(Reply(text="6344."))
        events = await wire.ask("What is my harbour guitar code?")
        assert events[-1]["type"] == "done"
        text = question_text(last_request(router))
        assert f"in “Errands”, {day_label(NOVEMBER)}: you said: My harbour guitar code changed: now it is 6344." in text
        assert "8393" not in text and "Music" not in text
        assert [s["recall"] for s in recall_events(events)[0]["sources"]] == ["conversation"]


async def test_the_budget_drops_other_conversations_passages_before_the_conversations_own() -> None:
    own = Passage("My office locker code is 4711.", ArchiveHit(2, "", 0.0, n=0, role="user"), date=NOVEMBER)
    hit = ElsewhereHit(7, "Gym", OCTOBER, 1, 0, "user", "My gym locker code is 9021.", 0.0)
    other = ElsewherePassage(hit.text, hit.created_at, hit=hit)
    both = fit([own, other], 0, 10**6)
    assert [p.source()["recall"] for p in both.passages] == ["turn", "conversation"]
    one = fit([own, other], 0, estimate_text(format_block([own])))  # room for one: the own one stays
    assert one.passages == [own] and one.block is not None and "9021" not in one.block


async def test_conversations_asking_the_same_words_keep_the_follow_ups_prefix(
    config: Config, router: FakeRouter
) -> None:
    """`make e2e`'s case: four conversations ask the same words but a number, each answered at
    length. Another's question says nothing this one does not, and another's answer is not what
    the user said: nothing is recalled, so each follow-up's prompt repeats the first request
    whole and the server reads only the new exchange (docs/DESIGN.md, "Across conversations")."""
    system = "You are a helpful assistant. " + " ".join(f"Rule {n}: name colours plainly." for n in range(20))
    async with serving(config) as (_, wire):
        for n in range(4):
            router.script(Reply(text=f"Colour number {n}: blue. " + "Another colour name is a hue. " * 60))
            first = await wire.ask(f"Name a colour, number {n}.", system=system)
            assert first[-1]["type"] == "done", first[-1]
            asked = last_request(router)
            router.script(Reply(text="Another colour: green."))
            follow_up = await wire.ask("And another one?", conversation=first[0]["conversation"])
            assert follow_up[-1]["type"] == "done", follow_up[-1]
            sent = last_request(router)
            assert sent["messages"][: len(asked["messages"])] == asked["messages"], n
            assert sent["messages"][len(asked["messages"])] == {"role": "assistant", "content": first[-1]["text"]}
            assert recall_events(first) == recall_events(follow_up) == []


async def test_what_the_user_said_is_recalled_not_the_models_answers_and_cut_to_a_memorys_length(
    config: Config, router: FakeRouter
) -> None:
    # the model's old answer is not the user's memory (and here it is wrong); the user's long
    # message is cut to the part that bears on the question
    past(config, "Gym", [("Where should I keep my gym bag?", "Your gym locker code is 1234, keep it there.")],
         OCTOBER)
    story = "We walked along the river for hours. " * 30
    said = f"{story}My garage door code is 5580, the one by the shed. {story}"
    past(config, "Weekend", [(said, "What a walk.")], NOVEMBER)
    async with serving(config) as (_, wire):
        router.script(Reply(text="I do not know."))
        events = await wire.ask("What is my gym locker code?")
        assert question_text(last_request(router)) == "What is my gym locker code?"
        assert recall_events(events) == []
        router.script(Reply(text="5580."))
        await wire.ask("What is my garage door code?")
        text = question_text(last_request(router))
        start = text.index(f"in “Weekend”, {day_label(NOVEMBER)}: you said: … ")
        passage = text[start:].split(": ", 2)[2].split("\n")[0]
        assert "My garage door code is 5580" in passage and len(passage) <= MAX_PASSAGE_CHARS


async def test_a_question_asked_again_tells_nothing() -> None:
    assert asks_again("Name a colour, number 1.", "Name a colour, number 0.")
    assert asks_again("And another one?", "and another one")
    assert not asks_again("What is my locker code?", "My locker code is 4711.")
    assert not asks_again("Am I allergic to peanuts?", "I am allergic to peanuts")
    assert not asks_again("Name a colour", "Name a colour for my bike frame, it is a Brompton")
    assert asks_again("What size are my bike tyres?", "What tyre size does my bike take? Is it 16 inch?")
    assert not asks_again("What size are my bike tyres?", "My bike is a Brompton. Which tyres fit it?")
    # a request that says nothing of the user asks too; one that does, or a statement beside it, tells
    assert asks_again("Who rides a bike?", "Tell me about Brompton bikes. Keep it short.")
    assert not asks_again("Who rides a bike?", "Write a toast for my sister: she rides a bike.")
    assert not asks_again("Who rides a bike?", "Explain gears. I ride a Brompton.")


async def test_questions_asked_in_many_conversations_do_not_crowd_out_what_the_user_said(
    config: Config, router: FakeRouter
) -> None:
    # 100 conversations asked about the bike, each question holding "bike" thrice: ranked among what
    # the user said, they filled every candidate place above the one statement, and nothing was
    # recalled (a question is never recalled from elsewhere). 300 turns beside them keep "bike" rare.
    config.data_dir.mkdir(parents=True, exist_ok=True)
    with HistoryStore(config.db_path) as store:
        for n in range(100):
            turns = [("Is a bike a good bike? Which bike is fast?", "It depends."), *FILLER, ("Thanks.", "Welcome.")]
            store.import_conversation(turns, f"digest-asked-{n}", title=f"Asked {n}", model=None,
                                      system_prompt=None, at=OCTOBER)
    past(config, "Commute", [FILLER[0], ("I ride a 2019 Brompton bike to work.", "Nice.")], NOVEMBER)
    async with serving(config) as (_, wire):
        router.script(Reply(text="A Brompton."))
        events = await wire.ask("What bike do I have?")
        assert events[-1]["type"] == "done", events[-1]
        text = question_text(last_request(router))
        assert f"in “Commute”, {day_label(NOVEMBER)}: you said: I ride a 2019 Brompton bike to work.\n" in text
        assert "Which bike is fast" not in text
        # deleted, it is gone from what the user said at once: nothing of it is recalled
        [shown] = recall_events(events)
        commute = shown["sources"][0]["conversation"]
        assert (await wire.request({"type": "delete", "conversation": commute}))["type"] != "error"
        router.script(Reply(text="I do not know."))
        events = await wire.ask("What bike do I have?")
        assert "Brompton" not in json.dumps(last_request(router)["messages"])
        assert recall_events(events) == []
    with sqlite3.connect(config.db_path) as db:
        assert db.execute("SELECT count(*) FROM said_fts WHERE said_fts MATCH 'brompton'").fetchone() == (0,)


async def test_a_request_that_says_nothing_of_the_user_is_not_recalled_but_one_that_does_is(
    config: Config, router: FakeRouter
) -> None:
    past(config, "Bikes", [("Tell me about Brompton bikes.", "They fold.")], OCTOBER)
    toast = "Write a toast for my sister Ana: she rides her Brompton bike everywhere."
    past(config, "Toast", [(toast, "To Ana!")], NOVEMBER)
    async with serving(config) as (_, wire):
        router.script(Reply(text="Ana does."))
        events = await wire.ask("Who rides a Brompton bike?")
        assert events[-1]["type"] == "done", events[-1]
        text = question_text(last_request(router))
        assert f"in “Toast”, {day_label(NOVEMBER)}: you said: {toast}\n" in text
        assert "Tell me about Brompton bikes" not in text and "“Bikes”" not in text
