"""The router client's HTTP transport: HTTP/1.1 on asyncio streams, one request per connection.

httpx's own transport (httpcore on anyio, h11) costs about 1 ms a request on this
class of machine, measured from the POST to the first streamed chunk against a
loopback server: twice what the whole request costs on plain asyncio streams.  That
millisecond is on every turn's way to its first token (``bench/bench_ttft.py``), so
the daemon gives httpx this transport instead; the client above it (requests,
``Timeout``, the exception tree, decoding, ``aiter_lines``) stays httpx's.

What it does, no more: ``http`` and ``https`` (verified with the system's CA
certificates), a fresh connection for every request sent with ``Connection: close``
(llama-server closes a connection soon after a stream while announcing keep-alive,
docs/DESIGN.md "llama-server quirks"; on loopback a connect costs 0.1–0.3 ms), response
bodies framed by ``Transfer-Encoding: chunked``, ``Content-Length`` or the end of the
connection, interim 1xx answers skipped.  No proxies: the daemon talks to the
``router_url`` it is given (README, "Configuration").  Failures are httpx's own
exceptions, so ``RouterClient`` maps them as it would httpx's transport's: connect
refused or unresolvable is ``ConnectError``, each timeout its ``*Timeout``, a
server that stops mid-body ``RemoteProtocolError``.

One request extension: ``SENT``, a callable the transport calls once the request has
been written, before the answer is awaited (``RouterClient.stream_chat`` tells the
client the request left then, so that the client's work does not compete with it).

Closing the response (httpx does when ``async with client.stream(...)`` exits, on a
cancel too) closes the connection, so the server sees the client go and stops
generating.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

import httpx

__all__ = ["SENT", "OneShotTransport"]

SENT = "sent"  # the request extension called once the request is written
READ_SIZE = 65536  # bytes asked of the socket at a time
MAX_HEADERS = 100  # header lines in one response; a server sending more is broken
# StreamReader's line limit: a status, header or chunk-size line longer than this is refused
LINE_LIMIT = 65536
NO_BODY = frozenset({204, 304})


class OneShotTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over a new asyncio connection per request (see the module docstring)."""

    def __init__(self) -> None:
        self._tls: ssl.SSLContext | None = None  # made with the first https request: loading CAs costs ~20 ms

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        reader, writer = await self._connect(request, timeouts.get("connect"))
        try:
            await _send(request, writer, timeouts.get("write"))
            if (sent := request.extensions.get(SENT)) is not None:
                sent()
            status, reason, headers = await _read_head(request, reader, timeouts.get("read"))
            framing = _framing(request, status, headers)
        except BaseException:
            writer.transport.abort()
            raise
        body = _Body(request, reader, writer, framing, timeouts.get("read"))
        return httpx.Response(
            status, headers=headers, stream=body, extensions={"http_version": b"HTTP/1.1", "reason_phrase": reason}
        )

    async def _connect(
        self, request: httpx.Request, timeout: float | None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        url = request.url
        tls: ssl.SSLContext | None = None
        if url.scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        elif url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"the URL scheme {url.scheme!r} is not http or https", request=request)
        port = url.port or (443 if tls else 80)
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.open_connection(url.host, port, ssl=tls, limit=LINE_LIMIT)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection within {timeout:g} s", request=request) from None
        except (OSError, ssl.SSLError) as exc:  # refused, unreachable, unresolvable, a bad certificate
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from exc


def _head(request: httpx.Request) -> bytes:
    """The request line and headers, with ``Connection: close`` whatever the client set."""
    url = request.url
    lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), url.raw_path)]
    lines += [b"%s: %s" % (name, value) for name, value in request.headers.raw if name.lower() != b"connection"]
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def _send(request: httpx.Request, writer: asyncio.StreamWriter, timeout: float | None) -> None:
    body = await request.aread()
    try:
        writer.write(_head(request) + body)
        async with asyncio.timeout(timeout):
            await writer.drain()
    except TimeoutError:
        raise httpx.WriteTimeout(f"the request was not sent within {timeout:g} s", request=request) from None
    except OSError as exc:
        raise httpx.WriteError(str(exc) or type(exc).__name__, request=request) from exc


async def _read_line(request: httpx.Request, reader: asyncio.StreamReader, timeout: float | None) -> bytes:
    """One line with its ending, b"" at the end of the connection; failures as httpx's."""
    try:
        async with asyncio.timeout(timeout):
            return await reader.readuntil(b"\n")
    except TimeoutError:
        raise httpx.ReadTimeout(f"nothing received for {timeout:g} s", request=request) from None
    except asyncio.IncompleteReadError as exc:
        return exc.partial
    except asyncio.LimitOverrunError:
        raise httpx.RemoteProtocolError(f"a line longer than {LINE_LIMIT} bytes", request=request) from None
    except OSError as exc:
        raise httpx.ReadError(str(exc) or type(exc).__name__, request=request) from exc


async def _read_head(
    request: httpx.Request, reader: asyncio.StreamReader, timeout: float | None
) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """The final status, its reason and headers; 1xx answers before it are skipped."""
    while True:
        line = await _read_line(request, reader, timeout)
        if not line:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        version, _, rest = line.rstrip(b"\r\n").partition(b" ")
        code, _, reason = rest.partition(b" ")
        if not version.startswith(b"HTTP/1.") or not code.isdigit() or len(code) != 3:
            raise httpx.RemoteProtocolError(f"not an HTTP/1.1 status line: {line[:80]!r}", request=request)
        headers: list[tuple[bytes, bytes]] = []
        while (line := await _read_line(request, reader, timeout)).strip():
            name, colon, value = line.partition(b":")
            if not colon or len(headers) >= MAX_HEADERS:
                raise httpx.RemoteProtocolError(f"a malformed response header: {line[:80]!r}", request=request)
            headers.append((name.strip(), value.strip()))
        if not line:
            raise httpx.RemoteProtocolError("Server disconnected in the middle of the headers.", request=request)
        status = int(code)
        if not 100 <= status < 200:
            return status, reason, headers


def _framing(request: httpx.Request, status: int, headers: list[tuple[bytes, bytes]]) -> int | str:
    """How the body ends: "chunked", "close" (at the end of the connection) or its length."""
    if request.method == "HEAD" or status in NO_BODY:
        return 0
    fields = {name.lower(): value for name, value in headers}
    if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
        return "chunked"
    length = fields.get(b"content-length")
    if length is None:
        return "close"
    if not length.strip().isdigit():
        raise httpx.RemoteProtocolError(f"a malformed Content-Length: {length[:40]!r}", request=request)
    return int(length)


class _Body(httpx.AsyncByteStream):
    """A response body read from its connection as it arrives; closing it closes the connection."""

    def __init__(
        self,
        request: httpx.Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        framing: int | str,
        timeout: float | None,
    ) -> None:
        self._request, self._reader, self._writer = request, reader, writer
        self._framing, self._timeout = framing, timeout

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._framing == "chunked":
            chunks = self._chunked()
        elif self._framing == "close":
            chunks = self._until_closed()
        else:
            assert isinstance(self._framing, int)
            chunks = self._sized(self._framing)
        async for chunk in chunks:
            yield chunk

    async def aclose(self) -> None:
        self._writer.close()

    async def _read(self, size: int) -> bytes:
        try:
            async with asyncio.timeout(self._timeout):
                return await self._reader.read(size)
        except TimeoutError:
            raise httpx.ReadTimeout(f"nothing received for {self._timeout:g} s", request=self._request) from None
        except OSError as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__, request=self._request) from exc

    def _truncated(self) -> httpx.RemoteProtocolError:
        return httpx.RemoteProtocolError(
            "peer closed connection without sending complete message body", request=self._request
        )

    async def _sized(self, left: int) -> AsyncIterator[bytes]:
        while left:
            data = await self._read(min(left, READ_SIZE))
            if not data:
                raise self._truncated()
            left -= len(data)
            yield data

    async def _until_closed(self) -> AsyncIterator[bytes]:
        while data := await self._read(READ_SIZE):
            yield data

    async def _chunked(self) -> AsyncIterator[bytes]:
        while True:
            line = await _read_line(self._request, self._reader, self._timeout)
            if not line:
                raise self._truncated()
            size = line.split(b";", 1)[0].strip()
            try:
                left = int(size, 16)
            except ValueError:
                left = -1
            if left < 0:
                raise httpx.RemoteProtocolError(f"a malformed chunk size: {line[:40]!r}", request=self._request)
            if left == 0:
                break
            async for data in self._sized(left):
                yield data
            if (await _read_line(self._request, self._reader, self._timeout)).strip():
                raise httpx.RemoteProtocolError("a chunk longer than its size", request=self._request)
        while (line := await _read_line(self._request, self._reader, self._timeout)).strip():
            pass  # trailers: nothing the client needs
