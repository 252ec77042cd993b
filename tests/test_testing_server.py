"""`qwen_embed_tooling.testing.EmbeddingServer`, checked with plain httpx clients.

Nothing here uses the project's own client: these tests pin down what the server puts
on the wire, so the client tests can rely on it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import httpx
import numpy as np
import pytest

from qwen_embed_tooling.testing import (
    FAULT_KINDS,
    QUEUE_FULL_MESSAGE,
    EmbeddingServer,
    Fault,
    expected_embedding,
    expected_embeddings,
)

TEXTS = ["alpha", "beta", "gamma", "Instruct: find it\nQuery:delta", "ünïcødé ✓"]


def embed(client: httpx.Client, texts: Any, **body: Any) -> httpx.Response:
    return client.post("/embeddings", json={"input": texts, "model": "m", **body})


def vectors(response: httpx.Response) -> np.ndarray:
    data = response.json()["data"]
    rows = []
    for item in data:
        emb = item["embedding"]
        if isinstance(emb, str):
            rows.append(np.frombuffer(base64.b64decode(emb), dtype="<f4"))
        else:
            rows.append(np.asarray(emb, dtype=np.float32))
    return np.stack(rows)


def wait_until(predicate: Any, timeout: float = 5.0) -> None:
    """For the gauges (connections_active, in_flight) that drop just after the client."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def drain(response: httpx.Response, into: bytearray) -> None:
    """Read a streamed body chunk by chunk into ``into`` (kept if the read fails)."""
    for chunk in response.iter_raw():
        into += chunk


def error_body(status: int, message: str, err_type: str = "BadRequestError") -> dict[str, Any]:
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": status}


@pytest.fixture
def client(embedding_server: EmbeddingServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=embedding_server.base_url, timeout=10.0) as c:
        yield c


# ---- expected vectors ----------------------------------------------------------------


def test_expected_embedding_is_a_deterministic_unit_float32_vector() -> None:
    v = expected_embedding("hello")
    assert v.dtype == np.float32
    assert v.shape == (1024,)
    assert abs(float(np.linalg.norm(v.astype(np.float64))) - 1.0) < 1e-6
    assert np.array_equal(v, expected_embedding("hello"))
    assert not np.array_equal(v, expected_embedding("hello "))
    assert expected_embedding("hello", 64).shape == (64,)
    v[0] = 5.0  # a copy: the cache is untouched
    assert expected_embedding("hello")[0] != 5.0
    m = expected_embeddings(["a", "b"], 32)
    assert m.shape == (2, 32)
    assert np.array_equal(m[1], expected_embedding("b", 32))
    assert expected_embeddings([], 8).shape == (0, 8)


def test_expected_embedding_dimensions_is_the_renormalised_prefix() -> None:
    full = expected_embedding("text")
    short = expected_embedding("text", dimensions=128)
    assert short.shape == (128,)
    prefix = full[:128].astype(np.float64)
    assert np.allclose(short, prefix / np.linalg.norm(prefix), atol=1e-7)
    assert abs(float(np.linalg.norm(short.astype(np.float64))) - 1.0) < 1e-6
    assert expected_embeddings(["text"], dimensions=128).shape == (1, 128)


@pytest.mark.parametrize(
    ("args", "kwargs", "exc"),
    [
        ((1,), {}, TypeError),
        (("x", 0), {}, ValueError),
        (("x", 8), {"dimensions": 9}, ValueError),
        (("x", 8), {"dimensions": 0}, ValueError),
        (("x", 8), {"dimensions": True}, ValueError),
    ],
)
def test_expected_embedding_rejects_bad_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], exc: type[Exception]
) -> None:
    with pytest.raises(exc):
        expected_embedding(*args, **kwargs)


# ---- the embeddings endpoint ---------------------------------------------------------


@pytest.mark.parametrize("encoding", [None, "float", "base64"])
def test_bodies_decode_to_exactly_the_expected_vectors(
    client: httpx.Client, encoding: str | None
) -> None:
    body = {} if encoding is None else {"encoding_format": encoding}
    r = embed(client, TEXTS, **body)
    assert r.status_code == 200
    item = r.json()["data"][0]["embedding"]
    assert isinstance(item, str) == (encoding == "base64")
    assert np.array_equal(vectors(r), expected_embeddings(TEXTS))


def test_response_shape_for_a_single_string(
    client: httpx.Client, embedding_server: EmbeddingServer
) -> None:
    r = embed(client, "just one")
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["object"] == "list"
    assert body["model"] == embedding_server.model == "Qwen/Qwen3-Embedding-0.6B"
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0)]
    assert np.array_equal(vectors(r)[0], expected_embedding("just one"))


def test_many_texts_come_back_in_order_with_their_index(client: httpx.Client) -> None:
    texts = [f"text {i % 37}" for i in range(300)]
    r = embed(client, texts, encoding_format="base64")
    assert [d["index"] for d in r.json()["data"]] == list(range(300))
    assert np.array_equal(vectors(r), expected_embeddings(texts))


def test_dimensions_refused_without_matryoshka(client: httpx.Client) -> None:
    r = embed(client, ["a"], dimensions=256)
    assert r.status_code == 400
    assert r.json() == error_body(
        400,
        "Model 'Qwen/Qwen3-Embedding-0.6B' does not support matryoshka representation, "
        "changing output dimensions will lead to poor results.",
    )


def test_dimensions_truncated_and_renormalised_with_matryoshka() -> None:
    with EmbeddingServer(matryoshka=True, dim=512) as srv, httpx.Client(base_url=srv.base_url) as c:
        for encoding in ("float", "base64"):
            r = embed(c, TEXTS, dimensions=64, encoding_format=encoding)
            got = vectors(r)
            assert got.shape == (len(TEXTS), 64)
            assert np.array_equal(got, expected_embeddings(TEXTS, 512, dimensions=64))
            assert np.allclose(np.linalg.norm(got.astype(np.float64), axis=1), 1.0, atol=1e-6)
        assert vectors(embed(c, ["a"])).shape == (1, 512)
        too_big = embed(c, ["a"], dimensions=513)
        assert too_big.status_code == 400
        assert "greater than max embedding dimension: 512" in too_big.json()["message"]
        assert embed(c, ["a"], dimensions=0).json()["message"] == (
            "Requested dimensions must be greater than 0"
        )


@pytest.fixture(scope="module")
def limited() -> Iterator[httpx.Client]:
    with (
        EmbeddingServer(max_input_chars=10, max_batch=4) as srv,
        httpx.Client(base_url=srv.base_url) as c,
    ):
        yield c


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"input": []}, "Input cannot be empty"),
        ({"input": ""}, "Input cannot be empty"),
        ({"input": " \n\t"}, "Input cannot be empty or whitespace only"),
        ({"input": ["ok", "   "]}, "Input at index 1 cannot be empty or whitespace only"),
        ({"input": ["ok", ""]}, "Input at index 1 cannot be empty or whitespace only"),
        ({"input": ["ok", 7]}, "All items in input list must be strings (item at index 1 is int)"),
        (
            {"input": [None]},
            "All items in input list must be strings (item at index 0 is NoneType)",
        ),
        (
            {"input": ["ok", "x" * 11]},
            "The input at index 1 (11 characters) is longer than the model's context length "
            "(10 characters).",
        ),
        ({"input": ["a"] * 5}, "Batch size 5 is larger than the maximum batch size 4."),
    ],
)
def test_bad_input_gets_sglang_400_naming_the_index(
    limited: httpx.Client, payload: dict[str, Any], message: str
) -> None:
    r = limited.post("/embeddings", json=payload)
    assert r.status_code == 400
    assert r.json() == error_body(400, message)


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"[1, 2]",
        b'{"model": "m"}',
        b'{"input": 5}',
        b'{"input": ["a"], "encoding_format": "hex"}',
    ],
)
def test_malformed_requests_get_400(limited: httpx.Client, content: bytes) -> None:
    r = limited.post("/embeddings", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["object"] == "error"
    assert r.json()["code"] == 400


def test_models_health_and_unknown_paths(client: httpx.Client) -> None:
    models = client.get("/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"]) for m in models["data"]] == [
        ("Qwen/Qwen3-Embedding-0.6B", "model")
    ]
    assert client.get("../health").status_code == 200
    assert client.get("/nope").status_code == 404
    assert client.get("/embeddings").status_code == 405


def test_api_key_is_required_on_v1_but_not_on_health() -> None:
    with EmbeddingServer(api_key="sk-test") as srv, httpx.Client(base_url=srv.base_url) as c:
        assert "sk-test" not in repr(srv)
        missing = embed(c, ["a"])
        assert missing.status_code == 401
        assert missing.json() == {"error": "Unauthorized"}
        wrong = c.post(
            "/embeddings", json={"input": ["a"]}, headers={"Authorization": "Bearer nope"}
        )
        assert wrong.status_code == 401
        assert c.get("/models").status_code == 401
        assert c.get(f"{srv.url}/health").status_code == 200
        good = c.post(
            "/embeddings", json={"input": ["a"]}, headers={"Authorization": "Bearer sk-test"}
        )
        assert good.status_code == 200
        assert srv.stats()["responses"] == {"401": 2, "200": 1}


# ---- connections ---------------------------------------------------------------------


def test_connections_are_counted_exactly(embedding_server: EmbeddingServer) -> None:
    for _ in range(3):
        with httpx.Client(base_url=embedding_server.base_url) as c:
            assert embed(c, ["a"]).status_code == 200
    assert embedding_server.connections_opened == 3
    wait_until(lambda: embedding_server.connections_active == 0)
    embedding_server.reset_counters()
    with httpx.Client(base_url=embedding_server.base_url) as c:
        for i in range(10):
            assert embed(c, [f"t{i}"]).status_code == 200
        assert embedding_server.connections_active == 1
    stats = embedding_server.stats()
    assert stats["connections_opened"] == 1
    assert stats["requests"] == 10
    assert stats["texts"] == 10
    wait_until(lambda: embedding_server.connections_active == 0)


def test_idle_keep_alive_timeout_closes_idle_connections() -> None:
    with EmbeddingServer(keep_alive_timeout=0.5) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as raw:
            raw.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert raw.recv(4096).startswith(b"HTTP/1.1 200")
            started = time.monotonic()
            assert raw.recv(4096) == b""  # the server closed the idle connection
            assert time.monotonic() - started > 0.3  # kept at least the idle timeout
        with httpx.Client(base_url=srv.base_url) as c:
            embed(c, ["a"])
            embed(c, ["b"])
            wait_until(lambda: srv.connections_active == 0)  # the idle one was closed
            assert embed(c, ["c"]).status_code == 200
        assert srv.connections_opened == 3  # raw + two for the client


def test_max_requests_per_connection_closes_after_n() -> None:
    with (
        EmbeddingServer(max_requests_per_connection=3) as srv,
        httpx.Client(base_url=srv.base_url) as c,
    ):
        closes = [embed(c, ["a"]).headers.get("connection") for _ in range(7)]
        assert closes == [None, None, "close", None, None, "close", None]
        assert srv.connections_opened == 3


def test_close_connections_spares_busy_ones_when_asked() -> None:
    with EmbeddingServer(latency=0.5) as srv, httpx.Client(base_url=srv.base_url) as idle:
        embed(idle, ["a"])

        async def busy() -> int:
            async with httpx.AsyncClient(base_url=srv.base_url) as c:
                task = asyncio.ensure_future(c.post("/embeddings", json={"input": ["b"]}))
                await asyncio.to_thread(wait_until, lambda: srv.stats()["in_flight"] == 1)
                assert srv.close_connections(idle_only=True) == 1
                return (await task).status_code

        assert asyncio.run(busy()) == 200
        assert embed(idle, ["c"]).status_code == 200  # the pool reconnects
        assert srv.connections_opened == 3
        wait_until(lambda: srv.connections_active == 1)
        assert srv.close_connections() == 1


# ---- faults --------------------------------------------------------------------------


def test_status_fault_with_retry_after_headers(
    client: httpx.Client, embedding_server: EmbeddingServer
) -> None:
    embedding_server.inject("status", status=429, retry_after=2, retry_after_ms=1500)
    r = embed(client, ["a"])
    assert r.status_code == 429
    assert r.headers["retry-after"] == "2"
    assert r.headers["retry-after-ms"] == "1500"
    assert r.json() == error_body(429, "Too Many Requests", "429")
    assert embed(client, ["a"]).status_code == 200
    embedding_server.inject(
        "status", status=502, body=b"<html>bad gateway</html>", headers={"x-a": "b"}
    )
    r = embed(client, ["a"])
    assert (r.status_code, r.text, r.headers["x-a"]) == (502, "<html>bad gateway</html>", "b")


def test_overload_and_rate_limit_presets_apply_to_the_next_count_requests(
    client: httpx.Client, embedding_server: EmbeddingServer
) -> None:
    embedding_server.inject_overloaded(count=2, retry_after="Wed, 21 Oct 2015 07:28:00 GMT")
    embedding_server.inject_rate_limit(retry_after_ms=5)
    first, second, third, fourth = (embed(client, ["a"]) for _ in range(4))
    assert first.status_code == second.status_code == 503
    assert first.json() == error_body(503, QUEUE_FULL_MESSAGE, "503")
    assert first.headers["retry-after"] == "Wed, 21 Oct 2015 07:28:00 GMT"
    assert third.status_code == 429
    assert third.headers["retry-after-ms"] == "5"
    assert fourth.status_code == 200
    stats = embedding_server.stats()
    assert stats["faults_applied"] == {"status": 3}
    assert stats["responses"] == {"503": 2, "429": 1, "200": 1}
    assert stats["requests"] == 4
    assert stats["texts"] == 1


def test_close_fault_drops_the_connection_without_an_answer(
    client: httpx.Client, embedding_server: EmbeddingServer
) -> None:
    embedding_server.inject("close")
    with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
        embed(client, ["a"])
    assert embed(client, ["a"]).status_code == 200
    assert embedding_server.connections_opened == 2
    assert embedding_server.stats()["responses"] == {"close": 1, "200": 1}


def test_reset_fault_in_the_middle_of_the_body(
    client: httpx.Client, embedding_server: EmbeddingServer
) -> None:
    embedding_server.inject("reset", pause=0.2)
    with client.stream("POST", "/embeddings", json={"input": TEXTS}) as r:
        assert r.status_code == 200
        total = int(r.headers["content-length"])
        got = bytearray()
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
            drain(r, got)
        assert 0 < len(got) < total
    embedding_server.inject("reset", after_bytes=0)
    with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
        embed(client, ["a"])
    assert embed(client, ["a"]).status_code == 200
    assert embedding_server.stats()["faults_applied"] == {"reset": 2}


def test_delay_fault_triggers_a_read_timeout(
    client: httpx.Client, embedding_server: EmbeddingServer
) -> None:
    embedding_server.inject("delay", seconds=1.0)
    with pytest.raises(httpx.ReadTimeout):
        client.post("/embeddings", json={"input": ["a"]}, timeout=0.2)
    embedding_server.inject("delay", seconds=0.2)
    started = time.monotonic()
    r = embed(client, ["a"])
    assert r.status_code == 200
    assert time.monotonic() - started >= 0.2
    assert np.array_equal(vectors(r)[0], expected_embedding("a"))


def test_malformed_fault(client: httpx.Client, embedding_server: EmbeddingServer) -> None:
    embedding_server.inject("malformed")
    r = embed(client, ["a"])
    assert r.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.content)
    embedding_server.inject("malformed", body="{}")
    assert embed(client, ["a"]).json() == {}


def test_wrong_count_fault(client: httpx.Client, embedding_server: EmbeddingServer) -> None:
    embedding_server.inject("wrong_count")
    assert len(embed(client, TEXTS).json()["data"]) == len(TEXTS) - 1
    embedding_server.inject("wrong_count", drop=2)
    assert len(embed(client, TEXTS).json()["data"]) == len(TEXTS) - 2


def test_nan_fault(client: httpx.Client, embedding_server: EmbeddingServer) -> None:
    embedding_server.inject("nan", index=1)
    data = embed(client, TEXTS).json()["data"]
    assert data[1]["embedding"][512] is None  # orjson writes NaN as null, as SGLang does
    assert None not in data[0]["embedding"]
    embedding_server.inject("nan", index=99)  # clamped to the last input
    got = vectors(embed(client, TEXTS, encoding_format="base64"))
    assert np.isnan(got[-1]).sum() == 1
    assert not np.isnan(got[:-1]).any()
    embedding_server.inject("nan", literal=True)
    r = embed(client, ["a", "b"])
    assert b"NaN" in r.content
    assert np.isnan(json.loads(r.content)["data"][0]["embedding"][512])


def test_zero_fault(client: httpx.Client, embedding_server: EmbeddingServer) -> None:
    embedding_server.inject("zero", index=2)
    got = vectors(embed(client, TEXTS, encoding_format="base64"))
    assert not got[2].any()
    assert np.array_equal(
        np.delete(got, 2, axis=0), np.delete(expected_embeddings(TEXTS), 2, axis=0)
    )


def test_vector_faults_skip_requests_answered_with_an_error(
    client: httpx.Client, embedding_server: EmbeddingServer
) -> None:
    embedding_server.inject("zero")
    assert embed(client, [""]).status_code == 400
    assert embed(client, ["a"]).json()["data"][0]["embedding"][0] != 0.0
    assert embedding_server.stats()["faults_applied"] == {}


def test_inject_rejects_bad_faults(embedding_server: EmbeddingServer) -> None:
    with pytest.raises(ValueError, match="unknown fault kind"):
        embedding_server.inject("explode")
    with pytest.raises(TypeError, match="takes no parameter 'seconds'"):
        embedding_server.inject("close", seconds=1)
    with pytest.raises(ValueError, match="status"):
        embedding_server.inject("status", status=99)
    with pytest.raises(ValueError, match="count"):
        embedding_server.inject("close", count=0)
    with pytest.raises(ValueError, match="rate"):
        embedding_server.set_random_faults(1.5)
    assert embedding_server.stats()["faults_pending"] == 0
    assert set(FAULT_KINDS) == {
        "status",
        "close",
        "reset",
        "delay",
        "malformed",
        "wrong_count",
        "nan",
        "zero",
    }
    fault = Fault.make("status", status=503, body={"a": 1}, headers={"k": "v"})
    assert Fault.from_dict(fault.to_dict()) == fault


def _outcomes(seed: int, n: int = 40) -> list[int | str]:
    with EmbeddingServer() as srv, httpx.Client(base_url=srv.base_url) as c:
        srv.set_random_faults(0.5, ["close", ("status", {"status": 503})], seed=seed)
        out: list[int | str] = []
        for i in range(n):
            try:
                out.append(embed(c, [f"t{i}"]).status_code)
            except httpx.RemoteProtocolError:
                out.append("close")
        srv.clear_faults()
        assert embed(c, ["after"]).status_code == 200
        stats = srv.stats()
        assert sum(stats["faults_applied"].values()) == sum(1 for o in out if o != 200)
        return out


def test_random_faults_are_seeded_and_reproducible() -> None:
    first = _outcomes(seed=7)
    assert first == _outcomes(seed=7)
    assert {200, 503, "close"} <= set(first)
    assert first != _outcomes(seed=8)


def test_scripted_faults_run_before_random_ones(
    client: httpx.Client, embedding_server: EmbeddingServer
) -> None:
    embedding_server.set_random_faults(1.0, [("status", {"status": 500})])
    embedding_server.inject("status", status=418)
    assert [embed(client, ["a"]).status_code for _ in range(3)] == [418, 500, 500]
    embedding_server.set_random_faults(0.0)
    assert embed(client, ["a"]).status_code == 200


# ---- counters and the received log ---------------------------------------------------


def test_received_log_keeps_inputs_in_order_and_is_bounded() -> None:
    with EmbeddingServer(received_limit=3) as srv, httpx.Client(base_url=srv.base_url) as c:
        embed(c, "Instruct: Given a web search query\nQuery:what is it")
        embed(c, ["doc one", "doc two"])
        embed(c, ["ok", ""])  # rejected, but received
        assert srv.received == [
            ["Instruct: Given a web search query\nQuery:what is it"],
            ["doc one", "doc two"],
            ["ok", ""],
        ]
        embed(c, ["last"])
        assert srv.received[0] == ["doc one", "doc two"]
        assert len(srv.received) == 3
        srv.reset_counters()
        assert srv.received == []
        assert srv.stats()["requests"] == 0


def test_max_in_flight_and_latency() -> None:
    async def burst(srv: EmbeddingServer) -> float:
        async with httpx.AsyncClient(base_url=srv.base_url) as c:
            started = time.monotonic()
            answers = await asyncio.gather(
                *(c.post("/embeddings", json={"input": [str(i)]}) for i in range(5))
            )
            assert all(a.status_code == 200 for a in answers)
            return time.monotonic() - started

    with EmbeddingServer(latency=0.4) as srv:
        elapsed = asyncio.run(burst(srv))
        assert elapsed >= 0.4  # the five were answered at once, each after 0.4 s
        stats = srv.stats()
        assert stats["max_in_flight"] == 5
        assert stats["connections_opened"] == 5
        wait_until(lambda: srv.stats()["in_flight"] == 0)


# ---- TLS and HTTP/2 ------------------------------------------------------------------


def test_tls_with_the_servers_ca() -> None:
    with EmbeddingServer(tls=True) as srv:
        assert srv.base_url.startswith("https://127.0.0.1:")
        assert Path(srv.ca_cert_path).read_text().startswith("-----BEGIN CERTIFICATE-----")
        with httpx.Client(base_url=srv.base_url, verify=srv.ssl_context()) as c:
            r = embed(c, TEXTS)
            assert r.http_version == "HTTP/1.1"
            assert np.array_equal(vectors(r), expected_embeddings(TEXTS))
        with httpx.Client(base_url=srv.base_url) as untrusting, pytest.raises(httpx.ConnectError):
            embed(untrusting, ["a"])
    with pytest.raises(RuntimeError, match="tls=True"):
        _ = EmbeddingServer().ca_cert_path


def test_http2_negotiated_by_alpn_over_tls() -> None:
    with (
        EmbeddingServer(tls=True, http2=True) as srv,
        httpx.Client(base_url=srv.base_url, verify=srv.ssl_context(), http2=True) as c,
    ):
        responses = [embed(c, [f"t{i}"]) for i in range(10)]
        assert {r.http_version for r in responses} == {"HTTP/2"}
        assert np.array_equal(vectors(responses[3])[0], expected_embedding("t3"))
        assert srv.connections_opened == 1
        assert srv.requests == 10
    with (
        EmbeddingServer(tls=True, http2=True) as srv,
        httpx.Client(base_url=srv.base_url, verify=srv.ssl_context()) as c,
    ):
        assert embed(c, ["a"]).http_version == "HTTP/1.1"  # ALPN falls back


def test_h2c_prior_knowledge_and_upgrade_on_cleartext() -> None:
    with EmbeddingServer(http2=True) as srv:
        with httpx.Client(base_url=srv.base_url, http1=False, http2=True) as c:
            r = embed(c, ["a"])
            assert r.http_version == "HTTP/2"
            assert np.array_equal(vectors(r)[0], expected_embedding("a"))
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        settings = conn.initiate_upgrade_connection()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as raw:
            raw.sendall(
                b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                b"HTTP2-Settings: " + settings + b"\r\n\r\n"
            )
            buffer = b""
            while b"\r\n\r\n" not in buffer:
                buffer += raw.recv(4096)
            head, rest = buffer.split(b"\r\n\r\n", 1)
            assert head.startswith(b"HTTP/1.1 101")
            raw.sendall(conn.data_to_send())
            events = conn.receive_data(rest) if rest else []
            status = None
            ended = False
            while not ended:
                for event in events:
                    if isinstance(event, h2.events.ResponseReceived) and event.stream_id == 1:
                        status = dict(event.headers)[b":status"]
                    ended = ended or (
                        isinstance(event, h2.events.StreamEnded) and event.stream_id == 1
                    )
                raw.sendall(conn.data_to_send())
                if not ended:
                    events = conn.receive_data(raw.recv(65535))
            assert status == b"200"
            conn.close_connection()
            raw.sendall(conn.data_to_send())


# ---- lifecycle -----------------------------------------------------------------------


def test_stop_start_and_restart_keep_the_port_and_counters() -> None:
    srv = EmbeddingServer(keep_alive_timeout=30)
    with pytest.raises(RuntimeError, match="start"):
        _ = srv.base_url
    with srv, httpx.Client(base_url=srv.base_url) as c:
        port = srv.port
        assert embed(c, ["a"]).status_code == 200
        srv.stop()
        assert not srv.running
        with pytest.raises(httpx.ConnectError):
            embed(c, ["a"])
        srv.start()
        assert srv.port == port
        assert embed(c, ["b"]).status_code == 200
        srv.restart()
        assert srv.port == port
        assert srv.running
        assert embed(c, ["c"]).status_code == 200
        assert srv.requests == 3
        assert srv.connections_opened == 3  # each stop closed the kept-alive connection


def test_stop_ends_a_delayed_request_at_once(embedding_server: EmbeddingServer) -> None:
    embedding_server.inject("delay", seconds=30)

    async def run() -> BaseException | None:
        async with httpx.AsyncClient(base_url=embedding_server.base_url) as c:
            task = asyncio.ensure_future(c.post("/embeddings", json={"input": ["a"]}))
            await asyncio.to_thread(
                wait_until, lambda: embedding_server.stats()["faults_applied"].get("delay") == 1
            )
            await asyncio.to_thread(embedding_server.stop)
            try:
                await task
            except httpx.TransportError as exc:
                return exc
            return None

    assert isinstance(asyncio.run(run()), httpx.RemoteProtocolError)


def test_process_mode_serves_from_a_child_and_reads_counters_back() -> None:
    with EmbeddingServer(process=True, dim=64) as srv:
        assert srv.pid != os.getpid()
        with httpx.Client(base_url=srv.base_url) as c:
            r = embed(c, TEXTS, encoding_format="base64")
            assert np.array_equal(vectors(r), expected_embeddings(TEXTS, 64))
            srv.inject_overloaded()
            assert embed(c, ["x"]).status_code == 503
            port = srv.port
            srv.restart()
            assert srv.port == port
            assert embed(c, ["y"]).status_code == 200
        stats = srv.stats()
        assert stats["requests"] == 3
        assert stats["texts"] == len(TEXTS) + 1
        assert stats["connections_opened"] == 2
        assert srv.received == [TEXTS, ["x"], ["y"]]
        srv.reset_counters()
        assert srv.requests == 0
        srv.stop()
        assert not srv.running
        srv.start()
        assert srv.running


def test_admin_endpoints_serve_counters_and_faults(
    client: httpx.Client, embedding_server: EmbeddingServer
) -> None:
    embed(client, ["a"])
    admin = f"{embedding_server.url}/_testing"
    stats = client.get(f"{admin}/stats?received=1").json()
    assert (stats["requests"], stats["texts"], stats["received"]) == (1, 1, [["a"]])
    r = client.post(
        f"{admin}/inject", json={"kind": "status", "params": {"status": 503}, "count": 1}
    )
    assert r.status_code == 200
    assert embed(client, ["b"]).status_code == 503
    assert client.post(f"{admin}/inject", json={"kind": "nope"}).status_code == 400
    assert client.post(f"{admin}/reset").status_code == 200
    assert embedding_server.requests == 0


def test_constructor_validates_settings() -> None:
    for kwargs in (
        {"port": -1},
        {"dim": 0},
        {"keep_alive_timeout": 0},
        {"latency": -1},
        {"max_batch": 0},
        {"api_key": ""},
        {"dialect": "nope"},
    ):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            EmbeddingServer(**kwargs)


# ---- packaging -----------------------------------------------------------------------


def test_package_imports_no_core_module_and_no_server_library() -> None:
    """The test server stands apart from the library: no module of the package imports
    qwen_embed_plugins, and importing it loads no server library (those are the tooling's
    dependencies and load when a server starts)."""
    import ast

    import qwen_embed_tooling.testing

    root = Path(qwen_embed_tooling.testing.__file__).parent
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                assert node.level in (0, 1), f"{path.name}: from {'.' * node.level}{node.module}"
                assert node.level == 1 or not (node.module or "").startswith("qwen_embed_plugins")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("qwen_embed_plugins"), path.name
    code = (
        "import sys\n"
        "import qwen_embed_plugins\n"
        "assert 'qwen_embed_tooling.testing' not in sys.modules\n"
        "before = set(sys.modules)\n"
        "import qwen_embed_tooling.testing\n"
        "new = sorted(m for m in set(sys.modules) - before if m.split('.')[0] in "
        "('uvicorn', 'hypercorn', 'trustme', 'httpx', 'httpx2', 'h2', 'starlette'))\n"
        "assert not new, new\n"
        "core = sorted(m for m in set(sys.modules) - before"
        " if m.startswith('qwen_embed_plugins.'))\n"
        "assert not core, core\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_command_line_runs_in_the_foreground_until_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "qwen_embed_tooling.testing", "--port", "0", "--latency", "0.01"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("Serving Qwen/Qwen3-Embedding-0.6B (1024-dim) at http://127.0.0.1:")
        base_url = line.rsplit(" ", 1)[1].strip()
        with httpx.Client(base_url=base_url) as c:
            assert np.array_equal(vectors(embed(c, ["a"]))[0], expected_embedding("a"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
