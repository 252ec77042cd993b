"""LlamaIndex adapter: ``QwenPooledEmbedding``, a ``BaseEmbedding`` on the shared pool.

``Settings.embed_model = QwenPooledEmbedding(base_url=...)`` makes every index, retriever
and ingestion pipeline of the process embed through the core clients
(``EmbeddingClient`` / ``AsyncEmbeddingClient``), so all of them — and any LangChain
``QwenPooledEmbeddings`` pointed at the same endpoint — share one connection pool.

How it plugs into LlamaIndex:

- The six private hooks are overridden; the public ``get_*`` / ``aget_*`` methods of
  ``BaseEmbedding`` are kept, so LlamaIndex's callback events (``CBEventType.EMBEDDING``),
  instrumentation events (``EmbeddingStartEvent`` / ``EmbeddingEndEvent``) and spans,
  its embeddings cache and its rate limiter all work unchanged.
- Every HTTP request is an instrumentation span of its own, a child of the public
  call's span: its bound arguments hold the batch (``texts``, or the one ``query`` /
  ``text``) and a span handler times it. LlamaIndex spans the three abstract hooks
  itself; ``_get_text_embeddings``, ``_aget_text_embedding`` and ``_aembed_batch`` (what
  ``_aget_text_embeddings`` sends once a slot of the window below is free, so the
  span times the request, not the wait) are spanned here.
- Batches are real batches (one request per ``embed_batch_size`` texts) and the async
  hooks are really async (the pool's per-event-loop ``AsyncClient``).
- ``aget_text_embedding_batch``: LlamaIndex starts one coroutine per batch and gathers
  them all at once (63 batches opened 61 connections in our measurement). Here each call
  gets a window of ``max_concurrency`` batches in flight: the override only sets that
  window (a ``ContextVar`` holding a semaphore, inherited by the tasks LlamaIndex
  creates) and delegates to LlamaIndex's own implementation, which keeps its events,
  cache, rate limiter and progress bar. The pool's ``limits.max_connections`` caps
  connections across all calls.

This module imports ``llama_index.core``: install the extra (from a checkout:
``pip install -e ".[llama-index]"``).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import InitVar
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import llama_index.core.instrumentation as _instrumentation
from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr, SecretStr, model_validator
from llama_index.core.instrumentation import get_dispatcher  # type: ignore[attr-defined]

from .._client import AsyncEmbeddingClient, EmbeddingClient
from .._config import OnError, TimeoutArg, env_setting
from .._protocol import format_query, validate_text, validate_texts
from .._results import EmbeddingList
from ._common import (
    FlatSettings,
    KeyFunctionSetting,
    describe,
    env_default,
    mask_inputs,
    wrap_key,
)
from ._names import TIMEOUT, Stock, resolve_names, zero_filled

__all__ = ["QwenPooledEmbedding"]

# The dispatcher LlamaIndex itself would give this module's classes (spans propagate to
# the root dispatcher, where span handlers are usually added).
_dispatcher = get_dispatcher(__name__)


def _zero_filled(
    rows: list[list[float]], client: EmbeddingClient | AsyncEmbeddingClient
) -> list[list[float]]:
    """``rows`` of an ``on_error="skip"`` slice with its skipped texts as zero vectors."""
    if isinstance(rows, EmbeddingList):
        return zero_filled(rows, client._known_dim())
    return rows


def _slice(
    client: EmbeddingClient, texts: list[str], first: int, on_error: OnError
) -> list[list[float]]:
    """One batch of a call (``texts``, from the caller's index ``first``) on ``client``:
    ``n x dim`` floats, skipped texts as zero vectors under ``on_error="skip"``."""
    return _zero_filled(client._embed_slice(texts, first, on_error), client)


class _BatchCall:
    """One ``get_text_embedding_batch`` / ``aget_text_embedding_batch`` call: its
    batches' offsets in the caller's list, its async window, its sync pipeline."""

    def __init__(
        self,
        size: int,
        *,
        window: asyncio.Semaphore | None = None,
        pipeline: _Pipeline | None = None,
    ) -> None:
        self.size = size
        self.window = window
        self.pipeline = pipeline
        self._started = 0

    def start_batch(self) -> int:
        """The caller's index of the next batch's first text (batches are consecutive
        slices of ``embed_batch_size`` texts, started in order)."""
        offset = self._started * self.size
        self._started += 1
        return offset


class _Pipeline:
    """The sync batches of one call, at most ``window`` of them on the wire at once (the
    next starts when one is answered): LlamaIndex takes them in order (``take``) while
    the following ones are being answered."""

    def __init__(
        self,
        client: EmbeddingClient,
        items: list[str],
        size: int,
        window: int,
        on_error: OnError = "raise",
    ):
        from .._run import shared_executor

        self._client = client
        self._on_error: OnError = on_error
        self._batches = [(i, items[i : i + size]) for i in range(0, len(items), size)]
        self._executor = shared_executor()
        self._futures: list[Future[list[Embedding]]] = [Future() for _ in self._batches]
        self._lock = threading.Lock()
        self._next = 0
        self._taken = 0
        self._closed = False
        for _ in range(min(window, len(self._batches))):
            self._start_next()

    def _start_next(self) -> None:
        with self._lock:
            if self._closed or self._next >= len(self._batches):
                return
            k = self._next
            self._next += 1
        self._executor.submit(self._run, k)

    def _run(self, k: int) -> None:
        offset, batch = self._batches[k]
        future = self._futures[k]
        try:
            result = _slice(self._client, batch, offset, self._on_error)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)
        finally:
            self._start_next()

    def take(self, texts: list[str]) -> list[Embedding]:
        """The vectors of the next batch (``texts``), waiting for them if needed."""
        k = self._taken
        self._taken += 1
        offset, batch = self._batches[k]
        if batch != texts:  # LlamaIndex cut its batches differently: embed these directly
            return _slice(self._client, texts, offset, self._on_error)
        return self._futures[k].result()

    def close(self) -> None:
        """No batch starts after this (those under way finish in the background)."""
        with self._lock:
            self._closed = True


# Set while a query goes through LlamaIndex's cache in its instructed form.
_INSTRUCTED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "qwen_embed_llama_index_instructed", default=False
)

# The batch call under way. A ContextVar, so the tasks that LlamaIndex's implementation
# creates (``asyncio.gather`` / ``run_jobs``) inherit it and concurrent calls each get
# their own.
_BATCH_CALL: contextvars.ContextVar[_BatchCall | None] = contextvars.ContextVar(
    "qwen_embed_llama_index_batch_call", default=None
)

# The mark ``dispatcher.span`` leaves on a function it has wrapped.
_SPAN_MARK: str = getattr(
    _instrumentation, "DISPATCHER_SPAN_DECORATED_ATTR", "__dispatcher_span_decorated__"
)

# Names the LangChain adapter and LlamaIndex's OpenAIEmbedding / OpenAILikeEmbedding use,
# accepted for the same field (docs/migration.md).
_STOCK = Stock(
    {
        "batch_size": "embed_batch_size",
        "model": "model_name",
        "api_base": "base_url",
        "timeout": TIMEOUT,
        "default_headers": "headers",
        "additional_kwargs": "extra_body",
    },
    harmless={"reuse_client": (True,), "mode": ("similarity", "text_search")},
)


class QwenPooledEmbedding(FlatSettings, BaseEmbedding):
    """LlamaIndex embeddings for Qwen3-Embedding on an OpenAI-compatible server.

    Setup:
        ``pip install -e ".[llama-index]"`` in a checkout (no PyPI release yet); a
        server speaking ``POST {base_url}/embeddings`` (SGLang, vLLM, Infinity, TEI,
        ...).

    Instantiate it once for every index, retriever and pipeline of the process:

    ```python
    from llama_index.core import Settings
    from qwen_embed_plugins import QwenPooledEmbedding

    Settings.embed_model = QwenPooledEmbedding(
        base_url="http://gpu-box:30000/v1",   # or env QWEN_EMBED_BASE_URL
        model_name="Qwen/Qwen3-Embedding-0.6B",
        embed_batch_size="auto",              # texts per request: found (default)
        max_concurrency=4,                    # requests in flight per batch call
    )
    ```

    ``OpenAILikeEmbedding``'s names are aliases with their meaning: ``api_base``
    (``base_url``), ``timeout`` (seconds, ``None``, ``httpx.Timeout`` or a ``(connect,
    read)`` tuple: every ``*_timeout`` field, as the core's ``timeout=`` sets them),
    ``default_headers`` (``headers``: extra headers, credential-like values masked and
    never pickled), ``additional_kwargs`` (``extra_body``: extra JSON body fields), and
    ``model``, ``batch_size``. Any other unknown name raises, naming the closest accepted
    one (docs/migration.md lists them all). ``config=EmbeddingConfig(...)`` is accepted
    too: the fields not given take its values, a field given with it overrides the
    config's value (``embed_model.config`` is the effective config).

    Embed:
        ``get_query_embedding(q)`` -> ``dim`` floats, sent as
        ``Instruct: {query_instruction}\\nQuery:{q}``;
        ``get_text_embedding(t)`` -> ``dim`` floats, sent raw;
        ``get_text_embedding_batch(texts)`` -> ``n x dim`` floats in input order, one
        request per ``embed_batch_size`` texts (``"auto"``, the default: requests sized
        from the server's latencies, see ``EmbeddingConfig.batch_size``).

    Async:
        ``aget_query_embedding``, ``aget_text_embedding``, ``aget_text_embedding_batch``:
        the same on the running event loop, at most ``max_concurrency`` requests of one
        call in flight. ``asyncio.run()`` any number of times works.

    Constructing opens nothing; connections open on the first request and are shared
    with every other client of the same endpoint and transport settings
    (``qwen_embed_plugins.pool_stats()`` shows them).

    Serialisation: ``to_dict()`` / ``to_json()`` / pickles never hold the API key (nor a
    callable key). A pickle holds a token naming the key in this process: a copy
    unpickled here or in a worker forked from this process
    (``await IngestionPipeline.arun(num_workers=N)`` on Linux, whose workers fork) uses
    the key given in code. Elsewhere (``from_dict``; ``IngestionPipeline.run(
    num_workers=N)``, whose workers are always spawned; macOS, Windows) the copy reads
    ``QWEN_EMBED_API_KEY`` from its own environment, and if the key was given in code
    and that variable is unset, its requests raise ``ConfigError`` naming that fix
    before anything is sent. So with worker processes and an authenticated server,
    pass the key through the environment.

    Raises:
        ConfigError: (from the constructor or an assignment) a setting is out of range;
            the message names the field. Wrong types raise pydantic's
            ``ValidationError``; both are ``ValueError``.
        InputError: a text is empty, whitespace-only or not a ``str`` (names the index).
        HTTPStatusError, TransportError, ResponseError, CircuitOpenError: see
            ``qwen_embed_plugins.errors``.
    """

    # The flat settings (base_url, dimensions, timeouts, pool limits, ...) are
    # FlatSettings' fields (declared in _settings.SETTINGS), with its model_config
    # (extra="forbid", inputs hidden in errors); these three are declared here.

    api_key: SecretStr | str | KeyFunctionSetting | None = Field(
        default=None,
        exclude=True,
        description=describe(
            "api_key",
            " Also a callable returning the key (sync, or async for the async methods), "
            "called for each request.",
        ),
    )
    model_name: str = Field(
        default_factory=env_default("model"),
        description=describe("model", " Also accepted as model=."),
    )
    embed_batch_size: Annotated[int, Field(gt=0, le=2048)] | Literal["auto"] = Field(  # type: ignore[assignment]
        default_factory=env_default("batch_size"),
        description=describe(
            "batch_size",
            " Also accepted as batch_size=. With 'auto', a batch call is one LlamaIndex batch "
            "(one embedding event) whose requests the client sizes.",
        ),
    )

    on_error: Literal["raise", "skip"] = Field(
        default="raise",
        description="What get_text_embedding_batch / aget_text_embedding_batch (and so "
        "an IngestionPipeline or an index build) do with a text that cannot be embedded "
        "(empty, whitespace-only, too long, refused by the server): 'raise' (default) its "
        "error, naming its index; 'skip': a zero vector of the same size in its place (one "
        "WARNING per batch), so every node still gets an embedding. Single-text calls "
        "always raise.",
    )
    # to_payload's memo: (the base_url field's value, its endpoint label)
    _endpoint_label: tuple[Any, str | None] = PrivateAttr(default=(None, None))

    _stock: ClassVar[Stock] = _STOCK
    _model_field: ClassVar[str] = "model_name"
    _batch_field: ClassVar[str] = "embed_batch_size"
    _key_from_env: ClassVar[Literal["always", "if_it_had_one"]] = "always"

    if TYPE_CHECKING:
        # OpenAILikeEmbedding's names (``_STOCK``): constructor keywords for type checkers
        # (pydantic's ``dataclass_transform`` signature lists fields only), not fields;
        # the validator renames them to their fields
        batch_size: InitVar[int | Literal["auto"]] = "auto"
        model: InitVar[str | None] = None
        api_base: InitVar[str | None] = None
        timeout: InitVar[TimeoutArg] = None
        default_headers: InitVar[Mapping[str, str] | None] = None
        additional_kwargs: InitVar[Mapping[str, Any] | None] = None
        reuse_client: InitVar[bool] = True

    if not TYPE_CHECKING:
        # Type checkers keep pydantic's field-based signature; at run time the core
        # config is built (and validated) here so bad settings raise ConfigError at once.
        # The model may come first, as OpenAILikeEmbedding(model_name, ...) takes it.
        def __init__(self, model_name: str | None = None, /, **data: Any) -> None:
            if model_name is not None:
                data = {"model_name": model_name, **data}
            super().__init__(**data)
            self._refresh()

    @model_validator(mode="before")
    @classmethod
    def _from_environment(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        mask_inputs(data)  # URL credentials (proxy, base_url): pydantic keeps the input
        if data.get("class_name") == cls.class_name():  # LlamaIndex's model_dump() adds it
            data = {name: value for name, value in data.items() if name != "class_name"}
        data = resolve_names(cls.__name__, data, cls.model_fields, _STOCK)
        if "api_key" not in data:
            data["api_key"] = env_setting("api_key")
        # a str kept as a SecretStr (masked in repr), a callable as a KeyFunction
        data["api_key"] = wrap_key(data["api_key"])
        if not data.get("model_name"):
            data["model_name"] = env_setting("model")  # else the declared default
        return data

    @classmethod
    def class_name(cls) -> str:
        """The name LlamaIndex stores in ``to_dict()["class_name"]``."""
        return "QwenPooledEmbedding"

    # Clients are cheap handles on the process-wide pool, made on first use.
    def _sync_client(self) -> EmbeddingClient:
        client = self._clients().sync
        if client is None:  # cannot happen
            raise RuntimeError("internal error: client is None")
        return client

    def _async_client(self) -> AsyncEmbeddingClient:
        client = self._clients().async_
        if client is None:  # cannot happen
            raise RuntimeError("internal error: client is None")
        return client

    def to_payload(self) -> dict[str, Any]:
        """What LlamaIndex puts in embedding events: no credentials, the endpoint as
        scheme://host:port/path."""
        payload: dict[str, Any] = super().to_payload()
        # LlamaIndex asks for it on every call: the endpoint label is worked out again
        # only when the base_url field holds another object (a new value)
        base, label = self._endpoint_label
        if base is not self.base_url or label is None:
            label = self.config.endpoint  # the config may resolve the field
            self._endpoint_label = (self.base_url, label)
        payload["base_url"] = label
        payload["dimensions"] = self.dimensions
        payload["max_concurrency"] = self.max_concurrency
        return payload

    # ------------------------------------------------------------------ hooks

    def get_query_embedding(self, query: str) -> Embedding:
        """Embed a query (with the Qwen instruction); ``dim`` floats.

        LlamaIndex's implementation (events, callbacks, ``embeddings_cache``). With an
        ``embeddings_cache``, the query reaches it in its instructed form, so the cache
        keys queries apart from documents of the same text (whose vectors differ).
        """
        if self.embeddings_cache is None:
            return super().get_query_embedding(query)
        token = _INSTRUCTED.set(True)
        try:
            return super().get_query_embedding(self._as_query(query))
        finally:
            _INSTRUCTED.reset(token)

    async def aget_query_embedding(self, query: str) -> Embedding:
        """Async ``get_query_embedding``."""
        if self.embeddings_cache is None:
            return await super().aget_query_embedding(query)
        token = _INSTRUCTED.set(True)
        try:
            return await super().aget_query_embedding(self._as_query(query))
        finally:
            _INSTRUCTED.reset(token)

    def _as_query(self, query: str) -> str:
        validate_text(query, None, max_chars=self.max_text_chars)
        return format_query(query, self.config.query_task)

    def _get_query_embedding(self, query: str) -> Embedding:
        """One query, with the Qwen instruction (unless already added); ``dim`` floats."""
        if _INSTRUCTED.get():
            return self._sync_client().embed_documents([query])[0]
        return self._sync_client().embed_query(query)

    async def _aget_query_embedding(self, query: str) -> Embedding:
        """Async ``_get_query_embedding``."""
        if _INSTRUCTED.get():
            return (await self._async_client().embed_documents([query]))[0]
        return await self._async_client().embed_query(query)

    def _get_text_embedding(self, text: str) -> Embedding:
        """One document, sent raw; ``dim`` floats."""
        return self._sync_client().embed_documents([text])[0]

    @_dispatcher.span
    async def _aget_text_embedding(self, text: str) -> Embedding:
        """Async ``_get_text_embedding``."""
        return (await self._async_client().embed_documents([text]))[0]

    @_dispatcher.span
    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        """Documents, sent raw; ``n x dim`` floats in input order. Within
        ``get_text_embedding_batch``, the answer of a batch already under way."""
        if not texts:
            return []
        call = _BATCH_CALL.get()
        if call is None:
            return _slice(self._sync_client(), texts, 0, self.on_error)
        offset = call.start_batch()
        if call.pipeline is not None:
            return call.pipeline.take(texts)
        return _slice(self._sync_client(), texts, offset, self.on_error)

    async def _aget_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        """Async ``_get_text_embeddings``; waits for a slot of the calling
        ``aget_text_embedding_batch``'s window when there is one."""
        if not texts:
            return []
        call = _BATCH_CALL.get()
        if call is None:
            return await self._aembed_batch(texts)
        offset = call.start_batch()  # before any await: batches start in their order
        if call.window is None:  # cannot happen
            raise RuntimeError("internal error: call.window is None")
        async with call.window:
            return await self._aembed_batch(texts, offset)

    @_dispatcher.span
    async def _aembed_batch(self, texts: list[str], first: int = 0) -> list[Embedding]:
        """One batch of documents on the running loop; ``n x dim`` floats (its own
        instrumentation span: ``texts`` is the batch, the span times the request).
        ``first``: the index of ``texts[0]`` in the caller's list (errors name it)."""
        client = self._async_client()
        rows = await client._embed_slice(texts, first, self.on_error)
        return _zero_filled(rows, client)

    def _chunk(self, items: list[str]) -> int:
        """Texts per LlamaIndex batch: ``embed_batch_size``; with ``"auto"`` the whole
        call is one LlamaIndex batch (LlamaIndex cuts a batch when it holds
        ``embed_batch_size`` texts, which ``"auto"`` never equals) and the core client
        cuts its requests (``batch_size="auto"``), up to ``max_concurrency`` in flight."""
        size = self.embed_batch_size
        return max(1, len(items)) if size == "auto" else size

    def _checked(self, texts: Any) -> list[str]:
        """The whole batch call's input, checked before anything is sent (``InputError``
        names the index in the caller's list); with ``on_error="skip"`` a list is taken
        as it is (each batch sets its bad texts aside)."""
        if self.on_error == "skip" and isinstance(texts, list):
            return texts
        return validate_texts(texts, max_chars=self.max_text_chars)

    def get_text_embedding_batch(
        self, texts: list[str], show_progress: bool = False, **kwargs: Any
    ) -> list[Embedding]:
        """Embed documents; ``n x dim`` floats in input order.

        LlamaIndex's implementation (events, callbacks, cache, rate limiter, progress
        bar), with up to ``max_concurrency`` batches in flight: while LlamaIndex handles
        one batch, the next ones are already on the wire (as the core client windows
        them). Every text is checked first; a failing input is named by its index in
        ``texts``.

        Returns ``[]`` for an empty list (what an `IngestionPipeline` re-run whose
        docstore already holds every document passes), sending nothing.

        Raises:
            InputError: ``texts`` is a single ``str``, an unordered collection, or holds
                an invalid text (nothing is sent).
        """
        if isinstance(texts, list) and not texts:
            return []
        items = self._checked(texts)
        window = self.max_concurrency
        size = self._chunk(items)
        pipeline = None
        if self.embeddings_cache is None and len(items) > size and window > 1:
            pipeline = _Pipeline(self._sync_client(), items, size, window, self.on_error)
        token = _BATCH_CALL.set(_BatchCall(size, pipeline=pipeline))
        try:
            return super().get_text_embedding_batch(items, show_progress=show_progress, **kwargs)
        finally:
            _BATCH_CALL.reset(token)
            if pipeline is not None:
                pipeline.close()

    async def aget_text_embedding_batch(
        self, texts: list[str], show_progress: bool = False, **kwargs: Any
    ) -> list[Embedding]:
        """Embed documents asynchronously; ``n x dim`` floats in input order.

        LlamaIndex's implementation (events, callbacks, cache, rate limiter, progress
        bar), with at most ``max_concurrency`` batch requests of this call in flight.
        Every text is checked first; a failing input is named by its index in ``texts``.
        ``[]`` for an empty list, sending nothing.
        """
        if isinstance(texts, list) and not texts:
            return []
        items = self._checked(texts)
        window = self.max_concurrency
        call = _BatchCall(self._chunk(items), window=asyncio.Semaphore(window))
        token = _BATCH_CALL.set(call)
        try:
            return await super().aget_text_embedding_batch(
                items, show_progress=show_progress, **kwargs
            )
        finally:
            _BATCH_CALL.reset(token)

    # LlamaIndex's implementations, reached through super(), open the spans; without this
    # mark DispatcherSpanMixin would wrap the overrides in a second, identical one.
    setattr(aget_text_embedding_batch, _SPAN_MARK, True)
    setattr(get_text_embedding_batch, _SPAN_MARK, True)
    setattr(get_query_embedding, _SPAN_MARK, True)
    setattr(aget_query_embedding, _SPAN_MARK, True)
