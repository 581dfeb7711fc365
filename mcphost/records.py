"""What the host keeps of a server's tools and of one call's result (plain data, no SDK)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CallOutcome", "RemoteTool"]


@dataclass(frozen=True)
class RemoteTool:
    """One tool as its server lists it."""

    name: str
    description: str
    input_schema: dict[str, Any]


@dataclass
class CallOutcome:
    """A tool call's result: its text, its images (MIME type, base64), and whether the tool failed."""

    text: str
    images: list[tuple[str, str]] = field(default_factory=list)
    is_error: bool = False
