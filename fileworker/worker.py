"""The worker: the operations done in Python, in a process of their own (``python -m fileworker.worker``).

pypdf and the motion measure hold the CPU for seconds on a large input; run in the daemon
they would slow every turn, and a thread cannot be killed on cancel. A child process in its
own group (``process.run_tool``) can. It takes the operation and its request (JSON) on its
command line, writes its progress as JSON lines on stdout and its output where the request
says; a failure meant for the user is one stderr line ``fileops: CODE message``.
"""

from __future__ import annotations

import importlib
import json
import sys

from fileworker.failure import WorkFailed

# each operation's module and function: only that module is imported, so a PDF merge does not
# load numpy, nor a tracking crop pypdf (a worker's start is part of every operation's time:
# bench/bench_convert.py)
WORK = {
    "pdf_merge": ("fileworker.pdfwork", "merge_pdfs"),
    "pdf_pages": ("fileworker.pdfwork", "select_pages"),
    "trackcrop": ("fileworker.tracking", "track_window"),
}


def progress(done: int, total: int) -> None:
    print(json.dumps({"done": done, "total": total}), flush=True)


def main(argv: list[str]) -> int:
    operation, request = argv
    module, function = WORK[operation]
    work = getattr(importlib.import_module(module), function)
    try:
        work(json.loads(request), progress)
    except WorkFailed as exc:
        print(f"fileops: {exc.code} {exc.message}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
