"""The OpenAI door (issue 31): real OpenAI clients against the real daemon and the fake router.

The ``openai`` SDK (streamed and not), simonw's ``llm`` with an OpenAI-compatible model
pointing at the door, and a curl-style reader of the SSE stream line by line on a plain
socket. What they ask is checked on the socket too: the conversations, their turns,
search and watchers.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio

from client import Wire, of_type
from core import Config
from history import IMPORTED
from selfcheck.fakerouter import FakeModel, FakeRouter, Reply
from selfcheck.samples import make_pdf, make_png
from tests.conftest import RunningDaemon

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def config(config: Config) -> Config:
    return dataclasses.replace(config, openai_listen="127.0.0.1:0")


@pytest_asyncio.fixture
async def door(daemon: RunningDaemon) -> AsyncIterator[tuple[str, str]]:
    """The door's base URL and key."""
    assert daemon.server is not None and daemon.server.door is not None
    host, port = daemon.server.door.address or ("", 0)
    key = (daemon.config.data_dir / "openai_key").read_text().strip()
    yield f"http://{host}:{port}/v1", key


def sdk(door: tuple[str, str], key: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=door[0], api_key=key or door[1], max_retries=0)


async def raw_http(door: tuple[str, str], head: str, body: bytes = b"") -> tuple[str, list[str]]:
    """A request on a plain socket, read as curl -N shows it: the head, then the body's lines."""
    host, port = door[0].removeprefix("http://").removesuffix("/v1").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head.encode() + body)
    answer = (await reader.read()).decode()
    writer.close()
    status_and_headers, _, rest = answer.partition("\r\n\r\n")
    if "Transfer-Encoding: chunked" in status_and_headers:  # a stream's body, joined as curl joins it
        rest = _unchunked(rest)
    return status_and_headers, rest.split("\n")


def _unchunked(body: str) -> str:
    """A chunked body's data (a stream cut short: what came of it)."""
    data = []
    while body:
        size_line, _, body = body.partition("\r\n")
        size = int(size_line.split(";")[0] or "0", 16)
        if not size:
            break
        data.append(body[:size])
        body = body[size + 2:]
    return "".join(data)


async def _changes(wire: Wire, rid: Any, until: str) -> AsyncIterator[dict[str, Any]]:
    """A watch's changes up to the first whose action is ``until``."""
    async for event in wire.stream(rid):
        yield event
        if event.get("action") == until:
            return


def post(door: tuple[str, str], body: dict[str, Any], key: str | None = None) -> tuple[str, bytes]:
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key or door[1]}\r\n" if key != "" else ""
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"), data


async def test_the_sdk_streams_continues_and_branches(
    daemon: RunningDaemon, door: tuple[str, str], router: FakeRouter, wire: Wire
) -> None:
    client = sdk(door)
    assert [m.id for m in (await client.models.list()).data] == ["fake-text", "fake-vision"]
    watcher = await daemon.connect()
    rid = await watcher.send({"type": "watch"})
    await watcher.until(rid, ("watching",))

    router.script(Reply(text="Paris is the capital.", usage={"prompt_tokens": 12, "completion_tokens": 5}))
    stream = await client.chat.completions.create(
        model="fake-text", stream=True, stream_options={"include_usage": True}, temperature=0.2, top_p=0.9,
        max_tokens=50, stop=["\n\n"], seed=7,
        messages=[{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "Capital of France?"}],
    )
    chunks = [chunk async for chunk in stream]
    first = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert first == "Paris is the capital."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 17
    assert chunks[0].id == "chatcmpl-1-1"
    sent = router.requests[-1]
    assert (sent["temperature"], sent["top_p"], sent["stop"], sent["seed"]) == (0.2, 0.9, ["\n\n"], 7)
    assert sent["max_tokens"] == 50 and sent["messages"][0]["content"].startswith("Answer in one line.")

    # a stateless client sends it all again: the same conversation goes on, not streamed this time
    router.script(Reply(text="About two million."))
    history = [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "Capital of France?"},
               {"role": "assistant", "content": first}]
    answer = await client.chat.completions.create(
        model="fake-text", messages=[*history, {"role": "user", "content": "How many live there?"}])
    assert answer.id == "chatcmpl-1-2" and answer.choices[0].message.content == "About two million."
    assert answer.choices[0].finish_reason == "stop"
    assert [m["content"] for m in router.requests[-1]["messages"]][-3:] == [
        "Capital of France?", first, "How many live there?"]

    # an edited earlier reply is a branch: a new conversation holding the client's turns, the old one untouched
    router.script(Reply(text="Lyon is not."))
    edited = [*history[:2], {"role": "assistant", "content": "Lyon."}, {"role": "user", "content": "Sure?"}]
    answer = await client.chat.completions.create(model="fake-text", messages=edited)
    assert answer.id == "chatcmpl-2-2"
    branch = await wire.request({"type": "open", "conversation": 2})
    assert [(t["text"], t["reply"], t["finish_reason"]) for t in branch["turns"]] == [
        ("Capital of France?", "Lyon.", IMPORTED), ("Sure?", "Lyon is not.", "stop")]
    assert branch["system"] == "Answer in one line."
    original = await wire.request({"type": "open", "conversation": 1})
    assert [t["reply"] for t in original["turns"]] == [first, "About two million."]

    # everything is visible on the socket: listed, searchable, told to watchers as it happened
    listed = await wire.request({"type": "conversations"})
    assert sorted(c["conversation"] for c in listed["items"]) == [1, 2]
    found = await wire.request({"type": "search", "query": "two million"})
    assert [group["conversation"] for group in found["conversations"]] == [1]
    changes = [await watcher.read() for _ in range(8)]  # 2 conversations made, 3 turns started and ended
    assert [(c["kind"], c["action"], c["conversation"]) for c in changes if c["kind"] == "conversation"] == [
        ("conversation", "created", 1), ("conversation", "created", 2)]
    assert sum(1 for c in changes if c["action"] == "ended") == 3
    await watcher.close()

    # refusals, in OpenAI's error shape and status; nothing stored for them
    with pytest.raises(openai.AuthenticationError) as denied:
        await sdk(door, key="wrong").chat.completions.create(model="fake-text", messages=[{"role": "user", "content": "x"}])
    assert denied.value.status_code == 401 and denied.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as unknown:
        await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert unknown.value.code == "model_not_found" and "fake-text" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model="fake-text", messages=[{"role": "assistant", "content": "x"}])
    assert "user" in bad.value.message
    router.script(Reply(status=500, error="the model crashed"))
    with pytest.raises(openai.APIStatusError) as failed:
        await client.chat.completions.create(model="fake-text", messages=[{"role": "user", "content": "Fail?"}])
    assert failed.value.status_code == 502 and failed.value.code == "router_error"
    # a changed system message is part of the thread: a branch under it, the first untouched
    router.script(Reply(text="Paris, I said."))
    answer = await client.chat.completions.create(model="fake-text", messages=[
        {"role": "system", "content": "Answer in French."}, *history[1:], {"role": "user", "content": "How many live there?"},
        {"role": "assistant", "content": "About two million."}, {"role": "user", "content": "Again?"}])
    assert answer.id == "chatcmpl-4-3"
    assert router.requests[-1]["messages"][0]["content"].startswith("Answer in French.")
    assert (await wire.request({"type": "open", "conversation": 4}))["system"] == "Answer in French."
    assert (await wire.request({"type": "open", "conversation": 1}))["system"] == "Answer in one line."
    listed = await wire.request({"type": "conversations"})
    # the failed question is kept, as every question the router failed is; the refused ones are not
    assert sorted(c["title"] for c in listed["items"]) == [
        "Capital of France?", "Capital of France?", "Capital of France?", "Fail?"]
    await client.close()


async def test_files_go_through_the_attachment_pipeline(door: tuple[str, str], router: FakeRouter, wire: Wire,
                                                        tmp_path: Path) -> None:
    client = sdk(door)
    png = base64.b64encode(make_png(tmp_path / "dot.png").read_bytes()).decode()
    pdf = base64.b64encode(make_pdf(tmp_path / "memo.pdf", ["The launch code is 4711."]).read_bytes()).decode()
    router.script(Reply(text="A dot and a memo."))
    answer = await client.chat.completions.create(model="fake-vision", messages=[{"role": "user", "content": [
        {"type": "text", "text": "What are these?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
        {"type": "file", "file": {"filename": "memo.pdf", "file_data": f"data:application/pdf;base64,{pdf}"}},
    ]}])
    assert answer.choices[0].message.content == "A dot and a memo."
    parts = router.requests[-1]["messages"][-1]["content"]
    assert any(p["type"] == "image_url" for p in parts)
    assert any("4711" in p.get("text", "") for p in parts)
    opened = await wire.request({"type": "open", "conversation": 1})
    assert [f["name"] for f in opened["turns"][0]["files"]] == ["image-1.png", "memo.pdf"]

    # the same rules as on the socket: an image for a text-only model is refused, and nothing is stored
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="fake-text", messages=[{"role": "user", "content": [
            {"type": "text", "text": "And this?"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}]}])
    assert refused.value.code == "no_vision"
    with pytest.raises(openai.BadRequestError) as remote:
        await client.chat.completions.create(model="fake-vision", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
    assert "data: URL" in remote.value.message
    assert len((await wire.request({"type": "conversations"}))["items"]) == 1


async def test_a_curl_style_reader_and_a_client_that_hangs_up(
    door: tuple[str, str], router: FakeRouter, wire: Wire
) -> None:
    router.script(Reply(text="one two three"))
    head, lines = await raw_http(door, *post(door, {"model": "fake-text", "stream": True,
                                                    "messages": [{"role": "user", "content": "Count"}]}))
    assert head.startswith("HTTP/1.1 200 OK") and "Content-Type: text/event-stream" in head
    assert "X-Assistant-Conversation: 1" in head
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and all(line == "" or line.startswith("data: ") for line in lines)
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "one two three"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["assistant"]["conversation"] == 1

    # the client hangs up mid-reply: the turn is cancelled as a cancel would, its partial reply kept
    rid = await wire.send({"type": "watch"})
    await wire.until(rid, ("watching",))
    hold = threading.Event()
    router.script(Reply(text="partial and then more", hold=hold))
    host, port = door[0].removeprefix("http://").removesuffix("/v1").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head_text, body = post(door, {"model": "fake-text", "stream": True, "messages": [{"role": "user", "content": "Go"}]})
    writer.write(head_text.encode() + body)
    await reader.readuntil(b"partial")
    writer.close()
    ended = [e async for e in _changes(wire, rid, "ended")]
    hold.set()
    assert (ended[-1]["conversation"], ended[-1]["finish_reason"]) == (2, "cancelled")
    conv = await wire.request({"type": "open", "conversation": 2})
    assert (conv["turns"][0]["status"], conv["turns"][0]["reply"]) == ("cancelled", "partial")

    # the daemon's own tools run inside the turn; the stream shows each call as a comment line
    router.script(Reply(tool_calls=[{"id": "c1", "name": "conversation_search", "arguments": '{"query": "Count"}'}]),
                  Reply(text="Found it."))
    head, lines = await raw_http(door, *post(door, {"model": "fake-text", "stream": True,
                                                    "messages": [{"role": "user", "content": "Search it"}]}))
    assert [line for line in lines if line.startswith(":")] == [": tool conversation_search ok: searched for 'Count': 0 results"]
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Found it."
    assert router.requests[-1]["messages"][-1]["role"] == "tool"

    # what the HTTP side refuses: no key, a body too large, a chunked body, an unknown path
    head, lines = await raw_http(door, *post(door, {"model": "fake-text", "messages": []}, key=""))
    assert head.startswith("HTTP/1.1 401") and json.loads(lines[0])["error"]["code"] == "invalid_api_key"
    auth = f"Authorization: Bearer {door[1]}\r\n"
    head, _ = await raw_http(door, f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 999999999\r\n\r\n")
    assert head.startswith("HTTP/1.1 413")
    head, _ = await raw_http(door, f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked\r\n\r\n")
    assert head.startswith("HTTP/1.1 411")
    head, lines = await raw_http(door, f"GET /v1/engines HTTP/1.1\r\nHost: x\r\n{auth}\r\n")
    assert head.startswith("HTTP/1.1 404") and "/v1/chat/completions" in json.loads(lines[0])["error"]["message"]
    head, _ = await raw_http(door, f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n\r\n")
    assert head.startswith("HTTP/1.1 401")
    listed = await wire.request({"type": "conversations"})
    assert len(listed["items"]) == 3


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


async def test_a_clients_own_tool_ends_the_response_and_its_result_continues_the_turn(
    door: tuple[str, str], router: FakeRouter, wire: Wire
) -> None:
    client = sdk(door)
    router.script(Reply(tool_calls=[{"id": "w1", "name": "get_weather", "arguments": '{"city": "Paris"}'}]))
    question = [{"role": "user", "content": "Weather in Paris?"}]
    stream = await client.chat.completions.create(model="fake-text", messages=question, tools=[WEATHER], stream=True)
    chunks = [chunk async for chunk in stream]
    [call] = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or ()]
    assert (call.id, call.function.name, call.function.arguments) == ("w1", "get_weather", '{"city": "Paris"}')
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    offered = [tool["function"]["name"] for tool in router.requests[-1]["tools"]]
    assert "get_weather" in offered and "conversation_search" in offered  # beside the daemon's own

    # the client runs it and sends the result: the same turn goes on, and is stored whole
    router.script(Reply(text="Sunny, 21 degrees."))
    answer = await client.chat.completions.create(model="fake-text", tools=[WEATHER], messages=[
        *question, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": "w1", "content": "sunny, 21 C"}])
    assert answer.id == "chatcmpl-1-1" and answer.choices[0].message.content == "Sunny, 21 degrees."
    sent = router.requests[-1]["messages"]
    assert [m["role"] for m in sent[-3:]] == ["user", "assistant", "tool"] and sent[-1]["content"] == "sunny, 21 C"
    conv = await wire.request({"type": "open", "conversation": 1})
    assert [(t["reply"], t["status"], t["finish_reason"]) for t in conv["turns"]] == [
        ("Sunny, 21 degrees.", "complete", "stop")]

    # and the conversation goes on from there as any other
    router.script(Reply(text="Cooler."))
    went_on = [*question, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": "w1", "content": "sunny, 21 C"},
               {"role": "assistant", "content": "Sunny, 21 degrees."}, {"role": "user", "content": "Tomorrow?"}]
    answer = await client.chat.completions.create(model="fake-text", tools=[WEATHER], messages=went_on)
    assert answer.id == "chatcmpl-1-2"
    with pytest.raises(openai.BadRequestError) as stale:  # results for a turn that called no tool of the client's
        await client.chat.completions.create(model="fake-text", messages=[
            *went_on, {"role": "assistant", "content": "Cooler.", "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": "w1", "content": "rain"}])
    assert "not waiting for tool results" in stale.value.message
    await client.close()


async def test_a_clients_own_tools_count_against_the_context(
    door: tuple[str, str], router: FakeRouter, wire: Wire
) -> None:
    # twelve tools of the client's, about 2,200 tokens of definitions on a 4,096-token model:
    # counted, the conversation compacts before its prompt and all the tools pass the context
    tools = [{"type": "function", "function": {
        "name": f"lookup_{n}", "description": f"Look up record set {n}. " + "It reads the ledger carefully. " * 18,
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}} for n in range(12)]
    client = sdk(door)
    messages: list[dict[str, Any]] = []
    for n in range(8):
        router.script(Reply(text=f"Answer {n}: " + "word " * 150))
        messages.append({"role": "user", "content": f"question {n} " + "filler " * 150})
        answer = await client.chat.completions.create(model="fake-text", messages=messages, tools=tools)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    await client.close()
    assert [r for r in router.requests if not r.get("stream")]  # a summary was asked: it compacted
    assert None not in router.timings  # and the fake refused no prompt (timings: None when it did)


async def test_llm_continues_one_conversation(
    door: tuple[str, str], router: FakeRouter, wire: Wire, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the key as the user gets it, from the command line
    printed = await asyncio.create_subprocess_exec(sys.executable, str(ROOT / "assistant.py"), "openai-key",
                                                   stdout=asyncio.subprocess.PIPE)
    out, _ = await printed.communicate()
    assert printed.returncode == 0 and out.decode().strip() == door[1]
    home = tmp_path / "llm"
    home.mkdir()
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: assistant\n  model_name: fake-text\n  api_base: {door[0]}\n  api_key_name: assistant\n")
    (home / "keys.json").write_text(json.dumps({"assistant": door[1]}))
    monkeypatch.setenv("LLM_USER_PATH", str(home))
    import llm

    def chat() -> tuple[str, str]:
        conversation = llm.get_model("assistant").conversation()
        first = conversation.prompt("Name a colour.").text()
        second = conversation.prompt("Another one?", stream=False).text()
        return first, second

    router.script(Reply(text="Blue."), Reply(text="Green."))
    assert await asyncio.to_thread(chat) == ("Blue.", "Green.")
    listed = await wire.request({"type": "conversations"})
    assert [c["turns"] for c in listed["items"]] == [2]
    assert [m["content"] for m in router.requests[-1]["messages"][1:]] == ["Name a colour.", "Blue.", "Another one?"]


async def test_models_are_listed_by_their_short_names(door: tuple[str, str], router: FakeRouter) -> None:
    """llama-server without --alias names its model by the GGUF path: the door lists the file's
    name, and a request naming it reaches that model by its own id."""
    path = "/home/me/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    router.models = [FakeModel(path), FakeModel("/a/tiny.gguf"), FakeModel("/b/tiny.gguf")]
    client = sdk(door)
    try:
        listed = [m.id async for m in client.models.list()]
        assert listed == ["SmolLM2-135M-Instruct.Q4_1", "/a/tiny.gguf", "/b/tiny.gguf"]  # a shared name: the ids
        answer = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1", messages=[{"role": "user", "content": "hi"}])
        assert answer.choices[0].message.content == "You said: hi"
        assert router.requests[-1]["model"] == path
    finally:
        await client.close()


async def test_door_conversations_feed_and_read_the_memory(
    door: tuple[str, str], router: FakeRouter, wire: Wire
) -> None:
    client = sdk(door)
    router.script(Reply(tool_calls=[{"id": "c1", "name": "memory_save",
                                     "arguments": json.dumps({"text": "The user is vegetarian"})}]),
                  Reply(text="Noted."))
    answer = await client.chat.completions.create(
        model="fake-text", messages=[{"role": "user", "content": "remember that I'm vegetarian"}])
    assert answer.choices[0].message.content == "Noted."
    [memory] = (await wire.request({"type": "memories"}))["items"]
    saved_in = (await wire.request({"type": "conversations"}))["items"][0]["conversation"]
    assert memory["text"] == "The user is vegetarian" and memory["source"] == {"conversation": saved_in, "turn": 1}
    # a new door conversation, with the client's own system message, reads it
    await client.chat.completions.create(model="fake-text", messages=[
        {"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "what shall I cook?"}])
    system = router.requests[-1]["messages"][0]
    assert system["role"] == "system" and system["content"].startswith("Answer in one line.")
    assert "The user is vegetarian" in system["content"]
    # and so does one a client brings with its earlier turns
    await client.chat.completions.create(model="fake-text", messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "a recipe, then?"}])
    assert "The user is vegetarian" in router.requests[-1]["messages"][0]["content"]


async def test_a_door_conversations_fact_reaches_a_socket_conversations_prompt(
    door: tuple[str, str], router: FakeRouter, wire: Wire
) -> None:
    router.script(Reply(text="Noted."))
    await sdk(door).chat.completions.create(
        model="fake-text", messages=[{"role": "user", "content": "My locker at the gym is number 4711."}])
    router.script(Reply(text="4711."))
    events = await wire.ask("Which gym locker number is mine?")
    assert events[-1]["type"] == "done"
    content = router.requests[-1]["messages"][-1]["content"]
    assert "you said: My locker at the gym is number 4711." in content
    assert content.endswith("Which gym locker number is mine?")
    [recalled] = [e for e in events if e["type"] == "progress" and e["stage"] == "recall"]
    assert recalled["sources"][0]["recall"] == "conversation"
