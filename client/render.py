"""Events shown to people: one function per answer type, and text that cannot drive the terminal.

Each renderer writes an event's content to a text stream; ``RENDERERS`` maps the event
types of the simple requests to theirs. ``Printable`` wraps a stream so that a title, a
file name or a reply with ESC, CR or NUL in it is shown, never obeyed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TextIO

from common import ADD_KB, LIST_CONVERSATIONS, LIST_KBS, LIST_MODELS

from .memory import render_memories, render_memory

__all__ = [
    "RENDERERS", "Printable", "chip_text", "describe_estimate", "describe_kb_add", "describe_timings", "error_text",
    "json_line", "render_settings",
]

Renderer = Callable[[dict[str, Any], TextIO], None]
SHOWN_PER_REASON = 3  # files listed by name under one reason of a kb add; the rest are counted


# the daemon's advice names protocol requests; said here as the commands that make them
FOR_THE_COMMAND_LINE = (
    (LIST_CONVERSATIONS, "list them with: assistant conversations"),
    (LIST_MODELS, "(assistant models lists them)"),
    (LIST_KBS, "assistant kb list shows the ones there are"),
    (ADD_KB, "assistant kb add creates one"),
)


def error_text(event: dict[str, Any], where: str = "") -> str:
    """An ``error`` event for a person: its code, where it happened, its message in this client's words."""
    message = str(event.get("message"))
    for said, meant in FOR_THE_COMMAND_LINE:
        message = message.replace(said, meant)
    return f"error ({event.get('code')}){' in ' + where if where else ''}: {message}"


def chip_text(chip: dict[str, Any]) -> str:
    """A file as a question carries it: ``big.log (text, cut to fit)``."""
    cut = ", cut to fit" if chip.get("truncated") else ""
    return f"{chip.get('name')} ({chip.get('kind')}{cut})"


def _render_conversations(event: dict[str, Any], out: TextIO) -> None:
    items = event["items"]
    if not items:
        print("no conversations yet; start one with: assistant ask \"...\"", file=out)
    for item in items:
        turns = f"{item['turns']:>3} turn{'' if item['turns'] == 1 else 's'}"
        print(f"{item['conversation']:>5}  {item['updated_at'][:16].replace('T', ' ')}  {turns:<9}  {item['title']}",
              file=out)


def _render_conversation(event: dict[str, Any], out: TextIO) -> None:
    print(f"# {event['title']}  (conversation {event['conversation']}, model {event['model'] or 'default'}, "
          f"context {event['ctx_used']}/{event['ctx_max'] or '?'})", file=out)
    if event.get("system") is not None:
        print(f"system prompt: {event['system'] or '(none)'}", file=out)
    for turn in event["turns"]:
        print(f"\n[{turn['turn']}] you: {turn['text']}", file=out)
        for chip in turn.get("files") or ():
            print(f"      file: {chip_text(chip)}", file=out)
        for tool in turn.get("tools") or ():
            print(f"      tool: {tool.get('name')} — {tool.get('summary')}", file=out)
        for decided in turn.get("approvals") or ():
            print(f"      {describe_approval(decided)}", file=out)
        reply = turn["reply"] or ""
        status = turn.get("status")
        marker = "" if status == "complete" else f"  [{status}{': ' + turn['error'] if turn.get('error') else ''}]"
        print(f"[{turn['turn']}] assistant: {reply}{marker}", file=out)


# who decided a call of a tool that may act, as ``open`` tells it
DECIDED_BY = {
    "user": "by you", "conversation": "approved for this conversation", "timeout": "no answer in time",
    "gone": "nobody left to ask", "cancel": "the reply was stopped", "shutdown": "the daemon stopped",
    "policy": "nobody could be asked",
}


def describe_approval(decided: dict[str, Any]) -> str:
    """One approval or denial kept with a turn: what, by whom (and which program), when."""
    verdict = "allowed" if decided.get("allowed") else "denied"
    by = DECIDED_BY.get(decided.get("by", ""), decided.get("by", ""))
    client = f" with {decided['client']}" if decided.get("client") else ""
    arguments = json.dumps(decided.get("arguments"), ensure_ascii=False)
    if len(arguments) > 120:
        arguments = arguments[:119] + "…"
    return f"{verdict}: {decided.get('name')} {arguments} — {by}{client}, {decided.get('at')}"


def _render_models(event: dict[str, Any], out: TextIO) -> None:
    for item in event["items"]:
        name = item.get("name") or item["id"]
        star = "*" if event.get("default") in (item["id"], name) else " "
        ctx = item["ctx_max"] or "?"
        images = f" (an image counts {item['image_tokens']})" if "image" in item["input_modalities"] else ""
        path = f"  ({item['id']})" if name != item["id"] else ""  # llama-server names a model by its file
        print(f"{star} {name}  ctx {ctx}  inputs {', '.join(item['input_modalities'])}{images}{path}", file=out)


def _render_status(event: dict[str, Any], out: TextIO) -> None:
    reach = "reachable" if event["router_reachable"] else "NOT reachable"
    print(f"assistant {event['version']}, up {event['uptime']:.0f}s, {event['turns_running']} turn(s) running", file=out)
    print(f"router {event['router_url']} ({reach}), model {event.get('model_name') or event['model'] or '?'}", file=out)
    print(f"socket {event['socket']}, data {event['data_dir']}", file=out)
    if event.get("config_error"):
        print(f"configuration NOT reloaded (the one in effect is kept): {event['config_error']}", file=out)
    for server in event.get("mcp", ()):
        line = f"mcp {server['name']}: {server['state']}, {server['tools']} tool(s)"
        if server["last_error"]:
            line += f"; last error: {server['last_error']}"
        print(line, file=out)
    ocr = event.get("ocr")
    if ocr is not None:
        images = ", image files too" if ocr["images"] else ""
        state = f"available ({'+'.join(ocr['languages'])}{images})" if ocr["available"] else f"not available: {ocr['note']}"
        print(f"OCR of scanned pages {state}", file=out)


def _render_presets(event: dict[str, Any], out: TextIO) -> None:
    for preset in event["items"]:
        print(f"{preset['name']:<14} {preset['title']} ({', '.join(preset['kinds'])})", file=out)
        print(f"{'':<14} {preset['prompt']}", file=out)


def _render_results(event: dict[str, Any], out: TextIO) -> None:
    for group in event["conversations"]:
        print(f"{group['conversation']:>5}  {group['title']}", file=out)
        for hit in group["hits"]:
            print(f"       [{hit['turn']}] {hit['role']}: {' '.join(hit['excerpt'].split())}", file=out)


def _render_kbs(event: dict[str, Any], out: TextIO) -> None:
    if not event["items"]:
        print("no knowledge bases yet; add one with: assistant kb add NAME PATH...", file=out)
    for kb in event["items"]:
        links = "every conversation" if kb["linked_all"] else f"{len(kb['conversations'])} conversation(s)"
        print(f"{kb['kb']}  {kb['documents']} documents, {kb['chunks']} chunks; linked to {links}", file=out)


def _render_kb_results(event: dict[str, Any], out: TextIO) -> None:
    if event["note"]:
        print(f"({event['note']})", file=out)
    for hit in event["results"]:
        page = f", page {hit['page']}" if "page" in hit else ""
        print(f"{hit['file']}{page} (passage {hit['chunk']} of {hit['chunks']}, "
              f"{hit['similarity_kind']} {hit['similarity']:.2f})", file=out)
        print(f"    {' '.join(hit['content'].split())[:300]}", file=out)


def _render_kb(event: dict[str, Any], out: TextIO) -> None:
    print(f"{event['kb']}: {event['documents']} documents, {event['chunks']} chunks", file=out)


def _render_mcp_servers(event: dict[str, Any], out: TextIO) -> None:
    if not event["servers"]:
        print("no MCP servers configured; add [mcp.servers.NAME] to config.toml (see the README)", file=out)
    for server in event["servers"]:
        error = f"  ({server['last_error']})" if server.get("last_error") else ""
        print(f"{server['name']}  {server['transport']}  {server['state']}{error}", file=out)
        for tool in server["tools"]:
            description = " ".join(tool["description"].split())
            if len(description) > 70:
                description = description[:69] + "…"
            asks = "  (asks first)" if tool.get("asks") else ""
            print(f"    {tool['offered_as']:<40} {description}{asks}", file=out)


def describe_kb_add(event: dict[str, Any]) -> list[str]:
    """What a ``kb_add`` did, for people: the totals, then the files left out grouped by reason."""
    lines = [f"{event['kb']}: {event['documents']} documents, {event['chunks']} chunks "
             f"({event['added']} added, {event['updated']} updated, {event['unchanged']} unchanged"
             f"{', ' + str(event['removed']) + ' removed' if event.get('removed') else ''})"]
    if event.get("cancelled"):
        lines.append(f"cancelled: {event.get('unread', 0)} file(s) left unread; the files added before are kept")
    for label, notes in (("skipped", event.get("skipped") or []), ("not added", event.get("errors") or [])):
        by_reason: dict[str, list[str]] = {}
        for note in notes:
            by_reason.setdefault(note["reason"], []).append(note["path"])
        for reason, paths in by_reason.items():
            lines.append(f"{label}: {len(paths)} file(s): {reason}")
            lines += [f"  {path}" for path in paths[:SHOWN_PER_REASON]]
            if len(paths) > SHOWN_PER_REASON:
                lines.append(f"  ... and {len(paths) - SHOWN_PER_REASON} more")
    if event.get("embedding_error"):
        lines.append(f"embeddings: {event['embedding_error']} (keyword search still works)")
    elif event.get("pending"):
        lines.append(f"{event['pending']} passage(s) not yet embedded: the next add embeds them")
    return lines


def render_settings(event: dict[str, Any], out: TextIO) -> None:
    print(f"conversation {event['conversation']}: {event['title']}", file=out)
    print(f"  model: {event['model'] or 'the default'}", file=out)
    system = event.get("system")
    shown = "the default" if system is None else (repr(system) if system else "none")
    print(f"  system prompt: {shown}", file=out)
    own = event.get("settings") or {}
    print(f"  kb_injection: {own.get('kb_injection', 'auto')}", file=out)
    print(f"  recall_injection: {own.get('recall_injection', 'the default')}", file=out)
    for key in ("temperature", "top_p"):
        print(f"  {key}: {own[key] if own.get(key) is not None else 'the default'}", file=out)
    approved = own.get("approved_tools") or []
    print(f"  tools approved for this conversation: {', '.join(approved) or 'none'}", file=out)
    if own.get("memory") == "off":  # said only when it differs from the default
        print("  memory: off (incognito)", file=out)


def describe_timings(timings: dict[str, Any]) -> str:
    """The model server's own figures of one reply, for people: what it read, reused and wrote."""
    parts = []
    if timings.get("prompt_n") is not None:
        reused = timings.get("cache_n")
        prompt = f"prompt: {timings['prompt_n']} tokens read"
        if reused is not None:
            prompt += f", {reused} reused from the server's cache"
        if timings.get("prompt_ms") is not None:
            prompt += f" ({timings['prompt_ms'] / 1000:.2f} s)"
        parts.append(prompt)
    if timings.get("predicted_per_second") is not None:
        parts.append(f"reply: {timings['predicted_per_second']:.1f} tokens/s")
    return "(" + "; ".join(parts) + ")" if parts else "(the model server reported no timings)"


def describe_estimate(event: dict[str, Any]) -> list[str]:
    """What a staged question would cost, and how full the context would be."""
    files = "".join(f", {chip_text(f)} {f['tokens']}" for f in event["files"])
    text = event["tokens"] - sum(f["tokens"] for f in event["files"])
    lines = [f"about {event['tokens']} tokens: the question {text}{files}"]
    used, ctx_max = event["ctx_used"], event["ctx_max"]
    if ctx_max:
        after = used + event["tokens"]
        lines.append(f"context: {used} of {ctx_max} used; with this question about {after} ({100 * after // ctx_max}%)")
    else:
        lines.append(f"context: {used} used; the model server cannot be reached, so its size is not known")
    return lines


RENDERERS: dict[str, Renderer] = {
    "kbs": _render_kbs,
    "kb": _render_kb,
    "kb_results": _render_kb_results,
    "results": _render_results,
    "conversations": _render_conversations,
    "conversation": _render_conversation,
    "models": _render_models,
    "status": _render_status,
    "presets": _render_presets,
    "mcp_servers": _render_mcp_servers,
    "settings": render_settings,
    "memories": render_memories,
    "memory": render_memory,
    "estimate": lambda e, out: print("\n".join(describe_estimate(e)), file=out),
    "deleted": lambda e, out: print(f"deleted conversation {e['conversation']}", file=out),
    "cancelled": lambda e, out: print(
        f"conversation {e['conversation']}: " + (f"turn {e['turn']} stopped; its partial reply is kept"
                                                  if e.get("turn") is not None else "nothing was running"), file=out),
}


# C0 controls but newline and tab, DEL, and the C1 controls: shown as \xNN, never obeyed
CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)) if c not in (0x0A, 0x09)}


# JSON escapes C0 controls itself; DEL and the C1 controls it leaves raw, and a terminal may obey them
_JSON_CONTROLS = {c: f"\\u{c:04x}" for c in (0x7F, *range(0x80, 0xA0))}


def json_line(event: dict[str, Any]) -> str:
    """An event as one line of JSON (``--json``), UTF-8 but with no character a terminal obeys."""
    return json.dumps(event, ensure_ascii=False).translate(_JSON_CONTROLS) + "\n"


class Printable:
    """A text stream that shows terminal control characters instead of obeying them: a title,
    a file name or a reply with ESC, CR or NUL in it cannot recolour or rewrite the terminal."""

    def __init__(self, raw: TextIO) -> None:
        self.raw = raw

    def write(self, text: str) -> int:
        return self.raw.write(text.translate(CONTROLS))

    def flush(self) -> None:
        self.raw.flush()

    def isatty(self) -> bool:
        return self.raw.isatty()

    def fileno(self) -> int:
        return self.raw.fileno()
