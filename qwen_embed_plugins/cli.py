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
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

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


# --------------------------------------------------------------------------- commands


def _build() -> click.Group:
    import click

    from . import __version__
    from .bench import MODES

    @click.group(context_settings={"help_option_names": ["-h", "--help"]})
    @click.version_option(__version__, prog_name="qwen-embed")
    def cli() -> None:
        """Is my embedding service slow, or is my client?

        Measure (bench), probe (check), use (embed) an OpenAI-compatible
        /v1/embeddings server, or start a local one (serve).
        """

    # ------------------------------------------------------------------ bench
    @cli.command()
    @click.option(
        "--base-url",
        metavar="URL",
        help="API root, e.g. http://gpu-box:30000/v1. Default: start a local "
        "server on loopback with HTTPS and an emulated round trip.",
    )
    @click.option(
        "--api-key",
        envvar="QWEN_EMBED_API_KEY",
        metavar="KEY",
        help="Bearer key [env QWEN_EMBED_API_KEY].",
    )
    @click.option("--model", help="Model name (default: the first one /models lists).")
    @click.option(
        "--requests",
        "n_requests",
        type=click.IntRange(1),
        default=200,
        show_default=True,
        help="HTTP requests per mode.",
    )
    @click.option(
        "--concurrency",
        type=click.IntRange(1, 1024),
        default=16,
        show_default=True,
        help="Threads or tasks per mode.",
    )
    @click.option(
        "--batch-size",
        type=click.IntRange(1, 2048),
        default=32,
        show_default=True,
        help="Texts per request in mode (e).",
    )
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
    @click.option(
        "--pool-size",
        type=click.IntRange(1),
        default=20,
        show_default=True,
        help="Limits.max_connections of the pooled modes.",
    )
    @click.option(
        "--mode",
        "modes",
        multiple=True,
        type=click.Choice(MODES),
        help="Run only these modes (repeatable). Default: all.",
    )
    @click.option(
        "--naive-trust",
        type=click.Choice(["ca", "bundle"]),
        default="ca",
        show_default=True,
        help="With a private CA: the naive client's per-request SSL context "
        "holds only that CA, or certifi's roots plus it (what OpenAI() loads).",
    )
    @click.option(
        "--ca",
        type=click.Path(exists=True, dir_okay=False),
        help="CA bundle (PEM) to verify an https:// server.",
    )
    @click.option("--insecure", is_flag=True, help="Do not verify TLS certificates.")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
    def bench(
        base_url: str | None,
        api_key: str | None,
        model: str | None,
        n_requests: int,
        concurrency: int,
        batch_size: int,
        texts_file: str | None,
        rtt_ms: float | None,
        no_tls: bool,
        pool_size: int,
        modes: tuple[str, ...],
        naive_trust: str,
        ca: str | None,
        insecure: bool,
        as_json: bool,
    ) -> None:
        """Naive vs pooled vs async vs HTTP/2 vs batched, side by side.

        Each mode sends --requests requests from --concurrency threads or tasks and is
        measured: latency percentiles, requests/s, texts/s, TCP connections opened,
        client CPU per request, errors, and the ratio to the naive client (a).
        """
        import contextlib
        import dataclasses

        from .bench import Target, load_texts, local_target, run_bench
        from .errors import QwenEmbedError

        if base_url and (rtt_ms is not None or no_tls):
            _fail(
                "--rtt-ms and --no-tls apply to the built-in local server only "
                "(leave out --base-url)",
                2,
            )
        texts = load_texts(texts_file) if texts_file else None
        if texts is not None and not texts:
            _fail(f"{texts_file} holds no text", 2)
        err = _console(stderr=True)
        stack = contextlib.ExitStack()
        with stack:
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
                            f"trip {40.0 if rtt_ms is None else rtt_ms:g} ms)..."
                        )
                    local = stack.enter_context(
                        local_target(
                            rtt_ms=40.0 if rtt_ms is None else rtt_ms,
                            tls=not no_tls,
                        )
                    )
                except ImportError as exc:
                    _fail(
                        f"the built-in server needs the 'testing' extra ({exc}): "
                        "pip install 'qwen-embed-plugins[testing]', or pass --base-url"
                    )
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
                _fail(str(exc))
        if as_json:
            _print_json(result.to_dict())
            return
        out = _console()
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

    # ------------------------------------------------------------------ check
    @cli.command()
    @click.option(
        "--base-url",
        envvar="QWEN_EMBED_BASE_URL",
        required=True,
        metavar="URL",
        help="API root, e.g. http://gpu-box:30000/v1 [env QWEN_EMBED_BASE_URL].",
    )
    @click.option(
        "--api-key",
        envvar="QWEN_EMBED_API_KEY",
        metavar="KEY",
        help="Bearer key [env QWEN_EMBED_API_KEY].",
    )
    @click.option("--model", help="Model to probe (default: the first one /models lists).")
    @click.option(
        "--ca",
        type=click.Path(exists=True, dir_okay=False),
        help="CA bundle (PEM) to verify an https:// server.",
    )
    @click.option("--insecure", is_flag=True, help="Do not verify TLS certificates.")
    @click.option(
        "--max-idle",
        type=click.FloatRange(0.5, 60),
        default=6.5,
        show_default=True,
        help="Longest idle wait of the keep-alive probe (s).",
    )
    @click.option(
        "--batch-probe-max",
        type=click.IntRange(1, 2048),
        default=512,
        show_default=True,
        help="Largest batch the batch-limit probe sends.",
    )
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
    def check(
        base_url: str,
        api_key: str | None,
        model: str | None,
        ca: str | None,
        insecure: bool,
        max_idle: float,
        batch_probe_max: int,
        as_json: bool,
    ) -> None:
        """What the server is and supports, with advice per finding.

        Health, model and vector size, base64, MRL dimensions, batch limit, HTTP/2,
        the idle keep-alive timeout it enforces, and a latency sample.
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
        if as_json:
            _print_json(report.to_dict())
        else:
            _console().print(_check_table(report))
        if not report.ok:
            raise SystemExit(1)

    # ------------------------------------------------------------------ embed
    @cli.command()
    @click.option(
        "--base-url",
        envvar="QWEN_EMBED_BASE_URL",
        required=True,
        metavar="URL",
        help="API root [env QWEN_EMBED_BASE_URL].",
    )
    @click.option(
        "--api-key",
        envvar="QWEN_EMBED_API_KEY",
        metavar="KEY",
        help="Bearer key [env QWEN_EMBED_API_KEY].",
    )
    @click.option(
        "--model",
        envvar="QWEN_EMBED_MODEL",
        help="Model name [env QWEN_EMBED_MODEL; default Qwen/Qwen3-Embedding-0.6B].",
    )
    @click.option(
        "--query", is_flag=True, help="The texts are search queries: add the Qwen3 instruction."
    )
    @click.option("--dimensions", type=click.IntRange(1), help="MRL output size.")
    @click.option(
        "--batch-size",
        type=click.IntRange(1, 2048),
        default=32,
        show_default=True,
        help="Texts per request.",
    )
    @click.option(
        "--concurrency",
        type=click.IntRange(1, 1024),
        default=4,
        show_default=True,
        help="Requests in flight.",
    )
    @click.option(
        "--chunk-size",
        type=click.IntRange(1),
        default=2048,
        show_default=True,
        help="Texts read, embedded and written per step (bounds memory).",
    )
    @click.option("--http2", is_flag=True, help="Use HTTP/2 (falls back to HTTP/1.1).")
    @click.option(
        "--ca",
        type=click.Path(exists=True, dir_okay=False),
        help="CA bundle (PEM) to verify an https:// server.",
    )
    @click.option("--insecure", is_flag=True, help="Do not verify TLS certificates.")
    @click.argument("input_path", metavar="INPUT", type=click.Path(exists=True, dir_okay=False))
    @click.argument("output_path", metavar="OUTPUT", type=click.Path(dir_okay=False))
    def embed(
        base_url: str,
        api_key: str | None,
        model: str | None,
        query: bool,
        dimensions: int | None,
        batch_size: int,
        concurrency: int,
        chunk_size: int,
        http2: bool,
        ca: str | None,
        insecure: bool,
        input_path: str,
        output_path: str,
    ) -> None:
        """Embed INPUT (one text per line, or JSONL with "text") into OUTPUT.

        OUTPUT is .npy (float32, rows x dim, one row per non-blank input record) or
        .jsonl ({"index": input line number, "id": ..., "embedding": [...]}). Streams
        in chunks: memory stays bounded for any input size.
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
        try:
            total = _count_records(input_path)
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
                    query,
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
    @click.option(
        "--port",
        type=click.IntRange(0, 65535),
        default=30000,
        show_default=True,
        help="Port on 127.0.0.1 (0 picks a free one).",
    )
    @click.option("--tls", is_flag=True, help="HTTPS with a throw-away test CA.")
    @click.option("--http2", is_flag=True, help="Also serve HTTP/2 (ALPN h2, h2c).")
    @click.option(
        "--latency",
        type=click.FloatRange(0),
        default=0.0,
        show_default=True,
        help="Seconds added to every embedding request.",
    )
    @click.option(
        "--dim", type=click.IntRange(1), default=1024, show_default=True, help="Vector size."
    )
    @click.option("--model", default=None, help="Model name served.")
    @click.option("--matryoshka", is_flag=True, help="Accept `dimensions` (MRL).")
    @click.option(
        "--keep-alive-timeout",
        type=click.FloatRange(0.001),
        default=5.0,
        show_default=True,
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
            _fail(f"{exc}: pip install 'qwen-embed-plugins[testing]'")
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
            _fail(
                f"the server needs the 'testing' extra ({exc}): "
                "pip install 'qwen-embed-plugins[testing]'"
            )
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


def _count_records(path: str) -> int:
    from .bench import iter_texts

    return sum(1 for _ in iter_texts(path))


def _embed_file(
    client: Any,
    input_path: str,
    output_path: str,
    total: int,
    query: bool,
    chunk_size: int,
    advance: Any,
) -> int:
    """Stream ``input_path`` through ``client`` into ``output_path``; returns the dim."""
    import itertools

    import numpy as np
    import orjson
    from numpy.lib.format import open_memmap

    from .bench import iter_texts
    from .protocol import format_query

    npy = output_path.lower().endswith(".npy")
    task = client.config.query_instruction
    records = iter_texts(input_path)
    out_arr: Any = None
    fh = None if npy else open(output_path, "wb")  # noqa: SIM115 - closed in finally
    row = 0
    dim = 0
    try:
        while True:
            chunk = list(itertools.islice(records, chunk_size))
            if not chunk:
                break
            texts = [format_query(t, task) if query else t for _, t, _ in chunk]
            try:
                vectors = client.embed_documents_array(texts, progress=advance)
            except Exception as exc:
                from .errors import InputError

                if isinstance(exc, InputError) and exc.index is not None:
                    line = chunk[exc.index][0] + 1
                    raise InputError(f"{input_path}:{line}: {exc}", index=row + exc.index) from exc
                raise
            dim = int(vectors.shape[1])
            if npy:
                if out_arr is None:
                    out_arr = open_memmap(
                        output_path, mode="w+", dtype=np.float32, shape=(total, dim)
                    )
                out_arr[row : row + len(chunk)] = vectors
            else:
                assert fh is not None
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
            raise ValueError(f"{input_path} changed while being read ({row} of {total} rows)")
    finally:
        if fh is not None:
            fh.close()
        if out_arr is not None:
            out_arr.flush()
            del out_arr
    return dim


if __name__ == "__main__":  # pragma: no cover
    main()
