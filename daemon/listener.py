"""The listening socket: path safety, stale sockets, a live daemon, socket activation.

The socket is created 0600 inside a 0700 directory so no other user can reach
it; connections are checked again with ``SO_PEERCRED`` (see ``connection``).
A socket file left by a crashed daemon is replaced; one that still answers
belongs to a live daemon, and we refuse to start beside it.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from common import socket_path_problem
from core.config import ConfigError
from core.errors import AssistantError

__all__ = ["AlreadyRunning", "Listener", "bind_listener", "socket_from_systemd"]

logger = logging.getLogger(__name__)

BACKLOG = 128
SD_LISTEN_FDS_START = 3  # systemd passes sockets from fd 3 on


class AlreadyRunning(AssistantError):
    """Another daemon already answers on the socket path."""

    code = "already_running"


@dataclass
class Listener:
    """A bound, listening socket and whether this process owns its path."""

    sock: socket.socket
    path: Path
    owned: bool  # False under socket activation: systemd owns the file
    inode: int = 0

    def cleanup(self) -> None:
        """Unlink the socket file if it is still the one we bound."""
        if not self.owned:
            return
        try:
            if self.path.lstat().st_ino == self.inode:
                self.path.unlink()
        except FileNotFoundError:
            pass


def socket_from_systemd(env: dict[str, str] | None = None) -> socket.socket | None:
    """The first socket systemd passed (``LISTEN_FDS``), or None when not socket-activated."""
    env = dict(os.environ) if env is None else env
    if env.get("LISTEN_PID") != str(os.getpid()):
        return None
    try:
        count = int(env.get("LISTEN_FDS", "0"))
    except ValueError:
        return None
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)  # not for our children
    if count < 1:
        return None
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        raise AssistantError("the socket systemd passed is not a Unix stream socket; check assistant.socket")
    sock.setblocking(False)
    os.set_inheritable(sock.fileno(), False)
    return sock


def _prepare_directory(directory: Path) -> None:
    """Create the socket's directory 0700, or check that an existing one is ours.

    The mode of a directory we did not create is never changed: ``ASSISTANT_SOCKET=~/a.sock``
    must not close the home directory. The socket itself is 0600 wherever it is.
    """
    try:
        directory.mkdir(mode=0o700, parents=True)
        return
    except FileExistsError:
        pass
    info = directory.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise AssistantError(f"{directory} is not a directory; remove it or set ASSISTANT_SOCKET")
    if info.st_mode & stat.S_ISVTX:
        return  # a sticky /tmp-like directory is shared on purpose; the socket is 0600 anyway
    if info.st_uid != os.geteuid():
        # another user could swap our socket for theirs in a directory they own
        raise AssistantError(
            f"{directory} belongs to another user (uid {info.st_uid}); remove it or set ASSISTANT_SOCKET"
        )
    if info.st_mode & 0o077:
        logger.debug("%s is open to other users; the socket in it is 0600", directory)


def _clear_stale(path: Path) -> None:
    """Remove a socket file nobody answers on; refuse when a daemon is alive on it."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise AssistantError(f"{path} exists and is not a socket; remove it or set ASSISTANT_SOCKET")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise
        logger.info("replacing stale socket %s", path)
        path.unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise AlreadyRunning(
        f"another assistant daemon is already serving on {path}; stop it first "
        "(systemctl --user stop assistant) or set ASSISTANT_SOCKET to another path"
    )


def bind_listener(path: Path) -> Listener:
    """Bind and listen on ``path`` (0600, directory 0700), replacing a stale socket."""
    problem = socket_path_problem(path)
    if problem is not None:
        raise ConfigError(problem)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _prepare_directory(path.parent)
        _clear_stale(path)
        old_umask = os.umask(0o177)  # the file is born 0600: no window where others may connect
        try:
            sock.bind(str(path))
        finally:
            os.umask(old_umask)
    except OSError as exc:
        sock.close()
        raise AssistantError(f"cannot listen on {path}: {exc.strerror}; check the path or set ASSISTANT_SOCKET") from exc
    except BaseException:
        sock.close()
        raise
    os.chmod(path, 0o600)
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return Listener(sock=sock, path=path, owned=True, inode=path.lstat().st_ino)
