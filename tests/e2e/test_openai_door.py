"""One question through the OpenAI door against the real llama-server, with the ``openai`` SDK:
streamed, continued by a second request that resends the first, and stored as one conversation."""

from __future__ import annotations

import dataclasses

import openai
import pytest

from client import Wire
from core import Config
from tests.conftest import RunningDaemon, serving
from tests.e2e.realserver import installed_or_skip_reason

STATE, SKIP_REASON = installed_or_skip_reason()
if STATE is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.asyncio


async def test_an_openai_client_asks_through_the_door(config: Config) -> None:
    config = dataclasses.replace(config, openai_listen="127.0.0.1:0", openai_key="e2e-key-of-sixteen-chars")
    running: RunningDaemon
    wire: Wire
    async with serving(config) as (running, wire):
        assert running.server is not None and running.server.door is not None
        host, port = running.server.door.address or ("", 0)
        client = openai.AsyncOpenAI(base_url=f"http://{host}:{port}/v1", api_key="e2e-key-of-sixteen-chars", max_retries=0)
        model = (await client.models.list()).data[0].id
        messages = [{"role": "user", "content": "Say hello in five words."}]
        stream = await client.chat.completions.create(model=model, messages=messages, stream=True, max_tokens=24,
                                                      stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        first = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert first and chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0
        again = await client.chat.completions.create(model=model, max_tokens=24, messages=[
            *messages, {"role": "assistant", "content": first}, {"role": "user", "content": "Once more."}])
        assert again.id == "chatcmpl-1-2" and again.choices[0].finish_reason in ("stop", "length")
        conv = await wire.request({"type": "open", "conversation": 1})
        assert [t["reply"] for t in conv["turns"]] == [first, again.choices[0].message.content]
        await client.close()
