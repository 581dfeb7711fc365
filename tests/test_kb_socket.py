"""Knowledge bases through the real socket: kb_add with progress, list, link, remove,
auto-injection before the question by mode, the 85% rule, the kb_search tool,
embeddings served by the fake router for real, and a dead embedder."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from client import Wire, of_type
from core import Config
from core.tools import TOOL_GUIDANCE
from kbinject.embedder import DIMENSION_PROBE
from selfcheck.fakerouter import FakeModel, FakeRouter, Reply, default_models
from selfcheck.samples import make_pdf
from tests.conftest import RunningDaemon, serving

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def router() -> Iterator[FakeRouter]:
    models = [*default_models(), FakeModel("fake-tiny", n_ctx=300), FakeModel("fake-2k", ["text", "image"], n_ctx=2048)]
    with FakeRouter(models=models) as fake:
        fake.embed_dim = 256  # enough dimensions to tell passages apart
        yield fake


@pytest_asyncio.fixture
async def kwire(config: Config) -> AsyncIterator[Wire]:
    """A daemon with an embedding model configured, and a connection to it."""
    running = RunningDaemon(dataclasses.replace(config, embedding_model="fake-embed"))
    await running.start()
    wire = await running.connect()
    yield wire
    await wire.close()
    await running.stop()


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "bees.md").write_text("# Bees\n\nHoney bees dance to tell the hive where flowers are.\n")
    (folder / "sub" / "tides.txt").write_text("Tides rise twice a day because of the moon's pull.\n")
    make_pdf(folder / "manual.pdf", ["The pump needs oil every spring.", "Replace the filter yearly."])
    (folder / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    return folder


async def kb_add(wire: Wire, kb: str, *paths: Path | str) -> list[dict[str, Any]]:
    rid = await wire.send({"type": "kb_add", "kb": kb, "paths": [str(p) for p in paths]})
    return await wire.until(rid, ("kb", "error"))


def question_of(router: FakeRouter) -> str:
    """The text of the last request's question, where this turn's passages go."""
    content = router.requests[-1]["messages"][-1]["content"]
    return content if isinstance(content, str) else "\n".join(p.get("text", "") for p in content)


async def test_kb_add_ingests_a_folder_with_progress(kwire: Wire, router: FakeRouter, docs: Path) -> None:
    events = await kb_add(kwire, "notes", docs, docs.parent / "missing.txt")
    progress = of_type(events, "progress")
    assert progress and all(p["stage"] == "ingesting" and p["kb"] == "notes" for p in progress)
    assert progress[-1]["done"] == progress[-1]["total"]
    result = events[-1]
    assert result["type"] == "kb" and result["kb"] == "notes"
    assert result["documents"] == 3 and result["chunks"] >= 4  # the PDF has a chunk a page
    assert [n["path"] for n in result["errors"]] == [str(docs.parent / "missing.txt")]
    assert any(n["path"].endswith("photo.png") for n in result["skipped"])
    assert result["embedded"] == result["chunks"] and router.embedding_requests
    # adding again embeds nothing: the model is only asked the size of its vectors
    embedded_before = len(router.embedding_requests)
    again = (await kb_add(kwire, "notes", docs))[-1]
    assert again["unchanged"] == 3 and again["added"] == 0 and again["embedded"] == 0
    assert [r["input"] for r in router.embedding_requests[embedded_before:]] == [[DIMENSION_PROBE]]


def kb_rows(db_path: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(db_path)) as db:
        return [row[0] for row in db.execute("SELECT name FROM kbs")]


async def test_a_removal_cut_short_by_a_stop_is_finished_at_the_next_start(
    config: Config, router: FakeRouter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from daemon import server
    from history.kb import KnowledgeStore
    from kbinject import index

    # a chunk a transaction, each 10 ms longer: the stop comes mid-way
    monkeypatch.setattr(index, "REMOVE_BATCH", 1)
    delete_chunks = KnowledgeStore.delete_chunks

    def slowly(store: KnowledgeStore, kb_id: int, limit: int) -> int:
        time.sleep(0.01)
        return delete_chunks(store, kb_id, limit)

    monkeypatch.setattr(KnowledgeStore, "delete_chunks", slowly)
    monkeypatch.setattr(server, "REQUEST_GRACE", 0.01)
    docs = tmp_path / "docs"
    docs.mkdir()
    for n in range(20):
        (docs / f"n{n}.txt").write_text("\n\n".join(f"para {k} zebra{n}x{k} " + "word " * 150 for k in range(10)))
    async with serving(config) as (daemon, wire):
        added = (await kb_add(wire, "big", docs))[-1]
        assert added["type"] == "kb" and added["documents"] == 20
        await wire.send({"type": "kb_remove", "kb": "big"})
        await asyncio.sleep(0.2)
        with contextlib.closing(sqlite3.connect(config.db_path)) as db:  # under way, not done
            assert 0 < db.execute("SELECT count(*) FROM kb_chunks").fetchone()[0] < added["chunks"]
        other = await daemon.connect()  # already gone from every list
        assert (await other.request({"type": "kb_list"}))["items"] == []
        await other.close()
    monkeypatch.setattr(KnowledgeStore, "delete_chunks", delete_chunks)  # the rest goes at full speed
    async with serving(config) as (_daemon, wire):  # started again
        assert (await wire.request({"type": "kb_list"}))["items"] == []
        again = (await kb_add(wire, "big", docs))[-1]  # added afresh, not found unchanged
        assert (again["added"], again["unchanged"], again["chunks"]) == (20, 0, added["chunks"])
        found = await wire.request({"type": "kb_search", "kb": "big", "query": "zebra0x0", "limit": 5})
        assert found["results"]
        async with asyncio.timeout(30):  # the removal is finished after the start, in the background
            while len(await asyncio.to_thread(kb_rows, config.db_path)) > 1:
                await asyncio.sleep(0.05)
        with contextlib.closing(sqlite3.connect(config.db_path)) as db:  # the old chunks are gone with it
            assert db.execute("SELECT count(*) FROM kb_chunks").fetchone()[0] == added["chunks"]


async def test_what_a_folder_holds_besides_files_is_named_up_to_a_bound(kwire: Wire, tmp_path: Path) -> None:
    from kbinject.ingest import MAX_SKIPPED_NOTES

    folder = tmp_path / "odd"
    folder.mkdir()
    (folder / "keep.txt").write_text("a file worth keeping\n")
    os.symlink(folder / "aloop", folder / "aloop")  # a symlink to itself: a loop
    for n in range(MAX_SKIPPED_NOTES + 200):
        os.symlink(folder / f"gone{n}", folder / f"link{n:05}")  # to nothing
    result = (await kb_add(kwire, "odd", folder))[-1]
    assert result["type"] == "kb" and result["documents"] == 1
    reasons = {note["path"]: note["reason"] for note in result["skipped"]}
    assert reasons[str(folder / "aloop")] == "a symlink loop"
    assert reasons[str(folder / "link00000")] == "a symlink to nothing"
    assert len(result["skipped"]) == MAX_SKIPPED_NOTES + 1  # the rest counted in one note
    assert result["skipped"][-1]["reason"] == "and 201 more entries left out for the same kinds of reason"


async def test_a_remove_waiting_for_another_connections_add_holds_up_nothing_else(
    kwire: Wire, router: FakeRouter, docs: Path, config: Config
) -> None:
    router.embeddings_open.clear()  # the add sits in its embedding phase until the list is answered
    added = await kwire.send({"type": "kb_add", "kb": "notes", "paths": [str(docs)]})
    await kwire.until(added, ("progress",))  # under way
    other = await Wire.open(config.socket_path, timeout=60)
    try:
        await other.send_raw(json.dumps({"type": "kb_remove", "id": "rm", "kb": "notes"}).encode() + b"\n"
                             + json.dumps({"type": "kb_list", "id": "list"}).encode() + b"\n")
        first = await other.read()
        assert first["id"] == "list"  # answered while the remove waits for the add
        router.embeddings_open.set()
        assert (await other.until("rm", ("kb", "error")))[-1]["type"] == "kb"
    finally:
        router.embeddings_open.set()
        await other.close()


async def test_list_link_and_remove(kwire: Wire, docs: Path) -> None:
    await kb_add(kwire, "notes", docs)
    listed = await kwire.request({"type": "kb_list"})
    assert listed["type"] == "kbs" and [k["kb"] for k in listed["items"]] == ["notes"]
    cid = (await kwire.ask("hello"))[0]["conversation"]
    linked = await kwire.request({"type": "kb_link", "kb": "notes", "conversation": cid})
    assert linked["type"] == "kb" and linked["conversations"] == [cid] and linked["linked_all"] is False
    everywhere = await kwire.request({"type": "kb_link", "kb": "notes"})
    assert everywhere["linked_all"] is True
    missing = await kwire.request({"type": "kb_link", "kb": "nope"})
    assert missing["code"] == "not_found"
    removed = await kwire.request({"type": "kb_remove", "kb": "notes"})
    assert removed["type"] == "kb" and removed["kb"] == "notes"
    assert (await kwire.request({"type": "kb_list"}))["items"] == []
    assert (await kwire.request({"type": "kb_remove", "kb": "notes"}))["code"] == "not_found"


async def test_auto_injection_puts_the_best_passages_before_the_question(
    kwire: Wire, router: FakeRouter, docs: Path
) -> None:
    await kb_add(kwire, "notes", docs)
    await kwire.request({"type": "kb_link", "kb": "notes"})
    events = await kwire.ask("why do honey bees dance?")
    kb_progress = [e for e in of_type(events, "progress") if e["stage"] == "kb"]
    assert kb_progress and "notes" in kb_progress[0]["detail"]
    # the system message stays the same on every turn; the passages go with the question
    # the system message is the system prompt and the tool guidance, as on every turn: no passages
    system = {"role": "system", "content": f"{Config().system_prompt}\n\n{TOOL_GUIDANCE}"}
    assert router.requests[-1]["messages"][0] == system
    question = question_of(router)
    assert question.startswith("[Knowledge Base Context]") and question.endswith("why do honey bees dance?")
    assert "[End Knowledge Base Context]\n\nwhy do honey bees dance?" in question
    assert "Source: notes (chunk 1 of bees.md, similarity: " in question
    assert "Honey bees dance" in question
    assert "tools" not in router.requests[-1] or "kb_search" not in json.dumps(router.requests[-1]["tools"])


async def test_the_kb_progress_names_the_passages_sources_and_open_keeps_them(
    kwire: Wire, router: FakeRouter, docs: Path
) -> None:
    await kb_add(kwire, "notes", docs)
    await kwire.request({"type": "kb_link", "kb": "notes"})
    events = await kwire.ask("why do honey bees dance?")
    [kb] = [e for e in of_type(events, "progress") if e["stage"] == "kb"]
    sources = kb["sources"]
    assert sources and {s["kb"] for s in sources} == {"notes"}
    bees = next(s for s in sources if s["file"] == "bees.md")
    assert bees["path"] == str(docs / "bees.md") and (bees["chunk"], bees["chunks"], bees["page"]) == (1, 1, None)
    assert len(sources) == question_of(router).count("\nSource: notes (")  # one per passage sent
    assert "bees.md (notes)" in kb["detail"]  # the documents, not just the knowledge base
    cid = events[-1]["conversation"]
    # stored with the turn: open shows where the answer's context came from
    turn = (await kwire.request({"type": "open", "conversation": cid}))["turns"][0]
    assert turn["sources"] == sources
    # a turn that got no passage says so the same way
    await kwire.request({"type": "settings", "conversation": cid, "kb_injection": "off"})
    await kwire.ask("and the tides?", conversation=cid)
    opened = await kwire.request({"type": "open", "conversation": cid, "turn": 2})
    assert opened["turns"][0]["sources"] == []


async def test_a_kb_progress_that_adds_nothing_has_no_sources(kwire: Wire, docs: Path) -> None:
    await kb_add(kwire, "notes", docs)
    await kwire.request({"type": "kb_link", "kb": "notes"})
    events = await kwire.ask("zebra quartz xylophone")
    [kb] = [e for e in of_type(events, "progress") if e["stage"] == "kb"]
    assert kb["sources"] == [] and "no knowledge-base passage matched" in kb["detail"]


@pytest.mark.parametrize("mode, block, tool", [("off", False, False), ("tool_only", False, True),
                                                ("both", True, True), ("auto", True, False)])
async def test_injection_modes(kwire: Wire, router: FakeRouter, docs: Path, mode: str, block: bool, tool: bool) -> None:
    await kb_add(kwire, "notes", docs)
    cid = (await kwire.ask("hello"))[0]["conversation"]
    await kwire.request({"type": "kb_link", "kb": "notes", "conversation": cid})
    settings = await kwire.request({"type": "settings", "conversation": cid, "kb_injection": mode})
    assert settings["settings"]["kb_injection"] == mode
    await kwire.ask("when does the pump need oil?", conversation=cid)
    assert ("[Knowledge Base Context]" in question_of(router)) is block
    tools = [t["function"]["name"] for t in router.requests[-1].get("tools") or []]
    assert ("kb_search" in tools) is tool


async def test_a_kb_linked_to_one_conversation_stays_there(kwire: Wire, router: FakeRouter, docs: Path) -> None:
    await kb_add(kwire, "notes", docs)
    mine = (await kwire.ask("hello"))[0]["conversation"]
    await kwire.request({"type": "kb_link", "kb": "notes", "conversation": mine})
    await kwire.ask("why do bees dance?")  # a new conversation: not linked
    assert "[Knowledge Base Context]" not in question_of(router)
    await kwire.ask("why do bees dance?", conversation=mine)
    assert "[Knowledge Base Context]" in question_of(router)


async def test_a_full_context_skips_injection_and_says_so(kwire: Wire, router: FakeRouter, docs: Path) -> None:
    await kb_add(kwire, "notes", docs)
    await kwire.request({"type": "kb_link", "kb": "notes"})
    # ~250 of 300 tokens before any passage, with the tool guidance and conversation_search's definition
    events = await kwire.ask("bees " * 130, model="fake-tiny")
    skipped = [e for e in of_type(events, "progress") if e["stage"] == "kb"]
    assert skipped and "skipped" in skipped[0]["detail"] and "85%" in skipped[0]["detail"]
    assert "[Knowledge Base Context]" not in question_of(router)


async def test_a_2048_token_context_still_offers_kb_search(kwire: Wire, router: FakeRouter, docs: Path) -> None:
    # the daemon's own tools may take a third of the context, in a fixed order: at 2,048 tokens
    # the search, the recall and kb_search fit (bench_recall's kb kind runs there), with nothing
    # to spare; a longer definition of any of them would drop kb_search silently
    await kb_add(kwire, "notes", docs)
    cid = (await kwire.ask("hello", model="fake-2k"))[0]["conversation"]
    await kwire.request({"type": "kb_link", "kb": "notes", "conversation": cid})
    await kwire.request({"type": "settings", "conversation": cid, "kb_injection": "tool_only"})
    assert (await kwire.ask("how often do I replace the filter?", conversation=cid))[-1]["type"] == "done"
    names = [t["function"]["name"] for t in router.requests[-1]["tools"]]
    assert names == ["conversation_search", "kb_search"]


async def test_the_kb_search_tool(kwire: Wire, router: FakeRouter, docs: Path) -> None:
    await kb_add(kwire, "notes", docs)
    cid = (await kwire.ask("hello"))[0]["conversation"]
    await kwire.request({"type": "kb_link", "kb": "notes", "conversation": cid})
    await kwire.request({"type": "settings", "conversation": cid, "kb_injection": "tool_only"})
    router.script(Reply(tool_calls=[{"id": "k1", "name": "kb_search",
                                     "arguments": json.dumps({"query": "filter replace", "max_results": 2})}]),
                  Reply(text="Yearly."))
    events = await kwire.ask("how often do I replace the filter?", conversation=cid)
    [tool] = of_type(events, "tool")
    assert tool["name"] == "kb_search" and tool["ok"] is True
    found = json.loads([m for m in router.requests[-1]["messages"] if m["role"] == "tool"][0]["content"])
    text = json.dumps(found)
    assert "Replace the filter yearly." in text and "manual.pdf" in text and '"page": 2' in text


async def test_an_embedding_model_swapped_for_another_size_is_embedded_again_by_kb_add(
    kwire: Wire, router: FakeRouter, docs: Path
) -> None:
    notes = (await kb_add(kwire, "notes", docs))[-1]
    tides = (await kb_add(kwire, "tides", docs / "sub"))[-1]
    bees = {"type": "kb_search", "kb": "notes", "query": "why do honey bees dance"}
    assert (await kwire.request(bees))["search"] == "hybrid"  # its vector cached, of 256 dimensions
    router.embed_dim = 32  # another model served under the same name, nothing asked since
    again = (await kb_add(kwire, "notes", docs))[-1]
    assert (again["unchanged"], again["embedded"], again["pending"]) == (3, notes["chunks"], 0)
    found = await kwire.request(bees)  # not the cached vector of the old model
    assert found["search"] == "hybrid" and found["note"] is None
    assert found["results"][0]["file"] == "bees.md" and found["results"][0]["similarity_kind"] == "cosine"
    listed = {item["kb"]: item for item in (await kwire.request({"type": "kb_list"}))["items"]}
    assert listed["notes"]["embedded"] == notes["chunks"]
    assert listed["tides"]["embedded"] == 0  # vectors of the old size until its own add
    stale = await kwire.request({"type": "kb_search", "kb": "tides", "query": "when do tides rise"})
    assert stale["search"] == "bm25" and "kb_add" in stale["note"] and stale["results"]
    assert (await kb_add(kwire, "tides", docs / "sub"))[-1]["embedded"] == tides["chunks"]
    assert (await kwire.request({"type": "kb_search", "kb": "tides", "query": "when do tides rise"}))["note"] is None


async def test_a_swapped_embedding_model_that_fails_leaves_the_passages_pending(
    kwire: Wire, router: FakeRouter, docs: Path
) -> None:
    notes = (await kb_add(kwire, "notes", docs))[-1]
    router.embed_dim = 32
    stale = await kwire.request({"type": "kb_search", "kb": "notes", "query": "honey bees"})
    assert stale["search"] == "bm25" and "kb_add" in stale["note"]  # the daemon knows the new size
    router.embed_fail = True
    again = (await kb_add(kwire, "notes", docs))[-1]
    assert (again["embedded"], again["pending"]) == (0, notes["chunks"])  # each refused: left for the next add
    listed = (await kwire.request({"type": "kb_list"}))["items"]
    assert listed[0]["embedded"] == 0  # the old size's vectors are not counted


async def test_one_add_answered_by_a_model_of_another_size_loses_no_other_vectors(
    kwire: Wire, router: FakeRouter, docs: Path, tmp_path: Path
) -> None:
    notes = (await kb_add(kwire, "notes", docs))[-1]
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "pears.txt").write_text("Pear trees need a pollinator planted nearby.\n")
    router.embed_dim = 32  # the server answers one add with another model (a router's mix-up)
    assert (await kb_add(kwire, "odd", odd))[-1]["embedded"] == 1
    router.embed_dim = 256
    found = await kwire.request({"type": "kb_search", "kb": "notes", "query": "how often is the filter replaced"})
    assert found["search"] == "hybrid" and found["results"][0]["similarity_kind"] == "cosine"
    listed = {item["kb"]: item for item in (await kwire.request({"type": "kb_list"}))["items"]}
    assert listed["notes"]["embedded"] == notes["chunks"]  # not dropped with the odd ones
    again = (await kb_add(kwire, "odd", odd))[-1]  # its passage is embedded again, at the usual size
    assert (again["unchanged"], again["embedded"], again["pending"]) == (1, 1, 0)


async def test_a_dead_embedder_falls_back_to_keywords(kwire: Wire, router: FakeRouter, docs: Path) -> None:
    await kb_add(kwire, "notes", docs)
    await kwire.request({"type": "kb_link", "kb": "notes"})
    router.embed_fail = True
    events = await kwire.ask("why do honey bees dance?")
    assert events[-1]["type"] == "done"
    assert "Honey bees dance" in question_of(router)  # found by bm25 alone


async def test_without_an_embedder_search_is_bm25(wire: Wire, router: FakeRouter, docs: Path) -> None:
    result = (await kb_add(wire, "notes", docs))[-1]
    assert result["embedded"] == 0 and router.embedding_requests == []
    await wire.request({"type": "kb_link", "kb": "notes"})
    await wire.ask("tides and the moon")
    assert "Tides rise twice a day" in question_of(router)


async def test_bad_kb_names_and_paths(kwire: Wire, tmp_path: Path) -> None:
    bad = await kwire.request({"type": "kb_add", "kb": "", "paths": [str(tmp_path)]})
    assert bad["code"] == "bad_request"
    relative = (await kb_add(kwire, "notes", "relative/path"))[-1]
    assert relative["type"] == "kb" and relative["errors"][0]["path"] == "relative/path"


async def test_the_kb_commands(daemon: RunningDaemon, docs: Path) -> None:
    async def cli(*args: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(ROOT / "assistant.py"), *args, cwd=ROOT, env=dict(os.environ),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode or 0, out.decode(), err.decode()

    code, out, err = await cli("kb", "add", "notes", str(docs))
    assert code == 0, err
    assert "notes: 3 documents" in out and "photo.png" in out
    code, out, _ = await cli("kb", "link", "notes", "--all")
    assert code == 0 and "notes" in out
    code, out, _ = await cli("kb", "list")
    assert "notes  3 documents" in out and "every conversation" in out
    code, out, _ = await cli("kb", "remove", "notes")
    assert code == 0
    code, out, _ = await cli("kb", "list")
    assert "no knowledge bases yet" in out


async def test_a_slow_embedder_does_not_hold_the_reply(
    config: Config, router: FakeRouter, docs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kbinject import service

    monkeypatch.setattr(service, "QUERY_TIMEOUT", 0.2)  # the bound the turn waits out, made short
    async with serving(dataclasses.replace(config, embedding_model="fake-embed")) as (_daemon, kwire):
        await kb_add(kwire, "notes", docs)
        await kwire.request({"type": "kb_link", "kb": "notes"})
        router.embed_delay = 30.0  # the query's embedding would take half a minute
        # the turn finishes long before that: the wait for the embedder is bounded (QUERY_TIMEOUT)
        events = await asyncio.wait_for(kwire.ask("why do honey bees dance?"), 15)
        assert events[-1]["type"] == "done"
        assert "Honey bees dance" in question_of(router)


async def test_kb_edges(kwire: Wire, router: FakeRouter, docs: Path, tmp_path: Path) -> None:
    await kb_add(kwire, "notes", docs)
    unlink = await kwire.request({"type": "kb_link", "kb": "notes", "conversation": 4242, "linked": False})
    assert unlink["code"] == "not_found"
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "fine.txt").write_text("plain name")
    (odd / os.fsdecode(b"caf\xe9.txt")).write_text("a name in Latin-1")
    result = (await kb_add(kwire, "odd", odd))[-1]
    assert result["type"] == "kb" and result["documents"] == 1
    assert any("not UTF-8" in note["reason"] for note in result["skipped"])
    padded = await kb_add(kwire, "  notes  ", docs)
    assert all(e["kb"] == "notes" for e in padded)
    for separator in (" ", "\x00"):  # a NUL parts words in a search as a space does
        many = await kwire.request({"type": "search", "query": separator.join(f"w{n}" for n in range(40))})
        assert many["code"] == "bad_request"


async def test_an_embedder_that_is_not_there_leaves_keyword_search(
    kwire: Wire, router: FakeRouter, docs: Path
) -> None:
    router.embeddings = False  # llama-server without --embeddings answers 501
    result = (await kb_add(kwire, "notes", docs))[-1]
    assert result["type"] == "kb" and result["chunks"] >= 4
    assert result["embedded"] == 0 and "--embeddings" in (result["embedding_error"] or ""), result
    await kwire.request({"type": "kb_link", "kb": "notes"})
    await kwire.ask("tides and the moon")
    assert "Tides rise twice a day" in question_of(router)


async def test_one_long_paragraph_is_cut_to_what_an_embedder_takes(
    kwire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    wall = tmp_path / "wall.txt"
    wall.write_text("word " * 20_000)  # one paragraph, no line breaks: 100,000 characters
    result = (await kb_add(kwire, "wall", wall))[-1]
    assert result["embedding_error"] is None and result["embedded"] == result["chunks"] > 50


async def test_kb_add_reports_pipes_and_sockets_it_never_opens(kwire: Wire, tmp_path: Path) -> None:
    folder = tmp_path / "odd"
    folder.mkdir()
    (folder / "real.md").write_text("# Real\n\nA regular file with words in it.\n")
    os.mkfifo(folder / "pipe")  # opening it for reading would wait for a writer forever
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(folder / "sock"))
    try:
        result = (await kb_add(kwire, "odd", folder))[-1]
        given = (await kb_add(kwire, "odd2", folder / "pipe"))[-1]
    finally:
        listening.close()
    assert result["type"] == "kb" and result["documents"] == 1
    reasons = {Path(n["path"]).name: n["reason"] for n in result["skipped"]}
    assert reasons["pipe"].startswith("a pipe (FIFO)") and reasons["sock"].startswith("a socket")
    assert given["errors"][0]["reason"].startswith("a pipe (FIFO)")


async def test_cancel_stops_a_kb_add_and_keeps_the_files_stored_whole(
    kwire: Wire, router: FakeRouter, docs: Path
) -> None:
    router.embed_delay = 60.0  # the embedding phase would last a minute
    rid = await kwire.send({"type": "kb_add", "kb": "notes", "paths": [str(docs)]})
    queued = await kwire.send({"type": "kb_add", "kb": "notes", "paths": [str(docs)]})  # waits for the first
    async for event in kwire.stream(rid):
        if event["type"] == "progress" and event["phase"] == "embedding":
            break
    cancelled = await kwire.request({"type": "cancel", "kb": "notes"})
    assert cancelled == {"type": "cancelled", "kb": "notes", "running": True, "id": cancelled["id"]}
    result = (await kwire.until(rid, ("kb", "error")))[-1]
    assert result["type"] == "kb" and result["cancelled"] is True
    assert result["added"] == 3 and result["documents"] == 3  # read and stored before the cancel
    assert result["embedded"] == 0 and result["pending"] == result["chunks"]  # embedded by a later add
    later = (await kwire.until(queued, ("kb", "error")))[-1]
    assert later["cancelled"] is True and later["added"] == later["unchanged"] == 0  # stopped before reading
    again = await kwire.request({"type": "cancel", "kb": "notes"})
    assert again["running"] is False
    listed = await kwire.request({"type": "kb_list"})
    assert [(kb["kb"], kb["documents"]) for kb in listed["items"]] == [("notes", 3)]


async def test_a_kb_add_holds_up_only_requests_about_its_kb(kwire: Wire, router: FakeRouter, docs: Path) -> None:
    router.embed_delay = 60.0  # the add would run for a minute
    add = await kwire.send({"type": "kb_add", "kb": "notes", "paths": [str(docs)]})
    link = await kwire.send({"type": "kb_link", "kb": "notes"})  # waits for the add
    assert (await kwire.request({"type": "status"}))["type"] == "status"  # at once, not after the add
    assert (await kwire.request({"type": "cancel", "kb": "notes"}))["running"] is True
    assert (await kwire.until(add, ("kb", "error")))[-1]["cancelled"] is True
    linked = (await kwire.until(link, ("kb", "error")))[-1]
    assert linked["type"] == "kb" and linked["linked_all"] is True


async def test_an_add_sent_after_a_cancel_of_its_kb_runs(kwire: Wire, docs: Path) -> None:
    cancel = await kwire.send({"type": "cancel", "kb": "notes"})
    add = await kwire.send({"type": "kb_add", "kb": "notes", "paths": [str(docs)]})  # back to back
    refused = (await kwire.until(cancel, ("cancelled", "error")))[-1]
    assert refused["code"] == "not_found"  # no such knowledge base yet: nothing to cancel
    result = (await kwire.until(add, ("kb", "error")))[-1]
    assert result["type"] == "kb" and result["cancelled"] is False and result["added"] == 3
    idle = await kwire.request({"type": "cancel", "kb": "notes"})
    assert idle == {"type": "cancelled", "kb": "notes", "running": False, "id": idle["id"]}


async def test_cancel_of_an_unknown_kb_is_not_found(kwire: Wire) -> None:
    answer = await kwire.request({"type": "cancel", "kb": "never-added"})
    assert answer["type"] == "error" and answer["code"] == "not_found"
    assert "never-added" in answer["message"] and "kb_list" in answer["message"]


async def test_cancel_names_a_conversation_or_a_kb(kwire: Wire) -> None:
    for fields in ({}, {"kb": "notes", "conversation": 1}):
        answer = await kwire.request({"type": "cancel", **fields})
        assert answer["type"] == "error" and answer["code"] == "bad_request"
        assert "'conversation'" in answer["message"] and "'kb'" in answer["message"]
