"""Configuration: defaults, the TOML file, ASSISTANT_* overrides, XDG paths."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from common import SETTINGS, socket_path_problem, unknown_variables
from core import Config, ConfigError, load_config
from core.models import image_cost


def test_defaults(tmp_path: Path) -> None:
    config = load_config({"HOME": str(tmp_path)})
    assert config.router_url == "http://127.0.0.1:8080/v1"
    assert config.kb_top_k == 3
    assert config.compact_at == 0.75
    assert config.model == "" and config.ctx_max == 0
    assert config.embeddings_base == config.router_url
    assert config.data_dir == tmp_path / ".local" / "share" / "assistant"
    assert config.db_path == config.data_dir / "history.db"
    assert config.socket_path == Path(f"/tmp/assistant-{os.getuid()}/assistant.sock")


def test_xdg_paths(tmp_path: Path) -> None:
    config = load_config({
        "HOME": str(tmp_path), "XDG_RUNTIME_DIR": "/run/user/1000", "XDG_DATA_HOME": str(tmp_path / "d"),
    })
    assert config.socket_path == Path("/run/user/1000/assistant.sock")
    assert config.data_dir == tmp_path / "d" / "assistant"


def test_explicit_paths_win(tmp_path: Path) -> None:
    config = load_config({
        "HOME": str(tmp_path), "XDG_RUNTIME_DIR": "/run/user/1000",
        "ASSISTANT_SOCKET": "/tmp/x.sock", "ASSISTANT_DATA_DIR": str(tmp_path / "data"),
    })
    assert config.socket_path == Path("/tmp/x.sock")
    assert config.data_dir == tmp_path / "data"


def test_file_then_environment(tmp_path: Path) -> None:
    (tmp_path / "assistant").mkdir()
    (tmp_path / "assistant" / "config.toml").write_text(
        'router_url = "http://10.0.0.2:9000/v1/"\nmodel = "qwen"\nkb_top_k = 5\ncompact_at = 0.6\n'
        'system_prompt = """Be brief."""\nembedding_model = "nomic"\n'
    )
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path), "ASSISTANT_KB_TOP_K": "7",
           "ASSISTANT_AUTO_TITLE": "no", "ASSISTANT_EMBEDDING_URL": "http://127.0.0.1:9999/v1"}
    config = load_config(env)
    assert config.router_url == "http://10.0.0.2:9000/v1"  # trailing slash dropped
    assert config.model == "qwen" and config.system_prompt == "Be brief."
    assert config.kb_top_k == 7  # the environment wins over the file
    assert config.compact_at == 0.6
    assert config.auto_title is False
    assert config.embeddings_base == "http://127.0.0.1:9999/v1"
    assert config.config_path == tmp_path / "assistant" / "config.toml"


@pytest.mark.parametrize(
    "env, words",
    [
        ({"ASSISTANT_KB_TOP_K": "three"}, "kb_top_k must be an int"),
        ({"ASSISTANT_COMPACT_AT": "2"}, "compact_at must be between"),
        ({"ASSISTANT_ROUTER_URL": "localhost:8080"}, "must start with http"),
        ({"ASSISTANT_REQUEST_TIMEOUT": "0"}, "positive number"),
        ({"ASSISTANT_AUTO_TITLE": "maybe"}, "auto_title must be a bool"),
        ({"ASSISTANT_MEMORY": "maybe"}, 'ASSISTANT_MEMORY: memory must be "on" or "off"'),
        ({"ASSISTANT_MEMORY_TOKENS": "-1"}, "memory_tokens must not be negative"),
        # accepted once, then every ask failed (or the daemon's stop did)
        ({"ASSISTANT_REQUEST_TIMEOUT": "nan"}, "request_timeout must be a float, not 'nan'"),
        ({"ASSISTANT_SHUTDOWN_GRACE": "inf"}, "shutdown_grace must be a float, not 'inf'"),
        ({"ASSISTANT_SHUTDOWN_GRACE": "-1"}, "ASSISTANT_SHUTDOWN_GRACE: shutdown_grace must not be negative"),
        ({"ASSISTANT_ROUTER_URL": "http://127.0.0.1:808o/v1"}, "router_url is not a URL"),
        ({"ASSISTANT_ROUTER_URL": "http://[::1"}, "router_url is not a URL"),
        ({"ASSISTANT_ROUTER_URL": "http://"}, "router_url names no host"),
        ({"ASSISTANT_EMBEDDING_URL": "http//x"}, "embedding_url must start with http"),
        # the OpenAI door serves the history: never beyond this machine
        ({"ASSISTANT_OPENAI_LISTEN": "0.0.0.0:8765"}, "openai_listen must be a loopback address"),
        ({"ASSISTANT_OPENAI_LISTEN": "[::]:8765"}, "openai_listen must be a loopback address"),
        ({"ASSISTANT_OPENAI_LISTEN": "192.168.1.2:80"}, "openai_listen must be a loopback address"),
        ({"ASSISTANT_OPENAI_LISTEN": "example.com:80"}, "openai_listen must be a loopback address"),
        ({"ASSISTANT_OPENAI_LISTEN": "8765"}, "openai_listen must be host:port"),
        ({"ASSISTANT_OPENAI_LISTEN": "127.0.0.1:99999"}, "openai_listen must be host:port"),
        ({"ASSISTANT_OCR_LANGUAGES": "eng, deu"}, 'ocr_languages must be tesseract language codes joined by +, e.g. "eng"'),
    ],
)
def test_bad_values_are_named(tmp_path: Path, env: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"HOME": str(tmp_path), **env})
    assert words in info.value.message


def test_the_openai_door_listens_on_loopback(tmp_path: Path) -> None:
    for listen, address in (("127.0.0.1:8765", ("127.0.0.1", 8765)), ("127.3.4.5:1", ("127.3.4.5", 1)),
                            ("[::1]:8765", ("::1", 8765)), ("localhost:0", ("localhost", 0))):
        config = load_config({"HOME": str(tmp_path), "ASSISTANT_OPENAI_LISTEN": listen})
        assert config.openai_address == address
    assert load_config({"HOME": str(tmp_path)}).openai_address is None


def test_unknown_key_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('routr_url = "http://x"\n')
    with pytest.raises(ConfigError) as info:
        load_config({"HOME": str(tmp_path), "ASSISTANT_CONFIG": str(path)})
    assert "unknown key 'routr_url'" in info.value.message


def test_broken_toml(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("model = \n")
    with pytest.raises(ConfigError) as info:
        load_config({"HOME": str(tmp_path), "ASSISTANT_CONFIG": str(path)})
    assert str(path) in info.value.message


@pytest.mark.parametrize(
    "text, words",
    [
        ('system_prompt = ["be terse"]\n', "system_prompt must be a str, not ['be terse']"),
        ("image_tokens = -5\n", "c.toml: image_tokens must not be negative; fix it and restart"),  # where it is
        ("api_key = true\n", "api_key must be a str, not True"),
        (b'model = "\xff"\n', "cannot read"),  # TOML is UTF-8
    ],
)
def test_a_file_value_of_the_wrong_kind_is_named(tmp_path: Path, text: str | bytes, words: str) -> None:
    path = tmp_path / "c.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as info:
        load_config({"HOME": str(tmp_path), "ASSISTANT_CONFIG": str(path)})
    assert words in info.value.message


def test_models_tables_give_a_model_its_own_image_cost(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('image_tokens = 500\n[models."qwen2.5-vl-7b"]\nimage_tokens = 1200\n'
                    '[models.gemma-3-4b]\nimage_tokens = 256\n')
    config = load_config({"HOME": str(tmp_path), "ASSISTANT_CONFIG": str(path), "ASSISTANT_IMAGE_TOKENS": "600"})
    assert image_cost(config, "qwen2.5-vl-7b") == 1200
    assert image_cost(config, "/models/gemma-3-4b.gguf") == 256  # llama-server's id without --alias
    assert image_cost(config, "llava") == 600  # the environment's image_tokens wins over the file's


@pytest.mark.parametrize(
    "text, words",
    [
        ('models = "qwen"\n', "models must be a table of tables"),
        ("[models]\nqwen = 3\n", '[models."qwen"] must be a table'),
        ('[models.qwen]\nctx_max = 4096\n', "unknown key 'ctx_max' in [models.\"qwen\"]; known keys: image_tokens"),
        ('[models.qwen]\nimage_tokens = "many"\n', 'c.toml [models."qwen"]: image_tokens must be an int, not \'many\''),
        ("[models.qwen]\nimage_tokens = -1\n", 'c.toml [models."qwen"]: image_tokens must not be negative'),
        # a dotted id unquoted is a table in a table
        ("[models.qwen2.5-vl]\nimage_tokens = 9\n", 'quote a model id with dots in it, as in [models."qwen2.5-vl"]'),
        # presets: a new one needs kinds and a prompt; kinds are the presets' own
        ('[presets.haiku]\ntitle = "Haiku"\n', "c.toml [presets.haiku]: a new preset needs kinds and prompt"),
        ('[presets.haiku]\nkinds = ["poem"]\nprompt = "x"\n', "kinds must be a list of some of text, code, pdf, scanned"),
        ('[presets.review]\nprompt = ""\n', "c.toml [presets.review]: prompt must be some text"),
        ('[presets.review]\nsystem = "x"\n', "unknown key 'system'; known keys: title, kinds, prompt"),
        ('[presets."two words"]\nkinds = ["text"]\nprompt = "x"\n', "a preset's name is letters, digits, _ and -"),
    ],
)
def test_a_bad_models_table_is_named(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config({"HOME": str(tmp_path), "ASSISTANT_CONFIG": str(path)})
    assert words in info.value.message


def test_assistant_config_naming_a_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config({"HOME": str(tmp_path), "ASSISTANT_CONFIG": str(tmp_path / "nope.toml")})
    assert str(tmp_path / "nope.toml") in refused.value.message and "unset ASSISTANT_CONFIG" in refused.value.message


def test_an_unknown_variable_is_named_with_the_closest_setting() -> None:
    env = {"ASSISTANT_ROUTERURL": "x", "ASSISTANT_SOCKETT": "y", "ASSISTANT_ROUTER_URL": "z", "ASSISTANT_ZZZZZZZZZZZZZZZZ": "1",
           "ASSISTANT_CACHE_DIR": "/c", "OTHER": "o"}
    warnings = unknown_variables(env)
    assert warnings[0] == "ASSISTANT_ROUTERURL is not a setting and is ignored; did you mean ASSISTANT_ROUTER_URL?"
    assert warnings[1].endswith("did you mean ASSISTANT_SOCKET?")
    assert warnings[2].startswith("ASSISTANT_ZZZZZZZZZZZZZZZZ is not a setting") and "ASSISTANT_MODEL" in warnings[2]
    assert len(warnings) == 3


def test_the_settings_the_client_knows_are_the_configs() -> None:
    """``common.SETTINGS`` (what the client, without ``core``, warns against) names every field
    of ``Config`` a user sets, in its order: a field added to one is added to the other."""
    not_set = ("mcp", "socket_path", "data_dir", "config_path", "model_image_tokens", "model_sampling",
               "presets")  # tables, and the paths
    assert SETTINGS == tuple(f.name for f in dataclasses.fields(Config) if f.name not in not_set)


def test_a_socket_path_too_long_is_named_with_its_size() -> None:
    assert socket_path_problem(Path("/run/user/1000/assistant.sock")) is None
    long = Path("/tmp/" + "x" * 120 + "/a.sock")
    assert socket_path_problem(long) == (
        f"the socket path {long} is 132 bytes, over the 107 a Unix socket allows; "
        "set ASSISTANT_SOCKET to a shorter path"
    )
