"""The turn engine: admission of turns, at most one per conversation.

``TurnEngine`` decides whether an ``ask`` may start (one turn per conversation, none
while shutting down), keeps each running turn's ``Slot`` so that ``cancel``, ``delete``
and shutdown can stop it, ``follow`` can join it and ``status`` list it, and turns every
refusal into an ``error`` event.  What a turn does once admitted is
``runner.TurnRunner``'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from attachments import FileReaders
from core.config import Config
from core.errors import AssistantError, Busy, InternalError, ShuttingDown, no_conversation
from core.router import RouterClient
from core.tools import Toolbox
from fileops import FileConvert
from history import AsyncHistory, Conversation, HistoryStore
from kbinject import KnowledgeBases
from kbinject.recallvec import MEMORIES
from recall import default_toolbox

from .approvals import Approvals, Asker, SocketAsker
from .background import Background
from .connection import Emit, Replier
from .context import ContextBuilder
from .live import Live
from .memory import Memories, MemorySave
from . import events
from .runner import Slot, StopReason, TurnRunner
from .turnrequest import TurnRequest

if TYPE_CHECKING:
    from mcphost import McpHost  # loaded only when MCP servers are configured (daemon.server)

__all__ = ["TurnEngine"]

logger = logging.getLogger(__name__)


class TurnEngine:
    """Runs turns: at most one per conversation, any number across conversations."""

    def __init__(
        self, config: Config, history: AsyncHistory, router: RouterClient, kbs: KnowledgeBases,
        readers: FileReaders, live: Live, mcp: McpHost | None = None,
    ) -> None:
        self.config = config
        self.mcp = mcp  # None: no MCP server configured (the SDK is never loaded)
        self.history = history
        self.router = router
        self._slots: dict[int, Slot] = {}  # by conversation: its one turn (a new one's, once stored)
        self._in_flight: set[Slot] = set()  # every ask's slot, a new conversation's too
        self._asks: set[asyncio.Task[Any]] = set()  # every ask in flight, started or not
        self._background = Background()
        self._accepting = True
        self.live = live
        self.approvals = Approvals(live, config.approval_timeout)  # calls of acting tools waiting for a person
        self.memories = Memories(history, live, lambda: kbs.recall.note(MEMORIES))  # told to the watchers
        self.runner = TurnRunner(
            config, history, router, ContextBuilder(config, history, router, kbs, readers),
            Toolbox([*default_toolbox(readers.images).tools, kbs.tool(), FileConvert(lambda: self.config, readers.ocr),
                     MemorySave(self.memories)]),
            self._background, live, self.approvals, mcp=mcp,
        )

    @property
    def accepting(self) -> bool:
        """False once shutdown has begun: no new turns."""
        return self._accepting

    @property
    def running(self) -> int:
        return sum(1 for slot in self._slots.values() if slot.state is not None)

    # -- public -----------------------------------------------------------------------------

    async def ask(self, request: TurnRequest, emit: Emit, asker: Asker | None = None) -> None:
        """Serve one ``ask``: events go to ``emit``, the turn goes to history.

        Every refusal is an ``error`` carrying ``conversation`` and ``turn`` (the
        turn it would have been; null when the conversation does not exist, and for
        ``busy``: the refused question is no turn, the running one goes on).
        ``asker`` decides the calls of tools that may act; by default the clients are asked
        (``SocketAsker``), a door with nobody to ask gives a ``Refuser``.
        """
        cid = request.conversation
        current = asyncio.current_task()
        assert current is not None
        self._asks.add(current)
        try:
            if not self._accepting:
                raise ShuttingDown()
            if cid is not None and cid in self._slots:
                # the refused question is no turn, and the running one is not failed by it
                raise Busy(f"conversation {cid} is still answering; wait for its reply or cancel it")
            await self._ask(request, cid, emit, asker)
        except AssistantError as exc:
            await self.refuse(exc, cid, emit)
        except asyncio.CancelledError:
            if self._accepting:
                raise
            await self.refuse(ShuttingDown(), cid, emit)  # stopped before it was stored
        except Exception:
            logger.exception("ask failed")
            await self.refuse(InternalError(), cid, emit)
        finally:
            self._asks.discard(current)

    async def refuse(self, exc: AssistantError, cid: int | None, emit: Emit, *, named: bool = True) -> None:
        """An ask's ``error``, with the turn it would have been (``named`` False: the ask named
        no conversation that can be, and is no turn)."""
        emit(events.error_event(exc, conversation=cid, turn=await self._refused_turn(cid, exc) if named else None))

    async def _refused_turn(self, cid: int | None, exc: AssistantError) -> int | None:
        """The turn a refused ask would have been: 1 in a new conversation, else the next one of
        its conversation; None when that does not exist, and for ``busy`` (the running turn is
        not the refused question's)."""
        if isinstance(exc, Busy):
            return None
        if cid is None:
            return 1
        try:
            conv = await self.history.run(HistoryStore.get_conversation, cid)
        except Exception:  # the store is closing: the refusal goes out without its turn
            logger.debug("no turn for a refused ask", exc_info=True)
            return None
        return conv.turns + 1 if conv is not None else None

    def running_turns(self) -> list[dict[str, Any]]:
        """The turns running now, by conversation, as ``status`` lists them."""
        return [
            {"conversation": cid, "turn": slot.state.turn, "text": slot.state.query, "ref": slot.state.ref,
             "stage": slot.stage, "model": slot.state.model_id, "started_at": slot.state.started_at}
            for cid, slot in sorted(self._slots.items()) if slot.state is not None
        ]

    async def follow(self, cid: int, emit: Emit) -> None:
        """Answer a ``follow`` of ``cid``: its running turn so far (``following``), and from then
        on each of that turn's events to ``emit`` too; ``turn: null`` when none runs."""
        if cid not in self._slots:
            await self.conversation(cid)  # not_found for a conversation that does not exist
        slot = self._slots.get(cid)
        if slot is not None and slot.state is None:
            await slot.started.wait()  # its question is on its way to the store
            slot = self._slots.get(cid)
        if slot is None or slot.state is None or slot.ended:
            emit(events.not_following(cid))
            return
        # in one step of the loop with every delta: the text so far and the deltas after it
        # are the reply, byte for byte
        emit({**slot.following(), "approvals": self.approvals.waiting(cid)})
        slot.followers.append(emit)

    def running_turn(self, cid: int) -> int | None:
        """The turn now running in ``cid``, if any."""
        slot = self._slots.get(cid)
        return slot.state.turn if slot and slot.state else None

    def cancel(self, cid: int, reason: StopReason = "cancelled") -> bool:
        """Stop the turn of ``cid`` (its partial reply is kept); False when none runs.

        A turn still starting (its question not yet stored) stops as soon as it is.
        """
        slot = self._slots.get(cid)
        if slot is None:
            return False
        if slot.stop is None and not slot.finishing:
            slot.stop = reason
            if slot.state is not None:
                slot.task.cancel()
        return True

    async def stop(self, cid: int) -> tuple[bool, int | None]:
        """Cancel the turn of ``cid`` and wait until it has ended and is stored: whether one
        was running, and its number (None when it ended before its question was stored)."""
        slot = self._slots.get(cid)
        if slot is None or not self.cancel(cid):
            return False, None
        await asyncio.wait([slot.task])
        return True, slot.state.turn if slot.state is not None else None

    async def wait_turn(self, cid: int) -> None:
        """Wait until ``cid`` has no turn starting or running."""
        slot = self._slots.get(cid)
        if slot is not None:
            await asyncio.wait([slot.task])

    async def settle(self) -> None:
        """Wait for background work (titles, checkpoints) to finish."""
        await self._background.settle()

    async def shutdown(self, grace: float) -> None:
        """Take no new turns; let running ones finish within ``grace``, then stop them."""
        self._accepting = False
        self.approvals.close()  # a call waiting for a person is denied: its turn goes on to an answer
        if self._asks:
            logger.info("waiting up to %.1fs for %d running turn(s)", grace, len(self._asks))
            _done, pending = await asyncio.wait(self._asks, timeout=grace)
            stored = set()
            for slot in list(self._in_flight):
                if slot.state is not None or slot.storing:  # stored, or being stored: it will be
                    stored.add(slot.task)
                    if slot.stop is None and not slot.finishing:
                        slot.stop = "interrupted"  # it stops (once stored) and keeps what it has
                        if slot.state is not None:
                            slot.task.cancel()
            for task in pending - stored:
                task.cancel()  # still starting: nothing stored yet, the client is told
            if pending:
                await asyncio.wait(pending)
        await self._background.cancel()

    def reconfigure(self, config: Config, router: RouterClient, mcp: McpHost | None) -> set[asyncio.Task[Any]]:
        """New turns run with ``config`` (its router, its MCP host); the asks in flight finish with
        the runner they started on. Those asks: what is replaced may be closed once they end."""
        old = self.runner
        self.runner = old.renewed(config, router, mcp)
        self.config, self.router, self.mcp = config, router, mcp
        return set(self._asks)

    # -- admission ------------------------------------------------------------------------------

    async def _ask(self, request: TurnRequest, cid: int | None, emit: Emit, asker: Asker | None) -> None:
        """The admitted ask's turn: started (its conversation busy from then on), then answered."""
        current = asyncio.current_task()
        assert current is not None
        slot = Slot(task=current)
        if cid is not None:
            self._slots[cid] = slot  # before the first await: a second ask is busy at once
        self._in_flight.add(slot)
        asking = emit
        emit = slot.relay(emit)
        slot.asker = asker or SocketAsker(self.approvals, emit, lambda: self._answerers(asking, slot))
        runner = self.runner  # the whole turn runs with the configuration it started with (a reload)
        try:
            # a client's tool results take up the turn that called its tools (the OpenAI door's)
            begin = runner.start if request.tool_results is None else runner.resume
            state = await begin(slot, request, emit)
            if state is None:
                return  # stored as failed: the router could not be asked
            slot.state = state
            self._slots[state.conversation] = slot  # a new conversation's, now that it has an id
            slot.started.set()
            await runner.answer(state, slot, emit)
        finally:
            slot.started.set()
            self._in_flight.discard(slot)
            for key in [k for k, v in self._slots.items() if v is slot]:
                del self._slots[key]

    def _answerers(self, asking: Emit, slot: Slot) -> list[Replier]:
        """Who can answer the turn's approvals now: its asker, its followers, the watchers."""
        emits = [asking, *slot.followers, *self.live.watchers()]
        return [e for e in emits if isinstance(e, Replier) and e.listening]

    async def conversation(self, cid: int | None) -> Conversation | None:
        """The live conversation ``cid`` (None for None); ``not_found`` when there is none."""
        if cid is None:
            return None
        conv = await self.history.run(HistoryStore.get_conversation, cid)
        if conv is None:
            raise no_conversation(cid)
        return conv

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as background work (``Background``)."""
        return self._background.spawn(coro)
