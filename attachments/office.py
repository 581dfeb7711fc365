"""Documents as attachments: DOCX, PPTX, XLSX, ODT, ODS, EPUB and HTML, read to text.

The kinds and why they are read with the standard library (zipfile, ElementTree on expat,
html.parser): docs/DESIGN.md, "Attachments". This module tells a document by its content
(``sniff``), reads it in a worker thread (``read_document``) and lays its text out for the
model (``document_body``) and for recall (``document_full_text``), as ``pdf.py`` does a PDF's:

- A document is told by what it holds, not only its name: a zip whose ``mimetype`` member
  names an OpenDocument text or spreadsheet or an EPUB, or whose package relationships
  (``[Content_Types].xml``) hold a Word, PowerPoint or Excel main part; HTML by its suffix
  or a ``<!doctype html>`` / ``<html`` start. A document suffix on a file that is not such
  an archive is a damaged document, not an unknown kind; an OLE2 file named ``.docx`` is an
  encrypted (password-protected) one.
- Slides, sheets and an EPUB's chapters are the pages of their documents (``UNITS``): the
  block puts ``[slide N]`` before each, the recall text joins them with ``PAGE_BREAK``, and
  the chip's ``pages`` counts them. A DOCX, ODT or HTML file is one page, read by offset.
- An EPUB whose chapters are encrypted (``META-INF/encryption.xml`` naming one, DRM) is
  refused; font obfuscation, which encrypts only fonts, is not DRM and is read.
"""

from __future__ import annotations

import logging
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote
from xml.etree import ElementTree as ET

from core.errors import FileRefused, UnsupportedKind
from core.files import open_regular

from .archive import Archive, damaged
from .budget import FULL_TEXT_CAP
from .classify import TEXT_SUFFIXES
from .doctext import Full, Writer
from .markup import MAX_HTML_BYTES, decode_html, html_text
from .odf import ODF_ENCRYPTED, read_ods, read_odt
from .ooxml import read_docx, read_pptx, read_xlsx
from .pdf import PAGE_BREAK

__all__ = [
    "DOCUMENT_KINDS",
    "MIME_TYPES",
    "UNITS",
    "DocumentText",
    "document_body",
    "document_full_text",
    "read_document",
    "sniff",
    "unsupported",
]

DOCUMENT_KINDS = ("docx", "pptx", "xlsx", "odt", "ods", "epub", "html")
# the page of a paged kind (a PDF's is "page": pdf.py)
UNITS = {"pptx": "slide", "xlsx": "sheet", "ods": "sheet", "epub": "chapter"}
FORMATS = {"docx": "DOCX", "pptx": "PPTX", "xlsx": "XLSX", "odt": "ODT", "ods": "ODS", "epub": "EPUB",
           "html": "HTML"}
MIME_TYPES = {
    "docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
    "pptx": "application/vnd.openxmlformats-officedocument.presentationml.presentation",
    "xlsx": "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
    "odt": "application/vnd.oasis.opendocument.text",
    "ods": "application/vnd.oasis.opendocument.spreadsheet",
    "epub": "application/epub+zip",
    "html": "text/html",
}
SUFFIXES = {
    "docx": "docx", "docm": "docx", "dotx": "docx", "dotm": "docx",
    "pptx": "pptx", "pptm": "pptx", "ppsx": "pptx", "potx": "pptx",
    "xlsx": "xlsx", "xlsm": "xlsx", "xltx": "xlsx",
    "odt": "odt", "ott": "odt", "ods": "ods", "ots": "ods", "epub": "epub",
    "html": "html", "htm": "html", "xhtml": "html",
}
# the mimetype member of an ODF package or an EPUB (templates read as their documents)
PACKAGE_MIMETYPES = {
    "application/vnd.oasis.opendocument.text": "odt",
    "application/vnd.oasis.opendocument.text-template": "odt",
    "application/vnd.oasis.opendocument.spreadsheet": "ods",
    "application/vnd.oasis.opendocument.spreadsheet-template": "ods",
    "application/epub+zip": "epub",
}
# an OOXML package's main part, by its usual name (the relationships say where it really is)
OOXML_PARTS = {"word/document.xml": "docx", "ppt/presentation.xml": "pptx", "xl/workbook.xml": "xlsx"}
ZIP_MAGIC = b"PK\x03\x04"
OLE2_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"
# the comments possessive (``*+``): a lazy ``.*?`` under ``*`` that may backtrack tries every way to
# split N comments (2**N), and the regex holds the GIL: a file of 40 "<!---->" froze the daemon
_HTML_START = re.compile(rb"\A(?:\xef\xbb\xbf)?\s*(?:<!--.*?-->\s*)*+<(?:!doctype\s+html|html[\s>])", re.I | re.S)
OPF = "{http://www.idpf.org/2007/opf}"
CONTAINER = "{urn:oasis:names:tc:opendocument:xmlns:container}"
XENC = "{http://www.w3.org/2001/04/xmlenc#}"
# bytes of the mimetype member read
MIMETYPE_BYTES = 256

logger = logging.getLogger(__name__)


@dataclass
class DocumentText:
    """A document's text: its pages (one for a kind without pages), whether it was cut."""

    kind: str
    pages: list[str]
    cut: bool = False

    @property
    def paged(self) -> bool:
        return self.kind in UNITS


def unsupported(name: str) -> UnsupportedKind:
    """The refusal of a kind chat does not take, naming those it does."""
    return UnsupportedKind(
        f"{name}: chat supports text, images, PDF, documents (DOCX, PPTX, XLSX, ODT, ODS, EPUB, HTML) and videos"
    )


def _package_kind(archive: Archive) -> str | None:
    """What kind of document a zip is, by its members; None when none."""
    if archive.has("mimetype"):
        declared = archive.read("mimetype", MIMETYPE_BYTES).decode("ascii", "replace").strip()
        if declared in PACKAGE_MIMETYPES:
            return PACKAGE_MIMETYPES[declared]
    if archive.has("[Content_Types].xml"):
        for part, kind in OOXML_PARTS.items():
            if archive.has(part):
                return kind
    return None


def sniff(path: str, name: str, suffix: str, head: bytes) -> str | None:
    """The document kind of a file (blocking), None when it is no document; FileRefused for a
    file named as a document that is not a readable one."""
    named = SUFFIXES.get(suffix)
    # a text suffix wins over the content, as in classify(): notes.txt that opens with <html> is text
    if named == "html" or (named is None and suffix not in TEXT_SUFFIXES and _HTML_START.match(head)):
        return "html"
    if head.startswith(ZIP_MAGIC):
        try:
            with Archive(path, name, FORMATS.get(named or "", "document")) as archive:
                kind = _package_kind(archive)
        except FileRefused:
            if named is not None:
                raise
            return None  # a zip of no document's name that cannot be read: an unknown kind, as before
        if kind is None and named is not None:
            raise damaged(name, FORMATS[named], "the archive holds none of its parts")
        return kind
    if named is None:
        return None
    if head.startswith(OLE2_MAGIC) and named in ("docx", "pptx", "xlsx"):
        raise FileRefused(f"{name}: the {FORMATS[named]} is password-protected (or an old binary Office "
                          "file under a new name); attach an unlocked copy, saved as " + FORMATS[named])
    raise damaged(name, FORMATS[named], "not a zip archive")


# -- EPUB ---------------------------------------------------------------------------------


def _epub_spine(archive: Archive) -> list[str]:
    """The members of an EPUB's chapters, in reading order."""
    rootfile = archive.xml("META-INF/container.xml").find(f"{CONTAINER}rootfiles/{CONTAINER}rootfile")
    opf = rootfile.get("full-path", "") if rootfile is not None else ""
    if not archive.has(opf):
        raise damaged(archive.name, archive.what, "its package document is missing")
    package = archive.xml(opf)
    folder = posixpath.dirname(opf)
    items = {
        item.get("id", ""): posixpath.normpath(posixpath.join(folder, unquote(item.get("href", ""))))
        for item in package.iter(OPF + "item")
    }
    return [items[ref.get("idref", "")] for ref in package.iter(OPF + "itemref") if ref.get("idref", "") in items]


def _epub_encrypted(archive: Archive) -> set[str]:
    """The members ``META-INF/encryption.xml`` says are encrypted."""
    if not archive.has("META-INF/encryption.xml"):
        return set()
    return {
        posixpath.normpath(unquote(ref.get("URI", "")))
        for ref in archive.xml("META-INF/encryption.xml").iter(XENC + "CipherReference")
    }


def _read_epub(archive: Archive, out: Writer) -> None:
    """An EPUB's chapters with text, one page each."""
    spine = _epub_spine(archive)
    if _epub_encrypted(archive) & set(spine):
        raise FileRefused(f"{archive.name}: the EPUB is protected by DRM (its chapters are encrypted); "
                          "attach a copy without DRM")
    for member in spine:
        if not archive.has(member):
            continue
        text = html_text(decode_html(archive.read(member, MAX_HTML_BYTES)))
        if text.strip():
            for line in text.splitlines():
                out.line(line)
            out.page()


def _read_zip(path: str, name: str, kind: str, out: Writer) -> None:
    readers: dict[str, Callable[[Archive, Writer], None]] = {
        "docx": read_docx, "pptx": read_pptx, "xlsx": read_xlsx, "odt": read_odt, "ods": read_ods,
        "epub": _read_epub,
    }
    with Archive(path, name, FORMATS[kind]) as archive:
        if kind in ("odt", "ods") and archive.has("META-INF/manifest.xml"):
            if ODF_ENCRYPTED in archive.read("META-INF/manifest.xml"):
                raise FileRefused(f"{name}: the {FORMATS[kind]} is password-protected; attach an unlocked copy")
        readers[kind](archive, out)


def _read_html(path: str, out: Writer) -> bool:
    """An HTML file's text; whether it was cut (read only to ``MAX_HTML_BYTES``)."""
    with open_regular(path) as handle:
        raw = handle.read(MAX_HTML_BYTES + 1)
    for line in html_text(decode_html(raw[:MAX_HTML_BYTES])).splitlines():
        out.line(line)
    return len(raw) > MAX_HTML_BYTES


def read_document(path: str, name: str, kind: str) -> DocumentText:
    """A document's text, at most ``FULL_TEXT_CAP`` characters (blocking: a worker thread).

    Raises FileRefused naming the file when it is damaged, encrypted or past a bound.
    """
    out = Writer()
    cut = False
    try:
        if kind == "html":
            cut = _read_html(path, out)
        else:
            _read_zip(path, name, kind, out)
    except Full:
        cut = True
    except ET.ParseError as exc:  # a part parsed whole elsewhere than Archive.xml
        raise damaged(name, FORMATS[kind], str(exc)) from None
    except RecursionError:
        raise damaged(name, FORMATS[kind], "nested too deeply") from None
    except FileRefused:
        raise
    except Exception as exc:  # a walk tripped on a structure no reader expects: the file's fault
        logger.debug("reading %s failed", name, exc_info=True)
        raise damaged(name, FORMATS[kind], f"{type(exc).__name__}: {exc}") from None
    pages = out.finish()
    if kind not in UNITS:
        pages = ["\n".join(pages)]
    return DocumentText(kind, pages, cut)


def document_body(document: DocumentText) -> str:
    """The text of a document's block: a paged one's pages each after ``[slide N]`` (its unit)."""
    if not document.paged:
        body = document.pages[0]
    else:
        unit = UNITS[document.kind]
        body = "\n\n".join(
            f"[{unit} {n}]\n{page}" if page.strip() else f"[{unit} {n}: no text]"
            for n, page in enumerate(document.pages, start=1)
        )
    if document.cut:
        body += "\n[the text stops here: the document's text passed the size limit]"
    return body


def document_full_text(document: DocumentText) -> str:
    """The text kept for recall: pages joined by ``PAGE_BREAK`` (``split(PAGE_BREAK)[n - 1]``
    is slide, sheet or chapter n), a note at the end when cut."""
    full = PAGE_BREAK.join(document.pages)
    if document.cut:
        full += f"\n[… the text stops here: only the first {FULL_TEXT_CAP} characters are kept]"
    return full
