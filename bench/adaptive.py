"""Adaptive concurrency (``max_concurrency="auto"``) vs a sweep of static settings,
against three loopback server models (issue 14, item 4).

Each run starts a fresh ``EmbeddingServer`` in a child process with one server model
(so a slow start or a rate-limit bucket starts from scratch, and the adaptive gate of
the new URL starts with no history), then one client embeds through the public API —
``EmbeddingClient(base_url=..., max_concurrency=setting).embed_documents_array`` on
chunks of ``--chunk`` texts (many batches per call: the window keeps ``setting``
batches in flight; ``"auto"``: a window of 64 and the endpoint's adaptive gate) —
for ``--seconds``, then stops. Rounds are interleaved (every setting once per round,
order rotated), results are medians over rounds.

Measured per run:

- texts/s: texts embedded / seconds the run took;
- p99 request latency: of the answered (200) requests, sending to answer, timed
  around ``_transport.SyncTransport.send`` for every setting alike (so the wait for a
  slot of the adaptive gate is not part of it);
- overload answers: 429 + 503 answers the server sent (its counters).

Server models (``qwen_embed_tooling.testing``), one batch = 32 texts of ~40 tokens:

- ``gpu``: ``GPULike(slots=8, base=4 ms, per_token=20 us, queue_limit=16)``: ~30 ms a
  batch, 8 at once, 503 past 16 waiting;
- ``rate``: ``RateLimited(rate=60/s)`` in front of ``GPULike(slots=32, ...)``: 429 with
  ``Retry-After`` past 60 requests/s (the default static 4 asks ~120/s);
- ``slow_start``: ``SlowStart(slots=8, start_slots=1, ramp=10 s, queue_limit=8)``.

Verdict per model (issue 14): auto's throughput >= 90% of the best static setting's
(highest median texts/s), its p99 <= 1.3x that setting's, and fewer overload answers
than the default static 4 (or none when static 4 had none).

    python bench/adaptive.py [--quick] [--rounds 3] [--seconds 15] [--models gpu,rate,slow_start]

``--simulate`` also runs the discrete-event simulation (bench/adaptive_sim.py) and puts
its results (clearly marked) next to the measured ones.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from pathlib import Path
from typing import Any

from _common import command_line, environment, markdown_table, median, save
from _harness import percentile

from qwen_embed_plugins import EmbeddingClient, Limits, _transport, close_all
from qwen_embed_plugins import _adaptive as adaptive
from qwen_embed_tooling.testing import (
    EmbeddingServer,
    GPULike,
    RateLimited,
    SlowStart,
)

STATIC = (1, 2, 4, 8, 16, 32)
SETTINGS: tuple[int | str, ...] = (*STATIC, "auto")
DEFAULT_STATIC = 4
BATCH = 32
GPU = {"base": 0.004, "per_token": 0.00002}


def server_models(kind: str) -> list[Any]:
    if kind == "gpu":
        return [GPULike(slots=8, queue_limit=16, **GPU)]
    if kind == "rate":
        return [RateLimited(rate=60.0), GPULike(slots=32, queue_limit=64, **GPU)]
    if kind == "slow_start":
        return [SlowStart(slots=8, start_slots=1, ramp=10.0, queue_limit=8, **GPU)]
    raise ValueError(f"unknown model {kind!r}")


def corpus(n: int) -> list[str]:
    # ~160 characters = ~40 tokens by the test server's count (chars / 4)
    return [f"document {i:06d}: " + "an embedding benchmark sentence " * 5 for i in range(n)]


class RequestTimes:
    """Times every HTTP exchange, for every setting at the same point: around
    ``SyncTransport.send`` (after any wait for a slot of the adaptive gate, which the
    call's own timing would include). Benchmark instrumentation only, not an API."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, float]] = []
        self._lock = threading.Lock()
        self._original: Any = None

    def __enter__(self) -> RequestTimes:
        original = self._original = _transport.SyncTransport.send
        rows, lock = self.rows, self._lock

        def timed(inner: Any, req: Any) -> Any:
            started = time.perf_counter()
            status = 0  # a failure without an answer
            try:
                reply = original(inner, req)
                status = reply.status
                return reply
            finally:
                ms = (time.perf_counter() - started) * 1000.0
                with lock:
                    rows.append((status, ms))

        _transport.SyncTransport.send = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        _transport.SyncTransport.send = self._original  # type: ignore[method-assign]


def run_one(kind: str, setting: int | str, seconds: float, chunk: int) -> dict[str, Any]:
    texts = corpus(chunk)
    with EmbeddingServer(process=True, server_model=server_models(kind)) as server:
        client = EmbeddingClient(
            base_url=server.base_url,
            max_concurrency=setting,  # type: ignore[arg-type]
            batch_size=BATCH,
            limits=Limits(max_connections=64),
        )
        done = 0
        with RequestTimes() as times:
            started = time.perf_counter()
            while time.perf_counter() - started < seconds:
                done += len(client.embed_documents_array(texts))
            elapsed = time.perf_counter() - started
        stats = server.stats()
        url = server.base_url.rstrip("/")
        gate = next(
            (
                snap
                for key, snap in adaptive.gates().items()
                if str(getattr(key, "base_url", key)).rstrip("/") == url
            ),
            None,
        )
        close_all()
    ok = [ms for status, ms in times.rows if status == 200]
    responses = stats["responses"]
    overloads = int(responses.get("429", 0)) + int(responses.get("503", 0))
    row: dict[str, Any] = {
        "texts_per_s": done / elapsed,
        "p99_ms": percentile(ok, 99.0),
        "p50_ms": percentile(ok, 50.0),
        "overloads": overloads,
        "requests": int(stats["requests"]),
        "max_in_flight": int(stats["max_in_flight"]),
        "seconds": elapsed,
    }
    if gate is not None:
        row["final_limit"] = gate["limit"]
        row["min_rtt_ms"] = None if gate["min_rtt"] is None else gate["min_rtt"] * 1000.0
    return row


def verdict(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    best = max(STATIC, key=lambda c: rows[str(c)]["texts_per_s"])
    auto, ref, default = rows["auto"], rows[str(best)], rows[str(DEFAULT_STATIC)]
    out = {
        "best_static": best,
        "throughput_ratio": auto["texts_per_s"] / ref["texts_per_s"],
        "p99_ratio": auto["p99_ms"] / ref["p99_ms"],
        "overloads_auto": auto["overloads"],
        "overloads_static_default": default["overloads"],
    }
    fewer = auto["overloads"] < default["overloads"] or (
        auto["overloads"] == 0 and default["overloads"] == 0
    )
    out["throughput_met"] = out["throughput_ratio"] >= 0.9
    out["p99_met"] = out["p99_ratio"] <= 1.3
    out["overloads_met"] = fewer
    out["met"] = out["throughput_met"] and out["p99_met"] and fewer
    return out


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("texts_per_s", "p99_ms", "p50_ms", "overloads", "requests", "max_in_flight")
    out: dict[str, Any] = {k: median([r[k] for r in runs]) for k in keys}
    if "final_limit" in runs[0]:
        out["final_limit"] = [r["final_limit"] for r in runs]
    out["runs"] = runs
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "## Adaptive concurrency (measured)",
        "",
        f"`{report['command']}` — {report['rounds']} interleaved rounds, medians; "
        f"{report['seconds']:.0f} s per run; {report['environment']['cpus']} CPUs, "
        f"load {report['environment']['load_1min_at_start']} at start.",
        "",
    ]
    for kind, data in report["models"].items():
        v = data["verdict"]
        lines += [
            f"### {kind}: {data['description']}",
            "",
            f"auto vs best static ({v['best_static']}): throughput "
            f"**{v['throughput_ratio']:.2f}x** (target >= 0.90), p99 **{v['p99_ratio']:.2f}x** "
            f"(target <= 1.30), overload answers **{v['overloads_auto']:.0f}** vs "
            f"{v['overloads_static_default']:.0f} at static {DEFAULT_STATIC} -> "
            f"**{'met' if v['met'] else 'MISSED'}**",
            "",
        ]
        rows = []
        best = data["rows"][str(v["best_static"])]
        for setting in SETTINGS:
            r = data["rows"][str(setting)]
            rows.append(
                [
                    str(setting),
                    r["texts_per_s"],
                    f"{r['texts_per_s'] / best['texts_per_s']:.2f}x",
                    r["p99_ms"],
                    r["p50_ms"],
                    r["overloads"],
                    r["max_in_flight"],
                    " ".join(str(x) for x in r.get("final_limit", [])) or "-",
                ]
            )
        lines.append(
            markdown_table(
                [
                    "max_concurrency",
                    "texts/s",
                    "vs best",
                    "p99 ms",
                    "p50 ms",
                    "429+503",
                    "server max in flight",
                    "final limit",
                ],
                rows,
            )
        )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    # the library logs each retry at WARNING (stderr when the app configured no logging):
    # the runs that overload the server would pay for thousands of lines
    logging.getLogger("qwen_embed_plugins").setLevel(logging.ERROR)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 4 s (smoke test)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--chunk", type=int, default=2048, help="texts per embed call")
    ap.add_argument("--models", default="gpu,rate,slow_start")
    ap.add_argument("--settings", default=None, help="a subset, e.g. 4,8,auto (no verdict)")
    ap.add_argument("--json", default=None, help="default bench/results/adaptive.json")
    ap.add_argument("--md", default=None, help="default bench/results/adaptive.md")
    ap.add_argument("--simulate", action="store_true", help="add the simulation's results")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds = 1, 4.0
    kinds = args.models.split(",")
    descriptions = {
        "gpu": "8 slots of ~30 ms, 503 past 16 waiting",
        "rate": "429 (Retry-After) past 60 requests/s; 32 slots of ~30 ms behind it",
        "slow_start": "1 slot growing to 8 over the first 10 s, 503 past 8 waiting",
    }
    settings = SETTINGS
    if args.settings:
        settings = tuple(s if s == "auto" else int(s) for s in args.settings.split(","))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        k: {str(s): [] for s in settings} for k in kinds
    }
    for rnd in range(args.rounds):
        order = list(settings)
        k = rnd % len(order)
        order = order[k:] + order[:k]
        for kind in kinds:
            for setting in order:
                row = run_one(kind, setting, args.seconds, args.chunk)
                runs[kind][str(setting)].append(row)
                print(
                    f"round {rnd + 1} {kind:>10} {setting!s:>4}: {row['texts_per_s']:7.0f} texts/s "
                    f"p99 {row['p99_ms']:6.1f} ms  overloads {row['overloads']:4d}  "
                    f"limit {row.get('final_limit', '-')}",
                    flush=True,
                )
    report: dict[str, Any] = {
        "command": command_line(),
        "environment": environment(),
        "rounds": args.rounds,
        "seconds": args.seconds,
        "chunk": args.chunk,
        "batch_size": BATCH,
        "models": {},
    }
    for kind in kinds:
        rows = {s: summarise(r) for s, r in runs[kind].items()}
        report["models"][kind] = {
            "description": descriptions[kind],
            "server_model": [repr(m) for m in server_models(kind)],
            "rows": rows,
        }
        if settings == SETTINGS:
            report["models"][kind]["verdict"] = verdict(rows)
    if settings != SETTINGS:
        print(report["models"])
        return 0
    text = markdown(report)
    if args.simulate:
        import adaptive_sim

        sim = adaptive_sim.simulate(seconds=30.0, seeds=3)
        report["simulation"] = sim
        text += "\n" + adaptive_sim.markdown(sim)
    path = save("adaptive", report, args.json)
    md = path.with_suffix(".md") if args.md is None else Path(args.md)
    md.write_text(text + "\n", encoding="utf-8")
    print(text)
    print(f"\nwrote {path} and {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
