"""Office documents on ``ask`` through the real socket (issue 47 item 4): DOCX, PPTX, XLSX, ODT,
ODS, EPUB and HTML read to text, their chips, paging through ``attachment_recall``, recall of
a folded document, and the refusals of damaged, encrypted and hostile ones.

The documents are written in the test by ``tests/documents.py`` with zipfile."""

from __future__ import annotations

import json
import struct
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from client import Wire, of_type
from core import Config
from history import HistoryStore
from selfcheck.fakerouter import FakeRouter, Reply
from tests.conftest import serving
from tests.documents import (
    A_NS,
    P_NS,
    S_NS,
    W_NS,
    make_docx,
    make_ooxml,
    make_epub,
    make_html,
    make_ods,
    make_odt,
    make_odt_of,
    make_pptx,
    make_xlsx,
    make_zip_bomb,
)
from tests.test_ask_files import drawn, text_of, user_of
from tests.test_recall_injection import FILLER, chat, last_request, question_text, recall_events
from tests.test_tools import call, tool_messages

pytestmark = pytest.mark.asyncio


@pytest.fixture
def router() -> Iterator[FakeRouter]:
    with FakeRouter() as fake:
        fake.embed_dim = 256
        yield fake


def every_kind(folder: Path) -> list[Path]:
    return [
        make_docx(folder / "plan.docx", "Quarterly plan", ["We move in May."], [["Item", "Cost"], ["Chairs", "40"]],
                  ["buy plants"]),
        make_pptx(folder / "deck.pptx", [("Intro", ["Welcome all"]), ("Budget", ["Costs rise by a tenth"])]),
        make_xlsx(folder / "book.xlsx", [("Costs", [["Item", "Price"], ["Desk", 120]]), ("Staff", [["Ana"]])]),
        make_odt(folder / "letter.odt", "Dear neighbour", ["The fence is done."], [["Day", "Task"]]),
        make_ods(folder / "rota.ods", [("Week 1", [["Mon", "Ines"]])]),
        make_epub(folder / "story.epub", [("Chapter One", "It was a dark night."), ("Chapter Two", "Dawn came.")]),
        make_html(folder / "page.html", "Opening hours", ["We open at nine."], [["Sat", "10-14"]]),
    ]


async def test_every_kind_is_read_into_the_prompt_with_its_chip(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    files = every_kind(tmp_path)
    events = await wire.ask("what is in these?", files=[str(f) for f in files])
    assert events[-1]["type"] == "done", events[-1]
    assert drawn(user_of(events)["files"]) == [
        {"name": "plan.docx", "kind": "docx", "truncated": False},
        {"name": "deck.pptx", "kind": "pptx", "pages": 2, "truncated": False},
        {"name": "book.xlsx", "kind": "xlsx", "pages": 2, "truncated": False},
        {"name": "letter.odt", "kind": "odt", "truncated": False},
        {"name": "rota.ods", "kind": "ods", "pages": 1, "truncated": False},
        {"name": "story.epub", "kind": "epub", "pages": 2, "truncated": False},
        {"name": "page.html", "kind": "html", "truncated": False},
    ]
    chip = user_of(events)["files"][0]
    assert chip["size"] == files[0].stat().st_size and len(chip["sha256"]) == 64
    sent = text_of(router.requests[-1])
    for expected in [
        "--- file: plan.docx ---\n# Quarterly plan\nWe move in May.\n- buy plants\n| Item | Cost |\n| --- | --- |\n"
        "| Chairs | 40 |",
        "--- file: deck.pptx (2 slides) ---\n[slide 1]\n# Intro\nWelcome all\n\n[slide 2]\n# Budget\nCosts rise by a tenth",
        "--- file: book.xlsx (2 sheets) ---\n[sheet 1]\n## Costs\n| Item | Price |\n| --- | --- |\n| Desk | 120 |",
        "[sheet 2]\n## Staff\n| Ana |",
        "--- file: letter.odt ---\n# Dear neighbour\nThe fence is done.\n| Day | Task |",
        "--- file: rota.ods (1 sheet) ---\n[sheet 1]\n## Week 1\n| Mon | Ines |",
        "--- file: story.epub (2 chapters) ---\n[chapter 1]\n# Chapter One\nIt was a dark night.",
        "--- file: page.html ---\n## Opening hours\nWe open at nine.\n| Sat | 10-14 |",
    ]:
        assert expected in sent
    # what no reader shows: the page's script and style, the ODS's million empty rows
    assert "hidden" not in sent and "color: red" not in sent and sent.count("| Mon | Ines |") == 1
    opened = await wire.request({"type": "open", "conversation": user_of(events)["conversation"]})
    assert opened["turns"][0]["files"] == user_of(events)["files"]


async def test_a_document_is_told_by_its_content_not_its_name(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    docx = make_docx(tmp_path / "download", "Minutes", ["Nothing was decided."])
    odt = make_odt(tmp_path / "letter.zip", "Hello", ["From the odt."])
    page = tmp_path / "saved"
    page.write_text("<!DOCTYPE html>\n<html><body><h1>Saved page</h1><p>Body text.</p></body></html>")
    snippet = tmp_path / "snippet.txt"  # a text suffix wins over the content, as it always has
    snippet.write_text("<html><body><b>bold</b></body></html>\n")
    events = await wire.ask("read", files=[str(docx), str(odt), str(page), str(snippet)])
    assert [c["kind"] for c in user_of(events)["files"]] == ["docx", "odt", "html", "text"]
    sent = text_of(router.requests[-1])
    assert "<b>bold</b>" in sent
    assert "# Minutes\nNothing was decided." in sent and "# Hello\nFrom the odt." in sent
    assert "# Saved page\nBody text." in sent and "<h1>" not in sent


async def test_a_deck_is_paged_by_its_slides_through_attachment_recall(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    deck = make_pptx(tmp_path / "deck.pptx", [(f"Slide title {n}", [f"Point {n}"]) for n in range(1, 4)])
    events = await wire.ask("keep this", files=[str(deck)])
    cid = user_of(events)["conversation"]
    router.script(
        call("attachment_recall", {"action": "list"}),
        call("attachment_recall", {"action": "read", "attachment_id": 1, "page": 2}, "call_2"),
        call("attachment_recall", {"action": "read", "attachment_id": 1, "max_chars": 30}, "call_3"),
        call("attachment_recall", {"action": "read", "attachment_id": 1, "offset": 30}, "call_4"),
        Reply(text="ok"),
    )
    events = await wire.ask("what does slide 2 say?", conversation=cid)
    assert [t["ok"] for t in of_type(events, "tool")] == [True, True, True, True]
    listing, page, first, rest = (json.loads(m["content"]) for m in tool_messages(router.requests[-1]))
    assert listing["attachments"][0]["pages"] == 3
    assert page["page"] == 2 and page["content"] == "# Slide title 2\nPoint 2" and page["pages"] == 3
    assert first["content"].startswith("[slide 1]\n# Slide title 1") and first["next_offset"] == 30
    assert rest["next_offset"] is None and (first["content"] + rest["content"]).endswith("[slide 3]\n# Slide title 3\nPoint 3")


MOVE = ["The new office is on the fourth floor.", "The movers come on 12 May, a Tuesday."]


@pytest.mark.parametrize(
    ("make", "listed", "label"),
    [
        (lambda d: make_docx(d / "plan.docx", "Office move", MOVE), "plan.docx (DOCX; turn 1)",
         "plan.docx (attached in turn 1): "),
        (lambda d: make_pptx(d / "plan.pptx", [("Office move", MOVE[:1]), ("Dates", MOVE[1:])]),
         "plan.pptx (PPTX, 2 slides; turn 1)", "plan.pptx, slide 2: "),
        (lambda d: make_xlsx(d / "plan.xlsx", [("Floors", [["Floor", "4"]]), ("Dates", [[MOVE[1]]])]),
         "plan.xlsx (XLSX, 2 sheets; turn 1)", "plan.xlsx, sheet 2: "),
    ],
)
async def test_a_detail_of_a_folded_document_is_recalled(
    config: Config, router: FakeRouter, tmp_path: Path, make: Callable[[Path], Path], listed: str,
    label: str,
) -> None:
    plan = make(tmp_path)
    async with serving(config) as (_, wire):
        router.script(Reply(text="Noted."))
        events = await wire.ask("Here is the plan.", files=[str(plan)])
        assert events[-1]["type"] == "done", events[-1]
        cid = events[-1]["conversation"]
        await chat(wire, router, cid, FILLER[:3])
    with HistoryStore(config.db_path) as store:  # a compaction folds the document's turn away
        store.add_compaction(cid, 2, "The user shared a plan and asked about tea.")
    async with serving(config) as (_, wire):
        router.script(Reply(text="On 12 May."))
        events = await wire.ask("When do the movers come?", conversation=cid)
        assert events[-1]["type"] == "done", events[-1]
        sent = last_request(router)
        assert "movers" not in json.dumps(sent["messages"][:-1])
        assert f"- id 1: {listed}" in sent["messages"][0]["content"]  # the manifest
        assert label in question_text(sent)  # a paged kind labelled by its page's unit
        assert "The movers come on 12 May" in question_text(sent)
        assert [(s["recall"], s["file"]) for s in recall_events(events)[0]["sources"]] == [("file", plan.name)]


def _billion_laughs(path: Path) -> Path:
    lol = ('<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">'
           + "".join(f'<!ENTITY lol{n} "{f"&lol{n - 1};" * 10 if n > 1 else "&lol;" * 10}">' for n in range(1, 10))
           + ']><w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"><w:body><w:p>'
           '<w:r><w:t>&lol9;</w:t></w:r></w:p></w:body></w:document>')
    return make_ooxml(path, "word/document.xml", {"word/document.xml": lol})


def _damaged(path: Path) -> Path:
    whole = make_docx(path, "Heading", ["Some text"]).read_bytes()
    path.write_bytes(whole[: len(whole) // 2])  # cut short, as a broken download is
    return path


def _ole2(path: Path) -> Path:
    path.write_bytes(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(2048))  # how Office saves an encrypted DOCX
    return path


def _plain_zip(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("photo.txt", "not a document")
    return path


def _lying_count(path: Path) -> Path:
    """A DOCX of 10,001 members whose end record says it holds one: zipfile reads the directory,
    not the count."""
    make_docx(path, "Heading", ["Some text"])
    with zipfile.ZipFile(path, "a") as archive:
        for n in range(10_001):
            archive.writestr(f"x/{n}", "")
    whole = bytearray(path.read_bytes())
    whole[-22 + 8 : -22 + 12] = (1).to_bytes(2, "little") * 2  # this disk's entries and all (no comment)
    path.write_bytes(bytes(whole))
    return path


def _long_names(path: Path) -> Path:
    """A DOCX of 9,000 members (fewer than the cap) whose names make its list of files 5.8 MB."""
    make_docx(path, "Heading", ["Some text"])
    with zipfile.ZipFile(path, "a") as archive:
        for n in range(9_000):
            archive.writestr(f"{n:0600}", "")
    return path


@pytest.mark.parametrize(
    ("make", "code", "words"),
    [
        (lambda d: _damaged(d / "broken.docx"), "file_refused", "broken.docx: not a readable DOCX"),
        (lambda d: _long_names(d / "names.docx"), "file_refused", "names.docx: the archive's list of files is over 5 MB"),
        (lambda d: make_zip_bomb(d / "bomb.docx"), "file_refused", "bomb.docx: the DOCX unpacks to more than 32 MB"),
        (lambda d: _billion_laughs(d / "lol.docx"), "file_refused", "declares XML entities"),
        (lambda d: _lying_count(d / "many.docx"), "file_refused", "many.docx: the archive holds too many files"),
        (lambda d: _ole2(d / "locked.docx"), "file_refused", "locked.docx: the DOCX is password-protected"),
        (lambda d: make_epub(d / "drm.epub", [("One", "x")], encrypted=True), "file_refused", "protected by DRM"),
        (lambda d: _plain_zip(d / "photos.zip"), "unsupported_kind",
         "photos.zip: chat supports text, images, PDF, documents (DOCX, PPTX, XLSX, ODT, ODS, EPUB, HTML) and videos"),
    ],
)
async def test_damaged_hostile_and_unknown_files_are_refused_and_the_daemon_lives(
    wire: Wire, router: FakeRouter, tmp_path: Path, make: Any, code: str, words: str
) -> None:
    events = await wire.ask("look", files=[str(make(tmp_path))])
    assert events[-1]["type"] == "error"
    assert (events[-1]["code"], events[-1]["turn"]) == (code, 1)
    assert words in events[-1]["message"]
    assert router.requests == [] and (await wire.request({"type": "conversations"}))["items"] == []
    fine = make_docx(tmp_path / "fine.docx", "Still here", ["The daemon answers."])
    events = await wire.ask("and this?", files=[str(fine)])
    assert events[-1]["type"] == "done" and "The daemon answers." in text_of(router.requests[-1])


def _zip64(path: Path) -> Path:
    """A DOCX whose end record leaves its count to a ZIP64 end record, as some writers always do."""
    whole = make_docx(path, "Heading", ["Some text"]).read_bytes()
    end = whole[-22:]  # no comment
    entries, size, offset = struct.unpack("<HII", end[10:20])
    record = struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, entries, entries, size, offset)
    locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, len(whole) - 22, 1)
    path.write_bytes(whole[:-22] + record + locator + end[:8] + struct.pack("<HH", 0xFFFF, 0xFFFF) + end[12:])
    return path


async def test_a_document_with_zip64_records_is_read(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    events = await wire.ask("read", files=[str(_zip64(tmp_path / "report.docx"))])  # was "too many files"
    assert events[-1]["type"] == "done", events[-1]
    assert "# Heading\nSome text" in text_of(router.requests[-1])


async def test_tables_nested_deep_are_walked_once(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    depth = 2000  # a 100 KB document: a table handed every nested table's rows took minutes and gigabytes
    xml = (f'<?xml version="1.0"?><w:document xmlns:w="{W_NS}"><w:body>'
           + "<w:tbl><w:tr><w:tc><w:p><w:r><w:t>cell</w:t></w:r></w:p>" * depth
           + "</w:tc></w:tr></w:tbl>" * depth + "</w:body></w:document>")
    nested = make_ooxml(tmp_path / "nested.docx", "word/document.xml", {"word/document.xml": xml})
    events = await wire.ask("read", files=[str(nested)])
    assert events[-1]["type"] == "done", events[-1]
    assert "| cell cell cell" in text_of(router.requests[-1])  # the nested tables' text, in its cell


def _with_part(path: Path, part: str, xml: str) -> Path:
    """The document at ``path`` with its member ``part`` written anew as ``xml``."""
    with zipfile.ZipFile(path) as archive:
        parts = {name: archive.read(name) for name in archive.namelist()}
    parts[part] = xml.encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in parts.items():
            archive.writestr(name, data)
    return path


async def test_a_shape_in_groups_nested_deep_is_read(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    depth = 3000  # deeper than Python's recursion limit: the slide is walked without recursion
    deck = _with_part(make_pptx(tmp_path / "deck.pptx", [("Title", ["body"])]), "ppt/slides/slide1.xml",
                      f'<?xml version="1.0"?><p:sld xmlns:p="{P_NS}" xmlns:a="{A_NS}"><p:cSld><p:spTree>'
                      + "<p:grpSp>" * depth
                      + "<p:sp><p:txBody><a:p><a:r><a:t>Deep inside</a:t></a:r></a:p></p:txBody></p:sp>"
                      + "</p:grpSp>" * depth + "</p:spTree></p:cSld></p:sld>")
    events = await wire.ask("read", files=[str(deck)])
    assert events[-1]["type"] == "done", events[-1]
    assert "Deep inside" in text_of(router.requests[-1])


async def test_a_shared_string_of_many_runs_is_read_at_once(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    runs = "<r><t>ab</t></r>" * 100_000  # each run looked its string's phonetic runs up again
    book = _with_part(make_xlsx(tmp_path / "book.xlsx", [("Sheet", [["first"]])]), "xl/sharedStrings.xml",
                      f'<?xml version="1.0"?><sst xmlns="{S_NS}"><si>{runs}</si></sst>')
    events = await wire.ask("read", files=[str(book)])
    assert events[-1]["type"] == "done", events[-1]
    assert "| abababab" in text_of(router.requests[-1])


async def test_a_page_that_leaves_its_head_unclosed_is_read(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    page = tmp_path / "menu.html"  # HTML may leave </head> out: the body's start ends it
    page.write_text("<!DOCTYPE html><html><head><meta charset=utf-8><title>Menu</title>"
                    "<body><h1>Today</h1><p>Soup of the day.</p><script>var x;</script>")
    events = await wire.ask("what is on?", files=[str(page)])
    assert events[-1]["type"] == "done"
    sent = text_of(router.requests[-1])
    assert "# Today\nSoup of the day." in sent and "var x" not in sent


async def test_an_odt_asking_for_many_spaces_gets_at_most_a_thousand(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    odt = make_odt_of(tmp_path / "spaces.odt", '<text:p>Hello<text:s text:c="100000"/>world</text:p>')
    events = await wire.ask("read", files=[str(odt)])  # a billion would take gigabytes
    assert events[-1]["type"] == "done"
    assert "Hello" + " " * 1000 + "world" in text_of(router.requests[-1])


async def test_a_file_opening_with_many_comments_is_told_apart_from_html_at_once(
    wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    notes = tmp_path / "notes"  # no suffix: its start is looked at for an html page
    notes.write_text("<!---->" * 64 + "<p>not a page</p>\n")  # tried every way to split them, it never ended
    events = await wire.ask("what is this?", files=[str(notes)])
    assert events[-1]["type"] == "done"
    assert [c["kind"] for c in user_of(events)["files"]] == ["text"]
    assert "<p>not a page</p>" in text_of(router.requests[-1])


async def test_estimate_counts_a_documents_text(wire: Wire, tmp_path: Path) -> None:
    deck = make_pptx(tmp_path / "deck.pptx", [("Title", ["word " * 400])])
    estimated = await wire.request({"type": "estimate", "text": "", "files": [str(deck)]})
    [item] = estimated["files"]
    assert item["kind"] == "pptx" and not item["truncated"] and 400 < item["tokens"] < 1000
