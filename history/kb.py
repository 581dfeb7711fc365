"""Knowledge-base tables: KBs, their documents and chunks, vectors and links.

``KnowledgeStore`` shares the ``HistoryStore``'s connection (``store.kb``): the same
history thread, every write method one transaction. It knows nothing of files, chunking
or numpy: ``kbinject`` hands it rows.

A chunk's id is ``kb_id << 32 | n`` with ``n`` counted up per KB and never reused
(``kbs.next_chunk``). Each KB therefore owns one contiguous rowid range: removing a KB
is a range delete, a search scoped to some KBs is a ``rowid BETWEEN`` per KB, which
FTS5 answers by seeking inside its doclists, and the KB of a chunk is its id shifted.
Every method leans on that layout. ``kb_chunk_fts`` is an external-content FTS5 table
over ``kb_chunks.text`` kept in step by triggers (history/migrations.py m006).

Keyword search ranks by FTS5's ``bm25()``, which reads every chunk the MATCH finds (its
size from the docsize table, its term positions): a word that many chunks of a big KB
hold would cost more than the rest of the turn's search (``bench/bench_kb.py``). So
a search ranks about ``RANKED_CHUNKS`` chunks at most (docs/DESIGN.md, "Knowledge-base ranking"):

- each quoted word (phrase) is counted in the searched KBs, each count stopping at
  ``RANKED_CHUNKS + 1``;
- the rarest phrases whose counts add up to at most ``RANKED_CHUNKS`` are *weighed*:
  bm25 ranks the chunks holding any of them. When every phrase fits (any KB of up to
  ``RANKED_CHUNKS`` chunks, and most questions) the ranking is exactly bm25;
- **the approximation**: the other phrases (its commonest words) find and score nothing;
- a question of frequent phrases only has nothing cheap to rank by: its matches come
  newest first, with score 0 (as conversation search does, history/search.py).

bm25's IDF is computed over every KB's chunks (FTS5 walks each weighed phrase's whole
doclist); only the ranking is confined to the searched KBs. Soft-deleted conversations
see no KB: ``linked`` returns nothing for them, and linking one is refused.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from .migrations import immediate_transaction
from .records import FromRow, column
from .sql import IS_LIVE_CONVERSATION

__all__ = [
    "KB_CHUNK_SHIFT",
    "MAX_KB_ID",
    "RANKED_CHUNKS",
    "KbChunk",
    "KbDocument",
    "KnowledgeBase",
    "KnowledgeStore",
    "NewKbDocument",
    "chunk_kb",
    "kb_chunk_range",
]

KB_CHUNK_SHIFT = 32
# The most chunks one keyword search ranks, about (module docstring).
RANKED_CHUNKS = 2_000
# The id must stay below 2**31 so `kb_id << 32 | n` fits SQLite's signed 64-bit rowid.
MAX_KB_ID = (1 << 31) - 1
MAX_CHUNKS_PER_KB = (1 << KB_CHUNK_SHIFT) - 1

KB_COLUMNS = """
k.id, k.name, k.linked_all, k.created_at,
(SELECT count(*) FROM kb_documents AS d WHERE d.kb_id = k.id) AS documents,
(SELECT coalesce(sum(d.chunks), 0) FROM kb_documents AS d WHERE d.kb_id = k.id) AS chunks,
(SELECT coalesce(sum(d.pages), 0) FROM kb_documents AS d WHERE d.kb_id = k.id) AS pages
"""
# A KB being removed is renamed to REMOVING and its id first (no user's name has a control
# character), so it is gone from every list at once while its chunks go in batches (a hit
# read back for a search that began before is dropped too: SELECT_CHUNK)
REMOVING = "\x01removing "
SELECT_KBS = f"SELECT {KB_COLUMNS} FROM kbs AS k WHERE substr(k.name, 1, 1) <> char(1) ORDER BY k.name"
SELECT_KBS_BEING_REMOVED = "SELECT id FROM kbs WHERE substr(name, 1, 1) = char(1) ORDER BY id"
SELECT_KB_IDS = "SELECT id FROM kbs WHERE substr(name, 1, 1) <> char(1) ORDER BY id"
SET_KB_REMOVING = "UPDATE kbs SET name = ?, linked_all = 0 WHERE id = ?"
SELECT_KB = f"SELECT {KB_COLUMNS} FROM kbs AS k WHERE k.name = ?"
SELECT_KB_IDS_NAMED = "SELECT name, id FROM kbs WHERE name IN (SELECT value FROM json_each(?))"
INSERT_KB = "INSERT INTO kbs (name, created_at) VALUES (?, ?)"
# Live conversations only: a deleted one keeps its link rows but never shows them.
SELECT_LINKED_CONVERSATIONS = """
SELECT l.conversation_id FROM kb_links AS l JOIN conversations AS c ON c.id = l.conversation_id
WHERE l.kb_id = ? AND c.deleted_at IS NULL
ORDER BY l.conversation_id
"""
SELECT_LINKED_KBS = f"""
SELECT {KB_COLUMNS} FROM kbs AS k
WHERE k.linked_all = 1
   OR EXISTS (SELECT 1 FROM kb_links AS l WHERE l.kb_id = k.id AND l.conversation_id = ?)
ORDER BY k.name
"""
SELECT_LINKED_KB_IDS = """
SELECT k.id FROM kbs AS k
WHERE k.linked_all = 1
   OR EXISTS (SELECT 1 FROM kb_links AS l WHERE l.kb_id = k.id AND l.conversation_id = ?)
ORDER BY k.id
"""
INSERT_LINK = """
INSERT OR IGNORE INTO kb_links (kb_id, conversation_id, created_at) VALUES (?, ?, ?)
"""
DELETE_LINK = "DELETE FROM kb_links WHERE kb_id = ? AND conversation_id = ?"
SET_LINKED_ALL = "UPDATE kbs SET linked_all = ? WHERE id = ?"

DOCUMENT_COLUMNS = """
d.id, d.kb_id, d.path, d.name, d.kind, d.sha256, d.size_bytes, d.mtime_ns, d.pages,
d.chunks, d.truncated, d.added_at
"""
SELECT_DOCUMENTS = f"SELECT {DOCUMENT_COLUMNS} FROM kb_documents AS d WHERE d.kb_id = ? ORDER BY d.path"
SELECT_DOCUMENT = f"SELECT {DOCUMENT_COLUMNS} FROM kb_documents AS d WHERE d.kb_id = ? AND d.path = ?"
INSERT_DOCUMENT = """
INSERT INTO kb_documents (kb_id, path, name, kind, sha256, size_bytes, mtime_ns, pages, chunks,
                          truncated, added_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""
SET_DOCUMENT_MTIME = "UPDATE kb_documents SET mtime_ns = ? WHERE id = ?"
SELECT_DOCUMENT_CHUNK_IDS = "SELECT id FROM kb_chunks WHERE document_id = ? ORDER BY id"
DELETE_DOCUMENT_VECTORS = """
DELETE FROM kb_vectors WHERE chunk_id IN (SELECT id FROM kb_chunks WHERE document_id = ?)
"""
DELETE_DOCUMENT_CHUNKS = "DELETE FROM kb_chunks WHERE document_id = ?"
DELETE_DOCUMENT = "DELETE FROM kb_documents WHERE id = ?"
TAKE_CHUNK_IDS = "UPDATE kbs SET next_chunk = next_chunk + ? WHERE id = ? RETURNING next_chunk"
INSERT_CHUNK = "INSERT INTO kb_chunks (id, document_id, ordinal, page, text) VALUES (?, ?, ?, ?, ?)"

DELETE_RANGE_VECTORS = "DELETE FROM kb_vectors WHERE chunk_id BETWEEN ? AND ?"
DELETE_RANGE_CHUNKS = "DELETE FROM kb_chunks WHERE id BETWEEN ? AND ?"
DELETE_KB_DOCUMENTS = "DELETE FROM kb_documents WHERE kb_id = ?"
DELETE_KB_LINKS = "DELETE FROM kb_links WHERE kb_id = ?"
DELETE_KB = "DELETE FROM kbs WHERE id = ?"
SELECT_CHUNK_BATCH_END = """
SELECT max(id) FROM (SELECT id FROM kb_chunks WHERE id BETWEEN ? AND ? ORDER BY id LIMIT ?)
"""

# A chunk is pending while it has no vector of the model in the dimension the model gives
# now (NULL: not known yet, any dimension will do): after the model behind the name
# changed, the vectors of the old one are embedded again.
SELECT_PENDING = """
SELECT c.id, c.text FROM kb_chunks AS c
WHERE c.id BETWEEN ? AND ?
  AND NOT EXISTS (SELECT 1 FROM kb_vectors AS v WHERE v.chunk_id = c.id AND v.model = ? AND v.dim = coalesce(?, v.dim))
ORDER BY c.id
LIMIT ?
"""
COUNT_PENDING = """
SELECT count(*) FROM kb_chunks AS c
WHERE c.id BETWEEN ? AND ?
  AND NOT EXISTS (SELECT 1 FROM kb_vectors AS v WHERE v.chunk_id = c.id AND v.model = ? AND v.dim = coalesce(?, v.dim))
"""
COUNT_VECTORS = """
SELECT count(*) FROM kb_vectors WHERE model = ? AND dim = coalesce(?, dim) AND chunk_id BETWEEN ? AND ?
"""
# Stored only while the chunk still exists: its document may have been replaced while
# the embedder worked on it.
INSERT_VECTOR = """
INSERT OR REPLACE INTO kb_vectors (chunk_id, model, dim, vector)
SELECT ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM kb_chunks WHERE id = ?)
"""
SELECT_VECTOR_DIMS = "SELECT dim, count(*) FROM kb_vectors WHERE model = ? GROUP BY dim"
SELECT_VECTORS = """
SELECT chunk_id, vector FROM kb_vectors
WHERE model = ? AND dim = ? AND chunk_id > ?
ORDER BY chunk_id
LIMIT ?
"""
# The ids come as one JSON array: one statement (one plan, cached) whatever their number,
# each id a primary-key lookup.
SELECT_VECTORS_OF = """
SELECT chunk_id, vector FROM kb_vectors
WHERE model = ? AND chunk_id IN (SELECT value FROM json_each(?))
"""

# bm25() is negative, best first; `rowid BETWEEN` scopes to one KB (or to every one).
ALL_CHUNKS = (0, (1 << 63) - 1)
COUNT_IN_RANGE = """
SELECT count(*) FROM (
    SELECT 1 FROM kb_chunk_fts WHERE kb_chunk_fts MATCH ? AND rowid BETWEEN ? AND ? LIMIT ?
)
"""
NEWEST_IN_RANGE = """
SELECT rowid, 0.0 AS score FROM kb_chunk_fts
WHERE kb_chunk_fts MATCH ? AND rowid BETWEEN ? AND ?
ORDER BY rowid DESC
LIMIT ?
"""
SEARCH_CHUNKS_IN_RANGE = """
SELECT rowid, bm25(kb_chunk_fts) AS score FROM kb_chunk_fts
WHERE kb_chunk_fts MATCH ? AND rowid BETWEEN ? AND ?
ORDER BY score
LIMIT ?
"""
CHUNK_COLUMNS = """
c.id, d.kb_id, k.name AS kb, c.document_id, d.path, d.name, d.kind, c.ordinal,
d.chunks, c.page, c.text
"""
SELECT_CHUNK = f"""
SELECT {CHUNK_COLUMNS}
FROM kb_chunks AS c
JOIN kb_documents AS d ON d.id = c.document_id
JOIN kbs AS k ON k.id = d.kb_id
WHERE c.id = ? AND substr(k.name, 1, 1) <> char(1)
"""
SELECT_DOCUMENT_CHUNKS = f"""
SELECT {CHUNK_COLUMNS}
FROM kb_chunks AS c
JOIN kb_documents AS d ON d.id = c.document_id
JOIN kbs AS k ON k.id = d.kb_id
WHERE d.kb_id = ? AND d.path = ?
ORDER BY c.ordinal
"""


def kb_chunk_range(kb_id: int) -> tuple[int, int]:
    """Inclusive (lo, hi) ids of every chunk of one KB."""
    if not 0 < kb_id <= MAX_KB_ID:
        raise ValueError(f"knowledge base id {kb_id} out of range")
    lo = kb_id << KB_CHUNK_SHIFT
    return lo, lo | MAX_CHUNKS_PER_KB


def chunk_kb(chunk_id: int) -> int:
    """The id of the KB a chunk belongs to."""
    return chunk_id >> KB_CHUNK_SHIFT


@dataclass
class KnowledgeBase(FromRow):
    """One knowledge base, with what it holds and where it is linked."""

    id: int
    name: str
    linked_all: bool = field(metadata=column(convert=bool))  # linked to every conversation
    created_at: str
    documents: int
    chunks: int
    pages: int  # PDF pages over all its documents
    conversations: list[int]  # the live conversations it is linked to one by one


@dataclass
class KbDocument(FromRow):
    """One file of a KB as it was when last added."""

    id: int
    kb_id: int
    path: str
    name: str
    kind: str
    sha256: str
    size_bytes: int
    mtime_ns: int
    pages: int | None
    chunks: int
    truncated: bool = field(metadata=column(convert=bool))
    added_at: str


@dataclass
class NewKbDocument:
    """A file to store in a KB, with its chunks as (page, text) in order."""

    path: str
    name: str
    kind: str
    sha256: str
    size_bytes: int
    mtime_ns: int
    pages: int | None
    truncated: bool
    chunks: Sequence[tuple[int | None, str]]


@dataclass
class KbChunk(FromRow):
    """One stored chunk with the document and KB it comes from."""

    id: int
    kb_id: int
    kb: str
    document_id: int
    path: str
    name: str  # the document's file name
    kind: str
    ordinal: int  # 1-based within the document
    chunks: int  # how many chunks the document has
    page: int | None
    text: str


class KnowledgeStore:
    """The KB tables, on the HistoryStore's connection and thread."""

    def __init__(self, conn: sqlite3.Connection, now: Callable[[], str]) -> None:
        self._conn = conn
        self._now = now

    # -- knowledge bases -------------------------------------------------------------

    def _kb(self, name: str) -> KnowledgeBase | None:
        row = self._conn.execute(SELECT_KB, (name,)).fetchone()
        return self._with_links(row) if row else None

    def _is_live(self, cid: int) -> bool:
        return self._conn.execute(IS_LIVE_CONVERSATION, (cid,)).fetchone() is not None

    def _with_links(self, row: sqlite3.Row) -> KnowledgeBase:
        linked = [r[0] for r in self._conn.execute(SELECT_LINKED_CONVERSATIONS, (row["id"],))]
        return KnowledgeBase.from_row(row, conversations=linked)

    def get(self, name: str) -> KnowledgeBase | None:
        """The KB of that name, None if there is none."""
        return self._kb(name)

    def ids(self) -> list[int]:
        """The ids of every KB (not one being removed): a search of all, without counts."""
        return [row[0] for row in self._conn.execute(SELECT_KB_IDS)]

    def ids_named(self, names: Sequence[str]) -> dict[str, int]:
        """The ids of the KBs of these names that exist, by name: a search's scope, without counts."""
        return {row[0]: row[1] for row in self._conn.execute(SELECT_KB_IDS_NAMED, (json.dumps(list(names)),))}

    def ensure(self, name: str) -> tuple[KnowledgeBase, bool]:
        """The KB of that name, created if missing; and whether it was created."""
        with immediate_transaction(self._conn):
            found = self._kb(name)
            if found is not None:
                return found, False
            cursor = self._conn.execute(INSERT_KB, (name, self._now()))
            assert cursor.lastrowid is not None
            if cursor.lastrowid > MAX_KB_ID:
                raise ValueError("too many knowledge bases were created; no id is left")
            created = self._kb(name)
        assert created is not None
        return created, True

    def all(self) -> list[KnowledgeBase]:
        """Every KB, by name."""
        return [self._with_links(row) for row in self._conn.execute(SELECT_KBS).fetchall()]

    def delete_chunks(self, kb_id: int, limit: int) -> int:
        """Delete up to ``limit`` of a KB's chunks (and their vectors); how many went.

        Removing a big KB goes a batch at a time, each its own transaction, so the
        history thread serves turns between batches instead of stalling for seconds
        (FTS5 writes a tombstone per token of every deleted chunk).
        """
        lo, hi = kb_chunk_range(kb_id)
        with immediate_transaction(self._conn):
            last = self._conn.execute(SELECT_CHUNK_BATCH_END, (lo, hi, limit)).fetchone()[0]
            if last is None:
                return 0
            self._conn.execute(DELETE_RANGE_VECTORS, (lo, last))
            return int(self._conn.execute(DELETE_RANGE_CHUNKS, (lo, last)).rowcount)

    def begin_remove(self, name: str) -> KnowledgeBase | None:
        """Take a KB out of every list and link, in one transaction; the KB as it was (None if
        missing). Then ``delete_chunks`` until it returns 0, and ``remove`` the rest: a removal
        cut short (a stop, a full disk) is finished by ``being_removed`` and the same two."""
        with immediate_transaction(self._conn):
            kb = self._kb(name)
            if kb is None:
                return None
            self._conn.execute(SET_KB_REMOVING, (f"{REMOVING}{kb.id}", kb.id))
            self._conn.execute(DELETE_KB_LINKS, (kb.id,))
        return kb

    def being_removed(self) -> list[int]:
        """The ids of the KBs whose removal began and did not end."""
        return [row[0] for row in self._conn.execute(SELECT_KBS_BEING_REMOVED)]

    def remove(self, kb_id: int) -> None:
        """Delete a KB ``begin_remove`` took out, with what is left of its chunks and vectors."""
        lo, hi = kb_chunk_range(kb_id)
        with immediate_transaction(self._conn):
            self._conn.execute(DELETE_RANGE_VECTORS, (lo, hi))
            self._conn.execute(DELETE_RANGE_CHUNKS, (lo, hi))
            self._conn.execute(DELETE_KB_DOCUMENTS, (kb_id,))
            self._conn.execute(DELETE_KB_LINKS, (kb_id,))
            self._conn.execute(DELETE_KB, (kb_id,))

    def set_link(self, name: str, cid: int | None, linked: bool) -> KnowledgeBase | None:
        """Link (or unlink) a KB to one conversation, or to every one when cid is None.

        None when the KB is missing; LookupError when cid names a missing or deleted
        conversation.
        """
        with immediate_transaction(self._conn):
            kb = self._kb(name)
            if kb is None:
                return None
            if cid is None:
                self._conn.execute(SET_LINKED_ALL, (int(linked), kb.id))
            elif not self._is_live(cid):
                raise LookupError(f"conversation {cid} not found")
            elif linked:
                self._conn.execute(INSERT_LINK, (kb.id, cid, self._now()))
            else:
                self._conn.execute(DELETE_LINK, (kb.id, cid))
            return self._kb(name)

    def linked(self, cid: int) -> list[KnowledgeBase]:
        """The KBs a live conversation sees (its own links and the linked-to-all); [] if deleted."""
        if not self._is_live(cid):
            return []
        rows = self._conn.execute(SELECT_LINKED_KBS, (cid,)).fetchall()
        return [self._with_links(row) for row in rows]

    def linked_ids(self, cid: int, *, live: bool = False) -> list[int]:
        """The ids of the KBs a live conversation sees: the per-turn check, without counts.
        ``live``: the caller has just read the conversation as live in this transaction."""
        if not live and not self._is_live(cid):
            return []
        return [row[0] for row in self._conn.execute(SELECT_LINKED_KB_IDS, (cid,))]

    # -- documents and chunks --------------------------------------------------------

    def documents(self, kb_id: int) -> list[KbDocument]:
        """The KB's documents, by path."""
        return [KbDocument.from_row(r) for r in self._conn.execute(SELECT_DOCUMENTS, (kb_id,))]

    def _delete_document(self, document_id: int) -> list[int]:
        removed = [row[0] for row in self._conn.execute(SELECT_DOCUMENT_CHUNK_IDS, (document_id,))]
        self._conn.execute(DELETE_DOCUMENT_VECTORS, (document_id,))
        self._conn.execute(DELETE_DOCUMENT_CHUNKS, (document_id,))
        self._conn.execute(DELETE_DOCUMENT, (document_id,))
        return removed

    def put_document(self, kb_id: int, document: NewKbDocument) -> tuple[KbDocument, list[int], list[int]]:
        """Store a document and its chunks, replacing the one at the same path.

        Returns the stored document, the new chunk ids (in order) and the ids of the
        chunks it replaced (their vectors are gone with them).
        """
        lo, _ = kb_chunk_range(kb_id)
        count = len(document.chunks)
        with immediate_transaction(self._conn):
            old = self._conn.execute(SELECT_DOCUMENT, (kb_id, document.path)).fetchone()
            removed = self._delete_document(old["id"]) if old else []
            following = self._conn.execute(TAKE_CHUNK_IDS, (count, kb_id)).fetchone()
            if following is None:
                raise LookupError(f"knowledge base {kb_id} not found")
            first = following[0] - count
            if following[0] - 1 > MAX_CHUNKS_PER_KB:
                raise ValueError("this knowledge base has used up its chunk ids; remove it and add it again")
            cursor = self._conn.execute(
                INSERT_DOCUMENT,
                (kb_id, document.path, document.name, document.kind, document.sha256,
                 document.size_bytes, document.mtime_ns, document.pages, count,
                 int(document.truncated), self._now()),
            )
            document_id = cursor.lastrowid
            ids = [lo | (first + n) for n in range(count)]
            self._conn.executemany(
                INSERT_CHUNK,
                [(chunk_id, document_id, n, page, text)
                 for n, (chunk_id, (page, text)) in enumerate(zip(ids, document.chunks), start=1)],
            )
            stored = self._conn.execute(SELECT_DOCUMENT, (kb_id, document.path)).fetchone()
        return KbDocument.from_row(stored), ids, removed

    def set_mtime(self, document_id: int, mtime_ns: int) -> None:
        """Record a new modification time for a document whose content did not change."""
        with immediate_transaction(self._conn):
            self._conn.execute(SET_DOCUMENT_MTIME, (mtime_ns, document_id))

    def remove_documents(self, kb_id: int, paths: Iterable[str]) -> list[int]:
        """Delete the KB's documents at these paths; the ids of the chunks that went."""
        removed: list[int] = []
        with immediate_transaction(self._conn):
            for path in paths:
                row = self._conn.execute(SELECT_DOCUMENT, (kb_id, path)).fetchone()
                if row is not None:
                    removed += self._delete_document(row["id"])
        return removed

    def document_chunks(self, kb_id: int, path: str) -> list[KbChunk]:
        """Every chunk of one document, in order."""
        return [KbChunk.from_row(r) for r in self._conn.execute(SELECT_DOCUMENT_CHUNKS, (kb_id, path))]

    def chunks(self, ids: Sequence[int]) -> list[KbChunk]:
        """The chunks with these ids, in the order given; missing ones left out."""
        found = []
        for chunk_id in ids:
            row = self._conn.execute(SELECT_CHUNK, (chunk_id,)).fetchone()
            if row is not None:
                found.append(KbChunk.from_row(row))
        return found

    def chunks_and_vectors(
        self, model: str, ids: Sequence[int], vector_ids: Sequence[int]
    ) -> tuple[list[KbChunk], list[tuple[int, bytes]]]:
        """``chunks(ids)`` and ``vectors_of(model, vector_ids)``: a search's hits and the vectors
        that score them, read in one trip."""
        return self.chunks(ids), self.vectors_of(model, vector_ids)

    def search(self, phrases: Sequence[str], kb_ids: Sequence[int] | None, limit: int) -> list[tuple[int, float]]:
        """(chunk id, bm25) of the best matches of any of ``phrases`` (each already quoted), best first.

        ``kb_ids`` None searches every KB. At most about ``RANKED_CHUNKS`` chunks are
        ranked (module docstring); bm25 shares one corpus statistic across the table,
        so scores from different KBs compare. Matches of only frequent phrases come
        newest first, with score 0.
        """
        if not phrases or limit <= 0:
            return []
        ranges = [ALL_CHUNKS] if kb_ids is None else [kb_chunk_range(kb_id) for kb_id in kb_ids]
        held = self._held(phrases, ranges)
        found = [phrase for phrase in phrases if held[phrase]]  # the others add nothing but their IDF walk
        if not found:
            return []
        weighed = _weighed(found, held)
        sql = SEARCH_CHUNKS_IN_RANGE if weighed else NEWEST_IN_RANGE
        match = " OR ".join(weighed or found)
        hits: list[tuple[int, float]] = []
        for lo, hi in ranges:
            hits += [(r[0], r[1]) for r in self._conn.execute(sql, (match, lo, hi, limit))]
        hits.sort(key=(lambda hit: hit[1]) if weighed else (lambda hit: -hit[0]))
        return hits[:limit]

    def _held(self, phrases: Sequence[str], ranges: Sequence[tuple[int, int]]) -> dict[str, int]:
        """How many chunks of ``ranges`` hold each phrase, counted up to RANKED_CHUNKS + 1."""
        held: dict[str, int] = {}
        for phrase in phrases:
            count = 0
            for lo, hi in ranges:
                count += self._conn.execute(COUNT_IN_RANGE, (phrase, lo, hi, RANKED_CHUNKS + 1 - count)).fetchone()[0]
                if count > RANKED_CHUNKS:
                    break
            held[phrase] = count
        return held

    # -- vectors ---------------------------------------------------------------------

    def pending_chunks(
        self, model: str, dim: int | None, kb_id: int, after: int, limit: int
    ) -> list[tuple[int, str]]:
        """(id, text) of up to ``limit`` chunks of a KB past id ``after`` with no vector of
        ``model`` of ``dim`` dimensions (None: of any)."""
        lo, hi = kb_chunk_range(kb_id)
        rows = self._conn.execute(SELECT_PENDING, (max(lo, after + 1), hi, model, dim, limit))
        return [(row[0], row[1]) for row in rows]

    def count_pending(self, model: str, dim: int | None, kb_id: int) -> int:
        """Chunks of a KB without a vector of ``model`` of ``dim`` dimensions (None: of any)."""
        lo, hi = kb_chunk_range(kb_id)
        return int(self._conn.execute(COUNT_PENDING, (lo, hi, model, dim)).fetchone()[0])

    def count_vectors(self, model: str, dim: int | None, kb_id: int) -> int:
        """Chunks of a KB with a vector of ``model`` of ``dim`` dimensions (None: of any)."""
        lo, hi = kb_chunk_range(kb_id)
        return int(self._conn.execute(COUNT_VECTORS, (model, dim, lo, hi)).fetchone()[0])

    def all_embedded(self, model: str, kb_id: int) -> bool:
        """Whether the KB has chunks, each with a vector of ``model`` of some size."""
        return not self.count_pending(model, None, kb_id) and bool(self.count_vectors(model, None, kb_id))

    def put_vectors(self, model: str, dim: int, rows: Sequence[tuple[int, bytes]]) -> list[int]:
        """Store vectors of chunks that still exist; the ids stored."""
        stored = []
        with immediate_transaction(self._conn):
            for chunk_id, blob in rows:
                if self._conn.execute(INSERT_VECTOR, (chunk_id, model, dim, blob, chunk_id)).rowcount:
                    stored.append(chunk_id)
        return stored

    def vector_dims(self, model: str) -> dict[int, int]:
        """{dimension: vectors} stored for ``model`` (one entry unless the model changed)."""
        return {row[0]: row[1] for row in self._conn.execute(SELECT_VECTOR_DIMS, (model,))}

    def vectors(self, model: str, dim: int, after: int, limit: int) -> list[tuple[int, bytes]]:
        """(chunk id, blob) of ``model``'s vectors of ``dim``, by id, past ``after``: a page to load."""
        return [(row[0], row[1]) for row in self._conn.execute(SELECT_VECTORS, (model, dim, after, limit))]

    def vectors_of(self, model: str, ids: Sequence[int]) -> list[tuple[int, bytes]]:
        """(chunk id, blob) of ``model``'s vectors of these chunks, those that have one, in no order."""
        if not ids:
            return []
        listed = "[" + ",".join(str(int(chunk_id)) for chunk_id in ids) + "]"
        return [(row[0], row[1]) for row in self._conn.execute(SELECT_VECTORS_OF, (model, listed))]


def _weighed(phrases: Sequence[str], held: dict[str, int]) -> list[str]:
    """The rarest phrases that together hold at most RANKED_CHUNKS chunks, in the question's order."""
    kept: set[str] = set()
    total = 0
    for phrase in sorted(phrases, key=held.__getitem__):
        if total + held[phrase] > RANKED_CHUNKS:
            break
        kept.add(phrase)
        total += held[phrase]
    return [phrase for phrase in phrases if phrase in kept]
