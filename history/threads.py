"""Threads: how a client that resends its whole conversation finds the one it continues.

A client of the OpenAI API keeps no id of ours: each request carries every earlier message.
``thread_digest`` names the texts of those messages, a user's question and the reply it got
per turn, so that the store finds, in one index seek (``HistoryStore.thread_conversation``),
the conversation whose turns are exactly those. Texts are compared without the whitespace
around them, which clients trim or keep as they like. The client's system prompt is part of
the thread: two clients with the same messages under different instructions are two
conversations (docs/DESIGN.md, "The OpenAI door").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

__all__ = ["IMPORTED", "thread_digest"]

IMPORTED = "imported"  # the finish reason of a turn a client brought, which the daemon never answered


def thread_digest(turns: Sequence[tuple[str, str]], system: str | None = None) -> str:
    """The digest of a conversation's turns, each its question's text and its reply's, under the
    system prompt ``system`` (None: the client sent none; such a digest is what it was before the
    system prompt took part, so the threads recorded then still match)."""
    texts: list[Any] = [[question.strip(), reply.strip()] for question, reply in turns]
    if system is not None:
        texts = [{"system": system.strip()}, *texts]
    return hashlib.sha256(json.dumps(texts, ensure_ascii=False).encode("utf-8", "surrogatepass")).hexdigest()
