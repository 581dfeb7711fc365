"""The events the daemon sends, each built here (docs/PROTOCOL.md is their reference).

Every event a turn sends, the ``error`` of any request, and the fields of the live
``changed`` events that more than one place publishes: one constructor each, typed,
so that an event's fields are written once. The events a turn sends are records too
(``Began``, ``Delta``, ``Reasoning``, ``ToolRan``, ``Done``, ``Failed``): each constructor
builds its record's JSON, and a reader of a turn's events in the daemon (the OpenAI door's
relay) gets them back as those records with ``read_turn``, never by string keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from core.errors import AssistantError
from core.models import display_name
from core.router import Timings, ToolCall, Usage
from history import Conversation

__all__ = [
    "Began", "Delta", "Done", "Event", "Failed", "Reasoning", "ToolRan", "TurnEvent", "approval", "approved",
    "cancelled_kb", "cancelled_turn", "changed", "config", "conversation", "conversation_item",
    "conversation_shown", "conversations", "deleted", "delta", "done", "error_event", "estimate", "following",
    "forbidden", "kb", "kb_progress", "kb_results", "listing", "mcp_servers", "missed", "model_name",
    "not_following", "progress", "read_turn", "reasoning", "results", "settings", "status", "tool",
    "usage_json", "user", "watching",
]

Event = dict[str, Any]  # one JSON object on the wire


# -- a turn's events, as records (docs/PROTOCOL.md, "Events") ------------------------------------


@dataclass(frozen=True, slots=True)
class Began:
    """``user``: the question stored, the turn has begun."""

    KIND: ClassVar[str] = "user"
    conversation: int
    turn: int
    text: str
    files: list[dict[str, Any]]
    ref: str | None

    def to_json(self) -> Event:
        return {"type": self.KIND, "conversation": self.conversation, "turn": self.turn, "text": self.text,
                "files": self.files, "ref": self.ref}

    @classmethod
    def of(cls, event: Event) -> Began:
        return cls(event["conversation"], event["turn"], event["text"], event["files"], event["ref"])


@dataclass(frozen=True, slots=True)
class Delta:
    """``delta``: a piece of the reply's text."""

    KIND: ClassVar[str] = "delta"
    conversation: int
    turn: int
    text: str

    def to_json(self) -> Event:
        return {"type": self.KIND, "conversation": self.conversation, "turn": self.turn, "text": self.text}

    @classmethod
    def of(cls, event: Event) -> Delta:
        return cls(event["conversation"], event["turn"], event["text"])


@dataclass(frozen=True, slots=True)
class Reasoning:
    """``reasoning``: a piece of the model's reasoning."""

    KIND: ClassVar[str] = "reasoning"
    conversation: int
    turn: int
    text: str

    def to_json(self) -> Event:
        return {"type": self.KIND, "conversation": self.conversation, "turn": self.turn, "text": self.text}

    @classmethod
    def of(cls, event: Event) -> Reasoning:
        return cls(event["conversation"], event["turn"], event["text"])


@dataclass(frozen=True, slots=True)
class ToolRan:
    """``tool``: a tool call the daemon ran (``server``/``tool``: where the tool lives; ours: None
    and its name; ``from_text``: the call was read from the reply's text)."""

    KIND: ClassVar[str] = "tool"
    conversation: int
    turn: int
    name: str
    server: str | None
    tool: str
    arguments: Any
    ok: bool
    summary: str
    from_text: bool = False
    approval: dict[str, Any] | None = None

    def to_json(self) -> Event:
        event: Event = {"type": self.KIND, "conversation": self.conversation, "turn": self.turn, "name": self.name,
                        "server": self.server, "tool": self.tool, "arguments": self.arguments, "ok": self.ok,
                        "summary": self.summary}
        if self.from_text:
            event["from_text"] = True
        if self.approval is not None:
            event["approval"] = self.approval
        return event

    @classmethod
    def of(cls, event: Event) -> ToolRan:
        return cls(event["conversation"], event["turn"], event["name"], event["server"], event["tool"],
                   event["arguments"], event["ok"], event["summary"], event.get("from_text", False),
                   event.get("approval"))


@dataclass(frozen=True, slots=True)
class Done:
    """``done``: a turn's reply, whole (``usage``/``timings`` as the wire has them;
    ``tool_calls``: the OpenAI client's own tools it ended on; ``note``: why ``saved`` is false)."""

    KIND: ClassVar[str] = "done"
    conversation: int
    turn: int
    text: str
    finish_reason: str | None
    usage: dict[str, Any]
    ctx_used: int
    ctx_max: int
    timings: dict[str, Any] | None
    model: str
    title: str | None
    saved: bool
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    note: str | None = None

    def to_json(self) -> Event:
        event: Event = {
            "type": self.KIND, "conversation": self.conversation, "turn": self.turn, "text": self.text,
            "finish_reason": self.finish_reason, "usage": self.usage, "ctx_used": self.ctx_used,
            "ctx_max": self.ctx_max, "timings": self.timings, "model": self.model, "title": self.title,
            "saved": self.saved,
        }
        if self.tool_calls:  # docs/PROTOCOL.md, "done"
            event["tool_calls"] = self.tool_calls
        if self.note is not None:
            event["note"] = self.note
        return event

    @classmethod
    def of(cls, event: Event) -> Done:
        return cls(event["conversation"], event["turn"], event["text"], event["finish_reason"], event["usage"],
                   event["ctx_used"], event["ctx_max"], event["timings"], event["model"], event["title"],
                   event["saved"], event.get("tool_calls") or [], event.get("note"))

    @property
    def prompt_tokens(self) -> int | None:
        return self.usage.get("prompt_tokens")

    @property
    def completion_tokens(self) -> int | None:
        return self.usage.get("completion_tokens")


@dataclass(frozen=True, slots=True)
class Failed:
    """``error``: a refusal or a failed turn (``where``: ``conversation``/``turn``, or ``id``)."""

    KIND: ClassVar[str] = "error"
    code: str
    message: str
    where: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> Event:
        return {"type": self.KIND, "code": self.code, "message": self.message, **self.where}

    @classmethod
    def of(cls, event: Event) -> Failed:
        where = {key: value for key, value in event.items() if key not in ("type", "code", "message")}
        return cls(event["code"], event["message"], where)


TurnEvent = Began | Delta | Reasoning | ToolRan | Done | Failed
_TURN_EVENTS: dict[str, type[Began] | type[Delta] | type[Reasoning] | type[ToolRan] | type[Done] | type[Failed]] = {
    kind.KIND: kind for kind in (Began, Delta, Reasoning, ToolRan, Done, Failed)
}


def read_turn(event: Event) -> TurnEvent | None:
    """A turn's event as its record; None for the events a turn sends that have none
    (``progress``, ``approval``, ...)."""
    kind = _TURN_EVENTS.get(event["type"])
    return None if kind is None else kind.of(event)


def error_event(exc: AssistantError, **extra: Any) -> Event:
    """The ``error`` event for a refusal; ``extra`` adds ``conversation``/``turn`` (or ``id``)."""
    return Failed(exc.code, exc.message, extra).to_json()


def user(conversation: int, turn: int, text: str, files: list[dict[str, Any]], ref: str | None) -> Event:
    """The question stored: the turn has begun."""
    return Began(conversation, turn, text, files, ref).to_json()


def delta(conversation: int, turn: int, text: str) -> Event:
    return Delta(conversation, turn, text).to_json()


def reasoning(conversation: int, turn: int, text: str) -> Event:
    return Reasoning(conversation, turn, text).to_json()


def progress(
    conversation: int | None, turn: int, stage: str, detail: str, *, sources: list[dict[str, Any]] | None = None,
    done: int | None = None, total: int | None = None,
) -> Event:
    """A step of a turn (``sources``: the passages a ``kb`` step found; ``done``/``total``: OCR's pages)."""
    event: Event = {"type": "progress", "conversation": conversation, "turn": turn, "stage": stage, "detail": detail}
    if sources is not None:
        event["sources"] = sources
    if done is not None:
        event.update(done=done, total=total)
    return event


def tool(
    conversation: int, turn: int, call: ToolCall, *, server: str | None, own: str, arguments: Any, ok: bool,
    summary: str, approval: dict[str, Any] | None,
) -> Event:
    """A tool call the daemon ran (``server``/``own``: where the tool lives; ours: None and its name)."""
    return ToolRan(conversation, turn, call.name, server, own, arguments, ok, summary, call.from_text,
                   approval).to_json()


def usage_json(usage: Usage | None) -> dict[str, Any]:
    """Usage as events show it: always an object, its counts null when the server said none."""
    return usage.to_json() if usage else {"prompt_tokens": None, "completion_tokens": None}


def done(
    conversation: int, turn: int, text: str, finish_reason: str | None, *, usage: Usage | None, ctx_used: int,
    ctx_max: int, timings: Timings | None, model: str, title: str | None, saved: bool,
    client_calls: list[ToolCall], note: str | None,
) -> Event:
    """A turn's reply, whole (``client_calls``: the OpenAI client's own tools it ended on;
    ``note``: why ``saved`` is false)."""
    return Done(conversation, turn, text, finish_reason, usage_json(usage), ctx_used, ctx_max,
                timings.to_json() if timings else None, model, title, saved,
                [call.to_openai() for call in client_calls], note).to_json()


def following(conversation: int, turn: int, **so_far: Any) -> Event:
    """A ``follow``'s answer: the running turn so far (``Slot.following`` names the fields)."""
    return {"type": "following", "conversation": conversation, "turn": turn, **so_far}


def not_following(conversation: int) -> Event:
    """A ``follow``'s answer when no turn runs."""
    return {"type": "following", "conversation": conversation, "turn": None}


def approval(question: dict[str, Any]) -> Event:
    """A call of a tool that may act, waiting for a person (``Question.to_json``)."""
    return {"type": "approval", **question}


def conversation_shown(conv: Conversation) -> dict[str, Any]:
    """A conversation's own fields as ``settings`` answers them and the ``conversation``
    ``updated`` change carries them."""
    return {"conversation": conv.id, "title": conv.title, "model": conv.model,
            "model_name": model_name(conv.model), "system": conv.system_prompt, "settings": conv.settings}


def conversation_item(conv: Conversation, running: bool) -> dict[str, Any]:
    """One item of a ``conversations`` listing."""
    return {**conv.to_json(), "model": conv.model, "model_name": model_name(conv.model), "running": running}


def model_name(model: str | None) -> str | None:
    """A model's short name as ``models`` shows it; None for the daemon's default."""
    return display_name(model) if model else None


# -- the answers of the other requests (docs/PROTOCOL.md, "Events") ------------------------------


def forbidden() -> Event:
    """The ``error`` for a connection of another user (no request was read)."""
    return {"type": "error", "code": "forbidden", "message": "this daemon serves only its own user"}


def cancelled_turn(conversation: int, turn: int | None) -> Event:
    return {"type": "cancelled", "conversation": conversation, "turn": turn}


def cancelled_kb(kb: str, running: bool) -> Event:
    return {"type": "cancelled", "kb": kb, "running": running}


def conversations(items: list[dict[str, Any]]) -> Event:
    return {"type": "conversations", "items": items}


def conversation(conv: Conversation, *, ctx_max: int, running: int | None, turns: Any) -> Event:
    """An ``open``'s answer (``turns``: ``protocol.Encoded``, encoded off the event loop)."""
    return {
        "type": "conversation", "conversation": conv.id, "title": conv.title, "model": conv.model,
        "model_name": model_name(conv.model), "system": conv.system_prompt, "settings": conv.settings, "ctx_used": conv.ctx_used, "ctx_max": ctx_max,
        "created_at": conv.created_at, "updated_at": conv.updated_at, "running": running, "total": conv.turns,
        "turns": turns,
    }


def deleted(conversation: int) -> Event:
    return {"type": "deleted", "conversation": conversation}


def listing(kind: str, items: list[dict[str, Any]], **extra: Any) -> Event:
    """A list's answer: ``models`` (with ``default``), ``presets``, ``kbs``."""
    return {"type": kind, "items": items, **extra}


def estimate(conversation: int | None, tokens: int, files: list[dict[str, Any]], ctx_used: int, ctx_max: int,
             recall_tokens: int = 0, recalled: list[dict[str, Any]] | None = None) -> Event:
    """What a staged question would cost: ``tokens`` counts its text, its files and the passages
    recall would add (``recall_tokens``, from ``recalled``)."""
    return {"type": "estimate", "conversation": conversation, "tokens": tokens, "files": files,
            "recall_tokens": recall_tokens, "recalled": recalled or [], "ctx_used": ctx_used, "ctx_max": ctx_max}


def settings(conv: Conversation) -> Event:
    return {"type": "settings", **conversation_shown(conv)}


def results(query: str, offset: int, groups: list[dict[str, Any]], more: bool) -> Event:
    """A ``search``'s hits, grouped by conversation."""
    return {"type": "results", "query": query, "offset": offset, "total": sum(len(g["hits"]) for g in groups),
            "more": more, "conversations": groups}


def kb_progress(kb: str, step: dict[str, Any]) -> Event:
    return {"type": "progress", "kb": kb, **step}


def kb(info: dict[str, Any]) -> Event:
    """A knowledge base as ``kb_add``, ``kb_remove`` and ``kb_link`` answer it."""
    return {"type": "kb", **info}


def kb_results(kb: str, query: str, search: str, note: str | None, hits: list[dict[str, Any]]) -> Event:
    return {"type": "kb_results", "kb": kb, "query": query, "search": search, "note": note, "results": hits}


def status(**fields: Any) -> Event:
    """``status``'s answer; its fields are listed in docs/PROTOCOL.md, "status"."""
    return {"type": "status", **fields}


def config(shown: dict[str, Any], default_model: str | None) -> Event:
    return {"type": "config", **shown, "default_model": default_model}


def watching(seq: int, epoch: str, first: int) -> Event:
    """A ``watch``'s answer: the last change's number, the daemon run's name, the first change
    the journal still holds (``seq + 1`` when none)."""
    return {"type": "watching", "seq": seq, "epoch": epoch, "first": first}


def approved(conversation: int, call: str, allow: bool, remember: bool) -> Event:
    return {"type": "approved", "conversation": conversation, "call": call, "allow": allow,
            "remember": "conversation" if remember else "once"}


def mcp_servers(servers: list[dict[str, Any]]) -> Event:
    return {"type": "mcp_servers", "servers": servers}


def memory(action: str, item: dict[str, Any]) -> Event:
    """A saved memory as ``memory_add``, ``memory_edit`` and ``memory_forget`` answer it."""
    return {"type": "memory", "action": action, "memory": item}


def memory_results(query: str, memories: list[dict[str, Any]], hits: list[dict[str, Any]]) -> Event:
    """A ``memory_search``'s answer: the saved memories matching, then the conversations' hits."""
    return {"type": "memory_results", "query": query, "memories": memories, "results": hits}


def changed(seq: int, kind: str, action: str, fields: dict[str, Any]) -> Event:
    """One change, to every watcher (``Live.publish``)."""
    return {"type": "changed", "seq": seq, "kind": kind, "action": action, **fields}


def missed(seq: int) -> Event:
    """To a watcher that stopped reading: the changes from ``seq`` on were not sent."""
    return {"type": "missed", "seq": seq,
            "message": "changes from this seq on were not sent, because events were not read; "
                       "read the conversations (and open the one shown) again"}
