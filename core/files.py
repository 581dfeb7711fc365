"""Checking an attached path and opening it safely.

The daemon runs as the user and reads the paths a client names, so each path is
checked before anything reads it: absolute, existing, a regular file once
symlinks are followed, and readable.  The check is ``os.stat`` only: a FIFO, a
socket or a device is refused without ever being opened, because opening a
FIFO for reading blocks until a writer comes, and opening some devices has side
effects.  ``open_regular`` then opens with ``O_NONBLOCK`` (so even a FIFO swapped
in after the check cannot block the open) and checks the open descriptor with
``fstat`` again, which closes the race between the check and the open.

Every refusal is a ``FileRefused`` whose message names the file and says what
to do.  Reads of file content happen in worker threads (``asyncio.to_thread``)
in bounded chunks, never on the event loop and never a whole large file at once.
"""

from __future__ import annotations

import hashlib
import os
import stat
from typing import BinaryIO

from .errors import FileRefused

__all__ = [
    "HASH_CHUNK",
    "HEAD_BYTES",
    "describe_mode",
    "check_path",
    "open_regular",
    "read_head",
    "sha256_file",
    "size_label",
]

# how much of a file classification looks at (magic numbers, UTF-8 sniffing)
HEAD_BYTES = 8 * 1024
# chunk size for hashing: big enough to be fast, small enough to keep memory flat
HASH_CHUNK = 1024 * 1024
# a size's units, largest first, in powers of 1000 as file managers on Linux show them
SIZE_UNITS = ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"))


def size_label(size: int) -> str:
    """A file's size as people read it: ``2.5 GB``, ``8.6 MB``, ``33.1 kB``, ``512 bytes``. The
    largest unit that keeps at least ``1.0`` (a small video once read ``0.0 MB``)."""
    for scale, unit in SIZE_UNITS:
        shown = f"{size / scale:.1f}"
        if float(shown) >= 1:
            return f"{shown} {unit}"
    return "1 byte" if size == 1 else f"{size} bytes"


def describe_mode(mode: int) -> str:
    """What kind of non-regular file ``mode`` is, in words a user knows."""
    if stat.S_ISFIFO(mode):
        return "a pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def check_path(path: str) -> os.stat_result:
    """Check ``path`` without opening it; return its stat (symlinks followed) or raise FileRefused."""
    if not isinstance(path, str) or not path:
        raise FileRefused(f"{path!r} is not a file path; send each file's absolute path")
    if "\x00" in path:
        raise FileRefused(f"{path!r} contains a NUL byte; send the file's real absolute path")
    if not os.path.isabs(path):
        raise FileRefused(f"{path}: not an absolute path; send the file's full path (starting with /)")
    try:
        info = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise FileRefused(
                f"{path}: a symlink to a file that does not exist; attach the file it should point to"
            ) from None
        raise FileRefused(f"{path}: no such file; check the path, the file may have moved") from None
    except NotADirectoryError:
        raise FileRefused(f"{path}: no such file (a part of the path is not a folder); check the path") from None
    except PermissionError:
        raise FileRefused(
            f"{path}: permission denied on a folder of the path; check its permissions"
        ) from None
    except OSError as exc:
        raise FileRefused(f"{path}: cannot be checked ({exc.strerror}); check the path") from None
    if stat.S_ISDIR(info.st_mode):
        raise FileRefused(f"{path}: a folder, not a file; attach the files inside it instead")
    if not stat.S_ISREG(info.st_mode):
        raise FileRefused(f"{path}: {describe_mode(info.st_mode)}, not a regular file; attach a regular file")
    if not os.access(path, os.R_OK):
        raise FileRefused(f"{path}: not readable by the assistant; check the file's permissions")
    return info


def open_regular(path: str) -> BinaryIO:
    """Open ``path`` for reading, refusing anything that is not (or no longer) a regular file.

    Blocking: call it from a worker thread.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except PermissionError:
        raise FileRefused(f"{path}: not readable by the assistant; check the file's permissions") from None
    except FileNotFoundError:
        raise FileRefused(f"{path}: no such file; check the path, the file may have moved") from None
    except OSError as exc:
        raise FileRefused(f"{path}: cannot be opened ({exc.strerror}); check the file") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileRefused(f"{path}: {describe_mode(info.st_mode)}, not a regular file; attach a regular file")
        # O_NONBLOCK means nothing for a regular file, but clear it for good measure
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_head(path: str, size: int = HEAD_BYTES) -> bytes:
    """The first ``size`` bytes of ``path`` (blocking; call from a worker thread)."""
    with open_regular(path) as handle:
        try:
            return handle.read(size)
        except OSError as exc:
            raise FileRefused(f"{path}: cannot be read ({exc.strerror}); check the file") from None


def sha256_file(path: str) -> str:
    """The SHA-256 of ``path``'s content, read in chunks (blocking; call from a worker thread)."""
    digest = hashlib.sha256()
    with open_regular(path) as handle:
        try:
            while chunk := handle.read(HASH_CHUNK):
                digest.update(chunk)
        except OSError as exc:
            raise FileRefused(f"{path}: cannot be read ({exc.strerror}); check the file") from None
    return digest.hexdigest()
