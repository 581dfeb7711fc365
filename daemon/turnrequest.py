"""What a turn is asked to do: ``TurnRequest``, the engine's input whoever asks.

The socket's ``ask`` (``TurnRequest.of``) and the OpenAI door (``daemon/openai/door.py``)
each build one; ``TurnEngine.ask`` takes it. ``check`` refuses what no turn can do, once
the turn is admitted (a refused ask still names its turn).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from attachments import MAX_FILES, Prepared, too_many_files
from core.errors import BadRequest
from core.presets import Preset, find_preset
from core.sampling import SAMPLING_KEYS

from .protocol import Request

__all__ = ["MAX_REF_CHARS", "TurnRequest"]

MAX_REF_CHARS = 128  # an ask's ``ref``: a client's own id for it, stored with the question


@dataclass(frozen=True)
class TurnRequest:
    """A question for a turn: its words and files, where it goes, and how it is answered."""

    text: str = ""
    files: list[str] = field(default_factory=list)
    conversation: int | None = None  # None: a new conversation
    model: str | None = None  # the model the ask names
    system: str | None = None  # a new conversation's own system prompt
    ref: str | None = None  # the client's own reference, stored with the question
    preset: str | None = None  # the preset whose prompt goes before ``text`` (core/presets.py)
    sampling: dict[str, Any] = field(default_factory=dict)  # the turn's own sampling, over the settings'
    # an OpenAI client's own tools, offered beside the daemon's; and their results, which take
    # up again the conversation's last turn (it ended on calls to them)
    client_tools: list[dict[str, Any]] = field(default_factory=list)
    tool_results: list[dict[str, Any]] | None = None
    memory: str | None = None  # a new conversation's ``memory`` setting ("off": incognito)

    @classmethod
    def of(cls, request: Request) -> TurnRequest:
        """The turn a socket ``ask`` asks for (its fields validated by ``protocol.validate``)."""
        return cls(
            text=request.get("text", ""), files=request.get("files", []), conversation=request.get("conversation"),
            model=request.get("model") or None, system=request.get("system"), ref=request.get("ref"),
            preset=request.get("preset"),
            sampling={key: value for key in SAMPLING_KEYS if (value := request.get(key)) is not None},
            memory=request.get("memory"),
        )

    def check(self, presets: Mapping[str, Preset]) -> Preset | None:
        """Refuse (``BadRequest``, ``NotFound``) what no turn can do; the preset it names."""
        if self.tool_results is not None:
            if self.conversation is None:
                raise BadRequest("tool results continue a conversation's last turn; name the conversation")
            return None
        preset = find_preset(presets, self.preset) if self.preset is not None else None
        if preset is not None and not self.files:
            preset.check([])
        if self.ref is not None and len(self.ref) > MAX_REF_CHARS:
            raise BadRequest(
                f"ask: 'ref' may have at most {MAX_REF_CHARS} characters, not {len(self.ref)}; send a short "
                "reference of the client's own (a counter, a UUID)"
            )
        if self.conversation is not None and self.system is not None:
            raise BadRequest(
                f"'system' sets a new conversation's system prompt; change conversation {self.conversation}'s with "
                "the settings request"
            )
        if self.conversation is not None and self.memory is not None:
            raise BadRequest(
                f"'memory' sets a new conversation's memory; change conversation {self.conversation}'s with the "
                "settings request"
            )
        if len(self.files) > MAX_FILES:
            raise too_many_files(len(self.files))
        if not self.text.strip() and not self.files:
            raise BadRequest("ask needs a question in 'text', or files")
        return preset

    def question(self, prepared: list[Prepared]) -> str:
        """What the question is about in words: its text, else its files' names."""
        return self.text or " ".join(p.name for p in prepared)

    def with_preset(self, preset: Preset | None, prepared: list[Prepared]) -> TurnRequest:
        """The request as sent: the preset's prompt before its text, once the files suit the
        preset (BadRequest naming the kinds otherwise)."""
        if preset is None:
            return self
        preset.check([(p.name, p.preset_kinds()) for p in prepared])
        return dataclasses.replace(self, text=preset.question(self.text), preset=None)
