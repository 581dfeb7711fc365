"""Reloading the configuration (SIGHUP, ``systemctl --user reload``): new turns use the file as
it is now, a running turn finishes with what it started with, MCP servers removed or changed
are stopped once no turn may call them, and a file that cannot be used keeps the one in effect."""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path

import pytest

from core import load_config
from selfcheck.fakerouter import FakeRouter, Reply
from tests.conftest import RunningDaemon
from tests.test_lifecycle import DaemonProcess, spawned, start  # noqa: F401 - the fixture
from tests.test_mcp_host import call, hosted_config, server

pytestmark = pytest.mark.asyncio


def write(tmp_path: Path, top: str, servers: dict[str, str]) -> Path:
    path = tmp_path / "config" / "assistant" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    tables = "".join(f"[mcp.servers.{name}]\n{spec}\n" for name, spec in servers.items())
    path.write_text(f"{top}\n[mcp]\nstart_timeout = 10\ncall_timeout = 10\n{tables}")
    return path


async def until(condition: object, what: str) -> None:
    """Wait for ``condition()`` (a bound on a hang, not a timing)."""
    for _ in range(600):
        if condition():  # type: ignore[operator]
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


async def test_a_reload_is_used_by_new_turns_and_running_ones_keep_theirs(
    tmp_path: Path, router: FakeRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path, 'system_prompt = "Old."', {"good": server("good")})
    daemon = RunningDaemon(hosted_config(router, monkeypatch), load=load_config)
    await daemon.start()
    assert daemon.server is not None
    wire = await daemon.connect()
    try:
        rest = threading.Event()
        # turn 1 calls a tool of `good` after the reload: its second request is made as it began
        router.script(Reply(chunks=["looking "], tool_calls=[{"id": "c1", "name": "good__echo",
                                                               "arguments": '{"text": "hi"}'}], hold=rest),
                      Reply(text="done"))
        rid = await wire.send({"type": "ask", "text": "echo hi"})
        await wire.until_reply(rid, "looking ")
        write(tmp_path, 'system_prompt = "New."\ntemperature = 0.3', {"other": server("good")})
        assert await daemon.server.reload()
        status = await wire.request({"type": "status"})
        assert [s["name"] for s in status["mcp"]] == ["other"] and status["config_error"] is None
        good = daemon.server._retired[0]
        assert good.spec.name == "good" and good.state == "ready"  # turn 1 may still call it
        rest.set()
        events = await wire.until(rid)
        assert events[-1]["type"] == "done" and events[-1]["text"].endswith("done")
        second = router.requests[-1]
        assert second["messages"][0]["content"].startswith("Old.") and "temperature" not in second
        assert second["messages"][-1]["content"] == "HI"  # the removed server answered the running turn
        await until(lambda: good.state == "stopped", "the removed server stopped once turn 1 ended")

        router.script(call("other__echo", {"text": "yo"}), Reply(text="ok"))
        events = await wire.ask("echo yo")
        assert events[-1]["type"] == "done", events[-1]
        assert router.requests[-1]["messages"][0]["content"].startswith("New.")
        assert router.requests[-1]["temperature"] == 0.3
        assert router.requests[-1]["messages"][-1]["content"] == "YO"
        offered = [t["function"]["name"] for t in router.requests[-1]["tools"]]
        assert "other__echo" in offered and not any(name.startswith("good__") for name in offered)

        write(tmp_path, "system_prompt = 3", {})  # not text: the configuration in effect stays
        assert not await daemon.server.reload()
        status = await wire.request({"type": "status"})
        assert "system_prompt must be a str" in status["config_error"] and "fix it and reload" in status["config_error"]
        assert [s["name"] for s in status["mcp"]] == ["other"]
        await wire.ask("still new?")
        assert router.requests[-1]["messages"][0]["content"].startswith("New.")
    finally:
        await wire.close()
        await daemon.stop()


async def test_sighup_reloads_the_daemon_and_status_says_why_it_could_not(
    spawned: list[DaemonProcess], router: FakeRouter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_client import cli

    path = write(tmp_path, 'system_prompt = "First."', {})
    monkeypatch.setenv("ASSISTANT_ROUTER_URL", router.url)
    proc = await start(spawned, tmp_path)
    path.write_text("system_prompt = [")  # not TOML
    proc.proc.send_signal(signal.SIGHUP)
    assert await proc.notified("STATUS=serving; the last reload failed")
    code, out, err = await cli("status")
    assert code == 0, err
    assert "configuration NOT reloaded (the one in effect is kept): cannot read" in out
    path.write_text('system_prompt = "Second."')
    proc.proc.send_signal(signal.SIGHUP)
    assert await proc.notified("STATUS=serving on")
    code, out, err = await cli("ask", "which prompt?")
    assert code == 0, err
    assert router.requests[-1]["messages"][0]["content"].startswith("Second.")
    code, out, _ = await cli("status")
    assert "NOT reloaded" not in out
    code, log = await proc.stop()
    assert code == 0 and "configuration reloaded from" in log and "the configuration in effect is kept" in log
