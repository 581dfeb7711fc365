"""The daemon's health, and its changes told to the watchers (docs/PROTOCOL.md, "Live state").

What a canvas shows of the daemon itself: whether the model server answers, the default
model and its context size, whether OCR can read scanned pages, each MCP server's state.
``status`` answers it (``health``); ``HealthWatch`` looks again every ``HEALTH_SECONDS``
while anyone watches, and right after a reload, and tells the watchers a ``daemon``
``health`` change when any of it differs from the last look. Nothing is asked while nobody
watches: the watch that comes first wakes it (``Live.wake``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from attachments import Ocr
from core.router import RouterClient

from .live import Live

if TYPE_CHECKING:
    from mcphost import McpHost

__all__ = ["HEALTH_SECONDS", "HealthWatch", "health"]

logger = logging.getLogger(__name__)

HEALTH_SECONDS = 10.0  # between two looks while anyone watches: a canvas learns of a router gone this soon
CTX_LOOKUP_SECONDS = 2.0  # ``status`` shows null rather than wait on a slow router


async def health(router: RouterClient, mcp: McpHost | None, ocr: Ocr) -> dict[str, Any]:
    """``status``'s fields about the daemon's health, as they are now."""
    reachable = await router.reachable()
    model = router.default_model()  # the configured one, else the router's first as last seen
    ctx_max: int | None = None
    ctx_source: str | None = None
    if reachable:
        try:
            # load=False: a status line must not make llama-swap load the default model
            info = await asyncio.wait_for(router.model_info(model, load=False), CTX_LOOKUP_SECONDS)
            model, ctx_max, ctx_source = info.id, info.ctx_max, info.ctx_source
        except Exception:  # status must answer, and soon, whatever the router says
            logger.debug("no default model for status", exc_info=True)
    return {"router_reachable": reachable, "model": model, "ctx_max": ctx_max, "ctx_source": ctx_source,
            "ocr": (await ocr.support()).to_json(), "mcp": mcp.status() if mcp else []}


def changed_fields(now: dict[str, Any]) -> dict[str, Any]:
    """What a ``daemon`` ``health`` change carries: the health, each MCP server by its state
    (its retry countdown changes every second, and is no change)."""
    return {**now, "mcp": [{"name": s["name"], "state": s["state"], "tools": s["tools"]} for s in now["mcp"]]}


class HealthWatch:
    """Looks at the daemon's health while anyone watches; tells them when it changed."""

    def __init__(self, live: Live, look: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        self._live = live
        self._look = look
        self._last: dict[str, Any] | None = None  # what the last look found (the fields a change carries)

    async def run(self) -> None:
        """Look every ``HEALTH_SECONDS`` while anyone watches (cancelled at shutdown)."""
        while True:
            if not self._live.watched():
                self._live.wake.clear()
                await self._live.wake.wait()
            await self.check()
            await asyncio.sleep(HEALTH_SECONDS)

    async def check(self) -> None:
        """Look now; a change from the last look is told."""
        self.observe(await self._look())

    def observe(self, now: dict[str, Any]) -> None:
        """The health as found (by a look, or a ``status``): a change from the last is told."""
        fields = changed_fields(now)
        if self._last is not None and fields != self._last:
            self._live.daemon_health(**fields)
        self._last = fields
