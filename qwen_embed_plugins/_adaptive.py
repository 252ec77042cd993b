"""Adaptive concurrency: a per-endpoint limit on requests in flight, found from measured
latency and overload answers (``EmbeddingConfig.max_concurrency="auto"``); and the
adaptive batch size of a replica (``BatchSizer``, ``EmbeddingConfig.batch_size="auto"``,
the default).

The goal: the number of requests in flight that gives the most embeddings per second
without overload answers (429, 503, timeouts) and without a standing queue on the
server (which only adds latency). Too few leaves GPU batch slots idle; too many queues
requests on the server (latency grows, throughput does not) or trips its rate limit.

Algorithm
---------
A gradient limit in the spirit of Netflix's concurrency-limits ``Gradient2Limit`` and
Envoy's adaptive concurrency filter (gradient controller), with the loss response of
Netflix's ``AIMDLimit``:

- **Windows**: samples are summarised every ``window`` seconds (at least 3 samples)
  by their median (Envoy: the p50 of the samples of each
  ``concurrency_update_interval``).
- **Baseline latency** (``min_rtt``): the lowest window median seen, re-measured at a
  quarter of the limit for 5 requests — after the first climb (whose windows may all
  have queued), then 1, 2, 4 ... s later, then every ``probe_interval`` seconds, and
  after 5 windows in a row at the minimum (Envoy's periodic minRTT measurement at a
  low concurrency; without it a standing queue would slowly become the baseline).
- **Gradient** ``g = (1 + tolerance) * min_rtt / median`` (Envoy's
  ``(minRTT + buffer) / sampleRTT``). When ``g < 1`` requests queue on the server: the
  limit moves towards ``g * limit`` (``g`` at least 0.5, smoothed by ``smoothing``), as
  in both sources. Otherwise, when the window used at least half the limit (Netflix's
  "app-limited" guard), the limit grows: it doubles each window until the first sign
  of queueing or overload (slow start), then grows by one request per window.
- **Overload** (429, 503, a timeout): the limit falls at once to ``backoff * limit``
  (and by at least one request; AIMD), but never below the number of requests the
  server did serve per round trip lately (Little's law: completions in the last 4
  ``min_rtt``, over 4), which is a rate limit's capacity. One decrease per round: an
  overload answer to a request sent before the last decrease is old news.
- **Ceiling**: the level at which an overload episode began is remembered; reaching it
  again takes ``quiet`` seconds without overload, doubled each time the server pushes
  back again at (or just above) that level, up to ``max_quiet`` (a simple form of TCP
  CUBIC's memory of ``W_max``). A rate limit shows no latency before its 429 — and
  behind a burst bucket, only seconds after the rate was passed — so without this the
  limit would climb back into it every few windows.

Why not Gradient2, Envoy or AIMD as they are: Gradient2 and Envoy read latency only
(Gradient2 ignores drops; Envoy sheds load itself), and a rate-limited provider
(DashScope, SiliconFlow) shows no latency signal at all; Gradient2 compares with a
long average latency, which drifts up under a steady queue, and its headroom
("queueSize" 4) and Envoy's (``sqrt(limit)``) keep a queue of that many requests on the
server (latency added, no throughput gained). Plain AIMD has no latency signal and,
with limits of 1-3 requests, each multiplicative step loses a third of the throughput.
Here the queue kept is about ``tolerance`` x the server's slots.

Sources:

- Netflix concurrency-limits, ``Gradient2Limit``, ``AIMDLimit``, ``VegasLimit``
  (https://github.com/Netflix/concurrency-limits, concurrency-limits-core/.../limit/),
  and "Performance Under Load"
  (https://netflixtechblog.medium.com/performance-under-load-3e6fa9a60581).
- Envoy, Adaptive Concurrency filter, gradient controller
  (https://www.envoyproxy.io/docs/envoy/latest/configuration/http/http_filters/adaptive_concurrency_filter).

The gate
--------
``AdaptiveGate`` is ``_transport.ProcessGate`` (process-wide, FIFO, threads and every
event loop, thread-safe wake-ups) whose capacity is the limit's current value (and at
most a fixed cap, e.g. ``Limits.max_connections_per_process``).
``release(latency, overload, retry_after)`` feeds the sample. A slot whose request got
an overload answer is held for ``min_rtt`` — or the server's ``Retry-After``, if longer
— before the next waiter gets it: a server that rejects at once would otherwise see the
next request at once (a 429 storm) whatever the limit, and a static window behaves the
same way (its rejected batch sleeps in its slot).

``gate_for(key)`` returns the process-wide gate of an endpoint; a forked child starts
with none (the fork hook of ``_state``; ``STATE.adaptive_gates``).
"""

from __future__ import annotations

import heapq
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Hashable
from typing import Any

from ._state import STATE
from ._transport import ProcessGate

__all__ = ["AdaptiveGate", "BatchSizer", "ConcurrencyLimit", "gate_for", "gates"]

_MIN_WINDOW_SAMPLES = 3
_SERVED_SPAN = 4.0
"""Round trips (of ``min_rtt``) over which served requests are counted."""
_PROBE_SAMPLES = 5
"""Samples (of requests sent at the lowered limit) that measure the baseline latency."""
_PROBE_AFTER_MIN_WINDOWS = 5
"""Windows in a row at the minimum limit that trigger a new baseline measurement
(Envoy does the same: the baseline may be stale)."""


def _level(estimate: float) -> int:
    return int(estimate + 0.5)


def _check(name: str, value: float, low: float, high: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and low <= value <= high):
        raise ValueError(f"ConcurrencyLimit.{name} must be in [{low}, {high}], got {value!r}")


class ConcurrencyLimit:
    """The adaptive limit of one endpoint: requests in flight, from latency and overload
    samples. Pure (no I/O), thread-safe, clock injectable. See the module docstring for
    the algorithm and its sources.

    Args:
        initial_limit: the limit before any sample, in requests (default 4, the static
            default, so the first burst is no larger than today's).
        min_limit: lowest limit, in requests (default 1).
        max_limit: highest limit, in requests (default 256).
        tolerance: how far above the baseline latency the window median may be before
            it counts as queueing, as a fraction (default 0.3: 30%). Also the queue
            the limit keeps on a slot-bound server: about ``tolerance`` x its slots.
        smoothing: weight of a new latency-driven estimate, 0..1 (default 0.5).
        backoff: the limit is multiplied by this on an overload answer, 0.3..0.95
            (default 0.7); it also falls by at least one request.
        window: seconds of samples summarised at a time (default 0.5 s; also the
            shortest time between two latency-driven changes).
        quiet: seconds without overload before the limit may reach the level of the
            last overload again (default 2 s); doubled at each repeat, up to
            ``max_quiet`` (default 60 s).
        probe_interval: seconds between two re-measurements of the baseline latency
            (default 30 s).
        clock: monotonic clock in seconds (injectable for tests).

    Raises:
        ValueError: a parameter out of range (the message names it).
    """

    def __init__(
        self,
        *,
        initial_limit: int = 4,
        min_limit: int = 1,
        max_limit: int = 256,
        tolerance: float = 0.3,
        smoothing: float = 0.5,
        backoff: float = 0.7,
        window: float = 0.5,
        quiet: float = 2.0,
        max_quiet: float = 60.0,
        probe_interval: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (("min_limit", min_limit), ("max_limit", max_limit)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ConcurrencyLimit.{name} must be an int >= 1, got {value!r}")
        if max_limit < min_limit:
            raise ValueError(
                f"ConcurrencyLimit.max_limit ({max_limit}) must be >= min_limit ({min_limit})"
            )
        if not isinstance(initial_limit, int) or isinstance(initial_limit, bool):
            raise ValueError(
                f"ConcurrencyLimit.initial_limit must be an int, got {initial_limit!r}"
            )
        _check("initial_limit", initial_limit, min_limit, max_limit)
        _check("tolerance", tolerance, 0.0, 10.0)
        _check("smoothing", smoothing, 0.01, 1.0)
        _check("backoff", backoff, 0.3, 0.95)
        _check("window", window, 0.0, 3600.0)
        _check("quiet", quiet, 0.0, 3600.0)
        _check("max_quiet", max_quiet, quiet, 86400.0)
        _check("probe_interval", probe_interval, 0.001, 86400.0)
        self.min_limit = min_limit
        self.max_limit = max_limit
        self.tolerance = float(tolerance)
        self.smoothing = float(smoothing)
        self.backoff = float(backoff)
        self.window = float(window)
        self.quiet = float(quiet)
        self.max_quiet = float(max_quiet)
        self.probe_interval = float(probe_interval)
        self._clock = clock
        self._lock = threading.Lock()
        now = clock()
        self._estimate = float(initial_limit)
        self._startup = True
        self._min_rtt: float | None = None
        self._samples: list[float] = []
        self._window_start = now
        self._peak = 0
        self._served: deque[float] = deque()
        self._last_drop = -math.inf
        self._last_overload = -math.inf
        self._last_wait = 0.0
        self._ceiling: int | None = None
        self._quiet_for = self.quiet
        self._quiet_until = -math.inf
        self._next_probe = now + self.probe_interval
        self._probe_gap = 0.5
        self._probe_saved: float | None = None
        self._probe_from = 0.0
        self._at_min = 0
        # counters (for metrics and tests)
        self.sample_count = 0
        self.overload_count = 0
        self.decrease_count = 0

    # ------------------------------------------------------------------ reading

    @property
    def limit(self) -> int:
        """The current limit: requests allowed in flight (``min_limit..max_limit``)."""
        return max(self.min_limit, min(self.max_limit, _level(self._estimate)))

    @property
    def min_rtt(self) -> float | None:
        """The baseline (no-load) latency in seconds; ``None`` before the first window."""
        return self._min_rtt

    def snapshot(self) -> dict[str, Any]:
        """The state as plain values: limit (requests), min_rtt (seconds), phase,
        ceiling (requests or None), samples, overloads, decreases."""
        with self._lock:
            phase = (
                "probe"
                if self._probe_saved is not None
                else "startup"
                if self._startup
                else "steady"
            )
            return {
                "limit": self.limit,
                "estimate": round(self._estimate, 3),
                "min_rtt": self._min_rtt,
                "phase": phase,
                "ceiling": self._ceiling,
                "samples": self.sample_count,
                "overloads": self.overload_count,
                "decreases": self.decrease_count,
            }

    def __repr__(self) -> str:
        return f"ConcurrencyLimit(limit={self.limit}, min_rtt={self._min_rtt!r})"

    # ------------------------------------------------------------------ samples

    def on_sample(
        self,
        latency: float,
        in_flight: int,
        overload: bool,
        retry_after: float | None = None,
    ) -> None:
        """Record one finished request.

        Args:
            latency: seconds from sending the request to its answer (or failure); the
                wait for a slot is not part of it.
            in_flight: requests in flight when it finished, itself included.
            overload: the server pushed back (429, 503, a timeout).
            retry_after: with ``overload``, the server's ``Retry-After`` in seconds, if
                it sent one. The caller then waits that long (``AdaptiveGate`` holds
                the slot), which backs off by itself: the first such answer only stops
                the limit from growing; the limit falls when another comes within that
                wait.

        Raises:
            ValueError: ``latency`` negative or not finite.
        """
        if not (isinstance(latency, int | float) and math.isfinite(latency) and latency >= 0):
            raise ValueError(f"latency must be seconds >= 0, got {latency!r}")
        with self._lock:
            now = self._clock()
            self.sample_count += 1
            if overload:
                self.overload_count += 1
                if now - latency >= self._last_drop:  # else sent before the last decrease
                    waited = retry_after is not None and retry_after > (self._min_rtt or 0.0)
                    again = now - self._last_overload < self._last_wait
                    self._on_overload(now, decrease=not waited or again)
                    self._last_overload = now
                    self._last_wait = retry_after if waited and retry_after else 0.0
                return
            self._served.append(now)
            self._trim_served(now)
            if self._probe_saved is not None:
                self._probe_sample(now, latency)
                return
            self._samples.append(latency)
            self._peak = max(self._peak, in_flight)
            if (
                len(self._samples) >= _MIN_WINDOW_SAMPLES
                and now - self._window_start >= self.window
            ):
                samples, peak = self._samples, self._peak
                self._samples, self._peak, self._window_start = [], 0, now
                self._on_window(now, samples, peak)

    # ------------------------------------------------------------------ internals

    def _trim_served(self, now: float) -> None:
        horizon = now - _SERVED_SPAN * (self._min_rtt or 0.0)
        served = self._served
        while served and served[0] < horizon:
            served.popleft()

    def _served_concurrency(self, now: float) -> float | None:
        """Requests the server completed per ``min_rtt`` lately (Little's law)."""
        rtt = self._min_rtt
        if rtt is None or not self._served:
            return None
        self._trim_served(now)
        return len(self._served) / _SERVED_SPAN

    def _set(self, value: float) -> None:
        self._estimate = max(float(self.min_limit), min(float(self.max_limit), value))

    def _on_overload(self, now: float, *, decrease: bool) -> None:
        self._end_probe()
        before = self.limit
        if decrease:
            target = min(self._estimate * self.backoff, self._estimate - 1.0)
            served = self._served_concurrency(now)
            if served is not None and served < self._estimate:
                # never below what the server did serve lately (Little's law): a rate
                # limit a little under the limit costs one level, not a third of it
                target = max(target, served)
            self._set(target)
            self.decrease_count += 1
            self._last_drop = now
            self._samples, self._peak, self._window_start = [], 0, now
        if self._startup:
            self._startup = False
            self._next_probe = now  # measured during the climb: the baseline may be queued
        if self._ceiling is not None and now - self._last_overload < self.window:
            # the same episode (the first decrease did not stop the pushback at once):
            # the level that broke is still the one the episode began at
            pass
        else:
            if self._ceiling is not None and before <= self._ceiling + 1:
                self._quiet_for = min(self.max_quiet, self._quiet_for * 2.0)  # broke again
            else:
                self._quiet_for = self.quiet
            self._ceiling = before
        self._quiet_until = now + self._quiet_for

    def _on_window(self, now: float, samples: list[float], peak: int) -> None:
        samples.sort()
        n = len(samples)
        median = samples[n // 2] if n % 2 else 0.5 * (samples[n // 2 - 1] + samples[n // 2])
        if self._min_rtt is None or median < self._min_rtt:
            self._min_rtt = median
        base = self._min_rtt
        gradient = (1.0 + self.tolerance) * base / median if median > 0 else 1.0
        if gradient < 1.0:
            gradient = max(0.5, gradient)
            new = (
                self._estimate * (1.0 - self.smoothing) + self._estimate * gradient * self.smoothing
            )
            self._set(min(new, self._estimate - 0.5 * self.smoothing))
            if self._startup:
                self._startup = False
                self._next_probe = now  # the baseline so far may include a queue
        elif 2 * peak >= self.limit:
            self._grow(now)
        if self.limit <= self.min_limit and self._ceiling is None:
            self._at_min += 1
        else:
            self._at_min = 0
        if now >= self._next_probe or self._at_min >= _PROBE_AFTER_MIN_WINDOWS:
            self._start_probe(now)

    def _grow(self, now: float) -> None:
        new = self._estimate * 2.0 if self._startup else self._estimate + 1.0
        ceiling = self._ceiling
        if ceiling is not None and now < self._quiet_until:
            return  # pushed back lately: no growth until `quiet` seconds of calm
        if ceiling is not None and _level(new) >= ceiling:
            # calm for long enough: one step at or past the old level, then wait again
            new = min(new, _level(self._estimate) + 1.0)
            self._quiet_until = now + self._quiet_for
            if _level(new) > ceiling + 1:
                self._ceiling, self._quiet_for = None, self.quiet  # well past it: forget
        self._set(new)

    def _start_probe(self, now: float) -> None:
        self._probe_saved = self._estimate
        self._set(max(float(self.min_limit), math.ceil(self._estimate / 4.0)))
        self._probe_from = now
        self._samples, self._peak = [], 0
        self._at_min = 0

    def _probe_sample(self, now: float, latency: float) -> None:
        # only requests sent once the lowered limit was in force measure the baseline
        if now - latency < self._probe_from:
            return
        self._samples.append(latency)
        if len(self._samples) < _PROBE_SAMPLES:
            return
        samples = sorted(self._samples)
        self._min_rtt = statistics.median(samples)
        self._end_probe()
        self._samples, self._peak, self._window_start = [], 0, now

    def _end_probe(self) -> None:
        saved = self._probe_saved
        if saved is None:
            return
        self._probe_saved = None
        self._set(saved)
        # young baselines are re-measured sooner: 1, 2, 4, ... s, then every probe_interval
        self._probe_gap = min(self.probe_interval, self._probe_gap * 2.0)
        self._next_probe = self._clock() + self._probe_gap


# --------------------------------------------------------------------------- the gate


class _Timer:
    """One daemon thread per process running delayed callbacks (held gate slots)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._thread: threading.Thread | None = None

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        with self._cond:
            self._seq += 1
            heapq.heappush(self._heap, (time.monotonic() + delay, self._seq, fn))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="qwen-embed-adaptive", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if not self._heap:
                        self._cond.wait()
                        continue
                    left = self._heap[0][0] - time.monotonic()
                    if left <= 0:
                        fn = heapq.heappop(self._heap)[2]
                        break
                    self._cond.wait(left)
            fn()


def _timer() -> _Timer:
    """The process's timer thread (``STATE.timer``; a forked child makes its own)."""
    timer: _Timer | None = STATE.timer
    if timer is None:
        with STATE.lock:
            timer = STATE.timer
            if timer is None:
                timer = STATE.timer = _Timer()
    return timer


class AdaptiveGate(ProcessGate):
    """A process-wide gate of one endpoint whose capacity is an adaptive limit.

    Threads wait in ``acquire``, coroutines of any event loop in ``aacquire`` (their
    loop is never blocked); waiters are served first come, first served, and woken
    thread-safely (``loop.call_soon_threadsafe``). Each request that got a slot gives
    it back with ``release(latency, overload)``, which feeds the limit.

    Args:
        limit: the ``ConcurrencyLimit`` (default: one with default parameters).
        cap: a fixed upper bound on the capacity, in requests (e.g.
            ``Limits.max_connections_per_process``); ``None`` = the limit's maximum.
        default_hold: seconds an overload answer holds its slot while the baseline
            latency is still unknown (default 0.05 s); afterwards the hold is
            ``min_rtt`` (or the server's ``Retry-After``, if longer).
        max_hold: the longest hold in seconds (default 30 s).
        call_later: ``call_later(seconds, fn)`` runs ``fn`` later, to end a hold
            (default: one timer thread per process; injectable for tests).
    """

    def __init__(
        self,
        limit: ConcurrencyLimit | None = None,
        *,
        cap: int | None = None,
        default_hold: float = 0.05,
        max_hold: float = 30.0,
        call_later: Callable[[float, Callable[[], None]], None] | None = None,
    ) -> None:
        self.limit = limit if limit is not None else ConcurrencyLimit()
        self.default_hold = default_hold
        self.max_hold = max_hold
        self._call_later = call_later
        self._cap = self.limit.max_limit
        super().__init__(cap if cap is not None else self.limit.max_limit)

    @property
    def slots(self) -> int:
        """The capacity now: requests allowed in flight (``min(cap, limit.limit)``)."""
        return min(self._cap, self.limit.limit)

    @slots.setter
    def slots(self, value: int) -> None:
        self._cap = value

    @property
    def in_flight(self) -> int:
        """Slots taken now (requests in flight, and slots held after an overload)."""
        return self._used

    def release(
        self,
        latency: float | None = None,
        overload: bool = False,
        retry_after: float | None = None,
    ) -> None:
        """Give a slot back.

        Args:
            latency: seconds the request took from sending to its answer; ``None``
                when no request was sent with the slot (no sample is recorded).
            overload: the server pushed back (429, 503, a timeout). The slot is then
                held before the next waiter gets it: for the baseline latency, or for
                ``retry_after`` if longer (so the gate, like a static window whose
                batch sleeps, sends one request fewer while the server asked to wait).
            retry_after: the server's ``Retry-After`` in seconds, if it sent one (capped
                at ``max_hold``).
        """
        if latency is None:
            super().release()
            return
        self.limit.on_sample(latency, self._used, overload, retry_after if overload else None)
        if overload:
            rtt = self.limit.min_rtt
            hold = self.default_hold if rtt is None else rtt
            if retry_after is not None and retry_after > hold:
                hold = min(retry_after, self.max_hold)
            hold -= latency
            if hold > 0:
                (self._call_later or _timer().call_later)(hold, super().release)
                return
        super().release()


# --------------------------------------------------------------------------- registry


def gate_for(
    key: Hashable,
    *,
    cap: int | None = None,
    factory: Callable[[], ConcurrencyLimit] = ConcurrencyLimit,
) -> AdaptiveGate:
    """The process-wide ``AdaptiveGate`` of an endpoint, created on first use.

    Args:
        key: what identifies the endpoint (e.g. its base URL, or ``PoolKey``);
            hashable.
        cap: a fixed upper bound on the gate's capacity, in requests
            (``Limits.max_connections_per_process``); part of the key.
        factory: builds the limit of a new gate (default ``ConcurrencyLimit()``).
    """
    found: AdaptiveGate | None = STATE.adaptive_gates.get((key, cap))
    if found is not None:
        return found
    with STATE.lock:
        found = STATE.adaptive_gates.get((key, cap))
        if found is None:
            found = STATE.adaptive_gates[(key, cap)] = AdaptiveGate(factory(), cap=cap)
        return found


def gates() -> dict[Hashable, dict[str, Any]]:
    """A snapshot of every gate of this process: ``{key: limit.snapshot() + in_flight}``."""
    with STATE.lock:
        items: list[tuple[tuple[Hashable, int | None], AdaptiveGate]] = list(
            STATE.adaptive_gates.items()
        )
    return {key: {**gate.limit.snapshot(), "in_flight": gate.in_flight} for (key, _), gate in items}


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
