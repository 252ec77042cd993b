"""Running a server: on its own event loop in a thread (uvicorn for HTTP/1.1, hypercorn for
HTTP/2), or in a child process driven over its pipes; TLS files from trustme."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, cast

import orjson

from ._app import _EmbeddingApp
from ._common import (
    _BACKLOG,
    _GRACEFUL_SHUTDOWN,
    _MODULE,
    LOOPBACK,
    _install_hint,
    _Receive,
    _Scope,
    _Send,
    _TLSFiles,
)
from ._dialects import DIALECTS
from ._state import _ListenSocket

logger = logging.getLogger(_MODULE)


class _ThreadServer:
    """One run of uvicorn (HTTP/1.1) or hypercorn (HTTP/2) on a private loop and thread."""

    def __init__(self, app: _EmbeddingApp, sock: _ListenSocket, tls: _TLSFiles | None) -> None:
        self._app = app
        self._settings = app.settings
        self._sock = sock
        self._tls = tls
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._stopping = False
        port = sock.getsockname()[1]
        self._thread = threading.Thread(
            target=self._run, name=f"EmbeddingServer-{port}", daemon=True
        )

    def start(self, timeout: float) -> None:
        """Start the thread and wait until the server serves.

        Raises:
            RuntimeError: the server failed to start (chained to the thread's error), or
                did not start within ``timeout`` seconds; never a failure to stop that
                follows either.
        """
        self._thread.start()
        started = self._ready.wait(timeout)
        if started and self._error is None:
            return
        if not started:
            self._stopping = True  # seen by _main when it has not begun yet
            self._signal_stop()
        self._thread.join(timeout)
        stuck = " (its thread is still running)" if self._thread.is_alive() else ""
        if not stuck:
            self._sock.close()
        error = self._error
        what = f"failed to start: {error!r}" if error else f"did not start within {timeout:g} s"
        raise RuntimeError(f"EmbeddingServer {what}{stuck}") from error

    def stop(self, timeout: float) -> None:
        self._signal_stop()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"EmbeddingServer thread did not stop within {timeout:g} s")
        self._sock.close()  # normally closed by the server already
        if self._error is not None:
            logger.error("EmbeddingServer thread failed", exc_info=self._error)

    def _signal_stop(self) -> None:
        loop = self._loop
        if loop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._begin_stop)

    def _begin_stop(self) -> None:
        self._app.request_stop()
        if self._stop_event is not None:
            self._stop_event.set()
        if self._settings.http2 and not self._settings.h2_only and self._tls is not None:
            # hypercorn over TLS waits for each connection's TLS close, which an idle
            # client never answers (asyncio gives up after 30 s): end the idle ones now,
            # the others once requests in flight had their grace
            state = self._app.state
            state.command("close_connections", {"idle_only": True})
            loop = asyncio.get_running_loop()
            loop.call_later(_GRACEFUL_SHUTDOWN, state.command, "close_connections", {})

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start() / stop()
            if self._error is None:  # the first cause (a lifespan failure) wins
                self._error = exc
        finally:
            self._ready.set()

    def _exception_handler(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """The loop's handler: drops a CancelledError once the server is stopping (a
        connection task cancelled at shutdown, which the stream callback of Python 3.11
        logs at ERROR with a traceback), passes everything else on."""
        stopping = self._stop_event is not None and self._stop_event.is_set()
        if stopping and isinstance(context.get("exception"), asyncio.CancelledError):
            return
        loop.default_exception_handler(context)

    async def _main(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._exception_handler)
        self._stop_event = stop_event = asyncio.Event()
        if self._stopping:  # start() gave up before this loop ran
            return
        if self._settings.h2_only:
            from ._h2server import serve_h2  # h2 only for this mode

            await serve_h2(self._app, self._sock, self._tls, self._asgi_ready, stop_event)
        elif self._settings.http2:
            await self._serve_hypercorn(stop_event)
        else:
            await self._serve_uvicorn(stop_event)

    def _asgi_ready(self) -> None:
        """Start-up of a server without ASGI lifespan events (the raw HTTP/2 one)."""
        self._app.begin_run()
        self._ready.set()

    async def _asgi(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] != "lifespan":
            await self._app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    self._app.begin_run()
                except Exception as exc:  # reported by start() as the cause
                    self._error = exc
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
                self._ready.set()
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _serve_uvicorn(self, stop_event: asyncio.Event) -> None:
        try:
            import uvicorn
        except ImportError as exc:
            raise ImportError(_install_hint("uvicorn")) from exc

        class _Server(uvicorn.Server):
            async def main_loop(self) -> None:
                # uvicorn's loop, woken by stop() instead of polling every 0.1 s
                counter = 0
                while not await self.on_tick(counter):
                    counter = (counter + 1) % 864_000
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop_event.wait(), 0.1)
                    if stop_event.is_set():
                        self.should_exit = True

        settings = self._settings
        config = uvicorn.Config(
            self._asgi,
            # h11 whatever is installed: httptools (uvicorn[standard], brought by chromadb)
            # parses and answers differently, and the servers' behaviour is the tests'
            http="h11",
            ws="none",
            lifespan="on",
            interface="asgi3",
            log_config=None,  # leave the host program's logging alone
            access_log=False,
            # uvicorn hands it to loop.call_later, which takes float seconds
            timeout_keep_alive=cast(int, settings.keep_alive_timeout),
            timeout_graceful_shutdown=cast(int, _GRACEFUL_SHUTDOWN),
            server_header=DIALECTS[settings.dialect].uvicorn_server_header,
            backlog=_BACKLOG,
            ssl_certfile=None if self._tls is None else self._tls.chain,
            ssl_keyfile=None if self._tls is None else self._tls.key,
        )
        await _Server(config).serve(sockets=[self._sock])

    async def _serve_hypercorn(self, stop_event: asyncio.Event) -> None:
        try:
            from hypercorn.asyncio import serve
            from hypercorn.config import Config, Sockets
        except ImportError as exc:
            raise ImportError(_install_hint("hypercorn")) from exc
        sock, tls = self._sock, self._tls

        class _Config(Config):
            def create_sockets(self) -> Sockets:
                # serve the counting socket bound by EmbeddingServer
                secure = [cast(socket.socket, sock)] if tls is not None else []
                insecure = [] if tls is not None else [cast(socket.socket, sock)]
                return Sockets(secure_sockets=secure, insecure_sockets=insecure, quic_sockets=[])

        settings = self._settings
        config = _Config()
        config.bind = [f"{LOOPBACK}:{sock.getsockname()[1]}"]
        config.keep_alive_timeout = settings.keep_alive_timeout
        # hypercorn closes HTTP/1.1 connections (Connection: close) and HTTP/2 ones
        # (GOAWAY) after this many requests; its default is 1000
        config.keep_alive_max_requests = settings.max_requests_per_connection or 2**31
        config.graceful_timeout = _GRACEFUL_SHUTDOWN
        config.errorlog = logging.getLogger(f"{_MODULE}.hypercorn")
        config.accesslog = None
        config.alpn_protocols = ["h2", "http/1.1"]
        config.backlog = _BACKLOG
        if tls is not None:
            config.certfile = tls.chain
            config.keyfile = tls.key
        await serve(cast(Any, self._asgi), config, shutdown_trigger=stop_event.wait)


# --------------------------------------------------------------------------------------
# Running a server in a child process
# --------------------------------------------------------------------------------------

_EXCEPTIONS: Final[dict[str, type[Exception]]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "OSError": OSError,
    "TimeoutError": TimeoutError,
    "ImportError": ImportError,
}


class _ChildProcess:
    """A ``python -m qwen_embed_tooling.testing --control`` child, driven over its pipes.

    One JSON line per command on the child's stdin, one JSON line per answer on its
    stdout (the child moves everything else it prints to stderr).
    """

    def __init__(self, spec: Mapping[str, Any], timeout: float) -> None:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the checkout holding the package
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(  # noqa: S603 -- this interpreter, fixed arguments
            [sys.executable, "-m", _MODULE, "--control"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            encoding="utf-8",
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._lock = threading.Lock()
        self._reader = threading.Thread(
            target=self._read, name=f"EmbeddingServer-child-{self._proc.pid}", daemon=True
        )
        self._reader.start()
        try:
            self.port = int(self._exchange(dict(spec), timeout))
        except BaseException:
            self.close(timeout=5.0)
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _read(self) -> None:
        stdout = self._proc.stdout
        if stdout is None:  # cannot happen
            raise RuntimeError("internal error: stdout is None")
        for line in stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _exchange(self, message: Mapping[str, Any], timeout: float) -> Any:
        stdin = self._proc.stdin
        if stdin is None:  # cannot happen
            raise RuntimeError("internal error: stdin is None")
        with self._lock:
            try:
                stdin.write(orjson.dumps(message).decode("utf-8") + "\n")
                stdin.flush()
            except OSError as exc:
                raise RuntimeError(f"EmbeddingServer child process is gone: {exc}") from exc
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"EmbeddingServer child did not answer within {timeout:g} s"
                ) from None
            if line is None:
                self._lines.put(None)
                raise RuntimeError(
                    f"EmbeddingServer child process exited (code {self._proc.poll()})"
                )
        answer = orjson.loads(line)
        if not answer["ok"]:
            raise _EXCEPTIONS.get(answer["type"], RuntimeError)(answer["error"])
        return answer["result"]

    def call(self, cmd: str, args: Mapping[str, Any] | None = None, timeout: float = 30.0) -> Any:
        return self._exchange({"cmd": cmd, "args": dict(args or {})}, timeout)

    def kill(self) -> None:
        """SIGKILL the child (as a crash does) and release its pipes."""
        _kill_child(self._proc)
        self._release(5.0)

    def _release(self, timeout: float) -> None:
        for pipe in (self._proc.stdin,):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()
        self._reader.join(timeout)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def close(self, timeout: float = 10.0) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(Exception):
                self.call("exit", timeout=timeout)
        for pipe in (self._proc.stdin,):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def _kill_child(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
