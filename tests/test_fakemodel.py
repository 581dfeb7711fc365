"""The in-process fake model holds to the seams it stands in for."""

from __future__ import annotations

import math

import pytest

from core.errors import RouterError, RouterUnreachable
from selfcheck.fakerouter import fake_embedding
from tests.fakemodel import Completion, EmbedCall, FakeModel

pytestmark = pytest.mark.asyncio


async def test_complete_answers_in_the_order_queued_and_records_the_calls() -> None:
    model = FakeModel()
    model.enqueue("first", RouterError("crashed"))
    model.enqueue("third")
    asked = [{"role": "user", "content": "hi"}]
    assert await model.complete("m", asked, max_tokens=10, temperature=0) == "first"
    asked[0]["content"] = "changed after the call"
    with pytest.raises(RouterError, match="crashed"):
        await model.complete("m", asked)
    assert await model.complete("other", []) == "third"
    assert model.completions[0] == Completion("m", [{"role": "user", "content": "hi"}], 10, {"temperature": 0})
    assert [c.model for c in model.completions] == ["m", "m", "other"]
    with pytest.raises(AssertionError, match="no reply queued"):
        await model.complete("m", asked)


async def test_embed_is_deterministic_and_can_fail() -> None:
    model = FakeModel()
    texts = ["otters eat fish", "fish otters eat", "volcanoes in Iceland"]
    vectors = await model.embed("e", texts, timeout=1.5)
    assert vectors == [fake_embedding(text) for text in texts]  # as the fake router's, so the fakes agree
    assert vectors[0] == vectors[1] != vectors[2]  # a bag of words
    assert all(math.isclose(sum(x * x for x in v), 1.0) for v in vectors)
    assert len((await FakeModel(dim=32).embed("e", ["x"]))[0]) == 32

    model.fail_embeddings()
    with pytest.raises(RouterUnreachable):
        await model.embed("e", ["otters"])
    model.fail_embeddings(RouterError("input is too large to process", 500))
    with pytest.raises(RouterError, match="too large"):
        await model.embed("e", ["otters"])
    model.heal_embeddings()
    assert await model.embed("e", []) == []
    assert model.embed_calls[0] == EmbedCall("e", texts, 1.5) and len(model.embed_calls) == 4
