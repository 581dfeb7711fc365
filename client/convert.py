"""``assistant.py convert OPERATION FILE... [--option value]`` and ``assistant.py operations``.

The options are the operation's own (``--start 3 --width 320``), typed as the daemon's
``operations`` answer says, so the client knows none of them itself; ``--output-dir`` is the
request's folder. The paths written are printed on stdout, one a line; progress goes to
stderr. Ctrl-C sends ``cancel`` and the daemon removes what was half-written.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from .render import error_text, json_line
from .terminal import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, Interrupts, Terminal
from .wire import Wire

__all__ = ["add_convert_commands", "run_convert", "run_operations"]


class ConvertUsage(Exception):
    """A convert command line that cannot be sent (exit status 2)."""


def add_convert_commands(sub: Any, options: argparse.ArgumentParser) -> None:
    convert = sub.add_parser("convert", parents=[options], help="a file operation without a model (assistant.py "
                             "operations lists them), e.g. convert video_to_gif clip.mp4 --start 3 --width 320")
    convert.add_argument("operation")
    convert.add_argument("rest", nargs=argparse.REMAINDER, metavar="FILE... [--option VALUE] [--output-dir DIR]")
    sub.add_parser("operations", parents=[options], help="the file operations convert runs, with their options")


def convert_request(operation: str, rest: list[str], spec: dict[str, Any] | None) -> dict[str, Any]:
    """The ``convert`` request of a command line; ``spec``: the operation as ``operations`` lists it."""
    types = {option["name"]: option["type"] for option in (spec or {}).get("options", [])}
    files: list[str] = []
    options: dict[str, Any] = {}
    request: dict[str, Any] = {"type": "convert", "operation": operation}
    words = iter(rest)
    for word in words:
        if not word.startswith("--"):
            files.append(str(Path(word).expanduser().absolute()))
            continue
        name, _, value = word[2:].partition("=")
        value = value or next(words, "")
        if not value:
            raise ConvertUsage(f"--{name} needs a value")
        if name == "output-dir":
            request["output_dir"] = str(Path(value).expanduser().absolute())
        else:
            options[name.replace("-", "_")] = _typed(value, types.get(name.replace("-", "_")))
    if not files:
        raise ConvertUsage(f"convert {operation} needs at least one file")
    request.update(files=files, options=options)
    return request


def _typed(value: str, kind: str | None) -> Any:
    """A command-line value as the option's JSON type (left a string when it is not one)."""
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            return float(value)
    except ValueError:
        pass
    return value


async def run_operations(client: Wire, as_json: bool, terminal: Terminal) -> int:
    event = await client.request({"type": "operations"})
    if as_json or event["type"] == "error":
        terminal.out.write(json_line(event))
        return EXIT_ERROR if event["type"] == "error" else EXIT_OK
    return _describe(event["items"], terminal)


def _describe(items: list[dict[str, Any]], terminal: Terminal) -> int:
    for item in items:
        print(f"{item['name']} ({', '.join(item['kinds'])}): {item['description']}", file=terminal.out)
        for option in item["options"]:
            choices = f" ({', '.join(map(str, option['choices']))})" if "choices" in option else ""
            print(f"  --{option['name']} {option['type']}{choices}, default {option['default']!r}: "
                  f"{option['description']}", file=terminal.out)
    return EXIT_OK


async def run_convert(client: Wire, args: argparse.Namespace, terminal: Terminal) -> int:
    listed = await client.request({"type": "operations"})
    spec = next((item for item in listed.get("items", []) if item["name"] == args.operation), None)
    if {"-h", "--help"} & set(args.rest):  # after the operation: its own options
        return _describe([spec] if spec else listed.get("items", []), terminal)
    if "--json" in args.rest:  # the client's option, after the operation's name
        args.rest, args.json = [word for word in args.rest if word != "--json"], True
    rid = await client.send(convert_request(args.operation, args.rest, spec))
    ident: list[str] = []
    sent: list[asyncio.Future[Any]] = []

    def cancel() -> None:
        terminal.note("cancelling: what was half-written is removed (Ctrl-C again to stop waiting)")
        if ident:
            sent.append(asyncio.ensure_future(client.send({"type": "cancel", "convert": ident[0]})))

    with Interrupts(cancel) as interrupts:
        async for event in client.stream(rid):
            if args.json:
                terminal.out.write(json_line(event))
            if event["type"] == "progress":
                ident[:] = [event["convert"]]
                if not args.json:
                    total = f"/{event['total']:g}" if event["total"] is not None else ""
                    terminal.status(f"{event['operation']}: {event['done']:g}{total} {event['unit']}")
                continue
            terminal.clear_status()
            if event["type"] == "error":
                if not args.json:
                    terminal.note(f"assistant: {error_text(event)}")
                return EXIT_ERROR
            if event["cancelled"] or interrupts.count:
                return EXIT_INTERRUPTED
            if not args.json:
                print("\n".join(chip["path"] for chip in event["outputs"]), file=terminal.out)
            return EXIT_OK
    raise AssertionError("stream() ends only by raising")  # pragma: no cover
