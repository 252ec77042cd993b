#!/usr/bin/env python3
"""Hedged queries against a heavy-tailed server (issue 14 item 5).

The server (its own process) answers each request after ``base`` seconds, except 1 in
``every`` (seeded draws, in arrival order) which takes ``factor`` times longer. Queries are
sent one after another (an interactive caller), with ``hedge=False`` and ``hedge=True``
in interleaved rounds (a fresh server per round, so each variant meets the same tail),
through the public API. Reported per variant (medians over rounds): p50, p99 and p99.9
latency of a query, and the extra requests the hedges cost (server requests / queries -
1). The hedged variant warms the endpoint's latency record with the first 100 queries of
each round (so it knows its p95); they are not timed.

    python bench/hedging.py [--queries 2000] [--rounds 3] [--every 50] [--factor 10]
        [--base 0.005] [--async] [--json bench/results/hedging.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import qwen_embed_plugins as q
from qwen_embed_tooling.testing import EmbeddingServer, HeavyTail

WARMUP = 100


def _quantile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def run_variant(hedge: bool, args: argparse.Namespace, round_no: int) -> dict[str, Any]:
    model = HeavyTail(base=args.base, every=args.every, factor=args.factor, seed=round_no)
    with EmbeddingServer(process=True, dim=256, server_model=model) as srv:
        config = q.EmbeddingConfig(base_url=srv.base_url, hedge=hedge)
        texts = [f"query {round_no}-{i}" for i in range(WARMUP + args.queries)]
        latencies: list[float] = []
        if args.use_async:
            client = q.AsyncEmbeddingClient(config)

            async def main() -> None:
                for i, text in enumerate(texts):
                    started = time.perf_counter()
                    await client.embed_query(text)
                    if i >= WARMUP:
                        latencies.append(time.perf_counter() - started)

            asyncio.run(main())
        else:
            sync = q.EmbeddingClient(config)
            for i, text in enumerate(texts):
                started = time.perf_counter()
                sync.embed_query(text)
                if i >= WARMUP:
                    latencies.append(time.perf_counter() - started)
        requests = srv.requests
        q.close_all()
    return {
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * _quantile(latencies, 0.99),
        "p999_ms": 1000 * _quantile(latencies, 0.999),
        "extra_requests": requests / len(texts) - 1.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--factor", type=float, default=10.0)
    parser.add_argument("--base", type=float, default=0.005)
    parser.add_argument("--async", dest="use_async", action="store_true")
    parser.add_argument("--json", default="bench/results/hedging.json")
    args = parser.parse_args(argv)
    rounds: dict[str, list[dict[str, Any]]] = {"off": [], "hedged": []}
    for r in range(args.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        for hedge in order:
            rounds["hedged" if hedge else "off"].append(run_variant(hedge, args, r))
            print(
                f"round {r} hedge={hedge}: {rounds['hedged' if hedge else 'off'][-1]}",
                file=sys.stderr,
            )
    medians = {
        name: {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        for name, rows in rounds.items()
    }
    ratio = medians["off"]["p99_ms"] / medians["hedged"]["p99_ms"]
    result = {
        "settings": vars(args),
        "rounds": rounds,
        "medians": medians,
        "p99_ratio_off_over_hedged": ratio,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print("| variant | p50 ms | p99 ms | p99.9 ms | extra requests |")
    print("|---|---:|---:|---:|---:|")
    for name, m in medians.items():
        print(
            f"| {name} | {m['p50_ms']:.1f} | {m['p99_ms']:.1f} | {m['p999_ms']:.1f} "
            f"| {100 * m['extra_requests']:.1f}% |"
        )
    print(f"p99: {ratio:.2f}x lower with hedging")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
