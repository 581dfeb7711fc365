"""The router client's HTTP transport against a scripted raw server on loopback.

Each test's server reads one request and writes bytes exactly as given, so the
framing cases real servers produce (chunked with extensions and trailers, sized,
ended by the close, interim 1xx) and the broken ones (a body cut short, a garbage
status, a bad chunk size, silence) are each tried on the wire.  The RouterClient
tests (test_router.py) drive the same transport against the fake router.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from core import transport as transport_module
from core.transport import AHEAD, OneShotTransport

pytestmark = pytest.mark.asyncio

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """A loopback server answering each connection with ``script``; keeps what it read."""

    def __init__(self) -> None:
        self.script: Script = answer(b"HTTP/1.1 204 No Content\r\n\r\n")
        self.requests: list[bytes] = []
        self.accepted = 0  # connections
        self.unused = 0  # connections closed by the client without a request
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self, tls: ssl.SSLContext | None = None) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=tls)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            self.unused += 1
            writer.close()
            return
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
        self.requests.append(head + await reader.readexactly(length))
        try:
            await self.script(reader, writer)
        finally:
            writer.close()

    async def until(self, condition: Callable[[], bool]) -> None:
        """Wait until ``condition`` holds of what the server saw (the deadline only stops a hang)."""
        async with asyncio.timeout(60):
            while not condition():
                await asyncio.sleep(0.005)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def answer(*parts: bytes, pause: float = 0.0) -> Script:
    """A script writing ``parts`` in turn, ``pause`` seconds apart, then closing."""

    async def script(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(pause)

    return script


@pytest_asyncio.fixture
async def server() -> AsyncIterator[RawServer]:
    raw = RawServer()
    await raw.start()
    yield raw
    await raw.stop()


@pytest_asyncio.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=OneShotTransport(), timeout=5.0) as client:
        yield client


async def test_the_request_goes_out_whole_with_connection_close(server: RawServer, http: httpx.AsyncClient) -> None:
    response = await http.post(f"{server.url}/v1/chat/completions?x=1", json={"q": "é"}, headers={"Connection": "keep-alive"})
    assert response.status_code == 204
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/chat/completions?x=1 HTTP/1.1"
    assert [line for line in lines if line.lower().startswith(b"connection:")] == [b"Connection: close"]
    assert f"Host: {server.url.removeprefix('http://')}".encode() in lines
    assert body == '{"q":"é"}'.encode()


async def test_a_chunked_body_with_extensions_and_trailers(server: RawServer, http: httpx.AsyncClient) -> None:
    server.script = answer(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n",
        b"7;name=value\r\ndata: 1\r\n",
        b"8\r\n\ndata: 2\r\n", b"1\r\n\n\r\n",
        b"0\r\nX-Trailer: yes\r\n\r\n",
        pause=0.01,
    )
    async with http.stream("GET", server.url) as response:
        lines = [line async for line in response.aiter_lines()]
    assert lines == ["data: 1", "data: 2"]  # chunks cut lines anywhere


async def test_a_sized_body_read_in_pieces(server: RawServer, http: httpx.AsyncClient) -> None:
    body = b"x" * 200_000
    server.script = answer(b"HTTP/1.1 200 OK\r\nContent-Length: 200000\r\n\r\n", body[:70_000], body[70_000:], pause=0.01)
    response = await http.get(server.url)
    assert response.content == body


async def test_a_body_ended_by_the_close_and_an_interim_answer_skipped(server: RawServer, http: httpx.AsyncClient) -> None:
    server.script = answer(b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\n", b"until ", b"the end", pause=0.01)
    response = await http.get(server.url)
    assert (response.status_code, response.text, response.reason_phrase) == (200, "until the end", "OK")


@pytest.mark.parametrize(
    "reply, message",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "peer closed connection without sending complete message body"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabc", "peer closed connection without sending complete message body"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nabc", "a malformed chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n", "a chunk longer than its size"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n", "a malformed Content-Length"),
        (b"SSH-2.0-OpenSSH_9.6\r\n", "not an HTTP/1.1 status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "a malformed response header"),
        (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n", "Server disconnected in the middle of the headers"),
        (b"", "Server disconnected without sending a response"),
    ],
)
async def test_a_broken_response_is_a_protocol_error(
    server: RawServer, http: httpx.AsyncClient, reply: bytes, message: str
) -> None:
    server.script = answer(reply)
    with pytest.raises(httpx.RemoteProtocolError, match=message):
        await http.get(server.url)


async def test_a_silent_server_is_a_read_timeout(server: RawServer, http: httpx.AsyncClient) -> None:
    gone = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up
        gone.set()

    server.script = silent
    with pytest.raises(httpx.ReadTimeout):
        await http.get(server.url, timeout=httpx.Timeout(5.0, read=0.2))
    await asyncio.wait_for(gone.wait(), 5)


async def test_a_refused_connection_is_a_connect_error(http: httpx.AsyncClient) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound but not listening: refused
        with pytest.raises(httpx.ConnectError):
            await http.get(f"http://127.0.0.1:{port}/")


async def test_closing_a_stream_early_closes_its_connection(server: RawServer, http: httpx.AsyncClient) -> None:
    gone = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            while not reader.at_eof():  # a token every 10 ms, as a model would, until the client goes
                writer.write(b"6\r\ndata: \r\n")
                await writer.drain()
                await asyncio.sleep(0.01)
        gone.set()

    server.script = endless
    async with http.stream("GET", server.url) as response:
        async for _ in response.aiter_bytes():
            break
    await asyncio.wait_for(gone.wait(), 5)


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


async def test_https_is_verified_against_the_systems_certificates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = self_signed(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server = RawServer()
    server.script = answer(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecret")
    await server.start(tls)
    try:
        async with httpx.AsyncClient(transport=OneShotTransport()) as http:
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await http.get(server.url)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # now the system trusts it
        async with httpx.AsyncClient(transport=OneShotTransport()) as http:
            assert (await http.get(server.url)).text == "secret"
    finally:
        await server.stop()


# -- connections opened ahead ----------------------------------------------------------------


async def test_a_connection_opened_ahead_carries_the_next_request(server: RawServer) -> None:
    transport = OneShotTransport()
    async with httpx.AsyncClient(transport=transport, timeout=5.0) as http:
        transport.connect_ahead(server.url + "/v1")
        await server.until(lambda: server.accepted == 1)  # open before any request is made
        sent = await http.post(server.url + "/v1/chat/completions", json={"q": 1}, extensions={AHEAD: True})
        assert sent.status_code == 204
        assert server.accepted == 1 and len(server.requests) == 1 and server.unused == 0
        assert (await http.get(server.url, extensions={AHEAD: True})).status_code == 204  # afresh
        assert server.accepted == 2 and server.unused == 0


async def test_a_request_made_on_the_way_leaves_the_connection_opened_ahead(server: RawServer) -> None:
    """A knowledge-base query's embedding, asked for after connect_ahead and before the chat
    request, connects itself: the chat request is the one the connection was opened for."""
    transport = OneShotTransport()
    async with httpx.AsyncClient(transport=transport, timeout=5.0) as http:
        transport.connect_ahead(server.url + "/v1")
        await server.until(lambda: server.accepted == 1)
        assert (await http.post(server.url + "/v1/embeddings", json={"input": "q"})).status_code == 204
        assert server.accepted == 2 and len(server.requests) == 1
        sent = await http.post(server.url + "/v1/chat/completions", json={"q": 1}, extensions={AHEAD: True})
        assert sent.status_code == 204
        assert server.accepted == 2 and len(server.requests) == 2 and server.unused == 0


async def test_a_connection_opened_ahead_and_not_used_is_closed(server: RawServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport_module, "SPARE_FOR", 0.05)
    transport = OneShotTransport()
    async with httpx.AsyncClient(transport=transport, timeout=5.0) as http:
        transport.connect_ahead(server.url)
        await server.until(lambda: server.unused == 1)
        transport.connect_ahead(server.url)
        transport.connect_ahead(server.url)  # replaces the one before
        await server.until(lambda: server.unused == 3)
        assert (await http.get(server.url)).status_code == 204
        assert (server.accepted, len(server.requests)) == (4, 1)
        transport.connect_ahead(server.url)
        await server.until(lambda: server.accepted == 5)
    # closing the client closes one still waiting
    await server.until(lambda: server.unused == 4)


async def test_a_connection_opened_ahead_elsewhere_is_not_used(server: RawServer) -> None:
    other = RawServer()
    await other.start()
    transport = OneShotTransport()
    try:
        async with httpx.AsyncClient(transport=transport, timeout=5.0) as http:
            transport.connect_ahead(other.url)
            await other.until(lambda: other.accepted == 1)
            assert (await http.get(server.url, extensions={AHEAD: True})).status_code == 204
            assert server.accepted == 1 and other.requests == []
        await other.until(lambda: other.unused == 1)  # closed with the client
    finally:
        await other.stop()


async def test_a_refused_connection_opened_ahead_leaves_the_error_to_the_request(http: httpx.AsyncClient) -> None:
    transport = OneShotTransport()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/"  # bound but not listening: refused
        async with httpx.AsyncClient(transport=transport, timeout=5.0) as client:
            transport.connect_ahead(url)
            with pytest.raises(httpx.ConnectError):
                await client.get(url, extensions={AHEAD: True})


async def test_a_server_named_by_a_host_name_is_connected_ahead_where_the_name_led(server: RawServer) -> None:
    transport = OneShotTransport()
    named = server.url.replace("127.0.0.1", "localhost")
    async with httpx.AsyncClient(transport=transport, timeout=5.0) as http:
        transport.connect_ahead(named)  # resolving would block the loop: nothing is opened yet
        transport.connect_ahead("ftp://127.0.0.1:21/")
        await asyncio.sleep(0.1)
        assert server.accepted == 0
        assert (await http.get(named)).status_code == 204  # by name: where it led is kept
        transport.connect_ahead(named)
        await server.until(lambda: server.accepted == 2)  # open before the request is made
        assert (await http.get(named + "/v1/chat", extensions={AHEAD: True})).status_code == 204
        assert (server.accepted, len(server.requests), server.unused) == (2, 2, 0)


async def test_a_connection_ahead_to_where_a_name_once_led_that_fails_connects_by_name(server: RawServer) -> None:
    transport = OneShotTransport()
    named = server.url.replace("127.0.0.1", "localhost")
    port = int(server.url.rsplit(":", 1)[1])
    async with httpx.AsyncClient(transport=transport, timeout=5.0) as http:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))  # bound, not listening: refused, as a server that moved
            transport._reached[("localhost", port)] = (socket.AF_INET, probe.getsockname())
            transport.connect_ahead(named)
            assert (await http.get(named, extensions={AHEAD: True})).status_code == 204
        assert transport._reached[("localhost", port)][1][1] == port  # where the name leads now
        assert server.accepted == 1 and len(server.requests) == 1

async def test_a_host_given_as_an_ip_address_is_matched_as_a_request_names_it() -> None:
    """A spare is taken by the (host, port) of the request's URL: an IPv6 address written long
    must be kept as written, while its connection goes to the address itself."""
    url = "http://[0:0:0:0:0:0:0:1]:8080/v1"
    target = transport_module._target(url)
    assert target is not None and target.host == httpx.URL(url).host
    assert target.literal == (socket.AF_INET6, ("::1", 8080))
