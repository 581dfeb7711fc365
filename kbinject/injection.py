"""Auto-injection: the knowledge-base block put before this turn's question.

A conversation's ``kb_injection`` setting says what KBs do in it: ``auto`` (the default)
injects the best chunks for the user's latest message into this turn's user message,
before the question (docs/DESIGN.md, "Prompt layout", says why there and not in the
system message), ``both`` does that and offers the ``kb_search`` tool, ``tool_only``
only offers the tool, and ``off`` keeps KBs out of the conversation altogether.

The block has the format docs/PROTOCOL.md shows ("Knowledge bases"): a header and a
footer around the passages, each naming its knowledge base, file, chunk and similarity.
It is added only if the context can take it: the estimate of what the prompt already
holds plus the block's tokens must stay within ``CONTEXT_LIMIT`` (85%) of the model's
context. Where all top-K chunks do not fit, the weakest are dropped until the rest do
(a fuller context still gets its best chunk); a block of even one chunk that does not
fit is skipped, with the reason for the log and the ``progress`` event.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from core import estimate_text
from core.tools import one_line

from .search import Hit, SearchMode

__all__ = [
    "BLOCK_FOOTER",
    "BLOCK_HEADER",
    "CONTEXT_LIMIT",
    "DEFAULT_INJECTION_MODE",
    "INJECTION_MODES",
    "Injection",
    "InjectionMode",
    "format_block",
    "injection_mode",
]

InjectionMode = Literal["auto", "tool_only", "both", "off"]
INJECTION_MODES: tuple[InjectionMode, ...] = ("auto", "tool_only", "both", "off")
DEFAULT_INJECTION_MODE: InjectionMode = "auto"
INJECTING_MODES: tuple[InjectionMode, ...] = ("auto", "both")
TOOL_MODES: tuple[InjectionMode, ...] = ("tool_only", "both")
SETTING = "kb_injection"  # the key in conversations.settings

# the prompt with the block may take at most this share of ctx_max, so passages never
# crowd out the reply (docs/DESIGN.md, "Knowledge-base ranking")
CONTEXT_LIMIT = 0.85

BLOCK_HEADER = (
    "[Knowledge Base Context]\n"
    "The following information was retrieved from the user's knowledge bases\n"
    "and may be relevant to this conversation:\n"
)
BLOCK_FOOTER = "[End Knowledge Base Context]"
MAX_SOURCE_CHARS = 200  # a file name in a passage's Source: line
ENTRY = "---\nSource: {kb} (chunk {chunk} of {file}, similarity: {similarity:.2f})\nContent: {content}\n"


def injection_mode(settings: Mapping[str, Any] | str | None) -> InjectionMode:
    """The mode of a conversation's settings (or a mode string); ``auto`` when unset or unknown."""
    value = settings.get(SETTING) if isinstance(settings, Mapping) else settings
    for mode in INJECTION_MODES:
        if value == mode:
            return mode
    return DEFAULT_INJECTION_MODE


def format_block(hits: Sequence[Hit]) -> str:
    """The ``[Knowledge Base Context]`` block of these hits (docs/PROTOCOL.md shows it)."""
    entries = [
        # a file's name is the user's own words, on one line: "a\nContent: ..." cannot forge an entry
        ENTRY.format(kb=hit.kb, chunk=hit.chunk, file=one_line(hit.document, MAX_SOURCE_CHARS),
                     similarity=hit.similarity, content=hit.text.strip())
        for hit in hits
    ]
    return BLOCK_HEADER + "\n" + "\n".join(entries) + BLOCK_FOOTER


@dataclass
class Injection:
    """What auto-injection adds before this turn's question, or why nothing."""

    block: str | None  # the block to put before the question; None: add nothing
    hits: list[Hit] = field(default_factory=list)  # the chunks in the block
    skipped_reason: str | None = None  # set when chunks were found but the context was too full
    tokens: int = 0  # the block's estimated tokens
    dropped: int = 0  # weaker chunks left out so the block fits
    search: SearchMode | None = None  # how the chunks were found (None: no search ran)
    note: str | None = None  # e.g. the embedder failed and keywords alone were used


def fit_block(hits: Sequence[Hit], ctx_used: int, ctx_max: int) -> Injection:
    """The block of as many of the best ``hits`` as the context takes, or the reason none fit."""
    limit = CONTEXT_LIMIT * ctx_max
    for count in range(len(hits), 0, -1):
        block = format_block(hits[:count])
        tokens = estimate_text(block)
        if ctx_max <= 0 or ctx_used + tokens <= limit:
            return Injection(block, list(hits[:count]), tokens=tokens, dropped=len(hits) - count)
    tokens = estimate_text(format_block(hits[:1])) if hits else 0
    return Injection(None, skipped_reason=too_full(ctx_used, ctx_max, tokens))


def too_full(ctx_used: int, ctx_max: int, tokens: int | None = None) -> str:
    """Why the block is skipped, for the log and the progress event."""
    share = ctx_used / ctx_max if ctx_max else 0.0
    needs = f"; even its best chunk needs {tokens} more" if tokens else ""
    return (
        f"knowledge-base context skipped: {ctx_used} of {ctx_max} tokens are in use ({share:.0%}){needs}, "
        f"and the context may not pass {CONTEXT_LIMIT:.0%}"
    )
