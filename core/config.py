"""Configuration: one frozen ``Config`` built once from file and environment.

Sources, later ones winning: the defaults below, ``$XDG_CONFIG_HOME/assistant/
config.toml`` (or ``$ASSISTANT_CONFIG``), then ``ASSISTANT_<KEY>`` for every key.
Paths follow the XDG base directories; see ``socket_path`` and ``data_dir``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import tomllib
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from common import SETTINGS, default_config_path, default_data_dir, default_socket_path

from .errors import AssistantError
from .mcpconfig import McpSettings, parse_mcp
from .presets import BUILTIN_PRESETS, Preset, parse_presets
from .sampling import SAMPLING_KEYS, sampling_problem
from .tokens import DEFAULT_IMAGE_TOKENS

__all__ = ["Config", "ConfigError", "load_config"]

DEFAULT_ROUTER_URL = "http://127.0.0.1:8080/v1"
MEMORY_MODES = ("on", "off")  # the ``memory`` setting, and a conversation's own
OCR_LANGUAGES = re.compile(r"[A-Za-z0-9_]+(\+[A-Za-z0-9_]+)*")  # tesseract's -l: eng, eng+deu, chi_sim


class ConfigError(AssistantError):
    """The configuration file or an ``ASSISTANT_*`` variable is invalid."""

    code = "config_error"


RECALL_MODES = ("auto", "tool_only", "off")  # recall_injection's values (kbinject/archive.py)


@dataclass(frozen=True)
class Config:
    """Every setting of the daemon; see the README's configuration table. The keys a user sets
    are named in ``common.SETTINGS`` too: the client warns of any other variable."""

    router_url: str = DEFAULT_ROUTER_URL
    api_key: str = ""
    model: str = ""  # empty: the router's first model
    system_prompt: str = "You are a helpful assistant running locally on the user's Linux desktop."
    ctx_max: int = 0  # 0: ask the router
    # the context assumed for a model whose server says nothing of it (and has not yet
    # refused a prompt as too long, which teaches us the real size)
    assumed_ctx: int = 4096
    # the most tokens one reply may take; 0: a quarter of the context (docs/DESIGN.md, "Budgets")
    max_reply_tokens: int = 0
    embedding_model: str = ""
    embedding_url: str = ""  # empty: router_url
    kb_top_k: int = 3
    # what a conversation's archive does in its turns unless its settings say otherwise:
    # auto (recalled before the question), tool_only, off (docs/DESIGN.md, "Recall injection")
    recall_injection: str = "auto"
    compact_at: float = 0.75
    request_timeout: float = 300.0  # seconds between two chunks of a reply
    connect_timeout: float = 5.0
    image_tokens: int = DEFAULT_IMAGE_TOKENS  # flat token cost of one image in estimates
    # the [models."<id>"] tables' image_tokens: a model's own image cost (core.models.image_cost)
    model_image_tokens: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # sampling sent with every turn's requests; None: not sent, the server's default (core/sampling.py)
    temperature: float | None = None
    top_p: float | None = None
    # the [models."<id>"] tables' temperature and top_p (core.models.sampling_params)
    model_sampling: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)
    auto_title: bool = True  # ask the model for a title after a conversation's first turn
    shutdown_grace: float = 5.0  # seconds running turns get to finish on SIGTERM
    # seconds a call of an acting tool waits for a person's answer before it is denied
    approval_timeout: float = 120.0
    # the OpenAI-compatible door (daemon/openai/door.py): "host:port" on loopback, "" = off; and
    # the key its clients must send ("" with the door on: one generated under the data folder)
    openai_listen: str = ""
    openai_key: str = ""
    # the most messages one door request may carry: a longer history is refused before it is
    # matched or stored (it costs the daemon memory and time out of all proportion to a turn)
    openai_max_messages: int = 4000
    # the door's open connections at most, and of those the ones yet to show the key (issue 44)
    openai_max_connections: int = 256
    openai_max_unkeyed: int = 32
    # tesseract's languages for scanned pages (attachments/ocr.py), and whether image files are
    # read by OCR for a model without vision (a photo's OCR is noise: off by default)
    ocr_languages: str = "eng"
    ocr_images: bool = False
    # the file operations (fileops/): where outputs go ("" = beside the first input), the seconds
    # one may run, and the bytes its output may take (a GIF: gif_max_bytes, far less)
    output_dir: str = ""
    convert_timeout: float = 600.0
    convert_max_bytes: int = 4 * 1024**3
    gif_max_bytes: int = 50 * 1024**2
    # saved memories in a new conversation's system prompt, memory_save, conversation_search's
    # scope "all" (docs/MEMORY.md): "on" or "off"; and the most tokens of memories one prompt carries
    memory: str = "on"
    memory_tokens: int = 400
    # how far back a watcher reconnecting with `since` is sent what it missed (daemon/live.py)
    watch_journal: int = 10_000
    watch_journal_minutes: float = 10.0
    # the presets the canvas offers for dropped files: built-in, and [presets.NAME] (core/presets.py)
    presets: Mapping[str, Preset] = dataclasses.field(default_factory=lambda: dict(BUILTIN_PRESETS))
    mcp: McpSettings = McpSettings()  # the [mcp] table: servers hosted for the model (core/mcpconfig.py)
    socket_path: Path = Path()
    data_dir: Path = Path()
    config_path: Path | None = None

    @property
    def db_path(self) -> Path:
        return self.data_dir / "history.db"

    @property
    def openai_address(self) -> tuple[str, int] | None:
        """The OpenAI door's host and port (validated at load: ``openai_listen_problem``), None when off."""
        return split_listen(self.openai_listen) if self.openai_listen else None

    @property
    def embeddings_base(self) -> str:
        return self.embedding_url or self.router_url

    def shown(self) -> dict[str, Any]:
        """The settings in effect as the ``config`` request shows them: secrets masked (the
        ``api_key``, a password in a URL; MCP servers by name and transport only, since their
        ``env`` and ``headers`` carry tokens), a default that is not set as ``null``."""
        mcp = self.mcp
        return {
            "router_url": masked_url(self.router_url),
            "api_key": SECRET_MASK if self.api_key else None,
            "model": self.model or None,
            "system_prompt": self.system_prompt,
            "ctx_max": self.ctx_max or None,
            "assumed_ctx": self.assumed_ctx,
            "max_reply_tokens": self.max_reply_tokens or None,
            "compact_at": self.compact_at,
            "image_tokens": self.image_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "models": {  # each [models."ID"] table: what it sets, null for what it leaves to the top level
                name: {"image_tokens": self.model_image_tokens.get(name),
                       "temperature": self.model_sampling.get(name, {}).get("temperature"),
                       "top_p": self.model_sampling.get(name, {}).get("top_p")}
                for name in sorted({*self.model_image_tokens, *self.model_sampling})
            },
            "embedding_model": self.embedding_model or None,
            "embedding_url": masked_url(self.embeddings_base),
            "kb_top_k": self.kb_top_k,
            "recall_injection": self.recall_injection,
            "request_timeout": self.request_timeout,
            "connect_timeout": self.connect_timeout,
            "auto_title": self.auto_title,
            "shutdown_grace": self.shutdown_grace,
            "approval_timeout": self.approval_timeout,
            "openai_listen": self.openai_listen or None,
            "openai_key": SECRET_MASK if self.openai_key else None,
            "openai_max_messages": self.openai_max_messages,
            "openai_max_connections": self.openai_max_connections,
            "openai_max_unkeyed": self.openai_max_unkeyed,
            "ocr_languages": self.ocr_languages,
            "ocr_images": self.ocr_images,
            "output_dir": self.output_dir or None,
            "convert_timeout": self.convert_timeout,
            "convert_max_bytes": self.convert_max_bytes,
            "gif_max_bytes": self.gif_max_bytes,
            "memory": self.memory,
            "memory_tokens": self.memory_tokens,
            "watch_journal": self.watch_journal,
            "watch_journal_minutes": self.watch_journal_minutes,
            "presets": [preset.to_json() for preset in self.presets.values()],
            "mcp": {
                "servers": [{"name": s.name, "transport": s.transport, "approval": s.approval} for s in mcp.servers],
                "default": list(mcp.default) if mcp.default is not None else None,
                "call_timeout": mcp.call_timeout,
                "start_timeout": mcp.start_timeout,
                "max_result_chars": mcp.max_result_chars,
                "tools_share": mcp.tools_share,
            },
            "socket": str(self.socket_path),
            "data_dir": str(self.data_dir),
            "config_path": str(self.config_path) if self.config_path is not None else None,
        }


SECRET_MASK = "********"  # a secret that is set, as shown to a client


def masked_url(url: str) -> str:
    """``url`` with the password of its user part masked (``http://me:********@host/v1``)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username or ''}:{SECRET_MASK}@"
    return urllib.parse.urlunsplit(parts._replace(netloc=user + parts.netloc.rpartition("@")[2]))


MODEL_KEYS = ("image_tokens", *SAMPLING_KEYS)  # what a [models."<id>"] table may set


LOOPBACK_NAMES = ("localhost",)


def split_listen(listen: str) -> tuple[str, int]:
    """``host:port`` (``[::1]:port`` for IPv6) as its host and port; ValueError when it is neither."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit() or int(port) > 65535:
        raise ValueError(listen)
    return host.removeprefix("[").removesuffix("]"), int(port)


def openai_listen_problem(listen: str) -> str | None:
    """What is wrong with an ``openai_listen`` value, or None: it must be a loopback address and
    a port, since anything else would open the user's history to the network."""
    try:
        host, _port = split_listen(listen)
    except ValueError:
        return "must be host:port, such as 127.0.0.1:8765 (or [::1]:8765)"
    if host.lower() in LOOPBACK_NAMES:
        return None
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        return (f"must be a loopback address (127.0.0.0/8, ::1 or localhost), not {host!r}: the door serves "
                "your history to whoever reaches it")
    return None


def _coerce(key: str, value: Any, source: str) -> Any:
    """Turn a TOML or environment value into the field's type, or say what is wrong."""
    kind = float if key in SAMPLING_KEYS else type(getattr(Config, key))  # those default to None: unset
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        if kind in (int, float) and isinstance(value, bool):
            raise ValueError(value)
        if kind is str and not isinstance(value, str):  # a TOML list or number is no text
            raise ValueError(value)
        coerced = kind(value)
        if kind is float and not math.isfinite(coerced):  # "nan" and "inf" read as floats
            raise ValueError(value)
        return coerced
    except (TypeError, ValueError, OverflowError):
        article = "an" if kind is int else "a"
        raise ConfigError(f"{source}: {key} must be {article} {kind.__name__}, not {value!r}; fix it and restart") from None


def _model_tables(tables: Any, source: str) -> tuple[dict[str, int], dict[str, dict[str, float]]]:
    """The ``[models."<id>"]`` tables: each model's ``image_tokens``, and its sampling settings."""
    example = 'e.g. [models."qwen2.5-vl-7b"] with image_tokens = 1200'
    if not isinstance(tables, dict):
        raise ConfigError(f"{source}: models must be a table of tables, one per model id ({example}); fix it and restart")
    costs: dict[str, int] = {}
    sampling: dict[str, dict[str, float]] = {}
    for model, table in tables.items():
        where = f'[models."{model}"]'
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: {where} must be a table ({example}); fix it and restart")
        for key, value in table.items():
            if isinstance(value, dict):  # [models.qwen2.5-vl] is read as models -> qwen2 -> 5-vl
                raise ConfigError(f"{source}: {where} holds a table {key!r}: quote a model id with dots in it, "
                                  f'as in [models."{model}.{key}"]; fix it and restart')
            if key not in MODEL_KEYS:
                raise ConfigError(f"{source}: unknown key {key!r} in {where}; known keys: {', '.join(MODEL_KEYS)}; "
                                  "fix it and restart")
        if "image_tokens" in table:
            cost = _coerce("image_tokens", table["image_tokens"], f"{source} {where}")
            if cost < 0:
                raise ConfigError(f"{source} {where}: image_tokens must not be negative; fix it and restart")
            costs[model] = cost
        for key in SAMPLING_KEYS:
            if key in table:
                value = _coerce(key, table[key], f"{source} {where}")
                if problem := sampling_problem(key, value):
                    raise ConfigError(f"{source} {where}: {key} {problem}; fix it and restart")
                sampling.setdefault(model, {})[key] = value
    return costs, sampling


def _url_problem(url: str) -> str | None:
    """What is wrong with a model server's URL, or None."""
    if not url.startswith(("http://", "https://")):
        return "must start with http:// or https://"
    try:
        parsed = urllib.parse.urlsplit(url)
        parsed.port  # noqa: B018 - raises for a port that is no number, or out of range
    except ValueError as exc:
        return f"is not a URL ({exc})"
    if not parsed.hostname:
        return "names no host"
    return None


def _validate(values: dict[str, Any], sources: dict[str, str]) -> None:
    """Refuse values out of range, naming where each came from (the file, or the variable)."""

    def refuse(key: str, problem: str) -> ConfigError:
        return ConfigError(f"{sources.get(key, 'default')}: {key} {problem}; fix it and restart")

    for key, example in (("router_url", "http://127.0.0.1:8080/v1"), ("embedding_url", "http://127.0.0.1:8081/v1")):
        url = values.get(key, DEFAULT_ROUTER_URL if key == "router_url" else "")
        if url and (problem := _url_problem(url)):
            raise refuse(key, f"{problem}, e.g. {example}")
    compact_at = values.get("compact_at", Config.compact_at)
    if not 0.1 <= compact_at <= 0.95:
        raise refuse("compact_at", "must be between 0.1 and 0.95 (a fraction of the context)")
    for key in ("ctx_max", "kb_top_k", "image_tokens", "max_reply_tokens"):
        if values.get(key, 0) < 0:
            raise refuse(key, "must not be negative")
    if values.get("openai_max_messages", Config.openai_max_messages) < 1:
        raise refuse("openai_max_messages", "must be at least 1 (messages a door request may carry)")
    if values.get("recall_injection", Config.recall_injection) not in RECALL_MODES:
        raise refuse("recall_injection", f"must be one of {', '.join(RECALL_MODES)}")
    if values.get("assumed_ctx", Config.assumed_ctx) < 512:
        raise refuse("assumed_ctx", "must be at least 512 tokens")
    for key in ("convert_max_bytes", "gif_max_bytes"):
        if values.get(key, 1) <= 0:
            raise refuse(key, "must be a positive number of bytes")
    output_dir = values.get("output_dir", "")
    if output_dir and not Path(output_dir).expanduser().is_absolute():
        raise refuse("output_dir", "must be an absolute folder (or empty: beside the first input)")
    for key in ("request_timeout", "connect_timeout", "approval_timeout", "convert_timeout"):
        if values.get(key, 1.0) <= 0:
            raise refuse(key, "must be a positive number of seconds")
    for key in ("watch_journal", "watch_journal_minutes"):
        if values.get(key, 0) < 0:
            raise refuse(key, "must not be negative (0: a reconnecting watcher is told it missed changes)")
    if values.get("shutdown_grace", 0.0) < 0:
        raise refuse("shutdown_grace", "must not be negative (seconds)")
    if not OCR_LANGUAGES.fullmatch(values.get("ocr_languages", Config.ocr_languages)):
        raise refuse("ocr_languages", 'must be tesseract language codes joined by +, e.g. "eng" or "eng+deu"')
    for key in SAMPLING_KEYS:
        if values.get(key) is not None and (problem := sampling_problem(key, values[key])):
            raise refuse(key, problem)
    for key in ("openai_max_connections", "openai_max_unkeyed"):
        if values.get(key, 1) < 1:
            raise refuse(key, "must be at least 1 (connections)")
    if values.get("openai_listen") and (problem := openai_listen_problem(values["openai_listen"])):
        raise refuse("openai_listen", problem)
    if values.get("memory", Config.memory) not in MEMORY_MODES:
        raise refuse("memory", 'must be "on" or "off"')
    if values.get("memory_tokens", Config.memory_tokens) < 0:
        raise refuse("memory_tokens", "must not be negative (0: no memories in the prompt)")


def load_config(env: Mapping[str, str] | None = None) -> Config:
    """Build the configuration from the TOML file and ``ASSISTANT_*`` variables."""
    env = os.environ if env is None else env
    path = default_config_path(env)
    if env.get("ASSISTANT_CONFIG") and not path.is_file():
        raise ConfigError(
            f"ASSISTANT_CONFIG names {path}, which is not a file; create it, or unset ASSISTANT_CONFIG "
            "to use the default place"
        )
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}  # where each value came from, for the refusals
    if path.is_file():
        try:
            with path.open("rb") as fh:
                table = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:  # TOML is UTF-8
            raise ConfigError(f"cannot read {path}: {exc}; fix the file or move it away") from exc
        if "mcp" in table:  # a table of its own, not overridable from the environment
            try:
                values["mcp"] = parse_mcp(table.pop("mcp"), str(path))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if "models" in table:  # per-model tables, file only like [mcp]
            values["model_image_tokens"], values["model_sampling"] = _model_tables(table.pop("models"), str(path))
        if "presets" in table:  # file only too
            try:
                values["presets"] = parse_presets(table.pop("presets"), str(path))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        for key, value in table.items():
            if key not in SETTINGS:
                raise ConfigError(f"{path}: unknown key {key!r}; known keys: {', '.join(SETTINGS)}, [mcp], [models], [presets]")
            values[key], sources[key] = _coerce(key, value, str(path)), str(path)
    for key in SETTINGS:
        var = f"ASSISTANT_{key.upper()}"
        if var in env:
            values[key], sources[key] = _coerce(key, env[var], var), var
    _validate(values, sources)
    if "router_url" in values:
        values["router_url"] = values["router_url"].rstrip("/")
    return Config(
        **values,
        socket_path=default_socket_path(env),
        data_dir=default_data_dir(env),
        config_path=path if path.is_file() else None,
    )
