"""Rendering for the ``qwen-embed`` commands: rich tables, progress bars, JSON, errors.

Imported by command bodies only (it imports rich), never at ``--help`` time.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

import click

if TYPE_CHECKING:
    from rich.console import Console

    from ._check_report import CheckReport

__all__ = [
    "NARROW_WIDTH",
    "check_table",
    "console",
    "fail",
    "fmt",
    "metrics_json",
    "metrics_snapshot",
    "metrics_table",
    "print_json",
    "progress_bar",
    "report",
    "warnings_in_report",
    "warnings_reported",
]

NARROW_WIDTH = 100
"""Columns the default tables fit in (and the width when not on a terminal)."""
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


# --------------------------------------------------------------------------- check

_STATUS_STYLE = {
    "ok": "[green]ok[/green]",
    "warn": "[yellow]warn[/yellow]",
    "fail": "[red]FAIL[/red]",
    "info": "[blue]info[/blue]",
}


# Commands running now that put the library's warnings in their own report (``check``:
# its notes); while any does, the CLI's log handler (``_app``) prints none on stderr.
_REPORTING = [0]
_REPORTING_LOCK = threading.Lock()


@contextmanager
def warnings_in_report() -> Iterator[None]:
    """While it is open, the library's warnings are not printed on stderr: the command
    puts them in its report (``check``: ``CheckReport.notes``)."""
    with _REPORTING_LOCK:
        _REPORTING[0] += 1
    try:
        yield
    finally:
        with _REPORTING_LOCK:
            _REPORTING[0] -= 1


def warnings_reported() -> bool:
    """Whether a running command reports the library's warnings itself."""
    return _REPORTING[0] > 0


def check_table(report: CheckReport) -> Any:
    """The findings of ``qwen-embed check``, one row each, with advice; its notes (the
    library's warnings during the check) under the table."""
    from rich.table import Table
    from rich.text import Text

    title = f"qwen-embed check: {report.base_url} (model {report.model})"
    if report.server is not None:
        title += f"\nserver: {report.server.title} ({report.server.source})"
    # the library's warnings during the check, under the table (not on stderr above it)
    caption = None
    if report.notes:  # plain text: a note's brackets are not rich markup
        caption = Text("\n".join(["client log during the check:", *report.notes]))
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
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
