"""``EmbeddingClient`` and ``AsyncEmbeddingClient``: the API the adapters and CLI call.

Both are thin: they validate input, plan batches (``protocol``), send each batch
through the endpoint's shared pool (``pool``) under the one retry layer (``retry``),
decode and check the vectors, and put them back in input order. The logic lives once in
``_ClientBase``; the two classes differ only where they do I/O.

The hot path posts JSON through the pooled HTTP client with this package's codec
(orjson, base64 -> numpy): the openai SDK costs ~3 ms of CPU per request on top of
~1 ms for the raw call (DESIGN.md section 5). ``use_sdk=True`` routes embedding calls
through an ``openai.OpenAI`` on the same pool instead, and ``openai_client()`` hands
that SDK client to users who want its surface.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, cast

import numpy as np
import openai

from . import pool, servers
from ._http import httpx
from .config import EmbeddingConfig
from .errors import (
    BadRequestError,
    BatchTooLargeError,
    ConnectError,
    ConnectTimeout,
    NetworkError,
    PoolTimeout,
    QwenEmbedError,
    ReadTimeout,
    RemoteProtocolError,
    ResponseError,
    HTTPStatusError,
    TransportError,
    WriteTimeout,
    error_from_response,
    scrub,
)
from .protocol import (
    BatchPlan,
    FloatArray,
    decode_checked,
    encode_request,
    format_query,
    normalize_rows,
    parse_body,
    plan_batches,
    validate_text,
    validate_texts,
)
from .retry import acall_with_retry, call_with_retry, parse_retry_after, retry_reason
from .servers import Detection

__all__ = ["AsyncEmbeddingClient", "EmbeddingClient", "Progress"]

_log = logging.getLogger("qwen_embed_plugins")

Progress = Callable[[int], None]
"""A progress callback: called once per finished batch with the number of input texts
that batch covered."""

_JSON_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}
_BASE64_REFUSED = re.compile(r"base64|encoding[_ ]format", re.I)
_SERVER_POSITION = re.compile(r"\b(?:index|input|item)\s*(?:at\s+(?:index\s+)?)?\[?(\d+)\]?", re.I)
_DIMENSIONS_REFUSED = re.compile(r"dimension|matryoshka|mrl", re.I)

# --------------------------------------------------------------------------- threads

_executor_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_EXECUTOR_THREADS = 64


def _shared_executor() -> ThreadPoolExecutor:
    """Threads that carry concurrent batches of sync calls (one set per process)."""
    global _executor
    ex = _executor
    if ex is None:
        with _executor_lock:
            if _executor is None:
                _executor = ThreadPoolExecutor(
                    max_workers=_EXECUTOR_THREADS, thread_name_prefix="qwen-embed"
                )
            ex = _executor
    return ex


def _executor_after_fork() -> None:
    global _executor, _executor_lock
    _executor = None  # its threads do not exist in the child
    _executor_lock = threading.Lock()


os.register_at_fork(after_in_child=_executor_after_fork)


def _run_windowed(count: int, job: Callable[[int], None], limit: int) -> None:
    """Run ``job(0..count-1)`` with at most ``limit`` in flight; first error wins."""
    if count == 1 or limit == 1:
        for i in range(count):
            job(i)
        return
    ex = _shared_executor()
    pending: set[Future[None]] = set()
    nxt = 0
    while nxt < count or pending:
        while nxt < count and len(pending) < limit:
            pending.add(ex.submit(job, nxt))
            nxt += 1
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        for fut in done:
            exc = fut.exception()
            if exc is not None:
                for other in pending:
                    other.cancel()
                wait(pending)
                raise exc


async def _arun_windowed(count: int, job: Callable[[int], Awaitable[None]], limit: int) -> None:
    """Async twin of ``_run_windowed``: tasks on the running loop."""
    if count == 1 or limit == 1:
        for i in range(count):
            await job(i)
        return
    pending: set[asyncio.Future[None]] = set()
    nxt = 0
    try:
        while nxt < count or pending:
            while nxt < count and len(pending) < limit:
                pending.add(asyncio.ensure_future(job(nxt)))
                nxt += 1
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if exc is not None:
                    raise exc
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


# --------------------------------------------------------------------------- base


class _ClientBase:
    """I/O-free parts shared by the sync and async clients."""

    def __init__(self, config: EmbeddingConfig | None = None, **settings: Any) -> None:
        if config is None:
            config = EmbeddingConfig(**settings)
        elif settings:
            config = config.replace(**settings)
        self._init(config)

    def _init(self, config: EmbeddingConfig) -> None:
        self._config = config
        self._key = config.pool_key
        self._url = config.embeddings_url
        self._model: str = config.model or ""
        self._secret = config.api_key_value()
        self._metrics = pool.endpoint_metrics(self._key)
        self._breaker = pool.endpoint_breaker(
            self._key,
            threshold=config.retry.circuit_failure_threshold,
            cooldown=config.retry.circuit_cooldown,
        )
        self._state = pool.endpoint_state(self._key, self._model)
        self._sdk: Any = None  # the openai SDK object, built on first use
        # The server profile: named by ``server=`` (no detection), else detected on the
        # first call, once per endpoint and process (servers.detect).
        self._detection: Detection | None = None
        if config.server != "auto":
            self._use(Detection(servers.get_profile(config.server), "server= setting"))

    # pickling / copying: only the config travels (its Secret re-reads the environment)
    def __getstate__(self) -> dict[str, Any]:
        return {"config": self._config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._init(state["config"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self._config.endpoint!r}, model={self._model!r})"

    @property
    def config(self) -> EmbeddingConfig:
        """The frozen ``EmbeddingConfig`` of this client."""
        return self._config

    @property
    def server(self) -> Detection | None:
        """The server profile in use and how it was found (``servers.Detection``);
        ``None`` until the first call when ``server="auto"``."""
        return self._detection

    # ----------------------------------------------------------------- server profile

    def _use(self, detection: Detection) -> None:
        self._detection = detection
        self._url = detection.embeddings_url or self._config.embeddings_url

    def _detect_args(self) -> tuple[Any, str, Any]:
        t = self._key.timeout
        connect, read = servers.probe_timeout(t.connect, t.read)
        timeout = httpx.Timeout(connect=connect, read=read, write=read, pool=read)
        return self._key, str(self._config.base_url), timeout

    def _refresh_server(self) -> bool:
        """Pick up a refinement of a generic profile; ``True`` when detection is needed."""
        detection = self._detection
        if detection is None:
            return True
        if detection.profile is servers.GENERIC and self._config.server == "auto":
            found = servers.cached_detection(self._key)
            if found is not None and found.profile is not servers.GENERIC:
                self._use(found)
        return False

    def _ensure_server(self) -> None:
        if self._refresh_server():
            key, base, timeout = self._detect_args()
            self._use(servers.detect(key, base, lambda: pool.get_sync_client(key), timeout))
        self._wire_options()  # dimensions checked against the profile before any request

    async def _aensure_server(self) -> None:
        if self._refresh_server():
            key, base, timeout = self._detect_args()
            self._use(await servers.adetect(key, base, lambda: pool.get_async_client(key), timeout))
        self._wire_options()

    def _observe(self, headers: Any) -> None:
        """Refine a generic auto-detected profile from an embedding response (free)."""
        detection = self._detection
        if (
            detection is not None
            and detection.profile is servers.GENERIC
            and self._config.server == "auto"
        ):
            found = servers.identify_response(headers)
            if found is not None:
                servers.upgrade(self._key, found)
                self._use(found)

    # ----------------------------------------------------------------- planning

    def _plan(self, texts: list[str]) -> BatchPlan:
        size = self._config.batch_size
        for limit in (self._state.batch_limit, self._profile_now().batch_limit):
            if limit is not None and limit < size:
                size = limit
        return plan_batches(texts, size)

    def _profile_now(self) -> servers.ServerProfile:
        return servers.GENERIC if self._detection is None else self._detection.profile

    @staticmethod
    def _batch_counts(plan: BatchPlan) -> list[int]:
        """Input texts covered by each batch (duplicates included), for progress."""
        if plan.positions is None:
            return [stop - start for start, stop in plan.batches]
        per_row = np.bincount(plan.positions, minlength=len(plan.unique))
        return [int(per_row[start:stop].sum()) for start, stop in plan.batches]

    @staticmethod
    def _assemble(plan: BatchPlan, parts: Sequence[FloatArray | None]) -> FloatArray:
        arrays = [p for p in parts if p is not None]
        assert len(arrays) == len(plan.batches), "a batch has no result"
        unique = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        return unique if plan.positions is None else unique[plan.positions]

    def _wire_options(self) -> tuple[str, int | None]:
        cfg = self._config
        profile = self._profile_now()
        fmt: str = cfg.encoding_format
        if fmt == "auto":
            fmt = "float" if self._state.base64_ok is False or not profile.base64 else "base64"
        dims = None
        if self._state.dimensions_ok is not False:
            dims = servers.wire_dimensions(profile, cfg.dimensions, self._model)
        return fmt, dims

    def _adapt(self, exc: BadRequestError, fmt: str, dims: int | None) -> bool:
        """Learn from a 400 that the server refuses base64 or ``dimensions``.

        Returns ``True`` when the request should be resent with other options.
        """
        message = exc.message
        if (
            fmt == "base64"
            and self._config.encoding_format == "auto"
            and _BASE64_REFUSED.search(message)
        ):
            self._state.base64_ok = False
            self._metrics.fallback("float_encoding")
            _log.warning(
                "%s refused encoding_format=base64; using float from now on", self._config.endpoint
            )
            return True
        if dims is not None and _DIMENSIONS_REFUSED.search(message):
            self._state.dimensions_ok = False
            self._metrics.fallback("client_side_dimensions")
            _log.warning(
                "%s rejected dimensions=%d; slicing and renormalising client-side",
                self._config.endpoint,
                dims,
            )
            return True
        return False

    @staticmethod
    def _name_input(exc: BadRequestError, indices: list[int]) -> None:
        """Translate the server's position within one request into the caller's index."""
        if len(indices) == 1:
            exc.index = indices[0]
        else:
            match = _SERVER_POSITION.search(exc.message)
            if match and int(match.group(1)) < len(indices):
                exc.index = indices[int(match.group(1))]
        if exc.index is not None:
            exc.args = (f"{exc.args[0]} [input index {exc.index} of this call]",)

    def _learn_batch_limit(self, exc: BatchTooLargeError, sent: int) -> int:
        limit = exc.limit if exc.limit is not None and exc.limit < sent else max(1, sent // 2)
        current = self._state.batch_limit
        if current is None or limit < current:
            self._state.batch_limit = limit
            self._metrics.fallback("batch_limit")
            _log.warning(
                "%s accepts at most %d texts per request; splitting batches",
                self._config.endpoint,
                limit,
            )
        return limit

    def _finish(
        self, arr: FloatArray, sent_dims: int | None, squared_norms: FloatArray
    ) -> FloatArray:
        """Apply MRL ``dimensions`` and normalisation to a decoded batch (``n x dim``,
        with its rows' squared norms from ``decode_checked``)."""
        want = self._config.dimensions
        if want is not None:
            if arr.shape[1] < want:
                raise ResponseError(
                    f"server returned {arr.shape[1]}-dimensional vectors, fewer than "
                    f"dimensions={want}"
                )
            # More components than asked is expected when a fixed-size list made us ask
            # for a bigger size (``sent_dims``); otherwise the server ignored ``dimensions``.
            if arr.shape[1] > want and sent_dims is not None and arr.shape[1] != sent_dims:
                self._state.dimensions_ok = False
                self._metrics.fallback("client_side_dimensions")
                _log.warning(
                    "%s ignored dimensions=%d (returned %d); slicing client-side",
                    self._config.endpoint,
                    want,
                    arr.shape[1],
                )
        if want is not None or self._config.normalize:
            arr, _ = normalize_rows(arr, want, squared_norms=squared_norms)
        return arr

    # ----------------------------------------------------------------- errors

    def _transport_error(self, exc: Exception) -> TransportError:
        label = self._config.endpoint
        text = scrub(str(exc), self._secret) or type(exc).__name__
        t = self._key.timeout
        if isinstance(exc, httpx.ConnectTimeout):
            return ConnectTimeout(
                f"connecting to {label} took longer than {t.connect} s (Timeouts.connect)",
                url=label,
            )
        if isinstance(exc, httpx.ReadTimeout):
            return ReadTimeout(f"{label} sent nothing for {t.read} s (Timeouts.read)", url=label)
        if isinstance(exc, httpx.WriteTimeout):
            return WriteTimeout(
                f"sending to {label} took longer than {t.write} s (Timeouts.write)", url=label
            )
        if isinstance(exc, httpx.PoolTimeout):
            return PoolTimeout(
                f"no free connection to {label} within {t.pool} s (Timeouts.pool; "
                f"Limits.max_connections={self._key.limits.max_connections})",
                url=label,
            )
        if isinstance(exc, httpx.ConnectError):
            if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
                return ConnectError(
                    f"TLS certificate verification failed for {label}: {text}. Pass "
                    "verify='/path/to/ca-bundle.pem' for a private CA",
                    url=label,
                )
            if "WRONG_VERSION_NUMBER" in text or "wrong version number" in text:
                return ConnectError(
                    f"TLS handshake with {label} failed: the server answers plain HTTP; "
                    f"use an http:// base_url ({text})",
                    url=label,
                )
            return ConnectError(f"cannot connect to {label}: {text}", url=label)
        if isinstance(exc, httpx.RemoteProtocolError):
            return RemoteProtocolError(f"{label} closed the connection: {text}", url=label)
        if isinstance(exc, httpx.NetworkError | httpx.ProtocolError):
            return NetworkError(f"connection to {label} broke: {text}", url=label)
        return TransportError(f"request to {label} failed: {text}", url=label)

    def _status_error(self, status: int, body: bytes, headers: Any) -> HTTPStatusError:
        error = error_from_response(
            status,
            body,
            url=self._url,
            headers=headers,
            retry_after=parse_retry_after(headers),
            secret=self._secret,
        )
        error = servers.refine_error(self._profile_now(), error)
        if status == 404 and not str(self._config.base_url).endswith("/v1"):
            error.args = (
                f"{error.args[0]} (OpenAI-compatible servers usually serve under /v1: "
                f"try base_url='{self._config.endpoint}/v1')",
            )
        return error

    def _sdk_error(self, exc: openai.OpenAIError) -> QwenEmbedError:
        if isinstance(exc, openai.APIStatusError):
            resp = exc.response
            return self._status_error(resp.status_code, resp.content, resp.headers)
        cause = exc.__cause__
        if isinstance(cause, httpx.HTTPError):
            return self._transport_error(cause)
        if isinstance(exc, openai.APITimeoutError):
            return ReadTimeout(f"{self._config.endpoint} timed out", url=self._config.endpoint)
        return ConnectError(
            f"request to {self._config.endpoint} failed: {scrub(str(exc), self._secret)}",
            url=self._config.endpoint,
        )

    def _sdk_unreadable(self, exc: ValueError) -> ResponseError:
        """The SDK's own parse failure (invalid JSON, "No embedding data received") as
        the ``ResponseError`` the codec path raises for the same body."""
        return ResponseError(
            f"{self._config.endpoint} sent a response the openai SDK could not read: "
            f"{type(exc).__name__}: {scrub(str(exc), self._secret)[:200]}",
            url=self._config.endpoint,
        )

    def _failed_exchange(self, exc: Exception, fresh: list[bool]) -> TransportError:
        """Map an HTTP library error; a failed h2c attempt switches the pool to HTTP/1.1
        and is marked for an immediate resend."""
        error = self._transport_error(exc)
        if isinstance(error, NetworkError | ConnectError) and pool.h2c_fallback(self._key):
            fresh[0] = False
        return error

    def _response_body(self, response: Any) -> bytes:
        """The body of a 2xx response; an error status raises the mapped ``HTTPStatusError``."""
        status: int = response.status_code
        if status >= 400:
            raise self._status_error(status, response.content, response.headers)
        self._observe(response.headers)
        content: bytes = response.content
        return content

    def _on_retry(self, exc: BaseException, delay: float) -> None:
        reason = retry_reason(exc) or "unknown"
        stale = delay == 0.0 and isinstance(exc, NetworkError)
        self._metrics.retry(reason, stale=stale)
        _log.warning(
            "retrying %s after %s in %.3f s: %s", self._config.endpoint, reason, delay, exc
        )

    def _request_done(
        self, outcome: str, started: float, texts: int, status: int | None, attempt: int
    ) -> None:
        """Record one HTTP exchange; log it at DEBUG (built only when DEBUG is on).

        ``attempt`` counts the tries of this batch: 1 is the first, 2+ are retries.
        """
        elapsed = time.perf_counter() - started
        self._metrics.request_finished(outcome, elapsed, texts)
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug(
                "POST %s texts=%d status=%s %.1f ms attempt=%d",
                self._config.endpoint,
                texts,
                outcome if status is None else status,  # no HTTP status: the error class
                elapsed * 1000.0,
                attempt,
            )

    def _sdk_kwargs(self, fmt: str, dims: int | None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"model": self._model}
        # Without encoding_format the SDK asks for base64 and decodes it itself.
        if fmt == "float":
            kwargs["encoding_format"] = "float"
        if dims is not None:
            kwargs["dimensions"] = dims
        return kwargs

    @staticmethod
    def _sdk_payload(response: Any) -> dict[str, Any]:
        return {"data": [{"index": d.index, "embedding": d.embedding} for d in response.data]}


# --------------------------------------------------------------------------- sync


class EmbeddingClient(_ClientBase):
    """Embed texts through an endpoint's process-wide shared pool (blocking API).

    Build it from an ``EmbeddingConfig`` or the same keyword arguments::

        client = EmbeddingClient(base_url="http://gpu-box:30000/v1")
        vectors = client.embed_documents(["first text", "second text"])  # 2 x 1024

    Constructing a client opens nothing. Every client with equal transport settings
    shares one ``httpx.Client``; concurrent batches run on a shared thread pool, at
    most ``max_concurrency`` per call. Thread-safe. Picklable (the API key is not
    pickled; it is re-read from ``QWEN_EMBED_API_KEY`` where unpickled).
    """

    def embed_documents(
        self, texts: Sequence[str] | Iterable[str], *, progress: Progress | None = None
    ) -> list[list[float]]:
        """Embed documents (sent raw, no instruction).

        Args:
            texts: the documents (``n`` texts, each a non-empty ``str``).
            progress: called once per finished batch with the texts it covered.

        Returns:
            ``n x dim`` nested lists of floats, row ``i`` for ``texts[i]``.

        Raises:
            InputError: invalid input (names the index); nothing is sent.
            HTTPStatusError, TransportError, ResponseError, CircuitOpenError: see ``errors``.
        """
        result: list[list[float]] = self.embed_documents_array(texts, progress=progress).tolist()
        return result

    def embed_documents_array(
        self, texts: Sequence[str] | Iterable[str], *, progress: Progress | None = None
    ) -> FloatArray:
        """Like ``embed_documents`` but returns a float32 numpy array, ``n x dim``."""
        items = validate_texts(texts, max_chars=self._config.max_text_chars)
        return self._embed(items, progress)

    def embed_query(self, text: str) -> list[float]:
        """Embed one search query with the Qwen3 instruction; ``dim`` floats.

        Raises:
            InputError: ``text`` is not a non-empty ``str``.
        """
        result: list[float] = self.embed_query_array(text).tolist()
        return result

    def embed_query_array(self, text: str) -> FloatArray:
        """Like ``embed_query`` but returns a float32 numpy array of shape ``(dim,)``."""
        validate_text(text, None, max_chars=self._config.max_text_chars)
        row: FloatArray = self._embed([format_query(text, self._config.query_instruction)], None)[0]
        return row

    def embed_queries(self, texts: Sequence[str] | Iterable[str]) -> list[list[float]]:
        """Embed many queries (each with the instruction); ``n x dim`` floats."""
        items = validate_texts(texts, max_chars=self._config.max_text_chars)
        task = self._config.query_instruction
        result: list[list[float]] = self._embed(
            [format_query(t, task) for t in items], None
        ).tolist()
        return result

    def openai_client(self) -> openai.OpenAI:
        """An ``openai.OpenAI`` on the shared pool (SDK retries off: ``max_retries=0``).

        Its HTTP client (``pool.SDKHTTPClient``) sends through the endpoint's current
        shared client, so the object can be kept: it survives ``close_all()``, ``fork``
        and the h2c fallback, and closing it closes nothing shared.
        """
        if self._sdk is None:
            self._sdk = openai.OpenAI(
                api_key=self._secret or "EMPTY",
                base_url=self._config.base_url,
                http_client=cast(Any, pool.SDKHTTPClient(self._key)),
                max_retries=0,
            )
        sdk: openai.OpenAI = self._sdk
        return sdk

    # ----------------------------------------------------------------- internals

    def _embed(self, texts: list[str], progress: Progress | None) -> FloatArray:
        self._ensure_server()
        plan = self._plan(texts)
        parts: list[FloatArray | None] = [None] * len(plan.batches)
        counts = self._batch_counts(plan) if progress is not None else None

        def job(b: int) -> None:
            start, stop = plan.batches[b]
            parts[b] = self._embed_batch(plan.unique[start:stop], plan.first_index[start:stop])
            if progress is not None and counts is not None:
                progress(counts[b])

        _run_windowed(len(plan.batches), job, self._config.max_concurrency)
        return self._assemble(plan, parts)

    def _embed_batch(self, texts: list[str], indices: list[int]) -> FloatArray:
        limit = self._state.batch_limit  # learned after this batch was planned
        if limit is not None and len(texts) > limit:
            return np.concatenate(
                [
                    self._embed_batch(texts[i : i + limit], indices[i : i + limit])
                    for i in range(0, len(texts), limit)
                ]
            )
        while True:
            fmt, dims = self._wire_options()
            try:
                payload = self._send(texts, fmt, dims)
            except BatchTooLargeError as exc:
                if len(texts) <= 1:
                    raise
                limit = self._learn_batch_limit(exc, len(texts))
                return np.concatenate(
                    [
                        self._embed_batch(texts[i : i + limit], indices[i : i + limit])
                        for i in range(0, len(texts), limit)
                    ]
                )
            except BadRequestError as exc:
                if self._adapt(exc, fmt, dims):
                    continue
                self._name_input(exc, indices)
                raise
            arr, squared_norms = decode_checked(
                parse_body(payload) if isinstance(payload, bytes) else payload, indices
            )
            return self._finish(arr, dims, squared_norms)

    def _send(self, texts: list[str], fmt: str, dims: int | None) -> bytes | dict[str, Any]:
        fresh = [True]
        tries = [0]
        key = self._key
        metrics = self._metrics

        def trace(name: str, info: dict[str, Any]) -> None:
            if name.endswith("connect_tcp.complete"):
                fresh[0] = True
                metrics.connection_opened()

        def attempt() -> bytes | dict[str, Any]:
            fresh[0] = False
            tries[0] += 1
            metrics.request_started()
            started = time.perf_counter()
            outcome, status = "ok", None
            try:
                if self._config.use_sdk:
                    try:
                        resp = self.openai_client().embeddings.create(
                            input=texts, **self._sdk_kwargs(fmt, dims)
                        )
                    except openai.OpenAIError as exc:
                        raise self._sdk_error(exc) from exc
                    except ValueError as exc:  # the SDK could not read the body
                        raise self._sdk_unreadable(exc) from exc
                    status = 200
                    return self._sdk_payload(resp)
                client = pool.get_sync_client(key)
                try:
                    response = client.post(
                        self._url,
                        content=encode_request(
                            texts, model=self._model, encoding_format=fmt, dimensions=dims
                        ),
                        headers=_JSON_HEADERS,
                        extensions={"trace": trace},
                    )
                except httpx.HTTPError as exc:
                    raise self._failed_exchange(exc, fresh) from exc
                status = response.status_code
                return self._response_body(response)
            except QwenEmbedError as exc:
                outcome = type(exc).__name__
                raise
            finally:
                self._request_done(outcome, started, len(texts), status, tries[0])

        return call_with_retry(
            attempt,
            policy=self._config.retry,
            breaker=self._breaker,
            on_retry=self._on_retry,
            fresh_connection=lambda: fresh[0],
        )


# --------------------------------------------------------------------------- async


class AsyncEmbeddingClient(_ClientBase):
    """The ``async`` twin of ``EmbeddingClient``: same settings, same shared pool.

    Really async: requests run on the running event loop through the pool's
    ``httpx.AsyncClient`` for that loop (one per loop, so ``asyncio.run()`` many times,
    Jupyter and threads with their own loops all work). At most ``max_concurrency``
    batches of a call are in flight at once.
    """

    async def embed_documents(
        self, texts: Sequence[str] | Iterable[str], *, progress: Progress | None = None
    ) -> list[list[float]]:
        """Embed documents; ``n x dim`` floats in input order (see
        ``EmbeddingClient.embed_documents``)."""
        arr = await self.embed_documents_array(texts, progress=progress)
        result: list[list[float]] = arr.tolist()
        return result

    async def embed_documents_array(
        self, texts: Sequence[str] | Iterable[str], *, progress: Progress | None = None
    ) -> FloatArray:
        """Embed documents into a float32 numpy array, ``n x dim``."""
        items = validate_texts(texts, max_chars=self._config.max_text_chars)
        return await self._embed(items, progress)

    async def embed_query(self, text: str) -> list[float]:
        """Embed one query with the Qwen3 instruction; ``dim`` floats."""
        result: list[float] = (await self.embed_query_array(text)).tolist()
        return result

    async def embed_query_array(self, text: str) -> FloatArray:
        """Embed one query into a float32 numpy array of shape ``(dim,)``."""
        validate_text(text, None, max_chars=self._config.max_text_chars)
        arr = await self._embed([format_query(text, self._config.query_instruction)], None)
        row: FloatArray = arr[0]
        return row

    async def embed_queries(self, texts: Sequence[str] | Iterable[str]) -> list[list[float]]:
        """Embed many queries (each with the instruction); ``n x dim`` floats."""
        items = validate_texts(texts, max_chars=self._config.max_text_chars)
        task = self._config.query_instruction
        arr = await self._embed([format_query(t, task) for t in items], None)
        result: list[list[float]] = arr.tolist()
        return result

    def openai_client(self) -> openai.AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` on the shared pool (``max_retries=0``).

        Its HTTP client (``pool.AsyncSDKHTTPClient``) sends through the running event
        loop's shared client, so one object works on every loop (``asyncio.run()`` many
        times), after ``close_all()`` and the h2c fallback; closing it closes nothing
        shared.
        """
        if self._sdk is None:
            self._sdk = openai.AsyncOpenAI(
                api_key=self._secret or "EMPTY",
                base_url=self._config.base_url,
                http_client=cast(Any, pool.AsyncSDKHTTPClient(self._key)),
                max_retries=0,
            )
        async_sdk: openai.AsyncOpenAI = self._sdk
        return async_sdk

    # ----------------------------------------------------------------- internals

    async def _embed(self, texts: list[str], progress: Progress | None) -> FloatArray:
        await self._aensure_server()
        plan = self._plan(texts)
        parts: list[FloatArray | None] = [None] * len(plan.batches)
        counts = self._batch_counts(plan) if progress is not None else None

        async def job(b: int) -> None:
            start, stop = plan.batches[b]
            parts[b] = await self._embed_batch(
                plan.unique[start:stop], plan.first_index[start:stop]
            )
            if progress is not None and counts is not None:
                progress(counts[b])

        await _arun_windowed(len(plan.batches), job, self._config.max_concurrency)
        return self._assemble(plan, parts)

    async def _embed_batch(self, texts: list[str], indices: list[int]) -> FloatArray:
        limit = self._state.batch_limit  # learned after this batch was planned
        if limit is not None and len(texts) > limit:
            return np.concatenate(
                [
                    await self._embed_batch(texts[i : i + limit], indices[i : i + limit])
                    for i in range(0, len(texts), limit)
                ]
            )
        while True:
            fmt, dims = self._wire_options()
            try:
                payload = await self._send(texts, fmt, dims)
            except BatchTooLargeError as exc:
                if len(texts) <= 1:
                    raise
                limit = self._learn_batch_limit(exc, len(texts))
                parts = [
                    await self._embed_batch(texts[i : i + limit], indices[i : i + limit])
                    for i in range(0, len(texts), limit)
                ]
                return np.concatenate(parts)
            except BadRequestError as exc:
                if self._adapt(exc, fmt, dims):
                    continue
                self._name_input(exc, indices)
                raise
            arr, squared_norms = decode_checked(
                parse_body(payload) if isinstance(payload, bytes) else payload, indices
            )
            return self._finish(arr, dims, squared_norms)

    async def _send(self, texts: list[str], fmt: str, dims: int | None) -> bytes | dict[str, Any]:
        fresh = [True]
        tries = [0]
        key = self._key
        metrics = self._metrics

        async def trace(name: str, info: dict[str, Any]) -> None:
            if name.endswith("connect_tcp.complete"):
                fresh[0] = True
                metrics.connection_opened()

        async def attempt() -> bytes | dict[str, Any]:
            fresh[0] = False
            tries[0] += 1
            metrics.request_started()
            started = time.perf_counter()
            outcome, status = "ok", None
            try:
                if self._config.use_sdk:
                    try:
                        resp = await self.openai_client().embeddings.create(
                            input=texts, **self._sdk_kwargs(fmt, dims)
                        )
                    except openai.OpenAIError as exc:
                        raise self._sdk_error(exc) from exc
                    except ValueError as exc:  # the SDK could not read the body
                        raise self._sdk_unreadable(exc) from exc
                    status = 200
                    return self._sdk_payload(resp)
                client = pool.get_async_client(key)
                try:
                    response = await client.post(
                        self._url,
                        content=encode_request(
                            texts, model=self._model, encoding_format=fmt, dimensions=dims
                        ),
                        headers=_JSON_HEADERS,
                        extensions={"trace": trace},
                    )
                except httpx.HTTPError as exc:
                    raise self._failed_exchange(exc, fresh) from exc
                status = response.status_code
                return self._response_body(response)
            except QwenEmbedError as exc:
                outcome = type(exc).__name__
                raise
            finally:
                self._request_done(outcome, started, len(texts), status, tries[0])

        return await acall_with_retry(
            attempt,
            policy=self._config.retry,
            breaker=self._breaker,
            on_retry=self._on_retry,
            fresh_connection=lambda: fresh[0],
        )
