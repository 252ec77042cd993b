"""Per-endpoint counters and latency histograms, and their ``stats()`` snapshot.

One ``EndpointMetrics`` per endpoint label (scheme://host:port/path, never
credentials), shared by every client, adapter and pool entry of that endpoint in the
process. Updates are lock-guarded and cost well under a microsecond each.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from typing import Any

from ._state import STATE

__all__ = [
    "LATENCY_BUCKETS",
    "EndpointMetrics",
    "metrics_for",
    "register_group",
    "reset_metrics",
    "stats",
]

LATENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Upper bounds (seconds) of the request latency histogram buckets (+Inf implied)."""

BATCH_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
"""Upper bounds (texts) of the batch size histogram buckets (+Inf implied)."""


class _Histogram:
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        cumulative = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            cumulative.append((bound, running))
        return {"buckets": cumulative, "sum": self.sum, "count": self.count}


class EndpointMetrics:
    """Counters of one endpoint.

    Attributes (read them through ``snapshot()``):
        requests: HTTP requests by outcome (``"ok"``, or the error class name).
        texts: texts embedded successfully.
        retries: retries by reason (``status_429``, ``disconnected``, ``readtimeout``...).
        stale_retries: requests resent at once after a reused idle connection was
            closed by the server.
        connections_opened: TCP connections actually opened (counted from the HTTP
            library's connection events, not estimated).
        in_flight: requests on the wire now.
        latency: request latency histogram (seconds).
        batch_size: texts-per-request histogram.
        fallbacks: one-off adaptations (``float_encoding``, ``client_side_dimensions``,
            ``batch_limit``, ``h2c_to_http1``).
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.retries: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self.texts = 0
        self.stale_retries = 0
        self.connections_opened = 0
        self.in_flight = 0
        self.latency = _Histogram(LATENCY_BUCKETS)
        self.batch_size = _Histogram(BATCH_BUCKETS)

    def reset(self) -> None:
        """Zero every counter except ``in_flight`` (requests still on the wire)."""
        with self._lock:
            self.requests.clear()
            self.retries.clear()
            self.fallbacks.clear()
            self.texts = self.stale_retries = self.connections_opened = 0
            self.latency = _Histogram(LATENCY_BUCKETS)
            self.batch_size = _Histogram(BATCH_BUCKETS)

    def after_fork_in_child(self) -> None:
        """In a forked child: a lock held by another thread at fork time would stay
        locked forever; the parent's requests are not in flight here."""
        self._lock = threading.Lock()
        self.in_flight = 0

    def connection_opened(self) -> None:
        with self._lock:
            self.connections_opened += 1

    def request_started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def request_finished(self, outcome: str, seconds: float, texts: int) -> None:
        """Record one HTTP exchange: ``outcome`` is ``"ok"`` or an error class name."""
        with self._lock:
            self.in_flight -= 1
            self.requests[outcome] += 1
            self.latency.observe(seconds)
            self.batch_size.observe(texts)
            if outcome == "ok":
                self.texts += texts

    def retry(self, reason: str, *, stale: bool = False) -> None:
        with self._lock:
            self.retries[reason] += 1
            if stale:
                self.stale_retries += 1

    def fallback(self, kind: str) -> None:
        with self._lock:
            self.fallbacks[kind] += 1

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of every counter (plain dicts and numbers)."""
        with self._lock:
            return {
                "requests": sum(self.requests.values()),
                "requests_by_outcome": dict(self.requests),
                "texts": self.texts,
                "retries": sum(self.retries.values()),
                "retries_by_reason": dict(self.retries),
                "stale_retries": self.stale_retries,
                "connections_opened": self.connections_opened,
                "in_flight": self.in_flight,
                "fallbacks": dict(self.fallbacks),
                "latency_seconds": self.latency.snapshot(),
                "batch_size": self.batch_size.snapshot(),
            }


def metrics_for(label: str) -> EndpointMetrics:
    """The process-wide ``EndpointMetrics`` of an endpoint label (made on first use;
    ``STATE.metrics``)."""
    found: EndpointMetrics | None = STATE.metrics.get(label)
    if found is not None:
        return found
    with STATE.lock:
        found = STATE.metrics.get(label)
        if found is None:
            found = STATE.metrics[label] = EndpointMetrics(label)
        return found


def register_group(label: str, members: tuple[str, ...]) -> None:
    """Report ``label`` (an endpoint of several replicas) in ``stats()`` as the total of
    its ``members``' rows (their replica labels)."""
    with STATE.lock:
        STATE.groups[label] = members


def _merge(snaps: list[dict[str, Any]]) -> dict[str, Any]:
    """The total of several snapshots (counters and histograms added up)."""
    out: dict[str, Any] = {}
    for snap in snaps:
        for name, value in snap.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[name] = out.get(name, 0) + value
            elif isinstance(value, dict) and "buckets" in value:
                got = out.get(name)
                if got is None:
                    out[name] = {
                        "buckets": list(value["buckets"]),
                        "sum": value["sum"],
                        "count": value["count"],
                    }
                else:
                    got["buckets"] = [
                        (b, n + m)
                        for (b, n), (_, m) in zip(got["buckets"], value["buckets"], strict=True)
                    ]
                    got["sum"] += value["sum"]
                    got["count"] += value["count"]
            elif isinstance(value, dict):
                merged = out.setdefault(name, {})
                for key, n in value.items():
                    merged[key] = merged.get(key, 0) + n
    return out


def stats() -> dict[str, dict[str, Any]]:
    """Snapshot of every endpoint's metrics, keyed by endpoint label: one row per server
    (replica), plus, for an endpoint of several replicas, a row labelled with their
    comma-separated labels holding the endpoint's totals (``"replicas"`` lists them)."""
    with STATE.lock:
        items: list[tuple[str, EndpointMetrics]] = list(STATE.metrics.items())
        groups: dict[str, tuple[str, ...]] = dict(STATE.groups)
    out = {label: m.snapshot() for label, m in items}
    for label, members in groups.items():
        rows = [out[m] for m in members if m in out]
        if rows:
            total = _merge(rows)
            total["replicas"] = list(members)
            out[label] = total
    return out


def reset_metrics() -> None:
    """Zero every endpoint's counters (for tests and benchmarks measuring one phase)."""
    with STATE.lock:
        items: list[EndpointMetrics] = list(STATE.metrics.values())
    for m in items:
        m.reset()


def prometheus_collector() -> Any:
    """A ``prometheus_client`` collector exporting every endpoint's metrics.

    Register it once: ``prometheus_client.REGISTRY.register(prometheus_collector())``.
    Names follow Prometheus conventions (``qwen_embed_requests_total``,
    ``qwen_embed_request_duration_seconds``, ...); the only label is ``endpoint``
    (scheme://host:port/path: never credentials or query strings), plus ``outcome`` /
    ``reason`` / ``kind`` where counted by them.

    Raises:
        ImportError: ``prometheus_client`` is missing (the ``prometheus`` extra; the
            message names the pip command).
    """
    try:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )
        from prometheus_client.registry import Collector
    except ImportError as exc:  # pragma: no cover - exercised without the extra
        from ._install import install_command as _install_command

        raise ImportError(
            f"Prometheus export needs prometheus-client: {_install_command('prometheus')}"
        ) from exc

    def histogram(name: str, doc: str, snaps: dict[str, dict[str, Any]], key: str) -> Any:
        family = HistogramMetricFamily(name, doc, labels=["endpoint"])
        for label, snap in snaps.items():
            h = snap[key]
            buckets = [
                ("+Inf" if b == float("inf") else repr(float(b)), n) for b, n in h["buckets"]
            ]
            family.add_metric([label], buckets, h["sum"])
        return family

    class _Collector(Collector):
        def collect(self) -> Any:
            snaps = stats()
            requests = CounterMetricFamily(
                "qwen_embed_requests",
                "Embedding HTTP requests by outcome.",
                labels=["endpoint", "outcome"],
            )
            texts = CounterMetricFamily(
                "qwen_embed_texts", "Texts embedded successfully.", labels=["endpoint"]
            )
            retries = CounterMetricFamily(
                "qwen_embed_retries", "Retried requests by reason.", labels=["endpoint", "reason"]
            )
            conns = CounterMetricFamily(
                "qwen_embed_connections_opened", "TCP connections opened.", labels=["endpoint"]
            )
            fallbacks = CounterMetricFamily(
                "qwen_embed_fallbacks",
                "One-off adaptations to the server.",
                labels=["endpoint", "kind"],
            )
            in_flight = GaugeMetricFamily(
                "qwen_embed_in_flight_requests", "Requests on the wire now.", labels=["endpoint"]
            )
            for label, snap in snaps.items():
                for outcome, n in snap["requests_by_outcome"].items():
                    requests.add_metric([label, outcome], n)
                texts.add_metric([label], snap["texts"])
                for reason, n in snap["retries_by_reason"].items():
                    retries.add_metric([label, reason], n)
                conns.add_metric([label], snap["connections_opened"])
                for kind, n in snap["fallbacks"].items():
                    fallbacks.add_metric([label, kind], n)
                in_flight.add_metric([label], snap["in_flight"])
            yield from (requests, texts, retries, conns, fallbacks, in_flight)
            yield histogram(
                "qwen_embed_request_duration_seconds",
                "Embedding request latency in seconds.",
                snaps,
                "latency_seconds",
            )
            yield histogram(
                "qwen_embed_batch_size_texts", "Texts per request.", snaps, "batch_size"
            )

    return _Collector()
