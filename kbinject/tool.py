"""kb_search: the model searches the knowledge bases linked to its conversation.

Offered when a KB is linked to the conversation (or to every conversation) and the
conversation's ``kb_injection`` is ``tool_only`` or ``both`` (``ToolContext.kb_injection``).
Scoped by construction: the KBs searched are those linked to ``ctx.conversation`` at the
time of the call; no argument names a KB, a path or another conversation.

The search is the hybrid one auto-injection uses (bm25 alone when the embedder is
missing or failing), so a slow embedder costs the call at most ``QUERY_TIMEOUT``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.tools import (
    Tool,
    ToolContext,
    ToolError,
    ToolResult,
    fit_results,
    json_content,
    max_results_argument,
    max_results_parameter,
    one_line,
    string_argument,
)

from .injection import TOOL_MODES, injection_mode

if TYPE_CHECKING:
    from .service import KnowledgeBases

__all__ = ["DEFAULT_RESULTS", "MAX_RESULTS", "KbSearch"]

DEFAULT_RESULTS = 5
MAX_RESULTS = 10  # each hit is up to a chunk (~1,000 characters)
MAX_QUERY_CHARS = 2_000


class KbSearch(Tool):
    """Search the conversation's knowledge bases."""

    name = "kb_search"
    description = (
        "Search the user's knowledge bases linked to this conversation (their documents, "
        "notes, PDFs and code) for passages relevant to a query. Use it when the question "
        "may be answered by the user's own documents. Write the query as a short question "
        "or a few keywords. Each result gives the knowledge base, the file, the chunk and "
        "page it comes from, a similarity (cosine, or the share of keywords found), and the "
        "passage; cite the file (and page) you use."
    )
    parameters = {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What to look for"},
            "max_results": max_results_parameter(DEFAULT_RESULTS, MAX_RESULTS),
        },
        "required": ["query"],
    }

    def __init__(self, kbs: KnowledgeBases) -> None:
        self.kbs = kbs

    async def available(self, ctx: ToolContext) -> bool:
        if injection_mode(ctx.kb_injection) not in TOOL_MODES:
            return False
        if ctx.kb_ids is not None:
            return bool(ctx.kb_ids)
        return await self.kbs.has_linked(ctx.conversation)

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        query = string_argument(arguments, "query")
        if query is None or not query.strip():
            raise ToolError("query must say what to look for")
        query = query.strip()[:MAX_QUERY_CHARS]
        limit = max_results_argument(arguments, DEFAULT_RESULTS, MAX_RESULTS)
        found = await self.kbs.search(query, conversation=ctx.conversation, limit=limit)
        body: dict[str, Any] = {
            "results": [hit.to_json() for hit in found.hits],
            "query": query,
            "total": len(found.hits),
            "search": found.mode,
        }
        if found.note:
            body["note"] = found.note
        body = fit_results(body, ctx.max_chars)
        count = body["total"]
        return ToolResult(
            content=json_content(body),
            ok=True,
            summary=one_line(f"searched the knowledge bases for {query!r}: {count} result{'s' if count != 1 else ''}"),
        )
