"""The daemon's lifecycle: start → serve → shutdown.

``Server.serve`` binds (or takes systemd's socket), opens the history and the
router client, tells systemd it is ready, and waits on an ``asyncio.Event`` set
by SIGTERM/SIGINT.  Shutdown stops accepting, lets running turns finish within
``shutdown_grace`` seconds, stops the rest (each stores what it has), closes
the connections, and unlinks the socket it bound.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import TYPE_CHECKING

from attachments import configure_image_cache, configure_ocr, image_data_url
from core.config import Config
from core.errors import AssistantError, RouterUnreachable, StartupError
from core.router import RouterClient
from history import AsyncHistory
from kbinject import KbSettings, KnowledgeBases

from .connection import Connection
from .handlers import Handlers, unindex_deleted
from .listener import Listener, bind_listener, socket_from_systemd
from .live import Live
from .notify import extended_start, sd_notify
from .openai_door import OpenAIDoor
from .turns import TurnEngine

if TYPE_CHECKING:
    from mcphost import McpHost

__all__ = ["Server", "new_event_loop", "serve"]

logger = logging.getLogger(__name__)

REQUEST_GRACE = 1.0  # seconds short requests (a list, an open) get to finish at shutdown
START_LIST_SECONDS = 5.0  # the model list asked right after start: longer, and the server is said not to answer


class Server:
    """One daemon: a listening socket, its connections, the turn engine."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._connections: set[Connection] = set()
        self._requests: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[None]] = set()  # start-up work after readiness
        self._listener: Listener | None = None
        self._server: asyncio.AbstractServer | None = None
        self._history: AsyncHistory | None = None
        self._router: RouterClient | None = None
        self._kbs: KnowledgeBases | None = None
        self._mcp: McpHost | None = None
        self._engine: TurnEngine | None = None
        self._handlers: Handlers | None = None
        self.door: OpenAIDoor | None = None  # the OpenAI door, when openai_listen is set
        self.live = Live()  # every change, told to the watching connections

    @property
    def engine(self) -> TurnEngine | None:
        return self._engine

    def request_stop(self) -> None:
        self._stop.set()

    async def serve(self) -> None:
        """Run until asked to stop; always cleans up what it started."""
        started = time.monotonic()
        try:
            await self._start()
            logger.info(
                "ready on %s in %.0f ms (router %s, data %s, loop %s)",
                self.config.socket_path, (time.monotonic() - started) * 1000,
                self.config.router_url, self.config.data_dir, type(asyncio.get_running_loop()).__module__.split(".")[0],
            )
            sd_notify("READY=1")
            self.ready.set()
            assert self._kbs is not None
            # knowledge-base vectors load after readiness: a large KB must not delay start-up
            # so is the MCP SDK, in a worker thread, when servers are configured
            warm = [self._mcp.warm()] if self._mcp is not None else []
            for work in (self._kbs.start(), self._check_router(), self._check_store(), self._unindex_deleted(), *warm):
                task = asyncio.create_task(work)
                task.add_done_callback(_log_failure)
                self._background.add(task)
            await self._stop.wait()
        finally:
            await self._shutdown()

    async def _start(self) -> None:
        sock = socket_from_systemd()
        if sock is not None:
            self._listener = Listener(sock=sock, path=self.config.socket_path, owned=False)
            logger.info("using the socket passed by systemd")
        else:
            self._listener = bind_listener(self.config.socket_path)
        data = self.config.data_dir
        try:
            data.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(
                f"cannot create the data folder {data} ({exc.strerror}); fix the permissions "
                "of its parent, or set ASSISTANT_DATA_DIR to a folder you own"
            ) from exc
        if not os.access(data, os.W_OK | os.X_OK):
            raise StartupError(
                f"cannot write to the data folder {data}; fix its permissions (the daemon runs as you), "
                "or set ASSISTANT_DATA_DIR to a folder you own"
            )
        async with extended_start():  # a migration of millions of turns outlasts systemd's start timeout
            self._history = await AsyncHistory.open(self.config.db_path)
        configure_image_cache(self.config.data_dir / "images", self.config.data_dir / "thumbnails")
        configure_ocr(self.config.data_dir / "ocr", self.config.ocr_languages, self.config.ocr_images)
        try:
            interrupted = await self._history.interrupt_running()
        except Exception as exc:  # a full disk: serve what can be served, and say so
            logger.warning("turns cut by a crash could not be marked interrupted (%s); free some space "
                           "and restart to mark them", exc)
            interrupted = 0
        if interrupted:
            logger.warning("%d turn(s) were cut by a crash; kept as interrupted", interrupted)
        self._router = RouterClient(self.config)
        self._kbs = KnowledgeBases(
            self._history, self._router, KbSettings(self.config.embedding_model, self.config.kb_top_k)
        )
        if self.config.mcp.servers:  # the host's code loads only when servers are configured
            from mcphost import McpHost

            self._mcp = McpHost(self.config.mcp, image_data_url)
        self._history.on_saved = lambda o: self.live.turn_saved(o.conversation, o.turn, o.status, o.finish_reason)
        self._engine = TurnEngine(self.config, self._history, self._router, self._kbs, self.live, self._mcp)
        self._handlers = Handlers(self.config, self._history, self._router, self._engine, self._kbs, self.live)
        if self.config.openai_address is not None:
            self.door = OpenAIDoor(self.config, self._engine, self._history, self._router, self.live)
            await self.door.start()
        self._server = await asyncio.start_unix_server(self._on_connect, sock=self._listener.sock)

    async def _check_store(self) -> None:
        """Say at once when the history is damaged, and how to recover (it is served as it is)."""
        assert self._history is not None
        damage = await self._history.check()
        if damage:
            db = self.config.db_path
            logger.warning(
                "%s is damaged (%s); the daemon goes on serving it, but recover soon: stop the daemon, "
                "run `sqlite3 %s .recover > recovered.sql`, or move the file aside to start afresh",
                db, damage, db,
            )

    async def _check_router(self) -> None:
        """Say at once when the model server is not there (the first question would fail); else
        learn its models now, so that the first question does not wait for the list."""
        assert self._router is not None
        try:
            # bounded: a server that takes connections and never answers must not hold the
            # model list's lock from the first question for the list's own timeout (MODELS_TIMEOUT)
            await asyncio.wait_for(self._router.models(), START_LIST_SECONDS)
        except (RouterUnreachable, TimeoutError):
            logger.warning(
                "no model server answers at %s yet; start one (llama-server, Ollama, ...) or set router_url",
                self.config.router_url,
            )
        except AssistantError as exc:  # it answers, but not with a model list
            logger.warning("%s", exc.message)

    async def _unindex_deleted(self) -> None:
        """Drop the search rows of conversations whose delete a stop cut short."""
        assert self._history is not None
        for cid in await self._history.deleted_but_indexed():
            await unindex_deleted(self._history, cid)

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._handlers is not None
        assert self._kbs is not None
        connection = Connection(reader, writer, self._handlers, self._requests, adding=self._kbs.adding)
        self._connections.add(connection)
        try:
            await connection.serve()
        finally:
            self._connections.discard(connection)

    async def _shutdown(self) -> None:
        sd_notify("STOPPING=1")
        if self._server is not None:
            self._server.close()  # stop accepting; open connections stay for the turns' last events
        if self.door is not None:
            self.door.stop_listening()
        for task in self._background:
            task.cancel()
        if self._engine is not None:
            await self._engine.shutdown(self.config.shutdown_grace)
        if self._requests:
            # short requests still in flight (a list, an open): they finish quickly
            _done, pending = await asyncio.wait(self._requests, timeout=REQUEST_GRACE)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)  # they end before the history they use is closed
        for connection in list(self._connections):
            connection.close()
        if self.door is not None:
            await self.door.close()
        if self._mcp is not None:
            await self._mcp.close()  # the servers' processes end with the daemon
        if self._kbs is not None:
            await self._kbs.close()
        if self._router is not None:
            await self._router.aclose()
        if self._history is not None:
            await self._history.close()
        if self._listener is not None:
            self._listener.cleanup()
            if not self._listener.owned or self._server is None:  # else the server closed it
                self._listener.sock.close()
        logger.info("stopped")


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("background start-up work failed", exc_info=task.exception())


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The daemon's event loop: uvloop's where it is installed (a dependency on Linux), else
    asyncio's own. uvloop's loop and transports are C: the daemon's part of a question's way
    to its first token is shorter on it (``bench/bench_ttft.py``; docs/DESIGN.md, "The event
    loop")."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def serve(config: Config) -> None:
    """Serve until SIGTERM or SIGINT."""
    server = Server(config)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, server.request_stop)
    try:
        await server.serve()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
