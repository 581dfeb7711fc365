"""The FTS5 message index: rowid layout, searchable text, query quoting.

`message_fts` is a regular FTS5 table (it keeps its own copy of the text) whose
rowid encodes where a message lives::

    rowid = conversation_id << 32 | turn << 8 | n

`n` is the message's index in the turn's `messages` list (0..254). Slot 255 holds the
summary of a compaction that ends at that turn, under role 'summary' (only the latest
summary of a conversation is kept in the index). Every conversation therefore owns one
contiguous rowid range, and a per-conversation search adds `rowid BETWEEN lo AND hi` to
the MATCH, which FTS5 answers by seeking inside its doclists instead of filtering the
whole corpus (how results are ranked: search.py). An external-content table would need
a content table keyed the same way plus triggers; the store writes these rows itself,
in the same transaction as the turn, so the index cannot drift from `turns`.

`said_fts` holds, under the same rowids, what the user said that does more than ask: each
turn's message 0 (its question) unless every sentence of it is a question or a request that
says nothing of the user (``only_asks``). It is what the search of the user's other
conversations ranks (history/elsewhere.py): such a message tells nothing about the user, is
never recalled from elsewhere, and ranking the copies of one asked in many conversations was
most of a turn's search (docs/DESIGN.md, "Across conversations"). Both indexes are written
together.
"""

from __future__ import annotations

import logging
import re
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from .records import json_column

logger = logging.getLogger(__name__)

CONVERSATION_SHIFT = 32
TURN_SHIFT = 8
# The turn field is 24 bits wide; the conversation id must stay below 2**31 so the
# rowid fits SQLite's signed 64-bit integer.
MAX_TURN = (1 << (CONVERSATION_SHIFT - TURN_SHIFT)) - 1
MAX_CONVERSATION_ID = (1 << 31) - 1
MAX_MESSAGE_INDEX = 254
# Reserved slot in every turn's range for the compaction summary that replaces it.
SUMMARY_SLOT = 255

# Roles whose text is worth finding. System prompts are not stored in turns; an
# assistant message carrying only tool_calls has no text and is skipped.
INDEXED_ROLES = ("user", "assistant", "tool")

CREATE_MESSAGE_FTS = """
CREATE VIRTUAL TABLE IF NOT EXISTS message_fts USING fts5(
    body,
    role UNINDEXED,
    tokenize = 'unicode61 remove_diacritics 2'
)
"""
INSERT_FTS_ROW = "INSERT INTO message_fts (rowid, body, role) VALUES (?, ?, ?)"
DELETE_FTS_RANGE = "DELETE FROM message_fts WHERE rowid BETWEEN ? AND ?"
SELECT_FTS_BATCH_END = "SELECT max(rowid) FROM (SELECT rowid FROM message_fts WHERE rowid BETWEEN ? AND ? LIMIT ?)"
# The role a compaction summary is indexed under (conversation_search shows it).
SUMMARY_ROLE = "summary"
DELETE_FTS_ROW = "DELETE FROM message_fts WHERE rowid = ?"
SELECT_FTS_RANGE = "SELECT rowid, body, role FROM message_fts WHERE rowid BETWEEN ? AND ?"


CREATE_SAID_FTS = """
CREATE VIRTUAL TABLE IF NOT EXISTS said_fts USING fts5(
    body,
    tokenize = 'unicode61 remove_diacritics 2'
)
"""
INSERT_SAID_ROW = "INSERT INTO said_fts (rowid, body) VALUES (?, ?)"
DELETE_SAID_ROW = "DELETE FROM said_fts WHERE rowid = ?"
DELETE_SAID_RANGE = "DELETE FROM said_fts WHERE rowid BETWEEN ? AND ?"
SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


# A sentence that starts with one of these asks for something ("Tell me about ...", "Summarize
# the attached file: ..."), unless it says something of the user (FIRST_PERSON)
REQUEST_WORDS = frozenset("""
please can could tell explain describe summarize summarise write show give list translate review
extract make create generate draft compare convert fix rewrite suggest recommend find help name
define calculate compute solve check correct improve outline continue search look keep be use answer
reply respond avoid focus
""".split())
FIRST_PERSON = frozenset("i i'm i've i'd i'll my mine myself we we're we've our ours".split())
WORDS = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)?")


def only_asks(text: str) -> bool:
    """Whether ``text`` only asks, and so tells nothing of the user: each of its sentences is a
    question (it ends with "?") or a request that says nothing of the user ("Tell me about the
    item 4.", "Summarize the attached file."; not "Write a toast for my sister Ana.")."""
    sentences = [s for s in SENTENCE_END.split(text.strip()) if s.strip()]
    return bool(sentences) and all(s.rstrip().endswith("?") or _requests(s) for s in sentences)


def _requests(sentence: str) -> bool:
    words = WORDS.findall(sentence.lower().replace("’", "'"))
    return bool(words) and words[0] in REQUEST_WORDS and not FIRST_PERSON.intersection(words)


def message_rowid(conversation_id: int, turn: int, n: int) -> int:
    """The `message_fts` rowid of message `n` of `turn` in a conversation."""
    if not 0 < conversation_id <= MAX_CONVERSATION_ID:
        raise ValueError(f"conversation id {conversation_id} out of range")
    if not 0 < turn <= MAX_TURN:
        raise ValueError(f"turn {turn} out of range")
    if not 0 <= n <= SUMMARY_SLOT:
        raise ValueError(f"message index {n} out of range")
    return conversation_id << CONVERSATION_SHIFT | turn << TURN_SHIFT | n


def split_rowid(rowid: int) -> tuple[int, int, int]:
    """(conversation_id, turn, n) encoded in a `message_fts` rowid."""
    return (
        rowid >> CONVERSATION_SHIFT,
        (rowid >> TURN_SHIFT) & MAX_TURN,
        rowid & 0xFF,
    )


def conversation_rowid_range(conversation_id: int) -> tuple[int, int]:
    """Inclusive (lo, hi) rowid bounds of every row of one conversation."""
    lo = conversation_id << CONVERSATION_SHIFT
    return lo, lo | 0xFFFFFFFF


def turn_rowid_range(conversation_id: int, turn: int) -> tuple[int, int]:
    """Inclusive (lo, hi) rowid bounds of every row of one turn."""
    lo = message_rowid(conversation_id, turn, 0)
    return lo, lo | 0xFF


def turn_message_range(conversation_id: int, turn: int) -> tuple[int, int]:
    """Inclusive (lo, hi) rowid bounds of a turn's messages: its summary slot left out."""
    lo = message_rowid(conversation_id, turn, 0)
    return lo, lo | MAX_MESSAGE_INDEX


def quoted_phrases(query: str) -> list[str]:
    """User text as FTS5 phrases, one per whitespace-separated token, each quoted.

    Wrapping each token in double quotes (inner quotes doubled) means `"`, `*`, `NOT`,
    `NEAR(`, `a:b` or a lone parenthesis are searched as text instead of being read as
    FTS5 syntax. A NUL is treated as a space: FTS5 parses the expression as a C string,
    and a NUL inside a quoted phrase would end it early ("unterminated string").
    Repeated tokens are kept once: they would only repeat the same filter.

    The index splits a word at what is not a letter or digit ("state-of-the-art" is a
    phrase of four), and each of a phrase's tokens costs a walk of all its matches: the
    phrases hold MAX_QUERY_TOKENS tokens in all, the last cut to what is left (a "word"
    of hundreds of tokens held the history thread, every turn waiting, over a big history).
    """
    phrases = []
    left = MAX_QUERY_TOKENS
    for word in search_words(query):
        tokens = INDEX_TOKEN.findall(word)
        if len(tokens) > left:
            if left == 0:
                break
            word = " ".join(tokens[:left])  # the same phrase to FTS5, shorter
        left -= min(len(tokens), left)
        phrases.append('"' + word.replace('"', '""') + '"')
    return list(dict.fromkeys(phrases))


MAX_QUERY_TOKENS = 64  # tokens a search looks up in all (its 32 words, each of one or a few)
INDEX_TOKEN = re.compile(r"[^\W_]+")  # a token as the index (unicode61) splits text: letters and digits


def search_words(query: str) -> list[str]:
    """The words of a query as they are searched, repeats too: split at whitespace and NULs."""
    return query.replace("\x00", " ").split()


def match_holding(rare: Sequence[str], must: Sequence[Sequence[str]]) -> str:
    """The MATCH of the ``rare`` phrases ORed, each match holding one of the first list of
    ``must`` that has a rare phrase: the words the recall floor asks a passage to hold one of
    (kbinject/terms.py, ``Terms.must_hold``), so no candidate is ranked that it would drop."""
    anyof = " OR ".join(rare)
    held = must_hold(rare, must)
    return anyof if len(held) in (0, len(rare)) else f"({' OR '.join(held)}) AND ({anyof})"


def must_hold(rare: Sequence[str], must: Sequence[Sequence[str]]) -> list[str]:
    """The rare phrases of the first list of ``must`` that has one: a match holds one of them
    (none: any of ``rare`` will do)."""
    for phrases in must:
        held = [phrase for phrase in phrases if phrase in rare]
        if held:
            return held
    return []


def quote_fts(query: str) -> str:
    """Make user text safe for MATCH: its quoted phrases, ANDed; "" if nothing is left."""
    return " ".join(quoted_phrases(query))


def message_text(message: dict[str, Any]) -> str:
    """The searchable text of one stored message ("" when it has none)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # Image parts carry no words, except a scanned page's OCR text on its image_ref
        # (attachments: the model sees the page, search finds its words).
        return "\n".join(
            text
            for part in content
            if isinstance(part, dict)
            and isinstance(text := part.get(_TEXT_FIELDS.get(str(part.get("type")), "")), str)
        )
    return ""


_TEXT_FIELDS = {"text": "text", "image_ref": "ocr"}  # the words of a stored content part, by its type


def searchable_messages(messages: Iterable[dict[str, Any]]) -> Iterator[tuple[int, str, str]]:
    """(n, role, text) for each message of a turn that belongs in the index."""
    for n, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in INDEXED_ROLES:
            continue
        text = message_text(message)
        if not text.strip():
            continue
        if n > MAX_MESSAGE_INDEX:
            # A turn with this many messages is a runaway tool loop; its tail stays in
            # `turns.messages` but has no rowid slot left to be indexed under.
            logger.warning(
                "turn has more than %d messages; the rest is not indexed",
                MAX_MESSAGE_INDEX + 1,
            )
            return
        yield n, str(role), text


def index_turn(
    conn: sqlite3.Connection,
    conversation_id: int,
    turn: int,
    messages: Iterable[dict[str, Any]],
    said: bool = True,
) -> int:
    """Bring a turn's message rows in `message_fts` in line with ``messages`` (and its question's
    in `said_fts`, unless not ``said``: a migration before that index existed).

    Call inside the turn's transaction; returns the number of rows written. Rows that
    already hold the same text are left alone: finishing a turn then writes only its
    reply, not the question again (an FTS5 delete writes a tombstone for every token, so
    rewriting the question doubled what each turn added to the index). A compaction
    summary in the turn's summary slot is not the turn's to replace and stays.
    """
    wanted = {
        message_rowid(conversation_id, turn, n): (text, role)
        for n, role, text in searchable_messages(messages)
    }
    current = {
        rowid: (body, role)
        for rowid, body, role in conn.execute(
            SELECT_FTS_RANGE, turn_message_range(conversation_id, turn)
        )
    }
    deleted = [(rowid,) for rowid, row in current.items() if wanted.get(rowid) != row]
    conn.executemany(DELETE_FTS_ROW, deleted)
    rows = [
        (rowid, text, role)
        for rowid, (text, role) in wanted.items()
        if current.get(rowid) != (text, role)
    ]
    conn.executemany(INSERT_FTS_ROW, rows)
    if said:  # the question's row, when it changed
        conn.executemany(DELETE_SAID_ROW, [row for row in deleted if row[0] & 0xFF == 0])
        conn.executemany(INSERT_SAID_ROW, said_rows(rows))
    return len(rows)


def said_rows(rows: Iterable[tuple[int, str, str]]) -> list[tuple[int, str]]:
    """Of these `message_fts` rows (rowid, text, role), the `said_fts` rows: each question that
    says more than it asks."""
    return [(rowid, text) for rowid, text, role in rows if rowid & 0xFF == 0 and role == "user" and not only_asks(text)]


def index_summary(
    conn: sqlite3.Connection,
    conversation_id: int,
    through_turn: int,
    summary: str,
    earlier_turns: Iterable[int] = (),
) -> None:
    """Make a compaction summary the conversation's one findable summary.

    It takes the summary slot of the last turn it folds. The summaries of earlier
    compactions (ending at ``earlier_turns``) leave the index, their rows staying in
    `compactions`: each new summary is built from the last and would only repeat it.
    """
    conn.executemany(
        DELETE_FTS_ROW,
        [(message_rowid(conversation_id, t, SUMMARY_SLOT),) for t in set(earlier_turns)],
    )
    rowid = message_rowid(conversation_id, through_turn, SUMMARY_SLOT)
    conn.execute(DELETE_FTS_ROW, (rowid,))
    conn.execute(INSERT_FTS_ROW, (rowid, summary, SUMMARY_ROLE))


def unindex_conversation(conn: sqlite3.Connection, conversation_id: int, limit: int) -> int:
    """Drop up to ``limit`` of a conversation's `message_fts` rows, the first by rowid; how many
    went (FTS5 tokenizes each row again to drop it: a long conversation goes a batch at a time)."""
    lo, hi = conversation_rowid_range(conversation_id)
    last = conn.execute(SELECT_FTS_BATCH_END, (lo, hi, limit)).fetchone()[0]
    if last is None:
        return 0
    conn.execute(DELETE_SAID_RANGE, (lo, last))
    return int(conn.execute(DELETE_FTS_RANGE, (lo, last)).rowcount)


_json_list = json_column(list)


def load_messages(raw: str | None) -> list[dict[str, Any]]:
    """`turns.messages` decoded; [] for a NULL or damaged value rather than an error."""
    return [m for m in _json_list(raw) if isinstance(m, dict)]
