"""One turn, from its question to ``done``: what ``TurnEngine`` runs once an ``ask`` is admitted.

A turn is two steps, each a sequence of named steps below, so that the engine can mark a
new conversation busy the moment its question is stored:

``start``   the ask's fields → the conversation (read first only when files need its
            budget) → the model → the files (refused before anything is stored or sent)
            → the question stored → ``user``
``answer``  the tools offered → the prompt (``context.ContextBuilder``) → rounds of
            streaming with the router, the model's tool calls run between them → the
            outcome stored → ``done`` or ``error`` → a title for a new conversation

Nothing is lost: the question is stored before the router is asked, the streaming
reply is checkpointed every ``CHECKPOINT_SECONDS``, and a cancel, a router failure or
a shutdown stores what arrived.  A crash leaves the turn ``running``; the next start
marks it ``interrupted``.  On a full disk no turn starts (``disk_full``), and the
outcome of a running one that cannot be written is kept in memory by the history
(``AsyncHistory.finish``) and written once there is room; the client is told so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from attachments import (
    MAX_FILES, Prepared, budget_chars, prepare_files, read_sent_pages, too_many_files, user_content,
)
from core import BUDGET_CHARS_PER_TOKEN, estimate_messages
from core.config import Config
from core.errors import (
    AssistantError,
    BadRequest,
    DiskFull,
    InternalError,
    RouterContextOverflow,
    RouterError,
    RouterFormatError,
    RouterUnreachable,
    no_conversation,
)
from core.models import display_name, sampling_params
from core.presets import Preset, find_preset
from core.sampling import SAMPLING_KEYS
from core.router import (
    ContentDelta, ModelInfo, ReasoningDelta, RouterClient, StreamEnd, StreamEvent, Timings, ToolCall, Usage, call_in_text,
)
from core.tools import TOOL_GUIDANCE, Tool, Toolbox, ToolContext, TurnCalls
from history import AsyncHistory, NewAttachment, Turn, TurnContext, TurnOutcome, TurnStatus, parse_arguments
from kbinject import injection_mode, recall_mode

from .approvals import Approvals, Asker, TurnGate
from .background import Background
from .connection import Emit
from .context import ContextBuilder, Progress, Prompt, router_messages
from .live import Live
from .protocol import Request, error_event
from .titles import make_title, provisional_title, title_prompt

if TYPE_CHECKING:
    from mcphost import McpHost  # loaded only when MCP servers are configured (daemon.server)

__all__ = ["Slot", "StopReason", "TurnRunner", "TurnState"]

logger = logging.getLogger(__name__)

CHECKPOINT_SECONDS = 1.0  # how often a streaming reply is saved against a crash
# rounds of tool calls in one turn; the round after the last, and a round after one that only
# repeated earlier calls, is "closed": the tools stay in the request (they are part of the prompt's
# cached prefix) with ``tool_choice: none`` and LAST_ROUND_NOTE, so the turn ends with an answer
MAX_TOOL_ROUNDS = 8
LAST_ROUND_NOTE = "You have made all the tool calls this question allows. Answer now with what you have."
NO_TOOLS_NOTE = "No tools can be called here. Answer in words, with what you know."
# a round whose tool call the server could not read is asked once more without tools, with this
UNREAD_CALL_NOTE = "Your tool call could not be read, and no tools can be called now. Answer in words, with what you know."
UNREAD_CALL_MESSAGE = (
    "the model wrote a tool call the model server could not read, and failed again when asked "
    "without tools ({detail}); ask again, perhaps in other words (a temperature of 0-0.3 helps small models)"
)
ROUND_SEPARATOR = "\n\n"  # between the text of two rounds around tool calls
MAX_REF_CHARS = 128  # an ask's ``ref``: a client's own id for it, stored with the question

StopReason = Literal["cancelled", "interrupted"]


@dataclass(frozen=True)
class Ask:
    """An ``ask`` request's fields."""

    text: str
    files: list[str]
    conversation: int | None  # None: a new conversation
    model: str | None  # the model the ask names
    system: str | None  # a new conversation's own system prompt
    ref: str | None = None  # the client's own reference, stored with the question
    overrides: dict[str, Any] = field(default_factory=dict)  # the turn's own sampling, over the settings'
    client_tools: list[dict[str, Any]] = field(default_factory=list)  # ``Request.client_tools``
    tool_results: list[dict[str, Any]] | None = None  # ``Request.tool_results``
    preset: Preset | None = None  # the preset whose prompt goes before ``text`` (core/presets.py)

    @classmethod
    def of(cls, request: Request, presets: Mapping[str, Preset]) -> Ask:
        named = request.get("preset")
        # a door's (``Request.overrides``), or the ask's own temperature and top_p
        sampling = {key: value for key in SAMPLING_KEYS if (value := request.get(key)) is not None}
        ask = cls(request.get("text", ""), request.get("files", []), request.get("conversation"),
                  request.get("model") or None, request.get("system"), request.get("ref"),
                  {**request.overrides, **sampling}, request.client_tools, request.tool_results,
                  find_preset(presets, named) if named is not None else None)
        if ask.tool_results is not None:
            if ask.conversation is None:
                raise BadRequest("tool results continue a conversation's last turn; name the conversation")
            return ask
        if ask.preset is not None and not ask.files:
            ask.preset.check([])
        if ask.ref is not None and len(ask.ref) > MAX_REF_CHARS:
            raise BadRequest(
                f"ask: 'ref' may have at most {MAX_REF_CHARS} characters, not {len(ask.ref)}; send a short "
                "reference of the client's own (a counter, a UUID)"
            )
        if ask.conversation is not None and ask.system is not None:
            raise BadRequest(
                f"'system' sets a new conversation's system prompt; change conversation {ask.conversation}'s with "
                "the settings request"
            )
        if len(ask.files) > MAX_FILES:
            raise too_many_files(len(ask.files))
        if not ask.text.strip() and not ask.files:
            raise BadRequest("ask needs a question in 'text', or files")
        return ask

    def question(self, prepared: list[Prepared]) -> str:
        """What the question is about in words: its text, else its files' names."""
        return self.text or " ".join(p.name for p in prepared)

    def with_preset(self, prepared: list[Prepared]) -> Ask:
        """The ask as sent: its preset's prompt before its text, once the files suit the preset
        (BadRequest naming the kinds otherwise)."""
        if self.preset is None:
            return self
        self.preset.check([(p.name, p.preset_kinds()) for p in prepared])
        return dataclasses.replace(self, text=self.preset.question(self.text), preset=None)


@dataclass
class TurnState:
    """What one running turn has so far: enough to store it however it ends."""

    conversation: int
    turn: int
    model: ModelInfo
    messages: list[dict[str, Any]]  # this turn's messages as stored, the question first
    question: dict[str, Any]  # the question as the router gets it (images inline)
    query: str  # the question as typed: what a knowledge-base search looks for
    topic: str  # the question in words: its text, else its files' names (what a title is made from)
    kb_injection: str  # the conversation's kb_injection mode
    new_conversation: bool = False  # the turn started its conversation
    files: list[dict[str, Any]] = field(default_factory=list)  # the question's chips, as ``user`` shows them
    ref: str | None = None  # the ask's ``ref``
    started_at: str = ""  # when the question was stored
    reasoning_shown: str = ""  # every reasoning delta of the turn, for a ``follow`` joining late
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
    sources: list[dict[str, Any]] = field(default_factory=list)  # the knowledge-base passages it carried
    past: TurnContext | None = None  # what history held for the prompt before this turn
    calls: TurnCalls | None = None  # the tool calls made so far (a repeated one is not run again)
    approvals: list[dict[str, Any]] = field(default_factory=list)  # how its calls of acting tools were decided
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p (and a door's stop, seed): sent when set
    overrides: dict[str, Any] = field(default_factory=dict)  # the ask's own sampling, over the settings'
    client_tools: list[dict[str, Any]] = field(default_factory=list)  # an OpenAI client's own, offered beside ours
    client_calls: list[ToolCall] = field(default_factory=list)  # the calls to them the turn ended on
    # a turn taken up again (``TurnRunner.resume``): its messages after the question, for the router
    resumed: list[dict[str, Any]] = field(default_factory=list)
    mcp: tuple[str, ...] = ()  # the MCP servers the conversation uses (its setting, else the default)
    stored: asyncio.Event = field(default_factory=asyncio.Event)  # set once its outcome is stored
    last_checkpoint: float = field(default_factory=time.monotonic)
    checkpoint_timer: asyncio.TimerHandle | None = None

    @property
    def reply(self) -> str:
        """The reply so far (appending to a list keeps a long stream linear)."""
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""

    @property
    def ctx_before(self) -> int:
        """The context the conversation filled before this turn."""
        return self.past.conversation.ctx_used if self.past is not None else 0

    @property
    def title(self) -> str | None:
        """The conversation's title as the turn began (None: it has none)."""
        if self.past is None:
            return None
        return self.past.conversation.title or None

    def emit_progress(self, emit: Emit) -> Progress:
        def progress(stage: str, detail: str, sources: list[dict[str, Any]] | None = None) -> None:
            event = {"type": "progress", "conversation": self.conversation, "turn": self.turn,
                     "stage": stage, "detail": detail}
            if sources is not None:
                event["sources"] = sources
            emit(event)
        return progress


@dataclass(eq=False)  # one per ask, told apart by identity (kept in sets)
class Slot:
    """A conversation's one turn, from the moment its ``ask`` is accepted."""

    task: asyncio.Task[Any]
    state: TurnState | None = None  # None until the question is stored
    storing: bool = False  # the question is on its way to the store: it will be there, whatever happens
    stop: StopReason | None = None  # set by cancel() or shutdown()
    finishing: bool = False  # its outcome is being stored: too late to stop, and it must not be cut
    # docs/PROTOCOL.md, "follow": other requests' emits that get the turn's events too
    followers: list[Emit] = field(default_factory=list)
    stage: str = "starting"  # the last progress stage, or "replying" once text streams after it
    started: asyncio.Event = field(default_factory=asyncio.Event)  # set once stored, or the ask ended
    ended: bool = False  # its done or error was sent
    asker: Asker | None = None  # decides its calls of tools that may act (daemon.approvals)

    def relay(self, emit: Emit) -> Emit:
        """``emit``, with each event also sent to the turn's followers (a copy each: every emit
        sets its own request's id)."""
        def relayed(event: dict[str, Any]) -> None:
            kind = event["type"]
            if kind == "progress":
                self.stage = event["stage"]
            elif kind in ("delta", "reasoning"):
                self.stage = "replying"
            for follower in self.followers:
                follower(dict(event))
            emit(event)
            if kind in ("done", "error") and self.state is not None:
                self.ended = True
                self.followers.clear()
        return relayed

    def following(self) -> dict[str, Any]:
        """The ``following`` event of the running turn: what it has so far, from memory."""
        state = self.state
        assert state is not None
        return {"type": "following", "conversation": state.conversation, "turn": state.turn, "text": state.query,
                "files": state.files, "ref": state.ref, "model": state.model_id, "stage": self.stage,
                "started_at": state.started_at, "reply": state.reply, "reasoning": state.reasoning_shown}


@dataclass
class Outcome:
    """How a turn's conversation with the router ended."""

    status: TurnStatus = "complete"
    finish_reason: str | None = None
    failure: AssistantError | None = None
    foreign_cancel: bool = False  # cancelled by someone tearing the loop down, not by a stop


class TurnRunner:
    """Runs admitted turns: starts them (the question stored), then answers them."""

    def __init__(
        self, config: Config, history: AsyncHistory, router: RouterClient, context: ContextBuilder,
        toolbox: Toolbox, background: Background, live: Live, approvals: Approvals, mcp: McpHost | None = None,
    ) -> None:
        self.config = config
        self.approvals = approvals  # the calls waiting for a person's answer
        self.live = live  # told of every conversation made and turn started or ended
        self.history = history
        self.router = router
        self.context = context
        self.toolbox = toolbox
        self.background = background  # checkpoints and titles, which the engine waits for or stops
        self.mcp = mcp
        self._no_tools: set[str] = set()  # models whose server refused the tools parameter
        self._titling: dict[int, asyncio.Task[Any]] = {}  # a conversation's title request under way

    def renewed(self, config: Config, router: RouterClient, mcp: McpHost | None) -> TurnRunner:
        """A runner for a reloaded configuration, sharing what outlives one: the prompts held
        for the server's cache, the title requests under way, the models without tools."""
        context = ContextBuilder(config, self.history, router, self.context.kbs)
        context.replays = self.context.replays
        runner = TurnRunner(config, self.history, router, context, self.toolbox, self.background, self.live,
                            self.approvals, mcp=mcp)
        runner._no_tools, runner._titling = self._no_tools, self._titling
        return runner

    # -- start: the question stored ---------------------------------------------------------

    async def start(self, slot: Slot, request: Request, emit: Emit) -> TurnState | None:
        """The question stored and shown (``user``); None when it was stored as failed because
        the router could not be asked (the client is told). A refusal raises: nothing stored."""
        ask = Ask.of(request, self.config.presets)
        if ask.tool_results is not None:
            return await self._resume(slot, ask, emit)
        past = await self._past(ask.conversation) if ask.conversation is not None and ask.files else None
        await self.history.ensure_room()  # a full disk refuses the turn before anything is asked
        # the model as far as it is known before the question is stored: named on the ask, the
        # conversation's own (read for files), else the default, which the conversation's own
        # may override: that one is not loaded (llama-swap would start it for nothing)
        final = ask.model is not None or ask.conversation is None or past is not None
        named = ask.model or (past.conversation.model if past else None)
        try:
            model = await self.router.model_info(named, load=final)
        except (RouterUnreachable, RouterError) as exc:
            # the question (and its files) are kept even when the router cannot be reached
            offline = ModelInfo(id=named or "", input_modalities=("text", "image"))
            prepared = await self._prepare(ask, offline, past, emit)
            ask = ask.with_preset(prepared)
            slot.storing = True
            await self._store_failed(ask, prepared, exc, emit)
            return None
        prepared = await self._prepare(ask, model, past, emit)
        ask = ask.with_preset(prepared)
        slot.storing = True
        state = await self._store_question(ask, prepared, model, final)
        emit(user_event(state.conversation, state.turn, ask.text, prepared, ask.ref))
        self._tell_started(state.past, state.turn, ask, state.files, state.model_id)
        self._read_sent_pages(state.conversation, state.turn, prepared, state.stored)
        return state

    async def _resume(self, slot: Slot, ask: Ask, emit: Emit) -> TurnState:
        """The conversation's last turn, which ended on calls to the client's own tools, taken up
        again with their results (``ask.tool_results``): running, then answered as any turn."""
        assert ask.conversation is not None and ask.tool_results is not None
        model = await self.router.model_info(ask.model)
        cid = ask.conversation
        await self.history.ensure_room()
        slot.storing = True
        try:
            turn, past = await self.history.reopen_turn(cid, self.context.replays.held_upto(cid))
        except LookupError:
            raise BadRequest(f"the last turn of conversation {cid} is not waiting for tool results; send the "
                             "results right after the assistant message that called the tools") from None
        results = [{**result, "ok": True, "summary": "run by the client"} for result in ask.tool_results]
        messages = [*turn.messages, *results]
        conv = past.conversation
        mcp = self.config.mcp.chosen(conv.settings.get("mcp_servers")) if self.mcp else ()
        state = TurnState(conversation=cid, turn=turn.turn, model=model, model_id=turn.model or model.id,
                          messages=messages, question=text_only(messages[0]), query=turn.text, topic=turn.text,
                          kb_injection=injection_mode(conv.settings), past=past, mcp=mcp, files=turn.files,
                          ref=turn.ref, started_at=turn.created_at, overrides=ask.overrides,
                          client_tools=ask.client_tools, parts=[turn.reply], resumed=router_messages(messages[1:]))
        emit({"type": "user", "conversation": cid, "turn": turn.turn, "text": turn.text, "files": turn.files,
              "ref": turn.ref})
        self._tell_started(past, turn.turn, ask, turn.files, state.model_id)
        return state

    def _tell_started(self, past: TurnContext | None, turn: int, ask: Ask, files: list[dict[str, Any]],
                      model: str | None) -> None:
        """Tell the watchers of a question stored (and of the conversation it made)."""
        assert past is not None
        conv = past.conversation
        if ask.conversation is None:
            self.live.publish("conversation", "created", conversation=conv.id, title=conv.title, model=conv.model)
        self.live.publish("turn", "started", conversation=conv.id, turn=turn, text=ask.text, files=files,
                          ref=ask.ref, model=model)

    def _tell_ended(self, end: dict[str, Any], ref: str | None, status: str, saved: bool, *,
                    usage: Usage | None, ctx_used: int) -> None:
        """Tell the watchers how a turn ended, from its ``done`` or ``error`` event (``saved``
        False: a full disk keeps it in memory)."""
        self.live.publish(
            "turn", "ended", conversation=end["conversation"], turn=end["turn"], ref=ref, status=status,
            finish_reason=end.get("finish_reason"), code=end.get("code"), usage=usage_json(usage),
            ctx_used=ctx_used, saved=saved,
        )

    async def _past(self, cid: int) -> TurnContext:
        """The conversation and what its prompt needs from history; ``not_found`` without it."""
        past = await self.context.read(cid)
        if past is None:
            raise no_conversation(cid)
        return past

    async def _prepare(self, ask: Ask, model: ModelInfo, past: TurnContext | None, emit: Emit) -> list[Prepared]:
        """Read the attached files within the text budget (docs/DESIGN.md, "Budgets"); refusals raise."""
        if not ask.files:
            return []
        turn = past.conversation.turns + 1 if past else 1
        emit({"type": "progress", "conversation": ask.conversation, "turn": turn, "stage": "extracting",
              "detail": f"reading {len(ask.files)} file(s)"})

        def reading(done: int, total: int) -> None:  # scanned pages (and images) read by tesseract
            emit({"type": "progress", "conversation": ask.conversation, "turn": turn, "stage": "ocr",
                  "detail": f"reading scanned pages by OCR: {done} of {total}", "done": done, "total": total})

        ctx_used = past.conversation.ctx_used if past else 0
        return await prepare_files(ask.files, model=model.id, vision=model.vision, ctx_max=model.ctx_max,
                                   ctx_used=ctx_used, on_ocr=reading)

    async def _begin(
        self, ask: Ask, prepared: list[Prepared], stored: dict[str, Any], model: str | None, default_model: str | None,
    ) -> tuple[Turn, TurnContext]:
        """Store the question (and its files' records) as a running turn, and read what its prompt
        needs, in one trip to the store: the turn, and what history held before it.

        ``model`` None: the conversation's own model, else ``default_model``. A new conversation
        keeps the model the ask named as its own, and the ask's ``system`` as its system prompt.
        """
        cid = ask.conversation
        records = [
            NewAttachment(name=p.name, path=p.path, kind=p.kind, content_type=p.mime, size_bytes=p.size_bytes,
                          sha256=p.sha256 or "", pages=p.pages, full_text=p.full_text)
            for p in prepared
        ]
        try:
            return await self.history.begin_turn(
                cid, ask.text, [stored], [p.chip.to_json() for p in prepared], model,
                provisional_title(ask.question(prepared)), attachments=records, conversation_model=ask.model,
                default_model=default_model, system_prompt=ask.system,
                held_upto=self.context.replays.held_upto(cid) if cid is not None else 0, ref=ask.ref,
            )
        except LookupError:  # missing, or deleted since it was read
            raise no_conversation(cid) from None

    async def _store_question(self, ask: Ask, prepared: list[Prepared], model: ModelInfo, final: bool) -> TurnState:
        """Store the question; ``model`` is the one to use when ``final``, else the default, which
        the conversation's own model (known once it is read) overrides."""
        question, stored = questions(ask.text, prepared)
        turn, past = await self._begin(ask, prepared, stored, model.id if final else None, model.id)
        conv = past.conversation
        mcp = self.config.mcp.chosen(conv.settings.get("mcp_servers")) if self.mcp else ()
        return TurnState(conversation=conv.id, turn=turn.turn, model=model, model_id=turn.model or model.id,
                         model_final=final, messages=[stored], question=question, query=ask.text,
                         topic=ask.question(prepared), kb_injection=injection_mode(conv.settings),
                         new_conversation=ask.conversation is None, past=past, mcp=mcp,
                         files=[p.chip.to_json() for p in prepared], ref=ask.ref, started_at=turn.created_at,
                         overrides=ask.overrides, client_tools=ask.client_tools)

    async def _store_failed(self, ask: Ask, prepared: list[Prepared], exc: AssistantError, emit: Emit) -> None:
        """Store a question the router could not be asked, with its error; then ``user`` and ``error``."""
        _question, stored = questions(ask.text, prepared)
        turn, past = await self._begin(ask, prepared, stored, ask.model, None)
        cid, n = past.conversation.id, turn.turn
        outcome = TurnOutcome(cid, n, [stored], "", "error", error=exc.message, error_code=exc.code)
        saved = await self.history.finish(outcome)
        if not saved:
            # the error stays what it was (the router was down, say), and says the disk is full too
            exc.message = f"{exc.message}; {self.history.kept_message()}"
        emit(user_event(cid, n, ask.text, prepared, ask.ref))
        self._tell_started(past, n, ask, [p.chip.to_json() for p in prepared], turn.model)
        self._read_sent_pages(cid, n, prepared, None)
        failed = error_event(exc, conversation=cid, turn=n)
        emit(failed)
        self._tell_ended(failed, ask.ref, "error", saved, usage=None, ctx_used=past.conversation.ctx_used)

    def _read_sent_pages(self, cid: int, turn: int, prepared: list[Prepared], stored: asyncio.Event | None) -> None:
        """Read by OCR, beside the reply, the scanned pages a vision model was sent as images, so
        that search and recall find their words (docs/DESIGN.md, "Attachments")."""
        for item in prepared:
            if item.read_later:
                self.background.spawn(self._keep_page_text(cid, turn, item, stored))

    async def _keep_page_text(self, cid: int, turn: int, item: Prepared, stored: asyncio.Event | None) -> None:
        """A file's pages read by OCR, kept with its turn once the turn is stored (whose outcome
        would write the question over them)."""
        full_text, pages = await read_sent_pages(item)
        if stored is not None:
            await stored.wait()
        if pages and item.sha256 is not None:
            await self.history.add_page_text(cid, turn, item.sha256, full_text, pages)

    # -- answer: the reply streamed and stored ----------------------------------------------

    async def answer(self, state: TurnState, slot: Slot, emit: Emit) -> None:
        """Converse, store the outcome and send its event, whatever happened; then a title for
        a new conversation's first reply."""
        outcome = await self._converse_guarded(state, slot, emit)
        slot.finishing = True  # a cancel from here on would lose the outcome's event
        try:
            saved = await self._finish(state, outcome) is not None
        finally:
            state.stored.set()
        failure = outcome.failure
        if failure is not None:
            if not saved:  # the error stays what it was, and says the disk is full too
                failure.message = f"{failure.message}; {self.history.kept_message()}"
            end = error_event(failure, conversation=state.conversation, turn=state.turn)
        else:
            # a reply a full disk keeps in memory for now is done all the same: the client has
            # its usage and ctx_used, and ``saved: false`` says it is not on disk yet
            end = self._done_event(state, outcome.finish_reason, saved)
        emit(end)
        self.approvals.forget(state.conversation)
        self._tell_ended(end, state.ref, outcome.status, saved, usage=state.usage, ctx_used=state.ctx_used)
        if outcome.foreign_cancel:
            raise asyncio.CancelledError
        if state.new_conversation and state.reply and self.config.auto_title:
            self._title(state)

    async def _converse_guarded(self, state: TurnState, slot: Slot, emit: Emit) -> Outcome:
        """``_converse``, every way it can end made an ``Outcome``."""
        try:
            if slot.stop is not None:
                raise asyncio.CancelledError  # cancelled while it was starting
            await self._settle_model(state)
            return Outcome(finish_reason=await self._converse(state, emit, slot.asker))
        except asyncio.CancelledError:
            reason = slot.stop or "interrupted"
            return Outcome(reason, reason, foreign_cancel=slot.stop is None)
        except AssistantError as exc:
            return Outcome("error", failure=exc)
        except Exception:
            logger.exception("turn %d of conversation %d failed", state.turn, state.conversation)
            return Outcome("error", failure=InternalError())

    async def _settle_model(self, state: TurnState) -> None:
        """The model the turn was stored with, as the router tells of it (llama-swap loads it to
        say); and no request beside the conversation's title request."""
        if not state.model_final or state.model.id != state.model_id:
            state.model = await self.router.model_info(state.model_id)
        if (titling := self._titling.get(state.conversation)) is not None:
            # the title request holds the server's copy of this conversation (its slot): sent
            # beside it, the question would go to another slot and be read anew from its first
            # token, or queue behind it all the same (one slot). It is a few tokens long.
            await asyncio.wait([titling])

    async def _converse(self, state: TurnState, emit: Emit, asker: Asker | None) -> str | None:
        """Stream from the router; tool calls loop back in, at most MAX_TOOL_ROUNDS times."""
        progress = state.emit_progress(emit)
        settings = state.past.conversation.settings if state.past else {}
        state.sampling = {**sampling_params(self.config, state.model.id, settings), **state.overrides}
        offered, ctx = await self._offer(state, progress, asker)
        client = self._client_tools(state, offered)
        theirs = {tool["function"]["name"] for tool in client}
        definitions = [*(t.definition() for t in offered), *client] or None
        # hosted tools can be many and long: their definitions count in the prompt's estimate
        tool_tokens = sum(t.tokens for t in offered if t.server is not None)
        # a turn taken up again had its passages when it began: none are added before its tool results
        build = partial(self.context.build, state.conversation, state.turn, current=[state.question, *state.resumed],
                        progress=progress, query=state.query, past=state.past,
                        kb_injection="off" if state.resumed else state.kb_injection, recall=not state.resumed,
                        tools=definitions, tool_tokens=tool_tokens)
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
                append(prompt, await self._run_tools(state, offered, ours, ctx, emit), state.model)
            if len(ours) < len(end.tool_calls):  # the client runs its own, and sends their results back
                state.client_calls = [call for call in end.tool_calls if call.name in theirs]
                return "tool_calls"
            # a model that only repeats calls it made (each answered from its first result) is
            # looping: a small model given the same result again calls again (issue 33's runs)
            closed = state.calls is not None and state.calls.last_round_repeated
        raise AssertionError("the last round is closed")

    def _client_tools(self, state: TurnState, offered: list[Tool]) -> list[dict[str, Any]]:
        """An OpenAI client's own tools offered beside ours (one named as ours is not: ours runs)."""
        if not state.client_tools or not state.model.tools or state.model.id in self._no_tools:
            return []
        names = {tool.name for tool in offered}
        return [tool for tool in state.client_tools if tool["function"]["name"] not in names]

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
        )
        if not state.model.tools or state.model.id in self._no_tools:
            return [], ctx
        offered = await self.toolbox.offer(ctx)
        if self.mcp is not None and state.mcp:
            room = int(self.context.budget(state.model).ctx_max * self.config.mcp.tools_share)
            hosted, note = await self.mcp.offer(state.mcp, room)  # docs/DESIGN.md, "MCP"
            if note:
                progress("tools", note)
            offered += hosted
        return offered, ctx

    async def _first_round(
        self, state: TurnState, prompt: Prompt, tools: list[dict[str, Any]] | None, emit: Emit,
        waiting: Callable[[], None], build: Callable[..., Awaitable[Prompt]],
    ) -> tuple[StreamEnd, Prompt]:
        """The first request; a router that says the prompt overflowed its context gets one
        prompt built again, harder, and one retry, as long as nothing has streamed yet."""
        try:
            return await self._stream_round(state, prompt, tools, emit, waiting), prompt
        except RouterContextOverflow as exc:
            if state.reply:
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

    async def _run_tools(
        self, state: TurnState, offered: list[Tool], calls: list[ToolCall], ctx: ToolContext, emit: Emit
    ) -> list[dict[str, Any]]:
        """Run one round's tool calls concurrently (one made before in this turn is answered from
        its first result: ``TurnCalls``); their messages for the prompt."""
        where = {"conversation": state.conversation, "turn": state.turn}
        acting = {t.name for t in offered if t.acts}
        for call in calls:  # one that may act says so once allowed (TurnGate)
            if call.name not in acting:
                emit({"type": "progress", **where, "stage": "tool", "detail": f"running {call.name}"})
        if state.calls is None:
            state.calls = TurnCalls(self.toolbox)
        results = await state.calls.run(offered, [(c.name, c.arguments) for c in calls], ctx)
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
                  "arguments": parse_arguments(call.arguments), "ok": result.ok, "summary": result.summary,
                  **({"from_text": True} if call.from_text else {}),
                  **({"approval": result.approval.to_json()} if result.approval else {})})
        if images:
            # tool messages carry text only: a returned image is shown in a message of its own,
            # for this turn's prompt (history keeps the tool's text; the image is not stored)
            for_prompt.append({"role": "user", "content": [
                {"type": "text", "text": f"The image(s) the {' and '.join(showing)} tool returned:"}, *images]})
        return for_prompt

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
        where = {"conversation": state.conversation, "turn": state.turn}
        round_start = state.round_start = len(state.reply)
        separate = bool(state.reply)  # a later round's text starts a new paragraph
        state.usage = None  # an earlier round's: one that ends without its own is estimated instead
        callable_tools = None if closed else tools
        async for event in self._stream(state, prompt, tools, sent, closed):
            if isinstance(event, ContentDelta):
                text = ROUND_SEPARATOR + event.text if separate else event.text
                separate = False
                state.parts.append(text)
                emit({"type": "delta", **where, "text": text})
                self._checkpoint(state)
            elif isinstance(event, ReasoningDelta):
                state.reasoning += event.text
                state.reasoning_shown += event.text
                emit({"type": "reasoning", **where, "text": event.text})
            elif isinstance(event, StreamEnd):
                state.usage = event.usage or state.usage
                calls = event.tool_calls if callable_tools else []  # calls nobody offered are not run
                state.unoffered = bool(event.tool_calls) and not callable_tools
                text = state.reply[round_start:].removeprefix(ROUND_SEPARATOR)
                if callable_tools and not calls and (written := written_call(state, text, callable_tools)):
                    # the round's text was the call: the stored reply and its message hold the call
                    # (the client saw the text as deltas; the ``tool`` event says ``from_text``)
                    calls, text = [written], ""
                    state.parts[:] = [state.reply[:round_start]]
                self._add_assistant(state, text, calls)
                state.round_start = len(state.reply)  # this round's text is stored with its message
                state.timings = event.timings or state.timings
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
            self._no_tools.add(state.model.id)
            params.pop("tool_choice", None)
            without_guidance(prompt)  # as every later prompt of this model will be: the same prefix
            async for event in chat(None, sent=None):  # the refused request went out: ``sent`` was called
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
        # not awaited: the store thread runs calls in order, so the outcome lands after it
        self.background.spawn(self._write_partial(state.conversation, state.turn, state.reply))

    async def _write_partial(self, cid: int, turn: int, reply: str) -> None:
        try:
            await self.history.save_partial(cid, turn, reply)
        except DiskFull:
            # the reply is in memory (the turn's state) and its outcome is kept if it cannot be
            # written either; a checkpoint only guards against a crash
            logger.debug("checkpoint of turn %d of conversation %d not written: disk full", turn, cid)

    async def _finish(self, state: TurnState, outcome: Outcome) -> TurnOutcome | None:
        """Store the turn's outcome, and return it; None when a full disk keeps it in memory for now."""
        if state.checkpoint_timer is not None:
            state.checkpoint_timer.cancel()
            state.checkpoint_timer = None
        messages = with_partial_round(state)
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
        state.ctx_used = state.ctx_before if ctx_used is None else ctx_used
        failure = outcome.failure
        stored = TurnOutcome(
            state.conversation, state.turn, messages, state.reply, outcome.status,
            finish_reason=outcome.finish_reason, error=failure.message if failure else None,
            error_code=failure.code if failure else None, prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None, ctx_used=ctx_used,
            sources=state.sources, approvals=state.approvals,
        )
        # a second cancel (shutdown after a user's cancel) must not lose the write
        return stored if await asyncio.shield(self.history.finish(stored)) else None

    def _done_event(self, state: TurnState, finish_reason: str | None, saved: bool) -> dict[str, Any]:
        usage = state.usage
        event = {
            "type": "done",
            "conversation": state.conversation,
            "turn": state.turn,
            "text": state.reply,
            "finish_reason": finish_reason,
            "usage": usage_json(usage),
            "ctx_used": state.ctx_used,
            "ctx_max": state.model.ctx_max,
            "timings": state.timings.to_json() if state.timings else None,
            "model": state.model.id,
            "title": state.title,
            "saved": saved,
        }
        if state.client_calls:  # the OpenAI door's client runs them (docs/PROTOCOL.md, "done")
            event["tool_calls"] = [call.to_openai() for call in state.client_calls]
        if not saved:
            event["note"] = self.history.kept_message()
        return event

    def _title(self, state: TurnState) -> None:
        """Ask the model for a title for a new conversation's first reply, in the background
        (the conversation's next question waits for it: ``_settle_model``)."""
        question = state.topic
        last = state.messages[-1]
        answer = last.get("content") if last.get("role") == "assistant" else ""
        prompt = title_prompt(state.prompt, answer if isinstance(answer, str) else "", question, state.reply)
        cid = state.conversation
        task = self._titling[cid] = self.background.spawn(make_title(
            self.router, self.history, cid, state.model.id, prompt, question, state.tools if state.prompt else None,
            renamed=lambda title: self.live.publish("conversation", "updated", conversation=cid, title=title),
        ))
        task.add_done_callback(lambda _: self._titling.pop(cid, None))


def written_call(state: TurnState, text: str, tools: list[dict[str, Any]]) -> ToolCall | None:
    """The call a round's whole text is, when the server returned none (``call_in_text``)."""
    offered = {tool["function"]["name"] for tool in tools}
    return call_in_text(text, offered, f"call_text_{len(state.messages)}")


def usage_json(usage: Usage | None) -> dict[str, Any]:
    """Usage as events show it: always an object, its counts null when the server said none."""
    return usage.to_json() if usage else {"prompt_tokens": None, "completion_tokens": None}


def without_guidance(prompt: Prompt) -> None:
    """The prompt's system message without the tool-use guidance (a server that takes no tools
    is asked again without them, and without words about them)."""
    first = prompt.messages[0] if prompt.messages else {}
    content = first.get("content")
    if first.get("role") == "system" and isinstance(content, str) and content.endswith(f"\n\n{TOOL_GUIDANCE}"):
        prompt.messages[0] = {**first, "content": content.removesuffix(f"\n\n{TOOL_GUIDANCE}")}
        prompt.encoded = None  # the JSON made for the prompt's start holds the old system message


def user_event(cid: int, turn: int, text: str, prepared: list[Prepared], ref: str | None) -> dict[str, Any]:
    return {"type": "user", "conversation": cid, "turn": turn, "text": text,
            "files": [p.chip.to_json() for p in prepared], "ref": ref}


def questions(text: str, prepared: list[Prepared]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The user message for the router and for storage (images as image_ref parts)."""
    if not prepared:
        return {"role": "user", "content": text}, {"role": "user", "content": text}
    for_router, for_storage = user_content(text, prepared)
    return {"role": "user", "content": for_router}, {"role": "user", "content": for_storage}


def with_partial_round(state: TurnState) -> list[dict[str, Any]]:
    """The turn's messages to store: when the reply was cut before its round ended, with what
    that round streamed."""
    messages = list(state.messages)
    if messages[-1].get("role") not in ("user", "tool"):
        return messages
    text = state.reply[state.round_start :].removeprefix(ROUND_SEPARATOR)
    partial_message: dict[str, Any] = {"role": "assistant", "content": text}
    if state.reasoning:
        partial_message["reasoning_content"] = state.reasoning
    if text or state.reasoning:
        messages.append(partial_message)
    return messages


def silent(message: dict[str, Any]) -> bool:
    """Whether a stored assistant message says nothing at all (no text, reasoning or calls)."""
    return (message.get("role") == "assistant" and not message.get("content")
            and not message.get("reasoning_content") and not message.get("tool_calls"))


def text_only(question: dict[str, Any]) -> dict[str, Any]:
    """A stored question as the router takes it again without its files' images (a turn taken up
    again: the model saw them in its first request)."""
    content = question.get("content")
    if not isinstance(content, list):
        return {"role": "user", "content": content or ""}
    texts = [p for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return {"role": "user", "content": texts or ""}


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
