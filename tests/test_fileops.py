"""The file operations themselves (fileops/), run in-process on generated files: outputs checked.

The same operations through the socket and the command line: tests/test_convert.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from pypdf import PdfReader

from core import Config
from core.errors import (
    BadOption,
    ConvertFailed,
    ConvertTimeout,
    FileRefused,
    NotFound,
    OutputTooLarge,
    ToolMissing,
)
from fileops import Converted, Converter
from fileops.markdown import pages_markdown, parse_pages
from fileops.outputs import Staged
from fileworker.failure import OutputTooLarge as WorkerTooLarge
from fileworker.failure import WorkFailed
from fileworker.tracking import filled, smooth_path, window_path
from selfcheck.samples import make_png
from attachments.mp4 import Mp4Sound, read_sound
from tests.media import BOX, duration, gray_frames, make_box_video, make_clip, make_sound, sound_codec, styled_pdf

REPORT = "Annual Report"


async def convert(operation: str, files: list[Path], options: dict[str, Any] | None = None, *,
                  config: Config | None = None, output_dir: str | None = None) -> tuple[Converted, list[Any]]:
    steps: list[Any] = []
    converter = Converter()
    config = config or Config()
    job = converter.job(config, operation, [str(f) for f in files], options or {}, output_dir,
                        lambda ident: lambda done, total, unit: steps.append((done, total, unit)))
    return await converter.convert(job, config.convert_timeout, None), steps


def report_pdf(path: Path) -> Path:
    return styled_pdf(path, [[(24, REPORT), (12, "The year went well."), (16, "Numbers"), (12, "- first point"),
                              (12, "- second point")], [(12, "Page two.")]])


@pytest.mark.asyncio
async def test_pdf_merge_keeps_the_order_and_makes_images_pages(tmp_path: Path) -> None:
    one = styled_pdf(tmp_path / "one.pdf", [[(12, "alpha page")], [(12, "beta page")]])
    two = styled_pdf(tmp_path / "two.pdf", [[(12, "gamma page")]])
    picture = make_png(tmp_path / "scan.png")
    done, steps = await convert("pdf_merge", [two, picture, one])
    (chip,) = done.outputs
    assert chip.name == "two merged.pdf" and chip.kind == "pdf" and Path(chip.path).parent == tmp_path
    pages = PdfReader(chip.path).pages
    assert [page.extract_text().strip() for page in pages] == ["gamma page", "", "alpha page", "beta page"]
    assert steps[-1] == (3, 3, "files")


@pytest.mark.asyncio
async def test_pdf_pages_takes_a_range_and_turns_it(tmp_path: Path) -> None:
    pdf = styled_pdf(tmp_path / "doc.pdf", [[(12, f"page {n}")] for n in range(1, 6)])
    done, _ = await convert("pdf_pages", [pdf], {"pages": "4-,2", "rotate": 90})
    reader = PdfReader(done.outputs[0].path)
    assert [page.extract_text().strip() for page in reader.pages] == ["page 4", "page 5", "page 2"]
    assert all(page.rotation == 90 for page in reader.pages)
    with pytest.raises(ConvertFailed, match="doc.pdf has 5 pages"):
        await convert("pdf_pages", [pdf], {"pages": "3-9"})


@pytest.mark.asyncio
async def test_the_workers_failures_keep_the_daemons_codes(tmp_path: Path) -> None:
    """The worker says its failures without importing core (its start): the codes are core's."""
    assert (WorkFailed.code, WorkerTooLarge.code) == (ConvertFailed.code, OutputTooLarge.code)
    pdf = styled_pdf(tmp_path / "doc.pdf", [[(12, f"page {n}")] for n in range(1, 6)])
    with pytest.raises(OutputTooLarge, match=r"past convert_max_bytes \(100\)"):
        await convert("pdf_pages", [pdf], config=Config(convert_max_bytes=100))
    assert [p.name for p in tmp_path.iterdir()] == ["doc.pdf"]


@pytest.mark.asyncio
async def test_pdf_to_markdown_keeps_headings_and_lists(tmp_path: Path) -> None:
    done, _ = await convert("pdf_to_markdown", [report_pdf(tmp_path / "report.pdf")])
    text = Path(done.outputs[0].path).read_text()
    assert text == ("# Annual Report\n\nThe year went well.\n\n## Numbers\n\n- first point\n- second point\n\n"
                    "Page two.\n")


@pytest.mark.asyncio
async def test_a_tool_is_waited_for_without_pidfds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a kernel without pidfd_open (before 5.3) a thread waits for the tool instead."""
    def no_pidfds(pid: int) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfds)
    done, _ = await convert("pdf_to_markdown", [report_pdf(tmp_path / "report.pdf")])
    assert Path(done.outputs[0].path).read_text().startswith("# Annual Report\n")
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(b"%PDF-1.4 not a whole file")
    with pytest.raises(ConvertFailed, match="broken.pdf"):
        await convert("pdf_to_markdown", [broken])


def test_cells_on_one_row_make_a_table() -> None:
    xml = (b'<pdf2xml><page number="1"><fontspec id="0" size="12"/>'
           b'<text top="10" left="10" height="12" font="0">Name</text>'
           b'<text top="10" left="200" height="12" font="0">Count</text>'
           b'<text top="40" left="10" height="12" font="0">apples</text>'
           b'<text top="40" left="200" height="12" font="0">3</text></page></pdf2xml>')
    assert pages_markdown(parse_pages(xml)) == ["| Name | Count |\n| --- | --- |\n| apples | 3 |"]


@pytest.mark.asyncio
async def test_outputs_never_overwrite_and_leave_no_temporary_file(tmp_path: Path) -> None:
    pdf = report_pdf(tmp_path / "report.pdf")
    (tmp_path / "report.md").write_text("mine")
    done, _ = await convert("pdf_to_markdown", [pdf])
    again, _ = await convert("pdf_to_markdown", [pdf])
    assert [done.outputs[0].name, again.outputs[0].name] == ["report (1).md", "report (2).md"]
    assert (tmp_path / "report.md").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report (1).md", "report (2).md", "report.md", "report.pdf"]


def test_without_hard_links_a_name_is_claimed_before_the_output_moves_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(source: object, target: object) -> None:
        raise PermissionError(1, "Operation not permitted")  # as vfat answers link()

    monkeypatch.setattr(os, "link", no_links)
    (tmp_path / "a.md").write_text("mine")
    staged = Staged.make(tmp_path, "a.md")
    staged.temporary.write_text("new")
    assert staged.publish() == tmp_path / "a (1).md"
    assert [(p.name, p.read_text()) for p in sorted(tmp_path.iterdir())] == [("a (1).md", "new"), ("a.md", "mine")]


@pytest.mark.asyncio
async def test_video_to_audio_copies_the_track_or_encodes_it(tmp_path: Path) -> None:
    clip = make_clip(tmp_path / "clip.mp4")
    copied, steps = await convert("video_to_audio", [clip])
    encoded, _ = await convert("video_to_audio", [clip], {"format": "mp3"})
    assert [copied.outputs[0].name, encoded.outputs[0].name] == ["clip.m4a", "clip.mp3"]
    assert [c.outputs[0].kind for c in (copied, encoded)] == ["audio", "audio"]
    for done in (copied, encoded):
        assert abs(duration(Path(done.outputs[0].path)) - 2.0) < 0.1
    assert steps and all(unit == "seconds" and total == pytest.approx(2.0, abs=0.1) for _, total, unit in steps)


@pytest.mark.asyncio
async def test_video_to_gif_has_the_asked_frames_and_refuses_past_its_bound(tmp_path: Path) -> None:
    clip = make_clip(tmp_path / "clip.mp4")
    done, _ = await convert("video_to_gif", [clip], {"start": 0.5, "duration": 1, "fps": 5, "width": 80})
    with Image.open(done.outputs[0].path) as gif:
        assert (gif.n_frames, gif.size) == (5, (80, 60))
    small = Config(gif_max_bytes=2000)
    with pytest.raises(OutputTooLarge, match=r"gif_max_bytes \(2000 bytes\)"):
        await convert("video_to_gif", [clip], {"width": 160}, config=small)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.gif", "clip.mp4"]


@pytest.mark.asyncio
async def test_trackcrop_follows_the_moving_box(tmp_path: Path) -> None:
    video = make_box_video(tmp_path / "box.mp4")
    done, steps = await convert("trackcrop", [video], {"aspect": "9:16"})
    (chip,) = done.outputs
    assert chip.name == "box 9x16.mp4" and chip.kind == "video"
    frames = gray_frames(Path(chip.path))
    assert frames.shape[1:] == (180, 100) and len(frames) == 20
    # the box, wholly white, is in every frame of the window, though it crosses 320 pixels
    seen = [(frame > 200).sum() for frame in frames]
    assert min(seen) >= BOX * BOX * 0.8, seen
    assert {unit for *_, unit in steps} == {"frames", "seconds"}


def test_the_window_path_is_smoothed_and_kept_in_the_frame() -> None:
    jitter = np.array([50.0, 60.0] * 10)
    assert np.ptp(smooth_path(jitter, 4)[2:-2]) < 3  # a jitter of 10 pixels evens out
    assert list(window_path(np.array([0.0, 160.0, 320.0]), 100, 220, 1)) == [0, 110, 220]
    assert filled([None, None, 40.0, None, 60.0], 80.0) == [40.0, 40.0, 40.0, 40.0, 60.0]


@pytest.mark.asyncio
async def test_a_missing_ffmpeg_names_its_debian_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clip = make_clip(tmp_path / "clip.mp4")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ToolMissing, match="install the Debian package ffmpeg"):
        await convert("video_to_audio", [clip])


@pytest.mark.asyncio
@pytest.mark.parametrize("operation, name", [("pdf_merge", "bad.pdf"), ("pdf_to_markdown", "bad.pdf"),
                                             ("video_to_gif", "bad.mp4"), ("trackcrop", "bad.mp4")])
async def test_a_damaged_input_is_named(tmp_path: Path, operation: str, name: str) -> None:
    damaged = tmp_path / name
    damaged.write_bytes(b"%PDF-1.4\n1 0 obj garbage" if name.endswith(".pdf") else b"\x00\x00\x00\x18ftypmp42junk")
    with pytest.raises(ConvertFailed, match=name):
        await convert(operation, [damaged])
    assert [p.name for p in tmp_path.iterdir()] == [name]


@pytest.mark.asyncio
async def test_a_conversion_past_its_time_bound_is_stopped_and_its_tool_killed(tmp_path: Path) -> None:
    clip = make_clip(tmp_path / "clip.mp4")
    with pytest.raises(ConvertTimeout, match=r"convert_timeout \(0.01 s\)"):
        await convert("trackcrop", [clip], config=Config(convert_timeout=0.01))
    assert [p.name for p in tmp_path.iterdir()] == ["clip.mp4"]


@pytest.mark.asyncio
async def test_requests_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    pdf = report_pdf(tmp_path / "report.pdf")
    with pytest.raises(NotFound, match="no operation 'pdf_explode'"):
        await convert("pdf_explode", [pdf])
    with pytest.raises(BadOption, match="option 'fps' must be an integer from 1 to 50"):
        await convert("video_to_gif", [tmp_path / "x.mp4"], {"fps": 500})
    with pytest.raises(BadOption, match="pdf_to_markdown has no option 'speed'"):
        await convert("pdf_to_markdown", [pdf], {"speed": 2})
    with pytest.raises(FileRefused, match="video_to_audio takes video files"):
        await convert("video_to_audio", [pdf])
    with pytest.raises(FileRefused, match="no such file"):
        await convert("pdf_to_markdown", [tmp_path / "gone.pdf"])


@pytest.mark.parametrize(("codec", "name", "video"), [
    ("aac", "a.m4a", False), ("libmp3lame", "b.mp4", False), ("libopus", "c.mp4", False), ("flac", "d.mp4", False),
    ("alac", "e.m4a", False), ("aac", "f.mov", True),
])
def test_an_mp4s_boxes_name_its_sound_as_ffprobe_does(tmp_path: Path, codec: str, name: str, video: bool) -> None:
    path = make_sound(tmp_path / name, codec, seconds=2, video=video)
    with open(path, "rb") as handle:
        found = read_sound(handle)
    assert found is not None and found.audio == sound_codec(path)
    assert found.duration == pytest.approx(duration(path), abs=0.1)


def test_an_mp4_without_sound_and_what_the_boxes_do_not_say(tmp_path: Path) -> None:
    with open(make_box_video(tmp_path / "silent.mp4"), "rb") as handle:
        assert read_sound(handle) == Mp4Sound(2.0, None)
    for name, data in [("torn.mp4", b"\x00\x00\x00\x18ftypisom" + bytes(64)),  # no moov: ffprobe says why
                       ("loop.mp4", b"\x00\x00\x00\x10ftypisom" + b"\x00\x00\x00\x08free" * 10000),
                       ("clip.mkv", b"\x1a\x45\xdf\xa3" + bytes(64))]:
        (tmp_path / name).write_bytes(data)
        with open(tmp_path / name, "rb") as handle:
            assert read_sound(handle) is None, name
