"""A hosted MCP tool as one of the model's tools: its name, its schema, its results.

Names: ``SERVER__TOOL``. A server name holds no ``__`` (``core.mcpconfig``) and the
daemon's own tools have none, so the prefix says which server a name belongs to and
no hosted tool can take one of ours. OpenAI function names are ``[a-zA-Z0-9_-]{1,64}``:
other characters become ``_``, and a name too long, or equal to a sibling's after that,
is cut and ends with a short hash of the tool's own name, so it is the same every time.

Schemas are rendered with sorted keys: the tool list sits at the top of the prompt, so
the same tools must be the same bytes from turn to turn (docs/DESIGN.md, "MCP").
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from typing import TYPE_CHECKING, Any

from core.errors import AssistantError, FileRefused
from core.jsontext import without_lone_surrogates
from core.seams import ImageReader
from core.tokens import cut_to_weight, estimate_tools, text_weight
from core.tools import Tool, ToolContext, ToolError, ToolResult, one_line

from .records import RemoteTool

if TYPE_CHECKING:
    from .host import ServerHandle

__all__ = ["MAX_DESCRIPTION_CHARS", "McpTool", "offered_names"]

MAX_NAME = 64
SEPARATOR = "__"
MAX_DESCRIPTION_CHARS = 1_000  # a server's essay on one tool costs every turn's context
MAX_IMAGE_BASE64 = 10 * 1024 * 1024  # as attachment_recall: one image rides in every later round
CUT_NOTE = "\n[... cut here: the result had {total} characters; ask for less, or for a part of it]"
NOT_A_NAME = re.compile(r"[^A-Za-z0-9_-]")
IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")


def _hashed(name: str, base: str, room: int, salt: int = 0) -> str:
    digest = hashlib.sha256(f"{name}#{salt}".encode() if salt else name.encode()).hexdigest()[:6]
    return f"{base[: room - 7]}_{digest}"


def offered_names(server: str, tools: list[str]) -> dict[str, str]:
    """The name the model sees for each of a server's tools: stable, and unique by construction.

    A name that is safe, fits and is no other's keeps it; the others get a hashed one, hashed
    again (salted) while it is taken: a tool may itself be named like another's hashed name.
    """
    room = MAX_NAME - len(server) - len(SEPARATOR)
    plain = {name: NOT_A_NAME.sub("_", name) or "_" for name in tools}
    counts: dict[str, int] = {}
    for safe in plain.values():
        counts[safe] = counts.get(safe, 0) + 1
    kept = {name: safe for name, safe in plain.items() if len(safe) <= room and counts[safe] == 1}
    taken = set(kept.values())
    for name, safe in plain.items():
        if name not in kept:  # the hash of the real name keeps it distinct
            salt = 0
            while (hashed := _hashed(name, safe, room, salt)) in taken:
                salt += 1
            kept[name] = hashed
            taken.add(hashed)
    return {name: f"{server}{SEPARATOR}{kept[name]}" for name in tools}


def canonical(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with sorted keys, an object schema at its root (what function calling needs).

    A schema JSON cannot carry (NaN, Infinity: the SDK reads them) becomes the empty one, as
    does a root that is not an object's; one that only leaves out ``"type"`` gets it.
    """
    try:
        fixed = json.loads(json.dumps(schema, sort_keys=True, ensure_ascii=False, allow_nan=False))
    except ValueError:
        fixed = None
    kind = fixed.get("type", "object") if isinstance(fixed, dict) else None
    if kind not in ("object", ["object"]):
        return {"properties": {}, "type": "object"}
    assert isinstance(fixed, dict)
    fixed["type"] = "object"
    fixed.setdefault("properties", {})
    return dict(sorted(fixed.items()))


class McpTool(Tool):
    """One tool of one hosted server, offered under its prefixed name."""

    def __init__(
        self, handle: ServerHandle, remote: RemoteTool, offered: str, max_result_chars: int, images: ImageReader
    ) -> None:
        self.handle = handle
        self._read_image = images
        self.remote = remote
        self.name = offered
        self.server = handle.spec.name
        description = " ".join(remote.description.split()) or f"the {remote.name} tool"
        if len(description) > MAX_DESCRIPTION_CHARS:
            description = description[: MAX_DESCRIPTION_CHARS - 1] + "…"
        self.description = f"{description} (MCP server {self.server})"
        self.parameters = canonical(remote.input_schema)
        self.annotations = remote.annotations
        self.acts = handle.spec.asks(remote.name, remote.read_only)  # docs/DESIGN.md, "Approval"
        self.max_result_chars = max_result_chars
        # made once (McpHost keeps a server's tools while its connection lasts), not for every
        # tool on every turn before its first token (bench/bench_mcp.py)
        self._definition = super().definition()
        self._tokens = estimate_tools([self._definition])

    def definition(self) -> dict[str, Any]:
        return self._definition

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def own_name(self) -> str:
        return self.remote.name

    async def available(self, ctx: ToolContext) -> bool:
        return True  # offered by McpHost.offer, which knows which servers run

    async def run(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        outcome = await self.handle.call(self.remote.name, arguments)  # ToolError when the server is gone
        text = outcome.text
        if outcome.is_error:
            reason = without_lone_surrogates(text[:2000]) or "no reason given"
            raise ToolError(f"{self.server}'s {self.remote.name} failed: {reason}")
        images, notes = await self._images(outcome.images, ctx)
        # in budget characters, as the room left is counted (text outside ASCII weighs more),
        # less what the images shown take
        limit = max(min(self.max_result_chars, ctx.max_chars - len(images) * ctx.image_chars), 200)
        if text_weight(text) > limit:
            note = CUT_NOTE.format(total=len(text))
            text = cut_to_weight(text, max(limit - len(note), 0)) + note
        text = without_lone_surrogates(text)  # once cut, over what is kept: a lone one could not be stored
        if notes:
            text = "\n".join([text, *notes]) if text else "\n".join(notes)
        shown = f", {len(images)} image(s)" if images else ""
        return ToolResult(
            content=text, ok=True, images=images,
            summary=one_line(f"{self.server}: {self.remote.name} returned {len(outcome.text)} characters{shown}"),
        )

    async def _images(
        self, found: list[tuple[str, str]], ctx: ToolContext
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """Images as image_url parts for a vision model (shown as attachment_recall shows its
        own), each checked, decoded and scaled as an attached image is; or a note of each one
        the model cannot be shown, and why."""
        images: list[dict[str, Any]] = []
        notes: list[str] = []
        room = ctx.max_chars  # each image shown takes ctx.image_chars of what is left
        for n, (mime, data) in enumerate(found, 1):
            if not ctx.vision:
                notes.append(f"[image {n} ({mime}) not shown: this model cannot see images]")
            elif mime not in IMAGE_TYPES:
                notes.append(f"[image {n} not shown: {mime} is not an image type models read]")
            elif len(data) > MAX_IMAGE_BASE64:
                notes.append(f"[image {n} not shown: over {MAX_IMAGE_BASE64 // (1024 * 1024)} MB of base64]")
            elif ctx.image_chars > room:
                notes.append(f"[image {n} not shown: no room left in the context for it]")
            else:
                try:
                    url = await self._read_image(_decoded(data, n), f"image {n}")
                except AssistantError as exc:  # FileRefused, TooManyPixels: the model reads why
                    notes.append(f"[{without_lone_surrogates(exc.message)} (not shown)]")
                    continue
                room -= ctx.image_chars
                images.append({"type": "image_url", "image_url": {"url": url}})
        return images, notes


def _decoded(data: str, n: int) -> bytes:
    """The bytes of an image's base64 (``FileRefused`` when it is not base64)."""
    try:
        return base64.b64decode("".join(data.split()), validate=True)
    except ValueError:  # binascii.Error
        raise FileRefused(f"image {n}: its data is not base64") from None
