"""Fixtures for the end-to-end tests: the real llama-server, the daemon pointed at it.

These tests run only when asked for by path (``pytest tests/e2e/``, as ``make e2e``
does): a plain ``pytest`` (``make test``) leaves this directory out (``norecursedirs``
in pyproject.toml), because building llama-server takes minutes and CI's time is
for the suite.  With nothing installed every test here is skipped with the
reason (see ``-rs``).

The daemon is the real one, in-process, from ``tests/conftest.py``
(``RunningDaemon``, the ``daemon`` and ``wire`` fixtures); only ``config``
changes, to point it at llama-server.  One llama-server serves the session; each
test first waits until it is idle, so a test that left a generation running
cannot slow the next one down.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from core import Config, load_config
from core.router import RouterClient
from tests.e2e.realserver import installed_or_skip_reason, llama, wait_idle

# llama-server options besides those scripts/llama.py always passes: the counters the tests read,
# and a cap on a reply, because a 135M model sometimes rambles until the context is full
SERVER_EXTRA = ("--metrics", "--slots", "-n", "400")


@pytest.fixture(scope="session")
def llama_server() -> Iterator[Any]:
    """llama-server with SmolLM2 on a free loopback port, for the whole session."""
    state, reason = installed_or_skip_reason()
    if state is None:
        pytest.skip(reason)
    server = llama.start_server(state, extra=SERVER_EXTRA, log=llama.CACHE / "e2e-llama-server.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def server_idle(llama_server: Any) -> None:
    """Start each test with nothing generating (an earlier test may have left a turn running)."""
    wait_idle(llama_server.url)


@pytest.fixture
def config(llama_server: Any, monkeypatch: pytest.MonkeyPatch) -> Config:
    monkeypatch.setenv("ASSISTANT_ROUTER_URL", llama_server.v1)
    monkeypatch.setenv("ASSISTANT_AUTO_TITLE", "false")
    monkeypatch.setenv("ASSISTANT_SHUTDOWN_GRACE", "0.5")
    return load_config()


@dataclass
class Sent:
    """What the daemon sent to the real server: streamed chats (with the tools offered) and plain completions."""

    chats: list[dict[str, Any]] = field(default_factory=list)
    completions: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Sent:
    """Record the daemon's router calls (in-process), passing every one on unchanged."""
    record = Sent()
    stream_chat, complete = RouterClient.stream_chat, RouterClient.complete

    def recording_stream_chat(self: RouterClient, model: str, messages: list[dict[str, Any]], *args: Any,
                              **kwargs: Any) -> AsyncGenerator[Any, None]:
        tools = args[0] if args else kwargs.get("tools")
        record.chats.append({"model": model, "messages": list(messages), "tools": tools or []})
        return stream_chat(self, model, messages, *args, **kwargs)

    async def recording_complete(self: RouterClient, model: str, messages: list[dict[str, Any]], *args: Any,
                                 **kwargs: Any) -> str:
        record.completions.append({"model": model, "messages": list(messages)})
        return await complete(self, model, messages, *args, **kwargs)

    monkeypatch.setattr(RouterClient, "stream_chat", recording_stream_chat)
    monkeypatch.setattr(RouterClient, "complete", recording_complete)
    return record
