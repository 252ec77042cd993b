"""The one retry layer: pure policy, a circuit breaker, and thin sync/async drivers.

The openai SDK's own retries are always off (``max_retries=0``), so an embedding request
is attempted at most ``RetryConfig.max_attempts`` times in all.

Retried (embedding requests are idempotent):
- connection failures and timeouts (connect, read, write, pool);
- a request cut on a reused keep-alive connection before any response byte ("Server
  disconnected without sending a response"): resent once at once on a fresh
  connection, then with backoff;
- HTTP 408, 429, 500, 502, 503, 504 (and HTTP/2 GOAWAY, which surfaces as a
  connection error).

Never retried: 400, 401, 403, 404, 413, 422, context-length errors and bad vectors
(NaN, all zeros): the same request would fail the same way.

Waits use capped exponential backoff with full jitter (``uniform(0, min(max,
initial * 2**retry))``), or the server's ``Retry-After`` / ``retry-after-ms`` up to
``RetryConfig.retry_after_max``. Sleep, clock and random source are injectable, so the
maths is tested without waiting.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from .config import RetryConfig
from .errors import (
    CircuitOpenError,
    NetworkError,
    QwenEmbedError,
    HTTPStatusError,
    TimeoutException,
    TransportError,
)

__all__ = [
    "RETRYABLE_STATUS",
    "CircuitBreaker",
    "RetryState",
    "acall_with_retry",
    "backoff_delay",
    "call_with_retry",
    "parse_retry_after",
    "retry_reason",
]

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})

T = TypeVar("T")


def parse_retry_after(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """Seconds to wait according to ``retry-after-ms`` or ``Retry-After``.

    ``Retry-After`` may be a number of seconds or an HTTP date (RFC 9110 10.2.3);
    ``retry-after-ms`` (milliseconds) is what OpenAI-style servers send. Returns ``None``
    when neither is present or parseable; never a negative number.

    Args:
        headers: response headers (case-insensitive mapping, or lower-case keys).
        now: the current UNIX time in seconds, for HTTP dates (default ``time.time()``).
    """
    raw_ms = headers.get("retry-after-ms")
    if raw_ms:
        try:
            return max(0.0, float(raw_ms) / 1000.0)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if not raw:
        return None
    raw = raw.strip()
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    current = time.time() if now is None else now
    return max(0.0, when.timestamp() - current)


def retry_reason(exc: BaseException) -> str | None:
    """Why ``exc`` is worth retrying (a short label for metrics), or ``None`` if not."""
    if isinstance(exc, HTTPStatusError):
        return f"status_{exc.status}" if exc.status in RETRYABLE_STATUS else None
    if isinstance(exc, TimeoutException):
        return type(exc).__name__.lower()
    if isinstance(exc, NetworkError):
        return "disconnected"
    if isinstance(exc, TransportError):
        return "connect_error"
    return None


def backoff_delay(retry: int, policy: RetryConfig, rng: random.Random | None = None) -> float:
    """Full-jitter backoff before retry number ``retry`` (0-based), in seconds."""
    cap = min(policy.backoff_max, policy.backoff_initial * (2.0**retry))
    return (rng or random).uniform(0.0, cap)


@dataclass
class RetryState:
    """The running state of one call's retries (attempts made, time spent)."""

    policy: RetryConfig
    started: float
    attempts: int = 0
    stale_resent: bool = False

    def next_delay(
        self,
        exc: BaseException,
        *,
        now: float,
        fresh_connection: bool,
        rng: random.Random | None = None,
    ) -> float | None:
        """Seconds to wait before the next attempt, or ``None`` to give up.

        Args:
            exc: what the last attempt raised.
            now: the monotonic clock now, in seconds.
            fresh_connection: whether the failed attempt opened its own connection
                (``False`` = it ran on a reused keep-alive connection).
            rng: random source for the jitter.
        """
        if retry_reason(exc) is None or self.attempts >= self.policy.max_attempts:
            return None
        if isinstance(exc, NetworkError) and not fresh_connection and not self.stale_resent:
            # The server closed an idle keep-alive connection as we reused it: resend
            # once, at once, on a fresh connection (embeddings are idempotent).
            self.stale_resent = True
            return 0.0
        server_wait = exc.retry_after if isinstance(exc, HTTPStatusError) else None
        if server_wait is not None:
            delay = min(server_wait, self.policy.retry_after_max)
        else:
            delay = backoff_delay(self.attempts - 1, self.policy, rng)
        deadline = self.policy.deadline
        if deadline is not None and (now - self.started) + delay > deadline:
            return None
        return delay


class CircuitBreaker:
    """A per-endpoint circuit breaker.

    Closed: calls pass. After ``threshold`` consecutive failed requests it opens: calls
    fail at once with ``CircuitOpenError`` for ``cooldown`` seconds. Then one probe
    request is let through (half-open): success closes the breaker, failure opens it for
    another cooldown. ``threshold=0`` disables it. Thread-safe; clock injectable.
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

    def after_fork(self) -> None:
        """In a forked child: a new lock (the parent's may have been held at fork time)."""
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"half-open"``."""
        with self._lock:
            if self._opened_at is None:
                return "closed"
            if self._clock() - self._opened_at >= self.cooldown:
                return "half-open"
            return "open"

    def before_request(self) -> None:
        """Raise ``CircuitOpenError`` if requests may not be sent now."""
        if self.threshold <= 0:
            return
        with self._lock:
            if self._opened_at is None:
                return
            waited = self._clock() - self._opened_at
            if waited >= self.cooldown and not self._probing:
                self._probing = True  # this caller is the probe
                return
            retry_in = max(0.0, self.cooldown - waited)
        raise CircuitOpenError(
            f"circuit open for {self.label}: {self._failures} consecutive failed requests; "
            f"failing fast, next probe in {retry_in:.1f} s",
            url=self.label,
            retry_in=retry_in,
        )

    def record_success(self) -> None:
        """A request got an HTTP response that is not a server failure."""
        with self._lock:
            self._failures = 0
            self._opened_at = None
            self._probing = False

    def record_failure(self) -> None:
        """A request failed with a retryable error (connection, timeout, 5xx, 429)."""
        if self.threshold <= 0:
            return
        with self._lock:
            self._failures += 1
            if self._probing or self._failures >= self.threshold:
                self._opened_at = self._clock()
            self._probing = False


def _after_failure(
    exc: QwenEmbedError,
    state: RetryState,
    breaker: CircuitBreaker | None,
    on_retry: Callable[[BaseException, float], None] | None,
    fresh_connection: bool,
    now: float,
    rng: random.Random | None,
) -> float | None:
    """Shared by both drivers: update the breaker, decide the wait (``None``: give up)."""
    if breaker is not None:
        if retry_reason(exc) is not None:
            breaker.record_failure()
        else:
            breaker.record_success()
    delay = state.next_delay(exc, now=now, fresh_connection=fresh_connection, rng=rng)
    if delay is not None and on_retry is not None:
        on_retry(exc, delay)
    return delay


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
) -> T:
    """Run ``attempt()`` until it succeeds or the policy gives up (sync driver).

    Args:
        attempt: one request; raises a ``QwenEmbedError`` on failure.
        policy: the ``RetryConfig``.
        breaker: the endpoint's circuit breaker, consulted before each attempt.
        on_retry: called with ``(error, delay_seconds)`` before each wait.
        fresh_connection: after a failure, whether that attempt opened a new connection.
        sleep, clock, rng: injectable for tests.

    Raises:
        The last attempt's error, or ``CircuitOpenError``.
    """
    state = RetryState(policy=policy, started=clock())
    while True:
        if breaker is not None:
            breaker.before_request()
        state.attempts += 1
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
) -> T:
    """The async twin of ``call_with_retry``; differs only in awaiting."""
    state = RetryState(policy=policy, started=clock())
    while True:
        if breaker is not None:
            breaker.before_request()
        state.attempts += 1
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
