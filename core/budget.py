"""How a model's context is shared between the prompt and the reply.

Three rules keep a conversation alive on a real server (docs/DESIGN.md, "Budgets"):

- **A reply leaves room.** Every chat request carries ``max_tokens``: at most
  ``max_reply_tokens`` (default a quarter of the context), and never so much that the
  prompt and the reply would leave less than ``NEXT_QUESTION_SHARE`` of the context for
  the next question.  A model that writes until it is stopped ("a very long story")
  ends with ``finish_reason: "length"`` instead of filling the context for good.
- **A prompt leaves room for a reply**: it may take at most the context less the
  smallest reply (``Budget.prompt_limit``); what is more is compacted, cut or refused.
- **No replayed message takes more than ``REPLAY_SHARE`` of the context.**  A longer one
  (a reply from a model with a larger context, a file attached before a model switch)
  is replayed as its head and tail around a marker saying where the whole is.  The cut
  depends only on the message and the context size, so a replayed message is the same
  bytes on every turn and the server's prompt cache keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .tokens import CHARS_PER_TOKEN, estimate_text

__all__ = ["MIN_TOOLS_CONTEXT", "PLAIN_CUT_MARKER", "Budget", "cut_text", "fit_message", "replay_marker"]

REPLY_SHARE = 0.25  # the default reply cap, of the context
NEXT_QUESTION_SHARE = 0.125  # room a reply leaves for the next question, of the context
MIN_REPLY_SHARE = 0.125  # the smallest reply a prompt must leave room for, of the context
REPLAY_SHARE = 0.5  # the most of the context one replayed message may take
SUMMARY_TOKENS = 600  # the longest summary of folded turns...
SUMMARY_SHARE = 0.125  # ...in a context of 4,800 tokens or more; a smaller one keeps less
MIN_CUT_CHARS = 200  # a cut text part keeps at least this much of its head and tail
CUT_MARKER = (
    "\n\n[… {omitted:,} characters of this message are left out here to fit the context; the whole "
    "text is in this conversation's history: conversation_search finds its words, attachment_recall "
    "re-reads its files …]\n\n"
)
# where the model has no tools (a context under MIN_TOOLS_CONTEXT): the cut named, no tool
PLAIN_CUT_MARKER = "\n\n[… {omitted:,} characters of this message are left out here to fit the context …]\n\n"
MIN_TOOLS_CONTEXT = 2048  # a smaller context is offered none of the daemon's own tools (docs/DESIGN.md)


@dataclass(frozen=True)
class Budget:
    """The shares of one model's context; ``ctx_max`` is never 0 here (an assumed size at worst)."""

    ctx_max: int
    max_reply_tokens: int = 0  # the configured cap; 0: REPLY_SHARE of the context

    @property
    def reply_cap(self) -> int:
        default = int(self.ctx_max * REPLY_SHARE)
        return max(1, min(self.max_reply_tokens or default, self.ctx_max - 1))

    @property
    def min_reply(self) -> int:
        return max(1, min(self.reply_cap, int(self.ctx_max * MIN_REPLY_SHARE)))

    @property
    def prompt_limit(self) -> int:
        """The most tokens a prompt may take: the context less the smallest reply."""
        return self.ctx_max - self.min_reply

    @property
    def summary_tokens(self) -> int:
        """The most a compaction summary may take (room is kept for it when planning)."""
        return min(SUMMARY_TOKENS, int(self.ctx_max * SUMMARY_SHARE))

    @property
    def replay_tokens(self) -> int:
        """The most tokens one replayed message may take."""
        return int(self.ctx_max * REPLAY_SHARE)

    @property
    def passage_limit(self) -> int:
        """The most a prompt with recalled passages may take: they never shrink the reply below its cap."""
        return self.ctx_max - self.reply_cap - int(self.ctx_max * NEXT_QUESTION_SHARE)

    def reply_tokens(self, prompt_tokens: int) -> int:
        """``max_tokens`` for a request whose prompt takes about ``prompt_tokens``."""
        room = self.ctx_max - prompt_tokens - int(self.ctx_max * NEXT_QUESTION_SHARE)
        return max(self.min_reply, min(self.reply_cap, room))


def cut_text(text: str, max_chars: int, marker: str = CUT_MARKER) -> str:
    """``text`` within about ``max_chars``: its head and tail around a ``marker`` naming the cut."""
    keep = max(max_chars - len(marker) - 8, 2 * MIN_CUT_CHARS)
    if len(text) <= max(max_chars, keep + len(marker)):
        return text
    head, tail = text[: keep * 2 // 3], text[len(text) - keep // 3 :]
    return head + marker.format(omitted=len(text) - len(head) - len(tail)) + tail


def replay_marker(ctx_max: int) -> str:
    """The marker of a cut in a message replayed to a model of context ``ctx_max``: naming the
    tools that find the whole only where the model has them."""
    return CUT_MARKER if ctx_max >= MIN_TOOLS_CONTEXT else PLAIN_CUT_MARKER


def fit_message(message: dict[str, Any], max_tokens: int, marker: str = CUT_MARKER) -> dict[str, Any]:
    """``message`` with its text cut so it takes about ``max_tokens`` at most, each cut marked
    by ``marker``.

    Each text part gives up room in proportion to its size, so a question beside a
    large file keeps its words; images and tool calls are kept as they are.  The
    message itself is returned when it already fits.
    """
    content = message.get("content")
    if isinstance(content, str):
        tokens = estimate_text(content)
        if tokens <= max_tokens:
            return message
        return {**message, "content": cut_text(content, _chars(content, max_tokens, tokens), marker)}
    if not isinstance(content, list):
        return message
    texts = [p.get("text", "") if isinstance(p, dict) and p.get("type") == "text" else "" for p in content]
    total = sum(estimate_text(t) for t in texts if t)
    if total <= max_tokens:
        return message
    parts = []
    for part, text in zip(content, texts):
        if text:
            tokens = estimate_text(text)
            share = max_tokens * tokens // total
            part = {**part, "text": cut_text(text, _chars(text, share, tokens), marker)}
        parts.append(part)
    return {**message, "content": parts}


def _chars(text: str, max_tokens: int, tokens: int) -> int:
    """How many characters of ``text`` (``tokens`` long) make about ``max_tokens``."""
    if text.isascii():
        return max_tokens * CHARS_PER_TOKEN
    return max(1, len(text) * max_tokens // max(tokens, 1))
