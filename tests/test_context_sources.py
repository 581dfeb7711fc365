"""Through the daemon's socket: where each model's context size came from, in `models` and `status`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest

from client import Wire
from core import Config
from core import router as router_module
from daemon import server as server_module
from selfcheck.fakerouter import FakeModel, FakeRouter, RouterMode
from tests.conftest import RunningDaemon, serving

pytestmark = pytest.mark.asyncio

Serve = Callable[..., AbstractAsyncContextManager[tuple[FakeRouter, Wire]]]


@pytest.fixture
def serve(config: Config) -> Serve:
    """A daemon on a fake router of the given mode (and settings), with a connection to it."""

    @asynccontextmanager
    async def run(
        mode: RouterMode, models: list[FakeModel] | None = None, **settings: Any
    ) -> AsyncIterator[tuple[FakeRouter, Wire]]:
        with FakeRouter(models, mode=mode) as fake:
            daemon = RunningDaemon(dataclasses.replace(config, router_url=fake.url, **settings))
            await daemon.start()
            wire = await daemon.connect()
            try:
                yield fake, wire
            finally:
                await wire.close()
                await daemon.stop()

    return run


def sizes(event: dict[str, Any]) -> dict[str, tuple[int, str]]:
    return {m["id"]: (m["ctx_max"], m["ctx_source"]) for m in event["items"]}


async def test_llama_server_states_its_sizes_in_the_model_list(wire: Wire) -> None:
    models = await wire.request({"type": "models"})
    assert sizes(models) == {"fake-text": (4096, "models"), "fake-vision": (8192, "models")}
    status = await wire.request({"type": "status"})
    assert (status["model"], status["ctx_max"], status["ctx_source"]) == ("fake-text", 4096, "models")


async def test_llama_swap_is_asked_only_for_the_model_a_turn_uses(serve: Serve) -> None:
    async with serve("llama-swap") as (fake, wire):
        status = await wire.request({"type": "status"})
        assert (status["model"], status["ctx_max"], status["ctx_source"]) == ("fake-text", 4096, "assumed")
        models = await wire.request({"type": "models"})
        assert sizes(models) == {"fake-text": (4096, "assumed"), "fake-vision": (4096, "assumed")}
        assert fake.loaded == []  # neither a status line nor a model list loads a model
        events = await wire.ask("hello", model="fake-vision")
        assert events[-1]["type"] == "done" and events[-1]["ctx_max"] == 8192
        assert fake.loaded == ["fake-vision"] and fake.hits["/upstream/fake-vision/props"] == 1
        models = await wire.request({"type": "models"})
        assert sizes(models) == {"fake-text": (4096, "assumed"), "fake-vision": (8192, "upstream")}


async def test_llama_swap_loads_only_a_conversations_own_model(config: Config) -> None:
    """After a restart (nothing known of any model), a question in a conversation loads that
    conversation's model alone, not the default first; and a cancel while it loads keeps the turn."""
    with FakeRouter(mode="llama-swap") as fake:
        settings = dataclasses.replace(config, router_url=fake.url)

        async def session() -> tuple[RunningDaemon, Wire]:
            daemon = RunningDaemon(settings)
            await daemon.start()
            return daemon, await daemon.connect()

        daemon, wire = await session()
        own = (await wire.ask("hello", model="fake-vision"))[0]["conversation"]
        default = (await wire.ask("hello"))[0]["conversation"]
        await wire.close()
        await daemon.stop()
        daemon, wire = await session()
        try:
            asked = fake.hits.copy()
            events = await wire.ask("again", conversation=own)
            assert events[-1]["type"] == "done" and events[-1]["ctx_max"] == 8192
            assert fake.hits["/upstream/fake-vision/props"] == asked["/upstream/fake-vision/props"] + 1
            assert fake.hits["/upstream/fake-text/props"] == asked["/upstream/fake-text/props"]  # not loaded
            events = await wire.ask("again", conversation=default)  # on the default: asked about it
            assert events[-1]["type"] == "done"
            assert fake.hits["/upstream/fake-text/props"] == asked["/upstream/fake-text/props"] + 1
        finally:
            await wire.close()
            await daemon.stop()
        daemon, wire = await session()
        try:
            fake.props_open.clear()  # the model takes long to load: the turn is cancelled meanwhile
            rid = await wire.send({"type": "ask", "text": "once more", "conversation": own})
            assert (await wire.until(rid, ("user",)))[-1]["type"] == "user"
            await wire.request({"type": "cancel", "conversation": own})
            events = await wire.until(rid)
            assert events[-1]["type"] == "done" and events[-1]["finish_reason"] == "cancelled"
            fake.props_open.set()  # loaded at last: the open does not wait out its lookup of the size
            turns = (await wire.request({"type": "open", "conversation": own}))["turns"]
            assert [(t["text"], t["status"]) for t in turns][-1] == ("once more", "cancelled")
        finally:
            fake.props_open.set()
            await wire.close()
            await daemon.stop()


async def test_ollama_is_asked_with_its_show_api(serve: Serve) -> None:
    models = [FakeModel("qwen3:8b", n_ctx=8192, n_ctx_train=40960), FakeModel("llama3.2:1b", n_ctx_train=131072)]
    async with serve("ollama", models) as (fake, wire):
        status = await wire.request({"type": "status"})
        assert (status["model"], status["ctx_max"], status["ctx_source"]) == ("qwen3:8b", 8192, "ollama")
        events = await wire.ask("hello", model="llama3.2:1b")
        assert events[-1]["type"] == "done" and events[-1]["ctx_max"] == 4096  # Ollama's default
        assert sizes(await wire.request({"type": "models"})) == {
            "qwen3:8b": (8192, "ollama"), "llama3.2:1b": (4096, "ollama")
        }


async def test_a_router_that_tells_no_size_gets_the_assumed_one(serve: Serve) -> None:
    async with serve("silent", [FakeModel("quiet", n_ctx=16384)], assumed_ctx=3000) as (fake, wire):
        status = await wire.request({"type": "status"})
        assert (status["model"], status["ctx_max"], status["ctx_source"]) == ("quiet", 3000, "assumed")
        events = await wire.ask("hello")
        assert events[-1]["type"] == "done" and events[-1]["ctx_max"] == 3000
        assert sizes(await wire.request({"type": "models"})) == {"quiet": (3000, "assumed")}


async def test_a_configured_size_says_so(serve: Serve) -> None:
    async with serve("llama-server", ctx_max=2000) as (fake, wire):
        assert sizes(await wire.request({"type": "models"})) == {"fake-text": (2000, "config"), "fake-vision": (2000, "config")}
        status = await wire.request({"type": "status"})
        assert (status["ctx_max"], status["ctx_source"]) == (2000, "config")


async def test_status_without_a_router_names_no_size(config: Config, router: FakeRouter) -> None:
    router.stop()  # never seen: no model either (one seen before is named: test_contract)
    async with serving(config) as (_, wire):
        status = await wire.request({"type": "status"})
        assert status["router_reachable"] is False
        assert (status["model"], status["ctx_max"], status["ctx_source"]) == (None, None, None)


# -- an old model list ------------------------------------------------------------------
# One rule: a list older than MODELS_TTL (0 here: every list is old) is fetched again before a
# turn that finds it so goes on; a turn never runs on a list it knows to be old.


async def soon(condition: Callable[[], bool]) -> bool:
    """Whether ``condition`` holds within 10 s: what the daemon does in the background."""
    for _ in range(2000):
        if condition():
            return True
        await asyncio.sleep(0.005)
    return False


async def test_an_old_model_list_is_fetched_again_before_the_turn(
    wire: Wire, router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = await wire.ask("hello")
    assert first[-1]["type"] == "done" and first[-1]["ctx_max"] == 4096
    cid = first[0]["conversation"]
    monkeypatch.setattr(router_module, "MODELS_TTL", 0.0)
    router.models[0] = FakeModel("fake-text", n_ctx=2048)  # the server restarted with a smaller context
    listed = router.hits["/v1/models"]
    events = await wire.ask("and again", conversation=cid)
    assert events[-1]["type"] == "done" and events[-1]["ctx_max"] == 2048  # the new list, not the old one
    assert router.hits["/v1/models"] > listed
    router.models.append(FakeModel("fake-new", n_ctx=1024))  # a model loaded since is found at once
    events = await wire.ask("hi new", model="fake-new")
    assert events[-1]["type"] == "done" and events[-1]["ctx_max"] == 1024
    assert router.requests[-1]["model"] == "fake-new"


async def test_a_turn_does_not_wait_behind_a_models_request(
    daemon: RunningDaemon, wire: Wire, router: FakeRouter
) -> None:
    """``models`` asks the server each time, and waits for it holding the list; a turn whose
    model the list, still fresh, tells of does not queue behind it."""
    first = await wire.ask("hello")
    listed = router.hits["/v1/models"]
    router.models_open.clear()
    other = await daemon.connect()
    try:
        rid = await other.send({"type": "models"})
        assert await soon(lambda: router.hits["/v1/models"] > listed)  # the server holds its answer
        async with asyncio.timeout(5):  # the held list answers only after HOLD_MAX
            events = await wire.ask("and again", conversation=first[0]["conversation"])
        assert events[-1]["type"] == "done" and events[-1]["text"] == "You said: and again"
        router.models_open.set()
        answer = await other.until(rid, ("models", "error"))
        assert answer[-1]["type"] == "models"
    finally:
        router.models_open.set()
        await other.close()


async def test_what_props_said_of_tools_stands_while_the_list_is_fetched_again(serve: Serve, config: Config) -> None:
    """A lone llama-server's /props says whether its template takes tools; no model list says
    it. While a new list's /props is asked (a ``models`` request fetches the list each time), a
    turn waits for that list, then takes the model from it: without tools, as /props said."""
    async with serve("llama-server", [FakeModel("plain", tools=False)]) as (fake, wire):
        first = await wire.ask("hello")
        assert "tools" not in fake.requests[-1]
        fake.props_open.clear()  # /props answers when the test says
        other = await Wire.open(config.socket_path, timeout=10)
        try:
            asked = fake.hits["/props"]
            rid = await other.send({"type": "models"})
            assert await soon(lambda: fake.hits["/props"] > asked)  # the new list's lone model is being asked
            sent = len(fake.requests)
            turn = asyncio.create_task(wire.ask("again", conversation=first[0]["conversation"]))
            await asyncio.sleep(0.2)
            assert not turn.done() and len(fake.requests) == sent  # the turn waits for the list
            fake.props_open.set()
            events = await turn
            assert events[-1]["type"] == "done"
            assert "tools" not in fake.requests[-1]
            assert (await other.until(rid, ("models", "error")))[-1]["type"] == "models"
        finally:
            fake.props_open.set()
            await other.close()


async def test_llama_swap_what_it_said_of_a_model_stands_through_later_lists(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asking about a model again would load it: an old list is fetched again without asking,
    and what was said of each model stands, so no model is loaded for nothing (two
    conversations on two models, the list fetched again before each turn)."""
    async with serve("llama-swap") as (fake, wire):
        vision = (await wire.ask("hello", model="fake-vision"))[0]["conversation"]
        text = (await wire.ask("hello", model="fake-text"))[0]["conversation"]
        assert fake.loaded == ["fake-vision", "fake-text"]
        monkeypatch.setattr(router_module, "MODELS_TTL", 0.0)
        listed = fake.models_answered
        for cid, ctx in ((vision, 8192), (text, 4096), (vision, 8192), (text, 4096)):
            events = await wire.ask("again", conversation=cid)
            assert events[-1]["type"] == "done" and events[-1]["ctx_max"] == ctx
        assert fake.models_answered >= listed + 4  # an old list, fetched again for every turn
        models = await wire.request({"type": "models"})
        assert sizes(models) == {"fake-text": (4096, "upstream"), "fake-vision": (8192, "upstream")}
        assert fake.hits["/upstream/fake-vision/props"] == 1 and fake.hits["/upstream/fake-text/props"] == 1
        # each switch a turn's own: none by a list fetched again
        assert fake.loaded == ["fake-vision", "fake-text", "fake-vision", "fake-text", "fake-vision", "fake-text"]


async def test_the_model_list_is_learned_at_start_so_the_first_question_does_not_wait(
    wire: Wire, router: FakeRouter
) -> None:
    await soon(lambda: router.models_answered > 0)  # the start's fetch answered (the daemon may still be reading it)
    router.models_open.clear()
    try:
        events = await wire.ask("first question")
        assert events[-1]["type"] == "done" and events[-1]["ctx_max"] == 4096
    finally:
        router.models_open.set()


@pytest.mark.parametrize(("case", "said"), [
    ("down", "`make demo` in the checkout for a small one to try"),  # the way to one, named
    ("silent", "no model server answers at"),  # takes connections, answers nothing in time
    ("wrong path", "check router_url"),  # it answers, but not with a model list: 404 below a wrong path
])
async def test_the_start_says_when_the_router_is_not_a_model_server(
    config: Config, router: FakeRouter, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
    case: str, said: str,
) -> None:
    if case == "down":
        router.stop()
    elif case == "silent":
        monkeypatch.setattr(server_module, "START_LIST_SECONDS", 0.2)
        router.models_open.clear()
    else:
        config = dataclasses.replace(config, router_url=f"{router.url}/wrong")
    caplog.set_level(logging.WARNING, logger="daemon.server")
    async with serving(config) as (_, wire):
        await soon(lambda: any(said in r.getMessage() for r in caplog.records))
        assert [r.getMessage() for r in caplog.records if said in r.getMessage()], caplog.text
        router.models_open.set()
        assert (await wire.request({"type": "status"}))["type"] == "status"
