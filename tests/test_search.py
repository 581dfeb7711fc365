"""The user-facing ``search`` request and ``assistant search``: FTS5 over every conversation."""

from __future__ import annotations

import pytest

from client import Wire
from history.fts import INDEX_TOKEN, MAX_QUERY_TOKENS, quoted_phrases
from selfcheck.fakerouter import FakeRouter, Reply

pytestmark = pytest.mark.asyncio


async def test_search_groups_hits_by_conversation(wire: Wire, router: FakeRouter) -> None:
    router.script(Reply(text="Penguins live in the southern hemisphere."), Reply(text="Cats sleep a lot."),
                  Reply(text="Emperor penguins are the largest penguins."))
    first = (await wire.ask("tell me about penguins"))[0]["conversation"]
    second = (await wire.ask("tell me about cats"))[0]["conversation"]
    await wire.ask("which penguins are largest?", conversation=first)
    event = await wire.request({"type": "search", "query": "penguins"})
    assert event["type"] == "results" and event["query"] == "penguins"
    [group] = event["conversations"]
    assert group["conversation"] == first and group["title"] == "tell me about penguins"
    assert event["total"] == len(group["hits"]) == 4
    ranks = [h["rank"] for h in group["hits"]]
    assert ranks == sorted(ranks, reverse=True)
    assert {h["role"] for h in group["hits"]} == {"user", "assistant"}
    assert any("[penguins]" in h["excerpt"].lower() for h in group["hits"])
    cats = await wire.request({"type": "search", "query": "cats"})
    assert [g["conversation"] for g in cats["conversations"]] == [second]


async def test_a_turn_is_found_once_it_has_ended(wire: Wire, router: FakeRouter) -> None:
    router.script(Reply(chunks=["Walruses "], hang=True))
    rid = await wire.send({"type": "ask", "text": "where do walruses sleep?"})
    started = await wire.until(rid, ("delta",))
    cid = started[0]["conversation"]
    running = await wire.request({"type": "search", "query": "walruses"})
    assert running["conversations"] == []  # indexed with its reply, when the turn ends
    await wire.request({"type": "cancel", "conversation": cid})
    await wire.until(rid)
    ended = await wire.request({"type": "search", "query": "walruses"})
    [group] = ended["conversations"]
    assert group["conversation"] == cid
    assert {h["role"] for h in group["hits"]} == {"user", "assistant"}  # the question and the words shown


async def test_search_within_one_conversation(wire: Wire) -> None:
    a = (await wire.ask("apples and pears"))[0]["conversation"]
    b = (await wire.ask("apples and plums"))[0]["conversation"]
    everywhere = await wire.request({"type": "search", "query": "apples"})
    assert {g["conversation"] for g in everywhere["conversations"]} == {a, b}
    only_b = await wire.request({"type": "search", "query": "apples", "conversation": b})
    assert [g["conversation"] for g in only_b["conversations"]] == [b]
    missing = await wire.request({"type": "search", "query": "apples", "conversation": 999})
    assert missing["code"] == "not_found"


@pytest.mark.parametrize("query", ['"', "a*", "NOT", "NEAR(", "x:y", "(((", "AND OR"])
async def test_nasty_queries_never_break(wire: Wire, query: str) -> None:
    await wire.ask("some text with NOT and x:y in it")
    event = await wire.request({"type": "search", "query": query})
    assert event["type"] == "results"


async def test_a_word_of_many_tokens_is_searched_by_its_first_ones(wire: Wire) -> None:
    # the index splits at what is not a letter or digit: this one "word" is a phrase of 100
    # tokens, each a walk of its matches; the search looks up MAX_QUERY_TOKENS of them in all
    word = "-".join(f"w{n}" for n in range(100))
    cid = (await wire.ask(f"the code is {word} today"))[0]["conversation"]
    found = await wire.request({"type": "search", "query": word})
    assert [g["conversation"] for g in found["conversations"]] == [cid]
    phrases = quoted_phrases(f"{word} {word}x and more")
    assert sum(len(INDEX_TOKEN.findall(p)) for p in phrases) == MAX_QUERY_TOKENS
    assert quoted_phrases("state-of-the-art tools") == ['"state-of-the-art"', '"tools"']  # short words as typed


async def test_deleted_conversations_are_not_found(wire: Wire) -> None:
    cid = (await wire.ask("secret plans"))[0]["conversation"]
    await wire.request({"type": "delete", "conversation": cid})
    event = await wire.request({"type": "search", "query": "secret"})
    assert event["conversations"] == [] and event["total"] == 0


async def test_empty_query_is_a_bad_request(wire: Wire) -> None:
    event = await wire.request({"type": "search", "query": "   "})
    assert event["code"] == "bad_request"
