"""Saved memories: short facts kept across conversations, and each conversation's frozen copy.

``MemoryStore`` shares the history's connection (and so its thread), as ``KnowledgeStore``
does: ``HistoryStore.memories``, awaited as ``await history.memories.run(MemoryStore.add,
text)``. A memory is the user's (``memory_add``) or the model's (``memory_save``, with the conversation and turn it came
from); deleting that conversation forgets it (``forget_conversation``).

A conversation's system prompt carries the memories as they stood at its first prompt
(``freeze``): kept in ``conversation_memories``, the same bytes on every later turn, so
the model server's prompt cache holds (docs/DESIGN.md, "Memory"). Newest first, cut to
the caller's budget.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import search
from .migrations import immediate_transaction
from .records import FromRow, SearchHit

__all__ = ["MAX_MEMORY_CHARS", "Memory", "MemoryStore", "OtherHit", "memory_block", "reads_memory"]


MAX_MEMORY_CHARS = 500  # a memory is a fact, not a document
MEMORY_HEADER = ("Saved memories: facts the user asked you to keep from earlier conversations, newest first "
                 "(where two disagree, the newer is true). Use them when they matter; do not recite them.")

SELECT_MEMORIES = "SELECT * FROM memories ORDER BY id DESC"
SELECT_MEMORY = "SELECT * FROM memories WHERE id = ?"
INSERT_MEMORY = """
INSERT INTO memories (text, created_at, updated_at, conversation_id, turn) VALUES (?, ?, ?, ?, ?)
"""
UPDATE_MEMORY = "UPDATE memories SET text = ?, updated_at = ? WHERE id = ?"
DELETE_MEMORY = "DELETE FROM memories WHERE id = ?"
MEMORIES_OF = "SELECT * FROM memories WHERE conversation_id = ? ORDER BY id"
DELETE_MEMORIES_OF = "DELETE FROM memories WHERE conversation_id = ?"
SELECT_BLOCK = "SELECT block FROM conversation_memories WHERE conversation_id = ?"
INSERT_BLOCK = "INSERT OR IGNORE INTO conversation_memories (conversation_id, block) VALUES (?, ?)"
DELETE_BLOCK = "DELETE FROM conversation_memories WHERE conversation_id = ?"
# ``reads_memory`` in SQL, of a conversation's row: a damaged settings JSON reads as no setting,
# as records.py reads it (``json_extract`` alone would fail the whole statement)
READS_MEMORY = "coalesce(CASE WHEN json_valid(settings) THEN json_extract(settings, '$.memory') END, 'on') != 'off'"
# the conversations memory search may read: live, and not incognito (settings memory "off")
READABLE_CONVERSATIONS = f"""
SELECT id, title, updated_at FROM conversations
WHERE id IN ({{ids}}) AND deleted_at IS NULL AND {READS_MEMORY}
"""
# a search over every conversation ranks this many hits for each one kept: those of the asking
# conversation and of incognito ones are dropped after ranking
OVERFETCH = 4


@dataclass
class Memory(FromRow):
    """One saved memory."""

    id: int
    text: str
    created_at: str
    updated_at: str
    conversation_id: int | None  # where the model saved it; None: the user added it
    turn: int | None

    def to_json(self) -> dict[str, Any]:
        """A memory as the ``memories`` answer and the ``changed`` event show it."""
        source = None if self.conversation_id is None else {"conversation": self.conversation_id, "turn": self.turn}
        return {"id": self.id, "text": self.text, "created_at": self.created_at, "updated_at": self.updated_at,
                "source": source}


def reads_memory(settings: dict[str, Any]) -> bool:
    """Whether a conversation of these settings reads (and feeds) memory: not incognito."""
    return settings.get("memory", "on") != "off"


def memory_block(memories: list[Memory], max_chars: int) -> str:
    """The system prompt's memories: newest first, as many whole ones as ``max_chars`` holds."""
    lines: list[str] = []
    used = len(MEMORY_HEADER)
    for memory in memories:
        line = f"- ({memory.updated_at[:10]}) {' '.join(memory.text.split())}"  # one line each, a list
        used += len(line) + 1
        if used > max_chars:
            break
        lines.append(line)
    return "\n".join([MEMORY_HEADER, *lines]) if lines else ""


@dataclass
class OtherHit:
    """A search hit in another conversation, with what labels it: its title and last activity."""

    hit: SearchHit
    title: str
    updated_at: str


class MemoryStore:
    """The ``memories`` and ``conversation_memories`` tables, on the history's connection."""

    def __init__(self, conn: sqlite3.Connection, now: Callable[[], str], phrases: search.PhraseStats) -> None:
        self._conn = conn
        self._now = now
        self._phrases = phrases  # the history's, shared: search.search learns phrase counts in it

    def all(self) -> list[Memory]:
        """Every memory, newest first."""
        return [Memory.from_row(row) for row in self._conn.execute(SELECT_MEMORIES)]

    def get(self, memory_id: int) -> Memory | None:
        row = self._conn.execute(SELECT_MEMORY, (memory_id,)).fetchone()
        return Memory.from_row(row) if row else None

    def add(self, text: str, conversation: int | None = None, turn: int | None = None) -> Memory:
        """Keep ``text`` (checked by the caller), from that conversation's turn or (None) the user."""
        with immediate_transaction(self._conn):
            now = self._now()
            cursor = self._conn.execute(INSERT_MEMORY, (text, now, now, conversation, turn))
            memory = self.get(int(cursor.lastrowid or 0))
        assert memory is not None
        return memory

    def edit(self, memory_id: int, text: str) -> Memory | None:
        """Its text replaced; None when there is no such memory."""
        with immediate_transaction(self._conn):
            if self._conn.execute(UPDATE_MEMORY, (text, self._now(), memory_id)).rowcount == 0:
                return None
            return self.get(memory_id)

    def forget(self, memory_id: int) -> Memory | None:
        """Delete it; what it was, None when there was none."""
        with immediate_transaction(self._conn):
            memory = self.get(memory_id)
            if memory is not None:
                self._conn.execute(DELETE_MEMORY, (memory_id,))
        return memory

    def forget_conversation(self, cid: int) -> list[Memory]:
        """Delete the memories saved in conversation ``cid`` and its frozen block; what they were."""
        with immediate_transaction(self._conn):
            gone = [Memory.from_row(row) for row in self._conn.execute(MEMORIES_OF, (cid,))]
            self._conn.execute(DELETE_MEMORIES_OF, (cid,))
            self._conn.execute(DELETE_BLOCK, (cid,))
        return gone

    def frozen(self, cid: int) -> str | None:
        """The block conversation ``cid``'s prompt carries; None before its first prompt."""
        row = self._conn.execute(SELECT_BLOCK, (cid,)).fetchone()
        return str(row[0]) if row else None

    def freeze(self, cid: int, max_chars: int) -> str:
        """The conversation's block: the one kept, else the memories now (made and kept once)."""
        kept = self.frozen(cid)
        if kept is not None:  # every turn but the first: a read, no write lock
            return kept
        with immediate_transaction(self._conn):
            kept = self.frozen(cid)
            if kept is not None:
                return kept
            block = memory_block(self.all(), max_chars)
            self._conn.execute(INSERT_BLOCK, (cid, block))
        return block


    def matching(self, query: str, limit: int) -> list[Memory]:
        """The memories holding most of the query's words (case aside), newest first among equals."""
        words = {word.casefold() for word in query.replace("\x00", " ").split()}
        scored = [(sum(word in memory.text.casefold() for word in words), memory) for memory in self.all()]
        found = sorted(((score, m) for score, m in scored if score), key=lambda pair: (-pair[0], -pair[1].id))
        return [memory for _score, memory in found[:limit]]

    def search_others(self, cid: int, query: str, limit: int) -> list[OtherHit]:
        """The best ``limit`` matches of ``query`` in the user's other conversations: live ones
        that are not incognito, never ``cid`` itself (it searches its own apart)."""
        hits = search.search(self._conn, self._phrases, query, limit * OVERFETCH + 1, cap=search.ALL_CAP)
        ids = sorted({hit.conversation_id for hit in hits} - {cid})
        if not ids:
            return []
        rows = self._conn.execute(READABLE_CONVERSATIONS.format(ids=",".join("?" * len(ids))), ids)
        readable = {row["id"]: row for row in rows}
        kept = [OtherHit(hit, readable[c]["title"], readable[c]["updated_at"])
                for hit in hits if (c := hit.conversation_id) in readable]
        return kept[:limit]
