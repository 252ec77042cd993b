"""`qwen_embed_tooling.testing.LoopbackProxy`, checked with plain httpx and sockets."""

from __future__ import annotations

import socket

import httpx
import numpy as np
import pytest

from qwen_embed_tooling.testing import EmbeddingServer, LoopbackProxy, expected_embeddings

ALIAS = "embeddings.internal.test"  # reserved TLD: only the proxy can reach it


def vectors(r: httpx.Response) -> np.ndarray:
    return np.asarray([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


def test_plain_http_requests_are_forwarded_with_keep_alive_and_counted() -> None:
    with (
        EmbeddingServer() as server,
        LoopbackProxy() as proxy,
        httpx.Client(proxy=proxy.url) as c,
    ):
        for i in range(3):
            r = c.post(f"{server.base_url}/embeddings", json={"input": [f"p{i}"]})
            assert np.array_equal(vectors(r), expected_embeddings([f"p{i}"]))
        assert c.get(f"{server.base_url}/models").status_code == 200
        stats = proxy.stats()
        assert (stats["requests"], stats["connects"], stats["refused"]) == (4, 0, 0)
        assert stats["targets"] == {f"127.0.0.1:{server.port}": 4}
        assert stats["connections_opened"] == 1  # keep-alive towards the client...
        assert server.connections_opened == 1  # ...and towards the server
        assert server.requests == 3


def test_https_goes_through_a_connect_tunnel_to_an_alias() -> None:
    with (
        EmbeddingServer(tls=True, tls_hostnames=[ALIAS]) as server,
        LoopbackProxy(aliases=[ALIAS]) as proxy,
        httpx.Client(proxy=proxy.url, verify=server.ssl_context()) as c,
    ):
        url = f"https://{ALIAS}:{server.port}/v1/embeddings"
        for i in range(3):
            r = c.post(url, json={"input": [f"s{i}"]})
            assert np.array_equal(vectors(r), expected_embeddings([f"s{i}"]))
        assert proxy.connects == 1  # one tunnel, kept alive
        assert proxy.requests == 0  # the proxy never sees inside the tunnel
        assert proxy.targets == {f"{ALIAS}:{server.port}": 1}
        assert server.requests == 3
        with pytest.raises(httpx.ConnectError):  # without the proxy the name does not resolve
            httpx.post(url, json={"input": ["x"]}, verify=server.ssl_context())


def test_non_loopback_targets_are_refused_without_a_connection() -> None:
    with LoopbackProxy() as proxy, httpx.Client(proxy=proxy.url) as c:
        r = c.get("http://example.com/v1/models")
        assert r.status_code == 403
        with pytest.raises(httpx.ProxyError):
            c.get("https://example.com/v1/models")
        stats = proxy.stats()
        assert (stats["refused"], stats["requests"], stats["connects"]) == (2, 0, 0)
        assert stats["targets"] == {}


def test_proxy_authentication() -> None:
    with EmbeddingServer() as server, LoopbackProxy(auth=("user", "pw")) as proxy:
        url = f"{server.base_url}/embeddings"
        with httpx.Client(proxy=proxy.url) as c:
            assert c.post(url, json={"input": ["a"]}).status_code == 407
        authed = f"http://user:pw@127.0.0.1:{proxy.port}"
        with httpx.Client(proxy=authed) as c:
            assert c.post(url, json={"input": ["a"]}).status_code == 200
        assert proxy.stats()["auth_failures"] == 1
        assert server.requests == 1


def test_raw_absolute_form_request_and_wait_for() -> None:
    with EmbeddingServer() as server, LoopbackProxy() as proxy:
        body = b'{"input": ["raw"]}'
        request = (
            f"POST {server.base_url}/embeddings HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode() + body
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as sock:
            sock.sendall(request)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert b'"embedding"' in payload
        assert proxy.wait_for("requests", 1, timeout=10) == 1
        assert proxy.wait_for("connections_active", 0, timeout=30, at_most=True) == 0
        proxy.reset_counters()
        assert proxy.requests == 0
    assert not proxy.running
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=5).close()
