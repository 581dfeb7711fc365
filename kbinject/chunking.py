"""Cutting a document into chunks that follow its structure and stay a bounded size.

A document is first cut into *sections* that a chunk never spans: a PDF page (so every
chunk has one exact page number) or a markdown heading with what follows it. A section
is cut into *blocks* at blank lines (paragraphs; in code, roughly one definition each),
and a block longer than a chunk is cut at a line end, else a sentence end, else a space.
Blocks are then packed greedily into chunks of at most ``CHUNK_CHARS`` characters; each
chunk after the first of a section starts with the last ``CHUNK_OVERLAP`` characters of
the one before (from a word boundary), so a sentence cut between two chunks is whole in
one of them.

Why ``CHUNK_CHARS`` is 1,000: every chunk is embedded on its own, and llama-server's
embedding endpoint refuses an input longer than its batch (512 tokens by default) with
HTTP 500. English prose runs about four characters a token and code about three, so
1,000 characters is 250-350 tokens, well inside; dense scripts (CJK) can still pass it,
which the embedder handles by halving the input (embedder.py). A markdown section
shorter than ``MIN_CHUNK_CHARS`` shares a chunk with the next, so a heading followed by
one line does not become a chunk of its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "CHUNK_CHARS",
    "CHUNK_OVERLAP",
    "MARKDOWN_SUFFIXES",
    "MIN_CHUNK_CHARS",
    "Chunk",
    "chunk_pages",
    "chunk_text",
]

CHUNK_CHARS = 1_000  # most characters in one chunk, overlap included
CHUNK_OVERLAP = 150  # characters of a chunk repeated at the start of the next in its section
MIN_CHUNK_CHARS = 200  # a markdown section shorter than this shares a chunk with the next
MARKDOWN_SUFFIXES = frozenset({"md", "markdown", "mdown", "mkd", "mdx"})

PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n+")
HEADING = re.compile(r"^ {0,3}#{1,6}(?:[ \t]|$)")
FENCE = re.compile(r"^ {0,3}(```|~~~)")
SENTENCE_END = re.compile(r"[.!?;:](?=\s)")
LAYOUT_SPACES = re.compile(r"[ \t]{2,}")
# A break closer to the start than this share of the limit wastes too much of a chunk.
MIN_BREAK_SHARE = 0.5


@dataclass(frozen=True)
class Chunk:
    """One chunk of a document: its text and, for a PDF, its page (1-based)."""

    page: int | None
    text: str


@dataclass(frozen=True)
class _Piece:
    """A block (or a part of a long one) to pack; ``continued`` if it goes on the block before."""

    text: str
    continued: bool = False


def _break_at(text: str, limit: int) -> int:
    """Where to cut ``text`` so the first part is at most ``limit`` characters."""
    window = text[: limit + 1]
    floor = int(limit * MIN_BREAK_SHARE)
    newline = window.rfind("\n")
    if newline >= floor:
        return newline + 1
    ends = [m.end() for m in SENTENCE_END.finditer(window) if m.end() <= limit]
    if ends and ends[-1] >= floor:
        return ends[-1]
    space = window.rfind(" ")
    if space >= floor:
        return space + 1
    return limit


def _split_block(block: str, limit: int) -> Iterator[_Piece]:
    """A block as pieces of at most ``limit`` characters, cut at the best break available."""
    continued = False
    while len(block) > limit:
        cut = _break_at(block, limit)
        head = block[:cut].rstrip()
        if head:
            yield _Piece(head, continued)
            continued = True
        block = block[cut:].lstrip()
    if block:
        yield _Piece(block, continued)


def _tail(text: str, size: int) -> str:
    """The last ``size`` characters of ``text`` or fewer, starting at a word."""
    if len(text) <= size:
        return text
    tail = text[-size:]
    space = re.search(r"\s", tail)
    return tail[space.end():] if space else tail


def _blocks(section: str) -> list[str]:
    return [b.strip("\n").rstrip() for b in PARAGRAPH_BREAK.split(section) if b.strip()]


def _pack(pieces: Sequence[_Piece]) -> list[str]:
    """Pieces of one section packed into chunks, each after the first overlapping the last."""
    chunks: list[str] = []
    current = ""
    for piece in pieces:
        joint = " " if piece.continued else "\n\n"
        if not current:
            current = piece.text
        elif len(current) + len(joint) + len(piece.text) <= CHUNK_CHARS:
            current += joint + piece.text
        else:
            chunks.append(current)
            overlap = _tail(current, CHUNK_OVERLAP)
            current = overlap + joint + piece.text if overlap else piece.text
    if current:
        chunks.append(current)
    return chunks


def _section_chunks(section: str) -> list[str]:
    # Room for the overlap and its joint, so a piece always fits behind them.
    limit = CHUNK_CHARS - CHUNK_OVERLAP - 2
    pieces = [piece for block in _blocks(section) for piece in _split_block(block, limit)]
    return _pack(pieces)


def _markdown_sections(text: str) -> list[str]:
    """Text cut before each heading (outside fenced code); short sections join the next."""
    sections: list[list[str]] = [[]]
    fenced = False
    for line in text.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and HEADING.match(line) and any(s.strip() for s in sections[-1]):
            sections.append([])
        sections[-1].append(line)
    merged: list[str] = []
    pending = ""
    for lines in sections:
        section = "\n".join(lines).strip("\n")
        pending = f"{pending}\n\n{section}" if pending else section
        if len(pending) >= MIN_CHUNK_CHARS:
            merged.append(pending)
            pending = ""
    if pending.strip():
        merged.append(pending)
    return merged


def _clean(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", " ")


def chunk_text(text: str, *, markdown: bool = False) -> list[Chunk]:
    """Chunks of a text or code file; ``markdown`` cuts sections at headings as well."""
    text = _clean(text)
    sections = _markdown_sections(text) if markdown else [text]
    return [Chunk(None, chunk) for section in sections for chunk in _section_chunks(section)]


def _page_text(page: str) -> str:
    # pdftotext -layout aligns columns with runs of spaces: one is enough for reading.
    lines = (LAYOUT_SPACES.sub(" ", line).strip() for line in _clean(page).split("\n"))
    return "\n".join(lines)


def chunk_pages(pages: Sequence[str]) -> list[Chunk]:
    """Chunks of a PDF's pages (page 1 first); a chunk never spans two pages."""
    return [
        Chunk(number, chunk)
        for number, page in enumerate(pages, start=1)
        for chunk in _section_chunks(_page_text(page))
    ]
