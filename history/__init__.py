"""SQLite history: conversations, turns, migrations and the FTS5 message index."""

from .aio import AsyncHistory
from .fts import (
    CONVERSATION_SHIFT,
    MAX_CONVERSATION_ID,
    MAX_MESSAGE_INDEX,
    MAX_TURN,
    SUMMARY_SLOT,
    TURN_SHIFT,
    conversation_rowid_range,
    message_rowid,
    message_text,
    quote_fts,
    split_rowid,
    turn_rowid_range,
)
from .migrations import MIGRATIONS, migrate
from .records import (
    TURN_STATUSES,
    Attachment,
    Conversation,
    NewAttachment,
    SearchHit,
    Turn,
    TurnStatus,
    tool_calls,
    utc_timestamp,
)
from .store import UNSET, HistoryStore

__all__ = [
    "AsyncHistory",
    "Attachment",
    "NewAttachment",
    "CONVERSATION_SHIFT",
    "Conversation",
    "HistoryStore",
    "MAX_CONVERSATION_ID",
    "MAX_MESSAGE_INDEX",
    "MAX_TURN",
    "MIGRATIONS",
    "SUMMARY_SLOT",
    "SearchHit",
    "TURN_SHIFT",
    "TURN_STATUSES",
    "Turn",
    "TurnStatus",
    "UNSET",
    "conversation_rowid_range",
    "message_rowid",
    "message_text",
    "migrate",
    "quote_fts",
    "split_rowid",
    "tool_calls",
    "turn_rowid_range",
    "utc_timestamp",
]
