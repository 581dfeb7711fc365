#!/usr/bin/env python3
"""Run every benchmark in turn, each in its own process, then list the targets met and missed.

``make bench`` calls this.  A benchmark that crashes or overruns its time makes
the exit status 1; a missed target is a finding and does not.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = (
    "bench_ttft.py", "bench_openai.py", "bench_relay.py", "bench_flood.py", "bench_startup.py", "bench_search.py",
    "bench_kb.py", "bench_mcp.py", "bench_ocr.py",
)
TIMEOUT = 100.0  # seconds per benchmark; each normally takes well under 30


def run(script: str) -> tuple[int, list[str]]:
    """Run one benchmark, echoing its output; return its exit status and its target lines."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / script)], cwd=HERE.parent, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    timer = threading.Timer(TIMEOUT, proc.terminate)  # SIGTERM: it stops its own children
    timer.start()
    targets = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            if line.startswith("target:"):
                targets.append(f"{script}: {line.removeprefix('target:').strip()}")
        status = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    return status, targets


def main() -> int:
    started = time.monotonic()
    failed = []
    targets: list[str] = []
    for script in BENCHMARKS:
        status, lines = run(script)
        targets += lines
        if status != 0:
            failed.append(f"{script} (exit {status})")
        print()
    print(f"== summary ({time.monotonic() - started:.1f} s)")
    for line in targets:
        print(line)
    for name in failed:
        print(f"ERROR: {name} did not finish")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
