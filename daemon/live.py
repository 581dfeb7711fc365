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
served meanwhile. ``seq`` counts from the daemon's start (0: nothing changed yet), so a
client that reconnects reads afresh what it shows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from history import Conversation

from . import events
from .connection import Replier

__all__ = ["ChangeKind", "Live", "WATCH_BACKLOG"]

logger = logging.getLogger(__name__)

# bytes a watcher may leave unread before it misses changes: hundreds of ordinary changes,
# far under the connection's own cap (connection.MAX_WRITE_BUFFER), which would drop it
WATCH_BACKLOG = 1024 * 1024

ChangeKind = Literal["conversation", "turn", "kb", "approval", "memory"]


@dataclass
class _Watch:
    """One watching connection: where its events go, and the first change it missed, if any."""

    emit: Replier
    missed_from: int | None = None


class Live:
    """The daemon's changes, numbered, and the connections watching them."""

    def __init__(self) -> None:
        self.seq = 0  # the last change's number
        self._watches: dict[object, _Watch] = {}  # by connection: one watch a connection

    def watch(self, emit: Replier) -> int:
        """Send every later change to ``emit``'s connection (a second watch there replaces its
        first); the ``seq`` of the last change before."""
        self._watches[emit.connection] = _Watch(emit)
        return self.seq

    def watchers(self) -> list[Replier]:
        """The watching connections that can still send requests (answer an approval)."""
        return [watch.emit for watch in self._watches.values() if watch.emit.listening]

    def publish(self, kind: ChangeKind, action: str, **fields: Any) -> None:
        """One change: ``changed`` to every watcher, with the next ``seq``."""
        self.seq += 1
        event = events.changed(self.seq, kind, action, fields)
        for key, watch in list(self._watches.items()):
            if watch.emit.gone:
                del self._watches[key]  # hung up: forgotten at the next change
            else:
                self._deliver(watch, event)

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

    def turn_saved(self, conversation: int, turn: int, status: str, finish_reason: str | None) -> None:
        """A reply a full disk kept in memory is saved at last."""
        self.publish("turn", "saved", conversation=conversation, turn=turn, status=status,
                     finish_reason=finish_reason)
