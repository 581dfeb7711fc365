"""What the knowledge-base facade answers: KB summaries, add results, progress."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from history import KnowledgeBase

from .ingest import FileNote

__all__ = ["AddResult", "KbInfo", "KbProgress", "Phase", "ProgressCallback"]

Phase = Literal["reading", "embedding"]


@dataclass(frozen=True)
class KbProgress:
    """One step of a kb_add: files read (``reading``) or chunks embedded (``embedding``)."""

    done: int
    total: int
    phase: Phase
    detail: str
    stage: Literal["ingesting"] = "ingesting"

    def to_json(self) -> dict[str, Any]:
        """The fields of the ``progress`` event (type, id and kb are the daemon's)."""
        return {"stage": self.stage, "phase": self.phase, "done": self.done, "total": self.total,
                "detail": self.detail}


ProgressCallback = Callable[[KbProgress], None]


@dataclass
class KbInfo:
    """One knowledge base as kb_list shows it."""

    name: str
    documents: int
    chunks: int
    pages: int
    linked_all: bool  # linked to every conversation
    conversations: list[int]  # live conversations linked one by one
    created_at: str
    embedded: int | None = None  # chunks with a vector of the configured model (None: no embedder)

    @classmethod
    def from_record(cls, kb: KnowledgeBase, embedded: int | None = None) -> KbInfo:
        return cls(kb.name, kb.documents, kb.chunks, kb.pages, kb.linked_all, kb.conversations,
                   kb.created_at, embedded)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "kb": self.name,
            "documents": self.documents,
            "chunks": self.chunks,
            "pages": self.pages,
            "linked_all": self.linked_all,
            "conversations": self.conversations,
            "created_at": self.created_at,
        }
        if self.embedded is not None:
            data["embedded"] = self.embedded
        return data


@dataclass
class AddResult:
    """What a kb_add did: the KB's totals after it, and what happened to each file."""

    kb: str
    documents: int = 0  # in the KB after the add
    chunks: int = 0  # in the KB after the add
    added: int = 0  # new documents
    updated: int = 0  # documents whose file changed, re-indexed
    unchanged: int = 0  # files already indexed as they are: nothing done
    removed: int = 0  # documents whose file is gone from a folder added again
    new_chunks: int = 0
    embedded: int = 0  # chunks embedded by this add
    pending: int = 0  # chunks still without a vector (found by keywords until embedded)
    embedding_error: str | None = None  # why embedding stopped, when it did
    truncated: list[str] = field(default_factory=list)  # documents indexed only in part (size cap)
    skipped: list[FileNote] = field(default_factory=list)  # images, other kinds, files without text
    errors: list[FileNote] = field(default_factory=list)  # bad paths, unreadable files
    cancelled: bool = False  # a cancel stopped it: what was stored whole is kept
    unread: int = 0  # files the cancel left unread
    created: bool = False  # the add made the KB (not in the ``kb`` event: the watchers are told)

    def to_json(self) -> dict[str, Any]:
        """The ``kb`` event's fields."""
        return {
            "kb": self.kb,
            "documents": self.documents,
            "chunks": self.chunks,
            "added": self.added,
            "updated": self.updated,
            "unchanged": self.unchanged,
            "removed": self.removed,
            "new_chunks": self.new_chunks,
            "embedded": self.embedded,
            "pending": self.pending,
            "embedding_error": self.embedding_error,
            # a boolean like a file chip's (an empty list would be truthy in JavaScript/QML)
            "truncated": bool(self.truncated),
            "truncated_documents": self.truncated,
            "skipped": [note.to_json() for note in self.skipped],
            "errors": [note.to_json() for note in self.errors],
            "cancelled": self.cancelled,
            "unread": self.unread,
        }
