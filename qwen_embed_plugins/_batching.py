"""Batch sizing, in one place: how many texts (and tokens) go in each request.

- **The plan** (``plan_batches``, ``plan_call``): a call's texts deduplicated (identical
  texts sent once, order kept) and, for a stated ``batch_size``, cut up front.
- **Growth** (``BatchSizer``, ``batch_size="auto"``, the default): each replica's batch
  size found from the latency of the batches it answered.
- **Waves** (``auto_batch_size``, ``Batches``): an ``"auto"`` call cut one batch at a
  time as its window frees a slot; one wave for a call that fits one, equal batches in
  the last wave of a long call.
- **Learned caps** (``BatchState``, per replica and model): limits a server stated or
  dropped batches showed (retested; learned by ``_learn``), and those a plan respects
  up front.
- **Token splitting** (``split_by_tokens``, ``split_runs``, ``Split``).

Everything here is I/O-free and shared by the sync and async clients.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from ._protocol import estimate_tokens
from .errors import (
    BatchTooLargeError,
    HTTPStatusError,
    PoolTimeout,
    QwenEmbedError,
    TimeoutException,
)

if TYPE_CHECKING:
    from ._metrics import EndpointMetrics

__all__ = [
    "RETEST_EVERY",
    "RETEST_EVERY_MAX",
    "BatchPlan",
    "BatchSizer",
    "BatchState",
    "Batches",
    "Split",
    "auto_batch_size",
    "check_limits",
    "limit_held",
    "observe_answer",
    "plan_batches",
    "plan_call",
    "plan_limits",
    "retest_failed",
    "split_by_tokens",
    "split_runs",
    "text_bytes",
]

_log = logging.getLogger("qwen_embed_plugins")

# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """How a call's texts are sent.

    Attributes:
        unique: the distinct texts in first-seen order (identical texts are sent once).
        first_index: for each unique text, the caller's index of its first occurrence
            (errors name it).
        positions: for each input, its row in ``unique`` (``None`` when there are no
            duplicates: rows are already in input order).
        batches: ``(start, stop)`` slices of ``unique``, each at most ``batch_size``.
    """

    unique: list[str]
    first_index: list[int]
    positions: npt.NDArray[np.intp] | None
    batches: list[tuple[int, int]]


def split_by_tokens(
    sizes: Sequence[int], start: int, stop: int, budget: int | None, count: int
) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into runs of at most ``count`` items whose ``sizes`` sum to
    at most ``budget`` (an item over the budget alone forms its own run)."""
    if budget is None:
        return [(i, min(i + count, stop)) for i in range(start, stop, count)]
    runs: list[tuple[int, int]] = []
    first, total = start, 0
    for i in range(start, stop):
        size = sizes[i]
        if i > first and (total + size > budget or i - first >= count):
            runs.append((first, i))
            first, total = i, 0
        total += size
    if first < stop:
        runs.append((first, stop))
    return runs


def plan_batches(
    texts: Sequence[str], batch_size: int, *, max_tokens: int | None = None
) -> BatchPlan:
    """Deduplicate ``texts`` and cut them into batches of at most ``batch_size`` texts
    and, when ``max_tokens`` is given, at most that many estimated tokens
    (``estimate_tokens``) per batch."""
    seen: dict[str, int] = {}
    positions: list[int] = []
    first_index: list[int] = []
    for i, text in enumerate(texts):
        row = seen.get(text)
        if row is None:
            row = seen[text] = len(first_index)
            first_index.append(i)
        positions.append(row)
    unique = list(seen)
    n = len(unique)
    sizes = [] if max_tokens is None else [estimate_tokens(t) for t in unique]
    batches = split_by_tokens(sizes, 0, n, max_tokens, batch_size)
    pos = None if n == len(texts) else np.asarray(positions, dtype=np.intp)
    return BatchPlan(unique=unique, first_index=first_index, positions=pos, batches=batches)


# --------------------------------------------------------------------------- growth


_KNEE_GAIN = 1.2
"""At the knee, the larger size is kept only if it carried this many times the texts
per second of the smaller."""


def _median(values: Collection[float]) -> float:
    return float(statistics.median(values))


class BatchSizer:
    """The batch size (texts per request) of one replica when none is stated or learned
    (``EmbeddingConfig.batch_size="auto"``), found from the latency of the batches it
    answered. Pure (no I/O), thread-safe.

    The decision: a request's latency is a fixed part (the round trip, the server's
    per-request work, a queue) plus a part that grows with its texts (the server's
    compute, encoding and decoding). While the fixed part dominates, a batch twice as
    large costs about the same time, so it carries twice the texts per second; once the
    per-text part dominates (a GPU at work, a CPU-bound server), doubling the batch
    doubles its latency and carries nothing more.

    - **Grow** (like TCP slow start): starting at ``start`` texts (or where ``leap``
      puts a sizer that has decided nothing yet), once ``samples``
      answers of batches of the current size are in, the next batches try twice the
      size — but only when the call has work for a full window of them
      (``size(pressure=True)``; a small call never moves the size).
    - **Keep** the larger size while its median latency is at most ``flat`` times the
      smaller size's (default 1.5: the larger batch carries at least a third more
      texts per second per request); otherwise **stop at the knee**: settle at the
      smaller size, or at the larger one if it carried at least 20% more texts per
      second (``size / median latency``). A trial size goes to ``samples`` batches at
      a time (so a server that refuses it refuses at most that many).
    - **Retest** a settled size after ``retest_every`` answers (default 8, so that one
      noisy answer on a loaded machine does not stop the growth for long; doubled, up
      to 3,200, each time the knee holds), as inferred batch limits are.
    - **Back off**: an overload answer (429, 503, a timeout) or a refused size (413,
      422, a token cap: ``too_large``) ends a trial and halves the size (not below
      ``floor``); a refused size also stops growth at that size.

    Args:
        start: the first size, in texts (default 32).
        ceiling: the largest size, in texts (default 2048).
        floor: the smallest size an overload backs off to, in texts (default 32).
        flat: how much longer (a factor >= 1) a doubled batch may take and still count
            as flat latency (default 1.5).
        samples: answers needed at a size before judging it (default 2).
        retest_every: answers at a settled size before the next larger one is tried
            again (default 8; doubled each time the knee holds, up to 3,200).

    Raises:
        ValueError: a parameter out of range (the message names it).
    """

    def __init__(
        self,
        *,
        start: int = 32,
        ceiling: int = 2048,
        floor: int = 32,
        flat: float = 1.5,
        samples: int = 2,
        retest_every: int = 8,
    ) -> None:
        for name, value in (
            ("start", start),
            ("ceiling", ceiling),
            ("floor", floor),
            ("samples", samples),
            ("retest_every", retest_every),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BatchSizer.{name} must be an int >= 1, got {value!r}")
        if not floor <= start <= ceiling:
            raise ValueError(
                f"BatchSizer needs floor <= start <= ceiling, got {floor}, {start}, {ceiling}"
            )
        if not (isinstance(flat, int | float) and math.isfinite(flat) and 1.0 <= flat <= 100.0):
            raise ValueError(f"BatchSizer.flat must be in [1.0, 100.0], got {flat!r}")
        self.start = start
        self.ceiling = ceiling
        self.floor = floor
        self.flat = float(flat)
        self.samples = samples
        self.retest_base = retest_every
        self._lock = threading.Lock()
        self.level = start
        self.trial: int | None = None
        self._handed = 0  # trial batches handed out and not yet answered
        self._waited = 0  # answers at the level while the trial's are awaited
        self.settled = False
        self.retest_every = retest_every
        self._since_settled = 0
        self._lat: dict[int, deque[float]] = {}
        self._too_large: int | None = None  # the smallest size refused
        # counters (for tests and metrics)
        self.grown = 0
        self.knees = 0
        self.backoffs = 0

    def __repr__(self) -> str:
        return f"BatchSizer(level={self.level}, trial={self.trial}, settled={self.settled})"

    def snapshot(self) -> dict[str, Any]:
        """The state as plain values: level and trial (texts), settled, the median latency
        per size (seconds), grown / knees / backoffs counters."""
        with self._lock:
            return {
                "level": self.level,
                "trial": self.trial,
                "settled": self.settled,
                "retest_every": self.retest_every,
                "latency": {n: _median(v) for n, v in sorted(self._lat.items()) if v},
                "grown": self.grown,
                "knees": self.knees,
                "backoffs": self.backoffs,
            }

    @property
    def bound(self) -> int:
        """The largest size not known to be refused (texts)."""
        refused = self._too_large
        return self.ceiling if refused is None else max(1, min(self.ceiling, refused - 1))

    def _next(self) -> int | None:
        bigger = min(self.ceiling, self.level * 2)
        if self._too_large is not None and bigger >= self._too_large:
            return None  # refused there (or below): no growth past it
        return bigger if bigger > self.level else None

    def size(self, pressure: bool = True) -> int:
        """The texts to put in the next batch.

        Args:
            pressure: the call has texts for a full window of batches of the next size
                (only then may a larger size be tried).
        """
        with self._lock:
            if self.trial is not None:
                if pressure and self._handed < self.samples:
                    self._handed += 1
                    return self.trial
                return self.level
            if not pressure:
                return self.level
            judged = len(self._lat.get(self.level, ())) >= self.samples
            due = not self.settled or self._since_settled >= self.retest_every
            bigger = self._next()
            if judged and due and bigger is not None:
                self.trial = bigger
                self._handed, self._waited = 1, 0
                self._lat.pop(bigger, None)  # judge the trial on fresh answers
                return bigger
            return self.level

    def leap(self, size: int) -> int:
        """Start the growth at ``size`` texts (at most ``ceiling``) instead of ``start``,
        if this sizer has decided nothing yet: never grown, no knee found, never backed
        off, no trial under way (answers at ``start`` alone do not count). For a call
        longer than one wave, whose first batches would otherwise spend its first round
        trips at ``start`` (``Engine.auto_batch_size``). From there the knee rule only
        grows the size; an overload or a refused size lowers it. The level, in texts."""
        with self._lock:
            fresh = not (self.grown or self.knees or self.backoffs) and self.trial is None
            if fresh:
                self.level = max(self.level, min(size, self.ceiling))
            return self.level

    def wants(self, remaining: int, window: int) -> bool:
        """Whether ``remaining`` texts fill a window of ``window`` batches of the next
        size (the ``pressure`` of ``size``)."""
        bigger = self.trial or self._next()
        return bigger is not None and remaining >= window * bigger

    def observe(
        self, texts: int, latency: float, *, overload: bool = False, too_large: bool = False
    ) -> None:
        """Record one answered request.

        Args:
            texts: texts in the request.
            latency: seconds from sending it to its decoded answer.
            overload: the server pushed back (429, 503, a timeout).
            too_large: the server refused the request's size (413, 422, a token cap).
        """
        with self._lock:
            if too_large or overload:
                self._back_off(texts, too_large=too_large)
                return
            if not (isinstance(latency, int | float) and math.isfinite(latency)) or latency < 0:
                return
            if texts != self.level and texts != self.trial:
                return  # the tail of a call, or a batch cut short by tokens: not comparable
            lat = self._lat.get(texts)
            if lat is None:
                lat = self._lat[texts] = deque(maxlen=8)
            lat.append(float(latency))
            trial = self.trial
            if texts == self.level:
                self._since_settled += 1
                if trial is not None:
                    self._waited += 1
                    if self._waited > 4 * self.samples:  # its batches were cut short or lost
                        self.trial = None
                return
            if trial is None or texts != trial:
                return
            self._handed = max(0, self._handed - 1)
            if len(lat) < self.samples:
                return
            base = self._lat.get(self.level)
            if not base:
                return
            small, large = _median(base), _median(lat)
            self.trial = None
            if large <= self.flat * small:
                self.level = trial  # flat: keep growing
                self.grown += 1
                if self.settled:
                    self.retest_every = self.retest_base  # the knee moved
                self.settled = False
                return
            # the knee: settle, at the larger size only if it carried clearly more texts
            # per second (else its latency buys nothing)
            self.knees += 1
            if trial / large > _KNEE_GAIN * self.level / small:
                self.level = trial
            if self.settled:
                self.retest_every = min(self.retest_every * 2, 3200)  # the knee held
            self.settled = True
            self._since_settled = 0

    def _back_off(self, texts: int, *, too_large: bool) -> None:
        self.backoffs += 1
        if too_large:
            refused = max(1, texts)
            self._too_large = refused if self._too_large is None else min(self._too_large, refused)
        self.trial = None
        lower = max(self.floor, self.level // 2)
        if too_large and self._too_large is not None and self.level >= self._too_large:
            lower = max(1, min(lower, self._too_large // 2))
        self.level = min(self.level, lower)
        self.settled = True
        self._since_settled = 0


# --------------------------------------------------------------------------- learned caps


RETEST_EVERY = 50  # successful requests before an inferred batch limit is retested
RETEST_EVERY_MAX = 3200


class ReplicaView(Protocol):
    """What a lesson about a replica needs of it (``_balance.Replica`` is one): its label,
    for the log, and its metrics, for the fallback counters."""

    @property
    def label(self) -> str: ...

    @property
    def metrics(self) -> EndpointMetrics: ...


@dataclass
class BatchState:
    """What the process has learned about one replica's batch size for one model
    (``_learn.ReplicaState.batch``).

    Attributes:
        limit: the most texts per request it accepts, once learned (texts).
        token_limit: the most tokens per request it accepts, once learned (tokens).
        size_limit: the most UTF-8 bytes of texts per request it accepts, once learned
            from a stated byte (request body) or character limit (bytes; ``text_bytes``).
        limit_inferred: ``limit`` was inferred from dropped batches (the server said
            nothing; e.g. out of memory for a while) rather than stated by the server:
            after ``retest_every`` successful requests one batch above it is let through;
            its success lifts the limit, its failure doubles ``retest_every`` (up to
            3,200 requests).
        size_failures: the largest piece the replica took, for each batch it dropped
            whose every piece then went through (two are needed to infer a limit).
        ok_since_limit: successful requests since the limit was inferred or retested.
        retest_every: requests between retests of an inferred limit (starts at 50).
        retesting: a retest batch is under way (only one at a time).
        sizer: the batch size found from this replica's latencies (``BatchSizer``; used
            when ``batch_size="auto"``).
    """

    limit: int | None = None
    token_limit: int | None = None
    size_limit: int | None = None
    limit_inferred: bool = False
    size_failures: list[int] = field(default_factory=list)
    ok_since_limit: int = 0
    retest_every: int = RETEST_EVERY
    retesting: bool = False
    sizer: BatchSizer = field(default_factory=BatchSizer)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def retest_due(self) -> bool:
        """An inferred batch limit has held for ``retest_every`` requests: try above it."""
        return (
            self.limit_inferred and not self.retesting and self.ok_since_limit >= self.retest_every
        )


class Split(Exception):
    """The chosen replica accepts fewer texts (or tokens, or bytes) per request than this
    batch."""

    def __init__(
        self, count: int | None = None, tokens: int | None = None, size: int | None = None
    ) -> None:
        super().__init__()
        self.count = count
        self.tokens = tokens
        self.size = size


def text_bytes(text: str) -> int:
    """What ``text`` adds to a request body, in bytes: its UTF-8 size and its quotes and
    comma (JSON escapes aside)."""
    return (len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))) + 3


def split_runs(split: Split, texts: Sequence[str]) -> list[tuple[int, int]]:
    """The ``(start, stop)`` pieces of ``texts`` within the limit ``split`` names: at most
    ``split.count`` texts, about ``split.tokens`` estimated tokens, or ``split.size``
    bytes (``text_bytes``; halves when the split cannot cut it)."""
    n = len(texts)
    if split.count is not None:
        return [(i, min(i + split.count, n)) for i in range(0, n, split.count)]
    if split.size is not None:
        runs = split_by_tokens([text_bytes(t) for t in texts], 0, n, split.size, n)
    else:
        runs = split_by_tokens([estimate_tokens(t) for t in texts], 0, n, split.tokens, n)
    return runs if len(runs) > 1 else [(0, n // 2), (n // 2, n)]


def plan_limits(
    replicas: Iterable[tuple[BatchState, int | None]], configured: int | None
) -> tuple[int | None, int | None]:
    """The (texts, tokens) per request a plan can respect up front: the most capable
    replica's known limits; a batch sent to a more limited replica is split there.

    Args:
        replicas: for each replica, its learned ``BatchState`` and the batch limit its
            server profile states (texts; ``None``: none).
        configured: ``EmbeddingConfig.max_batch_tokens`` (tokens; ``None``: none).
    """
    counts: list[int | None] = []
    token_caps: list[int | None] = []
    for batch, stated in replicas:
        learned = None if batch.retest_due() else batch.limit
        limits = [x for x in (learned, stated) if x]
        counts.append(min(limits) if limits else None)
        caps = [x for x in (batch.token_limit, configured) if x]
        token_caps.append(min(caps) if caps else None)
    count = None if None in counts else max(c for c in counts if c is not None)
    tokens = None if None in token_caps else max(t for t in token_caps if t is not None)
    return count, tokens


def check_limits(
    batch: BatchState, stated: int | None, configured: int | None, texts: Sequence[str]
) -> bool:
    """The batch and token limits of a replica for this batch: raises ``Split`` when
    ``texts`` exceed them; returns whether this batch retests an inferred batch limit
    (sent whole, above it).

    Args:
        batch: the replica's learned ``BatchState``.
        stated: the batch limit its server profile states (texts; ``None``: none).
        configured: ``EmbeddingConfig.max_batch_tokens`` (tokens; ``None``: none).
        texts: the batch.
    """
    limit = batch.limit
    retest = False
    if limit is not None and len(texts) > limit and batch.retest_due():
        with batch.lock:
            retest = batch.retest_due()
            batch.retesting = retest
        if retest:
            limit = None  # this batch retests the inferred limit
    if stated is not None and (limit is None or stated < limit):
        limit = stated
    if limit is not None and len(texts) > limit:
        raise Split(count=limit)
    tokens = batch.token_limit or configured
    if tokens is not None and len(texts) > 1 and sum(map(estimate_tokens, texts)) > tokens:
        raise Split(tokens=tokens)
    size = batch.size_limit
    if size is not None and len(texts) > 1 and sum(map(text_bytes, texts)) > size:
        raise Split(size=size)
    return retest


def retest_failed(batch: BatchState, replica: ReplicaView, error: QwenEmbedError) -> None:
    """A batch that retested an inferred limit failed (``error``): the limit still
    holds; the next retest waits twice as long (up to 3,200 requests), and the batch is
    sent again in pieces (raises ``Split``)."""
    batch.retesting = False
    batch.ok_since_limit = 0
    batch.retest_every = min(batch.retest_every * 2, RETEST_EVERY_MAX)
    if batch.limit is not None:
        _log.info(
            "%s still fails batches above %d texts (%s); retesting after %d requests",
            replica.label,
            batch.limit,
            type(error).__name__,
            batch.retest_every,
        )
        raise Split(count=batch.limit)  # sent again in pieces


def limit_held(batch: BatchState, replica: ReplicaView, texts: int, retest: bool) -> None:
    """A request of ``texts`` texts succeeded on ``replica``: counted towards the retest
    of an inferred batch limit, or (``retest``: it was above the limit) lifts it."""
    if not batch.limit_inferred:
        return
    if not retest:
        batch.ok_since_limit += 1
        return
    _log.info(
        "%s took a batch of %d texts above its inferred limit of %s: limit lifted",
        replica.label,
        texts,
        batch.limit,
    )
    batch.limit = None
    batch.limit_inferred = False
    batch.size_failures.clear()
    batch.retesting = False
    batch.ok_since_limit = 0
    batch.retest_every = RETEST_EVERY
    replica.metrics.fallback("batch_limit_lifted")


def observe_answer(
    sizer: BatchSizer, texts: int, seconds: float, error: QwenEmbedError | None
) -> None:
    """Feed an answered request to a replica's ``BatchSizer`` (``batch_size="auto"``
    only): its latency, or the overload (429, 503, a timeout) or refused size (413,
    422, a token cap) it met."""
    if error is None:
        sizer.observe(texts, seconds)
    elif isinstance(error, BatchTooLargeError):
        sizer.observe(texts, seconds, too_large=True)
    elif (isinstance(error, HTTPStatusError) and error.status in (429, 503)) or (
        isinstance(error, TimeoutException) and not isinstance(error, PoolTimeout)
    ):
        sizer.observe(texts, seconds, overload=True)


# --------------------------------------------------------------------------- waves


_ONE_WAVE = 8
"""A ``batch_size="auto"`` call whose texts fill the window with batches of at most this
many times the sizer's start (8 x 32 = 256 texts) is sent in one wave of them; a longer
call starts the growth of a replica that has decided nothing yet at that size (see
``auto_batch_size``)."""


def auto_batch_size(
    sizers: Sequence[BatchSizer],
    remaining: int,
    window: int,
    limits: Callable[[], tuple[int | None, int | None]],
) -> int:
    """The texts to put in the next batch of a ``batch_size="auto"`` call that has
    ``remaining`` texts left and up to ``window`` batches in flight, from the
    ``BatchSizer`` of each replica (``sizers``) and the known and learned limits
    (``limits()``: ``plan_limits``' texts and tokens per request, read only when needed).

    The largest size a replica's ``BatchSizer`` asks for now; but when a window's
    share of ``remaining`` is smaller, that share (not below the sizer's start), so
    the last batches of a call still fill the window; and when the share is larger
    but within ``_ONE_WAVE`` x the start (and below any size a replica refused), the
    share: a call that fits in one wave of moderate batches goes in one wave. A longer
    call starts the growth of a replica that has decided nothing yet at that one-wave
    size (``BatchSizer.leap``; at most the known or learned limit on texts per
    request), not at the start: its first round trips then carry ``_ONE_WAVE`` times
    the texts. Not under a limit on tokens per request, nor under a text limit at or
    below the start: batches cut below the level would leave the sizer blind. Known
    and learned limits are applied by the caller."""
    size = 0
    start = 1
    bound = 1 << 30
    for sizer in sizers:
        size = max(size, sizer.size(sizer.wants(remaining, window)))
        start = max(start, sizer.start)
        bound = min(bound, sizer.bound)
    share = -(-remaining // max(1, window))
    if share <= size:
        return max(1, min(size, max(start, share)))
    wave = min(_ONE_WAVE * start, bound)
    if share <= wave:
        return share
    count, tokens = limits()
    if tokens is not None or (count is not None and count <= start):
        return size  # batches cut below the level would leave the sizer blind
    wave = wave if count is None else min(wave, count)
    return max([size, *(sizer.leap(wave) for sizer in sizers)])


class Sizing(Protocol):
    """Where a call's batches learn their size (``_engine.Engine`` is one)."""

    def auto_batch_size(self, remaining: int, window: int) -> int: ...

    def batch_limits(self) -> tuple[int | None, int | None]: ...


class Batches:
    """The batches of one call, as indexes into ``plan.batches``, read one at a time by
    the window (``run_windowed``) as a slot frees up.

    For a stated ``batch_size`` the plan was cut up front. For ``batch_size="auto"``
    each batch is cut when it is about to be sent, at the size the replicas' batch
    sizers ask for now (``Engine.auto_batch_size``: they learn from the answers of the
    batches before it), until the rest of the call fits in the window's batches: from
    there every batch has that size (the last wave in equal batches). Always within the
    known and learned limits (texts per request, read at each cut; ``tokens``,
    estimated tokens per request).
    """

    def __init__(
        self,
        plan: BatchPlan,
        window: int,
        tokens: int | None,
        sizing: Sizing | None,
    ) -> None:
        self.plan = plan
        self.sizing = sizing
        self.tokens = tokens
        self.window = window
        self._next = 0
        self._at = 0
        self._last = 0  # the size of the last wave's batches, once it is cut
        self._sizes = (
            [estimate_tokens(t) for t in plan.unique]
            if sizing is not None and tokens is not None
            else None
        )
        self.single = len(plan.batches) == 1 if sizing is None else self._first_is_all()

    def _size(self) -> int:
        if self.sizing is None:  # cannot happen
            raise RuntimeError("internal error: sizing is None")
        sizing = self.sizing
        # The first ``window`` batches leave together (the window is empty): each is cut
        # over the slots still free, so a call that fits one wave goes out in equal
        # batches (400 texts, 4 slots: 4 x 100, not 100, 75, 57, 42 and a second wave).
        # Later batches are cut one at a time as a slot frees, over the whole window.
        # Once the rest fits in the batches the window has left, that size holds to the
        # end: the last wave goes in equal batches too (952 texts left, 4 slots: 238, 238,
        # 238, 238, not 238, 179, 134, ... 32, a tail of round trips at a fraction of the
        # size). An overload answered meanwhile no longer shrinks these few batches; a
        # known or learned text limit still caps them (below), a token budget splits them.
        size = self._last
        if not size:
            cut, remaining = len(self.plan.batches), len(self.plan.unique) - self._at
            slots = self.window - cut if cut < self.window else self.window
            size = sizing.auto_batch_size(remaining, slots)
            if size * slots >= remaining:
                self._last = size
        count = sizing.batch_limits()[0]  # learned during the call too
        return size if count is None else max(1, min(size, count))

    def _first_is_all(self) -> bool:
        n = len(self.plan.unique)
        return bool(n) and self._cut() == n

    def _cut(self) -> int:
        """Cut the next batch; its stop."""
        plan, start = self.plan, self._at
        n = len(plan.unique)
        stop = min(n, start + self._size())
        if self._sizes is not None and self.tokens is not None:
            stop = split_by_tokens(self._sizes, start, stop, self.tokens, stop - start)[0][1]
        plan.batches.append((start, stop))
        self._at = stop
        return stop

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> int:
        b = self._next
        if b >= len(self.plan.batches):
            if self.sizing is None or self._at >= len(self.plan.unique):
                raise StopIteration
            self._cut()
        self._next = b + 1
        return b


def plan_call(
    texts: list[str], batch_size: int | Literal["auto"], window: int, sizing: Sizing
) -> tuple[BatchPlan, Batches]:
    """The plan of a call's ``texts`` and its batches as a window of ``window`` batches
    reads them: cut up front for a stated ``batch_size`` (texts; at most the limits
    known now), else (``"auto"``) one at a time as they are sent, sized over the
    ``window`` requests in flight (``Batches``)."""
    count, tokens = sizing.batch_limits()
    if batch_size == "auto":
        plan = plan_batches(texts, max(1, len(texts)))
        plan.batches.clear()  # cut one at a time, as the window frees a slot
        return plan, Batches(plan, window, tokens, sizing)
    if count is not None and count < batch_size:
        batch_size = count
    plan = plan_batches(texts, batch_size, max_tokens=tokens)
    return plan, Batches(plan, window, tokens, None)
