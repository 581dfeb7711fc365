"""``convert`` and ``operations``: the local file operations (``fileops``) on the socket.

A ``convert`` answers ``progress`` as its tools go (the first at once, carrying the id a
``cancel`` names) and ends with ``converted``: the outputs as chips, or none and
``cancelled: true`` when a ``cancel`` stopped it. docs/PROTOCOL.md, "File operations".
"""

from __future__ import annotations

from core.config import Config
from fileops import Converter, ProgressUnit, Report

from .connection import Emit
from .protocol import Request

__all__ = ["on_convert", "on_operations"]


async def on_convert(converter: Converter, config: Config, request: Request, emit: Emit) -> None:
    operation: str = request.get("operation")

    def reporter(ident: str) -> Report:
        def report(done: float, total: float | None, unit: ProgressUnit) -> None:
            emit({"type": "progress", "convert": ident, "operation": operation, "done": done, "total": total,
                  "unit": unit})
        return report

    job = converter.job(config, operation, request.get("files"), request.get("options", {}),
                        request.get("output_dir"), reporter)
    job.report(0, len(job.inputs), "files")
    done = await converter.convert(job, config.convert_timeout, config.data_dir / "thumbnails")
    emit({"type": "converted", **done.to_json()})


async def on_operations(converter: Converter, request: Request, emit: Emit) -> None:
    emit({"type": "operations", "items": converter.operations()})
