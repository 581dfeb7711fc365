"""The ``mcp`` subcommands: ``list`` is the client's ``mcp_servers`` request, run and shown
as the client runs and shows every other; ``serve`` runs ``mcpserve.server`` (imported
only then: the SDK is heavy), with the client's socket path and exit statuses."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from client import EXIT_OK, Terminal, guarded, run_client, socket_path

__all__ = ["add_mcp_commands", "run_mcp"]


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


def run_mcp(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Run one ``mcp`` subcommand; its exit status (the client's)."""
    if args.mcp_command == "list":
        return run_client(args, out, err)

    def serve() -> int:
        path = socket_path(args)  # a path that cannot be a socket's is told now, not at each call
        from .server import serve  # the SDK loads only to serve

        serve(path)
        return EXIT_OK

    return guarded(Terminal(out, err), serve)
