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
import stat
import sys

from client import Terminal, add_client_commands, add_client_options, guarded, run_client
from common import __version__, missing_packages, unknown_variables
from mcpserve import add_mcp_commands, run_mcp

logger = logging.getLogger("assistant")
EXIT_SETUP = 78  # the daemon's EXIT_STARTUP (core is not importable without its packages): not restarted


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
    doctor = sub.add_parser("doctor", help="check your set-up: configuration, daemon, model server, MCP, disk")
    add_client_options(doctor, suppress=True)
    return parser


# what serving, the self-check and ``mcp serve`` need beyond the standard library: a Python
# without them (the system ``python3`` outside the venv) gets one line saying what to run instead
NEEDED = {"serve": ("httpx", "h11"), "test": ("httpx", "h11"), "mcp serve": ("mcp",)}


def missing_setup(what: str) -> str | None:
    """One line for a Python that lacks what ``what`` needs, or None."""
    missing = missing_packages(NEEDED[what])
    if not missing:
        return None
    venv = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".venv", "bin", "python")
    return (f"assistant: {sys.executable} has no {', '.join(missing)} (the daemon's packages): run `make setup` "
            f"once, then use {venv} (or the venv's `assistant` command) instead of {os.path.basename(sys.executable)}")


# the options of the entry point itself, and those of them that take a value
GLOBAL_OPTIONS = {"--verbose", "-v", "--test", "--version", "--json", "--socket", "-q", "--quiet", "-h", "--help"}


def with_command(argv: list[str], commands: set[str]) -> list[str]:
    """llm's habit: a bare prompt is a question. ``assistant "what is a socket"`` and
    ``assistant -c "more"`` are ``ask``; so is no command at all with text piped in, unless
    systemd started it (the daemon's stdin is its own then)."""
    at = 0
    while at < len(argv) and (argv[at] in GLOBAL_OPTIONS or argv[at].startswith("--socket=")):
        at += 2 if argv[at] == "--socket" else 1
    if at < len(argv):
        return argv if argv[at] in commands or argv[at].startswith("-h") else [*argv[:at], "ask", *argv[at:]]
    if {"--test", "--version", "-h", "--help"} & set(argv) or os.environ.keys() & {"NOTIFY_SOCKET", "LISTEN_FDS"}:
        return argv
    try:
        mode = os.fstat(0).st_mode
    except OSError:
        return argv
    return [*argv, "ask"] if stat.S_ISFIFO(mode) or stat.S_ISREG(mode) else argv


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    commands = set(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)
    args = parser.parse_args(with_command(sys.argv[1:] if argv is None else argv, commands))
    need = "test" if args.test else "mcp serve" if args.command == "mcp" and args.mcp_command == "serve" else (
        "serve" if args.command in (None, "serve") else None)
    if need is not None and (problem := missing_setup(need)):
        print(problem, file=sys.stderr)
        return EXIT_SETUP
    if args.test:
        from selfcheck.checks import run_selfcheck

        return run_selfcheck(verbose=args.verbose)
    if args.command == "mcp":
        return run_mcp(args)
    if args.command == "doctor":
        from doctor import run_doctor

        return guarded(Terminal(sys.stdout, sys.stderr), lambda: run_doctor(args))  # Ctrl-C: 130, no traceback
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
        env = {**os.environ, "ASSISTANT_SOCKET": args.socket} if args.socket else os.environ
        config = load_config(env)
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runner.run(serve(config, lambda: load_config(env)))  # SIGHUP reads it again
    except (StartupError, ConfigError) as exc:
        logger.error("cannot start: %s", exc.message)
        return EXIT_STARTUP  # systemd does not restart it in a loop (RestartPreventExitStatus)
    except AssistantError as exc:
        logger.error("%s", exc.message)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
