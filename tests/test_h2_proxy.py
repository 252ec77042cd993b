"""HTTP/2 refused streams and h2c, and proxies the same in sync and async."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import numpy as np
import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins import _balance as balance
from qwen_embed_plugins._state import STATE
from qwen_embed_tooling.testing import EmbeddingServer, LoopbackProxy, expected_embeddings

QUERIES = [f"query number {i}" for i in range(600)]
ALIAS = "embed.internal"


def _h2c_failed(client: q.EmbeddingClient | q.AsyncEmbeddingClient) -> bool:
    return bool(STATE.entries[client.config.pool_key].h2c_failed)


@pytest.mark.parametrize(("mode", "calls"), [("graceful", 600), ("refuse", 60)])
@pytest.mark.parametrize("tls", [False, True])
def test_refused_streams_are_resent_and_never_cost_h2(mode: str, calls: int, tls: bool) -> None:
    """A server (h2 only) that sends GOAWAY after every 7 streams of a connection (600
    concurrent calls), or refuses streams with REFUSED_STREAM (60 calls, 4 at a time):
    every call succeeds, over HTTP/2, with no HTTP/1.1 fallback and no breaker.

    (Hundreds of streams refused at once are not run: httpcore2's HTTP/2 connection then
    gets frames its h2 state machine refuses after the GOAWAY, and some streams wait
    until the call's deadline; see docs/reliability.md.)"""
    with EmbeddingServer(
        http2=True, h2_only=True, goaway_after=7, goaway_mode=mode, tls=tls
    ) as srv:
        kwargs: dict[str, object] = {"verify": str(srv.ca_cert_path)} if tls else {}
        client = q.AsyncEmbeddingClient(
            base_url=srv.base_url,
            http2=True,
            # the deadline is not what is tested: generous, for 600 TLS calls on a loaded CPU
            retry=q.RetryConfig(
                circuit_failure_threshold=2, circuit_open_after=0.0, query_deadline=300.0
            ),
            **kwargs,  # type: ignore[arg-type]
        )
        window = asyncio.Semaphore(600 if mode == "graceful" else 4)

        async def one(text: str) -> list[float]:
            async with window:
                return await client.embed_query(text)

        async def main() -> list[list[float]]:
            return await asyncio.gather(*(one(t) for t in QUERIES[:calls]))

        vectors = asyncio.run(main())
        assert len(vectors) == calls
        assert not _h2c_failed(client)
        assert balance.endpoint_for(client.config).opened == 0
        assert srv.stats()["faults_applied"].get(
            "goaway" if mode == "graceful" else "refused_stream"
        )
        sync = q.EmbeddingClient(client.config)
        arr = sync.embed_documents_array(QUERIES[:100])
        np.testing.assert_array_equal(arr, expected_embeddings(QUERIES[:100]))
        assert not _h2c_failed(sync)
        q.close_all()


def test_h2c_is_given_up_only_for_a_server_that_never_spoke_it() -> None:
    with EmbeddingServer() as h1_only:  # uvicorn: HTTP/1.1 only
        client = q.EmbeddingClient(base_url=h1_only.base_url, http2=True)
        assert len(client.embed_query("x")) == h1_only.dim
        assert _h2c_failed(client)  # the first exchange showed it: HTTP/1.1 from now on
    q.close_all()


# --------------------------------------------------------------------------- proxies


@contextlib.contextmanager
def server_behind_proxy(**settings: object) -> Iterator[tuple[EmbeddingServer, LoopbackProxy]]:
    """A server and a proxy in front of it; on exit the client pools and the proxy (its
    kept-alive upstream connections) close before the server does."""
    with EmbeddingServer(**settings) as srv:  # type: ignore[arg-type]
        try:
            with LoopbackProxy(aliases=(ALIAS,)) as proxy:
                try:
                    yield srv, proxy
                finally:
                    q.close_all()
        finally:
            q.close_all()


def test_env_proxy_is_used_by_sync_and_async_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host reachable only through the proxy: HTTP_PROXY routes both clients through it
    (the host name never resolves here), NO_PROXY exempts it, loopback is never proxied."""
    with server_behind_proxy() as (srv, proxy):
        remote = f"http://{ALIAS}:{srv.port}/v1"
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        sync = q.EmbeddingClient(base_url=remote)
        aclient = q.AsyncEmbeddingClient(base_url=remote)
        np.testing.assert_allclose(
            sync.embed_documents(["a"]), expected_embeddings(["a"]), atol=1e-6
        )
        got = asyncio.run(aclient.embed_documents(["b"]))
        np.testing.assert_allclose(got, expected_embeddings(["b"]), atol=1e-6)
        assert proxy.requests == 2
        assert set(proxy.targets) == {f"{ALIAS}:{srv.port}"}

        # loopback: never through the proxy, whatever the environment says
        q.EmbeddingClient(base_url=srv.base_url).embed_query("direct")
        asyncio.run(q.AsyncEmbeddingClient(base_url=srv.base_url).embed_query("direct"))
        assert proxy.requests == 2

        # NO_PROXY names the host: direct (which cannot resolve it), in both clients
        monkeypatch.setenv("NO_PROXY", ALIAS)
        fast = q.RetryConfig(max_attempts=1)
        with pytest.raises(q.ConnectError):
            q.EmbeddingClient(base_url=remote, retry=fast).embed_query("x")
        with pytest.raises(q.ConnectError):
            asyncio.run(q.AsyncEmbeddingClient(base_url=remote, retry=fast).embed_query("x"))
        assert proxy.requests == 2

        # an explicit proxy= wins over the environment (and over trust_env=False)
        explicit = q.EmbeddingClient(base_url=remote, proxy=proxy.url, trust_env=False)
        explicit.embed_query("explicit")
        assert proxy.requests == 3


def test_https_through_the_proxy_tunnels(monkeypatch: pytest.MonkeyPatch) -> None:
    with server_behind_proxy(tls=True, tls_hostnames=(ALIAS,)) as (srv, proxy):
        remote = f"https://{ALIAS}:{srv.port}/v1"
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        sync = q.EmbeddingClient(base_url=remote, verify=str(srv.ca_cert_path))
        aclient = q.AsyncEmbeddingClient(sync.config)
        sync.embed_query("tls one")
        asyncio.run(aclient.embed_query("tls two"))
        assert proxy.connects == 2
        assert srv.requests == 2
