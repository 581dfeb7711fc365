"""A model named by its short name: llama-server without ``--alias`` lists its model by the
whole GGUF path, and people name it by the file name (issue 45)."""

from __future__ import annotations

import pytest

from selfcheck.fakerouter import FakeModel, FakeRouter
from tests.conftest import RunningDaemon
from tests.test_client import cli

SMOL = "/home/me/models/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def by_path(router: FakeRouter) -> FakeRouter:
    router.models = [FakeModel(SMOL, ["text"], 4096), FakeModel("/other/Qwen2.5-1.5B.gguf", ["text"], 8192)]
    return router


@pytest.mark.asyncio
async def test_a_short_name_names_the_model_everywhere(daemon: RunningDaemon, by_path: FakeRouter) -> None:
    wire = await daemon.connect()
    try:
        status = await wire.request({"type": "status"})
        assert status["model"] == SMOL and status["model_name"] == "SmolLM2-135M-Instruct.Q4_1"
        listed = await wire.request({"type": "models"})
        assert [m["name"] for m in listed["items"]] == ["SmolLM2-135M-Instruct.Q4_1", "Qwen2.5-1.5B"]
        events = await wire.ask("hello", model="smollm2-135m-instruct.q4_1")  # any case
        assert events[-1]["type"] == "done", events[-1]
        assert by_path.requests[-1]["model"] == SMOL  # the server is asked by its own id
        cid = events[-1]["conversation"]
        set_ = await wire.request({"type": "settings", "conversation": cid, "model": "Qwen2.5-1.5B.gguf"})
        assert set_["type"] == "settings", set_
        await wire.ask("again", conversation=cid)
        assert by_path.requests[-1]["model"] == "/other/Qwen2.5-1.5B.gguf"
        assert (set_["model"], set_["model_name"]) == ("Qwen2.5-1.5B.gguf", "Qwen2.5-1.5B")  # as named
        listed = await wire.request({"type": "conversations"})
        item = next(c for c in listed["items"] if c["conversation"] == cid)
        assert (item["model"], item["model_name"]) == ("Qwen2.5-1.5B.gguf", "Qwen2.5-1.5B"), item
        opened = await wire.request({"type": "open", "conversation": cid})
        assert opened["model_name"] == "Qwen2.5-1.5B", opened
        fresh = await wire.ask("no model of its own")
        listed = await wire.request({"type": "conversations"})
        item = next(c for c in listed["items"] if c["conversation"] == fresh[-1]["conversation"])
        assert item["model"] is None and item["model_name"] is None  # the daemon's default, as it changes
    finally:
        await wire.close()
    code, out, err = await cli("ask", "-m", "SmolLM2-135M-Instruct.Q4_1", "from the command line")
    assert code == 0 and by_path.requests[-1]["model"] == SMOL, err
    code, out, _ = await cli("status")
    assert "model SmolLM2-135M-Instruct.Q4_1\n" in out, out
    code, out, err = await cli("models")
    assert code == 0 and out.splitlines()[0].split()[:2] == ["*", "SmolLM2-135M-Instruct.Q4_1"], out
    assert SMOL in out.splitlines()[0]  # the id the server knows it by, beside


@pytest.mark.asyncio
async def test_a_short_name_two_models_share_names_neither(daemon: RunningDaemon, router: FakeRouter) -> None:
    router.models = [FakeModel("/a/tiny.gguf"), FakeModel("/b/tiny.gguf")]
    wire = await daemon.connect()
    try:
        events = await wire.ask("hello", model="tiny")
        assert events[-1]["type"] == "error" and events[-1]["code"] == "not_found", events[-1]
        assert "/a/tiny.gguf" in events[-1]["message"]  # the message lists the ids to pick from
        events = await wire.ask("hello", model="/b/tiny.gguf")
        assert events[-1]["type"] == "done" and router.requests[-1]["model"] == "/b/tiny.gguf"
    finally:
        await wire.close()
