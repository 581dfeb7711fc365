"""One connection to an MCP server through the official SDK: start, list, call, stop.

This is the one module of ours that imports the ``mcp`` SDK, a heavy import;
``mcphost.host`` loads it in a worker thread the first time a server is needed, so a
daemon without MCP servers never loads it and one with them never blocks its loop on it.

The protocol is the SDK's (``ClientSession``: initialize, ``tools/list``, ``tools/call``;
its streamable HTTP transport). For stdio the transport is ours (``bounded_stdio``),
because the SDK's reads a server's lines without limit: a server that prints a gigabyte
without a newline would take the daemon's memory with it, and one that prints garbage
has every line logged with a traceback. Ours frames the same newline-delimited JSON-RPC
but caps a line at ``MAX_LINE_BYTES`` and gives up on a server after
``MAX_GARBAGE_LINES`` lines that are not JSON-RPC; either ends the connection with a
``fault`` the host shows in ``status``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import re
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx2  # the SDK's own HTTP client (a fork of httpx it depends on), loaded with it
import mcp_types
import pydantic
from mcp import ClientSession
from mcp.client.stdio import get_default_environment
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage

from core.mcpconfig import McpServerSpec

from .records import CallOutcome, RemoteTool

__all__ = ["Connection", "ConnectionLost", "open_connection"]

logger = logging.getLogger(__name__)

MAX_LINE_BYTES = 16 * 1024 * 1024  # one JSON-RPC message from a server (a large image result fits)
MAX_GARBAGE_LINES = 20  # lines that are not JSON-RPC before a server is given up on
STDERR_TAIL = 5  # lines of a server's stderr kept for its last error
STDERR_LINE_CHARS = 300
STOP_GRACE = 1.0  # seconds a server gets to exit after its stdin closes, then after SIGTERM
GROUP_POLL = 0.05  # seconds between looks at what is left of a stopped server's process group
MAX_TOOL_PAGES = 20  # tools/list pages read (a server that pages forever is cut off)
UNREADABLE = "its answer is not JSON-RPC that can be read"
LINES_PER_TURN = 32  # a server's lines read before the event loop serves the rest of the daemon


class ConnectionLost(Exception):
    """The server is gone, or the connection to it failed; the message says how."""


@dataclass
class Fault:
    """What ended a stdio connection from the server's side, and what it said on stderr."""

    reason: str | None = None
    stderr: list[str] = field(default_factory=list)
    closed: anyio.Event = field(default_factory=anyio.Event)

    def describe(self, default: str) -> str:
        text = self.reason or default
        if self.stderr:
            text += f" (its stderr ended: {' | '.join(self.stderr)})"
        return text


Streams = tuple[Any, Any]


@contextlib.asynccontextmanager
async def bounded_stdio(spec: McpServerSpec, fault: Fault) -> AsyncIterator[Streams]:
    """Run the server as a child (its own process group) and frame its JSON-RPC lines, bounded."""
    env = get_default_environment() | dict(spec.env)
    try:
        proc = await asyncio.create_subprocess_exec(
            spec.command, *spec.args, env=env, cwd=spec.cwd, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, limit=MAX_LINE_BYTES,
            start_new_session=True, preexec_fn=_dies_with(os.getpid()),
        )
    except FileNotFoundError:
        if spec.cwd is not None and not os.path.isdir(spec.cwd):
            raise ConnectionLost(f"cannot run {spec.command!r}: its folder (cwd) {spec.cwd} does not exist") from None
        raise ConnectionLost(f"cannot run {spec.command!r}: no such program (check command and PATH)") from None
    except OSError as exc:
        raise ConnectionLost(f"cannot run {spec.command!r}: {exc.strerror or exc}") from None
    assert proc.stdin and proc.stdout and proc.stderr
    read_send, read_recv = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_send, write_recv = anyio.create_memory_object_stream[SessionMessage](0)

    waiting: set[int | str] = set()  # the ids of our requests not yet answered

    async def from_server() -> None:
        garbage = lines = 0
        async with read_send:
            while True:
                lines += 1
                if lines % LINES_PER_TURN == 0:
                    await asyncio.sleep(0)  # lines already buffered are read without a wait: let the loop in
                try:
                    line = await proc.stdout.readline()  # type: ignore[union-attr]
                except ValueError:  # over the limit: asyncio drops the buffer and raises
                    fault.reason = too_large()
                    break
                if not line:
                    break
                if not line.strip():
                    continue
                try:
                    message = mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                except ValueError as exc:
                    answered = unreadable_answer(line, waiting, exc)
                    if answered is not None:  # a reply the SDK cannot read: its call fails now
                        message = answered
                    else:
                        garbage += 1
                        logger.debug("MCP server %s: a line that is not JSON-RPC: %.80r", spec.name, line)
                        if garbage >= MAX_GARBAGE_LINES:
                            fault.reason = f"wrote {garbage} lines that are not JSON-RPC on stdout"
                            break
                        continue
                if isinstance(message, mcp_types.JSONRPCNotification):
                    continue  # progress, logs, list changes: the host uses none, the SDK's handling costs
                if isinstance(message, mcp_types.JSONRPCResponse | mcp_types.JSONRPCError):
                    waiting.discard(message.id)  # type: ignore[arg-type]
                await read_send.send(SessionMessage(message))
        fault.closed.set()

    async def to_server() -> None:
        async with write_recv:
            async for item in write_recv:
                if isinstance(item.message, mcp_types.JSONRPCRequest):
                    waiting.add(item.message.id)
                data = item.message.model_dump_json(by_alias=True, exclude_unset=True).encode() + b"\n"
                try:
                    proc.stdin.write(data)  # type: ignore[union-attr]
                    await proc.stdin.drain()  # type: ignore[union-attr]
                except (ConnectionError, OSError):
                    fault.reason = fault.reason or "closed its stdin"
                    fault.closed.set()
                    return

    async def exited() -> None:
        # a child of the server's may hold its stdout open: its exit is the end all the same
        code = await proc.wait()
        fault.reason = fault.reason or f"exited (status {code})"
        fault.closed.set()

    async def stderr_tail() -> None:
        while True:
            try:
                line = await proc.stderr.readline()  # type: ignore[union-attr]
            except ValueError:
                continue  # an over-long stderr line is dropped, the rest still read
            if not line:
                return
            text = line.decode("utf-8", "replace").strip()
            if text:
                fault.stderr = [*fault.stderr[-(STDERR_TAIL - 1):], text[:STDERR_LINE_CHARS]]

    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(from_server)
            tasks.start_soon(to_server)
            tasks.start_soon(stderr_tail)
            tasks.start_soon(exited)
            try:
                yield read_recv, write_send
            finally:
                tasks.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await _stop(proc)
            for stream in (read_send, read_recv, write_send, write_recv):
                await stream.aclose()


# the id of a JSON-RPC answer, read where it stands at the top level of its object: first (after
# "jsonrpc", as the Python SDK writes it) or last (as the TypeScript SDK does)
_ID = r'"id"\s*:\s*(-?[0-9]{1,18}|"(?:[^"\\]|\\.){0,200}")'
ANSWER_ID = re.compile(rb'^\s*\{\s*(?:"jsonrpc"\s*:\s*"2\.0"\s*,\s*)?' + _ID.encode() + rb'|' + _ID.encode() + rb'\s*\}\s*$')


def unreadable_answer(line: bytes, waiting: set[int | str], exc: ValueError) -> mcp_types.JSONRPCError | None:
    """An error answering the request a line answers, when the line is an answer the SDK cannot
    read (a lone surrogate, a 5,000-digit number, nesting too deep) to a request of ours that
    waits: the call fails at once, rather than after ``call_timeout`` with its server."""
    found = ANSWER_ID.search(line)
    if found is None:
        return None
    try:
        rid = json.loads(found.group(1) or found.group(2))
    except ValueError:
        return None
    if rid not in waiting:
        return None
    first = exc.errors()[0]["msg"] if isinstance(exc, pydantic.ValidationError) and exc.errors() else str(exc)
    why = mcp_types.ErrorData(code=mcp_types.PARSE_ERROR, message=f"{UNREADABLE} ({first[:200]})")
    return mcp_types.JSONRPCError(jsonrpc="2.0", id=rid, error=why)


PR_SET_PDEATHSIG = 1
# looked up once here, not in the forked child (no dlopen between fork and exec)
_PRCTL = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)


def _dies_with(daemon: int) -> Callable[[], None]:
    """What the child runs before the server: SIGTERM when the daemon dies, even by SIGKILL
    outside systemd, where nothing else would stop it (its wrappers' children are stopped
    with its process group by ``_stop`` only)."""

    def arrange() -> None:
        if _PRCTL is not None:
            _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != daemon:  # it died before the request was made
            os._exit(1)

    return arrange


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """Close its stdin, then SIGTERM and SIGKILL its process group, each after STOP_GRACE; then
    the rest of the group: what the server started (``npx``, ``uvx`` and shell wrappers run
    it as a child of theirs) goes with it."""
    if proc.stdin is not None:
        proc.stdin.close()
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
        try:
            await asyncio.wait_for(proc.wait(), STOP_GRACE)
            break
        except asyncio.TimeoutError:
            continue
    await _end_group(proc.pid)


async def _end_group(group: int) -> None:
    """SIGTERM, then SIGKILL after STOP_GRACE, to what is left of a process group."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            return  # nothing left
        deadline = loop.time() + STOP_GRACE
        while loop.time() < deadline:
            await asyncio.sleep(GROUP_POLL)
            try:
                os.killpg(group, 0)
            except (ProcessLookupError, PermissionError):
                return


def too_large() -> str:
    return f"sent a message over {MAX_LINE_BYTES // (1024 * 1024)} MiB"


@contextlib.asynccontextmanager
async def http_streams(spec: McpServerSpec, timeout: float) -> AsyncIterator[Streams]:
    """The SDK's streamable HTTP transport, with the configured headers, and bounded as stdio is:
    an SSE event by the SDK's own cap (set to ``MAX_LINE_BYTES``), a JSON answer, which the SDK
    reads whole, by our transport's (uncompressed, so the bound is on what is held)."""
    from mcp.client.streamable_http import streamable_http_client

    headers = {"Accept-Encoding": "identity"} | dict(spec.headers)
    transport = _BoundedTransport(httpx2.AsyncHTTPTransport())
    client = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(timeout), transport=transport)
    opened = streamable_http_client(spec.url, http_client=client, max_sse_event_size=MAX_LINE_BYTES)
    async with client, opened as (read, write):
        yield read, write


class _BoundedTransport(httpx2.AsyncBaseTransport):
    """A transport whose answers other than an event stream end with a ``StreamError`` past
    ``MAX_LINE_BYTES``: the SDK answers the call waiting for it with that error at once,
    rather than holding a body of any size."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        if not response.headers.get("content-type", "").lower().startswith("text/event-stream"):
            assert isinstance(response.stream, httpx2.AsyncByteStream)
            response.stream = _BoundedStream(response.stream)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class _BoundedStream(httpx2.AsyncByteStream):
    """A response body that fails once it passes ``MAX_LINE_BYTES``."""

    def __init__(self, inner: httpx2.AsyncByteStream) -> None:
        self._inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self._inner:
            seen += len(chunk)
            if seen > MAX_LINE_BYTES:
                raise httpx2.StreamError(too_large())
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class Connection:
    """A live session with one server: its tools, and calls to them."""

    def __init__(self, spec: McpServerSpec, session: ClientSession, tools: list[RemoteTool], fault: Fault) -> None:
        self.spec = spec
        self.session = session
        self.tools = tools
        self._fault = fault  # what the transport saw end it: a truer reason than the SDK's "closed"

    async def call(self, name: str, arguments: dict[str, Any], timeout: float) -> CallOutcome:
        """Call a tool; an error the server reports is an outcome, a dead connection raises."""
        try:
            result = await self.session.call_tool(name, arguments, read_timeout_seconds=timeout)
        except MCPError as exc:
            if _connection_lost(exc):
                raise ConnectionLost(self._fault.describe(exc.message)) from None
            return CallOutcome(text=_refusal(exc), is_error=True)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
            raise ConnectionLost(self._fault.describe(f"the connection closed ({type(exc).__name__})")) from None
        except pydantic.ValidationError as exc:  # an answer that is no tool result: the call's fault
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            return CallOutcome(text=f"the server's answer is not a tool result ({where}: {first['msg']})", is_error=True)
        except RuntimeError as exc:  # the SDK's check of a result against the tool's output schema
            return CallOutcome(text=f"the server's answer does not match its tool's schema ({exc})"[:300], is_error=True)
        return outcome(result)


def _refusal(exc: MCPError) -> str:
    """A failed call for the model: an answer refused for its size or its form says so (ours,
    or the SDK's words for an HTTP answer it could not read), else the server's own words."""
    message = exc.message[:300]
    if too_large() in message or "byte limit" in message:
        return f"the server's answer was refused: it was over the {MAX_LINE_BYTES // (1024 * 1024)} MiB a message may be"
    if exc.code == mcp_types.PARSE_ERROR and message.startswith((UNREADABLE, "Failed to parse")):
        return f"the server's answer could not be read: {message}"
    return f"the server refused the call ({message})"


def _connection_lost(exc: MCPError) -> bool:
    """Whether the SDK says the connection is gone (closed, or the call timed out) rather than
    the server refusing the call: the SDK's own errors, matched whole (a server's error may
    carry the same code, or the same words)."""
    if exc.code == mcp_types.CONNECTION_CLOSED:
        return exc.message == "Connection closed"
    if exc.code == mcp_types.REQUEST_TIMEOUT:
        return exc.message.startswith("Request ") and exc.message.endswith(" timed out")
    return False


def outcome(result: Any) -> CallOutcome:
    """A ``CallToolResult`` as text and images: text parts joined, images kept as data,
    anything else named so the model knows it was there."""
    texts: list[str] = []
    images: list[tuple[str, str]] = []
    for block in result.content:
        kind = getattr(block, "type", "")
        if kind == "text":
            texts.append(block.text)
        elif kind == "image":
            images.append((block.mime_type, block.data))
        elif kind == "resource":
            resource = block.resource
            if hasattr(resource, "text"):
                texts.append(resource.text)
            else:
                texts.append(f"[binary resource {resource.uri} ({resource.mime_type or 'unknown type'}) not shown]")
        elif kind == "resource_link":
            texts.append(f"[resource {block.uri}{': ' + block.description if block.description else ''}]")
        else:
            texts.append(f"[{kind or 'unknown'} content not shown]")
    if not texts and not images and result.structured_content is not None:
        texts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return CallOutcome(text="\n".join(texts), images=images, is_error=bool(result.is_error))


async def _list_tools(session: ClientSession) -> list[RemoteTool]:
    tools: list[RemoteTool] = []
    cursor: str | None = None
    for _ in range(MAX_TOOL_PAGES):
        params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await session.list_tools(params=params)
        known = {tool.name for tool in tools}
        for t in page.tools:
            if t.name not in known:  # a tool listed twice (or a page repeated) is offered once
                known.add(t.name)
                tools.append(RemoteTool(t.name, t.description or "", dict(t.input_schema or {}), _annotations(t)))
        cursor = page.next_cursor
        if not cursor:
            break
    return tools


def _annotations(tool: mcp_types.Tool) -> dict[str, Any]:
    """A tool's annotations as the protocol spells them (``readOnlyHint``), those it sets only."""
    if tool.annotations is None:
        return {}
    return tool.annotations.model_dump(by_alias=True, exclude_none=True, mode="json")


async def _ignore(message: Any) -> None:
    """Server notifications and transport faults: the fault is read from ``Fault``."""


async def open_connection(
    spec: McpServerSpec, start_timeout: float, call_timeout: float,
    on_ready: Callable[[Connection], Awaitable[None]], stop: asyncio.Event,
) -> str:
    """Connect, list the tools, hand the connection to ``on_ready``, and hold it until
    ``stop`` is set (returns "", also when it comes while the server starts) or the server
    goes away (returns why)."""
    fault = Fault()
    streams = bounded_stdio(spec, fault) if spec.transport == "stdio" else http_streams(spec, call_timeout)
    try:
        async with streams as (read, write), ClientSession(read, write, message_handler=_ignore) as session:
            async with anyio.create_task_group() as held:
                async def stopped() -> None:
                    await stop.wait()
                    held.cancel_scope.cancel()

                held.start_soon(stopped)  # a stop ends a start under way too: the daemon may be stopping
                with anyio.fail_after(start_timeout):
                    await session.initialize()
                    tools = await _list_tools(session)
                await on_ready(Connection(spec, session, tools, fault))
                await fault.closed.wait()
                held.cancel_scope.cancel()
            return "" if stop.is_set() else fault.describe("exited")
    except Exception as exc:  # the SDK's task groups may wrap what happened in a group
        raise ConnectionLost(_failure(_unwrap(exc), fault, start_timeout)) from None


def _unwrap(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _failure(exc: BaseException, fault: Fault, start_timeout: float) -> str:
    """Why a connection ended, for people: the server's own fault first, then the SDK's word."""
    if isinstance(exc, ConnectionLost):
        return str(exc)
    if isinstance(exc, TimeoutError):
        return fault.describe(f"did not start within {start_timeout:g} s")
    if isinstance(exc, MCPError):
        return fault.describe(f"the connection failed ({exc.message})")
    if isinstance(exc, anyio.ClosedResourceError | anyio.BrokenResourceError | anyio.EndOfStream):
        return fault.describe("closed the connection")
    return fault.describe(f"{type(exc).__name__}: {exc}")
