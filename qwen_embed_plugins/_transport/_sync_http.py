"""The blocking transport of one pool (``SyncTransport``, all threads): the process gate,
retirement under ``close_all()``/the idle reaper, and the choice of backend per pool:

- HTTP/1.1: the stdlib's ``http.client`` (``_http11.HTTP1Pool``, public API, a pool of
  its own; its module says which guarantee comes from where);
- HTTP/2 and cleartext h2c: an ``httpx.Client`` (``httpx2`` under openai 3.x), which
  multiplexes requests on its connections. Its deadline: every httpx timeout (connect,
  read, write, pool) is at most the time left, and the body loop checks the deadline
  between frames; the connections it opens are counted through httpx's public ``trace``
  request extension (``connection.connect_tcp.complete``).

The contract it keeps (``Request -> Reply``, caps, deadline, the exception map) is
``_contract``'s.

Limits of the HTTP/2 backend (httpx on httpcore, sync and async alike), where no public
API gives the guarantee: a response with no ``:status`` pseudo-header is read as 200
(httpcore builds its h2 connection with inbound header validation off and defaults the
status to 200; httpx's public API shows no pseudo-headers), so only the body's checks
(JSON, vector count and size) stand between it and success; and the per-read deadline
of the sync client relies on httpcore looking the ``timeout`` extension up before each
read (``_http.TimeLeft``). docs/reliability.md lists both.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .._config import PoolKey
from .._metrics import EndpointMetrics
from ..errors import QwenEmbedError, pool_timeout_error, total_timeout_error
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
    keep_out_of_logs,
    mapped,
    quiet_header_loggers,
    ssl_context,
)
from ._http import H2Clients, TimeLeft, _limits, _timeout_ext, httpx, refused
from ._http11 import HTTP1Pool

__all__ = ["SyncTransport"]


class SyncTransport:
    """The blocking transport of one pool (all threads).

    HTTP/1.1 runs on the stdlib's ``http.client`` (``_http11.HTTP1Pool``, public API; at
    most ``max_connections`` connections); HTTP/2 and cleartext h2c on an ``httpx.Client``
    (``httpx2`` under openai 3.x), which multiplexes requests on its connections.

    Args:
        key: the pool's settings (URL, limits, HTTP/2, TLS, proxy).
        metrics: where connections opened are counted.
        h2c: speak prior-knowledge HTTP/2 over ``http://`` (see ``_pool.h2c_fallback``).
        gate: the process-wide ``ProcessGate`` of the endpoint, if any.
    """

    def __init__(
        self,
        key: PoolKey,
        metrics: EndpointMetrics,
        *,
        h2c: bool = False,
        gate: ProcessGate | None = None,
    ) -> None:
        self.key = key
        self.metrics = metrics
        cleartext = key.base_url.startswith("http://")
        http2 = key.http2 and (not cleartext or h2c)
        self.http2 = http2
        ctx = ssl_context(key.verify, http2=key.http2, cleartext=cleartext)
        self._ctx = ctx
        self._cleartext = cleartext
        self._h2 = H2Clients(self._new_client)  # HTTP/2: built on first use
        self._http1: Any = None
        if http2:
            quiet_header_loggers()
        else:
            self._http1 = HTTP1Pool(key, metrics, ctx)
        self._gate = gate
        self._urls: dict[str, Any] = {}
        self._state = threading.Lock()
        self._active = 0
        self._retired = False

    @property
    def is_closed(self) -> bool:
        if self._http1 is not None:
            return bool(self._http1.closed)
        return self._h2.closed

    def _new_client(self) -> Any:
        """A new HTTP/2 client of this transport (``H2Clients``)."""
        inner = httpx.HTTPTransport(
            verify=self._ctx,
            http1=not self._cleartext,
            http2=True,
            limits=_limits(self.key),
            proxy=self.key.proxy,
        )
        return httpx.Client(
            transport=inner,
            timeout=httpx.Timeout(5.0),
            follow_redirects=False,
            trust_env=False,
            headers={"User-Agent": _USER_AGENT},
        )

    def idle(self) -> bool:
        """If no request is under way, retire the transport (no new request may start
        on it) and return ``True``."""
        with self._state:
            if self._active == 0:
                self._retired = True
                return True
            return False

    def _url(self, url: str) -> Any:
        found = self._urls.get(url)
        if found is None:
            found = self._urls[url] = httpx.URL(url)
        return found

    def send(self, req: Request) -> Reply:
        """Perform ``req``; raise a translated ``QwenEmbedError`` on failure, or
        ``Retired`` when the transport was closed under it."""
        with self._state:
            if self._retired:
                raise Retired
            self._active += 1
        try:
            deadline = _deadline(req.total)
            gate = self._gate
            if gate is not None:
                wait = req.timeouts.pool
                left = _left(deadline)
                if left is not None:
                    wait = left if wait is None else min(wait, left)
                if not gate.acquire(wait):
                    raise pool_timeout_error(req.ctx)
            try:
                if self._http1 is not None:
                    return self._http1.exchange(req, deadline)  # type: ignore[no-any-return]
                return self._exchange(req, deadline)
            finally:
                if gate is not None:
                    gate.release()
        except QwenEmbedError as exc:
            if self._retired:
                raise Retired from exc
            raise
        finally:
            with self._state:
                self._active -= 1

    def _exchange(self, req: Request, deadline: float | None) -> Reply:
        """One exchange on the HTTP/2 client. Its deadline: every httpx timeout is at
        most the time left, and the body loop checks it between frames. An HTTP/2
        stream left unread retires the client (``H2Clients``)."""
        progress = Progress(deadline)
        progress.fresh = False
        metrics = self.metrics
        opened = [False]  # an HTTP/2 stream was opened for this exchange

        def trace(name: str, info: dict[str, Any]) -> None:
            if name.endswith("connect_tcp.complete"):
                progress.fresh = True
                metrics.connection_opened()
            elif name == "http2.send_request_headers.started":
                opened[0] = True
            elif name.endswith("receive_response_headers.started"):
                progress.stage = "read"  # sent: a protocol error now is the answer's

        clients = self._h2
        client = clients.take()
        if client is None:
            raise Retired

        keep_out_of_logs(*req.ctx.secrets())  # httpx/httpcore may log what echoes them
        headers = dict(req.headers)
        headers.setdefault("Accept-Encoding", _ACCEPT_ENCODING)
        timeouts = _timeout_ext(req.timeouts, None)
        request = httpx.Request(
            req.method,
            self._url(req.url),
            headers=headers,
            content=req.body or None,
            extensions={
                "timeout": timeouts if deadline is None else TimeLeft(timeouts, deadline),
                "trace": trace,
            },
        )
        response: Any = None
        ended = False  # the stream's body was read to its end
        block = mapped(req, progress, "httpx")
        try:
            with block:
                response = client.send(request, stream=True)
                progress.stage = "read"
                check_status(response.status_code, req, progress)
                resp_headers = response.headers
                _declared_too_big(resp_headers, req.max_bytes, req.ctx)
                body = _Body(resp_headers.get("content-encoding", ""), req.max_bytes, req.ctx)
                for chunk in response.iter_raw(_CHUNK):
                    progress.received = True
                    body.feed(chunk)
                    if deadline is not None and time.monotonic() > deadline:
                        raise total_timeout_error(
                            req.ctx, req.total, received=True, fresh=progress.fresh
                        )
                ended = True
                data = body.result(progress.fresh)
            block.check()  # the backend's failure, raised with no chain
        finally:
            if response is not None:
                response.close()
            # left unread (a stream the server refused is closed): the client is
            # retired, closed once idle
            idle = clients.give_back(client, opened[0] and not ended and not refused(block.error))
            if idle is not None:
                idle.close()
        return Reply(
            status=response.status_code,
            headers=resp_headers,
            body=data,
            fresh=progress.fresh,
            http_version=response.http_version,
        )

    def close(self) -> None:
        """Close every connection of the pool (those in use once their exchange ends);
        requests waiting for one are resent on the pool's next transport."""
        with self._state:
            self._retired = True
        if self._http1 is not None:
            self._http1.close()
        for client in self._h2.clear():
            client.close()
