#!/usr/bin/env python3
"""Crash audit: the daemon killed at random moments under load; what it kept, checked after each restart.

The daemon (benchlib's ``Daemon``) runs against a fake router, a process of its own, streaming
each reply slowly (``chunks=N`` words, ``--delay`` s apart, each carrying the question's tag).
In a round 1-3 clients send a random mix of ``ask`` (new and follow-up), ``cancel``,
``delete``, ``settings``, ``kb_add``/``kb_remove`` of three KBs (one large) and ``kb_link``
for up to 0.5 s (then, in ``--long-share`` of the rounds, the replies stream alone 0.5-3 s);
then SIGKILL, or SIGTERM (``--term-share``), some followed by SIGKILL (``--double-share``),
and ``--startup-kill-share`` of the restarts are killed once first. Started again on the same
data, the daemon is checked through the socket and in a copy of ``history.db``:

- integrity_check; FTS5 integrity-check (kb_chunk_fts against kb_chunks); no turn ``running``;
  PRAGMA foreign_key_check; KB documents keep their chunk count; a deletion's unindexing
  or a KB removal a kill cut short is finished 5 s after the start.
- message_fts holds exactly the rows ``history.fts`` makes of the stored messages of live
  conversations (and their latest summary).
- A question a client saw a ``user`` event for is stored (unless a ``delete`` of its
  conversation was sent) and search finds it; one refused ``shutting_down`` is not stored.
- Its turn: after ``done``, the reply and the status of the ``finish_reason``; after ``error``,
  ``error``; cut by the kill, interrupted, complete or cancelled, the reply and what the client
  saw one a prefix of the other, no shorter than what it had seen 1.25 s before the kill
  (the protocol's "at most a second behind").
- An acknowledged delete (gone from open and search), kb_remove or kb_add (all files) holds.
- After a SIGTERM alone: exit status 0 within 15 s, every ask answered, every turn ended.

It prints the kills by kind, the asks and those acknowledged, each violation with the seed and
round (one that persists counts again each round), and exits 1 on any. A seed fixes the
choices, not the timing. ``.venv/bin/python bench/crash_audit.py --seed 1``: 100 rounds, 2-3
minutes on 2 cores; ``--embed`` adds an embedding model, ``--keep`` keeps daemon.log and data/.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import multiprocessing.connection
import random
import re
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib import (
    FAKE_MODEL,
    TMP_PREFIX,
    Daemon,
    die_with_parent,
    header,
    router_process,
    temp_dir,
    terminate_on_sigterm,
    verdict,
)

from client import DaemonGone, Wire
from common import MAX_LIST_LIMIT
from history import SUMMARY_ROLE, SUMMARY_SLOT, conversation_rowid_range, message_rowid, split_rowid
from history.fts import load_messages, searchable_messages
from history.kb import SELECT_KBS_BEING_REMOVED
from selfcheck.fakerouter import FakeModel, FakeRouter, Reply

GRACE = 0.4  # ASSISTANT_SHUTDOWN_GRACE: seconds running turns get on SIGTERM
EXIT_TIMEOUT = 15.0  # seconds the daemon gets to exit on a signal
SETTLE_SECONDS = 5.0  # seconds start-up gets to finish what a kill cut short
# PROTOCOL.md: a reply a crash cut holds what was saved, "at most a second behind"; the promise,
# not daemon/runner.py's CHECKPOINT_SECONDS, so a daemon that breaks it fails here
CHECKPOINT_SLACK = 1.25
CONTEXT = 65536  # the fake model's context: a run never compacts
EMBED_DELAY = 0.05  # seconds the fake embedder takes a batch (--embed)
KB_FILES = {"kb0": 8, "kb1": 8, "kb2": 30}
KB_WORDS = {"kb0": 900, "kb1": 900, "kb2": 12000}  # words a file
OPS = {"ask": 30, "follow": 25, "cancel": 10, "delete": 7, "settings": 10, "kb_add": 8, "kb_remove": 5, "kb_link": 5}
ACKNOWLEDGED = ("cancel", "delete", "settings", "kb_add", "kb_remove", "kb_link")  # counted in the summary
KB_INJECTIONS = ("auto", "off", "both", "tool_only")
CHUNKS = (5, 20, 20, 20, 60, 120)  # words a reply: 0.1-2.4 s at 20 ms a word
FINISH_STATUS = {"stop": "complete", "length": "complete", "cancelled": "cancelled", "interrupted": "interrupted"}
CUT_STATUSES = ("interrupted", "complete", "cancelled")  # a turn the kill cut may have ended first
SELECT_RUNNING = "SELECT conversation_id, turn FROM turns WHERE status = 'running'"
SELECT_TURNS = "SELECT conversation_id, turn, messages FROM turns"
SELECT_SUMMARIES = "SELECT conversation_id, through_turn, summary FROM compactions ORDER BY id"
SELECT_FTS = "SELECT rowid, body, role FROM message_fts"
SELECT_LIVE = "SELECT id FROM conversations WHERE deleted_at IS NULL"
SELECT_DELETED = "SELECT id FROM conversations WHERE deleted_at IS NOT NULL"
COUNT_FTS_RANGE = "SELECT count(*) FROM message_fts WHERE rowid BETWEEN ? AND ?"
FTS_CHECKS = (
    "INSERT INTO message_fts (message_fts) VALUES ('integrity-check')",
    "INSERT INTO kb_chunk_fts (kb_chunk_fts, rank) VALUES ('integrity-check', 1)",  # 1: against kb_chunks
)
COUNT_MISCOUNTED = (
    "SELECT count(*) FROM kb_documents AS d WHERE chunks <> (SELECT count(*) FROM kb_chunks WHERE document_id = d.id)"
)
PRINTED_PER_KIND = 5  # violations of one kind printed as found; the rest only counted


class SlowRouter(FakeRouter):
    """The fake router streaming the question's ``chunks=N`` words (20 without) ``delay`` s
    apart, each ``r<tag>w<i>``: a search finds a stored reply by them."""

    delay = 0.02

    def next_reply(self, body: dict[str, Any], stream: bool) -> Reply:
        if not stream:
            return Reply(text="Fake title")
        users = [m for m in body.get("messages") or () if isinstance(m, dict) and m.get("role") == "user"]
        question = str(users[-1].get("content")) if users else ""
        count, tag = re.search(r"chunks=(\d+)", question), re.search(r"\bq\d+x\d+\b", question)
        words = int(count.group(1)) if count else 20
        return Reply(chunks=[f" r{tag.group(0) if tag else 'x'}w{i}" for i in range(words)], delay=self.delay)


def _slow_router(conn: multiprocessing.connection.Connection, delay: float, embed_delay: float) -> None:
    """Child process (benchlib.router_process): a SlowRouter until the parent says stop."""
    die_with_parent()
    router = SlowRouter(models=[FakeModel(FAKE_MODEL, ["text"], CONTEXT)])
    router.delay, router.embed_delay = delay, embed_delay
    with router, contextlib.suppress(EOFError, KeyboardInterrupt):
        conn.send(router.url)
        conn.recv()


# -- what the clients were told -------------------------------------------------------------
@dataclass
class Request:
    """One request of a round and the events answering it, each with its arrival time."""

    body: dict[str, Any]
    events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)

    def first(self, *types: str) -> dict[str, Any] | None:
        return next((e for _, e in self.events if e["type"] in types), None)

    def answer(self) -> dict[str, Any] | None:
        """The last event but progress: the answer, for a request answered once."""
        return next((e for _, e in reversed(self.events) if e["type"] != "progress"), None)


@dataclass
class SeenTurn:
    """A turn whose ``user`` event a client saw: what the history must keep of it."""

    tag: str
    text: str
    round: int
    end: dict[str, Any] | None  # its done or error, when one came before the kill
    seen: str  # the reply the client read
    early: str  # what of it the client had read CHECKPOINT_SLACK before the kill
    stored: str | None = None  # the reply stored, once checked


@dataclass
class Ledger:
    """What the clients were told across the rounds, and the violations found."""

    seed: int
    round: int = 0
    turns: dict[tuple[int, int], SeenTurn] = field(default_factory=dict)
    doomed: set[int] = field(default_factory=set)  # a delete was sent
    deleted: set[int] = field(default_factory=set)  # a delete was acknowledged
    kbs: dict[str, str] = field(default_factory=dict)  # "added", "removed" or "unknown"
    refused: list[str] = field(default_factory=list)  # tags of asks refused shutting_down
    stats: collections.Counter[str] = field(default_factory=collections.Counter)
    violations: list[tuple[int, str, str]] = field(default_factory=list)

    def conversations(self) -> list[int]:
        return sorted({cid for cid, _ in self.turns})

    def violation(self, kind: str, message: str) -> None:
        self.violations.append((self.round, kind, message))
        if sum(k == kind for _, k, _ in self.violations) <= PRINTED_PER_KIND:
            print(f"  !! seed {self.seed} round {self.round}: {kind}: {message}"[:400], flush=True)


class Client:
    """A connection of the load: requests sent with our own ids, events read in the background."""

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self.requests: dict[str, Request] = {}
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(DaemonGone, ValueError):  # ValueError: a line the kill cut
            while True:
                event = await self.wire.read()
                if (request := self.requests.get(str(event.get("id")))) is not None:
                    request.events.append((time.monotonic(), event))

    async def send(self, body: dict[str, Any]) -> None:
        rid = f"r{len(self.requests) + 1}"
        self.requests[rid] = Request(body)  # before sending: the answer may come at once
        with contextlib.suppress(DaemonGone):
            await self.wire.send({**body, "id": rid})


# -- a round: the load, the kill, what was acknowledged ---------------------------------------
class Round:
    """One round's random requests, and what their answers add to the ledger."""

    def __init__(self, ledger: Ledger, rng: random.Random, kb_root: Path) -> None:
        self.ledger, self.rng, self.kb_root = ledger, rng, kb_root
        self.busy: set[int] = set()  # conversations asked in this round (another ask is busy)

    def next_request(self) -> dict[str, Any] | None:
        ledger, rng = self.ledger, self.rng
        live = [cid for cid in ledger.conversations() if cid not in ledger.doomed]
        op = rng.choices(list(OPS), list(OPS.values()))[0] if live else "ask"
        cid, kb, title = (rng.choice(live) if live else 0), rng.choice(list(KB_FILES)), f"T{rng.randrange(10**6)}"
        if op == "follow" and cid in self.busy:
            return None
        if op in ("ask", "follow"):
            ledger.stats["asks"] += 1
            self.busy.add(cid)
            text = f"q{ledger.round}x{ledger.stats['asks']} {op} chunks={rng.choice(CHUNKS)}"
            return {"type": "ask", "text": text, **({"conversation": cid} if op == "follow" else {})}
        if op == "delete":
            ledger.doomed.add(cid)
        fields: dict[str, dict[str, Any]] = {
            "settings": {"conversation": cid, "title": title, "kb_injection": rng.choice(KB_INJECTIONS)},
            "cancel": {"conversation": cid}, "delete": {"conversation": cid}, "kb_remove": {"kb": kb},
            "kb_add": {"kb": kb, "paths": [str(self.kb_root / kb)]}, "kb_link": {"kb": kb, "conversation": cid},
        }
        return {"type": op, **fields[op]}

    async def drive(self, client: Client, stop: asyncio.Event) -> None:
        while not stop.is_set() and not client.reader.done():
            if (body := self.next_request()) is not None:
                await client.send(body)
            await asyncio.sleep(self.rng.uniform(0.0, 0.08))

    def digest(self, clients: list[Client], killed_at: float, clean: bool) -> None:
        """Note what the answers acknowledged (``clean``: the daemon had a SIGTERM alone)."""
        requests = [r for c in clients for r in c.requests.values()]
        for request in requests:
            kind, answer = request.body["type"], request.answer()
            if kind == "ask":
                self.note_ask(request, killed_at, clean)
            elif answer is not None and answer["type"] != "error":
                self.ledger.stats[kind] += 1
                if kind == "delete":
                    self.ledger.deleted.add(request.body["conversation"])
        for kb in KB_FILES:  # known when the round sent one add or remove (of two, which came last?)
            sent = [r for r in requests if r.body["type"] in ("kb_add", "kb_remove") and r.body["kb"] == kb]
            answer, kind = (sent[0].answer(), sent[0].body["type"]) if len(sent) == 1 else (None, "")
            done = answer is not None and not answer.get("cancelled") and not answer.get("errors") and (
                answer["type"] == "kb" or (kind == "kb_remove" and answer.get("code") == "not_found"))
            if sent:
                self.ledger.kbs[kb] = ("added" if kind == "kb_add" else "removed") if done else "unknown"

    def note_ask(self, request: Request, killed_at: float, clean: bool) -> None:
        ledger, text = self.ledger, request.body["text"]
        user, end = request.first("user"), request.first("done", "error")
        if user is None:
            if clean and end is None:
                ledger.violation("sigterm-unanswered", f"ask {text!r} got no event before the hang-up")
            elif end is not None and end.get("code") == "shutting_down":
                ledger.refused.append(text.split()[0])
            return
        ledger.stats["asks acknowledged"] += 1
        deltas = [(t, e["text"]) for t, e in request.events if e["type"] == "delta"]
        early = "".join(x for t, x in deltas if t < killed_at - CHECKPOINT_SLACK)
        seen = SeenTurn(text.split()[0], text, ledger.round, end, "".join(x for _, x in deltas), early)
        ledger.turns[(user["conversation"], user["turn"])] = seen
        if clean and end is None:
            ledger.violation("sigterm-unended", f"turn {user['conversation'], user['turn']} got no done or error")


# -- checks through the socket ----------------------------------------------------------------
async def check_socket(wire: Wire, ledger: Ledger) -> None:
    opened: dict[int, dict[str, Any]] = {}
    for cid in ledger.conversations():
        event = await wire.request({"type": "open", "conversation": cid})
        if cid in ledger.deleted and event["type"] != "error":
            ledger.violation("delete-undone", f"conversation {cid} (delete acknowledged) opens")
        elif event["type"] == "conversation":
            opened[cid] = event
    for (cid, turn_no), seen in ledger.turns.items():
        turn = next((t for t in opened.get(cid, {}).get("turns", ()) if t["turn"] == turn_no), None)
        if cid not in ledger.doomed and (turn is None or turn["text"] != seen.text):
            ledger.violation("question-lost", f"turn {(cid, turn_no)} {seen.tag} (round {seen.round}): {turn}")
        elif turn is not None and seen.stored is None:
            check_reply(ledger, (cid, turn_no), seen, turn)
    await check_search(wire, ledger, set(opened))
    await check_kbs(wire, ledger)


def check_reply(ledger: Ledger, key: tuple[int, int], seen: SeenTurn, turn: dict[str, Any]) -> None:
    stored = seen.stored = turn["reply"] or ""
    status, end = turn["status"], seen.end
    related = stored.startswith(seen.seen) or seen.seen.startswith(stored)
    if end is not None and end["type"] == "done":
        ok = stored == end["text"] and status == FINISH_STATUS.get(end["finish_reason"], "complete")
    else:
        ok = related and (status == "error" if end is not None else status in CUT_STATUSES)
    if not ok:
        told = f"{end['type']} {end.get('finish_reason') or end.get('code')}" if end else "no end"
        ledger.violation("reply", f"turn {key} {seen.tag}: the client saw {told} and {len(seen.seen)} characters; "
                         f"stored {status} with {len(stored)}")
    if end is None and len(stored) < len(seen.early):
        ledger.violation("checkpoint-lost", f"turn {key} {seen.tag}: {len(seen.early)} characters seen "
                         f"{CHECKPOINT_SLACK:g} s before the kill, {len(stored)} stored")


async def hits(wire: Wire, query: str) -> set[tuple[int, int, str]]:
    answer = await wire.request({"type": "search", "query": query, "limit": MAX_LIST_LIMIT})
    return {(g["conversation"], h["turn"], h["role"]) for g in answer.get("conversations", ()) for h in g["hits"]}


async def check_search(wire: Wire, ledger: Ledger, opened: set[int]) -> None:
    """This round's questions are found; deleted conversations and refused asks are not."""
    for (cid, turn_no), seen in ledger.turns.items():
        if seen.round == ledger.round and cid in opened and (cid, turn_no, "user") not in await hits(wire, seen.tag):
            ledger.violation("search", f"{seen.tag!r} does not find the question of turn {(cid, turn_no)}")
    tags = {cid: s.tag for (cid, _), s in ledger.turns.items()}
    for cid in sorted(ledger.deleted):
        if any(h[0] == cid for h in await hits(wire, tags[cid])):
            ledger.violation("delete-undone", f"{tags[cid]!r} finds conversation {cid} (delete acknowledged)")
    for tag in ledger.refused:
        if any(role == "user" for _, _, role in await hits(wire, tag)):
            ledger.violation("refused-stored", f"ask {tag} was refused shutting_down, yet stored")
    ledger.refused.clear()


async def check_kbs(wire: Wire, ledger: Ledger) -> None:
    listed = {k["kb"]: k["documents"] for k in (await wire.request({"type": "kb_list"}))["items"]}
    for name, state in ledger.kbs.items():
        if state == "removed" and name in listed:
            ledger.violation("kb-remove-undone", f"{name} (remove acknowledged) lists {listed[name]} documents")
        if state == "added" and listed.get(name) != KB_FILES[name]:
            ledger.violation("kb-add-lost", f"{name} (add of {KB_FILES[name]} files acknowledged): {listed.get(name)}")


# -- checks in SQLite -------------------------------------------------------------------------
def leftovers(conn: sqlite3.Connection) -> list[str]:
    """Background work a kill may cut short, which the next start must finish."""
    removing = len(conn.execute(SELECT_KBS_BEING_REMOVED).fetchall())
    deleted = [cid for (cid,) in conn.execute(SELECT_DELETED)]
    rows = sum(conn.execute(COUNT_FTS_RANGE, conversation_rowid_range(cid)).fetchone()[0] for cid in deleted)
    return [f"{removing} KB(s) half removed"] * bool(removing) + [f"{rows} search rows of deleted conversations"] * bool(rows)


async def settled_copy(db: Path) -> sqlite3.Connection:
    """An in-memory copy of the history (FTS5's integrity-check writes) once start-up has
    finished what a kill cut short, or SETTLE_SECONDS have passed."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as source:
            if not leftovers(source) or time.monotonic() > deadline:
                copy = sqlite3.connect(":memory:")
                source.backup(copy)
                return copy
        await asyncio.sleep(0.1)


def check_store(conn: sqlite3.Connection, ledger: Ledger) -> None:
    for problem in leftovers(conn):
        ledger.violation("leftover", f"{problem} {SETTLE_SECONDS:g} s after the start")
    if (damage := [row[0] for row in conn.execute("PRAGMA integrity_check")]) != ["ok"]:
        ledger.violation("integrity", "; ".join(damage[:5]))
    for statement in FTS_CHECKS:
        try:
            conn.execute(statement)
        except sqlite3.DatabaseError as exc:
            ledger.violation("fts-integrity", f"{statement.split()[2]}: {exc}")
    for cid, turn in conn.execute(SELECT_RUNNING):
        ledger.violation("running", f"turn {(cid, turn)} is stored running after a restart")
    if orphans := conn.execute("PRAGMA foreign_key_check").fetchall():
        ledger.violation("foreign-keys", f"{len(orphans)} rows whose parent is gone, e.g. {orphans[0]}")
    if count := conn.execute(COUNT_MISCOUNTED).fetchone()[0]:
        ledger.violation("kb-chunks", f"{count} KB documents whose chunks are not their count")
    check_fts_rows(conn, ledger)


def check_fts_rows(conn: sqlite3.Connection, ledger: Ledger) -> None:
    """message_fts against what history.fts makes of the stored messages and summaries."""
    live = {cid for (cid,) in conn.execute(SELECT_LIVE)}
    expected = {
        message_rowid(cid, turn, n): (text, role)
        for cid, turn, raw in conn.execute(SELECT_TURNS) if cid in live
        for n, role, text in searchable_messages(load_messages(raw))
    }
    latest = {cid: (through, summary) for cid, through, summary in conn.execute(SELECT_SUMMARIES) if cid in live}
    expected.update((message_rowid(cid, t, SUMMARY_SLOT), (s, SUMMARY_ROLE)) for cid, (t, s) in latest.items())
    indexed = {rowid: (body, role) for rowid, body, role in conn.execute(SELECT_FTS)}
    for rowid in sorted(expected.keys() | indexed.keys()):
        if expected.get(rowid) != indexed.get(rowid):
            where = "conversation {} turn {} message {}".format(*split_rowid(rowid))
            ledger.violation("fts-rows", f"{where}: indexed {indexed.get(rowid)!r:.60}, stored {expected.get(rowid)!r:.60}")


# -- the run ------------------------------------------------------------------------------------
def write_kb_sources(root: Path) -> Path:
    for kb, files in KB_FILES.items():
        (root / kb).mkdir(parents=True)
        for i in range(files):
            words = " ".join(f"k{kb}f{i}w{j}" for j in range(KB_WORDS[kb]))
            paragraphs = "\n\n".join(words[p:p + 800] for p in range(0, len(words), 800))
            (root / kb / f"doc{i}.md").write_text(f"# {kb} document {i}\n\n{paragraphs}\n")
    return root


class Run:
    """The rounds on one daemon: load, a kill, a restart, the checks; the seed picks everything."""

    def __init__(self, args: argparse.Namespace, daemon: Daemon, kb_root: Path) -> None:
        self.args, self.daemon, self.kb_root = args, daemon, kb_root
        self.rng, self.ledger = random.Random(args.seed), Ledger(args.seed)

    async def rounds(self) -> Ledger:
        ledger, started = self.ledger, time.monotonic()
        try:
            await self.restart()
            for ledger.round in range(1, self.args.iterations + 1):
                await self.play_round()
                await self.restart()
                wire = await Wire.open(self.daemon.socket_path, keep=False, timeout=30.0)
                await check_socket(wire, ledger)
                await wire.close()
                with contextlib.closing(await settled_copy(self.daemon.data_dir / "history.db")) as conn:
                    check_store(conn, ledger)
                if ledger.round % 10 == 0:
                    print(f"round {ledger.round}: {ledger.stats['asks']} asks, {len(ledger.violations)} violations, "
                          f"{time.monotonic() - started:.0f} s", flush=True)
        except (DaemonGone, TimeoutError, RuntimeError) as exc:  # it would not start, or not answer
            ledger.violation("unusable", f"{exc}\n{self.daemon.log_tail()}")
        return ledger

    async def play_round(self) -> None:
        game, rng = Round(self.ledger, self.rng, self.kb_root), self.rng
        clients = [Client(await Wire.open(self.daemon.socket_path, keep=False)) for _ in range(rng.randint(1, 3))]
        stop = asyncio.Event()
        workers = [asyncio.ensure_future(game.drive(c, stop)) for c in clients]
        await asyncio.sleep(rng.uniform(0.0, 0.5))
        stop.set()
        if rng.random() < self.args.long_share:
            await asyncio.sleep(rng.uniform(0.5, 3.0))  # the replies stream on alone
        killed_at = time.monotonic()
        kind = await self.stop()
        self.ledger.stats[kind] += 1
        await asyncio.gather(*workers)
        await asyncio.wait([c.reader for c in clients], timeout=5.0)
        for client in clients:
            await client.wire.close()
        game.digest(clients, killed_at, kind == "SIGTERM")

    async def stop(self) -> str:
        """Kill or stop the daemon as the mix says; the kind of stop."""
        proc, kind, rng = self.daemon.proc, "SIGKILL", self.rng
        assert proc is not None
        if rng.random() >= self.args.term_share:
            proc.kill()
        else:
            proc.terminate()
            kind = "SIGTERM"
            if rng.random() < self.args.double_share:
                await asyncio.sleep(rng.uniform(0.0, GRACE + 0.3))
                proc.kill()  # nothing once it has exited
                kind = "SIGTERM, then SIGKILL"
        try:
            code = await asyncio.to_thread(proc.wait, EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.ledger.violation("sigterm-hang", f"the daemon did not exit within {EXIT_TIMEOUT:g} s of {kind}")
            proc.kill()
            code = proc.wait()
        if kind == "SIGTERM" and code != 0:
            self.ledger.violation("sigterm-exit", f"exit status {code} on SIGTERM")
        self.daemon.stop()  # it has exited: this closes its notify socket
        return kind

    async def restart(self) -> None:
        """Start the daemon again, now and then killing one start at a random moment first."""
        daemon, rng = self.daemon, self.rng
        if rng.random() < self.args.startup_kill_share:
            starting = asyncio.ensure_future(asyncio.to_thread(daemon.start))
            await asyncio.sleep(rng.uniform(0.02, 0.4))
            self.ledger.stats["SIGKILL just after start-up" if starting.done() else "SIGKILL during start-up"] += 1
            if daemon.proc is not None:
                daemon.proc.kill()
            with contextlib.suppress(RuntimeError):  # "the daemon exited with -9"
                await starting
            daemon.stop()
        daemon.settings["ASSISTANT_AUTO_TITLE"] = rng.choice(["true", "false"])
        await asyncio.to_thread(daemon.start)


def report(ledger: Ledger, took: float) -> None:
    stats = ledger.stats
    kills = sorted(k for k in stats if k.startswith("SIG"))
    print(f"kills: {sum(stats[k] for k in kills)} ({', '.join(f'{k} {stats[k]}' for k in kills)})")
    print(f"asks: {stats['asks']}, acknowledged (a user event) {stats['asks acknowledged']}, "
          f"replies checked {sum(s.stored is not None for s in ledger.turns.values())}")
    print(f"other requests acknowledged: {', '.join(f'{k} {stats[k]}' for k in ACKNOWLEDGED)}")
    print(f"violations: {len(ledger.violations)}")
    for kind, count in collections.Counter(k for _, k, _ in ledger.violations).items():
        first = next(v for v in ledger.violations if v[1] == kind)
        print(f"  {kind}: {count}, first in round {first[0]} (seed {ledger.seed}): {first[2]}"[:400])
    print(f"result: {verdict(not ledger.violations)} (seed {ledger.seed}, {took:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1, help="seeds the choice of requests and kills (default 1)")
    parser.add_argument("--iterations", type=int, default=100, help="rounds, each ending in a kill (default 100)")
    parser.add_argument("--embed", action="store_true", help="configure an embedding model: KB adds embed")
    parser.add_argument("--term-share", type=float, default=0.25, help="share of the kills that are SIGTERM (0.25)")
    parser.add_argument("--double-share", type=float, default=0.15, help="share of SIGTERMs then SIGKILLed (0.15)")
    parser.add_argument("--startup-kill-share", type=float, default=0.15, help="share of restarts killed first (0.15)")
    parser.add_argument("--long-share", type=float, default=0.3, help="share of rounds streaming on 0.5-3 s (0.3)")
    parser.add_argument("--delay", type=float, default=0.02, help="seconds between a reply's words (0.02)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (daemon.log, data/)")
    args = parser.parse_args(argv)
    terminate_on_sigterm()
    header("crash_audit: the daemon killed at random moments under load; what it kept, checked after each restart")
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(router_process(_slow_router, args.delay, EMBED_DELAY if args.embed else 0.0))
        work = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}crash-")) if args.keep else stack.enter_context(temp_dir("crash"))
        settings = {"ASSISTANT_SHUTDOWN_GRACE": str(GRACE)} | ({"ASSISTANT_EMBEDDING_MODEL": "fake-embed"} if args.embed else {})
        daemon = Daemon(work, url, settings=settings)
        stack.callback(daemon.stop)
        ledger = asyncio.run(Run(args, daemon, write_kb_sources(work / "kbs")).rounds())
    report(ledger, time.monotonic() - started)
    if args.keep:
        print(f"kept: {work}")
    return 1 if ledger.violations else 0


if __name__ == "__main__":
    sys.exit(main())
