"""The one module that chooses the HTTP library.

openai 2.x is built on ``httpx``; openai 3.x on ``httpx2``, an API-identical fork whose
client types are the only ones openai 3.x accepts as ``http_client=``. This module picks
the library that matches the installed openai major version (the same rule as
``langchain_openai/_compat.py``) and re-exports it as ``httpx``. Every other module gets
the HTTP library from here and nowhere else.

The openai major version is read from the installed distribution's metadata, so
importing this module does not import ``openai`` itself (a large import, and only the
SDK path needs it).

Both httpx backends (the sync HTTP/2 client of ``_sync_http``, the async one of
``_async_http``) build their ``Limits`` (``_limits``) and per-request timeouts bounded by
the time left (``_timeout_ext``) here; ``TimeLeft`` bounds each read of the sync HTTP/2
client by the time left (the one reliance on an undocumented httpcore behaviour: the
extension looked up before each read; see its docstring for the bound).
"""

from __future__ import annotations

import re
import time
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._config import PoolKey, Timeouts

__all__ = ["HTTP_LIBRARY", "OPENAI_MAJOR", "httpx"]


def _openai_major() -> int:
    try:
        version = metadata.version("openai")
    except metadata.PackageNotFoundError:
        return 2
    match = re.match(r"\D*(\d+)", version)
    return int(match.group(1)) if match else 2


OPENAI_MAJOR: int = _openai_major()

if TYPE_CHECKING:
    import httpx
elif OPENAI_MAJOR >= 3:
    import httpx2 as httpx
else:
    import httpx

HTTP_LIBRARY: str = httpx.__name__
"""``"httpx"`` or ``"httpx2"``: the library in use, for reports and the benchmark."""


# --------------------------------------------------------------------------- httpx backends


def _limits(key: PoolKey) -> Any:
    return httpx.Limits(
        max_connections=key.limits.max_connections,
        max_keepalive_connections=key.limits.keepalive_connections,
        keepalive_expiry=key.limits.keepalive_expiry,
    )


def _timeout_ext(t: Timeouts, left: float | None) -> dict[str, float | None]:
    """httpx's per-request timeouts, each at most the time left (``left``)."""

    def bounded(value: float | None) -> float | None:
        if left is None:
            return value
        return left if value is None else min(value, left)

    return {
        "connect": bounded(t.connect),
        "read": bounded(t.read),
        "write": bounded(t.write),
        "pool": bounded(t.pool),
    }


class TimeLeft(dict[str, float | None]):
    """httpx's ``timeout`` request extension (``connect``, ``read``, ``write``,
    ``pool``: seconds or ``None``) whose every lookup is at most the time left before
    ``deadline`` (``time.monotonic()``), so that a response trickled byte by byte ends
    at the deadline, not one read timeout after the last byte.

    What it relies on: the ``timeout`` extension is documented by httpcore
    (docs/extensions.md); that httpcore looks it up (``.get``) before each socket read
    and write of an HTTP/2 connection, rather than once per request, is not. No public
    alternative bounds one HTTP/2 stream: a watchdog would have to shut down the shared
    connection (every stream on it), and httpcore's HTTP/2 reads are not reachable
    otherwise. Bounded: ``tests/test_backend_signals.py`` fails if httpcore stops
    looking it up per read (a trickled head must end in ``ReadTimeout``), and the async
    HTTP/2 path does not depend on it (``asyncio.timeout_at``)."""

    def __init__(self, timeouts: dict[str, float | None], deadline: float) -> None:
        super().__init__(timeouts)
        self.deadline = deadline

    def get(self, key: str, default: float | None = None) -> float | None:  # type: ignore[override]
        value = super().get(key, default)
        left = max(self.deadline - time.monotonic(), 0.001)
        return left if value is None else min(value, left)

    def __getitem__(self, key: str) -> float | None:
        if not super().__contains__(key):
            raise KeyError(key)
        return self.get(key)
