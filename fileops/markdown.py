"""A PDF's text as Markdown, from poppler's ``pdftohtml -xml``: every line with its place and font.

The body is the font size that carries most of the text; a line in a larger size is a
heading, the largest ``#``, the next ``##``, the rest ``###``. Lines close under each other
in the body size join into one paragraph; a line opening with a bullet or a number is a list
item; lines cut into cells at the same height, row after row with as many cells, are a
table. Pages without a line are left for OCR (``pdfops.pdf_to_markdown``). Runs in a
thread: parsing a long document's XML is seconds of CPU.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree
from collections import Counter
from dataclasses import dataclass

__all__ = ["Line", "pages_markdown", "parse_pages"]

HEADING_RATIO = 1.15  # a font this much larger than the body's is a heading's
PARAGRAPH_GAP = 0.7  # a gap above a line, in its heights, past which it opens a paragraph
SAME_ROW = 3  # pixels: text runs whose tops differ less sit on one row
BULLET = re.compile(r"^\s*(?:[•◦▪‣●○\-–*])\s+(.*)$")
NUMBERED = re.compile(r"^\s*(\d{1,3})[.)]\s+(.*)$")
ITEM = re.compile(r"^(?:- |\d{1,3}\. )")  # a list item as written
MAX_HEADING_LEVELS = 3


@dataclass
class Line:
    """One row of a page: its cells (text runs) left to right, its top, height and font size."""

    cells: list[str]
    top: float
    height: float
    size: float

    @property
    def text(self) -> str:
        return " ".join(self.cells)


def parse_pages(xml: bytes) -> list[list[Line]]:
    """The rows of each page of ``pdftohtml -xml`` output, top to bottom."""
    root = ElementTree.fromstring(xml)
    sizes: dict[str, float] = {}
    pages: list[list[Line]] = []
    for page in root.iter("page"):
        runs = []
        for element in page:
            if element.tag == "fontspec":
                sizes[element.get("id", "")] = float(element.get("size", "0"))
            elif element.tag == "text" and (text := "".join(element.itertext()).strip()):
                runs.append((float(element.get("top", "0")), float(element.get("left", "0")),
                             float(element.get("height", "0")), sizes.get(element.get("font", ""), 0.0), text))
        pages.append(_rows(sorted(runs)))
    return pages


def _rows(runs: list[tuple[float, float, float, float, str]]) -> list[Line]:
    rows: list[Line] = []
    for top, _left, height, size, text in runs:
        if rows and abs(rows[-1].top - top) < SAME_ROW:
            rows[-1].cells.append(text)
            rows[-1].size = max(rows[-1].size, size)
        else:
            rows.append(Line([text], top, height, size))
    return rows


def pages_markdown(pages: list[list[Line]]) -> list[str]:
    """Each page as Markdown ("" for a page without text: a scan)."""
    weights: Counter[float] = Counter()
    for line in (line for page in pages for line in page):
        weights[line.size] += len(line.text)
    # the size carrying most text; of two carrying as much, the smaller (a title as long as its one line)
    body = max(weights, key=lambda size: (weights[size], -size)) if weights else 0.0
    larger = sorted({size for size in weights if size > body * HEADING_RATIO}, reverse=True)
    levels = {size: min(rank + 1, MAX_HEADING_LEVELS) for rank, size in enumerate(larger)}
    return [_page(page, levels) for page in pages]


def _page(lines: list[Line], levels: dict[float, int]) -> str:
    blocks: list[str] = []
    previous: Line | None = None
    table: list[Line] = []
    for line in lines:
        if len(line.cells) > 1 and line.size not in levels:
            if table and len(table[-1].cells) != len(line.cells):
                blocks.append(_table(table))
                table = []
            table.append(line)
            previous = None
            continue
        if table:
            blocks.append(_table(table))
            table = []
        blocks, previous = _add(blocks, previous, line, levels)
    if table:
        blocks.append(_table(table))
    return "\n\n".join(blocks)


def _add(blocks: list[str], previous: Line | None, line: Line, levels: dict[float, int]) -> tuple[list[str], Line | None]:
    """``blocks`` with ``line`` added: a heading, a list item, or a paragraph's line."""
    text = line.text
    if line.size in levels:
        blocks.append("#" * levels[line.size] + " " + text)
        return blocks, None
    item = ("- " + bullet.group(1) if (bullet := BULLET.match(text))
            else f"{numbered.group(1)}. {numbered.group(2)}" if (numbered := NUMBERED.match(text)) else None)
    if item is not None:
        if blocks and ITEM.match(blocks[-1].rpartition("\n")[2]):  # the list goes on
            blocks[-1] += "\n" + item
        else:
            blocks.append(item)
        return blocks, None
    joins = previous is not None and line.top - (previous.top + previous.height) < PARAGRAPH_GAP * line.height
    if joins:
        blocks[-1] = blocks[-1] + " " + text
    else:
        blocks.append(text)
    return blocks, line


def _table(rows: list[Line]) -> str:
    if len(rows) < 2:  # one row with gaps in it is a line set in columns, not a table
        return " ".join(rows[0].cells)
    cells = [[cell.replace("|", "\\|") for cell in row.cells] for row in rows]
    out = ["| " + " | ".join(cells[0]) + " |", "|" + " --- |" * len(cells[0])]
    out += ["| " + " | ".join(row) + " |" for row in cells[1:]]
    return "\n".join(out)
