"""Files attached to a question: classify, extract, budget, image references.

The rules they follow are in docs/DESIGN.md, "Attachments".  The daemon calls, per turn:

- ``prepare_files(paths, model=, vision=, ctx_max=, ctx_used=)`` → ``Prepared``
  per file (chip, text block, images, full text for recall), or raises
  ``FileRefused`` / ``TooManyFiles`` / ``UnsupportedKind`` / ``NoVision`` with a
  message for the user;
- ``user_content(text, prepared)`` → the user message's content for the router
  and for storage (images as ``image_ref`` parts);
- ``resolve_image_refs(messages)`` on stored history before sending it again;
- ``estimate_files(paths, ...)`` for the ``estimate`` request;
- each of them takes the daemon's ``FileReaders`` (``readers.py``), made once at start:
  ``Ocr`` (scanned pages read by tesseract, ``ocr.py``; ``support()`` for ``status``) and
  ``ImageCache`` (the decode thread, the pixel budget and the caches, ``imagecache.py``).

Documents (DOCX, PPTX, XLSX, ODT, ODS, EPUB, HTML) are told and read by ``office.py``;
videos are attached with a line naming them (``video.py``), their facts read from an MP4's
boxes (``mp4.py``, which the file operations read too) or ffprobe.

It stands on ``core`` alone (errors, safe file opening, token rates).
"""

from .budget import FULL_TEXT_CAP, budget_chars, fair_shares
from .classify import Kind, classify, suffix_of
from .extract import (
    MAX_FILES,
    Chip,
    ImageAttachment,
    Prepared,
    estimate_files,
    prepare_files,
    read_sent_pages,
    read_text_file,
    too_many_files,
)
from .imagecache import ImageCache
from .mp4 import read_picture, read_sound
from .ocr import Ocr, OcrSupport
from .images import MAX_IMAGE_BYTES
from .office import DOCUMENT_KINDS, FORMATS as DOCUMENT_FORMATS, UNITS
from .pdf import MAX_PAGE_IMAGES, PAGE_BREAK, PAGE_MARKER
from .pdf import pdf_full_text, read_text as read_pdf_text
from .readers import FileReaders
from .refs import attached_image, image_ref, resolve_image_refs, user_content
from .video import VideoFacts, audio_line, probe_sound, read_video_facts, video_facts_said, video_line, video_line_naming

# what a paged kind's pages are: a PDF's pages, a deck's slides, a spreadsheet's sheets, an EPUB's chapters
PAGE_UNITS = {"pdf": "page", **UNITS}

__all__ = [
    "DOCUMENT_FORMATS",
    "DOCUMENT_KINDS",
    "PAGE_UNITS",
    "FULL_TEXT_CAP",
    "MAX_FILES",
    "MAX_IMAGE_BYTES",
    "MAX_PAGE_IMAGES",
    "PAGE_BREAK",
    "PAGE_MARKER",
    "Chip",
    "FileReaders",
    "ImageCache",
    "ImageAttachment",
    "Kind",
    "Ocr",
    "OcrSupport",
    "Prepared",
    "VideoFacts",
    "attached_image",
    "audio_line",
    "budget_chars",
    "classify",
    "estimate_files",
    "fair_shares",
    "image_ref",
    "pdf_full_text",
    "prepare_files",
    "probe_sound",
    "read_picture",
    "read_sound",
    "read_pdf_text",
    "read_sent_pages",
    "read_text_file",
    "read_video_facts",
    "resolve_image_refs",
    "suffix_of",
    "too_many_files",
    "user_content",
    "video_facts_said",
    "video_line",
    "video_line_naming",
]
