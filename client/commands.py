"""The command-line client: talks to the daemon over its socket, like the canvas.

Each command sends its request and prints the events that answer it: readable by
default, or the raw JSON lines with ``--json``. ``ask`` and ``chat`` stream the reply to
stdout and everything else to stderr (``terminal``); text piped in is part of the
question. Ctrl-C sends ``cancel``, so a partial reply (or the files a ``kb add`` stored)
is kept.

Exit statuses: 0 done, 1 the daemon answered with an error, 2 a usage error, 3 no daemon
answers (or the socket path cannot be one), 130 stopped by Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO, TypeAlias

from common import MAX_LIST_LIMIT, default_socket_path, socket_path_problem, unknown_variables

from .approve import Approver
from .convert import ConvertUsage, add_convert_commands, run_convert, run_operations
from .openaikey import openai_key
from .render import RENDERERS, describe_kb_add, error_text, json_line
from .terminal import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_NO_DAEMON,
    EXIT_OK,
    EXIT_USAGE,
    Interrupts,
    ProgressBar,
    Terminal,
    piped_stdin,
)
from .memory import add_memory_commands, memory_request
from .turn import Refused, Turn, chosen_conversation, compose_question, file_paths, latest_conversation, set_system
from .wire import DaemonGone, Unsendable, Wire

__all__ = ["add_client_commands", "add_client_options", "connect", "guarded", "run_client", "socket_path"]


# the entry point's subcommands, which each command joins
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class UsageError(Exception):
    """A command line that cannot be sent (exit status 2)."""


# -- commands ---------------------------------------------------------------------------------


async def _ask(client: Wire, args: argparse.Namespace, terminal: Terminal) -> int:
    files = file_paths(args.file)
    request: dict[str, Any] = {"type": "ask", "text": args.question}
    conversation = None if args.new else await chosen_conversation(client, args)
    if conversation is not None:
        request["conversation"] = conversation
        if args.system is not None and not await set_system(client, conversation, args.system, terminal):
            return EXIT_ERROR
    elif args.system is not None:
        request["system"] = args.system
    if args.incognito:
        if conversation is not None:
            raise UsageError(f"--incognito starts a new conversation; for conversation {conversation} use: "
                             f"assistant settings {conversation} --memory off")
        request["memory"] = "off"  # neither reads saved memories nor is read by memory search
    if args.model:
        request["model"] = args.model
    if files:
        request["files"] = files
    if args.preset:
        request["preset"] = args.preset
    request.update(args.options)
    approver = Approver(terminal, approve_all=args.approve_all, approve=args.approve or ())
    turn = Turn(client, terminal, as_json=args.json, stream=not (args.no_stream or args.extract), stats=args.stats,
                extract=args.extract, approver=approver)
    return await turn.run(request)


MODEL_OPTIONS = ("temperature", "top_p")  # what ``-o KEY VALUE`` may set (the daemon checks the ranges)


def model_options(pairs: list[list[str]] | None) -> dict[str, float | None]:
    """``-o KEY VALUE``s as request fields; ``default`` as a value is null (the setting's default)."""
    options: dict[str, float | None] = {}
    for key, value in pairs or ():
        key = key.replace("-", "_")
        if key not in MODEL_OPTIONS:
            raise UsageError(f"-o {key}: not a model option; the options are {', '.join(MODEL_OPTIONS)}")
        try:
            options[key] = None if value == "default" else float(value)
        except ValueError:
            raise UsageError(f"-o {key} {value}: give a number (or default)") from None
    return options


# -- other requests ---------------------------------------------------------------------------


async def _kb_add(client: Wire, args: argparse.Namespace, terminal: Terminal) -> int:
    kb = args.name
    rid = await client.send({"type": "kb_add", "kb": kb, "paths": file_paths(args.paths)})
    bar = ProgressBar(terminal)

    sent: list[asyncio.Future[Any]] = []

    def cancel() -> None:
        terminal.note("cancelling: the files being read are finished and kept (Ctrl-C again to stop waiting)")
        sent.append(asyncio.ensure_future(client.send({"type": "cancel", "kb": kb})))

    with Interrupts(cancel) as interrupts:
        async for event in client.stream(rid):
            if args.json:
                terminal.out.write(json_line(event))
            if event["type"] == "progress":
                if not args.json:
                    bar.update(event)
                continue
            terminal.clear_status()
            if event["type"] == "error":
                if not args.json:
                    terminal.note(f"assistant: {error_text(event)}")
                return EXIT_ERROR
            if not args.json:
                print("\n".join(describe_kb_add(event)), file=terminal.out)
            if event.get("cancelled") or interrupts.count:
                return EXIT_INTERRUPTED
            if event["added"] + event["updated"] + event["unchanged"] == 0:
                reasons = dict.fromkeys(n["reason"] for n in (event.get("skipped") or []) + (event.get("errors") or []))
                terminal.note(f"assistant: nothing was added: {'; '.join(reasons) or 'the paths hold no files'}")
                return EXIT_ERROR
            return EXIT_OK
    raise AssertionError("stream() ends only by raising")  # pragma: no cover


def _kb_request(args: argparse.Namespace) -> dict[str, Any]:
    if args.kb_command == "list":
        return {"type": "kb_list"}
    if args.kb_command == "remove":
        return {"type": "kb_remove", "kb": args.name}
    if args.kb_command == "search":
        search: dict[str, Any] = {"type": "kb_search", "kb": args.name, "query": " ".join(args.query)}
        if args.limit is not None:
            search["limit"] = args.limit
        return search
    return {"type": "kb_link", "kb": args.name, "linked": not args.unlink}


async def _kb_link_request(client: Wire, args: argparse.Namespace) -> dict[str, Any]:
    """``kb link``: conversation N (``--cid``), every conversation (``--all``), else the latest."""
    request = _kb_request(args)
    if args.all:
        return request
    request["conversation"] = args.cid if args.cid is not None else await latest_conversation(client)
    if request["conversation"] is None:
        raise UsageError("there are no conversations to link yet; ask a question first, or link to all with --all")
    return request


async def _settings_request(client: Wire, args: argparse.Namespace) -> dict[str, Any]:
    request: dict[str, Any] = {"type": "settings", "conversation": args.conversation_id}
    if args.revoke_all:
        request["approved_tools"] = []
    elif args.revoke:  # the list less those named: the rest stay approved
        shown = await client.request({"type": "settings", "conversation": args.conversation_id})
        if shown["type"] == "error":
            raise Refused(shown)
        approved = (shown.get("settings") or {}).get("approved_tools") or []
        request["approved_tools"] = [name for name in approved if name not in args.revoke]
    for key, value, to_default in (("title", args.title, False), ("kb_injection", args.kb, False),
                                   ("recall_injection", args.recall, False),
                                   ("model", args.model, args.default_model),
                                   ("system", args.system, args.default_system), ("memory", args.memory, False)):
        if to_default:
            request[key] = None  # null: the daemon's own setting again
        elif value is not None:
            request[key] = value
    request.update(args.options)
    return request


async def _estimate_request(client: Wire, args: argparse.Namespace) -> dict[str, Any]:
    request: dict[str, Any] = {"type": "estimate", "text": args.question}
    conversation = await chosen_conversation(client, args)
    if conversation is not None:
        request["conversation"] = conversation
    if args.model:
        request["model"] = args.model
    if args.file:
        request["files"] = file_paths(args.file)
    if args.preset:
        request["preset"] = args.preset
    return request


async def _conversations(client: Wire, wanted: int) -> dict[str, Any]:
    """``conversations -n N``: the daemon's pages (at most MAX_LIST_LIMIT each) until N are listed."""
    event = await client.request({"type": "conversations", "limit": min(wanted, MAX_LIST_LIMIT)})
    items = event.get("items") or []
    while event["type"] != "error" and len(event["items"]) == MAX_LIST_LIMIT and len(items) < wanted:
        event = await client.request({"type": "conversations", "limit": min(wanted - len(items), MAX_LIST_LIMIT),
                                      "before": items[-1]["updated_at"]})
        items += event.get("items") or []
    return event if event["type"] == "error" else {**event, "items": items}


def _nothing_found(event: dict[str, Any]) -> str | None:
    """What a search that found nothing says (on stderr, exit status 1, as grep's), or None."""
    if event["type"] == "results" and not event["conversations"]:
        return f"nothing found for {event['query']!r}"
    if event["type"] == "kb_results" and not event["results"]:
        return f"nothing found in {event['kb']} for {event['query']!r}"
    return None


async def _simple(client: Wire, request: dict[str, Any], as_json: bool, terminal: Terminal) -> int:
    if request["type"] == "conversations":
        event = await _conversations(client, request["limit"])
    else:
        event = await client.request(request)
    if as_json:
        terminal.out.write(json_line(event))
        return EXIT_ERROR if event["type"] == "error" else EXIT_OK
    if event["type"] == "error":
        terminal.note(f"assistant: {error_text(event)}")
        return EXIT_ERROR
    if request["type"] == "kb_link":  # the answer is the KB as it is now: say what changed
        scope = f"conversation {request['conversation']}" if "conversation" in request else "every conversation"
        print(f"{request['kb']}: {'linked to' if request['linked'] else 'unlinked from'} {scope}", file=terminal.out)
    if request["type"] == "kb_remove":
        print(f"removed knowledge base {event['kb']}: {event['documents']} documents, {event['chunks']} chunks "
              "(the files themselves are untouched)", file=terminal.out)
        return EXIT_OK
    RENDERERS.get(event["type"], lambda e, o: print(json.dumps(e, indent=2), file=o))(event, terminal.out)
    if (nothing := _nothing_found(event)) is not None:
        terminal.note(nothing)
        return EXIT_ERROR
    return EXIT_OK


async def _request_of(client: Wire, args: argparse.Namespace) -> dict[str, Any]:
    """The one request of a command answered by one event."""
    if args.command == "kb":
        return await _kb_link_request(client, args) if args.kb_command == "link" else _kb_request(args)
    if args.command == "settings":
        return await _settings_request(client, args)
    if args.command == "estimate":
        return await _estimate_request(client, args)
    if args.command == "memory":
        return memory_request(args)
    if args.command == "mcp":  # `mcp list` (mcpserve adds its parser)
        return {"type": "mcp_servers"}
    request: dict[str, Any] = {"type": args.command}
    if args.command == "conversations":
        request["limit"] = args.limit
    elif args.command in ("open", "delete", "cancel"):
        request["conversation"] = args.conversation_id
        if args.conversation_id is None:  # open and cancel: the latest
            request["conversation"] = await latest_conversation(client)
            if request["conversation"] is None:
                raise UsageError(f"there are no conversations to {args.command} yet")
    elif args.command == "search":
        request.update(query=" ".join(args.words), limit=args.limit)
        conversation = await chosen_conversation(client, args)
        if conversation is not None:
            request["conversation"] = conversation
    return request


async def connect(path: Path, timeout: float | None = None) -> Wire:
    try:
        return await Wire.open(path, keep=False, timeout=timeout)
    except OSError as exc:  # what Wire.open does not explain itself: a path through a file, ...
        raise DaemonGone(f"cannot reach a daemon at {path} ({exc.strerror or exc}); check ASSISTANT_SOCKET") from None


async def _run(args: argparse.Namespace, terminal: Terminal) -> int:
    client = await connect(socket_path(args))
    try:
        if args.command == "ask":
            return await _ask(client, args, terminal)
        if args.command == "chat":
            from .chat import Chat  # the chat's readline and loop, for chat alone

            chat = Chat(client, args, terminal, reconnect=lambda: connect(socket_path(args)))
            try:
                return await chat.run()
            finally:
                if chat.client is not client:
                    await chat.client.close()
        if args.command == "kb" and args.kb_command == "add":
            return await _kb_add(client, args, terminal)
        if args.command == "convert":
            return await run_convert(client, args, terminal)
        if args.command == "operations":
            return await run_operations(client, args.json, terminal)
        return await _simple(client, await _request_of(client, args), args.json, terminal)
    finally:
        await client.close()


def socket_path(args: argparse.Namespace) -> Path:
    path = Path(args.socket) if args.socket else default_socket_path(os.environ)
    problem = socket_path_problem(path)
    if problem is not None:
        raise DaemonGone(problem)
    return path


# -- the command line -------------------------------------------------------------------------


def add_client_options(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """The options every client command takes, before or after its name (``suppress``: as a
    subcommand's, so that leaving them out there keeps what was given before it)."""
    default: dict[str, Any] = {"default": argparse.SUPPRESS} if suppress else {}
    parser.add_argument("--json", action="store_true", help="print the raw JSON events", **default)
    parser.add_argument("--socket", help="the daemon's socket (default: $ASSISTANT_SOCKET or the XDG path)",
                        **default)
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress and no context meter on stderr",
                        **default)


def _add_conversation_choice(parser: argparse.ArgumentParser, *, new: bool = False) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("-c", "--continue", dest="continue_", action="store_true",
                       help="continue the latest conversation")
    where.add_argument("--cid", type=int, metavar="N", help="continue conversation N")
    if new:
        where.add_argument("--new", action="store_true", help="start a new conversation (the default)")


def _add_question(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", nargs="*", metavar="WORDS", help="the question (text piped in comes first)")
    parser.add_argument("-m", "--model", help="the model to use (default: the conversation's or the router's)")
    parser.add_argument("-f", "--file", action="append", metavar="PATH", help="attach a file (repeatable)")
    parser.add_argument("-p", "--preset", metavar="NAME",
                        help="ask with a preset's prompt (summarize, explain, describe ...: see `presets`); "
                             "WORDS are added after it")


def _add_options(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("-o", "--option", nargs=2, action="append", metavar=("KEY", "VALUE"),
                        help=f"a model option for {what}: temperature (0-2) or top_p (0-1]; 'default' unsets it")


def add_client_commands(sub: Subcommands) -> None:
    """Add the client's subcommands to the entry point's parser."""
    options = argparse.ArgumentParser(add_help=False)
    add_client_options(options, suppress=True)
    _add_questions(sub, options)
    _add_conversations(sub, options)
    _add_kb(sub, options)
    add_convert_commands(sub, options)
    add_memory_commands(sub, options)
    sub.add_parser("models", parents=[options], help="list the router's models")
    sub.add_parser("status", parents=[options], help="the daemon's and the router's state")
    sub.add_parser("openai-key", help="print the key OpenAI clients send to the daemon's OpenAI door")
    sub.add_parser("presets", parents=[options], help="the prompt presets for files (ask --preset NAME -f FILE)")


def _add_questions(sub: Subcommands, options: argparse.ArgumentParser) -> None:
    """``ask`` and ``chat``."""
    ask = sub.add_parser("ask", parents=[options], help="ask a question and stream the reply")
    _add_question(ask)
    _add_conversation_choice(ask, new=True)
    ask.add_argument("-s", "--system", help="the conversation's system prompt (stored with it)")
    ask.add_argument("--incognito", action="store_true",
                     help="a new conversation that neither reads saved memories nor is read by memory search")
    ask.add_argument("--no-stream", action="store_true", help="print the reply once it is complete")
    ask.add_argument("--stats", action="store_true",
                     help="after the reply, show what the model server read, reused from its cache and wrote")
    ask.add_argument("--approve", action="append", metavar="TOOL",
                     help="let the model run this tool that may act without asking (SERVER__TOOL, repeatable)")
    ask.add_argument("--approve-all", action="store_true",
                     help="let the model run every tool that may act without asking (without a terminal, "
                          "such calls are otherwise denied)")
    ask.add_argument("-x", "--extract", action="store_true",
                     help="print only the reply's first fenced code block (the whole reply when it has none)")
    _add_options(ask, "this question")

    chat = sub.add_parser("chat", parents=[options], help="an interactive conversation (Ctrl-C stops a reply)")
    chat.add_argument("text", nargs="*", metavar="WORDS", help="a first question (text piped in comes first)")
    chat.add_argument("-m", "--model", help="the model to use")
    chat.add_argument("-f", "--file", action="append", metavar="PATH", help="attach a file to the first question")
    _add_conversation_choice(chat)
    chat.add_argument("-s", "--system", help="the conversation's system prompt (stored with it)")
    chat.add_argument("--incognito", action="store_true",
                      help="new conversations that neither read saved memories nor are read by memory search")
    _add_options(chat, "each question")


def _add_conversations(sub: Subcommands, options: argparse.ArgumentParser) -> None:
    """The commands on stored conversations: list, open, delete, cancel, settings, estimate, search."""
    conversations = sub.add_parser("conversations", parents=[options], help="list conversations, newest first")
    conversations.add_argument("-n", "--limit", type=count, default=20, help="how many (default 20)")
    for name, text in (("open", "show a conversation (default: the latest)"), ("delete", "delete a conversation"),
                       ("cancel", "stop a conversation's running reply, what it said kept (default: the latest)")):
        cmd = sub.add_parser(name, parents=[options], help=text)
        cmd.add_argument("conversation_id", type=int, metavar="N", nargs=None if name == "delete" else "?")

    settings = sub.add_parser("settings", parents=[options], help="show or change a conversation's settings")
    settings.add_argument("conversation_id", type=int, metavar="N")
    settings.add_argument("--title", help="rename it")
    model = settings.add_mutually_exclusive_group()
    model.add_argument("-m", "--model", help="its model from now on")
    model.add_argument("--default-model", action="store_true", help="follow the daemon's default model")
    settings.add_argument("--kb", choices=("auto", "tool_only", "both", "off"), help="knowledge-base injection")
    settings.add_argument("--recall", choices=("auto", "tool_only", "off"),
                          help="passages of its folded turns and files put before each question")
    settings.add_argument("--memory", choices=("on", "off"), help="off: incognito (no saved memories, not searched)")
    system = settings.add_mutually_exclusive_group()
    system.add_argument("-s", "--system", help="its system prompt ('' for none)")
    system.add_argument("--default-system", action="store_true", help="use the daemon's system_prompt")
    revoke = settings.add_mutually_exclusive_group()
    revoke.add_argument("--revoke", action="append", metavar="TOOL",
                        help="ask again before TOOL (SERVER__TOOL) runs, after 'a' approved it (repeatable)")
    revoke.add_argument("--revoke-all", action="store_true", help="ask again before every tool that may act")
    settings.add_argument("--temperature", metavar="T", help="its temperature, 0-2 ('default': the configuration's)")
    settings.add_argument("--top-p", metavar="P", help="its top_p, above 0 to 1 ('default': the configuration's)")
    _add_options(settings, "its turns")

    estimate = sub.add_parser("estimate", parents=[options], help="what a question with files would cost")
    _add_question(estimate)
    _add_conversation_choice(estimate)

    search = sub.add_parser("search", parents=[options], help="full-text search of your conversations")
    search.add_argument("words", nargs="+")
    _add_conversation_choice(search)
    search.add_argument("-n", "--limit", type=limit, default=20)


def _add_kb(sub: Subcommands, options: argparse.ArgumentParser) -> None:
    """``kb`` and its own subcommands."""
    kb = sub.add_parser("kb", help="knowledge bases: add, list, search, remove, link")
    kb_sub = kb.add_subparsers(dest="kb_command", required=True)
    kb_add = kb_sub.add_parser("add", parents=[options],
                               help="add files and folders (Ctrl-C stops, keeping what was added)")
    kb_add.add_argument("name")
    kb_add.add_argument("paths", nargs="+")
    kb_sub.add_parser("list", parents=[options], help="list knowledge bases")
    kb_search = kb_sub.add_parser("search", parents=[options], help="search a knowledge base as the model would")
    kb_search.add_argument("name")
    kb_search.add_argument("query", nargs="+", metavar="WORDS")
    kb_search.add_argument("-n", "--limit", type=limit, metavar="N", help="passages to show (default 5)")
    kb_remove = kb_sub.add_parser("remove", parents=[options], help="remove a knowledge base")
    kb_remove.add_argument("name")
    kb_link = kb_sub.add_parser("link", parents=[options], help="link a knowledge base to conversations")
    kb_link.add_argument("name")
    linked = kb_link.add_mutually_exclusive_group()
    linked.add_argument("--cid", type=int, metavar="N", help="conversation N (default: the latest)")
    linked.add_argument("--all", action="store_true", help="every conversation, those to come too")
    kb_link.add_argument("--unlink", action="store_true", help="undo the link")


def limit(text: str) -> int:
    """``-n``: how many items a listing shows, as the daemon takes it (1 to MAX_LIST_LIMIT)."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 1 <= number <= MAX_LIST_LIMIT:
        raise argparse.ArgumentTypeError(f"{number} is not from 1 to {MAX_LIST_LIMIT}")
    return number


def count(text: str) -> int:
    """``conversations -n``: any positive number (the client pages through the daemon's lists)."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number} is not a positive number")
    return number


def _quiet_stdout() -> None:
    """stdout's reader has gone (``| head``): send whatever is left to /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def run_client(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Run one client command; its exit status."""
    terminal = Terminal(out, err, quiet=getattr(args, "quiet", False))

    def run() -> int:
        if args.command == "openai-key":  # a file's content: no daemon needed
            return _print_openai_key(terminal)
        if args.command in ("ask", "chat", "settings"):  # checked before connecting, as every usage error
            flags = [[key, value] for key in MODEL_OPTIONS if (value := getattr(args, key, None)) is not None]
            args.options = model_options([*flags, *(args.option or ())])
        if args.command in ("ask", "estimate"):  # read before connecting: a usage error needs no daemon
            args.question = compose_question(args.text, piped_stdin())
            if args.command == "ask" and not args.question.strip() and not args.file:
                raise UsageError("ask needs a question: as words, piped on stdin, or files with -f")
        return asyncio.run(_run(args, terminal))

    return guarded(terminal, run)


def _print_openai_key(terminal: Terminal) -> int:
    key = openai_key()
    if key is None:
        terminal.note("assistant: the OpenAI door has no key yet: set openai_listen (e.g. 127.0.0.1:8765) in "
                      "config.toml and start the daemon, which makes one; or set openai_key yourself")
        return EXIT_ERROR
    terminal.text(key + "\n")
    return EXIT_OK


def guarded(terminal: Terminal, run: Callable[[], int]) -> int:
    """Run a command as the client runs its own: no daemon, a usage error, a closed pipe and
    Ctrl-C end it with one line and their exit status."""
    for warning in unknown_variables(os.environ):
        terminal.note(f"assistant: warning: {warning}")
    try:
        return run()
    except DaemonGone as exc:
        terminal.note(f"assistant: {exc}")
        return EXIT_NO_DAEMON
    except Refused as exc:
        terminal.note(f"assistant: {exc}")
        return EXIT_ERROR
    except (UsageError, Unsendable, ConvertUsage) as exc:
        terminal.note(f"assistant: {exc}")
        return EXIT_USAGE
    except BrokenPipeError:
        _quiet_stdout()  # the reader took what it wanted: not an error
        return EXIT_OK
    except (KeyboardInterrupt, asyncio.CancelledError):
        with contextlib.suppress(OSError):
            terminal.note("[stopped]")
        return EXIT_INTERRUPTED
