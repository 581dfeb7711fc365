"""The in-memory vector index: every chunk vector of one embedding model in one matrix.

Vectors live in SQLite (``kb_vectors``, float32 blobs, L2-normalised), but reading 100k
of them takes about half a second, far too long per query. They are therefore loaded
once into one ``(n, dim)`` float32 matrix, kept in step as chunks are added and
removed, and a query is one matrix-vector product (the cosine, since all are unit
vectors) and a partial sort.

Searches run in a worker thread (numpy releases the GIL in the product) while the
event loop mutates the index, so the index never changes an array a search may be
reading: the matrix, the ids and the row count are published together as one tuple;
appending writes only rows past the published count (or into a new, larger matrix),
and removing builds new arrays. A search takes the tuple once and sees a consistent
index from then on.

A chunk's KB is its id shifted (history/kb.py); the index keeps that shifted column
too (0.4 MB at 100k), so scoping a search to a KB is one comparison over it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from history import KB_CHUNK_SHIFT

__all__ = ["GROWTH", "VectorIndex", "normalised", "vector_blob", "vectors_from_blobs"]

Matrix = npt.NDArray[np.float32]
Ids = npt.NDArray[np.int64]
KbIds = npt.NDArray[np.int32]
State = tuple[Matrix, Ids, KbIds, int]

GROWTH = 1.25  # the matrix grows by this factor when full: little slack held on a big index
MIN_GROWTH_ROWS = 1024
BLOB_DTYPE = np.dtype("<f4")


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


class VectorIndex:
    """Unit vectors of chunks, searchable by cosine, scoped by KB."""

    def __init__(self, dim: int, capacity: int = 0) -> None:
        self.dim = dim
        matrix = np.empty((capacity, dim), dtype=np.float32)
        ids = np.empty(capacity, dtype=np.int64)
        kbs = np.empty(capacity, dtype=np.int32)
        self._state: State = (matrix, ids, kbs, 0)

    def __len__(self) -> int:
        return self._state[3]

    @property
    def nbytes(self) -> int:
        """Memory held by the arrays (capacity, not just the rows in use)."""
        matrix, ids, kbs, _ = self._state
        return int(matrix.nbytes + ids.nbytes + kbs.nbytes)

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
        matrix, current, kbs, count = self._state
        needed = count + len(new_ids)
        if needed > len(current):
            capacity = max(needed, int(len(current) * GROWTH), len(current) + MIN_GROWTH_ROWS)
            grown = np.empty((capacity, self.dim), dtype=np.float32)
            grown[:count] = matrix[:count]
            grown_ids = np.empty(capacity, dtype=np.int64)
            grown_ids[:count] = current[:count]
            grown_kbs = np.empty(capacity, dtype=np.int32)
            grown_kbs[:count] = kbs[:count]
            matrix, current, kbs = grown, grown_ids, grown_kbs
        # rows past the published count: no search is reading them
        matrix[count:needed] = vectors
        current[count:needed] = new_ids
        kbs[count:needed] = new_ids >> KB_CHUNK_SHIFT
        self._state = (matrix, current, kbs, needed)

    def _keep(self, keep: npt.NDArray[np.bool_]) -> None:
        matrix, ids, kbs, count = self._state
        if bool(keep.all()):
            return
        self._state = (
            np.ascontiguousarray(matrix[:count][keep]),
            ids[:count][keep].copy(),
            kbs[:count][keep].copy(),
            int(keep.sum()),
        )

    def remove(self, ids: Sequence[int] | Ids) -> None:
        """Forget the vectors of these chunk ids (absent ones are ignored)."""
        if len(ids) == 0:
            return
        _, current, _, count = self._state
        if count:
            self._keep(~np.isin(current[:count], np.asarray(ids, dtype=np.int64)))

    def remove_range(self, lo: int, hi: int) -> None:
        """Forget every vector whose chunk id is in [lo, hi] (a whole KB)."""
        _, current, _, count = self._state
        if count:
            used = current[:count]
            self._keep((used < lo) | (used > hi))

    def search(
        self, query: npt.NDArray[np.float32], k: int, kb_ids: Sequence[int] | None = None
    ) -> list[tuple[int, float]]:
        """The ``k`` chunks most similar to a unit ``query``: (id, cosine), best first.

        ``kb_ids`` limits the search to those KBs' chunks (None: all).
        """
        matrix, ids, kbs, count = self._state
        if count == 0 or k <= 0:
            return []
        used_ids = ids[:count]
        rows: npt.NDArray[np.intp] | None = None
        if kb_ids is not None:
            used_kbs = kbs[:count]
            mask = np.zeros(count, dtype=bool)
            for kb_id in set(kb_ids):  # a few KBs: one comparison each beats np.isin's sort
                mask |= used_kbs == kb_id
            if not mask.any():
                return []
            if not mask.all():
                rows = np.flatnonzero(mask)
        if rows is None:
            scores = matrix[:count] @ query
            candidates = used_ids
        else:
            scores = matrix[rows] @ query
            candidates = used_ids[rows]
        if len(scores) > k:
            best = np.argpartition(-scores, k - 1)[:k]
        else:
            best = np.arange(len(scores))
        best = best[np.argsort(-scores[best], kind="stable")]
        return [(int(candidates[i]), float(scores[i])) for i in best]

    def similarities(self, query: npt.NDArray[np.float32], ids: Sequence[int]) -> dict[int, float]:
        """The cosine of ``query`` with each of these chunks that has a vector."""
        matrix, current, _, count = self._state
        if not ids or count == 0:
            return {}
        rows = np.flatnonzero(np.isin(current[:count], np.asarray(ids, dtype=np.int64)))
        scores = matrix[rows] @ query
        return {int(current[row]): float(score) for row, score in zip(rows, scores)}
