"""Token estimates for when the router reports no usage (seed 000 §3).

Text counts one token per ``CHARS_PER_TOKEN`` ASCII characters, the common rough
rule for English and code, and two for any other character; an image counts a flat per-model cost (765 by
default, OpenAI's base tile, reasonable across providers).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["CHARS_PER_TOKEN", "estimate_messages", "estimate_text"]

CHARS_PER_TOKEN = 4
NON_ASCII_TOKENS = 2  # SmolLM2 on llama-server: two tokens a CJK character
MESSAGE_OVERHEAD = 4  # role and separators a chat template adds per message
IMAGE_PART_TYPES = ("image_url", "image_ref")


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
