"""Frozen, hashable settings: endpoint, limits, timeouts, retry, batching.

Every settings object here is an immutable, keyword-only dataclass. Equal settings hash
equally, so the transport part of an ``EmbeddingConfig`` (its ``pool_key``) is the key
of the process-wide connection pool: every client and adapter built with equal transport
settings shares one pool, whatever its batching or model settings.

Units: every duration is in seconds, every size in texts or connections, as named.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar
from urllib.parse import urlsplit

from .errors import ConfigError, endpoint_label

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_QUERY_TASK",
    "NOT_GIVEN",
    "QWEN3_EMBEDDING_DIMS",
    "SERVER_NAMES",
    "EmbeddingConfig",
    "EncodingFormat",
    "Limits",
    "NotGiven",
    "RetryConfig",
    "Secret",
    "Timeouts",
    "TransportKey",
]

DEFAULT_QUERY_TASK: Final = (
    "Given a web search query, retrieve relevant passages that answer the query"
)
"""Qwen3-Embedding's default retrieval task (source: the Qwen3-Embedding model card and
its ``config_sentence_transformers.json`` query prompt)."""

DEFAULT_MODEL: Final = "Qwen/Qwen3-Embedding-0.6B"

QWEN3_EMBEDDING_DIMS: Final[dict[str, int]] = {
    "qwen3-embedding-0.6b": 1024,
    "qwen3-embedding-4b": 2560,
    "qwen3-embedding-8b": 4096,
}
"""Full vector size per Qwen3-Embedding model (source: the model cards). MRL allows any
``dimensions`` from 32 up to this size."""

QWEN3_MIN_DIMENSIONS: Final = 32

EncodingFormat = Literal["auto", "base64", "float"]

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
"""Servers with a profile (``qwen_embed_plugins.servers``); ``"openai"`` is the generic
OpenAI-compatible fallback. ``EmbeddingConfig(server=...)`` takes one of these or
``"auto"``."""

ENV_BASE_URL: Final = "QWEN_EMBED_BASE_URL"
ENV_API_KEY: Final = "QWEN_EMBED_API_KEY"
ENV_MODEL: Final = "QWEN_EMBED_MODEL"


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


class Secret:
    """A secret string (the API key) that never shows itself.

    ``repr`` and ``str`` print ``'**********'``. Pickling does NOT carry the value: an
    unpickled ``Secret`` re-reads ``QWEN_EMBED_API_KEY`` from the environment of the
    process it lands in (worker processes inherit it), so a pickle file never holds a key.
    """

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def get_secret_value(self) -> str:
        """The secret itself. Call only where it is sent (the Authorization header)."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('**********')"

    def __str__(self) -> str:
        return "**********"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(("Secret", self._value))

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_secret_from_env, ())

    # copy/deepcopy stay in the process: keep the value (without these, deepcopy would
    # go through __reduce__ and silently swap an explicit key for the environment's).
    def __copy__(self) -> Secret:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Secret:
        return self


def _secret_from_env() -> Secret | None:
    value = os.environ.get(ENV_API_KEY)
    return Secret(value) if value else None


def _check_range(
    owner: str, name: str, value: float | None, low: float, high: float, *, allow_none: bool
) -> None:
    if value is None:
        if not allow_none:
            raise ConfigError(f"{owner}.{name} must be a number in [{low}, {high}], got None")
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{owner}.{name} must be a number in [{low}, {high}], got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"{owner}.{name} must be in [{low}, {high}], got {value!r}")


def _check_int(owner: str, name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{owner}.{name} must be an integer in [{low}, {high}], got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"{owner}.{name} must be in [{low}, {high}], got {value!r}")


_T = TypeVar("_T")


class _Replaceable:
    def replace(self: _T, **changes: Any) -> _T:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeouts(_Replaceable):
    """Timeouts in seconds; ``None`` disables one.

    Attributes:
        connect: TCP + TLS connection set-up (default 5.0 s).
        read: the longest wait for response bytes (default 60.0 s: a large batch on a
            busy GPU can take tens of seconds).
        write: sending the request body (default 30.0 s).
        pool: waiting for a free pooled connection (default 60.0 s).
    """

    connect: float | None = 5.0
    read: float | None = 60.0
    write: float | None = 30.0
    pool: float | None = 60.0

    def __post_init__(self) -> None:
        for name in ("connect", "read", "write", "pool"):
            _check_range("Timeouts", name, getattr(self, name), 0.001, 86400.0, allow_none=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits(_Replaceable):
    """Connection pool limits of one endpoint, shared by every client of the process.

    Attributes:
        max_connections: most TCP connections open at once (default 20 connections).
        max_keepalive_connections: most idle connections kept for reuse (default
            ``None`` = ``max_connections``).
        keepalive_expiry: seconds an idle connection is kept (default 4.0 s). Keep it
            BELOW the server's idle timeout: uvicorn-based servers (SGLang, vLLM,
            Infinity) and llama.cpp close idle connections after 5 s, and a client that
            reuses a socket the server just closed gets "Server disconnected without
            sending a response".
    """

    max_connections: int = 20
    max_keepalive_connections: int | None = None
    keepalive_expiry: float = 4.0

    def __post_init__(self) -> None:
        _check_int("Limits", "max_connections", self.max_connections, 1, 10_000)
        if self.max_keepalive_connections is not None:
            _check_int(
                "Limits",
                "max_keepalive_connections",
                self.max_keepalive_connections,
                0,
                self.max_connections,
            )
        _check_range(
            "Limits", "keepalive_expiry", self.keepalive_expiry, 0.0, 3600.0, allow_none=False
        )

    @property
    def keepalive_connections(self) -> int:
        """``max_keepalive_connections`` with its default applied (connections)."""
        if self.max_keepalive_connections is None:
            return self.max_connections
        return self.max_keepalive_connections


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryConfig(_Replaceable):
    """The one retry layer's policy (the openai SDK's own retries are always off).

    Attributes:
        max_attempts: attempts per request, the first included (default 4; 1 = never
            retry).
        backoff_initial: the first backoff cap in seconds (default 0.25 s); the cap
            doubles each attempt and the wait is drawn uniformly in [0, cap] (full jitter).
        backoff_max: the largest backoff cap in seconds (default 8.0 s).
        retry_after_max: the longest ``Retry-After`` honoured, in seconds (default 30 s);
            a longer one is cut to this.
        deadline: seconds one embedding call may spend on retries in all (default
            120 s; ``None`` = no deadline).
        circuit_failure_threshold: consecutive failed requests to an endpoint that open
            its circuit breaker (default 8; 0 disables the breaker).
        circuit_cooldown: seconds the breaker stays open before a probe (default 10 s).
    """

    max_attempts: int = 4
    backoff_initial: float = 0.25
    backoff_max: float = 8.0
    retry_after_max: float = 30.0
    deadline: float | None = 120.0
    circuit_failure_threshold: int = 8
    circuit_cooldown: float = 10.0

    def __post_init__(self) -> None:
        _check_int("RetryConfig", "max_attempts", self.max_attempts, 1, 100)
        _check_range(
            "RetryConfig", "backoff_initial", self.backoff_initial, 0.0, 600.0, allow_none=False
        )
        _check_range("RetryConfig", "backoff_max", self.backoff_max, 0.0, 3600.0, allow_none=False)
        _check_range(
            "RetryConfig", "retry_after_max", self.retry_after_max, 0.0, 3600.0, allow_none=False
        )
        _check_range("RetryConfig", "deadline", self.deadline, 0.001, 86400.0, allow_none=True)
        _check_int(
            "RetryConfig", "circuit_failure_threshold", self.circuit_failure_threshold, 0, 1_000_000
        )
        _check_range(
            "RetryConfig", "circuit_cooldown", self.circuit_cooldown, 0.0, 3600.0, allow_none=False
        )


@dataclass(frozen=True, slots=True)
class TransportKey:
    """The transport part of a config: the key of the process-wide pool.

    Two configs with equal ``TransportKey`` share connections. Its ``repr`` never shows
    the API key.
    """

    base_url: str
    api_key: Secret | None
    timeout: Timeouts
    limits: Limits
    http2: bool
    verify: bool | str

    @property
    def label(self) -> str:
        """The endpoint as shown in stats, logs and metrics (no credentials)."""
        return endpoint_label(self.base_url)


def _normalise_base_url(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            "base_url is required: pass base_url='http://host:port/v1' or set "
            f"{ENV_BASE_URL}; there is deliberately no default endpoint"
        )
    url = value.strip().rstrip("/")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ConfigError(f"base_url is not a valid URL: {endpoint_label(url)}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"base_url must be an http:// or https:// URL with a host, got {endpoint_label(url)!r}"
        )
    if parts.username or parts.password:
        raise ConfigError(
            "base_url must not contain credentials (user:password@); pass api_key instead"
        )
    if parts.query or parts.fragment:
        raise ConfigError("base_url must not contain a query string or fragment")
    if url.endswith("/embeddings"):
        url = url[: -len("/embeddings")]
    return url


def _checked_api_key(value: str) -> Secret | None:
    """Strip surrounding whitespace (a key read from a file ends with a newline) and refuse
    keys an HTTP header cannot carry. The message never shows the key."""
    value = value.strip()
    if not value:
        return None
    if not value.isascii() or not value.isprintable() or any(c.isspace() for c in value):
        raise ConfigError(
            "api_key contains whitespace, control or non-ASCII characters inside it, which "
            "an HTTP Authorization header cannot carry; check how the key was read"
        )
    return Secret(value)


def known_model_dims(model: str) -> int | None:
    """Full vector size of a known Qwen3-Embedding model name or path, else ``None``."""
    lowered = model.lower().rstrip("/")
    for name, dim in QWEN3_EMBEDDING_DIMS.items():
        if lowered.endswith(name) or lowered.endswith(name.replace("-", "_")):
            return dim
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class EmbeddingConfig(_Replaceable):
    """Everything a client needs to embed through one endpoint.

    Keyword-only; frozen and hashable. ``base_url`` and ``api_key`` fall back to the
    environment (``QWEN_EMBED_BASE_URL``, ``QWEN_EMBED_API_KEY``); ``model`` to
    ``QWEN_EMBED_MODEL`` then ``Qwen/Qwen3-Embedding-0.6B``.

    Attributes:
        base_url: the OpenAI-compatible API root, e.g. ``http://gpu-box:30000/v1``
            (requests go to ``{base_url}/embeddings``). Required; never defaults to a
            public API.
        api_key: bearer token (``str`` or ``Secret``), ``None`` for servers without
            auth. Hidden from ``repr``, logs, errors and pickles.
        model: the model name sent in every request.
        dimensions: MRL output size in dimensions (``None`` = the model's full size).
            For Qwen3-Embedding: 32..1024 (0.6B), ..2560 (4B), ..4096 (8B). Sent to the
            server when it supports it; otherwise vectors are sliced client-side and
            L2-renormalised.
        query_instruction: the retrieval task put before queries as
            ``Instruct: {task}\\nQuery:{text}``; documents are sent raw. ``None``
            disables it (for non-Qwen models).
        batch_size: texts per request (default 32; 1..2048). Lowered automatically to
            a server's stated limit.
        max_concurrency: requests in flight at once per call (default 4).
        encoding_format: ``"auto"`` (base64, falling back to float once per endpoint if
            refused), ``"base64"`` or ``"float"``.
        normalize: L2-renormalise vectors whose norm is not 1 (e.g. after a server
            slices MRL dimensions without renormalising). Default ``True``.
        max_text_chars: longest accepted text in characters (default 262,144; ``None``
            = no limit). Longer texts raise ``InputError`` before anything is sent.
        timeout: a ``Timeouts`` (seconds), or one number for all four.
        limits: the endpoint's pool ``Limits`` (connections, keep-alive seconds).
        http2: negotiate HTTP/2 (ALPN over TLS; prior-knowledge h2c over ``http://``,
            falling back to HTTP/1.1 when the server does not speak it).
        verify: TLS verification: ``True`` (system CAs via certifi), ``False``, or the
            path of a CA bundle (PEM).
        retry: the ``RetryConfig``.
        use_sdk: send embedding requests through the ``openai`` SDK (on the same pool)
            instead of the built-in codec. Slower; for comparison and SDK-only features.
        server: the server behind ``base_url``: ``"auto"`` (default: detected once per
            endpoint and process, see ``qwen_embed_plugins.servers``) or one of
            ``SERVER_NAMES`` (``"sglang"``, ``"vllm"``, ``"tei"``, ``"infinity"``,
            ``"ollama"``, ``"llamacpp"``, ``"dashscope"``, ``"siliconflow"``, or
            ``"openai"`` for a generic server); naming it skips detection. Env
            ``QWEN_EMBED_SERVER``.
    """

    base_url: str | None = None
    api_key: str | Secret | NotGiven | None = NOT_GIVEN
    model: str | None = None
    dimensions: int | None = None
    query_instruction: str | None = DEFAULT_QUERY_TASK
    batch_size: int = 32
    max_concurrency: int = 4
    encoding_format: EncodingFormat = "auto"
    normalize: bool = True
    max_text_chars: int | None = 262_144
    timeout: Timeouts | float | None = field(default_factory=Timeouts)
    limits: Limits = field(default_factory=Limits)
    http2: bool = False
    verify: bool | str = True
    retry: RetryConfig = field(default_factory=RetryConfig)
    use_sdk: bool = False
    server: str = "auto"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        base_url = self.base_url if self.base_url is not None else os.environ.get(ENV_BASE_URL)
        set_(self, "base_url", _normalise_base_url(base_url))
        api_key = self.api_key
        if isinstance(api_key, NotGiven):
            api_key = os.environ.get(ENV_API_KEY) or None
        if isinstance(api_key, Secret):
            api_key = api_key.get_secret_value()
        if isinstance(api_key, str):
            api_key = _checked_api_key(api_key)
        elif api_key is not None:
            raise ConfigError("api_key must be a str, a Secret or None")
        set_(self, "api_key", api_key)
        model = self.model or os.environ.get(ENV_MODEL) or DEFAULT_MODEL
        if not isinstance(model, str):
            raise ConfigError(f"model must be a str, got {type(model).__name__}")
        set_(self, "model", model)
        timeout = self.timeout
        if timeout is None or (isinstance(timeout, int | float) and not isinstance(timeout, bool)):
            timeout = Timeouts(connect=timeout, read=timeout, write=timeout, pool=timeout)
        if not isinstance(timeout, Timeouts):
            raise ConfigError("timeout must be a Timeouts, a number of seconds or None")
        set_(self, "timeout", timeout)
        if not isinstance(self.limits, Limits):
            raise ConfigError("limits must be a Limits")
        if not isinstance(self.retry, RetryConfig):
            raise ConfigError("retry must be a RetryConfig")
        _check_int("EmbeddingConfig", "batch_size", self.batch_size, 1, 2048)
        _check_int("EmbeddingConfig", "max_concurrency", self.max_concurrency, 1, 1024)
        if self.encoding_format not in ("auto", "base64", "float"):
            raise ConfigError(
                "EmbeddingConfig.encoding_format must be 'auto', 'base64' or 'float', "
                f"got {self.encoding_format!r}"
            )
        if self.max_text_chars is not None:
            _check_int("EmbeddingConfig", "max_text_chars", self.max_text_chars, 1, 1 << 31)
        if self.dimensions is not None:
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
        if self.server != "auto" and self.server not in SERVER_NAMES:
            raise ConfigError(
                f"EmbeddingConfig.server must be 'auto' or one of {', '.join(SERVER_NAMES)}, "
                f"got {self.server!r}"
            )
        if self.query_instruction is not None and not isinstance(self.query_instruction, str):
            raise ConfigError("query_instruction must be a str or None")
        if not isinstance(self.verify, bool | str):
            raise ConfigError("verify must be True, False or a CA bundle path")
        if isinstance(self.verify, str) and not os.path.exists(self.verify):
            raise ConfigError(f"verify: CA bundle file not found: {self.verify}")

    # --------------------------------------------------------------- derived views

    @property
    def pool_key(self) -> TransportKey:
        """The transport settings that select the shared pool."""
        assert isinstance(self.base_url, str)
        assert isinstance(self.timeout, Timeouts)
        assert not isinstance(self.api_key, str | NotGiven)
        return TransportKey(
            base_url=self.base_url,
            api_key=self.api_key,
            timeout=self.timeout,
            limits=self.limits,
            http2=self.http2,
            verify=self.verify,
        )

    @property
    def embeddings_url(self) -> str:
        """``{base_url}/embeddings``."""
        return f"{self.base_url}/embeddings"

    @property
    def endpoint(self) -> str:
        """The endpoint label for messages and metrics (no credentials)."""
        return endpoint_label(str(self.base_url))

    def api_key_value(self) -> str | None:
        """The API key as a plain string, or ``None``."""
        return self.api_key.get_secret_value() if isinstance(self.api_key, Secret) else None

    @classmethod
    def from_env(cls, **overrides: Any) -> EmbeddingConfig:
        """A config from ``QWEN_EMBED_*`` environment variables, with ``overrides``.

        Reads ``QWEN_EMBED_BASE_URL``, ``QWEN_EMBED_API_KEY``, ``QWEN_EMBED_MODEL``,
        ``QWEN_EMBED_DIMENSIONS``, ``QWEN_EMBED_BATCH_SIZE``,
        ``QWEN_EMBED_MAX_CONCURRENCY``, ``QWEN_EMBED_HTTP2`` (``1``/``true``) and
        ``QWEN_EMBED_SERVER``.

        Raises:
            ConfigError: a variable holds a value out of range.
        """
        values: dict[str, Any] = {}
        for name, conv in (
            ("dimensions", int),
            ("batch_size", int),
            ("max_concurrency", int),
        ):
            raw = os.environ.get(f"QWEN_EMBED_{name.upper()}")
            if raw:
                try:
                    values[name] = conv(raw)
                except ValueError as exc:
                    raise ConfigError(
                        f"QWEN_EMBED_{name.upper()} must be an integer, got {raw!r}"
                    ) from exc
        http2 = os.environ.get("QWEN_EMBED_HTTP2")
        if http2:
            values["http2"] = http2.strip().lower() in ("1", "true", "yes", "on")
        server = os.environ.get("QWEN_EMBED_SERVER")
        if server:
            values["server"] = server.strip().lower()
        values.update(overrides)
        return cls(**values)
