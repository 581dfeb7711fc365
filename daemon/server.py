"""The daemon's lifecycle: start → serve → shutdown.

``Server.serve`` binds (or takes systemd's socket), opens the history and the
router client, tells systemd it is ready, and waits on an ``asyncio.Event`` set
by SIGTERM/SIGINT.  Shutdown stops accepting, lets running turns finish within
``shutdown_grace`` seconds, stops the rest (each stores what it has), closes
the connections, and unlinks the socket it bound.

SIGHUP reloads the configuration (``Server.reload``): new turns use it, running ones
finish with the one they started with; MCP servers added, removed or changed are
started (when first needed) and stopped; a file that cannot be used keeps the
configuration in effect, and the log and ``status`` say why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from attachments import FileReaders
from core.config import Config, ConfigError
from core.errors import AssistantError, RouterUnreachable, StartupError
from core.router import RouterClient
from history import AsyncHistory, HistoryStore, JournalStore
from kbinject import KbSettings, KnowledgeBases

from .connection import Connection
from .handlers import Handlers, unindex_deleted
from .listener import Listener, bind_listener, socket_from_systemd
from .live import RESERVE_BLOCK, JournalLimits, Live
from .notify import extended_start, sd_notify
from .openai import OpenAIDoor
from .turns import TurnEngine

if TYPE_CHECKING:
    from mcphost import McpHost, ServerHandle

__all__ = ["Server", "new_event_loop", "serve"]

logger = logging.getLogger(__name__)

# what a reload cannot change: the socket and data in use, and the embedder the knowledge bases hold
RESTART_KEYS = ("socket_path", "data_dir", "embedding_model", "embeddings_base")
# what the model server's client reads: a change makes a new client for the turns to come
ROUTER_KEYS = ("router_url", "api_key", "connect_timeout", "request_timeout", "model", "ctx_max", "assumed_ctx",
               "image_tokens", "model_image_tokens")
REQUEST_GRACE = 1.0  # seconds short requests (a list, an open) get to finish at shutdown
START_LIST_SECONDS = 5.0  # the model list asked right after start: longer, and the server is said not to answer


class Server:
    """One daemon: a listening socket, its connections, the turn engine."""

    def __init__(self, config: Config, load: Callable[[], Config] | None = None) -> None:
        self.config = config
        self._load = load  # the configuration read anew (SIGHUP); None: no reload
        self._reloading = asyncio.Lock()
        self._retired: list[ServerHandle] = []  # MCP servers a reload removed, stopped once unused
        self._old_routers: list[RouterClient] = []  # the knowledge bases' embedder may still be one
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._connections: set[Connection] = set()
        self._requests: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[Any]] = set()  # start-up work after readiness
        self._listener: Listener | None = None
        self._server: asyncio.AbstractServer | None = None
        self._history: AsyncHistory | None = None
        self._router: RouterClient | None = None
        self._kbs: KnowledgeBases | None = None
        self._mcp: McpHost | None = None
        self._readers: FileReaders | None = None  # OCR and the image cache, made at start
        self._engine: TurnEngine | None = None
        self._handlers: Handlers | None = None
        self.door: OpenAIDoor | None = None  # the OpenAI door, when openai_listen is set
        self.live = Live(journal_limits(config))  # every change, told to the watching connections

    @property
    def engine(self) -> TurnEngine | None:
        return self._engine

    @property
    def readers(self) -> FileReaders | None:
        return self._readers

    def request_stop(self) -> None:
        self._stop.set()

    def request_reload(self) -> None:
        if self.ready.is_set() and not self._stop.is_set():
            self._in_background(self.reload())

    def _in_background(self, work: Coroutine[Any, Any, Any]) -> None:
        """Work the daemon does beside the requests (logged if it fails, cancelled at shutdown)."""
        task = asyncio.create_task(work)
        task.add_done_callback(_log_failure)
        task.add_done_callback(self._background.discard)
        self._background.add(task)

    async def reload(self) -> bool:
        """Read the configuration again and use it for what comes next; False (and the old one
        kept, the reason logged and shown by ``status``) when it cannot be used."""
        assert self._load is not None and self._engine is not None and self._handlers is not None
        async with self._reloading:
            sd_notify(f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
            try:
                new = self._load()
            except ConfigError as exc:
                why = self._handlers.config_error = exc.message.replace("fix it and restart", "fix it and reload")
                logger.error("reload: %s; the configuration in effect is kept", why)
                sd_notify(f"READY=1\nSTATUS=serving; the last reload failed: {why}")
                return False
            self._handlers.config_error = None
            in_flight = self._apply(self._kept(new))
            self._in_background(self._retire(in_flight))
            self._in_background(self._handlers.health.check())  # another router, model or MCP server: told
            logger.info("configuration reloaded from %s", new.config_path or "the environment")
            sd_notify(f"READY=1\nSTATUS={self._status_line()}")
            return True

    def _kept(self, new: Config) -> Config:
        """``new``, with what only a restart changes as it is now (and said so)."""
        for key in RESTART_KEYS:
            if getattr(new, key) != getattr(self.config, key):
                logger.warning("reload: %s changed; it takes effect at the next restart", key.replace("s_base", "_url"))
        return dataclasses.replace(new, socket_path=self.config.socket_path, data_dir=self.config.data_dir)

    def _apply(self, new: Config) -> set[asyncio.Task[object]]:
        """Use ``new`` for the turns and requests to come; the asks in flight, which finish with
        what they started with."""
        assert self._engine is not None and self._handlers is not None and self._kbs is not None
        router = self._router
        assert router is not None
        if any(getattr(new, key) != getattr(self.config, key) for key in ROUTER_KEYS):
            self._old_routers.append(router)
            router = self._router = RouterClient(new)
        mcp = self._mcp
        if mcp is not None:
            mcp, retired = mcp.reconfigured(new.mcp)
            self._retired += retired
            mcp = mcp if new.mcp.servers else None
        elif new.mcp.servers:
            from mcphost import McpHost

            assert self._readers is not None
            mcp = McpHost(new.mcp, self._readers.images.image_data_url)
        self._mcp = mcp
        self._kbs.settings = KbSettings(self._kbs.settings.embedding_model, new.kb_top_k)
        in_flight = self._engine.reconfigure(new, router, mcp)
        self._handlers.config, self._handlers.router = new, router
        self.live.limits = journal_limits(new)
        self.config = new
        return in_flight

    async def _retire(self, in_flight: set[asyncio.Task[object]]) -> None:
        """Stop the MCP servers a reload removed or changed, once the turns that may call them end."""
        if in_flight:
            await asyncio.wait(in_flight)
        retired, self._retired = self._retired, []
        await asyncio.gather(*(handle.stop() for handle in retired))

    def _status_line(self) -> str:
        """What ``systemctl status`` shows of the daemon (sd_notify's STATUS=)."""
        return f"serving on {self.config.socket_path}; router {self.config.router_url}"

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
            sd_notify(f"READY=1\nSTATUS={self._status_line()}")
            self.ready.set()
            assert self._kbs is not None
            # knowledge-base vectors load after readiness: a large KB must not delay start-up
            # so is the MCP SDK, in a worker thread, when servers are configured
            warm = [self._mcp.warm()] if self._mcp is not None else []
            assert self._handlers is not None
            for work in (self._kbs.start(), self._check_router(), self._check_store(), self._unindex_deleted(),
                         self._handlers.health.run(), *warm):
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
        await self._resume_live(self._history)
        readers = self._readers = FileReaders.in_folder(self.config.data_dir, self.config.ocr_languages,
                                                        self.config.ocr_images)
        try:
            interrupted = await self._history.run(HistoryStore.interrupt_running)
        except Exception as exc:  # a full disk: serve what can be served, and say so
            logger.warning("turns cut by a crash could not be marked interrupted (%s); free some space "
                           "and restart to mark them", exc)
            interrupted = 0
        if interrupted:
            logger.warning("%d turn(s) were cut by a crash; kept as interrupted", interrupted)
        self._router = RouterClient(self.config)
        self._kbs = KnowledgeBases(
            self._history, self._router, KbSettings(self.config.embedding_model, self.config.kb_top_k), readers.ocr
        )
        if self.config.mcp.servers:  # the host's code loads only when servers are configured
            from mcphost import McpHost, ServerHandle

            self._mcp = McpHost(self.config.mcp, readers.images.image_data_url)
        self._history.on_saved = lambda o: self.live.turn_saved(o.conversation, o.turn, o.status, o.finish_reason)
        self._engine = TurnEngine(self.config, self._history, self._router, self._kbs, readers, self.live, self._mcp)
        self._handlers = Handlers(self.config, self._history, self._router, self._engine, self._kbs, self.live, readers)
        if self.config.openai_address is not None:
            self.door = OpenAIDoor(self.config, self._engine, self._history, self._router, self.live)
            await self.door.start()
        self._server = await asyncio.start_unix_server(self._on_connect, sock=self._listener.sock)

    async def _resume_live(self, history: AsyncHistory) -> None:
        """Number changes on from the last run's, with its journal (daemon/live.py)."""
        self.live.on_reserve = lambda upto: self._in_background(history.journal.run(JournalStore.reserve, upto))
        try:
            self.live.resume(*await history.journal.run(JournalStore.start, RESERVE_BLOCK))
        except AssistantError as exc:  # a full disk: number on from the reservation, and reserve when there is room
            logger.warning("the live state's numbering could not be reserved (%s); watchers that reconnect "
                           "will re-read", exc.message)
            base = await history.journal.run(JournalStore.reserved)
            self.live.resume(base, [])
            self.live.on_reserve(base + RESERVE_BLOCK)

    async def _save_live(self, history: AsyncHistory) -> None:
        """The last change's number and the journal, for the next start to resume from."""
        if not self.live.kept:
            return  # the start failed before it numbered on: keep the last run's
        try:
            await history.journal.run(JournalStore.save, *self.live.saved())
        except Exception as exc:  # a full disk: the next start numbers on from the reservation
            logger.warning("the live state's journal could not be saved (%s); watchers will re-read", exc)

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
                "no model server answers at %s yet; start one (llama-server, Ollama, ...), or `make demo` in the "
                "checkout for a small one to try, or set router_url",
                self.config.router_url,
            )
        except AssistantError as exc:  # it answers, but not with a model list
            logger.warning("%s", exc.message)

    async def _unindex_deleted(self) -> None:
        """Drop the search rows of conversations whose delete a stop cut short."""
        assert self._history is not None
        for cid in await self._history.run(HistoryStore.deleted_but_indexed):
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
        sd_notify("STOPPING=1\nSTATUS=stopping: running turns finish, then store what they have")
        if self._server is not None:
            self._server.close()  # stop accepting; open connections stay for the turns' last events
        if self.door is not None:
            self.door.stop_listening()
        for task in self._background:
            task.cancel()
        if self._handlers is not None:
            await self._handlers.converter.close()  # file operations: their tools killed, nothing half-written
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
        await asyncio.gather(*(handle.stop() for handle in self._retired))
        if self._kbs is not None:
            await self._kbs.close()
        for router in (*self._old_routers, *([self._router] if self._router is not None else [])):
            await router.aclose()
        if self._history is not None:
            await self._save_live(self._history)
            await self._history.close()
        if self._readers is not None:
            self._readers.close()
        if self._listener is not None:
            self._listener.cleanup()
            if not self._listener.owned or self._server is None:  # else the server closed it
                self._listener.sock.close()
        if self.ready.is_set():  # a start that failed says why, not that it stopped
            logger.info("stopped")


def journal_limits(config: Config) -> JournalLimits:
    return JournalLimits(config.watch_journal, config.watch_journal_minutes * 60)


def _log_failure(task: asyncio.Task[Any]) -> None:
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


async def serve(config: Config, load: Callable[[], Config] | None = None) -> None:
    """Serve until SIGTERM or SIGINT; SIGHUP reloads the configuration with ``load``."""
    server = Server(config, load)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, server.request_stop)
    if load is not None:
        loop.add_signal_handler(signal.SIGHUP, server.request_reload)
    try:
        await server.serve()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)
