"""JSON at the daemon's edges.

- ``strict_loads``: JSON text from outside (a client's line, a model's tool-call arguments),
  decoded strictly. Python's json module reads more than JSON: ``NaN`` and ``Infinity``, a
  number too large for a float (``1e400``, read as infinity), and a lone surrogate escape
  (``"\\ud800"``), which is valid JSON but no text. None of these can be written back out as
  JSON or UTF-8 (an event, a row in SQLite), so a value holding one is refused where it comes in.
- ``without_lone_surrogates``: what the model server sends, made text (U+FFFD for a lone half).
- ``json_body``: a request's body as JSON in pieces: long data URLs, and the messages a
  prompt replays (``EncodedPrefix``, encoded once when their turn was first replayed), are
  put in as bytes instead of going through the JSON encoder again on every turn
  (``bench/bench_body.py``).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SURROGATE_ESCAPE", "EncodedPrefix", "compact_json", "encode_message", "json_body", "strict_loads",
    "without_lone_surrogates",
]

# where a lone surrogate can come from in JSON text: its escape (raw UTF-8 cannot carry one)
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# made once: json.loads and json.dumps with options make a new decoder or encoder per call
_DECODER = json.JSONDecoder(parse_constant=_no_constant)
_ECHO_CHECK = json.JSONEncoder(ensure_ascii=False, allow_nan=False)
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def compact_json(value: Any) -> str:
    """``value`` as compact JSON, UTF-8 as it is (an event, a request's body); ``ValueError``
    for NaN or Infinity, which are not JSON (a JavaScript client cannot read them)."""
    return _COMPACT.encode(value)


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


# A data URL is sent as it is once it is this long: its base64 needs no JSON escaping, and
# encoding it again on every turn is the most of a request's cost with photos attached
SPLICE_MIN = 64 * 1024


# Stands in a body for what is put in as bytes: no data URL holds it, and no text can but by
# chance (2^-64), since it is drawn anew by each process and never shown
_MARKER = f"\x00{secrets.token_hex(8)}\x00"
_QUOTED_MARKER = compact_json(_MARKER)


@dataclass(frozen=True, slots=True)
class EncodedPrefix:
    """A prompt's first ``count`` messages as compact JSON made earlier, joined by commas."""

    count: int
    json: bytes


def encode_message(message: dict[str, Any]) -> bytes:
    """One message as ``json_body`` writes it: compact UTF-8 JSON."""
    return compact_json(message).encode()


def json_body(body: dict[str, Any], encoded: EncodedPrefix | None = None) -> list[bytes]:
    """``body`` as compact UTF-8 JSON (as httpx's ``json=`` writes it), in parts: ``encoded``
    in place of the first messages it stands for, and each long data URL of the other
    messages' image parts its own bytes. ``b"".join`` of them is the JSON text."""
    spliced: list[tuple[bytes, bool]] = []  # in the body's order: the bytes, and whether they are a string's
    messages = body.get("messages")
    if isinstance(messages, list):
        ahead: list[Any] = []
        if encoded is not None and encoded.count:
            spliced.append((encoded.json, False))
            ahead.append(_MARKER)
            messages = messages[encoded.count:]
        body = {**body, "messages": [*ahead, *(_with_url_markers(m, spliced) for m in messages)]}
    pieces = compact_json(body).split(_QUOTED_MARKER)  # each marker, quoted, where its bytes go
    parts = [pieces[0].encode()]
    for (data, string), piece in zip(spliced, pieces[1:], strict=True):
        if string:
            parts[-1] += b'"'
            parts += [data, b'"' + piece.encode()]
        else:
            parts += [data, piece.encode()]
    return parts


def _with_url_markers(message: Any, spliced: list[tuple[bytes, bool]]) -> Any:
    """The message with each long data URL of its image parts the marker (its bytes noted
    in ``spliced``)."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message  # text alone: as it is, not copied
    parts = []
    for part in content:
        image = part.get("image_url") if isinstance(part, dict) else None
        url = image.get("url") if isinstance(image, dict) else None
        if (
            isinstance(image, dict) and isinstance(url, str) and len(url) >= SPLICE_MIN
            and url.startswith("data:") and url.isascii()
        ):
            encoded = url.encode("ascii")
            if not encoded.translate(None, _AS_IS):  # nothing JSON would escape (a data URL's base64)
                spliced.append((encoded, True))
                part = {**part, "image_url": {**image, "url": _MARKER}}
        parts.append(part)
    return {**message, "content": parts}


# the printable ASCII that JSON writes as it is; translate(None, _AS_IS) leaves what it would not
_AS_IS = bytes(range(0x20, 0x7F)).replace(b'"', b"").replace(b"\\", b"")
