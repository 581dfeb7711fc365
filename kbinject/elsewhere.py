"""Recall injection across conversations: the user's other conversations and saved memories.

After the conversation's own archive (archive.py), the question is searched with the same
floor against what the user said in their other conversations (live, not incognito, never
the asking one: history/elsewhere.py) and the saved memories; the memories the
conversation's system prompt already carries (its frozen block) are dropped as any text
the prompt holds is.

Every passage recalled costs the model server a re-read of this turn's exchange at the next
turn (passages are not replayed), so it must be worth it (docs/DESIGN.md, "Across
conversations"): the user's words only, not the model's answers; the question's own keywords
only, never the recent turns' a back-reference borrows (those are this conversation's); not
a question the user asked there, nor this question asked again ("Name a colour, number 0."
for "…, number 1.": ``asks_again``); at most ``MAX_PASSAGE_CHARS``, a saved memory's most.

Their passages rank below the conversation's own (the budget drops them first) and are labelled
with where and when they were said: "in “Bike fitting”, 2 Nov: you said: ...", "you asked me to
remember (3 Dec): ...". In the block every passage stands by its date, oldest first, so where
two disagree the newer stands nearest the question (docs/DESIGN.md, "Recall injection";
docs/MEMORY.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from core.tools import one_line
from history import MAX_MEMORY_CHARS, AsyncHistory, ElsewhereFound, ElsewhereHit, ElsewhereStore, Memory, only_asks

from .recallvec import NO_NEAR, Near
from .search import fts_phrases, query_terms, reciprocal_rank_fusion
from .terms import Terms, best_piece, normalized

__all__ = ["ELSEWHERE_TOP_K", "MAX_PASSAGE_CHARS", "ElsewherePassage", "Others", "asks_again", "choose_elsewhere",
           "day_label", "search_elsewhere"]

ELSEWHERE_TOP_K = 3  # passages of other conversations and memories a turn gets at most
MAX_PASSAGE_CHARS = MAX_MEMORY_CHARS  # a message recalled from elsewhere is cut to a memory's length
CANDIDATES = 10  # messages read for the ELSEWHERE_TOP_K (docs/DESIGN.md, "Across conversations")
LETTERS = re.compile(r"[^\W\d_]+")  # words, numbers aside
SENTENCE_START = re.compile(r"(?<=[.!?\n])\s+")
WORD_START = re.compile(r"(?<!\S)\S")
MAX_TITLE_CHARS = 80
ROLE_LABELS = {"user": "you said", "assistant": "the assistant answered", "tool": "a tool returned"}


def day_label(timestamp: str, year: int | None = None) -> str:
    """"2 Nov" for a timestamp of this ``year`` (else "2 Nov 2025"); the timestamp's date when unreadable."""
    try:
        day = datetime.strptime(timestamp[:10], "%Y-%m-%d")
    except ValueError:
        return timestamp[:10]
    year = datetime.now(UTC).year if year is None else year
    return f"{day.day} {day:%b}" + ("" if day.year == year else f" {day.year}")


@dataclass
class ElsewherePassage:
    """A passage from another conversation (``hit``) or a saved memory (``memory``)."""

    text: str
    date: str  # the timestamp it was said (its turn's) or saved (the memory's last edit)
    hit: ElsewhereHit | None = None
    memory: Memory | None = None

    @property
    def sort_key(self) -> tuple[str, int, int, int]:
        return self.date, 0, 0, 0

    def label(self) -> str:
        if self.memory is not None:
            return f"you asked me to remember ({day_label(self.date)})"
        assert self.hit is not None
        title = one_line(self.hit.title, MAX_TITLE_CHARS) if self.hit.title.strip() else ""
        where = f"in “{title}”" if title else "in another conversation"
        return f"{where}, {day_label(self.date)}: {ROLE_LABELS.get(self.hit.role or '', 'it was said')}"

    def source(self) -> dict[str, Any]:
        """The passage's source as the ``recall`` progress and ``open`` show it."""
        if self.memory is not None:
            return {"recall": "memory", "memory": self.memory.id, "date": self.date[:10]}
        assert self.hit is not None
        return {"recall": "conversation", "conversation": self.hit.conversation, "title": self.hit.title,
                "date": self.date[:10], "turn": self.hit.turn, "role": self.hit.role}


@dataclass(frozen=True)
class Others:
    """What a turn's search of the other conversations found, and the saved memories."""

    terms: Terms  # the question's keywords alone: a back-reference's borrowed words are this conversation's
    found: ElsewhereFound  # with the saved memories

    @property
    def memories(self) -> list[Memory]:
        return self.found.memories

    @property
    def size(self) -> int:
        """Their text's length: what choosing among them costs."""
        return sum(len(hit.text) for hit in self.found.hits) + sum(len(m.text) for m in self.memories)


async def search_elsewhere(history: AsyncHistory, cid: int, terms: Terms, common: tuple[float, int]) -> Others | None:
    """The other conversations searched for the question's ``terms`` (not the recent turns'),
    and the saved memories, in one trip; None when the question has no keyword."""
    own = Terms(terms.question, [])
    phrases = fts_phrases(own.question)
    if not phrases:
        return None
    found = await history.elsewhere.run(ElsewhereStore.search, cid, phrases, CANDIDATES, common, own.must_hold())
    return Others(own, found)


def choose_elsewhere(others: Others, question: str, held: str, taken: list[str], near: Near = NO_NEAR
                     ) -> list[ElsewherePassage]:
    """The best passages of what ``others`` found for the ``question`` (and what the vectors found:
    ``near``), past the floor, none that asks it again or that the prompt's text ``held``
    (``normalized``) or a passage already ``taken`` holds; best first."""
    floor = others.terms.without(others.found.common)
    return choose(others.found.hits, others.memories, question, others.terms, floor, held, taken, near)


def choose(
    hits: list[ElsewhereHit], memories: list[Memory], question: str, terms: Terms, floor: Terms, prompt: str,
    taken: list[str], near: Near = NO_NEAR,
) -> list[ElsewherePassage]:
    """Memories and messages fused by rank (with the vectors' rankings: ``near``), each past the
    ``floor`` (or its vector counterpart), new to the prompt and more than the ``question``
    asked again."""
    held = prompt  # normalized by the caller, once for both searches
    keywords = len(hits)
    fused = near.fused_others(hits, floor)
    hits = fused.hits
    remembered = sorted((m for m in memories if floor.relevant(m.text) or m.id in near.memories),
                        key=lambda m: (-terms.strength(m.text), -m.id))
    cosines = {len(remembered) + i: cosine for i, cosine in fused.cosines.items()}
    cosines.update((i, near.memories[m.id]) for i, m in enumerate(remembered) if m.id in near.memories)
    candidates = [*(ElsewherePassage(m.text, m.updated_at, memory=m) for m in remembered),
                  *(ElsewherePassage(best_piece(h.text, terms), h.created_at, hit=h) for h in hits)]
    ranks = reciprocal_rank_fusion(range(len(remembered)), range(len(remembered), len(remembered) + keywords),
                                   sorted(cosines, key=lambda i: -cosines[i]))
    seen = [normalized(text) for text in taken]
    chosen: list[ElsewherePassage] = []
    for i in ranks:
        passage = candidates[i]
        plain = normalized(passage.text)
        if not plain or plain in held or asks_again(question, passage.text):
            continue
        if any(plain in other or other in plain for other in seen):
            continue
        near_enough = fused.floor.passes(passage.text, cosines.get(i))  # before the cut: its whole text's vector
        passage.text = cut_around(passage.text, terms)
        if not (floor.relevant(passage.text) or near_enough):
            continue
        chosen.append(passage)
        seen.append(plain)
        if len(chosen) == ELSEWHERE_TOP_K:
            break
    return chosen


def asks_again(question: str, text: str) -> bool:
    """Whether ``text`` only asks: it is a question (each of its sentences ends with "?"), or
    the ``question`` asked again: it holds the question's words in their order, numbers aside
    ("Name a colour, number 0." for "Name a colour, number 1."), and no keyword but numbers
    beyond them. A question asked elsewhere tells the model nothing about the user."""
    if only_asks(text):
        return True
    asked = LETTERS.findall(question.lower())
    said = LETTERS.findall(text.lower())
    if not asked or f" {' '.join(asked)} " not in f" {' '.join(said)} ":
        return False
    words = set(asked)
    return all(term in words for term in query_terms(text) if not term.isdigit())


def cut_around(text: str, terms: Terms, limit: int = MAX_PASSAGE_CHARS) -> str:
    """``text`` whole when it fits in ``limit`` characters, else the window of that length (from
    a sentence's start, or a word's) that holds most of the ``terms``, the latest of those (it
    starts nearest what matched), its cuts marked "…"."""
    if len(text) <= limit:
        return text
    starts = {0, *(m.end() for m in SENTENCE_START.finditer(text))}
    last = 0  # and a word's start every quarter of the limit, for text of few sentence ends
    for word in WORD_START.finditer(text):
        if word.start() - last >= limit // 4:
            starts.add(word.start())
            last = word.start()
    best, best_strength = "", -1.0
    for start in sorted(s for s in starts if s < len(text)):
        window = text[start:start + limit - 4]  # room for the marks
        if start + len(window) < len(text) and " " in window:
            window = window[: window.rindex(" ")]  # whole words
        strength = terms.strength(window)
        if strength >= best_strength:
            best, best_strength = (("… " if start else "") + window.strip()
                                   + (" …" if start + len(window) < len(text.rstrip()) else "")), strength
    return best
