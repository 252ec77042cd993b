"""The blocking HTTP/1.1 transport: one urllib3 connection pool per pool key.

``transport.SyncTransport`` sends every HTTP/1.1 exchange through an ``HTTP1Pool``
(HTTP/2 and cleartext h2c stay on httpx). Why urllib3, and why this way: on this
workload urllib3's ``HTTPConnectionPool`` is the only blocking pool within 1.3x of the
stdlib floor (docs/benchmarks.md, "Transport candidates"), and most of what is left of
its cost is ``urlopen``'s per-request machinery (URL parsing, ``Retry`` and ``Timeout``
objects, urllib3's response wrapper). So urllib3 manages the **connections** — the
pool (``maxsize=max_connections``, ``block=True``: never more connections than the
limit), TCP/TLS set-up, proxies (CONNECT tunnels for https, absolute-form requests
for http, as ``urllib3.ProxyManager`` builds them), the dropped-connection check — and
each **exchange** is written here: the request head is built once per
(method, URL, headers) and sent with the body in one ``sendall``; the response is read
by the stdlib's ``http.client.HTTPResponse`` (status line and header limits, chunked
decoding) in 64 KiB chunks into ``transport._Body`` (size cap, bounded gzip/deflate).

What urllib3 does not do, added by subclassing its pool (``_get_conn`` / ``_put_conn``):

- **keep-alive expiry**: a connection idle longer than ``Limits.keepalive_expiry`` is
  closed when it is taken from the pool, never reused; idle ones are also swept (closed)
  at most once a second on the way back to the pool, and the pool registry's reaper
  closes pools idle for longer than the expiry;
- ``Limits.max_keepalive_connections``: a connection coming back when that many idle
  connections are open is closed instead of kept;
- a closed pool wakes its waiters (urllib3 leaves them blocked until their timeout).

urllib3's own check is kept: a kept-alive connection whose socket is readable (the
server sent a FIN, or bytes no request asked for) is closed and replaced, never reused.
Connections opened are counted into ``EndpointMetrics.connection_opened`` when their
TCP connection is established (the connection class's ``_new_conn``).

Errors are translated at this boundary by ``from_urllib3``; every translated
``TransportError`` carries ``fresh`` (whether the exchange ran on a connection opened
for it), which the call engine reads to resend once at once after a stale keep-alive
connection.

``HTTP1Pool.bridge()`` is an ``httpx.BaseTransport`` over the same pool, for the openai
SDK (``SyncTransport.send_httpx``): SDK requests share the connections and the limit.
"""

from __future__ import annotations

import errno
import http.client
import queue
import re
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import (
    ClosedPoolError,
    EmptyPoolError,
)
from urllib3.util.connection import is_connection_dropped

from .config import PoolKey
from .errors import (
    QwenEmbedError,
    TransportError,
    from_urllib3,
    pool_timeout_error,
    total_timeout_error,
)
from .metrics import EndpointMetrics
from .transport import (
    _ACCEPT_ENCODING,
    _CHUNK,
    _USER_AGENT,
    Reply,
    Request,
    Retired,
    _Body,
    _declared_too_big,
    ssl_context,
)

__all__ = ["HTTP1Pool"]

_SWEEP_EVERY = 1.0  # seconds between two sweeps of expired idle connections (at most)
_HEAD_CACHE = 256  # request heads kept (one per method, URL and header set)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(r"[\r\n\x00]")
_PATH_SAFE = "/%:@!$&'()*+,;=-._~?"
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _marked(error: TransportError, fresh: bool, received: bool = False) -> TransportError:
    error.fresh = fresh  # type: ignore[attr-defined]  # read by the engine (stale resend)
    return error.with_received(received)


# --------------------------------------------------------------------------- urllib3 classes


class _Conn(HTTPConnection):
    """An urllib3 connection that counts the TCP connections it opens."""

    _qwen_metrics: EndpointMetrics | None = None
    _qwen_idle: float = 0.0  # monotonic time it went back to the pool

    def _new_conn(self) -> socket.socket:
        sock = super()._new_conn()
        metrics = self._qwen_metrics
        if metrics is not None:
            metrics.connection_opened()
        return sock


class _TLSConn(_Conn, HTTPSConnection):
    """``_Conn`` over TLS (and through CONNECT tunnels)."""


class _Pool(HTTPConnectionPool):
    """urllib3's pool with keep-alive expiry, a cap on idle connections kept, counted
    connections, open connections handed out first, and waiters woken when it closes.

    ``_get_conn`` / ``_put_conn`` are the methods through which urllib3's pool hands
    out and takes back its connections (a LIFO queue of ``maxsize`` slots, blocking);
    they are overridden here because urllib3 has no keep-alive expiry. Its own check is
    kept: a connection ``is_connection_dropped`` finds readable (a FIN, stray bytes) is
    closed, never reused."""

    ConnectionCls = _Conn
    _qwen_metrics: EndpointMetrics | None = None
    _qwen_expiry = 4.0
    _qwen_keep = 1
    _qwen_size = 1
    _qwen_next_sweep = 0.0

    def qwen_configure(self, metrics: EndpointMetrics, key: PoolKey) -> None:
        """Set what urllib3 has no parameter for (before the first connection)."""
        self._qwen_metrics = metrics
        self._qwen_expiry = key.limits.keepalive_expiry
        self._qwen_keep = key.limits.keepalive_connections
        self._qwen_size = key.limits.max_connections

    def _new_conn(self) -> Any:
        conn: Any = super()._new_conn()
        conn._qwen_metrics = self._qwen_metrics
        return conn

    def _get_conn(self, timeout: float | None = None) -> Any:
        q = self.pool
        if q is None:
            raise ClosedPoolError(self, "Pool is closed.")
        try:
            conn = q.get(block=True, timeout=timeout)
        except queue.Empty:
            raise EmptyPoolError(self, "no connection became free in time") from None
        if self.pool is None:  # closed while this thread waited
            if conn is not None:
                conn.close()
            raise ClosedPoolError(self, "Pool is closed.")
        if conn is not None and conn.sock is not None:
            expired = time.monotonic() - conn._qwen_idle > self._qwen_expiry
            if expired or is_connection_dropped(conn):
                conn.close()  # re-opened by the caller: counted, fresh
        return conn or self._new_conn()

    def _put_conn(self, conn: Any) -> None:
        q = self.pool
        if conn is not None and q is not None:
            if conn.sock is not None:
                now = conn._qwen_idle = time.monotonic()
                if self._qwen_keep < self._qwen_size or now >= self._qwen_next_sweep:
                    self._tidy(q, conn, now)
            if conn.sock is None:
                # A closed connection goes to the bottom of the LIFO queue (urllib3 puts
                # its empty slots there too): open idle ones are taken first.
                with q.not_full:
                    if len(q.queue) < q.maxsize:
                        q.queue.insert(0, conn)
                        q.unfinished_tasks += 1
                        q.not_empty.notify()
                        return
        super()._put_conn(conn)

    def _tidy(self, q: Any, conn: Any, now: float) -> None:
        """Close expired idle connections; close ``conn`` if the idle ones kept open
        already reach ``max_keepalive_connections``."""
        expiry = self._qwen_expiry
        with q.mutex:
            items = q.queue
            for idle in items:
                if idle is not None and idle.sock is not None and now - idle._qwen_idle > expiry:
                    idle.close()
            # closed connections and empty slots to the bottom: open ones are taken first
            open_ = [c for c in items if c is not None and c.sock is not None]
            if open_:
                items[:] = [c for c in items if c is None or c.sock is None] + open_
            kept = len(open_)
        self._qwen_next_sweep = now + min(_SWEEP_EVERY, max(expiry, 0.05))
        if kept >= self._qwen_keep:
            conn.close()

    def close(self) -> None:
        q = self.pool
        super().close()
        if q is not None:  # wake the threads waiting for a connection
            for _ in range(self._qwen_size):
                try:
                    q.put_nowait(None)
                except queue.Full:
                    break


class _TLSPool(_Pool, HTTPSConnectionPool):
    """``_Pool`` over TLS."""

    ConnectionCls = _TLSConn


# --------------------------------------------------------------------------- responses


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

    def getlist(self, key: str) -> list[str]:
        """The header's values (``[]`` when absent), split at the joins."""
        value = dict.get(self, key.lower())
        return [] if value is None else value.split(", ")


_MAX_LINE = 65_536  # bytes per header line, as http.client
_MAX_HEADERS = 100  # header lines, as http.client


def _read_head(fp: Any) -> _Headers:
    """The header lines of a response up to the blank line, within http.client's limits
    (``LineTooLong``, ``HTTPException`` past 100 headers)."""
    headers = _Headers()
    readline = fp.readline
    name = ""
    count = 0
    while True:
        raw = readline(_MAX_LINE + 1)
        if len(raw) > _MAX_LINE:
            raise http.client.LineTooLong("header line")
        if raw in (b"\r\n", b"\n", b""):
            return headers
        count += 1
        if count > _MAX_HEADERS:
            raise http.client.HTTPException(f"got more than {_MAX_HEADERS} headers")
        line = raw.decode("iso-8859-1").rstrip("\r\n")
        if line[0] in " \t":  # obsolete line folding: continues the last value
            if name:
                dict.__setitem__(headers, name, f"{headers[name]} {line.strip()}")
            continue
        name, sep, value = line.partition(":")
        if not sep:
            name = ""
            continue  # not a header line (the email parser would skip it too)
        name = name.lower()
        value = value.strip()
        before = dict.get(headers, name)
        dict.__setitem__(headers, name, value if before is None else f"{before}, {value}")


class _Response(http.client.HTTPResponse):
    """``http.client.HTTPResponse`` with its headers parsed into ``_Headers``
    (case-insensitive) instead of through the ``email`` package, which cost about a
    third of a small exchange's CPU. The status line, the ``100 Continue`` skip, the
    limits (line length, header count), chunked bodies and the ``Content-Length`` /
    ``Connection`` rules are the stdlib's (this ``begin`` follows its own). Conflicting
    ``Content-Length`` values make the body close-delimited (never reused)."""

    qwen_headers: _Headers

    def begin(self) -> None:
        if self.headers is not None:
            return
        while True:
            version, status, reason = self._read_status()
            if status != http.client.CONTINUE:
                break
            _read_head(self.fp)  # a 100 Continue's headers: skipped
        self.code = self.status = status
        self.reason = reason.strip()
        if version in ("HTTP/1.0", "HTTP/0.9"):
            self.version = 10
        elif version.startswith("HTTP/1."):
            self.version = 11
        else:
            raise http.client.UnknownProtocol(version)
        headers = _read_head(self.fp)
        self.qwen_headers = headers
        self.headers = self.msg = headers
        te = headers.get("transfer-encoding")
        self.chunked = bool(te) and te.lower() == "chunked"
        self.chunk_left = None
        self.will_close = self._check_close()
        self.length = None
        length = headers.get("content-length")
        if length and not self.chunked:
            try:
                self.length = int(length)
            except ValueError:
                self.length = None
            else:
                if self.length < 0:
                    self.length = None
        if status in (204, 304) or 100 <= status < 200 or self._method == "HEAD":
            self.length = 0
        if not self.will_close and not self.chunked and self.length is None:
            self.will_close = True


# --------------------------------------------------------------------------- the pool


class _Target:
    """Where one URL's requests go on this pool, worked out once per URL."""

    __slots__ = ("host_header", "target")

    def __init__(self, target: str, host_header: str) -> None:
        self.target = target
        self.host_header = host_header


class HTTP1Pool:
    """The HTTP/1.1 connections of one pool key, shared by all threads.

    Args:
        key: the pool's settings (URL, limits, TLS verification, proxy).
        metrics: where connections opened are counted.
        ssl_ctx: the process's SSL context for ``key`` (``transport.ssl_context``).
        gate: the process-wide gate of the endpoint; SDK requests (``bridge``) take a
            slot of it (the core path takes it in ``SyncTransport.send``).
    """

    def __init__(
        self,
        key: PoolKey,
        metrics: EndpointMetrics,
        ssl_ctx: ssl.SSLContext,
        *,
        gate: Any = None,
    ) -> None:
        self.key = key
        self.metrics = metrics
        self._gate = gate
        parts = urlsplit(key.base_url)
        self.scheme = parts.scheme
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.scheme == "https" else 80)
        limits = key.limits
        kw: dict[str, Any] = {
            "maxsize": limits.max_connections,
            "block": True,
            "retries": False,
            "timeout": None,
            "socket_options": list(HTTPConnection.default_socket_options),
        }
        if self.scheme == "https":
            kw["ssl_context"] = ssl_ctx
        self._manager: Any = None
        self._proxy_headers: dict[str, str] = {}
        self.forwarding = False  # plain http through a proxy: absolute-form targets
        self.tunnel = False  # https through a proxy: CONNECT
        pool: _Pool
        if key.proxy:
            proxy_url, self._proxy_headers = _proxy_parts(key.proxy)
            extra: dict[str, Any] = {}
            if proxy_url.startswith("https://"):  # TLS to the proxy, verified as the key says
                extra["proxy_ssl_context"] = ssl_context(key.verify, http2=False, cleartext=False)
            manager = urllib3.ProxyManager(
                proxy_url, proxy_headers=self._proxy_headers, **extra, **kw
            )
            manager.pool_classes_by_scheme = {"http": _Pool, "https": _TLSPool}
            pool = manager.connection_from_host(self.host, self.port, self.scheme)  # type: ignore[assignment]
            self._manager = manager
            self.tunnel = self.scheme == "https"
            self.forwarding = not self.tunnel
        elif self.scheme == "https":
            pool = _TLSPool(self.host, self.port, **kw)
        else:
            pool = _Pool(self.host, self.port, **kw)
        pool.qwen_configure(metrics, key)
        self._pool = pool
        self._closed = False
        self._targets: dict[str, _Target] = {}
        self._heads: dict[tuple[Any, ...], bytes] = {}
        self._bridge: Any = None
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close every idle connection now; those in use close when they come back.
        Threads waiting for a connection get ``Retired``."""
        self._closed = True
        self._pool.close()
        if self._manager is not None:
            self._manager.clear()

    # ---------------------------------------------------------------- request heads

    def _target(self, url: str) -> _Target:
        found = self._targets.get(url)
        if found is not None:
            return found
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = parts.hostname or ""
        if (parts.scheme, host.lower(), port) != (self.scheme, self.host.lower(), self.port):
            raise ValueError(
                f"the URL {parts.scheme}://{host}:{port} is not this pool's server "
                f"({self.key.label})"
            )
        path = quote(parts.path or "/", safe=_PATH_SAFE)
        if parts.query:
            path += "?" + quote(parts.query, safe=_PATH_SAFE)
        shown = f"[{host}]" if ":" in host else host
        default = 443 if parts.scheme == "https" else 80
        host_header = shown if port == default else f"{shown}:{port}"
        if self.forwarding:
            path = f"{parts.scheme}://{host_header}{path}"
        found = _Target(path, host_header)
        if len(self._targets) < _HEAD_CACHE:
            self._targets[url] = found
        return found

    def _head(self, method: str, url: str, headers: Mapping[str, str]) -> bytes:
        """The request head up to the ``Content-Length`` value (cached)."""
        cache_key = (method, url, *headers.items())
        head = self._heads.get(cache_key)
        if head is None:
            head = self._build_head(method, url, headers.items(), skip=())
            if len(self._heads) >= _HEAD_CACHE:
                self._heads.clear()
            self._heads[cache_key] = head
        return head

    def _build_head(self, method: str, url: str, items: Any, *, skip: tuple[str, ...]) -> bytes:
        where = self._target(url)
        if not _TOKEN.fullmatch(method):
            raise ValueError(f"invalid HTTP method {method[:20]!r}")
        lines = [f"{method} {where.target} HTTP/1.1", f"Host: {where.host_header}"]
        seen = set()
        for name, value in items:
            lower = name.lower()
            if lower in ("host", "content-length", "transfer-encoding", "connection"):
                continue
            if lower in skip:
                continue
            if not _TOKEN.fullmatch(name) or _BAD_VALUE.search(value):
                raise ValueError(f"invalid request header {name[:40]!r} (name or value)")
            seen.add(lower)
            lines.append(f"{name}: {value}")
        if "user-agent" not in seen:
            lines.append(f"User-Agent: {_USER_AGENT}")
        if "accept-encoding" not in seen:
            lines.append(f"Accept-Encoding: {_ACCEPT_ENCODING}")
        if self.forwarding:
            for name, value in self._proxy_headers.items():
                if name.lower() not in seen:
                    lines.append(f"{name}: {value}")
        lines.append("Content-Length: ")
        return "\r\n".join(lines).encode("latin-1")

    # ---------------------------------------------------------------- exchanges

    def _checkout(self, wait: float | None) -> Any:
        if self._closed:
            raise Retired
        try:
            return self._pool._get_conn(timeout=wait)
        except ClosedPoolError:
            raise Retired from None

    def _give_back(self, conn: Any, reusable: bool) -> None:
        if not reusable:
            conn.close()
        self._pool._put_conn(conn)

    def _connect(self, conn: Any, timeout: float | None) -> None:
        conn.timeout = timeout
        if self.tunnel:
            self._pool._prepare_proxy(conn)  # CONNECT host:port, then TLS inside
        else:
            conn.connect()

    def _start(
        self,
        conn: Any,
        head: bytes,
        body: bytes,
        method: str,
        connect: float | None,
        write: float | None,
        read: float | None,
        fresh: bool,
        stage: list[str],
    ) -> _Response:
        """Connect ``conn`` if it is new, send the request, read the status and headers.
        ``stage[0]`` says how far it got (for the error translation)."""
        if fresh:
            self._connect(conn, connect)
        sock = conn.sock
        stage[0] = "write"
        sock.settimeout(write)
        try:
            sock.sendall(b"".join((head, str(len(body)).encode(), b"\r\n\r\n", body)))
        except OSError as exc:
            # As urllib3: the server may close as it answers (a 413 before reading the
            # body); read what it sent. Nothing: the read fails with a clear error.
            if not isinstance(exc, BrokenPipeError) and exc.errno not in (
                errno.ECONNRESET,
                errno.EPROTOTYPE,
            ):
                raise
        stage[0] = "read"
        sock.settimeout(read)
        resp = _Response(sock, method=method)
        try:
            resp.begin()
        except BaseException:
            resp.close()
            raise
        return resp

    def exchange(self, req: Request, deadline: float | None) -> Reply:
        """Perform ``req`` (HTTP/1.1) within its size cap and ``deadline`` (a
        ``time.monotonic()`` value or ``None``).

        Raises:
            QwenEmbedError: a translated error (``TransportError``s carry ``fresh``).
            Retired: the pool was closed while this request waited for a connection.
        """
        ctx = req.ctx
        t = req.timeouts
        try:
            head = self._head(req.method, req.url, req.headers)
        except ValueError as exc:
            raise from_urllib3(exc, ctx) from None
        try:
            conn = self._checkout(t.pool)
        except EmptyPoolError:
            raise pool_timeout_error(ctx) from None
        fresh = conn.sock is None
        stage = ["connect"]
        resp: _Response | None = None
        received = False
        try:
            read_timeout = t.read
            if deadline is not None:
                left = max(deadline - time.monotonic(), 0.001)
                read_timeout = left if read_timeout is None else min(read_timeout, left)
            resp = self._start(
                conn, head, req.body, req.method, t.connect, t.write, read_timeout, fresh, stage
            )
            headers = resp.qwen_headers
            _declared_too_big(headers, req.max_bytes, ctx)
            body = _Body(headers.get("content-encoding", ""), req.max_bytes, ctx)
            read = resp.read1  # what has arrived (at most one recv): the deadline is
            while True:  # checked as a trickling body comes in, as on the httpx path
                chunk = read(_CHUNK)
                if not chunk:
                    break
                received = True
                body.feed(chunk)
                if deadline is not None and time.monotonic() > deadline:
                    raise total_timeout_error(ctx, req.total, received=True)
            if resp.length:  # Content-Length not reached: the server closed early
                raise http.client.IncompleteRead(b"", resp.length)
            data = body.result()
        except QwenEmbedError as exc:
            self._give_back(conn, False)
            if resp is not None:
                resp.close()
            if isinstance(exc, TransportError):
                _marked(exc, fresh, received)
            raise
        except Exception as exc:
            self._give_back(conn, False)
            if resp is not None:
                resp.close()
            if (
                stage[0] == "read"
                and isinstance(exc, TimeoutError)
                and deadline is not None
                and time.monotonic() >= deadline - 0.001
            ):
                error: TransportError = total_timeout_error(ctx, req.total, received=received)
            else:
                error = from_urllib3(exc, ctx, stage=stage[0], proxy=self._manager is not None)
            raise _marked(error, fresh, received) from exc
        except BaseException:  # KeyboardInterrupt and the like: never reuse the socket
            self._give_back(conn, False)
            if resp is not None:
                resp.close()
            raise
        resp.close()  # its buffered reader (the socket stays open for reuse)
        self._give_back(conn, not resp.will_close)
        return Reply(
            status=resp.status,
            headers=headers,
            body=data,
            fresh=fresh,
            http_version="HTTP/1.0" if resp.version == 10 else "HTTP/1.1",
        )


_SDK_CAP_FLOOR = 8 << 20


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
