"""``qwen-embed serve``: the loopback test server in the foreground (for demos)."""

from __future__ import annotations

import click

from qwen_embed_plugins.cli._options import shown, sized

__all__ = ["serve"]

# Names of the real model of scripts/realserver.py: this server would only rename its
# deterministic vectors, so asking for one gets the command that serves the real one.
_REAL_MODELS = frozenset({"minilm", "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2"})
_REAL_MODEL_ROUTE = (
    "qwen-embed serve answers with deterministic test vectors, not a real model, so "
    "--model {name} would only rename them. For all-MiniLM-L6-v2 (real weights, 384 "
    "dimensions, through Infinity) run, in a checkout: python3 scripts/realserver.py "
    "start  (the first run installs it into ~/.cache/qwen-embed-plugins: 1.6 GB, "
    "93-129 s on a 2-core machine, then ~8 s per start; it prints "
    "http://127.0.0.1:7997/v1 once healthy, model all-MiniLM-L6-v2); "
    "python3 scripts/realserver.py stop  stops it. See README, 'A real model for "
    "prototyping'."
)


@click.command()
@shown(
    "--port",
    type=click.IntRange(0, 65535),
    default=30000,
    help="Port on 127.0.0.1 (0 picks a free one).",
)
@click.option("--tls", is_flag=True, help="HTTPS with a throw-away test CA.")
@click.option("--http2", is_flag=True, help="Also serve HTTP/2 (ALPN h2, h2c).")
@shown(
    "--latency",
    type=click.FloatRange(0),
    default=0.0,
    help="Seconds added to every embedding request.",
)
@sized("--dim", upper=None, default=1024, help="Vector size.")
@click.option(
    "--model", default=None, help="Model name served (default: the first of --model-names)."
)
@click.option(
    "--model-names",
    default="",
    metavar="A,B",
    help="Serve only these model names (comma-separated); a request naming another "
    "gets vLLM's 404. Default: any name is answered.",
)
@click.option("--matryoshka", is_flag=True, help="Accept `dimensions` (MRL).")
@shown(
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
    model_names: str,
    matryoshka: bool,
    keep_alive_timeout: float,
    api_key: str | None,
    duration: float,
) -> None:
    """Run the loopback test server in the foreground (for demos).

    Deterministic vectors (not a real model), SGLang's dialect, on 127.0.0.1. Stops
    after --duration (status 0) or on Ctrl-C (status 130).
    A real model instead: `python3 scripts/realserver.py start` in a checkout serves
    all-MiniLM-L6-v2 through Infinity (see README, "A real model for prototyping");
    `--model minilm` (or all-MiniLM-L6-v2) prints that command and exits with status 1.
    """
    import errno
    import threading

    from qwen_embed_plugins._install import install_command as _install_command
    from qwen_embed_plugins.cli._output import console, fail

    from ..testing import DEFAULT_MODEL, EmbeddingServer

    hint = f"needs the tooling's dependencies: {_install_command('tooling')}"
    names = [name.strip() for name in model_names.split(",") if name.strip()]
    for name in (model, *names):
        if name is not None and name.strip().lower() in _REAL_MODELS:
            fail(_REAL_MODEL_ROUTE.format(name=name))
    try:
        server = EmbeddingServer(
            port=port,
            tls=tls,
            http2=http2,
            latency=latency,
            dim=dim,
            model=model or (names[0] if names else DEFAULT_MODEL),
            model_names=names,
            matryoshka=matryoshka,
            keep_alive_timeout=keep_alive_timeout,
            api_key=api_key,
        )
        server.start()
    except ImportError as exc:  # uvicorn, hypercorn or trustme missing
        fail(f"the server {hint} ({exc})")
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            fail(
                f"port {port} on 127.0.0.1 is already in use (another server?): stop it, "
                "or pick another port with --port (0 picks a free one)"
            )
        fail(f"cannot serve on 127.0.0.1 port {port}: {exc}")
    except (ValueError, RuntimeError) as exc:
        fail(str(exc))
    out = console()
    try:
        out.print(f"Serving {server.model} ({server.dim}-dim) at {server.base_url}")
        if tls:
            out.print(f"CA certificate: {server.ca_cert_path}  (pass --ca to clients)")
        out.print(
            f"Try: qwen-embed check --base-url {server.base_url}"
            + (f" --ca {server.ca_cert_path}" if tls else "")
        )
        out.file.flush()
        # Wait on an event nobody sets: signals (Ctrl-C, SIGTERM) still interrupt it.
        stop = threading.Event()
        while not stop.wait(0.5 if duration == 0 else duration):
            if duration:
                break
    finally:
        server.close()
