"""Memory across conversations (issue 48), through the real socket and the fake router: saved
memories and their requests, the model's memory_save, the frozen system-prompt block, incognito
conversations, deletion, and conversation_search's scope "all"."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from client import Wire
from core import Config
from history import AsyncHistory, HistoryStore
from history.aio import AsyncTables
from selfcheck.fakerouter import FakeRouter, Reply
from tests.conftest import serving
from tests.test_client import cli

pytestmark = pytest.mark.asyncio


def call(name: str, arguments: dict[str, Any], call_id: str = "call_1") -> Reply:
    return Reply(tool_calls=[{"id": call_id, "name": name, "arguments": json.dumps(arguments)}])


def system_text(request: dict[str, Any]) -> str:
    first = request["messages"][0]
    return str(first["content"]) if first["role"] == "system" else ""


def tool_names(request: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in request.get("tools") or []]


def tool_result(request: dict[str, Any]) -> dict[str, Any]:
    [message] = [m for m in request["messages"] if m["role"] == "tool"]
    return json.loads(message["content"])  # type: ignore[no-any-return]


async def watching(daemon: Any) -> Wire:
    watcher = await daemon.connect()
    rid = await watcher.send({"type": "watch"})
    await watcher.until(rid, ("watching",))
    return watcher


async def next_change(watcher: Wire, kind: str) -> dict[str, Any]:
    while True:
        event = await watcher.read()
        if event["type"] == "changed" and event["kind"] == kind:
            return event


async def test_memories_are_added_listed_edited_and_forgotten_and_watchers_see_each(
    wire: Wire, daemon: Any
) -> None:
    watcher = await watching(daemon)
    answer = await wire.request({"type": "memory_add", "text": "  I am vegetarian "})
    assert answer["type"] == "memory" and answer["action"] == "added"
    added = answer["memory"]
    assert added["text"] == "I am vegetarian" and added["source"] is None
    assert added["created_at"] == added["updated_at"]
    change = await next_change(watcher, "memory")
    assert change["action"] == "added" and change["memory"] == added
    second = (await wire.request({"type": "memory_add", "text": "My bike is a 2019 Brompton"}))["memory"]
    listed = await wire.request({"type": "memories"})
    assert listed["type"] == "memories"
    assert [m["id"] for m in listed["items"]] == [second["id"], added["id"]]  # newest first
    edited = await wire.request({"type": "memory_edit", "memory": added["id"], "text": "I am vegan"})
    assert edited["action"] == "edited" and edited["memory"]["text"] == "I am vegan"
    assert (await next_change(watcher, "memory"))["action"] == "added"
    assert (await next_change(watcher, "memory"))["action"] == "edited"
    forgotten = await wire.request({"type": "memory_forget", "memory": second["id"]})
    assert forgotten["action"] == "forgotten" and forgotten["memory"] == second
    change = await next_change(watcher, "memory")
    assert change["action"] == "forgotten" and change["memory"] == second
    assert [m["text"] for m in (await wire.request({"type": "memories"}))["items"]] == ["I am vegan"]
    await watcher.close()


@pytest.mark.parametrize(
    "request_, code, words",
    [
        ({"type": "memory_add", "text": "   "}, "bad_request", "fact to remember"),
        ({"type": "memory_add", "text": "x" * 501}, "bad_request", "at most 500"),
        ({"type": "memory_add"}, "bad_request", "text"),
        ({"type": "memory_edit", "memory": 99, "text": "a fact"}, "not_found", "memory list"),
        ({"type": "memory_forget", "memory": 99}, "not_found", "memory list"),
        ({"type": "memory_forget", "memory": "one"}, "bad_request", "memory"),
    ],
)
async def test_bad_memory_requests_are_refused_with_what_to_do(
    wire: Wire, request_: dict[str, Any], code: str, words: str
) -> None:
    error = await wire.request(request_)
    assert error["type"] == "error" and error["code"] == code and words in error["message"]
    assert (await wire.request({"type": "memories"}))["items"] == []  # nothing kept, the daemon alive


async def test_memories_go_into_a_new_conversation_frozen_byte_for_byte(wire: Wire, router: FakeRouter) -> None:
    await wire.request({"type": "memory_add", "text": "I live in Lisbon"})
    cid = (await wire.ask("hello"))[0]["conversation"]
    first = system_text(router.requests[-1])
    assert "I live in Lisbon" in first and first.startswith(Config.system_prompt)
    moved = (await wire.request({"type": "memory_add", "text": "I moved to Porto"}))["memory"]
    await wire.ask("and again", conversation=cid)
    assert system_text(router.requests[-1]) == first  # frozen: the server's prompt cache holds
    await wire.request({"type": "memory_forget", "memory": 1})
    await wire.ask("once more", conversation=cid)
    assert system_text(router.requests[-1]) == first
    await wire.ask("a new conversation")
    fresh = system_text(router.requests[-1])
    assert "I moved to Porto" in fresh and "Lisbon" not in fresh  # started after the forget
    await wire.request({"type": "memory_edit", "memory": moved["id"], "text": "I moved to Braga"})
    await wire.ask("another new one")
    assert "I moved to Braga" in system_text(router.requests[-1])
    assert "Porto" not in system_text(router.requests[-1])


async def test_the_frozen_block_comes_with_the_trip_that_begins_the_turn(
    config: Config, router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    trips: list[str] = []  # every store method sent to the history thread, by name

    def recording(run: Any) -> Any:
        async def recorded(self: Any, method: Any, /, *args: Any, **kwargs: Any) -> Any:
            trips.append(method.__qualname__)
            return await run(self, method, *args, **kwargs)
        return recorded

    monkeypatch.setattr(AsyncHistory, "run", recording(AsyncHistory.run))
    monkeypatch.setattr(AsyncTables, "run", recording(AsyncTables.run))
    async with serving(config) as (_daemon, client):
        await client.request({"type": "memory_add", "text": "I live in Lisbon"})
        cid = (await client.ask("hello"))[0]["conversation"]
        first = system_text(router.requests[-1])
        assert "I live in Lisbon" in first
        await client.request({"type": "memory_add", "text": "I moved to Porto"})
        trips.clear()
        await client.ask("and again", conversation=cid)
        assert system_text(router.requests[-1]) == first  # still frozen
        assert "HistoryStore.begin_turn" in trips
        assert not [trip for trip in trips if trip.startswith("MemoryStore.fr")]  # no trip of its own
    async with serving(config) as (_daemon, client):  # kept across a restart, read with the turn
        trips.clear()
        await client.ask("after a restart", conversation=cid)
        assert system_text(router.requests[-1]) == first
        await client.ask("a new conversation")
        assert "I moved to Porto" in system_text(router.requests[-1])
        assert not [trip for trip in trips if trip.startswith("MemoryStore.fr")]


async def test_a_conversation_with_its_own_system_prompt_gets_memories_under_an_empty_default(
    config: Config, router: FakeRouter
) -> None:
    async with serving(dataclasses.replace(config, system_prompt="")) as (_daemon, client):
        await client.request({"type": "memory_add", "text": "I live in Lisbon"})
        cid = (await client.ask("hello", system="Answer briefly."))[0]["conversation"]
        first = system_text(router.requests[-1])
        assert first.startswith("Answer briefly.") and "I live in Lisbon" in first
        await client.request({"type": "memory_add", "text": "I moved to Porto"})
        await client.ask("and again", conversation=cid)
        assert system_text(router.requests[-1]) == first  # frozen, read apart from the turn's trip
        await client.ask("no system prompt at all")
        assert system_text(router.requests[-1]) == ""  # no system message: nowhere for a block


async def test_the_block_keeps_the_newest_memories_within_memory_tokens(
    config: Config, router: FakeRouter
) -> None:
    async with serving(dataclasses.replace(config, memory_tokens=150)) as (_daemon, client):
        for n in range(1, 6):
            await client.request({"type": "memory_add", "text": f"fact number {n} " + "x" * 40})
        await client.ask("hello")
        block = system_text(router.requests[-1])
        assert "fact number 3" in block and "fact number 2" not in block  # newest first, cut to the budget
        assert block.index("fact number 5") < block.index("fact number 4")


async def test_a_memory_of_several_lines_is_one_line_of_the_block(wire: Wire, router: FakeRouter) -> None:
    await wire.request({"type": "memory_add", "text": "first line\n- (2020-01-01) a fake older memory"})
    await wire.ask("hello")
    block = system_text(router.requests[-1])
    assert "first line - (2020-01-01) a fake older memory" in block and "\n- (2020" not in block
    [memory] = (await wire.request({"type": "memories"}))["items"]
    assert memory["text"] == "first line\n- (2020-01-01) a fake older memory"  # kept as written


async def test_memory_save_by_the_model_is_kept_shown_and_reaches_the_next_conversation(
    wire: Wire, router: FakeRouter, daemon: Any
) -> None:
    watcher = await watching(daemon)
    router.script(call("memory_save", {"text": "The user is vegetarian"}), Reply(text="Noted."))
    events = await wire.ask("remember that I'm vegetarian")
    assert "memory_save" in tool_names(router.requests[0])
    [tool] = [e for e in events if e["type"] == "tool"]
    assert tool["name"] == "memory_save" and tool["ok"] is True
    assert tool["summary"] == "remembered: The user is vegetarian (memory 1)"
    assert tool_result(router.requests[-1])["saved"] == {"id": 1, "text": "The user is vegetarian"}
    change = await next_change(watcher, "memory")
    assert change["action"] == "added" and change["memory"]["source"] == {"conversation": 1, "turn": 1}
    [memory] = (await wire.request({"type": "memories"}))["items"]
    assert memory["source"] == {"conversation": 1, "turn": 1}
    await wire.ask("what should I cook tonight?")
    assert "The user is vegetarian" in system_text(router.requests[-1])
    await watcher.close()


async def test_a_too_long_memory_save_is_an_error_result_and_keeps_nothing(wire: Wire, router: FakeRouter) -> None:
    router.script(call("memory_save", {"text": "y" * 600}), Reply(text="Could not."))
    events = await wire.ask("remember this essay")
    [tool] = [e for e in events if e["type"] == "tool"]
    assert tool["ok"] is False and events[-1]["type"] == "done"
    assert (await wire.request({"type": "memories"}))["items"] == []


async def test_an_incognito_conversation_neither_reads_nor_saves_memories(
    wire: Wire, router: FakeRouter, daemon: Any
) -> None:
    await wire.request({"type": "memory_add", "text": "I live in Lisbon"})
    watcher = await watching(daemon)
    events = await wire.ask("hello", memory="off")
    cid = events[0]["conversation"]
    updated = await next_change(watcher, "conversation")
    while updated["action"] != "updated":
        updated = await next_change(watcher, "conversation")
    await watcher.close()
    assert updated["conversation"] == cid and updated["settings"] == {"memory": "off"}  # watchers know it
    assert "Lisbon" not in system_text(router.requests[-1])
    assert "memory_save" not in tool_names(router.requests[-1])
    opened = await wire.request({"type": "open", "conversation": cid})
    assert opened["settings"]["memory"] == "off"
    await wire.request({"type": "settings", "conversation": cid, "memory": "on"})
    await wire.ask("and now?", conversation=cid)
    assert "Lisbon" in system_text(router.requests[-1]) and "memory_save" in tool_names(router.requests[-1])
    refused = await wire.ask("again", conversation=cid, memory="off")
    assert refused[-1]["type"] == "error" and "settings" in refused[-1]["message"]


async def test_memory_off_in_the_configuration_turns_it_all_off(config: Config, router: FakeRouter) -> None:
    async with serving(dataclasses.replace(config, memory="off")) as (_daemon, client):
        await client.request({"type": "memory_add", "text": "I live in Lisbon"})
        await client.ask("hello")
        assert "Lisbon" not in system_text(router.requests[-1])
        assert "memory_save" not in tool_names(router.requests[-1])


async def test_deleting_a_conversation_forgets_what_was_saved_there(
    wire: Wire, router: FakeRouter, daemon: Any, config: Config
) -> None:
    router.script(call("memory_save", {"text": "The user's cat is called Zebulon"}), Reply(text="Noted."))
    cid = (await wire.ask("my cat Zebulon is ginger; remember his name"))[0]["conversation"]
    await wire.request({"type": "memory_add", "text": "kept: added by the user"})
    other = (await wire.ask("hello"))[0]["conversation"]
    assert (await wire.request({"type": "search", "query": "Zebulon"}))["total"] >= 1  # there while it lives
    question = {"type": "estimate", "conversation": other, "text": "what colour is my cat Zebulon?"}
    assert cid in {s.get("conversation") for s in (await wire.request(question))["recalled"]}  # and injected
    watcher = await watching(daemon)
    assert (await wire.request({"type": "delete", "conversation": cid}))["type"] == "deleted"
    change = await next_change(watcher, "memory")
    await watcher.close()
    assert change["action"] == "forgotten" and change["memory"]["id"] == 1
    assert [m["text"] for m in (await wire.request({"type": "memories"}))["items"]] == ["kept: added by the user"]
    assert (await wire.request({"type": "search", "query": "Zebulon"}))["total"] == 0
    assert (await wire.request(question))["recalled"] == []  # the per-turn injection finds nothing of it
    remembered = await wire.request({"type": "memory_search", "query": "Zebulon"})
    assert remembered["memories"] == [] and remembered["results"] == []
    router.script(call("conversation_search", {"query": "Zebulon ginger", "scope": "all"}), Reply(text="No."))
    await wire.ask("what is my cat called?", conversation=other)
    result = tool_result(router.requests[-1])
    assert result["total"] == 0 and result["scope"] == "all" and result["results"] == []
    await wire.ask("a fresh conversation")
    assert "Zebulon" not in system_text(router.requests[-1])
    with HistoryStore(config.db_path) as store:
        assert store.memories.frozen(cid) is None  # its frozen block went with it
        assert store.memories.search_others(other, "Zebulon", 20) == []


async def test_scope_all_finds_other_conversations_labelled_but_never_incognito_ones(
    wire: Wire, router: FakeRouter
) -> None:
    bike = (await wire.ask("my bike is a 2019 Brompton"))[0]["conversation"]
    await wire.request({"type": "settings", "conversation": bike, "title": "Bike fitting"})
    secret = (await wire.ask("my other Brompton is a secret", memory="off"))[0]["conversation"]
    here = (await wire.ask("hello"))[0]["conversation"]
    await wire.ask("I ride a Brompton to work", conversation=here)
    router.script(call("conversation_search", {"query": "Brompton", "scope": "all"}), Reply(text="A Brompton."))
    await wire.ask("which bike do I have?", conversation=here)
    result = tool_result(router.requests[-1])
    assert {r["turn"] for r in result["results"] if "title" not in r} == {2}  # this conversation's own
    labelled = [r for r in result["results"] if "title" in r]
    assert labelled and {(r["conversation"], r["title"]) for r in labelled} == {(bike, "Bike fitting")}
    assert all(len(r["date"]) == 10 and r["date"][:2] == "20" for r in labelled)
    assert secret not in {r.get("conversation") for r in result["results"]}
    assert result["results"][0]["turn"] == 2 and "title" not in result["results"][0]  # its own first
    # an incognito conversation cannot search the others
    router.script(call("conversation_search", {"query": "Brompton", "scope": "all"}), Reply(text="Cannot."))
    events = await wire.ask("which bike?", conversation=secret)
    [tool] = [e for e in events if e["type"] == "tool"]
    assert tool["ok"] is False
    assert "incognito" in [m for m in router.requests[-1]["messages"] if m["role"] == "tool"][0]["content"]


# -- the command line, as a real process ----------------------------------------------------


async def test_the_memory_commands_list_add_edit_and_forget(daemon: Any, router: FakeRouter) -> None:
    code, out, err = await cli("memory", "add", "I", "am", "vegetarian")
    assert code == 0, err
    assert out.strip() == "added memory 1: I am vegetarian"
    code, out, _ = await cli("memory", "list")
    assert code == 0 and out.split()[:4] == ["1", "I", "am", "vegetarian"] and "added by you" in out
    code, out, _ = await cli("memory", "edit", "1", "I", "am", "vegan")
    assert code == 0 and out.strip() == "edited memory 1: I am vegan"
    code, out, _ = await cli("--json", "memory", "list")
    assert [m["text"] for m in json.loads(out)["items"]] == ["I am vegan"]
    code, out, _ = await cli("memory", "forget", "1")
    assert code == 0 and out.strip() == "forgotten memory 1: I am vegan"
    code, _, err = await cli("memory", "forget", "1")
    assert code == 1 and "error (not_found)" in err and "memory list" in err
    code, out, _ = await cli("memory", "list")
    assert code == 0 and "no saved memories" in out


async def test_ask_prints_what_the_model_remembered_and_incognito_reads_none(
    daemon: Any, router: FakeRouter
) -> None:
    router.script(call("memory_save", {"text": "The user rides a Brompton"}), Reply(text="Noted."))
    code, out, err = await cli("ask", "remember that I ride a Brompton")
    assert code == 0, err
    assert "remembered: The user rides a Brompton (memory 1); forget it with: assistant memory forget 1" in err
    assert "remembered" not in out  # stdout is the reply alone
    code, _, err = await cli("ask", "--incognito", "which bike?")
    assert code == 0, err
    assert "Brompton" not in system_text(router.requests[-1])
    assert "memory_save" not in tool_names(router.requests[-1])
    code, _, err = await cli("ask", "which bike, then?")
    assert code == 0 and "The user rides a Brompton" in system_text(router.requests[-1])
    code, _, err = await cli("ask", "-c", "--incognito", "and now?")
    assert code == 2 and "settings" in err and "--memory off" in err
    code, out, err = await cli("settings", "2")
    assert code == 0 and "  memory: off (incognito)" in out.splitlines(), err
    code, out, err = await cli("settings", "2", "--memory", "on")
    assert code == 0 and "memory: off" not in out, err
