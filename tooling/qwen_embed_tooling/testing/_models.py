"""Server models for benchmarks: how a loaded server answers (slots, queues, rate limits,
latency tails), given to ``EmbeddingServer(server_model=...)``.

Each model is a frozen dataclass, JSON-safe through `model_to_dict` / `model_from_dict`
so a server in a child process (``process=True``) runs it too. Its clock is the serving
process's ``time.monotonic()``; slow start counts from each `EmbeddingServer.start`.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Final, TypeAlias

from ._common import _integer, _number


@dataclass(frozen=True)
class GPULike:
    """A GPU server: ``slots`` batches computed at once, each taking ``base + per_token *
    tokens`` seconds (tokens by `count_tokens`); requests beyond the slots wait in a FIFO
    queue (so latency grows with the tokens queued ahead), and past ``queue_limit``
    waiting requests the dialect's overload answer comes at once (SGLang: 503 "The
    request queue is full.").

    Attributes:
        slots: batches served at once (>= 1).
        base: seconds per batch.
        per_token: seconds per token of the batch.
        queue_limit: most requests waiting for a slot (>= 0).
    """

    kind: ClassVar[str] = "gpu"
    slots: int = 4
    base: float = 0.002
    per_token: float = 0.00002
    queue_limit: int = 64

    def __post_init__(self) -> None:
        _integer("slots", self.slots, minimum=1)
        _number("base", self.base)
        _number("per_token", self.per_token)
        _integer("queue_limit", self.queue_limit, minimum=0)


@dataclass(frozen=True)
class SlowStart(GPULike):
    """A `GPULike` server that starts cold: ``start_slots`` slots at start, growing
    linearly to ``slots`` over the first ``ramp`` seconds after each start (a warming
    cache, a compiling kernel, an autoscaler adding replicas).

    Attributes:
        ramp: seconds from start to full capacity.
        start_slots: slots at start (1 <= start_slots <= slots).
    """

    kind: ClassVar[str] = "slow_start"
    slots: int = 8
    ramp: float = 10.0
    start_slots: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        _number("ramp", self.ramp)
        _integer("start_slots", self.start_slots, minimum=1)
        if self.start_slots > self.slots:
            raise ValueError(f"start_slots ({self.start_slots}) must be <= slots ({self.slots})")


@dataclass(frozen=True)
class RateLimited:
    """A provider's rate limit: a token bucket of ``burst`` requests refilled at ``rate``
    requests per second; a request finding it empty gets 429 (the dialect's body) at
    once, with ``Retry-After`` (whole seconds until the next token, at least 1) when
    ``retry_after`` is True.

    Attributes:
        rate: requests per second (> 0).
        burst: bucket size in requests (0: ``max(1, round(rate))``).
        retry_after: send ``Retry-After``.
    """

    kind: ClassVar[str] = "rate_limit"
    rate: float = 50.0
    burst: int = 0
    retry_after: bool = True

    def __post_init__(self) -> None:
        _number("rate", self.rate, minimum=1e-9)
        _integer("burst", self.burst, minimum=0)


@dataclass(frozen=True)
class HeavyTail:
    """Latency with a heavy tail: each request takes ``base`` seconds, except that 1 in
    ``every`` (drawn from ``random.Random(seed)`` in arrival order) takes ``factor *
    base``.

    Attributes:
        base: seconds per request.
        every: one slow request in this many, on average (>= 1).
        factor: how many times ``base`` a slow request takes (>= 1).
        seed: seed of the draws.
    """

    kind: ClassVar[str] = "heavy_tail"
    base: float = 0.005
    every: int = 50
    factor: float = 10.0
    seed: int = 0

    def __post_init__(self) -> None:
        _number("base", self.base)
        _integer("every", self.every, minimum=1)
        _number("factor", self.factor, minimum=1.0)


@dataclass(frozen=True)
class DynamicBatching:
    """A GPU server that batches on its side (as SGLang, vLLM, TEI and Infinity do): one
    forward pass at a time; a request opens a pass, which waits ``window`` seconds for
    more requests and takes every request that arrives before it starts (while the GPU
    is busy with the pass before) as long as the pass stays within ``max_tokens``
    tokens (`count_tokens`). A pass of ``t`` tokens takes ``base + per_token * t``
    seconds (a request above ``max_tokens`` alone takes ``ceil(t / max_tokens)``
    passes). Every request of a pass is answered when it ends.

    Attributes:
        window: seconds a new pass waits for more requests.
        max_tokens: most tokens per pass (>= 1).
        base: seconds per pass.
        per_token: seconds per token of the pass.
    """

    kind: ClassVar[str] = "dynamic_batching"
    window: float = 0.002
    max_tokens: int = 8192
    base: float = 0.005
    per_token: float = 0.00005

    def __post_init__(self) -> None:
        _number("window", self.window)
        _integer("max_tokens", self.max_tokens, minimum=1)
        _number("base", self.base)
        _number("per_token", self.per_token)


ServerModel: TypeAlias = GPULike | SlowStart | RateLimited | HeavyTail | DynamicBatching
_MODELS: Final[dict[str, type[ServerModel]]] = {
    cls.kind: cls for cls in (GPULike, SlowStart, RateLimited, HeavyTail, DynamicBatching)
}


def model_to_dict(model: ServerModel) -> dict[str, Any]:
    """A JSON-safe form: the fields plus ``"kind"``."""
    return {"kind": model.kind, **asdict(model)}


def model_from_dict(data: Mapping[str, Any]) -> ServerModel:
    """Rebuild a model from `model_to_dict` output.

    Raises:
        ValueError: unknown ``kind`` or a field out of range.
        TypeError: an unknown field.
    """
    values = dict(data)
    kind = values.pop("kind", None)
    if kind not in _MODELS:
        raise ValueError(f"unknown server model {kind!r}; expected one of {', '.join(_MODELS)}")
    return _MODELS[kind](**values)


# --------------------------------------------------------------------------------------
# Running the models inside the app
# --------------------------------------------------------------------------------------

_Pause = Callable[[float], Awaitable[bool]]


class _QueueFull(Exception):
    """No slot and no room in the queue."""


class _Slots:
    """FIFO batch slots with a bounded queue; capacity may grow over time (slow start)."""

    def __init__(self, spec: GPULike) -> None:
        self.spec = spec
        self.active = 0
        self.waiting: deque[asyncio.Future[None]] = deque()
        self.started = time.monotonic()

    def capacity(self) -> int:
        spec = self.spec
        if not isinstance(spec, SlowStart) or spec.ramp <= 0.0:
            return spec.slots
        done = min(1.0, (time.monotonic() - self.started) / spec.ramp)
        return max(1, math.floor(spec.start_slots + (spec.slots - spec.start_slots) * done))

    async def acquire(self) -> None:
        if self.active < self.capacity() and not self.waiting:
            self.active += 1
            return
        if len(self.waiting) >= self.spec.queue_limit:
            raise _QueueFull
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():
                self.release()  # the slot was handed over just as we were cancelled
            else:
                future.cancel()
                self.waiting = deque(f for f in self.waiting if f is not future)
            raise

    def release(self) -> None:
        self.active -= 1
        self.wake()

    def wake(self) -> None:
        while self.waiting and self.active < self.capacity():
            future = self.waiting.popleft()
            if not future.done():
                self.active += 1
                future.set_result(None)


class _Pass:
    __slots__ = ("done", "started", "tokens")

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.started = False
        self.done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()


class _Batcher:
    """`DynamicBatching` on the server's loop: passes formed from arriving requests, run
    one at a time in the order they were opened."""

    def __init__(self, spec: DynamicBatching) -> None:
        self.spec = spec
        self.forming: _Pass | None = None
        self.gpu = asyncio.Lock()

    async def serve(self, tokens: int, pause: _Pause) -> bool:
        spec = self.spec
        found = self.forming
        if found is None or found.started or found.tokens + tokens > spec.max_tokens:
            found = self.forming = _Pass(tokens)
            asyncio.get_running_loop().create_task(self._run(found, pause))
        else:
            found.tokens += tokens
        return await asyncio.shield(found.done)

    async def _run(self, this: _Pass, pause: _Pause) -> None:
        spec = self.spec
        ok = True
        try:
            if spec.window > 0.0:
                ok = await pause(spec.window)
            async with self.gpu:
                this.started = True
                if self.forming is this:
                    self.forming = None
                passes = max(1, math.ceil(this.tokens / spec.max_tokens))
                seconds = passes * spec.base + spec.per_token * this.tokens
                if ok and seconds > 0.0:
                    ok = await pause(seconds)
        finally:
            if not this.done.done():
                this.done.set_result(ok)


class _Models:
    """The models of one server run: admission (rate limits) and service (slots,
    latency). Lives on the server's event loop; `begin_run` restarts the clocks."""

    def __init__(self, specs: Sequence[Mapping[str, Any]]) -> None:
        self.specs = [model_from_dict(spec) for spec in specs]
        self._slots: list[_Slots] = []
        self._buckets: list[tuple[RateLimited, list[float]]] = []
        self._tails: list[tuple[HeavyTail, random.Random]] = []
        self._batchers: list[_Batcher] = []
        self.begin_run()

    def begin_run(self) -> None:
        now = time.monotonic()
        self._slots = [_Slots(s) for s in self.specs if isinstance(s, GPULike)]
        self._buckets = [
            (s, [float(s.burst or max(1, round(s.rate))), now])
            for s in self.specs
            if isinstance(s, RateLimited)
        ]
        self._tails = [
            (s, random.Random(s.seed))  # noqa: S311 -- seeded latency draws
            for s in self.specs
            if isinstance(s, HeavyTail)
        ]
        self._batchers = []  # made on the server's loop, at the first request

    def __bool__(self) -> bool:
        return bool(self.specs)

    def admit(self) -> tuple[bool, str | None]:
        """Take a token from every bucket: ``(True, None)``, or ``(False, retry_after)``
        (``retry_after`` None when the model sends none)."""
        now = time.monotonic()
        for spec, bucket in self._buckets:
            size = float(spec.burst or max(1, round(spec.rate)))
            tokens = min(size, bucket[0] + (now - bucket[1]) * spec.rate)
            bucket[1] = now
            if tokens < 1.0:
                bucket[0] = tokens
                wait = max(1, math.ceil((1.0 - tokens) / spec.rate))
                return False, (str(wait) if spec.retry_after else None)
            bucket[0] = tokens - 1.0
        return True, None

    async def serve(self, tokens: int, pause: _Pause) -> tuple[str | None, bool]:
        """Hold the request for its service time. Returns the outcome (None when served,
        ``"full"`` when a queue was full: answer the overload status, ``"stopped"`` when
        the server began stopping meanwhile) and whether a heavy tail made it slow."""
        held: list[_Slots] = []
        slow = False
        if not self._batchers:
            self._batchers = [_Batcher(s) for s in self.specs if isinstance(s, DynamicBatching)]
        for batcher in self._batchers:
            if not await batcher.serve(tokens, pause):
                return "stopped", False
        try:
            for slots in self._slots:
                try:
                    await slots.acquire()
                except _QueueFull:
                    return "full", False
                held.append(slots)
            seconds = max(
                (s.spec.base + s.spec.per_token * tokens for s in held),
                default=0.0,
            )
            for spec, rng in self._tails:
                this_slow = rng.random() < 1.0 / spec.every
                slow = slow or this_slow
                seconds += spec.base * (spec.factor if this_slow else 1.0)
            if seconds > 0.0 and not await pause(seconds):
                return "stopped", slow
            return None, slow
        finally:
            for slots in held:
                slots.release()
