"""Plumbing shared by `LoopbackProxy` and `HostileServer`: an asyncio server on its own
loop and thread, bound to 127.0.0.1, with counters a test can wait on."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Final

from ._common import _BACKLOG, LOOPBACK

_STOP_GRACE: Final = 2.0  # seconds handlers get to finish when their server stops

_Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class _Counters:
    """Thread-safe counters and per-key tallies, with a condition to wait on."""

    def __init__(self, names: tuple[str, ...], tallies: tuple[str, ...]) -> None:
        self._names = names
        self._tallies = tallies
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.values: dict[str, int] = {}
        self.maps: dict[str, dict[str, int]] = {}
        self.reset()

    def reset(self) -> None:
        with self.lock:
            active = self.values.get("connections_active", 0)
            self.values = dict.fromkeys(self._names, 0)
            self.values["connections_active"] = active  # a gauge, not a counter
            self.maps = {name: {} for name in self._tallies}
            self.changed.notify_all()

    def add(self, name: str, n: int = 1, *, key: str | None = None) -> None:
        with self.lock:
            if key is None:
                self.values[name] = self.values.get(name, 0) + n
            else:
                tally = self.maps.setdefault(name, {})
                tally[key] = tally.get(key, 0) + n
            self.changed.notify_all()

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {**self.values, **{k: dict(v) for k, v in self.maps.items()}}

    def wait_for(self, name: str, n: int, timeout: float, *, at_most: bool = False) -> int:
        """Block until counter ``name`` is >= ``n`` (``at_most``: <= ``n``).

        Raises:
            ValueError: unknown counter.
            TimeoutError: not reached within ``timeout`` seconds.
        """
        if name not in self.values:
            raise ValueError(f"cannot wait on {name!r}; one of {', '.join(sorted(self.values))}")
        with self.changed:
            reached = self.changed.wait_for(
                lambda: self.values[name] <= n if at_most else self.values[name] >= n, timeout
            )
            if not reached:
                raise TimeoutError(
                    f"{name} is {self.values[name]}, not {'<=' if at_most else '>='} {n}, "
                    f"after {timeout:g} s"
                )
            return self.values[name]


class _LoopServer:
    """``asyncio.start_server`` on ``host`` (default 127.0.0.1):``port`` in a thread of
    its own.

    Each accepted connection runs ``handler``; `stop` closes the listener, gives the
    handlers ``_STOP_GRACE`` seconds, cancels what is left and joins the thread.
    """

    def __init__(
        self,
        name: str,
        handler: _Handler,
        counters: _Counters,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        host: str = LOOPBACK,
    ) -> None:
        self._name = name
        self.host = host
        self._ssl = ssl_context
        self._handler = handler
        self._counters = counters
        self.port = port
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, timeout: float) -> None:
        if self._thread is not None:
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(_BACKLOG)
        except BaseException:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        self._ready.clear()
        self._error = None
        self._thread = threading.Thread(
            target=self._run, args=(sock,), name=f"{self._name}-{self.port}", daemon=True
        )
        self._thread.start()
        started = self._ready.wait(timeout)
        if started and self._error is None:
            return
        stuck = ""
        try:  # the start failure is what to report, not a stop that fails after it
            self.stop(timeout)
        except RuntimeError:
            stuck = " (its thread is still running)"
        error = self._error
        what = f"failed to start: {error!r}" if error else f"did not start within {timeout:g} s"
        raise RuntimeError(f"{self._name} {what}{stuck}") from error

    def stop(self, timeout: float) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(stop.set)
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(f"{self._name} thread did not stop within {timeout:g} s")

    def _run(self, sock: socket.socket) -> None:
        try:
            asyncio.run(self._main(sock))
        except BaseException as exc:  # reported by start()
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self, sock: socket.socket) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._serve, sock=sock, backlog=_BACKLOG, ssl=self._ssl)
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            if self._tasks:
                _, pending = await asyncio.wait(list(self._tasks), timeout=_STOP_GRACE)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self._counters.add("connections_opened")
        self._counters.add("connections_active")
        try:
            await self._handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        except asyncio.CancelledError:
            if not self.stopping() or task is None:
                raise
            # `stop` cancelled this handler after its grace: end quietly. A connection
            # task that ends cancelled is logged with a traceback by asyncio's stream
            # callback (Python 3.11: it calls task.exception() on it).
            task.uncancel()
        finally:
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            except Exception:  # a peer that reads nothing: drop what is left unsent
                writer.transport.abort()
            self._counters.add("connections_active", -1)
            if task is not None:
                self._tasks.discard(task)

    def stopping(self) -> bool:
        """Whether `stop` was asked (handlers' loops check it)."""
        return self._stop is not None and self._stop.is_set()


async def read_head(reader: asyncio.StreamReader, idle: float) -> bytes | None:
    """One HTTP message head (request or status line and headers, ``\\r\\n\\r\\n``
    included), at most the reader's limit (64 KiB); None at a clean end of stream.

    Raises:
        ValueError: the head is longer than the limit.
        TimeoutError: nothing complete within ``idle`` seconds.
    """
    try:
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), idle)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ConnectionError("connection closed inside a message head") from exc
    except asyncio.LimitOverrunError as exc:
        raise ValueError("message head longer than the reader's limit") from exc


def parse_head(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    """The first line and the headers (names lower-cased) of a message head."""
    lines = head.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.append((name.strip().lower(), value.strip()))
    return lines[0], headers


def header(headers: list[tuple[str, str]], name: str) -> str | None:
    """The last value of header ``name`` (lower case), or None."""
    found = None
    for key, value in headers:
        if key == name:
            found = value
    return found
