"""A conversation's own system prompt, through the real socket: set on the ask that starts
it or with ``settings``, stored with the conversation, and the same bytes on every turn."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client import Wire
from core import Config
from core.tools import TOOL_GUIDANCE
from selfcheck.fakerouter import FakeModel, FakeRouter, default_models

pytestmark = pytest.mark.asyncio

PIRATE = "You answer as a pirate would."


@pytest.fixture
def router() -> Iterator[FakeRouter]:
    # "bare" model entries: what a model can do comes from /props (chat_template_caps.supports_tools)
    with FakeRouter(models=[*default_models(), FakeModel("fake-plain", tools=False)], models_format="bare") as fake:
        yield fake


def system(text: str) -> dict[str, Any]:
    """The system message of a conversation offered tools: its prompt, then the tool guidance."""
    return {"role": "system", "content": f"{text}\n\n{TOOL_GUIDANCE}"}


def system_of(request: dict[str, Any]) -> dict[str, Any] | None:
    first = request["messages"][0]
    return first if first["role"] == "system" else None


async def test_a_new_conversation_keeps_its_system_prompt_byte_for_byte(wire: Wire, router: FakeRouter) -> None:
    events = await wire.ask("hello", system=PIRATE)
    assert events[-1]["type"] == "done"
    await wire.ask("and again", conversation=1)
    await wire.ask("once more", conversation=1)
    first, second, third = (system_of(r) for r in router.requests[-3:])
    assert first == system(PIRATE)
    assert first == second == third  # the prompt cache's prefix starts here
    opened = await wire.request({"type": "open", "conversation": 1})
    assert opened["system"] == PIRATE
    other = await wire.ask("a conversation of the default kind")
    assert system_of(router.requests[-1]) == system(Config.system_prompt)
    assert (await wire.request({"type": "open", "conversation": other[-1]["conversation"]}))["system"] is None


async def test_system_on_an_existing_conversation_is_refused_and_points_to_settings(
    wire: Wire, router: FakeRouter
) -> None:
    await wire.ask("hello")
    asked = len(router.requests)
    events = await wire.ask("again", conversation=1, system=PIRATE)
    error = events[-1]
    assert error["type"] == "error" and error["code"] == "bad_request"
    assert "settings" in error["message"] and error["conversation"] == 1 and error["turn"] == 2
    assert len(router.requests) == asked  # nothing sent, nothing stored
    assert len((await wire.request({"type": "open", "conversation": 1}))["turns"]) == 1


async def test_settings_change_the_system_prompt_and_null_restores_the_default(
    wire: Wire, router: FakeRouter
) -> None:
    await wire.ask("hello")
    changed = await wire.request({"type": "settings", "conversation": 1, "system": PIRATE})
    assert changed["type"] == "settings" and changed["system"] == PIRATE
    await wire.ask("ahoy?", conversation=1)
    assert system_of(router.requests[-1]) == system(PIRATE)
    await wire.request({"type": "settings", "conversation": 1, "system": ""})
    await wire.ask("plain?", conversation=1)
    assert system_of(router.requests[-1]) is None  # '': no system message at all
    restored = await wire.request({"type": "settings", "conversation": 1, "system": None})
    assert restored["system"] is None
    await wire.ask("default?", conversation=1)
    assert system_of(router.requests[-1]) == system(Config.system_prompt)
    renamed = await wire.request({"type": "settings", "conversation": 1, "title": "Ahoy"})
    assert renamed["system"] is None  # a setting left out stays as it is


async def test_a_system_prompt_of_the_wrong_type_is_a_bad_request(wire: Wire) -> None:
    events = await wire.ask("hello", system=42)
    assert events[-1]["code"] == "bad_request" and "'system'" in events[-1]["message"]


async def test_the_tool_guidance_is_there_only_with_tools_and_never_changes(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    cid = (await wire.ask("hello"))[-1]["conversation"]
    notes = tmp_path / "notes.txt"
    notes.write_text("the code is WR-58213")
    await wire.ask("keep this", conversation=cid, files=[str(notes)])  # attachment_recall offered from here
    await wire.ask("thanks", conversation=cid)
    first, second, third = (r["messages"][0] for r in router.requests[-3:])
    assert first == second == third == system(Config.system_prompt)  # the same bytes whatever is offered
    assert [len(r["tools"]) for r in router.requests[-3:]] == [2, 3, 3]  # + memory_save
    await wire.ask("hello", model="fake-plain")  # a chat template without tools: none, and no guidance
    assert "tools" not in router.requests[-1]
    assert system_of(router.requests[-1]) == {"role": "system", "content": Config.system_prompt}
