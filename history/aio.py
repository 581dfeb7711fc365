"""AsyncHistory: the HistoryStore on its own thread, awaited from asyncio.

SQLite calls block, so they must not run on the event loop; and a sqlite3 connection
belongs to the thread that made it. One dedicated thread (``HistoryThread``) therefore
creates the store and runs every call, in submission order (aiosqlite's design).

``AsyncHistory.run`` takes a store method named on its class, with its arguments, typed by
its signature (``await history.run(HistoryStore.turns, cid)``; the knowledge-base tables'
through ``history.kb.run(KnowledgeStore.get, name)``): go-to-definition leads to the method
that runs. Each call sends the whole store method to the thread, so a multi-statement write
is one trip and one transaction, never statements interleaved with other callers; reads a
caller needs together are one store method too (``HistoryStore.replay_source``,
``search_with_conversations``). ``AsyncHistory``'s own methods are those with logic of their
own: a turn's outcome kept through a full disk, the disk's room, the quick check.

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
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from core.errors import DiskFull, HistoryDamaged, StartupError

from .connection import MEMORY
from .archive import ArchiveStore
from .kb import KnowledgeStore
from .memories import MemoryStore
from .records import Turn, TurnOutcome
from .store import HistoryStore

P = ParamSpec("P")
T = TypeVar("T")
S = TypeVar("S")  # a group of tables with a store of its own (AsyncTables)

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
        self.kb = AsyncTables(self, store.kb)
        self.archive = AsyncTables(self, store.archive)  # recall injection's queries
        self.elsewhere = AsyncTables(self, store.elsewhere)  # and across conversations (history/elsewhere.py)
        self.recall_vectors = AsyncTables(self, store.recall_vectors)  # their vectors (history/recallvec.py)
        self.memories = AsyncTables(self, store.memories)  # saved memories (history/memories.py)
        self.journal = AsyncTables(self, store.journal)  # the live state's numbering and journal

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

    async def run(self, method: Callable[Concatenate[HistoryStore, P], T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``method``, a ``HistoryStore`` method named on its class, run on the history thread:
        ``await history.run(HistoryStore.turns, cid)``. A full disk is DiskFull."""
        return await self._submit(partial(method, self._store, *args, **kwargs))

    async def _submit(self, call: Callable[[], T]) -> T:
        if self._closed:
            raise RuntimeError("history store is closed")
        try:
            return await self._thread.submit(call)
        except sqlite3.OperationalError as exc:
            if not is_disk_full(exc):
                raise
            raise DiskFull(f"the disk holding {self._folder()} is full; free some space and try again") from exc
        except sqlite3.DatabaseError as exc:
            if not is_damaged(exc):
                raise
            raise HistoryDamaged(self._store.path, exc) from exc

    # -- a full disk ---------------------------------------------------------------------

    async def finish(self, outcome: TurnOutcome) -> bool:
        """Store how a turn ended; False when it could not be written (a full disk, a database
        another program holds locked) and is kept in memory, written later."""
        self._kept.pop(outcome.key, None)  # an older outcome of the same turn is superseded
        try:
            await self.run(HistoryStore.finish, outcome)
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
                    await self.run(HistoryStore.finish, outcome)
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


class AsyncTables(Generic[S]):
    """A group of the history's tables with a store of their own (``HistoryStore.kb``,
    ``HistoryStore.archive``), on the history thread as ``AsyncHistory``'s are:
    ``await history.kb.run(KnowledgeStore.get, name)``."""

    def __init__(self, history: AsyncHistory, tables: S) -> None:
        self._history = history
        self._tables = tables

    async def run(self, method: Callable[Concatenate[S, P], T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``method``, a method of the tables' store named on its class, run on the history thread."""
        return await self._history._submit(partial(method, self._tables, *args, **kwargs))


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
