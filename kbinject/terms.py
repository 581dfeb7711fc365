"""The keywords a recall searches with, and the relevance floor its passages must pass.

Shared by the conversation's own archive (archive.py) and the other conversations and saved
memories (elsewhere.py): the same words, the same floor (archive.py's docstring says how).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .chunking import CHUNK_CHARS, CHUNK_OVERLAP, chunk_text
from .search import fts_phrases, keyword_share, query_terms

__all__ = ["MIN_MATCHED", "Terms", "best_piece", "held", "normalized"]

BACK_REFERENCE_TERMS = 3  # a question with fewer keywords is searched with the recent turns' too
RECENT_TERMS = 12  # keywords taken from the recent turns, at most
MIN_MATCHED = 2  # keywords of the question a passage must hold at most (half of them when fewer)
# A text this short is one chunk, whatever its lines: no block of it is cut (chunking.py
# cuts a block longer than this, the room a piece has behind the overlap)
ONE_CHUNK_CHARS = CHUNK_CHARS - CHUNK_OVERLAP - 2
# Words of a question that refers back and say nothing of what it asks for
BACK_REFERENCE_WORDS = frozenset("""
gave give given told remember remind mentioned earlier before previously wrote sent shared
provided last time ago back recall
""".split())


@dataclass(frozen=True)
class Terms:
    """The keywords a recall searches with: the question's, and the recent turns' when it has few."""

    question: list[str]
    recent: list[str]

    @classmethod
    def of(cls, question: str, recent: str) -> Terms:
        asked = [t for t in query_terms(question) if t not in BACK_REFERENCE_WORDS]
        if len(asked) >= BACK_REFERENCE_TERMS:
            return cls(asked, [])
        return cls(asked, [t for t in query_terms(recent) if t not in asked][:RECENT_TERMS])

    def relevant(self, text: str) -> bool:
        """The floor: half the question's keywords (its words, when it has numbers too: "12 times
        12" is about times), at most ``MIN_MATCHED``; a question of none needs that many of the
        recent turns' keywords."""
        words = [t for t in self.question if not t.isdigit()] or self.question
        if not words:
            return held(self.recent, text) >= MIN_MATCHED
        return held(words, text) >= min(MIN_MATCHED, (len(words) + 1) // 2)

    def must_hold(self) -> list[list[str]]:
        """The phrases (``fts_phrases``) a passage past the floor holds one of, as ``relevant`` and
        the vectors' floor ask: the question's words, else its numbers; the first list of these
        with a phrase that is not common counts (``history.fts.match_holding``); none: the recent
        turns' keywords decide, and any of them may match."""
        words = [t for t in self.question if not t.isdigit()]
        return [fts_phrases(words), fts_phrases(self.question)]

    def without(self, common: frozenset[str]) -> Terms:
        """These terms less those whose phrase is in ``common`` (too common to tell a passage)."""
        def rare(term: str) -> bool:
            return fts_phrases([term])[0] not in common
        return Terms([t for t in self.question if rare(t)], [t for t in self.recent if rare(t)])

    def strength(self, text: str) -> float:
        return keyword_share([*self.question, *self.recent], text)


def held(terms: Sequence[str], text: str) -> int:
    """How many of ``terms`` ``text`` holds (by their stems, as search.py matches them)."""
    return round(keyword_share(terms, text) * len(terms))


def normalized(text: str) -> str:
    """Text with its whitespace runs made one space, lower case: for containment checks."""
    return " ".join(text.split()).lower()


def best_piece(text: str, terms: Terms) -> str:
    """A message as a passage: whole when short, else its chunk holding most keywords."""
    if len(text) <= ONE_CHUNK_CHARS:  # most messages: no need to cut them to know
        return text
    pieces = chunk_text(text)
    if len(pieces) <= 1:
        return text
    return max(pieces, key=lambda piece: terms.strength(piece.text)).text
