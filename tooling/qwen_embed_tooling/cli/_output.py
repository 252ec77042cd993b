"""Rendering of ``qwen-embed bench``: the modes side by side, and its progress bars.

Imported by the command body only (it imports rich), never at ``--help`` time. The
console, JSON and metrics helpers are the library's (``qwen_embed_plugins.cli._output``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from qwen_embed_plugins.cli._output import fmt

if TYPE_CHECKING:
    from ..bench.results import BenchResult

__all__ = ["RichBenchProgress", "bench_renderables", "bench_table", "fmt_int"]


def _where(result: BenchResult) -> str:
    if result.local_server:
        return (
            f"built-in loopback server ({'HTTPS' if result.tls else 'HTTP'}, emulated "
            f"round trip {result.rtt_ms:g} ms)"
        )
    return result.base_url


def _bench_title(result: BenchResult) -> str:
    return (
        f"qwen-embed bench: {_where(result)}\n{result.requests} requests per mode, "
        f"concurrency {result.concurrency}, {result.batch_size} texts/request in (e), "
        f"pool limit {result.pool_max_connections}; model {result.model}"
        + (f" ({result.dim}-dim)" if result.dim else "")
    )


def bench_table(result: BenchResult, *, wide: bool = False) -> Any:
    """The modes side by side. Narrow (default, fits 100 columns): short mode names,
    req/s, texts/s, p50, p99, connections, CPU per request, errors (only when some
    mode had any) and the ratio to the naive client. ``wide``: every field."""
    from rich import box
    from rich.table import Table

    from ..bench.results import MODE_SHORT_LABELS

    errors = wide or any(m.errors for m in result.modes)
    server = result.local_server
    columns: list[tuple[str, Callable[[Any], str]]] = [
        ("req/s", lambda m: fmt(m.requests_per_s)),
        ("texts/s", lambda m: fmt(m.texts_per_s)),
        ("p50 ms", lambda m: fmt(m.p50_ms)),
    ]
    if wide:
        columns.append(("p95 ms", lambda m: fmt(m.p95_ms)))
    columns.append(("p99 ms", lambda m: fmt(m.p99_ms)))
    if wide:
        columns.append(("mean ms", lambda m: fmt(m.mean_ms)))
    columns.append(("conns", lambda m: fmt_int(m.connections_opened)))
    if wide and server:
        columns.append(("server conns", lambda m: fmt_int(m.connections_server)))
    columns.append(("CPU ms/req", lambda m: fmt(m.cpu_ms_per_request, 2)))
    if errors:
        columns.append(("errors", lambda m: f"[red]{m.errors}[/red]" if m.errors else "0"))
    if wide:
        columns.append(("HTTP", lambda m: m.http_version or "-"))
    columns.append(
        ("x (a)", lambda m: "-" if m.ratio_vs_naive is None else f"{m.ratio_vs_naive:.1f}x")
    )
    table = Table(
        title=_bench_title(result),
        title_justify="left",
        box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD,
        pad_edge=wide,
    )
    table.add_column("mode", no_wrap=True)
    for name, _ in columns:
        table.add_column(
            name, justify="right", no_wrap=True, style="bold" if name == "x (a)" else ""
        )
    for m in result.modes:
        label = m.label if wide else MODE_SHORT_LABELS.get(m.mode, m.mode)
        if m.skipped:
            table.add_row(label, "[dim]skipped[/dim]", *[""] * (len(columns) - 1))
            continue
        table.add_row(label, *(cell(m) for _, cell in columns))
    return table


def fmt_int(value: int | None) -> str:
    """An integer for a table, ``-`` for none."""
    return "-" if value is None else f"{value:,}"


def bench_renderables(result: BenchResult, *, wide: bool = False) -> list[Any]:
    """What ``qwen-embed bench`` prints: the table, notes on skipped modes and errors,
    a legend, and last the one-line conclusion (pooled vs naive, as measured)."""
    from ..bench.results import MODE_LABELS

    out: list[Any] = [bench_table(result, wide=wide)]
    for m in result.modes:
        if m.skipped:
            out.append(f"{MODE_LABELS.get(m.mode, m.mode)}: skipped: {m.skipped}")
        if m.error_sample:
            out.append(f"[red]{m.mode}: {m.errors} errors, e.g. {m.error_sample}[/red]")
    if not wide:
        out.append(
            "(a) a new openai.OpenAI per request; (b) one shared pooled client, threads; "
            "(c) the pooled async client; (d) the same over HTTP/2; (e) batched "
            "embed_documents. --wide: every column, --json: every field."
        )
    out.append(
        "conns: TCP connections the client opened (counted from connect events)"
        + (
            "; server conns: connections the server accepted."
            if wide and result.local_server
            else "."
        )
        + " x (a): texts/s relative to the naive client (a)."
    )
    out.append(f"[bold]{result.conclusion()}[/bold]")
    return out


class RichBenchProgress:
    """``BenchProgress`` drawing one rich progress bar per mode."""

    def __init__(self, progress: Any) -> None:
        self._progress = progress
        self._tasks: dict[str, Any] = {}

    def begin(self, mode: str, description: str, total: int) -> None:
        self._tasks[mode] = self._progress.add_task(description, total=total)

    def advance(self, mode: str, n: int = 1) -> None:
        self._progress.advance(self._tasks[mode], n)

    def end(self, mode: str) -> None:
        task = self._tasks[mode]
        self._progress.update(task, completed=self._progress.tasks[task].total)
