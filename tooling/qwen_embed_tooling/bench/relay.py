"""A TCP relay on 127.0.0.1 that adds an emulated network round trip.

``tc netem`` is not available on the machines this project runs on, so to reproduce a
remote server's round trip on loopback the benchmark puts this relay between client and
server. Every chunk of bytes is held for ``rtt / 2`` in each
direction before it is passed on, so TLS handshakes and requests pay the round trips
they would pay to a remote host. Chunks are released in arrival order and independently
of each other (a pipelined stream is delayed, not serialised).

The kernel's TCP handshake to the relay completes at once on loopback. With
``handshake=True`` (the default) the relay charges it anyway: no client byte reaches the
server before one full ``rtt`` has passed since the connection was accepted, which is
when a remote client could first send (SYN, SYN-ACK, then ACK with data).

Bandwidth, loss and reordering are not emulated. Only latency.

Use::

    with Relay(("127.0.0.1", server_port), rtt=0.040) as relay:
        url = f"https://localhost:{relay.port}/v1"   # 40 ms round trip to the server

``process=True`` runs the relay in a child process (``python -m
qwen_embed_tooling.bench.relay``) so that it never waits for the client's GIL: with
the relay in a thread of the measured process, a client thread holding the GIL for a few
milliseconds would delay the relay's timers and blur the emulated latency. The child
ignores Ctrl-C (its parent stops it) and exits when its parent goes away (its stdin,
a pipe from the parent, reaches end of file), so a killed parent leaves no relay behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
from types import TracebackType

__all__ = ["Relay"]

_CHUNK = 65536


class _RelayCore:
    """The asyncio part: accept, connect upstream, pump both directions with a delay."""

    def __init__(self, upstream: tuple[str, int], *, rtt: float, handshake: bool) -> None:
        self.upstream = upstream
        self.delay = rtt / 2.0
        self.handshake_delay = rtt if handshake else 0.0
        self.connections = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._handle, host, port)
        sock = self._server.sockets[0]
        return int(sock.getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is None:  # cannot happen
            raise RuntimeError("internal error: task is None")
        self._tasks.add(task)
        self.connections += 1
        loop = asyncio.get_running_loop()
        accepted = loop.time()
        swriter: asyncio.StreamWriter | None = None
        try:
            try:
                sreader, swriter = await asyncio.open_connection(*self.upstream)
            except OSError:
                return
            await asyncio.gather(
                self._pipe(creader, swriter, accepted + self.handshake_delay),
                self._pipe(sreader, cwriter, accepted),
            )
        except (OSError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # Only ``stop()`` cancels handlers. Finish normally: Python 3.11's
            # ``start_server`` done-callback calls ``task.exception()``, which raises on a
            # cancelled task and logs a spurious "Exception in callback".
            pass
        finally:
            for writer in (cwriter, swriter):
                if writer is not None:
                    writer.close()
            self._tasks.discard(task)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, not_before: float
    ) -> None:
        """Copy ``reader`` to ``writer``, each chunk due ``delay`` after it arrived."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        delay = self.delay

        async def pump() -> None:
            while True:
                try:
                    data = await reader.read(_CHUNK)
                except OSError:
                    data = b""
                queue.put_nowait((max(loop.time(), not_before) + delay, data))
                if not data:
                    return

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    with contextlib.suppress(OSError, RuntimeError):
                        if writer.can_write_eof():
                            writer.write_eof()
                        else:
                            writer.close()
                    return
                writer.write(data)
                await writer.drain()

        pumping = asyncio.ensure_future(pump())
        try:
            await deliver()
        finally:
            pumping.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await pumping


class Relay:
    """A delaying TCP relay from ``127.0.0.1:port`` to ``upstream``.

    Args:
        upstream: ``(host, port)`` of the real server.
        rtt: the emulated round trip in seconds (each direction holds chunks for
            ``rtt / 2``); 0 relays without delay.
        handshake: also charge one ``rtt`` for the TCP handshake (see the module
            docstring).
        process: run in a child process (no GIL sharing with the caller) instead of a
            daemon thread of this process.
        host, port: where to listen (``port=0``: a free port).

    Attributes:
        port: the listening port (valid after ``start()``).
        connections: connections accepted so far (thread mode only; ``None`` in process
            mode).

    Raises:
        RuntimeError: the relay could not start within 10 s.
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        rtt: float = 0.040,
        handshake: bool = True,
        process: bool = False,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if rtt < 0:
            raise ValueError(f"rtt must be >= 0 seconds, got {rtt!r}")
        self.upstream = upstream
        self.rtt = rtt
        self.handshake = handshake
        self.process = process
        self.host = host
        self.port = port
        self._core: _RelayCore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def connections(self) -> int | None:
        return self._core.connections if self._core is not None else None

    def start(self) -> Relay:
        """Start listening; returns ``self``."""
        if self.process:
            self._start_process()
        else:
            self._start_thread()
        return self

    def _start_process(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "qwen_embed_tooling.bench.relay",
            "--upstream",
            f"{self.upstream[0]}:{self.upstream[1]}",
            "--rtt-ms",
            repr(self.rtt * 1000.0),
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        if not self.handshake:
            cmd.append("--no-handshake")
        cmd.append("--watch-stdin")
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # noqa: S603
        self._proc = proc
        if proc.stdout is None:  # cannot happen
            raise RuntimeError("internal error: proc.stdout is None")
        line = proc.stdout.readline().decode().split()
        if len(line) != 2 or line[0] != "LISTENING":
            self.close()
            raise RuntimeError("the relay process did not start")
        self.port = int(line[1])

    def _start_thread(self) -> None:
        ready = threading.Event()
        failure: list[BaseException] = []
        loop = asyncio.new_event_loop()
        core = _RelayCore(self.upstream, rtt=self.rtt, handshake=self.handshake)

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                self.port = loop.run_until_complete(core.start(self.host, self.port))
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(core.stop())
            loop.close()

        self._core, self._loop = core, loop
        self._thread = threading.Thread(target=run, name="qwen-embed-relay", daemon=True)
        self._thread.start()
        if not ready.wait(10.0) or failure:
            raise RuntimeError(f"the relay did not start: {failure[0] if failure else 'timeout'}")

    def close(self) -> None:
        """Stop the relay and drop its connections."""
        if self._proc is not None:
            proc, self._proc = self._proc, None
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            proc.terminate()
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if self._loop is not None and self._thread is not None:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)
            thread.join(10.0)

    def __enter__(self) -> Relay:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qwen_embed_tooling.bench.relay")
    parser.add_argument("--upstream", required=True, help="host:port of the server")
    parser.add_argument("--rtt-ms", type=float, default=40.0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--no-handshake", action="store_true")
    parser.add_argument(
        "--watch-stdin",
        action="store_true",
        help="run for a parent: ignore Ctrl-C, exit when stdin reaches end of file",
    )
    args = parser.parse_args(argv)
    if args.watch_stdin:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

        def watch() -> None:
            while sys.stdin.buffer.read(4096):
                pass
            os._exit(0)  # the parent is gone (or closed the pipe): stop at once

        threading.Thread(target=watch, name="qwen-embed-relay-parent", daemon=True).start()
    host, _, port = args.upstream.rpartition(":")
    core = _RelayCore((host, int(port)), rtt=args.rtt_ms / 1000.0, handshake=not args.no_handshake)

    async def serve() -> None:
        listening = await core.start(args.host, args.port)
        sys.stdout.write(f"LISTENING {listening}\n")
        sys.stdout.flush()
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    _main()
