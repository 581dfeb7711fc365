"""Scripted conversations that need the conversation's past, a KB or a tool, through the socket.

One function per kind of recall (issues 33 and 49): each starts a fresh conversation, plants
a needle, asks for it back, and returns a ``Run``: the answer, whether it holds the needle,
the tools the model called, what the daemon recalled before the question, and the time each
turn took. The e2e tests (``tests/e2e_tools/``) run each once and assert;
``bench/bench_recall.py`` runs each many times and counts. ``n`` varies the needle and the
filler so runs differ. The recall kinds also run with ``recall_injection`` set otherwise (``mode``,
"tool_only" for the bench's plain twin: the same past, tools and question, no passage).

The long past is not generated turn by turn by the model: the earlier turns are stored
through the daemon's own store (``seed``: imported turns, then a compaction whose summary
we write), as the daemon would have stored them. So a scenario costs at most three model
requests: the file turn, a warm-up, the question.

    recall     a fact said 40 turns back, folded away by a compaction: recalled before the question
    file       a PDF attached in the first turn, folded away: a detail of its page 3, recalled
    followup   a fact folded away, asked for in three words that refer back to the last turn
    kb         a knowledge-base fact with kb_injection tool_only: kb_search
    mcp        a hosted MCP tool (tests/mcpservers.py "good": add)
    none       a question that needs nothing: no tool, no passage
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client import Wire, of_type, reply_text
from history import HistoryStore
from kbinject import recall_label
from selfcheck.samples import make_pdf

ROOT = Path(__file__).resolve().parents[2]
MCP_SERVER = "calc"  # tests/mcpservers.py "good", hosted under this name
# what the daemon is told: a 2,048-token context (the server has 4,096), so a conversation is
# compacted within a few dozen short turns; replies capped so a filler answer stays short
DAEMON_ENV = {
    "ASSISTANT_AUTO_TITLE": "false",
    "ASSISTANT_SHUTDOWN_GRACE": "0.5",
    "ASSISTANT_CTX_MAX": "2048",
    "ASSISTANT_MAX_REPLY_TOKENS": "96",
}
TURNS_BACK = 40  # the needle is said (or attached) this many turns before it is asked for
KEPT_TURNS = 2  # the turns the seeded compaction leaves in the prompt
SUMMARY = "The user listed where some of their things are kept, each in a numbered box."
# the first turn of a conversation whose setting must be made before the question; not "reply
# with just: hi", after which the model answered "The office wifi password is [password]."
# without calling kb_search (measured: with that turn before it, 0 of 3; without, 2 of 2)
WARM_UP = "Hello! I have a question for you in a moment."
COLOURS = "red blue green yellow white black orange purple grey brown".split()
THINGS = "pencil stapler mug lamp notebook charger scarf kettle ruler plant".split()


@dataclass
class Run:
    """One scripted conversation: what was asked back, what came, and what it took."""

    kind: str
    needle: str
    answer: str = ""
    tools: list[str] = field(default_factory=list)  # the tools called in the asking turn
    recalled: list[str] = field(default_factory=list)  # the asking turn's recalled sources ("turn 1")
    turn_seconds: list[float] = field(default_factory=list)  # every turn the model answered
    asking_seconds: float = 0.0  # the turn that asked for the needle
    asking_first_token: float | None = None  # seconds to its first delta or tool call (None: neither came)
    mode: str = "auto"  # the conversation's recall_injection
    compacted: bool = False  # the needle was folded away before it was asked for
    error: str | None = None

    @property
    def found(self) -> bool:
        return self.error is None and self.needle.lower() in self.answer.lower()

    def to_json(self) -> dict[str, Any]:
        first_token = None if self.asking_first_token is None else round(self.asking_first_token, 2)
        return {"kind": self.kind, "needle": self.needle, "found": self.found, "answer": self.answer,
                "tools": self.tools, "recalled": self.recalled, "turns": len(self.turn_seconds),
                "asking_seconds": round(self.asking_seconds, 2), "asking_first_token": first_token,
                "mode": self.mode, "compacted": self.compacted, "error": self.error}


class Talk:
    """A conversation on the daemon, timed turn by turn."""

    def __init__(self, wire: Wire, run: Run) -> None:
        self.wire = wire
        self.run = run
        self.cid: int | None = None
        self.first_token: float | None = None  # the last turn's seconds to its first delta or tool call

    async def ask(self, text: str, **fields: Any) -> list[dict[str, Any]]:
        started = time.monotonic()
        # each run is its own memory (incognito): the runs repeat their wordings with other
        # needles, and another run's fact, recalled across conversations, is not this one's
        where = {"conversation": self.cid} if self.cid is not None else {"memory": "off"}
        rid = await self.wire.send({"type": "ask", "text": text, **where, **fields})
        events: list[dict[str, Any]] = []
        self.first_token = None
        async for event in self.wire.stream(rid):
            events.append(event)
            if event["type"] in ("delta", "tool") and self.first_token is None:
                self.first_token = time.monotonic() - started
            if event["type"] in ("done", "error"):
                break
        self.run.turn_seconds.append(time.monotonic() - started)
        users = of_type(events, "user")
        if users:
            self.cid = users[0]["conversation"]
        if any(e.get("stage") == "compacting" for e in of_type(events, "progress")):
            self.run.compacted = True
        if events[-1]["type"] == "error":
            raise RuntimeError(f"turn failed: {events[-1]['code']}: {events[-1]['message']}")
        return events

    async def asking(self, text: str, **fields: Any) -> None:
        events = await self.ask(text, **fields)
        self.run.asking_seconds = self.run.turn_seconds[-1]
        self.run.asking_first_token = self.first_token
        self.run.tools = [t["name"] for t in of_type(events, "tool")]
        self.run.recalled = [label(source) for e in of_type(events, "progress") if e["stage"] == "recall"
                             for source in e["sources"]]
        self.run.answer = reply_text(events)


def label(source: dict[str, Any]) -> str:
    """A recalled source in a few words, as the CLI shows it: "turn 1", "report.pdf p3"."""
    return recall_label(source)


def fillers(rng: random.Random, count: int, first: int = 1) -> list[tuple[str, str]]:
    """Short exchanges of nothing much, as a long conversation holds."""
    turns = []
    for i in range(first, first + count):
        colour, thing, box = rng.choice(COLOURS), rng.choice(THINGS), rng.randint(1, 99)
        turns.append((f"Note {i}: the {colour} {thing} is in box {box}.", f"Noted: the {colour} {thing}, box {box}."))
    return turns


def seed(db: Path, turns: list[tuple[str, str]], cid: int | None = None, run: Run | None = None) -> int:
    """Store ``turns`` as the daemon would have (a new conversation, or after ``cid``'s turns), then a
    compaction folding all but the last KEPT_TURNS: the past a scenario needs, made without the model.
    A new conversation is incognito, as Talk.ask's are, with ``run``'s ``recall_injection``."""
    with HistoryStore(db) as store:
        if cid is None:
            cid = store.import_conversation(turns, f"seed-{time.monotonic_ns()}", title="Seeded", model=None,
                                            system_prompt=None).id
            settings = {"memory": "off", **({"recall_injection": run.mode} if run and run.mode != "auto" else {})}
            store.update_conversation(cid, settings=settings)
            last = len(turns)
        else:
            last = store.add_imported_turns(cid, turns)
        store.add_compaction(cid, last - KEPT_TURNS, SUMMARY)
    if run is not None:
        run.compacted = True
    return cid


async def recall(wire: Wire, n: int, workdir: Path, db: Path, mode: str = "auto") -> Run:
    rng = random.Random(n)
    bay = f"{rng.randint(100, 999)}"
    talk = Talk(wire, Run("recall", bay, mode=mode))
    # not a locker code: asked for one after a compaction, the model answered "I'm sorry, but I
    # can't assist with that." (issue 33's run)
    said = (f"Remember this: my bicycle is parked in bay {bay}.", "Noted.")
    talk.cid = seed(db, [said, *fillers(rng, TURNS_BACK)], run=talk.run)
    await talk.asking("In which bay did I park my bicycle?")
    return talk.run


async def settings(wire: Wire, fields: dict[str, Any]) -> None:
    answer = await wire.request({"type": "settings", **fields})
    if answer["type"] == "error":
        raise RuntimeError(f"settings failed: {answer}")


def report_pages(needle: str, rng: random.Random) -> list[str]:
    """A dull four-page report with the needle on page 3."""
    def lines(page: int) -> str:
        return "\n".join(f"Section {page}.{k}: the {rng.choice(COLOURS)} {rng.choice(THINGS)} order was checked."
                         for k in range(1, 9))
    pages = [f"Quarterly order report, page {page}\n{lines(page)}" for page in range(1, 5)]
    pages[2] += f"\nThe warranty reference for the order is {needle}."
    return pages


async def file(wire: Wire, n: int, workdir: Path, db: Path, mode: str = "auto") -> Run:
    rng = random.Random(1000 + n)
    needle = f"WR-{rng.randint(10000, 99999)}"
    folder = workdir if mode == "auto" else workdir / mode  # the twin's file has the same name
    folder.mkdir(exist_ok=True)
    report = make_pdf(folder / f"report-{n}.pdf", report_pages(needle, rng))
    talk = Talk(wire, Run("file", needle, mode=mode))
    await talk.ask("Here is my order report. Just say OK.", files=[str(report)])
    assert talk.cid is not None
    if mode != "auto":
        await settings(wire, {"conversation": talk.cid, "recall_injection": mode})
    seed(db, fillers(rng, TURNS_BACK), talk.cid, talk.run)
    await talk.asking("What is the warranty reference in the order report I attached?")
    return talk.run


async def followup(wire: Wire, n: int, workdir: Path, db: Path, mode: str = "auto") -> Run:
    rng = random.Random(5000 + n)
    spot = f"{rng.randint(100, 999)}"
    talk = Talk(wire, Run("followup", spot, mode=mode))
    said = (f"My parking spot at work is number {spot}.", "Noted.")
    last = [("I just arrived at the office car park.", "Good morning! Head to your parking spot.")]
    talk.cid = seed(db, [said, *fillers(rng, TURNS_BACK), *last], run=talk.run)
    await talk.asking("What number again?")
    return talk.run


async def kb(wire: Wire, n: int, workdir: Path, db: Path) -> Run:
    rng = random.Random(2000 + n)
    needle = f"heron-{rng.randint(1000, 9999)}"
    folder = workdir / f"kb-{n}"
    folder.mkdir()
    (folder / "office.md").write_text(f"# Office\n\nThe office wifi password is {needle}.\nThe printer is on floor 2.\n")
    (folder / "garden.md").write_text("# Garden\n\nWater the tomatoes every morning in summer.\n")
    (folder / "car.md").write_text("# Car\n\nThe car needs new tyres before winter.\n")
    name = f"notes{n}"
    rid = await wire.send({"type": "kb_add", "kb": name, "paths": [str(folder)]})
    added = (await wire.until(rid, ("kb", "error")))[-1]
    if added["type"] != "kb":
        raise RuntimeError(f"kb_add failed: {added}")
    talk = Talk(wire, Run("kb", needle))
    await talk.ask(WARM_UP)
    for request in ({"type": "kb_link", "kb": name, "conversation": talk.cid},
                    {"type": "settings", "conversation": talk.cid, "kb_injection": "tool_only"}):
        answer = await wire.request(request)
        if answer["type"] == "error":
            raise RuntimeError(f"{request['type']} failed: {answer}")
    await talk.asking("What is the office wifi password? Look it up in my knowledge base.")
    return talk.run


async def mcp(wire: Wire, n: int, workdir: Path, db: Path) -> Run:
    rng = random.Random(3000 + n)
    a, b = rng.randint(1000, 4999), rng.randint(1000, 4999)
    talk = Talk(wire, Run("mcp", str(a + b)))
    await talk.ask(WARM_UP)
    answer = await wire.request({"type": "settings", "conversation": talk.cid, "mcp_servers": [MCP_SERVER]})
    if answer["type"] == "error":
        raise RuntimeError(f"settings failed: {answer}")
    # asked this way or "use the calc__add tool to ...", the model wrote the call as unfenced JSON
    # text, which llama-server does not read as a call (2 of 2, bench/RESULTS.md)
    await talk.asking(f"What is {a} plus {b}? Use the add tool.")
    return talk.run


async def none(wire: Wire, n: int, workdir: Path, db: Path) -> Run:
    rng = random.Random(4000 + n)
    a, b = rng.randint(11, 19), rng.randint(11, 19)
    talk = Talk(wire, Run("none", str(a * b)))
    await talk.asking(f"What is {a} times {b}?")
    return talk.run


SCENARIOS: dict[str, Callable[[Wire, int, Path, Path], Awaitable[Run]]] = {
    "recall": recall, "file": file, "followup": followup, "kb": kb, "mcp": mcp, "none": none,
}
# the recall kinds again, their conversation's recall_injection set to a mode (the bench's twin)
RECALL_TWINS: dict[str, Callable[[Wire, int, Path, Path, str], Awaitable[Run]]] = {
    "recall": recall, "file": file, "followup": followup,
}
EXPECTED_TOOL = {"kb": "kb_search", "mcp": f"{MCP_SERVER}__add", "none": None}  # the tool kinds
# the recall kinds: what the daemon must have recalled before the question (any tool may be called)
EXPECTED_RECALL = {"recall": "turn 1", "file": " p3", "followup": "turn 1"}  # a recalled label ends so


def mcp_config_text() -> str:
    """A config.toml hosting tests/mcpservers.py "good" as MCP_SERVER, used by no conversation
    unless its settings name it (so the other scenarios are offered our tools alone)."""
    return (
        "[mcp]\ndefault = []\n\n"
        f"[mcp.servers.{MCP_SERVER}]\ncommand = {json.dumps(sys.executable)}\n"
        f"args = [{json.dumps(str(ROOT / 'tests' / 'mcpservers.py'))}, \"good\"]\n"
        'approval = "auto"\n'  # its add only computes: no person is asked in a measured run
    )


def mcp_config(config_dir: Path) -> Path:
    """``mcp_config_text`` as ``config_dir``/assistant/config.toml (``XDG_CONFIG_HOME``'s place)."""
    path = config_dir / "assistant" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(mcp_config_text())
    return path
