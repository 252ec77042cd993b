"""Run the whole benchmark suite and check the project's performance targets.

    python bench/run_all.py            # the full suite (~10 minutes on 2 cores)
    python bench/run_all.py --quick    # a smoke run (~1-2 minutes)

Runs each script in its own process, one after another (never in parallel: they would
steal each other's CPU), then prints every table and a targets table computed from the
JSON results in ``bench/results/``. Everything is also written to
``bench/results/summary.md``. Needs the ``test`` extra (LangChain, LlamaIndex and the
loopback server's stack).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, environment, markdown_table

HERE = Path(__file__).resolve().parent
POOL_LIMIT = 20  # Limits.max_connections default


def scripts(quick: bool) -> list[tuple[str, list[str]]]:
    q = ["--quick"] if quick else []
    rtt_workers = [
        "ours",
        "ours_async",
        "ours_tuned",
        "langchain_openai",
        "langchain_openai_async",
        "llamaindex_openai_like",
        "llamaindex_openai_like_async",
    ]
    return [
        ("single_requests.py", q),
        ("encoding.py", q),
        ("bulk_10k.py", q),
        (
            "bulk_10k.py",
            [
                *q,
                "--rtt-ms",
                "40",
                "--repeats",
                "1",
                "--name",
                "bulk_10k_rtt40",
                *[a for w in rtt_workers for a in ("--only", w)],
            ],
        ),
        ("rtt_https.py", q),
    ]


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _row(
    target: str, measured: str, ratio: float, goal: float, *, higher: bool = True
) -> list[str]:
    met = ratio >= goal if higher else ratio <= goal
    if met:
        verdict = "met"
    elif higher:
        verdict = f"missed: {ratio:.2f} vs {goal:g} ({goal / ratio:.1f}x short)"
    else:
        verdict = f"missed by {ratio / goal - 1:.0%}"
    return [target, measured, verdict]


def targets() -> str:
    rows: list[list[str]] = []
    rtt = load("rtt_https")
    if rtt:
        for phase, per in rtt["summary"].items():
            conc = phase[1:]
            a = per["pooled_async"]["ratio_vs_naive"]
            rows.append(
                _row(
                    f"pooled async >= 10x naive per request (HTTPS + "
                    f"{rtt['rtt_ms']:g} ms, concurrency {conc})",
                    f"{a:.1f}x (vs naive with certifi roots: "
                    f"{a / per['naive_certifi']['ratio_vs_naive']:.1f}x)",
                    a,
                    10,
                )
            )
            b = per["pooled_batched"]["ratio_vs_naive"]
            rows.append(
                _row(
                    f"batched embed_documents >= 50x naive per text (concurrency {conc})",
                    f"{b:.1f}x",
                    b,
                    50,
                )
            )
            worst = max(
                per[m]["connections_opened"] or 0
                for m in ("pooled_threads", "pooled_async", "pooled_async_http2", "pooled_batched")
            )
            rows.append(
                _row(
                    f"pooled connections <= pool limit {POOL_LIMIT} (concurrency {conc})",
                    f"at most {worst:.0f}",
                    worst,
                    POOL_LIMIT,
                    higher=False,
                )
            )
    for name in ("bulk_10k", "bulk_10k_rtt40"):
        bulk = load(name)
        if not bulk:
            continue
        s = bulk["summary"]
        where = f"{bulk['texts']:,} texts" + (
            f", {bulk['rtt_ms']:g} ms RTT" if bulk.get("rtt_ms") else ", loopback"
        )
        for ours in ("ours", "ours_array", "ours_async", "ours_tuned"):
            for stock in ("langchain_openai", "llamaindex_openai_like"):
                if ours in s and stock in s:
                    r = s[ours]["texts_per_s"] / s[stock]["texts_per_s"]
                    rows.append(_row(f">= 3x {stock} ({ours}, {where})", f"{r:.2f}x", r, 3))
        for ours in (
            "ours",
            "ours_array",
            "ours_async",
            "ours_tuned",
            "ours_langchain",
            "ours_llamaindex",
        ):
            if ours in s:
                c = s[ours]["connections"]
                rows.append(
                    _row(
                        f"{ours} connections <= {POOL_LIMIT} ({where})",
                        f"{c:.0f}",
                        c,
                        POOL_LIMIT,
                        higher=False,
                    )
                )
    single = load("single_requests")
    if single:
        seq = single["summary"]["sequential"]
        for ours, raw in (("ours_sync", "raw_sync"), ("ours_async", "raw_async")):
            r = seq[ours]["cpu_ms_per_request"] / seq[raw]["cpu_ms_per_request"]
            rows.append(
                _row(
                    f"client CPU per request <= 1.3x raw floor ({ours} vs {raw})",
                    f"{seq[ours]['cpu_ms_per_request']:.3f} vs "
                    f"{seq[raw]['cpu_ms_per_request']:.3f} ms = {r:.2f}x",
                    r,
                    1.3,
                    higher=False,
                )
            )
    return "### Targets\n\n" + markdown_table(["target", "measured", "verdict"], rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small, single-repeat runs")
    args = parser.parse_args()
    started = time.perf_counter()
    env = environment()
    parts = [
        f"## Benchmark results ({'quick' if args.quick else 'full'} run)\n\n"
        f"`python bench/run_all.py{' --quick' if args.quick else ''}` on "
        f"{env['cpus']} CPUs, Python {env['python']}, openai {env['openai']} "
        f"({env['http_library']}), load average {env['load_1min_at_start']} at start, "
        f"{env['when']}.\n"
    ]
    for script, extra in scripts(args.quick):
        cmd = [sys.executable, str(HERE / script), *extra]
        print(f"$ python bench/{script} {' '.join(extra)}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=HERE.parent)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
            raise SystemExit(f"bench/{script} failed")
        text = proc.stdout
        # keep the markdown, drop progress lines
        parts.append("\n" + text[text.index("###") :] if "###" in text else text)
    parts.append("\n" + targets())
    parts.append(f"\nTotal time: {time.perf_counter() - started:.0f} s.\n")
    report = "".join(parts)
    (RESULTS / "summary.md").write_text(report, encoding="utf-8")
    print(report)


if __name__ == "__main__":
    main()
