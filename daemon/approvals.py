"""A person in the loop: calls of tools that may act wait for an answer (docs/DESIGN.md, "Approval").

A hosted tool its server does not annotate read-only (``core.mcpconfig.McpServerSpec.asks``)
runs only once allowed. Each turn has a ``TurnGate`` (the ``core.tools.Gate`` its tools run
behind): a tool approved for the conversation earlier (its ``approved_tools`` setting) runs at
once; otherwise the turn's ``Asker`` decides, and the decision is kept with the turn.

- ``SocketAsker`` asks the clients: the ``approval`` event goes to the asking connection and
  the turn's followers, and a ``changed`` (kind ``approval``) to the watchers; the turn waits
  until one of them answers (``approve``, ``Approvals.answer``). No answer within
  ``approval_timeout``, every one of them gone, a cancel or the daemon stopping: denied.
- ``Refuser`` asks nobody and denies: the seam for a door with no person behind it (the
  OpenAI-compatible HTTP door), whose turns run only tools the configuration lets run
  without asking (``approval = "auto"``, ``auto_approve``, read-only ones). Any object with
  ``ask(question) -> Approval`` will do as an asker (``TurnEngine.ask(..., asker=...)``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from core.errors import NotPending
from core.tools import Approval, Tool
from history import AsyncHistory, HistoryStore, utc_timestamp

from . import events
from .connection import Emit, Replier
from .live import Live

__all__ = ["Approvals", "Asker", "Question", "Refuser", "SocketAsker", "TurnGate", "approved_tools"]

logger = logging.getLogger(__name__)

APPROVED_SETTING = "approved_tools"  # a conversation's setting: tools approved for its rest


@dataclass(frozen=True)
class Question:
    """One call waiting for approval, as the ``approval`` event shows it."""

    conversation: int
    turn: int
    call: str  # its id in the conversation's running turn, which ``approve`` names
    name: str  # as the model called it (``SERVER__TOOL``)
    server: str | None
    tool: str  # its name on its server
    arguments: dict[str, Any]
    annotations: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"conversation": self.conversation, "turn": self.turn, "call": self.call, "name": self.name,
                "server": self.server, "tool": self.tool, "arguments": self.arguments,
                "annotations": self.annotations}


class Asker(Protocol):
    """What decides a call nobody approved for the conversation: a person, or a policy."""

    async def ask(self, question: Question) -> Approval:
        """The decision; ``CancelledError`` when the turn stops meanwhile."""


class Refuser:
    """An asker with nobody behind it: every call it is asked about is denied."""

    async def ask(self, question: Question) -> Approval:
        return Approval(allowed=False, by="policy", at=utc_timestamp())


def approved_tools(settings: dict[str, Any]) -> list[str]:
    """The tools a conversation's settings approve for its rest (names as offered)."""
    names = settings.get(APPROVED_SETTING)
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


@dataclass
class _Waiting:
    question: Question
    answer: asyncio.Future[Approval]


class Approvals:
    """The calls waiting for a person's answer, daemon-wide, by conversation and call."""

    def __init__(self, live: Live, timeout: float) -> None:
        self.live = live
        self.timeout = timeout
        self.closed = False  # the daemon is stopping: every call is denied
        self._waiting: dict[tuple[int, str], _Waiting] = {}
        self._decided: dict[int, dict[str, Approval]] = {}  # the running turns' answered calls

    def waiting(self, cid: int) -> list[dict[str, Any]]:
        """The ``approval`` events of a conversation's calls still waiting (for a ``follow``)."""
        return [events.approval(w.question.to_json()) for (c, _), w in self._waiting.items() if c == cid]

    async def ask(self, question: Question, emit: Emit, answerers: Callable[[], list[Replier]]) -> Approval:
        """Show ``question`` (``emit``: the turn's events; the watchers) and wait for an answer from a
        client; denied on the timeout, when ``answerers`` (who can answer) are all gone, or at a stop."""
        if self.closed:
            return Approval(allowed=False, by="shutdown", at=utc_timestamp())
        key = (question.conversation, question.call)
        waiting = self._waiting[key] = _Waiting(question, asyncio.get_running_loop().create_future())
        shown = question.to_json()
        emit(events.approval(shown))
        self.live.publish("approval", "asked", **shown)

        def left() -> None:  # one of them hung up: denied when nobody who could answer is left
            if not any(r.listening for r in answerers()):
                self._settle(key, Approval(allowed=False, by="gone", at=utc_timestamp()))

        forget = [r.on_hang_up(left) for r in answerers()]
        left()
        decision: Approval | None = None
        try:
            async with asyncio.timeout(self.timeout):
                decision = await waiting.answer
        except TimeoutError:
            decision = Approval(allowed=False, by="timeout", at=utc_timestamp())
        finally:
            if decision is None:  # the turn was stopped (TurnGate keeps the denial with the turn)
                decision = Approval(allowed=False, by="shutdown" if self.closed else "cancel", at=utc_timestamp())
            del self._waiting[key]
            for undo in forget:
                undo()
            self._decided.setdefault(question.conversation, {})[question.call] = decision
            self.live.publish("approval", "answered", conversation=question.conversation, turn=question.turn,
                              call=question.call, allowed=decision.allowed, by=decision.by)
        return decision

    def _settle(self, key: tuple[int, str], decision: Approval) -> None:
        waiting = self._waiting.get(key)
        if waiting is not None and not waiting.answer.done():
            waiting.answer.set_result(decision)

    def answer(self, cid: int, call: str, allow: bool, remember: bool, client: str | None) -> Approval:
        """A client's answer (``approve``); ``NotPending`` for a call that waits for none."""
        waiting = self._waiting.get((cid, call))
        if waiting is None or waiting.answer.done():
            earlier = waiting.answer.result() if waiting is not None else self._decided.get(cid, {}).get(call)
            if earlier is not None:
                how = "allowed" if earlier.allowed else "denied"
                raise NotPending(f"call {call} of conversation {cid} was already answered ({how}); "
                                 "a call is answered once")
            asked = ", ".join(c for (n, c) in self._waiting if n == cid) or "none"
            raise NotPending(f"conversation {cid} has no call {call!r} waiting for approval (waiting: {asked}); "
                             "answer the call an approval event named")
        approval = Approval(allowed=allow, by="user", at=utc_timestamp(), remember=remember and allow, client=client)
        waiting.answer.set_result(approval)
        return approval

    def forget(self, cid: int) -> None:
        """The conversation's turn ended: its calls wait for nothing more."""
        self._decided.pop(cid, None)

    def close(self) -> None:
        """The daemon is stopping: every call waiting is denied, and every later one."""
        self.closed = True
        for key in list(self._waiting):
            self._settle(key, Approval(allowed=False, by="shutdown", at=utc_timestamp()))


class SocketAsker:
    """Asks the clients of a turn: the connection that asked, the turn's followers, the watchers."""

    def __init__(self, approvals: Approvals, emit: Emit, answerers: Callable[[], list[Replier]]) -> None:
        self.approvals = approvals
        self.emit = emit  # the turn's events: to the asking connection and the followers
        self.answerers = answerers

    async def ask(self, question: Question) -> Approval:
        return await self.approvals.ask(question, self.emit, self.answerers)


class TurnGate:
    """A turn's ``Gate``: a tool approved for the conversation runs, else the asker decides; every
    decision is added to ``records`` (stored with the turn, shown in ``open``)."""

    def __init__(self, conversation: int, turn: int, history: AsyncHistory, live: Live, approvals: Approvals,
                 asker: Asker, records: list[dict[str, Any]], progress: Callable[[str, str], None]) -> None:
        self.conversation = conversation
        self.turn = turn
        self.history = history
        self.live = live
        self.approvals = approvals
        self.asker = asker
        self.records = records
        self.progress = progress  # the turn's progress events: approval, then tool once allowed
        self._asked = 0

    async def __call__(self, tool: Tool, arguments: dict[str, Any]) -> Approval:
        self._asked += 1
        question = Question(self.conversation, self.turn, f"{self.turn}.{self._asked}", tool.name, tool.server,
                            tool.own_name, arguments, tool.annotations or {})
        conv = await self.history.run(HistoryStore.get_conversation, self.conversation)
        if conv is not None and tool.name in approved_tools(conv.settings):
            return self._record(question, Approval(allowed=True, by="conversation", at=utc_timestamp()))
        self.progress("approval", f"waiting for approval of {tool.name}")
        try:
            decision = await self.asker.ask(question)
        except asyncio.CancelledError:
            by = "shutdown" if self.approvals.closed else "cancel"
            self._record(question, Approval(allowed=False, by=by, at=utc_timestamp()))
            raise
        if decision.remember:
            await self._remember(tool.name)
        if decision.allowed:
            self.progress("tool", f"running {tool.name}")
        return self._record(question, decision)

    def _record(self, question: Question, decision: Approval) -> Approval:
        self.records.append({"call": question.call, "name": question.name, "server": question.server,
                             "tool": question.tool, "arguments": question.arguments, **decision.to_json()})
        logger.info("conversation %d turn %d: %s %s (%s)", self.conversation, self.turn, question.name,
                    "allowed" if decision.allowed else "denied", decision.by)
        return decision

    async def _remember(self, name: str) -> None:
        """Approve ``name`` for the rest of the conversation (its ``approved_tools`` setting)."""
        conv = await self.history.run(HistoryStore.get_conversation, self.conversation)
        if conv is None:
            return
        names = sorted({*approved_tools(conv.settings), name})
        conv = await self.history.run(
            HistoryStore.update_conversation, self.conversation, settings={APPROVED_SETTING: names})
        if conv is not None:
            self.live.conversation_updated(conv)
