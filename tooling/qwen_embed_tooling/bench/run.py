"""``run_bench``: the ways a program can call an embedding server, side by side.

Run in one process and one run, each mode is measured: latency percentiles,
requests/s, texts/s, TCP connections actually opened, client CPU, errors, and the
ratio to the naive client. Modes (``results.MODES``):

``naive``
    a new ``openai.OpenAI`` per request (the measurement that started the project,
    docs/benchmarks.md: one TCP + TLS connection per request), from ``concurrency``
    threads;
``pooled_threads``
    one shared ``EmbeddingClient`` (pooled, keep-alive) called from ``concurrency``
    threads, one text per request (``embed_query``);
``pooled_async``
    ``AsyncEmbeddingClient.embed_query`` from ``concurrency`` tasks on one loop;
``pooled_async_http2``
    the same over HTTP/2 (ALPN ``h2`` over TLS, prior-knowledge h2c otherwise), run
    only when the server offers it;
``pooled_batched``
    ``EmbeddingClient.embed_documents`` from ``concurrency`` threads, ``batch_size``
    texts per call (one request each).

Every mode sends ``requests`` HTTP requests. Connections are counted, not estimated:
the pooled modes from the pool's connect events (``pool_stats()``), the naive mode
from a trace hook on each per-request HTTP client; with the built-in local server the
server's own accept counter is reported alongside.

``local_target(...)`` starts the loopback ``EmbeddingServer`` in a child process, with
HTTPS (a test CA) and a relay that emulates a network round trip (``relay.Relay``), so
a first run on a fresh machine shows what connection reuse saves remotely.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import platform
import signal
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from qwen_embed_plugins import (
    DEFAULT_MODEL,
    DEFAULT_QUERY_TASK,
    AsyncEmbeddingClient,
    EmbeddingClient,
    EmbeddingConfig,
    Limits,
    close_all,
    format_query,
    pool_stats,
)
from qwen_embed_plugins._corpus import corpus
from qwen_embed_plugins.cli._probe import discover_models, probe_http2

from .results import MODE_LABELS, MODES, BenchResult, ModeResult

__all__ = ["BenchProgress", "Target", "local_target", "run_bench"]


@dataclass(frozen=True)
class Target:
    """An endpoint to benchmark or check.

    Attributes:
        base_url: the API root (``.../v1``).
        verify: TLS verification: ``True``, ``False`` or a CA bundle path.
        api_key: bearer token or ``None``.
        model: the model name to send (``None``: discover from ``/models``).
        local: the built-in loopback server (with relay) is behind ``base_url``.
        rtt_ms: the emulated round trip in ms (local target), ``None`` if unknown.
        server: the ``EmbeddingServer`` (local target), for its connection counter.
    """

    base_url: str
    verify: bool | str = True
    api_key: str | None = None
    model: str | None = None
    local: bool = False
    rtt_ms: float | None = None
    server: Any = field(default=None, repr=False, compare=False)


@contextlib.contextmanager
def _children_ignore_ctrl_c() -> Iterator[None]:
    """Block SIGINT while helper processes are spawned, so they inherit it blocked.

    A terminal's Ctrl-C goes to every process of the foreground group: the server and
    relay children would each die with a traceback of their own. Started with SIGINT
    blocked (the mask survives ``exec``), they never see it; this process handles
    Ctrl-C (a SIGINT arriving meanwhile is delivered when the block ends) and stops
    them. No-op where ``pthread_sigmask`` does not exist.
    """
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - not POSIX
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def local_target(
    *,
    rtt_ms: float = 40.0,
    tls: bool = True,
    http2: bool = True,
    dim: int = 1024,
    process: bool = True,
    handshake: bool = True,
) -> Iterator[Target]:
    """Start the loopback ``EmbeddingServer`` (and a delaying relay) for a benchmark.

    Args:
        rtt_ms: emulated network round trip in milliseconds (0: no relay).
        tls: serve HTTPS with a trustme test CA; the target's ``verify`` is that CA.
        http2: offer HTTP/2 (ALPN ``h2``) besides HTTP/1.1.
        dim: vector size in dimensions.
        process: run the server (and relay) in child processes, so they never share
            the client's GIL and the client's CPU time is its own.
        handshake: the relay also charges one round trip for the TCP handshake.

    Yields:
        a ``Target`` whose ``base_url`` goes through the relay.

    Raises:
        ImportError: a server library of the tooling (uvicorn, hypercorn, trustme) is missing.
    """
    from ..testing import EmbeddingServer
    from .relay import Relay

    with contextlib.ExitStack() as stack:
        with _children_ignore_ctrl_c():
            srv = stack.enter_context(
                EmbeddingServer(tls=tls, http2=http2, process=process, dim=dim)
            )
        base = urlsplit(srv.base_url)
        verify: bool | str = srv.ca_cert_path if tls else True
        if rtt_ms <= 0:
            yield Target(srv.base_url, verify=verify, local=True, rtt_ms=0.0, server=srv)
            return
        host = base.hostname or "127.0.0.1"
        with _children_ignore_ctrl_c():
            relay = stack.enter_context(
                Relay(
                    (host, int(base.port or 0)),
                    rtt=rtt_ms / 1000.0,
                    process=process,
                    handshake=handshake,
                )
            )
        url = urlunsplit((base.scheme, f"{host}:{relay.port}", base.path, "", ""))
        yield Target(url, verify=verify, local=True, rtt_ms=rtt_ms, server=srv)


# --------------------------------------------------------------------------- drivers


class BenchProgress(Protocol):
    """Receives progress from ``run_bench`` (called from worker threads)."""

    def begin(self, mode: str, description: str, total: int) -> None:
        """A mode starts; ``total`` requests will be sent."""

    def advance(self, mode: str, n: int = 1) -> None:
        """``n`` more requests of ``mode`` finished (successfully or not)."""

    def end(self, mode: str) -> None:
        """``mode`` finished."""


@dataclass
class _Run:
    latencies: list[float] = field(default_factory=list)
    requests: int = 0
    texts: int = 0
    errors: int = 0
    error_sample: str | None = None
    seconds: float = 0.0
    cpu: float = 0.0


class _Counter:
    """A thread-safe counter of TCP connections, fed by httpcore trace events."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def trace(self, name: str, info: dict[str, Any]) -> None:
        if name == "connection.connect_tcp.complete":
            with self._lock:
                self.count += 1

    def hook(self, request: Any) -> None:
        """An httpx ``request`` event hook that installs ``trace`` on the request."""
        previous = request.extensions.get("trace")
        if previous is None:
            request.extensions["trace"] = self.trace
        else:

            def both(name: str, info: dict[str, Any]) -> None:
                self.trace(name, info)
                previous(name, info)

            request.extensions["trace"] = both


def _describe_error(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]


def _drive_threads(
    total: int, concurrency: int, call: Callable[[int], int], tick: Callable[[], None]
) -> _Run:
    run = _Run()
    counter = itertools.count()
    lock = threading.Lock()

    def worker() -> None:
        lat: list[float] = []
        texts = errors = 0
        sample: str | None = None
        while True:
            i = next(counter)
            if i >= total:
                break
            started = time.perf_counter()
            try:
                texts += call(i)
                lat.append(time.perf_counter() - started)
            except Exception as exc:
                errors += 1
                sample = sample or _describe_error(exc)
            tick()
        with lock:
            run.latencies.extend(lat)
            run.texts += texts
            run.errors += errors
            run.error_sample = run.error_sample or sample

    threads = [
        threading.Thread(target=worker, name=f"qwen-embed-bench-{k}", daemon=True)
        for k in range(max(1, min(concurrency, total)))
    ]
    cpu0, t0 = time.process_time(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run.seconds = time.perf_counter() - t0
    run.cpu = time.process_time() - cpu0
    run.requests = total
    return run


def _drive_tasks(
    total: int,
    concurrency: int,
    make_call: Callable[[], Callable[[int], Any]],
    tick: Callable[[], None],
) -> _Run:
    """Run ``call(i)`` for i < total from ``concurrency`` tasks inside ``asyncio.run``.

    ``make_call`` runs inside the loop (so clients bind to it); ``call(i)`` returns an
    awaitable of the number of texts embedded.
    """
    run = _Run()

    async def main() -> None:
        call = make_call()
        counter = itertools.count()

        async def worker() -> None:
            while True:
                i = next(counter)
                if i >= total:
                    return
                started = time.perf_counter()
                try:
                    n = await call(i)
                    run.texts += n
                    run.latencies.append(time.perf_counter() - started)
                except Exception as exc:
                    run.errors += 1
                    run.error_sample = run.error_sample or _describe_error(exc)
                tick()

        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, total)))))

    cpu0, t0 = time.process_time(), time.perf_counter()
    asyncio.run(main())
    run.seconds = time.perf_counter() - t0
    run.cpu = time.process_time() - cpu0
    run.requests = total
    return run


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.asarray(values) * 1000.0, q))


def _mode_result(
    mode: str,
    run: _Run,
    connections: int | None,
    server_connections: int | None,
    http_version: str | None,
) -> ModeResult:
    secs = max(run.seconds, 1e-9)
    ok_requests = run.requests - run.errors
    return ModeResult(
        mode=mode,
        label=MODE_LABELS[mode],
        requests=run.requests,
        texts=run.texts,
        errors=run.errors,
        seconds=round(run.seconds, 4),
        requests_per_s=round(ok_requests / secs, 3),
        texts_per_s=round(run.texts / secs, 3),
        p50_ms=_round(_percentile(run.latencies, 50)),
        p95_ms=_round(_percentile(run.latencies, 95)),
        p99_ms=_round(_percentile(run.latencies, 99)),
        mean_ms=_round(float(np.mean(run.latencies)) * 1000.0 if run.latencies else None),
        connections_opened=connections,
        connections_server=server_connections,
        cpu_ms_per_request=round(run.cpu * 1000.0 / max(run.requests, 1), 3),
        http_version=http_version,
        error_sample=run.error_sample,
    )


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def _with_ratios(modes: list[ModeResult]) -> list[ModeResult]:
    base = next((m for m in modes if m.mode == "naive" and m.skipped is None), None)
    if base is None or base.texts_per_s <= 0:
        return modes
    out = []
    for m in modes:
        ratio = None if m.skipped else round(m.texts_per_s / base.texts_per_s, 2)
        out.append(ModeResult(**{**m.to_dict(), "ratio_vs_naive": ratio}))
    return out


# --------------------------------------------------------------------------- bench


class _NullProgress:
    def begin(self, mode: str, description: str, total: int) -> None:
        pass

    def advance(self, mode: str, n: int = 1) -> None:
        pass

    def end(self, mode: str) -> None:
        pass


def _server_count(target: Target) -> int | None:
    value = getattr(target.server, "connections_opened", None)
    return int(value) if isinstance(value, int) else None


def _pool_count(label: str) -> int:
    """TCP connections the pools of endpoint ``label`` opened so far (``pool_stats()``)."""
    row = pool_stats().get(label)
    return int(row["connections_opened"]) if row else 0


def run_bench(
    target: Target,
    *,
    requests: int = 200,
    concurrency: int = 16,
    batch_size: int = 32,
    texts: Sequence[str] | None = None,
    texts_source: str | None = None,
    modes: Sequence[str] = MODES,
    pool_max_connections: int = 20,
    progress: BenchProgress | None = None,
    warmup: bool = True,
    naive_trust: Literal["ca", "bundle"] = "ca",
) -> BenchResult:
    """Run the modes against ``target`` one after another and measure each.

    Args:
        target: the endpoint (see ``local_target`` for the built-in one).
        requests: HTTP requests per mode (>= 1).
        concurrency: threads (sync modes) or tasks (async modes) per mode (>= 1).
        batch_size: texts per request in ``pooled_batched`` (>= 1).
        texts: the input texts (default: ``corpus()``); request ``i`` of a one-text mode
            sends text ``i`` (cycling); ``pooled_batched`` sends ``requests * batch_size``
            texts.
        texts_source: a description of ``texts`` for the report.
        modes: which of ``MODES`` to run, in that order.
        pool_max_connections: ``Limits.max_connections`` of the pooled modes.
        progress: a ``BenchProgress`` (called from worker threads).
        warmup: send one untimed request per client kind first (imports, first-use
            costs), then close the pool so every mode starts cold.
        naive_trust: with a private CA (``target.verify`` a path), what the naive
            client's per-request SSL context trusts: ``"ca"`` that CA only (cheap to
            build), ``"bundle"`` certifi's public roots plus the CA (what
            ``openai.OpenAI()`` builds by default, costly in CPU: docs/benchmarks.md).

    Returns:
        a ``BenchResult``; modes that could not run carry ``skipped``.

    Raises:
        ValueError: an argument is out of range or a mode name is unknown.
        QwenEmbedError: the server cannot be reached or refuses the model (found
            while discovering the model or warming up).

    Note:
        The pool is process-wide: this closes it (``close_all()``) between modes.
    """
    if requests < 1 or concurrency < 1 or batch_size < 1:
        raise ValueError("requests, concurrency and batch_size must be >= 1")
    if naive_trust not in ("ca", "bundle"):
        raise ValueError(f"naive_trust must be 'ca' or 'bundle', got {naive_trust!r}")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    sink: BenchProgress = progress or _NullProgress()
    base_url = target.base_url.rstrip("/")
    model = target.model
    if model is None:
        found = discover_models(base_url, verify=target.verify, api_key=target.api_key)
        model = found[0] if found else DEFAULT_MODEL
    pool_texts = list(texts) if texts is not None else corpus(max(requests * batch_size, 1))
    if not pool_texts:
        raise ValueError("no input texts")
    source = texts_source or (
        "pydoc_data.topics passages" if texts is None else f"{len(pool_texts)} given texts"
    )
    queries = [
        format_query(pool_texts[i % len(pool_texts)], DEFAULT_QUERY_TASK)
        for i in range(min(requests, len(pool_texts)))
    ]

    def query(i: int) -> str:
        return pool_texts[i % len(pool_texts)]

    cfg = EmbeddingConfig(
        base_url=base_url,
        api_key=target.api_key,
        model=model,
        verify=target.verify,
        limits=Limits(max_connections=pool_max_connections),
        max_concurrency=max(1, min(concurrency, 64)),
    )
    naive_verify: Callable[[], Any]
    if isinstance(target.verify, str):
        ca = target.verify
        if naive_trust == "ca":
            # What a naive user with a private CA writes, per request (httpx 0.28
            # deprecates verify=<path>): a context holding only that CA.
            def naive_verify() -> Any:
                return ssl.create_default_context(cafile=ca)
        else:
            # The public roots plus the private CA (a corporate bundle / SSL_CERT_FILE):
            # what openai.OpenAI() loads by default, plus the CA.
            def naive_verify() -> Any:
                import certifi

                ctx = ssl.create_default_context(cafile=certifi.where())
                ctx.load_verify_locations(cafile=ca)
                return ctx
    else:
        fixed = target.verify

        def naive_verify() -> Any:  # True: httpx loads certifi's bundle, as OpenAI() does
            return fixed

    import openai  # the naive mode's client; imported only when a benchmark runs

    from qwen_embed_plugins._transport._http import HTTP_LIBRARY

    naive_counter = _Counter()

    def naive_call(text: str) -> int:
        http_client = openai.DefaultHttpxClient(
            verify=naive_verify(), event_hooks={"request": [naive_counter.hook]}
        )
        client = openai.OpenAI(
            base_url=base_url, api_key=target.api_key or "EMPTY", http_client=http_client
        )
        try:
            resp = client.embeddings.create(input=[text], model=model)
            return len(resp.data)
        finally:
            client.close()

    dim: int | None = None
    if warmup:
        first = format_query(query(0), DEFAULT_QUERY_TASK)
        dim = len(EmbeddingClient(cfg).embed_query_array(query(0)))
        if "naive" in modes:
            naive_call(first)

        async def warm_async() -> None:
            await AsyncEmbeddingClient(cfg).embed_query(query(0))

        if any(m.startswith("pooled_async") for m in modes):
            asyncio.run(warm_async())
        close_all()

    def naive_by_index(i: int) -> int:
        return naive_call(queries[i % len(queries)])

    client = EmbeddingClient(cfg)

    def pooled_call(i: int) -> int:
        client.embed_query(query(i))
        return 1

    def async_calls(acfg: EmbeddingConfig) -> Callable[[], Callable[[int], Any]]:
        def make_call() -> Callable[[int], Any]:
            aclient = AsyncEmbeddingClient(acfg)

            async def call(i: int) -> int:
                await aclient.embed_query(query(i))
                return 1

            return call

        return make_call

    bclient = EmbeddingClient(cfg.replace(batch_size=batch_size))
    n_texts = len(pool_texts)

    def batch_call(i: int) -> int:
        chunk = [pool_texts[(i * batch_size + k) % n_texts] for k in range(batch_size)]
        return len(bclient.embed_documents(chunk))

    results: list[ModeResult] = []
    http2_version: str | None = None
    if "pooled_async_http2" in modes:
        http2_version = probe_http2(base_url, verify=target.verify, api_key=target.api_key)
    version = "HTTP/1.1"

    for mode in modes:
        if mode == "pooled_async_http2" and http2_version != "HTTP/2":
            results.append(
                ModeResult(
                    mode=mode,
                    label=MODE_LABELS[mode],
                    skipped="the server does not offer HTTP/2"
                    + (" (no ALPN h2)" if base_url.startswith("https") else " (no h2c)"),
                )
            )
            continue
        close_all()
        server0 = _server_count(target)
        pool0 = _pool_count(cfg.endpoint)
        sink.begin(mode, MODE_LABELS[mode], requests)

        def tick(mode: str = mode) -> None:
            sink.advance(mode, 1)

        if mode == "naive":
            naive0 = naive_counter.count
            run = _drive_threads(requests, concurrency, naive_by_index, tick)
            connections = naive_counter.count - naive0
        elif mode == "pooled_threads":
            run = _drive_threads(requests, concurrency, pooled_call, tick)
        elif mode == "pooled_async":
            run = _drive_tasks(requests, concurrency, async_calls(cfg), tick)
        elif mode == "pooled_async_http2":
            run = _drive_tasks(requests, concurrency, async_calls(cfg.replace(http2=True)), tick)
        else:  # pooled_batched
            run = _drive_threads(requests, concurrency, batch_call, tick)
        if mode != "naive":
            close_all()
            connections = _pool_count(cfg.endpoint) - pool0
        server1 = _server_count(target)
        sink.end(mode)
        results.append(
            _mode_result(
                mode,
                run,
                connections,
                None if server0 is None or server1 is None else server1 - server0,
                http2_version if mode == "pooled_async_http2" else version,
            )
        )

    return BenchResult(
        base_url=cfg.endpoint,
        local_server=target.local,
        tls=base_url.startswith("https://"),
        rtt_ms=target.rtt_ms,
        requests=requests,
        concurrency=concurrency,
        batch_size=batch_size,
        pool_max_connections=pool_max_connections,
        naive_trust=naive_trust if isinstance(target.verify, str) else "default",
        model=model,
        dim=dim,
        texts_source=source,
        http_library=HTTP_LIBRARY,
        openai_version=str(openai.__version__),
        python=platform.python_version(),
        modes=_with_ratios(results),
    )
