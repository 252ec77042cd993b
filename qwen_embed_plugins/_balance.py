"""Replicas of one logical endpoint: choice, health, ejection, and what each has taught.

A config's ``base_url`` may name several replicas (one per GPU, or a fleet behind no
router). Each replica is a ``Replica``: its own pool (``pool``), requests in flight, a
latency EWMA, a health record, and the facts learned about its server per model
(``_learn.ReplicaState``: dialect, base64 and ``dimensions`` support, batch and token
limits).
Replicas are process-wide, shared by every client whose settings name them.

Choice (``Endpoint.choose``): the available replica with the fewest requests in flight;
ties go to the lowest recent latency (EWMA), then in turn. A replica whose requests fail
with health signals (``_retry.is_health_failure``: connect errors, timeouts, 502/503/504)
``eject_after`` times in a row is ejected for ``cooldown`` seconds, then probed by one
request; a batch whose replica failed is resent on another at once. The endpoint fails
fast (``CircuitOpenError``, naming each replica's last failure) only for a new call
while every replica has been failing for at least ``open_after`` seconds; calls under
way keep retrying within their deadline, so a restart shorter than that costs time,
not the run.

An outage costs the server almost nothing. A replica that fails with a health signal
(or, alone in its endpoint, whose control request failed too: the server fails whatever
the input) is *down* until it answers again. While no other replica of its endpoint
takes requests, one request at a time probes it (``Replica.gate``, a one-slot
``ProcessGate`` shared by threads and every event loop), each probe after a backoff that
doubles up to ``PROBE_CAP`` seconds (``Replica.probe_wait``), and every other request
waits for the probe's verdict, woken by it (``Endpoint.wait_probe``); with every replica
of an endpoint down, each request waits for the probe of the one with the fewest waiting
(one probe per replica) and goes to the first replica that answers. While another
replica takes requests, the work goes there, and the one down is ejected and probed by
one request after its cool-down (``choose``). Every retry (after a backoff, or at once
on another replica) is made only within the ``Budget`` of the replica it failed on
(``Replica.retries``, ``Endpoint.retry_allowed``): at most ``RETRY_RATIO`` of its recent
requests plus ``RETRY_FLOOR`` per ``RETRY_WINDOW`` seconds, across the process (as
Finagle's ``RetryBudget`` and gRPC's retry throttling); retries after a failure on a
replica that is down are paced by its probe and not counted.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Generator, Sequence
from typing import Any

from ._config import EmbeddingConfig, PoolKey, RetryConfig
from ._learn import ReplicaState
from ._metrics import EndpointMetrics
from ._retry import MIN_ATTEMPT_SECONDS, is_health_failure, retry_reason
from ._state import STATE
from ._transport import ProcessGate
from .errors import (
    CircuitOpenError,
    ConnectError,
    ConnectTimeout,
    HTTPStatusError,
    NetworkError,
    QwenEmbedError,
    TransportError,
)

__all__ = ["Budget", "Endpoint", "Replica", "endpoint_for", "replica_for"]

_log = logging.getLogger("qwen_embed_plugins")

_EWMA_ALPHA = 0.2
_LATENCY_WINDOW = 512
PROBE_CAP = 4.0
"""The longest wait between two probes of a replica that is down, in seconds."""
SUSPECT_RUN = 3
"""Requests in a row (not pieces of one bisection) failing in a way one input may cause
(500, 424, a dropped connection), with no success between, that put a replica down."""
RETRY_RATIO = 0.2
"""Retries a replica gets, as a share of its recent requests (``Budget``)."""
RETRY_FLOOR = 10
"""Retries a replica gets per ``RETRY_WINDOW`` whatever its traffic (``Budget``)."""
RETRY_WINDOW = 10.0
"""Seconds of requests a retry budget counts (``Budget``)."""


class Budget:
    """Caps extra requests (retries, hedges) at ``ratio`` of the requests seen plus
    ``floor``: one is allowed while ``spent + 1 <= ratio * seen + floor``, counted over
    the last ``window`` seconds (``None``: since the start). Thread-safe.

    Args:
        ratio: extra requests per request seen (0.05: 5%).
        floor: extra requests allowed per window whatever the traffic.
        window: seconds counted (``None``: everything since the start).
        clock: the monotonic clock, in seconds (tests give their own).

    Attributes:
        queries: requests seen (in the window, as last counted).
        hedges: extra requests allowed (in the window, as last counted).
        wins: hedges that answered first (``won``).
    """

    def __init__(
        self,
        ratio: float = 0.05,
        *,
        floor: int = 0,
        window: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ratio = ratio
        self.floor = floor
        self.window = window
        self.clock = clock
        self.queries = 0
        self.hedges = 0
        self.wins = 0
        self._seen: deque[float] = deque()  # monotonic times, with a window only
        self._spent: deque[float] = deque()
        self._lock = threading.Lock()

    def _expire(self, now: float) -> None:
        # with self._lock held
        if self.window is None:
            return
        oldest = now - self.window
        for times in (self._seen, self._spent):
            while times and times[0] < oldest:
                times.popleft()
        self.queries, self.hedges = len(self._seen), len(self._spent)

    def seen(self) -> None:
        """A request was made (it earns ``ratio`` of an extra one)."""
        with self._lock:
            if self.window is None:
                self.queries += 1
                return
            now = self.clock()
            self._seen.append(now)
            self._expire(now)

    def allow(self) -> bool:
        """Whether one more extra request fits (then it is counted as spent)."""
        with self._lock:
            now = self.clock() if self.window is not None else 0.0
            self._expire(now)
            if self.hedges + 1 > self.ratio * self.queries + self.floor:
                return False
            self.hedges += 1
            if self.window is not None:
                self._spent.append(now)
            return True

    def after_fork_in_child(self) -> None:
        """In a forked child: a new lock (another thread may have held it at the fork)."""
        self._lock = threading.Lock()

    def won(self) -> None:
        with self._lock:
            self.wins += 1

    def clear(self) -> None:
        """Forget every request and extra request counted."""
        with self._lock:
            self._seen.clear()
            self._spent.clear()
            self.queries = self.hedges = self.wins = 0


class Replica:
    """One server of an endpoint: its pool key, load, latency and health.

    Thread-safe; counters are exact under threads (a lock per replica, uncontended in
    the common case).
    """

    def __init__(self, key: PoolKey, metrics: EndpointMetrics) -> None:
        self.key = key
        self.url = key.base_url
        self.label = key.label
        self.metrics = metrics
        self._lock = threading.Lock()
        self.in_flight = 0
        self.ewma: float | None = None
        self.failures = 0
        self.streak_started: float | None = None
        self.ejected_until = 0.0
        self.probing = False
        self.last_error: QwenEmbedError | None = None
        self.ejections = 0
        self.states: dict[str, ReplicaState] = {}
        self.latencies: deque[float] = deque(maxlen=_LATENCY_WINDOW)
        """Recent latencies of requests of several texts, in seconds."""
        self.single_latencies: deque[float] = deque(maxlen=_LATENCY_WINDOW)
        """Recent latencies of single-text requests (queries), in seconds."""
        self.down = False
        """Down (a health failure, or a control request failed too): one request at a
        time probes it (``gate``) until it answers again."""
        self.down_error: QwenEmbedError | None = None
        self.probes = 0  # probes started since it went down
        self.suspects = 0  # requests failed in a row in a way one input may cause
        self.last_probe = 0.0  # monotonic time the latest probe ended
        self.probe_at: float | None = None  # monotonic time the next probe may go
        self.claims = 0  # requests holding or waiting for ``gate``
        self.gate = ProcessGate(1)
        self.retries = Budget(RETRY_RATIO, floor=RETRY_FLOOR, window=RETRY_WINDOW)
        """Retries to it, across the process (``Budget``)."""
        self.answered = False
        """Whether any HTTP answer (whatever its status) came from it in this process:
        until then, connection failures fail a call after ``RetryConfig.wait_for_server``."""
        self.episode_started: float | None = None
        self.episode_retries = 0

    def forget(self) -> None:
        """Forget what was learned about this server: its health, latencies and learned
        state per model (``reset()``)."""
        with self._lock:
            self.ewma = None
            self.failures = self.ejections = self.episode_retries = 0
            self.streak_started = self.episode_started = None
            self.ejected_until = 0.0
            self.probing = self.answered = self.down = False
            self.last_error = self.down_error = None
            self.probes = self.suspects = 0
            self.probe_at = None
            self.states.clear()
            self.latencies.clear()
            self.single_latencies.clear()
        self.retries.clear()

    def after_fork_in_child(self) -> None:
        """In a forked child: new locks and a free ``gate`` (a thread of the parent may
        have held them at the fork; its requests are not in the child)."""
        self._lock = threading.Lock()
        self.gate = ProcessGate(1)
        self.claims = 0
        self.probe_at = None
        self.retries.after_fork_in_child()

    def state(self, model: str) -> ReplicaState:
        """The learned state of this replica for ``model``."""
        found = self.states.get(model)
        if found is None:
            with self._lock:
                found = self.states.setdefault(model, ReplicaState())
        return found

    def begin(self) -> None:
        with self._lock:
            self.in_flight += 1

    def end(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def succeeded(self, seconds: float, texts: int = 2) -> None:
        """An answer arrived (any status that shows the server alive) in ``seconds``, to
        a request of ``texts`` texts (single-text latencies are kept apart: ``p95``)."""
        (self.single_latencies if texts == 1 else self.latencies).append(seconds)
        ewma = self.ewma
        self.ewma = seconds if ewma is None else ewma + _EWMA_ALPHA * (seconds - ewma)
        self.healthy()

    def healthy(self) -> None:
        """It answered, maybe with an error that shows it alive (its latency is not a
        success's: not recorded): its failure streak and ejection end."""
        if self.failures or self.probing or self.ejected_until:
            with self._lock:
                self.failures = 0
                self.streak_started = None
                self.ejected_until = 0.0
                self.probing = False

    def failed(
        self, exc: BaseException, *, eject_after: int, cooldown: float, health: bool = False
    ) -> None:
        """A request failed; health failures may eject the replica. ``health``: count it
        as one whatever its kind (the same batch then succeeded on another replica)."""
        if not (health or is_health_failure(exc)):
            return
        now = time.monotonic()
        with self._lock:
            if isinstance(exc, QwenEmbedError):
                self.last_error = exc
            self.failures += 1
            if self.streak_started is None:
                self.streak_started = now
            if self.probing or (eject_after > 0 and self.failures >= eject_after):
                if self.ejected_until <= now:
                    self.ejections += 1
                self.ejected_until = now + cooldown
                self.probing = False

    def went_down(self, exc: QwenEmbedError) -> None:
        """It failed whatever the request (``exc``: an outage or a health failure, or a
        control request's failure): down until it answers (``up``); one request at a
        time probes it (``gate``, ``probe_wait``)."""
        with self._lock:
            if not self.down:
                self.down, self.probes = True, 0
            self.down_error = exc
            self.last_probe = time.monotonic()
            self.probe_at = None

    def up(self) -> None:
        """It answered (a success, or an answer that shows it alive): not down."""
        if self.down or self.suspects:
            with self._lock:
                self.down, self.probes, self.suspects = False, 0, 0
                self.probe_at = None

    def suspect(self, exc: QwenEmbedError) -> None:
        """A request (not a piece of a bisection) failed with ``exc``, which one input
        may cause (500, 424, a dropped connection): ``SUSPECT_RUN`` of them in a row with
        no success between put it down (``went_down``): their bisections then wait for
        one probe instead of all running at once."""
        with self._lock:
            self.suspects += 1
            run = self.suspects
        if run >= SUSPECT_RUN:
            self.went_down(
                exc.with_context(
                    note=f" ({run} requests in a row failed with no success between: the "
                    "server fails whatever the input)"
                )
            )

    def alive(self, exc: QwenEmbedError) -> None:
        """A request to it failed with ``exc``: an HTTP answer below 500 other than 429
        shows it alive whatever it said (``up``)."""
        if isinstance(exc, HTTPStatusError) and exc.status < 500 and exc.status != 429:
            self.up()

    def probe_wait(self, policy: RetryConfig, rng: random.Random | None = None) -> float:
        """Seconds to wait before the next probe of this replica, down (its caller holds
        ``gate``): a backoff that doubles from ``policy.backoff_initial`` per probe up to
        ``min(policy.backoff_max, PROBE_CAP)`` (half of it jittered), at least the
        ``Retry-After`` it last sent (up to ``policy.retry_after_max``), less the time
        since its last failure. Drawn once per probe (``probe_at``): asked again before
        the probe is sent, it gives what is left of the same wait."""
        with self._lock:
            now = time.monotonic()
            if self.probe_at is not None:
                return max(0.0, self.probe_at - now)
            retry, self.probes = self.probes, self.probes + 1
            said = self.down_error
            cap = min(policy.backoff_max, PROBE_CAP, policy.backoff_initial * 2.0 ** min(retry, 60))
            wait = cap / 2.0 + (rng or random).uniform(0.0, cap / 2.0)
            server_wait = said.retry_after if isinstance(said, HTTPStatusError) else None
            if server_wait is not None and server_wait > 0.0:
                wait = max(wait, min(server_wait, policy.retry_after_max))
            self.probe_at = self.last_probe + wait
            return max(0.0, self.probe_at - now)

    def next_probe(self) -> tuple[int, float]:
        """How soon a request for it, down, may go: the requests holding or waiting for
        its ``gate``, then the monotonic time its next probe may go (drawn or not)."""
        at = self.probe_at
        return self.claims, self.last_probe if at is None else at

    def release_gate(self) -> None:
        """A request that held ``gate`` (or gave up waiting for it) lets it go."""
        with self._lock:
            self.claims -= 1
        self.gate.release()

    def probed(self) -> None:
        """A probe ended (its verdict recorded): the next one waits from now."""
        with self._lock:
            self.last_probe = time.monotonic()
            self.probe_at = None

    def retried(self, exc: QwenEmbedError, delay: float, *, bound: str = "") -> None:
        """A request to it failed with ``exc`` and is retried after ``delay`` seconds:
        counted, logged at DEBUG, and one WARNING when this starts an outage episode (the
        first retry since its last success; ``recovered`` logs its end). ``bound``: what
        will end the retries, when a count does (``"at most 3 attempts"``); else they go
        on until it answers (within the call's deadline)."""
        reason = retry_reason(exc) or "unknown"
        stale = delay == 0.0 and isinstance(exc, NetworkError) and not exc.refused
        self.metrics.retry(reason, stale=stale)
        _log.debug("retrying %s after %s in %.3f s: %s", self.label, reason, delay, exc)
        if stale or (isinstance(exc, TransportError) and exc.refused):
            return  # routine: a keep-alive connection closed under us, a refused stream
        with self._lock:
            self.episode_retries += 1
            if self.episode_started is not None:
                return
            self.episode_started = time.monotonic()
            self.episode_retries = 1
        _log.warning(
            "%s failed (%s); retrying %s (further retries are logged at DEBUG): %s",
            self.label,
            reason,
            bound or "until it answers or the deadline passes",
            exc,
            extra={"qwen_embed_episode": "start"},
        )

    def recovered(self) -> None:
        """A request to it succeeded: one WARNING when this ends an outage episode (how
        long it lasted, how many retries)."""
        if self.episode_started is None:
            return  # the common case: no lock
        with self._lock:
            started, self.episode_started = self.episode_started, None
        if started is not None:
            _log.warning(
                "%s answered again after %.1f s and %d %s",
                self.label,
                time.monotonic() - started,
                self.episode_retries,
                "retry" if self.episode_retries == 1 else "retries",
                extra={"qwen_embed_episode": "end"},
            )

    def available(self, now: float) -> bool:
        """Not ejected, or its cooldown is over (then the caller becomes the probe)."""
        return self.ejected_until <= now

    def failing_for(self, now: float) -> float:
        """Seconds since this replica's current run of health failures began (0: none)."""
        started = self.streak_started
        return 0.0 if started is None else now - started

    def p95(self, texts: int = 2) -> float | None:
        """The 95th percentile of the latencies of recent requests like one of ``texts``
        texts (single-text requests apart from batches), in seconds (``None``: fewer than
        20 samples)."""
        samples = list(self.single_latencies if texts == 1 else self.latencies)
        if len(samples) < 20:
            return None
        samples.sort()
        return samples[int(0.95 * (len(samples) - 1))]


def replica_for(key: PoolKey) -> Replica:
    """The process-wide ``Replica`` of ``key`` (``STATE.replicas``)."""
    found: Replica | None = STATE.replicas.get(key)
    if found is not None:
        return found
    from ._pool import pool_metrics

    with STATE.lock:
        found = STATE.replicas.get(key)
        if found is None:
            found = STATE.replicas[key] = Replica(key, pool_metrics(key))
        return found


class Endpoint:
    """The replicas of one config, and the choice among them."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        *,
        eject_after: int,
        cooldown: float,
        open_after: float,
        threshold: int,
    ) -> None:
        self.replicas = tuple(replicas)
        self.single = self.replicas[0] if len(self.replicas) == 1 else None
        self.eject_after = eject_after
        self.cooldown = cooldown
        self.open_after = open_after
        self.threshold = threshold
        self._turn = itertools.count()
        self.opened = 0
        self.hedges = Budget()

    def check_open(self) -> None:
        """At the start of a call: raise ``CircuitOpenError`` when every replica has
        failed ``threshold`` times in a row for at least ``open_after`` seconds and none
        is due for a probe."""
        if self.threshold <= 0:
            return
        now = time.monotonic()
        for replica in self.replicas:
            if (
                replica.failures < self.threshold
                or replica.failing_for(now) < self.open_after
                or replica.available(now)
            ):
                return
        self.opened += 1
        failures = {r.label: r.last_error for r in self.replicas if r.last_error is not None}
        retry_in = max(0.0, min(r.ejected_until for r in self.replicas) - now)
        said = "; ".join(f"{label}: {err}" for label, err in failures.items())
        last = next(reversed(failures.values()), None) if failures else None
        error = CircuitOpenError(
            f"circuit open: every replica of {','.join(r.label for r in self.replicas)} "
            f"has failed for {self.open_after:g} s or more; failing fast, next probe in "
            f"{retry_in:.1f} s. Last failures: {said or 'none recorded'}",
            url=",".join(r.label for r in self.replicas),
            retry_in=retry_in,
            last_error=last,
            failures=failures,
        )
        raise error from last

    def name_failures(self, error: QwenEmbedError) -> QwenEmbedError:
        """``error``, saying what every replica last failed with (a new error; ``error``
        itself when none has failed)."""
        failures = {r.label: r.last_error for r in self.replicas if r.last_error}
        if not failures:
            return error
        said = "; ".join(f"{label}: {err}" for label, err in failures.items())
        return error.with_context(note=f" (every replica failed; last failures: {said})")

    def replica_of(self, error: QwenEmbedError) -> Replica | None:
        """The replica ``error`` names (``.replica``), when it is one of these."""
        return next((r for r in self.replicas if r.label == error.replica), None)

    def first_contact(
        self, error: QwenEmbedError, started: float, delay: float | None, wait: float
    ) -> float | None:
        """The wait before retrying ``error`` (``None``: fail the call now). A connection
        failure while no replica has answered (any HTTP status) in this process is
        retried only within ``wait`` seconds (``RetryConfig.wait_for_server``) of the
        call's start (monotonic ``started``): the URL may be wrong, or the server not up.
        Once a replica has answered, an outage keeps ``delay`` (the deadline's budget)."""
        if delay is None or not self._never_reached(error):
            return delay
        left = wait - (time.monotonic() - started)
        return min(delay, left) if left > 0 else None

    def unreached(
        self, error: QwenEmbedError, started: float, wait: float
    ) -> QwenEmbedError | None:
        """When ``error`` failed a call to an endpoint never reached: a new error saying
        so, with the URL and how to check it (``None``: the endpoint was reached)."""
        if not self._never_reached(error):
            return None
        label = ",".join(r.label for r in self.replicas)
        return error.with_context(
            note=f" (no request of this process reached {label}; tried for "
            f"{time.monotonic() - started:.1f} s, RetryConfig.wait_for_server={wait:g} s). "
            f"Is the server up and the URL right? Check with: qwen-embed check --base-url "
            f"{label}",
        )

    def _never_reached(self, error: QwenEmbedError) -> bool:
        return isinstance(error, ConnectError | ConnectTimeout) and not any(
            r.answered for r in self.replicas
        )

    def choose(self, avoid: Replica | Collection[Replica] | None = None) -> Replica:
        """The replica for the next request: available ones first, fewest in flight,
        then lowest latency EWMA, then in turn; ``avoid`` (the one that just failed) only
        when no other is available. A replica whose cooldown is over is chosen first, as
        the probe (one request; otherwise its stale latency could keep it from ever being
        tried again). With every replica ejected, the one whose cooldown ends first (a
        call under way keeps retrying); with every replica down, the one with the fewest
        requests waiting for its probe (``wait_probe``: one probe per replica)."""
        single = self.single
        if single is not None:
            if not single.available(time.monotonic()):
                with single._lock:
                    single.probing = True
            return single
        if all(r.down for r in self.replicas):  # wait for the probe with fewest waiting
            return min(self.replicas, key=Replica.next_probe)
        now = time.monotonic()
        turn = next(self._turn)
        n = len(self.replicas)
        avoided: Collection[Replica] = (
            () if avoid is None else (avoid,) if isinstance(avoid, Replica) else avoid
        )
        best: Replica | None = None
        best_rank: tuple[float, float, int] | None = None
        for offset in range(n):
            replica = self.replicas[(turn + offset) % n]
            if replica in avoided or not replica.available(now) or replica.probing:
                continue  # a replica being probed takes no other request meanwhile
            if replica.ejected_until:
                best = replica  # its cooldown is over: probe it now
                break
            rank = (replica.in_flight, replica.ewma or 0.0, offset)
            if best_rank is None or rank < best_rank:
                best, best_rank = replica, rank
        if best is None:
            candidates = [r for r in self.replicas if r not in avoided] or list(self.replicas)
            best = min(candidates, key=lambda r: r.ejected_until)
        if best.ejected_until and best.ejected_until <= now:
            with best._lock:
                best.probing = True
        return best

    def retry_allowed(self, replica: Replica) -> bool:
        """Whether a retry after a failure on ``replica`` is made, wherever it goes (at
        once on another replica, or after a backoff): the one rule for every retry.
        Free while ``replica`` is down (its probe paces the retries to it, and a resend
        elsewhere moves the work away from it); else within ``replica.retries`` (then
        counted as spent)."""
        return replica.down or replica.retries.allow()

    def must_wait(self, replica: Replica) -> bool:
        """Whether a request for ``replica`` waits for its probe (``wait_probe``): it is
        down, and no other replica takes requests (with some up, an ejected replica is
        probed by one request after its cool-down, ``choose``)."""
        return replica.down and (self.single is not None or self.serving(replica) is None)

    def serving(self, besides: Replica | Collection[Replica] = ()) -> Replica | None:
        """A replica (not ``besides``) that takes requests now: not down, not ejected,
        not being probed (``None``: none does)."""
        now = time.monotonic()
        others: Collection[Replica] = (besides,) if isinstance(besides, Replica) else besides
        for r in self.replicas:
            if r not in others and not r.down and r.available(now) and not r.probing:
                return r
        return None

    def wait_probe(
        self,
        replica: Replica,
        remaining: Callable[[], float | None],
        policy: RetryConfig,
        outlasted: Callable[[Replica], QwenEmbedError],
        hold: Callable[[ProcessGate, float | None], object],
        sleep: Callable[[float], object],
    ) -> Generator[Any, Any, tuple[Replica, bool]]:
        """A flow's wait for a request to ``replica``, down: wait (``Hold``, woken without
        polling) for its ``gate``, held by the one request that probes it. Returns
        ``(replica, True)`` holding the gate (this request is the probe, sent after
        ``Replica.probe_wait``; ``Replica.release_gate`` after its verdict), or
        ``(the replica to send to, False)``: ``replica`` answered meanwhile, or (several
        replicas) another one takes requests (``serving``). ``remaining()``: the call's
        seconds left (``None``: no deadline); ``hold``, ``sleep``: the flow's operations
        (``_run.Hold``, ``_run.Sleep``: ``_run`` imports this module). Raises
        ``outlasted(replica)`` when the deadline comes first."""
        while True:
            left = remaining()
            with replica._lock:
                replica.claims += 1
            try:
                got = yield hold(replica.gate, None if left is None else max(0.0, left))
            except BaseException:
                got = False
                raise
            finally:
                if not got:
                    with replica._lock:
                        replica.claims -= 1
            if not got:
                raise outlasted(replica)
            if not replica.down:
                replica.release_gate()  # the probe succeeded: go (the next waiter follows)
                return replica, False
            other = self._elsewhere(replica)
            if other is not None:
                return other, False
            try:
                wait = replica.probe_wait(policy)
                left = remaining()
                if left is not None and wait + MIN_ATTEMPT_SECONDS >= left:
                    raise outlasted(replica)
                if wait > 0:
                    yield sleep(wait)
            except BaseException:
                replica.release_gate()
                raise
            other = self._elsewhere(replica)
            if other is not None:
                return other, False  # its probe goes later, with the next request due
            if not replica.down:  # a request sent before it went down succeeded
                replica.release_gate()
                return replica, False
            return replica, True

    def _elsewhere(self, replica: Replica) -> Replica | None:
        """With several replicas: the one to take a request instead of ``replica``'s
        probe (``replica``'s gate then released): a replica taking requests."""
        if self.single is not None:
            return None
        other = self.serving(replica)
        if other is not None:
            replica.release_gate()
        return other

    def failed(self, replica: Replica, exc: BaseException, *, health: bool = False) -> None:
        replica.failed(exc, eject_after=self.eject_after, cooldown=self.cooldown, health=health)

    def p95(self, texts: int = 2) -> float | None:
        """The endpoint's recent 95th-percentile latency (seconds) of requests like one of
        ``texts`` texts (``Replica.p95``), over its replicas."""
        values = [p for r in self.replicas if (p := r.p95(texts)) is not None]
        return min(values) if values else None


def endpoint_for(config: EmbeddingConfig) -> Endpoint:
    """The process-wide ``Endpoint`` of ``config``'s replicas (equal lists share it;
    configs with other breaker settings get their own ``Endpoint`` over the same
    process-wide replicas)."""
    keys = tuple(config.pool_key_for(url) for url in config.replicas)
    retry = config.retry
    eject_after = 3 if len(keys) > 1 else max(1, retry.circuit_failure_threshold)
    settings = (
        eject_after,
        retry.circuit_cooldown,
        retry.circuit_open_after,
        retry.circuit_failure_threshold,
    )
    found: Endpoint | None = STATE.endpoints.get((keys, settings))
    if found is not None:
        return found
    replicas = [replica_for(k) for k in keys]
    with STATE.lock:
        found = STATE.endpoints.get((keys, settings))
        if found is None:
            found = STATE.endpoints[(keys, settings)] = Endpoint(
                replicas,
                eject_after=eject_after,
                cooldown=retry.circuit_cooldown,
                open_after=retry.circuit_open_after,
                threshold=retry.circuit_failure_threshold,
            )
            if len(replicas) > 1:
                from ._metrics import register_group

                register_group(
                    ",".join(r.label for r in replicas), tuple(r.label for r in replicas)
                )
        return found
