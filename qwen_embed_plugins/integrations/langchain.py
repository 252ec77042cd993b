"""LangChain ``Embeddings`` over the process-wide shared pool: ``QwenPooledEmbeddings``.

The adapter adds nothing but the LangChain surface: its fields map one-to-one onto
``EmbeddingConfig``, and every call goes through the core ``EmbeddingClient`` /
``AsyncEmbeddingClient``, so every instance with equal transport settings (base URL,
API key, timeouts, limits, HTTP/2, TLS verification) shares one connection pool per
process (sync) and per event loop (async).

Needs the ``langchain`` extra: ``pip install 'qwen-embed-plugins[langchain]'``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable, Iterator, Sized
from contextlib import contextmanager
from typing import Any, Literal, NamedTuple, Self

from langchain_core.embeddings import Embeddings
from langchain_core.utils import secret_from_env
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from ..client import AsyncEmbeddingClient, EmbeddingClient
from ..config import ENV_API_KEY, EmbeddingConfig, EncodingFormat
from ..errors import ConfigError
from ..protocol import validate_texts
from ._common import DESCRIPTIONS, build_config, setting

__all__ = ["QwenPooledEmbeddings"]


_TQDM_MISSING = (
    "show_progress=True needs tqdm: pip install 'qwen-embed-plugins[langchain]' "
    "(or pip install tqdm)"
)

# Key in the pickled state: "the instance had an API key; re-read it from the
# environment where it is unpickled" (the key itself is never pickled).
_KEY_FROM_ENV = "qwen_embed_api_key_from_env"


def _tqdm() -> Any:
    """``tqdm.auto.tqdm`` (console or notebook bar), or an ``ImportError`` saying how
    to install it."""
    try:
        module = importlib.import_module("tqdm.auto")  # tqdm ships no type hints
    except ImportError as exc:
        raise ImportError(_TQDM_MISSING) from exc
    return module.tqdm


class _Clients(NamedTuple):
    fingerprint: tuple[Any, ...]
    config: EmbeddingConfig
    sync: EmbeddingClient | None
    async_: AsyncEmbeddingClient | None


class _Handles:
    """Per-instance cache of the core config and clients (built lazily).

    A cache, not state: it compares equal to any other ``_Handles`` (so two adapters
    with equal fields are equal), copies and pickles as an empty cache (a copy or an
    unpickled instance rebuilds its clients on first use, on the pool of the process
    it is in).
    """

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: _Clients | None = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Handles)

    def __hash__(self) -> int:
        return 0

    def __reduce__(self) -> tuple[type[_Handles], tuple[()]]:
        return (_Handles, ())

    def __copy__(self) -> _Handles:
        return _Handles()

    def __deepcopy__(self, memo: dict[int, Any]) -> _Handles:
        return _Handles()


def _as_texts(texts: Any) -> Any:
    """LangChain passes lists; also take any iterable (a generator is read once), and
    reject what is not a collection of texts with ``InputError`` (not a bare
    ``TypeError`` from ``len()``)."""
    if isinstance(texts, Sized):
        return texts  # lists, tuples; str/sets/mappings are rejected by the client
    if isinstance(texts, Iterable):
        return list(texts)
    return validate_texts(texts, max_chars=None)  # raises InputError naming the type


class QwenPooledEmbeddings(BaseModel, Embeddings):
    """Qwen3-Embedding (or any OpenAI-compatible ``/v1/embeddings`` server) for LangChain.

    Every instance for the same endpoint and transport settings shares the
    process-wide connection pool of ``qwen_embed_plugins``: one sync HTTP client for
    all threads and one async client per event loop, each with at most
    ``max_connections`` sockets, idle sockets dropped after ``keepalive_expiry`` seconds (below the
    5 s idle timeout of uvicorn-based servers), one retry layer. Constructing an
    instance opens no connection.

    Setup:
        Install the package with its LangChain extra and point it at a server
        (SGLang, vLLM, Infinity, TEI, llama.cpp, ...) serving Qwen3-Embedding:

        ```bash
        pip install 'qwen-embed-plugins[langchain]'
        export QWEN_EMBED_BASE_URL="http://gpu-box:30000/v1"
        export QWEN_EMBED_API_KEY="..."   # only if the server wants a bearer token
        ```

    Key init args — endpoint:
        base_url: str
            The OpenAI-compatible API root (env ``QWEN_EMBED_BASE_URL``).
        api_key: SecretStr | None
            Bearer token (env ``QWEN_EMBED_API_KEY``); never pickled.
        model: str
            Model name sent with every request (default
            ``"Qwen/Qwen3-Embedding-0.6B"``, env ``QWEN_EMBED_MODEL``).

    Key init args — embedding params:
        dimensions: int | None
            MRL output size (32..1024 for the 0.6B model); ``None`` = full size.
        query_instruction: str | None
            The Qwen3 retrieval task put before queries; ``None`` for non-Qwen models.
        batch_size: int | "auto"
            Texts per request (default ``"auto"``: from 32, grown while latency stays
            flat in batch size).
        max_concurrency: int
            Requests in flight at once per call (default 4).

    Key init args — pool:
        max_connections: int
            Connections to the endpoint for the whole process (default 20).
        keepalive_expiry: float
            Seconds an idle connection is kept (default 4.0).

    See the field list for every init arg, with its unit and default.

    Instantiate:
        ```python
        from qwen_embed_plugins import QwenPooledEmbeddings

        embed = QwenPooledEmbeddings(
            base_url="http://gpu-box:30000/v1",
            # dimensions=256,        # MRL: shorter vectors
            # query_instruction=None # for non-Qwen models
        )
        ```

    Embed single text:
        ```python
        input_text = "The meaning of life is 42"
        vector = embed.embed_query(input_text)
        print(vector[:3])
        ```
        ```python
        [0.02098247967660427, 0.0037386503536254168, 0.03225111961364746]
        ```

    Embed multiple texts:
        ```python
        input_texts = ["Document 1...", "Document 2..."]
        vectors = embed.embed_documents(input_texts)
        print(len(vectors))
        # The first 3 coordinates for the first vector
        print(vectors[0][:3])
        ```
        ```python
        2
        [-0.0030090874060988426, 0.01494116522371769, 0.05169259011745453]
        ```

    Async:
        ```python
        vector = await embed.aembed_query(input_text)
        print(vector[:3])

        # multiple:
        # await embed.aembed_documents(input_texts)
        ```
        ```python
        [0.02098247967660427, 0.0037386503536254168, 0.03225111961364746]
        ```

    (Sample output from the loopback ``qwen_embed_plugins.testing.EmbeddingServer``,
    whose vectors are deterministic stand-ins, not a model's.)

    Queries are sent as ``Instruct: {query_instruction}\\nQuery:{text}``, documents raw,
    as Qwen3-Embedding expects. ``aembed_documents`` / ``aembed_query`` are natively
    async (no thread executor) and run up to ``max_concurrency`` batches at once.

    Pickling and ``copy.deepcopy`` keep every field; the clients are rebuilt on first
    use in the process the instance lands in, on that process's pool. The API key is
    never written into a pickle: an unpickled instance that had a key re-reads
    ``QWEN_EMBED_API_KEY`` from its environment (worker processes inherit it), and has
    ``api_key=None`` if that variable is unset. ``copy.deepcopy`` keeps the key.

    Raises (from the embed methods): ``InputError`` (a text is not a non-empty
    ``str``; nothing is sent), ``HTTPStatusError`` and subclasses, ``TransportError``,
    ``ResponseError``, ``CircuitOpenError``; all are ``QwenEmbedError``.
    """

    # ------------------------------------------------------------------ endpoint

    base_url: str | list[str] | None = setting("base_url")

    api_key: SecretStr | None = Field(
        default_factory=secret_from_env(ENV_API_KEY, default=None),
        description=DESCRIPTIONS["api_key"],
    )

    model: str = setting("model")

    # ------------------------------------------------------------------ embedding

    dimensions: int | None = setting("dimensions")

    query_instruction: str | None = setting("query_instruction")

    batch_size: int | Literal["auto"] = setting("batch_size")

    max_batch_tokens: int | None = setting("max_batch_tokens")

    max_concurrency: int | Literal["auto"] = setting("max_concurrency")

    encoding_format: EncodingFormat = setting("encoding_format")

    normalize: bool = setting("normalize")

    max_text_chars: int | None = setting("max_text_chars")

    append_eos: bool | None = setting("append_eos")

    # ------------------------------------------------------------------ timeouts and retries

    connect_timeout: float | None = setting("connect_timeout")

    read_timeout: float | None = setting("read_timeout")

    write_timeout: float | None = setting("write_timeout")

    pool_timeout: float | None = setting("pool_timeout")

    total_timeout: float | None = setting("total_timeout")

    max_retries: int = setting("max_retries")

    deadline: float | None = setting("deadline")

    query_deadline: float | None = setting("query_deadline")

    # ------------------------------------------------------------------ pool

    max_connections: int = setting("max_connections")

    max_keepalive_connections: int | None = setting("max_keepalive_connections")

    keepalive_expiry: float = setting("keepalive_expiry")

    max_connections_per_process: int | None = setting("max_connections_per_process")

    # ------------------------------------------------------------------ transport

    http2: bool = setting("http2")

    verify: bool | str = setting("verify")

    proxy: str | None = setting("proxy")

    trust_env: bool = setting("trust_env")

    insecure_key: Literal["warn", "error", "allow"] = setting("insecure_key")

    hedge: bool = setting("hedge")

    use_sdk: bool = setting("use_sdk")

    server: str = setting("server")

    # ------------------------------------------------------------------ UI

    show_progress: bool = False
    """Show a ``tqdm`` progress bar (in texts) that advances once per finished batch
    in ``embed_documents`` / ``aembed_documents``. Needs ``tqdm`` (in the
    ``langchain`` extra)."""

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        protected_namespaces=(),
        use_attribute_docstrings=True,
        # A validation error must not echo the inputs: they may hold the API key.
        hide_input_in_errors=True,
    )

    _handles: _Handles = PrivateAttr(default_factory=_Handles)

    # ------------------------------------------------------------------ validation

    @model_validator(mode="before")
    @classmethod
    def _mask_key_input(cls, data: Any) -> Any:
        """Wrap a plain-string ``api_key`` at once, in place, so that no validation error
        holds the key in clear: ``ValidationError.errors()`` carries the original input
        mapping (a constructor's own ``**kwargs`` dict; with ``model_validate(d)``, ``d``
        gets the ``SecretStr``)."""
        if isinstance(data, dict) and isinstance(data.get("api_key"), str):
            data["api_key"] = SecretStr(data["api_key"])
        return data

    @model_validator(mode="after")
    def _validate_settings(self) -> Self:
        """Check every setting now (the core config validates ranges); open nothing."""
        config = self._build_config()
        if self.show_progress:
            _tqdm()
        self._handles.current = _Clients(self._fingerprint(), config, None, None)
        return self

    def _fingerprint(self) -> tuple[Any, ...]:
        return tuple(self.__dict__.values())

    def _build_config(self) -> EmbeddingConfig:
        key = self.api_key.get_secret_value() if self.api_key is not None else None
        return build_config(self.__dict__, api_key=key or None)

    def __setattr__(self, name: str, value: Any) -> None:
        """Assigning a field checks the new settings at once (rolled back if invalid), as
        the constructor does, instead of failing on the next call."""
        if name not in type(self).model_fields:
            super().__setattr__(name, value)
            return
        old = getattr(self, name)
        super().__setattr__(name, value)
        try:
            self._build_config()
        except ConfigError:
            super().__setattr__(name, old)
            raise

    def _clients(self) -> _Clients:
        """The config and both core clients for the current field values.

        Rebuilt when a field changed since (assignment, ``model_copy(update=...)``) and
        after unpickling; clients are cheap handles on the shared pool.
        """
        fingerprint = self._fingerprint()
        current = self._handles.current
        if current is None or current.fingerprint != fingerprint:
            current = _Clients(fingerprint, self._build_config(), None, None)
        if current.sync is None or current.async_ is None:
            current = current._replace(
                sync=EmbeddingClient(current.config),
                async_=AsyncEmbeddingClient(current.config),
            )
            self._handles.current = current
        return current

    @property
    def config(self) -> EmbeddingConfig:
        """The core ``EmbeddingConfig`` these fields map onto (frozen; its ``pool_key``
        selects the shared pool)."""
        return self._clients().config

    # ------------------------------------------------------------------ copying

    def __copy__(self) -> Self:
        """A shallow copy (also ``model_copy``) with its own client cache."""
        clone = super().__copy__()
        clone._handles = _Handles()
        return clone

    # ------------------------------------------------------------------ pickling

    def __getstate__(self) -> dict[Any, Any]:
        """Pickle the fields without the API key (see the class docstring)."""
        state = super().__getstate__()
        fields = dict(state["__dict__"])
        state[_KEY_FROM_ENV] = fields.get("api_key") is not None
        fields["api_key"] = None
        state["__dict__"] = fields
        state["__pydantic_private__"] = {"_handles": _Handles()}
        return state

    def __setstate__(self, state: dict[Any, Any]) -> None:
        state = dict(state)
        key_from_env = bool(state.pop(_KEY_FROM_ENV, False))
        super().__setstate__(state)
        if key_from_env:
            value = os.environ.get(ENV_API_KEY)
            self.__dict__["api_key"] = SecretStr(value) if value else None

    # ------------------------------------------------------------------ progress

    @contextmanager
    def _progress(self, total: int) -> Iterator[Callable[[int], None] | None]:
        if not self.show_progress:
            yield None
            return
        # Redraw on every finished batch (batches are network round trips, not hot loops).
        bar = _tqdm()(total=total, desc="Embedding", unit="text", mininterval=0, miniters=1)
        try:
            yield bar.update
        finally:
            bar.close()

    # ------------------------------------------------------------------ Embeddings

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """Embed documents (sent raw, without the query instruction).

        Args:
            texts: ``n`` non-empty strings; sent in batches of ``batch_size``, up to
                ``max_concurrency`` batches at once, identical texts sent once.

        Returns:
            ``n x dim`` floats (``dim`` = ``dimensions`` or the model's size), row ``i``
            for ``texts[i]``; ``[]`` for an empty list.

        Raises:
            InputError: a text is not a non-empty ``str`` (``.index`` names it).
            QwenEmbedError: the server or the network failed after retries.
        """
        texts = _as_texts(texts)
        if isinstance(texts, list) and not texts:
            return []
        client = self._clients().sync
        if client is None:  # cannot happen
            raise RuntimeError("internal error: client is None")
        with self._progress(len(texts)) as progress:
            return client.embed_documents(texts, progress=progress)

    def embed_query(self, text: str) -> list[float]:
        """Embed a search query as ``Instruct: {query_instruction}\\nQuery:{text}``.

        Returns:
            ``dim`` floats.

        Raises:
            InputError: ``text`` is not a non-empty ``str``.
            QwenEmbedError: the server or the network failed after retries.
        """
        client = self._clients().sync
        if client is None:  # cannot happen
            raise RuntimeError("internal error: client is None")
        return client.embed_query(text)

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        """Async ``embed_documents``: natively async on this event loop's shared pool.

        Returns:
            ``n x dim`` floats in input order; ``[]`` for an empty list.

        Raises:
            InputError, QwenEmbedError: as ``embed_documents``.
        """
        texts = _as_texts(texts)
        if isinstance(texts, list) and not texts:
            return []
        client = self._clients().async_
        if client is None:  # cannot happen
            raise RuntimeError("internal error: client is None")
        with self._progress(len(texts)) as progress:
            return await client.embed_documents(texts, progress=progress)

    async def aembed_query(self, text: str) -> list[float]:
        """Async ``embed_query`` (with the instruction); ``dim`` floats.

        Raises:
            InputError, QwenEmbedError: as ``embed_query``.
        """
        client = self._clients().async_
        if client is None:  # cannot happen
            raise RuntimeError("internal error: client is None")
        return await client.embed_query(text)
