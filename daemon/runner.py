"""One turn, from its question to ``done``: what ``TurnEngine`` runs once a turn is admitted.

The steps, each a method:

1. ``run``          the request's fields; the conversation (read before files are, else
                    in the same trip that stores the question); the model
2. ``_prepare``     attached files, refused before anything is stored or sent
3. ``_store_start`` the question is in history before the router hears of it
4. ``_converse``    the prompt (``context.ContextBuilder``), then rounds of streaming
                    with the router, running the model's tool calls between them
5. ``_finish``      the reply, however it ended, is stored; then ``done`` or ``error``

Nothing is lost: the question is stored before the router is asked, the streaming
reply is checkpointed every ``CHECKPOINT_SECONDS``, and a cancel, a router failure or
a shutdown stores what arrived.  A crash leaves the turn ``running``; the next start
marks it ``interrupted``.  On a full disk no turn starts (``disk_full``), and the
outcome of a running one that cannot be written is kept in memory by the history
(``AsyncHistory.finish``) and written once there is room; the client is told so.

The module is one piece (over 600 lines) because its steps share one ``TurnState``,
the turn's state machine; cut apart, the ways a turn can end would be read in two files.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from attachments import MAX_FILES, Prepared, budget_chars, prepare_files, too_many_files, user_content
from core import BUDGET_CHARS_PER_TOKEN, estimate_messages
from core.config import Config
from core.errors import (
    AssistantError,
    BadRequest,
    DiskFull,
    InternalError,
    RouterContextOverflow,
    RouterError,
    RouterUnreachable,
    no_conversation,
)
from core.models import display_name
from core.router import (
    ContentDelta,
    ModelInfo,
    ReasoningDelta,
    RouterClient,
    StreamEnd,
    StreamEvent,
    Timings,
    ToolCall,
    Usage,
)
from core.tools import Tool, Toolbox, ToolContext
from history import (
    AsyncHistory,
    Conversation,
    NewAttachment,
    Turn,
    TurnContext,
    TurnOutcome,
    TurnStatus,
    parse_arguments,
)
from kbinject import injection_mode

from .connection import Emit
from .context import ContextBuilder, Prompt, router_messages
from .protocol import Request, error_event
from .titles import make_title, provisional_title, title_prompt

if TYPE_CHECKING:
    from mcphost import McpHost  # loaded only when MCP servers are configured (daemon.server)

__all__ = ["Slot", "StopReason", "TurnRunner", "TurnState"]

logger = logging.getLogger(__name__)

CHECKPOINT_SECONDS = 1.0  # how often a streaming reply is saved against a crash
MAX_TOOL_ROUNDS = 8  # rounds of tool calls in one turn; then the model must answer
LAST_ROUND_NOTE = "You have made all the tool calls this question allows. Answer now with what you have."
NO_TOOLS_NOTE = "No tools can be called here. Answer in words, with what you know."
ROUND_SEPARATOR = "\n\n"  # between the text of two rounds around tool calls

StopReason = Literal["cancelled", "interrupted"]


@dataclass
class TurnState:
    """What one running turn has so far: enough to store it however it ends."""

    conversation: int
    turn: int
    model: ModelInfo
    messages: list[dict[str, Any]]  # this turn's messages as stored, the question first
    question: dict[str, Any]  # the question as the router gets it (images inline)
    kb: tuple[str, str]  # the question as typed and the kb_injection mode: what the KB search uses
    model_id: str = ""  # the model the turn was stored with (``model`` may still be the default)
    model_final: bool = True  # False: ``model`` is the default as listed, not yet asked about for this turn
    parts: list[str] = field(default_factory=list)  # the reply's deltas, joined on demand
    reasoning: str = ""
    usage: Usage | None = None
    timings: Timings | None = None  # the model server's figures of the last request (llama-server)
    unoffered: bool = False  # the last round called tools that were not offered
    prompt_estimate: int = 0
    ctx_used: int = 0
    round_start: int = 0  # where the current round's text begins in the reply
    prompt: list[dict[str, Any]] = field(default_factory=list)  # the last prompt sent: the title extends it
    tools: list[dict[str, Any]] | None = None  # the tools offered with it
    known: TurnContext | None = None  # what history held for the prompt before this turn (None: a new conversation)
    mcp: tuple[str, ...] = ()  # the MCP servers the conversation uses (its setting, else the default)
    last_checkpoint: float = field(default_factory=time.monotonic)
    checkpoint_timer: asyncio.TimerHandle | None = None

    @property
    def reply(self) -> str:
        """The reply so far (appending to a list keeps a long stream linear)."""
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""


@dataclass(eq=False)  # one per ask, told apart by identity (kept in sets)
class Slot:
    """A conversation's one turn, from the moment its ``ask`` is accepted."""

    task: asyncio.Task[Any]
    state: TurnState | None = None  # None until the question is stored
    storing: bool = False  # the question is on its way to the store: it will be there, whatever happens
    stop: StopReason | None = None  # set by cancel() or shutdown()
    finishing: bool = False  # its outcome is being stored: too late to stop, and it must not be cut


Spawn = Callable[[Any], "asyncio.Task[Any]"]
Claim = Callable[[int, "Slot"], None]


class TurnRunner:
    """Runs admitted turns: prepares, stores, converses with the router, finishes."""

    def __init__(
        self, config: Config, history: AsyncHistory, router: RouterClient, context: ContextBuilder,
        toolbox: Toolbox, *, spawn: Spawn, claim: Claim, mcp: McpHost | None = None,
    ) -> None:
        self.config = config
        self.history = history
        self.router = router
        self.context = context
        self.toolbox = toolbox
        self._spawn = spawn  # background work (checkpoints, titles) the engine keeps track of
        self._claim = claim  # a new conversation's slot, once it has an id
        self._no_tools: set[str] = set()  # models whose server refused the tools parameter
        self._titling: dict[int, asyncio.Task[Any]] = {}  # a conversation's title request under way
        self.mcp = mcp

    async def run(self, slot: Slot, request: Request, cid: int | None, emit: Emit, where: dict[str, Any]) -> None:
        """One ``ask`` from its fields to ``done``; refusals before the question is stored raise
        (``where`` then says which conversation and turn they concern)."""
        text: str = request.get("text", "")
        files: list[str] = request.get("files", [])
        chosen: str | None = request.get("model") or None
        system: str | None = request.get("system")  # a new conversation's own system prompt
        # the files' budget needs the conversation before they are read; for a plain question
        # the conversation is read in the same trip to the store that stores the question
        known = await self._read(cid, where) if cid is not None and files else None
        conv = known.conversation if known else None
        try:
            self._validate(text, files, cid, system)
            await self.history.ensure_room()  # a full disk refuses the turn before anything is asked
            # the model as far as it is known before the question is stored: named on the ask,
            # the conversation's own (read for files), else the default, which the conversation's
            # own may override: that one is not loaded (llama-swap would start it for nothing)
            final = chosen is not None or cid is None or known is not None
            # as last known when the model list is old: it is fetched again once the question is on its way
            model = await self.router.model_info(chosen or (conv.model if conv else None), load=final, stale_ok=True)
        except (RouterUnreachable, RouterError) as exc:
            # the question (and its files) are kept even when the router cannot be reached
            offline = ModelInfo(id=chosen or (conv.model if conv else None) or "", input_modalities=("text", "image"))
            prepared = await self._prepare(files, offline, conv, where, emit)
            slot.storing = True
            await self._store_failed(cid, text, prepared, exc, emit, chosen, system)
            return
        except AssistantError:
            if known is None and cid is not None:
                await self._read(cid, where)  # the refusal names the turn it would have been
            raise
        prepared = await self._prepare(files, model, conv, where, emit)  # a refusal: nothing stored or sent
        self.router.connect_ahead()  # the connection opens while the question is stored
        slot.storing = True
        state = await self._store_start(cid, text, prepared, model, chosen, final, system)
        slot.state = state
        self._claim(state.conversation, slot)
        where["conversation"], where["turn"] = state.conversation, state.turn
        emit(self._user_event(state.conversation, state.turn, text, prepared))
        await self._run(state, slot, emit)
        if cid is None and state.reply and self.config.auto_title:
            question = text or " ".join(p.name for p in prepared)
            answer = state.messages[-1].get("content") if state.messages[-1].get("role") == "assistant" else ""
            prompt = title_prompt(state.prompt, answer if isinstance(answer, str) else "", question, state.reply)
            cid = state.conversation
            task = self._titling[cid] = self._spawn(make_title(
                self.router, self.history, cid, state.model.id, prompt, question, state.tools if state.prompt else None
            ))
            task.add_done_callback(lambda _: self._titling.pop(cid, None))

    async def _read(self, cid: int, where: dict[str, Any]) -> TurnContext:
        """The conversation and what its prompt needs; sets the turn an error would name."""
        known = await self.context.read(cid)
        if known is None:
            raise no_conversation(cid)
        where["turn"] = known.conversation.turns + 1
        return known

    def _validate(self, text: str, files: list[str], cid: int | None, system: str | None) -> None:
        if cid is not None and system is not None:
            raise BadRequest(
                f"'system' sets a new conversation's system prompt; change conversation {cid}'s with the "
                "settings request"
            )
        if len(files) > MAX_FILES:
            raise too_many_files(len(files))
        if not text.strip() and not files:
            raise BadRequest("ask needs a question in 'text', or files")

    async def _prepare(
        self, files: list[str], model: ModelInfo, conv: Conversation | None, where: dict[str, Any], emit: Emit
    ) -> list[Prepared]:
        """Read the attached files within the text budget (docs/DESIGN.md, "Budgets"); refusals raise."""
        if not files:
            return []
        emit({"type": "progress", **where, "stage": "extracting", "detail": f"reading {len(files)} file(s)"})
        return await prepare_files(
            files, model=model.id, vision=model.vision, ctx_max=model.ctx_max, ctx_used=conv.ctx_used if conv else 0
        )

    @staticmethod
    def _user_event(cid: int, turn: int, text: str, prepared: list[Prepared]) -> dict[str, Any]:
        return {"type": "user", "conversation": cid, "turn": turn, "text": text,
                "files": [p.chip.to_json() for p in prepared]}

    async def _start_turn(
        self, cid: int | None, text: str, question: dict[str, Any], model: str | None,
        prepared: list[Prepared], chosen: str | None, default_model: str | None = None,
        system: str | None = None,
    ) -> tuple[Turn, TurnContext]:
        """Store the question (and its files' records) as a running turn, and read what its
        prompt needs, in one trip to the store.

        ``model`` None: the conversation's own model, else ``default_model``. ``chosen`` is
        the model the ask named: a new conversation keeps it as its own, and ``system`` as its
        system prompt.
        """
        chips = [p.chip.to_json() for p in prepared]
        title = provisional_title(text or " ".join(p.name for p in prepared))
        records = [
            NewAttachment(name=p.name, path=p.path, kind=p.kind, content_type=p.mime, size_bytes=p.size_bytes,
                          sha256=p.sha256 or "", pages=p.pages, full_text=p.full_text)
            for p in prepared
        ]
        known = self.context.replays.known(cid) if cid is not None else 0
        try:
            return await self.history.run(
                lambda s: s.begin_turn(cid, text, [question], chips, model, title, attachments=records,
                                       conversation_model=chosen, default_model=default_model, known=known,
                                       system_prompt=system)
            )
        except LookupError:  # missing, or deleted since it was read
            raise no_conversation(cid) from None

    @staticmethod
    def _questions(text: str, prepared: list[Prepared]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The user message for the router and for storage (images as image_ref parts)."""
        if not prepared:
            return {"role": "user", "content": text}, {"role": "user", "content": text}
        for_router, for_storage = user_content(text, prepared)
        return {"role": "user", "content": for_router}, {"role": "user", "content": for_storage}

    async def _store_start(
        self, cid: int | None, text: str, prepared: list[Prepared], model: ModelInfo, chosen: str | None,
        final: bool, system: str | None,
    ) -> TurnState:
        """Store the question; ``model`` is the one to use when ``final``, else the default, which
        the conversation's own model (known once it is read) overrides."""
        question, stored = self._questions(text, prepared)
        turn, known = await self._start_turn(
            cid, text, stored, model.id if final else None, prepared, chosen, default_model=model.id, system=system
        )
        conv = known.conversation
        mcp = self.config.mcp.chosen(conv.settings.get("mcp_servers")) if self.mcp else ()
        return TurnState(conversation=conv.id, turn=turn.turn, model=model, model_id=turn.model or model.id,
                         model_final=final,
                         messages=[stored], question=question, kb=(text, injection_mode(conv.settings)),
                         known=known, mcp=mcp)

    async def _store_failed(
        self, cid: int | None, text: str, prepared: list[Prepared], exc: AssistantError, emit: Emit,
        chosen: str | None, system: str | None,
    ) -> None:
        _question, stored = self._questions(text, prepared)
        turn, known = await self._start_turn(cid, text, stored, chosen, prepared, chosen, system=system)
        await self._fail(
            TurnState(conversation=known.conversation.id, turn=turn.turn, model=ModelInfo(chosen or ""),
                      messages=[stored], question=stored, kb=(text, "off")),
            exc, emit, prepared,
        )

    async def _fail(
        self, state: TurnState, exc: AssistantError, emit: Emit, prepared: list[Prepared] | None = None
    ) -> None:
        """End a stored turn that never reached the model: the question stays, with the error."""
        cid, turn = state.conversation, state.turn
        outcome = TurnOutcome(cid, turn, state.messages, "", "error", error=exc.message, error_code=exc.code)
        if not await self.history.finish(outcome):
            # the error stays what it was (the router was down, say), and says the disk is full too
            exc.message = f"{exc.message}; {self.history.kept_message()}"
        if prepared is not None:
            emit(self._user_event(cid, turn, state.kb[0], prepared))
        emit(error_event(exc, conversation=cid, turn=turn))

    async def _run(self, state: TurnState, slot: Slot, emit: Emit) -> None:
        """Converse, then store the outcome and send its event, whatever happened."""
        status: TurnStatus = "complete"
        failure: AssistantError | None = None
        foreign_cancel = False
        try:
            if slot.stop is not None:
                raise asyncio.CancelledError  # cancelled while it was starting
            if not state.model_final or state.model.id != state.model_id:
                # the model stored with the turn, the conversation's own or the default: as the router
                # tells of it (llama-swap loads it to say)
                state.model = await self.router.model_info(state.model_id, stale_ok=True)
            if (titling := self._titling.get(state.conversation)) is not None:
                # the title request holds the server's copy of this conversation (its slot): sent
                # beside it, the question would go to another slot and be read anew from its first
                # token, or queue behind it all the same (one slot). It is a few tokens long.
                await asyncio.wait([titling])
            finish_reason = await self._converse(state, emit)
        except asyncio.CancelledError:
            foreign_cancel = slot.stop is None  # not ours: someone is tearing the loop down
            status = finish_reason = slot.stop or "interrupted"
        except AssistantError as exc:
            # kept past this block without its traceback, which holds this frame (and so it):
            # a cycle that held the turn's whole state for the garbage collector
            status, finish_reason, failure = "error", None, exc.with_traceback(None)
        except Exception:
            logger.exception("turn %d of conversation %d failed", state.turn, state.conversation)
            status, finish_reason, failure = "error", None, InternalError()
        slot.finishing = True  # a cancel from here on would lose the outcome's event
        stored = await self._finish(state, status, finish_reason, failure)
        if stored is None:
            failure = DiskFull(self.history.kept_message())  # the reply waits in memory for room
        if failure is not None:
            emit(error_event(failure, conversation=state.conversation, turn=state.turn))
        else:
            emit(self._done_event(state, finish_reason))
        if stored is not None and stored.reply:  # replayed by the next prompt: made ready now
            self.context.remember(state.conversation, state.turn, stored.messages, state.model)
        if foreign_cancel:
            raise asyncio.CancelledError

    async def _converse(self, state: TurnState, emit: Emit) -> str | None:
        """Stream from the router; tool calls loop back in, at most MAX_TOOL_ROUNDS times.

        A router that says the prompt overflowed its context gets one harder
        compaction and one retry, as long as nothing has streamed yet.
        """
        where = {"conversation": state.conversation, "turn": state.turn}

        def progress(stage: str, detail: str) -> None:
            emit({"type": "progress", **where, "stage": stage, "detail": detail})

        known = state.known
        # what is offered depends on the conversation, not on the prompt: known first, so a
        # compaction's summary request can offer the same tools (the top of the cached prompt)
        ctx = ToolContext(
            conversation=state.conversation, turn=state.turn, history=self.history, vision=state.model.vision,
            max_chars=0, image_chars=state.model.image_tokens * BUDGET_CHARS_PER_TOKEN, kb_injection=state.kb[1],
            has_attachments=(known is not None and known.has_attachments) or has_files(state.messages[0]),
            kb_ids=known.kb_ids if known else None,
        )
        tools_work = state.model.tools and state.model.id not in self._no_tools
        offered = await self.toolbox.offer(ctx) if tools_work else []
        if tools_work and self.mcp is not None and state.mcp:
            offered += await self._hosted(state, progress)
        definitions = [t.definition() for t in offered] or None
        # hosted tools can be many and long: their definitions count in the prompt's estimate
        tool_tokens = sum(t.tokens for t in offered if t.server is not None)
        prompt = await self.context.build(
            state.conversation, state.turn, state.model, [state.question], progress, state.kb, known=known,
            tools=definitions, tool_tokens=tool_tokens,
        )
        state.prompt_estimate = prompt.tokens
        ctx = dataclasses.replace(ctx, max_chars=budget_chars(prompt.budget.ctx_max, prompt.tokens))
        said = False

        def waiting() -> None:
            # said once, when the first request has gone out (the router client calls it then):
            # the client's work on the event does not compete with the request on its way
            nonlocal said
            if not said:
                said = True
                progress("waiting", f"waiting for {display_name(state.model.id)}")

        for round_no in range(MAX_TOOL_ROUNDS + 1):
            tools = [t.definition() for t in offered] if offered and round_no < MAX_TOOL_ROUNDS else None
            if offered and tools is None:
                add_user_note(prompt.messages, LAST_ROUND_NOTE)
            try:
                end = await self._stream_round(state, prompt, tools, emit, waiting)
            except RouterContextOverflow as exc:
                if round_no or state.reply:
                    raise
                # the server said how big its context is: when that explains the refusal (we
                # thought the prompt bigger than that), a prompt built for the size fits; else
                # our estimate was low: fold all that may be folded, with no passages
                explained = exc.n_ctx is not None and prompt.tokens >= exc.n_ctx
                if exc.n_ctx is not None:
                    state.model = self.router.learn_context(state.model.id, exc.n_ctx)
                prompt = await self.context.build(
                    state.conversation, state.turn, state.model, [state.question], progress, state.kb,
                    force=not explained, known=known, tools=definitions, tool_tokens=tool_tokens,
                )
                end = await self._stream_round(state, prompt, tools, emit, waiting)
            state.prompt, state.tools = prompt.messages, tools
            if not end.tool_calls or tools is None:
                if state.unoffered and silent(state.messages[-1]):
                    # it called a tool nobody offered (or one past the last round) and said
                    # nothing: tell it so, once, and let it answer in words
                    state.messages.pop()
                    add_user_note(prompt.messages, NO_TOOLS_NOTE)
                    end = await self._stream_round(state, prompt, None, emit)
                    state.prompt, state.tools = prompt.messages, None
                return end.finish_reason
            append(prompt, router_messages(state.messages[-1:]), state.model)
            # the calls of a round share half of what is left of the context
            room = budget_chars(prompt.budget.ctx_max, prompt.tokens)
            ctx = dataclasses.replace(ctx, max_chars=room // len(end.tool_calls))
            append(prompt, await self._run_tools(state, offered, end.tool_calls, ctx, emit), state.model)
        raise AssertionError("the last round offers no tools")

    async def _hosted(self, state: TurnState, progress: Callable[[str, str], None]) -> list[Tool]:
        """The tools of the conversation's MCP servers, started as needed, within their share of
        the context (docs/DESIGN.md, "MCP"); a note when some are left out or a server is down."""
        assert self.mcp is not None
        room = int(self.context.budget(state.model).ctx_max * self.config.mcp.tools_share)
        hosted, note = await self.mcp.offer(state.mcp, room)
        if note:
            progress("tools", note)
        return list(hosted)

    async def _run_tools(
        self, state: TurnState, offered: list[Tool], calls: list[ToolCall], ctx: ToolContext, emit: Emit
    ) -> list[dict[str, Any]]:
        """Run one round's tool calls concurrently; their messages for the prompt."""
        where = {"conversation": state.conversation, "turn": state.turn}
        for call in calls:
            emit({"type": "progress", **where, "stage": "tool", "detail": f"running {call.name}"})
        results = await asyncio.gather(*(self.toolbox.call(offered, c.name, c.arguments, ctx) for c in calls))
        by_name = {t.name: t for t in offered}
        for_prompt: list[dict[str, Any]] = []
        images: list[dict[str, Any]] = []
        showing: list[str] = []
        for call, result in zip(calls, results):
            tool = by_name.get(call.name)
            # where the tool lives: an MCP server's name and its own name for the tool (ours: None, the name)
            server, own = (tool.server, tool.own_name) if tool else (None, call.name)
            message = {"role": "tool", "tool_call_id": call.id, "content": result.content,
                       "ok": result.ok, "summary": result.summary}
            if server is not None:
                message.update(server=server, tool=own)
            state.messages.append(message)
            for_prompt.extend(router_messages([message]))
            images.extend(image for image in result.images if image not in images)  # one showing is enough
            if result.images and call.name not in showing:
                showing.append(call.name)
            emit({"type": "tool", **where, "name": call.name, "server": server, "tool": own,
                  "arguments": parse_arguments(call.arguments), "ok": result.ok, "summary": result.summary})
        if images:
            # tool messages carry text only: a returned image is shown in a message of its own,
            # for this turn's prompt (history keeps the tool's text; the image is not stored)
            for_prompt.append({"role": "user", "content": [
                {"type": "text", "text": f"The image(s) the {' and '.join(showing)} tool returned:"}, *images]})
        return for_prompt

    async def _stream_round(
        self, state: TurnState, prompt: Prompt, tools: list[dict[str, Any]] | None, emit: Emit,
        sent: Callable[[], None] | None = None,
    ) -> StreamEnd:
        """One request and its streamed answer; ``sent`` is called when the request has gone out."""
        where = {"conversation": state.conversation, "turn": state.turn}
        round_start = state.round_start = len(state.reply)
        separate = bool(state.reply)  # a later round's text starts a new paragraph
        state.usage = None  # an earlier round's: one that ends without its own is estimated instead
        async for event in self._stream(state, prompt.messages, tools, prompt.max_tokens, sent):
            if isinstance(event, ContentDelta):
                text = ROUND_SEPARATOR + event.text if separate else event.text
                separate = False
                state.parts.append(text)
                emit({"type": "delta", **where, "text": text})
                self._checkpoint(state)
            elif isinstance(event, ReasoningDelta):
                state.reasoning += event.text
                emit({"type": "reasoning", **where, "text": event.text})
            elif isinstance(event, StreamEnd):
                state.usage = event.usage or state.usage
                calls = event.tool_calls if tools else []  # calls nobody offered are not run
                state.unoffered = bool(event.tool_calls) and not tools
                self._add_assistant(state, state.reply[round_start:].removeprefix(ROUND_SEPARATOR), calls)
                state.round_start = len(state.reply)  # this round's text is stored with its message
                state.timings = event.timings or state.timings
                return StreamEnd(event.finish_reason, calls, event.usage, event.text, event.timings)
        raise AssertionError("stream_chat ended without a StreamEnd")

    def _stream(
        self, state: TurnState, prompt: list[dict[str, Any]], tools: list[dict[str, Any]] | None, max_tokens: int,
        sent: Callable[[], None] | None,
    ) -> AsyncIterator[StreamEvent]:
        """The router's stream; a server that refuses ``tools`` is asked again without them."""
        if not tools:
            return self.router.stream_chat(state.model.id, prompt, None, sent=sent, max_tokens=max_tokens)
        return self._stream_with_tools(state, prompt, tools, max_tokens, sent)

    async def _stream_with_tools(
        self, state: TurnState, prompt: list[dict[str, Any]], tools: list[dict[str, Any]], max_tokens: int,
        sent: Callable[[], None] | None,
    ) -> AsyncIterator[StreamEvent]:
        started = False
        try:
            async for event in self.router.stream_chat(state.model.id, prompt, tools, sent=sent, max_tokens=max_tokens):
                started = True
                yield event
        except RouterError as exc:
            if started or not rejects_tools(exc):
                raise
            logger.warning("%s refused tools (%s); asking without them from now on", state.model.id, exc.message)
            self._no_tools.add(state.model.id)
            async for event in self.router.stream_chat(state.model.id, prompt, None, sent=sent, max_tokens=max_tokens):
                yield event

    def _add_assistant(self, state: TurnState, text: str, calls: list[ToolCall]) -> None:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        if state.reasoning:
            message["reasoning_content"] = state.reasoning
            state.reasoning = ""
        state.messages.append(message)

    def _checkpoint(self, state: TurnState) -> None:
        """Save the streaming reply at most every CHECKPOINT_SECONDS, and soon after the last delta."""
        if state.checkpoint_timer is not None:
            return  # a save is already due
        wait = state.last_checkpoint + CHECKPOINT_SECONDS - time.monotonic()
        loop = asyncio.get_running_loop()
        state.checkpoint_timer = loop.call_later(max(wait, 0.0), self._save_partial, state)

    def _save_partial(self, state: TurnState) -> None:
        state.checkpoint_timer = None
        state.last_checkpoint = time.monotonic()
        # not awaited: the store thread runs calls in order, so finish_turn lands after it
        self._spawn(self._write_partial(state.conversation, state.turn, state.reply))

    async def _write_partial(self, cid: int, turn: int, reply: str) -> None:
        try:
            await self.history.run(lambda s: s.save_partial(cid, turn, reply))
        except DiskFull:
            # the reply is in memory (the turn's state) and its outcome is kept if it cannot be
            # written either; a checkpoint only guards against a crash
            logger.debug("checkpoint of turn %d of conversation %d not written: disk full", turn, cid)

    async def _finish(
        self, state: TurnState, status: TurnStatus, finish_reason: str | None, exc: AssistantError | None = None
    ) -> TurnOutcome | None:
        """Store the turn's outcome, and return it; None when a full disk keeps it in memory for now."""
        if state.checkpoint_timer is not None:
            state.checkpoint_timer.cancel()
            state.checkpoint_timer = None
        messages = list(state.messages)
        if messages[-1].get("role") in ("user", "tool"):
            # the reply was cut before its round ended: keep what this round streamed
            text = state.reply[state.round_start :].removeprefix(ROUND_SEPARATOR)
            partial: dict[str, Any] = {"role": "assistant", "content": text}
            if state.reasoning:
                partial["reasoning_content"] = state.reasoning
            if text or state.reasoning:
                messages.append(partial)
        usage = state.usage
        ctx_used: int | None
        if usage is not None:
            ctx_used = usage.prompt_tokens + usage.completion_tokens
        elif len(messages) == 1:
            # no answer at all (stopped before the model said anything): later prompts leave
            # the turn out, so the conversation fills what it did before it
            ctx_used = None
        else:
            ctx_used = state.prompt_estimate + estimate_messages(messages[1:], state.model.image_tokens)
        known = state.known.conversation.ctx_used if state.known is not None else 0
        state.ctx_used = known if ctx_used is None else ctx_used
        outcome = TurnOutcome(
            state.conversation, state.turn, messages, state.reply, status, finish_reason=finish_reason,
            error=exc.message if exc else None, error_code=exc.code if exc else None,
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None, ctx_used=ctx_used,
        )
        # a second cancel (shutdown after a user's cancel) must not lose the write
        return outcome if await asyncio.shield(self.history.finish(outcome)) else None

    def _done_event(self, state: TurnState, finish_reason: str | None) -> dict[str, Any]:
        usage = state.usage
        return {
            "type": "done",
            "conversation": state.conversation,
            "turn": state.turn,
            "text": state.reply,
            "finish_reason": finish_reason,
            "usage": usage.to_json() if usage else {"prompt_tokens": None, "completion_tokens": None},
            "ctx_used": state.ctx_used,
            "ctx_max": state.model.ctx_max,
            "timings": state.timings.to_json() if state.timings else None,
        }


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
        exc, RouterContextOverflow
    )
