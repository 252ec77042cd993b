"""The adaptive batch size (``batch_size="auto"``, the default).

Unit tests drive ``batching.BatchSizer`` (and ``Engine.auto_batch_size``) with scripted
latencies, no sockets; loopback tests check what reaches a real server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins._batching import BatchSizer
from qwen_embed_plugins._engine import Engine
from qwen_embed_tooling.testing import EmbeddingServer, expected_embeddings

# --------------------------------------------------------------------------- decision


def drive(sizer: BatchSizer, latency: Callable[[int], float], answers: int) -> list[int]:
    """Ask for a size and answer it with ``latency(size)``, ``answers`` times, as a call
    with plenty of texts left would; the sizes asked for."""
    sizes = []
    for _ in range(answers):
        size = sizer.size(pressure=True)
        sizes.append(size)
        sizer.observe(size, latency(size))
    return sizes


def test_flat_latency_grows_to_the_ceiling() -> None:
    sizer = BatchSizer()
    sizes = drive(sizer, lambda n: 0.020, 30)
    assert sizes[0] == 32
    assert sizer.level == 2048
    assert sizes == sorted(sizes)  # only ever grows


def test_latency_proportional_to_the_batch_stops_at_the_start() -> None:
    # a GPU at work: 5 ms + 5.6 ms per text; doubling the batch doubles the latency
    sizer = BatchSizer()
    drive(sizer, lambda n: 0.005 + 0.0056 * n, 40)
    assert sizer.level in (32, 64)  # the knee: at most one doubling above the start
    assert sizer.settled
    assert sizer.knees >= 1


def test_grows_while_the_fixed_part_dominates_and_stops_at_the_knee() -> None:
    # 20 ms round trip + 100 us per text: nearly flat up to ~256 texts, then compute-bound
    sizer = BatchSizer()
    sizes = drive(sizer, lambda n: 0.020 + 0.0001 * n, 200)
    assert sizer.level == 512  # 1024 takes 1.72x as long as 512: the knee
    assert sizer.settled
    assert max(sizes) == 1024  # tried (and retried) above the knee, never further


def test_no_growth_without_pressure() -> None:
    sizer = BatchSizer()
    for _ in range(20):
        size = sizer.size(pressure=False)
        sizer.observe(size, 0.02)
    assert sizer.level == 32
    assert sizer.trial is None


def test_other_sizes_are_not_samples() -> None:
    sizer = BatchSizer()
    for _ in range(10):
        sizer.observe(7, 0.02)  # the tail of a call
    assert sizer.snapshot()["latency"] == {}
    assert sizer.size(pressure=True) == 32  # still judging the start


def test_overload_ends_the_trial_and_halves_not_below_the_floor() -> None:
    sizer = BatchSizer()
    drive(sizer, lambda n: 0.02, 12)
    assert sizer.level >= 256
    level = sizer.level
    sizer.observe(sizer.size(True), 0.02, overload=True)
    assert sizer.level == level // 2
    assert sizer.trial is None
    assert sizer.settled
    for _ in range(10):
        sizer.observe(sizer.level, 0.02, overload=True)
    assert sizer.level == 32  # the floor


def test_a_refused_size_is_never_tried_again() -> None:
    sizer = BatchSizer()
    drive(sizer, lambda n: 0.02, 4)  # 32 judged, trying 64 or more
    trial = sizer.size(True)
    assert trial > 32
    sizer.observe(trial, 0.02, too_large=True)
    assert sizer.bound == trial - 1
    sizes = drive(sizer, lambda n: 0.02, 200)  # flat: would grow, but not past the refusal
    assert max(sizes) < trial


def test_a_leap_starts_the_growth_of_a_sizer_that_knows_nothing_yet() -> None:
    sizer = BatchSizer()
    assert sizer.leap(256) == 256
    assert sizer.size(pressure=True) == 256  # judged there first, then grown from there
    sizes = drive(sizer, lambda n: 0.02, 30)
    assert min(sizes) == 256
    assert sizer.level == 2048
    assert BatchSizer(ceiling=128).leap(256) == 128  # never past the ceiling
    measured = BatchSizer()
    measured.observe(32, 0.02)
    measured.observe(32, 0.02)  # answers at the start, no decision yet: it still leaps
    assert measured.leap(256) == 256


@pytest.mark.parametrize(
    "history",
    [
        lambda s: drive(s, lambda n: 0.005 + 0.0056 * n, 40),  # answers: a knee found
        lambda s: s.observe(32, 0.02, overload=True),  # a back-off
        lambda s: s.observe(64, 0.02, too_large=True),  # a refused size
        lambda s: drive(s, lambda n: 0.02, 3),  # a trial under way
        lambda s: drive(s, lambda n: 0.02, 5),  # grown once
    ],
)
def test_a_leap_does_nothing_once_the_sizer_knows_something(
    history: Callable[[BatchSizer], object],
) -> None:
    sizer = BatchSizer()
    history(sizer)
    level, trial = sizer.level, sizer.trial
    assert sizer.leap(256) == level
    assert (sizer.level, sizer.trial) == (level, trial)


def test_a_settled_size_is_retested_and_the_knee_can_move() -> None:
    slow = True
    sizer = BatchSizer(retest_every=4)
    drive(sizer, lambda n: 0.005 + 0.0056 * n if slow else 0.02, 20)
    assert sizer.settled
    assert sizer.level <= 64
    slow = False  # the server got a faster link: latency now flat
    drive(sizer, lambda n: 0.02, 200)
    assert sizer.level == 2048


def test_retests_of_a_knee_that_holds_get_rarer() -> None:
    sizer = BatchSizer(retest_every=2)
    drive(sizer, lambda n: 0.005 + 0.0056 * n, 300)
    assert sizer.retest_every > 2


@pytest.mark.parametrize(
    "kwargs",
    [{"start": 0}, {"flat": 0.5}, {"samples": 0}, {"start": 64, "ceiling": 32}, {"floor": True}],
)
def test_bad_parameters_are_named(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="BatchSizer"):
        BatchSizer(**kwargs)  # type: ignore[arg-type]


def test_engine_spreads_a_small_call_over_the_window_in_one_wave() -> None:
    engine = Engine(q.EmbeddingConfig(base_url="http://127.0.0.1:9/v1"))
    engine.endpoint.replicas[0].states.clear()
    assert engine.auto_batch_size(50, 4) == 32  # a share below the start: the start
    assert engine.auto_batch_size(600, 4) == 150  # one wave of moderate batches
    assert engine.auto_batch_size(10_000, 4) == 256  # a big call: its growth starts there
    assert engine.auto_batch_size(600, 4) == 150  # the leap does not change a wave's cut
    assert engine.endpoint.replicas[0].state(engine.model).batch.sizer.level == 256
    engine.endpoint.replicas[0].states.clear()


@pytest.mark.parametrize(
    ("settings", "want"),
    [
        ({"max_batch_tokens": 100_000}, 32),  # a token limit: batches cut below the level
        ({"base_url": "https://api.siliconflow.cn/v1"}, 64),  # a text limit above the start
        ({"base_url": "https://dashscope.aliyuncs.com/compatible-mode/v1"}, 32),  # 10
    ],
)
def test_a_big_call_leaps_only_to_what_the_known_limits_let_the_sizer_measure(
    settings: dict[str, object], want: int
) -> None:
    config = q.EmbeddingConfig(**{"base_url": "http://127.0.0.1:9/v1", **settings})
    engine = Engine(config)  # nothing is sent: the limits are the servers' known ones
    engine.endpoint.replicas[0].states.clear()
    assert engine.auto_batch_size(10_000, 4) == want
    assert engine.endpoint.replicas[0].state(engine.model).batch.sizer.level == want
    engine.endpoint.replicas[0].states.clear()


@pytest.mark.parametrize(("raw", "want"), [("auto", "auto"), (" AUTO ", "auto"), ("64", 64)])
def test_batch_size_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, raw: str, want: object
) -> None:
    monkeypatch.setenv("QWEN_EMBED_BATCH_SIZE", raw)
    assert q.EmbeddingConfig(base_url="http://127.0.0.1:9/v1").batch_size == want


def test_batch_size_default_is_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QWEN_EMBED_BATCH_SIZE", raising=False)
    assert q.EmbeddingConfig(base_url="http://127.0.0.1:9/v1").batch_size == "auto"
    with pytest.raises(q.ConfigError, match="batch_size"):
        q.EmbeddingConfig(base_url="http://127.0.0.1:9/v1", batch_size="big")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- loopback

TEXTS = [f"passage {i} on the history of topic {i % 53}" for i in range(3000)]
SMALL_BATCHES = -(-len(TEXTS) // 32)  # requests at 32 texts each


@pytest.fixture
def flat_server() -> Iterator[EmbeddingServer]:
    """A server that answers in 200 ms whatever the batch: far above what a loaded
    machine adds (scheduling delays, the per-text work of encoding and decoding), so
    that the sizer sees flat latency however busy the CPU is."""
    with EmbeddingServer(latency=0.2) as server:
        yield server


@pytest.fixture
def capped_server() -> Iterator[EmbeddingServer]:
    """A server that refuses batches of more than 32 texts (stated in its 400)."""
    with EmbeddingServer(latency=0.01, max_batch=32) as server:
        yield server


def _assert_last_wave_is_equal(sizes: list[int]) -> None:
    """The rest of a long call, once it fits in the window's batches, goes in equal
    batches (the last one holding the remainder), not in a tail of ever smaller
    requests (238, 179, 134, ... 32: 11 requests for the last 952 texts)."""
    # sorted: ``received`` is the order of arrival, which the client's threads and tasks
    # may swap; below the first wave's size there is only the last wave
    last = sorted(s for s in sizes if s < 256)
    assert len(last) <= 4, sizes
    assert last[1:] == [last[-1]] * (len(last) - 1), sizes  # equal, but the remainder


def test_default_grows_past_32_texts_per_request_on_a_flat_server(
    flat_server: EmbeddingServer,
) -> None:
    client = q.EmbeddingClient(base_url=flat_server.base_url)
    arr = client.embed_documents_array(TEXTS)
    np.testing.assert_array_equal(arr, expected_embeddings(TEXTS))
    sizes = [len(batch) for batch in flat_server.received]
    # a call longer than one wave, to a replica not measured yet: its first wave (4
    # requests in flight before any answer) starts the growth at 256 texts, not 32
    assert sizes[:4] == [256] * 4, sizes
    assert max(sizes) > 32, sizes
    _assert_last_wave_is_equal(sizes)
    assert flat_server.requests < SMALL_BATCHES, sizes
    # the answers reached the replica's sizer (how fast it grows from them is the unit
    # tests', which need no clock)
    engine = Engine(client.config)
    assert 256 in engine.endpoint.replicas[0].state(engine.model).batch.sizer.snapshot()["latency"]


async def test_async_default_grows_past_32_texts_per_request_on_a_flat_server(
    flat_server: EmbeddingServer,
) -> None:
    client = q.AsyncEmbeddingClient(base_url=flat_server.base_url)
    arr = await client.embed_documents_array(TEXTS)
    np.testing.assert_array_equal(arr, expected_embeddings(TEXTS))
    sizes = [len(batch) for batch in flat_server.received]
    # a call longer than one wave, to a replica not measured yet: its first wave (4
    # requests in flight before any answer) starts the growth at 256 texts, not 32
    assert sizes[:4] == [256] * 4, sizes
    assert max(sizes) > 32, sizes
    _assert_last_wave_is_equal(sizes)
    assert flat_server.requests < SMALL_BATCHES, sizes
    # the answers reached the replica's sizer (how fast it grows from them is the unit
    # tests', which need no clock)
    engine = Engine(client.config)
    assert 256 in engine.endpoint.replicas[0].state(engine.model).batch.sizer.snapshot()["latency"]


def test_adapters_default_grows_on_a_flat_server(flat_server: EmbeddingServer) -> None:
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from qwen_embed_plugins import QwenPooledEmbedding, QwenPooledEmbeddings

    lc = QwenPooledEmbeddings(base_url=flat_server.base_url)
    li = QwenPooledEmbedding(base_url=flat_server.base_url)
    want = expected_embeddings(TEXTS)
    for run in (
        lambda: lc.embed_documents(TEXTS),
        lambda: asyncio.run(lc.aembed_documents(TEXTS)),
        lambda: li.get_text_embedding_batch(TEXTS),
        lambda: asyncio.run(li.aget_text_embedding_batch(TEXTS)),
    ):
        q.reset()  # each adapter and mode starts from the default again
        before = len(flat_server.received)
        np.testing.assert_allclose(np.asarray(run(), dtype=np.float32), want, atol=1e-6)
        sizes = [len(batch) for batch in flat_server.received[before:]]
        # the sizer's own pace is tested above; here: the adapters leave it on ("auto")
        assert max(sizes) > 32, sizes
        assert len(sizes) < SMALL_BATCHES, sizes
        _assert_last_wave_is_equal(sizes)


def test_stated_batch_size_is_kept(flat_server: EmbeddingServer) -> None:
    client = q.EmbeddingClient(base_url=flat_server.base_url, batch_size=32)
    client.embed_documents_array(TEXTS)
    assert flat_server.requests == SMALL_BATCHES


def test_default_does_not_grow_past_a_server_that_refuses_larger_batches(
    capped_server: EmbeddingServer,
) -> None:
    client = q.EmbeddingClient(base_url=capped_server.base_url)
    arr = client.embed_documents_array(TEXTS)
    np.testing.assert_array_equal(arr, expected_embeddings(TEXTS))
    refused = capped_server.requests - SMALL_BATCHES
    # the first wave's batches at most (a long call's growth starts at 256 texts: 4 in
    # flight before the first refusal is read), then never above 32 (the server logs
    # refused requests too, in the order they arrive)
    assert 1 <= refused <= 4
    big = [len(batch) for batch in capped_server.received if len(batch) > 32]
    assert big == [256] * refused, big
    before = capped_server.requests
    client.embed_documents_array(TEXTS[::-1])
    assert capped_server.requests - before == SMALL_BATCHES  # learned: no refusal


# --------------------------------------------------------------------------- server model


def test_dynamic_batching_model_round_trips_and_checks_its_fields() -> None:
    from qwen_embed_tooling.testing import DynamicBatching
    from qwen_embed_tooling.testing._models import model_from_dict, model_to_dict

    spec = DynamicBatching(window=0.001, max_tokens=64, base=0.0, per_token=0.0)
    assert model_from_dict(model_to_dict(spec)) == spec
    with pytest.raises(ValueError, match="max_tokens"):
        DynamicBatching(max_tokens=0)


async def test_dynamic_batching_server_answers_concurrent_requests() -> None:
    from qwen_embed_tooling.testing import DynamicBatching

    spec = DynamicBatching(window=0.002, max_tokens=64, base=0.02, per_token=0.0001)
    with EmbeddingServer(server_model=spec) as server:
        client = q.AsyncEmbeddingClient(base_url=server.base_url, batch_size=4)
        texts = [f"text {i} " * (1 + i % 40) for i in range(64)]  # some above max_tokens
        started = asyncio.get_running_loop().time()
        got = await client.embed_documents_array(texts)
        took = asyncio.get_running_loop().time() - started
        np.testing.assert_array_equal(got, expected_embeddings(texts))
        assert server.requests == 16
        assert took >= spec.base  # every request waited for a pass
