"""``EmbeddingClient`` and ``AsyncEmbeddingClient``: the API the adapters and CLI call.

Both are thin. Every decision of a call — batching, replica choice, retries,
bisection, fallbacks, checks — lives once in ``_engine.Engine`` as I/O-free flows; the
two classes differ only in how they run a flow: ``EmbeddingClient`` with blocking I/O on
the pool's ``SyncTransport`` (concurrent batches on a shared thread pool),
``AsyncEmbeddingClient`` with awaits on the running loop's ``AsyncTransport``. What
they share is written once in ``_ClientBase``: the checks of a call's arguments, its
plan (``_batching``) and the call under way (``_Run``); the result is assembled by
``_results``.

The hot path posts JSON through the pooled HTTP client with this package's codec
(orjson, base64 -> numpy): the openai SDK costs more CPU per request than the raw call
(docs/benchmarks.md has the figures). ``openai_client()`` hands an
``openai.OpenAI`` on the same pool (same caps and deadline; ``_sdk``) to users who want
the SDK's surface.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

from . import _pool as pool
from ._batching import Batches, BatchPlan, plan_call
from ._config import EmbeddingConfig, OnError, known_model_dims
from ._engine import Engine
from ._flat import config_from
from ._protocol import FloatArray, format_query, screen_texts, validate_text, validate_texts
from ._results import (
    EmbeddingList,
    EmbeddingResult,
    Inputs,
    Sink,
    batch_counts,
    caller_indices,
    finish_array,
    finish_list,
)
from ._run import (
    Call,
    Flow,
    Part,
    Send,
    ahedged,
    arun_windowed,
    hedged,
    run_async,
    run_sync,
    run_windowed,
)
from ._servers import Detection
from ._tracing import start_call, traced
from ._transport import Reply, Retired, _sdk
from ._transport._contract import prepare_ssl_contexts
from .errors import (
    ConfigError,
)

if TYPE_CHECKING:
    import openai

_log = logging.getLogger("qwen_embed_plugins")

__all__ = [
    "AsyncEmbeddingClient",
    "EmbeddingClient",
    "EmbeddingList",
    "EmbeddingResult",
    "Progress",
]

Progress = Callable[[int], None]
"""A progress callback: called once per finished batch with the number of input texts
that batch covered."""


# --------------------------------------------------------------------------- async library


def load_async_library() -> None:
    """Import the event-loop transport's HTTP library (aiohttp) now, if not yet done.

    Called when an object that makes async calls is built (``AsyncEmbeddingClient``,
    the LangChain and LlamaIndex adapters), so that the first async call does not
    import it: that import is a one-off 0.15-0.3 s of CPU on a quiet machine (its
    module set-up loads the system CA bundle), spent on the event loop, blocking every
    other task of the program and, in a call timed from a fresh process, making the
    async path slower than the sync one. A sync ``EmbeddingClient`` does not load it.
    """
    import aiohttp  # noqa: F401  (cheap once loaded: a sys.modules lookup)


def prepare_tls(config: EmbeddingConfig) -> None:
    """Start building the SSL contexts of ``config``'s ``https://`` replicas on a
    background thread (``_contract.prepare_ssl_contexts``), so that the first request
    does not load the CA bundle (10-20 ms of CPU for certifi's roots). Called when a
    client or adapter is built; returns at once and opens no connection."""
    prepare_ssl_contexts(
        (config.verify, bool(config.http2), url.startswith("http://")) for url in config.replicas
    )


# --------------------------------------------------------------------------- base


def _row(part: Part) -> FloatArray:
    """The vector (``dim``) of a one-text call's ``Part``."""
    row: FloatArray = part.pieces[0][1][0]
    return row


@dataclass
class _Run:
    """One call of many texts under way, I/O-free: the driver runs ``flow(b)`` for each
    batch ``b`` that ``batches`` yields, at most ``limit`` at once, and hands each
    ``Part`` to ``done`` (into the sink; progress reported)."""

    engine: Engine
    call: Call
    plan: BatchPlan
    batches: Batches
    sink: Sink
    indices: list[int]  # the caller's index of each unique text
    progress: Progress | None
    counts: Callable[[int], int] | None

    @property
    def limit(self) -> int:
        """Batches of the call in flight at most (1: a call of one batch)."""
        return 1 if self.batches.single else self.batches.window

    def flow(self, b: int) -> Flow:
        """Batch ``b``'s flow (``Engine.batch_flow``)."""
        start, stop = self.plan.batches[b]
        return self.engine.batch_flow(
            self.call, self.plan.unique[start:stop], self.indices[start:stop]
        )

    def done(self, b: int, part: Part) -> None:
        """Batch ``b`` finished with ``part``."""
        self.sink.put(b, part)
        if self.progress is not None and self.counts is not None:
            self.progress(self.counts(b))


class _ClientBase:
    """What the sync and async clients share: settings, engine, pickling, and the
    I/O-free part of a call (arguments checked, planned, results assembled)."""

    def __init__(self, config: EmbeddingConfig | None = None, **settings: Any) -> None:
        if config is None or settings:
            # EmbeddingConfig's fields and the adapters' flat names (read_timeout=...)
            config = config_from(settings, base=config, owner=type(self).__name__)
        self._init(config)

    def _init(self, config: EmbeddingConfig) -> None:
        self._config = config
        self._query_task = config.query_task  # resolved once (the config is frozen)
        self._engine = Engine(config)
        self._sdk: Any = None  # the openai SDK object, built on first use
        prepare_tls(config)

    _exchange: Callable[[Send], Any]

    # pickling / copying: only the config travels (its Secret re-reads the environment)
    def __getstate__(self) -> dict[str, Any]:
        return {"config": self._config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._init(state["config"])

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(base_url={self._config.endpoint!r}, "
            f"model={self._engine.model!r})"
        )

    @property
    def config(self) -> EmbeddingConfig:
        """The frozen ``EmbeddingConfig`` of this client."""
        return self._config

    @property
    def server(self) -> Detection | None:
        """The server profile in use and how it was found (``_servers.Detection``);
        ``None`` until the first answer when ``server="auto"``."""
        return self._engine.detection()

    def _one(self, text: str, *, query: bool) -> tuple[Call, Callable[[], Flow], float | None]:
        """A call of one text: the call, a new flow for it each time it runs (twice when
        hedged), and how long to wait before hedging it (``None``: no hedge)."""
        engine = self._engine
        call = engine.new_call(query=query)
        start_call(engine, call, 1)
        delay = engine.endpoint.p95(texts=1) if query and self._config.hedge else None
        return call, (lambda: engine.batch_flow(call, [text], [0])), delay

    def _start(
        self,
        inputs: Inputs,
        progress: Progress | None,
        on_error: OnError,
        *,
        lists: bool,
        query: bool,
    ) -> _Run | None:
        """A call of ``inputs`` under way, planned, whose batches the driver runs
        (``None``: no text to send, no request)."""
        if not inputs.texts:
            return None  # nothing to send: no request
        engine = self._engine
        call = engine.new_call(query=query, on_error=on_error)
        plan, batches = self._plan(inputs.texts)
        counts = batch_counts(plan) if progress is not None else None
        indices = caller_indices(plan, inputs)
        start_call(engine, call, len(inputs.texts))  # ended by the driver (``traced``)
        return _Run(engine, call, plan, batches, Sink(plan, lists=lists), indices, progress, counts)

    def _plan(self, texts: list[str]) -> tuple[BatchPlan, Batches]:
        """The plan of a call's ``texts`` and its batches (``_batching.plan_call``)."""
        config = self._config
        return plan_call(texts, config.batch_size, config.max_concurrency, self._engine)

    def _query_texts(self, texts: Iterable[str]) -> list[str]:
        items = validate_texts(texts, max_chars=self._config.max_text_chars)
        task = self._query_task
        return [format_query(t, task) for t in items]

    def _inputs(self, texts: object, on_error: OnError, first: int = 0) -> Inputs:
        """Check a call's texts before anything is sent: ``"raise"`` raises the first
        rejected text's ``InputError``; ``"skip"`` sets the rejected ones aside.
        ``first``: the caller's index of the first text (``"raise"`` only)."""
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        items, rejected = screen_texts(texts, max_chars=self._config.max_text_chars, first=first)
        if not rejected:
            return Inputs(items, len(items), None, {}, first)
        if on_error == "raise":
            raise next(iter(rejected.values()))
        first = next(iter(rejected))
        _log.warning(
            "skipping %d input(s) that cannot be sent (first: index %d: %s)",
            len(rejected),
            first,
            rejected[first],
        )
        kept = [i for i in range(len(items)) if i not in rejected]
        return Inputs([items[i] for i in kept], len(items), kept, rejected)

    def _known_dim(self) -> int:
        """The size of this config's vectors when known without asking the server
        (``dimensions``, else a known Qwen3-Embedding model's size), else 0."""
        config = self._config
        return config.dimensions or known_model_dims(config.model or "") or 0


# --------------------------------------------------------------------------- sync


class EmbeddingClient(_ClientBase):
    """Embed texts through an endpoint's process-wide shared pool (blocking API).

    Build it from an ``EmbeddingConfig``, or from keyword arguments: its fields and the
    flat names the adapters take (``read_timeout=30``, ``max_retries=2``,
    ``max_connections=8``: ``_settings.SETTINGS``), applied to the ``config`` given
    with them. An unknown name raises ``ConfigError`` naming the closest one:

    ```python
    client = EmbeddingClient(base_url="http://gpu-box:30000/v1")
    vectors = client.embed_documents(["first text", "second text"])  # 2 x 1024
    ```

    Constructing a client opens nothing. Every client with equal transport settings
    shares one pool; concurrent batches run on a shared thread pool, at most
    ``max_concurrency`` per call. Thread-safe. Picklable (the API key is not pickled;
    it is re-read from ``QWEN_EMBED_API_KEY`` where unpickled).
    """

    @overload
    def embed_documents(
        self,
        texts: Sequence[str] | Iterable[str],
        *,
        progress: Progress | None = None,
        on_error: Literal["raise"] = "raise",
    ) -> list[list[float]]: ...
    @overload
    def embed_documents(
        self,
        texts: Sequence[str] | Iterable[str],
        *,
        progress: Progress | None = None,
        on_error: Literal["skip"],
    ) -> EmbeddingList: ...
    def embed_documents(
        self,
        texts: Sequence[str] | Iterable[str],
        *,
        progress: Progress | None = None,
        on_error: OnError = "raise",
    ) -> list[list[float]] | EmbeddingList:
        """Embed documents (sent raw, no instruction).

        Args:
            texts: the documents (``n`` texts, each a non-empty ``str``).
            progress: called once per finished batch with the texts it covered.
            on_error: ``"raise"`` (default) the error of the first input that cannot be
                embedded (its ``.index`` names it); ``"skip"``: embed every other text and
                return an ``EmbeddingList`` with ``None`` in that slot and the error in
                ``.errors`` — texts refused before sending (empty, whitespace-only, over
                ``max_text_chars``, not a ``str``) included.

        Returns:
            ``n x dim`` nested lists of floats, row ``i`` for ``texts[i]``; ``[]`` for an
            empty batch (no request). Every row has the same ``dim``: the known size of
            the model (or ``dimensions``), else the size of the call's first answer.

        Raises:
            InputError: invalid input (names the index); nothing is sent.
            ResponseError: also when a replica answers vectors of another size (names
                the replica and the index).
            HTTPStatusError, TransportError, CircuitOpenError: see ``errors``; an input's
                own failure carries its ``.index``.
        """
        inputs = self._inputs(texts, on_error)
        sink = self._embed(inputs, progress, on_error, lists=True, query=False)
        return finish_list(sink, inputs, on_error)

    def _embed_slice(
        self, texts: list[str], first: int, on_error: OnError = "raise"
    ) -> list[list[float]]:
        """``embed_documents(texts, on_error=on_error)`` for ``texts``, the slice of a
        caller's list that starts at its index ``first``: every error raised is built
        naming the index in that list (``.index`` and message)."""
        inputs = self._inputs(texts, on_error, first)
        sink = self._embed(inputs, None, on_error, lists=True, query=False)
        return finish_list(sink, inputs, on_error)

    @overload
    def embed_documents_array(
        self,
        texts: Sequence[str] | Iterable[str],
        *,
        progress: Progress | None = None,
        on_error: Literal["raise"] = "raise",
    ) -> FloatArray: ...
    @overload
    def embed_documents_array(
        self,
        texts: Sequence[str] | Iterable[str],
        *,
        progress: Progress | None = None,
        on_error: Literal["skip"],
    ) -> EmbeddingResult: ...
    def embed_documents_array(
        self,
        texts: Sequence[str] | Iterable[str],
        *,
        progress: Progress | None = None,
        on_error: OnError = "raise",
    ) -> FloatArray | EmbeddingResult:
        """Like ``embed_documents`` but returns a float32 numpy array, ``n x dim`` (with
        ``on_error="skip"``: an ``EmbeddingResult`` whose failed rows are NaN). An empty
        batch gives ``(0, dim)`` when the size is known without asking the server
        (``dimensions``, or a Qwen3-Embedding model named with its size), else
        ``(0, 0)``; no request. Raises only this library's errors."""
        inputs = self._inputs(texts, on_error)
        sink = self._embed(inputs, progress, on_error, lists=False, query=False)
        return finish_array(sink, inputs, on_error, self._known_dim())

    def embed_query(self, text: str) -> list[float]:
        """Embed one search query; ``dim`` floats. It is sent as
        ``Instruct: {task}\\nQuery:{text}`` with ``config.query_task`` (by default the
        Qwen3 retrieval task for Qwen3-Embedding models, raw for others).

        Raises:
            InputError: ``text`` is not a non-empty ``str``.
        """
        result: list[float] = self.embed_query_array(text).tolist()
        return result

    def embed_query_array(self, text: str) -> FloatArray:
        """Like ``embed_query`` but returns a float32 numpy array of shape ``(dim,)``."""
        validate_text(text, None, max_chars=self._config.max_text_chars)
        return self._embed_one(format_query(text, self._query_task), query=True)

    def embed_queries(self, texts: Sequence[str] | Iterable[str]) -> list[list[float]]:
        """Embed many queries (each with the instruction); ``n x dim`` floats."""
        inputs = Inputs(self._query_texts(texts), 0, None, {})
        sink = self._embed(inputs, None, "raise", lists=True, query=True)
        return finish_list(sink, inputs, "raise")

    def openai_client(self) -> openai.OpenAI:
        """An ``openai.OpenAI`` on the shared pool (SDK retries off: ``max_retries=0``).

        Its HTTP client's transport (``_sdk.SDKTransport``) sends through the endpoint's
        current pool with the client's timeouts, deadline (``RetryConfig.deadline``) and
        response size cap, so the object can be kept: it survives ``close_all()``, ``fork`` and the
        h2c fallback, and closing it closes nothing shared.
        """
        if self._sdk is None:
            function = self._engine.requests.key_function  # a callable key: per request
            key = self._engine.requests.secret if function is None else function.resolve
            self._sdk = _sdk.sync_openai(self._config, api_key=key)
        sdk: openai.OpenAI = self._sdk
        return sdk

    # ----------------------------------------------------------------- internals

    def _exchange(self, op: Send) -> Reply:
        key, request = op.replica.key, op.request
        function = self._engine.requests.key_function
        if function is not None:  # a callable key: called for each request
            request = self._engine.requests.keyed(request, function.resolve())
        try:
            return pool.sync_transport(key).send(request)
        except Retired:  # closed under us (close_all, reaper): once more, on the new one
            return pool.sync_transport(key).send(request)

    def _embed_one(self, text: str, *, query: bool) -> FloatArray:
        call, flow, delay = self._one(text, query=query)

        def one(abandon: threading.Event | None = None) -> FloatArray:
            return _row(run_sync(flow(), self._exchange, abandon))

        with traced(call):
            if delay is None:
                return one()
            row: FloatArray = hedged(one, delay, self._engine.endpoint.hedges)
            return row

    def _embed(
        self,
        inputs: Inputs,
        progress: Progress | None,
        on_error: OnError,
        *,
        lists: bool,
        query: bool,
    ) -> Sink | None:
        run = self._start(inputs, progress, on_error, lists=lists, query=query)
        if run is None:
            return None
        send = self._exchange

        def job(b: int) -> None:
            run.done(b, run_sync(run.flow(b), send))

        with traced(run.call):
            run_windowed(run.batches, job, run.limit, run.call)
        return run.sink


# --------------------------------------------------------------------------- async


class AsyncEmbeddingClient(_ClientBase):
    """The ``async`` twin of ``EmbeddingClient``: same settings, same shared pools.

    Really async: requests run on the running event loop through the pool's transport
    for that loop (one per loop, so ``asyncio.run()`` many times, Jupyter and threads
    with their own loops all work). At most ``max_concurrency`` batches of a call are in
    flight at once. Building one loads the HTTP library (``load_async_library``), so
    that its first call does not block the event loop importing it.
    """

    def _init(self, config: EmbeddingConfig) -> None:
        load_async_library()
        super()._init(config)

    @overload
    async def embed_documents(
        self,
        texts: Sequence[str] | Iterable[str],
        *,
        progress: Progress | None = None,
        on_error: Literal["raise"] = "raise",
    ) -> list[list[float]]: ...
    @overload
    async def embed_documents(
        self,
        texts: Sequence[str] | Iterable[str],
        *,
        progress: Progress | None = None,
        on_error: Literal["skip"],
    ) -> EmbeddingList: ...
    async def embed_documents(
        self,
        texts: Sequence[str] | Iterable[str],
        *,
        progress: Progress | None = None,
        on_error: OnError = "raise",
    ) -> list[list[float]] | EmbeddingList:
        """Embed documents; ``n x dim`` floats in input order (see
        ``EmbeddingClient.embed_documents``)."""
        inputs = self._inputs(texts, on_error)
        sink = await self._embed(inputs, progress, on_error, lists=True, query=False)
        return finish_list(sink, inputs, on_error)

    async def _embed_slice(
        self, texts: list[str], first: int, on_error: OnError = "raise"
    ) -> list[list[float]]:
        """Async ``EmbeddingClient._embed_slice``."""
        inputs = self._inputs(texts, on_error, first)
        sink = await self._embed(inputs, None, on_error, lists=True, query=False)
        return finish_list(sink, inputs, on_error)

    @overload
    async def embed_documents_array(
        self,
        texts: Sequence[str] | Iterable[str],
        *,
        progress: Progress | None = None,
        on_error: Literal["raise"] = "raise",
    ) -> FloatArray: ...
    @overload
    async def embed_documents_array(
        self,
        texts: Sequence[str] | Iterable[str],
        *,
        progress: Progress | None = None,
        on_error: Literal["skip"],
    ) -> EmbeddingResult: ...
    async def embed_documents_array(
        self,
        texts: Sequence[str] | Iterable[str],
        *,
        progress: Progress | None = None,
        on_error: OnError = "raise",
    ) -> FloatArray | EmbeddingResult:
        """Embed documents into a float32 numpy array, ``n x dim``."""
        inputs = self._inputs(texts, on_error)
        sink = await self._embed(inputs, progress, on_error, lists=False, query=False)
        return finish_array(sink, inputs, on_error, self._known_dim())

    async def embed_query(self, text: str) -> list[float]:
        """Embed one query with the Qwen3 instruction; ``dim`` floats."""
        # embed_query_array inlined: one coroutine less per query
        validate_text(text, None, max_chars=self._config.max_text_chars)
        query = format_query(text, self._query_task)
        result: list[float] = (await self._embed_one(query, query=True)).tolist()
        return result

    async def embed_query_array(self, text: str) -> FloatArray:
        """Embed one query into a float32 numpy array of shape ``(dim,)``."""
        validate_text(text, None, max_chars=self._config.max_text_chars)
        query = format_query(text, self._query_task)
        return await self._embed_one(query, query=True)

    async def embed_queries(self, texts: Sequence[str] | Iterable[str]) -> list[list[float]]:
        """Embed many queries (each with the instruction); ``n x dim`` floats."""
        inputs = Inputs(self._query_texts(texts), 0, None, {})
        sink = await self._embed(inputs, None, "raise", lists=True, query=True)
        return finish_list(sink, inputs, "raise")

    def openai_client(self) -> openai.AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` on the shared pools (``max_retries=0``).

        Its HTTP client's transport (``_sdk.AsyncSDKTransport``) sends through the running
        event loop's pool with the client's timeouts, deadline and size cap, so one
        object works on every loop (``asyncio.run()`` many times), after ``close_all()``
        and the h2c fallback; closing it closes nothing shared.
        """
        if self._sdk is None:
            function = self._engine.requests.key_function  # a callable key: per request
            key = self._engine.requests.secret if function is None else function.aresolve
            self._sdk = _sdk.async_openai(self._config, api_key=key)
        async_sdk: openai.AsyncOpenAI = self._sdk
        return async_sdk

    # ----------------------------------------------------------------- internals

    async def _exchange(self, op: Send) -> Reply:
        key, request = op.replica.key, op.request
        function = self._engine.requests.key_function
        if function is not None:  # a callable key: awaited for each request
            request = self._engine.requests.keyed(request, await function.aresolve())
        try:
            return await pool.async_transport(key).send(request)
        except Retired:
            return await pool.async_transport(key).send(request)

    async def _embed_one(self, text: str, *, query: bool) -> FloatArray:
        call, flow, delay = self._one(text, query=query)
        with traced(call):
            if delay is None:  # the common path: no extra coroutine per query
                return _row(await run_async(flow(), self._exchange))

            async def one() -> FloatArray:
                return _row(await run_async(flow(), self._exchange))

            row: FloatArray = await ahedged(one, delay, self._engine.endpoint.hedges)
            return row

    async def _embed(
        self,
        inputs: Inputs,
        progress: Progress | None,
        on_error: OnError,
        *,
        lists: bool,
        query: bool,
    ) -> Sink | None:
        run = self._start(inputs, progress, on_error, lists=lists, query=query)
        if run is None:
            return None
        send = self._exchange

        async def job(b: int) -> None:
            run.done(b, await run_async(run.flow(b), send))

        with traced(run.call):
            await arun_windowed(run.batches, job, run.limit, run.call)
        return run.sink
