"""Options shared by the ``qwen-embed`` commands (click only: ``--help`` stays light)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import click

from .._settings import DEFAULT, DEFAULT_MODEL, SETTING

__all__ = [
    "DEFAULT",
    "DEFAULT_MODEL",
    "ENV_API_KEY",
    "ENV_BASE_URL",
    "ENV_MODEL",
    "MODELS_DEFAULT",
    "output_options",
    "server_options",
    "setting_option",
    "shown",
    "sized",
]

# The library's environment variables, from the settings' declaration (standard library
# only: --help does not import the library).
ENV_BASE_URL: Final = str(SETTING["base_url"].env)
ENV_API_KEY: Final = str(SETTING["api_key"].env)
ENV_MODEL: Final = str(SETTING["model"].env)

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


def setting_option(name: str, *, help: str, env: bool = True, **attrs: Any) -> Decorator:
    """The option of declared setting ``name`` (``_settings.SETTINGS``): its flag, and
    its environment variable when ``env`` (named at the end of ``help``, the command's
    wording); ``attrs`` go to ``click.option`` (type, default, ...).

    Raises:
        ValueError: the setting has no flag.
    """
    declared = SETTING[name]
    if declared.cli is None:
        raise ValueError(f"setting {name!r} has no CLI flag (_settings.SETTINGS)")
    envvar = declared.env if env else None
    shown_env = f" [env {envvar}]" if envvar else ""
    text = f"{help.removesuffix('.')}{shown_env}."
    return click.option(declared.cli, name, envvar=envvar, help=text, **attrs)


def server_options(*, required_url: bool, model_help: str, model_env: bool = False) -> Decorator:
    """``--base-url``, ``--api-key``, ``--model``, ``--ca``, ``--insecure``.

    ``required_url``: ``--base-url`` is required (default from ``QWEN_EMBED_BASE_URL``);
    otherwise it is optional and leaving it out means the built-in local server.
    ``model_env``: ``--model`` defaults to ``QWEN_EMBED_MODEL``.
    """
    if required_url:
        base_url = setting_option("base_url", required=True, metavar="URL", help=BASE_URL_HELP)
    else:
        base_url = setting_option(
            "base_url",
            env=False,
            metavar="URL",
            help=f"{BASE_URL_HELP}. Default: start a local server on loopback with HTTPS "
            "and an emulated round trip.",
        )
    return compose(
        base_url,
        setting_option("api_key", metavar="KEY", help="Bearer key."),
        setting_option("model", env=model_env, help=model_help),
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
