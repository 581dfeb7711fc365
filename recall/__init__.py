"""Model tools over a conversation's own past, token estimates and compaction.

- ``Toolbox`` with ``AttachmentRecall`` and ``ConversationSearch`` (seed 000 §1, §2): the
  daemon offers ``await toolbox.offer(ctx)``, and runs each call the model makes with
  ``await toolbox.call(offered, name, arguments, ctx)``, which never raises;
- compaction (seed 000 §3): ``plan_compaction``, ``summarize``, ``summary_message``;
- ``attachment_manifest``: the system-prompt block naming files no longer in the prompt;
- ``estimate_messages`` / ``estimate_text``: token estimates when the router gives none.

This package imports history and the daemon's errors and router types, never the turn
engine.
"""

from .attachment_recall import MAX_IMAGE_BASE64, PAGE_BREAK, PAGE_MARKER, AttachmentRecall, document_pages
from .budget import Budget, cut_text, fit_message
from .compaction import plan_compaction, summarize, summary_message, transcript
from .conversation_search import ConversationSearch
from .manifest import attachment_manifest
from .tokens import CHARS_PER_TOKEN, IMAGE_PART_TYPES, estimate_messages, estimate_text
from .toolbox import Tool, ToolContext, ToolError, ToolResult, Toolbox, error_result, json_content

__all__ = [
    "CHARS_PER_TOKEN",
    "IMAGE_PART_TYPES",
    "MAX_IMAGE_BASE64",
    "PAGE_BREAK",
    "PAGE_MARKER",
    "AttachmentRecall",
    "Budget",
    "ConversationSearch",
    "Tool",
    "ToolContext",
    "ToolError",
    "ToolResult",
    "Toolbox",
    "attachment_manifest",
    "default_toolbox",
    "document_pages",
    "cut_text",
    "error_result",
    "estimate_messages",
    "estimate_text",
    "fit_message",
    "json_content",
    "plan_compaction",
    "summarize",
    "summary_message",
    "transcript",
]


def default_toolbox() -> Toolbox:
    """The tools every turn may be offered, in the order they are offered."""
    return Toolbox([AttachmentRecall(), ConversationSearch()])
