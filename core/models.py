"""What a model server says of its models, read from its answers: pure functions, no I/O.

``ModelInfo`` is what the daemon knows of one model (input modalities, context size and
where that size came from, tool support, and the image cost the configuration gives it).
The functions read the facts out of the answers of ``/v1/models`` entries, llama-server's
``/props`` (also behind llama-swap's ``/upstream/<model>/props``) and Ollama's
``/api/show``; ``router.RouterClient`` asks and combines them (docs/DESIGN.md, "Context
sizes").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from .config import Config
from .sampling import SAMPLING_KEYS

ASSUMED_CTX = Config.assumed_ctx  # a size is never 0: until told, the configured default is assumed

__all__ = [
    "CtxSource",
    "Facts",
    "Missing",
    "ModelInfo",
    "display_name",
    "image_cost",
    "sampling_params",
    "listed_context",
    "enough",
    "listed_modalities",
    "ollama_facts",
    "positive_int",
    "props_facts",
]

# Ollama's default num_ctx with under 24 GiB of VRAM (docs/context-length.mdx; 32k and
# 256k with more, 2048 before 0.6): the smallest of today's defaults is the safe guess
OLLAMA_DEFAULT_CTX = 4096
NUM_CTX_PARAMETER = re.compile(r"^num_ctx\s+(\d+)\s*$", re.MULTILINE)

# Where a model's ctx_max came from, most trusted first: the configuration's ctx_max,
# the model list, llama-server's /props, the same through llama-swap's /upstream,
# Ollama's /api/show, an overflow error that named the size, else assumed_ctx.
CtxSource = Literal["config", "models", "props", "upstream", "ollama", "learned", "assumed"]


def display_name(model: str) -> str:
    """A model id for people: llama-server without --alias names a model by its GGUF path."""
    return model.rsplit("/", 1)[-1].removesuffix(".gguf")


def image_cost(config: Config, model: str) -> int:
    """The tokens one image counts for ``model`` in estimates: its ``[models]`` table's
    ``image_tokens``, named by its id or by its ``display_name`` (a GGUF path's file name
    without ``.gguf``), else ``image_tokens``."""
    own = config.model_image_tokens
    for name in (model, display_name(model)) if own else ():
        if name in own:
            return own[name]
    return config.image_tokens


def sampling_params(config: Config, model: str, conversation: dict[str, Any]) -> dict[str, float]:
    """The sampling fields of a turn's requests to ``model`` (``core/sampling.py``): the
    conversation's settings, else the model's ``[models]`` table (by id or ``display_name``),
    else the configuration's top-level keys; only those set somewhere."""
    tables = config.model_sampling
    own = next((tables[name] for name in (model, display_name(model)) if name in tables), {})
    params: dict[str, float] = {}
    for key in SAMPLING_KEYS:
        chosen = next((v for v in (conversation.get(key), own.get(key), getattr(config, key)) if v is not None), None)
        if chosen is not None:
            params[key] = float(chosen)
    return params


@dataclass(frozen=True)
class ModelInfo:
    """A model the router serves: what input it takes, its context size and where that came from."""

    id: str
    input_modalities: tuple[str, ...] = ("text",)
    ctx_max: int = ASSUMED_CTX
    # False when llama-server's /props says the chat template has no tool support: the
    # server then drops `tools` silently, so offering them only costs prompt tokens
    tools: bool = True
    ctx_source: CtxSource = "assumed"
    image_tokens: int = Config.image_tokens  # what one image counts in estimates (image_cost)

    @property
    def vision(self) -> bool:
        return "image" in self.input_modalities

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": display_name(self.id),
            "input_modalities": list(self.input_modalities),
            "ctx_max": self.ctx_max,
            "ctx_source": self.ctx_source,
            "image_tokens": self.image_tokens,
        }


@dataclass(frozen=True)
class Missing:
    """What a model entry did not say, to be asked where the router says it."""

    modalities: bool
    ctx: bool


@dataclass(frozen=True)
class Facts:
    """What one source said of a model; None where it said nothing."""

    modalities: tuple[str, ...] | None = None
    ctx: int | None = None
    tools: bool | None = None
    # ctx is the server's default rather than a size it states (Ollama without num_ctx):
    # a size learned from an overflow error is better
    guess: bool = False


def listed_modalities(entry: dict[str, Any]) -> tuple[str, ...] | None:
    found = entry.get("input_modalities")
    architecture = entry.get("architecture")
    if found is None and isinstance(architecture, dict):
        found = architecture.get("input_modalities")
        modality = architecture.get("modality")
        if found is None and isinstance(modality, str) and "->" in modality:
            # OpenRouter's older form: "text+image->text"
            found = modality.split("->", 1)[0].split("+")
    if isinstance(found, list) and found and all(isinstance(m, str) for m in found):
        return tuple(found)
    return None


def positive_int(value: Any) -> int | None:
    """A size a server stated; None unless it is a finite number above 0 (not NaN or Infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        return None
    return int(value)


def listed_context(entry: dict[str, Any]) -> int | None:
    meta = entry.get("meta")
    # meta.n_ctx_train is the training length, not what the server was started with: not used.
    candidates = [meta.get("n_ctx") if isinstance(meta, dict) else None]
    candidates += [entry.get("context_length"), entry.get("max_model_len")]
    for value in candidates:
        ctx = positive_int(value)
        if ctx is not None:
            return ctx
    return None


def props_facts(props: Any) -> Facts:
    """Modalities, context and tool support from a llama-server /props answer."""
    if not isinstance(props, dict):
        return Facts()
    modalities = None
    flags = props.get("modalities")
    if isinstance(flags, dict):
        modalities = ("text",) + tuple(name for flag, name in (("vision", "image"), ("audio", "audio")) if flags.get(flag))
    settings = props.get("default_generation_settings")
    ctx = positive_int(settings.get("n_ctx")) if isinstance(settings, dict) else None
    caps = props.get("chat_template_caps")
    tools = not (isinstance(caps, dict) and caps.get("supports_tools") is False)
    return Facts(modalities, ctx or positive_int(props.get("n_ctx")), tools)


def training_ctx(model_info: Any) -> int | None:
    """The training context length in an Ollama ``model_info``: ``<arch>.context_length``."""
    if not isinstance(model_info, dict):
        return None
    arch = model_info.get("general.architecture")
    ctx = positive_int(model_info.get(f"{arch}.context_length")) if isinstance(arch, str) else None
    if ctx is None:
        ctx = next((positive_int(v) for k, v in model_info.items() if k.endswith(".context_length")), None)
    return ctx


def ollama_facts(show: Any) -> Facts:
    """Modalities, context and tool support from an Ollama /api/show answer."""
    if not isinstance(show, dict):
        return Facts()
    trained = training_ctx(show.get("model_info"))
    parameters = show.get("parameters")
    found = NUM_CTX_PARAMETER.search(parameters) if isinstance(parameters, str) else None
    # Ollama caps num_ctx at the training length, and so its default
    ctx, guess = (int(found.group(1)), False) if found else (OLLAMA_DEFAULT_CTX, True)
    if trained:
        ctx = min(ctx, trained)
    caps = show.get("capabilities")
    if not isinstance(caps, list):
        return Facts(None, ctx or None, None, guess)
    modalities = ("text", "image") if "vision" in caps else ("text",)
    return Facts(modalities, ctx or None, "tools" in caps, guess)


def enough(missing: Missing, found: list[tuple[CtxSource, Facts]]) -> bool:
    """Whether the sources asked so far said everything the model entry lacked."""
    ctx = any(f.ctx and not f.guess for _, f in found)
    modalities = any(f.modalities for _, f in found)
    return (ctx or not missing.ctx) and (modalities or not missing.modalities)
