"""Office Open XML (DOCX, PPTX, XLSX): the parsed parts walked for their text.

Only text is taken: a DOCX's paragraphs (headings by their style: ``Title`` and
``heading N`` by name, so a German ``Überschrift 1`` counts as its style's name says, or
an outline level), list items (numbered paragraphs) and tables; a PPTX's slides in the
presentation's order, the title placeholder as ``#``, every other shape's paragraphs and
its tables; an XLSX's sheets in the workbook's order, each a table under its name, shared
strings resolved, numbers as stored (a date is its serial number). Parts are found through
the package's relationships, as Office finds them, with the usual names as a fallback.
Large sheets are read row by row (``Archive.iter_xml``), so their size costs no memory.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from xml.etree import ElementTree as ET

from .archive import Archive, damaged
from .doctext import Writer, outermost, table_row

__all__ = ["read_docx", "read_pptx", "read_xlsx"]

W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
A = "{http://schemas.openxmlformats.org/drawingml/2006/main}"
P = "{http://schemas.openxmlformats.org/presentationml/2006/main}"
S = "{http://schemas.openxmlformats.org/spreadsheetml/2006/main}"
R = "{http://schemas.openxmlformats.org/officeDocument/2006/relationships}"
OFFICE_DOCUMENT = "/officeDocument"
# cells of one sheet row kept: a stray cell in column XFD would otherwise make 16,384 empty ones
MAX_COLUMNS = 256
_HEADING_NAME = re.compile(r"heading (\d)")
_CELL_REF = re.compile(r"([A-Z]+)")


def main_part(archive: Archive, fallback: str) -> str:
    """The package's main part, as ``_rels/.rels`` names it (``fallback`` when it does not)."""
    if archive.has("_rels/.rels"):
        for rel in archive.xml("_rels/.rels"):
            if rel.get("Type", "").endswith(OFFICE_DOCUMENT) and rel.get("Target"):
                target = rel.get("Target", "").lstrip("/")
                if archive.has(target):
                    return target
    return fallback


# -- DOCX ---------------------------------------------------------------------------------


def _heading_styles(archive: Archive, document: str) -> dict[str, int]:
    """Style id → heading level, from the styles part (``Title`` is level 1)."""
    styles = next((t for t in archive.relationships(document).values() if t.endswith("styles.xml")), None)
    if styles is None or not archive.has(styles):
        return {}
    levels = {}
    for style in archive.xml(styles).iter(W + "style"):
        named = style.find(W + "name")
        name = (named.get(W + "val", "") if named is not None else "").lower()
        outline = style.find(f"{W}pPr/{W}outlineLvl")
        if name == "title":
            levels[style.get(W + "styleId", "")] = 1
        elif match := _HEADING_NAME.fullmatch(name):
            levels[style.get(W + "styleId", "")] = int(match[1])
        elif outline is not None and outline.get(W + "val", "").isdigit() and int(outline.get(W + "val", "9")) < 6:
            levels[style.get(W + "styleId", "")] = int(outline.get(W + "val", "0")) + 1
    return levels


def _run_text(paragraph: ET.Element) -> str:
    """A paragraph's text: its runs, tabs and breaks (deleted text, ``w:delText``, left out)."""
    parts = []
    for element in paragraph.iter():
        if element.tag == W + "t" and element.text:
            parts.append(element.text)
        elif element.tag == W + "tab":
            parts.append("\t")
        elif element.tag in (W + "br", W + "cr"):
            parts.append("\n")
    return "".join(parts)


def _docx_paragraph(paragraph: ET.Element, levels: dict[str, int], out: Writer) -> None:
    text = _run_text(paragraph).strip()
    if not text:
        return
    style = paragraph.find(f"{W}pPr/{W}pStyle")
    level = levels.get(style.get(W + "val", "")) if style is not None else None
    if level is not None:
        out.line("#" * min(level, 6) + " " + " ".join(text.split()))
    elif paragraph.find(f"{W}pPr/{W}numPr") is not None:
        out.line("- " + text)
    else:
        out.line(text)


def _docx_table(table: ET.Element, out: Writer) -> None:
    """A table's own rows and cells (a nested table's text stands in its cell: ``outermost``)."""
    rows = []
    for row in outermost(table, (W + "tr",), W + "tbl"):
        cells = [" ".join(_run_text(p) for p in cell.iter(W + "p"))
                 for cell in outermost(row, (W + "tc",), W + "tbl")]
        if any(cell.strip() for cell in cells):
            rows.append(cells)
    out.table(rows)


def _docx_blocks(parent: ET.Element, levels: dict[str, int], out: Writer) -> None:
    """Paragraphs and tables in order, through the containers around them (content controls,
    custom XML, tracked insertions)."""
    for child in parent:
        if child.tag == W + "p":
            _docx_paragraph(child, levels, out)
        elif child.tag == W + "tbl":
            _docx_table(child, out)
        elif child.tag != W + "sectPr":
            _docx_blocks(child, levels, out)


def read_docx(archive: Archive, out: Writer) -> None:
    """A DOCX's text as one page."""
    document = main_part(archive, "word/document.xml")
    levels = _heading_styles(archive, document)
    body = archive.xml(document).find(W + "body")
    if body is None:
        raise _missing(archive, "its body")
    _docx_blocks(body, levels, out)


def _missing(archive: Archive, what: str) -> Exception:
    return damaged(archive.name, archive.what, f"{what} is missing")


# -- PPTX ---------------------------------------------------------------------------------


def _drawing_text(paragraph: ET.Element) -> str:
    parts = []
    for element in paragraph.iter():
        if element.tag == A + "t" and element.text:
            parts.append(element.text)
        elif element.tag == A + "br":
            parts.append("\n")
    return "".join(parts).strip()


def _slide_shape(shape: ET.Element, out: Writer) -> None:
    placeholder = shape.find(f"{P}nvSpPr/{P}nvPr/{P}ph")
    title = placeholder is not None and placeholder.get("type") in ("title", "ctrTitle")
    for paragraph in shape.iter(A + "p"):
        text = _drawing_text(paragraph)
        if title:
            out.line("# " + " ".join(text.split()))
        else:
            level = paragraph.find(A + "pPr")
            indent = int(level.get("lvl", "0")) if level is not None and level.get("lvl", "0").isdigit() else 0
            out.line("  " * indent + text if indent else text)


def _slide(archive: Archive, part: str, out: Writer) -> None:
    for element in outermost(archive.xml(part), (P + "sp", A + "tbl"), ""):
        if element.tag == P + "sp":
            _slide_shape(element, out)
        else:
            rows = [[_drawing_text(cell) for cell in outermost(row, (A + "tc",), A + "tbl")]
                    for row in outermost(element, (A + "tr",), A + "tbl")]
            out.table([row for row in rows if any(row)])


def read_pptx(archive: Archive, out: Writer) -> None:
    """A PPTX's slides, one page each, in the presentation's order."""
    presentation = main_part(archive, "ppt/presentation.xml")
    targets = archive.relationships(presentation)
    ids = archive.xml(presentation).find(P + "sldIdLst")
    slides = [targets.get(slide.get(R + "id", ""), "") for slide in (ids if ids is not None else [])]
    for part in slides:
        if archive.has(part):
            _slide(archive, part, out)
        out.page()


# -- XLSX ---------------------------------------------------------------------------------


def _shared_strings(archive: Archive, workbook: str) -> list[str]:
    part = next((t for t in archive.relationships(workbook).values() if t.endswith("sharedStrings.xml")), None)
    if part is None or not archive.has(part):
        return []
    return [_shared_string(si) for si in archive.xml(part)]


def _shared_string(si: ET.Element) -> str:
    """One ``<si>``: its ``<t>`` runs joined, phonetic runs (``<rPh>``) left out (found once: per
    run, a string of 100,000 runs took minutes)."""
    phonetic = {t for rph in si.iter(S + "rPh") for t in rph.iter(S + "t")}
    return "".join(t.text or "" for t in si.iter(S + "t") if t not in phonetic)


def _column(ref: str) -> int | None:
    """The 0-based column of a cell reference (``C7`` → 2)."""
    match = _CELL_REF.match(ref)
    if match is None:
        return None
    number = 0
    for letter in match[1]:
        number = number * 26 + ord(letter) - 64
    return number - 1


def _cell_value(cell: ET.Element, strings: list[str]) -> str:
    kind = cell.get("t", "n")
    if kind == "inlineStr":
        return "".join(t.text or "" for t in cell.iter(S + "t"))
    value = cell.findtext(S + "v") or ""
    if kind == "s":
        return strings[int(value)] if value.isdigit() and int(value) < len(strings) else ""
    if kind == "b":
        return "TRUE" if value == "1" else "FALSE"
    return value


def _sheet_row(row: ET.Element, strings: list[str]) -> list[str]:
    cells: list[str] = []
    for cell in row.iter(S + "c"):
        column = _column(cell.get("r", "")) if cell.get("r") else len(cells)
        if column is None or column >= MAX_COLUMNS:
            continue
        cells.extend([""] * (column + 1 - len(cells)))
        cells[column] = _cell_value(cell, strings)
    while cells and not cells[-1].strip():
        cells.pop()
    return cells


def read_xlsx(archive: Archive, out: Writer) -> None:
    """An XLSX's sheets, one page each: the name as a heading, the rows as a table."""
    workbook = main_part(archive, "xl/workbook.xml")
    targets = archive.relationships(workbook)
    strings = _shared_strings(archive, workbook)
    for sheet in archive.xml(workbook).iter(S + "sheet"):
        out.line("## " + sheet.get("name", "sheet"))
        part = targets.get(sheet.get(R + "id", ""), "")
        if archive.has(part):
            rows = (_sheet_row(row, strings) for row in archive.iter_xml(part, S + "row"))
            _write_rows(rows, out)
        out.page()


def _write_rows(rows: Iterator[list[str]], out: Writer) -> None:
    """Non-empty rows as a table, written as they are read (``Full`` stops the reading)."""
    first = True
    for row in rows:
        if any(cell.strip() for cell in row):
            out.line(table_row(row))
            if first:
                out.line("|" + " --- |" * len(row))
                first = False
