"""``EmbeddingClient`` and ``AsyncEmbeddingClient``: the API the adapters and CLI call.

Both are thin. Every decision of a call — batching, replica choice, retries,
bisection, fallbacks, checks — lives once in ``_engine.Engine`` as I/O-free flows; the
two classes differ only in how they run a flow: ``EmbeddingClient`` with blocking I/O on
the pool's ``SyncTransport`` (concurrent batches on a shared thread pool),
``AsyncEmbeddingClient`` with awaits on the running loop's ``AsyncTransport``.

The hot path posts JSON through the pooled HTTP client with this package's codec
(orjson, base64 -> numpy): the openai SDK costs ~3 ms of CPU per request on top of
~1 ms for the raw call (DESIGN.md section 5). ``openai_client()`` hands an
``openai.OpenAI`` on the same pool (same caps and deadline; ``_sdk``) to users who want
the SDK's surface.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from . import _pool as pool
from ._config import EmbeddingConfig, OnError, known_model_dims
from ._engine import Engine
from ._flat import config_from
from ._protocol import (
    BatchPlan,
    FloatArray,
    estimate_tokens,
    format_query,
    plan_batches,
    screen_texts,
    split_by_tokens,
    validate_text,
    validate_texts,
)
from ._retry import parse_retry_after
from ._run import (
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
from ._transport import Reply, Retired, _sdk
from .errors import (
    ConfigError,
    HTTPStatusError,
    InputError,
    PoolTimeout,
    QwenEmbedError,
    TimeoutException,
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


class EmbeddingList(list):  # type: ignore[type-arg]
    """The vectors of an ``on_error="skip"`` call: ``n`` items, each ``dim`` floats or
    ``None`` for an input that could not be embedded.

    Attributes:
        errors: the caller's input index -> the error that input met.
    """

    errors: dict[int, QwenEmbedError]

    def __init__(self, rows: Iterable[Any] = (), errors: dict[int, QwenEmbedError] | None = None):
        super().__init__(rows)
        self.errors = dict(errors or {})


@dataclass
class EmbeddingResult:
    """The result of an ``on_error="skip"`` array call.

    Attributes:
        vectors: float32, ``n x dim``; rows of failed inputs are NaN.
        errors: the caller's input index -> the error that input met.
    """

    vectors: FloatArray
    errors: dict[int, QwenEmbedError] = field(default_factory=dict)

    @property
    def ok(self) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """Boolean mask, ``n``: ``True`` where the input was embedded."""
        mask = np.ones(len(self.vectors), dtype=bool)
        if self.errors:
            mask[list(self.errors)] = False
        return mask


_AUTO_WINDOW = 256
_OVERLOAD_STATUS = frozenset({429, 503})


def _gate_timeout(op: Send, gate: Any) -> PoolTimeout:
    limit = getattr(getattr(gate, "limit", None), "limit", "?")
    return PoolTimeout(
        f"no slot of the adaptive concurrency limit of {op.replica.label} (now {limit} "
        f"requests in flight) within {op.request.total} s (the call's deadline): the "
        "server is pushing back (429/503) or slower than the call allows",
        url=op.replica.label,
    )


def _overload(exc: QwenEmbedError) -> bool:
    """Whether a failed exchange says the server is past its capacity (a sample that
    should shrink an adaptive limit)."""
    if isinstance(exc, HTTPStatusError):
        return exc.status in _OVERLOAD_STATUS
    return isinstance(exc, TimeoutException) and not isinstance(exc, PoolTimeout)


# --------------------------------------------------------------------------- sinks


class _Sink:
    """Where decoded batches go as they finish, so no second full copy is kept: an
    array allocated at the first batch (``n_unique x dim``), or plain lists per batch."""

    def __init__(self, plan: BatchPlan, *, lists: bool) -> None:
        self.plan = plan
        self.lists = lists
        self.array: FloatArray | None = None
        self.rows: list[Any] | None = [None] * len(plan.unique) if lists else None
        self.failed: dict[int, QwenEmbedError] = {}  # unique row -> error
        self._lock = threading.Lock()  # batches finish on several threads

    def _allocate(self, dim: int) -> FloatArray:
        with self._lock:
            if self.array is None:
                array = np.empty((len(self.plan.unique), dim), np.float32)
                array.fill(np.nan)
                self.array = array
            return self.array

    def put(self, b: int, part: Part) -> None:
        start = self.plan.batches[b][0]
        for offset, rows in part.pieces:
            at = start + offset
            if self.rows is not None:
                self.rows[at : at + len(rows)] = rows.tolist()
            else:
                array = self.array if self.array is not None else self._allocate(rows.shape[1])
                array[at : at + len(rows)] = rows
        for offset, error in part.failed.items():
            self.failed[start + offset] = error
            if self.rows is not None:
                self.rows[start + offset] = None

    def _errors(self) -> dict[int, QwenEmbedError]:
        plan = self.plan
        if not self.failed:
            return {}
        if plan.positions is None:
            return {plan.first_index[row]: e for row, e in self.failed.items()}
        return {
            i: self.failed[int(row)]
            for i, row in enumerate(plan.positions)
            if int(row) in self.failed
        }

    def array_result(self, dim: int) -> tuple[FloatArray, dict[int, QwenEmbedError]]:
        """The rows (``n_inputs x d``) and errors; ``d`` is ``dim`` when every input
        failed (no answer said the size)."""
        plan = self.plan
        arr = self.array
        if arr is None:  # every input failed
            arr = np.full((len(plan.unique), dim), np.nan, dtype=np.float32)
        if plan.positions is not None:
            arr = arr[plan.positions]
        return arr, self._errors()

    def list_result(self) -> tuple[list[Any], dict[int, QwenEmbedError]]:
        plan = self.plan
        rows = self.rows
        if rows is None:  # cannot happen
            raise RuntimeError("internal error: rows is None")
        if plan.positions is not None:
            seen: set[int] = set()
            out: list[Any] = []
            for row in plan.positions.tolist():
                value = rows[row]
                if row in seen and value is not None:
                    value = list(value)  # duplicates get their own list
                seen.add(row)
                out.append(value)
            rows = out
        return rows, self._errors()


class _Batches:
    """The batches of one call, as indexes into ``plan.batches``, read one at a time by
    the window (``run_windowed``) as a slot frees up.

    For a stated ``batch_size`` the plan was cut up front. For ``batch_size="auto"``
    each batch is cut when it is about to be sent, at the size the replicas' batch
    sizers ask for now (``Engine.auto_batch_size``: they learn from the answers of the
    batches before it), until the rest of the call fits in the window's batches: from
    there every batch has that size (the last wave in equal batches). Always within the
    known and learned limits (texts per request, read at each cut; ``tokens``,
    estimated tokens per request).
    """

    def __init__(
        self,
        plan: BatchPlan,
        window: int,
        tokens: int | None,
        engine: Engine | None,
        spread: int | None = None,
    ) -> None:
        self.plan = plan
        self.engine = engine
        self.tokens = tokens
        self.window = window
        self.spread = spread or window
        self._next = 0
        self._at = 0
        self._last = 0  # the size of the last wave's batches, once it is cut
        self._sizes = (
            [estimate_tokens(t) for t in plan.unique]
            if engine is not None and tokens is not None
            else None
        )
        self.single = len(plan.batches) == 1 if engine is None else self._first_is_all()

    def _size(self) -> int:
        if self.engine is None:  # cannot happen
            raise RuntimeError("internal error: engine is None")
        engine = self.engine
        # The first ``spread`` batches leave together (the window is empty): each is cut
        # over the slots still free, so a call that fits one wave goes out in equal
        # batches (400 texts, 4 slots: 4 x 100, not 100, 75, 57, 42 and a second wave).
        # Later batches are cut one at a time as a slot frees, over the whole spread.
        # Once the rest fits in the batches the window has left, that size holds to the
        # end: the last wave goes in equal batches too (952 texts left, 4 slots: 238, 238,
        # 238, 238, not 238, 179, 134, ... 32, a tail of round trips at a fraction of the
        # size). An overload answered meanwhile no longer shrinks these few batches; a
        # known or learned text limit still caps them (below), a token budget splits them.
        size = self._last
        if not size:
            cut, remaining = len(self.plan.batches), len(self.plan.unique) - self._at
            slots = self.spread - cut if cut < self.spread else self.spread
            size = engine.auto_batch_size(remaining, slots)
            if size * slots >= remaining:
                self._last = size
        count = engine.batch_limits()[0]  # learned during the call too
        return size if count is None else max(1, min(size, count))

    def _first_is_all(self) -> bool:
        n = len(self.plan.unique)
        return bool(n) and self._cut() == n

    def _cut(self) -> int:
        """Cut the next batch; its stop."""
        plan, start = self.plan, self._at
        n = len(plan.unique)
        stop = min(n, start + self._size())
        if self._sizes is not None and self.tokens is not None:
            stop = split_by_tokens(self._sizes, start, stop, self.tokens, stop - start)[0][1]
        plan.batches.append((start, stop))
        self._at = stop
        return stop

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> int:
        b = self._next
        if b >= len(self.plan.batches):
            if self.engine is None or self._at >= len(self.plan.unique):
                raise StopIteration
            self._cut()
        self._next = b + 1
        return b


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


# --------------------------------------------------------------------------- base


class _ClientBase:
    """What the sync and async clients share: settings, engine, pickling."""

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
        # how a flow's Send is performed: through the adaptive gate only when there is
        # one (``max_concurrency="auto"``), else straight to the pool (one layer less)
        self._perform = self._send if config.max_concurrency == "auto" else self._exchange

    _send: Callable[[Send], Any]
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
        """The server profile in use and how it was found (``servers.Detection``);
        ``None`` until the first answer when ``server="auto"``."""
        return self._engine.detection()

    def _plan(self, texts: list[str]) -> tuple[BatchPlan, _Batches]:
        window = self._window()
        count, tokens = self._engine.batch_limits()
        size = self._config.batch_size
        if size == "auto":
            plan = plan_batches(texts, max(1, len(texts)))
            plan.batches.clear()  # cut one at a time, as the window frees a slot
            batches = _Batches(plan, window, tokens, self._engine, self._spread())
            return plan, batches
        if count is not None and count < size:
            size = count
        plan = plan_batches(texts, size, max_tokens=tokens)
        return plan, _Batches(plan, window, tokens, None)

    def _window(self) -> int:
        concurrency = self._config.max_concurrency
        # "auto": the endpoint's adaptive gate bounds the requests in flight
        return concurrency if isinstance(concurrency, int) else _AUTO_WINDOW

    def _spread(self) -> int:
        """Requests in flight a call's batches are spread over (to size them): the
        window, or with ``max_concurrency="auto"`` the adaptive limit now."""
        concurrency = self._config.max_concurrency
        if isinstance(concurrency, int):
            return concurrency
        gate = self._engine.adaptive_gate(self._engine.endpoint.replicas[0])
        return max(1, int(gate.slots)) if gate is not None else 4

    @staticmethod
    def _batch_counts(plan: BatchPlan) -> Callable[[int], int]:
        """Input texts covered by batch ``b`` (duplicates included), for progress."""
        if plan.positions is None:
            return lambda b: plan.batches[b][1] - plan.batches[b][0]
        per_row = np.bincount(plan.positions, minlength=len(plan.unique))
        return lambda b: int(per_row[plan.batches[b][0] : plan.batches[b][1]].sum())

    def _query_texts(self, texts: Iterable[str]) -> list[str]:
        items = validate_texts(texts, max_chars=self._config.max_text_chars)
        task = self._query_task
        return [format_query(t, task) for t in items]

    def _inputs(self, texts: object, on_error: OnError, first: int = 0) -> _Inputs:
        """Check a call's texts before anything is sent: ``"raise"`` raises the first
        rejected text's ``InputError``; ``"skip"`` sets the rejected ones aside.
        ``first``: the caller's index of the first text (``"raise"`` only)."""
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        items, rejected = screen_texts(texts, max_chars=self._config.max_text_chars, first=first)
        if not rejected:
            return _Inputs(items, len(items), None, {}, first)
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
        return _Inputs([items[i] for i in kept], len(items), kept, rejected)

    def _known_dim(self) -> int:
        """The size of this config's vectors when known without asking the server
        (``dimensions``, else a known Qwen3-Embedding model's size), else 0."""
        config = self._config
        return config.dimensions or known_model_dims(config.model or "") or 0


@dataclass
class _Inputs:
    """A call's texts after the checks before sending.

    Attributes:
        texts: the texts to send (the rejected ones left out).
        size: the number of inputs of the call (``n``), rejected ones included.
        kept: the caller's index of each text in ``texts``; ``None``: all were kept.
        rejected: the caller's index -> why that text cannot be sent.
        first: the caller's index of ``texts[0]`` when they are a slice of the caller's
            list (every error names the index in that list).
    """

    texts: list[str]
    size: int
    kept: list[int] | None
    rejected: dict[int, InputError]
    first: int = 0

    def errors(self, found: dict[int, QwenEmbedError]) -> dict[int, QwenEmbedError]:
        """Every input's error by the caller's index, in index order: ``found`` (keyed
        by position in ``texts``) and the rejected inputs."""
        if self.kept is None:
            return found
        kept = self.kept
        merged: dict[int, QwenEmbedError] = {kept[j]: e for j, e in found.items()}
        merged.update(self.rejected)
        return dict(sorted(merged.items()))


def _caller_indices(plan: BatchPlan, inputs: _Inputs) -> list[int]:
    """For each unique text of ``plan``, the caller's index of its first occurrence
    (errors name it), counting the inputs set aside before sending."""
    if inputs.kept is None:
        first = inputs.first
        return [first + i for i in plan.first_index] if first else plan.first_index
    kept = inputs.kept
    return [kept[i] for i in plan.first_index]


def _finish_list(
    sink: _Sink | None, inputs: _Inputs, on_error: OnError
) -> list[list[float]] | EmbeddingList:
    rows, errors = sink.list_result() if sink is not None else ([], {})
    if inputs.kept is not None:
        full: list[Any] = [None] * inputs.size
        for j, i in enumerate(inputs.kept):
            full[i] = rows[j]
        rows = full
    if on_error == "skip":
        return EmbeddingList(rows, inputs.errors(errors))
    return rows


def _finish_array(
    sink: _Sink | None, inputs: _Inputs, on_error: OnError, dim: int
) -> FloatArray | EmbeddingResult:
    if sink is not None:
        arr, errors = sink.array_result(dim)
    else:
        arr, errors = np.empty((0, dim), dtype=np.float32), {}
    if inputs.kept is not None:
        full = np.full((inputs.size, arr.shape[1] or dim), np.nan, dtype=np.float32)
        if len(arr):
            full[inputs.kept] = arr
        arr = full
    if on_error == "skip":
        return EmbeddingResult(arr, inputs.errors(errors))
    return arr


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
        return _finish_list(sink, inputs, on_error)

    def _embed_slice(self, texts: list[str], first: int) -> list[list[float]]:
        """``embed_documents(texts)`` for ``texts``, the slice of a caller's list that
        starts at its index ``first``: every error is built naming the index in that
        list (``.index`` and message)."""
        inputs = self._inputs(texts, "raise", first)
        sink = self._embed(inputs, None, "raise", lists=True, query=False)
        return _finish_list(sink, inputs, "raise")

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
        return _finish_array(sink, inputs, on_error, self._known_dim())

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
        inputs = _Inputs(self._query_texts(texts), 0, None, {})
        sink = self._embed(inputs, None, "raise", lists=True, query=True)
        return _finish_list(sink, inputs, "raise")

    def openai_client(self) -> openai.OpenAI:
        """An ``openai.OpenAI`` on the shared pool (SDK retries off: ``max_retries=0``).

        Its HTTP client's transport (``_sdk.SDKTransport``) sends through the endpoint's
        current pool with the client's timeouts, deadline (``RetryConfig.deadline``) and
        response size cap, so the object can be kept: it survives ``close_all()``, ``fork`` and the
        h2c fallback, and closing it closes nothing shared.
        """
        if self._sdk is None:
            self._sdk = _sdk.sync_openai(self._config, api_key=self._engine.secret)
        sdk: openai.OpenAI = self._sdk
        return sdk

    # ----------------------------------------------------------------- internals

    def _send(self, op: Send) -> Reply:
        gate = self._engine.adaptive_gate(op.replica)
        if gate is None:
            return self._exchange(op)
        # waiting here replaces waiting in the window: bounded by the call's deadline
        # (Request.total), not by the pool timeout
        if not gate.acquire(op.request.total):
            raise _gate_timeout(op, gate)
        started = time.perf_counter()
        sample, overload, wait = False, False, None
        try:
            reply = self._exchange(op)
            sample = True
            overload = reply.status in _OVERLOAD_STATUS
            if overload:
                wait = parse_retry_after(reply.headers)
            return reply
        except QwenEmbedError as exc:
            sample, overload = True, _overload(exc)
            wait = exc.retry_after if isinstance(exc, HTTPStatusError) else None
            raise
        finally:
            if sample:
                gate.release(time.perf_counter() - started, overload, wait)
            else:  # cancelled or interrupted: no answer to learn from
                gate.release()

    def _exchange(self, op: Send) -> Reply:
        key = op.replica.key
        try:
            return pool.sync_transport(key).send(op.request)
        except Retired:  # closed under us (close_all, reaper): once more, on the new one
            return pool.sync_transport(key).send(op.request)

    def _embed_one(self, text: str, *, query: bool) -> FloatArray:
        engine = self._engine
        call = engine.new_call(query=query)

        def one(abandon: threading.Event | None = None) -> FloatArray:
            part: Part = run_sync(engine.batch_flow(call, [text], [0]), self._perform, abandon)
            row: FloatArray = part.pieces[0][1][0]
            return row

        delay = engine.endpoint.p95() if query and self._config.hedge else None
        if delay is None:
            return one()
        row: FloatArray = hedged(one, delay, engine.endpoint.hedges)
        return row

    def _embed(
        self,
        inputs: _Inputs,
        progress: Progress | None,
        on_error: OnError,
        *,
        lists: bool,
        query: bool,
    ) -> _Sink | None:
        if not inputs.texts:
            return None  # nothing to send: no request
        engine = self._engine
        call = engine.new_call(query=query, on_error=on_error)
        plan, batches = self._plan(inputs.texts)
        sink = _Sink(plan, lists=lists)
        counts = self._batch_counts(plan) if progress is not None else None
        send = self._perform
        indices = _caller_indices(plan, inputs)

        def job(b: int) -> None:
            start, stop = plan.batches[b]
            part = run_sync(
                engine.batch_flow(call, plan.unique[start:stop], indices[start:stop]), send
            )
            sink.put(b, part)
            if progress is not None and counts is not None:
                progress(counts(b))

        run_windowed(batches, job, 1 if batches.single else batches.window, call)
        return sink


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
        return _finish_list(sink, inputs, on_error)

    async def _embed_slice(self, texts: list[str], first: int) -> list[list[float]]:
        """Async ``EmbeddingClient._embed_slice``."""
        inputs = self._inputs(texts, "raise", first)
        sink = await self._embed(inputs, None, "raise", lists=True, query=False)
        return _finish_list(sink, inputs, "raise")

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
        return _finish_array(sink, inputs, on_error, self._known_dim())

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
        inputs = _Inputs(self._query_texts(texts), 0, None, {})
        sink = await self._embed(inputs, None, "raise", lists=True, query=True)
        return _finish_list(sink, inputs, "raise")

    def openai_client(self) -> openai.AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` on the shared pools (``max_retries=0``).

        Its HTTP client's transport (``_sdk.AsyncSDKTransport``) sends through the running
        event loop's pool with the client's timeouts, deadline and size cap, so one
        object works on every loop (``asyncio.run()`` many times), after ``close_all()``
        and the h2c fallback; closing it closes nothing shared.
        """
        if self._sdk is None:
            self._sdk = _sdk.async_openai(self._config, api_key=self._engine.secret)
        async_sdk: openai.AsyncOpenAI = self._sdk
        return async_sdk

    # ----------------------------------------------------------------- internals

    async def _send(self, op: Send) -> Reply:
        gate = self._engine.adaptive_gate(op.replica)
        if gate is None:
            return await self._exchange(op)
        # waiting here replaces waiting in the window: bounded by the call's deadline
        # (Request.total), not by the pool timeout
        if not await gate.aacquire(op.request.total):
            raise _gate_timeout(op, gate)
        started = time.perf_counter()
        sample, overload, wait = False, False, None
        try:
            reply = await self._exchange(op)
            sample = True
            overload = reply.status in _OVERLOAD_STATUS
            if overload:
                wait = parse_retry_after(reply.headers)
            return reply
        except QwenEmbedError as exc:
            sample, overload = True, _overload(exc)
            wait = exc.retry_after if isinstance(exc, HTTPStatusError) else None
            raise
        finally:
            if sample:
                gate.release(time.perf_counter() - started, overload, wait)
            else:  # cancelled or interrupted: no answer to learn from
                gate.release()

    async def _exchange(self, op: Send) -> Reply:
        key = op.replica.key
        try:
            return await pool.async_transport(key).send(op.request)
        except Retired:
            return await pool.async_transport(key).send(op.request)

    async def _embed_one(self, text: str, *, query: bool) -> FloatArray:
        engine = self._engine
        call = engine.new_call(query=query)
        delay = engine.endpoint.p95() if query and self._config.hedge else None
        if delay is None:  # the common path: no extra coroutine per query
            part: Part = await run_async(engine.batch_flow(call, [text], [0]), self._perform)
            first: FloatArray = part.pieces[0][1][0]
            return first

        async def one() -> FloatArray:
            part: Part = await run_async(engine.batch_flow(call, [text], [0]), self._perform)
            row: FloatArray = part.pieces[0][1][0]
            return row

        row: FloatArray = await ahedged(one, delay, engine.endpoint.hedges)
        return row

    async def _embed(
        self,
        inputs: _Inputs,
        progress: Progress | None,
        on_error: OnError,
        *,
        lists: bool,
        query: bool,
    ) -> _Sink | None:
        if not inputs.texts:
            return None  # nothing to send: no request
        engine = self._engine
        call = engine.new_call(query=query, on_error=on_error)
        plan, batches = self._plan(inputs.texts)
        sink = _Sink(plan, lists=lists)
        counts = self._batch_counts(plan) if progress is not None else None
        send = self._perform
        indices = _caller_indices(plan, inputs)

        async def job(b: int) -> None:
            start, stop = plan.batches[b]
            part = await run_async(
                engine.batch_flow(call, plan.unique[start:stop], indices[start:stop]), send
            )
            sink.put(b, part)
            if progress is not None and counts is not None:
                progress(counts(b))

        await arun_windowed(batches, job, 1 if batches.single else batches.window, call)
        return sink
