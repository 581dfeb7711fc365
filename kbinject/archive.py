"""Recall injection: the conversation's own archive, searched before every turn like a KB.

A small model rarely calls ``conversation_search`` when the answer was folded away by a
compaction (issue 49's runs). So before a turn of a conversation with something out of
the prompt (folded turns; files whose text was cut to fit, or whose turn was folded), the
question is searched against that archive alone, and the passages that pass a relevance
floor go before the question, each labelled with its source ("turn 3, you said: ...",
"report.pdf, page 4: ..."), as knowledge-base passages do (docs/DESIGN.md, "Recall
injection"). The tools stay, for the model that digs further.

- Search: the knowledge bases' keywords (search.py ``query_terms``: stop words out, each
  quoted), ORed, bm25 over the folded turns' messages and the files' chunks
  (history/archive.py); the two lists are fused by rank (``reciprocal_rank_fusion``). A
  file is chunked as a KB document is (chunking.py), the first time it is searched; one whose
  whole text the prompt holds (its question sent it whole and is replayed whole) is not
  searched, and when nothing is out of the prompt nothing is searched (no ``recall`` progress).
- Back-references: a question of few keywords ("what was it again?", "the code I gave
  you") is searched with the recent turns' keywords as well; when it has words of its own,
  only what holds one of them is ranked (``Terms.must_hold``: the floor would drop the rest,
  and twenty of them could fill the candidates).
- The floor: a passage must hold half the question's keywords, ``MIN_MATCHED`` at most
  (numbers count only in a question of numbers alone), so "what is 12 times 12?" finds
  nothing in a conversation about lockers, nor in one that mentions 12 cats; a question
  of no keywords must share ``MIN_MATCHED`` with the recent turns. Keywords that much of the
  conversation holds (``COMMON_SHARE``) are neither searched by nor counted: they tell no
  passage apart.
- Vectors, when an embedding model is configured (recallvec.py): the nearest messages and
  chunks are a third list in the fusion, and a passage the keywords' floor drops passes
  when its cosine reaches ``MIN_SIMILARITY`` and it holds a keyword of the question that
  tells it apart (recallvec.py ``VectorFloor``).
- Dedup: a passage whose text the prompt already holds is dropped (files still inline).
- Of one file's chunks, only those holding more than half the keywords its best holds
  (``best_of_each_file``); of passages a later one restates, the later alone (``latest_only``).
- Order: oldest first, so when two passages disagree the newest stands nearest the question.
- Budget: the KB block first (within its ``CONTEXT_LIMIT``), then as many of the best
  passages as keep the prompt within ``Budget.passage_limit``: they never shrink the
  reply below its cap. The weakest are dropped first.

Nothing here fails a turn: ``recall`` logs a failure and recalls nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

from attachments import PAGE_BREAK, PAGE_UNITS
from core import estimate_text
from core.tools import one_line
from history import NOTHING_OUT, ArchiveFound, ArchiveHit, ArchiveStore, AsyncHistory, ElsewhereStore, FileToChunk

from .chunking import MARKDOWN_SUFFIXES, chunk_pages, chunk_text
from .elsewhere import ElsewherePassage, Others, choose_elsewhere, day_label, search_elsewhere
from .recallvec import NO_NEAR, Near, RecallVectors
from .search import fts_phrases, query_terms, reciprocal_rank_fusion
from .terms import Terms, best_piece, held, normalized

__all__ = [
    "DEFAULT_RECALL_MODE",
    "RECALL_MODES",
    "RECALL_TOP_K",
    "ArchiveRecall",
    "Recall",
    "RecallMode",
    "recall_label",
    "recall_mode",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

RecallMode = Literal["auto", "tool_only", "off"]
RECALL_MODES: tuple[RecallMode, ...] = ("auto", "tool_only", "off")
DEFAULT_RECALL_MODE: RecallMode = "auto"
SETTING = "recall_injection"  # the key in conversations.settings (and the configuration's)

RECALL_TOP_K = 3  # passages a turn gets at most
CANDIDATES = 20  # matches of each kind (turns, file chunks) ranked before the floor
# Choosing among less text than this (the prompt's, the matches') takes less time on the loop
# than a hand-off to a thread and back: some 20 us a thousand characters, against 0.15-0.2 ms
INLINE_CHARS = 8_000
# A keyword that more than this share of the conversation's pieces hold (messages, file chunks;
# more than COMMON_PIECES of them) tells no passage apart: it is not searched by, nor counts for the floor
COMMON_SHARE = 0.3
COMMON_PIECES = 3
BLOCK_HEADER = (
    "[Recalled from this conversation]\n"
    "These earlier parts of this conversation are no longer above and may be relevant\n"
    "(oldest first: when two disagree, the later one stands):\n"
)
ELSEWHERE_HEADER = (
    "[Recalled from earlier conversations]\n"
    "These passages of the user's earlier conversations and saved memories (and of this conversation,\n"
    "no longer above) may be relevant (oldest first: when two disagree, the later one stands):\n"
)
BLOCK_FOOTER = "[End Recalled]"
MAX_NAME_CHARS = 200  # a file's name in a label
ROLE_LABELS = {"user": "you said", "assistant": "the assistant answered", "tool": "a tool returned"}


def recall_mode(settings: Mapping[str, Any] | None, default: str = DEFAULT_RECALL_MODE) -> RecallMode:
    """The conversation's ``recall_injection`` (else ``default``, the configuration's); ``auto``
    when neither is a mode."""
    for value in ((settings or {}).get(SETTING), default):
        for mode in RECALL_MODES:
            if value == mode:
                return mode
    return DEFAULT_RECALL_MODE


@dataclass
class Passage:
    """One recalled passage: its text, its label's words and where it comes from."""

    text: str
    hit: ArchiveHit
    date: str = ""  # its turn's timestamp, looked up when passages of other conversations stand beside it

    @property
    def sort_key(self) -> tuple[str, int, int, int]:
        """Where it stands: its date, then its turn, its message, its chunk in the conversation."""
        return self.date, self.hit.turn, self.hit.n, self.hit.chunk or 0

    def label(self) -> str:
        hit = self.hit
        if hit.file is None:
            return f"turn {hit.turn}, {ROLE_LABELS.get(hit.role or '', 'it was said')}"
        name = one_line(hit.file, MAX_NAME_CHARS)
        if hit.page is None:
            return f"{name} (attached in turn {hit.turn})"
        return f"{name}, {PAGE_UNITS.get(hit.kind or '', 'page')} {hit.page}"

    def source(self) -> dict[str, Any]:
        """The passage's source as the ``recall`` progress and ``open`` show it."""
        hit = self.hit
        if hit.file is None:
            return {"recall": "turn", "turn": hit.turn, "role": hit.role}
        return {"recall": "file", "turn": hit.turn, "file": hit.file, "attachment": hit.attachment,
                "chunk": hit.chunk, "page": hit.page}


AnyPassage = Passage | ElsewherePassage


def recall_label(source: Mapping[str, Any]) -> str:
    """A recalled passage's source in a few words: "turn 3", "report.pdf p4", "notes.txt",
    "“Bike fitting” 2 Nov", "memory 4"."""
    kind = source.get("recall")
    if kind == "turn":
        return f"turn {source.get('turn')}"
    if kind == "conversation":
        return f"“{one_line(str(source.get('title') or ''), 40)}” {day_label(str(source.get('date')))}"
    if kind == "memory":
        return f"memory {source.get('memory')}"
    page = source.get("page")
    return f"{source.get('file')} p{page}" if page is not None else str(source.get("file"))


def format_block(passages: Sequence[AnyPassage]) -> str:
    """The block of these passages, oldest first: ``[Recalled from this conversation]``, or
    ``[Recalled from earlier conversations]`` when some come from elsewhere."""
    entries = [f"{p.label()}: {p.text.strip()}\n" for p in sorted(passages, key=lambda p: p.sort_key)]
    elsewhere = any(isinstance(p, ElsewherePassage) for p in passages)
    return (ELSEWHERE_HEADER if elsewhere else BLOCK_HEADER) + "\n" + "\n".join(entries) + BLOCK_FOOTER


@dataclass
class Recall:
    """What recall adds before this turn's question, or why nothing."""

    block: str | None = None
    passages: list[AnyPassage] = field(default_factory=list)
    tokens: int = 0
    searched: bool = False  # a search ran (a ``recall`` progress says what it found)
    note: str | None = None  # why nothing was added though passages were found, or the failure

    @property
    def sources(self) -> list[dict[str, Any]]:
        return [p.source() for p in sorted(self.passages, key=lambda p: p.sort_key)] if self.block else []


def file_chunks(file: FileToChunk) -> list[tuple[int | None, str]]:
    """A file's text in chunks, as a KB document of its kind is chunked."""
    if file.kind in PAGE_UNITS:  # a PDF's pages, a deck's slides, a workbook's sheets, an EPUB's chapters
        chunks = chunk_pages(file.text.split(PAGE_BREAK))
    else:
        markdown = "." in file.name and file.name.rsplit(".", 1)[1].lower() in MARKDOWN_SUFFIXES
        chunks = chunk_text(file.text, markdown=markdown)
    return [(chunk.page, chunk.text) for chunk in chunks if chunk.text.strip()]


async def _given(value: T) -> T:
    """``value``, awaitable: a search not made, among those gathered."""
    return value


async def _call(fn: Callable[..., T], /, *args: Any) -> T:
    """``fn(*args)`` on the loop, awaitable as ``asyncio.to_thread`` is."""
    return fn(*args)


class ArchiveRecall:
    """Finds the passages of a conversation's archive that bear on this turn's question."""

    def __init__(self, history: AsyncHistory, top_k: int = RECALL_TOP_K, vectors: RecallVectors | None = None) -> None:
        self.history = history
        self.top_k = top_k
        self.vectors = vectors  # None, or one without an embedder: keywords alone

    async def recall(
        self, cid: int, turn: int, question: str, recent: str, through: int, held: str, ctx_used: int, limit: int,
        *, own: bool = True, elsewhere: bool = False, inline: Collection[int] = frozenset(),
    ) -> Recall:
        """The block for turn ``turn``: passages of turns 1..``through`` and of the conversation's
        files out of the prompt (when ``own``: all but those whose question carried their whole
        text and is replayed whole, in a turn of ``inline``), then of the user's other
        conversations and saved memories (when ``elsewhere``: elsewhere.py), for ``question``
        (with ``recent``'s words when it has few), none that ``held`` (the prompt's text) already
        holds, as many as keep the prompt (``ctx_used`` tokens so far) within ``limit`` tokens.
        ``searched`` only when some of the archive was out of the prompt. Never raises (but
        CancelledError)."""
        if not question.strip() or not (own or elsewhere):  # files alone: their words are no question
            return Recall()
        try:
            terms = Terms.of(question, recent)
            if self.top_k <= 0 or not (terms.question or terms.recent):
                return Recall()
            # sent together: they queue on the history thread, and the turn waits for them once
            found, others = await asyncio.gather(
                self._search(cid, turn, terms, through, inline) if own else _given(NOTHING_OUT),
                search_elsewhere(self.history, cid, terms, (COMMON_SHARE, COMMON_PIECES)) if elsewhere else _given(None),
            )
            near = await self._near(cid, question, terms, through, found, elsewhere)
            chosen: list[AnyPassage] = []
            if found.searched or others is not None:
                # long messages cut to their best chunk, the prompt's text compared: CPU work, off the
                # loop when there is much of it (a thread's hand-off costs more than a little)
                work = len(held) + sum(len(hit.text) for hit in found.hits) + (others.size if others else 0)
                mine, theirs = await (asyncio.to_thread if work > INLINE_CHARS else _call)(
                    self._choose_all, found, others, question, terms, held, near)
                chosen += mine
                chosen += await self._dated(cid, theirs, mine)
            # other conversations searched in vain say nothing: every turn of memory would
            return fit(latest_only(chosen, terms), ctx_used, limit) if chosen else Recall(searched=found.searched)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("recall: the search failed for conversation %d", cid)
            return Recall(searched=True, note=f"recall failed ({type(exc).__name__})")

    async def _near(
        self, cid: int, question: str, terms: Terms, through: int, own: ArchiveFound, elsewhere: bool
    ) -> Near:
        """What the vectors find (recallvec.py) for the question, with the recent turns'
        keywords when it refers back (as the keywords' search takes them), in what ``own`` searched."""
        if self.vectors is None or not self.vectors.enabled or not (own.searched or elsewhere):
            return NO_NEAR
        text = f"{question}\n{' '.join(terms.recent)}" if terms.recent else question  # the KB's query: cached
        near = await self.vectors.near(cid, text, through, own.searched, elsewhere)
        # a file the prompt holds whole has its vectors still: not found here, as not by keywords
        kept = [(hit, cosine) for hit, cosine in near.own if hit.attachment is None or hit.attachment in own.files]
        return near if len(kept) == len(near.own) else replace(near, own=kept)

    async def _search(self, cid: int, turn: int, terms: Terms, through: int, inline: Collection[int]) -> ArchiveFound:
        """The keywords' matches in the conversation's archive out of the prompt (history/archive.py)."""
        phrases = fts_phrases([*terms.question, *terms.recent])
        common = (COMMON_SHARE, COMMON_PIECES)
        search = ArchiveStore.search
        must = terms.must_hold()
        found = await self.history.archive.run(search, cid, phrases, through, turn, CANDIDATES, common, inline, must)
        if found.unchunked:  # the first search since these files came: chunk them, search again
            await self._chunk_files(cid, found.unchunked)
            found = await self.history.archive.run(search, cid, phrases, through, turn, CANDIDATES, common, inline,
                                                   must)
        return found

    def _choose_all(
        self, found: ArchiveFound, others: Others | None, question: str, terms: Terms, held: str, near: Near
    ) -> tuple[list[Passage], list[ElsewherePassage]]:
        """The passages of the archive (``found``), then those of other conversations and memories
        (``others``) new beside them, none that the prompt's text ``held`` already holds."""
        plain = normalized(held)  # made comparable once, for both
        mine = self._choose(found.hits, terms, terms.without(found.common), plain, near) if found.searched else []
        theirs = choose_elsewhere(others, question, plain, [p.text for p in mine], near) if others else []
        return mine, theirs

    async def _dated(
        self, cid: int, theirs: list[ElsewherePassage], mine: list[Passage]
    ) -> list[ElsewherePassage]:
        """``theirs``, with ``mine`` dated when there are both, so that every passage stands by its
        date in the block."""
        if theirs and mine:
            dates = await self.history.elsewhere.run(ElsewhereStore.turn_dates, cid, [p.hit.turn for p in mine])
            for passage in mine:
                passage.date = dates.get(passage.hit.turn, "")
        return theirs

    async def _chunk_files(self, cid: int, files: list[FileToChunk]) -> None:
        """Chunk these files and store their chunks (off the event loop)."""
        for file in files:
            chunks = await asyncio.to_thread(file_chunks, file)
            await self.history.archive.run(ArchiveStore.put_chunks, file.id, chunks)
        if files and self.vectors is not None:
            self.vectors.note(cid)  # the new chunks get their vectors in the background

    def _choose(
        self, hits: list[ArchiveHit], terms: Terms, floor: Terms, prompt: str, near: Near = NO_NEAR
    ) -> list[Passage]:
        """The best passages past the ``floor`` (or its vector counterpart) and not in the
        ``prompt``'s text (``normalized``), best first."""
        held = prompt
        turns = [i for i, hit in enumerate(hits) if hit.file is None]
        files = [i for i, hit in enumerate(hits) if hit.file is not None]
        fused = near.fused_own(hits, floor)
        chosen: list[Passage] = []
        # a file's chunk beats the message that carried it
        for i in reciprocal_rank_fusion(files, turns, fused.similar):
            hit = fused.hits[i]
            text = best_piece(hit.text, terms) if hit.file is None else hit.text
            plain = normalized(text)
            passes = floor.relevant(text) or fused.floor.passes(text, fused.cosines.get(i))
            if not plain or not passes or plain in held:
                continue
            if any(plain in normalized(p.text) or normalized(p.text) in plain for p in chosen):
                continue
            chosen.append(Passage(text, hit))
            if len(chosen) == self.top_k:
                break
        return best_of_each_file(chosen, floor)


def best_of_each_file(passages: list[Passage], floor: Terms) -> list[Passage]:
    """``passages`` less the chunks of a file that hold half or less of the keywords its best
    chunk holds. Every page of a report says "order report"; asked for "the warranty reference
    in the order report", page 3 alone answers, and pages 1 and 2 cost the real model as much
    again to read (bench_recall's file kind: 17 s to the first token, 7.6 s without recall)."""
    share = {id(p): floor.strength(p.text) for p in passages if p.hit.attachment is not None}
    best: dict[int, float] = {}
    for p in passages:
        if p.hit.attachment is not None:
            best[p.hit.attachment] = max(best.get(p.hit.attachment, 0.0), share[id(p)])
    return [p for p in passages if p.hit.attachment is None or share[id(p)] * 2 > best[p.hit.attachment]]


def latest_only(passages: list[AnyPassage], terms: Terms) -> list[AnyPassage]:
    """``passages`` less those a later one restates: of two that hold every word the question asks
    with (two or more), the older goes when the later holds all its words but the numbers ("my code
    is 8393", then "my code changed: now it is 6344"). A small model shown both answers the older as
    often as not, whatever the order and the labels say (docs/DESIGN.md, "The later fact wins");
    "my gym code" and "my office code" are two facts and both stay."""
    asked = [t for t in terms.question if not t.isdigit()]
    if len(asked) < 2:
        return passages
    whole = [p for p in passages if held(asked, p.text) == len(asked)]

    def restated(older: AnyPassage) -> bool:
        words = [t for t in query_terms(older.text) if not t.isdigit()]
        return any(
            later.sort_key[:2] > older.sort_key[:2] and held(words, later.text) == len(words) for later in whole
        )

    gone = {id(p) for p in whole if restated(p)}
    return [p for p in passages if id(p) not in gone]


def fit(passages: list[AnyPassage], ctx_used: int, limit: int) -> Recall:
    """The block of as many of the best ``passages`` as keep the prompt within ``limit`` tokens,
    or why none fit."""
    for count in range(len(passages), 0, -1):
        block = format_block(passages[:count])
        tokens = estimate_text(block)
        if ctx_used + tokens <= limit:
            return Recall(block, passages[:count], tokens, searched=True)
    return Recall(searched=True, note=(
        f"recalled passages skipped: the prompt takes {ctx_used} tokens, and with them it would pass "
        f"{limit}, which would shrink the reply"))

