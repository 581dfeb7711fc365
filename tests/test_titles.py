"""Conversation titles: the question's first words at once, the model's title after the first reply."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from client import Wire
from core import Config
from daemon.titles import clean_title, provisional_title
from selfcheck.fakerouter import FakeRouter, Reply
from tests.conftest import RunningDaemon


class Titled:
    """A daemon that makes titles, and a way to wait for them."""

    def __init__(self, running: RunningDaemon, wire: Wire) -> None:
        self.running = running
        self.wire = wire

    async def ask(self, text: str, **fields: object) -> list[dict]:
        events = await self.wire.ask(text, **fields)
        assert self.running.server is not None and self.running.server.engine is not None
        await self.running.server.engine.settle()  # the title is made in the background
        return events

    async def title(self, cid: int) -> str:
        return (await self.wire.request({"type": "open", "conversation": cid}))["title"]


@pytest_asyncio.fixture
async def titled(config: Config) -> AsyncIterator[Titled]:
    running = RunningDaemon(dataclasses.replace(config, auto_title=True))
    await running.start()
    wire = await running.connect()
    yield Titled(running, wire)
    await wire.close()
    await running.stop()


@pytest.mark.asyncio
async def test_the_model_names_a_new_conversation(titled: Titled, router: FakeRouter) -> None:
    router.script_complete(Reply(text='"Rust borrow checker basics."'))
    events = await titled.ask("how does the borrow checker in rust work, in simple words please")
    assert await titled.title(events[0]["conversation"]) == "Rust borrow checker basics"
    turn, title_request = router.requests[0], [r for r in router.requests if not r.get("stream")][-1]
    # the title request extends the turn's own prompt, so a server reuses its cache for it
    assert title_request["messages"][: len(turn["messages"])] == turn["messages"]
    assert "borrow checker" in title_request["messages"][-3]["content"]
    assert title_request["messages"][-2] == {"role": "assistant", "content": events[-1]["text"]}
    assert title_request["messages"][-1]["content"].startswith("Name this conversation")
    assert title_request["max_tokens"] == 24


@pytest.mark.asyncio
async def test_a_failed_title_keeps_the_first_words(titled: Titled, router: FakeRouter) -> None:
    router.script_complete(Reply(status=500, error="no"))
    events = await titled.ask("what is a good name for a cat")
    assert len([r for r in router.requests if not r.get("stream")]) == 1
    assert await titled.title(events[0]["conversation"]) == "what is a good name for a cat"


@pytest.mark.asyncio
async def test_a_title_that_says_the_request_back_keeps_the_first_words(titled: Titled, router: FakeRouter) -> None:
    router.script_complete(Reply(text="The conversation is named with a title of at most six words"))
    events = await titled.ask("what is a good name for a dog")
    assert len([r for r in router.requests if not r.get("stream")]) == 1
    assert await titled.title(events[0]["conversation"]) == "what is a good name for a dog"


@pytest.mark.asyncio
async def test_a_follow_up_waits_for_its_conversations_title_not_anothers(titled: Titled, router: FakeRouter) -> None:
    """The title request holds the server's copy of its conversation: the next question there is
    sent once it is answered (else it would be read anew in another slot); another conversation's
    is not held up."""
    router.script_complete(Reply(text="Colours", delay=0.5), Reply(text="Animals", delay=0.5))
    first = (await titled.wire.ask("name a colour"))[0]["conversation"]  # its title is under way
    events = await titled.wire.ask("and another?", conversation=first)
    assert events[-1]["type"] == "done"
    titles = [i for i, r in enumerate(router.requests) if not r.get("stream")]
    follow_up = len(router.requests) - 1
    assert titles == [1] and follow_up == 2
    assert router.arrivals[follow_up] >= router.arrivals[1] + 0.5 - 0.01  # sent once the title was answered
    second = (await titled.wire.ask("name an animal"))[0]["conversation"]  # its title is under way now
    other = await titled.wire.ask("name a colour", conversation=first)
    assert other[-1]["type"] == "done"
    title = max(i for i, r in enumerate(router.requests) if not r.get("stream"))
    assert router.arrivals[-1] < router.arrivals[title] + 0.5  # not held up by conversation 2's title
    await titled.running.server.engine.settle()
    assert await titled.title(second) == "Animals"


@pytest.mark.asyncio
async def test_a_renamed_conversation_keeps_its_name(titled: Titled, router: FakeRouter) -> None:
    router.script_complete(Reply(text="Model title", delay=0.2))
    rid = await titled.wire.send({"type": "ask", "text": "rename me"})
    cid = (await titled.wire.until(rid))[0]["conversation"]
    await titled.wire.request({"type": "settings", "conversation": cid, "title": "Mine"})
    assert titled.running.server is not None and titled.running.server.engine is not None
    await titled.running.server.engine.settle()
    assert await titled.title(cid) == "Mine"


@pytest.mark.asyncio
async def test_only_the_first_turn_asks_for_a_title(titled: Titled, router: FakeRouter) -> None:
    events = await titled.ask("one")
    cid = events[0]["conversation"]
    assert await titled.title(cid) == "Fake title"
    await titled.ask("two", conversation=cid)
    assert len([r for r in router.requests if not r.get("stream")]) == 1


def test_provisional_title() -> None:
    assert provisional_title("  a b c d e f g h i j ") == "a b c d e f g h"
    assert provisional_title("x" * 100).endswith("…") and len(provisional_title("x" * 100)) == 60
    assert provisional_title("   ") == "New conversation"


def test_clean_title() -> None:
    assert clean_title('<think>hmm</think>\n"Title: Cats and dogs."') == "Cats and dogs"
    assert clean_title("**Rust**\nextra line") == "Rust"
    assert clean_title("   ") == ""
    # a small model saying the request back (SmolLM2 135M did): not a title, the provisional one stays
    assert clean_title("This conversation is between a title of at most six words and you") == ""
    # an apology, a tool's name or a sentence (SmolLM2 135M's): the question's first words stay
    assert clean_title("I'm sorry for the confusion. Here is a title") == ""
    assert clean_title("Notes__write_note") == "" and clean_title("conversation_search") == ""
    assert clean_title("The user asked about the borrow checker and I explained how lifetimes work in Rust") == ""
    assert clean_title("Sorting in Python") == "Sorting in Python"


@pytest.mark.asyncio
async def test_an_apology_for_a_title_keeps_the_questions_words(titled: Titled, router: FakeRouter) -> None:
    router.script_complete(Reply(text="I'm sorry for the confusion, but"))
    events = await titled.ask("what tyre size does a 2019 Brompton take")
    assert router.requests[-1].get("stream") is False or not router.requests[-1].get("stream")  # the title was asked
    assert await titled.title(events[0]["conversation"]) == "what tyre size does a 2019 Brompton take"
