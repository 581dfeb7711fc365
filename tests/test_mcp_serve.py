"""``assistant.py mcp serve`` driven by the SDK's own client over stdio, against the real
daemon on a real socket; and ``assistant.py mcp list``."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from client import Wire
from selfcheck.fakerouter import FakeRouter, Reply
from tests.conftest import RunningDaemon
from tests.test_cli import run_into_closed_pipe
from tests.test_client import cli

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parent.parent
READ_ONLY = ["kb_search", "list_conversations", "list_knowledge_bases", "list_memories", "memory_search",
             "read_conversation", "search_conversations"]


def text_of(result: Any) -> str:
    return "".join(block.text for block in result.content if block.type == "text")


async def seed(wire: Wire, router: FakeRouter, tmp_path: Path) -> int:
    router.script(Reply(text="The meeting moved to Thursday at noon."))
    cid = (await wire.ask("when is the team meeting?"))[0]["conversation"]
    await wire.ask("and the budget review?", conversation=cid)
    notes = tmp_path / "notes" / "garden.md"
    notes.parent.mkdir()
    notes.write_text("# Garden\n\nThe tomatoes need watering every second day in July.\n")
    rid = await wire.send({"type": "kb_add", "kb": "home", "paths": [str(notes.parent)]})
    assert (await wire.until(rid, ("kb", "error")))[-1]["type"] == "kb"
    return cid


def serve_params(daemon: RunningDaemon) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable, args=[str(ROOT / "assistant.py"), "mcp", "serve"],
        env={"ASSISTANT_SOCKET": str(daemon.config.socket_path)}, cwd=str(ROOT),
    )


async def test_mcp_serve_exposes_history_and_knowledge_read_only(
    daemon: RunningDaemon, wire: Wire, router: FakeRouter, tmp_path: Path
) -> None:
    cid = await seed(wire, router, tmp_path)
    async with stdio_client(serve_params(daemon)) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        listed = await session.list_tools()
        assert sorted(t.name for t in listed.tools) == READ_ONLY  # nothing that asks, deletes or adds

        found = json.loads(text_of(await session.call_tool("search_conversations", {"query": "meeting"})))
        assert found["total"] >= 1 and found["conversations"][0]["conversation"] == cid
        assert any("[meeting]" in h["excerpt"].lower() for h in found["conversations"][0]["hits"])

        listing = json.loads(text_of(await session.call_tool("list_conversations", {})))
        assert [c["conversation"] for c in listing["items"]] == [cid]

        whole = json.loads(text_of(await session.call_tool("read_conversation", {"conversation": cid})))
        assert [t["turn"] for t in whole["turns"]] == [1, 2]
        assert whole["turns"][0]["reply"] == "The meeting moved to Thursday at noon."
        one = json.loads(text_of(await session.call_tool("read_conversation", {"conversation": cid, "turn": 2})))
        assert [t["text"] for t in one["turns"]] == ["and the budget review?"]

        kbs = json.loads(text_of(await session.call_tool("list_knowledge_bases", {})))
        assert [kb["kb"] for kb in kbs["items"]] == ["home"]
        hits = json.loads(text_of(await session.call_tool("kb_search", {"kb": "home", "query": "tomatoes watering"})))
        assert hits["kb"] == "home" and "tomatoes" in hits["results"][0]["content"]

        missing = await session.call_tool("read_conversation", {"conversation": 99})
        assert missing.is_error and text_of(missing).endswith(
            ": conversation 99 does not exist; list them with list_conversations (not_found)")  # this client's tools
        no_turn = await session.call_tool("read_conversation", {"conversation": cid, "turn": 7})
        assert no_turn.is_error and "has no turn 7" in text_of(no_turn)
        no_kb = await session.call_tool("kb_search", {"kb": "work", "query": "x"})
        assert no_kb.is_error and text_of(no_kb).endswith(
            "no knowledge base 'work'; list_knowledge_bases shows the ones there are (not_found)")  # as above
        # a request over the daemon's line limit is refused at once, saying so (not a wait for
        # an answer that never comes)
        long = await session.call_tool("search_conversations", {"query": "word " * 250_000})
        assert long.is_error and text_of(long).endswith("the query is too long to send to the daemon; shorten it (too_long)")
    # read-only: the conversation is as it was
    assert (await wire.request({"type": "open", "conversation": cid}))["turns"][-1]["turn"] == 2


async def test_mcp_serve_offers_the_memory_read_only_and_never_an_incognito_conversation(
    daemon: RunningDaemon, wire: Wire, router: FakeRouter
) -> None:
    added = (await wire.request({"type": "memory_add", "text": "The user rides a Brompton"}))["memory"]
    await wire.request({"type": "memory_add", "text": "The user is vegetarian"})
    bike = (await wire.ask("my Brompton needs new tyres"))[0]["conversation"]
    await wire.request({"type": "settings", "conversation": bike, "title": "Bike fitting"})
    secret = (await wire.ask("my secret Brompton is blue", memory="off"))[0]["conversation"]
    async with stdio_client(serve_params(daemon)) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        listed = json.loads(text_of(await session.call_tool("list_memories", {})))
        assert [m["text"] for m in listed["items"]] == ["The user is vegetarian", "The user rides a Brompton"]
        found = json.loads(text_of(await session.call_tool("memory_search", {"query": "brompton"})))
        assert found["memories"] == [added]
        assert found["results"] and {r["conversation"] for r in found["results"]} == {bike}
        assert found["results"][0]["title"] == "Bike fitting" and secret != bike
        empty = await session.call_tool("memory_search", {"query": "   "})
        assert empty.is_error and text_of(empty).endswith("(bad_request)")
    assert len((await wire.request({"type": "memories"}))["items"]) == 2  # read-only


@pytest.mark.parametrize("where, said", [("none.sock", "no daemon answers"),
                                         ("file/a.sock", "(Not a directory); check ASSISTANT_SOCKET")])
async def test_mcp_serve_without_a_daemon_answers_tool_errors(tmp_path: Path, where: str, said: str) -> None:
    (tmp_path / "file").write_text("a file, not a folder")
    params = StdioServerParameters(
        command=sys.executable, args=[str(ROOT / "assistant.py"), "mcp", "serve"],
        env={"ASSISTANT_SOCKET": str(tmp_path / where)}, cwd=str(ROOT),
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        result = await session.call_tool("list_conversations", {})
        assert result.is_error and said in text_of(result)


@pytest.mark.parametrize("command", ["list", "serve"])
async def test_mcp_commands_refuse_a_socket_path_that_cannot_be_one_in_one_line(command: str) -> None:
    long = "/tmp/" + "d" * 120 + "/a.sock"
    code, out, err = await cli("mcp", command, env={"ASSISTANT_SOCKET": long})
    assert code == 3 and out == ""
    assert err == (f"assistant: the socket path {long} is 132 bytes, over the 107 a Unix socket allows; "
                   "set ASSISTANT_SOCKET to a shorter path\n")


async def test_mcp_list_tells_a_missing_daemon_as_the_client_does(tmp_path: Path) -> None:
    code, out, err = await cli("mcp", "list", "--socket", str(tmp_path / "gone.sock"))
    assert code == 3 and out == "" and err.startswith("assistant: no daemon answers on ")
    assert len(err.splitlines()) == 1
    code, out, err = await cli("mcp", "list", "--socket", "/etc/passwd/a.sock")  # a path through a file
    assert code == 3 and out == "" and err == (
        "assistant: cannot reach a daemon at /etc/passwd/a.sock (Not a directory); check ASSISTANT_SOCKET\n"
    )


async def test_mcp_list_into_a_closed_pipe_ends_quietly(daemon: RunningDaemon) -> None:
    for args in (("mcp", "list"), ("mcp", "list", "--json")):
        code, err = await run_into_closed_pipe(*args)
        assert code == 0, (args, err)
        assert "Traceback" not in err and "BrokenPipe" not in err, args


async def test_kb_search_request_answers_one_named_kb(wire: Wire, router: FakeRouter, tmp_path: Path) -> None:
    await seed(wire, router, tmp_path)
    answer = await wire.request({"type": "kb_search", "kb": "home", "query": "tomatoes", "limit": 3})
    assert answer["type"] == "kb_results" and answer["search"] == "bm25" and len(answer["results"]) == 1
    refused = await wire.request({"type": "kb_search", "kb": "home", "query": "  "})
    assert refused["type"] == "error" and refused["code"] == "bad_request"
    missing = await wire.request({"type": "kb_search", "kb": " garden ", "query": "tomatoes"})
    assert missing["code"] == "not_found" and "no knowledge base 'garden'; kb_list" in missing["message"]


async def test_mcp_serve_cuts_long_texts_and_keeps_json(daemon: RunningDaemon, wire: Wire, router: FakeRouter) -> None:
    reply = "".join(f"line {n:06d} of a very long answer.\n" for n in range(9_000))  # 315,000 characters
    router.script(Reply(chunks=[reply[i:i + 50_000] for i in range(0, len(reply), 50_000)]))
    cid = (await wire.ask("write it all out"))[0]["conversation"]
    for n in range(3):  # later conversations, for the pages
        await wire.ask(f"conversation {n + 2}")
    async with stdio_client(serve_params(daemon)) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        whole = json.loads(text_of(await session.call_tool("read_conversation", {"conversation": cid})))
        [turn] = whole["turns"]
        assert turn["text"] == "write it all out"  # short texts whole: the answer is JSON still
        assert turn["reply"].startswith(reply[:1000]) and "[... cut at" in turn["reply"] and "note" in whole
        # one turn, read on from where each answer was cut, gives the reply whole
        got, offset = "", 0
        for _ in range(20):
            one = json.loads(text_of(await session.call_tool(
                "read_conversation", {"conversation": cid, "turn": 1, "offset": offset})))
            part = one["turns"][0]["reply"]
            if "note" not in one:
                got += part
                break
            offset = int(one["note"].rsplit("offset=", 1)[1])
            got += part[:offset - len(got)]
        assert got == reply

        first = json.loads(text_of(await session.call_tool("list_conversations", {"limit": 2})))
        rest = json.loads(text_of(await session.call_tool(
            "list_conversations", {"limit": 2, "before": first["items"][-1]["updated_at"]})))
        assert [c["conversation"] for c in first["items"] + rest["items"]] == [cid + 3, cid + 2, cid + 1, cid]

        scoped = json.loads(text_of(await session.call_tool(
            "search_conversations", {"query": "conversation", "conversation": cid + 2})))
        assert [c["conversation"] for c in scoped["conversations"]] == [cid + 2]


async def test_a_daemon_that_does_not_answer_is_told_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mcpserve import server

    path = tmp_path / "silent.sock"
    accepted: list[asyncio.StreamWriter] = []
    silent = await asyncio.start_unix_server(lambda _reader, writer: accepted.append(writer), path=str(path))
    monkeypatch.setattr(server, "CALL_TIMEOUT", 0.3)
    async with silent:  # it accepts, and never answers
        with pytest.raises(server.ToolError) as refused:
            await server.Daemon(path).request({"type": "status"})
        for writer in accepted:
            writer.close()
    assert str(refused.value) == "the daemon did not answer within 0.3 s; see its log (timeout)"


async def test_a_query_that_is_not_text_is_refused_before_it_is_sent(daemon: RunningDaemon) -> None:
    from mcpserve import server

    # half an emoji: the SDK's own client cannot send it, a raw JSON-RPC client can (as an escape)
    with pytest.raises(server.ToolError) as refused:
        await server.Daemon(daemon.config.socket_path).request({"type": "search", "query": "half \ud83d of it"})
    assert str(refused.value) == "the query is not UTF-8 text; retype it (not_text)"


async def test_mcp_list_without_servers_says_how_to_add_one(daemon: RunningDaemon) -> None:
    # the daemon runs in this loop: the client must run beside it, not block it
    child = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "assistant.py"), "mcp", "list", "--socket", str(daemon.config.socket_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(child.communicate(), 60)
    assert child.returncode == 0, err
    assert "no MCP servers configured" in out.decode()

