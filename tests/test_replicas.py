"""Replicas: one logical endpoint over several servers (issue 15, item 1).

Every test talks to real loopback servers (`EmbeddingServer`, thread mode; process mode
where a server is killed). Counts come from the servers the tests own or from the
client's own per-replica counters; nothing waits on a sleep standing in for "the request
has arrived".
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import qwen_embed_plugins as q
from qwen_embed_plugins import _balance as balance
from qwen_embed_plugins import _learn as learn
from qwen_embed_plugins import _pool as pool
from qwen_embed_plugins._metrics import prometheus_collector
from qwen_embed_tooling import testing
from qwen_embed_tooling.testing import EmbeddingServer, expected_embeddings

FAST = q.RetryConfig(backoff_initial=0.01, backoff_max=0.1, deadline=120.0)


def _texts(n: int, tag: str) -> list[str]:
    return [f"{tag} passage {i} on topic {i % 89}" for i in range(n)]


def _label(url: str) -> str:
    return q.EmbeddingConfig(base_url=url).endpoint


def _states(client: q.EmbeddingClient) -> dict[str, learn.ReplicaState]:
    """What the process learned about each replica (by base URL) for the client's model."""
    model = client.config.model or ""
    return {r.url: r.state(model) for r in balance.endpoint_for(client.config).replicas}


def _counter(label: str, name: str) -> int:
    return int(q.stats().get(label, {}).get(name, 0))


def _wait_for(condition: Callable[[], bool], what: str, alive: threading.Thread) -> None:
    """Poll ``condition`` (a server-side counter) while the run under way is alive."""
    while not condition():
        if not alive.is_alive():
            raise AssertionError(f"the run ended before {what}")
        time.sleep(0.002)


@contextlib.contextmanager
def _servers(*settings: dict[str, Any]) -> Iterator[list[EmbeddingServer]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(EmbeddingServer(**s)) for s in settings]


@pytest.fixture(scope="module")
def trio() -> Iterator[list[EmbeddingServer]]:
    """Three default servers with some latency, so that concurrent batches overlap."""
    with _servers(*({"latency": 0.02} for _ in range(3))) as servers:
        yield servers


# --------------------------------------------------------------------------- settings


def test_list_and_env_name_one_endpoint_in_any_order(
    trio: list[EmbeddingServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, c = (s.base_url for s in trio)
    config = q.EmbeddingConfig(base_url=[a, b, c])
    assert config.replicas == tuple(sorted((a, b, c)))
    assert config.endpoint == ",".join(_label(u) for u in sorted((a, b, c)))
    monkeypatch.setenv("QWEN_EMBED_BASE_URL", f"{c}, {a}/,{b}")  # spaces, a trailing slash
    from_env = q.EmbeddingConfig()
    assert from_env == config
    assert hash(from_env) == hash(config)
    keys = [config.pool_key_for(u) for u in config.replicas]
    assert len(set(keys)) == 3
    endpoint = balance.endpoint_for(config)
    assert [r.key for r in endpoint.replicas] == keys
    for order in itertools.permutations((a, b, c)):
        other = q.EmbeddingConfig(base_url=list(order))
        assert other == config
        assert [other.pool_key_for(u) for u in other.replicas] == keys
        assert balance.endpoint_for(other) is endpoint
    assert balance.endpoint_for(from_env) is endpoint
    # a subset is another endpoint, but its replicas are the same process-wide objects
    pair = balance.endpoint_for(q.EmbeddingConfig(base_url=[b, a]))
    assert pair is not endpoint
    assert set(pair.replicas) < set(endpoint.replicas)


def test_each_configs_breaker_settings_apply_to_shared_replicas() -> None:
    """Equal lists share replicas (pools, health, learned state), but the breaker
    settings are each config's own: a client with ``circuit_cooldown=0.5`` must not get
    the cool-down of whichever config named these replicas first."""
    urls = ["http://127.0.0.1:9/v1", "http://127.0.0.1:7/v1"]  # never contacted
    slow = q.EmbeddingConfig(
        base_url=urls, retry=q.RetryConfig(circuit_cooldown=30.0, circuit_open_after=20.0)
    )
    quick = q.EmbeddingConfig(
        base_url=urls, retry=q.RetryConfig(circuit_cooldown=0.5, circuit_open_after=1.0)
    )
    first, second = balance.endpoint_for(slow), balance.endpoint_for(quick)
    assert set(first.replicas) == set(second.replicas)  # the same process-wide replicas
    assert (first.cooldown, first.open_after) == (30.0, 20.0)
    assert (second.cooldown, second.open_after) == (0.5, 1.0)


def test_clients_of_equal_lists_share_pools(trio: list[EmbeddingServer]) -> None:
    urls = [s.base_url for s in trio]
    first = q.EmbeddingClient(base_url=urls, batch_size=4)
    second = q.EmbeddingClient(base_url=list(reversed(urls)), batch_size=4)
    texts = _texts(48, "share")
    want = expected_embeddings(texts)
    np.testing.assert_array_equal(first.embed_documents_array(texts), want)
    np.testing.assert_array_equal(second.embed_documents_array(texts), want)
    for url in urls:
        key = first.config.pool_key_for(url)
        assert key == second.config.pool_key_for(url)
        assert pool.sync_transport(key) is pool.sync_transport(second.config.pool_key_for(url))
    stats = q.pool_stats()
    for url in urls:
        assert stats[_label(url)]["pools"] == 1  # one pool per replica, shared


def test_both_adapters_take_the_list_unchanged(trio: list[EmbeddingServer]) -> None:
    urls = [s.base_url for s in trio]
    texts = _texts(40, "adapters")
    want = expected_embeddings(texts)
    lc = q.QwenPooledEmbeddings(base_url=list(reversed(urls)), batch_size=4, max_concurrency=4)
    li = q.QwenPooledEmbedding(base_url=urls, embed_batch_size=4, max_concurrency=4)
    assert lc.config.replicas == li.config.replicas == tuple(sorted(urls))
    assert balance.endpoint_for(lc.config) is balance.endpoint_for(li.config)
    for server in trio:
        server.reset_counters()
    np.testing.assert_array_equal(np.asarray(lc.embed_documents(texts), dtype=np.float32), want)
    np.testing.assert_array_equal(
        np.asarray(li.get_text_embedding_batch(texts), dtype=np.float32), want
    )
    assert sum(s.texts for s in trio) == 2 * len(texts)  # none lost, none sent twice
    assert all(s.requests > 0 for s in trio), [s.requests for s in trio]


# --------------------------------------------------------------------------- balancing


def test_slow_replica_gets_fewer_batches() -> None:
    """Fewest requests in flight: a replica 5x slower holds its batches 5x longer, so it
    is picked far less often than the fast ones (round-robin would give each a third)."""
    with _servers({"latency": 0.02}, {"latency": 0.02}, {"latency": 0.1}) as servers:
        *fast, slow = servers
        client = q.EmbeddingClient(
            base_url=[s.base_url for s in servers], batch_size=16, max_concurrency=6
        )
        texts = _texts(2400, "balance")
        arr = client.embed_documents_array(texts)
        np.testing.assert_array_equal(arr, expected_embeddings(texts))
        counts = [s.requests for s in servers]
        print(f"requests per replica (fast, fast, slow): {counts}")
        assert sum(counts) == 150  # each batch once: no resends, no duplicates
        assert sum(s.texts for s in servers) == len(texts)
        assert slow.requests * 2 < min(s.requests for s in fast), counts


async def test_slow_replica_gets_fewer_batches_async() -> None:
    with _servers({"latency": 0.02}, {"latency": 0.02}, {"latency": 0.1}) as servers:
        *fast, slow = servers
        client = q.AsyncEmbeddingClient(
            base_url=[s.base_url for s in servers], batch_size=16, max_concurrency=6
        )
        texts = _texts(2400, "balance-async")
        arr = await client.embed_documents_array(texts)
        np.testing.assert_array_equal(arr, expected_embeddings(texts))
        counts = [s.requests for s in servers]
        assert sum(s.texts for s in servers) == len(texts)
        assert slow.requests * 2 < min(s.requests for s in fast), counts


# --------------------------------------------------------------------------- a replica dies


def _release(server: EmbeddingServer) -> None:
    """Release a process-mode server whose process was killed. ``close()`` tries to stop
    the dead child first and raises ``RuntimeError`` before closing its pipes (reported
    to the lead), hence the second step."""
    with contextlib.suppress(RuntimeError):
        server.close()
    child = server._child
    if child is not None:
        child.close()


def test_replica_killed_mid_run_loses_nothing_and_is_probed_back() -> None:
    """SIGKILL one of three server processes while a big call runs on another thread,
    with batches hanging on it: every vector arrives exactly once, in order, from the
    others; once a server listens on that port again it gets requests after the
    cool-down, not before."""
    settings: dict[str, Any] = {"process": True, "latency": 0.005, "received_limit": 100_000}
    texts = _texts(6000, "kill")
    want = expected_embeddings(texts)
    retry = FAST.replace(circuit_cooldown=5.0, circuit_open_after=30.0)
    victim = EmbeddingServer(**settings).start()
    try:
        with _servers(settings, settings) as survivors:
            _killed_mid_run(victim, survivors, texts, want, retry, settings)
    finally:
        _release(victim)


def _killed_mid_run(
    victim: EmbeddingServer,
    survivors: list[EmbeddingServer],
    texts: list[str],
    want: np.ndarray,
    retry: q.RetryConfig,
    settings: dict[str, Any],
) -> None:
    servers = [victim, *survivors]
    client = q.EmbeddingClient(
        base_url=[s.base_url for s in servers], batch_size=20, max_concurrency=6, retry=retry
    )
    labels = {s: _label(s.base_url) for s in servers}
    delivered_before = {s: _counter(labels[s], "texts") for s in servers}
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["arr"] = client.embed_documents_array(texts)
        except BaseException as exc:  # reported by the assertion below
            outcome["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    try:
        _wait_for(lambda: victim.requests >= 20, "the victim served 20 requests", worker)
        # from now on the victim holds every request it gets: batches hang on it
        victim.inject("delay", seconds=120.0, count=100_000)
        _wait_for(
            lambda: victim.stats()["faults_applied"].get("delay", 0) >= 2,
            "two batches hung on the victim",
            worker,
        )
        # every text the victim could ever answer was logged before it hung
        seen_by_victim = {t for batch in victim.received for t in batch}
        os.kill(victim.pid, signal.SIGKILL)
    finally:
        worker.join()
    assert "error" not in outcome, outcome.get("error")
    np.testing.assert_array_equal(outcome["arr"], want)  # 0 lost, 0 misordered

    delivered = {s: _counter(labels[s], "texts") - delivered_before[s] for s in servers}
    print(f"texts delivered per replica (victim first): {list(delivered.values())}")
    assert sum(delivered.values()) == len(texts)  # no text delivered twice
    from_survivors = [t for s in survivors for batch in s.received for t in batch]
    assert len(from_survivors) == len(set(from_survivors))  # none sent twice to them
    assert len(from_survivors) == len(texts) - delivered[victim]
    for s in survivors:
        assert s.texts == delivered[s]  # what they answered reached the client once
    missing = set(texts) - set(from_survivors)
    assert missing <= seen_by_victim  # the rest came from the victim, before it hung
    assert _counter(labels[victim], "retries") >= 2  # the hung batches were resent
    endpoint = balance.endpoint_for(client.config)
    replica = next(r for r in endpoint.replicas if r.url == victim.base_url)
    assert replica.ejections >= 1
    # the kill's failures: a hung batch's connection reset (counted once the batch
    # succeeded elsewhere) or a refused connection; which came last is the scheduler's
    assert isinstance(replica.last_error, q.ConnectError | q.NetworkError), replica.last_error

    # a server on the same port again: no request reaches it while the replica is
    # ejected; after the cool-down a probe does, then it takes its share again
    with EmbeddingServer(port=victim.port, **settings) as reborn:
        probe = _texts(8, "probe")
        while_ejected = 0
        while reborn.requests == 0:
            ejected_until = replica.ejected_until
            np.testing.assert_array_equal(
                client.embed_documents_array(probe), expected_embeddings(probe)
            )
            if time.monotonic() < ejected_until:
                while_ejected += 1
                assert reborn.requests == 0, "a request reached an ejected replica"
            time.sleep(0.01)
        print(f"probed back; {while_ejected} calls went elsewhere during its cool-down")
        assert replica.ejected_until == 0.0  # the probe's success readmitted it
        assert replica.failures == 0
        for s in (*survivors, reborn):
            s.reset_counters()
        more = _texts(1200, "after")
        np.testing.assert_array_equal(client.embed_documents_array(more), expected_embeddings(more))
        shares = [s.texts for s in (*survivors, reborn)]
        assert sum(shares) == len(more)
        assert reborn.texts >= len(more) // 10, shares


@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("status", {"status": 503}),
        ("status", {"status": 502}),
        ("delay", {"seconds": 30.0}),
        ("close", {}),
        ("reset", {"after_bytes": 0}),
        ("status", {"status": 500}),
    ],
    ids=["503", "502", "read-timeout", "close", "reset", "500"],
)
def test_a_replica_failing_every_request_is_ejected_and_blames_no_input(
    kind: str, params: dict[str, Any]
) -> None:
    """Issue 15: the health signals are connect errors, resets, 5xx and timeouts. A
    replica that fails every request in one of those ways while another is healthy is
    ejected, its batches are resent on the healthy one, and no input is blamed (no
    bisection down to single texts, no batch limit learned from its failures)."""
    with _servers({"latency": 0.005}, {"latency": 0.005}) as (bad, good):
        bad.inject(kind, count=100_000, **params)
        client = q.EmbeddingClient(
            base_url=[bad.base_url, good.base_url],
            batch_size=10,
            max_concurrency=4,
            retry=FAST,
            # past the good one's answers however loaded the machine (a read timeout
            # there would resend a batch it answered), far below the bad one's delay
            timeout=q.Timeouts(read=5.0),
        )
        texts = _texts(200, f"bad-{kind}")
        result = client.embed_documents(texts, on_error="skip")
        assert result.errors == {}, sorted(result.errors.items())[:3]
        np.testing.assert_array_equal(
            np.asarray(result, dtype=np.float32), expected_embeddings(texts)
        )
        assert good.texts == len(texts)
        replica = next(
            r for r in balance.endpoint_for(client.config).replicas if r.url == bad.base_url
        )
        assert replica.ejections >= 1
        assert replica.state(client.config.model or "").batch.limit is None


@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("status", {"status": 503}),
        ("status", {"status": 502}),
        ("delay", {"seconds": 30.0}),
        ("close", {}),
        ("reset", {"after_bytes": 0}),
    ],
    ids=["503", "502", "read-timeout", "close", "reset"],
)
def test_a_batch_whose_replica_failed_is_resent_on_another_at_once(
    kind: str, params: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 15: "a batch whose replica failed is resent on another at once". Every
    retry of a batch that failed on the bad replica, while the good one is available,
    goes without a backoff wait (the library logs each retry with its wait, at DEBUG)."""
    caplog.set_level(logging.DEBUG, logger="qwen_embed_plugins")
    with _servers({"latency": 0.005}, {"latency": 0.005}) as (bad, good):
        bad.inject(kind, count=100_000, **params)
        client = q.EmbeddingClient(
            base_url=[bad.base_url, good.base_url],
            batch_size=10,
            max_concurrency=4,
            retry=q.RetryConfig(backoff_initial=1.0, backoff_max=1.0, circuit_cooldown=60.0),
            timeout=q.Timeouts(read=5.0),  # see the test above
        )
        texts = _texts(100, f"at-once-{kind}")
        result = client.embed_documents(texts, on_error="skip")
        np.testing.assert_array_equal(
            np.asarray(result, dtype=np.float32), expected_embeddings(texts)
        )
    waits = [
        (r.args[1], r.args[2])
        for r in caplog.records
        if isinstance(r.args, tuple)
        and r.msg.startswith("retrying")
        and r.args[0] == _label(bad.base_url)
    ]
    assert waits, "the bad replica's failures were not retried"
    assert all(wait == 0.0 for _, wait in waits), waits


def test_an_ejected_replica_is_probed_by_one_request_at_a_time() -> None:
    """After the cool-down one request probes the ejected replica; the other batches
    keep going to the healthy one until the probe is answered."""
    with _servers({"latency": 0.005}, {"latency": 0.02}) as (bad, good):
        bad.inject("delay", seconds=0.8, count=100_000)  # each request hangs past read=0.5
        client = q.EmbeddingClient(
            base_url=[bad.base_url, good.base_url],
            batch_size=10,
            max_concurrency=4,
            retry=FAST.replace(circuit_cooldown=1.0),
            timeout=q.Timeouts(read=0.5),
        )
        texts = _texts(400, "probe-once")
        np.testing.assert_array_equal(
            client.embed_documents_array(texts), expected_embeddings(texts)
        )
        replica = next(
            r for r in balance.endpoint_for(client.config).replicas if r.url == bad.base_url
        )
        assert replica.ejections >= 1
        while bad.stats()["in_flight"]:  # the hung requests end on the server's side
            time.sleep(0.01)
        bad.reset_counters()
        time.sleep(max(0.0, replica.ejected_until - time.monotonic()))  # the cool-down
        np.testing.assert_array_equal(
            client.embed_documents_array(texts), expected_embeddings(texts)
        )
        assert bad.requests >= 1  # it was probed
        assert bad.stats()["max_in_flight"] == 1, bad.stats()


# --------------------------------------------------------------------------- all down


def _dead_urls(n: int) -> list[str]:
    urls = []
    for _ in range(n):
        server = EmbeddingServer()
        server.start()
        urls.append(server.base_url)
        server.close()
    return urls


def _down_client() -> tuple[q.EmbeddingClient, list[str]]:
    """A client of three replicas that all refuse connections, and their labels."""
    urls = _dead_urls(3)
    client = q.EmbeddingClient(
        base_url=urls,
        retry=q.RetryConfig(
            backoff_initial=0.01,
            backoff_max=0.05,
            deadline=1.0,
            query_deadline=1.0,
            circuit_failure_threshold=3,
            circuit_cooldown=60.0,
            circuit_open_after=0.0,
        ),
    )
    return client, sorted(_label(u) for u in urls)


def test_all_replicas_down_a_new_call_fails_fast_naming_each_replica() -> None:
    client, labels = _down_client()
    with pytest.raises(q.ConnectError):  # the first call retries until its deadline
        client.embed_documents(["nobody home"])
    # each replica's circuit opens after 3 refused connections; on a loaded machine the
    # first call's 1 s deadline can end before every replica has had 3, so calls go on
    # (each adds failures) until one fails fast: a bounded number of them
    for _ in range(20):
        try:
            client.embed_documents(["still nobody"])
        except q.CircuitOpenError as exc:
            error = exc
            break
        except q.ConnectError:
            continue
    else:
        pytest.fail("no call failed fast with CircuitOpenError after 20 calls")
    assert "circuit open" in str(error)
    assert sorted(error.failures) == labels
    for label, failure in error.failures.items():
        assert isinstance(failure, q.ConnectError)
        assert label in str(failure)
        assert f"{label}: {failure}" in str(error)
    assert isinstance(error.__cause__, q.ConnectError)


def test_all_replicas_down_a_call_under_way_names_each_replica_at_its_deadline() -> None:
    """The call that was already running when every replica went down ends at its
    deadline with an error saying what each replica last did, not only the last one."""
    client, labels = _down_client()
    with pytest.raises(q.ConnectError) as info:
        client.embed_documents(["nobody home"])
    message = str(info.value)
    missing = [label for label in labels if label not in message]
    assert not missing, f"{missing} not named in: {message}"


# --------------------------------------------------------------------------- learned state


def test_batch_limit_is_learned_per_replica() -> None:
    """One replica states a limit of 5 texts, the other has none: after learning, only
    the limited one gets small batches."""
    with _servers({"max_batch": 5, "latency": 0.005}, {"latency": 0.005}) as (limited, free):
        client = q.EmbeddingClient(
            base_url=[limited.base_url, free.base_url], batch_size=20, max_concurrency=2
        )
        texts = _texts(400, "limits")
        np.testing.assert_array_equal(
            client.embed_documents_array(texts), expected_embeddings(texts)
        )
        assert limited.stats()["responses"].get("400", 0) >= 1  # it said so, once or twice
        states = _states(client)
        assert states[limited.base_url].batch.limit == 5
        assert states[free.base_url].batch.limit is None
        limited.reset_counters()
        free.reset_counters()
        np.testing.assert_array_equal(
            client.embed_documents_array(texts), expected_embeddings(texts)
        )
        assert limited.stats()["responses"] == {"200": limited.requests}  # no refusal
        assert max(len(batch) for batch in limited.received) <= 5
        free_sizes = [len(batch) for batch in free.received]
        print(f"batch sizes on the unlimited replica: {sorted(set(free_sizes))}")
        assert max(free_sizes) == 20, "the unlimited replica got only small batches"


def test_server_is_identified_per_replica() -> None:
    with _servers({"dialect": "sglang"}, {"dialect": "vllm"}) as (sglang, vllm):
        client = q.EmbeddingClient(
            base_url=[sglang.base_url, vllm.base_url], batch_size=4, max_concurrency=2
        )
        texts = _texts(64, "dialects")
        np.testing.assert_array_equal(
            client.embed_documents_array(texts), expected_embeddings(texts)
        )
        assert sglang.requests > 0
        assert vllm.requests > 0
        states = _states(client)
        assert states[sglang.base_url].profile.name == "sglang"
        assert states[vllm.base_url].profile.name == "vllm"


class _NoBase64Dialect(testing.SGLangDialect):
    """An SGLang build that refuses ``encoding_format="base64"`` (as old ones did)."""

    name: ClassVar[str] = "sglang-no-base64"

    def encoding(self, value: Any) -> Any:
        if value == "base64":
            return self.request_error("encoding_format 'base64' is not supported")
        return super().encoding(value)


def test_base64_refusal_is_learned_for_that_replica_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(testing.DIALECTS, _NoBase64Dialect.name, _NoBase64Dialect)
    with _servers(
        {"dialect": _NoBase64Dialect.name, "latency": 0.005}, {"latency": 0.005}, {"latency": 0.005}
    ) as servers:
        refusing, *others = servers
        client = q.EmbeddingClient(
            base_url=[s.base_url for s in servers], batch_size=8, max_concurrency=3
        )
        texts = _texts(240, "b64")
        for _ in range(2):
            np.testing.assert_array_equal(
                client.embed_documents_array(texts), expected_embeddings(texts)
            )
        assert refusing.stats()["responses"].get("400", 0) >= 1
        refusals = refusing.stats()["responses"].get("400", 0)
        states = _states(client)
        assert states[refusing.base_url].base64_ok is False
        for s in others:
            assert states[s.base_url].base64_ok is True
            assert s.stats()["responses"] == {"200": s.requests}
        for s in servers:
            s.reset_counters()
        np.testing.assert_array_equal(
            client.embed_documents_array(texts), expected_embeddings(texts)
        )
        assert refusing.requests > 0
        assert refusing.stats()["responses"] == {"200": refusing.requests}  # float from now on
        fallbacks = {s: q.stats()[_label(s.base_url)]["fallbacks"] for s in servers}
        assert fallbacks[refusing].get("float_encoding") == 1
        for s in others:
            assert "float_encoding" not in fallbacks[s]
        assert refusals <= 3  # learned at once, not once per batch


class _Base64BreaksDialect(testing.SGLangDialect):
    """A server whose base64 path is broken: 500 for base64, float works."""

    name: ClassVar[str] = "sglang-base64-500"

    def encoding(self, value: Any) -> Any:
        if value == "base64":
            return self.error(500, "Internal Server Error", err_type="InternalServerError")
        return super().encoding(value)


def test_base64_failure_is_pinned_on_the_replica_that_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 500 with base64 that a float resend does not reproduce teaches *that* replica
    to use float: the float resend goes to the same replica, and a healthy replica that
    happens to answer it is not taught anything."""
    monkeypatch.setitem(testing.DIALECTS, _Base64BreaksDialect.name, _Base64BreaksDialect)
    # The broken replica is slower: after its 500 the healthy one has the lower latency
    # EWMA, so a resend left to the balancer goes there.
    with _servers({"dialect": _Base64BreaksDialect.name, "latency": 0.3}, {"latency": 0.005}) as (
        broken,
        healthy,
    ):
        client = q.EmbeddingClient(
            base_url=[broken.base_url, healthy.base_url],
            batch_size=8,
            max_concurrency=1,
            retry=FAST,
        )
        texts = _texts(80, "b64-500")
        np.testing.assert_array_equal(
            client.embed_documents_array(texts), expected_embeddings(texts)
        )
        assert broken.texts > 0  # it took batches, in float
        states = _states(client)
        assert states[broken.base_url].base64_ok is False
        assert states[healthy.base_url].base64_ok is True
        assert "float_encoding" not in q.stats()[_label(healthy.base_url)]["fallbacks"]


def test_dimensions_fallback_is_learned_per_replica() -> None:
    with _servers({"matryoshka": True, "latency": 0.005}, {"latency": 0.005}) as (mrl, plain):
        client = q.EmbeddingClient(
            base_url=[mrl.base_url, plain.base_url], dimensions=256, batch_size=8, max_concurrency=2
        )
        texts = _texts(160, "dims")
        want = expected_embeddings(texts, dimensions=256)
        for _ in range(2):
            got = client.embed_documents_array(texts)
            assert got.shape == (len(texts), 256)
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
        states = _states(client)
        assert states[plain.base_url].dimensions_ok is False
        assert states[mrl.base_url].dimensions_ok is not False
        assert mrl.stats()["responses"] == {"200": mrl.requests}  # never refused
        assert "client_side_dimensions" not in q.stats()[_label(mrl.base_url)]["fallbacks"]
        assert q.stats()[_label(plain.base_url)]["fallbacks"].get("client_side_dimensions") == 1


# --------------------------------------------------------------------------- stats


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
def counted() -> Iterator[tuple[list[EmbeddingServer], q.EmbeddingClient]]:
    """Three fresh servers and a client that embedded 300 texts through them."""
    with _servers(*({"latency": 0.01} for _ in range(3))) as servers:
        client = q.EmbeddingClient(
            base_url=[s.base_url for s in servers], batch_size=10, max_concurrency=3
        )
        client.embed_documents(_texts(300, "stats"))
        yield servers, client


def test_pool_stats_has_one_row_per_replica(
    counted: tuple[list[EmbeddingServer], q.EmbeddingClient],
) -> None:
    servers, _ = counted
    stats = q.pool_stats()
    for s in servers:
        row = stats[_label(s.base_url)]
        assert row["pools"] == 1
        assert row["requests"] == s.requests > 0
        assert row["texts"] == s.texts
        assert row["in_flight"] == 0
        assert row["connections_opened"] == s.connections_opened


def test_pool_stats_has_the_endpoint_total(
    counted: tuple[list[EmbeddingServer], q.EmbeddingClient],
) -> None:
    """Issue 15: per-replica rows *plus the endpoint total*, keyed by the endpoint label
    (``config.endpoint``: the replicas' labels, comma-separated)."""
    servers, client = counted
    stats = q.pool_stats()
    assert client.config.endpoint in stats, sorted(stats)
    total = stats[client.config.endpoint]
    assert total["requests"] == sum(s.requests for s in servers)
    assert total["texts"] == sum(s.texts for s in servers) == 300
    assert total["connections_opened"] == sum(s.connections_opened for s in servers)
    assert total["in_flight"] == 0


def test_prometheus_has_one_series_per_replica(
    counted: tuple[list[EmbeddingServer], q.EmbeddingClient],
) -> None:
    servers, _ = counted
    registry = CollectorRegistry()
    registry.register(prometheus_collector())
    samples = _samples(registry)
    for s in servers:
        endpoint = (("endpoint", _label(s.base_url)),)
        assert samples[("qwen_embed_texts_total", endpoint)] == s.texts
        assert samples[("qwen_embed_requests_total", (*endpoint, ("outcome", "ok")))] == s.requests


def test_prometheus_has_the_endpoint_total(
    counted: tuple[list[EmbeddingServer], q.EmbeddingClient],
) -> None:
    servers, client = counted
    registry = CollectorRegistry()
    registry.register(prometheus_collector())
    samples = _samples(registry)
    endpoint = (("endpoint", client.config.endpoint),)
    assert ("qwen_embed_texts_total", endpoint) in samples, sorted(
        k for k in samples if k[0] == "qwen_embed_texts_total"
    )
    assert samples[("qwen_embed_texts_total", endpoint)] == 300
    assert samples[("qwen_embed_requests_total", (*endpoint, ("outcome", "ok")))] == sum(
        s.requests for s in servers
    )


def test_a_slower_replica_is_probed_as_soon_as_its_cooldown_ends() -> None:
    """A replica ejected while it was the slower one: once its cooldown is over the next
    request probes it (its stale latency must not keep it out for good), and its
    success readmits it."""
    retry = q.RetryConfig(
        backoff_initial=0.01, backoff_max=0.05, circuit_cooldown=0.2, circuit_failure_threshold=2
    )
    with (
        EmbeddingServer(latency=0.0) as fast,
        EmbeddingServer(latency=0.03, process=True) as slow,
    ):
        client = q.EmbeddingClient(
            base_url=[fast.base_url, slow.base_url], retry=retry, batch_size=2, max_concurrency=4
        )
        replica = next(
            r for r in balance.endpoint_for(client.config).replicas if r.url == slow.base_url
        )
        for i in range(20):  # both answer; the slow one's latency average is the higher
            client.embed_query(f"warm {i}")
        assert slow.requests > 0
        slow.kill()  # its port closes: refused, ejected after two failures
        while replica.ejections == 0:  # 4 batches in flight: some go to the slow one
            client.embed_documents([f"down {i}" for i in range(16)])
        slow.start()
        slow.reset_counters()
        calls = 0
        while slow.requests == 0:
            ejected_until = replica.ejected_until
            client.embed_query(f"after {calls}")
            calls += 1
            if time.monotonic() < ejected_until:
                assert slow.requests == 0, "a request reached an ejected replica"
            assert calls < 100_000, "the replica was never probed"
        assert replica.ejected_until == 0.0


def test_a_server_on_a_slower_servers_port_is_ranked_afresh_after_reset() -> None:
    """How the test above could fail in CI ("the slow replica got no requests") when the
    suite forgot only the replicas' health between tests: its slow server got the port
    of an earlier test's slower one, the replica kept that server's latency average, and
    every sequential request went to the fast one. ``reset()`` (before each test)
    forgets it: an unmeasured replica is tried at once."""
    with EmbeddingServer(latency=0.0) as fast:
        with EmbeddingServer(latency=1.0) as old:  # far slower whatever the load
            port = old.port
            before = q.EmbeddingClient(base_url=[fast.base_url, old.base_url])
            for i in range(4):
                before.embed_query(f"old {i}")
            assert old.requests > 0
        with EmbeddingServer(port=port) as new:
            urls = [fast.base_url, new.base_url]
            for i in range(2):
                q.EmbeddingClient(base_url=urls).embed_query(f"inherited {i}")
            assert new.requests == 0  # the hazard: ranked on the old server's latency
            q.reset()
            client = q.EmbeddingClient(base_url=urls)
            for i in range(2):  # the first goes to either, the second to the unmeasured
                client.embed_query(f"fresh {i}")
            assert new.requests == 1


def test_no_batch_limit_is_learned_for_a_replica_from_pieces_another_took() -> None:
    """A batch dropped by both replicas (one drops anything over 4 texts, the other every
    request) is bisected; its pieces are all answered by the first. The second replica
    took none of them, so no batch limit is learned for it from that bisection."""
    with _servers({"latency": 0.002}, {"latency": 0.002}) as (small, broken):
        small.drop_batches_over(4)
        broken.inject("close", count=100_000)
        retry = FAST.replace(circuit_failure_threshold=100_000)  # keep both in rotation
        client = q.EmbeddingClient(
            base_url=[small.base_url, broken.base_url],
            batch_size=16,
            max_concurrency=1,
            retry=retry,
        )
        texts = _texts(96, "pieces")
        np.testing.assert_array_equal(
            client.embed_documents_array(texts), expected_embeddings(texts)
        )
        states = _states(client)
        assert states[broken.base_url].batch.limit is None
        assert broken.texts == 0
        limit = states[small.base_url].batch.limit
        assert limit is None or limit <= 4
