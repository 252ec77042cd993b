"""`EmbeddingServer`: the public front of the loopback server."""

from __future__ import annotations

import os
import shutil
import ssl
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from ._app import _EmbeddingApp
from ._common import (
    DEFAULT_DIM,
    DEFAULT_MAX_INPUT_CHARS,
    DEFAULT_MODEL,
    LOOPBACK,
    _check_dims,
    _integer,
    _number,
    _Settings,
    _TLSFiles,
    expected_embeddings,
)
from ._controls import _ServerControls
from ._dialects import DIALECTS
from ._models import (
    DynamicBatching,
    GPULike,
    HeavyTail,
    RateLimited,
    ServerModel,
    model_from_dict,
    model_to_dict,
)
from ._runner import _ChildProcess, _kill_child, _ThreadServer
from ._state import _listen, _State


class EmbeddingServer(_ServerControls):
    """A real OpenAI-compatible embedding server on 127.0.0.1 (SGLang's dialect).

    Use it as a context manager (starts on enter, `close` on exit) or call `start` /
    `stop` / `close`. A stopped server keeps its port, counters and faults; `start` binds
    the same port again.

    Args:
        port: TCP port on 127.0.0.1; 0 (default) picks a free one at the first `start`.
        model: model name in answers and ``/v1/models``.
        dim: full vector size, in components (Qwen3-Embedding-0.6B: 1024).
        matryoshka: accept ``dimensions`` (first components, L2-renormalised); when False
            a request with ``dimensions`` gets 400, like SGLang without the matryoshka
            override.
        keep_alive_timeout: seconds an idle keep-alive connection stays open (uvicorn's
            and SGLang's default: 5).
        latency: seconds added to every embedding request before it is answered.
        max_input_chars: longest accepted input, in characters (None: no limit); longer
            ones get 400 naming the input index and the limit.
        max_batch: most texts per request (None: no limit); more get 400.
        max_requests_per_connection: close a connection after this many requests (HTTP/1.1
            ``Connection: close``; HTTP/2 GOAWAY), like llama.cpp's 100. None: never.
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>`` (else 401
            ``{"error": "Unauthorized"}``); ``/health`` does not.
        tls: serve HTTPS with a certificate from a throw-away CA (`ca_cert_path`,
            `ssl_context`).
        http2: serve with hypercorn: HTTP/2 by ALPN over TLS, h2c (prior knowledge or
            ``Upgrade``) on cleartext, HTTP/1.1 otherwise. False: uvicorn, HTTP/1.1 only.
        process: run in a child process instead of a thread of this one (the child
            does not share this process's GIL).
        dialect: the server whose answers to reproduce, a key of `DIALECTS`: ``"sglang"``
            (default), ``"vllm"``, ``"tei"``, ``"infinity"``, ``"ollama"``, ``"llamacpp"``,
            ``"dashscope"``, ``"siliconflow"``. Paths, limits (``max_batch=None`` takes
            the server's: TEI 32, Infinity 2048, DashScope 10, SiliconFlow 64), error
            bodies, status codes and ``dimensions`` / ``encoding_format`` handling follow
            that server; `base_url` is its API root.
        url_prefix: Infinity only: its ``--url-prefix`` (default ``""``: ``/embeddings``
            at the root, as Infinity serves it unless started with ``--url-prefix /v1``).
        received_limit: how many requests' inputs `received` keeps (the newest).
        startup_timeout: seconds to wait for the server to start or stop.
        max_input_tokens: longest accepted text, in tokens (`count_tokens`: ceil(chars /
            4)); longer ones get the dialect's context-length answer for the first of them
            (see `limit_input_tokens`). None (default): no token limit.
        report_usage: include ``usage`` (``prompt_tokens``, ``total_tokens``) in answers
            (default True, as every real server does).
        append_eos: llama.cpp only: whether the server appends ``<|endoftext|>`` to each
            input (a GGUF whose tokenizer adds EOS; default True). With False, a text's
            vector differs from that of ``text + "<|endoftext|>"``; see `LlamaCppDialect`.
        goaway_after: HTTP/2 only: answer the first ``goaway_after`` streams of each
            connection, then refuse later ones (``goaway_mode``). Uses the raw HTTP/2
            server (see ``h2_only``).
        goaway_mode: ``"graceful"`` (default): once the first N streams are answered, send
            GOAWAY with ``last_stream_id`` = the N-th stream while later streams are still
            in flight (they are never answered: a client must resend them on a new
            connection), then close the connection; ``"early"``: send that GOAWAY as soon
            as stream N+1 arrives, while the first N may still be in flight (they are then
            answered, as RFC 9113 allows); ``"refuse"``: reset every stream after the N-th
            with RST_STREAM(REFUSED_STREAM) at once, and GOAWAY + close once the first N
            are answered. Counted in ``faults_applied`` as ``"goaway"`` (GOAWAY frames)
            and ``"refused_stream"`` (streams refused either way).
        h2_only: HTTP/2 only: serve with a raw HTTP/2 server written on ``h2`` instead of
            hypercorn; it speaks only HTTP/2: prior-knowledge h2c on cleartext (an
            HTTP/1.1 request, ``Upgrade: h2c`` included, gets its connection closed,
            counted as ``"h1_refused"``), ALPN ``h2`` over TLS.
        server_model: how a loaded server behaves (for benchmarks): a `GPULike`,
            `SlowStart`, `RateLimited` or `HeavyTail`, or a sequence of them (applied
            together: rate limits first); runs in child-process mode too.
        tls_hostnames: extra DNS names in the TLS certificate (besides 127.0.0.1 and
            localhost), e.g. a name only a `LoopbackProxy` alias resolves.
        model_names: more names the server serves besides ``model`` (like vLLM's
            ``--served-model-name a b``): a request naming any other model gets vLLM's
            404 ``{"object": "error", "message": "The model `x` does not exist.",
            "type": "NotFoundError", "param": null, "code": 404}``, and ``/v1/models``
            lists them all. Empty (default): any model name is answered, as SGLang and a
            one-model Infinity do.

    Raises:
        ValueError: a setting out of range (the message names it).
    """

    def __init__(
        self,
        *,
        port: int = 0,
        model: str = DEFAULT_MODEL,
        dim: int = DEFAULT_DIM,
        matryoshka: bool = False,
        keep_alive_timeout: float = 5.0,
        latency: float = 0.0,
        max_input_chars: int | None = DEFAULT_MAX_INPUT_CHARS,
        max_batch: int | None = None,
        max_requests_per_connection: int | None = None,
        api_key: str | None = None,
        tls: bool = False,
        http2: bool = False,
        process: bool = False,
        dialect: str = "sglang",
        received_limit: int = 1000,
        startup_timeout: float = 30.0,
        url_prefix: str | None = None,
        max_input_tokens: int | None = None,
        report_usage: bool = True,
        append_eos: bool = True,
        goaway_after: int | None = None,
        goaway_mode: str = "graceful",
        h2_only: bool = False,
        server_model: ServerModel | Sequence[ServerModel | Mapping[str, Any]] | None = None,
        tls_hostnames: Sequence[str] = (),
        model_names: Sequence[str] = (),
    ) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        if not isinstance(model, str) or not model:
            raise ValueError("model must be a non-empty str")
        _check_dims(dim, None)
        _number("keep_alive_timeout", keep_alive_timeout, minimum=0.001)
        _number("latency", latency)
        _number("startup_timeout", startup_timeout, minimum=0.001)
        for name, value in (
            ("max_input_chars", max_input_chars),
            ("max_batch", max_batch),
            ("max_requests_per_connection", max_requests_per_connection),
            ("max_input_tokens", max_input_tokens),
            ("goaway_after", goaway_after),
        ):
            if value is not None:
                _integer(name, value, minimum=1)
        _integer("received_limit", received_limit, minimum=0)
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("api_key must be a non-empty str or None")
        if dialect not in DIALECTS:
            raise ValueError(f"unknown dialect {dialect!r}; expected one of {', '.join(DIALECTS)}")
        if url_prefix is not None and (
            not isinstance(url_prefix, str)
            or (url_prefix and (not url_prefix.startswith("/") or url_prefix.endswith("/")))
        ):
            raise ValueError(f"url_prefix must be '' or like '/v1', got {url_prefix!r}")
        if max_requests_per_connection is None:
            max_requests_per_connection = DIALECTS[dialect].default_max_requests_per_connection
        if not append_eos and dialect != "llamacpp":
            raise ValueError("append_eos=False applies to dialect='llamacpp' only")
        if goaway_mode not in ("graceful", "early", "refuse"):
            raise ValueError(f"goaway_mode must be graceful, early or refuse, got {goaway_mode!r}")
        if (goaway_after is not None or h2_only) and not http2:
            raise ValueError("goaway_after and h2_only need http2=True")
        if isinstance(tls_hostnames, str) or not all(
            isinstance(name, str) and name for name in tls_hostnames
        ):
            raise ValueError("tls_hostnames must be a sequence of non-empty str")
        if isinstance(model_names, str) or not all(
            isinstance(name, str) and name for name in model_names
        ):
            raise ValueError("model_names must be a sequence of non-empty str")
        self._settings = _Settings(
            model=model,
            dim=dim,
            matryoshka=bool(matryoshka),
            keep_alive_timeout=float(keep_alive_timeout),
            latency=float(latency),
            max_input_chars=max_input_chars,
            max_batch=max_batch,
            max_requests_per_connection=max_requests_per_connection,
            api_key=api_key,
            tls=bool(tls),
            http2=bool(http2),
            dialect=dialect,
            received_limit=received_limit,
            url_prefix=url_prefix,
            max_input_tokens=max_input_tokens,
            report_usage=bool(report_usage),
            append_eos=bool(append_eos),
            goaway_after=goaway_after,
            goaway_mode=goaway_mode,
            h2_only=bool(h2_only or goaway_after is not None),
            server_model=_models_spec(server_model),
            tls_hostnames=tuple(tls_hostnames),
            model_names=tuple(dict.fromkeys((model, *model_names))) if model_names else (),
        )
        self._port = port
        self._process = bool(process)
        self._timeout = float(startup_timeout)
        self._lock = threading.RLock()
        self._state = _State(received_limit)
        self._app = _EmbeddingApp(self._settings, self._state, server_closes_after_max=bool(http2))
        self._thread: _ThreadServer | None = None
        self._child: _ChildProcess | None = None
        self._tls_files: _TLSFiles | None = None
        self._tmpdir: str | None = None
        self._finalizers: list[weakref.finalize[Any, Any]] = []

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> EmbeddingServer:
        """Start serving (no-op when running) and return ``self``.

        Raises:
            OSError: the port is taken (e.g. after `stop`, by another program).
            RuntimeError: the server did not start within ``startup_timeout`` seconds.
            ImportError: the ``testing`` extra (uvicorn, hypercorn, trustme) is missing.
        """
        with self._lock:
            if self.running:
                return self
            if self._settings.tls and self._tls_files is None:
                self._tls_files = _TLSFiles.create(self._workdir(), self._settings.tls_hostnames)
            if self._process:
                self._start_child()
            else:
                sock = _listen(self._port, self._state)
                self._port = sock.getsockname()[1]
                runner = _ThreadServer(self._app, sock, self._tls_files)
                runner.start(self._timeout)
                self._thread = runner
            return self

    def _start_child(self) -> None:
        if self._child is not None:
            self._child.call("start", timeout=self._timeout)
            return
        spec = {
            "settings": asdict(self._settings),
            "port": self._port,
            "tls": None if self._tls_files is None else asdict(self._tls_files),
        }
        child = _ChildProcess(spec, self._timeout)
        self._child = child
        self._port = child.port
        self._finalizers.append(weakref.finalize(self, _kill_child, child._proc))

    def stop(self) -> None:
        """Stop serving: close the listening socket and every connection.

        Requests in flight get up to 3 s to finish; ``delay`` faults and latency end at
        once (a delayed request's connection is closed without an answer). The port,
        counters and faults are kept for the next `start`. No-op when stopped.

        Raises:
            RuntimeError: the server did not stop within ``startup_timeout`` seconds.
        """
        with self._lock:
            if self._thread is not None:
                runner, self._thread = self._thread, None
                runner.stop(self._timeout)
            elif self._child is not None:
                self._child.call("stop", timeout=self._timeout)

    def restart(self, *, downtime: float = 0.0) -> None:
        """`stop`, wait ``downtime`` seconds (connections are refused meanwhile), `start`
        on the same port."""
        _number("downtime", downtime)
        with self._lock:
            if self._child is not None:
                self._child.call(
                    "restart", {"downtime": downtime}, timeout=self._timeout + downtime
                )
                return
            self.stop()
            time.sleep(downtime)
            self.start()

    def kill(self) -> None:
        """End the server abruptly, as a crash does: with ``process=True`` SIGKILL the
        child process (the kernel resets its connections; its counters, faults and rules
        die with it, and `stats` fails until `start`); in thread mode reset (RST) every
        connection and stop at once. `start` then serves again on the same port (a new
        child process with ``process=True``). No-op when stopped."""
        with self._lock:
            if self._child is not None:
                child, self._child = self._child, None
                child.kill()
            elif self._thread is not None:
                self._state.command("close_connections", {"reset": True})
                runner, self._thread = self._thread, None
                runner.stop(self._timeout)

    def close(self) -> None:
        """Stop, end the child process (``process=True``) and delete the TLS files."""
        with self._lock:
            self.stop()
            if self._child is not None:
                child, self._child = self._child, None
                child.close(self._timeout)
            for finalizer in self._finalizers:
                finalizer()
            self._finalizers.clear()
            self._tmpdir = None
            self._tls_files = None

    def __enter__(self) -> EmbeddingServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _workdir(self) -> str:
        if self._tmpdir is None:
            self._tmpdir = tempfile.mkdtemp(prefix="qwen-embed-testing-")
            self._finalizers.append(
                weakref.finalize(self, shutil.rmtree, self._tmpdir, ignore_errors=True)
            )
        return self._tmpdir

    # ---- addresses -------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """Whether the server is accepting connections."""
        if self._child is not None:
            return bool(self._child.call("running"))
        return self._thread is not None

    @property
    def port(self) -> int:
        """The TCP port on 127.0.0.1 (known after the first `start`).

        Raises:
            RuntimeError: ``port=0`` and the server was never started.
        """
        if self._port == 0:
            raise RuntimeError("the server has no port yet: call start() first")
        return self._port

    @property
    def url(self) -> str:
        """The root URL, e.g. ``http://127.0.0.1:8123`` (``https`` with ``tls=True``)."""
        scheme = "https" if self._settings.tls else "http"
        return f"{scheme}://{LOOPBACK}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI-style base URL: ``url + "/v1"`` (the dialect's API root: Infinity
        ``url`` unless ``url_prefix``, DashScope ``url + "/compatible-mode/v1"``)."""
        return f"{self.url}{self._app.dialect.base_path}"

    @property
    def dialect(self) -> str:
        """The dialect's name (a key of `DIALECTS`)."""
        return self._settings.dialect

    @property
    def ca_cert_path(self) -> str:
        """Path of the PEM file of the CA that signed the server's certificate.

        Raises:
            RuntimeError: the server was not built with ``tls=True``.
        """
        if not self._settings.tls:
            raise RuntimeError("ca_cert_path needs EmbeddingServer(tls=True)")
        if self._tls_files is None:
            self._tls_files = _TLSFiles.create(self._workdir(), self._settings.tls_hostnames)
        return self._tls_files.ca

    def ssl_context(self) -> ssl.SSLContext:
        """A client `ssl.SSLContext` trusting `ca_cert_path`, e.g. ``httpx.Client(verify=...)``
        (httpx deprecates ``verify=<path>``)."""
        return ssl.create_default_context(cafile=self.ca_cert_path)

    @property
    def model(self) -> str:
        """The model name the server reports."""
        return self._settings.model

    @property
    def dim(self) -> int:
        """The full vector size, in components."""
        return self._settings.dim

    @property
    def pid(self) -> int:
        """The process serving requests (the child's with ``process=True``)."""
        return self._child.pid if self._child is not None else os.getpid()

    # ---- counters ----------------------------------------------------------------------
    def _command(
        self, name: str, args: Mapping[str, Any] | None = None, *, timeout: float = 30.0
    ) -> Any:
        if self._child is not None:
            call = {"name": name, "args": dict(args or {})}
            return self._child.call("state", call, timeout=timeout)
        if self._process:
            raise RuntimeError("the server process is not running: call start() first")
        return self._state.command(name, args or {})

    def stats(self) -> dict[str, Any]:
        """A snapshot of the counters since the last `reset_counters`.

        Keys: ``connections_opened`` (TCP connections accepted), ``connections_active``
        (open now), ``requests`` (``POST /v1/embeddings`` received, retries and failures
        included; counted on arrival), ``received_count`` (authorised requests whose
        inputs were read and logged in `received`; not capped by ``received_limit``),
        ``texts`` (texts answered with vectors, status 200), ``in_flight`` and
        ``max_in_flight`` (embedding requests being answered: now, and at the peak),
        ``responses`` (outcome -> count: the status code as text, or ``"close"`` /
        ``"reset"``), ``faults_applied`` (kind -> count: fault kinds, rule kinds, and
        ``"rate_limit"`` / ``"queue_full"`` / ``"heavy_tail"`` from server models,
        ``"goaway"`` / ``"refused_stream"`` / ``"h1_refused"`` from the raw HTTP/2
        server), ``faults_pending``, ``random_fault_rate``, ``rules`` (kinds of the rules
        in force, oldest first).

        Answers are counted before their last byte is sent, so a client that got an
        answer finds it counted; ``in_flight`` and ``connections_active`` drop a moment
        after the client saw the answer or closed its connection.
        """
        return cast(dict[str, Any], self._command("stats"))

    @property
    def connections_opened(self) -> int:
        """TCP connections the server accepted (admin ones included)."""
        return int(self.stats()["connections_opened"])

    @property
    def connections_active(self) -> int:
        """TCP connections open right now."""
        return int(self.stats()["connections_active"])

    @property
    def requests(self) -> int:
        """Embedding requests received (``POST /v1/embeddings``)."""
        return int(self.stats()["requests"])

    @property
    def texts(self) -> int:
        """Texts answered with vectors."""
        return int(self.stats()["texts"])

    @property
    def received(self) -> list[list[Any]]:
        """The ``input`` of each authorised embedding request received, as a list, oldest
        first: rejected and faulted requests included, at most ``received_limit`` (the
        newest); a string input appears as a 1-item list."""
        return cast(list[list[Any]], self._command("received"))

    def reset_counters(self) -> None:
        """Zero the counters and empty `received` (open connections and faults stay)."""
        self._command("reset")

    # ---- helpers ---------------------------------------------------------------------
    def expected_embeddings(
        self, texts: Iterable[str], *, dimensions: int | None = None
    ) -> npt.NDArray[np.float32]:
        """`expected_embeddings` with this server's ``dim``: shape ``(n, dimensions or dim)``."""
        return expected_embeddings(texts, self._settings.dim, dimensions=dimensions)

    def __repr__(self) -> str:
        where = self.url if self._port else "127.0.0.1:<unbound>"
        mode = "process" if self._process else "thread"
        flags = "".join(
            f", {name}=True"
            for name in ("tls", "http2", "h2_only", "matryoshka")
            if getattr(self._settings, name)
        )
        auth = ", api_key=***" if self._settings.api_key is not None else ""
        return (
            f"EmbeddingServer({where}, {mode}, model={self.model!r}, dim={self.dim}{flags}{auth})"
        )


def _models_spec(
    value: ServerModel | Sequence[ServerModel | Mapping[str, Any]] | None,
) -> tuple[dict[str, Any], ...]:
    """The JSON-safe form of ``server_model`` (validated)."""
    if value is None:
        return ()
    items = (
        [value]
        if isinstance(value, GPULike | RateLimited | HeavyTail | DynamicBatching)
        else list(value)
    )
    out = []
    for item in items:
        model = model_from_dict(item) if isinstance(item, Mapping) else item
        if not isinstance(model, GPULike | RateLimited | HeavyTail | DynamicBatching):
            raise ValueError(f"server_model items must be server models, got {item!r}")
        out.append(model_to_dict(model))
    return tuple(out)
