"""OpenDocument text and spreadsheets (ODT, ODS): ``content.xml`` walked for its text.

An ODT's headings (``text:h`` with their outline level), paragraphs, list items and tables;
an ODS's sheets, each a table under its name. Repeated rows and columns (``number-*-
repeated``, how ODF writes a sheet's empty tail of a million rows) are expanded only when
they hold text, a row only up to ``MAX_COLUMNS`` cells, and rows only as the writer takes
them (past its cap it stops the reading); repeated spaces (``text:s``) up to ``MAX_REPEAT``.
"""

from __future__ import annotations

from collections.abc import Iterator
from xml.etree import ElementTree as ET

from .archive import Archive, damaged
from .doctext import Writer, outermost

__all__ = ["ODF_ENCRYPTED", "read_ods", "read_odt"]

OFFICE = "{urn:oasis:names:tc:opendocument:xmlns:office:1.0}"
TEXT = "{urn:oasis:names:tc:opendocument:xmlns:text:1.0}"
TABLE = "{urn:oasis:names:tc:opendocument:xmlns:table:1.0}"
# a manifest entry of an encrypted member (a password-protected document)
ODF_ENCRYPTED = b"encryption-data"
MAX_COLUMNS = 256
MAX_REPEAT = 1000  # a non-empty row or cell (or a space) repeated more than this is written this often


def _text(element: ET.Element) -> str:
    """An element's text with ODF's spaces (``text:s``), tabs and line breaks; notes left out."""
    parts = [element.text or ""]
    for child in element:
        if child.tag == TEXT + "s":
            count = child.get(TEXT + "c", "1")  # a small file may ask for a billion
            parts.append(" " * (min(int(count), MAX_REPEAT) if count.isdigit() else 1))
        elif child.tag == TEXT + "tab":
            parts.append("\t")
        elif child.tag == TEXT + "line-break":
            parts.append("\n")
        elif child.tag != TEXT + "note":
            parts.append(_text(child))
        parts.append(child.tail or "")
    return "".join(parts)


def _repeat(element: ET.Element, attribute: str) -> int:
    value = element.get(TABLE + attribute, "1")
    return min(int(value), MAX_REPEAT) if value.isdigit() and int(value) > 0 else 1


def _row_cells(row: ET.Element) -> list[str]:
    cells: list[str] = []
    for cell in row:
        if cell.tag not in (TABLE + "table-cell", TABLE + "covered-table-cell"):
            continue
        text = " ".join(_text(p) for p in cell.iter(TEXT + "p"))
        count = _repeat(cell, "number-columns-repeated") if text.strip() else 1
        cells.extend([text] * min(count, MAX_COLUMNS - len(cells)))
        if len(cells) >= MAX_COLUMNS:
            break
    while cells and not cells[-1].strip():
        cells.pop()
    return cells


def _table_rows(table: ET.Element) -> Iterator[list[str]]:
    """The rows with text, each repeated as it says, yielded as the writer takes them: a few KB of
    rows repeated a thousand times each would make a list of hundreds of millions."""
    for row in outermost(table, (TABLE + "table-row",), TABLE + "table"):  # in row groups too
        cells = _row_cells(row)
        if any(cell.strip() for cell in cells):
            for _ in range(_repeat(row, "number-rows-repeated")):
                yield cells


def _odt_blocks(parent: ET.Element, out: Writer, prefix: str = "") -> None:
    for child in parent:
        if child.tag == TEXT + "h":
            level = child.get(TEXT + "outline-level", "1")
            out.line("#" * min(int(level) if level.isdigit() else 1, 6) + " " + " ".join(_text(child).split()))
        elif child.tag == TEXT + "p":
            out.line(prefix + _text(child).strip())
        elif child.tag == TEXT + "list-item":
            _odt_blocks(child, out, "- ")
        elif child.tag == TABLE + "table":
            out.table(_table_rows(child))
        else:  # lists, sections, frames
            _odt_blocks(child, out, prefix)


def _body(archive: Archive, kind: str) -> ET.Element:
    found = archive.xml("content.xml").find(f"{OFFICE}body/{OFFICE}{kind}")
    if found is None:
        raise damaged(archive.name, archive.what, f"content.xml holds no office:{kind}")
    return found


def read_odt(archive: Archive, out: Writer) -> None:
    """An ODT's text as one page."""
    _odt_blocks(_body(archive, "text"), out)


def read_ods(archive: Archive, out: Writer) -> None:
    """An ODS's sheets, one page each: the name as a heading, the rows as a table."""
    for table in outermost(_body(archive, "spreadsheet"), (TABLE + "table",), ""):
        out.line("## " + table.get(TABLE + "name", "sheet"))
        out.table(_table_rows(table))
        out.page()
