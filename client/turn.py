"""One question and its streamed reply, as ``ask`` and ``chat`` both show it.

``Turn`` sends an ``ask`` and shows its events on a ``Terminal``: the reply's text on
stdout, the rest on stderr; the first Ctrl-C sends ``cancel`` (once the conversation is
known) and waits for the ``done`` that keeps the partial reply. A turn whose connection
was lost can be ``rejoin``ed on a new one (docs/PROTOCOL.md, "Writing a client"): it
follows the reply if it still runs, else shows the rest of it as stored. A call of a tool that
may act is answered by the turn's ``Approver`` (asked at the terminal; a Ctrl-C there denies it
and stops the reply).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import uuid
from collections.abc import Iterator
from typing import Any

from .approve import Approver
from .render import chip_text, describe_timings, error_text, json_line
from .terminal import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, Interrupts, Terminal
from .wire import DaemonGone, Wire

__all__ = [
    "Refused", "Turn", "chosen_conversation", "compose_question", "file_paths", "latest_conversation", "set_system",
]


def new_ref() -> str:
    """A reference for an ask, unique enough that no other client's ask carries it."""
    return f"cli-{uuid.uuid4().hex}"


def compose_question(words: list[str], piped: str | None) -> str:
    """The question: text piped in, then the words given (llm's order), a blank line between."""
    typed = " ".join(words)
    if piped is None or not piped.strip():
        return typed
    piped = piped.rstrip("\n")
    return f"{piped}\n\n{typed}" if typed else piped


# how a reply that did not end by itself ended, by its finish_reason ("cancelled": by this client)
STOPPED = {
    "cancelled": "cancelled; the partial reply is kept",
    "interrupted": "interrupted: the daemon stopped; the partial reply is kept",
    "length": "length: the reply reached the most it may take",
}
# the line a call's answer leaves on stderr, by how it was answered
VERDICTS = {"conversation": "allowed for this conversation",
            "unasked": "denied: no terminal to ask at; ask --approve TOOL or --approve-all allows it"}
CANCELLED_ELSEWHERE = "stopped by another client: cancelled (the partial reply is kept), or the conversation deleted"


FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})[^\n`]*\n(?P<code>.*?)^(?P=fence)[ \t]*$", re.MULTILINE | re.DOTALL)


def first_code_block(reply: str) -> str:
    """The first fenced code block of a reply, without its fences; the reply when it has none."""
    found = FENCE.search(reply)
    return found.group("code") if found else reply


class Refused(Exception):
    """The daemon answered a request the command needs first with an error."""

    def __init__(self, event: dict[str, Any]) -> None:
        super().__init__(error_text(event))


async def latest_conversation(client: Wire) -> int | None:
    event = await client.request({"type": "conversations", "limit": 1})
    if event["type"] == "error":  # forbidden: another user's daemon
        raise Refused(event)
    items = event.get("items") or []
    return items[0]["conversation"] if items else None


async def chosen_conversation(client: Wire, args: argparse.Namespace) -> int | None:
    """``--cid N``, the latest with ``-c``, else None (a new conversation)."""
    if getattr(args, "cid", None) is not None:
        return int(args.cid)
    if getattr(args, "continue_", False):
        return await latest_conversation(client)
    return None


def remembered(summary: str) -> str:
    """The line for a memory the model saved: what, and the command that forgets it."""
    saved = re.search(r"\(memory ([0-9]+)\)$", summary)
    return f"{summary}; forget it with: assistant memory forget {saved[1]}" if saved else summary


def file_paths(files: list[str] | None) -> list[str]:
    return [os.path.abspath(os.path.expanduser(f)) for f in files or ()]


class Turn:
    """One ``ask`` streamed to a terminal; Ctrl-C cancels it and waits for the partial reply."""

    def __init__(self, client: Wire, terminal: Terminal, *, as_json: bool = False, stream: bool = True,
                 stats: bool = False, extract: bool = False, approver: Approver | None = None) -> None:
        self.client = client
        self.terminal = terminal
        self.approver = approver or Approver(terminal)  # answers the daemon's approval events
        self.as_json = as_json
        self.stream = stream
        self.stats = stats
        self.extract = extract  # only the reply's first fenced code block (``-x``, as llm)
        self.conversation: int | None = None
        self.turn: int | None = None  # known from the `user` event
        self.sent = False  # the request went out: it may have reached the daemon
        self.ref: str | None = None  # the ask's ref (``run``)
        self.shown = ""  # the reply's text shown so far
        self.cancelling = False
        self._cancel_sent: asyncio.Future[Any] | None = None

    def _cancel(self) -> None:
        self.approver.interrupt()  # a call being asked about is denied, and the reply stopped
        self.cancelling = True
        self.terminal.status("cancelling… (Ctrl-C again to stop waiting)")
        self._send_cancel()

    def _send_cancel(self) -> None:
        # a new conversation's id is known from its `user` event: the cancel waits for it
        if self.conversation is not None and self._cancel_sent is None:
            self._cancel_sent = asyncio.ensure_future(
                self.client.send({"type": "cancel", "conversation": self.conversation})
            )

    async def run(self, request: dict[str, Any]) -> int:
        self.conversation = request.get("conversation")
        # the ask's own reference: a connection lost before ``user`` finds the turn by it (``find``)
        self.ref = request.setdefault("ref", new_ref())
        rid = await self.client.send(request)
        self.sent = True
        return await self._events(rid)

    async def find(self, client: Wire) -> bool:
        """Whether the daemon stored this ask, whose ``user`` event was lost with its connection:
        found by its ``ref``, its conversation and turn are then known (``rejoin`` follows it)."""
        found = await client.request({"type": "open", "ref": self.ref})
        if found["type"] != "conversation" or not found["turns"]:
            return False  # not stored (not_found), or a daemon that cannot tell (an older one)
        self.conversation, self.turn = found["conversation"], found["turns"][0]["turn"]
        return True

    async def rejoin(self, client: Wire) -> int:
        """Go on showing this turn on ``client``, a new connection: its reply followed from where
        it was shown, or read as stored when it no longer runs (a restarted daemon)."""
        self.client = client
        self._cancel_sent = None
        rid = await client.send({"type": "follow", "conversation": self.conversation})
        return await self._events(rid)

    async def _events(self, rid: Any) -> int:
        with Interrupts(self._cancel), self._lost():
            async for event in self.client.stream(rid):
                if event["type"] == "following":
                    if self.as_json:
                        self.terminal.out.write(json_line(event))
                    if event["turn"] is None or event["turn"] != self.turn:
                        return await self._stored()
                    if not self.as_json:
                        self._catch_up(event["reply"])
                    for waiting in event.get("approvals") or ():  # asked while this client was away
                        await self._approve(waiting)
                    continue
                if event["type"] == "approval":
                    if self.as_json:
                        self.terminal.out.write(json_line(event))
                        self.terminal.out.flush()
                    await self._approve(event)
                    continue
                if event["type"] == "user":
                    self.turn = event.get("turn")
                if "conversation" in event and event["conversation"] is not None:
                    self.conversation = event["conversation"]
                    if self.cancelling:
                        self._send_cancel()
                if self.as_json:
                    self.terminal.out.write(json_line(event))
                    self.terminal.out.flush()
                    if event["type"] in ("done", "error"):
                        return self._status(event)
                    continue
                if event["type"] in ("done", "error"):
                    return self._finish(event)
                self._show(event)
        raise AssertionError("stream() ends only by raising")  # pragma: no cover

    async def _approve(self, event: dict[str, Any]) -> None:
        """Answer a call waiting for approval (one answered elsewhere meanwhile is refused, unseen)."""
        self.terminal.clear_status()
        self.terminal.end_text()
        allow, remember = await self.approver.decide(event)
        if self.cancelling:
            return  # Ctrl-C: the cancel on its way denies the call and stops the reply
        verdict = VERDICTS.get(remember) if not allow or remember == "conversation" else "allowed"
        await self.client.send({"type": "approve", "conversation": event["conversation"], "call": event["call"],
                                "allow": allow, "remember": remember if allow else "once"})
        if not self.as_json:
            self.terminal.note(f"[{verdict or 'denied'}]")

    @contextlib.contextmanager
    def _lost(self) -> Iterator[None]:
        """A daemon gone mid-turn is told with the turn it was answering: where to find it later."""
        try:
            yield
        except DaemonGone as exc:
            if self.conversation is None or self.turn is None:
                raise
            raise DaemonGone(
                f"{exc}; it was answering conversation {self.conversation}, turn {self.turn}: the question is "
                f"kept, with the reply as far as it was saved (assistant open {self.conversation}, once it runs again)"
            ) from None

    def _status(self, event: dict[str, Any]) -> int:
        if event["type"] == "error" or event.get("saved") is False:  # not saved yet: a full disk
            return EXIT_ERROR
        reason = event.get("finish_reason")
        if reason == "cancelled" and self.cancelling:
            return EXIT_INTERRUPTED
        # cut short by the daemon's stop, or another client's cancel: the reply is not whole
        return EXIT_ERROR if reason in ("cancelled", "interrupted") else EXIT_OK

    def _catch_up(self, reply: str) -> None:
        """Show what a followed reply said while this client was away."""
        if reply.startswith(self.shown):
            self.terminal.text(reply[len(self.shown):])
            self.shown = reply

    async def _stored(self) -> int:
        """Show the rest of the turn as stored (it ended while this client was away)."""
        event = await self.client.request({"type": "open", "conversation": self.conversation, "turn": self.turn})
        if self.as_json:
            self.terminal.out.write(json_line(event))
            self.terminal.out.flush()
            return EXIT_ERROR if event["type"] == "error" or event["turns"][0]["status"] != "complete" else EXIT_OK
        self.terminal.clear_status()
        if event["type"] == "error":
            self.terminal.end_text()
            self.terminal.note(f"assistant: {error_text(event)}")
            return EXIT_ERROR
        stored = event["turns"][0]
        reply, status = stored["reply"], stored["status"]
        if reply.startswith(self.shown):
            self.terminal.text(reply[len(self.shown):])
        self.terminal.end_text()
        if not reply.startswith(self.shown):  # a crash kept the reply as last saved, shorter
            self.terminal.note(f"[the daemon kept the reply as far as it was saved: {len(reply)} characters]")
        if status == "error":
            self.terminal.note(f"assistant: {stored['error']}")
        elif status != "complete":
            self.terminal.note(f"[{STOPPED.get(status, status)}]")
        self.terminal.note(f"(conversation {self.conversation}, turn {self.turn})")
        return EXIT_OK if status == "complete" else EXIT_ERROR

    def _show(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "user":
            for chip in event.get("files") or ():
                if chip.get("truncated"):
                    self.terminal.note(f"[{chip_text(chip)}: only part of it fits the context; the rest is not sent]")
        elif kind == "delta" and self.stream:
            self.terminal.text(event["text"])
            self.shown += event["text"]
        elif kind == "progress" and event.get("stage") == "recall" and event.get("sources"):
            if not self.terminal.quiet:  # what the model was shown of the past: a line that stays
                self.terminal.note(str(event.get("detail")))
        elif kind == "progress" and not self.cancelling:
            self.terminal.status(f"{event.get('stage')}: {event.get('detail')}")
        elif kind == "reasoning" and not self.cancelling:
            self.terminal.status("thinking…")
        elif kind == "tool" and event.get("name") == "memory_save" and event.get("ok"):
            self.terminal.note(remembered(str(event.get("summary"))))
        elif kind == "tool":  # a turn's facts go to stderr whatever it is; progress only to a terminal
            self.terminal.note(f"[tool {event.get('name')}: {event.get('summary')}]")

    def _finish(self, event: dict[str, Any]) -> int:
        cid = event.get("conversation")
        where = f"conversation {cid}" if cid else "a new conversation"
        if event.get("turn"):
            where += f", turn {event['turn']}"
        if event["type"] == "error":
            self.terminal.clear_status()
            self.terminal.end_text()
            self.terminal.note(f"assistant: {error_text(event, where)}")
            return EXIT_ERROR
        if not self.stream:
            self.terminal.text(first_code_block(event["text"]) if self.extract else event["text"])
        self.terminal.clear_status()
        self.terminal.end_text()
        reason = event["finish_reason"]
        if reason not in ("stop", None):
            elsewhere = reason == "cancelled" and not self.cancelling
            self.terminal.note(f"[{CANCELLED_ELSEWHERE if elsewhere else STOPPED.get(reason, reason)}]")
        if not self.terminal.quiet:
            self.terminal.note(f"({where}, context {event['ctx_used']}/{event['ctx_max'] or '?'})")
        if event.get("saved") is False:
            self.terminal.note(f"assistant: {event.get('note') or 'the reply is not saved yet'}")
        if self.stats:  # asked for: said also when the server reports none (Ollama, vLLM)
            self.terminal.note(describe_timings(event.get("timings") or {}))
        return self._status(event)


async def set_system(client: Wire, conversation: int, system: str, terminal: Terminal) -> bool:
    event = await client.request({"type": "settings", "conversation": conversation, "system": system})
    if event["type"] == "error":
        terminal.note(f"assistant: {error_text(event)}")
        return False
    return True
