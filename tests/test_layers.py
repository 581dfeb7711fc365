"""The packages form floors: each imports only the floors below it, and nothing imports the daemon.

    assistant.py -> daemon -> {attachments, recall, kbinject} -> history -> core
                   daemon -> mcphost -> core;  assistant.py -> mcpserve -> core

with ``recall -> attachments`` and ``kbinject -> attachments`` allowed.  Checked on the
source (every ``import`` statement, including those inside functions and under
``TYPE_CHECKING``), so a cycle cannot hide behind a lazy import.
"""

from __future__ import annotations

import ast
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
    "mcpserve": {"core"},  # `assistant.py mcp ...`: a client of the socket, like daemon/client.py
    "daemon": {"core", "history", "attachments", "recall", "kbinject", "mcphost"},
    "selfcheck": {"core", "daemon"},
}


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
