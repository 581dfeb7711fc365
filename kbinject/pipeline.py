"""``Ingest``: the add pipeline of a knowledge base, from paths to stored, embedded chunks.

An add collects the files under the paths given (ingest.py), reads a few at a time
(``INGEST_CONCURRENCY``: each PDF runs pdftotext and pdfinfo), skips the ones whose
size and mtime, or else content hash, are unchanged, stores the rest through the
vector index (index.py, which keeps the index in step), removes the documents of a
folder added again whose files are gone, and embeds every chunk still without a
vector, ``BATCH_SIZE`` at a time. Progress goes to the caller's callback, throttled to
one step per ``PROGRESS_INTERVAL`` per phase.

Adds to one KB are serialised (a per-name lock, ``lock``): two adds of the same files
would otherwise both find them new. Adds to different KBs run concurrently. A file the
user can fix, and an embedder that fails, are noted in the ``AddResult``, never raised.

``cancel`` stops the adds of a KB: no further file is taken (those being read are
stored whole, each in its own transaction, so the KB never holds half a document),
folders are not checked for vanished files, and a batch being embedded is abandoned
(its chunks stay pending, embedded by a later add). The add then returns what it did.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from attachments import Ocr
from core.errors import DiskFull, FileRefused, no_kb
from history import AsyncHistory, KbDocument, KnowledgeStore, NewKbDocument

from .embedder import BATCH_SIZE, BatchEmbedder, EmbedderFailed
from .index import REMOVE_BATCH, KbIndex
from .ingest import (
    Collected,
    FileNote,
    Found,
    Staged,
    collect,
    file_hash,
    in_ingest_thread,
    read_document,
    stage,
)
from .records import AddResult, KbProgress, ProgressCallback

__all__ = ["INGEST_CONCURRENCY", "PROGRESS_INTERVAL", "Ingest"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

INGEST_CONCURRENCY = 4  # files extracted at once (each PDF runs pdftotext and pdfinfo)
PROGRESS_INTERVAL = 0.2  # seconds between two progress callbacks of one phase
# times one add goes round its KB again because the model changed size under way (a
# server that keeps switching models must not hold the add forever)
MAX_DIMENSION_RESTARTS = 2


class _Throttle:
    """Passes progress on at most every PROGRESS_INTERVAL seconds, and always the last step."""

    def __init__(self, callback: ProgressCallback | None) -> None:
        self.callback = callback
        self.last = 0.0

    def __call__(self, step: KbProgress) -> None:
        if self.callback is None:
            return
        now = time.monotonic()
        if step.done < step.total and now - self.last < PROGRESS_INTERVAL and step.done:
            return
        self.last = now
        try:
            self.callback(step)
        except Exception:  # a broken listener must not stop the ingest
            logger.exception("kb: progress callback failed")


class Ingest:
    """Adds files to knowledge bases and embeds their chunks; one add per KB at a time."""

    def __init__(self, history: AsyncHistory, index: KbIndex, embedder: BatchEmbedder | None, ocr: Ocr) -> None:
        self.history = history
        self.ocr = ocr  # scanned PDF pages are read as for a question
        self.index = index
        self.embedder = embedder
        self._locks: dict[str, asyncio.Lock] = {}
        self._stops: dict[str, set[asyncio.Event]] = {}  # per KB name: one event per add running or waiting
        # per KB name: when it was last cancelled (monotonic), for adds sent before that but
        # not here yet (a connection runs a client's adds of one KB one after the other)
        self._cancelled_at: dict[str, float] = {}

    def lock(self, name: str) -> asyncio.Lock:
        """The lock of the KB of this (valid) name: held by its adds and its removal."""
        # the lock stays once made (a few bytes): an add waiting on it must not run beside
        # a new one made after the KB was removed
        return self._locks.setdefault(name, asyncio.Lock())

    def cancel(self, name: str, sent: float | None = None) -> bool:
        """Stop the adds of the KB ``name`` (running or waiting for its lock), and those sent
        before ``sent`` (monotonic: when the cancel was sent) that are not here yet; False
        when none is running."""
        self._cancelled_at[name] = time.monotonic() if sent is None else sent
        stops = self._stops.get(name, set())
        for stop in stops:
            stop.set()
        return bool(stops)

    async def add(self, name: str, paths: Sequence[str], progress: ProgressCallback | None,
                  sent: float | None = None) -> AddResult:
        """Add files and folders to the KB ``name`` (created if new): extract, chunk, store, embed.

        ``sent`` (monotonic) is when the client sent it: an add sent before a cancel of its
        KB is stopped before it reads anything, even when it gets here after the cancel; one
        sent after the cancel runs.
        """
        stop = asyncio.Event()
        if sent is not None and sent < self._cancelled_at.get(name, -1.0):
            stop.set()
        stops = self._stops.setdefault(name, set())
        stops.add(stop)
        try:
            async with self.lock(name):
                result = await self._add(name, paths, progress, stop)
        finally:
            stops.discard(stop)
            if not stops:
                del self._stops[name]
        logger.info("kb %s: %d added, %d updated, %d unchanged, %d removed, %d errors; %d chunks embedded%s",
                    name, result.added, result.updated, result.unchanged, result.removed, len(result.errors),
                    result.embedded, f"; cancelled, {result.unread} file(s) unread" if result.cancelled else "")
        return result

    async def _add(self, name: str, paths: Sequence[str], progress: ProgressCallback | None,
                   stop: asyncio.Event) -> AddResult:
        record, created = await self.history.kb.run(KnowledgeStore.ensure, name)
        result = AddResult(kb=name, created=created)
        found = await in_ingest_thread(collect, list(paths)) if not stop.is_set() else Collected()
        result.errors += found.errors
        result.skipped += found.skipped
        report = _Throttle(progress)
        await self._read_all(record.id, found, result, report, stop)
        if self.embedder is not None and not stop.is_set():
            await self._embed_kb(record.id, result, report, stop)
        final = await self.history.kb.run(KnowledgeStore.get, name)
        assert final is not None
        if created and final.documents == 0 and not stop.is_set():  # nothing it was given could be read:
            # no empty KB is left behind (a cancelled add keeps the KB it made, as a link may wait on it)
            await self.index.remove_kb(final)
            result.created = False
        result.documents, result.chunks = final.documents, final.chunks
        if self.embedder is not None:
            result.pending = await self.history.kb.run(
                KnowledgeStore.count_pending, self.embedder.model, self.embedder.dim, record.id)
        result.cancelled = stop.is_set()
        return result

    async def embed_pending(self, name: str, total: AddResult, progress: ProgressCallback | None) -> None:
        """Embed the chunks of the KB ``name`` still without a vector, counting into ``total``."""
        if self.embedder is None:
            return
        async with self.lock(name):
            record = await self.history.kb.run(KnowledgeStore.get, name)
            if record is None:
                raise no_kb(name)
            await self._embed_kb(record.id, total, _Throttle(progress), asyncio.Event())
            total.pending += await self.history.kb.run(
                KnowledgeStore.count_pending, self.embedder.model, self.embedder.dim, record.id)

    # -- reading --------------------------------------------------------------------------

    async def _read_all(
        self, kb_id: int, found: Collected, result: AddResult, report: _Throttle, stop: asyncio.Event
    ) -> None:
        known = {doc.path: doc for doc in await self.history.kb.run(KnowledgeStore.documents, kb_id)}
        total = len(found.files)
        done = 0
        report(KbProgress(0, total, "reading", "reading files"))
        queue = iter(found.files)
        full: list[DiskFull] = []  # a full disk fails every file after it: the add stops with it

        async def worker() -> None:
            # a few workers take the files in turn: not one task per file of a big folder
            nonlocal done
            for file in queue:
                if stop.is_set() or full:
                    return  # the file taken is left unread with the rest
                try:
                    await self._read_one(kb_id, file, known.get(file.path), result)
                except DiskFull as exc:
                    full.append(exc)
                    return
                except Exception as exc:  # a store failure for one file must not stop the rest
                    logger.exception("kb: indexing %s failed", file.path)
                    reason = f"could not be indexed ({type(exc).__name__}); see the daemon's log"
                    result.errors.append(FileNote(file.path, reason))
                done += 1
                report(KbProgress(done, total, "reading", os.path.basename(file.path)))

        async with asyncio.TaskGroup() as group:
            for _ in range(min(INGEST_CONCURRENCY, total)):
                group.create_task(worker())
        if full:
            raise full[0]  # what was indexed before stays; adding the folder again goes on from there
        if stop.is_set():
            result.unread = total - done  # and the folders were not all seen: nothing is removed
            return
        await self._remove_vanished(kb_id, found, known, result)

    async def _read_one(self, kb_id: int, file: Found, known: KbDocument | None, result: AddResult) -> None:
        """Index one file, or note why not; a file the user can fix is noted, not raised."""
        try:
            staged = await in_ingest_thread(stage, file, reading=file.path)
            if staged.kind == "image":
                result.skipped.append(FileNote(file.path, "an image: knowledge bases index text and PDF only"))
                return
            if known is not None and (known.size_bytes, known.mtime_ns) == (staged.size, staged.mtime_ns):
                result.unchanged += 1
                return
            sha256 = await in_ingest_thread(file_hash, file.path, staged.size, staged.kind, reading=file.path)
            if known is not None and known.sha256 == sha256:
                result.unchanged += 1
                await self.history.kb.run(KnowledgeStore.set_mtime, known.id, staged.mtime_ns)
                return
            document = await read_document(staged, sha256, self.ocr)
        except FileRefused as exc:  # UnsupportedKind too
            note = FileNote(file.path, exc.message)
            (result.skipped if exc.code == "unsupported_kind" else result.errors).append(note)
            return
        except OSError as exc:
            result.errors.append(FileNote(file.path, f"cannot be read ({exc.strerror or exc})"))
            return
        await self._store_document(kb_id, staged, document, known, result)

    async def _store_document(
        self, kb_id: int, staged: Staged, document: NewKbDocument, known: KbDocument | None, result: AddResult
    ) -> None:
        if not document.chunks:
            reason = "no text to index" + (" (a scanned PDF has no text layer)" if staged.kind == "pdf" else "")
            result.skipped.append(FileNote(staged.path, reason))
            if known is not None:  # it had text before: the old chunks no longer stand for it
                await self.index.remove_documents(kb_id, [staged.path])
                result.removed += 1
            return
        ids = await self.index.put_document(kb_id, document)
        if known is None:
            result.added += 1
        else:
            result.updated += 1
        result.new_chunks += len(ids)
        if document.truncated:
            result.truncated.append(staged.path)

    async def _remove_vanished(
        self, kb_id: int, found: Collected, known: dict[str, KbDocument], result: AddResult
    ) -> None:
        """Documents under a folder added again whose files are gone are removed."""
        seen = {file.path for file in found.files}
        prefixes = tuple(folder.rstrip("/") + "/" for folder in found.folders)
        candidates = [path for path in known if path not in seen and path.startswith(prefixes)] if prefixes else []
        gone = await in_ingest_thread(_missing, candidates)
        # about REMOVE_BATCH chunks a transaction, as a KB's removal goes: a big deleted folder
        # in one held the history thread, every turn waiting
        batch: list[str] = []
        size = 0
        for path in gone:
            batch.append(path)
            size += known[path].chunks
            if size >= REMOVE_BATCH or path == gone[-1]:
                await self.index.remove_documents(kb_id, batch)
                result.removed += len(batch)
                batch, size = [], 0

    # -- embedding ------------------------------------------------------------------------

    async def _embed_kb(self, kb_id: int, result: AddResult, report: _Throttle, stop: asyncio.Event) -> None:
        """Embed every chunk of the KB without a vector of the size the model gives now, in
        batches, until ``stop``; a failure is noted, not raised."""
        assert self.embedder is not None
        embedder = self.embedder
        model = embedder.model
        try:
            dim = embedder.dim
            if await self.history.kb.run(KnowledgeStore.all_embedded, model, kb_id):
                # the model is asked the size of its vectors now, so the passages a model since
                # swapped for another embedded are found pending (were any passage without a
                # vector, its batch would tell, as it comes back)
                dim = await _until(stop, embedder.dimension())
                if stop.is_set():
                    return
            total = await self.history.kb.run(KnowledgeStore.count_pending, model, dim, kb_id)
            if not total:
                return
            report(KbProgress(0, total, "embedding", f"embedding {total} chunks"))
            after = 0
            done = 0
            restarts = 0
            while not stop.is_set():
                batch = await self.history.kb.run(KnowledgeStore.pending_chunks, model, dim, kb_id, after, BATCH_SIZE)
                if not batch and dim != embedder.dim and restarts < MAX_DIMENSION_RESTARTS:
                    # the model changed size under way: the chunks before the cursor have
                    # vectors of the old size, so go round once more from the start
                    # (the first size seen, when none was known, is not a change)
                    dim, after, restarts = embedder.dim, 0, restarts + (dim is not None)
                    continue
                if not batch:
                    break
                after = batch[-1][0]
                vectors = await _until(stop, embedder.documents([text for _, text in batch]))
                if vectors is None:
                    return  # cancelled: the batch stays pending
                result.embedded += await self.index.store([chunk_id for chunk_id, _ in batch], vectors)
                done += len(batch)
                report(KbProgress(min(done, total), total, "embedding", f"embedded {done} of {total} chunks"))
        except EmbedderFailed as exc:
            result.embedding_error = (
                f"{exc.message}; the chunks are searchable by keywords and will be embedded on the next add"
            )
            logger.warning("kb: embedding stopped: %s", exc.message)
        finally:
            await self.index.settle()


async def _until(stop: asyncio.Event, work: Coroutine[Any, Any, T]) -> T | None:
    """What ``work`` returns, or None when ``stop`` is set first (``work`` is then cancelled)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait([task])
    return None if task.cancelled() else task.result()


def _missing(paths: Sequence[str]) -> list[str]:
    """The paths that are gone: not those the daemon may not look at (a folder made unreadable)."""
    missing = []
    for path in paths:
        try:
            os.lstat(path)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                missing.append(path)
    return missing
