"""The prompt of a turn, built to fit the model's context.

Order: one system message (the system prompt, the knowledge-base passages for
this question, then — once older turns are compacted — the list of files no
longer inline and the summary standing for those turns), the turns after the
summary (image references resolved from their files), then this turn's own
messages.

Compaction (seed 000 §3): when the prompt would pass ``compact_at`` of
``ctx_max``, the oldest turns but the last few are summarised by the model into
a stored summary that replaces them in the prompt; the turns themselves stay in
history and in the search index, where the recall tools reach them.  The summary
goes into the one system message because many chat templates refuse a second
one.  A prompt that still cannot fit is refused with ``context_overflow``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from attachments import resolve_image_refs
from history import AsyncHistory, Compaction, HistoryStore
from kbinject import KnowledgeBases
from recall import attachment_manifest, estimate_messages, estimate_text, plan_compaction, summarize, summary_message

from .config import Config
from .errors import AssistantError, ContextOverflow
from .router import ModelInfo, RouterClient

__all__ = ["ContextBuilder", "complete_exchanges", "router_messages"]

logger = logging.getLogger(__name__)

# keys we keep on stored messages that routers do not accept
PRIVATE_MESSAGE_KEYS = ("ok", "summary", "reasoning_content")
SUMMARY_TOKENS = 600  # the most a summary may take, so room is kept for it
KEEP_LAST_TURNS = 2  # never folded: the model needs the recent exchange verbatim
# after the router said the prompt overflowed, our estimate was wrong: fold all we may
FORCED_COMPACT_AT = 0.1

Progress = Callable[[str, str], None]


def router_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored messages as the router takes them: our bookkeeping keys removed."""
    return [{k: v for k, v in m.items() if k not in PRIVATE_MESSAGE_KEYS} for m in messages]


def complete_exchanges(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored turn as it can be replayed, ending with an answer of the model's.

    Tool calls whose results never came (a turn cut mid-tool) are dropped with any
    results of theirs, but the text said with them stays; so is an exchange of calls
    the model never answered. A turn left without any answer replays as nothing, so
    two user messages never follow each other.
    """
    answered = {m.get("tool_call_id") for m in messages if m.get("role") == "tool"}
    dropped: set[Any] = set()
    kept = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls and not all(c.get("id") in answered for c in calls):
            dropped.update(c.get("id") for c in calls)
            if message.get("content"):
                kept.append({k: v for k, v in message.items() if k != "tool_calls"})
            continue
        if message.get("role") == "tool" and message.get("tool_call_id") in dropped:
            continue
        kept.append(message)
    # a turn cut after its tool results but before the model answered them: the calls'
    # exchange is left out (results not followed by an answer break some templates)
    while kept and kept[-1].get("role") == "tool":
        kept.pop()
    if kept and kept[-1].get("tool_calls"):
        last = kept.pop()
        if last.get("content"):
            kept.append({k: v for k, v in last.items() if k != "tool_calls"})
    if kept and kept[-1].get("role") != "assistant":
        return []
    return kept


class ContextBuilder:
    """Builds prompts for one daemon; compacts conversations that outgrow the context."""

    def __init__(self, config: Config, history: AsyncHistory, router: RouterClient, kbs: KnowledgeBases) -> None:
        self.config = config
        self.history = history
        self.router = router
        self.kbs = kbs

    async def build(
        self,
        cid: int,
        turn: int,
        model: ModelInfo,
        current: list[dict[str, Any]],
        progress: Progress,
        kb: tuple[str, str] = ("", "off"),
        force: bool = False,
    ) -> list[dict[str, Any]]:
        """The prompt for turn ``turn``: earlier turns, then ``current`` (router form).

        ``kb`` is (the user's question, the conversation's ``kb_injection`` mode): linked
        knowledge bases are searched with it and the best passages put in the system
        message when the context allows (seed 000 §4). ``force`` compacts harder (the
        router said the last prompt overflowed) and raises ``ContextOverflow`` when
        nothing is left to fold.
        """
        compaction, turns = await self.history.run(lambda s: _earlier(s, cid, turn))
        image_tokens = self.config.image_tokens
        fixed = (
            estimate_text(self.config.system_prompt) + estimate_messages(current, image_tokens) + SUMMARY_TOKENS
        )
        sizes = [(n, estimate_messages(messages, image_tokens)) for n, messages in turns]
        compact_at = FORCED_COMPACT_AT if force else self.config.compact_at
        through = plan_compaction(sizes, fixed, model.ctx_max, compact_at, KEEP_LAST_TURNS)
        if through is None and force:
            raise ContextOverflow(
                f"this question does not fit {model.id}'s context of {model.ctx_max} tokens even after "
                "compacting; attach fewer or smaller files, or start a new conversation"
            )
        if through is not None:
            folded = [m for n, messages in turns if n <= through for m in messages]
            compaction = await self._compact(cid, model, compaction, folded, through, progress) or compaction
            turns = [(n, m) for n, m in turns if compaction is None or n > compaction.through_turn]
        parts = await self._system_parts(cid, turn, compaction, [n for n, _ in turns])
        earlier = router_messages(await resolve_image_refs([m for _, ms in turns for m in ms], vision=model.vision))

        def assemble() -> list[dict[str, Any]]:
            system = [{"role": "system", "content": "\n\n".join(parts)}] if parts else []
            return [*system, *earlier, *current]

        prompt = assemble()
        needed = estimate_messages(prompt, image_tokens)
        # after an overflow the estimate has proved low: no passages this time
        block = None if force else await self._knowledge(cid, kb, needed, model.ctx_max, progress)
        if block:
            parts.insert(1 if self.config.system_prompt else 0, block)  # right after the system prompt
            prompt = assemble()
            needed = estimate_messages(prompt, image_tokens)
        if model.ctx_max and needed > model.ctx_max:
            raise ContextOverflow(
                f"this turn needs about {needed} tokens but {model.id}'s context holds {model.ctx_max}; "
                "attach fewer or smaller files, or start a new conversation"
            )
        return prompt

    async def _compact(
        self,
        cid: int,
        model: ModelInfo,
        previous: Compaction | None,
        folded: list[dict[str, Any]],
        through: int,
        progress: Progress,
    ) -> Compaction | None:
        """Summarise turns up to ``through`` and store it; None (logged) if the model fails."""
        progress("compacting", f"summarising turns 1-{through} to make room")
        # what the summariser may read: its own context less the summary it writes
        room = max(model.ctx_max - SUMMARY_TOKENS, 1000) * 3 if model.ctx_max else None
        try:
            summary = await summarize(
                self.router, model.id, previous.summary if previous else None, folded, SUMMARY_TOKENS,
                max_input_chars=room,
            )
        except AssistantError as exc:
            logger.warning("compaction of conversation %d failed: %s", cid, exc.message)
            return None
        return await self.history.run(lambda s: s.add_compaction(cid, through, summary))

    async def _knowledge(
        self, cid: int, kb: tuple[str, str], ctx_used: int, ctx_max: int, progress: Progress
    ) -> str | None:
        """The knowledge-base block for this turn, if the mode, the links and the context allow."""
        query, mode = kb
        injection = await self.kbs.context_block(cid, query, mode, ctx_used, ctx_max)
        if injection.skipped_reason:
            progress("kb", injection.skipped_reason)
        elif injection.block:
            sources = sorted({hit.kb for hit in injection.hits})
            progress("kb", f"{len(injection.hits)} passage(s) from {', '.join(sources)}")
        if injection.note:
            logger.debug("kb: %s", injection.note)
        return injection.block

    async def _system_parts(
        self, cid: int, turn: int, compaction: Compaction | None, inline: list[int]
    ) -> list[str]:
        """The system message's parts: the prompt, then the file manifest and the summary."""
        parts = [self.config.system_prompt] if self.config.system_prompt else []
        if compaction is not None:
            attachments = await self.history.run(lambda s: s.attachments(cid))
            manifest = attachment_manifest(attachments, {*inline, turn})
            if manifest:
                parts.append(manifest)
            parts.append(summary_message(compaction.summary, compaction.through_turn)["content"])
        return parts


def _earlier(store: HistoryStore, cid: int, turn: int) -> tuple[Compaction | None, list[tuple[int, list[dict[str, Any]]]]]:
    """The latest compaction and the answered turns after it, in one trip to the store."""
    compaction = store.latest_compaction(cid)
    after = compaction.through_turn if compaction else 0
    return compaction, [(n, complete_exchanges(m)) for n, m in store.answered_turns(cid, turn, after)]
