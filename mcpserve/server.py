"""``assistant.py mcp serve``: the user's memory as an MCP server, for any MCP client.

Read-only tools, each one request to the daemon over its socket (the client's
``connect``, a fresh connection per call, so calls in flight never share a reader):

- ``search_conversations``: the ``search`` request, over every conversation or one;
- ``list_conversations``: ``conversations``, newest first, a page at a time;
- ``read_conversation``: ``open``, the whole conversation or one turn of it (``open``'s
  ``turn``; its texts from an offset, for a turn too long to pass whole);
- ``list_knowledge_bases``: ``kb_list``;
- ``kb_search``: ``kb_search`` over one named knowledge base;
- ``memory_search``: ``memory_search``, the saved memories and every conversation that is
  not incognito (docs/MEMORY.md);
- ``list_memories``: ``memories``, the saved memories, newest first.

Nothing here writes: no ``ask``, ``delete``, ``settings``, ``kb_add`` or ``memory_add``. An MCP client
that runs this runs it as the user, with the user's socket; it sees what the user sees.
A daemon refusal (``not_found``, ``bad_request``) comes back to the client as a tool
error with the daemon's message and code; a daemon that is not running (``no_daemon``),
one that does not answer (``timeout``), likewise. An answer stays within
``MAX_RESULT_CHARS``, and stays JSON: its longest texts are cut, each saying so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from client import DaemonGone, Unsendable, connect
from common import LIST_CONVERSATIONS, LIST_KBS, MAX_LIST_LIMIT, __version__

__all__ = ["build_server", "serve"]

MAX_RESULT_CHARS = 100_000  # one answer to the client, as much as the daemon's own MCP host passes to a model
MIN_CUT = 200  # texts are not cut shorter than this to fit an answer: ask for fewer items instead
CALL_TIMEOUT = 60.0  # seconds for the daemon to answer one request
# the daemon's advice names its protocol's requests; a client of this server has these tools
FOR_THIS_CLIENT = (
    (LIST_CONVERSATIONS, "list them with list_conversations"),
    (LIST_KBS, "list_knowledge_bases shows the ones there are"),
)


class Daemon:
    """The daemon behind the socket, one connection per request."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket

    async def request(self, request: dict[str, Any]) -> dict[str, Any]:
        """The daemon's answer; every failure a ``ToolError`` that ends in its stable code."""
        try:
            wire = await connect(self.socket, timeout=CALL_TIMEOUT)
        except DaemonGone as exc:
            raise ToolError(f"{exc} (no_daemon)") from None
        try:
            event = await wire.request(request)  # each read within CALL_TIMEOUT
        except DaemonGone as exc:
            raise ToolError(f"{exc} (no_daemon)") from None
        except Unsendable as exc:  # its advice is the command line's
            what = "too long to send to the daemon; shorten it" if exc.code == "too_long" else "not UTF-8 text; retype it"
            raise ToolError(f"the query is {what} ({exc.code})") from None
        except TimeoutError:
            raise ToolError(f"the daemon did not answer within {CALL_TIMEOUT:g} s; see its log (timeout)") from None
        except ValueError:  # a line over the client's limit, or not JSON
            raise ToolError("the daemon's answer could not be read (too long, or not JSON); "
                            "read one turn at a time with read_conversation (bad_answer)") from None
        finally:
            await wire.close()
        if event["type"] == "error":
            message = str(event.get("message"))
            for said, meant in FOR_THIS_CLIENT:
                message = message.replace(said, meant)
            raise ToolError(f"{message} ({event.get('code')})")
        return event


def as_text(value: Any, more: Callable[[int], str]) -> str:
    """JSON for the client within ``MAX_RESULT_CHARS``: when too long, its longest texts are cut
    (each says so, and a ``note`` says how to read on: ``more(cap)``, ``cap`` the length they were
    cut to), so it stays JSON; ``ToolError`` when even texts of ``MIN_CUT`` characters do not fit."""
    text = json.dumps(value, ensure_ascii=False)
    cap = max(_texts(value), default=0)
    while len(text) > MAX_RESULT_CHARS:
        cap = int(cap * min(0.8, MAX_RESULT_CHARS / len(text)))
        if cap < MIN_CUT:
            raise ToolError(f"the answer is too long to pass on ({len(text):,} characters); {more(0)} (too_long)")
        cut = _cut(value, cap)
        if isinstance(cut, dict):
            cut["note"] = f"texts over {cap:,} characters were cut; {more(cap)}"
        text = json.dumps(cut, ensure_ascii=False)
    return text


def fewer(what: str) -> Callable[[int], str]:
    return lambda _cap: f"ask for fewer {what} (a smaller limit)"


def _texts(value: Any) -> list[int]:
    """The lengths of the strings in ``value``."""
    if isinstance(value, str):
        return [len(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _texts(v)]
    if isinstance(value, list):
        return [n for v in value for n in _texts(v)]
    return []


def _cut(value: Any, cap: int) -> Any:
    """``value`` with each string over ``cap`` characters cut there, saying how long it was."""
    if isinstance(value, str):
        return value if len(value) <= cap else f"{value[:cap]} [... cut at {cap:,} of {len(value):,} characters]"
    if isinstance(value, dict):
        return {k: _cut(v, cap) for k, v in value.items()}
    if isinstance(value, list):
        return [_cut(v, cap) for v in value]
    return value


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
    async def search_conversations(query: str, limit: int = 10, conversation: int | None = None) -> str:
        """Full-text search over the user's conversations with their local assistant (or only the one
        `conversation` names). Returns the matching conversations (best first), each with its hits: turn,
        role, an excerpt with the matched words in [brackets]; `more` is true when there are more hits than
        `limit` (up to 500). Read a hit with read_conversation."""
        request: dict[str, Any] = {"type": "search", "query": query, "limit": max(1, min(limit, MAX_LIST_LIMIT))}
        if conversation is not None:
            request["conversation"] = conversation
        return as_text(_answer(await daemon.request(request)), fewer("hits"))

    @server.tool(structured_output=False)
    async def list_conversations(limit: int = 20, before: str | None = None) -> str:
        """The user's conversations, most recently active first: id, title, last activity (updated_at),
        number of turns. For the next page, pass the updated_at of the last one listed as `before`."""
        request: dict[str, Any] = {"type": "conversations", "limit": max(1, min(limit, MAX_LIST_LIMIT))}
        if before is not None:
            request["before"] = before
        return as_text(_answer(await daemon.request(request)), fewer("conversations"))

    @server.tool(structured_output=False)
    async def read_conversation(conversation: int, turn: int | None = None, offset: int = 0) -> str:
        """Read one conversation (its title, model and every turn: question, files, reply, tool calls), or
        only one turn of it when `turn` is given (1-based). Long texts are cut to fit the answer, and say
        so; `offset` (with `turn`) reads that turn's question and reply from that character on."""
        if turn is None:
            opened = _answer(await daemon.request({"type": "open", "conversation": conversation}))
            return as_text(opened, lambda _cap: "read one turn at a time (turn)")
        opened = _answer(await daemon.request({"type": "open", "conversation": conversation, "turn": turn}))
        offset = max(offset, 0)
        if offset:
            [one] = opened["turns"]
            one.update({key: (one[key] or "")[offset:] for key in ("text", "reply")})
            opened["offset"] = offset
        return as_text(opened, lambda cap: f"read this turn on with offset={offset + cap}")

    @server.tool(structured_output=False)
    async def list_knowledge_bases() -> str:
        """The user's knowledge bases: name, documents, passages (chunks), pages, and where they are linked."""
        return as_text(_answer(await daemon.request({"type": "kb_list"})), lambda _cap: "each is listed all the same")

    @server.tool(structured_output=False)
    async def kb_search(kb: str, query: str, limit: int = 5) -> str:
        """Search one of the user's knowledge bases (hybrid: vectors and keywords) for passages relevant to
        `query`. Each result names the document, chunk and page, its similarity, and the passage."""
        request = {"type": "kb_search", "kb": kb, "query": query, "limit": max(1, min(limit, 50))}
        return as_text(_answer(await daemon.request(request)), fewer("passages"))

    @server.tool(structured_output=False)
    async def memory_search(query: str, limit: int = 10) -> str:
        """Search what the user's assistant remembers: the saved memories (short facts the user asked it to
        keep) holding the query's words, and hits in the user's past conversations (not incognito ones), each
        labelled with its conversation's title and date. Read a hit with read_conversation."""
        request = {"type": "memory_search", "query": query, "limit": max(1, min(limit, MAX_LIST_LIMIT))}
        return as_text(_answer(await daemon.request(request)), fewer("results"))

    @server.tool(structured_output=False)
    async def list_memories() -> str:
        """The user's saved memories, newest first: id, text, when saved or last edited, and where (the
        conversation and turn the assistant saved it in; null: the user added it)."""
        return as_text(_answer(await daemon.request({"type": "memories"})), lambda _cap: "each is listed all the same")

    return server


def serve(socket: Path) -> None:
    """Speak MCP on stdin/stdout until the client closes them."""
    build_server(socket).run("stdio")
