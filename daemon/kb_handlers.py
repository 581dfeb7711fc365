"""Knowledge-base requests: ``kb_add``, ``kb_list``, ``kb_remove``, ``kb_link``, ``kb_search``.

A group of ``Handlers`` of its own (``Handlers.__call__`` finds a request's method in each
group): the knowledge bases' requests need only the knowledge bases and the watchers.
"""

from __future__ import annotations

from core.errors import BadRequest
from kbinject import KbProgress, KnowledgeBases, kb_name

from . import events
from .connection import Emit
from .live import KbProgressTold, Live
from .protocol import Request

__all__ = ["KbHandlers"]


class KbHandlers:
    """The knowledge bases' requests; each write tells the watchers."""

    def __init__(self, kbs: KnowledgeBases, live: Live) -> None:
        self.kbs = kbs
        self.live = live

    async def on_kb_add(self, request: Request, emit: Emit) -> None:
        """Ingest files and folders into a knowledge base, reporting progress as it goes."""
        kb = kb_name(request.get("kb"))
        if not request.get("paths"):
            raise BadRequest("kb_add needs at least one file or folder in 'paths'")

        told = KbProgressTold(self.live, kb)  # and the watchers, of another client's add

        def progress(step: KbProgress) -> None:
            emit(events.kb_progress(kb, step.to_json()))
            told(step.phase, step.done, step.total)

        result = await self.kbs.add(kb, request.get("paths"), progress, sent=request.received)
        emit(events.kb(result.to_json()))
        if result.created or result.added or result.updated or result.removed or result.embedded:
            self.live.publish("kb", "added" if result.created else "changed", kb=result.kb,
                              documents=result.documents, chunks=result.chunks)

    async def on_kb_list(self, request: Request, emit: Emit) -> None:
        emit(events.listing("kbs", [info.to_json() for info in await self.kbs.list()]))

    async def on_kb_remove(self, request: Request, emit: Emit) -> None:
        info = await self.kbs.remove(request.get("kb"))
        emit(events.kb(info.to_json()))  # what it held, now gone
        self.live.publish("kb", "removed", kb=info.name)

    async def on_kb_link(self, request: Request, emit: Emit) -> None:
        linked: bool = request.get("linked", True)
        info = await self.kbs.link(request.get("kb"), request.get("conversation"), linked)
        emit(events.kb(info.to_json()))
        self.live.publish("kb", "linked", kb=info.name, conversation=request.get("conversation"), linked=linked)

    async def on_kb_search(self, request: Request, emit: Emit) -> None:
        """Search one named knowledge base (hybrid, as the kb_search tool does)."""
        query: str = request.get("query")
        if not query.strip():
            raise BadRequest("kb_search needs words in 'query'")
        found = await self.kbs.search(query, kbs=[request.get("kb")], limit=request.get("limit"))
        emit(events.kb_results(kb_name(request.get("kb")), query, found.mode, found.note,
                               [hit.to_json() for hit in found.hits]))
