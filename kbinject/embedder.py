"""Embedding through the router: chunks in batches when ingesting, one query per turn.

Ingest (``documents``) sends ``BATCH_SIZE`` chunks a request. A request the server
answers with an HTTP error is split in two and each half tried again, down to single
chunks; a single chunk it still refuses is embedded from its first half, then its
first quarter (a server whose batch is smaller than the chunk answers HTTP 500 for that
input alone, and the start of a chunk stands for it well enough). A chunk nothing works
for is left without a vector, still found by bm25. ``MAX_FAILED_REQUESTS`` errors in a
row, or a server that does not answer at all, end the run with ``EmbedderFailed``: the
chunks stay pending and are embedded by a later add (or ``embed_pending``).

A query (``query``) is embedded on every turn, so it is bounded: at most
``QUERY_TIMEOUT`` seconds, answered from an LRU cache of ``QUERY_CACHE_SIZE`` recent
queries, and after a failure no new attempt is made for ``RETRY_AFTER`` seconds, so a
dead or hung embedder costs one bounded wait, not one per turn. It never raises: the
caller gets no vector and a note, and searches by keywords alone.

numpy (``normalised``, vectors.py) is imported where a vector is first made, not at
module level: the daemon builds a ``BatchEmbedder`` at start-up, before it is ready,
and numpy would take a large share of the start-up target (``bench/bench_startup.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from core.errors import AssistantError, RouterError, RouterUnreachable
from core.seams import Embedder

if TYPE_CHECKING:  # annotations only: numpy stays off the start-up path (docstring)
    import numpy as np
    import numpy.typing as npt

    Vector = npt.NDArray[np.float32]

__all__ = [
    "BATCH_SIZE",
    "QUERY_CACHE_SIZE",
    "QUERY_TIMEOUT",
    "RETRY_AFTER",
    "BatchEmbedder",
    "EmbedderFailed",
]

logger = logging.getLogger(__name__)

QUERY_TIMEOUT = 1.5  # seconds a turn waits for its query's embedding before using bm25 alone
QUERY_CACHE_SIZE = 256  # recent query embeddings kept (a retried or repeated question is free)
QUERY_CHARS = 2_000  # a longer question is embedded from its start (the server's input limit)
NO_EMBEDDINGS_STATUSES = (404, 405, 501)  # a server without an embeddings endpoint
RETRY_AFTER = 30.0  # seconds without query embeddings after one failed or timed out
BATCH_SIZE = 32  # chunks per embedding request when ingesting
BATCH_TIMEOUT = 120.0  # seconds one ingest request may take (a CPU server on a big batch)
# HTTP errors in a row before ingest gives up on the embedder. Splitting a batch of 32
# down to one refused chunk, then halving it twice, fails 8 requests in a row.
MAX_FAILED_REQUESTS = 12
MIN_HALVED_CHARS = 200  # a refused chunk is halved while it is at least this long
DIMENSION_PROBE = "dimension"  # embedded to learn the size of the model's vectors
PROBE_TIMEOUT = 10.0  # seconds kb_add waits for that (llama-swap may be loading the model)


class EmbedderFailed(Exception):
    """The embedding server is down or keeps failing; the message says why."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BatchEmbedder:
    """One embedding model behind the router."""

    def __init__(self, client: Embedder, model: str) -> None:
        self.client = client
        self.model = model
        self._cache: OrderedDict[str, Vector] = OrderedDict()
        self._retry_at = 0.0
        self._failures = 0
        # the dimension of the vectors the model gave last (None: not asked since the start);
        # it changes when another model is served under the name
        self.dim: int | None = None

    async def dimension(self) -> int | None:
        """The dimension of the model's vectors now, asked for with a one-word text (the model
        behind the name may have been swapped since the last vector); the last one seen (None:
        none) when the server cannot say within ``PROBE_TIMEOUT``, or failed recently."""
        if time.monotonic() < self._retry_at:
            return self.dim
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                raw = await self.client.embed(self.model, [DIMENSION_PROBE], timeout=PROBE_TIMEOUT)
        except (TimeoutError, AssistantError) as exc:
            reason = exc.message if isinstance(exc, AssistantError) else f"no answer within {PROBE_TIMEOUT:g} s"
            logger.warning("kb: could not ask %s the size of its vectors (%s)", self.model, reason)
            return self.dim
        vector = _normalised(raw[0]) if raw else None
        if vector is not None:
            self._saw([vector])
        return self.dim

    def _saw(self, vectors: Sequence[Vector | None]) -> None:
        dims = {int(v.shape[0]) for v in vectors if v is not None}
        if len(dims) != 1:
            return  # none, or a server that mixes sizes in one answer: nothing to learn from it
        dim = dims.pop()
        if self.dim is not None and dim != self.dim:
            logger.warning("kb: %s now gives vectors of %d dimensions instead of %d", self.model, dim, self.dim)
            self._cache.clear()  # the old model's query vectors
        self.dim = dim

    # -- ingest -------------------------------------------------------------------------

    async def documents(self, texts: Sequence[str]) -> list[Vector | None]:
        """One unit vector per text (None for a text the server refused); ``EmbedderFailed``."""
        self._failures = 0
        return await self._batch(list(texts))

    async def _batch(self, texts: list[str]) -> list[Vector | None]:
        try:
            raw = await self.client.embed(self.model, texts, timeout=BATCH_TIMEOUT)
        except RouterUnreachable as exc:
            raise EmbedderFailed(exc.message) from exc
        except RouterError as exc:
            if exc.status in NO_EMBEDDINGS_STATUSES:  # no such endpoint: splitting cannot help
                raise EmbedderFailed(f"{exc.message} (or set embedding_url to a server that embeds)") from exc
            self._failures += 1
            if self._failures >= MAX_FAILED_REQUESTS:
                raise EmbedderFailed(exc.message) from exc
            if len(texts) > 1:
                middle = len(texts) // 2
                return await self._batch(texts[:middle]) + await self._batch(texts[middle:])
            if len(texts[0]) >= MIN_HALVED_CHARS:
                return await self._batch([texts[0][: len(texts[0]) // 2]])
            logger.warning("kb: the embedding server refused a chunk (%s); it is found by keywords only", exc.message)
            return [None]
        self._failures = 0
        self._retry_at = 0.0  # it works again: queries may use it at once
        vectors = [_normalised(vector) for vector in raw]
        self._saw(vectors)
        return vectors

    # -- queries ------------------------------------------------------------------------

    async def query(self, text: str, timeout: float | None = None) -> tuple[Vector | None, str | None]:
        """The query's unit vector, or None and why; never raises, never waits past ``timeout``.

        ``timeout`` defaults to ``QUERY_TIMEOUT``.
        """
        timeout = QUERY_TIMEOUT if timeout is None else timeout
        key = text[:QUERY_CHARS]
        cached = self._cache.get(key)
        if cached is not None and cached.shape[0] == self.dim:
            self._cache.move_to_end(key)
            return cached, None
        now = time.monotonic()
        if now < self._retry_at:
            return None, f"the embedding server failed recently; keyword search only for {self._retry_at - now:.0f} s more"
        try:
            async with asyncio.timeout(timeout):
                raw = await self.client.embed(self.model, [key], timeout=timeout)
        except TimeoutError:
            return None, self._failed(f"the embedding server did not answer within {timeout:g} s")
        except AssistantError as exc:
            return None, self._failed(exc.message)
        except Exception as exc:  # whatever happens, the turn goes on without vectors
            logger.exception("kb: query embedding failed")
            return None, self._failed(f"{type(exc).__name__}: {exc}")
        vector = _normalised(raw[0]) if raw else None
        if vector is None:
            return None, "the embedding server returned an empty or invalid vector"
        self._saw([vector])
        self._cache[key] = vector
        if len(self._cache) > QUERY_CACHE_SIZE:
            self._cache.popitem(last=False)
        return vector, None

    def _failed(self, reason: str) -> str:
        self._retry_at = time.monotonic() + RETRY_AFTER
        logger.warning("kb: query embedding failed (%s); keyword search only for %g s", reason, RETRY_AFTER)
        return f"{reason}; keyword search only"


def _normalised(raw: Sequence[float]) -> Vector | None:
    from .vectors import normalised  # numpy: first needed here (module docstring)

    return normalised(raw)
