"""The packages form floors: each imports only the floors below it, and nothing imports the daemon.

    assistant.py -> daemon -> {attachments, recall, kbinject} -> history -> core -> common
                   daemon -> fileops -> attachments (its OCR)
                   fileops runs (as a process) fileworker (nothing of ours)
                   daemon -> mcphost -> core
    assistant.py -> mcpserve -> client -> common
    assistant.py -> doctor -> {client, core.config}

with ``recall -> attachments`` and ``kbinject -> attachments`` allowed; ``common`` (below
every floor) may be imported from any of them. The client stands apart from the daemon:
it imports the standard library and ``common`` alone (the system ``python3`` runs it),
and the daemon never imports it. Checked on the source (every ``import`` statement,
including those inside functions and under ``TYPE_CHECKING``), so a cycle cannot hide
behind a lazy import; and on what a client command loads, run without the venv.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_client import bare_python

ROOT = Path(__file__).resolve().parent.parent
OURS = ("common", "core", "history", "attachments", "fileops", "fileworker", "recall", "kbinject", "mcphost", "daemon", "client", "mcpserve",
        "selfcheck", "doctor")
# what each package may import of ours
ALLOWED = {
    "common": set(),
    "core": {"common"},
    "history": {"common", "core"},
    "attachments": {"common", "core", "history"},
    # the file operations (issue 47): above attachments, whose OCR reads scanned pages
    "fileops": {"common", "core", "history", "attachments"},
    # what the file operations do in a worker process: nothing of ours, so the worker starts light
    "fileworker": set(),
    "recall": {"common", "core", "history", "attachments"},
    "kbinject": {"common", "core", "history", "attachments"},
    "mcphost": {"common", "core"},  # the MCP host: the daemon's, on the ground floor alone
    "daemon": {"common", "core", "history", "attachments", "fileops", "recall", "kbinject", "mcphost"},
    # the command line and the socket client: standard library and common only (test below)
    "client": {"common"},
    # `assistant.py mcp ...`: a client of the socket, made of the client's own parts
    "mcpserve": {"common", "client"},
    # `assistant.py doctor`: a client, and the configuration read as the daemon reads it
    "doctor": {"common", "client", "core"},
    "selfcheck": {"common", "core", "daemon", "client"},
}
DAEMON_SIDE = ("core", "history", "attachments", "fileops", "fileworker", "recall", "kbinject", "mcphost", "daemon")
# what a client command may load of ours: the entry point and the client's packages
CLIENT_START = {"__main__", "assistant", "common", "client", "mcpserve"}


def imported(path: Path) -> set[str]:
    """The top-level packages of ours that a module imports."""
    return {name.split(".")[0] for name in _all_imports(path)} & set(OURS)


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_floors_below(package: str) -> None:
    wrong = {
        f"{path.relative_to(ROOT)} imports {other}"
        for path in _modules(package)
        for other in imported(path) - ALLOWED[package] - {package}
    }
    assert not wrong, sorted(wrong)


@pytest.mark.parametrize("package", ["common", "client"])
def test_the_client_and_common_import_the_standard_library_alone(package: str) -> None:
    wrong = sorted(
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _modules(package)
        for name in _all_imports(path)
        if name.split(".")[0] not in sys.stdlib_module_names | ALLOWED[package] | {package}
    )
    assert not wrong, wrong


def test_the_daemon_never_imports_the_client() -> None:
    wrong = sorted(str(path.relative_to(ROOT)) for package in DAEMON_SIDE for path in _modules(package)
                   if "client" in imported(path))
    assert not wrong, wrong


def test_mcpserve_is_a_client_not_the_daemon() -> None:
    found = set().union(*(imported(path) for path in _modules("mcpserve")))
    assert "client" in found and not found & set(DAEMON_SIDE), found


def test_a_client_command_loads_the_standard_library_and_the_client_alone() -> None:
    """A command run as the client runs it (no daemon answers), and ``chat``'s module, on a
    Python without site-packages: everything it loaded is the standard library's or the client's."""
    script = ("import json, sys, assistant, client.chat\n"
              "code = assistant.main(['status', '--socket', '/nonexistent/s.sock'])\n"
              "print(json.dumps([code, sorted({m.split('.')[0] for m in sys.modules} - sys.stdlib_module_names)]))\n")
    done = subprocess.run([*bare_python(), "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    code, loaded = json.loads(done.stdout)
    assert code == 3 and "no daemon answers on /nonexistent/s.sock" in done.stderr, done.stderr
    assert set(loaded) <= CLIENT_START, loaded


def test_the_mcp_commands_load_the_client_side_alone() -> None:
    """``mcp list`` starts as light as any client command: no SDK, nothing of the daemon's."""
    heavy = ("mcp", "mcphost", "httpx", "numpy", "PIL", *DAEMON_SIDE)
    script = ("import json, sys, mcpserve\n"
              f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


@pytest.mark.parametrize("module", ["fileworker.pdfwork", "fileworker.tracking"])
def test_the_file_worker_starts_light(module: str) -> None:
    """A worker process loads of ours only its own package (not ``core``, whose package loads the
    configuration's modules), and no asyncio: its start is part of every PDF merge's time
    (docs/DESIGN.md, "File operations")."""
    script = (f"import json, sys, fileworker.worker, {module}\n"
              "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout))
    assert loaded & set(OURS) == {"fileworker"} and "asyncio" not in loaded, sorted(loaded)


def test_production_code_never_imports_the_tests() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for package in (*ALLOWED, "assistant.py")
        for path in ((ROOT / package).rglob("*.py") if package != "assistant.py" else [ROOT / package])
        if "tests" in {name.split(".")[0] for name in _all_imports(path)}
    ]
    assert not offenders


@functools.cache  # each module is read by its package's test and by the one on the tests
def _all_imports(path: Path) -> frozenset[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return frozenset(names)


def test_no_function_over_60_lines_nor_a_class_over_300() -> None:
    """The house's size rule (issue 43): scripts/sizes.py lists what breaks it."""
    checked = subprocess.run([sys.executable, str(ROOT / "scripts" / "sizes.py")], cwd=ROOT, capture_output=True,
                             text=True)
    assert checked.returncode == 0, checked.stdout
