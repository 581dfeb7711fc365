"""The client of the OpenAI-compatible model server ("the router").

One ``RouterClient`` owns the daemon's one ``httpx.AsyncClient`` for its whole life,
used as httpx intends: its own connection pool, explicit timeouts, streaming only
inside ``async with client.stream(...)`` so that a cancel closes the response and the
server sees the client go.  Pooled connections expire before llama-server drops an
idle one (``KEEPALIVE_EXPIRY``), and a streamed chat request's is not pooled at all
(docs/DESIGN.md, "llama-server quirks").  Every httpx
failure becomes one of our errors (``raise ... from exc``): no answer at all is
``RouterUnreachable`` with advice naming the URL, an HTTP error is ``RouterError``
carrying the server's own message, and a prompt too long for the model is
``RouterContextOverflow``.

Models come from ``GET /models``, cached for ``MODELS_TTL`` seconds behind a lock so
that concurrent turns share one fetch; a caller that finds the list older fetches it
again before it goes on (``models`` on the socket always asks).  What a list entry
lacks (input modalities, context size, tool support) is asked where the router says it:
llama-server's ``/props``, llama-swap's ``/upstream/<model>/props``, Ollama's
``/api/show`` (docs/DESIGN.md, "Context sizes").  Asking a router of several models about one
may load it, so that waits until ``model_info`` picks the model a turn is about to use.
What the router told of a model stands through later lists that do not say it.  A
model whose size nobody tells has ``assumed_ctx`` until the server refuses a prompt as
too long and names its size (``learn_context``); ``ModelInfo.ctx_source`` says where a
size came from, and ``ctx_max`` is never 0.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any, cast
from urllib.parse import quote

import httpx

from .config import Config
from .errors import AssistantError, NotFound, RouterError, RouterUnreachable
from .jsontext import EncodedPrefix, json_body, without_lone_surrogates
from .models import (
    CtxSource,
    Facts,
    Missing,
    ModelInfo,
    display_name,
    enough,
    image_cost,
    listed_context,
    listed_modalities,
    ollama_facts,
    props_facts,
)
from .sse import (
    ContentDelta,
    ReasoningDelta,
    StreamEnd,
    StreamEvent,
    Timings,
    ToolCall,
    Usage,
    call_in_text,
    error_from_body,
    parse_chat_stream,
)

__all__ = [
    "ContentDelta",
    "CtxSource",
    "MODELS_TTL",
    "ModelInfo",
    "ReasoningDelta",
    "RouterClient",
    "StreamEnd",
    "StreamEvent",
    "Timings",
    "ToolCall",
    "call_in_text",
    "Usage",
]

logger = logging.getLogger(__name__)

MODELS_TTL = 60.0  # seconds a model list is trusted; a model swapped in llama-swap shows up after this
# llama-server (cpp-httplib) drops a connection idle for 5 s: a pooled one is let go before that,
# so that a request never goes out on a connection the server is closing
KEEPALIVE_EXPIRY = 2.0
WRITE_TIMEOUT = 30.0  # seconds to send a request body (large base64 images included)
MODELS_TIMEOUT = 30.0  # seconds to wait for /models
PROPS_TIMEOUT = 10.0  # /props is a side channel: a slow one leaves ctx assumed rather than stall a turn
# Behind llama-swap, /upstream/<model>/props loads the model first: that may take a while
UPSTREAM_TIMEOUT = 120.0
REACHABLE_TIMEOUT = 3.0  # a status request answers quickly even when the router hangs
MAX_RAW_ERROR = 500
USER_AGENT = "assistant (local desktop daemon)"
UNREACHABLE_ADVICE = "is llama-server running? start it, or set router_url to where it listens"
LLAMA_SWAP_OWNER = "llama-swap"  # owned_by of llama-swap's /v1/models entries
OLLAMA_BANNER = "Ollama is running"  # what Ollama's root answers



def _server_body(response: httpx.Response) -> Any:
    text = response.text
    try:
        return json.loads(text)
    except ValueError:
        return text.strip()[:MAX_RAW_ERROR] or response.reason_phrase


def _status_advice(status: int) -> str:
    if status in (401, 403):
        return "check api_key in the configuration"
    if status == 404:
        return "check router_url (it usually ends in /v1, e.g. http://127.0.0.1:8080/v1)"
    if status == 503:
        return "the server may still be loading the model; try again shortly"
    return ""


def _status_error(response: httpx.Response, url: str) -> RouterError:
    return error_from_body(
        _server_body(response), response.status_code, prefix=f"the model server at {url} answered",
        advice=_status_advice(response.status_code),
    )


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, run the first time it is called only."""
    called = False

    def call() -> None:
        nonlocal called
        if not called:
            called = True
            fn()

    return call


def _seconds(value: float | None) -> str:
    return f"{value:g} s" if value is not None else "a long time"


def _reason(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


@functools.cache
def _tls() -> ssl.SSLContext:
    """httpx's own default (certifi's CA bundle), read once a process rather than by each client
    made: the read is costly next to a client's making, and a process may make many (the
    tests, a daemon each)."""
    return httpx.create_ssl_context(trust_env=False)


class RouterClient:
    """Talks to the model server: models, streamed and plain chat, embeddings."""

    def __init__(self, config: Config, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._config = config
        self._base = config.router_url.rstrip("/")
        # llama-server serves /props beside /v1, not under it; so do llama-swap and Ollama their own.
        self._root = self._base.removesuffix("/v1") or self._base
        self._props_url = self._root + "/props"
        self._transport = transport  # a test's httpx.MockTransport; else httpx's own
        self._http: httpx.AsyncClient | None = None
        self._lock = asyncio.Lock()
        self._models: list[ModelInfo] = []
        self._missing: dict[str, Missing] = {}
        self._fetched_at: float | None = None
        self._learned: dict[str, int] = {}  # model -> the size an overflow error named
        self._swap = False  # the model list is llama-swap's
        self._ollama: bool | None = None  # the router is Ollama; None: not asked since the last list
        self._told: set[str] = set()  # [models] ids the router did not list, said once in the log
        self._reach: asyncio.Future[bool] | None = None  # the reachability check under way

    @property
    def _client(self) -> httpx.AsyncClient:
        """The daemon's one HTTP client, made on first use (so that it is made in the running loop)."""
        if self._http is None:
            config = self._config
            headers = {"User-Agent": USER_AGENT}
            if config.api_key:
                headers["Authorization"] = f"Bearer {config.api_key}"
            timeout = httpx.Timeout(
                connect=config.connect_timeout, read=config.request_timeout, write=WRITE_TIMEOUT, pool=None
            )
            # trust_env off: the daemon talks to the router_url it is given, never through a proxy
            self._http = httpx.AsyncClient(
                headers=headers, timeout=timeout, transport=self._transport, trust_env=False, verify=_tls(),
                limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY),
            )
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    # -- models -----------------------------------------------------------------

    def _fresh(self) -> bool:
        return self._fetched_at is not None and time.monotonic() - self._fetched_at < MODELS_TTL

    async def models(self, refresh: bool = False) -> list[ModelInfo]:
        """The router's models, cached for ``MODELS_TTL`` seconds."""
        async with self._lock:
            if refresh or not self._fresh():
                await self._fetch_models()
            return list(self._models)

    async def model_info(self, model: str | None = None, *, load: bool = True) -> ModelInfo:
        """The named model, else the configured one, else the router's first; ``NotFound`` if absent.

        The list is fetched again when it is older than ``MODELS_TTL``, or lacks the model
        (one loaded since).  What the list did not say of the model is asked of the router
        first; with ``load=False`` nothing is asked that may load it (llama-swap's
        pass-through, /props on a router of several models): for a status line, not a turn.
        """
        wanted = model or self._config.model
        if self._fresh() and (known := self._find(wanted)) is not None and known.id not in self._missing:
            return known  # nothing to fetch or ask: not queued behind the list's lock
        async with self._lock:
            fetched = not self._fresh()
            if fetched:
                await self._fetch_models()
            info = self._find(wanted)
            if info is None and not fetched:
                await self._fetch_models()  # a model loaded since the last look
                info = self._find(wanted)
            if not self._models:
                raise RouterError(
                    f"the model server at {self._base} lists no models; load one (llama-server -m MODEL.gguf) "
                    "or check router_url"
                )
            if info is None:
                names = ", ".join(m.id for m in self._models)
                fix = "pick one of those" if model else "fix model in the configuration"
                raise NotFound(f"the model server has no model {wanted!r}; it has: {names}; {fix}")
            if info.id in self._missing:
                info = await self._probe(info, may_load=load)
            return info

    def learn_context(self, model: str, n_ctx: int) -> ModelInfo:
        """Remember the context size an overflow error named (``RouterContextOverflow.n_ctx``)
        for the daemon's life; the model's info with it.

        The learned size replaces an assumed or guessed one until the router reports a
        size itself; a configured ``ctx_max`` stays unless the server holds less.
        """
        if n_ctx <= 0:
            raise ValueError(f"a context size must be positive, not {n_ctx}")
        self._learned[model] = n_ctx
        current = next((m for m in self._models if m.id == model), None) or self._info(model)
        override = self._config.ctx_max
        if override and override <= n_ctx:
            return replace(current, ctx_max=override, ctx_source="config")
        learned = replace(current, ctx_max=n_ctx, ctx_source="learned")
        self._models = [learned if m.id == model else m for m in self._models]
        logger.info("model %s holds %d tokens (learned from the server's refusal)", model, n_ctx)
        return learned

    def default_model(self) -> str | None:
        """The default model without asking: the configured one, else the router's first as
        last seen (None before the router has ever answered)."""
        return self._config.model or (self._models[0].id if self._models else None)

    def _find(self, wanted: str) -> ModelInfo | None:
        """The model ``wanted`` names: its id, else its ``display_name`` in any case when no other
        model has it (llama-server without ``--alias`` names a model by its whole GGUF path)."""
        if not wanted:
            return self._models[0] if self._models else None
        exact = next((m for m in self._models if m.id == wanted), None)
        if exact is not None:
            return exact
        short = display_name(wanted).casefold()
        named = [m for m in self._models if display_name(m.id).casefold() == short]
        return named[0] if len(named) == 1 else None

    async def _fetch_models(self) -> None:
        url = f"{self._base}/models"
        # the model list is small and quick: a stuck router must not hold the models lock for request_timeout
        response = await self._request("GET", url, timeout=(MODELS_TIMEOUT, self._config.connect_timeout))
        body = self._json(response, url)
        entries = body.get("data") if isinstance(body, dict) else None
        if not isinstance(entries, list):
            raise RouterError(f"the model server at {url} did not answer with a model list; check router_url")
        models: list[ModelInfo] = []
        missing: dict[str, Missing] = {}
        told = {m.id: m for m in self._models if m.id not in self._missing}  # by earlier lists, or when asked
        for entry in entries:
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                continue
            modalities, listed = listed_modalities(entry), listed_context(entry)
            ctx_max, source = self._size(entry["id"], listed, "models")
            info = self._info(entry["id"], modalities or ("text",), ctx_max, source)
            lacks = Missing(modalities is None, listed is None and not self._config.ctx_max)
            if (known := told.get(info.id)) is not None:
                # what an earlier answer told stands where the list is silent (asked again, llama-swap
                # would load it); tools no list says: a turn takes the model from the list while a
                # lone model's /props is asked again below
                info = _what_was_told(info, known, lacks)
            elif lacks.modalities or lacks.ctx:
                missing[info.id] = lacks
            models.append(info)
        self._models, self._missing = models, missing
        self._swap = any(isinstance(e, dict) and e.get("owned_by") == LLAMA_SWAP_OWNER for e in entries)
        self._ollama = None
        # An empty list (a server still loading) is asked again next time rather than cached.
        self._fetched_at = time.monotonic() if models else None
        logger.debug("router lists %d models: %s", len(models), ", ".join(m.id for m in models))
        self._tell_unlisted(models)
        if len(models) == 1:
            # a lone model is a plain llama-server (or alike): /props is cheap and also says
            # whether its template takes tools; a router of several may load a model to answer.
            # Until it has answered, the model counts as not fully told, so that a turn meanwhile
            # waits for it rather than offer tools the template would drop (and word its
            # system prompt for them: the next turn's prompt would then differ from its start)
            if not self._swap:
                self._missing.setdefault(models[0].id, Missing(False, False))
            await self._probe(models[0], may_load=False)

    def _tell_unlisted(self, models: list[ModelInfo]) -> None:
        """Say once in the log which ``[models."ID"]`` tables name no model the router lists (a typo
        would otherwise leave that model's image cost the default without a word)."""
        if not models:
            return  # a server still loading lists nothing yet
        names = {name for m in models for name in (m.id, display_name(m.id))}
        for unlisted in sorted(set(self._config.model_image_tokens) - names - self._told):
            self._told.add(unlisted)
            logger.warning('[models."%s"] names no model the router lists (it has: %s); check the id',
                           unlisted, ", ".join(m.id for m in models))

    def _info(
        self, model: str, modalities: tuple[str, ...] = ("text",), ctx_max: int | None = None,
        source: CtxSource = "assumed",
    ) -> ModelInfo:
        """A model as first listed: with the image cost the configuration gives it."""
        return ModelInfo(model, modalities, ctx_max or self._config.assumed_ctx, ctx_source=source,
                         image_tokens=image_cost(self._config, model))

    def _size(self, model: str, found: int | None, source: CtxSource, guess: bool = False) -> tuple[int, CtxSource]:
        """ctx_max and its source: the configuration's, else a size the router states, else a
        learned one, else the router's default, else ``assumed_ctx``."""
        learned = self._learned.get(model)
        override = self._config.ctx_max
        if override:
            return (learned, "learned") if learned and learned < override else (override, "config")
        if found and not guess:
            return found, source
        if learned:
            return learned, "learned"
        if found:
            return found, source
        return self._config.assumed_ctx, "assumed"

    async def _probe(self, info: ModelInfo, *, may_load: bool) -> ModelInfo:
        """Ask what the model entry lacked, where the router says it; a router that says
        nothing leaves the defaults.  Without ``may_load``, only what cannot load a model."""
        missing = self._missing.get(info.id, Missing(False, False))
        lone = len(self._models) == 1
        found: list[tuple[CtxSource, Facts]] = []
        # recent llama-swap answers /props?model= too, by starting that model
        if may_load or (lone and not self._swap):
            found.append(("props", props_facts(await self._side_json(self._props_url, params={"model": info.id}))))
        if may_load and self._swap and not enough(missing, found):
            url = f"{self._root}/upstream/{quote(info.id, safe='/')}/props"
            found.append(("upstream", props_facts(await self._side_json(url, timeout=UPSTREAM_TIMEOUT))))
        if not enough(missing, found) and await self._is_ollama():
            show = await self._side_json(f"{self._root}/api/show", payload={"model": info.id})
            found.append(("ollama", ollama_facts(show)))
        # Only now: a probe cancelled by an impatient caller is tried again by the next one;
        # one that could not ask everything leaves the rest to a caller that may load the model.
        if may_load or (not self._swap and (lone or bool(self._ollama))):
            self._missing.pop(info.id, None)
        better = self._improve(info, missing, found)
        self._models = [better if m.id == info.id else m for m in self._models]
        return better

    def _improve(self, info: ModelInfo, missing: Missing, found: list[tuple[CtxSource, Facts]]) -> ModelInfo:
        """``info`` with what the sources said filled in where the model entry was silent."""
        modalities = next((f.modalities for _, f in found if f.modalities), None)
        tools = next((f.tools for _, f in found if f.tools is not None), info.tools)
        ctx_max, source = info.ctx_max, info.ctx_source
        if missing.ctx:
            said = next(((s, f) for s, f in found if f.ctx), None)
            if said is None:
                ctx_max, source = self._size(info.id, None, "assumed")
            else:
                ctx_max, source = self._size(info.id, said[1].ctx, said[0], said[1].guess)
        if missing.modalities and modalities:
            return replace(info, input_modalities=modalities, ctx_max=ctx_max, tools=tools, ctx_source=source)
        return replace(info, ctx_max=ctx_max, tools=tools, ctx_source=source)

    async def _is_ollama(self) -> bool:
        """Whether the router is Ollama, whose root says so; asked once per model list."""
        if self._ollama is None:
            response = await self._side(f"{self._root}/")
            self._ollama = response is not None and OLLAMA_BANNER in response.text
        return self._ollama

    async def _side(
        self, url: str, *, params: dict[str, str] | None = None, payload: Any = None, timeout: float = PROPS_TIMEOUT
    ) -> httpx.Response | None:
        """A side-channel question (GET, or POST with ``payload``): the answer when it is
        a 200, else None; it never raises, a router without the route just says nothing."""
        try:
            if payload is None:
                response = await self._client.get(url, params=params, timeout=timeout)
            else:
                response = await self._client.post(url, json=payload, timeout=timeout)
        except httpx.HTTPError as exc:
            logger.debug("no answer at %s: %s", url, _reason(exc))
            return None
        if response.status_code != 200:
            logger.debug("no answer at %s: HTTP %d", url, response.status_code)
            return None
        return response

    async def _side_json(self, url: str, **kwargs: Any) -> Any:
        """A side-channel answer as parsed JSON, or None."""
        response = await self._side(url, **kwargs)
        try:
            return response.json() if response is not None else None
        except ValueError:
            logger.debug("no JSON at %s", url)
            return None

    async def reachable(self) -> bool:
        """Whether the router answers HTTP at all, within a few seconds; never raises. Callers at
        once share one check: a flood of ``status`` lines is not as many requests to the router."""
        if self._reach is None or self._reach.done():
            self._reach = asyncio.ensure_future(self._reachable())
        return await asyncio.shield(self._reach)

    async def _reachable(self) -> bool:
        try:
            await self._client.get(f"{self._base}/models", timeout=REACHABLE_TIMEOUT)
        except Exception as exc:  # a status request must get an answer whatever went wrong
            logger.debug("router at %s unreachable: %s", self._base, _reason(exc))
            return False
        return True

    # -- chat -----------------------------------------------------------------

    async def stream_chat(
        self,
        model: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        sent: Callable[[], None] | None = None,
        encoded: EncodedPrefix | None = None,
        **params: Any,
    ) -> AsyncGenerator[StreamEvent, None]:
        """Stream a chat completion: deltas, then one ``StreamEnd``.

        ``sent`` is called once, when the request has gone out (httpx's ``trace`` extension),
        or at the latest when the answer starts.  ``encoded``: the first messages as JSON
        made earlier (``core.jsontext.json_body``).  Cancel the consuming task or ``aclose()``
        the generator to stop early; either closes the HTTP response.
        """
        url = f"{self._base}/chat/completions"
        body: dict[str, Any] = {"model": model, "messages": messages, **params, "stream": True,
                                "stream_options": {"include_usage": True}, **({"tools": tools} if tools else {})}
        logger.debug("POST %s model=%s messages=%d tools=%d", url, model, len(messages), len(tools or ()))
        went_out = _once(sent or (lambda: None))

        async def trace(event: str, info: dict[str, Any]) -> None:
            if event == "http11.send_request_body.complete":
                went_out()

        started = False
        end: StreamEnd | None = None
        try:
            content = json_content(body, encoded)
            # cpp-httplib (llama-server) closes a connection after a streamed answer though it
            # offered keep-alive: the connection is not pooled, or the next request would be lost
            content["headers"]["Connection"] = "close"
            async with self._client.stream("POST", url, **content, extensions={"trace": trace}) as response:
                went_out()  # a transport that does not trace (a test's MockTransport)
                if response.status_code >= 400:
                    await response.aread()
                    raise _status_error(response, url)
                started = True
                lines = cast(AsyncGenerator[str, None], response.aiter_lines())
                async with aclosing(lines), aclosing(parse_chat_stream(lines)) as events:
                    async for event in events:
                        if isinstance(event, StreamEnd):
                            end = event
                            break
                        yield event
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, url, mid_stream=started) from exc
        if end is None:  # parse_chat_stream ends with a StreamEnd or raises
            raise RouterError(f"the model server at {url} ended the reply without a result")
        yield end

    async def complete(self, model: str, messages: list[dict[str, Any]], max_tokens: int = 64, **params: Any) -> str:
        """A short non-streamed completion (titles, summaries): the reply's text."""
        url = f"{self._base}/chat/completions"
        body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, **params}
        body["stream"] = False
        response = await self._request("POST", url, payload=body)
        answer = self._json(response, url)
        if isinstance(answer, dict) and answer.get("error"):
            raise error_from_body(answer, prefix=f"the model server at {url} answered")
        try:
            content = answer["choices"][0]["message"].get("content")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise RouterError(f"the model server at {url} answered without a message: {response.text[:200]}") from None
        # a lone surrogate (a server cutting text between UTF-16 halves) could not be stored
        return without_lone_surrogates(content) if isinstance(content, str) else ""

    # -- embeddings -------------------------------------------------------------

    async def embed(self, model: str, inputs: list[str], timeout: float | None = None) -> list[list[float]]:
        """One vector per input, in input order; ``timeout`` bounds the whole call."""
        if not inputs:
            return []
        url = f"{self._config.embeddings_base.rstrip('/')}/embeddings"
        body = {"model": model, "input": inputs}
        try:
            async with asyncio.timeout(timeout):
                response = await self._request(
                    "POST", url, payload=body, timeout=(timeout, timeout) if timeout is not None else None
                )
        except TimeoutError:
            raise RouterUnreachable(
                f"the embedding server at {url} did not answer within {timeout:g} s; check it, or set embedding_url"
            ) from None
        answer = self._json(response, url)
        items = answer.get("data") if isinstance(answer, dict) else None
        try:
            ordered = sorted(items or (), key=lambda item: int(item.get("index", 0)))
            vectors = [[float(x) for x in item["embedding"]] for item in ordered]
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError):  # an index of Infinity
            raise RouterError(f"the embedding server at {url} answered without embeddings: {response.text[:200]}") from None
        if len(vectors) != len(inputs):
            raise RouterError(f"the embedding server at {url} returned {len(vectors)} vectors for {len(inputs)} inputs")
        return vectors

    # -- plumbing -----------------------------------------------------------------

    async def _request(
        self, method: str, url: str, *, payload: Any = None, timeout: tuple[float, float] | None = None
    ) -> httpx.Response:
        """Send a request; transport failures and HTTP errors become our errors.

        ``timeout``: (read, write and pool; connect) in seconds, else the client's.
        """
        client = self._client
        limits = client.timeout if timeout is None else httpx.Timeout(timeout[0], connect=timeout[1])
        try:
            body = json_content(payload) if payload is not None else {}
            response = await client.request(method, url, **body, timeout=limits)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, url, timeout=limits) from exc
        if response.status_code >= 400:
            raise _status_error(response, url)
        return response

    @staticmethod
    def _json(response: httpx.Response, url: str) -> Any:
        try:
            return response.json()
        except ValueError:
            raise RouterError(
                f"the model server at {url} answered with something that is not JSON: {response.text[:200]!r}; "
                "check router_url"
            ) from None

    def _transport_error(
        self, exc: httpx.HTTPError, url: str, *, mid_stream: bool = False, timeout: httpx.Timeout | None = None
    ) -> AssistantError:
        """Our error for an httpx failure, naming the URL and what to do."""
        reason = _reason(exc)
        timeout = timeout or self._client.timeout
        if isinstance(exc, httpx.ReadTimeout):
            return RouterUnreachable(
                f"the model server at {url} sent nothing for {_seconds(timeout.read)}; it may be overloaded or stuck: "
                "check it, or raise request_timeout"
            )
        if mid_stream:
            return RouterError(
                f"the model server closed the reply mid-stream ({reason}); it may have crashed or been restarted: "
                "the partial reply is kept, ask again to continue"
            )
        if isinstance(exc, httpx.ConnectTimeout):
            return RouterUnreachable(
                f"no connection to the model server at {url} within {_seconds(timeout.connect)}; {UNREACHABLE_ADVICE}"
            )
        if isinstance(exc, httpx.ConnectError):
            return RouterUnreachable(f"cannot connect to the model server at {url} ({reason}); {UNREACHABLE_ADVICE}")
        if isinstance(exc, httpx.TimeoutException):
            return RouterUnreachable(f"the model server at {url} timed out ({type(exc).__name__}); check it")
        return RouterUnreachable(f"the model server at {url} dropped the connection ({reason}); {UNREACHABLE_ADVICE}")


def _what_was_told(listed: ModelInfo, known: ModelInfo, lacks: Missing) -> ModelInfo:
    """A model as a new list gives it, with what an earlier answer told of it where the list is silent."""
    return replace(
        listed,
        input_modalities=known.input_modalities if lacks.modalities else listed.input_modalities,
        ctx_max=known.ctx_max if lacks.ctx else listed.ctx_max,
        ctx_source=known.ctx_source if lacks.ctx else listed.ctx_source,
        tools=known.tools,
    )


def json_content(body: dict[str, Any], encoded: EncodedPrefix | None = None) -> dict[str, Any]:
    """httpx's ``content`` and ``headers`` for a JSON body sent in pieces (``core.jsontext.
    json_body``), its length given: not chunked."""
    parts = json_body(body, encoded)
    headers = {"Content-Type": "application/json", "Content-Length": str(sum(map(len, parts)))}
    return {"content": _pieces(parts), "headers": headers}


async def _pieces(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part
