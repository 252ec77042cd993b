"""The process-wide registry of shared HTTP clients, one pool per endpoint.

Key: the frozen ``TransportKey`` of a config (base URL, API key, timeouts, limits,
HTTP/2, TLS verification) — never the adapter or client object, so every client and
adapter with equal transport settings shares the same connections.

- **Sync**: one ``httpx.Client`` per key, shared by all threads (httpx clients are
  thread-safe).
- **Async**: an ``httpx.AsyncClient`` is bound to the event loop that opened its
  connections, so there is one per (key, running loop). When ``asyncio.run()`` (or any
  runner that calls ``shutdown_asyncgens``) finishes a loop, that loop's clients are
  closed inside it; clients of loops closed otherwise are dropped on the next lookup.
  ``asyncio.run()`` twice, Jupyter, pytest and threads with their own loops all work.
- **fork**: a child process never touches its parent's sockets: the registry is emptied
  in the child (``os.register_at_fork``) and clients are rebuilt lazily.
- **Lazy**: nothing is opened until the first request. Creation is lock-guarded.
- ``close_all()`` / ``aclose_all()``; ``close_all()`` also runs at interpreter exit.

SSL contexts are built once per process per (verify, http2) setting: a new SSL context
costs ~55 ms of CPU, the bulk of a fresh ``openai.OpenAI()`` (DESIGN.md section 5).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import ssl
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from ._http import httpx
from .config import TransportKey
from .metrics import EndpointMetrics, metrics_for
from .retry import CircuitBreaker

__all__ = [
    "AsyncSDKHTTPClient",
    "EndpointState",
    "SDKHTTPClient",
    "aclose_all",
    "close_all",
    "endpoint_state",
    "get_async_client",
    "get_sync_client",
    "pool_stats",
]

_USER_AGENT = "qwen-embed-plugins"
_log = logging.getLogger("qwen_embed_plugins")

_lock = threading.RLock()
_entries: dict[TransportKey, _Entry] = {}
_ssl_contexts: dict[tuple[bool | str, bool, bool], ssl.SSLContext] = {}
# Clients abandoned in a forked child: kept referenced so that garbage collection never
# closes (and so shuts down) sockets that still belong to the parent.
_abandoned: list[Any] = []


@dataclass
class EndpointState:
    """What the process has learned about a server (per endpoint and model).

    Attributes:
        base64_ok: ``False`` once the server refused ``encoding_format="base64"``.
        dimensions_ok: ``False`` once the server refused or ignored ``dimensions``.
        batch_limit: the server's stated maximum texts per request, once learned.
    """

    base64_ok: bool | None = None
    dimensions_ok: bool | None = None
    batch_limit: int | None = None


@dataclass
class _LoopClient:
    client: Any  # httpx.AsyncClient
    sentinel: AsyncGenerator[None, None] | None = None
    dead: bool = False


@dataclass
class _Entry:
    key: TransportKey
    metrics: EndpointMetrics
    breaker: CircuitBreaker | None = None
    sync_client: Any = None  # httpx.Client | None
    async_clients: dict[asyncio.AbstractEventLoop, _LoopClient] = field(default_factory=dict)
    states: dict[str, EndpointState] = field(default_factory=dict)
    h2c_failed: bool = False


def _entry(key: TransportKey) -> _Entry:
    found = _entries.get(key)
    if found is not None:
        return found
    with _lock:
        found = _entries.get(key)
        if found is None:
            found = _Entry(key=key, metrics=metrics_for(key.label))
            _entries[key] = found
        return found


def endpoint_metrics(key: TransportKey) -> EndpointMetrics:
    """The metrics object of ``key``'s endpoint."""
    return _entry(key).metrics


def endpoint_breaker(key: TransportKey, *, threshold: int, cooldown: float) -> CircuitBreaker:
    """The circuit breaker of ``key``'s pool, created with the settings of the first
    client of that endpoint (later clients share it as it is)."""
    entry = _entry(key)
    breaker = entry.breaker
    if breaker is None:
        with _lock:
            if entry.breaker is None:
                entry.breaker = CircuitBreaker(
                    threshold=threshold, cooldown=cooldown, label=key.label
                )
            breaker = entry.breaker
    return breaker


def endpoint_state(key: TransportKey, model: str) -> EndpointState:
    """The process-wide ``EndpointState`` of (``key``, ``model``)."""
    entry = _entry(key)
    state = entry.states.get(model)
    if state is None:
        with _lock:
            state = entry.states.setdefault(model, EndpointState())
    return state


def _ssl_context(verify: bool | str, *, http2: bool, cleartext: bool) -> ssl.SSLContext:
    """One SSL context per process per setting (building one costs ~55 ms of CPU)."""
    cache_key = (verify, http2, cleartext)
    ctx = _ssl_contexts.get(cache_key)
    if ctx is not None:
        return ctx
    with _lock:
        ctx = _ssl_contexts.get(cache_key)
        if ctx is None:
            if cleartext:
                # http:// never uses TLS: a bare context avoids loading the CA bundle.
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            elif verify is False:
                ctx = ssl.create_default_context()
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            elif isinstance(verify, str):
                ctx = ssl.create_default_context(cafile=verify)
            else:
                import certifi

                ctx = ssl.create_default_context(cafile=certifi.where())
            _ssl_contexts[cache_key] = ctx
        return ctx


def _timeout(key: TransportKey) -> Any:
    """The ``httpx.Timeout`` of ``key``'s ``Timeouts`` (seconds)."""
    t = key.timeout
    return httpx.Timeout(connect=t.connect, read=t.read, write=t.write, pool=t.pool)


def _client_kwargs(entry: _Entry) -> dict[str, Any]:
    key = entry.key
    cleartext = key.base_url.startswith("http://")
    headers = {"User-Agent": _USER_AGENT}
    if key.api_key is not None:
        headers["Authorization"] = f"Bearer {key.api_key.get_secret_value()}"
    h2c = key.http2 and cleartext and not entry.h2c_failed
    return {
        "limits": httpx.Limits(
            max_connections=key.limits.max_connections,
            max_keepalive_connections=key.limits.keepalive_connections,
            keepalive_expiry=key.limits.keepalive_expiry,
        ),
        "timeout": _timeout(key),
        "http2": key.http2 and (not cleartext or h2c),
        # Prior-knowledge h2c on cleartext only when asked; see ``h2c_fallback``.
        "http1": not h2c,
        "verify": _ssl_context(key.verify, http2=key.http2, cleartext=cleartext),
        "headers": headers,
        "follow_redirects": False,
    }


class _ReleasingStream(httpx.SyncByteStream):
    """A response body that frees its ``_GatedTransport`` slot once closed (after the
    connection went back to the pool)."""

    def __init__(self, inner: Any, release: Callable[[], None]) -> None:
        self._inner = inner
        self._release: Callable[[], None] | None = release

    def __iter__(self) -> Any:
        yield from self._inner

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            release, self._release = self._release, None
            if release is not None:
                release()


class _GatedTransport(httpx.BaseTransport):
    """At most ``slots`` requests inside the wrapped HTTP/1.1 pool at once.

    httpcore's sync pool (1.0.9; httpcore2 2.16 shares the code) decides which
    connection serves a queued request outside the connections' own locks: while one
    thread scans for an available connection, another thread's response returns a
    connection to idle, and the scan then closes that idle connection "to make room" and
    opens a new one; a connection assigned to a queued request can also be closed under
    it (encode/httpcore#1110, where the request then hangs until its read timeout).
    Measured here: 20 threads x 8 requests at ``max_connections=20`` against Infinity on
    a busy machine opened 21-24 connections in 6 of 24 runs. With as many slots as
    connections, no request ever queues inside httpcore, so neither race can happen;
    waiting happens here instead, bounded by the pool timeout (``httpx.PoolTimeout``).
    """

    def __init__(self, inner: Any, slots: int) -> None:
        self._inner = inner
        self._slots = threading.BoundedSemaphore(slots)

    def handle_request(self, request: Any) -> Any:
        wait = request.extensions.get("timeout", {}).get("pool")
        if not self._slots.acquire(timeout=wait):
            raise httpx.PoolTimeout(
                f"no pooled connection became free within {wait} s", request=request
            )
        try:
            response = self._inner.handle_request(request)
        except BaseException:
            self._slots.release()
            raise
        response.stream = _ReleasingStream(response.stream, self._slots.release)
        return response

    def close(self) -> None:
        self._inner.close()


def _sync_transport(kwargs: dict[str, Any]) -> Any:
    """The transport of a shared sync client: httpx's own, gated when it speaks HTTP/1.1
    only (an HTTP/2 connection carries many requests at once; the gate would cap them)."""
    inner = httpx.HTTPTransport(
        verify=kwargs["verify"],
        http1=kwargs["http1"],
        http2=kwargs["http2"],
        limits=kwargs["limits"],
    )
    if kwargs["http2"]:
        return inner
    return _GatedTransport(inner, kwargs["limits"].max_connections)


def _sync_tracer(metrics: EndpointMetrics) -> Callable[[str, dict[str, Any]], None]:
    def trace(name: str, info: dict[str, Any]) -> None:
        if name.endswith("connect_tcp.complete"):
            metrics.connection_opened()

    return trace


def _async_tracer(metrics: EndpointMetrics) -> Callable[[str, dict[str, Any]], Any]:
    async def trace(name: str, info: dict[str, Any]) -> None:
        if name.endswith("connect_tcp.complete"):
            metrics.connection_opened()

    return trace


def get_sync_client(key: TransportKey) -> Any:
    """The shared ``httpx.Client`` of ``key`` (created on first use; thread-safe).

    Requests made through it (also by the openai SDK) count the TCP connections they
    open in the endpoint's metrics.
    """
    entry = _entry(key)
    client = entry.sync_client
    if client is not None and not client.is_closed:
        return client
    with _lock:
        client = entry.sync_client
        if client is None or client.is_closed:
            tracer = _sync_tracer(entry.metrics)

            def count_connections(request: Any) -> None:
                request.extensions.setdefault("trace", tracer)

            kwargs = _client_kwargs(entry)
            client = httpx.Client(
                **kwargs,
                transport=_sync_transport(kwargs),
                event_hooks={"request": [count_connections]},
            )
            entry.sync_client = client
        return client


async def _loop_sentinel(entry: _Entry, slot: _LoopClient) -> AsyncGenerator[None, None]:
    """Parked in the loop's async-generator registry; ``asyncio.run()`` finalises it
    (``shutdown_asyncgens``) before closing the loop, which closes the loop's client."""
    try:
        yield
    finally:
        if not slot.dead:
            slot.dead = True
            with _lock:
                for loop, held in list(entry.async_clients.items()):
                    if held is slot:
                        del entry.async_clients[loop]
            with contextlib.suppress(Exception):
                await slot.client.aclose()


def _purge_dead_loops(entry: _Entry) -> None:
    for loop, slot in list(entry.async_clients.items()):
        if loop.is_closed():
            del entry.async_clients[loop]
            slot.dead = True
            if slot.sentinel is not None:
                # Finish the parked generator without awaiting (its loop is gone).
                with contextlib.suppress(StopIteration, RuntimeError):
                    slot.sentinel.aclose().send(None)
            # No reference kept: garbage collection closes the dead loop's sockets (its
            # transports cannot be closed through a closed loop).


def get_async_client(key: TransportKey) -> Any:
    """The ``httpx.AsyncClient`` of ``key`` for the running event loop.

    Raises:
        RuntimeError: called with no running event loop.
    """
    loop = asyncio.get_running_loop()
    entry = _entry(key)
    slot = entry.async_clients.get(loop)
    if slot is not None and not slot.dead and not slot.client.is_closed:
        return slot.client
    with _lock:
        _purge_dead_loops(entry)
        slot = entry.async_clients.get(loop)
        if slot is not None and not slot.dead and not slot.client.is_closed:
            return slot.client
        tracer = _async_tracer(entry.metrics)

        async def count_connections(request: Any) -> None:
            request.extensions.setdefault("trace", tracer)

        client = httpx.AsyncClient(
            **_client_kwargs(entry), event_hooks={"request": [count_connections]}
        )
        slot = _LoopClient(client=client)
        sentinel = _loop_sentinel(entry, slot)
        # Start the generator synchronously: the running loop's firstiter hook registers
        # it, and it parks at its ``yield``.
        with contextlib.suppress(StopIteration):
            sentinel.asend(None).send(None)
        slot.sentinel = sentinel
        entry.async_clients[loop] = slot
        return client


class _NoTransport(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """The transport of an SDK-facing client: never used (its ``send`` goes to the pool)."""

    def handle_request(self, request: Any) -> Any:
        raise RuntimeError("requests of this client go through the shared pool")

    async def handle_async_request(self, request: Any) -> Any:
        raise RuntimeError("requests of this client go through the shared pool")


# Errors that mean "no HTTP exchange happened" on a cleartext HTTP/2 attempt: the server
# does not speak h2c (prior knowledge) and dropped the connection.
_H2C_FAILURES = (httpx.RemoteProtocolError, httpx.ConnectError, httpx.ReadError, httpx.WriteError)


class SDKHTTPClient(httpx.Client):
    """The ``httpx.Client`` handed to ``openai.OpenAI``: a stable handle on the endpoint's
    *current* shared client.

    Each ``send`` goes through ``get_sync_client(key)``, so an SDK object kept by the user
    keeps working after ``close_all()``, in a forked child (which gets its own sockets)
    and after the cleartext HTTP/2 -> HTTP/1.1 fallback (which this client also
    triggers, resending once). ``close()`` does nothing: the shared pool is not the SDK
    object's to close.
    """

    def __init__(self, key: TransportKey) -> None:
        super().__init__(timeout=_timeout(key), transport=_NoTransport(), trust_env=False)
        self._pool_key = key

    def send(self, request: Any, **kwargs: Any) -> Any:
        try:
            return get_sync_client(self._pool_key).send(request, **kwargs)
        except _H2C_FAILURES:
            if not h2c_fallback(self._pool_key):
                raise
        return get_sync_client(self._pool_key).send(request, **kwargs)

    def close(self) -> None:
        """Nothing to close (the pool is shared; see ``close_all()``)."""


class AsyncSDKHTTPClient(httpx.AsyncClient):
    """The ``httpx.AsyncClient`` handed to ``openai.AsyncOpenAI``: each ``send`` goes
    through the running loop's shared client (``get_async_client``), so one SDK object
    works on any event loop, after ``close_all()`` and after the h2c fallback.
    ``aclose()`` does nothing."""

    def __init__(self, key: TransportKey) -> None:
        super().__init__(timeout=_timeout(key), transport=_NoTransport(), trust_env=False)
        self._pool_key = key

    async def send(self, request: Any, **kwargs: Any) -> Any:
        try:
            return await get_async_client(self._pool_key).send(request, **kwargs)
        except _H2C_FAILURES:
            if not h2c_fallback(self._pool_key):
                raise
        return await get_async_client(self._pool_key).send(request, **kwargs)

    async def aclose(self) -> None:
        """Nothing to close (the pool is shared; see ``aclose_all()``)."""


def h2c_fallback(key: TransportKey) -> bool:
    """Give up prior-knowledge h2c for ``key`` and use HTTP/1.1 from now on.

    Returns ``True`` if this call switched (the caller should resend), ``False`` if h2c
    was not in use.
    """
    entry = _entry(key)
    if not (key.http2 and key.base_url.startswith("http://")) or entry.h2c_failed:
        return False
    with _lock:
        if entry.h2c_failed:
            return False
        entry.h2c_failed = True
        old = entry.sync_client
        entry.sync_client = None
        entry.async_clients.clear()
        if old is not None:
            _abandoned.append(old)
    entry.metrics.fallback("h2c_to_http1")
    _log.warning("%s does not speak cleartext HTTP/2 (h2c); using HTTP/1.1 from now on", key.label)
    return True


def close_all() -> None:
    """Close every shared sync client; drop every async client.

    Async clients can only be closed inside their own loop: use ``aclose_all()`` there.
    Later calls simply open new connections.
    """
    with _lock:
        entries = list(_entries.values())
    for entry in entries:
        with _lock:
            client, entry.sync_client = entry.sync_client, None
            slots = list(entry.async_clients.values())
            entry.async_clients.clear()
        if client is not None:
            client.close()
        for slot in slots:
            slot.dead = True
            _abandoned.append(slot.client)


async def aclose_all() -> None:
    """Close every shared sync client and this loop's async clients."""
    loop = asyncio.get_running_loop()
    with _lock:
        entries = list(_entries.values())
    closing = []
    for entry in entries:
        with _lock:
            slot = entry.async_clients.pop(loop, None)
        if slot is not None:
            slot.dead = True
            closing.append(slot.client.aclose())
    for coro in closing:
        await coro
    close_all()


def pool_stats() -> dict[str, dict[str, Any]]:
    """Per endpoint label: ``sync_clients``, ``async_clients`` (open now),
    ``connections_opened``, ``requests``, ``in_flight``, ``stale_retries``, ``retries``,
    ``texts`` (counts since start or ``reset_metrics()``).

    A row is an endpoint (scheme, host, port, path), as in the metrics: clients of one URL
    with different transport settings (limits, timeouts, key) have pools of their own,
    and their row adds them up (``sync_clients`` 2, say)."""
    with _lock:
        entries = list(_entries.values())
    out: dict[str, dict[str, Any]] = {}
    for entry in entries:
        label = entry.key.label
        row = out.setdefault(label, {"sync_clients": 0, "async_clients": 0})
        row["sync_clients"] += int(entry.sync_client is not None)
        row["async_clients"] += sum(
            1 for loop, s in entry.async_clients.items() if not s.dead and not loop.is_closed()
        )
        snap = entry.metrics.snapshot()
        for name in (
            "connections_opened",
            "requests",
            "in_flight",
            "stale_retries",
            "retries",
            "texts",
        ):
            row[name] = snap[name]
    return out


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()
    for entry in _entries.values():
        if entry.sync_client is not None:
            _abandoned.append(entry.sync_client)
        entry.sync_client = None
        for slot in entry.async_clients.values():
            slot.dead = True
            _abandoned.append(slot.client)
        entry.async_clients = {}
        if entry.breaker is not None:
            entry.breaker.after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(close_all)
