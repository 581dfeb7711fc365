"""Recall through a real tool-calling model (issues 33 and 49), one conversation of each kind.

Each test runs a scripted conversation from ``scenarios.py`` through the daemon's socket
against llama-server with Qwen2.5-Coder-1.5B, and asserts that the answer holds the
needle and that it got there the way the kind means: for the recall kinds, the daemon
recalled the folded-away passage before the question (the model may still call a tool);
for the others, the model called the tool, or no tool at all. The long past is stored
through the store, not written by the model: each scenario is at most three requests.
``bench/bench_recall.py`` runs many of each and counts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from client import Wire
from core import Config
from tests.e2e_tools import scenarios

pytestmark = pytest.mark.asyncio


@pytest.fixture
def mcp_hosted(tmp_path: Path) -> Path:
    """config.toml with the test MCP server; written before ``config`` reads it."""
    return scenarios.mcp_config(tmp_path / "config")


async def check(kind: str, wire: Wire, config: Config, tmp_path: Path) -> scenarios.Run:
    run = await scenarios.SCENARIOS[kind](wire, 1, tmp_path, config.db_path)
    print(json.dumps(run.to_json()))  # what the model did, for the log (-s)
    assert run.found, run.to_json()
    if kind in scenarios.EXPECTED_RECALL:
        assert run.compacted, run.to_json()
        assert any(label.endswith(scenarios.EXPECTED_RECALL[kind]) for label in run.recalled), run.to_json()
        return run
    expected = scenarios.EXPECTED_TOOL[kind]
    if expected is None:
        assert run.tools == [] and run.recalled == [], run.to_json()
    else:
        assert expected in run.tools, run.to_json()
    return run


async def test_a_fact_folded_away_40_turns_back_is_recalled(wire: Wire, config: Config, tmp_path: Path) -> None:
    await check("recall", wire, config, tmp_path)


async def test_a_page_of_a_file_folded_away_is_recalled(wire: Wire, config: Config, tmp_path: Path) -> None:
    await check("file", wire, config, tmp_path)


async def test_a_three_word_follow_up_finds_what_it_refers_to(wire: Wire, config: Config, tmp_path: Path) -> None:
    await check("followup", wire, config, tmp_path)


async def test_a_knowledge_base_fact_is_found_with_kb_search(wire: Wire, config: Config, tmp_path: Path) -> None:
    await check("kb", wire, config, tmp_path)


async def test_a_hosted_mcp_tool_is_called(mcp_hosted: Path, wire: Wire, config: Config, tmp_path: Path) -> None:
    await check("mcp", wire, config, tmp_path)


async def test_a_question_that_needs_nothing_gets_no_tool_and_no_passage(
    wire: Wire, config: Config, tmp_path: Path
) -> None:
    await check("none", wire, config, tmp_path)
