"""Where a tool runs: one round's tool calls, run concurrently for a turn.

The calls go through ``core.tools.TurnCalls`` (a call made before in the turn is answered
from its first result; a tool that may act waits at the turn's gate, ``approvals.TurnGate``);
each result is a ``tool`` message stored with the turn and a ``tool`` event, and a tool's
returned images are shown to the model in a message of their own.
"""

from __future__ import annotations

from typing import Any

from core.router import ToolCall
from core.tools import Tool, Toolbox, ToolContext, TurnCalls
from history import parse_arguments

from . import events
from .connection import Emit
from .context import router_messages
from .turnstate import TurnState

__all__ = ["run_tools"]


async def run_tools(
    state: TurnState, toolbox: Toolbox, offered: list[Tool], calls: list[ToolCall], ctx: ToolContext, emit: Emit
) -> list[dict[str, Any]]:
    """Run one round's tool calls concurrently (one made before in this turn is answered from
    its first result: ``TurnCalls``); their messages for the prompt."""
    acting = {t.name for t in offered if t.acts}
    for call in calls:  # one that may act says so once allowed (TurnGate)
        if call.name not in acting:
            emit(events.progress(state.conversation, state.turn, "tool", f"running {call.name}"))
    if state.calls is None:
        state.calls = TurnCalls(toolbox)
    results = await state.calls.run(offered, [(c.name, c.arguments) for c in calls], ctx)
    by_name = {t.name: t for t in offered}
    for_prompt: list[dict[str, Any]] = []
    images: list[dict[str, Any]] = []
    showing: list[str] = []
    for call, result in zip(calls, results):
        tool = by_name.get(call.name)
        # where the tool lives: an MCP server's name and its own name for the tool (ours: None, the name)
        server, own = (tool.server, tool.own_name) if tool else (None, call.name)
        message = {"role": "tool", "tool_call_id": call.id, "content": result.content,
                   "ok": result.ok, "summary": result.summary}
        if server is not None:
            message.update(server=server, tool=own)
        state.messages.append(message)
        for_prompt.extend(router_messages([message]))
        images.extend(image for image in result.images if image not in images)  # one showing is enough
        if result.images and call.name not in showing:
            showing.append(call.name)
        emit(events.tool(state.conversation, state.turn, call, server=server, own=own,
                         arguments=parse_arguments(call.arguments), ok=result.ok, summary=result.summary,
                         approval=result.approval.to_json() if result.approval else None))
    if images:
        # tool messages carry text only: a returned image is shown in a message of its own,
        # for this turn's prompt (history keeps the tool's text; the image is not stored)
        for_prompt.append({"role": "user", "content": [
            {"type": "text", "text": f"The image(s) the {' and '.join(showing)} tool returned:"}, *images]})
    return for_prompt
