"""``KbIndex``: the in-memory vector index of the daemon's embedding model, kept in step
with the store, and the nearest-vector search over it.

It owns the index's life: loaded once per daemon, on first need (the daemon asks right
after it is ready), by one task under ``lock``; every write that adds or removes
vectors (storing a document, removing documents or a KB, storing vectors) goes through
here and holds that lock around its store call and the matching index change, so a
load never misses or doubles a write. Searches take no lock (``VectorIndex`` publishes
consistent snapshots); the hits a search returns are read from the store after it,
so a chunk removed in between just drops out of the list.

numpy is imported only on the paths that need vectors (loading, storing vectors,
searching), never at module level, and always through ``vectors.py`` (which keeps its
BLAS at one thread): ``import kbinject`` is on the daemon's start-up path, and numpy
would take a large share of the start-up target (``bench/bench_startup.py``). Those paths
run after start-up, and only once a knowledge base with embeddings exists.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from core.errors import DiskFull
from history import AsyncHistory, KnowledgeBase, KnowledgeStore, NewKbDocument, kb_chunk_range

from .search import CANDIDATES

if TYPE_CHECKING:  # numpy-side types only: see the module docstring
    from .embedder import Vector
    from .vectors import VectorIndex

__all__ = ["LOAD_PAGE", "REMOVE_BATCH", "KbIndex"]

logger = logging.getLogger(__name__)

# Vectors read per trip to the store while loading the index (1.5 MB at 384). Small on
# purpose: glibc raises its mmap threshold to the largest block freed, so big pages (their
# blobs, the blobs' join, the float32 copy) put every later temporary on the heap and left
# much freed-but-held memory behind after a big load; small ones leave little, and the
# load is no slower (bench/bench_kb.py).
LOAD_PAGE = 1_024
REMOVE_BATCH = 2_000  # chunks deleted per transaction when a KB is removed: turns go between them


class KbIndex:
    """The chunk vectors of one embedding model ("" = none): loaded once, kept in step, searched.

    A chunk has at most one vector of the model (the store's key), but the model behind
    the name may change size: the vectors of each dimension are indexed on their own, and
    a query searches those of its own. So a model swapped for another, or a server that
    answers one batch with another model, loses nothing: a chunk whose vector is not of the
    size the model gives now is embedded again by the next add (history/kb.py, pending).
    """

    def __init__(self, history: AsyncHistory, model: str) -> None:
        self.history = history
        self.model = model
        self.lock = asyncio.Lock()  # held by the load and by every write of chunks or vectors
        self._indexes: dict[int, VectorIndex] = {}  # by dimension; empty until loaded
        # chunks given a vector of another size than the one an index holds for them: gone
        # from it at ``settle`` (each removal copies the index: once an add, not once a batch)
        self._moved: dict[int, set[int]] = {}
        self._loaded = False
        self._task: asyncio.Task[None] | None = None

    def of(self, dim: int) -> VectorIndex | None:
        """The index of the vectors of ``dim`` dimensions as it stands (None before the load,
        or while there is none of that size)."""
        return self._indexes.get(dim)

    def elsewhere(self, dim: int, kb_ids: Sequence[int] | None) -> dict[int, int]:
        """{dimension: vectors} of these KBs' chunks (None: all) in the indexes of other sizes
        than ``dim``: vectors a query of ``dim`` cannot be compared with."""
        counts = {other: index.count_in(kb_ids) for other, index in self._indexes.items() if other != dim}
        return {other: count for other, count in counts.items() if count}

    # -- loading --------------------------------------------------------------------------

    async def ready(self) -> None:
        """Make sure the index is loaded (one load, shared by every caller)."""
        if self._loaded:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._load(), name="kb-index-load")
            self._task.add_done_callback(_log_load_failure)
        await asyncio.shield(self._task)

    async def close(self) -> None:
        """Stop a load still running."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _load(self) -> None:
        from . import vectors  # numpy: first needed here (module docstring)

        model = self.model
        started = time.monotonic()
        async with self.lock:
            if self._loaded:
                return
            dims = await self.history.kb.run(KnowledgeStore.vector_dims, model)
            indexes = {}
            for dim, count in dims.items():
                index = indexes[dim] = vectors.VectorIndex(dim, capacity=count)
                after = 0
                while rows := await self.history.kb.run(KnowledgeStore.vectors, model, dim, after, LOAD_PAGE):
                    after = rows[-1][0]
                    good = [(chunk_id, blob) for chunk_id, blob in rows if len(blob) == dim * 4]
                    if good:
                        matrix = vectors.vectors_from_blobs([blob for _, blob in good], dim)
                        index.add([chunk_id for chunk_id, _ in good], matrix, replace=False)
            self._indexes, self._loaded = indexes, True
        for dim, index in indexes.items():
            logger.info("kb: %d vectors of %s (%d dimensions) loaded in %.2f s",
                        len(index), model, dim, time.monotonic() - started)

    # -- writes that add or remove vectors ----------------------------------------------

    async def put_document(self, kb_id: int, document: NewKbDocument) -> builtins.list[int]:
        """Store a document (replacing one at its path); its new chunk ids."""
        async with self.lock:
            _, ids, replaced = await self.history.kb.run(KnowledgeStore.put_document, kb_id, document)
            if replaced:
                self._remove(replaced)
        return ids

    async def remove_documents(self, kb_id: int, paths: Sequence[str]) -> None:
        """Remove these documents of a KB, their chunks and vectors."""
        async with self.lock:
            removed = await self.history.kb.run(KnowledgeStore.remove_documents, kb_id, paths)
            if removed:
                self._remove(removed)

    async def remove_kb(self, kb: KnowledgeBase) -> KnowledgeBase | None:
        """Delete a KB and everything in it; the record as it was removed (None if gone already).

        It leaves every list and link at once (history/kb.py ``begin_remove``); its chunks
        then go ``REMOVE_BATCH`` at a time, so turns keep using the history thread while a
        big KB is removed. A removal cut short is finished by ``finish_removals``.
        """
        async with self.lock:
            removed = await self.history.kb.run(KnowledgeStore.begin_remove, kb.name)
            if removed is not None:
                try:
                    await self._delete(removed.id)
                except DiskFull:  # it is gone for every list, committed: its rows go at the next start
                    logger.warning("kb: %s is removed; its chunks are deleted once there is room "
                                   "(at the next start)", kb.name)
            return removed

    async def finish_removals(self) -> None:
        """Finish the KB removals a stop (or a full disk) cut short: at start-up."""
        async with self.lock:
            for kb_id in await self.history.kb.run(KnowledgeStore.being_removed):
                logger.info("kb: finishing the removal of knowledge base %d", kb_id)
                await self._delete(kb_id)

    async def _delete(self, kb_id: int) -> None:
        for index in self._indexes.values():
            index.remove_range(*kb_chunk_range(kb_id))
        self._drop_empty()
        while await self.history.kb.run(KnowledgeStore.delete_chunks, kb_id, REMOVE_BATCH):
            pass
        await self.history.kb.run(KnowledgeStore.remove, kb_id)

    async def store(self, ids: Sequence[int], computed: Sequence[Vector | None]) -> int:
        """Store and index the vectors computed for these chunks; how many were stored.

        Each replaces the chunk's vector of the model, whatever its size was.
        """
        from .vectors import VectorIndex, np, vector_blob  # numpy: first needed here (module docstring)

        model = self.model
        by_dim: dict[int, builtins.list[tuple[int, Vector]]] = {}
        for chunk_id, vector in zip(ids, computed):
            if vector is not None:
                by_dim.setdefault(int(vector.shape[0]), []).append((chunk_id, vector))
        if not by_dim:
            return 0
        await self.ready()
        stored = 0
        async with self.lock:
            for dim, pairs in by_dim.items():
                blobs = [(chunk_id, vector_blob(v)) for chunk_id, v in pairs]
                put = set(await self.history.kb.run(KnowledgeStore.put_vectors, model, dim, blobs))
                kept = [(chunk_id, v) for chunk_id, v in pairs if chunk_id in put]
                if not kept:
                    continue
                kept_ids = [chunk_id for chunk_id, _ in kept]
                for other in self._indexes:
                    if other != dim:  # a vector of that size they had was replaced
                        self._moved.setdefault(other, set()).update(kept_ids)
                self._moved.get(dim, set()).difference_update(kept_ids)  # back to this size
                index = self._indexes.setdefault(dim, VectorIndex(dim))
                index.add(kept_ids, np.stack([v for _, v in kept]))
                stored += len(kept)
        return stored

    async def settle(self) -> None:
        """Drop from each index the chunks ``store`` gave a vector of another size (after an add:
        until then a query of the old size may find them there, and shows them by keywords)."""
        async with self.lock:
            for dim, moved in self._moved.items():
                if dim in self._indexes and moved:
                    self._indexes[dim].remove(sorted(moved))
            self._moved = {}
            self._drop_empty()

    def _remove(self, ids: Sequence[int]) -> None:
        """Forget these chunks' vectors, of whatever size."""
        for index in self._indexes.values():
            index.remove(ids)
        self._drop_empty()

    def _drop_empty(self) -> None:
        self._indexes = {dim: index for dim, index in self._indexes.items() if len(index)}

    # -- search ---------------------------------------------------------------------------

    async def nearest(
        self, index: VectorIndex, vector: Vector, kb_ids: Sequence[int] | None
    ) -> builtins.list[tuple[int, float]]:
        """The ``CANDIDATES`` chunks of ``index`` nearest ``vector``, (id, cosine) best first.

        ``index`` is the one of ``vector``'s dimension (``of``), as the caller took it. The
        search runs in a worker thread (simsimd and numpy release the GIL); its cosines are
        within ~1e-4 of the float32 ones (vectors.py): the exact ones of the hits shown come
        from ``rescored``.
        """
        return await asyncio.to_thread(index.nearest, vector, CANDIDATES, kb_ids)

    @staticmethod
    def rescored(vector: Vector, blobs: Sequence[tuple[int, bytes]]) -> builtins.list[tuple[int, float]]:
        """The exact cosines of ``vector`` with these stored (id, blob) vectors, best first."""
        from .vectors import exact_cosines  # numpy (module docstring)

        return exact_cosines(vector, blobs)


def _log_load_failure(task: asyncio.Task[None]) -> None:
    # Retrieved here so a load nobody awaits any more (the turn timed out) is still logged.
    if not task.cancelled() and task.exception() is not None:
        logger.error("kb: loading the vector index failed", exc_info=task.exception())
