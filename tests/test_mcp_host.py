"""The daemon as an MCP host, through the real socket: small MCP servers of our own
(``tests/mcpservers.py``) run as the daemon's children, the fake router scripts the
model's calls to their tools, and the daemon must contain every way a server can fail."""

from __future__ import annotations

import asyncio
import contextlib
import base64
import hashlib
import http.server
import io
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from client import Wire, of_type, reply_text
import mcphost.connection
import mcphost.host
import mcphost.tool
from mcphost.tool import McpTool
from core import Config, load_config
from core.tokens import text_weight
from daemon import server as daemon_server
from selfcheck.fakerouter import FakeModel, FakeRouter, Reply, default_models
from tests.conftest import RunningDaemon
from tests.test_client import cli

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parent.parent
SERVERS = Path(__file__).resolve().parent / "mcpservers.py"
# a start_timeout that the SDK's server meets on a slow machine (importing the SDK alone is slow)
SLOW_START = 4
QUICK_START = 2  # for servers without the SDK: a server that never answers is waited out this long
GOOD_TOOLS = ["good__add", "good__broken", "good__die", "good__echo", "good__huge", "good__picture", "good__slow"]


def server(mode: str, starts: Path | None = None) -> str:
    """A test server's table; its tools run without asking (tests/test_approval.py asks)."""
    spec = f'command = {json.dumps(sys.executable)}\nargs = [{json.dumps(str(SERVERS))}, "{mode}"]\napproval = "auto"\n'
    if starts is not None:  # the server notes each start of its process there
        spec += f"env = {{ MCP_TEST_STARTS = {json.dumps(str(starts))} }}\n"
    return spec


def write_config(tmp_path: Path, servers: dict[str, str], mcp: str = "") -> None:
    limits = "".join(f"{key} = 10\n" for key in ("start_timeout", "call_timeout") if key not in mcp)
    body = "[mcp]\n" + limits + mcp + "\n"
    body += "".join(f"[mcp.servers.{name}]\n{spec}\n" for name, spec in servers.items())
    path = tmp_path / "config" / "assistant" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)


def hosted_config(router: FakeRouter, monkeypatch: pytest.MonkeyPatch) -> Config:
    monkeypatch.setenv("ASSISTANT_ROUTER_URL", router.url)
    monkeypatch.setenv("ASSISTANT_AUTO_TITLE", "false")
    monkeypatch.setenv("ASSISTANT_SHUTDOWN_GRACE", "0.5")
    monkeypatch.setattr(mcphost.host, "BACKOFF_FIRST", 0.0)  # a failed server may be retried at once
    # the wait for a stopped server to exit before the next signal: shorter than the daemon's own,
    # as a hung test server is stopped often; the host still goes through every step
    monkeypatch.setattr(mcphost.connection, "STOP_GRACE", 0.2)
    # a request waiting on a server's start when the daemon stops (mcp_servers) is given up on
    # after this, and only then are the servers stopped
    monkeypatch.setattr(daemon_server, "REQUEST_GRACE", 0.01)
    return load_config()


@pytest.fixture
def router() -> Any:
    models = [*default_models(), FakeModel("fake-tiny", ["text"], n_ctx=1024)]
    with FakeRouter(models=models) as fake:
        yield fake


@pytest.fixture
def config(tmp_path: Path, router: FakeRouter, monkeypatch: pytest.MonkeyPatch) -> Config:
    write_config(tmp_path, {"good": server("good", tmp_path / "starts")})
    return hosted_config(router, monkeypatch)


@pytest_asyncio.fixture
async def hosting(tmp_path: Path, router: FakeRouter, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    """Start a daemon hosting the servers given: ``await hosting({"name": spec}, mcp_table)``."""
    running: list[tuple[RunningDaemon, Wire]] = []

    async def start(servers: dict[str, str], mcp: str = "") -> Wire:
        write_config(tmp_path, servers, mcp)
        daemon = RunningDaemon(hosted_config(router, monkeypatch))
        await daemon.start()
        wire = await daemon.connect()
        running.append((daemon, wire))
        return wire

    yield start
    for daemon, wire in running:
        await wire.close()
        await daemon.stop()


@pytest.fixture(scope="module")
def shared_router() -> Iterator[FakeRouter]:
    models = [*default_models(), FakeModel("fake-tiny", ["text"], n_ctx=1024)]
    with FakeRouter(models=models) as fake:
        yield fake


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared(tmp_path_factory: pytest.TempPathFactory, shared_router: FakeRouter) -> AsyncIterator[Wire]:
    """One daemon hosting ``good``, for the module's tests that only call its tools and read what
    comes back (``SHARED``): one start of the daemon and its server instead of one a test. A test
    that counts starts, breaks the server or needs its own limits has a daemon of its own."""
    home = tmp_path_factory.mktemp("shared")
    runtime = home / "run"
    runtime.mkdir(mode=0o700)
    with pytest.MonkeyPatch.context() as env:
        for var in [var for var in os.environ if var.startswith(("ASSISTANT_", "LISTEN_", "NOTIFY_SOCKET"))]:
            env.delenv(var)
        for var, value in (("XDG_RUNTIME_DIR", runtime), ("XDG_DATA_HOME", home / "data"),
                           ("XDG_CONFIG_HOME", home / "config"), ("HOME", home)):
            env.setenv(var, str(value))
        env.setenv("ASSISTANT_ROUTER_URL", shared_router.url)
        env.setenv("ASSISTANT_AUTO_TITLE", "false")
        env.setenv("ASSISTANT_SHUTDOWN_GRACE", "0.5")
        write_config(home, {"good": server("good")})
        daemon = RunningDaemon(load_config())
    await daemon.start()
    wire = await daemon.connect()
    yield wire
    await wire.close()
    await daemon.stop()


# the tests on the module's one daemon (``shared``) run on the module's event loop, as it does
SHARED = pytest.mark.asyncio(loop_scope="module")


def call(name: str, arguments: dict[str, Any], call_id: str = "call_1") -> Reply:
    return Reply(tool_calls=[{"id": call_id, "name": name, "arguments": json.dumps(arguments)}])


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The offered names of the hosted tools made (McpTool), in order."""
    names: list[str] = []
    init = McpTool.__init__

    def counted(tool: McpTool, *args: Any) -> None:
        names.append(args[2])
        init(tool, *args)

    monkeypatch.setattr(McpTool, "__init__", counted)
    return names


def tool_names(request: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in request.get("tools") or []]


def tool_messages(request: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in request["messages"] if m["role"] == "tool"]


async def server_state(wire: Wire, name: str) -> dict[str, Any]:
    status = await wire.request({"type": "status"})
    return next(s for s in status["mcp"] if s["name"] == name)


async def test_hosted_tools_are_offered_next_to_ours_sorted_and_byte_stable(
    wire: Wire, router: FakeRouter, made: list[str]
) -> None:
    cid = (await wire.ask("hello"))[0]["conversation"]
    first = router.requests[-1]["tools"]
    assert tool_names(router.requests[-1]) == ["conversation_search", "memory_save", *GOOD_TOOLS]
    echo = next(t for t in first if t["function"]["name"] == "good__echo")["function"]
    assert echo["parameters"]["properties"]["text"]["type"] == "string"
    assert "MCP server good" in echo["description"]
    await wire.ask("again", conversation=cid)
    # the tool list is rendered at the top of the prompt: the same bytes turn after turn
    assert json.dumps(router.requests[-1]["tools"]) == json.dumps(first)
    assert router.timings[-1]["cache_n"] > 0
    state = await server_state(wire, "good")
    assert state["state"] == "ready" and state["tools"] == len(GOOD_TOOLS) and state["last_error"] is None
    # made once while the server runs, not on every turn before the first token (bench/bench_mcp.py)
    assert sorted(made) == GOOD_TOOLS


@pytest.mark.parametrize("mode", ["good", "sdk"])  # the hand-written server answers as the SDK's does
async def test_a_call_comes_back_as_a_tool_message_is_stored_and_shown(
    hosting: Any, router: FakeRouter, mode: str
) -> None:
    wire = await hosting({"good": server(mode)}, "start_timeout = 60\n")  # the SDK's import, on a busy machine
    router.script(call("good__echo", {"text": "quiet words"}), Reply(text="It shouted."))
    events = await wire.ask("use echo")
    cid = events[0]["conversation"]
    [tool] = of_type(events, "tool")
    assert (tool["name"], tool["server"], tool["tool"], tool["ok"]) == ("good__echo", "good", "echo", True)
    assert tool["arguments"] == {"text": "quiet words"} and "good: echo" in tool["summary"]
    assert events[-1]["type"] == "done" and reply_text(events) == "It shouted."
    [message] = tool_messages(router.requests[-1])
    assert message["content"] == "QUIET WORDS" and set(message) == {"role", "tool_call_id", "content"}
    opened = await wire.request({"type": "open", "conversation": cid})
    [shown] = opened["turns"][0]["tools"]
    assert (shown["name"], shown["server"], shown["tool"], shown["ok"]) == ("good__echo", "good", "echo", True)
    await wire.ask("thanks", conversation=cid)
    assert [m["content"] for m in tool_messages(router.requests[-1])] == ["QUIET WORDS"]  # replayed as stored


@SHARED
async def test_our_own_tools_name_no_server(shared: Wire, shared_router: FakeRouter) -> None:
    wire, router = shared, shared_router
    router.script(call("conversation_search", {"query": "hello"}), Reply(text="ok"))
    [tool] = of_type(await wire.ask("hello"), "tool")
    assert tool["server"] is None and tool["tool"] == "conversation_search"


@SHARED
async def test_an_image_result_is_shown_to_a_vision_model_and_named_to_others(
    shared: Wire, shared_router: FakeRouter
) -> None:
    wire, router = shared, shared_router
    router.script(call("good__picture", {}), Reply(text="red"))
    events = await wire.ask("draw", model="fake-vision")
    assert of_type(events, "tool")[0]["ok"] is True
    last = router.requests[-1]["messages"][-1]
    assert last["role"] == "user" and "good__picture" in last["content"][0]["text"]
    assert last["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert "base64" not in tool_messages(router.requests[-1])[0]["content"]
    router.script(call("good__picture", {}), Reply(text="no eyes"))
    await wire.ask("draw", model="fake-text")
    assert "cannot see images" in tool_messages(router.requests[-1])[0]["content"]
    assert all(m["role"] != "user" or isinstance(m["content"], str) for m in router.requests[-1]["messages"])


@SHARED
async def test_a_tool_error_and_a_huge_result_come_back_as_results(shared: Wire, shared_router: FakeRouter) -> None:
    wire, router = shared, shared_router
    router.script(call("good__broken", {}), call("good__huge", {}, "call_2"), Reply(text="coped"))
    events = await wire.ask("try")
    broken, huge = of_type(events, "tool")
    assert broken["ok"] is False and huge["ok"] is True and events[-1]["type"] == "done"
    failed, big = tool_messages(router.requests[-1])
    assert failed["content"].startswith("Error: ") and "broken" in failed["content"]
    assert "cut here: the result had 500000 characters" in big["content"]
    assert len(big["content"]) < 20_000  # what is left of a 4,096-token context, not half a megabyte
    assert (await server_state(wire, "good"))["state"] == "ready"  # a tool's own failure is not the server's


@SHARED
async def test_a_japanese_result_is_cut_to_the_room_it_has(shared: Wire, shared_router: FakeRouter) -> None:
    wire, router = shared, shared_router
    router.script(call("good__huge", {"size": 50_000, "char": "漢"}), Reply(text="read"))  # ~100,000 tokens
    events = await wire.ask("try")
    assert events[-1]["type"] == "done", events[-1]  # the server took the round
    [big] = tool_messages(router.requests[-1])
    assert "cut here: the result had 50000 characters" in big["content"]
    assert text_weight(big["content"]) < 20_000  # what is left of a 4,096-token context, by weight


def raw(mode: str, **env: str) -> str:
    """The hand-written server of ``tests/mcpservers.py raw``, odd as ``mode`` says."""
    spec = f'command = {json.dumps(sys.executable)}\nargs = [{json.dumps(str(SERVERS))}, "raw", "{mode}"]\n'
    spec += 'approval = "auto"\n'
    if env:
        spec += "env = { " + ", ".join(f"{key} = {json.dumps(value)}" for key, value in env.items()) + " }\n"
    return spec


async def test_odd_tool_lists_are_offered_sound(hosting: Any, router: FakeRouter) -> None:
    # a schema holding NaN (the SDK reads it; no request could carry it) and a tool listed twice
    wire = await hosting({"odd": raw("nan"), "twice": raw("twice")}, f"start_timeout = {SLOW_START}\n")
    events = await wire.ask("hello")
    assert events[-1]["type"] == "done", events[-1]
    assert tool_names(router.requests[-1]) == ["conversation_search", "memory_save", "odd__echo", "odd__num",
                                                 "twice__echo"]
    num = next(t for t in router.requests[-1]["tools"] if t["function"]["name"] == "odd__num")
    assert num["function"]["parameters"] == {"properties": {}, "type": "object"}


async def test_a_servers_refusal_or_odd_answer_is_the_calls_not_the_servers(hosting: Any, router: FakeRouter) -> None:
    wire = await hosting({"closed": raw("closed"), "video": raw("video")}, f"start_timeout = {SLOW_START}\n")
    router.script(call("closed__echo", {"text": "a"}), call("video__echo", {"text": "b"}, "call_2"), Reply(text="ok"))
    events = await wire.ask("try")
    refused, odd = of_type(events, "tool")
    assert refused["ok"] is False and "the issue is closed" in refused["summary"]
    assert odd["ok"] is False and "not a tool result" in odd["summary"] and len(odd["summary"]) <= 120
    for name in ("closed", "video"):  # both servers are fine: their tools stay offered
        assert (await server_state(wire, name))["state"] == "ready"


async def test_images_of_a_tool_are_shown_as_the_context_has_room(hosting: Any, router: FakeRouter) -> None:
    wire = await hosting({"pics": raw("images")}, f"start_timeout = {SLOW_START}\n")
    router.script(call("pics__echo", {"text": "40"}), Reply(text="seen"))
    events = await wire.ask("draw", model="fake-vision")  # 8,192 tokens; 40 images would be 30,600
    assert events[-1]["type"] == "done"
    shown = [p for p in router.requests[-1]["messages"][-1]["content"] if p["type"] == "image_url"]
    assert 1 <= len(shown) < 10
    assert "no room left in the context" in tool_messages(router.requests[-1])[0]["content"]


async def test_what_a_server_started_stops_with_it(hosting: Any, router: FakeRouter, tmp_path: Path) -> None:
    children = tmp_path / "children"
    limits = f"start_timeout = {SLOW_START}\ncall_timeout = 600\n"
    wire = await hosting({"wrap": raw("child", MCP_TEST_CHILD=str(children))}, limits)
    router.script(call("wrap__echo", {"text": "die"}), Reply(text="it died"))
    # the server exits; its child holds its stdout open. The call ends at once all the same,
    # not after call_timeout (the deadline only stops a hang)
    async with asyncio.timeout(60):
        events = await wire.ask("end it")
    assert events[-1]["type"] == "done" and of_type(events, "tool")[0]["ok"] is False
    assert (await server_state(wire, "wrap"))["state"] == "failed"
    [pid] = [int(line) for line in children.read_text().split()]
    async with asyncio.timeout(30):  # the child went with its server
        while os.path.exists(f"/proc/{pid}") and "zombie" not in process_state(pid):
            await asyncio.sleep(0.05)


def process_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next((line for line in status if line.startswith("State:")), "").lower()
    except FileNotFoundError:
        return "zombie"  # gone


async def test_a_server_that_crashes_is_contained_and_restarted_on_the_next_need(
    wire: Wire, router: FakeRouter, tmp_path: Path, made: list[str]
) -> None:
    router.script(call("good__die", {}), Reply(text="it died"))
    events = await wire.ask("kill it")
    [tool] = of_type(events, "tool")
    assert tool["ok"] is False and events[-1]["type"] == "done" and reply_text(events) == "it died"
    assert "MCP server good failed" in tool_messages(router.requests[-1])[0]["content"]
    state = await server_state(wire, "good")
    assert state["state"] == "failed" and state["last_error"]
    code, out, _ = await cli("status", "--socket", wire.writer.get_extra_info("peername"))
    assert code == 0 and "mcp good: failed, 0 tool(s); last error:" in out
    router.script(call("good__add", {"a": 2, "b": 3}), Reply(text="5"))
    events = await wire.ask("add", conversation=events[0]["conversation"])
    assert of_type(events, "tool")[0]["ok"] is True
    assert tool_messages(router.requests[-1])[-1]["content"] == "5"
    assert len((tmp_path / "starts").read_text().split()) == 2
    recovered = await server_state(wire, "good")
    assert recovered["starts"] == 2 and recovered["state"] == "ready"
    assert recovered["last_error"] is None  # the failure before is not the state now
    assert sorted(made) == sorted(GOOD_TOOLS * 2)  # the restarted server's list, made anew


# The good server, but slow to go: it ignores SIGTERM and lingers after its stdin closes, so
# the host takes two STOP_GRACE to stop it and then kills it. As it starts it notes
# in the file named by its first argument whether a process noted in MCP_TEST_STARTS still runs.
STUBBORN = """
import atexit, os, runpy, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
atexit.register(time.sleep, 60)
overlap, sys.argv = sys.argv[1], sys.argv[2:]
with open(os.environ["MCP_TEST_STARTS"], "a+") as starts:
    starts.seek(0)
    for pid in starts.read().split():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            continue
        with open(overlap, "a") as fh:
            fh.write(pid + " still runs\\n")
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def stubborn_server(starts: Path, overlap: Path) -> str:
    args = ["-c", STUBBORN, str(overlap), str(SERVERS), "good"]
    return (f"command = {json.dumps(sys.executable)}\nargs = {json.dumps(args)}\n"
            f"env = {{ MCP_TEST_STARTS = {json.dumps(str(starts))} }}\napproval = \"auto\"\n")


async def test_a_restart_waits_for_the_old_process_and_keeps_the_new_connection(
    hosting: Any, router: FakeRouter, tmp_path: Path
) -> None:
    starts, overlap = tmp_path / "starts", tmp_path / "overlap"
    wire = await hosting({"good": stubborn_server(starts, overlap)}, "call_timeout = 0.5\n")
    router.script(call("good__slow", {"seconds": 30}), Reply(text="gave up"))
    cid = (await wire.ask("wait"))[0]["conversation"]
    assert (await server_state(wire, "good"))["state"] == "failed"  # hung: stopped, slowly
    first = int(starts.read_text().split()[0])
    await wire.ask("again", conversation=cid)  # at once (no back-off): a new start
    async with asyncio.timeout(60):  # until the first process is gone and its task has ended
        while _alive(first):
            await asyncio.sleep(0.05)
    await wire.request({"type": "status"})
    # the end of the first start's task did not clear the second one's connection
    await wire.ask("and again", conversation=cid)
    assert [n for n in tool_names(router.requests[-1]) if n.startswith("good__")] == GOOD_TOOLS
    state = await server_state(wire, "good")
    assert (state["state"], state["tools"], state["starts"]) == ("ready", len(GOOD_TOOLS), 2)
    assert len(starts.read_text().split()) == 2
    assert not overlap.exists()  # the second process started once the first had gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class SkewedClock:
    """The host's clock, moved on at will: its back-off passes without the test waiting it out."""

    def __init__(self) -> None:
        self.skew = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.skew


async def test_a_failed_server_is_not_restarted_before_its_back_off_has_passed(
    wire: Wire, router: FakeRouter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mcphost.host, "BACKOFF_FIRST", 60.0)
    clock = SkewedClock()
    monkeypatch.setattr(mcphost.host, "time", clock)
    router.script(call("good__die", {}), Reply(text="it died"))
    cid = (await wire.ask("kill it"))[0]["conversation"]
    state = await server_state(wire, "good")
    assert state["state"] == "failed" and 0 < state["retry_in"] <= 60
    events = await wire.ask("again", conversation=cid)  # within the back-off: not tried
    assert [n for n in tool_names(router.requests[-1]) if n.startswith("good__")] == []
    notes = [e["detail"] for e in of_type(events, "progress") if e["stage"] == "tools"]
    assert notes and "MCP server good is not available" in notes[0]
    state = await server_state(wire, "good")
    assert (state["state"], state["starts"]) == ("failed", 1) and state["retry_in"] > 0
    assert len((tmp_path / "starts").read_text().split()) == 1
    clock.skew = 60.0  # the back-off has passed
    assert (await server_state(wire, "good"))["retry_in"] == 0
    await wire.ask("and again", conversation=cid)
    assert [n for n in tool_names(router.requests[-1]) if n.startswith("good__")] == GOOD_TOOLS
    state = await server_state(wire, "good")
    assert (state["state"], state["starts"]) == ("ready", 2)
    assert len((tmp_path / "starts").read_text().split()) == 2


async def test_a_call_that_hangs_times_out_as_a_tool_error(hosting: Any, router: FakeRouter) -> None:
    wire = await hosting({"good": server("good")}, "call_timeout = 0.5\n")
    router.script(call("good__slow", {"seconds": 30}), Reply(text="gave up"))
    events = await wire.ask("wait")
    [tool] = of_type(events, "tool")
    assert tool["ok"] is False and events[-1]["type"] == "done"
    assert "did not answer within 0.5 s" in tool_messages(router.requests[-1])[0]["content"]
    assert "did not answer" in (await server_state(wire, "good"))["last_error"]


@pytest.mark.parametrize(
    "mode, spec, error",
    [
        ("hang", server("hang"), f"did not start within {QUICK_START} s"),
        ("garbage", server("garbage"), "lines that are not JSON-RPC"),
        ("flood", server("flood"), "a message over 16 MiB"),
        ("missing", 'command = "/nonexistent/mcp-server"\n', "no such program"),
        ("nowhere", server("good") + 'cwd = "/nonexistent/folder"\n', "(cwd) /nonexistent/folder does not exist"),
    ],
)
async def test_a_broken_server_never_fails_the_turn(
    hosting: Any, router: FakeRouter, mode: str, spec: str, error: str
) -> None:
    wire = await hosting({"good": server("good"), mode: spec}, f"start_timeout = {QUICK_START}\n")
    events = await wire.ask("hello")
    assert events[-1]["type"] == "done"
    assert tool_names(router.requests[-1]) == ["conversation_search", "memory_save", *GOOD_TOOLS]
    notes = [e["detail"] for e in of_type(events, "progress") if e["stage"] == "tools"]
    assert notes and f"MCP server {mode} is not available" in notes[0] and error in notes[0]
    state = await server_state(wire, mode)
    assert state["state"] == "failed" and error in state["last_error"]
    assert (await server_state(wire, "good"))["state"] == "ready"


async def test_a_starting_server_does_not_block_the_daemon(hosting: Any, router: FakeRouter) -> None:
    wire = await hosting({"hang": server("hang")}, "start_timeout = 1\n")
    asked = await wire.send({"type": "ask", "text": "hello"})
    status = await wire.send({"type": "status"})
    order: list[str] = []
    while len(order) < 2:
        event = await wire.read()
        if event.get("id") == status:
            order.append("status")
            assert next(s for s in event["mcp"] if s["name"] == "hang")["state"] in ("idle", "starting")
        elif event.get("id") == asked and event["type"] in ("done", "error"):
            order.append(event["type"])
    assert order == ["status", "done"]


async def test_each_conversation_uses_the_servers_its_settings_name(hosting: Any, router: FakeRouter) -> None:
    wire = await hosting({"good": server("good"), "other": server("good")}, 'default = ["other"]\n')
    cid = (await wire.ask("hello"))[0]["conversation"]
    assert [n for n in tool_names(router.requests[-1]) if n.startswith("good__")] == []
    assert "other__echo" in tool_names(router.requests[-1])
    answer = await wire.request({"type": "settings", "conversation": cid, "mcp_servers": ["good"]})
    assert answer["settings"]["mcp_servers"] == ["good"]
    await wire.ask("again", conversation=cid)
    assert tool_names(router.requests[-1]) == ["conversation_search", "memory_save", *GOOD_TOOLS]
    await wire.request({"type": "settings", "conversation": cid, "mcp_servers": []})
    await wire.ask("none", conversation=cid)
    assert tool_names(router.requests[-1]) == ["conversation_search", "memory_save"]
    await wire.request({"type": "settings", "conversation": cid, "mcp_servers": None})  # back to the default
    await wire.ask("default", conversation=cid)
    assert "other__echo" in tool_names(router.requests[-1]) and "good__echo" not in tool_names(router.requests[-1])
    refused = await wire.request({"type": "settings", "conversation": cid, "mcp_servers": ["nope"]})
    assert refused["type"] == "error" and refused["code"] == "not_found" and "good, other" in refused["message"]


async def test_fewer_tools_are_offered_when_they_would_take_too_much_context(
    hosting: Any, router: FakeRouter
) -> None:
    wire = await hosting({"good": server("good")}, "tools_share = 0.2\n")
    # 1,024 tokens: 204 for MCP tools, and none of the daemon's own (docs/DESIGN.md, "MCP")
    events = await wire.ask("hello", model="fake-tiny")
    offered = tool_names(router.requests[-1])
    assert 0 < len(offered) < len(GOOD_TOOLS)
    assert offered == GOOD_TOOLS[: len(offered)]  # a prefix of the sorted list: stable
    [note] = [e["detail"] for e in of_type(events, "progress") if e["stage"] == "tools"]
    assert f"offering {len(offered)} of {len(GOOD_TOOLS)} MCP tools" in note
    await wire.ask("again", conversation=events[0]["conversation"], model="fake-tiny")
    assert tool_names(router.requests[-1]) == offered


async def test_tool_schemas_count_in_the_prompt_estimate(hosting: Any, router: FakeRouter) -> None:
    wire = await hosting({"good": server("good")}, "default = []\n")
    used, sent = [], []
    for servers in (["good"], []):
        cid = (await wire.ask("hello"))[0]["conversation"]
        await wire.request({"type": "settings", "conversation": cid, "mcp_servers": servers})
        router.script(Reply(text="the same answer", usage=None))  # no usage: ctx_used is our estimate
        events = await wire.ask("hello again", conversation=cid)
        used.append(events[-1]["ctx_used"])
        sent.append(router.requests[-1])
    hosted, bare = used
    definitions = [t for t in sent[0]["tools"] if t["function"]["name"].startswith("good__")]
    assert len(definitions) == len(GOOD_TOOLS)
    assert hosted - bare >= len(json.dumps(definitions)) // 5  # about a token for 4 characters


async def test_mcp_servers_lists_every_server_and_its_tools(hosting: Any, router: FakeRouter) -> None:
    asking = server("good").replace('approval = "auto"\n', "")  # its tools not marked read-only ask first
    wire = await hosting({"good": server("good"), "missing": 'command = "/nonexistent/x"\n', "asking": asking})
    answer = await wire.request({"type": "mcp_servers"})
    servers = {entry["name"]: entry for entry in answer["servers"]}
    good, missing, asked = servers["good"], servers["missing"], servers["asking"]
    assert not any(t["asks"] for t in good["tools"])  # approval = "auto"
    assert [t["name"] for t in asked["tools"] if not t["asks"]] == ["add", "echo"]  # the read-only ones
    assert good["name"] == "good" and good["state"] == "ready" and good["transport"] == "stdio"
    assert [t["offered_as"] for t in good["tools"]] == GOOD_TOOLS
    assert next(t for t in good["tools"] if t["name"] == "add")["description"] == "Add two integers."
    assert missing["state"] == "failed" and "no such program" in missing["last_error"] and missing["tools"] == []


async def test_without_mcp_servers_status_lists_none(tmp_path: Path, router: FakeRouter, monkeypatch: Any) -> None:
    monkeypatch.setenv("ASSISTANT_ROUTER_URL", router.url)
    daemon = RunningDaemon(load_config())
    await daemon.start()
    wire = await daemon.connect()
    try:
        assert (await wire.request({"type": "status"}))["mcp"] == []
        assert (await wire.request({"type": "mcp_servers"}))["servers"] == []
    finally:
        await wire.close()
        await daemon.stop()


# A server whose tool description would clear the screen, and one whose stderr is in colour
# (and which never answers, so that its stderr ends up in its last error).
NASTY = """
import json, sys
tool = {"name": "paint", "description": "Clears \\x1b[2Jthe screen and \\x9b31mpaints", "inputSchema": {"type": "object"}}
for line in sys.stdin:
    request = json.loads(line)
    if "id" in request:
        result = {"tools": [tool]} if request["method"] == "tools/list" else {
            "protocolVersion": request["params"].get("protocolVersion"), "capabilities": {"tools": {}},
            "serverInfo": {"name": "nasty", "version": "1"}}
        print(json.dumps({"jsonrpc": "2.0", "id": request["id"], "result": result}), flush=True)
"""
LOUD = 'import sys; sys.stderr.write("\\x1b[31mred alert\\x1b[0m\\n"); sys.exit(1)'


def python_server(code: str) -> str:
    return f"command = {json.dumps(sys.executable)}\nargs = {json.dumps(['-c', code])}\n"


async def mcp_list(*args: str) -> tuple[int, str, str]:
    # the daemon runs in this loop: the client must run beside it, not block it
    child = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "assistant.py"), "mcp", "list", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(child.communicate(), 60)
    return child.returncode or 0, out.decode(), err.decode()


async def test_mcp_list_shows_a_servers_control_characters_never_obeys_them(
    hosting: Any, router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    await hosting({"nasty": python_server(NASTY), "loud": python_server(LOUD)}, f"start_timeout = {QUICK_START}\n")
    # the second listing shows the failure the first met, not a new start waited out again
    monkeypatch.setattr(mcphost.host, "BACKOFF_FIRST", 60.0)
    code, out, err = await mcp_list()
    assert code == 0, err
    assert "\x1b" not in out and "\x9b" not in out
    assert "nasty__paint" in out and "Clears \\x1b[2Jthe screen and \\x9b31mpaints" in out
    [loud] = [line for line in out.splitlines() if line.startswith("loud")]
    assert "failed" in loud and "\\x1b[31mred alert\\x1b[0m" in loud
    code, out, err = await mcp_list("--json")
    assert code == 0, err
    assert "\x1b" not in out and "\x9b" not in out and len(out.splitlines()) == 1
    servers = {server["name"]: server for server in json.loads(out)["servers"]}
    assert servers["nasty"]["tools"][0]["description"] == "Clears \x1b[2Jthe screen and \x9b31mpaints"
    assert "\x1b[31mred alert\x1b[0m" in servers["loud"]["last_error"]
    # doctor tells each server on a line of its own, with its fix
    child = await asyncio.create_subprocess_exec(sys.executable, str(ROOT / "assistant.py"), "doctor",
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out_b, _ = await asyncio.wait_for(child.communicate(), 60)
    lines = {line[6:20].strip(): line for line in out_b.decode().splitlines()}
    assert child.returncode == 1 and lines["mcp nasty"].startswith("ok") and "1 tool(s)" in lines["mcp nasty"]
    assert lines["mcp loud"].startswith("FAIL") and "fix [mcp.servers.loud] in config.toml" in lines["mcp loud"]


async def test_ctrl_c_stops_mcp_list_with_130(hosting: Any, router: FakeRouter) -> None:
    wire = await hosting({"hang": server("hang")}, "start_timeout = 30\n")
    child = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "assistant.py"), "mcp", "list",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):  # until its request is in: the daemon starts the server for it
        while (await server_state(wire, "hang"))["state"] != "starting":
            await asyncio.sleep(0.05)
    child.send_signal(signal.SIGINT)
    out, err = await asyncio.wait_for(child.communicate(), 60)
    assert child.returncode == 130 and out == b""
    assert err.decode() == "[stopped]\n"


@pytest.mark.parametrize("stop_wait", [600.0, 0.0])
async def test_a_server_still_starting_stops_with_the_daemon(
    tmp_path: Path, router: FakeRouter, monkeypatch: pytest.MonkeyPatch, stop_wait: float
) -> None:
    """Stopping the daemon ends a server's start at once and stops its process: the daemon
    neither waits out a start that would take 10 minutes nor leaves the process behind, even
    when it gives up waiting (0) and cancels what holds the server."""
    monkeypatch.setattr(mcphost.host, "STOP_WAIT", stop_wait)
    starts = tmp_path / "starts"
    write_config(tmp_path, {"hang": server("hang", starts)}, "start_timeout = 600\n")
    daemon = RunningDaemon(hosted_config(router, monkeypatch))
    await daemon.start()
    wire = await daemon.connect()
    try:
        async with asyncio.timeout(60):
            await wire.send({"type": "mcp_servers"})  # starts the server; the answer waits for it
            while not starts.exists() or not starts.read_text().strip():
                await asyncio.sleep(0.05)
            assert (await server_state(wire, "hang"))["state"] == "starting"
            await daemon.stop()
    finally:
        await wire.close()
        await daemon.stop()
    pid = int(starts.read_text().split()[0])
    with pytest.raises(ProcessLookupError):  # gone, and reaped
        os.kill(pid, 0)


async def test_mcp_list_shows_servers_and_their_tools(hosting: Any, router: FakeRouter) -> None:
    await hosting({"good": server("good"), "missing": 'command = "/nonexistent/x"\n'})
    code, out, err = await mcp_list()
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("good  stdio  ready")
    assert [line.split()[0] for line in lines[1:8]] == GOOD_TOOLS
    assert "Add two integers." in lines[1]
    assert lines[8].startswith("missing  stdio  failed") and "no such program" in lines[8]


async def test_a_streamable_http_server_is_hosted_too(hosting: Any, router: FakeRouter) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    child = await asyncio.create_subprocess_exec(
        sys.executable, str(SERVERS), "http", str(port), stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        while True:  # until it listens (the test's own timeout bounds a server that never does)
            try:
                _reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        spec = f'url = "http://127.0.0.1:{port}/mcp"\nheaders = {{ X-Test = "yes" }}\n'
        wire = await hosting({"web": spec})
        router.script(call("web__add", {"a": 20, "b": 22}), Reply(text="42"))
        events = await wire.ask("add over http")
        [tool] = of_type(events, "tool")
        assert (tool["server"], tool["tool"], tool["ok"]) == ("web", "add", True)
        assert tool_messages(router.requests[-1])[0]["content"] == "42"
        state = await server_state(wire, "web")
        assert state["transport"] == "http" and state["state"] == "ready"
    finally:
        child.kill()
        await child.wait()


async def test_a_cancel_during_a_hosted_call_stops_the_turn_and_keeps_the_server(
    wire: Wire, router: FakeRouter
) -> None:
    router.script(call("good__slow", {"seconds": 30}))  # the turn is cancelled before it answers
    asked = await wire.send({"type": "ask", "text": "wait for it"})
    async for event in wire.stream(asked):
        if event["type"] == "progress" and event["stage"] == "tool":
            break
    cid = event["conversation"]
    await wire.send({"type": "cancel", "conversation": cid})
    ended = (await wire.until(asked))[-1]
    assert ended["type"] == "done" and ended["finish_reason"] == "cancelled"
    router.script(call("good__echo", {"text": "still here"}), Reply(text="ok"))
    events = await wire.ask("echo", conversation=cid)
    assert of_type(events, "tool")[0]["ok"] is True
    assert tool_messages(router.requests[-1])[-1]["content"] == "STILL HERE"


async def test_a_server_that_lies_is_answered_at_once_and_its_fault_named(hosting: Any, router: FakeRouter) -> None:
    """Answers the SDK cannot read fail their call at once (not after call_timeout, with a
    healthy server killed); images go through the attachments' pipeline; offered names are
    unique though a tool is named as another's hashed name; and a server that then writes
    garbage is failed with that reason, not the SDK's "Connection closed"."""
    wire = await hosting({"odd": raw("odd")}, f"start_timeout = {SLOW_START}\ncall_timeout = 600\n")
    offered = mcphost.tool.offered_names("odd", ["echo", "a.b", "a_b", "a_b_" + hashlib.sha256(b"a.b").hexdigest()[:6]])
    assert len(set(offered.values())) == 4
    shadow = "a_b_" + hashlib.sha256(b"a.b").hexdigest()[:6]

    def calls(kinds: list[str]) -> Reply:
        return Reply(tool_calls=[{"id": kind, "name": "odd__echo", "arguments": json.dumps({"text": kind})}
                                 for kind in kinds])

    named = Reply(tool_calls=[{"id": f"t{n}", "name": offered[name], "arguments": "{}"}
                              for n, name in enumerate(["a.b", "a_b", shadow])])
    router.script(calls(["surrogate", "digits", "deep"]), named, calls(["svg", "notb64", "bomb", "wide"]),
                  Reply(text="coped"))
    async with asyncio.timeout(60):  # only a hang: each unreadable answer must not wait 600 s
        events = await wire.ask("try them all", model="fake-vision")
    assert events[-1]["type"] == "done"
    request = router.requests[-1]
    ours = ["conversation_search", "memory_save"]
    assert sorted(n for n in tool_names(request) if n not in ours) == sorted(offered.values())
    results = [m["content"] for m in tool_messages(request)]
    for text in results[:3]:
        assert "answer could not be read" in text and "Invalid JSON" in text
    assert results[3:6] == ["called a.b", "called a_b", f"called {shadow}"]
    assert "not a PNG, JPEG, WebP or GIF" in results[6] and "not base64" in results[7]
    assert "30000 x 30000" in results[8] or "far too many pixels" in results[8]
    shown = [p for p in request["messages"][-1]["content"] if p["type"] == "image_url"]
    assert len(shown) == 1  # the wide one, scaled to 2048 px as an attached image is
    from PIL import Image

    wide = Image.open(io.BytesIO(base64.b64decode(shown[0]["image_url"]["url"].partition(",")[2])))
    assert wide.size == (2048, 68)
    assert (await server_state(wire, "odd"))["state"] == "ready"
    router.script(call("odd__echo", {"text": "garbage"}), Reply(text="gone"))
    async with asyncio.timeout(60):
        await wire.ask("and now")
    state = await server_state(wire, "odd")
    assert state["state"] == "failed" and "lines that are not JSON-RPC" in state["last_error"], state


async def test_a_call_cut_by_the_servers_fault_names_the_fault() -> None:
    """The SDK's "Connection closed" reaches a waiting call as the transport ends; what ended
    it (garbage, a line over the cap) is what `mcp list` must show."""
    from mcp.shared.exceptions import MCPError

    class Closed:
        async def call_tool(self, *args: Any, **kwargs: Any) -> Any:
            raise MCPError(mcphost.connection.mcp_types.CONNECTION_CLOSED, "Connection closed")

    fault = mcphost.connection.Fault(reason="wrote 20 lines that are not JSON-RPC on stdout")
    connection = mcphost.connection.Connection(None, Closed(), [], fault)  # type: ignore[arg-type]
    with pytest.raises(mcphost.connection.ConnectionLost, match="wrote 20 lines that are not JSON-RPC"):
        await connection.call("echo", {}, 1.0)


class _LyingHttp(http.server.BaseHTTPRequestHandler):
    """A streamable HTTP MCP server whose tools answer past the cap: ``json`` as one
    application/json body, ``sse`` as one event of an event stream."""

    SIZE = 3 << 20

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - no stream of the server's own
        self.send_response(405)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_DELETE(self) -> None:  # noqa: N802
        self.do_GET()

    def do_POST(self) -> None:  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "id" not in request:
            self.send_response(202)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        method, rid = request["method"], request["id"]
        result: dict[str, Any] = {}
        if method == "initialize":
            result = {"protocolVersion": request["params"]["protocolVersion"], "capabilities": {"tools": {}},
                      "serverInfo": {"name": "liar", "version": "1"}}
        elif method == "tools/list":
            result = {"tools": [{"name": name, "inputSchema": {"type": "object"}} for name in ("json", "sse")]}
        elif method == "tools/call":
            result = {"content": [{"type": "text", "text": "x" * self.SIZE}]}
        body = json.dumps({"jsonrpc": "2.0", "id": rid, "result": result}).encode()
        streamed = method == "tools/call" and request["params"]["name"] == "sse"
        if streamed:
            body = b"event: message\ndata: " + body + b"\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream" if streamed else "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


async def test_an_http_server_answering_past_the_cap_is_refused_for_size(
    hosting: Any, router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK reads a JSON answer whole (400 MB: +2 GB): both kinds of answer are held to
    the stdio transport's cap, and the model is told the answer was refused for its size."""
    monkeypatch.setattr(mcphost.connection, "MAX_LINE_BYTES", 1 << 20)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _LyingHttp)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        wire = await hosting({"liar": f'url = "http://127.0.0.1:{server.server_address[1]}/mcp"\napproval = "auto"\n'})
        router.script(Reply(tool_calls=[{"id": kind, "name": f"liar__{kind}", "arguments": "{}"}
                                        for kind in ("json", "sse")]), Reply(text="too big"))
        async with asyncio.timeout(60):
            events = await wire.ask("fetch it")
        assert events[-1]["type"] == "done"
        for tool in of_type(events, "tool"):
            assert tool["ok"] is False
        for message in tool_messages(router.requests[-1]):
            assert "refused: it was over the 1 MiB a message may be" in message["content"], message
    finally:
        server.shutdown()
        server.server_close()


async def test_a_server_goes_when_its_daemon_is_killed(
    router: FakeRouter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside systemd nothing stopped a server whose daemon died by SIGKILL: one that does not
    watch its stdin lived on."""
    from tests.test_lifecycle import DaemonProcess

    starts = tmp_path / "starts"
    write_config(tmp_path, {"deaf": server("hang", starts)}, "start_timeout = 60\n")
    config = hosted_config(router, monkeypatch)
    daemon = await DaemonProcess.spawn(tmp_path)
    pid = None
    try:
        assert await daemon.notified()
        wire = await Wire.open(config.socket_path, timeout=30)
        await wire.send({"type": "mcp_servers"})  # starts it; it never answers
        async with asyncio.timeout(30):
            while not starts.exists() or not starts.read_text().strip():
                await asyncio.sleep(0.05)
        [pid] = {int(line) for line in starts.read_text().split()}  # it notes its start twice
        await wire.close()
        daemon.proc.kill()
        async with asyncio.timeout(30):  # a hang guard only: the kernel signals it as the daemon dies
            while os.path.exists(f"/proc/{pid}") and "zombie" not in process_state(pid):
                await asyncio.sleep(0.05)
    finally:
        if pid is not None:  # one left behind holds the daemon's output open
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            daemon.proc.kill()
        await daemon.proc.communicate()
        daemon.notify.close()


async def test_the_readmes_example_server_reads_without_asking_and_asks_to_act(
    hosting: Any, router: FakeRouter, tmp_path: Path
) -> None:
    example = ROOT / "docs" / "examples" / "notes_server.py"
    spec = f'command = {json.dumps(sys.executable)}\nargs = [{json.dumps(str(example))}]\nenv = {{ HOME = {json.dumps(str(tmp_path))} }}\n'
    wire = await hosting({"notes": spec})
    [notes] = (await wire.request({"type": "mcp_servers"}))["servers"]
    assert notes["state"] == "ready", notes
    assert {t["offered_as"]: t["asks"] for t in notes["tools"]} == {"notes__add_note": True, "notes__read_notes": False}
    (tmp_path / "notes.txt").write_text("buy milk\n")
    router.script(call("notes__read_notes", {}), Reply(text="milk"))
    events = await wire.ask("what is on my list?")
    assert of_type(events, "tool")[0]["ok"] is True
    assert tool_messages(router.requests[-1])[0]["content"] == "buy milk\n"


async def test_an_mcp_call_written_as_bare_json_runs_as_a_call(hosting: Any, router: FakeRouter) -> None:
    """Issue 49: a small model writes an MCP call as its reply's text (llama-server leaves an
    unfenced call as content); it runs as the call it is, ``from_text``, and its result goes back."""
    wire = await hosting({"good": server("good")})
    router.script(Reply(text=json.dumps({"name": "good__add", "arguments": {"a": 2, "b": 40}})), Reply(text="42"))
    events = await wire.ask("add 2 and 40 with the tool")
    assert events[-1]["type"] == "done" and reply_text(events) == json.dumps(
        {"name": "good__add", "arguments": {"a": 2, "b": 40}}) + "42"  # the client saw the text as it came
    [tool] = of_type(events, "tool")
    assert tool["name"] == "good__add" and tool["ok"] is True and tool["from_text"] is True, tool
    assert tool_messages(router.requests[-1])[0]["content"] == "42"
    opened = await wire.request({"type": "open", "conversation": events[-1]["conversation"]})
    assert opened["turns"][0]["reply"] == "42"  # what is kept is the answer, not the call's text
    # a server this conversation does not use: its tool is not offered, nothing runs, and the
    # model is told so (it answers without it)
    await wire.request({"type": "settings", "conversation": events[-1]["conversation"], "mcp_servers": []})
    router.script(Reply(text=json.dumps({"name": "good__add", "arguments": {"a": 1, "b": 1}})), Reply(text="2"))
    events = await wire.ask("again", conversation=events[-1]["conversation"])
    assert events[-1]["type"] == "done" and events[-1]["text"] == "2"
    assert [t["ok"] for t in of_type(events, "tool")] == [False]
    assert "there is no tool named 'good__add'" in tool_messages(router.requests[-1])[-1]["content"]
