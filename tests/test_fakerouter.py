"""The fake router itself: its prompt cache and timings, its length cutting, its router modes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from selfcheck.fakeprompt import PromptSlot, render_prompt, text_tokens
from selfcheck.fakerouter import FakeModel, FakeRouter, Reply

SYSTEM = {"role": "system", "content": "You are a helpful assistant running locally."}
# Every ChatML prompt opens alike: two prompts share at least this much, as on llama-server
OPENING = text_tokens("<|im_start|>")


@pytest.fixture
def fake() -> Iterator[FakeRouter]:
    with FakeRouter() as router:
        yield router


def root(fake: FakeRouter) -> str:
    return fake.url.removesuffix("/v1")


def chat(fake: FakeRouter, messages: list[dict[str, Any]], **params: Any) -> list[dict[str, Any]]:
    """A streamed chat request: its chunks, parsed, up to [DONE]."""
    body = {"model": "fake-text", "messages": messages, "stream": True, **params}
    with httpx.stream("POST", f"{fake.url}/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def text_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def finish_of(chunks: list[dict[str, Any]]) -> str | None:
    return next(c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])


# -- the prompt cache ----------------------------------------------------------------


def test_a_conversation_that_grows_reuses_its_prefix(fake: FakeRouter) -> None:
    first = [SYSTEM, {"role": "user", "content": "What is the capital of France? " * 5}]
    reply = text_of(chat(fake, first))
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And of Spain?"}]
    chat(fake, second)
    cold, warm = fake.timings
    assert cold is not None and warm is not None
    assert cold["cache_n"] == 0 and cold["prompt_n"] == text_tokens(render_prompt({"messages": first}))
    # everything up to the end of the previous answer is found in the cache: only the new question is read
    assert warm["cache_n"] == text_tokens(render_prompt({"messages": first}) + reply + "<|im_end|>")
    assert warm["cache_n"] + warm["prompt_n"] == text_tokens(render_prompt({"messages": second}))
    assert warm["prompt_n"] < 20


def test_a_changed_first_message_is_read_again_whole(fake: FakeRouter) -> None:
    question = {"role": "user", "content": "Tell me about llamas."}
    chat(fake, [SYSTEM, question])
    chat(fake, [{"role": "system", "content": "Be brief. " + SYSTEM["content"]}, question])
    # nothing but the template's opening "<|im_start|>system\n"
    assert fake.timings[1] is not None and fake.timings[1]["cache_n"] == text_tokens("<|im_start|>system\n") == 4
    assert fake.timings[0] is not None and fake.timings[0]["cache_n"] == 0  # a cold slot


def test_the_same_prompt_again_still_reads_its_last_token(fake: FakeRouter) -> None:
    messages = [SYSTEM, {"role": "user", "content": "hello"}]
    chat(fake, messages)
    chat(fake, messages)  # the cache holds the reply too, but the prompt is all that can match
    assert fake.timings[1] is not None and fake.timings[1]["prompt_n"] == 1


def test_a_changed_image_counts_as_changed() -> None:
    def with_image(data: str) -> dict[str, Any]:
        parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": data}}]
        return {"messages": [SYSTEM, {"role": "user", "content": parts}]}

    slot = PromptSlot()
    slot.use(render_prompt(with_image("data:image/png;base64,AAAA")), "A cat.")
    same = slot.use(render_prompt(with_image("data:image/png;base64,AAAA")), "A cat.")
    other = slot.use(render_prompt(with_image("data:image/png;base64,BBBB")), "A dog.")
    assert same.prompt_n == 1
    assert other.prompt_n > 4  # from the image marker on


def test_tool_calls_and_results_are_rendered_into_the_prompt() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "kb_search", "arguments": '{"q": "x"}'}}
    messages = [
        {"role": "user", "content": "look it up"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "found it"},
    ]
    tools = [{"type": "function", "function": {"name": "kb_search"}}]
    prompt = render_prompt({"messages": messages, "tools": tools})
    assert '<tool_call>\n{"name": "kb_search", "arguments": {"q": "x"}}\n</tool_call>' in prompt
    assert "<tool_response>\nfound it\n</tool_response>" in prompt
    assert prompt.startswith("<|im_start|>system\n# Tools") and prompt.endswith("<|im_start|>assistant\n")


def test_a_title_request_takes_the_slot_as_on_a_one_slot_server(fake: FakeRouter) -> None:
    turn = [SYSTEM, {"role": "user", "content": "Plan a trip to Lisbon for three days. " * 4}]
    reply = text_of(chat(fake, turn))
    title = {"model": "fake-text", "messages": [{"role": "user", "content": "A title for: Lisbon"}], "max_tokens": 24}
    answer = httpx.post(f"{fake.url}/chat/completions", json=title).json()
    assert answer["timings"]["cache_n"] == OPENING and answer["timings"] == fake.timings[1]
    chat(fake, turn + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and Porto?"}])
    # the slot now holds the title's prompt: the conversation is read again whole
    assert fake.timings[2] is not None and fake.timings[2]["cache_n"] == OPENING


# -- timings on the wire -----------------------------------------------------------------


def test_timings_ride_on_the_last_chunk(fake: FakeRouter) -> None:
    with_usage = chat(fake, [{"role": "user", "content": "hi"}], stream_options={"include_usage": True})
    assert with_usage[-1]["choices"] == [] and "usage" in with_usage[-1]
    assert with_usage[-1]["timings"] == fake.timings[0]
    assert not any("timings" in c for c in with_usage[:-1])
    without = chat(fake, [{"role": "user", "content": "hi"}])
    assert without[-1]["choices"][0]["finish_reason"] == "stop" and without[-1]["timings"] == fake.timings[1]
    assert set(without[-1]["timings"]) >= {"cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_per_second"}


def test_ollama_sends_no_timings_but_the_fake_still_counts() -> None:
    with FakeRouter(mode="ollama") as fake:
        chunks = chat(fake, [{"role": "user", "content": "hi"}], stream_options={"include_usage": True})
        assert not any("timings" in c for c in chunks)
        assert fake.timings[0] is not None and fake.timings[0]["cache_n"] == 0


# -- length --------------------------------------------------------------------------------


def test_max_tokens_cuts_the_reply(fake: FakeRouter) -> None:
    fake.script(Reply(text="one two three four five six"), Reply(text="one two"))
    cut = chat(fake, [{"role": "user", "content": "count"}], max_tokens=3)
    assert text_of(cut) == "one two three" and finish_of(cut) == "length"
    whole = chat(fake, [{"role": "user", "content": "count"}], max_tokens=3)
    assert text_of(whole) == "one two" and finish_of(whole) == "stop"


def test_tool_calls_that_do_not_fit_are_dropped(fake: FakeRouter) -> None:
    fake.script(Reply(text="Let me see.", tool_calls=[{"name": "kb_search", "arguments": {"q": "x"}}]))
    chunks = chat(fake, [{"role": "user", "content": "q"}], max_tokens=4)
    assert text_of(chunks) == "Let me see." and finish_of(chunks) == "length"
    assert not any(c["choices"] and "tool_calls" in c["choices"][0]["delta"] for c in chunks)


def test_a_fill_reply_writes_until_max_tokens_or_the_context_is_full() -> None:
    with FakeRouter([FakeModel("fake-text", n_ctx=300)]) as fake:
        fake.script(Reply(fill=True), Reply(fill=True))
        capped = chat(fake, [{"role": "user", "content": "go on"}], max_tokens=40)
        assert len([c for c in capped if c["choices"] and c["choices"][0]["delta"].get("content")]) == 40
        assert finish_of(capped) == "length"
        question = {"role": "user", "content": "x" * 400}  # 100 rough tokens: 200 are left
        full = chat(fake, [question])
        assert fake.timings[1] is not None and fake.timings[1]["predicted_n"] == 200
        assert finish_of(full) == "length"


def test_a_reply_stops_where_the_context_ends() -> None:
    with FakeRouter([FakeModel("fake-text", n_ctx=100)]) as fake:
        fake.script(Reply(text="word " * 50))
        chunks = chat(fake, [{"role": "user", "content": "y" * 360}])  # 90 tokens of 100
        assert text_of(chunks).split() == ["word"] * 10 and finish_of(chunks) == "length"


# -- modes --------------------------------------------------------------------------------


def test_llama_swap_mode() -> None:
    with FakeRouter(mode="llama-swap") as fake:
        entries = httpx.get(f"{fake.url}/models").json()["data"]
        assert {e["owned_by"] for e in entries} == {"llama-swap"} and not any("meta" in e for e in entries)
        assert httpx.get(f"{root(fake)}/props").status_code == 404
        assert httpx.get(f"{root(fake)}/running").json() == {"running": []}
        props = httpx.get(f"{root(fake)}/upstream/fake-vision/props").json()
        assert props["default_generation_settings"]["n_ctx"] == 8192
        assert httpx.get(f"{root(fake)}/running").json() == {"running": [{"model": "fake-vision", "state": "ready"}]}
        chat(fake, [{"role": "user", "content": "hi"}])  # fake-text: a swap
        assert fake.loaded == ["fake-vision", "fake-text"]


def test_ollama_mode() -> None:
    models = [FakeModel("qwen3:8b", ["text", "image"], n_ctx=8192, n_ctx_train=40960), FakeModel("llama3.2:1b")]
    with FakeRouter(models, mode="ollama") as fake:
        assert httpx.get(f"{root(fake)}/").text == "Ollama is running"
        assert "version" in httpx.get(f"{root(fake)}/api/version").json()
        assert httpx.get(f"{root(fake)}/props").status_code == 404
        assert {e["owned_by"] for e in httpx.get(f"{fake.url}/models").json()["data"]} == {"library"}
        show = httpx.post(f"{root(fake)}/api/show", json={"model": "qwen3:8b"}).json()
        assert show["parameters"].splitlines()[0].split() == ["num_ctx", "8192"]
        assert show["model_info"]["llama.context_length"] == 40960
        assert show["capabilities"] == ["completion", "vision", "tools"]
        default = httpx.post(f"{root(fake)}/api/show", json={"model": "llama3.2:1b"}).json()
        assert "num_ctx" not in default["parameters"]
        assert httpx.post(f"{root(fake)}/api/show", json={"model": "nope"}).status_code == 404


def test_silent_mode_tells_the_size_only_when_refusing() -> None:
    with FakeRouter([FakeModel("fake-text", n_ctx=100)], mode="silent") as fake:
        entries = httpx.get(f"{fake.url}/models").json()["data"]
        assert not any("meta" in e or "architecture" in e for e in entries)
        assert httpx.get(f"{root(fake)}/props").status_code == 404
        body = {"model": "fake-text", "messages": [{"role": "user", "content": "z" * 800}]}
        refused = httpx.post(f"{fake.url}/chat/completions", json=body)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["type"] == "exceed_context_size_error" and error["n_ctx"] == 100
        assert fake.timings == [None]
