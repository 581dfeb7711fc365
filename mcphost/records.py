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
    # its ToolAnnotations as the server gives them (readOnlyHint, destructiveHint ...), {} for none
    annotations: dict[str, Any] = field(default_factory=dict)

    @property
    def read_only(self) -> bool:
        """Whether its server says it only reads (``readOnlyHint: true``)."""
        return self.annotations.get("readOnlyHint") is True


@dataclass
class CallOutcome:
    """A tool call's result: its text, its images (MIME type, base64), and whether the tool failed."""

    text: str
    images: list[tuple[str, str]] = field(default_factory=list)
    is_error: bool = False
