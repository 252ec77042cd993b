"""Memory of the list API and of ``qwen-embed embed`` (issue 14, item 6).

Two measurements, each client in a fresh subprocess against the loopback server
(``EmbeddingServer(process=True)``, 1,024-dim base64 vectors) in another process:

1. ``lists``: ``EmbeddingClient.embed_documents`` of N distinct texts (default 10,000).
   RSS growth = peak RSS (``ru_maxrss``) minus the RSS just before the call (after
   imports, the texts, the client and a warm-up request). What the returned lists
   themselves occupy: in RSS, measured in another fresh subprocess that builds the same
   shape of lists from a random float32 array and frees the array (the allocator rounds
   each 24-byte float object up, so ``sys.getsizeof`` sums, also reported, undercount).
   Ratio = growth / lists; the target is <= 1.2 (no second full copy kept while the
   lists are built).
   The same for ``embed_documents_array`` against the size of its float32 array.
2. ``cli``: ``qwen-embed embed INPUT.txt OUTPUT.npy`` on 10,000 and on 100,000 texts:
   the CLI process's peak RSS (``ru_maxrss`` of the child, from ``wait4``). Flat means
   100k / 10k close to 1 (the output is written as it goes; at most ``--chunk-size``
   texts are held).

    python bench/memory.py [--texts 10000] [--cli-texts 10000 100000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import command_line, environment, markdown_table, save

HERE = Path(__file__).resolve().parent


def _rss_now_mib() -> float:
    with open("/proc/self/statm", encoding="ascii") as fh:
        pages = int(fh.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _deep_size_mib(rows: list[list[float]]) -> float:
    seen: set[int] = set()
    total = sys.getsizeof(rows)
    for row in rows:
        total += sys.getsizeof(row)
        for x in row:
            if id(x) not in seen:
                seen.add(id(x))
                total += sys.getsizeof(x)
    return total / (1 << 20)


def worker(kind: str, url: str, n: int) -> dict[str, Any]:
    """Runs in the subprocess: one call, its RSS growth and the result's own size."""
    import resource

    if kind == "reference":  # what n x dim Python floats in lists take in RSS
        import numpy as np

        before = _rss_now_mib()
        arr = np.random.default_rng(0).random((n, 1024), dtype=np.float32)
        rows = arr.tolist()
        del arr
        held = _rss_now_mib() - before
        return {"kind": kind, "texts": n, "rows": len(rows), "lists_rss_mib": held}

    import qwen_embed_plugins as q

    texts = [f"memory passage {i}: about item {i * 37 % 1009} and pooling" for i in range(n)]
    client = q.EmbeddingClient(base_url=url)
    client.embed_documents(["warm-up"])
    before = _rss_now_mib()
    if kind == "lists":
        result: Any = client.embed_documents(texts)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        own = _deep_size_mib(result)
        rows, dim = len(result), len(result[0])
    else:
        result = client.embed_documents_array(texts)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        own = result.nbytes / (1 << 20)
        rows, dim = result.shape
    return {
        "kind": kind,
        "texts": n,
        "rows": rows,
        "dim": dim,
        "rss_before_mib": before,
        "peak_rss_mib": peak,
        "growth_mib": peak - before,
        "result_mib": own,
        "growth_over_result": (peak - before) / own,
    }


def run_worker(kind: str, url: str, n: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--worker", kind, "--url", url, "--texts", str(n)],
        check=True,
        capture_output=True,
        text=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def run_cli(url: str, n: int, workdir: Path) -> dict[str, Any]:
    src = workdir / f"in_{n}.txt"
    with src.open("w", encoding="utf-8") as fh:
        for i in range(n):
            fh.write(f"cli passage {i}: a text about item {i * 37 % 1009}\n")
    dst = workdir / f"out_{n}.npy"
    exe = Path(sys.executable).with_name("qwen-embed")
    proc = subprocess.Popen(
        [str(exe), "embed", str(src), str(dst), "--base-url", url],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        err = proc.stderr.read().decode() if proc.stderr else ""
        raise RuntimeError(f"qwen-embed embed failed ({proc.returncode}): {err[-500:]}")
    if proc.stderr:
        proc.stderr.close()
    import numpy as np

    arr = np.load(dst, mmap_mode="r")
    if arr.shape[0] != n:
        raise RuntimeError(f"expected {n} rows, got {arr.shape}")
    return {
        "texts": n,
        "peak_rss_mib": usage.ru_maxrss / 1024.0,
        "output_mib": arr.nbytes / (1 << 20),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=10_000)
    parser.add_argument("--cli-texts", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--url", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.url, args.texts)))
        return {}

    from qwen_embed_tooling.testing import EmbeddingServer

    with EmbeddingServer(process=True) as srv, tempfile.TemporaryDirectory() as tmp:
        reference = run_worker("reference", srv.base_url, args.texts)
        calls = [run_worker(kind, srv.base_url, args.texts) for kind in ("lists", "array")]
        lists_rss = reference["lists_rss_mib"]
        calls[0]["lists_rss_mib"] = lists_rss
        calls[0]["growth_over_lists_rss"] = calls[0]["growth_mib"] / lists_rss
        cli = [run_cli(srv.base_url, n, Path(tmp)) for n in args.cli_texts]
    print(
        markdown_table(
            [
                "call",
                "texts",
                "RSS before MiB",
                "peak RSS MiB",
                "growth MiB",
                "result MiB",
                "growth / result",
            ],
            [
                [
                    c["kind"],
                    c["texts"],
                    f"{c['rss_before_mib']:.0f}",
                    f"{c['peak_rss_mib']:.0f}",
                    f"{c['growth_mib']:.0f}",
                    f"{c['result_mib']:.0f}",
                    f"{c['growth_over_result']:.2f}x",
                ]
                for c in calls
            ],
        )
    )
    print(
        f"\nthe same {args.texts:,} x 1,024 floats as lists hold {lists_rss:.0f} MiB of RSS "
        f"(built from an array that is then freed; getsizeof counts {calls[0]['result_mib']:.0f}: "
        f"the allocator rounds each 24-byte float up); embed_documents grew RSS by "
        f"{calls[0]['growth_over_lists_rss']:.2f}x that\n"
    )
    base = cli[0]["peak_rss_mib"]
    print(
        markdown_table(
            ["qwen-embed embed", "peak RSS MiB", "vs the smallest", "output MiB"],
            [
                [
                    f"{c['texts']:,} texts",
                    f"{c['peak_rss_mib']:.0f}",
                    f"{c['peak_rss_mib'] / base:.2f}x",
                    f"{c['output_mib']:.0f}",
                ]
                for c in cli
            ],
        )
    )
    data = {
        "benchmark": "memory",
        "command": command_line(),
        "environment": environment(),
        "reference": reference,
        "calls": calls,
        "cli": cli,
    }
    path = save("memory", data, args.json_path)
    print(f"\nwrote {path}")
    return data


if __name__ == "__main__":
    main()
