"""The HTTP side of the OpenAI door: HTTP/1.1 framed by ``h11`` on asyncio's own streams.

One request per connection, answered with ``Connection: close``. ``read_head`` reads the
request line and headers (under ``MAX_HEAD_BYTES``, 431 above) and no byte of the body:
the door checks the key first, then ``HttpRequest.read_body`` reads a body of exactly
``Content-Length`` bytes under ``MAX_BODY_BYTES`` (413 above it, said before any byte is
read). A chunked body is refused (411): the OpenAI clients send a length. ``Expect:
100-continue`` is answered when the body is wanted (curl waits for it before a large
body). The whole request must arrive within ``REQUEST_SECONDS``. A response is a JSON body,
or an SSE stream (``text/event-stream``) of ``data:`` lines, sent chunked. Anything a
client sends after its request (a pipelined one) is read and dropped; the end of what it
sends is taken for a hang-up. Why not an ASGI server: the door serves two routes on
loopback, and this is the whole of what they need, on the loop and streams the daemon
already runs (docs/DESIGN.md, "The OpenAI door").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import h11

__all__ = ["HttpError", "HttpRequest", "HttpReply", "MAX_BODY_BYTES", "refuse_connection", "serve_connection"]

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024  # the request line and headers (h11's receive buffer while it reads them)
MAX_BODY_BYTES = 64 * 1024 * 1024  # a request body: eight photos as base64 data URLs fit
REQUEST_SECONDS = 30.0  # a client has this long to send its request (a silent one is hung up on)
MAX_WRITE_BUFFER = 32 * 1024 * 1024  # a client that reads none of its reply is dropped past this
READ_CHUNK = 64 * 1024
# after an answer given before the body (401, 413), what the client still sends of it is read
# and dropped this long: closing with it unread resets the connection, and the answer with it
LINGER_SECONDS = 2.0
# headers whose repetition makes a request ambiguous (h11 checks Content-Length's itself)
SINGLE_HEADERS = ("authorization", "host")


class HttpError(Exception):
    """A request answered with an error status, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.kind = kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.code}}


class ClientGone(Exception):
    """The client closed its side, or sent nothing in time: there is no one to answer."""


class _Wire:
    """One connection's streams and its ``h11`` state, and when its request must have arrived."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.deadline = asyncio.get_running_loop().time() + REQUEST_SECONDS

    async def next_event(self) -> Any:
        """The next piece of the request, reading as h11 needs (within the request's time)."""
        try:
            async with asyncio.timeout_at(self.deadline):
                while (event := self.h11.next_event()) is h11.NEED_DATA:
                    self.h11.receive_data(await self.reader.read(READ_CHUNK))
        except (TimeoutError, ConnectionError, OSError) as exc:
            raise ClientGone from exc
        if isinstance(event, h11.ConnectionClosed):
            raise ClientGone
        return event


@dataclass
class HttpRequest:
    """One request as read: method, path (without its query), headers by lower-case name; its
    body once ``read_body`` has read it."""

    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    length: int = 0  # the body's Content-Length
    _wire: _Wire | None = field(default=None, repr=False)

    async def read_body(self) -> bytes:
        """Read the body (answering ``Expect: 100-continue``); ``ClientGone`` when it does not come."""
        wire = self._wire
        if wire is None or not self.length:
            return self.body
        if wire.h11.they_are_waiting_for_100_continue:
            wire.writer.write(wire.h11.send(h11.InformationalResponse(status_code=100, reason="Continue", headers=[])))
        parts: list[bytes] = []
        try:
            while not isinstance(event := await wire.next_event(), h11.EndOfMessage):
                parts.append(event.data)
        except h11.RemoteProtocolError as exc:  # it closed before the whole body came
            raise ClientGone from exc
        self.body = b"".join(parts)
        return self.body


async def read_head(wire: _Wire) -> HttpRequest:
    """Read one request's line and headers, or raise ``HttpError`` saying what is wrong with them."""
    try:
        event = await wire.next_event()
    except h11.RemoteProtocolError as exc:
        if exc.error_status_hint == 431:
            raise HttpError(431, f"the request line and headers may take at most {MAX_HEAD_BYTES} bytes") from None
        if exc.error_status_hint == 501:  # a Transfer-Encoding other than chunked
            raise HttpError(411, "send the body with a Content-Length header, not a Transfer-Encoding") from None
        raise HttpError(exc.error_status_hint, f"not an HTTP/1.1 request the door can read: {exc}") from None
    headers: dict[str, str] = {}
    for raw_name, raw_value in event.headers:
        name, value = raw_name.decode("latin-1"), raw_value.decode("latin-1")
        if name in headers and name in SINGLE_HEADERS:
            raise HttpError(400, f"the {name} header is given twice")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    method = event.method.decode("latin-1")
    request = HttpRequest(method, event.target.decode("latin-1").partition("?")[0], headers, _wire=wire)
    if "transfer-encoding" in headers:
        raise HttpError(411, "send the body with a Content-Length header, not chunked")
    if "content-length" not in headers:
        if method == "POST":
            raise HttpError(411, "a POST needs a Content-Length header")
        return request
    request.length = int(headers["content-length"])  # h11 has checked it is a number
    if request.length > MAX_BODY_BYTES:
        raise HttpError(413, f"a request body may have at most {MAX_BODY_BYTES // (1024 * 1024)} MiB; send fewer "
                        "or smaller files", code="request_too_large")
    return request


class HttpReply:
    """The answer to one request: a JSON body, or a stream of server-sent events."""

    def __init__(self, wire: _Wire) -> None:
        self._wire = wire
        self._reader = wire.reader
        self._writer = wire.writer
        self.started = False  # the status line went out
        self.status = 0
        self._pending: list[bytes] = []  # written in this turn of the loop after its first write
        self._batching = False

    @property
    def gone(self) -> bool:
        """The client hung up (or was dropped): nothing written reaches it."""
        return self._writer.transport.is_closing()

    def _head(self, status: int, headers: dict[str, str]) -> bytes:
        self.started, self.status = True, status
        response = h11.Response(status_code=status, reason=HTTPStatus(status).phrase,
                                headers=[*headers.items(), ("Connection", "close")])
        return self._wire.h11.send(response) or b""

    def _data(self, data: bytes) -> bytes:
        return self._wire.h11.send(h11.Data(data=data)) or b""

    def _write(self, data: bytes) -> None:
        """The first write in a turn of the loop leaves at once (a first token is not held back),
        the rest of that turn's in one write at its end, as the socket's connection does."""
        if self._batching:
            self._pending.append(data)
            return
        self._send([*self._pending, data])  # with what was held for it (a stream's head)
        self._pending = []
        self._batching = True
        asyncio.get_running_loop().call_soon(self._end_batch)

    def flush(self) -> None:
        """Send what waits for the end of this turn of the loop now (the connection is closing)."""
        self._end_batch()

    def end(self) -> None:
        """The response is whole: a stream's last chunk goes out (a stream cut short gets none)."""
        if self._wire.h11.our_state is h11.SEND_BODY:
            self._write(self._wire.h11.send(h11.EndOfMessage()) or b"")

    def _end_batch(self) -> None:
        self._batching = False
        if self._pending:
            self._send(self._pending)
            self._pending = []

    def _send(self, data: list[bytes]) -> None:
        if self.gone:
            return
        transport = self._writer.transport
        if transport.get_write_buffer_size() > MAX_WRITE_BUFFER:
            logger.warning("an OpenAI client is not reading its reply; dropping it")
            transport.abort()
            return
        transport.writelines(data)

    def json(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
        head = self._head(status, {"Content-Type": "application/json", "Content-Length": str(len(data)),
                                   **(headers or {})})
        self._write(head + self._data(data) + (self._wire.h11.send(h11.EndOfMessage()) or b""))

    def error(self, exc: HttpError) -> None:
        self.json(exc.status, exc.body(), exc.headers)

    def start_stream(self, headers: dict[str, str], first: dict[str, Any]) -> None:
        """The stream's head and ``first`` event, held to leave in one write with the next event
        (a first token's, the one the client waits for), or with what ends the stream."""
        self._pending += [self._head(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **headers}), self._data(_event_bytes(first))]

    def event(self, data: dict[str, Any] | str) -> None:
        """One ``data:`` event: a JSON object, or JSON text as it is (``[DONE]``, a chunk made ahead)."""
        self._write(self._data(_event_bytes(data)))

    def comment(self, text: str) -> None:
        """An SSE comment line, which clients skip: what the daemon does meanwhile, for a person reading."""
        self._write(self._data(f": {' '.join(text.split())}\n\n".encode("utf-8", "surrogatepass")))

    async def hung_up(self) -> None:
        """Return once the client has closed its side: what it sent after its request (a pipelined
        one) is dropped. Its end is taken for a hang-up, also a half-close that would still read
        (TCP tells them apart only once a write fails): the connection closes with what was
        sent, so the client never reads an ending its stored turn (cancelled) contradicts."""
        with contextlib.suppress(ConnectionError, OSError):
            while await self._reader.read(READ_CHUNK):
                pass
        self._pending = []
        self._writer.transport.close()


def _event_bytes(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode("utf-8", "surrogatepass")


Handler = Callable[[HttpRequest, HttpReply], Awaitable[None]]


def refuse_connection(writer: asyncio.StreamWriter, error: HttpError) -> None:
    """Answer a connection with ``error`` before reading anything of it, and close it."""
    reply = HttpReply(_Wire(asyncio.StreamReader(), writer))
    reply.error(error)
    reply.flush()
    writer.close()


async def serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handle: Handler) -> None:
    """Read one request's head, have ``handle`` answer it (reading its body when it wants), close.
    A failure of ours is a 500, never a dead daemon."""
    wire = _Wire(reader, writer)
    reply = HttpReply(wire)
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        # chunks are small and each one awaited: none may wait for the client's ACK (Nagle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        try:
            request = await read_head(wire)
        except HttpError as exc:
            reply.error(exc)
            return
        await handle(request, reply)
        reply.end()
    except ClientGone:
        pass  # it left, or said nothing in time: there is no one to answer
    except Exception:
        logger.exception("an OpenAI request failed")
        if not reply.started:
            reply.error(HttpError(500, "internal error, see the daemon's log", kind="server_error"))
    finally:
        reply.flush()
        try:
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                if writer.can_write_eof() and not writer.transport.is_closing():
                    writer.write_eof()
                    if reply.started and wire.h11.their_state is h11.SEND_BODY:
                        await _linger(reader)
        finally:
            writer.close()


async def _linger(reader: asyncio.StreamReader) -> None:
    """Read and drop the rest of a body the answer did not need, for ``LINGER_SECONDS`` at most
    (a chunk at a time: nothing of it is kept)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_SECONDS):
            while await reader.read(READ_CHUNK):
                pass
