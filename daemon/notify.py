"""systemd readiness: ``sd_notify`` over ``$NOTIFY_SOCKET`` (Type=notify units).

A few lines of stdlib instead of a dependency: the protocol is one datagram.
"""

from __future__ import annotations

import logging
import os
import socket

__all__ = ["sd_notify"]

logger = logging.getLogger(__name__)


def sd_notify(state: str) -> bool:
    """Send ``state`` (e.g. ``READY=1``) to systemd; False when not under systemd or it failed."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        logger.warning("sd_notify(%s) to %s failed: %s", state, address, exc)
        return False
    return True
