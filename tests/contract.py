"""The protocol's contract, checked on every line the tests' clients send and read.

``docs/protocol.schema.json`` is what a client author codes against. ``watch`` wraps
``client.wire.Wire`` for one test (conftest's autouse ``protocol_contract``), so every
event any test reads through a ``Wire`` — the fixtures', a test's own, the command-line
client's run in-process — is checked against it:

- an event answering a request the test sent is checked against the events that may
  answer that request type (``answers.TYPE``), any other against ``event``;
- a request the schema rejects must be refused: its every answer is an ``error``;
- a request the schema accepts must not be refused as malformed (``bad_request``,
  ``unknown_type``), so the schema and the daemon agree on what a valid request is; but
  for an ask with a ``preset`` whose files, once read, are not of the preset's kinds
  (``files_misfit``): a schema cannot know a file's kind.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from client import Wire

__all__ = ["SCHEMA_PATH", "check_event", "check_request", "strict_json", "watch"]

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "docs" / "protocol.schema.json"
MALFORMED = ("bad_request", "unknown_type")  # refusals of a request the schema should reject too


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all distinct: a duplicate is an error (``json``'s default keeps
    the last one silently, where a strict parser refuses the whole file)."""
    seen = [key for key, _ in pairs]
    twice = sorted({key for key in seen if seen.count(key) > 1})
    if twice:
        raise ValueError(f"duplicate key(s) {', '.join(map(repr, twice))} in one object")
    return dict(pairs)


def strict_json(text: str) -> Any:
    """JSON text parsed as a strict parser would: no duplicate keys."""
    return json.loads(text, object_pairs_hook=unique_keys)


@cache
def schema() -> dict[str, Any]:
    loaded: dict[str, Any] = strict_json(SCHEMA_PATH.read_text())
    Draft202012Validator.check_schema(loaded)
    return loaded


@cache
def validator(definition: str) -> Draft202012Validator:
    """A validator of one of the schema's ``$defs`` (with the others for its references)."""
    whole = schema()
    if definition not in whole["$defs"]:
        raise AssertionError(f"docs/protocol.schema.json has no $defs/{definition}")
    return Draft202012Validator({"$schema": whole["$schema"], "$defs": whole["$defs"], "$ref": f"#/$defs/{definition}"})


@cache
def by_type(definition: str) -> dict[str, list[str]] | None:
    """The branches of ``$defs/definition`` by the event ``type`` each requires, when it is
    nothing but a ``oneOf`` of ``$ref``s that each require one (``event``, ``answers.*``);
    else None."""
    defs = schema()["$defs"]
    whole = defs[definition]
    if set(whole) - {"description", "oneOf"} or "oneOf" not in whole:
        return None
    branches: dict[str, list[str]] = {}
    for branch in whole["oneOf"]:
        name = branch.get("$ref", "").removeprefix("#/$defs/")
        kind = defs.get(name, {}).get("properties", {}).get("type", {}).get("const")
        if set(branch) != {"$ref"} or not isinstance(kind, str):
            return None
        branches.setdefault(kind, []).append(name)
    return branches


# (definition, JSON) of small values found to keep to it: a test reads the same deltas, statuses
# and answers many times over, and the verdict on a value never changes
KEPT: set[tuple[str, str]] = set()
KEPT_MAX_CHARS = 2000
KEPT_MAX = 100_000


def problem(definition: str, value: Any) -> str | None:
    """Why ``value`` breaks ``$defs/definition``, or None when it keeps to it."""
    try:
        text = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        text = None
    key = (definition, text) if text is not None and len(text) <= KEPT_MAX_CHARS else None
    if key in KEPT:
        return None
    why = _problem(definition, value)
    if why is None and key is not None:
        if len(KEPT) >= KEPT_MAX:
            KEPT.clear()
        KEPT.add(key)
    return why


def _problem(definition: str, value: Any) -> str | None:
    branches = by_type(definition)
    if branches is not None and isinstance(value, dict) and isinstance(value.get("type"), str):
        # a oneOf holds when exactly one branch does, and a branch requiring another type cannot:
        # checking the few of this type is the same verdict, without a pass through every branch
        candidates = branches.get(value["type"], [])
        if sum(validator(name).is_valid(value) for name in candidates) == 1:
            return None
    error = best_match(validator(definition).iter_errors(value))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "the top"
    return f"{error.message} (at {where})"


def check_event(event: dict[str, Any], request_type: str | None = None) -> None:
    """Fail unless ``event`` keeps to the schema (as an answer to ``request_type`` when known)."""
    definition = "event"
    if request_type is not None and f"answers.{request_type}" in schema()["$defs"]:
        definition = f"answers.{request_type}"
    why = problem(definition, event)
    if why is not None:
        raise AssertionError(f"event breaks docs/protocol.schema.json $defs/{definition}: {why}\n{json.dumps(event)[:2000]}")


def request_problem(request: dict[str, Any]) -> str | None:
    """Why ``request`` breaks the schema (checked as its own type when it names a known one)."""
    kind = request.get("type")
    definition = f"request.{kind}" if isinstance(kind, str) and f"request.{kind}" in schema()["$defs"] else "request"
    return problem(definition, request)


def check_request(request: dict[str, Any]) -> bool:
    """Whether ``request`` keeps to the schema's ``request``."""
    return request_problem(request) is None


# the events that come before the one that ends a request (docs/PROTOCOL.md, "Writing a client");
# a watch never ends, and a follow of a running turn goes on to that turn's done or error
STREAMED = frozenset({"user", "progress", "reasoning", "delta", "tool", "approval", "watching", "changed", "missed"})


def ends_request(event: dict[str, Any]) -> bool:
    """Whether ``event`` is the last one its request gets."""
    if event["type"] == "following":
        return event.get("turn") is None
    return event["type"] not in STREAMED


READING = ("extracting", "ocr")  # the progress of an ask's files being read, which may come before a refusal


def files_misfit(request: dict[str, Any], event: dict[str, Any]) -> bool:
    """Whether ``event`` refuses an ask's files as not of its preset's kinds (known once read)."""
    return (request.get("type") == "ask" and bool(request.get("preset")) and bool(request.get("files"))
            and event.get("code") == "bad_request" and "works on files of the kinds" in event.get("message", ""))


def _no_constant(name: str) -> Any:
    raise ValueError(name)


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


class Sent:
    """The requests one connection sent (``Wire.send``, or lines of ``Wire.send_raw``): type and
    schema validity by id."""

    def __init__(self) -> None:
        self.requests: dict[str, tuple[str | None, bool, dict[str, Any]]] = {}
        self.ended: set[str] = set()  # ids whose request has had its last event

    def add(self, request: dict[str, Any]) -> None:
        kind = request.get("type")
        self.requests[_key(request["id"])] = (kind if isinstance(kind, str) else None, check_request(request), request)
        self.ended.discard(_key(request["id"]))

    def add_raw(self, data: bytes) -> None:
        """The requests among raw lines: each JSON object with a ``type`` and an ``id`` (lines
        that are not JSON, or carry NaN or Infinity, are the daemon's to refuse unseen). Blank
        lines are passed over unparsed: none is a request, and a flood of them (a test sends
        millions) would cost a failed parse each."""
        for line in filter(bytes.strip, data.split(b"\n")):
            try:
                request = json.loads(line, parse_constant=_no_constant)
            except (ValueError, RecursionError):
                continue
            if isinstance(request, dict) and isinstance(request.get("type"), str) and "id" in request:
                self.add(request)

    def answered(self, event: dict[str, Any]) -> None:
        found = self.requests.get(_key(event["id"])) if "id" in event else None
        if found is None:
            check_event(event)
            return
        kind, valid, request = found
        key = _key(event["id"])
        assert key not in self.ended, (
            f"an event after the one that ended request {json.dumps(request)[:300]}: {json.dumps(event)[:300]}"
        )
        if ends_request(event):
            self.ended.add(key)
        if not valid:
            # refused: files are read (``progress: extracting``) before a file is refused
            refusal = event["type"] == "error" or (event["type"] == "progress" and event.get("stage") in READING)
            assert refusal, (
                f"the daemon accepted a request docs/protocol.schema.json rejects "
                f"({request_problem(request)}): {json.dumps(request)[:500]} -> {json.dumps(event)[:500]}"
            )
            check_event(event)
            return
        assert not (event["type"] == "error" and event.get("code") in MALFORMED and not files_misfit(request, event)), (
            f"the daemon refused a request docs/protocol.schema.json accepts: {json.dumps(request)[:500]} -> {event}"
        )
        check_event(event, kind)


def watch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Check every request sent and event read through any ``Wire`` until the test ends."""
    send, send_raw, read = Wire.send, Wire.send_raw, Wire.read

    def sent(wire: Wire) -> Sent:
        record: Sent | None = wire.__dict__.get("_contract")
        if record is None:
            record = wire.__dict__["_contract"] = Sent()
        return record

    async def checked_send(wire: Wire, request: dict[str, Any]) -> Any:
        rid = await send(wire, request)
        sent(wire).add({**request, "id": rid})
        return rid

    async def checked_send_raw(wire: Wire, data: bytes) -> None:
        sent(wire).add_raw(data)
        await send_raw(wire, data)

    async def checked_read(wire: Wire) -> dict[str, Any]:
        event = await read(wire)
        sent(wire).answered(event)
        return event

    monkeypatch.setattr(Wire, "send", checked_send)
    monkeypatch.setattr(Wire, "send_raw", checked_send_raw)
    monkeypatch.setattr(Wire, "read", checked_read)
