"""Full-text search over `message_fts`: bm25 ranking that stays fast at a million messages.

Why not plain ``ORDER BY bm25()``: bm25 weighs each query phrase by its IDF, and FTS5
computes that on every query by walking the phrase's whole doclist, every row of the
table that holds it, whatever the MATCH is confined to. A search inside one
conversation finds its matches by seeking in its rowid range, but ranking them still
walks a common word's doclist over the whole table, most of the search's time at a
million messages (``bench/bench_search.py``). So bm25 is kept where it carries
information and the walk skipped where it carries almost none (what that costs in
ranking: docs/DESIGN.md, "History store"):

- Each phrase is classed *weighed* or *frequent* (held by more than ``FREQUENT_DOCS``
  messages), from a count that stops at ``FREQUENT_DOCS + 1`` rows, remembered in
  ``PhraseStats``.
- Weighed phrases are ranked by FTS5's own ``bm25()``; their IDF walks are short by
  construction.
- Frequent phrases still filter (every result holds every query word) through a second
  MATCH over the same rowid range that ranks nothing, but they are left out of the bm25
  expression: **the approximation**. Such a phrase's IDF is at most
  log(N / FREQUENT_DOCS); below ``FREQUENT_DOCS`` messages in all, the rank is exactly bm25.
- A query of frequent phrases only has nothing cheap to rank by: its matches come newest
  first, with rank 0.
- A search ranks at most the newest (highest rowid) ``CONVERSATION_CAP`` matches of its
  weighed phrases inside one conversation, ``ALL_CAP`` across all of them.

Equal ranks list the newest first. Excerpts come from ``snippet()`` over the whole query,
frequent words included, built only for the hits kept.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field

from .fts import CONVERSATION_SHIFT, MAX_TURN, SUMMARY_SLOT, TURN_SHIFT, quoted_phrases
from .records import SearchHit

# A phrase held by more messages than this is not weighed by bm25 (module docstring).
FREQUENT_DOCS = 100_000
# The most matches one search ranks, the newest kept. A conversation's rows sit together
# in the file; the rows of a search over everything are scattered, each a docsize lookup
# and the term offsets of a row on its own page, so fewer of them are ranked.
CONVERSATION_CAP = 10_000
ALL_CAP = 5_000
# Phrase classes remembered; past this the memory starts again (queries repeat few words).
MAX_REMEMBERED_PHRASES = 4096
# The whole rowid space: the bounds of a search over every conversation.
ALL_ROWIDS = (0, (1 << 63) - 1)

# Tokens of context around the matched terms in an excerpt; brackets mark the match.
SNIPPET_TOKENS = 12
SEARCH_SNIPPET = f"snippet(message_fts, 0, '[', ']', '…', {SNIPPET_TOKENS})"

COUNT_CAPPED = """
SELECT count(*) FROM (SELECT 1 FROM message_fts WHERE message_fts MATCH ? LIMIT ?)
"""
# The rowid just below the newest `cap` matches of the weighed phrases, if there are
# more. Only the weighed ones: a frequent phrase in this AND would be sought in its long
# doclist once per match.
CAP_CUTOFF = """
SELECT rowid FROM message_fts
WHERE message_fts MATCH :weighed AND rowid BETWEEN :lo AND :hi
ORDER BY rowid DESC LIMIT 1 OFFSET :cap
"""
ROLE_FILTER = "AND (:role IS NULL OR role = :role)"
# Frequent phrases filter through a second cursor that ranks nothing, over the same
# (capped) rowid range; the unary + keeps SQLite from handing the IN list to FTS5 as
# rowid lookups, each a new FTS5 query.
FREQUENT_FILTER = """
AND +rowid IN (
    SELECT f.rowid FROM message_fts AS f
    WHERE f.message_fts MATCH :query AND f.rowid BETWEEN :lo AND :hi
)
"""
# bm25() is selected once under an alias and ordered by it: `ORDER BY rank` would have
# FTS5 rank in its own sorter and again for the output column. Equal scores go newest first,
# as the hits are shown: without it which of them a LIMIT keeps is the sorter's choice, and
# `search` pages (``offset``) would repeat or skip hits.
RANKED_HITS = """
SELECT rowid AS id, bm25(message_fts) AS score
FROM message_fts
WHERE message_fts MATCH :weighed AND rowid BETWEEN :lo AND :hi {role} {frequent}
ORDER BY score, id DESC
LIMIT :limit
"""
NEWEST_HITS = f"""
SELECT rowid AS id, 0.0 AS score
FROM message_fts
WHERE message_fts MATCH :query AND rowid BETWEEN :lo AND :hi {ROLE_FILTER}
ORDER BY rowid DESC
LIMIT :limit
"""
# The few hits kept are looked up again by rowid for their role and excerpt: snippet()
# beside the rank in the query above would be built for every candidate. A compaction
# summary (slot SUMMARY_SLOT) is dated by its compaction, not by the turn it ends at.
HIT_DETAILS = f"""
WITH hits AS MATERIALIZED ({{hits}})
SELECT t.conversation_id, t.turn, message_fts.role, {SEARCH_SNIPPET} AS excerpt,
       h.score AS rank,
       CASE WHEN (h.id & 255) = {SUMMARY_SLOT} THEN coalesce(
           (SELECT k.created_at FROM compactions AS k
            WHERE k.conversation_id = t.conversation_id AND k.through_turn = t.turn
            ORDER BY k.id DESC LIMIT 1),
           t.created_at)
       ELSE t.created_at END AS created_at
FROM hits AS h
CROSS JOIN message_fts ON message_fts.rowid = h.id AND message_fts MATCH :query
JOIN turns AS t ON t.conversation_id = h.id >> {CONVERSATION_SHIFT}
               AND t.turn = (h.id >> {TURN_SHIFT}) & {MAX_TURN}
JOIN conversations AS c ON c.id = t.conversation_id AND c.deleted_at IS NULL
ORDER BY h.score, h.id DESC
"""


def _hits_sql(weighed: bool, filtered: bool) -> str:
    if not weighed:
        return HIT_DETAILS.format(hits=NEWEST_HITS)
    ranked = RANKED_HITS.format(role=ROLE_FILTER, frequent=FREQUENT_FILTER if filtered else "")
    return HIT_DETAILS.format(hits=ranked)


SEARCH_RANKED = _hits_sql(weighed=True, filtered=False)
SEARCH_RANKED_FILTERED = _hits_sql(weighed=True, filtered=True)
SEARCH_NEWEST = _hits_sql(weighed=False, filtered=False)


@dataclass
class PhraseStats:
    """Which phrases are frequent, remembered between searches.

    A phrase counted at ``docs`` (<= FREQUENT_DOCS) rows stays weighed at least until
    that many more rows have been indexed; a frequent one stays frequent until rows are
    deleted. The store reports both through ``indexed`` and ``forget``.
    """

    known: dict[str, tuple[int, int]] = field(default_factory=dict)  # phrase -> (docs, at)
    rows_indexed: int = 0

    def indexed(self, rows: int) -> None:
        """``rows`` more rows are in the index."""
        self.rows_indexed += rows

    def forget(self) -> None:
        """Rows left the index: every remembered count may be too high now."""
        self.known.clear()

    def frequent(self, conn: sqlite3.Connection, phrase: str) -> bool:
        """Whether more than FREQUENT_DOCS rows hold ``phrase`` (one capped count, or none)."""
        remembered = self.known.get(phrase)
        if remembered is not None:
            docs, at = remembered
            if docs > FREQUENT_DOCS or docs + self.rows_indexed - at <= FREQUENT_DOCS:
                return docs > FREQUENT_DOCS
        docs = conn.execute(COUNT_CAPPED, (phrase, FREQUENT_DOCS + 1)).fetchone()[0]
        if len(self.known) >= MAX_REMEMBERED_PHRASES:
            self.known.clear()
        self.known[phrase] = (docs, self.rows_indexed)
        return bool(docs > FREQUENT_DOCS)


def search(
    conn: sqlite3.Connection,
    stats: PhraseStats,
    query: str,
    limit: int,
    bounds: tuple[int, int] = ALL_ROWIDS,
    role: str | None = None,
    cap: int = ALL_CAP,
) -> list[SearchHit]:
    """The best ``limit`` matches of ``query`` among the rows whose rowid is within ``bounds``.

    At most the newest ``cap`` rows holding the query's weighed phrases are ranked.
    """
    phrases = quoted_phrases(query)
    if not phrases or limit <= 0:
        return []
    everything = " ".join(phrases)
    weighed = [p for p in phrases if not stats.frequent(conn, p)]
    lo, hi = bounds
    params: dict[str, object] = {
        "query": everything,
        "weighed": " ".join(weighed),
        "lo": lo,
        "hi": hi,
        "role": role,
        "limit": limit,
    }
    if not weighed:
        sql = SEARCH_NEWEST
    else:
        cutoff = conn.execute(CAP_CUTOFF, {**params, "cap": cap}).fetchone()
        if cutoff is not None:
            params["lo"] = cutoff[0] + 1
        sql = SEARCH_RANKED_FILTERED if len(weighed) < len(phrases) else SEARCH_RANKED
    return [SearchHit.from_row(row) for row in conn.execute(sql, params)]
