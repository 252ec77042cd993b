"""Running engine flows: the operations a flow yields, the state of a call, the sync
and async drivers, and the windows that keep a call's batches in flight.

A flow (``_engine``) is a generator that yields ``Send`` (perform this exchange on this
replica), ``Sleep`` (wait) and ``Hold`` (take a gate: wait for a replica's probe);
``run_sync`` performs them with blocking I/O, ``run_async`` with awaits.
``run_windowed`` / ``arun_windowed`` run a call's batches with at most ``limit`` in
flight; ``hedged`` / ``ahedged`` race a second copy of a slow single-query flow.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._config import OnError
from ._state import STATE
from ._transport import ProcessGate, Reply, Request
from .errors import QwenEmbedError

if TYPE_CHECKING:
    from ._balance import Budget, Replica
    from ._protocol import FloatArray
    from ._tracing import CallTrace

__all__ = [
    "Abandoned",
    "Call",
    "Hold",
    "Part",
    "Send",
    "Sleep",
    "ahedged",
    "arun_windowed",
    "hedged",
    "run_async",
    "run_sync",
    "run_windowed",
    "shared_executor",
]

# --------------------------------------------------------------------------- operations


class Send:
    """Operation: perform ``request`` on ``replica``'s pool; the flow receives the
    ``Reply`` (or has the translated ``QwenEmbedError`` thrown in)."""

    __slots__ = ("replica", "request")

    def __init__(self, replica: Replica, request: Request) -> None:
        self.replica = replica
        self.request = request


class Sleep:
    """Operation: wait ``seconds`` before going on."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


class Hold:
    """Operation: take ``gate`` (a ``ProcessGate``), waiting at most ``timeout`` seconds
    (``None``: no limit) without polling; the flow receives whether it got it, and
    releases it itself."""

    __slots__ = ("gate", "timeout")

    def __init__(self, gate: ProcessGate, timeout: float | None) -> None:
        self.gate = gate
        self.timeout = timeout


Op = Send | Sleep | Hold
Flow = Generator[Op, Any, Any]


# --------------------------------------------------------------------------- call state


_DIM_LOCK = threading.Lock()


@dataclass
class Call:
    """One embedding call under way.

    Attributes:
        started: monotonic start time, in seconds.
        deadline: seconds the call may take in all (``None``: no deadline).
        on_error: ``"raise"`` or ``"skip"`` for inputs the server cannot embed.
        failures: the caller's index -> its error, for inputs that failed.
        stop: set once an input error decided a ``"raise"`` call: no new batch starts
            (batches under way with lower indices finish, so the lowest is raised).
        lowest: the lowest input index found failing so far (``"raise"``).
        last_ok: monotonic time of the call's latest successful request (a batch or a
            control request), in seconds; ``-inf`` before any. A single input's
            ambiguous failure (a 500, a dropped connection, a 400 naming no input) is
            blamed on that input only when a request succeeded after it was sent.
        ok_on: the replicas (labels) that answered a request of the call: a refusal
            by one that has not is checked with a control request first (another
            replica's success says nothing of its options).
        dim: the vector size of the call's first answer (``agree_dim``), ``None`` before.
        server_errors: the errors that end the call whatever its inputs (a server never
            reached, a control request that failed too): raised first.
        trace: the call's OpenTelemetry span (``_tracing``), ``None`` when not traced.
    """

    started: float
    deadline: float | None
    on_error: OnError = "raise"
    failures: dict[int, QwenEmbedError] = field(default_factory=dict)
    stop: bool = False
    lowest: int | None = None
    last_ok: float = float("-inf")
    ok_on: set[str] = field(default_factory=set)
    dim: int | None = None
    server_errors: set[QwenEmbedError] = field(default_factory=set)
    trace: CallTrace | None = None

    def agree_dim(self, size: int) -> int:
        """The call's vector size: ``size`` if this is the first answer, else the first
        answer's (batches finish on several threads)."""
        if self.dim is not None:
            return self.dim
        with _DIM_LOCK:  # one lock for every call: taken once per call, not one per call
            if self.dim is None:
                self.dim = size
            return self.dim

    def remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return self.deadline - (time.monotonic() - self.started)


class Part:
    """The result of one planned batch: decoded rows (possibly in pieces, when the
    batch was split) and the inputs that failed."""

    __slots__ = ("failed", "pieces")

    def __init__(self) -> None:
        self.pieces: list[tuple[int, FloatArray]] = []  # (offset in the batch, rows)
        self.failed: dict[int, QwenEmbedError] = {}  # offset in the batch -> error

    def merge(self, other: Part, offset: int) -> None:
        self.pieces.extend((offset + o, rows) for o, rows in other.pieces)
        self.failed.update({offset + o: e for o, e in other.failed.items()})


# --------------------------------------------------------------------------- drivers


class Abandoned(Exception):
    """The flow's answer is no longer wanted (a hedge lost the race): it stopped."""


def run_sync(
    flow: Flow, send: Callable[[Send], Reply], abandon: threading.Event | None = None
) -> Any:
    """Run ``flow`` with blocking I/O: ``send`` performs a ``Send``; ``Sleep`` sleeps.

    Raises:
        Abandoned: ``abandon`` was set; the flow stopped before its next operation.
    """
    value: Any = None
    error: BaseException | None = None
    try:
        while True:
            try:
                op = flow.send(value) if error is None else flow.throw(error)
            except StopIteration as stop:
                return stop.value
            value = error = None
            if abandon is not None and abandon.is_set():
                raise Abandoned
            if type(op) is Send:
                try:
                    value = send(op)
                except QwenEmbedError as exc:
                    error = exc
            elif type(op) is Hold:
                value = op.gate.acquire(op.timeout)
            else:
                if type(op) is not Sleep:
                    raise TypeError(f"a flow yielded {op!r}")
                if abandon is None:
                    time.sleep(op.seconds)
                elif abandon.wait(op.seconds):
                    raise Abandoned
    finally:
        flow.close()  # an abandoned flow finishes its accounting ("cancelled")


async def run_async(flow: Flow, send: Callable[[Send], Any]) -> Any:
    """Run ``flow`` on the running loop: ``send`` returns an awaitable ``Reply``."""
    value: Any = None
    error: BaseException | None = None
    try:
        while True:
            try:
                op = flow.send(value) if error is None else flow.throw(error)
            except StopIteration as stop:
                return stop.value
            value = error = None
            if type(op) is Send:
                try:
                    value = await send(op)
                except QwenEmbedError as exc:
                    error = exc
            elif type(op) is Hold:
                value = await op.gate.aacquire(op.timeout)
            else:
                if type(op) is not Sleep:
                    raise TypeError(f"a flow yielded {op!r}")
                await asyncio.sleep(op.seconds)
    finally:
        flow.close()  # a cancelled call finishes its accounting ("cancelled")


# --------------------------------------------------------------------------- windows

_EXECUTOR_THREADS = 64


def shared_executor() -> ThreadPoolExecutor:
    """Threads that carry concurrent batches of sync calls (one set per process:
    ``STATE.executor``; a forked child makes its own)."""
    ex = STATE.executor
    if ex is None:
        with STATE.lock:
            ex = STATE.executor
            if ex is None:
                ex = STATE.executor = ThreadPoolExecutor(
                    max_workers=_EXECUTOR_THREADS, thread_name_prefix="qwen-embed"
                )
    return ex


def _pick_error(call: Call, errors: list[BaseException]) -> BaseException:
    """The error a failed call raises: an input error with the lowest index when the
    call stopped on bad inputs, else the first error; an error a control request showed
    to be the server's (whatever the input) comes first."""
    for e in errors:
        if e in call.server_errors:
            return e
    inputs = [e for e in errors if isinstance(e, QwenEmbedError) and e.index is not None]
    if inputs:
        return min(inputs, key=lambda e: e.index or 0)
    return errors[0]


def run_windowed(jobs: Iterable[int], job: Callable[[int], None], limit: int, call: Call) -> None:
    """Run ``job(i)`` for each ``i`` of ``jobs`` with at most ``limit`` in flight
    (threads). ``jobs`` is read one index at a time, as a slot frees up (so it may decide
    the next batch from the answers so far). On a failure no new job starts; jobs under
    way finish, then the chosen error is raised."""
    it = iter(jobs)
    if limit == 1:
        for i in it:
            if call.stop:
                break
            job(i)
        return
    ex = shared_executor()
    pending: set[Future[None]] = set()
    errors: list[BaseException] = []
    more = True
    while more or pending:
        while more and len(pending) < limit and not errors and not call.stop:
            nxt = next(it, None)
            if nxt is None:
                more = False
            else:
                pending.add(ex.submit(job, nxt))
        if not pending:
            break
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        for fut in done:
            exc = fut.exception()
            if exc is not None:
                errors.append(exc)
    if errors:
        raise _pick_error(call, errors)


async def arun_windowed(
    jobs: Iterable[int], job: Callable[[int], Any], limit: int, call: Call
) -> None:
    """Async twin of ``run_windowed``: tasks on the running loop."""
    it = iter(jobs)
    if limit == 1:
        for i in it:
            if call.stop:
                break
            await job(i)
        return
    pending: set[asyncio.Future[None]] = set()
    errors: list[BaseException] = []
    more = True
    try:
        while more or pending:
            while more and len(pending) < limit and not errors and not call.stop:
                nxt = next(it, None)
                if nxt is None:
                    more = False
                else:
                    pending.add(asyncio.ensure_future(job(nxt)))
            if not pending:
                break
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if exc is not None:
                    errors.append(exc)
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    if errors:
        raise _pick_error(call, errors)


# --------------------------------------------------------------------------- hedging


def hedged(first: Callable[[threading.Event], Any], delay: float, budget: Budget) -> Any:
    """Run ``first(abandon)``; if it has not finished after ``delay`` seconds and the
    budget allows, run a second copy and return whichever answers first (a failed copy
    waits for the other). The slower copy is then abandoned: a blocking request under way
    finishes, but it makes no further request or retry."""
    budget.seen()
    ex = shared_executor()
    stop_one, stop_two = threading.Event(), threading.Event()
    one = ex.submit(first, stop_one)
    done, _ = wait([one], timeout=delay)
    if done or not budget.allow():
        return one.result()
    two = ex.submit(first, stop_two)
    pending = {one, two}
    error: BaseException | None = None
    try:
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                exc = future.exception()
                if exc is None:
                    if future is two:
                        budget.won()
                    return future.result()
                error = error or exc
    finally:
        stop_one.set()
        stop_two.set()
    if error is None:  # cannot happen
        raise RuntimeError("internal error: error is None")
    raise error


async def ahedged(first: Callable[[], Any], delay: float, budget: Budget) -> Any:
    """The async ``hedged``: the slower copy is cancelled (its connection closed)."""
    budget.seen()
    one = asyncio.ensure_future(first())
    done, _ = await asyncio.wait({one}, timeout=delay)
    if done or not budget.allow():
        return await one
    two = asyncio.ensure_future(first())
    pending: set[asyncio.Future[Any]] = {one, two}
    error: BaseException | None = None
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if exc is None:
                    if task is two:
                        budget.won()
                    return task.result()
                error = error or exc
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    if error is None:  # cannot happen
        raise RuntimeError("internal error: error is None")
    raise error
