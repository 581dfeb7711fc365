"""Knowledge bases: ingest, chunk, embed, hybrid search, auto-injection, the kb_search tool.

The daemon holds one ``KnowledgeBases(history, embedder, KbSettings(model, top_k))`` (the
embedder is any ``core.Embedder``: the daemon's router client, or a test's fake) and calls:

- ``await kbs.add(name, paths, progress)`` → ``AddResult`` (kb_add; ``progress`` gets
  ``KbProgress`` steps), ``list()``, ``get(name)``, ``remove(name)``,
  ``link(name, conversation | None, linked)`` → ``KbInfo``;
- ``await kbs.context_block(conversation, query, mode, ctx_used_estimate, ctx_max)`` →
  ``Injection`` per turn (docs/DESIGN.md), ``injection_mode(conversation.settings)`` for the
  mode;
- ``ArchiveRecall(history).recall(...)`` → ``Recall``: the conversation's own archive
  searched before a turn (archive.py), ``recall_mode(settings, default)`` for its mode;
- ``kbs.tool()`` → the ``kb_search`` tool for the Toolbox (``ToolContext.kb_injection``);
- ``await kbs.start()`` (optional: load the vectors at start) and ``await kbs.close()``.

It stands on ``history``, ``attachments`` (the extractors) and ``core`` (errors, token
estimates, the tool framework, the ``Embedder`` protocol). Inside, ``service.py`` is the
facade (search and injection too) over ``index.py`` (the vector index, kept in step) and
``pipeline.py`` (the add pipeline). Importing the package does not import numpy (index.py
says why); ``vectors`` is imported by the first code that needs it.
"""

from .archive import (
    DEFAULT_RECALL_MODE,
    RECALL_MODES,
    ArchiveRecall,
    Recall,
    RecallMode,
    recall_label,
    recall_mode,
)
from .chunking import CHUNK_CHARS, CHUNK_OVERLAP, Chunk, chunk_pages, chunk_text
from .embedder import QUERY_CACHE_SIZE, QUERY_TIMEOUT, RETRY_AFTER
from .ingest import FileNote
from .injection import (
    BLOCK_FOOTER,
    BLOCK_HEADER,
    CONTEXT_LIMIT,
    DEFAULT_INJECTION_MODE,
    INJECTION_MODES,
    Injection,
    InjectionMode,
    format_block,
    injection_mode,
)
from .records import AddResult, KbInfo, KbProgress, ProgressCallback
from .search import Hit, SearchMode, SearchResult, SimilarityKind
from .service import KbSettings, KnowledgeBases, kb_name
from .tool import KbSearch

__all__ = [
    "BLOCK_FOOTER",
    "BLOCK_HEADER",
    "CHUNK_CHARS",
    "CHUNK_OVERLAP",
    "CONTEXT_LIMIT",
    "DEFAULT_INJECTION_MODE",
    "DEFAULT_RECALL_MODE",
    "INJECTION_MODES",
    "QUERY_CACHE_SIZE",
    "QUERY_TIMEOUT",
    "RECALL_MODES",
    "RETRY_AFTER",
    "AddResult",
    "ArchiveRecall",
    "Chunk",
    "FileNote",
    "Hit",
    "Injection",
    "InjectionMode",
    "KbInfo",
    "KbProgress",
    "KbSearch",
    "KbSettings",
    "KnowledgeBases",
    "ProgressCallback",
    "Recall",
    "RecallMode",
    "SearchMode",
    "SearchResult",
    "SimilarityKind",
    "chunk_pages",
    "chunk_text",
    "format_block",
    "injection_mode",
    "kb_name",
    "recall_label",
    "recall_mode",
]
