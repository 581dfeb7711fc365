"""Large images through the real socket: decoded once and reduced, within the pixel budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from attachments import ImageCache, imagecache
from client import Wire, of_type
from selfcheck.fakerouter import FakeRouter
from tests.conftest import RunningDaemon


def make_large_png(path: Path, side: int = 3000, colour: tuple[int, ...] = (200, 30, 30, 255)) -> Path:
    """A compressible RGBA PNG of ``side`` x ``side`` (a few hundred KB on disk, 36 MB decoded at
    3000); zlib's fastest level, as its size on disk is not what is tested."""
    image = Image.new("RGBA", (side, side), colour)
    image.paste((0, 0, 255, 128), (0, 0, side // 2, side // 2))
    image.save(path, "PNG", compress_level=1)
    return path


def images_of(daemon: RunningDaemon) -> ImageCache:
    """The daemon's image cache (it runs in the test's process)."""
    assert daemon.server is not None and daemon.server.readers is not None
    return daemon.server.readers.images


def image_urls(request: dict[str, Any]) -> list[str]:
    return [
        part["image_url"]["url"]
        for message in request["messages"] if isinstance(message["content"], list)
        for part in message["content"] if part.get("type") == "image_url"
    ]


def texts(request: dict[str, Any]) -> str:
    return "\n".join(
        part["text"] if isinstance(part, dict) else ""
        for message in request["messages"]
        for part in (message["content"] if isinstance(message["content"], list) else [{"text": message["content"]}])
        if isinstance(part, dict) and "text" in part
    )


@pytest.mark.asyncio
async def test_a_large_image_is_sent_scaled_and_later_turns_resend_it_without_decoding(
    daemon: RunningDaemon, wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    picture = make_large_png(tmp_path / "big.png")
    before = images_of(daemon).decodes
    events = await wire.ask("what is this?", files=[str(picture)], model="fake-vision")
    assert of_type(events, "done"), events[-1]
    assert images_of(daemon).decodes == before + 1
    [sent] = image_urls(router.requests[-1])
    assert sent.startswith("data:image/png;base64,")
    # the encoded copy is kept per file hash in the data dir
    assert len(list((daemon.config.data_dir / "images").iterdir())) == 1
    cid = events[-1]["conversation"]
    events = await wire.ask("and now in words only", conversation=cid, model="fake-vision")
    assert of_type(events, "done"), events[-1]
    assert images_of(daemon).decodes == before + 1  # not decoded again
    assert image_urls(router.requests[-1]) == [sent]  # the same bytes: the prompt stays cache-friendly


@pytest.mark.asyncio
async def test_a_replaced_image_is_refused_by_its_hash_before_any_decode(
    daemon: RunningDaemon, wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    picture = make_large_png(tmp_path / "big.png")
    events = await wire.ask("look", files=[str(picture)], model="fake-vision")
    cid = events[-1]["conversation"]
    make_large_png(picture, colour=(10, 200, 10, 255))  # another picture under the same name
    before = images_of(daemon).decodes
    events = await wire.ask("again", conversation=cid, model="fake-vision")
    assert of_type(events, "done"), events[-1]
    assert images_of(daemon).decodes == before
    assert image_urls(router.requests[-1]) == []
    assert "[image big.png is no longer available]" in texts(router.requests[-1])


@pytest.mark.asyncio
async def test_images_past_the_waiting_budget_are_refused_before_anything_is_decoded(
    daemon: RunningDaemon, wire: Wire, router: FakeRouter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pictures = [str(make_large_png(tmp_path / f"big{i}.png", colour=(i, 0, 0, 255))) for i in range(2)]
    # other questions are already waiting for most of the budget
    monkeypatch.setattr(images_of(daemon), "waiting", imagecache.MAX_WAITING_PIXELS - 10_000_000)
    before = images_of(daemon).decodes
    events = await wire.ask("compare", files=pictures, model="fake-vision")
    assert [e["type"] for e in events] == ["progress", "error"]
    assert events[-1]["code"] == "too_many_pixels"
    assert "ask again in a moment, or attach scaled-down copies" in events[-1]["message"]
    assert images_of(daemon).decodes == before
    assert router.requests == []
    monkeypatch.setattr(images_of(daemon), "waiting", 0)  # they are done: the same question goes through
    events = await wire.ask("compare", files=pictures, model="fake-vision")
    assert of_type(events, "done"), events[-1]
    assert len(image_urls(router.requests[-1])) == 2


def test_a_large_jpeg_is_decoded_at_reduced_size(tmp_path: Path) -> None:
    from attachments.images import decode_pixels, encode_image, probe_image

    path = tmp_path / "photo.jpg"
    Image.new("RGB", (8200, 4200), (90, 120, 150)).save(path, "JPEG", quality=80)
    probe = probe_image(str(path), "photo.jpg")
    assert probe is not None
    assert decode_pixels(probe) == 8200 * 4200 // 4  # decoded at half size: 4100 x 2100 still covers 2048
    encoded = encode_image(probe.data, "photo.jpg")
    assert (encoded.width, encoded.height) == (2048, 1049)
    assert encoded.mime == "image/jpeg"
