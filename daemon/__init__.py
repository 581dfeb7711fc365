"""The assistant daemon: socket server, protocol, turn engine, router client, config."""

__version__ = "0.1.0"

from .config import Config, ConfigError, load_config  # noqa: E402
from .errors import AssistantError  # noqa: E402
from .listener import AlreadyRunning  # noqa: E402
from .server import Server, serve  # noqa: E402

__all__ = ["AlreadyRunning", "AssistantError", "Config", "ConfigError", "Server", "__version__", "load_config", "serve"]
