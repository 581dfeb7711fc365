"""The OpenAI door: ``/v1/models`` and ``/v1/chat/completions`` for any OpenAI client.

Off unless ``openai_listen`` names a loopback address. Every request must carry the key
(``Authorization: Bearer``): a loopback port is open to every local user, unlike the
socket's uid check. A chat request is one ``ask`` through the same ``TurnEngine`` as the
socket's, so it is stored, searchable, shown to watchers, and gets the daemon's tools,
knowledge bases and compaction; ``TurnRelay`` turns the turn's events into OpenAI's
chunks (or one body). A stateless client resends its whole conversation: the earlier
messages name the conversation it continues (``history.thread_digest``); when none has
exactly those turns (a new client, an edited or regenerated reply), they are stored as a
new conversation's imported turns and the question continues that one. A client that
hangs up cancels its turn, as ``cancel`` does: the partial reply is kept.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import time
from typing import Any

from common import OPENAI_KEY_FILE
from core.config import Config
from core.errors import AssistantError, BadRequest, RouterError, RouterUnreachable, StartupError
from core.jsontext import compact_json, strict_loads
from core.router import RouterClient
from history import AsyncHistory, HistoryStore, thread_digest

from ..approvals import Refuser
from ..live import Live
from .http import HttpError, HttpReply, HttpRequest, serve_connection
from .messages import ChatAsk, read_chat, spool
from ..protocol import Request
from ..titles import provisional_title
from ..turns import TurnEngine

__all__ = ["OpenAIDoor", "door_key"]

logger = logging.getLogger(__name__)

MAX_TURNS = 16  # chat requests answered at once; more are told 429
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
    (mode 0600) in the data folder, which ``assistant.py openai-key`` prints."""
    if config.openai_key:
        return config.openai_key
    path = config.data_dir / OPENAI_KEY_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    key = f"sk-assistant-{secrets.token_urlsafe(32)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")
    logger.info("made a key for the OpenAI door in %s (assistant.py openai-key prints it)", path)
    return key


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
        self._turns = 0  # chat requests being answered
        self.address: tuple[str, int] | None = None  # where it listens, once started (a port 0 chosen)

    async def start(self) -> None:
        address = self.config.openai_address
        assert address is not None
        host, port = address
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
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await serve_connection(reader, writer, self.handle)
        finally:
            self._connections.discard(task)

    async def handle(self, request: HttpRequest, reply: HttpReply) -> None:
        """Answer one request: the key first (nothing is served or stored without it), then its route."""
        try:
            self._check_key(request)
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
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._key):
            raise HttpError(401, "send the door's key as Authorization: Bearer KEY (assistant.py openai-key prints "
                            "it)", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _models(self, reply: HttpReply) -> None:
        try:
            models = await self.router.models(refresh=True)
        except (RouterUnreachable, RouterError) as exc:
            raise http_error(exc) from None
        reply.json(200, {"object": "list", "data": [
            {"id": m.id, "object": "model", "created": 0, "owned_by": "assistant"} for m in models
        ]})

    async def _chat(self, request: HttpRequest, reply: HttpReply) -> None:
        if self._turns >= MAX_TURNS:
            raise HttpError(429, f"{MAX_TURNS} questions are being answered; try again in a moment",
                            code="busy", kind="rate_limit_error", headers={"Retry-After": "1"})
        self._turns += 1
        try:
            chat = self._read(request.body)
            try:
                await self.router.model_info(chat.model, load=False)  # before anything is stored
                cid = await self._conversation(chat)
            except AssistantError as exc:
                raise http_error(exc) from None
            paths = await asyncio.to_thread(spool, chat.uploads, self.config.data_dir / UPLOADS) if chat.uploads else []
            relay = TurnRelay(reply, chat)
            await self._run(_ask_request(chat, cid, paths), relay, reply)
            if relay.recordable:
                await self._record(chat, relay)
            relay.finish()
        finally:
            self._turns -= 1

    @staticmethod
    def _read(body: bytes) -> ChatAsk:
        try:
            return read_chat(strict_loads(body.decode("utf-8")))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise HttpError(400, "the body must be JSON text (UTF-8)", code="invalid_json") from None
        except BadRequest as exc:
            raise HttpError(400, exc.message, code="bad_request") from None

    async def _conversation(self, chat: ChatAsk) -> int | None:
        """The conversation the request continues: the one whose turns are its earlier messages,
        else a new one holding them; None for a first question."""
        if not chat.earlier:
            return None
        digest = thread_digest(chat.earlier)
        cid = await self.history.run(HistoryStore.thread_conversation, digest)
        if cid is None and chat.tool_results is not None:
            raise BadRequest("these tool results answer calls of no conversation the daemon has; send them with "
                             "the messages as they were when the tools were called")
        if cid is None:
            conv = await self.history.run(HistoryStore.import_conversation, 
                chat.earlier, digest, title=provisional_title(chat.earlier[0][0]), model=chat.model,
                system_prompt=chat.system,
            )
            self.live.publish("conversation", "created", conversation=conv.id, title=conv.title, model=conv.model)
            return conv.id
        if chat.system is not None:
            await self._set_system(cid, chat.system)
        return cid

    async def _set_system(self, cid: int, system: str) -> None:
        """The client's system message as the conversation's system prompt, as ``settings`` sets it."""
        conv = await self.history.run(HistoryStore.get_conversation, cid)
        if conv is None or conv.system_prompt == system:
            return
        changed = await self.history.run(HistoryStore.update_conversation, cid, system_prompt=system)
        if changed is not None:
            self.live.publish("conversation", "updated", conversation=cid, title=changed.title, model=changed.model,
                              system=changed.system_prompt, settings=changed.settings)

    async def _run(self, ask: Request, relay: TurnRelay, reply: HttpReply) -> None:
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
        digest = thread_digest([*turns, (question, relay.end["text"])])
        await self.history.run(HistoryStore.add_thread, digest, relay.conversation, relay.turn)


def _ask_request(chat: ChatAsk, cid: int | None, paths: list[str]) -> Request:
    """The ``ask`` a chat request makes (a new conversation's system prompt is the client's)."""
    args: dict[str, Any] = {"text": chat.question, "files": paths, "model": chat.model}
    if cid is None:
        args["system"] = chat.system
    else:
        args["conversation"] = cid
    return Request("ask", args=args, overrides=chat.sampling, client_tools=chat.tools, tool_results=chat.tool_results)


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
        self.end: dict[str, Any] | None = None  # the turn's done or error event
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
        return (end is not None and end["type"] == "done" and end["finish_reason"] not in ("cancelled", "interrupted")
                and not self.reply.gone)

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "user":
            self.conversation, self.turn = event["conversation"], event["turn"]
            self._base = {"id": f"chatcmpl-{self.conversation}-{self.turn}", "created": self.created,
                          "model": self.chat.model, "system_fingerprint": None,
                          "assistant": {"conversation": self.conversation, "turn": self.turn}}
            marker = "\x00"  # a delta's text goes where this stands in the chunk's JSON
            chunk = compact_json(self._chunk_of([{"index": 0, "delta": {"content": marker}, "finish_reason": None}]))
            head, _, tail = chunk.partition(compact_json(marker))
            self._content = (head, tail)
            self.stored.set()
        elif kind == "delta":
            self.parts.append(event["text"])
            if self.chat.stream:
                self._start()
                self.reply.event(f"{self._content[0]}{compact_json(event['text'])}{self._content[1]}")
        elif kind == "reasoning":
            self.reasoning.append(event["text"])
            self._chunk({"reasoning_content": event["text"]})
        elif kind == "tool" and self.chat.stream:
            self._start()
            state = "ok" if event["ok"] else "failed"
            self.reply.comment(f"tool {event['name']} {state}: {event['summary']}")
        elif kind in ("done", "error"):
            self.end = event
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
        if end["type"] == "error":
            error = http_error(_AsError(end["code"], end["message"]))
            if not self.reply.started:
                self.reply.error(error)
            else:  # mid-stream: the status has gone out; the error is the stream's last event
                self.reply.event(error.body())
                self.reply.event("[DONE]")
            return
        reason = end["finish_reason"] if end["finish_reason"] in FINISH_REASONS else "stop"
        usage = _usage(end["usage"])
        calls = end.get("tool_calls") or []
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


def _usage(usage: dict[str, Any]) -> dict[str, int] | None:
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if prompt is None or completion is None:
        return None
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
