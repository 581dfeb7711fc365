"""One turn, from its question to ``done``: what ``TurnEngine`` runs once an ``ask`` is admitted.

A turn is two steps, each a sequence of named steps below, so that the engine can mark a
new conversation busy the moment its question is stored:

``start``   the ask's fields → the conversation (read first only when files need its
            budget) → the model → the files (refused before anything is stored or sent)
            → the question stored → ``user``
``answer``  the rounds (``rounds.Rounds``: the tools offered, the prompt, rounds of
            streaming with the router, the model's tool calls run between them,
            ``toolcalls``) → the outcome stored (``saving.TurnSaver``) → ``done`` or
            ``error`` → a title for a new conversation

A turn an OpenAI client's tool calls ended is taken up again with their results
(``resume``): the door's concept, which the rounds see only as messages after the question.

Nothing is lost: the question is stored before the router is asked, the streaming
reply is checkpointed every ``CHECKPOINT_SECONDS``, and a cancel, a router failure or
a shutdown stores what arrived.  A crash leaves the turn ``running``; the next start
marks it ``interrupted``.  On a full disk no turn starts (``disk_full``), and the
outcome of a running one that cannot be written is kept in memory by the history
(``AsyncHistory.finish``) and written once there is room; the client is told so.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from attachments import Prepared, prepare_files
from core.config import Config
from core.errors import AssistantError, InternalError, RouterError, RouterUnreachable, no_conversation
from core.router import ModelInfo, RouterClient, Usage
from core.tools import Toolbox
from history import AsyncHistory, HistoryStore, Turn, TurnContext
from kbinject import injection_mode

from . import events
from .approvals import Approvals
from .background import Background
from .connection import Emit
from .context import ContextBuilder, router_messages
from .live import Live
from .rounds import Rounds
from .saving import TurnSaver, questions
from .titles import make_title, title_prompt
from .turnrequest import TurnRequest
from .turnstate import ClientTools, Outcome, Slot, StopReason, TurnState

if TYPE_CHECKING:
    from mcphost import McpHost  # loaded only when MCP servers are configured (daemon.server)

__all__ = ["Slot", "StopReason", "TurnRunner", "TurnState"]

logger = logging.getLogger(__name__)


class TurnRunner:
    """Runs admitted turns: starts them (the question stored), then answers them."""

    def __init__(
        self, config: Config, history: AsyncHistory, router: RouterClient, context: ContextBuilder,
        toolbox: Toolbox, background: Background, live: Live, approvals: Approvals, mcp: McpHost | None = None,
        *, no_tools: set[str] | None = None, titling: dict[int, asyncio.Task[Any]] | None = None,
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
        self._no_tools = set() if no_tools is None else no_tools  # models whose server refused the tools parameter
        self._titling = {} if titling is None else titling  # a conversation's title request under way
        self.saver = TurnSaver(history, context, background)
        self.rounds = Rounds(config, history, router, context, toolbox, live, approvals, self.saver, mcp,
                             self._no_tools)

    def renewed(self, config: Config, router: RouterClient, mcp: McpHost | None) -> TurnRunner:
        """A runner for a reloaded configuration, sharing what outlives one: the prompts held
        for the server's cache, the title requests under way, the models without tools."""
        context = ContextBuilder(config, self.history, router, self.context.kbs, self.context.readers)
        context.replays = self.context.replays
        return TurnRunner(config, self.history, router, context, self.toolbox, self.background, self.live,
                          self.approvals, mcp=mcp, no_tools=self._no_tools, titling=self._titling)

    # -- start: the question stored ---------------------------------------------------------

    async def start(self, slot: Slot, ask: TurnRequest, emit: Emit) -> TurnState | None:
        """The question stored and shown (``user``); None when it was stored as failed because
        the router could not be asked (the client is told). A refusal raises: nothing stored."""
        preset = ask.check(self.config.presets)
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
            ask = ask.with_preset(preset, prepared)
            slot.storing = True
            await self._store_failed(ask, prepared, exc, emit)
            return None
        prepared = await self._prepare(ask, model, past, emit)
        ask = ask.with_preset(preset, prepared)
        slot.storing = True
        state = await self._store_question(ask, prepared, model, final)
        emit(events.user(state.conversation, state.turn, ask.text, state.files, ask.ref))
        self._tell_started(state.past, state.turn, ask, state.files, state.model_id)
        self.saver.read_sent_pages(state.conversation, state.turn, prepared, state.stored)
        return state

    async def resume(self, slot: Slot, ask: TurnRequest, emit: Emit) -> TurnState:
        """The conversation's last turn, which ended on calls to the client's own tools, taken up
        again with their results (``ask.tool_results``): running, then answered as any turn."""
        ask.check(self.config.presets)
        assert ask.conversation is not None and ask.tool_results is not None
        model = await self.router.model_info(ask.model)
        cid = ask.conversation
        await self.history.ensure_room()
        slot.storing = True
        turn, past = await self.saver.reopen(cid)
        results = [{**result, "ok": True, "summary": "run by the client"} for result in ask.tool_results]
        messages = [*turn.messages, *results]
        client = ClientTools(ask.client_tools, resumed=router_messages(messages[1:]))
        state = self._state(ask, turn, past, model, messages, text_only(messages[0]), turn.text, client=client)
        state.reply.parts.append(turn.reply)
        emit(events.user(cid, turn.turn, turn.text, turn.files, turn.ref))
        self._tell_started(past, turn.turn, ask, turn.files, state.model_id)
        return state

    def _state(
        self, ask: TurnRequest, turn: Turn, past: TurnContext, model: ModelInfo, messages: list[dict[str, Any]],
        question: dict[str, Any], topic: str, *, client: ClientTools, final: bool = True,
    ) -> TurnState:
        """A turn's state once its question is stored (``turn``), before it is answered."""
        conv = past.conversation
        mcp = self.config.mcp.chosen(conv.settings.get("mcp_servers")) if self.mcp else ()
        return TurnState(conversation=conv.id, turn=turn.turn, model=model, model_id=turn.model or model.id,
                         model_final=final, messages=messages, question=question, query=turn.text, topic=topic,
                         kb_injection=injection_mode(conv.settings), new_conversation=ask.conversation is None,
                         past=past, mcp=mcp, files=turn.files, ref=turn.ref, started_at=turn.created_at,
                         overrides=ask.sampling, client=client)

    async def _store_question(self, ask: TurnRequest, prepared: list[Prepared], model: ModelInfo, final: bool) -> TurnState:
        """Store the question; ``model`` is the one to use when ``final``, else the default, which
        the conversation's own model (known once it is read) overrides."""
        question, stored = questions(ask.text, prepared)
        turn, past = await self.saver.begin(ask, prepared, stored, model.id if final else None, model.id)
        if (named := await self.saver.name_videos(past.conversation.id, turn.turn, prepared)) is not None:
            question, stored = questions(ask.text, named)  # stored whole when the turn is
        return self._state(ask, turn, past, model, [stored], question, ask.question(prepared),
                           client=ClientTools(ask.client_tools), final=final)

    async def _store_failed(self, ask: TurnRequest, prepared: list[Prepared], exc: AssistantError, emit: Emit) -> None:
        """Store a question the router could not be asked, with its error; then ``user`` and ``error``."""
        turn, past, saved = await self.saver.store_failed(ask, prepared, exc)
        cid, n = past.conversation.id, turn.turn
        updated_at = await self._updated_at(cid)  # read before user: the turn's events go out in one step
        emit(events.user(cid, n, ask.text, turn.files, ask.ref))
        self._tell_started(past, n, ask, turn.files, turn.model)
        self.saver.read_sent_pages(cid, n, prepared, None)
        failed = events.error_event(exc, conversation=cid, turn=n)
        emit(failed)
        self._tell_ended(failed, ask.ref, "error", saved, usage=None, ctx_used=past.conversation.ctx_used,
                         model=turn.model, updated_at=updated_at)

    def _tell_started(self, past: TurnContext | None, turn: int, ask: TurnRequest, files: list[dict[str, Any]],
                      model: str | None) -> None:
        """Tell the watchers of a question stored (and of the conversation it made)."""
        assert past is not None
        conv = past.conversation
        if ask.conversation is None:
            self.live.publish("conversation", "created", conversation=conv.id, title=conv.title, model=conv.model)
            if ask.memory is not None:  # its settings are not the defaults: incognito (docs/MEMORY.md)
                self.live.conversation_updated(conv)
        self.live.publish("turn", "started", conversation=conv.id, turn=turn, text=ask.text, files=files,
                          ref=ask.ref, model=model)

    async def _updated_at(self, cid: int) -> str | None:
        """The conversation's ``updated_at`` as stored now (None: deleted, or unreadable)."""
        try:
            conv = await self.history.run(HistoryStore.get_conversation, cid)
        except AssistantError:  # a full disk, a damaged file: the change is told all the same
            return None
        return conv.updated_at if conv else None

    def _tell_ended(self, end: dict[str, Any], ref: str | None, status: str, saved: bool, *,
                    usage: Usage | None, ctx_used: int, model: str | None, updated_at: str | None) -> None:
        """Tell the watchers how a turn ended, from its ``done`` or ``error`` event (``saved``
        False: a full disk keeps it in memory), with the model that answered and the
        conversation's ``updated_at`` as stored (a list is kept in order without a read)."""
        self.live.publish(
            "turn", "ended", conversation=end["conversation"], turn=end["turn"], ref=ref, status=status,
            finish_reason=end.get("finish_reason"), code=end.get("code"), usage=events.usage_json(usage),
            ctx_used=ctx_used, saved=saved, model=model, updated_at=updated_at,
        )

    async def _past(self, cid: int) -> TurnContext:
        """The conversation and what its prompt needs from history; ``not_found`` without it."""
        past = await self.context.read(cid)
        if past is None:
            raise no_conversation(cid)
        return past

    async def _prepare(self, ask: TurnRequest, model: ModelInfo, past: TurnContext | None, emit: Emit) -> list[Prepared]:
        """Read the attached files within the text budget (docs/DESIGN.md, "Budgets"); refusals raise."""
        if not ask.files:
            return []
        turn = past.conversation.turns + 1 if past else 1
        emit(events.progress(ask.conversation, turn, "extracting", f"reading {len(ask.files)} file(s)"))

        def reading(done: int, total: int) -> None:  # scanned pages (and images) read by tesseract
            emit(events.progress(ask.conversation, turn, "ocr", f"reading scanned pages by OCR: {done} of {total}",
                                 done=done, total=total))

        # a new conversation's prompt holds its system message and the tools' definitions first
        ctx_used = past.conversation.ctx_used if past else await self.rounds.opening_tokens(model, files=True)
        return await prepare_files(ask.files, self.context.readers, model=model.id, vision=model.vision,
                                   ctx_max=model.ctx_max, ctx_used=ctx_used, on_ocr=reading)

    # -- answer: the reply streamed and stored ----------------------------------------------

    async def answer(self, state: TurnState, slot: Slot, emit: Emit) -> None:
        """Converse, store the outcome and send its event, whatever happened; then a title for
        a new conversation's first reply."""
        outcome = await self._converse_guarded(state, slot, emit)
        slot.finishing = True  # a cancel from here on would lose the outcome's event
        try:
            saved = await self.saver.finish(state, outcome) is not None
        finally:
            state.stored.set()
        updated_at = await self._updated_at(state.conversation)  # before the end is sent: nothing waits between
        failure = outcome.failure
        if failure is not None:
            if not saved:  # the error stays what it was, and says the disk is full too
                failure.message = f"{failure.message}; {self.history.kept_message()}"
            end = events.error_event(failure, conversation=state.conversation, turn=state.turn)
        else:
            # a reply a full disk keeps in memory for now is done all the same: the client has
            # its usage and ctx_used, and ``saved: false`` says it is not on disk yet
            end = self._done_event(state, outcome.finish_reason, saved)
        emit(end)
        self.approvals.forget(state.conversation)
        self._tell_ended(end, state.ref, outcome.status, saved, usage=state.reply.usage, ctx_used=state.ctx_used,
                         model=state.model.id, updated_at=updated_at)
        if outcome.foreign_cancel:
            raise asyncio.CancelledError
        if state.new_conversation and state.reply.text and self.config.auto_title:
            self._title(state)

    async def _converse_guarded(self, state: TurnState, slot: Slot, emit: Emit) -> Outcome:
        """``Rounds.converse``, every way it can end made an ``Outcome``."""
        try:
            if slot.stop is not None:
                raise asyncio.CancelledError  # cancelled while it was starting
            await self._settle_model(state)
            return Outcome(finish_reason=await self.rounds.converse(state, emit, slot.asker))
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

    def _done_event(self, state: TurnState, finish_reason: str | None, saved: bool) -> dict[str, Any]:
        reply = state.reply
        return events.done(
            state.conversation, state.turn, reply.text, finish_reason, usage=reply.usage, ctx_used=state.ctx_used,
            ctx_max=state.model.ctx_max, timings=reply.timings, model=state.model.id, title=state.title, saved=saved,
            client_calls=state.client.calls, note=None if saved else self.history.kept_message(),
        )

    def _title(self, state: TurnState) -> None:
        """Ask the model for a title for a new conversation's first reply, in the background
        (the conversation's next question waits for it: ``_settle_model``)."""
        question = state.topic
        last = state.messages[-1]
        answer = last.get("content") if last.get("role") == "assistant" else ""
        prompt = title_prompt(state.prompt, answer if isinstance(answer, str) else "", question, state.reply.text)
        cid = state.conversation
        task = self._titling[cid] = self.background.spawn(make_title(
            self.router, self.history, cid, state.model.id, prompt, question, state.tools if state.prompt else None,
            renamed=self.live.conversation_updated,
        ))
        task.add_done_callback(lambda _: self._titling.pop(cid, None))


def text_only(question: dict[str, Any]) -> dict[str, Any]:
    """A stored question as the router takes it again without its files' images (a turn taken up
    again: the model saw them in its first request)."""
    content = question.get("content")
    if not isinstance(content, list):
        return {"role": "user", "content": content or ""}
    texts = [p for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return {"role": "user", "content": texts or ""}
