"""HistoryStore: conversations, turns, attachments, compactions and the search index.

Knowledge-base tables are reached through ``store.kb`` (history/kb.py). The statements
run here are named in sql.py, and connection.py opens the file.

Synchronous on purpose: one connection, used from one thread (`AsyncHistory` in aio.py
supplies that thread for the daemon). It migrates in its constructor, and every write
method is one transaction. A turn's `message_fts` rows are rewritten in the same
transaction as the turn itself (no triggers), so search never disagrees with `turns`.

Lookups return None / False / [] for a missing or soft-deleted conversation; turning
that into a protocol error is the daemon's business, not the store's.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import sqlite3
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import Any

from . import search, sql
from .connection import MEMORY, connect
from .fts import (
    MAX_TURN,
    TURN_SHIFT,
    conversation_rowid_range,
    index_summary,
    index_turn,
    load_messages,
    unindex_conversation,
)
from .archive import ArchiveStore
from .elsewhere import ElsewhereStore
from .recallvec import RecallVectorStore
from .kb import KnowledgeStore
from .journal import JournalStore
from .memories import MemoryStore, reads_memory
from .migrations import immediate_transaction, migrate
from .records import (
    TURN_STATUSES,
    Attachment,
    Compaction,
    Conversation,
    NewTurn,
    SearchHit,
    Turn,
    TurnContext,
    TurnOutcome,
    TurnStatus,
)
from .threads import IMPORTED

logger = logging.getLogger(__name__)

DEFAULT_LIST_LIMIT = 50
# search rows of a deleted conversation dropped a transaction: a long conversation at
# once would hold the history thread, every turn waiting
UNINDEX_BATCH = 500
DEFAULT_CONVERSATION_HITS = 5
DEFAULT_ALL_HITS = 20


class _Unset(enum.Enum):
    """Marks an argument left out, where None is itself a value to store."""

    UNSET = enum.auto()


UNSET = _Unset.UNSET


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class HistoryStore:
    """Conversations, turns and the message index in one SQLite file."""

    def __init__(self, path: Path | str) -> None:
        self.path = path if str(path) == MEMORY else Path(path)
        self._last_micros = 0  # the last timestamp given, in microseconds since the epoch
        self._second: tuple[int, str] = (-1, "")  # the last second formatted, and its text
        # How common each searched phrase is, learnt by searches (history/search.py).
        self._phrases = search.PhraseStats()
        self._conn = connect(self.path)
        try:
            migrate(self._conn)
        except BaseException:
            self._conn.close()
            raise
        # Knowledge bases (history/kb.py) share the connection, hence the thread.
        self.kb = KnowledgeStore(self._conn, self._now)
        self.archive = ArchiveStore(self._conn)  # recall injection's queries (history/archive.py)
        self.recall_vectors = RecallVectorStore(self._conn)  # their vectors (history/recallvec.py)
        self.memories = MemoryStore(self._conn, self._now, self._phrases)  # history/memories.py
        self.elsewhere = ElsewhereStore(self._conn, self.memories)  # and across conversations (history/elsewhere.py)
        self.journal = JournalStore(self._conn)  # the live state's numbering and journal (history/journal.py)

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
        micros = max(time.time_ns() // 1000, self._last_micros + 1)
        self._last_micros = micros
        # TIMESTAMP_FORMAT, its second formatted once for every write within it: each
        # question waits for a timestamp before it reaches the model
        seconds, fraction = divmod(micros, 1_000_000)
        if self._second[0] != seconds:
            self._second = (seconds, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)))
        return f"{self._second[1]}.{fraction:06d}Z"

    def _transaction(self) -> AbstractContextManager[sqlite3.Connection]:
        return immediate_transaction(self._conn)

    # -- conversations -------------------------------------------------------------

    def _conversation(self, cid: int) -> Conversation | None:
        row = self._conn.execute(sql.SELECT_CONVERSATION, (cid,)).fetchone()
        return Conversation.from_row(row) if row else None

    def _is_live(self, cid: int) -> bool:
        return self._conn.execute(sql.IS_LIVE_CONVERSATION, (cid,)).fetchone() is not None

    def _insert_conversation(
        self, title: str, model: str | None, system_prompt: str | None = None, now: str | None = None
    ) -> int:
        now = now or self._now()
        cursor = self._conn.execute(sql.INSERT_CONVERSATION, (title, model, system_prompt, now, now))
        assert cursor.lastrowid is not None
        return cursor.lastrowid

    def create_conversation(
        self, title: str = "", model: str | None = None, system_prompt: str | None = None
    ) -> Conversation:
        """A new, empty conversation (``system_prompt`` None: the daemon's)."""
        with self._transaction():
            cid = self._insert_conversation(title, model, system_prompt)
            conversation = self._conversation(cid)
        assert conversation is not None
        return conversation

    def get_conversation(self, cid: int) -> Conversation | None:
        """The conversation, None if it is missing or deleted."""
        return self._conversation(cid)

    def turn_context(
        self, cid: int, after: int = 0, before: int | None = None, conversation: Conversation | None = None
    ) -> TurnContext | None:
        """The conversation and what its next prompt needs; None if it is missing or deleted.

        Only the answered turns after ``after`` (and after the latest compaction), and before
        ``before`` (default: all), are read and decoded. ``conversation``: as just read, in this
        transaction's thread (not read again).
        """
        if conversation is None:
            conversation = self._conversation(cid)
        if conversation is None:
            return None
        compaction = self.latest_compaction(cid)
        start = max(compaction.through_turn if compaction else 0, after)
        return TurnContext(
            conversation=conversation,
            compaction=compaction,
            earlier=self.answered_turns(cid, before or conversation.turns + 1, start),
            has_attachments=self.has_attachments(cid),
            kb_ids=self.kb.linked_ids(cid, live=True),  # the conversation was just read, live
            after=after,
        )

    def list_conversations(
        self, limit: int = DEFAULT_LIST_LIMIT, before: str | None = None
    ) -> list[Conversation]:
        """Live conversations, most recently active first; `before` pages by updated_at."""
        if before is None:
            rows = self._conn.execute(sql.LIST_CONVERSATIONS, (limit,))
        else:
            rows = self._conn.execute(sql.LIST_CONVERSATIONS_BEFORE, (before, limit))
        return [Conversation.from_row(row) for row in rows]

    def update_conversation(
        self,
        cid: int,
        *,
        title: str | None = None,
        model: str | None | _Unset = UNSET,
        settings: dict[str, Any] | None = None,
        system_prompt: str | None | _Unset = UNSET,
    ) -> Conversation | None:
        """Change title, model (None = daemon default), system prompt (None = daemon default)
        or settings (merged in; a key given as None is removed, so its default applies again).

        updated_at is left alone: the list is ordered by conversation activity, and
        renaming an old conversation should not bring it to the top.
        """
        with self._transaction():
            current = self._conversation(cid)
            if current is None:
                return None
            self._conn.execute(
                sql.UPDATE_CONVERSATION,
                (
                    current.title if title is None else title,
                    current.model if model is UNSET else model,
                    current.system_prompt if system_prompt is UNSET else system_prompt,
                    _dumps({
                        key: value for key, value in {**current.settings, **(settings or {})}.items()
                        if value is not None
                    }),
                    cid,
                ),
            )
            return self._conversation(cid)

    def replace_title(self, cid: int, old: str, new: str) -> bool:
        """Retitle the conversation ``new`` if its title is still ``old`` (the user has not
        renamed it meanwhile); whether it was."""
        with self._transaction():
            renamed = self._conn.execute(sql.REPLACE_TITLE, (new, cid, old))
        return renamed.rowcount > 0

    def delete_conversation(self, cid: int) -> bool:
        """Soft-delete it (gone from every list and search at once); False if missing or already
        gone. Its search rows are dropped after, by ``unindex_deleted``."""
        with self._transaction():
            deleted = self._conn.execute(sql.SOFT_DELETE_CONVERSATION, (self._now(), cid))
        return deleted.rowcount > 0

    def unindex_deleted(self, cid: int, limit: int | None = None) -> int:
        """Drop up to ``limit`` (UNINDEX_BATCH) search rows of a deleted conversation; how many
        went (0: none left)."""
        with self._transaction():
            dropped = unindex_conversation(self._conn, cid, limit or UNINDEX_BATCH)
        if dropped:
            self._phrases.forget()
        return dropped

    def deleted_but_indexed(self) -> list[int]:
        """Deleted conversations whose search rows a stop kept from being dropped."""
        return [row[0] for row in self._conn.execute(sql.DELETED_BUT_INDEXED)]

    # -- turns ---------------------------------------------------------------------

    def _turn_row(self, cid: int, turn: int) -> Turn | None:
        row = self._conn.execute(sql.SELECT_TURN_ROW, (cid, turn)).fetchone()
        return Turn.from_row(row) if row else None

    def start_turn(self, new: NewTurn) -> tuple[Conversation, Turn]:
        """Record a new running turn (creating the conversation when ``new.conversation`` is None).

        ``title``, ``conversation_model`` and ``system_prompt`` describe a conversation created
        here and are ignored otherwise; the turn's ``attachments`` are stored with it, in the
        same transaction. Raises LookupError when ``new.conversation`` names a missing or
        deleted conversation.
        """
        with self._transaction():
            now = self._now()
            cid, model = new.conversation, new.model
            if cid is None:
                cid = self._insert_conversation(new.title, new.conversation_model, new.system_prompt, now)
                number = 1
                if model is None:
                    model = new.conversation_model or new.default_model
                # the row as inserted, with its columns' defaults (not read back)
                conversation = Conversation(id=cid, title=new.title, model=new.conversation_model, settings={},
                                            ctx_used=0, created_at=now, updated_at=now, turns=1,
                                            system_prompt=new.system_prompt)
            else:
                # one read says it is live, its next turn's number and its model
                found = self._conversation(cid)
                if found is None:
                    raise LookupError(f"conversation {cid} not found")
                number = found.turns + 1
                if model is None:
                    model = found.model or new.default_model
                self._conn.execute(sql.TOUCH_CONVERSATION, (now, cid))
                conversation = dataclasses.replace(found, updated_at=now, turns=number)
            self._conn.execute(sql.INSERT_TURN, (cid, number, new.text, _dumps(new.files), _dumps(new.messages), model,
                                                 now, now, new.ref))
            # not indexed for search yet: finish_turn indexes the question with its reply, one
            # FTS write instead of two, and the question reaches the model sooner (a third of
            # this transaction's time went to the index)
            if new.attachments:
                self._conn.executemany(sql.INSERT_ATTACHMENT, [
                    (cid, number, a.name, a.path, a.kind, a.content_type, a.size_bytes, a.sha256, a.pages,
                     a.full_text, now, a.sent_whole) for a in new.attachments
                ])
        # the row as just written (not read back: its JSON would be decoded again)
        turn = Turn(
            conversation_id=cid, turn=number, text=new.text, files=new.files, messages=new.messages, reply="",
            status="running", error=None, error_code=None, finish_reason=None, model=model,
            prompt_tokens=None, completion_tokens=None, created_at=now, updated_at=now, sources=[], ref=new.ref,
            approvals=[],
        )
        return conversation, turn

    def begin_turn(self, new: NewTurn, after: int = 0, memory_chars: int | None = None) -> tuple[Turn, TurnContext]:
        """``start_turn``, then what the turn's prompt needs (``turn_context`` after ``after``; the
        frozen memory block too, ``with_memories``): one call, so the daemon stores a question and
        reads its conversation in one trip to this thread."""
        conversation, turn = self.start_turn(new)
        if new.conversation is None:  # created here: nothing earlier to read; its files are this turn's
            context = TurnContext(conversation=conversation, compaction=None, earlier=[],
                                  has_attachments=bool(new.attachments),
                                  kb_ids=self.kb.linked_ids(conversation.id, live=True), after=after)
        else:
            found = self.turn_context(conversation.id, after, before=turn.turn, conversation=conversation)
            assert found is not None
            context = found
        return turn, self.with_memories(context, memory_chars)

    def with_memories(self, context: TurnContext, memory_chars: int | None) -> TurnContext:
        """``context`` with the conversation's frozen memory block (made at its first prompt, within
        ``memory_chars``; "" when the conversation is incognito); as it was when ``memory_chars`` is
        None (memory off for the daemon, or not known yet) or the conversation's system prompt is
        "" (no system message, so no block: none is made)."""
        conversation = context.conversation
        if memory_chars is None or conversation.system_prompt == "":
            return context
        block = self.memories.freeze(conversation.id, memory_chars) if reads_memory(conversation.settings) else ""
        return dataclasses.replace(context, memories=block)

    # -- threads: the OpenAI door's conversations, found by their texts (history/threads.py) --

    def thread_conversation(self, digest: str) -> int | None:
        """The newest live conversation whose turns, all of them, are the thread ``digest`` names."""
        row = self._conn.execute(sql.SELECT_THREAD, (digest,)).fetchone()
        return row[0] if row else None

    def add_thread(self, digest: str, cid: int, turns: int) -> None:
        """Record that conversation ``cid``'s first ``turns`` turns are the thread ``digest``."""
        with self._transaction():
            self._conn.execute(sql.INSERT_THREAD, (digest, cid, turns))

    def waiting_calls(self, cid: int) -> list[str] | None:
        """The ids of the calls the last turn of ``cid`` ended on that no stored result answers
        (a client's own tools, the OpenAI door's); None when its last turn did not end on calls."""
        row = self._conn.execute(sql.SELECT_WAITING_TURN, (cid, cid)).fetchone()
        if row is None:
            return None
        messages = load_messages(row[0])
        called = [n for n, m in enumerate(messages) if m.get("role") == "assistant" and m.get("tool_calls")]
        if not called:
            return None
        answered = {m.get("tool_call_id") for m in messages[called[-1] + 1:] if m.get("role") == "tool"}
        calls = [c.get("id") for c in messages[called[-1]]["tool_calls"] if isinstance(c, dict)]
        return [call for call in calls if isinstance(call, str) and call not in answered]

    def discard_import(self, cid: int) -> bool:
        """Remove a conversation ``import_conversation`` made whose question was refused, so a
        refusal stores nothing; only while all its turns are the imported ones (False otherwise:
        another request has gone on with it meanwhile)."""
        with self._transaction():
            turns, imported = self._conn.execute(sql.COUNT_IMPORTED, (IMPORTED, cid)).fetchone()
            if turns == 0 or turns != imported:
                return False
            while unindex_conversation(self._conn, cid, UNINDEX_BATCH):
                pass
            for statement in (sql.DELETE_THREADS, sql.DELETE_TURNS, sql.DELETE_CONVERSATION):
                self._conn.execute(statement, (cid,))
        self._phrases.forget()
        return True

    def reopen_turn(self, cid: int, after: int = 0, memory_chars: int | None = None) -> tuple[Turn, TurnContext]:
        """Take up again the last turn of ``cid``, which ended on calls to a client's own tools (the
        OpenAI door): running again, and what its prompt needs from before it. LookupError when
        its last turn did not end so (or it is missing or deleted)."""
        with self._transaction():
            now = self._now()
            row = self._conn.execute(sql.REOPEN_TURN, (now, cid, cid)).fetchone() if self._is_live(cid) else None
            if row is None:
                raise LookupError(f"the last turn of conversation {cid} is not waiting for tool results")
            turn = row[0]
            self._conn.execute(sql.TOUCH_CONVERSATION, (now, cid))
            found = self._turn_row(cid, turn)
            context = self.turn_context(cid, after, before=turn)
        assert found is not None and context is not None
        return found, self.with_memories(context, memory_chars)  # after the transaction: freeze has its own

    def import_conversation(
        self, turns: Sequence[tuple[str, str]], digest: str, *, title: str, model: str | None,
        system_prompt: str | None, at: str | None = None,
    ) -> Conversation:
        """A new conversation holding ``turns`` (question, reply) a client brought, stored complete
        with finish reason ``imported`` and searchable, recorded as the thread ``digest``; dated
        ``at`` (a timestamp) when given, as a test or a bench makes a past."""
        with self._transaction():
            now = at or self._now()
            cid = self._insert_conversation(title, model, system_prompt, now)
            self._insert_imported(cid, 1, turns, model, now)
            self._conn.execute(sql.INSERT_THREAD, (digest, cid, len(turns)))
            conversation = self._conversation(cid)
        assert conversation is not None
        return conversation

    def add_imported_turns(self, cid: int, turns: Sequence[tuple[str, str]]) -> int:
        """Append complete turns (question, reply) to a live conversation, as ``import_conversation``
        stores them: how a test or a bench makes a long past without a model writing it. The
        number of its last turn; LookupError when the conversation is missing or deleted."""
        with self._transaction():
            conversation = self._conversation(cid) if self._is_live(cid) else None
            if conversation is None:
                raise LookupError(f"conversation {cid} not found")
            self._insert_imported(cid, conversation.turns + 1, turns, conversation.model, self._now())
        return conversation.turns + len(turns)

    def _insert_imported(
        self, cid: int, first: int, turns: Sequence[tuple[str, str]], model: str | None, now: str
    ) -> None:
        for number, (question, reply) in enumerate(turns, first):
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
            self._conn.execute(sql.INSERT_TURN, (cid, number, question, "[]", _dumps(messages), model, now, now, None))
            self._conn.execute(sql.FINISH_TURN, (
                _dumps(messages), reply, "complete", IMPORTED, None, None, None, None, "[]", "[]", now, cid, number,
            ))
            self._phrases.indexed(index_turn(self._conn, cid, number, messages))

    def attachments(self, cid: int) -> list[Attachment]:
        """The conversation's attachments, oldest first, without their text."""
        return [Attachment.from_row(r) for r in self._conn.execute(sql.LIST_ATTACHMENTS, (cid,))]

    def has_attachments(self, cid: int) -> bool:
        """Whether the (live) conversation has any attachment: attachment_recall's offer."""
        return bool(self._conn.execute(sql.HAS_ATTACHMENTS, (cid,)).fetchone()[0])

    def attachment(self, cid: int, attachment_id: int) -> Attachment | None:
        """One attachment with its full text; None unless it belongs to ``cid``."""
        row = self._conn.execute(sql.SELECT_ATTACHMENT, (cid, attachment_id)).fetchone()
        return Attachment.from_row(row) if row else None

    def add_attachments(self, cid: int, turn: int, attachments: Sequence[NewAttachment]) -> list[int]:
        """Attach files to a turn already stored (a tool's outputs, file_convert's); their ids."""
        now = self._now()
        with self._transaction():
            return [self._conn.execute(sql.INSERT_ATTACHMENT, (
                cid, turn, a.name, a.path, a.kind, a.content_type, a.size_bytes, a.sha256, a.pages, a.full_text, now,
                a.sent_whole,
            )).lastrowid or 0 for a in attachments]

    def save_partial(self, cid: int, turn: int, reply: str) -> None:
        """Checkpoint a streaming reply; a crash then keeps what was already shown."""
        with self._transaction():
            self._conn.execute(sql.SAVE_PARTIAL, (reply, cid, turn))

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
        sources: list[dict[str, Any]] | None = None,
        approvals: list[dict[str, Any]] | None = None,
    ) -> Turn:
        """Store the turn's final messages and outcome (``sources``: its knowledge-base passages';
        ``approvals``: how its calls of acting tools were decided) and re-index it.

        Raises LookupError when the turn does not exist. A turn whose conversation was
        deleted while it ran is still saved, but not indexed: deleted conversations
        never reappear in search.
        """
        if status not in TURN_STATUSES:
            raise ValueError(f"unknown turn status {status!r}")
        with self._transaction():
            now = self._now()
            updated = self._conn.execute(
                sql.FINISH_TURN,
                (
                    _dumps(messages), reply, status, finish_reason, error, error_code,
                    prompt_tokens, completion_tokens, _dumps(sources or []), _dumps(approvals or []), now, cid, turn,
                ),
            )
            if updated.rowcount == 0:
                raise LookupError(f"turn {turn} of conversation {cid} not found")
            if self._is_live(cid):
                self._phrases.indexed(index_turn(self._conn, cid, turn, messages))
                self._conn.execute(sql.FINISH_CONVERSATION, (ctx_used, now, cid))
            result = self._turn_row(cid, turn)
        assert result is not None
        return result

    def add_page_text(self, cid: int, turn: int, sha256: str, full_text: str, pages: dict[int, str]) -> bool:
        """Keep the OCR text of a turn's scanned pages, read after the turn was stored (a vision
        model got them as images): on the pages' ``image_ref`` parts (file ``sha256``), which
        the search index reads, and as the file's text for recall. False when the turn is gone."""
        with self._transaction():
            row = self._conn.execute(sql.SELECT_TURN_MESSAGES, (cid, turn)).fetchone()
            if row is None:
                return False
            messages = load_messages(row[0])
            for message in messages:
                content = message.get("content") if message.get("role") == "user" else None
                for part in content if isinstance(content, list) else ():
                    page = part.get("page") if isinstance(part, dict) else None
                    if isinstance(page, int) and part.get("type") == "image_ref" and part.get("sha256") == sha256 \
                            and pages.get(page):
                        part["ocr"] = pages[page]
            self._conn.execute(sql.SET_TURN_MESSAGES, (_dumps(messages), cid, turn))
            self._conn.execute(sql.SET_ATTACHMENT_TEXT, (full_text, cid, turn, sha256))
            if self._is_live(cid):
                self._phrases.indexed(index_turn(self._conn, cid, turn, messages))
        return True

    def finish(self, outcome: TurnOutcome) -> Turn:
        """``finish_turn`` with the outcome's fields."""
        o = outcome
        return self.finish_turn(
            o.conversation, o.turn, messages=o.messages, reply=o.reply, status=o.status,
            finish_reason=o.finish_reason, error=o.error, error_code=o.error_code, prompt_tokens=o.prompt_tokens,
            completion_tokens=o.completion_tokens, ctx_used=o.ctx_used, sources=o.sources,
            approvals=o.approvals,
        )

    def turns(self, cid: int, from_turn: int = 1, limit: int | None = None) -> list[Turn]:
        """The turns of a live conversation, in order ([] if missing or deleted): every one, or at
        most ``limit`` from turn ``from_turn`` on."""
        if from_turn == 1 and limit is None:
            rows = self._conn.execute(sql.SELECT_TURNS, (cid,))
        else:
            rows = self._conn.execute(sql.SELECT_TURN_RANGE, (cid, from_turn, -1 if limit is None else limit))
        return [Turn.from_row(row) for row in rows]

    def answered_turns(
        self, cid: int, before: int, after: int = 0
    ) -> list[tuple[int, list[dict[str, Any]]]]:
        """(turn, messages) of each turn after ``after`` and before ``before`` that got a reply.

        ``after`` is the last turn a compaction summary stands for: those are not replayed.
        """
        rows = self._conn.execute(sql.SELECT_ANSWERED_TURNS, (cid, after, before))
        return [(turn, load_messages(raw)) for turn, raw in rows]

    def turn(self, cid: int, n: int) -> Turn | None:
        """Turn n (1-based) of a live conversation, or None."""
        row = self._conn.execute(sql.SELECT_TURN, (cid, n)).fetchone()
        return Turn.from_row(row) if row else None

    def interrupt_running(self) -> int:
        """Mark turns a crash left running as interrupted; how many there were.

        Their question and last checkpointed reply stay; the reply becomes the turn's
        assistant message when the crash came before it was written as one.
        """
        with self._transaction():
            running = self._conn.execute(sql.SELECT_RUNNING).fetchall()
            now = self._now()
            for cid, turn, raw, reply in running:
                messages = load_messages(raw)
                if reply and messages and messages[-1].get("role") != "assistant":
                    # checkpoints save only the reply: give it its message, so a replay of
                    # this turn keeps the roles alternating and the words the user saw
                    messages.append({"role": "assistant", "content": reply})
                if self._is_live(cid):
                    self._phrases.indexed(index_turn(self._conn, cid, turn, messages))  # as finish_turn would
                self._conn.execute(sql.INTERRUPT_TURN, (_dumps(messages), now, cid, turn))
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
            if self._conn.execute(sql.SELECT_TURN_EXISTS, (cid, through_turn)).fetchone() is None:
                raise LookupError(f"conversation {cid} has no turn {through_turn}")
            earlier = [row[0] for row in self._conn.execute(sql.SELECT_COMPACTION_TURNS, (cid,))]
            self._conn.execute(sql.INSERT_COMPACTION, (cid, through_turn, summary, self._now()))
            index_summary(self._conn, cid, through_turn, summary, earlier)
            compaction = self.latest_compaction(cid)
        self._phrases.indexed(1)
        if earlier:
            self._phrases.forget()
        assert compaction is not None
        return compaction

    def replay_source(
        self, cid: int, turn: int
    ) -> tuple[Compaction | None, list[tuple[int, list[dict[str, Any]]]]]:
        """The latest compaction and the answered turns after it and before ``turn``
        (``answered_turns``): what a replay is rebuilt from, read in one trip."""
        compaction = self.latest_compaction(cid)
        return compaction, self.answered_turns(cid, turn, compaction.through_turn if compaction else 0)

    def latest_compaction(self, cid: int) -> Compaction | None:
        """The compaction reaching furthest into the conversation, None if none (or deleted)."""
        row = self._conn.execute(sql.SELECT_LATEST_COMPACTION, (cid,)).fetchone()
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

    def search_with_conversations(
        self, query: str, limit: int, cid: int | None = None, offset: int = 0
    ) -> tuple[list[SearchHit], dict[int, Conversation]]:
        """``search_all`` (or ``search_conversation`` of ``cid``) past the first ``offset`` hits,
        and the live conversations of the hits by id: a search's answer, read in one trip."""
        wanted = offset + limit
        hits = self.search_conversation(cid, query, wanted) if cid is not None else self.search_all(query, wanted)
        hits = hits[offset:]
        found = {c: self._conversation(c) for c in {hit.conversation_id for hit in hits}}
        return hits, {c: conversation for c, conversation in found.items() if conversation is not None}
