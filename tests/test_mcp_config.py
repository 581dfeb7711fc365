"""The [mcp] table of config.toml, and the names hosted tools are offered under."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core import ConfigError, load_config
from mcphost import offered_names

FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


def load(tmp_path: Path, text: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "config.toml"
    path.write_text(text)
    return load_config({"HOME": str(tmp_path), "ASSISTANT_CONFIG": str(path)})


def test_servers_of_both_transports_and_the_limits(tmp_path: Path) -> None:
    config = load(tmp_path, """
        [mcp]
        default = ["files"]
        call_timeout = 5
        tools_share = 0.1
        [mcp.servers.files]
        command = "npx"
        args = ["-y", "server-filesystem", "/home/me"]
        env = { DEBUG = "1" }
        cwd = "/home/me"
        [mcp.servers.web-search]
        url = "http://127.0.0.1:8931/mcp"
        headers = { Authorization = "Bearer x" }
    """)
    files, web = config.mcp.servers
    assert (files.name, files.transport, files.args, files.env, files.cwd) == (
        "files", "stdio", ("-y", "server-filesystem", "/home/me"), (("DEBUG", "1"),), "/home/me")
    assert (web.name, web.transport, web.headers) == ("web-search", "http", (("Authorization", "Bearer x"),))
    assert config.mcp.call_timeout == 5 and config.mcp.tools_share == 0.1
    assert config.mcp.chosen(None) == ("files",)  # the default
    assert config.mcp.chosen(["web-search", "gone"]) == ("web-search",)  # unknown names ignored
    assert config.mcp.chosen([]) == ()


def test_a_folder_from_home_is_the_users(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    [spec] = load(tmp_path, '[mcp.servers.x]\ncommand = "a"\ncwd = "~/notes"\n').mcp.servers
    assert spec.cwd == str(tmp_path / "notes")


def test_no_table_no_servers_and_every_server_by_default(tmp_path: Path) -> None:
    assert load(tmp_path, "").mcp.servers == ()
    config = load(tmp_path, '[mcp.servers.b]\ncommand = "b"\n[mcp.servers.a]\ncommand = "a"\n')
    assert config.mcp.chosen(None) == ("a", "b")


@pytest.mark.parametrize(
    "text, words",
    [
        ('[mcp.servers."two__parts"]\ncommand = "x"\n', "a server name is"),
        ('[mcp.servers."files\\n"]\ncommand = "x"\n', "a server name is"),  # a newline after it
        ('[mcp.servers.x]\nargs = ["a"]\n', "needs either command"),
        ('[mcp.servers.x]\ncommand = "a"\nurl = "http://h"\n', "needs either command"),
        ('[mcp.servers.x]\nurl = "ftp://h"\n', "url must start"),
        ('[mcp.servers.x]\nurl = "http://h"\ncwd = "/"\n', "are for stdio servers"),
        ('[mcp.servers.x]\ncommand = "a"\nport = 3\n', "unknown key(s) port"),
        ('[mcp.servers.x]\ncommand = "a"\nargs = "-v"\n', "args must be a list of strings"),
        ('[mcp]\ndefault = ["nope"]\n[mcp.servers.x]\ncommand = "a"\n', "not configured: nope"),
        ('[mcp]\ncall_timeout = 0\n', "call_timeout must be a number"),
        ('[mcp]\ntools_share = true\n', "tools_share must be a number"),
        ('[mcp]\nservers_list = 1\n', "unknown key(s) servers_list"),
        ('mcp = 3\n', "mcp must be a table"),
    ],
)
def test_a_bad_table_is_a_config_error_saying_what_to_fix(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text)
    assert words in caught.value.message and caught.value.code == "config_error"


def test_offered_names_are_valid_distinct_and_stable() -> None:
    long = "read_" + "very_" * 20 + "long_name"
    tools = ["read.file", "read_file", "search", long, long + "2", "ünïcode tool", ""]
    names = offered_names("files", tools)
    assert all(FUNCTION_NAME.match(name) for name in names.values()), names
    assert len(set(names.values())) == len(tools)
    assert names["search"] == "files__search"  # a valid name is kept as it is
    assert all(name.startswith("files__") for name in names.values())
    assert offered_names("files", list(reversed(tools))) == names  # independent of the server's order
