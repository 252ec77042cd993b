"""A huge HTTP/2 response head is bounded like every other path's: a head of a million
headers (one HEADERS frame and 61 full CONTINUATION frames of one-byte indexed fields,
the most a client's 16 KiB frames let through) ends in a ``RemoteProtocolError`` once the
decoded header list passes 64 KiB (the ``SETTINGS_MAX_HEADER_LIST_SIZE`` the HTTP/2
client advertises, which h2 enforces while decoding), on the sync and async HTTP/2
paths and ``openai_client()``, and the connection is closed. Behaviour, not the
machine's memory: the decoded list never grows past the bound, so neither does the
memory a call holds. (A reliance on httpcore and h2: docs/reliability.md, "What the
library relies on".)"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import qwen_embed_plugins as q

HEADERS = 1_000_000
FRAME = 16384  # bytes: the client's SETTINGS_MAX_FRAME_SIZE (h2's default)


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    head = struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream)
    return head + payload


def huge_head(stream: int) -> bytes:
    """``:status 200``, one literal field added to the HPACK table, then a million
    one-byte references to it (index 62), cut into frames of ``FRAME`` bytes."""
    block = b"\x88" + b"\x40\x03x-h\x01v" + b"\xbe" * HEADERS
    parts = [block[i : i + FRAME] for i in range(0, len(block), FRAME)]
    frames = [_frame(0x1, 0x1, stream, parts[0])]  # HEADERS, END_STREAM
    for i, part in enumerate(parts[1:], 1):
        end = 0x4 if i == len(parts) - 1 else 0  # END_HEADERS on the last CONTINUATION
        frames.append(_frame(0x9, end, stream, part))
    return b"".join(frames)


class HugeHeadServer:
    """HTTPS on 127.0.0.1 with ALPN ``h2`` only (``tls=False``: prior-knowledge h2c, a
    server that does speak cleartext HTTP/2): each request stream gets ``huge_head``;
    ``closed`` counts connections the client closed."""

    def __init__(self, *, tls: bool = True) -> None:
        import h2.config
        import h2.connection
        import trustme

        self._h2 = (h2.config, h2.connection)
        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1")
        self.dir = tempfile.TemporaryDirectory()
        self.ca_path = str(Path(self.dir.name) / "ca.pem")
        ca.cert_pem.write_to_path(self.ca_path)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        cert.configure_cert(self.context)
        self.context.set_alpn_protocols(["h2"])
        self.sock = socket.create_server(("127.0.0.1", 0))
        scheme = "https" if tls else "http"
        self.tls = tls
        self.base_url = f"{scheme}://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.closed = threading.Semaphore(0)
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        config, connection = self._h2
        import h2.exceptions

        quits = (OSError, ssl.SSLError, h2.exceptions.ProtocolError)  # e.g. an HTTP/1.1 request
        with contextlib.suppress(*quits), contextlib.ExitStack() as stack:
            stack.callback(raw.close)  # closed whether or not the handshake succeeded
            conn = raw
            if self.tls:
                conn = stack.enter_context(self.context.wrap_socket(raw, server_side=True))
            h2 = connection.H2Connection(config.H2Configuration(client_side=False))
            h2.initiate_connection()
            conn.sendall(h2.data_to_send())
            while data := conn.recv(65536):
                for event in h2.receive_data(data):
                    stream = getattr(event, "stream_id", 0)
                    if type(event).__name__ == "RequestReceived":
                        conn.sendall(h2.data_to_send() + huge_head(stream))
                conn.sendall(h2.data_to_send())
        self.closed.release()  # the client closed (or reset) the connection

    def stop(self) -> None:
        self.sock.close()
        self.dir.cleanup()


@pytest.fixture(params=["tls", "h2c"])
def huge(request: pytest.FixtureRequest) -> Iterator[HugeHeadServer]:
    q.close_all()
    server = HugeHeadServer(tls=request.param == "tls")
    try:
        yield server
    finally:
        q.close_all()
        server.stop()


def _call(path: str, server: HugeHeadServer) -> Any:
    opts: dict[str, Any] = {
        "base_url": server.base_url,
        "verify": server.ca_path,
        "http2": True,
        "retry": q.RetryConfig(max_attempts=1, deadline=30.0),
    }
    try:
        if path == "h2_sync":
            return q.EmbeddingClient(**opts).embed_query("x")
        if path == "h2_async":
            return asyncio.run(q.AsyncEmbeddingClient(**opts).embed_query("x"))
        sdk = q.EmbeddingClient(**opts).openai_client()
        return sdk.embeddings.create(input=["x"], model="m")
    except Exception as exc:
        return exc


@pytest.mark.parametrize("path", ["h2_sync", "h2_async", "h2_sdk_sync"])
def test_a_million_header_http2_head_is_refused_at_the_header_list_bound(
    huge: HugeHeadServer, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Over h2c too: the server answered in HTTP/2 (a broken head is an answer), so the
    client never gives h2c up for HTTP/1.1 (which this server would never answer)."""
    outcome = _call(path, huge)
    assert "does not speak cleartext HTTP/2" not in caplog.text
    if path == "h2_sdk_sync":
        import openai

        assert isinstance(outcome, openai.APIConnectionError), repr(outcome)
        outcome = outcome.__cause__.__cause__ if outcome.__cause__ is not None else None
    assert isinstance(outcome, q.RemoteProtocolError), repr(outcome)
    assert "header list larger than 65536" in str(outcome), str(outcome)
    assert outcome.received  # the server's broken answer, not a dropped connection
    q.close_all()
    assert huge.closed.acquire(timeout=60.0)  # the connection was closed, not kept
