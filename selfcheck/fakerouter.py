"""A fake OpenAI-compatible model server: a real HTTP/1.1 server on loopback.

Used by the pytest suite, ``python3 assistant.py --test`` and the benchmarks, so it
imports the standard library and ``h11`` only (httpx's own HTTP/1.1 framing, installed
with it).  Its own asyncio loop in a background thread (``asyncio.start_server``, framed
by ``h11``) streams SSE chunk by chunk with real flushes, keeps connections alive as
httpx's pool expects, and notices a client that hangs up mid-stream (``disconnects``).

It imitates llama-server where servers differ: ``/v1/models`` entries with
``architecture.input_modalities`` and ``meta``, ``/props`` with ``modalities`` and
``default_generation_settings.n_ctx`` (honouring ``?model=``), a first chunk with
``"content": null``, tool calls streamed by ``index`` in pieces, a usage chunk with
``"choices": []``, errors as ``{"error": {"code", "message", "type"}}``, a prompt over
``n_ctx`` refused with ``exceed_context_size_error``, and ``timings`` on the last chunk.

Its prompt cache works as llama-server's one slot per model (see
``selfcheck/fakeprompt.py``): ``fake.timings[i]`` is the timings of
``fake.requests[i]`` (None when it was refused), ``cache_n`` the prompt tokens
reused from the previous request to that model and ``prompt_n`` the rest.
Replies are cut as llama-server cuts them (``Reply``).  Two models that misuse tools, as
small ones do: ``Reply(tool_calls=..., unparsed=...)`` is a call llama-server could not
parse (its "does not match the expected ... format" error, as an HTTP 500 or mid-stream),
and ``repeat_calls`` makes the fake answer every tool result with the same call again.
``mode`` picks the router it
imitates: llama-server (the default), llama-swap, Ollama, or a silent one that tells
no sizes (``FakeRouter``).

    with FakeRouter() as fake:
        fake.script(Reply(text="Hello there", reasoning=["Thinking."]))
        ...  # point the client at fake.url
        assert fake.requests[-1]["stream"] is True
        assert fake.timings[-1]["cache_n"] == 0

Run ``python -m selfcheck.fakerouter [--port N] [--mode M]`` to serve in the foreground.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import hashlib
import http
import json
import logging
import math
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

import h11

from selfcheck.fakeprompt import (
    CHARS_PER_TOKEN,
    PromptSlot,
    render_prompt,
    render_reply,
    text_tokens,
    tools_tokens,
)

__all__ = ["CHARS_PER_TOKEN", "FORMAT_ERROR", "FakeModel", "FakeRouter", "Reply", "RouterMode", "fake_embedding"]

logger = logging.getLogger(__name__)

ModelsFormat = Literal["llama", "top", "bare"]
RouterMode = Literal["llama-server", "llama-swap", "ollama", "silent"]

HOST = "127.0.0.1"
HEADER_LIMIT = 64 * 1024  # request line and headers
BATCH_BYTES = 64 * 1024  # coalesce unpaced SSE events into writes of about this size
EMBED_DIM = 8
START_TIMEOUT = 10.0
HOLD_MAX = 30.0  # seconds a held answer waits at most (models_open, props_open, embeddings_open)
HOLD_POLL = 0.005
COMPLETE_DEFAULT = "Fake title"
ARGUMENT_PIECES = 3  # tool-call arguments stream in this many chunks
FILL_WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor".split()
FILL_LIMIT = 4096  # words a fill reply writes when neither max_tokens nor a context ends it
OLLAMA_DEFAULT_CTX = 4096  # Ollama's default num_ctx below 24 GiB of VRAM
OLLAMA_VERSION = "0.12.6"
OLLAMA_BANNER = "Ollama is running"


EMBED_MAX_TOKENS = 512  # llama-server refuses a longer embedding input (HTTP 500)
STREAM_LINGER = 0.02  # seconds a connection stays open after a stream, as llama-server's does
# llama-server's error when the model's output starts a tool call its chat format's parser cannot
# read (common/chat: "The model produced output that does not match the expected " + format name)
FORMAT_ERROR = "The model produced output that does not match the expected peg-native format"


@dataclass
class FakeModel:
    """A model the fake serves: its id, input modalities and context size."""

    id: str
    input_modalities: list[str] = field(default_factory=lambda: ["text"])
    n_ctx: int = 4096
    tools: bool = True  # /props chat_template_caps.supports_tools, as llama-server reports it
    n_ctx_train: int | None = None  # the training length; None: 8 x n_ctx

    @property
    def trained(self) -> int:
        return self.n_ctx_train or self.n_ctx * 8


def default_models() -> list[FakeModel]:
    return [FakeModel("fake-text", ["text"], 4096), FakeModel("fake-vision", ["text", "image"], 8192)]


@dataclass
class Reply:
    """One scripted answer to a chat request; the fields say what and how to send.

    Replies are cut as llama-server cuts them, with ``finish_reason: "length"``: at
    ``max_tokens`` (or ``max_completion_tokens``, ``n_predict``), counted in streamed
    pieces (a word, a reasoning piece; a tool call costs its pieces), and where the prompt
    (in rough tokens) and the reply would pass the model's ``n_ctx``.  ``fill=True``
    writes words until one of those ends it.
    """

    text: str | None = None  # split into word chunks unless ``chunks`` is given
    chunks: list[str] | None = None
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] | None = None  # each {"id", "name", "arguments"}
    finish_reason: str | None = None  # default "stop", or "tool_calls" when there are some
    usage: dict[str, int] | None | Literal["auto"] = "auto"
    delay: float = 0.0  # seconds before each chunk (and before a non-streamed answer)
    status: int = 200
    error: str | None = None  # with status >= 400: the HTTP error; with 200: an error mid-stream
    error_type: str | None = None  # e.g. "exceed_context_size_error"
    legacy_error: bool = False  # mid-stream error as llama-server's old ``error:`` field
    drop_after: int | None = None  # close the connection after this many chunks
    hang: bool = False  # send the chunks, then nothing until the client hangs up
    hold: threading.Event | None = None  # streamed: after the first chunk, the rest waits until it is set
    first_content_null: bool = True
    fill: bool = False  # instead of text: words until max_tokens or the context ends the reply
    # the model wrote its tool_calls so that llama-server could not parse them: FORMAT_ERROR as
    # an HTTP 500 ("status") or, after the text, as an error event mid-stream ("stream")
    unparsed: Literal["status", "stream"] | None = None


def _words(text: str) -> list[str]:
    """Split text the way a model streams it: one word (with its leading space) a chunk."""
    return re.findall(r"\s*\S+\s*$|\s*\S+", text) or ([text] if text else [])


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def _rough_tokens(body: dict[str, Any]) -> int:
    """The messages' text and the tools' definitions (a template renders them into the prompt)
    in rough tokens (``text_tokens``): usage's prompt_tokens, and what is measured against a
    model's n_ctx."""
    texts = [_message_text(m) for m in body.get("messages") or () if isinstance(m, dict)]
    return max(1, text_tokens("".join(texts)) + tools_tokens(body.get("tools")))


def _max_tokens(body: dict[str, Any]) -> int | None:
    """The reply's cap the request set, if any (-1 is llama-server's "no cap")."""
    for key in ("max_tokens", "max_completion_tokens", "n_predict"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def _fill(count: int) -> list[str]:
    return [(" " if i else "") + FILL_WORDS[i % len(FILL_WORDS)] for i in range(count)]


def fake_embedding(text: str, dim: int = EMBED_DIM) -> list[float]:
    """A deterministic unit vector: hashed bag of words, so texts sharing words point alike."""
    vector = [0.0] * dim
    for word in re.findall(r"\w+", text.lower()):
        digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
        vector[digest[0] % dim] += 1.0 if digest[1] & 1 else -1.0
    norm = math.sqrt(sum(x * x for x in vector))
    if norm == 0.0:
        vector[0], norm = 1.0, 1.0
    return [x / norm for x in vector]


@dataclass
class _Request:
    """A parsed HTTP request."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    conn: h11.Connection  # its connection's HTTP/1.1 state, which frames the answer
    arrived: float = 0.0  # time.time() when the body was read
    connected: float = 0.0  # time.time() when its connection was accepted

    @property
    def keep_alive(self) -> bool:
        """Whether the connection may serve another request once this one is answered."""
        return self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE


class _ClientGone(Exception):
    """The client closed the connection while we were streaming to it."""


class FakeRouter:
    """The fake server; ``start()``/``stop()`` or use it as a context manager.

    ``mode`` picks the router it imitates:

    - ``"llama-server"`` (default): as the module says; ``models_format`` and ``props``
      vary it.
    - ``"llama-swap"``: entries ``owned_by: "llama-swap"`` without size or modalities, no
      ``/props`` at the root, llama-server's ``/props`` through ``/upstream/<model>/props``,
      and ``/running``.  A request for another model than the running one starts it:
      ``loaded`` lists the models started, in order.
    - ``"ollama"``: entries ``owned_by: "library"``, the root answering "Ollama is
      running", ``/api/version``, ``POST /api/show`` (``parameters`` with ``num_ctx``
      unless the model runs at Ollama's default, ``model_info`` with the training length,
      ``capabilities``), no ``/props``.  As Ollama, it sends no ``timings`` and neither
      refuses an over-long prompt (Ollama drops old messages) nor stops at the context
      end (it shifts the context).
    - ``"silent"``: entries without size or modalities and nothing else that tells the
      size, but the overflow error still names ``n_ctx`` (llama-server behind a plain
      proxy).
    """

    def __init__(
        self,
        models: list[FakeModel] | None = None,
        models_format: ModelsFormat = "llama",
        props: bool = True,
        *,
        mode: RouterMode = "llama-server",
        port: int = 0,
        api_key: str | None = None,
    ) -> None:
        self.models = default_models() if models is None else models
        self.models_format = models_format
        self.props = props
        self.mode = mode
        self.api_key = api_key  # when set, requests must carry "Authorization: Bearer <key>"
        self.embed_dim = EMBED_DIM
        self.embed_delay = 0.0
        self.embed_fail = False
        self.embeddings = True  # False: answer /v1/embeddings as llama-server without --embeddings
        self.repeat_calls = False  # True: a request ending in a tool result is answered with the same call
        self.props_delay = 0.0  # seconds before /props answers (a router loading the model)
        self.models_open = threading.Event()  # cleared: /models answers wait until it is set again
        self.models_open.set()
        self.props_open = threading.Event()  # cleared: /props answers (a model loading) wait so too
        self.props_open.set()
        self.embeddings_open = threading.Event()  # cleared: embedding answers wait so too
        self.embeddings_open.set()
        self.models_answered = 0  # /models answers sent
        self.requests: list[dict[str, Any]] = []
        self.arrivals: list[float] = []  # time.time() when each chat request's body was read
        self.connected: list[float] = []  # and when the connection it came on was accepted
        self.timings: list[dict[str, Any] | None] = []  # llama-server's timings of requests[i]
        self.loaded: list[str] = []  # llama-swap mode: the models started, in order
        self.embedding_requests: list[dict[str, Any]] = []
        self.hits: collections.Counter[str] = collections.Counter()  # path -> requests served
        self.disconnects = 0
        self.connections = 0  # TCP connections accepted: keep-alive reuse shows as fewer
        self._port_wanted = port
        self._port = 0
        self._cond = threading.Condition()
        self._stream_queue: collections.deque[Reply] = collections.deque()
        self._complete_queue: collections.deque[Reply] = collections.deque()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._startup_error: BaseException | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()  # connections not yet closed for good
        self._counter = 0
        self._slots: dict[str, PromptSlot] = {}  # model -> its prompt cache
        self._running: str | None = None  # llama-swap mode: the model it runs

    # -- lifecycle ---------------------------------------------------------

    @property
    def url(self) -> str:
        """The base URL a client uses, ending in ``/v1``."""
        return f"http://{HOST}:{self._port}/v1"

    @property
    def port(self) -> int:
        return self._port

    def start(self) -> FakeRouter:
        if self._thread is not None:
            raise RuntimeError("FakeRouter already started")
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="fakerouter", daemon=True)
        self._thread.start()
        if not ready.wait(START_TIMEOUT):
            raise RuntimeError("FakeRouter did not start")
        if self._startup_error is not None:
            self._thread.join()
            self._thread = None
            raise RuntimeError(f"FakeRouter could not start: {self._startup_error}") from self._startup_error
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(START_TIMEOUT)
        self._thread = None

    def __enter__(self) -> FakeRouter:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self, ready: threading.Event) -> None:
        try:
            asyncio.run(self._main(ready))
        except BaseException as exc:  # reported to start(); a thread must not die loudly
            self._startup_error = exc
            ready.set()

    async def _main(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._accept, HOST, self._port_wanted, limit=HEADER_LIMIT)
        self._port = server.sockets[0].getsockname()[1]
        ready.set()
        async with server:
            await self._stopping.wait()
            await self._settle_accepts()
            server.close()
            await self._close_connections()

    async def _settle_accepts(self) -> None:
        """Let connections accepted just before stop finish their set-up: on Python 3.11 one
        whose set-up task first runs after server.close() fails an assertion there, silently,
        and its socket is left to the garbage collector (a ResourceWarning in a later test)."""
        me = asyncio.current_task()
        while True:
            setting_up = [t for t in asyncio.all_tasks() if t is not me and t not in self._connections]
            if not setting_up:
                return
            await asyncio.wait(setting_up)

    async def _close_connections(self) -> None:
        """Close every connection, also one whose handler, cancelled before it ran, cannot."""
        me = asyncio.current_task()
        while True:
            for task in list(self._connections):
                task.cancel()
            for writer in list(self._writers):
                writer.transport.abort()
            self._writers.clear()
            others = [task for task in asyncio.all_tasks() if task is not me]
            if not others:
                break
            await asyncio.wait(others)  # cancelled handlers end at once; accepts finish on their own
        # Closed transports release their sockets on the next loop iterations.
        for _ in range(3):
            await asyncio.sleep(0)

    # -- scripting and recording ----------------------------------------

    def script(self, *replies: Reply) -> None:
        """Queue replies for the next streaming chat requests, first in first out."""
        with self._cond:
            self._stream_queue.extend(replies)

    def script_complete(self, *replies: Reply) -> None:
        """Queue replies for the next non-streaming chat requests (titles, summaries)."""
        with self._cond:
            self._complete_queue.extend(replies)

    def wait_requests(self, n: int, timeout: float = 10.0) -> bool:
        """Block until ``n`` chat requests have arrived; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self.requests) >= n, timeout)

    def wait_disconnects(self, n: int, timeout: float = 10.0) -> bool:
        """Block until ``n`` streams were abandoned by their client; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.disconnects >= n, timeout)

    def reset(self) -> None:
        """Forget recorded requests, queued replies and the embedder knobs; the models, and
        what the server holds (its prompt caches, llama-swap's running model), stay."""
        with self._cond:
            self.requests.clear()
            self.arrivals.clear()
            self.connected.clear()
            self.timings.clear()
            self.loaded.clear()
            self.embedding_requests.clear()
            self.hits.clear()
            self.disconnects = 0
            self.connections = 0
            self._stream_queue.clear()
            self._complete_queue.clear()
            self.embed_delay = 0.0
            self.embed_fail = False
            self.embeddings = True
            self.repeat_calls = False
            self.props_delay = 0.0
            self.models_open.set()
            self.props_open.set()
            self.embeddings_open.set()
            self.models_answered = 0

    def _note_disconnect(self) -> None:
        with self._cond:
            self.disconnects += 1
            self._cond.notify_all()

    # -- HTTP plumbing -------------------------------------------------------

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Track a new connection from its first moment: stop() may come before its handler runs."""
        assert self._loop is not None
        self._writers.add(writer)
        task = self._loop.create_task(self._connection(reader, writer))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self._cond:
            self.connections += 1
        connected = time.time()
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=HEADER_LIMIT)
        try:
            while True:
                request = await self._read_request(conn, reader, writer)
                if request is not None:
                    request.connected = connected
                if request is None or not await self._dispatch(request, reader, writer) or not request.keep_alive:
                    break
                conn.start_next_cycle()
        except (_ClientGone, ConnectionError, asyncio.CancelledError):
            pass
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            _answer_broken(conn, writer, status, "headers too large" if status == 431 else str(exc))
        except Exception:
            logger.exception("fake router: request failed")
            _answer_broken(conn, writer, 500, "fake router crashed")
        finally:
            if self._stopping is not None and self._stopping.is_set():
                writer.transport.abort()  # a client that stopped reading must not delay stop()
            else:
                writer.close()
            if not writer.transport.get_write_buffer_size():
                self._writers.discard(writer)  # closed for good; one still flushing waits for stop()

    async def _read_request(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> _Request | None:
        event = await _next_event(conn, reader)
        if isinstance(event, h11.ConnectionClosed):
            return None  # the client closed an idle keep-alive connection
        assert isinstance(event, h11.Request)
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers}
        if conn.they_are_waiting_for_100_continue:
            writer.write(conn.send(h11.InformationalResponse(status_code=100, reason="Continue", headers=[])) or b"")
        body = bytearray()
        while not isinstance(part := await _next_event(conn, reader), h11.EndOfMessage):
            if isinstance(part, h11.ConnectionClosed):
                raise _ClientGone
            body += part.data
        parts = urlsplit(event.target.decode("latin-1"))
        query = dict(parse_qsl(parts.query))
        return _Request(event.method.decode("latin-1"), parts.path, query, headers, bytes(body), conn, time.time())

    async def _dispatch(self, request: _Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; return whether the connection may serve another."""
        path = request.path.rstrip("/") or "/"
        with self._cond:
            self.hits[path] += 1
        # llama-server answers its OpenAI routes with and without the /v1 prefix.
        route = (request.method, path.removeprefix("/v1"))
        if route[1] != "/health" and self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return await _send(writer, 401, _error_body(401, "Invalid API Key", "authentication_error"), request)
        if route == ("GET", "/models"):
            await _until_open(self.models_open)
            kept = await _send(writer, 200, self._models_body(), request)
            with self._cond:
                self.models_answered += 1
            return kept
        if route == ("GET", "/health"):
            return await _send(writer, 200, {"status": "ok"}, request)
        if route == ("POST", "/chat/completions"):
            return await self._chat(request, reader, writer)
        if route == ("POST", "/embeddings"):
            return await self._embeddings(request, writer)
        if route == ("GET", "/debug/last-chat"):
            # the last chat request's body and when it arrived: a benchmark replays the daemon's
            # very prompt, and times the daemon's part of the way to the router
            with self._cond:
                last = {**self.requests[-1], "_arrived": self.arrivals[-1]} if self.requests else None
            return await _send(writer, 200 if last else 404, last or _error_body(404, "no chat yet", "not_found_error"), request)
        if self.mode == "llama-server" and (request.method, path) == ("GET", "/props"):
            return await self._props(request, writer, request.query.get("model"))
        if self.mode == "llama-swap":
            return await self._llama_swap(request, writer, path)
        if self.mode == "ollama":
            return await self._ollama(request, writer, path)
        return await _not_found(writer, request)

    # -- endpoints -------------------------------------------------------------

    def _model(self, name: Any) -> FakeModel | None:
        return next((m for m in self.models if m.id == name), None)

    def _models_body(self) -> dict[str, Any]:
        data = []
        for model in self.models:
            entry: dict[str, Any] = {"id": model.id, "object": "model", "created": 0, "owned_by": "llamacpp"}
            if self.mode == "llama-swap":
                entry.update(owned_by="llama-swap", status={"value": "loaded" if model.id == self._running else "unloaded"})
            elif self.mode == "ollama":
                entry["owned_by"] = "library"
            elif self.mode == "silent":
                pass
            elif self.models_format == "llama":
                entry["architecture"] = {"input_modalities": list(model.input_modalities), "output_modalities": ["text"]}
                # n_ctx_train is deliberately larger: a client must not take it for the runtime context.
                entry["meta"] = {"n_ctx": model.n_ctx, "n_ctx_train": model.trained, "n_vocab": 32000}
            elif self.models_format == "top":
                entry["input_modalities"] = list(model.input_modalities)
            data.append(entry)
        return {"object": "list", "data": data}

    async def _props(self, request: _Request, writer: asyncio.StreamWriter, wanted: str | None) -> bool:
        """llama-server's /props, of ``wanted`` (``?model=`` on its router mode) or the first model."""
        if self.props_delay:
            await asyncio.sleep(self.props_delay)
        await _until_open(self.props_open)
        if not self.props or not self.models:
            return await _not_found(writer, request)
        model = self._model(wanted) if wanted else self.models[0]
        if model is None:
            return await _send(writer, 400, _error_body(400, f"model {wanted!r} not found", "invalid_request_error"), request)
        body = {
            "default_generation_settings": {"n_ctx": model.n_ctx, "params": {"temperature": 0.8}},
            "total_slots": 1,
            "model_path": f"/models/{model.id}.gguf",
            "modalities": {"vision": "image" in model.input_modalities, "audio": "audio" in model.input_modalities},
            "build_info": "fake",
            "chat_template_caps": {"supports_tools": model.tools, "supports_tool_calls": model.tools},
        }
        return await _send(writer, 200, body, request)

    def _start(self, model: str) -> None:
        """llama-swap mode: run ``model``, stopping the one that ran (no groups)."""
        with self._cond:
            if self.mode == "llama-swap" and model != self._running:
                self._running = model
                self.loaded.append(model)

    async def _llama_swap(self, request: _Request, writer: asyncio.StreamWriter, path: str) -> bool:
        """llama-swap's own routes: /upstream/<model>/<path> passes through to the model's
        llama-server (starting it), /running lists what runs."""
        if (request.method, path) == ("GET", "/running"):
            running = [{"model": self._running, "state": "ready"}] if self._running else []
            return await _send(writer, 200, {"running": running}, request)
        upstream = unquote(path.removeprefix("/upstream/")) if path.startswith("/upstream/") else ""
        if request.method == "GET" and upstream.endswith("/props"):
            model = self._model(upstream.removesuffix("/props"))
            if model is not None:
                self._start(model.id)
                return await self._props(request, writer, model.id)
        return await _not_found(writer, request)

    async def _ollama(self, request: _Request, writer: asyncio.StreamWriter, path: str) -> bool:
        """Ollama's own routes: its banner, /api/version and /api/show."""
        if (request.method, path) == ("GET", "/"):
            return await _send_text(writer, 200, OLLAMA_BANNER, request)
        if (request.method, path) == ("GET", "/api/version"):
            return await _send(writer, 200, {"version": OLLAMA_VERSION}, request)
        if (request.method, path) == ("POST", "/api/show"):
            try:
                asked = json.loads(request.body)
                model = self._model(asked.get("model") or asked.get("name"))
            except (ValueError, AttributeError):
                model = None
            if model is None:
                return await _send(writer, 404, {"error": "model not found"}, request)
            return await _send(writer, 200, _ollama_show(model), request)
        return await _not_found(writer, request)

    def _overflow(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """llama-server's answer to a prompt over the model's context, when it is one."""
        model = self._model(body.get("model"))
        tokens = _rough_tokens(body)
        if self.mode == "ollama" or model is None or tokens <= model.n_ctx:
            return None
        message = (
            f"request ({tokens} tokens) exceeds the available context size ({model.n_ctx} tokens), "
            "try increasing it"
        )
        return {"error": {"code": 400, "message": message, "type": "exceed_context_size_error",
                          "n_prompt_tokens": tokens, "n_ctx": model.n_ctx}}

    def _image_for_blind_model(self, body: dict[str, Any]) -> bool:
        model = self._model(body.get("model"))
        if model is None or "image" in model.input_modalities:
            return False
        return any(
            isinstance(part, dict) and part.get("type") == "image_url"
            for message in body.get("messages") or ()
            if isinstance(message, dict) and isinstance(message.get("content"), list)
            for part in message["content"]
        )

    def next_reply(self, body: dict[str, Any], stream: bool) -> Reply:
        """The reply to a chat request: the next one scripted, else an echo of the question (a
        subclass may answer otherwise: bench/crash_audit.py's slow router)."""
        with self._cond:
            queue = self._stream_queue if stream else self._complete_queue
            if queue:
                return queue.popleft()
        if not stream:
            return Reply(text=COMPLETE_DEFAULT)
        if self.repeat_calls and _may_call(body):
            again = _last_calls(body)
            if again:
                return Reply(tool_calls=again)
        users = [m for m in body.get("messages") or () if isinstance(m, dict) and m.get("role") == "user"]
        return Reply(text="You said: " + (_message_text(users[-1]) if users else ""))

    async def _chat(self, request: _Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        try:
            body = json.loads(request.body)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            return await _send(writer, 400, _error_body(400, f"invalid JSON: {exc}", "invalid_request_error"), request)
        stream = bool(body.get("stream"))
        with self._cond:
            self.requests.append({"path": request.path, **body})
            self.arrivals.append(request.arrived)
            self.connected.append(request.connected)
            self.timings.append(None)
            index = len(self.requests) - 1
            self._counter += 1
            serial = self._counter
            self._cond.notify_all()
        self._start(str(body.get("model") or ""))
        if self._image_for_blind_model(body):
            # what llama-server answers for an image to a model loaded without its mmproj
            message = "image input is not supported - hint: if this is unexpected, you may need to provide the mmproj"
            return await _send(writer, 500, _error_body(500, message, "server_error"), request)
        overflow = self._overflow(body)
        if overflow is not None:
            return await _send(writer, 400, overflow, request)
        reply = self.next_reply(body, stream)
        if reply.unparsed is not None and _may_call(body):
            # llama-server sends no call it could not parse: the text so far, then the error
            status = 500 if reply.unparsed == "status" else 200
            reply = dataclasses.replace(reply, tool_calls=None, status=status, error=FORMAT_ERROR)
        if reply.status >= 400:
            kind = reply.error_type or ("server_error" if reply.status >= 500 else "invalid_request_error")
            return await _send(writer, reply.status, _error_body(reply.status, reply.error or "fake error", kind), request)
        chunks = _Chunks(reply, body, serial, self._reply_limit(body), send_timings=self.mode != "ollama")
        self._use_slot(body, chunks, index)
        if not stream:
            if reply.delay:
                await asyncio.sleep(reply.delay)
            return await _send(writer, 200, chunks.completion(), request)
        return await self._stream(chunks, request, reader, writer)

    def _reply_limit(self, body: dict[str, Any]) -> int | None:
        """Pieces the reply may have: max_tokens, and the room the context leaves after the
        prompt (llama-server stops when its context is full; Ollama shifts it instead)."""
        limits = [n for n in (_max_tokens(body),) if n is not None]
        model = self._model(body.get("model"))
        if model is not None and self.mode != "ollama":
            limits.append(max(0, model.n_ctx - _rough_tokens(body)))
        return min(limits) if limits else None

    def _use_slot(self, body: dict[str, Any], chunks: _Chunks, index: int) -> None:
        """Measure the request against its model's prompt cache, which then holds it."""
        with self._cond:
            slot = self._slots.setdefault(str(body.get("model") or ""), PromptSlot())
            timings = slot.use(render_prompt(body), chunks.generated()).timings(chunks.piece_count())
            self.timings[index] = timings
        if chunks.send_timings and not chunks.reply.error:
            chunks.timings = timings

    async def _stream(self, chunks: _Chunks, request: _Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        reply = chunks.reply
        # h11 frames the body in chunks (close-delimited to an HTTP/1.0 client)
        writer.write(request.conn.send(h11.Response(
            status_code=200, reason="OK", headers=[("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")],
        )) or b"")
        pieces = chunks.pieces()
        if reply.drop_after is not None:
            pieces = pieces[: reply.drop_after]
        try:
            events = chunks.prologue() + pieces
            if reply.hold is not None:  # the first chunk, then the rest when the test says
                first = len(events) - len(pieces) + 1
                await self._write_events(events[:first], reply.delay, request, reader, writer)
                await _until_open(reply.hold)
                events = events[first:]
            await self._write_events(events, reply.delay, request, reader, writer)
            if reply.drop_after is not None:
                # Flush what was sent, then close without the final chunk: a crashed server.
                writer.transport.set_write_buffer_limits(0)
                await writer.drain()
                writer.transport.close()
                return False
            if reply.hang:
                await writer.drain()
                while await reader.read(HEADER_LIMIT):
                    pass  # a client sends nothing mid-response; we wait for its hang-up
                raise _ClientGone
            await self._write_events(chunks.epilogue(), 0.0, request, reader, writer)
            writer.write(request.conn.send(h11.EndOfMessage()) or b"")
            await writer.drain()
        except (_ClientGone, ConnectionError):
            self._note_disconnect()
            writer.transport.abort()
            return False
        # llama-server offers keep-alive but closes a connection soon after a stream ends,
        # without answering what arrives on it: a client that pools it loses its next request.
        await asyncio.sleep(STREAM_LINGER)
        return False

    async def _write_events(
        self, events: list[bytes], delay: float, request: _Request, reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """Send SSE events as HTTP chunks: each paced and flushed, or coalesced when unpaced."""
        if delay > 0:
            for event in events:
                await asyncio.sleep(delay)
                if reader.at_eof() or reader.exception() is not None or writer.transport.is_closing():
                    raise _ClientGone
                writer.write(_frame(request.conn, event))
                await writer.drain()
            return
        batch = bytearray()
        for event in events:
            batch += event
            if len(batch) >= BATCH_BYTES:
                writer.write(_frame(request.conn, bytes(batch)))
                batch.clear()
                await writer.drain()
        if batch:
            writer.write(_frame(request.conn, bytes(batch)))
        await writer.drain()

    async def _embeddings(self, request: _Request, writer: asyncio.StreamWriter) -> bool:
        try:
            body = json.loads(request.body)
            inputs = body["input"]
        except (ValueError, KeyError, TypeError) as exc:
            return await _send(writer, 400, _error_body(400, f"bad request: {exc}", "invalid_request_error"), request)
        with self._cond:
            self.embedding_requests.append({"path": request.path, **body})
            self._cond.notify_all()
            delay, fail, dim = self.embed_delay, self.embed_fail, self.embed_dim
        if delay:
            await asyncio.sleep(delay)
        await _until_open(self.embeddings_open)
        if fail:
            return await _send(writer, 500, _error_body(500, "fake embedder failure", "server_error"), request)
        if not self.embeddings:
            # llama-server started without --embeddings
            message = "This server does not support embeddings. Start it with `--embeddings`"
            return await _send(writer, 501, _error_body(501, message, "not_supported_error"), request)
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        too_long = max((_rough_tokens({"messages": [{"content": str(t)}]}) for t in texts), default=0)
        if too_long > EMBED_MAX_TOKENS:
            # llama-server's physical batch (-ub 512) bounds one input
            message = f"input ({too_long} tokens) is too large to process. increase the physical batch size"
            return await _send(writer, 500, _error_body(500, message, "server_error"), request)
        data = [{"object": "embedding", "index": i, "embedding": fake_embedding(str(t), dim)} for i, t in enumerate(texts)]
        tokens = sum(len(str(t).split()) for t in texts)
        # Reversed on purpose: the OpenAI API promises order only through "index".
        answer = {
            "object": "list",
            "model": body.get("model", ""),
            "data": data[::-1],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return await _send(writer, 200, answer, request)


class _Chunks:
    """Builds the SSE events (and the non-streamed answer) of one scripted reply, cut at
    ``limit`` pieces when one is given."""

    def __init__(
        self, reply: Reply, body: dict[str, Any], serial: int, limit: int | None = None, *, send_timings: bool = True
    ) -> None:
        self.reply = reply
        self.body = body
        self.model = str(body.get("model") or "fake")
        self.common = {
            "created": int(time.time()),
            "id": f"chatcmpl-fake{serial}",
            "model": self.model,
            "system_fingerprint": "fake",
            "object": "chat.completion.chunk",
        }
        if reply.fill:
            self.content = _fill(FILL_LIMIT if limit is None else limit)
        elif reply.chunks is not None:
            self.content = list(reply.chunks)
        else:
            self.content = _words(reply.text or "") if reply.text is not None else []
        self.reasoning = list(reply.reasoning)
        self.calls = [self._call(i, c) for i, c in enumerate(reply.tool_calls or ())]
        self.cut = reply.fill or (limit is not None and self._cut(limit))
        self.send_timings = send_timings
        self.timings: dict[str, Any] | None = None  # llama-server's, set once the slot measured the prompt

    def _cut(self, limit: int) -> bool:
        """Keep what fits ``limit`` pieces: reasoning, then text, then whole tool calls."""
        whole = self.piece_count()
        self.reasoning = self.reasoning[:limit]
        self.content = self.content[: limit - len(self.reasoning)]
        room = limit - len(self.reasoning) - len(self.content)
        kept = []
        for call in self.calls:
            cost = _call_pieces(call)
            if cost > room:
                break
            kept.append(call)
            room -= cost
        self.calls = kept
        return self.piece_count() < whole

    def generated(self) -> str:
        """The reply as the model wrote it, for the prompt cache (reasoning left out)."""
        return render_reply("".join(self.content), [(c["name"], c["arguments"]) for c in self.calls])

    @staticmethod
    def _call(index: int, call: dict[str, Any]) -> dict[str, str]:
        arguments = call.get("arguments", "{}")
        return {
            "id": str(call.get("id") or f"call_fake{index}"),
            "name": str(call["name"]),
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        }

    def _event(self, choices: list[Any], **extra: Any) -> bytes:
        return b"data: " + json.dumps({"choices": choices, **self.common, **extra}).encode() + b"\n\n"

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return self._event([{"finish_reason": None, "index": 0, "delta": delta}])

    @property
    def finish_reason(self) -> str:
        if self.cut:
            return "length"
        return self.reply.finish_reason or ("tool_calls" if self.calls else "stop")

    def prologue(self) -> list[bytes]:
        if not self.reply.first_content_null:
            return []
        return [self._delta({"role": "assistant", "content": None})]

    def pieces(self) -> list[bytes]:
        """The counted chunks: reasoning, then content, then tool-call fragments."""
        out = [self._delta({"reasoning_content": piece}) for piece in self.reasoning]
        # Content chunks dominate benchmarks: build them from a template, not json.dumps of a dict.
        prefix = b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":'
        suffix = (b'}}],' + json.dumps(self.common)[1:].encode()) + b"\n\n"
        out.extend(prefix + json.dumps(piece).encode() + suffix for piece in self.content)
        for index, call in enumerate(self.calls):
            head = {"index": index, "id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": ""}}
            out.append(self._delta({"tool_calls": [head]}))
            for piece in _split_even(call["arguments"], ARGUMENT_PIECES):
                out.append(self._delta({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}))
        return out

    def piece_count(self) -> int:
        """The reply's length in the fake's tokens: its streamed pieces."""
        return len(self.reasoning) + len(self.content) + sum(_call_pieces(c) for c in self.calls)

    def usage(self) -> dict[str, int] | None:
        if self.reply.usage == "auto":
            prompt, completion = _rough_tokens(self.body), self.piece_count()
            return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        return self.reply.usage

    def epilogue(self) -> list[bytes]:
        reply = self.reply
        if reply.error:
            error = {"code": 500, "message": reply.error, "type": reply.error_type or "server_error"}
            if reply.legacy_error:
                return [b"error: " + json.dumps(error).encode() + b"\n\n", b"data: [DONE]\n\n"]
            return [b"data: " + json.dumps({"error": error}).encode() + b"\n\n"]
        last: list[tuple[list[Any], dict[str, Any]]] = [([{"finish_reason": self.finish_reason, "index": 0, "delta": {}}], {})]
        usage = self.usage()
        options = self.body.get("stream_options") or {}
        if usage is not None and isinstance(options, dict) and options.get("include_usage"):
            last.append(([], {"usage": usage}))
        if self.timings is not None:
            last[-1][1]["timings"] = self.timings  # llama-server's go on the last chunk
        return [self._event(choices, **extra) for choices, extra in last] + [b"data: [DONE]\n\n"]

    def completion(self) -> dict[str, Any]:
        """The whole answer to a request without ``stream``."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in self.calls
            ]
        answer = {
            **self.common,
            "object": "chat.completion",
            "choices": [{"finish_reason": self.finish_reason, "index": 0, "message": message}],
        }
        usage = self.usage()
        if usage is not None:
            answer["usage"] = usage
        if self.timings is not None:
            answer["timings"] = self.timings
        return answer


def _may_call(body: dict[str, Any]) -> bool:
    """Whether the request lets the model call a tool: llama-server renders the tools of a request
    with ``tool_choice: none`` into the prompt all the same, but reads no call from the reply."""
    return bool(body.get("tools")) and body.get("tool_choice") != "none"


def _last_calls(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The calls of the last assistant message, when the request ends with their results."""
    messages = [m for m in body.get("messages") or () if isinstance(m, dict)]
    if not messages or messages[-1].get("role") != "tool":
        return []
    asked = next((m for m in reversed(messages) if m.get("role") == "assistant"), {})
    calls = []
    for n, call in enumerate(asked.get("tool_calls") or ()):
        function = call.get("function") or {}
        calls.append({"id": f"call_again{len(messages)}_{n}", "name": function.get("name"), "arguments": function.get("arguments")})
    return calls


def _call_pieces(call: dict[str, str]) -> int:
    """A streamed tool call's pieces: its head, then its arguments in ARGUMENT_PIECES."""
    return 1 + len(list(_split_even(call["arguments"], ARGUMENT_PIECES)))


def _frame(conn: h11.Connection, data: bytes) -> bytes:
    """A piece of a streamed body, as h11 frames it (one HTTP/1.1 chunk)."""
    return conn.send(h11.Data(data=data)) or b""


def _split_even(text: str, parts: int) -> Iterator[str]:
    size = max(1, math.ceil(len(text) / parts))
    for start in range(0, len(text), size):
        yield text[start : start + size]


def _ollama_show(model: FakeModel) -> dict[str, Any]:
    """Ollama's /api/show of a model: num_ctx among its parameters unless it runs at
    Ollama's default, its training length in model_info, and its capabilities."""
    parameters = ['stop                           "<|im_end|>"']
    if model.n_ctx != min(OLLAMA_DEFAULT_CTX, model.trained):
        parameters.insert(0, f"num_ctx                        {model.n_ctx}")
    capabilities = ["completion"] + ["vision"] * ("image" in model.input_modalities) + ["tools"] * model.tools
    return {
        "modelfile": f"# Modelfile generated by \"ollama show\"\nFROM /models/{model.id}.gguf\n",
        "parameters": "\n".join(parameters),
        "template": "{{ .Prompt }}",
        "details": {"format": "gguf", "family": "llama", "parameter_size": "1B", "quantization_level": "Q4_K_M"},
        "model_info": {"general.architecture": "llama", "general.parameter_count": 10**9,
                       "llama.context_length": model.trained},
        "capabilities": capabilities,
    }


async def _until_open(gate: threading.Event) -> None:
    """Hold an answer while a test keeps ``gate`` cleared (HOLD_MAX at most): the gate is set
    from the test's thread, so the server's loop looks at it every HOLD_POLL."""
    for _ in range(int(HOLD_MAX / HOLD_POLL)):
        if gate.is_set():
            return
        await asyncio.sleep(HOLD_POLL)


async def _not_found(writer: asyncio.StreamWriter, request: _Request) -> bool:
    return await _send(writer, 404, _error_body(404, "File Not Found", "not_found_error"), request)


async def _send_text(writer: asyncio.StreamWriter, status: int, text: str, request: _Request) -> bool:
    writer.write(_response_bytes(request.conn, status, "text/plain; charset=utf-8", text.encode()))
    await writer.drain()
    return request.keep_alive


def _error_body(code: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "type": kind}}


def _response_bytes(conn: h11.Connection, status: int, kind: str, payload: bytes) -> bytes:
    """A whole response with a Content-Length body, framed by h11 (``Connection: close`` when the
    request asked for it)."""
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "Status"
    headers = [("Content-Type", kind), ("Content-Length", str(len(payload)))]
    return b"".join(conn.send(event) or b"" for event in (
        h11.Response(status_code=status, reason=phrase, headers=headers), h11.Data(data=payload), h11.EndOfMessage()))


async def _send(writer: asyncio.StreamWriter, status: int, body: Any, request: _Request) -> bool:
    writer.write(_response_bytes(request.conn, status, "application/json; charset=utf-8", json.dumps(body).encode()))
    await writer.drain()
    return request.keep_alive


def _answer_broken(conn: h11.Connection, writer: asyncio.StreamWriter, status: int, message: str) -> None:
    """An error for a request that could not be read or served, when no answer has begun."""
    if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
        payload = json.dumps({"error": {"code": status, "message": message}}).encode()
        writer.write(_response_bytes(conn, status, "application/json; charset=utf-8", payload))


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
    """The next piece of a request, reading as h11 needs."""
    while (event := conn.next_event()) is h11.NEED_DATA:
        conn.receive_data(await reader.read(HEADER_LIMIT))
    return event


def main(argv: list[str] | None = None) -> None:
    """Serve in the foreground until SIGINT or SIGTERM, printing the URL."""
    parser = argparse.ArgumentParser(prog="python -m selfcheck.fakerouter", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: any free port)")
    parser.add_argument("--format", choices=["llama", "top", "bare"], default="llama", help="shape of /v1/models")
    parser.add_argument("--mode", choices=["llama-server", "llama-swap", "ollama", "silent"], default="llama-server",
                        help="the router to imitate")
    args = parser.parse_args(argv)
    stop = threading.Event()
    # Set explicitly: a shell starting us in the background leaves SIGINT ignored.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    with FakeRouter(models_format=args.format, mode=args.mode, port=args.port) as fake:
        print(fake.url, flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
