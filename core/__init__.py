"""The ground floor: what every layer of the daemon shares, importing nothing of ours but ``common``.

- ``errors``: the error tree, each error with a stable ``code``;
- ``config``: the one frozen ``Config``, from file and environment;
- ``tokens`` and ``budget``: token estimates, and how a context is shared between
  prompt and reply;
- ``files``: checking and safely opening a path a client names;
- ``process``: the tools run on files (poppler, tesseract, ffmpeg), each in a process group
  of its own, imported as ``core.process`` where used;
- ``tools``: the framework of the model's tools (``Tool``, ``Toolbox``, ``ToolContext``);
- ``seams``: the small protocols lower packages take instead of the daemon's classes
  (a ``Completer`` for compaction, an ``Embedder`` for knowledge bases);
- ``router`` and ``sse``: the client of the OpenAI-compatible model server and its
  stream parser. They load httpx, so they are imported as ``core.router`` where used,
  not from here: importing ``core`` stays light.

Below this floor: ``common`` (what the daemon and its clients both know). Above it:
``history`` (the SQLite store), then ``attachments``, ``recall`` and ``kbinject``, then
``daemon``, then ``assistant.py``; no package imports one above it. The command-line
``client`` stands on ``common`` alone, beside this floor, not on it.
"""

from common import __version__, default_socket_path

from .budget import MIN_TOOLS_CONTEXT, Budget, cut_text, fit_message, replay_marker
from .config import Config, ConfigError, load_config
from .errors import AssistantError
from .seams import Completer, Embedder, ImageReader
from .tokens import (
    BUDGET_CHARS_PER_TOKEN,
    CHARS_PER_TOKEN,
    DEFAULT_IMAGE_TOKENS,
    IMAGE_PART_TYPES,
    estimate_messages,
    estimate_text,
    estimate_tools,
)

__all__ = [
    "MIN_TOOLS_CONTEXT",
    "BUDGET_CHARS_PER_TOKEN",
    "CHARS_PER_TOKEN",
    "DEFAULT_IMAGE_TOKENS",
    "IMAGE_PART_TYPES",
    "AssistantError",
    "Budget",
    "Completer",
    "ImageReader",
    "Config",
    "ConfigError",
    "Embedder",
    "__version__",
    "cut_text",
    "default_socket_path",
    "estimate_messages",
    "estimate_text",
    "estimate_tools",
    "fit_message",
    "replay_marker",
    "load_config",
]
