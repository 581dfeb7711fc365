"""The daemon as an MCP host: configured servers, started when first needed, kept contained.

Each server has a ``ServerHandle``, a small state machine:

    idle --need--> starting --listed--> ready --crash/exit/garbage/hang--> failed
                       \\--error/timeout----------------------------------> failed
    failed --need, once its back-off has passed--> starting

A connection lives in a task of its own (``_hold``), so starting, a crash or a kill
never run on a turn's task, and nothing waits longer than ``start_timeout`` for a
server to start or ``call_timeout`` for a call. A failure is kept as the server's
``last_error`` (``status`` shows it) and the server is tried again on the next need
after a back-off that doubles with each failure in a row (``BACKOFF_FIRST`` to
``BACKOFF_MAX``). Each start is a generation of its own and waits for the one before
to stop its process, so what an earlier start does as it ends (clear its connection,
tell how it ended) never touches a later one. A call that times out takes its server
down (it is hung, and its next call would wait as long); any other failure of a call
comes back to the model as a tool error (``ToolError``), never as a failed turn.

The SDK (``mcphost.connection``) is imported in a worker thread on first need, or by
``warm()`` after the daemon is ready: a heavy import that must not stall the event loop,
and that a daemon without MCP servers never pays.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

from core.mcpconfig import McpServerSpec, McpSettings
from core.seams import ImageReader
from core.tools import ToolError

from .records import CallOutcome
from .tool import McpTool, offered_names

if TYPE_CHECKING:
    from .connection import Connection

__all__ = ["McpHost", "ServerHandle"]

logger = logging.getLogger(__name__)

BACKOFF_FIRST = 1.0  # seconds before a failed server is tried again
BACKOFF_MAX = 300.0
START_SLACK = 5.0  # seconds beyond start_timeout for spawning the process
# seconds a new start waits for the one before to stop its process: two STOP_GRACE
# (connection.py) at most, and a margin for a loaded machine
STOP_WAIT = 10.0
# seconds a task given up on (cancelled) gets to stop its process: stdin closed, SIGTERM, SIGKILL,
# STOP_GRACE apart, in a cleanup the cancel does not cut short
KILL_WAIT = 4.0
State = Literal["idle", "starting", "ready", "failed", "stopped"]


class ServerHandle:
    """One configured server: its state, its last error, its tools, its connection."""

    def __init__(self, spec: McpServerSpec, settings: McpSettings, sdk: _Sdk) -> None:
        self.spec = spec
        self.settings = settings
        self._sdk = sdk
        self.state: State = "idle"
        self.last_error: str | None = None
        self.failures = 0  # in a row; reset by a successful start
        self.starts = 0
        self.retry_at = 0.0
        self.connection: Connection | None = None
        self._task: asyncio.Task[None] | None = None
        self._generation = 0  # one more with each start
        self._ready: asyncio.Future[None] | None = None
        self._stop = asyncio.Event()

    def to_json(self) -> dict[str, Any]:
        retry = max(self.retry_at - time.monotonic(), 0.0) if self.state == "failed" else 0.0
        return {
            "name": self.spec.name,
            "transport": self.spec.transport,
            "state": self.state,
            "last_error": self.last_error,
            "tools": len(self.connection.tools) if self.connection else 0,
            "starts": self.starts,
            "retry_in": round(retry, 1),
        }

    async def ensure(self) -> bool:
        """Start the server if it is not running and may be tried; whether it is ready."""
        if self.state == "ready":
            return True
        if self.state == "stopped" or (self.state == "failed" and time.monotonic() < self.retry_at):
            return False
        if self.state != "starting":
            self._begin()
        ready, generation = self._ready, self._generation
        assert ready is not None
        # the connection's own start timeout fires first; this one only guards against a bug there
        wait = STOP_WAIT + self.settings.start_timeout + START_SLACK
        done, _ = await asyncio.wait({ready}, timeout=wait)
        if not done:
            self._fail(f"did not start within {self.settings.start_timeout:g} s", generation)
        return self.state == "ready"

    def _begin(self) -> None:
        """A new start, a generation of its own: what is left of the one before (a task still
        stopping its process) can neither clear the new connection nor fail the new start."""
        self.state = "starting"
        self.starts += 1
        self._generation += 1
        self._stop = asyncio.Event()
        self._ready = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(
            self._hold(self._generation, self._ready, self._stop, self._task), name=f"mcp server {self.spec.name}"
        )

    async def _hold(
        self, generation: int, ready: asyncio.Future[None], stop: asyncio.Event,
        previous: asyncio.Task[None] | None,
    ) -> None:
        """The connection's whole life, in its own task, once the one before it has ended."""

        async def on_ready(connection: Connection) -> None:
            if generation != self._generation or stop.is_set():
                return  # given up on while it started: it is stopped at once
            # a failure before is history now: ``status`` says what is, not what was
            self.connection, self.state, self.failures, self.last_error = connection, "ready", 0, None
            logger.info("MCP server %s ready: %d tool(s)", self.spec.name, len(connection.tools))
            if not ready.done():
                ready.set_result(None)

        try:
            await _ended(previous)  # one process of a server at a time
            if stop.is_set():
                return
            module = await self._sdk.load()
            why = await module.open_connection(
                self.spec, self.settings.start_timeout, self.settings.call_timeout, on_ready, stop
            )
            if why:
                self._fail(why, generation)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - whatever a server does, the daemon goes on
            self._fail(_describe(exc), generation)
        finally:
            if generation == self._generation:
                self.connection = None
                if self.state in ("ready", "starting") and not stop.is_set():
                    self._fail("the connection ended", generation)
            if not ready.done():
                ready.set_result(None)

    def _fail(self, why: str, generation: int | None = None) -> None:
        """Mark the server failed, stop what is left of it, and set its back-off; a failure
        told by an earlier start (``generation``) than the current one is old news."""
        if self.state == "stopped" or generation not in (None, self._generation):
            return
        if self.state == "failed":
            if generation is not None:  # the same failure, told again (with more detail) by the connection's end
                self.last_error = why
            return
        self.last_error = why
        self.state = "failed"
        self.failures += 1
        self.retry_at = time.monotonic() + min(BACKOFF_FIRST * 2 ** (self.failures - 1), BACKOFF_MAX)
        logger.warning("MCP server %s failed: %s", self.spec.name, why)
        self._stop.set()  # the holding task closes the connection and stops the process
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    async def call(self, name: str, arguments: dict[str, Any]) -> CallOutcome:
        """One tool call; ``ToolError`` when the server is not there or does not answer in time."""
        connection = self.connection
        if self.state != "ready" or connection is None:
            raise ToolError(f"the MCP server {self.spec.name} is not running ({self.last_error or 'stopped'})")
        timeout = self.settings.call_timeout
        try:
            return await asyncio.wait_for(connection.call(name, arguments, timeout), timeout + 1.0)
        except asyncio.TimeoutError:
            why = f"{name} did not answer within {timeout:g} s"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the connection died under the call
            why = _describe(exc)
        if "timed out" in why.lower():
            why = f"{name} did not answer within {timeout:g} s"
        if self.connection is connection:
            self._fail(why)
        raise ToolError(f"the MCP server {self.spec.name} failed: {why}; it is restarted on a later turn")

    async def stop(self) -> None:
        """Stop the server, started or starting; its process is gone when this returns (the
        daemon must not leave it behind), unless even SIGKILL did not end it."""
        self.state = "stopped"
        self._stop.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), STOP_WAIT)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - shutting down regardless
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=KILL_WAIT)


class _Sdk:
    """The SDK-facing module, imported once, in a worker thread."""

    def __init__(self) -> None:
        self._module: ModuleType | None = None
        self._lock = asyncio.Lock()

    async def load(self) -> Any:
        if self._module is None:
            async with self._lock:
                if self._module is None:
                    self._module = await asyncio.to_thread(importlib.import_module, "mcphost.connection")
        return self._module


class McpHost:
    """Every configured server, and the tools of those a conversation uses."""

    def __init__(self, settings: McpSettings, images: ImageReader, sdk: _Sdk | None = None) -> None:
        self.settings = settings
        self._images = images  # a tool's images go through the attachments' pipeline
        self._sdk = sdk or _Sdk()
        self.handles = {spec.name: ServerHandle(spec, settings, self._sdk) for spec in settings.servers}
        self._made: dict[str, tuple[Connection, list[McpTool]]] = {}  # each server's tools, as offered

    def reconfigured(self, settings: McpSettings) -> tuple[McpHost, list[ServerHandle]]:
        """A host for a reloaded ``[mcp]`` table: a server configured as before is kept as it is
        (running, with its tools); the handles of those removed or changed are returned, for the
        caller to stop once the turns that may call them have ended."""
        host = McpHost(settings, self._images, self._sdk)
        retired = []
        for name, handle in self.handles.items():
            if name in host.handles and settings.server(name) == handle.spec:
                handle.settings = settings  # its timeouts as now configured, from its next start or call
                host.handles[name] = handle
                if name in self._made and settings.max_result_chars == self.settings.max_result_chars:
                    host._made[name] = self._made[name]
            else:
                retired.append(handle)
        return host, retired

    async def warm(self) -> None:
        """Load the SDK ahead of the first need (after readiness: start-up does not wait)."""
        await self._sdk.load()

    def status(self) -> list[dict[str, Any]]:
        return [handle.to_json() for handle in self.handles.values()]

    async def offer(self, servers: Sequence[str], room: int) -> tuple[list[McpTool], str | None]:
        """The tools of ``servers`` (started as needed, concurrently), sorted by name, as many as
        ``room`` tokens of descriptions hold; and a note when some were left out or a server is down."""
        handles = [self.handles[name] for name in servers if name in self.handles]
        ready = await asyncio.gather(*(h.ensure() for h in handles))
        tools: list[McpTool] = []
        for handle, up in zip(handles, ready):
            if up and handle.connection is not None:
                tools += self._tools_of(handle, handle.connection)
        tools.sort(key=lambda t: t.name)
        notes = [f"MCP server {h.spec.name} is not available ({h.last_error or h.state})"
                 for h, up in zip(handles, ready) if not up]
        kept = fit_tools(tools, room)
        if len(kept) < len(tools):
            notes.append(f"offering {len(kept)} of {len(tools)} MCP tools: their descriptions would take "
                         f"more than {room} tokens ({self.settings.tools_share:.0%} of the context)")
        return kept, "; ".join(notes) or None

    def running_tools(self, servers: Sequence[str], room: int) -> list[McpTool]:
        """The tools ``offer`` would give of those of ``servers`` that run now, starting none (an
        ``estimate`` asks)."""
        handles = [self.handles[name] for name in servers if name in self.handles]
        tools = [tool for h in handles if h.state == "ready" and h.connection is not None
                 for tool in self._tools_of(h, h.connection)]
        return fit_tools(sorted(tools, key=lambda t: t.name), room)

    def _tools_of(self, handle: ServerHandle, connection: Connection) -> list[McpTool]:
        """A server's tools as offered: made once a connection (a restarted server lists anew)."""
        made = self._made.get(handle.spec.name)
        if made is None or made[0] is not connection:
            names = offered_names(handle.spec.name, [t.name for t in connection.tools])
            tools = [McpTool(handle, t, names[t.name], self.settings.max_result_chars, self._images)
                     for t in connection.tools]
            made = self._made[handle.spec.name] = (connection, tools)
        return made[1]

    async def describe(self) -> list[dict[str, Any]]:
        """Every server with its tools, starting those not running (``mcp list``)."""
        await asyncio.gather(*(h.ensure() for h in self.handles.values()))
        described = []
        for handle in self.handles.values():
            entry = handle.to_json()
            connection = handle.connection
            if connection is not None:
                names = offered_names(handle.spec.name, [t.name for t in connection.tools])
                entry["tools"] = [{"name": t.name, "offered_as": names[t.name], "description": t.description,
                                   "asks": handle.spec.asks(t.name, t.read_only)}
                                  for t in sorted(connection.tools, key=lambda t: names[t.name])]
            else:
                entry["tools"] = []
            described.append(entry)
        return described

    async def close(self) -> None:
        await asyncio.gather(*(h.stop() for h in self.handles.values()))


def fit_tools(tools: list[McpTool], room: int) -> list[McpTool]:
    """The first tools (in their sorted order) whose definitions fit ``room`` tokens: the same
    prefix every turn, so the prompt's top stays the same while nothing changes."""
    kept: list[McpTool] = []
    used = 0
    for tool in tools:
        used += tool.tokens
        if used > room:
            break
        kept.append(tool)
    return kept


async def _ended(task: asyncio.Task[None] | None) -> None:
    """Wait for an earlier start's task to stop its process; cancel it if it takes too long."""
    if task is None or task.done():
        return
    try:
        done, _ = await asyncio.wait({task}, timeout=STOP_WAIT)
    except asyncio.CancelledError:  # the daemon stops: so does what is left of the earlier start
        task.cancel()
        raise
    if not done:
        logger.warning("MCP server task %s did not stop within %g s; cancelled", task.get_name(), STOP_WAIT)
        task.cancel()


def _describe(exc: BaseException) -> str:
    """One line for a failure, from inside an exception group when the SDK's task groups made one."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc) or type(exc).__name__
    return text if type(exc).__name__ in ("ConnectionLost", "ToolError") else f"{type(exc).__name__}: {text}"
