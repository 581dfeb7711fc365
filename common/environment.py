"""The environment both the daemon and its clients read: the socket's place, and the
``ASSISTANT_*`` variables there are.

``SETTINGS`` names the keys a user may set (each a field of ``core.config.Config``, and an
``ASSISTANT_<KEY>`` variable); ``unknown_variables`` warns of any other ``ASSISTANT_*``
variable, so that a misspelt one is told by the client as by the daemon.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path

from .limits import MAX_SOCKET_PATH

__all__ = [
    "OPENAI_KEY_FILE", "PATH_VARIABLES", "SETTINGS", "default_config_path", "default_data_dir", "default_socket_path",
    "missing_packages", "socket_path_problem", "unknown_variables",
]

# the keys a user may set, in the order Config declares them (tests/test_config.py holds the two together)
SETTINGS = (
    "router_url", "api_key", "model", "system_prompt", "ctx_max", "assumed_ctx", "max_reply_tokens",
    "embedding_model", "embedding_url", "kb_top_k", "recall_injection", "compact_at", "request_timeout",
    "connect_timeout",
    "image_tokens", "temperature", "top_p", "auto_title", "shutdown_grace", "approval_timeout", "openai_listen",
    "openai_key", "openai_max_messages", "openai_max_connections", "openai_max_unkeyed", "ocr_languages",
    "ocr_images", "output_dir", "convert_timeout", "convert_max_bytes", "gif_max_bytes", "memory", "memory_tokens",
    "watch_journal", "watch_journal_minutes",
)
# ASSISTANT_* variables that are not settings: the paths, and the demo's cache (scripts/llama.py)
PATH_VARIABLES = ("ASSISTANT_SOCKET", "ASSISTANT_DATA_DIR", "ASSISTANT_CONFIG", "ASSISTANT_CACHE_DIR")


def missing_packages(names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` this Python cannot import: the system ``python3`` outside the venv lacks
    the daemon's packages, and is told so in one line rather than by a traceback."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """A warning for each ``ASSISTANT_*`` variable that nothing reads, naming the closest known one
    (a misspelt ``ASSISTANT_ROUTERURL`` would otherwise be ignored without a word)."""
    known = [*PATH_VARIABLES, *(f"ASSISTANT_{key.upper()}" for key in SETTINGS)]
    warnings = []
    for var in sorted(v for v in env if v.startswith("ASSISTANT_") and v not in known):
        close = difflib.get_close_matches(var, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else f"; the settings are {', '.join(known)}"
        warnings.append(f"{var} is not a setting and is ignored{hint}")
    return warnings


OPENAI_KEY_FILE = "openai_key"  # under the data folder: the OpenAI door's generated key (mode 0600)


def default_data_dir(env: Mapping[str, str]) -> Path:
    """``$ASSISTANT_DATA_DIR``, else ``$XDG_DATA_HOME/assistant`` (``~/.local/share/assistant``)."""
    if env.get("ASSISTANT_DATA_DIR"):
        return Path(env["ASSISTANT_DATA_DIR"])
    base = env.get("XDG_DATA_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".local" / "share")
    return Path(base) / "assistant"


def default_config_path(env: Mapping[str, str]) -> Path:
    """``$ASSISTANT_CONFIG``, else ``$XDG_CONFIG_HOME/assistant/config.toml``."""
    if env.get("ASSISTANT_CONFIG"):
        return Path(env["ASSISTANT_CONFIG"])
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".config")
    return Path(base) / "assistant" / "config.toml"


def default_socket_path(env: Mapping[str, str]) -> Path:
    """``$ASSISTANT_SOCKET``, else ``$XDG_RUNTIME_DIR/assistant.sock``, else ``/tmp/assistant-$UID/``."""
    if env.get("ASSISTANT_SOCKET"):
        return Path(env["ASSISTANT_SOCKET"])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "assistant.sock"
    return Path(f"/tmp/assistant-{os.getuid()}") / "assistant.sock"


def socket_path_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a Unix socket's path (too long), or None."""
    size = len(os.fsencode(path))
    if size <= MAX_SOCKET_PATH:
        return None
    return (f"the socket path {path} is {size} bytes, over the {MAX_SOCKET_PATH} a Unix socket allows; "
            "set ASSISTANT_SOCKET to a shorter path")
