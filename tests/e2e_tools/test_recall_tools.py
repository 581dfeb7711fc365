"""Recall through a real tool-calling model (issue 33), one conversation of each kind.

Each test runs a scripted conversation from ``scenarios.py`` through the daemon's socket
against llama-server with Qwen2.5-Coder-1.5B, and asserts that the answer holds the
needle and that the model got it the way the kind means: by calling the tool (and, for
the recall kinds, after a compaction folded the needle away), or with no tool at all.
``bench/bench_recall.py`` runs many of each and counts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from client import Wire
from tests.e2e_tools import scenarios

pytestmark = pytest.mark.asyncio


@pytest.fixture
def mcp_hosted(tmp_path: Path) -> Path:
    """config.toml with the test MCP server; written before ``config`` reads it."""
    return scenarios.mcp_config(tmp_path / "config")


async def check(kind: str, wire: Wire, tmp_path: Path) -> scenarios.Run:
    run = await scenarios.SCENARIOS[kind](wire, 1, tmp_path)
    print(json.dumps(run.to_json()))  # what the model did, for the log (-s)
    assert run.found, run.to_json()
    expected = scenarios.EXPECTED_TOOL[kind]
    if expected is None:
        assert run.tools == [], run.to_json()
    else:
        assert expected in run.tools, run.to_json()
    return run


async def test_a_fact_folded_away_is_found_with_conversation_search(wire: Wire, tmp_path: Path) -> None:
    run = await check("recall", wire, tmp_path)
    assert run.compacted and len(run.turn_seconds) > scenarios.MIN_TURNS_BACK


async def test_a_file_attached_before_a_compaction_is_read_again(wire: Wire, tmp_path: Path) -> None:
    run = await check("file", wire, tmp_path)
    assert run.compacted and len(run.turn_seconds) > scenarios.FILE_TURNS_BACK


async def test_a_knowledge_base_fact_is_found_with_kb_search(wire: Wire, tmp_path: Path) -> None:
    await check("kb", wire, tmp_path)


async def test_a_hosted_mcp_tool_is_called(mcp_hosted: Path, wire: Wire, tmp_path: Path) -> None:
    await check("mcp", wire, tmp_path)


async def test_a_question_that_needs_no_tool_gets_none(wire: Wire, tmp_path: Path) -> None:
    await check("none", wire, tmp_path)
