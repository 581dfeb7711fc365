"""Recall injection beyond the conversation: the user's other conversations, searched per turn.

``ElsewhereStore`` shares the history's connection (``store.elsewhere``), as ``ArchiveStore``
does, and is its counterpart across conversations: kbinject (recall_others.py) hands it the
quoted keywords of a question and floors, labels and orders what comes back.

One FTS5 query, bm25 over what the user said in their other conversations (`said_fts`,
history/fts.py: each turn's question that says more than it asks), outside the asking
conversation's rowid range, the keywords ORed: what the user said, not the model's answers
(an old answer is not the user's memory, can be long, and can be wrong), nor summaries or tool
results (they were for that conversation's questions), nor questions that only ask (they tell
nothing about the user, and are never recalled: ranked, the copies of one question asked in
many conversations crowded the candidates and were most of the search's time;
docs/DESIGN.md, "Across conversations"). The query ranks rowids alone and reads the text of
the best few after.
Phrases that too many statements hold (more than ``common`` = (share, least) of the turns, at
most ``COMMON_MAX``) are neither searched by nor counted: ranking their many matches is the
cost, and they tell no passage apart. Only the best few are looked up again: live conversations
that are not incognito (settings ``memory`` ``off``), with their title and the turn's date.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field

from .fts import conversation_rowid_range, match_holding, split_rowid
from .memories import READS_MEMORY, Memory, MemoryStore

__all__ = ["ElsewhereFound", "ElsewhereHit", "ElsewhereStore"]

# a phrase more statements than this hold is common, however large the history: 2,000 messages
# before said_fts, when a statement's words were counted again in its reply (bench_memory's
# p95 at 1,000 conversations x 50 turns: 5.3 ms at 2,000 statements, 1.4-2.8 ms at 1,000)
COMMON_MAX = 1000
OVERFETCH = 4  # matches ranked for each one kept: incognito and deleted conversations' are dropped after

SEARCH_OTHERS = """
SELECT rowid, bm25(said_fts) AS score FROM said_fts
WHERE said_fts MATCH ? AND (rowid < ? OR rowid > ?)
ORDER BY score
LIMIT ?
"""
SAID = "SELECT body FROM said_fts WHERE rowid = ?"
COUNT_HOLDING = "SELECT count(*) FROM (SELECT 1 FROM said_fts WHERE said_fts MATCH ? LIMIT ?)"
COUNT_TURNS = "SELECT count(*) FROM turns"
READABLE_TURN = f"""
SELECT c.title, t.created_at FROM turns AS t JOIN conversations AS c ON c.id = t.conversation_id
WHERE t.conversation_id = ? AND t.turn = ? AND c.deleted_at IS NULL AND {READS_MEMORY}
"""
TURN_DATES = "SELECT turn, created_at FROM turns WHERE conversation_id = ? AND turn IN ({turns})"


@dataclass(frozen=True)
class ElsewhereHit:
    """A message of another conversation that matched, best first: where it is and what labels it."""

    conversation: int
    title: str
    created_at: str  # its turn's
    turn: int
    n: int
    role: str | None
    text: str
    score: float  # bm25, lower is better


@dataclass(frozen=True)
class ElsewhereFound:
    hits: list[ElsewhereHit]
    common: frozenset[str]  # the phrases too common to search by
    memories: list[Memory] = field(default_factory=list)  # every saved memory, read in the same trip


class ElsewhereStore:
    """The recall queries over the user's other conversations, on the history's connection."""

    def __init__(self, conn: sqlite3.Connection, memories: MemoryStore) -> None:
        self._conn = conn
        self._memories = memories

    def search(
        self, cid: int, phrases: Sequence[str], limit: int, common: tuple[float, int], must: Sequence[Sequence[str]] = ()
    ) -> ElsewhereFound:
        """The best ``limit`` matches of the rare ``phrases`` in the readable conversations but ``cid``,
        each holding a phrase of ``must``'s first list with a rare one (``match_holding``); and the
        saved memories, in the same trip to the history thread (a hand-off costs more than reading them)."""
        found = self._search(cid, phrases, limit, common, must)
        return ElsewhereFound(found.hits, found.common, self._memories.all())

    def _search(
        self, cid: int, phrases: Sequence[str], limit: int, common: tuple[float, int], must: Sequence[Sequence[str]]
    ) -> ElsewhereFound:
        if not phrases or limit <= 0:
            return ElsewhereFound([], frozenset())
        share, least = common
        turns = self._conn.execute(COUNT_TURNS).fetchone()[0]  # a statement at most each: near enough
        cap = min(COMMON_MAX, max(least, int(share * turns))) + 1
        frequent = frozenset(p for p in phrases if self._conn.execute(COUNT_HOLDING, (p, cap)).fetchone()[0] >= cap)
        rare = [phrase for phrase in phrases if phrase not in frequent]
        if not rare:
            return ElsewhereFound([], frequent)
        lo, hi = conversation_rowid_range(cid)
        rows = self._conn.execute(SEARCH_OTHERS, (match_holding(rare, must), lo, hi, limit * OVERFETCH)).fetchall()
        hits: list[ElsewhereHit] = []
        for rowid, score in rows:
            conversation, turn, n = split_rowid(rowid)
            found = self._conn.execute(READABLE_TURN, (conversation, turn)).fetchone()
            if found is not None:
                body = self._conn.execute(SAID, (rowid,)).fetchone()[0]
                hits.append(ElsewhereHit(conversation, found[0], found[1], turn, n, "user", body, score))
                if len(hits) == limit:
                    break
        return ElsewhereFound(hits, frequent)

    def turn_dates(self, cid: int, turns: Sequence[int]) -> dict[int, str]:
        """When each of these turns of conversation ``cid`` was asked."""
        wanted = sorted(set(turns))
        if not wanted:
            return {}
        rows = self._conn.execute(TURN_DATES.format(turns=",".join("?" * len(wanted))), (cid, *wanted))
        return {int(turn): str(created_at) for turn, created_at in rows}
