"""The one retry layer: pure policy (what to retry, how long to wait, what counts as ill
health). The engine (``_engine``) drives it with ``RetryState``; the breaker that hears
the health signals is ``balance``'s (per replica).

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
  a lower ``last_stream_id``, ``REFUSED_STREAM``): never processed, so always resent
  and never counted as a failure: at once (``MAX_REFUSED_RESENDS`` per request), then
  with the outage backoff until the call's deadline.
- ``"fatal"``: everything else (400, 401, 403, 404, 413, 422, a context-length error,
  a malformed 200, a local ``PoolTimeout``, a TLS certificate failure): not retried.

An explicit ``RetryConfig.max_retries`` (the flat ``max_retries``) bounds every request
to that many retries whatever the kind (outages and refused streams included); left
``None``, the budgets above apply. ``RetryState.ended_by`` says which bound ended the
retries (``ended``: the words an error adds).

Only endpoint ill health feeds the circuit breaker (``balance``) (``is_health_failure``): connect
errors and timeouts, read timeouts with no response, 502/503/504. Never 4xx, 429 (back
off instead), a local ``PoolTimeout``, a refused stream, or a 500 (one input's fault as
often as the server's; bisection tells which).

Whose fault a failure may be (``maybe_input``, ``refusal``, ``input_error``,
``ambiguous``, ``named_position``, ``replica_suspect``) is decided here too: the engine
bisects, resends or blames an input on these answers.

Clock and random source are parameters, so the maths is tested without waiting.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from ._config import RetryConfig
from .errors import (
    SERVER_POSITION,
    BadRequestError,
    BatchTooLargeError,
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
    "FailureKind",
    "RetryState",
    "ambiguous",
    "backoff_delay",
    "classify",
    "input_error",
    "is_health_failure",
    "maybe_input",
    "named_position",
    "parse_retry_after",
    "refusal",
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
"""Refused HTTP/2 streams resent at once per request; later ones are resent with the
outage backoff, until the call's deadline (never counted against ``max_attempts``)."""

FailureKind = Literal["outage", "transient", "refused", "fatal"]


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
        failures: failed attempts of every kind (what ``policy.max_retries`` bounds).
        ended_by: the bound that ended the retries (``"max_retries"``,
            ``"max_attempts"``, ``"deadline"``), ``None`` while they go on or when the
            failure was not retryable.
        counted: what the last retried failure counts against: ``"attempts"``
            (``max_attempts``), ``"deadline"`` (an outage) or ``None`` (none yet).
    """

    policy: RetryConfig
    started: float
    deadline: float | None = field(default=None)
    attempts: int = 0
    outages: int = 0
    refused: int = 0
    stale_resent: bool = False
    failures: int = 0
    ended_by: str | None = None
    counted: str | None = None

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
        self.failures += 1
        bound = self.policy.max_retries
        if bound is not None and self.failures > bound:
            self.ended_by = "max_retries"  # an explicit bound: whatever the kind
            return None
        if self.policy.max_attempts <= 1 and kind != "refused":
            self.ended_by = "max_attempts"
            return None  # retries turned off, outages included
        if kind == "refused":
            # never processed: resending is always safe and is no failed attempt
            self.refused += 1
            if self.refused <= MAX_REFUSED_RESENDS:
                return 0.0
            kind = "outage"  # a server refusing on and on: backed off, until the deadline
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
            self.counted = "deadline"
            retry = self.outages - 1
        else:
            self.attempts += 1
            self.counted = "attempts"
            if self.attempts >= self.policy.max_attempts:
                self.ended_by = "max_attempts"
                return None
            retry = self.attempts - 1
        delay = backoff_delay(retry, self.policy, rng)
        server_wait = exc.retry_after if isinstance(exc, HTTPStatusError) else None
        if server_wait is not None and server_wait > 0.0:
            # the server's wait lengthens the backoff, never shortens it
            delay = max(delay, min(server_wait, self.policy.retry_after_max))
        left = self.remaining(now)
        if left is not None and delay + MIN_ATTEMPT_SECONDS >= left:
            self.ended_by = "deadline"
            return None  # no time left for an attempt after the wait
        return delay

    def ended(self) -> str:
        """Words saying which bound ended the retries (``""``: none did), for an error."""
        policy = self.policy
        if self.ended_by == "max_retries":
            return f" (gave up after {_attempts(self.failures)}: max_retries={policy.max_retries})"
        if self.ended_by == "max_attempts":
            return (
                f" (gave up after {_attempts(self.attempts)}: "
                f"RetryConfig.max_attempts={policy.max_attempts})"
            )
        if self.ended_by == "deadline" and self.deadline is not None:
            return f" (gave up: the call's deadline of {self.deadline:g} s is spent)"
        return ""

    def bound(self) -> str:
        """What will end these retries when a count does, for the log (``""``: the
        deadline only, as for an outage)."""
        if self.policy.max_retries is not None:
            n = self.policy.max_retries
            return f"at most {n} {'time' if n == 1 else 'times'} (max_retries)"
        if self.counted == "attempts":
            n = self.policy.max_attempts
            return f"within {_attempts(n)} in all (RetryConfig.max_attempts)"
        return ""


def _attempts(n: int) -> str:
    """``"1 attempt"``, ``"3 attempts"``."""
    return f"{n} attempt" if n == 1 else f"{n} attempts"


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


NOT_REFUSALS = frozenset({401, 403, 404, 407, 408, 429})
"""4xx statuses that say nothing about a request's content: the key, the URL or model,
a proxy's credentials, a timeout, a rate limit."""


def refusal(exc: BaseException) -> bool:
    """The server refused the request for what it holds, whatever its wording: a 4xx
    (400, 413, 422, ...; not ``NOT_REFUSALS``), or a 2xx answer that does not fit the
    request and names no input (a count mismatch, no ``data``; never an answer over the
    size cap: ``ResponseError.max_bytes``). For a batch of several
    texts the engine splits it (once a control request shows the server working); for
    one text it is that input's error."""
    if isinstance(exc, HTTPStatusError):
        return 400 <= exc.status < 500 and exc.status not in NOT_REFUSALS
    return isinstance(exc, ResponseError) and exc.index is None and exc.max_bytes is None


def input_error(exc: BaseException) -> bool:
    """A failure of a single-text request that belongs to that input."""
    if isinstance(exc, ServerError):
        return exc.status in BACKEND_STATUS
    if isinstance(exc, BadRequestError) or (isinstance(exc, HTTPStatusError) and refusal(exc)):
        return True
    if isinstance(exc, ResponseError):
        # an answer naming no input: that text's, once a control request works; never
        # one over the size cap (the server's fault whatever the input)
        return exc.max_bytes is None
    return isinstance(exc, NetworkError) and exc.sent and not exc.refused and not exc.received


def ambiguous(exc: BaseException) -> bool:
    """A single input's failure that the server may have caused whatever the input."""
    if isinstance(exc, ServerError | NetworkError) or (
        isinstance(exc, ResponseError) and exc.index is None
    ):
        return True
    return (
        isinstance(exc, HTTPStatusError)
        and refusal(exc)
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
