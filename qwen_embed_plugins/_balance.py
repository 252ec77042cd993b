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
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Collection, Sequence

from ._config import EmbeddingConfig, PoolKey
from ._learn import ReplicaState
from ._metrics import EndpointMetrics
from ._retry import is_health_failure, retry_reason
from ._state import STATE
from .errors import (
    CircuitOpenError,
    ConnectError,
    ConnectTimeout,
    NetworkError,
    QwenEmbedError,
    TransportError,
)

__all__ = ["Endpoint", "HedgeBudget", "Replica", "endpoint_for", "replica_for"]

_log = logging.getLogger("qwen_embed_plugins")

_EWMA_ALPHA = 0.2
_LATENCY_WINDOW = 512


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
            self.probing = self.answered = False
            self.last_error = None
            self.states.clear()
            self.latencies.clear()

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

    def succeeded(self, seconds: float) -> None:
        """An answer arrived (any status that shows the server alive) in ``seconds``."""
        self.latencies.append(seconds)
        ewma = self.ewma
        self.ewma = seconds if ewma is None else ewma + _EWMA_ALPHA * (seconds - ewma)
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

    def retried(self, exc: QwenEmbedError, delay: float) -> None:
        """A request to it failed with ``exc`` and is retried after ``delay`` seconds:
        counted, logged at DEBUG, and one WARNING when this starts an outage episode (the
        first retry since its last success; ``recovered`` logs its end)."""
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
            "%s failed (%s); retrying until it answers (further retries are logged at DEBUG): %s",
            self.label,
            reason,
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

    def p95(self) -> float | None:
        """The 95th percentile of recent request latencies, in seconds (``None``:
        fewer than 20 samples)."""
        samples = list(self.latencies)
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


class HedgeBudget:
    """Caps hedged requests at ``ratio`` of the queries seen (default 5%): a hedge is
    allowed while ``hedges + 1 <= ratio * queries``. Thread-safe."""

    def __init__(self, ratio: float = 0.05) -> None:
        self.ratio = ratio
        self.queries = 0
        self.hedges = 0
        self.wins = 0
        self._lock = threading.Lock()

    def seen(self) -> None:
        with self._lock:
            self.queries += 1

    def allow(self) -> bool:
        with self._lock:
            if self.hedges + 1 <= self.ratio * self.queries:
                self.hedges += 1
                return True
            return False

    def won(self) -> None:
        with self._lock:
            self.wins += 1


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
        self.hedges = HedgeBudget()

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
        call under way keeps retrying)."""
        single = self.single
        if single is not None:
            if not single.available(time.monotonic()):
                with single._lock:
                    single.probing = True
            return single
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

    def failed(self, replica: Replica, exc: BaseException, *, health: bool = False) -> None:
        replica.failed(exc, eject_after=self.eject_after, cooldown=self.cooldown, health=health)

    def p95(self) -> float | None:
        """The endpoint's recent 95th-percentile latency (seconds), over its replicas."""
        values = [p for r in self.replicas if (p := r.p95()) is not None]
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
