"""The blocking HTTP/1.1 backend: the stdlib's ``http.client`` through its public API,
with a small connection pool of its own.

``_sync_http.SyncTransport`` sends every HTTP/1.1 exchange through an ``HTTP1Pool`` (HTTP/2
and cleartext h2c run on httpx). Why ``http.client``: it is the floor the benchmark
measures the library against (``bench/compare.py``: "stdlib keepalive"), and the sync
CPU floors of docs/benchmarks.md hold with it; urllib3's public ``urlopen`` costs more
CPU per exchange on top of it (measured while choosing: docs/benchmarks.md, "Transport
candidates").

Which guarantee comes from where (every call below is public stdlib API):

- **Framing** (request line, ``Host``, ``Content-Length``, status line, headers, chunked
  bodies): ``HTTPConnection.request()`` / ``getresponse()`` / ``HTTPResponse.read1()``;
  nothing is parsed or written by hand.
- **Connections never above the limit**: at most ``max_connections`` requests hold a
  slot of a semaphore (its wait bounded by ``Timeouts.pool`` and the time left;
  ``close()`` wakes the waiters, which then find the pool closed: ``Retired``); an
  exchange takes an idle connection if there is one and opens one only if not.
- **Keep-alive**: idle connections are kept last-in first-out, at most
  ``max_keepalive_connections``; one idle longer than ``keepalive_expiry`` is closed
  instead of reused, and so is one whose socket turned readable while idle (a FIN, or a
  stray response no request asked for: ``select``). Whether a connection may carry the
  next request is decided here (``_framing``) from the documented ``HTTPResponse.version``
  and the headers (RFC 9112): not after ``Connection: close``, an HTTP/1.0 answer without
  keep-alive or a body that ends with the connection.
- **No reuse of a socket with bytes left**: a connection goes back to the pool only
  after its response was read to the end (``read1`` until ``b""``; a body short of its
  ``Content-Length`` is refused, counted here: ``read1`` does not raise for it); any
  failure, or a body cut by its cap or deadline, closes it.
- **The total time budget** (``Request.total``): the connect timeout (the connection's
  documented ``timeout`` argument), the write and per-read socket timeouts and the pool
  wait are each at most the time left, and a watchdog thread
  shuts the socket down (``socket.shutdown``) when the deadline passes, so a head,
  chunk-size line or trailer trickled byte by byte ends too.
- **1xx answers**: ``http.client`` skips ``100 Continue`` only; another 1xx taken as the
  response raises ``RemoteProtocolError`` and the connection is closed (its final
  answer is never read as the next request's).
- **Proxies**: ``set_tunnel`` (CONNECT, ``Proxy-Authorization``) for https; absolute-form
  targets for http. TLS to the proxy itself (an ``https://`` proxy URL) is not supported
  on this path (a clear ``TransportError``).
- Connections opened are counted once established (TCP, and TLS for https).

The calls are the documented ones: ``HTTPConnection(host, port, timeout=,
context=)``, ``set_tunnel``, ``connect``, ``request``, ``getresponse``, ``close``;
``HTTPResponse.status`` / ``version`` / ``getheaders()`` / ``read1()`` (the
``io.BufferedIOBase`` reader API, supported since 3.5) / ``close()``.

Remaining reliance on what ``http.client`` does not document: ``HTTPConnection.sock``,
the connection's socket, read (never assigned) to set the write and read timeouts from
the time left (``settimeout``), for the idle check (``select``), for the watchdog's
``shutdown`` and to see whether ``http.client`` closed the connection itself. No
documented API gives an ``HTTPConnection``'s socket (the docs list ``request``,
``getresponse``, ``set_debuglevel``, ``set_tunnel``, ``connect``, ``close``,
``blocksize``, ``putrequest``/``putheader``/``endheaders``/``send``), and none takes one:
a subclass whose ``connect()`` made the socket itself would have to assign ``sock`` (and
read the undocumented ``host``/``port``/``timeout``, and call the private ``_tunnel``
for a proxy), which is worse than reading it. ``sock`` is the attribute the stdlib's
own ``HTTPSConnection`` and urllib3's connection classes set and use. Bounded: it is
only read, never assigned; were it renamed or left ``None`` once connected, every
exchange would fail at once (``AttributeError`` on ``conn.sock.settimeout``), not
silently.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import select
import socket
import ssl
import threading
import time
from typing import Any
from urllib.parse import unquote, urlsplit

from .._config import PoolKey
from .._metrics import EndpointMetrics
from ..errors import TransportError, pool_timeout_error, total_timeout_error
from ._contract import (
    _ACCEPT_ENCODING,
    _CHUNK,
    _USER_AGENT,
    Progress,
    Reply,
    Request,
    Retired,
    _Body,
    _declared_too_big,
    check_status,
    mapped,
)

__all__ = ["HTTP1Pool"]


# --------------------------------------------------------------------------- watchdog


class _Watchdog:
    """One daemon thread per process that shuts down the socket of an exchange whose
    deadline has passed (the blocked read or write in the exchange's thread then fails
    at once). While exchanges are under way it wakes every ``_TICK`` seconds (or at the
    soonest deadline, if sooner), so registering an exchange costs no thread switch;
    after ``_PARK`` seconds without one it sleeps until the next is registered."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active: dict[int, Progress] = {}
        self._parked = True
        self._pid = -1

    def add(self, progress: Progress) -> None:
        with self._cond:
            if self._pid != os.getpid():  # first use, or a forked child: no thread yet
                self._pid = os.getpid()
                self._active.clear()
                self._parked = False
                threading.Thread(target=self._run, name="qwen-embed-watchdog", daemon=True).start()
            self._active[id(progress)] = progress
            if self._parked:
                self._parked = False
                self._cond.notify()

    def remove(self, progress: Progress) -> None:
        with self._cond:
            self._active.pop(id(progress), None)

    def _run(self) -> None:
        cond = self._cond
        idle_since = time.monotonic()
        with cond:
            while True:
                now = time.monotonic()
                if not self._active:
                    if now - idle_since > _PARK:
                        self._parked = True
                        cond.wait()
                        idle_since = time.monotonic()
                        continue
                    cond.wait(_TICK)
                    continue
                idle_since = now
                soonest = now + _TICK
                for key, progress in list(self._active.items()):
                    deadline = progress.deadline
                    if deadline is None:
                        continue
                    if deadline <= now:
                        if _shut(progress):
                            del self._active[key]
                    else:
                        soonest = min(soonest, deadline)
                cond.wait(max(soonest - now, 0.001))


_TICK = 0.1  # seconds between the watchdog's checks while exchanges are under way
_PARK = 5.0  # seconds without an exchange before the watchdog sleeps until the next


def _shut(progress: Progress) -> bool:
    """Shut the exchange's socket down; ``False`` if it has none yet (connecting)."""
    conn = progress.conn
    sock = conn.sock if conn is not None else None
    if sock is None:
        return False
    progress.expired = True
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    return True


_watchdog = _Watchdog()


class _Headers(dict[str, str]):
    """Response headers: names stored lower-case, lookups case-insensitive, a repeated
    header's values joined with ``", "`` (RFC 9110 section 5.3)."""

    __slots__ = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict.get(self, key.lower(), default)

    def __getitem__(self, key: str) -> str:
        return dict.__getitem__(self, key.lower())

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key.lower() if isinstance(key, str) else key)


def _headers(items: list[tuple[str, str]]) -> _Headers:
    headers = _Headers()
    for name, value in items:
        name = name.lower()
        if "\n" in value:  # obsolete line folding: the fold is one space
            value = " ".join(part.strip() for part in value.splitlines())
        before = dict.get(headers, name)
        dict.__setitem__(headers, name, value if before is None else f"{before}, {value}")
    return headers


def _framing(method: str, status: int, version: int, headers: _Headers) -> tuple[int | None, bool]:
    """How the body of a response is delimited, and whether its connection can carry the
    next request, from the documented parts of the response (``HTTPResponse.status``,
    ``version`` and the headers) by the rules of RFC 9112 (sections 6.3 and 9.3), which
    ``http.client`` reads the body by.

    Returns:
        ``(declared, persistent)``: the ``Content-Length`` the body must reach (``None``:
        none to check: no body, a chunked body, or one that ends with the connection),
        and whether the connection stays open after the response (HTTP/1.1 unless
        ``Connection: close``; HTTP/1.0 only with keep-alive; never after a body that
        ends with the connection).
    """
    connection = headers.get("connection", "").lower()
    if version == 11:
        persistent = "close" not in connection
    else:
        persistent = (
            bool(headers.get("keep-alive"))
            or "keep-alive" in connection
            or "keep-alive" in headers.get("proxy-connection", "").lower()
        )
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return None, persistent
    coding = headers.get("transfer-encoding")
    if coding is not None:  # chunked: ends with its last chunk; any other: with the close
        return None, persistent and coding.strip().lower() == "chunked"
    raw = headers.get("content-length")
    try:
        declared = None if raw is None else int(raw.split(",")[0])
    except ValueError:
        declared = None
    if declared is None or declared < 0:
        return None, False  # the body ends when the server closes the connection
    return declared, persistent


# --------------------------------------------------------------------------- the pool


class HTTP1Pool:
    """The HTTP/1.1 connections of one pool key, shared by all threads.

    Args:
        key: the pool's settings (URL, limits, TLS verification, proxy).
        metrics: where connections opened are counted.
        ssl_ctx: the process's SSL context for ``key`` (``_contract.ssl_context``).
    """

    def __init__(self, key: PoolKey, metrics: EndpointMetrics, ssl_ctx: ssl.SSLContext) -> None:
        self.key = key
        self.metrics = metrics
        limits = key.limits
        self._expiry = limits.keepalive_expiry
        self._size = limits.max_connections
        self._keep = min(limits.keepalive_connections, self._size)
        self._slots = threading.Semaphore(self._size)
        self._lock = threading.Lock()
        self._idle: list[tuple[Any, float]] = []  # (connection, monotonic time it went idle)
        self._closed = False
        parts = urlsplit(key.base_url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._https else 80)
        self._ssl = ssl_ctx
        self._targets: dict[str, str] = {}
        self._proxy: tuple[str, str, int, dict[str, str]] | None = None
        self.proxied = bool(key.proxy)
        if key.proxy:
            proxy = urlsplit(key.proxy)
            headers: dict[str, str] = {}
            if proxy.username is not None:
                import base64

                auth = f"{unquote(proxy.username)}:{unquote(proxy.password or '')}"
                token = base64.b64encode(auth.encode("latin-1")).decode("ascii")
                headers["Proxy-Authorization"] = f"Basic {token}"
            port = proxy.port or (443 if proxy.scheme == "https" else 80)
            self._proxy = (proxy.scheme, proxy.hostname or "", port, headers)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close every idle connection now; those in use close when they come back.
        Threads waiting for a connection get ``Retired``."""
        self._closed = True
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()
        for _ in range(self._size):  # wake the waiters: they find the pool closed
            self._slots.release()

    # ---------------------------------------------------------------- connections

    def _new(self, timeout: float | None) -> Any:
        """A new, unconnected connection whose connect (TCP, TLS, proxy tunnel) takes at
        most ``timeout`` seconds (the constructor's documented ``timeout``)."""
        proxy = self._proxy
        if proxy is None:
            if self._https:
                return http.client.HTTPSConnection(
                    self._host, self._port, timeout=timeout, context=self._ssl
                )
            return http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        scheme, host, port, headers = proxy
        if scheme == "https":
            raise TransportError(
                f"TLS to the proxy itself (an https:// proxy URL) is not supported for "
                f"{self.key.label} over HTTP/1.1; use an http:// proxy URL (https targets "
                "are tunnelled with CONNECT)",
                url=self.key.label,
                sent=False,
            )
        if self._https:
            conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=self._ssl)
            conn.set_tunnel(self._host, self._port, headers=headers)
            return conn
        return http.client.HTTPConnection(host, port, timeout=timeout)

    def _take(self, timeout: float | None) -> tuple[Any, bool]:
        """``(connection, idle)``: an idle connection still fit for reuse (``True``), or
        a new, unconnected one with a connect ``timeout`` (``False``)."""
        while True:
            with self._lock:
                if not self._idle:
                    break
                conn, since = self._idle.pop()
            sock = conn.sock
            if sock is not None and time.monotonic() - since <= self._expiry:
                try:
                    readable = select.select([sock], [], [], 0)[0]
                except (OSError, ValueError):
                    readable = [sock]
                if not readable:  # no FIN, no stray bytes
                    return conn, True
            conn.close()
        return self._new(timeout), False

    def _give_back(self, conn: Any, reusable: bool) -> None:
        if reusable and conn.sock is not None and not self._closed:
            with self._lock:
                if len(self._idle) < self._keep:
                    self._idle.append((conn, time.monotonic()))
                    return
        conn.close()

    def _target(self, url: str) -> str:
        found = self._targets.get(url)
        if found is not None:
            return found
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if (parts.hostname or "").lower() != self._host.lower() or port != self._port:
            raise ValueError(f"the URL is not this pool's server ({self.key.label})")
        found = parts.path or "/"
        if parts.query:
            found += "?" + parts.query
        if self._proxy is not None and not self._https:
            found = url  # absolute-form through a forward proxy
        if len(self._targets) < 256:
            self._targets[url] = found
        return found

    # ---------------------------------------------------------------- exchanges

    def exchange(self, req: Request, deadline: float | None) -> Reply:
        """Perform ``req`` (HTTP/1.1) within its size cap and ``deadline`` (a
        ``time.monotonic()`` value or ``None``).

        Raises:
            QwenEmbedError: a translated error (``TransportError`` s carry ``fresh``).
            Retired: the pool was closed before or while this request waited.
        """
        if self._closed:
            raise Retired
        t = req.timeouts
        wait = t.pool
        left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
        if left is not None:
            wait = left if wait is None else min(wait, left)
        if not self._slots.acquire(timeout=wait):
            raise pool_timeout_error(req.ctx)
        try:
            if self._closed:
                raise Retired
            return self._exchange(req, deadline, left)
        finally:
            self._slots.release()

    def _exchange(self, req: Request, deadline: float | None, left: float | None) -> Reply:
        t = req.timeouts
        connect, read, write = t.connect, t.read, t.write
        if left is not None:
            connect = left if connect is None else min(connect, left)
            read = left if read is None else min(read, left)
            write = left if write is None else min(write, left)
        progress = Progress(deadline, connect, write)
        headers = dict(req.headers)
        headers.setdefault("Accept-Encoding", _ACCEPT_ENCODING)
        headers.setdefault("User-Agent", _USER_AGENT)
        if self._proxy is not None and not self._https:
            headers.update(self._proxy[3])
        conn: Any = None
        resp: Any = None
        complete = persistent = False
        try:
            with mapped(req, progress, "stdlib", proxy=self._proxy is not None) as block:
                target = self._target(req.url)
                conn, idle = self._take(connect)
                progress.conn = conn
                if deadline is not None:
                    _watchdog.add(progress)
                if idle:
                    progress.fresh = False
                else:
                    progress.connected = True
                    conn.connect()
                    self.metrics.connection_opened()
                progress.stage = "write"
                conn.sock.settimeout(write)
                conn.request(req.method, target, req.body or None, headers)
                progress.stage = "read"
                conn.sock.settimeout(read)
                resp = conn.getresponse()
                check_status(resp.status, req, progress)
                resp_headers = _headers(resp.getheaders())
                length = resp_headers.get("content-length")
                if length is not None and len({v.strip() for v in length.split(",")}) > 1:
                    # http.client would take the first: which body is the answer?
                    raise http.client.HTTPException(f"conflicting Content-Length: {length}")
                _declared_too_big(resp_headers, req.max_bytes, req.ctx)
                declared, persistent = _framing(req.method, resp.status, resp.version, resp_headers)
                body = _Body(resp_headers.get("content-encoding", ""), req.max_bytes, req.ctx)
                read1 = resp.read1
                received = 0
                while True:
                    chunk = read1(_CHUNK)
                    if not chunk:
                        break
                    received += len(chunk)
                    progress.received = True
                    body.feed(chunk)
                    if deadline is not None and time.monotonic() > deadline:
                        raise total_timeout_error(
                            req.ctx, req.total, received=True, fresh=progress.fresh
                        )
                if progress.expired:  # cut at the deadline (a trickled trailer ends quietly)
                    raise total_timeout_error(
                        req.ctx, req.total, received=True, fresh=progress.fresh
                    )
                if declared is not None and received < declared:
                    # Content-Length not reached: the server closed early (read1 returns
                    # b"" at the end of the stream, documented; it does not raise)
                    raise http.client.IncompleteRead(b"", declared - received)
                data = body.result(progress.fresh)
                resp.close()  # read to its end: the connection may take the next request
                complete = True
            block.check()  # the backend's failure, raised with no chain
        finally:
            if deadline is not None:
                _watchdog.remove(progress)
            if conn is not None:
                reusable = complete and persistent and not progress.expired
                self._give_back(conn, reusable)
        return Reply(
            status=resp.status,
            headers=resp_headers,
            body=data,
            fresh=progress.fresh,
            http_version="HTTP/1.0" if resp.version == 10 else "HTTP/1.1",
        )
