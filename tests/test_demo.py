"""``make demo``'s long first step, the compile of llama-server (scripts/llama.py): it says how
far it is as it goes, how long it takes on this machine, and what Ctrl-C did."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.test_client import ROOT


def llama(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> ModuleType:
    monkeypatch.setenv("ASSISTANT_CACHE_DIR", str(tmp_path))
    spec = importlib.util.spec_from_file_location("llama_script", ROOT / "scripts" / "llama.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "PROGRESS_EVERY", 0.01)
    return module


def build(percents: str, exit_code: int = 0) -> list[str]:
    """A stand-in for pip's compile: cmake's progress lines, a pause between each."""
    code = (f"import sys, time\nfor p in {percents!r}.split():\n"
            "    print(f'[ {p}%] Building CXX object ggml.o', flush=True); time.sleep(0.1)\n"
            f"sys.exit({exit_code})\n")
    return [sys.executable, "-c", code]


def test_the_compile_says_how_far_it_is_and_how_it_failed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = llama(monkeypatch, tmp_path)
    script._build(build("10 55 100"), {}, 0.0)
    said = capsys.readouterr().err
    assert "llama: compiling: 55% after" in said and "llama: compiling: 100% after" in said
    with pytest.raises(script.LlamaError, match=r"failed \(whole log: .*build.log\):\n.*\[ 7%\] Building"):
        script._build(build("7", exit_code=2), {}, 0.0)


def test_ctrl_c_stops_the_compile_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = llama(monkeypatch, tmp_path)

    class CtrlC:
        """Ctrl-C while the build runs: it lands as the log is looked at."""

        def findall(self, text: bytes) -> list[bytes]:
            raise KeyboardInterrupt

    monkeypatch.setattr(script, "PROGRESS", CtrlC())
    with pytest.raises(KeyboardInterrupt):
        script._build([sys.executable, "-c", "import time; time.sleep(60)"], {}, 0.0)
    assert "llama: compile stopped; `make demo` starts it over" in capsys.readouterr().err


def test_the_estimate_is_for_this_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    script = llama(monkeypatch, tmp_path)
    monkeypatch.setattr(script, "BUILD_JOBS", 4)
    monkeypatch.setattr(script, "_build", lambda cmd, env, started: None)
    with pytest.raises(script.LlamaError):  # the stand-in made no wheel
        script._build_server_wheel()
    assert "about 5 minutes on this machine's 4 core(s)" in capsys.readouterr().err
