"""``qwen-embed check``: what the server is and supports, with advice per finding."""

from __future__ import annotations

import click

from ._options import MODELS_DEFAULT, output_options, server_options, shown, sized

__all__ = ["check"]


@click.command()
@server_options(required_url=True, model_help=f"Model to probe ({MODELS_DEFAULT}).")
@shown(
    "--max-idle",
    type=click.FloatRange(0.5, 60),
    default=6.5,
    help="Longest idle wait of the keep-alive probe (s).",
)
@sized(
    "--batch-probe-max",
    upper=2048,
    default=128,
    help="Largest batch the batch-limit probe sends (texts; a CPU server may take ~40 ms "
    "per text).",
)
@shown(
    "--timeout",
    type=click.FloatRange(0.5, 86400),
    default=300.0,
    help="Seconds the whole check may take: each probe runs within the time left, and "
    "one the deadline cuts fails naming it.",
)
@output_options()
def check(
    base_url: str,
    api_key: str | None,
    model: str | None,
    ca: str | None,
    insecure: bool,
    max_idle: float,
    batch_probe_max: int,
    timeout: float,
    as_json: bool,
    show_metrics: bool,
) -> None:
    """What the server is and supports, with advice per finding.

    Health, model and vector size, base64, MRL dimensions, batch limit, HTTP/2,
    the idle keep-alive timeout it enforces, and a latency sample (--metrics: the
    client's counters of that sample). The advice names the settings of the server
    software the client detects (SGLang, vLLM, TEI, Infinity, Ollama, llama.cpp, ...);
    a base URL missing its /v1 is diagnosed as such. Exit status 1 when a probe failed.

    The whole check ends within --timeout seconds; every answer it reads is capped
    (1 MiB for a GET; a POST by its number of texts), and the API key is scrubbed from
    everything it prints.
    """
    from .. import QwenEmbedError
    from ._check import check_server
    from ._options import verify_setting
    from ._output import check_table, console, fail, report, warnings_in_report

    verify = verify_setting(ca, insecure)
    err = console(stderr=True)
    try:
        # the library's warnings go into the report's notes, not on stderr above it
        with warnings_in_report(), err.status("probing...") as status:
            result = check_server(
                base_url,
                api_key=api_key,
                verify=verify,
                model=model,
                max_idle=max_idle,
                batch_probe_max=batch_probe_max,
                timeout=timeout,
                step=lambda name: status.update(f"probing {name}..."),
            )
    except QwenEmbedError as exc:  # the settings themselves (e.g. a malformed URL)
        fail(str(exc), 2)
    report(
        result.to_dict(),
        lambda out: out.print(check_table(result)),
        as_json=as_json,
        metrics_of=result.base_url if show_metrics else None,
    )
    if not result.ok:
        raise SystemExit(1)
