"""The blocking HTTP/1.1 backend: the stdlib's ``http.client`` through its public API,
with a small connection pool of its own.

``transport.SyncTransport`` sends every HTTP/1.1 exchange through an ``HTTP1Pool`` (HTTP/2
and cleartext h2c run on httpx). Why ``http.client``: it is the floor the benchmark
measures the library against (``bench/compare.py``: "stdlib keepalive"), and the sync
CPU floors (<= 1.3x raw httpx per request, the array path <= 1.3x the stdlib) hold with
it; urllib3's public ``urlopen`` adds ~250 us per exchange on top of it (measured while
choosing: docs/benchmarks.md, "Transport candidates").

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
  stray response no request asked for: ``select``). A response that says
  ``Connection: close`` (or is HTTP/1.0 without keep-alive) makes ``http.client`` close
  the connection itself.
- **No reuse of a socket with bytes left**: a connection goes back to the pool only
  after its response was read to the end; any failure, or a body cut by its cap or
  deadline, closes it.
- **The total time budget** (``Request.total``): the connect, write and per-read socket
  timeouts and the pool wait are each at most the time left, and a watchdog thread
  shuts the socket down (``socket.shutdown``) when the deadline passes, so a head,
  chunk-size line or trailer trickled byte by byte ends too.
- **1xx answers**: ``http.client`` skips ``100 Continue`` only; another 1xx taken as the
  response raises ``RemoteProtocolError`` and the connection is closed (its final
  answer is never read as the next request's).
- **Proxies**: ``set_tunnel`` (CONNECT, ``Proxy-Authorization``) for https; absolute-form
  targets for http. TLS to the proxy itself (an ``https://`` proxy URL) is not supported
  on this path (a clear ``TransportError``).
- Connections opened are counted once established (TCP, and TLS for https).

Remaining reliance on behaviour ``http.client`` does not document: ``HTTPResponse.length``
(the bytes of a ``Content-Length`` body not yet read; a body cut short is refused) and
``HTTPResponse.will_close`` (whether the server ends the connection after this
response) are read, as every user of ``read1()`` must; both are plain attributes of the
class since Python 3.0.
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

from .config import PoolKey
from .errors import TransportError, pool_timeout_error, total_timeout_error
from .metrics import EndpointMetrics
from .transport import (
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


# --------------------------------------------------------------------------- the pool


class HTTP1Pool:
    """The HTTP/1.1 connections of one pool key, shared by all threads.

    Args:
        key: the pool's settings (URL, limits, TLS verification, proxy).
        metrics: where connections opened are counted.
        ssl_ctx: the process's SSL context for ``key`` (``transport.ssl_context``).
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

    def _new(self) -> Any:
        proxy = self._proxy
        if proxy is None:
            if self._https:
                return http.client.HTTPSConnection(self._host, self._port, context=self._ssl)
            return http.client.HTTPConnection(self._host, self._port)
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
            conn = http.client.HTTPSConnection(host, port, context=self._ssl)
            conn.set_tunnel(self._host, self._port, headers=headers)
            return conn
        return http.client.HTTPConnection(host, port)

    def _take(self) -> Any:
        """An idle connection still fit for reuse, or a new (unconnected) one."""
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
                    return conn
            conn.close()
        return self._new()

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
        complete = False
        try:
            with mapped(req, progress, "stdlib", proxy=self._proxy is not None):
                target = self._target(req.url)
                conn = self._take()
                progress.conn = conn
                if deadline is not None:
                    _watchdog.add(progress)
                if conn.sock is None:
                    progress.connected = True
                    conn.timeout = connect
                    conn.connect()
                    self.metrics.connection_opened()
                else:
                    progress.fresh = False
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
                body = _Body(resp_headers.get("content-encoding", ""), req.max_bytes, req.ctx)
                read1 = resp.read1
                while True:
                    chunk = read1(_CHUNK)
                    if not chunk:
                        break
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
                if resp.length:  # Content-Length not reached: the server closed early
                    raise http.client.IncompleteRead(b"", resp.length)
                data = body.result()
                resp.close()  # read to its end: the connection may take the next request
                complete = True
        finally:
            if deadline is not None:
                _watchdog.remove(progress)
            if conn is not None:
                reusable = complete and not progress.expired and not resp.will_close
                self._give_back(conn, reusable)
        return Reply(
            status=resp.status,
            headers=resp_headers,
            body=data,
            fresh=progress.fresh,
            http_version="HTTP/1.0" if resp.version == 10 else "HTTP/1.1",
        )
