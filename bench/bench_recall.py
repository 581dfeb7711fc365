"""Recall fidelity through a real tool-calling model: how often the answer holds the needle.

Not a test: ``make e2e-tools`` runs one conversation of each kind and asserts; this runs
``--runs`` of each (issue 49 asks ten) and reports, per kind, the fidelity (the answer
contains the needle), how often the daemon recalled the folded-away passage before the
question (the recall kinds) or the model called the tool the kind needs (none for
``none``), and the time per turn: the median of every turn the model answered, and of the
turn that asked for the needle, with its ratio to the ``none`` kind's one-line answer (not
a like turn: a recall turn reads its passages and answers from them).

Issue 49's target, a recall turn at most twice a plain one, is measured by ``--compare``
(3 by default): each recall kind's first runs are asked again, after the kind's runs, as
twins: the same past and the same question in a conversation whose ``recall_injection`` is
``tool_only``, so the two prompts differ by the recalled block alone (``off`` would also
drop the two recall tools' definitions, about 500 tokens: the first twins, 2026-12-07,
were ``off`` and their ratios counted those tokens against recall). Printed, the medians
of the first output (a delta or a tool call: the twin's model may search) and of the
whole turn both ways and their ratios. A twin runs after its kind's other runs, so the
server's cache holds, for it as for a run, only what every run's prompt shares (the
system prompt, the tools, the summary), not its own run's past. The kinds are
``tests/e2e_tools/scenarios.py``'s: recall (a fact 40 turns back, folded away), file (page
3 of a PDF folded away), followup (a three-word question that refers back), kb (kb_search,
tool_only), mcp (a hosted MCP tool), none (nothing needed). Their long past is stored
through the store, not written by the model: a run is at most three requests.

The server is ``scripts/llama.py --tools``: llama-server with Qwen2.5-Coder-1.5B, our
chat template, ``--jinja -c 4096 -t 2 --temp 0`` (fetched once, 1.1 GB). The daemon runs
as a child process (``benchlib.Daemon``) told a 2,048-token context. Run it alone on the
CPU: beside test suites llama-server fell from 75-90 to 5 prompt tokens/s (issue 49).

    .venv/bin/python bench/bench_recall.py                      # 10 of each kind, 3 twins
    .venv/bin/python bench/bench_recall.py --runs 3 --kinds recall,none --json out.json
    .venv/bin/python bench/bench_recall.py --router fake --runs 2  # the bench's own paths, no model

``--router URL`` uses a server already running instead of starting llama-server; ``--router
fake`` starts ``python -m selfcheck.fakerouter``: its figures mean nothing, but every path of
the bench runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from benchlib import ROOT, Daemon, cpu_model, fake_router_process, header, temp_dir, terminate_on_sigterm

sys.path.insert(0, str(ROOT))
from client import Wire  # noqa: E402
from tests.e2e.realserver import llama  # noqa: E402  (scripts/llama.py, loaded by path)
from tests.e2e_tools import scenarios  # noqa: E402

# the plain twin keeps the recall tools (their definitions are ~500 tokens of every prompt of
# a conversation that may recall) and gets no passage: the two prompts differ by the block alone
TWIN_MODE = "tool_only"
EVENT_TIMEOUT = 600.0  # seconds for one event: a first prompt, or a compaction's summary, on a busy CPU


async def run_all(
    socket_path: Path, db: Path, workdir: Path, kinds: list[str], runs: int, compare: int
) -> list[scenarios.Run]:
    """Every run, then each recall kind's first ``compare`` again as plain twins (``TWIN_MODE``):
    after the kind's runs, so that a twin, like a run, finds in the server's cache only what
    every run's prompt shares, not its own run's past."""
    wire = await Wire.open(socket_path, timeout=EVENT_TIMEOUT)
    done: list[scenarios.Run] = []
    try:
        for kind in kinds:
            for n in range(runs):
                done.append(await one(scenarios.SCENARIOS[kind](wire, n, workdir, db), kind, "auto"))
            for n in range(min(compare, runs) if kind in scenarios.RECALL_TWINS else 0):
                twin = scenarios.RECALL_TWINS[kind](wire, n, workdir, db, TWIN_MODE)
                done.append(await one(twin, kind, TWIN_MODE))
    finally:
        await wire.close()
    return done


async def one(scenario: Awaitable[scenarios.Run], kind: str, mode: str) -> scenarios.Run:
    try:
        run = await scenario
    except (RuntimeError, TimeoutError, AssertionError) as exc:
        run = scenarios.Run(kind, "?", mode=mode, error=str(exc))
    print(json.dumps(run.to_json()), flush=True)
    return run


def apt(run: scenarios.Run) -> bool:
    """The run got there the way its kind means: the passage recalled, or the tool (none) called."""
    if run.kind in scenarios.EXPECTED_RECALL:
        return any(label.endswith(scenarios.EXPECTED_RECALL[run.kind]) for label in run.recalled)
    expected = scenarios.EXPECTED_TOOL[run.kind]
    return expected in run.tools if expected else not run.tools and not run.recalled


def summary(runs: list[scenarios.Run], kinds: list[str]) -> list[dict[str, Any]]:
    rows = []
    plain = [r.asking_seconds for r in runs if r.kind == "none" and r.error is None]
    plain_s = statistics.median(plain) if plain else None
    for kind in kinds:
        mine = [r for r in runs if r.kind == kind and r.mode == "auto"]
        turns = [t for r in mine for t in r.turn_seconds]
        asking = [r.asking_seconds for r in mine if r.error is None]
        asking_s = statistics.median(asking) if asking else None
        rows.append({
            "kind": kind, "runs": len(mine), "found": sum(r.found for r in mine), "apt": sum(apt(r) for r in mine),
            "compacted": sum(r.compacted for r in mine), "errors": sum(r.error is not None for r in mine),
            "turn_median_s": round(statistics.median(turns), 1) if turns else None,
            "asking_median_s": round(asking_s, 1) if asking_s is not None else None,
            "vs_none": round(asking_s / plain_s, 2) if asking_s is not None and plain_s else None,
        })
    return rows


def compared(runs: list[scenarios.Run], kinds: list[str]) -> list[dict[str, Any]]:
    """Per recall kind with twins: the medians of the first token and of the turn, with recall
    injection (the runs that have a twin) and without (their twins), and the ratios."""
    rows = []
    for kind in kinds:
        twins = [r for r in runs if r.kind == kind and r.mode == TWIN_MODE]
        if not twins:
            continue
        paired = [r for r in runs if r.kind == kind and r.mode == "auto"][:len(twins)]
        row: dict[str, Any] = {"kind": kind, "pairs": len(twins), "found_on": sum(r.found for r in paired),
                               "found_off": sum(r.found for r in twins)}
        for name, value in (("first_token", lambda r: r.asking_first_token), ("turn", lambda r: r.asking_seconds)):
            on = median_of([value(r) for r in paired if r.error is None])
            off = median_of([value(r) for r in twins if r.error is None])
            row[f"{name}_on_s"], row[f"{name}_off_s"] = rounded(on), rounded(off)
            row[f"{name}_ratio"] = round(on / off, 2) if on is not None and off else None
        rows.append(row)
    return rows


def median_of(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 2)


def print_tables(rows: list[dict[str, Any]], twins: list[dict[str, Any]]) -> None:
    print(f"\n{'kind':9} {'found':>7} {'apt':>7} {'compacted':>10} {'errors':>7} {'turn s':>7} {'asking s':>9} "
          f"{'vs none':>8}")
    for row in rows:
        print(f"{row['kind']:9} {row['found']:>3}/{row['runs']:<3} {row['apt']:>3}/{row['runs']:<3} "
              f"{row['compacted']:>6}/{row['runs']:<3} {row['errors']:>7} {row['turn_median_s']!s:>7} "
              f"{row['asking_median_s']!s:>9} {row['vs_none']!s:>8}")
    if not twins:
        return
    print("\nthe same question with recall injection auto and tool_only (medians; target: a recall turn ≤ 2× a plain one)")
    print(f"{'kind':9} {'pairs':>5} {'found on/off':>12} {'first token s on/off':>21} {'ratio':>6} "
          f"{'turn s on/off':>14} {'ratio':>6}")
    for row in twins:
        found = f"{row['found_on']}/{row['found_off']}"
        first = f"{row['first_token_on_s']}/{row['first_token_off_s']}"
        turn = f"{row['turn_on_s']}/{row['turn_off_s']}"
        print(f"{row['kind']:9} {row['pairs']:>5} {found:>12} {first:>21} {row['first_token_ratio']!s:>6} "
              f"{turn:>14} {row['turn_ratio']!s:>6}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="conversations of each kind (default 10)")
    parser.add_argument("--kinds", default=",".join(scenarios.SCENARIOS), help="comma-separated kinds")
    parser.add_argument("--compare", type=int, default=3, metavar="N",
                        help="each recall kind's first N runs also asked with recall_injection off (default 3)")
    parser.add_argument("--router", help="an OpenAI-compatible server's URL instead of llama-server, or 'fake' "
                                         "(selfcheck's fake router: no figure means anything, every path runs)")
    parser.add_argument("--json", type=Path, help="write every run and the summary here")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in scenarios.SCENARIOS]
    if unknown:
        parser.error(f"unknown kinds {unknown}; known: {', '.join(scenarios.SCENARIOS)}")
    terminate_on_sigterm()
    with contextlib.ExitStack() as stack:
        if args.router:
            header(f"recall through the server at {args.router} ({cpu_model()})")
            url = stack.enter_context(fake_router_process()) if args.router == "fake" else args.router
        else:
            state = llama.with_tools_model(llama.install())
            header(f"recall through {llama.TOOLS_ALIAS} ({cpu_model()})")
            url = stack.enter_context(llama.running_server(
                state, extra=llama.TOOLS_FLAGS, log=llama.CACHE / "bench-recall-llama-server.log")).v1
        work = stack.enter_context(temp_dir("recall"))
        (work / "config.toml").write_text(scenarios.mcp_config_text())  # benchlib.Daemon reads it
        daemon = Daemon(work, url, settings=dict(scenarios.DAEMON_ENV)).start()
        try:
            runs = asyncio.run(run_all(daemon.socket_path, daemon.data_dir / "history.db", work, kinds, args.runs,
                                       args.compare))
        finally:
            daemon.stop()
    rows, twins = summary(runs, kinds), compared(runs, kinds)
    print_tables(rows, twins)
    if args.json:
        body = {"runs": [r.to_json() for r in runs], "summary": rows, "compared": twins}
        args.json.write_text(json.dumps(body, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
