"""How ``qwen-embed`` ends on a signal: one line on stderr, the conventional status.

Ctrl-C (SIGINT) raises ``KeyboardInterrupt`` (Python's default); SIGTERM and SIGHUP
raise ``Terminated`` while a command runs (``terminating_raises``), so every ``finally``
on the way out runs for them as for Ctrl-C: temporary files are removed, child
processes stopped, resumable state kept. The status is 128 + the signal number: 130
for SIGINT, 143 for SIGTERM, 129 for SIGHUP.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["Terminated", "describe", "exit_status", "terminating_raises"]

_CAUGHT = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived while a command ran (``signum``: which)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def exit_status(exc: BaseException) -> int:
    """128 + the signal number of a ``KeyboardInterrupt`` (SIGINT) or ``Terminated``."""
    if isinstance(exc, Terminated):
        return 128 + exc.signum
    return 128 + int(signal.SIGINT)


def describe(exc: BaseException) -> str:
    """``interrupted (Ctrl-C)``, ``terminated (SIGTERM)``, ``hung up (SIGHUP)``."""
    if isinstance(exc, Terminated):
        name = signal.Signals(exc.signum).name
        return f"{'hung up' if name == 'SIGHUP' else 'terminated'} ({name})"
    return "interrupted (Ctrl-C)"


def _raise(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def terminating_raises() -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise ``Terminated`` in the main thread (the
    previous handlers come back on exit). Outside the main thread: no change."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _raise) for sig in _CAUGHT}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
