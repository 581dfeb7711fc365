"""The limits both ends of the socket keep: the daemon refuses what passes them, and its
clients check first, so that the user is told before anything is sent."""

__all__ = ["MAX_LIST_LIMIT", "MAX_REQUEST_BYTES", "MAX_SOCKET_PATH"]

MAX_REQUEST_BYTES = 1 << 20  # the longest request line the daemon reads (1 MiB, newline excluded)
MAX_LIST_LIMIT = 500  # the most items a listing or a search answers with (its ``limit``)
MAX_SOCKET_PATH = 107  # bytes: sun_path holds 108 with its NUL
