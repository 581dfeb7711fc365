"""The packages form floors: each imports only the floors below it, and nothing imports the daemon.

    assistant.py -> daemon -> {attachments, recall, kbinject} -> history -> core
                   daemon -> mcphost -> core;  assistant.py -> mcpserve -> daemon's client -> core

with ``recall -> attachments`` and ``kbinject -> attachments`` allowed.  Checked on the
source (every ``import`` statement, including those inside functions and under
``TYPE_CHECKING``), so a cycle cannot hide behind a lazy import.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("core", "history", "attachments", "recall", "kbinject", "mcphost", "mcpserve", "daemon", "selfcheck")
# what each package may import of ours
ALLOWED = {
    "core": set(),
    "history": {"core"},
    "attachments": {"core", "history"},
    "recall": {"core", "history", "attachments"},
    "kbinject": {"core", "history", "attachments"},
    "mcphost": {"core"},  # the MCP host: the daemon's, on the ground floor alone
    # `assistant.py mcp ...`: a client of the socket, made of the client's own parts (CLIENT_SIDE:
    # standard library and core only), never the daemon's server
    "mcpserve": {"core", "daemon"},
    "daemon": {"core", "history", "attachments", "recall", "kbinject", "mcphost"},
    "selfcheck": {"core", "daemon"},
}
CLIENT_SIDE = ("daemon.client", "daemon.cli")  # what mcpserve may import of the daemon package


def imported(path: Path) -> set[str]:
    """The top-level packages of ours that a module imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(name.split(".")[0] for name in names if name.split(".")[0] in OURS)
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_floors_below(package: str) -> None:
    wrong = {
        f"{path.relative_to(ROOT)} imports {other}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for other in imported(path) - ALLOWED[package] - {package}
    }
    assert not wrong, sorted(wrong)


def test_mcpserve_imports_only_the_client_side_of_the_daemon_package() -> None:
    wrong = sorted(
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "mcpserve").rglob("*.py"))
        for name in _all_imports(path)
        if name.split(".")[0] == "daemon" and not any(name == m or name.startswith(m + ".") for m in CLIENT_SIDE)
    )
    assert not wrong, wrong


def test_the_mcp_commands_load_the_client_side_alone() -> None:
    """``mcp list`` starts as light as any client command: no SDK, nothing of the daemon's server."""
    script = ("import json, sys, mcpserve; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
              "('mcp', 'mcphost', 'httpx', 'numpy', 'PIL', 'history', 'daemon'))))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    assert loaded and all(m == "daemon" or m.startswith(("daemon.client", "daemon.cli")) for m in loaded), loaded


def test_production_code_never_imports_the_tests() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for package in (*ALLOWED, "assistant.py")
        for path in ((ROOT / package).rglob("*.py") if package != "assistant.py" else [ROOT / package])
        if "tests" in {name.split(".")[0] for name in _all_imports(path)}
    ]
    assert not offenders


def _all_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names
