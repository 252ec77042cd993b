"""What the OpenTelemetry hooks cost: client CPU per single-query call, side by side.

One process, one loopback server in a child process (plain HTTP, no emulated RTT: the
client's own cost is what is measured), ``EmbeddingClient.embed_query`` (sync) and
``AsyncEmbeddingClient.embed_query`` (async, one event loop). Modes, interleaved call by
call (the order rotates with each call), so they run under the same conditions of a
shared machine:

- ``absent``: as in a process without ``opentelemetry-api`` (the ``otel`` extra not
  installed): the script sets the library's handle on the API to ``None`` for the call
  (a benchmark's privilege), so every hook returns at its first check;
- ``no_provider``: the API installed and no tracer provider set (its default no-op
  provider): what every user of a venv that has ``opentelemetry-api`` gets;
- ``absent_again``: ``absent`` once more, an A/A control: its difference to ``absent``
  is the noise floor of the measurement.

A second phase sets an SDK ``TracerProvider`` whose processor drops every span (no export
cost) and interleaves ``absent`` with ``recording`` (a span per call and one per request
built and ended): what tracing itself costs when it is on. A micro-benchmark times the
hooks alone (``start_call`` and ``traced``'s enter/exit on a call) in each state.

Each call's client CPU is ``time.process_time()`` around it (this process, all threads;
the server runs elsewhere). A repeat is ``--requests`` calls per mode after 20 warm-up
ones; the tables show medians over ``--repeats`` repeats and the median of the per-repeat
ratios.

    python bench/tracing_overhead.py [--quick] [--requests N] [--repeats R]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import timeit
from collections.abc import Sequence
from typing import Any

from _common import command_line, environment, markdown_table, median, save
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from qwen_embed_plugins import AsyncEmbeddingClient, EmbeddingClient, close_all
from qwen_embed_plugins import _tracing as tracing
from qwen_embed_plugins._corpus import corpus
from qwen_embed_plugins._run import Call
from qwen_embed_tooling.testing import EmbeddingServer

PATHS = ("sync", "async")
OFF_MODES = ("absent", "no_provider", "absent_again")
ON_MODES = ("absent", "recording")
WARMUP = 20
API = tracing._otel  # the library's handle on opentelemetry.trace


class _Dropped(SpanExporter):
    """Counts the spans it is given and exports nothing."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans += len(spans)
        return SpanExportResult.SUCCESS


def _set(mode: str) -> None:
    tracing._otel = None if mode.startswith("absent") else API  # type: ignore[assignment]


def _sync_repeat(url: str, texts: list[str], modes: tuple[str, ...]) -> dict[str, float]:
    """CPU seconds per mode for ``len(texts)`` calls each, interleaved."""
    client = EmbeddingClient(base_url=url)
    for t in texts[:WARMUP]:
        client.embed_query(t)
    cpu = dict.fromkeys(modes, 0.0)
    k = len(modes)
    for i, t in enumerate(texts):
        for mode in modes[i % k :] + modes[: i % k]:
            _set(mode)
            c0 = time.process_time()
            client.embed_query(t)
            cpu[mode] += time.process_time() - c0
    _set("no_provider")
    close_all()
    return cpu


def _async_repeat(url: str, texts: list[str], modes: tuple[str, ...]) -> dict[str, float]:
    """The async twin of ``_sync_repeat`` (one event loop, one call at a time)."""

    async def main() -> dict[str, float]:
        client = AsyncEmbeddingClient(base_url=url)
        for t in texts[:WARMUP]:
            await client.embed_query(t)
        cpu = dict.fromkeys(modes, 0.0)
        k = len(modes)
        for i, t in enumerate(texts):
            for mode in modes[i % k :] + modes[: i % k]:
                _set(mode)
                c0 = time.process_time()
                await client.embed_query(t)
                cpu[mode] += time.process_time() - c0
        _set("no_provider")
        return cpu

    return asyncio.run(main())


def _phase(url: str, texts: list[str], modes: tuple[str, ...], repeats: int) -> dict[str, Any]:
    runs: dict[str, dict[str, list[float]]] = {p: {m: [] for m in modes} for p in PATHS}
    for _ in range(repeats):
        for path in PATHS:
            repeat = _sync_repeat if path == "sync" else _async_repeat
            for mode, cpu in repeat(url, texts, modes).items():
                runs[path][mode].append(cpu * 1e6 / len(texts))  # us per call
    return runs


def _ratios(runs: dict[str, list[float]], a: str, b: str) -> float:
    """The median over repeats of ``a``'s CPU / ``b``'s CPU."""
    return median([x / y for x, y in zip(runs[a], runs[b], strict=True)])


def micro(url: str, number: int = 100_000) -> dict[str, float]:
    """Nanoseconds per call of the hooks a call runs (``start_call`` and ``traced``'s
    enter/exit), in the current state of the global provider, absent and present."""
    engine = EmbeddingClient(base_url=url)._engine
    out = {}
    for mode in ("absent", "api"):
        _set(mode)

        def one() -> None:
            call = Call(started=0.0, deadline=None)
            tracing.start_call(engine, call, 1)
            with tracing.traced(call):
                pass

        def bare() -> None:
            Call(started=0.0, deadline=None)

        hooks = min(timeit.repeat(one, number=number, repeat=5))
        base = min(timeit.repeat(bare, number=number, repeat=5))
        out[mode] = (hooks - base) / number * 1e9
    _set("no_provider")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and repeats")
    parser.add_argument("--requests", type=int, default=None, help="per mode, path and repeat")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    n = args.requests or (300 if args.quick else 2000)
    repeats = args.repeats or (3 if args.quick else 7)
    texts = corpus(n)
    env = environment()
    assert API is not None, "needs opentelemetry-api (the otel extra) and the SDK"
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    with EmbeddingServer(process=True) as srv:
        off = _phase(srv.base_url, texts, OFF_MODES, repeats)
        micro_off = micro(srv.base_url)
        dropped = _Dropped()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(dropped))
        trace.set_tracer_provider(provider)
        on = _phase(srv.base_url, texts, ON_MODES, repeats)
        micro_on = micro(srv.base_url)
    # the switch did what it says: spans only while recording, two per call (call + POST)
    calls = repeats * len(PATHS) * (n + WARMUP)
    assert dropped.spans >= 2 * repeats * len(PATHS) * n, (dropped.spans, calls)
    result = {
        "benchmark": "tracing_overhead",
        "command": command_line(),
        "environment": env,
        "requests": n,
        "repeats": repeats,
        "summary_us_per_call": {
            "off": {p: {m: median(v) for m, v in r.items()} for p, r in off.items()},
            "on": {p: {m: median(v) for m, v in r.items()} for p, r in on.items()},
        },
        "paired_ratios": {
            p: {
                "no_provider_vs_absent": _ratios(off[p], "no_provider", "absent"),
                "control_vs_absent": _ratios(off[p], "absent_again", "absent"),
                "recording_vs_absent": _ratios(on[p], "recording", "absent"),
            }
            for p in PATHS
        },
        "micro_ns_per_call": {"no_provider": micro_off, "recording": micro_on},
        "spans_exported": dropped.spans,
        "runs_us_per_call": {"off": off, "on": on},
    }
    save("tracing_overhead", result, args.json_path)
    print(render(result))
    return result


def render(result: dict[str, Any]) -> str:
    s = result["summary_us_per_call"]
    r = result["paired_ratios"]
    rows = [
        [
            path,
            round(s["off"][path]["absent"], 1),
            round(s["off"][path]["no_provider"], 1),
            f"{r[path]['no_provider_vs_absent']:.3f}x",
            f"{r[path]['control_vs_absent']:.3f}x",
            round(s["on"][path]["recording"], 1),
            f"{r[path]['recording_vs_absent']:.3f}x",
        ]
        for path in PATHS
    ]
    m = result["micro_ns_per_call"]
    lines = [
        f"### Tracing overhead ({result['requests']} single-query calls per mode and path, "
        f"median of {result['repeats']})",
        "",
        f"`{result['command']}`",
        "",
        markdown_table(
            [
                "path",
                "CPU us/call, API absent",
                "CPU us/call, API, no provider",
                "no provider vs absent (paired)",
                "noise: A/A control (paired)",
                "CPU us/call, recording",
                "recording vs absent (paired)",
            ],
            rows,
        ),
        "",
        f"Micro-benchmark, the hooks of one call alone: {m['no_provider']['absent']:.0f} ns "
        f"with the API absent, {m['no_provider']['api']:.0f} ns with the API and no "
        f"provider; {m['recording']['api']:.0f} ns to open and end a recording call span "
        "(its request spans not included).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
