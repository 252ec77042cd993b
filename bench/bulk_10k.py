"""``embed_documents`` of 10,000 texts: ours vs the stock LangChain and LlamaIndex clients.

Side by side in one run, each client in its own fresh subprocess (so its peak RSS is
its own and no pool is shared), against the same loopback server in another process:

- ``ours`` / ``ours_async``: ``EmbeddingClient.embed_documents`` /
  ``AsyncEmbeddingClient.embed_documents`` (defaults: 32 texts per request, 4 in
  flight, base64);
- ``ours_array``: ``EmbeddingClient.embed_documents_array`` (float32 ``n x dim``, no
  Python lists);
- ``ours_tuned``: ``EmbeddingClient(batch_size=256, max_concurrency=8)``: fewer, larger
  requests, more in flight (what pays off when each request costs a network round trip);
- ``ours_langchain``: ``QwenPooledEmbeddings().embed_documents`` (our LangChain adapter);
- ``ours_llamaindex``: ``QwenPooledEmbedding().get_text_embedding_batch``;
- ``langchain_openai`` (+ ``_async``): ``langchain_openai.OpenAIEmbeddings(
  check_embedding_ctx_length=False)`` with its other defaults (1,000 texts per
  request, sequential; ``aembed_documents`` for the async one);
- ``llamaindex_openai_like`` (+ ``_async``): ``OpenAILikeEmbedding`` with its defaults
  (10 texts per request; ``aget_text_embedding_batch`` fires every batch at once).

Measured: texts/s (wall time of the embedding call only), client CPU, TCP connections
the server accepted during the run, peak RSS of the client process (and its RSS before
embedding, after imports and loading the texts). Three vectors of each result are
checked against the server's known embedding. Medians of ``--repeats``.

    python bench/bulk_10k.py [--quick] [--texts N] [--repeats R]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import (
    command_line,
    environment,
    markdown_table,
    median,
    peak_rss_mb,
    process_cpu_seconds,
    save,
)

WORKERS = (
    "ours",
    "ours_array",
    "ours_async",
    "ours_tuned",
    "ours_langchain",
    "ours_llamaindex",
    "langchain_openai",
    "langchain_openai_async",
    "llamaindex_openai_like",
    "llamaindex_openai_like_async",
)
STOCK = ("langchain_openai", "llamaindex_openai_like")


def _embed(worker: str, base_url: str, model: str, texts: list[str]) -> Any:
    if worker == "ours":
        from qwen_embed_plugins import EmbeddingClient

        return EmbeddingClient(base_url=base_url, model=model).embed_documents(texts)
    if worker == "ours_array":
        from qwen_embed_plugins import EmbeddingClient

        return EmbeddingClient(base_url=base_url, model=model).embed_documents_array(texts)
    if worker == "ours_tuned":
        from qwen_embed_plugins import EmbeddingClient

        tuned = EmbeddingClient(base_url=base_url, model=model, batch_size=256, max_concurrency=8)
        return tuned.embed_documents(texts)
    if worker == "ours_async":
        from qwen_embed_plugins import AsyncEmbeddingClient

        async def run() -> Any:
            return await AsyncEmbeddingClient(base_url=base_url, model=model).embed_documents(texts)

        return asyncio.run(run())
    if worker == "ours_langchain":
        from qwen_embed_plugins import QwenPooledEmbeddings

        return QwenPooledEmbeddings(base_url=base_url, model=model).embed_documents(texts)
    if worker == "ours_llamaindex":
        from qwen_embed_plugins import QwenPooledEmbedding

        return QwenPooledEmbedding(base_url=base_url, model_name=model).get_text_embedding_batch(
            texts
        )
    if worker.startswith("langchain_openai"):
        from langchain_openai import OpenAIEmbeddings

        lc = OpenAIEmbeddings(
            model=model, base_url=base_url, api_key="EMPTY", check_embedding_ctx_length=False
        )
        if worker.endswith("_async"):
            return asyncio.run(lc.aembed_documents(texts))
        return lc.embed_documents(texts)
    if worker.startswith("llamaindex_openai_like"):
        from llama_index.embeddings.openai_like import OpenAILikeEmbedding

        li = OpenAILikeEmbedding(model_name=model, api_base=base_url, api_key="EMPTY")
        if worker.endswith("_async"):
            return asyncio.run(li.aget_text_embedding_batch(texts))
        return li.get_text_embedding_batch(texts)
    raise ValueError(worker)


def worker_main(worker: str, base_url: str, model: str, n: int) -> None:
    """Runs in the subprocess: embed, check, print one JSON line."""
    import numpy as np

    from qwen_embed_plugins._corpus import corpus
    from qwen_embed_tooling.testing import expected_embedding

    texts = corpus(n, unique=True)
    # import everything the worker needs before the clock starts
    _ = _embed.__code__
    if worker.startswith("langchain"):
        import langchain_openai  # noqa: F401
    elif worker.startswith("llamaindex"):
        import llama_index.embeddings.openai_like  # noqa: F401
    elif worker == "ours_langchain":
        from qwen_embed_plugins import QwenPooledEmbeddings  # noqa: F401
    elif worker == "ours_llamaindex":
        from qwen_embed_plugins import QwenPooledEmbedding  # noqa: F401
    rss_before = peak_rss_mb()
    cpu0, t0 = time.process_time(), time.perf_counter()
    vectors = _embed(worker, base_url, model, texts)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    ok = len(vectors) == n and all(
        np.allclose(
            np.asarray(vectors[i], dtype=np.float32), expected_embedding(texts[i]), atol=1e-5
        )
        for i in (0, n // 2, n - 1)
    )
    pooled = None
    if worker.startswith("ours"):
        from qwen_embed_plugins import pool_stats

        pooled = sum(row["connections_opened"] for row in pool_stats().values())
    print(
        json.dumps(
            {
                "worker": worker,
                "texts": n,
                "seconds": seconds,
                "cpu_seconds": cpu,
                "rss_before_mb": rss_before,
                "peak_rss_mb": peak_rss_mb(),
                "correct": ok,
                "client_connections": pooled,
            }
        )
    )


def run_worker(worker: str, srv: Any, base_url: str, n: int) -> dict[str, Any]:
    before = srv.connections_opened
    server_cpu0 = process_cpu_seconds(srv.pid)
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            worker,
            "--base-url",
            base_url,
            "--model",
            srv.model,
            "--texts",
            str(n),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{worker} failed:\n{proc.stderr[-3000:]}")
    data: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    data["connections"] = srv.connections_opened - before
    server_cpu1 = process_cpu_seconds(srv.pid)
    # the server's CPU over the whole subprocess (its embedding call dominates)
    data["server_cpu_seconds"] = (
        server_cpu1 - server_cpu0
        if server_cpu0 is not None and server_cpu1 is not None
        else float("nan")
    )
    data["texts_per_s"] = n / data["seconds"]
    return data


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,000 texts, 1 repeat")
    parser.add_argument("--texts", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--only", action="append", choices=WORKERS, help="run only these")
    parser.add_argument(
        "--rtt-ms",
        type=float,
        default=0.0,
        help="emulated round trip through the delaying relay (default 0)",
    )
    parser.add_argument("--name", default=None, help="results file name")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    n = args.texts or (2000 if args.quick else 10_000)
    if args.worker:
        worker_main(args.worker, args.base_url, args.model, n)
        return None
    repeats = args.repeats or (1 if args.quick else 3)
    workers = tuple(args.only) if args.only else WORKERS
    from qwen_embed_tooling.testing import EmbeddingServer

    env = environment()
    runs: dict[str, list[dict[str, Any]]] = {w: [] for w in workers}
    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(EmbeddingServer(process=True))
        base_url = srv.base_url
        if args.rtt_ms > 0:
            from qwen_embed_tooling.bench.relay import Relay

            relay = stack.enter_context(
                Relay(("127.0.0.1", srv.port), rtt=args.rtt_ms / 1000.0, process=True)
            )
            base_url = f"http://127.0.0.1:{relay.port}/v1"
        for r in range(repeats):
            order = workers[r % len(workers) :] + workers[: r % len(workers)]
            for w in order:
                runs[w].append(run_worker(w, srv, base_url, n))
    summary = {
        w: {
            k: median([run[k] for run in rs])
            for k in (
                "texts_per_s",
                "seconds",
                "cpu_seconds",
                "server_cpu_seconds",
                "connections",
                "peak_rss_mb",
                "rss_before_mb",
            )
        }
        | {"correct": all(run["correct"] for run in rs)}
        for w, rs in runs.items()
    }
    result = {
        "benchmark": "bulk_10k",
        "command": command_line(),
        "environment": env,
        "texts": n,
        "repeats": repeats,
        "rtt_ms": args.rtt_ms,
        "summary": summary,
        "runs": runs,
    }
    save(args.name or "bulk_10k", result, args.json_path)
    print(render(result))
    return result


def render(result: dict[str, Any]) -> str:
    s = result["summary"]
    rows = []
    for w, m in s.items():
        vs = [f"{m['texts_per_s'] / s[b]['texts_per_s']:.1f}x" if b in s else "-" for b in STOCK]
        rows.append(
            [
                w,
                m["texts_per_s"],
                m["seconds"],
                m["cpu_seconds"],
                m["server_cpu_seconds"],
                int(m["connections"]),
                m["peak_rss_mb"],
                m["peak_rss_mb"] - m["rss_before_mb"],
                *vs,
                "yes" if m["correct"] else "NO",
            ]
        )
    headers = [
        "client",
        "texts/s",
        "wall s",
        "client CPU s",
        "server CPU s",
        "connections",
        "peak RSS MiB",
        "RSS growth MiB",
        "vs langchain_openai",
        "vs llamaindex_openai_like",
        "vectors correct",
    ]
    where = (
        f", emulated {result['rtt_ms']:g} ms round trip" if result.get("rtt_ms") else ", loopback"
    )
    return (
        f"### embed_documents of {result['texts']:,} texts{where} "
        f"(median of {result['repeats']})"
        f"\n\n`{result['command']}`\n\n" + markdown_table(headers, rows) + "\n"
    )


if __name__ == "__main__":
    main()
