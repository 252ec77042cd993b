"""Frozen, hashable settings: endpoint, limits, timeouts, retry, batching.

``EmbeddingConfig`` holds them all; its transport policies (``Timeouts``, ``Limits``,
``RetryConfig``) are defined in ``_policy`` and exported from here. Every settings
object is an immutable, keyword-only dataclass. Equal settings hash
equally, so the transport part of an ``EmbeddingConfig`` (its ``pool_key``) is the key
of the process-wide connection pool: every client and adapter built with equal transport
settings shares one pool, whatever its batching or model settings.

Units: every duration is in seconds, every size in texts or connections, as named.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol
from urllib.parse import urlsplit

from ._endpoint import (
    check_url_port,
    environment_proxy,
    insecure_key_target,
    is_loopback,
    normalise_base_url,
)
from ._extras import (
    RESERVED_BODY_KEYS,
    RequestBody,
    RequestHeaders,
    is_secret_field,
    is_secret_header,
    request_body,
    request_headers,
)
from ._keys import ENV_API_KEY, KeyFunction, MissingKey, Secret, checked_api_key
from ._policy import Limits, Replaceable, RetryConfig, Timeouts, check_int
from ._protocol import (
    DEFAULT_QUERY_TASK,
    QWEN3_EMBEDDING_DIMS,
    default_query_instruction,
    is_qwen3_embedding,
    known_model_dims,
)
from ._server_text import ProxyURL, endpoint_label, has_credentials, redact_url
from ._settings import DEFAULT, DEFAULT_MODEL, SETTING, SETTINGS
from .errors import ConfigError

__all__ = [
    "CONCURRENCY_AUTO_REMOVED",
    "DEFAULT_MODEL",
    "DEFAULT_QUERY_TASK",
    "ENV_API_KEY",
    "ENV_SETTINGS",
    "NOT_GIVEN",
    "OPENAI_VARIABLES",
    "QWEN3_EMBEDDING_DIMS",
    "RESERVED_BODY_KEYS",
    "SERVER_NAMES",
    "EmbeddingConfig",
    "EncodingFormat",
    "KeyFunction",
    "Limits",
    "MissingKey",
    "NotGiven",
    "OnError",
    "PhaseTimeouts",
    "PoolKey",
    "ProxyURL",
    "RequestBody",
    "RequestHeaders",
    "RetryConfig",
    "Secret",
    "TimeoutArg",
    "Timeouts",
    "default_query_instruction",
    "env_setting",
    "environment_proxy",
    "insecure_key_target",
    "is_loopback",
    "is_qwen3_embedding",
    "is_removed_concurrency",
    "is_secret_field",
    "is_secret_header",
    "known_model_dims",
    "redact_url",
    "request_body",
    "request_headers",
    "timeouts_of",
]

QWEN3_MIN_DIMENSIONS: Final = 32

EncodingFormat = Literal["auto", "base64", "float"]
"""How vectors travel: ``"auto"`` (base64, falling back to float once per endpoint if
refused or broken), ``"base64"`` or ``"float"`` (``EmbeddingConfig.encoding_format``)."""

SERVER_NAMES: Final[tuple[str, ...]] = (
    "sglang",
    "vllm",
    "tei",
    "infinity",
    "ollama",
    "llamacpp",
    "dashscope",
    "siliconflow",
    "openai",
)
"""Servers with a profile (``qwen_embed_plugins._servers``); ``"openai"`` is the generic
OpenAI-compatible fallback. ``EmbeddingConfig(server=...)`` takes one of these or
``"auto"``."""


class NotGiven:
    """The type of ``NOT_GIVEN``: "argument not passed", distinct from ``None``.

    ``None`` can be a meaningful value (``timeout=None`` means "no timeout",
    ``query_instruction=None`` means "no instruction"), so "use the default / the
    environment" needs its own marker.
    """

    _instance: NotGiven | None = None

    def __new__(cls) -> NotGiven:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "NOT_GIVEN"

    def __reduce__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Final = NotGiven()


CONCURRENCY_AUTO_REMOVED: Final = (
    'max_concurrency="auto" (or QWEN_EMBED_MAX_CONCURRENCY=auto) was removed: it did not '
    'lower query latency under load (docs/benchmarks.md, "Adaptive concurrency: removed"); '
    "give max_concurrency as an integer, requests in flight per call, 1..1024 (default 4)"
)
"""The error of the removed ``max_concurrency="auto"``, on every surface."""


def is_removed_concurrency(value: object) -> bool:
    """Whether ``value`` is the removed ``max_concurrency="auto"`` (any case, spaces
    around), which ``EmbeddingConfig`` refuses with ``CONCURRENCY_AUTO_REMOVED``."""
    return isinstance(value, str) and value.strip().lower() == "auto"


@dataclass(frozen=True, slots=True, repr=False)
class PoolKey:
    """The transport part of a config for one server (replica): the key of its
    process-wide pool.

    Two configs with equal ``PoolKey`` share connections. It holds no API key (the key
    and the timeouts travel with each request), so clients of many tenants of one
    server share one pool. ``proxy`` is the URL the transports dial, credentials
    included; ``repr`` shows it redacted.
    """

    base_url: str
    limits: Limits
    http2: bool
    verify: bool | str
    proxy: str | None

    def __repr__(self) -> str:
        proxy = None if self.proxy is None else redact_url(self.proxy)
        return (
            f"PoolKey(base_url={self.base_url!r}, limits={self.limits!r}, "
            f"http2={self.http2!r}, verify={self.verify!r}, proxy={proxy!r})"
        )

    @property
    def label(self) -> str:
        """The replica as shown in stats, logs and metrics (no credentials)."""
        return endpoint_label(self.base_url)


def _is_proxy_url(url: str) -> bool:
    """Whether ``url`` is an ``http://`` or ``https://`` URL with a host."""
    try:
        parts = urlsplit(url)
        return parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:
        return False


def _resolved_api_key(api_key: Any) -> Secret | KeyFunction | None:
    """The API key as given (``str``, ``Secret``, a callable, ``KeyFunction``, ``None``)
    or from the environment (``NOT_GIVEN``), checked (``_checked_api_key``); a callable
    becomes a ``KeyFunction`` (one given as such is kept: its recent keys with it)."""
    if isinstance(api_key, NotGiven):
        api_key = env_setting("api_key")
    if isinstance(api_key, Secret):
        api_key = api_key.get_secret_value()
    if isinstance(api_key, str):
        return checked_api_key(api_key)
    if isinstance(api_key, KeyFunction):
        return api_key
    if callable(api_key):
        return KeyFunction(api_key)
    if api_key is not None:
        raise ConfigError(
            "api_key must be a str, a Secret, a callable returning the key (sync or "
            f"async) or None, got {type(api_key).__name__}"
        )
    return None


# --------------------------------------------------------------------------- environment


ENV_SETTINGS: Final[dict[str, tuple[str, Any]]] = {
    setting.name: (setting.env, setting.parse or str) for setting in SETTINGS if setting.env
}
"""The settings read from the environment, with their variable and parser. The one
resolver (``env_setting``) serves ``EmbeddingConfig`` and both framework adapters."""


_DECLARED: Final = object()


def env_setting(
    name: str, default: Any = _DECLARED, environ: Mapping[str, str] | None = None
) -> Any:
    """The value of setting ``name`` from its ``QWEN_EMBED_*`` variable, else ``default``
    (its declared default when not given).

    ``QWEN_EMBED_BASE_URL`` may hold a comma-separated list of replica URLs.

    Raises:
        ConfigError: the variable holds a value that does not parse (the message names
            the variable, never the API key's value).
    """
    env = os.environ if environ is None else environ
    variable, parse = ENV_SETTINGS[name]
    raw = env.get(variable)
    if raw is None or not raw.strip():
        return SETTING[name].default if default is _DECLARED else default
    try:
        return parse(raw)
    except ValueError as exc:
        shown = "(hidden)" if name == "api_key" else repr(raw)
        raise ConfigError(f"{variable} has an invalid value {shown}: {exc}") from None


# --------------------------------------------------------------------------- the config

_FROM_ENV: Final = tuple(
    s.name
    for s in SETTINGS
    if s.env and not s.into and s.name not in ("base_url", "api_key", "model", "proxy")
)
"""The settings ``EmbeddingConfig`` takes from the environment, else their declared
default, when not given (``NOT_GIVEN``); the four left out have rules of their own."""

OPENAI_VARIABLES: Final = ("OPENAI_BASE_URL", "OPENAI_API_BASE", "OPENAI_API_KEY")
"""The openai SDK's and the stock adapters' variables, which are never read here: an
OpenAI key must not reach another server."""


def _openai_variables_not_read() -> None:
    """No base URL was given: when only the openai SDK's variables are set, say that
    they are not read, and what to set instead.

    Raises:
        ConfigError: one of ``OPENAI_VARIABLES`` is set (the message names it, never
            its value).
    """
    found = [name for name in OPENAI_VARIABLES if os.environ.get(name, "").strip()]
    if found:
        base, key = SETTING["base_url"].env, SETTING["api_key"].env
        raise ConfigError(
            f"base_url is required: pass base_url='http://host:port/v1' or set {base} "
            f"(and {key} if the server wants a key). {', '.join(found)} "
            f"{'is' if len(found) == 1 else 'are'} set but deliberately not read: an "
            "OpenAI key must never be sent to another server"
        )


_PHASES: Final = ("connect", "read", "write", "pool")


class PhaseTimeouts(Protocol):
    """Per-phase timeouts in seconds, as ``httpx.Timeout`` holds them."""

    @property
    def connect(self) -> float | None: ...
    @property
    def read(self) -> float | None: ...
    @property
    def write(self) -> float | None: ...
    @property
    def pool(self) -> float | None: ...


TimeoutArg = (
    float
    | tuple[float | None, float | None]
    | tuple[float | None, float | None, float | None, float | None]
    | PhaseTimeouts
    | None
)
"""What ``timeout=`` takes on every surface (``timeouts_of``)."""


def _seconds_or_none(value: object, what: str) -> float | None:
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
        return value
    raise ConfigError(f"timeout: {what} must be a number of seconds or None, got {value!r}")


def timeouts_of(value: object) -> Timeouts:
    """``timeout=`` as the stock clients take it, as ``Timeouts``: the one meaning of
    ``timeout`` in the core config, the clients and both adapters.

    - a number ``x`` (seconds): every phase (connect, read, write, pool) and the
      exchange in all (``total``) at most ``x``: a request never takes longer than
      ``timeout``, and nothing cuts it sooner;
    - ``None``: no limit at all;
    - ``httpx.Timeout(...)`` (any object with ``connect``, ``read``, ``write`` and
      ``pool`` attributes, seconds or ``None``), a ``(connect, read)`` or a
      ``(connect, read, write, pool)`` tuple: those phases (write and pool take
      ``read`` with a pair), and ``total`` their sum (``None`` when one is ``None``),
      so no phase is cut by a total shorter than itself;
    - a ``Timeouts``: as given.

    Raises:
        ConfigError: any other type, a value out of range (0.001..86400 s).
    """
    if isinstance(value, Timeouts):
        return value
    if value is None or isinstance(value, int | float):
        x = _seconds_or_none(value, "the number")
        return Timeouts(connect=x, read=x, write=x, pool=x, total=x)
    if isinstance(value, tuple) and len(value) in (2, 4):
        given = [_seconds_or_none(v, f"item {i}") for i, v in enumerate(value)]
        phases = given if len(given) == 4 else [given[0], given[1], given[1], given[1]]
    elif all(hasattr(value, name) for name in _PHASES):  # httpx.Timeout (public attributes)
        phases = [_seconds_or_none(getattr(value, name), name) for name in _PHASES]
    else:
        raise ConfigError(
            "timeout must be a number of seconds, None, httpx.Timeout(...), a (connect, "
            f"read) or (connect, read, write, pool) tuple, or a Timeouts; got {value!r}"
        )
    total = None if None in phases else sum(p for p in phases if p is not None)
    return Timeouts(**dict(zip(_PHASES, phases, strict=True)), total=total)


def _deadlines_cover(retry: RetryConfig, timeout: Timeouts) -> RetryConfig:
    """``retry`` with each call deadline left at its default raised to the exchange's
    ``total`` when a timeout was set longer than the default total: a ``timeout=`` is
    never cut short by a default deadline (an explicit deadline is kept)."""
    if not isinstance(retry, RetryConfig):
        raise ConfigError("retry must be a RetryConfig")
    total = timeout.total
    if total == DEFAULT["total_timeout"]:
        return retry
    changes: dict[str, float | None] = {}
    for name in ("deadline", "query_deadline"):
        current = getattr(retry, name)
        if current == DEFAULT[name] and (total is None or total > current):
            changes[name] = total
    return retry.replace(**changes) if changes else retry


OnError = Literal["raise", "skip"]
"""What a call does with an input the server cannot embed: ``"raise"`` its error, or
``"skip"`` it (``None`` in its slot, the error reported with its index)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EmbeddingConfig(Replaceable):
    """Everything a client needs to embed through one endpoint.

    Keyword-only; frozen and hashable. A setting that is not given is read from its
    ``QWEN_EMBED_*`` environment variable (``ENV_SETTINGS``: each setting's variable is
    declared in ``_settings.SETTINGS``, with its default), then takes its default.

    Attributes:
        base_url: the OpenAI-compatible API root, e.g. ``http://gpu-box:30000/v1``
            (requests go to ``{base_url}/embeddings``), or a list of replica URLs (each
            batch goes to the replica with the fewest requests in flight). Required;
            never defaults to a public API. A list is stored sorted (equal lists in any
            order share pools).
        api_key: bearer token (``str`` or ``Secret``), a callable returning it (sync
            ``Callable[[], str]`` or async ``Callable[[], Awaitable[str]]``, called for
            each request: a rotating token; held as a ``KeyFunction``), or ``None`` for
            servers without auth. Hidden from ``repr``, logs, errors and pickles (see
            ``Secret`` for what an unpickled copy uses).
        model: the model name sent in every request (default
            ``Qwen/Qwen3-Embedding-0.6B``).
        dimensions: MRL output size in dimensions (``None`` = the model's full size).
            For Qwen3-Embedding: 32..1024 (0.6B), ..2560 (4B), ..4096 (8B). Sent to the
            server when it supports it (never when it equals the model's full size);
            otherwise vectors are sliced client-side and L2-renormalised.
        query_instruction: the retrieval task put before queries as
            ``Instruct: {task}\\nQuery:{text}``; documents are sent raw. ``None``: queries
            are sent raw too. ``"auto"`` (default): ``DEFAULT_QUERY_TASK`` for a model
            whose name identifies Qwen3-Embedding (``is_qwen3_embedding``: hub names,
            server paths, Ollama tags), raw queries for any other model; the choice is
            logged once per model (INFO). The resolved value is ``query_task``.
        batch_size: texts per request (1..2048), or ``"auto"`` (the default): starting
            at 32 (at 256 for a call longer than one wave of 256-text batches to a
            replica not measured yet), each replica's batch size grows while a batch
            twice as large answers in about the same time (latency flat in batch size),
            and stops at the knee where latency grows with the batch
            (``_batching.BatchSizer``); 413/422/429/503 and token caps make it back off.
            Either way lowered automatically to a server's stated limit.
        max_batch_tokens: most (estimated) tokens per request (default ``None``: the
            server's known cap, else learned from its refusal). Tokens are estimated
            without a tokenizer (UTF-8 bytes / 4).
        max_concurrency: requests in flight at once per call, 1..1024 (default 4).
            ``"auto"`` was removed: it raises ``ConfigError``.
        encoding_format: ``"auto"`` (base64, falling back to float once per endpoint if
            refused or broken), ``"base64"`` or ``"float"``.
        normalize: L2-renormalise vectors whose norm is not 1 (e.g. after a server
            slices MRL dimensions without renormalising). Default ``True``.
        max_text_chars: longest accepted text in characters (default 262,144; ``None``
            = no limit). Longer texts raise ``InputError`` before anything is sent.
        append_eos: append ``<|endoftext|>`` to every text client-side. Qwen3-Embedding
            pools the last token, which must be that token; servers that tokenise
            without it (some llama.cpp builds) give degraded vectors. ``None`` (default)
            = check once on llama.cpp endpoints and warn.
        max_response_bytes: largest response body accepted, in bytes, counted both as
            received and decompressed (default ``None``: derived per request from the
            texts sent and the vector size, well above the largest legal answer).
        timeout: seconds: one number for every phase and the exchange in all, ``None``
            (no limit), ``httpx.Timeout(...)``, a ``(connect, read)`` tuple, or a
            ``Timeouts`` (``timeouts_of``). A call deadline left at its default is
            raised to the exchange's total when that is longer, so no default cuts a
            ``timeout`` short.
        limits: the endpoint's pool ``Limits`` (connections, keep-alive seconds).
        http2: negotiate HTTP/2 (ALPN over TLS; prior-knowledge h2c over ``http://``,
            falling back to HTTP/1.1 when the server does not speak it).
        verify: TLS verification: ``True`` (CAs from certifi), ``False``, or the path of
            a CA bundle (PEM).
        proxy: an HTTP proxy URL for this endpoint (``http://host:port``, or
            ``http://user:password@host:port``: then held as a ``ProxyURL``, shown
            redacted and never pickled), ``None`` for none; not given: from
            ``QWEN_EMBED_PROXY``, else ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` and
            ``NO_PROXY`` when ``trust_env``, as httpx does. Loopback hosts are never
            proxied.
        trust_env: read proxies from the environment (default ``True``).
        insecure_key: what to do when an API key is about to go over plain ``http://``
            to a host that is not loopback: ``"warn"`` (default: one WARNING per
            endpoint), ``"error"`` (``ConfigError``) or ``"allow"``.
        retry: the ``RetryConfig``.
        hedge: send a second copy of a slow ``embed_query`` request after the
            endpoint's observed 95th-percentile latency and keep the first answer
            (extra load capped at 5% of requests). Default ``False``.
        server: the server behind ``base_url``: ``"auto"`` (default: identified from its
            answers, see ``qwen_embed_plugins._servers``) or one of ``SERVER_NAMES``;
            naming it sets its known limits at once.
        headers: extra HTTP headers sent with every request (a gateway's credential, a
            tenant header), or ``None``. Per request: they never split the pool.
            ``Content-Type``, ``Accept``, ``Content-Length``, ``Host`` and the other
            headers the client sets are refused, and so is ``Authorization`` together
            with ``api_key`` (without one, an ``Authorization`` header is sent as given,
            e.g. ``Basic ...``). Values of credential-like headers (``is_secret_header``:
            ``Authorization``, ``Cookie``, names with ``auth``, ``key`` such as
            ``Ocp-Apim-Subscription-Key``, ``token``, ``secret``, ``password``, ...) are
            hidden from ``repr``, logs and errors and never pickled.
            Stored as ``RequestHeaders``.
        extra_body: extra JSON fields merged into every request body (vLLM's
            ``truncate_prompt_tokens``, TEI's ``truncate``, Ollama's ``options``), or
            ``None``. ``input``, ``model``, ``encoding_format`` and ``dimensions`` are
            the client's own and refused, except ``encoding_format`` or ``dimensions``
            set to ``None``: that field is never sent (float vectors; ``dimensions``
            applied client-side). Values under credential-like field names
            (``is_secret_field``: ``api_key``, ``access_token``, ``password``, ... at any
            depth) are hidden from ``repr``, logs and errors and never pickled.
            Stored as ``RequestBody``.
    """

    base_url: str | tuple[str, ...] | list[str] | None = None
    api_key: str | Secret | KeyFunction | Callable[[], Any] | NotGiven | None = NOT_GIVEN
    model: str | None = None
    # Not given (NOT_GIVEN): read from the environment in __post_init__; the declared
    # types are what the fields hold after it.
    dimensions: int | None = NOT_GIVEN  # type: ignore[assignment]
    query_instruction: str | None = DEFAULT["query_instruction"]
    batch_size: int | Literal["auto"] = NOT_GIVEN  # type: ignore[assignment]
    max_batch_tokens: int | None = NOT_GIVEN  # type: ignore[assignment]
    max_concurrency: int = NOT_GIVEN  # type: ignore[assignment]
    encoding_format: EncodingFormat = DEFAULT["encoding_format"]
    normalize: bool = DEFAULT["normalize"]
    max_text_chars: int | None = DEFAULT["max_text_chars"]
    append_eos: bool | None = DEFAULT["append_eos"]
    max_response_bytes: int | None = None
    timeout: Timeouts | TimeoutArg = field(default_factory=Timeouts)
    limits: Limits = field(default_factory=Limits)
    http2: bool = NOT_GIVEN  # type: ignore[assignment]
    verify: bool | str = DEFAULT["verify"]
    proxy: str | ProxyURL | NotGiven | None = NOT_GIVEN
    trust_env: bool = DEFAULT["trust_env"]
    insecure_key: Literal["warn", "error", "allow"] = DEFAULT["insecure_key"]
    retry: RetryConfig = field(default_factory=RetryConfig)
    hedge: bool = DEFAULT["hedge"]
    server: str = NOT_GIVEN  # type: ignore[assignment]
    headers: Mapping[str, str] | None = DEFAULT["headers"]
    extra_body: Mapping[str, Any] | None = DEFAULT["extra_body"]

    def __post_init__(self) -> None:
        self._resolve()
        self._check_numbers()
        self._check_dimensions()
        self._check_choices()
        self._check_proxy()

    def _resolve(self) -> None:
        """Fill the settings not given from the environment (``env_setting``) and the
        defaults, in their checked forms (a ``Secret`` key as ``str``, a proxy URL with
        credentials as ``ProxyURL``, a number of seconds as ``Timeouts``)."""
        set_ = object.__setattr__
        base_url = self.base_url if self.base_url is not None else env_setting("base_url")
        if not base_url:
            _openai_variables_not_read()
        set_(self, "base_url", normalise_base_url(base_url))
        api_key = _resolved_api_key(self.api_key)
        set_(self, "api_key", api_key)
        set_(self, "headers", request_headers(self.headers, api_key=api_key is not None))
        set_(self, "extra_body", request_body(self.extra_body))
        model = self.model or env_setting("model")  # else the declared default
        if not isinstance(model, str):
            raise ConfigError(f"model must be a str, got {type(model).__name__}")
        set_(self, "model", model)
        for name in _FROM_ENV:
            value = getattr(self, name)
            set_(self, name, env_setting(name) if isinstance(value, NotGiven) else value)
        proxy = self.proxy
        if isinstance(proxy, NotGiven):
            proxy = env_setting("proxy", NOT_GIVEN)
        if isinstance(proxy, str) and has_credentials(proxy):
            proxy = ProxyURL(proxy)  # a secret from here on: never shown in clear
        set_(self, "proxy", proxy)
        timeout = timeouts_of(self.timeout)
        set_(self, "timeout", timeout)
        set_(self, "retry", _deadlines_cover(self.retry, timeout))
        if not isinstance(self.limits, Limits):
            raise ConfigError("limits must be a Limits")
        if not isinstance(self.retry, RetryConfig):
            raise ConfigError("retry must be a RetryConfig")

    def _check_numbers(self) -> None:
        """Integer settings within their ranges (``ConfigError`` naming the setting)."""
        if self.batch_size != "auto":
            check_int("EmbeddingConfig", "batch_size", self.batch_size, 1, 2048)
        if self.max_batch_tokens is not None:
            check_int("EmbeddingConfig", "max_batch_tokens", self.max_batch_tokens, 1, 1 << 30)
        if is_removed_concurrency(self.max_concurrency):
            raise ConfigError(CONCURRENCY_AUTO_REMOVED)
        check_int("EmbeddingConfig", "max_concurrency", self.max_concurrency, 1, 1024)
        if self.encoding_format not in ("auto", "base64", "float"):
            raise ConfigError(
                "EmbeddingConfig.encoding_format must be 'auto', 'base64' or 'float', "
                f"got {self.encoding_format!r}"
            )
        if self.max_text_chars is not None:
            check_int("EmbeddingConfig", "max_text_chars", self.max_text_chars, 1, 1 << 31)
        if self.max_response_bytes is not None:
            check_int(
                "EmbeddingConfig", "max_response_bytes", self.max_response_bytes, 1024, 1 << 40
            )

    def _check_dimensions(self) -> None:
        """``dimensions`` within what the model has (Qwen3: 32 up to its full size)."""
        if self.dimensions is None:
            return
        model = str(self.model)
        full = known_model_dims(model)
        low, high = (QWEN3_MIN_DIMENSIONS, full) if full else (1, 65_536)
        if (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or not (low <= self.dimensions <= high)
        ):
            where = f" for {model}" if full else ""
            raise ConfigError(
                f"EmbeddingConfig.dimensions must be an integer in [{low}, {high}]{where}, "
                f"got {self.dimensions!r}"
            )

    def _check_choices(self) -> None:
        """``server``, ``query_instruction``, ``verify`` and ``insecure_key``."""
        if self.server != "auto" and self.server not in SERVER_NAMES:
            raise ConfigError(
                f"EmbeddingConfig.server must be 'auto' or one of {', '.join(SERVER_NAMES)}, "
                f"got {self.server!r}"
            )
        if self.query_instruction is not None and not isinstance(self.query_instruction, str):
            raise ConfigError("query_instruction must be a str, 'auto' or None")
        if self.query_instruction == "auto":
            default_query_instruction(str(self.model))  # logs the choice (once per model)
        if not isinstance(self.verify, bool | str):
            raise ConfigError("verify must be True, False or a CA bundle path")
        if isinstance(self.verify, str) and not os.path.exists(self.verify):
            raise ConfigError(f"verify: CA bundle file not found: {self.verify}")
        if self.insecure_key not in ("warn", "error", "allow"):
            raise ConfigError("insecure_key must be 'warn', 'error' or 'allow'")

    def _check_proxy(self) -> None:
        """An http(s) proxy URL with a host and a valid port (or none); no key over
        plain HTTP with ``insecure_key='error'``."""
        proxy = self.proxy
        if isinstance(proxy, ProxyURL):
            proxy = proxy.get_secret_value()
        if proxy is not None and not isinstance(proxy, NotGiven):
            if not isinstance(proxy, str) or not _is_proxy_url(proxy):
                shown = endpoint_label(proxy) if isinstance(proxy, str) else type(proxy).__name__
                raise ConfigError(
                    f"proxy must be an http:// or https:// proxy URL with a host or None, "
                    f"got {shown!r}"
                )
            check_url_port(proxy, "proxy")
        if self.api_key is not None and self.insecure_key == "error":
            for url in self.replicas:
                if insecure_key_target(url):
                    raise ConfigError(
                        f"the API key would be sent over plain HTTP to {endpoint_label(url)}, "
                        "which is not a loopback address (insecure_key='error'); use https://"
                    )

    # --------------------------------------------------------------- derived views

    @property
    def replicas(self) -> tuple[str, ...]:
        """The base URL of every replica (one for a single server), sorted."""
        base = self.base_url
        if base is None:  # cannot happen
            raise RuntimeError("internal error: base is None")
        return (base,) if isinstance(base, str) else tuple(base)

    def proxy_for(self, url: str) -> str | None:
        """The proxy URL to reach replica ``url`` through (``None``: connect directly)."""
        if is_loopback(url):
            return None
        proxy = self.proxy
        if isinstance(proxy, ProxyURL):
            return proxy.get_secret_value()
        if not isinstance(proxy, NotGiven):
            return proxy
        return environment_proxy(url) if self.trust_env else None

    def pool_key_for(self, url: str) -> PoolKey:
        """The pool key of replica ``url`` (see ``PoolKey``)."""
        return PoolKey(
            base_url=url,
            limits=self.limits,
            http2=bool(self.http2),
            verify=self.verify,
            proxy=self.proxy_for(url),
        )

    @property
    def pool_key(self) -> PoolKey:
        """The pool key of the first (or only) replica."""
        return self.pool_key_for(self.replicas[0])

    @property
    def embeddings_url(self) -> str:
        """``{base_url}/embeddings`` of the first (or only) replica."""
        return f"{self.replicas[0]}/embeddings"

    @property
    def endpoint(self) -> str:
        """The endpoint label for messages and metrics (no credentials); replicas are
        comma-separated."""
        return ",".join(endpoint_label(url) for url in self.replicas)

    @property
    def query_task(self) -> str | None:
        """The instruction queries get (``query_instruction`` with ``"auto"`` resolved
        for ``model``: see ``default_query_instruction``); ``None``: queries are raw."""
        if self.query_instruction == "auto":
            return default_query_instruction(self.model or "")
        return self.query_instruction

    @property
    def timeouts(self) -> Timeouts:
        """``timeout`` as a ``Timeouts``."""
        timeout = self.timeout
        if not isinstance(timeout, Timeouts):  # __post_init__ made it one
            raise TypeError("timeout is not a Timeouts")
        return timeout

    def api_key_value(self) -> str | None:
        """The API key as a plain string, or ``None`` (none, or a callable key: see
        ``key_function``)."""
        return self.api_key.get_secret_value() if isinstance(self.api_key, Secret) else None

    @property
    def key_function(self) -> KeyFunction | None:
        """The key callable (``api_key=<callable>``, called for each request), or
        ``None`` for a fixed key or none."""
        return self.api_key if isinstance(self.api_key, KeyFunction) else None

    @classmethod
    def from_env(cls, **overrides: Any) -> EmbeddingConfig:
        """A config from ``QWEN_EMBED_*`` environment variables, with ``overrides``
        (the same as ``EmbeddingConfig(**overrides)``: every setting not given is read
        from the environment).

        Raises:
            ConfigError: a variable holds a value out of range.
        """
        return cls(**overrides)
