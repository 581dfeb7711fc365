"""Incremental parsing of an OpenAI-compatible streaming chat completion.

Two layers, both free of I/O so they can be fed from httpx or from a list of
strings in a test:

- ``SSEParser`` turns the lines of a ``text/event-stream`` body (as
  ``httpx.Response.aiter_lines()`` yields them) into ``SSEEvent``s by the WHATWG
  rules: ``data:`` lines accumulate until a blank line, ``:`` lines are comments.
- ``ChatAccumulator`` turns each event's JSON chunk into the ``ContentDelta`` /
  ``ReasoningDelta`` events the turn engine forwards, and collects tool-call
  fragments (by ``index``), the ``finish_reason``, the ``usage`` and llama-server's
  ``timings`` for the closing ``StreamEnd``.

``parse_chat_stream`` ties both to an async iterator of lines; its last item is
always a ``StreamEnd``, and a stream that stops before ``[DONE]`` or a
``finish_reason`` raises ``RouterError`` (the connection dropped mid-reply).

Dialects handled, because real servers differ:

- llama-server's first chunk carries ``"content": null``; a usage-only chunk has
  ``"choices": []``; reasoning is ``reasoning_content`` (llama.cpp, DeepSeek) or
  ``reasoning`` (vLLM, OpenRouter); ``timings`` come with llama-server's last chunk.
- An error after the HTTP 200: ``data: {"error": {...}}``, ``event: error`` +
  ``data:``, or llama-server's pre-2025-09 ``error: {...}`` field. All raise
  ``RouterError`` (``RouterContextOverflow`` for a context overflow, with the context
  size when the server names it).
- A ``data:`` line arriving while the buffered data is already a complete JSON
  document (a server that omits the blank line) dispatches the buffered one first.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import AsyncGenerator, AsyncIterable, Collection
from dataclasses import dataclass, field
from typing import Any

from .errors import RouterContextOverflow, RouterError, RouterFormatError
from .jsontext import SURROGATE_ESCAPE, without_lone_surrogates

__all__ = [
    "ChatAccumulator",
    "ContentDelta",
    "ReasoningDelta",
    "SSEEvent",
    "SSEParser",
    "StreamEnd",
    "StreamEvent",
    "Timings",
    "ToolCall",
    "Usage",
    "call_in_text",
    "error_from_body",
    "is_context_overflow",
    "parse_chat_stream",
]

logger = logging.getLogger(__name__)

DONE_SENTINEL = "[DONE]"
# a reply's whole text inside one ``` fence (a language tag allowed): what ``call_in_text`` unwraps
FENCE_PATTERN = re.compile(r"\A```[A-Za-z]*[ \t]*\n?(.*?)\n?```\Z", re.DOTALL)
# How much of a server's raw, non-JSON error text reaches the user.
MAX_ERROR_TEXT = 500
# Error ``type``/``code`` values that mean "the prompt does not fit the context".
OVERFLOW_TYPES = frozenset({"exceed_context_size_error", "context_length_exceeded"})
# Wordings of the same, from llama-server, vLLM, OpenAI, Ollama and LM Studio.
OVERFLOW_PATTERN = re.compile(
    r"exceeds? the available context size"
    r"|context size has been exceeded"
    r"|maximum context length"
    r"|context[ _]length[ _]exceeded"
    r"|exceeds? (?:the )?context (?:length|window)"
    r"|context (?:length|window) (?:is )?exceeded"
    r"|too (?:many|long) .*context",
    re.IGNORECASE,
)
# llama-server's words when the model's output starts a tool call its chat format's parser
# cannot read ("... does not match the expected peg-native format"; the format's name varies)
FORMAT_PATTERN = re.compile(r"does not match the expected .*format", re.IGNORECASE)
# The context size in an overflow message without an ``n_ctx`` field: vLLM and OpenAI say
# "maximum context length is 4096 tokens", llama-server "the available context size (4096 tokens)".
OVERFLOW_CTX_PATTERN = re.compile(
    r"maximum context length is (\d+)|(?:available )?context size \((\d+) tokens\)", re.IGNORECASE
)
OVERFLOW_ADVICE = (
    "start a new conversation, attach fewer or smaller files, or give the model server a larger context "
    "(llama-server -c)"
)


@dataclass
class SSEEvent:
    """One dispatched server-sent event: its type (``message`` unless named) and its data."""

    event: str
    data: str


@dataclass
class ContentDelta:
    """A piece of the reply's text."""

    text: str


@dataclass
class ReasoningDelta:
    """A piece of the model's separately streamed reasoning."""

    text: str


@dataclass
class ToolCall:
    """One tool call the model made; ``arguments`` is the raw JSON text it produced."""

    id: str
    name: str
    arguments: str
    from_text: bool = False  # the model wrote it as its reply's text (``call_in_text``)

    def to_openai(self) -> dict[str, Any]:
        """The call as it goes back to the router in the assistant message's ``tool_calls``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Usage:
    """Token counts the router reported for one reply."""

    prompt_tokens: int
    completion_tokens: int

    def to_json(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}


def _number(value: Any) -> float | None:
    """A count or a measure a server sent; None unless it is a finite number, not negative
    (a Python server may send NaN or Infinity, which no event could carry)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        return None
    return float(value)


def _count(value: Any) -> int | None:
    number = _number(value)
    return int(number) if number is not None else None


@dataclass
class Timings:
    """llama-server's account of one reply: prompt tokens it processed and reused from
    its prompt cache, tokens it generated, and how fast; a field it did not send is None."""

    prompt_n: int | None = None  # prompt tokens processed (not found in the cache)
    cache_n: int | None = None  # prompt tokens reused from the previous prompt
    prompt_ms: float | None = None
    prompt_per_second: float | None = None
    predicted_n: int | None = None
    predicted_ms: float | None = None
    predicted_per_second: float | None = None

    @classmethod
    def from_json(cls, raw: Any) -> Timings | None:
        """The timings of a chunk's ``timings`` object; None when it is not one."""
        if not isinstance(raw, dict):
            return None
        return cls(
            prompt_n=_count(raw.get("prompt_n")),
            cache_n=_count(raw.get("cache_n")),
            prompt_ms=_number(raw.get("prompt_ms")),
            prompt_per_second=_number(raw.get("prompt_per_second")),
            predicted_n=_count(raw.get("predicted_n")),
            predicted_ms=_number(raw.get("predicted_ms")),
            predicted_per_second=_number(raw.get("predicted_per_second")),
        )

    def to_json(self) -> dict[str, int | float | None]:
        """The part a client shows: the ``timings`` of a ``done`` event."""
        return {
            "prompt_n": self.prompt_n,
            "cache_n": self.cache_n,
            "prompt_ms": self.prompt_ms,
            "predicted_n": self.predicted_n,
            "predicted_per_second": self.predicted_per_second,
        }


@dataclass
class StreamEnd:
    """The close of a reply: why it stopped, the tool calls it made, usage, its whole text,
    and llama-server's timings (None from servers that send none)."""

    finish_reason: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage | None = None
    text: str = ""
    timings: Timings | None = None


StreamEvent = ContentDelta | ReasoningDelta | StreamEnd


# what a model may write as a tool's name in a call it writes as text (OpenAI's rule for names)
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def call_in_text(text: str, offered: Collection[str], call_id: str) -> ToolCall | None:
    """The tool call a reply's whole text is, or None.

    Small local models write a call as plain text when their server's parser does not catch
    it (Qwen2.5-Coder-1.5B: a bare ``{"name": "calc__add", "arguments": {...}}``, which
    llama-server left as content): the call was meant, and nothing would run. A call is the
    whole text, stripped, optionally inside one ``` fence: one JSON object with exactly
    ``name`` and ``arguments`` (an object, or a JSON string of one). A reply that merely holds
    such an object among words is text. A call of a tool not ``offered`` is a call too (the
    same 1.5B model wrote ``{"name": "math_operation", ...}`` for "what is 17 times 13?",
    issue 49's run): it runs nothing, and its result tells the model the tools there are, so
    the model answers rather than leave the user a call as the reply.
    """
    body = text.strip()
    fenced = FENCE_PATTERN.match(body)
    if fenced:
        body = fenced.group(1).strip()
    if not body.startswith("{"):
        return None
    try:
        value = json.loads(body)
        if not isinstance(value, dict) or set(value) != {"name", "arguments"} or not offered:
            return None
        if not isinstance(value["name"], str) or not TOOL_NAME.match(value["name"]):
            return None
        arguments = value["arguments"]
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
    except (ValueError, RecursionError, TypeError):  # TypeError: a name that cannot be looked up
        return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(call_id, value["name"], json.dumps(arguments, ensure_ascii=False), from_text=True)


def _looks_complete(data: str) -> bool:
    """True when ``data`` is already a whole JSON document (or ``[DONE]``)."""
    if data.strip() == DONE_SENTINEL:
        return True
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


class SSEParser:
    """Turns ``text/event-stream`` lines into events; feed it every line, then ``flush()``."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = ""

    def feed(self, line: str) -> SSEEvent | None:
        """Consume one line (without its line ending); return the event it completes, if any."""
        # The hot path: one ``data:`` line per chunk, then a blank line.
        if line.startswith("data:"):
            value = line[6:] if line.startswith("data: ") else line[5:]
            dispatched = None
            if self._data and _looks_complete("\n".join(self._data)):
                # No blank line since the last complete chunk: a lenient server.
                dispatched = self._dispatch()
            self._data.append(value)
            return dispatched
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None  # a comment, e.g. a keep-alive ping
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "error":
            # llama-server before 2025-09 streamed errors as a non-standard field.
            pending = self._dispatch()
            if pending is not None:
                logger.debug("dropping unterminated event before an error field: %.80s", pending.data)
            return SSEEvent("error", value)
        # ``id`` and ``retry`` matter only to reconnecting browsers; others are ignored by the spec.
        return None

    def flush(self) -> SSEEvent | None:
        """The event still buffered when the body ended without a closing blank line."""
        return self._dispatch()

    def _dispatch(self) -> SSEEvent | None:
        if not self._data:
            self._event = ""
            return None
        event = SSEEvent(self._event or "message", "\n".join(self._data))
        self._data = []
        self._event = ""
        return event


def _overflow_ctx(body: Any, message: str) -> int | None:
    """The context size an overflow error names: llama-server's ``n_ctx`` (in the error
    object, or beside it), else a number in the message's wording."""
    error = body.get("error") if isinstance(body, dict) else None
    for holder in (error, body):
        if isinstance(holder, dict):
            n_ctx = _count(holder.get("n_ctx"))
            if n_ctx:
                return n_ctx
    found = OVERFLOW_CTX_PATTERN.search(message)
    if found:
        return int(found.group(1) or found.group(2)) or None
    return None


def _error_fields(body: Any) -> tuple[str, tuple[str, ...]]:
    """The message and the type/code values of an error body in any of the usual shapes."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            message = error.get("message") or error.get("msg") or json.dumps(error)
            return str(message), _kinds(error)
        if isinstance(error, str) and error:
            return error, _kinds(body)
        detail = body.get("detail")
        if detail:
            # FastAPI validation errors are a list of dicts; keep them readable.
            return (detail if isinstance(detail, str) else json.dumps(detail)), ()
        if body.get("message"):
            # vLLM's older ErrorResponse: {"object": "error", "message": ..., "type": ...}
            return str(body["message"]), _kinds(body)
        return json.dumps(body)[:MAX_ERROR_TEXT], ()
    if isinstance(body, str):
        return body.strip()[:MAX_ERROR_TEXT], ()
    return json.dumps(body)[:MAX_ERROR_TEXT], ()


def _kinds(error: dict[str, Any]) -> tuple[str, ...]:
    # OpenAI puts "invalid_request_error" in type and "context_length_exceeded" in code.
    return tuple(str(error[key]) for key in ("type", "code") if error.get(key) is not None)


def is_context_overflow(message: str, kinds: tuple[str, ...] = ()) -> bool:
    """True when a server's error says the prompt does not fit the model's context."""
    return any(kind in OVERFLOW_TYPES for kind in kinds) or bool(OVERFLOW_PATTERN.search(message))


def error_from_body(
    body: Any, status: int | None = None, *, prefix: str = "the model server answered", advice: str = ""
) -> RouterError:
    """Our error for a server's error body (parsed JSON, or raw text), carrying the server's
    words, then ``advice`` when given."""
    message, kinds = _error_fields(body)
    if not message:
        message = "no error message"
    where = f"{prefix} {status}" if status else prefix
    tail = f"; {advice}" if advice else ""
    if is_context_overflow(message, kinds):
        return RouterContextOverflow(
            f"{where}: {message}; the prompt is too long for the model: {OVERFLOW_ADVICE}{tail}",
            status,
            _overflow_ctx(body, message),
        )
    if FORMAT_PATTERN.search(message):
        return RouterFormatError(f"{where}: {message}{tail}", status)
    return RouterError(f"{where}: {message}{tail}", status)


class ChatAccumulator:
    """Consumes chunks of one streamed reply; yields deltas and builds the closing ``StreamEnd``."""

    def __init__(self) -> None:
        self.done = False  # saw data: [DONE]
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.timings: Timings | None = None
        self._text: list[str] = []
        # index -> [id, name, argument fragments]
        self._calls: dict[int, tuple[list[str], list[str], list[str]]] = {}

    @property
    def complete(self) -> bool:
        """The server said the reply is over ([DONE] or a finish_reason); otherwise it was cut off."""
        return self.done or self.finish_reason is not None

    def feed_event(self, event: SSEEvent) -> list[ContentDelta | ReasoningDelta]:
        """Consume one SSE event; ``[DONE]`` marks the end, errors raise ``RouterError``."""
        data = event.data
        if data == DONE_SENTINEL or data.strip() == DONE_SENTINEL:
            self.done = True
            return []
        try:
            chunk = json.loads(data)
        except ValueError:
            if event.event == "error":
                raise error_from_body(data, prefix="the model server failed mid-reply") from None
            raise RouterError(f"the model server sent a chunk that is not JSON: {data[:120]!r}") from None
        if event.event == "error":
            # The legacy error field carries the error object itself, not {"error": ...}.
            body = chunk if isinstance(chunk, dict) and "error" in chunk else {"error": chunk}
            raise error_from_body(body, prefix="the model server failed mid-reply")
        if not isinstance(chunk, dict):
            raise RouterError(f"the model server sent a chunk that is not a JSON object: {data[:120]!r}")
        if "\\u" in data and SURROGATE_ESCAPE.search(data):
            chunk = without_lone_surrogates(chunk)  # a lone one could be neither sent on nor stored
        try:
            return self.feed(chunk)
        except (AttributeError, TypeError, ValueError) as exc:  # a field of the wrong shape
            raise RouterError(f"the model server sent a malformed chunk ({exc}): {data[:120]!r}") from None

    def feed(self, chunk: dict[str, Any]) -> list[ContentDelta | ReasoningDelta]:
        """Consume one parsed chunk; return the text and reasoning deltas it carries."""
        if chunk.get("error"):
            raise error_from_body(chunk, prefix="the model server failed mid-reply")
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            prompt, completion = _count(usage.get("prompt_tokens") or 0), _count(usage.get("completion_tokens") or 0)
            if prompt is not None and completion is not None:  # else none at all: the daemon estimates
                self.usage = Usage(prompt, completion)
        if "timings" in chunk:
            # the last chunk's; earlier ones carry them only with timings_per_token
            self.timings = Timings.from_json(chunk["timings"]) or self.timings
        out: list[ContentDelta | ReasoningDelta] = []
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # we ask for n=1; other choices are not ours
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning and isinstance(reasoning, str):
                out.append(ReasoningDelta(reasoning))
            content = delta.get("content")
            if content and isinstance(content, str):
                self._text.append(content)
                out.append(ContentDelta(content))
            for position, call in enumerate(delta.get("tool_calls") or ()):
                self._add_call(position, call)
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        return out

    def _add_call(self, position: int, call: dict[str, Any]) -> None:
        index = call.get("index")
        call_id = call.get("id") or ""
        if not isinstance(index, int):
            # Some servers omit the index: a new id opens a call, otherwise it continues the last.
            known_ids = {parts[0][0] for parts in self._calls.values() if parts[0]}
            if not self._calls or (call_id and call_id not in known_ids):
                index = max(self._calls, default=-1) + 1
            else:
                index = max(self._calls)
        ids, names, arguments = self._calls.setdefault(index, ([], [], []))
        if call_id and not ids:
            ids.append(call_id)
        function = call.get("function") or {}
        name = function.get("name")
        # The name comes whole in one chunk, but some servers repeat it in every chunk.
        if name and "".join(names) != name:
            names.append(name)
        if function.get("arguments"):
            arguments.append(str(function["arguments"]))

    def tool_calls(self) -> list[ToolCall]:
        """The tool calls collected so far, in index order; a call without an id gets one."""
        calls = []
        for index in sorted(self._calls):
            ids, names, arguments = self._calls[index]
            calls.append(ToolCall(ids[0] if ids else f"call_{index}", "".join(names), "".join(arguments)))
        return calls

    def end(self) -> StreamEnd:
        """The ``StreamEnd`` summing up everything consumed."""
        return StreamEnd(self.finish_reason, self.tool_calls(), self.usage, "".join(self._text), self.timings)


async def parse_chat_stream(lines: AsyncIterable[str]) -> AsyncGenerator[StreamEvent, None]:
    """Parse a streamed chat completion; the last item is a ``StreamEnd``.

    Raises ``RouterError`` when the server reports an error mid-stream, and when
    the lines stop before ``[DONE]`` or a ``finish_reason`` (the server closed
    the reply mid-stream).
    """
    parser = SSEParser()
    accumulator = ChatAccumulator()
    async for line in lines:
        event = parser.feed(line)
        if event is None:
            continue
        for delta in accumulator.feed_event(event):
            yield delta
        if accumulator.done:
            break
    else:
        event = parser.flush()
        if event is not None:
            for delta in accumulator.feed_event(event):
                yield delta
    if not accumulator.complete:
        raise RouterError(
            "the model server closed the reply mid-stream (it may have crashed or been restarted); "
            "the partial reply is kept, ask again to continue"
        )
    yield accumulator.end()
