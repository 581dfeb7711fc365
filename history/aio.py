"""AsyncHistory: the HistoryStore on its own thread, awaited from asyncio.

SQLite calls block, so they must not run on the event loop; and a sqlite3 connection
belongs to the thread that made it. One single-worker executor therefore creates the
store and runs every call, in submission order (aiosqlite's design). Callers send
whole store methods, `await history.run(lambda s: s.turns(cid))`, so a multi-statement
write is one hop and one transaction, never statements interleaved with other callers.

Cancelling an awaiting caller does not stop a call already running on the thread: the
transaction still completes (or rolls back) as a whole.
"""

from __future__ import annotations

import asyncio
import errno
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from core.errors import StartupError

from .store import HistoryStore

T = TypeVar("T")

THREAD_NAME_PREFIX = "history"


class AsyncHistory:
    """One HistoryStore owned by one dedicated thread."""

    def __init__(self, executor: ThreadPoolExecutor, store: HistoryStore) -> None:
        self._executor = executor
        self._store = store
        self._closed = False

    @classmethod
    async def open(cls, path: Path | str) -> AsyncHistory:
        """Open (and migrate) the store on a new history thread."""
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME_PREFIX)
        loop = asyncio.get_running_loop()
        try:
            store = await loop.run_in_executor(executor, HistoryStore, path)
        except BaseException as exc:
            executor.shutdown(wait=False, cancel_futures=True)
            if isinstance(exc, (sqlite3.DatabaseError, OSError)):
                raise unusable(Path(path), exc) from exc
            raise
        return cls(executor, store)

    async def check(self) -> str | None:
        """What SQLite's quick check finds wrong with the database, None when it is sound.

        On its own read-only connection in a thread of its own: a large database takes a
        while, and the history thread must go on serving turns meanwhile.
        """
        return await asyncio.to_thread(quick_check, self._store.path)

    async def run(self, fn: Callable[[HistoryStore], T]) -> T:
        """Run fn(store) on the history thread and return its result."""
        if self._closed:
            raise RuntimeError("history store is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, self._store)

    async def close(self) -> None:
        """Close the store after the calls already queued, then end the thread."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self._store.close)
        finally:
            # The queue is empty by now, so this only joins an idle thread.
            self._executor.shutdown(wait=True)


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
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC or "database or disk is full" in str(exc):
        return StartupError(f"the disk holding {path} is full; free some space and start again")
    if isinstance(exc, sqlite3.DatabaseError):
        return StartupError(
            f"{path} is not a usable database ({exc}); move it aside (mv {path} {path}.damaged) and start "
            "again: a new, empty history is made (the old file can be inspected or restored from a backup)"
        )
    return StartupError(f"cannot open {path} ({exc}); check the file and its folder")
