"""The ``qwen-embed`` click group: the commands, and how signals end them."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from ._signals import Terminated, describe, exit_status, terminating_raises
from .bench import bench
from .check import check
from .embed import embed
from .serve import serve

__all__ = ["QwenEmbedGroup", "cli"]


class QwenEmbedGroup(click.Group):
    """A click group whose commands end on a signal with one line on stderr and the
    conventional status (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP) instead of
    click's ``Aborted!`` with status 1; SIGTERM and SIGHUP unwind like Ctrl-C."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            with terminating_raises(), _library_warnings():
                return super().invoke(ctx)
        except (KeyboardInterrupt, Terminated) as exc:
            # on a terminal, end the line the echoed ^C is on
            newline = "\n" if sys.stderr.isatty() else ""
            click.echo(f"{newline}qwen-embed: {describe(exc)}", err=True)
            raise click.exceptions.Exit(exit_status(exc)) from None


class _EpisodeLines(logging.Handler):
    """The library's warnings on stderr, one line each, and one line per outage episode
    (when it starts; the progress going on again shows its end)."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "qwen_embed_episode", None) == "end":
            return
        try:
            click.echo(f"qwen-embed: {record.getMessage()}", err=True)
        except Exception:
            self.handleError(record)


@contextmanager
def _library_warnings() -> Iterator[None]:
    """While a command runs, the library's WARNING lines go through ``_EpisodeLines``
    (otherwise Python's last-resort handler prints every one)."""
    logger = logging.getLogger("qwen_embed_plugins")
    handler = _EpisodeLines(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from importlib import metadata

    try:
        version = metadata.version("qwen-embed-plugins")
    except metadata.PackageNotFoundError:  # running from a source tree
        version = "0.0.0"
    click.echo(f"qwen-embed, version {version}")
    ctx.exit()


@click.group(cls=QwenEmbedGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version and exit.",
)
def cli() -> None:
    """Is my embedding service slow, or is my client?

    Measure (bench), probe (check), use (embed) an OpenAI-compatible
    /v1/embeddings server, or start a local one (serve).
    """


for _command in (bench, check, embed, serve):
    cli.add_command(_command)
