"""Token estimates, for when the model server counts none, and their constants.

Two uses, two rates, both named here:

- **estimates** (``estimate_text``, ``estimate_messages``): what a prompt is likely to
  cost, at ``CHARS_PER_TOKEN`` (4) ASCII characters a token, the common rule for English
  and code, and ``NON_ASCII_TOKENS`` (2) for any other character (small tokenizers split
  CJK text that finely); an image counts ``DEFAULT_IMAGE_TOKENS`` (765, OpenAI's base
  tile, reasonable across servers) unless configured otherwise;
- **budgets** (the attachments' text budget; docs/DESIGN.md, "Attachments"): deliberately
  pessimistic at ``BUDGET_CHARS_PER_TOKEN`` (3), so extracted files err towards leaving
  room.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = [
    "BUDGET_CHARS_PER_TOKEN",
    "CHARS_PER_TOKEN",
    "DEFAULT_IMAGE_TOKENS",
    "IMAGE_PART_TYPES",
    "NON_ASCII_TOKENS",
    "NON_ASCII_WEIGHT",
    "cut_to_weight",
    "estimate_messages",
    "estimate_text",
    "estimate_tools",
    "text_weight",
]

CHARS_PER_TOKEN = 4  # estimates
BUDGET_CHARS_PER_TOKEN = 3  # budgets: cautious on purpose
DEFAULT_IMAGE_TOKENS = 765  # an image's flat cost (the image_tokens setting)
NON_ASCII_TOKENS = 2  # SmolLM2 on llama-server: two tokens a CJK character
MESSAGE_OVERHEAD = 4  # role and separators a chat template adds per message
IMAGE_PART_TYPES = ("image_url", "image_ref")

# A character outside ASCII (CJK, Cyrillic, emoji, U+FFFD) costs a tokenizer one or two
# tokens (SmolLM2 on llama-server: two for CJK), where ASCII runs BUDGET_CHARS_PER_TOKEN to one;
# counted at two tokens, such text is cut before it can overflow the context: the
# weight of a text in budget characters (``text_weight``) is what budgets count.
NON_ASCII_WEIGHT = 2 * BUDGET_CHARS_PER_TOKEN


def text_weight(text: str) -> int:
    """``text``'s length in budget characters: ASCII one each, others NON_ASCII_WEIGHT."""
    if text.isascii():
        return len(text)
    ascii_chars = len(text.encode("ascii", "ignore"))
    return ascii_chars + NON_ASCII_WEIGHT * (len(text) - ascii_chars)


def cut_to_weight(text: str, weight: int) -> str:
    """The longest start of ``text`` whose weight is at most ``weight``."""
    if text_weight(text[:weight]) <= weight and (len(text) <= weight or text.isascii()):
        return text[:weight]
    total = 0
    for index, char in enumerate(text):
        total += 1 if char.isascii() else NON_ASCII_WEIGHT
        if total > weight:
            return text[:index]
    return text


def estimate_text(text: str) -> int:
    """ASCII at CHARS_PER_TOKEN a token; any other character (CJK, emoji, U+FFFD) at
    NON_ASCII_TOKENS, as small tokenizers count them (a flat 4 undercounts such text 8x)."""
    if text.isascii():
        return math.ceil(len(text) / CHARS_PER_TOKEN)
    ascii_chars = len(text.encode("ascii", "ignore"))
    return math.ceil(ascii_chars / CHARS_PER_TOKEN) + NON_ASCII_TOKENS * (len(text) - ascii_chars)


def estimate_messages(messages: list[dict[str, Any]], image_tokens: int) -> int:
    """Tokens of a prompt in the router's format; image parts count ``image_tokens`` each."""
    total = 0
    for message in messages:
        total += MESSAGE_OVERHEAD
        content = message.get("content")
        if isinstance(content, str):
            total += estimate_text(content)
        elif isinstance(content, list):
            for part in content:
                if part.get("type") in IMAGE_PART_TYPES:
                    total += image_tokens
                else:
                    total += estimate_text(str(part.get("text", "")))
        for call in message.get("tool_calls") or ():
            function = call.get("function", {})
            total += estimate_text(function.get("name", "") + function.get("arguments", ""))
    return total


def estimate_tools(definitions: list[dict[str, Any]] | None) -> int:
    """Tokens the ``tools`` of a request take: chat templates render them into the prompt
    (as JSON, near the top), so they count against the context like any message."""
    if not definitions:
        return 0
    return estimate_text(json.dumps(definitions, ensure_ascii=False, separators=(",", ":")))
