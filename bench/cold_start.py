"""The first requests of a fresh process: ours vs the seed's pooled client, side by side.

The seed's scenario: HTTPS, an emulated 40 ms network round trip, ``--requests`` single
queries (default 200) at ``--concurrency`` (default 16 threads, or tasks with
``--async``) from a process that has just built its client. The seed's own pooled client
is one shared ``openai.OpenAI`` (``openai.AsyncOpenAI``) whose httpx client is built
with the CA bundle, so it builds its SSL context when it is constructed; ours is
``EmbeddingClient`` (``AsyncEmbeddingClient``) with ``verify=<bundle path>``. The bundle
is certifi's public roots plus the test CA (``--trust bundle``, the default: what a
client verifying a real server loads, ~20 ms of CPU) or the test CA alone
(``--trust ca``).

Each variant runs in a FRESH subprocess per round (imports done before the clock
starts), in an order rotated each round. Reported per variant: construction time (ms),
the first request's latency, p50 / p95 / max latency of every request (the first wave
included: that is what "cold" means), wall time; then the median over rounds of the
per-round ratio ours / seed. ``--baseline DIR`` adds the library of another checkout
(a ``git worktree`` of an older commit) as the variant ``base``.

    python bench/cold_start.py [--rounds 5] [--requests 200] [--concurrency 16] [--async]
        [--trust bundle|ca] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

VARIANTS = ("ours", "seed")


def _texts(n: int) -> list[str]:
    return [f"what does the pooled client reuse, question {i}?" for i in range(n)]


def _stats(latencies: list[float], wall: float, construct: float, first: float) -> dict[str, Any]:
    from _harness import percentile

    lat = [x * 1000.0 for x in latencies]
    return {
        "construct_ms": construct * 1000.0,
        "first_ms": first * 1000.0,
        "p50_ms": percentile(lat, 50),
        "p95_ms": percentile(lat, 95),
        "max_ms": max(lat),
        "wall_s": wall,
    }


def child_sync(
    variant: str, base_url: str, model: str, ca: str, n: int, conc: int
) -> dict[str, Any]:
    import ssl

    import openai  # imported before the clock: both sides pay their imports up front

    from qwen_embed_plugins import EmbeddingClient

    texts = _texts(n)
    perf = time.perf_counter
    t0 = perf()
    if variant == "ours":
        client = EmbeddingClient(base_url=base_url, model=model, verify=ca)
        fn = client.embed_query
    else:
        sdk = openai.OpenAI(
            base_url=base_url,
            api_key="EMPTY",
            max_retries=0,
            http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=ca)),
        )

        def fn(text: str) -> Any:
            return sdk.embeddings.create(input=[text], model=model).data[0].embedding

    construct = perf() - t0
    latencies: list[float] = []
    firsts: list[float] = []
    lock = threading.Lock()
    it = iter(range(n))
    start = threading.Event()

    def worker() -> None:
        mine: list[float] = []
        start.wait()
        while True:
            with lock:
                i = next(it, None)
            if i is None:
                break
            a = perf()
            fn(texts[i])
            mine.append(perf() - a)
            if i == 0:
                firsts.append(mine[-1])
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(conc)]
    for th in threads:
        th.start()
    w0 = perf()
    start.set()
    for th in threads:
        th.join()
    return _stats(latencies, perf() - w0, construct, firsts[0])


async def child_async(
    variant: str, base_url: str, model: str, ca: str, n: int, conc: int
) -> dict[str, Any]:
    import ssl

    import openai

    from qwen_embed_plugins import AsyncEmbeddingClient

    texts = _texts(n)
    perf = time.perf_counter
    t0 = perf()
    if variant == "ours":
        client = AsyncEmbeddingClient(base_url=base_url, model=model, verify=ca)
        fn = client.embed_query
    else:
        sdk = openai.AsyncOpenAI(
            base_url=base_url,
            api_key="EMPTY",
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(
                verify=ssl.create_default_context(cafile=ca)
            ),
        )

        async def fn(text: str) -> Any:
            return (await sdk.embeddings.create(input=[text], model=model)).data[0].embedding

    construct = perf() - t0
    latencies: list[float] = []
    firsts: list[float] = []
    it = iter(range(n))

    async def worker() -> None:
        for i in it:
            a = perf()
            await fn(texts[i])
            latencies.append(perf() - a)
            if i == 0:
                firsts.append(latencies[-1])

    w0 = perf()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return _stats(latencies, perf() - w0, construct, firsts[0])


def run_child(args: argparse.Namespace) -> None:
    fields = (args.child, args.base_url, args.model, args.ca, args.requests, args.concurrency)
    out = asyncio.run(child_async(*fields)) if args.use_async else child_sync(*fields)
    print(json.dumps(out), flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rtt-ms", type=float, default=40.0)
    parser.add_argument("--async", dest="use_async", action="store_true")
    parser.add_argument("--trust", choices=("bundle", "ca"), default="bundle")
    parser.add_argument("--baseline", default=None, help="another checkout's root")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--ca", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_child(args)
        return {}

    from _harness import rotated

    from qwen_embed_tooling.bench.run import local_target

    variants = [*VARIANTS, "base"] if args.baseline else list(VARIANTS)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with (
        local_target(rtt_ms=args.rtt_ms, http2=False) as target,
        tempfile.TemporaryDirectory() as tmp,
    ):
        model = target.server.model
        ca = str(target.verify)
        if args.trust == "bundle":
            import certifi

            ca = os.path.join(tmp, "bundle.pem")
            with open(ca, "w") as out:
                out.write(Path(certifi.where()).read_text() + Path(str(target.verify)).read_text())
        for r in range(args.rounds):
            for v in rotated(variants, r):
                env = os.environ.copy()
                if v == "base":
                    root = os.path.abspath(args.baseline)
                    env["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "tooling")])
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    "ours" if v == "base" else v,
                    "--base-url",
                    target.base_url,
                    "--model",
                    model,
                    "--ca",
                    ca,
                    "--requests",
                    str(args.requests),
                    "--concurrency",
                    str(args.concurrency),
                ]
                if args.use_async:
                    cmd.append("--async")
                proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
                runs[v].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    keys = list(runs["ours"][0])
    med = {v: {k: statistics.median(s[k] for s in runs[v]) for k in keys} for v in variants}
    ratios = {
        v: {
            k: statistics.median(o[k] / s[k] for o, s in zip(runs[v], runs["seed"], strict=True))
            for k in ("first_ms", "p50_ms", "p95_ms", "max_ms", "wall_s")
        }
        for v in variants
        if v != "seed"
    }
    mode = "async tasks" if args.use_async else "threads"
    print(
        f"cold start, HTTPS + {args.rtt_ms:g} ms RTT, {args.requests} queries, "
        f"concurrency {args.concurrency} ({mode}), trust {args.trust}, "
        f"medians of {args.rounds} fresh processes each\n"
    )
    print("| client | construct ms | first ms | p50 ms | p95 ms | max ms | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for v in variants:
        m = med[v]
        print(
            f"| {v} | {m['construct_ms']:.1f} | {m['first_ms']:.1f} | {m['p50_ms']:.1f} | "
            f"{m['p95_ms']:.1f} | {m['max_ms']:.1f} | {m['wall_s']:.2f} |"
        )
    for v, ratio in ratios.items():
        print(
            f"{v} / seed (median of per-round ratios): "
            + ", ".join(f"{k} {x:.2f}x" for k, x in ratio.items())
        )
    return {"runs": runs, "median": med, "ratios": ratios}


if __name__ == "__main__":
    main()
