"""Files on ``ask`` through the real socket: chips, extraction into the
prompt, image references in history, every refusal, the budget, ``estimate``."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import select
import shutil
import sqlite3
import stat
import subprocess
import threading
import types
from pathlib import Path
from typing import Any

import pytest

from client import Wire, of_type
from core import Config, load_config
from selfcheck.fakerouter import FakeModel, FakeRouter, Reply
from selfcheck.samples import Scan, make_mpo, make_pdf, make_png, make_sparse
from tests.conftest import RunningDaemon, serving
from tests.media import make_clip

pytestmark = pytest.mark.asyncio


def drawn(chips: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What chips show of their files, without where each file is (path, size, hash, thumbnail)."""
    return [{k: v for k, v in chip.items() if k in ("name", "kind", "pages", "truncated")} for chip in chips]


def parts(request: dict[str, Any], role: str = "user", index: int = -1) -> list[dict[str, Any]]:
    """The content parts of a message the router received (the last user message by default)."""
    messages = [m for m in request["messages"] if m["role"] == role]
    content = messages[index]["content"]
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


def user_of(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The turn's ``user`` event (``progress: extracting`` comes before it)."""
    [user] = of_type(events, "user")
    return user


def text_of(request: dict[str, Any], index: int = -1) -> str:
    return "\n".join(p["text"] for p in parts(request, index=index) if p["type"] == "text")


def images_of(request: dict[str, Any], index: int = -1) -> list[str]:
    return [p["image_url"]["url"] for p in parts(request, index=index) if p["type"] == "image_url"]


def stored_messages(config: Config, cid: int, turn: int) -> list[dict[str, Any]]:
    with sqlite3.connect(config.db_path) as conn:
        row = conn.execute("SELECT messages FROM turns WHERE conversation_id = ? AND turn = ?", (cid, turn)).fetchone()
    conn.close()
    return json.loads(row[0])


async def test_text_and_code_files_reach_the_model(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("the meeting is on Tuesday\n")
    code = tmp_path / "main.rs"
    code.write_text('fn main() { println!("hi"); }\n')
    events = await wire.ask("summarise", files=[str(notes), str(code)])
    assert [e["type"] for e in events[:2]] == ["progress", "user"]
    user = user_of(events)
    assert drawn(user["files"]) == [
        {"name": "notes.txt", "kind": "text", "truncated": False},
        {"name": "main.rs", "kind": "text", "truncated": False},
    ]
    assert of_type(events, "progress")[0]["stage"] == "extracting"
    assert events[-1]["type"] == "done"
    sent = text_of(router.requests[-1])
    assert sent.startswith("summarise")
    assert "--- file: notes.txt ---" in sent and "the meeting is on Tuesday" in sent
    assert "--- file: main.rs ---" in sent and 'println!("hi")' in sent
    opened = await wire.request({"type": "open", "conversation": user["conversation"]})
    assert opened["turns"][0]["files"] == user["files"]


async def test_files_without_text(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    notes = tmp_path / "todo.md"
    notes.write_text("- buy milk\n")
    events = await wire.ask("", files=[str(notes)])
    assert events[-1]["type"] == "done"
    assert "buy milk" in text_of(router.requests[-1])
    listed = await wire.request({"type": "conversations"})
    assert listed["items"][0]["title"] == "todo.md"


async def test_an_image_is_sent_and_kept_as_a_reference(
    wire: Wire, router: FakeRouter, config: Config, tmp_path: Path
) -> None:
    cat = make_png(tmp_path / "cat.png", (40, 30))
    events = await wire.ask("what is this?", files=[str(cat)], model="fake-vision")
    assert drawn(user_of(events)["files"]) == [{"name": "cat.png", "kind": "image", "truncated": False}]
    [url] = images_of(router.requests[-1])
    assert url.startswith("data:image/png;base64,")
    cid = user_of(events)["conversation"]
    stored = stored_messages(config, cid, 1)[0]["content"]
    [ref] = [p for p in stored if p["type"] == "image_ref"]
    assert ref["name"] == "cat.png" and ref["path"] == str(cat) and len(ref["sha256"]) == 64
    assert "base64" not in json.dumps(stored)  # the image itself never goes into history

    # the next turn resolves the reference from the file again
    await wire.ask("and now?", conversation=cid)
    assert images_of(router.requests[-1], index=0) == [url]
    # once the file changes, the model is told it is gone
    make_png(cat, (41, 30))
    await wire.ask("still there?", conversation=cid)
    assert images_of(router.requests[-1], index=0) == []
    assert "[image cat.png is no longer available]" in text_of(router.requests[-1], index=0)


async def test_a_large_photo_goes_out_as_it_is_and_its_replay_the_same(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    from PIL import Image

    photo = tmp_path / "noise.png"  # 1 MB that does not compress: its data URL is sent in a piece of its own
    Image.frombytes("RGB", (600, 600), os.urandom(600 * 600 * 3)).save(photo)
    events = await wire.ask("what is this?", files=[str(photo)], model="fake-vision")
    assert events[-1]["type"] == "done", events[-1]
    [url] = images_of(router.requests[-1])
    assert url == "data:image/png;base64," + base64.b64encode(photo.read_bytes()).decode()
    await wire.ask("and again?", conversation=user_of(events)["conversation"])
    assert images_of(router.requests[-1], index=0) == [url]  # replayed, byte for byte


async def test_a_body_in_parts_is_the_json_of_the_body() -> None:
    from core.jsontext import SPLICE_MIN, json_body

    big = "data:image/png;base64," + "A" * SPLICE_MIN
    quoted = "data:image/png;base64," + "A" * SPLICE_MIN + '"'  # would need escaping: encoded as usual
    body = {"model": "m", "stream": True, "messages": [
        {"role": "system", "content": "text with \x00 and \u2603"},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": big}},
                                     {"type": "image_url", "image_url": {"url": quoted}}]},
    ]}
    parts = json_body(body)
    assert big.encode() in parts and len(parts) == 3  # the one long data URL spliced in
    assert json.loads(b"".join(parts)) == body
    assert b"".join(parts) == json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


async def test_messages_encoded_earlier_are_put_in_as_they_were_encoded() -> None:
    from core.jsontext import SPLICE_MIN, EncodedPrefix, encode_message, json_body

    big = "data:image/png;base64," + "A" * SPLICE_MIN
    messages = [
        {"role": "system", "content": "text with \x00 and \u2603"},
        {"role": "user", "content": "a question"},
        {"role": "assistant", "content": "an answer, \"quoted\""},
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": big}}]},
    ]
    body = {"model": "m", "messages": messages, "stream": True}
    expected = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    for count in range(len(messages) + 1):
        encoded = EncodedPrefix(count, b",".join(encode_message(m) for m in messages[:count]))
        parts = json_body(body, encoded)
        assert b"".join(parts) == expected, count
        if count < len(messages):
            assert big.encode() in parts  # a message after the prefix: its data URL still spliced
        if count:
            assert encoded.json in parts  # put in as it was made, not encoded again
    # what the prefix stands for is what is sent, whatever the messages now say
    stale = EncodedPrefix(1, encode_message({"role": "system", "content": "as it was"}))
    assert json.loads(b"".join(json_body(body, stale)))["messages"][0]["content"] == "as it was"


async def test_a_phones_mpo_photo_and_a_log_that_mentions_pdf(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    photo = make_mpo(tmp_path / "photo.jpg", (40, 30))  # a JPEG with a second picture after it
    log = tmp_path / "app.log.1"
    log.write_text("saved report %PDF-1.7 to disk\n")  # text, whatever it mentions
    events = await wire.ask("what is this?", files=[str(photo), str(log)], model="fake-vision")
    assert events[-1]["type"] == "done", events[-1]
    assert [(f["name"], f["kind"]) for f in user_of(events)["files"]] == [("photo.jpg", "image"), ("app.log.1", "text")]
    [url] = images_of(router.requests[-1])
    assert url.startswith("data:image/jpeg;base64,")  # the first picture, as a plain JPEG
    assert "saved report %PDF-1.7 to disk" in text_of(router.requests[-1])


async def test_pdf_text_page_and_blank_page(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    pdf = make_pdf(tmp_path / "report.pdf", ["Quarterly revenue grew by nine percent.", None])
    events = await wire.ask("read it", files=[str(pdf)], model="fake-vision")
    assert drawn(user_of(events)["files"]) == [{"name": "report.pdf", "kind": "pdf", "pages": 2, "truncated": False}]
    request = router.requests[-1]
    assert "Quarterly revenue grew by nine percent." in text_of(request)
    assert "--- file: report.pdf" in text_of(request)
    assert len(images_of(request)) == 1  # the text-less page, rendered


async def test_scanned_pages_on_a_text_model_are_refused(
    wire: Wire, router: FakeRouter, tmp_path: Path, no_tesseract: None
) -> None:
    pdf = make_pdf(tmp_path / "scan.pdf", [Scan("hello")])
    events = await wire.ask("read it", files=[str(pdf)])
    error = events[-1]
    assert [e["type"] for e in events] == ["progress", "error"]
    assert error["code"] == "no_vision" and error["message"] == (
        "fake-text cannot see images, and scan.pdf has 1 scanned page (no text to read); ask a model that can "
        "(the models request lists them), or leave scan.pdf out (tesseract is not installed: install "
        "tesseract-ocr and tesseract-ocr-eng to read scanned pages)")
    assert error["turn"] == 1
    assert router.requests == []


async def test_an_image_on_a_text_model_is_refused(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    cat = make_png(tmp_path / "cat.png")
    events = await wire.ask("see?", files=[str(cat)])
    assert events[-1]["code"] == "no_vision"
    assert events[-1]["message"] == (
        "fake-text cannot see images; ask a model that can (the models request lists them), or leave the image out "
        "(or set ocr_images = true in config.toml to read its text instead, as for a screenshot)"
    )
    assert router.requests == []


async def test_a_long_file_is_cut_to_the_budget(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    log = tmp_path / "big.log"
    log.write_text("line of log text\n" * 5000)  # 85,000 characters
    staged = await wire.request({"type": "estimate", "files": [str(log)]})
    assert staged["files"][0]["truncated"] is True  # said before it is sent, as the chip will
    # half of what the system message and the tools' definitions leave, at 3 characters a token:
    # the turn counts what the estimate counts (about 5,000 characters of fake-text's 4,096 tokens)
    assert staged["ctx_max"] == 4096 and 600 < staged["ctx_used"] < 1000
    budget = (staged["ctx_max"] - staged["ctx_used"]) // 2 * 3
    events = await wire.ask("what happened?", files=[str(log)])
    assert drawn(user_of(events)["files"]) == [{"name": "big.log", "kind": "text", "truncated": True}]
    sent = text_of(router.requests[-1])
    assert f"(truncated: first {budget} of 85000 characters)" in sent.split("\n", 3)[2]  # the block's header
    assert budget < len(sent) < budget + 200


async def test_a_huge_sparse_file_is_read_only_to_the_budget(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    huge = make_sparse(tmp_path / "huge.log", 4 << 30, head=b"start of the log\n")
    events = await wire.ask("look", files=[str(huge)])
    assert events[-1]["type"] == "done"
    assert user_of(events)["files"][0]["truncated"] is True
    assert len(text_of(router.requests[-1])) < 8000


@pytest.mark.parametrize(
    "make, code, words",
    [
        (lambda d: "relative/path.txt", "file_refused", "absolute"),
        (lambda d: str(d / "missing.txt"), "file_refused", "missing.txt"),
        (lambda d: str(d), "file_refused", "a folder, not a file"),
        (lambda d: "/dev/null", "file_refused", "not a regular file"),
        (lambda d: str(make_sparse(d / "huge.png", 21 << 20, b"\x89PNG\r\n\x1a\n")), "file_refused", "20 MB"),
        (lambda d: str(_binary(d / "blob.bin")), "unsupported_kind", "chat supports text, images, PDF, documents"),
    ],
)
async def test_refusals_send_and_store_nothing(
    wire: Wire, router: FakeRouter, tmp_path: Path, make: Any, code: str, words: str
) -> None:
    events = await wire.ask("look", files=[make(tmp_path)])
    assert events[-1]["type"] == "error"
    assert events[-1]["code"] == code
    assert words in events[-1]["message"]
    assert events[-1]["turn"] == 1
    assert router.requests == []
    assert (await wire.request({"type": "conversations"}))["items"] == []


def _binary(path: Path) -> Path:
    path.write_bytes(bytes(range(256)) * 40)
    return path


async def test_a_fifo_is_refused_without_being_opened(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    # an open for reading would block until a writer came: the answer proves it never happened
    events = await asyncio.wait_for(wire.ask("look", files=[str(fifo)]), 10)
    assert events[-1]["code"] == "file_refused"
    assert "not a regular file" in events[-1]["message"]


async def test_a_symlink_to_a_file_is_followed(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    target = tmp_path / "real.txt"
    target.write_text("linked content")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    events = await wire.ask("look", files=[str(link)])
    assert events[-1]["type"] == "done"
    assert "linked content" in text_of(router.requests[-1])


async def test_more_than_eight_files(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    paths = []
    for i in range(9):
        path = tmp_path / f"f{i}.txt"
        path.write_text("x")
        paths.append(str(path))
    events = await wire.ask("look", files=paths)
    assert events[-1]["code"] == "too_many_files"
    assert router.requests == []


async def test_files_are_kept_when_the_router_is_down(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    router.stop()
    events = await wire.ask("read", files=[str(notes)])
    assert user_of(events)["files"][0]["name"] == "notes.txt"
    assert events[-1]["code"] == "router_unreachable"
    turn = (await wire.request({"type": "open", "conversation": user_of(events)["conversation"]}))["turns"][0]
    assert turn["files"] == user_of(events)["files"] and turn["status"] == "error"


async def test_estimate_counts_staged_text_and_files(wire: Wire, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("a" * 4000)
    cat = make_png(tmp_path / "cat.png")
    event = await wire.request({"type": "estimate", "text": "x" * 40, "files": [str(notes), str(cat)],
                                "model": "fake-vision"})
    assert event["type"] == "estimate"
    assert event["files"] == [
        {"name": "notes.txt", "kind": "text", "tokens": 1000, "truncated": False},
        {"name": "cat.png", "kind": "image", "tokens": 765, "truncated": False},
    ]
    assert event["tokens"] == 10 + 1000 + 765
    assert event["ctx_used"] > 0 and event["ctx_max"] == 8192  # a new conversation: its system message, tools
    cid = (await wire.ask("hello"))[0]["conversation"]
    later = await wire.request({"type": "estimate", "text": "more", "conversation": cid})
    assert later["ctx_used"] > 0 and later["files"] == []
    refused = await wire.request({"type": "estimate", "files": [str(cat)]})
    assert refused["code"] == "no_vision"


async def test_each_model_counts_images_at_its_own_cost(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    models = [FakeModel("fake-vision", ["text", "image"], 8192), FakeModel("/models/llava-1.5.gguf", ["text", "image"])]
    config_file = tmp_path / "config" / "assistant" / "config.toml"
    config_file.parent.mkdir(parents=True)
    config_file.write_text('image_tokens = 500\n[models.fake-vision]\nimage_tokens = 1200\n')
    cat = make_png(tmp_path / "cat.png")
    with FakeRouter(models) as router:
        monkeypatch.setenv("ASSISTANT_ROUTER_URL", router.url)
        monkeypatch.setenv("ASSISTANT_AUTO_TITLE", "false")
        async with serving(load_config()) as (_daemon, wire):
            listed = await wire.request({"type": "models"})
            assert {m["id"]: m["image_tokens"] for m in listed["items"]} == {
                "fake-vision": 1200, "/models/llava-1.5.gguf": 500}
            used = {}
            for model in ("fake-vision", "/models/llava-1.5.gguf"):
                estimate = await wire.request({"type": "estimate", "files": [str(cat)], "model": model})
                assert estimate["files"] == [
                    {"name": "cat.png", "kind": "image", "tokens": listed_cost(listed, model), "truncated": False}]
                router.script(Reply(text="a cat", usage=None))  # no usage: ctx_used is our estimate
                done = (await wire.ask("what is it?", files=[str(cat)], model=model))[-1]
                assert done["type"] == "done", done
                used[model] = done["ctx_used"]
            # the same prompt but for the image's cost
            assert used["fake-vision"] - used["/models/llava-1.5.gguf"] == 1200 - 500


def listed_cost(listed: dict[str, Any], model: str) -> int:
    return next(m["image_tokens"] for m in listed["items"] if m["id"] == model)


async def test_estimate_counts_a_file_that_reports_no_size(wire: Wire) -> None:
    """/proc files say they hold 0 bytes, and ask reads them all the same: so does estimate."""
    cpuinfo = Path("/proc/cpuinfo")
    chars = len(cpuinfo.read_text())
    assert cpuinfo.stat().st_size == 0 and chars > 100
    event = await wire.request({"type": "estimate", "files": [str(cpuinfo)]})
    assert event["type"] == "estimate", event
    assert event["files"][0]["tokens"] >= chars // 4 * 0.9  # it can change a little between reads


async def test_restart_keeps_files_and_their_references(daemon: RunningDaemon, router: FakeRouter, tmp_path: Path) -> None:
    cat = make_png(tmp_path / "cat.png")
    wire = await daemon.connect()
    cid = user_of(await wire.ask("see", files=[str(cat)], model="fake-vision"))["conversation"]
    await wire.close()
    await daemon.stop()
    await daemon.start()
    wire = await daemon.connect()
    try:
        turn = (await wire.request({"type": "open", "conversation": cid}))["turns"][0]
        assert drawn(turn["files"]) == [{"name": "cat.png", "kind": "image", "truncated": False}]
        await wire.ask("again", conversation=cid, model="fake-vision")
        assert len(images_of(router.requests[-1], index=0)) == 1
    finally:
        await wire.close()


async def test_cjk_text_is_cut_before_it_can_overflow_the_context(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    # the fake, like llama-server with SmolLM2, counts two tokens a CJK character
    notes = tmp_path / "notes.md"
    notes.write_text("漢字かな交じり文" * 2500)
    events = await wire.ask("summarise", files=[str(notes)])
    assert events[-1]["type"] == "done", events[-1]
    assert user_of(events)["files"][0]["truncated"] is True


@pytest.mark.parametrize("make, words", [("corrupt", "damaged or incomplete"), ("bomb", "decompression bomb")])
async def test_damaged_and_bomb_images_are_refused(
    wire: Wire, router: FakeRouter, tmp_path: Path, make: str, words: str
) -> None:
    from selfcheck.samples import make_bomb_png, make_corrupt_png

    path = make_corrupt_png(tmp_path / "bad.png") if make == "corrupt" else make_bomb_png(tmp_path / "bomb.png")
    events = await wire.ask("look", files=[str(path)], model="fake-vision")
    assert events[-1]["code"] == "file_refused"
    assert router.requests == []
    assert words in events[-1]["message"]


async def test_a_file_that_blocks_on_read_is_refused_in_time_and_never_holds_a_stop(
    config: Config, router: FakeRouter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/proc/kmsg looks regular and blocks on read: an ask or a kb_add of it once waited for
    ever, and a daemon stopping waited for the thread stuck on it. A FIFO with a writer that
    never writes, taken for a regular file, stands in for it."""
    from core import filethreads, files
    from kbinject import ingest

    kmsg = tmp_path / "kmsg"
    os.mkfifo(kmsg)
    writer = os.open(kmsg, os.O_RDWR | os.O_NONBLOCK)  # held open: a read waits for data, not EOF
    seen_regular = types.SimpleNamespace(**{n: getattr(stat, n) for n in dir(stat) if n.isupper() or n.startswith("S_")})
    seen_regular.S_ISREG = lambda mode: stat.S_ISREG(mode) or stat.S_ISFIFO(mode)
    monkeypatch.setattr(files, "stat", seen_regular)
    monkeypatch.setattr(ingest, "stat", seen_regular)
    monkeypatch.setattr(filethreads, "READ_TIMEOUT", 0.5)
    try:
        async with serving(config) as (_daemon, wire):
            events = await wire.ask("look", files=[str(kmsg)])
            assert events[-1]["code"] == "file_refused" and "did not finish within 0.5 s" in events[-1]["message"]
            rid = await wire.send({"type": "kb_add", "kb": "logs", "paths": [str(kmsg)]})
            added = (await wire.until(rid, ("kb", "error")))[-1]
            assert added["type"] == "kb" and "did not finish within 0.5 s" in added["errors"][0]["reason"]
            monkeypatch.setattr(filethreads, "READ_TIMEOUT", 3600.0)
            await wire.send({"type": "ask", "text": "look again", "files": [str(kmsg)]})  # stuck as the daemon stops
            await wire.send({"type": "kb_add", "kb": "logs", "paths": [str(kmsg)]})
            await wire.request({"type": "status"})  # both lines were read
        # nothing the daemon leaves behind waits on the reads: the loop's own threads end
        async with asyncio.timeout(30):  # a hang guard only
            await asyncio.get_running_loop().shutdown_default_executor()
        stuck = [t for t in threading.enumerate() if t.name.startswith(("file-read", "kb-ingest"))]
        assert stuck and all(t.daemon for t in stuck)  # the process's exit does not wait for them
    finally:
        os.close(writer)  # the stuck reads see the end of the pipe and their threads end


async def test_a_stop_mid_question_leaves_nothing_its_pdf_tools_started(
    daemon: RunningDaemon, wire: Wire, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon stopping while a question's PDF is read kills each poppler tool with its process
    group: what a wrapper around pdftotext started neither outlives the daemon nor holds up its stop.
    (A ``cancel`` waits for the files to be read: the turn stops once its question is stored.)"""
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("pdfinfo", "pdftoppm"):
        (tools / tool).symlink_to(shutil.which(tool) or tool)
    started = tmp_path / "child"
    wrapper = tools / "pdftotext"
    wrapper.write_text(f"#!/bin/sh\n{shutil.which('sleep')} 60 >/dev/null 2>&1 &\necho $! > {started}\nwait\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", str(tools))
    await wire.send({"type": "ask", "text": "read it", "files": [str(make_pdf(tmp_path / "report.pdf", ["text"]))]})
    async with asyncio.timeout(30):  # only against a hang: the tool starts at once
        while not started.exists() or not started.read_text().strip():
            await asyncio.sleep(0.02)
    async with asyncio.timeout(30):  # the stop (0.5 s of grace) waits for nothing the tool left behind
        await daemon.stop()
    handle = os.pidfd_open(int(started.read_text()))
    try:
        assert select.select([handle], [], [], 20)[0], "the wrapper's child outlived the daemon"
    finally:
        os.close(handle)


async def test_a_damaged_video_is_refused_naming_it(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\x00\x00\x00\x18ftypisom" + bytes(range(256)) * 40)
    events = await wire.ask("what is this?", files=[str(broken)])
    assert events[-1]["type"] == "error" and events[-1]["code"] == "file_refused", events[-1]
    assert events[-1]["message"].startswith("broken.mp4: not a readable video (ffprobe: "), events[-1]
    assert events[-1]["message"].endswith("; check the file or attach another copy")
    assert router.requests == []


async def test_a_video_the_boxes_do_not_describe_is_probed(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    """Not an MP4: ffprobe reads its header (bounded in time and output) for the chip and the line."""
    clip = tmp_path / "clip.mkv"
    subprocess.run(["ffmpeg", "-v", "error", "-i", str(make_clip(tmp_path / "clip.mp4")), "-c", "copy", str(clip)],
                   check=True, timeout=60)
    router.script(Reply(text="a clip"))
    [user] = of_type(await wire.ask("what is this?", files=[str(clip)]), "user")
    [chip] = user["files"]
    assert (chip["kind"], chip["width"], chip["height"], round(chip["duration"])) == ("video", 160, 120, 2), chip
    assert "--- file: clip.mkv ---\n[video, 0:02, 160x120, " in text_of(router.requests[-1])
    estimated = await wire.request({"type": "estimate", "text": "and now?", "files": [str(clip)], "conversation": 1})
    assert [(f["kind"], f["truncated"]) for f in estimated["files"]] == [("video", False)]
    assert 0 < estimated["files"][0]["tokens"] < 100


async def test_a_small_video_says_its_size_in_kilobytes(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    """A clip of a few dozen kB once read "0.0 MB" in the model's line: under a megabyte a size is
    said in kB, and the line is the one attachment_recall reads back and the manifest repeats."""
    clip = make_clip(tmp_path / "clip.mp4")
    size = clip.stat().st_size
    assert 1_000 < size < 500_000, size
    router.script(Reply(text="a clip"))
    await wire.ask("what is this?", files=[str(clip)])
    assert f"[video, 0:02, 160x120, {size / 1e3:.1f} kB; you cannot watch it" in text_of(router.requests[-1])


async def test_a_video_of_gigabytes_is_attached_without_reading_it(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    """An 8 GiB video (an MP4 whose header comes first, then a hole) is attached from its boxes:
    the daemon reads a few KiB of it, hashes none of it and stores its path, not its bytes."""
    clip = tmp_path / "clip.mp4"
    subprocess.run(["ffmpeg", "-v", "error", "-i", str(make_clip(tmp_path / "small.mp4")), "-c", "copy",
                    "-movflags", "+faststart", str(clip)], check=True, timeout=60)
    with open(clip, "r+b") as handle:
        handle.truncate(8 << 30)  # sparse: the disk holds the clip alone
    before = read_bytes()
    router.script(Reply(text="a long clip"))
    [user] = of_type(await wire.ask("what is this?", files=[str(clip)]), "user")
    assert read_bytes() - before < 16 << 20  # this process (and the daemon in it) read next to nothing
    assert user["files"][0]["size"] == 8 << 30 and user["files"][0]["sha256"] is None
    assert user["files"][0]["duration"] == 2.0 and "8.6 GB" in text_of(router.requests[-1])


def read_bytes() -> int:
    """The bytes this process has read through read() and its kin so far (Linux /proc)."""
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])
