"""Hybrid search pieces: the keyword query, rank fusion, and what a hit says.

Keywords: a question is a sentence, not a query, so its words are ORed (every word
ANDed, as conversation_search does, would find nothing for most questions), words too
common to mean anything (``STOP_WORDS``) are dropped, and each remaining word is quoted
(``history.quote_fts``'s rule) so no FTS5 syntax can come through. bm25 then ranks the
chunks holding the rarer words of the question first; the index stems English words
(porter), so "backups" finds "backup". A word that many chunks hold is left out of the
ranking when the question has rarer ones (history/kb.py ``RANKED_CHUNKS``): bm25's cost
grows with every chunk it ranks.

Fusion: the bm25 list and the cosine list are merged by reciprocal rank fusion, each
chunk scoring ``sum(1 / (RRF_K + rank))`` over the lists it is in. Ranks, not scores,
are fused, so bm25's unbounded scale and the cosine never need reconciling; a chunk
high in both lists wins.

A chunk only the vectors found must reach ``MIN_VECTOR_SIMILARITY``; one bm25 found
too is kept whatever its cosine.

Similarity shown with a hit: the cosine between query and chunk whenever both have a
vector; otherwise (no embedder, or the chunk not embedded yet) the share of the
question's keywords the chunk contains, marked ``"keywords"``. bm25 itself is no
similarity: its scale depends on the corpus (a one-chunk KB scores ~1e-6).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from history import KbChunk

__all__ = [
    "CANDIDATES",
    "MAX_QUERY_TERMS",
    "MIN_VECTOR_SIMILARITY",
    "RRF_K",
    "STOP_WORDS",
    "Hit",
    "SearchMode",
    "SearchResult",
    "SimilarityKind",
    "fts_phrases",
    "fts_query",
    "keyword_share",
    "query_terms",
    "reciprocal_rank_fusion",
]

SearchMode = Literal["hybrid", "bm25"]
SimilarityKind = Literal["cosine", "keywords"]

RRF_K = 60  # the usual constant (Cormack et al. 2009): damps the weight of the very top ranks
CANDIDATES = 40  # chunks each list contributes to the fusion
MAX_QUERY_TERMS = 24  # keywords kept from a long question (the first ones)
# A chunk found by its vector alone must be at least this similar: the nearest vectors
# always exist, and a "thanks!" should not inject three unrelated chunks. Small sentence
# models put unrelated text at 0 to 0.2; models with a high floor (e5) pass it anyway.
MIN_VECTOR_SIMILARITY = 0.2
SIMILARITY_DIGITS = 4
WORD = re.compile(r"\w+")
# Stemming for keyword_share: a keyword matches a word that starts with its first
# letters, all but the last STEM_SLACK of a long one ("backups" ~ "backup", "backed").
STEM_SLACK = 2
MIN_STEM = 4

STOP_WORDS = frozenset("""
a about above after again against all am an and any are as at be because been before being
below between both but by can could did do does doing down during each few for from further
had has have having he her here hers herself him himself his how i if in into is it its
itself just me more most my myself no nor not now of off on once only or other our ours
ourselves out over own same she should so some such than that the their theirs them
themselves then there these they this those through to too under until up very was we
were what when where which while who whom why will with would you your yours yourself
yourselves tell say says said please thanks thank hi hello ok okay also get got let lets
know think want need like make use using used one two s t d ll m re ve
""".split())


def query_terms(query: str) -> list[str]:
    """The question's keywords: lower case, stop words dropped, each once, in order."""
    words = (w for w in WORD.findall(query.lower()) if w not in STOP_WORDS)
    return list(dict.fromkeys(words))[:MAX_QUERY_TERMS]


def fts_phrases(terms: Sequence[str]) -> list[str]:
    """The keywords as FTS5 phrases, each quoted (the store ORs them)."""
    return ['"' + term.replace('"', '""') + '"' for term in terms]


def fts_query(terms: Sequence[str]) -> str:
    """An FTS5 MATCH expression: the keywords quoted, ORed; '' when there are none."""
    return " OR ".join(fts_phrases(terms))


def _stem(term: str) -> str:
    return term[: max(MIN_STEM, len(term) - STEM_SLACK)]


def keyword_share(terms: Sequence[str], text: str) -> float:
    """The share of ``terms`` that ``text`` contains (by their stems), 0 to 1."""
    if not terms:
        return 0.0
    lowered = text.lower()
    found = sum(1 for term in terms if _starts_word(lowered, _stem(term)))  # a term starts with its stem
    return found / len(terms)


def _starts_word(text: str, prefix: str) -> bool:
    """Whether a word of ``text`` (a run of ``WORD``'s characters) starts with ``prefix``, a
    keyword's stem: found where no word character stands before it (the cheapest test: recall
    tries it on every passage it finds)."""
    at = text.find(prefix)
    while at >= 0:
        if at == 0 or not (text[at - 1].isalnum() or text[at - 1] == "_"):  # what \w matches
            return True
        at = text.find(prefix, at + 1)
    return False


def reciprocal_rank_fusion(*rankings: Iterable[int], k: int = RRF_K) -> list[int]:
    """Ids from several best-first lists, ordered by their summed reciprocal ranks."""
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, chunk_id in enumerate(ranking, start=1):
            scores[chunk_id] = scores.get(chunk_id, 0.0) + 1.0 / (k + rank)
    # ties (the same ranks in different lists) keep the first list's order
    return sorted(scores, key=lambda chunk_id: -scores[chunk_id])


@dataclass
class Hit:
    """One chunk found: where it comes from, how similar it is, and its text."""

    kb: str
    document: str  # the file's name
    path: str
    chunk: int  # 1-based within the document
    chunks: int  # the document's chunk count
    page: int | None  # PDF page
    similarity: float
    similarity_kind: SimilarityKind
    text: str
    chunk_id: int

    @classmethod
    def from_chunk(cls, chunk: KbChunk, similarity: float, kind: SimilarityKind) -> Hit:
        return cls(
            kb=chunk.kb,
            document=chunk.name,
            path=chunk.path,
            chunk=chunk.ordinal,
            chunks=chunk.chunks,
            page=chunk.page,
            similarity=round(similarity, SIMILARITY_DIGITS),
            similarity_kind=kind,
            text=chunk.text,
            chunk_id=chunk.id,
        )

    def to_json(self) -> dict[str, Any]:
        """The hit as the kb_search tool (and a client) shows it."""
        data: dict[str, Any] = {
            "kb": self.kb,
            "file": self.document,
            "path": self.path,
            "chunk": self.chunk,
            "chunks": self.chunks,
        }
        if self.page is not None:
            data["page"] = self.page
        data["similarity"] = self.similarity
        data["similarity_kind"] = self.similarity_kind
        data["content"] = self.text
        return data


@dataclass
class SearchResult:
    """The hits of one search, how it was searched, and why vectors were not used if not."""

    hits: list[Hit]
    mode: SearchMode
    note: str | None = None  # e.g. the embedder failed, keyword search only
