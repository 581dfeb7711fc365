"""Fixtures for recall through a real tool-calling model: llama-server with Qwen2.5-Coder-1.5B.

Run by path (``make e2e-tools``: ``pytest tests/e2e_tools/``); a plain ``pytest`` leaves
this directory out (``norecursedirs``). ``scripts/llama.py install --tools`` fetches the
model once (1.1 GB); without it every test here is skipped with the reason. The server
runs as the issue measured it: our chat template (``scripts/qwen2.5-coder-tools.jinja``),
``--jinja -c 4096 -t 2 --temp 0``. The daemon is the real one, in-process
(``tests/conftest.py``), told a context of 2,048 tokens so that a test's conversation
is compacted within a few dozen short turns.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from client import Wire
from core import Config, load_config
from tests.e2e.realserver import installed_or_skip_reason, llama, wait_idle
from tests.e2e_tools.scenarios import DAEMON_ENV

IDLE_TIMEOUT = 120.0  # a turn an earlier test left running on the slow model
# seconds for any one event: a first request reads the system prompt and the tools before its
# first token, and a compaction's summary is written before the turn goes on
EVENT_TIMEOUT = 600.0


def tools_state_or_skip() -> dict[str, str]:
    state, reason = installed_or_skip_reason()
    if state is None:
        pytest.skip(reason)
    stamp = llama.MODELS / (llama.TOOLS_FILE + ".sha256")
    if not stamp.is_file():
        pytest.skip(f"{llama.TOOLS_ALIAS} is not in {llama.MODELS}: run `make e2e-tools` "
                    "(or `python3 scripts/llama.py install --tools`, a 1.1 GB download)")
    return dict(llama.with_tools_model(state))


@pytest.fixture(scope="session")
def tools_server() -> Iterator[Any]:
    """llama-server with the tool-calling model on a free loopback port, for the whole session."""
    state = tools_state_or_skip()
    log = llama.CACHE / "e2e-tools-llama-server.log"
    server = llama.start_server(state, extra=(*llama.TOOLS_FLAGS, "--slots"), log=log)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def server_idle(tools_server: Any) -> None:
    wait_idle(tools_server.url, IDLE_TIMEOUT)


@pytest.fixture
def config(tools_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    monkeypatch.setenv("ASSISTANT_ROUTER_URL", tools_server.v1)
    for key, value in DAEMON_ENV.items():
        monkeypatch.setenv(key, value)
    return load_config()


@pytest_asyncio.fixture
async def wire(daemon: Any) -> AsyncIterator[Wire]:
    client = await Wire.open(daemon.config.socket_path, timeout=EVENT_TIMEOUT)
    yield client
    await client.close()
