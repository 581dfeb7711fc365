"""The conversions under way: start one, stop one, stop them all at shutdown.

``Converter.convert`` checks the request (operation, files, options, folder), runs the
operation under ``convert_timeout`` as a task of its own (so ``cancel`` from any
connection can stop it by its id), then names the outputs and makes their chips. Whatever
ends it before that (a cancel, the bound, a failure, the daemon stopping) discards the
staged outputs: nothing partial is left in the user's folder.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attachments import Ocr
from core.config import Config
from core.errors import ConvertTimeout, FileRefused, NotFound, ShuttingDown

from .job import Job, Report
from .options import OPERATIONS, check_files, parse_options
from .outputs import OutputChip, chip_of, kind_of_output, output_folder
from .pdfops import pdf_merge, pdf_pages, pdf_to_markdown
from .video import trackcrop, video_to_audio, video_to_gif

__all__ = ["Converted", "Converter"]

logger = logging.getLogger(__name__)

RUNNERS: dict[str, Callable[[Job], Awaitable[None]]] = {
    "pdf_merge": pdf_merge,
    "pdf_pages": pdf_pages,
    "pdf_to_markdown": pdf_to_markdown,
    "video_to_audio": video_to_audio,
    "video_to_gif": video_to_gif,
    "trackcrop": trackcrop,
}


@dataclass
class Converted:
    """How a conversion ended: its outputs, or none when it was cancelled."""

    convert: str
    operation: str
    outputs: list[OutputChip]
    cancelled: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"convert": self.convert, "operation": self.operation, "cancelled": self.cancelled,
                "outputs": [chip.to_json() for chip in self.outputs]}


class Converter:
    """Runs the file operations; each has an id (``c1``, ``c2``, ...) that ``cancel`` names."""

    def __init__(self, ocr: Ocr | None = None, prefix: str = "c") -> None:
        self._ocr = ocr or Ocr()  # the daemon's (its cache); alone, one that keeps none
        self._prefix = prefix  # file_convert's own: "t1", ... (a turn's cancel stops those)
        self._ids = itertools.count(1)
        self._running: dict[str, asyncio.Task[None]] = {}
        self._closing = False

    def operations(self) -> list[dict[str, Any]]:
        return [spec.to_json() for spec in OPERATIONS.values()]

    def job(self, config: Config, operation: str, files: list[str], options: dict[str, Any],
            output_dir: str | None, report: Callable[[str], Report]) -> Job:
        """A checked conversion, not yet started: ``bad_request``/``file_refused`` name what is wrong."""
        spec = OPERATIONS.get(operation)
        if spec is None:
            raise NotFound(f"no operation {operation!r}; the operations are {', '.join(OPERATIONS)}")
        checked = parse_options(spec, options)
        inputs = check_files(spec, files)
        folder = output_folder(inputs[0][0], output_dir, config.output_dir)
        if not folder.is_absolute():
            raise FileRefused(f"output_dir {output_dir!r} is not an absolute path; send the folder's full path")
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            raise FileRefused(f"{folder}: not a folder this daemon may write to; choose another output_dir")
        ident = f"{self._prefix}{next(self._ids)}"
        return Job(ident, spec, inputs, checked, folder, config.convert_max_bytes, config.gif_max_bytes, report(ident),
                   self._ocr)

    async def convert(self, job: Job, timeout: float, thumbnails: Path | None) -> Converted:
        """Run ``job`` to its end; its outputs published and described, or none if cancelled."""
        task = asyncio.create_task(self._run(job, timeout))
        self._running[job.id] = task
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():  # the request itself was: stop the work too
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise
            if self._closing:
                raise ShuttingDown(f"the daemon is stopping: {job.spec.name} of {job.first.name} was stopped "
                                   "and wrote nothing; run it again once the daemon is back") from None
            return Converted(job.id, job.spec.name, [], cancelled=True)  # a cancel stopped it
        finally:
            self._running.pop(job.id, None)
        published = [(staged.publish(), staged.sha256) for staged in job.staged]
        if all(sha256 is not None and kind_of_output(path) != "image" for path, sha256 in published):
            # written from memory (a Markdown), its digest taken then: a stat each, nothing to read
            chips = [chip_of(path, None, sha256) for path, sha256 in published]
        else:
            chips = await asyncio.to_thread(lambda: [chip_of(path, thumbnails, sha256) for path, sha256 in published])
        return Converted(job.id, job.spec.name, chips)

    async def _run(self, job: Job, timeout: float) -> None:
        try:
            try:
                async with asyncio.timeout(timeout):
                    await RUNNERS[job.spec.name](job)
            except TimeoutError:
                raise ConvertTimeout(f"{job.spec.name} of {job.first.name} ran past convert_timeout ({timeout:g} s) "
                                     "and was stopped; raise convert_timeout or convert a smaller file") from None
        except BaseException:  # cancelled, timed out or failed: nothing partial stays in the folder
            for staged in job.staged:
                staged.discard()
            raise

    def cancel(self, ident: str) -> bool:
        """Stop conversion ``ident``; False when none of that id runs."""
        task = self._running.get(ident)
        if task is None or task.done():
            return False
        task.cancel()
        return True

    async def close(self) -> None:
        """Stop every conversion (the daemon is stopping): their tools killed, partial output removed."""
        self._closing = True
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
