"""The one retry layer: pure policy (what to retry, how long to wait, what counts as ill
health), the circuit breaker, and thin sync/async drivers.

The openai SDK's own retries are always off (``max_retries=0``). Failures fall in four
kinds (``classify``):

- ``"outage"``: the endpoint is down or pushing back: connection refused or timed out,
  HTTP 429, 502, 503, 504. Retried with capped exponential backoff (full jitter), or the
  server's ``Retry-After`` when longer (up to ``RetryConfig.retry_after_max``; a zero,
  negative, NaN or past value never shortens the backoff), until the call's
  deadline: a restart or a rate-limit window shorter than the deadline costs time, not
  the run.
- ``"transient"``: a failure that may not repeat: HTTP 408, 500 and 424 (TEI's backend
  error), a connection that
  broke after the request was sent, a read or write timeout. At most
  ``RetryConfig.max_attempts`` attempts in all. A request cut on a reused keep-alive
  connection before any response byte ("Server disconnected without sending a
  response") is first resent once at once on a fresh connection.
- ``"refused"``: an HTTP/2 stream the server refused before processing it (GOAWAY with
  a lower ``last_stream_id``, ``REFUSED_STREAM``): resent at once, never counted as a
  failure (bounded per call).
- ``"fatal"``: everything else (400, 401, 403, 404, 413, 422, a context-length error,
  a malformed 200, a local ``PoolTimeout``, a TLS certificate failure): not retried.

Only endpoint ill health feeds the circuit breaker (``is_health_failure``): connect
errors and timeouts, read timeouts with no response, 502/503/504. Never 4xx, 429 (back
off instead), a local ``PoolTimeout``, a refused stream, or a 500 (one input's fault as
often as the server's; bisection tells which).

Whose fault a failure may be (``maybe_input``, ``input_error``, ``ambiguous``,
``named_position``, ``replica_suspect``) is decided here too: the engine bisects, resends
or blames an input on these answers.

Sleep, clock and random source are injectable, so the maths is tested without waiting.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import random
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from .config import RetryConfig
from .errors import (
    SERVER_POSITION,
    BadRequestError,
    BatchTooLargeError,
    CircuitOpenError,
    ConnectError,
    ConnectTimeout,
    ContextLengthError,
    HTTPStatusError,
    NetworkError,
    PoolTimeout,
    QwenEmbedError,
    ReadTimeout,
    ResponseError,
    ServerError,
    TimeoutException,
    TransportError,
)

__all__ = [
    "BACKEND_STATUS",
    "OUTAGE_STATUS",
    "RETRYABLE_STATUS",
    "CircuitBreaker",
    "FailureKind",
    "RetryState",
    "acall_with_retry",
    "ambiguous",
    "backoff_delay",
    "call_with_retry",
    "classify",
    "input_error",
    "is_health_failure",
    "maybe_input",
    "named_position",
    "parse_retry_after",
    "replica_suspect",
    "retry_reason",
]

RETRYABLE_STATUS = frozenset({408, 424, 429, 500, 502, 503, 504})
OUTAGE_STATUS = frozenset({429, 502, 503, 504})
HEALTH_STATUS = frozenset({502, 503, 504})
MIN_ATTEMPT_SECONDS = 0.02
"""A retry is not started with less than this left before the deadline (it could only
end in a timeout hiding the failure that caused it)."""
MAX_REFUSED_RESENDS = 16
"""Refused HTTP/2 streams resent at once per request before they count as failures."""

FailureKind = Literal["outage", "transient", "refused", "fatal"]

T = TypeVar("T")


def parse_retry_after(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """Seconds to wait according to ``retry-after-ms`` or ``Retry-After``.

    ``Retry-After`` may be a number of seconds or an HTTP date (RFC 9110 10.2.3);
    ``retry-after-ms`` (milliseconds) is what OpenAI-style servers send. Returns ``None``
    when neither is present or usable: a value that is not a number or a date, zero,
    negative, NaN, infinite, or a date in the past says nothing about when to come back
    (the normal backoff applies; it is never a reason to retry at once). Otherwise a
    positive number of seconds.

    Args:
        headers: response headers (case-insensitive mapping, or lower-case keys).
        now: the current UNIX time in seconds, for HTTP dates (default ``time.time()``).
    """
    raw_ms = headers.get("retry-after-ms")
    if raw_ms:
        found = _positive(raw_ms, 1000.0)
        if found is not None:
            return found
    raw = headers.get("retry-after")
    if not raw:
        return None
    raw = raw.strip()
    seconds = _positive(raw, 1.0)
    if seconds is not None or _number_like(raw):
        return seconds
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:
        return None
    current = time.time() if now is None else now
    return _positive(str(when.timestamp() - current), 1.0)


def _number_like(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _positive(text: str, per_second: float) -> float | None:
    """``text`` as a positive, finite number of seconds (``None``: anything else)."""
    try:
        value = float(text) / per_second
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0.0 else None


def _tls_failure(exc: BaseException) -> bool:
    text = str(exc)
    return "TLS certificate verification failed" in text or "TLS handshake with" in text


def classify(exc: BaseException) -> FailureKind:
    """The kind of failure ``exc`` is (see the module docstring)."""
    if isinstance(exc, HTTPStatusError):
        if exc.status in OUTAGE_STATUS:
            return "outage"
        return "transient" if exc.status in RETRYABLE_STATUS else "fatal"
    if not isinstance(exc, TransportError) or isinstance(exc, PoolTimeout):
        return "fatal"
    if exc.refused:
        return "refused"
    if isinstance(exc, ConnectError | ConnectTimeout):
        return "fatal" if _tls_failure(exc) else "outage"
    return "transient"


def is_health_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the endpoint (replica) is unwell: what the breaker hears."""
    if isinstance(exc, HTTPStatusError):
        return exc.status in HEALTH_STATUS
    if isinstance(exc, ConnectError | ConnectTimeout):
        return not _tls_failure(exc)
    return isinstance(exc, ReadTimeout) and not exc.received


def retry_reason(exc: BaseException) -> str | None:
    """A short label for why ``exc`` is retried (for metrics), or ``None`` if it is not."""
    kind = classify(exc)
    if kind == "fatal":
        return None
    if isinstance(exc, HTTPStatusError):
        return f"status_{exc.status}"
    if kind == "refused":
        return "refused_stream"
    if isinstance(exc, TimeoutException):
        return type(exc).__name__.lower()
    if isinstance(exc, NetworkError):
        return "disconnected"
    return "connect_error"


def backoff_delay(retry: int, policy: RetryConfig, rng: random.Random | None = None) -> float:
    """Full-jitter backoff before retry number ``retry`` (0-based), in seconds:
    ``uniform(0, min(backoff_max, backoff_initial * 2**retry))``."""
    cap = min(policy.backoff_max, policy.backoff_initial * (2.0 ** min(retry, 60)))
    return (rng or random).uniform(0.0, cap)


@dataclass
class RetryState:
    """The running state of one request's retries.

    Attributes:
        policy: the ``RetryConfig``.
        started: the monotonic time the call started, in seconds.
        deadline: seconds the call may take in all (``None``: no deadline).
        attempts: attempts made that count against ``max_attempts`` (transient ones,
            the first attempt included).
        outages: outage retries made (they count against the deadline only).
        refused: refused HTTP/2 streams resent.
        stale_resent: the one immediate resend after a stale keep-alive connection
            was used.
    """

    policy: RetryConfig
    started: float
    deadline: float | None = field(default=None)
    attempts: int = 0
    outages: int = 0
    refused: int = 0
    stale_resent: bool = False

    def __post_init__(self) -> None:
        if self.deadline is None:
            self.deadline = self.policy.deadline

    def remaining(self, now: float) -> float | None:
        """Seconds left before the deadline (``None``: no deadline)."""
        if self.deadline is None:
            return None
        return self.deadline - (now - self.started)

    def next_delay(
        self,
        exc: BaseException,
        *,
        now: float,
        fresh_connection: bool,
        rng: random.Random | None = None,
        outage: bool = False,
    ) -> float | None:
        """Seconds to wait before the next attempt, or ``None`` to give up.

        Call it once per failed attempt. A ``Retry-After`` the server sent lengthens the
        backoff (up to ``retry_after_max``), never shortens it.

        Args:
            exc: what the last attempt raised.
            now: the monotonic clock now, in seconds.
            fresh_connection: whether the failed attempt opened its own connection
                (``False`` = it ran on a reused keep-alive connection).
            rng: random source for the jitter.
            outage: the server is known to fail whatever the input (a control request
                failed too): a retryable failure is retried as an outage, until the
                deadline, rather than ``max_attempts`` times.
        """
        kind = classify(exc)
        if kind == "fatal":
            return None
        if outage and kind == "transient":
            kind = "outage"
        if self.policy.max_attempts <= 1 and kind != "refused":
            return None  # retries turned off, outages included
        if kind == "refused":
            self.refused += 1
            if self.refused <= MAX_REFUSED_RESENDS:
                return 0.0
            kind = "transient"
        if (
            isinstance(exc, NetworkError)
            and not fresh_connection
            and not self.stale_resent
            and kind == "transient"
        ):
            # The server closed an idle keep-alive connection as we reused it: resend
            # once, at once, on a fresh connection (embeddings are idempotent).
            self.stale_resent = True
            return 0.0
        if kind == "outage":
            self.outages += 1
            retry = self.outages - 1
        else:
            self.attempts += 1
            if self.attempts >= self.policy.max_attempts:
                return None
            retry = self.attempts - 1
        delay = backoff_delay(retry, self.policy, rng)
        server_wait = exc.retry_after if isinstance(exc, HTTPStatusError) else None
        if server_wait is not None and server_wait > 0.0:
            # the server's wait lengthens the backoff, never shortens it
            delay = max(delay, min(server_wait, self.policy.retry_after_max))
        left = self.remaining(now)
        if left is not None and delay + MIN_ATTEMPT_SECONDS >= left:
            return None  # no time left for an attempt after the wait
        return delay


class CircuitBreaker:
    """A per-endpoint (per-replica) circuit breaker that listens to health only.

    Closed: calls pass. After ``threshold`` consecutive health failures
    (``is_health_failure``) it opens: new calls fail at once with ``CircuitOpenError``
    for ``cooldown`` seconds (calls already under way keep retrying within their
    deadline). Then one probe is let through (half-open): a success closes the breaker,
    a health failure opens it for another cooldown. Any answer that shows the server
    alive (a 2xx, a 4xx, a 429, a 500) resets the count. ``threshold=0`` disables it.
    Thread-safe; clock injectable.
    """

    def __init__(
        self,
        *,
        threshold: int,
        cooldown: float,
        label: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self.label = label
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None
        self._probing = False
        self.last_error: QwenEmbedError | None = None
        self.opened = 0
        """How many times the breaker opened (for stats and tests)."""

    def after_fork(self) -> None:
        """In a forked child: a new lock (the parent's may have been held at fork time)."""
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"half-open"``."""
        with self._lock:
            return self._state()

    def _state(self) -> str:
        if self._opened_at is None:
            return "closed"
        if self._clock() - self._opened_at >= self.cooldown:
            return "half-open"
        return "open"

    def available(self) -> bool:
        """Whether a request may be sent now without waiting (closed, or a probe is due)."""
        if self.threshold <= 0:
            return True
        with self._lock:
            state = self._state()
            return state == "closed" or (state == "half-open" and not self._probing)

    def open_error(self) -> CircuitOpenError:
        """The ``CircuitOpenError`` for this breaker now (with the last failure)."""
        with self._lock:
            waited = 0.0 if self._opened_at is None else self._clock() - self._opened_at
            retry_in = max(0.0, self.cooldown - waited)
            last = self.last_error
        said = f"; last failure: {last}" if last is not None else ""
        return CircuitOpenError(
            f"circuit open for {self.label} after {self.threshold} consecutive health "
            f"failures; failing fast, next probe in {retry_in:.1f} s{said}",
            url=self.label,
            retry_in=retry_in,
            last_error=last,
        )

    def before_call(self) -> None:
        """At the start of a call: raise ``CircuitOpenError`` while the breaker is open;
        when the cooldown is over, let this call be the probe."""
        if self.threshold <= 0:
            return
        with self._lock:
            state = self._state()
            if state == "closed":
                return
            if state == "half-open" and not self._probing:
                self._probing = True
                return
        error = self.open_error()
        raise error from error.last_error

    before_request = before_call

    def record_success(self) -> None:
        """The server answered (a 2xx, or any status that shows it alive)."""
        if self._failures == 0 and self._opened_at is None and not self._probing:
            return  # the common case: no lock
        with self._lock:
            self._failures = 0
            self._opened_at = None
            self._probing = False

    def record(self, exc: BaseException) -> None:
        """Record a failed attempt: a health failure counts, anything else shows the
        server alive (resets the count)."""
        if is_health_failure(exc):
            self.record_failure(exc if isinstance(exc, QwenEmbedError) else None)
        elif isinstance(exc, HTTPStatusError):
            self.record_success()

    def record_failure(self, exc: QwenEmbedError | None = None) -> None:
        """A health failure (connection refused, timeout, 502/503/504)."""
        if self.threshold <= 0:
            return
        with self._lock:
            if exc is not None:
                self.last_error = exc
            self._failures += 1
            if self._probing or self._failures >= self.threshold:
                if self._opened_at is None or self._probing:
                    self.opened += 1
                self._opened_at = self._clock()
            self._probing = False


# --------------------------------------------------------------------------- drivers


def call_with_retry(
    attempt: Callable[[], T],
    *,
    policy: RetryConfig,
    breaker: CircuitBreaker | None = None,
    on_retry: Callable[[BaseException, float], None] | None = None,
    fresh_connection: Callable[[], bool] = lambda: True,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
    deadline: float | None = None,
) -> T:
    """Run ``attempt()`` until it succeeds or the policy gives up (sync driver).

    Args:
        attempt: one request; raises a ``QwenEmbedError`` on failure.
        policy: the ``RetryConfig``.
        breaker: the endpoint's circuit breaker: checked once at the start (an open
            breaker fails the call at once) and told every outcome.
        on_retry: called with ``(error, delay_seconds)`` before each wait.
        fresh_connection: after a failure, whether that attempt opened a new connection.
        sleep, clock, rng: injectable for tests.
        deadline: seconds for the whole call (default ``policy.deadline``).

    Raises:
        The last attempt's error, or ``CircuitOpenError``.
    """
    state = RetryState(policy=policy, started=clock(), deadline=deadline)
    if breaker is not None:
        breaker.before_call()
    while True:
        try:
            result = attempt()
        except QwenEmbedError as exc:
            delay = _after_failure(exc, state, breaker, on_retry, fresh_connection(), clock(), rng)
            if delay is None:
                raise
            if delay > 0:
                sleep(delay)
            continue
        if breaker is not None:
            breaker.record_success()
        return result


async def acall_with_retry(
    attempt: Callable[[], Awaitable[T]],
    *,
    policy: RetryConfig,
    breaker: CircuitBreaker | None = None,
    on_retry: Callable[[BaseException, float], None] | None = None,
    fresh_connection: Callable[[], bool] = lambda: True,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
    deadline: float | None = None,
) -> T:
    """The async twin of ``call_with_retry``; differs only in awaiting."""
    state = RetryState(policy=policy, started=clock(), deadline=deadline)
    if breaker is not None:
        breaker.before_call()
    while True:
        try:
            result = await attempt()
        except QwenEmbedError as exc:
            delay = _after_failure(exc, state, breaker, on_retry, fresh_connection(), clock(), rng)
            if delay is None:
                raise
            if delay > 0:
                await sleep(delay)
            continue
        if breaker is not None:
            breaker.record_success()
        return result


def _after_failure(
    exc: QwenEmbedError,
    state: RetryState,
    breaker: CircuitBreaker | None,
    on_retry: Callable[[BaseException, float], None] | None,
    fresh_connection: bool,
    now: float,
    rng: random.Random | None,
) -> float | None:
    """Shared by both drivers: tell the breaker, decide the wait (``None``: give up)."""
    if breaker is not None:
        breaker.record(exc)
    delay = state.next_delay(exc, now=now, fresh_connection=fresh_connection, rng=rng)
    if delay is not None and on_retry is not None:
        on_retry(exc, delay)
    return delay


# --------------------------------------------------------------------------- whose fault

BACKEND_STATUS = frozenset({500, 424})
"""The model failed (TEI answers 424 ``Backend error``): the server's fault or one
input's alike; bisection and control requests tell which."""


def replica_suspect(exc: BaseException) -> bool:
    """A failure the replica may have caused rather than the batch: worth one resend on
    another replica before anything else (connection errors and drops, timeouts, 5xx)."""
    if isinstance(exc, ServerError):
        return True
    return isinstance(exc, TransportError) and classify(exc) in ("outage", "transient")


def maybe_input(exc: BaseException) -> bool:
    """A failure of a multi-text batch that one of its inputs may have caused."""
    if isinstance(exc, BatchTooLargeError):
        return False
    if isinstance(exc, ServerError):
        return exc.status in BACKEND_STATUS
    if isinstance(exc, ContextLengthError):
        return True
    if isinstance(exc, BadRequestError):
        # a 400 naming a position in the request is that input's; others are the
        # request's own (a wrong model name, a bad parameter): not bisected
        return SERVER_POSITION.search(exc.message) is not None
    if isinstance(exc, TransportError):
        return isinstance(exc, NetworkError) and exc.sent and not exc.refused and not exc.received
    return False


def input_error(exc: BaseException) -> bool:
    """A failure of a single-text request that belongs to that input."""
    if isinstance(exc, ServerError):
        return exc.status in BACKEND_STATUS
    if isinstance(exc, BadRequestError):
        return True
    if isinstance(exc, ResponseError):
        return exc.index is not None
    return isinstance(exc, NetworkError) and exc.sent and not exc.refused and not exc.received


def ambiguous(exc: BaseException) -> bool:
    """A single input's failure that the server may have caused whatever the input."""
    if isinstance(exc, ServerError | NetworkError):
        return True
    return (
        isinstance(exc, BadRequestError)
        and not isinstance(exc, ContextLengthError | BatchTooLargeError)
        and SERVER_POSITION.search(exc.message) is None
    )


def named_position(exc: QwenEmbedError, count: int) -> int | None:
    """The position (0-based, below ``count``) a 400 names as the bad input, if any."""
    if not isinstance(exc, BadRequestError):
        return None
    match = SERVER_POSITION.search(exc.message)
    if match and int(match.group(1)) < count:
        return int(match.group(1))
    return None
