"""Rendering for the ``qwen-embed`` commands: rich tables, progress bars, JSON, errors.

Imported by command bodies only (it imports rich), never at ``--help`` time.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import click

if TYPE_CHECKING:
    from rich.console import Console

    from .._bench.results import BenchResult, CheckReport

__all__ = [
    "NARROW_WIDTH",
    "RichBenchProgress",
    "bench_renderables",
    "check_table",
    "console",
    "fail",
    "metrics_json",
    "metrics_snapshot",
    "metrics_table",
    "print_json",
    "progress_bar",
    "report",
]

NARROW_WIDTH = 100
"""Columns the default ``bench`` table fits in (and the width when not on a terminal)."""
WIDE_WIDTH = 160
"""The width of ``--wide`` output when not on a terminal."""


def console(*, stderr: bool = False, wide: bool = False) -> Console:
    """A rich console on stdout (or stderr). On a terminal: its width. Otherwise (a
    pipe, a file, CliRunner): ``$COLUMNS`` when set, else 100 (160 with ``wide``)."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width: int | None = None
    if not stream.isatty():
        columns = os.environ.get("COLUMNS", "")
        width = int(columns) if columns.isdigit() else (WIDE_WIDTH if wide else NARROW_WIDTH)
    return Console(file=stream, width=width, stderr=stderr, highlight=False)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code``."""
    click.echo(f"error: {message}", err=True)
    raise SystemExit(code)


def print_json(obj: Any) -> None:
    """``obj`` as indented JSON on stdout."""
    import orjson

    click.echo(orjson.dumps(obj, option=orjson.OPT_INDENT_2).decode())


def fmt(value: float | None, digits: int = 1) -> str:
    """A figure for a table: ``-`` for none, thousands separated from 1,000 up."""
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


# --------------------------------------------------------------------------- bench


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

    from .._bench.results import MODE_SHORT_LABELS

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
    from .._bench.results import MODE_LABELS

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


# --------------------------------------------------------------------------- check

_STATUS_STYLE = {
    "ok": "[green]ok[/green]",
    "warn": "[yellow]warn[/yellow]",
    "fail": "[red]FAIL[/red]",
    "info": "[blue]info[/blue]",
}


def check_table(report: CheckReport) -> Any:
    """The findings of ``qwen-embed check``, one row each, with advice."""
    from rich.table import Table

    title = f"qwen-embed check: {report.base_url} (model {report.model})"
    if report.server is not None:
        title += f"\nserver: {report.server.title} ({report.server.source})"
    table = Table(title=title, title_justify="left")
    table.add_column("check", no_wrap=True)
    table.add_column("", no_wrap=True)
    table.add_column("finding", ratio=1)
    table.add_column("advice", ratio=1)
    for f in report.findings:
        table.add_row(f.name, _STATUS_STYLE[f.status], f.summary, f.advice or "")
    return table


# --------------------------------------------------------------------------- metrics


def metrics_snapshot(label: str) -> dict[str, dict[str, Any]]:
    """``stats()`` of one endpoint label, as ``{label: snapshot}`` (empty when no
    request of this process went to it through the client)."""
    from .. import stats

    snap = stats().get(label)
    return {label: snap} if snap is not None else {}


def metrics_json(metrics: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The snapshots, JSON-safe: the histograms' infinite last bound becomes "+Inf"."""
    out = {}
    for label, snap in metrics.items():
        row = dict(snap)
        for key in ("latency_seconds", "batch_size"):
            hist = snap[key]
            buckets = [["+Inf" if b == float("inf") else b, n] for b, n in hist["buckets"]]
            row[key] = {**hist, "buckets": buckets}
        out[label] = row
    return out


def _upper_bound(hist: dict[str, Any], q: float) -> float | None:
    """The smallest bucket bound holding quantile ``q`` of a histogram snapshot."""
    if not hist["count"]:
        return None
    for bound, cumulative in hist["buckets"]:
        if cumulative >= q * hist["count"]:
            return float(bound)
    return None  # pragma: no cover - the +Inf bucket holds everything


def _counted(total: int, by: dict[str, int]) -> str:
    detail = ", ".join(f"{k} {v:,}" for k, v in sorted(by.items()))
    return f"{total:,}" + (f" ({detail})" if detail else "")


def metrics_table(metrics: dict[str, dict[str, Any]]) -> Any:
    """One column per endpoint of ``stats()`` snapshots, one row per metric."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if not metrics:
        return Text("metrics: no request of this process went through the client")

    def latency(s: dict[str, Any]) -> str:
        bounds = [_upper_bound(s["latency_seconds"], q) for q in (0.5, 0.95, 0.99)]
        return " / ".join(
            "-" if b is None else ("> 60 s" if b == float("inf") else f"<= {fmt(b * 1000)}")
            for b in bounds
        )

    def mean(hist: dict[str, Any], scale: float = 1.0) -> str:
        return fmt(hist["sum"] * scale / hist["count"] if hist["count"] else None)

    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("requests", lambda s: _counted(s["requests"], s["requests_by_outcome"])),
        ("texts embedded", lambda s: f"{s['texts']:,}"),
        ("texts per request (mean)", lambda s: mean(s["batch_size"])),
        ("retries", lambda s: _counted(s["retries"], s["retries_by_reason"])),
        ("stale-connection resends", lambda s: f"{s['stale_retries']:,}"),
        ("TCP connections opened", lambda s: f"{s['connections_opened']:,}"),
        ("in flight now", lambda s: f"{s['in_flight']:,}"),
        ("latency mean ms", lambda s: mean(s["latency_seconds"], 1000.0)),
        ("latency p50 / p95 / p99 ms", latency),
        ("fallbacks", lambda s: _counted(sum(s["fallbacks"].values()), s["fallbacks"])),
    ]
    table = Table()
    table.add_column("metric", no_wrap=True)
    for label in metrics:
        table.add_column(label, justify="right")
    for name, cell in rows:
        table.add_row(name, *(cell(snap) for snap in metrics.values()))
    heading = Text("client metrics of this process (qwen_embed_plugins.stats()):", no_wrap=True)
    return Group(heading, table)


def report(
    data: dict[str, Any],
    render: Callable[[Console], None],
    *,
    as_json: bool,
    metrics_of: str | None,
    wide: bool = False,
) -> None:
    """Print a command's result: JSON (``data``, plus ``metrics``) or ``render`` (plus
    the metrics table). ``metrics_of``: the endpoint label whose metrics to add, or None."""
    metrics = metrics_snapshot(metrics_of) if metrics_of is not None else None
    if as_json:
        if metrics is not None:
            data["metrics"] = metrics_json(metrics)
        print_json(data)
        return
    out = console(wide=wide)
    render(out)
    if metrics is not None:
        out.print(metrics_table(metrics))


# --------------------------------------------------------------------------- progress


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


def progress_bar(out: Console, *, unit: str = "requests") -> Any:
    """A rich progress bar on ``out``, drawn only when it is a terminal."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=out,
        disable=not out.is_terminal,
    )
