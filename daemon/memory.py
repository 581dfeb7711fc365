"""Memory across conversations: saved memories, the model's ``memory_save``, their requests.

``Memories`` is the one place that changes saved memories (``history.memories``) and tells
the watchers (a ``changed`` of kind ``memory``): the socket's requests, the model's
``memory_save`` and a conversation's deletion all go through it. ``frozen_block`` is what a
conversation's system prompt carries (docs/DESIGN.md, "Memory"): the memories as they stood
at its first prompt, none when memory is off for it. ``MemoryHandlers`` serves the
``memories``, ``memory_add``, ``memory_edit`` and ``memory_forget`` requests for
``daemon.handlers.Handlers`` (docs/PROTOCOL.md, "Memory").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core import BUDGET_CHARS_PER_TOKEN
from core.config import Config
from core.errors import BadRequest, NotFound
from core.tools import Tool, ToolContext, ToolError, ToolResult, json_content, one_line, string_argument
from history import MAX_MEMORY_CHARS, AsyncHistory, Conversation, Memory, MemoryStore, reads_memory, search_words

from . import events
from .connection import Emit
from .live import Live
from .protocol import Request

__all__ = ["MemoryHandlers", "MemorySave", "Memories", "frozen_block", "memory_chars", "memory_on"]

DEFAULT_SEARCH_LIMIT = 10
MAX_QUERY_WORDS = 32  # as the search request's: each word costs a look-up of its frequency
SAVED_NOTE = "Saved. Tell the user in a few words that you will remember it."


def memory_on(config: Config, conversation: Conversation | None) -> bool:
    """Whether memory is on for this conversation: the daemon's ``memory`` and its own setting."""
    if config.memory != "on":
        return False
    return conversation is None or reads_memory(conversation.settings)


def memory_chars(config: Config, setting: str | None = None) -> int | None:
    """The frozen memory block's room in characters, for the trip that begins a turn to read (or
    make) the block with the conversation (``HistoryStore.with_memories``); None when memory is
    off for the daemon, or ``setting`` (the ``memory`` an ``ask`` creating the conversation sets)
    is "off", or the daemon's system prompt is "" (a conversation with one of its own has its
    block read apart, ``frozen_block``)."""
    if config.memory != "on" or setting == "off" or not config.system_prompt:
        return None
    return block_chars(config)


def block_chars(config: Config) -> int:
    """The frozen memory block's room in characters (``memory_tokens``)."""
    return config.memory_tokens * BUDGET_CHARS_PER_TOKEN


async def frozen_block(config: Config, history: AsyncHistory, conversation: Conversation | None) -> str:
    """The memories a conversation's system prompt carries: those at its first prompt, kept; ""
    when memory is off for it. A turn has them from the trip that began it (``TurnContext.memories``):
    this is for the rest, a conversation with a system prompt of its own under an empty default
    among them (``memory_chars`` is None for it)."""
    if conversation is None or not memory_on(config, conversation):
        return ""
    return await history.memories.run(MemoryStore.freeze, conversation.id, block_chars(config))


def memory_text(text: Any, what: str) -> str:
    """A memory's text, stripped; ``BadRequest`` saying what to send when it cannot be one."""
    if not isinstance(text, str) or not text.strip():
        raise BadRequest(f"{what}: 'text' needs the fact to remember, such as \"I am vegetarian\"")
    if len(text) > MAX_MEMORY_CHARS:
        raise BadRequest(f"{what}: a memory holds at most {MAX_MEMORY_CHARS} characters, not {len(text)}; "
                         "keep the fact itself, or save it as two")
    return text.strip()


class Memories:
    """Saved memories: every change stored, then told to the watchers."""

    def __init__(self, history: AsyncHistory, live: Live, changed: Callable[[], None] | None = None) -> None:
        self.history = history
        self.live = live
        self.changed = changed or (lambda: None)  # a memory's text is new: embed it (kbinject/recallvec.py)

    async def all(self) -> list[Memory]:
        return await self.history.memories.run(MemoryStore.all)

    async def add(self, text: str, conversation: int | None = None, turn: int | None = None) -> Memory:
        memory = await self.history.memories.run(MemoryStore.add, text, conversation, turn)
        self.live.publish("memory", "added", memory=memory.to_json())
        self.changed()
        return memory

    async def edit(self, memory_id: int, text: str) -> Memory:
        memory = await self.history.memories.run(MemoryStore.edit, memory_id, text)
        if memory is None:
            raise no_memory(memory_id)
        self.live.publish("memory", "edited", memory=memory.to_json())
        self.changed()
        return memory

    async def forget(self, memory_id: int) -> Memory:
        memory = await self.history.memories.run(MemoryStore.forget, memory_id)
        if memory is None:
            raise no_memory(memory_id)
        self.live.publish("memory", "forgotten", memory=memory.to_json())
        return memory

    async def forget_conversation(self, cid: int) -> None:
        """A deleted conversation's memories (those the model saved there) forgotten at once."""
        for memory in await self.history.memories.run(MemoryStore.forget_conversation, cid):
            self.live.publish("memory", "forgotten", memory=memory.to_json())



def no_memory(memory_id: int) -> NotFound:
    return NotFound(f"there is no memory {memory_id}; list them with the memories request "
                    "(assistant.py memory list)")


class MemorySave(Tool):
    """Keep a fact the user wants remembered in later conversations."""

    name = "memory_save"
    description = (
        "Save a short fact about the user to remember in later conversations, when the user asks "
        "you to remember something or states a lasting preference or fact about themselves "
        f"(\"I'm vegetarian\", \"my bike is a 2019 Brompton\"). One fact, at most {MAX_MEMORY_CHARS} "
        "characters, written so it reads on its own. Never for passing details of this conversation."
    )
    parameters = {
        "type": "object",
        "properties": {"text": {"type": "string", "description": "The fact, in a sentence"}},
        "required": ["text"],
    }

    def __init__(self, memories: Memories) -> None:
        self.memories = memories

    async def available(self, ctx: ToolContext[Any]) -> bool:
        # offered from the first turn whenever memory is on: a stable tool list (docs/DESIGN.md)
        return ctx.memory

    async def run(self, arguments: dict[str, Any], ctx: ToolContext[Any]) -> ToolResult:
        try:
            text = memory_text(string_argument(arguments, "text"), "memory_save")
        except BadRequest as exc:
            raise ToolError(exc.message) from None
        memory = await self.memories.add(text, ctx.conversation, ctx.turn)
        body = {"saved": {"id": memory.id, "text": memory.text}, "note": SAVED_NOTE}
        return ToolResult(content=json_content(body), ok=True,
                          summary=one_line(f"remembered: {memory.text} (memory {memory.id})", 600))


class MemoryHandlers:
    """The memory requests, served by ``Handlers`` (which sets ``memories``)."""

    memories: Memories

    async def on_memories(self, request: Request, emit: Emit) -> None:
        emit(events.listing("memories", [m.to_json() for m in await self.memories.all()]))

    async def on_memory_add(self, request: Request, emit: Emit) -> None:
        memory = await self.memories.add(memory_text(request.get("text"), "memory_add"))
        emit(events.memory("added", memory.to_json()))

    async def on_memory_edit(self, request: Request, emit: Emit) -> None:
        memory = await self.memories.edit(request.get("memory"), memory_text(request.get("text"), "memory_edit"))
        emit(events.memory("edited", memory.to_json()))

    async def on_memory_search(self, request: Request, emit: Emit) -> None:
        """Saved memories and every conversation memory may read (not incognito), as ``mcp serve``'s
        ``memory_search`` offers them."""
        query: str = request.get("query")
        limit: int = request.get("limit", DEFAULT_SEARCH_LIMIT)
        if not query.strip():
            raise BadRequest("memory_search needs words in 'query'")
        if len(search_words(query)) > MAX_QUERY_WORDS:
            raise BadRequest(f"memory_search takes at most {MAX_QUERY_WORDS} words; keep the ones that matter")
        history = self.memories.history
        memories = await history.memories.run(MemoryStore.matching, query, limit)
        others = await history.memories.run(MemoryStore.search_others, 0, query, limit)
        hits = [{"conversation": o.hit.conversation_id, "title": o.title, "date": o.updated_at[:10],
                 "turn": o.hit.turn, "role": o.hit.role, "excerpt": o.hit.excerpt, "timestamp": o.hit.created_at}
                for o in others]
        emit(events.memory_results(query, [m.to_json() for m in memories], hits))

    async def on_memory_forget(self, request: Request, emit: Emit) -> None:
        memory = await self.memories.forget(request.get("memory"))
        emit(events.memory("forgotten", memory.to_json()))
