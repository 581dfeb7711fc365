"""Shared plumbing for the benchmarks: processes, sockets, statistics, the report header.

Every benchmark runs the daemon (``python assistant.py``) and the fake router
(``selfcheck/fakerouter.py``) as separate processes on loopback, so neither shares
a GIL with the other or with the measuring client.  Children are started with
``PR_SET_PDEATHSIG`` so they die with the benchmark even if it is killed, and
every context manager here stops what it started on the way out, failure or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import datetime
import multiprocessing
import multiprocessing.connection
import os
import platform
import random
import selectors
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # selfcheck.fakerouter, history

from client import Wire  # noqa: E402  (after the path above)

TMP_PREFIX = "/tmp/asst-bench-"  # short: AF_UNIX paths are limited to 107 bytes
START_TIMEOUT = 15.0  # seconds a child gets to come up
STOP_TIMEOUT = 10.0  # seconds a child gets to exit on SIGTERM before SIGKILL
PR_SET_PDEATHSIG = 1
DEFAULT_QUESTION = "What is the capital of France?"
# What the daemon sends before the history (core/config.py Config.system_prompt).
SYSTEM_PROMPT = "You are a helpful assistant running locally on the user's Linux desktop."
FAKE_MODEL = "fake-text"  # the fake router's first model: the daemon's default


# -- report ------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def header(title: str) -> None:
    """Print what is measured, the command that reproduces it, the date and the machine."""
    argv = list(sys.argv)
    with contextlib.suppress(ValueError):
        argv[0] = str(Path(argv[0]).resolve().relative_to(ROOT))
    python = sys.executable
    with contextlib.suppress(ValueError):
        python = str(Path(python).relative_to(ROOT))
    print(f"== {title}")
    print(f"command: cd {shlex.quote(str(ROOT))} && {shlex.join([python, *argv])}")
    print(f"date:    {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {cpu_model()}; "
        f"Python {platform.python_version()}, Linux {platform.release()}"
    )
    sys.stdout.flush()


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f} ms"


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def p90(values: Sequence[float]) -> float:
    """The 90th percentile (inclusive interpolation; the max of fewer than 2 values)."""
    if len(values) < 2:
        return max(values)
    return statistics.quantiles(values, n=10, method="inclusive")[8]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


# -- processes ---------------------------------------------------------------------------


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM, wait, then SIGKILL: the one way every child here is ended."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    if not _wait_exit(proc, STOP_TIMEOUT):
        proc.kill()
    proc.wait()


def _wait_exit(proc: subprocess.Popen[Any], timeout: float) -> bool:
    """Wait for the child to exit, noticing it at once (Popen.wait(timeout) polls every 50 ms)."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(pidfd, selectors.EVENT_READ)
            return bool(sel.select(timeout))
    finally:
        os.close(pidfd)


def terminate_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so ``finally`` blocks stop the children."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


@contextlib.contextmanager
def temp_dir(tag: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{tag}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def fake_router_process() -> Iterator[str]:
    """``python -m selfcheck.fakerouter`` in its own process; yields its URL (default replies only)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "selfcheck.fakerouter"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=die_with_parent,
    )
    try:
        assert proc.stdout is not None
        url = read_line(proc, START_TIMEOUT)
        if not url.startswith("http://"):
            raise RuntimeError(f"fake router printed {url!r} instead of its URL")
        yield url
    finally:
        stop_process(proc)
        if proc.stdout is not None:
            proc.stdout.close()


def read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The first line a child prints (its URL, or that it is ready), within ``timeout`` seconds."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise RuntimeError(f"{proc.args!r} printed nothing within {timeout:g} s")
    line = proc.stdout.readline().strip()
    if not line:
        raise RuntimeError(f"{proc.args!r} exited with {proc.wait()} before printing a line")
    return line


def _scripted_router(conn: multiprocessing.connection.Connection, chunks: list[str], repeat: int) -> None:
    """Child process: a FakeRouter with ``repeat`` copies of one long reply queued; stops on a message."""
    die_with_parent()
    from selfcheck.fakerouter import FakeModel, FakeRouter, Reply

    # a context the reply fits in, with room to spare: the fake ends a reply that fills its
    # context with "length", as llama-server does, and the daemon asks for a share of it
    model = FakeModel(FAKE_MODEL, n_ctx=4 * len(chunks) + 4096)
    with FakeRouter(models=[model]) as fake:
        fake.script(*[Reply(chunks=chunks) for _ in range(repeat)])
        conn.send(fake.url)
        with contextlib.suppress(EOFError, KeyboardInterrupt):
            conn.recv()  # anything, or the parent's end closing, means stop


def scripted_router_process(chunks: list[str], repeat: int) -> contextlib.AbstractContextManager[str]:
    """A FakeRouter in a child process answering the next ``repeat`` streams with ``chunks``.

    ``python -m selfcheck.fakerouter`` cannot be scripted from outside, so the child
    scripts itself; its replies after the ``repeat`` scripted ones are the default echo.
    """
    return router_process(_scripted_router, chunks, repeat)


@contextlib.contextmanager
def router_process(target: Callable[..., None], *args: Any) -> Iterator[str]:
    """Run ``target(pipe, *args)`` in a spawned child that sends back its router's URL."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), name="bench-fakerouter")
    proc.start()
    child.close()
    try:
        if not parent.poll(START_TIMEOUT):
            raise RuntimeError("the fake router did not start")
        yield parent.recv()
    finally:
        with contextlib.suppress(OSError):
            parent.send("stop")
        parent.close()
        proc.join(STOP_TIMEOUT)
        if proc.is_alive():
            proc.kill()
            proc.join()


class Daemon:
    """``python assistant.py`` in a child process, ready when it sends READY=1 on our NOTIFY_SOCKET."""

    def __init__(
        self, workdir: Path, router_url: str, data_dir: Path | None = None, prefix: Sequence[str] = (),
        settings: dict[str, str] | None = None,
    ) -> None:
        self.workdir = workdir
        self.settings = settings or {}  # ASSISTANT_* for this daemon, over the benchmarks' defaults
        self.router_url = router_url
        self.socket_path = workdir / "d.sock"
        self.data_dir = data_dir or workdir / "data"
        self.notify_path = workdir / "n.sock"
        self.log_path = workdir / "daemon.log"
        self.prefix = list(prefix)  # e.g. ["-m", "cProfile", "-o", FILE]
        self.proc: subprocess.Popen[bytes] | None = None
        self._notify: socket.socket | None = None
        self.spawned_at = 0.0
        self.ready_at = 0.0

    @property
    def startup(self) -> float:
        """Seconds from spawn to READY=1."""
        return self.ready_at - self.spawned_at

    def env(self) -> dict[str, str]:
        env = {
            k: v for k, v in os.environ.items()
            if not k.startswith(("ASSISTANT_", "LISTEN_", "NOTIFY_SOCKET", "JOURNAL_STREAM"))
        }
        env.update(
            ASSISTANT_SOCKET=str(self.socket_path),
            ASSISTANT_DATA_DIR=str(self.data_dir),
            ASSISTANT_ROUTER_URL=self.router_url,
            ASSISTANT_AUTO_TITLE="false",
            ASSISTANT_SHUTDOWN_GRACE="1",  # a benchmark stopped mid-turn cleans up quickly
            ASSISTANT_CONFIG=str(self._empty_config()),  # never the user's own file
            NOTIFY_SOCKET=str(self.notify_path),
        )
        env.update(self.settings)
        return env

    def _empty_config(self) -> Path:
        path = self.workdir / "config.toml"
        if not path.exists():
            self.workdir.mkdir(parents=True, exist_ok=True)
            path.write_text("# the benchmark's daemon: everything from ASSISTANT_* variables\n")
        return path

    def start(self, timeout: float = START_TIMEOUT) -> Daemon:
        self.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.notify_path.unlink(missing_ok=True)
        # kept bound until stop(): the daemon also reports STOPPING=1 there
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._notify.bind(str(self.notify_path))
            with open(self.log_path, "ab") as log:
                self.spawned_at = time.perf_counter()
                self.proc = subprocess.Popen(
                    [sys.executable, *self.prefix, "assistant.py"],
                    cwd=ROOT,
                    env=self.env(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    preexec_fn=die_with_parent,
                )
            self._wait_ready(self._notify, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, notify: socket.socket, timeout: float) -> None:
        assert self.proc is not None
        deadline = self.spawned_at + timeout
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise RuntimeError(f"the daemon sent no READY=1 within {timeout:g} s\n{self.log_tail()}")
            notify.settimeout(min(remaining, 0.2))
            try:
                message = notify.recv(4096)
            except TimeoutError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the daemon exited with {self.proc.returncode}\n{self.log_tail()}") from None
                continue
            if b"READY=1" in message.split(b"\n"):
                self.ready_at = time.perf_counter()
                return

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def self_reported_ready_ms(self) -> float | None:
        """The daemon's own "ready on ... in N ms" (the serve() part of start-up), from its log."""
        for line in reversed(self.log_tail(200).splitlines()):
            if " ready on " in line and " ms (" in line:
                with contextlib.suppress(ValueError):
                    return float(line.split(" in ", 1)[1].split(" ms", 1)[0])
        return None

    def rss_kib(self, field: str = "VmRSS") -> int:
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise RuntimeError(f"no {field} in /proc/{self.proc.pid}/status")

    def stop(self) -> float:
        """Stop it (SIGTERM); returns the seconds it took to exit."""
        started = time.perf_counter()
        if self.proc is not None:
            stop_process(self.proc)
        stopped = time.perf_counter() - started
        if self._notify is not None:
            self._notify.close()
            self._notify = None
            self.notify_path.unlink(missing_ok=True)
        return stopped if self.proc is not None else 0.0

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def profile_prefix(path: Path) -> list[str]:
    """Interpreter arguments that run the daemon under cProfile, writing ``path`` on exit."""
    return ["-m", "cProfile", "-o", str(path)]


def print_profile(path: Path, top: int = 25) -> None:
    """The daemon's hottest functions by own time (written when it exits on SIGTERM)."""
    import pstats

    if not path.exists():
        print(f"profile: {path} was not written (did the daemon exit cleanly?)")
        return
    print(f"profile of the daemon process (cProfile, top {top} by own time; figures above are inflated by it):")
    stats = pstats.Stats(str(path), stream=sys.stdout)
    stats.strip_dirs().sort_stats("tottime").print_stats(top)


# -- the socket client -----------------------------------------------------------------------


async def open_client(path: Path) -> Wire:
    """A connection for a benchmark: no events kept and no per-read timers, so it adds little."""
    return await Wire.open(path, keep=False)


async def answer(client: Wire, rid: Any, types: tuple[str, ...]) -> dict[str, Any]:
    """The first event answering ``rid`` whose type is in ``types``; an ``error`` raises."""
    async for event in client.stream(rid):
        if event["type"] == "error" and "error" not in types:
            raise RuntimeError(f"the daemon answered with an error: {event}")
        if event["type"] in types:
            return event
    raise AssertionError("stream() ends only by raising")  # pragma: no cover


async def statuses(client: Wire, until: asyncio.Future[Any] | None, count: int) -> list[float]:
    """Time ``status`` round trips: ``count`` of them, or as many as fit until ``until`` is done."""
    times: list[float] = []
    while (until is None and len(times) < count) or (until is not None and not until.done()):
        started = time.perf_counter()
        await answer(client, await client.send({"type": "status"}), ("status",))
        times.append(time.perf_counter() - started)
    return times


def history_messages(question: str, reply: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]


def write_history(
    db_path: Path, conversations: int, turns: int, model: str = FAKE_MODEL, filler: int = 0
) -> dict[int, list[dict[str, str]]]:
    """Fill history.db through ``HistoryStore`` (start_turn/finish_turn, as the daemon does);
    each reply is ``filler`` characters longer than its echo of the question.

    Returns each conversation's id and its messages as the daemon will replay them.
    """
    from history import HistoryStore, NewTurn

    db_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    out: dict[int, list[dict[str, str]]] = {}
    with HistoryStore(db_path) as store:
        for c in range(conversations):
            cid: int | None = None
            messages: list[dict[str, str]] = []
            for t in range(turns):
                question = f"Question {t + 1} of conversation {c + 1}: tell me something about topic {t % 17}."
                reply = "You said: " + question + " Well, " * (filler // 6)
                asked = [{"role": "user", "content": question}]
                conv, turn = store.start_turn(NewTurn(cid, question, asked, [], model, question[:40]))
                cid = conv.id
                exchange = history_messages(question, reply)
                store.finish_turn(
                    cid, turn.turn, messages=exchange, reply=reply, status="complete", finish_reason="stop",
                    prompt_tokens=100, completion_tokens=10, ctx_used=110,
                )
                messages.extend(exchange)
            assert cid is not None
            out[cid] = messages
    return out


# -- made-up text for the search benchmarks -------------------------------------------------

# Function words in rough order of English frequency, then filler made of syllables.
COMMON_WORDS = """
the of and to a in is you that it for be on with as this are i can or not have was but by
at your from if an will we do use they all one so more what there which when would about
my like out up has their other also how some time just then them these into only any new
make first file code need get data may than its should no been see could because set here
where way each example function value system work used two over most well now run very
after even our back call much model user want help same test key text good error still
list line write change number read name case type both many while another different point
part between return output
""".split()
SYLLABLES = (
    "ka to ri mon lex ter sa ven dor pi lu ston ber qua ne fal gri mo tas el wen zu ca ro "
    "tin vel shi par dex om"
).split()


def vocabulary(rng: random.Random, size: int) -> list[str]:
    """``size`` words: the common ones first (for a Zipf-like draw), then made-up ones."""
    words = list(dict.fromkeys(COMMON_WORDS))
    seen = set(words)
    while len(words) < size:
        word = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words
