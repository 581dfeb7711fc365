"""Threads: how a client that resends its whole conversation finds the one it continues.

A client of the OpenAI API keeps no id of ours: each request carries every earlier message.
``thread_digest`` names the texts of those messages, a user's question and the reply it got
per turn, so that the store finds, in one index seek (``HistoryStore.thread_conversation``),
the conversation whose turns are exactly those. Texts are compared without the whitespace
around them, which clients trim or keep as they like.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

__all__ = ["IMPORTED", "thread_digest"]

IMPORTED = "imported"  # the finish reason of a turn a client brought, which the daemon never answered


def thread_digest(turns: Sequence[tuple[str, str]]) -> str:
    """The digest of a conversation's turns, each its question's text and its reply's."""
    texts = [[question.strip(), reply.strip()] for question, reply in turns]
    return hashlib.sha256(json.dumps(texts, ensure_ascii=False).encode("utf-8", "surrogatepass")).hexdigest()
