"""`HostileServer(http2=True)`: the hostile kinds over HTTP/2 (TLS, ALPN ``h2`` only).

Frames are built by ``h2`` (public API, outbound header validation off so that a
malformed or missing ``:status`` can be sent) and written on the raw asyncio stream, so
a frame can be trickled byte by byte. Each kind maps to its HTTP/2 form:

* ``trickle``: the bytes of the HEADERS (padded to ~200 bytes) and DATA frames
  (``headers``) or of the DATA frames only, one per ``interval``;
* ``trickle_chunked``: ``part="size"``: the 9-byte DATA frame header (HTTP/2's chunk
  size) one byte per ``interval``; ``part="trailer"``: a trailing HEADERS frame so;
* ``huge_content_length`` / ``endless_chunked``: DATA frames until the client resets the
  stream (with / without ``content-length``), flow control respected;
* ``status_line``: the final HEADERS with ``:status`` = ``code`` (``None``: none at all);
* ``echo_auth``: ``where="status"`` and ``"status_line"`` put the value in ``:status``;
  ``"chunk_size"`` in ``content-length`` (HTTP/2 frames its body by itself);
  ``"header_line"`` as a header's name; the other places as over HTTP/1.1;
* ``truncated_encoding``: as over HTTP/1.1 (the cut body, its ``content-length``);
* ``interim``: an informational HEADERS frame, then the answer;
* ``stray_response`` and ``redirect`` answer as ``ok`` / as over HTTP/1.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import Any, Final

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import orjson

from ._common import _PREFIX, _gzip_bomb, _transform
from ._hostile import truncated
from ._loop import header

_IDLE: Final = 30.0
_MAX_BODY: Final = 64 * 1024 * 1024
_ERROR: Final = b'{"error":{"message":"internal error","type":"server_error","code":null}}'


class _Conn:
    """One HTTP/2 connection of a `HostileServer`."""

    def __init__(
        self, server: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        config = h2.config.H2Configuration(
            client_side=False,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
        self.server = server
        self.conn = h2.connection.H2Connection(config=config)
        self.reader = reader
        self.writer = writer
        self.lock = asyncio.Lock()  # one writer of frames at a time
        self.window = asyncio.Event()
        self.bodies: dict[int, tuple[list[tuple[str, str]], bytearray]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.closing = False

    async def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.writer.write(data)
            self.server._counters.add("bytes_sent", len(data))
            await self.writer.drain()

    async def trickle(self, interval: float) -> bool:
        """Write what h2 has queued one byte per ``interval``; False when cut short."""
        data = self.conn.data_to_send()
        deadline = time.monotonic() + self.server.max_seconds
        for i in range(len(data)):
            if time.monotonic() >= deadline or self.stopping():
                return False
            self.writer.write(data[i : i + 1])
            self.server._counters.add("bytes_sent", 1)
            self.server._counters.add("trickled")
            await self.writer.drain()
            await asyncio.sleep(interval)
        return True

    def queue_data(self, sid: int, data: bytes, *, end: bool) -> None:
        """Queue a small ``data`` (within the flow-control window) in frame-size pieces."""
        size = self.conn.max_outbound_frame_size
        for start in range(0, len(data), size):
            last = start + size >= len(data)
            self.conn.send_data(sid, data[start : start + size], end_stream=end and last)

    def stopping(self) -> bool:
        return self.closing or self.server._server.stopping()

    async def run(self) -> None:
        self.conn.initiate_connection()
        await self.flush()
        try:
            while not self.stopping():
                data = await asyncio.wait_for(self.reader.read(65536), _IDLE)
                if not data:
                    return
                try:
                    events = self.conn.receive_data(data)
                except h2.exceptions.ProtocolError:
                    return
                for event in events:
                    self.event(event)
                async with self.lock:
                    await self.flush()
        finally:
            self.closing = True
            self.window.set()
            for task in list(self.tasks):
                task.cancel()
            if self.tasks:
                await asyncio.gather(*self.tasks, return_exceptions=True)

    def event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            raw = event.headers or []
            headers = [(bytes(k).decode("latin-1"), bytes(v).decode("latin-1")) for k, v in raw]
            self.bodies[event.stream_id or 0] = (headers, bytearray())
        elif isinstance(event, h2.events.DataReceived):
            sid = event.stream_id or 0
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.conn.acknowledge_received_data(event.flow_controlled_length or 0, sid)
            if sid in self.bodies and len(self.bodies[sid][1]) < _MAX_BODY:
                self.bodies[sid][1].extend(event.data or b"")
        elif isinstance(event, h2.events.StreamEnded):
            sid = event.stream_id or 0
            if sid in self.bodies:
                headers, body = self.bodies.pop(sid)
                task = asyncio.get_running_loop().create_task(
                    self.answer(sid, headers, bytes(body))
                )
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        elif isinstance(event, h2.events.StreamReset):
            self.bodies.pop(event.stream_id or 0, None)
            self.window.set()
        elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            self.window.set()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.closing = True

    async def send_data(self, sid: int, data: bytes, *, end: bool) -> bool:
        """``data`` under flow control; False when the stream or connection is gone."""
        view = memoryview(data)
        while view:
            if self.stopping():
                return False
            try:
                window = min(
                    self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size
                )
            except h2.exceptions.StreamClosedError:
                return False
            if window <= 0:
                self.window.clear()
                await self.window.wait()
                continue
            async with self.lock:
                try:
                    self.conn.send_data(sid, bytes(view[:window]))
                except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                    return False
                await self.flush()
            view = view[window:]
        if end:
            async with self.lock:
                with contextlib.suppress(h2.exceptions.ProtocolError):
                    self.conn.end_stream(sid)
                await self.flush()
        return True

    async def headers(self, sid: int, fields: list[tuple[str, str]], *, end: bool = False) -> None:
        async with self.lock:
            self.conn.send_headers(sid, [(k.encode(), v.encode("latin-1")) for k, v in fields])
            if end:
                self.conn.end_stream(sid)
            await self.flush()

    async def answer(self, sid: int, headers: list[tuple[str, str]], body: bytes) -> None:
        server = self.server
        path = (header(headers, ":path") or "/").split("?", 1)[0]
        server._counters.add("requests")
        server._counters.add("paths", key=path)
        kind, params = server.kind, server.params
        if path.startswith("/redirected/") or not server._targets(path):
            kind, params = "ok", {}
        server._counters.add("kinds", key=kind)
        status, doc = server._valid(path.removeprefix("/redirected"), body)
        valid = orjson.dumps(doc)
        plain = [("content-type", "application/json"), ("content-length", str(len(valid)))]
        try:
            await self._answer(sid, kind, params, headers, path, status, valid, plain)
        except (h2.exceptions.ProtocolError, ConnectionError):
            return

    async def _answer(
        self,
        sid: int,
        kind: str,
        params: Mapping[str, Any],
        headers: list[tuple[str, str]],
        path: str,
        status: int,
        valid: bytes,
        plain: list[tuple[str, str]],
    ) -> None:
        ok = [(":status", str(status)), *plain]
        if kind == "silent":
            deadline = time.monotonic() + self.server.max_seconds
            while time.monotonic() < deadline and not self.stopping():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        elif kind == "drop":
            self.closing = True
            self.writer.transport.abort()
        elif kind == "trickle":
            # HPACK makes a head small: padded to ~200 bytes, as long as an HTTP/1.1 one
            padded = [*ok, ("x-padding", "p" * 256)] if params["headers"] else ok
            async with self.lock:
                self.conn.send_headers(sid, _encode(padded))
                if not params["headers"]:
                    await self.flush()
                self.queue_data(sid, valid, end=True)
                await self.trickle(params["interval"])
        elif kind == "trickle_chunked":
            async with self.lock:
                self.conn.send_headers(sid, _encode([(":status", str(status)), plain[0]]))
                if params["part"] == "size":
                    await self.flush()
                    self.queue_data(sid, valid, end=True)
                    head = self.conn.data_to_send()  # the DATA frame: 9-byte header first
                    for i in range(9):
                        if self.stopping():
                            return
                        self.writer.write(head[i : i + 1])
                        self.server._counters.add("trickled")
                        await self.writer.drain()
                        await asyncio.sleep(params["interval"])
                    self.writer.write(head[9:])
                    await self.writer.drain()
                else:
                    self.queue_data(sid, valid, end=False)
                    await self.flush()
                    self.conn.send_headers(sid, [(b"x-trailer", b"t" * 64)], end_stream=True)
                    await self.trickle(params["interval"])
        elif kind in ("huge_content_length", "endless_chunked"):
            fields = [(":status", "200"), ("content-type", "application/json")]
            if kind == "huge_content_length":
                fields.append(("content-length", str(params["declared"])))
            await self.headers(sid, fields)
            sent, limit = 0, self.server.max_bytes
            deadline = time.monotonic() + self.server.max_seconds
            piece = _PREFIX
            while sent < limit and time.monotonic() < deadline:
                if not await self.send_data(sid, piece, end=False):
                    return
                sent += len(piece)
                piece = b" " * 65536
        elif kind == "truncated_encoding":
            cut = truncated(valid, params["encoding"])
            fields = [(":status", "200"), ("content-type", "application/json")]
            fields += [("content-encoding", params["encoding"]), ("content-length", str(len(cut)))]
            await self.headers(sid, fields)
            await self.send_data(sid, cut, end=True)
        elif kind == "gzip_bomb":
            blob = _gzip_bomb(params["inflated"])
            fields = [(":status", "200"), ("content-type", "application/json")]
            fields += [("content-encoding", "gzip"), ("content-length", str(len(blob)))]
            await self.headers(sid, fields)
            await self.send_data(sid, blob, end=True)
        elif kind == "interim":
            await self.headers(sid, [(":status", str(params["status"])), ("link", "</s.css>")])
            await self.headers(sid, ok)
            await self.send_data(sid, valid, end=True)
        elif kind == "status_line":
            code = params["code"]
            first = [] if code is None else [(":status", str(code))]
            await self.headers(sid, [*first, *plain])
            await self.send_data(sid, valid, end=True)
        elif kind == "echo_auth":
            await self._echo(sid, params, headers)
        elif kind == "redirect":
            location = params["location"] or f"{self.server.url}/redirected{path}"
            fields = [(":status", str(params["status"])), ("location", location)]
            await self.headers(sid, [*fields, ("content-length", "2")])
            await self.send_data(sid, b"{}", end=True)
        elif kind == "error_200":
            error = {"message": params["message"], "type": params["type"], "code": params["code"]}
            data = orjson.dumps({"error": error})
            await self.headers(sid, [(":status", "200"), ("content-length", str(len(data)))])
            await self.send_data(sid, data, end=True)
        else:  # ok and the kinds whose HTTP/2 form is a valid answer
            await self.headers(sid, ok)
            await self.send_data(sid, valid, end=True)

    async def _echo(
        self, sid: int, params: Mapping[str, Any], headers: list[tuple[str, str]]
    ) -> None:
        value = _transform(header(headers, "authorization") or "", params["transform"])
        where = params["where"]
        length = ("content-length", str(len(_ERROR)))
        if where in ("status", "status_line", "chunk_size", "header_line"):
            first = (":status", value if where in ("status", "status_line") else "500")
            if where == "chunk_size":
                length = ("content-length", value)
            extra = [(value.lower(), "x")] if where == "header_line" else []
            await self.headers(sid, [first, length, *extra])
            await self.send_data(sid, _ERROR, end=True)
            return
        if where == "content_encoding":
            data = b'{"object":"list"}'
            fields = [(":status", "200"), ("content-encoding", value)]
            await self.headers(sid, [*fields, ("content-length", str(len(data)))])
            await self.send_data(sid, data, end=True)
            return
        in_body = where in ("body", "both")
        status = params["status"] or (200 if in_body else 500)
        extra = [("x-request-id", value)] if where in ("header", "both") else []
        data = (
            f"upstream error: unexpected credentials {value}\n".encode("latin-1", "replace")
            if in_body
            else _ERROR
        )
        kind = "text/plain" if in_body else "application/json"
        fields = [(":status", str(status)), ("content-type", kind), *extra]
        await self.headers(sid, [*fields, ("content-length", str(len(data)))])
        await self.send_data(sid, data, end=True)


def _encode(fields: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode("latin-1")) for k, v in fields]


async def serve_h2(server: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Serve one HTTP/2 connection of ``server`` until it ends or the server stops."""
    await _Conn(server, reader, writer).run()
