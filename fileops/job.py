"""One conversion as the operations see it: inputs, options, where outputs go, how to report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from attachments import Ocr

from .options import FileKind, OperationSpec
from .outputs import Staged

__all__ = ["Job", "ProgressUnit", "Report"]

ProgressUnit = Literal["files", "pages", "seconds", "frames"]
Report = Callable[[float, float | None, ProgressUnit], None]


@dataclass
class Job:
    """A conversion under way; its outputs are staged until all of them are whole."""

    id: str
    spec: OperationSpec
    inputs: list[tuple[Path, FileKind]]
    options: dict[str, Any]
    folder: Path
    max_bytes: int  # convert_max_bytes
    gif_max_bytes: int
    report: Report
    ocr: Ocr  # reads the pages of a scanned PDF (the daemon's, with its cache)
    staged: list[Staged] = field(default_factory=list)

    @property
    def first(self) -> Path:
        return self.inputs[0][0]

    def stage(self, name: str) -> Staged:
        """A temporary file in the output folder for the output to be called ``name``."""
        staged = Staged.make(self.folder, name)
        self.staged.append(staged)
        return staged
