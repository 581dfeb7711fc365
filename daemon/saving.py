"""Where a turn is saved: its question stored, its streaming reply checkpointed, its outcome stored.

``TurnSaver`` is the runner's one door to the store for a turn: ``begin`` stores the
question as a running turn (and reads what the prompt needs, in the same trip);
``checkpoint`` saves the streaming reply at most every ``CHECKPOINT_SECONDS`` against a
crash; ``finish`` stores the outcome, however the turn ended, with what the round cut
short had streamed. A full disk keeps an outcome in memory (``AsyncHistory.finish``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from attachments import Prepared, read_sent_pages, user_content
from core import estimate_messages
from core.errors import AssistantError, BadRequest, DiskFull, no_conversation
from history import AsyncHistory, HistoryStore, NewAttachment, NewTurn, Turn, TurnContext, TurnOutcome

from .background import Background
from .context import ContextBuilder
from .memory import memory_chars
from .titles import provisional_title
from .turnrequest import TurnRequest
from .turnstate import Outcome, TurnState

__all__ = ["CHECKPOINT_SECONDS", "ROUND_SEPARATOR", "TurnSaver", "questions"]

logger = logging.getLogger(__name__)

CHECKPOINT_SECONDS = 1.0  # how often a streaming reply is saved against a crash
ROUND_SEPARATOR = "\n\n"  # between the text of two rounds around tool calls


class TurnSaver:
    """Stores a turn: its question, checkpoints of its reply, its outcome."""

    def __init__(self, history: AsyncHistory, context: ContextBuilder, background: Background) -> None:
        self.history = history
        self.context = context  # its replay cache says how far the server holds a conversation
        self.background = background  # checkpoints and page texts, which the engine waits for or stops

    async def begin(
        self, ask: TurnRequest, prepared: list[Prepared], stored: dict[str, Any], model: str | None,
        default_model: str | None,
    ) -> tuple[Turn, TurnContext]:
        """Store the question (and its files' records) as a running turn, and read what its prompt
        needs, in one trip to the store: the turn, and what history held before it.

        ``model`` None: the conversation's own model, else ``default_model``. A new conversation
        keeps the model the ask named as its own, and the ask's ``system`` as its system prompt.
        """
        cid = ask.conversation
        records = [
            NewAttachment(name=p.name, path=p.path, kind=p.kind, content_type=p.mime, size_bytes=p.size_bytes,
                          sha256=p.sha256 or "", pages=p.pages, full_text=p.full_text, sent_whole=p.sent_whole)
            for p in prepared
        ]
        new = NewTurn(
            cid, ask.text, [stored], [p.chip.to_json() for p in prepared], model,
            provisional_title(ask.question(prepared)), attachments=records, conversation_model=ask.model,
            default_model=default_model, system_prompt=ask.system, ref=ask.ref,
        )
        held = self.context.replays.held_upto(cid) if cid is not None else 0
        try:
            chars = memory_chars(self.context.config, ask.memory if cid is None else None)
            turn, past = await self.history.run(HistoryStore.begin_turn, new, held, chars)
        except LookupError:  # missing, or deleted since it was read
            raise no_conversation(cid) from None
        if cid is None and ask.memory is not None:  # set before its first prompt reads memories
            conv = await self.history.run(HistoryStore.update_conversation, past.conversation.id,
                                          settings={"memory": ask.memory})
            if conv is not None:
                past = dataclasses.replace(past, conversation=conv)
        return turn, past

    async def store_failed(
        self, ask: TurnRequest, prepared: list[Prepared], exc: AssistantError,
    ) -> tuple[Turn, TurnContext, bool]:
        """Store a question the router could not be asked, with its error: the turn, what history
        held before it, and whether it is on disk (``exc`` says so when not)."""
        _question, stored = questions(ask.text, prepared)
        turn, past = await self.begin(ask, prepared, stored, ask.model, None)
        outcome = TurnOutcome(past.conversation.id, turn.turn, [stored], "", "error", error=exc.message,
                              error_code=exc.code)
        saved = await self.history.finish(outcome)
        if not saved:
            # the error stays what it was (the router was down, say), and says the disk is full too
            exc.message = f"{exc.message}; {self.history.kept_message()}"
        return turn, past, saved

    async def reopen(self, cid: int) -> tuple[Turn, TurnContext]:
        """The conversation's last turn, which ended on calls to an OpenAI client's own tools,
        running again; ``BadRequest`` when it did not."""
        try:
            return await self.history.run(HistoryStore.reopen_turn, cid, self.context.replays.held_upto(cid),
                                          memory_chars(self.context.config))
        except LookupError:
            raise BadRequest(f"the last turn of conversation {cid} is not waiting for tool results; send the "
                             "results right after the assistant message that called the tools") from None

    def read_sent_pages(self, cid: int, turn: int, prepared: list[Prepared], stored: asyncio.Event | None) -> None:
        """Read by OCR, beside the reply, the scanned pages a vision model was sent as images, so
        that search and recall find their words (docs/DESIGN.md, "Attachments")."""
        for item in prepared:
            if item.read_later:
                self.background.spawn(self._keep_page_text(cid, turn, item, stored))

    async def _keep_page_text(self, cid: int, turn: int, item: Prepared, stored: asyncio.Event | None) -> None:
        """A file's pages read by OCR, kept with its turn once the turn is stored (whose outcome
        would write the question over them)."""
        full_text, pages = await read_sent_pages(item, self.context.readers.ocr)
        if stored is not None:
            await stored.wait()
        if pages and item.sha256 is not None:
            await self.history.run(HistoryStore.add_page_text, cid, turn, item.sha256, full_text, pages)

    def checkpoint(self, state: TurnState) -> None:
        """Save the streaming reply at most every CHECKPOINT_SECONDS, and soon after the last delta."""
        due = state.checkpoint
        if due.timer is not None:
            return  # a save is already due
        wait = due.last + CHECKPOINT_SECONDS - time.monotonic()
        loop = asyncio.get_running_loop()
        due.timer = loop.call_later(max(wait, 0.0), self._save_partial, state)

    def _save_partial(self, state: TurnState) -> None:
        state.checkpoint.timer = None
        state.checkpoint.last = time.monotonic()
        # not awaited: the store thread runs calls in order, so the outcome lands after it
        self.background.spawn(self._write_partial(state.conversation, state.turn, state.reply.text))

    async def _write_partial(self, cid: int, turn: int, reply: str) -> None:
        try:
            await self.history.run(HistoryStore.save_partial, cid, turn, reply)
        except DiskFull:
            # the reply is in memory (the turn's state) and its outcome is kept if it cannot be
            # written either; a checkpoint only guards against a crash
            logger.debug("checkpoint of turn %d of conversation %d not written: disk full", turn, cid)

    async def finish(self, state: TurnState, outcome: Outcome) -> TurnOutcome | None:
        """Store the turn's outcome, and return it; None when a full disk keeps it in memory for now."""
        if state.checkpoint.timer is not None:
            state.checkpoint.timer.cancel()
            state.checkpoint.timer = None
        messages = with_partial_round(state)
        usage = state.reply.usage
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
            state.conversation, state.turn, messages, state.reply.text, outcome.status,
            finish_reason=outcome.finish_reason, error=failure.message if failure else None,
            error_code=failure.code if failure else None, prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None, ctx_used=ctx_used,
            sources=state.sources, approvals=state.approvals,
        )
        # a second cancel (shutdown after a user's cancel) must not lose the write
        written = await asyncio.shield(self.history.finish(stored))
        self.context.kbs.recall.note(state.conversation, state.turn)  # its messages get vectors, in the background
        return stored if written else None

    async def name_videos(self, cid: int, turn: int, prepared: list[Prepared]) -> list[Prepared] | None:
        """The question's files with each video's line naming its attachment id, known once the
        question is stored (docs/DESIGN.md, "Videos on a question"); None when it has no video."""
        if not any(p.kind == "video" for p in prepared):
            return None
        stored = await self.history.run(HistoryStore.attachments, cid)
        ids = iter([a.id for a in stored if a.turn == turn and a.kind == "video"])  # stored in the question's order
        return [p.with_attachment_id(next(ids)) if p.kind == "video" else p for p in prepared]


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
    reply = state.reply
    text = reply.text[reply.round_start :].removeprefix(ROUND_SEPARATOR)
    partial_message: dict[str, Any] = {"role": "assistant", "content": text}
    if reply.reasoning:
        partial_message["reasoning_content"] = reply.reasoning
    if text or reply.reasoning:
        messages.append(partial_message)
    return messages
