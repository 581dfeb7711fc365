"""A tool call's arguments checked against the tool's JSON Schema before the tool runs.

Servers do not check what a model puts in a call (llama-server parses the call and
passes it on), and small models send an object where a string belongs, junk in an
optional enum, or a required field left out. ``check_arguments`` finds the first such
mismatch and names its field, so the model reads one plain sentence and can call again.

It reads the part of JSON Schema that tool definitions use: ``type`` (one or a list),
``properties``, ``required``, ``enum``, ``items``, ``additionalProperties: false``,
``minimum``/``maximum``. Other keywords (``anyOf``, ``$ref``, formats, ...) are left to
the tool, which still refuses what it cannot serve. It is lenient where a model's slip
has one meaning: a numeric string or an integral float for an integer (as the tools'
own ``integer_argument`` reads them), ``null`` for an optional field (left out), and
keys the schema does not name unless it forbids them. What it accepts it returns with
those values converted, so a hosted tool gets the types it declared.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["ArgumentMismatch", "check_arguments"]

MAX_QUOTED = 80  # characters of a wrong value quoted back to the model
JSON_TYPES = {
    "string": str, "object": dict, "array": list, "boolean": bool,
}


class ArgumentMismatch(ValueError):
    """The arguments do not fit the schema; the message names the field and says what it takes."""


def check_arguments(schema: Any, arguments: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` checked against the tool's ``parameters`` schema, with lenient conversions
    applied; ``ArgumentMismatch`` on the first field that does not fit."""
    if not isinstance(schema, dict):
        return arguments
    checked = _value(schema, arguments, "")
    return checked if isinstance(checked, dict) else arguments


def _quote(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= MAX_QUOTED else text[: MAX_QUOTED - 1] + "…"


def _value(schema: dict[str, Any], value: Any, path: str) -> Any:
    """``value`` checked against ``schema`` at ``path`` (dotted; "" for the arguments object)."""
    kinds = schema.get("type")
    names = [kinds] if isinstance(kinds, str) else [k for k in kinds or () if isinstance(k, str)]
    if names:
        value = _typed(names, value, path)
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and value not in enum:
        choices = ", ".join(str(choice) for choice in enum)
        raise ArgumentMismatch(f"{path} must be one of: {choices}; not {_quote(value)}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _in_range(schema, value, path)
    if isinstance(value, dict) and isinstance(schema.get("properties"), dict):
        return _object(schema, value, path)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_value(schema["items"], item, f"{path}[{i}]") for i, item in enumerate(value)]
    return value


def _typed(names: list[str], value: Any, path: str) -> Any:
    """``value`` as one of the JSON types ``names``, converting a model's usual slips."""
    for name in names:
        converted = _as_type(name, value)
        if converted is not None or (name == "null" and value is None):
            return converted
    wanted = " or ".join(_article(name) for name in names)
    what = path or "the arguments"
    raise ArgumentMismatch(f"{what} must be {wanted}, not {_quote(value)}")


def _article(name: str) -> str:
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _as_type(name: str, value: Any) -> Any:
    """``value`` as JSON type ``name``, or None when it is not one (nor plainly meant as one)."""
    if name == "integer":
        if isinstance(value, bool):
            return None
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                return None
        return None
    if name == "number":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                return None
            return number if math.isfinite(number) else None
        return None
    kind = JSON_TYPES.get(name)
    if kind is None:
        return value if name != "null" else None  # a type we do not know is the tool's to check
    return value if isinstance(value, kind) and not (kind is not bool and isinstance(value, bool)) else None


def _in_range(schema: dict[str, Any], value: float, path: str) -> None:
    low, high = schema.get("minimum"), schema.get("maximum")
    if isinstance(low, (int, float)) and value < low:
        raise ArgumentMismatch(f"{path} must be at least {low}, not {_quote(value)}")
    if isinstance(high, (int, float)) and value > high:
        raise ArgumentMismatch(f"{path} must be at most {high}, not {_quote(value)}")


def _object(schema: dict[str, Any], value: dict[str, Any], path: str) -> dict[str, Any]:
    """An object's fields checked: required ones present, known ones fitting, unknown ones allowed
    unless ``additionalProperties`` is false."""
    properties: dict[str, Any] = schema["properties"]
    required = [name for name in schema.get("required") or () if isinstance(name, str)]
    prefix = f"{path}." if path else ""
    checked: dict[str, Any] = {}
    for key, item in value.items():
        if item is None:
            continue  # a model's way of leaving a field out (a required one is then missing)
        field = properties.get(key)
        if isinstance(field, dict):
            checked[key] = _value(field, item, prefix + key)
        elif schema.get("additionalProperties") is False:
            known = ", ".join(properties) or "none"
            raise ArgumentMismatch(f"{prefix}{key} is not an argument of this tool; its arguments are: {known}")
        else:
            checked[key] = item
    missing = [name for name in required if checked.get(name) is None]
    if missing:
        field = properties.get(missing[0])
        about = field.get("description") if isinstance(field, dict) else None
        hint = f" ({about})" if isinstance(about, str) and about else ""
        raise ArgumentMismatch(f"{prefix}{missing[0]} is required{hint}")
    return checked
