"""Throughput with DEFAULT settings: ours vs the stock adapters, and vs the server's capacity.

Each server model is a real HTTP server (``qwen_embed_tooling.testing.EmbeddingServer``,
``process=True``) in its own process; each client run is a fresh subprocess (its own
pool, nothing learned beforehand: what a user's first call gets), timed around the
embedding call only:

- ``constant``: 20 ms per request whatever the batch (a remote server with spare
  capacity, a network-bound link);
- ``gpu_serial``: ``GPULike(slots=1, base=5 ms, per_token=0.05 ms)``, one batch at a
  time, FIFO;
- ``gpu_dynamic``: ``DynamicBatching(window=2 ms, max_tokens=8192, base=5 ms,
  per_token=0.05 ms)``: requests merged server-side into passes, one pass at a time;
- ``infinity``: the real Infinity server (CPU, in its own process), both of its models:
  the tiny random-weight Qwen3 and MiniLM. Started here by ``scripts/realserver.py
  start --port 0`` and stopped afterwards (or the one at ``QWEN_EMBED_REALSERVER_URL``);
  skipped, with the reason printed, when its venv and model are not cached
  (``python scripts/realserver.py setup`` installs them: minutes, 1.5 GB).

Clients, sync and async, each with its DEFAULT settings: ours (LangChain
``QwenPooledEmbeddings.embed_documents`` / ``aembed_documents``, LlamaIndex
``QwenPooledEmbedding.get_text_embedding_batch`` / ``aget_text_embedding_batch``) vs
``langchain_openai.OpenAIEmbeddings(check_embedding_ctx_length=False)`` and
``OpenAILikeEmbedding``. The ceiling: an ideal client (raw pooled httpx, threads, a
float32 array per batch) at the best static (batch size, requests in flight) of a grid,
found in the first round and re-measured in every round.

Variants run in interleaved rounds (order rotated each round, ``_harness.rotated``);
tables show medians. Ratios: ours / the best stock adapter of the same mode (sync or
async), ours / capacity (of the medians, and the median of each round's ours / the same
round's capacity: "per round", which a server drifting between rounds moves less), ours
async / ours sync.

    python bench/throughput.py [--quick] [--texts N] [--gpu-texts N] [--real-texts N] [--rounds R]
                               [--models constant,gpu_serial,...] [--json PATH]
    python bench/throughput.py --sizes 100,500,2000,10000 [--rounds R] [--json PATH]

``--sizes`` measures only ours async against ours sync on the constant
model, at each corpus size.

``--quick`` (CI): 300 texts, one round, the constant model only, clients in this
process: checks that the whole thing runs, its figures are not for reading.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import command_line, environment, markdown_table, median, rotated

OURS = {
    "sync": ("ours_langchain", "ours_llamaindex"),
    "async": ("ours_langchain_async", "ours_llamaindex_async"),
}
STOCK = {
    "sync": ("langchain_openai", "llamaindex_openai_like"),
    "async": ("langchain_openai_async", "llamaindex_openai_like_async"),
}
CLIENTS = (*OURS["sync"], *OURS["async"], *STOCK["sync"], *STOCK["async"])
GRID = ((256, 2), (256, 4), (1024, 2), (1024, 4), (2048, 2), (2048, 8))
QUICK_GRID = ((256, 4),)
REAL_GRID = ((32, 4), (64, 2), (128, 2), (512, 1), (512, 2), (1024, 1))
"""The real server's grid: a CPU server, whose capacity is tens to hundreds of texts/s and
whose per-request work favours large requests."""
MODELS = ("constant", "gpu_serial", "gpu_dynamic", "infinity")
TIMEOUT = 1800.0


# ----------------------------------------------------------------------------- servers


def server_kwargs(name: str) -> dict[str, Any]:
    """``EmbeddingServer`` arguments of a loopback server model."""
    from qwen_embed_tooling.testing import DynamicBatching, GPULike

    if name == "constant":
        return {"latency": 0.020}
    if name == "gpu_serial":
        return {"server_model": GPULike(slots=1, base=0.005, per_token=0.00005, queue_limit=4096)}
    if name == "gpu_dynamic":
        return {
            "server_model": DynamicBatching(
                window=0.002, max_tokens=8192, base=0.005, per_token=0.00005
            )
        }
    raise ValueError(name)


REALSERVER = Path(__file__).resolve().parents[1] / "scripts" / "realserver.py"


def _realserver(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REALSERVER), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def infinity_ready() -> str | None:
    """Why the real Infinity server cannot be started here, or ``None`` when it can: its
    venv and the tiny Qwen3 model are cached (``scripts/realserver.py setup``; this
    script never installs them, which takes minutes and 1.5 GB)."""
    if os.environ.get("QWEN_EMBED_REALSERVER_URL"):
        return None
    try:
        proc = _realserver("paths")
        paths = json.loads(proc.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        return f"scripts/realserver.py paths failed: {exc}"
    for key in ("venv", "model"):
        if not (Path(paths[key]) / ".qwen-embed-complete.json").exists():
            return (
                f"the real Infinity server is not set up ({paths[key]} missing: "
                "run `python scripts/realserver.py setup`)"
            )
    return None


@contextlib.contextmanager
def infinity_server() -> Iterator[tuple[str, list[str]]]:
    """(base URL, served model names) of a real Infinity server: the one at
    ``QWEN_EMBED_REALSERVER_URL`` if set (``/v1/models`` names its models), else one
    started here on a free port in its own process and stopped afterwards."""
    url = os.environ.get("QWEN_EMBED_REALSERVER_URL")
    if url:
        import httpx

        url = url.rstrip("/")
        listed = httpx.get(url + "/models", timeout=30).json()["data"]
        yield url, [str(m["id"]) for m in listed]
        return
    proc = _realserver("start", "--port", "0", "--json", timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/realserver.py start failed:\n{proc.stderr[-3000:]}")
    state = json.loads(proc.stdout.strip().splitlines()[-1])
    try:
        yield str(state["base_url"]).rstrip("/"), [str(m) for m in state["models"]]
    finally:
        _realserver("stop", "--port", str(state["port"]))


# ----------------------------------------------------------------------------- workers


def _offline_tiktoken() -> None:
    """LangChain / LlamaIndex may load a tiktoken file; with no internet, point tiktoken
    at the copy LlamaIndex ships (REAL-SERVERS.md)."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return
    with contextlib.suppress(ImportError):
        import llama_index.core

        cache = Path(llama_index.core.__file__).parent / "_static" / "tiktoken_cache"
        if cache.is_dir():
            os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)


def _client(worker: str, base_url: str, model: str, batch: int, conc: int) -> Any:
    """The embedding callable of ``worker`` (built before the clock starts)."""
    if worker.startswith("ours_langchain"):
        from qwen_embed_plugins import QwenPooledEmbeddings

        lc = QwenPooledEmbeddings(base_url=base_url, model=model)
        return lc.aembed_documents if worker.endswith("_async") else lc.embed_documents
    if worker.startswith("ours_llamaindex"):
        from qwen_embed_plugins import QwenPooledEmbedding

        li = QwenPooledEmbedding(base_url=base_url, model_name=model)
        if worker.endswith("_async"):
            return li.aget_text_embedding_batch
        return li.get_text_embedding_batch
    if worker.startswith("langchain_openai"):
        from langchain_openai import OpenAIEmbeddings

        stock = OpenAIEmbeddings(
            model=model, base_url=base_url, api_key="EMPTY", check_embedding_ctx_length=False
        )
        return stock.aembed_documents if worker.endswith("_async") else stock.embed_documents
    if worker.startswith("llamaindex_openai_like"):
        from llama_index.embeddings.openai_like import OpenAILikeEmbedding

        like = OpenAILikeEmbedding(model_name=model, api_base=base_url, api_key="EMPTY")
        if worker.endswith("_async"):
            return like.aget_text_embedding_batch
        return like.get_text_embedding_batch
    if worker == "capacity":
        from _harness import run_sync
        from _peers import Target, decode_array, httpx_sync

        call, close = httpx_sync(Target(base_url, model), decode_array, limit=max(conc, 1))

        def ideal(texts: list[str]) -> Any:
            batches = [texts[i : i + batch] for i in range(0, len(texts), batch)]
            try:
                # collect=False: embed_once collected before its clock; a collection
                # here would be timed (0.1-0.4 s in this process, which imports every peer)
                run_sync(call, batches, conc, collect=False)
            finally:
                close()
            return texts  # every batch was answered (a failure raises)

        return ideal
    raise ValueError(worker)


def worker_main(worker: str, base_url: str, model: str, n: int, batch: int, conc: int) -> None:
    """In the subprocess: embed ``n`` distinct passages once, print one JSON line."""
    print(json.dumps(embed_once(worker, base_url, model, n, batch, conc)))


def embed_once(
    worker: str, base_url: str, model: str, n: int, batch: int, conc: int
) -> dict[str, Any]:
    """Embed ``n`` distinct passages once with ``worker``; its figures.

    A full garbage-collection pass is run before the clock starts, and the full passes
    (generation 2) inside the timed call are counted (``gc_full_passes``): after
    LlamaIndex's import one costs ~0.1 s of CPU, and whichever call's allocations trip
    the interpreter's threshold pays it (issue 21: it made one adapter's async call
    0.45x its sync twin at 500 texts). Collecting first gives every client the same
    start; the count shows a pass that still lands inside a call."""
    _offline_tiktoken()
    from qwen_embed_plugins._corpus import corpus

    texts = corpus(n, unique=True)
    embed = _client(worker, base_url, model, batch, conc)
    gc.collect()
    full0 = gc.get_stats()[2]["collections"]
    cpu0, t0 = time.process_time(), time.perf_counter()
    asynchronous = asyncio.iscoroutinefunction(embed)
    result = asyncio.run(embed(texts)) if asynchronous else embed(texts)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {
        "gc_full_passes": gc.get_stats()[2]["collections"] - full0,
        "worker": worker,
        "texts": n,
        "rows": len(result),
        "seconds": seconds,
        "cpu_seconds": cpu,
        "texts_per_s": n / seconds,
    }


IN_PROCESS = False
"""``--quick``: run the clients in this process (faster; they share its pools and what
it learned, so the figures are for the report's shape, not for reading)."""


def run_worker(
    worker: str, srv: Any, base_url: str, model: str, n: int, batch: int = 0, conc: int = 0
) -> dict[str, Any]:
    before = srv.requests if srv is not None else 0
    if IN_PROCESS:
        data = embed_once(worker, base_url, model, n, batch, conc)
        data["requests"] = srv.requests - before if srv is not None else None
        return data
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            worker,
            "--base-url",
            base_url,
            "--model",
            model,
            "--texts",
            str(n),
            "--batch",
            str(batch),
            "--conc",
            str(conc),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=TIMEOUT,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{worker} failed:\n{proc.stderr[-3000:]}")
    data: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if data["rows"] != n:
        raise RuntimeError(f"{worker} returned {data['rows']} vectors for {n} texts")
    data["requests"] = srv.requests - before if srv is not None else None
    return data


# ----------------------------------------------------------------------------- driver


def sweep(sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    """``--sizes``: ours async against ours sync (both adapters) on the ``constant``
    model at each corpus size, interleaved rounds, medians (issue 21, Deliver 2)."""
    from qwen_embed_tooling.testing import EmbeddingServer

    out = []
    with EmbeddingServer(process=True, **server_kwargs("constant")) as srv:
        for n in sizes:
            print(f"[sizes] {n} texts, {rounds} round(s)", file=sys.stderr)
            runs: dict[str, list[dict[str, Any]]] = {w: [] for w in (*OURS["sync"], *OURS["async"])}
            for r in range(rounds):
                for w in rotated(list(runs), r):
                    runs[w].append(run_worker(w, srv, srv.base_url, srv.model, n))
            tps = {w: median([x["texts_per_s"] for x in rs]) for w, rs in runs.items()}
            out.append(
                {
                    "texts": n,
                    "texts_per_s": tps,
                    "async_vs_sync": {w: tps[f"{w}_async"] / tps[w] for w in OURS["sync"]},
                    "gc_full_passes": {
                        w: sum(x["gc_full_passes"] for x in rs) for w, rs in runs.items()
                    },
                }
            )
    return out


@contextlib.contextmanager
def _target(name: str) -> Iterator[tuple[Any, str, list[str]]]:
    """(server or None, base URL, models to embed with) of a server model."""
    if name == "infinity":
        with infinity_server() as (base_url, served):
            yield None, base_url, served
        return
    from qwen_embed_tooling.testing import EmbeddingServer

    with EmbeddingServer(process=True, **server_kwargs(name)) as srv:
        yield srv, srv.base_url, [srv.model]


def measure(
    name: str,
    base_url: str,
    model: str,
    srv: Any,
    n: int,
    rounds: int,
    grid: tuple[tuple[int, int], ...],
) -> dict[str, Any]:
    """Every client and the capacity probe on one server, interleaved rounds."""
    variants = [*CLIENTS, "capacity"]
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in variants}
    searched: dict[str, float] = {}
    best: tuple[int, int] = grid[0]
    for r in range(rounds):
        for variant in rotated(variants, r):
            if variant != "capacity":
                runs[variant].append(run_worker(variant, srv, base_url, model, n))
                continue
            if r == 0:  # find the best static setting once, then re-measure it
                for batch, conc in grid:
                    got = run_worker("capacity", srv, base_url, model, n, batch, conc)
                    searched[f"{batch}x{conc}"] = got["texts_per_s"]
                    if got["texts_per_s"] >= searched.get(f"{best[0]}x{best[1]}", 0.0):
                        best = (batch, conc)
            runs["capacity"].append(run_worker("capacity", srv, base_url, model, n, *best))
            print(f"  [{name}/{model}] round {r + 1}: capacity {best}", file=sys.stderr)
    rows = {
        v: {
            "texts_per_s": median([x["texts_per_s"] for x in rs]),
            "cpu_seconds": median([x["cpu_seconds"] for x in rs]),
            "requests": median([x["requests"] for x in rs if x["requests"] is not None])
            if srv is not None
            else None,
            "runs": [round(x["texts_per_s"], 1) for x in rs],
            "gc_full_passes": [x["gc_full_passes"] for x in rs],
        }
        for v, rs in runs.items()
    }
    capacity = rows["capacity"]["texts_per_s"]
    ratios: dict[str, dict[str, float]] = {}
    for mode in ("sync", "async"):
        stock = max(rows[s]["texts_per_s"] for s in STOCK[mode])
        for ours in OURS[mode]:
            mine = rows[ours]["texts_per_s"]
            ratios[ours] = {
                "vs_best_stock": mine / stock,
                "vs_capacity": mine / capacity,
                # each round's run over the same round's capacity run, then the median: a
                # server whose speed drifts between rounds (Infinity on the client's cores)
                # moves both sides of each pair
                "vs_capacity_per_round": median(
                    [
                        a["texts_per_s"] / b["texts_per_s"]
                        for a, b in zip(runs[ours], runs["capacity"], strict=True)
                    ]
                ),
            }
            if mode == "async":
                ratios[ours]["vs_own_sync"] = (
                    mine / rows[ours.removesuffix("_async")]["texts_per_s"]
                )
    return {
        "server": name,
        "model": model,
        "texts": n,
        "capacity_setting": {"batch": best[0], "in_flight": best[1]},
        "capacity_grid": searched,
        "rows": rows,
        "ratios": ratios,
    }


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few texts, one round (for CI)")
    ap.add_argument("--texts", type=int, default=None, help="passages (default 10,000)")
    ap.add_argument(
        "--gpu-texts",
        type=int,
        default=None,
        help="passages on the GPU-like servers, whose capacity is a few hundred texts/s "
        "(default 2,000)",
    )
    ap.add_argument(
        "--real-texts",
        type=int,
        default=None,
        help="passages on the real Infinity server (a CPU server on the same cores: default 200)",
    )
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3)")
    ap.add_argument(
        "--models",
        default=None,
        help=f"comma-separated, of {', '.join(MODELS)} (default: all; --quick: constant)",
    )
    ap.add_argument(
        "--real-models",
        default=None,
        help="comma-separated: only these of the Infinity server's models (default: all)",
    )
    ap.add_argument(
        "--sizes",
        default=None,
        help="comma-separated corpus sizes: instead of the table, ours async vs ours sync "
        "on the constant model at each size",
    )
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--base-url", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--conc", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.base_url, args.model, args.texts, args.batch, args.conc)
        return None
    global IN_PROCESS
    IN_PROCESS = args.quick
    texts = args.texts or (300 if args.quick else 10_000)
    gpu_texts = args.gpu_texts or (60 if args.quick else 2_000)
    real_texts = args.real_texts or (60 if args.quick else 200)
    rounds = args.rounds or (1 if args.quick else 3)
    grid = QUICK_GRID if args.quick else GRID
    chosen = args.models or ("constant" if args.quick else ",".join(MODELS))
    models = [m.strip() for m in chosen.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    if args.real_models and "infinity" not in models:
        ap.error("--real-models needs infinity in --models")
    if args.sizes:
        report = {
            "benchmark": "throughput-sizes",
            "command": command_line(),
            "environment": environment(),
            "rounds": rounds,
            "sizes": sweep([int(x) for x in args.sizes.split(",")], rounds),
        }
        return _finish(report, args.json_path, render_sizes)
    report: dict[str, Any] = {
        "benchmark": "throughput",
        "command": command_line(),
        "environment": environment(),
        "rounds": rounds,
        "texts": texts,
        "gpu_texts": gpu_texts,
        "real_texts": real_texts,
        "results": [],
        "skipped": {},
    }
    for name in models:
        if name == "infinity":
            why = infinity_ready()
            if why is not None:
                report["skipped"][name] = why
                print(f"skipping infinity: {why}", file=sys.stderr)
                continue
        n = {"constant": texts, "infinity": real_texts}.get(name, gpu_texts)
        with _target(name) as (srv, base_url, served):
            if name == "infinity" and args.real_models:
                wanted = [m.strip() for m in args.real_models.split(",") if m.strip()]
                if unknown := sorted(set(wanted) - set(served)):
                    ap.error(f"--real-models: not served: {unknown}; served: {served}")
                served = wanted
            for model in served:
                print(f"[{name}/{model}] {n} texts, {rounds} round(s)", file=sys.stderr)
                g = grid if name != "infinity" or args.quick else REAL_GRID
                report["results"].append(measure(name, base_url, model, srv, n, rounds, g))
    return _finish(report, args.json_path, render)


def _finish(
    report: dict[str, Any], json_path: Path | None, show: Callable[[dict[str, Any]], str]
) -> dict[str, Any]:
    """Stamp the load at the end, write the JSON (if asked), print the tables."""
    report["environment"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    if json_path:
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    print(show(report))
    return report


def render(report: dict[str, Any]) -> str:
    """Markdown tables of a report."""
    env = report["environment"]
    lines = [
        f"`{report['command']}` — medians of {report['rounds']} interleaved round(s); "
        f"load average {env.get('load_avg_at_start')} at start, "
        f"{env.get('load_avg_at_end')} at end; {env.get('cpus')} CPUs",
        "",
    ]
    rows = []
    for res in report["results"]:
        r = res["rows"]
        cap = res["capacity_setting"]
        for mode in ("sync", "async"):
            stock = max(STOCK[mode], key=lambda s: r[s]["texts_per_s"])
            for ours in OURS[mode]:
                q = res["ratios"][ours]
                rows.append(
                    [
                        f"{res['server']} ({res['model'].split('/')[-1]}, {res['texts']:,})",
                        ours,
                        r[ours]["texts_per_s"],
                        "-" if r[ours]["requests"] is None else r[ours]["requests"],
                        f"{stock} {r[stock]['texts_per_s']:,.0f}",
                        f"{q['vs_best_stock']:.2f}x",
                        f"{r['capacity']['texts_per_s']:,.0f} ({cap['batch']}x{cap['in_flight']})",
                        f"{q['vs_capacity']:.0%}",
                        f"{q['vs_capacity_per_round']:.0%}",
                        f"{q['vs_own_sync']:.2f}x" if "vs_own_sync" in q else "-",
                    ]
                )
    headers = [
        "server (texts)",
        "ours (defaults)",
        "texts/s",
        "requests",
        "best stock texts/s",
        "ours / stock",
        "capacity (batch x in flight)",
        "ours / capacity",
        "per round",
        "async / sync",
    ]
    lines.append(markdown_table(headers, rows))
    for name, why in report["skipped"].items():
        lines.append(f"\n{name}: skipped ({why})")
    return "\n".join(lines) + "\n"


def render_sizes(report: dict[str, Any]) -> str:
    """The ``--sizes`` table."""
    env = report["environment"]
    rows = []
    for res in report["sizes"]:
        t, q, g = res["texts_per_s"], res["async_vs_sync"], res["gc_full_passes"]
        rows.append(
            [
                f"{res['texts']:,}",
                *(x for w in OURS["sync"] for x in (t[w], t[f"{w}_async"], f"{q[w]:.2f}x")),
                sum(g.values()),
            ]
        )
    headers = ["texts", "LangChain sync", "async", "async / sync"]
    headers += ["LlamaIndex sync", "async", "async / sync", "full GC passes in the calls"]
    return (
        f"`{report['command']}` — medians of {report['rounds']} interleaved round(s); "
        f"load average {env.get('load_avg_at_start')} at start, "
        f"{env.get('load_avg_at_end')} at end\n\n" + markdown_table(headers, rows) + "\n"
    )


if __name__ == "__main__":
    main()
