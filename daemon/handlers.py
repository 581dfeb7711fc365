"""Request handlers: one method per request type, each emitting its answer.

``ask`` belongs to the turn engine; the rest are short reads and writes of the
history and the router's model list. Each write tells the watchers (``daemon.live``);
``watch`` and ``follow`` answer at once and go on sending on their connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from attachments import FileReaders, estimate_files
from core import estimate_text
from core.config import Config
from core.errors import (
    AssistantError,
    BadRequest,
    NotFound,
    NotPending,
    RouterError,
    RouterUnreachable,
    listed,
    no_conversation,
)
from core.models import image_cost
from core.presets import find_preset
from core.router import RouterClient
from core.version import __version__
from history import AsyncHistory, Conversation, HistoryStore, JournalStore, SearchHit, Turn, search_words
from fileops import Converter
from kbinject import KnowledgeBases, Recall, kb_name

from . import events
from .connection import Emit, Replier
from .context import recall_estimate
from .convert import on_convert, on_operations
from .health import HealthWatch, health
from .kb_handlers import KbHandlers
from .live import Live
from .memory import MemoryHandlers
from .protocol import Request, encode_list
from .turnrequest import TurnRequest
from .turns import TurnEngine

__all__ = ["Handlers"]

logger = logging.getLogger(__name__)

DEFAULT_LIST_LIMIT = 50
DEFAULT_SEARCH_LIMIT = 20
MAX_SEARCH_WORDS = 32  # each word costs a look-up of its frequency: a pasted page must not cost hundreds
CTX_LOOKUP_SECONDS = 2.0  # ``open``/``status`` show 0/null rather than wait on a slow router


class Handlers(MemoryHandlers):
    """Dispatches validated requests; see docs/PROTOCOL.md for each answer."""

    def __init__(
        self, config: Config, history: AsyncHistory, router: RouterClient, engine: TurnEngine, kbs: KnowledgeBases,
        live: Live, readers: FileReaders,
    ) -> None:
        self.config = config
        self.readers = readers
        self.live = live
        self.history = history
        self.router = router
        self.engine = engine
        self.kbs = kbs
        self.memories = engine.memories
        self.started = time.monotonic()
        self.config_error: str | None = None  # why the last reload (SIGHUP) kept the configuration in effect
        self.converter = Converter(readers.ocr)  # the file operations under way (daemon/convert.py)
        self.kb = KbHandlers(kbs, live)  # the knowledge bases' requests
        self.health = HealthWatch(live, self.look)  # its changes told to the watchers

    async def __call__(self, request: Request, emit: Replier) -> None:
        if request.fault is not None and request.type != "ask":  # an ask's refusal names its turn
            raise BadRequest(request.fault)
        name = "on_" + request.type  # protocol.REQUESTS lists only requests some group answers
        group = next(g for g in (self, self.kb) if hasattr(g, name))
        await getattr(group, name)(request, emit)

    async def on_ask(self, request: Request, emit: Emit) -> None:
        if request.fault is not None:  # refused with the turn it would have been
            cid = request.get("conversation")
            await self.engine.refuse(BadRequest(request.fault), cid, emit, named=request.invalid != "conversation")
            return
        await self.engine.ask(TurnRequest.of(request), emit)

    async def on_cancel(self, request: Request, emit: Emit) -> None:
        if sum(map(request.has, ("kb", "conversation", "convert"))) != 1:
            raise BadRequest("cancel needs one of 'conversation' (to stop its turn), 'kb' (to stop adding to it) "
                             "or 'convert' (to stop a file operation)")
        if request.has("convert"):
            ident: str = request.get("convert")
            emit({"type": "cancelled", "convert": ident, "running": self.converter.cancel(ident)})
            return
        if request.has("kb"):
            kb = kb_name(request.get("kb"))
            running = self.kbs.cancel(kb, sent=request.received)
            if not running:
                await self.kbs.get(kb)  # not_found for a knowledge base that does not exist
            emit(events.cancelled_kb(kb, running))
            return
        cid: int = request.get("conversation")
        stopped, turn = await self.engine.stop(cid)  # answered once the turn has ended and is stored
        if not stopped:
            await self._conversation(cid)  # not_found for a conversation that does not exist
        emit(events.cancelled_turn(cid, turn))

    async def on_conversations(self, request: Request, emit: Emit) -> None:
        limit = request.get("limit", DEFAULT_LIST_LIMIT)
        before = request.get("before")
        items = await self.history.run(HistoryStore.list_conversations, limit, before)
        emit(events.conversations(
            [events.conversation_item(c, self.engine.running_turn(c.id) is not None) for c in items]))

    async def on_open(self, request: Request, emit: Emit) -> None:
        if request.has("ref"):  # the turn whose ask carried it, in its conversation
            found = await turn_by_ref(self.history, request)
            cid, conv, picked = found.conversation_id, await self._conversation(found.conversation_id), [found]
        elif request.has("conversation"):
            cid = request.get("conversation")
            conv = await self._conversation(cid)
            picked = None
        else:
            raise BadRequest("open needs 'conversation' (a conversation's id) or 'ref' (an ask's own reference)")
        before = self.engine.running_turn(cid)
        turns = self.history.shown(picked or await open_turns(self.history, request, conv))  # with any kept in memory
        # a turn stored running that runs no more was cut by a crash the start could not mark
        # (a full disk then): it is shown as the next start will store it
        live = {before, self.engine.running_turn(cid)}
        turns = [dataclasses.replace(t, status="interrupted") if t.status == "running" and t.turn not in live else t
                 for t in turns]
        # the turn shown running, as read (it may have ended since: the event is one snapshot)
        running = next((t.turn for t in reversed(turns) if t.status == "running"), None)
        # encoded in a worker thread, turn by turn: a long conversation would hold the loop and
        # every client with it (bench/bench_open.py)
        shown = await asyncio.to_thread(encode_list, (t.to_json() for t in turns))
        emit(events.conversation(conv, ctx_max=await self._ctx_max(conv.model), running=running, turns=shown))

    async def on_delete(self, request: Request, emit: Emit) -> None:
        cid: int = request.get("conversation")
        await self._conversation(cid)
        if self.engine.cancel(cid):
            await self.engine.wait_turn(cid)  # its last write lands before the delete
        if not await self.history.run(HistoryStore.delete_conversation, cid):
            raise NotFound(f"conversation {cid} does not exist")
        await self.memories.forget_conversation(cid)  # what was saved there goes with it
        emit(events.deleted(cid))
        self.live.publish("conversation", "deleted", conversation=cid)
        # its search rows go after, a batch at a time, while other work goes on (not holding
        # up this connection's later lines, as a delete does until it is answered)
        self.engine.spawn(unindex_deleted(self.history, cid))

    async def on_models(self, request: Request, emit: Emit) -> None:
        models = await self.router.models(refresh=True)  # asked for: as the server says it now
        default = self.config.model or (models[0].id if models else None)
        emit(events.listing("models", [m.to_json() for m in models], default=default))

    async def on_presets(self, request: Request, emit: Emit) -> None:
        """The prompt presets the canvas offers for dropped files (built-in and configured)."""
        emit(events.listing("presets", [preset.to_json() for preset in self.config.presets.values()]))

    async def on_estimate(self, request: Request, emit: Emit) -> None:
        """Tokens a staged question and its files would add, before it is sent (a meter for the canvas)."""
        text: str = request.get("text", "")
        if request.has("preset"):  # its prompt goes before the text
            text = find_preset(self.config.presets, request.get("preset")).question(text)
        cid: int | None = request.get("conversation")
        conv = await self._conversation(cid) if cid is not None else None
        ctx_used = conv.ctx_used if conv else 0
        named = request.get("model") or (conv.model if conv else None)
        try:
            model = await self.router.model_info(named)
            name, vision, ctx_max, image_tokens = model.id, model.vision, model.ctx_max, model.image_tokens
            if conv is None:  # a new conversation's prompt holds its system message and tools first
                ctx_used = await self.engine.runner.rounds.opening_tokens(model, files=bool(request.get("files")))
        except (RouterUnreachable, RouterError):
            # a meter still works while the router is away
            name, vision, ctx_max = "", True, 0
            image_tokens = image_cost(self.config, named or self.router.default_model() or "")
        files = await estimate_files(
            request.get("files", []), self.readers, image_tokens=image_tokens, model=name, vision=vision,
            ctx_max=ctx_max, ctx_used=ctx_used,
        )
        text_tokens = estimate_text(text)
        recalled = await recall_estimate(self.history, self.config, conv, text, ctx_max) if conv else Recall()
        emit(events.estimate(cid, text_tokens + sum(f["tokens"] for f in files) + recalled.tokens, files, ctx_used,
                             ctx_max, recalled.tokens, recalled.sources))

    async def on_settings(self, request: Request, emit: Emit) -> None:
        cid: int = request.get("conversation")
        await self._conversation(cid)
        changes: dict[str, Any] = {}
        if request.has("title"):
            title = request.get("title").strip()
            if not title:
                raise BadRequest("settings: 'title' needs some text; leave the field out to keep the title")
            changes["title"] = title[:200]
        if request.has("model"):
            model = request.get("model") or None
            if model is not None:
                await self.router.model_info(model)  # not_found names the models there are
            changes["model"] = model
        for key in ("kb_injection", "recall_injection"):
            if request.has(key):
                changes["settings"] = {**changes.get("settings", {}), key: request.get(key)}
        if request.has("system"):
            changes["system_prompt"] = request.get("system")  # null: the daemon's system_prompt again
        if request.has("mcp_servers"):
            changes["settings"] = {**changes.get("settings", {}), "mcp_servers": self._mcp_servers(request)}
        for key in ("temperature", "top_p", "memory"):  # null: the model's again; memory off: incognito
            if request.has(key):
                changes["settings"] = {**changes.get("settings", {}), key: request.get(key)}
        if request.has("approved_tools"):  # revoking is sending the list without it ([] or null: none)
            approved = sorted(set(request.get("approved_tools") or ())) or None
            changes["settings"] = {**changes.get("settings", {}), "approved_tools": approved}
        conv = await self.history.run(HistoryStore.update_conversation, cid, **changes)
        if conv is None:
            raise no_conversation(cid)
        emit(events.settings(conv))
        if changes:
            self.live.conversation_updated(conv)

    async def on_search(self, request: Request, emit: Emit) -> None:
        """Full-text search of the user's conversations, hits grouped by conversation."""
        query: str = request.get("query")
        cid: int | None = request.get("conversation")
        limit: int = request.get("limit", DEFAULT_SEARCH_LIMIT)
        offset: int = request.get("offset", 0)
        if not query.strip():
            raise BadRequest("search needs words in 'query'")
        if len(search_words(query)) > MAX_SEARCH_WORDS:
            raise BadRequest(f"search takes at most {MAX_SEARCH_WORDS} words; keep the ones that matter")
        if cid is not None:
            await self._conversation(cid)
        # one hit past the limit says whether there are more
        hits, convs = await self.history.run(HistoryStore.search_with_conversations, query, limit + 1, cid, offset)
        groups = group_hits(hits[:limit], convs)
        emit(events.results(query, offset, groups, more=len(hits) > limit))

    async def on_convert(self, request: Request, emit: Emit) -> None:
        await on_convert(self.converter, self.config, request, emit)

    async def on_operations(self, request: Request, emit: Emit) -> None:
        await on_operations(self.converter, request, emit)

    async def on_status(self, request: Request, emit: Emit) -> None:
        now = await self.look()
        self.health.observe(now)  # a change it shows is told to the watchers too
        emit(events.status(
            version=__version__, router_url=self.config.router_url, **now,
            model_name=events.model_name(now["model"]),
            uptime=round(time.monotonic() - self.started, 3), turns_running=self.engine.running,
            running=self.engine.running_turns(), socket=str(self.config.socket_path),
            data_dir=str(self.config.data_dir), config_error=self.config_error,
        ))

    async def look(self) -> dict[str, Any]:
        """The daemon's health now (``daemon.health``), with the router and MCP host in effect."""
        return await health(self.router, self.engine.mcp, self.readers.ocr)

    async def on_config(self, request: Request, emit: Emit) -> None:
        """The settings in effect (read-only; secrets masked), and the default model they give."""
        emit(events.config(self.config.shown(), self.router.default_model()))

    # -- live state (issue 30): what changes, and a running reply ------------------------------

    async def on_watch(self, request: Request, emit: Replier) -> None:
        """Every later change to this connection, as ``changed`` events (``daemon.live``); with
        ``since``, the changes after it first."""
        self.live.watch(emit, request.get("since"))

    async def on_follow(self, request: Request, emit: Replier) -> None:
        """The conversation's running turn so far, then its events as they come."""
        await self.engine.follow(request.get("conversation"), emit)

    # -- approval (issue 32): a person's answer to a call of a tool that may act ------------------

    async def on_approve(self, request: Request, emit: Replier) -> None:
        """Allow or deny a call waiting for approval, once (``daemon.approvals``)."""
        cid: int = request.get("conversation")
        if self.engine.running_turn(cid) is None:
            await self._conversation(cid)  # not_found for a conversation that does not exist
            raise NotPending(f"no turn of conversation {cid} is running, so no call waits for approval; "
                             "its calls were decided when it ended (open shows how)")
        remember = request.get("remember", "once") == "conversation"
        approval = self.engine.approvals.answer(cid, request.get("call"), request.get("allow"), remember,
                                                emit.program)
        emit(events.approved(cid, request.get("call"), approval.allowed, approval.remember))

    # -- MCP (issue 13): the hosted servers, and what `assistant.py mcp serve` reads ------------

    async def on_mcp_servers(self, request: Request, emit: Emit) -> None:
        """Every configured MCP server with its state and tools (starting those not running)."""
        servers = await self.engine.mcp.describe() if self.engine.mcp else []
        emit(events.mcp_servers(servers))

    def _mcp_servers(self, request: Request) -> list[str] | None:
        """The ``mcp_servers`` setting: configured names (null: the configuration's default)."""
        names: list[str] | None = request.get("mcp_servers")
        known = [spec.name for spec in self.config.mcp.servers]
        unknown = [n for n in names or () if n not in known]
        if unknown:
            raise NotFound(f"settings: no MCP server named {listed(unknown)}; "
                             f"configured: {', '.join(known) or 'none (add [mcp.servers.NAME] to config.toml)'}")
        return sorted(set(names)) if names is not None else None

    async def _conversation(self, cid: int) -> Conversation:
        conv = await self.engine.conversation(cid)
        assert conv is not None
        return conv

    async def _ctx_max(self, model: str | None) -> int:
        try:
            info = await asyncio.wait_for(self.router.model_info(model), CTX_LOOKUP_SECONDS)
        except (asyncio.TimeoutError, AssistantError):
            return 0
        return info.ctx_max


def group_hits(hits: list[SearchHit], convs: dict[int, Conversation]) -> list[dict[str, Any]]:
    """Hits grouped by conversation: best-ranked group first, the newer one on a tie."""
    groups: dict[int, list[SearchHit]] = {}
    for hit in hits:
        if hit.conversation_id in convs:
            groups.setdefault(hit.conversation_id, []).append(hit)
    order = sorted(groups, key=lambda c: convs[c].updated_at, reverse=True)
    order.sort(key=lambda c: -max(h.rank for h in groups[c]))  # stable: the newer first on a tie
    return [
        {
            "conversation": c,
            "title": convs[c].title,
            "updated_at": convs[c].updated_at,
            "hits": [
                {"turn": h.turn, "role": h.role, "excerpt": h.excerpt, "rank": round(h.rank, 4),
                 "timestamp": h.created_at}
                for h in sorted(groups[c], key=lambda h: -h.rank)
            ],
        }
        for c in order
    ]


async def turn_by_ref(history: AsyncHistory, request: Request) -> Turn:
    """The newest turn whose ask carried the ``ref`` an ``open`` names."""
    if any(request.has(key) for key in ("conversation", "turn", "from_turn", "limit")):
        raise BadRequest("open takes 'ref' alone (it finds one turn); or 'conversation' and a turn or page")
    ref: str = request.get("ref")
    turn = await history.journal.run(JournalStore.turn_by_ref, ref)
    if turn is None:
        raise NotFound(f"no stored turn's ask carried the ref {ref[:128]!r}: the ask was not stored (its "
                       "conversation may have been deleted); ask again")
    return turn


async def open_turns(history: AsyncHistory, request: Request, conv: Conversation) -> list[Turn]:
    """The turns an ``open`` asks for: one (``turn``), a page (``from_turn`` on, at most
    ``limit``; ``limit`` alone: the last ones), or every one."""
    cid = conv.id
    paged = request.has("from_turn") or request.has("limit")
    if request.has("turn"):  # that turn alone
        if paged:
            raise BadRequest("open takes 'turn' (one turn) or 'from_turn' and 'limit' (a page), not both")
        n: int = request.get("turn")
        one = await history.run(HistoryStore.turn, cid, n)
        if one is None:
            raise NotFound(f"conversation {cid} has no turn {n}; it has {conv.turns}")
        return [one]
    if not paged:
        return await history.run(HistoryStore.turns, cid)
    limit: int | None = request.get("limit")
    # ``limit`` alone is the newest page: a canvas shows the end of a conversation first
    first = request.get("from_turn") or max(1, conv.turns - (limit or 0) + 1)
    return await history.run(HistoryStore.turns, cid, first, limit)


async def unindex_deleted(history: AsyncHistory, cid: int) -> None:
    """Drop a deleted conversation's search rows, a batch a trip to the history thread."""
    while await history.run(HistoryStore.unindex_deleted, cid):
        pass
