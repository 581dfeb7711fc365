"""The recall tools on a real history: attachment_recall, conversation_search, the manifest.

One file for the three, past the usual length, because they share their fixtures (a
history on disk, turns stored as the daemon stores them, files attached to them) and
their scoping rule (nothing of another conversation is reachable). The framework they
run in is tested in test_toolbox.py."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from PIL import Image

from attachments import ImageCache
from core.tools import Tool, Toolbox, ToolContext, ToolResult
from history import AsyncHistory, Attachment, HistoryStore, NewAttachment, NewTurn, TurnOutcome
from recall import (
    AttachmentRecall,
    ConversationSearch,
    attachment_manifest,
    default_toolbox,
    document_pages,
)
from recall import attachment_recall as recall_module
from recall.conversation_search import NOTHING_EARLIER, NOTHING_FOUND

LONG_TEXT = "".join(f"line {i:04d} of the design notes\n" for i in range(400))  # 12,000 chars
PDF_TEXT = "Introduction to otters.\fOtters eat fish.\f   \n\fAppendix: river maps."


@pytest_asyncio.fixture
async def history(tmp_path: Path) -> AsyncIterator[AsyncHistory]:
    opened = await AsyncHistory.open(tmp_path / "data" / "history.db")
    yield opened
    await opened.close()


def context(history: AsyncHistory, cid: int, *, turn: int = 2, max_chars: int = 20_000, vision: bool = True) -> ToolContext:
    return ToolContext(conversation=cid, history=history, max_chars=max_chars, vision=vision, turn=turn)


async def add_turn(
    history: AsyncHistory,
    cid: int | None,
    question: str,
    answer: str = "ok",
    attachments: Sequence[NewAttachment] = (),
) -> tuple[int, int]:
    """A whole turn, stored as the daemon stores one: (conversation, turn)."""
    asked = {"role": "user", "content": question}

    new = NewTurn(cid, question, [asked], [], "m", "t", attachments=attachments)
    conversation, turn = await history.run(HistoryStore.start_turn, new)
    answered = [asked, {"role": "assistant", "content": answer}]
    assert await history.finish(TurnOutcome(conversation.id, turn.turn, answered, answer, "complete"))
    return conversation.id, turn.turn


def text_file(name: str, text: str, kind: str = "text") -> NewAttachment:
    mime = "application/pdf" if kind == "pdf" else "text/plain"
    pages = len(text.split("\f")) if kind == "pdf" else None
    return NewAttachment(name=name, path=f"/nowhere/{name}", kind=kind, content_type=mime,
                         size_bytes=len(text.encode()), sha256="0" * 64, pages=pages, full_text=text)


def png_file(path: Path, color: tuple[int, int, int] = (200, 30, 30)) -> NewAttachment:
    Image.new("RGB", (6, 4), color).save(path, format="PNG")
    data = path.read_bytes()
    return NewAttachment(name=path.name, path=str(path), kind="image", content_type="image/png",
                         size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


async def attachment_ids(history: AsyncHistory, cid: int) -> dict[str, int]:
    return {a.name: a.id for a in await history.run(HistoryStore.attachments, cid)}


async def call(tool: Tool, ctx: ToolContext, **arguments: Any) -> ToolResult:
    """Through the Toolbox, as the daemon calls: errors come back as results."""
    toolbox = Toolbox([tool])
    return await toolbox.call(await toolbox.offer(ctx), tool.name, json.dumps(arguments), ctx)


def body(result: ToolResult) -> Any:
    assert result.ok, result.content
    return json.loads(result.content)


# -- the tools' definitions --------------------------------------------------------------


def test_definition_is_the_openai_tools_format() -> None:
    definition = ConversationSearch().definition()
    assert definition["type"] == "function"
    function = definition["function"]
    assert function["name"] == "conversation_search"
    assert function["parameters"]["required"] == ["query"]
    assert function["parameters"]["properties"]["role_filter"]["enum"] == ["all", "user", "assistant"]
    recall = AttachmentRecall().definition()["function"]
    assert recall["parameters"]["properties"]["action"]["enum"] == ["list", "read"]
    assert [t.name for t in default_toolbox(ImageCache()).tools] == ["conversation_search", "attachment_recall"]


# -- attachment_recall: list and scoping -------------------------------------------------


@pytest.mark.asyncio
async def test_recall_is_offered_only_with_attachments(history: AsyncHistory) -> None:
    tool = AttachmentRecall()
    bare, _ = await add_turn(history, None, "no files")
    with_file, _ = await add_turn(history, None, "a file", attachments=[text_file("a.txt", "alpha")])
    assert await tool.available(context(history, bare)) is False
    assert await tool.available(context(history, with_file)) is True
    await history.run(HistoryStore.delete_conversation, with_file)
    assert await tool.available(context(history, with_file)) is False


@pytest.mark.asyncio
async def test_list_shows_this_conversations_files(history: AsyncHistory, tmp_path: Path) -> None:
    cid, _ = await add_turn(history, None, "files", attachments=[text_file("notes.txt", "alpha beta")])
    await add_turn(history, cid, "more", attachments=[text_file("otters.pdf", PDF_TEXT, "pdf"), png_file(tmp_path / "red.png")])
    await add_turn(history, None, "elsewhere", attachments=[text_file("secret.txt", "not yours")])
    listed = body(await call(AttachmentRecall(), context(history, cid), action="list"))
    assert listed["count"] == 3
    assert [a["filename"] for a in listed["attachments"]] == ["notes.txt", "otters.pdf", "red.png"]
    first = listed["attachments"][0]
    assert set(first) >= {"id", "filename", "content_type", "size_bytes", "has_text", "pages", "created_at"}
    assert (first["content_type"], first["size_bytes"], first["has_text"]) == ("text/plain", 10, True)
    assert listed["attachments"][1]["pages"] == 4
    assert listed["attachments"][2]["has_text"] is False


@pytest.mark.asyncio
async def test_a_long_list_keeps_the_newest_that_fit(history: AsyncHistory) -> None:
    files = [text_file(f"file{i:02d}.txt", "x") for i in range(30)]
    cid, _ = await add_turn(history, None, "many", attachments=files)
    result = await call(AttachmentRecall(), context(history, cid, max_chars=1500), action="list")
    listed = body(result)
    assert len(result.content) <= 1500
    assert listed["count"] == 30 and listed["shown"] == len(listed["attachments"]) < 30
    assert listed["attachments"][-1]["filename"] == "file29.txt"


@pytest.mark.asyncio
async def test_an_id_from_another_conversation_is_not_found(history: AsyncHistory) -> None:
    mine, _ = await add_turn(history, None, "mine", attachments=[text_file("mine.txt", "my text")])
    theirs, _ = await add_turn(history, None, "theirs", attachments=[text_file("theirs.txt", "their secret")])
    their_id = (await attachment_ids(history, theirs))["theirs.txt"]
    result = await call(AttachmentRecall(), context(history, mine), action="read", attachment_id=their_id)
    assert (result.ok, result.content) == (
        False, f"Error: no attachment {their_id} in this conversation; call action=list"
    )
    assert "secret" not in result.content


@pytest.mark.asyncio
async def test_a_deleted_conversations_files_are_gone(history: AsyncHistory) -> None:
    cid, _ = await add_turn(history, None, "doomed", attachments=[text_file("gone.txt", "bye")])
    file_id = (await attachment_ids(history, cid))["gone.txt"]
    tool, ctx = AttachmentRecall(), context(history, cid)
    offered = [tool]  # offered before the delete, called after it
    await history.run(HistoryStore.delete_conversation, cid)
    result = await Toolbox([tool]).call(offered, tool.name, json.dumps({"action": "read", "attachment_id": file_id}), ctx)
    assert not result.ok and "no attachment" in result.content
    assert body(await Toolbox([tool]).call(offered, tool.name, '{"action": "list"}', ctx))["count"] == 0


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        # checked against the tool's schema before it runs (core/argschema.py)
        ({"action": "delete"}, 'action must be one of: list, read; not "delete"'),
        ({}, "action is required"),
        ({"action": "read"}, "action=read needs attachment_id"),
        ({"action": "read", "attachment_id": "two"}, "attachment_id must be an integer"),
        ({"action": "read", "attachment_id": True}, "attachment_id must be an integer"),
        ({"action": "read", "attachment_id": 999}, "no attachment 999 in this conversation"),
        ({"action": "read", "attachment_id": 2**63}, "attachment_id 9223372036854775808 is out of range"),
        ({"action": "read", "attachment_id": 1, "offset": -(2**70)}, "offset"),
        ({"action": 7}, "action must be a string, not 7"),
    ],
)
async def test_bad_recall_arguments(history: AsyncHistory, arguments: dict[str, Any], message: str) -> None:
    cid, _ = await add_turn(history, None, "f", attachments=[text_file("f.txt", "text")])
    result = await call(AttachmentRecall(), context(history, cid), **arguments)
    assert not result.ok and message in result.content


# -- attachment_recall: text and PDF -----------------------------------------------------


@pytest.mark.asyncio
async def test_read_a_short_text_file(history: AsyncHistory) -> None:
    cid, _ = await add_turn(history, None, "f", attachments=[text_file("notes.txt", "alpha beta")])
    file_id = (await attachment_ids(history, cid))["notes.txt"]
    # a numeric string is accepted: models often send ids as strings
    result = await call(AttachmentRecall(), context(history, cid), action="read", attachment_id=str(file_id))
    read = body(result)
    assert read == {
        "id": file_id, "filename": "notes.txt", "content_type": "text/plain",
        "content_type_returned": "text", "pages": None, "offset": 0, "returned_chars": 10,
        "total_chars": 10, "next_offset": None, "content": "alpha beta",
    }
    assert result.images == [] and "notes.txt" in result.summary


@pytest.mark.asyncio
async def test_paging_through_a_long_document_gives_it_all_back(history: AsyncHistory) -> None:
    cid, _ = await add_turn(history, None, "f", attachments=[text_file("design.md", LONG_TEXT)])
    file_id = (await attachment_ids(history, cid))["design.md"]
    ctx = context(history, cid, max_chars=3000)
    pieces, offset, reads = [], 0, 0
    while offset is not None:
        result = await call(AttachmentRecall(), ctx, action="read", attachment_id=file_id, offset=offset)
        read = body(result)
        assert len(result.content) <= ctx.max_chars
        assert read["offset"] == offset and read["total_chars"] == len(LONG_TEXT)
        pieces.append(read["content"])
        offset = read["next_offset"]
        reads += 1
    assert "".join(pieces) == LONG_TEXT
    assert reads == 5  # each read as large as the context allows (~2,600 characters)


@pytest.mark.asyncio
async def test_max_chars_is_capped_by_the_context(history: AsyncHistory) -> None:
    cid, _ = await add_turn(history, None, "f", attachments=[text_file("design.md", LONG_TEXT)])
    file_id = (await attachment_ids(history, cid))["design.md"]
    small = body(await call(AttachmentRecall(), context(history, cid), action="read", attachment_id=file_id, max_chars=100, offset=31))
    assert (small["returned_chars"], small["next_offset"]) == (100, 131)
    assert small["content"] == LONG_TEXT[31:131]
    huge = body(await call(AttachmentRecall(), context(history, cid, max_chars=2000), action="read", attachment_id=file_id, max_chars=10**6))
    assert huge["returned_chars"] == 2000 - recall_module.ENVELOPE_CHARS


@pytest.mark.asyncio
async def test_json_escapes_still_fit_the_context(history: AsyncHistory) -> None:
    nasty = '"\\\n' * 2000  # every character doubles in JSON
    cid, _ = await add_turn(history, None, "f", attachments=[text_file("q.txt", nasty)])
    file_id = (await attachment_ids(history, cid))["q.txt"]
    result = await call(AttachmentRecall(), context(history, cid, max_chars=1000), action="read", attachment_id=file_id)
    assert len(result.content) <= 1000
    assert body(result)["content"] == nasty[: body(result)["returned_chars"]]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("arguments", "ctx_chars", "message"),
    [
        ({"offset": 12_000}, 20_000, "offset 12000 is outside the text (0 to 11999)"),
        ({"offset": -1}, 20_000, "offset -1 is outside the text"),
        ({"max_chars": 0}, 20_000, "max_chars must be at least 1"),
        ({}, 500, "there is no room left in the context"),
        ({"page": 1}, 20_000, "design.md has no pages"),
    ],
)
async def test_bad_reads(history: AsyncHistory, arguments: dict[str, Any], ctx_chars: int, message: str) -> None:
    cid, _ = await add_turn(history, None, "f", attachments=[text_file("design.md", LONG_TEXT)])
    file_id = (await attachment_ids(history, cid))["design.md"]
    result = await call(AttachmentRecall(), context(history, cid, max_chars=ctx_chars), action="read", attachment_id=file_id, **arguments)
    assert not result.ok and message in result.content


@pytest.mark.asyncio
async def test_read_one_page_of_a_pdf(history: AsyncHistory) -> None:
    cid, _ = await add_turn(history, None, "f", attachments=[text_file("otters.pdf", PDF_TEXT, "pdf")])
    file_id = (await attachment_ids(history, cid))["otters.pdf"]
    tool, ctx = AttachmentRecall(), context(history, cid)
    page = body(await call(tool, ctx, action="read", attachment_id=file_id, page=2))
    assert (page["page"], page["pages"], page["content"], page["next_offset"]) == (2, 4, "Otters eat fish.", None)
    scanned = body(await call(tool, ctx, action="read", attachment_id=file_id, page=3))
    assert scanned["content"].startswith("[page 3 has no text layer: it is probably a scanned image")
    missing = await call(tool, ctx, action="read", attachment_id=file_id, page=5)
    assert not missing.ok and "text for pages 1 to 4; not page 5" in missing.content
    # offset pages within the page
    part = body(await call(tool, ctx, action="read", attachment_id=file_id, page=4, offset=10, max_chars=5))
    assert (part["content"], part["next_offset"]) == ("river", 15)


@pytest.mark.asyncio
async def test_a_whole_pdf_read_shows_its_pages(history: AsyncHistory) -> None:
    cid, _ = await add_turn(history, None, "f", attachments=[text_file("otters.pdf", PDF_TEXT, "pdf")])
    file_id = (await attachment_ids(history, cid))["otters.pdf"]
    read = body(await call(AttachmentRecall(), context(history, cid), action="read", attachment_id=file_id))
    content = read["content"]
    assert content.startswith("[page 1]\nIntroduction to otters.\n\n[page 2]\nOtters eat fish.")
    assert "[page 3]\n[page 3 has no text layer" in content
    assert content.endswith("[page 4]\nAppendix: river maps.")
    assert "\f" not in content and read["total_chars"] == len(content)


@pytest.mark.asyncio
async def test_a_pdf_without_any_text_says_so(history: AsyncHistory) -> None:
    scan = text_file("scan.pdf", "", "pdf")
    cid, _ = await add_turn(history, None, "f", attachments=[scan])
    file_id = (await attachment_ids(history, cid))["scan.pdf"]
    result = await call(AttachmentRecall(), context(history, cid), action="read", attachment_id=file_id)
    assert not result.ok and "scan.pdf has no text layer (a scanned PDF?)" in result.content


def test_document_pages() -> None:
    assert document_pages("one\ftwo\f") == ["one", "two", ""]
    assert document_pages("no markers at all") == ["no markers at all"]
    assert document_pages("[page 1]\nfirst\n[page 2]\nsecond\nmore\n") == ["first", "second\nmore"]
    assert document_pages("see [page 2] inline") == ["see [page 2] inline"]  # only whole lines mark


# -- attachment_recall: images -------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_image_is_shown_to_a_vision_model(history: AsyncHistory, tmp_path: Path) -> None:
    image = png_file(tmp_path / "chart.png")
    cid, _ = await add_turn(history, None, "look", attachments=[image])
    file_id = (await attachment_ids(history, cid))["chart.png"]
    result = await call(AttachmentRecall(), context(history, cid, vision=True), action="read", attachment_id=file_id)
    read = body(result)
    assert read["content_type_returned"] == "base64_image"
    assert (read["id"], read["filename"], read["content_type"]) == (file_id, "chart.png", "image/png")
    expected = "data:image/png;base64," + base64.b64encode((tmp_path / "chart.png").read_bytes()).decode()
    assert result.images == [{"type": "image_url", "image_url": {"url": expected}}]
    assert "base64," not in result.content  # the model reads the image, not its text
    assert "chart.png" in result.summary


@pytest.mark.asyncio
async def test_an_image_for_a_model_without_vision_is_refused(history: AsyncHistory, tmp_path: Path) -> None:
    cid, _ = await add_turn(history, None, "look", attachments=[png_file(tmp_path / "chart.png")])
    file_id = (await attachment_ids(history, cid))["chart.png"]
    result = await call(AttachmentRecall(), context(history, cid, vision=False), action="read", attachment_id=file_id)
    assert not result.ok and result.images == []
    assert "cannot see images" in result.content and "vision model" in result.content


@pytest.mark.asyncio
@pytest.mark.parametrize("change", ["repainted", "same size, other bytes", "deleted", "grown"])
async def test_a_changed_or_missing_image_is_refused(history: AsyncHistory, tmp_path: Path, change: str) -> None:
    path = tmp_path / "photo.png"
    cid, _ = await add_turn(history, None, "look", attachments=[png_file(path)])
    file_id = (await attachment_ids(history, cid))["photo.png"]
    if change == "repainted":
        png_file(path, color=(0, 0, 255))
    elif change == "same size, other bytes":
        data = bytearray(path.read_bytes())
        data[-20] ^= 0xFF
        path.write_bytes(bytes(data))
    elif change == "deleted":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes() + b"\0" * 10)
    result = await call(AttachmentRecall(), context(history, cid), action="read", attachment_id=file_id)
    assert (result.ok, result.content) == (
        False, "Error: the file has changed or is gone; ask the user to attach it again"
    )
    assert result.images == []


@pytest.mark.asyncio
async def test_an_image_too_large_for_base64_is_refused(
    history: AsyncHistory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = png_file(tmp_path / "big.png")
    cid, _ = await add_turn(history, None, "look", attachments=[image])
    file_id = (await attachment_ids(history, cid))["big.png"]
    monkeypatch.setattr(recall_module, "MAX_IMAGE_BASE64", image.size_bytes)  # base64 is 4/3 larger
    result = await call(AttachmentRecall(), context(history, cid), action="read", attachment_id=file_id)
    assert not result.ok and "too large to show again" in result.content
    assert "attach a smaller version" in result.content


# -- conversation_search -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_search_is_offered_from_the_first_turn(history: AsyncHistory) -> None:
    # a tool appearing on turn 2 would change the top of the prompt the server caches
    tool = ConversationSearch()
    assert await tool.available(context(history, 1, turn=1)) is True
    assert await tool.available(context(history, 1, turn=2)) is True


@pytest.mark.asyncio
async def test_search_finds_earlier_messages(history: AsyncHistory) -> None:
    cid, _ = await add_turn(history, None, "my budget is 4200 euros", "noted, a budget of 4200")
    await add_turn(history, cid, "unrelated", "unrelated too")
    result = await call(ConversationSearch(), context(history, cid, turn=3), query="budget")
    found = body(result)
    assert (found["query"], found["total"], found["conversation"]) == ("budget", 2, cid)
    assert {(r["turn"], r["role"]) for r in found["results"]} == {(1, "user"), (1, "assistant")}
    first = found["results"][0]
    assert set(first) == {"turn", "role", "excerpt", "timestamp", "rank"}
    assert "[budget]" in first["excerpt"] and first["rank"] > 0
    assert first["timestamp"].endswith("Z")
    assert result.summary == "searched for 'budget': 2 results"


@pytest.mark.asyncio
async def test_search_leaves_out_the_turn_being_answered(history: AsyncHistory) -> None:
    cid, _ = await add_turn(history, None, "the kiwi fruit", "green inside")
    await add_turn(history, cid, "what did I say about kiwi?", "")
    found = body(await call(ConversationSearch(), context(history, cid, turn=2), query="kiwi"))
    assert [r["turn"] for r in found["results"]] == [1]


@pytest.mark.asyncio
async def test_search_role_filter_and_result_count(history: AsyncHistory) -> None:
    cid, _ = await add_turn(history, None, "llama one", "llama reply one")
    for i in range(24):
        await add_turn(history, cid, f"llama {i}", "ok")
    tool, ctx = ConversationSearch(), context(history, cid, turn=26)
    assert body(await call(tool, ctx, query="llama"))["total"] == 5
    assert body(await call(tool, ctx, query="llama", max_results=0))["total"] == 1
    assert body(await call(tool, ctx, query="llama", max_results=50))["total"] == 20
    assert body(await call(tool, ctx, query="llama", max_results="3"))["total"] == 3
    assistant = body(await call(tool, ctx, query="llama", role_filter="assistant"))
    assert [(r["turn"], r["role"]) for r in assistant["results"]] == [(1, "assistant")]
    users = body(await call(tool, ctx, query="llama", role_filter="user", max_results=20))
    assert {r["role"] for r in users["results"]} == {"user"} and users["total"] == 20


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "query is required (Search keywords)"),  # the schema, before the tool runs
        ({"query": "   "}, "query must be some keywords"),
        ({"query": ["a"]}, "query must be a string"),
        ({"query": "a", "role_filter": "system"}, 'role_filter must be one of: all, user, assistant; not "system"'),
        ({"query": "a", "max_results": "many"}, "max_results must be an integer"),
    ],
)
async def test_bad_search_arguments(history: AsyncHistory, arguments: dict[str, Any], message: str) -> None:
    cid, _ = await add_turn(history, None, "a", "b")
    result = await call(ConversationSearch(), context(history, cid, turn=2), **arguments)
    assert not result.ok and message in result.content


@pytest.mark.asyncio
@pytest.mark.parametrize("query", ['"', '""', "*", "NOT", "a NOT b", "NEAR(", "NEAR(a b)", "a:b", "body:x", "(", "((a", "{body}: x", "\x00", "😀"])
async def test_nasty_queries_are_searched_as_text(history: AsyncHistory, query: str) -> None:
    cid, _ = await add_turn(history, None, "Do NOT panic about ratio a:b", "plain")
    result = await call(ConversationSearch(), context(history, cid, turn=2), query=query)
    assert result.ok, result.content
    assert isinstance(body(result)["results"], list)


@pytest.mark.asyncio
async def test_query_syntax_words_are_found(history: AsyncHistory) -> None:
    cid, _ = await add_turn(history, None, "Do NOT panic about ratio a:b", "plain")
    await add_turn(history, cid, "other", "words")
    tool, ctx = ConversationSearch(), context(history, cid, turn=3)
    assert [r["turn"] for r in body(await call(tool, ctx, query="NOT"))["results"]] == [1]
    assert [r["turn"] for r in body(await call(tool, ctx, query="a:b"))["results"]] == [1]


@pytest.mark.asyncio
async def test_search_never_leaves_its_conversation(history: AsyncHistory) -> None:
    mine, _ = await add_turn(history, None, "about my garden", "roses")
    theirs, _ = await add_turn(history, None, "about their garden", "tulips")
    found = body(await call(ConversationSearch(), context(history, mine, turn=2), query="garden"))
    assert {r["excerpt"] for r in found["results"]} == {"about my [garden]"}
    await history.run(HistoryStore.delete_conversation, mine)
    gone = body(await call(ConversationSearch(), context(history, mine, turn=2), query="garden"))
    assert gone["results"] == [] and gone["total"] == 0 and gone["note"] == NOTHING_FOUND
    first = body(await call(ConversationSearch(), context(history, theirs, turn=1), query="garden"))
    assert first["total"] == 0 and first["note"] == NOTHING_EARLIER  # what a small model does with [] (issue 33)


@pytest.mark.asyncio
async def test_search_finds_the_compaction_summary(history: AsyncHistory) -> None:
    cid, _ = await add_turn(history, None, "hello", "hi")
    await add_turn(history, cid, "second", "ok")
    await history.run(HistoryStore.add_compaction, cid, 2, "The user plans a trip to Lisbon in May.")
    found = body(await call(ConversationSearch(), context(history, cid, turn=3), query="Lisbon"))
    assert [(r["turn"], r["role"]) for r in found["results"]] == [(2, "summary")]


@pytest.mark.asyncio
async def test_search_results_fit_the_context(history: AsyncHistory) -> None:
    cid, _ = await add_turn(history, None, "ferret " + "padding " * 30, "ferret " + "words " * 30)
    for _ in range(8):
        await add_turn(history, cid, "ferret " + "more " * 30, "ok")
    result = await call(ConversationSearch(), context(history, cid, turn=10, max_chars=900), query="ferret", max_results=20)
    found = body(result)
    assert len(result.content) <= 900
    assert 0 < found["total"] == len(found["results"]) < 10


# -- manifest ------------------------------------------------------------------------------


def attachment(id: int, turn: int, name: str, kind: str, **fields: Any) -> Attachment:
    defaults: dict[str, Any] = dict(
        conversation_id=1, path=f"/f/{name}", content_type={"pdf": "application/pdf", "image": "image/png"}.get(kind, "text/plain"),
        size_bytes=2048, sha256="0" * 64, pages=None, created_at="2026-01-01T00:00:00.000000Z", has_text=kind != "image",
    )
    return Attachment(id=id, turn=turn, name=name, kind=kind, **{**defaults, **fields})


def test_manifest_lists_the_files_of_the_folded_turns() -> None:
    files = [
        attachment(1, 1, "report.pdf", "pdf", pages=14),
        attachment(2, 2, "photo.png", "image"),
        attachment(4, 3, "scan.pdf", "pdf", pages=1, has_text=False),
        attachment(3, 5, "notes.md", "text"),
    ]
    block = attachment_manifest(files, through_turn=4)
    assert block is not None
    lines = block.splitlines()
    assert "attachment_recall" in lines[0]
    assert lines[1:] == [
        "- id 1: report.pdf (PDF, 14 pages; turn 1)",
        "- id 2: photo.png (image, image/png; turn 2)",
        "- id 4: scan.pdf (PDF, 1 page, no text layer; turn 3)",
    ]
    assert attachment_manifest(files[3:], through_turn=4) is None
    assert attachment_manifest([], through_turn=9) is None


def test_manifest_keeps_the_newest_when_there_are_many(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("recall.manifest.MAX_MANIFEST_FILES", 2)
    files = [attachment(i, i, f"f{i}.txt", "text") for i in range(1, 6)]
    block = attachment_manifest(files, through_turn=5)
    assert block is not None
    assert block.splitlines()[1:] == [
        "- id 4: f4.txt (text, 2,048 bytes; turn 4)",
        "- id 5: f5.txt (text, 2,048 bytes; turn 5)",
        "(and 3 older ones: action='list' shows them all)",
    ]


@pytest.mark.asyncio
async def test_a_query_of_too_many_words_is_refused(history: AsyncHistory) -> None:
    cid, _ = await add_turn(history, None, "a", "b")
    for query in (" ".join(f"w{n}" for n in range(33)), "\x00".join(f"w{n}" for n in range(33))):
        result = await call(ConversationSearch(), context(history, cid, turn=2), query=query)
        assert not result.ok and "at most 32" in result.content


def test_estimates_count_other_scripts_heavier() -> None:
    from core import estimate_text

    assert estimate_text("a" * 40) == 10
    assert estimate_text("漢" * 10) == 20
    assert estimate_text("ab漢") == 3
