"""The command-line client: talks to the daemon over its socket, like the canvas.

Each command sends one request and prints the events that answer it, readable
by default, or as the raw JSON lines with ``--json``.  ``ask`` streams the
reply as it comes; Ctrl-C sends ``cancel`` so the partial reply is kept.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from core.config import default_socket_path
from core.wire import DaemonGone, Wire

__all__ = ["add_client_commands", "run_client"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_NO_DAEMON = 2


# -- rendering ------------------------------------------------------------------------------


def _print_error(event: dict[str, Any], out: TextIO) -> None:
    print(f"error ({event.get('code')}): {event.get('message')}", file=out)


def _render_conversations(event: dict[str, Any], out: TextIO) -> None:
    items = event["items"]
    if not items:
        print("no conversations yet; start one with: assistant ask \"...\"", file=out)
    for item in items:
        print(f"{item['conversation']:>5}  {item['updated_at'][:16].replace('T', ' ')}  "
              f"{item['turns']:>3} turns  {item['title']}", file=out)


def _render_conversation(event: dict[str, Any], out: TextIO) -> None:
    print(f"# {event['title']}  (conversation {event['conversation']}, model {event['model'] or 'default'}, "
          f"context {event['ctx_used']}/{event['ctx_max'] or '?'})", file=out)
    for turn in event["turns"]:
        print(f"\n[{turn['turn']}] you: {turn['text']}", file=out)
        for chip in turn.get("files") or ():
            print(f"      file: {chip.get('name')} ({chip.get('kind')})", file=out)
        for tool in turn.get("tools") or ():
            print(f"      tool: {tool.get('name')} — {tool.get('summary')}", file=out)
        reply = turn["reply"] or ""
        status = turn.get("status")
        marker = "" if status == "complete" else f"  [{status}{': ' + turn['error'] if turn.get('error') else ''}]"
        print(f"[{turn['turn']}] assistant: {reply}{marker}", file=out)


def _render_models(event: dict[str, Any], out: TextIO) -> None:
    for item in event["items"]:
        star = "*" if item["id"] == event.get("default") else " "
        ctx = item["ctx_max"] or "?"
        print(f"{star} {item['id']}  ctx {ctx}  inputs {', '.join(item['input_modalities'])}", file=out)


def _render_status(event: dict[str, Any], out: TextIO) -> None:
    reach = "reachable" if event["router_reachable"] else "NOT reachable"
    print(f"assistant {event['version']}, up {event['uptime']:.0f}s, {event['turns_running']} turn(s) running", file=out)
    print(f"router {event['router_url']} ({reach}), model {event['model'] or '?'}", file=out)
    print(f"socket {event['socket']}, data {event['data_dir']}", file=out)


def _render_results(event: dict[str, Any], out: TextIO) -> None:
    if not event["conversations"]:
        print(f"nothing found for {event['query']!r}", file=out)
    for group in event["conversations"]:
        print(f"{group['conversation']:>5}  {group['title']}", file=out)
        for hit in group["hits"]:
            print(f"       [{hit['turn']}] {hit['role']}: {hit['excerpt']}", file=out)


def _render_kbs(event: dict[str, Any], out: TextIO) -> None:
    if not event["items"]:
        print("no knowledge bases yet; add one with: assistant kb add NAME PATH...", file=out)
    for kb in event["items"]:
        links = "every conversation" if kb["linked_all"] else f"{len(kb['conversations'])} conversation(s)"
        print(f"{kb['kb']}  {kb['documents']} documents, {kb['chunks']} chunks; linked to {links}", file=out)


def _render_kb(event: dict[str, Any], out: TextIO) -> None:
    line = f"{event['kb']}: {event['documents']} documents, {event['chunks']} chunks"
    if "added" in event:  # the result of kb_add
        line += f" ({event['added']} added, {event['updated']} updated, {event['unchanged']} unchanged)"
    print(line, file=out)
    for note in [*event.get("skipped", ()), *event.get("errors", ())]:
        print(f"  {note['path']}: {note['reason']}", file=out)
    if event.get("embedding_error"):
        print(f"  embeddings: {event['embedding_error']} (keyword search still works)", file=out)


RENDERERS = {
    "kbs": _render_kbs,
    "kb": _render_kb,
    "results": _render_results,
    "conversations": _render_conversations,
    "conversation": _render_conversation,
    "models": _render_models,
    "status": _render_status,
    "deleted": lambda e, out: print(f"deleted conversation {e['conversation']}", file=out),
}


# -- commands -------------------------------------------------------------------------------


async def _ask(client: Wire, args: argparse.Namespace, out: TextIO) -> int:
    request: dict[str, Any] = {"type": "ask", "text": " ".join(args.text)}
    if args.conversation is not None:
        request["conversation"] = args.conversation
    if args.model:
        request["model"] = args.model
    if args.file:
        request["files"] = [os.path.abspath(f) for f in args.file]
    rid = await client.send(request)
    conversation: int | None = None
    try:
        async for event in client.stream(rid):
            if args.json:
                print(json.dumps(event, ensure_ascii=False), file=out, flush=True)
            kind = event["type"]
            conversation = event.get("conversation", conversation)
            if kind == "delta" and not args.json:
                out.write(event["text"])
                out.flush()
            elif kind == "error":
                if not args.json:
                    _print_error(event, sys.stderr)
                return EXIT_ERROR
            elif kind == "done":
                if not args.json:
                    tail = "" if event["finish_reason"] in ("stop", None) else f"\n[{event['finish_reason']}]"
                    print(tail, file=out)
                    print(f"(conversation {event['conversation']}, turn {event['turn']}, "
                          f"context {event['ctx_used']}/{event['ctx_max'] or '?'})", file=sys.stderr)
                    if args.stats and event.get("timings"):
                        print(describe_timings(event["timings"]), file=sys.stderr)
                return EXIT_OK
    except asyncio.CancelledError:
        if conversation is not None:
            await client.send({"type": "cancel", "conversation": conversation})
        raise
    return EXIT_ERROR


def describe_timings(timings: dict[str, Any]) -> str:
    """The model server's own figures of one reply, for people: what it read, reused and wrote."""
    parts = []
    if timings.get("prompt_n") is not None:
        reused = timings.get("cache_n")
        prompt = f"prompt: {timings['prompt_n']} tokens read"
        if reused is not None:
            prompt += f", {reused} reused from the server's cache"
        if timings.get("prompt_ms") is not None:
            prompt += f" ({timings['prompt_ms'] / 1000:.2f} s)"
        parts.append(prompt)
    if timings.get("predicted_per_second") is not None:
        parts.append(f"reply: {timings['predicted_per_second']:.1f} tokens/s")
    return "(" + "; ".join(parts) + ")" if parts else "(the model server reported no timings)"


class ProgressBar:
    """One line on a terminal, redrawn in place: ``reading  [#####     ] 12/40``."""

    WIDTH = 30

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.shown = False

    def update(self, event: dict[str, Any]) -> None:
        if not self.stream.isatty():
            return
        done, total = event.get("done", 0), max(event.get("total", 0), 1)
        filled = self.WIDTH * min(done, total) // total
        bar = "#" * filled + " " * (self.WIDTH - filled)
        self.stream.write(f"\r{event.get('phase', ''):<9} [{bar}] {done}/{total} ")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")


async def _kb_add(client: Wire, args: argparse.Namespace, out: TextIO) -> int:
    paths = [os.path.abspath(p) for p in args.paths]
    rid = await client.send({"type": "kb_add", "kb": args.name, "paths": paths})
    bar = ProgressBar(getattr(sys.stderr, "raw", sys.stderr))  # it redraws its line with \r
    try:
        async for event in client.stream(rid):
            if args.json:
                print(json.dumps(event, ensure_ascii=False), file=out, flush=True)
            if event["type"] == "progress":
                bar.update(event)
                continue
            bar.close()
            if event["type"] == "error":
                _print_error(event, sys.stderr)
                return EXIT_ERROR
            if not args.json:
                _render_kb(event, out)
            return EXIT_OK
    finally:
        bar.close()
    return EXIT_ERROR


def _kb_request(args: argparse.Namespace) -> dict[str, Any]:
    if args.kb_command == "list":
        return {"type": "kb_list"}
    if args.kb_command == "remove":
        return {"type": "kb_remove", "kb": args.name}
    request: dict[str, Any] = {"type": "kb_link", "kb": args.name, "linked": not args.unlink}
    if args.conversation is not None:
        request["conversation"] = args.conversation
    return request


async def _latest_conversation(client: Wire) -> int | None:
    event = await client.request({"type": "conversations", "limit": 1})
    items = event.get("items") or []
    return items[0]["conversation"] if items else None


async def _simple(client: Wire, request: dict[str, Any], as_json: bool, out: TextIO) -> int:
    event = await client.request(request)
    if as_json:
        print(json.dumps(event, ensure_ascii=False), file=out)
        return EXIT_ERROR if event["type"] == "error" else EXIT_OK
    if event["type"] == "error":
        _print_error(event, sys.stderr)
        return EXIT_ERROR
    RENDERERS.get(event["type"], lambda e, o: print(json.dumps(e, indent=2), file=o))(event, out)
    return EXIT_OK


async def _run(args: argparse.Namespace, out: TextIO) -> int:
    path = Path(args.socket) if args.socket else default_socket_path(os.environ)
    client = await Wire.open(path, keep=False)
    try:
        if args.command == "ask":
            if args.new:
                args.conversation = None
            elif args.conversation is None and args.continue_:
                args.conversation = await _latest_conversation(client)
            return await _ask(client, args, out)
        if args.command == "kb":
            if args.kb_command == "add":
                return await _kb_add(client, args, out)
            return await _simple(client, _kb_request(args), args.json, out)
        request: dict[str, Any] = {"type": args.command}
        if args.command == "conversations":
            request["limit"] = args.limit
        elif args.command in ("open", "delete"):
            request["conversation"] = args.conversation_id
        elif args.command == "search":
            request.update(query=" ".join(args.words), limit=args.limit)
            if args.conversation is not None:
                request["conversation"] = args.conversation
        return await _simple(client, request, args.json, out)
    finally:
        await client.close()


def add_client_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the client's subcommands to the entry point's parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print the raw JSON events")
    common.add_argument("--socket", help="the daemon's socket (default: $ASSISTANT_SOCKET or the XDG path)")

    ask = sub.add_parser("ask", parents=[common], help="ask a question and stream the reply")
    ask.add_argument("text", nargs="+", help="the question")
    where = ask.add_mutually_exclusive_group()
    where.add_argument("-c", "--conversation", type=int, help="continue conversation N")
    where.add_argument("--new", action="store_true", help="start a new conversation (the default)")
    where.add_argument("--continue", dest="continue_", action="store_true", help="continue the latest conversation")
    ask.add_argument("-m", "--model", help="the model to use (default: the conversation's or the router's)")
    ask.add_argument("-f", "--file", action="append", help="attach a file (repeatable)")
    ask.add_argument("--stats", action="store_true",
                     help="after the reply, show what the model server read, reused from its cache and wrote")

    conversations = sub.add_parser("conversations", parents=[common], help="list conversations, newest first")
    conversations.add_argument("-n", "--limit", type=int, default=20)
    for name, text in (("open", "show a conversation"), ("delete", "delete a conversation")):
        cmd = sub.add_parser(name, parents=[common], help=text)
        cmd.add_argument("conversation_id", type=int, metavar="N")
    search = sub.add_parser("search", parents=[common], help="full-text search of your conversations")
    search.add_argument("words", nargs="+")
    search.add_argument("-c", "--conversation", type=int, help="only conversation N")
    search.add_argument("-n", "--limit", type=int, default=20)
    kb = sub.add_parser("kb", help="knowledge bases: add, list, remove, link")
    kb_sub = kb.add_subparsers(dest="kb_command", required=True)
    kb_add = kb_sub.add_parser("add", parents=[common], help="add files and folders to a knowledge base")
    kb_add.add_argument("name")
    kb_add.add_argument("paths", nargs="+")
    kb_sub.add_parser("list", parents=[common], help="list knowledge bases")
    kb_remove = kb_sub.add_parser("remove", parents=[common], help="remove a knowledge base")
    kb_remove.add_argument("name")
    kb_link = kb_sub.add_parser("link", parents=[common], help="link a knowledge base to conversations")
    kb_link.add_argument("name")
    kb_link.add_argument("-c", "--conversation", type=int, help="only conversation N (default: every conversation)")
    kb_link.add_argument("--unlink", action="store_true", help="undo the link")
    sub.add_parser("models", parents=[common], help="list the router's models")
    sub.add_parser("status", parents=[common], help="the daemon's and the router's state")


# C0 controls but newline and tab, DEL, and the C1 controls: shown as \xNN, never obeyed
CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)) if c not in (0x0A, 0x09)}


class Printable:
    """A text stream that shows terminal control characters instead of obeying them: a title,
    a file name or a reply with ESC, CR or NUL in it cannot recolour or rewrite the terminal."""

    def __init__(self, raw: TextIO) -> None:
        self.raw = raw

    def write(self, text: str) -> int:
        return self.raw.write(text.translate(CONTROLS))

    def flush(self) -> None:
        self.raw.flush()


def run_client(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    try:
        with contextlib.redirect_stderr(Printable(sys.stderr)):
            return asyncio.run(_run(args, Printable(out)))  # type: ignore[arg-type]
    except DaemonGone as exc:
        print(f"assistant: {exc}", file=sys.stderr)
        return EXIT_NO_DAEMON
    except KeyboardInterrupt:
        print("\n[cancelled]", file=sys.stderr)
        return EXIT_ERROR
