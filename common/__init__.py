"""Below every floor: what the daemon and its clients both know, in the standard library alone.

- ``limits``: the longest request line the daemon reads, the most items a listing answers
  with, the longest path a Unix socket may have;
- ``environment``: the socket's default place (and why a path cannot be one), the keys a
  user may set, and a warning for an ``ASSISTANT_*`` variable that is none of them;
- ``advice``: the phrases of the daemon's messages that name a protocol request, which
  each client says in its own words;
- ``version``: the version, written once.

It imports nothing of ours and nothing outside the standard library: ``core`` (the
daemon's ground floor) and ``client`` (the command line, which the system ``python3``
runs) both stand on it, and the client imports it without ``core``'s ``__init__`` (the
configuration, ``tomllib``, the budgets) behind it.
"""

from .advice import ADD_KB, ADVICE, LIST_CONVERSATIONS, LIST_KBS, LIST_MODELS
from .environment import (
    OPENAI_KEY_FILE,
    PATH_VARIABLES,
    SETTINGS,
    default_config_path,
    default_data_dir,
    default_socket_path,
    missing_packages,
    socket_path_problem,
    unknown_variables,
)
from .limits import MAX_LIST_LIMIT, MAX_REQUEST_BYTES, MAX_SOCKET_PATH
from .version import __version__

__all__ = [
    "ADD_KB",
    "ADVICE",
    "LIST_CONVERSATIONS",
    "LIST_KBS",
    "LIST_MODELS",
    "MAX_LIST_LIMIT",
    "MAX_REQUEST_BYTES",
    "MAX_SOCKET_PATH",
    "OPENAI_KEY_FILE",
    "PATH_VARIABLES",
    "SETTINGS",
    "__version__",
    "default_config_path",
    "default_data_dir",
    "default_socket_path",
    "missing_packages",
    "socket_path_problem",
    "unknown_variables",
]
