"""Earlier turns as a prompt replays them, held between turns.

Every turn replays the conversation so far.  Reading all of it from SQLite, decoding
its JSON, cutting oversize messages and estimating tokens again on every turn costs
milliseconds at a few hundred turns, before the first token.  The answered turns do not
change once answered (one turn runs per conversation, and nothing edits a past one), so
the replayed form of each is made once and held here; a turn reads only the turns
answered since (``HistoryStore.turn_context(known=...)``), none when the last one was
held as it was stored (``ContextBuilder.remember``, after its ``done``).

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

from attachments import resolve_image_refs
from core import IMAGE_PART_TYPES, fit_message
from core.jsontext import FrozenJSON
from history import Compaction

__all__ = ["ReplayCache", "Replayed", "ReplayedTurn"]

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
    sent: Messages | None  # the router's form, encoded once; None when it has images, resolved per prompt

    async def for_router(self, vision: bool) -> Messages:
        if self.sent is not None:
            return self.sent
        return router_messages(await resolve_image_refs(self.stored, vision=vision))


@dataclass
class Replayed:
    """A conversation's replayed turns after its latest compaction, up to a turn."""

    compaction: Compaction | None  # the latest; its summary stands for the turns it folded
    ctx_max: int
    vision: bool
    image_tokens: int  # what one image counts in the turns' estimates
    upto: int = 0  # every turn up to this one is in ``turns`` if it was answered
    turns: list[ReplayedTurn] = field(default_factory=list)  # changed by ``append`` and ``fold`` only
    system: Messages | None = None  # the system message, made (and encoded) once per compaction
    system_prompt: str | None = None  # the conversation's system prompt ``system`` was made from
    # kept with ``turns``, so that a prompt does not walk every turn to count and join them
    # (three walks a question, ~0.1 ms at 200 turns): their tokens, and their router form in
    # order, None while one has images (resolved for each prompt)
    tokens: int = 0
    sent: Messages | None = field(default_factory=list)

    @property
    def after(self) -> int:
        return self.compaction.through_turn if self.compaction else 0

    def append(self, turn: ReplayedTurn) -> None:
        self.turns.append(turn)
        self.tokens += turn.tokens
        if self.sent is not None:
            if turn.sent is None:
                self.sent = None
            else:
                self.sent += turn.sent

    def fold(self, compaction: Compaction) -> None:
        """A new compaction now stands for the turns it folded."""
        self.compaction = compaction
        kept = [t for t in self.turns if t.n > compaction.through_turn]
        self.turns, self.tokens, self.sent = [], 0, []
        for turn in kept:
            self.append(turn)
        self.system = None


class ReplayCache:
    """The replayed turns of the conversations asked in lately."""

    def __init__(self, estimate: Callable[[Messages, int], int], size: int = CACHED_CONVERSATIONS) -> None:
        self._estimate = estimate
        self._size = size
        self._entries: OrderedDict[int, Replayed] = OrderedDict()

    def known(self, cid: int) -> int:
        """The last turn held for ``cid``: a store read need only bring the turns after it."""
        entry = self._entries.get(cid)
        return entry.upto if entry else 0

    def holds(self, cid: int) -> bool:
        return cid in self._entries

    def get(self, cid: int, after: int, model: Model, known: int) -> Replayed | None:
        """The entry, when it is still valid for ``model`` (ctx_max, vision, image_tokens) and
        holds every turn up to ``known``.

        ``after`` is the latest compaction the store knew of when it was read; the entry may
        know a later one (made by this same turn before a retry).
        """
        entry = self._entries.get(cid)
        if entry is None or (entry.ctx_max, entry.vision, entry.image_tokens) != model:
            return None
        if entry.after < after or entry.upto < known:
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
        for n, messages in turns:
            if n <= entry.upto or n <= entry.after:
                continue
            stored = [fit_message(m, replay_tokens) for m in messages]
            # encoded once (core.jsontext.json_parts splices the bytes into every request)
            sent: Messages | None = None if has_images(stored) else [FrozenJSON(m) for m in router_messages(stored)]
            entry.append(ReplayedTurn(n, stored, self._estimate(stored, entry.image_tokens), sent))
        entry.upto = max(entry.upto, upto)
