"""What a turn leaves to Python's cyclic garbage collector: nothing of its own.

Objects in a reference cycle outlive their use until the collector's next pass, and
they are what sets it off: a pass over them, 0.2-0.4 ms on a cold cache, lands in
whatever runs then, at times a question's way to its request (core/transport.py). Each
test collects the garbage already there, then saves what the collector finds after its
work (``gc.DEBUG_SAVEALL``) and looks for the daemon's objects in it. On the event loop
the daemon runs on (uvloop's, on Linux): asyncio's own leaves a cycle of its own in each
socket transport.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from core import Config
from core.transport import AHEAD, Client, OneShotTransport, _Spare
from core.wire import Wire
from daemon.protocol import Request
from daemon.runner import TurnState
from history.records import TurnContext
from selfcheck.fakerouter import FakeRouter, Reply
from tests.conftest import RunningDaemon, serving
from tests.test_transport import RawServer, answer, self_signed

pytestmark = pytest.mark.asyncio

# what a request would leave behind: itself; a turn: its HTTP requests and their answers, its state,
# what its prompt was built from
DAEMON_OBJECTS = (Request, httpx.Response, httpx.Request, TurnState, TurnContext, _Spare)


@contextlib.contextmanager
def left_to_collector() -> Iterator[list[str]]:
    """Fills, as the block ends, with the daemon's objects only the collector would have freed
    of those made in the block."""
    left: list[str] = []
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield left
        gc.collect()
    finally:
        gc.set_debug(0)
        left += sorted(type(o).__qualname__ for o in gc.garbage if isinstance(o, DAEMON_OBJECTS))
        gc.garbage.clear()


async def test_turns_leave_nothing_to_the_cyclic_collector(
    config: Config, router: FakeRouter, tmp_path: Path
) -> None:
    """Streamed replies, a title (a request read whole), a tool round, the model list, turns
    the router fails, refused requests, the router gone: every request and turn is freed as
    soon as it is done with."""
    async with serving(dataclasses.replace(config, auto_title=True)) as (running, wire):
        await wire.ask("warm up")  # first-use objects (the client, its transport) are not a turn's
        await settle(running)
        await wire.request({"type": "models"})
        with left_to_collector() as left:
            await work(running, wire, router, tmp_path)
    assert left == []


async def work(running: RunningDaemon, wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    router.script_complete(Reply(text="A title"))
    router.script(
        Reply(tool_calls=[{"id": "c1", "name": "conversation_search", "arguments": '{"query": "spam"}'}]),
        Reply(text="Nothing found."),
    )
    first = await wire.ask("what did we say about spam?")
    assert first[-1]["type"] == "done"
    await settle(running)  # its title
    cid = first[0]["conversation"]
    assert (await wire.ask("and eggs?", conversation=cid))[-1]["type"] == "done"
    assert (await wire.request({"type": "models"}))["type"] == "models"
    # the router fails the turn: before its reply, and in the middle of it
    router.script(Reply(status=500, error="boom"), Reply(text="one two three four five six", drop_after=3))
    assert (await wire.ask("and bacon?", conversation=cid))[-1]["code"] == "router_error"
    assert (await wire.ask("and beans?", conversation=cid))[-1]["type"] == "error"
    # refused: a file that is not there, a field of the wrong type (by the ask's own path, and
    # by every other request's)
    assert (await wire.ask("read it", conversation=cid, files=[str(tmp_path / "gone.txt")]))[-1]["type"] == "error"
    assert (await wire.ask("and ham?", conversation=cid, model=7))[-1]["code"] == "bad_request"
    assert (await wire.request({"type": "open", "conversation": "one"}))["code"] == "bad_request"
    # the router gone: nothing to connect to
    router.stop()
    assert (await wire.ask("anyone there?", conversation=cid))[-1]["code"] == "router_unreachable"


async def settle(running: RunningDaemon) -> None:
    assert running.server is not None and running.server.engine is not None
    await running.server.engine.settle()  # the title is made in the background


async def test_failed_requests_leave_nothing_to_the_cyclic_collector(tmp_path: Path) -> None:
    """A connection opened ahead that fails (an untrusted certificate), and an answer whose
    body is cut short while httpx reads it whole: the router client's failures are freed too."""
    cert, key = self_signed(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    secure, short = RawServer(), RawServer()
    short.script = answer(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\ncut")
    await secure.start(tls)
    await short.start()
    transport = OneShotTransport()
    try:
        async with Client(transport=transport, timeout=5.0) as client:
            with left_to_collector() as left:
                transport.connect_ahead(secure.url)
                with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                    await client.get(secure.url, extensions={AHEAD: True})
                with pytest.raises(httpx.RemoteProtocolError):
                    await client.get(short.url)
    finally:
        await secure.stop()
        await short.stop()
    assert left == []
