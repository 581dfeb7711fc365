"""``python3 assistant.py --test``: an end-to-end self-check from a checkout.

Starts the fake OpenAI-compatible router on loopback and the real daemon on a
socket in a temporary directory, then drives it through the socket the way the
canvas does.  Prints one line per check and exits non-zero on any failure.
Needs nothing beyond the project's own dependencies (no pytest).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sys
import tempfile
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from client import Wire, of_type, reply_text
from core import Config, load_config
from daemon.server import Server
from selfcheck.fakerouter import FakeModel, FakeRouter, Reply, default_models
from selfcheck.samples import Scan, make_pdf, make_png

EVENT_TIMEOUT = 30.0  # seconds for any one event: a hang fails the check instead of stalling it

__all__ = ["run_selfcheck"]


@dataclass
class Context:
    """What every check gets: the router, the daemon's config, a connection, a scratch dir."""

    router: FakeRouter
    config: Config
    wire: Wire
    scratch: Path
    server: Server
    task: asyncio.Task[None]

    async def restart(self) -> None:
        await self.wire.close()
        self.server.request_stop()
        await self.task
        self.server = Server(self.config)
        self.task = asyncio.create_task(self.server.serve())
        await self.server.ready.wait()
        self.wire = await Wire.open(self.config.socket_path, timeout=EVENT_TIMEOUT)


Check = Callable[[Context], Awaitable[None]]
CHECKS: list[tuple[str, Check]] = []


def check(description: str) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        CHECKS.append((description, fn))
        return fn

    return register


class Skipped(Exception):
    """A check that cannot run on this machine (a system tool is missing): the reason is shown."""


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


# -- the checks ---------------------------------------------------------------------------------


@check("status answers and reaches the router")
async def _status(ctx: Context) -> None:
    event = await ctx.wire.request({"type": "status"})
    expect(event["type"] == "status" and event["router_reachable"] is True, f"status: {event}")


@check("models come from /v1/models with modalities and context size")
async def _models(ctx: Context) -> None:
    event = await ctx.wire.request({"type": "models"})
    by_id = {m["id"]: m for m in event["items"]}
    expect(by_id["fake-vision"]["input_modalities"] == ["text", "image"], f"models: {event}")
    expect(by_id["fake-text"]["ctx_max"] == 4096, f"models: {event}")


@check("ask streams deltas and ends with done; open shows the stored turn")
async def _ask(ctx: Context) -> None:
    ctx.router.script(Reply(chunks=["Hello", ", ", "world"]))
    events = await ctx.wire.ask("hello")
    expect(reply_text(events) == "Hello, world", f"reply: {events}")
    done = events[-1]
    expect(done["type"] == "done" and done["finish_reason"] == "stop", f"done: {done}")
    opened = await ctx.wire.request({"type": "open", "conversation": done["conversation"]})
    expect(opened["turns"][0]["reply"] == "Hello, world", f"open: {opened}")


@check("a continued conversation sends the earlier turns")
async def _continue(ctx: Context) -> None:
    first = await ctx.wire.ask("first question")
    cid = first[0]["conversation"]
    await ctx.wire.ask("second question", conversation=cid)
    roles = [m["role"] for m in ctx.router.requests[-1]["messages"]]
    expect(roles == ["system", "user", "assistant", "user"], f"roles sent: {roles}")


@check("bad lines get error events and the connection lives on")
async def _bad_lines(ctx: Context) -> None:
    await ctx.wire.send_raw(b"not json\n")
    event = await ctx.wire.read()
    expect(event.get("code") == "bad_request", f"not json: {event}")
    unknown = await ctx.wire.request({"type": "nope"})
    expect(unknown.get("code") == "unknown_type", f"unknown type: {unknown}")
    expect((await ctx.wire.request({"type": "status"}))["type"] == "status", "connection died")


@check("cancel ends the turn with finish_reason cancelled and keeps the partial reply")
async def _cancel(ctx: Context) -> None:
    ctx.router.script(Reply(chunks=["partial"], hang=True))
    rid = await ctx.wire.send({"type": "ask", "text": "go on forever"})
    events = await ctx.wire.until_reply(rid, "partial")
    cid = events[0]["conversation"]
    await ctx.wire.request({"type": "cancel", "conversation": cid})
    done = (await ctx.wire.until(rid))[-1]
    expect(done.get("finish_reason") == "cancelled", f"done: {done}")
    turn = (await ctx.wire.request({"type": "open", "conversation": cid}))["turns"][0]
    expect(turn["reply"] == "partial" and turn["status"] == "cancelled", f"stored: {turn}")


@check("a router error keeps the question in history, marked")
async def _router_error(ctx: Context) -> None:
    ctx.router.script(Reply(status=500, error="the model crashed"))
    events = await ctx.wire.ask("will this fail?")
    error = events[-1]
    expect(error.get("code") == "router_error" and "the model crashed" in error["message"], f"error: {error}")
    turn = (await ctx.wire.request({"type": "open", "conversation": error["conversation"]}))["turns"][0]
    expect(turn["text"] == "will this fail?" and turn["status"] == "error", f"stored: {turn}")


@check("history survives a daemon restart")
async def _restart(ctx: Context) -> None:
    events = await ctx.wire.ask("remember this")
    cid = events[0]["conversation"]
    await ctx.restart()
    turn = (await ctx.wire.request({"type": "open", "conversation": cid}))["turns"][0]
    expect(turn["text"] == "remember this" and turn["reply"] == "You said: remember this", f"after restart: {turn}")


# -- attachments -------------------------------------------------------------------------------


def _user(events: list[dict]) -> dict:
    users = of_type(events, "user")
    expect(len(users) == 1, f"no user event: {events}")
    return users[0]


def _sent_text(ctx: Context, index: int = -1) -> str:
    content = [m for m in ctx.router.requests[-1]["messages"] if m["role"] == "user"][index]["content"]
    if isinstance(content, str):
        return content
    return "\n".join(p.get("text", "") for p in content if p["type"] == "text")


def _sent_images(ctx: Context, index: int = -1) -> int:
    content = [m for m in ctx.router.requests[-1]["messages"] if m["role"] == "user"][index]["content"]
    return sum(1 for p in content if isinstance(content, list) and p["type"] == "image_url")


@check("files are classified: text, a code suffix, an image, a PDF; an unknown kind is refused")
async def _classify(ctx: Context) -> None:
    (ctx.scratch / "notes.txt").write_text("plain notes")
    (ctx.scratch / "tool.py").write_text("print('hi')")
    make_png(ctx.scratch / "dot.png")
    make_pdf(ctx.scratch / "doc.pdf", ["hello pdf"])
    names = ["notes.txt", "tool.py", "dot.png", "doc.pdf"]
    events = await ctx.wire.ask("what are these?", files=[str(ctx.scratch / n) for n in names], model="fake-vision")
    kinds = [chip["kind"] for chip in _user(events)["files"]]
    expect(kinds == ["text", "text", "image", "pdf"], f"kinds: {kinds}")
    (ctx.scratch / "blob.bin").write_bytes(bytes(range(256)) * 8)
    refused = (await ctx.wire.ask("and this?", files=[str(ctx.scratch / "blob.bin")]))[-1]
    expect(refused.get("code") == "unsupported_kind" and "chat supports text, images, PDF, documents" in refused["message"],
           f"unknown kind: {refused}")


@check("a PDF with one text page and one blank page gives the text and one page image")
async def _pdf(ctx: Context) -> None:
    pdf = make_pdf(ctx.scratch / "two.pdf", ["The answer is forty-two.", None])
    events = await ctx.wire.ask("read", files=[str(pdf)], model="fake-vision")
    chip = _user(events)["files"][0]
    expect(chip == {"name": "two.pdf", "kind": "pdf", "pages": 2, "truncated": False, "path": str(pdf),
                    "size": pdf.stat().st_size, "sha256": hashlib.sha256(pdf.read_bytes()).hexdigest()},
           f"chip: {chip}")
    expect("The answer is forty-two." in _sent_text(ctx), "the PDF's text did not reach the model")
    expect(_sent_images(ctx) == 1, f"page images sent: {_sent_images(ctx)}")


@check("a file cut to a small budget is marked in its block and its chip")
async def _truncation(ctx: Context) -> None:
    (ctx.scratch / "long.txt").write_text("word " * 2000)
    events = await ctx.wire.ask("summarise", files=[str(ctx.scratch / "long.txt")], model="fake-tiny")
    chip = _user(events)["files"][0]
    expect(chip["truncated"] is True, f"chip: {chip}")
    header = next(line for line in _sent_text(ctx).splitlines() if line.startswith("--- file: long.txt"))
    expect("truncated" in header, f"header: {header}")
    expect(len(_sent_text(ctx)) < 1000, f"sent {len(_sent_text(ctx))} characters for a 600-character budget")


@check("an image reference resolves after a save and reload, and is unavailable once the file changes")
async def _image_ref(ctx: Context) -> None:
    image = make_png(ctx.scratch / "cat.png", (32, 32))
    events = await ctx.wire.ask("see", files=[str(image)], model="fake-vision")
    cid = _user(events)["conversation"]
    await ctx.restart()
    await ctx.wire.ask("again", conversation=cid)
    expect(_sent_images(ctx, index=0) == 1, "the stored image did not come back after a restart")
    make_png(image, (33, 32))
    await ctx.wire.ask("and now", conversation=cid)
    expect(_sent_images(ctx, index=0) == 0, "a changed image was still sent")
    expect("[image cat.png is no longer available]" in _sent_text(ctx, index=0), "no unavailable notice")


@check("an image for a text-only model is refused: '<model> cannot see images'")
async def _no_vision(ctx: Context) -> None:
    image = make_png(ctx.scratch / "v.png")
    error = (await ctx.wire.ask("see", files=[str(image)], model="fake-text"))[-1]
    expect(error.get("code") == "no_vision" and error["message"].startswith("fake-text cannot see images; "),
           f"{image.name}: {error}")
    expect(ctx.router.requests == [], "something was sent to the model")


@check("a scanned page for a text-only model is read by OCR (tesseract)")
async def _ocr(ctx: Context) -> None:
    ocr = (await ctx.wire.request({"type": "status"}))["ocr"]
    scanned = make_pdf(ctx.scratch / "scanned.pdf", [Scan("Receipt number 90417", font_px=40)])
    events = await ctx.wire.ask("what is the number?", files=[str(scanned)], model="fake-text")
    if not ocr["available"]:  # refused, naming what to install
        expect(events[-1].get("code") == "no_vision" and "tesseract" in events[-1]["message"], f"refusal: {events[-1]}")
        raise Skipped(ocr["note"])
    sent = _sent_text(ctx)
    expect("[page 1, read by OCR]" in sent and "90417" in sent, f"the page's OCR text did not reach the model: {sent}")
    expect(any(e["type"] == "progress" and e["stage"] == "ocr" for e in events), "no ocr progress")


@check("each refusal: not absolute, missing, not a regular file, unreadable, too big, too many")
async def _refusals(ctx: Context) -> None:
    fifo = ctx.scratch / "fifo"
    os.mkfifo(fifo)
    big = ctx.scratch / "big.png"
    with big.open("wb") as fh:
        fh.write(b"\x89PNG\r\n\x1a\n")
        fh.truncate(21 << 20)
    dangling = ctx.scratch / "dangling.txt"
    dangling.symlink_to(ctx.scratch / "nowhere")
    cases = {
        "relative.txt": "file_refused",
        str(ctx.scratch / "missing.txt"): "file_refused",
        str(fifo): "file_refused",
        "/dev/null": "file_refused",
        str(dangling): "file_refused",
        str(big): "file_refused",
    }
    if os.geteuid() != 0:  # root reads any file, so only an ordinary user can check this one
        locked = ctx.scratch / "locked.txt"
        locked.write_text("secret")
        locked.chmod(0)
        cases[str(locked)] = "file_refused"
    for path, code in cases.items():
        error = (await ctx.wire.ask("look", files=[path], model="fake-vision"))[-1]
        expect(error.get("code") == code, f"{path}: {error}")
    nine = (await ctx.wire.ask("look", files=[str(ctx.scratch / "notes.txt")] * 9))[-1]
    expect(nine.get("code") == "too_many_files", f"nine files: {nine}")
    expect(ctx.router.requests == [], "a refused question reached the model")


# -- model tools and compaction -----------------------------------------------------------------


def _call(name: str, arguments: dict, call_id: str = "call_1") -> Reply:
    return Reply(tool_calls=[{"id": call_id, "name": name, "arguments": json.dumps(arguments)}])


def _tool_results(ctx: Context) -> list[str]:
    return [m["content"] for m in ctx.router.requests[-1]["messages"] if m["role"] == "tool"]


@check("attachment_recall lists and reads a file; the calls are tool events and stay in history")
async def _recall(ctx: Context) -> None:
    (ctx.scratch / "plan.txt").write_text("step one: water the plants")
    events = await ctx.wire.ask("keep this", files=[str(ctx.scratch / "plan.txt")])
    cid = _user(events)["conversation"]
    listing = _call("attachment_recall", {"action": "list"})
    ctx.router.script(listing, Reply(text="ok"))
    await ctx.wire.ask("what files?", conversation=cid)
    aid = json.loads(_tool_results(ctx)[-1])["attachments"][0]["id"]
    ctx.router.script(_call("attachment_recall", {"action": "read", "attachment_id": aid}), Reply(text="Water."))
    events = await ctx.wire.ask("what is step one?", conversation=cid)
    tools = of_type(events, "tool")
    expect(len(tools) == 1 and tools[0]["ok"] is True, f"tool events: {tools}")
    expect("water the plants" in _tool_results(ctx)[-1], "the file's text did not come back to the model")
    opened = await ctx.wire.request({"type": "open", "conversation": cid})
    expect(opened["turns"][-1]["tools"][0]["name"] == "attachment_recall", f"open: {opened['turns'][-1]}")


@check("a tool cannot reach another conversation's attachment")
async def _scoping(ctx: Context) -> None:
    (ctx.scratch / "secret.txt").write_text("the vault code is 0451")
    secret = _user(await ctx.wire.ask("mine", files=[str(ctx.scratch / "secret.txt")]))["conversation"]
    ctx.router.script(_call("attachment_recall", {"action": "list"}), Reply(text="ok"))
    await ctx.wire.ask("list", conversation=secret)
    aid = json.loads(_tool_results(ctx)[-1])["attachments"][0]["id"]
    (ctx.scratch / "other.txt").write_text("nothing")
    other = _user(await ctx.wire.ask("other", files=[str(ctx.scratch / "other.txt")]))["conversation"]
    ctx.router.script(_call("attachment_recall", {"action": "read", "attachment_id": aid}), Reply(text="no"))
    events = await ctx.wire.ask("read it", conversation=other)
    result = _tool_results(ctx)[-1]
    expect(of_type(events, "tool")[0]["ok"] is False and "0451" not in result, f"leaked: {result}")


@check("conversation_search finds an earlier turn, with a highlighted excerpt")
async def _conversation_search(ctx: Context) -> None:
    ctx.router.script(Reply(text="Your flight leaves at 7:40 from gate B12."))
    cid = _user(await ctx.wire.ask("when does my flight leave?"))["conversation"]
    ctx.router.script(_call("conversation_search", {"query": "flight gate"}), Reply(text="B12"))
    await ctx.wire.ask("which gate was it?", conversation=cid)
    found = json.loads(_tool_results(ctx)[-1])
    expect(found["total"] >= 1 and found["results"][0]["turn"] == 1, f"search: {found}")
    expect("[" in found["results"][0]["excerpt"], f"excerpt: {found['results'][0]}")


@check("compaction summarises old turns when the context fills; originals stay searchable")
async def _compaction(ctx: Context) -> None:
    ctx.router.script_complete(Reply(text="SUMMARY: early questions about gardening."))
    cid = None
    for n in range(10):
        ctx.router.script(Reply(text=f"Answer {n} " + "lorem " * 60))
        fields = {"model": "fake-small"} if cid is None else {"conversation": cid}
        events = await ctx.wire.ask(f"garden question {n} " + "words " * 40, **fields)
        cid = _user(events)["conversation"]
        if any(e["stage"] == "compacting" for e in of_type(events, "progress")):
            break
    else:
        raise AssertionError("ten turns in a 1500-token context never compacted")
    system = ctx.router.requests[-1]["messages"][0]["content"]
    expect("SUMMARY: early questions about gardening." in system, f"system message: {system[:200]}")
    opened = await ctx.wire.request({"type": "open", "conversation": cid})
    expect(opened["turns"][0]["text"].startswith("garden question 0"), "the first turn is gone from history")
    found = await ctx.wire.request({"type": "search", "query": "garden", "conversation": cid})
    expect(found["total"] >= 1, f"search after compaction: {found}")


# -- knowledge bases ----------------------------------------------------------------------------


async def _kb_add(ctx: Context, kb: str, folder: Path) -> dict:
    rid = await ctx.wire.send({"type": "kb_add", "kb": kb, "paths": [str(folder)]})
    events = await ctx.wire.until(rid, ("kb", "error"))
    expect(events[-1]["type"] == "kb", f"kb_add: {events[-1]}")
    expect(any(e["type"] == "progress" for e in events), "kb_add sent no progress")
    return events[-1]


@check("kb_add ingests a folder (text and PDF pages), embedding through /v1/embeddings")
async def _kb_ingest(ctx: Context) -> None:
    folder = ctx.scratch / "kb"
    folder.mkdir()
    (folder / "volcano.md").write_text("# Volcanoes\n\nMagma that reaches the surface is called lava.\n")
    make_pdf(folder / "guide.pdf", ["Water boils at 100 degrees at sea level.", "Ice melts at zero."])
    result = await _kb_add(ctx, "science", folder)
    expect(result["documents"] == 2 and result["chunks"] >= 3, f"kb_add: {result}")
    expect(bool(ctx.router.embedding_requests) and result["embedded"] == result["chunks"], f"embedded: {result}")


@check("a linked KB is injected as [Knowledge Base Context] before the question, not in the system prompt")
async def _kb_inject(ctx: Context) -> None:
    await ctx.wire.request({"type": "kb_link", "kb": "science"})
    await ctx.wire.ask("what is lava?")
    messages = ctx.router.requests[-1]["messages"]
    question = messages[-1]["content"]
    expect("[Knowledge Base Context]" in question and "Source: science (chunk" in question, f"question: {question[:300]}")
    expect(question.endswith("what is lava?"), "the passages do not come before the question")
    expect("Magma that reaches the surface" in question, "the right passage was not injected")
    expect("[Knowledge Base Context]" not in messages[0]["content"], "the system prompt changed with the passages")


@check("kb_injection modes: off injects nothing, tool_only offers kb_search instead")
async def _kb_modes(ctx: Context) -> None:
    # incognito: the fake router's echo of the check above (its KB block) would be recalled from there
    cid = _user(await ctx.wire.ask("hello", memory="off"))["conversation"]
    await ctx.wire.request({"type": "settings", "conversation": cid, "kb_injection": "off"})
    await ctx.wire.ask("what is lava?", conversation=cid)
    expect("[Knowledge Base Context]" not in json.dumps(ctx.router.requests[-1]["messages"]), "off still injected")
    await ctx.wire.request({"type": "settings", "conversation": cid, "kb_injection": "tool_only"})
    ctx.router.script(_call("kb_search", {"query": "boiling water"}), Reply(text="100 degrees"))
    events = await ctx.wire.ask("when does water boil?", conversation=cid)
    expect("[Knowledge Base Context]" not in json.dumps(ctx.router.requests[-1]["messages"]), "tool_only injected")
    tools = of_type(events, "tool")
    expect(len(tools) == 1 and tools[0]["name"] == "kb_search" and tools[0]["ok"], f"tool: {tools}")
    expect("Water boils at 100 degrees" in _tool_results(ctx)[-1], "kb_search did not find the passage")


# -- the runner ---------------------------------------------------------------------------------


async def _run(verbose: bool) -> int:
    failures = skipped = 0
    models = [
        *default_models(),
        FakeModel("fake-tiny", n_ctx=400),  # a 600-character text budget
        FakeModel("fake-small", ["text", "image"], n_ctx=1500),  # fills up in a few turns
    ]
    with tempfile.TemporaryDirectory(prefix="assistant-selfcheck-") as tmp, FakeRouter(models=models) as router:
        router.embed_dim = 256  # enough dimensions to tell passages apart
        scratch = Path(tmp)
        env = {
            "HOME": tmp,
            "XDG_CONFIG_HOME": str(scratch / "config"),
            "ASSISTANT_SOCKET": str(scratch / "run" / "assistant.sock"),
            "ASSISTANT_DATA_DIR": str(scratch / "data"),
            "ASSISTANT_ROUTER_URL": router.url,
            "ASSISTANT_AUTO_TITLE": "false",
            "ASSISTANT_EMBEDDING_MODEL": "fake-embed",
        }
        config = load_config(env)
        server = Server(config)
        task = asyncio.create_task(server.serve())
        await server.ready.wait()
        ctx = Context(router, config, await Wire.open(config.socket_path, timeout=EVENT_TIMEOUT), scratch, server, task)
        print(f"self-check: daemon on {config.socket_path}, fake router on {router.url}")
        for description, fn in CHECKS:
            router.reset()
            try:
                await asyncio.wait_for(fn(ctx), 60)
                print(f"  ok    {description}")
            except Skipped as why:
                skipped += 1
                print(f"  skip  {description}: {why}")
            except Exception as exc:  # every failure is reported, the run goes on
                failures += 1
                print(f"  FAIL  {description}: {exc}")
                if verbose:
                    traceback.print_exc()
        await ctx.wire.close()
        ctx.server.request_stop()
        await ctx.task
    print(f"self-check: {len(CHECKS) - failures - skipped} passed, {skipped} skipped, {failures} failed")
    return 1 if failures else 0


def run_selfcheck(verbose: bool = False) -> int:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.ERROR, stream=sys.stderr)
    return asyncio.run(_run(verbose))
