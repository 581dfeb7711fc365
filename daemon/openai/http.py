"""The HTTP side of the OpenAI door: a small, strict HTTP/1.1 server on asyncio's own streams.

One request per connection, answered with ``Connection: close``: the request line, headers
under ``MAX_HEAD_BYTES``, and a body of exactly ``Content-Length`` bytes under
``MAX_BODY_BYTES`` (413 above it). A chunked body is refused (411): the OpenAI clients send a
length. ``Expect: 100-continue`` is answered, as curl waits for it before a large body. A
response is a JSON body, or an SSE stream (``text/event-stream``) of ``data:`` lines ended by
closing the connection. Why not an ASGI server: the door serves two routes on loopback,
and this is the whole of what they need, on the loop and streams the daemon already runs
(docs/DESIGN.md, "The OpenAI door").
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

__all__ = ["HttpError", "HttpRequest", "HttpReply", "MAX_BODY_BYTES", "serve_connection"]

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024  # the request line and headers
MAX_BODY_BYTES = 64 * 1024 * 1024  # a request body: eight photos as base64 data URLs fit
HEAD_SECONDS = 30.0  # a client has this long to send its request (a silent one is hung up on)
MAX_WRITE_BUFFER = 32 * 1024 * 1024  # a client that reads none of its reply is dropped past this
READ_CHUNK = 64 * 1024


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


@dataclass
class HttpRequest:
    """One request as read: method, path (without its query), headers by lower-case name, body."""

    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


async def read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> HttpRequest:
    """Read one request, or raise ``HttpError`` saying what is wrong with it."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise HttpError(431, f"the request line and headers may take at most {MAX_HEAD_BYTES} bytes") from None
    lines = head.decode("latin-1").split("\r\n")[:-2]
    parts = lines[0].split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
        raise HttpError(400, "the request line must be METHOD PATH HTTP/1.1")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise HttpError(400, f"a header line must be Name: value, not {line[:80]!r}")
        name = name.lower()
        if name in headers and name in ("content-length", "authorization", "host"):
            raise HttpError(400, f"the {name} header is given twice")
        headers[name] = f"{headers[name]}, {value.strip()}" if name in headers else value.strip()
    request = HttpRequest(parts[0], parts[1].partition("?")[0], headers)
    request.body = await _read_body(reader, writer, request)
    return request


async def _read_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: HttpRequest) -> bytes:
    headers = request.headers
    if "transfer-encoding" in headers:
        raise HttpError(411, "send the body with a Content-Length header, not chunked")
    length_text = headers.get("content-length")
    if length_text is None:
        if request.method == "POST":
            raise HttpError(411, "a POST needs a Content-Length header")
        return b""
    if not length_text.isascii() or not length_text.isdigit():
        raise HttpError(400, f"Content-Length must be a number of bytes, not {length_text[:40]!r}")
    length = int(length_text)
    if length > MAX_BODY_BYTES:
        raise HttpError(413, f"a request body may have at most {MAX_BODY_BYTES // (1024 * 1024)} MiB; send fewer "
                        "or smaller files", code="request_too_large")
    if length and headers.get("expect", "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    return await reader.readexactly(length)


class HttpReply:
    """The answer to one request: a JSON body, or a stream of server-sent events."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
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
        lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", *(f"{k}: {v}" for k, v in headers.items()),
                 "Connection: close", "", ""]
        return "\r\n".join(lines).encode("latin-1")

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
        self._write(self._head(status, {"Content-Type": "application/json", "Content-Length": str(len(data)),
                                        **(headers or {})}) + data)

    def error(self, exc: HttpError) -> None:
        self.json(exc.status, exc.body(), exc.headers)

    def start_stream(self, headers: dict[str, str], first: dict[str, Any]) -> None:
        """The stream's head and ``first`` event, held to leave in one write with the next event
        (a first token's, the one the client waits for), or with what ends the stream."""
        self._pending += [self._head(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                            **headers}), _event_bytes(first)]

    def event(self, data: dict[str, Any] | str) -> None:
        """One ``data:`` event: a JSON object, or JSON text as it is (``[DONE]``, a chunk made ahead)."""
        self._write(_event_bytes(data))

    def comment(self, text: str) -> None:
        """An SSE comment line, which clients skip: what the daemon does meanwhile, for a person reading."""
        self._write(f": {' '.join(text.split())}\n\n".encode("utf-8", "surrogatepass"))

    async def hung_up(self) -> None:
        """Return once the client has closed its side (one request a connection: anything more is dropped)."""
        with contextlib.suppress(ConnectionError, OSError):
            while await self._reader.read(READ_CHUNK):
                pass


def _event_bytes(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode("utf-8", "surrogatepass")


Handler = Callable[[HttpRequest, HttpReply], Awaitable[None]]


async def serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handle: Handler) -> None:
    """Read one request, have ``handle`` answer it, close. A failure of ours is a 500, never a dead daemon."""
    reply = HttpReply(reader, writer)
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        # chunks are small and each one awaited: none may wait for the client's ACK (Nagle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        try:
            async with asyncio.timeout(HEAD_SECONDS):
                request = await read_request(reader, writer)
        except HttpError as exc:
            reply.error(exc)
            return
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, OSError):
            return  # it left, or said nothing in time: there is no one to answer
        await handle(request, reply)
    except Exception:
        logger.exception("an OpenAI request failed")
        if not reply.started:
            reply.error(HttpError(500, "internal error, see the daemon's log", kind="server_error"))
    finally:
        reply.flush()
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            if writer.can_write_eof() and not writer.transport.is_closing():
                writer.write_eof()
            writer.close()
