#!/usr/bin/env python3
"""What recall injection adds to a turn: the archive searched before the question.

A conversation of ``--turns`` (2,000) imported turns (a user note of 12 to 30 words and
a reply of 20 to 60, Zipf words over a 5,000-word vocabulary, as bench_search.py draws
them) folded by a compaction but the last two, with a 40-page text file attached, is
searched the way a turn searches it (``kbinject.ArchiveRecall.recall``: the file chunked
once, then one trip to the history thread for the counts and the bm25 matches, the
passages chosen in a worker thread) for ``--queries`` (200) questions: a planted fact's
words, rare words, common words, and short questions that lean on the recent turns.
Printed: p50/p95/max of the whole recall (what a turn's first token waits for), and how
often a passage was recalled. Target (issue 49): p95 ≤ 5 ms at 2,000 archived turns.

    .venv/bin/python bench/bench_recall_inject.py [--turns 2000] [--queries 200]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

from benchlib import ROOT, header, median, ms, p90, temp_dir, terminate_on_sigterm, verdict, vocabulary

sys.path.insert(0, str(ROOT))
from history import AsyncHistory, HistoryStore  # noqa: E402
from kbinject import ArchiveRecall  # noqa: E402

TARGET_P95 = 0.005
FACT = "My bicycle is parked in bay 417 near the east gate."


def words(rng: random.Random, vocab: list[str], low: int, high: int) -> str:
    weights = [1 / (rank + 1) ** 1.07 for rank in range(len(vocab))]
    return " ".join(rng.choices(vocab, weights, k=rng.randint(low, high)))


def make_history(db: Path, turns: int, rng: random.Random, vocab: list[str]) -> int:
    """The conversation: imported turns, a file in the first, all folded but the last two."""
    past = [(words(rng, vocab, 12, 30), words(rng, vocab, 20, 60)) for _ in range(turns)]
    past[turns // 3] = (FACT, "Noted.")
    with HistoryStore(db) as store:
        cid = store.import_conversation(past, "bench", title="bench", model=None, system_prompt=None).id
        text = "\n".join(words(rng, vocab, 40, 80) for _ in range(40 * 12))
        store._conn.execute(  # a file of turn 1, as start_turn stores one (bench only)
            "INSERT INTO attachments (conversation_id, turn, name, path, kind, content_type, size_bytes, sha256, "
            "pages, full_text, created_at) VALUES (?, 1, 'notes.txt', '/tmp/notes.txt', 'text', 'text/plain', ?, "
            "'0', NULL, ?, 'now')", (cid, len(text), text))
        store._conn.commit()
        store.add_compaction(cid, turns - 2, "A long conversation of notes.")
    return cid


def questions(rng: random.Random, vocab: list[str], count: int) -> list[str]:
    kinds = [
        lambda: "Where did I park my bicycle?",
        lambda: f"What about {rng.choice(vocab[3000:])} and {rng.choice(vocab[3000:])}?",
        lambda: f"Tell me about {rng.choice(vocab[:15])} {rng.choice(vocab[:15])}.",
        lambda: "what was it again?",
        lambda: f"and the {rng.choice(vocab[200:2000])}?",
    ]
    return [rng.choice(kinds)() for _ in range(count)]


async def measure(
    db: Path, cid: int, turns: int, asked: list[str], recent: str
) -> tuple[list[float], int, float]:
    history = await AsyncHistory.open(db)
    try:
        recall = ArchiveRecall(history)
        first = time.perf_counter()
        await recall.recall(cid, turns + 1, "warm up", recent, turns - 2, "", 0, 10**6)  # chunks the file
        print(f"first recall (chunks the file): {ms(time.perf_counter() - first)}")
        times, found = [], 0
        cpu = time.process_time()
        for question in asked:
            started = time.perf_counter()
            result = await recall.recall(cid, turns + 1, question, recent, turns - 2, recent, 500, 10**6)
            times.append(time.perf_counter() - started)
            found += bool(result.block)
        return times, found, (time.process_time() - cpu) / len(asked)
    finally:
        await history.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--queries", type=int, default=200)
    args = parser.parse_args(argv)
    terminate_on_sigterm()
    rng = random.Random(20261207)
    vocab = vocabulary(rng, 5000)
    header(f"recall injection over {args.turns} archived turns")
    with temp_dir("recall-inject") as work:
        db = work / "history.db"
        cid = make_history(db, args.turns, rng, vocab)
        recent = f"{words(rng, vocab, 12, 30)}\n{words(rng, vocab, 20, 60)}"
        times, found, cpu = asyncio.run(measure(db, cid, args.turns, questions(rng, vocab, args.queries), recent))
    times.sort()
    p95 = times[int(0.95 * (len(times) - 1))]
    print(f"recall per turn: p50 {ms(median(times))}  p90 {ms(p90(times))}  p95 {ms(p95)}  max {ms(times[-1])}")
    print(f"CPU per recall, every thread of the process: {ms(cpu)} (steadier than the clock when cores are shared)")
    print(f"passages recalled for {found} of {len(times)} questions")
    print(f"p95 ≤ {ms(TARGET_P95)}: {verdict(p95 <= TARGET_P95)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
