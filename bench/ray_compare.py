"""Ray Data: ``embed_dataset`` vs Ray's own ``HttpRequestProcessorConfig``, and scaling.

Side by side in one run, on one local Ray instance, against the same loopback replicas
(``EmbeddingServer`` child processes, each adding ``--latency-ms`` to every request):

- ``embed_dataset``: ``qwen_embed_plugins.ray.embed_dataset`` (one client and pool per
  actor; ``--batch-size`` rows per call, 32 texts per request, ``--max-in-flight``
  requests in flight per actor, base64 vectors);
- ``ray_llm_http``: ``ray.data.llm.build_processor(HttpRequestProcessorConfig(url=...,
  concurrency=..., qps=...))`` in its documented usage: a ``preprocess`` that turns each
  row into one ``/v1/embeddings`` request (``payload``), a ``postprocess`` that takes the
  vector out of ``http_response``; its own knobs (``batch_size`` rows per call,
  ``concurrency`` actors, ``qps`` cap) left at their defaults unless given.

``embed_dataset`` gets the ``R`` replicas as one list of base URLs: every actor's client
balances over them (fewest requests in flight). Ray's processor takes one URL, so for it
a job over ``R`` replicas is run as ``R`` shards of the rows (by ``id mod R``), each
against one replica, as one Ray job (``Dataset.union``). (Before the client accepted a
list, ``embed_dataset`` was sharded the same way; ``replicas_supported`` keeps that path
for such versions.)

Measured per run: rows/s (wall time from building the plan to the last row consumed by
the driver), embedding requests and TCP connections counted by the servers, CPU seconds
of the servers and of Ray's worker processes (sampled from /proc), every row counted and
the first vector of every output batch checked against the server's known vector.

    python bench/ray_compare.py                      # 50,000 rows, 3 replicas, + scaling grid
    python bench/ray_compare.py --quick              # 5,000 rows, small grid
    python bench/ray_compare.py --cpu-per-row        # one actor's CPU per row, no Ray
"""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from _common import command_line, environment, markdown_table, process_cpu_seconds, save

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def texts_for(ids: Sequence[int]) -> list[str]:
    return [f"passage {i}: " + "lorem ipsum dolor " * (1 + i % 6) for i in ids]


def replicas_supported(urls: list[str]) -> bool:
    """Whether the core takes a list of replica base URLs yet."""
    from qwen_embed_plugins import ConfigError, EmbeddingConfig

    if len(urls) < 2:
        return True
    try:
        EmbeddingConfig(base_url=urls)  # type: ignore[arg-type]
    except ConfigError:
        return False
    return True


def share(actors: int, replicas: int) -> list[int]:
    """Actors per shard: ``actors`` spread over ``min(actors, replicas)`` shards."""
    groups = min(actors, replicas)
    return [actors // groups + (1 if i < actors % groups else 0) for i in range(groups)]


def dataset(ids: Sequence[int], rows_per_block: int) -> Any:
    import ray.data

    items = [{"id": i, "text": t} for i, t in zip(ids, texts_for(ids), strict=True)]
    return ray.data.from_items(items, override_num_blocks=max(1, len(items) // rows_per_block))


class WorkerCPU:
    """CPU seconds used by this Ray instance's worker processes (``ray::...``): /proc is
    sampled every 0.2 s so actors that exit during the run are counted up to their last
    sample. Also notes when the first embedding request reached a server (``servers``
    polled until then), to tell Ray's start-up from the embedding itself."""

    def __init__(self, servers: Sequence[Any] = ()) -> None:
        self._servers = list(servers)
        self.first_request_at = 0.0
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _workers() -> Iterator[int]:
        """Ray worker processes descended from this process (the local Ray instance this
        script started: driver -> raylet -> workers), not other Ray users' workers."""
        parent: dict[int, int] = {}
        ray_workers = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as fh:
                    parent[int(entry.name)] = int(fh.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                    if fh.read(5) == b"ray::":
                        ray_workers.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
        me = os.getpid()
        for pid in ray_workers:
            p, hops = pid, 0
            while p > 1 and p != me and hops < 16:
                p, hops = parent.get(p, 0), hops + 1
            if p == me:
                yield pid

    def _sample(self) -> None:
        for pid in self._workers():
            cpu = process_cpu_seconds(pid)
            if cpu is not None:
                self._first.setdefault(pid, cpu)
                self._last[pid] = cpu

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._sample()
            if not self.first_request_at and any(s.requests for s in self._servers):
                self.first_request_at = time.perf_counter()

    def __enter__(self) -> WorkerCPU:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def seconds(self) -> float:
        return sum(self._last[p] - self._first[p] for p in self._last)


def consume(ds: Any, column: str, check: Any) -> tuple[int, int, bool, float, int]:
    """Pull every row to the driver; check the first vector of each batch.

    Returns rows, batches checked, all correct, and when (perf_counter) and with how many
    rows the first batch arrived (to tell start-up from steady state)."""
    rows = checked = 0
    ok = True
    first_at, first_rows = 0.0, 0
    for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
        n = batch.num_rows
        rows += n
        if not first_at:
            first_at, first_rows = time.perf_counter(), n
        if n:
            got = np.asarray(batch.column(column)[0].as_py(), dtype=np.float32)
            want = check(batch.column("text")[0].as_py())
            ok = ok and bool(np.array_equal(got, want))
            checked += 1
    return rows, checked, ok, first_at, first_rows


def build_ours(ids: list[int], urls: list[str], actors: int, args: Any) -> tuple[Any, int]:
    from qwen_embed_plugins.ray import embed_dataset

    opts = {
        "batch_size": args.batch_size,
        "max_in_flight": args.max_in_flight,
        "num_cpus": args.actor_cpus,
    }
    if replicas_supported(urls):
        base: Any = urls if len(urls) > 1 else urls[0]
        return embed_dataset(
            dataset(ids, args.rows_per_block), base_url=base, concurrency=actors, **opts
        ), len(urls)
    counts = share(actors, len(urls))
    parts = [
        embed_dataset(
            dataset(ids[g :: len(counts)], args.rows_per_block),
            base_url=urls[g],
            concurrency=c,
            **opts,
        )
        for g, c in enumerate(counts)
    ]
    return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0], len(counts)


def build_ray_llm(ids: list[int], urls: list[str], actors: int, args: Any, model: str) -> Any:
    from ray.data.llm import HttpRequestProcessorConfig, build_processor

    counts = share(actors, len(urls))
    parts = []
    for g, c in enumerate(counts):
        config = HttpRequestProcessorConfig(
            url=f"{urls[g]}/embeddings",
            concurrency=c,
            qps=args.llm_qps,
            **({"batch_size": args.llm_batch_size} if args.llm_batch_size else {}),
        )
        processor = build_processor(
            config,
            preprocess=lambda row: {
                "payload": {"model": model, "input": row["text"], "encoding_format": "float"}
            },
            postprocess=lambda row: {
                "id": row["id"],
                "text": row["text"],
                "embedding": row["http_response"]["data"][0]["embedding"],
            },
        )
        parts.append(processor(dataset(ids[g :: len(counts)], args.rows_per_block)))
    return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]


def run(
    mode: str, rows: int, servers: list[Any], actors: int, replicas: int, args: Any
) -> dict[str, Any]:
    from qwen_embed_tooling.testing import expected_embedding

    used = servers[:replicas]
    urls = [s.base_url for s in used]
    dim = used[0].dim
    for s in servers:
        s.reset_counters()
    server_cpu0 = [process_cpu_seconds(s.pid) or 0.0 for s in used]
    ids = list(range(rows))
    with WorkerCPU(used) as workers:
        start = time.perf_counter()
        if mode == "embed_dataset":
            ds, replicas_used = build_ours(ids, urls, actors, args)
        else:
            ds = build_ray_llm(ids, urls, actors, args, used[0].model)
            replicas_used = len(share(actors, len(urls)))
        got, checked, ok, first_at, _first_rows = consume(
            ds, "embedding", lambda t: expected_embedding(t, dim)
        )
        end = time.perf_counter()
        seconds = end - start
    stats = [s.stats() for s in used]
    server_cpu = sum(
        (process_cpu_seconds(s.pid) or 0.0) - c0 for s, c0 in zip(used, server_cpu0, strict=True)
    )
    result = {
        "mode": mode,
        "rows": rows,
        "actors": actors,
        "replicas": replicas,
        "replicas_used": replicas_used,
        "client_replicas": replicas_supported(urls),
        "seconds": seconds,
        "rows_per_s": got / seconds,
        "first_batch_s": first_at - start,
        "first_request_s": workers.first_request_at - start if workers.first_request_at else None,
        # rows/s from the first request at a server (+-0.2 s) to the last row consumed
        "steady_rows_per_s": got / (end - workers.first_request_at)
        if workers.first_request_at
        else None,
        "rows_out": got,
        "rows_checked": checked,
        "correct": ok and got == rows,
        "requests": sum(st["requests"] for st in stats),
        "connections": sum(st["connections_opened"] for st in stats),
        "server_max_in_flight": max(st["max_in_flight"] for st in stats),
        "server_cpu_s": server_cpu,
        "ray_worker_cpu_s": workers.seconds,
    }
    print(
        f"{mode:14s} rows={rows} actors={actors} replicas={replicas} "
        f"-> {result['rows_per_s']:.0f} rows/s (steady {result['steady_rows_per_s'] or 0:.0f}, "
        f"first request at {result['first_request_s'] or 0:.1f} s), {result['requests']} requests, "
        f"{result['connections']} connections, worker CPU {workers.seconds:.1f} s, "
        f"server CPU {server_cpu:.1f} s, correct={result['correct']}",
        flush=True,
    )
    return result


def cpu_per_row(rows: int, repeats: int, batch_size: int) -> dict[str, Any]:
    """What one actor's work costs in CPU, without Ray: in this process, the same calls
    ``embed_dataset``'s actor makes per ``map_batches`` call (texts out of an Arrow
    table, ``embed_documents_array``, the Arrow output column), against a server in a
    child process (its CPU is not counted). The per-actor ceiling is 1 core / this."""
    import pyarrow as pa

    from qwen_embed_plugins import EmbeddingClient
    from qwen_embed_plugins.ray import _vectors_column
    from qwen_embed_tooling.testing import EmbeddingServer

    texts = texts_for(range(rows))
    runs = []
    with EmbeddingServer(process=True) as server:
        client = EmbeddingClient(base_url=server.base_url)
        client.embed_documents_array(texts[:64])  # detection, connections
        for _ in range(repeats):
            cpu, wall = time.process_time(), time.perf_counter()
            for i in range(0, rows, batch_size):
                table = pa.table({"text": texts[i : i + batch_size]})
                vectors = client.embed_documents_array(table.column("text").to_pylist())
                table.append_column("embedding", _vectors_column(vectors, vectors.shape[1]))
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            runs.append({"cpu_s": cpu, "wall_s": wall, "us_per_row": cpu / rows * 1e6})
    us = sorted(r["us_per_row"] for r in runs)[len(runs) // 2]
    print(f"CPU per row (median of {repeats}): {us:.0f} us -> {1e6 / us:,.0f} rows/s per core")
    return {"rows": rows, "batch_size": batch_size, "median_us_per_row": us, "runs": runs}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5,000 rows, grid 1/2 x 1/2")
    parser.add_argument("--rows", type=int, default=None, help="comparison rows (50,000)")
    parser.add_argument("--grid-rows", type=int, default=None, help="scaling rows (20,000)")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--actors", type=int, default=3, help="actors in the comparison")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="server latency")
    parser.add_argument("--batch-size", type=int, default=1024, help="rows per call (ours)")
    parser.add_argument("--max-in-flight", type=int, default=4)
    parser.add_argument("--actor-cpus", type=float, default=0.5, help="num_cpus per actor")
    parser.add_argument("--rows-per-block", type=int, default=1000)
    parser.add_argument("--ray-cpus", type=int, default=4, help="logical CPUs for ray.init")
    parser.add_argument("--llm-qps", type=int, default=None, help="Ray processor qps")
    parser.add_argument("--llm-batch-size", type=int, default=None)
    parser.add_argument("--no-ray-llm", action="store_true")
    parser.add_argument("--no-grid", action="store_true")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument(
        "--cpu-per-row",
        action="store_true",
        help="only measure one actor's CPU per row, without Ray (ray_cpu_per_row.json)",
    )
    args = parser.parse_args(argv)
    if args.cpu_per_row:
        data = {"benchmark": "ray_cpu_per_row", "command": command_line()}
        data["environment"] = environment()
        data |= cpu_per_row(args.rows or 50_000, max(3, args.repeats), args.batch_size)
        save("ray_cpu_per_row", data, args.json_path)
        return data
    rows = args.rows or (5000 if args.quick else 50_000)
    grid_rows = args.grid_rows or (5000 if args.quick else 20_000)
    actor_grid = (1, 2) if args.quick else (1, 2, 4)
    replica_grid = (1, 2) if args.quick else (1, 2, 3)

    import ray

    from qwen_embed_tooling.testing import EmbeddingServer

    env = environment()
    env["ray"] = ray.__version__
    ray.init(num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    n_servers = max(args.replicas, max(replica_grid))
    compare: list[dict[str, Any]] = []
    grid: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(EmbeddingServer(process=True, latency=args.latency_ms / 1000))
            for _ in range(n_servers)
        ]
        modes = ["embed_dataset"] + ([] if args.no_ray_llm else ["ray_llm_http"])
        for mode in modes:  # warm-up, not recorded: Ray's first job pays one-off costs
            run(mode, 1000, servers, 1, 1, args)
        for r in range(args.repeats):
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                compare.append(run(mode, rows, servers, args.actors, args.replicas, args))
            if not args.no_grid:
                cells = [(rep, a) for rep in replica_grid for a in actor_grid]
                for replicas, actors in cells if r % 2 == 0 else cells[::-1]:
                    grid.append(run("embed_dataset", grid_rows, servers, actors, replicas, args))
    ray.shutdown()
    result = {
        "benchmark": "ray_compare",
        "command": command_line(),
        "environment": env,
        "settings": {
            "latency_ms": args.latency_ms,
            "batch_size": args.batch_size,
            "request_batch_size": 32,
            "max_in_flight": args.max_in_flight,
            "actor_cpus": args.actor_cpus,
            "ray_logical_cpus": args.ray_cpus,
            "rows_per_block": args.rows_per_block,
            "llm_qps": args.llm_qps,
            "llm_batch_size": args.llm_batch_size or 64,
        },
        "repeats": args.repeats,
        "compare": medians(compare, ("mode", "actors", "replicas")),
        "grid": medians(grid, ("replicas", "actors")),
        "compare_runs": compare,
        "grid_runs": grid,
    }
    save("ray_compare", result, args.json_path)
    print(render(result))
    return result


def medians(runs: list[dict[str, Any]], key: tuple[str, ...]) -> list[dict[str, Any]]:
    """One row per ``key``: the median of each number over the repeats, ``correct`` only
    if every run was, in first-seen order."""
    import statistics

    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault(tuple(r[k] for k in key), []).append(r)
    out = []
    for rs in groups.values():
        row: dict[str, Any] = {}
        for k, v in rs[0].items():
            values = [r[k] for r in rs]
            if k == "correct":
                row[k] = all(values)
            elif isinstance(v, int | float) and not isinstance(v, bool) and None not in values:
                row[k] = statistics.median(values)
            else:
                row[k] = v
        row["runs"] = len(rs)
        out.append(row)
    return out


def render(result: dict[str, Any]) -> str:
    out = [f"`{result['command']}` (medians of {result.get('repeats', 1)})\n"]
    comp = result["compare"]
    if comp:
        ours = [r for r in comp if r["mode"] == "embed_dataset"]
        base = ours[0]["rows_per_s"] if ours else None
        rows = [
            [
                r["mode"],
                r["rows"],
                r["actors"],
                r["replicas_used"],
                r["rows_per_s"],
                r["steady_rows_per_s"],
                r["first_request_s"],
                f"{base / r['rows_per_s']:.1f}x" if base and r["mode"] != "embed_dataset" else "1x",
                r["requests"],
                r["connections"],
                r["ray_worker_cpu_s"],
                r["server_cpu_s"],
                "yes" if r["correct"] else "NO",
            ]
            for r in comp
        ]
        out.append(
            markdown_table(
                [
                    "client",
                    "rows",
                    "actors",
                    "replicas",
                    "rows/s",
                    "steady rows/s",
                    "first request s",
                    "embed_dataset is",
                    "requests",
                    "connections",
                    "Ray worker CPU s",
                    "server CPU s",
                    "vectors correct",
                ],
                rows,
            )
        )
    grid = result["grid"]
    if grid:
        actors = sorted({r["actors"] for r in grid})
        replicas = sorted({r["replicas"] for r in grid})
        cell = {(r["replicas"], r["actors"]): r for r in grid}
        table = []
        for rep in replicas:
            line: list[Any] = [f"{rep} replica{'s' if rep > 1 else ''}"]
            for a in actors:
                r = cell.get((rep, a))
                if r is None:
                    line.append("-")
                else:
                    text = f"{r['rows_per_s']:,.0f} / {r['steady_rows_per_s'] or 0:,.0f}"
                    if r["replicas_used"] < rep:
                        text += f" ({r['replicas_used']} used)"
                    line.append(text)
            table.append(line)
        out.append(
            f"\nrows/s of embed_dataset, {grid[0]['rows']:,} rows (whole job / from the first "
            "request at a server to the last row):\n\n"
            + markdown_table(["", *[f"{a} actor{'s' if a > 1 else ''}" for a in actors]], table)
        )
        util = [
            [
                r["replicas"],
                r["actors"],
                r["steady_rows_per_s"],
                r["ray_worker_cpu_s"] / r["seconds"],
                r["ray_worker_cpu_s"] / r["seconds"] / r["actors"],
                r["server_cpu_s"] / r["seconds"],
                r["server_max_in_flight"],
                r["connections"],
            ]
            for r in grid
        ]
        out.append(
            "\nwhere the time goes (CPU cores busy, averaged over the run):\n\n"
            + markdown_table(
                [
                    "replicas",
                    "actors",
                    "steady rows/s",
                    "Ray workers (cores)",
                    "per actor (cores)",
                    "servers (cores)",
                    "peak in flight at a server",
                    "connections",
                ],
                util,
            )
        )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
