"""Recall fidelity through a real tool-calling model: how often the answer holds the needle.

Not a test: ``make e2e-tools`` runs one conversation of each kind and asserts; this runs
``--runs`` of each (issue 49 asks ten) and reports, per kind, the fidelity (the answer
contains the needle), how often the daemon recalled the folded-away passage before the
question (the recall kinds) or the model called the tool the kind needs (none for
``none``), and the time per turn: the median of every turn the model answered, and of the
turn that asked for the needle, with its ratio to a plain turn's (``none``; issue 49's
target: a recall turn at most twice a plain one). The kinds are
``tests/e2e_tools/scenarios.py``'s: recall (a fact 40 turns back, folded away), file (page
3 of a PDF folded away), followup (a three-word question that refers back), kb (kb_search,
tool_only), mcp (a hosted MCP tool), none (nothing needed). Their long past is stored
through the store, not written by the model: a run is at most three requests.

The server is ``scripts/llama.py --tools``: llama-server with Qwen2.5-Coder-1.5B, our
chat template, ``--jinja -c 4096 -t 2 --temp 0`` (fetched once, 1.1 GB). The daemon runs
as a child process (``benchlib.Daemon``) told a 2,048-token context. Run it alone on the
CPU: beside test suites llama-server fell from 75-90 to 5 prompt tokens/s (issue 49).

    .venv/bin/python bench/bench_recall.py                      # 10 of each kind
    .venv/bin/python bench/bench_recall.py --runs 3 --kinds recall,none --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchlib import ROOT, Daemon, cpu_model, header, temp_dir, terminate_on_sigterm

sys.path.insert(0, str(ROOT))
from client import Wire  # noqa: E402
from tests.e2e.realserver import llama  # noqa: E402  (scripts/llama.py, loaded by path)
from tests.e2e_tools import scenarios  # noqa: E402

EVENT_TIMEOUT = 600.0  # seconds for one event: a first prompt, or a compaction's summary, on a busy CPU


async def run_all(
    socket_path: Path, db: Path, workdir: Path, kinds: list[str], runs: int
) -> list[scenarios.Run]:
    wire = await Wire.open(socket_path, timeout=EVENT_TIMEOUT)
    done: list[scenarios.Run] = []
    try:
        for kind in kinds:
            for n in range(runs):
                try:
                    run = await scenarios.SCENARIOS[kind](wire, n, workdir, db)
                except (RuntimeError, TimeoutError, AssertionError) as exc:
                    run = scenarios.Run(kind, "?", error=str(exc))
                done.append(run)
                print(json.dumps(run.to_json()), flush=True)
    finally:
        await wire.close()
    return done


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
        mine = [r for r in runs if r.kind == kind]
        turns = [t for r in mine for t in r.turn_seconds]
        asking = [r.asking_seconds for r in mine if r.error is None]
        asking_s = statistics.median(asking) if asking else None
        rows.append({
            "kind": kind, "runs": len(mine), "found": sum(r.found for r in mine), "apt": sum(apt(r) for r in mine),
            "compacted": sum(r.compacted for r in mine), "errors": sum(r.error is not None for r in mine),
            "turn_median_s": round(statistics.median(turns), 1) if turns else None,
            "asking_median_s": round(asking_s, 1) if asking_s is not None else None,
            "vs_plain": round(asking_s / plain_s, 2) if asking_s is not None and plain_s else None,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="conversations of each kind (default 10)")
    parser.add_argument("--kinds", default=",".join(scenarios.SCENARIOS), help="comma-separated kinds")
    parser.add_argument("--json", type=Path, help="write every run and the summary here")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in scenarios.SCENARIOS]
    if unknown:
        parser.error(f"unknown kinds {unknown}; known: {', '.join(scenarios.SCENARIOS)}")
    terminate_on_sigterm()
    state = llama.with_tools_model(llama.install())
    header(f"recall through {llama.TOOLS_ALIAS} ({cpu_model()})")
    with temp_dir("recall") as work, llama.running_server(state, extra=llama.TOOLS_FLAGS,
                                                          log=llama.CACHE / "bench-recall-llama-server.log") as server:
        (work / "config.toml").write_text(scenarios.mcp_config_text())  # benchlib.Daemon reads it
        daemon = Daemon(work, server.v1, settings=dict(scenarios.DAEMON_ENV)).start()
        try:
            runs = asyncio.run(run_all(daemon.socket_path, daemon.data_dir / "history.db", work, kinds, args.runs))
        finally:
            daemon.stop()
    rows = summary(runs, kinds)
    print(f"\n{'kind':9} {'found':>7} {'apt':>7} {'compacted':>10} {'errors':>7} {'turn s':>7} {'asking s':>9} "
          f"{'vs plain':>9}")
    for row in rows:
        print(f"{row['kind']:9} {row['found']:>3}/{row['runs']:<3} {row['apt']:>3}/{row['runs']:<3} "
              f"{row['compacted']:>6}/{row['runs']:<3} {row['errors']:>7} {row['turn_median_s']!s:>7} "
              f"{row['asking_median_s']!s:>9} {row['vs_plain']!s:>9}")
    if args.json:
        args.json.write_text(json.dumps({"runs": [r.to_json() for r in runs], "summary": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
