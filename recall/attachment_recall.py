"""attachment_recall: the model re-reads a file attached earlier in its conversation.

``list`` shows the conversation's files; ``read`` returns one of them:
documents from the full text stored when they were attached (never cut to the turn's
budget), paged so that a read fits what is left of the context; images re-read from
where they were attached, checked against the hash taken then, and shown as they were
sent then (a WebP or a large photo re-encoded alike), when the context has room for one;
a video, which no model here can watch, as the line that named it on its question, with its id;
a sound file ``file_convert`` made, likewise, as the line of its duration and size it was stored with.

Scoped by construction: the store is only ever asked with ``ctx.conversation``, and
``HistoryStore.attachment`` matches the id together with it, so an id from another
conversation reads as not found. No argument names a path.

A PDF's stored text is its pages joined by ``attachments.PAGE_BREAK`` (a form feed, as
attachments/pdf.py ``pdf_full_text`` joins them: ``split(PAGE_BREAK)[n - 1]`` is page n).
Text without a form feed but with ``PAGE_MARKER`` lines (``[page N]``, as a PDF's block
has them) is split at those lines instead. A read without ``page`` shows the pages with
a ``PAGE_MARKER`` line before each, so offsets run over that text; a page without text
(scanned) says so instead of being empty.
"""

from __future__ import annotations

import re
from typing import Any

from attachments import PAGE_BREAK, PAGE_MARKER, PAGE_UNITS, ImageCache, attached_image, audio_line, video_line_naming
from core.errors import FileRefused
from core.tokens import cut_to_weight, text_weight
from core.tools import (
    Tool,
    ToolContext,
    ToolError,
    ToolResult,
    integer_argument,
    json_content,
    string_argument,
)
from history import AsyncHistory, Attachment, HistoryStore

__all__ = [
    "MAX_IMAGE_BASE64",
    "AttachmentRecall",
    "document_pages",
]

# a PAGE_MARKER line alone: where text without form feeds is split into pages
PAGE_MARKER_LINE = re.compile(r"^\[page (\d+)\][ \t]*$", re.MULTILINE)
SCANNED_PAGE = (
    "[page {n} has no text layer: it is probably a scanned image, which cannot be read as "
    "text; ask the user what it shows, or to attach it as an image]"
)
# An image shown again is refused over this much base64 (as sent: within 2048 px): its data URL goes
# whole into every later request of the turn's tool rounds.
MAX_IMAGE_BASE64 = 10 * 1024 * 1024
# Characters kept free in a text read for the JSON around the text.
ENVELOPE_CHARS = 400
MIN_READ_CHARS = 200  # a read smaller than this is not worth making
GONE = "the file has changed or is gone; ask the user to attach it again"
LIST_CUT_NOTE = "only the newest fit in the context"


def document_pages(text: str) -> list[str]:
    """A stored PDF text split into its pages (one page when it has no markers)."""
    if PAGE_BREAK in text:
        return text.split(PAGE_BREAK)  # a document's slides, sheets or chapters likewise
    starts = list(PAGE_MARKER_LINE.finditer(text))
    if not starts:
        return [text]
    pages = [text[m.end() : n.start()] for m, n in zip(starts, starts[1:])]
    pages.append(text[starts[-1].end() :])
    return [page.strip("\n") for page in pages]


def _page_text(pages: list[str], n: int, unit: str = "page") -> str:
    """Page ``n`` (1-based) as the model reads it (``unit``: a document's slide, sheet, chapter)."""
    text = pages[n - 1]
    if text.strip():
        return text
    return SCANNED_PAGE.format(n=n) if unit == "page" else f"[{unit} {n} has no text]"


def _whole_document(pages: list[str], unit: str = "page") -> str:
    """A PDF's pages (a document's slides, sheets or chapters), each after its marker line
    (``PAGE_MARKER``, ``[slide N]``)."""
    marker = PAGE_MARKER if unit == "page" else f"[{unit} {{n}}]"
    return "\n\n".join(
        marker.format(n=n) + "\n" + _page_text(pages, n, unit) for n in range(1, len(pages) + 1)
    )


class AttachmentRecall(Tool):
    """List the conversation's attachments, or read one of them again."""

    name = "attachment_recall"
    description = (
        "Re-read files attached earlier in this conversation, whose content may no longer "
        "be in your context. Use action='list' to see them (id, name, type, pages), then "
        "action='read' with an attachment_id to get the content. Long documents come in "
        "parts: read on from next_offset, or give page=N for one page of a PDF."
    )
    parameters = {
        "type": "object",
        "properties": {
            "action": {"type": "string", "enum": ["list", "read"], "description": "list or read"},
            "attachment_id": {
                "type": "integer",
                "description": "The id of the attachment to read (from action='list'); required for read.",
            },
            "offset": {
                "type": "integer",
                "description": "Character offset to read from (default 0): the next_offset of the previous read.",
            },
            "max_chars": {
                "type": "integer",
                "description": "At most this many characters (default: as many as fit).",
            },
            "page": {
                "type": "integer",
                "description": "For a PDF, a slide deck, a spreadsheet or an EPUB: read only this page, "
                               "slide, sheet or chapter (1-based).",
            },
        },
        "required": ["action"],
    }

    def __init__(self, images: ImageCache | None = None) -> None:
        """``images``: the daemon's image cache (``FileReaders.images``); None, one of its own."""
        self.images = images if images is not None else ImageCache()

    async def available(self, ctx: ToolContext[AsyncHistory]) -> bool:
        if ctx.recall_injection == "off":
            return False
        if ctx.has_attachments is not None:
            return ctx.has_attachments
        return await ctx.history.run(HistoryStore.has_attachments, ctx.conversation)

    async def run(self, arguments: dict[str, Any], ctx: ToolContext[AsyncHistory]) -> ToolResult:
        action = string_argument(arguments, "action")
        if action == "list":
            return await self._list(ctx)
        if action == "read":
            return await self._read(arguments, ctx)
        raise ToolError("action must be 'list' or 'read'")

    # -- list -------------------------------------------------------------------------

    async def _list(self, ctx: ToolContext[AsyncHistory]) -> ToolResult:
        attachments = await ctx.history.run(HistoryStore.attachments, ctx.conversation)
        items = [a.to_json() for a in attachments]
        body: dict[str, Any] = {"attachments": items, "count": len(items)}
        if len(json_content(body)) > ctx.max_chars:
            # too many to fit what is left of the context: the newest are kept
            frame = {**body, "attachments": [], "shown": len(items), "note": LIST_CUT_NOTE}
            room = ctx.max_chars - len(json_content(frame))
            kept = len(items)
            sizes = [len(json_content(item)) + 1 for item in items]  # +1: the comma
            while kept and sum(sizes[len(items) - kept :]) > room:
                kept -= 1
            body = {**frame, "attachments": items[len(items) - kept :], "shown": kept}
        return ToolResult(
            content=json_content(body), ok=True, summary=f"listed {len(items)} attachment(s)"
        )

    # -- read -------------------------------------------------------------------------

    async def _read(self, arguments: dict[str, Any], ctx: ToolContext[AsyncHistory]) -> ToolResult:
        wanted = integer_argument(arguments, "attachment_id")
        if wanted is None:
            raise ToolError("action=read needs attachment_id; call action=list to see the ids")
        attachment = await ctx.history.run(HistoryStore.attachment, ctx.conversation, wanted)
        if attachment is None:
            raise ToolError(f"no attachment {wanted} in this conversation; call action=list")
        if attachment.kind == "image" and (ctx.vision or not attachment.full_text):
            return await self._image(attachment, ctx)  # an image read by OCR gives a blind model its text
        return self._text(attachment, arguments, ctx)

    def _text(self, attachment: Attachment, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        source, page, pages = self._source(attachment, integer_argument(arguments, "page"))
        offset = integer_argument(arguments, "offset") or 0
        if not 0 <= offset < len(source):
            raise ToolError(f"offset {offset} is outside the text (0 to {len(source) - 1})")
        body = self._text_body(attachment, source, offset, self._read_limit(arguments, ctx), page, pages)
        # JSON escapes (\n, \") lengthen the text: cutting as much weight as the excess always
        # fits, each character weighing at least as much in JSON
        excess = text_weight(json_content(body)) - ctx.max_chars
        if excess > 0 and (weight := text_weight(body["content"])) > excess:
            body = self._text_body(attachment, source, offset, weight - excess, page, pages)
        where = f" page {page}" if page is not None else ""
        summary = (
            f"read {attachment.name}{where}: {body['returned_chars']:,} of {len(source):,} characters"
            f" from {offset:,}"
        )
        return ToolResult(content=json_content(body), ok=True, summary=summary)

    @staticmethod
    def _source(attachment: Attachment, page: int | None) -> tuple[str, int | None, int | None]:
        """The text a read pages through (the document, or one page), the page, the page count."""
        text = attachment.full_text or ""
        if attachment.kind == "audio" and not text:  # a sound file stored before they had a line
            text = audio_line(None, attachment.size_bytes, None)
        if attachment.kind in ("video", "audio"):  # its line was stored before its id was known: named here
            text = video_line_naming(text, attachment.id)
        if not text.strip():
            what = "no text layer (a scanned PDF?)" if attachment.kind == "pdf" else "no text"
            raise ToolError(f"{attachment.name} has {what}; ask the user what it contains")
        unit = PAGE_UNITS.get(attachment.kind)
        if unit is None:
            if page is not None:
                raise ToolError(f"{attachment.name} has no pages; page applies to PDFs, slide decks, "
                                "spreadsheets and EPUBs; use offset")
            return text, None, None
        pages = document_pages(text)
        count = attachment.pages or len(pages)
        if page is None:
            return _whole_document(pages, unit), None, count
        if not 1 <= page <= len(pages):
            raise ToolError(f"{attachment.name} has text for {unit}s 1 to {len(pages)}; not {unit} {page}")
        return _page_text(pages, page, unit), page, count

    @staticmethod
    def _read_limit(arguments: dict[str, Any], ctx: ToolContext) -> int:
        room = ctx.max_chars - ENVELOPE_CHARS
        if room < MIN_READ_CHARS:
            raise ToolError(
                "there is no room left in the context for more of this file; answer from what you have"
            )
        requested = integer_argument(arguments, "max_chars")
        if requested is not None and requested < 1:
            raise ToolError("max_chars must be at least 1")
        return min(requested or room, room)

    @staticmethod
    def _text_body(
        attachment: Attachment, source: str, offset: int, limit: int, page: int | None, pages: int | None
    ) -> dict[str, Any]:
        # ``limit`` is in budget characters: a character outside ASCII weighs the two tokens it costs
        chunk = cut_to_weight(source[offset : offset + limit], limit)
        end = offset + len(chunk)
        body: dict[str, Any] = {
            "id": attachment.id,
            "filename": attachment.name,
            "content_type": attachment.content_type,
            "content_type_returned": "text",
            "pages": pages,
        }
        if page is not None:
            body["page"] = page
        body.update(
            offset=offset,
            returned_chars=len(chunk),
            total_chars=len(source),
            next_offset=end if end < len(source) else None,
            content=chunk,
        )
        return body

    async def _image(self, attachment: Attachment, ctx: ToolContext) -> ToolResult:
        if not ctx.vision:
            raise ToolError(
                f"{attachment.name} is an image and this model cannot see images; tell the user, "
                "who can switch to a vision model to look at it"
            )
        if ctx.image_chars > ctx.max_chars:
            raise ToolError(
                f"there is no room left in the context to show {attachment.name} again; answer from what you have"
            )
        # as it was sent when attached (a WebP or a large photo re-encoded alike), not the file's bytes
        try:
            image = await attached_image(attachment.path, attachment.name, attachment.sha256, self.images)
        except FileRefused:
            raise ToolError(GONE) from None
        if image is None:
            raise ToolError(GONE)
        url = image.data_url
        if len(url) > MAX_IMAGE_BASE64:
            raise ToolError(self._too_large(attachment, len(url)))
        body = {
            "id": attachment.id,
            "filename": attachment.name,
            "content_type": attachment.content_type,
            "content_type_returned": "base64_image",
            # The data URL goes to the model as an image part (ToolResult.images): as text
            # it would cost a token every few characters, in this prompt and every later one.
            "content": f"[the image {attachment.name} is shown to you as an image part]",
        }
        return ToolResult(
            content=json_content(body),
            ok=True,
            summary=f"showed {attachment.name} ({image.width}x{image.height})",
            images=[{"type": "image_url", "image_url": {"url": url}}],
        )

    @staticmethod
    def _too_large(attachment: Attachment, encoded_size: int) -> str:
        return (
            f"{attachment.name} is too large to show again ({encoded_size / 1048576:.1f} MB as base64, "
            f"the limit is {MAX_IMAGE_BASE64 // 1048576} MB); ask the user to attach a smaller version"
        )
