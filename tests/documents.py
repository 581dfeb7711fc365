"""Minimal valid Office documents written with zipfile for the tests: DOCX, PPTX, XLSX, ODT,
ODS, EPUB and HTML, each holding the text the tests look for."""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from pathlib import Path
from xml.sax.saxutils import escape

W_NS = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
A_NS = "http://schemas.openxmlformats.org/drawingml/2006/main"
P_NS = "http://schemas.openxmlformats.org/presentationml/2006/main"
S_NS = "http://schemas.openxmlformats.org/spreadsheetml/2006/main"
R_NS = "http://schemas.openxmlformats.org/officeDocument/2006/relationships"
PKG_RELS = "http://schemas.openxmlformats.org/package/2006/relationships"
OFFICE_DOC = "http://schemas.openxmlformats.org/officeDocument/2006/relationships/officeDocument"
CONTENT_TYPES = ('<?xml version="1.0" encoding="UTF-8"?><Types xmlns="http://schemas.openxmlformats.org/'
                 'package/2006/content-types"><Default Extension="xml" ContentType="application/xml"/></Types>')


def _rels(*targets: tuple[str, str, str]) -> str:
    """A relationships part of (id, type, target)."""
    body = "".join(f'<Relationship Id="{i}" Type="{t}" Target="{target}"/>' for i, t, target in targets)
    return f'<?xml version="1.0" encoding="UTF-8"?><Relationships xmlns="{PKG_RELS}">{body}</Relationships>'


def make_ooxml(path: Path, main: str, parts: dict[str, str]) -> Path:
    """An OOXML package whose relationships name ``main`` its main part, holding ``parts``."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("[Content_Types].xml", CONTENT_TYPES)
        archive.writestr("_rels/.rels", _rels(("rId1", OFFICE_DOC, main)))
        for name, text in parts.items():
            archive.writestr(name, text)
    return path


def make_docx(path: Path, heading: str, paragraphs: Sequence[str], table: Sequence[Sequence[str]] = (),
              bullets: Sequence[str] = ()) -> Path:
    """A DOCX: a Heading 1 (by its style's name), paragraphs, bullets (numbered paragraphs), a table."""
    def para(text: str, extra: str = "") -> str:
        return f"<w:p>{extra}<w:r><w:t xml:space=\"preserve\">{escape(text)}</w:t></w:r></w:p>"

    body = para(heading, '<w:pPr><w:pStyle w:val="Kop1"/></w:pPr>')
    body += "".join(para(text) for text in paragraphs)
    body += "".join(para(text, '<w:pPr><w:numPr><w:ilvl w:val="0"/><w:numId w:val="1"/></w:numPr></w:pPr>')
                    for text in bullets)
    if table:
        rows = "".join("<w:tr>" + "".join(f"<w:tc>{para(cell)}</w:tc>" for cell in row) + "</w:tr>" for row in table)
        body += f"<w:tbl>{rows}</w:tbl>"
    document = f'<?xml version="1.0" encoding="UTF-8"?><w:document xmlns:w="{W_NS}"><w:body>{body}</w:body></w:document>'
    # a style id that is not "Heading1" (as a Dutch Word writes it): the style's name says heading 1
    styles = (f'<?xml version="1.0"?><w:styles xmlns:w="{W_NS}"><w:style w:type="paragraph" w:styleId="Kop1">'
              '<w:name w:val="heading 1"/></w:style></w:styles>')
    styles_rel = "http://schemas.openxmlformats.org/officeDocument/2006/relationships/styles"
    return make_ooxml(path, "word/document.xml", {
        "word/document.xml": document, "word/styles.xml": styles,
        "word/_rels/document.xml.rels": _rels(("rId1", styles_rel, "styles.xml")),
    })


def make_pptx(path: Path, slides: Sequence[tuple[str, Sequence[str]]]) -> Path:
    """A PPTX of (title, body lines) slides."""
    slide_rel = "http://schemas.openxmlformats.org/officeDocument/2006/relationships/slide"
    parts = {}
    ids = []
    rels = []
    for n, (title, lines) in enumerate(slides, start=1):
        paras = "".join(f"<a:p><a:r><a:t>{escape(line)}</a:t></a:r></a:p>" for line in lines)
        parts[f"ppt/slides/slide{n}.xml"] = (
            f'<?xml version="1.0"?><p:sld xmlns:p="{P_NS}" xmlns:a="{A_NS}"><p:cSld><p:spTree>'
            f'<p:sp><p:nvSpPr><p:cNvPr id="1" name="t"/><p:cNvSpPr/><p:nvPr><p:ph type="title"/></p:nvPr></p:nvSpPr>'
            f'<p:txBody><a:p><a:r><a:t>{escape(title)}</a:t></a:r></a:p></p:txBody></p:sp>'
            f'<p:sp><p:nvSpPr><p:cNvPr id="2" name="b"/><p:cNvSpPr/><p:nvPr/></p:nvSpPr>'
            f'<p:txBody>{paras}</p:txBody></p:sp></p:spTree></p:cSld></p:sld>'
        )
        ids.append(f'<p:sldId id="{255 + n}" r:id="rId{n}"/>')
        rels.append((f"rId{n}", slide_rel, f"slides/slide{n}.xml"))
    parts["ppt/presentation.xml"] = (f'<?xml version="1.0"?><p:presentation xmlns:p="{P_NS}" xmlns:r="{R_NS}">'
                                     f'<p:sldIdLst>{"".join(ids)}</p:sldIdLst></p:presentation>')
    parts["ppt/_rels/presentation.xml.rels"] = _rels(*rels)
    return make_ooxml(path, "ppt/presentation.xml", parts)


def make_xlsx(path: Path, sheets: Sequence[tuple[str, Sequence[Sequence[str | int]]]]) -> Path:
    """An XLSX of (name, rows) sheets: text cells as shared strings, numbers as numbers."""
    sheet_rel = "http://schemas.openxmlformats.org/officeDocument/2006/relationships/worksheet"
    strings_rel = "http://schemas.openxmlformats.org/officeDocument/2006/relationships/sharedStrings"
    strings: list[str] = []
    parts = {}
    entries = []
    rels = [("rIdS", strings_rel, "sharedStrings.xml")]
    for n, (name, rows) in enumerate(sheets, start=1):
        xml_rows = []
        for r, row in enumerate(rows, start=1):
            cells = []
            for c, value in enumerate(row):
                ref = f"{chr(65 + c)}{r}"
                if isinstance(value, int):
                    cells.append(f'<c r="{ref}"><v>{value}</v></c>')
                else:
                    strings.append(value)
                    cells.append(f'<c r="{ref}" t="s"><v>{len(strings) - 1}</v></c>')
            xml_rows.append(f'<row r="{r}">{"".join(cells)}</row>')
        parts[f"xl/worksheets/sheet{n}.xml"] = (f'<?xml version="1.0"?><worksheet xmlns="{S_NS}"><sheetData>'
                                                f'{"".join(xml_rows)}</sheetData></worksheet>')
        entries.append(f'<sheet name="{escape(name)}" sheetId="{n}" r:id="rId{n}"/>')
        rels.append((f"rId{n}", sheet_rel, f"worksheets/sheet{n}.xml"))
    parts["xl/workbook.xml"] = (f'<?xml version="1.0"?><workbook xmlns="{S_NS}" xmlns:r="{R_NS}"><sheets>'
                                f'{"".join(entries)}</sheets></workbook>')
    parts["xl/_rels/workbook.xml.rels"] = _rels(*rels)
    parts["xl/sharedStrings.xml"] = (f'<?xml version="1.0"?><sst xmlns="{S_NS}">'
                                     + "".join(f"<si><t>{escape(s)}</t></si>" for s in strings) + "</sst>")
    return make_ooxml(path, "xl/workbook.xml", parts)


ODF_NS = ('xmlns:office="urn:oasis:names:tc:opendocument:xmlns:office:1.0" '
          'xmlns:text="urn:oasis:names:tc:opendocument:xmlns:text:1.0" '
          'xmlns:table="urn:oasis:names:tc:opendocument:xmlns:table:1.0"')


def _odf(path: Path, mimetype: str, body: str) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(zipfile.ZipInfo("mimetype"), mimetype)  # stored, first, as ODF wants
        archive.writestr("content.xml", f'<?xml version="1.0"?><office:document-content {ODF_NS}>'
                                        f'<office:body>{body}</office:body></office:document-content>')
        archive.writestr("META-INF/manifest.xml", '<?xml version="1.0"?><manifest:manifest xmlns:manifest='
                                                  '"urn:oasis:names:tc:opendocument:xmlns:manifest:1.0"/>')
    return path


def _odf_table(rows: Sequence[Sequence[str]], name: str = "") -> str:
    cells = "".join("<table:table-row>" + "".join(
        f'<table:table-cell><text:p>{escape(cell)}</text:p></table:table-cell>' for cell in row)
        # the empty tail of a sheet, as LibreOffice writes it
        + '<table:table-cell table:number-columns-repeated="16380"/></table:table-row>' for row in rows)
    tail = '<table:table-row table:number-rows-repeated="1048570"><table:table-cell/></table:table-row>'
    return f'<table:table table:name="{escape(name)}">{cells}{tail}</table:table>'


def make_odt(path: Path, heading: str, paragraphs: Sequence[str], table: Sequence[Sequence[str]] = ()) -> Path:
    body = f'<text:h text:outline-level="1">{escape(heading)}</text:h>'
    body += "".join(f"<text:p>{escape(text)}</text:p>" for text in paragraphs)
    if table:
        body += _odf_table(table)
    return make_odt_of(path, body)


def make_odt_of(path: Path, body: str) -> Path:
    """An ODT whose ``office:text`` is this XML, as written."""
    return _odf(path, "application/vnd.oasis.opendocument.text", f"<office:text>{body}</office:text>")


def make_ods(path: Path, sheets: Sequence[tuple[str, Sequence[Sequence[str]]]]) -> Path:
    body = "".join(_odf_table(rows, name) for name, rows in sheets)
    return _odf(path, "application/vnd.oasis.opendocument.spreadsheet", f"<office:spreadsheet>{body}</office:spreadsheet>")


def make_epub(path: Path, chapters: Sequence[tuple[str, str]], encrypted: bool = False) -> Path:
    """An EPUB of (title, paragraph) chapters; ``encrypted``: its encryption.xml names them (DRM)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(zipfile.ZipInfo("mimetype"), "application/epub+zip")
        archive.writestr("META-INF/container.xml", (
            '<?xml version="1.0"?><container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container">'
            '<rootfiles><rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/>'
            '</rootfiles></container>'))
        items, refs = [], []
        for n, (title, text) in enumerate(chapters, start=1):
            archive.writestr(f"OEBPS/ch{n}.xhtml", (
                '<?xml version="1.0" encoding="utf-8"?><!DOCTYPE html><html xmlns="http://www.w3.org/1999/xhtml">'
                f"<head><title>{escape(title)}</title></head><body><h1>{escape(title)}</h1>"
                f"<p>{escape(text)}&nbsp;</p></body></html>"))
            items.append(f'<item id="c{n}" href="ch{n}.xhtml" media-type="application/xhtml+xml"/>')
            refs.append(f'<itemref idref="c{n}"/>')
        archive.writestr("OEBPS/content.opf", (
            '<?xml version="1.0"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0">'
            f'<manifest>{"".join(items)}</manifest><spine>{"".join(refs)}</spine></package>'))
        if encrypted:
            refs_xml = "".join(
                '<enc:EncryptedData xmlns:enc="http://www.w3.org/2001/04/xmlenc#"><enc:CipherData>'
                f'<enc:CipherReference URI="OEBPS/ch{n}.xhtml"/></enc:CipherData></enc:EncryptedData>'
                for n in range(1, len(chapters) + 1))
            archive.writestr("META-INF/encryption.xml", '<?xml version="1.0"?><encryption xmlns='
                             f'"urn:oasis:names:tc:opendocument:xmlns:container">{refs_xml}</encryption>')
    return path


def make_html(path: Path, title: str, paragraphs: Sequence[str], table: Sequence[Sequence[str]] = ()) -> Path:
    rows = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in table)
    body = "".join(f"<p>{escape(p)}</p>" for p in paragraphs)
    path.write_text(f"<!DOCTYPE html><html><head><title>x</title><style>p {{color: red}}</style></head><body>"
                    f"<h2>{escape(title)}</h2>{body}<table>{rows}</table><script>var hidden = 1;</script>"
                    "</body></html>")
    return path


def make_zip_bomb(path: Path, member: str = "word/document.xml", size: int = 48 * 1024 * 1024) -> Path:
    """A DOCX whose document unpacks to ``size`` bytes of well-formed XML, nearly all blanks (a few
    hundred KB packed): only a bound on what is unpacked stops it."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        archive.writestr("[Content_Types].xml", CONTENT_TYPES)
        archive.writestr("_rels/.rels", _rels(("rId1", OFFICE_DOC, member)))
        with archive.open(member, "w", force_zip64=True) as stream:
            stream.write(f'<?xml version="1.0"?><w:document xmlns:w="{W_NS}"><w:body>'.encode())
            chunk = b" " * (1024 * 1024)
            for _ in range(size // len(chunk)):
                stream.write(chunk)
    return path
