"""The checks of ``doctor``, in the order a set-up is built: each gives one ``Check`` line."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from client import DaemonGone, Wire, socket_path
from common import missing_packages

if TYPE_CHECKING:
    from core import Config

__all__ = ["Check", "run_doctor"]

HTTP_TIMEOUT = 10.0  # seconds the model server has for each of doctor's questions
MCP_TIMEOUT = 120.0  # seconds the daemon has to start every MCP server and list their tools
ROOMY_BYTES = 64 << 20  # free space under this and the daemon warns (history's ROOMY_BYTES)
POPPLER = ("pdftotext", "pdftoppm", "pdfinfo")
FFMPEG = ("ffmpeg", "ffprobe")  # convert's video operations (fileops/)


@dataclass
class Check:
    """One line: what was checked, whether it passed, what was found or what to do."""

    name: str
    ok: bool
    said: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'}  {self.name:<14} {self.said}"


def run_doctor(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Run every check, print one line each; 0 only when all pass."""
    checks: list[Check] = []

    def tell(check: Check) -> None:
        checks.append(check)
        print(check.line(), file=out, flush=True)

    missing = missing_packages(("httpx", "numpy", "PIL"))
    tell(Check("python", not missing, f"{sys.executable} has no {', '.join(missing)}: run `make setup`, then use "
                                      ".venv/bin/python (or .venv/bin/assistant)" if missing else sys.executable))
    config = _configuration(tell)
    if config is not None:
        asyncio.run(_served(args, config, tell))
        _local(config, tell)
    failed = sum(not c.ok for c in checks)
    print(f"{len(checks) - failed} of {len(checks)} checks passed" + (f"; fix the {failed} above" if failed else ""),
          file=out)
    return 1 if failed else 0


def _configuration(tell: Any) -> Config | None:
    from core.config import ConfigError, load_config  # the file read as the daemon reads it

    try:
        config = load_config()
    except ConfigError as exc:
        tell(Check("configuration", False, exc.message))
        return None
    where = str(config.config_path) if config.config_path else "no config.toml: the defaults and ASSISTANT_* variables"
    tell(Check("configuration", True, where))
    return config


async def _served(args: argparse.Namespace, config: Config, tell: Any) -> None:
    """The daemon (when it answers: its models and MCP servers), then the model server itself."""
    wire = await _daemon(args, tell)
    try:
        models = await wire.request({"type": "models"}) if wire is not None else None
        router = await asyncio.to_thread(_router, config, models)
        tell(router)
        if config.embedding_model:
            tell(await asyncio.to_thread(_embeddings, config))
        else:
            tell(Check("embeddings", True, "no embedding_model: knowledge bases use keyword search only"))
        if wire is not None:
            for server in await _mcp(wire):
                tell(server)
        elif config.mcp.servers:
            tell(Check("mcp", False, "not checked: no daemon answers (start it, then run doctor again)"))
    finally:
        if wire is not None:
            await wire.close()


async def _daemon(args: argparse.Namespace, tell: Any) -> Wire | None:
    try:
        path = socket_path(args)
        wire = await Wire.open(path, keep=False, timeout=HTTP_TIMEOUT)
        status = await wire.request({"type": "status"})
    except (DaemonGone, OSError, TimeoutError) as exc:
        tell(Check("daemon", False, str(exc)))
        return None
    if status["type"] == "error":
        tell(Check("daemon", False, f"{status['message']}"))
        await wire.close()
        return None
    tell(Check("daemon", True, f"assistant {status['version']} on {path}, up {status['uptime']:.0f}s"))
    if status.get("config_error"):
        tell(Check("reload", False, f"the daemon runs an older configuration: {status['config_error']}"))
    ocr = status.get("ocr") or {}
    if ocr:  # as the daemon finds it: tesseract and the configured languages (attachments.ocr)
        languages = "+".join(ocr.get("languages") or ())
        tell(Check("ocr", bool(ocr.get("available")), ocr.get("note") or f"tesseract reads {languages}"))
    return wire


def _router(config: Config, models: dict[str, Any] | None) -> Check:
    """The model server: reachable, its models (with the daemon's view of them), tools for the default."""
    base = config.router_url
    try:
        listed = _http(config, f"{base}/models")
    except OSError as exc:
        return Check("router", False, f"{base} does not answer ({_why(exc)}): start your model server (llama-server, "
                                      "Ollama, ...), or `make demo` for a small one, or fix router_url")
    ids = [str(m["id"]) for m in listed.get("data") or [] if isinstance(m, dict) and m.get("id")]
    if not ids:
        return Check("router", False, f"{base} lists no models: load one in the model server")
    described = {m["id"]: m for m in (models or {}).get("items") or []}
    default = config.model or ids[0]
    if default not in ids:
        return Check("router", False, f"model {default!r} is not among {', '.join(ids)}: fix model in config.toml")
    shown = []
    for model in ids:
        known = described.get(model)
        vision = known is not None and "image" in known["input_modalities"]
        facts = f"ctx {known['ctx_max']}{', vision' if vision else ''}" if known else "ctx ? (no daemon to ask)"
        shown.append(f"{model} ({facts}{', tools ' + _tools(config, model) if model == default else ''})")
    return Check("router", True, f"{base}: {'; '.join(shown)}")


def _tools(config: Config, model: str) -> str:
    """Whether the server takes the tools parameter for ``model`` (one token asked)."""
    tool = {"type": "function", "function": {"name": "ping", "description": "Answer ping.",
                                              "parameters": {"type": "object", "properties": {}}}}
    body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1, "tools": [tool]}
    try:
        _http(config, f"{config.router_url}/chat/completions", body)
    except urllib.error.HTTPError as exc:
        return f"refused ({exc.code}: llama-server needs --jinja)"
    except OSError as exc:
        return f"not known ({_why(exc)})"
    return "yes"


def _embeddings(config: Config) -> Check:
    url = f"{config.embeddings_base}/embeddings"
    try:
        answer = _http(config, url, {"model": config.embedding_model, "input": ["doctor"]})
        size = len(answer["data"][0]["embedding"])
    except OSError as exc:
        return Check("embeddings", False, f"{url} for {config.embedding_model!r}: {_why(exc)}; start an embedding "
                                          "server (llama-server --embeddings --pooling mean) or fix embedding_url")
    except (KeyError, IndexError, TypeError):
        return Check("embeddings", False, f"{url} answered without vectors: check embedding_model")
    return Check("embeddings", True, f"{config.embedding_model}: {size} dimensions")


async def _mcp(wire: Wire) -> list[Check]:
    wire.timeout = MCP_TIMEOUT  # the daemon starts each server to list its tools
    event = await wire.request({"type": "mcp_servers"})
    if event["type"] == "error":
        return [Check("mcp", False, event["message"])]
    checks = []
    for server in event["servers"]:
        name = f"mcp {server['name']}"
        if server["state"] == "ready":
            checks.append(Check(name, True, f"{len(server['tools'])} tool(s)"))
        else:
            checks.append(Check(name, False, f"{server['state']}: {server['last_error']}; fix [mcp.servers."
                                             f"{server['name']}] in config.toml (try its command in a shell)"))
    return checks


def _local(config: Config, tell: Any) -> None:
    """What this machine has: poppler, ffmpeg, free space where the history is."""
    lacking = [tool for tool in POPPLER if shutil.which(tool) is None]
    tell(Check("poppler", not lacking, f"no {', '.join(lacking)}: scanned PDF pages cannot be rendered; install "
                                       "poppler-utils (make setup does, with apt)" if lacking else "pdftotext, pdftoppm"))
    video = [tool for tool in FFMPEG if shutil.which(tool) is None]
    tell(Check("ffmpeg", not video, f"no {', '.join(video)}: convert cannot work on videos; install ffmpeg (make "
                                    "setup does, with apt)" if video else "ffmpeg, ffprobe"))
    folder = config.data_dir
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    tell(Check("disk", free >= ROOMY_BYTES, f"{free >> 20} MB free at {folder}"
               + ("" if free >= ROOMY_BYTES else ": free some space, or set ASSISTANT_DATA_DIR elsewhere")))


def _http(config: Config, url: str, body: dict[str, Any] | None = None) -> Any:
    """GET (or POST ``body``) as JSON, with the configured key; not through a proxy, as the daemon asks."""
    headers = {"Content-Type": "application/json"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    data = json.dumps(body).encode() if body is not None else None
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(urllib.request.Request(url, data, headers), timeout=HTTP_TIMEOUT) as response:
        return json.loads(response.read())


def _why(exc: OSError) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}"
    reason = getattr(exc, "reason", None) or exc
    return str(getattr(reason, "strerror", None) or reason)

