"""The raw HTTP/2 server of `EmbeddingServer` (``h2_only``, ``goaway_after``), checked
frame by frame with a socket and hyperframe/hpack (not the project's client)."""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import h2.config
import h2.connection
import hpack
import httpx
import numpy as np
import pytest
from hyperframe.frame import (
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    RstStreamFrame,
)

from qwen_embed_tooling.testing import EmbeddingServer, expected_embeddings

REFUSED_STREAM = 7
DIM = 8  # small answers: no flow-control window updates needed by the raw client


class RawH2:
    """A prior-knowledge (or ALPN h2) client that sends with h2 and reads raw frames, so
    it can see frames that h2's own state machine would refuse after a GOAWAY."""

    def __init__(self, server: EmbeddingServer) -> None:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        if server.url.startswith("https"):
            context = server.ssl_context()
            context.set_alpn_protocols(["h2"])
            sock = context.wrap_socket(sock, server_hostname="127.0.0.1")
            assert isinstance(sock, ssl.SSLSocket)
            assert sock.selected_alpn_protocol() == "h2"
        self.sock = sock
        self.scheme = "https" if server.url.startswith("https") else "http"
        self.authority = f"127.0.0.1:{server.port}"
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.decoder = hpack.Decoder()
        self.buffer = b""
        self.frames: list[Frame] = []

    def send_embeddings(self, count: int) -> list[int]:
        """Open ``count`` streams at once, each embedding ``["s<i>"]``; their ids."""
        ids = []
        for i in range(count):
            stream_id = self.conn.get_next_available_stream_id()
            body = json.dumps({"input": [f"s{i}"], "model": "m"}).encode()
            self.conn.send_headers(
                stream_id,
                [
                    (":method", "POST"),
                    (":path", "/v1/embeddings"),
                    (":scheme", self.scheme),
                    (":authority", self.authority),
                    ("content-type", "application/json"),
                    ("content-length", str(len(body))),
                ],
            )
            self.conn.send_data(stream_id, body, end_stream=True)
            ids.append(stream_id)
        self.sock.sendall(self.conn.data_to_send())
        return ids

    def read_until_closed(self) -> list[Frame]:
        """Every frame until the server closes the connection."""
        while data := self.sock.recv(65536):
            self.buffer += data
            while len(self.buffer) >= 9:
                frame, length = Frame.parse_frame_header(memoryview(self.buffer[:9]))
                if len(self.buffer) < 9 + length:
                    break
                frame.parse_body(memoryview(self.buffer[9 : 9 + length]))
                self.buffer = self.buffer[9 + length :]
                self.frames.append(frame)
        return self.frames

    def answers(self) -> dict[int, tuple[int, bytes]]:
        """stream id -> (status, body) for the streams answered in full."""
        status: dict[int, int] = {}
        bodies: dict[int, bytes] = {}
        done: set[int] = set()
        for frame in self.frames:
            if isinstance(frame, HeadersFrame):
                headers = dict(self.decoder.decode(frame.data))
                status[frame.stream_id] = int(headers[":status"])
                bodies.setdefault(frame.stream_id, b"")
            elif isinstance(frame, DataFrame):
                bodies[frame.stream_id] += frame.data
            if isinstance(frame, HeadersFrame | DataFrame) and "END_STREAM" in frame.flags:
                done.add(frame.stream_id)
        return {sid: (status[sid], bodies[sid]) for sid in done}

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw() -> Iterator[list[RawH2]]:
    clients: list[RawH2] = []
    yield clients
    for client in clients:
        client.close()


def kinds(frames: list[Frame]) -> list[str]:
    return [type(f).__name__ for f in frames if type(f) is not DataFrame]


def check_answers(client: RawH2, stream_ids: list[int]) -> None:
    answers = client.answers()
    assert sorted(answers) == stream_ids
    for i, stream_id in enumerate(stream_ids):
        status, body = answers[stream_id]
        assert status == 200
        vector = json.loads(body)["data"][0]["embedding"]
        assert np.array_equal(
            np.asarray(vector, dtype=np.float32), expected_embeddings([f"s{i}"], DIM)[0]
        )


@pytest.mark.parametrize("tls", [False, True])
def test_graceful_goaway_refuses_streams_still_in_flight(raw: list[RawH2], tls: bool) -> None:
    with EmbeddingServer(http2=True, tls=tls, dim=DIM, goaway_after=3, latency=0.1) as server:
        client = RawH2(server)
        raw.append(client)
        ids = client.send_embeddings(5)  # 1, 3, 5 answered; 7, 9 in flight when GOAWAY comes
        frames = client.read_until_closed()
        goaways = [f for f in frames if isinstance(f, GoAwayFrame)]
        assert [(g.last_stream_id, g.error_code) for g in goaways] == [(ids[2], 0)]
        check_answers(client, ids[:3])  # the later streams got nothing at all
        first_goaway = frames.index(goaways[0])
        assert all(not isinstance(f, HeadersFrame) for f in frames[first_goaway:])
        stats = server.stats()
        assert stats["faults_applied"] == {"refused_stream": 2, "goaway": 1}
        assert (stats["requests"], stats["responses"]) == (3, {"200": 3})


def test_early_goaway_comes_before_the_answers_it_still_sends(raw: list[RawH2]) -> None:
    with EmbeddingServer(
        http2=True, dim=DIM, goaway_after=2, goaway_mode="early", latency=0.2
    ) as server:
        client = RawH2(server)
        raw.append(client)
        ids = client.send_embeddings(4)
        frames = client.read_until_closed()
        order = kinds(frames)
        assert order.count("GoAwayFrame") == 1
        goaway = next(f for f in frames if isinstance(f, GoAwayFrame))
        assert goaway.last_stream_id == ids[1]
        assert order.index("GoAwayFrame") < order.index("HeadersFrame")  # streams in flight
        check_answers(client, ids[:2])
        assert server.stats()["faults_applied"] == {"refused_stream": 2, "goaway": 1}


@pytest.mark.parametrize("tls", [False, True])
def test_refused_stream_resets_then_goaway(raw: list[RawH2], tls: bool) -> None:
    with EmbeddingServer(
        http2=True, tls=tls, dim=DIM, goaway_after=2, goaway_mode="refuse", latency=0.1
    ) as server:
        client = RawH2(server)
        raw.append(client)
        ids = client.send_embeddings(4)
        frames = client.read_until_closed()
        resets = [f for f in frames if isinstance(f, RstStreamFrame)]
        assert [(r.stream_id, r.error_code) for r in resets] == [
            (ids[2], REFUSED_STREAM),
            (ids[3], REFUSED_STREAM),
        ]
        check_answers(client, ids[:2])
        goaways = [f for f in frames if isinstance(f, GoAwayFrame)]
        assert [g.last_stream_id for g in goaways] == [ids[1]]
        assert frames.index(goaways[0]) > frames.index(resets[-1])
        assert server.stats()["faults_applied"] == {"refused_stream": 2, "goaway": 1}


def test_goaway_after_n_sequential_streams_then_a_new_connection_works() -> None:
    with (
        EmbeddingServer(http2=True, dim=DIM, goaway_after=2) as server,
        httpx.Client(base_url=server.base_url, http1=False, http2=True) as c,
    ):
        for i in range(6):  # httpx reads each GOAWAY between requests: nothing is lost
            r = c.post("/embeddings", json={"input": [f"s{i}"]})
            assert r.status_code == 200
            assert r.http_version == "HTTP/2"
        server.wait_for("connections_opened", 3, timeout=60)
        assert server.stats()["faults_applied"].get("goaway", 0) >= 2


@pytest.mark.parametrize("tls", [False, True])
def test_h2_only_server_refuses_http11(tls: bool) -> None:
    with EmbeddingServer(http2=True, h2_only=True, tls=tls, dim=DIM) as server:
        verify: Any = server.ssl_context() if tls else True
        with httpx.Client(base_url=server.base_url, http1=False, http2=True, verify=verify) as c:
            texts = [f"t{i}" for i in range(300)]  # ~ 60 KB: flow control across frames
            r = c.post("/embeddings", json={"input": texts})
            assert (r.status_code, r.http_version) == (200, "HTTP/2")
            got = np.asarray([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
            assert np.array_equal(got, expected_embeddings(texts, DIM))
            assert c.get("/models").status_code == 200
        # in clear text the refusal is a plain close (never a reset, however the request's
        # segments arrive); asyncio's TLS transport cannot half-close, so there a reset can
        # still win the race
        refused: Any = (
            (httpx.RemoteProtocolError, httpx.ConnectError, httpx.ReadError)
            if tls
            else httpx.RemoteProtocolError
        )
        with pytest.raises(refused):
            httpx.post(f"{server.base_url}/embeddings", json={"input": ["a"]}, verify=verify)
        if not tls:
            with pytest.raises(httpx.RemoteProtocolError):  # h2c by Upgrade is HTTP/1.1 too
                httpx.post(
                    f"{server.base_url}/embeddings",
                    json={"input": ["a"]},
                    headers={"Connection": "Upgrade, HTTP2-Settings", "Upgrade": "h2c"},
                )
            assert server.stats()["faults_applied"] == {"h1_refused": 2}


def test_raw_h2_server_applies_faults_and_rules() -> None:
    with (
        EmbeddingServer(http2=True, h2_only=True, dim=DIM) as server,
        httpx.Client(base_url=server.base_url, http1=False, http2=True) as c,
    ):
        server.inject_status(503)
        assert c.post("/embeddings", json={"input": ["a"]}).status_code == 503
        server.poison("p")
        assert c.post("/embeddings", json={"input": ["a", "p"]}).status_code == 500
        server.clear_rules()
        server.inject("close")
        with pytest.raises(httpx.RemoteProtocolError):
            c.post("/embeddings", json={"input": ["a"]})
        assert c.post("/embeddings", json={"input": ["a"]}).status_code == 200
        assert server.connections_opened == 2
        assert server.stats()["responses"] == {"503": 1, "500": 1, "close": 1, "200": 1}
