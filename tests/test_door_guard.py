"""The OpenAI door under a hostile or broken client (issue 44): a long history is bounded and
read off the loop, a refused question leaves nothing behind (no imported conversation, no
file), a long file name is stored shortened, tool results must answer the calls made, and
the system prompt is part of the thread a request continues.

Driven as tests/test_openai.py drives the door: the ``openai`` SDK against the real daemon and
the fake router, what happened checked on the socket.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio

from client import Wire
from core import Config, load_config
from daemon.openai import door as door_module
from selfcheck.fakerouter import FakeRouter, Reply
from selfcheck.samples import make_png
from tests.conftest import RunningDaemon, serving

pytestmark = pytest.mark.asyncio

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture
def config(config: Config) -> Config:
    return dataclasses.replace(config, openai_listen="127.0.0.1:0")


@contextlib.asynccontextmanager
async def door_client(daemon: RunningDaemon) -> AsyncIterator[openai.AsyncOpenAI]:
    """The ``openai`` SDK pointed at the daemon's door, with its key."""
    assert daemon.server is not None and daemon.server.door is not None
    host, port = daemon.server.door.address or ("", 0)
    key = (daemon.config.data_dir / "openai_key").read_text().strip()
    sdk = openai.AsyncOpenAI(base_url=f"http://{host}:{port}/v1", api_key=key, max_retries=0)
    try:
        yield sdk
    finally:
        await sdk.close()


@pytest_asyncio.fixture
async def client(daemon: RunningDaemon) -> AsyncIterator[openai.AsyncOpenAI]:
    async with door_client(daemon) as sdk:
        yield sdk


def history(turns: int) -> list[dict[str, Any]]:
    """``turns`` short exchanges, then a question: ``2 * turns + 1`` messages."""
    messages: list[dict[str, Any]] = []
    for n in range(turns):
        messages += [{"role": "user", "content": f"q{n}"}, {"role": "assistant", "content": f"a{n}"}]
    return [*messages, {"role": "user", "content": "And now?"}]


def tiny_image(n: int) -> dict[str, Any]:
    data = base64.b64encode(f"not really a png {n}".encode()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


async def conversations(wire: Wire) -> list[dict[str, Any]]:
    return list((await wire.request({"type": "conversations"}))["items"])


def uploads(daemon: RunningDaemon) -> list[Path]:
    folder = daemon.config.data_dir / "uploads"
    return sorted(p for p in folder.rglob("*")) if folder.exists() else []


async def test_a_long_history_is_read_off_the_loop_and_bounded(
    daemon: RunningDaemon, client: openai.AsyncOpenAI, router: FakeRouter, wire: Wire,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bound = daemon.config.openai_max_messages
    assert bound == 4000  # the default the docs name
    # the request is held inside its reading until the socket has answered a status: on the
    # event loop, that reading would hold the status too (and give up waiting)
    entered, release, waited = threading.Event(), threading.Event(), []
    real = door_module.read_chat

    def held(body: Any) -> Any:
        entered.set()
        waited.append(release.wait(timeout=10))
        return real(body)

    monkeypatch.setattr(door_module, "read_chat", held)
    router.script(Reply(text="Here."))
    just_under = history((bound - 1) // 2)
    assert len(just_under) == bound - 1
    asked = asyncio.create_task(client.chat.completions.create(model="fake-text", messages=just_under))
    assert await asyncio.to_thread(entered.wait, 10)
    status = await wire.request({"type": "status"})
    release.set()
    answer = await asked
    assert status["type"] == "status" and waited == [True]
    assert answer.choices[0].message.content == "Here."
    [conv] = await conversations(wire)
    assert conv["turns"] == len(just_under) // 2 + 1  # the imported turns and the question

    # one over the bound: refused, naming the bound, before anything is matched or stored
    monkeypatch.setattr(door_module, "read_chat", real)
    asked_before = len(router.requests)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="fake-text", messages=history(bound // 2))
    assert refused.value.code == "too_many_messages"
    assert f"at most {bound} messages" in refused.value.message and "openai_max_messages" in refused.value.message
    assert len(await conversations(wire)) == 1
    assert len(router.requests) == asked_before


async def test_the_bound_is_a_setting(config: Config, router: FakeRouter, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASSISTANT_OPENAI_MAX_MESSAGES", "5")
    async with serving(dataclasses.replace(load_config(), openai_listen="127.0.0.1:0")) as (daemon, _wire):
        assert daemon.config.openai_max_messages == 5
        async with door_client(daemon) as client:
            router.script(Reply(text="Fine."))
            answer = await client.chat.completions.create(model="fake-text", messages=history(2))  # 5 messages
            assert answer.choices[0].message.content == "Fine."
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model="fake-text", messages=history(3))  # 7
    assert "at most 5 messages" in refused.value.message and "this one has 7" in refused.value.message


async def test_too_many_files_are_counted_before_any_is_written(
    daemon: RunningDaemon, client: openai.AsyncOpenAI, router: FakeRouter, wire: Wire
) -> None:
    for count in (9, 1000):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="fake-vision", messages=[{"role": "user", "content": [
                {"type": "text", "text": "What are these?"}, *(tiny_image(n) for n in range(count))]}])
        assert refused.value.code == "too_many_files" and f"you sent {count}" in refused.value.message
        assert uploads(daemon) == []
    assert router.requests == [] and await conversations(wire) == []


async def test_a_refused_question_stores_nothing(
    daemon: RunningDaemon, client: openai.AsyncOpenAI, router: FakeRouter, wire: Wire, tmp_path: Path
) -> None:
    watcher = await daemon.connect()
    try:
        await refused_and_told(watcher, client, router, wire, daemon, tmp_path)
    finally:
        await watcher.close()


async def refused_and_told(watcher: Wire, client: openai.AsyncOpenAI, router: FakeRouter, wire: Wire,
                           daemon: RunningDaemon, tmp_path: Path) -> None:
    rid = await watcher.send({"type": "watch"})
    await watcher.until(rid, ("watching",))
    earlier = history(2)[:-1]
    with pytest.raises(openai.BadRequestError) as refused:  # 9 files
        await client.chat.completions.create(model="fake-vision", messages=[*earlier, {"role": "user", "content": [
            {"type": "text", "text": "What are these?"}, *(tiny_image(n) for n in range(9))]}])
    assert refused.value.code == "too_many_files"
    assert await conversations(wire) == []

    # an image for a text-only model: refused by the turn, after the earlier messages were
    # matched: the conversation made for them goes again, and the image written for it
    png = base64.b64encode(make_png(tmp_path / "dot.png").read_bytes()).decode()
    with pytest.raises(openai.BadRequestError) as blind:
        await client.chat.completions.create(model="fake-text", messages=[*earlier, {"role": "user", "content": [
            {"type": "text", "text": "And this?"}, {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}]}])
    assert blind.value.code == "no_vision"
    assert await conversations(wire) == []
    assert uploads(daemon) == []
    assert (await wire.request({"type": "search", "query": "q1"}))["conversations"] == []
    assert router.requests == []

    # the same history then asked properly is a conversation of its own, as the first would have been
    router.script(Reply(text="Words only."))
    answer = await client.chat.completions.create(model="fake-text", messages=[*earlier, {"role": "user", "content": "Now?"}])
    assert answer.choices[0].message.content == "Words only."
    [conv] = await conversations(wire)
    assert conv["turns"] == 3
    changes = []
    async for event in watcher.stream(rid):
        if event["type"] == "changed":
            changes.append((event["kind"], event["action"]))
        if event.get("action") == "ended":
            break
    # a watcher was told of the conversation made for the refused question, and of its going
    assert changes[:2] == [("conversation", "created"), ("conversation", "deleted")]


async def test_a_long_file_name_is_stored_shortened(
    daemon: RunningDaemon, client: openai.AsyncOpenAI, router: FakeRouter, wire: Wire
) -> None:
    text = base64.b64encode(b"The launch code is 4711.").decode()
    names = ["a" * 1000 + "-one.txt", "a" * 1000 + "-two.txt", "é" * 1000 + ".md"]
    router.script(Reply(text="Read them."))
    answer = await client.chat.completions.create(model="fake-text", messages=[{"role": "user", "content": [
        {"type": "text", "text": "Read these."},
        *({"type": "file", "file": {"filename": name, "file_data": f"data:text/plain;base64,{text}"}} for name in names),
    ]}])
    assert answer.choices[0].message.content == "Read them."
    opened = await wire.request({"type": "open", "conversation": 1})
    shown = [f["name"] for f in opened["turns"][0]["files"]]
    assert len(set(shown)) == 3  # still told apart
    assert [name.rsplit(".", 1)[1] for name in shown] == ["txt", "txt", "md"]
    assert shown[0].startswith("aaaa") and all(len(name.encode()) <= 120 for name in shown)
    assert "4711" in str(router.requests[-1]["messages"][-1]["content"])


async def test_tool_results_must_answer_the_calls_made(
    daemon: RunningDaemon, client: openai.AsyncOpenAI, router: FakeRouter, wire: Wire
) -> None:
    router.script(Reply(tool_calls=[{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}]))
    question = [{"role": "user", "content": "Weather in Paris?"}]
    answer = await client.chat.completions.create(model="fake-text", messages=question, tools=[WEATHER])
    [call] = answer.choices[0].message.tool_calls or []
    assert call.id == "call_1"
    asked = len(router.requests)
    called = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}

    # a result for a call never made, none for the one that was
    with pytest.raises(openai.BadRequestError) as wrong:
        await client.chat.completions.create(model="fake-text", tools=[WEATHER], messages=[
            *question, called, {"role": "tool", "tool_call_id": "nope", "content": "sunny"}])
    assert "call_1" in wrong.value.message and "nope" in wrong.value.message

    # the same, with the assistant message made to match: the calls stored are what count
    forged = {"role": "assistant", "content": None, "tool_calls": [{**call.model_dump(), "id": "nope"}]}
    with pytest.raises(openai.BadRequestError) as wrong:
        await client.chat.completions.create(model="fake-text", tools=[WEATHER], messages=[
            *question, forged, {"role": "tool", "tool_call_id": "nope", "content": "sunny"}])
    assert "call_1" in wrong.value.message and "nope" in wrong.value.message
    assert len(router.requests) == asked

    # the right one still takes the turn up
    router.script(Reply(text="Sunny."))
    answer = await client.chat.completions.create(model="fake-text", tools=[WEATHER], messages=[
        *question, called, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert answer.choices[0].message.content == "Sunny."
    assert router.requests[-1]["messages"][-1]["tool_call_id"] == "call_1"


async def test_the_system_prompt_is_part_of_the_thread(
    daemon: RunningDaemon, client: openai.AsyncOpenAI, router: FakeRouter, wire: Wire
) -> None:
    router.script(Reply(text="Hello."))
    first = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    await client.chat.completions.create(model="fake-text", messages=first)
    said = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Next?"}]

    # another client, the same messages under other instructions: a conversation of its own
    router.script(Reply(text="Ahoy."))
    answer = await client.chat.completions.create(
        model="fake-text", messages=[{"role": "system", "content": "Talk like a pirate."}, *said])
    assert answer.id == "chatcmpl-2-2"
    assert (await wire.request({"type": "open", "conversation": 1}))["system"] == "Be terse."
    assert (await wire.request({"type": "open", "conversation": 2}))["system"] == "Talk like a pirate."

    # the first client goes on with its own
    router.script(Reply(text="Done."))
    answer = await client.chat.completions.create(
        model="fake-text", messages=[{"role": "system", "content": "Be terse."}, *said])
    assert answer.id == "chatcmpl-1-2"
    assert len(await conversations(wire)) == 2
