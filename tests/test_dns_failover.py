"""Failover by DNS: the endpoint's name moves from one address to another and the old
server stops; the next call reaches the new one after at most one refused connect, on
every path (the sync and async clients and ``openai_client()`` sync and async, over
HTTP/1.1 and HTTP/2): no path keeps connecting to an address it resolved before
(aiohttp's DNS cache is cleared on a connect failure).

The name is resolved inside the test: ``socket.getaddrinfo`` (which ``http.client``,
aiohttp's default resolver and httpx/anyio all call) is patched for one made-up name
only, to 127.0.0.1 and then 127.0.0.2, where two `HostileServer` s (plain answers)
listen on the same port. Over HTTP/2 (TLS) the certificate names neither: ``verify`` is
off for these loopback servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import qwen_embed_plugins as q
from qwen_embed_tooling.testing import HostileServer, expected_embeddings

NAME = "failover.qwen-embed.test"
CLIENT_PATHS = ("sync", "async", "sdk_sync", "sdk_async")
PATHS = (*CLIENT_PATHS, *(f"h2_{p}" for p in CLIENT_PATHS))


@pytest.fixture
def two_addresses(path: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Two servers, on 127.0.0.1 and 127.0.0.2, one port; ``NAME`` resolves to
    ``state["address"]``."""
    http2 = path.startswith("h2_")
    for _ in range(20):  # a port free on both addresses
        old = HostileServer(http2=http2).start()
        try:
            new = HostileServer(http2=http2, host="127.0.0.2", port=old.port).start()
            break
        except OSError:
            old.stop()
    else:
        pytest.fail("no port free on both 127.0.0.1 and 127.0.0.2")
    state: dict[str, Any] = {"address": "127.0.0.1", "old": old, "new": new}
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        # anyio (httpx's async backend) passes the name IDNA-encoded, as bytes
        named = host in (NAME, NAME.encode("ascii"))
        return real(state["address"] if named else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    q.close_all()
    yield state
    q.close_all()
    old.stop()
    new.stop()


def _embed(runner: asyncio.Runner | None, path: str, client: Any, texts: list[str]) -> Any:
    """``texts`` embedded on ``path`` (an async path on ``runner``'s loop), as an array."""
    path = path.removeprefix("h2_")
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


def _refused_retries() -> int:
    """Retries after a connect failure, so far (every endpoint)."""
    rows = [row for row in q.stats().values() if "replicas" not in row]
    return sum(int(row["retries_by_reason"].get("connect_error", 0)) for row in rows)


def _refused(exc: BaseException) -> bool:
    """Whether an SDK failure is a connect failure (the library's ``ConnectError``, the
    cause of the ``httpx`` error the SDK wrapped)."""
    cause = exc.__cause__
    return isinstance(cause, Exception) and isinstance(cause.__cause__, q.ConnectError)


@pytest.mark.parametrize("path", PATHS)
def test_failover_follows_dns_after_one_refused_connect(
    two_addresses: dict[str, Any], path: str
) -> None:
    """The library's clients: the call after the move succeeds, with at most one retry
    after a connect failure (the connect the old address refused; a kept-alive
    connection the old server closed is resent too, not a connect failure).
    ``openai_client()`` (no retries of its own, ``max_retries=0``): of the requests
    after the move, at most one fails to connect before one reaches the new address."""
    import openai

    state = two_addresses
    http2 = path.startswith("h2_")
    url = f"{'https' if http2 else 'http'}://{NAME}:{state['old'].port}/v1"
    # the outage budget retries connect failures until the deadline, each one counted
    retry = q.RetryConfig(deadline=60.0, query_deadline=60.0)
    is_async = path.endswith("async")
    make = q.AsyncEmbeddingClient if is_async else q.EmbeddingClient
    client = make(base_url=url, retry=retry, http2=http2, verify=not http2)
    # one event loop for every call of an async path: aiohttp's session (and its DNS
    # cache) lives as long as its loop
    with asyncio.Runner() if is_async else contextlib.nullcontext() as runner:
        got = _embed(runner, path, client, ["alpha"])
        np.testing.assert_allclose(got, expected_embeddings(["alpha"]), atol=1e-6)
        assert state["old"].stats()["requests"] >= 1
        # the name moves; the old server stops (its address now refuses connections)
        state["address"] = "127.0.0.2"
        state["old"].stop()
        before = _refused_retries()
        refused = 0
        for _ in range(3 if "sdk" in path else 1):
            try:
                got = _embed(runner, path, client, ["beta"])
            except openai.APIConnectionError as exc:
                refused += _refused(exc)
                continue
            break
        np.testing.assert_allclose(got, expected_embeddings(["beta"]), atol=1e-6)
    assert state["new"].stats()["requests"] >= 1
    assert refused + _refused_retries() - before <= 1, (refused, _refused_retries(), before)
