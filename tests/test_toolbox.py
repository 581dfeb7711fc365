"""The tool framework (core/tools.py) on its own: offering, calling, and what a failure
becomes; the argument and result helpers the tools share. No history, no HTTP: the
tools here touch nothing but their arguments."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from core.tools import (
    Tool,
    Toolbox,
    ToolContext,
    ToolError,
    ToolResult,
    fit_results,
    json_content,
    max_results_argument,
)

T = TypeVar("T")


class NoHistory:
    """A HistoryRunner for tools that must not touch history."""

    async def run(self, fn: Callable[[Any], T]) -> T:
        raise AssertionError("this tool was not meant to touch history")


def context() -> ToolContext:
    return ToolContext(conversation=1, history=NoHistory(), max_chars=20_000, vision=True, turn=2)


class Echo(Tool):
    name = "echo"
    description = "Echo the arguments."
    parameters = {"type": "object", "properties": {"say": {"type": "string"}}}

    def __init__(self, can: bool = True, failure: BaseException | None = None) -> None:
        self.can = can
        self.failure = failure
        self.calls: list[dict[str, Any]] = []

    async def available(self, ctx: ToolContext) -> bool:
        return self.can

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        self.calls.append(arguments)
        if self.failure is not None:
            raise self.failure
        return ToolResult(content=json.dumps(arguments), ok=True, summary="echoed")


class Broken(Echo):
    name = "broken"

    async def available(self, ctx: ToolContext) -> bool:
        raise RuntimeError("cannot tell")


class Shy(Echo):
    name = "shy"


def test_tool_names_must_be_unique() -> None:
    with pytest.raises(ValueError, match="share a name"):
        Toolbox([Echo(), Echo()])


@pytest.mark.asyncio
async def test_offer_keeps_only_available_tools(caplog: pytest.LogCaptureFixture) -> None:
    yes, broken, shy = Echo(), Broken(), Shy(can=False)
    toolbox = Toolbox([broken, yes, shy])
    with caplog.at_level(logging.ERROR, logger="core.tools"):
        offered = await toolbox.offer(context())
    assert offered == [yes]  # shy said no, broken failed its check
    assert "broken" in caplog.text and "cannot tell" in caplog.text


class Long(Echo):
    name = "long"
    description = "Echo the arguments, at length. " * 20


@pytest.mark.asyncio
async def test_a_room_holds_the_first_tools_that_fit_available_or_not() -> None:
    shy, long, echo = Shy(can=False), Long(), Echo()
    toolbox = Toolbox([shy, long, echo])
    assert long.tokens > shy.tokens + echo.tokens
    room = shy.tokens + echo.tokens  # the long one does not fit beside the first: skipped
    assert toolbox.fitting(room) == [shy, echo] and toolbox.fitting(None) == [shy, long, echo]
    # the shy one is not available, but it holds its place: what fits depends on the room alone,
    # so a tool that becomes available later never pushes out one offered before
    assert await toolbox.offer(context(), room) == [echo]
    shy.can = True
    assert await toolbox.offer(context(), room) == [shy, echo]
    assert await toolbox.offer(context(), 0) == []


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("raw", "expected"),
    [('{"say": "hi"}', {"say": "hi"}), ("", {}), (None, {}), ({"say": "as dict"}, {"say": "as dict"})],
)
async def test_call_passes_the_arguments(raw: Any, expected: dict[str, Any]) -> None:
    echo = Echo()
    result = await Toolbox([echo]).call([echo], "echo", raw, context())
    assert result.ok and echo.calls == [expected]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("name", "raw", "message"),
    [
        ("nope", "{}", "Error: there is no tool named 'nope'; the tools here are: echo"),
        ("echo", "{not json", "Error: the arguments are not valid JSON"),
        ("echo", "[1, 2]", "Error: the arguments must be a JSON object, not list"),
        ("echo", '"text"', "Error: the arguments must be a JSON object, not str"),
    ],
)
async def test_bad_calls_become_error_results(name: str, raw: str, message: str) -> None:
    echo = Echo()
    result = await Toolbox([echo]).call([echo], name, raw, context())
    assert not result.ok
    assert result.content.startswith(message)
    assert "\n" not in result.summary and name in result.summary
    assert echo.calls == []


@pytest.mark.asyncio
async def test_a_tool_not_offered_is_refused() -> None:
    echo = Echo()
    result = await Toolbox([echo]).call([], "echo", "{}", context())
    assert (result.ok, result.content) == (False, "Error: the tool echo is not available in this conversation")
    assert echo.calls == []


@pytest.mark.asyncio
async def test_tool_errors_and_crashes_become_error_results(
    caplog: pytest.LogCaptureFixture
) -> None:
    refusing = Echo(failure=ToolError("attachment_id is missing"))
    result = await Toolbox([refusing]).call([refusing], "echo", "{}", context())
    assert (result.ok, result.content) == (False, "Error: attachment_id is missing")

    crashing = Echo(failure=KeyError("boom"))
    with caplog.at_level(logging.ERROR, logger="core.tools"):
        result = await Toolbox([crashing]).call([crashing], "echo", "{}", context())
    assert not result.ok and result.content == "Error: the tool failed (KeyError: 'boom')"
    assert caplog.records[-1].exc_info is not None  # logged with its traceback


@pytest.mark.asyncio
async def test_cancellation_is_not_swallowed() -> None:
    cancelled = Echo(failure=asyncio.CancelledError())
    with pytest.raises(asyncio.CancelledError):
        await Toolbox([cancelled]).call([cancelled], "echo", "{}", context())


def test_max_results_is_clamped_not_refused() -> None:
    assert max_results_argument({}, 5, 20) == 5
    assert [max_results_argument({"max_results": n}, 5, 20) for n in (0, -3, 7, "7", 7.0, 50)] == [1, 1, 7, 7, 7, 20]
    with pytest.raises(ToolError, match="max_results must be an integer"):
        max_results_argument({"max_results": "many"}, 5, 20)


def test_the_weakest_results_give_way_to_fit() -> None:
    body: dict[str, Any] = {"results": [{"n": n, "text": "x" * 50} for n in range(5)], "query": "q", "total": 5}
    fitted = fit_results(body, 200)
    assert [r["n"] for r in fitted["results"]] == [0, 1] and fitted["total"] == 2
    assert len(json_content(fitted)) <= 200 and list(fitted) == list(body)
    assert body["total"] == 5 and len(body["results"]) == 5  # the caller's body is left as it was
    assert fit_results(body, 10) == {**body, "results": [], "total": 0}  # the frame alone may not fit
    assert fit_results(body, 10_000) == body
