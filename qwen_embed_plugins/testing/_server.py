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
    QUEUE_FULL_MESSAGE,
    _check_dims,
    _integer,
    _number,
    _Settings,
    expected_embeddings,
)
from ._dialects import DIALECTS
from ._faults import SOAK_FAULTS, Fault, FaultSpec, _as_fault
from ._runner import _ChildProcess, _kill_child, _ThreadServer, _TLSFiles
from ._state import _listen, _State


class EmbeddingServer:
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
                self._tls_files = _TLSFiles.create(self._workdir())
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
            self._tls_files = _TLSFiles.create(self._workdir())
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
    def _command(self, name: str, args: Mapping[str, Any] | None = None) -> Any:
        if self._child is not None:
            return self._child.call("state", {"name": name, "args": dict(args or {})})
        if self._process:
            raise RuntimeError("the server process is not running: call start() first")
        return self._state.command(name, args or {})

    def stats(self) -> dict[str, Any]:
        """A snapshot of the counters since the last `reset_counters`.

        Keys: ``connections_opened`` (TCP connections accepted), ``connections_active``
        (open now), ``requests`` (``POST /v1/embeddings`` received, retries and failures
        included), ``texts`` (texts answered with vectors, status 200), ``in_flight`` and
        ``max_in_flight`` (embedding requests being answered: now, and at the peak),
        ``responses`` (outcome -> count: the status code as text, or ``"close"`` /
        ``"reset"``), ``faults_applied`` (kind -> count), ``faults_pending``,
        ``random_fault_rate``.

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

    # ---- faults ------------------------------------------------------------------------
    def inject(self, kind: str, *, count: int = 1, **params: Any) -> None:
        """Apply the fault ``kind`` to the next ``count`` embedding requests.

        See the module docstring and `Fault` for kinds and ``params``. Scripted faults
        run before random ones (`set_random_faults`).

        Raises:
            ValueError: unknown kind, bad count, or a parameter out of range.
            TypeError: a parameter the kind does not take.
        """
        _integer("count", count, minimum=1)
        fault = Fault.make(kind, **params)
        self._command("inject", {"fault": fault.to_dict(), "count": count})

    def inject_status(
        self,
        status: int,
        *,
        count: int = 1,
        message: str | None = None,
        retry_after: float | str | None = None,
        retry_after_ms: float | None = None,
    ) -> None:
        """Answer the next ``count`` embedding requests with ``status`` and SGLang's error
        body; ``retry_after`` (seconds or an HTTP date) and ``retry_after_ms`` set those
        headers."""
        self.inject(
            "status",
            count=count,
            status=status,
            message=message,
            retry_after=retry_after,
            retry_after_ms=retry_after_ms,
        )

    def inject_rate_limit(
        self,
        *,
        count: int = 1,
        retry_after: float | str | None = None,
        retry_after_ms: float | None = None,
    ) -> None:
        """429 Too Many Requests for the next ``count`` embedding requests."""
        self.inject_status(429, count=count, retry_after=retry_after, retry_after_ms=retry_after_ms)

    def inject_overloaded(self, *, count: int = 1, retry_after: float | str | None = None) -> None:
        """SGLang's overload answer, 503 "The request queue is full.", for the next
        ``count`` embedding requests."""
        self.inject_status(503, count=count, message=QUEUE_FULL_MESSAGE, retry_after=retry_after)

    def set_random_faults(
        self, rate: float, kinds: Sequence[FaultSpec] = SOAK_FAULTS, *, seed: int = 0
    ) -> None:
        """Give each embedding request (with no scripted fault pending) probability
        ``rate`` of one fault drawn uniformly from ``kinds``.

        The draws come from ``random.Random(seed)`` in arrival order, so a run with the
        same requests in the same order meets the same faults. ``kinds`` items are fault
        kinds, ``(kind, params)`` pairs or `Fault` objects; the default is `SOAK_FAULTS`.
        ``rate=0`` switches random faults off.

        Raises:
            ValueError: ``rate`` outside 0..1, empty ``kinds``, or a bad fault.
        """
        if not 0.0 <= _number("rate", rate) <= 1.0:
            raise ValueError(f"rate must be in 0..1, got {rate!r}")
        faults = [_as_fault(spec) for spec in kinds]
        if rate > 0.0 and not faults:
            raise ValueError("kinds must name at least one fault")
        self._command(
            "random_faults",
            {"rate": float(rate), "kinds": [f.to_dict() for f in faults], "seed": seed},
        )

    def clear_faults(self) -> None:
        """Drop pending scripted faults and switch random faults off."""
        self._command("clear_faults")

    def close_connections(self, *, idle_only: bool = False) -> int:
        """Close open client connections now (FIN, no answer), as a server sweeping idle
        keep-alive connections does; with ``idle_only`` spare those with a request in
        flight. Returns how many connections were closed."""
        return int(self._command("close_connections", {"idle_only": idle_only}))

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
            for name in ("tls", "http2", "matryoshka")
            if getattr(self._settings, name)
        )
        auth = ", api_key=***" if self._settings.api_key is not None else ""
        return (
            f"EmbeddingServer({where}, {mode}, model={self.model!r}, dim={self.dim}{flags}{auth})"
        )
