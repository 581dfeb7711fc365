"""The in-memory vector index: every chunk vector of one embedding model, as int8 codes.

Vectors live in SQLite (``kb_vectors``, float32 blobs, L2-normalised); reading them all
for each query would take far too long, so they are loaded once into memory and kept in
step as chunks are added and removed. Each is held as int8 codes and one float32 scale
(``quantised``: its largest component is coded as 127), a quarter of float32's bytes for
a scan bound by memory bandwidth; a scale per vector, so a vector added later never has
to fit a range chosen before it. A search (``nearest``) codes the query the same way and
takes the integer dot products with simsimd's int8 kernels (numpy has none), split over
``SCAN_THREADS`` threads. The codes only pick candidates (``shortlist_size(k)``), which
are re-scored from ``fine`` codes, each vector's rounding error coded again in 4 bits;
callers show the exact cosines of their few hits from the float32 blobs
(``exact_cosines``). Why, and what it was weighed against: docs/DESIGN.md,
"Knowledge-base ranking"; recall and speed: ``bench/bench_kb.py``.

numpy's BLAS (OpenBLAS in numpy's wheels) must not start threads of its own: after a
product big enough to split (a long shortlist re-scored), they spin-wait for more work
on the cores the event loop and the scan's threads need. numpy is therefore imported
here, the package's only way in, with ``OPENBLAS_NUM_THREADS=1`` for the time of its
import (OpenBLAS reads it when it loads; the environment is restored at once, so the
processes the daemon starts keep the user's). Nothing in the daemon imports numpy first;
a program that does keeps its BLAS threads (bench/bench_kb.py takes numpy from here).

Searches run in worker threads (simsimd and numpy release the GIL) while the event loop
mutates the index, so the index never changes an array a search may be reading: codes,
fine codes, scales, ids and the row count are published together as one ``_Snapshot``;
appending writes only rows past the published count (or into new, larger arrays), and
removing builds new arrays. Every thread of a scan reads the one snapshot its search
took and writes only its own arrays. A chunk's KB is its id shifted (history/kb.py); the
index keeps that column too, so scoping a search to a KB is one comparison over it.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from history import KB_CHUNK_SHIFT


def _import_numpy() -> None:
    """Load numpy with its BLAS at one thread (module docstring), leaving the environment as it was."""
    key = "OPENBLAS_NUM_THREADS"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        import numpy  # noqa: F401
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before


_import_numpy()
import numpy as np  # noqa: E402  (loaded above)
import numpy.typing as npt  # noqa: E402
import simsimd  # noqa: E402

__all__ = [
    "GROWTH",
    "SHORTLIST_FACTOR",
    "VectorIndex",
    "exact_cosines",
    "fine_codes",
    "normalised",
    "quantised",
    "shortlist_size",
    "vector_blob",
    "vectors_from_blobs",
]

Matrix = npt.NDArray[np.float32]
Codes = npt.NDArray[np.int8]
FineCodes = npt.NDArray[np.int8]  # two 4-bit codes a byte
Scales = npt.NDArray[np.float32]
Ids = npt.NDArray[np.int64]
KbIds = npt.NDArray[np.int32]
# What a search may return: the chunks of these KBs (the rows of these groups, for recall's
# vectors), or the rows whose group the function keeps (recall: the other conversations' messages)
Scope = Sequence[int] | Callable[[KbIds], npt.NDArray[np.bool_]]
Rows = npt.NDArray[np.intp]

GROWTH = 1.25  # the arrays grow by this factor when full: little slack held on a big index
MIN_GROWTH_ROWS = 1024
BLOB_DTYPE = np.dtype("<f4")
CODE_MAX = 127  # a vector's largest component (in absolute value) is coded as ±127
FINE_STEPS = 16  # a fine code counts sixteenths of a code step: -8 to 7
PART_ROWS = 16384  # rows one thread scores at a time (6 MB of codes at 384 dimensions)
TOP_SAMPLE = 16  # _top: every 16th score bounds the best ones
# Threads one scan is split over (the calling one included): the products are nearly
# bound by memory bandwidth, yet a second core still helps (bench/bench_kb.py); past
# four, bandwidth is the limit. Ours, not simsimd's ``threads=``: its OpenMP workers spin
# between calls on the cores the loop needs, for far more CPU than the scans themselves.
SCAN_THREADS = max(1, min(4, os.cpu_count() or 1))
# The threads that share scans with the ones searching; they start on first use, and
# parts of concurrent searches queue for them (they would only share the cores anyway).
_SCAN_POOL = ThreadPoolExecutor(max_workers=max(1, SCAN_THREADS - 1), thread_name_prefix="kb-scan")
# Candidates re-scored with the fine codes per candidate wanted, and at least
# MIN_SHORTLIST: the true top k sits within a few code errors (~5e-4 each, the vector's
# and the query's) of the approximate k-th score, and that band holds a handful of vectors unless many are
# near-duplicates of each other.
SHORTLIST_FACTOR = 2
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


def quantised(vectors: Matrix) -> tuple[Codes, FineCodes, Scales]:
    """Rows as int8 codes, fine codes and a float32 scale each:
    ``row ≈ codes * scale`` and, closer, ``row ≈ (codes + fine_codes(fine) / FINE_STEPS) * scale``."""
    peaks = np.abs(vectors).max(axis=1)
    scales = np.where(peaks > 0, peaks / CODE_MAX, 1.0).astype(np.float32)
    steps = vectors / scales[:, None]
    codes = np.rint(steps)
    fine = np.clip(np.rint((steps - codes) * FINE_STEPS), -FINE_STEPS // 2, FINE_STEPS // 2 - 1).astype(np.int8)
    if fine.shape[1] % 2:
        fine = np.pad(fine, ((0, 0), (0, 1)))
    # two's complement nibbles: the even component low, the odd one high
    packed = (fine[:, 0::2] & 0x0F) | (fine[:, 1::2] << 4)
    return codes.astype(np.int8), packed, scales


def fine_codes(packed: FineCodes, dim: int) -> Codes:
    """The fine codes of some rows, one int8 (-8 to 7) a component."""
    unpacked = np.empty((len(packed), packed.shape[1] * 2), dtype=np.int8)
    unpacked[:, 0::2] = (packed << 4) >> 4  # arithmetic shifts: the nibble's sign comes back
    unpacked[:, 1::2] = packed >> 4
    return unpacked[:, :dim]


def shortlist_size(k: int) -> int:
    """How many approximate candidates to re-score for a top ``k``."""
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
    fine: FineCodes
    scales: Scales
    ids: Ids
    kbs: KbIds
    count: int

    @classmethod
    def empty(cls, dim: int, capacity: int) -> _Snapshot:
        return cls(
            codes=np.empty((capacity, dim), dtype=np.int8),
            fine=np.empty((capacity, (dim + 1) // 2), dtype=np.int8),
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
        count = self.count
        bigger = dataclasses.replace(_Snapshot.empty(self.codes.shape[1], capacity), count=count)
        bigger.codes[:count] = self.codes[:count]
        bigger.fine[:count] = self.fine[:count]
        bigger.scales[:count] = self.scales[:count]
        bigger.ids[:count] = self.ids[:count]
        bigger.kbs[:count] = self.kbs[:count]
        return bigger

    def kept(self, keep: npt.NDArray[np.bool_]) -> _Snapshot:
        """New arrays holding only the rows in use that ``keep`` marks."""
        count = self.count
        return _Snapshot(
            np.ascontiguousarray(self.codes[:count][keep]),
            np.ascontiguousarray(self.fine[:count][keep]),
            self.scales[:count][keep].copy(),
            self.ids[:count][keep].copy(),
            self.kbs[:count][keep].copy(),
            int(keep.sum()),
        )


def _best_of_part(
    snapshot: _Snapshot, query: Codes, query_scale: float, rows: Rows | None, n: int, start: int, stop: int
) -> tuple[Rows, Matrix]:
    """The ``n`` positions in [start, stop) of highest approximate cosine, and their cosines.

    A position is a row in use, or an entry of ``rows`` when the search is scoped.
    Scaling and the partial sort happen here too, so they are split over the threads.
    """
    codes = snapshot.codes[start:stop] if rows is None else snapshot.codes[rows[start:stop]]
    # the integer sums as float32: exact up to 1,040 dimensions (127 x 127 a component
    # within 24 bits), within 6e-8 of them past that. Not into an ``out=`` array: simsimd
    # 6.5 then returns None without a reference of its own, which kills Python 3.11 in time.
    scores = np.asarray(simsimd.cdist(query, codes, metric="dot", out_dtype="float32"))[0]
    scores *= snapshot.scales[start:stop] if rows is None else snapshot.scales[rows[start:stop]]
    scores *= np.float32(query_scale)
    best = _top(scores, n)
    return best + start, scores[best]


def _top(scores: Matrix, n: int) -> Rows:
    """The positions of the ``n`` highest scores, in no order.

    A partial sort of every score would cost a good part of what the products do. The n-th
    highest of every TOP_SAMPLE-th score is at most the n-th highest of all, so the
    scores at or above it hold the top n (about TOP_SAMPLE x n of them): only those are
    sorted.
    """
    if len(scores) <= n:
        return np.arange(len(scores))
    sample = scores[::TOP_SAMPLE]
    if len(sample) > n:
        (candidates,) = np.nonzero(scores >= np.partition(sample, len(sample) - n)[len(sample) - n])
    else:
        candidates = np.arange(len(scores))
    return candidates[np.argpartition(scores[candidates], len(candidates) - n)[len(candidates) - n :]]


def _best_positions(snapshot: _Snapshot, query: Matrix, rows: Rows | None, n: int) -> tuple[Rows, Matrix]:
    """The ``n`` positions of highest approximate cosine, best first, and their cosines.

    The positions are cut into parts of PART_ROWS that the threads take in turn, so a
    thread slowed by other work on its core takes fewer of them.
    """
    total = snapshot.count if rows is None else len(rows)
    codes, _, scales = quantised(query.reshape(1, -1))  # the query coded as the vectors are
    scale = float(scales[0])
    parts = max(1, -(-total // PART_ROWS))
    taken = itertools.count()  # next() on it is atomic: each part is scanned once

    def scan() -> list[tuple[Rows, Matrix]]:
        found = []
        while (part := next(taken)) < parts:
            start, stop = part * PART_ROWS, min(total, (part + 1) * PART_ROWS)
            found.append(_best_of_part(snapshot, codes, scale, rows, n, start, stop))
        return found

    helpers = [_SCAN_POOL.submit(scan) for _ in range(min(SCAN_THREADS, parts) - 1)]
    try:
        found = scan()
    finally:
        found += [best for helper in helpers for best in helper.result()]
    positions = np.concatenate([p for p, _ in found])
    scores = np.concatenate([c for _, c in found])
    order = np.argsort(-scores, kind="stable")[:n]
    return positions[order], scores[order]


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
        return int(state.codes.nbytes + state.fine.nbytes + state.scales.nbytes + state.ids.nbytes + state.kbs.nbytes)

    def add(
        self, ids: Sequence[int], vectors: Matrix, *, replace: bool = True, groups: Sequence[int] | None = None
    ) -> None:
        """Add the vectors of these chunk ids; vectors must be unit length.

        ``replace`` first drops vectors the index already holds for these ids; loading,
        which knows the ids are new, skips that search. ``groups``: what scopes each (what
        ``kb_ids`` of a search name) when it is not the id's KB (recall's vectors).
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
        codes, fine, scales = quantised(vectors)
        # rows past the published count: no search is reading them
        state.codes[count:needed] = codes
        state.fine[count:needed] = fine
        state.scales[count:needed] = scales
        state.ids[count:needed] = new_ids
        state.kbs[count:needed] = new_ids >> KB_CHUNK_SHIFT if groups is None else np.asarray(groups, dtype=np.int32)
        self._state = dataclasses.replace(state, count=needed)

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

    def count_in(self, kb_ids: Scope | None) -> int:
        """The vectors of these KBs' chunks (None: all)."""
        state = self._state
        return state.count if kb_ids is None else int(_in_scope(state, kb_ids).sum())

    def remove_range(self, lo: int, hi: int) -> None:
        """Forget every vector whose chunk id is in [lo, hi] (a whole KB)."""
        state = self._state
        if state.count:
            used = state.ids[: state.count]
            self._keep((used < lo) | (used > hi))

    def shortlist(
        self, query: npt.NDArray[np.float32], n: int, kb_ids: Scope | None = None
    ) -> list[tuple[int, float]]:
        """The ``n`` chunks of highest approximate cosine with a unit ``query``, best first.

        The scores are approximate (within ~1.5e-3 of the cosine): ``nearest`` re-scores
        them. ``kb_ids`` limits the search to those KBs' chunks (None: all).
        """
        state = self._state
        rows, scores = _shortlisted(state, query, n, kb_ids)
        return [(int(state.ids[row]), float(score)) for row, score in zip(rows, scores)]

    def nearest(
        self, query: npt.NDArray[np.float32], k: int, kb_ids: Scope | None = None
    ) -> list[tuple[int, float]]:
        """The ``k`` chunks nearest a unit ``query``, best first, with cosines within ~1e-4:
        ``shortlist_size(k)`` candidates by the codes, re-scored with the fine codes."""
        state = self._state
        rows, _ = _shortlisted(state, query, shortlist_size(k), kb_ids)
        if len(rows) == 0:
            return []
        steps = state.codes[rows].astype(np.float32)
        steps += fine_codes(state.fine[rows], self.dim) * np.float32(1 / FINE_STEPS)
        cosines = (steps @ query.astype(np.float32, copy=False)) * state.scales[rows]
        order = np.argsort(-cosines, kind="stable")[:k]
        return [(int(state.ids[rows[i]]), float(cosines[i])) for i in order]


def _in_scope(state: _Snapshot, kb_ids: Scope) -> npt.NDArray[np.bool_]:
    """Which rows are chunks of these KBs (or of the groups a function keeps)."""
    used_kbs = state.kbs[: state.count]
    if callable(kb_ids):
        return kb_ids(used_kbs)
    mask = np.zeros(state.count, dtype=bool)
    for kb_id in set(kb_ids):  # a few KBs: one comparison each beats np.isin's sort
        mask |= used_kbs == kb_id
    return mask


def _shortlisted(
    state: _Snapshot, query: npt.NDArray[np.float32], n: int, kb_ids: Scope | None
) -> tuple[Rows, Matrix]:
    """The rows of the ``n`` highest approximate cosines within ``kb_ids`` (None: all), best
    first, and those cosines."""
    if state.count == 0 or n <= 0:
        return np.empty(0, dtype=np.intp), np.empty(0, dtype=np.float32)
    rows: Rows | None = None
    if kb_ids is not None:
        mask = _in_scope(state, kb_ids)
        if not mask.any():
            return np.empty(0, dtype=np.intp), np.empty(0, dtype=np.float32)
        if not mask.all():
            rows = np.flatnonzero(mask)
    positions, scores = _best_positions(state, query.astype(np.float32, copy=False), rows, n)
    return (positions if rows is None else rows[positions]), scores
