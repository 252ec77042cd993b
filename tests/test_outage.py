"""An outage costs the server almost nothing: while a replica is down one request at a
time probes it, with a backoff growing to a cap, and every other request waits for the
probe's verdict; retries to a replica that is up stay within its process-wide budget; an
explicit ``max_retries`` bounds every request whatever the cause; the hedge delay of a
query comes from queries, not from bulk batches.

The decisions run on the engine with scripted replies and a virtual clock (``Sim``: many
flows at once, each ``Sleep`` advancing virtual time, no waiting); a few socket tests show
what only real drivers show (threads and several event loops sharing one replica) with
short deadlines, their request counts bounded by what the deadline allows."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import signal
import threading
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import orjson
import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins import _balance as balance
from qwen_embed_plugins._engine import Engine
from qwen_embed_plugins._run import Flow, Hold, Send, Sleep
from qwen_embed_plugins._transport import Reply, Request
from qwen_embed_tooling.testing import EmbeddingServer

DIM = 4
TEXTS = [f"outage passage {i}" for i in range(1024)]


# --------------------------------------------------------------------------- the virtual clock


def _ok(request: Request) -> Reply:
    texts = orjson.loads(request.body)["input"]
    texts = [texts] if isinstance(texts, str) else texts
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": [1.0 + (len(t) + k) % 5 for k in range(DIM)],
        }
        for i, t in enumerate(texts)
    ]
    body = orjson.dumps({"object": "list", "data": data, "model": "sim-model"})
    return Reply(200, {"content-type": "application/json"}, body, fresh=True)


def _status(code: int, message: str = "CUDA error: device-side assert") -> Reply:
    body = orjson.dumps({"error": {"message": message}})
    return Reply(code, {"content-type": "application/json"}, body, fresh=True)


class Sim:
    """Runs several flows at once on a virtual clock, as the drivers run them on threads
    or tasks: a ``Send`` is answered by ``answer(request, now)`` at once, a ``Sleep``
    wakes its flow when the virtual clock reaches its end, and a ``Hold`` parks its flow
    until the gate is free (taken in arrival order when it is released). The clock only
    moves when no flow can go on. Records the virtual time of each request."""

    def __init__(self, answer: Callable[[Request, float], Reply | q.QwenEmbedError]) -> None:
        self.answer = answer
        self.now = 0.0
        self.sent: list[float] = []

    def run(self, flows: Sequence[Flow]) -> list[Any]:
        results: list[Any] = [None] * len(flows)
        ready: deque[tuple[int, Any, BaseException | None]] = deque(
            (i, None, None) for i in range(len(flows))
        )
        timers: list[tuple[float, int, int]] = []
        parked: deque[tuple[int, Hold]] = deque()
        order = itertools.count()
        while ready or timers or parked:
            if not ready:
                for _ in range(len(parked)):  # a released gate: its first waiter takes it
                    i, hold = parked.popleft()
                    if hold.gate.acquire(0.0):
                        ready.append((i, True, None))
                    else:
                        parked.append((i, hold))
            if not ready:
                assert timers, "every flow waits for a gate nobody holds"
                self.now, _, i = heapq.heappop(timers)
                ready.append((i, None, None))
                continue
            i, value, error = ready.popleft()
            flow = flows[i]
            try:
                op = flow.send(value) if error is None else flow.throw(error)
            except StopIteration as stop:
                results[i] = stop.value
                continue
            except q.QwenEmbedError as exc:
                results[i] = exc
                continue
            if isinstance(op, Send):
                self.sent.append(self.now)
                outcome = self.answer(op.request, self.now)
                if isinstance(outcome, BaseException):
                    ready.append((i, None, outcome))
                else:
                    ready.append((i, outcome, None))
            elif isinstance(op, Sleep):
                heapq.heappush(timers, (self.now + op.seconds, next(order), i))
            else:
                assert isinstance(op, Hold), op
                if hold_now := op.gate.acquire(0.0):
                    ready.append((i, hold_now, None))
                else:
                    parked.append((i, op))
        return results


def _engine(retry: q.RetryConfig, **settings: Any) -> Engine:
    url = f"http://outage-sim-{uuid.uuid4().hex[:12]}.test/v1"
    config = q.EmbeddingConfig(
        base_url=url, model="sim-model", encoding_format="float", retry=retry, **settings
    )
    return Engine(config)


def _flows(eng: Engine, batches: int, size: int) -> list[Flow]:
    call = eng.new_call(query=False)
    return [
        eng.batch_flow(
            call, TEXTS[b * size : (b + 1) * size], list(range(b * size, (b + 1) * size))
        )
        for b in range(batches)
    ]


OUTAGE = 30.0  # virtual seconds
NO_DEADLINE = q.RetryConfig(deadline=None, circuit_failure_threshold=0)


def _outage(code: int) -> Callable[[Request, float], Reply | q.QwenEmbedError]:
    def answer(request: Request, now: float) -> Reply | q.QwenEmbedError:
        if now >= OUTAGE:
            return _ok(request)
        if code == 0:
            return q.ConnectError(f"connection refused by {request.ctx.url}", url=request.ctx.url)
        return _status(code)

    return answer


@pytest.mark.unit
@pytest.mark.parametrize("code", [500, 503, 0])
@pytest.mark.parametrize("batches", [4, 32])
def test_an_outage_of_30_s_costs_a_few_dozen_requests(code: int, batches: int) -> None:
    """A server failing everything for 30 s (500 to every request, the control too; 503;
    connection refused) while 4 or 32 batches are in flight: past the first attempt of
    each batch, the server gets a few dozen requests, however many batches wait; the
    probes' waits grow to a cap of a few seconds; every text is embedded once it is up."""
    eng = _engine(NO_DEADLINE)
    sim = Sim(_outage(code))
    # a first answer: the server was up (an unreached server fails fast instead)
    eng.endpoint.replicas[0].answered = True
    parts = sim.run(_flows(eng, batches, 8))
    assert all(isinstance(p, object) and not isinstance(p, Exception) for p in parts), parts
    assert sum(len(p.pieces) and sum(r.shape[0] for _, r in p.pieces) for p in parts) == batches * 8
    during = [t for t in sim.sent if t < OUTAGE]
    extra = len(during) - batches  # past each batch's first attempt
    assert extra <= 40, (extra, during)
    probes = sorted({t for t in during if t > 0.0})
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps
    assert max(gaps) <= balance.PROBE_CAP + 1e-9
    assert max(gaps) >= balance.PROBE_CAP / 2  # grew to the cap
    assert len(probes) >= 6  # kept probing: the outage was noticed at its end
    assert min(t for t in sim.sent if t >= OUTAGE) - OUTAGE <= balance.PROBE_CAP


@pytest.mark.unit
def test_waiting_flows_follow_the_probe_at_once() -> None:
    """When the probe succeeds, the waiting batches go at once (no wait of their own)."""
    eng = _engine(NO_DEADLINE)
    eng.endpoint.replicas[0].answered = True
    sim = Sim(_outage(503))
    sim.run(_flows(eng, 16, 4))
    after = [t for t in sim.sent if t >= OUTAGE]
    assert len(after) == 16
    assert len(set(after)) == 1  # all at the probe's time


# --------------------------------------------------------------------------- max_retries


@pytest.mark.unit
@pytest.mark.parametrize("code", [503, 500, 0])
def test_max_retries_bounds_every_cause(code: int) -> None:
    """``max_retries=2``: a query's request gets 3 attempts whatever fails it (an outage
    status, a 500, a refused connection), and the error says so. (For a 500 the
    bare-string trial is one of the 3, and no control request or resend follows: the
    bound is the single text's.)"""
    retry = q.RetryConfig(max_retries=2, backoff_initial=0.01, deadline=None, query_deadline=None)
    eng = _engine(retry)
    eng.endpoint.replicas[0].answered = True
    inputs: list[Any] = []
    outage = _outage(code)

    def answer(request: Request, now: float) -> Reply | q.QwenEmbedError:
        inputs.append(orjson.loads(request.body)["input"])
        return outage(request, now)

    sim = Sim(answer)
    call = eng.new_call(query=True)
    (error,) = sim.run([eng.batch_flow(call, ["what is pooling?"], [0])])
    assert isinstance(error, q.QwenEmbedError), error
    assert "max_retries=2" in str(error)
    assert "gave up after 3 attempts" in str(error)
    assert inputs.count(["what is pooling?"]) == (3 if code != 500 else 2)
    assert len(inputs) == 3


@pytest.mark.unit
def test_unset_max_retries_keeps_the_outage_budget() -> None:
    eng = _engine(NO_DEADLINE.replace(backoff_initial=0.01))
    eng.endpoint.replicas[0].answered = True
    sim = Sim(_outage(503))
    (part,) = sim.run([eng.batch_flow(eng.new_call(query=True), ["q"], [0])])
    assert not isinstance(part, Exception)
    assert len(sim.sent) > 10  # retried until the server answered


def _query(surface: str, settings: dict[str, Any]) -> None:
    """One query through ``surface`` (a core client or an adapter) with ``settings``."""
    if surface == "sync":
        q.EmbeddingClient(**settings).embed_query("busy")
    elif surface == "async":
        asyncio.run(q.AsyncEmbeddingClient(**settings).embed_query("busy"))
    elif surface == "langchain":
        from qwen_embed_plugins.integrations.langchain import QwenPooledEmbeddings

        QwenPooledEmbeddings(**settings).embed_query("busy")
    else:
        from qwen_embed_plugins.integrations.llama_index import QwenPooledEmbedding

        QwenPooledEmbedding(**settings).get_query_embedding("busy")


@pytest.mark.parametrize("surface", ["sync", "async", "langchain", "llama_index"])
def test_max_retries_sends_n_plus_one_requests_to_a_503_server(
    embedding_server: EmbeddingServer, surface: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Against a server always answering 503, ``max_retries=2`` sends 3 requests on every
    surface; the error names the bound; the log never promises retries until it
    answers."""
    url = embedding_server.base_url
    embedding_server.inject_overloaded(count=10_000)
    caplog.set_level(logging.WARNING, logger="qwen_embed_plugins")
    settings: dict[str, Any] = {"base_url": url, "max_retries": 2}
    with pytest.raises(q.OverloadedError, match=r"max_retries=2"):
        _query(surface, settings)
    assert embedding_server.requests == 3
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "until it answers" not in said
    assert "at most 2" in said


@pytest.mark.unit
def test_ray_passes_max_retries_through_the_same_setting() -> None:
    pytest.importorskip("ray")
    from qwen_embed_plugins.ray import _client_config

    config, _, _ = _client_config("http://127.0.0.1:9/v1", 2, None, {"max_retries": 2})
    assert config.retry.max_retries == 2
    config, _, _ = _client_config("http://127.0.0.1:9/v1", 2, None, {})
    assert config.retry.max_retries is None


# --------------------------------------------------------------------------- retry budget


@pytest.mark.unit
def test_the_budget_counts_a_window_of_requests() -> None:
    clock = [0.0]
    budget = balance.Budget(0.2, floor=10, window=10.0, clock=lambda: clock[0])
    assert sum(budget.allow() for _ in range(50)) == 10  # the floor only
    for _ in range(100):
        budget.seen()
    assert sum(budget.allow() for _ in range(50)) == 20  # 20% of 100
    clock[0] = 10.5  # the window has passed: nothing counted any more
    assert sum(budget.allow() for _ in range(50)) == 10
    hedges = balance.Budget()  # the hedging budget: 5% of every query, no floor
    assert not hedges.allow()
    for _ in range(40):
        hedges.seen()
    assert [hedges.allow() for _ in range(3)] == [True, True, False]


@pytest.mark.unit
def test_a_retry_over_the_budget_is_not_made_and_says_so() -> None:
    eng = _engine(q.RetryConfig(backoff_initial=0.01, deadline=None, query_deadline=None))
    replica = eng.endpoint.replicas[0]
    replica.answered = True
    while replica.retries.allow():
        pass  # another part of the process spent it
    sim = Sim(lambda request, now: _status(408, "request timeout"))
    (error,) = sim.run([eng.batch_flow(eng.new_call(query=False), ["a", "b"], [0, 1])])
    assert isinstance(error, q.HTTPStatusError), error
    assert "retry budget" in str(error)
    assert len(sim.sent) == 1


# --------------------------------------------------------------------------- hedging


@pytest.mark.unit
def test_the_hedge_delay_comes_from_single_text_requests() -> None:
    """Bulk batches of about 1 s and queries of 15 ms on the same endpoint: the p95 of a
    query (the hedge delay) is the queries', and the engine files each answer by its
    class."""
    eng = _engine(q.RetryConfig())
    replica = eng.endpoint.replicas[0]
    for _ in range(100):
        replica.succeeded(1.0, 64)
        replica.succeeded(0.015, 1)
    assert eng.endpoint.p95(texts=1) == pytest.approx(0.015)
    assert eng.endpoint.p95(texts=64) == pytest.approx(1.0)
    other = _engine(q.RetryConfig())
    sim = Sim(lambda request, now: _ok(request))
    call = other.new_call(query=False)
    sim.run([other.batch_flow(call, ["a", "b"], [0, 1]), other.batch_flow(call, ["c"], [2])])
    replica = other.endpoint.replicas[0]
    assert (len(replica.latencies), len(replica.single_latencies)) == (1, 1)


# --------------------------------------------------------------------------- sockets


def _down(server: EmbeddingServer, code: int) -> None:
    server.inject_status(code, count=100_000, message="CUDA error: device-side assert")


@pytest.mark.parametrize("code", [503, 500])
def test_threads_and_loops_share_one_probe(embedding_server: EmbeddingServer, code: int) -> None:
    """Two threads with a sync call each and two event loops with an async call each,
    8 batches in flight apiece, against a server failing everything for a 3 s deadline:
    the deadline ends every call with the server's error, naming the deadline, and the
    server gets the calls' first attempts and bisections plus one probe at a time (about
    5 probes in 3 s)."""
    url = embedding_server.base_url
    settings: dict[str, Any] = {
        "base_url": url,
        "batch_size": 4,
        "max_concurrency": 8,
        "deadline": 3.0,
    }
    q.EmbeddingClient(**settings).embed_documents(["warm"])  # the server has answered
    embedding_server.reset_counters()
    _down(embedding_server, code)
    texts = TEXTS[:256]
    errors: list[BaseException] = []

    def sync_call() -> None:
        try:
            q.EmbeddingClient(**settings).embed_documents(texts)
        except q.QwenEmbedError as exc:
            errors.append(exc)

    def async_call() -> None:
        async def go() -> None:
            await q.AsyncEmbeddingClient(**settings).embed_documents(texts)

        try:
            asyncio.run(go())
        except q.QwenEmbedError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=f) for f in (sync_call, sync_call, async_call, async_call)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 4
    for error in errors:
        assert isinstance(error, q.HTTPStatusError), error
        assert error.status == code
        assert "deadline" in str(error)
    # 4 calls x 8 batches in flight: their first attempts; a 500 also costs each batch a
    # retry and a bisection before its control fails; then one probe at a time
    first = 4 * 8 * (1 if code == 503 else 5)
    assert embedding_server.requests <= first + 12, embedding_server.requests


# --------------------------------------------------------------------------- several replicas


@pytest.fixture
def virtual(monkeypatch: pytest.MonkeyPatch) -> Callable[[Sim], None]:
    """``virtual(sim)``: the engine, the balancer and the call read ``sim``'s virtual clock
    (health, cool-downs, probe waits and deadlines follow it)."""
    import time as real
    import types

    from qwen_embed_plugins import _engine, _retry, _run

    def use(sim: Sim) -> None:
        clock = types.SimpleNamespace(
            monotonic=lambda: sim.now,
            perf_counter=lambda: sim.now,
            time=real.time,
            sleep=real.sleep,
        )
        for module in (balance, _engine, _retry, _run):
            monkeypatch.setattr(module, "time", clock)

    return use


def _replicas_engine(n: int, retry: q.RetryConfig, **settings: Any) -> Engine:
    run = uuid.uuid4().hex[:12]
    urls = [f"http://outage-sim-{run}-{i}.test/v1" for i in range(n)]
    config = q.EmbeddingConfig(
        base_url=urls, model="sim-model", encoding_format="float", retry=retry, **settings
    )
    eng = Engine(config)
    for replica in eng.endpoint.replicas:
        replica.answered = True  # the servers were up (an unreached one fails fast)
    return eng


class _PerReplica:
    """Answers as ``down`` says for each replica (by URL), counting the requests each got
    and when."""

    def __init__(self, eng: Engine, down: Callable[[int, float], bool], code: int = 503):
        self.urls = [r.url for r in eng.endpoint.replicas]
        self.down = down
        self.code = code
        self.times: list[list[float]] = [[] for _ in self.urls]

    def __call__(self, request: Request, now: float) -> Reply | q.QwenEmbedError:
        i = next(k for k, url in enumerate(self.urls) if request.url.startswith(url))
        self.times[i].append(now)
        if not self.down(i, now):
            return _ok(request)
        if self.code == 0:
            return q.ConnectError(f"connection refused by {self.urls[i]}", url=self.urls[i])
        return _status(self.code)


def _rows(parts: Sequence[Any]) -> int:
    assert not [p for p in parts if isinstance(p, Exception)], parts
    return sum(sum(r.shape[0] for _, r in p.pieces) for p in parts)


@pytest.mark.unit
@pytest.mark.parametrize("code", [503, 0])
@pytest.mark.parametrize("n", [2, 3])
def test_every_replica_down_for_30_s_costs_a_few_dozen_requests_each(
    virtual: Callable[[Sim], None], n: int, code: int
) -> None:
    """Every replica of an endpoint fails everything for 30 s while 32 batches are in
    flight: each replica gets its batches' first attempts and then one probe at a time,
    a few dozen requests in all, whatever waits; once they answer every text is embedded,
    the first answer coming within a probe's wait of the end."""
    eng = _replicas_engine(n, NO_DEADLINE)
    answer = _PerReplica(eng, lambda i, now: now < OUTAGE, code)
    sim = Sim(answer)
    virtual(sim)
    assert _rows(sim.run(_flows(eng, 32, 8))) == 32 * 8
    for times in answer.times:
        during = [t for t in times if t < OUTAGE]
        first = sum(t == 0.0 for t in during)  # first attempts and resends at once
        assert len(during) - first <= 40, (len(during), first)
        assert len(during) <= 32 + 40
    probes = sorted(t for times in answer.times for t in times if 0.0 < t < OUTAGE)
    assert len(probes) >= 6  # kept probing
    assert min(t for t in sim.sent if t >= OUTAGE) - OUTAGE <= balance.PROBE_CAP


@pytest.mark.unit
def test_the_first_replica_to_answer_takes_the_waiting_work(
    virtual: Callable[[Sim], None],
) -> None:
    """Two replicas down; the second comes back at 10 s, the first stays down: the
    waiting batches go to the second, the first keeps getting one probe at a time."""
    eng = _replicas_engine(2, NO_DEADLINE)
    answer = _PerReplica(eng, lambda i, now: i == 0 or now < 10.0)
    sim = Sim(answer)
    virtual(sim)
    assert _rows(sim.run(_flows(eng, 32, 8))) == 32 * 8
    back = [t for t in answer.times[1] if t >= 10.0]
    assert len(back) >= 32  # every batch was answered by it
    assert max(back) - 10.0 <= 2 * balance.PROBE_CAP  # its probe, then the waiting work
    later = [t for t in answer.times[0] if t > 0.0]
    gaps = [b - a for a, b in itertools.pairwise(later)]
    assert all(g > 0.0 for g in gaps), later  # one probe at a time


@pytest.mark.unit
def test_one_replica_down_work_flows_to_the_other_and_it_is_probed_back(
    virtual: Callable[[Sim], None],
) -> None:
    """One replica of two fails everything for 30 s while calls keep coming (one a
    second, 8 batches each): the work goes to the other, the one down gets a few
    requests and then one probe per cool-down (3 s), and takes work again once it
    answers."""
    eng = _replicas_engine(2, NO_DEADLINE.replace(circuit_cooldown=3.0))
    answer = _PerReplica(eng, lambda i, now: i == 0 and now < OUTAGE)
    sim = Sim(answer)
    virtual(sim)
    for second in range(45):
        sim.now = float(second)
        assert _rows(sim.run(_flows(eng, 8, 4))) == 8 * 4
    down = [t for t in answer.times[0] if t < OUTAGE]
    probes = [t for t in down if t >= 1.0]
    assert len(down) - len(probes) <= balance.SUSPECT_RUN + 8  # before it was ejected
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert len(probes) >= 5, probes  # probed throughout
    assert all(g >= 3.0 for g in gaps), probes  # one per cool-down
    assert len(answer.times[1]) >= 30 * 8 - len(down)  # the other took the work
    after = [t for t in answer.times[0] if t >= OUTAGE]
    assert after
    assert min(after) - OUTAGE <= 4.0  # probed back within a cool-down
    assert len(after) >= 20  # then it takes its share


@pytest.mark.unit
@pytest.mark.parametrize("n", [1, 2])
def test_the_deadline_ends_a_call_while_every_replica_is_down(
    virtual: Callable[[Sim], None], n: int
) -> None:
    """Every replica down for good, a 5 s deadline: every batch ends with the server's
    error naming the deadline, past it in virtual time by no more than a probe's wait."""
    eng = _replicas_engine(n, q.RetryConfig(deadline=5.0, circuit_failure_threshold=0))
    answer = _PerReplica(eng, lambda i, now: True)
    sim = Sim(answer)
    virtual(sim)
    parts = sim.run(_flows(eng, 32, 8))
    assert all(isinstance(p, q.HTTPStatusError) and p.status == 503 for p in parts), parts
    assert any("deadline" in str(p) for p in parts)
    assert sim.now <= 5.0 + balance.PROBE_CAP
    for times in answer.times:
        assert len([t for t in times if t > 0.0]) <= 20


def test_two_loopback_replicas_answering_503_get_one_probe_at_a_time(
    embedding_server: EmbeddingServer,
) -> None:
    """Two real servers answering 503 to everything, 16 batches in flight, a 2 s
    deadline: the call ends with the 503, naming the deadline; past the first attempts,
    each server gets a handful of probes (about one per second)."""
    with EmbeddingServer() as other:
        servers = [embedding_server, other]
        settings: dict[str, Any] = {
            "base_url": [s.base_url for s in servers],
            "batch_size": 4,
            "max_concurrency": 16,
            "deadline": 2.0,
        }
        client = q.EmbeddingClient(**settings)
        for i in range(4):
            client.embed_documents([f"warm {i}"])  # both have answered
        for s in servers:
            s.reset_counters()
            _down(s, 503)
        with pytest.raises(q.HTTPStatusError) as info:
            client.embed_documents(TEXTS[:256])
        assert info.value.status == 503
        assert "deadline" in str(info.value)
        total = sum(s.requests for s in servers)
        assert total <= 16 + 2 * 12, [s.requests for s in servers]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_uses_a_replica_whose_locks_a_thread_held(
    embedding_server: EmbeddingServer,
) -> None:
    """A thread holds a replica's lock, its probe gate and its retry budget's lock when
    the process forks: the child's call on that replica (down, so through its gate)
    neither deadlocks nor waits, and brings it back up."""
    client = q.EmbeddingClient(
        base_url=embedding_server.base_url, retry=q.RetryConfig(backoff_initial=0.01)
    )
    client.embed_query("parent")
    endpoint = balance.endpoint_for(client.config)
    replica = endpoint.replicas[0]
    replica.went_down(q.ConnectError("test: down", url=embedding_server.base_url))
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with replica._lock, replica.retries._lock, endpoint.hedges._lock:
            assert replica.gate.acquire(None)
            held.set()
            done.wait()
        replica.gate.release()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        ok = False
        try:
            signal.alarm(120)  # a deadlock ends the child (the parent then sees "0")
            ok = len(client.embed_query("child")) == embedding_server.dim
            ok = ok and not replica.down
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    done.set()
    holder.join()
    assert answer == b"1"


@pytest.mark.unit
def test_a_resend_at_once_on_another_replica_is_charged_to_the_budget() -> None:
    """A batch failing on a replica with a 507 is resent at once on another only within
    the first replica's retry budget (the one rule for every retry): spent, it is not
    resent (a 507 is not retried after a backoff either: the call fails with it)."""
    eng = _replicas_engine(2, q.RetryConfig(backoff_initial=0.01, deadline=None))
    first, second = eng.endpoint.replicas
    second.ewma = 1.0  # the first is chosen first
    while first.retries.allow():
        pass  # another part of the process spent it
    answer = _PerReplica(eng, lambda i, now: i == 0, code=507)
    (error,) = Sim(answer).run([eng.batch_flow(eng.new_call(query=True), ["q"], [0])])
    assert isinstance(error, q.HTTPStatusError), error
    assert [len(t) for t in answer.times] == [1, 0]  # not resent
    fresh = _replicas_engine(2, q.RetryConfig(backoff_initial=0.01, deadline=None))
    fresh.endpoint.replicas[1].ewma = 1.0
    answer = _PerReplica(fresh, lambda i, now: i == 0, code=507)
    (part,) = Sim(answer).run([fresh.batch_flow(fresh.new_call(query=True), ["q"], [0])])
    assert not isinstance(part, Exception), part
    assert [len(t) for t in answer.times] == [1, 1]  # within the budget: resent at once
    assert fresh.endpoint.replicas[0].retries.hedges == 1


@pytest.mark.unit
def test_an_error_answer_feeds_no_latency() -> None:
    """An error answer shows the server alive but its latency is no success's: the
    latencies behind the hedge delay and the EWMA stay empty."""
    eng = _engine(q.RetryConfig(deadline=None))
    sim = Sim(lambda request, now: _status(404, "no such route"))
    (error,) = sim.run([eng.batch_flow(eng.new_call(query=False), ["a", "b"], [0, 1])])
    assert isinstance(error, q.HTTPStatusError), error
    replica = eng.endpoint.replicas[0]
    assert replica.answered
    assert (len(replica.latencies), len(replica.single_latencies), replica.ewma) == (0, 0, None)


@pytest.mark.unit
def test_the_retry_log_and_error_name_the_bound_that_applies() -> None:
    """The WARNING's promise matches what ends the retries: ``max_retries`` given, or
    ``max_attempts`` for a failure it counts (a read timeout), the deadline for an outage;
    counts in the singular when they are 1."""
    from qwen_embed_plugins._retry import RetryState

    timeout = q.ReadTimeout("sent nothing for 0.3 s", url="http://127.0.0.1:9/v1")
    state = RetryState(q.RetryConfig(max_attempts=4), started=0.0)
    assert state.bound() == ""  # nothing counted yet
    assert state.next_delay(timeout, now=0.0, fresh_connection=True) is not None
    assert state.bound() == "within 4 attempts in all (RetryConfig.max_attempts)"
    while state.next_delay(timeout, now=0.0, fresh_connection=True) is not None:
        pass
    assert state.ended() == " (gave up after 4 attempts: RetryConfig.max_attempts=4)"
    outage = q.OverloadedError("HTTP 503", status=503, url="http://127.0.0.1:9/v1")
    waiting = RetryState(q.RetryConfig(max_attempts=4, deadline=60.0), started=0.0)
    assert waiting.next_delay(outage, now=0.0, fresh_connection=True) is not None
    assert waiting.bound() == ""  # an outage: the deadline ends it
    once = RetryState(q.RetryConfig(max_retries=1), started=0.0)
    assert once.bound() == "at most 1 time (max_retries)"
    assert once.next_delay(outage, now=0.0, fresh_connection=True) is not None
    assert once.next_delay(outage, now=0.0, fresh_connection=True) is None
    assert once.ended() == " (gave up after 2 attempts: max_retries=1)"
