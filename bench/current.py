"""Re-measure every figure of docs/benchmarks.md's "Current figures" section, in one go.

    python bench/current.py            # ~15-20 minutes on 2 loaded cores
    python bench/current.py --quick    # a smoke run of the same steps (~3 minutes)

Runs each step below in its own process, one after another (never in parallel: they
would steal each other's CPU). Every step measures its variants side by side, in
interleaved rounds (an order rotated each round), fresh processes where the step says
so; the tables are medians over rounds. Prints, ready to paste into the page, the commit,
the machine and load, and each step's command and tables; also writes them to
``bench/results/current.md``.

The repeat counts are chosen to fit ~20 minutes on 2 loaded cores: 3 rounds for the
CPU floors, 2 for throughput (its 10,000-text constant model and the capacity grid take
~5 minutes a round under load), 2 repeats of the seed's table, 5 fresh processes per
variant for the cold start, 7 rounds for the adapters' per-query cost. Differences under
~10% between two runs are noise on such a machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

_CPU_ROWS = ["--only", "single_sync", "--only", "single_async", "--only", "batch_sync"]

# (title, script and arguments, the same in --quick)
STEPS: list[tuple[str, list[str], list[str]]] = [
    (
        "Client CPU per request: sync and async single queries, the array path",
        ["compare.py", *_CPU_ROWS, "--rounds", "3"],
        ["compare.py", *_CPU_ROWS, "--quick"],
    ),
    (
        "Throughput with default settings vs the stock adapters",
        ["throughput.py", "--models", "constant,gpu_dynamic", "--rounds", "2"],
        ["throughput.py", "--models", "constant,gpu_dynamic", "--quick"],
    ),
    (
        "The seed's table: HTTPS + 40 ms round trip",
        ["rtt_https.py", "--repeats", "2"],
        ["rtt_https.py", "--quick"],
    ),
    (
        "The first requests of a fresh process (sync, 16 threads)",
        ["cold_start.py", "--rounds", "5"],
        ["cold_start.py", "--rounds", "1", "--requests", "48"],
    ),
    (
        "The first requests of a fresh process (async, 16 tasks)",
        ["cold_start.py", "--rounds", "5", "--async"],
        ["cold_start.py", "--rounds", "1", "--requests", "48", "--async"],
    ),
    (
        "What each adapter adds per query",
        ["adapter_overhead.py", "--rounds", "7"],
        ["adapter_overhead.py", "--rounds", "1", "--queries", "60"],
    ),
]


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return out.stdout.strip()


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one round")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "current.md")
    args = parser.parse_args(argv)

    import openai

    dirty = " (with uncommitted changes)" if _git("status", "--porcelain") else ""
    parts = [
        f"Commit {_git('rev-parse', '--short', 'HEAD')}{dirty}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; Python "
        f"{sys.version.split()[0]}, openai {openai.__version__}, {os.cpu_count()} CPUs; "
        f"load {_load()} at the start.\n"
    ]
    started = time.perf_counter()
    failed = 0
    for title, full, quick in STEPS:
        cmd = quick if args.quick else full
        shown = "python bench/" + " ".join(cmd)
        print(f"[current] {shown} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(HERE / cmd[0]), *cmd[1:]],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        seconds = time.perf_counter() - t0
        body = "\n".join(
            line for line in proc.stdout.splitlines() if not line.startswith("repeat ")
        ).strip()
        if proc.returncode != 0:
            failed += 1
            body += f"\n\nFAILED (exit {proc.returncode}):\n\n```\n{proc.stderr[-3000:]}\n```"
        parts.append(
            f"\n#### {title}\n\n`{shown}` ({seconds / 60:.1f} min, load {_load()} after)\n\n"
            f"{body}\n"
        )
    parts.append(
        f"\nAll steps: {(time.perf_counter() - started) / 60:.1f} min; load {_load()} at the end.\n"
    )
    text = "".join(parts)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
