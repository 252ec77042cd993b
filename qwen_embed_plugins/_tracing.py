"""OpenTelemetry spans of embedding calls (the ``otel`` extra: ``opentelemetry-api``).

A second observer of the events ``_metrics`` counts: the clients report where a call
starts and ends (``start_call``, ``traced``: ``_client``, above every surface), the
engine where each HTTP exchange starts, is answered and ends (``CallTrace.request``,
``RequestTrace.answered`` / ``end``: ``_engine``, beside the metrics' calls); this module
turns them into spans when a tracer provider is set, and into nothing otherwise.

- One span per embedding call (``embed_documents``, ``embed_query``, ... on every
  surface: sync, async, HTTP/2, both adapters, Ray, the CLI), following OTel's GenAI
  conventions for client embeddings: name ``embeddings {gen_ai.request.model}``, kind
  ``CLIENT``, ``gen_ai.operation.name="embeddings"``, ``gen_ai.provider.name``,
  ``gen_ai.request.model``, ``server.address`` / ``server.port`` (one replica),
  ``gen_ai.request.encoding_formats``, ``gen_ai.embeddings.dimension.count``,
  ``gen_ai.response.model``, ``gen_ai.usage.input_tokens`` (the sum the server reported
  over the call's answered requests), ``error.type`` on failure. Its parent is the
  caller's current span (a LangChain or LlamaIndex span when the framework is traced).
- One child span per HTTP exchange of the call (retries, splits, bisection halves,
  control requests, replicas, hedges), following OTel's HTTP client conventions: name
  ``POST``, ``http.request.method``, ``url.full`` (no credentials, no query),
  ``server.address`` / ``server.port`` of the replica, ``http.request.resend_count``,
  ``http.response.status_code``, ``network.protocol.version``, ``error.type``.

Never recorded: texts, vectors, the API key, header values, error messages (a server's
error text can quote the input). Without ``opentelemetry-api`` (the import is tried
once) a call costs one ``is None`` check; with the API but no tracer provider set (its
default) the API's no-op span start; neither builds an attribute (bench/tracing_overhead.py
measures both).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from importlib import metadata
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from ._protocol import usage_prompt_tokens
from ._server_text import endpoint_label

try:  # the ``otel`` extra; its absence costs one ``is None`` check per call
    from opentelemetry import context as _context
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _otel
except ImportError:  # pragma: no cover - exercised in a venv without the extra
    _otel = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from types import TracebackType

    from opentelemetry.trace import Span, Tracer

    from ._config import EmbeddingConfig
    from ._servers import Detection

__all__ = ["CallTrace", "RequestTrace", "attached", "carrier", "start_call", "traced"]

_NAME = "qwen_embed_plugins"
_UNKNOWN_PROVIDER = "openai_compatible"
"""``gen_ai.provider.name`` while the server is neither declared (``server=``) nor yet
identified: the conventions list no value for self-hosted OpenAI-compatible servers,
and ``openai`` would claim OpenAI's service (and its ``openai.*`` attributes)."""


class _Replica(Protocol):
    @property
    def url(self) -> str: ...


class _Endpoint(Protocol):
    @property
    def single(self) -> _Replica | None: ...


class Engine(Protocol):
    """What a call's span reads of its ``_engine.Engine`` (this module imports none of
    the engine's modules: they import it)."""

    @property
    def model(self) -> str: ...
    @property
    def config(self) -> EmbeddingConfig: ...
    @property
    def endpoint(self) -> _Endpoint: ...
    def detection(self) -> Detection | None: ...


class Call(Protocol):
    """What a call's span reads and sets of its ``_run.Call``."""

    dim: int | None
    trace: CallTrace | None


_where: dict[str, tuple[str, str | None, int | None]] = {}  # URL -> (url.full, host, port)


def _version() -> str | None:
    """This distribution's version (the tracer's ``instrumentation scope`` version)."""
    try:
        return metadata.version("qwen-embed-plugins")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a bare checkout
        return None


# The API's tracer for this library (made at the first call): a proxy that stays a no-op
# until a provider is set, then delegates to it. ``_real`` is that provider's tracer, once
# a span showed one set (a global provider is set once and never replaced).
_PROXY: Tracer | None = None
_real: Tracer | None = None


def _place(url: str) -> tuple[str, str | None, int | None]:
    """``url`` as ``(url.full without credentials or query, server.address,
    server.port)``; computed once per URL."""
    found = _where.get(url)
    if found is None:
        full = endpoint_label(url)
        try:
            parts = urlsplit(full)
            port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
            found = (full, parts.hostname, port)
        except ValueError:
            found = (full, None, None)
        if len(_where) < 1024:  # URLs are few (one per replica and request kind)
            _where[url] = found
    return found


def _error_type(exc: BaseException) -> str:
    """``error.type`` of an exception: its fully qualified class name."""
    cls = type(exc)
    return f"{cls.__module__}.{cls.__qualname__}"


def _provider_name(engine: Engine) -> str:
    """The server's profile name when declared or identified, else ``openai_compatible``."""
    found = engine.detection()
    if found is None or found.profile.name == "openai":  # the generic profile
        return _UNKNOWN_PROVIDER
    return found.profile.name


class CallTrace:
    """The span of one embedding call (made by ``start_call`` only when it records)."""

    __slots__ = (
        "_lock",
        "call",
        "ctx",
        "dim",
        "engine",
        "formats",
        "model",
        "span",
        "tokens",
        "tracer",
    )

    def __init__(self, tracer: Tracer, span: Span, engine: Engine) -> None:
        self.tracer = tracer
        self.span = span
        self.engine = engine
        self.ctx = _otel.set_span_in_context(span)  # the parent of its request spans
        self.call: Call | None = None
        self._lock = threading.Lock()
        self.tokens: int | None = None
        self.model: str | None = None
        self.dim: int | None = None  # the size of the first answer's vectors
        self.formats: list[str] = []

    def request(self, url: str, fmt: str, texts: int, attempt: int) -> RequestTrace:
        """A child span for one HTTP exchange to ``url`` of ``texts`` texts, the
        ``attempt``-th (from 1) of its request."""
        full, host, port = _place(url)
        attrs: dict[str, Any] = {
            "http.request.method": "POST",
            "url.full": full,
            "qwen_embed.request.texts": texts,
        }
        if host is not None:
            attrs["server.address"] = host
        if port is not None:
            attrs["server.port"] = port
        if attempt > 1:
            attrs["http.request.resend_count"] = attempt - 1
        if fmt not in self.formats:
            with self._lock:
                if fmt not in self.formats:
                    self.formats.append(fmt)
        span = self.tracer.start_span(
            "POST", context=self.ctx, kind=_otel.SpanKind.CLIENT, attributes=attrs
        )
        return RequestTrace(self, span)

    def answered(self, payload: object, dim: int) -> None:
        """A request of the call was answered with ``payload`` (vectors of ``dim``
        floats): its usage and model."""
        tokens = usage_prompt_tokens(payload)
        model = payload.get("model") if isinstance(payload, Mapping) else None
        with self._lock:
            if tokens is not None:
                self.tokens = (self.tokens or 0) + tokens
            if self.model is None and isinstance(model, str) and model:
                self.model = model
            if self.dim is None:
                self.dim = dim

    def __enter__(self) -> CallTrace:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """The call ended (``exc``: its error): the attributes learned, then the end."""
        span, call = self.span, self.call
        self.call = None  # the call and its trace refer to each other until now
        dims = self.engine.config.dimensions or (call.dim if call is not None else None)
        dims = dims or self.dim
        if dims:
            span.set_attribute("gen_ai.embeddings.dimension.count", dims)
        if self.formats:
            span.set_attribute("gen_ai.request.encoding_formats", self.formats)
        if self.model is not None:
            span.set_attribute("gen_ai.response.model", self.model)
        if self.tokens is not None:
            span.set_attribute("gen_ai.usage.input_tokens", self.tokens)
        span.set_attribute("gen_ai.provider.name", _provider_name(self.engine))
        if exc is not None:
            kind_name = "cancelled" if isinstance(exc, asyncio.CancelledError) else _error_type(exc)
            span.set_attribute("error.type", kind_name)
            span.set_status(_otel.StatusCode.ERROR)
        span.end()


class RequestTrace:
    """The span of one HTTP exchange of a call."""

    __slots__ = ("call", "span")

    def __init__(self, call: CallTrace, span: Span) -> None:
        self.call = call
        self.span = span

    def answered(self, http_version: str, payload: object, dim: int) -> None:
        """The exchange was answered with a good body (``payload``, vectors of ``dim``
        floats) over ``http_version`` (``"HTTP/1.1"``, ``"HTTP/2"``)."""
        self.span.set_attribute("network.protocol.version", http_version.rpartition("/")[2])
        self.call.answered(payload, int(dim))

    def end(self, outcome: str, status: int | None, error: BaseException | None) -> None:
        """The exchange ended: ``outcome`` is ``"ok"``, ``"cancelled"`` (a hedge lost,
        the caller cancelled) or an error's class name; ``status`` its HTTP status."""
        span = self.span
        span.set_attribute("qwen_embed.outcome", outcome)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if outcome not in ("ok", "cancelled"):
            if status is not None and status >= 400:
                span.set_attribute("error.type", str(status))
            elif error is not None:
                span.set_attribute("error.type", _error_type(error))
            else:
                span.set_attribute("error.type", "_OTHER")
            span.set_status(_otel.StatusCode.ERROR)
        span.end()


class _Untraced:
    """``traced``'s answer for a call without a span: does nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_UNTRACED = _Untraced()


def start_call(engine: Engine, call: Call, texts: int) -> None:
    """Open ``call``'s span (``call.trace``) when a tracer provider records it: a call of
    ``texts`` texts through ``engine``, child of the caller's current span.

    Until a span shows a provider set, the span is started bare through the API's proxy
    tracer (with no provider: the API's shared invalid span, and nothing else is built)
    and its attributes are set once it records; afterwards they are given at its start,
    where a sampler sees them (as the GenAI conventions ask)."""
    global _PROXY, _real
    if _otel is None:  # the ``otel`` extra is not installed
        return
    model = engine.model
    name = f"embeddings {model}" if model else "embeddings"
    tracer = _real
    if tracer is None:
        proxy = _PROXY
        if proxy is None:
            proxy = _PROXY = _otel.get_tracer(_NAME, _version())
        span = proxy.start_span(name, kind=_otel.SpanKind.CLIENT)
        if span is _otel.INVALID_SPAN:  # no provider (the API's default): nothing to do
            return
        provider = _otel.get_tracer_provider()
        if isinstance(provider, _otel.ProxyTracerProvider | _otel.NoOpTracerProvider):
            return  # none either: the no-op tracer handed back the current (remote) span
        tracer = _real = provider.get_tracer(_NAME, _version())
        if span.is_recording():
            span.set_attributes(_call_attributes(engine, texts))
    else:
        attrs = _call_attributes(engine, texts)
        span = tracer.start_span(name, kind=_otel.SpanKind.CLIENT, attributes=attrs)
    if not span.is_recording():  # sampled out: nothing to add
        return
    trace = CallTrace(tracer, span, engine)
    trace.call = call
    call.trace = trace


def _call_attributes(engine: Engine, texts: int) -> dict[str, Any]:
    """The call span's attributes known at its start."""
    model = engine.model
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "embeddings",
        "gen_ai.provider.name": _provider_name(engine),
        "qwen_embed.texts": texts,
    }
    if model:
        attrs["gen_ai.request.model"] = model
    single = engine.endpoint.single
    if single is not None:
        _, host, port = _place(single.url)
        if host is not None:
            attrs["server.address"] = host
        if port is not None:
            attrs["server.port"] = port
    return attrs


def traced(call: Call) -> CallTrace | _Untraced:
    """The context manager around a call's run: ends its span (with its error), or
    does nothing for a call without one."""
    trace = call.trace
    return _UNTRACED if trace is None else trace


def carrier() -> dict[str, str]:
    """The caller's current trace context as W3C headers (``traceparent``, ...), for a
    worker in another process (Ray) to parent its calls' spans; ``{}`` without a
    recording span."""
    if _otel is None or not _otel.get_current_span().get_span_context().is_valid:
        return {}
    out: dict[str, str] = {}
    _propagate.inject(out)
    return out


class attached:  # noqa: N801 - used as a context manager, like contextlib's
    """Within the block, ``headers`` (from ``carrier``) is the current trace context, so
    calls made there are children of the span it names; a no-op for ``{}``."""

    __slots__ = ("headers", "token")

    def __init__(self, headers: Mapping[str, str] | None) -> None:
        self.headers = headers
        self.token: object = None

    def __enter__(self) -> None:
        if self.headers and _otel is not None:
            self.token = _context.attach(_propagate.extract(self.headers))

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            _context.detach(self.token)  # type: ignore[arg-type]
            self.token = None
