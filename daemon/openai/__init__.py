"""The OpenAI-compatible door: ``door`` serves the routes and relays a turn, ``http`` is the
HTTP/1.1 framing on asyncio's streams, ``messages`` reads a chat request into the daemon's terms."""

from .door import OpenAIDoor, door_key

__all__ = ["OpenAIDoor", "door_key"]
