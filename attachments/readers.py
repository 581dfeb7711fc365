"""FileReaders: the services that read attached files, made once by the daemon.

OCR (``ocr.Ocr``: tesseract's languages, its cache, the bound on pages read at once) and the
image cache (``imagecache.ImageCache``: the decode thread, the pixel budget, the cache and the
thumbnails) keep state for the daemon's life. The server makes them at start and hands them
down, as it does the router client; no module holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .imagecache import ImageCache
from .ocr import DEFAULT_LANGUAGES, Ocr

__all__ = ["FileReaders"]


@dataclass(frozen=True)
class FileReaders:
    """OCR and the image cache; the defaults keep no cache on disk (tests, tools)."""

    ocr: Ocr = field(default_factory=Ocr)
    images: ImageCache = field(default_factory=ImageCache)

    @classmethod
    def in_folder(cls, data_dir: Path, languages: str = DEFAULT_LANGUAGES, ocr_images: bool = False) -> FileReaders:
        """Caches under ``data_dir`` (``ocr``, ``images``, ``thumbnails``), made 0700 when missing."""
        return cls(Ocr(data_dir / "ocr", languages, ocr_images), ImageCache(data_dir / "images", data_dir / "thumbnails"))

    def close(self) -> None:
        self.images.close()
