"""``assistant.py doctor``: a check of the user's own set-up, one line each with its fix.

``--test`` checks the code against its own fake router; this checks what the user has:
this Python and its packages, the configuration, the socket and the daemon, the model
server (its models, their context, vision and tools), the embedding model, poppler, each
MCP server, the disk. It is a client of the socket where the daemon knows best (models, MCP
servers), and asks the model server itself too, so that it tells something when no daemon
runs. Standard library, ``common``, the client, and ``core.config`` to read the file as
the daemon does (no package the system ``python3`` lacks).
"""

from .checks import Check, run_doctor

__all__ = ["Check", "run_doctor"]
