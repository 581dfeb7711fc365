"""The ``mcp`` subcommands: ``list`` renders the daemon's ``mcp_servers``; ``serve`` runs
``mcpserve.server`` (imported only then: the SDK is heavy)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from core.config import default_socket_path
from core.wire import DaemonGone, Wire

__all__ = ["add_mcp_commands", "run_mcp", "socket_path"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_NO_DAEMON = 3  # as the client's (README, "Exit statuses")


def socket_path(args: argparse.Namespace) -> Path:
    return Path(args.socket) if getattr(args, "socket", None) else default_socket_path(os.environ)


def add_mcp_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``mcp list`` and ``mcp serve`` to the entry point's parser."""
    mcp = sub.add_parser("mcp", help="MCP: the servers the daemon hosts; serve your history to MCP clients")
    mcp_sub = mcp.add_subparsers(dest="mcp_command", required=True)
    listing = mcp_sub.add_parser("list", help="the MCP servers the daemon hosts, their state and tools")
    # SUPPRESS: given before ``mcp`` (the entry point's global options), they are kept
    listing.add_argument("--json", action="store_true", help="print the raw JSON event", default=argparse.SUPPRESS)
    serve = mcp_sub.add_parser("serve", help="speak MCP on stdio: your conversations and knowledge bases, read-only")
    for cmd in (listing, serve):
        cmd.add_argument("--socket", help="the daemon's socket (default: $ASSISTANT_SOCKET or the XDG path)",
                         default=argparse.SUPPRESS)


def render_servers(event: dict[str, Any], out: TextIO) -> None:
    servers = event["servers"]
    if not servers:
        print("no MCP servers configured; add [mcp.servers.NAME] to config.toml (see the README)", file=out)
    for server in servers:
        line = f"{server['name']}  {server['transport']}  {server['state']}"
        if server.get("last_error"):
            line += f"  ({server['last_error']})"
        print(line, file=out)
        for tool in server["tools"]:
            description = " ".join(tool["description"].split())
            if len(description) > 70:
                description = description[:69] + "…"
            print(f"    {tool['offered_as']:<40} {description}", file=out)


async def _list(args: argparse.Namespace, out: TextIO) -> int:
    wire = await Wire.open(socket_path(args), keep=False)
    try:
        event = await wire.request({"type": "mcp_servers"})
    finally:
        await wire.close()
    if getattr(args, "json", False):
        print(json.dumps(event, ensure_ascii=False), file=out)
    elif event["type"] == "error":
        print(f"error ({event.get('code')}): {event.get('message')}", file=sys.stderr)
    else:
        render_servers(event, out)
    return EXIT_ERROR if event["type"] == "error" else EXIT_OK


def run_mcp(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    try:
        if args.mcp_command == "serve":
            from .server import serve  # the SDK loads only to serve

            serve(socket_path(args))
            return EXIT_OK
        return asyncio.run(_list(args, out))
    except DaemonGone as exc:
        print(f"assistant: {exc}", file=sys.stderr)
        return EXIT_NO_DAEMON
    except KeyboardInterrupt:
        return EXIT_ERROR
