"""AsyncHistory: the HistoryStore on its own thread, awaited from asyncio.

SQLite calls block, so they must not run on the event loop; and a sqlite3 connection
belongs to the thread that made it. One dedicated thread (``HistoryThread``) therefore
creates the store and runs every call, in submission order (aiosqlite's design).

``AsyncHistory`` has an ``async`` twin of each store method used outside this package, of
the same name and signature (``await history.turns(cid)``; the knowledge-base tables'
under ``history.kb``). Each sends the whole store method to the thread, so a
multi-statement write is one trip and one transaction, never statements interleaved with
other callers; reads a caller needs together are one store method too
(``HistoryStore.replay_source``, ``search_with_conversations``).

Cancelling an awaiting caller does not stop its call, queued or running: every call
sent runs, and its transaction completes (or rolls back) as a whole.

A full disk (SQLite's SQLITE_FULL) is ``DiskFull`` for every caller. A turn's outcome
that cannot be written (a full disk, a database another program holds locked past the
busy timeout) is not lost: ``finish`` keeps it in memory, retries it with
back-off (``RETRY_FIRST`` doubling to ``RETRY_MAX`` seconds), writes it before anything
new is started (``ensure_room``) and tries a last time at ``close``; meanwhile
``shown`` puts it on the turn as read, so ``open`` never shows it ``running``; once it is
written, ``on_saved`` is told.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from core.errors import DiskFull, HistoryDamaged, StartupError

from .connection import MEMORY
from .journal import AsyncJournal
from .kb import KbChunk, KbDocument, KnowledgeBase, KnowledgeStore, NewKbDocument
from .records import Attachment, Compaction, Conversation, NewAttachment, SearchHit, Turn, TurnContext, TurnOutcome
from .store import (
    DEFAULT_ALL_HITS,
    DEFAULT_CONVERSATION_HITS,
    DEFAULT_LIST_LIMIT,
    UNSET,
    HistoryStore,
    _Unset,
)

P = ParamSpec("P")
T = TypeVar("T")

logger = logging.getLogger(__name__)

THREAD_NAME_PREFIX = "history"
MIN_FREE_BYTES = 1 << 20  # less free than this refuses a new turn: its question and reply need room
# With this much free, the disk is not looked at again for ROOMY_FOR seconds: no turn fills it
# that fast, and every turn's question waits for the check
ROOMY_BYTES = 64 << 20
ROOMY_FOR = 1.0
RETRY_FIRST = 0.5  # seconds before a kept outcome is written again; doubles each time
RETRY_MAX = 30.0


Call = tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


class HistoryThread:
    """One thread running the calls sent to it, in order; each result is set on the
    caller's future in the caller's loop."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        # a daemon thread: a loop that died without close() must not hang the exit on it
        self._thread = threading.Thread(target=self._serve, name=THREAD_NAME_PREFIX, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._calls.put((fn, loop, future))
        return future

    def stop(self) -> None:
        """End the thread once the calls already sent have run, and wait for it."""
        self._calls.put(None)
        self._thread.join()

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, loop, future = call
            try:
                outcome: tuple[Any, BaseException | None] = (fn(), None)
            except BaseException as exc:  # handed to the caller, whatever it is
                outcome = (None, exc)
            try:
                loop.call_soon_threadsafe(_settle, future, *outcome)
            except RuntimeError:  # the loop is closed: nobody waits for it
                pass


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


class AsyncHistory:
    """One HistoryStore owned by one dedicated thread."""

    def __init__(self, thread: HistoryThread, store: HistoryStore) -> None:
        self._thread = thread
        self._store = store
        self._closed = False
        self._kept: dict[tuple[int, int], TurnOutcome] = {}  # outcomes not written yet, oldest first
        self._unwritable = ""  # why the last of them could not be written
        self._flushing = asyncio.Lock()
        self._retry: asyncio.Task[None] | None = None
        self._roomy_until = 0.0  # monotonic time until which the disk is not looked at again
        # told of each kept outcome once it is written at last (the daemon tells its watchers)
        self.on_saved: Callable[[TurnOutcome], None] | None = None
        self.kb = AsyncKnowledgeStore(self, store.kb)
        self.journal = AsyncJournal(self, store.journal)

    @classmethod
    async def open(cls, path: Path | str) -> AsyncHistory:
        """Open (and migrate) the store on a new history thread."""
        thread = HistoryThread()
        try:
            store = await thread.submit(lambda: HistoryStore(path))
        except BaseException as exc:
            thread.stop()
            if isinstance(exc, (sqlite3.DatabaseError, OSError)):
                raise unusable(Path(path), exc) from exc
            raise
        return cls(thread, store)

    async def check(self) -> str | None:
        """What SQLite's quick check finds wrong with the database, None when it is sound.

        On its own read-only connection in a thread of its own: a large database takes a
        while, and the history thread must go on serving turns meanwhile.
        """
        return await asyncio.to_thread(quick_check, self._store.path)

    async def _call(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)``, a store method, on the history thread; a full disk is DiskFull."""
        if self._closed:
            raise RuntimeError("history store is closed")
        try:
            return await self._thread.submit(partial(fn, *args, **kwargs))
        except sqlite3.OperationalError as exc:
            if not is_disk_full(exc):
                raise
            raise DiskFull(f"the disk holding {self._folder()} is full; free some space and try again") from exc
        except sqlite3.DatabaseError as exc:
            if not is_damaged(exc):
                raise
            raise HistoryDamaged(self._store.path, exc) from exc

    # -- the store's methods, each run on the history thread -----------------------------

    async def create_conversation(
        self, title: str = "", model: str | None = None, system_prompt: str | None = None
    ) -> Conversation:
        return await self._call(self._store.create_conversation, title, model, system_prompt)

    async def get_conversation(self, cid: int) -> Conversation | None:
        return await self._call(self._store.get_conversation, cid)

    async def turn_context(
        self, cid: int, held_upto: int = 0, before: int | None = None, conversation: Conversation | None = None
    ) -> TurnContext | None:
        return await self._call(self._store.turn_context, cid, held_upto, before, conversation)

    async def list_conversations(
        self, limit: int = DEFAULT_LIST_LIMIT, before: str | None = None
    ) -> list[Conversation]:
        return await self._call(self._store.list_conversations, limit, before)

    async def update_conversation(
        self,
        cid: int,
        *,
        title: str | None = None,
        model: str | None | _Unset = UNSET,
        settings: dict[str, Any] | None = None,
        system_prompt: str | None | _Unset = UNSET,
    ) -> Conversation | None:
        return await self._call(
            self._store.update_conversation, cid, title=title, model=model, settings=settings,
            system_prompt=system_prompt,
        )

    async def replace_title(self, cid: int, old: str, new: str) -> bool:
        return await self._call(self._store.replace_title, cid, old, new)

    async def delete_conversation(self, cid: int) -> bool:
        return await self._call(self._store.delete_conversation, cid)

    async def unindex_deleted(self, cid: int, limit: int | None = None) -> int:
        return await self._call(self._store.unindex_deleted, cid, limit)

    async def deleted_but_indexed(self) -> list[int]:
        return await self._call(self._store.deleted_but_indexed)

    async def start_turn(
        self,
        cid: int | None,
        text: str,
        messages: list[dict[str, Any]],
        files: list[dict[str, Any]],
        model: str | None,
        title: str = "",
        *,
        attachments: Sequence[NewAttachment] = (),
        conversation_model: str | None = None,
        default_model: str | None = None,
        system_prompt: str | None = None,
        ref: str | None = None,
    ) -> tuple[Conversation, Turn]:
        return await self._call(
            self._store.start_turn, cid, text, messages, files, model, title, attachments=attachments,
            conversation_model=conversation_model, default_model=default_model, system_prompt=system_prompt, ref=ref,
        )

    async def begin_turn(
        self,
        cid: int | None,
        text: str,
        messages: list[dict[str, Any]],
        files: list[dict[str, Any]],
        model: str | None,
        title: str = "",
        *,
        attachments: Sequence[NewAttachment] = (),
        conversation_model: str | None = None,
        default_model: str | None = None,
        system_prompt: str | None = None,
        held_upto: int = 0,
        ref: str | None = None,
    ) -> tuple[Turn, TurnContext]:
        return await self._call(
            self._store.begin_turn, cid, text, messages, files, model, title, attachments=attachments,
            conversation_model=conversation_model, default_model=default_model, system_prompt=system_prompt,
            held_upto=held_upto, ref=ref,
        )

    async def thread_conversation(self, digest: str) -> int | None:
        return await self._call(self._store.thread_conversation, digest)

    async def add_thread(self, digest: str, cid: int, turns: int) -> None:
        await self._call(self._store.add_thread, digest, cid, turns)

    async def waiting_calls(self, cid: int) -> list[str] | None:
        return await self._call(self._store.waiting_calls, cid)

    async def discard_import(self, cid: int) -> bool:
        return await self._call(self._store.discard_import, cid)

    async def reopen_turn(self, cid: int, held_upto: int = 0) -> tuple[Turn, TurnContext]:
        return await self._call(self._store.reopen_turn, cid, held_upto)

    async def import_conversation(
        self, turns: Sequence[tuple[str, str]], digest: str, *, title: str, model: str | None,
        system_prompt: str | None,
    ) -> Conversation:
        return await self._call(
            self._store.import_conversation, turns, digest, title=title, model=model, system_prompt=system_prompt,
        )
    async def add_page_text(self, cid: int, turn: int, sha256: str, full_text: str, pages: dict[int, str]) -> bool:
        return await self._call(self._store.add_page_text, cid, turn, sha256, full_text, pages)

    async def attachments(self, cid: int) -> list[Attachment]:
        return await self._call(self._store.attachments, cid)

    async def has_attachments(self, cid: int) -> bool:
        return await self._call(self._store.has_attachments, cid)

    async def attachment(self, cid: int, attachment_id: int) -> Attachment | None:
        return await self._call(self._store.attachment, cid, attachment_id)

    async def add_attachments(self, cid: int, turn: int, attachments: Sequence[NewAttachment]) -> list[int]:
        return await self._call(self._store.add_attachments, cid, turn, attachments)

    async def save_partial(self, cid: int, turn: int, reply: str) -> None:
        return await self._call(self._store.save_partial, cid, turn, reply)

    async def turns(self, cid: int, from_turn: int = 1, limit: int | None = None) -> list[Turn]:
        return await self._call(self._store.turns, cid, from_turn, limit)

    async def turn(self, cid: int, n: int) -> Turn | None:
        return await self._call(self._store.turn, cid, n)

    async def interrupt_running(self) -> int:
        return await self._call(self._store.interrupt_running)

    async def add_compaction(self, cid: int, through_turn: int, summary: str) -> Compaction:
        return await self._call(self._store.add_compaction, cid, through_turn, summary)

    async def replay_source(
        self, cid: int, turn: int
    ) -> tuple[Compaction | None, list[tuple[int, list[dict[str, Any]]]]]:
        return await self._call(self._store.replay_source, cid, turn)

    async def search_conversation(
        self,
        cid: int,
        query: str,
        limit: int = DEFAULT_CONVERSATION_HITS,
        role: str | None = None,
        before_turn: int | None = None,
    ) -> list[SearchHit]:
        return await self._call(self._store.search_conversation, cid, query, limit, role, before_turn)

    async def search_all(self, query: str, limit: int = DEFAULT_ALL_HITS) -> list[SearchHit]:
        return await self._call(self._store.search_all, query, limit)

    async def search_with_conversations(
        self, query: str, limit: int, cid: int | None = None, offset: int = 0
    ) -> tuple[list[SearchHit], dict[int, Conversation]]:
        return await self._call(self._store.search_with_conversations, query, limit, cid, offset)

    # -- a full disk ---------------------------------------------------------------------

    async def finish(self, outcome: TurnOutcome) -> bool:
        """Store how a turn ended; False when it could not be written (a full disk, a database
        another program holds locked) and is kept in memory, written later."""
        self._kept.pop(outcome.key, None)  # an older outcome of the same turn is superseded
        try:
            await self._call(self._store.finish, outcome)
        except (DiskFull, sqlite3.DatabaseError) as exc:
            self._unwritable = self._why(exc)
            if not self._kept:
                logger.warning("%s: replies are kept in memory until they can be written", self._unwritable)
            self._kept[outcome.key] = outcome
            if self._retry is None or self._retry.done():
                self._retry = asyncio.create_task(self._retry_kept())
            return False
        return True

    def _why(self, exc: Exception) -> str:
        if isinstance(exc, DiskFull):
            return f"the disk holding {self._folder()} is full"
        return f"the history database cannot be written now ({exc})"

    def kept_message(self) -> str:
        """What a client is told when its turn's outcome was kept in memory."""
        return (
            f"{self._unwritable}, so this reply is not saved yet: it is kept in memory and saved as soon as "
            "it can be; free some space, or end what holds the database (stopping the daemon before then "
            "loses it)"
        )

    def shown(self, turns: list[Turn]) -> list[Turn]:
        """Turns as read from the store, with the outcomes kept in memory in place."""
        if not self._kept:
            return turns
        return [
            kept.shown_on(t) if (kept := self._kept.get((t.conversation_id, t.turn))) else t for t in turns
        ]

    async def ensure_room(self) -> None:
        """Raise ``DiskFull`` unless there is room to start a turn: kept outcomes are written
        first, and the disk must have ``MIN_FREE_BYTES`` free."""
        if self._kept and not await self.flush():
            raise DiskFull(
                f"{self._unwritable} and {len(self._kept)} reply(ies) wait in memory to be saved; free some "
                "space (or end what holds the database), then ask again"
            )
        if self._store.path == MEMORY or time.monotonic() < self._roomy_until:
            return
        free = free_bytes(self._folder())
        if free is None or free >= ROOMY_BYTES:
            self._roomy_until = time.monotonic() + ROOMY_FOR
        elif free < MIN_FREE_BYTES:
            raise DiskFull(
                f"the disk holding {self._folder()} is full ({free // 1024} KiB free); free some space, then ask again"
            )

    async def flush(self) -> bool:
        """Write the kept outcomes, oldest first, until one fails; True when none is left."""
        async with self._flushing:
            for key, outcome in list(self._kept.items()):
                try:
                    await self._call(self._store.finish, outcome)
                except (DiskFull, sqlite3.DatabaseError) as exc:
                    self._unwritable = self._why(exc)
                    return False
                if self._kept.get(key) is outcome:
                    del self._kept[key]
                logger.info("turn %d of conversation %d, kept in memory, is saved now", *key)
                if self.on_saved is not None:
                    self.on_saved(outcome)
            return True

    async def _retry_kept(self) -> None:
        delay = RETRY_FIRST
        while self._kept:
            await asyncio.sleep(delay)
            if await self.flush():
                return
            delay = min(delay * 2, RETRY_MAX)

    def _folder(self) -> Path:
        return Path(self._store.path).parent

    async def close(self) -> None:
        """Close the store after the calls already queued (and a last try at writing what a full
        disk kept in memory), then end the thread."""
        if self._closed:
            return
        if self._retry is not None:
            self._retry.cancel()
        if self._kept and not await self.flush():
            logger.error("%s: %d reply(ies) kept in memory are lost", self._unwritable, len(self._kept))
        self._closed = True
        try:
            await self._thread.submit(self._store.close)
        finally:
            # The queue is empty by now, so this only joins an idle thread.
            self._thread.stop()


class AsyncKnowledgeStore:
    """The history's knowledge-base tables (``HistoryStore.kb``), each method run on the history
    thread as ``AsyncHistory``'s are."""

    def __init__(self, history: AsyncHistory, kb: KnowledgeStore) -> None:
        self._call = history._call
        self._kb = kb

    async def get(self, name: str) -> KnowledgeBase | None:
        return await self._call(self._kb.get, name)

    async def ids(self) -> list[int]:
        return await self._call(self._kb.ids)

    async def ids_named(self, names: Sequence[str]) -> dict[str, int]:
        return await self._call(self._kb.ids_named, names)

    async def ensure(self, name: str) -> tuple[KnowledgeBase, bool]:
        return await self._call(self._kb.ensure, name)

    async def all(self) -> list[KnowledgeBase]:
        return await self._call(self._kb.all)

    async def delete_chunks(self, kb_id: int, limit: int) -> int:
        return await self._call(self._kb.delete_chunks, kb_id, limit)

    async def begin_remove(self, name: str) -> KnowledgeBase | None:
        return await self._call(self._kb.begin_remove, name)

    async def being_removed(self) -> list[int]:
        return await self._call(self._kb.being_removed)

    async def remove(self, kb_id: int) -> None:
        return await self._call(self._kb.remove, kb_id)

    async def set_link(self, name: str, cid: int | None, linked: bool) -> KnowledgeBase | None:
        return await self._call(self._kb.set_link, name, cid, linked)

    async def linked(self, cid: int) -> list[KnowledgeBase]:
        return await self._call(self._kb.linked, cid)

    async def linked_ids(self, cid: int, *, live: bool = False) -> list[int]:
        return await self._call(self._kb.linked_ids, cid, live=live)

    async def documents(self, kb_id: int) -> list[KbDocument]:
        return await self._call(self._kb.documents, kb_id)

    async def put_document(self, kb_id: int, document: NewKbDocument) -> tuple[KbDocument, list[int], list[int]]:
        return await self._call(self._kb.put_document, kb_id, document)

    async def set_mtime(self, document_id: int, mtime_ns: int) -> None:
        return await self._call(self._kb.set_mtime, document_id, mtime_ns)

    async def remove_documents(self, kb_id: int, paths: Iterable[str]) -> list[int]:
        return await self._call(self._kb.remove_documents, kb_id, paths)

    async def document_chunks(self, kb_id: int, path: str) -> list[KbChunk]:
        return await self._call(self._kb.document_chunks, kb_id, path)

    async def chunks(self, ids: Sequence[int]) -> list[KbChunk]:
        return await self._call(self._kb.chunks, ids)

    async def chunks_and_vectors(
        self, model: str, ids: Sequence[int], vector_ids: Sequence[int]
    ) -> tuple[list[KbChunk], list[tuple[int, bytes]]]:
        return await self._call(self._kb.chunks_and_vectors, model, ids, vector_ids)

    async def search(self, phrases: Sequence[str], kb_ids: Sequence[int] | None, limit: int) -> list[tuple[int, float]]:
        return await self._call(self._kb.search, phrases, kb_ids, limit)

    async def pending_chunks(
        self, model: str, dim: int | None, kb_id: int, after: int, limit: int
    ) -> list[tuple[int, str]]:
        return await self._call(self._kb.pending_chunks, model, dim, kb_id, after, limit)

    async def count_pending(self, model: str, dim: int | None, kb_id: int) -> int:
        return await self._call(self._kb.count_pending, model, dim, kb_id)

    async def count_vectors(self, model: str, dim: int | None, kb_id: int) -> int:
        return await self._call(self._kb.count_vectors, model, dim, kb_id)

    async def all_embedded(self, model: str, kb_id: int) -> bool:
        return await self._call(self._kb.all_embedded, model, kb_id)

    async def put_vectors(self, model: str, dim: int, rows: Sequence[tuple[int, bytes]]) -> list[int]:
        return await self._call(self._kb.put_vectors, model, dim, rows)

    async def vector_dims(self, model: str) -> dict[int, int]:
        return await self._call(self._kb.vector_dims, model)

    async def vectors(self, model: str, dim: int, after: int, limit: int) -> list[tuple[int, bytes]]:
        return await self._call(self._kb.vectors, model, dim, after, limit)

    async def vectors_of(self, model: str, ids: Sequence[int]) -> list[tuple[int, bytes]]:
        return await self._call(self._kb.vectors_of, model, ids)


def is_damaged(exc: sqlite3.Error) -> bool:
    """Whether SQLite found the database damaged, or no database at all (SQLITE_CORRUPT,
    SQLITE_NOTADB): a file overwritten or cut while the daemon runs."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def is_disk_full(exc: sqlite3.Error) -> bool:
    """Whether SQLite failed for want of space (SQLITE_FULL)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF == sqlite3.SQLITE_FULL


def free_bytes(folder: Path) -> int | None:
    """Bytes a non-root process may still write on the file system of ``folder``; None if unknown."""
    try:
        stat = os.statvfs(folder)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def quick_check(path: Path | str) -> str | None:
    """``PRAGMA quick_check`` on a read-only connection: None for "ok", else its first findings."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = [row[0] for row in conn.execute("PRAGMA quick_check(5)")]
    except sqlite3.DatabaseError as exc:
        return str(exc)
    finally:
        conn.close()
    return None if rows == ["ok"] else "; ".join(rows)


def unusable(path: Path, exc: BaseException) -> StartupError:
    """The start-up error for a history that cannot be opened: the file, and what to do."""
    if isinstance(exc, PermissionError):
        return StartupError(
            f"cannot open {path}: permission denied; fix the permissions of {path.parent} "
            "(the daemon runs as you), or set ASSISTANT_DATA_DIR to a folder you own"
        )
    free = free_bytes(path.parent)
    # SQLite says "disk I/O error" when it cannot make the -shm file of a WAL database on a
    # full disk: a damaged file must not be blamed (and moved aside) for a want of space
    if (isinstance(exc, OSError) and exc.errno == errno.ENOSPC
            or isinstance(exc, sqlite3.Error) and is_disk_full(exc) or "database or disk is full" in str(exc)
            or free is not None and free < MIN_FREE_BYTES):
        return StartupError(f"the disk holding {path} is full; free some space and start again")
    if isinstance(exc, sqlite3.DatabaseError):
        return StartupError(
            f"{path} is not a usable database ({exc}); move it aside (mv {path} {path}.damaged) and start "
            "again: a new, empty history is made (the old file can be inspected or restored from a backup)"
        )
    return StartupError(f"cannot open {path} ({exc}); check the file and its folder")
