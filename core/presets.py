"""Prompt presets: one-click questions about dropped files (summarize, describe, explain ...).

A preset is a prompt and the kinds of file it suits.  The canvas lists them (``presets``)
when files are dropped and an ``ask`` names one (``preset``): the daemon sends the preset's
prompt, then the ask's own ``text``, with the files.  The kinds a preset names are finer
than a chip's: a text file is ``code`` (a programming, markup or config language by its
suffix) or ``text``, and a PDF with a page without a text layer is ``scanned`` as well as
``pdf``.  A preset suits a question when every file has one of its kinds.

``[presets.NAME]`` tables in config.toml add presets or replace built-in ones (a field
left out keeps the built-in's); they are read once, with the rest of the configuration.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import BadRequest, NotFound

__all__ = ["BUILTIN_PRESETS", "PRESET_KINDS", "Preset", "find_preset", "parse_presets"]

# the kinds a preset may name, as files are told apart for presets
PRESET_KINDS = ("text", "code", "pdf", "scanned", "image")
PRESET_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
PRESET_KEYS = ("title", "kinds", "prompt")


@dataclass(frozen=True)
class Preset:
    """A named prompt for files of some kinds."""

    name: str
    title: str
    kinds: tuple[str, ...]
    prompt: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "kinds": list(self.kinds), "prompt": self.prompt}

    def question(self, text: str) -> str:
        """What is asked: the prompt, then the user's own words when there are any."""
        return f"{self.prompt}\n\n{text}" if text.strip() else self.prompt

    def check(self, files: Sequence[tuple[str, frozenset[str]]]) -> None:
        """BadRequest, naming the kinds, unless every file (name, its kinds) is of one of this
        preset's kinds."""
        wanted = ", ".join(self.kinds)
        if not files:
            raise BadRequest(f"the preset {self.name!r} works on files ({wanted}); attach at least one")
        misfits = [name for name, kinds in files if not kinds & set(self.kinds)]
        if misfits:
            raise BadRequest(f"the preset {self.name!r} works on files of the kinds {wanted}; "
                             f"{', '.join(misfits)} is not one; choose another preset (the presets request lists them)")


BUILTIN_PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("summarize", "Summarize", ("text", "code", "pdf"),
           "Summarize the attached file: its main points first, then the details that matter. Keep it short."),
    Preset("explain", "Explain", ("code", "text"),
           "Explain the attached file step by step for someone reading it for the first time: "
           "what it does or says, and why."),
    Preset("describe", "Describe", ("image", "scanned"),
           "Describe what the attached image or scanned page shows: its content, its layout and any text on it."),
    Preset("extract_text", "Extract text", ("image", "pdf"),
           "Write out all the text in the attached file exactly as it appears, in reading order, keeping "
           "headings, lists and tables. Add nothing else."),
    Preset("review", "Review", ("code",),
           "Review the attached code: bugs, risky constructs and unclear parts, the most serious first, "
           "each with a suggested fix."),
)}


def find_preset(presets: Mapping[str, Preset], name: str) -> Preset:
    """The preset of that name; NotFound naming the ones there are."""
    preset = presets.get(name)
    if preset is None:
        raise NotFound(f"no preset named {name!r}; the presets are {', '.join(presets)} (the presets request "
                       "lists them, and [presets.NAME] in config.toml adds one)")
    return preset


def parse_presets(tables: Any, source: str) -> dict[str, Preset]:
    """The built-in presets with the ``[presets.NAME]`` tables of config.toml applied; raises
    ValueError saying what is wrong."""
    example = 'e.g. [presets.translate] with title = "Translate", kinds = ["text"], prompt = "Translate ..."'
    if not isinstance(tables, dict):
        raise ValueError(f"{source}: presets must be a table of tables, one per preset ({example}); fix it and restart")
    presets = dict(BUILTIN_PRESETS)
    for name, table in tables.items():
        where = f"{source} [presets.{name}]"
        if not PRESET_NAME.match(name):
            raise ValueError(f"{where}: a preset's name is letters, digits, _ and - (at most 64); fix it and restart")
        if not isinstance(table, dict):
            raise ValueError(f"{where} must be a table ({example}); fix it and restart")
        unknown = [key for key in table if key not in PRESET_KEYS]
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r}; known keys: {', '.join(PRESET_KEYS)}; fix it and restart")
        presets[name] = _preset(name, table, presets.get(name), where)
    return presets


def _preset(name: str, table: dict[str, Any], base: Preset | None, where: str) -> Preset:
    """One configured preset, over the built-in of its name when there is one."""
    if base is None and not {"kinds", "prompt"} <= table.keys():
        raise ValueError(f"{where}: a new preset needs kinds and prompt; fix it and restart")
    title = table.get("title", base.title if base else name)
    prompt = table.get("prompt", base.prompt if base else "")
    kinds = table.get("kinds", list(base.kinds) if base else [])
    if not isinstance(title, str) or not title.strip():
        raise ValueError(f"{where}: title must be some text; fix it and restart")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: prompt must be some text; fix it and restart")
    if not isinstance(kinds, list) or not kinds or any(kind not in PRESET_KINDS for kind in kinds):
        raise ValueError(f"{where}: kinds must be a list of some of {', '.join(PRESET_KINDS)}; fix it and restart")
    return Preset(name, title.strip(), tuple(dict.fromkeys(kinds)), prompt.strip())
