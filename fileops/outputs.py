"""Where an operation's output goes, and how it appears there: whole, and never over a file.

The output is written under a hidden temporary name in its folder (``.clip.3f2a.part.gif``:
the tools pick the format by the suffix), then given its name with ``os.link``, which fails
rather than replace a file: ``clip.gif`` taken, it becomes ``clip (1).gif``, and so on. A
cancelled, failed or timed-out operation leaves nothing behind but what it renamed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["OutputChip", "OutputKind", "Staged", "chip_of", "kind_of_output", "output_folder"]

OutputKind = Literal["pdf", "markdown", "audio", "image", "video"]
MAX_SUFFIXED = 10_000  # "name (9999).md": past this a folder is full of them, and something is wrong
THUMBNAIL_PX = 256  # as attachments' chips
SUFFIX_KINDS: dict[str, OutputKind] = {
    ".pdf": "pdf", ".md": "markdown", ".gif": "image", ".png": "image", ".m4a": "audio", ".mp3": "audio",
    ".opus": "audio", ".ogg": "audio", ".flac": "audio", ".wav": "audio", ".mka": "audio", ".mp4": "video",
}


def kind_of_output(path: Path) -> OutputKind:
    return SUFFIX_KINDS.get(path.suffix.lower(), "video")


def output_folder(first: Path, asked: str | None, configured: str) -> Path:
    """The folder of an output: the request's ``output_dir``, else the configuration's, else the
    first input's."""
    chosen = asked or configured
    return Path(chosen).expanduser() if chosen else first.parent


@dataclass
class Staged:
    """One output being written: its temporary path, and the name it will take."""

    folder: Path
    name: str  # "clip.gif"
    temporary: Path
    sha256: str | None = None  # of what ``write`` wrote: the chip need not read the file back

    @classmethod
    def make(cls, folder: Path, name: str) -> Staged:
        stem, suffix = _split(name)
        temporary = folder / f".{stem}.{secrets.token_hex(4)}.part{suffix}"
        return cls(folder, name, temporary)

    def publish(self) -> Path:
        """Give the whole output its name, the first of ``name``, ``name (1)``, ... not taken."""
        stem, suffix = _split(self.name)
        for number in range(MAX_SUFFIXED):
            final = self.folder / (f"{stem}{suffix}" if number == 0 else f"{stem} ({number}){suffix}")
            try:
                os.link(self.temporary, final)  # never over a file, unlike a rename
            except FileExistsError:
                continue
            except OSError:  # a file system without hard links (FAT on a stick): claim the name first
                if not _claim(final):
                    continue
                os.replace(self.temporary, final)  # over the empty file just claimed, nothing else
                return final
            self.discard()
            return final
        raise FileExistsError(f"{self.folder / self.name} and {MAX_SUFFIXED} numbered copies exist")

    def write(self, data: bytes) -> None:
        """Write ``data`` as the whole output (blocking), keeping its digest for the chip."""
        self.temporary.write_bytes(data)
        self.sha256 = hashlib.sha256(data).hexdigest()

    def discard(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.temporary.unlink()


def _claim(path: Path) -> bool:
    """Create ``path`` empty unless it exists; whether this call made it."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    return True


def _split(name: str) -> tuple[str, str]:
    path = Path(name)
    return path.stem, path.suffix


@dataclass
class OutputChip:
    """An output file as the canvas shows it."""

    path: str
    name: str
    size: int
    sha256: str
    kind: OutputKind
    thumbnail: str | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"path": self.path, "name": self.name, "size": self.size, "sha256": self.sha256,
                                "kind": self.kind}
        if self.kind == "image":
            data["thumbnail"] = self.thumbnail
        return data


def chip_of(path: Path, thumbnails: Path | None, sha256: str | None = None) -> OutputChip:
    """The chip of a published output (blocking: it reads the file to hash it unless ``sha256``, the
    digest of what was written, is given, and makes an image's thumbnail)."""
    if sha256 is None:
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            while block := fh.read(1 << 20):
                digest.update(block)
        sha256 = digest.hexdigest()
    kind = kind_of_output(path)
    shown = _thumbnail(path, sha256, thumbnails) if kind == "image" and thumbnails is not None else None
    return OutputChip(str(path), path.name, path.stat().st_size, sha256, kind, shown)


def _thumbnail(path: Path, sha256: str, folder: Path) -> str | None:
    """A PNG of the image's first frame, at most ``THUMBNAIL_PX`` a side, in ``folder``."""
    from PIL import Image

    target = folder / f"{sha256}.png"
    if target.is_file():
        return str(target)
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        with Image.open(path) as image:
            image.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
            staged = Staged.make(folder, target.name)
            image.convert("RGBA").save(staged.temporary, "PNG")
        os.replace(staged.temporary, target)  # the same hash is the same picture
    except (OSError, ValueError):
        return None
    return str(target)
