"""Sampling settings through the socket: ``temperature`` and ``top_p`` from the configuration's
top-level keys, a model's ``[models."ID"]`` table and the conversation's ``settings``, in that
order of strength, sent with every request of a turn (the fake router records them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from client import Wire
from core import ConfigError, load_config
from selfcheck.fakerouter import FakeRouter, Reply
from tests.conftest import serving

def write_config(tmp_path: Path, text: str) -> None:
    path = tmp_path / "config" / "assistant" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def sampling(request: dict[str, Any]) -> dict[str, Any]:
    return {key: request[key] for key in ("temperature", "top_p") if key in request}


async def settings(wire: Wire, cid: int, **fields: Any) -> dict[str, Any]:
    return await wire.request({"type": "settings", "conversation": cid, **fields})


@pytest.mark.asyncio
async def test_none_is_sent_unless_set(wire: Wire, router: FakeRouter) -> None:
    await wire.ask("hello")
    assert sampling(router.requests[-1]) == {}  # the server's own default applies


@pytest.mark.asyncio
async def test_a_models_table_then_the_conversations_setting(
    router: FakeRouter, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    write_config(tmp_path, '[models."fake-text"]\ntemperature = 0.1\ntop_p = 0.9\n')
    monkeypatch.setenv("ASSISTANT_ROUTER_URL", router.url)
    monkeypatch.setenv("ASSISTANT_AUTO_TITLE", "false")
    monkeypatch.setenv("ASSISTANT_TEMPERATURE", "0.7")  # every other model
    async with serving(load_config()) as (_daemon, wire):
        cid = (await wire.ask("hello", model="fake-text"))[0]["conversation"]
        assert sampling(router.requests[-1]) == {"temperature": 0.1, "top_p": 0.9}
        answer = await settings(wire, cid, temperature=0)
        assert answer["type"] == "settings" and answer["settings"]["temperature"] == 0
        router.script(Reply(tool_calls=[{"id": "c1", "name": "conversation_search",
                                         "arguments": json.dumps({"query": "hello"})}]))
        await wire.ask("what did I say?", conversation=cid)
        # every round of the turn carries it: the one with the call and the one after it
        assert [sampling(r) for r in router.requests[-2:]] == [{"temperature": 0.0, "top_p": 0.9}] * 2
        await settings(wire, cid, temperature=None)  # back to the model's
        await wire.ask("again", conversation=cid)
        assert sampling(router.requests[-1]) == {"temperature": 0.1, "top_p": 0.9}
        opened = await wire.request({"type": "open", "conversation": cid})
        assert "temperature" not in opened["settings"]
        await wire.ask("another model", model="fake-vision")
        assert sampling(router.requests[-1]) == {"temperature": 0.7}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("fields", "words"),
    [({"temperature": 3}, "temperature"), ({"temperature": "low"}, "temperature"),
     ({"top_p": 0}, "top_p"), ({"top_p": True}, "top_p")],
)
async def test_a_setting_out_of_range_is_refused(wire: Wire, fields: dict[str, Any], words: str) -> None:
    cid = (await wire.ask("hello"))[0]["conversation"]
    answer = await settings(wire, cid, **fields)
    assert answer["type"] == "error" and answer["code"] == "bad_request", answer
    assert words in answer["message"]
    opened = await wire.request({"type": "open", "conversation": cid})
    assert opened["settings"] == {}


@pytest.mark.parametrize(
    ("text", "words"),
    [('[models."m"]\ntemperature = 2.5\n', "temperature must be from 0 to 2"),
     ('[models."m"]\ntop_p = 0\n', "top_p must be above 0"),
     ('temperature = "cold"\n', "temperature must be a float"),
     ("top_p = 1.5\n", "top_p must be above 0 and at most 1")],
)
def test_a_bad_value_in_the_configuration_is_named(tmp_path: Path, text: str, words: str) -> None:
    write_config(tmp_path, text)
    with pytest.raises(ConfigError, match=words):
        load_config()
