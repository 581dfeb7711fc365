"""The rounds of a turn: its prompt sent, the reply streamed, the model's tool calls run between.

``Rounds.converse`` offers the tools (ours, the MCP servers', an OpenAI client's own), builds
the prompt (``context.ContextBuilder``) and streams rounds with the router until the model
answers in words, at most ``MAX_TOOL_ROUNDS`` of tool calls; the calls of a round run in
``toolcalls``. A round streams in ``_stream_once``: each delta is an event and joins the
reply, which ``saving.TurnSaver`` checkpoints. What a server cannot do is worked around
here: one that refuses ``tools`` is asked again without them, a tool call it could not read
is asked once more without tools, a prompt it says overflowed is built again and sent once more.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from attachments import budget_chars
from core import BUDGET_CHARS_PER_TOKEN, MIN_TOOLS_CONTEXT, estimate_messages, estimate_text, estimate_tools
from core.config import Config
from core.errors import RouterContextOverflow, RouterError, RouterFormatError
from core.models import display_name, sampling_params
from core.router import (
    ContentDelta, ModelInfo, ReasoningDelta, RouterClient, StreamEnd, StreamEvent, ToolCall, call_in_text,
)
from core.tools import TOOL_GUIDANCE, Tool, Toolbox, ToolContext
from history import AsyncHistory
from kbinject import recall_mode

from . import events
from .approvals import Approvals, Asker, TurnGate
from .connection import Emit
from .context import ContextBuilder, Progress, Prompt, router_messages
from .live import Live
from .memory import memory_on
from .saving import ROUND_SEPARATOR, TurnSaver
from .toolcalls import run_tools
from .turnstate import TurnState

if TYPE_CHECKING:
    from mcphost import McpHost  # loaded only when MCP servers are configured (daemon.server)

__all__ = ["LAST_ROUND_NOTE", "MAX_TOOL_ROUNDS", "NO_TOOLS_NOTE", "UNREAD_CALL_NOTE", "Rounds", "has_files"]

logger = logging.getLogger(__name__)

# rounds of tool calls in one turn; the round after the last, and a round after one that only
# repeated earlier calls, is "closed": the tools stay in the request (they are part of the prompt's
# cached prefix) with ``tool_choice: none`` and LAST_ROUND_NOTE, so the turn ends with an answer
MAX_TOOL_ROUNDS = 8
# the share of the context the daemon's own tools' definitions may take: a small context holds
# the first of them that fit (``Toolbox.fitting``), and one under MIN_TOOLS_CONTEXT none: with the
# system message and a summary, even one would leave a compaction too little room for turns, and
# the conversation would compact (and be read again whole) on every turn (docs/DESIGN.md, "The
# tools' share of the context")
OWN_TOOLS_SHARE = 1 / 3
LAST_ROUND_NOTE = "You have made all the tool calls this question allows. Answer now with what you have."
NO_TOOLS_NOTE = "No tools can be called here. Answer in words, with what you know."
# a round whose tool call the server could not read is asked once more without tools, with this
UNREAD_CALL_NOTE = "Your tool call could not be read, and no tools can be called now. Answer in words, with what you know."
UNREAD_CALL_MESSAGE = (
    "the model wrote a tool call the model server could not read, and failed again when asked "
    "without tools ({detail}); ask again, perhaps in other words (a temperature of 0-0.3 helps small models)"
)


class Rounds:
    """Converses with the router for a turn: its rounds and the tool calls between them."""

    def __init__(
        self, config: Config, history: AsyncHistory, router: RouterClient, context: ContextBuilder, toolbox: Toolbox,
        live: Live, approvals: Approvals, saver: TurnSaver, mcp: McpHost | None, no_tools: set[str],
    ) -> None:
        self.config = config
        self.history = history
        self.router = router
        self.context = context
        self.toolbox = toolbox
        self.live = live
        self.approvals = approvals
        self.saver = saver  # checkpoints the streaming reply
        self.mcp = mcp
        self.no_tools = no_tools  # models whose server refused the tools parameter (shared across reloads)

    async def converse(self, state: TurnState, emit: Emit, asker: Asker | None) -> str | None:
        """Stream from the router; tool calls loop back in, at most MAX_TOOL_ROUNDS times."""
        progress = state.emit_progress(emit)
        settings = state.past.conversation.settings if state.past else {}
        state.sampling = {**sampling_params(self.config, state.model.id, settings), **state.overrides}
        offered, ctx = await self._offer(state, progress, asker)
        client = self._client_tools(state, offered)
        theirs = {tool["function"]["name"] for tool in client}
        # the chat template renders every definition into the prompt: ``build`` counts them all
        definitions = [*(t.definition() for t in offered), *client] or None
        # a turn taken up again had its passages when it began: none are added before its tool results
        build = partial(self.context.build, state.conversation, state.turn, current=[state.question, *state.client.resumed],
                        progress=progress, query=state.query, past=state.past,
                        kb_injection="off" if state.client.resumed else state.kb_injection,
                        recall=not state.client.resumed, tools=definitions)
        prompt = await build(state.model)
        state.prompt_estimate, state.sources = prompt.tokens, prompt.sources
        ctx = dataclasses.replace(ctx, max_chars=budget_chars(prompt.budget.ctx_max, prompt.tokens))
        def waiting() -> None:  # said by the router client when the first request has gone out
            progress("waiting", f"waiting for {display_name(state.model.id)}")

        closed = False
        for round_no in range(MAX_TOOL_ROUNDS + 1):
            closed = closed or round_no == MAX_TOOL_ROUNDS
            if offered and closed:
                add_user_note(prompt.messages, LAST_ROUND_NOTE)
            if round_no == 0:
                end, prompt = await self._first_round(state, prompt, definitions, emit, waiting, build)
            else:
                end = await self._stream_round(state, prompt, definitions, emit, closed=closed)
            if not end.tool_calls or closed:
                return await self._last_words(state, prompt, definitions, end, emit)
            append(prompt, router_messages(state.messages[-1:]), state.model)
            # the calls of a round share half of what is left of the context
            room = budget_chars(prompt.budget.ctx_max, prompt.tokens)
            ctx = dataclasses.replace(ctx, max_chars=room // len(end.tool_calls))
            ours = [call for call in end.tool_calls if call.name not in theirs]
            if ours:
                append(prompt, await run_tools(state, self.toolbox, offered, ours, ctx, emit), state.model)
            if len(ours) < len(end.tool_calls):  # the client runs its own, and sends their results back
                state.client.calls = [call for call in end.tool_calls if call.name in theirs]
                return "tool_calls"
            # a model that only repeats calls it made (each answered from its first result) is
            # looping: a small model given the same result again calls again (issue 33's runs)
            closed = state.calls is not None and state.calls.last_round_repeated
        raise AssertionError("the last round is closed")

    def _client_tools(self, state: TurnState, offered: list[Tool]) -> list[dict[str, Any]]:
        """An OpenAI client's own tools offered beside ours (one named as ours is not: ours runs)."""
        if not state.client.offered or not state.model.tools or state.model.id in self.no_tools:
            return []
        names = {tool.name for tool in offered}
        return [tool for tool in state.client.offered if tool["function"]["name"] not in names]

    async def _offer(self, state: TurnState, progress: Progress, asker: Asker | None) -> tuple[list[Tool], ToolContext]:
        """The tools this turn offers, and the context they run in (with the gate its calls of
        tools that may act wait at: ``asker`` decides them). What is offered depends on the
        conversation, not on the prompt: a compaction's summary request can offer the same tools
        (the top of the cached prompt)."""
        past = state.past
        gate = None if asker is None else TurnGate(
            state.conversation, state.turn, self.history, self.live, self.approvals, asker, state.approvals, progress)
        ctx = ToolContext(
            conversation=state.conversation, turn=state.turn, history=self.history, vision=state.model.vision,
            max_chars=0, image_chars=state.model.image_tokens * BUDGET_CHARS_PER_TOKEN,
            kb_injection=state.kb_injection,
            recall_injection=recall_mode(past.conversation.settings if past else None, self.config.recall_injection),
            has_attachments=(past is not None and past.has_attachments) or has_files(state.messages[0]),
            kb_ids=past.kb_ids if past else None, gate=gate,
            memory=memory_on(self.config, past.conversation if past else None),
        )
        if not state.model.tools or state.model.id in self.no_tools:
            return [], ctx
        offered = await self.toolbox.offer(ctx, self._own_room(state.model))
        if self.mcp is not None and state.mcp:
            room = int(self.context.budget(state.model).ctx_max * self.config.mcp.tools_share)
            hosted, note = await self.mcp.offer(state.mcp, room)  # docs/DESIGN.md, "MCP"
            if note:
                progress("tools", note)
            offered += hosted
        return offered, ctx

    def _own_room(self, model: ModelInfo) -> int:
        """Tokens the daemon's own tools' definitions may take of ``model``'s context."""
        ctx_max = self.context.budget(model).ctx_max
        return int(ctx_max * OWN_TOOLS_SHARE) if ctx_max >= MIN_TOOLS_CONTEXT else 0

    async def opening_tokens(self, model: ModelInfo, files: bool = False) -> int:
        """What a new conversation's first prompt holds before its question: the system message and
        the definitions of the tools it is offered, as ``converse`` offers them (``files``: the
        question carries files; MCP servers' tools only when running: an ``estimate`` starts none)."""
        ctx = ToolContext(conversation=0, turn=1, history=self.history, vision=model.vision, max_chars=0,
                          recall_injection=self.config.recall_injection, has_attachments=files,
                          memory=memory_on(self.config, None))
        usable = model.tools and model.id not in self.no_tools
        offered = await self.toolbox.offer(ctx, self._own_room(model)) if usable else []
        if usable and self.mcp is not None:  # as ``_offer`` adds them, with or without ours
            room = int(self.context.budget(model).ctx_max * self.config.mcp.tools_share)
            offered += self.mcp.running_tools(self.config.mcp.chosen(None), room)
        system = await self.context.instructions(None, bool(offered))
        return estimate_text(system) + estimate_tools([tool.definition() for tool in offered])

    async def _first_round(
        self, state: TurnState, prompt: Prompt, tools: list[dict[str, Any]] | None, emit: Emit,
        waiting: Callable[[], None], build: Callable[..., Awaitable[Prompt]],
    ) -> tuple[StreamEnd, Prompt]:
        """The first request; a router that says the prompt overflowed its context gets one
        prompt built again, harder, and one retry, as long as nothing has streamed yet."""
        try:
            return await self._stream_round(state, prompt, tools, emit, waiting), prompt
        except RouterContextOverflow as exc:
            if state.reply.text:
                raise
            # the server said how big its context is: when that explains the refusal (we thought
            # the prompt bigger than that), a prompt built for the size fits; else our estimate
            # was low: fold all that may be folded, with no passages
            explained = exc.n_ctx is not None and prompt.tokens >= exc.n_ctx
            if exc.n_ctx is not None:
                state.model = self.router.learn_context(state.model.id, exc.n_ctx)
            prompt = await build(state.model, force=not explained)
            state.sources = prompt.sources
            # the steps of a request start again: ``compacting`` and ``kb`` (when they happen) were
            # sent for the new prompt, so ``waiting`` is sent again as it leaves
            return await self._stream_round(state, prompt, tools, emit, waiting), prompt

    async def _last_words(
        self, state: TurnState, prompt: Prompt, tools: list[dict[str, Any]] | None, end: StreamEnd, emit: Emit
    ) -> str | None:
        """The turn's finish reason. A model that called a tool nobody offered (or one in a closed
        round) and said nothing is told so, once, and answers in words."""
        if state.unoffered and silent(state.messages[-1]):
            state.messages.pop()
            add_user_note(prompt.messages, NO_TOOLS_NOTE)
            end = await self._stream_round(state, prompt, tools, emit, closed=True)
        return end.finish_reason

    async def _stream_round(
        self, state: TurnState, prompt: Prompt, tools: list[dict[str, Any]] | None, emit: Emit,
        sent: Callable[[], None] | None = None, *, closed: bool = False,
    ) -> StreamEnd:
        """One round (``closed``: the tools are sent, not to be called); when the server could not
        read the tool call the model wrote (llama-server's "does not match the expected ...
        format"), the round is asked once more, closed. What the failed attempt streamed stays in
        the reply (the client has shown it)."""
        try:
            return await self._stream_once(state, prompt, tools, emit, sent, closed=closed)
        except RouterFormatError as exc:
            if not tools or closed:
                raise
            logger.warning("%s wrote a tool call the server could not read; asking without tools", state.model.id)
            add_user_note(prompt.messages, UNREAD_CALL_NOTE)
            try:
                return await self._stream_once(state, prompt, tools, emit, closed=True)
            except RouterFormatError as again:
                raise RouterFormatError(UNREAD_CALL_MESSAGE.format(detail=again.message), again.status) from exc

    async def _stream_once(
        self, state: TurnState, prompt: Prompt, tools: list[dict[str, Any]] | None, emit: Emit,
        sent: Callable[[], None] | None = None, *, closed: bool = False,
    ) -> StreamEnd:
        """One request and its streamed answer; ``sent`` is called when the request has gone out."""
        reply = state.reply
        round_start = reply.round_start = len(reply.text)
        separate = bool(reply.text)  # a later round's text starts a new paragraph
        reply.usage = None  # an earlier round's: one that ends without its own is estimated instead
        callable_tools = None if closed else tools
        async for event in self._stream(state, prompt, tools, sent, closed):
            if isinstance(event, ContentDelta):
                text = ROUND_SEPARATOR + event.text if separate else event.text
                separate = False
                reply.parts.append(text)
                emit(events.delta(state.conversation, state.turn, text))
                self.saver.checkpoint(state)
            elif isinstance(event, ReasoningDelta):
                reply.reasoning += event.text
                reply.shown += event.text
                emit(events.reasoning(state.conversation, state.turn, event.text))
            elif isinstance(event, StreamEnd):
                reply.usage = event.usage or reply.usage
                calls = event.tool_calls if callable_tools else []  # calls nobody offered are not run
                state.unoffered = bool(event.tool_calls) and not callable_tools
                text = reply.text[round_start:].removeprefix(ROUND_SEPARATOR)
                if callable_tools and not calls and (written := written_call(state, text, callable_tools)):
                    # the round's text was the call: the stored reply and its message hold the call
                    # (the client saw the text as deltas; the ``tool`` event says ``from_text``)
                    calls, text = [written], ""
                    reply.parts[:] = [reply.text[:round_start]]
                self._add_assistant(state, text, calls)
                reply.round_start = len(reply.text)  # this round's text is stored with its message
                reply.timings = event.timings or reply.timings
                state.prompt, state.tools = prompt.messages, tools  # what the title request extends
                return StreamEnd(event.finish_reason, calls, event.usage, event.text, event.timings)
        raise AssertionError("stream_chat ended without a StreamEnd")

    async def _stream(
        self, state: TurnState, prompt: Prompt, tools: list[dict[str, Any]] | None, sent: Callable[[], None] | None,
        closed: bool,
    ) -> AsyncIterator[StreamEvent]:
        """The router's stream; a server that refuses ``tools`` is asked again without them."""
        # a client's max_tokens may shorten the reply, never lengthen it past the room kept for the next question
        params: dict[str, Any] = {**state.sampling, "max_tokens": min(prompt.max_tokens, state.sampling.get(
            "max_tokens", prompt.max_tokens))}
        if closed and tools:
            params["tool_choice"] = "none"

        def chat(tools: list[dict[str, Any]] | None, sent: Callable[[], None] | None = sent) -> AsyncIterator[StreamEvent]:
            return self.router.stream_chat(state.model.id, prompt.messages, tools, sent=sent,
                                           encoded=prompt.encoded, **params)
        started = False
        try:
            async for event in chat(tools):
                started = True
                yield event
        except RouterError as exc:
            if started or not tools or not rejects_tools(exc):
                raise
            logger.warning("%s refused tools (%s); asking without them from now on", state.model.id, exc.message)
            self.no_tools.add(state.model.id)
            params.pop("tool_choice", None)
            without_guidance(prompt)  # as every later prompt of this model will be: the same prefix
            async for event in chat(None, sent=None):  # the refused request went out: ``sent`` was called
                yield event

    def _add_assistant(self, state: TurnState, text: str, calls: list[ToolCall]) -> None:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        if state.reply.reasoning:
            message["reasoning_content"] = state.reply.reasoning
            state.reply.reasoning = ""
        state.messages.append(message)


def written_call(state: TurnState, text: str, tools: list[dict[str, Any]]) -> ToolCall | None:
    """The call a round's whole text is, when the server returned none (``call_in_text``)."""
    offered = {tool["function"]["name"] for tool in tools}
    return call_in_text(text, offered, f"call_text_{len(state.messages)}")


def without_guidance(prompt: Prompt) -> None:
    """The prompt's system message without the tool-use guidance (a server that takes no tools
    is asked again without them, and without words about them)."""
    first = prompt.messages[0] if prompt.messages else {}
    content = first.get("content")
    if first.get("role") == "system" and isinstance(content, str) and content.endswith(f"\n\n{TOOL_GUIDANCE}"):
        prompt.messages[0] = {**first, "content": content.removesuffix(f"\n\n{TOOL_GUIDANCE}")}
        prompt.encoded = None  # the JSON made for the prompt's start holds the old system message


def silent(message: dict[str, Any]) -> bool:
    """Whether a stored assistant message says nothing at all (no text, reasoning or calls)."""
    return (message.get("role") == "assistant" and not message.get("content")
            and not message.get("reasoning_content") and not message.get("tool_calls"))


def has_files(question: dict[str, Any]) -> bool:
    """Whether a stored question carries files (its content is a list of parts then)."""
    return isinstance(question.get("content"), list)


def append(prompt: Prompt, messages: list[dict[str, Any]], model: ModelInfo) -> None:
    """Messages added to a round's prompt, counted as they come (estimates add up)."""
    prompt.messages.extend(messages)
    prompt.tokens += estimate_messages(messages, model.image_tokens)


def add_user_note(prompt: list[dict[str, Any]], note: str) -> None:
    """Tell the model ``note`` as the user, joining a user message already last (never two in a row)."""
    last = prompt[-1]
    if last.get("role") != "user":
        prompt.append({"role": "user", "content": note})
    elif isinstance(last["content"], list):
        last["content"] = [*last["content"], {"type": "text", "text": note}]
    else:
        last["content"] = f"{last['content']}\n\n{note}"


def rejects_tools(exc: RouterError) -> bool:
    """Whether the router refused the request because of ``tools`` (no tool support, or
    llama-server without --jinja): ask again without them."""
    return (exc.status in (400, 422, 500, 501)) and "tool" in exc.message.lower() and not isinstance(
        exc, (RouterContextOverflow, RouterFormatError)
    )
