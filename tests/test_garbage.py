"""What a turn leaves to Python's cyclic garbage collector: nothing of its own.

Objects in a reference cycle outlive their use until the collector's next pass, and
they are what sets it off: a pass over them, 0.2-0.4 ms on a cold cache, lands in
whatever runs then, at times a question's way to its request (core/transport.py). Each
test collects the garbage already there, then saves what the collector finds after its
work through the socket (``gc.DEBUG_SAVEALL``) and looks for the daemon's objects in it.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from core import Config
from core.wire import Wire
from daemon.protocol import Request
from daemon.runner import TurnState
from history.records import TurnContext
from selfcheck.fakerouter import FakeRouter, Reply
from tests.conftest import RunningDaemon

pytestmark = pytest.mark.asyncio

# what a request would leave behind: itself; a turn: its HTTP requests and their answers, its state,
# what its prompt was built from
DAEMON_OBJECTS = (Request, httpx.Response, httpx.Request, TurnState, TurnContext)


@pytest_asyncio.fixture
async def titled(config: Config) -> AsyncIterator[tuple[RunningDaemon, Wire]]:
    running = RunningDaemon(dataclasses.replace(config, auto_title=True))
    await running.start()
    wire = await running.connect()
    yield running, wire
    await wire.close()
    await running.stop()


def left(garbage: list[object]) -> list[str]:
    return sorted(type(o).__qualname__ for o in garbage if isinstance(o, DAEMON_OBJECTS))


async def test_turns_leave_nothing_to_the_cyclic_collector(
    titled: tuple[RunningDaemon, Wire], router: FakeRouter
) -> None:
    """Streamed replies, a title (a request read whole), a tool round, the model list, requests
    refused: every request and turn is freed as soon as it is done with."""
    running, wire = titled
    assert running.server is not None and running.server.engine is not None
    await wire.ask("warm up")  # first-use objects (the client, its transport) are not the turn's
    await running.server.engine.settle()
    await wire.request({"type": "models"})
    seen = await collected_after(running, wire, router)
    assert left(seen) == []


async def collected_after(running: RunningDaemon, wire: Wire, router: FakeRouter) -> list[object]:
    found: list[object] = []
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        router.script_complete(Reply(text="A title"))
        router.script(
            Reply(tool_calls=[{"id": "c1", "name": "conversation_search", "arguments": '{"query": "spam"}'}]),
            Reply(text="Nothing found."),
        )
        first = await wire.ask("what did we say about spam?")
        assert first[-1]["type"] == "done"
        assert running.server is not None and running.server.engine is not None
        await running.server.engine.settle()  # its title
        follow_up = await wire.ask("and eggs?", conversation=first[0]["conversation"])
        assert follow_up[-1]["type"] == "done"
        assert (await wire.request({"type": "models"}))["type"] == "models"
        # refused for a field of the wrong type: by the ask's own path, and by every other's
        refused = await wire.ask("and ham?", conversation=first[0]["conversation"], model=7)
        assert refused[-1]["code"] == "bad_request"
        assert (await wire.request({"type": "open", "conversation": "one"}))["code"] == "bad_request"
        gc.collect()
    finally:
        gc.set_debug(0)
        found.extend(gc.garbage)
        gc.garbage.clear()
    return found
