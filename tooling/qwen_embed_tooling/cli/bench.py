"""``qwen-embed bench``: naive vs pooled vs async vs HTTP/2 vs batched, side by side."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from qwen_embed_plugins._install import install_command as _install_command
from qwen_embed_plugins.cli._options import (
    MODELS_DEFAULT,
    output_options,
    server_options,
    shown,
    sized,
)

from ..bench.results import MODES

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["bench"]

SERVER_DEPS_HINT = f"{_install_command('tooling')}, or pass --base-url"


@click.command()
@server_options(required_url=False, model_help=f"Model name ({MODELS_DEFAULT}).")
@sized("--requests", "n_requests", upper=None, default=200, help="HTTP requests per mode.")
@sized("--concurrency", upper=1024, default=16, help="Threads or tasks per mode.")
@sized("--batch-size", upper=2048, default=32, help="Texts per request in mode (e).")
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
@sized("--pool-size", upper=None, default=20, help="Limits.max_connections of the pooled modes.")
@click.option(
    "--mode",
    "modes",
    multiple=True,
    type=click.Choice(MODES),
    help="Run only these modes (repeatable). Default: all.",
)
@shown(
    "--naive-trust",
    type=click.Choice(["ca", "bundle"]),
    default="ca",
    help="With a private CA: the naive client's per-request SSL context "
    "holds only that CA, or certifi's roots plus it (what OpenAI() loads).",
)
@click.option(
    "--wide",
    is_flag=True,
    help="Every column (p95, mean, server connections, errors, HTTP version) and the "
    "full mode descriptions; the default table fits 100 columns.",
)
@output_options()
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
    wide: bool,
    as_json: bool,
    show_metrics: bool,
) -> None:
    """Naive vs pooled vs async vs HTTP/2 vs batched, side by side.

    Each mode sends --requests requests from --concurrency threads or tasks and is
    measured: latency percentiles, requests/s, texts/s, TCP connections opened,
    client CPU per request, errors, and the ratio to the naive client (a). The table
    ends with a one-line conclusion: the pooled client's req/s against the naive one's.

    Without --base-url it starts a local server on 127.0.0.1 (HTTPS, a throw-away
    test CA, an emulated 40 ms round trip).
    """
    import contextlib
    import dataclasses

    from qwen_embed_plugins import QwenEmbedError
    from qwen_embed_plugins._corpus import load_texts
    from qwen_embed_plugins.cli._options import verify_setting
    from qwen_embed_plugins.cli._output import console, fail, print_json, progress_bar, report

    from ..bench.results import BENCH_SCHEMA
    from ..bench.run import Target, local_target, run_bench
    from ._output import RichBenchProgress, bench_renderables

    if base_url and (rtt_ms is not None or no_tls):
        raise click.UsageError(
            "--rtt-ms and --no-tls apply to the built-in local server only (leave out --base-url)"
        )
    verify = verify_setting(ca, insecure)
    try:
        texts = load_texts(texts_file) if texts_file else None
    except (ValueError, OSError) as exc:
        fail(f"cannot read --texts: {exc}", 2)
    if texts is not None and not texts:
        fail(f"{texts_file} holds no text", 2)
    err = console(stderr=True)
    rtt = 40.0 if rtt_ms is None else rtt_ms
    with contextlib.ExitStack() as stack:
        if base_url:
            target = Target(base_url, verify=verify, api_key=api_key, model=model)
        else:
            if not as_json:
                err.print(
                    "Starting the built-in server on 127.0.0.1 "
                    f"({'HTTP' if no_tls else 'HTTPS, test CA'}, emulated round "
                    f"trip {rtt:g} ms)..."
                )
            try:
                local = stack.enter_context(local_target(rtt_ms=rtt, tls=not no_tls))
            except ImportError as exc:
                fail(f"the built-in server cannot start ({exc}): {SERVER_DEPS_HINT}")
            target = dataclasses.replace(local, api_key=api_key, model=model)
        if not as_json:
            err.print(f"measuring {target.base_url} ...", soft_wrap=True, markup=False)
        bar = progress_bar(err)
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
                    progress=RichBenchProgress(bar),
                    naive_trust="bundle" if naive_trust == "bundle" else "ca",
                )
        except QwenEmbedError as exc:
            if as_json:  # machines still get a JSON document on stdout
                print_json(
                    {
                        "schema": BENCH_SCHEMA,
                        "ok": False,
                        "error": str(exc),
                        "error_type": type(exc).__name__,
                    }
                )
            fail(str(exc))

    def render(out: Console) -> None:
        for item in bench_renderables(result, wide=wide):
            out.print(item)

    report(
        result.to_dict(),
        render,
        as_json=as_json,
        metrics_of=result.base_url if show_metrics else None,
        wide=wide,
    )
