"""Earlier turns as a prompt replays them, held between turns.

Every turn replays the conversation so far.  Reading all of it from SQLite, decoding
its JSON, cutting oversize messages, estimating tokens and encoding the request's JSON
again on every turn would cost time that grows with the conversation, before the first
token (``bench/bench_ttft.py``, ``bench/bench_body.py``).  The answered turns do not
change once answered (one turn runs per conversation, and nothing edits a past one), so
the replayed form of each, with its JSON bytes, is made once and held here; a turn reads
only the turns answered since (``HistoryStore.turn_context(after=...)``).

What is held stays valid while the conversation's latest compaction and the model's
context size, vision and image cost are the same; otherwise the entry is rebuilt from storage.
Turns carrying images are held without their pixels (resolved from their files for each
prompt), so the cache holds text, and at most ``CACHED_CONVERSATIONS`` conversations.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from attachments import ImageCache, resolve_image_refs
from core import IMAGE_PART_TYPES, fit_message, replay_marker
from core.jsontext import EncodedPrefix, encode_message
from history import Compaction

__all__ = ["ReplayCache", "Replayed", "ReplayedTurn", "encoded_prefix"]

CACHED_CONVERSATIONS = 32
Messages = list[dict[str, Any]]
Model = tuple[int, bool, int]  # what an entry is valid for: the context size, vision and image cost
PRIVATE_MESSAGE_KEYS = ("ok", "summary", "reasoning_content", "server", "tool")  # ours, not the router's


def router_messages(messages: Sequence[dict[str, Any]]) -> Messages:
    """Stored messages as the router takes them: our bookkeeping keys removed."""
    return [{k: v for k, v in m.items() if k not in PRIVATE_MESSAGE_KEYS} for m in messages]


def has_images(messages: Sequence[dict[str, Any]]) -> bool:
    return any(
        isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
        for m in messages if isinstance(m.get("content"), list)
        for part in m["content"]
    )


@dataclass
class ReplayedTurn:
    """One answered turn as replayed: its stored messages (cut to fit) and their tokens."""

    n: int
    stored: Messages  # whole exchanges, oversize text cut; image references as stored
    tokens: int
    sent: Messages | None  # the router's form; None when it has images, resolved per prompt
    json: bytes | None  # ``sent`` encoded once, the messages joined by commas (None with ``sent``)
    # its question replayed as stored, not cut: the files it carried whole are in the prompt
    # whole (recall need not search them)
    whole: bool = False

    async def for_router(self, vision: bool, images: ImageCache) -> Messages:
        if self.sent is not None:
            return self.sent
        return router_messages(await resolve_image_refs(self.stored, images, vision=vision))


@dataclass
class Replayed:
    """A conversation's replayed turns after its latest compaction, up to a turn."""

    compaction: Compaction | None  # the latest; its summary stands for the turns it folded
    ctx_max: int
    vision: bool
    image_tokens: int  # what one image counts in the turns' estimates
    upto: int = 0  # every turn up to this one is in ``turns`` if it was answered
    turns: list[ReplayedTurn] = field(default_factory=list)
    system: Messages | None = None  # the system message, made once per compaction
    system_prompt: str | None = None  # the conversation's system prompt ``system`` was made from

    @property
    def after(self) -> int:
        return self.compaction.through_turn if self.compaction else 0

    @property
    def tokens(self) -> int:
        return sum(t.tokens for t in self.turns)

    def fold(self, compaction: Compaction) -> None:
        """A new compaction now stands for the turns it folded."""
        self.compaction = compaction
        self.turns = [t for t in self.turns if t.n > compaction.through_turn]
        self.system = None


def encoded_prefix(system: Messages, turns: Sequence[ReplayedTurn]) -> EncodedPrefix:
    """The system message and the leading run of text-only turns as JSON bytes, for the
    request's body: what every prompt of the conversation starts with."""
    count, parts = len(system), [encode_message(m) for m in system]
    for turn in turns:
        if turn.sent is None or turn.json is None:
            break  # images: resolved per prompt, encoded with it
        if turn.sent:
            count += len(turn.sent)
            parts.append(turn.json)
    return EncodedPrefix(count, b",".join(parts))


class ReplayCache:
    """The replayed turns of the conversations asked in lately."""

    def __init__(self, estimate: Callable[[Messages, int], int], size: int = CACHED_CONVERSATIONS) -> None:
        self._estimate = estimate
        self._size = size
        self._entries: OrderedDict[int, Replayed] = OrderedDict()

    def held_upto(self, cid: int) -> int:
        """The last turn held for ``cid``: a store read need only bring the turns after it."""
        entry = self._entries.get(cid)
        return entry.upto if entry else 0

    def holds(self, cid: int) -> bool:
        return cid in self._entries

    def get(self, cid: int, after: int, model: Model, held_upto: int) -> Replayed | None:
        """The entry, when it is still valid for ``model`` (ctx_max, vision, image_tokens) and
        holds every turn up to ``held_upto``.

        ``after`` is the latest compaction the store knew of when it was read; the entry may
        know a later one (made by this same turn before a retry).
        """
        entry = self._entries.get(cid)
        if entry is None or (entry.ctx_max, entry.vision, entry.image_tokens) != model:
            return None
        if entry.after < after or entry.upto < held_upto:
            return None
        self._entries.move_to_end(cid)
        return entry

    def start(self, cid: int, compaction: Compaction | None, model: Model) -> Replayed:
        """A new, empty entry for ``cid`` (replacing any), for ``model`` (ctx_max, vision, image_tokens)."""
        entry = Replayed(compaction, *model)
        self._entries[cid] = entry
        self._entries.move_to_end(cid)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)
        return entry

    def add(self, entry: Replayed, turns: Sequence[tuple[int, Messages]], upto: int, replay_tokens: int) -> None:
        """Append the turns answered after ``entry.upto`` (whole exchanges), then hold up to ``upto``."""
        marker = replay_marker(entry.ctx_max)
        for n, messages in turns:
            if n <= entry.upto or n <= entry.after:
                continue
            stored = [fit_message(m, replay_tokens, marker) for m in messages]
            sent = None if has_images(stored) else router_messages(stored)
            json = None if sent is None else b",".join(encode_message(m) for m in sent)
            whole = bool(stored) and stored[0] is messages[0]  # fit_message returns a message that fits
            entry.turns.append(ReplayedTurn(n, stored, self._estimate(stored, entry.image_tokens), sent, json, whole))
        entry.upto = max(entry.upto, upto)
