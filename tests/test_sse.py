"""Unit tests of the SSE parser and the chat-chunk accumulator, from plain lines and httpx.MockTransport."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from core.config import Config
from core.errors import RouterContextOverflow, RouterError
from core.router import RouterClient
from core.sse import (
    ChatAccumulator,
    ContentDelta,
    ReasoningDelta,
    SSEEvent,
    SSEParser,
    StreamEnd,
    StreamEvent,
    Timings,
    ToolCall,
    Usage,
    error_from_body,
    parse_chat_stream,
)


def events_of(lines: list[str]) -> list[SSEEvent]:
    parser = SSEParser()
    out = [e for e in map(parser.feed, lines) if e is not None]
    last = parser.flush()
    return out + ([last] if last is not None else [])


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> str:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return "data: " + json.dumps({"choices": choices, "object": "chat.completion.chunk", **extra})


async def aiter(lines: list[str]) -> AsyncIterator[str]:
    for line in lines:
        yield line


async def collect(lines: list[str]) -> list[StreamEvent]:
    return [event async for event in parse_chat_stream(aiter(lines))]


# -- SSEParser ---------------------------------------------------------------


def test_parser_dispatches_on_blank_lines_and_skips_comments() -> None:
    events = events_of([": ping", "data: one", "", "", "data:two", "", ":another comment", "data: three"])
    assert events == [SSEEvent("message", "one"), SSEEvent("message", "two"), SSEEvent("message", "three")]


def test_parser_joins_multiline_data_with_newlines() -> None:
    events = events_of(['data: {"a":', "data:  1}", ""])
    assert events == [SSEEvent("message", '{"a":\n 1}')]
    assert json.loads(events[0].data) == {"a": 1}


def test_parser_keeps_event_names_and_ignores_id_and_retry() -> None:
    events = events_of(["event: error", "id: 7", "retry: 100", 'data: {"x": 1}', "", 'data: {"y": 2}', ""])
    assert events == [SSEEvent("error", '{"x": 1}'), SSEEvent("message", '{"y": 2}')]


def test_parser_splits_complete_chunks_sent_without_blank_lines() -> None:
    events = events_of(['data: {"n": 1}', 'data: {"n": 2}', "data: [DONE]"])
    assert [e.data for e in events] == ['{"n": 1}', '{"n": 2}', "[DONE]"]


def test_parser_reports_llama_servers_legacy_error_field() -> None:
    events = events_of(['error: {"code": 500, "message": "boom"}', "", "data: [DONE]", ""])
    assert events == [SSEEvent("error", '{"code": 500, "message": "boom"}'), SSEEvent("message", "[DONE]")]


# -- ChatAccumulator -----------------------------------------------------------


def test_accumulator_ignores_null_content_and_reads_both_reasoning_keys() -> None:
    acc = ChatAccumulator()
    out = acc.feed({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}]})
    out += acc.feed({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]})
    out += acc.feed({"choices": [{"index": 0, "delta": {"reasoning": " yes"}}]})
    out += acc.feed({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})
    out += acc.feed({"choices": [{"index": 0, "delta": {"content": ""}}]})
    out += acc.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    out += acc.feed({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}})
    assert out == [ReasoningDelta("hmm"), ReasoningDelta(" yes"), ContentDelta("Hi")]
    assert acc.end() == StreamEnd("stop", [], Usage(12, 3), "Hi")


def test_accumulator_assembles_interleaved_tool_calls_by_index() -> None:
    acc = ChatAccumulator()
    pieces = [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "search", "arguments": ""}},
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "read", "arguments": '{"id"'}},
        {"index": 0, "function": {"arguments": '{"q": '}},
        {"index": 1, "function": {"arguments": ": 3}"}},
        {"index": 0, "function": {"name": "search", "arguments": '"cats"}'}},  # a server repeating the name
    ]
    for piece in pieces:
        assert acc.feed({"choices": [{"index": 0, "delta": {"tool_calls": [piece]}}]}) == []
    acc.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    end = acc.end()
    assert end.finish_reason == "tool_calls"
    assert end.tool_calls == [ToolCall("call_a", "search", '{"q": "cats"}'), ToolCall("call_b", "read", '{"id": 3}')]
    assert end.tool_calls[0].to_openai()["function"] == {"name": "search", "arguments": '{"q": "cats"}'}


def test_accumulator_names_calls_without_id_or_index() -> None:
    acc = ChatAccumulator()
    acc.feed({"choices": [{"delta": {"tool_calls": [{"function": {"name": "a", "arguments": "{}"}}]}}]})
    acc.feed({"choices": [{"delta": {"tool_calls": [{"id": "x2", "function": {"name": "b", "arguments": "{"}}]}}]})
    acc.feed({"choices": [{"delta": {"tool_calls": [{"function": {"arguments": "}"}}]}}]})
    assert acc.tool_calls() == [ToolCall("call_0", "a", "{}"), ToolCall("x2", "b", "{}")]


def test_accumulator_ignores_other_choices() -> None:
    acc = ChatAccumulator()
    out = acc.feed({"choices": [{"index": 1, "delta": {"content": "other"}}, {"index": 0, "delta": {"content": "ours"}}]})
    assert out == [ContentDelta("ours")]


def test_error_chunk_raises_with_the_servers_message() -> None:
    acc = ChatAccumulator()
    with pytest.raises(RouterError, match="out of memory") as info:
        acc.feed({"error": {"code": 500, "message": "out of memory", "type": "server_error"}})
    assert not isinstance(info.value, RouterContextOverflow)


def test_error_chunk_about_context_is_an_overflow() -> None:
    acc = ChatAccumulator()
    body = {"error": {"code": 400, "message": "the request exceeds the available context size", "type": "exceed_context_size_error"}}
    with pytest.raises(RouterContextOverflow, match="exceeds the available context size"):
        acc.feed(body)


def test_legacy_error_event_raises() -> None:
    acc = ChatAccumulator()
    with pytest.raises(RouterContextOverflow, match="try increasing the context size"):
        acc.feed_event(SSEEvent("error", json.dumps({"code": 400, "message": "try increasing the context size",
                                                      "type": "exceed_context_size_error"})))


def test_non_json_chunk_raises() -> None:
    with pytest.raises(RouterError, match="not JSON"):
        ChatAccumulator().feed_event(SSEEvent("message", "{broken"))


# -- error bodies ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "overflow", "words"),
    [
        ({"error": {"message": "Invalid model", "type": "invalid_request_error"}}, False, "Invalid model"),
        ({"error": "model not loaded"}, False, "model not loaded"),
        ({"detail": "Not authenticated"}, False, "Not authenticated"),
        ({"detail": [{"loc": ["body", "messages"], "msg": "field required"}]}, False, "field required"),
        ({"object": "error", "message": "This model's maximum context length is 4096 tokens.", "type": "BadRequestError"},
         True, "maximum context length is 4096"),
        ({"error": {"message": "too long", "type": "invalid_request_error", "code": "context_length_exceeded"}},
         True, "too long"),
        ({"error": "the input length exceeds the context length"}, True, "input length exceeds"),
        ({"error": {"code": 500, "message": "Context size has been exceeded.", "type": "server_error"}}, True,
         "Context size has been exceeded"),
    ],
)
def test_error_from_body_shapes(body: Any, overflow: bool, words: str) -> None:
    error = error_from_body(body, 400)
    assert isinstance(error, RouterContextOverflow) is overflow
    assert words in error.message
    assert error.status == 400


@pytest.mark.parametrize(
    ("body", "n_ctx"),
    [
        # llama-server: the sizes beside the message, in the error object
        ({"error": {"code": 400, "message": "request (5000 tokens) exceeds the available context size (4096 tokens), "
                    "try increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": 5000, "n_ctx": 4096}},
         4096),
        ({"error": {"code": 400, "message": "request (9000 tokens) exceeds the available context size (8192 tokens)",
                    "type": "exceed_context_size_error"}}, 8192),
        ({"object": "error", "message": "This model's maximum context length is 2048 tokens. However, you requested "
          "3000 tokens.", "type": "BadRequestError"}, 2048),
        ({"error": {"message": "the request exceeds the available context size", "type": "exceed_context_size_error"}},
         None),
        ({"error": {"message": "too long", "code": "context_length_exceeded", "n_ctx": 0}}, None),
    ],
)
def test_an_overflow_carries_the_size_the_server_named(body: Any, n_ctx: int | None) -> None:
    error = error_from_body(body, 400)
    assert isinstance(error, RouterContextOverflow)
    assert error.n_ctx == n_ctx


def test_advice_follows_the_servers_words() -> None:
    error = error_from_body({"error": {"message": "Loading model", "type": "unavailable_error"}}, 503, advice="wait")
    assert error.message.endswith("Loading model; wait") and error.status == 503


def test_error_from_raw_text_is_truncated() -> None:
    error = error_from_body("x" * 2000 + "tail", 502)
    assert "x" * 500 in error.message
    assert "tail" not in error.message
    assert not isinstance(error, RouterContextOverflow)


# -- parse_chat_stream --------------------------------------------------------------


@pytest.mark.asyncio
async def test_stream_ends_with_stream_end() -> None:
    events = await collect([
        chunk({"role": "assistant", "content": None}), "",
        chunk({"content": "Hel"}), "",
        chunk({"content": "lo"}), "",
        chunk({}, "stop"), "",
        chunk(None, usage={"prompt_tokens": 5, "completion_tokens": 2}), "",
        "data: [DONE]", "",
    ])
    assert events == [ContentDelta("Hel"), ContentDelta("lo"), StreamEnd("stop", [], Usage(5, 2), "Hello")]


# llama-server's timings object as it ends a stream (tools/server, result_timings::to_json)
TIMINGS = {
    "cache_n": 3000, "prompt_n": 512, "prompt_ms": 1234.5, "prompt_per_token_ms": 2.41, "prompt_per_second": 414.7,
    "predicted_n": 37, "predicted_ms": 890.0, "predicted_per_token_ms": 24.05, "predicted_per_second": 41.6,
}


@pytest.mark.asyncio
async def test_timings_on_the_usage_chunk_reach_the_stream_end() -> None:
    # with stream_options.include_usage llama-server puts them on the usage chunk, the last one
    events = await collect([
        chunk({"content": "Hi"}), "",
        chunk({}, "stop"), "",
        chunk(None, usage={"prompt_tokens": 3512, "completion_tokens": 37}, timings=TIMINGS), "",
        "data: [DONE]", "",
    ])
    end = events[-1]
    assert isinstance(end, StreamEnd)
    assert end.timings == Timings(512, 3000, 1234.5, 414.7, 37, 890.0, 41.6)
    assert end.timings.to_json() == {
        "prompt_n": 512, "cache_n": 3000, "prompt_ms": 1234.5, "predicted_n": 37, "predicted_per_second": 41.6
    }


@pytest.mark.asyncio
async def test_timings_on_the_finish_chunk_and_their_absence() -> None:
    # without usage the finish chunk is the last, and carries them; other servers send none
    events = await collect([chunk({"content": "Hi"}), "", chunk({}, "stop", timings={"prompt_n": 4}), "", "data: [DONE]"])
    end = events[-1]
    assert isinstance(end, StreamEnd) and end.timings is not None
    assert end.timings.to_json() == {
        "prompt_n": 4, "cache_n": None, "prompt_ms": None, "predicted_n": None, "predicted_per_second": None
    }
    plain = await collect([chunk({"content": "Hi"}), "", chunk({}, "stop"), "", "data: [DONE]"])
    assert plain[-1] == StreamEnd("stop", [], None, "Hi", None)


def test_odd_timings_are_left_out() -> None:
    assert Timings.from_json("fast") is None
    assert Timings.from_json({"prompt_n": "many", "cache_n": True, "prompt_ms": -1.0, "predicted_n": 3.0}) == Timings(
        predicted_n=3
    )


@pytest.mark.asyncio
async def test_numbers_json_cannot_carry_are_left_out() -> None:
    # a Python server's json.dumps writes NaN and Infinity; no event could carry them on
    events = await collect([
        chunk({"content": "Hi"}), "",
        'data: {"choices": [], "usage": {"prompt_tokens": Infinity, "completion_tokens": NaN}, '
        '"timings": {"prompt_n": Infinity, "cache_n": 3, "prompt_ms": NaN, "predicted_per_second": Infinity}}', "",
        chunk({}, "stop"), "", "data: [DONE]",
    ])
    end = events[-1]
    assert isinstance(end, StreamEnd) and end.usage is None  # the daemon estimates instead
    assert end.timings is not None and end.timings.to_json() == {
        "prompt_n": None, "cache_n": 3, "prompt_ms": None, "predicted_n": None, "predicted_per_second": None
    }


def test_odd_usage_is_no_usage() -> None:
    acc = ChatAccumulator()
    acc.feed({"choices": [], "usage": {"prompt_tokens": "many", "completion_tokens": 2}})
    assert acc.usage is None
    acc.feed({"choices": [], "usage": {"prompt_tokens": 7}})  # a count left out is none
    assert acc.usage == Usage(7, 0)


@pytest.mark.asyncio
async def test_lone_surrogates_from_the_server_become_replacement_characters() -> None:
    # a server that cuts text between UTF-16 halves sends each half as an escape of its own
    events = await collect([
        chunk({"content": "Hi \ud83d"}), "", chunk({"content": "\ude00 there \ud83d\ude00"}), "",
        chunk({"tool_calls": [{"index": 0, "id": "c\udc00", "function": {"name": "f", "arguments": '{"q": "\ud800'}}]}),
        "", chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"}'}}]}, "tool_calls"), "", "data: [DONE]",
    ])
    texts = [e.text for e in events if isinstance(e, ContentDelta)]
    assert texts == ["Hi \ufffd", "\ufffd there \U0001f600"]  # a pair in one string stays whole
    end = events[-1]
    assert isinstance(end, StreamEnd)
    assert end.tool_calls == [ToolCall("c\ufffd", "f", '{"q": "\ufffd"}')]
    for text in (*texts, end.text, end.tool_calls[0].arguments):
        text.encode()  # each can be sent on and stored


@pytest.mark.asyncio
async def test_stream_stops_reading_at_done() -> None:
    async def lines() -> AsyncIterator[str]:
        yield chunk({"content": "a"})
        yield ""
        yield "data: [DONE]"
        yield ""
        raise AssertionError("read past [DONE]")

    events = [e async for e in parse_chat_stream(lines())]
    assert events == [ContentDelta("a"), StreamEnd(None, [], None, "a")]


@pytest.mark.asyncio
async def test_stream_with_finish_but_no_done_is_complete() -> None:
    events = await collect([chunk({"content": "a"}), "", chunk({}, "length")])
    assert events[-1] == StreamEnd("length", [], None, "a")


@pytest.mark.asyncio
async def test_stream_cut_off_raises_after_the_deltas() -> None:
    seen: list[StreamEvent] = []
    with pytest.raises(RouterError, match="mid-stream"):
        async for event in parse_chat_stream(aiter([chunk({"content": "par"}), "", chunk({"content": "tial"}), ""])):
            seen.append(event)
    assert seen == [ContentDelta("par"), ContentDelta("tial")]


# -- through httpx.MockTransport ------------------------------------------------------


def mock_client(handler: Any) -> RouterClient:
    return RouterClient(Config(router_url="http://router.test/v1"), transport=httpx.MockTransport(handler))


@pytest.mark.asyncio
async def test_crlf_stream_without_blank_lines_through_the_client() -> None:
    body = "\r\n".join([chunk({"content": "one"}), chunk({"content": " two"}), chunk({}, "stop"), "data: [DONE]"]) + "\r\n"

    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["stream"] is True
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())

    client = mock_client(handler)
    try:
        events = [e async for e in client.stream_chat("m", [{"role": "user", "content": "hi"}])]
    finally:
        await client.aclose()
    assert events == [ContentDelta("one"), ContentDelta(" two"), StreamEnd("stop", [], None, "one two")]


@pytest.mark.asyncio
async def test_legacy_llama_server_error_at_http_200_through_the_client() -> None:
    error = {"code": 400, "message": "the request exceeds the available context size. try increasing the context size "
             "or enable context shift", "type": "invalid_request_error"}
    body = f"error: {json.dumps(error)}\n\ndata: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())

    client = mock_client(handler)
    try:
        with pytest.raises(RouterContextOverflow, match="enable context shift"):
            async for _ in client.stream_chat("m", []):
                pass
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_vllm_style_400_through_the_client() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"object": "error", "type": "BadRequestError", "code": 400, "message":
                                         "This model's maximum context length is 2048 tokens. However, you requested 3000"})

    client = mock_client(handler)
    try:
        with pytest.raises(RouterContextOverflow) as info:
            async for _ in client.stream_chat("m", []):
                pass
    finally:
        await client.aclose()
    assert info.value.status == 400 and info.value.n_ctx == 2048
    assert "maximum context length is 2048" in info.value.message
    assert "http://router.test/v1/chat/completions" in info.value.message


@pytest.mark.parametrize(
    "chunk",
    [
        '{"choices": [{"index": 0, "delta": "oops"}]}',
        '{"choices": [{"index": 0, "delta": {"tool_calls": [7]}}]}',
    ],
)
def test_malformed_chunks_are_router_errors(chunk: str) -> None:
    acc = ChatAccumulator()
    with pytest.raises(RouterError, match="malformed chunk"):
        acc.feed_event(SSEEvent("message", chunk))
