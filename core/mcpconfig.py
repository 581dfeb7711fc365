"""The ``[mcp]`` table of config.toml: the MCP servers the daemon hosts, and their limits.

    [mcp]
    default = ["files"]        # servers a conversation uses unless its settings say (absent: all)
    call_timeout = 60          # seconds one tool call may take
    start_timeout = 20         # seconds a server may take to start and list its tools
    max_result_chars = 100000  # the most text one call's result brings back
    tools_share = 0.25         # the share of the context MCP tool descriptions may take

    [mcp.servers.files]        # stdio: the daemon runs it as a child process
    command = "npx"
    args = ["-y", "@modelcontextprotocol/server-filesystem", "/home/me/notes"]
    env = { "DEBUG" = "0" }
    cwd = "/home/me"

    approval = "ask"           # ask before its acting tools run ("auto": never ask)
    auto_approve = ["list_directory"]   # run these at once, whatever their annotations say
    always_ask = ["read_file"]          # ask for these, whatever their annotations say

    [mcp.servers.web]          # streamable HTTP
    url = "http://127.0.0.1:8931/mcp"
    headers = { "Authorization" = "Bearer ..." }

A server name becomes the prefix of its tools' names (``files__read_file``), so it is
kept to what OpenAI function names allow and never holds ``__`` (docs/DESIGN.md, "MCP").
A server runs as the user; a tool of it that may act (any tool its server does not annotate
``readOnlyHint: true``) runs only once a person allows it, unless the server is ``approval =
"auto"`` or names it in ``auto_approve`` (``McpServerSpec.asks``; docs/DESIGN.md, "Approval").
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["McpServerSpec", "McpSettings", "parse_mcp"]

SERVER_NAME = re.compile(r"^[A-Za-z0-9]+(?:[-_][A-Za-z0-9]+)*$")  # no "__": it separates server and tool
MAX_SERVER_NAME = 24  # leaves 38 of the 64 characters of a function name to the tool's own name
STDIO_KEYS = {"command", "args", "env", "cwd"}
HTTP_KEYS = {"url", "headers"}
APPROVAL_KEYS = {"approval", "auto_approve", "always_ask"}  # either transport
APPROVAL_MODES = ("ask", "auto")
SETTINGS = {"default", "call_timeout", "start_timeout", "max_result_chars", "tools_share", "servers"}


def _error(source: str, message: str) -> ValueError:
    """What is wrong, for ``core.config`` to raise as its ``ConfigError``."""
    return ValueError(f"{source}: {message}; fix it and restart")


@dataclass(frozen=True)
class McpServerSpec:
    """One configured MCP server: a command to run (stdio) or a URL (streamable HTTP)."""

    name: str
    command: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    url: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    approval: str = "ask"  # "auto": its tools run without asking
    auto_approve: tuple[str, ...] = ()  # tools (their names on the server) run without asking
    always_ask: tuple[str, ...] = ()  # tools asked about even when annotated read-only

    @property
    def transport(self) -> str:
        return "http" if self.url else "stdio"

    def asks(self, tool: str, read_only: bool) -> bool:
        """Whether a call of ``tool`` waits for a person's approval: the lists first, then the
        server's ``approval``, then the tool's own ``readOnlyHint``."""
        if tool in self.always_ask:
            return True
        if tool in self.auto_approve or self.approval == "auto":
            return False
        return not read_only


@dataclass(frozen=True)
class McpSettings:
    """The ``[mcp]`` table; no servers means no MCP at all (the SDK is never loaded)."""

    servers: tuple[McpServerSpec, ...] = ()
    default: tuple[str, ...] | None = None  # None: every configured server
    call_timeout: float = 60.0
    start_timeout: float = 20.0
    max_result_chars: int = 100_000
    tools_share: float = 0.25

    def server(self, name: str) -> McpServerSpec | None:
        return next((s for s in self.servers if s.name == name), None)

    def chosen(self, setting: Any) -> tuple[str, ...]:
        """The servers a conversation uses: its ``mcp_servers`` setting (a list of names, unknown
        ones ignored), else the default."""
        known = [s.name for s in self.servers]
        if isinstance(setting, list):
            return tuple(sorted(n for n in known if n in setting))
        if self.default is None:
            return tuple(sorted(known))
        return tuple(sorted(n for n in known if n in self.default))


def _strings(value: Any, what: str, source: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _error(source, f"{what} must be a list of strings")
    return tuple(value)


def _pairs(value: Any, what: str, source: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise _error(source, f"{what} must be a table of strings")
    return tuple(sorted(value.items()))


def _server(name: str, table: Any, source: str) -> McpServerSpec:
    where = f"[mcp.servers.{name}]"
    if not SERVER_NAME.fullmatch(name) or len(name) > MAX_SERVER_NAME:
        raise _error(source, f"{where}: a server name is letters and digits, single - or _ between them, "
                             f"at most {MAX_SERVER_NAME} characters")
    if not isinstance(table, dict):
        raise _error(source, f"{where} must be a table")
    unknown = set(table) - STDIO_KEYS - HTTP_KEYS - APPROVAL_KEYS
    if unknown:
        raise _error(source, f"{where}: unknown key(s) {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(sorted(STDIO_KEYS | HTTP_KEYS | APPROVAL_KEYS))}")
    approval = _approval(table, where, source)
    command, url = table.get("command"), table.get("url")
    if (command is None) == (url is None):
        raise _error(source, f"{where} needs either command (a program to run) or url (streamable HTTP)")
    if url is not None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise _error(source, f"{where}: url must start with http:// or https://")
        if set(table) & STDIO_KEYS:
            raise _error(source, f"{where}: command, args, env and cwd are for stdio servers, not a url")
        return McpServerSpec(name, url=url, headers=_pairs(table.get("headers", {}), f"{where} headers", source),
                             **approval)
    if not isinstance(command, str) or not command:
        raise _error(source, f"{where}: command must be a program name or path")
    if "headers" in table:
        raise _error(source, f"{where}: headers are for url servers")
    cwd = table.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise _error(source, f"{where}: cwd must be a folder path")
    if cwd is not None:
        cwd = os.path.expanduser(cwd)  # as a shell would: the file is the user's
    return McpServerSpec(
        name, command=command, args=_strings(table.get("args", []), f"{where} args", source),
        env=_pairs(table.get("env", {}), f"{where} env", source), cwd=cwd, **approval,
    )


def _approval(table: dict[str, Any], where: str, source: str) -> dict[str, Any]:
    """A server's ``approval``, ``auto_approve`` and ``always_ask``, as ``McpServerSpec`` fields."""
    mode = table.get("approval", "ask")
    if mode not in APPROVAL_MODES:
        raise _error(source, f'{where}: approval must be "ask" (ask before acting tools run) or "auto" (never ask)')
    auto = _strings(table.get("auto_approve", []), f"{where} auto_approve", source)
    ask = _strings(table.get("always_ask", []), f"{where} always_ask", source)
    if both := sorted(set(auto) & set(ask)):
        raise _error(source, f"{where}: {', '.join(both)} is in both auto_approve and always_ask; keep one")
    return {"approval": mode, "auto_approve": auto, "always_ask": ask}


def _number(table: dict[str, Any], key: str, default: float, low: float, high: float, source: str) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise _error(source, f"[mcp] {key} must be a number from {low:g} to {high:g}")
    return float(value)


def parse_mcp(table: Any, source: str) -> McpSettings:
    """The ``[mcp]`` table as settings; ``ValueError`` naming what is wrong."""
    if not isinstance(table, dict):
        raise _error(source, "mcp must be a table ([mcp] and [mcp.servers.NAME])")
    unknown = set(table) - SETTINGS
    if unknown:
        raise _error(source, f"[mcp]: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(SETTINGS))}")
    servers_table = table.get("servers", {})
    if not isinstance(servers_table, dict):
        raise _error(source, "[mcp.servers.NAME] tables hold the servers")
    servers = tuple(_server(name, spec, source) for name, spec in sorted(servers_table.items()))
    default = table.get("default")
    if default is not None:
        default = _strings(default, "[mcp] default", source)
        missing = [n for n in default if n not in servers_table]
        if missing:
            raise _error(source, f"[mcp] default names servers not configured: {', '.join(missing)}")
    return McpSettings(
        servers=servers,
        default=default,
        call_timeout=_number(table, "call_timeout", McpSettings.call_timeout, 0.1, 3600, source),
        start_timeout=_number(table, "start_timeout", McpSettings.start_timeout, 0.1, 600, source),
        max_result_chars=int(_number(table, "max_result_chars", McpSettings.max_result_chars, 1000, 10**7, source)),
        tools_share=_number(table, "tools_share", McpSettings.tools_share, 0.0, 0.9, source),
    )
