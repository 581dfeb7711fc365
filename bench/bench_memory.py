#!/usr/bin/env python3
"""Memory across conversations: does a fact said once, in another conversation, reach the prompt?

Part 1, fidelity (issue 48, "Measured"): ``--conversations`` (500) imported conversations of 4
to 8 turns of Zipf filler (as bench_search.py draws it), dated an hour apart; 40 facts stated
once each in one of them ("My {thing} is {value}."), 10 of those updated in a later one
("My {thing} changed: now it is {value}."), and 10 things never said (but asked about in
another conversation: "Do you know my {thing}?", "No, you have not told me ..."). Each is
asked in a fresh conversation ("What is my {thing}?") the way a turn recalls
(``ArchiveRecall.recall`` with ``elsewhere``, as ``ContextBuilder`` calls it; no model
request: what is measured is the block the prompt would carry, which the fake router would
only echo). Printed: the share of asked
facts whose passage (the newer, for an update) is in the block (target ≥ 95%), whether for
every update the newer passage is the one nearest the question (the older dropped as restated,
or before it), and how many never-said questions got a
passage above the floor (target 0).

Part 2, cost: ``--big`` (1,000) conversations × ``--turns`` (50) turns, ``--queries`` (200)
questions of the kinds above plus common and rare words, the recall timed per turn (p50/p95;
target ≤ 10 ms p95). Run time: about a minute, most of it writing the history.

``--vectors``: part 1 with vectors as well (an embedding model configured), from the fake
router's embedding (``fake_embedding``, a hashed bag of words: texts sharing words point
alike) called in-process; every message is embedded before the questions are asked.

    .venv/bin/python bench/bench_memory.py [--conversations 500] [--big 1000] [--turns 50] [--vectors]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from benchlib import ROOT, header, median, ms, temp_dir, terminate_on_sigterm, verdict, vocabulary

sys.path.insert(0, str(ROOT))
from history import AsyncHistory, HistoryStore  # noqa: E402
from kbinject import ArchiveRecall  # noqa: E402
from kbinject.embedder import BatchEmbedder  # noqa: E402
from kbinject.recallvec import RecallVectors  # noqa: E402
from selfcheck.fakerouter import fake_embedding  # noqa: E402

TARGET_SHARE = 0.95
TARGET_P95 = 0.010
FACTS, UPDATED, NEVER = 40, 10, 10
START = datetime(2026, 1, 5, 9, tzinfo=UTC)
THINGS = """
locker gate bike garage wifi alarm padlock safe mailbox storage trailer kayak boiler
printer router scooter canoe laptop tablet drone camera telescope piano violin guitar
cello trumpet ukulele accordion harp saxophone
""".split()
PLACES = """
gym office club studio cabin warehouse workshop harbour campus library hangar chalet
marina barn attic cellar basement
""".split()


def words(rng: random.Random, vocab: list[str], low: int, high: int) -> str:
    weights = [1 / (rank + 1) ** 1.07 for rank in range(len(vocab))]
    return " ".join(rng.choices(vocab, weights, k=rng.randint(low, high)))


def stamp(hours: int) -> str:
    return (START + timedelta(hours=hours)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def things(rng: random.Random) -> tuple[list[str], list[str], list[str]]:
    """Distinct things ("gym locker code"): the facts', the never-said ones (whose place and thing
    no fact names), and near misses (a said fact's place with another thing: two of three words)."""
    places, objects = PLACES[:], THINGS[:]
    rng.shuffle(places)
    rng.shuffle(objects)
    said = [f"{p} {t} code" for p in places[:10] for t in objects[:20]]
    rng.shuffle(said)
    facts = said[:FACTS]
    never = [f"{p} {t} code" for p, t in zip(places[10:] * 4, objects[20:])][:NEVER]
    near = [f"{fact.split()[0]} {objects[20 + i]} code" for i, fact in enumerate(facts[:NEVER])]
    return facts, never, near


def asked_elsewhere(thing: str) -> tuple[str, str]:
    """A never-said thing asked about in another conversation, and the model's answer: neither says
    it (recalled, either would cost the next turn a re-read for nothing: docs/DESIGN.md)."""
    return f"Do you know my {thing}?", f"No, you have not told me your {thing} yet."


def write(db: Path, count: int, turns: tuple[int, int], rng: random.Random, vocab: list[str],
          planted: dict[int, tuple[str, str]]) -> None:
    """``count`` conversations of filler, ``planted`` (conversation index → a turn) among them."""
    with HistoryStore(db) as store:
        for i in range(count):
            past = [(words(rng, vocab, 12, 30), words(rng, vocab, 20, 60)) for _ in range(rng.randint(*turns))]
            if i in planted:
                past.insert(rng.randrange(len(past) + 1), planted[i])
            store.import_conversation(past, f"bench-{i}", title=f"chat {i}", model=None, system_prompt=None,
                                      at=stamp(i))


class FakeEmbedder:
    """The fake router's embedding, in-process (``--vectors``)."""

    async def embed(self, model: str, inputs: list[str], timeout: float | None = None) -> list[list[float]]:
        return [fake_embedding(text, EMBED_DIM) for text in inputs]


EMBED_DIM = 256


async def ask(db: Path, questions: list[str], vectors: bool = False) -> list[tuple[str | None, float]]:
    """Each question in a fresh conversation: the block recalled and the time it took."""
    history = await AsyncHistory.open(db)
    try:
        fresh = await history.run(HistoryStore.create_conversation, "fresh")
        embedded = RecallVectors(history, BatchEmbedder(FakeEmbedder(), "fake") if vectors else None)
        embedded.catch_up()
        await embedded.settled()
        recall = ArchiveRecall(history, vectors=embedded)
        found = []
        for question in questions:
            started = time.perf_counter()
            result = await recall.recall(fresh.id, 1, question, "", 0, question, 500, 10**6,
                                         own=False, elsewhere=True)
            found.append((result.block, time.perf_counter() - started))
        return found
    finally:
        await history.close()


def fidelity(work: Path, count: int, rng: random.Random, vocab: list[str], vectors: bool = False) -> bool:
    facts, never, near = things(rng)
    slots = rng.sample(range(count // 2), FACTS)  # said in the first half, updated in the second
    values = {thing: str(rng.randint(1000, 9999)) for thing in facts}
    planted = {slot: (f"My {thing} is {values[thing]}.", "Noted.") for slot, thing in zip(slots, facts)}
    newer = {thing: str(rng.randint(1000, 9999)) for thing in facts[:UPDATED]}
    for slot, thing in zip(rng.sample(range(count // 2, count), UPDATED), newer):
        planted[slot] = (f"My {thing} changed: now it is {newer[thing]}.", "Noted.")
    for slot, thing in zip(rng.sample([i for i in range(count) if i not in planted], NEVER), never):
        planted[slot] = asked_elsewhere(thing)
    write(work / "history.db", count, (4, 8), rng, vocab, planted)
    answers = asyncio.run(ask(work / "history.db", [f"What is my {t}?" for t in facts + never + near], vectors))
    reached = sum(bool(block and newer.get(t, values[t]) in block) for t, (block, _) in zip(facts, answers))
    ordered = sum(bool(block and newer[t] in block and block.find(values[t]) < block.index(newer[t]))
                  for t, (block, _) in zip(facts[:UPDATED], answers))  # the older dropped or before
    stray = sum(bool(block) for block, _ in answers[FACTS:FACTS + NEVER])
    missed = sum(bool(block) for block, _ in answers[FACTS + NEVER:])
    share = reached / FACTS
    print(f"{count} conversations: the fact's passage reached the prompt for {reached}/{FACTS} ({share:.0%}); "
          f"target ≥ {TARGET_SHARE:.0%}: {verdict(share >= TARGET_SHARE)}")
    print(f"updates with the newer passage nearest the question (the older dropped or before): {ordered}/{UPDATED}: {verdict(ordered == UPDATED)}")
    print(f"never-said questions (each asked, unanswered, in another conversation) with a passage: "
          f"{stray}/{NEVER}: {verdict(stray == 0)}")
    print(f"(for information) near misses, a said fact's place with another thing: {missed}/{NEVER} got a passage")
    return share >= TARGET_SHARE and ordered == UPDATED and stray == 0


def cost(work: Path, count: int, turns: int, queries: int, rng: random.Random, vocab: list[str]) -> bool:
    facts, never, _ = things(rng)
    items = facts + never
    planted = {i * (count // FACTS): (f"My {thing} is {rng.randint(1000, 9999)}.", "Noted.")
               for i, thing in enumerate(facts)}
    started = time.perf_counter()
    write(work / "big.db", count, (turns, turns), rng, vocab, planted)
    print(f"wrote {count} conversations × {turns} turns in {time.perf_counter() - started:.0f} s")
    kinds = [
        lambda: f"What is my {rng.choice(items)}?",
        lambda: f"What about {rng.choice(vocab[3000:])} and {rng.choice(vocab[3000:])}?",
        lambda: f"Tell me about {rng.choice(vocab[:15])} {rng.choice(vocab[:15])}.",
        lambda: f"and the {rng.choice(vocab[200:2000])}?",
    ]
    answers = asyncio.run(ask(work / "big.db", [rng.choice(kinds)() for _ in range(queries)]))
    times = sorted(seconds for _, seconds in answers[5:])  # the first few warm the page cache
    p95 = times[int(0.95 * (len(times) - 1))]
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"recall across {count} × {turns} turns, per turn: p50 {ms(median(times))}  p95 {ms(p95)}  "
          f"max {ms(times[-1])}  (load average {load})")
    print(f"p95 ≤ {ms(TARGET_P95)}: {verdict(p95 <= TARGET_P95)}")
    return p95 <= TARGET_P95


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=500)
    parser.add_argument("--big", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--vectors", action="store_true", help="part 1 with the fake embedder's vectors too")
    args = parser.parse_args(argv)
    terminate_on_sigterm()
    rng = random.Random(20261207)
    vocab = vocabulary(rng, 5000)
    header("memory across conversations: recall injection of other conversations")
    with temp_dir("memory") as work:
        good = fidelity(work, args.conversations, rng, vocab, args.vectors)
        good = cost(work, args.big, args.turns, args.queries, rng, vocab) and good
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
