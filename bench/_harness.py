"""Measurement core of ``bench/compare.py`` and ``bench/transports.py`` (not a public API).

- Client CPU is ``getrusage(RUSAGE_SELF)`` user + system time of THIS process (every
  thread of it) around the measured loop only; the server and the relay run in child
  processes, so their CPU is not counted.
- Variants run in interleaved rounds: round ``r`` runs every variant once, in an order
  rotated by ``r`` (A B C, B C A, C A B, ...), so a burst of load from the other agents
  on this 2-core machine hits every variant alike. Tables show medians over rounds.
- Each request's latency is recorded (``perf_counter`` around the awaited call).
"""

from __future__ import annotations

import asyncio
import gc
import importlib.metadata
import itertools
import os
import platform
import re
import resource
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


# ---------------------------------------------------------------------------- numbers


def cpu_seconds() -> float:
    """User + system CPU seconds used so far by this process (all threads)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, MiB (``ru_maxrss``)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024.0 if sys.platform != "darwin" else kib / (1024.0 * 1024.0)


def median(values: Iterable[float]) -> float:
    vals = [v for v in values if v is not None and v == v]
    return float(statistics.median(vals)) if vals else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def rotated(items: Sequence[T], r: int) -> list[T]:
    """``items`` rotated left by ``r`` (the order of round ``r``)."""
    if not items:
        return []
    k = r % len(items)
    return [*items[k:], *items[:k]]


@dataclass
class Sample:
    """One measured loop: ``count`` requests carrying ``texts`` texts."""

    count: int
    texts: int
    wall: float
    cpu: float
    latencies: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, float]:
        lat = [x * 1000.0 for x in self.latencies]
        return {
            "requests": self.count,
            "texts": self.texts,
            "wall_s": self.wall,
            "cpu_s": self.cpu,
            "cpu_us_per_request": self.cpu * 1e6 / self.count,
            "cpu_us_per_text": self.cpu * 1e6 / self.texts,
            "req_per_s": self.count / self.wall,
            "texts_per_s": self.texts / self.wall,
            "p50_ms": percentile(lat, 50),
            "p95_ms": percentile(lat, 95),
            "p99_ms": percentile(lat, 99),
        }


def summarise(samples: Sequence[dict[str, float]]) -> dict[str, float]:
    """Median of every numeric field over rounds."""
    if not samples:
        return {}
    keys = [k for k, v in samples[0].items() if isinstance(v, int | float)]
    return {k: median(s[k] for s in samples) for k in keys}


# ---------------------------------------------------------------------------- loops


def run_sync(
    call: Callable[[T], Any],
    items: Sequence[T],
    concurrency: int = 1,
    *,
    texts_per_item: int = 1,
    collect: bool = True,
) -> Sample:
    """Call ``call(item)`` for every item, ``concurrency`` threads pulling from one queue
    (``collect``: run the garbage collector first, outside the measurement)."""
    n = len(items)
    latencies: list[float] = []
    if collect:
        gc.collect()
    if concurrency <= 1:
        perf = time.perf_counter
        cpu0, wall0 = cpu_seconds(), perf()
        for item in items:
            t0 = perf()
            call(item)
            latencies.append(perf() - t0)
        wall, cpu = perf() - wall0, cpu_seconds() - cpu0
        return Sample(n, n * texts_per_item, wall, cpu, latencies)
    counter = itertools.count()
    lock = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Event()

    def worker() -> None:
        mine: list[float] = []
        perf = time.perf_counter
        start.wait()
        try:
            while (i := next(counter)) < n:
                t0 = perf()
                call(items[i])
                mine.append(perf() - t0)
        except BaseException as exc:
            errors.append(exc)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for th in threads:
        th.start()
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    start.set()
    for th in threads:
        th.join()
    wall, cpu = time.perf_counter() - wall0, cpu_seconds() - cpu0
    if errors:
        raise errors[0]
    return Sample(n, n * texts_per_item, wall, cpu, latencies)


async def run_async(
    call: Callable[[T], Awaitable[Any]],
    items: Sequence[T],
    concurrency: int = 1,
    *,
    texts_per_item: int = 1,
    collect: bool = True,
) -> Sample:
    """Await ``call(item)`` for every item, ``concurrency`` tasks pulling from one queue
    (``collect``: run the garbage collector first, outside the measurement)."""
    n = len(items)
    latencies: list[float] = []
    counter = itertools.count()
    perf = time.perf_counter

    async def worker() -> None:
        while (i := next(counter)) < n:
            t0 = perf()
            await call(items[i])
            latencies.append(perf() - t0)

    if collect:
        gc.collect()
    cpu0, wall0 = cpu_seconds(), perf()
    if concurrency <= 1:
        await worker()
    else:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = perf() - wall0, cpu_seconds() - cpu0
    return Sample(n, n * texts_per_item, wall, cpu, latencies)


# ---------------------------------------------------------------------------- environment


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """What the numbers were measured on (versions, CPUs, load)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    dists = (
        "qwen-embed-plugins",
        "openai",
        "httpx",
        "httpx2",
        "httpcore2",
        "aiohttp",
        "httpx-aiohttp",
        "urllib3",
        "numpy",
        "orjson",
        "langchain-openai",
        "llama-index-core",
        "llama-index-embeddings-openai-like",
        "uvicorn",
    )
    return {
        "python": platform.python_version(),
        "versions": {d: _version(d) for d in dists},
        "cpus": os.cpu_count(),
        "load_avg_at_start": [round(x, 2) for x in load] if load else None,
        "platform": platform.platform(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def command_line() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]])


# ---------------------------------------------------------------------------- tables


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        if value != value:
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as ``"1.23x"`` (``-`` when either is missing)."""
    if a is None or b is None or b == 0 or a != a or b != b:
        return "-"
    return f"{a / b:.2f}x"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    body = [[fmt(v) for v in row] for row in rows]
    numeric = re.compile(r"^[-+]?[\d,.]+(x| MiB| us| ms)?$|^-$")
    align = [
        "---:" if body and all(numeric.match(r[i]) for r in body) else "---"
        for i in range(len(headers))
    ]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)
