"""Prompts a real model server can reuse, through the real socket.

A model server such as llama-server keeps the last prompt (and the reply it wrote)
and reuses the longest common prefix of the next one; everything after the first
changed byte is read again.  These tests hold the daemon to the rules that make that
work and that keep a conversation alive in a small context: what comes before the
previous answer never changes (but at a compaction), every request caps its reply so
the next question still fits, and an oversize past is folded or cut, never fatal.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client import Wire, of_type
from core import Config
from history import HistoryStore
from selfcheck.fakeprompt import render_prompt, text_tokens
from selfcheck.fakerouter import FakeModel, FakeRouter, Reply, default_models
from selfcheck.samples import make_png
from tests.conftest import RunningDaemon, serving

pytestmark = pytest.mark.asyncio

SMALL = "fake-1k"  # a llama-server started with -c 1024


@pytest.fixture
def router() -> Iterator[FakeRouter]:
    models = [*default_models(), FakeModel(SMALL, ["text", "image"], n_ctx=1024)]
    with FakeRouter(models=models) as fake:
        fake.embed_dim = 256
        yield fake


def turn_requests(router: FakeRouter) -> list[dict[str, Any]]:
    """The streamed chat requests, one per model round."""
    return [r for r in router.requests if r.get("stream")]


def assert_reuses(before: dict[str, Any], after: dict[str, Any], answer: str) -> None:
    """``after`` repeats ``before`` up to its question, then that question and its answer.

    The question may come back without the passages it carried (they were for that turn).
    """
    old, new = before["messages"], after["messages"]
    assert new[: len(old) - 1] == old[:-1], "something before the previous question changed"
    question = new[len(old) - 1]
    assert question["role"] == "user"
    assert new[len(old)] == {"role": "assistant", "content": answer}


async def kb_linked(wire: Wire, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "bees.md").write_text("Honey bees dance to tell the hive where the flowers are.\n" * 4)
    (docs / "pump.md").write_text("The pump needs oil every spring and a new seal every year.\n" * 4)
    rid = await wire.send({"type": "kb_add", "kb": "notes", "paths": [str(docs)]})
    assert (await wire.until(rid, ("kb", "error")))[-1]["type"] == "kb"
    assert (await wire.request({"type": "kb_link", "kb": "notes"}))["type"] == "kb"


async def test_the_prompt_before_the_previous_answer_never_changes_with_a_kb(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    await kb_linked(wire, tmp_path)
    questions = ["why do bees dance?", "and the pump?", "how often oil?", "what about the hive?"]
    cid, answers = None, []
    for n, question in enumerate(questions):
        router.script(Reply(text=f"Answer {n}."))
        events = await wire.ask(question, **({"conversation": cid} if cid else {}))
        assert events[-1]["type"] == "done", events[-1]
        assert any(e["stage"] == "kb" for e in of_type(events, "progress"))
        cid = events[0]["conversation"]
        answers.append(events[-1]["text"])
    sent = turn_requests(router)
    assert len(sent) == len(questions)
    system = sent[0]["messages"][0]
    for n in range(1, len(sent)):
        assert sent[n]["messages"][0] == system
        assert_reuses(sent[n - 1], sent[n], answers[n - 1])
        # the passages ride with this turn's question, and only with it
        assert "[Knowledge Base Context]" in json.dumps(sent[n]["messages"][-1])
        assert "[Knowledge Base Context]" not in json.dumps(sent[n]["messages"][:-1])
        assert sent[n]["messages"][len(sent[n - 1]["messages"]) - 1] == {"role": "user", "content": questions[n - 1]}


async def test_the_prompt_before_the_previous_answer_never_changes_with_recall(
    config: Config, router: FakeRouter
) -> None:
    """Recalled passages ride with their turn's question only: the prefix the server holds stays."""
    filler = [(f"Tell me about tea number {n}.", f"Tea {n} is a drink.") for n in range(4)]
    facts = [("My locker code is 4711.", "Noted."), ("My bike is a blue Gazelle.", "Noted."),
             ("My dentist is Doctor Vos.", "Noted.")]
    config.data_dir.mkdir(parents=True, exist_ok=True)
    with HistoryStore(config.db_path) as store:
        cid = store.import_conversation([*filler[:2], *facts, *filler[2:]], "d", title="t", model=None,
                                        system_prompt=None).id
        store.add_compaction(cid, 6, "We talked about tea.")
    questions = ["What is my locker code?", "Which bike do I ride?", "Who is my dentist?", "The locker code again?"]
    answers = []
    async with serving(config) as (_, wire):
        for n, question in enumerate(questions):
            router.script(Reply(text=f"Answer {n}."))
            events = await wire.ask(question, conversation=cid)
            assert events[-1]["type"] == "done", events[-1]
            assert [e["sources"] for e in of_type(events, "progress") if e["stage"] == "recall"][0]
            answers.append(events[-1]["text"])
    sent = turn_requests(router)
    assert len(sent) == len(questions)
    for n in range(1, len(sent)):
        assert_reuses(sent[n - 1], sent[n], answers[n - 1])
        before = len(sent[n - 1]["messages"]) - 1  # the previous question: sent again without its passages
        assert json.dumps(sent[n]["messages"][:before]) == json.dumps(sent[n - 1]["messages"][:before])
        assert sent[n]["messages"][before] == {"role": "user", "content": questions[n - 1]}
        assert "[Recalled from this conversation]" in json.dumps(sent[n]["messages"][-1])
        assert "[Recalled from this conversation]" not in json.dumps(sent[n]["messages"][:-1])


async def test_files_and_tool_rounds_keep_the_prefix(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("the launch code is 4711\n")
    events = await wire.ask("keep this", files=[str(notes)])
    cid = of_type(events, "user")[0]["conversation"]
    router.script(
        Reply(tool_calls=[{"id": "c1", "name": "attachment_recall", "arguments": '{"action": "list"}'}]),
        Reply(text="It is in notes.txt."),
    )
    second = await wire.ask("where is the code?", conversation=cid)
    await wire.ask("thanks", conversation=cid)
    first_req, round1, round2, third = turn_requests(router)
    assert_reuses(first_req, round1, events[-1]["text"])
    assert round2["messages"][: len(round1["messages"])] == round1["messages"]  # a round only appends
    # the next turn replays the whole tool exchange as it was sent, then the answer
    assert third["messages"][: len(round2["messages"])] == round2["messages"]
    assert third["messages"][len(round2["messages"])] == {"role": "assistant", "content": second[-1]["text"]}
    assert round1["tools"] == third["tools"]  # the tool list a template renders first stays put


async def test_a_follow_up_reads_only_the_turn_answered_since(
    wire: Wire, router: FakeRouter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replayed turns are held between prompts: a follow-up's trip to the store reads only the
    turn answered since the last prompt, and its prompt replays it whole, tool round and all."""
    read: list[int] = []
    answered_turns = HistoryStore.answered_turns

    def counted(store: HistoryStore, cid: int, before: int, after: int = 0) -> list[tuple[int, Any]]:
        rows = answered_turns(store, cid, before, after)
        read.extend(n for n, _ in rows)
        return rows

    monkeypatch.setattr(HistoryStore, "answered_turns", counted)
    notes = tmp_path / "notes.txt"
    notes.write_text("the launch code is 4711\n")
    router.script(
        Reply(tool_calls=[{"id": "c1", "name": "attachment_recall", "arguments": '{"action": "list"}'}]),
        Reply(text="It is in notes.txt."),
    )
    first = await wire.ask("where is the code?", files=[str(notes)])
    cid = of_type(first, "user")[0]["conversation"]
    second = await wire.ask("and the date?", conversation=cid)
    await wire.ask("thanks", conversation=cid)
    assert read == [1, 2]  # turn 2's prompt read turn 1; turn 3's, turn 2: none twice
    round1, round2, follow_up, last = turn_requests(router)
    assert follow_up["messages"][: len(round2["messages"])] == round2["messages"]
    assert follow_up["messages"][len(round2["messages"])] == {"role": "assistant", "content": first[-1]["text"]}
    assert_reuses(follow_up, last, second[-1]["text"])


async def test_every_request_caps_its_reply_and_leaves_room(wire: Wire, router: FakeRouter) -> None:
    cid = None
    for n in range(4):
        events = await wire.ask(f"question {n} " + "words " * 60, model=SMALL, **({"conversation": cid} if cid else {}))
        cid = events[0]["conversation"]
    for request in turn_requests(router):
        prompt = sum(len(json.dumps(m)) for m in request["messages"]) // 4
        assert 0 < request["max_tokens"] <= 1024 // 4
        assert prompt + request["max_tokens"] <= 1024 - 1024 // 8 or request["max_tokens"] == 1024 // 8


async def test_a_model_that_writes_until_stopped_leaves_room_for_more(wire: Wire, router: FakeRouter) -> None:
    router.script(Reply(fill=True))  # "a very long story": words until max_tokens or the context end
    story = (await wire.ask("tell me a very long story", model=SMALL))[-1]
    assert story["type"] == "done" and story["finish_reason"] == "length"
    assert turn_requests(router)[-1]["max_tokens"] <= 1024 // 4
    cid = story["conversation"]
    for question in ("who was the hero?", "and how did it end?"):
        events = await wire.ask(question, conversation=cid)
        assert events[-1]["type"] == "done", events[-1]
    opened = await wire.request({"type": "open", "conversation": cid})
    assert opened["turns"][0]["reply"] == story["text"] and opened["turns"][0]["finish_reason"] == "length"


async def test_a_reply_larger_than_the_context_does_not_end_the_conversation(
    wire: Wire, router: FakeRouter
) -> None:
    # ~3,600 tokens: fits 8k, not half of 4k with the tools beside it (a 1k context would
    # compact a reply cut to its half: the tools' definitions leave no room to replay it)
    story = " ".join(f"word{n}" for n in range(1_800))
    router.script(Reply(text=story))
    events = await wire.ask("tell me a very long story", model="fake-vision")
    cid = events[0]["conversation"]
    assert events[-1]["type"] == "done" and events[-1]["text"] == story
    changed = await wire.request({"type": "settings", "conversation": cid, "model": "fake-text"})
    assert changed["type"] == "settings", changed
    for question in ("who was the hero?", "and how did it end?"):
        events = await wire.ask(question, conversation=cid)
        assert events[-1]["type"] == "done", events[-1]
    replayed = json.dumps(turn_requests(router)[-1]["messages"])
    assert "word0 " in replayed and "word1799" in replayed  # its head and its end
    assert "left out here to fit the context" in replayed and "conversation_search" in replayed
    opened = await wire.request({"type": "open", "conversation": cid})
    assert opened["turns"][0]["reply"] == story  # history keeps it whole


async def test_a_cut_names_no_tool_to_a_model_offered_none(wire: Wire, router: FakeRouter) -> None:
    # a context under 2,048 tokens gets none of the daemon's tools: the cut's marker names none
    story = " ".join(f"word{n}" for n in range(600))  # ~1,200 tokens: more than half of 1k
    router.script(Reply(text=story))
    events = await wire.ask("tell me a story", model="fake-vision")
    cid = events[0]["conversation"]
    changed = await wire.request({"type": "settings", "conversation": cid, "model": SMALL})
    assert changed["type"] == "settings", changed
    events = await wire.ask("who was the hero?", conversation=cid)
    assert events[-1]["type"] == "done", events[-1]
    request = turn_requests(router)[-1]
    replayed = json.dumps(request["messages"])
    assert "word0 " in replayed and "word599" in replayed and "left out here to fit the context" in replayed
    assert "tools" not in request and "conversation_search" not in replayed and "attachment_recall" not in replayed


async def test_a_file_larger_than_the_context_allows_after_a_model_switch(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    report = tmp_path / "report.txt"
    # ~2,200 tokens: fits 8k with the tools, not half of 4k (replayed cut, as in the test above)
    report.write_text("line of the quarterly report\n" * 300)
    router.script(Reply(text="A report, read."))
    events = await wire.ask("read this", files=[str(report)], model="fake-vision")
    cid = of_type(events, "user")[0]["conversation"]
    assert not of_type(events, "user")[0]["files"][0]["truncated"]
    changed = await wire.request({"type": "settings", "conversation": cid, "model": "fake-text"})
    assert changed["type"] == "settings", changed
    events = await wire.ask("summarise it in one line", conversation=cid)
    assert events[-1]["type"] == "done", events[-1]
    assert "left out here to fit the context" in json.dumps(turn_requests(router)[-1]["messages"])


async def test_a_question_that_cannot_fit_names_the_real_cause(wire: Wire, router: FakeRouter) -> None:
    cid = (await wire.ask("hello", model=SMALL))[0]["conversation"]
    events = await wire.ask("please read: " + "blah " * 1_000, conversation=cid)
    error = events[-1]
    assert error["type"] == "error" and error["code"] == "context_overflow"
    assert "this question needs about" in error["message"] and "shorten it" in error["message"]
    assert "files" not in error["message"]
    assert len(turn_requests(router)) == 1  # refused before the router heard it
    events = await wire.ask("a short one", conversation=cid)
    assert events[-1]["type"] == "done"  # and the conversation goes on


async def test_images_that_cannot_fit_say_so(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    images = [str(make_png(tmp_path / f"i{n}.png")) for n in range(2)]  # 2 x 765 tokens > 1,024
    events = await wire.ask("look", files=images, model=SMALL)
    assert events[-1]["code"] == "context_overflow"
    assert "this question and its files need" in events[-1]["message"]


async def test_a_failed_summary_leaves_old_turns_out_and_goes_on(wire: Wire, router: FakeRouter) -> None:
    cid = None
    for n in range(12):
        router.script_complete(Reply(status=500, error="summariser down"))
        router.script(Reply(text=f"Answer {n}: " + "word " * 80))
        fields = {"conversation": cid} if cid else {"model": SMALL}
        events = await wire.ask(f"question {n} " + "filler " * 60, **fields)
        assert events[-1]["type"] == "done", events[-1]
        cid = events[0]["conversation"]
    last = turn_requests(router)[-1]["messages"]
    assert "question 0 " not in json.dumps(last) and "question 11 " in json.dumps(last)
    assert sum(len(json.dumps(m)) for m in last) // 4 < 1024


# -- what the server reads: the fake keeps llama-server's prompt cache ------------------------------


GENERATION_PROMPT = "<|im_start|>assistant\n"


class Turns:
    """Asks in one conversation, keeping the streamed requests of each turn (its rounds)."""

    def __init__(self, wire: Wire, router: FakeRouter) -> None:
        self.wire, self.router = wire, router
        self.cid: int | None = None
        self.rounds: list[list[int]] = []  # per turn: indexes into router.requests
        self.done: list[dict[str, Any]] = []

    async def ask(self, text: str, **fields: Any) -> list[dict[str, Any]]:
        before = len(self.router.requests)
        if self.cid is not None:
            fields["conversation"] = self.cid
        events = await self.wire.ask(text, **fields)
        assert events[-1]["type"] == "done", events[-1]
        self.cid = of_type(events, "user")[0]["conversation"]
        self.rounds.append([i for i in range(before, len(self.router.requests)) if self.router.requests[i].get("stream")])
        self.done.append(events[-1])
        return events

    def limit(self, n: int) -> int:
        """The most turn ``n`` (0-based) may read: the previous exchange and what follows it."""
        first = self.router.requests[self.rounds[n][0]]
        previous_question = len(self.router.requests[self.rounds[n - 1][0]]["messages"]) - 1
        head = render_prompt({"messages": first["messages"][:previous_question], "tools": first.get("tools")})
        return text_tokens(render_prompt(first)) - text_tokens(head.removesuffix(GENERATION_PROMPT))

    def read(self, n: int) -> int:
        """What the server read for turn ``n``'s first request."""
        timings = self.router.timings[self.rounds[n][0]]
        assert timings is not None
        return int(timings["prompt_n"])


async def test_with_a_kb_each_turn_reads_only_the_new_exchange(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    await kb_linked(wire, tmp_path)
    turns = Turns(wire, router)
    for n, question in enumerate(["why do bees dance?", "and the pump?", "how often oil?", "the hive?", "a seal?"]):
        router.script(Reply(text=f"Answer {n}: " + "detail " * 30))
        await turns.ask(question)
    for n in range(2, 5):
        assert turns.read(n) <= turns.limit(n), (n, router.timings)
        # most of the prompt comes from the cache: the passages are read once, with their question
        assert router.timings[turns.rounds[n][0]]["cache_n"] > turns.read(n)
    # done carries the server's figures of the turn's request
    assert turns.done[-1]["timings"]["prompt_n"] == turns.read(4)
    assert turns.done[-1]["timings"]["cache_n"] == router.timings[turns.rounds[4][0]]["cache_n"]


async def test_without_a_kb_a_turn_reads_little_more_than_its_question(wire: Wire, router: FakeRouter) -> None:
    turns = Turns(wire, router)
    for n in range(5):
        await turns.ask(f"question number {n} about the weather")
    for n in range(1, 5):
        question = render_prompt({"messages": [{"role": "user", "content": f"question number {n} about the weather"}]})
        assert turns.read(n) <= text_tokens(question) + 2, (n, router.timings)


async def test_files_and_tools_keep_each_turn_within_its_limit(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("the launch code is 4711\n" * 20)
    turns = Turns(wire, router)
    await turns.ask("hello")
    await turns.ask("keep this", files=[str(notes)])
    router.script(
        Reply(tool_calls=[{"id": "c1", "name": "attachment_recall", "arguments": '{"action": "list"}'}]),
        Reply(text="It is in notes.txt."),
    )
    await turns.ask("where is the code?")
    await turns.ask("thanks")
    await turns.ask("one more")
    for n in range(3, 5):
        assert turns.read(n) <= turns.limit(n), (n, router.timings)
    # the second round of a tool turn reads only the call and its result
    second_round = router.timings[turns.rounds[2][1]]
    assert second_round is not None and second_round["prompt_n"] < 200


async def test_after_a_compaction_the_next_turns_reuse_it(wire: Wire, router: FakeRouter) -> None:
    turns = Turns(wire, router)
    compacting: list[int] = []
    for n in range(10):
        router.script_complete(Reply(text=f"Earlier: weather questions up to {n}."))
        # turns of ~430 tokens: a 1k context offers no tools, and two such turns with the summary
        # request and the summary do not fit it (the transcript below)
        router.script(Reply(text=f"Answer {n}: " + "word " * 250))
        events = await turns.ask(f"question {n} " + "filler " * 60, **({} if n else {"model": SMALL}))
        if any(e["stage"] == "compacting" for e in of_type(events, "progress")):
            compacting.append(n)
    assert compacting and compacting[0] >= 2
    # a compacting turn reads its new prompt whole (and its summary request is a prompt of
    # its own); every other turn from the third on reads only what is new
    after = [n for n in range(2, 10) if n not in compacting]
    assert any(n - 1 in compacting for n in after), compacting  # a turn right after one is checked
    for n in after:
        assert turns.read(n) <= turns.limit(n), (n, compacting, router.timings)
    # in a context this small the conversation and a summary request do not fit together:
    # the summariser reads a transcript of the folded turns instead
    summaries = [r for r in router.requests if not r.get("stream")]
    assert len(summaries) == len(compacting)
    assert all(len(r["messages"]) == 2 for r in summaries)


async def test_the_system_message_is_the_same_after_a_restart(
    config: Config, router: FakeRouter, tmp_path: Path
) -> None:
    """The file list a compaction puts in the system message depends on the compaction alone:
    a restart (or an evicted replay cache) builds the same bytes, so the server reuses its cache.
    Here a later turn's file is never answered (the router refused that turn)."""
    notes, later = tmp_path / "notes.txt", tmp_path / "later.txt"
    notes.write_text("marmosets " * 40)
    later.write_text("tamarins " * 10)

    async def ask(wire: Wire, text: str, **fields: Any) -> list[dict[str, Any]]:
        router.script_complete(Reply(text="Earlier: questions about monkeys."))
        router.script(Reply(text="Answer: " + "word " * 50))  # the turn after the restart compacts nothing more
        return await wire.ask(text, **fields)

    async with serving(config) as (_daemon, wire):
        events = await ask(wire, "question 0 " + "filler " * 40, model=SMALL, files=[str(notes)])
        cid = of_type(events, "user")[0]["conversation"]
        for n in range(1, 8):
            events = await ask(wire, f"question {n} " + "filler " * 40, conversation=cid)
            if any(e["stage"] == "compacting" for e in of_type(events, "progress")):
                break
        else:
            raise AssertionError("no compaction")
        router.script(Reply(status=500, error="refused"))
        refused = await wire.ask("look at this", conversation=cid, files=[str(later)])
        assert refused[-1]["type"] == "error"
        await ask(wire, "and now?", conversation=cid)
        warm = turn_requests(router)[-1]["messages"][0]
        assert warm["role"] == "system" and "notes.txt" in warm["content"] and "later.txt" not in warm["content"]
    async with serving(config) as (_daemon, wire):  # started again: the same system message
        await ask(wire, "one more", conversation=cid)
        assert turn_requests(router)[-1]["messages"][0] == warm


async def test_a_summary_is_asked_as_the_conversations_next_message(wire: Wire, router: FakeRouter) -> None:
    """With room for it, the summary request extends the conversation the server holds, so a
    compaction costs the server the last exchange and the request, not a re-read of it all."""
    turns = Turns(wire, router)
    for n in range(16):
        router.script_complete(Reply(text=f"Earlier: questions 0 to {n}."))
        router.script(Reply(text=f"Answer {n}: " + "word " * 120))
        events = await turns.ask(f"question {n} " + "filler " * 80)
        if any(e["stage"] == "compacting" for e in of_type(events, "progress")):
            break
    else:
        raise AssertionError("sixteen turns of ~300 tokens in a 4,096-token context never compacted")
    [index] = [i for i, r in enumerate(router.requests) if not r.get("stream")]
    summary, timings = router.requests[index], router.timings[index]
    asked = turns.rounds[-2][0]  # the last turn before the compaction
    assert summary["messages"][: len(router.requests[asked]["messages"]) - 1] == router.requests[asked]["messages"][:-1]
    assert summary["tools"] == router.requests[asked]["tools"] and summary["tool_choice"] == "none"
    assert "summary of it so far" in summary["messages"][-1]["content"]
    assert timings is not None and timings["cache_n"] > 5 * timings["prompt_n"], timings
    assert "Earlier: questions 0 to" in router.requests[-1]["messages"][0]["content"]


async def grow_until_compacting(wire: Wire, router: FakeRouter, *summaries: Reply) -> tuple[int, list[dict[str, Any]]]:
    """A conversation asked in until a turn compacts (turns of ~300 tokens in 4,096: the
    summary is asked in place), ``summaries`` answering its summary requests."""
    router.script_complete(*summaries)
    cid = None
    for n in range(16):
        router.script(Reply(text=f"Answer {n}: " + "word " * 120))
        events = await wire.ask(f"question {n} " + "filler " * 80, **({"conversation": cid} if cid else {}))
        cid = of_type(events, "user")[0]["conversation"]
        if any(e["stage"] == "compacting" for e in of_type(events, "progress")):
            return cid, events
    raise AssertionError("no compaction")


async def test_an_in_place_summary_the_server_finds_too_long_is_asked_from_a_transcript(
    wire: Wire, router: FakeRouter
) -> None:
    overflow = Reply(status=400, error="request (5000 tokens) exceeds the available context size (4096 tokens)",
                     error_type="exceed_context_size_error")
    _cid, events = await grow_until_compacting(wire, router, overflow, Reply(text="Earlier: from a transcript."))
    assert events[-1]["type"] == "done", events[-1]
    asked = [r["messages"][-1]["content"] for r in router.requests if not r.get("stream")]
    assert len(asked) == 2 and "summary of it so far" in asked[0] and "The turns to summarise" in asked[1]
    system = router.requests[-1]["messages"][0]["content"]
    assert "Earlier: from a transcript." in system and "could not be summarised" not in system


async def test_a_summary_the_server_is_too_busy_for_is_asked_again_next_turn(wire: Wire, router: FakeRouter) -> None:
    cid, events = await grow_until_compacting(wire, router, Reply(status=503, error="Loading model"))
    assert events[-1]["type"] == "done", events[-1]  # its oldest turns left out of this prompt
    assert "Summary of the conversation" not in router.requests[-1]["messages"][0]["content"]  # nothing stored
    router.script_complete(Reply(text="Earlier: at last."))
    await wire.ask("and now?", conversation=cid)
    system = router.requests[-1]["messages"][0]["content"]
    assert "Earlier: at last." in system and "could not be summarised" not in system


async def test_the_title_request_does_not_cost_the_next_turn(config: Config, router: FakeRouter) -> None:
    running = RunningDaemon(dataclasses.replace(config, auto_title=True))
    await running.start()
    wire = await running.connect()
    try:
        turns = Turns(wire, router)
        await turns.ask("what is a good name for a cat?")
        await running.server._engine.settle()  # the title request has been answered
        await turns.ask("and for a dog?")
        titles = [r for r in router.requests if not r.get("stream")]
        assert len(titles) == 1
        assert turns.read(1) <= turns.limit(1), router.timings
    finally:
        await wire.close()
        await running.stop()


async def test_a_router_that_tells_no_size_is_learned_from_its_refusal(config: Config) -> None:
    """Behind a proxy that lists no context (llama-swap without capabilities), the daemon
    assumes 4,096; the server's refusal names 2,048, and the turn is retried at once."""
    with FakeRouter(models=[FakeModel("hidden", n_ctx=2048)], mode="silent") as silent:
        running = RunningDaemon(dataclasses.replace(config, router_url=silent.url))
        await running.start()
        wire = await running.connect()
        try:
            cid = None
            for n in range(12):
                silent.script(Reply(text=f"Answer {n}: " + "word " * 60))
                events = await wire.ask(f"question {n} " + "filler " * 60, **({"conversation": cid} if cid else {}))
                assert events[-1]["type"] == "done", (n, events[-1])
                cid = events[0]["conversation"]
            assert events[-1]["ctx_max"] == 2048
            models = await wire.request({"type": "models"})
            assert models["items"][0]["ctx_max"] == 2048 and models["items"][0]["ctx_source"] == "learned"
            refused = [t for t in silent.timings if t is None]
            assert len(refused) == 1  # refused once, then known
        finally:
            await wire.close()
            await running.stop()


async def test_saved_memories_are_frozen_so_the_prefix_holds_across_saves_and_a_restart(
    config: Config, router: FakeRouter
) -> None:
    """A conversation's system message carries the memories of its first prompt: a memory the
    model saves, one the user adds or forgets, and a restart all leave every later prompt reusing
    the previous one (docs/DESIGN.md, "Memory")."""
    async with serving(config) as (_daemon, wire):
        await wire.request({"type": "memory_add", "text": "The user lives in Lisbon"})
        events = await wire.ask("hello")
        cid = events[0]["conversation"]
        saving = Reply(tool_calls=[{"id": "c1", "name": "memory_save", "arguments": '{"text": "Moved to Porto"}'}])
        router.script(saving, Reply(text="Noted."))
        await wire.ask("remember I moved to Porto", conversation=cid)
        await wire.request({"type": "memory_forget", "memory": 1})
        await wire.ask("and now?", conversation=cid)
    async with serving(config) as (_daemon, wire):
        await wire.ask("after a restart", conversation=cid)
    sent = [r for r in turn_requests(router) if r["messages"][-1]["role"] != "tool"]  # each turn's first round
    assert len(sent) == 4
    system = sent[0]["messages"][0]
    assert "The user lives in Lisbon" in system["content"] and "Porto" not in system["content"]
    for n in range(1, len(sent)):
        assert sent[n]["messages"][0] == system
        assert sent[n]["messages"][: len(sent[n - 1]["messages"]) - 1] == sent[n - 1]["messages"][:-1]
