"""The flat settings both framework adapters take, defined once.

LangChain and LlamaIndex users set plain fields (``max_connections=8``,
``read_timeout=30``), not nested objects; both adapters declare the same fields, with
the defaults and descriptions below, and build the core ``EmbeddingConfig`` with
``build_config``. A field not given takes its ``QWEN_EMBED_*`` environment variable
(the one resolver, ``config.env_setting``) or its default.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from ..config import (
    DEFAULT_MODEL,
    DEFAULT_QUERY_TASK,
    NOT_GIVEN,
    EmbeddingConfig,
    Limits,
    RetryConfig,
    Timeouts,
    env_setting,
)

__all__ = ["DESCRIPTIONS", "build_config", "env_default", "setting"]

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
    "batch_size": "Texts per request (1..2048), or 'auto' (default, env "
    "QWEN_EMBED_BATCH_SIZE): from 32, grown while a batch twice as large answers in about "
    "the same time, stopped where latency grows with the batch. Lowered automatically to a "
    "server's stated limit.",
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
    "batch_size": "auto",
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
    )
