"""An in-process fake model, for testing the lower floors without HTTP.

``FakeModel`` is both seams a lower package takes (``core.seams``): a ``Completer``
whose ``complete`` returns the replies queued with ``enqueue``, in order (as llm's
``tests/conftest.py`` ``MockModel.enqueue``), and an ``Embedder`` whose vectors are the
fake router's hashed bag of words (``selfcheck.fakerouter.fake_embedding``), so texts
sharing words point alike and a test can mix the two fakes. Every call is recorded.

What goes over the wire (request bodies, SSE, HTTP errors) is the router client's
concern, tested against the fake router on loopback (``selfcheck.fakerouter``); a test
of compaction or of knowledge bases needs only a model's answers.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from core.errors import RouterUnreachable
from selfcheck.fakerouter import fake_embedding

if TYPE_CHECKING:
    from core.seams import Completer, Embedder

__all__ = ["Completion", "EmbedCall", "FakeModel"]


@dataclass
class Completion:
    """One ``complete`` call, as it was made (the messages copied at the time)."""

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class EmbedCall:
    """One ``embed`` call, as it was made."""

    model: str
    inputs: list[str]
    timeout: float | None


class FakeModel:
    """Queued completions and deterministic embeddings, in the test's own loop."""

    def __init__(self, dim: int | None = None) -> None:
        self.dim = dim  # None: the fake router's size, so the two fakes' vectors agree
        self.replies: deque[str | BaseException] = deque()
        self.completions: list[Completion] = []
        self.embed_calls: list[EmbedCall] = []
        # raised by every embed call while set (fail_embeddings), as a server that is down
        self.embed_failure: BaseException | None = None

    def enqueue(self, *replies: str | BaseException) -> None:
        """What the next ``complete`` calls answer, in order; an exception is raised instead."""
        self.replies.extend(replies)

    def fail_embeddings(self, failure: BaseException | None = None) -> None:
        """Make every ``embed`` call raise ``failure`` (by default: the server is unreachable)."""
        self.embed_failure = failure or RouterUnreachable("the fake embedding server is down")

    def heal_embeddings(self) -> None:
        """Let ``embed`` answer again."""
        self.embed_failure = None

    async def complete(self, model: str, messages: list[dict[str, Any]], max_tokens: int = 64, **params: Any) -> str:
        self.completions.append(Completion(model, copy.deepcopy(messages), max_tokens, dict(params)))
        if not self.replies:
            raise AssertionError(f"FakeModel.complete({model!r}) was called with no reply queued; enqueue one")
        reply = self.replies.popleft()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def embed(self, model: str, inputs: list[str], timeout: float | None = None) -> list[list[float]]:
        self.embed_calls.append(EmbedCall(model, list(inputs), timeout))
        if self.embed_failure is not None:
            raise self.embed_failure
        if self.dim is None:
            return [fake_embedding(text) for text in inputs]
        return [fake_embedding(text, self.dim) for text in inputs]


if TYPE_CHECKING:  # the type checker holds the fake to both seams
    _completer: Completer = FakeModel()
    _embedder: Embedder = FakeModel()
