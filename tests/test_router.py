"""RouterClient against the real FakeRouter over loopback: streaming, models, errors, cancellation, embeddings."""

from __future__ import annotations

import asyncio
import math
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from typing import Any

import httpx
import pytest
import pytest_asyncio

from core.config import Config
from core.errors import NotFound, RouterContextOverflow, RouterError, RouterUnreachable
from core.router import (
    ContentDelta,
    ModelInfo,
    ReasoningDelta,
    RouterClient,
    StreamEnd,
    StreamEvent,
    ToolCall,
    Usage,
)
from selfcheck.fakerouter import FakeModel, FakeRouter, Reply, fake_embedding

USER = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def fake() -> Iterator[FakeRouter]:
    with FakeRouter() as router:
        yield router


@pytest_asyncio.fixture
async def client(fake: FakeRouter) -> AsyncIterator[RouterClient]:
    router_client = RouterClient(Config(router_url=fake.url))
    yield router_client
    await router_client.aclose()


MakeClient = Callable[..., RouterClient]


@pytest_asyncio.fixture
async def make_client() -> AsyncIterator[MakeClient]:
    """Builds clients with any config and closes them all at the end."""
    made: list[RouterClient] = []

    def make(**settings: Any) -> RouterClient:
        made.append(RouterClient(Config(**settings)))
        return made[-1]

    yield make
    for router_client in made:
        await router_client.aclose()


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


async def drain(stream: AsyncIterator[StreamEvent]) -> list[StreamEvent]:
    return [event async for event in stream]


# -- streaming ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_default_reply_echoes_the_question(client: RouterClient, fake: FakeRouter) -> None:
    events = await drain(client.stream_chat("fake-text", USER, temperature=0.2))
    deltas = [e for e in events if isinstance(e, ContentDelta)]
    assert len(deltas) > 1
    end = events[-1]
    assert isinstance(end, StreamEnd)
    assert end.text == "".join(d.text for d in deltas) == "You said: hello there"
    assert end.finish_reason == "stop"
    assert end.usage == Usage(prompt_tokens=2, completion_tokens=len(deltas))
    sent = fake.requests[-1]
    assert sent["path"] == "/v1/chat/completions"
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["model"] == "fake-text" and sent["temperature"] == 0.2
    assert "tools" not in sent


@pytest.mark.asyncio
async def test_reasoning_and_tool_calls_by_index(client: RouterClient, fake: FakeRouter) -> None:
    fake.script(Reply(
        reasoning=["Let me ", "look."],
        tool_calls=[
            {"id": "call_1", "name": "conversation_search", "arguments": {"query": "cats", "max_results": 3}},
            {"id": "call_2", "name": "attachment_recall", "arguments": '{"action": "list"}'},
        ],
    ))
    tools = [{"type": "function", "function": {"name": "conversation_search", "parameters": {"type": "object"}}}]
    events = await drain(client.stream_chat("fake-text", USER, tools))
    assert [e for e in events if isinstance(e, ReasoningDelta)] == [ReasoningDelta("Let me "), ReasoningDelta("look.")]
    assert not any(isinstance(e, ContentDelta) for e in events)
    end = events[-1]
    assert isinstance(end, StreamEnd)
    assert end.finish_reason == "tool_calls"
    assert end.tool_calls == [
        ToolCall("call_1", "conversation_search", '{"query": "cats", "max_results": 3}'),
        ToolCall("call_2", "attachment_recall", '{"action": "list"}'),
    ]
    assert fake.requests[-1]["tools"] == tools


@pytest.mark.asyncio
async def test_scripted_chunks_finish_and_no_usage(client: RouterClient, fake: FakeRouter) -> None:
    fake.script(Reply(chunks=["a", "b"], finish_reason="length", usage=None, first_content_null=False))
    events = await drain(client.stream_chat("fake-text", USER))
    assert events[:2] == [ContentDelta("a"), ContentDelta("b")]
    end = events[-1]
    assert isinstance(end, StreamEnd)
    assert (end.finish_reason, end.tool_calls, end.usage, end.text) == ("length", [], None, "ab")
    assert end.timings is not None and end.timings.predicted_n == 2  # on the finish chunk, without usage


@pytest.mark.asyncio
async def test_back_to_back_streams_survive_a_server_that_closes_after_each(
    client: RouterClient, fake: FakeRouter
) -> None:
    # the fake, like llama-server, closes each connection soon after its stream
    for _ in range(5):
        await drain(client.stream_chat("fake-text", USER))
    assert len(fake.requests) == 5
    assert fake.connections == 5
    assert fake.disconnects == 0


# -- models ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_models_table_for_an_unlisted_id_is_said_once(fake: FakeRouter, caplog: pytest.LogCaptureFixture) -> None:
    config = Config(router_url=fake.url, model_image_tokens={"fake-vison": 1200, "fake-vision": 900})
    router_client = RouterClient(config)
    try:
        for _ in range(2):
            models = await router_client.models(refresh=True)
    finally:
        await router_client.aclose()
    assert [m.image_tokens for m in models] == [765, 900]
    told = [r.getMessage() for r in caplog.records if "names no model" in r.getMessage()]
    assert told == ['[models."fake-vison"] names no model the router lists (it has: fake-text, fake-vision); '
                    "check the id"]


@pytest.mark.asyncio
async def test_llama_format_models(client: RouterClient, fake: FakeRouter) -> None:
    models = await client.models()
    assert models == [
        ModelInfo("fake-text", ("text",), 4096, ctx_source="models"),
        ModelInfo("fake-vision", ("text", "image"), 8192, ctx_source="models"),
    ]
    assert [m.vision for m in models] == [False, True]
    assert models[1].to_json() == {
        "id": "fake-vision", "name": "fake-vision", "input_modalities": ["text", "image"], "ctx_max": 8192, "ctx_source": "models",
        "image_tokens": 765,
    }
    assert fake.hits["/props"] == 0


@pytest.mark.asyncio
async def test_top_format_takes_ctx_from_props_when_a_model_is_chosen(make_client: MakeClient) -> None:
    with FakeRouter(models_format="top") as fake:
        client = make_client(router_url=fake.url)
        listed = await client.models()
        # Two models: listing must not ask /props about each (on a router that may load them);
        # until a turn picks one, their size is the configuration's assumed_ctx, and says so.
        assert listed == [
            ModelInfo("fake-text", ("text",), 4096, ctx_source="assumed"),
            ModelInfo("fake-vision", ("text", "image"), 4096, ctx_source="assumed"),
        ]
        assert fake.hits["/props"] == 0
        info = await client.model_info("fake-vision")
        assert info == ModelInfo("fake-vision", ("text", "image"), 8192, ctx_source="props")
        assert fake.hits["/props"] == 1
        assert (await client.models())[1] == info
        await client.model_info("fake-vision")
        assert fake.hits["/props"] == 1


@pytest.mark.asyncio
async def test_an_abandoned_props_probe_is_tried_again(make_client: MakeClient) -> None:
    with FakeRouter(models_format="top") as fake:
        client = make_client(router_url=fake.url)
        fake.props_delay = 30
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.model_info("fake-vision"), 0.2)
        fake.props_delay = 0
        assert (await client.model_info("fake-vision")).ctx_max == 8192


@pytest.mark.asyncio
async def test_bare_single_model_falls_back_to_props(make_client: MakeClient) -> None:
    with FakeRouter([FakeModel("solo", ["text", "image"], 16384)], models_format="bare") as fake:
        client = make_client(router_url=fake.url)
        assert await client.models() == [ModelInfo("solo", ("text", "image"), 16384, ctx_source="props")]
        assert fake.hits["/props"] == 1


@pytest.mark.asyncio
async def test_bare_without_props_defaults_to_text_and_assumed_ctx(make_client: MakeClient) -> None:
    with FakeRouter([FakeModel("solo", ["text", "image"], 16384)], models_format="bare", props=False) as fake:
        client = make_client(router_url=fake.url, assumed_ctx=3000)
        assert await client.model_info(None) == ModelInfo("solo", ("text",), 3000, ctx_source="assumed")
        assert fake.hits["/props"] == 1


@pytest.mark.asyncio
async def test_ctx_override_applies_to_every_model(make_client: MakeClient, fake: FakeRouter) -> None:
    client = make_client(router_url=fake.url, ctx_max=2000)
    assert [(m.ctx_max, m.ctx_source) for m in await client.models()] == [(2000, "config"), (2000, "config")]


# -- where the context size comes from ----------------------------------------------

UPSTREAM_PROPS = "/upstream/fake-vision/props"


@pytest.mark.asyncio
async def test_llama_swap_is_asked_through_upstream_only_for_the_model_in_use(make_client: MakeClient) -> None:
    with FakeRouter(mode="llama-swap") as fake:
        client = make_client(router_url=fake.url)
        listed = await client.models()
        assert [(m.ctx_max, m.ctx_source) for m in listed] == [(4096, "assumed"), (4096, "assumed")]
        # a status line does not load the model either
        assert (await client.model_info("fake-vision", load=False)).ctx_source == "assumed"
        assert fake.loaded == [] and not any(path.startswith("/upstream/") for path in fake.hits)
        info = await client.model_info("fake-vision")
        assert info == ModelInfo("fake-vision", ("text", "image"), 8192, ctx_source="upstream")
        assert fake.loaded == ["fake-vision"] and fake.hits[UPSTREAM_PROPS] == 1
        assert fake.hits["/props"] == 1  # llama-server's own place was asked first, and has none
        await client.model_info("fake-vision")
        await client.models()
        assert fake.hits[UPSTREAM_PROPS] == 1 and fake.loaded == ["fake-vision"]


@pytest.mark.asyncio
async def test_a_lone_model_behind_llama_swap_is_not_loaded_by_a_listing(make_client: MakeClient) -> None:
    with FakeRouter([FakeModel("solo", n_ctx=16384)], mode="llama-swap") as fake:
        client = make_client(router_url=fake.url)
        assert (await client.models())[0].ctx_source == "assumed"
        assert fake.loaded == []
        assert (await client.model_info(None)).ctx_max == 16384
        assert fake.loaded == ["solo"]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("model", "ctx"),
    [
        (FakeModel("qwen3:8b", ["text", "image"], n_ctx=8192, n_ctx_train=40960), 8192),  # num_ctx in its parameters
        (FakeModel("llama3.2:1b", n_ctx=4096, n_ctx_train=131072), 4096),  # Ollama's default
        (FakeModel("tiny:1b", n_ctx=2048, n_ctx_train=2048), 2048),  # the default, capped at the training length
    ],
)
async def test_ollama_is_asked_with_api_show(make_client: MakeClient, model: FakeModel, ctx: int) -> None:
    with FakeRouter([model, FakeModel("other:1b", tools=False)], mode="ollama") as fake:
        client = make_client(router_url=fake.url)
        assert (await client.models())[0].ctx_source == "assumed"
        info = await client.model_info(model.id)
        assert info == ModelInfo(model.id, tuple(model.input_modalities), ctx, tools=True, ctx_source="ollama")
        assert fake.hits["/api/show"] == 1 and fake.hits["/"] == 1
        assert (await client.model_info("other:1b", load=False)).tools is False  # /api/show loads nothing


@pytest.mark.asyncio
async def test_a_silent_router_gets_the_assumed_size_until_an_overflow_names_it(make_client: MakeClient) -> None:
    with FakeRouter([FakeModel("quiet", n_ctx=1000), FakeModel("other")], mode="silent") as fake:
        client = make_client(router_url=fake.url, assumed_ctx=2048)
        assert await client.model_info("quiet") == ModelInfo("quiet", ("text",), 2048, ctx_source="assumed")
        long = [{"role": "user", "content": "word " * 1000}]
        with pytest.raises(RouterContextOverflow) as overflow:
            await drain(client.stream_chat("quiet", long))
        assert overflow.value.n_ctx == 1000
        learned = client.learn_context("quiet", overflow.value.n_ctx)
        assert learned == ModelInfo("quiet", ("text",), 1000, ctx_source="learned")
        assert await client.model_info("quiet") == learned
        # a refreshed model list does not forget it
        await client.models(refresh=True)
        assert await client.model_info("quiet") == learned
        assert (await client.models())[1].ctx_source == "assumed"


@pytest.mark.asyncio
async def test_a_size_the_router_reports_wins_over_a_learned_one(make_client: MakeClient, fake: FakeRouter) -> None:
    client = make_client(router_url=fake.url)
    await client.models()
    assert client.learn_context("fake-text", 1000).ctx_max == 1000
    assert (await client.model_info("fake-text")).ctx_max == 1000
    await client.models(refresh=True)
    assert await client.model_info("fake-text") == ModelInfo("fake-text", ("text",), 4096, ctx_source="models")


@pytest.mark.asyncio
async def test_a_configured_size_yields_only_to_a_smaller_learned_one(make_client: MakeClient, fake: FakeRouter) -> None:
    client = make_client(router_url=fake.url, ctx_max=3000)
    await client.models()
    assert client.learn_context("fake-text", 5000).ctx_source == "config"
    assert (await client.model_info("fake-text")).ctx_max == 3000
    assert client.learn_context("fake-text", 2000) == ModelInfo("fake-text", ("text",), 2000, ctx_source="learned")
    await client.models(refresh=True)
    assert (await client.model_info("fake-text")).ctx_max == 2000


@pytest.mark.asyncio
async def test_learning_the_size_of_a_model_not_listed_yet(client: RouterClient) -> None:
    assert client.learn_context("elsewhere", 512) == ModelInfo("elsewhere", ctx_max=512, ctx_source="learned")
    with pytest.raises(ValueError):
        client.learn_context("elsewhere", 0)


@pytest.mark.asyncio
async def test_ollama_default_guess_yields_to_a_learned_size(make_client: MakeClient) -> None:
    with FakeRouter([FakeModel("llama3.2:1b", n_ctx=4096, n_ctx_train=131072)], mode="ollama") as fake:
        client = make_client(router_url=fake.url)
        assert (await client.model_info(None)).ctx_max == 4096
        client.learn_context("llama3.2:1b", 32768)  # a server with more VRAM runs a larger default
        await client.models(refresh=True)
        assert await client.model_info(None) == ModelInfo("llama3.2:1b", ctx_max=32768, ctx_source="learned")


@pytest.mark.asyncio
async def test_models_are_cached_and_concurrent_callers_share_a_fetch(client: RouterClient, fake: FakeRouter) -> None:
    results = await asyncio.gather(*(client.models() for _ in range(5)))
    assert all(r == results[0] for r in results)
    await client.model_info("fake-vision")
    assert fake.hits["/v1/models"] == 1
    await client.models(refresh=True)
    assert fake.hits["/v1/models"] == 2


@pytest.mark.asyncio
async def test_model_info_defaults(make_client: MakeClient, fake: FakeRouter) -> None:
    first = make_client(router_url=fake.url)
    assert (await first.model_info(None)).id == "fake-text"
    assert (await first.model_info("")).id == "fake-text"
    configured = make_client(router_url=fake.url, model="fake-vision")
    assert (await configured.model_info(None)).id == "fake-vision"
    assert (await configured.model_info("fake-text")).id == "fake-text"


@pytest.mark.asyncio
async def test_unknown_model_refreshes_once_then_names_the_models(client: RouterClient, fake: FakeRouter) -> None:
    await client.models()
    with pytest.raises(NotFound) as info:
        await client.model_info("gpt-17")
    assert "gpt-17" in info.value.message
    assert "fake-text" in info.value.message and "fake-vision" in info.value.message
    assert fake.hits["/v1/models"] == 2


@pytest.mark.asyncio
async def test_a_model_loaded_after_caching_is_found(client: RouterClient, fake: FakeRouter) -> None:
    await client.models()
    fake.models.append(FakeModel("new-one", n_ctx=1024))
    assert await client.model_info("new-one") == ModelInfo("new-one", ("text",), 1024, ctx_source="models")


@pytest.mark.asyncio
async def test_a_router_without_models(make_client: MakeClient) -> None:
    with FakeRouter(models=[]) as fake:
        client = make_client(router_url=fake.url)
        with pytest.raises(RouterError, match="lists no models"):
            await client.model_info(None)


# -- errors ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_unreachable_router_names_the_url(make_client: MakeClient) -> None:
    url = closed_port_url()
    client = make_client(router_url=url)
    with pytest.raises(RouterUnreachable) as listing:
        await client.models()
    assert url in listing.value.message and "llama-server" in listing.value.message
    with pytest.raises(RouterUnreachable) as chat:
        await drain(client.stream_chat("m", USER))
    assert f"{url}/chat/completions" in chat.value.message
    assert await client.reachable() is False


@pytest.mark.asyncio
async def test_reachable(client: RouterClient) -> None:
    assert await client.reachable() is True


@pytest.mark.asyncio
async def test_proxy_variables_are_not_followed(make_client: MakeClient, fake: FakeRouter, monkeypatch: pytest.MonkeyPatch) -> None:
    # a desktop session's proxy is for the web: the model server at router_url is asked directly
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, closed_port_url())
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    client = make_client(router_url=fake.url)
    assert [m.id for m in await client.models()] == [m.id for m in fake.models]
    events = await drain(client.stream_chat("m", USER))
    assert isinstance(events[-1], StreamEnd)


@pytest.mark.asyncio
async def test_http_500_carries_the_servers_message(client: RouterClient, fake: FakeRouter) -> None:
    fake.script(Reply(status=500, error="model failed to load: out of memory"))
    with pytest.raises(RouterError) as info:
        await drain(client.stream_chat("fake-text", USER))
    assert type(info.value) is RouterError
    assert info.value.status == 500
    assert "model failed to load: out of memory" in info.value.message


@pytest.mark.asyncio
async def test_context_overflow_before_the_stream(client: RouterClient, fake: FakeRouter) -> None:
    fake.script(Reply(status=400, error="request (5000 tokens) exceeds the available context size (4096 tokens), "
                      "try increasing it", error_type="exceed_context_size_error"))
    with pytest.raises(RouterContextOverflow) as info:
        await drain(client.stream_chat("fake-text", USER))
    assert info.value.status == 400
    assert "5000 tokens" in info.value.message


@pytest.mark.asyncio
async def test_context_overflow_from_complete(client: RouterClient, fake: FakeRouter) -> None:
    fake.script_complete(Reply(status=400, error="the request exceeds the available context size",
                               error_type="exceed_context_size_error"))
    with pytest.raises(RouterContextOverflow):
        await client.complete("fake-text", USER)


@pytest.mark.asyncio
async def test_error_mid_stream_keeps_the_deltas_before_it(client: RouterClient, fake: FakeRouter) -> None:
    fake.script(Reply(chunks=["par", "tial"], error="slot crashed"))
    seen: list[StreamEvent] = []
    with pytest.raises(RouterError, match="slot crashed"):
        async for event in client.stream_chat("fake-text", USER):
            seen.append(event)
    assert seen == [ContentDelta("par"), ContentDelta("tial")]


@pytest.mark.asyncio
async def test_legacy_error_field_mid_stream(client: RouterClient, fake: FakeRouter) -> None:
    fake.script(Reply(chunks=[], error="the request exceeds the available context size", legacy_error=True,
                      error_type="exceed_context_size_error"))
    with pytest.raises(RouterContextOverflow):
        await drain(client.stream_chat("fake-text", USER))


@pytest.mark.asyncio
async def test_dropped_stream_is_a_router_error(client: RouterClient, fake: FakeRouter) -> None:
    fake.script(Reply(chunks=["one ", "two ", "three"], drop_after=2))
    seen: list[StreamEvent] = []
    with pytest.raises(RouterError, match="mid-stream") as info:
        async for event in client.stream_chat("fake-text", USER):
            seen.append(event)
    assert type(info.value) is RouterError
    assert seen == [ContentDelta("one "), ContentDelta("two ")]


@pytest.mark.asyncio
async def test_a_stalled_stream_times_out(make_client: MakeClient, fake: FakeRouter) -> None:
    client = make_client(router_url=fake.url, request_timeout=0.2)
    fake.script(Reply(chunks=["late"], delay=30))
    with pytest.raises(RouterUnreachable, match="sent nothing for 0.2 s"):
        await drain(client.stream_chat("fake-text", USER))


@pytest.mark.asyncio
async def test_api_key(make_client: MakeClient) -> None:
    with FakeRouter(api_key="sekrit") as fake:
        good = make_client(router_url=fake.url, api_key="sekrit")
        assert len(await good.models()) == 2
        bad = make_client(router_url=fake.url)
        with pytest.raises(RouterError, match="api_key") as info:
            await bad.models()
        assert info.value.status == 401
        assert "Invalid API Key" in info.value.message


@pytest.mark.asyncio
async def test_wrong_path_advises_on_router_url(make_client: MakeClient, fake: FakeRouter) -> None:
    client = make_client(router_url=fake.url + "/nowhere")
    with pytest.raises(RouterError, match="check router_url") as info:
        await client.models()
    assert info.value.status == 404


# -- cancellation ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_cancelling_the_consumer_disconnects(client: RouterClient, fake: FakeRouter) -> None:
    fake.script(Reply(chunks=["first "], hang=True))
    got_first = asyncio.Event()
    seen: list[StreamEvent] = []

    async def consume() -> None:
        async for event in client.stream_chat("fake-text", USER):
            seen.append(event)
            got_first.set()

    task = asyncio.create_task(consume())
    await got_first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(fake.wait_disconnects, 1)
    assert fake.disconnects == 1
    assert seen == [ContentDelta("first ")]


@pytest.mark.asyncio
async def test_closing_the_generator_disconnects(client: RouterClient, fake: FakeRouter) -> None:
    fake.script(Reply(chunks=["a", "b", "c", "d"], delay=0.05))
    async with aclosing(client.stream_chat("fake-text", USER)) as stream:
        async for event in stream:
            assert event == ContentDelta("a")
            break
    assert await asyncio.to_thread(fake.wait_disconnects, 1)
    # The client still works on a fresh connection.
    assert isinstance((await drain(client.stream_chat("fake-text", USER)))[-1], StreamEnd)


# -- complete and embeddings -------------------------------------------------------------


@pytest.mark.asyncio
async def test_complete(client: RouterClient, fake: FakeRouter) -> None:
    assert await client.complete("fake-text", USER) == "Fake title"
    fake.script_complete(Reply(text="Cats and dogs"))
    assert await client.complete("fake-text", USER, max_tokens=12) == "Cats and dogs"
    sent = fake.requests[-1]
    assert sent["stream"] is False and sent["max_tokens"] == 12


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


@pytest.mark.asyncio
async def test_embeddings_in_input_order(client: RouterClient, fake: FakeRouter) -> None:
    texts = ["the cat sat on the mat", "the cat sat", "quantum chromodynamics lecture"]
    vectors = await client.embed("embedder", texts)
    assert len(vectors) == 3 and all(len(v) == 8 for v in vectors)
    assert all(math.isclose(cosine(v, v), 1.0) for v in vectors)
    # The fake answers in reverse order; the client must reorder by index.
    assert vectors == [fake_embedding(text) for text in texts]
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])
    assert fake.embedding_requests[-1]["model"] == "embedder"
    assert fake.embedding_requests[-1]["input"] == texts
    assert await client.embed("embedder", []) == []
    assert len(fake.embedding_requests) == 1


@pytest.mark.asyncio
async def test_embeddings_use_embedding_url(make_client: MakeClient, fake: FakeRouter) -> None:
    client = make_client(router_url=closed_port_url(), embedding_url=fake.url)
    assert len(await client.embed("e", ["x"])) == 1
    assert fake.hits["/v1/embeddings"] == 1


@pytest.mark.asyncio
async def test_failing_and_slow_embedder(client: RouterClient, fake: FakeRouter) -> None:
    fake.embed_fail = True
    with pytest.raises(RouterError, match="fake embedder failure") as info:
        await client.embed("e", ["x"])
    assert info.value.status == 500
    fake.embed_fail = False
    fake.embed_delay = 30
    with pytest.raises(RouterUnreachable, match="within 0.2 s"):
        await client.embed("e", ["x"], timeout=0.2)


@pytest.mark.asyncio
async def test_an_embedding_answer_json_cannot_carry_is_the_servers_error() -> None:
    # a Python server's json.dumps writes Infinity; int() of it overflows
    body = b'{"data": [{"index": Infinity, "embedding": [0.5, 0.5]}]}'
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
    client = RouterClient(Config(router_url="http://router.test/v1"), transport=transport)
    try:
        with pytest.raises(RouterError, match="answered without embeddings"):
            await client.embed("e", ["x"])
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_props_tells_a_template_without_tools(make_client: MakeClient) -> None:
    with FakeRouter(models=[FakeModel("plain", n_ctx=2048, tools=False)], models_format="bare") as fake:
        info = await make_client(router_url=fake.url).model_info(None)
        assert info == ModelInfo("plain", ("text",), 2048, tools=False, ctx_source="props")
    with FakeRouter(models=[FakeModel("able", n_ctx=2048)], models_format="bare") as fake:
        assert (await make_client(router_url=fake.url).model_info(None)).tools is True


@pytest.mark.asyncio
async def test_an_image_for_a_text_model_is_the_servers_error(client: RouterClient, fake: FakeRouter) -> None:
    # as llama-server answers it (HTTP 500); the daemon refuses such a turn before sending it
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
    with pytest.raises(RouterError) as info:
        await drain(client.stream_chat("fake-text", image))
    assert "image input is not supported" in info.value.message and info.value.status == 500
