"""The small protocols lower packages take instead of the daemon's concrete classes.

A lower package names only what it calls: compaction needs something that completes a
prompt, knowledge bases something that embeds texts, tools something that runs a call
on the history thread. The daemon passes its ``RouterClient`` and ``AsyncHistory``; a
test passes an in-process fake (``tests/fakemodel.py``), with no HTTP in between.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

__all__ = ["Completer", "Embedder", "HistoryRunner"]

T = TypeVar("T")


class Completer(Protocol):
    """Writes a short, non-streamed answer to a prompt (a summary, a title)."""

    async def complete(self, model: str, messages: list[dict[str, Any]], max_tokens: int = 64, **params: Any) -> str:
        ...


class Embedder(Protocol):
    """Turns texts into vectors, one per text in order; ``timeout`` bounds the whole call."""

    async def embed(self, model: str, inputs: list[str], timeout: float | None = None) -> list[list[float]]:
        ...


class HistoryRunner(Protocol):
    """Runs a function with the history store on the store's own thread."""

    async def run(self, fn: Callable[[Any], T]) -> T:
        ...
