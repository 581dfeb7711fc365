"""Start-up stays light: the daemon imports no heavy library it may not need before it is
ready. The MCP SDK (and our host) load only when MCP servers are configured, after readiness;
Pillow only for an image. httpx, which every daemon uses, is imported with the router client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVERS = Path(__file__).resolve().parent / "mcpservers.py"


def server(mode: str) -> str:
    return f'command = {json.dumps(sys.executable)}\nargs = [{json.dumps(str(SERVERS))}, "{mode}"]\n'


HEAVY = ("PIL", "pypdf", "numpy", "simsimd", "mcp", "mcphost")


def test_the_daemon_imports_no_heavy_library_to_start() -> None:
    script = f"import sys, daemon.server; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]"]


def test_a_daemon_without_mcp_servers_never_imports_the_sdk(tmp_path: Path) -> None:
    """The daemon, serving a text turn with tools, has loaded neither ``mcp`` nor our host, nor Pillow."""
    script = textwrap.dedent("""
        import asyncio, sys
        from client import Wire
        from core import load_config
        from daemon.server import Server
        from selfcheck.fakerouter import FakeRouter

        async def main():
            with FakeRouter() as router:
                import os
                os.environ["ASSISTANT_ROUTER_URL"] = router.url
                server = Server(load_config())
                task = asyncio.create_task(server.serve())
                await server.ready.wait()
                wire = await Wire.open(server.config.socket_path, timeout=30)
                events = await wire.ask("hello")
                await wire.request({"type": "status"})
                await wire.close()
                server.request_stop()
                await task
                print(events[-1]["type"], sorted(m for m in sys.modules if m.split(".")[0] in ("mcp", "mcphost", "PIL")))

        asyncio.run(main())
    """)
    env = {**os.environ, "ASSISTANT_SOCKET": str(tmp_path / "s.sock"), "ASSISTANT_DATA_DIR": str(tmp_path / "d")}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["done", "[]"]


def test_the_sdk_loads_when_servers_are_configured(tmp_path: Path) -> None:
    """The other side of the same check: a daemon with a server does load it (after readiness)."""
    config = tmp_path / "config.toml"
    config.write_text(f"[mcp.servers.good]\n{server('good')}")
    script = textwrap.dedent("""
        import asyncio, sys
        from core import load_config
        from daemon.server import Server

        async def main():
            server = Server(load_config())
            task = asyncio.create_task(server.serve())
            await server.ready.wait()
            before = "mcp" in sys.modules
            while "mcp" not in sys.modules:
                await asyncio.sleep(0.05)
            server.request_stop()
            await task
            print(before, "mcp" in sys.modules)

        asyncio.run(main())
    """)
    env = {**os.environ, "ASSISTANT_SOCKET": str(tmp_path / "s.sock"), "ASSISTANT_DATA_DIR": str(tmp_path / "d"),
           "ASSISTANT_CONFIG": str(config), "ASSISTANT_ROUTER_URL": "http://127.0.0.1:9/v1"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]
