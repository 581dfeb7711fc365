"""The attachment manifest: what attachment_recall can fetch, named in the system prompt.

Once a file's turn has been folded into a compaction's summary, the model no longer
knows the file existed, and a tool it has no reason to call goes unused. The manifest
lists those files (name, kind, pages, id) so the model can ask for them: a video or a sound file
by what its stored line says (duration, size in pixels), an image or a text by its kind and size. It depends on
the compaction alone, so the system message it is part of stays the same bytes until the
next compaction, whenever and however often it is built (after a restart too): a file of
a later turn that was never answered is not named in it (``action='list'`` shows it).
"""

from __future__ import annotations

from collections.abc import Sequence

from attachments import DOCUMENT_FORMATS, PAGE_UNITS, video_facts_said
from core.files import size_label
from history import Attachment

__all__ = ["MANIFEST_HEADER", "MAX_MANIFEST_FILES", "attachment_manifest"]

MANIFEST_HEADER = (
    "Files attached earlier in this conversation, no longer shown here in full. "
    "Read any of them again with the attachment_recall tool "
    "(action='read', attachment_id=ID):"
)
MAX_MANIFEST_FILES = 50  # the newest; the tool's action='list' shows them all
# kinds stored with a line of their facts (attachments/video.py): a video, file_convert's sound files
LINED_KINDS = ("video", "audio")


def _describe(attachment: Attachment) -> str:
    if attachment.kind == "pdf":
        pages = attachment.pages
        kind = f"PDF, {pages} page{'s' if pages != 1 else ''}" if pages else "PDF"
        if not attachment.has_text and pages:  # read and found bare (file_convert's PDFs are not read)
            kind += ", no text layer"
    elif attachment.kind in DOCUMENT_FORMATS:
        kind = DOCUMENT_FORMATS[attachment.kind]
        if (unit := PAGE_UNITS.get(attachment.kind)) and attachment.pages:
            kind += f", {attachment.pages} {unit}{'s' if attachment.pages != 1 else ''}"
    elif attachment.kind == "image":
        kind = f"image, {attachment.content_type}"
    elif attachment.kind in LINED_KINDS:  # "video, 0:02, 160x120, 33.1 kB", "audio, 0:02, 33.1 kB"
        line = attachment.video_line
        kind = video_facts_said(line) if line else f"{attachment.kind}, {size_label(attachment.size_bytes)}"
    else:
        kind = f"text, {attachment.size_bytes:,} bytes"
    return f"- id {attachment.id}: {attachment.name} ({kind}; turn {attachment.turn})"


def attachment_manifest(attachments: Sequence[Attachment], through_turn: int) -> str | None:
    """The system-prompt block naming the attachments of the turns a compaction folded (up to
    ``through_turn``); None when they had none."""
    missing = [a for a in attachments if a.turn <= through_turn]
    if not missing:
        return None
    shown = missing[-MAX_MANIFEST_FILES:]
    lines = [MANIFEST_HEADER, *(_describe(a) for a in shown)]
    if len(missing) > len(shown):
        lines.append(f"(and {len(missing) - len(shown)} older ones: action='list' shows them all)")
    return "\n".join(lines)
