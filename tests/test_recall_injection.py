"""Recall injection through the real socket: the conversation's own archive searched before
each turn and its passages put before the question (docs/DESIGN.md, "Recall injection").

The earlier turns are made by the store (an import, then a compaction that folds most of
them), as the daemon would have made them, so each test costs one or two model requests.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from client import Wire, of_type
from core import Config
from history import HistoryStore
from core import estimate_text
from kbinject.archive import BLOCK_FOOTER, BLOCK_HEADER
from selfcheck.fakerouter import FakeModel, FakeRouter, Reply, default_models
from selfcheck.samples import make_pdf, make_png
from tests.conftest import serving
from tests.e2e_tools import scenarios
from tests.test_client import cli

pytestmark = pytest.mark.asyncio

SMALL = "fake-1k"  # a llama-server started with -c 1024
LARGE = "fake-16k"
LARGER = "fake-32k"

FILLER = [
    ("Tell me about tea.", "Tea is a drink made from leaves."),
    ("How is green tea made?", "The leaves are steamed and dried."),
    ("And black tea?", "The leaves are oxidised first."),
    ("What about the weather today?", "It looks sunny."),
    ("Should I take a jacket?", "A light one will do."),
    ("What is a good book to read?", "Try a classic novel."),
]
LOCKER = ("My locker code is 4711.", "Noted.")


@pytest.fixture
def router() -> Iterator[FakeRouter]:
    models = [*default_models(), FakeModel(SMALL, ["text"], n_ctx=1024), FakeModel(LARGE, ["text"], n_ctx=16384),
              FakeModel(LARGER, ["text"], n_ctx=32768)]
    with FakeRouter(models=models) as fake:
        fake.embed_dim = 256
        yield fake


def archived(config: Config, turns: list[tuple[str, str]], through: int, settings: dict[str, Any] | None = None) -> int:
    """A conversation of ``turns`` whose turns 1..``through`` a compaction folded away."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    with HistoryStore(config.db_path) as store:
        conv = store.import_conversation(turns, f"digest-{len(turns)}-{through}", title="t", model=None,
                                         system_prompt=None)
        if through:
            store.add_compaction(conv.id, through, "We talked about tea, the weather and books.")
        if settings:
            store.update_conversation(conv.id, settings=settings)
    return conv.id


def last_request(router: FakeRouter) -> dict[str, Any]:
    return [r for r in router.requests if r.get("stream")][-1]


def question_text(request: dict[str, Any]) -> str:
    content = request["messages"][-1]["content"]
    return content if isinstance(content, str) else "\n".join(p.get("text", "") for p in content)


async def chat(wire: Wire, router: FakeRouter, cid: int, exchanges: list[tuple[str, str]]) -> None:
    """``exchanges`` asked in conversation ``cid``, each answered as scripted."""
    for question, answer in exchanges:
        router.script(Reply(text=answer))
        assert (await wire.ask(question, conversation=cid))[-1]["type"] == "done"


def recall_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in of_type(events, "progress") if e["stage"] == "recall"]


async def test_a_folded_fact_is_recalled_before_the_question_and_shown(config: Config, router: FakeRouter) -> None:
    cid = archived(config, [FILLER[0], LOCKER, *FILLER[1:]], through=5)
    async with serving(config) as (_, wire):
        router.script(Reply(text="It is 4711."))
        events = await wire.ask("What is my locker code?", conversation=cid)
        assert events[-1]["type"] == "done", events[-1]
        sent = last_request(router)
        text = question_text(sent)
        assert text.startswith(BLOCK_HEADER)
        assert "turn 2, you said: My locker code is 4711.\n" in text
        assert text.endswith(f"{BLOCK_FOOTER}\n\nWhat is my locker code?")
        # only this turn's message carries it: nothing before the question mentions the code
        assert not any("4711" in json.dumps(m) for m in sent["messages"][:-1])
        shown = recall_events(events)
        assert [e["sources"] for e in shown] == [[{"recall": "turn", "turn": 2, "role": "user"}]]
        assert shown[0]["detail"] == "recalled: turn 2"
        kinds = [e["type"] for e in events]
        assert kinds.index("progress", kinds.index("user")) < kinds.index("delta")
        opened = await wire.request({"type": "open", "conversation": cid})
        last = opened["turns"][-1]
        assert last["recalled"] == [{"recall": "turn", "turn": 2, "role": "user"}]
        assert last["sources"] == []
        # the next turn replays the question without its passages
        router.script(Reply(text="Sure."))
        events = await wire.ask("Thanks, and how is oolong made?", conversation=cid)
        assert events[-1]["type"] == "done"
        replayed = last_request(router)["messages"]
        assert {"role": "user", "content": "What is my locker code?"} in replayed
        assert not any(BLOCK_HEADER in json.dumps(m) for m in replayed[:-1])


async def test_a_question_that_needs_nothing_gets_no_passage(config: Config, router: FakeRouter) -> None:
    cats = ("I have 12 cats and a dog.", "That is a lot of cats.")
    cid = archived(config, [FILLER[0], LOCKER, cats, *FILLER[1:]], through=6)
    async with serving(config) as (_, wire):
        router.script(Reply(text="144."))
        events = await wire.ask("what is 12 times 12?", conversation=cid)
        assert events[-1]["type"] == "done"
        assert question_text(last_request(router)) == "what is 12 times 12?"
        assert [e["sources"] for e in recall_events(events)] == [[]]
        opened = await wire.request({"type": "open", "conversation": cid})
        assert opened["turns"][-1]["recalled"] == []


@pytest.mark.parametrize("question", ["what was it again?", "the code I gave you"])
async def test_a_short_question_that_refers_back_finds_its_passage(
    config: Config, router: FakeRouter, question: str
) -> None:
    recent = [("I am at the gym and my locker will not open.", "Try the code you set for it.")]
    cid = archived(config, [FILLER[0], LOCKER, *FILLER[1:], *recent], through=6)
    async with serving(config) as (_, wire):
        router.script(Reply(text="4711."))
        events = await wire.ask(question, conversation=cid)
        assert events[-1]["type"] == "done"
        assert "turn 2, you said: My locker code is 4711." in question_text(last_request(router))
        assert [e["sources"] for e in recall_events(events)] == [[{"recall": "turn", "turn": 2, "role": "user"}]]


async def test_a_short_question_ranks_only_what_holds_its_own_words(config: Config, router: FakeRouter) -> None:
    # "colour" and "widget" are too few: the last turn's words are searched too, but a passage
    # must hold one of the question's own. Twenty notes of the last turn's rarer words outranked
    # every widget, filled the candidates, and the floor then dropped them all.
    notes = [(f"Zebra quartz note {n}.", "Noted.") for n in range(20)]
    widgets = [(f"A widget of size {n}.", "Ok.") for n in range(24)]
    turns = [*notes, *widgets, ("The zebra widget is green.", "Ok."), *FILLER * 6, ("Any zebra quartz?", "Rare.")]
    cid = archived(config, turns, through=len(turns) - 1)
    async with serving(config) as (_, wire):
        router.script(Reply(text="Green."))
        events = await wire.ask("And what colour is the widget?", conversation=cid)
        assert events[-1]["type"] == "done", events[-1]
        text = question_text(last_request(router))
        assert "you said: The zebra widget is green." in text
        assert "Zebra quartz note" not in text


async def test_passages_stand_oldest_first_so_the_newest_is_nearest_the_question(
    config: Config, router: FakeRouter
) -> None:
    gym, office = ("My gym locker code is 4711.", "Noted."), ("My office locker code is 9090.", "Noted.")
    cid = archived(config, [FILLER[0], gym, FILLER[1], office, *FILLER[2:]], through=6)
    async with serving(config) as (_, wire):
        router.script(Reply(text="4711 at the gym, 9090 at the office."))
        events = await wire.ask("What is my locker code?", conversation=cid)
        assert events[-1]["type"] == "done"
        text = question_text(last_request(router))
        # two facts, not one restated: both stand, the later nearest the question
        assert text.index(gym[0]) < text.index(office[0]) < text.index("What is my locker code?")
        assert [s["turn"] for s in recall_events(events)[0]["sources"]] == [2, 4]


async def test_a_fact_said_again_later_replaces_the_older_one(config: Config, router: FakeRouter) -> None:
    changed = ("I changed my locker code to 9090 today.", "Noted, 9090.")
    cid = archived(config, [FILLER[0], LOCKER, FILLER[1], changed, *FILLER[2:]], through=6)
    async with serving(config) as (_, wire):
        router.script(Reply(text="9090."))
        events = await wire.ask("What is my locker code?", conversation=cid)
        assert events[-1]["type"] == "done"
        text = question_text(last_request(router))
        # the later message holds every word of the older but its number: only the later is shown
        assert "turn 4, you said: I changed my locker code to 9090 today." in text
        assert "4711" not in text
        assert recall_events(events)[0]["sources"] == [{"recall": "turn", "turn": 4, "role": "user"}]


async def test_what_the_prompt_already_holds_is_not_recalled(config: Config, router: FakeRouter) -> None:
    # the fact was folded away, then said again in a turn the prompt still replays
    cid = archived(config, [FILLER[0], LOCKER, *FILLER[1:], LOCKER], through=6)
    async with serving(config) as (_, wire):
        router.script(Reply(text="4711."))
        events = await wire.ask("What is my locker code?", conversation=cid)
        assert events[-1]["type"] == "done"
        sent = last_request(router)
        assert question_text(sent) == "What is my locker code?"
        assert sum("My locker code is 4711." in json.dumps(m) for m in sent["messages"]) == 1
        assert [e["sources"] for e in recall_events(events)] == [[]]


async def test_recalled_passages_share_the_context_budget(config: Config, router: FakeRouter) -> None:
    # three long passages, each about a third of a 1,024-token context: not all fit
    long_facts = [
        (f"Locker note {n}: my gym locker code is 47{n}1. " + "The gym has many lockers in rows. " * 28, "Noted.")
        for n in range(3)
    ]
    cid = archived(config, [*FILLER, *long_facts, *FILLER[:2]], through=9)
    with HistoryStore(config.db_path) as store:
        store.update_conversation(cid, model=SMALL)
    async with serving(config) as (_, wire):
        router.script(Reply(text="Which one?"))
        events = await wire.ask("What is my gym locker code?", conversation=cid)
        assert events[-1]["type"] == "done", events[-1]
        sent = last_request(router)
        recalled = recall_events(events)[0]["sources"]
        assert 1 <= len(recalled) < 3
        assert question_text(sent).count("you said: Locker note") == len(recalled)
        tokens = sum(len(json.dumps(m)) for m in sent["messages"]) / 4
        assert tokens < 1024


async def test_kb_passages_come_first_then_recalled_ones_then_the_question(
    config: Config, router: FakeRouter, tmp_path: Path
) -> None:
    cid = archived(config, [FILLER[0], ("The pump in my cellar is a Grundfos.", "Noted."), *FILLER[1:]], through=5)
    async with serving(config) as (_, wire):
        docs = tmp_path / "docs"
        docs.mkdir()
        (docs / "pump.md").write_text("The cellar pump needs oil every spring and a new seal every year.\n")
        rid = await wire.send({"type": "kb_add", "kb": "notes", "paths": [str(docs)]})
        assert (await wire.until(rid, ("kb", "error")))[-1]["type"] == "kb"
        assert (await wire.request({"type": "kb_link", "kb": "notes"}))["type"] == "kb"
        router.script(Reply(text="Oil it."))
        events = await wire.ask("How do I look after the cellar pump?", conversation=cid)
        assert events[-1]["type"] == "done"
        text = question_text(last_request(router))
        kb, recalled = text.index("[Knowledge Base Context]"), text.index(BLOCK_HEADER)
        assert kb < recalled < text.index("How do I look after the cellar pump?")
        assert "turn 2, you said: The pump in my cellar is a Grundfos." in text
        opened = await wire.request({"type": "open", "conversation": cid})
        last = opened["turns"][-1]
        assert [s["file"] for s in last["sources"]] == ["pump.md"]
        assert last["recalled"] == [{"recall": "turn", "turn": 2, "role": "user"}]


def tool_names(request: dict[str, Any]) -> set[str]:
    return {tool["function"]["name"] for tool in request.get("tools") or ()}


@pytest.mark.parametrize("mode", ["tool_only", "off"])
async def test_the_setting_keeps_the_archive_out_of_the_prompt(
    config: Config, router: FakeRouter, mode: str
) -> None:
    cid = archived(config, [FILLER[0], LOCKER, *FILLER[1:]], through=5)
    async with serving(config) as (_, wire):
        shown = await wire.request({"type": "settings", "conversation": cid, "recall_injection": mode})
        assert shown["settings"]["recall_injection"] == mode
        router.script(Reply(text="I do not know."))
        events = await wire.ask("What is my locker code?", conversation=cid)
        assert events[-1]["type"] == "done", events[-1]
        sent = last_request(router)
        assert question_text(sent) == "What is my locker code?"
        assert recall_events(events) == []
        # tool_only leaves the model its recall tools; off takes them away too
        assert ("conversation_search" in tool_names(sent)) == (mode == "tool_only")


async def test_a_bad_setting_is_refused_and_auto_comes_back(config: Config, router: FakeRouter) -> None:
    cid = archived(config, [FILLER[0], LOCKER, *FILLER[1:]], through=5, settings={"recall_injection": "off"})
    async with serving(config) as (_, wire):
        refused = await wire.request({"type": "settings", "conversation": cid, "recall_injection": "sometimes"})
        assert refused["type"] == "error" and refused["code"] == "bad_request"
        assert "auto, tool_only, off" in refused["message"]
        assert (await wire.request({"type": "settings", "conversation": cid, "recall_injection": "auto"}))[
            "settings"]["recall_injection"] == "auto"
        router.script(Reply(text="4711."))
        events = await wire.ask("What is my locker code?", conversation=cid)
        assert "My locker code is 4711." in question_text(last_request(router))
        assert events[-1]["type"] == "done"


async def test_the_configuration_sets_the_default(
    config: Config, router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASSISTANT_RECALL_INJECTION", "tool_only")
    from core import load_config

    config = load_config()
    cid = archived(config, [FILLER[0], LOCKER, *FILLER[1:]], through=5)
    async with serving(config) as (_, wire):
        router.script(Reply(text="?"))
        events = await wire.ask("What is my locker code?", conversation=cid)
        assert question_text(last_request(router)) == "What is my locker code?"
        assert recall_events(events) == []


async def test_a_part_of_a_file_cut_to_fit_is_recalled_with_its_name(
    config: Config, router: FakeRouter, tmp_path: Path
) -> None:
    lines = [f"Line {n}: nothing of note here, only padding words." for n in range(1200)]
    lines[600] = "The warranty number of the dishwasher is W-55821."
    notes = tmp_path / "notes.txt"
    notes.write_text("\n".join(lines) + "\n")
    async with serving(config) as (_, wire):
        router.script(Reply(text="Read it."))
        events = await wire.ask("Keep this file.", files=[str(notes)])
        assert events[-1]["type"] == "done", events[-1]
        assert "W-55821" not in json.dumps(last_request(router)["messages"])  # cut to fit
        cid = events[-1]["conversation"]
        router.script(Reply(text="W-55821."))
        events = await wire.ask("What is the dishwasher warranty number?", conversation=cid)
        assert events[-1]["type"] == "done", events[-1]
        text = question_text(last_request(router))
        assert "notes.txt (attached in turn 1): " in text and "W-55821" in text
        sources = recall_events(events)[0]["sources"]
        assert [(s["recall"], s["file"], s["turn"]) for s in sources] == [("file", "notes.txt", 1)]
        assert recall_events(events)[0]["detail"] == "recalled: notes.txt"


async def test_estimate_counts_the_passages_a_question_would_recall(config: Config, router: FakeRouter) -> None:
    cid = archived(config, [FILLER[0], LOCKER, *FILLER[1:]], through=5)
    async with serving(config) as (_, wire):
        question = "What is my locker code?"
        plain = await wire.request({"type": "estimate", "conversation": cid, "text": "what is 12 times 12?"})
        assert plain["recall_tokens"] == 0 and plain["recalled"] == []
        assert plain["tokens"] == estimate_text("what is 12 times 12?")
        estimated = await wire.request({"type": "estimate", "conversation": cid, "text": question})
        assert estimated["recalled"] == [{"recall": "turn", "turn": 2, "role": "user"}]
        assert estimated["tokens"] == estimate_text(question) + estimated["recall_tokens"]
        router.script(Reply(text="4711."))
        events = await wire.ask(question, conversation=cid)
        assert events[-1]["type"] == "done"
        block = question_text(last_request(router)).removesuffix(f"\n\n{question}")
        assert estimated["recall_tokens"] == estimate_text(block)


async def test_the_cli_says_what_was_recalled_on_stderr(config: Config, router: FakeRouter) -> None:
    archived(config, [FILLER[0], LOCKER, *FILLER[1:]], through=5)
    async with serving(config):
        router.script(Reply(text="It is 4711."))
        code, out, err = await cli("ask", "-c", "What is my locker code?")
        assert code == 0, err
        assert out.strip() == "It is 4711."
        assert "recalled: turn 2\n" in err
        router.script(Reply(text="144."))
        code, out, err = await cli("ask", "-c", "what is 12 times 12?")
        assert code == 0 and "recalled" not in err


async def test_a_page_of_a_folded_pdf_is_recalled_with_its_page(
    config: Config, router: FakeRouter, tmp_path: Path
) -> None:
    pages = ["Quarterly report of the Lisbon office.", "Revenue grew by nine percent.",
             "The new office manager is Ana Duarte, from March.", "Outlook for next year is stable."]
    pdf = make_pdf(tmp_path / "report.pdf", pages)
    async with serving(config) as (_, wire):
        router.script(Reply(text="Noted."))
        events = await wire.ask("Here is the report.", files=[str(pdf)])
        assert events[-1]["type"] == "done", events[-1]
        cid = events[-1]["conversation"]
        await chat(wire, router, cid, FILLER[:3])
    with HistoryStore(config.db_path) as store:  # a compaction folds the file's turn away
        store.add_compaction(cid, 2, "The user shared a report and asked about tea.")
    async with serving(config) as (_, wire):
        router.script(Reply(text="Ana Duarte."))
        events = await wire.ask("Who is the new office manager?", conversation=cid)
        assert events[-1]["type"] == "done", events[-1]
        sent = last_request(router)
        assert "Ana Duarte" not in json.dumps(sent["messages"][:-1])
        assert "report.pdf, page 3: The new office manager is Ana Duarte, from March." in question_text(sent)
        shown = recall_events(events)[0]
        assert shown["detail"] == "recalled: report.pdf p3"
        found = [(s["recall"], s["file"], s["page"], s["turn"]) for s in shown["sources"]]
        assert found == [("file", "report.pdf", 3, 1)]


@pytest.mark.parametrize("kind", ["recall", "file", "followup", "none"])
async def test_the_real_model_scenarios_recall_in_a_few_requests(
    config: Config, router: FakeRouter, tmp_path: Path, kind: str
) -> None:
    """tests/e2e_tools' scenarios (issue 49, item 4), their mechanics on the fake router: the long
    past is stored, not generated, the needle is folded away and recalled, at most three requests."""
    async with serving(config) as (_, wire):
        run = await scenarios.SCENARIOS[kind](wire, 1, tmp_path, config.db_path)
    assert run.error is None
    assert len([r for r in router.requests if r.get("stream")]) <= 3
    if kind in scenarios.EXPECTED_RECALL:
        assert run.compacted
        assert any(label.endswith(scenarios.EXPECTED_RECALL[kind]) for label in run.recalled), run.to_json()
        assert run.needle in question_text(last_request(router))
    else:
        assert run.recalled == []
    if kind == "file":
        # every page says "order report", page 3 alone answers: the real model read pages 1
        # and 2 as well, and its first token came 2.2 times later than without recall
        assert [label for label in run.recalled if ".pdf" in label] == ["report-1.pdf p3"], run.recalled


@pytest.mark.parametrize("kind", sorted(scenarios.RECALL_TWINS))
async def test_a_recall_scenarios_plain_twin_asks_the_same_with_no_passage(
    config: Config, router: FakeRouter, tmp_path: Path, kind: str
) -> None:
    """bench_recall.py's plain twin (``--compare``): the same past, tools and question, no passage."""
    async with serving(config) as (_, wire):
        run = await scenarios.SCENARIOS[kind](wire, 1, tmp_path, config.db_path)
        with_recall = last_request(router)
        twin = await scenarios.RECALL_TWINS[kind](wire, 1, tmp_path, config.db_path, "tool_only")
        plain = last_request(router)
    assert twin.error is None and twin.mode == "tool_only" and twin.compacted and twin.recalled == []
    assert plain["tools"] == with_recall["tools"]  # the prompts differ by the recalled block alone
    assert twin.needle == run.needle and twin.asking_first_token is not None
    assert question_text(with_recall).endswith(question_text(plain)) and run.needle not in question_text(plain)
    assert plain["messages"][1:-1] == with_recall["messages"][1:-1]  # the same past, after the system message
    assert run.needle not in json.dumps(plain["messages"])


async def test_a_word_most_of_the_conversation_holds_recalls_nothing(config: Config, router: FakeRouter) -> None:
    teas = [(f"I drank a cup of tea at {hour} o'clock.", "Tea is nice.") for hour in range(1, 9)]
    cid = archived(config, [*teas, LOCKER, *teas[:2]], through=9)
    async with serving(config) as (_, wire):
        router.script(Reply(text="Tea."))
        events = await wire.ask("What about tea?", conversation=cid)
        assert events[-1]["type"] == "done"
        assert question_text(last_request(router)) == "What about tea?"
        assert [e["sources"] for e in recall_events(events)] == [[]]
        router.script(Reply(text="4711."))
        events = await wire.ask("And my locker code, with my tea?", conversation=cid)
        assert "turn 9, you said: My locker code is 4711." in question_text(last_request(router))


async def test_a_question_of_files_alone_recalls_nothing(config: Config, router: FakeRouter, tmp_path: Path) -> None:
    recent = [("I am at the gym and my locker will not open.", "Try the code you set for it.")]
    cid = archived(config, [FILLER[0], LOCKER, *FILLER[1:], *recent], through=6)
    photo = make_png(tmp_path / "locker.png")
    async with serving(config) as (_, wire):
        router.script(Reply(text="A picture."))
        events = await wire.ask("", files=[str(photo)], conversation=cid, model="fake-vision")
        assert events[-1]["type"] == "done", events[-1]
        assert recall_events(events) == []
        assert "4711" not in json.dumps(last_request(router)["messages"])


async def test_a_word_most_of_a_files_pages_hold_is_common_though_few_messages_say_it(
    config: Config, router: FakeRouter, tmp_path: Path
) -> None:
    # the messages are counted first, and a file's chunks only when they could make a word common:
    # "kettle" and "kitchen" are in one message but on every page, "shelf" on all but one: common
    pages = [f"Page {n}: the kettle stands on shelf {n} of the kitchen." for n in range(1, 9)]
    pages[4] = "Page 5: the descaler is in the blue cupboard, beside the kettle."
    pdf = make_pdf(tmp_path / "kitchen.pdf", pages)
    async with serving(config) as (_, wire):
        router.script(Reply(text="Noted."))
        events = await wire.ask("Here is the kitchen plan; mind the kettle.", files=[str(pdf)])
        assert events[-1]["type"] == "done", events[-1]
        cid = events[-1]["conversation"]
        await chat(wire, router, cid, FILLER[:3])
    with HistoryStore(config.db_path) as store:
        store.add_compaction(cid, 2, "The user shared a kitchen plan and asked about tea.")
    async with serving(config) as (_, wire):
        router.script(Reply(text="On a shelf."))
        events = await wire.ask("Which kitchen shelf has the kettle?", conversation=cid)
        assert events[-1]["type"] == "done", events[-1]
        assert question_text(last_request(router)) == "Which kitchen shelf has the kettle?"
        assert [e["sources"] for e in recall_events(events)] == [[]]
        router.script(Reply(text="In the blue cupboard."))
        events = await wire.ask("Which kitchen shelf has the kettle descaler?", conversation=cid)
        assert "kitchen.pdf, page 5: Page 5: the descaler is in the blue cupboard" in question_text(last_request(router))


BOILER = "The boiler was serviced by Kowalski Heating on 3 March; the next service is due next spring.\n"


def chunked_files(config: Config) -> list[str]:
    """The names of the files recall has chunked (those a search took)."""
    with closing(sqlite3.connect(config.db_path)) as conn:
        return [row[0] for row in conn.execute(
            "SELECT DISTINCT a.name FROM attachment_chunks AS c JOIN attachments AS a ON a.id = c.attachment_id "
            "ORDER BY a.name")]


def long_notes(path: Path, lines: int = 1200, at: int | None = None) -> Path:
    """A text file of padding with the dishwasher's warranty number on line ``at`` (its middle)."""
    text = [f"Line {n}: nothing of note here, only padding words." for n in range(lines)]
    text[lines // 2 if at is None else at] = "The warranty number of the dishwasher is W-55821."
    path.write_text("\n".join(text) + "\n")
    return path


async def test_a_file_sent_whole_is_searched_only_once_its_turn_is_folded(
    config: Config, router: FakeRouter, tmp_path: Path
) -> None:
    boiler = tmp_path / "boiler.txt"
    boiler.write_text(BOILER)
    async with serving(config) as (_, wire):
        router.script(Reply(text="Noted."))
        events = await wire.ask("Here are my boiler notes.", files=[str(boiler)])
        assert events[-1]["type"] == "done", events[-1]
        cid = events[-1]["conversation"]
        assert "Kowalski Heating" in question_text(last_request(router))  # whole in the prompt
        assert recall_events(events) == []  # nothing out of the prompt: no search, nothing said
        router.script(Reply(text="Kowalski Heating."))
        events = await wire.ask("Who serviced the boiler?", conversation=cid)
        assert events[-1]["type"] == "done", events[-1]
        assert question_text(last_request(router)) == "Who serviced the boiler?"
        assert recall_events(events) == []  # the file's turn is replayed whole
        await chat(wire, router, cid, FILLER[:2])
    assert chunked_files(config) == []  # never searched, never chunked
    with HistoryStore(config.db_path) as store:  # a compaction folds the file's turn away
        store.add_compaction(cid, 2, "The user shared notes and asked about tea.")
    async with serving(config) as (_, wire):
        router.script(Reply(text="Kowalski Heating."))
        events = await wire.ask("Who serviced the boiler?", conversation=cid)
        assert events[-1]["type"] == "done", events[-1]
        sent = last_request(router)
        assert "Kowalski" not in json.dumps(sent["messages"][:-1])
        assert f"boiler.txt (attached in turn 1): {BOILER.strip()}" in question_text(sent)
        sources = recall_events(events)[0]["sources"]
        assert ("file", "boiler.txt", 1) in [(s["recall"], s.get("file"), s["turn"]) for s in sources]
    assert chunked_files(config) == ["boiler.txt"]


async def test_of_files_asked_together_only_the_one_cut_to_fit_is_searched(
    config: Config, router: FakeRouter, tmp_path: Path
) -> None:
    notes = long_notes(tmp_path / "notes.txt")
    boiler = tmp_path / "boiler.txt"
    boiler.write_text(BOILER)
    async with serving(config) as (_, wire):
        router.script(Reply(text="Read them."))
        events = await wire.ask("Keep these files.", files=[str(notes), str(boiler)])
        assert events[-1]["type"] == "done", events[-1]
        sent = json.dumps(last_request(router)["messages"])
        assert "W-55821" not in sent and "Kowalski Heating" in sent  # the notes cut to fit, the boiler's whole
        assert [e["sources"] for e in recall_events(events)] == [[]]  # the cut notes searched at once
        cid = events[-1]["conversation"]
        router.script(Reply(text="W-55821."))
        events = await wire.ask("What is the dishwasher warranty number?", conversation=cid)
        assert events[-1]["type"] == "done", events[-1]
        text = question_text(last_request(router))
        assert "notes.txt (attached in turn 1): " in text and "W-55821" in text
        assert [s["file"] for s in recall_events(events)[0]["sources"]] == ["notes.txt"]
    assert chunked_files(config) == ["notes.txt"]  # the file sent whole was never chunked


async def test_a_file_whose_turn_got_no_answer_is_out_of_the_prompt_and_recalled(
    config: Config, router: FakeRouter, tmp_path: Path
) -> None:
    boiler = tmp_path / "boiler.txt"
    boiler.write_text(BOILER)
    async with serving(config) as (_, wire):
        router.script(Reply(status=500, error="the model crashed"))
        events = await wire.ask("Here are my boiler notes.", files=[str(boiler)])
        assert events[-1]["type"] == "error", events[-1]
        cid = of_type(events, "user")[0]["conversation"]
        router.script(Reply(text="Kowalski Heating."))
        events = await wire.ask("Who serviced the boiler?", conversation=cid)
        assert events[-1]["type"] == "done", events[-1]
        sent = last_request(router)
        assert "Kowalski" not in json.dumps(sent["messages"][:-1])  # a turn without an answer is not replayed
        assert f"boiler.txt (attached in turn 1): {BOILER.strip()}" in question_text(sent)


async def test_a_file_sent_whole_but_replayed_cut_is_searched(
    config: Config, router: FakeRouter, tmp_path: Path
) -> None:
    # whole for a model of 32,768 tokens (about 41,600 characters); a model of 16,384 replays a
    # message of at most 8,192 tokens: its head (two thirds) and tail, line 500 cut out (a smaller
    # model has too little room for passages beside that half and the tools' definitions)
    notes = long_notes(tmp_path / "notes.txt", 800, at=500)
    async with serving(config) as (_, wire):
        router.script(Reply(text="Read it."))
        events = await wire.ask("Keep this file.", files=[str(notes)], model=LARGER)
        assert events[-1]["type"] == "done", events[-1]
        assert "W-55821" in json.dumps(last_request(router)["messages"])
        assert recall_events(events) == []
        cid = events[-1]["conversation"]
        router.script(Reply(text="W-55821."))
        events = await wire.ask("What is the dishwasher warranty number?", conversation=cid, model=LARGE)
        assert events[-1]["type"] == "done", events[-1]
        sent = last_request(router)
        assert "W-55821" not in json.dumps(sent["messages"][:-1])  # cut out of the replayed question
        assert "notes.txt (attached in turn 1): " in question_text(sent) and "W-55821" in question_text(sent)
