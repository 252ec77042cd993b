"""The ``qwen-embed`` command line: ``check`` and ``embed`` (and ``bench``, ``serve``).

A thin front end over the client and the probes of ``check`` (``_check``, ``_probe``):
each command is a module-level click command in its own private module
(``_check_command``, ``_embed_command``), grouped in ``_app``; rich renders tables and
progress (``_output``). It needs the optional ``cli`` extra (``click`` and ``rich``);
without it, ``qwen-embed`` prints the install command and exits with status 1.
``bench`` and ``serve`` come with the tooling distribution (``qwen-embed-tooling``),
found through the entry-point group ``qwen_embed.commands``; without it they print how
to install it (status 1).

Start-up stays light: importing this package imports only the standard library, and
the command modules import only click at module level, so ``qwen-embed --help`` loads
neither numpy, nor the HTTP library, nor rich, nor the client: command bodies import
what they use.

Exit status: 0 on success; 1 when the server cannot be used, a ``check`` probe failed
or a job failed; 2 for usage errors (and unsafe requests, such as OUTPUT being INPUT);
128 + the signal number when interrupted: 130 for Ctrl-C (SIGINT), 143 for SIGTERM,
129 for SIGHUP, with one line on stderr and no traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import click

__all__ = ["get_command", "main"]

_SIGNAL_EXITS = frozenset({129, 130, 143})


def get_command() -> click.Group:
    """The ``click`` group of ``qwen-embed`` (for tests and for embedding it).

    Raises:
        ImportError: click is not installed.
    """
    from ._app import cli

    return cli


def _missing_extra() -> str | None:
    import importlib.util

    for name in ("click", "rich"):
        try:
            found = importlib.util.find_spec(name) is not None
        except ValueError:  # sys.modules[name] is None: blocked on purpose
            found = False
        if not found:
            return name
    return None


def _leave(code: int) -> None:
    """Exit at once after a signal: flush what was printed and skip the interpreter's
    shutdown, which would wait for worker threads still blocked on the network."""
    import contextlib
    import os

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``qwen-embed`` console script.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Raises:
        SystemExit: always, with the exit status (1 when click or rich is missing).
            After a signal (status 129, 130 or 143) the process ends at once instead.
    """
    try:
        missing = _missing_extra()
        if missing is not None:
            from .._install import install_command as _install_command

            sys.stderr.write(
                f"qwen-embed needs the 'cli' extra ({missing} is not installed):\n"
                f"    {_install_command('cli')}\n"
            )
            raise SystemExit(1)
        get_command().main(args=list(argv) if argv is not None else None, prog_name="qwen-embed")
    except KeyboardInterrupt:  # before click runs (importing it) or after it returned
        sys.stderr.write(
            ("\n" if sys.stderr.isatty() else "") + "qwen-embed: interrupted (Ctrl-C)\n"
        )
        if argv is None:
            _leave(130)
        raise SystemExit(130) from None
    except SystemExit as exc:
        if exc.code in _SIGNAL_EXITS and argv is None:
            _leave(int(exc.code))
        raise
