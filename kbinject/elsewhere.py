"""Recall injection across conversations: the user's other conversations and saved memories.

After the conversation's own archive (archive.py), the question is searched with the same
keywords and the same floor against the user's other conversations (live, not incognito,
never the asking one: history/elsewhere.py) and the saved memories; the memories the
conversation's system prompt already carries (its frozen block) are dropped as any text
the prompt holds is. Their passages rank below the conversation's own (the budget drops
them first) and are labelled with where and when they were said: "in “Bike fitting”,
2 Nov: you said: ...", "you asked me to remember (3 Dec): ...". In the block every passage
stands by its date, oldest first, so where two disagree the newer stands nearest the
question (docs/DESIGN.md, "Recall injection"; docs/MEMORY.md).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from core.tools import one_line
from history import AsyncHistory, ElsewhereHit, ElsewhereStore, Memory, MemoryStore

from .recallvec import NO_NEAR, Near
from .search import fts_phrases, reciprocal_rank_fusion
from .terms import Terms, best_piece, normalized

__all__ = ["ELSEWHERE_TOP_K", "ElsewherePassage", "day_label", "recall_elsewhere"]

ELSEWHERE_TOP_K = 3  # passages of other conversations and memories a turn gets at most
CANDIDATES = 20
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


async def recall_elsewhere(
    history: AsyncHistory, cid: int, terms: Terms, held: str, taken: list[str], common: tuple[float, int],
    near: Near = NO_NEAR,
) -> list[ElsewherePassage]:
    """The best passages of other conversations and memories for ``terms`` (and what the vectors
    found: ``near``), past the floor, none that the prompt's text ``held`` or a passage already
    ``taken`` holds; best first."""
    phrases = fts_phrases([*terms.question, *terms.recent])
    if not phrases:
        return []
    found = await history.elsewhere.run(ElsewhereStore.search, cid, phrases, CANDIDATES, common)
    memories = await history.memories.run(MemoryStore.all)
    floor = terms.without(found.common)
    return await asyncio.to_thread(choose, found.hits, memories, terms, floor, held, taken, near)


def choose(
    hits: list[ElsewhereHit], memories: list[Memory], terms: Terms, floor: Terms, prompt: str, taken: list[str],
    near: Near = NO_NEAR,
) -> list[ElsewherePassage]:
    """Memories and messages fused by rank (with the vectors' rankings: ``near``), each past the
    ``floor`` (or its vector counterpart) and new to the prompt."""
    held = normalized(prompt)
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
        if not plain or plain in held or not (floor.relevant(passage.text)
                                              or fused.floor.passes(passage.text, cosines.get(i))):
            continue
        if any(plain in other or other in plain for other in seen):
            continue
        chosen.append(passage)
        seen.append(plain)
        if len(chosen) == ELSEWHERE_TOP_K:
            break
    return chosen
