"""The engine driven with scripted replies, no socket: the flows' own operations
(``Send`` -> a ``Reply`` or a thrown error, ``Sleep`` -> recorded, not slept) show each
decision of the failure policy on its own: back off, bisect, learn a batch cap, resend a
bare string, and which error a call's deadline ends on."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import orjson
import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins._engine import Engine
from qwen_embed_plugins._run import Call, Flow, Hold, Part, Send, Sleep, run_async, run_sync
from qwen_embed_plugins._transport import Reply, Request
from qwen_embed_plugins.errors import QwenEmbedError, total_timeout_error

pytestmark = pytest.mark.unit  # scripted replies: no server, no socket

DIM = 4
FAST = q.RetryConfig(backoff_initial=0.01, backoff_max=0.02, max_attempts=2)

Answer = Callable[[Request, int], "Reply | QwenEmbedError"]


class Script:
    """Runs a flow as ``run_sync`` does, answering each ``Send`` with ``answer(request,
    number)`` (a ``Reply``, or an error thrown into the flow as a transport raises it),
    recording each ``Sleep`` instead of sleeping, and taking each ``Hold``'s gate at
    once (one flow: nothing else holds it)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.inputs: list[Any] = []  # the ``input`` of each request sent, in order
        self.sleeps: list[float] = []

    def run(self, flow: Flow) -> Any:
        value: Any = None
        error: BaseException | None = None
        try:
            while True:
                try:
                    op = flow.send(value) if error is None else flow.throw(error)
                except StopIteration as stop:
                    return stop.value
                value = error = None
                if isinstance(op, Sleep):
                    self.sleeps.append(op.seconds)
                    continue
                if isinstance(op, Hold):  # a replica's probe gate: one flow, never waits
                    value = op.gate.acquire(0.0)
                    continue
                assert isinstance(op, Send), op
                self.inputs.append(orjson.loads(op.request.body)["input"])
                outcome = self.answer(op.request, len(self.inputs))
                if isinstance(outcome, BaseException):
                    error = outcome
                else:
                    value = outcome
        finally:
            flow.close()

    @property
    def sizes(self) -> list[int]:
        return [len(i) if isinstance(i, list) else 1 for i in self.inputs]


def _vector(text: str) -> list[float]:
    seed = sum(text.encode()) + len(text)
    return [1.0 + (seed + k) % 7 for k in range(DIM)]


def ok(request: Request) -> Reply:
    """A 200 with one float vector per input (a bare string input is one input)."""
    texts = orjson.loads(request.body)["input"]
    texts = [texts] if isinstance(texts, str) else texts
    data = [
        {"object": "embedding", "index": i, "embedding": _vector(t)} for i, t in enumerate(texts)
    ]
    body = orjson.dumps({"object": "list", "data": data, "model": "script-model"})
    return Reply(200, {"content-type": "application/json"}, body, fresh=True)


def status(code: int, message: str) -> Reply:
    body = orjson.dumps({"error": {"message": message}})
    return Reply(code, {"content-type": "application/json"}, body, fresh=True)


def engine(retry: q.RetryConfig = FAST, **settings: Any) -> Engine:
    """An engine for an endpoint of its own (a host no other test uses: no learned
    state from elsewhere); nothing is ever sent to it."""
    url = f"http://engine-script-{uuid.uuid4().hex[:12]}.test/v1"
    config = q.EmbeddingConfig(
        base_url=url, model="script-model", encoding_format="float", retry=retry, **settings
    )
    return Engine(config)


def batch(eng: Engine, call: Call, texts: Sequence[str]) -> Flow:
    return eng.batch_flow(call, list(texts), list(range(len(texts))))


def rows_of(part: Part, count: int) -> dict[int, Any]:
    found: dict[int, Any] = {}
    for offset, rows in part.pieces:
        for k in range(rows.shape[0]):
            found[offset + k] = rows[k]
    assert set(found) | set(part.failed) == set(range(count))
    return found


def test_an_outage_backs_off_then_answers() -> None:
    """[503, 503, 200]: one vector after two backoffs, the same request each time."""
    replies = [status(503, "The request queue is full."), status(503, "busy")]

    def answer(request: Request, n: int) -> Reply:
        return replies[n - 1] if n <= len(replies) else ok(request)

    eng = engine()
    script = Script(answer)
    part = script.run(batch(eng, eng.new_call(query=True), ["what is pooling?"]))
    assert script.inputs == [["what is pooling?"]] * 3
    assert len(script.sleeps) == 2
    assert all(s > 0 for s in script.sleeps)
    assert part.failed == {}
    (row,) = rows_of(part, 1).values()
    expected = np.array(_vector("what is pooling?"), dtype=np.float32)
    np.testing.assert_allclose(row, expected / np.linalg.norm(expected), rtol=1e-6)


@pytest.mark.parametrize("poisoned", [0, 5, 7])
def test_bisection_isolates_the_poisoned_input(poisoned: int) -> None:
    """A 500 for any request that holds the poisoned text: the batch of 8 is bisected;
    the other 7 are embedded and the error names the caller's index."""
    texts = [f"passage {i}" for i in range(8)]
    texts[poisoned] = "poison"

    def answer(request: Request, n: int) -> Reply:
        sent = orjson.loads(request.body)["input"]
        if "poison" in ([sent] if isinstance(sent, str) else sent):
            return status(500, "CUDA error: device-side assert triggered")
        return ok(request)

    eng = engine()
    script = Script(answer)
    part = script.run(batch(eng, eng.new_call(query=False, on_error="skip"), texts))
    assert list(part.failed) == [poisoned]
    error = part.failed[poisoned]
    assert isinstance(error, q.ServerError)
    assert error.index == poisoned
    assert f"input index {poisoned}" in str(error)
    rows = rows_of(part, 8)
    assert sorted(rows) == [i for i in range(8) if i != poisoned]
    assert max(script.sizes) == 8
    assert 1 in script.sizes


def test_a_poisoned_input_raises_in_raise_mode() -> None:
    texts = [f"passage {i}" for i in range(8)]
    texts[3] = "poison"

    def answer(request: Request, n: int) -> Reply:
        if "poison" in orjson.loads(request.body)["input"]:
            return status(500, "CUDA error")
        return ok(request)

    eng = engine()
    with pytest.raises(q.ServerError) as info:
        Script(answer).run(batch(eng, eng.new_call(query=False), texts))
    assert info.value.index == 3


def test_a_413_teaches_the_batch_cap() -> None:
    """A 413 stating a limit of 4: the batch of 8 is sent again as two of 4, and the
    replica's cap is kept: the next call's batch is split before anything is sent."""

    def answer(request: Request, n: int) -> Reply:
        size = len(orjson.loads(request.body)["input"])
        if size > 4:
            return status(413, f"batch size {size} > maximum allowed batch size 4")
        return ok(request)

    eng = engine()
    texts = [f"passage {i}" for i in range(8)]
    first = Script(answer)
    part = first.run(batch(eng, eng.new_call(query=False), texts))
    assert sorted(rows_of(part, 8)) == list(range(8))
    assert first.sizes == [8, 4, 4]
    assert first.sleeps == []
    replica = eng.endpoint.replicas[0]
    assert replica.state(eng.model).batch.limit == 4
    again = Script(answer)
    again.run(batch(eng, eng.new_call(query=False), texts))
    assert again.sizes == [4, 4]


def test_a_refused_one_item_list_is_resent_as_a_bare_string() -> None:
    """A 500 for ``input: ["text"]`` that ``input: "text"`` does not get: resent at once
    as a bare string, and learned for the replica."""

    def answer(request: Request, n: int) -> Reply:
        if isinstance(orjson.loads(request.body)["input"], list):
            return status(500, "list index out of range")
        return ok(request)

    eng = engine()
    first = Script(answer)
    part = first.run(batch(eng, eng.new_call(query=True), ["one"]))
    assert first.inputs == [["one"], "one"]
    assert first.sleeps == []
    assert len(rows_of(part, 1)) == 1
    assert eng.endpoint.replicas[0].state(eng.model).bare_input is True
    second = Script(answer)
    second.run(batch(eng, eng.new_call(query=True), ["two"]))
    assert second.inputs == ["two"]


def _at_deadline(call: Call, request: Request) -> QwenEmbedError:
    """The transport's error for an exchange its total budget (the call's time left)
    cut: returned once the call's deadline has passed, as the transport raises it."""
    while (call.remaining() or 0.0) > 0:
        time.sleep(0.005)  # the clock is the event here: the deadline passing
    return total_timeout_error(request.ctx, request.total)


def test_the_deadline_in_an_outage_reports_the_outage() -> None:
    """503s, then the retry the deadline cuts: the call raises the last server answer
    (the outage), not the timeout of the retry cut short."""
    eng = engine(FAST.replace(query_deadline=0.3))
    call = eng.new_call(query=True)

    def answer(request: Request, n: int) -> Reply | QwenEmbedError:
        if n <= 3:
            return status(503, "The request queue is full.")
        return _at_deadline(call, request)

    script = Script(answer)
    with pytest.raises(q.HTTPStatusError) as info:
        script.run(batch(eng, call, ["still busy"]))
    assert info.value.status == 503
    assert isinstance(info.value.__context__, q.ReadTimeout)  # why the retries stopped
    assert len(script.inputs) == 4


def test_the_deadline_with_no_answer_reports_the_timeout() -> None:
    """The first request is cut by the deadline: no server answered in this call, so
    the timeout is the error."""
    eng = engine(FAST.replace(query_deadline=0.2))
    call = eng.new_call(query=True)
    script = Script(lambda request, n: _at_deadline(call, request))
    with pytest.raises(q.ReadTimeout, match="the call's deadline"):
        script.run(batch(eng, call, ["silent"]))
    assert len(script.inputs) == 1


def test_both_drivers_run_the_same_decisions() -> None:
    """``run_sync`` and ``run_async`` (the clients' drivers) perform the same flow: the
    same requests for the same script ([503, 503, 200]), two backoffs slept."""

    def scripted() -> tuple[Callable[[Send], Reply], list[Any]]:
        seen: list[Any] = []

        def send(op: Send) -> Reply:
            seen.append(orjson.loads(op.request.body)["input"])
            if len(seen) <= 2:
                return status(503, "The request queue is full.")
            return ok(op.request)

        return send, seen

    eng = engine()
    send, seen = scripted()
    part = run_sync(batch(eng, eng.new_call(query=True), ["q"]), send)
    assert seen == [["q"]] * 3
    assert len(rows_of(part, 1)) == 1

    async def main() -> tuple[Part, list[Any]]:
        send, seen = scripted()

        async def asend(op: Send) -> Reply:
            return send(op)

        eng = engine()
        found = await run_async(batch(eng, eng.new_call(query=True), ["q"]), asend)
        return found, seen

    part, seen = asyncio.run(main())
    assert seen == [["q"]] * 3
    assert len(rows_of(part, 1)) == 1
