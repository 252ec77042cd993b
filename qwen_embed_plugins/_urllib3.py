"""The blocking HTTP/1.1 backend: urllib3 through its public API.

``transport.SyncTransport`` sends every HTTP/1.1 exchange through an ``HTTP1Pool`` (HTTP/2
and cleartext h2c run on httpx). Why urllib3: it is the blocking library cheapest per
exchange on this workload (docs/benchmarks.md, "Transport candidates"), and the CPU floors
(sync <= 1.3x raw httpx, the array path <= 1.3x the stdlib) hold with it.

Which guarantee comes from where (every call below is urllib3's or the stdlib's public API):

- **Framing** (request head, ``Content-Length``, status line, headers, chunked bodies,
  ``Content-Length`` enforcement): ``HTTPConnectionPool.urlopen(..., retries=False,
  redirect=False, preload_content=False, decode_content=False)`` and
  ``HTTPResponse.read(amt)``; nothing is parsed or written by hand.
- **Connections never above the limit**: at most ``max_connections`` requests pass a
  semaphore in front of the pool (its wait bounded by ``Timeouts.pool`` and the time
  left; ``close()`` wakes the waiters, which then find the pool closed: ``Retired``).
- ``Limits.max_keepalive_connections``: the pool's documented ``maxsize`` with
  ``block=False`` ("more connections will be created but they will not be saved once
  they've been used"): a connection coming back to a full pool is closed. urllib3 logs a
  WARNING ("Connection pool is full, discarding connection") each time, so set it below
  ``max_connections`` only if that is wanted.
- **No reuse of a socket with bytes left**: ``HTTPResponse.release_conn()`` after the
  body was read to its end (urllib3 releases it itself at that point); any failure (or
  a body cut by its cap or deadline) calls ``HTTPResponse.close()`` first, so the
  connection goes back to the pool closed. urllib3 closes a pooled connection whose
  socket turned readable while idle (a FIN, or a stray response no request asked for)
  before reusing it.
- **The total time budget** (``Request.total``): the connect, write and per-read
  timeouts and the pool wait are each at most the time left, and a watchdog thread
  shuts the socket down (``socket.shutdown``) when the deadline passes, so a head,
  chunk-size line or trailer trickled byte by byte ends too. The watchdog finds the
  connection because the pool's ``ConnectionCls`` (a documented class attribute) is a
  subclass of ``urllib3.connection.HTTPConnection`` that overrides its public
  ``connect()``, ``request()`` and ``getresponse()`` (each calls the original): they
  register the connection with the exchange under way in this thread, count
  connections opened once connected (TCP, and TLS for https), note whether the
  exchange runs on a fresh one, set the connect and write timeouts (urllib3 would send
  with the connect timeout), and close a kept-alive connection idle for longer than
  ``Limits.keepalive_expiry`` before it is used again (urllib3 has no keep-alive expiry;
  the request then opens a new one). Idle connections are not swept while the pool is
  in use; the pool registry's reaper closes a pool idle for longer than the expiry.
- **1xx answers**: ``http.client`` skips ``100 Continue`` only; any other 1xx taken as
  the response raises ``RemoteProtocolError`` and the connection is closed (its final
  answer is never read as the next request's).
- Proxies: ``urllib3.ProxyManager`` (CONNECT for https, absolute-form for http), its
  ``pool_classes_by_scheme`` set to the pool classes above.

Remaining reliance on behaviour urllib3 does not document: that ``urlopen`` calls the
connection's ``request()`` then ``getresponse()`` for each exchange (the watchdog and
the expiry hook there; without it a trickled head would again be bounded only per
read). ``verify=False`` silences urllib3's ``InsecureRequestWarning`` for that host only
(a ``warnings`` filter). The TLS handshake is bounded by the connect timeout per read,
not by the watchdog (the socket is not reachable until ``connect()`` returns).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import ssl
import threading
import time
import warnings
from typing import Any
from urllib.parse import unquote, urlsplit

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import ClosedPoolError

from .config import PoolKey
from .errors import pool_timeout_error, total_timeout_error
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
    ssl_context,
)

__all__ = ["HTTP1Pool"]

_local = threading.local()  # .progress: the exchange under way in this thread


# --------------------------------------------------------------------------- watchdog


class _Watchdog:
    """One daemon thread per process that shuts down the socket of an exchange whose
    deadline has passed (the blocked read or write in the exchange's thread then fails
    at once). It sleeps until the soonest deadline, or while nothing is registered."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active: dict[int, Progress] = {}
        self._soonest = float("inf")
        self._pid = -1

    def add(self, progress: Progress) -> None:
        deadline = progress.deadline if progress.deadline is not None else float("inf")
        with self._cond:
            if self._pid != os.getpid():  # first use, or a forked child: no thread yet
                self._pid = os.getpid()
                self._active.clear()
                self._soonest = float("inf")
                threading.Thread(target=self._run, name="qwen-embed-watchdog", daemon=True).start()
            self._active[id(progress)] = progress
            if deadline < self._soonest:
                self._soonest = deadline
                self._cond.notify()

    def remove(self, progress: Progress) -> None:
        with self._cond:
            self._active.pop(id(progress), None)

    def _run(self) -> None:
        cond = self._cond
        with cond:
            while True:
                if not self._active:
                    self._soonest = float("inf")
                    cond.wait()
                    continue
                now = time.monotonic()
                soonest = float("inf")
                for key, progress in list(self._active.items()):
                    deadline = progress.deadline or now
                    if deadline <= now and _shut(progress):
                        del self._active[key]
                    else:
                        # not connected yet: try again shortly
                        soonest = min(soonest, deadline if deadline > now else now + 0.05)
                self._soonest = soonest
                cond.wait(min(max(soonest - now, 0.001), 3600.0))


def _shut(progress: Progress) -> bool:
    """Shut the exchange's socket down; ``False`` if it has none yet. A connection that
    went back to the pool (its body read to the end) and was taken by another exchange
    is left alone."""
    conn = progress.conn
    if conn is None or conn.qwen_progress is not progress:
        return conn is not None
    sock = conn.sock
    if sock is None:
        return False
    progress.expired = True
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    return True


_watchdog = _Watchdog()


# --------------------------------------------------------------------------- urllib3 classes


class _ConnMixin:
    """Public-method overrides of urllib3's connection classes (see the module text)."""

    qwen_owner: HTTP1Pool  # set on the per-pool subclass
    qwen_idle_since = 0.0  # monotonic time its last response head arrived
    qwen_progress: Progress | None = None  # the exchange using it

    def connect(self) -> None:
        progress: Progress | None = getattr(_local, "progress", None)
        if progress is not None:
            progress.stage = "connect"
            progress.connected = progress.fresh = True
            self.timeout = progress.connect
        super().connect()  # type: ignore[misc]
        self.qwen_owner.metrics.connection_opened()
        if progress is not None:
            progress.conn = self
            self.qwen_progress = progress
            progress.stage = "write"
            self.timeout = progress.write
            self.sock.settimeout(progress.write)  # type: ignore[attr-defined]

    def request(self, *args: Any, **kwargs: Any) -> None:
        progress: Progress | None = getattr(_local, "progress", None)
        if progress is not None:
            if self.sock is not None and not progress.connected:  # type: ignore[attr-defined]
                progress.fresh = False  # a kept-alive connection
                if time.monotonic() - self.qwen_idle_since > self.qwen_owner.expiry:
                    self.close()  # type: ignore[attr-defined]  # expired: reconnected below
            progress.conn = self
            self.qwen_progress = progress
            progress.stage = "write"
            self.timeout = progress.write
        super().request(*args, **kwargs)  # type: ignore[misc]
        if progress is not None:
            progress.stage = "read"

    def getresponse(self) -> Any:
        response = super().getresponse()  # type: ignore[misc]
        self.qwen_idle_since = time.monotonic()
        return response


class _Conn(_ConnMixin, HTTPConnection):
    pass


class _TLSConn(_ConnMixin, HTTPSConnection):
    pass


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
        self.expiry = limits.keepalive_expiry
        self._size = limits.max_connections
        self._slots = threading.Semaphore(self._size)
        self._targets: dict[str, str] = {}
        self._closed = False
        parts = urlsplit(key.base_url)
        conn_cls: Any = type("_Conn", (_Conn,), {"qwen_owner": self})
        tls_cls: Any = type("_TLSConn", (_TLSConn,), {"qwen_owner": self})
        pool_cls = type("_Pool", (HTTPConnectionPool,), {"ConnectionCls": conn_cls})
        tls_pool_cls = type("_TLSPool", (HTTPSConnectionPool,), {"ConnectionCls": tls_cls})
        kw: dict[str, Any] = {
            # at most max_connections requests pass the semaphore; the pool keeps at most
            # max_keepalive_connections of their connections (block=False: one more is
            # opened when none is free, and closed when it comes back to a full pool)
            "maxsize": min(limits.keepalive_connections, self._size),
            "block": False,
            "retries": False,
            "headers": {"User-Agent": _USER_AGENT},
        }
        if parts.scheme == "https":
            kw["ssl_context"] = ssl_ctx
            if key.verify is False:
                # verify=False is the user's explicit choice for this host: urllib3's
                # per-request InsecureRequestWarning for it is silenced (httpx, the other
                # backends, warns for none); other hosts keep theirs
                host = re.escape(parts.hostname or "")
                warnings.filterwarnings(
                    "ignore",
                    message=f"Unverified HTTPS request is being made to host '{host}'",
                    category=urllib3.exceptions.InsecureRequestWarning,
                )
        self._manager: Any = None
        if key.proxy:
            proxy_url, proxy_headers = _proxy_parts(key.proxy)
            extra: dict[str, Any] = {}
            if proxy_url.startswith("https://"):  # TLS to the proxy, verified as the key says
                extra["proxy_ssl_context"] = ssl_context(key.verify, http2=False, cleartext=False)
            manager = urllib3.ProxyManager(proxy_url, proxy_headers=proxy_headers, **extra, **kw)
            manager.pool_classes_by_scheme = {"http": pool_cls, "https": tls_pool_cls}
            self._manager = manager
            self._pool: Any = None
        else:
            host = parts.hostname or ""
            port = parts.port or (443 if parts.scheme == "https" else 80)
            cls = tls_pool_cls if parts.scheme == "https" else pool_cls
            self._pool = cls(host, port, **kw)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close every idle connection now; those in use close when they come back.
        Threads waiting for a connection get ``Retired``."""
        self._closed = True
        if self._pool is not None:
            self._pool.close()
        if self._manager is not None:
            self._manager.clear()
        for _ in range(self._size):  # wake the waiters: they find the pool closed
            self._slots.release()

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
        resp: Any = None
        complete = False
        _local.progress = progress
        if deadline is not None:
            _watchdog.add(progress)
        try:
            with mapped(req, progress, "urllib3", proxy=self._manager is not None):
                try:
                    resp = self._urlopen(req, headers, urllib3.Timeout(connect=connect, read=read))
                except ClosedPoolError:
                    raise Retired from None
                check_status(resp.status, req, progress)
                resp_headers = resp.headers
                _declared_too_big(resp_headers, req.max_bytes, req.ctx)
                body = _Body(resp_headers.get("content-encoding", ""), req.max_bytes, req.ctx)
                read_chunk = resp.read
                while True:
                    chunk = read_chunk(_CHUNK, decode_content=False)
                    if not chunk:
                        break
                    progress.received = True
                    body.feed(chunk)
                    if deadline is not None and time.monotonic() > deadline:
                        raise total_timeout_error(
                            req.ctx, req.total, received=True, fresh=progress.fresh
                        )
                data = body.result()
                complete = True
        finally:
            _local.progress = None
            if deadline is not None:
                _watchdog.remove(progress)
            if resp is not None:
                if not complete or progress.expired:
                    resp.close()  # never reuse a socket with bytes left
                resp.release_conn()
        version = resp.version
        return Reply(
            status=resp.status,
            headers=resp_headers,
            body=data,
            fresh=progress.fresh,
            http_version="HTTP/1.0" if version == 10 else "HTTP/1.1",
        )

    def _urlopen(self, req: Request, headers: dict[str, str], timeout: Any) -> Any:
        kw: dict[str, Any] = {
            "body": req.body or None,
            "headers": headers,
            "retries": False,
            "redirect": False,
            "timeout": timeout,
            "preload_content": False,
            "decode_content": False,
            "release_conn": False,
        }
        if self._manager is not None:
            return self._manager.urlopen(req.method, req.url, **kw)
        target = self._targets.get(req.url)
        if target is None:
            if not self._pool.is_same_host(req.url):
                raise ValueError(f"the URL is not this pool's server ({self.key.label})")
            target = urllib3.util.parse_url(req.url).request_uri
            if len(self._targets) < 256:
                self._targets[req.url] = target
        return self._pool.urlopen(req.method, target, **kw)


def _proxy_parts(proxy: str) -> tuple[str, dict[str, str]]:
    """The proxy URL without credentials, and the ``Proxy-Authorization`` header they
    make (Basic), if any."""
    parts = urlsplit(proxy)
    headers: dict[str, str] = {}
    if parts.username is not None:
        auth = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        headers = dict(urllib3.util.make_headers(proxy_basic_auth=auth))
    host = parts.hostname or ""
    shown = f"[{host}]" if ":" in host else host
    netloc = f"{shown}:{parts.port}" if parts.port else shown
    return f"{parts.scheme}://{netloc}", headers
