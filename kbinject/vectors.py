"""The in-memory vector index: every chunk vector of one embedding model, as int8 codes.

Vectors live in SQLite (``kb_vectors``, float32 blobs, L2-normalised), but reading 100k
of them takes about half a second, far too long per query. They are therefore loaded
once into memory and kept in step as chunks are added and removed.

Not as float32, though: 100k vectors of 384 dimensions are 155 MB, and a search that
reads them all is bound by memory bandwidth (~9 ms a query on one core). The index
keeps each vector as int8 codes with one float32 scale per vector (``quantised``:
the vector's largest component maps to 127), a quarter of the bytes; a search (``shortlist``)
casts the codes to float32 a cache-sized block at a time (``SCAN_BYTES``) for BLAS's
product, so main memory is read at a quarter of the cost. Per-vector scales, not one
global scale, so a vector added later never has to fit a range chosen before it, and
each vector uses all 8 bits.

The codes only pick candidates: the cosine's error is ~5e-4 (half a code step per
component), about the gap between neighbouring scores near the top of 100k random
vectors. So the best ``SHORTLIST_FACTOR`` times as many as wanted are shortlisted and
re-scored exactly (``exact_cosines``) from their float32 blobs, read back from SQLite:
a few hundred primary-key lookups (~1 ms), where a float32 copy in memory would cost
the 155 MB this design saves, and SQLite is the one source of truth anyway. Every
similarity a caller sees is therefore the exact float32 cosine, and the top of the
list is exact unless a vector's approximate score fell below the shortlist's edge.

Searches run in a worker thread (numpy releases the GIL in the cast and the product)
while the event loop mutates the index, so the index never changes an array a search
may be reading: the codes, scales, ids and the row count are published together as one
``_Snapshot``; appending writes only rows past the published count (or into new,
larger arrays), and removing builds new arrays. A search takes the snapshot once and
sees a consistent index from then on.

A chunk's KB is its id shifted (history/kb.py); the index keeps that shifted column
too (0.4 MB at 100k), so scoping a search to a KB is one comparison over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from history import KB_CHUNK_SHIFT

__all__ = [
    "GROWTH",
    "SHORTLIST_FACTOR",
    "VectorIndex",
    "exact_cosines",
    "normalised",
    "quantised",
    "shortlist_size",
    "vector_blob",
    "vectors_from_blobs",
]

Matrix = npt.NDArray[np.float32]
Codes = npt.NDArray[np.int8]
Scales = npt.NDArray[np.float32]
Ids = npt.NDArray[np.int64]
KbIds = npt.NDArray[np.int32]
Rows = npt.NDArray[np.intp]

GROWTH = 1.25  # the arrays grow by this factor when full: little slack held on a big index
MIN_GROWTH_ROWS = 1024
BLOB_DTYPE = np.dtype("<f4")
CODE_MAX = 127  # a vector's largest component (in absolute value) is coded as ±127
# Bytes of float32 one scan step casts the codes into: small enough to stay in the
# core's cache between the cast and the product, big enough that the Python loop
# (a few µs a step) is a small share of the scan.
SCAN_BYTES = 1 << 20
# Candidates re-scored exactly per candidate wanted, and at least MIN_SHORTLIST: the
# true top k sits within a few code errors of the approximate k-th score, and that band
# holds few vectors unless many are near-duplicates of each other.
SHORTLIST_FACTOR = 4
MIN_SHORTLIST = 64


def normalised(vector: Sequence[float] | npt.NDArray[np.floating]) -> npt.NDArray[np.float32] | None:
    """``vector`` as a unit float32 vector; None when it is empty, zero or not finite."""
    array = np.asarray(vector, dtype=np.float32)
    if array.ndim != 1 or array.size == 0 or not np.all(np.isfinite(array)):
        return None
    norm = float(np.linalg.norm(array))
    if norm == 0.0 or not np.isfinite(norm):
        return None
    return (array / norm).astype(np.float32, copy=False)


def vector_blob(vector: npt.NDArray[np.float32]) -> bytes:
    """The ``kb_vectors.vector`` blob of a vector: little-endian float32."""
    return vector.astype(BLOB_DTYPE, copy=False).tobytes()


def vectors_from_blobs(blobs: Sequence[bytes], dim: int) -> Matrix:
    """Blobs of ``dim`` float32 each as an ``(n, dim)`` matrix (one copy)."""
    joined = b"".join(blobs)
    return np.frombuffer(joined, dtype=BLOB_DTYPE).reshape(len(blobs), dim).astype(np.float32, copy=False)


def quantised(vectors: Matrix) -> tuple[Codes, Scales]:
    """Rows as int8 codes and a float32 scale each: ``row ≈ codes * scale``."""
    peaks = np.abs(vectors).max(axis=1)
    scales = np.where(peaks > 0, peaks / CODE_MAX, 1.0).astype(np.float32)
    codes = np.rint(vectors / scales[:, None]).astype(np.int8)
    return codes, scales


def shortlist_size(k: int) -> int:
    """How many approximate candidates to re-score for an exact top ``k``."""
    return max(MIN_SHORTLIST, SHORTLIST_FACTOR * k)


def exact_cosines(query: npt.NDArray[np.float32], rows: Sequence[tuple[int, bytes]]) -> list[tuple[int, float]]:
    """(id, float32 cosine) of the chunks whose blobs are given, best first.

    Blobs of another dimension than the query's (a model that changed size) are left out.
    """
    size = query.shape[0] * BLOB_DTYPE.itemsize
    kept = [(chunk_id, blob) for chunk_id, blob in rows if len(blob) == size]
    if not kept:
        return []
    scores = vectors_from_blobs([blob for _, blob in kept], query.shape[0]) @ query
    order = np.argsort(-scores, kind="stable")
    return [(kept[i][0], float(scores[i])) for i in order]


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """The index as one search sees it: arrays of ``capacity`` rows, the first ``count`` in use."""

    codes: Codes
    scales: Scales
    ids: Ids
    kbs: KbIds
    count: int

    @classmethod
    def empty(cls, dim: int, capacity: int) -> _Snapshot:
        return cls(
            codes=np.empty((capacity, dim), dtype=np.int8),
            scales=np.empty(capacity, dtype=np.float32),
            ids=np.empty(capacity, dtype=np.int64),
            kbs=np.empty(capacity, dtype=np.int32),
            count=0,
        )

    @property
    def capacity(self) -> int:
        return len(self.ids)

    def grown(self, capacity: int) -> _Snapshot:
        """A copy with room for ``capacity`` rows (the published ones copied)."""
        bigger = _Snapshot.empty(self.codes.shape[1], capacity)
        count = self.count
        bigger.codes[:count] = self.codes[:count]
        bigger.scales[:count] = self.scales[:count]
        bigger.ids[:count] = self.ids[:count]
        bigger.kbs[:count] = self.kbs[:count]
        return _Snapshot(bigger.codes, bigger.scales, bigger.ids, bigger.kbs, count)

    def kept(self, keep: npt.NDArray[np.bool_]) -> _Snapshot:
        """New arrays holding only the rows in use that ``keep`` marks."""
        count = self.count
        return _Snapshot(
            np.ascontiguousarray(self.codes[:count][keep]),
            self.scales[:count][keep].copy(),
            self.ids[:count][keep].copy(),
            self.kbs[:count][keep].copy(),
            int(keep.sum()),
        )


def _approximate_scores(snapshot: _Snapshot, query: Matrix, rows: Rows | None) -> Matrix:
    """The approximate cosine of ``query`` with every row in use, or with ``rows`` of them."""
    codes, dim = snapshot.codes, snapshot.codes.shape[1]
    total = snapshot.count if rows is None else len(rows)
    scores = np.empty(total, dtype=np.float32)
    step = max(1, SCAN_BYTES // (dim * 4))
    block = np.empty((min(step, total), dim), dtype=np.float32)  # per call: searches run concurrently
    for start in range(0, total, step):
        stop = min(total, start + step)
        part = block[: stop - start]
        if rows is None:
            np.copyto(part, codes[start:stop], casting="unsafe")
        else:
            np.copyto(part, codes[rows[start:stop]], casting="unsafe")
        np.matmul(part, query, out=scores[start:stop])
    scores *= snapshot.scales[: snapshot.count] if rows is None else snapshot.scales[rows]
    return scores


class VectorIndex:
    """Unit vectors of chunks as int8 codes, shortlisted by approximate cosine, scoped by KB."""

    def __init__(self, dim: int, capacity: int = 0) -> None:
        self.dim = dim
        self._state = _Snapshot.empty(dim, capacity)

    def __len__(self) -> int:
        return self._state.count

    @property
    def nbytes(self) -> int:
        """Memory held by the arrays (capacity, not just the rows in use)."""
        state = self._state
        return int(state.codes.nbytes + state.scales.nbytes + state.ids.nbytes + state.kbs.nbytes)

    def add(self, ids: Sequence[int], vectors: Matrix, *, replace: bool = True) -> None:
        """Add the vectors of these chunk ids; vectors must be unit length.

        ``replace`` first drops vectors the index already holds for these ids; loading,
        which knows the ids are new, skips that search.
        """
        if len(ids) == 0:
            return
        if vectors.shape != (len(ids), self.dim):
            raise ValueError(f"expected {len(ids)} vectors of {self.dim}, got {vectors.shape}")
        new_ids = np.asarray(ids, dtype=np.int64)
        if replace:
            self.remove(new_ids)
        state = self._state
        count = state.count
        needed = count + len(new_ids)
        if needed > state.capacity:
            state = state.grown(max(needed, int(state.capacity * GROWTH), state.capacity + MIN_GROWTH_ROWS))
        codes, scales = quantised(vectors)
        # rows past the published count: no search is reading them
        state.codes[count:needed] = codes
        state.scales[count:needed] = scales
        state.ids[count:needed] = new_ids
        state.kbs[count:needed] = new_ids >> KB_CHUNK_SHIFT
        self._state = _Snapshot(state.codes, state.scales, state.ids, state.kbs, needed)

    def _keep(self, keep: npt.NDArray[np.bool_]) -> None:
        if not bool(keep.all()):
            self._state = self._state.kept(keep)

    def remove(self, ids: Sequence[int] | Ids) -> None:
        """Forget the vectors of these chunk ids (absent ones are ignored)."""
        if len(ids) == 0:
            return
        state = self._state
        if state.count:
            self._keep(~np.isin(state.ids[: state.count], np.asarray(ids, dtype=np.int64)))

    def remove_range(self, lo: int, hi: int) -> None:
        """Forget every vector whose chunk id is in [lo, hi] (a whole KB)."""
        state = self._state
        if state.count:
            used = state.ids[: state.count]
            self._keep((used < lo) | (used > hi))

    def shortlist(
        self, query: npt.NDArray[np.float32], n: int, kb_ids: Sequence[int] | None = None
    ) -> list[tuple[int, float]]:
        """The ``n`` chunks of highest approximate cosine with a unit ``query``, best first.

        The scores are approximate (within ~1e-3 of the cosine): re-score the ids with
        ``exact_cosines`` before showing or thresholding them. ``kb_ids`` limits the
        search to those KBs' chunks (None: all).
        """
        state = self._state
        if state.count == 0 or n <= 0:
            return []
        rows: Rows | None = None
        if kb_ids is not None:
            used_kbs = state.kbs[: state.count]
            mask = np.zeros(state.count, dtype=bool)
            for kb_id in set(kb_ids):  # a few KBs: one comparison each beats np.isin's sort
                mask |= used_kbs == kb_id
            if not mask.any():
                return []
            if not mask.all():
                rows = np.flatnonzero(mask)
        scores = _approximate_scores(state, query.astype(np.float32, copy=False), rows)
        candidates = state.ids[: state.count] if rows is None else state.ids[rows]
        if len(scores) > n:
            best = np.argpartition(scores, len(scores) - n)[len(scores) - n :]
        else:
            best = np.arange(len(scores))
        best = best[np.argsort(-scores[best], kind="stable")]
        return [(int(candidates[i]), float(scores[i])) for i in best]
