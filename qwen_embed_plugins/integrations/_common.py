"""The flat settings both framework adapters take, defined once.

LangChain and LlamaIndex users set plain fields (``max_connections=8``,
``read_timeout=30``), not nested objects; both adapters declare the same fields, with
the defaults and descriptions below, and build the core ``EmbeddingConfig`` with
``build_config``. A field not given takes its ``QWEN_EMBED_*`` environment variable
(the one resolver, ``config.env_setting``) or its default.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, Final

from pydantic import PlainSerializer, PlainValidator

from ..config import (
    DEFAULT_MODEL,
    DEFAULT_QUERY_TASK,
    NOT_GIVEN,
    EmbeddingConfig,
    Limits,
    RequestBody,
    RequestHeaders,
    RetryConfig,
    Timeouts,
    env_setting,
    request_body,
    request_headers,
)
from ..errors import ConfigError

__all__ = [
    "DESCRIPTIONS",
    "ExtraBodyField",
    "HeadersField",
    "Stock",
    "build_config",
    "coerce",
    "env_default",
    "resolve_names",
    "setting",
]

_T = Timeouts()
_L = Limits()
_R = RetryConfig()

DESCRIPTIONS: Final[dict[str, str]] = {
    "base_url": "The OpenAI-compatible API root, e.g. 'http://gpu-box:30000/v1' (requests go "
    "to '{base_url}/embeddings'), or a list of replica URLs. Default: env "
    "QWEN_EMBED_BASE_URL (comma-separated for replicas). Required.",
    "api_key": "Bearer token; None for servers without auth. Default: env QWEN_EMBED_API_KEY. "
    "Never shown, logged, serialised or pickled.",
    "model": f"Model name sent in every request. Default: env QWEN_EMBED_MODEL, then "
    f"{DEFAULT_MODEL!r}.",
    "dimensions": "MRL output size in dimensions (None = the model's full size; "
    "Qwen3-Embedding: 32..1024 for 0.6B, ..2560 for 4B, ..4096 for 8B). Sent when the "
    "server supports it, else sliced and L2-renormalised client-side.",
    "query_instruction": "Task put before queries as 'Instruct: {task}\\nQuery:{text}'; "
    "documents are sent raw. None disables it (non-Qwen models). Default: "
    f"{DEFAULT_QUERY_TASK!r}.",
    "batch_size": "Texts per request (1..2048; default 32, env QWEN_EMBED_BATCH_SIZE). "
    "Lowered automatically to a server's stated limit.",
    "max_batch_tokens": "Most estimated tokens per request (None: the server's known cap, "
    "else learned from its refusal).",
    "max_concurrency": "Requests in flight at once per call (1..1024; default 4), or 'auto' "
    "for an adaptive per-endpoint limit.",
    "encoding_format": "'auto' (base64, falling back to float once per endpoint if refused), "
    "'base64' or 'float'.",
    "normalize": "L2-renormalise vectors whose norm is not 1 (default True).",
    "max_text_chars": "Longest accepted text in characters (default 262,144; None = no "
    "limit); longer texts raise InputError before anything is sent.",
    "append_eos": "Append <|endoftext|> to every text client-side (None: check once on "
    "llama.cpp endpoints and warn).",
    "connect_timeout": f"Seconds to open a TCP (+TLS) connection (default {_T.connect}; "
    "None = no limit).",
    "read_timeout": f"Seconds to wait for response bytes (default {_T.read}; None = no limit).",
    "write_timeout": f"Seconds to send a request body (default {_T.write}; None = no limit).",
    "pool_timeout": f"Seconds to wait for a free pooled connection (default {_T.pool}; None "
    "= no limit).",
    "total_timeout": f"Seconds one HTTP exchange may take in all (default {_T.total}; bounds "
    "a body that trickles in).",
    "max_connections": f"Most TCP connections per pool (default {_L.max_connections}): the "
    "sync pool is process-wide, each event loop has its own async pool.",
    "max_keepalive_connections": "Most idle connections kept for reuse (default None = "
    "max_connections).",
    "keepalive_expiry": f"Seconds an idle connection is kept (default {_L.keepalive_expiry}); "
    "keep it below the server's idle timeout (5 s for uvicorn-based servers and llama.cpp).",
    "max_connections_per_process": "Most requests in flight to the endpoint from the whole "
    "process, over every pool and event loop (default None: no process-wide cap).",
    "max_retries": f"Retries after the first attempt for failures that are not outages "
    f"(default {_R.max_attempts - 1}); outages (refused connections, 429, 502-504) are "
    "retried until the deadline; 0 turns retries off entirely.",
    "deadline": f"Seconds one bulk call may take in all, retries included (default "
    f"{_R.deadline}; None = no deadline).",
    "query_deadline": f"The same for a single query (default {_R.query_deadline}).",
    "http2": "Negotiate HTTP/2 (ALPN over TLS; h2c over http://, falling back to HTTP/1.1).",
    "verify": "TLS verification: True (CAs from certifi), False, or a CA bundle path.",
    "proxy": "HTTP proxy URL for the endpoint; None (default): from HTTP(S)_PROXY / "
    "ALL_PROXY / NO_PROXY when trust_env. Loopback hosts are never proxied.",
    "trust_env": "Read proxies from the environment (default True).",
    "insecure_key": "An API key over plain http:// to a non-loopback host: 'warn' (default), "
    "'error' or 'allow'.",
    "hedge": "Hedge single queries: a second copy after the endpoint's p95 latency, first "
    "answer wins, at most 5% extra requests (default False).",
    "use_sdk": "Send requests through the openai SDK on the same pool (slower; for comparison).",
    "server": "The server behind base_url: 'auto' (identified from its answers) or 'sglang', "
    "'vllm', 'tei', 'infinity', 'ollama', 'llamacpp', 'dashscope', 'siliconflow', 'openai'.",
    "headers": "Extra HTTP headers sent with every request (a gateway credential, a tenant "
    "header); per request, they never split the pool. Content-Type, Accept, Host and the "
    "other headers the client sets are refused, and Authorization with api_key. Values of "
    "credential-like headers (Authorization, Cookie, *auth*, *api-key*, *token*, *secret*) "
    "are masked in repr and dumps and never pickled.",
    "extra_body": "Extra JSON fields merged into every request body (vLLM "
    "truncate_prompt_tokens, TEI truncate, Ollama options/keep_alive); input, model, "
    "encoding_format and dimensions are the client's own and refused.",
}
"""One description per flat setting, shared by both adapters' fields."""

_ENV_BACKED = {
    "base_url",
    "model",
    "dimensions",
    "batch_size",
    "max_batch_tokens",
    "max_concurrency",
    "http2",
    "server",
}
_DEFAULTS: Final[dict[str, Any]] = {
    "base_url": None,
    "model": DEFAULT_MODEL,
    "dimensions": None,
    "query_instruction": DEFAULT_QUERY_TASK,
    "batch_size": 32,
    "max_batch_tokens": None,
    "max_concurrency": 4,
    "encoding_format": "auto",
    "normalize": True,
    "max_text_chars": 262_144,
    "append_eos": None,
    "connect_timeout": _T.connect,
    "read_timeout": _T.read,
    "write_timeout": _T.write,
    "pool_timeout": _T.pool,
    "total_timeout": _T.total,
    "max_connections": _L.max_connections,
    "max_keepalive_connections": _L.max_keepalive_connections,
    "keepalive_expiry": _L.keepalive_expiry,
    "max_connections_per_process": _L.max_connections_per_process,
    "max_retries": _R.max_attempts - 1,
    "deadline": _R.deadline,
    "query_deadline": _R.query_deadline,
    "http2": False,
    "verify": True,
    "trust_env": True,
    "insecure_key": "warn",
    "hedge": False,
    "use_sdk": False,
    "server": "auto",
    "headers": None,
    "extra_body": None,
}


def env_default(name: str) -> Callable[[], Any]:
    """A default factory for field ``name``: its environment variable, else its default."""
    default = _DEFAULTS[name]
    if name not in _ENV_BACKED:
        return lambda: default
    if name == "base_url":

        def base_url() -> Any:
            value = env_setting("base_url")
            if isinstance(value, str) and "," in value:
                return [part.strip() for part in value.split(",") if part.strip()]
            return value

        return base_url
    return lambda: env_setting(name, default)


def setting(name: str) -> Any:
    """The pydantic ``Field`` of flat setting ``name``: its default (environment first)
    and description, the same in both adapters."""
    from pydantic import Field

    if name == "proxy":
        return Field(default=None, description=DESCRIPTIONS[name])
    return Field(default_factory=env_default(name), description=DESCRIPTIONS[name])


def build_config(values: Mapping[str, Any], *, api_key: str | None) -> EmbeddingConfig:
    """The core ``EmbeddingConfig`` of an adapter's flat field ``values``.

    Raises:
        ConfigError: a value is out of range (the message names the field).
    """
    proxy = values.get("proxy") or NOT_GIVEN  # None: from the environment (trust_env)
    base_url = values.get("base_url")
    if isinstance(base_url, list):
        base_url = tuple(base_url)
    return EmbeddingConfig(
        base_url=base_url,
        api_key=api_key,
        model=values["model"],
        dimensions=values["dimensions"],
        query_instruction=values["query_instruction"],
        batch_size=values["batch_size"],
        max_batch_tokens=values["max_batch_tokens"],
        max_concurrency=values["max_concurrency"],
        encoding_format=values["encoding_format"],
        normalize=values["normalize"],
        max_text_chars=values["max_text_chars"],
        append_eos=values["append_eos"],
        timeout=Timeouts(
            connect=values["connect_timeout"],
            read=values["read_timeout"],
            write=values["write_timeout"],
            pool=values["pool_timeout"],
            total=values["total_timeout"],
        ),
        limits=Limits(
            max_connections=values["max_connections"],
            max_keepalive_connections=values["max_keepalive_connections"],
            keepalive_expiry=values["keepalive_expiry"],
            max_connections_per_process=values["max_connections_per_process"],
        ),
        retry=RetryConfig(
            max_attempts=values["max_retries"] + 1,
            deadline=values["deadline"],
            query_deadline=values["query_deadline"],
        ),
        http2=values["http2"],
        verify=values["verify"],
        proxy=proxy,
        trust_env=values["trust_env"],
        insecure_key=values["insecure_key"],
        hedge=values["hedge"],
        use_sdk=values["use_sdk"],
        server=values["server"],
        headers=values.get("headers"),
        extra_body=values.get("extra_body"),
    )


# --------------------------------------------------------------------------- headers and body


def _headers_in(value: object) -> RequestHeaders | None:
    return request_headers(value)


def _body_in(value: object) -> RequestBody | None:
    return request_body(value)


def _headers_out(value: RequestHeaders | None) -> dict[str, str] | None:
    return None if value is None else value.masked()


def _body_out(value: RequestBody | None) -> dict[str, Any] | None:
    return None if value is None else dict(value)


def coerce(name: str, value: Any) -> Any:
    """``value`` of field ``name`` as stored: ``headers`` as ``RequestHeaders`` and
    ``extra_body`` as ``RequestBody`` (for assignment and ``model_copy(update=...)``,
    which skip validation), anything else unchanged.

    Raises:
        ConfigError: an invalid ``headers`` or ``extra_body``.
    """
    if name == "headers":
        return request_headers(value)
    if name == "extra_body":
        return request_body(value)
    return value


HeadersField = Annotated[
    Mapping[str, str] | None,
    PlainValidator(_headers_in, json_schema_input_type=dict[str, str] | None),
    PlainSerializer(_headers_out),
]
"""An adapter's ``headers`` field: stored as the core ``RequestHeaders`` (secret values
masked in ``repr`` and dumps, never pickled)."""

ExtraBodyField = Annotated[
    Mapping[str, Any] | None,
    PlainValidator(_body_in, json_schema_input_type=dict[str, Any] | None),
    PlainSerializer(_body_out),
]
"""An adapter's ``extra_body`` field: stored as the core ``RequestBody``."""


# --------------------------------------------------------------------------- parameter names


def _seconds(name: str) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
            return value
        raise ConfigError(
            f"{name}= takes a number of seconds (the total per request) or None, got "
            f"{type(value).__name__}; for per-phase limits use connect_timeout=, "
            "read_timeout=, write_timeout=, pool_timeout="
        )

    return convert


class Stock:
    """How an adapter treats the parameter names of the stock adapter it replaces.

    Attributes:
        aliases: stock name -> this adapter's field, with the same meaning.
        convert: stock name -> a function checking and converting its value.
        harmless: stock name -> the one value accepted (it asks for what this adapter
            always does; any other value is refused with the hint in ``refused``).
        refused: stock name -> why it has no equivalent here and what to use instead.
    """

    def __init__(
        self,
        aliases: Mapping[str, str],
        *,
        harmless: Mapping[str, object] | None = None,
        refused: Mapping[str, str] | None = None,
    ) -> None:
        self.aliases = dict(aliases)
        self.convert = {
            alias: _seconds(alias) for alias, field in aliases.items() if field == "total_timeout"
        }
        self.harmless = dict(harmless or {})
        self.refused = dict(refused or {})


_NO_TOKENIZER = (
    "no tokenizer is used here: texts are sent as strings, never tiktoken ids; "
    "max_text_chars bounds a text (characters), max_batch_tokens a request"
)
_SHARED_POOL = (
    "requests go through the process-wide shared pool; set max_connections, verify, proxy, "
    "http2 or the *_timeout fields instead"
)
REFUSED_HINTS: Final[dict[str, str]] = {
    "embedding_ctx_length": _NO_TOKENIZER,
    "tiktoken_model_name": _NO_TOKENIZER,
    "allowed_special": _NO_TOKENIZER,
    "disallowed_special": _NO_TOKENIZER,
    "check_embedding_ctx_length": _NO_TOKENIZER,
    "tiktoken_enabled": _NO_TOKENIZER,
    "http_client": _SHARED_POOL,
    "http_async_client": _SHARED_POOL,
    "async_http_client": _SHARED_POOL,
    "client": _SHARED_POOL,
    "async_client": _SHARED_POOL,
    "reuse_client": "clients are always reused: they are handles on the shared pool",
    "retry_min_seconds": "backoff is built in (capped exponential, full jitter); bound a "
    "call with deadline= (seconds) and max_retries=",
    "retry_max_seconds": "backoff is built in (capped exponential, full jitter); bound a "
    "call with deadline= (seconds) and max_retries=",
    "default_query": "URL query parameters are not sent; use headers= or extra_body=",
    "organization": "OpenAI organisations do not apply; if a gateway wants a header, pass headers=",
    "openai_organization": "OpenAI organisations do not apply; if a gateway wants a "
    "header, pass headers=",
    "deployment": "Azure OpenAI is not supported",
    "api_version": "Azure OpenAI is not supported",
    "openai_api_version": "Azure OpenAI is not supported",
    "openai_api_type": "Azure OpenAI is not supported",
}
"""Stock parameters (``OpenAIEmbeddings``, ``OpenAIEmbedding``) with no equivalent here,
and what to use instead."""


def resolve_names(
    owner: str, data: dict[str, Any], fields: Iterable[str], stock: Stock
) -> dict[str, Any]:
    """``data`` (constructor keywords) with stock aliases renamed to this adapter's fields.

    Raises:
        ConfigError: an alias given together with its field (or another alias of it);
            a stock parameter with no equivalent (with a hint); any other unknown name
            ("did you mean ..." naming the closest accepted name).
    """
    known = set(fields)
    out: dict[str, Any] = {}
    source: dict[str, str] = {}
    for name, value in data.items():
        target = name
        if name not in known:
            if name in stock.aliases:
                target = stock.aliases[name]
                convert = stock.convert.get(name)
                value = convert(value) if convert is not None else value
            elif name in stock.harmless and value == stock.harmless[name]:
                continue
            elif name in stock.harmless:
                raise ConfigError(
                    f"{owner}: only {name}={stock.harmless[name]!r} is accepted (what this "
                    f"adapter always does): {REFUSED_HINTS[name]}"
                )
            elif name in REFUSED_HINTS:
                hint = REFUSED_HINTS[name]
                raise ConfigError(f"{owner}: parameter {name!r} is not supported: {hint}")
            else:
                raise ConfigError(_unknown(owner, name, known, stock))
        if target in out:
            raise ConfigError(f"{owner}: pass either {source[target]!r} or {name!r}, not both")
        out[target] = value
        source[target] = name
    return out


def _unknown(owner: str, name: str, known: set[str], stock: Stock) -> str:
    names = sorted(known | set(stock.aliases))
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if not close:
        return f"{owner}: unknown parameter {name!r} (docs/migration.md lists the accepted ones)"
    match = close[0]
    field = stock.aliases.get(match)
    also = f" (an alias of {field!r})" if field else ""
    return f"{owner}: unknown parameter {name!r}; did you mean {match!r}{also}?"
