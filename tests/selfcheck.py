"""``python3 assistant.py --test``: an end-to-end self-check from a checkout.

Starts the fake OpenAI-compatible router on loopback and the real daemon on a
socket in a temporary directory, then drives it through the socket the way the
canvas does.  Prints one line per check and exits non-zero on any failure.
Needs nothing beyond the project's own dependencies (no pytest).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import tempfile
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from daemon import Config, Server, load_config
from tests.fakerouter import FakeRouter, Reply
from tests.wire import Wire, reply_text

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
        self.wire = await Wire.open(self.config.socket_path)


Check = Callable[[Context], Awaitable[None]]
CHECKS: list[tuple[str, Check]] = []


def check(description: str) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        CHECKS.append((description, fn))
        return fn

    return register


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


# -- the runner ---------------------------------------------------------------------------------


async def _run(verbose: bool) -> int:
    failures = 0
    with tempfile.TemporaryDirectory(prefix="assistant-selfcheck-") as tmp, FakeRouter() as router:
        scratch = Path(tmp)
        env = {
            "HOME": tmp,
            "XDG_CONFIG_HOME": str(scratch / "config"),
            "ASSISTANT_SOCKET": str(scratch / "run" / "assistant.sock"),
            "ASSISTANT_DATA_DIR": str(scratch / "data"),
            "ASSISTANT_ROUTER_URL": router.url,
            "ASSISTANT_AUTO_TITLE": "false",
        }
        config = load_config(env)
        server = Server(config)
        task = asyncio.create_task(server.serve())
        await server.ready.wait()
        ctx = Context(router, config, await Wire.open(config.socket_path), scratch, server, task)
        print(f"self-check: daemon on {config.socket_path}, fake router on {router.url}")
        for description, fn in CHECKS:
            router.reset()
            try:
                await asyncio.wait_for(fn(ctx), 60)
                print(f"  ok    {description}")
            except Exception as exc:  # every failure is reported, the run goes on
                failures += 1
                print(f"  FAIL  {description}: {exc}")
                if verbose:
                    traceback.print_exc()
        await ctx.wire.close()
        ctx.server.request_stop()
        await ctx.task
    print(f"self-check: {len(CHECKS) - failures} passed, {failures} failed")
    return 1 if failures else 0


def run_selfcheck(verbose: bool = False) -> int:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.ERROR, stream=sys.stderr)
    return asyncio.run(_run(verbose))
