"""A recording HTTP proxy for loopback: what the daemon asked llama-server, and what the server said of it.

The daemon is pointed at the proxy's URL instead of the server's.  Every
connection is relayed as bytes in both directions, untouched (a streamed reply
reaches the daemon as the server sends it); beside the relay, a copy of each
direction is split into HTTP/1.1 messages (``Content-Length``, chunked, or to
the close) so the proxy can note, for each ``POST .../chat/completions``, the
request body and the server's ``timings`` (``prompt_n``, ``cache_n``,
``prompt_ms``, ...) from the last streamed chunk or the plain JSON answer.  That
works whatever the daemon itself reports.

Standard library only; one asyncio server in the caller's event loop.  The listening
socket may be bound before the loop runs (``listening_socket()``), so a client such
as the daemon can be started, from the main thread, already pointed at it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import urllib.parse
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Exchange", "MessageParser", "RecordingProxy", "listening_socket"]

READ_SIZE = 1 << 16
CHAT_PATH = "/chat/completions"
NO_BODY_STATUSES = (204, 304)


@dataclass
class Message:
    """One HTTP message: its start line, headers (lower-case names) and body (de-chunked)."""

    start: str
    headers: dict[str, str]
    body: bytes


class MessageParser:
    """Splits one direction of an HTTP/1.1 connection into messages, fed as bytes arrive."""

    def __init__(self, responses: bool) -> None:
        self.responses = responses
        self._buf = bytearray()
        self._head: tuple[str, dict[str, str]] | None = None
        self._body = bytearray()
        self._mode = ""  # "length", "chunked" or "close"
        self._left = 0  # body bytes still due ("length") or of the current chunk ("chunked")
        self._in_chunk = False
        self._trailer = False
        self.broken = False

    def feed(self, data: bytes) -> list[Message]:
        """The messages ``data`` completes; none once the stream proved not to be HTTP/1.1 as expected."""
        if self.broken:
            return []
        self._buf += data
        done: list[Message] = []
        try:
            while (message := self._step()) is not None:
                if message.start:
                    done.append(message)
        except (ValueError, IndexError):
            self.broken = True  # the relay goes on; only the record stops
        return done

    def eof(self) -> list[Message]:
        """The message whose body ran to the close, if one did."""
        if self._head is not None and self._mode == "close":
            self._body += self._buf
            self._buf.clear()
            return [self._finish()]
        return []

    def _step(self) -> Message | None:
        """One message if the buffer completes one (an empty start line: a 1xx, skipped); else None."""
        if self._head is None:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                return None
            head = bytes(self._buf[:end]).decode("latin-1")
            del self._buf[: end + 4]
            if self._begin(head):
                return Message("", {}, b"")
        if self._mode == "length":
            return self._length_step()
        if self._mode == "chunked":
            return self._chunk_step()
        return None  # "close": everything up to eof()

    def _begin(self, head: str) -> bool:
        """Read a message's head; True if it is an interim (1xx) response, which has no body."""
        start, *lines = head.split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        status = int(start.split()[1]) if self.responses else 0
        if 100 <= status < 200:
            return True
        self._head = (start, headers)
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._mode, self._in_chunk, self._trailer = "chunked", False, False
        elif "content-length" in headers or not self.responses or status in NO_BODY_STATUSES:
            self._mode, self._left = "length", int(headers.get("content-length", "0") or 0)
        else:
            self._mode = "close"
        return False

    def _length_step(self) -> Message | None:
        take = min(self._left, len(self._buf))
        self._body += self._buf[:take]
        del self._buf[:take]
        self._left -= take
        return self._finish() if self._left == 0 else None

    def _chunk_step(self) -> Message | None:
        while True:
            if self._in_chunk:
                if len(self._buf) < self._left + 2:
                    return None
                self._body += self._buf[: self._left]
                del self._buf[: self._left + 2]
                self._in_chunk = False
                continue
            end = self._buf.find(b"\r\n")
            if end < 0:
                return None
            line = bytes(self._buf[:end])
            del self._buf[: end + 2]
            if self._trailer:
                if not line:
                    return self._finish()
            else:
                self._left = int(line.split(b";")[0].strip() or b"0", 16)
                self._trailer = self._left == 0
                self._in_chunk = self._left > 0

    def _finish(self) -> Message:
        assert self._head is not None
        message = Message(self._head[0], self._head[1], bytes(self._body))
        self._head, self._body, self._mode = None, bytearray(), ""
        return message


@dataclass
class Exchange:
    """One chat completion that went through the proxy: the request, and what the server answered."""

    label: Any  # the caller's ``RecordingProxy.label`` when the request arrived
    request: dict[str, Any]
    status: int = 0  # 0: no answer came
    timings: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    reply: str = ""
    error: str = ""

    @property
    def streamed(self) -> bool:
        return bool(self.request.get("stream"))


@dataclass
class _Request:
    exchange: Exchange | None  # None: not a chat completion (models, props, ...)


def _decoded(message: Message) -> bytes:
    encoding = message.headers.get("content-encoding", "").lower()
    if encoding in ("gzip", "deflate"):
        return zlib.decompress(message.body, wbits=47)  # 47: gzip or zlib header, detected
    return message.body


def _error_text(error: Any) -> str:
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


def _read_answer(exchange: Exchange, message: Message) -> None:
    """Fill the exchange from a streamed (SSE) or a plain JSON answer."""
    exchange.status = int(message.start.split()[1])
    text = _decoded(message).decode("utf-8", errors="replace")
    if "text/event-stream" in message.headers.get("content-type", ""):
        objects = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    else:
        objects = [text]
    parts: list[str] = []
    for raw in objects:
        with contextlib.suppress(ValueError):
            obj = json.loads(raw)
            if not isinstance(obj, dict):
                continue
            exchange.timings = obj.get("timings") or exchange.timings
            exchange.usage = obj.get("usage") or exchange.usage
            if obj.get("error"):
                exchange.error = _error_text(obj["error"])
            for choice in obj.get("choices") or ():
                said = choice.get("delta") or choice.get("message") or {}
                if isinstance(said.get("content"), str):
                    parts.append(said["content"])
    exchange.reply = "".join(parts)


def listening_socket() -> socket.socket:
    """A loopback socket bound to a free port and listening, for ``RecordingProxy(sock=...)``."""
    return socket.create_server(("127.0.0.1", 0))


class RecordingProxy:
    """Relays loopback HTTP to ``upstream`` and records every chat completion in ``exchanges``."""

    def __init__(self, upstream: str, sock: socket.socket | None = None) -> None:
        """Relay to ``upstream`` (http://HOST:PORT); listen on ``sock``, else on a free loopback port."""
        parts = urllib.parse.urlsplit(upstream)
        self.host, self.port_upstream = parts.hostname or "127.0.0.1", parts.port or 80
        self.exchanges: list[Exchange] = []
        self.label: Any = None  # set by the caller; copied into each exchange as it arrives
        self.in_flight = 0  # requests of any kind sent on and not yet answered
        self._sock = sock
        self.port = sock.getsockname()[1] if sock is not None else 0
        self._changed = asyncio.Condition()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> RecordingProxy:
        if self._sock is not None:
            self._server = await asyncio.start_server(self._relay, sock=self._sock)
        else:
            self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate()`` holds (checked as exchanges end); False on timeout."""
        try:
            async with asyncio.timeout(timeout), self._changed:
                await self._changed.wait_for(predicate)
        except TimeoutError:
            return False
        return True

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        # cancelled only when the loop shuts down under an interrupted run: not re-raised,
        # since 3.11's start_server would log it as an "exception in callback"
        with contextlib.suppress(asyncio.CancelledError):
            await self._relay_connection(client_reader, client_writer)

    async def _relay_connection(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(self.host, self.port_upstream)
        except OSError:
            client_writer.close()
            return
        pending: deque[_Request] = deque()
        self._writers.update((client_writer, server_writer))
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._requests(client_reader, server_writer, pending))
                group.create_task(self._answers(server_reader, client_writer, pending))
        except* (ConnectionError, OSError):
            pass  # either side hung up mid-message: what was recorded stays
        finally:
            for writer in (client_writer, server_writer):
                self._writers.discard(writer)
                writer.close()
            await self._settle(pending)

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pending: deque[_Request]) -> None:
        parser = MessageParser(responses=False)
        while data := await reader.read(READ_SIZE):
            for message in parser.feed(data):
                pending.append(self._on_request(message))
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    async def _answers(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pending: deque[_Request]) -> None:
        parser = MessageParser(responses=True)
        while data := await reader.read(READ_SIZE):
            # noted before it is passed on: a client that hangs up once it has read the end
            # of a stream (the daemon does) must not cost the record of that end
            for message in parser.feed(data):
                await self._on_answer(pending, message)
            writer.write(data)
            await writer.drain()
        for message in parser.eof():
            await self._on_answer(pending, message)
        writer.close()

    def _on_request(self, message: Message) -> _Request:
        self.in_flight += 1
        method, _, rest = message.start.partition(" ")
        path = rest.split(" ", 1)[0].split("?", 1)[0]
        if method != "POST" or not path.endswith(CHAT_PATH):
            return _Request(None)
        try:
            body = json.loads(_decoded(message))
        except ValueError:
            body = {}
        exchange = Exchange(self.label, body if isinstance(body, dict) else {})
        self.exchanges.append(exchange)
        return _Request(exchange)

    async def _on_answer(self, pending: deque[_Request], message: Message) -> None:
        if not pending:
            return
        request = pending.popleft()
        if request.exchange is not None:
            _read_answer(request.exchange, message)
        await self._done()

    async def _settle(self, pending: deque[_Request]) -> None:
        """Requests the connection closed on without an answer."""
        while pending:
            request = pending.popleft()
            if request.exchange is not None:
                request.exchange.error = request.exchange.error or "the connection closed before an answer"
            await self._done()

    async def _done(self) -> None:
        async with self._changed:
            self.in_flight -= 1
            self._changed.notify_all()

