"""The transport contract, written once above the backends: one HTTP exchange through a
pool's connection (``Request -> Reply``), bounded in size and time, errors translated at
the boundary. This module imports no backend; the backends import it.

Two implementations of the contract, ``send(Request) -> Reply`` (``_pool`` builds one per
pool, and per event loop for the async one; the package's ``__init__`` says which when):

- ``SyncTransport`` (``_sync_http``; blocking, all threads): the stdlib's ``http.client``
  for HTTP/1.1 (``_http11``, public API, a pool of its own) and an ``httpx.Client``
  (``httpx2`` under openai 3.x) when HTTP/2 is asked.
- ``AsyncTransport`` (``_async_http``; one per event loop): ``aiohttp`` for HTTP/1.1
  (docs/benchmarks.md, "Transport candidates") and an ``httpx.AsyncClient`` when HTTP/2
  is asked (aiohttp speaks HTTP/1.1 only).

What every backend shares is here, once:

- ``_Body``: the size cap (``Request.max_bytes``) on the bytes received AND on the bytes
  after ``Content-Encoding`` decoding (gzip/deflate decoded here, bounded: a small gzip
  body cannot inflate past the cap), so a hostile ``Content-Length``, an endless chunked
  body or a gzip bomb ends in ``ResponseError`` with bounded memory; an unasked-for
  encoding is refused (its name scrubbed of the key); a compressed body cut before the
  end of its stream is a ``RemoteProtocolError`` (``received``, like a body cut short),
  never a shorter answer; ``sdk_cap`` for the SDK's requests;
- ``Progress``, ``failure`` and ``mapped``: how far an exchange got, and the one place a
  backend's exception becomes the library's (``_exceptions.translate``, the one table),
  raised with no chain to it (``Mapped``: the original quotes the server's bytes
  unscrubbed); a timeout at the deadline is the total budget's ``ReadTimeout``;
- ``check_status``: a status outside 200-599 (after the backend skipped 1xx answers) is
  a ``RemoteProtocolError``, never success;
- the total time budget (``Request.total``: ``Timeouts.total`` or the call's deadline,
  whichever is sooner; ``_deadline`` / ``_left``): each backend bounds its connect,
  write, pool wait and reads by the time left, and the whole exchange as its module says;
- ``ProcessGate`` (``Limits.max_connections_per_process``), ``ssl_context``, and
  ``quiet_header_loggers`` (no HTTP/2 header block, no secret sent in the HTTP
  libraries' logs, by logger and level, and by scrubbing each record's formatted
  message: never by its wording).

Connection reuse only of sockets with nothing unread on them; redirects are never
followed (a 3xx is returned as it is). Proxies are passed explicitly (resolved once from
the config; see ``EmbeddingConfig.proxy_for``), so the transports route the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import threading
import time
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._config import Timeouts
from .._server_text import scrub
from .._state import STATE
from ..errors import (
    ErrorContext,
    PoolTimeout,
    QwenEmbedError,
    RemoteProtocolError,
    ResponseError,
    TimeoutException,
    total_timeout_error,
)
from ._exceptions import translate

__all__ = [
    "Mapped",
    "ProcessGate",
    "Reply",
    "Request",
    "Retired",
    "check_status",
    "failure",
    "keep_out_of_logs",
    "mapped",
    "quiet_header_loggers",
    "sdk_cap",
    "ssl_context",
]


class Retired(Exception):
    """The transport was closed (``close_all()``, the idle reaper) before or while this
    request used it: resend once on the pool's current transport. Never reaches users."""


_USER_AGENT = "qwen-embed-plugins"
_CHUNK = 65_536
_ACCEPT_ENCODING = "gzip, deflate"


@dataclass(slots=True)
class Request:
    """One exchange to perform.

    Attributes:
        method: ``"POST"`` or ``"GET"``.
        url: the absolute URL.
        body: the request body (``b""`` for none).
        headers: request headers (``Authorization`` included by the caller).
        timeouts: connect/read/write/pool timeouts in seconds.
        total: seconds the whole exchange may take (``None``: unbounded).
        max_bytes: the largest response body accepted, in bytes (received and decoded).
        ctx: how errors describe the endpoint (no credentials).
    """

    method: str
    url: str
    body: bytes
    headers: Mapping[str, str]
    timeouts: Timeouts
    total: float | None
    max_bytes: int
    ctx: ErrorContext


@dataclass(slots=True)
class Reply:
    """A complete HTTP response.

    Attributes:
        status: the HTTP status code.
        headers: the response headers (case-insensitive lookups).
        body: the decoded body, at most ``Request.max_bytes`` bytes.
        fresh: the exchange ran on a connection opened for it (``False``: on a reused
            keep-alive connection).
        http_version: e.g. ``"HTTP/1.1"`` or ``"HTTP/2"``.
    """

    status: int
    headers: Mapping[str, str]
    body: bytes
    fresh: bool
    http_version: str = "HTTP/1.1"


# --------------------------------------------------------------------------- logs

# The loggers of the ``hpack`` package (HTTP/2 header compression): at DEBUG they print
# every header block, encoded and decoded, ``Authorization`` included. The encoded form
# (Huffman-coded) cannot be scrubbed: their DEBUG records are dropped.
_HEADER_LOGGERS = ("hpack.hpack", "hpack.table")
# The loggers of httpx and httpcore (httpx2's and httpcore2's under openai 3.x): their
# records may quote what a server sent (a response head echoing the key in a header or
# the reason phrase): every record is scrubbed of the secrets sent, whatever its wording.
_SCRUBBED_LOGGERS = (
    "httpx",
    "httpx2",
    *(
        f"{package}.{name}"
        for package in ("httpcore", "httpcore2")
        for name in ("http11", "http2", "connection", "proxy", "socks")
    ),
)


class _NoHeaderBlocks(logging.Filter):
    """Drops the DEBUG records of the ``hpack`` loggers (header blocks)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.DEBUG


class _NoSecrets(logging.Filter):
    """Scrubs every secret sent (``STATE.log_secrets``) and every ``Bearer``/``Basic``
    value from a record, through the documented ``logging`` API only: the record's
    formatted message (``getMessage()``) is scrubbed and, when anything was replaced,
    becomes its ``msg`` (with no ``args``). No reliance on a record's wording or on the
    position of its arguments."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a record whose args do not fit its format: logging reports it
            return True
        clean = scrub(text, *STATE.log_secrets)
        if clean != text:
            record.msg = clean
            record.args = None
        return True


_no_header_blocks = _NoHeaderBlocks()
_no_secrets = _NoSecrets()


def keep_out_of_logs(*secrets: str | None) -> None:
    """Scrub ``secrets`` from the HTTP libraries' log records (``quiet_header_loggers``)
    from now on in this process. The most recent ``_LOG_SECRETS`` are kept (a callable
    key may give a new one for each request; each request adds its own again)."""
    known = STATE.log_secrets
    if all(not s or s in known for s in secrets):
        return
    with STATE.lock:
        known = STATE.log_secrets
        new = [s for s in dict.fromkeys(secrets) if s and s not in known]
        STATE.log_secrets = (*known, *new)[-_LOG_SECRETS:]


_LOG_SECRETS = 256


def quiet_header_loggers(*secrets: str | None) -> None:
    """Keep HTTP/2 header blocks and the secrets sent (the API key, ``secrets``, and those
    of every request of an httpx transport: ``keep_out_of_logs``) out of the HTTP
    libraries' logs, whatever the logging configuration: a ``logging.Filter`` on the
    ``hpack`` package's own loggers (``hpack.hpack``, ``hpack.table``) drops their DEBUG
    records (the ``hpack`` logger's level is raised to INFO when nobody set one, so those
    records are not even built), and one on each httpx/httpcore logger scrubs every
    record's message. Installed when the first HTTP/2 transport is built and by
    ``qwen-embed check``; the ``h2`` package logs through a logger of its own only when
    given one (httpcore gives none)."""
    keep_out_of_logs(*secrets)
    parent = logging.getLogger("hpack")
    if parent.level == logging.NOTSET:
        parent.setLevel(logging.INFO)
    for name in _HEADER_LOGGERS:
        logger = logging.getLogger(name)
        if _no_header_blocks not in logger.filters:
            logger.addFilter(_no_header_blocks)
    for name in _SCRUBBED_LOGGERS:
        logger = logging.getLogger(name)
        if _no_secrets not in logger.filters:
            logger.addFilter(_no_secrets)


# --------------------------------------------------------------------------- TLS


def ssl_context(verify: bool | str, *, http2: bool, cleartext: bool) -> ssl.SSLContext:
    """One SSL context per process per setting (loading the CA bundle is the bulk of a
    fresh ``openai.OpenAI()``'s set-up). CAs from certifi unless ``verify`` names a
    bundle. Built under its own lock, not the state lock: a build (10-20 ms of CPU for
    certifi's roots) never holds up a pool look-up (``prepare_ssl_contexts``)."""
    cache_key = (verify, http2, cleartext)
    ctx = STATE.ssl_contexts.get(cache_key)
    if ctx is not None:
        return ctx
    with STATE.ssl_lock:
        ctx = STATE.ssl_contexts.get(cache_key)
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
            if http2 and not cleartext:
                ctx.set_alpn_protocols(["h2", "http/1.1"])
            STATE.ssl_contexts[cache_key] = ctx
        return ctx


def prepare_ssl_contexts(settings: Iterable[tuple[bool | str, bool, bool]]) -> None:
    """Build the SSL contexts of ``settings`` (``(verify, http2, cleartext)`` each, as
    ``ssl_context`` takes them) on a background thread, so that the first request on
    an ``https://`` endpoint does not pay for loading the CA bundle. Returns at once:
    nothing to do when every context exists, is being built or is cleartext; else one
    daemon thread (many clients built at once start one). A setting that fails to build
    (a file that is not a CA bundle) is left to the first request, which raises the
    error where the caller sees it."""
    wanted = [s for s in dict.fromkeys(settings) if not s[2] and s not in STATE.ssl_contexts]
    if not wanted:
        return
    with STATE.lock:
        todo = [s for s in wanted if s not in STATE.ssl_pending]
        STATE.ssl_pending.update(todo)
    if not todo:
        return

    def build() -> None:
        time.sleep(0)  # hand the GIL back first: the constructor that started us returns
        for verify, http2, cleartext in todo:
            # the request that needs it builds it again and raises there
            with contextlib.suppress(Exception):
                ssl_context(verify, http2=http2, cleartext=cleartext)
        with STATE.lock:
            STATE.ssl_pending.difference_update(todo)

    threading.Thread(target=build, name="qwen-embed-tls", daemon=True).start()


# --------------------------------------------------------------------------- body limits


class _Body:
    """Collects a response body within ``cap`` bytes, decoding gzip/deflate on the fly
    with a bounded output (``zlib``'s ``max_length``); a compressed body must reach the
    end of its stream (``result``)."""

    __slots__ = ("_cap", "_ctx", "_inflater", "_parts", "_raw", "_size", "encoding")

    def __init__(self, encoding: str, cap: int, ctx: ErrorContext) -> None:
        self._cap = cap
        self._ctx = ctx
        self._parts: list[bytes] = []
        self._size = 0
        self._raw = 0
        encoding = encoding.strip().lower()
        self.encoding = encoding
        if encoding in ("", "identity"):
            self._inflater: Any = None
        elif encoding in ("gzip", "x-gzip"):
            self._inflater = zlib.decompressobj(zlib.MAX_WBITS | 16)
        elif encoding == "deflate":
            self._inflater = zlib.decompressobj()
        else:
            shown = scrub(encoding, *ctx.secrets())[:40]
            raise ResponseError(
                f"{ctx.url} answered with Content-Encoding {shown!r}, which this "
                "client did not ask for (it accepts gzip and deflate)",
                url=ctx.url,
            )

    def _too_big(self, what: str) -> ResponseError:
        return ResponseError(
            f"the response of {self._ctx.url} is larger than the cap of {self._cap:,} bytes "
            f"({what}); raise max_response_bytes if it is legitimate",
            url=self._ctx.url,
            max_bytes=self._cap,
        )

    def feed(self, chunk: bytes) -> None:
        self._raw += len(chunk)
        if self._raw > self._cap:
            raise self._too_big("as received")
        inflater = self._inflater
        if inflater is None:
            self._size += len(chunk)
            self._parts.append(chunk)
            return
        data = chunk
        while data:
            try:
                out = inflater.decompress(data, self._cap - self._size + 1)
            except zlib.error as exc:
                if self.encoding == "deflate" and self._size == 0 and not self._parts:
                    # "deflate" is sometimes sent raw, without the zlib wrapper.
                    self._inflater = inflater = zlib.decompressobj(-zlib.MAX_WBITS)
                    continue
                raise ResponseError(
                    f"the {self.encoding} body of {self._ctx.url} is corrupt: {exc}",
                    url=self._ctx.url,
                ) from exc
            self._size += len(out)
            if self._size > self._cap:
                raise self._too_big(f"after {self.encoding} decoding")
            if out:
                self._parts.append(out)
            data = inflater.unconsumed_tail

    def result(self, fresh: bool) -> bytes:
        """The whole decoded body, once the backend read the raw one to its end.

        Args:
            fresh: the exchange ran on a connection opened for it (for the error).

        Raises:
            ResponseError: over the cap after decoding.
            RemoteProtocolError: a compressed body that stops before its stream's end
                (``decompressobj().eof`` unset): cut short, as a dropped connection is
                (``received``), never passed on as a whole answer. An empty body is no
                stream and passes.
        """
        inflater = self._inflater
        if inflater is not None:
            tail = inflater.flush()
            self._size += len(tail)
            if self._size > self._cap:
                raise self._too_big(f"after {self.encoding} decoding")
            self._parts.append(tail)
            if self._raw and not inflater.eof:
                raise RemoteProtocolError(
                    f"the {self.encoding} body of {self._ctx.url} ends before its stream "
                    "does: the response was cut short",
                    url=self._ctx.url,
                    received=True,
                    fresh=fresh,
                )
        parts = self._parts
        return parts[0] if len(parts) == 1 else b"".join(parts)


def _declared_too_big(headers: Mapping[str, str], cap: int, ctx: ErrorContext) -> None:
    raw = headers.get("content-length")
    if raw is None:
        return
    try:
        size = int(raw)
    except ValueError:
        return
    if size > cap:
        raise ResponseError(
            f"the response of {ctx.url} declares {size:,} bytes (Content-Length), above the "
            f"cap of {cap:,} bytes; raise max_response_bytes if it is legitimate",
            url=ctx.url,
            max_bytes=cap,
        )


def _deadline(total: float | None) -> float | None:
    return None if total is None else time.monotonic() + total


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


# --------------------------------------------------------------------------- one exchange


class Progress:
    """How far one exchange got, for the error it may end in (``mapped``) and for the
    sync backend's watchdog.

    Attributes:
        deadline: the ``time.monotonic()`` the exchange must end by (``None``: none).
        connect, write: the connect and write timeouts in force (seconds).
        stage: ``"connect"``, ``"write"`` or ``"read"``.
        fresh: the exchange runs on a connection opened for it.
        connected: a connection was opened during this exchange.
        received: part of the response has arrived.
        conn: the backend's connection object (sync HTTP/1.1), once known.
        expired: the watchdog shut the connection down at the deadline.
    """

    __slots__ = (
        "conn",
        "connect",
        "connected",
        "deadline",
        "expired",
        "fresh",
        "received",
        "stage",
        "write",
    )

    def __init__(
        self,
        deadline: float | None,
        connect: float | None = None,
        write: float | None = None,
    ) -> None:
        self.deadline = deadline
        self.connect = connect
        self.write = write
        self.stage = "connect"
        self.fresh = True
        self.connected = False
        self.received = False
        self.conn: Any = None
        self.expired = False


def failure(
    exc: Exception, req: Request, progress: Progress, backend: str, *, proxy: bool = False
) -> QwenEmbedError:
    """The library's error for what a backend raised during ``req`` (``_exceptions.translate``,
    the one map), built once with how far the exchange got (``fresh``, ``received``); a
    timeout at or past the deadline (a per-read timeout set to the time left), and any
    failure of a read the watchdog cut at the deadline, is the total budget's
    ``ReadTimeout``. The caller raises it with no chain (see ``Mapped``)."""
    error = translate(
        exc,
        req.ctx,
        backend=backend,
        stage=progress.stage,
        proxy=proxy,
        fresh=progress.fresh,
        received=progress.received,
    )
    deadline = progress.deadline
    if progress.expired or (
        isinstance(error, TimeoutException)
        and not isinstance(error, PoolTimeout)
        and deadline is not None
        and time.monotonic() >= deadline - 0.002
    ):
        error = total_timeout_error(
            req.ctx, req.total, received=progress.received, fresh=progress.fresh
        )
    return error


class Mapped:
    """The block of one exchange (``with mapped(...) as block:``): whatever the backend
    raises inside it becomes ``failure(...)``, kept as ``error`` (the exception is
    swallowed), and ``block.check()``, called right after the block, raises it. Raised
    there, outside every ``except`` clause, the library's error has no ``__cause__``
    and no ``__context__``: the backend's exception quotes the server's bytes as they
    came (a status line, a chunk-size line, a header line) and a formatted traceback
    prints every exception of the chain. What the chain tells is read before
    (``translate``). The library's own errors, ``Retired`` and non-``Exception``s pass
    through as they are."""

    __slots__ = ("backend", "error", "progress", "proxy", "req")

    def __init__(self, req: Request, progress: Progress, backend: str, proxy: bool) -> None:
        self.req = req
        self.progress = progress
        self.backend = backend
        self.proxy = proxy
        self.error: QwenEmbedError | None = None

    def __enter__(self) -> Mapped:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> bool:
        if not isinstance(exc, Exception) or isinstance(exc, QwenEmbedError | Retired):
            return False
        self.error = failure(exc, self.req, self.progress, self.backend, proxy=self.proxy)
        return True

    def check(self) -> None:
        """Raise the error the block ended in, if any (call it outside any ``except``)."""
        if self.error is not None:
            raise self.error


def mapped(req: Request, progress: Progress, backend: str, *, proxy: bool = False) -> Mapped:
    """The block of one exchange whose backend failure becomes the library's error,
    raised with no chain by ``check()`` right after the block (see ``Mapped``)."""
    return Mapped(req, progress, backend, proxy)


def check_status(status: int, req: Request, progress: Progress) -> None:
    """Refuse a status that is not a final HTTP answer (``200``-``599`` after the
    backend skipped interim ``1xx`` answers): the connection is then closed, never
    reused, and no body is read as an answer."""
    if 200 <= status <= 599:
        return
    what = "an interim (1xx) answer" if 100 <= status <= 199 else "a malformed status"
    raise RemoteProtocolError(
        f"{req.ctx.url} answered with {what} ({status}) where the final response was due",
        url=req.ctx.url,
        fresh=progress.fresh,
        received=True,
    )


# --------------------------------------------------------------------------- gates


class ProcessGate:
    """A process-wide cap on requests in flight to one endpoint, shared by threads and
    every event loop (``Limits.max_connections_per_process``).

    Waiters are served first come, first served; a thread waits on a lock, a coroutine
    on a future of its own loop (woken thread-safely). A wait longer than the pool
    timeout raises ``PoolTimeout``.
    """

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._lock = threading.Lock()
        self._used = 0
        self._waiters: list[Any] = []  # threading.Lock (held) or (loop, future)

    def _grant_next(self) -> None:
        # with self._lock held, self._used already decremented
        while self._waiters and self._used < self.slots:
            waiter = self._waiters.pop(0)
            if isinstance(waiter, tuple):
                loop, future = waiter
                if future.done() or loop.is_closed():
                    continue
                self._used += 1
                loop.call_soon_threadsafe(_settle, future)
            else:
                self._used += 1
                waiter.release()

    def acquire(self, timeout: float | None) -> bool:
        """Take a slot, waiting at most ``timeout`` seconds; ``False`` on timeout."""
        with self._lock:
            if self._used < self.slots and not self._waiters:
                self._used += 1
                return True
            waiter = threading.Lock()
            waiter.acquire()
            self._waiters.append(waiter)
        if waiter.acquire(timeout=-1 if timeout is None else timeout):
            return True
        with self._lock:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
                return False
        return True  # granted while timing out

    async def aacquire(self, timeout: float | None) -> bool:  # noqa: ASYNC109 - a wait bound
        """``acquire`` for a coroutine (the wait does not block the loop)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._used < self.slots and not self._waiters:
                self._used += 1
                return True
            future: asyncio.Future[None] = loop.create_future()
            entry = (loop, future)
            self._waiters.append(entry)
        try:
            async with asyncio.timeout(timeout):
                await future
            return True
        except (TimeoutError, asyncio.CancelledError) as exc:
            with self._lock:
                if entry in self._waiters:
                    self._waiters.remove(entry)
                    granted = False
                else:
                    granted = True
            if granted:  # the slot arrived as we gave up: pass it on
                self.release()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return False

    def release(self) -> None:
        """Return a slot."""
        with self._lock:
            self._used -= 1
            self._grant_next()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


_SDK_CAP_FLOOR = 8 << 20


def sdk_cap(body: bytes) -> int:
    """The response size cap for a request the openai SDK built: from the number of
    inputs of an embeddings request (each up to 8,192 float32 values written as JSON
    floats, 32 bytes each), at least 8 MiB."""
    try:
        import orjson

        data = orjson.loads(body) if body else None
    except ValueError:
        data = None
    inputs = data.get("input") if isinstance(data, dict) else None
    count = len(inputs) if isinstance(inputs, list) else 1
    return max(_SDK_CAP_FLOOR, count * 8192 * 32 + 65_536)
