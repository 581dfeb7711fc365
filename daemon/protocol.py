"""The socket protocol: request validation and event encoding.

Every request is one JSON object on one line with a ``type``; each type has a
table of fields (``REQUESTS``) giving their JSON type and whether they must be
present.  Unknown fields are ignored, a field of the wrong type is a
``bad_request`` naming the field.  Events are JSON objects, one per line,
carrying back the request's ``id`` when it had one.  ``docs/PROTOCOL.md`` is the
reference the canvas is written against; keep the two in step.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from common import MAX_LIST_LIMIT, MAX_REQUEST_BYTES
from core.errors import BadRequest, UnknownType, listed
from core.jsontext import compact_json, strict_loads, without_lone_surrogates
from core.sampling import sampling_problem
from history import MAX_CONVERSATION_ID

from .events import error_event

__all__ = [
    "BARRIERS",
    "KB_INJECTION_MODES",
    "MAX_LINE_BYTES",
    "Encoded",
    "Request",
    "decode_line",
    "encode_event",
    "encode_list",
    "event_parts",
    "error_event",
    "request_id",
    "sequence_key",
    "validate",
]

logger = logging.getLogger(__name__)

MAX_LINE_BYTES = MAX_REQUEST_BYTES  # a request line over 1 MiB is refused (the client checks it too)
MAX_ID_CHARS = 256  # a request id, as JSON: ids are echoed on every event
KB_INJECTION_MODES = ("auto", "tool_only", "both", "off")
RECALL_MODES = ("auto", "tool_only", "off")  # recall_injection (kbinject/archive.py)
REMEMBER = ("once", "conversation")  # an approve's reach: this call, or the tool for the conversation's rest
MAX_SEARCH_OFFSET = 10_000  # a search ranks at most this many matches (history/search.py): none lie past it

FieldKind = Literal[
    "str", "int", "bool", "str_list", "str_or_null", "kb_mode", "limit", "timestamp", "str_list_or_null", "offset",
    "temperature", "top_p", "remember", "object", "recall_mode", "on_off", "seq",
]
# null means something (the default), not "absent"
NULLABLE = ("str_or_null", "str_list_or_null", "temperature", "top_p")

# Requests that change what later requests see: every later line on the connection waits
# until they are answered (docs/PROTOCOL.md, "Order"). ``ask`` and ``kb_add`` run long and
# hold nothing up; an ask claims its conversation before the next line is read.
BARRIERS = frozenset({"settings", "cancel", "delete", "kb_link", "kb_remove", "memory_add", "memory_edit",
                      "memory_forget"})
# Requests about one knowledge base run one after the other on a connection, in the order sent.
KB_SEQUENCED = frozenset({"kb_add", "kb_link", "kb_remove"})
# an ``updated_at`` as the daemon writes it (history.records.TIMESTAMP_FORMAT)
TIMESTAMP = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}Z")  # ASCII digits only


@dataclass(frozen=True)
class FieldSpec:
    """One field of a request: its JSON kind and whether it must be present."""

    kind: FieldKind
    required: bool = False


S = FieldSpec
# The requests this daemon serves and the fields each one reads.
REQUESTS: dict[str, dict[str, FieldSpec]] = {
    "ask": {"text": S("str"), "files": S("str_list"), "conversation": S("int"), "model": S("str"), "system": S("str"),
            "ref": S("str"), "preset": S("str"), "temperature": S("temperature"), "top_p": S("top_p"),
            "memory": S("on_off")},
    "cancel": {"conversation": S("int"), "kb": S("str"), "convert": S("str")},  # one of them (handlers.on_cancel)
    "conversations": {"limit": S("limit"), "before": S("timestamp")},
    # ``conversation``, or ``ref``: the turn whose ask carried it (handlers.on_open)
    "open": {"conversation": S("int"), "ref": S("str"), "turn": S("int"), "from_turn": S("int"), "limit": S("limit")},
    "delete": {"conversation": S("int", required=True)},
    "models": {},
    "estimate": {"text": S("str"), "files": S("str_list"), "conversation": S("int"), "model": S("str"),
                 "preset": S("str")},
    "settings": {
        "conversation": S("int", required=True),
        "kb_injection": S("kb_mode"),
        "recall_injection": S("recall_mode"),
        "title": S("str"),
        "model": S("str_or_null"),
        "system": S("str_or_null"),
        "mcp_servers": S("str_list_or_null"),
        "temperature": S("temperature"),  # null: the model's (core/sampling.py)
        "top_p": S("top_p"),
        "approved_tools": S("str_list_or_null"),  # tools approved for the conversation (daemon/approvals.py)
        "memory": S("on_off"),  # off: an incognito conversation (docs/MEMORY.md)
    },
    "search": {"query": S("str", required=True), "conversation": S("int"), "limit": S("limit"), "offset": S("offset")},
    "kb_add": {"kb": S("str", required=True), "paths": S("str_list", required=True)},
    "kb_list": {},
    "kb_remove": {"kb": S("str", required=True)},
    "kb_link": {"kb": S("str", required=True), "conversation": S("int"), "linked": S("bool")},
    "status": {},
    "config": {},
    "presets": {},  # the prompt presets offered for dropped files (core/presets.py)
    # MCP (docs/PROTOCOL.md, "MCP servers"): the hosted servers and their tools; a named KB searched
    "mcp_servers": {},
    "kb_search": {"kb": S("str", required=True), "query": S("str", required=True), "limit": S("limit")},
    # live state (docs/PROTOCOL.md, "Live state"): every change; a running turn joined
    "watch": {"since": S("seq")},  # the last change seen: those after it are sent first
    "follow": {"conversation": S("int", required=True)},
    # a person's answer to a call waiting for approval (docs/PROTOCOL.md, "Approval")
    "approve": {"conversation": S("int", required=True), "call": S("str", required=True),
                "allow": S("bool", required=True), "remember": S("remember")},
    # local file operations (docs/PROTOCOL.md, "File operations"; fileops/)
    "convert": {"operation": S("str", required=True), "files": S("str_list", required=True),
                "options": S("object"), "output_dir": S("str")},
    "operations": {},
    # saved memories (docs/PROTOCOL.md, "Memory")
    "memories": {},
    "memory_add": {"text": S("str", required=True)},
    "memory_edit": {"memory": S("int", required=True), "text": S("str", required=True)},
    "memory_forget": {"memory": S("int", required=True)},
    "memory_search": {"query": S("str", required=True), "limit": S("limit")},
}

_KIND_NAMES = {
    "str": "a string",
    "int": f"an integer from 1 to {MAX_CONVERSATION_ID}",
    "bool": "true or false",
    "str_list": "a list of strings",
    "str_or_null": "a string or null",
    "kb_mode": "one of " + ", ".join(KB_INJECTION_MODES),
    "recall_mode": "one of " + ", ".join(RECALL_MODES),
    "limit": f"an integer from 1 to {MAX_LIST_LIMIT}",
    "timestamp": "an updated_at from an earlier answer, such as \"2026-11-29T20:04:30.454753Z\"",
    "str_list_or_null": "a list of strings or null",
    "offset": f"an integer from 0 to {MAX_SEARCH_OFFSET}",
    "temperature": "a number from 0 to 2, or null",
    "top_p": "a number above 0 and at most 1, or null",
    "remember": "one of " + ", ".join(REMEMBER),
    "object": "a JSON object",
    "on_off": "one of on, off",
    "seq": "an integer from 0 (a watching or changed event's seq)",
}


@dataclass
class Request:
    """A validated request: its type, its ``id`` (if any) and its known fields.

    ``fault`` says what is wrong with the first field that is missing or of the wrong type
    (``invalid`` names it): the request is refused with a ``BadRequest`` saying it, by its
    handler, so that a refused ``ask`` still says which conversation and turn it concerned.
    """

    type: str
    id: Any = None
    args: dict[str, Any] = field(default_factory=dict)
    has_id: bool = False  # an ``"id": null`` is echoed too
    fault: str | None = None
    invalid: str | None = None
    received: float = field(default_factory=time.monotonic)  # when its line was read

    def get(self, name: str, default: Any = None) -> Any:
        return self.args.get(name, default)

    def has(self, name: str) -> bool:
        return name in self.args


def _valid(kind: FieldKind, value: Any) -> bool:
    if kind == "str":
        return isinstance(value, str)
    if kind == "int":  # the ids of conversations: SQLite rowids within the search index's layout
        return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_CONVERSATION_ID
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str_list":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == "str_or_null":
        return value is None or isinstance(value, str)
    if kind == "str_list_or_null":
        return value is None or _valid("str_list", value)
    if kind == "kb_mode":
        return value in KB_INJECTION_MODES
    if kind == "recall_mode":
        return value in RECALL_MODES
    if kind == "remember":
        return value in REMEMBER
    if kind == "object":
        return isinstance(value, dict)
    if kind == "on_off":
        return value in ("on", "off")
    if kind in ("temperature", "top_p"):
        return value is None or sampling_problem(kind, value) is None
    if kind == "limit":
        return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_LIST_LIMIT
    if kind == "timestamp":
        return isinstance(value, str) and TIMESTAMP.fullmatch(value) is not None
    if kind == "seq":  # a change's number (daemon/live.py): SQLite's integers at most
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63
    if kind == "offset":
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SEARCH_OFFSET
    raise AssertionError(kind)


def decode_line(line: bytes) -> dict[str, Any]:
    """Decode one request line into a JSON object, or raise ``BadRequest``."""
    try:
        # strictly: a lone surrogate (\ud800) or a number beyond a float (1e400) could not be echoed
        obj = strict_loads(line.decode(json.detect_encoding(line), "surrogatepass"))
    except (UnicodeError, ValueError) as exc:
        raise BadRequest(f"the line is not valid JSON text ({exc}); send one JSON object per line") from None
    except RecursionError:
        raise BadRequest("the line nests too deeply; send one flat JSON object per line") from None
    if not isinstance(obj, dict):
        raise BadRequest('a request must be a JSON object such as {"type": "status"}')
    return obj


def request_id(obj: dict[str, Any]) -> Any:
    """The request's ``id``, echoed on every event that answers it; ``BadRequest`` if too large
    (a large id would ride on every delta of a reply)."""
    value = obj.get("id")
    if value is not None and len(compact_json(value)) > MAX_ID_CHARS:
        raise BadRequest(f"the request's id is over {MAX_ID_CHARS} characters as JSON; use a short one, such as a number")
    return value


def _whole(kind: FieldKind, value: Any) -> Any:
    """An integer field's value written with a zero fraction (``50.0``, ``1e1``: JSON Schema's
    integers too) as the integer it is."""
    if kind in ("int", "limit", "offset") and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def validate(obj: dict[str, Any]) -> Request:
    """Check a decoded request against ``REQUESTS``: raise ``BadRequest`` for a request of no
    known type; a field at fault is the request's ``fault``, its valid fields are kept."""
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise BadRequest('the request has no "type"; see docs/PROTOCOL.md for the request types')
    spec = REQUESTS.get(kind)
    if spec is None:
        raise UnknownType(f"unknown request type {listed([repr(kind)])}; known types: {', '.join(REQUESTS)}")
    request = Request(type=kind, id=obj.get("id"), has_id="id" in obj)
    for name, fspec in spec.items():
        value = obj.get(name)
        fault = None
        if value is None and fspec.kind not in NULLABLE:
            # absent, or an explicit null, which reads as absent
            if fspec.required:
                fault = f"{kind}: the field {name!r} is required"
        elif name in obj and not _valid(fspec.kind, value := _whole(fspec.kind, value)):
            fault = f"{kind}: {name!r} must be {_KIND_NAMES[fspec.kind]}, not {json.dumps(value)[:60]}"
        elif name in obj:
            request.args[name] = value
        if fault is not None and request.fault is None:
            request.fault, request.invalid = fault, name
    return request


def sequence_key(request: Request) -> str | None:
    """What a request must wait for besides the ``BARRIERS``: earlier requests of the same key."""
    name = request.args.get("kb")
    if request.type in KB_SEQUENCED and isinstance(name, str):
        return "kb:" + name.strip()
    return None


@dataclass(frozen=True)
class Encoded:
    """A field's value as JSON already, in pieces (``encode_list``), put into its event as
    they are: the turns of a long conversation's ``open``, encoded turn by turn off the
    event loop and never joined into one copy."""

    parts: list[bytes]


def encode_json(value: Any) -> bytes:
    """A value as compact UTF-8 JSON (no ASCII escaping: the canvas reads UTF-8)."""
    text = compact_json(value)
    try:
        return text.encode()
    except UnicodeEncodeError:  # a lone surrogate from outside, not caught where it came in
        logger.warning("an event carried a lone surrogate; sent as U+FFFD")
        return encode_json(without_lone_surrogates(value))


def event_parts(event: dict[str, Any]) -> list[bytes]:
    """One event as a JSON line, in pieces: one, unless a field is ``Encoded`` (its own pieces
    then follow the field's name): a huge line is never copied whole, since each copy holds
    the event loop (``bench/bench_open.py``)."""
    if not any(isinstance(value, Encoded) for value in event.values()):
        return [encode_json(event) + b"\n"]
    parts = []
    for n, (key, value) in enumerate(event.items()):
        name = (b"," if n else b"{") + encode_json(key) + b":"
        if isinstance(value, Encoded):
            parts.append(name)
            parts += value.parts
        else:
            parts.append(name + encode_json(value))
    parts.append(b"}\n")
    return parts


def encode_event(event: dict[str, Any]) -> bytes:
    """One event as a JSON line."""
    return b"".join(event_parts(event))


def encode_list(items: Iterable[Any]) -> Encoded:
    """A list encoded item by item: a thread doing it lets the event loop in between (one
    ``json.dumps`` of the whole holds the GIL throughout)."""
    parts = [b"["]
    for item in items:
        parts += (encode_json(item), b",")
    parts[-1] = b"]" if len(parts) > 1 else b"[]"
    return Encoded(parts)
