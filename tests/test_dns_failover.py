"""Failover by DNS: the endpoint's name moves from one address to another and the old
server stops; the next call reaches the new one after at most one refused connect, on
every HTTP/1.1 path (the sync and async clients, ``openai_client()`` sync and async):
no path keeps connecting to an address it resolved before (aiohttp's DNS cache is
dropped on a connect failure).

The name is resolved inside the test (``socket.getaddrinfo``, which ``http.client`` and
aiohttp's default resolver both call, patched for one made-up name only) to two loopback
addresses, 127.0.0.1 and 127.0.0.2, where two small servers listen on the same port.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.server
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import qwen_embed_plugins as q
from qwen_embed_tooling.testing import expected_embeddings

NAME = "failover.qwen-embed.test"
PATHS = ("sync", "async", "sdk_sync", "sdk_async")


class _Handler(http.server.BaseHTTPRequestHandler):
    """``POST .../embeddings`` with `expected_embeddings`; one request per connection
    (HTTP/1.0), so every request connects (and resolves) anew."""

    def do_POST(self) -> None:
        doc = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        texts = doc["input"] if isinstance(doc["input"], list) else [doc["input"]]
        vectors = expected_embeddings(texts)
        b64 = doc.get("encoding_format") == "base64"
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()
                if b64
                else v.tolist(),
            }
            for i, v in enumerate(vectors)
        ]
        body = json.dumps({"object": "list", "data": data, "model": doc.get("model", "m")})
        self.server.served += 1  # type: ignore[attr-defined]  # before the client has it
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: Any) -> None:
        pass


def _serve(host: str, port: int) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer((host, port), _Handler)
    server.served = 0  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def two_addresses(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Two servers, 127.0.0.1 and 127.0.0.2 on one port; ``NAME`` resolves to
    ``state["address"]``, each lookup counted."""
    for _ in range(20):  # a port free on both addresses
        old = _serve("127.0.0.1", 0)
        port = old.server_address[1]
        try:
            new = _serve("127.0.0.2", port)
            break
        except OSError:
            old.shutdown()
            old.server_close()
    else:
        pytest.fail("no port free on both 127.0.0.1 and 127.0.0.2")
    state: dict[str, Any] = {"address": "127.0.0.1", "port": port, "old": old, "new": new}
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == NAME:
            host = state["address"]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    q.close_all()
    yield state
    q.close_all()
    for server in (old, new):
        with contextlib.suppress(Exception):
            server.shutdown()
        server.server_close()


def _embed(runner: asyncio.Runner | None, path: str, client: Any, texts: list[str]) -> Any:
    """``texts`` embedded on ``path`` (an async path on ``runner``'s loop), as an array."""
    if path == "sync":
        return np.asarray(client.embed_documents_array(texts))
    if path == "sdk_sync":
        got = client.openai_client().embeddings.create(input=texts, model="m")
        return np.asarray([d.embedding for d in got.data], dtype=np.float32)

    async def run() -> Any:
        if path == "async":
            return await client.embed_documents_array(texts)
        got = await client.openai_client().embeddings.create(input=texts, model="m")
        return [d.embedding for d in got.data]

    assert runner is not None
    return np.asarray(runner.run(run()), dtype=np.float32)


def _retries() -> int:
    return sum(int(row["retries"]) for row in q.stats().values() if "replicas" not in row)


@pytest.mark.parametrize("path", PATHS)
def test_failover_follows_dns_after_one_refused_connect(
    two_addresses: dict[str, Any], path: str
) -> None:
    """The library's clients: the call after the move succeeds, with at most one retry
    (the connect the old address refused). ``openai_client()`` (no retries of its own,
    ``max_retries=0``): the request after the move may fail once with that refused
    connect, the next one reaches the new address."""
    import openai

    state = two_addresses
    url = f"http://{NAME}:{state['port']}/v1"
    # the outage budget retries connect failures until the deadline, each one counted
    retry = q.RetryConfig(deadline=60.0, query_deadline=60.0)
    is_async = path in ("async", "sdk_async")
    client = (q.AsyncEmbeddingClient if is_async else q.EmbeddingClient)(base_url=url, retry=retry)
    # one event loop for every call of an async path: aiohttp's session (and its DNS
    # cache) lives as long as its loop
    with asyncio.Runner() if is_async else contextlib.nullcontext() as runner:
        got = _embed(runner, path, client, ["alpha"])
        np.testing.assert_allclose(got, expected_embeddings(["alpha"]), atol=1e-6)
        assert state["old"].served == 1
        # the name moves; the old server stops (its address now refuses connections)
        state["address"] = "127.0.0.2"
        state["old"].shutdown()
        state["old"].server_close()
        before = _retries()
        texts = ["beta"]
        if path.startswith("sdk"):
            with contextlib.suppress(openai.APIConnectionError):  # the one refused connect
                got = _embed(runner, path, client, texts)
                texts = ["gamma"]  # it went through: this call checks the next one too
        got = _embed(runner, path, client, texts)
        np.testing.assert_allclose(got, expected_embeddings(texts), atol=1e-6)
    assert state["new"].served >= 1
    assert _retries() - before <= 1, (_retries(), before)
