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

Two request extensions: ``SENT``, a callable the transport calls once the request has
been written, before the answer is awaited (``RouterClient.stream_chat`` tells the
client the request left then, so that the client's work does not compete with it);
and ``AHEAD``, true on the request a connection was opened ahead for.

``connect_ahead(url)`` opens the connection for a request about to be made while the
caller does other work: the daemon calls it just before it stores a question, so the
connect (and an https handshake) overlaps that trip to the history thread instead of
following it (0.3-0.4 ms of the first token, bench/bench_ttft.py). The next request to
that host and port marked ``AHEAD`` takes it, not one made on the way (a knowledge-base
query's embedding, a context size asked for): the chat request would connect after
them. One not taken within ``SPARE_FOR`` seconds is closed, so a turn refused after it
holds no server connection for long.

Closing the response (httpx does when ``async with client.stream(...)`` exits, on a
cancel too) closes the connection, so the server sees the client go and stops
generating.

``Client`` is httpx's client with every response ``release``d once it is closed: httpx
wraps each response's stream in an object that points back to the response (to set
``elapsed`` at close), a reference cycle only the cyclic garbage collector frees. Left
to it, each response kept its request alive until the collector's next pass, and with
the request the prompt's body and the callbacks in its extensions (through them the
turn's whole state, ~70 objects a turn): what set the collector off, a pass every ten
questions or so that found those to free (0.2-0.4 ms on a cold cache), and one question
in twenty-five met it between its line and its request (docs/DESIGN.md, "One trip to the
store").
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["AHEAD", "SENT", "Client", "OneShotTransport", "release"]

SENT = "sent"  # the request extension called once the request is written
AHEAD = "ahead"  # the request extension that takes the connection opened ahead (connect_ahead)
READ_SIZE = 65536  # bytes asked of the socket at a time
MAX_HEADERS = 100  # header lines in one response; a server sending more is broken
# StreamReader's line limit: a status, header or chunk-size line longer than this is refused
LINE_LIMIT = 65536
NO_BODY = frozenset({204, 304})
SPARE_FOR = 2.0  # seconds a connection made ahead waits for its request before it is closed
SPENT = httpx.ByteStream(b"")  # a released response's stream: it was read, or closed unread


class Client(httpx.AsyncClient):
    """httpx's client, each response released once it is closed (the module docstring): one
    read whole by ``send`` (read as httpx's own ``send`` reads it), a streamed one by
    ``stream`` as its context closes it; ``send(stream=True)`` leaves that to its caller."""

    async def send(self, request: httpx.Request, *, stream: bool = False, **kwargs: Any) -> httpx.Response:
        response = await super().send(request, stream=True, **kwargs)
        for earlier in response.history:  # redirects and auth rounds, read and closed
            release(earlier)
        if stream:
            return response
        try:
            await response.aread()
        except BaseException:
            await response.aclose()
            raise
        finally:
            release(response)
        return response

    @asynccontextmanager
    async def stream(self, method: str, url: httpx.URL | str, **kwargs: Any) -> AsyncIterator[httpx.Response]:
        response: httpx.Response | None = None
        try:
            async with super().stream(method, url, **kwargs) as response:
                yield response
        finally:
            if response is not None:
                release(response)


def release(response: httpx.Response) -> None:
    """Drop a closed response's stream, and with it the stream's reference back to the response."""
    response.stream = SPENT


class OneShotTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over a new asyncio connection per request (see the module docstring)."""

    def __init__(self) -> None:
        self._tls: ssl.SSLContext | None = None  # made with the first https request: loading CAs costs ~20 ms
        self._spare: _Spare | None = None  # a connection opened ahead (``connect_ahead``)
        self._targets: dict[str, _Target | None] = {}  # url -> where connect_ahead goes
        # (host, port) -> the socket family and address its last connection made by name reached
        self._reached: dict[tuple[str, int], tuple[int, Any]] = {}

    def connect_ahead(self, url: str) -> None:
        """Open a connection to ``url``'s server now, for a request about to be sent there.

        The connect, and for https the TLS handshake, then happen while the caller does
        other work (the daemon stores the question meanwhile). The next request to that
        host and port with the ``AHEAD`` extension takes the connection if it comes within
        ``SPARE_FOR`` seconds; otherwise it is closed. A server named by a host name
        (``localhost``) is connected to at the loopback address its last connection made
        by name reached, once there was one: resolving the name here would block. A name
        that led elsewhere is not connected to ahead: an address met once may have moved
        (DHCP, a VPN), and a connect that hangs would cost the request its connect timeout;
        a loopback one is refused at once when nothing listens there, and the request then
        connects by name.
        """
        if url not in self._targets:
            self._targets[url] = _target(url)
        target = self._targets[url]
        if target is None:
            return
        reached = target.literal or self._reached.get((target.host, target.port))
        if reached is None:
            return
        family, address = reached
        self._drop_spare()
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(address)
        except BlockingIOError:
            pass  # under way
        except OSError:
            sock.close()  # refused: the request connects itself, and reports it
            return
        tls = self._context() if target.secure else None
        loop = asyncio.get_running_loop()
        opening = loop.create_task(_open(sock, address, tls, target.host), name="router-connect-ahead")
        self._spare = _Spare((target.host, target.port), sock, opening, loop.call_later(SPARE_FOR, self._drop_spare))

    async def aclose(self) -> None:
        """Close the connection opened ahead, if one waits (the client closes with the daemon)."""
        spare, self._spare = self._spare, None
        if spare is not None:
            _discard(spare)
            await asyncio.gather(spare.opening, return_exceptions=True)

    def _drop_spare(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            _discard(spare)

    async def _take_spare(self, address: tuple[str, int]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The connection opened ahead to ``address``; None if there is none, or it failed."""
        spare = self._spare
        if spare is None or spare.address != address:
            return None
        self._spare = None
        spare.timer.cancel()
        try:
            return await asyncio.shield(spare.opening)
        except asyncio.CancelledError:
            _discard(spare)
            raise
        except (OSError, ssl.SSLError):
            del spare  # its task holds the failure, whose traceback holds this frame
            return None  # the request connects itself, and reports what fails

    def _context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

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
        if url.scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(f"the URL scheme {url.scheme!r} is not http or https", request=request)
        tls = self._context() if url.scheme == "https" else None
        port = url.port or (443 if tls else 80)
        try:
            async with asyncio.timeout(timeout):
                if (
                    self._spare is not None
                    and request.extensions.get(AHEAD)
                    and (opened := await self._take_spare((url.host, port))) is not None
                ):
                    return opened
                reader, writer = await asyncio.open_connection(url.host, port, ssl=tls, limit=LINE_LIMIT)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection within {timeout:g} s", request=request) from None
        except (OSError, ssl.SSLError) as exc:  # refused, unreachable, unresolvable, a bad certificate
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from exc
        sock, peer = writer.get_extra_info("socket"), writer.get_extra_info("peername")
        if sock is not None and peer and _loopback(peer[0]):  # the next connection opened ahead goes there
            self._reached[(url.host, port)] = (sock.family, peer)
        return reader, writer


@dataclass(frozen=True, slots=True)
class _Target:
    """Where ``connect_ahead`` goes for a URL: its host and port as a request names them, and
    for a host given as an IP address, the socket family and address to connect to."""

    host: str
    port: int
    secure: bool
    literal: tuple[int, Any] | None


def _target(url: str) -> _Target | None:
    """Where to connect ahead for ``url``; None unless it is http or https."""
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https"):
        return None
    secure = parsed.scheme == "https"
    port = parsed.port or (443 if secure else 80)
    try:
        ip = ipaddress.ip_address(parsed.host)
    except ValueError:
        return _Target(parsed.host, port, secure, None)
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    # the host as a request names it (``[0:0::1]`` as written), the address in its short form
    return _Target(parsed.host, port, secure, (family, (str(ip), port)))


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


async def _open(
    sock: socket.socket, address: tuple[str, int], tls: ssl.SSLContext | None, host: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Streams on a socket whose connect is under way (or done)."""
    try:
        try:
            sock.getpeername()
        except OSError:  # not connected yet: wait for the connect under way (EALREADY)
            await asyncio.get_running_loop().sock_connect(sock, address)
        return await asyncio.open_connection(
            sock=sock, ssl=tls, server_hostname=host if tls else None, limit=LINE_LIMIT
        )
    except BaseException:
        sock.close()
        raise


def _discard(spare: _Spare) -> None:
    """Stop a connection opened ahead that no request took: its opening, or the connection."""
    spare.timer.cancel()
    spare.opening.cancel()
    spare.opening.add_done_callback(lambda task: _close(task, spare.sock))


def _close(task: asyncio.Task[tuple[asyncio.StreamReader, asyncio.StreamWriter]], sock: socket.socket) -> None:
    """Close what an ``_open`` that ended made: its connection, else its socket (a task
    cancelled before it ran never reached its own ``close``)."""
    if not task.cancelled() and task.exception() is None:
        task.result()[1].transport.abort()
    else:
        sock.close()


@dataclass(slots=True)
class _Spare:
    """A connection opened ahead: where to, its socket, the task opening it, and the timer
    that drops it unused."""

    address: tuple[str, int]
    sock: socket.socket
    opening: asyncio.Task[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
    timer: asyncio.TimerHandle


def _head(request: httpx.Request) -> bytes:
    """The request line and headers, with ``Connection: close`` whatever the client set."""
    url = request.url
    lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), url.raw_path)]
    lines += [b"%s: %s" % (name, value) for name, value in request.headers.raw if name.lower() != b"connection"]
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def _send(request: httpx.Request, writer: asyncio.StreamWriter, timeout: float | None) -> None:
    # a body of one piece leaves with the head in one write; one of several (a prompt's long
    # data URLs, core.jsontext.json_parts) piece by piece, never joined into one copy
    assert isinstance(request.stream, httpx.AsyncByteStream)
    parts = [part async for part in request.stream]
    try:
        if len(parts) == 1:
            writer.write(_head(request) + parts[0])
        else:
            writer.writelines([_head(request), *parts])
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
