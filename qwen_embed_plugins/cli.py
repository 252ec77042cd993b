"""The ``qwen-embed`` command line: ``bench``, ``check``, ``embed``, ``serve``.

A thin front end over ``bench.py`` (measurements and probes) and the client: it parses
options, shows progress bars and tables (``rich``), and prints JSON for machines
(``--json``). It needs the optional ``cli`` extra (``click`` and ``rich``); without it,
``qwen-embed`` prints the install command and exits with status 1. This module imports
neither at import time, so that message can always be shown.

Exit status: 0 on success; 1 when the server cannot be used (or a ``check`` probe
failed); 2 for usage errors.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NoReturn

if TYPE_CHECKING:
    import click
    from rich.console import Console

    from .bench import BenchResult, CheckReport

__all__ = ["INSTALL_HINT", "get_command", "main"]

INSTALL_HINT = "pip install 'qwen-embed-plugins[cli]'"
"""The command printed when the ``cli`` extra (click, rich) is missing."""

_command: click.Group | None = None


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``qwen-embed`` console script.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Raises:
        SystemExit: always, with the exit status (1 when click or rich is missing).
    """
    try:
        import click  # noqa: F401
        import rich  # noqa: F401
    except ImportError as exc:
        sys.stderr.write(
            f"qwen-embed needs the 'cli' extra ({exc.name} is not installed):\n    {INSTALL_HINT}\n"
        )
        raise SystemExit(1) from None
    get_command().main(args=list(argv) if argv is not None else None, prog_name="qwen-embed")


def get_command() -> click.Group:
    """The ``click`` group of ``qwen-embed`` (built on first call; for tests/embedding).

    Raises:
        ImportError: click or rich is not installed.
    """
    global _command
    if _command is None:
        _command = _build()
    return _command


# --------------------------------------------------------------------------- helpers


def _console(*, stderr: bool = False) -> Console:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    terminal = stream.isatty()
    # Not a terminal (a pipe, a file, CliRunner): a fixed width that fits the tables.
    return Console(file=stream, width=None if terminal else 150, stderr=stderr, highlight=False)


def _fail(message: str, code: int = 1) -> NoReturn:
    import click

    click.echo(f"error: {message}", err=True)
    raise SystemExit(code)


def _verify(ca: str | None, insecure: bool) -> bool | str:
    if ca and insecure:
        _fail("--ca and --insecure exclude each other", 2)
    if ca:
        return ca
    return not insecure


def _print_json(obj: Any) -> None:
    import click
    import orjson

    click.echo(orjson.dumps(obj, option=orjson.OPT_INDENT_2).decode())


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


# --------------------------------------------------------------------------- rendering


def _bench_table(result: BenchResult) -> Any:
    from rich.table import Table

    if result.local_server:
        where = (
            f"built-in loopback server ({'HTTPS' if result.tls else 'HTTP'}, emulated "
            f"round trip {result.rtt_ms:g} ms)"
        )
    else:
        where = result.base_url
    title = (
        f"qwen-embed bench: {where}\n{result.requests} requests per mode, "
        f"concurrency {result.concurrency}, {result.batch_size} texts/request in (e), "
        f"pool limit {result.pool_max_connections}; model {result.model}"
        + (f" ({result.dim}-dim)" if result.dim else "")
    )
    table = Table(title=title, title_justify="left", show_lines=False)
    table.add_column("mode", no_wrap=True)
    for name in ("req/s", "texts/s", "p50 ms", "p95 ms", "p99 ms"):
        table.add_column(name, justify="right")
    table.add_column("conns", justify="right")
    if result.local_server:
        table.add_column("server conns", justify="right")
    table.add_column("CPU ms/req", justify="right")
    table.add_column("errors", justify="right")
    table.add_column("x (a)", justify="right", style="bold")
    for m in result.modes:
        if m.skipped:
            row = [m.label, "[dim]skipped[/dim]"] + [""] * (len(table.columns) - 2)
            table.add_row(*row)
            continue
        row = [
            m.label,
            _fmt(m.requests_per_s),
            _fmt(m.texts_per_s),
            _fmt(m.p50_ms),
            _fmt(m.p95_ms),
            _fmt(m.p99_ms),
            str(m.connections_opened) if m.connections_opened is not None else "-",
        ]
        if result.local_server:
            row.append(str(m.connections_server) if m.connections_server is not None else "-")
        row += [
            _fmt(m.cpu_ms_per_request, 2),
            f"[red]{m.errors}[/red]" if m.errors else "0",
            f"{m.ratio_vs_naive:.1f}x" if m.ratio_vs_naive is not None else "-",
        ]
        table.add_row(*row)
    return table


_STATUS_STYLE = {
    "ok": "[green]ok[/green]",
    "warn": "[yellow]warn[/yellow]",
    "fail": "[red]FAIL[/red]",
    "info": "[blue]info[/blue]",
}


def _check_table(report: CheckReport) -> Any:
    from rich.table import Table

    table = Table(
        title=f"qwen-embed check: {report.base_url} (model {report.model})", title_justify="left"
    )
    table.add_column("check", no_wrap=True)
    table.add_column("", no_wrap=True)
    table.add_column("finding")
    table.add_column("advice")
    for f in report.findings:
        table.add_row(f.name, _STATUS_STYLE[f.status], f.summary, f.advice or "")
    return table


def _print_bench(out: Console, result: BenchResult) -> None:
    out.print(_bench_table(result))
    for m in result.modes:
        if m.skipped:
            out.print(f"{m.label}: skipped: {m.skipped}")
        if m.error_sample:
            out.print(f"[red]{m.mode}: {m.errors} errors, e.g. {m.error_sample}[/red]")
    out.print(
        "conns: TCP connections the client opened (counted from connect events)"
        + ("; server conns: connections the server accepted." if result.local_server else ".")
    )
    out.print("x (a): texts/s relative to the naive client (a).")


def _metrics_snapshot(label: str) -> dict[str, dict[str, Any]]:
    """``stats()`` of one endpoint label, as ``{label: snapshot}`` (empty when no
    request of this process went to it through the client)."""
    from .metrics import stats

    snap = stats().get(label)
    return {label: snap} if snap is not None else {}


def _metrics_json(metrics: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
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


def _metrics_table(metrics: dict[str, dict[str, Any]]) -> Any:
    """One column per endpoint of ``stats()`` snapshots, one row per metric."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if not metrics:
        return Text("metrics: no request of this process went through the client")

    def latency(s: dict[str, Any]) -> str:
        bounds = [_upper_bound(s["latency_seconds"], q) for q in (0.5, 0.95, 0.99)]
        return " / ".join(
            "-" if b is None else ("> 60 s" if b == float("inf") else f"<= {_fmt(b * 1000)}")
            for b in bounds
        )

    def mean(hist: dict[str, Any], scale: float = 1.0) -> str:
        return _fmt(hist["sum"] * scale / hist["count"] if hist["count"] else None)

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


class _RichBenchProgress:
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


def _progress_bar(console: Console, *, texts: bool = False) -> Any:
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
        TextColumn("texts" if texts else "requests"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,
    )


# --------------------------------------------------------------------------- options


_BASE_URL_HELP = "API root, e.g. http://gpu-box:30000/v1"
_MODELS_DEFAULT = "default: the first one /models lists"


def _compose(*decorators: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """One decorator applying ``decorators`` as if stacked in this order (top first)."""

    def apply(f: Any) -> Any:
        for decorator in reversed(decorators):
            f = decorator(f)
        return f

    return apply


def _server_options(
    *, required_url: bool, model_help: str, model_envvar: str | None = None
) -> Callable[[Any], Any]:
    """``--base-url``, ``--api-key``, ``--model``, ``--ca``, ``--insecure``.

    ``required_url``: ``--base-url`` is required (default from ``QWEN_EMBED_BASE_URL``);
    otherwise it is optional and leaving it out means the built-in local server.
    """
    import click

    from .config import ENV_API_KEY, ENV_BASE_URL

    if required_url:
        base_url = click.option(
            "--base-url",
            envvar=ENV_BASE_URL,
            required=True,
            metavar="URL",
            help=f"{_BASE_URL_HELP} [env {ENV_BASE_URL}].",
        )
    else:
        base_url = click.option(
            "--base-url",
            metavar="URL",
            help=f"{_BASE_URL_HELP}. Default: start a local server on loopback with HTTPS "
            "and an emulated round trip.",
        )
    return _compose(
        base_url,
        click.option(
            "--api-key", envvar=ENV_API_KEY, metavar="KEY", help=f"Bearer key [env {ENV_API_KEY}]."
        ),
        click.option("--model", envvar=model_envvar, help=model_help),
        click.option(
            "--ca",
            type=click.Path(exists=True, dir_okay=False),
            help="CA bundle (PEM) to verify an https:// server.",
        ),
        click.option("--insecure", is_flag=True, help="Do not verify TLS certificates."),
    )


def _output_options() -> Callable[[Any], Any]:
    """``--json`` and ``--metrics`` (the commands that report on a server)."""
    import click

    return _compose(
        click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table."),
        click.option(
            "--metrics",
            "show_metrics",
            is_flag=True,
            help="Also print the client's metrics of the endpoint after the run "
            "(qwen_embed_plugins.stats(); under 'metrics' with --json).",
        ),
    )


def _shown(*decls: str, type: Any, default: Any, help: str) -> Callable[[Any], Any]:
    """An option whose default ``--help`` shows."""
    import click

    return click.option(*decls, type=type, default=default, show_default=True, help=help)


def _sized(*decls: str, upper: int | None, default: int, help: str) -> Callable[[Any], Any]:
    """An integer option from 1 (to ``upper``) with a shown default."""
    import click

    return _shown(*decls, type=click.IntRange(1, upper), default=default, help=help)


def _extra_missing(exc: ImportError, what: str, alternative: str = "") -> NoReturn:
    _fail(
        f"{what} needs the 'testing' extra ({exc}): "
        f"pip install 'qwen-embed-plugins[testing]'{alternative}"
    )


def _report(
    data: dict[str, Any],
    render: Callable[[Console], None],
    *,
    as_json: bool,
    metrics_of: str | None,
) -> None:
    """Print a command's result: JSON (``data``, plus ``metrics``) or ``render`` (plus
    the metrics table). ``metrics_of``: the endpoint label whose metrics to add, or None."""
    metrics = _metrics_snapshot(metrics_of) if metrics_of is not None else None
    if as_json:
        if metrics is not None:
            data["metrics"] = _metrics_json(metrics)
        _print_json(data)
        return
    out = _console()
    render(out)
    if metrics is not None:
        out.print(_metrics_table(metrics))


# --------------------------------------------------------------------------- commands


def _build() -> click.Group:
    import click

    from . import __version__
    from .bench import MODES
    from .config import ENV_MODEL

    @click.group(context_settings={"help_option_names": ["-h", "--help"]})
    @click.version_option(__version__, prog_name="qwen-embed")
    def cli() -> None:
        """Is my embedding service slow, or is my client?

        Measure (bench), probe (check), use (embed) an OpenAI-compatible
        /v1/embeddings server, or start a local one (serve).
        """

    # ------------------------------------------------------------------ bench
    @cli.command()
    @_server_options(required_url=False, model_help=f"Model name ({_MODELS_DEFAULT}).")
    @_sized("--requests", "n_requests", upper=None, default=200, help="HTTP requests per mode.")
    @_sized("--concurrency", upper=1024, default=16, help="Threads or tasks per mode.")
    @_sized("--batch-size", upper=2048, default=32, help="Texts per request in mode (e).")
    @click.option(
        "--texts",
        "texts_file",
        type=click.Path(exists=True, dir_okay=False),
        help="Input texts: one per line, or JSONL with a 'text' field. "
        "Default: passages of Python's own documentation (pydoc_data).",
    )
    @click.option(
        "--rtt-ms",
        type=click.FloatRange(0),
        default=None,
        help="Emulated network round trip of the local server (ms) [default: 40].",
    )
    @click.option("--no-tls", is_flag=True, help="Local server over plain HTTP.")
    @_sized(
        "--pool-size", upper=None, default=20, help="Limits.max_connections of the pooled modes."
    )
    @click.option(
        "--mode",
        "modes",
        multiple=True,
        type=click.Choice(MODES),
        help="Run only these modes (repeatable). Default: all.",
    )
    @_shown(
        "--naive-trust",
        type=click.Choice(["ca", "bundle"]),
        default="ca",
        help="With a private CA: the naive client's per-request SSL context "
        "holds only that CA, or certifi's roots plus it (what OpenAI() loads).",
    )
    @_output_options()
    def bench(
        base_url: str | None,
        api_key: str | None,
        model: str | None,
        ca: str | None,
        insecure: bool,
        n_requests: int,
        concurrency: int,
        batch_size: int,
        texts_file: str | None,
        rtt_ms: float | None,
        no_tls: bool,
        pool_size: int,
        modes: tuple[str, ...],
        naive_trust: str,
        as_json: bool,
        show_metrics: bool,
    ) -> None:
        """Naive vs pooled vs async vs HTTP/2 vs batched, side by side.

        Each mode sends --requests requests from --concurrency threads or tasks and is
        measured: latency percentiles, requests/s, texts/s, TCP connections opened,
        client CPU per request, errors, and the ratio to the naive client (a).
        """
        import contextlib
        import dataclasses

        from .bench import BENCH_SCHEMA, Target, load_texts, local_target, run_bench
        from .errors import QwenEmbedError

        if base_url and (rtt_ms is not None or no_tls):
            _fail(
                "--rtt-ms and --no-tls apply to the built-in local server only "
                "(leave out --base-url)",
                2,
            )
        try:
            texts = load_texts(texts_file) if texts_file else None
        except (ValueError, OSError) as exc:
            _fail(f"cannot read --texts: {exc}", 2)
        if texts is not None and not texts:
            _fail(f"{texts_file} holds no text", 2)
        err = _console(stderr=True)
        rtt = 40.0 if rtt_ms is None else rtt_ms
        with contextlib.ExitStack() as stack:
            if base_url:
                target = Target(
                    base_url, verify=_verify(ca, insecure), api_key=api_key, model=model
                )
            else:
                try:
                    if not as_json:
                        err.print(
                            "Starting the built-in server on 127.0.0.1 "
                            f"({'HTTP' if no_tls else 'HTTPS, test CA'}, emulated round "
                            f"trip {rtt:g} ms)..."
                        )
                    local = stack.enter_context(local_target(rtt_ms=rtt, tls=not no_tls))
                except ImportError as exc:
                    _extra_missing(exc, "the built-in server", ", or pass --base-url")
                target = dataclasses.replace(local, api_key=api_key, model=model)
            bar = _progress_bar(err)
            try:
                with bar:
                    result = run_bench(
                        target,
                        requests=n_requests,
                        concurrency=concurrency,
                        batch_size=batch_size,
                        texts=texts,
                        texts_source=texts_file,
                        modes=modes or MODES,
                        pool_max_connections=pool_size,
                        progress=_RichBenchProgress(bar),
                        naive_trust="bundle" if naive_trust == "bundle" else "ca",
                    )
            except QwenEmbedError as exc:
                if as_json:  # machines still get a JSON document on stdout
                    _print_json(
                        {
                            "schema": BENCH_SCHEMA,
                            "ok": False,
                            "error": str(exc),
                            "error_type": type(exc).__name__,
                        }
                    )
                _fail(str(exc))
        _report(
            result.to_dict(),
            lambda out: _print_bench(out, result),
            as_json=as_json,
            metrics_of=result.base_url if show_metrics else None,
        )

    # ------------------------------------------------------------------ check
    @cli.command()
    @_server_options(required_url=True, model_help=f"Model to probe ({_MODELS_DEFAULT}).")
    @_shown(
        "--max-idle",
        type=click.FloatRange(0.5, 60),
        default=6.5,
        help="Longest idle wait of the keep-alive probe (s).",
    )
    @_sized(
        "--batch-probe-max",
        upper=2048,
        default=512,
        help="Largest batch the batch-limit probe sends.",
    )
    @_output_options()
    def check(
        base_url: str,
        api_key: str | None,
        model: str | None,
        ca: str | None,
        insecure: bool,
        max_idle: float,
        batch_probe_max: int,
        as_json: bool,
        show_metrics: bool,
    ) -> None:
        """What the server is and supports, with advice per finding.

        Health, model and vector size, base64, MRL dimensions, batch limit, HTTP/2,
        the idle keep-alive timeout it enforces, and a latency sample (--metrics: the
        client's counters of that sample).
        """
        from .bench import check_server

        err = _console(stderr=True)
        with err.status("probing...") as status:
            report = check_server(
                base_url,
                api_key=api_key,
                verify=_verify(ca, insecure),
                model=model,
                max_idle=max_idle,
                batch_probe_max=batch_probe_max,
                step=lambda name: status.update(f"probing {name}..."),
            )
        _report(
            report.to_dict(),
            lambda out: out.print(_check_table(report)),
            as_json=as_json,
            metrics_of=report.base_url if show_metrics else None,
        )
        if not report.ok:
            raise SystemExit(1)

    # ------------------------------------------------------------------ embed
    @cli.command()
    @_server_options(
        required_url=True,
        model_help=f"Model name [env {ENV_MODEL}; default Qwen/Qwen3-Embedding-0.6B].",
        model_envvar=ENV_MODEL,
    )
    @click.option(
        "--query", is_flag=True, help="The texts are search queries: add the Qwen3 instruction."
    )
    @click.option("--dimensions", type=click.IntRange(1), help="MRL output size.")
    @_sized("--batch-size", upper=2048, default=32, help="Texts per request.")
    @_sized("--concurrency", upper=1024, default=4, help="Requests in flight.")
    @_sized(
        "--chunk-size",
        upper=None,
        default=2048,
        help="Texts read, embedded and written per step (bounds memory).",
    )
    @click.option("--http2", is_flag=True, help="Use HTTP/2 (falls back to HTTP/1.1).")
    @click.argument("input_path", metavar="INPUT", type=click.Path(exists=True, dir_okay=False))
    @click.argument("output_path", metavar="OUTPUT", type=click.Path(dir_okay=False))
    def embed(
        base_url: str,
        api_key: str | None,
        model: str | None,
        ca: str | None,
        insecure: bool,
        query: bool,
        dimensions: int | None,
        batch_size: int,
        concurrency: int,
        chunk_size: int,
        http2: bool,
        input_path: str,
        output_path: str,
    ) -> None:
        """Embed INPUT (one text per line, or JSONL with "text") into OUTPUT.

        OUTPUT is .npy (float32, rows x dim, one row per non-blank input record) or
        .jsonl ({"index": input line number, "id": ..., "embedding": [...]}). Blank
        (empty or whitespace-only) records are skipped; stderr says how many and on
        which lines. Streams in chunks: memory stays bounded for any input size.
        OUTPUT is written to a temporary file beside it and replaces it only when
        every record was embedded: a failed or interrupted run leaves it as it was.
        """
        from .client import EmbeddingClient
        from .config import EmbeddingConfig
        from .errors import QwenEmbedError

        suffix = Path(output_path).suffix.lower()
        if suffix not in (".npy", ".jsonl", ".ndjson"):
            _fail("OUTPUT must end in .npy, .jsonl or .ndjson", 2)
        try:
            cfg = EmbeddingConfig(
                base_url=base_url,
                api_key=api_key,
                model=model,
                dimensions=dimensions,
                batch_size=batch_size,
                max_concurrency=concurrency,
                http2=http2,
                verify=_verify(ca, insecure),
            )
        except QwenEmbedError as exc:
            _fail(str(exc), 2)
        client = EmbeddingClient(cfg)
        err = _console(stderr=True)
        started = time.perf_counter()
        prepare = _preparer(
            input_path, cfg.query_instruction if query else None, cfg.max_text_chars
        )
        try:
            total, blank, blank_lines = _scan_records(input_path, prepare)
            if blank:
                err.print(_blank_notice(blank, blank_lines), markup=False)
            if total == 0:
                _fail(f"{input_path} holds no text", 2)
            bar = _progress_bar(err, texts=True)
            with bar:
                task = bar.add_task("embedding", total=total)
                dim = _embed_file(
                    client,
                    input_path,
                    output_path,
                    total,
                    prepare,
                    chunk_size,
                    lambda n: bar.advance(task, n),
                )
        except (QwenEmbedError, ValueError, OSError) as exc:
            _fail(str(exc))
        seconds = time.perf_counter() - started
        err.print(
            f"embedded {total:,} texts ({dim}-dim) into {output_path} in {seconds:.1f} s "
            f"({total / max(seconds, 1e-9):,.0f} texts/s)"
        )

    # ------------------------------------------------------------------ serve
    @cli.command()
    @_shown(
        "--port",
        type=click.IntRange(0, 65535),
        default=30000,
        help="Port on 127.0.0.1 (0 picks a free one).",
    )
    @click.option("--tls", is_flag=True, help="HTTPS with a throw-away test CA.")
    @click.option("--http2", is_flag=True, help="Also serve HTTP/2 (ALPN h2, h2c).")
    @_shown(
        "--latency",
        type=click.FloatRange(0),
        default=0.0,
        help="Seconds added to every embedding request.",
    )
    @_sized("--dim", upper=None, default=1024, help="Vector size.")
    @click.option("--model", default=None, help="Model name served.")
    @click.option("--matryoshka", is_flag=True, help="Accept `dimensions` (MRL).")
    @_shown(
        "--keep-alive-timeout",
        type=click.FloatRange(0.001),
        default=5.0,
        help="Idle keep-alive seconds.",
    )
    @click.option("--api-key", default=None, help="Require this bearer key.")
    @click.option(
        "--duration",
        type=click.FloatRange(0),
        default=0.0,
        help="Stop after this many seconds (0: until Ctrl-C).",
    )
    def serve(
        port: int,
        tls: bool,
        http2: bool,
        latency: float,
        dim: int,
        model: str | None,
        matryoshka: bool,
        keep_alive_timeout: float,
        api_key: str | None,
        duration: float,
    ) -> None:
        """Run the loopback test server in the foreground (for demos).

        Deterministic vectors (not a real model), SGLang's dialect, on 127.0.0.1.
        """
        try:
            from .testing import DEFAULT_MODEL, EmbeddingServer
        except ImportError as exc:  # pragma: no cover - testing.py imports stdlib only
            _extra_missing(exc, "the server")
        try:
            server = EmbeddingServer(
                port=port,
                tls=tls,
                http2=http2,
                latency=latency,
                dim=dim,
                model=model or DEFAULT_MODEL,
                matryoshka=matryoshka,
                keep_alive_timeout=keep_alive_timeout,
                api_key=api_key,
            )
            server.start()
        except ImportError as exc:
            _extra_missing(exc, "the server")
        except (ValueError, OSError, RuntimeError) as exc:
            _fail(str(exc))
        out = _console()
        try:
            out.print(f"Serving {server.model} ({server.dim}-dim) at {server.base_url}")
            if tls:
                out.print(f"CA certificate: {server.ca_cert_path}  (pass --ca to clients)")
            out.print(
                f"Try: qwen-embed check --base-url {server.base_url}"
                + (f" --ca {server.ca_cert_path}" if tls else "")
            )
            deadline = time.monotonic() + duration if duration else None
            while deadline is None or time.monotonic() < deadline:
                time.sleep(
                    0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
                )
        except KeyboardInterrupt:
            pass
        finally:
            server.close()

    return cli


# --------------------------------------------------------------------------- embed I/O


_BLANK_LINES_SHOWN = 5
"""How many line numbers of skipped blank records the ``embed`` notice lists."""


def _preparer(
    input_path: str, task: str | None, max_chars: int | None
) -> Callable[[int, str], str]:
    """``prepare(line_number, text)``: the text ``embed`` sends for a record of INPUT.

    With the query instruction when ``task`` is given, and checked as the client checks
    it, so a bad record is reported by file and line (1-based), not by its position in
    a chunk.

    Raises (from ``prepare``):
        InputError: the text cannot be sent (see ``protocol.validate_text``).
    """
    from .errors import InputError
    from .protocol import format_query, validate_text

    def prepare(number: int, text: str) -> str:
        sent = text if task is None else format_query(text, task)
        try:
            return validate_text(sent, None, max_chars=max_chars)
        except InputError as exc:
            raise InputError(f"{input_path}:{number + 1}: {exc}") from exc

    return prepare


def _scan_records(path: str, prepare: Callable[[int, str], str]) -> tuple[int, int, list[int]]:
    """One pass over ``path`` before anything is sent: every record is checked with
    ``prepare``. Returns the number of records, the number of blank records skipped,
    and the first (up to ``_BLANK_LINES_SHOWN``) of their 1-based line numbers."""
    from .bench import iter_texts

    blank: list[int] = []  # 1-based lines of the blank records (the first few)
    blanks = 0

    def skipped(number: int) -> None:
        nonlocal blanks
        blanks += 1
        if len(blank) < _BLANK_LINES_SHOWN:
            blank.append(number + 1)

    total = 0
    for number, text, _ in iter_texts(path, on_blank=skipped):
        prepare(number, text)
        total += 1
    return total, blanks, blank


def _blank_notice(count: int, lines: list[int]) -> str:
    """The notice, e.g. ``skipped 1 blank record (line 2)``; "..." when ``lines``
    holds only the first of them."""
    where = ", ".join(map(str, lines)) + (", ..." if count > len(lines) else "")
    plural = "s" if count != 1 else ""
    return f"skipped {count:,} blank record{plural} (line{'s' if len(lines) > 1 else ''} {where})"


def _embed_file(
    client: Any,
    input_path: str,
    output_path: str,
    total: int,
    prepare: Callable[[int, str], str],
    chunk_size: int,
    advance: Callable[[int], None],
) -> int:
    """Stream ``input_path`` through ``client`` into ``output_path``; returns the dim.

    Writes a temporary file in the output's directory and moves it onto
    ``output_path`` (``os.replace``, atomic) once every record is embedded; on any
    failure, ``KeyboardInterrupt`` included, removes it and leaves ``output_path``
    as it was.
    """
    import os
    import secrets

    target = Path(output_path)
    while True:
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.part")
        try:
            fh = open(tmp, "xb")  # noqa: SIM115 - closed below, before the replace
        except FileExistsError:  # pragma: no cover - 32 random bits
            continue
        except OSError as exc:
            raise OSError(exc.errno, f"cannot write {output_path}: {exc.strerror}") from exc
        break
    try:
        with fh:
            dim = _write_vectors(
                client,
                input_path,
                fh,
                target.suffix.lower() == ".npy",
                total,
                prepare,
                chunk_size,
                advance,
            )
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dim


def _write_vectors(
    client: Any,
    input_path: str,
    fh: BinaryIO,
    npy: bool,
    total: int,
    prepare: Callable[[int, str], str],
    chunk_size: int,
    advance: Callable[[int], None],
) -> int:
    """Embed the records of ``input_path`` chunk by chunk and write each chunk's rows
    to ``fh`` (.npy: header for ``total`` rows, then float32 rows; else JSON lines) as
    soon as it is embedded. Returns the dim."""
    import itertools

    import numpy as np
    import orjson
    from numpy.lib.format import dtype_to_descr, write_array_header_1_0

    from .bench import iter_texts

    changed = f"{input_path} changed while being read"
    records = iter_texts(input_path)
    row = 0
    dim = 0
    while chunk := list(itertools.islice(records, chunk_size)):
        if row + len(chunk) > total:
            raise ValueError(f"{changed} (more than {total} records)")
        texts = [prepare(number, text) for number, text, _ in chunk]
        vectors = client.embed_documents_array(texts, progress=advance)
        if row == 0:
            dim = int(vectors.shape[1])
            if npy:
                header = {"descr": dtype_to_descr(np.dtype("<f4")), "fortran_order": False}
                write_array_header_1_0(fh, {**header, "shape": (total, dim)})
        elif vectors.shape[1] != dim:
            raise ValueError(
                f"{input_path}:{chunk[0][0] + 1}: the server answered "
                f"{vectors.shape[1]}-dim vectors after {dim}-dim ones"
            )
        if npy:
            fh.write(np.ascontiguousarray(vectors, dtype="<f4").tobytes())
        else:
            lines = []
            for (number, _, ident), vec in zip(chunk, vectors, strict=True):
                item: dict[str, Any] = {"index": number}
                if ident is not None:
                    item["id"] = ident
                item["embedding"] = vec
                lines.append(orjson.dumps(item, option=orjson.OPT_SERIALIZE_NUMPY))
            fh.write(b"\n".join(lines) + b"\n")
        row += len(chunk)
    if row != total:
        raise ValueError(f"{changed} ({row} of {total} records)")
    return dim


if __name__ == "__main__":  # pragma: no cover
    main()
