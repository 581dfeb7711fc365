"""Model tools through the real socket: the fake router streams real ``tool_calls``,
the daemon runs them, feeds the results back, and stores and shows every call."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client import Wire, of_type, reply_text
from core import Config
from selfcheck.fakerouter import FakeModel, FakeRouter, Reply, default_models
from selfcheck.samples import make_pdf, make_png, make_webp
from tests.conftest import RunningDaemon

pytestmark = pytest.mark.asyncio


@pytest.fixture
def router() -> Iterator[FakeRouter]:
    # fake-small holds none of the daemon's tools (under 2,048 tokens), fake-2k the first that fit
    # a third of it (docs/DESIGN.md, "The tools' share of the context")
    models = [*default_models(), FakeModel("fake-small", ["text", "image"], n_ctx=1500),
              FakeModel("fake-2k", ["text", "image"], n_ctx=2048)]
    with FakeRouter(models=models) as fake:
        yield fake


def call(name: str, arguments: dict[str, Any] | str, call_id: str = "call_1") -> Reply:
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return Reply(tool_calls=[{"id": call_id, "name": name, "arguments": raw}])


def tool_names(request: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in request.get("tools") or []]


def tool_messages(request: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in request["messages"] if m["role"] == "tool"]


async def ask_with_file(wire: Wire, path: Path, text: str = "keep this", **fields: Any) -> int:
    events = await wire.ask(text, files=[str(path)], **fields)
    assert events[-1]["type"] == "done", events[-1]
    return of_type(events, "user")[0]["conversation"]


async def test_tools_are_offered_only_when_they_can_work(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    cid = (await wire.ask("hello"))[0]["conversation"]
    # search from the first turn (a stable tool list keeps the server's prompt cache); no files
    assert tool_names(router.requests[-1]) == ["conversation_search", "memory_save"]
    await wire.ask("again", conversation=cid)
    assert tool_names(router.requests[-1]) == ["conversation_search", "memory_save"]
    notes = tmp_path / "notes.txt"
    notes.write_text("alpha")
    await wire.ask("file", files=[str(notes)], conversation=cid)
    assert tool_names(router.requests[-1]) == ["conversation_search", "attachment_recall", "memory_save"]
    other = await ask_with_file(wire, notes)
    assert tool_names(router.requests[-1]) == ["conversation_search", "attachment_recall", "memory_save"]
    assert other != cid


async def test_attachment_recall_list_and_read(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("the launch code is 4711\n")
    cid = await ask_with_file(wire, notes)
    router.script(
        call("attachment_recall", {"action": "list"}),
        call("attachment_recall", {"action": "read", "attachment_id": 1}, "call_2"),
        Reply(chunks=["It is ", "4711."]),
    )
    events = await wire.ask("what was the code?", conversation=cid)
    tools = of_type(events, "tool")
    assert [(t["name"], t["arguments"], t["ok"]) for t in tools] == [
        ("attachment_recall", {"action": "list"}, True),
        ("attachment_recall", {"action": "read", "attachment_id": 1}, True),
    ]
    assert all(t["summary"] for t in tools)
    assert "tool" in [e["stage"] for e in of_type(events, "progress")]
    assert reply_text(events).endswith("It is 4711.")
    assert events[-1]["type"] == "done" and events[-1]["finish_reason"] == "stop"
    listing = json.loads(tool_messages(router.requests[-2])[0]["content"])
    assert listing["count"] == 1 and listing["attachments"][0]["filename"] == "notes.txt"
    read = json.loads(tool_messages(router.requests[-1])[-1]["content"])
    assert "the launch code is 4711" in read["content"] and read["content_type_returned"] == "text"
    # the assistant's tool calls are sent back exactly as the model made them
    assistant = [m for m in router.requests[-1]["messages"] if m["role"] == "assistant"][-1]
    assert assistant["tool_calls"][0]["id"] == "call_2"
    # open shows the calls; the next turn replays them whole
    opened = await wire.request({"type": "open", "conversation": cid})
    assert [t["name"] for t in opened["turns"][1]["tools"]] == ["attachment_recall", "attachment_recall"]
    assert opened["turns"][1]["tools"][1]["ok"] is True
    await wire.ask("thanks", conversation=cid)
    replayed = router.requests[-1]["messages"]
    assert [m["role"] for m in replayed].count("tool") == 2
    assert all(set(m) <= {"role", "content", "tool_call_id", "tool_calls"} for m in replayed if m["role"] == "tool")


async def test_an_attachment_of_another_conversation_is_not_found(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret words")
    await ask_with_file(wire, secret)  # attachment 1, conversation 1
    mine = tmp_path / "mine.txt"
    mine.write_text("harmless")
    cid = await ask_with_file(wire, mine)  # attachment 2, conversation 2
    router.script(call("attachment_recall", {"action": "read", "attachment_id": 1}), Reply(text="ok"))
    events = await wire.ask("read attachment 1", conversation=cid)
    [tool] = of_type(events, "tool")
    assert tool["ok"] is False
    content = tool_messages(router.requests[-1])[0]["content"]
    assert content.startswith("Error:") and "top secret" not in content
    assert events[-1]["type"] == "done"


async def test_paging_through_a_long_document(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    pdf = make_pdf(tmp_path / "book.pdf", [f"Chapter {n} text." for n in range(1, 6)])
    cid = await ask_with_file(wire, pdf, model="fake-vision")
    router.script(call("attachment_recall", {"action": "read", "attachment_id": 1, "page": 4}), Reply(text="ok"))
    await wire.ask("what does page 4 say?", conversation=cid)
    read = json.loads(tool_messages(router.requests[-1])[0]["content"])
    assert "Chapter 4 text." in read["content"] and "Chapter 3" not in read["content"]
    router.script(
        call("attachment_recall", {"action": "read", "attachment_id": 1, "offset": 0, "max_chars": 40}),
        call("attachment_recall", {"action": "read", "attachment_id": 1, "offset": 40, "max_chars": 40}, "call_2"),
        Reply(text="ok"),
    )
    await wire.ask("read the start", conversation=cid)
    first, second = (json.loads(m["content"]) for m in tool_messages(router.requests[-1])[-2:])
    assert first["returned_chars"] == 40 and first["next_offset"] == 40
    assert first["content"].startswith("[page 1]") and "Chapter 1 text." in first["content"]
    assert second["content"] != first["content"] and second["total_chars"] == first["total_chars"]


async def test_a_recalled_image_is_shown_to_a_vision_model(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    image = make_png(tmp_path / "chart.png", (30, 20))
    cid = await ask_with_file(wire, image, model="fake-vision")
    router.script(call("attachment_recall", {"action": "read", "attachment_id": 1}), Reply(text="a chart"))
    events = await wire.ask("look again", conversation=cid)
    assert of_type(events, "tool")[0]["ok"] is True
    last = router.requests[-1]["messages"][-1]
    assert last["role"] == "user"
    assert any(p["type"] == "image_url" and p["image_url"]["url"].startswith("data:image/png") for p in last["content"])
    assert "data:image" not in tool_messages(router.requests[-1])[0]["content"]


def shown_images(request: dict[str, Any]) -> list[str]:
    """The data URLs of the images a tool round shows (the last message, after the tool results)."""
    last = request["messages"][-1]
    if last["role"] != "user" or not isinstance(last["content"], list):
        return []
    return [p["image_url"]["url"] for p in last["content"] if p["type"] == "image_url"]


async def test_a_recalled_image_is_shown_as_it_was_sent_and_once_a_round(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    photo = make_webp(tmp_path / "photo.webp", (30, 20))  # re-encoded when attached: servers take no WebP
    cid = await ask_with_file(wire, photo, model="fake-vision")
    [sent] = [p["image_url"]["url"] for p in router.requests[-1]["messages"][-1]["content"] if p["type"] == "image_url"]
    assert sent.startswith("data:image/jpeg;base64,")
    reads = [{"id": f"c{n}", "name": "attachment_recall", "arguments": '{"action": "read", "attachment_id": 1}'}
             for n in range(4)]
    router.script(Reply(tool_calls=reads), Reply(text="a photo"))
    events = await wire.ask("look again, closely", conversation=cid)
    assert [t["ok"] for t in of_type(events, "tool")] == [True] * 4
    assert shown_images(router.requests[-1]) == [sent]  # as first sent, and one showing for four reads


async def test_an_image_is_not_shown_again_without_room_for_it(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    image = make_png(tmp_path / "chart.png", (30, 20))
    cid = await ask_with_file(wire, image, model="fake-2k")  # the image and the tools took most of it
    router.script(call("attachment_recall", {"action": "read", "attachment_id": 1}), Reply(text="from memory"))
    events = await wire.ask("look again", conversation=cid)
    [tool] = of_type(events, "tool")
    assert tool["ok"] is False and "no room left" in tool["summary"]
    assert shown_images(router.requests[-1]) == []
    assert events[-1]["type"] == "done"


async def test_the_tools_definitions_count_against_the_context(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    # a PDF makes file_convert available: with the search, the recall and memory_save, about
    # 1,060 tokens of definitions that a prompt counting only its messages left out, sending the
    # fake (which counts them, as llama-server does) prompts over its 2,048 tokens
    pdf = make_pdf(tmp_path / "report.pdf", ["The quarterly report: sales rose."])
    cid = await ask_with_file(wire, pdf, model="fake-2k")
    compacted = None
    for n in range(8):
        router.script(Reply(text=f"Answer {n}: " + "word " * 60))
        events = await wire.ask(f"question {n} " + "filler " * 40, conversation=cid)
        assert events[-1]["type"] == "done", events[-1]
        if "compacting" in [e["stage"] for e in of_type(events, "progress")]:
            compacted = n
            break
    assert compacted is not None  # the conversation was folded before its prompt outgrew the context
    assert None not in router.timings  # and the fake refused no prompt (timings: None when it did)
    # a third of the context holds the search and the recall, not file_convert: the same on every turn
    chats = [r for r in router.requests if r.get("stream")]
    assert {tuple(tool_names(r)) for r in chats} == {("conversation_search", "attachment_recall")}


async def test_a_small_context_is_offered_none_of_the_tools(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("alpha")
    cid = await ask_with_file(wire, notes, model="fake-small")  # 1,500 tokens: under 2,048
    await wire.ask("again", conversation=cid)
    assert [tool_names(r) for r in router.requests] == [[], []]
    assert "Call a tool" not in router.requests[-1]["messages"][0]["content"]  # nor the guidance
    staged = await wire.request({"type": "estimate", "text": "hi", "model": "fake-small"})
    without = staged["ctx_used"]  # a new conversation's system message alone
    staged = await wire.request({"type": "estimate", "text": "hi", "model": "fake-2k"})
    assert staged["ctx_used"] > without + 200  # the search's definition, and the guidance


JAPANESE = "東京の天気は晴れです。"  # each character costs about two tokens, not a third of one


async def test_reading_back_a_japanese_document_fits_the_context(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    document = tmp_path / "jp.txt"
    document.write_text((JAPANESE * 40 + "\n") * 60)  # 26,000 characters, ~52,000 tokens
    cid = await ask_with_file(wire, document, text="read")
    router.script(call("attachment_recall", {"action": "read", "attachment_id": 1}), Reply(text="read it"))
    events = await wire.ask("again", conversation=cid)
    [tool] = of_type(events, "tool")
    assert tool["ok"] is True and events[-1]["type"] == "done", events[-1]  # the server took the round
    read = json.loads(tool_messages(router.requests[-1])[0]["content"])
    assert 0 < read["returned_chars"] < 1500 and read["next_offset"] == read["returned_chars"]


async def test_a_japanese_conversation_is_summarised_within_the_context(wire: Wire, router: FakeRouter) -> None:
    cid = None
    for n in range(6):
        fields = {"model": "fake-text"} if cid is None else {"conversation": cid}
        events = await wire.ask(f"{n} " + JAPANESE * 45, **fields)  # ~1,000 tokens a question
        assert events[-1]["type"] == "done", events[-1]
        cid = of_type(events, "user")[0]["conversation"]
    system = router.requests[-1]["messages"][0]["content"]
    assert "Summary of the conversation so far" in system  # compacted,
    assert "could not be summarised" not in system  # and the summariser took its request


async def test_conversation_search_finds_earlier_turns(wire: Wire, router: FakeRouter) -> None:
    router.script(Reply(text="The meeting moved to Thursday at noon."))
    cid = (await wire.ask("when is the meeting?"))[0]["conversation"]
    await wire.ask("unrelated chat", conversation=cid)
    router.script(call("conversation_search", {"query": "meeting", "max_results": 50}), Reply(text="Thursday."))
    events = await wire.ask("remind me about the meeting day", conversation=cid)
    [tool] = of_type(events, "tool")
    assert tool["ok"] is True and tool["arguments"]["query"] == "meeting"
    found = json.loads(tool_messages(router.requests[-1])[0]["content"])
    assert found["conversation"] == cid and found["query"] == "meeting"
    assert {r["turn"] for r in found["results"]} == {1}  # never the question being answered
    assert any("[meeting]" in r["excerpt"].lower() for r in found["results"])


@pytest.mark.parametrize(
    "reply, words",
    [
        (call("conversation_search", "{not json"), "Error"),
        (call("no_such_tool", {}), "no tool named"),
        (call("attachment_recall", {"action": "list"}), "not available"),  # nothing attached here
        (call("conversation_search", {"query": 'NEAR( "*'}), ""),
    ],
)
async def test_bad_calls_become_error_results_not_failed_turns(
    wire: Wire, router: FakeRouter, reply: Reply, words: str
) -> None:
    cid = (await wire.ask("first"))[0]["conversation"]
    router.script(reply, Reply(text="recovered"))
    events = await wire.ask("second", conversation=cid)
    assert events[-1]["type"] == "done"
    assert reply_text(events).endswith("recovered")
    assert words in tool_messages(router.requests[-1])[0]["content"]


@pytest.mark.parametrize(
    "arguments",
    [
        '{"query": "first", "max_results": NaN}',
        '{"query": "first", "max_results": Infinity}',
        '{"query": "first", "max_results": 1e400}',
        '{"query": "first", "max_results": "\\ud800"}',  # a lone surrogate: valid JSON, no text
        '{"query": "\\udc00"}',
    ],
)
async def test_arguments_json_cannot_carry_are_refused_and_the_turn_is_kept(
    wire: Wire, router: FakeRouter, arguments: str
) -> None:
    cid = (await wire.ask("first"))[0]["conversation"]
    router.script(call("conversation_search", arguments), Reply(text="recovered"))
    events = await wire.ask("second", conversation=cid)
    assert events[-1]["type"] == "done", events[-1]
    [tool] = of_type(events, "tool")
    assert tool["ok"] is False and tool["arguments"] == arguments  # shown as the model sent them
    assert "not valid JSON" in tool_messages(router.requests[-1])[0]["content"]
    opened = await wire.request({"type": "open", "conversation": cid})
    assert opened["type"] == "conversation", opened
    assert [t["status"] for t in opened["turns"]] == ["complete", "complete"]
    assert opened["turns"][1]["reply"].endswith("recovered")


async def test_a_turn_cut_in_a_later_round_is_not_stored_with_an_earlier_rounds_usage(
    wire: Wire, router: FakeRouter
) -> None:
    first = await wire.ask("first " + "words " * 200)
    cid = first[0]["conversation"]
    router.script(
        Reply(chunks=["Checking."], tool_calls=[{"id": "c1", "name": "conversation_search",
                                                 "arguments": json.dumps({"query": "words"})}]),
        Reply(chunks=["The ", "answer ", "is"], drop_after=2),  # the second round is cut mid-reply
    )
    events = await wire.ask("second", conversation=cid)
    assert events[-1]["type"] == "error"
    opened = await wire.request({"type": "open", "conversation": cid})
    # the round that ended the turn reported none: estimated, not the first round's figures
    assert opened["turns"][1]["usage"] == {"prompt_tokens": None, "completion_tokens": None}
    assert opened["ctx_used"] > first[-1]["ctx_used"]


async def test_at_most_eight_rounds_then_the_model_must_answer(wire: Wire, router: FakeRouter) -> None:
    cid = (await wire.ask("first"))[0]["conversation"]
    # new calls every round (a round of nothing but repeats closes the tools sooner: test_tool_guards)
    router.script(*[call("conversation_search", {"query": f"first {i}"}, f"c{i}") for i in range(8)])
    events = await wire.ask("loop forever", conversation=cid)
    assert len(of_type(events, "tool")) == 8
    last = router.requests[-1]
    assert last["tools"] and last["tool_choice"] == "none"  # sent for the cached prefix, not to be called
    assert "Answer now" in last["messages"][-1]["content"]
    assert events[-1]["type"] == "done"
    turn = (await wire.request({"type": "open", "conversation": cid}))["turns"][1]
    assert len(turn["tools"]) == 8 and turn["status"] == "complete"


async def test_a_router_that_refuses_tools_is_asked_without_them(wire: Wire, router: FakeRouter) -> None:
    cid = (await wire.ask("first"))[0]["conversation"]
    router.script(Reply(status=500, error="tools param requires --jinja flag"))
    events = await wire.ask("second", conversation=cid)
    assert events[-1]["type"] == "done" and reply_text(events) == "You said: second"
    assert "tools" in router.requests[-2] and "tools" not in router.requests[-1]
    await wire.ask("third", conversation=cid)
    assert "tools" not in router.requests[-1]  # remembered for this model
    # asked again without the words about tools too, as every later prompt: one prefix from then on
    refused, retried, third = (r["messages"] for r in router.requests[-3:])
    assert "Call a tool" in refused[0]["content"] and "Call a tool" not in retried[0]["content"]
    assert third[: len(retried)] == retried


async def test_compaction_summarises_old_turns_and_keeps_them(wire: Wire, router: FakeRouter) -> None:
    router.script_complete(Reply(text="Earlier: questions about the first topics."))
    cid, compacted = None, None
    for n in range(10):
        router.script(Reply(text=f"Answer {n}: " + "word " * 60))
        fields = {"model": "fake-small"} if cid is None else {"conversation": cid}
        events = await wire.ask(f"question {n} about topic{n} " + "filler " * 40, **fields)
        cid = of_type(events, "user")[0]["conversation"]
        if "compacting" in [e["stage"] for e in of_type(events, "progress")]:
            compacted = n
            break
    assert compacted is not None and compacted >= 2
    assert events[-1]["type"] == "done"
    sent = router.requests[-1]["messages"]
    assert sent[0]["role"] == "system" and "Earlier: questions about the first topics." in sent[0]["content"]
    assert [m["role"] for m in sent].count("system") == 1
    # folded into the summary: only this question's recalled passages may quote it (docs/DESIGN.md)
    assert "topic0 " not in json.dumps(sent[:-1])
    assert f"topic{compacted} " in json.dumps(sent) and f"topic{compacted - 1} " in json.dumps(sent)
    summarised = [r for r in router.requests if not r.get("stream")][-1]
    assert "topic0" in json.dumps(summarised["messages"])  # the summariser read the old turns
    opened = await wire.request({"type": "open", "conversation": cid})
    assert len(opened["turns"]) == compacted + 1 and opened["turns"][0]["text"].startswith("question 0")
    found = await wire.request({"type": "search", "query": "topic0", "conversation": cid})
    assert found["total"] >= 1  # the originals stay searchable
    # the next turn reuses the stored summary without asking for another
    await wire.ask("one more", conversation=cid)
    assert "Earlier: questions about the first topics." in router.requests[-1]["messages"][0]["content"]


async def test_a_summary_with_a_lone_surrogate_is_kept_as_text(wire: Wire, router: FakeRouter) -> None:
    # a server that cuts text between UTF-16 halves, in a plain (not streamed) answer
    router.script_complete(Reply(text="Earlier: topics \ud83d and more."))
    cid = None
    for n in range(10):
        router.script(Reply(text=f"Answer {n}: " + "word " * 60))
        fields = {"model": "fake-small"} if cid is None else {"conversation": cid}
        events = await wire.ask(f"question {n} about topic{n} " + "filler " * 40, **fields)
        assert events[-1]["type"] == "done", events[-1]
        cid = of_type(events, "user")[0]["conversation"]
        if "compacting" in [e["stage"] for e in of_type(events, "progress")]:
            break
    assert "Earlier: topics \ufffd and more." in router.requests[-1]["messages"][0]["content"]


async def test_a_context_overflow_from_the_router_compacts_and_retries(wire: Wire, router: FakeRouter) -> None:
    cid = (await wire.ask("one " * 50))[0]["conversation"]  # a 4096 context: no compaction of its own
    for n in range(3):
        await wire.ask(f"more {n} " + "text " * 50, conversation=cid)
    router.script(Reply(status=400, error="request (2000 tokens) exceeds the available context size (1500 tokens)",
                        error_type="exceed_context_size_error"))
    router.script_complete(Reply(text="Summary of the start."))
    events = await wire.ask("next", conversation=cid)
    assert events[-1]["type"] == "done", events[-1]
    assert "compacting" in [e["stage"] for e in of_type(events, "progress")]
    assert "Summary of the start." in router.requests[-1]["messages"][0]["content"]


async def test_a_turn_that_cannot_fit_is_a_clear_error(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    image_heavy = [str(make_png(tmp_path / f"i{n}.png")) for n in range(3)]  # 3 x 765 tokens > 1500
    events = await wire.ask("look", files=image_heavy, model="fake-small")
    error = events[-1]
    assert error["type"] == "error" and error["code"] == "context_overflow"
    assert "1500" in error["message"] and "fewer or smaller files" in error["message"]
    assert router.requests == []  # refused before anything was sent
    turn = (await wire.request({"type": "open", "conversation": error["conversation"]}))["turns"][0]
    assert turn["status"] == "error" and turn["text"] == "look"  # the question is kept


async def test_no_tools_for_a_template_without_them(config: Config) -> None:
    # llama-server drops `tools` silently for such a template: offering them is waste
    with FakeRouter(models=[FakeModel("plain", tools=False)], models_format="bare") as plain:
        running = RunningDaemon(dataclasses.replace(config, router_url=plain.url))
        await running.start()
        wire = await running.connect()
        try:
            cid = (await wire.ask("one"))[0]["conversation"]
            await wire.ask("two", conversation=cid)
            assert "tools" not in plain.requests[-1]
        finally:
            await wire.close()
            await running.stop()


async def test_after_compaction_the_system_message_lists_the_files_left_out(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    notes = tmp_path / "minutes.txt"
    notes.write_text("the budget was approved\n")
    router.script_complete(Reply(text="Earlier: the user shared meeting minutes."))
    events = await wire.ask("keep these minutes", files=[str(notes)], model="fake-small")
    cid = of_type(events, "user")[0]["conversation"]
    for n in range(10):
        router.script(Reply(text=f"Answer {n}: " + "word " * 60))
        events = await wire.ask(f"question {n} " + "filler " * 40, conversation=cid)
        if "compacting" in [e["stage"] for e in of_type(events, "progress")]:
            break
    system = router.requests[-1]["messages"][0]["content"]
    assert "Earlier: the user shared meeting minutes." in system
    assert "- id 1: minutes.txt (text, 24 bytes; turn 1)" in system
    assert "attachment_recall" in system
    assert "the budget was approved" not in json.dumps(router.requests[-1]["messages"][1:])


async def test_a_cancel_in_a_later_round_stores_each_rounds_text_once(
    wire: Wire, router: FakeRouter, config: Config
) -> None:
    cid = (await wire.ask("first"))[0]["conversation"]
    first_round = Reply(chunks=["Let me check."],
                        tool_calls=[{"id": "c1", "name": "conversation_search", "arguments": '{"query": "first"}'}])
    router.script(first_round, Reply(chunks=["The answer is"], hang=True))
    rid = await wire.send({"type": "ask", "text": "second", "conversation": cid})
    await wire.until_reply(rid, "Let me check.\n\nThe answer is")
    await wire.request({"type": "cancel", "conversation": cid})
    assert (await wire.until(rid))[-1]["finish_reason"] == "cancelled"
    with sqlite3.connect(config.db_path) as conn:
        raw = conn.execute("SELECT messages, reply FROM turns WHERE turn = 2").fetchone()
    conn.close()
    said = [m["content"] for m in json.loads(raw[0]) if m["role"] == "assistant"]
    assert said == ["Let me check.", "The answer is"]
    assert raw[1] == "Let me check.\n\nThe answer is"


async def test_a_file_swapped_for_a_fifo_is_never_opened(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    image = make_png(tmp_path / "pic.png")
    cid = await ask_with_file(wire, image, model="fake-vision")
    image.unlink()
    os.mkfifo(image)  # reading it would block the daemon's thread forever
    router.script(call("attachment_recall", {"action": "read", "attachment_id": 1}), Reply(text="gone"))
    events = await asyncio.wait_for(wire.ask("look again", conversation=cid), 10)
    [tool] = of_type(events, "tool")
    assert tool["ok"] is False and events[-1]["type"] == "done"
    assert "changed or is gone" in tool_messages(router.requests[-1])[0]["content"]


async def test_the_calls_of_one_round_share_the_room_left(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    book = tmp_path / "book.txt"
    book.write_text("a long line of text for the reader\n" * 400)  # 14,000 characters
    cid = await ask_with_file(wire, book, model="fake-2k")
    # three different reads (the same call made three times would run once: test_tool_guards.py)
    reads = [{"id": f"r{n}", "name": "attachment_recall",
              "arguments": f'{{"action": "read", "attachment_id": 1, "offset": {n * 35}}}'} for n in range(3)]
    router.script(Reply(tool_calls=reads), Reply(text="read it"))
    events = await wire.ask("read it three times", conversation=cid)
    assert events[-1]["type"] == "done", events[-1]  # the fake enforces the 2048-token context
    sizes = [len(m["content"]) for m in tool_messages(router.requests[-1])]
    assert len(sizes) == 3 and max(sizes) - min(sizes) < 50


async def test_a_cancel_before_the_model_answers_its_tool_results_replays_as_the_text_said(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    cid = (await wire.ask("first"))[0]["conversation"]
    slow_tool = Reply(chunks=["Let me check."],
                      tool_calls=[{"id": "c1", "name": "conversation_search", "arguments": '{"query": "first"}'}])
    # the answer to the results never starts: the cancel lands once the server has the request
    router.script(slow_tool, Reply(chunks=[], hang=True))
    asked = len(router.requests)
    rid = await wire.send({"type": "ask", "text": "second", "conversation": cid})
    try:
        await asyncio.wait_for(wire.until(rid, ("tool",)), 5)
        async with asyncio.timeout(5):
            while len(router.requests) < asked + 2:  # the request for the answer to the results
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError([e for e in wire.events if e.get("id") == rid])
    await wire.request({"type": "cancel", "conversation": cid})
    await wire.until(rid)
    await wire.ask("third", conversation=cid)
    roles = [m["role"] for m in router.requests[-1]["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert router.requests[-1]["messages"][4]["content"] == "Let me check."


async def test_replayed_turns_always_end_with_an_answer() -> None:
    from daemon.context import complete_exchanges

    question = {"role": "user", "content": "q"}
    calls = {"role": "assistant", "content": "", "tool_calls": [{"id": "a"}]}
    result = {"role": "tool", "tool_call_id": "a", "content": "r"}
    answer = {"role": "assistant", "content": "done"}
    assert complete_exchanges([question, calls, result, answer]) == [question, calls, result, answer]
    assert complete_exchanges([question, calls]) == []  # cut before any answer: nothing to replay
    assert complete_exchanges([question, calls, result]) == []
    said = {**calls, "content": "Let me see."}
    assert complete_exchanges([question, said, result]) == [question, {"role": "assistant", "content": "Let me see."}]


async def test_a_call_to_a_tool_nobody_offered_gets_one_plain_retry(config: Config) -> None:
    """A model whose template takes no tools may still emit a call: it is told, once, to
    answer in words, and the turn ends with that answer rather than an empty reply."""
    with FakeRouter(models=[FakeModel("plain", tools=False)], models_format="bare") as plain:
        running = RunningDaemon(dataclasses.replace(config, router_url=plain.url))
        await running.start()
        wire = await running.connect()
        try:
            plain.script(call("conversation_search", {"query": "x"}), Reply(text="Paris, in words."))
            events = await wire.ask("capital of France?")
            assert events[-1]["type"] == "done", events[-1]
            assert events[-1]["text"] == "Paris, in words." and events[-1]["finish_reason"] == "stop"
            assert of_type(events, "tool") == []  # nothing was run
            retry = plain.requests[-1]
            assert "tools" not in retry and "No tools can be called here" in retry["messages"][-1]["content"]
            opened = await wire.request({"type": "open", "conversation": events[0]["conversation"]})
            assert opened["turns"][0]["reply"] == "Paris, in words."
            # stored as one question and one answer: the next turn replays them alternating
            await wire.ask("and of Spain?", conversation=events[0]["conversation"])
            roles = [m["role"] for m in plain.requests[-1]["messages"]]
            assert roles == ["system", "user", "assistant", "user"]
        finally:
            await wire.close()
            await running.stop()
