"""The events the daemon sends, each built here (docs/PROTOCOL.md is their reference).

Every event a turn sends, the ``error`` of any request, and the fields of the live
``changed`` events that more than one place publishes: one constructor each, typed,
so that an event's fields are written once.
"""

from __future__ import annotations

from typing import Any

from core.errors import AssistantError
from core.models import display_name
from core.router import Timings, ToolCall, Usage
from history import Conversation

__all__ = [
    "Event", "approval", "approved", "cancelled_kb", "cancelled_turn", "changed", "config", "conversation",
    "conversation_item", "conversation_shown", "conversations", "deleted", "delta", "done", "error_event",
    "estimate", "following", "forbidden", "kb", "kb_progress", "kb_results", "listing", "mcp_servers",
    "missed", "model_name", "not_following", "progress", "reasoning", "results", "settings", "status", "tool",
    "usage_json", "user", "watching",
]

Event = dict[str, Any]  # one JSON object on the wire


def error_event(exc: AssistantError, **extra: Any) -> Event:
    """The ``error`` event for a refusal; ``extra`` adds ``conversation``/``turn`` (or ``id``)."""
    event: Event = {"type": "error", "code": exc.code, "message": exc.message}
    event.update(extra)
    return event


def user(conversation: int, turn: int, text: str, files: list[dict[str, Any]], ref: str | None) -> Event:
    """The question stored: the turn has begun."""
    return {"type": "user", "conversation": conversation, "turn": turn, "text": text, "files": files, "ref": ref}


def delta(conversation: int, turn: int, text: str) -> Event:
    return {"type": "delta", "conversation": conversation, "turn": turn, "text": text}


def reasoning(conversation: int, turn: int, text: str) -> Event:
    return {"type": "reasoning", "conversation": conversation, "turn": turn, "text": text}


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
    event: Event = {"type": "tool", "conversation": conversation, "turn": turn, "name": call.name, "server": server,
                    "tool": own, "arguments": arguments, "ok": ok, "summary": summary}
    if call.from_text:
        event["from_text"] = True
    if approval is not None:
        event["approval"] = approval
    return event


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
    event: Event = {
        "type": "done", "conversation": conversation, "turn": turn, "text": text, "finish_reason": finish_reason,
        "usage": usage_json(usage), "ctx_used": ctx_used, "ctx_max": ctx_max,
        "timings": timings.to_json() if timings else None, "model": model, "title": title, "saved": saved,
    }
    if client_calls:  # docs/PROTOCOL.md, "done"
        event["tool_calls"] = [call.to_openai() for call in client_calls]
    if note is not None:
        event["note"] = note
    return event


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
