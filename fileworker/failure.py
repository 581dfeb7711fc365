"""A failure the worker reports to the user: one stderr line ``fileops: CODE message``.

The codes are ``core.errors``' (``ConvertFailed``, ``OutputTooLarge``), which ``fileops``
rebuilds from that line; the worker does not import ``core`` for them: the package loads
the configuration's modules, a part of every PDF operation's start (bench/bench_convert.py).
"""

from __future__ import annotations

__all__ = ["OutputTooLarge", "WorkFailed"]


class WorkFailed(Exception):
    """What the worker could not do, said for the user (``convert_failed``)."""

    code = "convert_failed"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class OutputTooLarge(WorkFailed):
    """The output would pass its size bound (``output_too_large``)."""

    code = "output_too_large"
