"""Records read from history.db, and how each is shown to a client."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import Any, Literal, Self

from core.jsontext import strict_loads

TurnStatus = Literal["running", "complete", "cancelled", "error", "interrupted"]
TURN_STATUSES: tuple[TurnStatus, ...] = (
    "running",
    "complete",
    "cancelled",
    "error",
    "interrupted",
)

# Microseconds keep timestamps distinct between quick successive writes, and the
# fixed width makes text order equal time order, which listing and cursors rely on.
TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"

# Shown for a tool call whose result never arrived (the turn was cancelled mid-call).
NO_RESULT_SUMMARY = "no result"
SUMMARY_FALLBACK_CHARS = 120


def utc_timestamp(moment: datetime | None = None) -> str:
    """ISO-8601 UTC with microseconds, e.g. 2026-11-29T19:50:19.123456Z."""
    return (moment or datetime.now(UTC)).astimezone(UTC).strftime(TIMESTAMP_FORMAT)


def parse_timestamp(text: str) -> datetime:
    """The datetime of a `utc_timestamp()` string."""
    return datetime.strptime(text, TIMESTAMP_FORMAT).replace(tzinfo=UTC)


def json_column(kind: type[list[Any]] | type[dict[str, Any]]) -> Callable[[str | None], Any]:
    """A converter from a JSON text column to a ``kind`` (a fresh empty one when it is not)."""

    def convert(raw: str | None) -> Any:
        # A hand-edited or half-migrated row must not make a whole conversation unreadable.
        if not raw:
            return kind()
        try:
            value = json.loads(raw)
        except ValueError:
            return kind()
        return value if isinstance(value, kind) else kind()

    return convert


def column(name: str | None = None, convert: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """``field()`` metadata: read from column ``name`` (default: the field's), through ``convert``."""
    return {"column": name, "convert": convert}


@dataclass(frozen=True)
class _FieldPlan:
    name: str
    column: str
    convert: Callable[[Any], Any] | None
    optional: bool  # has a default, used when the SELECT leaves the column out


# Worked out once per class: from_row runs for every turn of every listing.
_PLANS: dict[type, tuple[_FieldPlan, ...]] = {}


def _plan(record: type) -> tuple[_FieldPlan, ...]:
    return tuple(
        _FieldPlan(
            name=f.name,
            column=f.metadata.get("column") or f.name,
            convert=f.metadata.get("convert"),
            optional=f.default is not MISSING or f.default_factory is not MISSING,
        )
        for f in fields(record)
    )


class FromRow:
    """Builds a dataclass record from an ``sqlite3.Row``, field by field.

    Each field is read from the column of its own name unless its
    ``field(metadata=column(...))`` names another or a converter; a field with a
    default may be missing from the SELECT.
    """

    @classmethod
    def from_row(cls, row: sqlite3.Row, **given: Any) -> Self:
        """The record of ``row``; ``given`` supplies fields that are not columns."""
        keys = row.keys()
        values = dict(given)
        plans = _PLANS.get(cls) or _PLANS.setdefault(cls, _plan(cls))
        for plan in plans:
            if plan.name in values or (plan.optional and plan.column not in keys):
                continue
            raw = row[plan.column]
            values[plan.name] = plan.convert(raw) if plan.convert else raw
        return cls(**values)


@dataclass
class Conversation(FromRow):
    """One conversation row, with the number of turns it holds."""

    id: int
    title: str
    model: str | None
    settings: dict[str, Any] = field(metadata=column(convert=json_column(dict)))
    ctx_used: int
    created_at: str
    updated_at: str
    turns: int = field(metadata=column("turn_count"))
    system_prompt: str | None = None  # None: the daemon's system_prompt; '': no system message

    def to_json(self) -> dict[str, Any]:
        """The item of a `conversations` listing."""
        return {
            "conversation": self.id,
            "title": self.title,
            "updated_at": self.updated_at,
            "turns": self.turns,
        }


@dataclass
class Turn(FromRow):
    """One question and everything the model did to answer it."""

    conversation_id: int
    turn: int
    text: str
    files: list[dict[str, Any]] = field(metadata=column(convert=json_column(list)))
    messages: list[dict[str, Any]] = field(metadata=column(convert=json_column(list)))
    reply: str
    status: TurnStatus
    error: str | None
    error_code: str | None
    finish_reason: str | None
    model: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    created_at: str
    updated_at: str
    # the knowledge-base passages its prompt carried (m008): where they came from, not their text;
    # the passages recalled from the conversation's archive too, told apart by their "recall" key
    sources: list[dict[str, Any]] = field(default_factory=list, metadata=column(convert=json_column(list)))
    ref: str | None = None  # the client's own reference, given on its ask  (m009)
    # how each call of a tool that may act was allowed or denied (m010)
    approvals: list[dict[str, Any]] = field(default_factory=list, metadata=column(convert=json_column(list)))

    @property
    def usage(self) -> dict[str, int | None] | None:
        """Token usage as the router reported it, None when it reported none."""
        if self.prompt_tokens is None and self.completion_tokens is None:
            return None
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }

    def tools(self) -> list[dict[str, Any]]:
        """The tool calls made in this turn, each with its outcome."""
        return tool_calls(self.messages)

    def to_json(self) -> dict[str, Any]:
        """A turn as the `open` request shows it."""
        return {
            "turn": self.turn,
            "text": self.text,
            "files": self.files,
            "reply": self.reply,
            "tools": self.tools(),
            "status": self.status,
            "error": self.error,
            "finish_reason": self.finish_reason,
            "model": self.model,
            # the shape of a ``done`` event's: an object whose counts may be null
            "usage": self.usage or {"prompt_tokens": None, "completion_tokens": None},
            "sources": [source for source in self.sources if "recall" not in source],
            "recalled": [source for source in self.sources if "recall" in source],
            "created_at": self.created_at,
            "ref": self.ref,
            "approvals": self.approvals,
        }


@dataclass
class TurnOutcome:
    """How a turn ended, as ``HistoryStore.finish`` stores it (and as it is shown while a full
    disk keeps it in memory)."""

    conversation: int
    turn: int
    messages: list[dict[str, Any]]
    reply: str
    status: TurnStatus
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ctx_used: int | None = None
    sources: list[dict[str, Any]] = field(default_factory=list)  # its knowledge-base passages'
    approvals: list[dict[str, Any]] = field(default_factory=list)  # its calls' approvals and denials

    @property
    def key(self) -> tuple[int, int]:
        return self.conversation, self.turn

    def shown_on(self, turn: Turn) -> Turn:
        """``turn`` as read from the store (still ``running``) with this outcome in place."""
        return replace(
            turn, messages=self.messages, reply=self.reply, status=self.status, finish_reason=self.finish_reason,
            error=self.error, error_code=self.error_code, prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens, sources=self.sources, approvals=self.approvals,
        )


@dataclass
class Attachment(FromRow):
    """A file attached in a conversation: its metadata, and its full text when loaded."""

    id: int
    conversation_id: int
    turn: int
    name: str
    path: str
    kind: str
    content_type: str
    size_bytes: int
    sha256: str
    pages: int | None
    created_at: str
    has_text: bool = field(metadata=column(convert=bool))
    full_text: str | None = None  # only from HistoryStore.attachment()
    video_line: str | None = None  # a video's text, the line it was stored with (its duration and size)

    def to_json(self) -> dict[str, Any]:
        """An item of attachment_recall's ``list``."""
        return {
            "id": self.id,
            "filename": self.name,
            "content_type": self.content_type,
            "size_bytes": self.size_bytes,
            "has_text": self.has_text,
            "pages": self.pages,
            "turn": self.turn,
            "created_at": self.created_at,
        }


@dataclass
class NewAttachment:
    """An attachment to store with the turn that carries it."""

    name: str
    path: str
    kind: str
    content_type: str
    size_bytes: int
    sha256: str
    pages: int | None = None
    full_text: str | None = None
    sent_whole: bool = False  # its question carried all of ``full_text`` (not cut to the budget)


@dataclass(frozen=True)
class NewTurn:
    """A question to store as a new running turn (``HistoryStore.start_turn``)."""

    conversation: int | None  # None: a new conversation, made in the same transaction
    text: str
    messages: list[dict[str, Any]]
    files: list[dict[str, Any]]  # the chips, as the protocol sends them
    model: str | None  # None: the conversation's own model, else ``default_model``
    title: str = ""  # of a conversation made here (ignored otherwise), as the next two
    attachments: Sequence[NewAttachment] = ()
    conversation_model: str | None = None
    default_model: str | None = None
    system_prompt: str | None = None  # None: the daemon's
    ref: str | None = None  # the client's own name for the turn


def _flipped_bm25(score: float) -> float:
    # bm25() is negative with lower meaning better; flipped so callers (and the model
    # reading conversation_search results) see "bigger is better". (0.0 - x, not -x: an
    # unranked hit's 0.0 must not read as -0.0.)
    return 0.0 - float(score)


@dataclass
class SearchHit(FromRow):
    """One message found by full-text search; rank is -bm25, higher is better."""

    conversation_id: int
    turn: int
    role: str
    excerpt: str
    rank: float = field(metadata=column(convert=_flipped_bm25))
    created_at: str


@dataclass
class Compaction(FromRow):
    """A stored summary standing for turns 1..through_turn of a conversation."""

    id: int
    conversation_id: int
    through_turn: int
    summary: str
    created_at: str


def parse_arguments(raw: Any) -> Any:
    """Tool-call arguments as a JSON object when they are one, else as sent."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = strict_loads(raw)  # NaN or "\ud800" could not be sent in an event
        except (ValueError, RecursionError):
            return raw
        if isinstance(value, dict):
            return value
    return raw


def _outcome(result: dict[str, Any] | None) -> tuple[bool, str]:
    if result is None:
        return False, NO_RESULT_SUMMARY
    content = result.get("content")
    text = content if isinstance(content, str) else ""
    # Results stored by the daemon carry "ok"/"summary"; older rows fall back to the
    # "Error: ..." convention tool failures are reported to the model with.
    ok = result.get("ok")
    summary = result.get("summary")
    return (
        bool(ok) if ok is not None else not text.startswith("Error"),
        summary if isinstance(summary, str) else text[:SUMMARY_FALLBACK_CHARS],
    )


def tool_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`{name, arguments, ok, summary, server, tool}` per assistant tool call, in call order;
    ``server`` names the MCP server of a hosted tool (None for the daemon's own), ``tool`` the
    tool's name there."""
    results = {
        m.get("tool_call_id"): m for m in messages if m.get("role") == "tool"
    }
    calls: list[dict[str, Any]] = []
    for message in messages:
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or []:
            if not isinstance(call, dict):
                continue
            function = call.get("function") or {}
            result = results.get(call.get("id"))
            ok, summary = _outcome(result)
            name = function.get("name", "")
            calls.append(
                {
                    "name": name,
                    "arguments": parse_arguments(function.get("arguments")),
                    "ok": ok,
                    "summary": summary,
                    "server": (result or {}).get("server"),
                    "tool": (result or {}).get("tool") or name,
                }
            )
    return calls


@dataclass
class TurnContext:
    """What a new turn's prompt needs from history, read in one trip to the store."""

    conversation: Conversation
    compaction: Compaction | None  # the latest one; its summary stands for the turns it folded
    # (turn, messages) of the answered turns after the compaction and after the turn the
    # caller asked to read after (``HistoryStore.turn_context``'s ``after``)
    earlier: list[tuple[int, list[dict[str, Any]]]]
    has_attachments: bool
    kb_ids: list[int]  # the knowledge bases the conversation sees
    after: int = 0  # what it was read with: ``earlier`` holds only the answered turns after it
    # the saved memories its system prompt carries, frozen at its first prompt and read (or made)
    # in the same trip ("" none: memory is off for it); None when the trip was not asked to
    memories: str | None = None
