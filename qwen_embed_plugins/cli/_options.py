"""Options shared by the ``qwen-embed`` commands (click only: ``--help`` stays light)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import click

__all__ = [
    "ENV_API_KEY",
    "ENV_BASE_URL",
    "ENV_MODEL",
    "MODELS_DEFAULT",
    "output_options",
    "server_options",
    "shown",
    "sized",
]

# The library's environment variables (qwen_embed_plugins._config reads the same ones);
# spelled out here so that --help does not import the library.
ENV_BASE_URL: Final = "QWEN_EMBED_BASE_URL"
ENV_API_KEY: Final = "QWEN_EMBED_API_KEY"
ENV_MODEL: Final = "QWEN_EMBED_MODEL"

BASE_URL_HELP: Final = "API root, e.g. http://gpu-box:30000/v1"
MODELS_DEFAULT: Final = "default: the first one /models lists"

Decorator = Callable[[Any], Any]


def compose(*decorators: Decorator) -> Decorator:
    """One decorator applying ``decorators`` as if stacked in this order (top first)."""

    def apply(f: Any) -> Any:
        for decorator in reversed(decorators):
            f = decorator(f)
        return f

    return apply


def server_options(
    *, required_url: bool, model_help: str, model_envvar: str | None = None
) -> Decorator:
    """``--base-url``, ``--api-key``, ``--model``, ``--ca``, ``--insecure``.

    ``required_url``: ``--base-url`` is required (default from ``QWEN_EMBED_BASE_URL``);
    otherwise it is optional and leaving it out means the built-in local server.
    """
    if required_url:
        base_url = click.option(
            "--base-url",
            envvar=ENV_BASE_URL,
            required=True,
            metavar="URL",
            help=f"{BASE_URL_HELP} [env {ENV_BASE_URL}].",
        )
    else:
        base_url = click.option(
            "--base-url",
            metavar="URL",
            help=f"{BASE_URL_HELP}. Default: start a local server on loopback with HTTPS "
            "and an emulated round trip.",
        )
    return compose(
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


def output_options() -> Decorator:
    """``--json`` and ``--metrics`` (the commands that report on a server)."""
    return compose(
        click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table."),
        click.option(
            "--metrics",
            "show_metrics",
            is_flag=True,
            help="Also print the client's metrics of the endpoint after the run "
            "(qwen_embed_plugins.stats(); under 'metrics' with --json).",
        ),
    )


def shown(*decls: str, type: Any, default: Any, help: str) -> Decorator:
    """An option whose default ``--help`` shows."""
    return click.option(*decls, type=type, default=default, show_default=True, help=help)


def sized(*decls: str, upper: int | None, default: int, help: str) -> Decorator:
    """An integer option from 1 (to ``upper``) with a shown default."""
    return shown(*decls, type=click.IntRange(1, upper), default=default, help=help)


def verify_setting(ca: str | None, insecure: bool) -> bool | str:
    """The client's ``verify`` from ``--ca`` / ``--insecure``.

    Raises:
        click.UsageError: both were given.
    """
    if ca and insecure:
        raise click.UsageError("--ca and --insecure exclude each other")
    if ca:
        return ca
    return not insecure
