#!/usr/bin/env python3
"""Full-text search on a history of a million messages, and turns stored per second.

The history: ``--conversations`` (200) conversations of about 1,000 to 9,000 messages,
``--messages`` (1,000,000) in all, alternating a user question (median 12 words) and an
assistant reply (median 67 words). Words are drawn from a Zipf distribution (s = 1.07)
over 60,000 words: English function words first, then made-up words. The query words
come from three bands of that vocabulary, printed with how many messages hold them:
common (the 15 most frequent: from "the" in 87% of messages to 24%), mid (ranks 41 to
3,000: 10% down to 0.1%) and rare (ranks 8,001 on: a few dozen to a few hundred
messages). The history is written straight into the schema (turns and message_fts
rows, as the store writes them, in transactions of 100 turns so the FTS5 index has the
segments of a grown one) and cached under /tmp, since making it takes half a minute;
``--rebuild`` makes it again. Nothing is written into the repository.

Measured, all through ``HistoryStore`` (the daemon adds one hop to its history thread):
- ``search_conversation`` (conversation_search, 5 hits): p50/p95/max over
  ``--queries`` queries of 1 to 3 words, each word rare, mid or common with equal odds,
  one in five with a role filter, each in a random conversation; twice: first with
  nothing known about the words (each new common word costs one capped count), then
  again. The same queries as a ``LIKE`` scan of the conversation's stored messages give
  the ratio, and as plain bm25 over every query word (the design history/search.py
  replaces) show how often the fast ranking returns the same hits.
- ``search_all`` (the user's ``search``, 20 hits): the same.
- turns stored per second (``start_turn`` + ``finish_turn``, the index kept in step in
  the same transactions) on a copy of the big history, and on an empty one.
Targets: per conversation p95 < 15 ms and max < 50 ms; all conversations p95 < 20 ms;
over 1,000 turns/s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sqlite3
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import header, temp_dir, terminate_on_sigterm, verdict, vocabulary

from history import HistoryStore, NewTurn, SearchHit, conversation_rowid_range, message_rowid, quote_fts

CORPUS_VERSION = 2  # bump when the generator changes: the cache name carries it
SEED = 20260401
CACHE_DIR = Path("/tmp")
VOCABULARY_SIZE = 60_000
ZIPF_S = 1.07
MIN_CONVERSATION, MAX_CONVERSATION = 1_000, 9_000  # messages; the mean makes 200 x 5,000
USER_WORDS = (2.5, 0.7)  # lognormal mu, sigma: median 12 words
REPLY_WORDS = (4.2, 0.6)  # median 67 words
TURNS_PER_COMMIT = 100
# Rank bands of the vocabulary the queries draw from (0 = "the").
BANDS = {"common": (0, 15), "mid": (40, 3_000), "rare": (8_000, VOCABULARY_SIZE)}
ROLE_FILTER_SHARE = 0.2
LIKE_SAMPLES = 100  # LIKE scans of one conversation, for the ratio
LIKE_ALL_SAMPLES = 3  # LIKE scans of everything: about half a second each
AGREEMENT_SAMPLES = 150  # queries also answered by plain bm25, to show what the speed costs
AGREEMENT_ALL_SAMPLES = 40
WRITE_TURNS = 2_000

TARGET_CONVERSATION_P95 = 15.0  # ms
TARGET_CONVERSATION_MAX = 50.0
TARGET_ALL_P95 = 20.0
TARGET_TURNS_PER_SECOND = 1_000.0



@dataclass(frozen=True)
class Corpus:
    """What the history was generated from: enough to draw queries and new turns."""

    words: list[str]
    probabilities: np.ndarray
    sizes: list[int]  # messages per conversation, conversation ids 1..n


@dataclass(frozen=True)
class Query:
    text: str
    bands: tuple[str, ...]
    conversation: int
    role: str | None


def make_corpus(messages: int, conversations: int) -> Corpus:
    rng = random.Random(SEED)
    words = vocabulary(rng, VOCABULARY_SIZE)
    ranks = np.arange(1, len(words) + 1, dtype=float)
    probabilities = 1.0 / ranks**ZIPF_S
    probabilities /= probabilities.sum()
    nrng = np.random.default_rng(SEED)
    raw = nrng.integers(MIN_CONVERSATION, MAX_CONVERSATION + 1, conversations).astype(float)
    # scaled so the sizes add up to `messages`, each even (whole turns)
    sizes = [max(2, int(round(x * messages / raw.sum() / 2)) * 2) for x in raw]
    step = 2 if sum(sizes) < messages else -2
    while abs(messages - sum(sizes)) >= 2:
        sizes[rng.randrange(conversations)] += step
    return Corpus(words, probabilities, sizes)


class TextSource:
    """Questions and replies drawn from the corpus's word distribution."""

    def __init__(self, corpus: Corpus, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.words = np.array(corpus.words, dtype=object)
        self.probabilities = corpus.probabilities

    def texts(self, turns: int) -> list[tuple[str, str]]:
        lengths = np.empty(turns * 2, dtype=np.int64)
        lengths[0::2] = np.clip(self.rng.lognormal(*USER_WORDS, turns), 2, 400)
        lengths[1::2] = np.clip(self.rng.lognormal(*REPLY_WORDS, turns), 5, 800)
        ids = self.rng.choice(len(self.words), size=int(lengths.sum()), p=self.probabilities)
        tokens = self.words[ids]
        texts: list[str] = []
        start = 0
        for length in lengths:
            texts.append(" ".join(tokens[start : start + length]))
            start += int(length)
        return list(zip(texts[0::2], texts[1::2]))


def cache_path(messages: int, conversations: int) -> Path:
    return CACHE_DIR / f"assistant-bench-search-v{CORPUS_VERSION}-{messages}-{conversations}-{SEED}.db"


def stamp(second: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(1_767_225_600 + second)) + ".000000Z"


def write_corpus(path: Path, corpus: Corpus) -> None:
    """Write the conversations straight into a migrated history.db, as the store would."""
    partial = path.with_suffix(".partial")
    for stale in (partial, Path(f"{partial}-wal"), Path(f"{partial}-shm")):
        stale.unlink(missing_ok=True)
    HistoryStore(partial).close()  # the schema, migrated
    source = TextSource(corpus, SEED + 1)
    conn = sqlite3.connect(partial, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = OFF")
    second = 0
    started = time.perf_counter()
    for cid, size in enumerate(corpus.sizes, start=1):
        conn.execute(
            "INSERT INTO conversations (id, title, created_at, updated_at) VALUES (?, ?, ?, ?)",
            (cid, f"conversation {cid}", stamp(second), stamp(second + size)),
        )
        pairs = source.texts(size // 2)
        for first in range(0, len(pairs), TURNS_PER_COMMIT):
            turns, rows = [], []
            for turn, (question, reply) in enumerate(pairs[first : first + TURNS_PER_COMMIT], first + 1):
                messages = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
                second += 2
                turns.append((cid, turn, question, json.dumps(messages), reply, stamp(second)))
                rows.append((message_rowid(cid, turn, 0), question, "user"))
                rows.append((message_rowid(cid, turn, 1), reply, "assistant"))
            conn.execute("BEGIN")
            conn.executemany(
                "INSERT INTO turns (conversation_id, turn, text, messages, reply, status, created_at,"
                " updated_at) VALUES (?, ?, ?, ?, ?, 'complete', ?6, ?6)",
                turns,
            )
            conn.executemany("INSERT INTO message_fts (rowid, body, role) VALUES (?, ?, ?)", rows)
            conn.execute("COMMIT")
        if cid % 20 == 0 or cid == len(corpus.sizes):
            print(f"  {cid}/{len(corpus.sizes)} conversations, {time.perf_counter() - started:.0f} s", flush=True)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    partial.rename(path)
    Path(f"{partial}-wal").unlink(missing_ok=True)
    Path(f"{partial}-shm").unlink(missing_ok=True)


def ensure_corpus(corpus: Corpus, rebuild: bool) -> Path:
    path = cache_path(sum(corpus.sizes), len(corpus.sizes))
    if rebuild:
        path.unlink(missing_ok=True)
    if path.exists():
        print(f"history: {path} (cached; --rebuild to make it again)")
        return path
    print(f"history: generating {path} ...")
    started = time.perf_counter()
    try:
        write_corpus(path, corpus)
    except BaseException:
        for leftover in path.parent.glob(path.with_suffix(".partial").name + "*"):
            leftover.unlink(missing_ok=True)  # a gigabyte not to leave behind
        raise
    print(f"history: generated in {time.perf_counter() - started:.1f} s, {path.stat().st_size / 1e6:.0f} MB")
    return path


def describe_bands(conn: sqlite3.Connection, corpus: Corpus) -> None:
    """How many messages hold the first and the last word of each band the queries draw from."""
    total = conn.execute("SELECT count(*) FROM message_fts_docsize").fetchone()[0]
    for band, (first, end) in BANDS.items():
        shares = []
        for rank in (first, end - 1):
            word = corpus.words[rank]
            docs = conn.execute("SELECT count(*) FROM message_fts WHERE message_fts MATCH ?", (quote_fts(word),)).fetchone()[0]
            shares.append(f"{word!r} in {docs:,} ({docs / total:.2%})")
        print(f"  {band:6} words (ranks {first + 1}-{end}): {shares[0]} to {shares[1]} of {total:,} messages")


def make_queries(corpus: Corpus, count: int, seed: int) -> list[Query]:
    rng = random.Random(seed)
    queries = []
    for _ in range(count):
        bands = tuple(rng.choice(list(BANDS)) for _ in range(rng.randint(1, 3)))
        words = [corpus.words[rng.randrange(*BANDS[band])] for band in bands]
        role = rng.choice(["user", "assistant"]) if rng.random() < ROLE_FILTER_SHARE else None
        queries.append(Query(" ".join(words), bands, rng.randint(1, len(corpus.sizes)), role))
    return queries


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return (time.perf_counter() - started) * 1000, result


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))]


def summary(values: list[float]) -> str:
    return (
        f"p50 {statistics.median(values):7.2f} ms  p95 {percentile(values, 0.95):7.2f} ms  "
        f"max {max(values):7.2f} ms  (n={len(values)})"
    )


def kind(query: Query) -> str:
    """The query's most selective word: what decides how it is answered."""
    for band in ("rare", "mid", "common"):
        if band in query.bands:
            return band
    raise AssertionError(query)


def by_kind(queries: list[Query], times: list[float]) -> None:
    for band in ("rare", "mid", "common"):
        picked = [t for q, t in zip(queries, times) if kind(q) == band]
        if picked:
            label = f"{band} word" if band != "common" else "common words only"
            print(f"    {label:18} {summary(picked)}")


def like_pattern_sql(words: list[str]) -> str:
    return " AND ".join("messages LIKE ?" for _ in words)


def like_conversation(conn: sqlite3.Connection, query: Query) -> int:
    words = query.text.split()
    sql = f"SELECT turn FROM turns WHERE conversation_id = ? AND {like_pattern_sql(words)}"
    return len(conn.execute(sql, [query.conversation, *(f"%{w}%" for w in words)]).fetchall())


def like_all(conn: sqlite3.Connection, query: Query) -> int:
    words = query.text.split()
    sql = f"SELECT conversation_id, turn FROM turns WHERE {like_pattern_sql(words)}"
    return len(conn.execute(sql, [f"%{w}%" for w in words]).fetchall())


# The plain design the issue measured: every phrase in one bm25() expression.
EXACT_SEARCH = """
SELECT rowid FROM message_fts
WHERE message_fts MATCH :query AND rowid BETWEEN :lo AND :hi AND (:role IS NULL OR role = :role)
ORDER BY bm25(message_fts), rowid DESC
LIMIT :limit
"""


def exact_hits(conn: sqlite3.Connection, query: str, bounds: tuple[int, int], role: str | None, limit: int) -> list[int]:
    params = {"query": quote_fts(query), "lo": bounds[0], "hi": bounds[1], "role": role, "limit": limit}
    return [row[0] for row in conn.execute(EXACT_SEARCH, params)]


def hit_rowids(hits: list[SearchHit]) -> list[int]:
    slot = {"user": 0, "assistant": 1}
    return [message_rowid(h.conversation_id, h.turn, slot[h.role]) for h in hits]


def agreement(pairs: list[tuple[Query, list[int], list[int], float]]) -> None:
    """How often the fast ranking returns what bm25 over every phrase returns."""
    for band in ("rare", "mid", "common"):
        picked = [(ours, exact) for q, ours, exact, _ in pairs if kind(q) == band]
        if not picked:
            continue
        same = sum(1 for ours, exact in picked if set(ours) == set(exact))
        overlap = statistics.mean(len(set(o) & set(e)) / len(e) if e else float(not o) for o, e in picked)
        label = f"{band} word" if band != "common" else "common words only"
        print(f"    {label:18} same hits {same}/{len(picked)}, mean overlap {overlap:.0%}")
    slow = [t for *_, t in pairs]
    print(f"    (bm25 over every phrase took {summary(slow)})")


def bench_conversation_search(store: HistoryStore, queries: list[Query]) -> list[float]:
    times = []
    for query in queries:
        elapsed, _ = timed(lambda: store.search_conversation(query.conversation, query.text, 5, query.role))
        times.append(elapsed)
    return times


def bench_search_all(store: HistoryStore, queries: list[Query]) -> list[float]:
    times = []
    for query in queries:
        elapsed, _ = timed(lambda: store.search_all(query.text, 20))
        times.append(elapsed)
    return times


def search_section(path: Path, corpus: Corpus, count: int) -> dict[str, float]:
    queries = make_queries(corpus, count, SEED + 2)
    all_queries = make_queries(corpus, count // 2, SEED + 3)
    results: dict[str, float] = {}
    with HistoryStore(path) as store:
        conn = store._conn  # the same connection, for the LIKE baseline
        describe_bands(conn, corpus)
        # the file's pages into the OS cache, as in a daemon that has been running
        for query in make_queries(corpus, 50, SEED + 4):
            store.search_conversation(query.conversation, query.text.split()[0], 5)
        print(f"\nconversation_search, {len(queries)} queries (1-3 words; rare/mid/common; 20% role filter)")
        cold = bench_conversation_search(store, queries)
        warm = bench_conversation_search(store, queries)
        print(f"  first pass: {summary(cold)}")
        by_kind(queries, cold)
        print(f"  again:      {summary(warm)}")
        results["conversation_p95"] = percentile(cold, 0.95)
        results["conversation_max"] = max(cold)

        sample = queries[:LIKE_SAMPLES]
        like = [timed(lambda: like_conversation(conn, q))[0] for q in sample]
        fts = warm[:LIKE_SAMPLES]
        ratios = [lt / ft for lt, ft in zip(like, fts)]
        print(f"  LIKE scan of the same conversation ({len(sample)} of the queries): {summary(like)}")
        print(
            f"  LIKE / FTS5, per query: median {statistics.median(ratios):.0f}x, "
            f"p50 over p50 {statistics.median(like) / statistics.median(fts):.0f}x"
        )
        sizes = sorted(corpus.sizes)
        print(f"  conversations: {sizes[0]}..{sizes[-1]} messages, median {statistics.median(sizes):.0f}")
        compared = []
        for q in queries[:AGREEMENT_SAMPLES]:
            bounds = conversation_rowid_range(q.conversation)
            elapsed, exact = timed(lambda: exact_hits(conn, q.text, bounds, q.role, 5))
            ours = hit_rowids(store.search_conversation(q.conversation, q.text, 5, q.role))
            compared.append((q, ours, exact, elapsed))
        print(f"  against bm25 over every phrase ({len(compared)} of the queries, top 5):")
        agreement(compared)

        print(f"\nsearch over all conversations, {len(all_queries)} queries, 20 hits")
        cold_all = bench_search_all(store, all_queries)
        warm_all = bench_search_all(store, all_queries)
        print(f"  first pass: {summary(cold_all)}")
        by_kind(all_queries, cold_all)
        print(f"  again:      {summary(warm_all)}")
        compared = []
        for q in [q for q in all_queries if kind(q) != "common"][:AGREEMENT_ALL_SAMPLES]:
            elapsed, exact = timed(lambda: exact_hits(conn, q.text, (0, (1 << 63) - 1), None, 20))
            compared.append((q, hit_rowids(store.search_all(q.text, 20)), exact, elapsed))
        print(f"  against bm25 over every phrase ({len(compared)} queries with a rare or mid word, top 20):")
        agreement(compared)
        like_times = [timed(lambda: like_all(conn, q))[0] for q in all_queries[:LIKE_ALL_SAMPLES]]
        print(f"  LIKE scan of every conversation ({len(like_times)} queries): {summary(like_times)}")
        results["all_p95"] = percentile(cold_all, 0.95)
    return results


def store_turns(path: Path, corpus: Corpus, turns: int) -> float:
    """Turns per second through start_turn + finish_turn, in new conversations of 50 turns."""
    pairs = TextSource(corpus, SEED + 5).texts(turns)
    with HistoryStore(path) as store:
        started = time.perf_counter()
        cid: int | None = None
        for n, (question, reply) in enumerate(pairs):
            if n % 50 == 0:
                cid = None
            question_message = {"role": "user", "content": question}
            conversation, turn = store.start_turn(NewTurn(cid, question, [question_message], [], "bench", "t"))
            cid = conversation.id
            store.finish_turn(
                cid, turn.turn, messages=[question_message, {"role": "assistant", "content": reply}],
                reply=reply, status="complete", finish_reason="stop", prompt_tokens=100,
                completion_tokens=50, ctx_used=150,
            )
        elapsed = time.perf_counter() - started
        assert cid is not None and store.search_conversation(cid, pairs[-1][1].split()[-1])
    return turns / elapsed


def write_section(path: Path, corpus: Corpus, turns: int) -> float:
    with temp_dir("search") as work:
        copy = work / "history.db"
        print(f"\nstoring turns ({turns}, start_turn + finish_turn, index in the same transactions)")
        started = time.perf_counter()
        shutil.copyfile(path, copy)
        # flushed now, or the first checkpoint's fsync would write the whole copy
        with open(copy, "rb+") as handle:
            os.fsync(handle.fileno())
        print(f"  (copied and synced the history in {time.perf_counter() - started:.1f} s)")
        big = store_turns(copy, corpus, turns)
        copy.unlink()
        empty = store_turns(work / "empty.db", corpus, turns)
    print(f"  on the 1M-message history: {big:,.0f} turns/s")
    print(f"  on an empty history:       {empty:,.0f} turns/s")
    return big


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--queries", type=int, default=600, help="per-conversation queries (half as many over all)")
    parser.add_argument("--turns", type=int, default=WRITE_TURNS, help="turns stored for the write rate")
    parser.add_argument("--rebuild", action="store_true", help="generate the history again")
    args = parser.parse_args()
    terminate_on_sigterm()
    header("bench_search: full-text search at 1M messages, turns stored per second")
    corpus = make_corpus(args.messages, args.conversations)
    path = ensure_corpus(corpus, args.rebuild)
    results = search_section(path, corpus, args.queries)
    rate = write_section(path, corpus, args.turns)
    print()
    p95, worst, all_p95 = results["conversation_p95"], results["conversation_max"], results["all_p95"]
    print(f"target: conversation_search p95 < {TARGET_CONVERSATION_P95:g} ms: {p95:.2f} ms {verdict(p95 < TARGET_CONVERSATION_P95)}")
    print(f"target: conversation_search max < {TARGET_CONVERSATION_MAX:g} ms: {worst:.2f} ms {verdict(worst < TARGET_CONVERSATION_MAX)}")
    print(f"target: search (all conversations) p95 < {TARGET_ALL_P95:g} ms: {all_p95:.2f} ms {verdict(all_p95 < TARGET_ALL_P95)}")
    print(f"target: turns stored > {TARGET_TURNS_PER_SECOND:,.0f}/s: {rate:,.0f}/s {verdict(rate > TARGET_TURNS_PER_SECOND)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
