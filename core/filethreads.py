"""Blocking file work off the event loop, bounded in time, on threads nobody waits for.

``asyncio.to_thread`` and ``ThreadPoolExecutor`` threads are joined when the daemon
stops: one stuck reading a file that never answers (``/proc/kmsg`` for root, a FIFO
behind a path that looks regular, a hung network disk) would hold the daemon up for
ever. A ``FileThreads`` pool runs each call on a daemon thread and gives up on it after
``timeout`` seconds with a ``FileRefused`` naming the file; the stuck thread is left
behind (the process's exit does not wait for it) and another takes its place, so a
pool of N threads always has N that can work.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .errors import FileRefused

__all__ = ["FILE_THREADS", "FileThreads", "READ_TIMEOUT"]

T = TypeVar("T")

READ_TIMEOUT = 60.0  # seconds one call (open, read, hash, classify a file) may take


@dataclass(eq=False)
class _Job:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    call: Callable[[], Any]
    state: str = "queued"  # queued, running, dropped (given up on before it ran), stuck, done
    lock: threading.Lock = field(default_factory=threading.Lock)


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if not future.done():
        future.set_result(value) if ok else future.set_exception(value)


class FileThreads:
    """Up to ``workers`` daemon threads working at once, beside those stuck on a file."""

    def __init__(self, workers: int, name: str) -> None:
        self._workers = workers
        self._name = name
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._stuck = 0

    async def run(self, what: str, fn: Callable[..., T], *args: Any, bounded: bool = True) -> T:
        """``fn(*args)`` on one of the threads; ``FileRefused`` naming ``what`` past
        ``READ_TIMEOUT`` (work that is no file's read, such as chunking, is not ``bounded``)."""
        loop = asyncio.get_running_loop()
        job = _Job(loop, loop.create_future(), lambda: fn(*args))
        self._jobs.put(job)
        with self._lock:
            if self._idle == 0 and self._threads < self._workers + self._stuck:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self._name}-{self._threads}", daemon=True).start()
        timeout = READ_TIMEOUT if bounded else None
        try:
            return await asyncio.wait_for(job.future, timeout)
        except TimeoutError:
            self._give_up(job)
            raise FileRefused(
                f"{what}: reading it did not finish within {timeout:g} s (a file that blocks, such as "
                "/proc/kmsg, or a hung network disk); attach a regular file on a local disk"
            ) from None
        except asyncio.CancelledError:
            self._give_up(job)
            raise

    def _give_up(self, job: _Job) -> None:
        with job.lock:
            if job.state == "queued":
                job.state = "dropped"
            elif job.state == "running":
                job.state = "stuck"
                with self._lock:
                    self._stuck += 1  # a thread more may start while it is stuck

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            job = self._jobs.get()
            with self._lock:
                self._idle -= 1
            with job.lock:
                if job.state == "dropped":
                    continue
                job.state = "running"
            try:
                ok, value = True, job.call()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller as it is
                ok, value = False, exc
            with job.lock:
                if job.state == "stuck":
                    with self._lock:
                        self._stuck -= 1
                job.state = "done"
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                job.loop.call_soon_threadsafe(_settle, job.future, ok, value)


FILE_THREADS = FileThreads(8, "file-read")  # the attachments' reads, checks and hashes
