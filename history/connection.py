"""Opening history.db: a private file, and the pragmas every connection runs with."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

MEMORY = ":memory:"

# WAL lets readers (the CLI, a backup) work while the daemon writes; NORMAL sync is
# durable across application crashes in WAL mode and much cheaper than FULL; the busy
# timeout rides out another process's short write instead of failing at once. With NORMAL
# the only fsyncs are a checkpoint's, and they were most of what storing a turn cost
# (bench/bench_search.py): checkpointing every 4,000 pages (a WAL of up to 16 MB)
# instead of SQLite's 1,000 pays them a quarter as often.
CONNECTION_PRAGMAS = (
    "PRAGMA journal_mode = WAL",
    "PRAGMA synchronous = NORMAL",
    "PRAGMA wal_autocheckpoint = 4000",
    "PRAGMA busy_timeout = 5000",
    "PRAGMA foreign_keys = ON",
)


def _create_private(path: Path) -> None:
    # Conversations are private: the file is made 0600 before SQLite opens it, and the
    # -wal/-shm files SQLite creates copy the database file's permissions.
    if not path.exists():
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))


def connect(path: Path | str) -> sqlite3.Connection:
    """A connection with ``sqlite3.Row`` rows and CONNECTION_PRAGMAS applied.

    A file path gets its directory (0700) and the file (0600) made first; MEMORY
    opens an in-memory database.
    """
    if isinstance(path, Path):
        directory = path.parent
        if not directory.exists():
            directory.mkdir(parents=True, mode=0o700)
            directory.chmod(0o700)  # mkdir's mode is filtered by the umask
        _create_private(path)
    conn = sqlite3.connect(path)
    try:
        conn.row_factory = sqlite3.Row
        for pragma in CONNECTION_PRAGMAS:
            conn.execute(pragma)
    except BaseException:
        conn.close()
        raise
    return conn
