"""qwen-embed-plugins: fast, safe embeddings for RAG frameworks.

One process-wide pooled HTTP client per endpoint (sync, and async per event loop) for
OpenAI-compatible ``/v1/embeddings`` servers serving Qwen3-Embedding, with a LangChain
``Embeddings`` (``QwenPooledEmbeddings``) and a LlamaIndex ``BaseEmbedding``
(``QwenPooledEmbedding``) on top.

Importing this package is light: settings, errors and metrics, with numpy the only heavy
import. The clients (and with them the HTTP libraries: httpx 0.28 alone also imports
click, rich and pygments for its own CLI), the pool functions and the framework adapters
are resolved on first access (PEP 562).

The public modules are this one (import everything from here), ``errors``, one entry
module per framework (``integrations.langchain``, ``integrations.llama_index``), ``ray``
and ``cli``. Every other module is private (``_config``, ``_client``, ``_pool``, ...): its
names and place may change in any release.
"""

from __future__ import annotations

from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

from ._config import (
    DEFAULT_MODEL,
    DEFAULT_QUERY_TASK,
    NOT_GIVEN,
    EmbeddingConfig,
    EncodingFormat,
    Limits,
    NotGiven,
    OnError,
    ProxyURL,
    RetryConfig,
    Secret,
    Timeouts,
)
from ._install import install_command as _install_command
from ._metrics import prometheus_collector, reset_metrics, stats
from ._protocol import format_query
from ._state import reset
from .errors import (
    AuthenticationError,
    BadRequestError,
    BatchTooLargeError,
    CircuitOpenError,
    ConfigError,
    ConnectError,
    ConnectTimeout,
    ContextLengthError,
    HTTPStatusError,
    InputError,
    NetworkError,
    NotFoundError,
    OverloadedError,
    PoolTimeout,
    QwenEmbedError,
    RateLimitError,
    ReadTimeout,
    RemoteProtocolError,
    ResponseError,
    ServerError,
    TimeoutException,
    TransportError,
    WriteTimeout,
)

if TYPE_CHECKING:
    from ._client import (
        AsyncEmbeddingClient,
        EmbeddingClient,
        EmbeddingList,
        EmbeddingResult,
        Progress,
    )
    from ._pool import aclose_all, close_all, pool_stats
    from .integrations.langchain import QwenPooledEmbeddings
    from .integrations.llama_index import QwenPooledEmbedding

try:
    __version__ = _metadata.version("qwen-embed-plugins")
except _metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_QUERY_TASK",
    "NOT_GIVEN",
    "AsyncEmbeddingClient",
    "AuthenticationError",
    "BadRequestError",
    "BatchTooLargeError",
    "CircuitOpenError",
    "ConfigError",
    "ConnectError",
    "ConnectTimeout",
    "ContextLengthError",
    "EmbeddingClient",
    "EmbeddingConfig",
    "EmbeddingList",
    "EmbeddingResult",
    "EncodingFormat",
    "HTTPStatusError",
    "InputError",
    "Limits",
    "NetworkError",
    "NotFoundError",
    "NotGiven",
    "OnError",
    "OverloadedError",
    "PoolTimeout",
    "Progress",
    "ProxyURL",
    "QwenEmbedError",
    "QwenPooledEmbedding",
    "QwenPooledEmbeddings",
    "RateLimitError",
    "ReadTimeout",
    "RemoteProtocolError",
    "ResponseError",
    "RetryConfig",
    "Secret",
    "ServerError",
    "TimeoutException",
    "Timeouts",
    "TransportError",
    "WriteTimeout",
    "__version__",
    "aclose_all",
    "close_all",
    "format_query",
    "pool_stats",
    "prometheus_collector",
    "reset",
    "reset_metrics",
    "stats",
]

_LAZY = {
    "QwenPooledEmbeddings": ("integrations.langchain", "langchain-core", "langchain"),
    "QwenPooledEmbedding": ("integrations.llama_index", "llama-index-core", "llama-index"),
}
_CORE_LAZY = {
    "AsyncEmbeddingClient": "_client",
    "EmbeddingClient": "_client",
    "EmbeddingList": "_client",
    "EmbeddingResult": "_client",
    "Progress": "_client",
    "aclose_all": "_pool",
    "close_all": "_pool",
    "pool_stats": "_pool",
}


def __getattr__(name: str) -> Any:
    """Resolve the clients, the pool functions and the framework adapters on first
    access (PEP 562)."""
    import importlib

    if name in _CORE_LAZY:
        value = getattr(importlib.import_module(f".{_CORE_LAZY[name]}", __name__), name)
    elif name in _LAZY:
        module_name, dist, extra = _LAZY[name]
        try:
            module = importlib.import_module(f".{module_name}", __name__)
        except ImportError as exc:
            raise ImportError(f"{name} needs {dist}: {_install_command(extra)}") from exc
        value = getattr(module, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
