"""One client connection: JSON lines in, events out, several requests in flight.

Lines are split by hand rather than with ``StreamReader.readline`` so that a
line over the limit can be answered at once and then skipped up to its newline
without ever being held in memory.  Each request runs as its own task, so a
long ``ask`` does not hold up a ``cancel`` on the same connection; a failure in
one request becomes an ``error`` event and nothing else.  Requests take effect in
the order sent: one that changes what later ones see (``protocol.BARRIERS``) is
answered before any later line of the connection starts. Each request names only the
few it waits for (the last barrier, the last of its knowledge base), never every earlier
one, and a connection holds at most ``MAX_PENDING_REQUESTS``: a client that sends
without reading is refused line by line, not held in memory.

Writes never wait for the client: a turn keeps streaming, and keeps being
stored, even if the canvas stops reading.  A client that lets more than
``MAX_WRITE_BUFFER`` pile up is disconnected instead.  The first event sent in
a turn of the event loop leaves at once, and the rest of that turn's events in
one write at its end: a first token is not held back while the chunks that
arrived with it are parsed, and a fast stream costs at most two system calls per
batch rather than one per delta.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from core.errors import AssistantError, InternalError, LineTooLong, ShuttingDown, TooManyRequests

from . import events
from .events import error_event
from .protocol import (
    BARRIERS,
    MAX_LINE_BYTES,
    Request,
    decode_line,
    event_parts,
    request_id,
    sequence_key,
    validate,
)

__all__ = ["Connection", "Emit", "Handler", "Replier"]

logger = logging.getLogger(__name__)

READ_CHUNK = 64 * 1024
REFUSAL_GRACE = 2.0  # seconds a refused client has to read why before it is hung up on
MAX_WRITE_BUFFER = 32 * 1024 * 1024
MAX_PENDING_REQUESTS = 1000  # requests of one connection in flight (waiting or running) at once

Emit = Callable[[dict[str, Any]], None]

_TOO_LONG = object()  # marks a line that passed MAX_LINE_BYTES
LEADING_SPACE = re.compile(rb"[ \t\r\n]*")
LINES_PER_TURN = 32  # requests started from one client before the loop serves the others


def peer_credentials(sock: socket.socket) -> tuple[int, int] | None:
    """The pid and uid of the process on the other end (``SO_PEERCRED``), None if unknown."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process on the other end, None if unknown."""
    creds = peer_credentials(sock)
    return creds[1] if creds else None


def peer_program(sock: Any) -> str | None:
    """The name of the program on the other end (``/proc/PID/comm``), None if unknown."""
    creds = peer_credentials(sock) if sock is not None else None
    if not creds:
        return None
    try:
        with open(f"/proc/{creds[0]}/comm", encoding="utf-8", errors="replace") as comm:
            return comm.read().strip() or None
    except OSError:
        return None


async def read_lines(reader: asyncio.StreamReader, limit: int = MAX_LINE_BYTES) -> AsyncIterator[bytes | object]:
    """Yield each line (without its newline), or ``_TOO_LONG`` once for a line over ``limit``."""
    buf = bytearray()
    skipping = False  # inside an oversized line, waiting for its end
    lines = 0
    while True:
        chunk = await reader.read(READ_CHUNK)
        if len(chunk) == READ_CHUNK:
            # a client that sends faster than we parse must not starve the others: a full
            # chunk a turn of the loop (a smaller one emptied the buffer: the next read waits)
            await asyncio.sleep(0)
        if not chunk:
            if buf and not skipping:
                yield bytes(buf)
            return
        start = 0
        while True:
            if not buf and not skipping:
                # whitespace before a line is nothing (blank lines included): skip a run of it at
                # C speed, so a flood of blank lines costs no step per line
                blank = LEADING_SPACE.match(chunk, start)
                assert blank is not None  # the pattern matches the empty string
                start = blank.end()
                if start == len(chunk):
                    break
            newline = chunk.find(b"\n", start)
            piece = chunk[start:] if newline < 0 else chunk[start:newline]
            if not skipping:
                if len(buf) + len(piece) > limit:
                    buf.clear()
                    skipping = True
                    yield _TOO_LONG
                else:
                    buf += piece
            if newline < 0:
                break
            if not skipping:
                yield bytes(buf)
                lines += 1
                if lines % LINES_PER_TURN == 0:
                    await asyncio.sleep(0)  # many lines in one chunk: let the other clients in
            buf.clear()
            skipping = False
            start = newline + 1


class Replier:
    """The ``emit`` a request's handler gets: sends each event on the request's connection with
    the request's ``id``; and what a ``watch`` or a ``follow``, which outlive their request,
    need to know of that connection (``daemon.live``)."""

    __slots__ = ("connection", "_echo")

    def __init__(self, connection: Connection, request: Request) -> None:
        self.connection = connection
        self._echo = {"id": request.id} if request.has_id else None

    def __call__(self, event: dict[str, Any]) -> None:
        if self._echo is not None:
            event.update(self._echo)
        self.connection.send(event)

    @property
    def gone(self) -> bool:
        """The client hung up, or was dropped: nothing sent reaches it."""
        return self.connection.closed

    @property
    def backlog(self) -> int:
        """Bytes sent and not yet read by the client, beside the largest event among them."""
        return self.connection.backlog

    @property
    def listening(self) -> bool:
        """The client can still send requests (an ``approve``): it has not hung up or closed its side."""
        return self.connection.listening

    def on_hang_up(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` once the client can send no more requests; the canceller of that."""
        return self.connection.on_hang_up(callback)

    @property
    def program(self) -> str | None:
        """The program on the other end (who answered an approval), when known."""
        return peer_program(self.connection.socket)


Handler = Callable[[Request, Replier], Awaitable[None]]


class _Chain:
    """The requests of one knowledge base in flight on a connection: the last one (the next
    waits for it) and how many of them are ``kb_add``."""

    __slots__ = ("last", "adds", "count")

    def __init__(self, task: asyncio.Task[None]) -> None:
        self.last = task
        self.adds = 0
        self.count = 0

    def enter(self, task: asyncio.Task[None], adding: bool) -> None:
        self.last = task
        self.count += 1
        self.adds += adding

    def leave(self, adding: bool) -> bool:
        """Count one out; whether none is left."""
        self.count -= 1
        self.adds -= adding
        return self.count == 0


class Connection:
    """Serves one client until it hangs up; requests outlive it (a turn is never cut)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: Handler,
        tasks: set[asyncio.Task[None]],
        adding: Callable[[str], bool] = lambda _kb: False,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self._adding = adding  # whether an add to the KB named holds it, from any connection
        self._tasks = tasks  # the server's set, so shutdown can wait for them
        self._mine: set[asyncio.Task[None]] = set()  # this connection's requests in flight
        self._barrier: asyncio.Task[None] | None = None  # the last barrier: every later request waits for it
        self._sequenced: dict[str, _Chain] = {}  # per KB, the last request later ones of that KB wait for
        self._opens: set[asyncio.Task[None]] = set()  # the opens since the last barrier: the next one waits for them
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._largest = 0  # the largest event queued since the client last had nothing to read
        self._oversize = 0  # the size of a batch over the cap still being sent: it may wait whole
        self._batching = False  # an event already left in this turn of the loop
        self.closed = False
        self.listening = True  # False once the client can send no more requests
        self._hang_ups: list[Callable[[], None]] = []  # told when it stops listening (daemon.approvals)

    def send(self, event: dict[str, Any]) -> None:
        """Queue one event; dropped silently once the client is gone."""
        if self.closed:
            return
        parts = event_parts(event)
        size = sum(map(len, parts))
        if not self._pending and not self._writer.transport.get_write_buffer_size():
            self._largest = 0  # it read everything: what waits from here on is new
        self._largest = max(self._largest, size)
        self._pending += parts
        self._pending_bytes += size
        if self._stalled():
            self._drop()  # within one turn of the loop: a stalled client cannot hold more
        elif not self._batching:
            self._batching = True
            self._flush()
            asyncio.get_running_loop().call_soon(self._end_batch)

    @property
    def backlog(self) -> int:
        """Bytes waiting for the client (queued in this turn of the loop, and in the transport)
        beside the largest event among them: a client reading one large event (an ``open`` of
        a long conversation) is reading, not stalled."""
        if self.closed:
            return 0
        return max(self._pending_bytes + self._writer.transport.get_write_buffer_size() - self._largest, 0)

    def _end_batch(self) -> None:
        self._batching = False
        self._flush()

    def _stalled(self) -> bool:
        """Whether more than the cap would wait for a client that has not read what it has.

        A client that reads gets even one event larger than the cap (``open`` of a long
        conversation), and the events sent while it reads that one: what counts is data
        waiting behind unread data, beside the one oversize batch being sent.
        """
        waiting = self._writer.transport.get_write_buffer_size()
        if waiting <= MAX_WRITE_BUFFER:
            self._oversize = 0  # sent far enough: the cap alone holds again
        return waiting > 0 and waiting + self._pending_bytes > MAX_WRITE_BUFFER + self._oversize

    def _flush(self) -> None:
        if self.closed or not self._pending:
            return
        transport = self._writer.transport
        if transport.is_closing():
            self._pending.clear()
            self.closed = True
            return
        # the cap holds before the write: what a client does not read is never held past it
        if self._stalled():
            self._drop()
            return
        if self._pending_bytes > MAX_WRITE_BUFFER:
            self._oversize = max(self._oversize, self._pending_bytes)
        transport.writelines(self._pending)  # uvloop's writes them as they are (writev), no joined copy
        self._pending.clear()
        self._pending_bytes = 0

    def _drop(self) -> None:
        """Disconnect a client that stopped reading, discarding what it did not read."""
        logger.warning("client is not reading its events (over %d bytes wait); disconnecting it", MAX_WRITE_BUFFER)
        self._pending.clear()
        self._pending_bytes = 0
        self.closed = True
        self._writer.transport.abort()
        self._hung_up()

    @property
    def socket(self) -> Any:
        """The connection's socket (uvloop's stands in for a ``socket.socket``), None when closed."""
        return self._writer.get_extra_info("socket")

    def close(self) -> None:
        if not self.closed:
            self._flush()
            self.closed = True
            self._writer.close()
        self._hung_up()

    def on_hang_up(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (soon, from the loop) once the client can send no more requests: it
        hung up, shut its writing side, or was dropped. Returns what forgets it again."""
        if not self.listening:
            asyncio.get_running_loop().call_soon(callback)
            return lambda: None
        self._hang_ups.append(callback)
        return lambda: self._hang_ups.remove(callback) if callback in self._hang_ups else None

    def _hung_up(self) -> None:
        """No request can come any more: tell those waiting for one (an approval's answer)."""
        if not self.listening:
            return
        self.listening = False
        callbacks, self._hang_ups = self._hang_ups, []
        loop = asyncio.get_running_loop()
        for callback in callbacks:
            loop.call_soon(callback)

    async def serve(self) -> None:
        sock = self._writer.get_extra_info("socket")
        uid = peer_uid(sock) if sock is not None else None
        if uid is not None and uid != os.geteuid():
            logger.warning("refused a connection from uid %d", uid)
            self.send(events.forbidden())
            await self._turn_away()
            return
        try:
            async for line in read_lines(self._reader):
                if line is _TOO_LONG:
                    exc = LineTooLong(
                        f"a request line may have at most {MAX_LINE_BYTES} bytes (1 MiB); send file paths, not contents"
                    )
                    self.send(error_event(exc))
                elif isinstance(line, bytes) and line.strip():
                    try:
                        self._start(line)
                    except Exception:  # one bad line must never end the connection
                        logger.exception("could not start a request")
                        self.send(error_event(InternalError()))
            # the client is done sending (`echo ... | socat` half-closes): answer what it asked
            self._hung_up()
            if self._mine:
                await asyncio.wait(self._mine)
        except (ConnectionError, OSError) as exc:
            logger.debug("connection read ended: %s", exc)
        finally:
            # requests still running go on: a turn is stored even when its client left
            self.close()

    async def _turn_away(self) -> None:
        """Hang up once the client has read why: closing with its line unread would reset the
        connection, and its reader would lose the event before it (the write side is closed
        first, and what it sends read and dropped, for at most ``REFUSAL_GRACE`` seconds)."""
        self._flush()
        with contextlib.suppress(OSError, RuntimeError):
            self._writer.write_eof()
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(REFUSAL_GRACE):
                while await self._reader.read(READ_CHUNK):
                    pass
        self.close()

    def _start(self, line: bytes) -> None:
        try:
            obj = decode_line(line)
        except AssistantError as exc:
            self.send(error_event(exc))
            return
        try:
            rid = request_id(obj)
        except AssistantError as exc:
            self.send(error_event(exc))  # not echoed: that is what is wrong with it
            return
        echo = {"id": rid} if "id" in obj else {}
        try:
            request = validate(obj)
        except AssistantError as exc:
            self.send(error_event(exc, **echo))
            return
        if len(self._mine) >= MAX_PENDING_REQUESTS:
            # each request waiting is a task: a client that sends without reading its answers
            # is refused past the bound rather than held in memory
            self.send(error_event(TooManyRequests(MAX_PENDING_REQUESTS), **echo))
            return
        task = asyncio.create_task(self._run(request, self._order(request)), name=f"request-{request.type}")
        for tasks in (self._tasks, self._mine):
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        self._enter(request, task)

    def _order(self, request: Request) -> list[asyncio.Task[None]]:
        """What ``request`` waits for: the last barrier before it, the last earlier request of its
        knowledge base, and (a barrier) every ``open`` since that barrier. Each of those waited
        for the ones before it, so a request names a few tasks however many came earlier."""
        earlier = [self._barrier] if self._barrier is not None else []
        key = sequence_key(request)
        chain = self._sequenced.get(key) if key else None
        if chain is not None:
            earlier.append(chain.last)
        if request.type in BARRIERS:
            # a canvas must not get an open's conversation after a later delete's or settings' answer
            earlier += self._opens
        return earlier

    def _enter(self, request: Request, task: asyncio.Task[None]) -> None:
        """Record ``task`` as what later requests of the connection (or of its KB) wait for."""
        key = sequence_key(request)
        chain = self._sequenced.get(key) if key else None
        # a kb_link or kb_remove waiting for a kb_add of its KB (this connection's, or another's)
        # holds up only that KB's requests: as a barrier it would hold up the whole connection
        # for the whole ingest
        waits = (chain is not None and chain.adds > 0) or (key is not None and self._adding(request.get("kb")))
        if request.type in BARRIERS and not waits:
            self._barrier = task
            self._opens = set()  # the barrier waits for them: later ones wait for the barrier
            task.add_done_callback(self._barrier_done)
        if request.type == "open":
            opens = self._opens
            opens.add(task)
            task.add_done_callback(opens.discard)
        if key is not None:
            if chain is None:
                chain = self._sequenced[key] = _Chain(task)
            adding = request.type == "kb_add"
            chain.enter(task, adding)
            task.add_done_callback(lambda _: self._forget(key, adding))

    def _barrier_done(self, task: asyncio.Task[None]) -> None:
        if self._barrier is task:
            self._barrier = None

    def _forget(self, key: str, adding: bool) -> None:
        chain = self._sequenced.get(key)
        if chain is not None and chain.leave(adding):
            del self._sequenced[key]

    async def _run(self, request: Request, earlier: list[asyncio.Task[None]]) -> None:
        emit = Replier(self, request)
        echo = {"id": request.id} if request.has_id else {}
        started = False
        try:
            if earlier:
                await asyncio.wait(earlier)
            started = True
            await self._handler(request, emit)
        except AssistantError as exc:
            self.send(error_event(exc, **echo))
        except asyncio.CancelledError:
            # only a stopping daemon cancels a request: one still waiting for an earlier line,
            # or cut short, is told why (an ask that started answers for itself)
            if request.type != "ask":
                self.send(error_event(ShuttingDown(), **echo))
            elif not started:
                cid = request.get("conversation")
                self.send(error_event(ShuttingDown(), conversation=cid, turn=None if cid else 1, **echo))
            raise
        except Exception:
            logger.exception("request %s failed", request.type)
            self.send(error_event(InternalError(), **echo))
