"""Under faults the client keeps working, loses nothing, and says what went wrong."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qwen_embed_plugins as q
from qwen_embed_plugins import _pool as pool
from qwen_embed_tooling.testing import EmbeddingServer, expected_embeddings

SOAK_TEXTS = [f"soak passage {i} about topic {i % 97}" for i in range(10_000)]
SOAK_FAULTS = [
    ("status", {"status": 429, "retry_after_ms": 5}),
    ("status", {"status": 503}),
    ("status", {"status": 500}),
    ("status", {"status": 502}),
    ("close", {}),
    ("reset", {}),
    ("reset", {"after_bytes": 0}),
    ("delay", {"seconds": 0.05}),
]
# Batch jobs ride out outages with more attempts; the breaker still guards the endpoint.
BATCH_RETRY = q.RetryConfig(
    max_attempts=30,
    backoff_initial=0.05,
    backoff_max=0.5,
    deadline=60.0,
    circuit_failure_threshold=100,
)


def _retries(label: str) -> int:
    return int(q.stats().get(label, {}).get("retries", 0))


def _soak_check(srv: EmbeddingServer, arr: np.ndarray, label: str, retries_before: int) -> None:
    want = expected_embeddings(SOAK_TEXTS)
    assert arr.shape == want.shape  # lost = 0
    np.testing.assert_array_equal(arr, want)  # misordered = 0, corrupted = 0
    injected = sum(srv.stats()["faults_applied"].values())
    retried = _retries(label) - retries_before
    print(f"soak: texts={len(SOAK_TEXTS)} faults={injected} retries={retried} lost=0 misordered=0")
    assert injected >= 5
    assert retried >= injected - 8  # delays need no retry; every other fault does


def test_soak_sync_with_random_faults(srv: EmbeddingServer) -> None:
    srv.set_random_faults(0.05, SOAK_FAULTS, seed=11)
    client = q.EmbeddingClient(
        base_url=srv.base_url, retry=BATCH_RETRY, batch_size=32, max_concurrency=4
    )
    before = _retries(client.config.endpoint)
    arr = client.embed_documents_array(SOAK_TEXTS)
    _soak_check(srv, arr, client.config.endpoint, before)


async def test_soak_async_with_random_faults(srv: EmbeddingServer) -> None:
    srv.set_random_faults(0.05, SOAK_FAULTS, seed=12)
    client = q.AsyncEmbeddingClient(
        base_url=srv.base_url, retry=BATCH_RETRY, batch_size=32, max_concurrency=4
    )
    before = _retries(client.config.endpoint)
    arr = await client.embed_documents_array(SOAK_TEXTS)
    _soak_check(srv, arr, client.config.endpoint, before)


def test_server_down_two_seconds_mid_run(wait_until: Any) -> None:
    with EmbeddingServer(latency=0.002) as srv:
        client = q.EmbeddingClient(
            base_url=srv.base_url, retry=BATCH_RETRY, batch_size=16, max_concurrency=2
        )
        retries_before = _retries(client.config.endpoint)

        def outage() -> None:  # once the run is under way (250 requests in all)
            wait_until(lambda: srv.requests >= 10, "the run to reach the server")
            srv.restart(downtime=2.0)

        restarter = threading.Thread(target=outage)
        restarter.start()
        try:
            arr = client.embed_documents_array(SOAK_TEXTS[:4000])
        finally:
            restarter.join()
        np.testing.assert_array_equal(arr, expected_embeddings(SOAK_TEXTS[:4000]))
        # the outage really happened mid-run: requests failed and were retried
        assert _retries(client.config.endpoint) > retries_before


def test_rate_limit_retry_after_is_honoured(srv: EmbeddingServer) -> None:
    srv.inject_status(429, retry_after=0.4)
    client = q.EmbeddingClient(base_url=srv.base_url)
    started = time.monotonic()
    assert len(client.embed_query("after 429")) == 1024
    assert time.monotonic() - started >= 0.35
    assert srv.requests == 2


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, q.BadRequestError),
        (401, q.AuthenticationError),
        (404, q.NotFoundError),
        (422, q.BadRequestError),
    ],
)
def test_client_errors_are_not_retried(
    embedding_server: EmbeddingServer, status: int, cls: type
) -> None:
    srv = embedding_server  # a new server: whether it takes one-item lists is not known yet
    srv.poison("x", status=status, message="nope")
    client = q.EmbeddingClient(base_url=srv.base_url)
    with pytest.raises(cls) as info:
        client.embed_documents(["x"])
    assert info.value.status == status  # type: ignore[attr-defined]
    assert "nope" in str(info.value)
    if cls is q.BadRequestError:
        # not retried as such: a 400 naming no input could be about the request, and
        # nothing succeeded yet, so one control request ("hello", answered) showed the
        # server working; then the text went once as a bare string (a server may refuse
        # one-item lists), refused too: the input's, final (never sent a third time)
        assert srv.received == [["x"], ["hello"], ["x"]]
        assert info.value.index == 0  # type: ignore[attr-defined]
    else:  # 401 / 404: the endpoint's, never an input's
        assert srv.received == [["x"]]


@pytest.mark.parametrize(("kind", "words"), [("nan", "NaN"), ("zero", "all zeros")])
def test_bad_vectors_raise_naming_the_index(srv: EmbeddingServer, kind: str, words: str) -> None:
    srv.inject(kind, index=2)
    client = q.EmbeddingClient(base_url=srv.base_url, encoding_format="float")
    with pytest.raises(q.ResponseError) as info:
        client.embed_documents(["t0", "t1", "t2", "t3"])
    assert words in str(info.value)
    assert info.value.index == 2
    assert "input index 2" in str(info.value)
    assert srv.requests == 1  # deterministic: not retried


FAST = q.RetryConfig(backoff_initial=0.01, backoff_max=0.02)


@pytest.mark.parametrize(
    ("kind", "words"), [("wrong_count", "embeddings for"), ("malformed", "not valid JSON")]
)
def test_an_answer_that_does_not_fit_the_batch_is_a_refusal(
    srv: EmbeddingServer, kind: str, words: str
) -> None:
    """A batch answered with the wrong count (or a body that is no answer): refused;
    a control request shows the server working, the halves go through: every vector.
    Every time: the server's own error after the batch and the control."""
    srv.inject(kind)
    client = q.EmbeddingClient(base_url=srv.base_url, encoding_format="float", retry=FAST)
    texts = ["t0", "t1", "t2", "t3"]
    np.testing.assert_allclose(client.embed_documents(texts), expected_embeddings(texts), atol=1e-6)
    assert srv.received == [texts, ["hello"], texts[:2], texts[2:]]
    srv.reset_counters()
    srv.inject(kind, count=2)
    other = q.EmbeddingClient(base_url=srv.base_url, encoding_format="float", retry=FAST)
    with pytest.raises(q.ResponseError, match=words) as info:
        other.embed_documents([f"fresh {t}" for t in texts])
    assert info.value.index is None
    assert srv.requests == 2  # the batch and the control: the server's, not an input's


def test_overload_is_an_outage_retried_until_the_deadline(srv: EmbeddingServer) -> None:
    """503 "queue full" is retried past max_attempts (an outage costs time, not the
    call), and only the call's deadline ends it."""
    srv.inject_overloaded(count=10)
    fast = q.RetryConfig(max_attempts=3, backoff_initial=0.01, backoff_max=0.02)
    client = q.EmbeddingClient(base_url=srv.base_url, retry=fast)
    assert len(client.embed_query("busy")) == srv.dim
    assert srv.requests == 11  # ten refusals, then the answer
    srv.reset_counters()
    srv.inject_overloaded(count=10_000)
    # a deadline that a loaded machine answers well within, several times over (a call
    # that no answer reached before its deadline ends on the timeout: no server said
    # anything; tests/test_engine_script.py shows both endings without a clock race)
    short = q.EmbeddingClient(
        base_url=srv.base_url, retry=fast.replace(query_deadline=2.0, circuit_failure_threshold=0)
    )
    with pytest.raises(q.OverloadedError, match="request queue is full"):
        short.embed_query("still busy")
    assert srv.requests > 3  # max_attempts does not bound an outage
    srv.clear_faults()


def test_circuit_breaker_fails_fast_on_dead_endpoint() -> None:
    srv = EmbeddingServer()
    srv.start()
    url = srv.base_url
    srv.stop()
    client = q.EmbeddingClient(
        base_url=url,
        retry=q.RetryConfig(
            backoff_initial=0.01,
            backoff_max=0.02,
            query_deadline=5.0,  # not what is tested: ended by wait_for_server (2 s)
            circuit_failure_threshold=4,
            circuit_cooldown=30.0,
            circuit_open_after=0.0,
        ),
    )
    # the first call retries the refused connection until its deadline...
    with pytest.raises(q.ConnectError, match="cannot connect"):
        client.embed_query("down")
    # ...then a new call fails at once, naming the last failure (also its cause)
    with pytest.raises(q.CircuitOpenError, match="circuit open") as info:
        client.embed_query("down")
    assert "cannot connect" in str(info.value)
    assert isinstance(info.value.__cause__, q.ConnectError)
    assert isinstance(info.value.last_error, q.ConnectError)


def test_open_circuit_sends_nothing() -> None:
    """Failing fast means no request leaves: counted on the server, not timed."""
    with EmbeddingServer() as srv:  # its own endpoint: a breaker of its own
        srv.inject_status(503, count=10_000)
        client = q.EmbeddingClient(
            base_url=srv.base_url,
            retry=q.RetryConfig(
                max_attempts=1,  # one request per call: the breaker opens on a count, not a time
                circuit_failure_threshold=4,
                circuit_cooldown=600.0,  # no probe while the test runs, however slow
                circuit_open_after=0.0,
            ),
        )
        for _ in range(4):
            with pytest.raises(q.OverloadedError):
                client.embed_query("down")
        sent = srv.requests
        assert sent == 4
        srv.clear_faults()
        with pytest.raises(q.CircuitOpenError, match="circuit open") as info:
            client.embed_query("healthy again, but the circuit is open")
        assert info.value.retry_in > 0
        assert srv.requests == sent  # nothing was sent


def test_batch_too_large_is_split_and_remembered() -> None:
    with EmbeddingServer(max_batch=10) as srv:
        client = q.EmbeddingClient(base_url=srv.base_url, batch_size=32)
        texts = SOAK_TEXTS[:95]
        np.testing.assert_array_equal(
            client.embed_documents_array(texts), expected_embeddings(texts)
        )
        srv.reset_counters()
        np.testing.assert_array_equal(
            client.embed_documents_array(texts), expected_embeddings(texts)
        )
        assert srv.requests == 10  # the limit was learned: no more rejected batches


def test_distinct_timeouts() -> None:
    with EmbeddingServer() as srv:
        srv.inject("delay", seconds=600.0)  # ended when the server stops, below
        slow = q.EmbeddingClient(
            base_url=srv.base_url,
            timeout=q.Timeouts(read=0.2),
            retry=q.RetryConfig(max_attempts=1),
        )
        with pytest.raises(q.ReadTimeout, match=r"Timeouts\.read"):
            slow.embed_query("slow")
    # a port nobody listens on refuses at once: ConnectError, not a timeout
    dead = q.EmbeddingClient(base_url=srv.base_url, retry=q.RetryConfig(max_attempts=1))
    with pytest.raises(q.ConnectError):
        dead.embed_query("nobody home")


def test_pool_timeout_is_its_own_error(wait_until: Any) -> None:
    with EmbeddingServer() as srv:
        srv.inject("delay", seconds=600.0)  # the holder's request, until we drop it
        client = q.EmbeddingClient(
            base_url=srv.base_url,
            limits=q.Limits(max_connections=1),
            timeout=q.Timeouts(pool=0.1),
            retry=q.RetryConfig(max_attempts=1),
        )
        held: list[object] = []

        def hold() -> None:
            try:
                held.append(client.embed_query("holder"))
            except q.QwenEmbedError as exc:
                held.append(exc)

        holder = threading.Thread(target=hold)
        holder.start()
        wait_until(lambda: srv.requests == 1, "the holder's request to reach the server")
        with pytest.raises(q.PoolTimeout, match=r"Timeouts\.pool") as info:
            client.embed_documents(["a", "b"])
        assert isinstance(info.value, q.TimeoutException)
        assert not isinstance(info.value, q.ReadTimeout | q.ConnectTimeout)
        srv.close_connections()  # the holder fails and frees the slot
        holder.join()
        # the holder's connection was dropped: one control request ("hello") showed the
        # server working, so its text was sent once more, and went through
        (vector,) = held
        assert isinstance(vector, list), vector
        assert len(vector) == srv.dim
        # the timed-out call never reached the server
        texts = [t for batch in srv.received for t in batch]
        assert "a" not in texts
        assert "b" not in texts
        assert sum("holder" in t for t in texts) == 2


async def test_no_pool_timeout_under_500_concurrent_calls() -> None:
    with EmbeddingServer() as srv:
        client = q.AsyncEmbeddingClient(base_url=srv.base_url)
        texts = [f"concurrent {i}" for i in range(500)]
        results = await asyncio.gather(*(client.embed_query_array(t) for t in texts))
        assert len(results) == 500
        assert srv.connections_opened <= client.config.limits.max_connections


# The loopback server (not the client) leaks its side of a connection whose TLS handshake the
# client refused; collect it inside this test, where that ResourceWarning is expected.
@pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")
def test_tls_verification_on_by_default_and_custom_ca() -> None:
    _tls_verification_case()
    gc.collect()


def _tls_verification_case() -> None:
    with EmbeddingServer(tls=True) as srv:
        assert srv.base_url.startswith("https://")
        strict = q.EmbeddingClient(base_url=srv.base_url, retry=q.RetryConfig(max_attempts=1))
        with pytest.raises(q.ConnectError, match="certificate verification failed"):
            strict.embed_query("tls")
        trusted = q.EmbeddingClient(base_url=srv.base_url, verify=str(srv.ca_cert_path))
        assert len(trusted.embed_query("tls")) == 1024


def test_http2_over_tls_is_negotiated() -> None:
    with EmbeddingServer(tls=True, http2=True) as srv:
        client = q.EmbeddingClient(
            base_url=srv.base_url,
            verify=str(srv.ca_cert_path),
            http2=True,
            batch_size=4,
            max_concurrency=4,
        )
        texts = SOAK_TEXTS[:64]
        retries_before = _retries(client.config.endpoint)
        try:
            arr = client.embed_documents_array(texts)
            version = health_version(client, srv.url + "/health")
        finally:
            q.close_all()  # let the server shut down without waiting for our connections
        np.testing.assert_array_equal(arr, expected_embeddings(texts))
        assert version == "HTTP/2"
        # 16 batches: a request resent after its connection was dropped (seen once on a
        # loaded machine: "Server disconnected", retried) reached the server twice and is
        # counted by the client as a retry; nothing else is sent twice
        assert srv.requests == 16 + _retries(client.config.endpoint) - retries_before
        # multiplexed: at most one connection per batch racing the first h2 handshake
        # (httpcore opens them before it knows the server speaks h2)
        assert srv.connections_opened <= 4


def test_h2c_falls_back_to_http1_when_server_lacks_it(srv: EmbeddingServer) -> None:
    client = q.EmbeddingClient(base_url=srv.base_url, http2=True)  # uvicorn: HTTP/1.1 only
    np.testing.assert_array_equal(
        client.embed_documents_array(["h2c?"]), expected_embeddings(["h2c?"])
    )


_text = st.text(max_size=40)
_item = st.one_of(
    _text,
    st.none(),
    st.integers(),
    st.binary(max_size=4),
    st.lists(_text, max_size=2),
    st.floats(allow_nan=True),
)


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(items=st.lists(_item, max_size=6))
def test_any_input_gives_a_clear_error_or_a_correct_result(
    srv: EmbeddingServer, items: list[object]
) -> None:
    client = q.EmbeddingClient(base_url=srv.base_url, retry=q.RetryConfig(max_attempts=2))
    valid = all(isinstance(t, str) and t.strip() for t in items)  # [] included: no request
    if valid:
        arr = client.embed_documents_array(items)  # type: ignore[arg-type]
        np.testing.assert_array_equal(arr, expected_embeddings(items))  # type: ignore[arg-type]
    else:
        with pytest.raises(q.InputError) as info:
            client.embed_documents(items)  # type: ignore[arg-type]
        bad = next(i for i, t in enumerate(items) if not (isinstance(t, str) and t.strip()))
        assert info.value.index == bad


def health_version(client: q.EmbeddingClient, url: str) -> str:
    """The HTTP version of a ``GET /health`` sent through the client's shared pool."""
    from qwen_embed_plugins._transport import Request
    from qwen_embed_plugins.errors import ErrorContext

    config = client.config
    ctx = ErrorContext(url=config.endpoint)
    req = Request("GET", url, b"", {}, config.timeouts, 30.0, 1 << 20, ctx)
    return pool.sync_transport(config.pool_key).send(req).http_version
