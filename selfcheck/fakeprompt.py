"""The fake router's prompt cache: chat requests rendered as a ChatML template does.

llama-server keeps, per slot, the tokens of the last prompt and of the reply it
generated, and on the next request reuses the longest common prefix
(``timings.cache_n``) and processes only the rest (``timings.prompt_n``).  A
client whose prompts stay byte-identical up to the previous answer pays only for
what is new; one that changes an early byte pays for everything after it.  The
fake mirrors that on text instead of tokens:

- ``render_prompt`` renders a request's messages the way a ChatML template does
  (``<|im_start|>{role}\\n{content}<|im_end|>\\n`` each, then
  ``<|im_start|>assistant\\n``).  Content parts are concatenated; an image is a
  fixed marker with a hash of its data, so a changed image counts as changed; tool
  calls and tool results are rendered the way Qwen's templates do; the request's
  ``tools`` go at the end of the system message, so offering other tools (or
  none) changes the prompt from its first message on, as on a real server.
  Reasoning is not rendered (templates drop it from the history).
- ``PromptSlot`` is one model's slot: the last rendering plus the reply text it
  generated and ``<|im_end|>``; ``use`` measures a new prompt against it and
  takes its place, as every request does on a one-slot llama-server, titles and
  summaries included.

Lengths are the fake's rough tokens (``text_tokens``): ASCII at
``CHARS_PER_TOKEN`` characters a token, other scripts at two tokens a character.
Standard library only, like the fake itself.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["CHARS_PER_TOKEN", "PromptSlot", "Use", "render_prompt", "render_reply", "text_tokens", "tools_tokens"]

CHARS_PER_TOKEN = 4
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
IMAGE_HASH_CHARS = 16
PROMPT_MS_PER_TOKEN = 0.5  # about 2000 prompt tokens a second
PREDICTED_MS_PER_TOKEN = 20.0  # 50 generated tokens a second


def text_tokens(text: str) -> int:
    """A tokenizer's count, roughly: ASCII at CHARS_PER_TOKEN a token, and other scripts at
    two tokens a character, as SmolLM2's tokenizer counts CJK text on llama-server."""
    ascii_chars = len(text.encode("ascii", "ignore"))
    return ascii_chars // CHARS_PER_TOKEN + 2 * (len(text) - ascii_chars)


def _part(part: Any) -> str:
    if not isinstance(part, dict):
        return ""
    kind = part.get("type")
    if kind == "text":
        return str(part.get("text", ""))
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url", "") if isinstance(image, dict) else str(image or "")
        digest = hashlib.blake2b(str(url).encode(), digest_size=IMAGE_HASH_CHARS // 2).hexdigest()
        return f"<image:{digest}>"
    return f"<{kind}>"


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part(part) for part in content)
    return ""


def _tool_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments or "{}"}}}\n</tool_call>'


def render_reply(text: str, calls: list[tuple[str, str]]) -> str:
    """An assistant message's body: its text, then its tool calls as ``(name, arguments)``."""
    return text + "".join("\n" + _tool_call(name, arguments) for name, arguments in calls)


def _calls_of(message: dict[str, Any]) -> list[tuple[str, str]]:
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            arguments = function.get("arguments")
            text = arguments if isinstance(arguments, str) else json.dumps(arguments)
            calls.append((str(function.get("name", "")), text))
    return calls


def _block(role: str, body: str) -> str:
    return f"{IM_START}{role}\n{body}{IM_END}\n"


def _tools_text(tools: Any) -> str:
    if not isinstance(tools, list) or not tools:
        return ""
    listed = "\n".join(json.dumps(tool, sort_keys=True) for tool in tools)
    return f"\n\n# Tools\n\n<tools>\n{listed}\n</tools>"


def tools_tokens(tools: Any) -> int:
    """What a request's ``tools`` add to its prompt, in rough tokens: the template renders them."""
    return text_tokens(_tools_text(tools))


def render_prompt(body: dict[str, Any]) -> str:
    """A chat request as a ChatML template renders it, ending where the reply begins."""
    messages = [m for m in body.get("messages") or () if isinstance(m, dict)]
    tools = _tools_text(body.get("tools"))
    out = []
    if tools and not (messages and messages[0].get("role") == "system"):
        out.append(_block("system", tools.lstrip("\n")))
    for index, message in enumerate(messages):
        role = str(message.get("role", "user"))
        text = _content(message.get("content"))
        if role == "system" and index == 0:
            out.append(_block("system", text + tools))
        elif role == "assistant":
            out.append(_block("assistant", render_reply(text, _calls_of(message))))
        elif role == "tool":
            out.append(_block("user", f"<tool_response>\n{text}\n</tool_response>"))
        else:
            out.append(_block(role, text))
    return "".join(out) + f"{IM_START}assistant\n"


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix, by halving (fast on long equal runs)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


@dataclass
class Use:
    """What one request cost its slot: prompt tokens reused from the cache and processed."""

    cache_n: int
    prompt_n: int

    def timings(self, predicted_n: int) -> dict[str, float | int]:
        """The request's timings the way llama-server reports them, with plausible times."""
        prompt_ms = self.prompt_n * PROMPT_MS_PER_TOKEN
        predicted_ms = predicted_n * PREDICTED_MS_PER_TOKEN
        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": PROMPT_MS_PER_TOKEN,
            "prompt_per_second": 1000.0 / PROMPT_MS_PER_TOKEN,
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": PREDICTED_MS_PER_TOKEN,
            "predicted_per_second": 1000.0 / PREDICTED_MS_PER_TOKEN,
        }


class PromptSlot:
    """One model's slot: the text it holds, reused as a prefix by the next request."""

    def __init__(self) -> None:
        self.text = ""

    def use(self, prompt: str, reply: str) -> Use:
        """Measure ``prompt`` against the cached text, then hold it and its ``reply``."""
        total = text_tokens(prompt)
        # llama-server evaluates at least the prompt's last token again, even on a full match
        cache_n = max(0, min(text_tokens(prompt[: _common_prefix(prompt, self.text)]), total - 1))
        self.text = prompt + reply + IM_END
        return Use(cache_n, total - cache_n)
