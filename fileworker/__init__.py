"""The file operations done in Python, in a process of their own: ``python -m fileworker.worker``.

``fileops`` runs them (pypdf's merges and cuts, trackcrop's motion measure) as a child
process it can kill; they are a package of their own, on the standard library and their
libraries alone (pypdf, Pillow, numpy), because a worker's start is part of every such
operation's time: the worker, when it was ``fileops.worker``, imported the ``fileops`` package
first, and with it asyncio and ``attachments``, some 0.3 s of a sub-second merge; then
``core``, whose package loads the configuration's modules (bench/bench_convert.py;
docs/DESIGN.md, "File operations"). Its failures carry ``core.errors``' codes (``failure.py``).
"""

__all__: list[str] = []
