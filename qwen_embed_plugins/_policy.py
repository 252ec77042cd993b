"""The transport's policy objects: ``Timeouts``, ``Limits`` (one endpoint's pool) and
``RetryConfig``, frozen, keyword-only and hashable like every setting, with the range
checks and ``replace`` that ``EmbeddingConfig`` (``_config``) shares.

Units: every duration is in seconds, every size in connections, as named.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from ._settings import DEFAULT
from .errors import ConfigError

__all__ = ["Limits", "Replaceable", "RetryConfig", "Timeouts", "check_int", "check_range"]


def check_range(
    owner: str, name: str, value: float | None, low: float, high: float, *, allow_none: bool
) -> None:
    """Refuse setting ``owner.name`` unless ``value`` is a number in ``[low, high]``
    (or ``None``, when ``allow_none``).

    Raises:
        ConfigError: naming the setting, its range and ``value``.
    """
    if value is None:
        if not allow_none:
            raise ConfigError(f"{owner}.{name} must be a number in [{low}, {high}], got None")
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{owner}.{name} must be a number in [{low}, {high}], got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"{owner}.{name} must be in [{low}, {high}], got {value!r}")


def check_int(owner: str, name: str, value: object, low: int, high: int) -> None:
    """Refuse setting ``owner.name`` unless ``value`` is an integer in ``[low, high]``.

    Raises:
        ConfigError: naming the setting, its range and ``value``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{owner}.{name} must be an integer in [{low}, {high}], got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"{owner}.{name} must be in [{low}, {high}], got {value!r}")


_T = TypeVar("_T")


class Replaceable:
    """The ``replace`` of every frozen settings dataclass."""

    def replace(self: _T, **changes: Any) -> _T:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeouts(Replaceable):
    """Timeouts in seconds; ``None`` disables one.

    Attributes:
        connect: TCP + TLS connection set-up (default 5.0 s).
        read: the longest wait for response bytes (default 60.0 s: a large batch on a
            busy GPU can take tens of seconds).
        write: sending the request body (default 30.0 s).
        pool: waiting for a free pooled connection (default 60.0 s).
        total: one HTTP exchange in all, from the first connection attempt to the last
            response byte (default 120.0 s). Bounds a response that trickles in just
            fast enough to beat ``read`` (a slow-drip body); the call's own deadline
            (``RetryConfig``) bounds it further.
    """

    connect: float | None = DEFAULT["connect_timeout"]
    read: float | None = DEFAULT["read_timeout"]
    write: float | None = DEFAULT["write_timeout"]
    pool: float | None = DEFAULT["pool_timeout"]
    total: float | None = DEFAULT["total_timeout"]

    def __post_init__(self) -> None:
        for name in ("connect", "read", "write", "pool", "total"):
            check_range("Timeouts", name, getattr(self, name), 0.001, 86400.0, allow_none=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits(Replaceable):
    """Connection pool limits of one endpoint (of each replica, with several).

    A pool is shared by every client and adapter with equal transport settings. The
    sync pool is one per process (all threads); an async connection belongs to one
    event loop, so each running loop has its own async pool.

    Attributes:
        max_connections: most TCP connections open at once per pool (default 20
            connections): process-wide for the sync pool, per event loop for async ones.
        max_connections_per_process: most requests in flight to the endpoint from the
            whole process at once, over every pool (the sync one and every event
            loop's), or ``None`` for no process-wide cap (default). Over HTTP/1.1 one
            request holds one connection, so this also caps connections in use at once;
            a request beyond it waits (at most ``Timeouts.pool`` s, then
            ``PoolTimeout``).
        max_keepalive_connections: most idle connections kept for reuse (default
            ``None`` = ``max_connections``).
        keepalive_expiry: seconds an idle connection is kept (default 4.0 s). Keep it
            BELOW the server's idle timeout: uvicorn-based servers (SGLang, vLLM,
            Infinity) and llama.cpp close idle connections after 5 s, and a client that
            reuses a socket the server just closed gets "Server disconnected without
            sending a response".
    """

    max_connections: int = DEFAULT["max_connections"]
    max_keepalive_connections: int | None = DEFAULT["max_keepalive_connections"]
    keepalive_expiry: float = DEFAULT["keepalive_expiry"]
    max_connections_per_process: int | None = DEFAULT["max_connections_per_process"]

    def __post_init__(self) -> None:
        check_int("Limits", "max_connections", self.max_connections, 1, 10_000)
        if self.max_connections_per_process is not None:
            check_int(
                "Limits",
                "max_connections_per_process",
                self.max_connections_per_process,
                1,
                100_000,
            )
        if self.max_keepalive_connections is not None:
            check_int(
                "Limits",
                "max_keepalive_connections",
                self.max_keepalive_connections,
                0,
                self.max_connections,
            )
        check_range(
            "Limits", "keepalive_expiry", self.keepalive_expiry, 0.0, 3600.0, allow_none=False
        )

    @property
    def keepalive_connections(self) -> int:
        """``max_keepalive_connections`` with its default applied (connections)."""
        if self.max_keepalive_connections is None:
            return self.max_connections
        return self.max_keepalive_connections


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryConfig(Replaceable):
    """The one retry layer's policy (the openai SDK's own retries are always off).

    Two budgets. An *outage* (connection refused or timed out, 502/503/504, 429) is
    retried with capped exponential backoff until the call's deadline, so a server
    restart or a rate-limit window shorter than the deadline costs time, not the run
    (while a replica is down, one request at a time probes it: ``_balance``).
    Other retryable failures (500, a connection dropped after the request was sent, a
    read timeout) get at most ``max_attempts`` attempts. An explicit ``max_retries``
    replaces both: every request gets at most that many retries, whatever the cause.

    Attributes:
        max_retries: retries per request after its first attempt whatever the cause,
            outages included (``None``, the default: ``max_attempts`` for failures
            that are not outages, the deadline for outages; 0 = never retry).
        max_attempts: attempts per request for failures that are not outages, the
            first included (default 4; 1 = never retry, outages included).
        backoff_initial: the first backoff cap in seconds (default 0.25 s); the cap
            doubles each attempt and the wait is drawn uniformly in [0, cap] (full jitter).
        backoff_max: the largest backoff cap in seconds (default 8.0 s).
        retry_after_max: the longest ``Retry-After`` honoured, in seconds (default 30 s);
            a longer one is cut to this.
        deadline: seconds one bulk call (``embed_documents``, a batch) may take in all,
            retries and waits included (default 300 s; ``None`` = no deadline).
        query_deadline: the same for ``embed_query`` and other single-query calls,
            which are interactive (default 15 s; ``None`` = no deadline).
        circuit_failure_threshold: consecutive health failures (connect errors,
            timeouts, 502/503/504) that open the endpoint's (or replica's) circuit
            breaker (default 8; 0 disables the breaker).
        circuit_cooldown: seconds the breaker stays open before a probe (default 10 s);
            with several replicas, how long a failing replica is ejected.
        circuit_open_after: the breaker opens (new calls fail fast) only when the
            failures have also lasted this long (default 10 s): a restart shorter than
            this never fails a call that the deadline would have carried through.
        wait_for_server: seconds a call keeps retrying connection failures (refused,
            DNS, connect timeout, TLS handshake) while no replica of the endpoint has
            answered in this process (default 2 s): a wrong URL or a server that is not
            up fails fast (``ConnectError`` naming the URL). Raise it for a job started
            before its server (like gRPC's ``wait_for_ready``); the call's deadline still
            bounds it. Once a replica has answered, an outage gets the whole deadline.
    """

    max_retries: int | None = DEFAULT["max_retries"]
    max_attempts: int = 4  # the first attempt and the retries
    backoff_initial: float = 0.25
    backoff_max: float = 8.0
    retry_after_max: float = 30.0
    deadline: float | None = DEFAULT["deadline"]
    query_deadline: float | None = DEFAULT["query_deadline"]
    circuit_failure_threshold: int = 8
    circuit_cooldown: float = 10.0
    circuit_open_after: float = 10.0
    wait_for_server: float = 2.0

    def __post_init__(self) -> None:
        check_int("RetryConfig", "max_attempts", self.max_attempts, 1, 100)
        if self.max_retries is not None:
            check_int("RetryConfig", "max_retries", self.max_retries, 0, 99)
        check_int(
            "RetryConfig", "circuit_failure_threshold", self.circuit_failure_threshold, 0, 1_000_000
        )
        for name, low, high in _RETRY_SECONDS:
            value = getattr(self, name)
            allow_none = name in ("deadline", "query_deadline")
            check_range("RetryConfig", name, value, low, high, allow_none=allow_none)


_RETRY_SECONDS: Final = (
    ("wait_for_server", 0.0, 86400.0),
    ("backoff_initial", 0.0, 600.0),
    ("backoff_max", 0.0, 3600.0),
    ("retry_after_max", 0.0, 3600.0),
    ("deadline", 0.001, 86400.0),
    ("query_deadline", 0.001, 86400.0),
    ("circuit_cooldown", 0.0, 3600.0),
    ("circuit_open_after", 0.0, 86400.0),
)
"""``RetryConfig``'s durations and their ranges, in seconds (``ConfigError`` outside)."""
