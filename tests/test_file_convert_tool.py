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
from tests.media import duration, make_clip, styled_pdf
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


async def test_a_merged_pdf_is_read_as_a_pdf_on_a_question_is(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    pdf = await attached_pdf(wire, router, tmp_path)  # attachment 1
    second = styled_pdf(tmp_path / "annex.pdf", [[(12, "The annex lists the spare parts.")]])
    router.script(Reply(text="an annex"))
    assert (await wire.ask("and this?", files=[str(second)], conversation=1))[-1]["type"] == "done"
    router.script(call(TOOL, {"operation": "pdf_merge", "attachments": [1, 2]}), Reply(text="merged"))
    rid = await wire.send({"type": "ask", "text": "merge them", "conversation": 1})
    asked = (await wire.until(rid, ("approval", "done", "error")))[-1]
    await wire.request({"type": "approve", "conversation": 1, "call": asked["call"], "allow": True})
    [tool] = of_type(await wire.until(rid), "tool")
    assert tool["ok"], tool
    [output] = json.loads(tool_messages(router.requests[-1])[-1]["content"])["outputs"]
    router.script(call("attachment_recall", {"action": "read", "attachment_id": output["id"]}), Reply(text="read"))
    await wire.ask("read the merged one", conversation=1)
    read = json.loads(tool_messages(router.requests[-1])[-1]["content"])
    assert "It went well." in read["content"] and "spare parts" in read["content"], read
    assert "no text layer" not in json.dumps(read) and pdf.exists()


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


def user_text(request: dict[str, Any]) -> str:
    """The text of the last user message the router received."""
    content = [m for m in request["messages"] if m["role"] == "user"][-1]["content"]
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content if p["type"] == "text")


async def test_a_video_on_a_question_is_named_to_the_model_and_converted_by_it(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    """A video is attached, never read into the prompt: a chip with its facts and one line naming
    it and its attachment id; then file_convert takes it, once approved, and attaches its sound."""
    clip = make_clip(tmp_path / "clip.mp4")
    router.script(Reply(text="a clip"))
    events = await wire.ask("what is this?", files=[str(clip)])
    [user] = of_type(events, "user")
    assert user["files"] == [{"name": "clip.mp4", "kind": "video", "truncated": False, "path": str(clip),
                              "size": clip.stat().st_size, "sha256": None, "duration": 2.0, "width": 160,
                              "height": 120}]
    sent = user_text(router.requests[-1])
    assert sent.startswith("what is this?\n\n--- file: clip.mp4 ---\n[video, 0:02, 160x120, ")
    assert "you cannot watch it, but it is attachment 1, and file_convert can turn it into its sound track" in sent
    assert len(sent) < 400 and TOOL in offered(router.requests[-1])
    opened = await wire.request({"type": "open", "conversation": 1})
    assert opened["turns"][0]["files"] == user["files"]

    router.script(call(TOOL, {"operation": "video_to_audio", "attachments": [1]}), Reply(text="here it is"))
    rid = await wire.send({"type": "ask", "text": "give me its sound", "conversation": 1})
    asked = (await wire.until(rid, ("approval", "done", "error")))[-1]
    assert asked["type"] == "approval" and asked["arguments"]["operation"] == "video_to_audio", asked
    assert not (tmp_path / "clip.m4a").exists()  # nothing runs before the answer
    await wire.request({"type": "approve", "conversation": 1, "call": asked["call"], "allow": True})
    [tool] = of_type(await wire.until(rid), "tool")
    assert tool["ok"] and tool["summary"] == "video_to_audio: wrote clip.m4a", tool
    assert abs(duration(tmp_path / "clip.m4a") - 2.0) < 0.1
    result = json.loads(tool_messages(router.requests[-1])[-1]["content"])
    assert [(o["id"], o["filename"]) for o in result["outputs"]] == [(2, "clip.m4a")]
    # the first question, as stored and sent again, names the video as the model first saw it
    first = [m for m in router.requests[-1]["messages"] if m["role"] == "user"][0]
    assert user_text({"messages": [first]}) == sent



async def converted(wire: Wire, router: FakeRouter, operation: str, options: dict[str, Any], ident: int = 1) -> None:
    """A turn of conversation 1 in which the model calls file_convert on attachment ``ident``, approved."""
    router.script(call(TOOL, {"operation": operation, "attachments": [ident], "options": options}),
                  Reply(text="done"))
    rid = await wire.send({"type": "ask", "text": f"make a {operation}", "conversation": 1})
    asked = (await wire.until(rid, ("approval", "done", "error")))[-1]
    assert asked["type"] == "approval", asked
    await wire.request({"type": "approve", "conversation": 1, "call": asked["call"], "allow": True})
    [tool] = of_type(await wire.until(rid), "tool")
    assert tool["ok"], tool


def kilobytes(path: Path) -> str:
    """A small file's size as the model reads it (a test clip and what is made of it: kB, not "0.0 MB")."""
    size = path.stat().st_size
    assert 1_000 <= size < 999_000, size
    return f"{size / 1e3:.1f} kB"


async def test_folded_videos_and_outputs_are_named_by_kind_and_a_video_read_names_its_id(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    """Once a compaction folds them, the manifest tells a video by its duration and picture size,
    a sound file by its duration, a GIF and a merged PDF by their kinds; attachment_recall's read
    of a video names its id."""
    clip = make_clip(tmp_path / "clip.mp4")
    router.script(Reply(text="a clip"))
    await wire.ask("what is this?", files=[str(clip)])
    await converted(wire, router, "video_to_audio", {})
    await converted(wire, router, "video_to_gif", {"duration": 1, "width": 80})
    await converted(wire, router, "trackcrop", {"aspect": "9:16"})
    await converted(wire, router, "pdf_merge", {}, ident=3)  # the GIF as a page
    router.script_complete(Reply(text="Earlier: a clip and what was made of it."))
    for n in range(16):
        router.script(Reply(text=f"Answer {n}: " + "word " * 120))
        events = await wire.ask(f"question {n} " + "filler " * 80, conversation=1)
        if any(e["stage"] == "compacting" for e in of_type(events, "progress")):
            break
    system = router.requests[-1]["messages"][0]["content"]
    assert "Earlier: a clip and what was made of it." in system
    lines = [line for line in system.splitlines() if line.startswith("- id ")]
    assert lines[:3] == [
        f"- id 1: clip.mp4 (video, 0:02, 160x120, {kilobytes(clip)}; turn 1)",
        f"- id 2: clip.m4a (audio, 0:02, {kilobytes(tmp_path / 'clip.m4a')}; turn 2)",
        "- id 3: clip.gif (image, image/gif; turn 3)",
    ], system
    crop = tmp_path / "clip 9x16.mp4"
    assert lines[3] == f"- id 4: clip 9x16.mp4 (video, 0:02, 66x120, {kilobytes(crop)}; turn 4)"
    assert lines[4] == "- id 5: clip merged.pdf (PDF, 1 page, no text layer; turn 5)"  # a GIF's page: no words

    for ident, name in [(1, "clip.mp4"), (4, "clip 9x16.mp4")]:
        router.script(call("attachment_recall", {"action": "read", "attachment_id": ident}), Reply(text="read"))
        await wire.ask(f"what is attachment {ident}?", conversation=1)
        read = json.loads(tool_messages(router.requests[-1])[-1]["content"])
        assert read["filename"] == name and read["content"].startswith("[video, 0:02, "), read
        assert f"you cannot watch it, but it is attachment {ident}, and file_convert" in read["content"], read


async def test_a_sound_output_is_read_as_what_it_is_not_as_no_text(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    """video_to_audio's output, copied (an M4A: its duration from the boxes) or encoded (an MP3:
    from ffprobe), is stored with a line of its facts: attachment_recall reads its kind, duration,
    size and id, and that file_convert has nothing for it, where it once said "no text"."""
    clip = make_clip(tmp_path / "clip.mp4")
    router.script(Reply(text="a clip"))
    await wire.ask("what is this?", files=[str(clip)])
    await converted(wire, router, "video_to_audio", {})  # attachment 2: clip.m4a
    await converted(wire, router, "video_to_audio", {"format": "mp3"})  # attachment 3: clip.mp3
    for ident, name in [(2, "clip.m4a"), (3, "clip.mp3")]:
        router.script(call("attachment_recall", {"action": "read", "attachment_id": ident}), Reply(text="read"))
        await wire.ask(f"what is attachment {ident}?", conversation=1)
        read = json.loads(tool_messages(router.requests[-1])[-1]["content"])
        assert read["filename"] == name and read["content"] == (
            f"[audio, 0:02, {kilobytes(tmp_path / name)}; you cannot hear it, but it is attachment {ident}; "
            "file_convert takes PDFs, images and videos, not sound]"), read
    router.script(call("attachment_recall", {"action": "list"}), Reply(text="listed"))
    await wire.ask("what is there?", conversation=1)
    listed = json.loads(tool_messages(router.requests[-1])[-1]["content"])["attachments"]
    assert [(a["filename"], a["has_text"]) for a in listed] == [
        ("clip.mp4", True), ("clip.m4a", True), ("clip.mp3", True)], listed
