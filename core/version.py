"""The version, for the daemon's modules that name it here; written once in ``common.version``."""

from common.version import __version__

__all__ = ["__version__"]
