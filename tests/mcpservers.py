"""Small MCP servers the tests host, run as ``python tests/mcpservers.py MODE``.

- ``sdk``: the SDK's ``MCPServer`` over stdio with a few tools (echo, add, a PNG image,
  a tool error, a huge result, a slow one, one that exits the process; echo and add are
  annotated read-only);
- ``good``: the same tools, answered as ``sdk`` answers them, by hand: the SDK's import
  alone takes over a second, paid at every start of a test's server (most tests host
  this one; a few host ``sdk`` and ``http``, so the SDK's own server is tested too);
- ``http PORT``: the SDK's server over streamable HTTP at ``http://127.0.0.1:PORT/mcp``;
- ``hang``: reads its stdin and never answers (not even ``initialize``);
- ``garbage``: answers every line with lines that are not JSON-RPC;
- ``flood``: answers ``initialize`` with one line of 40 MiB and no newline in sight;
- ``raw MODE``: a hand-written JSON-RPC server with one tool, ``echo``, odd as MODE says:
  ``nan`` (a second tool's schema holds NaN), ``twice`` (it lists its tools twice),
  ``closed`` (refuses every call with an error whose words say "closed"), ``video``
  (answers with a content block of no known type), ``images`` (answers with as many
  PNGs as ``text`` says), ``child`` (starts a child that outlives it, its pid written to
  the file ``MCP_TEST_CHILD`` names, and exits when ``echo`` gets "die"), ``acting`` (a tool
  that acts, ``write_note``, appending its ``text`` to the file ``MCP_TEST_NOTES`` names, and
  one its annotations call read-only, ``read_notes``, reading that file back: no SDK, so it
  starts in a moment), ``odd`` (tools
  ``a.b``, ``a_b`` and one named as ``a.b``'s hashed name; each answers with its name, and
  ``echo`` answers as its text says: ``surrogate``, ``digits`` or ``deep``, a reply the SDK
  cannot read; ``svg``, ``notb64``, ``bomb`` or ``wide``, an image of that sort;
  ``garbage``, 30 lines that are not JSON-RPC).

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


def sdk() -> None:
    build_good().run("stdio")


def http() -> None:
    """The same tools over streamable HTTP on 127.0.0.1:PORT/mcp (PORT is the next argument)."""
    build_good().run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))


def build_good():  # type: ignore[no-untyped-def]
    from mcp.server.mcpserver import Image, MCPServer
    from mcp.types import ToolAnnotations

    server = MCPServer("test-good")
    computes = ToolAnnotations(readOnlyHint=True)  # runs without asking (the others may act)

    @server.tool(description="Echo the text back, uppercased.", annotations=computes)
    def echo(text: str) -> str:
        return text.upper()

    @server.tool(description="Add two integers.", annotations=computes)
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


def _schema(tool: str, properties: dict, required: list, output: bool = True) -> dict:  # type: ignore[type-arg]
    """A tool's listing as the SDK makes it from the function's signature (pydantic's titles)."""
    inputs = {"properties": {name: {"title": name.capitalize(), **spec} for name, spec in properties.items()},
              **({"required": required} if required else {}), "type": "object", "title": f"{tool}Arguments"}
    listing = {"inputSchema": inputs, "name": tool}
    if output:
        listing["outputSchema"] = {"properties": {"result": {"title": "Result", "type": "string"}},
                                   "required": ["result"], "type": "object", "title": f"{tool}Output"}
    return listing


GOOD_TOOLS = [
    {"description": "Echo the text back, uppercased.", **_schema("echo", {"text": {"type": "string"}}, ["text"]),
     "annotations": {"readOnlyHint": True}},
    {"description": "Add two integers.", **_schema("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"]),
     "annotations": {"readOnlyHint": True}},
    {"description": "A small red PNG.", **_schema("picture", {}, [], output=False)},
    {"description": "Always fails.", **_schema("broken", {}, [])},
    {"description": "A result far over any cap.",
     **_schema("huge", {"size": {"default": 500000, "type": "integer"}, "char": {"default": "x", "type": "string"}}, [])},
    {"description": "Takes its time.", **_schema("slow", {"seconds": {"type": "number"}}, ["seconds"])},
    {"description": "Exits the server's process at once.", **_schema("die", {}, [])},
]


def good() -> None:
    """``sdk``'s tools without the SDK: JSON-RPC lines on stdio, each call in a thread of its own
    (as the SDK runs each request in a task), answered as the SDK answers."""
    import json
    import threading

    lock = threading.Lock()

    def send(message: dict) -> None:  # type: ignore[type-arg]
        line = json.dumps({"jsonrpc": "2.0", **message}) + "\n"
        with lock:
            sys.stdout.write(line)
            sys.stdout.flush()

    def call(rid: object, name: str, arguments: dict) -> None:  # type: ignore[type-arg]
        try:
            text = good_call(name, arguments)
        except Exception as exc:  # the SDK's words for any failure of a tool
            detail = f": {exc}" if isinstance(exc, (KeyError, TypeError, ValueError)) else ""
            send({"id": rid, "result": {"content": [{"type": "text", "text": f"Error executing tool {name}{detail}"}],
                                        "isError": True}})
            return
        if name == "picture":
            send({"id": rid, "result": {"content": [{"data": text, "mimeType": "image/png", "type": "image"}],
                                        "isError": False}})
        else:
            send({"id": rid, "result": {"content": [{"text": text, "type": "text"}], "isError": False,
                                        "structuredContent": {"result": text}}})

    for line in sys.stdin:
        request = json.loads(line)
        method, rid, params = request.get("method"), request.get("id"), request.get("params") or {}
        if rid is None:
            continue  # a notification
        if method == "initialize":
            send({"id": rid, "result": {"capabilities": {"tools": {"listChanged": False}},
                                        "protocolVersion": params["protocolVersion"],
                                        "serverInfo": {"name": "test-good", "version": ""}}})
        elif method == "tools/list":
            send({"id": rid, "result": {"tools": GOOD_TOOLS}})
        elif method == "tools/call":
            threading.Thread(target=call, args=(rid, params["name"], params.get("arguments") or {}), daemon=True).start()
        else:
            send({"id": rid, "result": {}})


def good_call(name: str, arguments: dict) -> str:  # type: ignore[type-arg]
    """What ``sdk``'s tool ``name`` returns (base64 for the picture)."""
    if name == "echo":
        return str(arguments["text"]).upper()
    if name == "add":
        return str(int(arguments["a"]) + int(arguments["b"]))
    if name == "picture":
        import base64
        import io

        from PIL import Image as Pil

        buffer = io.BytesIO()
        Pil.new("RGB", (4, 4), "red").save(buffer, "PNG")
        return base64.b64encode(buffer.getvalue()).decode()
    if name == "broken":
        raise RuntimeError("the disk is on fire")
    if name == "huge":
        return str(arguments.get("char", "x")) * int(arguments.get("size", 500_000))
    if name == "slow":
        time.sleep(float(arguments["seconds"]))
        return "finally"
    if name == "die":
        os._exit(3)
    raise ValueError(f"Unknown tool: {name}")


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


def notes(params: dict) -> str:  # type: ignore[type-arg]
    """``acting``'s tools: ``write_note`` appends a line to the notes file, ``read_notes`` reads it."""
    path = os.environ["MCP_TEST_NOTES"]
    if params["name"] == "write_note":
        with open(path, "a") as fh:
            fh.write(params["arguments"]["text"] + "\n")
        return "written"
    try:
        with open(path) as fh:
            return fh.read() or "(no notes)"
    except FileNotFoundError:
        return "(no notes)"


def raw() -> None:
    import base64
    import io
    import json
    import subprocess

    mode = sys.argv[2]
    tools = [{"name": "echo", "description": "Echo.",
              "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}}}]
    if mode == "nan":
        tools.append({"name": "num", "description": "Has NaN.",
                      "inputSchema": {"type": "object", "properties": {"x": {"type": "number", "default": float("nan")}}}})
    if mode == "twice":
        tools = tools * 2
    if mode == "acting":
        text_only = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
        tools = [{"name": "write_note", "description": "Append a line to the notes.", "inputSchema": text_only,
                  "annotations": {"destructiveHint": False}},
                 {"name": "read_notes", "description": "Read the notes.", "inputSchema": {"type": "object"},
                  "annotations": {"readOnlyHint": True, "title": "Read notes"}}]
    if mode == "odd":  # the third is named as the first's offered name would be, hashed
        import hashlib

        shadow = "a_b_" + hashlib.sha256(b"a.b").hexdigest()[:6]
        tools += [{"name": name, "description": name, "inputSchema": {"type": "object"}}
                  for name in ("a.b", "a_b", shadow)]
    if mode == "child":  # as npx, uvx or a shell wrapper leave one: it holds stdout open too
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        with open(os.environ["MCP_TEST_CHILD"], "a") as fh:
            fh.write(f"{child.pid}\n")

    def send(message: dict) -> None:  # type: ignore[type-arg]
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", **message}) + "\n")
        sys.stdout.flush()

    def png(side: int, height: int = 0) -> str:
        from PIL import Image

        buffer = io.BytesIO()
        Image.new("RGB", (side, height or side), "red").save(buffer, "PNG")
        return base64.b64encode(buffer.getvalue()).decode()

    def bomb() -> str:  # a PNG header claiming 30,000 x 30,000 pixels, and nothing more
        import struct
        import zlib

        def chunk(kind: bytes, body: bytes) -> bytes:
            return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

        header = struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)
        rows = zlib.compress(b"\0" * 1000)
        png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")
        return base64.b64encode(png).decode()

    def odd(rid: int, name: str, text: str) -> None:
        if name != "echo":
            send({"id": rid, "result": {"content": [{"type": "text", "text": f"called {name}"}]}})
        elif text in ("surrogate", "digits", "deep"):
            body = {"surrogate": '"\\ud800"', "digits": "9" * 5000, "deep": "[" * 3000 + "]" * 3000}[text]
            sys.stdout.write(f'{{"jsonrpc":"2.0","id":{rid},"result":{{"content":[],"x":{body}}}}}\n')
            sys.stdout.flush()
        elif text == "garbage":
            sys.stdout.write("not JSON-RPC at all\n" * 30)
            sys.stdout.flush()
        else:
            data = {"svg": base64.b64encode(b"<svg xmlns='http://www.w3.org/2000/svg'/>").decode(),
                    "notb64": "@@ not base64 @@", "bomb": bomb(), "wide": png(3000, 100)}[text]
            send({"id": rid, "result": {"content": [{"type": "image", "mimeType": "image/png", "data": data}]}})

    for line in sys.stdin:
        request = json.loads(line)
        method, rid = request.get("method"), request.get("id")
        if rid is None:
            continue  # a notification
        if method == "initialize":
            send({"id": rid, "result": {"protocolVersion": request["params"]["protocolVersion"],
                                        "capabilities": {"tools": {}}, "serverInfo": {"name": "raw", "version": "1"}}})
        elif method == "tools/list":
            send({"id": rid, "result": {"tools": tools}})
        elif method != "tools/call":
            send({"id": rid, "result": {}})
        elif mode == "closed":
            send({"id": rid, "error": {"code": -32602, "message": "Invalid arguments: the issue is closed"}})
        elif mode == "acting":
            send({"id": rid, "result": {"content": [{"type": "text", "text": notes(request["params"])}]}})
        elif mode == "odd":
            params = request["params"]
            odd(rid, params["name"], str((params.get("arguments") or {}).get("text", "")))
        elif mode == "video":
            send({"id": rid, "result": {"content": [{"type": "text", "text": "before"}, {"type": "video", "url": "x"}]}})
        else:
            text = str((request["params"].get("arguments") or {}).get("text", ""))
            if mode == "child" and text == "die":
                os._exit(3)
            if mode == "images":
                content = [{"type": "image", "mimeType": "image/png", "data": png(8 + n)} for n in range(int(text))]
            else:
                content = [{"type": "text", "text": text.upper()}]
            send({"id": rid, "result": {"content": content}})


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    note_start()
    print(f"test MCP server {sys.argv[1]} starting", file=sys.stderr, flush=True)
    {"good": good, "sdk": sdk, "http": http, "hang": hang, "garbage": garbage, "flood": flood, "raw": raw}[sys.argv[1]]()
