"""The daemon's clients: the command line behind ``assistant.py``'s subcommands, and the
socket client everything else speaks through (``mcp serve``, the self-check, the tests,
the benchmarks).

- ``wire``: one JSON-lines connection to the socket (``Wire``), and why one failed
  (``DaemonGone``, ``Unsendable``);
- ``commands``: the subcommands, their requests and exit statuses;
- ``turn``: one question and its streamed reply, as ``ask`` and ``chat`` show it;
- ``chat``: the interactive conversation (imported by ``chat`` alone);
- ``terminal``: what goes to stdout and to stderr, Ctrl-C, stdin, a closed pipe;
- ``render``: events shown to people, their text never obeyed.

Standard library only, and nothing of ours but ``common``: the system ``python3`` runs it
from a checkout, without the venv, and it never loads the daemon (``daemon`` does not
import it either; tests/test_layers.py holds both).
"""

from .commands import add_client_commands, add_client_options, connect, guarded, run_client, socket_path
from .terminal import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_NO_DAEMON, EXIT_OK, EXIT_USAGE, Terminal
from .wire import TERMINAL, DaemonGone, Unsendable, Wire, of_type, reply_text

__all__ = [
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_NO_DAEMON",
    "EXIT_OK",
    "EXIT_USAGE",
    "TERMINAL",
    "DaemonGone",
    "Terminal",
    "Unsendable",
    "Wire",
    "add_client_commands",
    "add_client_options",
    "connect",
    "guarded",
    "of_type",
    "reply_text",
    "run_client",
    "socket_path",
]
