"""Work the daemon does beside the turns (checkpoints, titles, a deleted conversation's search
rows): logged if it fails, waited for by ``settle``, cancelled at shutdown once turns end."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["Background"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Background:
    """The daemon's background tasks, kept so that none is lost or left running."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    async def settle(self) -> None:
        """Wait until no background work is left (work may spawn more)."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    async def cancel(self) -> None:
        """Cancel what is left, and wait for it to end."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background task failed", exc_info=task.exception())
