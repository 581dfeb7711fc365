"""Running several extractions at once, all or nothing.

A question's files are extracted concurrently, and one refusal refuses the
whole question: nothing is sent.  ``gather_all`` therefore cancels the other
extractions at the first failure (their subprocesses are killed by their own
cleanup) and raises that failure itself, not the ``ExceptionGroup`` a bare
``asyncio.TaskGroup`` would, so callers catch ``FileRefused`` as usual.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

__all__ = ["gather_all"]

T = TypeVar("T")


async def gather_all(coroutines: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coroutines`` concurrently and return their results in order.

    On a failure the others are cancelled and the failure of the earliest
    coroutine (in the given order) that failed is raised.
    """
    tasks: list[asyncio.Task[T]] = []
    try:
        async with asyncio.TaskGroup() as group:
            for coroutine in coroutines:
                tasks.append(group.create_task(coroutine))
    except BaseExceptionGroup as failed:
        raise (_earliest(tasks) or failed.exceptions[0]) from None
    return [task.result() for task in tasks]


def _earliest(tasks: list[asyncio.Task[T]]) -> BaseException | None:
    """The failure of the earliest task (in the given order) that failed, if one did."""
    for task in tasks:
        if task.done() and not task.cancelled() and (error := task.exception()) is not None:
            return error
    return None
