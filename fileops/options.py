"""The operations' names, the kinds of file each takes, and their typed options.

What ``operations`` lists and what ``convert`` checks its ``options`` against: an option of
the wrong type or out of range is a ``bad_option`` naming it and what it takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from core.errors import BadOption, FileRefused

__all__ = ["OPERATIONS", "FileKind", "OperationSpec", "Option", "check_files", "file_kind", "parse_options"]

FileKind = Literal["pdf", "image", "video"]
OptionType = Literal["integer", "number", "string"]
SUFFIXES: dict[str, FileKind] = {
    ".pdf": "pdf",
    **dict.fromkeys((".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"), "image"),
    **dict.fromkeys((".mp4", ".m4v", ".mkv", ".webm", ".mov", ".avi", ".ogv", ".mpg", ".mpeg", ".ts", ".flv",
                     ".wmv", ".3gp"), "video"),
}
MAX_GIF_SECONDS = 60.0  # a longer GIF is a video: the palette pass holds every frame's colours


@dataclass(frozen=True)
class Option:
    """One option of an operation: its JSON type, default and bounds (or its choices)."""

    name: str
    type: OptionType
    default: Any
    description: str
    choices: tuple[Any, ...] = ()
    minimum: float | None = None
    maximum: float | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "type": self.type, "default": self.default,
                                "description": self.description}
        if self.choices:
            data["choices"] = list(self.choices)
        if self.minimum is not None:
            data["minimum"] = self.minimum
        if self.maximum is not None:
            data["maximum"] = self.maximum
        return data

    def check(self, value: Any) -> Any:
        """``value`` as this option takes it, or ``BadOption`` saying what it takes."""
        ok = isinstance(value, str) if self.type == "string" else (
            isinstance(value, (int, float)) and not isinstance(value, bool)
            and (self.type == "number" or float(value).is_integer()))
        if ok and self.choices:
            ok = value in self.choices
        if ok and self.type != "string":
            ok = (self.minimum is None or value >= self.minimum) and (self.maximum is None or value <= self.maximum)
        if not ok:
            raise BadOption(f"option {self.name!r} must be {self._wanted()}, not {value!r}")
        return int(value) if self.type == "integer" else value

    def _wanted(self) -> str:
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        what = {"integer": "an integer", "number": "a number", "string": "a string"}[self.type]
        if self.minimum is not None and self.maximum is not None:
            what += f" from {self.minimum:g} to {self.maximum:g}"
        return what


@dataclass(frozen=True)
class OperationSpec:
    """A named operation: what it does, the kinds of file it takes, how many, its options."""

    name: str
    description: str
    kinds: tuple[FileKind, ...]
    options: tuple[Option, ...] = ()
    max_files: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "kinds": list(self.kinds),
                "max_files": self.max_files, "options": [option.to_json() for option in self.options]}


O = Option
OPERATIONS: dict[str, OperationSpec] = {spec.name: spec for spec in (
    OperationSpec("pdf_merge", "PDFs and images (each a page) into one PDF, in the order given",
                  ("pdf", "image"), max_files=100),
    OperationSpec("pdf_pages", "a range of a PDF's pages into a new PDF, turned if asked", ("pdf",), (
        O("pages", "string", "", 'pages and ranges, such as "1-3,5" or "4-"; empty: every page'),
        O("rotate", "integer", 0, "degrees clockwise", choices=(0, 90, 180, 270)),
    )),
    OperationSpec("pdf_to_markdown", "a PDF as Markdown: headings, paragraphs and lists; scanned pages by OCR",
                  ("pdf",)),
    OperationSpec("video_to_audio", "a video's sound track, copied when its format allows", ("video",), (
        O("format", "string", "auto", "auto: the track as it is when it can be, else Opus",
          choices=("auto", "opus", "mp3")),
    )),
    OperationSpec("video_to_gif", "a clip of a video as an animated GIF (a palette pass keeps its colours)",
                  ("video",), (
        O("start", "number", 0, "seconds into the video", minimum=0),
        O("duration", "number", 5, "seconds of video", minimum=0.1, maximum=MAX_GIF_SECONDS),
        O("fps", "integer", 10, "frames a second", minimum=1, maximum=50),
        O("width", "integer", 480, "pixels (the height follows)", minimum=16, maximum=1920),
    )),
    OperationSpec("trackcrop", "a video cropped to an aspect, the window following what moves", ("video",), (
        O("aspect", "string", "9:16", "the output's width:height, such as 9:16 or 1:1"),
        O("smooth", "number", 1.0, "seconds the window's path is averaged over", minimum=0, maximum=10),
    )),
)}


def file_kind(path: Path) -> FileKind | None:
    return SUFFIXES.get(path.suffix.lower())


def parse_options(spec: OperationSpec, given: dict[str, Any]) -> dict[str, Any]:
    """Every option of ``spec``: the given ones checked, the rest their defaults."""
    known = {option.name: option for option in spec.options}
    unknown = sorted(set(given) - set(known))
    if unknown:
        takes = ", ".join(known) or "no options"
        raise BadOption(f"{spec.name} has no option {unknown[0]!r}; it takes {takes}")
    return {name: option.check(given[name]) if name in given else option.default for name, option in known.items()}


def check_files(spec: OperationSpec, files: list[str]) -> list[tuple[Path, FileKind]]:
    """The input files with their kinds, or the refusal of the first that does not fit."""
    if not files:
        raise BadOption(f"{spec.name} needs at least one file in 'files'")
    if len(files) > spec.max_files:
        raise FileRefused(f"{spec.name} takes {spec.max_files} file{'s' if spec.max_files > 1 else ''}, "
                         f"not {len(files)}")
    checked = []
    for name in files:
        path = Path(name).expanduser()
        if not path.is_absolute():
            raise FileRefused(f"{name!r} is not an absolute path; send the file's full path")
        kind = file_kind(path)
        if kind not in spec.kinds:
            raise FileRefused(f"{path.name}: {spec.name} takes {' or '.join(spec.kinds)} files; "
                              "see the operations request for which operation takes it")
        if not path.is_file():
            raise FileRefused(f"{path}: no such file (or not a file); check the path")
        checked.append((path, kind))
    return checked
