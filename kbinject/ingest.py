"""The files of a ``kb_add``: finding them, and reading each into chunks.

``collect`` expands the paths given (absolute; files or folders) into the files to
read. Folders are walked recursively, in name order, following symlinks but never into
a folder already walked (by device and inode), so a symlink loop ends. Hidden entries
(``.git``, ``.venv``, ``.env``) and ``SKIPPED_DIR_NAMES`` are left out of a walk: they
are tooling, caches or secrets rather than knowledge; a hidden file named on its own is
read. A path that does not exist or cannot be listed is reported and the rest goes on.

``stage`` checks and classifies one file with the attachments package's own checks
(regular file, readable, kind by name and content); ``read_document`` extracts it with
the attachments extractors, below a question's budget: the whole text of a text file
and every page of a PDF (page by page, so chunks keep their page numbers), up to the
per-document cap those extractors keep for recall (``FULL_TEXT_CAP``, 2 Mi characters;
a document cut there is marked ``truncated``). Images are not indexed.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from attachments import FULL_TEXT_CAP, Kind, Ocr, classify, read_pdf_text, read_text_file, suffix_of
from core.files import check_path, describe_mode, open_regular, read_head, sha256_file
from core.filethreads import FileThreads
from history import NewKbDocument

from .chunking import MARKDOWN_SUFFIXES, Chunk, chunk_pages, chunk_text

__all__ = [
    "MAX_FILES_PER_ADD",
    "SKIPPED_DIR_NAMES",
    "Collected",
    "FileNote",
    "Found",
    "Staged",
    "collect",
    "read_document",
    "stage",
]

WHOLE_HASH_BYTES = 16 * 1024 * 1024  # files up to this (and every PDF) are hashed whole
# a larger text file is fingerprinted by its size, its head (every byte its indexed text can
# come from: FULL_TEXT_CAP characters of up to 4 bytes) and its last megabyte
HEAD_BYTES = 4 * FULL_TEXT_CAP
EDGE_BYTES = 1024 * 1024
INGEST_THREADS = 2  # its own threads: ingest never starves the turns' file work
_INGEST_THREADS = FileThreads(INGEST_THREADS, "kb-ingest")
T = TypeVar("T")

MAX_FILES_PER_ADD = 50_000  # a slip (adding ~ instead of ~/notes) stops here, reported
MAX_ENTRIES_PER_ADD = 4 * MAX_FILES_PER_ADD  # entries looked at, files or not: the walk's bound
MAX_SKIPPED_NOTES = 1_000  # entries the walk leaves out are named up to this, then counted
SKIPPED_DIR_NAMES = frozenset({"node_modules", "__pycache__", "site-packages"})


@dataclass(frozen=True)
class FileNote:
    """A path the add did not index, and why (for the user)."""

    path: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "reason": self.reason}


@dataclass(frozen=True)
class Found:
    """A regular file to read, as the walk saw it."""

    path: str
    size: int
    mtime_ns: int


@dataclass
class Collected:
    """What a list of paths expands to."""

    files: list[Found] = field(default_factory=list)
    errors: list[FileNote] = field(default_factory=list)
    skipped: list[FileNote] = field(default_factory=list)
    folders: list[str] = field(default_factory=list)  # folders walked: files gone from them are removed


class _Walk:
    """The state of one collect(): what was seen, so nothing is read twice."""

    def __init__(self, out: Collected) -> None:
        self.out = out
        self.dirs: set[tuple[int, int]] = set()
        self.files: set[tuple[int, int]] = set()
        self.full = False
        self.entries = 0
        self.unlisted = 0  # entries left out beyond MAX_SKIPPED_NOTES

    def skip(self, path: str, reason: str) -> None:
        if len(self.out.skipped) < MAX_SKIPPED_NOTES:
            self.out.skipped.append(FileNote(path, reason))
        else:
            self.unlisted += 1

    def stop(self, path: str, reason: str) -> None:
        """The add takes no more: said once."""
        if not self.full:
            self.full = True
            self.out.errors.append(FileNote(path, reason))

    def file(self, path: str, info: os.stat_result) -> None:
        key = (info.st_dev, info.st_ino)
        if key in self.files:
            return  # a hard link or symlink to a file already taken
        if len(self.out.files) >= MAX_FILES_PER_ADD:
            self.stop(path, f"only the first {MAX_FILES_PER_ADD} files are added at once; "
                            "add the remaining folders separately")
            return
        self.files.add(key)
        self.out.files.append(Found(path, info.st_size, info.st_mtime_ns))

    def folder(self, root: str, info: os.stat_result) -> None:
        self.dirs.add((info.st_dev, info.st_ino))
        self.out.folders.append(root)
        stack = [root]
        while stack and not self.full:
            stack.extend(reversed(self._children(stack.pop())))

    def _children(self, folder: str) -> list[str]:
        """Take the folder's files; return its subfolders to walk, in name order."""
        try:
            with os.scandir(folder) as listing:
                entries = sorted(listing, key=lambda entry: entry.name)
        except OSError as exc:
            self.out.errors.append(FileNote(folder, f"the folder cannot be read ({exc.strerror}); check its permissions"))
            return []
        subfolders = []
        for entry in entries:
            self.entries += 1
            if self.entries > MAX_ENTRIES_PER_ADD:
                self.stop(entry.path, f"only the first {MAX_ENTRIES_PER_ADD} entries are looked at in one add; "
                                      "add the folders that matter separately")
                return []
            if entry.name.startswith("."):
                continue
            if not _is_text(entry.path):
                shown = entry.path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                self.skip(shown, "a name that is not UTF-8; rename the file to index it")
                continue
            try:
                info = entry.stat()  # follows a symlink
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    self.skip(entry.path, "a symlink to nothing")
                elif exc.errno == errno.ELOOP:
                    self.skip(entry.path, "a symlink loop")
                else:  # not allowed in: the file is there, and would be indexed
                    self.out.errors.append(FileNote(entry.path, f"cannot be read ({exc.strerror}); check its permissions"))
                continue
            if stat.S_ISDIR(info.st_mode):
                key = (info.st_dev, info.st_ino)
                if entry.name in SKIPPED_DIR_NAMES or key in self.dirs:
                    continue  # tooling, or a folder already walked (a symlink loop)
                self.dirs.add(key)
                subfolders.append(entry.path)
            elif stat.S_ISREG(info.st_mode):
                self.file(entry.path, info)
            else:  # never opened: reading a FIFO would wait forever, a device may act
                self.skip(entry.path, f"{describe_mode(info.st_mode)}, not a regular file")
        return subfolders


def _is_text(path: str) -> bool:
    """Whether a path is valid text (a name of bytes that are not UTF-8 cannot be stored or shown)."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_root(path: object) -> str:
    """A given path as a normalised absolute path; ValueError with the reason if it is not one."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ValueError(f"{path!r} is not a path; send absolute paths of files or folders")
    if not os.path.isabs(path):
        raise ValueError("not an absolute path; send the full path (starting with /)")
    return os.path.normpath(path)


def collect(paths: Sequence[str]) -> Collected:
    """Expand files and folders into the files to read (blocking: run it in a thread)."""
    out = Collected()
    walk = _Walk(out)
    for given in paths:
        try:
            path = _check_root(given)
        except ValueError as exc:
            out.errors.append(FileNote(str(given), str(exc)))
            continue
        try:
            info = os.stat(path)
        except FileNotFoundError:
            out.errors.append(FileNote(path, "no such file or folder; check the path"))
            continue
        except OSError as exc:
            out.errors.append(FileNote(path, f"cannot be read ({exc.strerror}); check the path and its permissions"))
            continue
        if stat.S_ISDIR(info.st_mode):
            if (info.st_dev, info.st_ino) not in walk.dirs:
                walk.folder(path, info)
        elif stat.S_ISREG(info.st_mode):
            walk.file(path, info)
        else:
            out.errors.append(FileNote(path, f"{describe_mode(info.st_mode)}, not a regular file or folder"))
    if walk.unlisted:
        out.skipped.append(FileNote("", f"and {walk.unlisted} more entries left out for the same kinds of reason"))
    return out


@dataclass(frozen=True)
class Staged:
    """A file checked and classified."""

    path: str
    name: str
    kind: Kind
    size: int
    mtime_ns: int


def stage(found: Found) -> Staged:
    """Check and classify a file (blocking); raises FileRefused / UnsupportedKind."""
    info = check_path(found.path)
    name = os.path.basename(found.path)
    kind = classify(name, read_head(found.path)).kind
    return Staged(found.path, name, kind, info.st_size, info.st_mtime_ns)


def file_hash(path: str, size: int, kind: str = "text") -> str:
    """A SHA-256 that changes with what is indexed of the file (blocking); raises FileRefused.

    Up to WHOLE_HASH_BYTES, and a PDF of any size (its text may come from anywhere in it),
    the whole file is hashed; a larger text file (of which only the first 2 Mi characters
    are indexed) by its size, its first HEAD_BYTES and its last megabyte, so re-adding a
    huge log reads its head and tail, not all of it, and an edit of its indexed part is seen.
    """
    if size <= WHOLE_HASH_BYTES or kind == "pdf":
        return sha256_file(path)
    digest = hashlib.sha256(f"{size}:".encode())
    with open_regular(path) as handle:
        digest.update(handle.read(HEAD_BYTES))
        handle.seek(max(size - EDGE_BYTES, HEAD_BYTES))
        digest.update(handle.read(EDGE_BYTES))
    return digest.hexdigest()


async def in_ingest_thread(fn: Callable[..., T], *args: Any, reading: str | None = None) -> T:
    """Run blocking ingest work on the ingest threads, never the default pool: a big
    ingest must not hold up the turns' own file work (attachments, image checks). The read
    of a file (``reading`` names it) is bounded in time, and a stop never waits for it."""
    return await _INGEST_THREADS.run(reading or "ingest", fn, *args, bounded=reading is not None)


def _read_and_chunk(path: str, markdown: bool) -> tuple[list[Chunk], bool]:
    """A text file's chunks and whether it was read whole (blocking: chunking a file of
    millions of characters is work the event loop must not wait for)."""
    body, complete, _ = read_text_file(path)
    return chunk_text(body, markdown=markdown), complete


async def read_document(staged: Staged, sha256: str, ocr: Ocr) -> NewKbDocument:
    """Extract a text or PDF file into a document of chunks; raises FileRefused."""
    if staged.kind == "pdf":
        text = await read_pdf_text(staged.path, staged.name)
        # scanned pages are read by OCR, as for a question (attachments/ocr.py; cached by hash)
        read = await ocr.page_texts(staged.path, staged.name, sha256, text)
        chunks = await in_ingest_thread(chunk_pages, read)  # chunking a long PDF is long work
        pages: int | None = text.total_pages
        truncated = text.cut or len(text.page_texts) < text.total_pages
    else:
        markdown = suffix_of(staged.name) in MARKDOWN_SUFFIXES
        chunks, complete = await in_ingest_thread(_read_and_chunk, staged.path, markdown, reading=staged.path)
        pages, truncated = None, not complete
    return NewKbDocument(
        path=staged.path,
        name=staged.name,
        kind=staged.kind,
        sha256=sha256,
        size_bytes=staged.size,
        mtime_ns=staged.mtime_ns,
        pages=pages,
        truncated=truncated,
        chunks=[(chunk.page, chunk.text) for chunk in chunks],
    )
