"""The event-loop transport of one pool: ``aiohttp`` over HTTP/1.1, ``httpx`` for HTTP/2.

One ``AsyncTransport`` per (pool, running event loop) (``_pool.async_transport``). Same
contract and guarantees as the blocking transport (``_sync_http``, ``_http11``; the
contract is ``_contract``'s): bodies read as a stream
within a size cap and a total time budget, redirects never followed, connections with
unread bytes never reused, connections opened counted, requests beyond
``max_connections`` waiting in a FIFO gate in front of the pool (at most
``Timeouts.pool`` seconds).

A transport belongs to its event loop (the pool stores it on the loop object), so a loop
dropped without being closed is garbage-collected with its transports. ``QuietFlag`` is
then set (by the pool's finaliser on the loop, which runs before any finaliser of the
loop's garbage) and every connection is released at once, so the server sees it close;
aiohttp prints no "Unclosed client session" / "Unclosed connector" for it.

aiohttp was chosen after measuring the candidates side by side (docs/benchmarks.md,
"Transport candidates"): httpx2's async stack costs several times raw aiohttp's CPU per request.

Which guarantee comes from where:

- the total time budget: aiohttp's ``ClientTimeout(total=...)`` (the time left) bounds
  the whole aiohttp exchange, head and body included (a trickled head, chunk-size line
  or trailer ends there); the HTTP/2 exchange is awaited under ``asyncio.timeout_at``;
  the pool wait is bounded by the time left too;
- the size cap: ``StreamReader.readany()`` / ``Response.aiter_raw`` into
  ``_contract._Body``;
- no reuse of a socket with bytes left: ``ClientResponse.release()`` only after the body
  was read to its end, ``ClientResponse.close()`` otherwise; interim 1xx answers are
  skipped by aiohttp and httpx; statuses outside 200-599 are refused
  (``_contract.check_status``);
- errors: ``_contract.failure`` / ``mapped`` (``_exceptions.translate``), raised with no
  chain to the backend's exception (it quotes the server's bytes);
- DNS: aiohttp caches what it resolved (``TCPConnector``'s ``ttl_dns_cache``, 10 s);
  a connect failure clears the cache (``TCPConnector.clear_dns_cache()``), so the retry
  resolves the name afresh (an endpoint moved to another address by DNS); httpx (HTTP/2)
  and ``http.client`` resolve on each connect;
- keep-alive: ``TCPConnector(limit=max_connections, keepalive_timeout=
  keepalive_expiry)``; httpx's ``Limits``. aiohttp has no cap on idle connections kept
  below ``limit``: ``max_keepalive_connections`` applies to the HTTP/2 client only.

Public APIs only (no private attribute of asyncio, aiohttp, httpx or httpcore is read or
assigned; ``tests/test_layout.py`` checks it):

- aiohttp's sockets are made here (``TCPConnector(socket_factory=...)``, aiohttp >=
  3.12), so the library can close them itself; httpx's are seen through httpcore's
  ``stream.get_extra_info("socket")`` (asyncio's socket view: shut down, never closed);
- the connector subclass overrides public members only: ``connect`` (counts new
  connections, tells the request whether its connection is new, and closes a kept-alive
  connection whose protocol ``should_close`` — unread bytes — instead of reusing it),
  ``closed`` and the finaliser (silent once ``QuietFlag`` is set: the connections are
  released by the library); it relies on aiohttp's ``ClientSession`` finaliser asking
  ``connector.closed``, and on ``should_close`` (public name, not documented);
  no documented aiohttp API tells whether a kept-alive connection received bytes while
  idle (asyncio reads them into the protocol at once, so the socket never looks
  readable; ``ClientResponse.release()`` after reading to EOF and ``close()``
  otherwise cover the bytes of the exchange itself; ``force_close=True`` would give up
  keep-alive). Bounded: were ``should_close`` removed, every reuse would fail at once
  (``AttributeError``); were its meaning changed, ``tests/test_hostile.py``
  (``test_a_stray_response_is_never_taken_for_the_next_answer``, async) fails;
- a loop that is open but will not run again (``close_all`` at exit): each aiohttp
  connection's asyncio transport is aborted (``Transport.abort`` takes it out of the
  selector at once) and its socket closed; an httpx connection's socket is shut down and
  the client closed inside the loop if it runs again.

The bounded alternative where no public API gives the guarantee: a transport of a loop
that is closed without ``shutdown_asyncgens()`` or dropped unclosed cannot be closed
(its ``close()`` needs the loop). Its connections are still released at once (the
server sees them close; aiohttp's sockets are closed, httpx's shut down), but asyncio's
own finaliser reports each such transport ("unclosed transport" ResourceWarning, shown
only when ResourceWarnings are enabled) next to its report of the loop itself
("unclosed event loop") when the loop's garbage is collected, and closes the descriptor
then. A loop run by ``asyncio.run()`` (or shut down with ``shutdown_asyncgens()``) closes
its transports inside it: nothing is reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import io
import math
import os
import socket
import time
import warnings
import weakref
from collections.abc import Callable, MutableMapping
from typing import Any

from .._config import PoolKey
from .._metrics import EndpointMetrics
from ..errors import (
    QwenEmbedError,
    pool_timeout_error,
    total_timeout_error,
)
from ._contract import (
    _ACCEPT_ENCODING,
    _CHUNK,
    _USER_AGENT,
    ProcessGate,
    Progress,
    Reply,
    Request,
    Retired,
    _Body,
    _deadline,
    _declared_too_big,
    _left,
    check_status,
    failure,
    keep_out_of_logs,
    mapped,
    quiet_header_loggers,
    ssl_context,
)
from ._http import H2Clients, _limits, _timeout_ext, httpx, refused

__all__ = ["AsyncTransport", "QuietFlag"]

_LARGE_BODY = 1 << 20  # bytes: aiohttp's threshold for its "large body" warning
_TIMEOUTS_KEPT = 64  # ``ClientTimeout`` objects kept per transport (``AsyncTransport._timeout``)


def _progress(deadline: float | None, stage: str, fresh: bool, received: bool) -> Progress:
    """A ``Progress`` for an error of the aiohttp exchange (built only then)."""
    progress = Progress(deadline)
    progress.stage, progress.fresh, progress.received = stage, fresh, received
    return progress


# --------------------------------------------------------------------------- async


class QuietFlag:
    """Shared by one transport, its connector (and the pool's slot for it). Set once
    nobody will close the transport inside its event loop any more: the loop was
    garbage-collected without being closed, the pool retired the transport
    (``close_all``), or its loop is closed. From then on the connector reports itself
    closed while its loop is not running (so aiohttp's ``ClientSession`` finaliser stays
    silent), and a connector collected unclosed shuts its connections down instead of
    warning.

    It also keeps the socket of every connection the transport opened (aiohttp's are
    made here, ``new_socket`` is the connector's ``socket_factory``; httpx's are asyncio's
    ``get_extra_info("socket")`` view), none of which holds anything of the loop, so that
    the pool's finaliser on a collected loop can release them before any finaliser of
    the loop's garbage runs (``shutdown_sockets``)."""

    __slots__ = ("_conns", "_made", "_pid", "is_set", "shut")

    def __init__(self) -> None:
        self._pid = os.getpid()
        self.is_set = False
        self.shut = False  # every connection was released: nothing is left to close
        # aiohttp: the sockets made (``new_socket``) whose connection is not up yet
        self._made: dict[int, socket.socket] = {}
        # every connection: its socket, and a weak reference to its asyncio transport
        self._conns: list[tuple[Any, weakref.ref[Any] | None]] = []

    def new_socket(self, addr_info: Any) -> socket.socket:
        """aiohttp's ``socket_factory``: a socket for one connection attempt."""
        family, type_, proto, _, _ = addr_info
        sock = socket.socket(family=family, type=type_, proto=proto)
        made = self._made
        if len(made) > 8:  # attempts that failed (closed by aiohappyeyeballs)
            self._made = made = {fd: s for fd, s in made.items() if s.fileno() != -1}
        made[sock.fileno()] = sock
        return sock

    def track(self, wire: Any) -> None:
        """Keep a new aiohttp connection (its asyncio transport ``wire``): its socket,
        and the transport weakly. Forget the connections closed since."""
        view = wire.get_extra_info("socket")
        sock = self._made.pop(view.fileno(), view) if view is not None else None
        self._keep(sock, weakref.ref(wire))

    def track_stream(self, stream: Any) -> None:
        """Keep the socket of a new httpcore network stream (httpx, HTTP/2)."""
        self._keep(stream.get_extra_info("socket"), None)

    def _keep(self, sock: Any, wire: weakref.ref[Any] | None) -> None:
        if sock is None:
            return
        conns = self._conns
        conns[:] = [c for c in conns if c[0].fileno() != -1]
        conns.append((sock, wire))

    def has_open(self) -> bool:
        """Whether a kept connection's socket is still open."""
        return any(c[0].fileno() != -1 for c in self._conns)

    def shutdown_sockets(self, *, loop_open: bool) -> None:
        """Set the flag and release every connection now: the server sees it close.

        ``loop_open``: the transport's loop is still open (not closed, not collected),
        but will not run before this returns. Each aiohttp connection's asyncio
        transport is then aborted first (``Transport.abort``: it leaves the loop's
        selector at once) and its socket closed; an httpx connection's socket is shut
        down (``SHUT_RDWR``), and its descriptor closed by asyncio when the loop runs
        again. Without ``loop_open`` the loop is closed or gone: aiohttp's sockets are
        closed and httpx's shut down (their descriptors are closed by asyncio's
        finaliser of the loop's transports, with its "unclosed transport"
        ResourceWarning). In a forked child nothing is touched: a shutdown would end
        the parent's connection (the socket is shared)."""
        self.is_set = True
        self.shut = True
        conns, self._conns = self._conns, []
        made, self._made = self._made, {}
        if os.getpid() != self._pid:
            return
        for sock, ref in conns:
            wire = ref() if ref is not None else None
            closable = isinstance(sock, socket.socket)
            if loop_open:
                closable = closable and wire is not None
                if wire is not None and closable:
                    with contextlib.suppress(Exception):
                        wire.abort()
            with contextlib.suppress(OSError):
                if closable:
                    sock.close()
                else:
                    sock.shutdown(socket.SHUT_RDWR)
        for sock in made.values():  # a connection attempt under way
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                if not loop_open:
                    sock.close()


_fresh: contextvars.ContextVar[bool] = contextvars.ContextVar("qwen_embed_fresh", default=True)
"""Set by the connector for the request being connected (in the request's own context):
``True`` when it got a connection opened for it."""


class _Hooks:
    """What the connector subclass needs of its transport (one attribute on the
    connector, so that no name of ours can collide with one of aiohttp's)."""

    __slots__ = ("loop", "opened", "quiet", "seen")

    def __init__(self, loop: Any, quiet: QuietFlag, opened: Callable[[Any], None]) -> None:
        self.loop = loop
        self.quiet = quiet
        self.opened = opened
        self.seen: weakref.WeakSet[Any] = weakref.WeakSet()


def _aiohttp_connector_class() -> Any:
    global _connector_class
    if _connector_class is not None:
        return _connector_class
    import aiohttp

    class _Connector(aiohttp.TCPConnector):
        """Counts the connections it opens, tells each request whether its connection
        is new (``_fresh``), and never hands out a kept-alive connection with unread
        data on it (a stray response no request asked for). Once its ``QuietFlag`` is
        set it reports itself closed while its loop is not running, and if collected
        unclosed shuts its connections down instead of warning (see ``QuietFlag``).

        Public members only: ``connect``, ``closed`` and the finaliser are overridden;
        the connection's ``protocol``/``transport`` and the protocol's ``should_close``
        are read."""

        def __init__(self, *args: Any, qwen_hooks: _Hooks, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.qwen_hooks = qwen_hooks

        @property
        def closed(self) -> bool:
            if super().closed:
                return True
            quiet = self.qwen_hooks.quiet
            return quiet.shut or (quiet.is_set and not self.qwen_hooks.loop.is_running())

        def __del__(self, _warnings: Any = warnings) -> None:
            hooks = self.__dict__.get("qwen_hooks")  # absent if __init__ failed
            if hooks is not None and hooks.quiet.is_set and not super().closed:
                # nobody will close it inside its loop any more: its connections are
                # released (the server sees them close), no "Unclosed connector"
                with contextlib.suppress(Exception):  # a finaliser must not raise
                    hooks.quiet.shutdown_sockets(loop_open=not hooks.loop.is_closed())
                return
            super().__del__(_warnings)

        async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:  # noqa: ASYNC109
            hooks = self.qwen_hooks
            for _ in range(64):
                conn = await super().connect(req, traces, timeout)
                proto = conn.protocol
                if proto is None:
                    _fresh.set(True)
                    return conn
                if proto not in hooks.seen:
                    hooks.seen.add(proto)
                    hooks.opened(conn.transport)
                    _fresh.set(True)
                    return conn
                if proto.should_close:  # unread bytes or a half-read body: never reuse
                    conn.close()
                    continue
                _fresh.set(False)
                return conn
            return conn

    _connector_class = _Connector
    return _Connector


_connector_class: Any = None


class AsyncTransport:
    """The transport of one pool on one event loop.

    ``aiohttp`` over HTTP/1.1 (one ``ClientSession`` per loop and pool); an
    ``httpx.AsyncClient`` when HTTP/2 is asked. Requests beyond ``max_connections``
    wait in a FIFO gate in front of the pool (at most ``Timeouts.pool`` seconds), never
    inside the HTTP library.

    ``quiet`` (shared with the pool's slot) keeps the connections' sockets and is set
    once the transport will not be closed inside its loop any more (see ``QuietFlag``).
    """

    def __init__(
        self,
        key: PoolKey,
        metrics: EndpointMetrics,
        *,
        h2c: bool = False,
        gate: ProcessGate | None = None,
        quiet: QuietFlag | None = None,
    ) -> None:
        self.key = key
        self.metrics = metrics
        cleartext = key.base_url.startswith("http://")
        self.http2 = key.http2 and (not cleartext or h2c)
        self._gate = gate
        self._slots = asyncio.Semaphore(key.limits.max_connections)
        self._ssl = ssl_context(key.verify, http2=key.http2, cleartext=cleartext)
        self._session: Any = None
        self._h2 = H2Clients(self._new_httpx)
        self._closing: set[asyncio.Task[None]] = set()  # retired clients being closed
        self._closed = False
        self._h2c = cleartext and self.http2
        self._urls: dict[str, Any] = {}
        self._timeouts: dict[tuple[int | None, float | None, float | None], Any] = {}
        self._kept_headers: tuple[Any, Any] | None = None
        self.quiet = quiet if quiet is not None else QuietFlag()
        self._loop: asyncio.AbstractEventLoop | None = None  # once a session/client exists

    @property
    def is_closed(self) -> bool:
        return self._closed

    def _opened(self, wire: Any) -> None:
        """Count a new aiohttp connection and keep it (``QuietFlag``)."""
        self.metrics.connection_opened()
        if wire is not None:
            self.quiet.track(wire)

    def _opened_stream(self, stream: Any) -> None:
        """Keep a new httpcore network stream's socket (``QuietFlag``)."""
        if stream is not None:
            self.quiet.track_stream(stream)

    # ---------------------------------------------------------------- aiohttp

    def _aiohttp(self) -> Any:
        session = self._session
        if session is None:
            import aiohttp

            connector = _aiohttp_connector_class()(
                qwen_hooks=_Hooks(self._running_loop(), self.quiet, self._opened),
                socket_factory=self.quiet.new_socket,
                limit=self.key.limits.max_connections,
                limit_per_host=0,
                keepalive_timeout=self.key.limits.keepalive_expiry or 0.001,
                ssl=self._ssl if self.key.base_url.startswith("https://") else False,
                enable_cleanup_closed=False,
            )
            session = self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                trust_env=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                headers={"User-Agent": _USER_AGENT},
                skip_auto_headers=("Accept-Encoding",),
            )
        return session

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop = asyncio.get_running_loop()
        return loop

    def _url(self, url: str) -> Any:
        found = self._urls.get(url)
        if found is None:
            import yarl

            found = self._urls[url] = yarl.URL(url, encoded=False)
        return found

    def _timeout(self, req: Request, deadline: float | None) -> Any:
        """aiohttp's ``ClientTimeout`` for ``req``: ``total`` is the time left before
        ``deadline``, cut down to whole milliseconds (never later than the deadline), so
        that the objects can be kept (``_timeouts``): a call's first request leaves at
        once, so its time left is nearly always the same number of milliseconds.

        A connect or read timeout at least as long as the time left is left out: the
        total timer ends the exchange first, and aiohttp then arms no read timer per
        request (a query's deadline is shorter than ``Timeouts.read`` by default)."""
        t = req.timeouts
        connect, read = t.connect, t.read
        left_ms = None
        if deadline is not None:  # at least 1 ms, as before any exchange
            left_ms = max(int((deadline - time.monotonic()) * 1000.0), 1)
            if connect is not None and connect * 1000.0 >= left_ms:
                connect = None
            if read is not None and read * 1000.0 >= left_ms:
                read = None
        key = (left_ms, connect, read)
        timeout = self._timeouts.get(key)
        if timeout is None:
            import aiohttp

            if len(self._timeouts) >= _TIMEOUTS_KEPT:
                self._timeouts.clear()
            timeout = self._timeouts[key] = aiohttp.ClientTimeout(
                total=None if left_ms is None else left_ms / 1000.0,
                sock_connect=connect,
                sock_read=read,
                # aiohttp rounds timers of ``ceil_threshold`` s or more up to the next
                # whole second (default 5 s): never, so the deadline is kept to the ms
                ceil_threshold=math.inf,
            )
        return timeout

    def _headers(self, headers: Any) -> Any:
        """The request headers as aiohttp takes them (``Accept-Encoding`` added unless
        set). Built once per read-only headers object (the engine's, one per client) and
        kept while the next request brings the same object; a mutable mapping is read
        afresh each time."""
        kept = self._kept_headers
        if kept is not None and kept[0] is headers:
            return kept[1]
        from multidict import CIMultiDict, CIMultiDictProxy

        built: Any = CIMultiDict(dict(headers))
        if "Accept-Encoding" not in built:
            built["Accept-Encoding"] = _ACCEPT_ENCODING
        frozen = CIMultiDictProxy(built)  # aiohttp copies it; nobody may change it
        if not isinstance(headers, MutableMapping):
            self._kept_headers = (headers, frozen)
        return frozen

    async def _aiohttp_exchange(self, req: Request, deadline: float | None) -> Reply:
        import aiohttp

        session = self._aiohttp()
        # the call's deadline is aiohttp's own total timer (``ClientTimeout.total`` bounds
        # the whole exchange, body read included): cheaper than a second timer around it
        timeout = self._timeout(req, deadline)
        # how far the exchange got (``Progress``, built only for an error)
        fresh, received, stage = True, False, "connect"
        resp: Any = None
        ok = False
        error: QwenEmbedError | None = None
        try:
            body = req.body
            resp = await session.request(
                req.method,
                self._url(req.url),
                # aiohttp warns for a bytes body over 1 MiB ("might lock the event loop"):
                # a large one is sent from a file-like object, in pieces
                data=(body if len(body) < _LARGE_BODY else io.BytesIO(body)) or None,
                headers=self._headers(req.headers),
                allow_redirects=False,
                timeout=timeout,
                proxy=self.key.proxy,
            )
            fresh = _fresh.get()
            stage = "read"
            status = resp.status
            headers = resp.headers
            if not 200 <= status <= 599:
                check_status(status, req, _progress(deadline, stage, fresh, received))
            _declared_too_big(headers, req.max_bytes, req.ctx)
            reader = _Body(headers.get("Content-Encoding", ""), req.max_bytes, req.ctx)
            content = resp.content
            while chunk := await content.readany():
                received = True
                reader.feed(chunk)
                if deadline is not None and time.monotonic() > deadline:
                    raise total_timeout_error(req.ctx, req.total, received=True, fresh=fresh)
            data = reader.result(fresh)
            ok = True
        except (QwenEmbedError, Retired):
            raise
        except Exception as exc:
            if isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ClientError):
                # aiohttp's total timer (ClientTimeout.total): the deadline
                raise total_timeout_error(
                    req.ctx, req.total, received=received, fresh=fresh
                ) from exc
            if isinstance(exc, aiohttp.ClientConnectorError):
                # the name may have moved to another address (failover by DNS): the
                # next attempt resolves it afresh, not from aiohttp's DNS cache
                session.connector.clear_dns_cache()
            # raised below, outside this clause: no chain to ``exc``, which quotes the
            # server's bytes (``_contract.Mapped``)
            error = failure(exc, req, _progress(deadline, stage, fresh, received), "aiohttp")
        finally:
            if resp is not None:
                if ok:
                    resp.release()
                else:
                    resp.close()  # never reuse a connection with an unread body
        if error is not None:
            raise error
        version = resp.version
        return Reply(
            status=status,
            headers=headers,
            body=data,
            fresh=fresh,
            http_version="HTTP/1.1"
            if version is None or version == (1, 1)
            else f"HTTP/{version.major}.{version.minor}",
        )

    # ---------------------------------------------------------------- httpx (HTTP/2)

    def _new_httpx(self) -> Any:
        """A new HTTP/2 client of this transport (``H2Clients``)."""
        quiet_header_loggers()
        self._running_loop()
        inner = httpx.AsyncHTTPTransport(
            verify=self._ssl,
            http1=not self._h2c,
            http2=True,
            limits=_limits(self.key),
            proxy=self.key.proxy,
        )
        return httpx.AsyncClient(
            transport=inner,
            follow_redirects=False,
            trust_env=False,
            headers={"User-Agent": _USER_AGENT},
        )

    async def _httpx_exchange(self, req: Request, deadline: float | None) -> Reply:
        """One exchange on the HTTP/2 client; an HTTP/2 stream left unread retires the
        client (``H2Clients``)."""
        progress = Progress(deadline)
        progress.fresh = False
        metrics = self.metrics
        opened = self._opened_stream
        stream = [False]  # an HTTP/2 stream was opened for this exchange

        async def trace(name: str, info: dict[str, Any]) -> None:
            if name.endswith("connect_tcp.complete"):
                progress.fresh = True
                metrics.connection_opened()
                opened(info.get("return_value"))
            elif name == "http2.send_request_headers.started":
                stream[0] = True
            elif name.endswith("receive_response_headers.started"):
                progress.stage = "read"  # sent: a protocol error now is the answer's

        clients = self._h2
        client = clients.take()
        if client is None:
            raise Retired
        keep_out_of_logs(*req.ctx.secrets())  # httpx/httpcore may log what echoes them
        url = self._urls.get(req.url)
        if url is None:
            url = self._urls[req.url] = httpx.URL(req.url)
        headers = dict(req.headers)
        headers.setdefault("Accept-Encoding", _ACCEPT_ENCODING)
        request = httpx.Request(
            req.method,
            url,
            headers=headers,
            content=req.body or None,
            extensions={"timeout": _timeout_ext(req.timeouts, _left(deadline)), "trace": trace},
        )
        response: Any = None
        ended = False  # the stream's body was read to its end
        block = mapped(req, progress, "httpx")
        try:
            with block:
                response = await client.send(request, stream=True)
                progress.stage = "read"
                check_status(response.status_code, req, progress)
                _declared_too_big(response.headers, req.max_bytes, req.ctx)
                body = _Body(response.headers.get("content-encoding", ""), req.max_bytes, req.ctx)
                async for chunk in response.aiter_raw(_CHUNK):
                    progress.received = True
                    body.feed(chunk)
                ended = True
                data = body.result(progress.fresh)
            block.check()  # the backend's failure, raised with no chain
        finally:
            try:
                if response is not None:
                    await response.aclose()
            finally:
                # left unread (a stream the server refused is closed): the client is
                # retired, closed once idle
                idle = clients.give_back(
                    client, stream[0] and not ended and not refused(block.error)
                )
                if idle is not None:
                    task = asyncio.get_running_loop().create_task(idle.aclose())
                    self._closing.add(task)
                    task.add_done_callback(self._closing.discard)
        return Reply(
            status=response.status_code,
            headers=response.headers,
            body=data,
            fresh=progress.fresh,
            http_version=response.http_version,
        )

    # ---------------------------------------------------------------- contract

    async def send(self, req: Request) -> Reply:
        """Perform ``req`` on the running loop; raise a translated ``QwenEmbedError``, or
        ``Retired`` when the transport was closed before or under it."""
        if self._closed:
            raise Retired
        try:
            deadline = _deadline(req.total)
            wait = req.timeouts.pool
            if deadline is not None:  # the pool wait is part of the exchange's budget too
                left = max(deadline - time.monotonic(), 0.001)
                wait = left if wait is None else min(wait, left)
            gate = self._gate
            if gate is not None and not await gate.aacquire(wait):
                raise pool_timeout_error(req.ctx)
            slots = self._slots
            try:
                if slots.locked():
                    try:
                        async with asyncio.timeout(wait):
                            await slots.acquire()
                    except TimeoutError:
                        raise pool_timeout_error(req.ctx) from None
                else:
                    await slots.acquire()
                try:
                    if not self.http2:  # bounded by aiohttp's total timer
                        return await self._aiohttp_exchange(req, deadline)
                    exchange = self._httpx_exchange
                    if deadline is None:
                        return await exchange(req, deadline)
                    try:
                        async with asyncio.timeout_at(
                            asyncio.get_running_loop().time() + (deadline - time.monotonic())
                        ):
                            return await exchange(req, deadline)
                    except TimeoutError:
                        raise total_timeout_error(req.ctx, req.total) from None
                finally:
                    slots.release()
            finally:
                if gate is not None:
                    gate.release()
        except QwenEmbedError as exc:
            if self._closed:
                raise Retired from exc
            raise

    def retire(self) -> None:
        """No new request may use this transport (``close_all``): its close is left to
        its own loop, and if the loop never runs again its connections are shut down
        when it is collected (``QuietFlag``)."""
        self._closed = True
        self.quiet.is_set = True

    async def aclose(self) -> None:
        """Close the session and client (inside their own loop)."""
        self._closed = True
        session, self._session = self._session, None
        clients = self._h2.clear()
        if session is not None:
            connector = session.connector
            if connector is not None:  # closed for real (its ``closed`` may say so early)
                with contextlib.suppress(Exception):
                    await connector.close()
            with contextlib.suppress(Exception):
                await session.close()
        for client in clients:
            with contextlib.suppress(Exception):
                await client.aclose()
        if self._closing:  # retired clients closing: done before the loop may end
            await asyncio.gather(*self._closing, return_exceptions=True)
        # A connection closed while its request was still being written (a server that
        # stopped reading, a deadline) waits for its write buffer to drain before its
        # socket closes: never, if the server does not read. Shut every socket down
        # (a no-op on closed ones): the write fails and asyncio closes the transport;
        # let the loop run that before it shuts down.
        if self.quiet.has_open():
            self.quiet.shutdown_sockets(loop_open=True)
            await asyncio.sleep(0)

    def abandon(self) -> None:
        """Drop the session and client without awaiting (their loop is closed, gone, or
        will not run again): release their connections now (the server sees them
        close; ``QuietFlag.shutdown_sockets``), with no "Unclosed client session" /
        "Unclosed connector" message. If the loop is still open, the HTTP/2 client is
        also closed inside it, should it run again."""
        self._closed = True
        loop = self._loop
        loop_open = loop is not None and not loop.is_closed()
        self.quiet.shutdown_sockets(loop_open=loop_open)  # first: frees the session quietly
        self._session = None
        clients = self._h2.clear()
        if loop is not None and loop_open:
            for client in clients:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_close_later, client)


def _close_later(client: Any) -> None:
    """On the client's own loop, when it runs again: close it there."""
    asyncio.ensure_future(client.aclose())  # noqa: RUF006 - fire and forget, by design
