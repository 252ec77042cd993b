"""The adaptive batch size of a replica (``BatchSizer``, ``EmbeddingConfig.batch_size="auto"``,
the default): the texts per request, found from the latency of the batches a replica
answered.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Collection
from typing import Any

__all__ = ["BatchSizer"]


# --------------------------------------------------------------------------- batch size


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
