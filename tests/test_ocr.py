"""Scanned pages and screenshots read by the real tesseract, through the real socket: a
text-only model answers from OCR text, which search, the recall tools and a knowledge base
find later; a vision model gets the page as an image and its text is kept all the same.
And the prompt presets: listed, used, configured and refused.

tesseract takes about a second a page, so these tests are few, each doing a whole story,
and draw few pages; pages that only need to exist are blank (read at once).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from attachments import ocr as ocr_module
from attachments import pdf as pdf_module
from attachments import FileReaders, prepare_files
from client import Wire, of_type
from core import Config, load_config
from history import HistoryStore
from selfcheck.fakerouter import FakeRouter, Reply
from selfcheck.samples import Scan, make_pdf, make_png
from tests.conftest import serving
from tests.test_client import cli

pytestmark = pytest.mark.asyncio

CONFIG = """
ocr_images = true

[presets.translate]
title = "Translate"
kinds = ["text"]
prompt = "Translate the attached file into French."

[presets.summarize]
title = "Sum up"
"""


@pytest.fixture
def config(router: FakeRouter, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Config:
    """conftest's configuration, with image files read by OCR and two configured presets."""
    (tmp_path / "config" / "assistant").mkdir(parents=True)
    (tmp_path / "config" / "assistant" / "config.toml").write_text(CONFIG)
    monkeypatch.setenv("ASSISTANT_ROUTER_URL", router.url)
    monkeypatch.setenv("ASSISTANT_AUTO_TITLE", "false")
    monkeypatch.setenv("ASSISTANT_SHUTDOWN_GRACE", "0.5")
    return load_config()


@pytest.fixture
def tesseract_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the files tesseract is run on (the daemon runs in the test's process)."""
    runs: list[str] = []
    real = ocr_module._tesseract

    async def counted(image: bytes, name: str, languages: str) -> str:
        runs.append(name)
        return await real(image, name, languages)

    monkeypatch.setattr(ocr_module, "_tesseract", counted)
    yield runs


def letter(path: Path) -> Path:
    """A PDF of a typed page (a text layer) and a scanned one (a picture of its text only)."""
    return make_pdf(path, ["Cover letter typed with a text layer.",
                           Scan("The kestrel aviary owes\ninvoice 48213 by Friday", font_px=40)])


def sent_text(request: dict[str, Any]) -> str:
    """The text of the user's messages the router was sent in a request."""
    texts = []
    for message in request["messages"]:
        if message["role"] != "user":
            continue
        content = message.get("content")
        parts = content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
        texts += [p["text"] for p in parts if p.get("type") == "text"]
    return "\n".join(texts)


async def test_a_text_only_model_answers_from_ocr_text_found_again_later(
    wire: Wire, router: FakeRouter, tmp_path: Path, tesseract_runs: list[str]
) -> None:
    pdf = letter(tmp_path / "letter.pdf")
    shot = make_png(tmp_path / "shot.png", (900, 200), "Error 7731 quota exceeded", font_px=36)
    events = await wire.ask("what is owed?", files=[str(pdf), str(shot)])  # fake-text: no vision
    assert events[-1]["type"] == "done", events[-1]
    ocr = [e for e in of_type(events, "progress") if e["stage"] == "ocr"]
    assert ocr and ocr[-1]["done"] == ocr[-1]["total"] == 2 and "2 of 2" in ocr[-1]["detail"]
    assert [e["type"] for e in events].index("user") > events.index(ocr[-1])  # read before it is stored
    sent = sent_text(router.requests[0])
    assert "[page 1]\nCover letter typed" in sent
    assert "[page 2, read by OCR]" in sent and "48213" in sent and "kestrel" in sent.lower()
    assert "--- file: shot.png ---\n[read by OCR]" in sent and "7731" in sent
    assert not any(p.get("type") == "image_url" for p in router.requests[0]["messages"][-1]["content"])
    cid = events[-1]["conversation"]

    # a later turn with the same file reads nothing again; the recall tools return the text
    router.script(
        Reply(tool_calls=[{"id": "r1", "name": "attachment_recall",
                           "arguments": '{"action": "read", "attachment_id": 1, "page": 2}'},
                          {"id": "s1", "name": "conversation_search", "arguments": '{"query": "kestrel aviary"}'}]),
        Reply(text="It is invoice 48213."),
    )
    again = await wire.ask("and again?", files=[str(pdf)], conversation=cid)
    assert again[-1]["type"] == "done" and not [e for e in of_type(again, "progress") if e["stage"] == "ocr"]
    assert sorted(tesseract_runs) == ["letter.pdf", "shot.png"]
    tool_results = [m["content"] for m in router.requests[-1]["messages"] if m.get("role") == "tool"]
    assert "[read by OCR]" in tool_results[0] and "48213" in tool_results[0]
    assert "48213" in tool_results[1]

    found = await wire.request({"type": "search", "query": "kestrel 48213"})
    assert found["conversations"][0]["conversation"] == cid and "48213" in found["conversations"][0]["hits"][0]["excerpt"]
    status = await wire.request({"type": "status"})
    assert status["ocr"] == {"available": True, "languages": ["eng"], "installed": status["ocr"]["installed"],
                             "images": True, "note": None} and "eng" in status["ocr"]["installed"]


async def test_a_vision_model_sees_the_page_and_its_text_is_searched_and_indexed(
    config: Config, router: FakeRouter, tmp_path: Path, tesseract_runs: list[str]
) -> None:
    pdf = letter(tmp_path / "letter.pdf")
    async with serving(dataclasses.replace(config, embedding_model="fake-embed")) as (daemon, wire):
        events = await wire.ask("what is this?", files=[str(pdf)], model="fake-vision")
        assert events[-1]["type"] == "done"
        assert not [e for e in of_type(events, "progress") if e["stage"] == "ocr"]  # read after the question went
        assert daemon.server is not None and daemon.server.engine is not None
        await daemon.server.engine.settle()  # the page is read beside the reply, and kept once it is stored
        question = router.requests[0]["messages"][-1]["content"]
        assert [p["type"] for p in question] == ["text", "text", "image_url"]  # the page goes as an image
        assert "48213" not in sent_text(router.requests[0])
        assert "[page 2: no text layer, sent as an image]" in question[0]["text"]
        found = await wire.request({"type": "search", "query": "48213"})
        assert found["total"] == 1  # its OCR text, stored with the page's reference
        engine = daemon.server.engine
        assert engine is not None
        # what recall reads
        kept = await engine.runner.history.run(HistoryStore.attachment, events[-1]["conversation"], 1)
        assert kept is not None and "[read by OCR]\nThe kestrel aviary owes" in (kept.full_text or "")
        # the conversation moves to a text-only model: the page's text takes the image's place
        cid = events[-1]["conversation"]
        assert (await wire.ask("and the number?", conversation=cid, model="fake-text"))[-1]["type"] == "done"
        replayed = router.requests[-1]["messages"][-3]["content"]
        assert [p["type"] for p in replayed] == ["text", "text", "text"]
        assert replayed[2]["text"].startswith("[image letter.pdf (page 2) read by OCR]\n") and "48213" in replayed[2]["text"]

        rid = await wire.send({"type": "kb_add", "kb": "letters", "paths": [str(pdf)]})
        added = (await wire.until(rid, ("kb", "error")))[-1]
        assert added["type"] == "kb" and added["documents"] == 1
        hits = await wire.request({"type": "kb_search", "kb": "letters", "query": "kestrel aviary invoice"})
        assert any("48213" in hit["content"] and hit["page"] == 2 for hit in hits["results"])
    assert tesseract_runs == ["letter.pdf"]  # the knowledge base took the page's text from the cache


async def test_presets_are_listed_used_configured_and_refused(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    listed = await wire.request({"type": "presets"})
    by_name = {p["name"]: p for p in listed["items"]}
    assert list(by_name) == ["summarize", "explain", "describe", "extract_text", "review", "translate"]
    assert by_name["summarize"]["title"] == "Sum up" and by_name["summarize"]["kinds"] == ["text", "code", "pdf"]
    assert by_name["describe"]["kinds"] == ["image", "scanned"] and by_name["review"]["kinds"] == ["code"]
    code = tmp_path / "tool.py"
    code.write_text("def add(a, b):\n    return a - b\n")
    notes = tmp_path / "notes.txt"
    notes.write_text("Meet at noon by the river.\n")

    # incognito, as the translation below: a preset's prompt, stored as what the user said, shares "attached
    # file" with the others' and would be recalled beside them (tests of recall: test_memory_recall.py)
    events = await wire.ask("be brief", files=[str(code)], preset="review", memory="off")
    assert events[-1]["type"] == "done"
    text = sent_text(router.requests[-1])
    assert text.startswith(by_name["review"]["prompt"] + "\n\nbe brief\n\n--- file: tool.py") and "return a - b" in text
    assert of_type(events, "user")[0]["text"] == by_name["review"]["prompt"] + "\n\nbe brief"
    await wire.ask("", files=[str(notes)], preset="translate", memory="off")
    assert sent_text(router.requests[-1]).startswith("Translate the attached file into French.\n\n--- file: notes.txt")

    asked = len(router.requests)
    unknown = (await wire.ask("x", files=[str(notes)], preset="haiku"))[-1]
    assert unknown["code"] == "not_found" and "summarize, explain" in unknown["message"]
    misfit = (await wire.ask("x", files=[str(code), str(notes)], preset="review"))[-1]
    assert misfit["code"] == "bad_request" and "of the kinds code" in misfit["message"] and "notes.txt" in misfit["message"]
    typed = make_pdf(tmp_path / "typed.pdf", ["A typed page."])
    pdf_misfit = (await wire.ask("", files=[str(typed)], preset="explain"))[-1]
    assert pdf_misfit["code"] == "bad_request" and "of the kinds code, text; typed.pdf" in pdf_misfit["message"]
    assert len(router.requests) == asked
    assert len((await wire.request({"type": "conversations"}))["items"]) == 2  # nothing of the refused stored

    plain = await wire.request({"type": "estimate", "text": "be brief", "files": [str(code)]})
    preset = await wire.request({"type": "estimate", "text": "be brief", "files": [str(code)], "preset": "review"})
    assert preset["tokens"] > plain["tokens"] + 10

    status, out, err = await cli("presets")
    assert status == 0 and "extract_text   Extract text (image, pdf)" in out, err
    status, out, err = await cli("ask", "--preset", "summarize", "-f", str(notes))
    assert status == 0, err
    assert sent_text(router.requests[-1]).startswith(by_name["summarize"]["prompt"])


async def test_without_tesseract_a_scan_is_refused_naming_the_package(
    wire: Wire, router: FakeRouter, tmp_path: Path, no_tesseract: None
) -> None:
    pdf = make_pdf(tmp_path / "scan.pdf", [Scan("hello")])
    error = (await wire.ask("read it", files=[str(pdf)]))[-1]
    assert error["code"] == "no_vision" and error["message"] == (
        "fake-text cannot see images, and scan.pdf has 1 scanned page (no text to read); ask a model that can "
        "(the models request lists them), or leave scan.pdf out (tesseract is not installed: install "
        "tesseract-ocr and tesseract-ocr-eng to read scanned pages)")
    shot = (await wire.ask("see?", files=[str(make_png(tmp_path / "shot.png"))]))[-1]  # ocr_images on, no tesseract
    assert shot["code"] == "no_vision" and shot["message"].endswith("(tesseract is not installed: install "
                                                                    "tesseract-ocr and tesseract-ocr-eng to read scanned pages)")
    assert router.requests == []
    ocr = (await wire.request({"type": "status"}))["ocr"]
    assert ocr["available"] is False and ocr["installed"] == [] and "install tesseract-ocr" in ocr["note"]


async def test_a_language_without_its_data_names_its_package(
    router: FakeRouter, config: Config, tmp_path: Path
) -> None:
    async with serving(dataclasses.replace(config, ocr_languages="eng+zzz_test")) as (_daemon, wire):
        pdf = make_pdf(tmp_path / "scan.pdf", [Scan("hello")])
        error = (await wire.ask("read it", files=[str(pdf)]))[-1]
        assert error["code"] == "no_vision" and error["message"].endswith(
            "(tesseract has no zzz_test language data: install tesseract-ocr-zzz-test to read scanned pages)")
        ocr = (await wire.request({"type": "status"}))["ocr"]
        assert ocr["available"] is False and ocr["languages"] == ["eng", "zzz_test"] and "eng" in ocr["installed"]


async def test_pages_past_the_bound_are_listed_and_a_cancel_reaps_tesseract(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pdf_module, "MAX_OCR_PAGES", 2)
    readers = FileReaders()  # no cache, and asked afresh whether OCR is there
    pdf = make_pdf(tmp_path / "long.pdf", [Scan("")] * 5)  # blank scans: tesseract reads them at once
    told: list[tuple[int, int]] = []
    [prepared] = await prepare_files([str(pdf)], readers, model="m", vision=False, ctx_max=8192, ctx_used=0,
                                     on_ocr=lambda done, total: told.append((done, total)))
    block = prepared.text_block or ""
    assert "[page 2: scanned; OCR found no text on it]" in block
    assert "[page 3: scanned, not read — only 2 pages are read by OCR]" in block and "[page 5: scanned, not read" in block
    assert told[-1] == (2, 2) and prepared.chip.truncated and prepared.read_by_ocr

    # a tesseract that hangs is killed and reaped when the question is cancelled
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("pdfinfo", "pdftoppm", "pdftotext"):
        (tools / tool).symlink_to(shutil.which(tool) or tool)
    pid_file = tmp_path / "pid"
    fake = tools / "tesseract"
    fake.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec {shutil.which('sleep')} 60\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tools))
    # (OCR was found available above, and is kept so: the fake tesseract is not asked)
    one = make_pdf(tmp_path / "one.pdf", [Scan("")])
    task = asyncio.ensure_future(prepare_files([str(one)], readers, model="m", vision=False, ctx_max=8192, ctx_used=0))
    async with asyncio.timeout(30):  # only against a hang: tesseract starts at once
        while not pid_file.exists() or not pid_file.read_text().strip():
            await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)  # killed and reaped, not left behind
    monkeypatch.setattr(ocr_module, "OCR_TIMEOUT", 0.3)  # and one that runs too long: the page is not read
    [slow] = await prepare_files([str(one)], readers, model="m", vision=False, ctx_max=8192, ctx_used=0)
    assert "[page 1: scanned, could not be read by OCR]" in (slow.text_block or "")


async def test_estimate_counts_a_scans_pages_as_ocr_read_them(
    wire: Wire, router: FakeRouter, tmp_path: Path, tesseract_runs: list[str]
) -> None:
    """Issue 45: a scan for a text-only model was estimated as a typed page a page (about 500
    tokens) though OCR had read a few words of it; a page read before counts its text, and the
    estimate reads nothing itself."""
    pdf = letter(tmp_path / "letter.pdf")
    before = await wire.request({"type": "estimate", "files": [str(pdf)]})
    assert before["files"][0]["tokens"] >= 500 and tesseract_runs == []  # a typed page's length, guessed
    events = await wire.ask("what is owed?", files=[str(pdf)])
    assert events[-1]["type"] == "done" and tesseract_runs == ["letter.pdf"]
    after = await wire.request({"type": "estimate", "files": [str(pdf)]})
    assert after["files"][0]["tokens"] < 100, after  # the page's own few words
    assert tesseract_runs == ["letter.pdf"]


async def test_a_new_conversations_estimate_counts_its_system_message_and_tools(wire: Wire) -> None:
    fresh = await wire.request({"type": "estimate", "text": "hello"})
    # the system prompt, the tool guidance and the definitions of the tools a first turn gets
    assert fresh["ctx_used"] > 100, fresh
    events = await wire.ask("hello")
    cid = events[-1]["conversation"]
    continued = await wire.request({"type": "estimate", "text": "hello", "conversation": cid})
    assert continued["ctx_used"] == events[-1]["ctx_used"]  # a conversation's own, as before
