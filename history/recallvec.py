"""The vectors of what recall searches: messages, attachment chunks and saved memories.

``RecallVectorStore`` shares the history's connection (``store.recall_vectors``), as
``ArchiveStore`` does. kbinject (recallvec.py) embeds what ``pending`` hands it, off the
turn's path, and stores the vectors with ``put``; it keeps them in memory as int8 codes
(the knowledge bases' ``VectorIndex``) and looks the nearest up again here before it
uses them. One table, ``recall_vectors``, keyed by what each vector is of:

- a message of a turn (user or assistant, not a summary or a tool's result): its
  ``message_fts`` rowid, which holds the conversation in its high bits;
- a chunk of an attachment (``attachment_chunks``): its id negated;
- a saved memory: its id (below 2**32: no message's rowid is), conversation 0.

Each row keeps the digest of the text embedded: a text that changed since (a reply
finished after its checkpoint, a memory edited, a file chunked again) is pending again,
and its old vector is never used meanwhile. Triggers (migration m015) drop a conversation's
rows when it is deleted or made incognito, and a memory's when it is forgotten; nothing
of an incognito conversation is ever embedded (``pending``, ``put``).
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass

from .archive import ArchiveHit
from .elsewhere import READABLE_TURN, ElsewhereHit
from .fts import MAX_MESSAGE_INDEX, conversation_rowid_range, split_rowid, turn_message_range
from .memories import READS_MEMORY
from .migrations import immediate_transaction

__all__ = ["EMBED_CHARS", "Piece", "RecallVectorStore", "digest"]

EMBED_CHARS = 2_000  # a longer message is embedded from its start (the server's input limit)
READABLE = f"SELECT 1 FROM conversations WHERE id = ? AND deleted_at IS NULL AND {READS_MEMORY}"
READABLE_IDS = f"SELECT id FROM conversations WHERE deleted_at IS NULL AND {READS_MEMORY} ORDER BY id DESC"
MESSAGES = f"""
SELECT rowid, body, role FROM message_fts
WHERE rowid BETWEEN ? AND ? AND (rowid & 255) <= {MAX_MESSAGE_INDEX} AND role IN ('user', 'assistant')
"""
MESSAGE = "SELECT body, role FROM message_fts WHERE rowid = ?"
MESSAGE_KEYS = f"""
SELECT rowid FROM message_fts
WHERE rowid BETWEEN ? AND ? AND (rowid & 255) <= {MAX_MESSAGE_INDEX} AND role IN ('user', 'assistant')
"""
CHUNKS = """
SELECT ch.id, ch.text FROM attachment_chunks AS ch JOIN attachments AS a ON a.id = ch.attachment_id
WHERE a.conversation_id = ?
"""
CHUNK = """
SELECT a.conversation_id, a.turn, a.name, a.id, ch.ordinal, ch.page, ch.text, a.kind
FROM attachment_chunks AS ch JOIN attachments AS a ON a.id = ch.attachment_id WHERE ch.id = ?
"""
MEMORIES = "SELECT id, text FROM memories"
STORED = "SELECT id, model, digest FROM recall_vectors WHERE conversation_id = ?"
STORED_ROW = "SELECT digest FROM recall_vectors WHERE id = ? AND model = ? AND length(vector) > 0"
PUT = "INSERT OR REPLACE INTO recall_vectors (id, conversation_id, model, digest, vector) VALUES (?, ?, ?, ?, ?)"
LOAD = "SELECT id, conversation_id, vector FROM recall_vectors WHERE model = ? AND length(vector) > 0"


def digest(text: str) -> str:
    """What identifies a text embedded: its hash."""
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Piece:
    """A text to embed: its key in ``recall_vectors``, its group (the conversation; the
    conversation negated for a chunk; 0 for a memory) and the text."""

    key: int
    group: int
    text: str


class RecallVectorStore:
    """Recall's vectors, on the history's connection."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def conversations(self) -> list[int]:
        """The conversations recall may embed (live, not incognito), newest first."""
        return [row[0] for row in self._conn.execute(READABLE_IDS)]

    def pending(self, cid: int, model: str, limit: int, turn: int | None = None) -> list[Piece]:
        """Up to ``limit`` texts of conversation ``cid`` (0: the saved memories) that have no
        vector of ``model`` for their current text; none for a deleted or incognito one.

        ``turn``: only that turn's texts are read and compared with what was embedded; of the
        rest, those without a vector (a turn imported, a catch-up cut short). None: all."""
        stored = {key: (m, d) for key, m, d in self._conn.execute(STORED, (cid,))}
        if cid == 0:
            texts = [(key, 0, text) for key, text in self._conn.execute(MEMORIES)]
        elif self._conn.execute(READABLE, (cid,)).fetchone() is None:
            return []
        elif turn is None:
            texts = [(key, cid, body[:EMBED_CHARS]) for key, body, _ in
                     self._conn.execute(MESSAGES, conversation_rowid_range(cid))]
            texts += [(-key, -cid, text[:EMBED_CHARS]) for key, text in self._conn.execute(CHUNKS, (cid,))]
        else:
            texts = [(key, cid, body[:EMBED_CHARS]) for key, body, _ in
                     self._conn.execute(MESSAGES, turn_message_range(cid, turn))]
            noted = {key for key, _, _ in texts}
            missing = [key for (key,) in self._conn.execute(MESSAGE_KEYS, conversation_rowid_range(cid))
                       if key not in noted and stored.get(key, ("",))[0] != model][:limit]
            texts += [(key, cid, self._conn.execute(MESSAGE, (key,)).fetchone()[0][:EMBED_CHARS]) for key in missing]
        found: list[Piece] = []
        for key, group, text in texts:
            if text.strip() and stored.get(key) != (model, digest(text)):
                found.append(Piece(key, group, text))
                if len(found) == limit:
                    break
        return found

    def put(self, model: str, pieces: Sequence[Piece], blobs: Sequence[bytes]) -> list[Piece]:
        """Store the vectors (``b""``: the embedder refused the text) of these pieces, each only
        while its text is still the one embedded and its conversation readable; those stored."""
        stored: list[Piece] = []
        with immediate_transaction(self._conn):
            for piece, blob in zip(pieces, blobs):
                if self._current(piece):
                    conversation = abs(piece.group)
                    self._conn.execute(PUT, (piece.key, conversation, model, digest(piece.text), blob))
                    stored.append(piece)
        return stored

    def _current(self, piece: Piece) -> bool:
        if piece.group == 0:
            row = self._conn.execute("SELECT text FROM memories WHERE id = ?", (piece.key,)).fetchone()
            return row is not None and row[0] == piece.text
        if self._conn.execute(READABLE, (abs(piece.group),)).fetchone() is None:
            return False
        if piece.key < 0:
            row = self._conn.execute("SELECT text FROM attachment_chunks WHERE id = ?", (-piece.key,)).fetchone()
        else:
            row = self._conn.execute(MESSAGE, (piece.key,)).fetchone()
        return row is not None and row[0][:EMBED_CHARS] == piece.text

    def load(self, model: str) -> list[tuple[int, int, bytes]]:
        """Every vector of ``model``: (key, group, blob)."""
        rows = self._conn.execute(LOAD, (model,)).fetchall()
        return [(key, -conversation if key < 0 else conversation, blob) for key, conversation, blob in rows]

    def _valid(self, key: int, model: str, text: str) -> bool:
        """Whether ``key``'s vector is still there and of ``text`` as it is now."""
        row = self._conn.execute(STORED_ROW, (key, model)).fetchone()
        return row is not None and row[0] == digest(text[:EMBED_CHARS])

    def own(self, cid: int, keys: Sequence[int], model: str, through: int) -> list[ArchiveHit]:
        """The hits of these keys in conversation ``cid``'s archive: messages of turns
        1..``through``, chunks of its files; those whose vector is stale left out."""
        hits: list[ArchiveHit] = []
        if self._conn.execute(READABLE, (cid,)).fetchone() is None:
            return hits
        for key in keys:
            if key < 0:
                row = self._conn.execute(CHUNK, (-key,)).fetchone()
                if row is None or row[0] != cid or not self._valid(key, model, row[6]):
                    continue
                _, turn, name, attachment, ordinal, page, text, kind = row
                hits.append(ArchiveHit(turn, text, 0.0, file=name, attachment=attachment, chunk=ordinal, page=page,
                                       kind=kind))
                continue
            conversation, turn, n = split_rowid(key)
            row = self._conn.execute(MESSAGE, (key,)).fetchone()
            if conversation == cid and turn <= through and row is not None and self._valid(key, model, row[0]):
                hits.append(ArchiveHit(turn, row[0], 0.0, n=n, role=row[1]))
        return hits

    def others(self, cid: int, keys: Sequence[int], model: str) -> list[ElsewhereHit]:
        """The hits of these message keys in readable conversations other than ``cid``: what the
        user said there (an old answer is not the user's memory, as for the keyword search)."""
        hits: list[ElsewhereHit] = []
        for key in keys:
            conversation, turn, n = split_rowid(key)
            if key < 0 or conversation in (0, cid):
                continue
            readable = self._conn.execute(READABLE_TURN, (conversation, turn)).fetchone()
            row = self._conn.execute(MESSAGE, (key,)).fetchone()
            if readable is not None and row is not None and row[1] == "user" and self._valid(key, model, row[0]):
                hits.append(ElsewhereHit(conversation, readable[0], readable[1], turn, n, row[1], row[0], 0.0))
        return hits

    def memories(self, keys: Sequence[int], model: str) -> list[int]:
        """Those of these memory ids whose vector is of their text as it is now."""
        valid = []
        for key in keys:
            row = self._conn.execute("SELECT text FROM memories WHERE id = ?", (key,)).fetchone()
            if row is not None and self._valid(key, model, row[0]):
                valid.append(key)
        return valid
