"""The small protocols lower packages take instead of the daemon's concrete classes.

A lower package names only what it calls: compaction needs something that completes a
prompt, knowledge bases something that embeds texts. The daemon passes its
``RouterClient``; a test passes an in-process fake (``tests/fakemodel.py``), with no HTTP
in between. (The history is no seam: the packages above ``history`` take its
``AsyncHistory`` itself.)
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Completer", "Embedder", "ImageReader"]


class Completer(Protocol):
    """Writes a short, non-streamed answer to a prompt (a summary, a title)."""

    async def complete(self, model: str, messages: list[dict[str, Any]], max_tokens: int = 64, **params: Any) -> str:
        ...


class Embedder(Protocol):
    """Turns texts into vectors, one per text in order; ``timeout`` bounds the whole call."""

    async def embed(self, model: str, inputs: list[str], timeout: float | None = None) -> list[list[float]]:
        ...


class ImageReader(Protocol):
    """Checks an image handed over whole (an MCP tool's) as an attached one is, and makes it
    the data URL the model gets: decoded within a bound, scaled; ``FileRefused`` when it cannot
    be used."""

    async def __call__(self, data: bytes, name: str) -> str:
        ...
