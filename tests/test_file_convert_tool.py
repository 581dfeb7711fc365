"""file_convert, the file operations as the model's tool, through the real socket: it names the
conversation's attachments by id, every call waits for a person's approval, and its outputs
are attached to the turn (attachment_recall reads them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from client import Wire, of_type
from selfcheck.fakerouter import FakeRouter, Reply
from tests.media import styled_pdf
from tests.test_mcp_host import call, tool_messages

pytestmark = pytest.mark.asyncio
TOOL = "file_convert"


def offered(request: dict[str, Any]) -> list[str]:
    return [tool["function"]["name"] for tool in request.get("tools", [])]


async def attached_pdf(wire: Wire, router: FakeRouter, folder: Path) -> Path:
    """A conversation (1) whose first turn attached a report (attachment 1)."""
    pdf = styled_pdf(folder / "report.pdf", [[(24, "Annual Report"), (12, "It went well.")]])
    router.script(Reply(text="a report"))
    assert (await wire.ask("what is this?", files=[str(pdf)]))[-1]["type"] == "done"
    return pdf


async def test_a_call_runs_once_approved_and_its_output_is_recallable(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    pdf = await attached_pdf(wire, router, tmp_path)
    assert TOOL in offered(router.requests[-1])
    router.script(call(TOOL, {"operation": "pdf_to_markdown", "attachments": [1]}), Reply(text="made it"))
    rid = await wire.send({"type": "ask", "text": "make it markdown", "conversation": 1})
    asked = (await wire.until(rid, ("approval", "done", "error")))[-1]
    assert asked["type"] == "approval" and asked["name"] == TOOL and asked["server"] is None
    assert asked["arguments"] == {"operation": "pdf_to_markdown", "attachments": [1]}
    assert not (tmp_path / "report.md").exists()  # nothing runs before the answer
    await wire.request({"type": "approve", "conversation": 1, "call": asked["call"], "allow": True})
    events = await wire.until(rid)
    [tool] = of_type(events, "tool")
    assert tool["ok"] and tool["summary"] == "pdf_to_markdown: wrote report.md", tool
    assert (tmp_path / "report.md").read_text() == "# Annual Report\n\nIt went well.\n"
    result = json.loads(tool_messages(router.requests[-1])[-1]["content"])
    assert result["outputs"] == [{"id": 2, "filename": "report.md", "path": str(tmp_path / "report.md"),
                                  "size_bytes": (tmp_path / "report.md").stat().st_size, "kind": "markdown"}]

    router.script(call("attachment_recall", {"action": "read", "attachment_id": 2}), Reply(text="read"))
    await wire.ask("read it back", conversation=1)
    read = json.loads(tool_messages(router.requests[-1])[-1]["content"])
    assert "# Annual Report" in json.dumps(read), read
    assert pdf.exists()


async def test_a_denied_call_writes_nothing_and_bad_ids_are_told(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    await attached_pdf(wire, router, tmp_path)
    router.script(call(TOOL, {"operation": "pdf_to_markdown", "attachments": [1]}), Reply(text="as you wish"))
    rid = await wire.send({"type": "ask", "text": "convert", "conversation": 1})
    asked = (await wire.until(rid, ("approval", "done", "error")))[-1]
    await wire.request({"type": "approve", "conversation": 1, "call": asked["call"], "allow": False})
    [tool] = of_type(await wire.until(rid), "tool")
    assert not tool["ok"] and sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".md") == []

    router.script(call(TOOL, {"operation": "pdf_to_markdown", "attachments": [7]}), Reply(text="sorry"))
    rid = await wire.send({"type": "ask", "text": "convert 7", "conversation": 1})
    asked = (await wire.until(rid, ("approval", "done", "error")))[-1]
    await wire.request({"type": "approve", "conversation": 1, "call": asked["call"], "allow": True})
    [tool] = of_type(await wire.until(rid), "tool")
    told = tool_messages(router.requests[-1])[-1]["content"]
    assert not tool["ok"] and "this conversation has no attachment 7" in told, told


async def test_it_is_offered_only_with_a_file_it_takes(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    router.script(Reply(text="hi"))
    await wire.ask("hello")
    assert TOOL not in offered(router.requests[-1])
    notes = tmp_path / "notes.txt"
    notes.write_text("a text file: nothing to convert")
    router.script(Reply(text="ok"))
    await wire.ask("read", files=[str(notes)], conversation=1)
    assert "attachment_recall" in offered(router.requests[-1]) and TOOL not in offered(router.requests[-1])
