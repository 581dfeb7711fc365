"""Small MCP servers the tests host, run as ``python tests/mcpservers.py MODE``.

- ``good``: the SDK's ``MCPServer`` over stdio with a few tools (echo, add, a PNG image,
  a tool error, a huge result, a slow one, one that exits the process);
- ``http PORT``: the same server over streamable HTTP at ``http://127.0.0.1:PORT/mcp``;
- ``hang``: reads its stdin and never answers (not even ``initialize``);
- ``garbage``: answers every line with lines that are not JSON-RPC;
- ``flood``: answers ``initialize`` with one line of 40 MiB and no newline in sight.

Each writes a line to the file named by ``MCP_TEST_STARTS`` (when set) as it starts,
so a test can count (re)starts.
"""

# no `from __future__ import annotations`: the SDK reads the tools' annotations at run time
import os
import sys
import time


def note_start() -> None:
    path = os.environ.get("MCP_TEST_STARTS")
    if path:
        with open(path, "a") as fh:
            fh.write(f"{os.getpid()}\n")


def good() -> None:
    build_good().run("stdio")


def http() -> None:
    """The same tools over streamable HTTP on 127.0.0.1:PORT/mcp (PORT is the next argument)."""
    build_good().run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))


def build_good():  # type: ignore[no-untyped-def]
    from mcp.server.mcpserver import Image, MCPServer

    server = MCPServer("test-good")

    @server.tool(description="Echo the text back, uppercased.")
    def echo(text: str) -> str:
        return text.upper()

    @server.tool(description="Add two integers.")
    def add(a: int, b: int) -> str:
        return str(a + b)

    @server.tool(description="A small red PNG.")
    def picture() -> Image:
        import io

        from PIL import Image as Pil

        buffer = io.BytesIO()
        Pil.new("RGB", (4, 4), "red").save(buffer, "PNG")
        return Image(data=buffer.getvalue(), format="png")

    @server.tool(description="Always fails.")
    def broken() -> str:
        raise ValueError("the disk is on fire")

    @server.tool(description="A result far over any cap.")
    def huge(size: int = 500_000, char: str = "x") -> str:
        return char * size

    @server.tool(description="Takes its time.")
    def slow(seconds: float) -> str:
        time.sleep(seconds)
        return "finally"

    @server.tool(description="Exits the server's process at once.")
    def die() -> str:
        os._exit(3)

    return server


def hang() -> None:
    note_start()
    for _line in sys.stdin:
        pass
    time.sleep(3600)


def garbage() -> None:
    for _line in sys.stdin:
        for n in range(50):
            sys.stdout.write(f"this is not JSON-RPC, line {n}\n")
        sys.stdout.flush()


def flood() -> None:
    sys.stdin.readline()
    chunk = "y" * (1024 * 1024)
    for _ in range(40):
        sys.stdout.write(chunk)
    sys.stdout.flush()
    time.sleep(3600)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    note_start()
    print(f"test MCP server {sys.argv[1]} starting", file=sys.stderr, flush=True)
    {"good": good, "http": http, "hang": hang, "garbage": garbage, "flood": flood}[sys.argv[1]]()
