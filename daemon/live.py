"""Live state: every change, told to every watching client (docs/PROTOCOL.md, "watch").

``Live`` is one small publisher owned by the server and handed to what makes changes:
the handlers (settings, delete, knowledge bases), the turn runner (a conversation
created, a turn started and ended), titles, and the history's late saves of replies a
full disk kept in memory. Each change gets the next daemon-wide ``seq`` and goes at once,
as a ``changed`` event, to each connection that sent ``watch``: no polling, no queue of
its own (an event is queued on the watcher's connection like any other).

A watcher that does not read is bounded like any client: once more than
``WATCH_BACKLOG`` bytes wait for it (beside the largest event waiting, an ``open`` it is
reading: ``Connection.backlog``), it gets one ``missed`` event naming the first
``seq`` it did not get, then nothing until what waits is back under the bound, when
``changed`` events resume. It holds at most the bound and one event; the others are
served meanwhile.

``seq`` never goes back, across restarts too: the history keeps a number no change has
passed (``history.journal``), reserved a block ahead, so the store is written once a
block, never on a turn's path. Each change is kept in a bounded journal (the last
``watch_journal`` changes, of the last ``watch_journal_minutes``) so that a watcher that
reconnects with ``since`` is sent what it missed; the journal is saved at a clean stop and
read back at the next start. ``epoch`` names this run: a client that sees it change knows
the daemon restarted (docs/DESIGN.md, "Resuming a watch").
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from history import Conversation, SavedChange

from . import events
from .connection import Replier

__all__ = ["JOURNAL_BYTES", "ChangeKind", "JournalLimits", "KbProgressTold", "Live", "RESERVE_BLOCK", "WATCH_BACKLOG"]

logger = logging.getLogger(__name__)

# bytes a watcher may leave unread before it misses changes: hundreds of ordinary changes,
# far under the connection's own cap (connection.MAX_WRITE_BUFFER), which would drop it
WATCH_BACKLOG = 1024 * 1024
# change numbers reserved in the history at a time: one write per this many changes
RESERVE_BLOCK = 1000
# the journal's size at most, as JSON: a replay is sent whole (not cut at WATCH_BACKLOG, since a
# client that reconnects reads at once), so it must stay far under the connection's own cap
JOURNAL_BYTES = 8 * 1024 * 1024

ChangeKind = Literal["conversation", "turn", "kb", "approval", "memory", "daemon"]


@dataclass(frozen=True)
class JournalLimits:
    """How much of the past a reconnecting watcher can be sent: the last ``changes``, made in
    the last ``seconds`` (the ``watch_journal`` settings)."""

    changes: int = 10_000
    seconds: float = 600.0


@dataclass
class _Watch:
    """One watching connection: where its events go, and the first change it missed, if any."""

    emit: Replier
    missed_from: int | None = None


class Live:
    """The daemon's changes, numbered, and the connections watching them."""

    def __init__(self, limits: JournalLimits = JournalLimits()) -> None:
        self.seq = 0  # the last change's number
        self.epoch = secrets.token_hex(8)  # this run's name: another one means the daemon restarted
        self.limits = limits
        self._journal: deque[tuple[float, dict[str, Any], int]] = deque()  # (made at, Unix time; the change; bytes)
        self._journal_bytes = 0
        self._reserved: int | None = None  # no change is numbered past it; None: not kept (no history)
        self.on_reserve: Callable[[int], None] | None = None  # writes a new reservation
        self._watches: dict[object, _Watch] = {}  # by connection: one watch a connection
        self.wake = asyncio.Event()  # set by a watch: what looks only while anyone watches goes on (daemon.health)

    def resume(self, base: int, saved: list[SavedChange]) -> None:
        """At start: count on from ``base`` (``base + RESERVE_BLOCK`` is reserved), with the
        changes the last run saved at its stop (those that end at ``base``, one after another)."""
        self.seq, self._reserved = base, base + RESERVE_BLOCK
        if saved and saved[-1].seq == base and all(b.seq == a.seq + 1 for a, b in zip(saved, saved[1:])):
            for change in saved:
                self._keep(change.at, json.loads(change.event), len(change.event))
        self._trim()

    @property
    def kept(self) -> bool:
        """Whether the numbering is the history's (``resume``): only then is it saved."""
        return self._reserved is not None

    def saved(self) -> tuple[int, list[SavedChange]]:
        """At a clean stop: the last change's number and the journal, for the next start."""
        self._trim()
        return self.seq, [SavedChange(event["seq"], at, json.dumps(event, ensure_ascii=False))
                          for at, event, _size in self._journal]

    def watch(self, emit: Replier, since: int | None = None) -> None:
        """Answer ``watching`` and send every later change to ``emit``'s connection (a second
        watch there replaces its first); with ``since``, first the changes after it, or
        ``missed`` when the journal no longer holds them all."""
        self._trim()
        first = self._journal[0][1]["seq"] if self._journal else self.seq + 1
        emit(events.watching(self.seq, self.epoch, first))
        watch = self._watches[emit.connection] = _Watch(emit)
        self.wake.set()
        if since is None or since == self.seq:
            return
        if first <= since + 1 <= self.seq:
            for _at, event, _size in self._journal:
                if event["seq"] > since:
                    watch.emit(dict(event))  # whole: the journal is bounded (JOURNAL_BYTES)
        else:  # gone from the journal (or never in it: another run's, a history moved aside)
            emit(events.missed(min(since + 1, first)))

    def watched(self) -> bool:
        """Whether any connection still watches (those that hung up are forgotten)."""
        for key in [key for key, watch in self._watches.items() if watch.emit.gone]:
            del self._watches[key]
        return bool(self._watches)

    def watchers(self) -> list[Replier]:
        """The watching connections that can still send requests (answer an approval)."""
        return [watch.emit for watch in self._watches.values() if watch.emit.listening]

    def publish(self, kind: ChangeKind, action: str, **fields: Any) -> None:
        """One change: ``changed`` to every watcher, with the next ``seq``."""
        self.seq += 1
        event = events.changed(self.seq, kind, action, fields)
        self._keep(time.time(), event, len(json.dumps(event, ensure_ascii=False)))
        self._trim()
        if self._reserved is not None and self.seq + RESERVE_BLOCK // 2 > self._reserved:
            self._reserved += RESERVE_BLOCK  # long before it is reached: the write lands first
            if self.on_reserve is not None:
                self.on_reserve(self._reserved)
        for key, watch in list(self._watches.items()):
            if watch.emit.gone:
                del self._watches[key]  # hung up: forgotten at the next change
            else:
                self._deliver(watch, event)

    def _keep(self, at: float, event: dict[str, Any], size: int) -> None:
        self._journal.append((at, event, size))
        self._journal_bytes += size

    def _trim(self) -> None:
        """Forget the changes past the journal's limits."""
        oldest = time.time() - self.limits.seconds
        while self._journal and (len(self._journal) > self.limits.changes or self._journal[0][0] < oldest
                                 or self._journal_bytes > JOURNAL_BYTES):
            self._journal_bytes -= self._journal.popleft()[2]

    def _deliver(self, watch: _Watch, event: dict[str, Any]) -> None:
        over = watch.emit.backlog > WATCH_BACKLOG
        if watch.missed_from is not None:
            if over:
                return
            watch.missed_from = None  # it read what waited: changes reach it again
        elif over:
            watch.missed_from = event["seq"]
            logger.info("a watcher is not reading (over %d bytes wait); it misses changes from %d on",
                        WATCH_BACKLOG, event["seq"])
            watch.emit(events.missed(event["seq"]))
            return
        watch.emit(dict(event))  # each watcher's copy gets its own request id

    def conversation_updated(self, conv: Conversation) -> None:
        """A conversation's title, model, system prompt or settings changed."""
        self.publish("conversation", "updated", **events.conversation_shown(conv))

    def kb_progress(self, kb: str, phase: str, done: int, total: int) -> None:
        """A step of a ``kb_add`` (``KbProgressTold`` says which are told)."""
        self.publish("kb", "progress", kb=kb, phase=phase, done=done, total=total)

    def daemon_health(self, *, router_reachable: bool, model: str | None, ctx_max: int | None,
                      ctx_source: str | None, ocr: dict[str, Any], mcp: list[dict[str, Any]]) -> None:
        """The daemon's health changed (``daemon.health``): its new values."""
        self.publish("daemon", "health", router_reachable=router_reachable, model=model, ctx_max=ctx_max,
                     ctx_source=ctx_source, ocr=ocr, mcp=mcp)

    def turn_saved(self, conversation: int, turn: int, status: str, finish_reason: str | None) -> None:
        """A reply a full disk kept in memory is saved at last."""
        self.publish("turn", "saved", conversation=conversation, turn=turn, status=status,
                     finish_reason=finish_reason)


class KbProgressTold:
    """A ``kb_add``'s steps as the watchers are told them: one a percent of each phase at most,
    so that an add of thousands of files does not push every other change out of the journal."""

    def __init__(self, live: Live, kb: str) -> None:
        self._live = live
        self._kb = kb
        self._last: tuple[str, int] | None = None  # the phase and percent last told

    def __call__(self, phase: str, done: int, total: int) -> None:
        mark = (phase, done * 100 // total if total else 100)
        if mark != self._last:
            self._last = mark
            self._live.kb_progress(self._kb, phase, done, total)
