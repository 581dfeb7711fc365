"""Conversation titles: the question's first words at once, the model's after the first reply."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from core.errors import AssistantError
from core.router import RouterClient
from history import AsyncHistory, Conversation, HistoryStore

__all__ = ["clean_title", "make_title", "provisional_title", "title_prompt"]

logger = logging.getLogger(__name__)

TITLE_WORDS = 8
TITLE_MAX_CHARS = 60
TITLE_TOKENS = 24
TITLE_INSTRUCTIONS = (
    "You name conversations. Answer with a title of at most six words, no quotes, no punctuation at the end."
)
# asked after the first exchange, as the conversation's next message: the request then
# shares the turn's prompt, so the server reuses its cache instead of reading a new prompt
# (and the next turn still finds the conversation in the cache)
TITLE_REQUEST = (
    "Name this conversation with a title of at most six words. Answer with the title alone: "
    "no quotes, no punctuation at the end."
)


ECHOED = "title of at most six words"  # in both requests: a "title" holding it is the request said back
# what small models answer instead of a title (SmolLM2: "I'm sorry for the confusion…"): the
# question's first words say more
NOT_A_TITLE = re.compile(r"^(i'?m sorry|i am sorry|sorry|i apologi[sz]e|apologies|i can(no|')t|as an ai)\b", re.I)
TOOL_NAME = re.compile(r"^\w+__\w+$|^[a-z]+(_[a-z]+)+$")  # an MCP tool (server__tool) or one of ours
TITLE_MAX_WORDS = 12  # past it, a sentence rather than a title


def _bounded(title: str) -> str:
    return title[: TITLE_MAX_CHARS - 1].rstrip() + "…" if len(title) > TITLE_MAX_CHARS else title


def provisional_title(text: str) -> str:
    """The first words of the question, until the model offers a better title."""
    return _bounded(" ".join(text.split()[:TITLE_WORDS])) or "New conversation"


def clean_title(raw: str) -> str:
    """A model's title made presentable: one line, no quotes or thinking, bounded length."""
    text = raw.split("</think>")[-1]
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    title = lines[0].strip("\"'`*#").removeprefix("Title:").strip().strip("\"'`*").rstrip(".")
    if ECHOED in title.lower():  # a small model repeating the request: the question's words say more
        return ""
    if NOT_A_TITLE.match(title) or TOOL_NAME.match(title) or len(title.split()) > TITLE_MAX_WORDS:
        return ""
    return _bounded(title)


def title_prompt(asked: list[dict[str, Any]], answer: str, question: str, reply: str) -> list[dict[str, Any]]:
    """The title request: the turn's own prompt and answer, then the request, when there is one."""
    if asked and asked[-1].get("role") == "user":
        return [*asked, {"role": "assistant", "content": answer}, {"role": "user", "content": TITLE_REQUEST}]
    return [
        {"role": "system", "content": TITLE_INSTRUCTIONS},
        {"role": "user", "content": f"Question: {question[:2000]}\n\nAnswer: {reply[:1000]}\n\nTitle:"},
    ]


async def make_title(
    router: RouterClient, history: AsyncHistory, cid: int, model: str, prompt: list[dict[str, Any]], question: str,
    tools: list[dict[str, Any]] | None = None, renamed: Callable[[Conversation], None] | None = None,
) -> None:
    """Ask the model for a short title; keep the provisional one if that fails or was changed.
    ``renamed`` is told the conversation once the title is its own.

    ``tools`` are the ones the turn offered: a template renders them at the top of the
    prompt, so the request offers them too (``tool_choice: none``) to keep the cache's prefix.
    """
    params: dict[str, Any] = {"tools": tools, "tool_choice": "none"} if tools else {}
    try:
        title = clean_title(await router.complete(model, prompt, max_tokens=TITLE_TOKENS, **params))
    except AssistantError as exc:
        logger.info("no model-made title for conversation %d: %s", cid, exc.message)
        return
    if not title:
        return
    # kept when the user has renamed the conversation meanwhile
    if await history.run(HistoryStore.replace_title, cid, provisional_title(question), title) and renamed is not None:
        conv = await history.run(HistoryStore.get_conversation, cid)
        if conv is not None:
            renamed(conv)
