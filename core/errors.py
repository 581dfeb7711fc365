"""Errors that reach a client, each with a stable ``code``.

Only the messages of these exceptions are sent to a client verbatim; anything
else becomes ``internal`` ("internal error, see the daemon's log") and its
traceback goes to the log.  Every message says what the user can do.

    AssistantError                    code
    ├── BadRequest                    bad_request     malformed or mistyped request
    │   └── UnknownType               unknown_type    a request type we do not serve
    ├── LineTooLong                   line_too_long   a request line over 1 MiB
    ├── TooManyRequests               too_many_requests  a connection's requests in flight pass the bound
    ├── NotFound                      not_found       no such conversation / turn / KB
    ├── Busy                          busy            a turn already runs in that conversation
    ├── NotPending                    not_pending     an answer to a call that waits for none
    ├── FileRefused                   file_refused    an attached file cannot be used
    │   ├── TooManyFiles              too_many_files
    │   ├── UnsupportedKind           unsupported_kind
    │   ├── NoVision                  no_vision
    │   └── TooManyPixels             too_many_pixels  images waiting to be decoded pass the budget
    ├── BadOption                     bad_option      an option a file operation does not take, or a wrong value
    ├── ConvertFailed                 convert_failed  a file operation could not be done (fileops/)
    │   ├── ToolMissing               tool_missing    its tool (ffmpeg, poppler) is not installed
    │   ├── ConvertTimeout            convert_timeout  it passed convert_timeout
    │   └── OutputTooLarge            output_too_large  its output passed its size bound
    ├── ContextOverflow               context_overflow  the turn cannot fit the model's context
    ├── RouterUnreachable             router_unreachable  no answer from the model server
    ├── RouterError                   router_error    the model server answered with an error
    │   ├── RouterContextOverflow     router_context_overflow
    │   └── RouterFormatError         router_error    the model wrote a tool call the server could not read
    ├── DiskFull                      disk_full       the disk holding the history is full
    ├── HistoryDamaged                history_damaged  the history database is damaged (it names the file)
    ├── ShuttingDown                  shutting_down   the daemon is stopping
    └── InternalError                 internal        a bug; the log has the traceback
"""

from __future__ import annotations

# advice in messages that names a protocol request, which each client says in its own words
from common.advice import ADD_KB, ADVICE, LIST_CONVERSATIONS, LIST_KBS, LIST_MODELS

__all__ = [
    "AssistantError",
    "BadOption",
    "BadRequest",
    "Busy",
    "ContextOverflow",
    "ConvertFailed",
    "ConvertTimeout",
    "DiskFull",
    "FileRefused",
    "HistoryDamaged",
    "LineTooLong",
    "NoVision",
    "NotFound",
    "NotPending",
    "OutputTooLarge",
    "RouterContextOverflow",
    "RouterError",
    "RouterFormatError",
    "RouterUnreachable",
    "EXIT_STARTUP",
    "ShuttingDown",
    "StartupError",
    "TooManyRequests",
    "ToolMissing",
    "TooManyFiles",
    "TooManyPixels",
    "UnknownType",
    "UnsupportedKind",
    "InternalError",
    "ADVICE",
    "LIST_CONVERSATIONS",
    "LIST_KBS",
    "LIST_MODELS",
    "ADD_KB",
    "listed",
    "no_conversation",
    "no_kb",
]


class AssistantError(Exception):
    """Base of every error whose message may be shown to the user."""

    code = "error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(AssistantError):
    """The request is not valid JSON, lacks a field, or has a field of the wrong type."""

    code = "bad_request"


class UnknownType(BadRequest):
    """The request's ``type`` is not one the daemon serves."""

    code = "unknown_type"


class LineTooLong(AssistantError):
    """A request line passed the size limit."""

    code = "line_too_long"


class TooManyRequests(AssistantError):
    """A connection sent more requests than may wait for an answer at once: the line is refused
    (nothing of it done) rather than held until the earlier ones are answered."""

    code = "too_many_requests"

    def __init__(self, bound: int) -> None:
        super().__init__(
            f"this connection already has {bound} requests waiting for an answer; "
            "read their answers before sending more, then send this one again"
        )


class NotFound(AssistantError):
    """A conversation, turn, attachment or knowledge base that does not exist."""

    code = "not_found"


class Busy(AssistantError):
    """A turn is already running in the conversation."""

    code = "busy"


class NotPending(AssistantError):
    """An ``approve`` for a call that is not waiting for one: answered already, unknown, or its
    turn ended."""

    code = "not_pending"


class FileRefused(AssistantError):
    """An attached file cannot be read or used."""

    code = "file_refused"


class TooManyFiles(FileRefused):
    """More files than one question may carry."""

    code = "too_many_files"


class UnsupportedKind(FileRefused):
    """A file of a kind chat does not take."""

    code = "unsupported_kind"


class NoVision(FileRefused):
    """Images for a model that cannot see them."""

    code = "no_vision"


class TooManyPixels(FileRefused):
    """The images of a question, with those other questions are decoding, pass the pixel budget."""

    code = "too_many_pixels"


class BadOption(AssistantError):
    """An option of a file operation it does not take, or of a value it does not take: the
    message names the option and what it takes (the request itself is well formed)."""

    code = "bad_option"


class ConvertFailed(AssistantError):
    """A file operation could not be done: a damaged input (named), a tool that failed."""

    code = "convert_failed"


class ToolMissing(ConvertFailed):
    """The tool an operation runs is not installed; the message names its Debian package."""

    code = "tool_missing"


class ConvertTimeout(ConvertFailed):
    """A file operation ran past ``convert_timeout``."""

    code = "convert_timeout"


class OutputTooLarge(ConvertFailed):
    """A file operation's output passed its size bound, which the message names."""

    code = "output_too_large"


class ContextOverflow(AssistantError):
    """The turn cannot fit the model's context, even after compaction."""

    code = "context_overflow"


class RouterUnreachable(AssistantError):
    """The model server did not answer (refused, timed out, dropped)."""

    code = "router_unreachable"


class RouterError(AssistantError):
    """The model server answered with an error; the message carries its own words."""

    code = "router_error"

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RouterContextOverflow(RouterError):
    """The model server said the prompt exceeds its context; ``n_ctx`` is the size it
    named (llama-server's error body carries it), None when it named none."""

    code = "router_context_overflow"

    def __init__(self, message: str, status: int | None = None, n_ctx: int | None = None) -> None:
        super().__init__(message, status)
        self.n_ctx = n_ctx


class RouterFormatError(RouterError):
    """The model began a tool call the model server could not parse: llama-server's "the model
    produced output that does not match the expected ... format". The turn asks once more
    without tools before it reports this (``daemon.runner``)."""


class DiskFull(AssistantError):
    """The disk holding the history is full: nothing new is stored until there is room
    (a reply that could not be written is kept in memory and written then)."""

    code = "disk_full"


class HistoryDamaged(AssistantError):
    """The history database is damaged (overwritten, truncated, a disk fault) while the daemon
    runs: what needs it is refused, with the file named and the way to recover it."""

    code = "history_damaged"

    def __init__(self, path: object, why: object) -> None:
        super().__init__(
            f"the history database {path} is damaged ({why}); stop the daemon, then recover it "
            f"(sqlite3 {path} .recover > recovered.sql) or move it aside (mv {path} {path}.damaged) "
            "and start again"
        )


class ShuttingDown(AssistantError):
    """The daemon is stopping and takes no new turns."""

    code = "shutting_down"

    def __init__(self, message: str = "the daemon is shutting down; ask again once it is back") -> None:
        super().__init__(message)


class StartupError(AssistantError):
    """The daemon cannot start: its data cannot be opened. The message names the file and
    what to do; the process exits with ``EXIT_STARTUP``, which the systemd unit does not
    restart in a loop."""

    code = "startup"


EXIT_STARTUP = 78  # sysexits' EX_CONFIG: systemd's RestartPreventExitStatus names it


class InternalError(AssistantError):
    """Anything unexpected: the client gets this, the log gets the traceback."""

    code = "internal"

    def __init__(self, message: str = "internal error; the daemon's log (journalctl --user -u assistant) has the details") -> None:
        super().__init__(message)


MAX_LISTED = 5  # names of a client's own an error message repeats, then how many more
MAX_NAME_CHARS = 60


def listed(names: list[str]) -> str:
    """Names a client sent, for a message: the first few, each cut short, and how many more
    (100,000 unknown names made a message of 300 KB)."""
    shown = [name if len(name) <= MAX_NAME_CHARS else name[: MAX_NAME_CHARS - 1] + "…" for name in names[:MAX_LISTED]]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


def no_conversation(cid: object) -> NotFound:
    """The refusal of a conversation that does not exist (or was deleted)."""
    return NotFound(f"conversation {cid} does not exist; {LIST_CONVERSATIONS}")


def no_kb(name: object, advice: str = LIST_KBS) -> NotFound:
    """The refusal of a knowledge base that does not exist, with what to do instead."""
    return NotFound(f"there is no knowledge base {name!r}; {advice}")
