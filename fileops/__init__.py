"""Local file operations on what the user drops: PDFs merged, cut and made Markdown; videos'
sound, GIFs and tracking crops (docs/FILEOPS.md).

A floor above ``core`` and ``attachments`` (its OCR) that imports nothing of the daemon's:
``Converter`` runs an operation, named in ``OPERATIONS`` with typed options, as tools in
process groups of their own (poppler, ffmpeg, and ``python -m fileworker.worker`` for pypdf and
numpy), bounded in time and output size, its outputs written whole beside the input.
"""

from .job import Job, ProgressUnit, Report
from .options import OPERATIONS, FileKind, OperationSpec, Option
from .outputs import OutputChip
from .service import Converted, Converter
from .tool import FileConvert

__all__ = [
    "OPERATIONS",
    "Converted",
    "Converter",
    "FileConvert",
    "FileKind",
    "Job",
    "OperationSpec",
    "Option",
    "OutputChip",
    "ProgressUnit",
    "Report",
]
