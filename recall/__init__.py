"""Model tools over a conversation's own past, and compaction.

- ``AttachmentRecall`` and ``ConversationSearch`` for a ``core.tools.Toolbox``: the
  daemon offers ``await toolbox.offer(ctx)``, and runs each call the model makes with
  ``await toolbox.call(offered, name, arguments, ctx)``, which never raises;
- compaction (docs/DESIGN.md, "Compaction"): ``plan_compaction``, ``summarize``, ``summary_message``;
- ``attachment_manifest``: the system-prompt block naming files no longer in the prompt.

It stands on ``history``, ``attachments`` and ``core``; compaction takes a
``core.Completer`` (the daemon's router client, or a test's fake model).
"""

from attachments import ImageCache
from core.tools import Toolbox

from .attachment_recall import MAX_IMAGE_BASE64, AttachmentRecall, document_pages
from .compaction import (
    IN_PLACE_REQUEST,
    plan_compaction,
    summarize,
    summarize_in_place,
    summary_message,
    transcript,
)
from .conversation_search import ConversationSearch
from .manifest import attachment_manifest

__all__ = [
    "IN_PLACE_REQUEST",
    "MAX_IMAGE_BASE64",
    "AttachmentRecall",
    "ConversationSearch",
    "attachment_manifest",
    "default_toolbox",
    "document_pages",
    "plan_compaction",
    "summarize",
    "summarize_in_place",
    "summary_message",
    "transcript",
]


def default_toolbox(images: ImageCache) -> Toolbox:
    """The tools every turn may be offered, in the order they are offered; ``images``: the
    daemon's image cache, which shows an image attached earlier again. The search first: it is
    offered in every conversation, so a small context holds it before the others
    (``Toolbox.fitting``), and a file's ``attachment_recall`` appears after it in the list."""
    return Toolbox([ConversationSearch(), AttachmentRecall(images)])
