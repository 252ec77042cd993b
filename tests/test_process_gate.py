"""The process-wide gate (``Limits.max_connections_per_process``): at most ``slots``
requests in flight, shared by threads and coroutines of every event loop, served first
come, first served; a timeout or a cancellation takes nothing (real threads, coroutines on
two event loops in two threads)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from qwen_embed_plugins._transport import ProcessGate

pytestmark = pytest.mark.unit


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Wait for a condition of the gate's own state (fails only after a long time)."""
    deadline = time.monotonic() + 60.0
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.001)


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
    gate = ProcessGate(3)
    holders = Holders()
    go = threading.Event()
    done: list[int] = []

    def worker(i: int) -> None:
        assert gate.acquire(None)
        holders.enter()
        go.wait()
        holders.leave()
        gate.release()
        done.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    wait_until(lambda: gate._used == 3 and len(gate._waiters) == 7, "3 in, 7 waiting")
    assert holders.peak == 3
    go.set()
    for t in threads:
        t.join()
    assert sorted(done) == list(range(10))
    assert holders.peak == 3
    assert gate._used == 0


def test_threads_are_served_first_come_first_served() -> None:
    gate = ProcessGate(1)
    assert gate.acquire(None)
    order: list[int] = []

    def worker(i: int) -> None:
        assert gate.acquire(None)
        order.append(i)
        gate.release()

    threads = []
    for i in range(6):
        t = threading.Thread(target=worker, args=(i,))
        t.start()
        threads.append(t)
        wait_until(lambda n=i: len(gate._waiters) == n + 1, f"waiter {i} queued")
    gate.release()
    for t in threads:
        t.join()
    assert order == list(range(6))


def test_thread_timeout_returns_false_and_takes_nothing() -> None:
    gate = ProcessGate(1)
    assert gate.acquire(None)
    assert gate.acquire(0.05) is False
    assert gate._used == 1
    assert gate._waiters == []
    gate.release()
    assert gate.acquire(0.05) is True


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
    gate = ProcessGate(3)
    holders = Holders()
    go = threading.Event()

    async def job() -> None:
        assert await gate.aacquire(None)
        holders.enter()
        await asyncio.to_thread(go.wait)  # the loop stays free while slots are held
        holders.leave()
        gate.release()

    futures = [loops[i % 2].submit(job()) for i in range(10)]
    wait_until(lambda: gate._used == 3 and len(gate._waiters) == 7, "3 in, 7 waiting")
    # a waiting coroutine does not block its loop: both loops still run other work
    for lt in loops:
        assert lt.submit(asyncio.sleep(0, result="alive")).result(timeout=60) == "alive"
    assert holders.peak == 3
    go.set()
    for f in futures:
        f.result(timeout=60)
    assert holders.peak == 3
    assert gate._used == 0


def test_coroutines_and_threads_are_served_in_order(
    loops: tuple[LoopThread, LoopThread],
) -> None:
    gate = ProcessGate(1)
    assert gate.acquire(None)
    order: list[str] = []
    lock = threading.Lock()

    async def job(name: str) -> None:
        assert await gate.aacquire(None)
        with lock:
            order.append(name)
        gate.release()

    def thread_job(name: str) -> None:
        assert gate.acquire(None)
        with lock:
            order.append(name)
        gate.release()

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
    gate.release()
    for f in futures:
        f.result(timeout=60)
    for t in threads:
        t.join()
    assert order == ["a0", "b1", "t2", "a3", "b4"]


def test_coroutine_timeout_returns_false(loops: tuple[LoopThread, LoopThread]) -> None:
    gate = ProcessGate(1)
    assert gate.acquire(None)

    async def job() -> bool:
        return await gate.aacquire(0.05)

    assert loops[0].submit(job()).result(timeout=60) is False
    assert gate._used == 1
    assert gate._waiters == []


def test_a_cancelled_waiter_releases_nothing_it_did_not_get(
    loops: tuple[LoopThread, LoopThread],
) -> None:
    gate = ProcessGate(1)
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
    assert gate._used == 1  # nothing released by the cancellation
    gate.release()  # the slot goes to the next waiter
    second.result(timeout=60)
    assert got == ["second"]
    assert gate._used == 1
    gate.release()
    assert gate._used == 0


def test_a_waiter_cancelled_as_it_is_granted_passes_the_slot_on() -> None:
    gate = ProcessGate(1)
    assert gate.acquire(None)

    async def main() -> None:
        task = asyncio.create_task(gate.aacquire(None))
        await asyncio.sleep(0)
        assert len(gate._waiters) == 1
        gate.release()  # grants it (the wake-up is scheduled) ...
        task.cancel()  # ... and it is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert gate._used == 0


# --------------------------------------------------------------------------- registry
