"""Replicas: fewest-in-flight (the library) vs round-robin vs a single replica.

Three loopback servers, each in its own process (``EmbeddingServer(process=True)``):
two answer every request after ``--fast-ms`` (default 20 ms), one after ``--slow-ms``
(default 100 ms, 5x slower). The same corpus (``--texts``, default 20,000 distinct
passages) is embedded by three variants, with the same batch size and the same total
concurrency:

- ``fewest_in_flight``: ``EmbeddingClient(base_url=[a, b, c])``, the library: each batch
  goes to the replica with the fewest requests in flight (ties: lowest latency EWMA);
- ``round_robin``: the baseline, written here (not in the library): one
  ``EmbeddingClient`` per replica, the corpus cut into the same batches, batch ``i``
  sent to replica ``i % 3`` by a thread pool of the same total concurrency;
- ``single``: ``EmbeddingClient(base_url=a)``, one fast replica alone.

Two scenarios, in the same run:

- ``capped`` (the realistic one): each replica serves at most ``--per-replica`` requests
  at once (a GPU server has a concurrency sweet spot; beyond it requests queue). The
  loopback server has no such limit, so the cap is the client's pool:
  ``Limits(max_connections=k)`` per replica, the same for every variant, and total
  concurrency ``3 * k``. A batch waiting for a connection is in flight (and its wait
  is part of its latency).
- ``uncapped``: no per-replica cap (every server answers any number of requests at
  its fixed latency), the same total concurrency. What fewest-in-flight does when
  in-flight counts say nothing about capacity.

Measured per variant: texts/s (wall time of the whole corpus), batch latency p50/p99
(milliseconds, one HTTP exchange from dispatch to the last response byte, including a
wait for a pool connection, read from the library's per-request debug record, the same
for every variant), batches each replica answered (server-side counters), client CPU
seconds. Variants run in interleaved rounds (order rotated each round); tables show
medians over rounds. Every vector of the first round is checked against the server's
known embedding, three rows of each later one.

    python bench/replicas.py [--quick] [--rounds R] [--texts N] [--per-replica K]
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS, command_line, environment, markdown_table, median, save

VARIANTS = ("fewest_in_flight", "round_robin", "single")


class _BatchLatencies(logging.Handler):
    """Collects the elapsed milliseconds of each request from the library's debug
    record (``POST <label> texts=N status=S <ms> ms attempt=A``)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.ms: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith("POST ") and record.args:
            args = record.args
            assert isinstance(args, tuple)
            self.ms.append(float(args[3]))


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _variants(
    urls: list[str], batch: int, concurrency: int, per_replica: int | None
) -> dict[str, Callable[[list[str]], np.ndarray]]:
    import qwen_embed_plugins as q

    limits = q.Limits(max_connections=per_replica or 20)
    common: dict[str, Any] = {"batch_size": batch, "limits": limits}
    fewest = q.EmbeddingClient(base_url=urls, max_concurrency=concurrency, **common)
    single = q.EmbeddingClient(base_url=urls[0], max_concurrency=concurrency, **common)
    per = [q.EmbeddingClient(base_url=u, max_concurrency=1, **common) for u in urls]
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="round-robin")

    def round_robin(texts: list[str]) -> np.ndarray:
        starts = range(0, len(texts), batch)
        out: np.ndarray | None = None

        def job(i: int) -> tuple[int, np.ndarray]:
            start = starts[i]
            return start, per[i % len(per)].embed_documents_array(texts[start : start + batch])

        # map() submits every batch in order; the pool's threads take them in turn
        for start, rows in pool.map(job, range(len(starts))):
            if out is None:
                out = np.empty((len(texts), rows.shape[1]), dtype=np.float32)
            out[start : start + len(rows)] = rows
        assert out is not None
        return out

    return {
        "fewest_in_flight": fewest.embed_documents_array,
        "round_robin": round_robin,
        "single": single.embed_documents_array,
    }


def _run_scenario(
    name: str,
    servers: list[Any],
    texts: list[str],
    *,
    latencies: list[float],
    batch: int,
    concurrency: int,
    per_replica: int | None,
    rounds: int,
    handler: _BatchLatencies,
) -> dict[str, Any]:
    from qwen_embed_tooling.testing import expected_embeddings

    urls = [s.base_url for s in servers]
    run = _variants(urls, batch, concurrency, per_replica)
    for fn in run.values():  # warm: connections, learned state, EWMA
        fn(texts[: batch * concurrency])
    samples: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for variant in order:
            before = [s.requests for s in servers]
            handler.ms.clear()
            cpu0, t0 = _cpu(), time.perf_counter()
            arr = run[variant](texts)
            wall, cpu = time.perf_counter() - t0, _cpu() - cpu0
            batch_ms = list(handler.ms)
            if r == 0:
                np.testing.assert_array_equal(arr, expected_embeddings(texts))
            else:
                rows = [0, len(texts) // 2, len(texts) - 1]
                want = expected_embeddings([texts[i] for i in rows])
                np.testing.assert_array_equal(arr[rows], want)
            per_server = [s.requests - b for s, b in zip(servers, before, strict=True)]
            samples[variant].append(
                {
                    "texts_per_s": len(texts) / wall,
                    "wall_s": wall,
                    "client_cpu_s": cpu,
                    "p50_batch_ms": _percentile(batch_ms, 50),
                    "p99_batch_ms": _percentile(batch_ms, 99),
                    "batches": len(batch_ms),
                    "batches_per_replica": per_server,
                }
            )
            print(
                f"{name} round {r + 1}/{rounds} {variant}: {len(texts) / wall:,.0f} texts/s, "
                f"p99 {_percentile(batch_ms, 99):.1f} ms, batches per replica {per_server}",
                file=sys.stderr,
            )
    summary: dict[str, dict[str, Any]] = {}
    for variant, runs in samples.items():
        summary[variant] = {
            key: median([s[key] for s in runs])
            for key in ("texts_per_s", "wall_s", "client_cpu_s", "p50_batch_ms", "p99_batch_ms")
        }
        summary[variant]["batches_per_replica"] = [
            median([s["batches_per_replica"][i] for s in runs]) for i in range(len(servers))
        ]
    return {
        "scenario": name,
        "per_replica_connections": per_replica,
        "concurrency": concurrency,
        "ceiling_texts_per_s": ceilings(latencies, batch, concurrency, per_replica),
        "summary": summary,
        "rounds": samples,
    }


def ceilings(
    latencies: list[float], batch: int, concurrency: int, per_replica: int | None
) -> dict[str, float]:
    """Texts/s each variant would reach if the client cost nothing: the latency model's
    bound (``latencies`` in seconds, the first replica is the single one).

    Capped (``per_replica`` requests at once per replica): fewest-in-flight keeps every
    replica at its cap, ``sum(k / latency)``; round-robin gives each replica the same
    number of batches, so the slowest sets the pace, ``R * min(k / latency)``; a single
    replica ``k / latency``. Uncapped: fewest-in-flight keeps ``C / R`` in flight on each,
    ``sum(C / R / latency)``; round-robin, by Little's law, ``C / mean(latency)``; a
    single replica ``C / latency``.
    """
    r = len(latencies)
    if per_replica:
        k = per_replica
        rates = {
            "fewest_in_flight": sum(k / lat for lat in latencies),
            "round_robin": r * min(k / lat for lat in latencies),
            "single": k / latencies[0],
        }
    else:
        c = concurrency
        rates = {
            "fewest_in_flight": sum(c / r / lat for lat in latencies),
            "round_robin": c / (sum(latencies) / r),
            "single": c / latencies[0],
        }
    return {v: batch * rate for v, rate in rates.items()}


def _table(result: dict[str, Any]) -> str:
    summary = result["summary"]
    rr = summary["round_robin"]
    ceiling = result["ceiling_texts_per_s"]
    rows = []
    for variant in VARIANTS:
        s = summary[variant]
        rows.append(
            [
                variant.replace("_", " "),
                f"{s['texts_per_s'] / rr['texts_per_s']:.2f}x",
                f"{s['p99_batch_ms'] / rr['p99_batch_ms']:.2f}x",
                s["texts_per_s"],
                f"{s['texts_per_s'] / ceiling[variant]:.0%} of {ceiling[variant]:,.0f}",
                s["p99_batch_ms"],
                s["p50_batch_ms"],
                " / ".join(f"{b:.0f}" for b in s["batches_per_replica"]),
                s["client_cpu_s"],
            ]
        )
    return markdown_table(
        [
            "variant",
            "texts/s vs round-robin",
            "p99 batch latency vs round-robin",
            "texts/s",
            "of the latency bound",
            "p99 batch ms",
            "p50 batch ms",
            "batches: fast / fast / slow",
            "client CPU s",
        ],
        rows,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4,000 texts, 1 round")
    parser.add_argument("--texts", type=int, default=None, help="corpus size (default 20,000)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5)")
    parser.add_argument("--batch", type=int, default=32, help="texts per request (default 32)")
    parser.add_argument(
        "--per-replica", type=int, default=2, help="requests at once per replica (default 2)"
    )
    parser.add_argument("--fast-ms", type=float, default=20.0)
    parser.add_argument("--slow-ms", type=float, default=100.0)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--markdown", default=None, help="also write the tables here")
    args = parser.parse_args(argv)
    n = args.texts or (4000 if args.quick else 20_000)
    rounds = args.rounds or (1 if args.quick else 5)

    from qwen_embed_plugins._corpus import corpus
    from qwen_embed_tooling.testing import EmbeddingServer

    texts = corpus(n, unique=True)
    handler = _BatchLatencies()
    logger = logging.getLogger("qwen_embed_plugins")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    env = environment()
    latencies = [args.fast_ms / 1000.0, args.fast_ms / 1000.0, args.slow_ms / 1000.0]
    servers = [EmbeddingServer(process=True, latency=s) for s in latencies]
    try:
        for s in servers:
            s.start()
        concurrency = 3 * args.per_replica
        scenarios = [
            _run_scenario(
                "capped",
                servers,
                texts,
                latencies=latencies,
                batch=args.batch,
                concurrency=concurrency,
                per_replica=args.per_replica,
                rounds=rounds,
                handler=handler,
            ),
            _run_scenario(
                "uncapped",
                servers,
                texts,
                latencies=latencies,
                batch=args.batch,
                concurrency=concurrency,
                per_replica=None,
                rounds=rounds,
                handler=handler,
            ),
        ]
    finally:
        for s in servers:
            s.close()
    data = {
        "benchmark": "replicas",
        "command": command_line(),
        "environment": env,
        "texts": n,
        "rounds": rounds,
        "batch_size": args.batch,
        "latency_ms": [args.fast_ms, args.fast_ms, args.slow_ms],
        "scenarios": scenarios,
    }
    out = save("replicas", data, args.json_path)
    load = env.get("load_1min_at_start")
    lines = [
        f"`{data['command']}`: {n:,} texts, {args.batch} per batch, replicas answering after "
        f"{args.fast_ms:g} / {args.fast_ms:g} / {args.slow_ms:g} ms, medians of {rounds} "
        f"interleaved rounds; load average at start {load}, {env['cpus']} CPUs.",
        "",
    ]
    for result in scenarios:
        k = result["per_replica_connections"]
        title = (
            f"**capped: at most {k} requests at once per replica, total concurrency "
            f"{result['concurrency']}**"
            if k
            else f"**uncapped: servers take any number of requests, total concurrency "
            f"{result['concurrency']}**"
        )
        lines += [title, "", _table(result), ""]
    text = "\n".join(lines)
    md = Path(args.markdown) if args.markdown else (RESULTS / "replicas.md")
    if args.json_path is None or args.markdown:
        md.write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {out}", file=sys.stderr)
    return data


if __name__ == "__main__":
    main()
