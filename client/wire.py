"""The JSON-lines client of the daemon's socket: the command line, ``mcp serve``, the
self-check, the tests and the benchmarks all speak through this one (standard library only).

Requests get ids (``r1``, ``r2``, ... unless they carry one); events are matched to their
request by id. A ``Wire`` may keep every event it reads (``keep=True``, what tests
inspect) or drop those nobody waits for (the client, the benchmarks); it may bound each
read (``timeout``, so a hang fails a test instead of stalling it) or wait as long as a
model takes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from common import MAX_REQUEST_BYTES

__all__ = ["TERMINAL", "DaemonGone", "Unsendable", "Wire", "of_type", "reply_text"]

TERMINAL = ("done", "error")  # the events that end an ask
READ_LIMIT = 64 * 1024 * 1024  # the longest event line accepted (an `open` of a long conversation)


class DaemonGone(Exception):
    """No daemon answers on the socket, or it hung up; the message says what to do."""


class Unsendable(ValueError):
    """A request that cannot go to the daemon as it is (``code``: ``too_long``, over 1 MiB, or
    ``not_text``, text that is not UTF-8); the message says what to do. Nothing was sent."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class Wire:
    """One connection to the daemon."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, keep: bool = True,
        timeout: float | None = None,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.keep = keep
        self.timeout = timeout
        self.events: list[dict[str, Any]] = []  # read and not yet taken (all of them with keep)
        self._next = 0

    @classmethod
    async def open(cls, path: Path | str, *, keep: bool = True, timeout: float | None = None) -> Wire:
        try:
            reader, writer = await asyncio.open_unix_connection(str(path), limit=READ_LIMIT)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise DaemonGone(
                f"no daemon answers on {path} ({exc.strerror}); start it with `make run` "
                "or `systemctl --user start assistant`"
            ) from None
        except PermissionError:
            raise DaemonGone(f"{path} belongs to another user; set ASSISTANT_SOCKET to your daemon's socket") from None
        return cls(reader, writer, keep=keep, timeout=timeout)

    async def send_raw(self, data: bytes) -> None:
        try:
            self.writer.write(data)
            await self.writer.drain()
        except (ConnectionError, OSError) as exc:
            raise DaemonGone(f"the connection to the daemon was lost ({exc}); is it stopping? see its log") from None

    async def send(self, request: dict[str, Any]) -> Any:
        """Send a request with a fresh id (unless it has one) and return the id; ``Unsendable``
        (nothing sent) for one the daemon would refuse unread."""
        if "id" not in request:
            self._next += 1
            request = {**request, "id": f"r{self._next}"}
        try:
            line = json.dumps(request, ensure_ascii=False).encode()
        except UnicodeEncodeError:  # a file name or word the shell passed as undecodable bytes
            raise Unsendable(
                "a file name or word is not UTF-8 text; rename the file, or retype the words", "not_text"
            ) from None
        if len(line) > MAX_REQUEST_BYTES:
            raise Unsendable(
                f"the request is {len(line):,} bytes, over the {MAX_REQUEST_BYTES:,} the daemon reads; "
                "send long text as a file (ask -f FILE)", "too_long",
            )
        await self.send_raw(line + b"\n")
        return request["id"]

    async def read(self) -> dict[str, Any]:
        """The next event on the connection (kept when ``keep``)."""
        try:
            line = await asyncio.wait_for(self.reader.readline(), self.timeout)
        except TimeoutError:
            raise  # no answer in time is not a lost connection (TimeoutError is an OSError)
        except (ConnectionError, OSError) as exc:
            raise DaemonGone(f"the connection to the daemon was lost ({exc}); is it stopping? see its log") from None
        if not line:
            raise DaemonGone("the daemon closed the connection (is it stopping? see its log)")
        event: dict[str, Any] = json.loads(line)
        if self.keep:
            self.events.append(event)
        return event

    async def stream(self, request_id: Any) -> AsyncGenerator[dict[str, Any], None]:
        """The events answering ``request_id`` as they come (those already read first); an
        error with no id read meanwhile (the daemon refusing the connection itself,
        ``forbidden``) answers it too."""
        for event in [e for e in self.events if e.get("id") == request_id]:
            yield event
        while True:
            event = await self.read()
            if event.get("id") == request_id or ("id" not in event and event.get("type") == "error"):
                yield event

    async def until(self, request_id: Any, types: tuple[str, ...] = TERMINAL) -> list[dict[str, Any]]:
        """Events answering ``request_id`` up to the first of one of ``types``."""
        got = []
        async for event in self.stream(request_id):
            got.append(event)
            if event["type"] in types:
                return got
        raise AssertionError("stream() ends only by raising")  # pragma: no cover

    async def until_reply(self, request_id: Any, text: str) -> list[dict[str, Any]]:
        """Events answering ``request_id`` until their deltas add up to ``text``."""
        got = []
        async for event in self.stream(request_id):
            got.append(event)
            if reply_text(got) == text:
                return got
            if event["type"] in TERMINAL:
                raise AssertionError(f"turn ended before its reply read {text!r}: {event}")
        raise AssertionError("stream() ends only by raising")  # pragma: no cover

    async def request(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send a request answered by one event and return that event (taken off ``events``)."""
        rid = await self.send(request)
        async for event in self.stream(rid):
            if event in self.events:
                self.events.remove(event)
            return event
        raise AssertionError("stream() ends only by raising")  # pragma: no cover

    async def ask(self, text: str, **fields: Any) -> list[dict[str, Any]]:
        """Ask and return every event of the turn, through ``done`` or ``error``."""
        rid = await self.send({"type": "ask", "text": text, **fields})
        return await self.until(rid)

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


def of_type(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


def reply_text(events: list[dict[str, Any]]) -> str:
    return "".join(e["text"] for e in of_type(events, "delta"))
