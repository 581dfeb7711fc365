"""The prompt of a turn, built to fit the model's context and to be reused by its server.

Layout (docs/DESIGN.md, "Prompt layout"):

    system     the system prompt; after a compaction also the files no longer
               inline and the summary standing for the folded turns
    earlier    the turns after the summary, as stored (image references resolved,
               a message over its share of the context cut to head and tail)
    this turn  the user message: this question's knowledge-base passages first,
               then the passages recalled from the conversation's archive (folded
               turns, files), then the question and its files; tool rounds append after it

A model server reuses the longest common prefix of consecutive prompts (llama-server's
prompt cache) and re-reads everything after the first changed byte.  So everything up
to the previous answer is the same bytes on every turn: the system message changes
only at a compaction, replayed turns are replayed from storage the same way every
time, and what belongs to one turn alone (passages, recalled images, the last-round
note) comes after the previous answer.  Passages go into the user message rather than
a second system message because many chat templates refuse a system message that is
not first, and they are not stored with the question: replaying every old question's
passages would spend the context on them.

Compaction: when the prompt would pass ``compact_at`` of the context (or the part a
prompt may take, ``Budget.prompt_limit``), the oldest turns but the last
``KEEP_LAST_TURNS`` are summarised into a stored summary; when that is not enough, the
last turns are folded too.  If the summary cannot be made, the oldest turns are left
out of this prompt instead.  History keeps everything whole.  Only a question that
cannot fit on its own is refused (``context_overflow``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from attachments import FileReaders
from core import (
    BUDGET_CHARS_PER_TOKEN,
    Budget,
    Config,
    estimate_messages,
    estimate_text,
    estimate_tools,
)
from core.errors import AssistantError, ContextOverflow, RouterContextOverflow, RouterError, RouterUnreachable
from core.jsontext import EncodedPrefix
from core.router import ModelInfo, RouterClient
from core.tools import TOOL_GUIDANCE
from history import MAX_TURN, AsyncHistory, Compaction, Conversation, HistoryStore, MemoryStore, TurnContext
from kbinject import ArchiveRecall, Hit, KnowledgeBases, Recall, recall_label, recall_mode
from recall import (
    IN_PLACE_REQUEST,
    attachment_manifest,
    plan_compaction,
    summarize,
    summarize_in_place,
    summary_message,
)

from .memory import frozen_block, memory_on
from .replay import ReplayCache, Replayed, encoded_prefix, router_messages

__all__ = ["ContextBuilder", "Prompt", "complete_exchanges", "recall_estimate", "router_messages", "with_passages"]

logger = logging.getLogger(__name__)

RECENT_MESSAGES = 4  # the messages whose words a short, back-referring question is searched with too
KEEP_LAST_TURNS = 2  # folded last: the model needs the recent exchange verbatim
COMPACT_TO = 0.5  # a compaction leaves the prompt at this share of the threshold, room for many turns
NO_SUMMARY = "{previous}(Later turns could not be summarised: conversation_search finds what was said in them.)"



class Progress(Protocol):
    """Where a turn's ``progress`` events go: a stage, a line for a person, and for ``kb`` the
    passages' sources (docs/PROTOCOL.md, "Knowledge bases")."""

    def __call__(self, stage: str, detail: str, sources: list[dict[str, Any]] | None = None) -> None: ...


def passage_source(hit: Hit) -> dict[str, Any]:
    """Where one injected passage comes from, as the ``kb`` progress and ``open`` show it."""
    return {"kb": hit.kb, "file": hit.document, "path": hit.path, "chunk": hit.chunk, "chunks": hit.chunks,
            "page": hit.page, "similarity": hit.similarity}


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


@dataclass(frozen=True)
class OutOfPrompt:
    """What of the conversation a prompt leaves out, for recall to search: turns 1..``through``
    (folded, or left out to fit; 0: none), and the files of any turn not in ``inline``, the
    turns whose question the prompt replays whole (a file its question carried whole is in it)."""

    through: int
    inline: frozenset[int]


@dataclass
class Prompt:
    """A prompt ready for the router: its messages, their estimated tokens and the context's shares."""

    messages: list[dict[str, Any]]
    tokens: int
    budget: Budget
    encoded: EncodedPrefix | None = None  # its first messages as JSON made once (the replayed turns)
    sources: list[dict[str, Any]] = field(default_factory=list)  # the knowledge-base passages it carries

    @property
    def max_tokens(self) -> int:
        """The reply's cap for this prompt (``max_tokens`` of the request)."""
        return self.budget.reply_tokens(self.tokens)


class ContextBuilder:
    """Builds prompts for one daemon; compacts conversations that outgrow the context."""

    def __init__(
        self, config: Config, history: AsyncHistory, router: RouterClient, kbs: KnowledgeBases, readers: FileReaders,
    ) -> None:
        self.config = config
        self.history = history
        self.router = router
        self.kbs = kbs
        self.readers = readers  # the files of a question are read with them, images resolved
        self.replays = ReplayCache(estimate_messages)
        self.archive = ArchiveRecall(history, vectors=kbs.recall)

    def budget(self, model: ModelInfo) -> Budget:
        return Budget(model.ctx_max or self.config.assumed_ctx, self.config.max_reply_tokens)

    async def read(self, cid: int) -> TurnContext | None:
        """The conversation and the turns answered since its last prompt (one trip to the store)."""
        return await self.history.run(HistoryStore.turn_context, cid, self.replays.held_upto(cid))

    async def build(
        self,
        cid: int,
        turn: int,
        model: ModelInfo,
        *,
        current: list[dict[str, Any]],
        progress: Progress,
        past: TurnContext | None = None,
        query: str = "",
        kb_injection: str = "off",
        tools: list[dict[str, Any]] | None = None,
        force: bool = False,
        recall: bool = True,
    ) -> Prompt:
        """The prompt for turn ``turn``: earlier turns, then ``current`` (router form).

        ``past`` is what history held before the turn was stored (``read``, or the trip that
        stored it). Linked knowledge bases are searched for ``query`` as ``kb_injection`` says,
        and the best passages put before the question when the context allows. ``tools`` are
        the definitions the turn offers: a compaction's summary request sends them too, so that
        it shares the prompt the server holds from the last turn. Their definitions count in the
        prompt's tokens: the chat template renders them into the prompt (docs/DESIGN.md, "The
        tools' share of the context"). ``force`` folds every earlier turn and adds no
        passages: the router said the last prompt overflowed, so our estimate was low; ``recall``
        False recalls nothing from the archive (docs/DESIGN.md, "Recall injection").
        """
        budget = self.budget(model)
        entry = await self._replayed(cid, turn, model, budget, past)
        instructions = await self.instructions(past.conversation if past else None, bool(tools),
                                               past.memories if past else None)
        own = estimate_messages([{"role": "system", "content": instructions}, *current], model.image_tokens)
        tool_tokens = estimate_tools(tools)
        own += tool_tokens
        if own > budget.prompt_limit:
            raise self._too_big(model, budget, own, current)
        system = entry.system
        if system is None or entry.system_prompt != instructions:  # settings changed it
            system = await self._system(entry, cid, instructions)
        through = self._plan(entry, own + budget.summary_tokens, budget, force)
        if through is not None:
            # after an overflow the server cannot take the conversation as it is: a transcript
            made = await self._compact(cid, model, budget, entry, through, progress, None if force else tools,
                                       in_place=not force)
            if made is not None:
                entry.fold(made)
                system = await self._system(entry, cid, instructions)
        earlier, tokens, encoded, out = await self._replay(entry, system, current, budget, model, cid, tool_tokens)
        prompt = [*system, *earlier, *current]
        if tokens > budget.prompt_limit:  # the summary and this question alone are too much
            raise self._too_big(model, budget, tokens, current)
        if force:  # after an overflow the estimate has proved low: no passages this time
            return Prompt(prompt, tokens, budget, encoded)
        blocks, sources = await self._passages(cid, turn, query, kb_injection, prompt, tokens, budget, past,
                                               progress, out if recall else None)
        if blocks:
            tokens += put_before_question(prompt, "\n\n".join(blocks), model.image_tokens)
        return Prompt(prompt, tokens, budget, encoded, sources)

    async def _passages(
        self, cid: int, turn: int, query: str, kb_injection: str, prompt: list[dict[str, Any]], tokens: int,
        budget: Budget, past: TurnContext | None, progress: Progress, out: OutOfPrompt | None,
    ) -> tuple[list[str], list[dict[str, Any]]]:
        """This turn's blocks of passages and their sources: the knowledge bases', then those
        recalled (docs/DESIGN.md, "Recall injection") when ``out`` is not None and the
        conversation's ``recall_injection`` is ``auto``: from what ``out`` says its archive leaves
        out of the prompt, and from the other conversations and memories when memory is on."""
        kb_ids = past.kb_ids if past else None
        block, sources = await self._knowledge(cid, query, kb_injection, tokens, budget.ctx_max, progress, kb_ids)
        blocks = [block] if block else []
        if out is None or past is None:
            return blocks, sources
        recalled = await recall_for(self.archive, self.config, past, turn, query, prompt, blocks, tokens,
                                    budget.passage_limit, out)
        tell_recalled(recalled, progress)
        if recalled.block:
            blocks.append(recalled.block)
            sources = [*sources, *recalled.sources]
        return blocks, sources

    async def _replayed(
        self, cid: int, turn: int, model: ModelInfo, budget: Budget, past: TurnContext | None
    ) -> Replayed:
        """The conversation's replayed turns before ``turn``: those held, and those answered since."""
        compaction = past.compaction if past else None
        after = compaction.through_turn if compaction else 0
        held_for = (budget.ctx_max, model.vision, model.image_tokens)
        read_after = past.after if past else 0  # the turns ``past`` skipped: held when it was read
        entry = self.replays.get(cid, after, held_for, read_after)
        raw = past.earlier if past else []
        if entry is None:
            # what was read is the whole story only when it skipped nothing and nothing was
            # held (a held entry for another context size may have compacted since)
            if read_after > 0 or self.replays.holds(cid):
                compaction, raw = await self.history.run(HistoryStore.replay_source, cid, turn)
            entry = self.replays.start(cid, compaction, held_for)
        self.replays.add(entry, [(n, complete_exchanges(m)) for n, m in raw], turn - 1, budget.replay_tokens)
        return entry

    def _plan(self, entry: Replayed, fixed: int, budget: Budget, force: bool) -> int | None:
        """The last turn to fold, or None: the oldest but the last few, or all when that is not enough."""
        turns = entry.turns
        if not turns:
            return None
        if force:
            return turns[-1].n
        share = min(self.config.compact_at, budget.prompt_limit / budget.ctx_max)
        if fixed + entry.tokens <= share * budget.ctx_max:
            return None
        sizes = [(t.n, t.tokens) for t in turns]
        # fold down to well under the threshold: compacting a little every turn would make
        # the server re-read the whole prompt every turn
        target = share * COMPACT_TO
        through = plan_compaction(sizes, fixed, budget.ctx_max, target, KEEP_LAST_TURNS)
        kept = sum(tokens for n, tokens in sizes if through is None or n > through)
        if fixed + kept > budget.prompt_limit:
            return plan_compaction(sizes, fixed, budget.ctx_max, target, 0)
        return through

    async def _replay(
        self,
        entry: Replayed,
        system: list[dict[str, Any]],
        current: list[dict[str, Any]],
        budget: Budget,
        model: ModelInfo,
        cid: int,
        fixed: int = 0,
    ) -> tuple[list[dict[str, Any]], int, EncodedPrefix, OutOfPrompt]:
        """The earlier turns in router form, the whole prompt's tokens, the JSON its start
        is made of, and what is out of the prompt (the last turn folded or left out, the turns
        replayed whole); the oldest turns are left out while the prompt cannot fit.

        Leaving turns out happens only when a compaction fell short: it changes the
        prompt's start on every turn, which a summary does once.
        """
        own = estimate_messages([*system, *current], model.image_tokens) + fixed
        room = budget.prompt_limit - own
        turns = entry.turns
        total = entry.tokens
        skip = 0
        while skip < len(turns) and total > room:
            total -= turns[skip].tokens
            skip += 1
        if skip:
            logger.warning("conversation %d: %d earlier turn(s) left out of the prompt to fit %s's context",
                           cid, skip, model.id)
        earlier: list[dict[str, Any]] = []
        for t in turns[skip:]:
            earlier += t.sent if t.sent is not None else await t.for_router(model.vision, self.readers.images)
        out = OutOfPrompt(turns[skip - 1].n if skip else entry.after, frozenset(t.n for t in turns[skip:] if t.whole))
        return earlier, own + total, encoded_prefix(system, turns[skip:]), out

    def _too_big(self, model: ModelInfo, budget: Budget, tokens: int, current: list[dict[str, Any]]) -> ContextOverflow:
        files = any(isinstance(m.get("content"), list) for m in current)
        what = "this question and its files need" if files else "this question needs"
        fix = "attach fewer or smaller files, or shorten the question" if files else "shorten it"
        return ContextOverflow(
            f"{what} about {tokens} tokens, but {model.id}'s context holds {budget.ctx_max} with "
            f"{budget.min_reply} kept for the answer; {fix}, or use a model with a larger context"
        )

    async def _compact(
        self,
        cid: int,
        model: ModelInfo,
        budget: Budget,
        entry: Replayed,
        through: int,
        progress: Progress,
        tools: list[dict[str, Any]] | None,
        in_place: bool = True,
    ) -> Compaction | None:
        """Summarise turns up to ``through`` and store it; a note in its place if the model cannot;
        None (nothing stored: asked again next turn) when the server could not answer just now."""
        progress("compacting", f"summarising turns 1-{through} to make room")
        previous = entry.compaction
        try:
            summary = await self._summary(model, budget, entry, through, tools, in_place)
        except RouterUnreachable:
            raise  # no summary and no answer either: the turn fails and says why
        except AssistantError as exc:
            if busy(exc):
                # the server cannot answer just now (a model loading, too many requests): no
                # compaction is stored; this prompt leaves its oldest turns out, the next asks again
                logger.warning("compaction of conversation %d put off: %s", cid, exc.message)
                return None
            # the model cannot summarise (it errs, or says nothing): fold the turns all the same,
            # behind a note, so the prompt stays the same from here on instead of losing its
            # oldest turn anew (and asking for a summary again) on every turn
            logger.warning("compaction of conversation %d failed, turns folded unsummarised: %s", cid, exc.message)
            summary = NO_SUMMARY.format(previous=f"{previous.summary}\n\n" if previous else "")
        return await self.history.run(HistoryStore.add_compaction, cid, through, summary)

    async def _summary(
        self, model: ModelInfo, budget: Budget, entry: Replayed, through: int, tools: list[dict[str, Any]] | None,
        in_place: bool,
    ) -> str:
        """The summary, asked where the server's cache makes it cheapest (docs/DESIGN.md, "Compaction").

        As the conversation's next message when the conversation still fits with the request
        and the summary: the server then reads only the last exchange and the request. Else
        from a transcript of the folded turns, cut to fit.
        """
        images = self.readers.images
        conversation = [*(entry.system or []), *[m for t in entry.turns for m in await t.for_router(model.vision, images)]]
        needed = (estimate_messages(conversation, model.image_tokens) + estimate_text(IN_PLACE_REQUEST)
                  + budget.summary_tokens)
        if tools:
            needed += estimate_tools(tools)
        if in_place and needed <= budget.ctx_max:
            try:
                return await summarize_in_place(self.router, model.id, conversation, budget.summary_tokens, tools)
            except RouterContextOverflow:
                pass  # the estimate was low: the transcript below is cut to fit
        # what the summariser may read: its own context less the summary it writes and
        # its instructions, at the cautious characters-per-token of file budgets
        room = max(budget.ctx_max - 3 * budget.summary_tokens, budget.summary_tokens) * BUDGET_CHARS_PER_TOKEN
        folded = [m for t in entry.turns if t.n <= through for m in t.stored]
        previous = entry.compaction.summary if entry.compaction else None
        return await summarize(self.router, model.id, previous, folded, budget.summary_tokens, max_input_chars=room)

    async def _knowledge(
        self, cid: int, query: str, mode: str, ctx_used: int, ctx_max: int, progress: Progress,
        kb_ids: list[int] | None,
    ) -> tuple[str | None, list[dict[str, Any]]]:
        """The knowledge-base block for this turn, if the mode, the links and the context allow,
        and the sources of its passages (every ``kb`` progress carries them: [] when none)."""
        injection = await self.kbs.context_block(cid, query, mode, ctx_used, ctx_max, kb_ids)
        sources = [passage_source(hit) for hit in injection.hits] if injection.block else []
        if injection.skipped_reason:
            progress("kb", injection.skipped_reason, [])
        elif injection.block:
            progress("kb", passages_detail(injection.hits), sources)
        elif injection.search is not None:
            # a search ran and found nothing to add: the canvas is told why not
            why = f" ({injection.note})" if injection.note else ""
            progress("kb", f"no knowledge-base passage matched the question{why}", [])
        elif injection.note:
            progress("kb", injection.note, [])  # the search failed
        if injection.note:
            logger.debug("kb: %s", injection.note)
        return injection.block, sources

    async def instructions(self, conversation: Conversation | None, tools: bool, memories: str | None = None) -> str:
        """The system message's own text: the system prompt, the saved memories frozen at the
        conversation's first prompt (docs/DESIGN.md, "Memory": ``memories`` as the turn's trip
        read them, else read now), and the tool guidance when tools are offered; each the same
        from turn to turn, a stable prefix."""
        instructions = self.system_prompt(conversation)
        if memories is None and instructions:
            memories = await frozen_block(self.config, self.history, conversation)
        if instructions and memories:
            instructions = f"{instructions}\n\n{memories}"
        if tools and instructions:
            instructions = f"{instructions}\n\n{TOOL_GUIDANCE}"
        return instructions

    def system_prompt(self, conversation: Conversation | None) -> str:
        """The conversation's own system prompt (``settings``, or ``system`` on its first ``ask``),
        else the daemon's."""
        if conversation is not None and conversation.system_prompt is not None:
            return conversation.system_prompt
        return self.config.system_prompt

    async def _system(self, entry: Replayed, cid: int, instructions: str) -> list[dict[str, Any]]:
        """Make (and hold in ``entry``) the one system message (none if it would be empty): the system prompt, then the
        file manifest and the summary, which change only when a compaction is made."""
        parts = [instructions] if instructions else []
        compaction = entry.compaction
        if compaction is not None:
            attachments = await self.history.run(HistoryStore.attachments, cid)
            manifest = attachment_manifest(attachments, compaction.through_turn)
            if manifest:
                parts.append(manifest)
            parts.append(summary_message(compaction.summary, compaction.through_turn)["content"])
        entry.system = [{"role": "system", "content": "\n\n".join(parts)}] if parts else []
        entry.system_prompt = instructions
        return entry.system


async def recall_for(
    archive: ArchiveRecall, config: Config, past: TurnContext, turn: int, query: str, prompt: list[dict[str, Any]],
    blocks: list[str], tokens: int, limit: int, out: OutOfPrompt,
) -> Recall:
    """What recall adds to this turn's ``prompt`` (``tokens`` so far, with ``blocks``) when the
    conversation's ``recall_injection`` is ``auto``: passages of its archive out of the prompt
    (``out``: turns folded or left out; files cut to fit, or of turns not replayed whole) when
    it has one, and of the other conversations and the saved memories when memory is on for it."""
    conversation = past.conversation
    own = bool(out.through or past.has_attachments)  # the files: the store says which are out
    elsewhere = memory_on(config, conversation)
    if not (own or elsewhere) or recall_mode(conversation.settings, config.recall_injection) != "auto":
        return Recall()
    used = tokens + sum(estimate_text(b) for b in blocks)
    held = "\n".join([*map(message_words, prompt), *blocks])
    recent = "\n".join(message_words(m) for m in prompt[:-1][-RECENT_MESSAGES:] if m.get("role") != "system")
    return await archive.recall(conversation.id, turn, query, recent, out.through, held, used, limit,
                                own=own, elsewhere=elsewhere, inline=out.inline | {turn})


def tell_recalled(recalled: Recall, progress: Progress) -> None:
    """The ``recall`` progress of a search of the archive (docs/PROTOCOL.md, "Recall injection")."""
    if recalled.block:
        labels = ", ".join(recall_label(source) for source in recalled.sources)
        progress("recall", f"recalled: {labels}", recalled.sources)
    elif recalled.searched:
        progress("recall", recalled.note or "nothing recalled: no earlier passage matched the question", [])


def passages_detail(hits: list[Hit]) -> str:
    """The ``kb`` progress line for a person: how many passages, from which documents."""
    documents = list(dict.fromkeys(f"{hit.document} ({hit.kb})" for hit in hits))
    return f"{len(hits)} passage(s) from {', '.join(documents)}"


BUSY_STATUSES = (429, 502, 503, 504)  # a server loading a model, overloaded, or a proxy without it


def busy(exc: AssistantError) -> bool:
    """Whether the model server could not answer just now, rather than could not at all."""
    return isinstance(exc, RouterError) and exc.status in BUSY_STATUSES


def put_before_question(prompt: list[dict[str, Any]], block: str, image_tokens: int) -> int:
    """Put ``block`` into the prompt's last message (the question), before its text; the tokens it adds."""
    question = prompt[-1]
    prompt[-1] = with_passages(question, block)
    return estimate_messages([prompt[-1]], image_tokens) - estimate_messages([question], image_tokens)


def with_passages(message: dict[str, Any], block: str) -> dict[str, Any]:
    """The user message with the knowledge-base block before the question (router form only)."""
    content = message.get("content")
    if isinstance(content, list):
        return {**message, "content": [{"type": "text", "text": block}, *content]}
    return {**message, "content": f"{block}\n\n{content}"}


def message_words(message: dict[str, Any]) -> str:
    """The text of a router-form message (its text parts), for recall's search and dedup."""
    content = message.get("content")
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


async def recall_estimate(
    history: AsyncHistory, config: Config, conversation: Conversation, text: str, ctx_max: int
) -> Recall:
    """What an ``ask`` of ``text`` would recall in ``conversation`` now, for ``estimate``: as
    ``ContextBuilder.build`` recalls, against the stored turns instead of the prompt (the summary
    and the turns after it as what the prompt holds; no knowledge-base block)."""
    if not text.strip() or recall_mode(conversation.settings, config.recall_injection) != "auto":
        return Recall()
    compaction, kept = await history.run(HistoryStore.replay_source, conversation.id, MAX_TURN)
    through = compaction.through_turn if compaction else 0
    own = bool(through) or await history.run(HistoryStore.has_attachments, conversation.id)
    elsewhere = memory_on(config, conversation)
    if not (own or elsewhere):
        return Recall()
    messages = [message for _, turn in kept for message in turn]
    inline = frozenset(n for n, turn in kept if turn)  # the files a question carried whole are held
    memories = (await history.memories.run(MemoryStore.frozen, conversation.id) or "") if elsewhere else ""
    held = "\n".join([compaction.summary if compaction else "", memories, *map(message_words, messages)])
    recent = "\n".join(message_words(m) for m in messages[-RECENT_MESSAGES:])
    turn = (kept[-1][0] if kept else through) + 1
    limit = Budget(ctx_max or config.assumed_ctx, config.max_reply_tokens).passage_limit
    return await ArchiveRecall(history).recall(conversation.id, turn, text, recent, through, held,
                                               conversation.ctx_used + estimate_text(text), limit,
                                               own=own, elsewhere=elsewhere, inline=inline)
