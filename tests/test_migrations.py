"""history.db schema: a fresh migration, an old pre-migration file, atomicity."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import pytest

from history import HistoryStore, NewTurn
from history import migrations as migrations_module
from history.fts import index_turn, message_rowid
from history.migrations import MIGRATIONS, m001_initial, migrate, table_columns
from history.records import parse_timestamp

CONVERSATION_COLUMNS = [
    "id", "title", "model", "settings", "ctx_used", "created_at", "updated_at",
    "deleted_at", "system_prompt",
]
TURN_COLUMNS_M001 = [
    "id", "conversation_id", "turn", "text", "messages", "reply", "status", "error",
    "error_code", "finish_reason", "model", "prompt_tokens", "completion_tokens",
    "created_at", "updated_at",
]
ALL_MIGRATIONS = [
    "m001_initial", "m002_turn_files", "m003_attachments", "m004_compactions",
    "m005_message_fts_automerge", "m006_knowledge_bases", "m007_conversation_system_prompt",
    "m008_turn_sources",
    "m009_turn_ref",
    "m010_turn_approvals",
    "m011_threads",
    "m012_attachment_chunks",
    "m013_memories",
    "m014_live_journal",
    "m015_recall_vectors",
    "m016_attachment_sent_whole",
    "m017_said_fts",
]


@contextmanager
def connect(path: Path) -> Iterator[sqlite3.Connection]:
    with closing(sqlite3.connect(path)) as conn:
        yield conn


def migrated_through(conn: sqlite3.Connection, count: int) -> None:
    """``conn``'s file as the first ``count`` migrations leave it, each recorded as applied."""
    conn.execute(migrations_module.CREATE_MIGRATIONS_TABLE)
    for migration in MIGRATIONS[:count]:
        with conn:
            migration(conn)
            conn.execute(migrations_module.INSERT_APPLIED, (migration.__name__, "t"))


def migration_rows(conn: sqlite3.Connection) -> list[tuple[str, str]]:
    return conn.execute("SELECT name, applied_at FROM _migrations ORDER BY rowid").fetchall()


def schema_sql(conn: sqlite3.Connection, name: str) -> str:
    row = conn.execute("SELECT sql FROM sqlite_master WHERE name = ?", (name,)).fetchone()
    assert row is not None, f"{name} missing"
    return str(row[0])


def assert_kb_schema(conn: sqlite3.Connection) -> None:
    """The knowledge-base tables of m006."""
    assert table_columns(conn, "kbs") == ["id", "name", "linked_all", "next_chunk", "created_at"]
    assert table_columns(conn, "kb_documents") == [
        "id", "kb_id", "path", "name", "kind", "sha256", "size_bytes", "mtime_ns", "pages",
        "chunks", "truncated", "added_at",
    ]
    assert table_columns(conn, "kb_chunks") == ["id", "document_id", "ordinal", "page", "text"]
    assert table_columns(conn, "kb_vectors") == ["chunk_id", "model", "dim", "vector"]
    assert table_columns(conn, "kb_links") == ["kb_id", "conversation_id", "created_at"]
    assert table_columns(conn, "kb_chunk_fts") == ["text"]
    fts_sql = schema_sql(conn, "kb_chunk_fts").replace(" ", "")
    assert "content='kb_chunks'" in fts_sql and "content_rowid='id'" in fts_sql
    assert "porter" in fts_sql
    for trigger in ("kb_chunks_ai", "kb_chunks_ad", "kb_chunks_au"):
        assert "kb_chunk_fts" in schema_sql(conn, trigger)
    assert "(document_id, ordinal)" in schema_sql(conn, "kb_chunks_document")
    assert "(conversation_id)" in schema_sql(conn, "kb_links_conversation")
    assert "PRIMARY KEY (chunk_id, model)" in schema_sql(conn, "kb_vectors")


def test_migration_list_is_ordered_and_named() -> None:
    assert [m.__name__ for m in MIGRATIONS] == ALL_MIGRATIONS


def test_migrate_empty_database(tmp_path: Path) -> None:
    with connect(tmp_path / "history.db") as conn:
        assert migrate(conn) == ALL_MIGRATIONS

        assert table_columns(conn, "conversations") == CONVERSATION_COLUMNS
        assert table_columns(conn, "turns") == TURN_COLUMNS_M001 + ["files", "sources", "ref", "approvals"]
        assert table_columns(conn, "_migrations") == ["name", "applied_at"]
        assert table_columns(conn, "threads") == ["digest", "conversation_id", "turns"]
        assert table_columns(conn, "message_fts") == ["body", "role"]
        assert table_columns(conn, "attachments") == [
            "id", "conversation_id", "turn", "name", "path", "kind", "content_type",
            "size_bytes", "sha256", "pages", "full_text", "created_at", "chunked", "sent_whole",
        ]
        assert table_columns(conn, "attachment_chunks") == ["id", "attachment_id", "ordinal", "page", "text"]
        assert "attachments_conversation" in schema_sql(conn, "attachments_conversation")
        assert table_columns(conn, "compactions") == [
            "id", "conversation_id", "through_turn", "summary", "created_at",
        ]
        assert "(conversation_id, through_turn)" in schema_sql(conn, "compactions_conversation")
        assert conn.execute(
            "SELECT v FROM message_fts_config WHERE k = 'automerge'"
        ).fetchone() == (migrations_module.FTS_AUTOMERGE,)

        assert_kb_schema(conn)

        fts_sql = schema_sql(conn, "message_fts")
        assert "fts5" in fts_sql
        assert "role UNINDEXED" in fts_sql
        assert "remove_diacritics 2" in fts_sql
        # A regular FTS5 table, not external-content: it keeps its own text.
        assert "content=" not in fts_sql.replace(" ", "")
        assert "conversations_updated_at" in schema_sql(conn, "conversations_updated_at")
        assert "WHERE status = 'running'" in schema_sql(conn, "turns_running")
        # UNIQUE(conversation_id, turn) already indexes the lookup; no duplicate index.
        assert conn.execute(
            "SELECT count(*) FROM sqlite_master WHERE name = 'turns_conversation_turn'"
        ).fetchone() == (0,)

        rows = migration_rows(conn)
        assert [name for name, _ in rows] == ALL_MIGRATIONS
        for _, applied_at in rows:
            parse_timestamp(applied_at)  # raises unless ISO-8601 UTC with microseconds

        # Current already: nothing applied, records untouched.
        assert migrate(conn) == []
        assert migration_rows(conn) == rows


def test_new_files_column_defaults_to_empty_list(tmp_path: Path) -> None:
    with connect(tmp_path / "history.db") as conn:
        migrate(conn)
        conn.execute(
            "INSERT INTO conversations (id, created_at, updated_at) VALUES (1, 'x', 'x')"
        )
        conn.execute(
            "INSERT INTO turns (conversation_id, turn, text, messages, status, created_at,"
            " updated_at) VALUES (1, 1, 'q', '[]', 'complete', 'x', 'x')"
        )
        assert conn.execute("SELECT files FROM turns").fetchone() == ("[]",)
        assert conn.execute("SELECT settings, ctx_used, title FROM conversations").fetchone() == (
            "{}", 0, "",
        )


def test_m001_has_no_files_column_and_m002_adds_it(tmp_path: Path) -> None:
    with connect(tmp_path / "history.db") as conn:
        conn.execute(migrations_module.CREATE_MIGRATIONS_TABLE)
        with conn:
            m001_initial(conn)
            conn.execute(migrations_module.INSERT_APPLIED, ("m001_initial", "t"))
        assert "files" not in table_columns(conn, "turns")

        assert migrate(conn) == ALL_MIGRATIONS[1:]
        assert table_columns(conn, "turns")[-4:] == ["files", "sources", "ref", "approvals"]


def build_old_schema(path: Path, *, with_files: bool) -> None:
    """A history.db as written before migrations were tracked."""
    files_column = ", files TEXT" if with_files else ""
    with connect(path) as conn:
        conn.executescript(
            f"""
            CREATE TABLE conversations (
                id INTEGER PRIMARY KEY,
                title TEXT NOT NULL DEFAULT '',
                model TEXT,
                settings TEXT NOT NULL DEFAULT '{{}}',
                ctx_used INTEGER NOT NULL DEFAULT 0,
                created_at TEXT NOT NULL,
                updated_at TEXT NOT NULL,
                deleted_at TEXT
            );
            -- No error_code column yet, and maybe no files column.
            CREATE TABLE turns (
                id INTEGER PRIMARY KEY,
                conversation_id INTEGER NOT NULL REFERENCES conversations(id),
                turn INTEGER NOT NULL,
                text TEXT NOT NULL,
                messages TEXT NOT NULL,
                reply TEXT NOT NULL DEFAULT '',
                status TEXT NOT NULL,
                error TEXT,
                finish_reason TEXT,
                model TEXT,
                prompt_tokens INTEGER,
                completion_tokens INTEGER,
                created_at TEXT NOT NULL,
                updated_at TEXT NOT NULL{files_column},
                UNIQUE (conversation_id, turn)
            );
            INSERT INTO conversations (id, title, created_at, updated_at, deleted_at) VALUES
                (1, 'Old one', '2026-10-01T10:00:00.000000Z', '2026-10-01T10:05:00.000000Z', NULL),
                (2, 'Gone', '2026-10-02T10:00:00.000000Z', '2026-10-02T10:00:00.000000Z',
                 '2026-10-03T00:00:00.000000Z');
            """
        )
        turns = [
            (1, 1, "what is a marmoset", "A small monkey."),
            (1, 2, "and a tamarin", "A related monkey."),
            (2, 1, "secret deleted question", "secret deleted answer"),
        ]
        for cid, n, text, reply in turns:
            messages = [
                {"role": "user", "content": text},
                {"role": "assistant", "content": reply},
            ]
            conn.execute(
                "INSERT INTO turns (conversation_id, turn, text, messages, reply, status,"
                " model, prompt_tokens, completion_tokens, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?, 'complete', 'old-model', 10, 5,"
                " '2026-10-01T10:00:00.000000Z', '2026-10-01T10:00:00.000000Z')",
                (cid, n, text, json.dumps(messages), reply),
            )
        if with_files:
            conn.execute(
                """UPDATE turns SET files = '[{"name":"a.txt","kind":"text"}]' WHERE turn = 1"""
            )
        conn.commit()


def test_old_schema_file_upgrades_in_place(tmp_path: Path) -> None:
    path = tmp_path / "history.db"
    build_old_schema(path, with_files=False)

    with HistoryStore(path) as store:
        turns = store.turns(1)
        assert [(t.turn, t.text, t.reply) for t in turns] == [
            (1, "what is a marmoset", "A small monkey."),
            (2, "and a tamarin", "A related monkey."),
        ]
        assert all(t.files == [] for t in turns)
        assert all(t.error_code is None for t in turns)
        assert turns[0].usage == {"prompt_tokens": 10, "completion_tokens": 5}
        conversation = store.get_conversation(1)
        assert conversation is not None
        assert (conversation.title, conversation.turns) == ("Old one", 2)
        assert store.get_conversation(2) is None
        # The old turns were put in the new search index; the deleted one was not.
        assert [(h.conversation_id, h.turn, h.role) for h in store.search_all("tamarin")] == [
            (1, 2, "user")
        ]
        assert store.search_all("monkey") != []
        assert store.search_all("secret") == []
        # And the upgraded file takes new turns.
        _, new = store.start_turn(NewTurn(1, "more", [{"role": "user", "content": "more"}], [], None))
        assert new.turn == 3

    with connect(path) as conn:
        columns = table_columns(conn, "turns")
        assert "files" in columns and "error_code" in columns
        assert conn.execute("SELECT count(*) FROM turns").fetchone() == (4,)
        assert conn.execute("SELECT count(*) FROM conversations").fetchone() == (2,)
        rows = migration_rows(conn)
        assert [name for name, _ in rows] == ALL_MIGRATIONS

    # Re-opening is a no-op: nothing re-applied, nothing re-indexed twice.
    with HistoryStore(path) as store:
        assert len(store.search_all("tamarin")) == 1
    with connect(path) as conn:
        assert migration_rows(conn) == rows
        assert migrate(conn) == []


def test_old_schema_that_already_has_files_keeps_them(tmp_path: Path) -> None:
    path = tmp_path / "history.db"
    build_old_schema(path, with_files=True)

    with HistoryStore(path) as store:
        first, second = store.turns(1)
        assert first.files == [{"name": "a.txt", "kind": "text"}]
        assert second.files == []  # NULL in the old column reads as no files
    with connect(path) as conn:
        assert table_columns(conn, "turns").count("files") == 1
        assert [name for name, _ in migration_rows(conn)] == ALL_MIGRATIONS


def test_failed_migration_leaves_no_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def m003_broken(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE half_done (x INTEGER)")
        conn.execute("ALTER TABLE turns ADD COLUMN doomed TEXT")
        raise RuntimeError("boom")

    monkeypatch.setattr(migrations_module, "MIGRATIONS", [*MIGRATIONS, m003_broken])
    path = tmp_path / "history.db"
    with pytest.raises(RuntimeError, match="boom"):
        HistoryStore(path)

    with connect(path) as conn:
        # The migrations before it were committed, each on its own...
        assert [name for name, _ in migration_rows(conn)] == ALL_MIGRATIONS
        # ...and the broken one rolled back whole, DDL included.
        assert conn.execute(
            "SELECT count(*) FROM sqlite_master WHERE name = 'half_done'"
        ).fetchone() == (0,)
        assert "doomed" not in table_columns(conn, "turns")


def test_a_file_from_before_compactions_upgrades(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "history.db"
    monkeypatch.setattr(migrations_module, "MIGRATIONS", MIGRATIONS[:3])
    messages = [{"role": "user", "content": "about lemurs"}]
    with connect(path) as conn:
        migrate(conn)
        with conn:  # a turn as that version of the store wrote it
            conn.execute("INSERT INTO conversations (id, created_at, updated_at) VALUES (1, 'x', 'x')")
            conn.execute("INSERT INTO turns (conversation_id, turn, text, messages, status, created_at, updated_at) "
                         "VALUES (1, 1, 'about lemurs', ?, 'complete', 'x', 'x')", (json.dumps(messages),))
            index_turn(conn, 1, 1, messages, said=False)  # before said_fts
        assert conn.execute("SELECT v FROM message_fts_config WHERE k = 'automerge'").fetchone() is None
    monkeypatch.undo()

    with HistoryStore(path) as store:
        conversation = store.get_conversation(1)
        assert conversation is not None and conversation.system_prompt is None
        assert [h.turn for h in store.search_conversation(conversation.id, "lemurs")] == [1]
        assert store.kb.all() == []
        assert store.latest_compaction(conversation.id) is None
        store.add_compaction(conversation.id, 1, "They talked about lemurs.")
        assert [h.role for h in store.search_conversation(conversation.id, "talked")] == ["summary"]
    with connect(path) as conn:
        assert [name for name, _ in migration_rows(conn)] == ALL_MIGRATIONS
        assert conn.execute("SELECT v FROM message_fts_config WHERE k = 'automerge'").fetchone() == (8,)


def test_m008_to_m010_give_every_turn_no_sources_no_ref_and_no_approvals(tmp_path: Path) -> None:
    # a history.db of m007 with a turn in it: after m008 to m010 the turn reads as one that got no
    # passages, whose ask carried no ref, and that asked no approval
    db = tmp_path / "history.db"
    with connect(db) as conn:
        migrated_through(conn, 7)
        with conn:
            conn.execute("INSERT INTO conversations (title, created_at, updated_at) VALUES ('t', 'x', 'x')")
            conn.execute("INSERT INTO turns (conversation_id, turn, text, messages, status, created_at, updated_at) "
                         "VALUES (1, 1, 'q', '[]', 'complete', 'x', 'x')")
        assert "sources" not in table_columns(conn, "turns")
        assert migrate(conn) == ["m008_turn_sources", "m009_turn_ref", "m010_turn_approvals", "m011_threads",
                                 "m012_attachment_chunks", "m013_memories", "m014_live_journal",
                                 "m015_recall_vectors", "m016_attachment_sent_whole", "m017_said_fts"]
        assert conn.execute("SELECT sources, ref, approvals FROM turns").fetchone() == ("[]", None, "[]")


def test_m013_adds_the_memory_tables_to_an_m012_file(tmp_path: Path) -> None:
    # a history.db of m012 gets the saved memories and each conversation's frozen block
    db = tmp_path / "history.db"
    with connect(db) as conn:
        migrated_through(conn, 12)
        assert migrate(conn)[0] == "m013_memories"
        assert table_columns(conn, "memories") == [
            "id", "text", "created_at", "updated_at", "conversation_id", "turn"]
        assert table_columns(conn, "conversation_memories") == ["conversation_id", "block"]


def test_m014_keeps_the_live_numbering_and_indexes_refs(tmp_path: Path) -> None:
    """A history.db of m013 gains the live state's tables, empty, and an index of turns by ref."""
    db = tmp_path / "history.db"
    with connect(db) as conn:
        migrated_through(conn, 13)
        assert migrate(conn) == ["m014_live_journal", "m015_recall_vectors", "m016_attachment_sent_whole",
                                 "m017_said_fts"]
        assert table_columns(conn, "live_seq") == ["id", "reserved"]
        assert table_columns(conn, "live_changes") == ["seq", "at", "event"]
        assert conn.execute("SELECT count(*) FROM live_changes").fetchone() == (0,)
        assert "WHERE ref IS NOT NULL" in schema_sql(conn, "turns_ref")


def test_m015_adds_recall_vectors_that_go_with_their_conversation(tmp_path: Path) -> None:
    """A history.db of m014 gains `recall_vectors`; a deleted or incognito conversation's rows go,
    and so does a forgotten memory's."""
    db = tmp_path / "history.db"
    with connect(db) as conn:
        migrated_through(conn, 14)
        assert migrate(conn) == ["m015_recall_vectors", "m016_attachment_sent_whole", "m017_said_fts"]
        assert table_columns(conn, "recall_vectors") == ["id", "conversation_id", "model", "digest", "vector"]
        with conn:
            for _ in range(3):
                conn.execute("INSERT INTO conversations (title, created_at, updated_at) VALUES ('t', 'x', 'x')")
            conn.execute("INSERT INTO memories (text, created_at, updated_at) VALUES ('m', 'x', 'x')")
            conn.executemany("INSERT INTO recall_vectors VALUES (?, ?, 'e', 'd', x'00')",
                             [(1 << 32 | 256, 1), (2 << 32 | 256, 2), (3 << 32 | 256, 3), (-65537, 3), (1, 0)])
            conn.execute("UPDATE conversations SET deleted_at = 'y' WHERE id = 1")
            conn.execute("""UPDATE conversations SET settings = '{"memory": "off"}' WHERE id = 3""")
            conn.execute("DELETE FROM memories")
        assert conn.execute("SELECT id, conversation_id FROM recall_vectors").fetchall() == [(2 << 32 | 256, 2)]


def test_m016_reads_an_older_file_as_not_sent_whole(tmp_path: Path) -> None:
    """A history.db of m015 gains `attachments.sent_whole`; its files read as cut (0), so recall
    searches them whenever it searches the conversation, as it did before."""
    db = tmp_path / "history.db"
    with connect(db) as conn:
        migrated_through(conn, 15)
        with conn:
            conn.execute("INSERT INTO conversations (title, created_at, updated_at) VALUES ('t', 'x', 'x')")
            conn.execute("INSERT INTO attachments (conversation_id, turn, name, path, kind, content_type, size_bytes, "
                         "sha256, full_text, created_at) VALUES (1, 1, 'a.txt', '/a.txt', 'text', 'text/plain', 1, "
                         "'s', 'a', 'x')")
        assert migrate(conn) == ["m016_attachment_sent_whole", "m017_said_fts"]
        assert conn.execute("SELECT sent_whole FROM attachments").fetchall() == [(0,)]


def test_m017_indexes_what_the_user_said_but_questions_that_only_ask(tmp_path: Path) -> None:
    """A history.db of m016 gains `said_fts`, filled from `message_fts`: each turn's question that
    says more than it asks, under its rowid; not the replies, nor a question that only asks."""
    db = tmp_path / "history.db"
    with connect(db) as conn:
        migrated_through(conn, 16)
        said = ["My bike is a Brompton.", "What size are its tyres?", "It is red. Is red fast?", "Is it? Really?"]
        with conn:
            conn.execute("INSERT INTO conversations (title, created_at, updated_at) VALUES ('t', 'x', 'x')")
            for turn, text in enumerate(said, start=1):
                index_turn(conn, 1, turn, [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}],
                           said=False)
        assert migrate(conn) == ["m017_said_fts"]
        rows = conn.execute("SELECT rowid, body FROM said_fts ORDER BY rowid").fetchall()
        assert rows == [(message_rowid(1, 1, 0), said[0]), (message_rowid(1, 3, 0), said[2])]
        assert conn.execute("SELECT v FROM said_fts_config WHERE k = 'automerge'").fetchone() == (8,)
