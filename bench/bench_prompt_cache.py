#!/usr/bin/env python3
"""How much of each prompt llama-server's prompt cache spares, turn by turn, against the physical limit.

A real llama-server with SmolLM2 135M (``scripts/llama.py``; built once by ``make e2e``
or ``python3 scripts/llama.py install``) on loopback with one slot (``-np 1``), so the
prompt cache is that slot's; or ``--server URL``, one already running.  The daemon
(``python assistant.py``, a temp data dir and socket, model-made titles on) talks to
it through a recording proxy (``recording_proxy.py``) that relays the bytes as they
are and notes every chat request's body and the server's ``timings`` of its answer.
Scenarios, each a fresh daemon and one conversation of ``--turns`` one-line questions:

- (a) ``plain``: no knowledge base;
- (b) ``kb``: a keyword knowledge base linked (``kb_add`` of four small notes whose
  words the questions share, ``kb_link``; ``kb_injection`` is ``auto``), so passages
  are injected into every turn's prompt;
- (c) ``compact``: no knowledge base, the daemon told ``ctx_max`` (``--compact-ctx``)
  so that it compacts within a dozen turns; the server's own context stays large.

Per request: ``cache_n`` (prompt tokens the server took from its cache), ``prompt_n``
(those it processed), the prompt time, and the physical limit: the tokens of what
follows the previous answer in that prompt plus the previous exchange, i.e.
tokens(render(prompt)) minus the tokens it shares with render(the prompt up to, not
including, the previous user message), rendered by the server's ``/apply-template``
and counted by its ``/tokenize``.  A turn is within its limit when ``prompt_n`` is no
more than that.  ``shared`` is how many tokens the prompt has in common with the
previous chat prompt followed by its reply's text tokenized again: what a cache of
the previous turn could give if the model's sampled tokens are those its text
tokenizes to (when they are not, ``cache_n`` stops short of ``shared``).  Title and
summary requests (not streamed) are rows of their own.  Turns from 3 on count in the
summary line, except a turn that compacted (its prompt is new).  Not part of ``make
bench``: it needs the compiled server and takes about 15 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib import (
    ROOT,
    Daemon,
    answer,
    header,
    open_client,
    temp_dir,
    terminate_on_sigterm,
)
from recording_proxy import Exchange, RecordingProxy, listening_socket

from client import Wire

sys.path.insert(0, str(ROOT))
from tests.e2e.realserver import get, installed_or_skip_reason, llama, post  # noqa: E402

SERVER_CTX = 8192  # as make demo's llama-server is meant to run
REPLY_CAP = 512  # -n, as make demo
SEED = 42  # the server's sampling seed: the same replies to the same prompts
LOG_VERBOSITY = 4  # the server's log then shows its prompt-cache decisions (saved, restored, f_keep, f_sim)
# what the daemon is told the context is in scenario (c): it compacts every few turns even when the
# model answers in a sentence or two (with 4,096 a llama.cpp build whose SmolLM2 answered shortly
# never compacted in twelve turns)
COMPACT_CTX = 1024
TITLE_WAIT = 60.0  # seconds for the title request the daemon sends after the first reply
IDLE_WAIT = 120.0  # seconds for the server to answer everything of a turn
RUN_TIMEOUT = 1800.0  # one scenario, whatever --turns says
FIRST_COUNTED_TURN = 3  # turn 1 has nothing to reuse, turn 2 follows the title request
KB_NAME = "house"

QUESTIONS = (
    "How often are the tomatoes in the garden watered?",
    "What else grows in the garden besides tomatoes?",
    "When is the compost heap in the garden turned?",
    "How are slugs kept off the beans in the garden?",
    "How often is the bicycle chain oiled?",
    "What pressure do the bicycle tyres need?",
    "When were the bicycle brake pads changed?",
    "When is the kitchen oven cleaned?",
    "Which flour goes into the bread baked in the kitchen?",
    "How is the sourdough starter in the kitchen fed?",
    "What filament does the workshop printer use?",
    "When is the workshop door code changed?",
)
KB_NOTES = {
    "garden.txt": (
        "Garden notes. The vegetable garden behind the house grows tomatoes, runner beans, "
        "courgettes and basil. The tomatoes are watered every Tuesday and Friday at dawn, never "
        "in the afternoon sun. The compost heap in the garden is turned on the first Saturday of "
        "each month. Slugs are kept off the beans with copper tape around the beds."
    ),
    "bicycle.txt": (
        "Bicycle notes. The chain of the blue bicycle is oiled every two hundred kilometres with "
        "dry lube. The bicycle tyres are pumped to 4.5 bar at the front and 5 bar at the back. "
        "The brake pads were changed in March; the next check of the brakes is in September."
    ),
    "kitchen.txt": (
        "Kitchen notes. The kitchen oven is cleaned on the last Sunday of each month. Bread is "
        "baked on Saturday mornings with rye flour and a sourdough starter called Bertha. The "
        "starter is fed every evening with fifty grams of flour and fifty grams of water."
    ),
    "workshop.txt": (
        "Workshop notes. The workshop printer uses green PLA filament at 210 degrees, and its bed "
        "is levelled before every long print. The saw blades are sharpened every spring, and the "
        "workshop door code is changed each January."
    ),
}


@dataclass(frozen=True)
class Scenario:
    """One conversation to run: with a knowledge base or not, with the daemon's context made small or not."""

    name: str
    title: str
    kb: bool = False
    compact: bool = False


SCENARIOS = (
    Scenario("plain", "(a) one conversation, no knowledge base"),
    Scenario("kb", "(b) the same, a keyword knowledge base linked (passages injected every turn)", kb=True),
    Scenario("compact", "(c) the same, no knowledge base, a small ctx_max for the daemon so it compacts", compact=True),
)


@dataclass
class Turn:
    """What the daemon said of one turn: whether it compacted, its knowledge-base progress, its ``done``."""

    number: int
    compacted: bool = False
    kb: str = ""
    done: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    """One request to the server, as the table shows it."""

    turn: int
    kind: str  # "chat", "title" or "summary"
    exchange: Exchange
    rendered: int | None = None  # tokens of the rendered prompt, by /tokenize
    limit: int | None = None
    shared: int | None = None
    exempt: bool = False
    notes: list[str] = field(default_factory=list)

    def timing(self, key: str) -> float | None:
        timings = self.exchange.timings or {}
        value = timings.get(key)
        return float(value) if isinstance(value, (int, float)) else None

    @property
    def total(self) -> int | None:
        cache, prompt = self.timing("cache_n"), self.timing("prompt_n")
        return int(cache + prompt) if cache is not None and prompt is not None else None

    @property
    def reuse(self) -> float | None:
        cache, total = self.timing("cache_n"), self.total
        return 100.0 * cache / total if cache is not None and total else None

    @property
    def within(self) -> bool | None:
        prompt = self.timing("prompt_n")
        return prompt <= self.limit if prompt is not None and self.limit is not None else None


# -- talking to the daemon -------------------------------------------------------------------


async def add_knowledge(client: Wire, folder: Path) -> None:
    folder.mkdir()
    for name, text in KB_NOTES.items():
        (folder / name).write_text(text + "\n")
    rid = await client.send({"type": "kb_add", "kb": KB_NAME, "paths": [str(folder)]})
    added = await answer(client, rid, ("kb",))
    if added["documents"] != len(KB_NOTES) or not added["chunks"]:
        raise RuntimeError(f"kb_add did not take the notes: {added}")
    await answer(client, await client.send({"type": "kb_link", "kb": KB_NAME}), ("kb",))


async def ask(client: Wire, number: int, text: str, conversation: int | None) -> Turn:
    request: dict[str, Any] = {"type": "ask", "text": text}
    if conversation is not None:
        request["conversation"] = conversation
    rid = await client.send(request)
    turn = Turn(number)
    while True:
        event = await client.read()
        if event.get("id") != rid:
            continue
        if event["type"] == "progress" and event.get("stage") == "compacting":
            turn.compacted = True
        elif event["type"] == "progress" and event.get("stage") == "kb":
            turn.kb = str(event.get("detail", ""))
        elif event["type"] == "done":
            turn.done = event
            return turn
        elif event["type"] == "error":
            raise RuntimeError(f"turn {number} failed: {event.get('code')}: {event.get('message')}")


async def converse(client: Wire, proxy: RecordingProxy, turns: int) -> list[Turn]:
    """One conversation; after each turn, wait until the server has answered all it was asked."""
    done: list[Turn] = []
    conversation: int | None = None
    for number in range(1, turns + 1):
        proxy.label = (number, "turn")
        turn = await ask(client, number, QUESTIONS[(number - 1) % len(QUESTIONS)], conversation)
        conversation = turn.done["conversation"]
        proxy.label = (number, "after")
        if number == 1:
            titled = await proxy.wait_for(lambda: any(not e.streamed for e in proxy.exchanges), TITLE_WAIT)
            if not titled:
                print(f"note: no title request within {TITLE_WAIT:g} s of the first reply")
        if not await proxy.wait_for(lambda: proxy.in_flight == 0, IDLE_WAIT):
            raise RuntimeError(f"the server still had requests open {IDLE_WAIT:g} s after turn {number}")
        done.append(turn)
    return done


async def run_conversation(
    scenario: Scenario, base: str, listener: socket.socket, daemon: Daemon, turns: int
) -> tuple[list[Exchange], list[Turn]]:
    async with RecordingProxy(base, sock=listener) as proxy:
        client = await open_client(daemon.socket_path)
        try:
            async with asyncio.timeout(RUN_TIMEOUT):
                if scenario.kb:
                    await add_knowledge(client, daemon.workdir / "notes")
                done = await converse(client, proxy, turns)
        finally:
            await client.close()
    return proxy.exchanges, done


# -- the physical limit ------------------------------------------------------------------------


class Tokens:
    """The server's own chat template and tokenizer (``/apply-template``, ``/tokenize``), cached."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.available = True
        self._cache: dict[str, list[int]] = {}

    def of_prompt(self, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> list[int] | None:
        body: dict[str, Any] = {"messages": messages, **({"tools": tools} if tools else {})}
        status, answer = post(self.base + "/apply-template", body)
        if status == 404:
            self.available = False
        if status != 200 or not isinstance(answer, dict) or "prompt" not in answer:
            return None
        return self.of_text(answer["prompt"], special=True)

    def of_text(self, text: str, special: bool) -> list[int] | None:
        key = f"{special}:{text}"
        if key not in self._cache:
            status, answer = post(self.base + "/tokenize", {"content": text, "add_special": special, "parse_special": True})
            if status != 200 or not isinstance(answer, dict):
                return None
            self._cache[key] = [t if isinstance(t, int) else t["id"] for t in answer["tokens"]]
        return self._cache[key]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def previous_user_index(messages: list[dict[str, Any]]) -> int | None:
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    return users[-2] if len(users) >= 2 else None


def measure_chat(row: Row, tokens: Tokens, previous: tuple[list[int], str] | None) -> list[int] | None:
    """Fill the row's rendered size, limit and shared prefix; returns the prompt's tokens."""
    messages = row.exchange.request.get("messages") or []
    tools = row.exchange.request.get("tools")
    full = tokens.of_prompt(messages, tools)
    if full is None:
        return None
    row.rendered = len(full)
    cut = previous_user_index(messages)
    prefix = tokens.of_prompt(messages[:cut], tools) if cut is not None else []
    if prefix is not None:
        row.limit = len(full) - common_prefix(full, prefix)
    if previous is not None:
        reply = tokens.of_text(previous[1], special=False) or []
        row.shared = common_prefix(full, previous[0] + reply)
    return full


def build_rows(exchanges: list[Exchange], turns: list[Turn], tokens: Tokens) -> list[Row]:
    compacted = {t.number for t in turns if t.compacted}
    kb = {t.number: t.kb for t in turns}
    rows: list[Row] = []
    previous: tuple[list[int], str] | None = None
    for exchange in exchanges:
        number, phase = exchange.label or (0, "setup")
        kind = "chat" if exchange.streamed else ("summary" if phase == "turn" else "title")
        row = Row(number, kind, exchange)
        if kind == "chat":
            full = measure_chat(row, tokens, previous)
            previous = (full, exchange.reply) if full is not None else None
            row.exempt = number in compacted
            if row.exempt:
                row.notes.append("compacted: exempt")
            if kb.get(number):
                row.notes.append(f"kb: {kb[number]}")
        else:
            full = tokens.of_prompt(exchange.request.get("messages") or [])
            row.rendered = len(full) if full is not None else None
        if row.rendered is not None and row.total is not None and row.rendered != row.total:
            row.notes.append(f"rendered {row.rendered}")
        if exchange.error or exchange.status != 200:
            row.notes.append(f"HTTP {exchange.status}: {exchange.error}"[:80])
        rows.append(row)
    return rows


# -- the report ------------------------------------------------------------------------------------

HEAD = f"{'turn':>4} {'kind':<7} {'msgs':>4} {'tokens':>6} {'cache_n':>7} {'prompt_n':>8} {'prompt ms':>9} " \
       f"{'limit':>6} {'<=limit':>7} {'reuse':>6} {'shared':>6} {'reply':>5}  note"


def cell(value: float | None, spec: str = "d") -> str:
    return "-" if value is None else format(int(value) if spec == "d" else value, spec)


def print_row(row: Row) -> None:
    within = {None: "-", True: "yes", False: "NO"}[row.within] if row.kind == "chat" else ""
    reuse = f"{row.reuse:.1f}%" if row.reuse is not None else "-"
    print(
        f"{row.turn:>4} {row.kind:<7} {len(row.exchange.request.get('messages') or []):>4} {cell(row.total):>6} "
        f"{cell(row.timing('cache_n')):>7} {cell(row.timing('prompt_n')):>8} {cell(row.timing('prompt_ms'), '.1f'):>9} "
        f"{cell(row.limit) if row.kind == 'chat' else '':>6} {within:>7} {reuse:>6} "
        f"{cell(row.shared) if row.kind == 'chat' else '':>6} {cell(row.timing('predicted_n')):>5}  {'; '.join(row.notes)}"
    )


def summary(name: str, rows: list[Row]) -> str:
    chats = [r for r in rows if r.kind == "chat" and r.turn >= FIRST_COUNTED_TURN]
    counted = [r for r in chats if not r.exempt and r.within is not None]
    exempt = len([r for r in chats if r.exempt])
    if not counted:
        return f"summary {name}: no turn from {FIRST_COUNTED_TURN} on with timings and a limit to count"
    within = sum(1 for r in counted if r.within)
    reuse = statistics.median(r.reuse or 0.0 for r in counted)
    processed = sum(int(r.timing("prompt_n") or 0) for r in counted)
    limit = sum(r.limit or 0 for r in counted)
    spent = sum(r.timing("prompt_ms") or 0.0 for r in counted)
    last = max(r.turn for r in chats)
    return (
        f"summary {name}: turns {FIRST_COUNTED_TURN}-{last}: {within} of {len(counted)} processed <= their limit"
        f"{f' ({exempt} exempt: compacted)' if exempt else ''}; median reuse {reuse:.1f}%; "
        f"prompt tokens processed {processed:,} (at the limit: {limit:,}); prompt time {spent:,.0f} ms"
    )


def report(scenario: Scenario, rows: list[Row], turns: list[Turn]) -> str:
    ctx = turns[-1].done.get("ctx_max") if turns else None
    cache_prompt = {str(r.exchange.request.get("cache_prompt", "absent")) for r in rows}
    print(f"-- {scenario.title}; the daemon's ctx_max {ctx}; cache_prompt in its requests: {', '.join(sorted(cache_prompt))}")
    print(HEAD)
    for row in rows:
        print_row(row)
    line = summary(scenario.name, rows)
    if scenario.compact and turns and not any(t.compacted for t in turns):
        line += f"; NO compaction in {len(turns)} turns: give --compact-ctx less than {ctx}"
    print(line)
    print(flush=True)
    return line


# -- the server --------------------------------------------------------------------------------------


def describe_server(base: str) -> None:
    status, props = get(base + "/props")
    if status != 200 or not isinstance(props, dict):
        print(f"server:  {base} (no /props: HTTP {status})")
        return
    settings = props.get("default_generation_settings") or {}
    print(
        f"server:  {base}, {props.get('build_info', '?')}, slots {props.get('total_slots', '?')}, "
        f"n_ctx {settings.get('n_ctx', '?')}; model {str(props.get('model_path', '?')).rsplit('/', 1)[-1]}"
    )
    if props.get("total_slots") not in (1, None):
        print("note: the server has more than one slot; a turn may land on a slot that cached something else")


def start_server(args: argparse.Namespace, stack: contextlib.ExitStack) -> str | None:
    """The base URL of the server to use (started here unless --server); None if none can be."""
    if args.server:
        base = str(args.server).rstrip("/").removesuffix("/v1")
        try:
            status, _ = get(base + "/health")
            problem = f"HTTP {status}"
        except OSError as exc:
            status, problem = 0, str(exc)
        if status != 200:
            print(f"cannot run: {base}/health: {problem}; is llama-server running there? (or leave --server out)")
            return None
        return base
    state, reason = installed_or_skip_reason()
    if state is None:
        print(f"cannot run: {reason}")
        return None
    extra = (
        "--alias", llama.ALIAS, "-c", str(args.ctx), "-np", "1", "-n", str(args.max_tokens), "--seed", str(SEED),
        "-lv", str(LOG_VERBOSITY),
    )
    print(f"starting: {Path(state['server']).name} {' '.join(extra)} (log {llama.CACHE / 'bench-prompt-cache.log'})")
    server = stack.enter_context(llama.running_server(state, extra=extra, log=llama.CACHE / "bench-prompt-cache.log"))
    return str(server.url)


def run_scenario(scenario: Scenario, base: str, args: argparse.Namespace) -> str:
    extra_env = {"ASSISTANT_CTX_MAX": str(args.compact_ctx)} if scenario.compact else {}
    with temp_dir("pcache") as work, contextlib.closing(listening_socket()) as listener:
        # the proxy's port is bound first, so the daemon can start from this (the main) thread:
        # its PR_SET_PDEATHSIG follows the thread that started it, not the process
        proxy_url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        # titles on: the title request is part of what is measured
        daemon = Daemon(work, proxy_url, settings={"ASSISTANT_AUTO_TITLE": "true", **extra_env})
        try:
            daemon.start()
            exchanges, turns = asyncio.run(run_conversation(scenario, base, listener, daemon, args.turns))
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise RuntimeError(f"{exc}\nthe daemon's log ends:\n{daemon.log_tail()}") from exc
        finally:
            daemon.stop()
        tokens = Tokens(base)
        rows = build_rows(exchanges, turns, tokens)
        if not tokens.available:
            print("note: the server has no /apply-template: no limits")
        return report(scenario, rows, turns)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", metavar="URL", help="use this running llama-server (http://HOST:PORT, /v1 or not) "
                        "instead of starting one; give it one slot (-np 1)")
    parser.add_argument("--turns", type=int, default=len(QUESTIONS),
                        help=f"questions per conversation (default {len(QUESTIONS)})")
    parser.add_argument("--scenario", choices=[*(s.name for s in SCENARIOS), "all"], default="all",
                        help="plain (a), kb (b), compact (c), or all (default)")
    parser.add_argument("--ctx", type=int, default=SERVER_CTX,
                        help=f"the started server's context (-c; default {SERVER_CTX})")
    parser.add_argument("--max-tokens", type=int, default=REPLY_CAP,
                        help=f"the started server's reply cap (-n; default {REPLY_CAP})")
    parser.add_argument("--compact-ctx", type=int, default=COMPACT_CTX,
                        help=f"ctx_max the daemon is given in scenario compact (default {COMPACT_CTX})")
    args = parser.parse_args(argv)
    if args.turns < 1:
        parser.error("--turns must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    terminate_on_sigterm()
    header("bench_prompt_cache: llama-server's prompt cache per turn, through the daemon, against the physical limit")
    chosen = [s for s in SCENARIOS if args.scenario in (s.name, "all")]
    status = 0
    with contextlib.ExitStack() as stack:
        try:
            base = start_server(args, stack)
        except llama.LlamaError as exc:
            print(f"cannot run: {exc}")
            return 1
        if base is None:
            return 1
        describe_server(base)
        print(flush=True)
        lines = []
        for scenario in chosen:
            try:
                lines.append(run_scenario(scenario, base, args))
            except (RuntimeError, TimeoutError, OSError) as exc:
                print(f"scenario {scenario.name} failed: {exc}\n", flush=True)
                status = 1
    if len(lines) > 1:
        for line in lines:
            print(line)
    return status


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # what was started is stopped by then, on the way out of main()
        sys.exit(130)
