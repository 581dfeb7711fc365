"""The OpenAI door: ``/v1/models`` and ``/v1/chat/completions`` for any OpenAI client.

Off unless ``openai_listen`` names a loopback address. Every request must carry the key
(``Authorization: Bearer``): a loopback port is open to every local user, unlike the
socket's uid check. A chat request is one ``ask`` through the same ``TurnEngine`` as the
socket's, so it is stored, searchable, shown to watchers, and gets the daemon's tools,
knowledge bases and compaction; ``TurnRelay`` turns the turn's events into OpenAI's
chunks (or one body). A stateless client resends its whole conversation: the earlier
messages, with its system prompt, name the conversation it continues
(``history.thread_digest``); when none has exactly those turns (a new client, an edited or
regenerated reply), they are stored as a new conversation's imported turns and the
question continues that one. A refused question stores nothing: neither that import nor
its files. A request is read, and its thread named, off the event loop (the socket is
served meanwhile), and its messages are bounded (``openai_max_messages``). A client that
hangs up cancels its turn, as ``cancel`` does: the partial reply is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import resource
import secrets
import time
from collections import Counter
from pathlib import Path
from typing import Any

from common import OPENAI_KEY_FILE
from core.config import Config
from core.errors import AssistantError, BadRequest, RouterError, RouterUnreachable, StartupError
from core.jsontext import compact_json, strict_loads
from core.models import ModelInfo, display_name
from core.router import RouterClient
from history import AsyncHistory, HistoryStore, thread_digest

from .. import events
from ..approvals import Refuser
from ..events import Began, Delta, Done, Event, Failed, Reasoning, ToolRan
from ..live import Live
from .http import HttpError, HttpReply, HttpRequest, refuse_connection, serve_connection
from .messages import ChatAsk, read_chat, spool, unspool
from ..titles import provisional_title
from ..turnrequest import TurnRequest
from ..turns import TurnEngine

__all__ = ["OpenAIDoor", "door_key"]

logger = logging.getLogger(__name__)

MAX_TURNS = 16  # chat requests answered at once; more are told 429
MIN_KEY_CHARS = 16  # a shorter key (an empty key file) is no key
# descriptors kept from the door for the socket's clients, the store, the router and files: a
# quarter of the limit of open files, and at least this many
RESERVED_FILES = 64
OPEN_FILES_CEILING = 1 << 20  # the soft limit asked for when the hard one is unlimited (Linux's nr_open)
CLOSE_GRACE = 1.0  # seconds a connection gets at shutdown to send its last bytes
UPLOADS = "uploads"  # under the data folder: the files clients sent, as the attachment pipeline reads them
# the daemon's error codes as HTTP statuses (anything else: 500)
STATUSES = {
    "bad_request": 400, "file_refused": 400, "too_many_files": 400, "unsupported_kind": 400, "no_vision": 400,
    "too_many_pixels": 400, "context_overflow": 400, "router_context_overflow": 400, "not_found": 404,
    "busy": 429, "router_unreachable": 502, "router_error": 502, "disk_full": 507, "shutting_down": 503,
}
# the OpenAI error codes some clients act on
OPENAI_CODES = {"context_overflow": "context_length_exceeded", "router_context_overflow": "context_length_exceeded",
                "not_found": "model_not_found"}
# how a turn ends, as OpenAI says it: a stop (a cancel, a shutdown) is a stop
FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter")


def door_key(config: Config) -> str:
    """The key clients must send: ``openai_key``, else one made at the first start and kept
    (mode 0600) in the data folder, which ``assistant.py openai-key`` prints. A key file
    holding less than ``MIN_KEY_CHARS`` (a first start cut short) is replaced by a new key; a
    configured key that short stops the start."""
    if config.openai_key:
        if len(config.openai_key.strip()) < MIN_KEY_CHARS:
            raise StartupError(f"openai_key must have at least {MIN_KEY_CHARS} characters (any local user may "
                               "try keys on the door's port); set a longer one, or remove it to have one made")
        return config.openai_key.strip()
    path = config.data_dir / OPENAI_KEY_FILE
    try:
        kept = path.read_text(errors="replace").strip()
    except FileNotFoundError:
        kept = None
    if kept is not None and len(kept) >= MIN_KEY_CHARS:
        return kept
    key = f"sk-assistant-{secrets.token_urlsafe(32)}"
    _write_key(path, key)
    if kept is None:
        logger.info("made a key for the OpenAI door in %s (assistant.py openai-key prints it)", path)
    else:
        logger.warning("the OpenAI door's key file %s held %s; made a new key there (assistant.py openai-key "
                       "prints it)", path, "a key too short to keep" if kept else "no key")
    return key


def _write_key(path: Path, key: str) -> None:
    """Write the key whole or not at all: a temporary file (0600), fsync, rename, fsync the folder."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(key + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def raise_open_files() -> int:
    """Raise the soft limit of open files to the hard one (logged); the soft limit then in effect."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the limit of open files from %d to %d (%s)", soft, wanted, exc)
            return soft
        logger.info("raised the limit of open files from %d to %d", soft, wanted)
        return wanted
    return soft if soft != resource.RLIM_INFINITY else OPEN_FILES_CEILING


class OpenAIDoor:
    """The HTTP listener on ``openai_listen`` and the requests it serves."""

    def __init__(self, config: Config, engine: TurnEngine, history: AsyncHistory, router: RouterClient,
                 live: Live) -> None:
        self.config = config
        self.engine = engine
        self.history = history
        self.router = router
        self.live = live
        self._key = door_key(config).encode()
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()
        # connections that have shown no valid key yet, oldest first (the first to go past the cap)
        self._unkeyed: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._max_connections = config.openai_max_connections
        self._full = False  # connections were refused since the door was last below its cap
        self._turns = 0  # chat requests being answered
        self.address: tuple[str, int] | None = None  # where it listens, once started (a port 0 chosen)

    async def start(self) -> None:
        address = self.config.openai_address
        assert address is not None
        host, port = address
        files = raise_open_files()
        room = files - max(RESERVED_FILES, files // 4)
        if room < self._max_connections:
            logger.warning("the OpenAI door takes at most %d connections, not openai_max_connections = %d: the "
                           "limit of open files is %d, and some are kept for the socket and the store",
                           max(room, 1), self._max_connections, files)
            self._max_connections = max(room, 1)
        try:
            self._server = await asyncio.start_server(self._connection, host, port, limit=64 * 1024)
        except OSError as exc:
            raise StartupError(f"cannot listen on {self.config.openai_listen} for the OpenAI door ({exc.strerror}); "
                                 "choose another openai_listen port, or stop what uses it") from exc
        sockname = self._server.sockets[0].getsockname()
        self.address = (sockname[0], sockname[1])
        logger.info("OpenAI door on http://%s:%d/v1", *self.address)

    async def close(self) -> None:
        """Stop listening; connections still answering get ``CLOSE_GRACE`` to finish."""
        if self._server is not None:
            self._server.close()
        if self._connections:
            _done, pending = await asyncio.wait(self._connections, timeout=CLOSE_GRACE)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)

    def stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one connection within the caps: past ``openai_max_connections`` it is told 503 at
        once; past ``openai_max_unkeyed``, the oldest connection yet to show the key is dropped."""
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= self._max_connections:
            if not self._full:  # once a time it fills: a flood must not flood the log too
                logger.warning("the OpenAI door has %d connections open, its most; refusing more (openai_max_"
                               "connections)", len(self._connections))
            self._full = True
            refuse_connection(writer, HttpError(
                503, f"the door has {len(self._connections)} connections open, its most; try again in a moment",
                code="too_many_connections", kind="server_error", headers={"Retry-After": "1"}))
            return
        if len(self._unkeyed) >= self.config.openai_max_unkeyed:
            oldest = next(iter(self._unkeyed))
            self._unkeyed.pop(oldest).transport.close()  # its read ends: no one left to answer
        self._connections.add(task)
        self._unkeyed[task] = writer
        try:
            await serve_connection(reader, writer, self.handle)
        finally:
            self._connections.discard(task)
            self._unkeyed.pop(task, None)
            self._full = self._full and len(self._connections) >= self._max_connections

    async def handle(self, request: HttpRequest, reply: HttpReply) -> None:
        """Answer one request: the key first (nothing of the body is read, nothing served or stored
        without it), then its route."""
        try:
            self._check_key(request)
            task = asyncio.current_task()
            if task is not None:
                self._unkeyed.pop(task, None)
            await request.read_body()
            route = (request.method, request.path.rstrip("/"))
            if route == ("GET", "/v1/models"):
                await self._models(reply)
            elif route == ("POST", "/v1/chat/completions"):
                await self._chat(request, reply)
            elif route[1] in ("/v1/models", "/v1/chat/completions"):
                raise HttpError(405, f"{request.path} does not take {request.method}", code="method_not_allowed")
            else:
                raise HttpError(404, f"nothing is served at {request.path}; this door serves GET /v1/models and "
                                "POST /v1/chat/completions", code="unknown_url")
        except HttpError as exc:
            reply.error(exc)

    def _check_key(self, request: HttpRequest) -> None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given or not hmac.compare_digest(given.encode(), self._key):
            raise HttpError(401, "send the door's key as Authorization: Bearer KEY (assistant.py openai-key prints "
                            "it)", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _models(self, reply: HttpReply) -> None:
        try:
            models = await self.router.models(refresh=True)
        except (RouterUnreachable, RouterError) as exc:
            raise http_error(exc) from None
        reply.json(200, {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "assistant"} for name in short_ids(models)
        ]})

    async def _chat(self, request: HttpRequest, reply: HttpReply) -> None:
        if self._turns >= MAX_TURNS:
            raise HttpError(429, f"{MAX_TURNS} questions are being answered; try again in a moment",
                            code="busy", kind="rate_limit_error", headers={"Retry-After": "1"})
        self._turns += 1
        try:
            # a long history takes a while to parse and name: the loop serves the socket meanwhile
            chat, digest = await asyncio.to_thread(self._read, request.body, self.config.openai_max_messages)
            try:
                await self.router.model_info(chat.model, load=False)  # before anything is stored
                cid, imported = await self._conversation(chat, digest)
            except AssistantError as exc:
                raise http_error(exc) from None
            relay = TurnRelay(reply, chat)
            paths: list[str] = []
            written: list[Path] = []
            try:
                if chat.uploads:
                    try:
                        paths, written = await asyncio.to_thread(spool, chat.uploads, self.config.data_dir / UPLOADS)
                    except AssistantError as exc:  # a full disk
                        raise http_error(exc) from None
                await self._run(_ask_request(chat, cid, paths), relay, reply)
            finally:
                if relay.conversation is None:  # refused before its question was stored: keep nothing
                    await self._discard(cid if imported else None, written)
            if relay.recordable:
                await self._record(chat, relay)
            relay.finish()
        finally:
            self._turns -= 1

    @staticmethod
    def _read(body: bytes, max_messages: int) -> tuple[ChatAsk, str]:
        """The request (on a worker thread: a long one takes a while), and the digest naming its
        earlier turns under its system prompt."""
        try:
            parsed = strict_loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise HttpError(400, "the body must be JSON text (UTF-8)", code="invalid_json") from None
        messages = parsed.get("messages") if isinstance(parsed, dict) else None
        if isinstance(messages, list) and len(messages) > max_messages:
            raise HttpError(400, f"a request may carry at most {max_messages} messages (openai_max_messages), and "
                            f"this one has {len(messages)}; send the later ones, or start a new conversation",
                            code="too_many_messages")
        try:
            chat = read_chat(parsed)
        except AssistantError as exc:
            raise http_error(exc) from None
        return chat, thread_digest(chat.earlier, chat.system)

    async def _conversation(self, chat: ChatAsk, digest: str) -> tuple[int | None, bool]:
        """The conversation the request continues: the one whose turns are its earlier messages
        under its system prompt, else a new one holding them (True: imported now); None for a
        first question."""
        if not chat.earlier:
            return None, False
        cid = await self.history.run(HistoryStore.thread_conversation, digest)
        if chat.tool_results is not None:
            if cid is None:
                raise BadRequest("these tool results answer calls of no conversation the daemon has; send them "
                                 "with the messages as they were when the tools were called")
            await self._check_results(cid, chat.tool_results)
        if cid is None:
            conv = await self.history.run(HistoryStore.import_conversation, 
                chat.earlier, digest, title=provisional_title(chat.earlier[0][0]), model=chat.model,
                system_prompt=chat.system,
            )
            self.live.publish("conversation", "created", conversation=conv.id, title=conv.title, model=conv.model)
            return conv.id, True
        if chat.system is not None:
            await self._set_system(cid, chat.system)
        return cid, False

    async def _check_results(self, cid: int, results: list[dict[str, Any]]) -> None:
        """Tool results must answer the calls the turn ended on, each once (the turn not waiting
        for any: the engine says so)."""
        waiting = await self.history.run(HistoryStore.waiting_calls, cid)
        given = [result["tool_call_id"] for result in results]
        if waiting is not None and sorted(given) != sorted(waiting):
            raise BadRequest(f"the tool results must answer the calls the model made, one each: it called "
                             f"{', '.join(waiting) or 'no tool of yours'}, and results came for {', '.join(given)}; "
                             "send one tool message per call, with that call's tool_call_id")

    async def _discard(self, imported: int | None, written: list[Path]) -> None:
        """Undo what a refused question made: the conversation imported for it, the files written."""
        try:
            if written:
                await asyncio.to_thread(unspool, written)
            if imported is not None and await self.history.run(HistoryStore.discard_import, imported):
                self.live.publish("conversation", "deleted", conversation=imported)
        except Exception:  # the refusal (or what stopped the turn) is the answer, not this
            logger.warning("could not remove what a refused OpenAI request left", exc_info=True)

    async def _set_system(self, cid: int, system: str) -> None:
        """The client's system message as the conversation's system prompt, as ``settings`` sets it."""
        conv = await self.history.run(HistoryStore.get_conversation, cid)
        if conv is None or conv.system_prompt == system:
            return
        changed = await self.history.run(HistoryStore.update_conversation, cid, system_prompt=system)
        if changed is not None:
            self.live.conversation_updated(changed)

    async def _run(self, ask: TurnRequest, relay: TurnRelay, reply: HttpReply) -> None:
        """The turn, cancelled (its partial reply kept) when the client hangs up."""
        # nobody to ask: a tool that may act runs only when the configuration approves it in
        # advance (approval "auto", auto_approve, or the conversation's remembered approvals)
        turn = asyncio.create_task(self.engine.ask(ask, relay, asker=Refuser()))
        hangup = asyncio.create_task(reply.hung_up())
        try:
            await asyncio.wait([turn, hangup], return_when=asyncio.FIRST_COMPLETED)
            if not turn.done():
                logger.info("an OpenAI client hung up; cancelling its turn")
                stored = asyncio.create_task(relay.stored.wait())
                await asyncio.wait([turn, stored], return_when=asyncio.FIRST_COMPLETED)
                stored.cancel()
                if relay.conversation is not None:
                    self.engine.cancel(relay.conversation)
            await turn
        finally:
            hangup.cancel()

    async def _record(self, chat: ChatAsk, relay: TurnRelay) -> None:
        """Name the conversation by its turns with this one: the client's next request finds it.
        A turn taken up with tool results is the last of ``earlier``, its reply now the whole one."""
        assert relay.conversation is not None and relay.turn is not None and relay.end is not None
        turns = chat.earlier if chat.tool_results is None else chat.earlier[:-1]
        question = chat.question if chat.tool_results is None else chat.earlier[-1][0]
        assert isinstance(relay.end, Done)  # recordable
        digest = await asyncio.to_thread(thread_digest, [*turns, (question, relay.end.text)], chat.system)
        await self.history.run(HistoryStore.add_thread, digest, relay.conversation, relay.turn)


def _ask_request(chat: ChatAsk, cid: int | None, paths: list[str]) -> TurnRequest:
    """The turn a chat request asks for (a new conversation's system prompt is the client's)."""
    return TurnRequest(text=chat.question, files=paths, conversation=cid, model=chat.model or None,
                       system=chat.system if cid is None else None, sampling=chat.sampling, client_tools=chat.tools,
                       tool_results=chat.tool_results)


def short_ids(models: list[ModelInfo]) -> list[str]:
    """The ids a client is shown: a model's short name (a GGUF path's file name) where no other
    model has it, so ``llm`` and Open WebUI configurations stay short; the router's id else.
    A chat request naming either is the same model (``RouterClient.model_info``)."""
    names = Counter(display_name(m.id).casefold() for m in models)
    return [display_name(m.id) if names[display_name(m.id).casefold()] == 1 else m.id for m in models]


def http_error(exc: AssistantError) -> HttpError:
    """A daemon error as the HTTP status and OpenAI error an OpenAI client understands."""
    status = STATUSES.get(exc.code, 500)
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_error"
    return HttpError(status, exc.message, code=OPENAI_CODES.get(exc.code, exc.code), kind=kind)


class TurnRelay:
    """One turn's events as an OpenAI response: chunks as they come (``stream``), else one body."""

    def __init__(self, reply: HttpReply, chat: ChatAsk) -> None:
        self.reply = reply
        self.chat = chat
        self.created = int(time.time())
        self.conversation: int | None = None
        self.turn: int | None = None
        self.stored = asyncio.Event()  # the question is stored (or refused): a hang-up can cancel it
        self.end: Done | Failed | None = None  # how the turn ended
        self.parts: list[str] = []
        self.reasoning: list[str] = []
        self._base: dict[str, Any] = {}
        self._content = ("", "")  # a content chunk's JSON around its text, made once the turn is known

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def recordable(self) -> bool:
        """Whether the client got the whole reply, so its next request will carry it."""
        end = self.end
        return (isinstance(end, Done) and end.finish_reason not in ("cancelled", "interrupted")
                and not self.reply.gone)

    def __call__(self, event: Event) -> None:
        match events.read_turn(event):
            case Began() as began:
                self._began(began)
            case Delta(text=text):
                self.parts.append(text)
                if self.chat.stream:
                    self._start()
                    self.reply.event(f"{self._content[0]}{compact_json(text)}{self._content[1]}")
            case Reasoning(text=text):
                self.reasoning.append(text)
                self._chunk({"reasoning_content": text})
            case ToolRan() as ran if self.chat.stream:
                self._start()
                self.reply.comment(f"tool {ran.name} {'ok' if ran.ok else 'failed'}: {ran.summary}")
            case Done() | Failed() as end:
                self.end = end
                self.stored.set()

    def _began(self, began: Began) -> None:
        """The question is stored: the response's id and the content chunk's frame are known."""
        self.conversation, self.turn = began.conversation, began.turn
        self._base = {"id": f"chatcmpl-{self.conversation}-{self.turn}", "created": self.created,
                      "model": self.chat.model, "system_fingerprint": None,
                      "assistant": {"conversation": self.conversation, "turn": self.turn}}
        marker = "\x00"  # a delta's text goes where this stands in the chunk's JSON
        chunk = compact_json(self._chunk_of([{"index": 0, "delta": {"content": marker}, "finish_reason": None}]))
        head, _, tail = chunk.partition(compact_json(marker))
        self._content = (head, tail)
        self.stored.set()

    def _headers(self) -> dict[str, str]:
        return {"X-Assistant-Conversation": str(self.conversation), "X-Assistant-Turn": str(self.turn)}

    def _start(self) -> None:
        if not self.reply.started:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            self.reply.start_stream(self._headers(), self._chunk_of([role]))

    def _chunk(self, delta: dict[str, Any]) -> None:
        if self.chat.stream:
            self._start()
            self._send([{"index": 0, "delta": delta, "finish_reason": None}])

    def _chunk_of(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        usage = {"usage": None} if self.chat.include_usage else {}
        return {**self._base, "object": "chat.completion.chunk", "choices": choices, **usage, **extra}

    def _send(self, choices: list[dict[str, Any]], **extra: Any) -> None:
        self.reply.event(self._chunk_of(choices, **extra))

    def finish(self) -> None:
        """The response's end: the last chunks and ``[DONE]``, the whole body, or the error."""
        end = self.end
        assert end is not None
        if isinstance(end, Failed):
            error = http_error(_AsError(end.code, end.message))
            if not self.reply.started:
                self.reply.error(error)
            else:  # mid-stream: the status has gone out; the error is the stream's last event
                self.reply.event(error.body())
                self.reply.event("[DONE]")
            return
        reason = end.finish_reason if end.finish_reason in FINISH_REASONS else "stop"
        usage = _usage(end)
        calls = end.tool_calls
        if self.chat.stream:
            self._start()
            if calls:
                self._send([{"index": 0, "delta": {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]},
                             "finish_reason": None}])
            self._send([{"index": 0, "delta": {}, "finish_reason": reason}])
            if self.chat.include_usage:
                self._send([], usage=usage)
            self.reply.event("[DONE]")
            return
        message: dict[str, Any] = {"role": "assistant", "content": self.text or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        self.reply.json(200, {**self._base, "object": "chat.completion", "usage": usage, "choices": [
            {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}]}, self._headers())


class _AsError(AssistantError):
    """An ``error`` event's code and message, as the error it was."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _usage(done: Done) -> dict[str, int] | None:
    prompt, completion = done.prompt_tokens, done.completion_tokens
    if prompt is None or completion is None:
        return None
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
