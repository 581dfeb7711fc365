"""The daemon as an MCP host: tools from configured Model Context Protocol servers.

- ``McpHost``: every server of ``[mcp.servers.NAME]``, started when first needed, kept
  contained (a crash, a hang, a flood or garbage fails that server, not the turn), and
  restarted on a later need with back-off; ``offer`` gives the tools of the servers a
  conversation uses as ``core.tools.Tool``s named ``SERVER__TOOL``, sorted, fitted to a
  share of the context; ``status``/``describe`` for the ``status`` and ``mcp_servers``
  requests.

It stands on ``core`` alone. The ``mcp`` SDK is loaded by ``mcphost.connection`` in a
worker thread on first need: importing this package does not load it.
"""

from .host import McpHost, ServerHandle
from .tool import McpTool, offered_names

__all__ = ["McpHost", "McpTool", "ServerHandle", "offered_names"]
