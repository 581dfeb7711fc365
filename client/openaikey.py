"""``assistant.py openai-key``: the key an OpenAI client sends to the daemon's OpenAI door.

Read where the daemon reads it, without the daemon: ``ASSISTANT_OPENAI_KEY``, else
``openai_key`` in the configuration file, else the key the daemon made at its first start
with ``openai_listen`` set (``openai_key`` in the data folder).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping

from common import OPENAI_KEY_FILE, default_config_path, default_data_dir

__all__ = ["openai_key"]


def openai_key(env: Mapping[str, str] = os.environ) -> str | None:
    """The door's key, or None when there is none yet."""
    if env.get("ASSISTANT_OPENAI_KEY"):
        return env["ASSISTANT_OPENAI_KEY"]
    try:
        with default_config_path(env).open("rb") as fh:
            configured = tomllib.load(fh).get("openai_key")
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        configured = None  # the daemon says what is wrong with its file
    if isinstance(configured, str) and configured:
        return configured
    try:
        return (default_data_dir(env) / OPENAI_KEY_FILE).read_text().strip() or None
    except OSError:
        return None
