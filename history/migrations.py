"""Schema migrations for history.db.

`MIGRATIONS` is an ordered list of small named functions. `migrate()` applies each one
not yet recorded in `_migrations`, in its own transaction together with its record, so
an interrupted upgrade leaves the file before or after a migration, never halfway. An
applied migration is never edited: a mistake is mended by appending a new one.

history.db files written before migrations were tracked have `conversations` and
`turns` but no `_migrations` table (and may or may not have `turns.files`). m001
therefore creates only what is missing, adds any column an old table lacks, and fills
the search index from the rows it finds, so such a file upgrades in place.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .fts import CREATE_MESSAGE_FTS, CREATE_SAID_FTS, INSERT_SAID_ROW, index_turn, load_messages, said_rows
from .records import utc_timestamp

logger = logging.getLogger(__name__)

Migration = Callable[[sqlite3.Connection], None]

CREATE_MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS _migrations (
    name TEXT PRIMARY KEY,
    applied_at TEXT NOT NULL
)
"""
SELECT_APPLIED = "SELECT name FROM _migrations"
INSERT_APPLIED = "INSERT INTO _migrations (name, applied_at) VALUES (?, ?)"

CREATE_CONVERSATIONS = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    -- Shown in the conversation list; '' until the daemon or the user names it.
    title TEXT NOT NULL DEFAULT '',
    -- The model chosen for this conversation; NULL follows the daemon's default, so
    -- changing the default moves every conversation that never picked one.
    model TEXT,
    -- JSON object of per-conversation settings (kb_injection, ...): new settings need
    -- no migration.
    settings TEXT NOT NULL DEFAULT '{}',
    -- Tokens the context held after the last reply, for the estimate and for deciding
    -- when to compact without re-counting the whole history.
    ctx_used INTEGER NOT NULL DEFAULT 0,
    created_at TEXT NOT NULL,
    -- Last activity; the list is ordered by it and paged with it as the cursor.
    updated_at TEXT NOT NULL,
    -- Soft delete: the rows stay (recoverable by hand) but are invisible everywhere.
    deleted_at TEXT
)
"""

CREATE_TURNS = """
CREATE TABLE IF NOT EXISTS turns (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations (id),
    -- 1-based position in the conversation; the protocol names turns by it.
    turn INTEGER NOT NULL,
    -- The question as typed, shown again when the conversation is reopened.
    text TEXT NOT NULL,
    -- JSON list of this turn's messages in the router's chat format (user, assistant,
    -- tool), extracted file text inline and images as image_ref parts: what is replayed
    -- to the model and what the search index is built from.
    messages TEXT NOT NULL,
    -- Final assistant text, or the partial one checkpointed while it streamed, so a
    -- cancel or a crash never loses what the user already saw.
    reply TEXT NOT NULL DEFAULT '',
    -- running, complete, cancelled, error or interrupted (left running by a crash).
    status TEXT NOT NULL,
    -- The message and stable code of the error that ended the turn, if one did.
    error TEXT,
    error_code TEXT,
    -- The router's finish_reason (stop, length, tool_calls, cancelled ...).
    finish_reason TEXT,
    -- The model that answered, which may differ from the conversation's over time.
    model TEXT,
    -- Usage as reported by the router; NULL when it reported none.
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    UNIQUE (conversation_id, turn)
)
"""

# Columns an old table may lack, as ALTER TABLE ADD COLUMN accepts them (a NOT NULL
# column needs a constant default there). Timestamps added this way are set to the
# migration time, the best that can be said about rows that never had one.
LATE_COLUMNS: dict[str, dict[str, str]] = {
    "conversations": {
        "title": "TEXT NOT NULL DEFAULT ''",
        "model": "TEXT",
        "settings": "TEXT NOT NULL DEFAULT '{}'",
        "ctx_used": "INTEGER NOT NULL DEFAULT 0",
        "created_at": "TEXT NOT NULL DEFAULT ''",
        "updated_at": "TEXT NOT NULL DEFAULT ''",
        "deleted_at": "TEXT",
    },
    "turns": {
        "text": "TEXT NOT NULL DEFAULT ''",
        "messages": "TEXT NOT NULL DEFAULT '[]'",
        "reply": "TEXT NOT NULL DEFAULT ''",
        "status": "TEXT NOT NULL DEFAULT 'complete'",
        "error": "TEXT",
        "error_code": "TEXT",
        "finish_reason": "TEXT",
        "model": "TEXT",
        "prompt_tokens": "INTEGER",
        "completion_tokens": "INTEGER",
        "created_at": "TEXT NOT NULL DEFAULT ''",
        "updated_at": "TEXT NOT NULL DEFAULT ''",
    },
}
TIMESTAMP_COLUMNS = ("created_at", "updated_at")

# Listing walks conversations newest first and pages by updated_at.
CREATE_CONVERSATIONS_UPDATED_INDEX = """
CREATE INDEX IF NOT EXISTS conversations_updated_at ON conversations (updated_at)
"""
# interrupt_running() runs at every start; the partial index holds only the few
# running turns, so it stays instant however long the history grows.
CREATE_TURNS_RUNNING_INDEX = """
CREATE INDEX IF NOT EXISTS turns_running ON turns (status) WHERE status = 'running'
"""
# An old turns table may lack the UNIQUE constraint that gives this lookup its index.
CREATE_TURNS_LOOKUP_INDEX = """
CREATE INDEX IF NOT EXISTS turns_conversation_turn ON turns (conversation_id, turn)
"""
SELECT_TURNS_TO_INDEX = """
SELECT t.conversation_id, t.turn, t.messages
FROM turns AS t JOIN conversations AS c ON c.id = t.conversation_id
WHERE c.deleted_at IS NULL
"""


def table_columns(conn: sqlite3.Connection, table: str) -> list[str]:
    """Column names of a table, [] when it does not exist."""
    return [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]


def table_exists(conn: sqlite3.Connection, name: str) -> bool:
    """Whether a table (or virtual table) of that name exists."""
    row = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)
    ).fetchone()
    return row is not None


def _has_index_on(conn: sqlite3.Connection, table: str, columns: list[str]) -> bool:
    for index in conn.execute(f"PRAGMA index_list({table})").fetchall():
        indexed = [row[2] for row in conn.execute(f"PRAGMA index_info({index[1]})")]
        if indexed[: len(columns)] == columns:
            return True
    return False


def _add_missing_columns(conn: sqlite3.Connection, table: str) -> None:
    present = set(table_columns(conn, table))
    now = utc_timestamp()
    for name, definition in LATE_COLUMNS[table].items():
        if name in present:
            continue
        logger.info("history: adding missing column %s.%s", table, name)
        conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {definition}")
        if name in TIMESTAMP_COLUMNS:
            conn.execute(f"UPDATE {table} SET {name} = ? WHERE {name} = ''", (now,))


def _fill_message_fts(conn: sqlite3.Connection) -> None:
    for conversation_id, turn, raw in conn.execute(SELECT_TURNS_TO_INDEX).fetchall():
        try:
            index_turn(conn, conversation_id, turn, load_messages(raw), said=False)  # m017 fills said_fts
        except ValueError:
            # An id outside the rowid layout cannot be indexed; the turn itself is kept.
            logger.warning("history: turn %s/%s not indexed", conversation_id, turn)


def m001_initial(conn: sqlite3.Connection) -> None:
    """Conversations, turns and the message index; completes a pre-migration file."""
    conn.execute(CREATE_CONVERSATIONS)
    conn.execute(CREATE_TURNS)
    _add_missing_columns(conn, "conversations")
    _add_missing_columns(conn, "turns")
    conn.execute(CREATE_CONVERSATIONS_UPDATED_INDEX)
    conn.execute(CREATE_TURNS_RUNNING_INDEX)
    if not _has_index_on(conn, "turns", ["conversation_id", "turn"]):
        conn.execute(CREATE_TURNS_LOOKUP_INDEX)
    had_index = table_exists(conn, "message_fts")
    conn.execute(CREATE_MESSAGE_FTS)
    if not had_index:
        # Turns written before the index existed must be findable too.
        _fill_message_fts(conn)


def m002_turn_files(conn: sqlite3.Connection) -> None:
    """`turns.files`: the chips of the files asked with, shown again by `open`."""
    # Some pre-migration files already gained the column by hand-run ALTER.
    if "files" not in table_columns(conn, "turns"):
        conn.execute("ALTER TABLE turns ADD COLUMN files TEXT NOT NULL DEFAULT '[]'")


CREATE_ATTACHMENTS = """
CREATE TABLE attachments (
    -- The id attachment_recall names; looked up only together with conversation_id,
    -- so an id from another conversation reads as not found.
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations (id),
    -- The turn that carried it.
    turn INTEGER NOT NULL,
    -- The chip's name, and where the file was read from: an image is re-read from
    -- there (checked against sha256), never copied into the database.
    name TEXT NOT NULL,
    path TEXT NOT NULL,
    -- text, image or pdf; and the MIME type the recall tool reports.
    kind TEXT NOT NULL,
    content_type TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    pages INTEGER,
    -- The whole extracted text, not cut to the turn's budget (a large cap aside), for
    -- attachment_recall to page through after the inline copy left the context.
    full_text TEXT,
    created_at TEXT NOT NULL
)
"""
CREATE_ATTACHMENTS_INDEX = """
CREATE INDEX attachments_conversation ON attachments (conversation_id, id)
"""


def m003_attachments(conn: sqlite3.Connection) -> None:
    """`attachments`: each attached file's metadata and full text, per conversation."""
    conn.execute(CREATE_ATTACHMENTS)
    conn.execute(CREATE_ATTACHMENTS_INDEX)


CREATE_COMPACTIONS = """
CREATE TABLE compactions (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations (id),
    -- The last turn the summary stands for: prompts replay only the turns after it,
    -- while turns 1..through_turn stay whole in `turns` and in the search index.
    through_turn INTEGER NOT NULL,
    -- The model's summary of those turns (and of the summary before it); also indexed in
    -- message_fts under the summary slot of through_turn, role 'summary'.
    summary TEXT NOT NULL,
    created_at TEXT NOT NULL
)
"""
# latest_compaction() reads the newest row of one conversation at every turn.
CREATE_COMPACTIONS_INDEX = """
CREATE INDEX compactions_conversation ON compactions (conversation_id, through_turn)
"""


def m004_compactions(conn: sqlite3.Connection) -> None:
    """`compactions`: the stored summaries that replace a conversation's oldest turns."""
    conn.execute(CREATE_COMPACTIONS)
    conn.execute(CREATE_COMPACTIONS_INDEX)


# FTS5 merges its segments as it writes, once a level holds `automerge` of them, in
# work proportional to the number of levels. At the default of 4, a big history writes
# far more pages per stored turn than at 8, and stores turns the slower for it
# (bench/bench_search.py); 8 costs a few more segments per search to seek in.
FTS_AUTOMERGE = 8
SET_FTS_AUTOMERGE = "INSERT INTO message_fts (message_fts, rank) VALUES ('automerge', ?)"
SET_SAID_AUTOMERGE = "INSERT INTO said_fts (said_fts, rank) VALUES ('automerge', ?)"


def m005_message_fts_automerge(conn: sqlite3.Connection) -> None:
    """Let message_fts merge segments less eagerly, so storing a turn writes less."""
    conn.execute(SET_FTS_AUTOMERGE, (FTS_AUTOMERGE,))


# Knowledge bases: documents added once, whose passages the turns of every linked
# conversation are given (kbinject). A chunk's id is `kb_id << 32 | n`
# (history/kb.py), so each KB owns one rowid range: a search scoped to the KBs linked to a
# conversation adds `rowid BETWEEN lo AND hi` to its MATCH, and FTS5 seeks inside its
# doclists instead of joining every match back to its document.
CREATE_KBS = """
CREATE TABLE kbs (
    -- AUTOINCREMENT: a removed KB's id (and so its chunk ids) is never handed out again.
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    -- What the user calls it (kb_add, kb_link ...); unique.
    name TEXT NOT NULL UNIQUE,
    -- 1: linked to every conversation, present and future (seed §4's "personal KBs").
    linked_all INTEGER NOT NULL DEFAULT 0,
    -- The n of the next chunk id (kb_id << 32 | n): ids are never reused, so a vector
    -- computed for a replaced chunk can never be stored under its successor.
    next_chunk INTEGER NOT NULL DEFAULT 1,
    created_at TEXT NOT NULL
)
"""
CREATE_KB_DOCUMENTS = """
CREATE TABLE kb_documents (
    id INTEGER PRIMARY KEY,
    kb_id INTEGER NOT NULL REFERENCES kbs (id),
    -- Absolute path it was read from: re-adding the same path replaces the document.
    path TEXT NOT NULL,
    -- The file name shown in hits and in the injected context.
    name TEXT NOT NULL,
    -- text or pdf.
    kind TEXT NOT NULL,
    -- Of the file's bytes: re-adding a file whose hash is unchanged costs no extraction
    -- and no embedding.
    sha256 TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    -- With size_bytes, recognises an untouched file without reading it to hash it.
    mtime_ns INTEGER NOT NULL,
    -- A PDF's page count; NULL for text.
    pages INTEGER,
    chunks INTEGER NOT NULL,
    -- 1 when only the first part of the text was indexed (the extraction cap).
    truncated INTEGER NOT NULL DEFAULT 0,
    added_at TEXT NOT NULL,
    UNIQUE (kb_id, path)
)
"""
CREATE_KB_CHUNKS = """
CREATE TABLE kb_chunks (
    -- kb_id << 32 | n, see above.
    id INTEGER PRIMARY KEY,
    document_id INTEGER NOT NULL REFERENCES kb_documents (id),
    -- 1-based position in the document: "chunk 3 of report.pdf".
    ordinal INTEGER NOT NULL,
    -- The PDF page the chunk comes from; NULL for text.
    page INTEGER,
    text TEXT NOT NULL
)
"""
# Deleting a document finds its chunks (and the foreign key check needs it too).
CREATE_KB_CHUNKS_INDEX = "CREATE INDEX kb_chunks_document ON kb_chunks (document_id, ordinal)"
# External content: the text is stored once, in kb_chunks; triggers keep the index in step.
CREATE_KB_CHUNK_FTS = """
CREATE VIRTUAL TABLE kb_chunk_fts USING fts5(
    text,
    content = 'kb_chunks',
    content_rowid = 'id',
    tokenize = 'porter unicode61 remove_diacritics 2'
)
"""
CREATE_KB_CHUNK_TRIGGERS = (
    """
    CREATE TRIGGER kb_chunks_ai AFTER INSERT ON kb_chunks BEGIN
        INSERT INTO kb_chunk_fts (rowid, text) VALUES (new.id, new.text);
    END
    """,
    """
    CREATE TRIGGER kb_chunks_ad AFTER DELETE ON kb_chunks BEGIN
        INSERT INTO kb_chunk_fts (kb_chunk_fts, rowid, text) VALUES ('delete', old.id, old.text);
    END
    """,
    """
    CREATE TRIGGER kb_chunks_au AFTER UPDATE OF text ON kb_chunks BEGIN
        INSERT INTO kb_chunk_fts (kb_chunk_fts, rowid, text) VALUES ('delete', old.id, old.text);
        INSERT INTO kb_chunk_fts (rowid, text) VALUES (new.id, new.text);
    END
    """,
)
CREATE_KB_VECTORS = """
CREATE TABLE kb_vectors (
    chunk_id INTEGER NOT NULL REFERENCES kb_chunks (id),
    -- The embedding model that made it: vectors of different models never mix, and
    -- configuring another model embeds the chunks again.
    model TEXT NOT NULL,
    dim INTEGER NOT NULL,
    -- dim little-endian float32, L2-normalised: a dot product is the cosine.
    vector BLOB NOT NULL,
    PRIMARY KEY (chunk_id, model)
)
"""
CREATE_KB_LINKS = """
CREATE TABLE kb_links (
    kb_id INTEGER NOT NULL REFERENCES kbs (id),
    conversation_id INTEGER NOT NULL REFERENCES conversations (id),
    created_at TEXT NOT NULL,
    PRIMARY KEY (kb_id, conversation_id)
) WITHOUT ROWID
"""
# A turn looks up the KBs of its conversation.
CREATE_KB_LINKS_INDEX = "CREATE INDEX kb_links_conversation ON kb_links (conversation_id)"


def m006_knowledge_bases(conn: sqlite3.Connection) -> None:
    """Knowledge bases: documents, chunks, their FTS5 index, vectors and links."""
    for statement in (
        CREATE_KBS,
        CREATE_KB_DOCUMENTS,
        CREATE_KB_CHUNKS,
        CREATE_KB_CHUNKS_INDEX,
        CREATE_KB_CHUNK_FTS,
        *CREATE_KB_CHUNK_TRIGGERS,
        CREATE_KB_VECTORS,
        CREATE_KB_LINKS,
        CREATE_KB_LINKS_INDEX,
    ):
        conn.execute(statement)


def m007_conversation_system_prompt(conn: sqlite3.Connection) -> None:
    """`conversations.system_prompt`: a conversation's own system prompt."""
    # NULL follows the daemon's `system_prompt` setting, as `model` NULL follows its model;
    # '' is a conversation asked without any system message. A column rather than a key of
    # `settings`: the prompt builder reads it on every turn with the conversation's row.
    conn.execute("ALTER TABLE conversations ADD COLUMN system_prompt TEXT")


def m008_turn_sources(conn: sqlite3.Connection) -> None:
    """`turns.sources`: the knowledge-base passages a turn's prompt carried."""
    # JSON list of {kb, file, path, chunk, chunks, page, similarity}: the passages themselves
    # are not stored with the question (docs/DESIGN.md, "Prompt layout"), so `open` shows where
    # the answer's context came from by this list alone; '[]' for a turn that got none.
    conn.execute("ALTER TABLE turns ADD COLUMN sources TEXT NOT NULL DEFAULT '[]'")


def m009_turn_ref(conn: sqlite3.Connection) -> None:
    """`turns.ref`: the client's own reference for the ask that made the turn."""
    # A client whose connection dropped before the `user` event finds its question by this
    # (the request id is the connection's, not stored); NULL when the ask carried none.
    conn.execute("ALTER TABLE turns ADD COLUMN ref TEXT")


def m010_turn_approvals(conn: sqlite3.Connection) -> None:
    """`turns.approvals`: how each call of a tool that may act was allowed or denied."""
    # JSON list of {call, name, server, tool, arguments, allowed, by, at, remember, client}, in
    # the order decided: a column of the turn rather than a field of its tool messages, because a
    # call denied by a cancel or a stop has no tool message, and its denial is kept all the same.
    conn.execute("ALTER TABLE turns ADD COLUMN approvals TEXT NOT NULL DEFAULT '[]'")
CREATE_THREADS = """
CREATE TABLE threads (
    digest TEXT NOT NULL,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id),
    turns INTEGER NOT NULL,
    PRIMARY KEY (digest, conversation_id)
) WITHOUT ROWID
"""


def m011_threads(conn: sqlite3.Connection) -> None:
    """`threads`: how a stateless client (the OpenAI door) finds the conversation it continues."""
    # A client of the OpenAI API resends the whole conversation each time: `digest` names the
    # texts of its user and assistant messages (history.thread_digest) as they stood after
    # `turns` turns of the conversation, so its next request finds that conversation in one
    # seek. A row whose conversation has gone on since (another client, a regenerated reply)
    # no longer matches, and the request starts a branch instead.
    conn.execute(CREATE_THREADS)


CREATE_ATTACHMENT_CHUNKS = """
CREATE TABLE attachment_chunks (
    -- attachment_id << 16 | n: an attachment's chunks are one rowid range, so a search
    -- scoped to a conversation's files is a `rowid BETWEEN` per file (history/archive.py)
    id INTEGER PRIMARY KEY,
    -- no foreign key: the chunks are an index of attachments.full_text, made again at will
    attachment_id INTEGER NOT NULL,
    -- 1-based position in the file, and the PDF page it comes from (NULL for text)
    ordinal INTEGER NOT NULL,
    page INTEGER,
    text TEXT NOT NULL
)
"""
CREATE_ATTACHMENT_CHUNK_FTS = """
CREATE VIRTUAL TABLE attachment_chunk_fts USING fts5(
    text,
    content = 'attachment_chunks',
    content_rowid = 'id',
    tokenize = 'porter unicode61 remove_diacritics 2'
)
"""
CREATE_ATTACHMENT_CHUNK_TRIGGERS = (
    """
    CREATE TRIGGER attachment_chunks_ai AFTER INSERT ON attachment_chunks BEGIN
        INSERT INTO attachment_chunk_fts (rowid, text) VALUES (new.id, new.text);
    END
    """,
    """
    CREATE TRIGGER attachment_chunks_ad AFTER DELETE ON attachment_chunks BEGIN
        INSERT INTO attachment_chunk_fts (attachment_chunk_fts, rowid, text) VALUES ('delete', old.id, old.text);
    END
    """,
)


def m012_attachment_chunks(conn: sqlite3.Connection) -> None:
    """`attachment_chunks`: the attachments' full text in chunks, indexed for recall injection."""
    # Chunked lazily, the first time a turn recalls from the conversation (kbinject/archive.py):
    # `chunked` says the chunks are those of the current full_text (OCR text arriving later
    # resets it, history/sql.py SET_ATTACHMENT_TEXT).
    conn.execute(CREATE_ATTACHMENT_CHUNKS)
    conn.execute(CREATE_ATTACHMENT_CHUNK_FTS)
    for trigger in CREATE_ATTACHMENT_CHUNK_TRIGGERS:
        conn.execute(trigger)
    conn.execute("ALTER TABLE attachments ADD COLUMN chunked INTEGER NOT NULL DEFAULT 0")


CREATE_MEMORIES = """
CREATE TABLE memories (
    id INTEGER PRIMARY KEY,
    -- A short fact the user wants kept across conversations (at most MAX_MEMORY_CHARS).
    text TEXT NOT NULL,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    -- Where the model saved it (memory_save); NULL for one the user added. Deleting that
    -- conversation forgets it: the fact came from there.
    conversation_id INTEGER REFERENCES conversations(id),
    turn INTEGER
)
"""
CREATE_MEMORIES_INDEX = "CREATE INDEX memories_conversation ON memories (conversation_id)"
CREATE_CONVERSATION_MEMORIES = """
CREATE TABLE conversation_memories (
    conversation_id INTEGER PRIMARY KEY REFERENCES conversations(id),
    -- The saved memories as its system prompt carries them, frozen at its first prompt so
    -- the prompt stays the same bytes on every turn (docs/DESIGN.md, "Memory").
    block TEXT NOT NULL
)
"""


def m013_memories(conn: sqlite3.Connection) -> None:
    """`memories` and `conversation_memories`: facts kept across conversations (docs/MEMORY.md)."""
    for statement in (CREATE_MEMORIES, CREATE_MEMORIES_INDEX, CREATE_CONVERSATION_MEMORIES):
        conn.execute(statement)


def m014_live_journal(conn: sqlite3.Connection) -> None:
    """`live_seq`, `live_changes` and `turns_ref`: the live state across a restart (history/journal.py)."""
    # `reserved`: no change the daemon told its watchers is numbered past it, so a restart,
    # even after a crash, never numbers a change as an earlier one was (daemon/live.py)
    conn.execute("CREATE TABLE live_seq (id INTEGER PRIMARY KEY CHECK (id = 1), reserved INTEGER NOT NULL)")
    # the last run's changes, as their `changed` events (JSON), written at a clean stop so
    # that a watcher reconnecting after the restart is sent what it missed
    conn.execute("CREATE TABLE live_changes (seq INTEGER PRIMARY KEY, at REAL NOT NULL, event TEXT NOT NULL)")
    # a client that lost its connection before `user` finds its turn by its ask's `ref`
    conn.execute("CREATE INDEX turns_ref ON turns (ref) WHERE ref IS NOT NULL")


CREATE_RECALL_VECTORS = """
CREATE TABLE recall_vectors (
    -- What the vector is of (history/recallvec.py): a message's message_fts rowid, the
    -- negated id of an attachment chunk, or a memory's id.
    id INTEGER PRIMARY KEY,
    -- The conversation it belongs to (0: a saved memory); its rows go when it is deleted
    -- or made incognito (the triggers below).
    conversation_id INTEGER NOT NULL,
    model TEXT NOT NULL,
    -- Of the text embedded: a text changed since (a reply finished, a memory edited) is
    -- embedded again, and its old vector is never used meanwhile.
    digest TEXT NOT NULL,
    -- Little-endian float32, unit length; empty when the embedder refused the text.
    vector BLOB NOT NULL
)
"""
RECALL_VECTORS_TRIGGERS = (
    "CREATE INDEX recall_vectors_conversation ON recall_vectors (conversation_id)",
    """CREATE TRIGGER recall_vectors_forgotten AFTER UPDATE OF deleted_at, settings ON conversations
    WHEN new.deleted_at IS NOT NULL
      OR CASE WHEN json_valid(new.settings) THEN json_extract(new.settings, '$.memory') END = 'off' BEGIN
        DELETE FROM recall_vectors WHERE conversation_id = new.id;
    END""",
    """CREATE TRIGGER recall_vectors_conversation_gone AFTER DELETE ON conversations BEGIN
        DELETE FROM recall_vectors WHERE conversation_id = old.id;
    END""",
    """CREATE TRIGGER recall_vectors_memory_gone AFTER DELETE ON memories BEGIN
        DELETE FROM recall_vectors WHERE id = old.id AND conversation_id = 0;
    END""",
)


def m015_recall_vectors(conn: sqlite3.Connection) -> None:
    """`recall_vectors`: what recall searches, embedded (docs/DESIGN.md, "Recall injection")."""
    for statement in (CREATE_RECALL_VECTORS, *RECALL_VECTORS_TRIGGERS):
        conn.execute(statement)


def m016_attachment_sent_whole(conn: sqlite3.Connection) -> None:
    """`attachments.sent_whole`: whether the question carried the file's whole text."""
    # 1 when the turn's question carried all of full_text (not cut to the budget): recall
    # injection searches such a file only once its turn is out of the prompt (folded, left out,
    # or replayed cut), docs/DESIGN.md "Recall injection". 0 for the rows before it and for a
    # tool's outputs: searched whenever the conversation's archive is, as they were.
    conn.execute("ALTER TABLE attachments ADD COLUMN sent_whole INTEGER NOT NULL DEFAULT 0")


# the questions in message_fts, read in batches to fill said_fts
SELECT_QUESTIONS = """
SELECT rowid, body, role FROM message_fts WHERE rowid > ? AND (rowid & 255) = 0 ORDER BY rowid LIMIT ?
"""
FILL_BATCH = 5000


def m017_said_fts(conn: sqlite3.Connection) -> None:
    """`said_fts`: what the user said, questions that only ask left out (history/fts.py), which
    the search of the other conversations ranks; filled from `message_fts`."""
    conn.execute(CREATE_SAID_FTS)
    conn.execute(SET_SAID_AUTOMERGE, (FTS_AUTOMERGE,))
    last = -1
    while rows := conn.execute(SELECT_QUESTIONS, (last, FILL_BATCH)).fetchall():
        conn.executemany(INSERT_SAID_ROW, said_rows(rows))
        last = rows[-1][0]


MIGRATIONS: list[Migration] = [
    m001_initial,
    m002_turn_files,
    m003_attachments,
    m004_compactions,
    m005_message_fts_automerge,
    m006_knowledge_bases,
    m007_conversation_system_prompt,
    m008_turn_sources,
    m009_turn_ref,
    m010_turn_approvals,
    m011_threads,
    m012_attachment_chunks,
    m013_memories,
    m014_live_journal,
    m015_recall_vectors,
    m016_attachment_sent_whole,
    m017_said_fts,
]


@contextmanager
def immediate_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction: committed on success, rolled back on any exception.

    BEGIN IMMEDIATE takes the write lock before the first read, so what a write method
    reads (the next turn number, whether a conversation exists) cannot change under it
    from another connection; the explicit BEGIN also puts DDL inside the transaction,
    which Python's implicit transactions leave out.
    """
    with conn:
        conn.execute("BEGIN IMMEDIATE")
        yield conn


def applied_migrations(conn: sqlite3.Connection) -> set[str]:
    """Names recorded in `_migrations`."""
    return {row[0] for row in conn.execute(SELECT_APPLIED)}


def migrate(conn: sqlite3.Connection) -> list[str]:
    """Apply every missing migration in order; the names applied, [] when current."""
    conn.execute(CREATE_MIGRATIONS_TABLE)
    done = applied_migrations(conn)
    # Filtering first means opening a current file takes no write lock at all.
    pending = [m for m in MIGRATIONS if m.__name__ not in done]
    applied: list[str] = []
    for migration in pending:
        name = migration.__name__
        with immediate_transaction(conn):
            # Checked inside the write lock: another process may have just applied it.
            if name in applied_migrations(conn):
                continue
            logger.info("history: applying migration %s", name)
            migration(conn)
            conn.execute(INSERT_APPLIED, (name, utc_timestamp()))
        applied.append(name)
    return applied
