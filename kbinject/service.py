"""``KnowledgeBases``: the one object the daemon holds for everything KB.

It ties the pieces together: ingest (ingest.py, chunking.py) into the store
(history/kb.py), embedding through the router (embedder.py) into the in-memory vector
index (vectors.py), hybrid search (search.py), auto-injection (injection.py) and the
``kb_search`` tool (tool.py).

Consistency of the vector index: it is loaded once per daemon, on first need, by one
task under ``_index_lock``; every write that adds or removes vectors (storing a
document, storing vectors, removing a KB) holds the same lock around its store call and
the matching index change, so a load never misses or doubles a write. Searches take no
lock (the index publishes consistent snapshots); the float32 vectors a search re-scores
are read from the store after the shortlist, so a chunk removed in between just drops
out of the list.

Adds to one KB are serialised (a per-name lock): two adds of the same files would
otherwise both find them new. Adds to different KBs run concurrently.

Nothing here fails a turn: ``context_block`` logs any failure and injects nothing, and
search falls back to bm25 when the embedder is missing, failing or slow.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from core.errors import BadRequest, FileRefused, NotFound
from core.seams import Embedder
from history import (
    AsyncHistory,
    HistoryStore,
    KbChunk,
    KbDocument,
    KnowledgeBase,
    NewKbDocument,
    kb_chunk_range,
)

from .embedder import BATCH_SIZE, QUERY_TIMEOUT, BatchEmbedder, EmbedderFailed, Vector
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
from .injection import (
    CONTEXT_LIMIT,
    INJECTING_MODES,
    Injection,
    InjectionMode,
    fit_block,
    injection_mode,
    too_full,
)
from .records import AddResult, KbInfo, KbProgress, ProgressCallback
from .search import (
    CANDIDATES,
    MIN_VECTOR_SIMILARITY,
    Hit,
    SearchResult,
    fts_phrases,
    keyword_share,
    query_terms,
    reciprocal_rank_fusion,
)
from .tool import KbSearch
from .vectors import (
    VectorIndex,
    exact_cosines,
    shortlist_size,
    vector_blob,
    vectors_from_blobs,
)

__all__ = ["DEFAULT_SEARCH_LIMIT", "KB_NAME_MAX", "KnowledgeBases"]

logger = logging.getLogger(__name__)

KB_NAME_MAX = 100  # characters in a KB's name
DEFAULT_SEARCH_LIMIT = 5  # hits of a search that names no limit
MAX_SEARCH_LIMIT = 50
INGEST_CONCURRENCY = 4  # files extracted at once (each PDF runs pdftotext and pdfinfo)
# Vectors read per trip to the store while loading the index (1.5 MB at 384). Small on
# purpose: glibc raises its mmap threshold to the largest block freed, so pages of
# 8,192 (12 MB of blobs, their join, the float32 copy) put every later temporary on the
# heap and left ~40 MB of freed-but-held memory behind at 100k vectors; at 1,024 it is
# ~4 MB, and the load is no slower (0.7 s).
LOAD_PAGE = 1_024
REMOVE_BATCH = 2_000  # chunks deleted per transaction when a KB is removed (~80 ms each)
PROGRESS_INTERVAL = 0.2  # seconds between two progress callbacks of one phase


def kb_name(name: object) -> str:
    """A valid KB name (stripped); BadRequest otherwise."""
    if not isinstance(name, str) or not name.strip():
        raise BadRequest("kb must be the knowledge base's name, a non-empty string")
    name = name.strip()
    if len(name) > KB_NAME_MAX:
        raise BadRequest(f"a knowledge base's name has at most {KB_NAME_MAX} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise BadRequest("a knowledge base's name cannot contain control characters")
    return name


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


@dataclass(frozen=True)
class KbSettings:
    """The two settings knowledge bases read: the embedding model ("" = keywords only) and
    how many passages a turn gets."""

    embedding_model: str = ""
    top_k: int = 3


class KnowledgeBases:
    """Knowledge bases: add, list, remove, link, search, inject, and the kb_search tool."""

    def __init__(self, history: AsyncHistory, embedder: Embedder, settings: KbSettings) -> None:
        self.settings = settings
        self.history = history
        self.embedder = BatchEmbedder(embedder, settings.embedding_model) if settings.embedding_model else None
        self.query_timeout = QUERY_TIMEOUT  # the most a search waits for its query's vector
        self._dim_changes = 0  # times the model's dimension changed (every vector dropped)
        self._index: VectorIndex | None = None  # None until loaded, or while no vector exists
        self._index_loaded = False
        self._index_task: asyncio.Task[None] | None = None
        self._index_lock = asyncio.Lock()
        self._kb_locks: dict[str, asyncio.Lock] = {}

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Load the vector index now rather than at the first search (optional, ~0.5 s per 100k)."""
        if self.embedder is not None:
            await self._ready_index()

    async def close(self) -> None:
        """Stop a vector index load still running."""
        task = self._index_task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # -- the vector index ---------------------------------------------------------------

    async def _ready_index(self) -> None:
        """Make sure the index is loaded (one load, shared by every caller)."""
        if self._index_loaded:
            return
        if self._index_task is None or self._index_task.done():
            self._index_task = asyncio.create_task(self._load_index(), name="kb-index-load")
            self._index_task.add_done_callback(_log_load_failure)
        await asyncio.shield(self._index_task)

    async def _load_index(self) -> None:
        assert self.embedder is not None
        model = self.embedder.model
        started = time.monotonic()
        async with self._index_lock:
            if self._index_loaded:
                return
            dims = await self.history.run(lambda s: s.kb.vector_dims(model))
            if not dims:
                self._index, self._index_loaded = None, True
                return
            dim = max(dims, key=lambda d: dims[d])  # others are stale: dropped at the next add
            index = VectorIndex(dim, capacity=dims[dim])
            after = 0
            while True:
                rows = await self.history.run(partial(_vectors_page, model, dim, after))
                if not rows:
                    break
                after = rows[-1][0]
                good = [(chunk_id, blob) for chunk_id, blob in rows if len(blob) == dim * 4]
                if good:
                    matrix = vectors_from_blobs([blob for _, blob in good], dim)
                    index.add([chunk_id for chunk_id, _ in good], matrix, replace=False)
            self._index, self._index_loaded = index, True
        logger.info("kb: %d vectors of %s (%d dimensions) loaded in %.2f s",
                    len(index), model, dim, time.monotonic() - started)

    async def _store_vectors(self, ids: Sequence[int], vectors: Sequence[Vector | None]) -> int:
        """Store and index the vectors computed for these chunks; how many were stored."""
        assert self.embedder is not None
        model = self.embedder.model
        pairs = [(chunk_id, v) for chunk_id, v in zip(ids, vectors) if v is not None]
        if not pairs:
            return 0
        dim = int(pairs[-1][1].shape[0])
        pairs = [(chunk_id, v) for chunk_id, v in pairs if v.shape[0] == dim]
        await self._ready_index()
        async with self._index_lock:
            if self._index is None or self._index.dim != dim:
                if self._index is not None:
                    logger.warning("kb: %s now returns %d dimensions instead of %d; every chunk is embedded again",
                                   model, dim, self._index.dim)
                    await self.history.run(lambda s: s.kb.drop_other_dims(model, dim))
                    self._dim_changes += 1
                self._index = VectorIndex(dim)
            blobs = [(chunk_id, vector_blob(v)) for chunk_id, v in pairs]
            stored = set(await self.history.run(lambda s: s.kb.put_vectors(model, dim, blobs)))
            kept = [(chunk_id, v) for chunk_id, v in pairs if chunk_id in stored]
            if kept:
                self._index.add([chunk_id for chunk_id, _ in kept], np.stack([v for _, v in kept]))
        return len(kept)

    # -- knowledge bases ----------------------------------------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        return self._kb_locks.setdefault(name, asyncio.Lock())

    async def _info(self, kb: KnowledgeBase) -> KbInfo:
        if self.embedder is None:
            return KbInfo.from_record(kb)
        model = self.embedder.model
        embedded = await self.history.run(lambda s: s.kb.count_vectors(model, kb.id))
        return KbInfo.from_record(kb, embedded)

    async def list(self) -> builtins.list[KbInfo]:
        """Every KB, by name, with its counts and links."""
        kbs = await self.history.run(lambda s: s.kb.all())
        return [await self._info(kb) for kb in kbs]

    async def get(self, kb: str) -> KbInfo:
        """One KB; NotFound if there is none of that name."""
        name = kb_name(kb)
        found = await self.history.run(lambda s: s.kb.get(name))
        if found is None:
            raise NotFound(f"there is no knowledge base {name!r}; kb_list shows the ones there are")
        return await self._info(found)

    async def documents(self, kb: str) -> builtins.list[KbDocument]:
        """The documents of a KB, by path; NotFound if there is no such KB."""
        info = await self.history.run(lambda s: s.kb.get(kb_name(kb)))
        if info is None:
            raise NotFound(f"there is no knowledge base {kb!r}; kb_list shows the ones there are")
        return await self.history.run(lambda s: s.kb.documents(info.id))

    async def remove(self, kb: str) -> KbInfo:
        """Delete a KB and everything in it (its files are untouched); what it held.

        The chunks go ``REMOVE_BATCH`` at a time (history/kb.py ``delete_chunks``), so
        turns keep using the history thread while a big KB is removed.
        """
        name = kb_name(kb)
        async with self._lock(name):
            found = await self.history.run(lambda s: s.kb.get(name))
            if found is None:
                raise NotFound(f"there is no knowledge base {name!r}; kb_list shows the ones there are")
            async with self._index_lock:
                if self._index is not None:
                    self._index.remove_range(*kb_chunk_range(found.id))
                while await self.history.run(lambda s: s.kb.delete_chunks(found.id, REMOVE_BATCH)):
                    pass
                removed = await self.history.run(lambda s: s.kb.remove(name))
        # the lock stays (a few bytes): an add waiting on it must not run beside a new one
        return KbInfo.from_record(removed or found)

    async def link(self, kb: str, conversation: int | None, linked: bool = True) -> KbInfo:
        """Link a KB to one conversation, or to every conversation when ``conversation`` is None.

        ``linked=False`` undoes that link. A KB linked to every conversation stays
        visible in a conversation unlinked on its own (set its ``kb_injection`` to
        ``off`` to keep KBs out of it).
        """
        name = kb_name(kb)
        try:
            updated = await self.history.run(lambda s: s.kb.set_link(name, conversation, linked))
        except LookupError:
            raise NotFound(f"conversation {conversation} does not exist") from None
        if updated is None:
            raise NotFound(f"there is no knowledge base {name!r}; kb_add creates one")
        return await self._info(updated)

    async def linked(self, conversation: int) -> builtins.list[KbInfo]:
        """The KBs a conversation sees (none for a deleted one)."""
        kbs = await self.history.run(lambda s: s.kb.linked(conversation))
        return [KbInfo.from_record(kb) for kb in kbs]

    async def has_linked(self, conversation: int) -> bool:
        """Whether any KB is linked to the conversation (cheap: for the per-turn checks)."""
        return bool(await self.history.run(lambda s: s.kb.linked_ids(conversation)))

    # -- ingest ---------------------------------------------------------------------------

    async def add(self, kb: str, paths: Sequence[str], progress: ProgressCallback | None = None) -> AddResult:
        """Add files and folders to a KB (created if new): extract, chunk, index, embed.

        A bad path or unreadable file is reported in the result, never raised; files
        already indexed with the same content cost nothing. When the embedder fails the
        chunks are kept (found by keywords) and embedded by a later add.
        """
        name = kb_name(kb)
        if isinstance(paths, str) or not isinstance(paths, Sequence):
            raise BadRequest("paths must be a list of absolute paths of files or folders")
        async with self._lock(name):
            record, _ = await self.history.run(lambda s: s.kb.ensure(name))
            result = AddResult(kb=name)
            found = await in_ingest_thread(collect, list(paths))
            result.errors += found.errors
            result.skipped += found.skipped
            report = _Throttle(progress)
            await self._read_all(record.id, found, result, report)
            if self.embedder is not None:
                await self._embed_kb(record.id, result, report)
            final = await self.history.run(lambda s: s.kb.get(name))
            assert final is not None
            result.documents, result.chunks = final.documents, final.chunks
            if self.embedder is not None:
                model = self.embedder.model
                result.pending = await self.history.run(lambda s: s.kb.count_pending(model, record.id))
        logger.info("kb %s: %d added, %d updated, %d unchanged, %d removed, %d errors; %d chunks embedded",
                    name, result.added, result.updated, result.unchanged, result.removed, len(result.errors),
                    result.embedded)
        return result

    async def _read_all(self, kb_id: int, found: Collected, result: AddResult, report: _Throttle) -> None:
        known = {doc.path: doc for doc in await self.history.run(lambda s: s.kb.documents(kb_id))}
        total = len(found.files)
        done = 0
        report(KbProgress(0, total, "reading", "reading files"))
        queue = iter(found.files)

        async def worker() -> None:
            # a few workers take the files in turn: not one task per file of a big folder
            nonlocal done
            for file in queue:
                try:
                    await self._read_one(kb_id, file, known.get(file.path), result)
                except Exception as exc:  # a store failure for one file must not stop the rest
                    logger.exception("kb: indexing %s failed", file.path)
                    reason = f"could not be indexed ({type(exc).__name__}); see the daemon's log"
                    result.errors.append(FileNote(file.path, reason))
                done += 1
                report(KbProgress(done, total, "reading", os.path.basename(file.path)))

        async with asyncio.TaskGroup() as group:
            for _ in range(min(INGEST_CONCURRENCY, total)):
                group.create_task(worker())
        await self._remove_vanished(kb_id, found, known, result)

    async def _read_one(self, kb_id: int, file: Found, known: KbDocument | None, result: AddResult) -> None:
        """Index one file, or note why not; a file the user can fix is noted, not raised."""
        try:
            staged = await in_ingest_thread(stage, file)
            if staged.kind == "image":
                result.skipped.append(FileNote(file.path, "an image: knowledge bases index text and PDF only"))
                return
            if known is not None and (known.size_bytes, known.mtime_ns) == (staged.size, staged.mtime_ns):
                result.unchanged += 1
                return
            sha256 = await in_ingest_thread(file_hash, file.path, staged.size)
            if known is not None and known.sha256 == sha256:
                result.unchanged += 1
                await self.history.run(lambda s: s.kb.set_mtime(known.id, staged.mtime_ns))
                return
            document = await read_document(staged, sha256)
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
                await self._remove_documents(kb_id, [staged.path])
                result.removed += 1
            return
        async with self._index_lock:
            _, ids, replaced = await self.history.run(lambda s: s.kb.put_document(kb_id, document))
            if self._index is not None and replaced:
                self._index.remove(replaced)
        if known is None:
            result.added += 1
        else:
            result.updated += 1
        result.new_chunks += len(ids)
        if document.truncated:
            result.truncated.append(staged.path)

    async def _remove_documents(self, kb_id: int, paths: Sequence[str]) -> None:
        async with self._index_lock:
            removed = await self.history.run(lambda s: s.kb.remove_documents(kb_id, paths))
            if self._index is not None and removed:
                self._index.remove(removed)

    async def _remove_vanished(
        self, kb_id: int, found: Collected, known: dict[str, KbDocument], result: AddResult
    ) -> None:
        """Documents under a folder added again whose files are gone are removed."""
        seen = {file.path for file in found.files}
        prefixes = tuple(folder.rstrip("/") + "/" for folder in found.folders)
        candidates = [path for path in known if path not in seen and path.startswith(prefixes)] if prefixes else []
        gone = await in_ingest_thread(_missing, candidates)
        if gone:
            await self._remove_documents(kb_id, gone)
            result.removed += len(gone)

    async def _embed_kb(self, kb_id: int, result: AddResult, report: _Throttle) -> None:
        """Embed every chunk of the KB without a vector, in batches; a failure is noted, not raised."""
        assert self.embedder is not None
        embedder = self.embedder
        model = embedder.model
        total = await self.history.run(lambda s: s.kb.count_pending(model, kb_id))
        if not total:
            return
        report(KbProgress(0, total, "embedding", f"embedding {total} chunks"))
        after = 0
        done = 0
        changes = self._dim_changes
        while True:
            batch = await self.history.run(partial(_pending_page, model, kb_id, after))
            if not batch and changes != self._dim_changes:
                # the model's dimension changed under way: the chunks before the cursor lost
                # their vectors too, so go round once more from the start
                changes, after = self._dim_changes, 0
                continue
            if not batch:
                break
            after = batch[-1][0]
            try:
                vectors = await embedder.documents([text for _, text in batch])
            except EmbedderFailed as exc:
                result.embedding_error = (
                    f"{exc.message}; the chunks are searchable by keywords and will be embedded on the next add"
                )
                logger.warning("kb: embedding stopped: %s", exc.message)
                return
            result.embedded += await self._store_vectors([chunk_id for chunk_id, _ in batch], vectors)
            done += len(batch)
            report(KbProgress(min(done, total), total, "embedding", f"embedded {done} of {total} chunks"))

    async def embed_pending(self, kb: str | None = None, progress: ProgressCallback | None = None) -> AddResult:
        """Embed the chunks an earlier add could not (all KBs, or one); the counts in an AddResult."""
        names = [kb_name(kb)] if kb is not None else [info.name for info in await self.list()]
        total = AddResult(kb=kb or "")
        if self.embedder is None:
            return total
        for name in names:
            async with self._lock(name):
                record = await self.history.run(partial(_kb_named, name))
                if record is None:
                    raise NotFound(f"there is no knowledge base {name!r}; kb_list shows the ones there are")
                await self._embed_kb(record.id, total, _Throttle(progress))
                model = self.embedder.model
                total.pending += await self.history.run(partial(_count_pending, model, record.id))
            if total.embedding_error:
                break
        return total

    # -- search ---------------------------------------------------------------------------

    async def search(
        self,
        query: str,
        *,
        conversation: int | None = None,
        kbs: Sequence[str] | None = None,
        limit: int | None = None,
    ) -> SearchResult:
        """Hybrid search of the KBs linked to ``conversation``, or of the KBs named, or of all."""
        if conversation is not None:
            kb_ids: builtins.list[int] | None = await self.history.run(lambda s: s.kb.linked_ids(conversation))
        elif kbs is not None:
            kb_ids = []
            for name in kbs:
                record = await self.history.run(partial(_kb_named, kb_name(name)))
                if record is None:
                    raise NotFound(f"there is no knowledge base {name!r}; kb_list shows the ones there are")
                kb_ids.append(record.id)
        else:
            kb_ids = None
        wanted = DEFAULT_SEARCH_LIMIT if limit is None else max(1, min(MAX_SEARCH_LIMIT, limit))
        if kb_ids == []:
            return SearchResult([], "bm25", "no knowledge base is linked")
        return await self._search(query, kb_ids, wanted)

    async def _search(self, query: str, kb_ids: builtins.list[int] | None, limit: int) -> SearchResult:
        terms = query_terms(query)
        phrases = fts_phrases(terms)
        keywords, (nearest, vector, note) = await asyncio.gather(
            self.history.run(lambda s: s.kb.search(phrases, kb_ids, CANDIDATES)),
            self._nearest(query, kb_ids),
        )
        found = {chunk_id for chunk_id, _ in keywords}
        similar = [chunk_id for chunk_id, cosine in nearest if cosine >= MIN_VECTOR_SIMILARITY or chunk_id in found]
        ranked = reciprocal_rank_fusion([chunk_id for chunk_id, _ in keywords], similar)
        chosen = ranked[:limit]
        cosines = dict(nearest)
        # the chunks bm25 alone found get their cosine from their stored vector, read in
        # the same trip to the history thread as the chunks themselves
        unscored = [chunk_id for chunk_id in chosen if chunk_id not in cosines] if vector is not None else []
        if chosen:
            model = self.embedder.model if self.embedder is not None else ""
            chunks, blobs = await self.history.run(partial(_chunks_and_vectors, model, chosen, unscored))
        else:
            chunks, blobs = [], []
        if vector is not None and blobs:
            cosines.update(exact_cosines(vector, blobs))
        hits = [
            Hit.from_chunk(chunk, cosines[chunk.id], "cosine") if chunk.id in cosines
            else Hit.from_chunk(chunk, keyword_share(terms, chunk.text), "keywords")
            for chunk in chunks
        ]
        return SearchResult(hits, "hybrid" if vector is not None else "bm25", note)

    async def _nearest(
        self, query: str, kb_ids: builtins.list[int] | None
    ) -> tuple[builtins.list[tuple[int, float]], Vector | None, str | None]:
        """The vector candidates, the query's vector, and why there are none; bounded, never raises."""
        if self.embedder is None or not query.strip():
            return [], None, None
        embedding = asyncio.create_task(self.embedder.query(query, self.query_timeout))
        try:
            async with asyncio.timeout(self.query_timeout):
                await self._ready_index()
        except TimeoutError:
            embedding.cancel()
            await asyncio.gather(embedding, return_exceptions=True)
            return [], None, "the vector index is still loading; keyword search only"
        except Exception as exc:
            embedding.cancel()
            await asyncio.gather(embedding, return_exceptions=True)
            return [], None, f"the vector index could not be loaded ({type(exc).__name__}); keyword search only"
        vector, note = await embedding
        index = self._index
        if vector is None or index is None:
            return [], vector, note
        if index.dim != vector.shape[0]:
            return [], None, (
                f"the embedding model now gives {vector.shape[0]} dimensions, the index holds {index.dim}; "
                "keyword search only until the knowledge bases are added again"
            )
        nearest = await self._nearest_vectors(index, vector, kb_ids)
        return nearest, vector, note

    async def _nearest_vectors(
        self, index: VectorIndex, vector: Vector, kb_ids: builtins.list[int] | None
    ) -> builtins.list[tuple[int, float]]:
        """The ``CANDIDATES`` chunks nearest ``vector``, (id, exact cosine) best first.

        The index shortlists by approximate cosine (in a worker thread: numpy releases
        the GIL); the shortlist's float32 vectors are read back from the store and
        re-scored exactly (vectors.py).
        """
        assert self.embedder is not None
        model = self.embedder.model
        shortlist = await asyncio.to_thread(index.shortlist, vector, shortlist_size(CANDIDATES), kb_ids)
        if not shortlist:
            return []
        ids = [chunk_id for chunk_id, _ in shortlist]
        blobs = await self.history.run(lambda s: s.kb.vectors_of(model, ids))
        return exact_cosines(vector, blobs)[:CANDIDATES]

    # -- auto-injection -----------------------------------------------------------------

    async def context_block(
        self,
        conversation: int,
        query: str,
        mode: InjectionMode | str | None,
        ctx_used_estimate: int,
        ctx_max: int,
        kb_ids: Sequence[int] | None = None,
    ) -> Injection:
        """The knowledge-base block for this turn's question, or why there is none.

        ``kb_ids`` are the KBs the conversation sees when the caller has read them already.
        Never raises (but CancelledError): a failure is logged and nothing injected.
        """
        try:
            return await self._context_block(
                conversation, query, injection_mode(mode), ctx_used_estimate, ctx_max, kb_ids
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("kb: auto-injection failed for conversation %d", conversation)
            return Injection(None, note=f"knowledge-base search failed ({type(exc).__name__})")

    async def _context_block(
        self, conversation: int, query: str, mode: InjectionMode, ctx_used: int, ctx_max: int,
        known_ids: Sequence[int] | None,
    ) -> Injection:
        top_k = self.settings.top_k
        if mode not in INJECTING_MODES or top_k <= 0 or not query.strip():
            return Injection(None)
        kb_ids = list(known_ids) if known_ids is not None else await self.history.run(
            lambda s: s.kb.linked_ids(conversation)
        )
        if not kb_ids:
            return Injection(None)
        if ctx_max > 0 and ctx_used >= CONTEXT_LIMIT * ctx_max:
            return self._skipped(conversation, Injection(None, skipped_reason=too_full(ctx_used, ctx_max)))
        found = await self._search(query, kb_ids, top_k)
        if not found.hits:
            return Injection(None, search=found.mode, note=found.note)
        injection = fit_block(found.hits, ctx_used, ctx_max)
        injection.search, injection.note = found.mode, found.note
        return self._skipped(conversation, injection) if injection.skipped_reason else injection

    @staticmethod
    def _skipped(conversation: int, injection: Injection) -> Injection:
        logger.info("kb: conversation %d: %s", conversation, injection.skipped_reason)
        return injection

    # -- the tool -------------------------------------------------------------------------

    def tool(self) -> KbSearch:
        """The ``kb_search`` tool over these knowledge bases, for the daemon's Toolbox."""
        return KbSearch(self)


# Store calls made in loops: module functions bound with partial, so each call carries
# its own arguments rather than a closure over the loop's variables.
def _vectors_page(model: str, dim: int, after: int, store: HistoryStore) -> list[tuple[int, bytes]]:
    return store.kb.vectors(model, dim, after, LOAD_PAGE)


def _chunks_and_vectors(
    model: str, ids: Sequence[int], vector_ids: Sequence[int], store: HistoryStore
) -> tuple[list[KbChunk], list[tuple[int, bytes]]]:
    return store.kb.chunks(ids), store.kb.vectors_of(model, vector_ids)


def _pending_page(model: str, kb_id: int, after: int, store: HistoryStore) -> list[tuple[int, str]]:
    return store.kb.pending_chunks(model, kb_id, after, BATCH_SIZE)


def _kb_named(name: str, store: HistoryStore) -> KnowledgeBase | None:
    return store.kb.get(name)


def _count_pending(model: str, kb_id: int, store: HistoryStore) -> int:
    return store.kb.count_pending(model, kb_id)


def _missing(paths: Sequence[str]) -> list[str]:
    return [path for path in paths if not os.path.lexists(path)]


def _log_load_failure(task: asyncio.Task[None]) -> None:
    # Retrieved here so a load nobody awaits any more (the turn timed out) is still logged.
    if not task.cancelled() and task.exception() is not None:
        logger.error("kb: loading the vector index failed", exc_info=task.exception())

