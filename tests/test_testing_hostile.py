"""`qwen_embed_tooling.testing.HostileServer`, checked with raw sockets and http.client:
each hostile behaviour really happens on the wire, bounded, and stops cleanly."""

from __future__ import annotations

import http.client
import json
import socket
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from qwen_embed_tooling.testing import HOSTILE_KINDS, HostileServer, expected_embeddings

DIM = 16
KEY = "Bearer sk-test-0123456789abcdef"
_OPEN: list[http.client.HTTPConnection] = []  # closed after each test


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileServer]:
    with HostileServer(dim=DIM) as server:
        yield server


@pytest.fixture
def h(hostile: HostileServer) -> Iterator[HostileServer]:
    hostile.set("ok")
    hostile.reset_counters()
    yield hostile
    hostile.set("ok")
    while _OPEN:
        _OPEN.pop().close()


def request(
    server: HostileServer,
    path: str = "/v1/embeddings",
    texts: Any = ("a", "b"),
    headers: dict[str, str] | None = None,
    method: str = "POST",
) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    _OPEN.append(conn)
    body = json.dumps({"input": list(texts), "model": "m"}) if method == "POST" else None
    conn.request(
        method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})}
    )
    return conn.getresponse()


def raw_request(texts: list[str], path: str = "/v1/embeddings") -> bytes:
    body = json.dumps({"input": texts}).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def read_response(sock: socket.socket, buffer: bytearray) -> tuple[bytes, bytes]:
    """One Content-Length-framed response from ``sock`` (``buffer`` keeps what follows)."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        assert chunk, "closed before a response head"
        buffer += chunk
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    length = int(
        next(
            v
            for k, v in (line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
            if k.lower() == b"content-length"
        )
    )
    buffer[:] = rest
    while len(buffer) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed inside a response body"
        buffer += chunk
    body = bytes(buffer[:length])
    del buffer[:length]
    return head, body


def vectors(body: bytes) -> np.ndarray:
    return np.asarray([d["embedding"] for d in json.loads(body)["data"]], dtype=np.float32)


def test_ok_answers_are_valid(h: HostileServer) -> None:
    r = request(h)
    assert r.status == 200
    assert np.array_equal(vectors(r.read()), expected_embeddings(["a", "b"], DIM))
    assert h.stats()["kinds"] == {"ok": 1}


def test_huge_content_length_streams_until_the_client_closes(h: HostileServer) -> None:
    h.set("huge_content_length")
    with socket.create_connection(("127.0.0.1", h.port), timeout=60) as sock:
        sock.sendall(raw_request(["a"]))
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        assert b"Content-Length: 2147483648" in head
        while len(body) < 4 * 1024**2:  # it keeps coming, as fast as we read
            body += sock.recv(1024**2)
        assert body.startswith(b'{"object":"list","data":[')
    h.wait_for("connections_active", 0, timeout=60, at_most=True)  # stopped writing
    assert 4 * 1024**2 <= h.stats()["bytes_sent"] < 2 * 1024**3


def test_endless_chunked_body_also_on_models(h: HostileServer) -> None:
    h.set("endless_chunked", on="models")
    r = request(h)  # embeddings are answered normally
    assert np.array_equal(vectors(r.read()), expected_embeddings(["a", "b"], DIM))
    r = request(h, "/v1/models", method="GET")
    assert r.getheader("Transfer-Encoding") == "chunked"
    got = 0
    while got < 4 * 1024**2:
        got += len(r.read1(1024**2))  # decoded chunks: never a last chunk
    assert not r.isclosed()
    r.close()
    assert h.stats()["kinds"] == {"ok": 1, "endless_chunked": 1}


def test_gzip_bomb_is_small_and_inflates_past_a_gigabyte(h: HostileServer) -> None:
    h.set("gzip_bomb")
    r = request(h)
    assert r.getheader("Content-Encoding") == "gzip"
    compressed = r.read()
    assert len(compressed) < 2 * 1024**2
    inflater = zlib.decompressobj(31)
    total = 0
    data = compressed
    first = b""
    while data and total <= 1024**3:  # bounded memory: 1 MiB out per step
        out = inflater.decompress(data, 1024**2)
        first = first or out[:25]
        total += len(out)
        data = inflater.unconsumed_tail
    assert total > 1024**3
    assert first == b'{"object":"list","data":['


def test_trickle_sends_a_valid_answer_a_byte_at_a_time() -> None:
    with HostileServer("trickle", interval=0.01, dim=2) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
            sock.sendall(raw_request(["a"]))
            pieces = []
            data = b""
            while True:
                piece = sock.recv(65536)
                pieces.append(piece)
                data += piece
                head, _, body = data.partition(b"\r\n\r\n")
                if body and len(body) >= int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]):
                    break
        assert len(pieces) > 5  # a byte at a time, not in one piece
        assert np.array_equal(vectors(body), expected_embeddings(["a"], 2))


@pytest.mark.parametrize(
    ("transform", "echoed"),
    [
        ("exact", KEY),
        ("upper", KEY.upper()),
        ("lower", KEY.lower()),
        ("truncate", KEY[:-4]),
        ("bare", KEY.removeprefix("Bearer ")),
    ],
)
def test_echo_auth_in_a_non_json_body_and_in_x_request_id(
    h: HostileServer, transform: str, echoed: str
) -> None:
    h.set("echo_auth", transform=transform)
    r = request(h, headers={"Authorization": KEY})
    assert (r.status, r.getheader("Content-Type")) == (200, "text/plain")
    assert echoed in r.read().decode()
    h.set("echo_auth", transform=transform, where="header")
    r = request(h, headers={"Authorization": KEY})
    assert r.status == 500
    assert r.getheader("x-request-id") == echoed
    assert json.loads(r.read())["error"]["message"] == "internal error"


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_redirect_points_at_a_valid_answer_nobody_should_follow(
    h: HostileServer, status: int
) -> None:
    h.set("redirect", status=status)
    r = request(h)
    assert r.status == status
    location = r.getheader("Location")
    assert location == f"{h.url}/redirected/v1/embeddings"
    r.read()
    assert "/redirected/v1/embeddings" not in h.stats()["paths"]
    followed = request(h, "/redirected/v1/embeddings")  # what a follower would get
    assert np.array_equal(vectors(followed.read()), expected_embeddings(["a", "b"], DIM))
    assert h.stats()["paths"]["/redirected/v1/embeddings"] == 1


@pytest.mark.parametrize(
    ("kind", "check"),
    [
        ("error_200", lambda doc: doc["error"]["message"].startswith("The server had an error")),
        ("nested", lambda doc: isinstance(doc["data"][0]["embedding"][0], list)),
        ("string_components", lambda doc: isinstance(doc["data"][0]["embedding"][0], str)),
        ("bool_components", lambda doc: isinstance(doc["data"][0]["embedding"][0], bool)),
    ],
)
def test_malformed_200_bodies(h: HostileServer, kind: str, check: Any) -> None:
    h.set(kind)
    r = request(h)
    assert r.status == 200
    doc = json.loads(r.read())
    assert check(doc)
    if kind == "nested":
        got = np.asarray([d["embedding"][0] for d in doc["data"]], dtype=np.float32)
        assert np.array_equal(got, expected_embeddings(["a", "b"], DIM))


def test_html_200(h: HostileServer) -> None:
    h.set("html")
    r = request(h)
    assert (r.status, r.getheader("Content-Type")) == (200, "text/html; charset=utf-8")
    assert r.read().startswith(b"<!DOCTYPE html>")


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_stray_response_waits_on_the_keep_alive_socket(h: HostileServer, delay: float) -> None:
    h.set("stray_response", delay=delay)
    with socket.create_connection(("127.0.0.1", h.port), timeout=60) as sock:
        buffer = bytearray()
        sock.sendall(raw_request(["a", "b"]))
        head, body = read_response(sock, buffer)
        assert head.startswith(b"HTTP/1.1 200")
        assert np.array_equal(vectors(body), expected_embeddings(["a", "b"], DIM))
        h.wait_for("stray_sent", 1, timeout=30)
        head, stray = read_response(sock, buffer)  # nobody asked for this one
        assert head.startswith(b"HTTP/1.1 200")
        assert np.array_equal(vectors(stray), expected_embeddings(["stray 0", "stray 1"], DIM))
        sock.sendall(raw_request(["c", "d"]))  # the next answer is the real one, now late
        _, late = read_response(sock, buffer)
        assert np.array_equal(vectors(late), expected_embeddings(["c", "d"], DIM))
    assert h.stats()["stray_sent"] == 1  # once per connection


def test_streams_are_bounded_and_stop_ends_them() -> None:
    server = HostileServer("endless_chunked", max_seconds=120.0, max_bytes=256 * 1024, dim=DIM)
    with server, socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(raw_request(["a"]))
        got = b""
        while chunk := sock.recv(65536):  # ends at max_bytes: the server closes
            got += chunk
        assert 256 * 1024 <= len(got) < 300 * 1024
    with HostileServer("huge_content_length", dim=DIM) as server:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        sock.sendall(raw_request(["a"]))
        sock.recv(65536)
        server.wait_for("requests", 1)
    sock.close()  # stop() returned while the stream was still going: it ended it
    assert server.stats()["connections_opened"] == 1
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()


def test_kinds_and_parameters_are_validated() -> None:
    assert set(HOSTILE_KINDS) == {
        "ok",
        "huge_content_length",
        "endless_chunked",
        "gzip_bomb",
        "trickle",
        "echo_auth",
        "redirect",
        "error_200",
        "nested",
        "string_components",
        "bool_components",
        "html",
        "stray_response",
        "silent",
        "drop",
        "interim",
        "status_line",
        "trickle_chunked",
        "truncated_encoding",
    }
    with pytest.raises(ValueError, match="unknown kind"):
        HostileServer("nope")
    with pytest.raises(ValueError, match="takes no parameter"):
        HostileServer("html", interval=1)
    with pytest.raises(ValueError, match="redirect status"):
        HostileServer("redirect", status=200)
    with pytest.raises(ValueError, match="on must be"):
        HostileServer(on="ready")
    with pytest.raises(ValueError, match="encoding must be"):
        HostileServer("truncated_encoding", encoding="br")
    with pytest.raises(ValueError, match="loopback"):
        HostileServer(host="10.0.0.1")


# --------------------------------------------------------------------------- HTTP/2


def h2_exchange(
    server: HostileServer, path: str = "/v1/embeddings", reads: list[int] | None = None
) -> list[Any]:
    """One request on a fresh TLS connection (ALPN h2), read with ``h2`` (inbound header
    validation off, to see what was sent) until the stream ends or the server closes:
    the events of the stream (``reads``: gets the size of each read)."""
    import ssl

    import h2.config
    import h2.connection
    import h2.events

    context = ssl.create_default_context(cafile=server.ca_cert_path)
    context.set_alpn_protocols(["h2"])
    sock = context.wrap_socket(
        socket.create_connection(("127.0.0.1", server.port), timeout=30),
        server_hostname="127.0.0.1",
    )
    assert sock.selected_alpn_protocol() == "h2"
    config = h2.config.H2Configuration(client_side=True, validate_inbound_headers=False)
    conn = h2.connection.H2Connection(config)
    conn.initiate_connection()
    sid = conn.get_next_available_stream_id()
    body = json.dumps({"input": ["a", "b"], "model": "m"}).encode()
    fields = [(":method", "POST"), (":path", path), (":scheme", "https")]
    fields += [(":authority", "127.0.0.1"), ("authorization", KEY)]
    conn.send_headers(sid, fields)
    conn.send_data(sid, body, end_stream=True)
    sock.sendall(conn.data_to_send())
    events: list[Any] = []
    try:
        while data := sock.recv(65536):
            if reads is not None:
                reads.append(len(data))
            for event in conn.receive_data(data):
                if getattr(event, "stream_id", None) == sid:
                    events.append(event)
                if isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, sid)
                if isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    return events
            sock.sendall(conn.data_to_send())
    finally:
        sock.close()
    return events


def h2_heads(events: list[Any]) -> list[dict[bytes, bytes]]:
    return [dict(e.headers) for e in events if hasattr(e, "headers") and e.headers]


def test_http2_answers_are_valid_and_hostile_on_cue() -> None:
    """``http2=True``: TLS with ALPN h2 only; a valid answer, then a missing, a malformed
    and a key-holding ``:status``, and a 103 before the answer, as sent on the wire."""
    with HostileServer(dim=DIM, http2=True) as server:
        assert server.url.startswith("https://")
        events = h2_exchange(server)
        assert h2_heads(events)[0][b":status"] == b"200"
        data = b"".join(e.data for e in events if hasattr(e, "data") and e.data)
        got = [d["embedding"] for d in json.loads(data)["data"]]
        np.testing.assert_allclose(got, expected_embeddings(["a", "b"], DIM), atol=1e-6)

        server.set("status_line", code=None)
        assert b":status" not in h2_heads(h2_exchange(server))[0]
        server.set("status_line", code="-200")
        assert h2_heads(h2_exchange(server))[0][b":status"] == b"-200"
        server.set("echo_auth", where="status")
        assert h2_heads(h2_exchange(server))[0][b":status"] == KEY.encode()
        server.set("interim", status=103)
        heads = h2_heads(h2_exchange(server))
        assert [h[b":status"] for h in heads] == [b"103", b"200"]
        server.set("drop")
        assert h2_exchange(server) == []  # closed without an answer
        assert server.stats()["kinds"] == {
            "ok": 1,
            "status_line": 2,
            "echo_auth": 1,
            "interim": 1,
            "drop": 1,
        }


def test_http2_trickle_writes_the_head_a_byte_at_a_time() -> None:
    """``trickle`` with ``headers``: the HEADERS frame arrives one byte per interval (the
    client's reads see single bytes), and the answer is complete at the end."""
    with HostileServer(dim=2, http2=True, max_seconds=60) as server:
        server.set("trickle", headers=True, interval=0.001)
        reads: list[int] = []
        events = h2_exchange(server, reads=reads)
        assert h2_heads(events)[0][b":status"] == b"200"
        data = b"".join(e.data for e in events if hasattr(e, "data") and e.data)
        assert json.loads(data)["data"][0]["index"] == 0
        # after the server's preface: the HEADERS frame (9 bytes of frame header and
        # more) and the DATA frames, one byte per TLS record, so one per read
        assert reads.count(1) > 9 + len(data)
