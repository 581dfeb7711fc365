"""The daemon guards a model's tool use, through the real socket: what a small model did with
real tools (issue 33) scripted on the fake router. Arguments are checked against the tool's
schema before it runs, a call made again is answered from its first result, the rounds are
capped with an answer at the end, and a call the server could not parse has its round asked
again with the tools closed (still sent, for the prompt cache, with ``tool_choice: none``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client import Wire, of_type, reply_text
from core.tools import REPEAT_ERROR_NOTE, REPEAT_NOTE
from daemon.rounds import LAST_ROUND_NOTE, UNREAD_CALL_NOTE
from selfcheck.fakerouter import FORMAT_ERROR, FakeRouter, Reply

pytestmark = pytest.mark.asyncio


@pytest.fixture
def router() -> Iterator[FakeRouter]:
    with FakeRouter() as fake:
        yield fake


def call(name: str, arguments: dict[str, Any], call_id: str = "call_1", **reply: Any) -> Reply:
    return Reply(tool_calls=[{"id": call_id, "name": name, "arguments": json.dumps(arguments)}], **reply)


def tool_contents(request: dict[str, Any]) -> list[str]:
    return [m["content"] for m in request["messages"] if m["role"] == "tool"]


async def conversation(wire: Wire) -> int:
    events = await wire.ask("my locker code is 4471")
    assert events[-1]["type"] == "done", events[-1]
    return int(of_type(events, "user")[0]["conversation"])


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        ({"query": {"text": "locker"}}, 'query must be a string, not {"text": "locker"}'),
        ({"q": "locker"}, "query is required"),
        ({"query": "locker", "role_filter": "everyone"}, "role_filter must be one of: all, user, assistant"),
        ({"query": "locker", "max_results": "many"}, 'max_results must be an integer, not "many"'),
        ({"query": None}, "query is required"),
    ],
)
async def test_arguments_that_do_not_fit_the_schema_are_refused_naming_the_field(
    wire: Wire, router: FakeRouter, arguments: dict[str, Any], words: str
) -> None:
    cid = await conversation(wire)
    router.script(call("conversation_search", arguments), Reply(text="recovered"))
    events = await wire.ask("what was my locker code?", conversation=cid)
    assert events[-1]["type"] == "done", events[-1]
    [tool] = of_type(events, "tool")
    assert tool["ok"] is False
    [content] = tool_contents(router.requests[-1])
    assert content.startswith("Error: ") and words in content, content
    assert "\"results\"" not in content  # the search never ran
    assert reply_text(events).endswith("recovered")


async def test_a_models_harmless_slips_are_read_as_meant(wire: Wire, router: FakeRouter) -> None:
    cid = await conversation(wire)
    # a numeric string for an integer, null for an optional field, a key the tool does not know
    arguments = {"query": "locker", "max_results": "1", "role_filter": None, "verbose": True}
    router.script(call("conversation_search", arguments), Reply(text="4471"))
    events = await wire.ask("what was my locker code?", conversation=cid)
    [tool] = of_type(events, "tool")
    assert tool["ok"] is True, tool
    [content] = tool_contents(router.requests[-1])
    found = json.loads(content)
    assert found["total"] == 1 and "4471" in found["results"][0]["excerpt"]


async def test_an_attachment_id_that_is_not_a_number_is_refused_before_the_tool_runs(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("the code is WR-58213\n")
    events = await wire.ask("keep this", files=[str(notes)])
    cid = of_type(events, "user")[0]["conversation"]
    router.script(call("attachment_recall", {"action": "read", "attachment_id": "notes.txt"}), Reply(text="ok"))
    events = await wire.ask("what was the code?", conversation=cid)
    [content] = tool_contents(router.requests[-1])
    assert 'attachment_id must be an integer, not "notes.txt"' in content
    assert events[-1]["type"] == "done"


def closed(request: dict[str, Any]) -> bool:
    """A request whose tools are sent (the prompt's cached prefix holds them) but not to be called."""
    return bool(request.get("tools")) and request.get("tool_choice") == "none"


async def test_a_call_made_again_is_answered_from_its_first_result_then_the_tools_close(
    wire: Wire, router: FakeRouter
) -> None:
    cid = await conversation(wire)
    router.repeat_calls = True  # the model answers every tool result with the same call
    router.script(call("conversation_search", {"query": "locker"}))
    events = await wire.ask("what was my locker code?", conversation=cid)
    first_call, again_call = of_type(events, "tool")
    assert "repeated" not in first_call["summary"]
    assert "repeated: answered from the first result" in again_call["summary"]
    first, again = tool_contents(router.requests[-1])
    assert "4471" in json.loads(first)["results"][0]["excerpt"]
    assert again == f"{first}\n\n{REPEAT_NOTE}"
    # a round of nothing but repeats is a loop: the next round is closed and says to answer
    *calling, last = router.requests[-3:]
    assert not any(closed(r) for r in calling) and closed(last)
    assert last["tools"] == calling[0]["tools"] and LAST_ROUND_NOTE in last["messages"][-1]["content"]
    assert events[-1]["type"] == "done", events[-1]
    assert reply_text(events).startswith("You said: ")
    opened = await wire.request({"type": "open", "conversation": cid})
    assert opened["turns"][1]["status"] == "complete" and len(opened["turns"][1]["tools"]) == 2


async def test_the_same_call_twice_in_one_round_runs_once(wire: Wire, router: FakeRouter) -> None:
    cid = await conversation(wire)
    bad = {"id": "c1", "name": "conversation_search", "arguments": json.dumps({"query": 7})}
    router.script(Reply(tool_calls=[bad, {**bad, "id": "c2"}]), Reply(text="done"))
    events = await wire.ask("search twice", conversation=cid)
    assert [t["ok"] for t in of_type(events, "tool")] == [False, False]
    first, second = tool_contents(router.requests[-1])
    assert first.startswith("Error: query must be a string") and second == f"{first}\n\n{REPEAT_ERROR_NOTE}"


async def test_a_call_the_server_could_not_parse_is_asked_again_with_the_tools_closed(wire: Wire, router: FakeRouter) -> None:
    cid = await conversation(wire)
    router.script(call("conversation_search", {"query": "locker"}, unparsed="status"), Reply(text="It is 4471."))
    events = await wire.ask("what was my locker code?", conversation=cid)
    assert events[-1]["type"] == "done", events[-1]
    assert reply_text(events) == "It is 4471." and not of_type(events, "tool")
    tried, again = router.requests[-2:]
    assert not closed(tried) and closed(again)
    assert again["messages"][-1]["content"].endswith(UNREAD_CALL_NOTE)
    await wire.ask("thanks", conversation=cid)
    assert not closed(router.requests[-1])  # the next turn offers them again


async def test_a_call_that_fails_mid_stream_keeps_what_streamed_and_is_asked_again(
    wire: Wire, router: FakeRouter
) -> None:
    cid = await conversation(wire)
    router.script(call("conversation_search", {"query": "locker"}, text="Let me look.", unparsed="stream"),
                  Reply(text="It is 4471."))
    events = await wire.ask("what was my locker code?", conversation=cid)
    assert events[-1]["type"] == "done", events[-1]
    assert reply_text(events) == "Let me look.\n\nIt is 4471."
    assert closed(router.requests[-1])
    opened = await wire.request({"type": "open", "conversation": cid})
    assert opened["turns"][1]["status"] == "complete" and opened["turns"][1]["reply"].endswith("It is 4471.")


async def test_a_second_unreadable_answer_is_a_clear_error_and_the_partial_reply_is_kept(
    wire: Wire, router: FakeRouter
) -> None:
    cid = await conversation(wire)
    router.script(call("conversation_search", {"query": "locker"}, text="Let me look.", unparsed="stream"),
                  Reply(text="Still", error=FORMAT_ERROR))
    events = await wire.ask("what was my locker code?", conversation=cid)
    error = events[-1]
    assert error["type"] == "error" and error["code"] == "router_error", error
    assert "could not read" in error["message"] and "ask again" in error["message"]
    assert error["turn"] == 2
    opened = await wire.request({"type": "open", "conversation": cid})
    turn = opened["turns"][1]
    assert turn["status"] == "error" and turn["reply"].startswith("Let me look.") and "Still" in turn["reply"]
    assert (await wire.ask("try again", conversation=cid))[-1]["type"] == "done"  # the daemon lives on
