"""A raw HTTP/2 server on ``h2`` (sans-IO) serving the embedding ASGI app.

It exists for what hypercorn will not do on cue: speak only HTTP/2 (prior-knowledge h2c
on cleartext, ALPN ``h2`` over TLS; an HTTP/1.1 connection is closed), and refuse streams
after the first ``goaway_after`` of a connection with a GOAWAY whose ``last_stream_id``
lies below streams still in flight, or with RST_STREAM(REFUSED_STREAM) (see
``EmbeddingServer(goaway_after=..., goaway_mode=...)``). Answers, faults and counters
are the app's, as with uvicorn and hypercorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from hyperframe.frame import GoAwayFrame

from ._common import _BACKLOG, _GRACEFUL_SHUTDOWN, _MODULE, _Message, _TLSFiles

if TYPE_CHECKING:
    from ._app import _EmbeddingApp
    from ._state import _ListenSocket

logger = logging.getLogger(_MODULE)

_PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_MAX_BODY: Final = 64 * 1024 * 1024  # bytes of one request body
_GOAWAY_GRACE: Final = 1.0  # seconds a connection stays open after its last GOAWAY


class _Stream:
    """One request stream: its headers, body and lifecycle events."""

    __slots__ = ("body", "closed", "complete", "headers", "id", "reset")

    def __init__(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.id = stream_id
        self.headers = headers
        self.body = bytearray()
        self.complete = asyncio.Event()  # the request body is complete (or the stream gone)
        self.closed = asyncio.Event()  # the stream or its connection is gone
        self.reset = False


class _Runner:
    """The connections of one run, for shutdown."""

    def __init__(self, app: _EmbeddingApp, secure: bool) -> None:
        self.app = app
        self.secure = secure
        self.protocols: set[_H2Protocol] = set()
        self.tasks: set[asyncio.Task[None]] = set()


class _H2Protocol(asyncio.Protocol):
    """One HTTP/2 connection: h2's state machine plus one task per accepted stream."""

    def __init__(self, runner: _Runner) -> None:
        self.runner = runner
        self.app = runner.app
        self.settings = runner.app.settings
        self.state = runner.app.state
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        self.conn = h2.connection.H2Connection(config=config)
        self.conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1000},
        )
        self.transport: asyncio.Transport | None = None
        self.peer: tuple[str, int] | None = None
        self.sockname: tuple[str, int] | None = None
        self.streams: dict[int, _Stream] = {}
        self.accepted = 0  # streams accepted on this connection
        self.last_ok = 0  # id of the last accepted stream
        self.goaway_sent = False
        self.closed = False
        self.window_open = asyncio.Event()
        self._preface = b""
        self.refused = False  # an HTTP/1.1 client was refused: its bytes are dropped
        self._timer: asyncio.TimerHandle | None = None

    # ---- transport events --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = (str(peer[0]), int(peer[1])) if peer else None
        name = transport.get_extra_info("sockname")
        self.sockname = (str(name[0]), int(name[1])) if name else None
        self.runner.protocols.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # the rest of a refused HTTP/1.1 request: read and dropped
        if len(self._preface) < len(_PREFACE):  # prior knowledge only: no HTTP/1.1
            self._preface += data[: len(_PREFACE) - len(self._preface)]
            if not _PREFACE.startswith(self._preface):
                self.state.fault_applied("h1_refused")
                self._refuse_http11()
                return
            if len(self._preface) == len(_PREFACE):
                # our preface (SETTINGS) only once the client's is checked, so an
                # HTTP/1.1 client sees a plain close, never binary frames
                self.conn.initiate_connection()
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError:
            self.flush()
            self.abort(reset=False)
            return
        for event in events:
            self._event(event)
        self.flush()
        self._arm_idle()

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.runner.protocols.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        for stream in self.streams.values():
            stream.reset = True
            stream.complete.set()
            stream.closed.set()
        self.window_open.set()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data and self.transport is not None and not self.closed:
            self.transport.write(data)

    def _refuse_http11(self) -> None:
        """Refuse an HTTP/1.1 client with a plain close, never a reset.

        Closing while the rest of its request is still arriving makes the kernel answer
        with a reset (the client reads ECONNRESET, not the end of the stream). So our side
        ends first (FIN), what else the client sends is read and dropped, and the socket
        closes when the client closes its side (``eof_received``) or after the keep-alive
        timeout. asyncio's TLS transport has no ``write_eof``: there the connection is
        closed at once (and a reset can still win the race).
        """
        self.refused = True
        self.goaway_sent = True  # nothing more is written here, not even at shutdown
        transport = self.transport
        if transport is None or not transport.can_write_eof():
            self.abort(reset=False)
            return
        transport.write_eof()
        self._close_later(self.settings.keep_alive_timeout)  # GOAWAY is off: a plain close

    def abort(self, *, reset: bool) -> None:
        """Close the connection (``reset``: at once, dropping unsent data)."""
        if self.transport is not None:
            if reset:
                self.transport.abort()
            else:
                self.transport.close()

    # ---- h2 events ---------------------------------------------------------------------
    def _event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            self._request(event.stream_id or 0, list(event.headers or []))
        elif isinstance(event, h2.events.DataReceived):
            stream_id = event.stream_id or 0
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.conn.acknowledge_received_data(event.flow_controlled_length or 0, stream_id)
            stream = self.streams.get(stream_id)
            if stream is not None:
                stream.body += event.data or b""
                if len(stream.body) > _MAX_BODY:
                    self._reset(stream, h2.errors.ErrorCodes.REFUSED_STREAM)
        elif isinstance(event, h2.events.StreamEnded):
            stream = self.streams.get(event.stream_id or 0)
            if stream is not None:
                stream.complete.set()
        elif isinstance(event, h2.events.StreamReset):
            stream = self.streams.get(event.stream_id or 0)
            if stream is not None:
                stream.reset = True
                stream.complete.set()
                stream.closed.set()
        elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            self.window_open.set()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.abort(reset=False)

    def _reset(self, stream: _Stream, code: h2.errors.ErrorCodes) -> None:
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.conn.reset_stream(stream.id, code)
        stream.reset = True
        stream.complete.set()
        stream.closed.set()

    def _request(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> None:
        limit = self.settings.goaway_after
        if self.goaway_sent or (limit is not None and self.accepted >= limit):
            self._refuse(stream_id)
            return
        self.accepted += 1
        self.last_ok = stream_id
        stream = _Stream(stream_id, headers)
        self.streams[stream_id] = stream
        task = asyncio.get_running_loop().create_task(self._run(stream))
        self.runner.tasks.add(task)
        task.add_done_callback(self.runner.tasks.discard)

    def _refuse(self, stream_id: int) -> None:
        """A stream beyond ``goaway_after``: never answered (GOAWAY modes) or reset."""
        self.state.fault_applied("refused_stream")
        mode = self.settings.goaway_mode
        if mode == "refuse":
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
        elif mode == "early":
            self._goaway()
        self._maybe_goaway()

    def _goaway(self) -> None:
        """Send GOAWAY(NO_ERROR, last_stream_id = the last accepted stream) once, without
        telling h2 (whose state machine would refuse to finish the accepted streams)."""
        if self.goaway_sent or self.transport is None or self.closed:
            return
        self.goaway_sent = True
        self.state.fault_applied("goaway")
        self.flush()
        frame = GoAwayFrame(0, last_stream_id=self.last_ok, error_code=0)
        self.transport.write(frame.serialize())

    def _maybe_goaway(self) -> None:
        """After the first ``goaway_after`` streams are answered: GOAWAY, then close."""
        limit = self.settings.goaway_after
        if limit is None or self.accepted < limit or self.streams:
            return
        self._goaway()
        self._close_later(_GOAWAY_GRACE)

    def _close_later(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(seconds, self.abort_idle)

    def _arm_idle(self) -> None:
        if not self.streams and not self.goaway_sent and not self.closed:
            self._close_later(self.settings.keep_alive_timeout)

    def abort_idle(self) -> None:
        if not self.streams:
            self._goaway()
            self.abort(reset=False)

    # ---- one stream through the ASGI app -------------------------------------------------
    async def _run(self, stream: _Stream) -> None:
        if self._timer is not None:
            self._timer.cancel()
        pseudo = {k: v for k, v in stream.headers if k.startswith(b":")}
        target = pseudo.get(b":path", b"/")
        path, _, query = target.partition(b"?")
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "2",
            "method": pseudo.get(b":method", b"GET").decode("latin-1"),
            "scheme": "https" if self.runner.secure else "http",
            "path": path.decode("latin-1"),
            "raw_path": path,
            "query_string": query,
            "root_path": "",
            "headers": [(k.lower(), v) for k, v in stream.headers if not k.startswith(b":")],
            "client": self.peer,
            "server": self.sockname,
        }
        delivered = False

        async def receive() -> _Message:
            nonlocal delivered
            if not delivered:
                await stream.complete.wait()
                if not stream.reset:
                    delivered = True
                    return {"type": "http.request", "body": bytes(stream.body), "more_body": False}
            await stream.closed.wait()
            return {"type": "http.disconnect"}

        async def send(message: _Message) -> None:
            if stream.reset or self.closed:
                return
            try:
                if message["type"] == "http.response.start":
                    headers = [(b":status", str(message["status"]).encode("ascii"))]
                    headers += [(bytes(k).lower(), bytes(v)) for k, v in message["headers"]]
                    self.conn.send_headers(stream.id, headers)
                    self.flush()
                elif message["type"] == "http.response.body":
                    more = bool(message.get("more_body", False))
                    await self._send_data(stream, bytes(message.get("body", b"")), end=not more)
            except (h2.exceptions.ProtocolError, ConnectionError):
                stream.reset = True

        try:
            await self.app(scope, receive, send)
        except Exception:
            logger.exception("EmbeddingServer (raw HTTP/2) app failed")
            if not stream.reset and not self.closed:
                self._reset(stream, h2.errors.ErrorCodes.INTERNAL_ERROR)
                self.flush()
        finally:
            self.streams.pop(stream.id, None)
            stream.closed.set()
            if not self.closed:
                self._maybe_goaway()
                self._arm_idle()

    async def _send_data(self, stream: _Stream, data: bytes, *, end: bool) -> None:
        view = memoryview(data)
        while view:
            if stream.reset or self.closed:
                raise ConnectionError("stream closed")
            window = min(
                self.conn.local_flow_control_window(stream.id), self.conn.max_outbound_frame_size
            )
            if window <= 0:
                self.window_open.clear()
                await self.window_open.wait()
                continue
            self.conn.send_data(stream.id, bytes(view[:window]))
            view = view[window:]
            self.flush()
        if end:
            self.conn.end_stream(stream.id)
            self.flush()


async def serve_h2(
    app: _EmbeddingApp,
    sock: _ListenSocket,
    tls: _TLSFiles | None,
    ready: Callable[[], None],
    stop: asyncio.Event,
) -> None:
    """Serve ``app`` over HTTP/2 only on ``sock`` until ``stop`` is set; then GOAWAY every
    connection, give requests in flight up to 3 s, and close."""
    context: ssl.SSLContext | None = None
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tls.chain, tls.key)
        context.set_alpn_protocols(["h2"])
    runner = _Runner(app, secure=context is not None)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _H2Protocol(runner), sock=sock, ssl=context, backlog=_BACKLOG
    )
    ready()
    try:
        await stop.wait()
    finally:
        server.close()
        for protocol in list(runner.protocols):
            protocol._goaway()
        if runner.tasks:
            _, pending = await asyncio.wait(list(runner.tasks), timeout=_GRACEFUL_SHUTDOWN)
            for task in pending:
                task.cancel()
        for protocol in list(runner.protocols):
            protocol.abort(reset=True)  # TLS too: no close_notify exchange left pending
        await asyncio.sleep(0)  # let the transports run connection_lost
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), _GRACEFUL_SHUTDOWN)
