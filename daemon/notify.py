"""systemd readiness: ``sd_notify`` over ``$NOTIFY_SOCKET`` (Type=notify units).

A few lines of stdlib instead of a dependency: the protocol is one datagram.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator

__all__ = ["extended_start", "sd_notify"]

logger = logging.getLogger(__name__)

EXTEND_EVERY = 10.0  # seconds between asks for more start time
EXTEND_BY = 30.0  # seconds asked for each time: systemd's timeout is then that from the ask


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


@contextlib.asynccontextmanager
async def extended_start() -> AsyncIterator[None]:
    """While the block runs, ask systemd every ``EXTEND_EVERY`` seconds for ``EXTEND_BY`` more
    (``EXTEND_TIMEOUT_USEC``): a long migration must not be killed by ``TimeoutStartSec`` and
    begun again, in a loop. Nothing is sent outside systemd."""
    if not os.environ.get("NOTIFY_SOCKET"):
        yield
        return

    async def extend() -> None:
        while True:
            await asyncio.sleep(EXTEND_EVERY)
            sd_notify(f"EXTEND_TIMEOUT_USEC={int(EXTEND_BY * 1_000_000)}")

    asker = asyncio.create_task(extend())
    try:
        yield
    finally:
        asker.cancel()
