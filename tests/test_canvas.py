"""What a canvas shows, through the socket: `done`'s model and title, file chips with their
file (path, size, hash) and an image's thumbnail, pages of `open`, `search` with `offset`,
the `config` request; and where the daemon and its documents disagreed (issue 30)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from client import Wire, of_type
from core import Config
from selfcheck.fakerouter import FakeRouter, Reply
from selfcheck.samples import make_png
from tests.conftest import serving

pytestmark = pytest.mark.asyncio


def stages(events: list[dict[str, Any]]) -> list[str]:
    return [e["stage"] for e in of_type(events, "progress")]


# -- done ------------------------------------------------------------------------------------


async def test_done_names_the_model_and_the_conversations_title(wire: Wire) -> None:
    first = (await wire.ask("hello there, how are you"))[-1]
    assert first["type"] == "done" and first["model"] == "fake-text"
    assert first["title"] == "hello there, how are you"  # the question's first words, until another
    assert first["saved"] is True and "note" not in first
    cid = first["conversation"]
    await wire.request({"type": "settings", "conversation": cid, "title": "Greetings"})
    second = (await wire.ask("and you?", conversation=cid, model="fake-vision"))[-1]
    assert (second["title"], second["model"]) == ("Greetings", "fake-vision")


# -- chips -----------------------------------------------------------------------------------


async def test_chips_carry_their_files_path_size_and_hash(wire: Wire, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("the meeting is on Tuesday\n")
    events = await wire.ask("when?", files=[str(notes)])
    [chip] = of_type(events, "user")[0]["files"]
    assert chip["path"] == str(notes) and chip["size"] == notes.stat().st_size
    assert chip["sha256"] == hashlib.sha256(notes.read_bytes()).hexdigest()
    assert "thumbnail" not in chip  # images only
    opened = await wire.request({"type": "open", "conversation": events[-1]["conversation"]})
    assert opened["turns"][0]["files"] == [chip]


async def test_an_image_chip_has_a_thumbnail_made_once_per_file(wire: Wire, config: Config, tmp_path: Path) -> None:
    photo = make_png(tmp_path / "photo.png", (1000, 600))
    events = await wire.ask("what is this?", files=[str(photo)], model="fake-vision")
    [chip] = of_type(events, "user")[0]["files"]
    thumbnail = Path(chip["thumbnail"])
    assert thumbnail.parent == config.data_dir / "thumbnails"
    with Image.open(thumbnail) as shown:
        assert shown.format == "PNG" and shown.size == (256, 154)  # the longest side 256, in proportion
    made = thumbnail.stat().st_mtime_ns
    os.utime(thumbnail, ns=(made - 10**9, made - 10**9))  # a second older: a new write would show
    # the same file attached again (under another name): the thumbnail is reused, not made again
    copy = tmp_path / "again.png"
    copy.write_bytes(photo.read_bytes())
    events = await wire.ask("and this?", files=[str(copy)], model="fake-vision")
    [again] = of_type(events, "user")[0]["files"]
    assert again["thumbnail"] == str(thumbnail) and again["sha256"] == chip["sha256"]
    assert thumbnail.stat().st_mtime_ns == made - 10**9
    assert sorted(p.name for p in thumbnail.parent.iterdir()) == [thumbnail.name]


async def test_a_fifo_is_refused_and_makes_no_thumbnail(wire: Wire, config: Config, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    events = await wire.ask("look", files=[str(fifo)], model="fake-vision")
    assert events[-1]["code"] == "file_refused" and not of_type(events, "user")
    assert not any((config.data_dir / "thumbnails").iterdir())


# -- open in pages, search with offset -------------------------------------------------------


async def conversation_of(wire: Wire, turns: int) -> int:
    cid = (await wire.ask("question 1"))[-1]["conversation"]
    for n in range(2, turns + 1):
        await wire.ask(f"question {n}", conversation=cid)
    return cid


async def test_open_returns_a_page_of_turns_with_the_total(wire: Wire) -> None:
    cid = await conversation_of(wire, 5)

    async def page(**fields: Any) -> tuple[list[int], int]:
        opened = await wire.request({"type": "open", "conversation": cid, **fields})
        assert opened["type"] == "conversation", opened
        return [t["turn"] for t in opened["turns"]], opened["total"]

    assert await page() == ([1, 2, 3, 4, 5], 5)
    assert await page(from_turn=2, limit=2) == ([2, 3], 5)
    assert await page(from_turn=4) == ([4, 5], 5)
    assert await page(limit=2) == ([4, 5], 5)  # limit alone: the newest page
    assert await page(limit=50) == ([1, 2, 3, 4, 5], 5)
    assert await page(from_turn=9) == ([], 5)
    assert await page(turn=3) == ([3], 5)
    refused = await wire.request({"type": "open", "conversation": cid, "turn": 3, "limit": 2})
    assert refused["code"] == "bad_request" and "'from_turn'" in refused["message"]


async def test_search_pages_on_with_offset(wire: Wire) -> None:
    cid = await conversation_of(wire, 6)  # the fake router echoes each question: 12 hits for "question"
    whole = await wire.request({"type": "search", "query": "question", "limit": 6})

    def hits(answer: dict[str, Any]) -> list[tuple[int, str]]:
        return [(h["turn"], h["role"]) for g in answer["conversations"] for h in g["hits"]]

    first = await wire.request({"type": "search", "query": "question", "limit": 3})
    second = await wire.request({"type": "search", "query": "question", "limit": 3, "offset": first["total"]})
    assert (first["offset"], second["offset"]) == (0, 3) and first["more"] and second["more"]
    assert set(hits(first)) | set(hits(second)) == set(hits(whole)) and not set(hits(first)) & set(hits(second))
    last = await wire.request({"type": "search", "query": "question", "conversation": cid, "offset": 11})
    assert last["total"] == 1 and last["more"] is False
    refused = await wire.request({"type": "search", "query": "question", "offset": -1})
    assert refused["code"] == "bad_request" and "'offset'" in refused["message"]


# -- config ------------------------------------------------------------------------------------


@pytest.fixture
def secret_config(config: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    """conftest's config with secrets to keep: an api_key, an MCP server with a token."""
    monkeypatch.setenv("ASSISTANT_API_KEY", "sk-very-secret")
    folder = tmp_path / "config" / "assistant"
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(
        '[mcp.servers.web]\nurl = "http://127.0.0.1:9/mcp"\nheaders = { Authorization = "Bearer tok-secret" }\n'
    )
    from core import load_config

    return load_config()


async def test_config_shows_the_settings_in_effect_with_secrets_masked(secret_config: Config) -> None:
    config = secret_config
    async with serving(config) as (_daemon, wire):
        await wire.request({"type": "models"})  # the router's first model is known: the default in effect
        shown = await wire.request({"type": "config"})
    assert shown["type"] == "config"
    assert shown["api_key"] == "********" and shown["router_url"] == config.router_url
    assert (shown["model"], shown["default_model"]) == (None, "fake-text")
    assert shown["system_prompt"] == config.system_prompt
    assert (shown["ctx_max"], shown["assumed_ctx"], shown["compact_at"]) == (None, 4096, 0.75)
    assert shown["mcp"]["servers"] == [{"name": "web", "transport": "http", "approval": "ask"}]
    assert shown["config_path"] == str(config.config_path) and shown["data_dir"] == str(config.data_dir)
    line = json.dumps(shown)
    assert "sk-very-secret" not in line and "tok-secret" not in line


async def test_config_shows_sampling_as_the_configuration_table_has_it(
    config: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """temperature and top_p, top level and per model (issue 46 item 6)."""
    folder = tmp_path / "config" / "assistant"
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(
        'temperature = 0.2\n[models."fake-text"]\ntop_p = 0.9\n[models."big"]\nimage_tokens = 1000\n'
    )
    from core import load_config

    async with serving(load_config()) as (_daemon, wire):
        shown = await wire.request({"type": "config"})
    assert (shown["temperature"], shown["top_p"]) == (0.2, None)
    assert shown["models"] == {
        "big": {"image_tokens": 1000, "temperature": None, "top_p": None},
        "fake-text": {"image_tokens": None, "temperature": None, "top_p": 0.9},
    }
    assert (shown["watch_journal"], shown["watch_journal_minutes"]) == (10_000, 10.0)


async def test_a_password_in_the_router_url_is_masked(config: Config, router: FakeRouter) -> None:
    import dataclasses

    url = router.url.replace("http://", "http://me:hunter2@")
    async with serving(dataclasses.replace(config, router_url=url)) as (_daemon, wire):
        shown = await wire.request({"type": "config"})
    assert shown["router_url"] == url.replace("hunter2", "********")
    assert shown["embedding_url"] == shown["router_url"]


# -- where the daemon and its documents disagreed (issue 30) ----------------------------------


@pytest.mark.parametrize("new", [True, False])
async def test_a_question_too_big_for_the_context_is_shown_before_its_error(wire: Wire, new: bool) -> None:
    """(1) context_overflow: the question is stored, so `user` comes first, new conversation or not."""
    fields = {} if new else {"conversation": (await wire.ask("hello"))[-1]["conversation"]}
    events = await wire.ask("please read: " + "blah " * 6_000, **fields)
    assert [e["type"] for e in events] == ["user", "error"]
    assert events[-1]["code"] == "context_overflow" and events[-1]["turn"] == events[0]["turn"]
    assert events[-1]["conversation"] == events[0]["conversation"] is not None  # a new one's id too (issue 46)
    opened = await wire.request({"type": "open", "conversation": events[0]["conversation"]})
    assert opened["turns"][-1]["status"] == "error" and opened["turns"][-1]["text"].startswith("please read")


async def test_a_prompt_the_server_refuses_as_too_long_starts_its_steps_again(
    wire: Wire, router: FakeRouter
) -> None:
    """(3) the stages of a retried request come in their documented order, from `compacting` on."""
    cid = (await wire.ask("one " * 50))[-1]["conversation"]
    for n in range(3):
        await wire.ask(f"more {n} " + "text " * 50, conversation=cid)
    router.script(Reply(status=400, error="request (2000 tokens) exceeds the available context size (1500 tokens)",
                        error_type="exceed_context_size_error"))
    router.script_complete(Reply(text="Summary of the start."))
    events = await wire.ask("next", conversation=cid)
    assert events[-1]["type"] == "done", events[-1]
    assert stages(events) == ["waiting", "compacting", "waiting"]  # the retry leaves, and says so


async def test_a_refused_prompt_that_cannot_fit_ends_after_waiting(wire: Wire, router: FakeRouter) -> None:
    """(3) a size learned from the server's refusal may leave the question too big: the error then
    follows the first request's `waiting`, as the document says."""
    router.script(Reply(status=400, error="request (3000 tokens) exceeds the available context size (200 tokens)",
                        error_type="exceed_context_size_error"))
    events = await wire.ask("a question " * 200)
    assert [e["type"] for e in events] == ["user", "progress", "error"]
    assert stages(events) == ["waiting"] and events[-1]["code"] == "context_overflow"
