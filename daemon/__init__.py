"""The assistant daemon: socket server, protocol, turn engine, router client, config.

``Server`` and ``serve`` load on first use (PEP 562), so that the other
packages can import ``daemon.errors`` without pulling in the server, which
imports them in turn.
"""

from typing import TYPE_CHECKING, Any

from .config import Config, ConfigError, load_config
from .errors import AssistantError
from .listener import AlreadyRunning

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .server import Server, serve

__all__ = ["AlreadyRunning", "AssistantError", "Config", "ConfigError", "Server", "__version__", "load_config", "serve"]


def __getattr__(name: str) -> Any:
    if name in ("Server", "serve"):
        from . import server

        return getattr(server, name)
    raise AttributeError(f"module 'daemon' has no attribute {name!r}")
