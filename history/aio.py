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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

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
        except BaseException:
            executor.shutdown(wait=False, cancel_futures=True)
            raise
        return cls(executor, store)

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
