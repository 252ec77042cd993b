"""Does ``max_concurrency="auto"`` earn its keep? (issue 29, deliverable 4)

The criterion: keep the option only if, with FOUR competing client processes on a
GPU-like server with dynamic batching and on a server whose latency grows with what it
queues, it cuts the p99 latency of single-text queries at least 1.5x while keeping at
least 95% of the defaults' throughput.

Each run starts a fresh ``EmbeddingServer(process=True)`` (its own process) with one
server model, then four client processes (each a fresh interpreter: its own pool, its own
adaptive gate, nothing learned beforehand). Every client does what a RAG service does:

- **bulk**: one thread ingests documents, ``EmbeddingClient.embed_documents_array`` on
  calls of ``--chunk`` texts, one call after the other (closed loop);
- **queries**: single-text ``embed_query`` calls arriving at ``--qps`` per second per
  client, an open loop (arrivals at fixed times, each answered in a thread of a pool of
  16, so a slow answer does not delay the next arrival); a query's latency is from its
  arrival time to its answer (any wait for a thread or for a gate slot included: what
  the user waits).

All four clients use the variant's settings: ``default`` (``EmbeddingClient(base_url=...)``)
or ``auto`` (the same with ``max_concurrency="auto"``). The clients start together, run
``--warmup`` seconds unmeasured (the batch size and the adaptive limit learn), then
``--seconds`` measured:

- throughput: texts the server answered with vectors in the measured window (its own
  counter, read at the window's start and end), per second;
- p99 / p50 query latency: over the queries of all four clients that arrived in the
  window.

Server models (``qwen_embed_tooling.testing``; texts of ~40 tokens):

- ``dynamic``: ``DynamicBatching(window=2 ms, max_tokens=8192, base=5 ms,
  per_token=20 us)``: requests merged server-side into passes, one pass at a time;
- ``queued``: ``GPULike(slots=1, base=5 ms, per_token=20 us, queue_limit=4096)``: one
  batch at a time, FIFO, so a request's latency grows with the tokens queued ahead of it.

Variants alternate within a round (order rotated each round); the verdict uses the
median over rounds of each round's ratios: p99 cut = default p99 / auto p99 (target
>= 1.5), throughput = auto / default (target >= 0.95).

    python bench/adaptive.py [--rounds 4] [--seconds 15] [--warmup 4] [--models dynamic,queued]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import command_line, environment, markdown_table, median, save
from _harness import percentile, rotated

from qwen_embed_tooling.testing import DynamicBatching, EmbeddingServer, GPULike

CLIENTS = 4
VARIANTS: dict[str, dict[str, Any]] = {"default": {}, "auto": {"max_concurrency": "auto"}}
GPU = {"base": 0.005, "per_token": 0.00002}
DESCRIPTIONS = {
    "dynamic": "GPU-like, dynamic batching: passes of <= 8,192 tokens, 5 ms + 20 us/token, "
    "one at a time",
    "queued": "GPU-like, one batch at a time (5 ms + 20 us/token), FIFO queue: latency grows "
    "with the tokens queued",
}
TARGET_P99_CUT = 1.5
TARGET_THROUGHPUT = 0.95


def server_model(kind: str) -> Any:
    if kind == "dynamic":
        return DynamicBatching(window=0.002, max_tokens=8192, **GPU)
    if kind == "queued":
        return GPULike(slots=1, queue_limit=4096, **GPU)
    raise ValueError(f"unknown model {kind!r}; expected dynamic or queued")


def corpus(client: int, n: int) -> list[str]:
    # ~160 characters = ~40 tokens by the test server's count (chars / 4)
    return [
        f"client {client} document {i:06d}: " + "an embedding benchmark sentence " * 5
        for i in range(n)
    ]


# ----------------------------------------------------------------------------- worker


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One client process: bulk calls in a thread, open-loop queries; returns what it saw."""
    from qwen_embed_plugins import EmbeddingClient

    client = EmbeddingClient(base_url=spec["base_url"], **VARIANTS[spec["variant"]])
    me, qps = int(spec["client"]), float(spec["qps"])
    docs = corpus(me, int(spec["chunk"]))
    start = float(spec["start_at"])
    measure_from = start + float(spec["warmup"])
    end = measure_from + float(spec["seconds"])
    bulk_texts, bulk_calls, errors = [0], [0], [0]

    def bulk() -> None:
        while time.time() < end:
            try:
                bulk_texts[0] += len(client.embed_documents_array(docs))
                bulk_calls[0] += 1
            except Exception:
                errors[0] += 1

    latencies: list[float] = []
    lock = threading.Lock()

    def query(i: int, arrival: float) -> None:
        try:
            client.embed_query(f"client {me} question {i}: what does the benchmark measure?")
        except Exception:
            with lock:
                errors[0] += 1
            return
        done = time.time()
        if measure_from <= arrival < end:
            with lock:
                latencies.append((done - arrival) * 1000.0)

    time.sleep(max(0.0, start - time.time()))
    thread = threading.Thread(target=bulk, daemon=True)
    thread.start()
    # arrivals staggered between clients, so the four do not ask at the same instant
    offset = me / (CLIENTS * qps)
    with ThreadPoolExecutor(max_workers=16) as pool:
        i = 0
        while True:
            arrival = start + offset + i / qps
            if arrival >= end:
                break
            time.sleep(max(0.0, arrival - time.time()))
            pool.submit(query, i, arrival)
            i += 1
    thread.join()
    return {
        "query_ms": latencies,
        "bulk_texts": bulk_texts[0],
        "bulk_calls": bulk_calls[0],
        "errors": errors[0],
    }


# ----------------------------------------------------------------------------- one run


def run_one(kind: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    with EmbeddingServer(process=True, server_model=[server_model(kind)]) as server:
        start_at = time.time() + args.startup
        procs = []
        for c in range(CLIENTS):
            spec = {
                "base_url": server.base_url,
                "variant": variant,
                "client": c,
                "qps": args.qps,
                "chunk": args.chunk,
                "start_at": start_at,
                "warmup": args.warmup,
                "seconds": args.seconds,
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--worker", json.dumps(spec)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        measure_from = start_at + args.warmup
        time.sleep(max(0.0, measure_from - time.time()))
        before = server.stats()
        t0 = time.time()
        time.sleep(max(0.0, measure_from + args.seconds - time.time()))
        after = server.stats()
        window = time.time() - t0
        late = t0 - measure_from
        outs = []
        for proc in procs:
            stdout, _ = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"a client process failed ({proc.returncode})")
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    query_ms = [ms for out in outs for ms in out["query_ms"]]
    return {
        "texts_per_s": (after["texts"] - before["texts"]) / window,
        "p99_query_ms": percentile(query_ms, 99.0),
        "p50_query_ms": percentile(query_ms, 50.0),
        "queries": len(query_ms),
        "server_max_in_flight": int(after["max_in_flight"]),
        "overloads": sum(int(after["responses"].get(s, 0)) for s in ("429", "503")),
        "client_errors": sum(out["errors"] for out in outs),
        "bulk_calls": [out["bulk_calls"] for out in outs],
        "window_s": window,
        "stats_read_late_s": late,
    }


# ----------------------------------------------------------------------------- report


def verdict(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    pairs = list(zip(runs["default"], runs["auto"], strict=True))
    cuts = [d["p99_query_ms"] / a["p99_query_ms"] for d, a in pairs]
    thr = [a["texts_per_s"] / d["texts_per_s"] for d, a in pairs]
    out: dict[str, Any] = {
        "p99_cut_per_round": cuts,
        "throughput_ratio_per_round": thr,
        "p99_cut": median(cuts),
        "throughput_ratio": median(thr),
    }
    out["p99_met"] = out["p99_cut"] >= TARGET_P99_CUT
    out["throughput_met"] = out["throughput_ratio"] >= TARGET_THROUGHPUT
    out["met"] = out["p99_met"] and out["throughput_met"]
    return out


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        '## `max_concurrency="auto"` vs the defaults, four competing clients',
        "",
        f"`{report['command']}`: {report['rounds']} interleaved rounds; per run a fresh "
        f"server process and {CLIENTS} client processes, {report['warmup']:.0f} s warm-up + "
        f"{report['seconds']:.0f} s measured, bulk calls of {report['chunk']} texts and "
        f"{report['qps']:g} queries/s per client; {env['cpus']} CPUs, load "
        f"{env['load_1min_at_start']} at start. Ratios: medians of per-round ratios.",
        "",
    ]
    rows = []
    for kind, data in report["models"].items():
        v = data["verdict"]
        d, a = data["medians"]["default"], data["medians"]["auto"]
        rows.append(
            [
                kind,
                f"{d['p99_query_ms']:.0f} / {a['p99_query_ms']:.0f}",
                f"**{v['p99_cut']:.2f}x**",
                f"{d['texts_per_s']:.0f} / {a['texts_per_s']:.0f}",
                f"**{v['throughput_ratio']:.2f}x**",
                "met" if v["met"] else "MISSED",
            ]
        )
    lines.append(
        markdown_table(
            [
                "server",
                "p99 query ms default / auto",
                "p99 cut (>= 1.5)",
                "texts/s default / auto",
                "throughput auto / default (>= 0.95)",
                "verdict",
            ],
            rows,
        )
    )
    lines.append("")
    for kind, data in report["models"].items():
        v = data["verdict"]
        lines.append(
            f"- {kind} ({data['description']}): p99 cut per round "
            + ", ".join(f"{x:.2f}" for x in v["p99_cut_per_round"])
            + "; throughput ratio per round "
            + ", ".join(f"{x:.2f}" for x in v["throughput_ratio_per_round"])
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=15.0, help="measured seconds per run")
    ap.add_argument("--warmup", type=float, default=4.0, help="unmeasured seconds per run")
    ap.add_argument("--startup", type=float, default=5.0, help="seconds for clients to start")
    ap.add_argument("--chunk", type=int, default=512, help="texts per bulk call")
    ap.add_argument("--qps", type=float, default=4.0, help="queries per second per client")
    ap.add_argument("--models", default="dynamic,queued")
    ap.add_argument("--json", default=None, help="default bench/results/adaptive.json")
    ap.add_argument("--md", default=None, help="default bench/results/adaptive.md")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        # the library logs each retry at WARNING: keep the worker's stdout / stderr quiet
        logging.getLogger("qwen_embed_plugins").setLevel(logging.ERROR)
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    kinds = args.models.split(",")
    report: dict[str, Any] = {
        "command": command_line(),
        "environment": environment(),
        "rounds": args.rounds,
        "seconds": args.seconds,
        "warmup": args.warmup,
        "chunk": args.chunk,
        "qps": args.qps,
        "clients": CLIENTS,
        "models": {},
    }
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {k: {v: [] for v in VARIANTS} for k in kinds}
    for rnd in range(args.rounds):
        for kind in kinds:
            for variant in rotated(list(VARIANTS), rnd):
                row = run_one(kind, variant, args)
                runs[kind][variant].append(row)
                print(
                    f"round {rnd + 1} {kind:>8} {variant:>7}: {row['texts_per_s']:7.0f} texts/s "
                    f"p99 query {row['p99_query_ms']:7.1f} ms (p50 {row['p50_query_ms']:6.1f}, "
                    f"{row['queries']} queries)  server max in flight "
                    f"{row['server_max_in_flight']}  errors {row['client_errors']}  "
                    f"load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    for kind in kinds:
        keys = ("texts_per_s", "p99_query_ms", "p50_query_ms", "server_max_in_flight")
        report["models"][kind] = {
            "description": DESCRIPTIONS[kind],
            "server_model": repr(server_model(kind)),
            "medians": {
                v: {k: median([r[k] for r in runs[kind][v]]) for k in keys} for v in VARIANTS
            },
            "runs": runs[kind],
            "verdict": verdict(runs[kind]),
        }
    report["load_1min_at_end"] = round(os.getloadavg()[0], 2)
    text = markdown(report)
    path = save("adaptive", report, args.json)
    md = path.with_suffix(".md") if args.md is None else Path(args.md)
    md.write_text(text + "\n", encoding="utf-8")
    print(text)
    print(f"\nwrote {path} and {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
