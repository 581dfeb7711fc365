"""``convert``, ``operations`` and ``cancel`` of a convert through the socket, and the
``convert`` command: every operation on generated files, outputs checked; cancel, the time
bound, shutdown, a missing ffmpeg, damaged inputs. The operations' own details:
tests/test_fileops.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from pypdf import PdfReader

from client import Wire
from core import load_config
from selfcheck.samples import make_png
from tests.conftest import RunningDaemon
from tests.media import BOX, duration, gray_frames, make_box_video, make_clip, make_sound, styled_pdf
from tests.test_client import cli

pytestmark = pytest.mark.asyncio
ENDS = ("converted", "error")


async def convert(wire: Wire, operation: str, files: list[Path], **fields: Any) -> list[dict[str, Any]]:
    rid = await wire.send({"type": "convert", "operation": operation, "files": [str(f) for f in files], **fields})
    return await wire.until(rid, ENDS)


def only_output(events: list[dict[str, Any]]) -> dict[str, Any]:
    assert events[-1]["type"] == "converted", events[-1]
    (chip,) = events[-1]["outputs"]
    assert chip["sha256"] == hashlib.sha256(Path(chip["path"]).read_bytes()).hexdigest()
    assert chip["size"] == Path(chip["path"]).stat().st_size
    return chip


def sleeping_ffmpeg(folder: Path) -> Path:
    """A PATH folder with the real ffprobe and an ffmpeg that writes part of its output, says it
    is half a second in, and sleeps: an operation that runs until it is stopped. It leaves its
    pid in ``folder/pid``."""
    folder.mkdir()
    (folder / "ffprobe").symlink_to(shutil.which("ffprobe") or "ffprobe")
    script = folder / "ffmpeg"
    script.write_text(f"#!/bin/sh\necho $$ > {folder / 'pid'}\nfor last; do :; done\nprintf partial > \"$last\"\n"
                      f"echo out_time_us=500000\necho progress=continue\nexec {shutil.which('sleep')} 600\n")
    script.chmod(0o755)
    return folder


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A folder for a test's inputs and outputs alone (tmp_path holds the daemon's data too)."""
    folder = tmp_path / "in"
    folder.mkdir()
    return folder


def gone(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
    except ProcessLookupError:
        return True
    return False


async def test_operations_lists_each_with_its_options_and_kinds(wire: Wire) -> None:
    event = await wire.request({"type": "operations"})
    items = {item["name"]: item for item in event["items"]}
    assert list(items) == ["pdf_merge", "pdf_pages", "pdf_to_markdown", "video_to_audio", "video_to_gif", "trackcrop"]
    assert items["pdf_merge"]["kinds"] == ["pdf", "image"] and items["pdf_merge"]["max_files"] == 100
    fps = next(o for o in items["video_to_gif"]["options"] if o["name"] == "fps")
    assert fps == {"name": "fps", "type": "integer", "default": 10, "description": "frames a second",
                   "minimum": 1, "maximum": 50}


async def test_pdf_merge_streams_progress_and_ends_with_the_chip(wire: Wire, tmp_path: Path) -> None:
    one = styled_pdf(tmp_path / "one.pdf", [[(12, "alpha page")]])
    two = styled_pdf(tmp_path / "two.pdf", [[(12, "beta page")], [(12, "gamma page")]])
    events = await convert(wire, "pdf_merge", [two, make_png(tmp_path / "photo.png"), one])
    first, *steps, _end = events
    assert first == {"type": "progress", "id": first["id"], "convert": first["convert"], "operation": "pdf_merge",
                     "done": 0, "total": 3, "unit": "files"}
    assert steps and steps[-1]["done"] == 3 and all(step["convert"] == first["convert"] for step in steps)
    chip = only_output(events)
    assert chip["name"] == "two merged.pdf" and chip["kind"] == "pdf" and "thumbnail" not in chip
    texts = [page.extract_text().strip() for page in PdfReader(chip["path"]).pages]
    assert texts == ["beta page", "gamma page", "", "alpha page"]


async def test_pdf_pages_into_an_output_dir(wire: Wire, tmp_path: Path) -> None:
    pdf = styled_pdf(tmp_path / "doc.pdf", [[(12, f"page {n}")] for n in range(1, 4)])
    out = tmp_path / "out"
    out.mkdir()
    chip = only_output(await convert(wire, "pdf_pages", [pdf], options={"pages": "3,1", "rotate": 180},
                                     output_dir=str(out)))
    assert Path(chip["path"]) == out / "doc pages 3,1.pdf"
    pages = PdfReader(chip["path"]).pages
    assert [p.extract_text().strip() for p in pages] == ["page 3", "page 1"] and pages[0].rotation == 180


async def test_the_configured_output_dir_is_used_when_the_request_names_none(
    router: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "outputs"
    out.mkdir()
    monkeypatch.setenv("ASSISTANT_ROUTER_URL", router.url)
    monkeypatch.setenv("ASSISTANT_OUTPUT_DIR", str(out))
    daemon = RunningDaemon(load_config())
    await daemon.start()
    try:
        wire = await daemon.connect()
        pdf = styled_pdf(tmp_path / "doc.pdf", [[(20, "Title")], [(12, "body")]])
        chip = only_output(await convert(wire, "pdf_to_markdown", [pdf]))
        assert Path(chip["path"]) == out / "doc.md"
        await wire.close()
    finally:
        await daemon.stop()


async def test_the_cli_makes_markdown_and_prints_its_path(daemon: RunningDaemon, tmp_path: Path) -> None:
    pdf = styled_pdf(tmp_path / "report.pdf", [[(24, "Annual Report"), (12, "It went well."), (16, "Numbers"),
                                                (12, "1. first"), (12, "2. second")]])
    (tmp_path / "report.md").write_text("my notes")
    code, out, err = await cli("convert", "pdf_to_markdown", str(pdf))
    assert code == 0, err
    assert out == f"{tmp_path / 'report (1).md'}\n"
    assert (tmp_path / "report (1).md").read_text() == ("# Annual Report\n\nIt went well.\n\n## Numbers\n\n"
                                                         "1. first\n2. second\n")
    assert (tmp_path / "report.md").read_text() == "my notes"


async def test_the_cli_lists_an_operations_options_and_writes_json_when_asked(
    daemon: RunningDaemon, tmp_path: Path
) -> None:
    code, out, err = await cli("convert", "pdf_pages", "--help")
    assert code == 0, err
    assert out.splitlines()[1] == "  --pages string, default '': pages and ranges, such as \"1-3,5\" or \"4-\"; empty: every page"
    pdf = styled_pdf(tmp_path / "doc.pdf", [[(12, "one")], [(12, "two")]])
    code, out, err = await cli("convert", "pdf_pages", str(pdf), "--pages", "2", "--json")
    assert code == 0, err
    *steps, end = [json.loads(line) for line in out.splitlines()]
    assert steps[0]["type"] == "progress" and end["type"] == "converted"
    assert end["outputs"][0]["path"] == str(tmp_path / "doc pages 2.pdf")


async def test_video_to_audio_keeps_the_duration(wire: Wire, tmp_path: Path) -> None:
    events = await convert(wire, "video_to_audio", [make_clip(tmp_path / "clip.mp4")], options={"format": "opus"})
    chip = only_output(events)
    assert chip["name"] == "clip.opus" and chip["kind"] == "audio"
    assert abs(duration(Path(chip["path"])) - 2.0) < 0.1
    seconds = [e for e in events if e["type"] == "progress" and e["unit"] == "seconds"]
    assert seconds and seconds[-1]["total"] == pytest.approx(2.0, abs=0.1)


async def test_an_mp4s_sound_is_copied_without_ffprobe(wire: Wire, tmp_path: Path, work: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """ffprobe's start costs as much as the copy: an MP4's sound track is read from its boxes. Without
    ffprobe on PATH an MP4 still converts, and a Matroska file still asks for it."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "ffmpeg").symlink_to(shutil.which("ffmpeg") or "ffmpeg")
    clip = make_clip(work / "clip.mp4")
    mkv = make_sound(work / "tone.mkv", "libopus", video=True)
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tools))  # the daemon's PATH: it runs in this process
    events = await convert(wire, "video_to_audio", [clip])
    end = (await convert(wire, "video_to_audio", [mkv]))[-1]
    monkeypatch.setenv("PATH", path)
    chip = only_output(events)
    assert chip["name"] == "clip.m4a" and abs(duration(Path(chip["path"])) - 2.0) < 0.1
    assert [e for e in events if e["type"] == "progress" and e["unit"] == "seconds"][-1]["total"] == 2.0
    assert end["code"] == "tool_missing" and "ffprobe is not installed" in end["message"], end


async def test_an_mp4s_gif_is_made_without_ffprobe(wire: Wire, tmp_path: Path, work: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """ffprobe's start is a sixth of a short GIF: an MP4's picture and duration are read from its
    boxes. Without ffprobe an MP4 still makes its GIF; an MP4 of sound alone still asks for it."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "ffmpeg").symlink_to(shutil.which("ffmpeg") or "ffmpeg")
    clip = make_clip(work / "clip.mp4")
    tone = make_sound(work / "tone.mp4", "aac")
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tools))  # the daemon's PATH: it runs in this process
    events = await convert(wire, "video_to_gif", [clip], options={"start": 0.5, "fps": 5})
    late = (await convert(wire, "video_to_gif", [clip], options={"start": 3}))[-1]
    end = (await convert(wire, "video_to_gif", [tone]))[-1]
    monkeypatch.setenv("PATH", path)
    chip = only_output(events)
    with Image.open(chip["path"]) as gif:
        assert gif.n_frames == 8  # 1.5 s left of 2, at 5 fps
    assert [e for e in events if e["type"] == "progress" and e["unit"] == "seconds"][-1]["total"] == 1.5
    assert late["code"] == "convert_failed" and "lasts 2 s: start 3 is past its end" in late["message"], late
    assert end["code"] == "tool_missing" and "ffprobe is not installed" in end["message"], end


async def test_the_cli_makes_a_gif_of_the_asked_frames(daemon: RunningDaemon, tmp_path: Path) -> None:
    clip = make_clip(tmp_path / "clip.mp4")
    code, out, err = await cli("convert", "video_to_gif", str(clip), "--start", "0.5", "--duration", "1.2",
                               "--fps", "5", "--width=64")
    assert code == 0, err
    with Image.open(out.strip()) as gif:
        assert (gif.n_frames, gif.size) == (6, (64, 48))


async def test_a_gif_chip_has_a_thumbnail(wire: Wire, tmp_path: Path) -> None:
    chip = only_output(await convert(wire, "video_to_gif", [make_clip(tmp_path / "clip.mp4")],
                                     options={"duration": 1, "fps": 2, "width": 120}))
    assert chip["kind"] == "image"
    with Image.open(chip["thumbnail"]) as thumbnail:
        assert thumbnail.format == "PNG" and thumbnail.size == (120, 90)


async def test_trackcrop_through_the_socket_follows_the_box(wire: Wire, tmp_path: Path) -> None:
    chip = only_output(await convert(wire, "trackcrop", [make_box_video(tmp_path / "box.mp4")],
                                     options={"aspect": "1:1", "smooth": 0.5}))
    frames = gray_frames(Path(chip["path"]))
    assert frames.shape[1:] == (180, 180)
    seen = [int((frame > 200).sum()) for frame in frames]
    assert min(seen) >= BOX * BOX * 0.8, seen


async def test_a_conversion_is_cancelled_by_its_id(wire: Wire, tmp_path: Path, work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clip = make_clip(work / "clip.mp4")
    tools = sleeping_ffmpeg(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(tools))
    rid = await wire.send({"type": "convert", "operation": "video_to_gif", "files": [str(clip)]})
    async for event in wire.stream(rid):
        if event["type"] == "progress" and event["unit"] == "seconds":  # the tool runs, and has written
            break
    assert [p.name for p in work.iterdir() if p.name.endswith(".part.gif")]  # its partial output, hidden
    answer = await wire.request({"type": "cancel", "convert": event["convert"]})
    assert answer == {"type": "cancelled", "id": answer["id"], "convert": event["convert"], "running": True}
    end = (await wire.until(rid, ENDS))[-1]
    assert end == {"type": "converted", "id": rid, "convert": event["convert"], "operation": "video_to_gif",
                   "cancelled": True, "outputs": []}
    assert sorted(p.name for p in work.iterdir()) == ["clip.mp4"]
    assert gone(tools / "pid")
    again = await wire.request({"type": "cancel", "convert": event["convert"]})
    assert again["running"] is False


def straggling_ffmpeg(folder: Path) -> Path:
    """A PATH folder with the real ffprobe and an ffmpeg that starts a helper in its process
    group (its pid in ``folder/pid``), writes its output and ends well, leaving the helper."""
    folder.mkdir()
    (folder / "ffprobe").symlink_to(shutil.which("ffprobe") or "ffprobe")
    script = folder / "ffmpeg"
    script.write_text(f"#!/bin/sh\n{shutil.which('sleep')} 600 >/dev/null 2>&1 </dev/null &\necho $! > {folder / 'pid'}\n"
                      "for last; do :; done\nprintf sound > \"$last\"\n")
    script.chmod(0o755)
    return folder


def ends(pid_file: Path, within: float = 30) -> bool:
    """Whether the process ends within ``within`` seconds (it need not be our child: a pidfd)."""
    try:
        handle = os.pidfd_open(int(pid_file.read_text()))
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([handle], [], [], within)[0])
    finally:
        os.close(handle)


async def test_a_tool_that_ends_leaves_nothing_of_its_group_running(
        wire: Wire, tmp_path: Path, work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only a cancelled tool: one that ended well has what it left in its group killed."""
    clip = make_clip(work / "clip.mp4")
    tools = straggling_ffmpeg(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(tools))
    end = (await convert(wire, "video_to_audio", [clip]))[-1]
    assert end["type"] == "converted" and [Path(o["path"]).read_text() for o in end["outputs"]] == ["sound"], end
    assert ends(tools / "pid")


async def test_the_time_bound_kills_the_tool(router: Any, tmp_path: Path, work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clip = make_clip(work / "clip.mp4")
    monkeypatch.setenv("ASSISTANT_ROUTER_URL", router.url)
    monkeypatch.setenv("ASSISTANT_CONVERT_TIMEOUT", "1")
    daemon = RunningDaemon(load_config())
    await daemon.start()
    try:
        wire = await daemon.connect()
        tools = sleeping_ffmpeg(tmp_path / "bin")
        monkeypatch.setenv("PATH", str(tools))
        end = (await convert(wire, "video_to_audio", [clip]))[-1]
        assert end["code"] == "convert_timeout" and "convert_timeout (1 s)" in end["message"], end
        assert sorted(p.name for p in work.iterdir()) == ["clip.mp4"]
        assert gone(tools / "pid")
        await wire.close()
    finally:
        await daemon.stop()


async def test_shutdown_stops_a_conversion(daemon: RunningDaemon, tmp_path: Path, work: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    clip = make_clip(work / "clip.mp4")
    tools = sleeping_ffmpeg(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(tools))
    wire = await daemon.connect()
    rid = await wire.send({"type": "convert", "operation": "video_to_gif", "files": [str(clip)]})
    async for event in wire.stream(rid):
        if event["type"] == "progress" and event["unit"] == "seconds":
            break
    await daemon.stop()
    end = (await wire.until(rid, ENDS))[-1]
    assert end["code"] == "shutting_down", end
    assert sorted(p.name for p in work.iterdir()) == ["clip.mp4"]
    assert gone(tools / "pid")
    await wire.close()


async def test_a_missing_ffmpeg_is_named_by_its_package(daemon: RunningDaemon, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    clip = make_clip(tmp_path / "clip.mp4")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # the daemon's PATH: it runs in this process
    code, out, err = await cli("convert", "video_to_gif", str(clip), env={"PATH": os.environ["PATH"]})
    assert code == 1 and out == ""
    # an MP4's picture is read from its boxes (no ffprobe): ffmpeg, the GIF's tool, is the one missed
    assert "ffmpeg is not installed; install the Debian package ffmpeg" in err, err


async def test_damaged_inputs_are_named(wire: Wire, tmp_path: Path, work: Path) -> None:
    pdf = work / "torn.pdf"
    pdf.write_bytes(b"%PDF-1.4\n1 0 obj << /Type /Catalog")
    video = work / "torn.mp4"
    video.write_bytes(b"\x00\x00\x00\x18ftypisom" + b"\x00" * 64)
    for operation, path in (("pdf_pages", pdf), ("pdf_to_markdown", pdf), ("video_to_audio", video)):
        end = (await convert(wire, operation, [path]))[-1]
        assert end["code"] == "convert_failed" and end["message"].startswith(f"{path.name}: "), end
    assert sorted(p.name for p in work.iterdir()) == ["torn.mp4", "torn.pdf"]


async def test_refusals_name_what_is_wrong(wire: Wire, tmp_path: Path, work: Path) -> None:
    pdf = styled_pdf(work / "doc.pdf", [[(12, "x")]])
    cases = [
        ({"operation": "pdf_explode", "files": [str(pdf)]}, "not_found", "no operation 'pdf_explode'"),
        ({"operation": "video_to_gif", "files": [str(pdf)]}, "file_refused", "video_to_gif takes video files"),
        ({"operation": "pdf_pages", "files": [str(pdf)], "options": {"rotate": 45}}, "bad_option",
         "option 'rotate' must be one of 0, 90, 180, 270"),
        ({"operation": "pdf_pages", "files": [str(pdf), str(pdf)]}, "file_refused", "pdf_pages takes 1 file, not 2"),
        ({"operation": "pdf_pages", "files": ["doc.pdf"]}, "file_refused", "'doc.pdf' is not an absolute path"),
        ({"operation": "pdf_pages", "files": [str(pdf)], "output_dir": str(work / "none")}, "file_refused",
         "not a folder"),
    ]
    for fields, code, words in cases:
        event = await wire.request({"type": "convert", **fields})
        assert event["type"] == "error" and event["code"] == code and words in event["message"], (fields, event)
    refused = await wire.request({"type": "cancel", "convert": "c1", "kb": "notes"})
    assert refused["code"] == "bad_request"
    assert sorted(p.name for p in work.iterdir()) == ["doc.pdf"]
