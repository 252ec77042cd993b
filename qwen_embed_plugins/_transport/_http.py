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
import threading
import time
from collections.abc import Callable
from importlib import metadata
from typing import TYPE_CHECKING, Any

from ..errors import TransportError

if TYPE_CHECKING:
    from .._config import PoolKey, Timeouts

__all__ = ["HTTP_LIBRARY", "OPENAI_MAJOR", "H2Clients", "httpx", "refused"]


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


class H2Clients:
    """The httpx client of an HTTP/2 transport, replaced by a fresh one whenever an
    exchange abandons its HTTP/2 stream (stops reading before the stream's end:
    cancelled, at the deadline, over the size cap).

    Why: httpcore never resets a stream its caller stops reading, and never credits the
    connection's flow-control window with the bytes that still arrive for it (httpcore
    issue #943, closed as "wontfix"; PR #1098, open). Once about 16 MiB (the window
    httpcore grants) arrived for abandoned streams, every stream on that connection
    stalls until its read timeout. No public API resets one stream or closes one pooled
    connection, so the whole client is retired: new exchanges go to a fresh client, and
    the old one is closed once its last exchange ends (its other streams finish first).
    A stream the server refused (``refused``) is closed already: not abandoned.

    Thread-safe (the sync transport's threads); ``build`` makes a client.
    """

    __slots__ = ("_active", "_build", "_lock", "_old", "closed", "current")

    def __init__(self, build: Callable[[], Any]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self.current: Any = None
        self._active: dict[Any, int] = {}  # client -> its exchanges under way
        self._old: set[Any] = set()  # retired, closed when their exchanges end
        self.closed = False

    def take(self) -> Any:
        """The client for a new exchange (built on first use); ``give_back`` it after.
        ``None`` once ``clear`` was called (the transport is closed)."""
        with self._lock:
            if self.closed:
                return None
            client = self.current
            if client is None:
                client = self.current = self._build()
            self._active[client] = self._active.get(client, 0) + 1
            return client

    def give_back(self, client: Any, abandoned: bool) -> Any:
        """End an exchange on ``client``; ``abandoned``: it left its stream unread, so
        ``client`` is retired. Returns a retired client no exchange uses any more (the
        caller closes it), else ``None``."""
        with self._lock:
            left = self._active[client] - 1
            if left:
                self._active[client] = left
            else:
                del self._active[client]
            if abandoned and client is self.current:
                self.current = None
                self._old.add(client)
            if left == 0 and client in self._old:
                self._old.discard(client)
                return client
            return None

    def clear(self) -> list[Any]:
        """Every client held, current and retired (for the transport's close); none
        is held or built afterwards."""
        with self._lock:
            self.closed = True
            clients = [c for c in (self.current, *self._old) if c is not None]
            self.current = None
            self._old.clear()
            return clients


def refused(error: object) -> bool:
    """``error`` is an HTTP/2 stream the server refused (``TransportError.refused``)."""
    return isinstance(error, TransportError) and error.refused
