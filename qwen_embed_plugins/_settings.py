"""Every flat setting, declared once: name, type, default, environment variable, one doc
line, CLI flag, and where the core ``EmbeddingConfig`` holds it.

``SETTINGS`` is the one source. From it come: the defaults of ``EmbeddingConfig`` and of
its parts (``Timeouts``, ``Limits``, ``RetryConfig``) and which settings it reads from
the environment (``_config``); the flat keywords of the core clients and of Ray's
``embed_dataset`` (``_flat.config_from``); the pydantic fields of both framework
adapters (``integrations._common``); the ``qwen-embed`` options of the settings that
have a flag (``cli._options``); and the parameter tables of the docs
(``qwen_embed_tooling.settings_docs``). ``tests/test_settings.py`` checks that every
surface exposes exactly these settings.

This module imports the standard library only, so ``qwen-embed --help`` may read it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = [
    "DEFAULT",
    "DEFAULT_MODEL",
    "SETTING",
    "SETTINGS",
    "STOCK_NAMES",
    "Setting",
    "closest",
]

DEFAULT_MODEL: Final = "Qwen/Qwen3-Embedding-0.6B"


def _env_bool(raw: str) -> bool:
    return raw.strip().lower() in ("1", "true", "yes", "on")


def _env_int_or_auto(raw: str) -> int | str:
    raw = raw.strip().lower()
    return raw if raw == "auto" else int(raw)


def _env_lower(raw: str) -> str:
    return raw.strip().lower()


@dataclass(frozen=True, slots=True)
class Setting:
    """One flat setting.

    Attributes:
        name: the keyword (core clients, adapters, Ray) and the field name.
        type: the type a flat value has (a typing form; the adapters' fields and the
            docs' tables show it).
        default: the value when neither given nor in the environment.
        doc: what it means, with its unit (the adapters' field description, the docs'
            table, the start of the CLI option's help).
        env: the ``QWEN_EMBED_*`` variable read when it is not given, or ``None``.
        parse: how that variable's text becomes a value (``str`` when ``None``).
        cli: the ``qwen-embed`` option that sets it, or ``None``.
        into: where ``EmbeddingConfig`` holds it: ``"part.attribute"`` (``"timeout.read"``)
            for an attribute of one of its parts, ``""`` for its own field of this name.
    """

    name: str
    type: Any
    default: Any
    doc: str
    env: str | None = None
    parse: Callable[[str], Any] | None = None
    cli: str | None = None
    into: str = ""

    @property
    def part(self) -> str | None:
        """The ``EmbeddingConfig`` field holding this setting's part, or ``None``."""
        return self.into.partition(".")[0] or None

    @property
    def attribute(self) -> str:
        """The attribute of ``part`` (or of the config) that holds it."""
        return self.into.partition(".")[2] or self.name


SETTINGS: Final[tuple[Setting, ...]] = (
    # ------------------------------------------------------------------ endpoint
    Setting(
        "base_url",
        str | list[str] | None,
        None,
        "The OpenAI-compatible API root, e.g. 'http://gpu-box:30000/v1' (requests go to "
        "'{base_url}/embeddings'), or a list of replica URLs (comma-separated in the "
        "environment). Required: there is no default endpoint.",
        env="QWEN_EMBED_BASE_URL",
        cli="--base-url",
    ),
    Setting(
        "api_key",
        str | None,
        None,
        "Bearer token, or (in code) a callable returning it, called for each request (a "
        "rotating token; an async one serves the async methods only); None for servers "
        "without auth. Never shown, logged, serialised or pickled.",
        env="QWEN_EMBED_API_KEY",
        cli="--api-key",
    ),
    Setting(
        "model",
        str,
        DEFAULT_MODEL,
        "Model name sent in every request.",
        env="QWEN_EMBED_MODEL",
        cli="--model",
    ),
    # ------------------------------------------------------------------ embedding
    Setting(
        "dimensions",
        int | None,
        None,
        "MRL output size in dimensions (None = the model's full size; Qwen3-Embedding: "
        "32..1024 for 0.6B, ..2560 for 4B, ..4096 for 8B). Sent when the server supports "
        "it, else sliced and L2-renormalised client-side.",
        env="QWEN_EMBED_DIMENSIONS",
        parse=int,
        cli="--dimensions",
    ),
    Setting(
        "query_instruction",
        str | None,
        "auto",
        "Task put before queries as 'Instruct: {task}\\nQuery:{text}'; documents are sent "
        "raw. None: queries are sent raw too. 'auto' (default): 'Given a web search query, "
        "retrieve relevant passages that answer the query' for a model whose name "
        "identifies Qwen3-Embedding (hub names, server paths, Ollama tags such as "
        "'qwen3-embedding:8b'), raw queries for any other model.",
    ),
    Setting(
        "batch_size",
        int | Literal["auto"],
        "auto",
        "Texts per request (1..2048), or 'auto' (default): from 32, grown while a batch "
        "twice as large answers in about the same time, stopped where latency grows with "
        "the batch. Lowered automatically to a server's stated limit.",
        env="QWEN_EMBED_BATCH_SIZE",
        parse=_env_int_or_auto,
        cli="--batch-size",
    ),
    Setting(
        "max_batch_tokens",
        int | None,
        None,
        "Most estimated tokens per request (None: the server's known cap, else learned "
        "from its refusal).",
        env="QWEN_EMBED_MAX_BATCH_TOKENS",
        parse=int,
    ),
    Setting(
        "max_concurrency",
        int,
        4,
        "Requests in flight at once per call (1..1024; default 4). 'auto' was removed: it "
        "raises ConfigError.",
        env="QWEN_EMBED_MAX_CONCURRENCY",
        # "auto" passes through, so that the core's check says it was removed
        parse=_env_int_or_auto,
    ),
    Setting(
        "encoding_format",
        Literal["auto", "base64", "float"],
        "auto",
        "'auto' (base64, falling back to float once per endpoint if refused), 'base64' or 'float'.",
    ),
    Setting("normalize", bool, True, "L2-renormalise vectors whose norm is not 1 (default True)."),
    Setting(
        "max_text_chars",
        int | None,
        262_144,
        "Longest accepted text in characters (default 262,144; None = no limit); longer "
        "texts raise InputError before anything is sent.",
    ),
    Setting(
        "append_eos",
        bool | None,
        None,
        "Append <|endoftext|> to every text client-side (None: check once on llama.cpp "
        "endpoints and warn).",
    ),
    # ------------------------------------------------------------------ timeouts and retries
    Setting(
        "connect_timeout",
        float | None,
        5.0,
        "Seconds to open a TCP (+TLS) connection (default 5.0; None = no limit).",
        into="timeout.connect",
    ),
    Setting(
        "read_timeout",
        float | None,
        60.0,
        "Seconds to wait for response bytes (default 60.0; None = no limit).",
        into="timeout.read",
    ),
    Setting(
        "write_timeout",
        float | None,
        30.0,
        "Seconds to send a request body (default 30.0; None = no limit).",
        into="timeout.write",
    ),
    Setting(
        "pool_timeout",
        float | None,
        60.0,
        "Seconds to wait for a free pooled connection (default 60.0; None = no limit).",
        into="timeout.pool",
    ),
    Setting(
        "total_timeout",
        float | None,
        120.0,
        "Seconds one HTTP exchange may take in all (default 120.0; bounds a body that "
        "trickles in).",
        into="timeout.total",
    ),
    Setting(
        "max_retries",
        int | None,
        None,
        "Retries per request after its first attempt, whatever the cause, outages "
        "included (0 = never retry). None (default): 3 retries for failures that are not "
        "outages; outages (refused connections, 429, 502-504) are retried until the "
        "deadline, one probe at a time.",
        into="retry.max_retries",
    ),
    Setting(
        "deadline",
        float | None,
        300.0,
        "Seconds one bulk call may take in all, retries included (default 300.0; None = "
        "no deadline).",
        cli="--deadline",
        into="retry.deadline",
    ),
    Setting(
        "query_deadline",
        float | None,
        15.0,
        "The same for a single query (default 15.0).",
        into="retry.query_deadline",
    ),
    # ------------------------------------------------------------------ pool
    Setting(
        "max_connections",
        int,
        20,
        "Most TCP connections per pool (default 20): the sync pool is process-wide, each "
        "event loop has its own async pool.",
        into="limits.max_connections",
    ),
    Setting(
        "max_keepalive_connections",
        int | None,
        None,
        "Most idle connections kept for reuse (default None = max_connections).",
        into="limits.max_keepalive_connections",
    ),
    Setting(
        "keepalive_expiry",
        float,
        4.0,
        "Seconds an idle connection is kept (default 4.0); keep it below the server's idle "
        "timeout (5 s for uvicorn-based servers and llama.cpp).",
        into="limits.keepalive_expiry",
    ),
    Setting(
        "max_connections_per_process",
        int | None,
        None,
        "Most requests in flight to the endpoint from the whole process, over every pool "
        "and event loop (default None: no process-wide cap).",
        into="limits.max_connections_per_process",
    ),
    # ------------------------------------------------------------------ transport
    Setting(
        "http2",
        bool,
        False,
        "Negotiate HTTP/2 (ALPN over TLS; h2c over http://, falling back to HTTP/1.1).",
        env="QWEN_EMBED_HTTP2",
        parse=_env_bool,
        cli="--http2",
    ),
    Setting(
        "verify",
        bool | str,
        True,
        "TLS verification: True (CAs from certifi), False, or a CA bundle path.",
    ),
    Setting(
        "proxy",
        str | None,
        None,
        "HTTP proxy URL for the endpoint; credentials in it (http://user:password@host:port) "
        "are never shown, dumped or pickled (the URL shows as http://user:***@host:port; an "
        "unpickled copy reads QWEN_EMBED_PROXY or HTTP(S)_PROXY). None (default): from "
        "QWEN_EMBED_PROXY, else HTTP(S)_PROXY / ALL_PROXY / NO_PROXY when trust_env. "
        "Loopback hosts are never proxied.",
        env="QWEN_EMBED_PROXY",
    ),
    Setting("trust_env", bool, True, "Read proxies from the environment (default True)."),
    Setting(
        "insecure_key",
        Literal["warn", "error", "allow"],
        "warn",
        "An API key over plain http:// to a non-loopback host: 'warn' (default), 'error' "
        "or 'allow'.",
    ),
    Setting(
        "hedge",
        bool,
        False,
        "Hedge single queries: a second copy after the p95 latency of the endpoint's "
        "single-text requests (bulk batches apart), first answer wins, at most 5% extra "
        "requests (default False).",
    ),
    Setting(
        "server",
        str,
        "auto",
        "The server behind base_url: 'auto' (identified from its answers) or 'sglang', "
        "'vllm', 'tei', 'infinity', 'ollama', 'llamacpp', 'dashscope', 'siliconflow', "
        "'openai'.",
        env="QWEN_EMBED_SERVER",
        parse=_env_lower,
    ),
    # ------------------------------------------------------------------ per request
    Setting(
        "headers",
        Mapping[str, str] | None,
        None,
        "Extra HTTP headers sent with every request (a gateway credential, a tenant "
        "header); per request, they never split the pool. Content-Type, Accept, Host and "
        "the other headers the client sets are refused, and Authorization with api_key. "
        "Values of credential-like headers (Authorization, Proxy-Authorization, Cookie, "
        "*auth*, *key* such as X-Api-Key, Ocp-Apim-Subscription-Key or x-functions-key, "
        "*token*, *secret*, *session*) are masked in repr, dumps, logs and errors and "
        "never pickled.",
    ),
    Setting(
        "extra_body",
        Mapping[str, Any] | None,
        None,
        "Extra JSON fields merged into every request body (vLLM truncate_prompt_tokens, "
        "TEI truncate, Ollama options/keep_alive); input, model, encoding_format and "
        "dimensions are the client's own and refused, but encoding_format or dimensions "
        "set to None is never sent (float vectors; dimensions applied client-side). "
        "Values of credential-like fields (api_key, access_token, password, *secret*, ... "
        "at any depth) are masked in repr and dumps and never pickled.",
    ),
)

SETTING: Final[Mapping[str, Setting]] = {setting.name: setting for setting in SETTINGS}
"""``SETTINGS`` by name."""

DEFAULT: Final[Mapping[str, Any]] = {setting.name: setting.default for setting in SETTINGS}
"""Every setting's default, by name."""

STOCK_NAMES: Final[Mapping[str, str]] = {
    "api_base": "base_url",
    "openai_api_base": "base_url",
    "openai_api_key": "api_key",
    "model_name": "model",
    "chunk_size": "batch_size",
    "embed_batch_size": "batch_size",
    "request_timeout": "timeout",
    "default_headers": "headers",
    "extra_headers": "headers",
    "model_kwargs": "extra_body",
    "additional_kwargs": "extra_body",
    "openai_proxy": "proxy",
    "user": "extra_body",
}
"""Names other embedding clients (openai, LangChain, LlamaIndex) use, and the setting
that does their job here: what an unknown-name error suggests."""


def closest(name: str, known: Iterable[str]) -> str | None:
    """The accepted name ``name`` most likely meant (``STOCK_NAMES`` first, then the
    nearest spelling), or ``None``."""
    names = sorted(known)
    if STOCK_NAMES.get(name) in names:
        return STOCK_NAMES[name]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return close[0] if close else None
