"""``qwen-embed embed``: embed a text file into ``.npy`` or JSON lines, resumably."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from ._options import DEFAULT, DEFAULT_MODEL, server_options, setting_option, sized

if TYPE_CHECKING:
    from rich.console import Console

    from ._embed_job import Outcome, Settings, StatePaths

__all__ = ["embed"]

_OUTPUT_SUFFIXES = (".npy", ".jsonl", ".ndjson")
_WAIT_FOR_SERVER = 2.0  # seconds: RetryConfig's default wait_for_server


@click.command()
@server_options(
    required_url=True, model_help=f"Model name; default {DEFAULT_MODEL}.", model_env=True
)
@click.option(
    "--query", is_flag=True, help="The texts are search queries: add the Qwen3 instruction."
)
@setting_option("dimensions", type=click.IntRange(1), help="MRL output size.")
@setting_option(
    "batch_size",
    env=False,  # the variable may say "auto"; the job sends fixed-size batches
    type=click.IntRange(1, 2048),
    default=32,
    show_default=True,
    help="Texts per request.",
)
@sized("--concurrency", upper=1024, default=4, help="Requests in flight.")
@sized(
    "--chunk-size",
    upper=None,
    default=2048,
    help="Most texts held in memory at once (in flight); bounds memory with --concurrency.",
)
@setting_option("http2", is_flag=True, help="Use HTTP/2 (falls back to HTTP/1.1).")
@setting_option(
    "deadline",
    env=False,
    type=click.FloatRange(0.001, 86400.0),
    default=DEFAULT["deadline"],
    show_default=True,
    metavar="SECONDS",
    help="Longest time one batch may take, retries and waits included, in seconds.",
)
@click.option(
    "--wait-for-server",
    type=click.FloatRange(0.0, 86400.0),
    default=_WAIT_FOR_SERVER,
    show_default=True,
    metavar="SECONDS",
    help="While no request of the run has reached the server, connection failures "
    "(refused, DNS, timeout, TLS) end the run after this many seconds; raise it to start "
    "the job before its server. Once the server has answered, an outage is retried "
    "until --deadline.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Make the run resumable, and continue an interrupted one: keeps .OUTPUT.part and "
    ".OUTPUT.resume beside OUTPUT until it completes. Refused if INPUT or the settings "
    "changed.",
)
@click.option(
    "--ray",
    "use_ray",
    is_flag=True,
    help="Run on Ray Data (extra [ray]): INPUT is Parquet or JSONL (a file or a folder), "
    "OUTPUT a folder of Parquet files (the input columns plus 'embedding'); one client "
    "(one pool) per Ray actor.",
)
@click.option("--column", default="text", show_default=True, help="--ray: the text column.")
@click.option(
    "--address",
    envvar="RAY_ADDRESS",
    help="--ray: the Ray cluster to use [env RAY_ADDRESS; default: a local one].",
)
@sized("--actors", upper=4096, default=1, help="--ray: Ray actors (client processes).")
@click.option(
    "--on-error",
    type=click.Choice(["raise", "skip"]),
    default="raise",
    show_default=True,
    help="--ray: 'skip' writes a null embedding and an error column for rows the server "
    "cannot embed, and finishes the job.",
)
@click.option("--input", "input_opt", type=click.Path(exists=True), help="Same as INPUT.")
@click.option("--output", "output_opt", type=click.Path(), help="Same as OUTPUT.")
@click.argument("input_path", metavar="INPUT", required=False, type=click.Path(exists=True))
@click.argument("output_path", metavar="OUTPUT", required=False, type=click.Path())
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
    deadline: float,
    wait_for_server: float,
    resume: bool,
    use_ray: bool,
    column: str,
    address: str | None,
    actors: int,
    on_error: str,
    input_opt: str | None,
    output_opt: str | None,
    input_path: str | None,
    output_path: str | None,
) -> None:
    """Embed INPUT (one text per line, or JSONL with "text") into OUTPUT.

    OUTPUT is .npy (float32, rows x dim, one row per non-blank input record, in order)
    or .jsonl ({"index": i, "id": ..., "embedding": [...]} per record, where i is the
    record's 0-based line index in INPUT: line number - 1). Blank (empty or
    whitespace-only) records are skipped; stderr says how many and on which lines.

    OUTPUT is written beside it as .OUTPUT.part and replaces OUTPUT only when every
    record was embedded and INPUT did not change meanwhile: a failed or interrupted run
    (Ctrl-C, SIGTERM, SIGHUP) leaves OUTPUT as it was. OUTPUT may not be INPUT.
    With --resume, a killed or failed run continues where it stopped when the same
    command is run again, and ends with the same bytes as an uninterrupted run.

    With --ray, the job runs on Ray Data: see docs/scale-out.md.
    """
    import time
    from pathlib import Path

    input_path = input_path or input_opt
    output_path = output_path or output_opt
    if not input_path or not output_path:
        raise click.UsageError("give INPUT and OUTPUT (or --input and --output)")
    if use_ray:
        _run_on_ray(
            input_path,
            output_path,
            base_url=base_url,
            api_key=api_key,
            model=model,
            ca=ca,
            insecure=insecure,
            query=query,
            dimensions=dimensions,
            batch_size=batch_size,
            concurrency=concurrency,
            http2=http2,
            deadline=deadline,
            wait_for_server=wait_for_server,
            column=column,
            address=address,
            actors=actors,
            on_error=on_error,
        )
        return
    if Path(input_path).is_dir():
        raise click.UsageError("INPUT is a folder: only --ray reads folders")

    from .. import Limits, QwenEmbedError, RetryConfig
    from ._embed_job import Settings, StatePaths, UsageProblem, check_paths
    from ._options import verify_setting
    from ._output import console, fail

    paths = StatePaths(output_path)
    try:  # first: `embed in.txt in.txt` is told that OUTPUT is INPUT, not about suffixes
        check_paths(input_path, paths)
    except UsageProblem as exc:
        fail(str(exc), 2)
    suffix = Path(output_path).suffix.lower()
    if suffix not in _OUTPUT_SUFFIXES:
        raise click.UsageError("OUTPUT must end in .npy, .jsonl or .ndjson")
    from .. import EmbeddingClient, EmbeddingConfig

    try:
        cfg = EmbeddingConfig(
            base_url=base_url,
            api_key=api_key,
            model=model,
            dimensions=dimensions,
            batch_size=batch_size,
            max_concurrency=1,  # one batch per call; the job keeps --concurrency in flight
            limits=Limits(max_connections=max(Limits().max_connections, concurrency)),
            http2=http2,
            verify=verify_setting(ca, insecure),
            retry=RetryConfig(deadline=deadline, wait_for_server=wait_for_server),
        )
    except QwenEmbedError as exc:
        fail(str(exc), 2)
    settings = Settings(
        endpoint=cfg.endpoint,
        model=str(cfg.model),
        dimensions=dimensions,
        query_instruction=cfg.query_task if query else None,
        batch_size=batch_size,
        output_format="npy" if suffix == ".npy" else "jsonl",
    )
    err = console(stderr=True)
    started = time.perf_counter()
    outcome = _run(
        EmbeddingClient(cfg),
        input_path,
        paths,
        settings,
        cfg.max_text_chars,
        resume,
        window=max(1, min(concurrency, chunk_size // batch_size or 1)),
        err=err,
    )
    seconds = time.perf_counter() - started
    resumed = f", {outcome.resumed:,} of them from the interrupted run" if outcome.resumed else ""
    err.print(
        f"embedded {outcome.total:,} texts ({outcome.dim}-dim) into {output_path} in "
        f"{seconds:.1f} s ({outcome.sent / max(seconds, 1e-9):,.0f} texts/s{resumed})",
        soft_wrap=True,
        markup=False,
    )


def _run_on_ray(input_path: str, output_path: str, **opts: Any) -> None:
    """``embed --ray``: ``qwen_embed_plugins.ray.embed_files`` with the command's
    settings; one line of summary on stderr."""
    import os
    import time

    from ._options import verify_setting
    from ._output import console, fail

    if opts["query"]:
        raise click.UsageError("--query is not supported with --ray")
    try:
        from ..ray import embed_files
    except ImportError as exc:
        from .._install import install_command as _install_command

        fail(f"--ray needs Ray Data: {_install_command('ray')} ({exc})", 2)
    if opts["api_key"]:
        # Ray actors read the key from their environment (it is never pickled); local
        # actors inherit this process's.
        os.environ["QWEN_EMBED_API_KEY"] = opts["api_key"]
    from .. import QwenEmbedError, RetryConfig

    settings: dict[str, Any] = {
        "model": opts["model"],
        "dimensions": opts["dimensions"],
        "http2": opts["http2"],
        "retry": RetryConfig(deadline=opts["deadline"], wait_for_server=opts["wait_for_server"]),
        "verify": verify_setting(opts["ca"], opts["insecure"]),
    }
    started = time.perf_counter()
    try:
        result = embed_files(
            input_path,
            output_path,
            column=opts["column"],
            base_url=opts["base_url"],
            address=opts["address"],
            concurrency=opts["actors"],
            max_in_flight=opts["concurrency"],
            request_batch_size=opts["batch_size"],
            on_error=opts["on_error"],
            **{k: v for k, v in settings.items() if v is not None},
        )
    except (QwenEmbedError, ValueError, OSError) as exc:
        fail(str(exc))
    seconds = time.perf_counter() - started
    rows = "?" if result.rows is None else f"{result.rows:,}"
    failed = f", {result.failed_rows:,} failed (see the error column)" if result.failed_rows else ""
    console(stderr=True).print(
        f"embedded {rows} rows into {result.output_dir} ({len(result.files)} Parquet "
        f"files) in {seconds:.1f} s on Ray{failed}",
        soft_wrap=True,
        markup=False,
    )


def _blank_notice(count: int, lines: list[int]) -> str:
    """E.g. ``skipped 1 blank record (line 2)``; "..." when ``lines`` holds only the
    first of them."""
    where = ", ".join(map(str, lines)) + (", ..." if count > len(lines) else "")
    plural = "s" if count != 1 else ""
    return f"skipped {count:,} blank record{plural} (line{'s' if len(lines) > 1 else ''} {where})"


def _run(
    client: Any,
    input_path: str,
    paths: StatePaths,
    settings: Settings,
    max_chars: int | None,
    resume: bool,
    *,
    window: int,
    err: Console,
) -> Outcome:
    """Scan, then run the job with a progress bar; every way out ends in one message."""
    from .. import QwenEmbedError, format_query
    from ._embed_job import JobError, UsageProblem, run_job, scan_input
    from ._output import fail, progress_bar
    from ._signals import Terminated, describe, exit_status

    task = settings.query_instruction

    def prepare(text: str) -> str:
        return text if task is None else format_query(text, task)

    try:
        scan = scan_input(input_path, prepare, max_chars)
    except (JobError, ValueError, OSError) as exc:
        fail(str(exc))
    if scan.blanks:
        err.print(_blank_notice(scan.blanks, scan.blank_lines), markup=False, soft_wrap=True)
    if scan.total == 0:
        fail(f"{input_path} holds no text", 2)
    states: list[Any] = []
    bar = progress_bar(err, unit="texts")
    try:
        with bar:
            progress = bar.add_task("embedding", total=scan.total)
            return run_job(
                client,
                input_path,
                paths,
                scan,
                settings,
                prepare,
                resume=resume,
                window=window,
                progress=lambda n: bar.advance(progress, n),
                on_state=states.append,
            )
    except UsageProblem as exc:
        fail(str(exc), 2)
    except (QwenEmbedError, JobError, ValueError, OSError) as exc:
        fail(str(exc) + _kept(states, paths, resume))
    except (KeyboardInterrupt, Terminated) as exc:
        newline = "\n" if sys.stderr.isatty() else ""  # end the line of the echoed ^C
        click.echo(f"{newline}qwen-embed: {describe(exc)}{_kept(states, paths, resume)}", err=True)
        raise click.exceptions.Exit(exit_status(exc)) from None


def _kept(states: list[Any], paths: StatePaths, resume: bool) -> str:
    """What the failed run left: nothing (OUTPUT as it was, or still absent), or the
    resumable part."""
    if not resume or not states:
        if not paths.output.exists():
            return f"; nothing written to {paths.output}"
        return f"; {paths.output} left as it was"
    state = states[0]
    return (
        f"; {state.texts_done():,} of {state.total:,} texts embedded and kept in "
        f"{paths.part}: run the same command to continue"
    )
