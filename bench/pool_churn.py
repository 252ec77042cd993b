"""Connection churn of the shared sync pool under thread contention: gated vs httpcore alone.

httpcore's sync pool can close a connection and open a replacement while requests queue
inside it (see ``qwen_embed_plugins.pool._GatedTransport`` and encode/httpcore#1110), so a
run opens more TCP connections than ``max_connections`` although never more at once. The
library puts a semaphore of ``max_connections`` slots in front of that pool. This script
shows the difference side by side in one run: rounds alternate between the library's
transport (``gated``) and httpx's own transport alone (``ungated``, the same client
otherwise); each round is ``--threads`` threads, each embedding ``--texts`` texts with
``EmbeddingClient.embed_documents`` (``max_concurrency`` 4: more requests than
connections), and counts the TCP connections opened (httpcore connect events).

The race needs a busy machine: ``--load N`` runs N CPU-burning processes meanwhile (the
CI machines are shared). Against a real server, e.g. Infinity from
``scripts/realserver.py start``:

    python bench/pool_churn.py --base-url http://127.0.0.1:7997/v1 \\
        --model Qwen/Qwen3-Embedding-0.6B --rounds 20 --load 2

With no ``--base-url``, a local ``EmbeddingServer`` in a child process is used (the race
shows far less often there: it answers in microseconds).
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from _common import command_line, environment, markdown_table, save

import qwen_embed_plugins as q
from qwen_embed_plugins import pool
from qwen_embed_plugins._bench.corpus import corpus


def _burn(stop_at: float) -> None:  # pragma: no cover - a CPU load for the benchmark
    while time.monotonic() < stop_at:
        pass


_GATED = pool._sync_transport  # the library's transport factory


def _ungated(kwargs: dict[str, Any]) -> Any:
    """httpx's transport alone: what the library gates, without the gate."""
    transport = _GATED(kwargs)
    return getattr(transport, "_inner", transport)


def run(base_url: str, model: str, rounds: int, threads: int, texts: int) -> dict[str, Any]:
    words = corpus()
    # short texts (the first 80 characters of each passage): the pool, not the model, is
    # what is measured
    chunks = [
        [words[(t * texts + i) % len(words)][:80] for i in range(texts)] for t in range(threads)
    ]
    limit = q.Limits().max_connections
    label = q.EmbeddingConfig(base_url=base_url).endpoint
    gated = _GATED
    rows: dict[str, list[dict[str, int]]] = {"gated": [], "ungated": []}
    for r in range(rounds):
        for mode in ("gated", "ungated") if r % 2 == 0 else ("ungated", "gated"):
            pool._sync_transport = gated if mode == "gated" else _ungated  # type: ignore[assignment]
            try:
                q.close_all()
                before = dict(q.pool_stats().get(label, {}))
                clients = [
                    q.EmbeddingClient(base_url=base_url, model=model, max_concurrency=4)
                    for _ in range(threads)
                ]
                with ThreadPoolExecutor(threads) as ex:
                    list(ex.map(lambda c, t: c.embed_documents(t), clients, chunks))
                after = q.pool_stats()[label]
                rows[mode].append(
                    {
                        k: int(after[k]) - int(before.get(k, 0))
                        for k in ("connections_opened", "requests", "retries")
                    }
                )
            finally:
                pool._sync_transport = gated  # type: ignore[assignment]
    q.close_all()
    summary = {}
    for mode, found in rows.items():
        summary[mode] = {
            "rounds": len(found),
            "rounds_over_limit": sum(f["connections_opened"] > limit for f in found),
            "max_connections_opened": max(f["connections_opened"] for f in found),
            "retries": sum(f["retries"] for f in found),
            "requests_per_round": found[0]["requests"],
        }
    return {"limit": limit, "summary": summary, "rounds": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", help="an embedding server (default: a local one)")
    ap.add_argument("--model", default="Qwen/Qwen3-Embedding-0.6B")
    ap.add_argument("--rounds", type=int, default=10, help="rounds per mode")
    ap.add_argument("--threads", type=int, default=20)
    ap.add_argument("--texts", type=int, default=250, help="texts per thread")
    ap.add_argument("--load", type=int, default=0, help="CPU-burning processes meanwhile")
    ap.add_argument("--out", help="JSON output (default bench/results/pool_churn.json)")
    args = ap.parse_args()

    burners = [
        multiprocessing.Process(target=_burn, args=(time.monotonic() + 3600,), daemon=True)
        for _ in range(args.load)
    ]
    for b in burners:
        b.start()
    try:
        if args.base_url:
            result = run(args.base_url, args.model, args.rounds, args.threads, args.texts)
        else:
            from qwen_embed_plugins.testing import EmbeddingServer

            with EmbeddingServer(process=True, latency=0.02) as srv:
                result = run(srv.base_url, args.model, args.rounds, args.threads, args.texts)
    finally:
        for b in burners:
            b.terminate()
    result.update(command=command_line(), environment=environment(), load=args.load)
    table = markdown_table(
        [
            "transport",
            "rounds",
            f"rounds with > {result['limit']} connections opened",
            "most opened in a round",
            "retries",
            "requests per round",
        ],
        [
            [
                mode,
                s["rounds"],
                s["rounds_over_limit"],
                s["max_connections_opened"],
                s["retries"],
                s["requests_per_round"],
            ]
            for mode, s in result["summary"].items()
        ],
    )
    print(table)
    print("saved", save("pool_churn", result, args.out))


if __name__ == "__main__":
    main()
