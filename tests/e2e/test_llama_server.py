"""The daemon against a real llama-server with SmolLM2 135M, through the real socket.

A 135M model answers, but not reliably: these tests assert the protocol and the
plumbing (events, usage, context, what was sent, what was stored), never the
words of a reply.  Where a test needs the server's own view it asks the server
(``/slots``, ``/metrics``, ``/tokenize``), not the daemon.

Skipped as a whole, with the reason, when llama-server is not installed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import random
import string
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client import Wire, of_type, reply_text
from core import Config, load_config
from core import router as router_module
from core.errors import AssistantError, RouterError
from core.router import RouterClient
from core.models import display_name
from selfcheck.samples import make_pdf, make_png
from tests.conftest import RunningDaemon
from tests.e2e.conftest import Sent
from tests.e2e.realserver import (
    busy_slots,
    get,
    installed_or_skip_reason,
    llama,
    metrics,
    post,
    prompt_tokens,
    wait_idle,
)

STATE, SKIP_REASON = installed_or_skip_reason()
if STATE is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.asyncio

SHORT = "Say hello in five words."
# long enough that a cancel after a few tokens always lands mid-generation
LONG = "Write a very long story, at least 1500 words, about a dragon who learns to bake bread."
CANCEL_AFTER_DELTAS = 8
STOP_SECONDS = 2.0  # a cancelled generation must end on the server within this
PROMPT_SECONDS = 5.0  # the next reply after a cancel must start within this
# how a reply of this model ends: its own stop, or the server's cap (-n in conftest.SERVER_EXTRA)
FINISHED = ("stop", "length")
BACK_TO_BACK = 40  # streams in a row; with one in eight failing, 40 all pass by chance 0.5% of the time


def model_id(server: Any) -> str:
    status, listing = get(server.v1 + "/models")
    assert status == 200
    return str(listing["data"][0]["id"])


def content_text(message: dict[str, Any]) -> str:
    """A message's text whether its content is a string or a list of parts."""
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def assert_turn(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The events of one answered turn are user, progress, then deltas, then done; returns done."""
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "done", events[-1]
    assert "user" in kinds and kinds.index("user") < kinds.index("delta"), kinds
    first = kinds.index("user")
    waiting = first + 1
    while events[waiting]["type"] == "progress" and events[waiting]["stage"] in ("compacting", "kb", "recall"):
        waiting += 1  # the prompt's preparation comes before the request leaves
    assert kinds[waiting] == "progress" and events[waiting]["stage"] == "waiting", events[waiting]
    assert set(kinds[waiting + 1:-1]) <= {"delta", "reasoning"}, kinds
    done = events[-1]
    assert done["text"] == reply_text(events)
    return done


# -- streaming, conversations, models, context ------------------------------------------------


async def test_a_streamed_ask_arrives_token_by_token(wire: Wire, llama_server: Any, sent: Sent) -> None:
    events = await wire.ask(SHORT)
    done = assert_turn(events)
    deltas = of_type(events, "delta")
    assert len(deltas) >= 2, "llama-server streams a token a chunk; one delta means it was not streamed"
    assert done["text"].strip()
    assert done["finish_reason"] in FINISHED
    usage = done["usage"]
    assert usage["prompt_tokens"] > 0
    assert usage["completion_tokens"] >= len(deltas)  # each delta is at least one token
    # without --alias the id is the GGUF's path; people are shown its name
    assert of_type(events, "progress")[0]["detail"] == f"waiting for {display_name(model_id(llama_server))}"
    assert sent.chats[0]["model"] == model_id(llama_server)


async def test_a_continued_conversation_sends_the_history(wire: Wire, llama_server: Any, sent: Sent) -> None:
    first = assert_turn(await wire.ask("My name is Ada. Greet me."))
    cid = first["conversation"]
    second = assert_turn(await wire.ask("What is my name?", conversation=cid))
    assert (second["conversation"], second["turn"]) == (cid, 2)
    messages = sent.chats[1]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[2]["content"] == first["text"]
    # the server read the whole history: its count is the templated prompt's, longer than turn 1's
    assert second["usage"]["prompt_tokens"] == prompt_tokens(llama_server.url, messages)
    assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] / 2
    conv = await wire.request({"type": "open", "conversation": cid})
    assert [(t["turn"], t["status"], t["reply"]) for t in conv["turns"]] == [
        (1, "complete", first["text"]), (2, "complete", second["text"])
    ]


async def test_two_conversations_stream_at_once(wire: Wire, llama_server: Any) -> None:
    first = await wire.send({"type": "ask", "text": LONG})
    second = await wire.send({"type": "ask", "text": LONG})
    seen_busy = 0
    while seen_busy < 2:  # both generations on the server at the same time (it has several slots)
        await wire.read()
        seen_busy = max(seen_busy, busy_slots(llama_server.url))
        if any(e["type"] in ("done", "error") for e in wire.events):
            break
    assert seen_busy == 2
    for rid in (first, second):
        user = next(e for e in await wire.until(rid, ("user",)) if e["type"] == "user")
        await wire.request({"type": "cancel", "conversation": user["conversation"]})
    ends = [(await wire.until(rid))[-1] for rid in (first, second)]
    assert [e["type"] for e in ends] == ["done", "done"], ends
    assert ends[0]["conversation"] != ends[1]["conversation"]


async def test_models_come_from_the_real_model_list(wire: Wire, llama_server: Any) -> None:
    event = await wire.request({"type": "models"})
    status, listing = get(llama_server.v1 + "/models")
    assert status == 200
    assert [item["id"] for item in event["items"]] == [entry["id"] for entry in listing["data"]]
    assert event["default"] == listing["data"][0]["id"]
    item = event["items"][0]
    assert item["input_modalities"] == ["text"]
    assert item["ctx_max"] == llama.CTX  # -c 4096, not the model's training context
    # the server's per-slot context, which is what a conversation can fill
    status, props = get(llama_server.url + "/props")
    assert status == 200
    assert props["default_generation_settings"]["n_ctx"] == item["ctx_max"]
    assert props["modalities"]["vision"] is False


async def test_status_reaches_the_real_server(wire: Wire, llama_server: Any) -> None:
    status = await wire.request({"type": "status"})
    assert status["router_url"] == llama_server.v1
    assert status["router_reachable"] is True
    assert status["model"] == model_id(llama_server)


async def test_ctx_used_is_the_servers_usage(wire: Wire, llama_server: Any, sent: Sent) -> None:
    done = assert_turn(await wire.ask(SHORT))
    usage = done["usage"]
    assert done["ctx_used"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert done["ctx_max"] == llama.CTX
    # the server's own token count of what was sent, not the daemon's 4-characters-a-token estimate
    assert usage["prompt_tokens"] == prompt_tokens(llama_server.url, sent.chats[0]["messages"])
    conv = await wire.request({"type": "open", "conversation": done["conversation"]})
    assert (conv["ctx_used"], conv["ctx_max"]) == (done["ctx_used"], llama.CTX)
    assert conv["turns"][0]["usage"] == usage


async def test_back_to_back_streams_do_not_meet_a_closed_connection(config: Config) -> None:
    """llama-server closes its side after every streamed reply; a pooled connection must not be reused.

    Reusing it fails as "Server disconnected without sending a response" (router_unreachable)
    for roughly one request in eight when they follow each other closely, as a second
    conversation's turn or a quick follow-up does.
    """
    router = RouterClient(config)
    failures: list[str] = []
    try:
        model = (await router.model_info()).id
        for i in range(BACK_TO_BACK):
            try:
                async for _ in router.stream_chat(model, [{"role": "user", "content": f"Say hi {i}."}], max_tokens=4):
                    pass
            except AssistantError as exc:
                failures.append(f"{i}: {exc.code}: {exc.message}")
    finally:
        await router.aclose()
    assert not failures, f"{len(failures)} of {BACK_TO_BACK} back-to-back streams failed: {failures[:3]}"


# -- cancel ---------------------------------------------------------------------------------------------


async def test_cancel_mid_generation_stops_the_server(wire: Wire, llama_server: Any) -> None:
    rid = await wire.send({"type": "ask", "text": LONG})
    while len(of_type([e for e in wire.events if e.get("id") == rid], "delta")) < CANCEL_AFTER_DELTAS:
        await wire.read()
    assert busy_slots(llama_server.url) == 1, "the generation should be running on the server"
    cid = next(e for e in wire.events if e.get("id") == rid and e["type"] == "user")["conversation"]
    cancel = await wire.send({"type": "cancel", "conversation": cid})
    events = await wire.until(rid)
    done = events[-1]
    assert done["type"] == "done" and done["finish_reason"] == "cancelled", done
    assert done["text"] == reply_text(events) and done["text"]
    assert (await wire.until(cancel, ("cancelled",)))[-1]["turn"] == 1

    # the server noticed the closed connection and stopped generating
    took = wait_idle(llama_server.url, timeout=STOP_SECONDS)
    decodes = metrics(llama_server.url)["n_decode_total"]
    await asyncio.sleep(0.5)
    assert metrics(llama_server.url)["n_decode_total"] == decodes, "the server went on decoding after the cancel"

    conv = await wire.request({"type": "open", "conversation": cid})
    assert (conv["turns"][0]["status"], conv["turns"][0]["reply"]) == ("cancelled", done["text"])
    # and the next request is served at once
    started = time.monotonic()
    rid = await wire.send({"type": "ask", "text": SHORT, "conversation": cid})
    while not of_type([e for e in wire.events if e.get("id") == rid], "delta"):
        await wire.read()
    first_token = time.monotonic() - started
    assert first_token < PROMPT_SECONDS, f"first token {first_token:.2f} s after a cancel (server idle after {took:.2f} s)"
    assert_turn(await wire.until(rid))


# -- attachments -----------------------------------------------------------------------------------------


async def test_an_image_to_a_text_only_model_is_refused_before_sending(
    wire: Wire, llama_server: Any, sent: Sent, tmp_path: Path
) -> None:
    picture = make_png(tmp_path / "cat.png", text="a cat")
    before = metrics(llama_server.url)
    events = await wire.ask("What is in this picture?", files=[str(picture)])
    assert not of_type(events, "user"), "a refusal stores nothing"
    error = events[-1]
    assert error["type"] == "error" and error["code"] == "no_vision", error
    assert error["conversation"] is None
    assert sent.chats == []
    after = metrics(llama_server.url)
    assert after["prompt_tokens_total"] == before["prompt_tokens_total"]
    assert (await wire.request({"type": "conversations"}))["items"] == []


async def test_the_real_server_itself_fails_an_image_for_a_text_only_model(
    llama_server: Any, config: Config, tmp_path: Path
) -> None:
    """Why the daemon refuses first: llama-server answers an HTTP error, not a reply about the image."""
    import base64

    png = base64.b64encode(make_png(tmp_path / "cat.png").read_bytes()).decode()
    messages: list[dict[str, Any]] = [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
    ]}]
    body = {"model": model_id(llama_server), "messages": messages, "stream": True}
    status, answer = post(llama_server.v1 + "/chat/completions", body)
    assert status >= 400, answer
    assert isinstance(answer, dict) and set(answer["error"]) >= {"code", "message", "type"}, answer
    # and the daemon's router client turns that into a router_error carrying the server's words
    router = RouterClient(config)
    try:
        with pytest.raises(RouterError) as caught:
            async for _ in router.stream_chat(model_id(llama_server), messages):
                pass
    finally:
        await router.aclose()
    assert caught.value.code == "router_error"
    assert answer["error"]["message"][:40] in caught.value.message


async def test_a_text_file_reaches_the_model(wire: Wire, llama_server: Any, sent: Sent, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("Meeting notes. The password for the lab is PURPLE-ELEPHANT-42.\n")
    events = await wire.ask("What is the password in the notes?", files=[str(notes)])
    user = of_type(events, "user")[0]
    assert user["files"] == [{"name": "notes.txt", "kind": "text", "truncated": False, "path": str(notes),
                              "size": notes.stat().st_size, "sha256": hashlib.sha256(notes.read_bytes()).hexdigest()}]
    assert [e["stage"] for e in of_type(events, "progress")][:1] == ["extracting"]
    done = assert_turn(events)
    assert done["finish_reason"] in FINISHED
    question = sent.chats[0]["messages"][-1]
    assert "PURPLE-ELEPHANT-42" in content_text(question)
    assert done["usage"]["prompt_tokens"] > 20


async def test_a_pdf_reaches_the_model(wire: Wire, llama_server: Any, sent: Sent, tmp_path: Path) -> None:
    pdf = make_pdf(tmp_path / "report.pdf", ["Quarterly report: revenue rose 12 percent.", "Costs fell in March."])
    events = await wire.ask("Summarise the report.", files=[str(pdf)])
    user = of_type(events, "user")[0]
    assert user["files"] == [{"name": "report.pdf", "kind": "pdf", "pages": 2, "truncated": False, "path": str(pdf),
                              "size": pdf.stat().st_size, "sha256": hashlib.sha256(pdf.read_bytes()).hexdigest()}]
    done = assert_turn(events)
    assert done["finish_reason"] in FINISHED
    question = content_text(sent.chats[0]["messages"][-1])
    assert "revenue rose 12 percent" in question and "Costs fell in March" in question
    conv = await wire.request({"type": "open", "conversation": done["conversation"]})
    assert conv["turns"][0]["files"] == user["files"]


# -- errors, restart, titles ---------------------------------------------------------------------------------


async def test_the_servers_context_overflow_is_known_as_one(wire: Wire, llama_server: Any, sent: Sent) -> None:
    """A prompt the daemon's estimate lets through but the server counts as too long.

    llama-server answers HTTP 400 ``exceed_context_size_error``; the daemon must read
    that as an overflow (``router_context_overflow``, or ``context_overflow`` once it
    has tried compacting and found nothing to fold), never as a plain ``router_error``.
    """
    # random letters and digits: about 3,000 tokens by the daemon's estimate (4 characters a
    # token), twice that by a real tokenizer, which finds no words in them
    rng = random.Random(7)
    huge = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(12_000))
    events = await wire.ask(huge)
    assert of_type(events, "user"), "the question is stored before the server is asked"
    assert sent.chats, "the daemon's estimate should have let this through to the server"
    error = events[-1]
    assert error["type"] == "error" and error["code"] in ("router_context_overflow", "context_overflow"), error
    conv = await wire.request({"type": "open", "conversation": error["conversation"]})
    assert conv["turns"][0]["status"] == "error"


async def test_text_in_other_scripts_is_refused_before_it_is_sent(wire: Wire, llama_server: Any, sent: Sent) -> None:
    """6,000 tokens for the server, and for the daemon's estimate (two a CJK character): refused early."""
    events = await wire.ask("漢字" * 1500)
    error = events[-1]
    assert error["type"] == "error" and error["code"] == "context_overflow", error
    assert not sent.chats  # the server never had to say it


async def test_a_restart_keeps_the_history(daemon: RunningDaemon, llama_server: Any, sent: Sent) -> None:
    wire = await daemon.connect()
    first = assert_turn(await wire.ask(SHORT))
    cid = first["conversation"]
    await wire.close()
    await daemon.stop()
    await daemon.start()
    wire = await daemon.connect()
    try:
        conv = await wire.request({"type": "open", "conversation": cid})
        turn = conv["turns"][0]
        assert (turn["status"], turn["reply"], turn["usage"]) == ("complete", first["text"], first["usage"])
        assert conv["ctx_used"] == first["ctx_used"]
        second = assert_turn(await wire.ask("Say it again.", conversation=cid))
        assert (second["conversation"], second["turn"]) == (cid, 2)
        assert sent.chats[-1]["messages"][2] == {"role": "assistant", "content": first["text"]}
    finally:
        await wire.close()


async def test_the_model_names_the_conversation(
    llama_server: Any, sent: Sent, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ASSISTANT_ROUTER_URL", llama_server.v1)
    monkeypatch.setenv("ASSISTANT_AUTO_TITLE", "true")
    running = RunningDaemon(load_config())
    await running.start()
    try:
        wire = await running.connect()
        done = assert_turn(await wire.ask(SHORT))
        assert running.server is not None and running.server.engine is not None
        with caplog.at_level(logging.INFO, logger="daemon"):
            await running.server.engine.settle()
        assert len(sent.completions) == 1  # a plain (not streamed) completion for the title
        assert not [r for r in caplog.records if "no model-made title" in r.getMessage()]
        conv = await wire.request({"type": "open", "conversation": done["conversation"]})
        assert isinstance(conv["title"], str) and 0 < len(conv["title"]) <= 60
        await wire.close()
    finally:
        await running.stop()


async def test_the_router_client_embeds_with_a_real_server(
    llama_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Knowledge bases will need /v1/embeddings: the same server serves it with --embeddings --pooling mean."""
    assert STATE is not None
    with llama.running_server(STATE, extra=llama.EMBEDDING_FLAGS, log=llama.CACHE / "e2e-embeddings.log") as server:
        monkeypatch.setenv("ASSISTANT_ROUTER_URL", server.v1)
        router = RouterClient(load_config())
        try:
            model = (await router.model_info()).id
            vectors = await router.embed(model, ["a red apple", "a green pear", "a red apple"], timeout=30)
            assert len(vectors) == 3 and len({len(v) for v in vectors}) == 1 and len(vectors[0]) > 100
            assert vectors[0] == pytest.approx(vectors[2])  # input order kept
            assert vectors[0] != pytest.approx(vectors[1])
            # an input longer than the server's batch is an HTTP 500 with the server's words
            with pytest.raises(RouterError) as caught:
                await router.embed(model, ["word " * 2000], timeout=30)
            assert "too large" in caught.value.message
        finally:
            await router.aclose()


async def test_tools_offered_to_a_model_without_tool_support(wire: Wire, llama_server: Any, sent: Sent) -> None:
    """SmolLM2's chat template has no tools: llama-server would drop them silently, so none are offered."""
    status, props = get(llama_server.url + "/props")
    assert status == 200 and props["chat_template_caps"]["supports_tools"] is False
    first = assert_turn(await wire.ask("Remember: my cat is called Miso."))
    assert_turn(await wire.ask("Another topic: say hello."))
    done = assert_turn(await wire.ask("What did I say my cat is called?", conversation=first["conversation"]))
    assert not sent.chats[-1]["tools"]  # /props says the template has none: none are offered
    assert done["finish_reason"] in FINISHED
    assert all(e["stage"] != "tool" for e in of_type(wire.events, "progress")), "the model cannot have called one"


async def test_a_knowledge_base_with_real_embeddings(
    llama_server: Any, sent: Sent, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Ingest through the real /v1/embeddings (the same server, --embeddings --pooling mean),
    then a linked KB's passage reaches the real model, before the question (the system
    prompt stays the same, so the server's cache keeps the conversation)."""
    assert STATE is not None
    folder = tmp_path / "kb"
    folder.mkdir()
    (folder / "garden.md").write_text("# Garden\n\nThe tomatoes are watered every Tuesday at dawn.\n")
    make_pdf(folder / "bikes.pdf", ["Bicycle chains want oil every two hundred kilometres."])
    with llama.running_server(STATE, extra=llama.EMBEDDING_FLAGS, log=llama.CACHE / "e2e-kb.log") as server:
        monkeypatch.setenv("ASSISTANT_ROUTER_URL", server.v1)
        config = load_config()
        probe = RouterClient(config)
        try:
            model = (await probe.model_info()).id
        finally:
            await probe.aclose()
        monkeypatch.setenv("ASSISTANT_EMBEDDING_MODEL", model)
        running = RunningDaemon(load_config())
        await running.start()
        try:
            wire = await running.connect()
            rid = await wire.send({"type": "kb_add", "kb": "home", "paths": [str(folder)]})
            result = (await wire.until(rid, ("kb", "error")))[-1]
            assert result["type"] == "kb", result
            assert result["documents"] == 2 and result["embedded"] == result["chunks"] > 0
            assert result["embedding_error"] is None
            await wire.request({"type": "kb_link", "kb": "home"})
            events = await wire.ask("When are the tomatoes watered?")
            assert_turn(events)
            assert any(e["stage"] == "kb" for e in of_type(events, "progress"))
            messages = sent.chats[-1]["messages"]
            question = content_text(messages[-1])
            assert "[Knowledge Base Context]" in question and "watered every Tuesday" in question
            assert question.endswith("When are the tomatoes watered?")
            assert "[Knowledge Base Context]" not in content_text(messages[0])
            await wire.close()
        finally:
            await running.stop()


# -- a small context and the prompt cache (issue: prompts a real server can reuse) -------------------------

SMALL_CTX = 1024
# no -n cap here: the daemon's own max_tokens must stop a story that would fill the context
SERVER_EXTRA_SMALL = ("--metrics", "--slots", "-np", "1")


@pytest.fixture
def small_server(config: Config) -> Iterator[Any]:
    """A second llama-server with a 1,024-token context and one slot (its cache is the slot's)."""
    server = llama.start_server(STATE, extra=(*SERVER_EXTRA_SMALL, "-c", str(SMALL_CTX)),
                                log=llama.CACHE / "e2e-llama-server-small.log")
    try:
        yield server
    finally:
        server.stop()


async def small_daemon(config: Config, server: Any) -> RunningDaemon:
    running = RunningDaemon(dataclasses.replace(config, router_url=server.v1))
    await running.start()
    return running


async def test_a_long_story_in_a_small_context_leaves_the_conversation_alive(
    config: Config, small_server: Any
) -> None:
    """Asked for a very long story with -c 1024, the model would write until the context is
    full; every later turn would then overflow.  The reply is capped so two more questions
    are answered."""
    running = await small_daemon(config, small_server)
    wire = await running.connect()
    try:
        story = assert_turn(await wire.ask(LONG))
        assert story["ctx_max"] == SMALL_CTX
        assert story["finish_reason"] in FINISHED
        assert story["usage"]["prompt_tokens"] + story["usage"]["completion_tokens"] <= SMALL_CTX - SMALL_CTX // 8
        cid = story["conversation"]
        for question in ("Who was the hero of the story?", "How did it end?"):
            done = assert_turn(await wire.ask(question, conversation=cid))
            assert done["usage"]["prompt_tokens"] < SMALL_CTX
        opened = await wire.request({"type": "open", "conversation": cid})
        assert opened["turns"][0]["reply"] == story["text"]  # stored whole
    finally:
        await wire.close()
        await running.stop()


async def assert_reused(running: RunningDaemon, thing: str, turns: int) -> None:
    """``turns`` questions in one conversation: from the third turn on, llama-server's
    `timings` must show only the previous answer and the new question read, the rest taken
    from its cache (a turn that compacted is left out: its new summary changes the top of
    the prompt, as documented)."""
    wire = await running.connect()
    try:
        cid = None
        timings = []
        for n in range(turns):
            events = await wire.ask(f"Question {n}: name a {thing}.", **({"conversation": cid} if cid else {}))
            done = assert_turn(events)
            cid = done["conversation"]
            assert done["ctx_max"] == SMALL_CTX
            compacted = any(e["type"] == "progress" and e["stage"] == "compacting" for e in events)
            timings.append(None if compacted else done["timings"])
        checked = [later for later in timings[2:] if later is not None]
        assert checked, "every later turn compacted: the replies were too long for this test"
        for later in checked:
            assert later["cache_n"] > 0 and later["prompt_n"] < later["cache_n"], timings
    finally:
        await wire.close()
        await running.stop()


async def test_the_server_reuses_the_conversation_from_turn_to_turn(config: Config, small_server: Any) -> None:
    await assert_reused(await small_daemon(config, small_server), "colour", 5)


async def test_questions_after_the_model_list_went_old(
    config: Config, small_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every question finds the model list past MODELS_TTL (as one after a pause does): the
    list (and the lone model's /props) is asked again before the question goes on, and the
    server still reuses the conversation from turn to turn. The router is named `localhost`,
    as many set it."""
    monkeypatch.setattr(router_module, "MODELS_TTL", 0.0)
    named = dataclasses.replace(config, router_url=small_server.v1.replace("127.0.0.1", "localhost"))
    assert named.router_url != small_server.v1
    running = RunningDaemon(named)
    await running.start()
    await assert_reused(running, "fruit", 4)


async def test_a_follow_up_while_the_title_is_made_is_read_from_the_cache(config: Config) -> None:
    """After a new conversation's first reply the title request holds the slot with the
    conversation's cache (this server has several): a follow-up asked at once waits for it and
    is read from that cache; sent beside it, it could land on another slot and be read from its
    first token (`bench/bench_follow_up.py`)."""
    system = "You are a helpful assistant. " + " ".join(
        f"Rule {n}: answer briefly and name colours plainly." for n in range(60)
    )
    running = RunningDaemon(dataclasses.replace(config, auto_title=True))
    await running.start()
    wire = await running.connect()
    try:
        for n in range(4):
            # the four conversations say the same words: memory is on, and none recalls another's
            # question (docs/DESIGN.md, "Across conversations": the bound), so each follow-up
            # reads its first exchange from the cache
            events = await wire.ask(f"Name a colour, number {n}.", system=system)
            assert not [e for e in events if e.get("stage") == "recall" and e.get("sources")], events
            first = assert_turn(events)
            follow_up = assert_turn(await wire.ask("And another one?", conversation=first["conversation"]))
            timings = follow_up["timings"]
            assert timings["cache_n"] > 3 * timings["prompt_n"], timings  # the system prompt alone is ~750 tokens
    finally:
        await wire.close()
        await running.stop()
