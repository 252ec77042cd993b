"""The seed's table, reproduced: HTTPS with an emulated 40 ms network round trip.

The measurement that started the project: a new ``openai.OpenAI`` per request (482 ms,
2.1 req/s, 200 TCP connections for 200 requests) vs one pooled client (136 ms,
7.3 req/s, <= 20 connections). Here the loopback server runs in a child process with
HTTPS (a trustme test CA) behind a relay that holds every chunk for RTT/2 in each
direction and charges one RTT for the TCP handshake (``qwen_embed_tooling.bench.relay``),
so TCP + TLS set-up costs what it costs remotely.

It runs ``qwen_embed_tooling.bench.run.run_bench`` (what ``qwen-embed bench`` runs) at
concurrency 1 (one request at a time, as in the seed) and at ``--concurrency``, plus
the naive client with certifi's public roots + the test CA (what ``openai.OpenAI()``
builds by default). Medians of ``--repeats`` runs.

    python bench/rtt_https.py [--quick] [--requests N] [--repeats R] [--rtt-ms MS]
"""

from __future__ import annotations

import argparse
from typing import Any

from _common import command_line, environment, markdown_table, median, save

from qwen_embed_tooling.bench.results import MODES
from qwen_embed_tooling.bench.run import local_target, run_bench

FIELDS = (
    "p50_ms",
    "p95_ms",
    "requests_per_s",
    "texts_per_s",
    "connections_opened",
    "connections_server",
    "cpu_ms_per_request",
    "errors",
)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, 1 repeat")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rtt-ms", type=float, default=40.0)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    n = args.requests or (40 if args.quick else 200)
    repeats = args.repeats or (1 if args.quick else 3)
    env = environment()
    phases = {1: n, args.concurrency: n}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    meta: dict[str, Any] = {}
    with local_target(rtt_ms=args.rtt_ms) as target:
        for r in range(repeats):
            for conc, count in phases.items():
                phase = runs.setdefault(f"c{conc}", {})
                result = run_bench(target, requests=count, concurrency=conc)
                meta = {k: v for k, v in result.to_dict().items() if k != "modes"}
                for m in result.modes:
                    phase.setdefault(m.mode, []).append(m.to_dict())
                bundle = run_bench(
                    target,
                    requests=max(10, count // 2),
                    concurrency=conc,
                    modes=["naive"],
                    naive_trust="bundle",
                    warmup=r == 0,
                )
                phase.setdefault("naive_certifi", []).append(bundle.modes[0].to_dict())
            print(f"repeat {r + 1}/{repeats} done", flush=True)
    summary: dict[str, dict[str, dict[str, float | None]]] = {}
    for phase, per_mode in runs.items():
        naive = median([m["texts_per_s"] for m in per_mode["naive"]])
        summary[phase] = {}
        for mode, ms in per_mode.items():
            row: dict[str, float | None] = {}
            for f in FIELDS:
                values = [m[f] for m in ms if m[f] is not None]
                row[f] = median(values) if values else None
            tps = row["texts_per_s"] or 0.0
            row["ratio_vs_naive"] = tps / naive if naive else None
            summary[phase][mode] = row
    out = {
        "benchmark": "rtt_https",
        "command": command_line(),
        "environment": env,
        "rtt_ms": args.rtt_ms,
        "requests": n,
        "repeats": repeats,
        "concurrency": args.concurrency,
        "bench_meta": meta,
        "summary": summary,
        "runs": runs,
    }
    save("rtt_https", out, args.json_path)
    print(render(out))
    return out


LABELS = {
    "naive": "(a) naive: new OpenAI() per request, CA-only SSL context",
    "naive_certifi": "(a') naive, certifi roots + CA (OpenAI() default trust)",
    "pooled_threads": "(b) pooled sync, threads",
    "pooled_async": "(c) pooled async",
    "pooled_async_http2": "(d) pooled async, HTTP/2",
    "pooled_batched": "(e) pooled + batched (32 texts/request)",
}


def render(result: dict[str, Any]) -> str:
    parts = [
        f"### HTTPS + emulated {result['rtt_ms']:g} ms round trip "
        f"({result['requests']} requests per mode, median of {result['repeats']})\n\n"
        f"`{result['command']}`\n"
    ]
    for phase, per_mode in result["summary"].items():
        conc = phase[1:]
        rows = []
        for mode in ("naive", "naive_certifi", *MODES[1:]):
            if mode not in per_mode:
                continue
            m = per_mode[mode]
            rows.append(
                [
                    LABELS[mode],
                    m["p50_ms"],
                    m["p95_ms"],
                    m["requests_per_s"],
                    m["texts_per_s"],
                    f"{m['connections_opened']:.0f} / {m['connections_server']:.0f}"
                    if m["connections_opened"] is not None
                    else "-",
                    m["cpu_ms_per_request"],
                    f"{m['errors']:.0f}",
                    f"{m['ratio_vs_naive']:.1f}x" if m["ratio_vs_naive"] else "-",
                ]
            )
        headers = [
            "mode",
            "p50 ms",
            "p95 ms",
            "req/s",
            "texts/s",
            "conns client / server",
            "CPU ms/req",
            "errors",
            "texts/s vs (a)",
        ]
        parts.append(f"\nConcurrency {conc}:\n\n" + markdown_table(headers, rows) + "\n")
    return "".join(parts)


if __name__ == "__main__":
    main()
