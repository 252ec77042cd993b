"""Adaptive concurrency: the limit (deterministic: injected clock, synthetic samples) and
the gate (real threads, coroutines on two event loops in two threads)."""

from __future__ import annotations

import asyncio
import math
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from qwen_embed_plugins import _adaptive as adaptive
from qwen_embed_plugins._adaptive import AdaptiveGate, ConcurrencyLimit, gate_for, gates

# --------------------------------------------------------------------------- helpers


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def drive(
    limit: ConcurrencyLimit,
    clock: Clock,
    server: Callable[[int], tuple[float, float]],
    seconds: float,
    *,
    retry_after: float | None = None,
) -> list[int]:
    """A saturated client: every round, ``limit.limit`` requests are in flight and all
    finish after the latency the server gives for that concurrency. ``server(n)``
    returns ``(latency seconds, fraction of overload answers)``. Returns the limit
    after each round (but the rounds of a baseline probe)."""
    end = clock.now + seconds
    history = []
    while clock.now < end:
        n = limit.limit
        latency, bad = server(n)
        overloads = math.ceil(bad * n - 1e-9)
        clock.now += latency
        for i in range(n):
            if i < overloads:
                limit.on_sample(0.001, n - i, True, retry_after)
            else:
                limit.on_sample(latency, n - i, False)
        if limit.snapshot()["phase"] != "probe":  # a probe lowers it for a moment
            history.append(limit.limit)
    return history


def slots(count: int, base: float = 0.02) -> Callable[[int], tuple[float, float]]:
    """A GPU-like server: ``count`` requests at once, the rest queue."""
    return lambda n: (base * max(1.0, n / count), 0.0)


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Wait for a condition of the gate's own state (fails only after a long time)."""
    deadline = time.monotonic() + 60.0
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.001)


def fixed(n: int) -> ConcurrencyLimit:
    return ConcurrencyLimit(initial_limit=n, min_limit=n, max_limit=n)


# --------------------------------------------------------------------------- the limit


def test_flat_latency_grows_to_the_maximum() -> None:
    clock = Clock()
    limit = ConcurrencyLimit(max_limit=64, clock=clock)
    history = drive(limit, clock, lambda n: (0.02, 0.0), 30.0)
    assert history[-1] == 64
    assert max(history) == 64
    assert limit.snapshot()["overloads"] == 0


@pytest.mark.parametrize("count", [2, 8, 24])
def test_slot_bound_server_converges_near_its_slots(count: int) -> None:
    clock = Clock()
    limit = ConcurrencyLimit(clock=clock)
    history = drive(limit, clock, slots(count), 60.0)
    tail = history[len(history) // 2 :]
    # throughput needs >= count in flight; a queue beyond ~tolerance x slots is waste
    assert min(tail) >= count
    assert max(tail) <= math.ceil(count * 1.3) + 2
    assert limit.min_rtt == pytest.approx(0.02)


def test_overload_brings_the_limit_down_and_keeps_it_there() -> None:
    clock = Clock()
    limit = ConcurrencyLimit(clock=clock)
    drive(limit, clock, lambda n: (0.02, 0.0), 5.0)  # climbs first
    assert limit.limit > 20

    def capped(n: int) -> tuple[float, float]:
        return 0.02, max(0.0, (n - 6) / n)  # every request past 6 is refused

    history = drive(limit, clock, capped, 60.0)
    tail = history[len(history) // 2 :]
    assert max(tail) <= 7
    assert min(tail) >= 3
    # the ceiling makes probes above the capacity rare: fewer than one per second
    overloads_tail = sum(1 for n in tail if n > 6)
    assert overloads_tail < 30.0
    assert limit.snapshot()["decreases"] >= 2


def test_overloads_sent_before_a_decrease_do_not_decrease_again() -> None:
    clock = Clock()
    limit = ConcurrencyLimit(initial_limit=20, clock=clock)
    clock.now += 0.01
    limit.on_sample(0.005, 20, True)
    after_first = limit.limit
    assert after_first < 20
    for _ in range(10):  # answers to requests sent before that decrease
        limit.on_sample(0.005, 20, True)
    assert limit.limit == after_first
    clock.now += 0.01
    limit.on_sample(0.001, 10, True)  # sent after it: news
    assert limit.limit < after_first


def test_retry_after_first_holds_growth_then_decreases_when_it_repeats() -> None:
    clock = Clock()
    limit = ConcurrencyLimit(clock=clock)
    drive(limit, clock, lambda n: (0.02, 0.0), 3.0)
    level = limit.limit
    clock.now += 0.1
    limit.on_sample(0.001, level, True, 1.0)
    assert limit.limit == level  # the held slot backs off; the limit stays
    assert limit.snapshot()["ceiling"] == level
    drive(limit, clock, lambda n: (0.02, 0.0), 0.6)  # within the quiet time: no growth
    assert limit.limit <= level
    clock.now += 0.1
    limit.on_sample(0.001, level, True, 1.0)  # again within the 1 s wait (0.7 s): decrease
    assert limit.limit < level


def test_never_outside_min_and_max() -> None:
    rng = random.Random(7)
    clock = Clock()
    limit = ConcurrencyLimit(initial_limit=5, min_limit=2, max_limit=9, clock=clock)
    for _ in range(20_000):
        clock.now += rng.choice([0.0, 0.001, 0.05, 0.7, 3.0])
        latency = rng.choice([0.0, 1e-6, 0.01, 0.2, 5.0, 120.0])
        limit.on_sample(latency, rng.randint(0, 50), rng.random() < 0.2, rng.choice([None, 2.0]))
        assert 2 <= limit.limit <= 9


def test_recovers_after_an_overload_window() -> None:
    clock = Clock()
    limit = ConcurrencyLimit(max_limit=32, clock=clock)
    drive(limit, clock, lambda n: (0.02, 0.0), 5.0)
    assert limit.limit == 32
    drive(limit, clock, lambda n: (0.02, 0.5), 3.0)  # half the answers are 503
    assert limit.limit <= 4
    history = drive(limit, clock, lambda n: (0.02, 0.0), 120.0)
    assert history[-1] == 32


def test_a_slower_server_is_followed_by_the_baseline_probe() -> None:
    clock = Clock()
    limit = ConcurrencyLimit(max_limit=64, probe_interval=10.0, clock=clock)
    drive(limit, clock, slots(8, base=0.02), 30.0)
    assert 8 <= limit.limit <= 13
    # the same server, now 5x slower per request (longer texts, a busier GPU)
    history = drive(limit, clock, slots(8, base=0.1), 120.0)
    tail = history[len(history) // 2 :]
    assert limit.min_rtt == pytest.approx(0.1)
    assert min(tail) >= 8
    assert max(tail) <= 13


def test_app_limited_callers_do_not_inflate_the_limit() -> None:
    clock = Clock()
    limit = ConcurrencyLimit(clock=clock)
    for _ in range(2000):
        clock.now += 0.02
        limit.on_sample(0.02, 1, False)  # one request at a time
    assert limit.limit <= 4


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"min_limit": 0}, "min_limit"),
        ({"max_limit": 0}, "max_limit"),
        ({"min_limit": 5, "max_limit": 4, "initial_limit": 4}, "max_limit"),
        ({"initial_limit": 300}, "initial_limit"),
        ({"initial_limit": 2.5}, "initial_limit"),
        ({"tolerance": -0.1}, "tolerance"),
        ({"smoothing": 0.0}, "smoothing"),
        ({"backoff": 1.0}, "backoff"),
        ({"window": math.nan}, "window"),
        ({"quiet": 5.0, "max_quiet": 1.0}, "max_quiet"),
        ({"probe_interval": 0.0}, "probe_interval"),
    ],
)
def test_bad_parameters_are_named(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ConcurrencyLimit(**kwargs)


@pytest.mark.parametrize("latency", [-0.1, math.inf, math.nan])
def test_bad_latency_is_refused(latency: float) -> None:
    with pytest.raises(ValueError, match="latency"):
        ConcurrencyLimit().on_sample(latency, 1, False)


def test_snapshot_and_repr() -> None:
    limit = ConcurrencyLimit()
    snap = limit.snapshot()
    assert snap["limit"] == 4
    assert snap["phase"] == "startup"
    assert snap["min_rtt"] is None
    assert "limit=4" in repr(limit)


# --------------------------------------------------------------------------- the gate, threads


class Holders:
    """Counts how many threads hold a slot at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.peak = 0

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


def test_threads_never_exceed_the_capacity() -> None:
    gate = AdaptiveGate(fixed(3))
    holders = Holders()
    go = threading.Event()
    done: list[int] = []

    def worker(i: int) -> None:
        assert gate.acquire(None)
        holders.enter()
        go.wait()
        holders.leave()
        gate.release(0.01, False)
        done.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    wait_until(lambda: gate.in_flight == 3 and len(gate._waiters) == 7, "3 in, 7 waiting")
    assert holders.peak == 3
    go.set()
    for t in threads:
        t.join()
    assert sorted(done) == list(range(10))
    assert holders.peak == 3
    assert gate.in_flight == 0


def test_threads_are_served_first_come_first_served() -> None:
    gate = AdaptiveGate(fixed(1))
    assert gate.acquire(None)
    order: list[int] = []

    def worker(i: int) -> None:
        assert gate.acquire(None)
        order.append(i)
        gate.release(0.01, False)

    threads = []
    for i in range(6):
        t = threading.Thread(target=worker, args=(i,))
        t.start()
        threads.append(t)
        wait_until(lambda n=i: len(gate._waiters) == n + 1, f"waiter {i} queued")
    gate.release(0.01, False)
    for t in threads:
        t.join()
    assert order == list(range(6))


def test_thread_timeout_returns_false_and_takes_nothing() -> None:
    gate = AdaptiveGate(fixed(1))
    assert gate.acquire(None)
    assert gate.acquire(0.05) is False
    assert gate.in_flight == 1
    assert gate._waiters == []
    gate.release(0.01, False)
    assert gate.acquire(0.05) is True


def test_a_growing_limit_lets_waiters_in() -> None:
    clock = Clock()
    gate = AdaptiveGate(ConcurrencyLimit(initial_limit=1, max_limit=8, clock=clock))
    assert gate.acquire(None)
    got = threading.Semaphore(0)

    def worker() -> None:
        assert gate.acquire(None)
        got.release()

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    wait_until(lambda: len(gate._waiters) == 3, "3 waiting")
    # one slot, and a latency that stays flat: the limit grows, the waiters get in
    for _ in range(2):
        for _ in range(3):
            clock.now += 0.3
            gate.limit.on_sample(0.02, 1, False)
    assert gate.limit.limit >= 4
    gate.release(0.02, False)
    for _ in range(3):
        assert got.acquire(timeout=60)
    for t in threads:
        t.join()
    assert gate.in_flight == 3


def test_an_overload_holds_its_slot_until_the_hold_ends() -> None:
    later: list[tuple[float, Callable[[], None]]] = []
    clock = Clock()
    gate = AdaptiveGate(
        ConcurrencyLimit(initial_limit=2, clock=clock),
        call_later=lambda s, fn: later.append((s, fn)),
    )
    assert gate.acquire(None)
    gate.release(0.001, True, retry_after=1.5)
    assert gate.in_flight == 1  # held
    assert later[0][0] == pytest.approx(1.5 - 0.001)
    assert gate.acquire(0) is True
    assert gate.acquire(0) is False  # the held slot is not free
    later[0][1]()  # the hold ends
    assert gate.in_flight == 1
    assert gate.acquire(0) is True


def test_an_overload_hold_on_the_real_timer_ends() -> None:
    gate = AdaptiveGate(fixed(1), default_hold=0.05)
    assert gate.acquire(None)
    gate.release(0.0, True)
    assert gate.acquire(None) is True  # granted once the process timer ends the hold
    gate.release(0.01, False)
    assert gate.in_flight == 0


def test_cap_bounds_the_capacity() -> None:
    gate = AdaptiveGate(ConcurrencyLimit(initial_limit=8), cap=2)
    assert gate.slots == 2
    assert gate.acquire(0)
    assert gate.acquire(0)
    assert gate.acquire(0) is False


def test_release_without_latency_records_nothing() -> None:
    gate = AdaptiveGate(fixed(2))
    assert gate.acquire(None)
    gate.release()
    assert gate.limit.sample_count == 0
    assert gate.in_flight == 0


# --------------------------------------------------------------------------- the gate, loops


class LoopThread:
    """An event loop running in its own thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever)
        self.thread.start()

    def submit(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.fixture
def loops() -> Any:
    pair = (LoopThread(), LoopThread())
    yield pair
    for lt in pair:
        lt.close()


def test_coroutines_on_two_loops_share_the_capacity(loops: tuple[LoopThread, LoopThread]) -> None:
    gate = AdaptiveGate(fixed(3))
    holders = Holders()
    go = threading.Event()

    async def job() -> None:
        assert await gate.aacquire(None)
        holders.enter()
        await asyncio.to_thread(go.wait)  # the loop stays free while slots are held
        holders.leave()
        gate.release(0.01, False)

    futures = [loops[i % 2].submit(job()) for i in range(10)]
    wait_until(lambda: gate.in_flight == 3 and len(gate._waiters) == 7, "3 in, 7 waiting")
    # a waiting coroutine does not block its loop: both loops still run other work
    for lt in loops:
        assert lt.submit(asyncio.sleep(0, result="alive")).result(timeout=60) == "alive"
    assert holders.peak == 3
    go.set()
    for f in futures:
        f.result(timeout=60)
    assert holders.peak == 3
    assert gate.in_flight == 0


def test_coroutines_and_threads_are_served_in_order(
    loops: tuple[LoopThread, LoopThread],
) -> None:
    gate = AdaptiveGate(fixed(1))
    assert gate.acquire(None)
    order: list[str] = []
    lock = threading.Lock()

    async def job(name: str) -> None:
        assert await gate.aacquire(None)
        with lock:
            order.append(name)
        gate.release(0.01, False)

    def thread_job(name: str) -> None:
        assert gate.acquire(None)
        with lock:
            order.append(name)
        gate.release(0.01, False)

    futures = []
    threads = []
    for i, name in enumerate(["a0", "b1", "t2", "a3", "b4"]):
        if name[0] == "t":
            t = threading.Thread(target=thread_job, args=(name,))
            t.start()
            threads.append(t)
        else:
            futures.append(loops[0 if name[0] == "a" else 1].submit(job(name)))
        wait_until(lambda n=i: len(gate._waiters) == n + 1, f"{name} queued")
    gate.release(0.01, False)
    for f in futures:
        f.result(timeout=60)
    for t in threads:
        t.join()
    assert order == ["a0", "b1", "t2", "a3", "b4"]


def test_coroutine_timeout_returns_false(loops: tuple[LoopThread, LoopThread]) -> None:
    gate = AdaptiveGate(fixed(1))
    assert gate.acquire(None)

    async def job() -> bool:
        return await gate.aacquire(0.05)

    assert loops[0].submit(job()).result(timeout=60) is False
    assert gate.in_flight == 1
    assert gate._waiters == []


def test_a_cancelled_waiter_releases_nothing_it_did_not_get(
    loops: tuple[LoopThread, LoopThread],
) -> None:
    gate = AdaptiveGate(fixed(1))
    assert gate.acquire(None)
    got: list[str] = []

    async def job(name: str) -> None:
        assert await gate.aacquire(None)
        got.append(name)

    first = loops[0].submit(job("cancelled"))
    wait_until(lambda: len(gate._waiters) == 1, "first queued")
    second = loops[1].submit(job("second"))
    wait_until(lambda: len(gate._waiters) == 2, "second queued")
    first.cancel()
    wait_until(lambda: len(gate._waiters) == 1, "the cancelled waiter left")
    assert gate.in_flight == 1  # nothing released by the cancellation
    gate.release(0.01, False)  # the slot goes to the next waiter
    second.result(timeout=60)
    assert got == ["second"]
    assert gate.in_flight == 1
    gate.release(0.01, False)
    assert gate.in_flight == 0


def test_a_waiter_cancelled_as_it_is_granted_passes_the_slot_on() -> None:
    gate = AdaptiveGate(fixed(1))
    assert gate.acquire(None)

    async def main() -> None:
        task = asyncio.create_task(gate.aacquire(None))
        await asyncio.sleep(0)
        assert len(gate._waiters) == 1
        gate.release(0.01, False)  # grants it (the wake-up is scheduled) ...
        task.cancel()  # ... and it is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert gate.in_flight == 0


# --------------------------------------------------------------------------- registry


def test_gate_for_is_one_gate_per_key_and_cap() -> None:
    key = "http://127.0.0.1:1/v1#test-registry"
    gate = gate_for(key)
    assert gate_for(key) is gate
    assert gate_for(key, cap=2) is not gate
    assert gate_for(key, cap=2).slots <= 2
    assert gates()[key]["limit"] == gate.limit.limit


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_with_no_gates() -> None:
    key = "http://127.0.0.1:1/v1#test-fork"
    parent = gate_for(key)
    assert parent.acquire(None)  # a slot taken in the parent
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        ok = False
        try:
            child = gate_for(key)
            ok = child is not parent and child.in_flight == 0 and child.acquire(0)
            child.release(0.01, False)
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    parent.release()
    assert answer == b"1"
    assert adaptive.gate_for(key) is parent


# --------------------------------------------------------------------------- through the client


@pytest.fixture
def crowded_server() -> Any:
    """2 slots of ~20 ms, 503 past 2 waiting: more than 4 requests in flight overload it."""
    from qwen_embed_tooling.testing import EmbeddingServer, GPULike

    model = GPULike(slots=2, base=0.02, per_token=0.0, queue_limit=2)
    with EmbeddingServer(server_model=model) as server:
        yield server


def _gate_of(server: Any) -> dict[str, Any]:
    """The snapshot of the adaptive gate the client made for ``server``."""
    url = server.base_url.rstrip("/")
    found = [
        snap
        for key, snap in gates().items()
        if str(getattr(key, "base_url", key)).rstrip("/") == url
    ]
    assert len(found) == 1
    return found[0]


def _overloads(server: Any) -> int:
    responses = server.stats()["responses"]
    return int(responses.get("503", 0)) + int(responses.get("429", 0))


def test_auto_pushes_back_far_less_than_a_large_static_window(crowded_server: Any) -> None:
    from qwen_embed_plugins import EmbeddingClient, Limits

    texts = [f"text {i}" for i in range(40 * 16)]  # 40 batches of 16
    limits = Limits(max_connections=64)
    auto = EmbeddingClient(
        base_url=crowded_server.base_url, max_concurrency="auto", batch_size=16, limits=limits
    )
    assert len(auto.embed_documents(texts)) == len(texts)
    auto_overloads = _overloads(crowded_server)
    assert _gate_of(crowded_server)["samples"] >= 40
    crowded_server.reset_counters()
    static = EmbeddingClient(
        base_url=crowded_server.base_url, max_concurrency=16, batch_size=16, limits=limits
    )
    assert len(static.embed_documents(texts)) == len(texts)
    static_overloads = _overloads(crowded_server)
    assert static_overloads > 0  # 16 in flight overload a 2 + 2 server
    assert auto_overloads * 4 < static_overloads, (auto_overloads, static_overloads)


async def test_auto_async_calls_share_the_gate(crowded_server: Any) -> None:
    from qwen_embed_plugins import AsyncEmbeddingClient

    client = AsyncEmbeddingClient(
        base_url=crowded_server.base_url, max_concurrency="auto", batch_size=8
    )
    texts = [f"text {i}" for i in range(8 * 8)]
    results = await asyncio.gather(*(client.embed_documents(texts) for _ in range(4)))
    assert all(len(r) == len(texts) for r in results)
    snap = _gate_of(crowded_server)
    assert snap["samples"] >= 32
    assert snap["in_flight"] == 0
