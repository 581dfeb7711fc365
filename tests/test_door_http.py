"""The OpenAI door's HTTP side under a hostile local user (issue 44) and on h11 (issue 43).

Plain sockets on loopback against the real daemon, each test a bounded handful of
connections: the key is checked before a byte of the body is read, connections are
capped while the Unix socket goes on answering, an empty key file opens nothing, a
half-close ends as a hang-up, and the bounds the door had before h11 still hold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import resource
import stat
import threading
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from client import Wire
from core import Config
from core.errors import StartupError
from daemon.openai import http
from selfcheck.fakerouter import FakeRouter, Reply
from tests.conftest import RunningDaemon, serving

pytestmark = pytest.mark.asyncio

READ_TIMEOUT = 10.0  # a bound on a wait for the daemon, far above what any answer takes
BIG_BODY = 50 * 1024 * 1024  # declared, never sent


@pytest.fixture
def config(config: Config) -> Config:
    return dataclasses.replace(config, openai_listen="127.0.0.1:0")


@pytest_asyncio.fixture
async def door(daemon: RunningDaemon) -> AsyncIterator[tuple[tuple[str, int], str]]:
    """The door's address and key."""
    assert daemon.server is not None and daemon.server.door is not None and daemon.server.door.address
    yield daemon.server.door.address, (daemon.config.data_dir / "openai_key").read_text().strip()


async def connect(address: tuple[str, int]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(*address)


async def answer(reader: asyncio.StreamReader) -> bytes:
    """Everything the door sends until it closes the connection."""
    return await asyncio.wait_for(reader.read(), READ_TIMEOUT)


def chat_head(length: int, key: str | None, extra: str = "") -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key is not None else ""
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def chat_body(question: str, stream: bool) -> bytes:
    messages = [{"role": "user", "content": question}]
    return json.dumps({"model": "fake-text", "stream": stream, "messages": messages}).encode()


async def test_the_key_is_checked_before_a_byte_of_the_body_is_read(door: tuple[tuple[str, int], str]) -> None:
    address, key = door
    # a head declaring 50 MB and no body: the 401 comes while the body is still owed
    for auth, extra in ((None, ""), ("nope", ""), ("", ""), (None, "Expect: 100-continue\r\n")):
        reader, writer = await connect(address)
        writer.write(chat_head(BIG_BODY, auth, extra))
        got = await answer(reader)
        writer.close()
        assert got.startswith(b"HTTP/1.1 401 "), got[:80]
        assert b"100 Continue" not in got  # a client told to go on would send the body
        assert json.loads(got.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_api_key"
    # with the key, the body is read (curl's Expect answered first), and a wrong one refused
    reader, writer = await connect(address)
    writer.write(chat_head(5, key, "Expect: 100-continue\r\n"))
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"{nope")
    got = await answer(reader)
    writer.close()
    assert got.startswith(b"HTTP/1.1 400 ") and b"invalid_json" in got
    # a client that sends its 20 MB body regardless (httpx) still reads its 401: the rest is dropped
    async with httpx.AsyncClient() as client:
        refused = await client.post(f"http://{address[0]}:{address[1]}/v1/chat/completions", content=bytes(20_000_000),
                                    headers={"Authorization": "Bearer nope"})
    assert refused.status_code == 401


async def test_connections_are_capped_and_the_socket_answers_while_the_door_is_full(
    config: Config, router: FakeRouter, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(hard, 1024)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))  # a systemd user service's soft limit
    caplog.set_level(logging.INFO, logger="daemon.openai.door")
    capped = dataclasses.replace(config, openai_max_connections=6, openai_max_unkeyed=3)
    try:
        async with serving(capped) as (running, wire):
            assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
            if lowered < hard:
                assert f"raised the limit of open files from {lowered} to {hard}" in caplog.text
            assert running.server is not None and running.server.door is not None
            address = running.server.door.address
            assert address is not None
            key = (capped.data_dir / "openai_key").read_text().strip()
            await _unkeyed_connections_are_capped(address, key)
            await _all_connections_are_capped(address, key, router, wire)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def _unkeyed_connections_are_capped(address: tuple[str, int], key: str) -> None:
    """Eight connections sending a request line and no more: all but three are dropped."""
    idle = [await connect(address) for _ in range(8)]
    for _reader, writer in idle:
        writer.write(b"GET /v1/models HTTP/1.1\r\n")
    reads = {asyncio.ensure_future(_read_or_reset(reader)): n for n, (reader, _writer) in enumerate(idle)}
    dropped: list[int] = []
    pending = set(reads)
    while len(dropped) < 5:
        done, pending = await asyncio.wait(pending, timeout=READ_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
        assert done, f"only {len(dropped)} of 8 idle connections were dropped"
        for read in done:
            assert read.result() == b""  # closed without an answer
            dropped.append(reads[read])
    for read in pending:
        read.cancel()
    # the three left are still served once they show the key
    for n in sorted(set(range(8)) - set(dropped)):
        reader, writer = idle[n]
        writer.write(f"Host: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
        got = await answer(reader)
        assert got.startswith(b"HTTP/1.1 200 "), got[:80]
    for _reader, writer in idle:
        writer.close()


async def _read_or_reset(reader: asyncio.StreamReader) -> bytes:
    """What a connection gets until it is closed, b"" when it is reset."""
    try:
        return await reader.read()
    except ConnectionResetError:
        return b""


async def _all_connections_are_capped(address: tuple[str, int], key: str, router: FakeRouter, wire: Wire) -> None:
    """Four keyed streams held open and two idle connections fill the door (six): the seventh
    is told 503 at once, and ``status`` on the socket answers within a second meanwhile."""
    hold = threading.Event()
    router.script(*(Reply(text=f"held {n} and more", hold=hold) for n in range(4)))
    streams = []
    try:
        for n in range(4):
            reader, writer = await connect(address)
            body = chat_body(f"Question {n}", stream=True)
            writer.write(chat_head(len(body), key) + body)
            await asyncio.wait_for(reader.readuntil(b"held"), READ_TIMEOUT)
            streams.append((reader, writer))
        idle = [await connect(address) for _ in range(2)]
        for _reader, writer in idle:
            writer.write(b"GET /v1/models HTTP/1.1\r\n")
        reader, writer = await connect(address)
        got = await answer(reader)
        writer.close()
        assert got.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in got, got[:200]
        status = await asyncio.wait_for(wire.request({"type": "status"}), 1.0)
        assert status["type"] == "status"
        for _reader, writer in idle:
            writer.close()
    finally:
        hold.set()
    for reader, writer in streams:
        got = await answer(reader)
        writer.close()
        assert b"data: [DONE]" in got


async def test_an_empty_key_file_is_replaced_and_an_empty_bearer_refused(
    config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    path = config.data_dir / "openai_key"
    caplog.set_level(logging.INFO, logger="daemon.openai.door")
    for kept in ("", "short\n"):  # a first start cut short between creating and writing the file
        config.data_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(kept)
        async with serving(config) as (running, _wire):
            assert running.server is not None and running.server.door is not None
            address = running.server.door.address
            assert address is not None
            key = path.read_text().strip()
            assert key.startswith("sk-assistant-") and len(key) > 40
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert sorted(p.name for p in config.data_dir.iterdir() if "openai_key" in p.name) == ["openai_key"]
            for auth in ("Authorization: Bearer \r\n", "Authorization: Bearer\r\n",
                         f"Authorization: Bearer {kept}\r\n"):
                reader, writer = await connect(address)
                writer.write(f"GET /v1/models HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
                got = await answer(reader)
                writer.close()
                assert got.startswith(b"HTTP/1.1 401 "), (auth, got[:80])
            reader, writer = await connect(address)
            writer.write(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
            got = await answer(reader)
            writer.close()
            assert got.startswith(b"HTTP/1.1 200 ")
        assert f"key file {path} held" in caplog.text
        caplog.clear()
    # a configured key that short is refused at start, saying so
    with pytest.raises(StartupError, match="openai_key must have at least 16 characters"):
        async with serving(dataclasses.replace(config, openai_key="short")):
            pass


async def test_a_half_close_after_the_request_ends_as_a_hang_up(
    door: tuple[tuple[str, int], str], router: FakeRouter, daemon: RunningDaemon, wire: Wire
) -> None:
    address, key = door
    for conversation, stream in ((1, False), (2, True)):
        router.reset()  # a reply the cancelled turn never asked for goes too
        hold = threading.Event()
        router.script(Reply(text="partial and then more", hold=hold))
        watcher = await daemon.connect()
        try:
            rid = await watcher.send({"type": "watch"})
            await watcher.until(rid, ("watching",))
            reader, writer = await connect(address)
            body = chat_body("Go", stream)
            writer.write(chat_head(len(body), key) + body)
            if stream:
                await asyncio.wait_for(reader.readuntil(b"partial"), READ_TIMEOUT)
            writer.write_eof()  # done sending; it would still read
            ended = [e async for e in _changes(watcher, rid, "ended")]
        finally:
            hold.set()
            await watcher.close()
        got = await answer(reader)
        writer.close()
        assert (ended[-1]["conversation"], ended[-1]["finish_reason"]) == (conversation, "cancelled")
        # what it read does not say the reply ended: it is cut, as the turn is stored
        assert b'"finish_reason":"stop"' not in got and b"[DONE]" not in got, got
        assert not got.endswith(b"\r\n0\r\n\r\n")  # nor does the chunked body end
        if not stream:
            assert got == b""  # no answer at all, rather than an empty one that "stopped"
        conv = await wire.request({"type": "open", "conversation": conversation})
        assert conv["turns"][-1]["status"] == "cancelled"


async def _changes(wire: Wire, rid: object, until: str) -> AsyncIterator[dict[str, object]]:
    """A watch's changes up to the first whose action is ``until``."""
    async for event in wire.stream(rid):
        yield event
        if event.get("action") == until:
            return


async def test_the_bounds_kept_on_h11(
    door: tuple[tuple[str, int], str], router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    address, key = door
    # 20,000 headers pass the head's 64 KiB: 431, before the key is looked at
    reader, writer = await connect(address)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 20_000 + b"\r\n")
    got = await answer(reader)
    writer.close()
    assert got.startswith(b"HTTP/1.1 431 ")
    # a body in any Transfer-Encoding is refused for a length (h11 reads only chunked, the door neither)
    for coding in ("chunked", "gzip"):
        reader, writer = await connect(address)
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: {coding}\r\n\r\n".encode())
        got = await answer(reader)
        writer.close()
        assert got.startswith(b"HTTP/1.1 411 "), got[:80]
    # a second request sent on the heels of the first is not answered (one request a connection)
    reader, writer = await connect(address)
    models = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
    writer.write(models + models)
    got = await answer(reader)
    writer.close()
    assert got.count(b"HTTP/1.1 ") == 1 and got.startswith(b"HTTP/1.1 200 ")
    # a client that sends its head a byte at a time is dropped when its time is up
    monkeypatch.setattr(http, "REQUEST_SECONDS", 0.3)
    reader, writer = await connect(address)
    dropped = asyncio.ensure_future(answer(reader))
    sent = 0
    while not dropped.done() and sent < len(models):
        writer.write(models[sent:sent + 1])
        sent += 1
        await asyncio.wait([dropped], timeout=0.05)
    writer.close()
    assert await dropped == b"" and sent < len(models)  # hung up on, unanswered, before the head was whole
    # an HTTP/1.0 client gets its answer too; a request without Host is a 400 (HTTP/1.1 asks for one)
    for request, status in ((f"GET /v1/models HTTP/1.0\r\nAuthorization: Bearer {key}\r\n\r\n", b"200"),
                            (f"GET /v1/models HTTP/1.1\r\nAuthorization: Bearer {key}\r\n\r\n", b"400")):
        reader, writer = await connect(address)
        writer.write(request.encode())
        got = await answer(reader)
        writer.close()
        assert got.split(b" ")[1] == status, got[:80]
