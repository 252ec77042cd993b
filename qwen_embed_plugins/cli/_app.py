"""The ``qwen-embed`` click group: the commands, and how signals end them.

``check`` and ``embed`` are the library's own. Other distributions add commands through
the entry-point group ``qwen_embed.commands`` (``name = "module:click_command"``): the
tooling (``qwen-embed-tooling``) adds ``bench`` and ``serve``. When it is not installed,
those two names still exist and say how to install it (status 1).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from .._install import install_command as _install_command
from ._check_command import check
from ._embed_command import embed
from ._signals import Terminated, describe, exit_status, terminating_raises

__all__ = ["COMMANDS_GROUP", "TOOLING_COMMANDS", "TOOLING_HINT", "QwenEmbedGroup", "cli"]

COMMANDS_GROUP = "qwen_embed.commands"
"""The entry-point group other distributions add ``qwen-embed`` commands through."""
TOOLING_HINT = _install_command("tooling")
"""The command printed when a command of the tooling is asked for and missing."""
TOOLING_COMMANDS = {
    "bench": "Naive vs pooled vs async vs HTTP/2 vs batched (needs qwen-embed-tooling).",
    "serve": "Run the loopback test server (needs qwen-embed-tooling).",
}
"""The commands ``qwen-embed-tooling`` brings, with the help shown while it is missing."""


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
    (when it starts; the progress going on again shows its end); none while a command
    reports them itself (``_output.warnings_in_report``)."""

    def emit(self, record: logging.LogRecord) -> None:
        from ._output import warnings_reported

        if getattr(record, "qwen_embed_episode", None) == "end" or warnings_reported():
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


def _missing(name: str, short_help: str, reason: str) -> click.Command:
    """A stand-in for tooling command ``name``: says how to install it, exits 1."""

    def run() -> None:
        click.echo(
            f"qwen-embed {name} comes with the tooling package ({reason}):\n    {TOOLING_HINT}",
            err=True,
        )
        raise SystemExit(1)

    return click.Command(
        name,
        callback=run,
        short_help=short_help,
        help=f"{short_help}\n\nInstall it with: {TOOLING_HINT}",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )


def _add_commands(group: click.Group) -> None:
    """The library's commands, those of the ``qwen_embed.commands`` entry points, and
    stand-ins for the tooling's commands that no entry point provides."""
    from importlib.metadata import entry_points

    for command in (check, embed):
        group.add_command(command)
    for point in entry_points(group=COMMANDS_GROUP):
        if point.name in group.commands:  # the library's own commands are never replaced
            continue
        try:
            loaded = point.load()
        except ImportError as exc:  # installed, but broken (a dependency missing)
            if point.name in TOOLING_COMMANDS:
                group.add_command(_missing(point.name, TOOLING_COMMANDS[point.name], str(exc)))
            continue
        if isinstance(loaded, click.Command):
            group.add_command(loaded, point.name)
    for name, short_help in TOOLING_COMMANDS.items():
        if name not in group.commands:
            group.add_command(_missing(name, short_help, "qwen-embed-tooling is not installed"))


_add_commands(cli)
