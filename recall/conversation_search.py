"""conversation_search: keyword search over the earlier turns of the model's conversation.

On the FTS5 index of history (history/search.py): the user's text with the files
inlined in it, the assistant's replies, tool results and the compaction summary;
bm25-ranked, with ``snippet()`` excerpts where ``[brackets]`` mark the words found. It is
offered from the first turn (docs/DESIGN.md, "Prompt layout": a stable tool list).

Scoped by construction: the search is bounded to ``ctx.conversation``'s rowid range, and
to the turns before the one being answered, whose question would otherwise find itself.
The query is quoted word by word before MATCH (``history.quote_fts``), so ``"``, ``*``,
``NOT``, ``NEAR(`` or ``:`` are searched as text. Words are ANDed.

``scope`` "all" searches the user's other conversations too (docs/MEMORY.md): live ones that
are not incognito, each hit labelled with its conversation's title and date, after this
conversation's own; only when memory is on for this conversation (``ctx.memory``). Still no
argument names a conversation or a path: which ones are read is the store's choice.
"""

from __future__ import annotations

from typing import Any, Literal

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
from history import AsyncHistory, HistoryStore, MemoryStore, OtherHit, SearchHit, search_words

__all__ = ["DEFAULT_RESULTS", "MAX_RESULTS", "ConversationSearch"]

Scope = Literal["conversation", "all"]
SCOPES: tuple[Scope, ...] = ("conversation", "all")
RoleFilter = Literal["all", "user", "assistant"]
ROLE_FILTERS: tuple[RoleFilter, ...] = ("all", "user", "assistant")
DEFAULT_RESULTS = 5
MAX_RESULTS = 20
MAX_QUERY_WORDS = 32  # each word is a filter: past a few, a search finds nothing anyway
RANK_DIGITS = 4  # significant: bm25 of a word in half the messages is ~1e-6


def _result(hit: SearchHit) -> dict[str, Any]:
    return {
        "turn": hit.turn,
        "role": hit.role,
        "excerpt": hit.excerpt,
        "timestamp": hit.created_at,
        "rank": float(f"{hit.rank:.{RANK_DIGITS}g}"),
    }


def _other(found: OtherHit) -> dict[str, Any]:
    """A hit in another conversation, labelled so the model can say where it comes from."""
    return {**_result(found.hit), "conversation": found.hit.conversation_id, "title": found.title or "(untitled)",
            "date": found.updated_at[:10]}


def merged(own: list[dict[str, Any]], others: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """This conversation's hits first, then the others'; the others keep at least half the
    places when they match (so a long conversation of its own cannot hide them)."""
    keep_own = min(len(own), limit - min(len(others), limit // 2))
    return [*own[:keep_own], *others][:limit]


NOT_SHARED = ("Memory is off for this conversation (incognito, or memory off in the configuration): only this "
              "conversation can be searched; search again with scope \"conversation\".")
NOTHING_EARLIER = "This is the conversation's first turn: there is nothing earlier to search. Answer the user directly."
NOTHING_FOUND = ("No earlier turn matches these words. Answer from what you know, or say that the conversation "
                 "does not mention it; do not search again with the same words.")


class ConversationSearch(Tool):
    """Find earlier messages of this conversation by keywords."""

    name = "conversation_search"
    description = (
        "Search the earlier messages of this conversation by keywords: the user's "
        "messages (with the text of files they attached), your replies, tool results "
        "and the summary of compacted turns. Use it when a detail from earlier is no "
        "longer in your context. Every word must match; results are best first, with "
        "the matched words in [brackets]."
    )
    parameters = {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "Search keywords"},
            "max_results": max_results_parameter(DEFAULT_RESULTS, MAX_RESULTS),
            "role_filter": {
                "type": "string",
                "enum": list(ROLE_FILTERS),
                "description": "Only messages of this role (default all)",
            },
            "scope": {
                "type": "string",
                "enum": list(SCOPES),
                "description": "conversation (default): this conversation; all: the user's other conversations "
                               "too, each result labelled with its conversation's title and date",
            },
        },
        "required": ["query"],
    }

    async def available(self, ctx: ToolContext) -> bool:
        # offered from the first turn on (where it finds nothing yet): the tools a
        # chat template renders sit at the top of the prompt, and a tool that appeared
        # on turn 2 would make the server re-read the whole first exchange
        return ctx.recall_injection != "off"  # the conversation keeps its past out

    async def run(self, arguments: dict[str, Any], ctx: ToolContext[AsyncHistory]) -> ToolResult:
        query = string_argument(arguments, "query")
        if query is None or not query.strip():
            raise ToolError("query must be some keywords to search for")
        if len(search_words(query)) > MAX_QUERY_WORDS:
            raise ToolError(f"search with a few keywords (at most {MAX_QUERY_WORDS}): every word must match")
        limit = max_results_argument(arguments, DEFAULT_RESULTS, MAX_RESULTS)
        role = string_argument(arguments, "role_filter") or "all"
        if role not in ROLE_FILTERS:
            raise ToolError(f"role_filter must be one of {', '.join(ROLE_FILTERS)}")
        scope = string_argument(arguments, "scope") or "conversation"
        if scope not in SCOPES:
            raise ToolError(f"scope must be one of {', '.join(SCOPES)}")
        if scope == "all" and not ctx.memory:
            raise ToolError(NOT_SHARED)
        cid, turn = ctx.conversation, ctx.turn
        hits = await ctx.history.run(HistoryStore.search_conversation, cid, query, limit, role, before_turn=turn)
        results = [_result(hit) for hit in hits]
        if scope == "all":
            others = await ctx.history.memories.run(MemoryStore.search_others, cid, query, limit)
            results = merged(results, [_other(o) for o in others if role in ("all", o.hit.role)], limit)
        body: dict[str, Any] = {
            "results": results,
            "query": query,
            "total": len(results),
            "conversation": cid,
        }
        if scope == "all":
            body["scope"] = "all"
        if not results:
            # a small model given a bare empty list searches again, or answers "I can't assist"
            # (issue 33's runs): say what the empty list means and what to do
            body["note"] = NOTHING_EARLIER if turn <= 1 and scope == "conversation" else NOTHING_FOUND
        body = fit_results(body, ctx.max_chars)
        found = body["total"]
        return ToolResult(
            content=json_content(body),
            ok=True,
            summary=one_line(f"searched for {query!r}: {found} result{'s' if found != 1 else ''}"),
        )
