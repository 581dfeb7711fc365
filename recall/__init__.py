"""Model tools over a conversation's own past, token estimates and compaction."""

from .tokens import CHARS_PER_TOKEN, estimate_messages, estimate_text

__all__ = ["CHARS_PER_TOKEN", "estimate_messages", "estimate_text"]
