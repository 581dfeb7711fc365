"""``KnowledgeBases``: the one object the daemon holds for everything KB.

A facade over three parts it composes: the vector index kept in step with the store
(index.py ``KbIndex``), the add pipeline (pipeline.py ``Ingest``: collect, read, store,
embed, progress) and the embedder (embedder.py). It answers the KB questions itself
(list, get, documents, remove, link), and does the hybrid search (search.py: bm25 and
vectors fused) and the auto-injection (injection.py) over them; ``tool`` gives the
``kb_search`` tool (tool.py).

Nothing here fails a turn: ``context_block`` logs any failure and injects nothing, and
search falls back to bm25 when the embedder is missing, failing or slow, or while the
vector index is still loading.

numpy stays off the import path (index.py's docstring says why): the ``Vector`` type is
imported for annotations only, and the vector work happens in index.py.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from attachments import Ocr
from core.errors import ADD_KB, BadRequest, no_conversation, no_kb
from core.seams import Embedder
from history import AsyncHistory, KbDocument, KnowledgeBase, KnowledgeStore

from .embedder import QUERY_TIMEOUT, BatchEmbedder
from .index import KbIndex
from .injection import (
    CONTEXT_LIMIT,
    INJECTING_MODES,
    Injection,
    InjectionMode,
    fit_block,
    injection_mode,
    too_full,
)
from .pipeline import Ingest
from .recallvec import RecallVectors
from .records import AddResult, KbInfo, ProgressCallback
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

if TYPE_CHECKING:  # numpy's array type: annotations only (index.py's docstring)
    from .embedder import Vector

__all__ = ["DEFAULT_SEARCH_LIMIT", "KB_NAME_MAX", "KbSettings", "KnowledgeBases", "kb_name"]

logger = logging.getLogger(__name__)

KB_NAME_MAX = 100  # characters in a KB's name
DEFAULT_SEARCH_LIMIT = 5  # hits of a search that names no limit
MAX_SEARCH_LIMIT = 50
# The KBs a search covers: these ids, or a read of them from the history
Scope = builtins.list[int] | Callable[[], Awaitable[builtins.list[int]]]


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


@dataclass(frozen=True)
class KbSettings:
    """The two settings knowledge bases read: the embedding model ("" = keywords only) and
    how many passages a turn gets."""

    embedding_model: str = ""
    top_k: int = 3


class KnowledgeBases:
    """Knowledge bases: add, list, remove, link, search, inject, and the kb_search tool."""

    def __init__(self, history: AsyncHistory, embedder: Embedder, settings: KbSettings, ocr: Ocr | None = None) -> None:
        """``ocr``: the daemon's (``FileReaders.ocr``); None, one of its own without a cache."""
        self.settings = settings
        self.history = history
        model = settings.embedding_model
        self.embedder = BatchEmbedder(embedder, model) if model else None
        self.query_timeout = QUERY_TIMEOUT  # the most a search waits for its query's vector
        self.index = KbIndex(history, model)  # never loaded without an embedder
        self.ingest = Ingest(history, self.index, self.embedder, ocr if ocr is not None else Ocr())
        self.recall = RecallVectors(history, self.embedder)  # recall injection's vectors, same embedder

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Finish a KB removal a stop cut short, then load the vector index now rather than make
        the first search wait for it; after start-up."""
        self.recall.catch_up()  # what has no vector yet, in the background
        await self.index.finish_removals()
        if self.embedder is not None:
            await self.index.ready()

    async def close(self) -> None:
        """Stop a vector index load still running, and recall's embedding."""
        await self.recall.close()
        await self.index.close()

    # -- knowledge bases ----------------------------------------------------------------

    async def _info(self, kb: KnowledgeBase) -> KbInfo:
        if self.embedder is None:
            return KbInfo.from_record(kb)
        model, dim = self.embedder.model, self.embedder.dim
        embedded = await self.history.kb.run(KnowledgeStore.count_vectors, model, dim, kb.id)
        return KbInfo.from_record(kb, embedded)

    async def list(self) -> builtins.list[KbInfo]:
        """Every KB, by name, with its counts and links."""
        kbs = await self.history.kb.run(KnowledgeStore.all)
        return [await self._info(kb) for kb in kbs]

    async def get(self, kb: str) -> KbInfo:
        """One KB; NotFound if there is none of that name."""
        name = kb_name(kb)
        found = await self.history.kb.run(KnowledgeStore.get, name)
        if found is None:
            raise no_kb(name)
        return await self._info(found)

    async def documents(self, kb: str) -> builtins.list[KbDocument]:
        """The documents of a KB, by path; NotFound if there is no such KB."""
        info = await self.history.kb.run(KnowledgeStore.get, kb_name(kb))
        if info is None:
            raise no_kb(kb)
        return await self.history.kb.run(KnowledgeStore.documents, info.id)

    async def remove(self, kb: str) -> KbInfo:
        """Delete a KB and everything in it (its files are untouched); what it held.

        Not while an add to it runs (its lock); the chunks go in batches (index.py
        ``remove_kb``), so turns keep using the history thread meanwhile.
        """
        name = kb_name(kb)
        async with self.ingest.lock(name):
            found = await self.history.kb.run(KnowledgeStore.get, name)
            if found is None:
                raise no_kb(name)
            removed = await self.index.remove_kb(found)
        return KbInfo.from_record(removed or found)

    async def link(self, kb: str, conversation: int | None, linked: bool = True) -> KbInfo:
        """Link a KB to one conversation, or to every conversation when ``conversation`` is None.

        ``linked=False`` undoes that link. A KB linked to every conversation stays
        visible in a conversation unlinked on its own (set its ``kb_injection`` to
        ``off`` to keep KBs out of it).
        """
        name = kb_name(kb)
        try:
            updated = await self.history.kb.run(KnowledgeStore.set_link, name, conversation, linked)
        except LookupError:
            raise no_conversation(conversation) from None
        if updated is None:
            raise no_kb(name, ADD_KB)
        return await self._info(updated)

    async def linked(self, conversation: int) -> builtins.list[KbInfo]:
        """The KBs a conversation sees (none for a deleted one)."""
        kbs = await self.history.kb.run(KnowledgeStore.linked, conversation)
        return [KbInfo.from_record(kb) for kb in kbs]

    async def has_linked(self, conversation: int) -> bool:
        """Whether any KB is linked to the conversation (cheap: for the per-turn checks)."""
        return bool(await self.history.kb.run(KnowledgeStore.linked_ids, conversation))

    # -- ingest ---------------------------------------------------------------------------

    async def add(self, kb: str, paths: Sequence[str], progress: ProgressCallback | None = None,
                  sent: float | None = None) -> AddResult:
        """Add files and folders to a KB (created if new): extract, chunk, index, embed.

        A bad path or unreadable file is reported in the result, never raised; files
        already indexed with the same content cost nothing. When the embedder fails the
        chunks are kept (found by keywords) and embedded by a later add. ``sent``: see
        ``Ingest.add``.
        """
        name = kb_name(kb)
        if isinstance(paths, str) or not isinstance(paths, Sequence):
            raise BadRequest("paths must be a list of absolute paths of files or folders")
        return await self.ingest.add(name, paths, progress, sent)

    def adding(self, kb: str) -> bool:
        """Whether an add to ``kb`` (or its removal) holds the KB now, from any connection."""
        try:
            return self.ingest.lock(kb_name(kb)).locked()
        except BadRequest:
            return False

    def cancel(self, kb: str, sent: float | None = None) -> bool:
        """Stop the adds to ``kb`` (each keeps the files it stored whole), and those sent before
        ``sent`` (see ``Ingest.cancel``); False when none runs."""
        return self.ingest.cancel(kb_name(kb), sent)

    async def embed_pending(self, kb: str | None = None, progress: ProgressCallback | None = None) -> AddResult:
        """Embed the chunks an earlier add could not (all KBs, or one); the counts in an AddResult."""
        names = [kb_name(kb)] if kb is not None else [info.name for info in await self.list()]
        total = AddResult(kb=kb or "")
        if self.embedder is None:
            return total
        for name in names:
            await self.ingest.embed_pending(name, total, progress)
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
        # (not a KB being removed: its chunks are still there)
        scope: Scope = partial(self.history.kb.run, KnowledgeStore.ids)
        if conversation is not None:
            scope = partial(self.history.kb.run, KnowledgeStore.linked_ids, conversation)
        elif kbs is not None:
            scope = partial(self._named_ids, [kb_name(name) for name in kbs])
        wanted = DEFAULT_SEARCH_LIMIT if limit is None else max(1, min(MAX_SEARCH_LIMIT, limit))
        return await self._search(query, scope, wanted)

    async def _named_ids(self, names: Sequence[str]) -> builtins.list[int]:
        """The ids of the KBs named, in order; NotFound for the first that does not exist."""
        ids = await self.history.kb.run(KnowledgeStore.ids_named, names)
        missing = next((name for name in names if name not in ids), None)
        if missing is not None:
            raise no_kb(missing)
        return [ids[name] for name in names]

    def _embedding(self, query: str) -> asyncio.Task[tuple[Vector | None, str | None]] | None:
        """The query's embedding, under way; None without an embedder or words."""
        if self.embedder is None or not query.strip():
            return None
        return asyncio.create_task(self.embedder.query(query, self.query_timeout))

    async def _search(self, query: str, scope: Scope, limit: int) -> SearchResult:
        """Hybrid search of the KBs in ``scope``.

        The query's vector is asked for first; the KBs in scope are read while it comes,
        then their bm25 candidates on the history thread while the vector is scanned as
        soon as it is there (docs/DESIGN.md).
        """
        terms = query_terms(query)
        phrases = fts_phrases(terms)
        embedding = self._embedding(query)  # the query's vector needs no KB: asked for at once
        try:
            kb_ids = await scope() if callable(scope) else scope
        except BaseException:
            await _dropped(embedding)
            raise
        if kb_ids == []:
            await _dropped(embedding)
            return SearchResult([], "bm25", "no knowledge base is linked")
        bm25 = asyncio.ensure_future(self.history.kb.run(KnowledgeStore.search, phrases, kb_ids, CANDIDATES))
        try:
            nearest, vector, note = await self._nearest(kb_ids, embedding)
            keywords = await bm25
        except BaseException:  # cancelled: neither the keywords nor the vector are wanted
            await _dropped(bm25)
            await _dropped(embedding)
            raise
        found = {chunk_id for chunk_id, _ in keywords}
        similar = [chunk_id for chunk_id, cosine in nearest if cosine >= MIN_VECTOR_SIMILARITY or chunk_id in found]
        ranked = reciprocal_rank_fusion([chunk_id for chunk_id, _ in keywords], similar)
        chosen = ranked[:limit]
        # the hits shown get the exact cosine of their stored vector (the index's is within
        # ~1e-4), those bm25 alone found included, read in the same trip as their text
        if chosen:
            model = self.embedder.model if self.embedder is not None else ""
            scored = chosen if vector is not None else []
            chunks, blobs = await self.history.kb.run(KnowledgeStore.chunks_and_vectors, model, chosen, scored)
        else:
            chunks, blobs = [], []
        cosines = dict(self.index.rescored(vector, blobs)) if vector is not None and blobs else {}
        hits = [
            Hit.from_chunk(chunk, cosines[chunk.id], "cosine") if chunk.id in cosines
            else Hit.from_chunk(chunk, keyword_share(terms, chunk.text), "keywords")
            for chunk in chunks
        ]
        return SearchResult(hits, "hybrid" if vector is not None else "bm25", note)

    async def _nearest(
        self, kb_ids: builtins.list[int] | None, embedding: asyncio.Task[tuple[Vector | None, str | None]] | None
    ) -> tuple[builtins.list[tuple[int, float]], Vector | None, str | None]:
        """The vector candidates, the query's vector (``embedding``, under way), and why there
        are none; bounded, never raises."""
        if embedding is None:
            return [], None, None
        try:
            async with asyncio.timeout(self.query_timeout):
                await self.index.ready()
        except TimeoutError:
            await _dropped(embedding)
            return [], None, "the vector index is still loading; keyword search only"
        except Exception as exc:
            await _dropped(embedding)
            return [], None, f"the vector index could not be loaded ({type(exc).__name__}); keyword search only"
        vector, note = await embedding
        if vector is None:
            return [], None, note
        dim = int(vector.shape[0])
        index = self.index.of(dim)
        # passages embedded by a model since swapped for one of another size (kb_add embeds them again)
        stale = self.index.elsewhere(dim, kb_ids)
        if stale:
            old = max(stale, key=lambda d: stale[d])
            note = (f"{sum(stale.values())} passages have vectors of {old} dimensions and the embedding model "
                    f"now gives {dim}: they are found by keywords until kb_add embeds their knowledge bases again")
        if index is None or (stale and not index.count_in(kb_ids)):
            return [], None if stale else vector, note
        nearest = await self.index.nearest(index, vector, kb_ids)
        return nearest, vector, note

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
        if known_ids is not None:
            kb_ids = list(known_ids)
        else:
            kb_ids = await self.history.kb.run(KnowledgeStore.linked_ids, conversation)
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


async def _dropped(task: asyncio.Task[Any] | None) -> None:
    """Cancel a task whose result is no longer wanted, and wait for it to end."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

