"""HistoryStore: conversations, turns, attachments, compactions and the search index.

Knowledge-base tables are reached through ``store.kb`` (history/kb.py).

Synchronous on purpose: one connection, used from one thread (`AsyncHistory` in aio.py
supplies that thread for the daemon). It migrates in its constructor, and every write
method is one transaction. A turn's `message_fts` rows are rewritten in the same
transaction as the turn itself (no triggers), so search never disagrees with `turns`.

Lookups return None / False / [] for a missing or soft-deleted conversation; turning
that into a protocol error is the daemon's business, not the store's.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import sqlite3
from collections.abc import Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import Any

from . import search
from .fts import (
    MAX_TURN,
    TURN_SHIFT,
    conversation_rowid_range,
    index_summary,
    index_turn,
    load_messages,
    unindex_conversation,
)
from .kb import KnowledgeStore
from .migrations import immediate_transaction, migrate
from .records import (
    TIMESTAMP_FORMAT,
    TURN_STATUSES,
    Attachment,
    Compaction,
    Conversation,
    NewAttachment,
    SearchHit,
    Turn,
    TurnContext,
    TurnStatus,
)

logger = logging.getLogger(__name__)

MEMORY = ":memory:"

# WAL lets readers (the CLI, a backup) work while the daemon writes; NORMAL sync is
# durable across application crashes in WAL mode and much cheaper than FULL; the busy
# timeout rides out another process's short write instead of failing at once. With NORMAL
# the only fsyncs are a checkpoint's, and they were most of what storing a turn cost
# (bench/bench_search.py): checkpointing every 4,000 pages (a WAL of up to 16 MB)
# instead of SQLite's 1,000 pays them a quarter as often.
CONNECTION_PRAGMAS = (
    "PRAGMA journal_mode = WAL",
    "PRAGMA synchronous = NORMAL",
    "PRAGMA wal_autocheckpoint = 4000",
    "PRAGMA busy_timeout = 5000",
    "PRAGMA foreign_keys = ON",
)

DEFAULT_LIST_LIMIT = 50
DEFAULT_CONVERSATION_HITS = 5
DEFAULT_ALL_HITS = 20

CONVERSATION_SELECT = """
SELECT c.id, c.title, c.model, c.settings, c.ctx_used, c.created_at, c.updated_at,
       (SELECT count(*) FROM turns AS t WHERE t.conversation_id = c.id) AS turn_count
FROM conversations AS c
"""
SELECT_CONVERSATION = CONVERSATION_SELECT + "WHERE c.id = ? AND c.deleted_at IS NULL"
# id breaks ties between equal timestamps; the updated_at index already ends in rowid.
LIST_ORDER = "ORDER BY c.updated_at DESC, c.id DESC LIMIT ?"
LIST_CONVERSATIONS = CONVERSATION_SELECT + "WHERE c.deleted_at IS NULL " + LIST_ORDER
LIST_CONVERSATIONS_BEFORE = (
    CONVERSATION_SELECT
    + "WHERE c.deleted_at IS NULL AND c.updated_at < ? "
    + LIST_ORDER
)
IS_LIVE_CONVERSATION = "SELECT 1 FROM conversations WHERE id = ? AND deleted_at IS NULL"
INSERT_CONVERSATION = """
INSERT INTO conversations (title, model, created_at, updated_at) VALUES (?, ?, ?, ?)
"""
TOUCH_CONVERSATION = "UPDATE conversations SET updated_at = ? WHERE id = ?"
FINISH_CONVERSATION = """
UPDATE conversations SET ctx_used = coalesce(?, ctx_used), updated_at = ? WHERE id = ?
"""
UPDATE_CONVERSATION = "UPDATE conversations SET title = ?, model = ?, settings = ? WHERE id = ?"
SOFT_DELETE_CONVERSATION = """
UPDATE conversations SET deleted_at = ? WHERE id = ? AND deleted_at IS NULL
"""

TURN_COLUMNS = """
t.conversation_id, t.turn, t.text, t.files, t.messages, t.reply, t.status, t.error,
t.error_code, t.finish_reason, t.model, t.prompt_tokens, t.completion_tokens,
t.created_at, t.updated_at
"""
SELECT_TURNS = f"""
SELECT {TURN_COLUMNS}
FROM turns AS t JOIN conversations AS c ON c.id = t.conversation_id
WHERE t.conversation_id = ? AND c.deleted_at IS NULL
ORDER BY t.turn
"""
SELECT_TURN = f"""
SELECT {TURN_COLUMNS}
FROM turns AS t JOIN conversations AS c ON c.id = t.conversation_id
WHERE t.conversation_id = ? AND t.turn = ? AND c.deleted_at IS NULL
"""
# The row itself whatever became of its conversation: a turn still finishes (and is
# returned to the daemon) when its conversation was deleted while it ran.
SELECT_TURN_ROW = f"""
SELECT {TURN_COLUMNS} FROM turns AS t WHERE t.conversation_id = ? AND t.turn = ?
"""
NEXT_TURN = "SELECT coalesce(max(turn), 0) + 1 FROM turns WHERE conversation_id = ?"
ATTACHMENT_COLUMNS = """
a.id, a.conversation_id, a.turn, a.name, a.path, a.kind, a.content_type, a.size_bytes,
a.sha256, a.pages, a.created_at, a.full_text IS NOT NULL AND a.full_text != '' AS has_text
"""
# Joined to the conversation so a deleted conversation's files are gone too.
LIST_ATTACHMENTS = f"""
SELECT {ATTACHMENT_COLUMNS}
FROM attachments AS a JOIN conversations AS c ON c.id = a.conversation_id
WHERE a.conversation_id = ? AND c.deleted_at IS NULL
ORDER BY a.id
"""
HAS_ATTACHMENTS = """
SELECT EXISTS (
    SELECT 1 FROM attachments AS a JOIN conversations AS c ON c.id = a.conversation_id
    WHERE a.conversation_id = ? AND c.deleted_at IS NULL
)
"""
SELECT_ATTACHMENT = f"""
SELECT {ATTACHMENT_COLUMNS}, a.full_text
FROM attachments AS a JOIN conversations AS c ON c.id = a.conversation_id
WHERE a.conversation_id = ? AND a.id = ? AND c.deleted_at IS NULL
"""
INSERT_ATTACHMENT = """
INSERT INTO attachments (conversation_id, turn, name, path, kind, content_type, size_bytes,
                         sha256, pages, full_text, created_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""

# What a prompt replays: the turns after a compaction's last one that got a reply. A turn
# without any (an error before the first word) is left out: a question without an answer
# would break the alternation of roles many chat templates require.
SELECT_ANSWERED_TURNS = """
SELECT t.turn, t.messages FROM turns AS t JOIN conversations AS c ON c.id = t.conversation_id
WHERE t.conversation_id = ? AND t.turn > ? AND t.turn < ? AND t.reply != ''
  AND c.deleted_at IS NULL
ORDER BY t.turn
"""

INSERT_TURN = """
INSERT INTO turns (conversation_id, turn, text, files, messages, status, model,
                   created_at, updated_at)
VALUES (?, ?, ?, ?, ?, 'running', ?, ?, ?)
"""
# Only a running turn takes checkpoints: a late one must not overwrite a final reply.
SAVE_PARTIAL = """
UPDATE turns SET reply = ? WHERE conversation_id = ? AND turn = ? AND status = 'running'
"""
FINISH_TURN = """
UPDATE turns
SET messages = ?, reply = ?, status = ?, finish_reason = ?, error = ?, error_code = ?,
    prompt_tokens = ?, completion_tokens = ?, updated_at = ?
WHERE conversation_id = ? AND turn = ?
"""
SELECT_RUNNING = "SELECT conversation_id, turn, messages, reply FROM turns WHERE status = 'running'"
INTERRUPT_TURN = """
UPDATE turns SET status = 'interrupted', messages = ?, updated_at = ?
WHERE conversation_id = ? AND turn = ?
"""

INSERT_COMPACTION = """
INSERT INTO compactions (conversation_id, through_turn, summary, created_at)
VALUES (?, ?, ?, ?)
"""
SELECT_COMPACTION_TURNS = "SELECT through_turn FROM compactions WHERE conversation_id = ?"
SELECT_LATEST_COMPACTION = """
SELECT k.id, k.conversation_id, k.through_turn, k.summary, k.created_at
FROM compactions AS k JOIN conversations AS c ON c.id = k.conversation_id
WHERE k.conversation_id = ? AND c.deleted_at IS NULL
ORDER BY k.through_turn DESC, k.id DESC
LIMIT 1
"""
SELECT_TURN_EXISTS = "SELECT 1 FROM turns WHERE conversation_id = ? AND turn = ?"


class _Unset(enum.Enum):
    """Marks an argument left out, where None is itself a value to store."""

    UNSET = enum.auto()


UNSET = _Unset.UNSET


def _create_private(path: Path) -> None:
    # Conversations are private: the file is made 0600 before SQLite opens it, and the
    # -wal/-shm files SQLite creates copy the database file's permissions.
    if not path.exists():
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class HistoryStore:
    """Conversations, turns and the message index in one SQLite file."""

    def __init__(self, path: Path | str) -> None:
        self.path = path if str(path) == MEMORY else Path(path)
        if isinstance(self.path, Path):
            directory = self.path.parent
            if not directory.exists():
                directory.mkdir(parents=True, mode=0o700)
                directory.chmod(0o700)  # mkdir's mode is filtered by the umask
            _create_private(self.path)
        self._last_time: datetime | None = None
        # How common each searched phrase is, learnt by searches (history/search.py).
        self._phrases = search.PhraseStats()
        self._conn = sqlite3.connect(self.path)
        try:
            self._conn.row_factory = sqlite3.Row
            for pragma in CONNECTION_PRAGMAS:
                self._conn.execute(pragma)
            migrate(self._conn)
        except BaseException:
            self._conn.close()
            raise
        # Knowledge bases (history/kb.py) share the connection, hence the thread.
        self.kb = KnowledgeStore(self._conn, self._now)

    # -- lifecycle -----------------------------------------------------------------

    def close(self) -> None:
        """Close the connection; safe to call twice."""
        self._conn.close()

    def __enter__(self) -> HistoryStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _now(self) -> str:
        # Strictly increasing within this store, so two writes in one microsecond (or a
        # clock stepping back) cannot give equal updated_at values and make the
        # `before` cursor skip or repeat a conversation.
        now = datetime.now(UTC)
        if self._last_time is not None and now <= self._last_time:
            now = self._last_time + timedelta(microseconds=1)
        self._last_time = now
        return now.strftime(TIMESTAMP_FORMAT)

    def _transaction(self) -> AbstractContextManager[sqlite3.Connection]:
        return immediate_transaction(self._conn)

    # -- conversations -------------------------------------------------------------

    def _conversation(self, cid: int) -> Conversation | None:
        row = self._conn.execute(SELECT_CONVERSATION, (cid,)).fetchone()
        return Conversation.from_row(row) if row else None

    def _is_live(self, cid: int) -> bool:
        return self._conn.execute(IS_LIVE_CONVERSATION, (cid,)).fetchone() is not None

    def _insert_conversation(self, title: str, model: str | None) -> int:
        now = self._now()
        cursor = self._conn.execute(INSERT_CONVERSATION, (title, model, now, now))
        assert cursor.lastrowid is not None
        return cursor.lastrowid

    def create_conversation(self, title: str = "", model: str | None = None) -> Conversation:
        """A new, empty conversation."""
        with self._transaction():
            cid = self._insert_conversation(title, model)
            conversation = self._conversation(cid)
        assert conversation is not None
        return conversation

    def get_conversation(self, cid: int) -> Conversation | None:
        """The conversation, None if it is missing or deleted."""
        return self._conversation(cid)

    def turn_context(self, cid: int, known: int = 0, before: int | None = None) -> TurnContext | None:
        """The conversation and what its next prompt needs; None if it is missing or deleted.

        ``known`` is the last turn the caller still holds from an earlier call: only the
        answered turns after it (and after the latest compaction), and before ``before``
        (default: all), are read and decoded.
        """
        conversation = self._conversation(cid)
        if conversation is None:
            return None
        compaction = self.latest_compaction(cid)
        after = max(compaction.through_turn if compaction else 0, known)
        return TurnContext(
            conversation=conversation,
            compaction=compaction,
            earlier=self.answered_turns(cid, before or conversation.turns + 1, after),
            has_attachments=self.has_attachments(cid),
            kb_ids=self.kb.linked_ids(cid),
            known=known,
        )

    def list_conversations(
        self, limit: int = DEFAULT_LIST_LIMIT, before: str | None = None
    ) -> list[Conversation]:
        """Live conversations, most recently active first; `before` pages by updated_at."""
        if before is None:
            rows = self._conn.execute(LIST_CONVERSATIONS, (limit,))
        else:
            rows = self._conn.execute(LIST_CONVERSATIONS_BEFORE, (before, limit))
        return [Conversation.from_row(row) for row in rows]

    def update_conversation(
        self,
        cid: int,
        *,
        title: str | None = None,
        model: str | None | _Unset = UNSET,
        settings: dict[str, Any] | None = None,
    ) -> Conversation | None:
        """Change title, model (None = daemon default) or settings (merged in).

        updated_at is left alone: the list is ordered by conversation activity, and
        renaming an old conversation should not bring it to the top.
        """
        with self._transaction():
            current = self._conversation(cid)
            if current is None:
                return None
            self._conn.execute(
                UPDATE_CONVERSATION,
                (
                    current.title if title is None else title,
                    current.model if model is UNSET else model,
                    _dumps({**current.settings, **(settings or {})}),
                    cid,
                ),
            )
            return self._conversation(cid)

    def delete_conversation(self, cid: int) -> bool:
        """Soft-delete it and drop its search rows; False if missing or already gone."""
        with self._transaction():
            deleted = self._conn.execute(SOFT_DELETE_CONVERSATION, (self._now(), cid))
            if deleted.rowcount == 0:
                return False
            unindex_conversation(self._conn, cid)
        self._phrases.forget()
        return True

    # -- turns ---------------------------------------------------------------------

    def _turn_row(self, cid: int, turn: int) -> Turn | None:
        row = self._conn.execute(SELECT_TURN_ROW, (cid, turn)).fetchone()
        return Turn.from_row(row) if row else None

    def start_turn(
        self,
        cid: int | None,
        text: str,
        messages: list[dict[str, Any]],
        files: list[dict[str, Any]],
        model: str | None,
        title: str = "",
        attachments: Sequence[NewAttachment] = (),
        conversation_model: str | None = None,
    ) -> tuple[Conversation, Turn]:
        """Record a new running turn (creating the conversation when cid is None).

        `title` and `conversation_model` (NULL: the daemon's default) describe a
        conversation created here and are ignored otherwise; the turn's
        `attachments` are stored with it, in the same transaction. Raises
        LookupError when cid names a missing or deleted conversation; the daemon checks
        first, this only guards the row.
        """
        with self._transaction():
            if cid is None:
                cid = self._insert_conversation(title, conversation_model)
            elif not self._is_live(cid):
                raise LookupError(f"conversation {cid} not found")
            number = self._conn.execute(NEXT_TURN, (cid,)).fetchone()[0]
            now = self._now()
            self._conn.execute(
                INSERT_TURN,
                (cid, number, text, _dumps(files), _dumps(messages), model, now, now),
            )
            self._phrases.indexed(index_turn(self._conn, cid, number, messages))
            self._conn.executemany(INSERT_ATTACHMENT, [
                (cid, number, a.name, a.path, a.kind, a.content_type, a.size_bytes, a.sha256,
                 a.pages, a.full_text, now)
                for a in attachments
            ])
            self._conn.execute(TOUCH_CONVERSATION, (now, cid))
            conversation = self._conversation(cid)
            turn = self._turn_row(cid, number)
        assert conversation is not None and turn is not None
        return conversation, turn

    def begin_turn(
        self,
        cid: int | None,
        text: str,
        messages: list[dict[str, Any]],
        files: list[dict[str, Any]],
        model: str | None,
        title: str = "",
        attachments: Sequence[NewAttachment] = (),
        conversation_model: str | None = None,
        default_model: str | None = None,
        known: int = 0,
    ) -> tuple[Turn, TurnContext]:
        """``start_turn``, then what the turn's prompt needs (``turn_context``): one call, so the
        daemon stores a question and reads its conversation in one trip to this thread.

        ``model`` None runs the turn on the conversation's own model, else ``default_model``.
        """
        if model is None and cid is not None:
            conversation = self._conversation(cid)
            model = conversation.model if conversation else None
        conversation, turn = self.start_turn(
            cid, text, messages, files, model or default_model, title, attachments, conversation_model
        )
        context = self.turn_context(conversation.id, known, before=turn.turn)
        assert context is not None
        return turn, context

    def attachments(self, cid: int) -> list[Attachment]:
        """The conversation's attachments, oldest first, without their text."""
        return [Attachment.from_row(r) for r in self._conn.execute(LIST_ATTACHMENTS, (cid,))]

    def has_attachments(self, cid: int) -> bool:
        """Whether the (live) conversation has any attachment: attachment_recall's offer."""
        return bool(self._conn.execute(HAS_ATTACHMENTS, (cid,)).fetchone()[0])

    def attachment(self, cid: int, attachment_id: int) -> Attachment | None:
        """One attachment with its full text; None unless it belongs to ``cid``."""
        row = self._conn.execute(SELECT_ATTACHMENT, (cid, attachment_id)).fetchone()
        return Attachment.from_row(row) if row else None

    def save_partial(self, cid: int, turn: int, reply: str) -> None:
        """Checkpoint a streaming reply; a crash then keeps what was already shown."""
        with self._transaction():
            self._conn.execute(SAVE_PARTIAL, (reply, cid, turn))

    def finish_turn(
        self,
        cid: int,
        turn: int,
        *,
        messages: list[dict[str, Any]],
        reply: str,
        status: TurnStatus,
        finish_reason: str | None = None,
        error: str | None = None,
        error_code: str | None = None,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        ctx_used: int | None = None,
    ) -> Turn:
        """Store the turn's final messages and outcome and re-index it.

        Raises LookupError when the turn does not exist. A turn whose conversation was
        deleted while it ran is still saved, but not indexed: deleted conversations
        never reappear in search.
        """
        if status not in TURN_STATUSES:
            raise ValueError(f"unknown turn status {status!r}")
        with self._transaction():
            now = self._now()
            updated = self._conn.execute(
                FINISH_TURN,
                (
                    _dumps(messages), reply, status, finish_reason, error, error_code,
                    prompt_tokens, completion_tokens, now, cid, turn,
                ),
            )
            if updated.rowcount == 0:
                raise LookupError(f"turn {turn} of conversation {cid} not found")
            if self._is_live(cid):
                self._phrases.indexed(index_turn(self._conn, cid, turn, messages))
                self._conn.execute(FINISH_CONVERSATION, (ctx_used, now, cid))
            result = self._turn_row(cid, turn)
        assert result is not None
        return result

    def turns(self, cid: int) -> list[Turn]:
        """Every turn of a live conversation, in order ([] if missing or deleted)."""
        return [Turn.from_row(row) for row in self._conn.execute(SELECT_TURNS, (cid,))]

    def answered_turns(
        self, cid: int, before: int, after: int = 0
    ) -> list[tuple[int, list[dict[str, Any]]]]:
        """(turn, messages) of each turn after ``after`` and before ``before`` that got a reply.

        ``after`` is the last turn a compaction summary stands for: those are not replayed.
        """
        rows = self._conn.execute(SELECT_ANSWERED_TURNS, (cid, after, before))
        return [(turn, load_messages(raw)) for turn, raw in rows]

    def turn(self, cid: int, n: int) -> Turn | None:
        """Turn n (1-based) of a live conversation, or None."""
        row = self._conn.execute(SELECT_TURN, (cid, n)).fetchone()
        return Turn.from_row(row) if row else None

    def interrupt_running(self) -> int:
        """Mark turns a crash left running as interrupted; how many there were.

        Their question and last checkpointed reply stay; the reply becomes the turn's
        assistant message when the crash came before it was written as one.
        """
        with self._transaction():
            running = self._conn.execute(SELECT_RUNNING).fetchall()
            now = self._now()
            for cid, turn, raw, reply in running:
                messages = load_messages(raw)
                if reply and messages and messages[-1].get("role") != "assistant":
                    # checkpoints save only the reply: give it its message, so a replay of
                    # this turn keeps the roles alternating and the words the user saw
                    messages.append({"role": "assistant", "content": reply})
                    index_turn(self._conn, cid, turn, messages)
                self._conn.execute(INTERRUPT_TURN, (_dumps(messages), now, cid, turn))
            count = len(running)
        if count:
            logger.info("history: %d turn(s) left running were marked interrupted", count)
        return count

    # -- compaction ----------------------------------------------------------------

    def add_compaction(self, cid: int, through_turn: int, summary: str) -> Compaction:
        """Store a summary standing for turns 1..through_turn, and index it for search.

        The turns themselves are untouched (and stay findable). Raises LookupError when
        the conversation is missing or deleted or has no such turn.
        """
        with self._transaction():
            if not self._is_live(cid):
                raise LookupError(f"conversation {cid} not found")
            if self._conn.execute(SELECT_TURN_EXISTS, (cid, through_turn)).fetchone() is None:
                raise LookupError(f"conversation {cid} has no turn {through_turn}")
            earlier = [row[0] for row in self._conn.execute(SELECT_COMPACTION_TURNS, (cid,))]
            self._conn.execute(INSERT_COMPACTION, (cid, through_turn, summary, self._now()))
            index_summary(self._conn, cid, through_turn, summary, earlier)
            compaction = self.latest_compaction(cid)
        self._phrases.indexed(1)
        if earlier:
            self._phrases.forget()
        assert compaction is not None
        return compaction

    def latest_compaction(self, cid: int) -> Compaction | None:
        """The compaction reaching furthest into the conversation, None if none (or deleted)."""
        row = self._conn.execute(SELECT_LATEST_COMPACTION, (cid,)).fetchone()
        return Compaction.from_row(row) if row else None

    # -- search --------------------------------------------------------------------

    def search_conversation(
        self,
        cid: int,
        query: str,
        limit: int = DEFAULT_CONVERSATION_HITS,
        role: str | None = None,
        before_turn: int | None = None,
    ) -> list[SearchHit]:
        """Best bm25 matches among one conversation's messages ("all"/None: any role).

        ``before_turn`` leaves that turn and later ones out (the running turn's own
        question would match its own words). Ranking as history/search.py describes:
        exactly bm25 below 100,000 messages.
        """
        lo, hi = conversation_rowid_range(cid)
        if before_turn is not None:
            if before_turn <= 1:
                return []
            hi = min(hi, lo + (min(before_turn, MAX_TURN + 1) << TURN_SHIFT) - 1)
        return search.search(
            self._conn,
            self._phrases,
            query,
            limit,
            (lo, hi),
            None if role in (None, "all") else role,
            search.CONVERSATION_CAP,
        )

    def search_all(self, query: str, limit: int = DEFAULT_ALL_HITS) -> list[SearchHit]:
        """Best bm25 matches across every live conversation, newest first for equal rank."""
        return search.search(self._conn, self._phrases, query, limit, cap=search.ALL_CAP)
