"""file_convert: the file operations offered to the model, over the conversation's attachments.

The model names attachments by their ids (attachment_recall's ``list``), never a path: a
file reaches an operation only if the user attached it in this conversation, and only as
it was (its size checked against the one stored). The tool writes files, so it ``acts``:
every call waits for a person's approval (daemon/approvals.py) before anything runs. Its
outputs are attached to the turn, so attachment_recall lists them and reads a Markdown
output's text.
"""

from __future__ import annotations

import asyncio
import mimetypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attachments import (
    FULL_TEXT_CAP,
    Ocr,
    VideoFacts,
    audio_line,
    pdf_full_text,
    probe_sound,
    read_pdf_text,
    read_video_facts,
    video_line,
)
from core.config import Config
from core.errors import AssistantError
from core.tools import Tool, ToolContext, ToolError, ToolResult, json_content, one_line, string_argument
from history import AsyncHistory, HistoryStore, NewAttachment

from .options import OPERATIONS
from .outputs import OutputChip
from .service import Converter

__all__ = ["FileConvert"]

MAX_ATTACHMENTS = 100  # pdf_merge's bound; the others take one
GONE = "the file has changed or is gone since it was attached; ask the user to attach it again"
# what a chip's kind is stored as: attachment_recall reads "pdf" and "image" as their kinds
STORED_KINDS = {"markdown": "text"}
CONVERTIBLE = frozenset(kind for spec in OPERATIONS.values() for kind in spec.kinds)  # as attachments are stored


def _description() -> str:
    options = "; ".join(
        f"{spec.name}: " + (", ".join(f"{o.name} ({o.description})" for o in spec.options) or "none")
        for spec in OPERATIONS.values() if spec.options)
    return ("Convert files the user attached in this conversation, on the user's computer: "
            + ", ".join(f"{spec.name} ({spec.description})" for spec in OPERATIONS.values())
            + f". Options: {options}. Name files by their attachment ids (attachment_recall list). "
            "It writes new files beside the originals and the user approves every call; the outputs "
            "are attached to the conversation.")


class FileConvert(Tool):
    """One file operation on attachments, once a person allows it."""

    name = "file_convert"
    acts = True
    parameters = {
        "type": "object",
        "properties": {
            "operation": {"type": "string", "enum": list(OPERATIONS)},
            "attachments": {"type": "array", "items": {"type": "integer"}, "minItems": 1,
                            "description": "attachment ids, in the order the operation takes them"},
            "options": {"type": "object", "description": "the operation's options by name; defaults if left out"},
        },
        "required": ["operation", "attachments"],
    }

    def __init__(self, config: Callable[[], Config], ocr: Ocr | None = None) -> None:
        self.description = _description()
        self._config = config  # the configuration in effect, read at each call (a reload changes it)
        self._converter = Converter(ocr, prefix="t")

    async def available(self, ctx: ToolContext[AsyncHistory]) -> bool:
        """Offered once the conversation has a file an operation takes (a PDF, an image, a video): a text
        file alone would cost every prompt the tool's definition for nothing."""
        if ctx.has_attachments is False:
            return False
        return any(a.kind in CONVERTIBLE for a in await ctx.history.run(HistoryStore.attachments, ctx.conversation))

    async def run(self, arguments: dict[str, Any], ctx: ToolContext[AsyncHistory]) -> ToolResult:
        operation = string_argument(arguments, "operation") or ""
        options = arguments.get("options") or {}
        if not isinstance(options, dict):
            raise ToolError("options must be a JSON object of the operation's options, such as {\"pages\": \"1-2\"}")
        files = await self._files(arguments.get("attachments"), ctx)
        config = self._config()
        try:
            job = self._converter.job(config, operation, files, options, None, lambda _ident: _quiet)
            done = await self._converter.convert(job, config.convert_timeout, config.data_dir / "thumbnails")
        except AssistantError as exc:  # a bad option, a damaged file, a missing ffmpeg: the model is told
            raise ToolError(exc.message) from None
        stored = [await _stored(chip) for chip in done.outputs]
        ids = await ctx.history.run(HistoryStore.add_attachments, ctx.conversation, ctx.turn, stored)
        outputs = [{"id": ident, "filename": chip.name, "path": chip.path, "size_bytes": chip.size, "kind": chip.kind}
                   for ident, chip in zip(ids, done.outputs)]
        written = ", ".join(chip.name for chip in done.outputs)
        return ToolResult(content=json_content({"operation": operation, "outputs": outputs}), ok=True,
                          summary=one_line(f"{operation}: wrote {written}"))

    async def _files(self, ids: Any, ctx: ToolContext[AsyncHistory]) -> list[str]:
        """The paths of the attachments ``ids`` of this conversation, each as it was attached."""
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ToolError("attachments must be a list of attachment ids (integers), from attachment_recall's list")
        if len(ids) > MAX_ATTACHMENTS:
            raise ToolError(f"at most {MAX_ATTACHMENTS} attachments in one call")
        paths = []
        for ident in ids:
            found = await ctx.history.run(HistoryStore.attachment, ctx.conversation, ident)
            if found is None:
                raise ToolError(f"this conversation has no attachment {ident}; attachment_recall's list shows them")
            path = Path(found.path)
            if not path.is_file() or path.stat().st_size != found.size_bytes:
                raise ToolError(f"{found.name}: {GONE}")
            paths.append(str(path))
        return paths


def _quiet(done: float, total: float | None, unit: str) -> None:
    """Progress of a tool's conversion: the turn shows the call, not its steps."""


async def _stored(chip: OutputChip) -> NewAttachment:
    """An output as the turn's attachment, with what attachment_recall, recall and the manifest of
    folded files read of it: a merged or cut PDF its text layer and pages, as a PDF on a question
    is read; a Markdown output its text; a video (trackcrop's) the line a video on a question has
    (attachments/video.py), a sound file (video_to_audio's) such a line with its duration."""
    text, pages = None, None
    if chip.kind == "pdf":
        try:
            read = await read_pdf_text(chip.path, chip.name)
            text, pages = pdf_full_text(read), read.total_pages
        except AssistantError:  # attached all the same, its pages unread (the manifest says "PDF")
            pass
    elif chip.kind == "audio":
        text = audio_line(await probe_sound(chip.path, chip.name), chip.size, None)
    else:
        text = await asyncio.to_thread(_text_of, chip)
    content_type = mimetypes.guess_type(chip.name)[0] or "application/octet-stream"
    return NewAttachment(chip.name, chip.path, STORED_KINDS.get(chip.kind, chip.kind), content_type, chip.size,
                         chip.sha256, pages=pages, full_text=text)


def _text_of(chip: OutputChip) -> str | None:
    """A Markdown output's text, or a video's line; None for an output with no words to keep."""
    if chip.kind == "markdown":
        return Path(chip.path).read_text(errors="replace")[:FULL_TEXT_CAP]
    if chip.kind == "video":  # an MP4 of our own making: its boxes say its duration and size
        return video_line(read_video_facts(chip.path) or VideoFacts(None, None, None), chip.size, None)
    return None
