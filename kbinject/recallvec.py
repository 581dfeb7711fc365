"""Vectors for recall injection, when an embedding model is configured (issue 49 item 1).

What the per-turn recall searches by keywords (archive.py, elsewhere.py: the messages of
turns, the chunks of attachments, the saved memories) gets int8 vectors too, with the
knowledge bases' machinery: their embedder (embedder.py, the same model, its query cache),
their in-memory index (vectors.py ``VectorIndex``), their rank fusion (search.py).

- Embedding is off the turn's path: a turn stored, or a file chunked, queues its
  conversation (``note``); one background task embeds what is pending, ``BATCH_SIZE``
  texts a request. The queue is bounded (past ``MAX_QUEUED`` conversations it falls back to
  a catch-up of all); an embedder that fails stops the task, and the next ``note`` after
  ``RETRY_AFTER`` seconds starts it again with a catch-up of everything (so does the start
  of the daemon). A turn never waits for any of it.
- At a turn the question (with the recent turns' keywords when it refers back, as the
  keyword search takes them) is embedded once, within the KB search's bound
  (``QUERY_TIMEOUT``), from the embedder's cache when the KB search embedded the same text.
  No vector in time: keywords alone.
- ``near`` looks up the nearest vectors of the conversation's archive, of the other
  conversations and of the memories, and reads each hit again from the store (still
  there, its text still the one embedded, its conversation readable).
- The floor's vector counterpart (``VectorFloor``): a passage the keywords' floor drops
  passes when its cosine reaches ``MIN_SIMILARITY`` and it holds one of the question's
  keywords that tells it apart (see ``VectorFloor``).

docs/DESIGN.md, "Recall injection" says why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from history import ArchiveHit, AsyncHistory, ElsewhereHit, Piece, RecallVectorStore

from .embedder import BATCH_SIZE, QUERY_TIMEOUT, RETRY_AFTER, BatchEmbedder, EmbedderFailed
from .terms import Terms, held

if TYPE_CHECKING:  # numpy stays off the start-up path (embedder.py's docstring)
    import numpy as np
    import numpy.typing as npt

    from .embedder import Vector
    from .vectors import KbIds, VectorIndex

__all__ = ["MEMORIES", "MIN_SIMILARITY", "NO_NEAR", "Fused", "Near", "RecallVectors", "VectorFloor"]

logger = logging.getLogger(__name__)

# A passage found by its vector alone must be at least this similar to the question (and
# hold one of its keywords): recall injects a stray passage into every turn it passes, so
# the bar is above the knowledge bases' 0.2 (search.py MIN_VECTOR_SIMILARITY)
MIN_SIMILARITY = 0.35
NEAREST = 40  # vectors looked up per source (own archive, other conversations), before the floor
NEAREST_MEMORIES = 10
# A keyword that this many of the keyword search's matches hold tells no passage apart: holding
# it admits none by its vector ("what is my hangar harp code?" beside forty "my ... code is")
TELLING_MAX = 5
MAX_QUEUED = 1_000  # conversations waiting to be embedded; past it, a catch-up of all
MEMORIES = 0  # the queue's entry (and the index's group) of the saved memories

H = TypeVar("H", ArchiveHit, ElsewhereHit)


@dataclass
class Near:
    """What the vectors found for a turn: the hits and their cosines, by source."""

    own: list[tuple[ArchiveHit, float]] = field(default_factory=list)
    others: list[tuple[ElsewhereHit, float]] = field(default_factory=list)
    memories: dict[int, float] = field(default_factory=dict)

    def fused_own(self, hits: list[ArchiveHit], floor: Terms) -> Fused[ArchiveHit]:
        """The keywords' ``hits`` and, after them, those only the vectors found; the vectors'
        ranking over them, each one's cosine by its place in the list, and the floor's
        vector counterpart (``floor``: the keywords' floor)."""
        return _fused(hits, self.own, floor)

    def fused_others(self, hits: list[ElsewhereHit], floor: Terms) -> Fused[ElsewhereHit]:
        """``fused_own`` for the other conversations' messages."""
        return _fused(hits, self.others, floor)


@dataclass(frozen=True)
class VectorFloor:
    """The floor's vector counterpart: a cosine of at least ``MIN_SIMILARITY``, and one of the
    question's keywords (the recent turns' when it has none) held, one that fewer than
    ``TELLING_MAX`` of the keyword search's matches hold (``words``). So "my bike is a 2019
    Brompton" comes for "what tyre size does my bike take?" (one keyword of four: under the
    keywords' floor), a passage that shares no word with the question never does (a model
    whose unrelated texts sit high), nor one that shares only a word most matches share."""

    words: list[str]

    @classmethod
    def of(cls, floor: Terms, matches: Sequence[str]) -> VectorFloor:
        words = [t for t in floor.question if not t.isdigit()] or floor.question or floor.recent
        return cls([w for w in words if sum(held([w], text) for text in matches) < TELLING_MAX])

    def passes(self, text: str, cosine: float | None) -> bool:
        return cosine is not None and cosine >= MIN_SIMILARITY and held(self.words, text) >= 1


@dataclass
class Fused(Generic[H]):
    """The keywords' hits and the vectors' together (``Near.fused_own``)."""

    hits: list[H]
    similar: list[int]  # the vectors' ranking, by place in ``hits``
    cosines: dict[int, float]  # by place in ``hits``
    floor: VectorFloor


def _identity(hit: ArchiveHit | ElsewhereHit) -> tuple[int | None, ...]:
    if isinstance(hit, ElsewhereHit):
        return hit.conversation, hit.turn, hit.n
    return hit.turn, hit.n, hit.attachment, hit.chunk


def _fused(hits: list[H], near: list[tuple[H, float]], floor: Terms) -> Fused[H]:
    vector_floor = VectorFloor.of(floor, [hit.text for hit in hits])
    if not near:
        return Fused(hits, [], {}, vector_floor)
    merged = list(hits)
    places = {_identity(hit): i for i, hit in enumerate(merged)}
    ranking: list[int] = []
    cosines: dict[int, float] = {}
    for hit, cosine in near:  # best first, each similar enough (``_similar``)
        place = places.get(_identity(hit))
        if place is None:
            place = places[_identity(hit)] = len(merged)
            merged.append(hit)
        ranking.append(place)
        cosines[place] = cosine
    return Fused(merged, ranking, cosines, vector_floor)


NO_NEAR = Near()


class RecallVectors:
    """Recall's vectors: the background embedding and the nearest lookups."""

    def __init__(self, history: AsyncHistory, embedder: BatchEmbedder | None) -> None:
        self.history = history
        self.embedder = embedder
        self.query_timeout = QUERY_TIMEOUT
        self._queue: dict[int, int | None] = {}  # conversations (and MEMORIES) to embed: the turn, or None (all)
        self._all = False  # a catch-up of every conversation is due
        self._task: asyncio.Task[None] | None = None
        self._retry_at = 0.0
        self._index: VectorIndex | None = None
        self._loading: asyncio.Task[VectorIndex | None] | None = None
        self._backlog: list[tuple[Piece, Vector]] = []  # embedded while the index loads: added after
        self._caught_up = asyncio.Event()  # the start's catch-up was asked for

    @property
    def enabled(self) -> bool:
        return self.embedder is not None

    # -- embedding, in the background -----------------------------------------------------

    def note(self, cid: int, turn: int | None = None) -> None:
        """Conversation ``cid`` has new text (turn ``turn`` stored; None: a file chunked, or
        anything): embed it soon."""
        if self.embedder is None:
            return
        if len(self._queue) >= MAX_QUEUED:
            self._all = True
        elif cid in self._queue and self._queue[cid] != turn:
            self._queue[cid] = None  # two turns noted before the first was embedded: all of it
        else:
            self._queue[cid] = turn
        self._queue.setdefault(MEMORIES, None)  # memories are few: looked at every time
        self._wake()

    def catch_up(self) -> None:
        """Embed whatever has no vector yet (at the start, and after the embedder failed)."""
        if self.embedder is not None:
            self._all = True
            self._caught_up.set()
            self._wake()

    def _wake(self) -> None:
        if (self._task is None or self._task.done()) and time.monotonic() >= self._retry_at:
            self._task = asyncio.create_task(self._run(), name="recall-vectors")

    async def settled(self) -> None:
        """Wait until the start's catch-up was asked for and nothing is being embedded (tests)."""
        if self.embedder is not None:
            await self._caught_up.wait()
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def close(self) -> None:
        """Stop the background work."""
        for task in (self._task, self._loading):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        try:
            while self._queue or self._all:
                if self._all:
                    self._all = False
                    for cid in await self.history.recall_vectors.run(RecallVectorStore.conversations):
                        self._queue[cid] = None
                    self._queue[MEMORIES] = None
                cid = next(iter(self._queue))
                await self._embed(cid, self._queue.pop(cid))
        except EmbedderFailed as exc:
            logger.warning("recall: embedding stopped (%s); it goes on after %g s", exc.message, RETRY_AFTER)
            self._retry_at = time.monotonic() + RETRY_AFTER
            self._queue.clear()
            self._all = True  # what was pending is caught up then
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("recall: embedding failed")

    async def _embed(self, cid: int, turn: int | None) -> None:
        """Embed what conversation ``cid`` (MEMORIES: the memories) has without a vector (of
        turn ``turn`` and those never embedded; None: all)."""
        assert self.embedder is not None
        model = self.embedder.model
        while True:
            pieces = await self.history.recall_vectors.run(RecallVectorStore.pending, cid, model, BATCH_SIZE, turn)
            if not pieces:
                return
            vectors = await self.embedder.documents([p.text for p in pieces])
            blobs = [b"" if v is None else _blob(v) for v in vectors]
            stored = await self.history.recall_vectors.run(RecallVectorStore.put, model, pieces, blobs)
            if len(stored) < len(pieces):
                return  # the conversation went meanwhile, or its texts changed: a later note sees to it
            self._indexed(pieces, vectors)

    def _indexed(self, pieces: Sequence[Piece], vectors: Sequence[Vector | None]) -> None:
        index = self._index
        kept = [(p, v) for p, v in zip(pieces, vectors) if v is not None]
        if index is None:  # not loaded: the load reads them from the store, or adds them after
            if self._loading is not None and not self._loading.done():
                self._backlog += kept
            return
        if not kept:
            return
        if any(int(v.shape[0]) != index.dim for _, v in kept):
            self._index, self._loading = None, None  # another model's size: load again
            return
        import numpy as np  # loaded already: vectors exist

        index.add([p.key for p, _ in kept], np.stack([v for _, v in kept]), groups=[p.group for p, _ in kept])

    # -- lookups, at a turn --------------------------------------------------------------

    async def query(self, text: str) -> Vector | None:
        """The question's vector within ``query_timeout``; None (keywords alone) otherwise."""
        if self.embedder is None or not text.strip():
            return None
        vector, _ = await self.embedder.query(text, self.query_timeout)
        return vector

    async def _ready(self) -> VectorIndex | None:
        """The index, loaded once; None while it loads past the query's bound, or failed."""
        if self._index is not None:
            return self._index
        loading = self._loading
        if loading is None or (loading.done() and (loading.cancelled() or loading.exception() is not None)):
            self._loading = asyncio.create_task(self._load())
        try:
            async with asyncio.timeout(self.query_timeout):
                return await asyncio.shield(self._loading)
        except TimeoutError:
            return None
        except Exception:
            logger.exception("recall: the vector index could not be loaded")
            return None

    async def _load(self) -> VectorIndex | None:
        assert self.embedder is not None
        rows = await self.history.recall_vectors.run(RecallVectorStore.load, self.embedder.model)
        index = await asyncio.to_thread(_built, rows, self.embedder.dim)
        self._index, backlog, self._backlog = index, self._backlog, []
        if index is not None:
            self._indexed([p for p, _ in backlog], [v for _, v in backlog])
        return index

    async def near(self, cid: int, text: str, through: int, own: bool, elsewhere: bool) -> Near:
        """What the vectors find for ``text``: in conversation ``cid``'s archive (turns
        1..``through``, its files) when ``own``, in the other conversations and memories when
        ``elsewhere``. Empty without an embedder, a vector in time, or an index."""
        if self.embedder is None:
            return NO_NEAR
        vector = await self.query(text)
        index = await self._ready() if vector is not None else None
        if vector is None or index is None or index.dim != int(vector.shape[0]):
            return NO_NEAR
        model = self.embedder.model
        found = Near()
        tables = self.history.recall_vectors
        if own:
            cosines = _similar(await asyncio.to_thread(index.nearest, vector, NEAREST, [cid, -cid]))
            hits = await tables.run(RecallVectorStore.own, cid, list(cosines), model, through)
            found.own = [(hit, cosines[_key(cid, hit)]) for hit in hits]
        if elsewhere:
            def others(groups: KbIds) -> npt.NDArray[np.bool_]:  # messages (not chunks, memories) of the rest
                return (groups > 0) & (groups != cid)

            cosines = _similar(await asyncio.to_thread(index.nearest, vector, NEAREST * 2, others))
            hits = await tables.run(RecallVectorStore.others, cid, list(cosines), model)
            found.others = [(hit, cosines[_message_key(hit.conversation, hit.turn, hit.n)]) for hit in hits]
            memories = _similar(await asyncio.to_thread(index.nearest, vector, NEAREST_MEMORIES, [MEMORIES]))
            valid = await tables.run(RecallVectorStore.memories, list(memories), model)
            found.memories = {key: memories[key] for key in valid}
        return found


def _similar(nearest: list[tuple[int, float]]) -> dict[int, float]:
    """The nearest that are similar enough to count, best first: only those are looked up."""
    return {key: cosine for key, cosine in nearest if cosine >= MIN_SIMILARITY}


def _message_key(cid: int, turn: int, n: int) -> int:
    from history import message_rowid

    return message_rowid(cid, turn, n)


def _key(cid: int, hit: ArchiveHit) -> int:
    if hit.attachment is not None and hit.chunk is not None:
        from history.archive import CHUNK_SHIFT

        return -(hit.attachment << CHUNK_SHIFT | hit.chunk)
    return _message_key(cid, hit.turn, hit.n)


def _blob(vector: Vector) -> bytes:
    from .vectors import vector_blob

    return vector_blob(vector)


def _built(rows: list[tuple[int, int, bytes]], dim: int | None) -> VectorIndex | None:
    """The index of these (key, group, blob) rows: the size ``dim`` when known, else the first's."""
    from .vectors import VectorIndex, vectors_from_blobs

    sizes = {len(blob) // 4 for _, _, blob in rows}
    size = dim or (max(sizes) if sizes else None)
    if size is None:
        return VectorIndex(0) if dim is None else VectorIndex(dim)
    rows = [row for row in rows if len(row[2]) == size * 4]
    index = VectorIndex(size, len(rows))
    if rows:
        index.add([k for k, _, _ in rows], vectors_from_blobs([b for _, _, b in rows], size),
                  replace=False, groups=[g for _, g, _ in rows])
    return index
