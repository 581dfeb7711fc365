"""What the live state keeps across a restart: the numbering of changes, and the journal.

``JournalStore`` shares the ``HistoryStore``'s connection (``store.journal``), as the
knowledge-base tables do. The daemon numbers its changes itself (``daemon.live``); the
store keeps two things for it, neither written on a turn's path:

- ``live_seq.reserved``: a number no change has passed. At each start the daemon counts
  on from it and reserves a block ahead (``start``), and reserves the next block long
  before it is used up (``reserve``): one write per block of changes, and after a crash
  (nothing saved) the numbering still never goes back, it only skips the rest of a block.
- ``live_changes``: the changes of the last run, written once at a clean stop (``save``)
  and read back, and emptied, at the next start: a watcher that reconnects after a restart
  is sent what it missed. After a crash the table is empty, and it is told it missed some.

Looking a turn up by the ``ref`` its ask carried lives here too: it is how a client that
lost its connection finds its own question again (m012's index).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from .migrations import immediate_transaction
from .records import Turn
from .sql import TURN_COLUMNS

__all__ = ["JournalStore", "SavedChange"]

SELECT_RESERVED = "SELECT reserved FROM live_seq WHERE id = 1"
SET_RESERVED = "INSERT INTO live_seq (id, reserved) VALUES (1, ?) ON CONFLICT (id) DO UPDATE SET reserved = excluded.reserved"
SELECT_CHANGES = "SELECT seq, at, event FROM live_changes ORDER BY seq"
INSERT_CHANGE = "INSERT INTO live_changes (seq, at, event) VALUES (?, ?, ?)"
# the newest turn with the ref, of a conversation not deleted (turns_ref: m012)
SELECT_TURN_BY_REF = f"""
SELECT {TURN_COLUMNS}
FROM turns AS t JOIN conversations AS c ON c.id = t.conversation_id
WHERE t.ref = ? AND c.deleted_at IS NULL
ORDER BY t.created_at DESC, t.conversation_id DESC LIMIT 1
"""


@dataclass(frozen=True)
class SavedChange:
    """One change of an earlier run: its number, when it was made (Unix time), its event as JSON."""

    seq: int
    at: float
    event: str


class JournalStore:
    """The ``live_seq`` and ``live_changes`` tables (m012)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def start(self, block: int) -> tuple[int, list[SavedChange]]:
        """The number to count on from and the changes the last run saved (taken: the table is
        emptied); ``block`` numbers past it are reserved for this run."""
        with immediate_transaction(self._conn):
            row = self._conn.execute(SELECT_RESERVED).fetchone()
            base = row[0] if row else 0
            saved = [SavedChange(*r) for r in self._conn.execute(SELECT_CHANGES)]
            self._conn.execute("DELETE FROM live_changes")
            self._conn.execute(SET_RESERVED, (base + block,))
        return base, saved

    def reserved(self) -> int:
        """The reservation as it stands (read only: a start on a full disk numbers on from it)."""
        row = self._conn.execute(SELECT_RESERVED).fetchone()
        return row[0] if row else 0

    def reserve(self, upto: int) -> None:
        """No change of this run is numbered past ``upto`` without another reservation."""
        with immediate_transaction(self._conn):
            self._conn.execute(SET_RESERVED, (upto,))

    def save(self, last: int, changes: list[SavedChange]) -> None:
        """At a clean stop: the next run counts on from ``last`` and can replay ``changes``."""
        with immediate_transaction(self._conn):
            self._conn.execute("DELETE FROM live_changes")
            self._conn.executemany(INSERT_CHANGE, [(c.seq, c.at, c.event) for c in changes])
            self._conn.execute(SET_RESERVED, (last,))

    def turn_by_ref(self, ref: str) -> Turn | None:
        """The newest turn whose ask carried ``ref``, in a conversation not deleted; None when none did."""
        row = self._conn.execute(SELECT_TURN_BY_REF, (ref,)).fetchone()
        return Turn.from_row(row) if row else None

