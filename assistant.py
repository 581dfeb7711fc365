#!/usr/bin/env python3
"""assistant: a local AI assistant daemon and its command-line client.

    python3 assistant.py                 serve (the daemon, in the foreground)
    python3 assistant.py ask "question"  ask, streaming the reply (see --help)
    python3 assistant.py --test          end-to-end self-check against a fake router

This file only wires things together: serving goes to the daemon (its configuration,
logging, the server), every other command to the client (``client``, ``mcpserve``), which
never loads the daemon's modules.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from client import add_client_commands, add_client_options, run_client
from common import __version__, unknown_variables
from mcpserve import add_mcp_commands, run_mcp

logger = logging.getLogger("assistant")


class OneLine(logging.Formatter):
    """A record on one line, its traceback folded in: journald makes each line of stderr an
    entry of its own, and a traceback's lines would be read as unrelated events."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", " | ")


def setup_logging(verbose: bool) -> None:
    """One line per event on stderr; journald adds its own timestamps."""
    under_journald = bool(os.environ.get("JOURNAL_STREAM"))
    fmt = "%(levelname)s %(name)s: %(message)s" if under_journald else "%(asctime)s %(levelname)s %(name)s: %(message)s"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLine(fmt) if under_journald else logging.Formatter(fmt))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    logging.getLogger("httpx").setLevel(logging.DEBUG if verbose else logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.INFO if verbose else logging.WARNING)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="assistant", description=__doc__.split("\n\n")[0])
    parser.add_argument("--verbose", "-v", action="store_true", help="log debug details")
    parser.add_argument("--test", action="store_true", help="run the end-to-end self-check and exit")
    parser.add_argument("--version", action="version", version=f"assistant {__version__}")
    add_client_options(parser)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("serve", help="run the daemon in the foreground (the default)")
    add_client_commands(sub)
    add_mcp_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.test:
        from selfcheck.checks import run_selfcheck

        return run_selfcheck(verbose=args.verbose)
    if args.command == "mcp":
        return run_mcp(args)
    if args.command not in (None, "serve"):
        return run_client(args)
    return run_daemon(args)


def run_daemon(args: argparse.Namespace) -> int:
    """Serve in the foreground until stopped; the exit status."""
    setup_logging(args.verbose)
    # the daemon (its configuration, then httpx, Pillow, ...) loads only to serve: the client
    # needs the standard library alone
    from core import AssistantError, load_config
    from core.config import ConfigError
    from core.errors import EXIT_STARTUP, StartupError
    from daemon.server import new_event_loop, serve

    for warning in unknown_variables(os.environ):
        logger.warning("%s", warning)
    try:
        # --socket serves there, as it makes the client talk there
        config = load_config({**os.environ, "ASSISTANT_SOCKET": args.socket} if args.socket else None)
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runner.run(serve(config))
    except (StartupError, ConfigError) as exc:
        logger.error("cannot start: %s", exc.message)
        return EXIT_STARTUP  # systemd does not restart it in a loop (RestartPreventExitStatus)
    except AssistantError as exc:
        logger.error("%s", exc.message)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
