"""``assistant.py mcp ...``: the client side of MCP, speaking to the daemon over its socket.

- ``mcp list``: the MCP servers the daemon hosts, their state and their tools
  (the ``mcp_servers`` request);
- ``mcp serve``: an MCP server on stdio for any MCP client (Claude Desktop, an editor,
  another assistant), exposing the user's conversations and knowledge bases read-only
  (``mcpserve.server``; the only module here that loads the ``mcp`` SDK).

It is a client of the socket, and uses the client's own parts (``client``: the socket
path and its checks, the exit statuses, the error lines, the rendering that shows a
server's text without obeying its control characters). Those import the standard library
and ``common`` only, never the daemon, so importing this costs nothing: the client's start
stays light.
"""

from .cli import add_mcp_commands, run_mcp

__all__ = ["add_mcp_commands", "run_mcp"]
