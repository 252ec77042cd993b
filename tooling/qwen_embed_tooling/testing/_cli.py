"""Command line: ``python -m qwen_embed_tooling.testing`` (foreground server) and the
child-process control loop (``--control``)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

import orjson

from ._common import DEFAULT_DIM, DEFAULT_MAX_INPUT_CHARS, DEFAULT_MODEL, _TLSFiles
from ._server import EmbeddingServer


def _control_loop() -> int:
    """Body of ``--control``: serve one EmbeddingServer for a parent over the pipes."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints go to stderr
    sys.stdout = sys.stderr

    def answer(ok: bool, result: Any = None, exc: BaseException | None = None) -> None:
        if ok:
            message: dict[str, Any] = {"ok": True, "result": result}
        else:
            message = {"ok": False, "type": type(exc).__name__, "error": str(exc)}
        out.write(orjson.dumps(message).decode("utf-8") + "\n")
        out.flush()

    line = sys.stdin.readline()
    if not line:
        return 1
    server: EmbeddingServer | None = None
    try:
        spec = orjson.loads(line)
        settings = dict(spec["settings"])
        server = EmbeddingServer(port=int(spec["port"]), process=False, **settings)
        if spec.get("tls"):
            server._tls_files = _TLSFiles(**spec["tls"])
        server.start()
    except Exception as exc:
        answer(False, exc=exc)
        if server is not None:
            server.close()
        return 1
    answer(True, server.port)
    try:
        while line := sys.stdin.readline():
            try:
                request = orjson.loads(line)
                cmd, args = request["cmd"], request.get("args", {})
                if cmd == "exit":
                    answer(True)
                    break
                if cmd == "start":
                    server.start()
                    result: Any = None
                elif cmd == "stop":
                    server.stop()
                    result = None
                elif cmd == "restart":
                    server.restart(downtime=float(args.get("downtime", 0.0)))
                    result = None
                elif cmd == "running":
                    result = server.running
                elif cmd == "state":
                    result = server._state.command(args["name"], args.get("args", {}))
                else:
                    raise ValueError(f"unknown command {cmd!r}")
                answer(True, result)
            except Exception as exc:
                answer(False, exc=exc)
    finally:
        server.close()
        out.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run an `EmbeddingServer` in the foreground until Ctrl-C or SIGTERM.

    ``python -m qwen_embed_tooling.testing --port 30000 [--tls] [--http2] [--latency S]``;
    ``--help`` lists every option. Prints the base URL (and the CA file with ``--tls``).
    Returns the process exit code.
    """
    parser = argparse.ArgumentParser(
        prog="python -m qwen_embed_tooling.testing",
        description="A loopback OpenAI-compatible embedding server (SGLang dialect) "
        "with deterministic vectors, for tests, demos and benchmarks.",
    )
    parser.add_argument(
        "--port", type=int, default=30000, help="port on 127.0.0.1; 0 picks one (default: 30000)"
    )
    parser.add_argument("--tls", action="store_true", help="serve HTTPS with a throw-away CA")
    parser.add_argument(
        "--http2", action="store_true", help="serve HTTP/2 (ALPN, h2c) with hypercorn"
    )
    parser.add_argument(
        "--latency", type=float, default=0.0, help="seconds added per embedding request"
    )
    parser.add_argument(
        "--model",
        default=None,
        help=f"model name (default: the first --model-names, else {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--model-names",
        default="",
        help="comma-separated model names served; others get 404 (default: any name)",
    )
    parser.add_argument("--dim", type=int, default=DEFAULT_DIM, help="vector size (default: 1024)")
    parser.add_argument("--matryoshka", action="store_true", help="accept `dimensions`")
    parser.add_argument("--api-key", default=None, help="require this bearer key on /v1")
    parser.add_argument(
        "--keep-alive-timeout", type=float, default=5.0, help="idle keep-alive seconds (default: 5)"
    )
    parser.add_argument("--max-batch", type=int, default=None, help="most texts per request")
    parser.add_argument(
        "--max-input-chars",
        type=int,
        default=DEFAULT_MAX_INPUT_CHARS,
        help="longest input, in characters",
    )
    parser.add_argument(
        "--max-requests-per-connection",
        type=int,
        default=None,
        help="close connections after N requests",
    )
    parser.add_argument("--control", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.control:
        return _control_loop()
    names = [name.strip() for name in args.model_names.split(",") if name.strip()]
    try:
        server = EmbeddingServer(
            port=args.port,
            model=args.model or (names[0] if names else DEFAULT_MODEL),
            model_names=names,
            dim=args.dim,
            matryoshka=args.matryoshka,
            keep_alive_timeout=args.keep_alive_timeout,
            latency=args.latency,
            max_input_chars=args.max_input_chars,
            max_batch=args.max_batch,
            max_requests_per_connection=args.max_requests_per_connection,
            api_key=args.api_key,
            tls=args.tls,
            http2=args.http2,
        )
        server.start()
    except (ValueError, OSError, ImportError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        print(f"Serving {server.model} ({server.dim}-dim) at {server.base_url}", flush=True)
        if args.tls:
            print(f"CA certificate: {server.ca_cert_path}", flush=True)
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0
