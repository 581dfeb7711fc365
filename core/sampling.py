"""Sampling settings sent with a turn's requests: ``temperature`` and ``top_p``.

Small local models call tools well only when they sample greedily or nearly so (issue 33:
Qwen2.5-Coder-1.5B made apt calls on 18 of 20 prompts at temperature 0, 6-7 of 10 at
llama-server's default 0.8), while a chat model may want its default. So each is set
where it belongs, later sources winning: the configuration's top-level keys (every
model), a model's ``[models."ID"]`` table, then the conversation's own (the ``settings``
request). One set nowhere is not sent, and the server's default applies. Titles and
compaction summaries are not affected: they are short, and their own requests.
``core.models.sampling_params`` picks a request's values.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["SAMPLING_KEYS", "sampling_problem"]

SAMPLING_KEYS = ("temperature", "top_p")
MAX_TEMPERATURE = 2.0  # OpenAI's range; llama-server takes more, which no one wants for answers


def sampling_problem(key: str, value: Any) -> str | None:
    """What is wrong with ``value`` for the sampling setting ``key``, or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"must be a number, not {value!r}"
    if key == "temperature" and not 0 <= value <= MAX_TEMPERATURE:
        return f"must be from 0 to {MAX_TEMPERATURE:g} (0: always the likeliest token), not {value!r}"
    if key == "top_p" and not 0 < value <= 1:
        return f"must be above 0 and at most 1, not {value!r}"
    return None
