"""Recall fidelity through a real tool-calling model: how often the answer holds the needle.

Not a test: ``make e2e-tools`` runs one conversation of each kind and asserts; this runs
``--runs`` of each (issue 33 asks ten) and reports, per kind, the fidelity (the answer
contains the needle), how often the model called the tool the kind needs (none for
``none``), whether the needle had been folded away by a compaction first, and the time
per turn: the median of every turn, and of the turn that asked for the needle. The
kinds are ``tests/e2e_tools/scenarios.py``'s: recall (conversation_search after a
compaction), file (attachment_recall after a compaction), kb (kb_search, tool_only), mcp
(a hosted MCP tool), none (no tool needed).

The server is ``scripts/llama.py --tools``: llama-server with Qwen2.5-Coder-1.5B, our
chat template, ``--jinja -c 4096 -t 2 --temp 0`` (fetched once, 1.1 GB). The daemon runs
as a child process (``benchlib.Daemon``) told a 2,048-token context, so conversations
are compacted within a few dozen short turns.

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


async def run_all(socket_path: Path, workdir: Path, kinds: list[str], runs: int) -> list[scenarios.Run]:
    wire = await Wire.open(socket_path, timeout=EVENT_TIMEOUT)
    done: list[scenarios.Run] = []
    try:
        for kind in kinds:
            for n in range(runs):
                try:
                    run = await scenarios.SCENARIOS[kind](wire, n, workdir)
                except (RuntimeError, TimeoutError) as exc:
                    run = scenarios.Run(kind, "?", error=str(exc))
                done.append(run)
                print(json.dumps(run.to_json()), flush=True)
    finally:
        await wire.close()
    return done


def summary(runs: list[scenarios.Run], kinds: list[str]) -> list[dict[str, Any]]:
    rows = []
    for kind in kinds:
        mine = [r for r in runs if r.kind == kind]
        expected = scenarios.EXPECTED_TOOL[kind]
        apt = [r for r in mine if (expected in r.tools if expected else not r.tools)]
        turns = [t for r in mine for t in r.turn_seconds]
        asking = [r.asking_seconds for r in mine if r.error is None]
        rows.append({
            "kind": kind, "runs": len(mine), "found": sum(r.found for r in mine), "apt_tool": len(apt),
            "compacted": sum(r.compacted for r in mine), "errors": sum(r.error is not None for r in mine),
            "turn_median_s": round(statistics.median(turns), 1) if turns else None,
            "asking_median_s": round(statistics.median(asking), 1) if asking else None,
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
            runs = asyncio.run(run_all(daemon.socket_path, work, kinds, args.runs))
        finally:
            daemon.stop()
    rows = summary(runs, kinds)
    print(f"\n{'kind':8} {'found':>7} {'apt tool':>9} {'compacted':>10} {'errors':>7} {'turn s':>7} {'asking s':>9}")
    for row in rows:
        print(f"{row['kind']:8} {row['found']:>3}/{row['runs']:<3} {row['apt_tool']:>5}/{row['runs']:<3} "
              f"{row['compacted']:>6}/{row['runs']:<3} {row['errors']:>7} {row['turn_median_s']!s:>7} "
              f"{row['asking_median_s']!s:>9}")
    if args.json:
        args.json.write_text(json.dumps({"runs": [r.to_json() for r in runs], "summary": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
