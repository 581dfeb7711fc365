"""Zip archives of XML (OOXML, ODF, EPUB) read within bounds.

A document is a zip the user dropped; it may be damaged, encrypted or built to hurt (a zip
bomb, a billion-laughs XML). ``Archive`` opens one so that none of that can hang or exhaust
the daemon:

- the member count and the central directory's size are read from the end-of-central-directory
  record (its ZIP64 record's, when it has one) before ``zipfile`` builds a ``ZipInfo`` per
  member (a million empty members would cost gigabytes), and refused past ``MAX_MEMBERS`` and
  ``MAX_DIRECTORY_BYTES``; ``zipfile`` reads the entries the directory holds, whatever count
  the record claims, so the members it read are counted again;
- members are decompressed in chunks and counted as they come, never trusting the sizes
  the archive declares: past ``MAX_MEMBER_BYTES`` for one member or ``MAX_TOTAL_BYTES`` in
  all, the file is refused (a 10 KB zip that unpacks to gigabytes stops at the cap);
- XML is fed to expat (``xml.etree.ElementTree``) in those chunks, and a document that
  declares an entity (``<!ENTITY``) is refused: none of these formats needs one, and
  expansion is how a small XML grows without bound;
- an encrypted member (the zip's own encryption) is refused as password-protected;
- all of it runs in a worker thread (``FILE_THREADS``) and checks ``MAX_SECONDS``
  between chunks, so even a thread the caller gave up on stops soon.

Every refusal is ``FileRefused`` naming the file.
"""

from __future__ import annotations

import os
import posixpath
import struct
import time
import zipfile
from collections.abc import Iterator
from typing import BinaryIO
from xml.etree import ElementTree as ET

from core.errors import FileRefused
from core.files import open_regular

__all__ = [
    "MAX_DIRECTORY_BYTES",
    "MAX_MEMBERS",
    "MAX_MEMBER_BYTES",
    "MAX_SECONDS",
    "MAX_TOTAL_BYTES",
    "Archive",
    "damaged",
]

# members an archive may list: a long EPUB has a few thousand (chapters, images, fonts)
MAX_MEMBERS = 10_000
# bytes one member may unpack to: a thousand-page DOCX's document.xml is a few MB
MAX_MEMBER_BYTES = 32 * 1024 * 1024
# bytes all members read may unpack to
MAX_TOTAL_BYTES = 128 * 1024 * 1024
# seconds the reading of one document may take
MAX_SECONDS = 30.0
READ_CHUNK = 256 * 1024
# bytes the central directory may take: MAX_MEMBERS entries of a long name each (an entry is 46
# bytes, its name and its extra fields); a lying count still builds no more than this holds
MAX_DIRECTORY_BYTES = MAX_MEMBERS * 512
EOCD_MAGIC = b"PK\x05\x06"
EOCD_SIZE = 22
ZIP64_LOCATOR = b"PK\x06\x07"  # 20 bytes, right before the end record, after the ZIP64 record
ZIP64_LOCATOR_SIZE = 20
ZIP64_EOCD_MAGIC = b"PK\x06\x06"
ZIP64_EOCD_SIZE = 56
MAX_COMMENT = 65535
# an XML entity declaration: none of the formats needs one (see the module docstring)
ENTITY_DECLARATION = b"<!ENTITY"


def damaged(name: str, what: str, why: str) -> FileRefused:
    """The refusal of a document that cannot be read."""
    return FileRefused(f"{name}: not a readable {what} ({why}); check the file or attach another copy")


def _member_count(handle: BinaryIO, name: str, what: str) -> None:
    """Refuse an archive that lists more than ``MAX_MEMBERS`` members or a larger central
    directory than they need (or an end record that leaves the count to a ZIP64 record it
    lacks), before ``zipfile`` reads them."""
    size = handle.seek(0, os.SEEK_END)
    tail_size = min(size, EOCD_SIZE + MAX_COMMENT + ZIP64_LOCATOR_SIZE + ZIP64_EOCD_SIZE)
    handle.seek(size - tail_size)
    tail = handle.read(tail_size)
    at = tail.rfind(EOCD_MAGIC)
    if at < 0 or len(tail) - at < EOCD_SIZE:
        raise damaged(name, what, "not a complete zip archive")
    entries, directory = struct.unpack("<HI", tail[at + 10 : at + 16])
    record = at - ZIP64_LOCATOR_SIZE - ZIP64_EOCD_SIZE  # where zipfile reads a ZIP64 record, as it does
    if record >= 0 and tail[at - ZIP64_LOCATOR_SIZE : at - ZIP64_LOCATOR_SIZE + 4] == ZIP64_LOCATOR \
            and tail[record : record + 4] == ZIP64_EOCD_MAGIC:
        entries, directory = struct.unpack("<QQ", tail[record + 32 : record + 48])
    elif entries == 0xFFFF:
        entries = MAX_MEMBERS + 1
    if entries > MAX_MEMBERS:
        raise _too_many(name)
    if directory > MAX_DIRECTORY_BYTES:
        raise FileRefused(f"{name}: the archive's list of files is over {MAX_DIRECTORY_BYTES // 1_000_000} MB; "
                          "attach a smaller document")


def _too_many(name: str) -> FileRefused:
    return FileRefused(f"{name}: the archive holds too many files (over {MAX_MEMBERS}); attach a smaller document")


def _refuse_entities(tail: bytes, chunk: bytes, archive: Archive, member: str) -> bytes:
    """Refuse an entity declaration in ``chunk`` (or across from the ``tail`` of the chunk before);
    the tail to give with the next chunk."""
    if ENTITY_DECLARATION in tail + chunk:
        raise damaged(archive.name, archive.what, f"{member} declares XML entities")
    return chunk[-len(ENTITY_DECLARATION) :]


class Archive:
    """A document's zip, open for bounded reads (a context manager; blocking, for a worker thread)."""

    def __init__(self, path: str, name: str, what: str) -> None:
        """``what`` names the format in messages (``DOCX``, ``EPUB``)."""
        self.name = name
        self.what = what
        self.deadline = time.monotonic() + MAX_SECONDS
        self._left = MAX_TOTAL_BYTES
        self._handle = open_regular(path)
        try:
            _member_count(self._handle, name, what)
            self._handle.seek(0)
            self._zip = zipfile.ZipFile(self._handle)
        except FileRefused:
            self._handle.close()
            raise
        except Exception as exc:  # BadZipFile, OSError, EOFError, NotImplementedError ...
            self._handle.close()
            raise damaged(name, what, f"a damaged zip archive: {exc}") from None
        if len(self._zip.filelist) > MAX_MEMBERS:  # the record's count said fewer than the directory holds
            self.close()
            raise _too_many(name)
        self.members = {info.filename: info for info in self._zip.infolist()}

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._zip.close()
        self._handle.close()

    def has(self, member: str) -> bool:
        return member in self.members

    def chunks(self, member: str, limit: int = MAX_MEMBER_BYTES) -> Iterator[bytes]:
        """``member`` unpacked, chunk by chunk, within the bounds; FileRefused when past one."""
        info = self.members.get(member)
        if info is None:
            raise damaged(self.name, self.what, f"{member} is missing")
        if info.flag_bits & 0x1:
            raise FileRefused(f"{self.name}: the {self.what} is password-protected; attach an unlocked copy")
        read = 0
        try:
            with self._zip.open(info) as stream:
                while chunk := stream.read(READ_CHUNK):
                    read += len(chunk)
                    self._left -= len(chunk)
                    if read > limit or self._left < 0:
                        raise self._too_large(limit if read > limit else MAX_TOTAL_BYTES)
                    if time.monotonic() > self.deadline:
                        raise FileRefused(f"{self.name}: reading the {self.what} took too long (over "
                                          f"{MAX_SECONDS:g} s); attach a smaller document")
                    yield chunk
        except FileRefused:
            raise
        except Exception as exc:  # BadZipFile, zlib.error, EOFError, NotImplementedError (a method)
            raise damaged(self.name, self.what, f"{member}: {exc}") from None

    def _too_large(self, limit: int) -> FileRefused:
        return FileRefused(
            f"{self.name}: the {self.what} unpacks to more than {limit // (1024 * 1024)} MB (a zip bomb, or a "
            "document too large to read); attach a smaller document"
        )

    def read(self, member: str, limit: int = MAX_MEMBER_BYTES) -> bytes:
        """``member`` whole, within the bounds."""
        return b"".join(self.chunks(member, limit))

    def xml(self, member: str) -> ET.Element:
        """``member`` parsed as XML, fed to expat chunk by chunk; an entity declaration refused."""
        parser = ET.XMLParser()
        tail = b""
        try:
            for chunk in self.chunks(member):
                tail = _refuse_entities(tail, chunk, self, member)
                parser.feed(chunk)
            return parser.close()
        except ET.ParseError as exc:
            raise damaged(self.name, self.what, f"{member}: {exc}") from None

    def iter_xml(self, member: str, tag: str) -> Iterator[ET.Element]:
        """The ``tag`` elements of ``member``, each once it is whole, dropped after use: a large
        sheet is read in constant memory."""
        parser = ET.XMLPullParser(events=("start", "end"))
        tail = b""
        open_elements: list[ET.Element] = []
        try:
            for chunk in self.chunks(member):
                tail = _refuse_entities(tail, chunk, self, member)
                parser.feed(chunk)
                for event, element in parser.read_events():
                    if event == "start":
                        open_elements.append(element)
                        continue
                    open_elements.pop()
                    if element.tag == tag:
                        yield element
                        if open_elements:  # dropped from its parent, so the tree keeps no rows
                            open_elements[-1].remove(element)
            parser.close()
        except ET.ParseError as exc:
            raise damaged(self.name, self.what, f"{member}: {exc}") from None

    def relationships(self, part: str) -> dict[str, str]:
        """An OOXML part's relationships: id → the target's member name (``_rels/NAME.rels``)."""
        folder, base = posixpath.split(part)
        rels = posixpath.join(folder, "_rels", base + ".rels")
        if not self.has(rels):
            return {}
        found = {}
        for rel in self.xml(rels):
            target = rel.get("Target", "")
            if rel.get("TargetMode") == "External" or not target:
                continue
            resolved = target.lstrip("/") if target.startswith("/") else posixpath.normpath(posixpath.join(folder, target))
            found[rel.get("Id", "")] = resolved
        return found
