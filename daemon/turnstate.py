"""A running turn's state: ``TurnState`` and its records, the ``Slot`` the engine keeps it in.

``TurnState`` holds enough to store a turn however it ends; what the reply has so far
(``Reply``), an OpenAI client's own tools (``ClientTools``) and the crash guard's timer
(``Checkpoint``) are records of their own.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from core.errors import AssistantError
from core.router import ModelInfo, Timings, ToolCall, Usage
from core.tools import TurnCalls
from history import TurnContext, TurnStatus

from . import events
from .approvals import Asker
from .connection import Emit
from .context import Progress

__all__ = ["Checkpoint", "ClientTools", "Outcome", "Reply", "Slot", "StopReason", "TurnState"]

StopReason = Literal["cancelled", "interrupted"]


@dataclass
class Reply:
    """The reply so far: its text, its reasoning, and the server's usage and timings."""

    parts: list[str] = field(default_factory=list)  # the reply's deltas, joined on demand
    reasoning: str = ""  # the current round's, until its message holds it
    shown: str = ""  # every reasoning delta of the turn, for a ``follow`` joining late
    usage: Usage | None = None
    timings: Timings | None = None  # the model server's figures of the last request (llama-server)
    round_start: int = 0  # where the current round's text begins in the reply

    @property
    def text(self) -> str:
        """The reply so far (appending to a list keeps a long stream linear)."""
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""


@dataclass
class ClientTools:
    """An OpenAI client's own tools: offered beside ours, run by the client (docs/DESIGN.md)."""

    offered: list[dict[str, Any]] = field(default_factory=list)  # their definitions, as the client sent them
    calls: list[ToolCall] = field(default_factory=list)  # the calls to them the turn ended on
    # a turn taken up again with their results (``TurnRunner.resume``): its messages after the
    # question, for the router
    resumed: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Checkpoint:
    """When the streaming reply was last saved, and the save that is due."""

    last: float = field(default_factory=time.monotonic)
    timer: asyncio.TimerHandle | None = None


@dataclass
class TurnState:
    """What one running turn has so far: enough to store it however it ends."""

    conversation: int
    turn: int
    model: ModelInfo
    messages: list[dict[str, Any]]  # this turn's messages as stored, the question first
    question: dict[str, Any]  # the question as the router gets it (images inline)
    query: str  # the question as typed: what a knowledge-base search looks for
    topic: str  # the question in words: its text, else its files' names (what a title is made from)
    kb_injection: str  # the conversation's kb_injection mode
    new_conversation: bool = False  # the turn started its conversation
    files: list[dict[str, Any]] = field(default_factory=list)  # the question's chips, as ``user`` shows them
    ref: str | None = None  # the ask's ``ref``
    started_at: str = ""  # when the question was stored
    model_id: str = ""  # the model the turn was stored with (``model`` may still be the default)
    model_final: bool = True  # False: ``model`` is the default as listed, not yet asked about for this turn
    reply: Reply = field(default_factory=Reply)
    unoffered: bool = False  # the last round called tools that were not offered
    prompt_estimate: int = 0
    ctx_used: int = 0
    prompt: list[dict[str, Any]] = field(default_factory=list)  # the last prompt sent: the title extends it
    tools: list[dict[str, Any]] | None = None  # the tools offered with it
    sources: list[dict[str, Any]] = field(default_factory=list)  # the knowledge-base passages it carried
    past: TurnContext | None = None  # what history held for the prompt before this turn
    calls: TurnCalls | None = None  # the tool calls made so far (a repeated one is not run again)
    approvals: list[dict[str, Any]] = field(default_factory=list)  # how its calls of acting tools were decided
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p (and a door's stop, seed): sent when set
    overrides: dict[str, Any] = field(default_factory=dict)  # the ask's own sampling, over the settings'
    client: ClientTools = field(default_factory=ClientTools)
    mcp: tuple[str, ...] = ()  # the MCP servers the conversation uses (its setting, else the default)
    stored: asyncio.Event = field(default_factory=asyncio.Event)  # set once its outcome is stored
    checkpoint: Checkpoint = field(default_factory=Checkpoint)

    @property
    def ctx_before(self) -> int:
        """The context the conversation filled before this turn."""
        return self.past.conversation.ctx_used if self.past is not None else 0

    @property
    def title(self) -> str | None:
        """The conversation's title as the turn began (None: it has none)."""
        if self.past is None:
            return None
        return self.past.conversation.title or None

    def emit_progress(self, emit: Emit) -> Progress:
        def progress(stage: str, detail: str, sources: list[dict[str, Any]] | None = None) -> None:
            emit(events.progress(self.conversation, self.turn, stage, detail, sources=sources))
        return progress


@dataclass(eq=False)  # one per ask, told apart by identity (kept in sets)
class Slot:
    """A conversation's one turn, from the moment its ``ask`` is accepted."""

    task: asyncio.Task[Any]
    state: TurnState | None = None  # None until the question is stored
    storing: bool = False  # the question is on its way to the store: it will be there, whatever happens
    stop: StopReason | None = None  # set by cancel() or shutdown()
    finishing: bool = False  # its outcome is being stored: too late to stop, and it must not be cut
    # docs/PROTOCOL.md, "follow": other requests' emits that get the turn's events too
    followers: list[Emit] = field(default_factory=list)
    stage: str = "starting"  # the last progress stage, or "replying" once text streams after it
    started: asyncio.Event = field(default_factory=asyncio.Event)  # set once stored, or the ask ended
    ended: bool = False  # its done or error was sent
    asker: Asker | None = None  # decides its calls of tools that may act (daemon.approvals)

    def relay(self, emit: Emit) -> Emit:
        """``emit``, with each event also sent to the turn's followers (a copy each: every emit
        sets its own request's id)."""
        def relayed(event: dict[str, Any]) -> None:
            kind = event["type"]
            if kind == "progress":
                self.stage = event["stage"]
            elif kind in ("delta", "reasoning"):
                self.stage = "replying"
            for follower in self.followers:
                follower(dict(event))
            emit(event)
            if kind in ("done", "error") and self.state is not None:
                self.ended = True
                self.followers.clear()
        return relayed

    def following(self) -> dict[str, Any]:
        """The ``following`` event of the running turn: what it has so far, from memory."""
        state = self.state
        assert state is not None
        return events.following(
            state.conversation, state.turn, text=state.query, files=state.files, ref=state.ref, model=state.model_id,
            stage=self.stage, started_at=state.started_at, reply=state.reply.text, reasoning=state.reply.shown,
        )


@dataclass
class Outcome:
    """How a turn's conversation with the router ended."""

    status: TurnStatus = "complete"
    finish_reason: str | None = None
    failure: AssistantError | None = None
    foreign_cancel: bool = False  # cancelled by someone tearing the loop down, not by a stop
