#!/usr/bin/env python3
"""Knowledge bases: search latency and memory at 100,000 chunks, ingest throughput.

Search: a KB of ``--chunks`` (100,000) chunks of about 900 characters (words drawn from
a Zipf distribution over 60,000 words, as bench_search.py does) in 1,000 documents, each
chunk with a random unit vector of ``--dim`` (384) float32, written straight into a
migrated history.db (the chunk rows through the store's own FTS5 triggers) and cached
under /tmp, since making it takes a while; ``--rebuild`` makes it again. Nothing is
written into the repository. Then, through ``KnowledgeBases`` as the daemon uses it:
- loading the vectors into memory (once per daemon);
- p50/p95/max over ``--queries`` queries (1 to 3 keywords from rare, mid and common
  bands, or a question of 6 to 14 words with stop words), scoped to the KB as a linked
  conversation's search is: vector alone (the int8 shortlist in worker threads,
  re-scored with the fine codes, as the daemon runs it), bm25 alone (on the history
  thread), and hybrid (the linked KB's id read while the query is embedded, then its
  bm25 candidates beside the vector scan, fused, hits read back with the float32
  vectors of those shown); hybrid twice, first with every query embedded by the fake
  router (a loopback round trip), then with the query embeddings cached;
- RSS of this process (imports, the KB loaded, searches done) and its peak;
- recall@10 of the vector side against exact float32 search over every vector (loaded
  for that after the memory is measured).
Ingest: ``--pdfs`` (20) PDFs of ``--pages`` (25) dense text pages (~3,000 characters)
added to a fresh KB, without an embedder and with the fake router embedding (384
dimensions, in its own process): pages per second and chunks per second.
Targets: hybrid p95 <= 10 ms; RSS with the KB loaded <= 150 MB; recall@10 >= 0.98.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import random
import sqlite3
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from benchlib import (
    die_with_parent,
    header,
    router_process,
    temp_dir,
    terminate_on_sigterm,
    verdict,
    vocabulary,
)

from core import Config
from core.router import RouterClient
from history import AsyncHistory, HistoryStore, kb_chunk_range
from kbinject import KbSettings, KnowledgeBases
from kbinject.search import CANDIDATES, fts_phrases, query_terms
from kbinject.vectors import np, vector_blob, vectors_from_blobs  # numpy as the daemon loads it: BLAS at one thread

CORPUS_VERSION = 2  # bump when the generator changes: the cache name carries it
SEED = 20261129
CACHE_DIR = Path("/tmp")
VOCABULARY_SIZE = 60_000
ZIPF_S = 1.07
CHUNK_WORDS = (5.0, 0.2)  # lognormal mu, sigma: median ~150 words, ~900 characters
DOCUMENTS = 1_000
BANDS = {"common": (0, 15), "mid": (40, 3_000), "rare": (8_000, VOCABULARY_SIZE)}
QUESTION_SHARE = 0.3  # queries that are questions rather than keywords
EMBED_MODEL = "fake-embed"
KB_NAME = "Bench"
PAGE_LINES, LINE_CHARS = 40, 78

TARGET_HYBRID_P95 = 10.0  # ms
TARGET_RSS_MB = 150.0
TARGET_RECALL = 0.98
RECALL_AT = 10

QUESTION_FORMS = ("how does the {} work with {}", "what is {} for", "why would {} fail when {}",
                  "where can i find the {} about {}", "explain {} and {}")


# -- the corpus ----------------------------------------------------------------------------


def kb_vocabulary() -> list[str]:
    return vocabulary(random.Random(SEED), VOCABULARY_SIZE)


def probabilities() -> np.ndarray:
    ranks = np.arange(1, VOCABULARY_SIZE + 1, dtype=float)
    weights = 1.0 / ranks**ZIPF_S
    return weights / weights.sum()


def cache_path(chunks: int, dim: int) -> Path:
    return CACHE_DIR / f"assistant-bench-kb-v{CORPUS_VERSION}-{chunks}-{dim}-{SEED}.db"


def chunk_texts(rng: np.random.Generator, words: np.ndarray, p: np.ndarray, count: int) -> list[str]:
    lengths = np.clip(rng.lognormal(*CHUNK_WORDS, count), 40, 170).astype(np.int64)
    ids = rng.choice(len(words), size=int(lengths.sum()), p=p)
    tokens = words[ids]
    texts, start = [], 0
    for length in lengths:
        texts.append(" ".join(tokens[start : start + length]))
        start += int(length)
    return texts


def write_corpus(path: Path, chunks: int, dim: int) -> None:
    """Write one KB of ``chunks`` chunks with vectors straight into a migrated history.db."""
    partial = path.with_suffix(".partial")
    for stale in (partial, Path(f"{partial}-wal"), Path(f"{partial}-shm")):
        stale.unlink(missing_ok=True)
    with HistoryStore(partial) as store:
        kb, _ = store.kb.ensure(KB_NAME)
    rng = np.random.default_rng(SEED)
    words = np.array(kb_vocabulary(), dtype=object)
    p = probabilities()
    lo, _ = kb_chunk_range(kb.id)
    per_document = chunks // DOCUMENTS
    conn = sqlite3.connect(partial, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = OFF")
    started = time.perf_counter()
    conn.execute("BEGIN")
    for d in range(1, DOCUMENTS + 1):
        count = per_document if d < DOCUMENTS else chunks - per_document * (DOCUMENTS - 1)
        conn.execute(
            "INSERT INTO kb_documents (id, kb_id, path, name, kind, sha256, size_bytes, mtime_ns, pages, chunks,"
            " truncated, added_at) VALUES (?, ?, ?, ?, 'pdf', ?, 0, 0, ?, ?, 0, '2026-11-29T00:00:00.000000Z')",
            (d, kb.id, f"/bench/doc{d:04d}.pdf", f"doc{d:04d}.pdf", f"{d:064x}", count, count),
        )
    conn.execute("COMMIT")
    n = 0
    for d in range(1, DOCUMENTS + 1):
        count = per_document if d < DOCUMENTS else chunks - per_document * (DOCUMENTS - 1)
        texts = chunk_texts(rng, words, p, count)
        matrix = rng.standard_normal((count, dim)).astype(np.float32)
        matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
        conn.execute("BEGIN")  # one transaction per document
        ids = [lo | (n + i + 1) for i in range(count)]
        conn.executemany(
            "INSERT INTO kb_chunks (id, document_id, ordinal, page, text) VALUES (?, ?, ?, ?, ?)",
            [(chunk_id, d, i + 1, i + 1, text) for i, (chunk_id, text) in enumerate(zip(ids, texts))],
        )
        conn.executemany(
            "INSERT INTO kb_vectors (chunk_id, model, dim, vector) VALUES (?, ?, ?, ?)",
            [(chunk_id, EMBED_MODEL, dim, vector_blob(row)) for chunk_id, row in zip(ids, matrix)],
        )
        conn.execute("COMMIT")
        n += count
        if d % 200 == 0:
            print(f"  {n:,}/{chunks:,} chunks, {time.perf_counter() - started:.0f} s", flush=True)
    conn.execute("UPDATE kbs SET next_chunk = ? WHERE id = ?", (n + 1, kb.id))
    conn.execute("INSERT INTO kb_chunk_fts (kb_chunk_fts) VALUES ('optimize')")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    os.replace(partial, path)


def ensure_corpus(chunks: int, dim: int, rebuild: bool) -> Path:
    path = cache_path(chunks, dim)
    if path.exists() and not rebuild:
        print(f"corpus: {path} (cached; --rebuild to make it again)")
        return path
    print(f"corpus: generating {path} ...", flush=True)
    started = time.perf_counter()
    # in a child process, so this process's memory figures do not carry the generation's
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=write_corpus, args=(path, chunks, dim))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"generating the corpus failed (exit {proc.exitcode})")
    print(f"corpus: generated in {time.perf_counter() - started:.1f} s, {path.stat().st_size / 1e6:.0f} MB")
    return path


def make_queries(count: int) -> list[str]:
    rng = random.Random(SEED + 2)
    words = kb_vocabulary()
    queries = []
    for _ in range(count):
        if rng.random() < QUESTION_SHARE:
            picks = [words[rng.randrange(*BANDS[rng.choice(("mid", "rare"))])] for _ in range(2)]
            queries.append(rng.choice(QUESTION_FORMS).format(*picks[: 2]))
        else:
            queries.append(" ".join(words[rng.randrange(*BANDS[rng.choice(tuple(BANDS))])]
                                    for _ in range(rng.randint(1, 3))))
    return queries


# -- the fake embedder in its own process --------------------------------------------------


def _embedding_router(conn: multiprocessing.connection.Connection, dim: int) -> None:
    """Child process: a FakeRouter serving ``dim``-dimensional embeddings; stops on a message."""
    die_with_parent()
    from selfcheck.fakerouter import FakeRouter

    with FakeRouter() as fake:
        fake.embed_dim = dim
        conn.send(fake.url)
        with contextlib.suppress(EOFError, KeyboardInterrupt):
            conn.recv()


def embedding_router(dim: int) -> contextlib.AbstractContextManager[str]:
    return router_process(_embedding_router, dim)


# -- measuring -----------------------------------------------------------------------------


def rss_mb(field: str = "VmRSS") -> float:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
    return f"p50 {statistics.median(ordered):.2f} ms, p95 {p95:.2f} ms, max {ordered[-1]:.2f} ms"


def p95(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]


async def timed(queries: list[str], run: Callable[[str], Awaitable[object]]) -> list[float]:
    samples = []
    for query in queries:
        started = time.perf_counter()
        await run(query)
        samples.append((time.perf_counter() - started) * 1000)
    return samples


async def search_part(path: Path, work: Path, dim: int, queries: list[str]) -> tuple[float, float, float]:
    """Search latencies and memory over the cached corpus (only read); (worst hybrid p95, RSS, recall@10)."""
    baseline = rss_mb()
    with embedding_router(dim) as url:
        config = Config(router_url=url, embedding_model=EMBED_MODEL, kb_top_k=3)
        history = await AsyncHistory.open(path)
        router = RouterClient(config)
        kbs = KnowledgeBases(history, router, KbSettings(config.embedding_model, config.kb_top_k))
        try:
            started = time.perf_counter()
            await kbs.start()
            load = time.perf_counter() - started
            index = kbs.index.of(dim)
            assert index is not None
            kb = await kbs.get(KB_NAME)
            kb_ids = [1]
            print(f"\nKB: {kb.chunks:,} chunks in {kb.documents:,} documents, {len(index):,} vectors of {index.dim}")
            print(f"  vectors loaded in {load:.2f} s ({index.nbytes / 1e6:.0f} MB of arrays)")

            embed = await timed(queries, lambda q: kbs.search(q, kbs=[KB_NAME], limit=3))
            vectors = {q: await query_vector(kbs, q) for q in queries}

            async def vector_only(query: str) -> object:
                return await kbs.index.nearest(index, vectors[query], kb_ids)

            async def bm25_only(query: str) -> object:
                phrases = fts_phrases(query_terms(query))
                return await history.kb.search(phrases, kb_ids, CANDIDATES)

            vector_ms = await timed(queries, vector_only)
            bm25_ms = await timed(queries, bm25_only)
            hybrid_ms = await timed(queries, lambda q: kbs.search(q, kbs=[KB_NAME], limit=3))
            hits = await kbs.search(queries[0], kbs=[KB_NAME], limit=3)
            assert hits.mode == "hybrid", hits.note
            print(f"\nsearch, {len(queries)} queries ({QUESTION_SHARE:.0%} questions, the rest 1-3 keywords), "
                  f"top {CANDIDATES} per list, 3 hits:")
            print(f"  vector (int8 shortlist, fine re-score): {summary(vector_ms)}")
            print(f"  bm25 (FTS5, history thread):   {summary(bm25_ms)}")
            print(f"  hybrid, query embedded by the fake router: {summary(embed)}")
            print(f"  hybrid, query embedding cached:            {summary(hybrid_ms)}")
            rss, peak = rss_mb(), rss_mb("VmHWM")
            print(f"\nmemory: RSS {rss:.0f} MB with the KB loaded (before loading: {baseline:.0f} MB), peak {peak:.0f} MB")
            recall = await vector_recall(kbs, history, index.dim, [vectors[q] for q in queries], kb_ids)
            print(f"\nrecall@{RECALL_AT} of the vector side against exact float32 search: {recall:.4f}")
        finally:
            await kbs.close()
            await router.aclose()
            await history.close()
    return max(p95(embed), p95(hybrid_ms)), rss, recall


async def query_vector(kbs: KnowledgeBases, query: str) -> np.ndarray:
    assert kbs.embedder is not None
    vector, why = await kbs.embedder.query(query)
    if vector is None:
        raise RuntimeError(f"the fake router gave no embedding for {query!r}: {why}")
    return vector


async def vector_recall(
    kbs: KnowledgeBases, history: AsyncHistory, dim: int, queries: list[np.ndarray], kb_ids: list[int]
) -> float:
    """The share of the exact top RECALL_AT (every float32 vector, one product) the daemon's search finds."""
    index = kbs.index.of(dim)
    assert index is not None and kbs.embedder is not None
    model = kbs.embedder.model
    rows: list[tuple[int, bytes]] = []
    while True:
        after = rows[-1][0] if rows else 0
        page = await history.kb.vectors(model, dim, after, 8_192)
        if not page:
            break
        rows += page
    ids = np.array([chunk_id for chunk_id, _ in rows])
    matrix = vectors_from_blobs([blob for _, blob in rows], dim)
    found = 0
    for query in queries:
        exact = set(ids[np.argsort(-(matrix @ query))[:RECALL_AT]].tolist())
        nearest = await kbs.index.nearest(index, query, kb_ids)
        found += len(exact & {chunk_id for chunk_id, _ in nearest[:RECALL_AT]})
    return found / (RECALL_AT * len(queries))


def page_text(rng: random.Random, words: list[str], cumulative: list[float]) -> str:
    lines: list[str] = []
    line = ""
    while len(lines) < PAGE_LINES:
        word = rng.choices(words, cum_weights=cumulative)[0]
        if len(line) + len(word) + 1 > LINE_CHARS:
            lines.append(line)
            line = ""
            if rng.random() < 0.12:
                lines.append("")
        line = f"{line} {word}".strip()
    return "\n".join(lines)


def make_pdfs(folder: Path, pdfs: int, pages: int) -> None:
    from selfcheck.samples import make_pdf

    rng = random.Random(SEED + 3)
    words = kb_vocabulary()[:5_000]
    cumulative = list(np.cumsum(probabilities()[:5_000]))
    folder.mkdir(parents=True)
    for n in range(pdfs):
        make_pdf(folder / f"paper{n:02d}.pdf", [page_text(rng, words, cumulative) for _ in range(pages)])


async def ingest_once(folder: Path, work: Path, url: str, model: str) -> tuple[float, int]:
    config = Config(router_url=url, embedding_model=model)
    history = await AsyncHistory.open(work / f"ingest-{model or 'none'}.db")
    router = RouterClient(config)
    kbs = KnowledgeBases(history, router, KbSettings(config.embedding_model, config.kb_top_k))
    try:
        started = time.perf_counter()
        result = await kbs.add("Papers", [str(folder)])
        elapsed = time.perf_counter() - started
        assert not result.errors and result.embedding_error is None, result.to_json()
        return elapsed, result.chunks
    finally:
        await kbs.close()
        await router.aclose()
        await history.close()


async def ingest_part(work: Path, pdfs: int, pages: int, dim: int) -> None:
    folder = work / "papers"
    make_pdfs(folder, pdfs, pages)
    total = pdfs * pages
    print(f"\ningest: {pdfs} PDFs x {pages} pages ({total} pages, ~{PAGE_LINES * LINE_CHARS:,} characters a page)")
    with embedding_router(dim) as url:
        bare, chunks = await ingest_once(folder, work, url, "")
        print(f"  without an embedder: {bare:.2f} s, {total / bare:,.0f} pages/s, {chunks / bare:,.0f} chunks/s "
              f"({chunks} chunks)")
        embedded, chunks = await ingest_once(folder, work, url, EMBED_MODEL)
        print(f"  embedding with the fake router ({dim} dimensions): {embedded:.2f} s, {total / embedded:,.0f} pages/s, "
              f"{chunks / embedded:,.0f} chunks/s")


async def run(args: argparse.Namespace) -> int:
    path = ensure_corpus(args.chunks, args.dim, args.rebuild)
    queries = make_queries(args.queries)
    with temp_dir("kb") as work:
        worst, rss, recall = await search_part(path, work, args.dim, queries)
        if not args.no_ingest:
            await ingest_part(work, args.pdfs, args.pages, args.dim)
    print()
    print(f"target: hybrid search p95 <= {TARGET_HYBRID_P95:g} ms: {worst:.2f} ms {verdict(worst <= TARGET_HYBRID_P95)}")
    print(f"target: RSS with the KB loaded <= {TARGET_RSS_MB:g} MB: {rss:.0f} MB {verdict(rss <= TARGET_RSS_MB)}")
    print(f"target: recall@{RECALL_AT} >= {TARGET_RECALL:g}: {recall:.4f} {verdict(recall >= TARGET_RECALL)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--queries", type=int, default=200)  # within the query cache (256)
    parser.add_argument("--pdfs", type=int, default=20)
    parser.add_argument("--pages", type=int, default=25)
    parser.add_argument("--no-ingest", action="store_true", help="search and memory only")
    parser.add_argument("--rebuild", action="store_true", help="generate the cached corpus again")
    args = parser.parse_args()
    terminate_on_sigterm()
    header("bench_kb: knowledge-base search at 100k chunks, memory, ingest throughput")
    return asyncio.run(run(args))


if __name__ == "__main__":
    raise SystemExit(main())
