"""A ten-line MCP server for the daemon to host: one tool that reads, one that acts."""
from pathlib import Path

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

NOTES = Path.home() / "notes.txt"
server = MCPServer("notes")


@server.tool(description="Read my notes.", annotations=ToolAnnotations(readOnlyHint=True))
def read_notes() -> str:  # read-only: runs without asking
    return NOTES.read_text() if NOTES.exists() else "(no notes yet)"


@server.tool(description="Add a line to my notes.")
def add_note(text: str) -> str:  # may act: each call waits for your yes
    with NOTES.open("a") as notes:
        notes.write(text + "\n")
    return "noted"


if __name__ == "__main__":
    server.run()  # stdio
