"""The blocking HTTP/1.1 transport on ``http.client`` (``qwen_embed_plugins._transport._http11``).

Against loopback servers: `EmbeddingServer`s (uvicorn), and, for what a real server
cannot do on cue (stray bytes, endless or trickling bodies, gzip bombs, a server that
never reads), a minimal raw-socket server in this file; proxies through a minimal
loopback forward proxy (CONNECT and absolute-form) in this file. Every server here
binds 127.0.0.1 only and every socket has a timeout.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import gzip
import http.client
import os
import select
import socket
import threading
import time
import types
import zlib
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import orjson
import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins import _pool as pool
from qwen_embed_plugins._config import PoolKey
from qwen_embed_plugins._metrics import EndpointMetrics
from qwen_embed_plugins._transport import Reply, Request, Retired, SyncTransport, _http11
from qwen_embed_plugins._transport._exceptions import translate
from qwen_embed_plugins._transport._http import httpx
from qwen_embed_plugins.errors import ErrorContext, endpoint_label
from qwen_embed_tooling.testing import EmbeddingServer, expected_embedding, expected_embeddings

LOOPBACK = "127.0.0.1"
IO_TIMEOUT = 30.0  # seconds: a bound on every raw socket operation (never reached)


# --------------------------------------------------------------------------- helpers


def wait_until(condition: Callable[[], bool], what: str, limit: float = 60.0) -> None:
    """Poll ``condition`` (a server counter, a queue state) until it holds."""
    end = time.monotonic() + limit
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.01)


def make_transport(
    base_url: str,
    *,
    limits: q.Limits | None = None,
    verify: bool | str = True,
    proxy: str | None = None,
) -> SyncTransport:
    """A transport of its own (not the shared registry's: no reaper closes it). The
    key is built directly: the config never proxies loopback hosts, these tests do."""
    key = PoolKey(
        base_url=base_url, limits=limits or q.Limits(), http2=False, verify=verify, proxy=proxy
    )
    return SyncTransport(key, EndpointMetrics(key.label))


def make_request(
    base_url: str,
    texts: tuple[str, ...] = ("a",),
    *,
    timeouts: q.Timeouts | None = None,
    total: float | None = None,
    max_bytes: int = 1 << 24,
    path: str = "/embeddings",
    secret: str | None = None,
    max_connections: int = 20,
    body: bytes | None = None,
) -> Request:
    t = timeouts or q.Timeouts()
    headers = {"Content-Type": "application/json"}
    if secret is not None:
        headers["Authorization"] = f"Bearer {secret}"
    ctx = ErrorContext(
        url=endpoint_label(base_url),
        secret=secret,
        connect=t.connect,
        read=t.read,
        write=t.write,
        pool=t.pool,
        total=total,
        max_connections=max_connections,
    )
    if body is None:
        body = orjson.dumps({"input": list(texts), "model": "m", "encoding_format": "base64"})
    return Request("POST", base_url + path, body, headers, t, total, max_bytes, ctx)


def vectors(reply: Reply) -> np.ndarray:
    data = orjson.loads(reply.body)["data"]
    return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data])


def open_idle(t: SyncTransport) -> int:
    """Connections kept open in the transport's pool, idle (client-side count)."""
    return sum(1 for c, _ in t._http1._idle if c.sock is not None)


# --------------------------------------------------------------------------- raw server


def read_request(f: Any) -> tuple[str, dict[str, str], bytes] | None:
    """One HTTP/1.1 request (Content-Length bodies) from a socket file; None at EOF."""
    line = f.readline(65_537)
    if not line:
        return None
    headers: dict[str, str] = {}
    while True:
        h = f.readline(65_537)
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    body = f.read(int(headers.get("content-length", "0") or 0))
    return line.decode("latin-1").rstrip("\r\n"), headers, body


def response(body: bytes, *, status: int = 200, headers: tuple[str, ...] = ()) -> bytes:
    head = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class RawServer:
    """A loopback TCP server: each accepted connection runs ``handler(number, sock)`` on
    a thread of its own; counts the connections it accepts."""

    def __init__(self, handler: Callable[[int, socket.socket], None]) -> None:
        self.handler = handler
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((LOOPBACK, 0))
        self.listener.listen(64)
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self.closed = threading.Event()
        self.threads: list[threading.Thread] = []
        self.socks: list[socket.socket] = []
        self.errors: list[BaseException] = []

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}/v1"

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                sock, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            sock.settimeout(IO_TIMEOUT)
            self.socks.append(sock)
            th = threading.Thread(target=self._run, args=(self.accepted, sock), daemon=True)
            self.threads.append(th)
            th.start()

    def _run(self, number: int, sock: socket.socket) -> None:
        try:
            self.handler(number, sock)
        except (OSError, ValueError):
            pass  # the client went away: expected in these tests
        except BaseException as exc:  # surfaced by close()
            self.errors.append(exc)
        finally:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> RawServer:
        th = threading.Thread(target=self._accept, daemon=True)
        self.threads.append(th)
        th.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed.set()
        for sock in list(self.socks):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for th in self.threads:
            th.join(IO_TIMEOUT)
        self.listener.close()
        if self.errors:
            raise self.errors[0]


def serve_requests(answer: Callable[[int, str, bytes], bytes]) -> Callable[..., None]:
    """A handler answering each request of a connection with ``answer(conn, path, body)``."""

    def handler(number: int, sock: socket.socket) -> None:
        f = sock.makefile("rb")
        while (req := read_request(f)) is not None:
            line, _, body = req
            sock.sendall(answer(number, line.split()[1], body))

    return handler


# --------------------------------------------------------------------------- proxy


class ForwardProxy:
    """A loopback forward proxy: ``CONNECT host:port`` tunnels and absolute-form
    requests (rewritten to origin-form on one upstream connection per client
    connection). Targets must be 127.0.0.1. Records request lines and the
    ``Proxy-Authorization`` it saw; with ``auth`` ("user:password") it answers 407 to
    requests without it."""

    def __init__(self, auth: str | None = None) -> None:
        self.expected = (
            None if auth is None else "Basic " + base64.b64encode(auth.encode()).decode()
        )
        self.lines: list[str] = []
        self.auth_seen: list[str | None] = []
        self.server = RawServer(self._handle)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.server.port}"

    def __enter__(self) -> ForwardProxy:
        self.server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.__exit__(*exc)

    def _handle(self, number: int, sock: socket.socket) -> None:
        f = sock.makefile("rb")
        upstream: socket.socket | None = None
        up_file: Any = None
        try:
            while (req := read_request(f)) is not None:
                line, headers, body = req
                self.lines.append(line)
                self.auth_seen.append(headers.get("proxy-authorization"))
                if (
                    self.expected is not None
                    and headers.get("proxy-authorization") != self.expected
                ):
                    sock.sendall(
                        response(
                            b"",
                            status=407,
                            headers=("Proxy-Authenticate: Basic", "Connection: close"),
                        )
                    )
                    return
                method, target, _ = line.split()
                if method == "CONNECT":
                    host, _, port = target.rpartition(":")
                    assert host == LOOPBACK, target
                    upstream = socket.create_connection((host, int(port)), timeout=IO_TIMEOUT)
                    sock.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    _relay(sock, upstream)
                    return
                parts = urlsplit(target)
                assert parts.scheme == "http", target
                assert parts.hostname == LOOPBACK, target
                if upstream is None:
                    upstream = socket.create_connection(
                        (LOOPBACK, parts.port or 80), timeout=IO_TIMEOUT
                    )
                    up_file = upstream.makefile("rb")
                head = [f"{method} {parts.path or '/'} HTTP/1.1"]
                head += [f"{k}: {v}" for k, v in headers.items() if k != "proxy-authorization"]
                upstream.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
                sock.sendall(_read_raw_response(up_file))
        finally:
            if upstream is not None:
                upstream.close()


def _read_raw_response(f: Any) -> bytes:
    lines = [f.readline(65_537)]
    length = 0
    while True:
        h = f.readline(65_537)
        lines.append(h)
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return b"".join(lines) + f.read(length)


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until either side closes."""
    socks = [a, b]
    while True:
        readable, _, _ = select.select(socks, [], [], IO_TIMEOUT)
        if not readable:
            return
        for s in readable:
            data = s.recv(65_536)
            if not data:
                return
            (b if s is a else a).sendall(data)


# --------------------------------------------------------------------------- limits


def test_connection_limit_exact_under_threads() -> None:
    with EmbeddingServer(latency=0.05, keep_alive_timeout=60) as srv:
        client = q.EmbeddingClient(base_url=srv.base_url, limits=q.Limits(max_connections=4))
        texts = [f"thread text {i}" for i in range(100)]
        results: dict[int, list[float]] = {}
        errors: list[BaseException] = []
        start = threading.Barrier(20)

        def work(k: int) -> None:
            start.wait()
            try:
                for i in range(k, 100, 20):
                    results[i] = client.embed_query(texts[i])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(20)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert errors == []
        sent = [q.format_query(t, q.DEFAULT_QUERY_TASK) for t in texts]
        got = np.asarray([results[i] for i in range(100)], dtype=np.float32)
        np.testing.assert_array_equal(got, expected_embeddings(sent))
        stats = srv.stats()
        # 20 threads, 100 requests of 50 ms: exactly the limit of connections was
        # opened (each in use at once), and never more requests in flight than that
        assert stats["connections_opened"] == 4
        assert stats["max_in_flight"] <= 4
        assert q.pool_stats()[client.config.endpoint]["connections_opened"] == 4
        assert srv.requests == 100


class FakeClock:
    """The transport's clock, moved by hand (keep-alive expiry without waiting)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(_http11, "time", types.SimpleNamespace(monotonic=fake.monotonic))
    return fake


def test_keepalive_expiry_is_honoured(clock: FakeClock) -> None:
    with EmbeddingServer(keep_alive_timeout=60) as srv:
        t = make_transport(srv.base_url, limits=q.Limits(keepalive_expiry=2.0))
        try:
            first = t.send(make_request(srv.base_url))
            clock.now += 1.9  # idle less than the expiry: reused
            second = t.send(make_request(srv.base_url))
            clock.now += 2.1  # idle longer: closed, a new connection
            third = t.send(make_request(srv.base_url))
            assert (first.fresh, second.fresh, third.fresh) == (True, False, True)
            assert srv.connections_opened == 2
            assert t.metrics.connections_opened == 2
            np.testing.assert_array_equal(vectors(third), expected_embeddings(["a"]))
        finally:
            t.close()


def test_max_keepalive_connections_is_honoured() -> None:
    with EmbeddingServer(keep_alive_timeout=60, latency=0.5) as srv:
        limits = q.Limits(max_connections=4, max_keepalive_connections=1)
        t = make_transport(srv.base_url, limits=limits)
        try:
            start = threading.Barrier(4)

            def one() -> None:
                start.wait()
                t.send(make_request(srv.base_url))

            threads = [threading.Thread(target=one) for _ in range(4)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            assert srv.connections_opened == 4
            assert open_idle(t) == 1
            wait_until(lambda: srv.connections_active == 1, "3 connections closed")
            assert not t.send(make_request(srv.base_url)).fresh  # the kept one is reused
        finally:
            t.close()


def test_pool_timeout_names_max_connections() -> None:
    with EmbeddingServer(keep_alive_timeout=60) as srv:
        limits = q.Limits(max_connections=1)
        t = make_transport(srv.base_url, limits=limits)
        try:
            srv.inject("delay", seconds=1.5)
            done: list[Reply] = []
            th = threading.Thread(target=lambda: done.append(t.send(make_request(srv.base_url))))
            th.start()
            wait_until(lambda: srv.stats()["in_flight"] == 1, "the first request arrived")
            timeouts = q.Timeouts(pool=0.2)
            with pytest.raises(q.PoolTimeout, match=r"Limits\.max_connections=1") as info:
                t.send(make_request(srv.base_url, timeouts=timeouts, max_connections=1))
            assert "Timeouts.pool" in str(info.value)
            assert info.value.sent is False
            th.join()
            assert done[0].status == 200
            assert srv.connections_opened == 1
        finally:
            t.close()


def test_close_wakes_threads_waiting_for_a_connection() -> None:
    with EmbeddingServer(keep_alive_timeout=60) as srv:
        t = make_transport(srv.base_url, limits=q.Limits(max_connections=1))
        srv.inject("delay", seconds=1.0)
        outcomes: dict[str, Any] = {}

        def run(name: str) -> None:
            try:
                timeouts = q.Timeouts(pool=120.0)
                outcomes[name] = t.send(make_request(srv.base_url, timeouts=timeouts))
            except BaseException as exc:
                outcomes[name] = exc

        first = threading.Thread(target=run, args=("first",))
        first.start()
        wait_until(lambda: srv.stats()["in_flight"] == 1, "the first request arrived")
        waiter = threading.Thread(target=run, args=("waiter",))
        waiter.start()  # it waits for the one connection (or finds the pool closed)
        t.close()
        waiter.join(100.0)  # far below its 120 s pool timeout
        assert isinstance(outcomes.get("waiter"), Retired)
        first.join()
        assert outcomes["first"].status == 200  # in flight: finished on its connection
        wait_until(lambda: srv.connections_active == 0, "its connection closed after use")
        assert t.is_closed


# --------------------------------------------------------------------------- reuse safety


def test_stale_keepalive_connection_is_resent_once() -> None:
    # The server reads the next request on a kept-alive connection and closes it
    # without an answer: "Server disconnected" on a reused connection.
    with EmbeddingServer(keep_alive_timeout=60) as srv:
        t = make_transport(srv.base_url)
        try:
            assert t.send(make_request(srv.base_url)).fresh
            srv.inject("close")
            with pytest.raises(q.RemoteProtocolError, match="Server disconnected") as info:
                t.send(make_request(srv.base_url))
            assert info.value.fresh is False  # type: ignore[attr-defined]
            assert isinstance(info.value, q.NetworkError)
        finally:
            t.close()
        # the engine resends such a failure at once, once, on a new connection
        client = q.EmbeddingClient(base_url=srv.base_url)
        client.embed_documents(["warm"])
        srv.reset_counters()
        srv.inject("close")
        before = q.pool_stats()[client.config.endpoint]["stale_retries"]
        np.testing.assert_array_equal(
            client.embed_documents_array(["after close"]), expected_embeddings(["after close"])
        )
        assert q.pool_stats()[client.config.endpoint]["stale_retries"] == before + 1
        assert srv.requests == 2
        assert srv.connections_opened == 1  # the resend's new connection


def test_idle_connection_closed_by_server_is_not_reused() -> None:
    with EmbeddingServer(keep_alive_timeout=60) as srv:
        t = make_transport(srv.base_url)
        try:
            t.send(make_request(srv.base_url))
            wait_until(lambda: srv.stats()["in_flight"] == 0, "the answer was counted")
            assert srv.close_connections(idle_only=True) == 1
            wait_until(lambda: srv.connections_active == 0, "the server closed it")
            reply = t.send(make_request(srv.base_url))  # the FIN is seen: no error
            assert reply.fresh
            assert srv.connections_opened == 2
            assert t.metrics.connections_opened == 2
        finally:
            t.close()


def test_connection_with_stray_bytes_is_never_reused() -> None:
    go = threading.Event()
    stray_sent = threading.Event()

    def handler(number: int, sock: socket.socket) -> None:
        f = sock.makefile("rb")
        req = read_request(f)
        assert req is not None
        sock.sendall(response(b"first" if number == 1 else b"second"))
        if number == 1:
            go.wait(IO_TIMEOUT)
            sock.sendall(response(b"stray: no request asked for this"))
            stray_sent.set()
            if read_request(f) is not None:  # a reuse would get this answer
                sock.sendall(response(b"reused"))
        else:
            read_request(f)

    with RawServer(handler) as raw:
        t = make_transport(raw.base_url)
        try:
            first = t.send(make_request(raw.base_url))
            assert first.body == b"first"
            go.set()
            assert stray_sent.wait(IO_TIMEOUT)
            wait_until(lambda: _readable(t), "the stray bytes reached the idle connection")
            second = t.send(make_request(raw.base_url))
            assert second.body == b"second"
            assert second.fresh
            assert raw.accepted == 2
        finally:
            t.close()


def _readable(t: SyncTransport) -> bool:
    socks = [c.sock for c, _ in t._http1._idle if c.sock is not None]
    return bool(socks) and bool(select.select(socks, [], [], 0)[0])


@pytest.mark.parametrize(
    ("head", "body", "kept"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n", b"ok", True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n", b"ok", False),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n", b"2\r\nok\r\n0\r\n\r\n", True),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n", b"ok", False),
        (b"HTTP/1.1 200 OK\r\n", b"ok", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -2\r\n", b"ok", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n", b"ok", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: Keep-Alive\r\n", b"ok", True),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nKeep-Alive: timeout=5\r\n", b"ok", True),
    ],
    ids=[
        "1.1 length",
        "1.1 close",
        "1.1 chunked",
        "1.1 other coding",
        "1.1 until close",
        "1.1 bad length",
        "1.0",
        "1.0 keep-alive",
        "1.0 keep-alive header",
    ],
)
def test_connection_kept_only_when_the_response_framing_allows(
    head: bytes, body: bytes, kept: bool
) -> None:
    """The framing decision (``_http11._framing``, from the documented response version
    and headers): a connection is reused only after a response that keeps it open and
    whose body end is known; a body that ends with the connection is read to its end."""

    def handler(number: int, sock: socket.socket) -> None:
        f = sock.makefile("rb")
        while read_request(f) is not None:
            sock.sendall(head + b"\r\n" + body)
            if not kept:
                return  # the server closes: the end of a body without a length

    with RawServer(handler) as raw:
        t = make_transport(raw.base_url)
        try:
            replies = [t.send(make_request(raw.base_url)) for _ in range(3)]
            assert [r.body for r in replies] == [b"ok"] * 3
            assert [r.fresh for r in replies] == [True, not kept, not kept]
            assert raw.accepted == (1 if kept else 3)
            assert replies[0].http_version == head[:8].decode()
        finally:
            t.close()


def test_a_body_cut_short_of_its_length_is_refused_and_not_reused() -> None:
    """``Content-Length`` not reached when the server closes (``read1`` then returns
    ``b""`` without raising): the exchange fails and the next one opens a connection."""

    def handler(number: int, sock: socket.socket) -> None:
        f = sock.makefile("rb")
        read_request(f)
        if number == 1:
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nok")
            return
        sock.sendall(response(b"whole"))
        read_request(f)

    with RawServer(handler) as raw:
        t = make_transport(raw.base_url)
        try:
            with pytest.raises(q.RemoteProtocolError, match="broken response") as info:
                t.send(make_request(raw.base_url))
            assert info.value.received
            reply = t.send(make_request(raw.base_url))
            assert (reply.body, reply.fresh, raw.accepted) == (b"whole", True, 2)
        finally:
            t.close()


def test_response_heads_are_parsed_like_the_stdlib() -> None:
    def heads(number: int, sock: socket.socket) -> None:
        f = sock.makefile("rb")
        read_request(f)
        sock.sendall(
            b"HTTP/1.1 100 Continue\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nX-Multi: a\r\nx-multi: b\r\nX-Folded: one\r\n two\r\n"
            b"Content-Length: 2\r\n\r\nok"
        )
        read_request(f)  # conflicting lengths: refused, the connection never reused
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc")
        sock.shutdown(socket.SHUT_WR)
        read_request(f)

    with RawServer(heads) as raw:
        t = make_transport(raw.base_url)
        try:
            first = t.send(make_request(raw.base_url))
            assert (first.status, first.body) == (200, b"ok")
            assert first.headers["X-MULTI"] == "a, b"
            assert first.headers.get("x-folded") == "one two"
            with pytest.raises(q.RemoteProtocolError, match="broken response") as info:
                t.send(make_request(raw.base_url))
            assert not info.value.fresh
            assert t.send(make_request(raw.base_url)).fresh  # that connection was not kept
        finally:
            t.close()


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(101)),
        b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 70_000 + b"\r\n",
        b"HTTP/1.1 200 OK\r\n" * 2 + b"X" * 70_000,
        b"SPDY/3 200 OK\r\n",
    ],
    ids=["101 headers", "long header line", "endless line", "not HTTP/1"],
)
def test_hostile_response_heads_are_refused(head: bytes) -> None:
    def hostile(number: int, sock: socket.socket) -> None:
        read_request(sock.makefile("rb"))
        sock.sendall(head + b"\r\n")

    with RawServer(hostile) as raw:
        t = make_transport(raw.base_url)
        try:
            with pytest.raises(q.RemoteProtocolError, match="broken response"):
                t.send(make_request(raw.base_url))
        finally:
            t.close()


def test_redirect_is_returned_as_it_is() -> None:
    with EmbeddingServer() as srv:
        t = make_transport(srv.base_url)
        try:
            srv.inject("status", status=302, headers={"Location": "http://elsewhere/"})
            reply = t.send(make_request(srv.base_url))
            assert reply.status == 302
            assert reply.headers["location"] == "http://elsewhere/"
            assert reply.headers["Location"] == "http://elsewhere/"  # case-insensitive
            assert srv.requests == 1
        finally:
            t.close()


# --------------------------------------------------------------------------- bodies and time


def _bodies(number: int, path: str, body: bytes) -> bytes:
    payload = orjson.dumps({"data": [{"index": 0, "embedding": "AAAA"}], "pad": "x" * 5000})
    if path.endswith("/gzip"):
        return response(gzip.compress(payload), headers=("Content-Encoding: gzip",))
    if path.endswith("/deflate"):
        return response(zlib.compress(payload), headers=("Content-Encoding: deflate",))
    if path.endswith("/rawdeflate"):
        c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
        return response(c.compress(payload) + c.flush(), headers=("Content-Encoding: deflate",))
    if path.endswith("/chunked-gzip"):
        data = gzip.compress(payload)
        chunks = b"".join(
            b"%x\r\n%s\r\n" % (len(data[i : i + 700]), data[i : i + 700])
            for i in range(0, len(data), 700)
        )
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Encoding: gzip\r\n\r\n"
        return head + chunks + b"0\r\n\r\n"
    if path.endswith("/bomb"):
        bomb = gzip.compress(b"\0" * (64 << 20))  # 64 MiB of zeros in ~64 KiB
        return response(bomb, headers=("Content-Encoding: gzip",))
    if path.endswith("/declared"):
        return b"HTTP/1.1 200 OK\r\nContent-Length: 500000000\r\n\r\n" + b"x" * 1000
    return response(payload)


@pytest.mark.parametrize("path", ["/gzip", "/deflate", "/rawdeflate", "/chunked-gzip", "/plain"])
def test_encoded_bodies_are_decoded(path: str) -> None:
    want = orjson.dumps({"data": [{"index": 0, "embedding": "AAAA"}], "pad": "x" * 5000})
    with RawServer(serve_requests(_bodies)) as raw:
        t = make_transport(raw.base_url)
        try:
            reply = t.send(make_request(raw.base_url, path=path))
            assert reply.body == want
            assert not t.send(make_request(raw.base_url, path=path)).fresh  # kept alive
        finally:
            t.close()


def test_size_cap_on_this_path() -> None:
    def endless(number: int, sock: socket.socket) -> None:
        f = sock.makefile("rb")
        while (req := read_request(f)) is not None:
            path = req[0].split()[1]
            if not path.endswith("/endless"):
                sock.sendall(_bodies(number, path, req[2]))
                continue
            sock.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"%x\r\n%s\r\n" % (65_536, b"y" * 65_536)
            while not raw.closed.is_set():
                sock.sendall(chunk)  # until the client hangs up (then: BrokenPipe)

    with RawServer(endless) as raw:
        t = make_transport(raw.base_url)
        try:
            cap = 1 << 20
            with pytest.raises(q.ResponseError, match="declares 500,000,000 bytes"):
                t.send(make_request(raw.base_url, path="/declared", max_bytes=cap))
            with pytest.raises(q.ResponseError, match="as received"):
                t.send(make_request(raw.base_url, path="/endless", max_bytes=cap))
            with pytest.raises(q.ResponseError, match="after gzip decoding"):
                t.send(make_request(raw.base_url, path="/bomb", max_bytes=cap))
            # a connection whose body was not read to its end is never reused; the bomb's
            # (about 1 KB, read to its end before it inflated past the cap) may be
            reply = t.send(make_request(raw.base_url, path="/plain"))
            assert raw.accepted == (3 if not reply.fresh else 4)
        finally:
            t.close()


def test_total_deadline_bounds_a_trickling_body() -> None:
    def trickle(number: int, sock: socket.socket) -> None:
        f = sock.makefile("rb")
        read_request(f)
        if number == 1:  # headers, then the body one byte every 20 ms
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
            while not raw.closed.is_set():
                sock.sendall(b"z")
                time.sleep(0.02)
        else:  # headers, then silence
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
            raw.closed.wait(IO_TIMEOUT)

    with RawServer(trickle) as raw:
        t = make_transport(raw.base_url)
        try:
            timeouts = q.Timeouts(read=20.0)
            started = time.monotonic()
            with pytest.raises(q.ReadTimeout, match="in all") as info:
                t.send(make_request(raw.base_url, timeouts=timeouts, total=0.5))
            assert time.monotonic() - started >= 0.5
            assert info.value.received
            assert info.value.fresh is True  # type: ignore[attr-defined]
            # the read timeout is cut to what is left of the total
            with pytest.raises(q.ReadTimeout, match="in all"):
                t.send(make_request(raw.base_url, timeouts=timeouts, total=0.5))
        finally:
            t.close()


def test_read_timeout_and_truncated_body() -> None:
    with EmbeddingServer(keep_alive_timeout=60) as srv:
        t = make_transport(srv.base_url)
        try:
            srv.inject("delay", seconds=2.0)
            with pytest.raises(q.ReadTimeout, match=r"Timeouts\.read"):
                t.send(make_request(srv.base_url, timeouts=q.Timeouts(read=0.3)))
        finally:
            t.close()

    def truncated(number: int, sock: socket.socket) -> None:
        read_request(sock.makefile("rb"))
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"{" * 10)

    with RawServer(truncated) as raw:
        t = make_transport(raw.base_url)
        try:
            with pytest.raises(q.RemoteProtocolError, match="broken response") as info:
                t.send(make_request(raw.base_url))
            assert info.value.received
        finally:
            t.close()


def test_write_timeout_when_the_server_does_not_read() -> None:
    def never_reads(number: int, sock: socket.socket) -> None:
        raw.closed.wait(IO_TIMEOUT)

    with RawServer(never_reads) as raw:
        t = make_transport(raw.base_url)
        try:
            big = b"x" * (64 << 20)  # beyond every socket buffer on loopback
            request = make_request(raw.base_url, body=big, timeouts=q.Timeouts(write=0.3))
            with pytest.raises(q.WriteTimeout, match=r"Timeouts\.write") as info:
                t.send(request)
            assert info.value.fresh is True  # type: ignore[attr-defined]
        finally:
            t.close()


def test_connect_errors_say_nothing_was_sent() -> None:
    listener = socket.socket()
    listener.bind((LOOPBACK, 0))
    port = listener.getsockname()[1]
    listener.close()  # nobody listens there now: refused
    url = f"http://{LOOPBACK}:{port}/v1"
    t = make_transport(url)
    with pytest.raises(q.ConnectError, match="cannot connect") as info:
        t.send(make_request(url))
    assert info.value.sent is False
    assert info.value.fresh is True  # type: ignore[attr-defined]
    t.close()

    def silent(number: int, sock: socket.socket) -> None:  # TCP, but never a TLS byte
        raw.closed.wait(IO_TIMEOUT)

    with RawServer(silent) as raw:
        url = f"https://{LOOPBACK}:{raw.port}/v1"
        t = make_transport(url)
        try:
            with pytest.raises(q.ConnectTimeout, match=r"Timeouts\.connect") as cinfo:
                t.send(make_request(url, timeouts=q.Timeouts(connect=0.3)))
            assert cinfo.value.sent is False
            # counted once connected (TCP and TLS): this one never was
            assert t.metrics.connections_opened == 0
        finally:
            t.close()


# --------------------------------------------------------------------------- TLS, proxies


@pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")
def test_tls_with_the_test_servers_ca() -> None:
    with EmbeddingServer(tls=True) as srv:
        client = q.EmbeddingClient(base_url=srv.base_url, verify=str(srv.ca_cert_path))
        texts = [f"tls {i}" for i in range(40)]
        np.testing.assert_array_equal(
            client.embed_documents_array(texts), expected_embeddings(texts)
        )
        opened = q.pool_stats()[client.config.endpoint]["connections_opened"]
        assert opened == srv.connections_opened >= 1
        unverified = q.EmbeddingClient(base_url=srv.base_url, verify=False)  # no warning
        np.testing.assert_array_equal(
            unverified.embed_documents_array(texts[:2]), expected_embeddings(texts[:2])
        )
        default = q.EmbeddingClient(
            base_url=srv.base_url, retry=q.RetryConfig(max_attempts=1, query_deadline=1.0)
        )
        with pytest.raises(q.ConnectError, match="certificate verification failed"):
            default.embed_query("unknown CA")
    # the server (not the client) leaks its side of the refused handshakes: collect them
    # here, where that ResourceWarning is expected
    gc.collect()


def test_http_through_a_forward_proxy() -> None:
    with EmbeddingServer(keep_alive_timeout=60) as srv, ForwardProxy() as proxy:
        t = make_transport(srv.base_url, proxy=proxy.url)
        try:
            for text in ("via proxy 1", "via proxy 2"):
                reply = t.send(make_request(srv.base_url, (text,)))
                np.testing.assert_array_equal(vectors(reply), expected_embeddings([text]))
        finally:
            t.close()
        target = f"http://{LOOPBACK}:{srv.port}/v1/embeddings"
        assert proxy.lines == [f"POST {target} HTTP/1.1"] * 2  # absolute-form
        assert proxy.server.accepted == 1  # kept alive through the proxy
        assert t.metrics.connections_opened == 1  # to the proxy
        assert srv.connections_opened == 1  # the proxy's one upstream connection


@pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")
def test_https_through_a_connect_tunnel_with_proxy_credentials() -> None:
    with EmbeddingServer(tls=True) as srv, ForwardProxy(auth="user:s3cret-pw") as proxy:
        authed = proxy.url.replace("http://", "http://user:s3cret-pw@")
        ca = str(srv.ca_cert_path)
        t = make_transport(srv.base_url, proxy=authed, verify=ca)
        try:
            for text in ("tunnel 1", "tunnel 2"):
                reply = t.send(make_request(srv.base_url, (text,)))
                np.testing.assert_array_equal(vectors(reply), expected_embeddings([text]))
        finally:
            t.close()
        assert len(proxy.lines) == 1  # one tunnel, kept alive
        assert proxy.lines[0].startswith(f"CONNECT {LOOPBACK}:{srv.port} HTTP/1.")
        assert proxy.auth_seen == [proxy.expected]
        assert srv.connections_opened == 1
        # without credentials: the proxy refuses the tunnel, nothing reaches the server
        for proxy_url in (proxy.url, proxy.url.replace("http://", "http://user:wrong-pw@")):
            refused = make_transport(srv.base_url, proxy=proxy_url, verify=ca)
            try:
                with pytest.raises(q.ConnectError, match="proxy") as info:
                    refused.send(make_request(srv.base_url))
            finally:
                refused.close()
            assert "407" in str(info.value)
            assert "wrong-pw" not in str(info.value)
            assert info.value.sent is False
        assert srv.requests == 2


def test_forward_proxy_answer_is_returned_as_it_is() -> None:
    with EmbeddingServer() as srv, ForwardProxy(auth="user:s3cret-pw") as proxy:
        wrong = proxy.url.replace("http://", "http://user:wrong-pw@")
        t = make_transport(srv.base_url, proxy=wrong)
        try:
            reply = t.send(make_request(srv.base_url))
            assert reply.status == 407  # the proxy's refusal, for the engine to report
        finally:
            t.close()
        sent = base64.b64encode(b"user:wrong-pw").decode()
        assert proxy.auth_seen == [f"Basic {sent}"]  # credentials from the proxy URL
        assert srv.requests == 0


# --------------------------------------------------------------------------- fork, SDK


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_child_opens_its_own_connections() -> None:
    with EmbeddingServer(keep_alive_timeout=60) as srv:
        client = q.EmbeddingClient(base_url=srv.base_url)
        client.embed_documents(["parent"])
        key = client.config.pool_key
        parent = pool.sync_transport(key)
        assert srv.connections_opened == 1
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                child = pool.sync_transport(key)
                arr = client.embed_documents_array(["child"])
                ok = child is not parent and np.array_equal(arr, expected_embeddings(["child"]))
                code = 0 if ok else 2
            finally:
                os.write(write_fd, bytes([code]))
                os._exit(code)
        os.close(write_fd)
        _, status = os.waitpid(pid, 0)
        os.read(read_fd, 1)
        os.close(read_fd)
        assert os.waitstatus_to_exitcode(status) == 0
        assert srv.connections_opened == 2  # the child's own
        before = q.pool_stats()[client.config.endpoint]["stale_retries"]
        reply = parent.send(make_request(srv.base_url))  # the parent's socket is intact
        assert reply.status == 200
        assert not reply.fresh
        assert srv.connections_opened == 2
        assert q.pool_stats()[client.config.endpoint]["stale_retries"] == before


def test_openai_sdk_goes_through_the_same_pool() -> None:
    _openai_sdk_goes_through_the_same_pool(port=0)


def test_openai_sdk_pool_counters_on_a_port_an_earlier_server_used(poisoned_port: int) -> None:
    """CI once ran the test above on the port of an earlier test's server, whose
    connections this process still counted for the URL: 2 opened instead of 1."""
    _openai_sdk_goes_through_the_same_pool(port=poisoned_port)


def _openai_sdk_goes_through_the_same_pool(port: int) -> None:
    import openai

    with EmbeddingServer(keep_alive_timeout=60, port=port) as srv:
        client = q.EmbeddingClient(base_url=srv.base_url, limits=q.Limits(max_connections=1))
        client.embed_query("core first")
        sdk = client.openai_client()
        for i in range(3):
            got = sdk.embeddings.create(input=[f"sdk {i}"], model="m")
            assert np.array_equal(
                np.asarray(got.data[0].embedding, dtype=np.float32),
                expected_embedding(f"sdk {i}"),
            )
        with sdk.embeddings.with_streaming_response.create(input=["streamed"], model="m") as r:
            assert r.http_response.status_code == 200
            assert r.http_response.http_version == "HTTP/1.1"
            r.read()
        assert srv.connections_opened == 1  # core and SDK on one connection (limit 1)
        assert q.pool_stats()[client.config.endpoint]["connections_opened"] == 1
        # a timeout reaches the SDK as httpx's, chained from the library's error; the
        # client's Timeouts apply (the SDK's timeout= does not)
        srv.inject("delay", seconds=2.0)
        impatient = q.EmbeddingClient(client.config, timeout=q.Timeouts(read=0.3))
        with pytest.raises(openai.APITimeoutError) as info:
            impatient.openai_client().embeddings.create(input=["slow"], model="m")
        cause = info.value.__cause__
        assert isinstance(cause, httpx.ReadTimeout)
        assert isinstance(cause.__cause__, q.ReadTimeout)
        assert len(client.embed_query("pool still works")) == 1024


# --------------------------------------------------------------------------- translation


KEY = "sk-this-is-the-secret-key-123"


@pytest.mark.parametrize(
    ("exc", "stage", "cls", "sent"),
    [
        (http.client.RemoteDisconnected("Remote end closed"), "read", q.RemoteProtocolError, True),
        (http.client.IncompleteRead(b"", 10), "read", q.RemoteProtocolError, True),
        (ConnectionResetError(104, "reset"), "read", q.NetworkError, True),
        (BrokenPipeError(32, "pipe"), "write", q.NetworkError, True),
        (TimeoutError("timed out"), "connect", q.ConnectTimeout, False),
        (TimeoutError("timed out"), "write", q.WriteTimeout, True),
        (TimeoutError("timed out"), "read", q.ReadTimeout, True),
        (ConnectionRefusedError(111, f"refused {KEY}"), "connect", q.ConnectError, False),
        (OSError(f"Tunnel connection failed: 407 {KEY}"), "connect", q.ConnectError, False),
        (ValueError(f"invalid header {KEY}"), "read", q.TransportError, False),
    ],
)
def test_translate_stdlib(exc: BaseException, stage: str, cls: type, sent: bool) -> None:
    ctx = ErrorContext(
        url="http://h:1/v1",
        secret=KEY,
        connect=1.0,
        read=2.0,
        write=3.0,
        pool=4.0,
        max_connections=7,
    )
    error = translate(exc, ctx, backend="stdlib", stage=stage)
    assert type(error) is cls
    assert error.sent is sent
    assert KEY not in str(error)
    assert "http://h:1/v1" in str(error)
