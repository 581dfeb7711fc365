"""JSON text from outside (a client's line, a model's tool-call arguments), decoded strictly.

Python's json module reads more than JSON: ``NaN`` and ``Infinity``, a number too large
for a float (``1e400``, read as infinity), and a lone surrogate escape (``"\\ud800"``), which
is valid JSON but no text. None of these can be written back out as JSON or UTF-8 (an
event, a row in SQLite), so a value holding one is refused here, where it comes in.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["SURROGATE_ESCAPE", "strict_loads", "without_lone_surrogates"]

# where a lone surrogate can come from in JSON text: its escape (raw UTF-8 cannot carry one)
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# made once: json.loads and json.dumps with options make a new decoder or encoder per call
_DECODER = json.JSONDecoder(parse_constant=_no_constant)
_ECHO_CHECK = json.JSONEncoder(ensure_ascii=False, allow_nan=False)


def strict_loads(text: str) -> Any:
    """``text`` as a JSON value; ``ValueError`` (a ``UnicodeError`` for a lone surrogate) for
    what could not be written out again, ``RecursionError`` for nesting too deep."""
    value = _DECODER.decode(text)
    _ECHO_CHECK.encode(value).encode()
    return value


def without_lone_surrogates(value: Any) -> Any:
    """``value`` (decoded JSON) with each lone surrogate in its strings replaced by U+FFFD:
    what a server that cuts text between UTF-16 halves (a JavaScript one) sends can then be
    shown and stored (an emoji cut between two chunks shows as two U+FFFD)."""
    if isinstance(value, str):
        if _SURROGATE.search(value) is None:
            return value
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, dict):
        return {without_lone_surrogates(k): without_lone_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_lone_surrogates(v) for v in value]
    return value
