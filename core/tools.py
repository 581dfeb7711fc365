"""The model's tools: what each offers, and calling them so that a failure is an answer.

A ``Tool`` describes itself in the OpenAI ``tools`` format, says whether it can work in
this turn (``available``), and runs with the ``ToolContext`` of the turn: its own
conversation and nothing else, so no argument can reach another conversation.

``Toolbox.call`` never raises (``CancelledError`` aside): an unknown tool, one not offered
this turn, arguments that are not a JSON object or do not fit the tool's schema
(``argschema``: checked before the tool runs, the field named), a ``ToolError`` or any
exception in the tool all become an ``"Error: ..."`` result the model reads and can act
on, and the turn goes on (llm's ``execute_tool_calls``). Unexpected exceptions are logged with their
traceback; tool output never is.
"""

from __future__ import annotations

import asyncio
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from .argschema import ArgumentMismatch, check_arguments
from .jsontext import strict_loads
from .tokens import estimate_tools

__all__ = [
    "TOOL_GUIDANCE",
    "Approval",
    "Gate",
    "Tool",
    "ToolContext",
    "ToolError",
    "ToolResult",
    "Toolbox",
    "TurnCalls",
    "error_result",
    "fit_results",
    "integer_argument",
    "json_content",
    "max_results_argument",
    "max_results_parameter",
    "string_argument",
]

logger = logging.getLogger(__name__)

H = TypeVar("H")  # the history a tool reads: the daemon's ``history.AsyncHistory``

SUMMARY_MAX_CHARS = 120  # the one line the UI shows per call
MAX_INTEGER = 2**63 - 1  # SQLite's largest integer: no id or count beyond it
ERROR_PREFIX = "Error: "
# added to the system prompt whenever tools are offered, the same bytes every turn (the server's
# prompt cache): what a small model needs told (issue 33: without it, Qwen2.5-Coder-1.5B searched
# the conversation for "what is 12 times 12?" and called the same tool again and again)
TOOL_GUIDANCE = (
    "Call a tool only when the answer needs something not shown here (an earlier detail, a file's "
    "text, the user's documents), never for general knowledge, arithmetic or greetings. When a tool "
    "result arrives, answer from it; never repeat a call."
)
# what a call made a second time in one turn gets after its first result: small models call
# the same search again and again instead of answering from what it found (issue 33)
REPEAT_NOTE = (
    "You already made this exact call in this turn; the result above is the same as before. "
    "Do not call it again: answer the user from this result."
)
# what the model reads for a call that was not allowed to run, by who or what denied it
DECLINED = {
    "user": "the user declined this call",
    "timeout": "the user did not answer in time",
    "gone": "nobody was there to approve it",
    "cancel": "the user stopped the reply",
    "shutdown": "the assistant is stopping",
    "policy": "calls of this tool need a person's approval, and none can be asked here",
}
DECLINED_NOTE = "It did not run. Do not call it again: answer the user without it, saying what you would have done."
REPEAT_ERROR_NOTE = (
    "You already made this exact call in this turn and it failed the same way. Do not repeat it: "
    "change the arguments, or answer the user with what you have."
)


@dataclass
class ToolContext(Generic[H]):
    """What a tool may touch: its own conversation, nothing else.

    ``history`` is the daemon's ``history.AsyncHistory``, which this floor cannot name: a
    tool that reads it takes a ``ToolContext[AsyncHistory]``.
    """

    conversation: int
    history: H
    max_chars: int  # how much text one result may carry (what is left of the context)
    vision: bool  # whether the model can be shown images
    turn: int  # the turn being answered; turns 1..turn-1 are the earlier ones
    # the conversation's kb_injection setting (auto/tool_only/both/off): kb_search is
    # offered only under tool_only and both; None reads as the default, auto
    kb_injection: str | None = None
    # the conversation's recall_injection (auto/tool_only/off): off offers neither recall tool
    recall_injection: str | None = None
    # what the turn already read from history, so the offer needs no trip of its own (None: ask)
    has_attachments: bool | None = None
    kb_ids: list[int] | None = None
    image_chars: int = 0  # what showing one image takes of max_chars
    gate: Gate | None = None  # what lets a call of a tool that acts run; None: none runs
    memory: bool = False  # memory is on for this conversation: memory_save, conversation_search's scope "all"


class Gate(Protocol):
    """What decides whether a call of a tool that may act runs: a person asked, or a policy."""

    async def __call__(self, tool: Tool, arguments: dict[str, Any]) -> Approval:
        """The decision; ``CancelledError`` when the turn stops meanwhile."""


@dataclass
class ToolResult:
    """What a tool call gave: the text the model reads, and a line for the UI."""

    content: str  # JSON text, or "Error: ..." when ok is False
    ok: bool
    summary: str  # one line
    images: list[dict[str, Any]] = field(default_factory=list)  # image_url parts to show a vision model
    approval: Approval | None = None  # how a call of a tool that may act was let run, or stopped


@dataclass(frozen=True)
class Approval:
    """How a call of a tool that may act was decided, and by whom (docs/PROTOCOL.md, "Approval")."""

    allowed: bool
    # "user" (a client answered), "conversation" (the tool was approved for the conversation
    # earlier); denials also "timeout", "gone", "cancel", "shutdown", "policy"
    by: str
    at: str = ""  # when, ISO 8601 UTC
    remember: bool = False  # the user approved the tool for the rest of the conversation
    client: str | None = None  # the program that answered, when known

    def to_json(self) -> dict[str, Any]:
        return {"allowed": self.allowed, "by": self.by, "at": self.at, "remember": self.remember,
                "client": self.client}


class ToolError(Exception):
    """Bad arguments or a request the tool cannot serve; the message is for the model."""


def one_line(text: str, limit: int = SUMMARY_MAX_CHARS) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def json_content(value: Any) -> str:
    """A tool result as the JSON text the model reads (UTF-8 as is, compact)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def error_result(name: str, message: str) -> ToolResult:
    """The result that tells the model its call failed, and why."""
    return ToolResult(
        content=ERROR_PREFIX + message, ok=False, summary=one_line(f"{name} failed: {message}")
    )


class Tool(ABC):
    """One tool the model may call."""

    # class attributes for the daemon's own tools; a hosted MCP tool sets them per instance
    name: str
    description: str
    parameters: dict[str, Any]  # JSON Schema of the arguments object
    server: str | None = None  # the MCP server a hosted tool comes from; None for ours
    acts: bool = False  # a call waits for the turn's Gate (ours only read)
    annotations: dict[str, Any] | None = None  # what its server says of it (MCP ToolAnnotations)

    @property
    def own_name(self) -> str:
        """The tool's name where it lives (an MCP tool's name on its server, without the prefix)."""
        return self.name

    def definition(self) -> dict[str, Any]:
        """The tool in the OpenAI ``tools`` format."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    @property
    def tokens(self) -> int:
        """Tokens its definition takes in a prompt."""
        return estimate_tools([self.definition()])

    @abstractmethod
    async def available(self, ctx: ToolContext) -> bool:
        """Whether the tool can do anything useful in this turn."""

    @abstractmethod
    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Do the call; raise ``ToolError`` for arguments or requests it cannot serve."""


def parse_arguments(raw: str | dict[str, Any] | None) -> dict[str, Any]:
    """The call's arguments as a dict; ``ToolError`` unless they are a JSON object."""
    if isinstance(raw, dict):
        return raw
    if raw is None or not raw.strip():
        return {}  # models send "" for a call without arguments
    try:
        value = strict_loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ToolError(f"the arguments are not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(value, dict):
        raise ToolError(f"the arguments must be a JSON object, not {type(value).__name__}")
    return value


def integer_argument(arguments: dict[str, Any], key: str) -> int | None:
    """An integer argument (a numeric string too, as models often send); None if absent.

    Beyond SQLite's 64-bit integers no id, offset or count exists: such a number is
    refused here rather than overflow in the store.
    """
    value = arguments.get(key)
    if value is None:
        return None
    number: int | None = None
    if isinstance(value, bool):
        number = None
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            number = None
    elif isinstance(value, int):
        number = value
    if number is None:
        raise ToolError(f"{key} must be an integer, not {json_content(value)}")
    if not -MAX_INTEGER <= number <= MAX_INTEGER:
        raise ToolError(f"{key} {number} is out of range; use a value from the tool's results")
    return number


def string_argument(arguments: dict[str, Any], key: str) -> str | None:
    """A string argument; None if absent."""
    value = arguments.get(key)
    if value is None or isinstance(value, str):
        return value
    raise ToolError(f"{key} must be a string, not {json_content(value)}")


def max_results_parameter(default: int, maximum: int) -> dict[str, Any]:
    """The JSON Schema of a search tool's ``max_results`` argument."""
    return {"type": "integer", "description": f"Maximum results (1-{maximum}, default {default})"}


def max_results_argument(arguments: dict[str, Any], default: int, maximum: int) -> int:
    """The ``max_results`` argument clamped to 1..``maximum``; ``default`` when absent.

    Clamped rather than refused: a model asking for 50 results wants many, and gets
    the most the tool gives instead of a round trip to learn the limit.
    """
    wanted = integer_argument(arguments, "max_results")
    return default if wanted is None else max(1, min(maximum, wanted))


def fit_results(body: dict[str, Any], max_chars: int) -> dict[str, Any]:
    """``body`` with as many of its ``results`` as fit ``max_chars`` of JSON, ``total`` counting them.

    The results are best first, so the weakest give way when they do not all fit what
    is left of the context. The rest of the body is kept whole.
    """
    results = list(body["results"])
    fitted = {**body, "results": results, "total": len(results)}
    while len(json_content(fitted)) > max_chars and results:
        results.pop()
        fitted["total"] = len(results)
    return fitted


class Toolbox:
    """The daemon's tools; offers those that can work and runs the calls the model makes."""

    def __init__(self, tools: Sequence[Tool]) -> None:
        names = [tool.name for tool in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"two tools share a name: {names}")
        self.tools = list(tools)
        self._tokens = [tool.tokens for tool in self.tools]  # their definitions never change

    def fitting(self, room: int | None) -> list[Tool]:
        """The tools a context may carry, whose definitions take at most ``room`` tokens (None:
        all): in the toolbox's order, one that does not fit skipped. Every tool counts, available
        or not, so what fits depends on the room alone and the tools offered in a conversation
        only grow as they become available (docs/DESIGN.md, "The tools' share of the context")."""
        if room is None:
            return self.tools
        fitting, used = [], 0
        for tool, tokens in zip(self.tools, self._tokens, strict=True):
            if used + tokens <= room:
                fitting.append(tool)
                used += tokens
        return fitting

    async def offer(self, ctx: ToolContext, room: int | None = None) -> list[Tool]:
        """The tools available in this turn, of those ``room`` tokens hold (``fitting``), in the
        toolbox's order.

        A tool whose ``available`` fails is left out (and logged) rather than failing
        the turn.
        """
        offered = []
        for tool in self.fitting(room):
            try:
                if await tool.available(ctx):
                    offered.append(tool)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("tool %s: availability check failed; not offered", tool.name)
        return offered

    async def call(
        self, offered: Sequence[Tool], name: str, raw_arguments: str | dict[str, Any] | None, ctx: ToolContext
    ) -> ToolResult:
        """Run one call the model made; every failure becomes an error result."""
        tool = next((t for t in offered if t.name == name), None)
        if tool is None:
            if any(t.name == name for t in self.tools):
                return error_result(name, f"the tool {name} is not available in this conversation")
            known = ", ".join(t.name for t in offered) or "none"
            return error_result(name, f"there is no tool named {name!r}; the tools here are: {known}")
        try:
            arguments = check_arguments(tool.parameters, parse_arguments(raw_arguments))
            approval = await self._approval(tool, arguments, ctx)
            if approval is not None and not approval.allowed:
                return declined(name, approval)
            result = await tool.run(arguments, ctx)
            result.approval = approval
        except asyncio.CancelledError:
            raise
        except (ToolError, ArgumentMismatch) as exc:
            logger.debug("tool %s refused: %s", name, one_line(str(exc)))  # may quote the model's values
            return error_result(name, str(exc))
        except Exception as exc:
            logger.exception("tool %s failed", name)
            return error_result(name, f"the tool failed ({type(exc).__name__}: {exc})")
        logger.debug("tool %s: %s", name, result.summary)
        return result

    @staticmethod
    async def _approval(tool: Tool, arguments: dict[str, Any], ctx: ToolContext) -> Approval | None:
        """The decision on a call of a tool that may act (None: it only reads, nothing to decide)."""
        if not tool.acts:
            return None
        if ctx.gate is None:
            return Approval(allowed=False, by="policy")
        return await ctx.gate(tool, arguments)


def declined(name: str, approval: Approval) -> ToolResult:
    """The result of a call that was not allowed to run: the model is told why."""
    why = DECLINED.get(approval.by, "it was not allowed")
    return ToolResult(content=f"{ERROR_PREFIX}{why}. {DECLINED_NOTE}", ok=False, approval=approval,
                      summary=one_line(f"{name} not run: {why}"))


class TurnCalls:
    """The calls one turn has made: a call made again (same tool, same arguments) is not run
    again but answered from its first result, with a note telling the model to answer from it."""

    def __init__(self, toolbox: Toolbox) -> None:
        self.toolbox = toolbox
        self._first: dict[str, ToolResult] = {}  # call key -> its first result
        self.last_round_repeated = False  # every call of the last round had been made before

    @staticmethod
    def key(name: str, raw_arguments: str | dict[str, Any] | None) -> str:
        """The call as a key: its name and its arguments as sorted JSON (as sent, when they are not JSON)."""
        try:
            arguments: Any = parse_arguments(raw_arguments)
        except ToolError:
            arguments = raw_arguments
        return name + "\0" + json.dumps(arguments, sort_keys=True, ensure_ascii=False)

    async def run(
        self, offered: Sequence[Tool], calls: Sequence[tuple[str, str | dict[str, Any] | None]], ctx: ToolContext
    ) -> list[ToolResult]:
        """One round's calls: the new ones run concurrently (one of each when the round repeats
        itself), the ones made before answered from their first result; in the calls' order."""
        keys = [self.key(name, raw) for name, raw in calls]
        new = {key: call for key, call in zip(keys, calls) if key not in self._first}
        self.last_round_repeated = not new
        ran = await asyncio.gather(*(self.toolbox.call(offered, name, raw, ctx) for name, raw in new.values()))
        fresh = dict(zip(new, ran))
        results = []
        for key, (name, _raw) in zip(keys, calls):
            if key in fresh:
                result = self._first[key] = fresh.pop(key)
            else:
                result = repeated(name, self._first[key])
            results.append(result)
        return results


def repeated(name: str, first: ToolResult) -> ToolResult:
    """The answer to a call made again: the first result and a note to answer from it (images
    are not shown twice)."""
    note = REPEAT_NOTE if first.ok else REPEAT_ERROR_NOTE
    return ToolResult(content=f"{first.content}\n\n{note}", ok=first.ok,
                      summary=one_line(f"{name} repeated: answered from the first result"))
