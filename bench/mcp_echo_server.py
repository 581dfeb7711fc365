"""The MCP server bench_mcp.py calls: one ``echo`` tool over stdio (the SDK's MCPServer)."""

# no `from __future__ import annotations`: the SDK reads the tool's annotations at run time
from mcp.server.mcpserver import MCPServer

server = MCPServer("bench-echo")


@server.tool(description="Return the text as it came.")
def echo(text: str) -> str:
    return text


if __name__ == "__main__":
    server.run("stdio")
