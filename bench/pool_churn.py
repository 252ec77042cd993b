"""Connection churn of the shared sync pool under thread contention: ours vs raw httpx.

httpcore's sync pool, with more requests than connections queued inside it, can close a
connection another thread has just released or been given and open a replacement
(encode/httpcore#1110): a run then opens more TCP connections than ``max_connections``,
though never more at once. The library's blocking HTTP/1.1 transport is urllib3's
``HTTPConnectionPool`` with ``maxsize=max_connections`` and ``block=True``
(``qwen_embed_plugins._transport._http11``): a connection is only opened into a free slot of a
bounded queue, so a run can never open more than the limit while all of them stay alive.

This script shows both side by side in one run: rounds alternate between ``ours``
(``--threads`` threads, each ``EmbeddingClient.embed_documents`` of ``--texts`` texts with
``max_concurrency`` 4: more requests than connections, all on the shared pool) and
``httpx`` (one raw ``httpx.Client`` of the same connection limit, the same batches of 32
sent by ``threads x 4`` worker threads). Connections opened are counted by the library
(``pool_stats()``) and by httpcore's ``trace`` extension for raw httpx.

The race needs a busy machine: ``--load N`` runs N CPU-burning processes meanwhile (the
CI machines are shared). Against a real server, e.g. Infinity from
``scripts/realserver.py start``:

    python bench/pool_churn.py --base-url http://127.0.0.1:7997/v1 \\
        --model Qwen/Qwen3-Embedding-0.6B --rounds 10 --load 2

With no ``--base-url``, a local ``EmbeddingServer`` (20 ms per request) in a child
process is used.
"""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from _common import command_line, environment, markdown_table, save

import qwen_embed_plugins as q
from qwen_embed_plugins._corpus import corpus
from qwen_embed_plugins._transport._http import httpx


def _burn(stop_at: float) -> None:  # pragma: no cover - a CPU load for the benchmark
    while time.monotonic() < stop_at:
        pass


def _ours(base_url: str, model: str, chunks: list[list[str]]) -> dict[str, int]:
    q.close_all()
    label = q.EmbeddingConfig(base_url=base_url).endpoint
    before = dict(q.pool_stats().get(label, {}))  # the counters outlive close_all()
    clients = [q.EmbeddingClient(base_url=base_url, model=model, max_concurrency=4) for _ in chunks]
    with ThreadPoolExecutor(len(chunks)) as ex:
        list(ex.map(lambda c, t: c.embed_documents(t), clients, chunks))
    after = q.pool_stats()[label]
    q.close_all()
    return {
        k: int(after[k]) - int(before.get(k, 0))
        for k in ("connections_opened", "requests", "retries")
    }


def _raw_httpx(base_url: str, model: str, chunks: list[list[str]], limit: int) -> dict[str, int]:
    opened = 0
    lock = threading.Lock()

    def trace(event: str, info: dict[str, Any]) -> None:
        nonlocal opened
        if event == "connection.connect_tcp.complete":
            with lock:
                opened += 1

    batches = [chunk[i : i + 32] for chunk in chunks for i in range(0, len(chunk), 32)]
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    with httpx.Client(limits=limits, timeout=60.0) as client:

        def post(batch: list[str]) -> None:
            r = client.post(
                base_url.rstrip("/") + "/embeddings",
                json={"input": batch, "model": model, "encoding_format": "base64"},
                extensions={"trace": trace},
            )
            r.raise_for_status()

        with ThreadPoolExecutor(len(chunks) * 4) as ex:
            list(ex.map(post, batches))
    return {"connections_opened": opened, "requests": len(batches), "retries": 0}


def run(base_url: str, model: str, rounds: int, threads: int, texts: int) -> dict[str, Any]:
    words = corpus()
    # short texts (the first 80 characters of each passage): the pool, not the model, is
    # what is measured
    chunks = [
        [words[(t * texts + i) % len(words)][:80] for i in range(texts)] for t in range(threads)
    ]
    limit = q.Limits().max_connections
    rows: dict[str, list[dict[str, int]]] = {"ours": [], "httpx": []}
    for r in range(rounds):
        for mode in ("ours", "httpx") if r % 2 == 0 else ("httpx", "ours"):
            if mode == "ours":
                rows[mode].append(_ours(base_url, model, chunks))
            else:
                rows[mode].append(_raw_httpx(base_url, model, chunks, limit))
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
            from qwen_embed_tooling.testing import EmbeddingServer

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
