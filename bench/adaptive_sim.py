"""Discrete-event simulation of adaptive vs static concurrency against three server models.

A SIMULATION (virtual time, no sockets): it drives the real
``qwen_embed_plugins._adaptive.ConcurrencyLimit`` with an injected clock, through a gate
that mirrors ``AdaptiveGate`` (FIFO, capacity = the limit, overload answers hold their
slot for ``min_rtt``), and a client that mirrors the library's call engine (one bulk
call, a window of batches, 429 -> Retry-After, 503 -> full-jitter backoff). Used to tune
the algorithm before the real loopback benchmark (bench/adaptive.py).

Server models (parameters as in ``qwen_embed_tooling.testing`` GPULike / RateLimited /
SlowStart):

- gpu: ``slots`` batches at once, each ``base + per_token * tokens`` seconds (x noise),
  FIFO queue, 503 at once past ``queue_limit`` waiting.
- rate: a token bucket (``rate`` req/s, burst = rate) in front of a gpu server with
  plenty of slots; 429 with Retry-After = ceil(time to next token), at least 1 s.
- slow_start: gpu whose slots grow linearly from 1 to ``slots`` over ``ramp`` seconds.

Run: ``python bench/adaptive_sim.py [--seconds 20] [--seeds 3] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwen_embed_plugins._adaptive import ConcurrencyLimit

BATCH = 16  # texts per request
TOKENS = BATCH * 40  # tokens per request
CLIENT_CPU = 0.0008  # seconds of client CPU per request (single GIL: serialised)
NET = 0.0003  # one-way loopback + HTTP overhead, seconds
MAX_THREADS = 64  # the library's shared executor (sync bulk call)
STATIC = (1, 2, 4, 8, 16, 32)
HOLD_RETRY_AFTER = 1.0


class Sim:
    def __init__(self, seed: int) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.rng = random.Random(seed)

    def at(self, delay: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self.now + max(0.0, delay), self._seq, fn))

    def run(self, until: float) -> None:
        while self._heap and self._heap[0][0] <= until:
            t, _, fn = heapq.heappop(self._heap)
            self.now = t
            fn()
        self.now = until


# ----------------------------------------------------------------------------- servers


@dataclass
class GPU:
    slots: int = 8
    base: float = 0.004
    per_token: float = 0.00002
    queue_limit: int = 16
    ramp: float = 0.0  # slow start: seconds to full capacity (0: none)
    start_slots: int = 1
    rate: float = 0.0  # rate limit in req/s (0: none)
    active: int = 0
    waiting: deque[Callable[[], None]] = field(default_factory=deque)
    tokens: float = 0.0
    stamp: float = 0.0
    overloads: int = 0

    def capacity(self, now: float) -> int:
        if self.ramp <= 0:
            return self.slots
        done = min(1.0, now / self.ramp)
        return max(1, math.floor(self.start_slots + (self.slots - self.start_slots) * done))

    def handle(self, sim: Sim, answer: Callable[[int, float], None]) -> None:
        """``answer(status, retry_after)`` is called when the response leaves."""
        if self.rate > 0:
            size = max(1.0, round(self.rate))
            self.tokens = min(size, self.tokens + (sim.now - self.stamp) * self.rate)
            self.stamp = sim.now
            if self.tokens < 1.0:
                self.overloads += 1
                wait = max(1, math.ceil((1.0 - self.tokens) / self.rate))
                answer(429, float(wait))
                return
            self.tokens -= 1.0

        def start() -> None:
            service = (self.base + self.per_token * TOKENS) * sim.rng.lognormvariate(0.0, 0.08)

            def done() -> None:
                self.active -= 1
                self._wake(sim)
                answer(200, 0.0)

            sim.at(service, done)

        if self.active < self.capacity(sim.now) and not self.waiting:
            self.active += 1
            start()
            return
        if len(self.waiting) >= self.queue_limit:
            self.overloads += 1
            answer(503, 0.0)
            return
        self.waiting.append(start)

    def _wake(self, sim: Sim) -> None:
        while self.waiting and self.active < self.capacity(sim.now):
            self.active += 1
            self.waiting.popleft()()

    def tick(self, sim: Sim) -> None:
        """Slow start: slots appear over time."""
        self._wake(sim)
        if self.ramp > 0 and sim.now < self.ramp:
            sim.at(0.05, lambda: self.tick(sim))


VARIANTS: dict[str, dict[str, Any]] = {
    # other shapes, same algorithm defaults (robustness, not tuning)
    "gpu-4slots": {"kind": "gpu", "slots": 4, "queue_limit": 8},
    "gpu-32slots": {"kind": "gpu", "slots": 32, "queue_limit": 32},
    "gpu-slow": {"kind": "gpu", "slots": 8, "base": 0.15, "queue_limit": 16},
    "rate-20": {"kind": "rate", "rate": 20.0},
    "rate-400": {"kind": "rate", "rate": 400.0},
    "rate-slow": {"kind": "rate", "rate": 10.0, "base": 0.15},
    "slow_start-fast": {"kind": "slow_start", "ramp": 3.0},
    "slow_start-16": {"kind": "slow_start", "slots": 16, "queue_limit": 16},
}


def make_server(kind: str) -> GPU:
    if kind in VARIANTS:
        spec = dict(VARIANTS[kind])
        server = make_server(spec.pop("kind"))
        for name, value in spec.items():
            setattr(server, name, value)
        return server
    if kind == "gpu":
        # 8 slots of ~17 ms; 503 past 16 waiting
        return GPU(slots=8, base=0.004, per_token=0.00002, queue_limit=16)
    if kind == "rate":
        # 100 req/s in front of a 32-slot server of ~17 ms (best: ~2 in flight)
        return GPU(slots=32, base=0.004, per_token=0.00002, queue_limit=64, rate=100.0)
    if kind == "slow_start":
        # 1 -> 8 slots over 10 s, 503 past 8 waiting
        return GPU(slots=8, base=0.004, per_token=0.00002, queue_limit=8, ramp=10.0, start_slots=1)
    raise ValueError(kind)


# ----------------------------------------------------------------------------- client


class SimGate:
    """Mirror of AdaptiveGate in virtual time."""

    def __init__(self, sim: Sim, limit: ConcurrencyLimit | None, static: int | None) -> None:
        self.sim = sim
        self.limit = limit
        self.static = static
        self.used = 0
        self.waiters: deque[Callable[[], None]] = deque()
        self.trace: list[tuple[float, int]] = []

    def cap(self) -> int:
        if self.limit is None:
            assert self.static is not None
            return self.static
        return self.limit.limit

    def acquire(self, then: Callable[[], None]) -> None:
        if self.used < self.cap() and not self.waiters:
            self.used += 1
            then()
        else:
            self.waiters.append(then)

    def _free(self) -> None:
        self.used -= 1
        while self.waiters and self.used < self.cap():
            self.used += 1
            self.waiters.popleft()()

    def release(self, latency: float, overload: bool, retry_after: float = 0.0) -> None:
        if self.limit is not None:
            self.limit.on_sample(latency, self.used, overload, retry_after or None)
            self.trace.append((self.sim.now, self.limit.limit))
            if overload:
                rtt = self.limit.min_rtt
                hold = max(0.05 if rtt is None else rtt, HOLD_RETRY_AFTER * retry_after)
                hold -= latency
                if hold > 0:
                    self.sim.at(hold, self._free)
                    return
        self._free()


class CPU:
    """The client's one GIL: per-request work is serialised."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.free_at = 0.0

    def run(self, cost: float, then: Callable[[], None]) -> None:
        start = max(self.sim.now, self.free_at)
        self.free_at = start + cost
        self.sim.at(self.free_at - self.sim.now, then)


def run_one(kind: str, mode: str, seconds: float, seed: int) -> dict[str, Any]:
    sim = Sim(seed)
    server = make_server(kind)
    server.tokens = max(1.0, round(server.rate))  # the bucket starts full
    server.tick(sim)
    cpu = CPU(sim)
    if mode == "auto":
        limit = ConcurrencyLimit(clock=lambda: sim.now)
        gate = SimGate(sim, limit, None)
        window = MAX_THREADS
    else:
        gate = SimGate(sim, None, int(mode))
        window = min(int(mode), MAX_THREADS)
    latencies: list[float] = []
    done_batches = 0
    attempts = 0

    def batch() -> None:
        state = {"outages": 0}

        def attempt() -> None:
            gate.acquire(send)

        def send() -> None:
            nonlocal attempts
            attempts += 1
            sent = sim.now

            def arrive() -> None:
                server.handle(sim, lambda status, ra: sim.at(NET, lambda: back(status, ra)))

            def back(status: int, retry_after: float) -> None:
                def decoded() -> None:
                    nonlocal done_batches
                    latency = sim.now - sent
                    overload = status in (429, 503)
                    gate.release(latency, overload, retry_after)
                    if not overload:
                        latencies.append(latency)
                        done_batches += 1
                        sim.at(0.0, batch)  # the window's next batch
                        return
                    state["outages"] += 1
                    if retry_after > 0:
                        delay = retry_after
                    else:
                        cap = min(8.0, 0.25 * 2 ** (state["outages"] - 1))
                        delay = sim.rng.uniform(0.0, cap)
                    sim.at(delay, attempt)

                cpu.run(CLIENT_CPU / 2, decoded)

            cpu.run(CLIENT_CPU / 2, lambda: sim.at(NET, arrive))

        attempt()

    for _ in range(window):
        batch()
    sim.run(seconds)
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))] if latencies else float("nan")
    out: dict[str, Any] = {
        "texts_per_s": done_batches * BATCH / seconds,
        "p99_ms": p99 * 1000.0,
        "overloads": server.overloads,
        "attempts": attempts,
    }
    if mode == "auto":
        assert gate.limit is not None
        out["final_limit"] = gate.limit.limit
        out["snapshot"] = gate.limit.snapshot()
        lims = [lim for t, lim in gate.trace if t >= seconds / 2]
        out["median_limit_2nd_half"] = statistics.median(lims) if lims else None
    return out


MAIN_MODELS = ("gpu", "rate", "slow_start")


def simulate(
    seconds: float = 30.0, seeds: int = 3, models: tuple[str, ...] | list[str] = MAIN_MODELS
) -> dict[str, Any]:
    """Every setting on every model; medians over ``seeds`` random seeds."""
    modes = [str(c) for c in STATIC] + ["auto"]
    report: dict[str, Any] = {"simulation": True, "seconds": seconds, "seeds": seeds}
    report["models"] = {}
    for kind in models:
        rows: dict[str, Any] = {}
        for mode in modes:
            runs = [run_one(kind, mode, seconds, seed) for seed in range(seeds)]
            rows[mode] = {
                "texts_per_s": statistics.median(r["texts_per_s"] for r in runs),
                "p99_ms": statistics.median(r["p99_ms"] for r in runs),
                "overloads": statistics.median(r["overloads"] for r in runs),
            }
            if mode == "auto":
                rows[mode]["final_limit"] = [r["final_limit"] for r in runs]
                rows[mode]["median_limit_2nd_half"] = [r["median_limit_2nd_half"] for r in runs]
        best = max(STATIC, key=lambda c: rows[str(c)]["texts_per_s"])
        auto, ref, default = rows["auto"], rows[str(best)], rows["4"]
        verdict: dict[str, Any] = {
            "best_static": best,
            "throughput_ratio": auto["texts_per_s"] / ref["texts_per_s"],
            "p99_ratio": auto["p99_ms"] / ref["p99_ms"],
            "overloads_auto": auto["overloads"],
            "overloads_static4": default["overloads"],
        }
        verdict["met"] = (
            verdict["throughput_ratio"] >= 0.9
            and verdict["p99_ratio"] <= 1.3
            and (auto["overloads"] < default["overloads"] or auto["overloads"] == 0)
        )
        spec = dict(VARIANTS.get(kind, {"kind": kind}))
        report["models"][kind] = {"server": spec, "rows": rows, "verdict": verdict}
    return report


def markdown(report: dict[str, Any]) -> str:
    """The simulation's results as markdown (marked as a simulation)."""
    lines = [
        "## Adaptive concurrency (SIMULATION, not a measurement)",
        "",
        f"`python bench/adaptive_sim.py --seconds {report['seconds']:.0f} "
        f"--seeds {report['seeds']}`: virtual time, medians over {report['seeds']} seeds; the "
        "real `ConcurrencyLimit` driven by a discrete-event model of the gate, the call "
        "engine and the server (see the script's docstring).",
        "",
        "| model | best static | auto texts/s vs best | auto p99 vs best | overloads auto / "
        "static 4 | limits (2nd half) | verdict |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for kind, data in report["models"].items():
        v, auto = data["verdict"], data["rows"]["auto"]
        lines.append(
            f"| {kind} | {v['best_static']} | {v['throughput_ratio']:.2f}x | "
            f"{v['p99_ratio']:.2f}x | {v['overloads_auto']:.0f} / {v['overloads_static4']:.0f} | "
            f"{auto['median_limit_2nd_half']} | {'met' if v['met'] else 'missed'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--models", default=",".join(MAIN_MODELS))
    ap.add_argument("--variants", action="store_true", help="also the other shapes (VARIANTS)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    models = args.models.split(",") + (list(VARIANTS) if args.variants else [])
    report = simulate(args.seconds, args.seeds, models)
    modes = [str(c) for c in STATIC] + ["auto"]
    for kind, data in report["models"].items():
        rows, verdict = data["rows"], data["verdict"]
        print(f"\n== {kind} (simulation, {args.seconds:.0f} s, median of {args.seeds} seeds)")
        print(f"{'setting':>8} {'texts/s':>9} {'p99 ms':>8} {'overloads':>9}")
        for mode in modes:
            r = rows[mode]
            extra = f"  limits {r['median_limit_2nd_half']}" if mode == "auto" else ""
            print(
                f"{mode:>8} {r['texts_per_s']:9.0f} {r['p99_ms']:8.1f} {r['overloads']:9.0f}{extra}"
            )
        print(
            f"best static {verdict['best_static']}: throughput x{verdict['throughput_ratio']:.2f}, "
            f"p99 x{verdict['p99_ratio']:.2f}, overloads {verdict['overloads_auto']:.0f} vs "
            f"static-4 {verdict['overloads_static4']:.0f} -> "
            f"{'MET' if verdict['met'] else 'MISSED'}"
        )
    print()
    print(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
