"""`LoopbackProxy`: a counting forward HTTP proxy on 127.0.0.1 that only reaches 127.0.0.1.

For tests of a client's proxy handling (``HTTP_PROXY`` / ``HTTPS_PROXY`` / ``NO_PROXY``,
an explicit ``proxy=``): plain ``http://`` targets arrive in absolute form
(``POST http://127.0.0.1:8000/v1/embeddings HTTP/1.1``) and are forwarded with keep-alive
on both sides; ``https://`` targets arrive as ``CONNECT host:port`` and are tunnelled
byte for byte. Every forwarded request, tunnel and target is counted, so a test can
assert what went through the proxy and what did not.

Targets are never resolved: ``127.0.0.1``, ``localhost`` and the names given as
``aliases`` are reached at 127.0.0.1; any other host gets 403 without a connection
attempt (so a test can use an endpoint name that only the proxy can reach).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
from collections.abc import Iterable
from typing import Any, Final
from urllib.parse import urlsplit

from ._common import LOOPBACK, _integer, _number
from ._loop import _Counters, _LoopServer, header, parse_head, read_head

_UPSTREAM_TIMEOUT: Final = 300.0  # seconds an upstream may take to answer
_HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
    }
)
_LOOPBACK_NAMES: Final = frozenset({"127.0.0.1", "localhost"})
_COUNTERS: Final = (
    "connections_opened",
    "connections_active",
    "requests",
    "connects",
    "refused",
    "auth_failures",
)


class LoopbackProxy:
    """A forward HTTP proxy on 127.0.0.1 that counts what it forwards.

    Use it as a context manager (starts on enter, stops on exit) or call `start` /
    `stop`; point a client at `url` (``HTTP_PROXY=proxy.url``, ``proxy=proxy.url``).

    Args:
        port: TCP port on 127.0.0.1; 0 (default) picks a free one.
        aliases: host names the proxy reaches at 127.0.0.1 (never resolved), e.g.
            ``("embeddings.internal.test",)`` for an endpoint only the proxy can reach.
            With TLS, give the server the same names (``EmbeddingServer(tls_hostnames=...)``).
        auth: ``(user, password)``: require ``Proxy-Authorization: Basic ...`` (else 407
            with ``Proxy-Authenticate``); None (default): no authentication.
        idle_timeout: seconds a client connection may stay idle between requests.
        startup_timeout: seconds to wait for the proxy to start or stop.

    Counters (`stats`): ``connections_opened`` / ``connections_active`` (client
    connections), ``requests`` (absolute-form requests forwarded), ``connects`` (CONNECT
    tunnels opened), ``refused`` (targets that are not loopback: 403), ``auth_failures``
    (407), and ``targets``: ``"host:port"`` as the client named it -> requests plus
    tunnels.
    """

    def __init__(
        self,
        *,
        port: int = 0,
        aliases: Iterable[str] = (),
        auth: tuple[str, str] | None = None,
        idle_timeout: float = 30.0,
        startup_timeout: float = 10.0,
    ) -> None:
        _integer("port", port, minimum=0)
        self._idle = _number("idle_timeout", idle_timeout, minimum=0.001)
        self._timeout = _number("startup_timeout", startup_timeout, minimum=0.001)
        names = [str(a).lower() for a in aliases]
        if not all(names):
            raise ValueError("aliases must be non-empty host names")
        self._allowed = _LOOPBACK_NAMES | frozenset(names)
        self._auth: bytes | None = None
        if auth is not None:
            user, password = auth
            self._auth = b"Basic " + base64.b64encode(f"{user}:{password}".encode())
        self._counters = _Counters(_COUNTERS, ("targets",))
        self._server = _LoopServer("LoopbackProxy", self._handle, self._counters, port)

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> LoopbackProxy:
        """Start serving (no-op when running) and return ``self``.

        Raises:
            OSError: the port is taken.
            RuntimeError: the proxy did not start within ``startup_timeout`` seconds.
        """
        self._server.start(self._timeout)
        return self

    def stop(self) -> None:
        """Stop: close the listener and every client connection and tunnel (handlers get
        2 s). No-op when stopped."""
        self._server.stop(self._timeout)

    close = stop

    def __enter__(self) -> LoopbackProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """Whether the proxy is accepting connections."""
        return self._server.running

    @property
    def port(self) -> int:
        """The proxy's TCP port on 127.0.0.1 (known after `start`)."""
        return self._server.port

    @property
    def url(self) -> str:
        """The proxy URL, ``http://127.0.0.1:<port>`` (for ``HTTP_PROXY`` and ``HTTPS_PROXY``
        alike: the client speaks plain HTTP to the proxy)."""
        return f"http://{LOOPBACK}:{self.port}"

    # ---- counters ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """A snapshot of the counters (see the class doc) since `reset_counters`."""
        return self._counters.snapshot()

    @property
    def requests(self) -> int:
        """Absolute-form (``http://``) requests forwarded."""
        return int(self.stats()["requests"])

    @property
    def connects(self) -> int:
        """CONNECT tunnels opened (``https://`` targets)."""
        return int(self.stats()["connects"])

    @property
    def targets(self) -> dict[str, int]:
        """``"host:port"`` -> requests plus tunnels to it."""
        return dict(self.stats()["targets"])

    def reset_counters(self) -> None:
        """Zero the counters (open connections stay)."""
        self._counters.reset()

    def wait_for(
        self, counter: str, n: int, *, timeout: float = 10.0, at_most: bool = False
    ) -> int:
        """Block until ``counter`` (a key of `stats` other than ``targets``) is >= ``n``
        (``at_most``: <= ``n``); returns its value.

        Raises:
            TimeoutError: not reached within ``timeout`` seconds.
        """
        return self._counters.wait_for(counter, n, timeout, at_most=at_most)

    def __repr__(self) -> str:
        where = self.url if self.port else "127.0.0.1:<unbound>"
        return f"LoopbackProxy({where}, aliases={sorted(self._allowed - _LOOPBACK_NAMES)})"

    # ---- the proxy -----------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstreams: dict[tuple[str, int], tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
        try:
            while not self._server.stopping():
                try:
                    head = await read_head(reader, self._idle)
                except ValueError:
                    await _simple(writer, 431, "request head too large")
                    return
                if head is None:
                    return
                line, headers = parse_head(head)
                parts = line.split(" ")
                if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                    await _simple(writer, 400, "bad request line")
                    return
                method, target, _ = parts
                if self._auth is not None and not hmac.compare_digest(
                    (header(headers, "proxy-authorization") or "").encode("latin-1"), self._auth
                ):
                    self._counters.add("auth_failures")
                    extra = ("Proxy-Authenticate", 'Basic realm="LoopbackProxy"')
                    await _simple(writer, 407, "proxy authentication required", extra)
                    return
                if method == "CONNECT":
                    await self._tunnel(target, reader, writer)
                    return
                if not await self._forward(method, target, headers, reader, writer, upstreams):
                    return
        finally:
            for _, up_writer in upstreams.values():
                up_writer.close()

    def _allowed_target(self, host: str | None, port: int | None) -> tuple[str, int] | None:
        if not host or port is None or host.lower() not in self._allowed:
            self._counters.add("refused")
            return None
        return host.lower(), port

    async def _tunnel(
        self, target: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        host, _, port_text = target.rpartition(":")
        allowed = self._allowed_target(host, int(port_text) if port_text.isdigit() else None)
        if allowed is None:
            await _simple(writer, 403, "only loopback targets")
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(LOOPBACK, allowed[1])
        except OSError as exc:
            await _simple(writer, 502, f"cannot reach the target: {exc}")
            return
        self._counters.add("connects")
        self._counters.add("targets", key=f"{allowed[0]}:{allowed[1]}")
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        try:
            await writer.drain()
            await asyncio.gather(_copy(reader, up_writer), _copy(up_reader, writer))
        finally:
            up_writer.close()

    async def _forward(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upstreams: dict[tuple[str, int], tuple[asyncio.StreamReader, asyncio.StreamWriter]],
    ) -> bool:
        """Forward one absolute-form request and its answer; False: close the client."""
        url = urlsplit(target)
        if url.scheme != "http":
            await _simple(writer, 400, "absolute-form http:// targets only (CONNECT for https)")
            return False
        allowed = self._allowed_target(url.hostname, url.port or 80)
        if allowed is None:
            await _simple(writer, 403, "only loopback targets")
            return False
        self._counters.add("requests")
        self._counters.add("targets", key=f"{allowed[0]}:{allowed[1]}")
        upstream = upstreams.pop(allowed, None)
        if upstream is None:
            try:
                upstream = await asyncio.open_connection(LOOPBACK, allowed[1])
            except OSError as exc:
                await _simple(writer, 502, f"cannot reach the target: {exc}")
                return False
        up_reader, up_writer = upstream
        path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        kept = [(k, v) for k, v in headers if k not in _HOP_BY_HOP]
        out = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in kept)
        up_writer.write(out.encode("latin-1") + b"\r\n")
        await _relay_body(headers, reader, up_writer, request=True)
        head = await read_head(up_reader, _UPSTREAM_TIMEOUT)
        if head is None:
            up_writer.close()
            await _simple(writer, 502, "the target closed the connection without an answer")
            return False
        status_line, answer = parse_head(head)
        status = int(status_line.split(" ")[1])
        kept = [(k, v) for k, v in answer if k not in _HOP_BY_HOP]
        out = status_line + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in kept)
        writer.write(out.encode("latin-1") + b"\r\n")
        no_body = method == "HEAD" or status in (204, 304) or status < 200
        until_close = not no_body and not await _relay_body(
            answer, up_reader, writer, request=False
        )
        await writer.drain()
        upstream_closes = until_close or (header(answer, "connection") or "").lower() == "close"
        if upstream_closes:
            up_writer.close()
        else:
            upstreams[allowed] = (up_reader, up_writer)
        client_closes = (
            "close"
            in (
                (header(headers, "connection") or "") + (header(headers, "proxy-connection") or "")
            ).lower()
        )
        return not (until_close or client_closes)


async def _relay_body(
    headers: list[tuple[str, str]],
    src: asyncio.StreamReader,
    dst: asyncio.StreamWriter,
    *,
    request: bool,
) -> bool:
    """Copy one message body framed by ``headers``; False when it is delimited by the end
    of the connection (a response without length), which was copied to the end."""
    if "chunked" in (header(headers, "transfer-encoding") or "").lower():
        while True:
            line = await src.readuntil(b"\r\n")
            dst.write(line)
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while (trailer := await src.readuntil(b"\r\n")) != b"\r\n":
                    dst.write(trailer)
                dst.write(b"\r\n")
                break
            dst.write(await src.readexactly(size + 2))
            await dst.drain()
        return True
    length = header(headers, "content-length")
    if length is not None:
        remaining = int(length)
        while remaining > 0:
            chunk = await src.read(min(remaining, 65536))
            if not chunk:
                raise ConnectionError("connection closed inside a message body")
            dst.write(chunk)
            remaining -= len(chunk)
            await dst.drain()
        return True
    if request:
        return True  # a request without length has no body
    await _copy(src, dst)
    return False


async def _copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copy until end of stream, then half-close ``dst``."""
    with contextlib.suppress(ConnectionError):
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    with contextlib.suppress(OSError, RuntimeError):
        if dst.can_write_eof():
            dst.write_eof()


async def _simple(
    writer: asyncio.StreamWriter, status: int, message: str, *extra: tuple[str, str]
) -> None:
    """A short plain-text answer that closes the connection."""
    body = message.encode("utf-8")
    lines = [f"HTTP/1.1 {status} {message}", "Content-Type: text/plain; charset=utf-8"]
    lines += [f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in extra)]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
    with contextlib.suppress(ConnectionError):
        await writer.drain()
