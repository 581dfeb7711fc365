"""Compaction: the oldest turns of a long conversation folded into a stored summary.

When a prompt would pass ``compact_at`` of the model's context, ``plan_compaction``
picks the oldest turns to fold (never the last ``keep_last``), ``summarize`` has the
model write a summary of them (and of the summary before, which it replaces), the daemon
stores it (``HistoryStore.add_compaction``), and prompts from then on carry
``summary_message`` in place of those turns. The turns stay
whole in history and in the search index, where conversation_search and
attachment_recall still reach them. docs/DESIGN.md, "Compaction", says how far it folds
and why, and what happens to a summary the model cannot write.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from core.errors import RouterError
from core.seams import Completer
from core.tokens import cut_to_weight, text_weight

__all__ = [
    "SUMMARY_INSTRUCTIONS",
    "plan_compaction",
    "summarize",
    "summarize_in_place",
    "summary_message",
    "transcript",
]

logger = logging.getLogger(__name__)

SUMMARY_INSTRUCTIONS = (
    "You summarise the early part of a conversation between a user and an assistant, "
    "so that the conversation can go on after that part leaves the assistant's context. "
    "Write in the conversation's language, as plain text or short bullet points, with no "
    "preamble. Keep every fact and figure stated, decisions made, names (people, "
    "projects, places, products), numbers, dates, code identifiers, what the user wants "
    "and prefers, questions still open and tasks still pending, and the name of every "
    "file attached with a line on what it holds. Leave out greetings and filler."
)
# A message longer than this is shown to the summariser by its head and tail: inlined
# files are most of it, and attachment_recall can read them again whole.
MESSAGE_CHARS = 6_000
TOOL_RESULT_CHARS = 1_500  # a tool's result: what it found matters, not all of it
TOOL_ARGUMENTS_CHARS = 300
MIN_MESSAGE_CHARS = 400  # the least of a message kept when the whole must shrink
THINK_START, THINK_END = "<think>", "</think>"


def plan_compaction(
    turn_tokens: Sequence[tuple[int, int]],
    fixed_tokens: int,
    ctx_max: int,
    compact_at: float,
    keep_last: int = 2,
) -> int | None:
    """The last turn to fold so that the prompt fits under ``compact_at`` of ``ctx_max``.

    ``turn_tokens`` is (turn number, tokens) for each turn the prompt replays, oldest
    first; ``fixed_tokens`` everything else that stays: system prompt, knowledge-base
    block, the new question, and room for the summary that will replace the folded turns.
    The oldest turns are folded until the rest fits, never the last ``keep_last``.
    None when the prompt already fits, ``ctx_max`` is unknown (0), or there is nothing
    that may be folded. When even folding every turn allowed is not enough, that last
    allowed turn is returned all the same: the prompt shrinks as far as it can, and the
    caller, checking again, knows the remaining turns and the question cannot fit.
    """
    if not 0 < compact_at <= 1:
        raise ValueError(f"compact_at must be in (0, 1], not {compact_at}")
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0, not {keep_last}")
    if ctx_max <= 0:
        return None
    limit = compact_at * ctx_max
    remaining = fixed_tokens + sum(tokens for _, tokens in turn_tokens)
    if remaining <= limit:
        return None
    foldable = turn_tokens[: len(turn_tokens) - keep_last] if keep_last else turn_tokens
    last: int | None = None
    for turn, tokens in foldable:
        remaining -= tokens
        last = turn
        if remaining <= limit:
            break
    return last


def _cut(text: str, limit: int) -> str:
    """``text`` within ``limit`` budget characters (``core.tokens.text_weight``: a character
    outside ASCII weighs the two tokens it costs): its head and tail around a note of the cut."""
    if text_weight(text) <= limit:
        return text
    keep = max(limit - 40, 2)
    head = cut_to_weight(text, keep * 2 // 3)
    tail = cut_to_weight(text[len(head) :][::-1], keep // 3)[::-1]
    return f"{head}\n[… {len(text) - len(head) - len(tail):,} characters left out …]\n{tail}"


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    pieces = []
    for part in content:
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            pieces.append(part["text"])
        elif kind in ("image_url", "image_ref"):
            name = part.get("name")
            page = part.get("page")
            label = f"image: {name}" if name else "image"
            pieces.append(f"[{label}, page {page}]" if page else f"[{label}]")
    return "\n".join(pieces)


def _render(message: dict[str, Any], limit: int) -> str | None:
    role = message.get("role")
    text = _content_text(message.get("content"))
    if role == "tool":
        return f"Tool result: {_cut(text, min(limit, TOOL_RESULT_CHARS))}" if text else None
    lines = []
    if text.strip():
        lines.append(f"{str(role).capitalize()}: {_cut(text, limit)}")
    for call in message.get("tool_calls") or ():
        if not isinstance(call, dict):
            continue
        function = call.get("function") or {}
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        lines.append(f"Assistant called {function.get('name', '?')}({_cut(arguments, TOOL_ARGUMENTS_CHARS)})")
    return "\n".join(lines) or None


def transcript(messages: Sequence[dict[str, Any]], max_chars: int | None = None) -> str:
    """The messages as the summariser reads them, long ones cut to fit ``max_chars``.

    When even cut messages are too many, the oldest are left out (the summary before
    them, which the summariser also reads, stands for the older past).
    """
    per_message = MESSAGE_CHARS
    if max_chars is not None and messages:
        per_message = max(MIN_MESSAGE_CHARS, min(MESSAGE_CHARS, max_chars // len(messages)))
    rendered = [text for text in (_render(m, per_message) for m in messages if isinstance(m, dict)) if text]
    if max_chars is None:
        return "\n\n".join(rendered)
    kept: list[str] = []
    size = 0
    for text in reversed(rendered):
        size += text_weight(text) + 2
        if kept and size > max_chars:
            break
        kept.append(text)
    left_out = len(rendered) - len(kept)
    note = [f"[{left_out} older messages are left out here]"] if left_out else []
    return "\n\n".join(note + kept[::-1])


def _clean(raw: str) -> str:
    """The summary without a reasoning model's thinking ("" if it never stopped thinking)."""
    if THINK_END in raw:
        return raw.split(THINK_END)[-1].strip()
    return "" if raw.lstrip().startswith(THINK_START) else raw.strip()


async def summarize(
    completer: Completer,
    model: str,
    previous_summary: str | None,
    messages: Sequence[dict[str, Any]],
    max_tokens: int,
    *,
    max_input_chars: int | None = None,
) -> str:
    """The model's summary of ``messages``, merged with the summary that came before.

    ``max_input_chars`` bounds the transcript sent (long messages are cut first).
    Raises what ``completer.complete`` raises (the daemon's router client: our errors), and
    ``RouterError`` for an empty answer.
    """
    parts = []
    if previous_summary:
        parts.append(f"Summary of the conversation before these turns:\n{previous_summary}")
    parts.append(f"The turns to summarise:\n{transcript(messages, max_input_chars)}")
    parts.append(
        "Write the summary of everything above"
        + (", merging the earlier summary in." if previous_summary else ".")
    )
    prompt = [
        {"role": "system", "content": SUMMARY_INSTRUCTIONS},
        {"role": "user", "content": "\n\n".join(parts)},
    ]
    summary = _clean(await completer.complete(model, prompt, max_tokens=max_tokens))
    if not summary:
        raise RouterError(f"{model} gave an empty summary of the conversation; try again, or start a new one")
    logger.info("compaction: %s summarised %d messages in %d characters", model, len(messages), len(summary))
    return summary


IN_PLACE_REQUEST = (
    "Pause the conversation here: write a summary of it so far, for yourself. It will stand "
    "for the earlier part of this conversation once that leaves your context, so merge in any "
    "earlier summary shown at the top. Write in the conversation's language, as plain text or "
    "short bullet points. Keep every fact and figure stated, decisions made, names (people, "
    "projects, places, products), numbers, dates, code identifiers, what the user wants and "
    "prefers, questions still open and tasks still pending, and the name of every file "
    "attached with a line on what it holds. Leave out greetings and filler. Answer with the "
    "summary alone, with no preamble, and call no tool."
)


async def summarize_in_place(
    completer: Completer,
    model: str,
    conversation: Sequence[dict[str, Any]],
    max_tokens: int,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The model's summary of ``conversation``, asked as the conversation's next message.

    ``conversation`` is the prompt as the turns replay it (its system message carries any
    earlier summary), which a model server still holds in its prompt cache from the last
    turn: only the request itself is new to it, where a transcript would be read whole.
    ``tools`` are the ones the turns were offered, sent again (``tool_choice: none``) because
    a chat template renders them at the top of the prompt. Raises as ``summarize`` does.
    """
    prompt = [*conversation, {"role": "user", "content": IN_PLACE_REQUEST}]
    params: dict[str, Any] = {"tools": tools, "tool_choice": "none"} if tools else {}
    summary = _clean(await completer.complete(model, prompt, max_tokens=max_tokens, **params))
    if not summary:
        raise RouterError(f"{model} gave an empty summary of the conversation; try again, or start a new one")
    logger.info("compaction: %s summarised its conversation in place in %d characters", model, len(summary))
    return summary


def summary_message(summary: str, through_turn: int) -> dict[str, Any]:
    """The message that stands for turns 1..through_turn in the prompt."""
    turns = "turn 1" if through_turn == 1 else f"turns 1-{through_turn}"
    return {
        "role": "system",
        "content": (
            f"Summary of the conversation so far ({turns}, no longer shown here; "
            "conversation_search finds their exact words and attachment_recall re-reads "
            f"their files):\n{summary}"
        ),
    }
