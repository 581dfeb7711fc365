"""``assistant.py memory list|add|edit|forget``: the saved memories (docs/MEMORY.md).

Each subcommand is one request answered by one event (``commands._simple`` sends it); the
renderers here print the answers for a person.
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

__all__ = ["add_memory_commands", "memory_request", "render_memories", "render_memory"]


def add_memory_commands(sub: Any, options: argparse.ArgumentParser) -> None:
    """``memory`` and its subcommands, on the entry point's subparsers."""
    memory = sub.add_parser("memory", help="saved memories, kept across conversations: list, add, edit, forget")
    memory_sub = memory.add_subparsers(dest="memory_command", required=True)
    memory_sub.add_parser("list", parents=[options], help="list the saved memories, newest first")
    add = memory_sub.add_parser("add", parents=[options], help="save a memory (at most 500 characters)")
    add.add_argument("words", nargs="+", metavar="WORDS")
    edit = memory_sub.add_parser("edit", parents=[options], help="replace a memory's text")
    edit.add_argument("memory_id", type=int, metavar="N")
    edit.add_argument("words", nargs="+", metavar="WORDS")
    forget = memory_sub.add_parser("forget", parents=[options], help="delete a memory")
    forget.add_argument("memory_id", type=int, metavar="N")


def memory_request(args: argparse.Namespace) -> dict[str, Any]:
    """The request a ``memory`` subcommand sends."""
    command = args.memory_command
    if command == "list":
        return {"type": "memories"}
    if command == "add":
        return {"type": "memory_add", "text": " ".join(args.words)}
    if command == "edit":
        return {"type": "memory_edit", "memory": args.memory_id, "text": " ".join(args.words)}
    return {"type": "memory_forget", "memory": args.memory_id}


def _line(memory: dict[str, Any]) -> str:
    source = memory.get("source")
    where = f"conversation {source['conversation']}, turn {source['turn']}" if source else "added by you"
    return f"{memory['id']:>4}  {memory['text']}  ({memory['updated_at'][:10]}, {where})"


def render_memories(event: dict[str, Any], out: TextIO) -> None:
    items = event.get("items") or []
    if not items:
        print("no saved memories (add one with: assistant memory add WORDS)", file=out)
    for memory in items:
        print(_line(memory), file=out)


def render_memory(event: dict[str, Any], out: TextIO) -> None:
    memory = event["memory"]
    print(f"{event['action']} memory {memory['id']}: {memory['text']}", file=out)
