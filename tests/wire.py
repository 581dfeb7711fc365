"""A test client speaking the protocol over the real socket, keeping every event it reads."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

EVENT_TIMEOUT = 30.0  # a hang fails the test instead of stalling the suite
TERMINAL = ("done", "error")


class Wire:
    """Sends raw lines or requests; reads events, sorting them by request id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.events: list[dict[str, Any]] = []
        self._next = 0

    @classmethod
    async def open(cls, path: Path) -> Wire:
        reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 24)
        return cls(reader, writer)

    async def send_raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def send(self, request: dict[str, Any]) -> Any:
        """Send a request with a fresh id (unless it has one) and return the id."""
        if "id" not in request:
            self._next += 1
            request = {**request, "id": f"r{self._next}"}
        await self.send_raw(json.dumps(request).encode() + b"\n")
        return request["id"]

    async def read(self) -> dict[str, Any]:
        line = await asyncio.wait_for(self.reader.readline(), EVENT_TIMEOUT)
        if not line:
            raise ConnectionError("the daemon closed the connection")
        event = json.loads(line)
        self.events.append(event)
        return event

    async def until(self, request_id: Any, types: tuple[str, ...] = TERMINAL) -> list[dict[str, Any]]:
        """Events answering ``request_id`` (including ones already read) up to one of ``types``."""
        got = [e for e in self.events if e.get("id") == request_id]
        if any(e["type"] in types for e in got):
            return got
        while True:
            event = await self.read()
            if event.get("id") == request_id:
                got.append(event)
                if event["type"] in types:
                    return got

    async def until_reply(self, request_id: Any, text: str) -> list[dict[str, Any]]:
        """Events answering ``request_id`` until their deltas add up to ``text``."""
        while True:
            got = [e for e in self.events if e.get("id") == request_id]
            if reply_text(got) == text:
                return got
            if any(e["type"] in TERMINAL for e in got):
                raise AssertionError(f"turn ended before its reply read {text!r}: {got[-1]}")
            await self.read()

    async def request(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send a request answered by one event and return that event."""
        rid = await self.send(request)
        while True:
            for event in self.events:
                if event.get("id") == rid:
                    self.events.remove(event)
                    return event
            await self.read()

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
