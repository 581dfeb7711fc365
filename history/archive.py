"""A conversation's archive for recall injection: its folded turns and its files' text.

``ArchiveStore`` shares the ``HistoryStore``'s connection (``store.archive``), as the
knowledge-base tables do. It knows nothing of chunking or of what is relevant: kbinject
(archive.py) hands it the chunks of a file and the quoted keywords of a question, and
ranks, floors and labels what comes back.

Two FTS5 indexes are searched, each by bm25, each only within the conversation:

- ``message_fts`` (history/fts.py), over the rowids of turns 1..``through``: the turns a
  compaction folded away (summary slots left out: the summary is in the prompt already);
- ``attachment_chunk_fts`` over ``attachment_chunks``, the full text in chunks of the
  conversation's files that are out of the prompt, one rowid range per file
  (``attachment_id << CHUNK_SHIFT | n``): a file is out unless its question carried its
  whole text (``sent_whole``) and the prompt replays that question whole (``inline``). The
  chunks are made lazily, the first time a search takes the file: files that never leave
  the prompt cost nothing.

Nothing out of the prompt (no turn up to ``through``, no file out): no search at all, and
``ArchiveFound.searched`` says so.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from . import sql
from .fts import MAX_MESSAGE_INDEX, match_holding, message_rowid, must_hold, split_rowid
from .migrations import immediate_transaction

__all__ = ["NOTHING_OUT", "ArchiveFound", "ArchiveHit", "ArchiveStore", "CHUNK_SHIFT", "FileToChunk"]

CHUNK_SHIFT = 16  # an attachment's chunks: attachment_id << 16 | n (n from 1)
MAX_CHUNKS = (1 << CHUNK_SHIFT) - 1

SEARCH_MESSAGES = f"""
SELECT rowid, body, role, bm25(message_fts) AS score FROM message_fts
WHERE message_fts MATCH ? AND rowid BETWEEN ? AND ? AND (rowid & 255) <= {MAX_MESSAGE_INDEX}
ORDER BY score
LIMIT ?
"""
# the best chunks of one file, their text joined in the same statement (not looked up one by one)
SEARCH_FILE_CHUNKS = """
SELECT f.score, f.rowid, c.ordinal, c.page, c.text
FROM (SELECT rowid, bm25(attachment_chunk_fts) AS score FROM attachment_chunk_fts
      WHERE attachment_chunk_fts MATCH ? AND rowid BETWEEN ? AND ?
      ORDER BY score
      LIMIT ?) AS f
JOIN attachment_chunks AS c ON c.id = f.rowid
ORDER BY f.score
"""
# Counted in FTS5's own table of row sizes (one small row per message, the same rowids):
# counting message_fts itself in a range reads every message's text
COUNT_MESSAGES = f"""
SELECT count(*) FROM message_fts_docsize WHERE id BETWEEN ? AND ? AND (id & 255) <= {MAX_MESSAGE_INDEX}
"""
COUNT_MESSAGES_HOLDING = f"""
SELECT count(*) FROM (SELECT 1 FROM message_fts
WHERE message_fts MATCH ? AND rowid BETWEEN ? AND ? AND (rowid & 255) <= {MAX_MESSAGE_INDEX} LIMIT ?)
"""
ANY_MESSAGE = f"""
SELECT 1 FROM message_fts WHERE message_fts MATCH ? AND rowid BETWEEN ? AND ? AND (rowid & 255) <= {MAX_MESSAGE_INDEX}
LIMIT 1
"""
ANY_FILE_CHUNK = """
SELECT 1 FROM attachment_chunk_fts WHERE attachment_chunk_fts MATCH ? AND rowid BETWEEN ? AND ? LIMIT 1
"""
COUNT_FILE_CHUNKS = "SELECT count(*) FROM attachment_chunks WHERE id BETWEEN ? AND ?"
COUNT_FILE_CHUNKS_HOLDING = """
SELECT count(*) FROM (SELECT 1 FROM attachment_chunk_fts
WHERE attachment_chunk_fts MATCH ? AND rowid BETWEEN ? AND ? LIMIT ?)
"""
# The conversation's files with text, live conversations only; ``chunked`` says whether
# its chunks are those of its current text, ``sent_whole`` whether its question carried all of it.
SELECT_FILES = """
SELECT a.id, a.turn, a.name, a.chunked, a.kind, a.sent_whole
FROM attachments AS a JOIN conversations AS c ON c.id = a.conversation_id
WHERE a.conversation_id = ? AND c.deleted_at IS NULL AND a.full_text IS NOT NULL AND a.full_text != ''
ORDER BY a.id
"""
SELECT_FILE_TEXT = "SELECT id, name, kind, full_text FROM attachments WHERE id = ?"
FileRow = tuple[int, int, str, int, str, int]  # a row of SELECT_FILES
DELETE_FILE_CHUNKS = "DELETE FROM attachment_chunks WHERE id BETWEEN ? AND ?"
INSERT_FILE_CHUNK = "INSERT INTO attachment_chunks (id, attachment_id, ordinal, page, text) VALUES (?, ?, ?, ?, ?)"
SET_CHUNKED = "UPDATE attachments SET chunked = 1 WHERE id = ?"


@dataclass(frozen=True)
class FileToChunk:
    """A file whose text has no chunks yet (or stale ones): kbinject chunks it."""

    id: int
    name: str
    kind: str  # text, image, pdf, docx ... (a paged kind's text holds page breaks)
    text: str


@dataclass(frozen=True)
class ArchiveHit:
    """One match in the archive: a folded turn's message, or a chunk of a file; best first per kind."""

    turn: int  # the turn that said it, or that carried the file
    text: str  # the message's searchable text, or the chunk
    score: float  # bm25 (lower is better), comparable within its kind only
    n: int = -1  # a message's place in its turn (a file comes with the question: -1)
    role: str | None = None  # a message's role (user, assistant, tool)
    file: str | None = None  # a file's name
    attachment: int | None = None  # a file's id
    chunk: int | None = None  # a file chunk's ordinal
    page: int | None = None  # a paged file's page (a PDF's page, a deck's slide ...)
    kind: str | None = None  # a file's kind (pdf, pptx, text ...)


@dataclass(frozen=True)
class ArchiveFound:
    """A search of the archive: its matches, and the phrases too common in it to search by; or,
    when files of it have no chunks yet, those files (and no search: chunk them, then search);
    or ``searched`` False: nothing of the conversation is out of the prompt, nothing to search."""

    hits: list[ArchiveHit]
    common: frozenset[str]
    unchunked: list[FileToChunk] = field(default_factory=list)
    files: tuple[int, ...] = ()  # the ids of the files out of the prompt: those searched
    searched: bool = True


NOTHING_OUT = ArchiveFound([], frozenset(), searched=False)  # nothing of the conversation out of the prompt


def file_range(attachment_id: int) -> tuple[int, int]:
    """Inclusive rowid bounds of a file's chunks."""
    lo = attachment_id << CHUNK_SHIFT
    return lo, lo | MAX_CHUNKS


class ArchiveStore:
    """The recall queries over one conversation's archive, on the history's connection."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def out_of_prompt(self, cid: int, inline: Collection[int]) -> dict[int, FileRow]:
        """The conversation's files with text that the prompt does not hold whole, by id: all but
        those whose question carried their whole text when the prompt replays that question
        whole (its turn in ``inline``)."""
        return {row[0]: row for row in self._conn.execute(SELECT_FILES, (cid,)) if not (row[5] and row[1] in inline)}

    def texts(self, ids: Sequence[int]) -> list[FileToChunk]:
        """These files' names, kinds and text, to chunk."""
        return [FileToChunk(*self._conn.execute(SELECT_FILE_TEXT, (i,)).fetchone()) for i in ids]

    def put_chunks(self, attachment_id: int, chunks: Sequence[tuple[int | None, str]]) -> None:
        """Replace a file's chunks with ``chunks`` ((page, text), in order), in one transaction."""
        lo, hi = file_range(attachment_id)
        with immediate_transaction(self._conn):
            self._conn.execute(DELETE_FILE_CHUNKS, (lo, hi))
            self._conn.executemany(INSERT_FILE_CHUNK, [
                (lo + n, attachment_id, n, page, text) for n, (page, text) in enumerate(chunks[:MAX_CHUNKS], start=1)
            ])
            self._conn.execute(SET_CHUNKED, (attachment_id,))

    def search(
        self, cid: int, phrases: Sequence[str], through: int, before: int, limit: int, common: tuple[float, int],
        inline: Collection[int] = frozenset(), must: Sequence[Sequence[str]] = (),
    ) -> ArchiveFound:
        """The best matches of the rare ``phrases`` (each quoted) in turns 1..``through`` and in the
        conversation's files out of the prompt (``out_of_prompt``: ``inline`` are the turns the
        prompt replays whole), chunked: at most ``limit`` of each kind, best first within a kind;
        each holding a phrase of ``must``'s first list with a rare one (``match_holding``).

        A phrase is common when more than ``common`` = (share, least) of the conversation's pieces
        before turn ``before`` (its messages, its files' chunks) hold it, and at least ``least``:
        what most of it says tells no passage apart, and ranking its many matches is the cost.
        When no piece out of the prompt holds one of the question's own rare phrases that a match
        must hold, nothing is searched further: most questions are not about what was folded,
        and a short one's dozen borrowed phrases cost a count each (1.2 -> 0.3 ms a turn in
        ``bench_ttft.py --new-questions``).
        """
        if limit <= 0 or not self._conn.execute(sql.IS_LIVE_CONVERSATION, (cid,)).fetchone():
            return NOTHING_OUT
        files = self.out_of_prompt(cid, inline)
        if through <= 0 and not files:
            return NOTHING_OUT
        unchunked = [i for i, row in files.items() if not row[3]]  # in the same trip: most turns find none
        if unchunked:
            return ArchiveFound([], frozenset(), self.texts(unchunked), tuple(files))
        if not phrases:
            return ArchiveFound([], frozenset(), files=tuple(files))
        # the messages first: usually most of the pieces, so the files' few need no count
        ranges = [(COUNT_MESSAGES, COUNT_MESSAGES_HOLDING, message_rowid(cid, 1, 0),
                   message_rowid(cid, before - 1, MAX_MESSAGE_INDEX))] if before > 1 else []
        ranges += [(COUNT_FILE_CHUNKS, COUNT_FILE_CHUNKS_HOLDING, *file_range(f)) for f in files]
        sized = [(holding, lo, hi, self._conn.execute(count, (lo, hi)).fetchone()[0])
                 for count, holding, lo, hi in ranges]
        share, least = common
        pieces = sum(size for *_, size in sized)
        cap = max(least, int(share * pieces)) + 1  # a phrase held this often is common: counting stops there

        def common_of(some: Sequence[str]) -> set[str]:
            return {phrase for phrase in some if self._holding(phrase, sized, pieces, cap) >= cap}

        # the question's own phrases first: when none that a match must hold is out of the prompt,
        # nothing is found, and the recent turns' phrases (a dozen) need no count
        own = [phrase for phrase in phrases if any(phrase in words for words in must)]
        frequent = common_of(own)
        held = must_hold([phrase for phrase in own if phrase not in frequent], must)
        if held and not self._holds_any(" OR ".join(held), cid, through, files):
            return ArchiveFound([], frozenset(frequent), files=tuple(files))
        frequent |= common_of([phrase for phrase in phrases if phrase not in own])
        rare = [phrase for phrase in phrases if phrase not in frequent]
        if not rare:
            return ArchiveFound([], frozenset(frequent), files=tuple(files))
        match = match_holding(rare, must)
        hits: list[ArchiveHit] = []
        if through > 0:
            lo, hi = message_rowid(cid, 1, 0), message_rowid(cid, through, MAX_MESSAGE_INDEX)
            for rowid, body, role, score in self._conn.execute(SEARCH_MESSAGES, (match, lo, hi, limit)):
                _, turn, n = split_rowid(rowid)
                hits.append(ArchiveHit(turn, body, score, n=n, role=role))
        return ArchiveFound(hits + self._file_hits(files, match, limit), frozenset(frequent), files=tuple(files))

    def _holds_any(self, match: str, cid: int, through: int, files: dict[int, FileRow]) -> bool:
        """Whether a folded message (turns 1..``through``) or a chunk of one of ``files`` matches."""
        if through > 0:
            lo, hi = message_rowid(cid, 1, 0), message_rowid(cid, through, MAX_MESSAGE_INDEX)
            if self._conn.execute(ANY_MESSAGE, (match, lo, hi)).fetchone():
                return True
        return any(self._conn.execute(ANY_FILE_CHUNK, (match, *file_range(f))).fetchone() for f in files)

    def _holding(self, phrase: str, ranges: Sequence[tuple[str, int, int, int]], pieces: int, cap: int) -> int:
        """How many of the ``pieces`` of ``ranges`` (each with its size) hold ``phrase``, counted up
        to ``cap``; less when the ranges left uncounted could not make it reach ``cap``."""
        held = 0
        for holding, lo, hi, size in ranges:
            if held + pieces < cap:
                break
            held += self._conn.execute(holding, (phrase, lo, hi, cap - held)).fetchone()[0]
            pieces -= size
            if held >= cap:
                break
        return held

    def _file_hits(self, files: dict[int, FileRow], match: str, limit: int) -> list[ArchiveHit]:
        found: list[tuple[float, int, int, int | None, str, int]] = []
        for attachment_id in files:
            lo, hi = file_range(attachment_id)
            found += [(*row, attachment_id) for row in self._conn.execute(SEARCH_FILE_CHUNKS, (match, lo, hi, limit))]
        found.sort(key=lambda row: row[:2])
        hits = []
        for score, _, ordinal, page, text, attachment_id in found[:limit]:
            _, turn, name, _, kind, _ = files[attachment_id]
            hits.append(ArchiveHit(turn, text, score, file=name, attachment=attachment_id, chunk=ordinal, page=page,
                                   kind=kind))
        return hits
