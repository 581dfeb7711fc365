"""The turn engine: admission of turns, at most one per conversation.

``TurnEngine`` decides whether an ``ask`` may start (one turn per conversation, none
while shutting down), keeps each running turn's ``Slot`` so that ``cancel``, ``delete``
and shutdown can stop it, and turns every refusal into an ``error`` event.  What a
turn does once admitted is ``runner.TurnRunner``'s.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from core.config import Config
from core.errors import AssistantError, BadRequest, Busy, InternalError, ShuttingDown, no_conversation
from core.router import RouterClient
from core.tools import Toolbox
from history import AsyncHistory, Conversation
from kbinject import KnowledgeBases
from recall import default_toolbox

from .connection import Emit
from .context import ContextBuilder
from .protocol import Request, error_event
from .runner import Slot, StopReason, TurnRunner

if TYPE_CHECKING:
    from mcphost import McpHost  # loaded only when MCP servers are configured (daemon.server)

__all__ = ["TurnEngine"]

logger = logging.getLogger(__name__)


class TurnEngine:
    """Runs turns: at most one per conversation, any number across conversations."""

    def __init__(
        self, config: Config, history: AsyncHistory, router: RouterClient, kbs: KnowledgeBases,
        mcp: McpHost | None = None,
    ) -> None:
        self.config = config
        self.mcp = mcp  # None: no MCP server configured (the SDK is never loaded)
        self.history = history
        self.router = router
        self._slots: dict[int, Slot] = {}  # by conversation: its one turn (a new one's, once stored)
        self._in_flight: set[Slot] = set()  # every ask's slot, a new conversation's too
        self._asks: set[asyncio.Task[Any]] = set()  # every ask in flight, started or not
        self._background: set[asyncio.Task[Any]] = set()
        self._accepting = True
        self.runner = TurnRunner(
            config, history, router, ContextBuilder(config, history, router, kbs),
            Toolbox([*default_toolbox().tools, kbs.tool()]), spawn=self.spawn, claim=self._claim, mcp=mcp,
        )

    @property
    def accepting(self) -> bool:
        """False once shutdown has begun: no new turns."""
        return self._accepting

    @property
    def running(self) -> int:
        return sum(1 for slot in self._slots.values() if slot.state is not None)

    # -- public -----------------------------------------------------------------------------

    async def ask(self, request: Request, emit: Emit) -> None:
        """Serve one ``ask``: events go to ``emit``, the turn goes to history.

        Every refusal is an ``error`` carrying ``conversation`` and ``turn`` (the
        turn it would have been; null when the conversation does not exist, and for
        ``busy``: the refused question is no turn, the running one goes on).
        """
        cid: int | None = request.get("conversation")
        where: dict[str, Any] = {"conversation": cid, "turn": None if cid is not None else 1}
        if request.invalid == "conversation":
            where["turn"] = None  # which conversation it meant is not known
        current = asyncio.current_task()
        assert current is not None
        self._asks.add(current)
        try:
            if request.fault is not None:
                await self._would_be(cid, where)
                raise BadRequest(request.fault)
            if not self._accepting:
                await self._would_be(cid, where)
                raise ShuttingDown()
            if cid is not None and cid in self._slots:
                # the refused question is no turn, and the running one is not failed by it
                raise Busy(f"conversation {cid} is still answering; wait for its reply or cancel it")
            await self._ask(request, cid, emit, where)
        except AssistantError as exc:
            emit(error_event(exc, **where))
        except asyncio.CancelledError:
            if self._accepting:
                raise
            await self._would_be(cid, where)
            emit(error_event(ShuttingDown(), **where))  # stopped before it was stored
        except Exception:
            logger.exception("ask failed")
            emit(error_event(InternalError(), **where))
        finally:
            self._asks.discard(current)

    async def _would_be(self, cid: int | None, where: dict[str, Any]) -> None:
        """Set the turn a refused ask would have been in ``cid`` (left null when it does not exist)."""
        if cid is None or where["turn"] is not None:
            return
        try:
            conv = await self.history.run(lambda s: s.get_conversation(cid))
        except Exception:  # the store is closing: the refusal goes out without its turn
            logger.debug("no turn for a refused ask", exc_info=True)
            return
        if conv is not None:
            where["turn"] = conv.turns + 1

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
        while self._background:
            await asyncio.wait(list(self._background))

    async def shutdown(self, grace: float) -> None:
        """Take no new turns; let running ones finish within ``grace``, then stop them."""
        self._accepting = False
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
        for task in self._background:
            task.cancel()
        if self._background:
            await asyncio.wait(self._background)

    # -- admission ------------------------------------------------------------------------------

    async def _ask(self, request: Request, cid: int | None, emit: Emit, where: dict[str, Any]) -> None:
        current = asyncio.current_task()
        assert current is not None
        slot = Slot(task=current)
        if cid is not None:
            self._slots[cid] = slot  # before the first await: a second ask is busy at once
        self._in_flight.add(slot)
        try:
            await self.runner.run(slot, request, cid, emit, where)
        finally:
            self._in_flight.discard(slot)
            for key in [k for k, v in self._slots.items() if v is slot]:
                del self._slots[key]

    async def conversation(self, cid: int | None) -> Conversation | None:
        """The live conversation ``cid`` (None for None); ``not_found`` when there is none."""
        if cid is None:
            return None
        conv = await self.history.run(lambda s: s.get_conversation(cid))
        if conv is None:
            raise no_conversation(cid)
        return conv

    def _claim(self, cid: int, slot: Slot) -> None:
        """A new conversation's turn is stored: from now on ``cid`` is busy with ``slot``."""
        self._slots[cid] = slot

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Run ``coro`` as background work (a title, a checkpoint, a deleted conversation's search
        rows): logged if it fails, waited for by ``settle``, cancelled at shutdown once the turns
        have ended."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background task failed", exc_info=task.exception())
