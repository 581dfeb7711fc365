"""A tool call the model wrote as its reply's text, through the real socket (issue 33): when a
round's whole text is one JSON call of an offered tool and the server returned no
``tool_calls`` (Qwen2.5-Coder-1.5B's unfenced calls, which llama-server leaves as content),
the daemon runs it; JSON naming a tool not offered, or JSON among words, stays the reply."""

from __future__ import annotations

import json
from collections.abc import Iterator
import pytest

from client import Wire, of_type, reply_text
from selfcheck.fakerouter import FakeRouter, Reply

pytestmark = pytest.mark.asyncio

SEARCH = {"name": "conversation_search", "arguments": {"query": "locker"}}


@pytest.fixture
def router() -> Iterator[FakeRouter]:
    with FakeRouter() as fake:
        yield fake


async def conversation(wire: Wire) -> int:
    events = await wire.ask("my locker code is 4471")
    assert events[-1]["type"] == "done", events[-1]
    return int(of_type(events, "user")[0]["conversation"])


@pytest.mark.parametrize(
    "text",
    [
        json.dumps(SEARCH),
        f"  \n{json.dumps(SEARCH, indent=2)}\n",
        f"```json\n{json.dumps(SEARCH)}\n```",
        json.dumps({"name": "conversation_search", "arguments": json.dumps({"query": "locker"})}),
    ],
    ids=["bare", "indented", "fenced", "arguments-as-string"],
)
async def test_a_reply_that_is_one_json_call_runs_the_tool(wire: Wire, router: FakeRouter, text: str) -> None:
    cid = await conversation(wire)
    router.script(Reply(text=text), Reply(text="It is 4471."))
    events = await wire.ask("what was my locker code?", conversation=cid)
    assert events[-1]["type"] == "done", events[-1]
    [tool] = of_type(events, "tool")
    assert tool["name"] == "conversation_search" and tool["ok"] is True, tool
    assert tool["arguments"] == {"query": "locker"} and tool["from_text"] is True
    # the next request carries the call as a call, and its result
    messages = router.requests[-1]["messages"]
    [called] = [m for m in messages if m["role"] == "assistant" and m.get("tool_calls")]
    assert called["tool_calls"][0]["function"]["name"] == "conversation_search"
    assert "conversation_search" not in (called.get("content") or "")
    [result] = [m["content"] for m in messages if m["role"] == "tool"]
    assert "4471" in json.loads(result)["results"][0]["excerpt"]
    # what is kept is the answer, not the call's text
    opened = await wire.request({"type": "open", "conversation": cid})
    turn = opened["turns"][1]
    assert turn["reply"] == "It is 4471." and [t["name"] for t in turn["tools"]] == ["conversation_search"]


@pytest.mark.parametrize(
    "text",
    [
        f"Let me search: {json.dumps(SEARCH)}",
        f"{json.dumps(SEARCH)} and then I will answer",
        json.dumps({**SEARCH, "why": "to find it"}),
        json.dumps({"name": "conversation_search", "arguments": ["locker"]}),
    ],
    ids=["after-words", "before-words", "extra-key", "arguments-not-an-object"],
)
async def test_json_that_is_not_exactly_a_call_of_an_offered_tool_stays_text(
    wire: Wire, router: FakeRouter, text: str
) -> None:
    cid = await conversation(wire)
    asked = len(router.requests)
    router.script(Reply(text=text))
    events = await wire.ask("what was my locker code?", conversation=cid)
    assert events[-1]["type"] == "done", events[-1]
    assert of_type(events, "tool") == []
    assert len(router.requests) == asked + 1  # no round followed
    assert reply_text(events) == text
    opened = await wire.request({"type": "open", "conversation": cid})
    assert opened["turns"][1]["reply"] == text and opened["turns"][1]["tools"] == []



async def test_a_call_of_a_tool_not_offered_runs_nothing_and_the_model_answers(wire: Wire, router: FakeRouter) -> None:
    """Qwen2.5-Coder-1.5B answered "what is 17 times 13?" with a call of a tool it made up
    (issue 49's run): left as the reply, the user got a call; as a call of no tool, nothing
    runs, the model is told the tools there are, and it answers."""
    cid = await conversation(wire)
    made_up = json.dumps({"name": "math_operation", "arguments": {"operation": "multiply", "numbers": [17, 13]}})
    router.script(Reply(text=made_up), Reply(text="221"))
    events = await wire.ask("what is 17 times 13?", conversation=cid)
    assert events[-1]["type"] == "done" and events[-1]["text"] == "221", events[-1]
    [tool] = of_type(events, "tool")
    assert tool["name"] == "math_operation" and tool["ok"] is False and tool["from_text"] is True
    [result] = [m["content"] for m in router.requests[-1]["messages"] if m["role"] == "tool"]
    assert "there is no tool named 'math_operation'" in result and "conversation_search" in result
