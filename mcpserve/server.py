"""``assistant.py mcp serve``: the user's memory as an MCP server, for any MCP client.

Read-only tools, each one request to the daemon over its socket (the client's
``connect``, a fresh connection per call, so calls in flight never share a reader):

- ``search_conversations``: the ``search`` request, over every conversation;
- ``list_conversations``: ``conversations``, newest first;
- ``read_conversation``: ``open``, the whole conversation or one turn of it;
- ``list_knowledge_bases``: ``kb_list``;
- ``kb_search``: ``kb_search`` over one named knowledge base.

Nothing here writes: no ``ask``, ``delete``, ``settings`` or ``kb_add``. An MCP client
that runs this runs it as the user, with the user's socket; it sees what the user sees.
A daemon refusal (``not_found``, ``bad_request``) comes back to the client as a tool
error with the daemon's message; a daemon that is not running, likewise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from core.version import __version__
from core.wire import DaemonGone, Unsendable
from daemon.client import connect

__all__ = ["build_server", "serve"]

MAX_RESULT_CHARS = 200_000  # one answer to the client; a long conversation is cut, with a note
CALL_TIMEOUT = 60.0  # seconds for the daemon to answer one request


class Daemon:
    """The daemon behind the socket, one connection per request."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket

    async def request(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            wire = await connect(self.socket, timeout=CALL_TIMEOUT)
        except DaemonGone as exc:
            raise ToolError(str(exc)) from None
        try:
            event = await wire.request(request)  # each read within CALL_TIMEOUT
        except (DaemonGone, Unsendable) as exc:
            raise ToolError(str(exc)) from None
        except TimeoutError:
            raise ToolError(f"the daemon did not answer within {CALL_TIMEOUT:g} s; see its log") from None
        finally:
            await wire.close()
        if event["type"] == "error":
            raise ToolError(f"{event.get('message')} ({event.get('code')})")
        return event


def as_text(value: Any) -> str:
    """JSON for the client, cut (with a note) when it is too long to pass on whole."""
    text = json.dumps(value, ensure_ascii=False)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f"\n[... cut: the answer had {len(text)} characters; ask for one turn]"
    return text


def _answer(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k not in ("type", "id")}


def build_server(socket: Path) -> MCPServer:
    daemon = Daemon(socket)
    server: MCPServer = MCPServer(
        "assistant", version=__version__,
        instructions="The user's local assistant: search and read their past conversations and knowledge bases "
                     "(read-only).",
    )

    @server.tool(structured_output=False)
    async def search_conversations(query: str, limit: int = 10) -> str:
        """Full-text search over all of the user's conversations with their local assistant. Returns the
        matching conversations (best first), each with its hits: turn, role, an excerpt with the matched
        words in [brackets]. Read a hit with read_conversation."""
        limit = max(1, min(limit, 100))
        return as_text(_answer(await daemon.request({"type": "search", "query": query, "limit": limit})))

    @server.tool(structured_output=False)
    async def list_conversations(limit: int = 20) -> str:
        """The user's conversations, most recently active first: id, title, last activity, number of turns."""
        limit = max(1, min(limit, 500))
        return as_text(_answer(await daemon.request({"type": "conversations", "limit": limit})))

    @server.tool(structured_output=False)
    async def read_conversation(conversation: int, turn: int | None = None) -> str:
        """Read one conversation (its title, model and every turn: question, files, reply, tool calls), or
        only one turn of it when `turn` is given (1-based)."""
        opened = _answer(await daemon.request({"type": "open", "conversation": conversation}))
        if turn is not None:
            chosen = [t for t in opened["turns"] if t["turn"] == turn]
            if not chosen:
                raise ToolError(f"conversation {conversation} has no turn {turn}; it has {len(opened['turns'])}")
            opened["turns"] = chosen
        return as_text(opened)

    @server.tool(structured_output=False)
    async def list_knowledge_bases() -> str:
        """The user's knowledge bases: name, documents, passages (chunks), pages, and where they are linked."""
        return as_text(_answer(await daemon.request({"type": "kb_list"})))

    @server.tool(structured_output=False)
    async def kb_search(kb: str, query: str, limit: int = 5) -> str:
        """Search one of the user's knowledge bases (hybrid: vectors and keywords) for passages relevant to
        `query`. Each result names the document, chunk and page, its similarity, and the passage."""
        limit = max(1, min(limit, 50))
        return as_text(_answer(await daemon.request({"type": "kb_search", "kb": kb, "query": query, "limit": limit})))

    return server


def serve(socket: Path) -> None:
    """Speak MCP on stdin/stdout until the client closes them."""
    build_server(socket).run("stdio")
