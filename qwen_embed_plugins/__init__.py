"""qwen-embed-plugins: fast, safe embeddings for RAG frameworks.

One process-wide pooled HTTP client per endpoint (sync, and async per event loop) for
OpenAI-compatible ``/v1/embeddings`` servers serving Qwen3-Embedding, with a LangChain
``Embeddings`` (``QwenPooledEmbeddings``) and a LlamaIndex ``BaseEmbedding``
(``QwenPooledEmbedding``) on top. Importing this package imports no framework: the two
adapters are resolved lazily, on first access.
"""

from __future__ import annotations

from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

from .client import AsyncEmbeddingClient, EmbeddingClient, EmbeddingList, EmbeddingResult
from .config import (
    DEFAULT_MODEL,
    DEFAULT_QUERY_TASK,
    NOT_GIVEN,
    EmbeddingConfig,
    Limits,
    NotGiven,
    RetryConfig,
    Secret,
    Timeouts,
)
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
from .metrics import reset_metrics, stats
from .pool import aclose_all, close_all, pool_stats
from .protocol import format_query

if TYPE_CHECKING:
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
    "HTTPStatusError",
    "InputError",
    "Limits",
    "NetworkError",
    "NotFoundError",
    "NotGiven",
    "OverloadedError",
    "PoolTimeout",
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
    "reset_metrics",
    "stats",
]

_LAZY = {
    "QwenPooledEmbeddings": ("langchain", "langchain-core", "langchain"),
    "QwenPooledEmbedding": ("llama_index", "llama-index-core", "llama-index"),
}


def __getattr__(name: str) -> Any:
    """Resolve the framework adapters on first access (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, dist, extra = _LAZY[name]
    import importlib

    try:
        module = importlib.import_module(f".integrations.{module_name}", __name__)
    except ImportError as exc:
        raise ImportError(
            f"{name} needs {dist}: pip install 'qwen-embed-plugins[{extra}]'"
        ) from exc
    value = getattr(module, name)
    globals()[name] = value
    return value
