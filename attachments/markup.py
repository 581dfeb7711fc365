"""HTML (and an EPUB's XHTML chapters) as Markdown-ish text, through ``html.parser``.

``html.parser`` and not expat, even for XHTML: an EPUB's chapters use HTML's named entities
(``&nbsp;``) that expat, which never loads the DTD, calls undefined; and a web page saved
from a browser is seldom well-formed. What is kept: headings as ``#``, paragraphs and other
blocks on lines of their own, list items as ``- ``, table rows as ``| a | b |``; scripts,
styles and the ``<head>`` are left out. Whitespace runs collapse outside ``<pre>``.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

__all__ = ["MAX_HTML_BYTES", "decode_html", "html_text"]

# bytes of one HTML file (or EPUB chapter) read: html.parser is Python, some 10 MB a second
MAX_HTML_BYTES = 16 * 1024 * 1024
HEADINGS = {f"h{n}": n for n in range(1, 7)}
BLOCKS = frozenset("""
    p div section article aside header footer main nav blockquote pre figure figcaption
    address dl dt dd ul ol form fieldset hr body caption details summary
""".split())
SKIPPED = frozenset({"script", "style", "noscript", "template", "head", "svg", "math", "iframe", "object"})
VOID = frozenset("area base br col embed hr img input link meta param source track wbr".split())
_SPACES = re.compile(r"[ \t\r\n\f\v]+")
_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([A-Za-z0-9._:-]+)""", re.IGNORECASE)


class _Walker(HTMLParser):
    """Collects the lines of Markdown-ish text as the parser walks the markup."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.lines: list[str] = []
        self.line: list[str] = []
        self.prefix = ""
        self.skipping: list[str] = []  # the skipped elements open
        self.pre = 0
        self.row: list[str] | None = None  # a table row's cells so far
        self.cell: list[str] | None = None
        self.header_rows = 0  # rows of the current table written (a separator follows the first)
        self.tables: list[int] = []

    def flush(self, keep: bool = False) -> None:
        """End the line; ``keep``: an empty line keeps its prefix (``<li><p>text``: the item's ``- ``)."""
        text = "".join(self.line)
        text = text.strip("\n") if self.pre else _SPACES.sub(" ", text).strip()
        if text:
            self.lines.append(self.prefix + text)
        elif keep:
            return
        self.line = []
        self.prefix = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "body" and "head" in self.skipping:  # HTML may leave </head> out: the body ends it
            del self.skipping[self.skipping.index("head"):]
        if tag in SKIPPED and tag not in VOID:
            self.skipping.append(tag)
        if self.skipping:
            return
        if tag == "table":
            self.flush()
            self.tables.append(0)
        elif tag == "tr":
            self.row = []
        elif tag in ("td", "th"):
            self.cell = []
        elif tag == "br":
            self._text("\n" if self.pre or self.cell is None else " ")
            if not self.pre and self.cell is None:
                self.flush()
        elif tag in HEADINGS:
            self.flush()
            self.prefix = "#" * HEADINGS[tag] + " "
        elif tag == "li":
            self.flush()
            self.prefix = "- "
        elif tag in BLOCKS:
            self.flush(keep=True)
            if tag == "pre":
                self.pre += 1

    def handle_endtag(self, tag: str) -> None:
        if self.skipping:
            if tag == self.skipping[-1]:
                self.skipping.pop()
            return
        if tag in ("td", "th") and self.cell is not None and self.row is not None:
            self.row.append(_SPACES.sub(" ", "".join(self.cell)).strip().replace("|", "\\|"))
            self.cell = None
        elif tag == "tr" and self.row is not None:
            self._end_row()
        elif tag == "table" and self.tables:
            self.tables.pop()
        elif tag in HEADINGS or tag in BLOCKS or tag == "li":
            self.flush()
            if tag == "pre" and self.pre:
                self.pre -= 1

    def _end_row(self) -> None:
        assert self.row is not None
        while self.row and not self.row[-1]:
            self.row.pop()  # a layout table's empty tail
        if self.row:
            self.lines.append("| " + " | ".join(self.row) + " |")
            if self.tables and self.tables[-1] == 0:
                self.lines.append("|" + " --- |" * len(self.row))
            if self.tables:
                self.tables[-1] += 1
        self.row = None

    def handle_data(self, data: str) -> None:
        if not self.skipping:
            self._text(data)

    def _text(self, data: str) -> None:
        (self.cell if self.cell is not None else self.line).append(data)


def decode_html(raw: bytes) -> str:
    """HTML bytes as text: by a byte order mark, else a ``<meta charset>`` near the start,
    else UTF-8 (undecodable bytes replaced)."""
    if raw.startswith(b"\xef\xbb\xbf"):
        return raw[3:].decode("utf-8", "replace")
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        return raw.decode("utf-16", "replace")
    if found := _CHARSET.search(raw[:4096]):
        try:
            return raw.decode(found[1].decode("ascii"), "replace")
        except LookupError:
            pass
    return raw.decode("utf-8", "replace")


def html_text(markup: str) -> str:
    """The Markdown-ish text of an HTML document (blocking)."""
    walker = _Walker()
    walker.feed(markup)
    walker.close()
    if walker.row is not None:
        walker._end_row()
    walker.flush()
    return "\n".join(walker.lines)
