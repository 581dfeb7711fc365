"""The text a document reader writes: lines gathered into pages, within ``FULL_TEXT_CAP``.

Readers (``ooxml.py``, ``odf.py``, ``office.py``) write Markdown-ish lines: headings as
``#``, list items as ``- ``, table rows as ``| a | b |`` (a separator line after the
first), and end a page at each slide, sheet or chapter. Past the cap the writer raises
``Full`` and the reader's caller keeps what was written, marked as cut.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from xml.etree import ElementTree as ET

from .budget import FULL_TEXT_CAP

__all__ = ["Full", "Writer", "outermost", "table_row"]


class Full(Exception):
    """The document's text passed ``FULL_TEXT_CAP``: the rest is not read."""


def table_row(cells: Sequence[str]) -> str:
    """A table row as Markdown: ``| a | b |``, each cell on one line, a ``|`` in it escaped."""
    return "| " + " | ".join(" ".join(cell.split()).replace("|", "\\|") for cell in cells) + " |"


def outermost(element: ET.Element, tags: tuple[str, ...], stop: str) -> Iterator[ET.Element]:
    """The descendants of ``element`` whose tag is one of ``tags``, in order, none inside another
    of them or inside a ``stop`` element (a table within a table): each is walked by its own
    outermost. ``iter`` would hand a table the rows of every table nested in it, and each row
    the cells of theirs: a 100 KB document of tables nested 2,000 deep took gigabytes."""
    stack = [iter(element)]  # a stack, not recursion: a slide's groups may nest deeper than Python's
    while stack:
        for child in stack[-1]:
            if child.tag in tags:
                yield child
            elif child.tag != stop:
                stack.append(iter(child))
                break
        else:
            stack.pop()


class Writer:
    """Lines of text gathered into pages."""

    def __init__(self) -> None:
        self.pages: list[str] = []
        self.lines: list[str] = []
        self.size = 0

    def line(self, text: str) -> None:
        """Add a line (nothing when blank); ``Full`` past the cap."""
        if not text.strip():
            return
        self.lines.append(text)
        self.size += len(text) + 1
        if self.size > FULL_TEXT_CAP:
            raise Full

    def table(self, rows: Iterable[Sequence[str]]) -> None:
        """A table's rows (read as they are written: ``Full`` stops them), the first followed by
        the separator Markdown wants."""
        for index, row in enumerate(rows):
            self.line(table_row(row))
            if index == 0:
                self.line("|" + " --- |" * len(row))

    def page(self) -> None:
        """End a page (a slide, a sheet, a chapter); an empty one counts too."""
        self.pages.append("\n".join(self.lines))
        self.lines = []

    def finish(self) -> list[str]:
        """The pages, the last one ended if it has lines."""
        if self.lines or not self.pages:
            self.page()
        return self.pages
