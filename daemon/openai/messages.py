"""What an OpenAI chat request asks, in the daemon's terms.

``read_chat`` turns a ``/v1/chat/completions`` body into a ``ChatAsk``: the system prompt
(the client's ``system`` messages), the earlier turns as (question, reply) texts, the new
question's text and files, and the sampling the client set for this turn. Files come as
``image_url`` parts (data URLs) and ``file`` parts (base64 ``file_data``); ``spool`` writes
them under the data folder, where the attachment pipeline reads them as it reads any
file of an ``ask``. Every refusal is a ``BadRequest`` naming the field and what to send
(``TooManyFiles`` for more files than a question takes, counted before any is decoded).
"""

from __future__ import annotations

import base64
import binascii
import errno
import hashlib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attachments import MAX_FILES, too_many_files
from core.errors import BadRequest, DiskFull
from core.sampling import sampling_problem

__all__ = ["ChatAsk", "Upload", "read_chat", "spool", "unspool"]

MAX_STOP = 4  # OpenAI's limit on stop sequences
DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?:;[\w=.+-]+)*?;base64,(?P<data>.*)", re.DOTALL)
EXTENSIONS = {
    "image/png": ".png", "image/jpeg": ".jpg", "image/gif": ".gif", "image/webp": ".webp",
    "application/pdf": ".pdf", "text/plain": ".txt", "text/markdown": ".md", "application/json": ".json",
}
SAFE_NAME = re.compile(r"[^\w.,+-]+")
# a stored file's name, in UTF-8 bytes (filesystems allow 255): a longer one keeps its start,
# its extension (up to MAX_EXTENSION characters) and a hash of the whole, so it stays unique
MAX_NAME_BYTES = 120
MAX_EXTENSION = 16


@dataclass(frozen=True)
class Upload:
    """A file sent inside a request: the name it is shown by, and its bytes."""

    name: str
    data: bytes


@dataclass
class ChatAsk:
    """A chat request in the daemon's terms."""

    model: str
    system: str | None  # the client's system messages, joined; None: it sent none
    earlier: list[tuple[str, str]]  # the turns before the question: (question, reply) texts
    question: str
    uploads: list[Upload] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, max_tokens, stop, seed
    stream: bool = False
    include_usage: bool = False
    tools: list[dict[str, Any]] = field(default_factory=list)  # the client's own, offered beside the daemon's
    # the results of the client's tools the last turn called (``question`` is then ""), or None
    tool_results: list[dict[str, Any]] | None = None


def read_chat(body: Any) -> ChatAsk:
    """The request body as a ``ChatAsk``; ``BadRequest`` saying what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest('the body must be a JSON object such as {"model": "...", "messages": [...]}')
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must name one of the models GET /v1/models lists")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("'messages' must be a non-empty list of message objects")
    if body.get("n", 1) != 1:
        raise BadRequest("'n' must be 1: the daemon answers each question once")
    stream = body.get("stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise BadRequest("'stream' must be true or false, and 'stream_options' an object")
    system, turns, results = _thread(messages)
    question_text, uploads = turns.pop() if results is None else ("", [])
    return ChatAsk(model=model, system=system, earlier=_pairs(turns),
                   question=question_text, uploads=uploads, sampling=_sampling(body), stream=stream,
                   include_usage=bool(options.get("include_usage")) and stream, tools=_tools(body),
                   tool_results=results)


def _thread(messages: list[dict[str, Any]]) -> tuple[str | None, list[Any], list[dict[str, Any]] | None]:
    """The system text; the rest as a list alternating (question, files) and reply text, ending
    with the new question; and the tool results the messages end with (None: they end with a
    question). A reply the model went on with after tool results is one turn's reply."""
    systems: list[str] = []
    turns: list[Any] = []  # [(text, uploads), reply, (text, uploads), reply, ..., (text, uploads)]
    results: list[dict[str, Any]] = []  # the tool messages since the last assistant message
    called: list[Any] = []  # the ids of the calls the last assistant message made
    for n, message in enumerate(messages):
        role, content, where = message.get("role"), message.get("content"), f"messages[{n}]"
        if role in ("system", "developer"):
            systems.append(_text(content, where))
        elif role == "user":
            text, uploads = _text(content, where), _uploads(content, n) if n == len(messages) - 1 else []
            if turns and isinstance(turns[-1], tuple):  # two questions in a row: one turn's question
                text = f"{turns.pop()[0]}\n\n{text}"
            turns.append((text, uploads))
        elif role == "assistant":
            if not turns:
                raise BadRequest(f"{where}: an assistant message must follow a user message")
            text = _text(content, where) if content is not None else ""
            if isinstance(turns[-1], str):
                turns[-1] = "\n\n".join(part for part in (turns[-1].strip(), text.strip()) if part)
            else:
                turns.append(text)
            results = []
            called = [c.get("id") for c in message.get("tool_calls") or [] if isinstance(c, dict)]
        elif role == "tool":
            if not turns or not isinstance(turns[-1], str):
                raise BadRequest(f"{where}: a tool message must follow the assistant message that called the tool")
            results.append(_tool_result(message, where))
        else:
            raise BadRequest(f"{where}: role {role!r} is not served here; send system, user, assistant and tool "
                             "messages")
    systems_text = "\n\n".join(systems) if systems else None
    if messages[-1].get("role") == "tool":
        _check_answers(called, results)
        return systems_text, turns, results
    if not turns or not isinstance(turns[-1], tuple):
        raise BadRequest("the last message must be the user's question, or the results of the tools called")
    if not turns[-1][0].strip() and not turns[-1][1]:
        raise BadRequest("the last user message has no text and no files; ask a question")
    return systems_text, turns, None


def _check_answers(called: list[Any], results: list[dict[str, Any]]) -> None:
    """The tool results must answer the calls of the assistant message before them, each once,
    as OpenAI requires: a result for a call never made would reach the model as if it had been."""
    given = [result["tool_call_id"] for result in results]
    if sorted(given) != sorted(str(call) for call in called):
        expected = ", ".join(str(call) for call in called) or "no tool"
        raise BadRequest(f"the tool messages must answer the calls of the assistant message before them, one "
                         f"each: it called {expected}, and results came for {', '.join(given)}; send one tool "
                         "message per call, with that call's tool_call_id")


def _tool_result(message: dict[str, Any], where: str) -> dict[str, Any]:
    call = message.get("tool_call_id")
    if not isinstance(call, str) or not call:
        raise BadRequest(f"{where}: a tool message needs the 'tool_call_id' of the call it answers")
    return {"role": "tool", "tool_call_id": call, "content": _text(message.get("content") or "", where)}


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The client's own function tools, as the router is to be offered them."""
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list of function tools")
    offered = []
    for n, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise BadRequest(f'tools[{n}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}')
        offered.append({"type": "function", "function": {
            key: value for key, value in function.items() if key in ("name", "description", "parameters", "strict")}})
    return offered


def _pairs(turns: list[Any]) -> list[tuple[str, str]]:
    """The earlier turns as (question, reply); a question the client kept without a reply gets ""."""
    pairs: list[tuple[str, str]] = []
    for item in turns:
        if isinstance(item, tuple):
            pairs.append((item[0], ""))
        else:
            pairs[-1] = (pairs[-1][0], item)
    return pairs


def _text(content: Any, where: str) -> str:
    """A message's text: its string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text"
                         and isinstance(p.get("text"), str))
    raise BadRequest(f"{where}: 'content' must be text or a list of parts")


def _uploads(content: Any, n: int) -> list[Upload]:
    """The files among a question's parts: ``image_url`` data URLs and ``file`` parts."""
    if not isinstance(content, list):
        return []
    files = sum(1 for part in content if not (isinstance(part, dict) and part.get("type") == "text"))
    if files > MAX_FILES:  # before any is decoded, let alone written
        raise too_many_files(files)
    uploads: list[Upload] = []
    for i, part in enumerate(content):
        where = f"messages[{n}].content[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            continue
        if kind == "image_url":
            url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else None
            mime, data = _data_url(url, where)
            uploads.append(Upload(f"image-{len(uploads) + 1}{EXTENSIONS.get(mime, '.png')}", data))
        elif kind == "file" and isinstance(part.get("file"), dict):
            uploads.append(_file_part(part["file"], where, len(uploads) + 1))
        else:
            raise BadRequest(f"{where}: a part of type {kind!r} is not served; send text, image_url or file parts")
    return uploads


def _file_part(spec: dict[str, Any], where: str, number: int) -> Upload:
    if "file_data" not in spec:
        raise BadRequest(f"{where}: send the file itself as file_data (base64 or a data: URL); file ids are not "
                         "served here")
    raw = spec["file_data"]
    if isinstance(raw, str) and raw.startswith("data:"):
        mime, data = _data_url(raw, where)
    else:
        mime, data = "application/octet-stream", _base64(raw, where)
    name = spec.get("filename") if isinstance(spec.get("filename"), str) else None
    return Upload(name or f"file-{number}{EXTENSIONS.get(mime, '.txt')}", data)


def _data_url(url: Any, where: str) -> tuple[str, bytes]:
    match = DATA_URL.fullmatch(url) if isinstance(url, str) else None
    if match is None:
        raise BadRequest(f"{where}: send the file inline as a base64 data: URL (data:image/png;base64,...); the "
                         "daemon fetches nothing from the network")
    return match["mime"] or "application/octet-stream", _base64(match["data"], where)


def _base64(text: Any, where: str) -> bytes:
    try:
        if not isinstance(text, str):
            raise ValueError
        return base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error):
        raise BadRequest(f"{where}: the file's data is not valid base64") from None


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling the client set for this turn, checked as the settings are."""
    sampling: dict[str, Any] = {}
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            if problem := sampling_problem(key, body[key]):
                raise BadRequest(f"'{key}' {problem}")
            sampling[key] = body[key]
    tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if tokens is not None:
        if not _whole(tokens) or tokens < 1:
            raise BadRequest("'max_tokens' must be a whole number of tokens, at least 1")
        sampling["max_tokens"] = tokens
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
            raise BadRequest(f"'stop' must be a string or a list of at most {MAX_STOP} strings")
        sampling["stop"] = stops
    if body.get("seed") is not None:
        if not _whole(body["seed"]):
            raise BadRequest("'seed' must be a whole number")
        sampling["seed"] = body["seed"]
    return sampling


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and math.isfinite(value)


def spool(uploads: list[Upload], folder: Path) -> tuple[list[str], list[Path]]:
    """Write a question's files under ``folder`` (one folder per content, so a name shown on the
    chip is the client's): the paths an ``ask`` names, and the files this call wrote (what
    ``unspool`` removes when the question is refused)."""
    paths: list[str] = []
    written: list[Path] = []
    try:
        for upload in uploads:
            place = folder / hashlib.sha256(upload.data).hexdigest()[:32]
            place.mkdir(mode=0o700, parents=True, exist_ok=True)
            path = place / stored_name(upload.name)
            if not path.exists():
                written.append(path)  # a part written is removed too
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(upload.data)
            paths.append(str(path))
    except OSError as exc:
        unspool(written)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(f"the disk holding {folder} is full; free some space, then send the question again") from exc
        raise
    return paths, written


def unspool(written: list[Path]) -> None:
    """Remove the files ``spool`` wrote for a question that was refused, and their folders when
    nothing else is in them."""
    for path in written:
        path.unlink(missing_ok=True)
        try:
            path.parent.rmdir()
        except OSError:  # another file of the same content is kept there
            pass


def stored_name(name: str) -> str:
    """A client's file name as it is stored: no folders, only safe characters, and at most
    ``MAX_NAME_BYTES`` (a longer one: its start, a hash of the whole, its extension)."""
    safe = SAFE_NAME.sub("_", os.path.basename(name)).strip("._") or "file"
    if len(safe.encode()) <= MAX_NAME_BYTES:
        return safe
    stem, extension = os.path.splitext(safe)
    if len(extension) > MAX_EXTENSION:
        stem, extension = safe, ""
    mark = "-" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    room = MAX_NAME_BYTES - len(extension.encode()) - len(mark)
    start = stem.encode()[:room].decode("utf-8", "ignore")
    return f"{start}{mark}{extension}"
