"""Fixtures: every path in tmp_path, a fake router on loopback, the real daemon on a real socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from client import Wire
from core import Config, load_config
from core import router as router_module
from core.jsontext import EncodedPrefix
from daemon.server import Server, new_event_loop
from selfcheck.fakerouter import FakeRouter
from tests.contract import watch

EVENT_TIMEOUT = 30.0  # seconds for any one event: a hang fails the test instead of stalling the suite
TMPFS = Path("/dev/shm")


def pytest_configure(config: pytest.Config) -> None:
    """The tests' files (tmp_path, and what they and the daemons they start put in TMPDIR) on
    tmpfs where the machine has one and the caller named no TMPDIR: each test's daemon makes
    its SQLite database afresh, and on a disk the fsyncs of its set-up and of the checkpoint at
    its close were a good part of every start and stop."""
    if "TMPDIR" not in os.environ and TMPFS.is_dir() and os.access(TMPFS, os.W_OK | os.X_OK):
        os.environ["TMPDIR"] = str(TMPFS)
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Every test runs on the daemon's own event loop (uvloop's, where it is installed)."""
    return {"daemon": new_event_loop}


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point socket, data and config into tmp_path; drop any ASSISTANT_* of the caller."""
    for var in list(os.environ):
        if var.startswith(("ASSISTANT_", "LISTEN_", "NOTIFY_SOCKET")):
            monkeypatch.delenv(var)
    # a short socket path: AF_UNIX paths are limited to 107 bytes
    runtime = Path(f"/tmp/asst-test-{os.getpid()}-{abs(hash(tmp_path)) % 10**8}")
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("HOME", str(tmp_path))
    yield tmp_path
    for child in runtime.iterdir():
        child.unlink()
    runtime.rmdir()


@pytest.fixture(autouse=True)
def protocol_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request a test sends and every event it reads keeps to docs/protocol.schema.json."""
    watch(monkeypatch)


@pytest.fixture(autouse=True)
def bodies_as_encoded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every request body the daemon makes in pieces (``core.jsontext.json_body``: replayed turns'
    JSON made once, data URLs spliced) is the JSON of the body as it is when sent: a message changed
    in place after its JSON was made once would send stale text."""
    real = router_module.json_body
    stale: list[str] = []

    def checked(body: dict[str, Any], encoded: EncodedPrefix | None = None) -> list[bytes]:
        parts = real(body, encoded)
        if b"".join(parts) != json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode():
            stale.append(json.dumps(body)[:300])
        return parts

    monkeypatch.setattr(router_module, "json_body", checked)
    yield
    assert not stale, f"a request body differs from the JSON of its messages: {stale[0]}"


@pytest.fixture
def no_tesseract(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PATH with poppler's tools but no tesseract (the machine the attachments design was
    written on): scanned pages cannot be read by OCR."""
    tools = tmp_path / "no-tesseract-bin"
    tools.mkdir()
    for tool in ("pdftotext", "pdftoppm", "pdfinfo"):
        (tools / tool).symlink_to(shutil.which(tool) or tool)
    monkeypatch.setenv("PATH", str(tools))  # each daemon's (and each FileReaders') OCR asks afresh


@pytest.fixture
def router() -> Iterator[FakeRouter]:
    with FakeRouter() as fake:
        yield fake


@pytest.fixture
def config(router: FakeRouter, monkeypatch: pytest.MonkeyPatch) -> Config:
    monkeypatch.setenv("ASSISTANT_ROUTER_URL", router.url)
    monkeypatch.setenv("ASSISTANT_AUTO_TITLE", "false")
    monkeypatch.setenv("ASSISTANT_SHUTDOWN_GRACE", "0.5")
    return load_config()


class RunningDaemon:
    """A Server running in the test's loop, stoppable and restartable."""

    def __init__(self, config: Config, load: Callable[[], Config] | None = None) -> None:
        self.config = config
        self.load = load  # what a reload reads (None: no reload)
        self.server: Server | None = None
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.server = Server(self.config, self.load)
        self.task = asyncio.create_task(self.server.serve())
        ready = asyncio.create_task(self.server.ready.wait())
        done, _ = await asyncio.wait([ready, self.task], return_when=asyncio.FIRST_COMPLETED)
        if self.task in done:
            ready.cancel()
            self.task.result()  # raises what stopped it

    async def stop(self) -> None:
        if self.server is not None and self.task is not None:
            self.server.request_stop()
            await self.task
            self.server = None

    async def connect(self) -> Wire:
        return await Wire.open(self.config.socket_path, timeout=EVENT_TIMEOUT)


@contextlib.asynccontextmanager
async def serving(config: Config) -> AsyncIterator[tuple[RunningDaemon, Wire]]:
    """A daemon on ``config`` and a connection to it, stopped at the end: for a test that
    stops and starts its own (a restart is two of these in turn)."""
    running = RunningDaemon(config)
    await running.start()
    try:
        client = await running.connect()
        try:
            yield running, client
        finally:
            await client.close()
    finally:
        await running.stop()


@pytest_asyncio.fixture
async def daemon(config: Config) -> AsyncIterator[RunningDaemon]:
    running = RunningDaemon(config)
    await running.start()
    yield running
    await running.stop()


@pytest_asyncio.fixture
async def wire(daemon: RunningDaemon) -> AsyncIterator[Wire]:
    client = await daemon.connect()
    yield client
    await client.close()
