"""Failure isolation: what the breaker hears, outage budgets, bisection, lifetimes.

Every test talks to a real loopback `EmbeddingServer`; waits are on server counters or
events, never on sleeps standing in for "the request has arrived".
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins import _balance as balance
from qwen_embed_plugins import _pool as pool
from qwen_embed_plugins._state import STATE
from qwen_embed_tooling.testing import EmbeddingServer, expected_embeddings

FAST = q.RetryConfig(backoff_initial=0.01, backoff_max=0.05)


def wait_until(condition: Callable[[], bool], what: str, limit: float = 60.0) -> None:
    """Wait for ``condition`` (polling a server counter); fail after ``limit`` seconds,
    a guard against hangs only (no test asserts on how long it took)."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def endpoint(client: q.EmbeddingClient | q.AsyncEmbeddingClient) -> balance.Endpoint:
    return balance.endpoint_for(client.config)


# --------------------------------------------------------------------------- the breaker


def test_500s_never_open_the_breaker(srv: EmbeddingServer) -> None:
    """A deterministic 500 says nothing about the endpoint's health."""
    client = q.EmbeddingClient(
        base_url=srv.base_url,
        encoding_format="base64",  # no float retry: one request per call
        retry=FAST.replace(max_attempts=1, circuit_failure_threshold=2, circuit_open_after=0.0),
    )
    # each call: the query as a one-item list and as a bare string (a server may refuse
    # one-item lists), then a control request (a 500 to a single text with no success
    # since is checked with a known-good text), likewise; it fails too, and with
    # max_attempts=1 the outage is not retried
    srv.inject_status(500, count=80, message="json: unsupported value: NaN")
    for _ in range(20):
        with pytest.raises(q.ServerError, match="unsupported value: NaN"):
            client.embed_query("poison")
    assert len(client.embed_query("fine")) == srv.dim  # no CircuitOpenError
    assert endpoint(client).opened == 0


def test_a_429_window_is_waited_out_and_never_opens_the_breaker(srv: EmbeddingServer) -> None:
    texts = [f"document {i}" for i in range(320)]
    client = q.EmbeddingClient(
        base_url=srv.base_url,
        retry=FAST.replace(circuit_failure_threshold=2, circuit_open_after=0.0),
    )
    srv.inject_rate_limit(count=30)  # no Retry-After: backoff
    arr = client.embed_documents_array(texts)
    np.testing.assert_array_equal(arr, expected_embeddings(texts))
    assert srv.stats()["responses"].get("429") == 30
    assert endpoint(client).opened == 0


def test_local_pool_timeouts_never_open_the_breaker() -> None:
    """500 gathered queries over 10 connections with a 0.3 s pool timeout: some wait too
    long in this process's own queue (PoolTimeout), none is reported as the endpoint's
    ill health, and the next call goes through."""
    with EmbeddingServer(latency=0.05) as srv:
        client = q.AsyncEmbeddingClient(
            base_url=srv.base_url,
            limits=q.Limits(max_connections=10),
            timeout=q.Timeouts(pool=0.3),
            retry=FAST.replace(circuit_failure_threshold=2, circuit_open_after=0.0),
        )

        async def main() -> list[object]:
            calls = [client.embed_query(f"query {i}") for i in range(500)]
            return await asyncio.gather(*calls, return_exceptions=True)

        results = asyncio.run(main())
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors, "the pool timeout never fired: the test proves nothing"
        assert all(isinstance(e, q.PoolTimeout) for e in errors), {type(e) for e in errors}
        assert "max_connections=10" in str(errors[0])
        assert srv.stats()["max_in_flight"] <= 10
        assert endpoint(client).opened == 0
        assert len(asyncio.run(client.embed_query("after"))) == srv.dim


def test_open_breaker_names_the_last_failure_and_fails_new_calls_fast() -> None:
    srv = EmbeddingServer()
    srv.start()
    url = srv.base_url
    srv.stop()
    client = q.EmbeddingClient(
        base_url=url,
        retry=FAST.replace(
            query_deadline=5.0,  # not what is tested: ended by wait_for_server (2 s)
            circuit_failure_threshold=3,
            circuit_cooldown=60.0,
            circuit_open_after=0.0,
        ),
    )
    with pytest.raises(q.ConnectError):
        client.embed_query("down")
    before = endpoint(client).replicas[0].metrics.snapshot()["requests"]
    with pytest.raises(q.CircuitOpenError) as info:
        client.embed_query("still down")
    error = info.value
    assert isinstance(error.last_error, q.ConnectError)
    assert error.__cause__ is error.last_error
    assert "cannot connect" in str(error)
    assert list(error.failures) == [endpoint(client).replicas[0].label]
    assert endpoint(client).replicas[0].metrics.snapshot()["requests"] == before  # nothing sent


# --------------------------------------------------------------------------- outages


def test_a_restart_costs_time_not_the_run() -> None:
    """A server down for 3 s in the middle of a 3,000-text call (longer than
    max_attempts x backoff): the call waits it out; every vector exact; no breaker."""
    texts = [f"restart text {i}" for i in range(3000)]
    with EmbeddingServer(latency=0.01) as srv:
        client = q.EmbeddingClient(
            base_url=srv.base_url,
            batch_size=16,
            retry=q.RetryConfig(backoff_initial=0.05, backoff_max=0.5, max_attempts=2),
        )
        result: dict[str, object] = {}

        def run() -> None:
            try:
                result["arr"] = client.embed_documents_array(texts)
            except BaseException as exc:  # reported below
                result["error"] = exc

        worker = threading.Thread(target=run)
        worker.start()
        wait_until(lambda: srv.requests >= 20, "the call to be under way")
        srv.restart(downtime=3.0)
        worker.join()
        assert "error" not in result, result.get("error")
        np.testing.assert_array_equal(result["arr"], expected_embeddings(texts))
        assert endpoint(client).opened == 0


# --------------------------------------------------------------------------- dimensions


def test_native_dimensions_are_not_sent(
    srv: EmbeddingServer, caplog: pytest.LogCaptureFixture
) -> None:
    """dimensions equal to the model's full size is not asked for (SGLang without MRL
    would refuse it and the client would warn about slicing)."""
    caplog.set_level(logging.WARNING, logger="qwen_embed_plugins")
    client = q.EmbeddingClient(base_url=srv.base_url, dimensions=1024)  # Qwen3-0.6B: 1024
    vectors = client.embed_documents(["a", "b"])
    np.testing.assert_allclose(vectors, expected_embeddings(["a", "b"]), atol=1e-6)
    assert set(srv.stats()["responses"]) == {"200"}
    assert not caplog.records


# --------------------------------------------------------------------------- lifetime


def test_close_all_leaks_no_socket_over_20_cycles(srv: EmbeddingServer) -> None:
    client = q.EmbeddingClient(base_url=srv.base_url)
    aclient = q.AsyncEmbeddingClient(base_url=srv.base_url)
    loop = asyncio.new_event_loop()
    try:
        for i in range(20):
            client.embed_query(f"sync {i}")
            loop.run_until_complete(aclient.embed_query(f"async {i}"))
            q.close_all()  # the loop's pool is closed inside the loop when it next runs

        def closed() -> bool:
            loop.run_until_complete(asyncio.sleep(0))  # the loop runs the scheduled close
            return srv.connections_active == 0

        wait_until(closed, "every connection closed")
    finally:
        loop.close()
    assert srv.connections_opened >= 20  # each cycle opened fresh connections


def test_close_all_during_traffic_resends_and_never_trips_the_breaker() -> None:
    texts = [f"busy text {i}" for i in range(400)]
    with EmbeddingServer(latency=0.02) as srv:
        client = q.EmbeddingClient(
            base_url=srv.base_url,
            batch_size=8,
            retry=q.RetryConfig(circuit_failure_threshold=1, circuit_open_after=0.0),
        )
        result: dict[str, object] = {}

        def run() -> None:
            try:
                result["arr"] = client.embed_documents_array(texts)
            except BaseException as exc:
                result["error"] = exc

        worker = threading.Thread(target=run)
        worker.start()
        for k in (5, 15, 30):
            wait_until(lambda k=k: srv.requests >= k, f"{k} requests")
            q.close_all()
        worker.join()
        assert "error" not in result, result.get("error")
        np.testing.assert_array_equal(result["arr"], expected_embeddings(texts))
        assert endpoint(client).opened == 0


def test_idle_pools_are_closed_and_reopen() -> None:
    """A pool idle past its keep-alive expiry is closed (its socket released) and a
    later call opens a new one."""
    with EmbeddingServer() as srv:
        client = q.EmbeddingClient(base_url=srv.base_url, limits=q.Limits(keepalive_expiry=0.2))
        client.embed_query("first")
        assert srv.connections_active == 1
        key = client.config.pool_key
        wait_until(lambda: pool.reap_idle() >= 0 and key_closed(key), "the idle pool closed")
        wait_until(lambda: srv.connections_active == 0, "the server to see the close")
        assert len(client.embed_query("again")) == srv.dim
        assert srv.connections_opened == 2


def key_closed(key: q._config.PoolKey) -> bool:
    return STATE.entries[key].sync is None


def test_tenants_share_one_pool(srv: EmbeddingServer) -> None:
    """The API key is per request, not per pool: 200 tenants' clients, one connection."""
    clients = [
        q.EmbeddingClient(base_url=srv.base_url, api_key=f"tenant-key-{i:04d}") for i in range(200)
    ]
    for client in clients:
        client.embed_query("hello")
    assert srv.connections_opened <= 1
    row = q.pool_stats()[clients[0].config.endpoint]
    assert row["pools"] == 1
    assert all("tenant-key" not in f for f in row["fingerprints"])


# --------------------------------------------------------------------------- accounting


def test_cancelled_and_rejected_requests_are_not_counted_as_ok() -> None:
    with EmbeddingServer(latency=0.5) as srv:
        client = q.AsyncEmbeddingClient(base_url=srv.base_url)
        before = q.stats().get(client.config.endpoint, {}).get("requests_by_outcome", {})

        async def cancel_one() -> None:
            task = asyncio.ensure_future(client.embed_query("to be cancelled"))
            await asyncio.to_thread(wait_until, lambda: srv.requests >= 1, "arrival")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(cancel_one())
        srv.inject("malformed", count=2)  # the query and its control request
        with pytest.raises(q.ResponseError):
            asyncio.run(client.embed_query("rejected"))
        snap = q.stats()[client.config.endpoint]
        outcomes = snap["requests_by_outcome"]
        assert outcomes.get("cancelled", 0) - before.get("cancelled", 0) == 1
        assert outcomes.get("rejected", 0) - before.get("rejected", 0) == 2
        assert outcomes.get("ok", 0) == before.get("ok", 0)


# --------------------------------------------------------------------------- secrets


def test_the_key_is_held_in_a_secret(srv: EmbeddingServer) -> None:
    key = "sk-live-0123456789abcdef"
    client = q.EmbeddingClient(base_url=srv.base_url, api_key=key)
    client.embed_query("x")
    engine = client._engine
    seen = [repr(vars(client)), repr(vars(engine)), repr(vars(engine.requests)), repr(client)]
    seen.append(str(client.config))
    seen += [repr(c) for c in engine.requests._contexts.values()]
    assert not any(key in text for text in seen)


def test_a_key_over_plain_http_to_a_remote_host_warns_once_or_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="qwen_embed_plugins")
    remote = "http://10.255.255.1:9/v1"  # never contacted: the breaker-free path fails first
    with pytest.raises(q.ConfigError, match="plain HTTP"):
        q.EmbeddingConfig(base_url=remote, api_key="sk-abcdef", insecure_key="error")
    engine = q.EmbeddingClient(base_url=remote, api_key="sk-abcdef")._engine
    engine.new_call(query=True)
    engine.new_call(query=True)
    warnings = [r.getMessage() for r in caplog.records if "plain HTTP" in r.getMessage()]
    assert len(warnings) == 1
    assert "sk-abcdef" not in warnings[0]
    caplog.clear()
    q.EmbeddingClient(base_url="http://127.0.0.1:9/v1", api_key="sk-abcdef")._engine.new_call(
        query=True
    )
    assert not [r for r in caplog.records if "plain HTTP" in r.getMessage()]  # loopback


# --------------------------------------------------------------------------- limits


def test_process_wide_cap_holds_over_threads_and_loops() -> None:
    """8 threads, each running its own event loop, limit 4 per process: never more than 4
    requests in flight at the server (each loop has its own pool of up to 20)."""
    with EmbeddingServer(latency=0.05) as srv:
        config = q.EmbeddingConfig(
            base_url=srv.base_url, limits=q.Limits(max_connections_per_process=4)
        )

        def worker(i: int) -> None:
            aclient = q.AsyncEmbeddingClient(config)

            async def main() -> None:
                await asyncio.gather(*(aclient.embed_query(f"t{i}-{j}") for j in range(10)))

            asyncio.run(main())

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        sync = q.EmbeddingClient(config)
        sync.embed_documents([f"s{j}" for j in range(40)])
        for t in threads:
            t.join()
        assert srv.requests >= 80
        assert srv.stats()["max_in_flight"] <= 4
