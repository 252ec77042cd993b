"""Benchmark and server-check logic behind ``qwen-embed bench`` and ``qwen-embed check``.

Everything here returns result objects and prints nothing; ``cli.py`` renders them.

- ``run_bench(target, ...)`` runs, side by side in one process and one run, the ways a
  program can call an embedding server, and measures each: latency percentiles,
  requests/s, texts/s, TCP connections actually opened, client CPU, errors, and the
  ratio to the naive client. Modes (``MODES``):

  ``naive``
      a new ``openai.OpenAI`` per request (the seed measurement: 482 ms, 2.1 req/s,
      one TCP + TLS connection per request), from ``concurrency`` threads;
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
- ``local_target(...)`` starts the loopback ``EmbeddingServer`` in a child process, with
  HTTPS (a test CA) and a relay that emulates a network round trip (``_relay.Relay``),
  so a first run on a fresh machine shows what connection reuse saves remotely.
- ``check_server(...)`` probes a server: health, models and vector size, base64,
  ``dimensions`` (MRL), batch limit, HTTP/2, the idle keep-alive timeout it enforces,
  and a latency sample, with advice per finding.
- ``corpus(n)`` / ``iter_texts(path)``: real input (passages of the Python
  documentation that ships with every Python: ``pydoc_data.topics``) or a user file.

Times are reported in milliseconds (``*_ms``), rates per second (``*_per_s``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import math
import platform
import re
import select
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import openai
import orjson

from . import pool
from ._http import HTTP_LIBRARY, httpx
from .client import AsyncEmbeddingClient, EmbeddingClient
from .config import DEFAULT_MODEL, EmbeddingConfig, Limits
from .errors import QwenEmbedError, endpoint_label, error_from_response, parse_batch_limit
from .protocol import encode_request, format_query

__all__ = [
    "BENCH_SCHEMA",
    "CHECK_SCHEMA",
    "MODES",
    "BenchProgress",
    "BenchResult",
    "CheckFinding",
    "CheckReport",
    "ModeResult",
    "Target",
    "check_server",
    "corpus",
    "discover_models",
    "iter_texts",
    "load_texts",
    "local_target",
    "measure_idle_timeout",
    "probe_http2",
    "run_bench",
]

BENCH_SCHEMA = "qwen-embed-bench/1"
"""``schema`` field of ``BenchResult.to_dict()``; bumped if a field changes meaning."""
CHECK_SCHEMA = "qwen-embed-check/1"
"""``schema`` field of ``CheckReport.to_dict()``."""

ModeName = Literal[
    "naive", "pooled_threads", "pooled_async", "pooled_async_http2", "pooled_batched"
]
MODES: tuple[ModeName, ...] = (
    "naive",
    "pooled_threads",
    "pooled_async",
    "pooled_async_http2",
    "pooled_batched",
)
_MODE_LABELS: dict[str, str] = {
    "naive": "(a) naive: new openai.OpenAI per request",
    "pooled_threads": "(b) pooled sync, shared client, threads",
    "pooled_async": "(c) pooled async",
    "pooled_async_http2": "(d) pooled async, HTTP/2",
    "pooled_batched": "(e) pooled + batched embed_documents",
}

# --------------------------------------------------------------------------- input


_WS = re.compile(r"\s+")
_PARAGRAPH = re.compile(r"\n\s*\n")
_SENTENCE = re.compile(r"(?<=[.!?:])\s+(?=[A-Z\"'(])")
_corpus_cache: list[str] | None = None


def _build_corpus() -> list[str]:
    from pydoc_data.topics import topics

    seen: dict[str, None] = {}
    # 1. paragraphs of the Python language reference, as written
    for key in sorted(topics):
        for para in _PARAGRAPH.split(topics[key]):
            text = _WS.sub(" ", para).strip()
            if 40 <= len(text) <= 2000:
                seen.setdefault(text, None)
    # 2. overlapping windows of 2..10 consecutive sentences (how RAG chunkers cut text)
    flat = _WS.sub(" ", "\n\n".join(topics[k] for k in sorted(topics)))
    sentences = [s.strip() for s in _SENTENCE.split(flat) if len(s.strip()) >= 20]
    for width in range(2, 11):
        for start in range(0, len(sentences) - width + 1):
            text = " ".join(sentences[start : start + width])
            if len(text) <= 2000:
                seen.setdefault(text, None)
    return list(seen)


def corpus(n: int | None = None, *, unique: bool = False) -> list[str]:
    """Real English passages from ``pydoc_data.topics`` (ships with every Python).

    First the paragraphs of the language reference (about 1,600, median ~150
    characters), then overlapping windows of 2..10 consecutive sentences, all distinct
    and at most 2,000 characters: about 20,000 distinct texts in all.

    Args:
        n: how many texts (``None``: all of them). Beyond the distinct ones the list
            repeats from the start.
        unique: raise instead of repeating.

    Raises:
        ValueError: ``unique=True`` and fewer than ``n`` distinct texts exist.
    """
    global _corpus_cache
    if _corpus_cache is None:
        _corpus_cache = _build_corpus()
    texts = _corpus_cache
    if n is None:
        return list(texts)
    if n > len(texts):
        if unique:
            raise ValueError(f"the corpus has {len(texts)} distinct texts, {n} asked")
        return [texts[i % len(texts)] for i in range(n)]
    return texts[:n]


def _numbered_lines(fh: Any, path: Path) -> Iterator[tuple[int, str]]:
    """``enumerate(fh)``, with a decoding error reported as ``ValueError`` naming the line."""
    number = 0
    while True:
        try:
            line = fh.readline()
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}:{number + 1}: not UTF-8 text ({exc.reason})") from exc
        if not line:
            return
        yield number, line
        number += 1


def iter_texts(
    path: str | Path, *, on_blank: Callable[[int], None] | None = None
) -> Iterator[tuple[int, str, Any]]:
    """Stream ``(record_number, text, id)`` from a text file, skipping blank records.

    ``.jsonl`` / ``.ndjson`` files hold one JSON object per line with a ``"text"`` field
    (an ``"id"`` field, if present, is passed through; otherwise ``id`` is ``None``);
    any other file holds one text per line. ``record_number`` counts lines from 0.
    ``on_blank(record_number)`` is called for each blank (empty or whitespace-only)
    record skipped.

    Raises:
        ValueError: a JSONL line is not an object with a string ``"text"``, or a line is
            not UTF-8 (the message names the file and line).
        OSError: the file cannot be read.
    """
    path = Path(path)
    jsonl = path.suffix.lower() in (".jsonl", ".ndjson")
    with path.open("r", encoding="utf-8") as fh:
        for number, line in _numbered_lines(fh, path):
            if not line.strip():
                if on_blank is not None:
                    on_blank(number)
                continue
            if jsonl:
                try:
                    obj = orjson.loads(line)
                except orjson.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number + 1}: not valid JSON: {exc}") from exc
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    raise ValueError(
                        f'{path}:{number + 1}: expected an object with a "text" string'
                    )
                text = obj["text"]
                if not text.strip():
                    if on_blank is not None:
                        on_blank(number)
                    continue
                yield number, text, obj.get("id")
            else:
                yield number, line.rstrip("\r\n"), None


def load_texts(path: str | Path) -> list[str]:
    """All non-blank texts of ``path`` (see ``iter_texts``), in order."""
    return [text for _, text, _ in iter_texts(path)]


# --------------------------------------------------------------------------- targets


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
        ImportError: the ``testing`` extra (uvicorn, hypercorn, trustme) is missing.
    """
    from . import testing
    from ._relay import Relay

    with testing.EmbeddingServer(tls=tls, http2=http2, process=process, dim=dim) as srv:
        base = urlsplit(srv.base_url)
        verify: bool | str = srv.ca_cert_path if tls else True
        if rtt_ms <= 0:
            yield Target(srv.base_url, verify=verify, local=True, rtt_ms=0.0, server=srv)
            return
        host = base.hostname or "127.0.0.1"
        with Relay(
            (host, int(base.port or 0)),
            rtt=rtt_ms / 1000.0,
            process=process,
            handshake=handshake,
        ) as relay:
            url = urlunsplit((base.scheme, f"{host}:{relay.port}", base.path, "", ""))
            yield Target(url, verify=verify, local=True, rtt_ms=rtt_ms, server=srv)


def _ssl_context(verify: bool | str) -> ssl.SSLContext:
    if verify is False:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    if isinstance(verify, str):
        return ssl.create_default_context(cafile=verify)
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "User-Agent": "qwen-embed-check"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def discover_models(
    base_url: str,
    *,
    verify: bool | str = True,
    api_key: str | None = None,
    timeout: float = 10.0,
) -> list[str]:
    """Model ids listed by ``GET {base_url}/models`` (empty if the server has none).

    Raises:
        QwenEmbedError (``TransportError`` or ``HTTPStatusError``): the request failed.
    """
    with httpx.Client(verify=_ssl_context(verify), timeout=timeout) as client:
        try:
            resp = client.get(f"{base_url.rstrip('/')}/models", headers=_headers(api_key))
        except httpx.HTTPError as exc:
            raise _transport_error(base_url, exc) from exc
    if resp.status_code >= 400:
        raise error_from_response(
            resp.status_code, resp.content, url=base_url, headers=resp.headers, secret=api_key
        )
    try:
        data = orjson.loads(resp.content).get("data", [])
        return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
    except (orjson.JSONDecodeError, AttributeError, TypeError):
        return []


def _transport_error(base_url: str, exc: Exception) -> QwenEmbedError:
    from .errors import ConnectError, TransportError

    label = endpoint_label(base_url)
    if isinstance(exc, httpx.ConnectError):
        return ConnectError(f"cannot connect to {label}: {exc}", url=label)
    return TransportError(f"request to {label} failed: {type(exc).__name__}: {exc}", url=label)


def probe_http2(
    base_url: str,
    *,
    verify: bool | str = True,
    api_key: str | None = None,
    timeout: float = 10.0,
) -> str | None:
    """The HTTP version a client asking for HTTP/2 gets: ``"HTTP/2"`` or ``"HTTP/1.1"``.

    Over ``https://`` h2 is offered by ALPN (the server picks). Over ``http://`` a
    prior-knowledge h2c request is tried; ``None`` means it failed (no h2c).
    """
    cleartext = base_url.startswith("http://")
    kwargs: dict[str, Any] = {"http2": True, "timeout": timeout}
    if cleartext:
        kwargs["http1"] = False
    else:
        kwargs["verify"] = _ssl_context(verify)
    try:
        with httpx.Client(**kwargs) as client:
            resp = client.get(f"{base_url.rstrip('/')}/models", headers=_headers(api_key))
            return str(resp.http_version)
    except httpx.HTTPError:
        return None


# --------------------------------------------------------------------------- results


class BenchProgress(Protocol):
    """Receives progress from ``run_bench`` (called from worker threads)."""

    def begin(self, mode: str, description: str, total: int) -> None:
        """A mode starts; ``total`` requests will be sent."""

    def advance(self, mode: str, n: int = 1) -> None:
        """``n`` more requests of ``mode`` finished (successfully or not)."""

    def end(self, mode: str) -> None:
        """``mode`` finished."""


@dataclass(frozen=True)
class ModeResult:
    """One mode's measurements (field names are stable: ``--json`` prints them).

    Attributes:
        mode: one of ``MODES``.
        label: a human description.
        skipped: why the mode did not run, else ``None`` (then numbers are zero/None).
        requests: HTTP requests made (calls; each carries ``texts / requests`` texts).
        texts: texts embedded successfully.
        errors: calls that raised.
        seconds: wall time of the mode (s).
        requests_per_s, texts_per_s: successful requests / texts per wall second.
        p50_ms, p95_ms, p99_ms, mean_ms: per-call latency (ms; successful calls,
            including client set-up for the naive mode).
        connections_opened: TCP connections the client opened (counted from connect
            events of the HTTP library).
        connections_server: connections the local server accepted during the mode
            (``None`` for a remote server).
        cpu_ms_per_request: CPU time of the client process per request (ms; all
            threads; the local server and relay run in other processes).
        http_version: the protocol the mode used.
        ratio_vs_naive: ``texts_per_s`` divided by the naive mode's (per text; the
            same as per request for the one-text modes).
        error_sample: the first error message, if any.
    """

    mode: str
    label: str
    skipped: str | None = None
    requests: int = 0
    texts: int = 0
    errors: int = 0
    seconds: float = 0.0
    requests_per_s: float = 0.0
    texts_per_s: float = 0.0
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    mean_ms: float | None = None
    connections_opened: int | None = None
    connections_server: int | None = None
    cpu_ms_per_request: float | None = None
    http_version: str | None = None
    ratio_vs_naive: float | None = None
    error_sample: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BenchResult:
    """A whole ``run_bench`` run (see ``to_dict`` for the JSON shape)."""

    base_url: str
    local_server: bool
    tls: bool
    rtt_ms: float | None
    requests: int
    concurrency: int
    batch_size: int
    pool_max_connections: int
    naive_trust: str
    model: str
    dim: int | None
    texts_source: str
    http_library: str
    openai_version: str
    python: str
    modes: list[ModeResult]

    def mode(self, name: str) -> ModeResult:
        """The result of mode ``name``.

        Raises:
            KeyError: no such mode in this run.
        """
        for m in self.modes:
            if m.mode == name:
                return m
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: ``schema`` plus every field; ``modes`` a list of dicts."""
        out: dict[str, Any] = {"schema": BENCH_SCHEMA}
        out.update(asdict(self))
        return out


# --------------------------------------------------------------------------- drivers


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
        label=_MODE_LABELS[mode],
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


def _pool_count(base_url: str) -> int:
    row = pool.pool_stats().get(endpoint_label(base_url))
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
            ``openai.OpenAI()`` builds by default, ~15-60 ms of CPU each).

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
        format_query(pool_texts[i % len(pool_texts)], _query_task())
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
        first = format_query(query(0), _query_task())
        dim = len(EmbeddingClient(cfg).embed_query_array(query(0)))
        if "naive" in modes:
            naive_call(first)

        async def warm_async() -> None:
            await AsyncEmbeddingClient(cfg).embed_query(query(0))

        if any(m.startswith("pooled_async") for m in modes):
            asyncio.run(warm_async())
        pool.close_all()

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
                    label=_MODE_LABELS[mode],
                    skipped="the server does not offer HTTP/2"
                    + (" (no ALPN h2)" if base_url.startswith("https") else " (no h2c)"),
                )
            )
            continue
        pool.close_all()
        server0 = _server_count(target)
        pool0 = _pool_count(base_url)
        sink.begin(mode, _MODE_LABELS[mode], requests)

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
            pool.close_all()
            connections = _pool_count(base_url) - pool0
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
        base_url=endpoint_label(base_url),
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


def _query_task() -> str:
    from .config import DEFAULT_QUERY_TASK

    return DEFAULT_QUERY_TASK


# --------------------------------------------------------------------------- check


@dataclass(frozen=True)
class CheckFinding:
    """One probe's outcome.

    Attributes:
        name: ``health``, ``models``, ``embedding``, ``base64``, ``dimensions``,
            ``batch_limit``, ``http2``, ``keepalive``, ``latency``.
        status: ``"ok"``, ``"warn"`` (works, but needs a setting), ``"fail"`` or
            ``"info"``.
        summary: one line for people.
        value: the measured value (JSON-ready), e.g. the dimension or timeout seconds.
        advice: what to do about it, or ``None``.
    """

    name: str
    status: Literal["ok", "warn", "fail", "info"]
    summary: str
    value: Any = None
    advice: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CheckReport:
    """``check_server``'s findings (``to_dict()`` is the ``--json`` shape)."""

    base_url: str
    model: str | None
    findings: list[CheckFinding]

    @property
    def ok(self) -> bool:
        """No finding failed."""
        return all(f.status != "fail" for f in self.findings)

    def finding(self, name: str) -> CheckFinding:
        """The finding called ``name``.

        Raises:
            KeyError: no such finding.
        """
        for f in self.findings:
            if f.name == name:
                return f
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": CHECK_SCHEMA,
            "base_url": self.base_url,
            "model": self.model,
            "ok": self.ok,
            "findings": [f.to_dict() for f in self.findings],
        }


_MATRYOSHKA_ADVICE = (
    "vLLM: start it with --hf-overrides '{\"is_matryoshka\": true}' to serve MRL "
    "`dimensions`; meanwhile the client slices and renormalises client-side"
)


def _root_url(base_url: str) -> str:
    parts = urlsplit(base_url)
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def measure_idle_timeout(
    base_url: str,
    *,
    verify: bool | str = True,
    api_key: str | None = None,
    max_idle: float = 6.5,
) -> float | None:
    """Seconds after which the server closes an idle keep-alive connection.

    Opens one HTTP/1.1 connection, makes one request (``GET /models``), then waits up
    to ``max_idle`` seconds for the server to close it, and returns the idle time at
    which it did (``None``: still open after ``max_idle``).

    Raises:
        OSError: the connection could not be made.
    """
    import http.client

    parts = urlsplit(base_url)
    host = parts.hostname or "127.0.0.1"
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(
            host, parts.port or 443, context=_ssl_context(verify), timeout=10.0
        )
    else:
        conn = http.client.HTTPConnection(host, parts.port or 80, timeout=10.0)
    try:
        headers = _headers(api_key)
        headers.pop("Content-Type")
        conn.request("GET", f"{parts.path.rstrip('/')}/models", headers=headers)
        resp = conn.getresponse()
        resp.read()
        if resp.will_close:
            return 0.0
        sock = conn.sock
        assert sock is not None
        idle_from = time.monotonic()
        deadline = idle_from + max_idle
        sock.setblocking(False)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            readable, _, _ = select.select([sock], [], [], left)
            if not readable:
                continue
            try:
                data = sock.recv(1)
            except ssl.SSLWantReadError:  # a TLS record with no data (session ticket)
                continue
            except (ssl.SSLError, OSError):
                data = b""
            if not data:
                return time.monotonic() - idle_from
            # unsolicited bytes on an idle HTTP/1.1 connection: treat as closing
            return time.monotonic() - idle_from
    finally:
        conn.close()


def check_server(
    base_url: str,
    *,
    api_key: str | None = None,
    verify: bool | str = True,
    model: str | None = None,
    max_idle: float = 6.5,
    batch_probe_max: int = 512,
    samples: int = 10,
    step: Callable[[str], None] | None = None,
) -> CheckReport:
    """Probe what an OpenAI-compatible embedding server is and supports.

    Args:
        base_url: the API root (``.../v1``).
        api_key: bearer token, or ``None``.
        verify: TLS verification (``True``, ``False`` or a CA bundle path).
        model: the model to probe (default: the first one ``/models`` lists).
        max_idle: longest idle wait when measuring the keep-alive timeout (s).
        batch_probe_max: largest batch the batch-limit probe sends (texts).
        samples: warm single-text requests in the latency sample.
        step: called with each probe's name before it runs (for a spinner).

    Returns:
        a ``CheckReport``. Probes never raise: a failure becomes a ``"fail"`` finding,
        and probes that depend on a failed one are left out.
    """
    base_url = base_url.rstrip("/")
    say = step or (lambda name: None)
    findings: list[CheckFinding] = []
    ctx = _ssl_context(verify)
    headers = _headers(api_key)
    url = f"{base_url}/embeddings"

    with httpx.Client(verify=ctx, timeout=30.0) as http:
        # ---- health
        say("health")
        try:
            resp = http.get(f"{_root_url(base_url)}/health", headers=headers)
            if resp.status_code < 400:
                findings.append(
                    CheckFinding(
                        "health", "ok", f"GET /health: {resp.status_code}", resp.status_code
                    )
                )
            else:
                findings.append(
                    CheckFinding(
                        "health",
                        "info",
                        f"GET /health: {resp.status_code} (no health endpoint)",
                        resp.status_code,
                    )
                )
        except httpx.HTTPError as exc:
            findings.append(
                CheckFinding(
                    "health",
                    "fail",
                    f"cannot reach {endpoint_label(base_url)}: {exc}",
                    None,
                    "check the URL, the port, and that the server is running"
                    + (
                        "; for a private CA pass --ca /path/to/ca.pem"
                        if "CERTIFICATE" in str(exc)
                        else ""
                    ),
                )
            )
            return CheckReport(endpoint_label(base_url), model, findings)

        # ---- models
        say("models")
        models: list[str] = []
        try:
            models = discover_models(base_url, verify=verify, api_key=api_key)
            findings.append(
                CheckFinding(
                    "models",
                    "ok" if models else "info",
                    f"models: {', '.join(models)}" if models else "GET /models lists no model",
                    models,
                )
            )
        except QwenEmbedError as exc:
            findings.append(CheckFinding("models", "info", f"GET /models failed: {exc}", []))
        if model is None:
            model = models[0] if models else DEFAULT_MODEL

        def post(texts: list[str], fmt: str = "float", dimensions: int | None = None) -> Any:
            body = encode_request(
                texts, model=model or "", encoding_format=fmt, dimensions=dimensions
            )
            return http.post(url, content=body, headers=headers)

        # ---- embedding
        say("embedding")
        try:
            resp = post(["What is a Python list comprehension?"])
        except httpx.HTTPError as exc:
            findings.append(CheckFinding("embedding", "fail", f"POST /embeddings: {exc}"))
            return CheckReport(endpoint_label(base_url), model, findings)
        if resp.status_code >= 400:
            err = error_from_response(resp.status_code, resp.content, url=url, secret=api_key)
            findings.append(
                CheckFinding(
                    "embedding",
                    "fail",
                    str(err),
                    resp.status_code,
                    "check --model (see the models finding) and --api-key",
                )
            )
            return CheckReport(endpoint_label(base_url), model, findings)
        float_vec = _first_vector(resp.content)
        if float_vec is None:
            findings.append(
                CheckFinding("embedding", "fail", "the response holds no float embedding")
            )
            return CheckReport(endpoint_label(base_url), model, findings)
        dim = int(float_vec.size)
        norm = float(np.linalg.norm(float_vec))
        from .config import known_model_dims

        expected = known_model_dims(model)
        emb_status: Literal["ok", "warn"] = "ok"
        advice = None
        if expected is not None and expected != dim:
            emb_status = "warn"
            advice = (
                f"{model} has {expected} dimensions; the server returns {dim}: is the "
                "model name right, or does the server truncate?"
            )
        findings.append(
            CheckFinding(
                "embedding",
                emb_status,
                f"{model}: {dim} dimensions, norm {norm:.4f}",
                {"dim": dim, "norm": round(norm, 6)},
                advice,
            )
        )

        # ---- base64
        say("base64")
        try:
            resp = post(["What is a Python list comprehension?"], fmt="base64")
            if resp.status_code >= 400:
                findings.append(
                    CheckFinding(
                        "base64",
                        "warn",
                        f"encoding_format=base64 refused ({resp.status_code})",
                        False,
                        "nothing to do: encoding_format='auto' falls back to float once "
                        "(responses are ~4x larger)",
                    )
                )
            else:
                item = orjson.loads(resp.content)["data"][0]["embedding"]
                if isinstance(item, str):
                    b64 = np.frombuffer(base64.b64decode(item), dtype="<f4")
                    same = b64.shape == float_vec.shape and bool(
                        np.allclose(b64, float_vec, atol=1e-5)
                    )
                    findings.append(
                        CheckFinding(
                            "base64",
                            "ok" if same else "warn",
                            "base64 supported"
                            + ("" if same else " but differs from the float response"),
                            True,
                            None if same else "use encoding_format='float'",
                        )
                    )
                else:
                    findings.append(
                        CheckFinding(
                            "base64",
                            "info",
                            "base64 ignored: floats returned",
                            False,
                            "nothing to do: the client decodes either form",
                        )
                    )
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
            findings.append(CheckFinding("base64", "warn", f"base64 probe failed: {exc}", None))

        # ---- dimensions
        say("dimensions")
        want = 256 if dim > 256 else max(1, dim // 2)
        try:
            resp = post(["What is a Python list comprehension?"], dimensions=want)
            if resp.status_code >= 400:
                findings.append(
                    CheckFinding(
                        "dimensions",
                        "warn",
                        f"dimensions={want} refused ({resp.status_code})",
                        False,
                        _MATRYOSHKA_ADVICE,
                    )
                )
            else:
                vec = _first_vector(resp.content)
                got = 0 if vec is None else int(vec.size)
                if vec is not None and got == want:
                    n = float(np.linalg.norm(vec))
                    unit = abs(n - 1.0) < 1e-3
                    findings.append(
                        CheckFinding(
                            "dimensions",
                            "ok" if unit else "warn",
                            f"dimensions={want} served"
                            + ("" if unit else f", not renormalised (norm {n:.3f})"),
                            True,
                            None
                            if unit
                            else "nothing to do: the client renormalises "
                            "(normalize=True, the default)",
                        )
                    )
                else:
                    findings.append(
                        CheckFinding(
                            "dimensions",
                            "warn",
                            f"dimensions={want} ignored (got {got} dimensions)",
                            False,
                            _MATRYOSHKA_ADVICE,
                        )
                    )
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
            findings.append(
                CheckFinding("dimensions", "warn", f"dimensions probe failed: {exc}", None)
            )

        # ---- batch limit
        say("batch_limit")
        findings.append(_probe_batch_limit(post, batch_probe_max, url, api_key))

    # ---- HTTP/2
    say("http2")
    version = probe_http2(base_url, verify=verify, api_key=api_key)
    if version == "HTTP/2":
        how = "ALPN h2" if base_url.startswith("https") else "h2c prior knowledge"
        findings.append(
            CheckFinding(
                "http2",
                "ok",
                f"HTTP/2 offered ({how})",
                True,
                "http2=True multiplexes every request over one connection (fewer handshakes)",
            )
        )
    else:
        findings.append(
            CheckFinding(
                "http2",
                "info",
                "HTTP/1.1 only",
                False,
                "keep http2=False (the default); the pool keeps up to "
                "Limits.max_connections HTTP/1.1 connections alive",
            )
        )

    # ---- keep-alive
    say("keepalive")
    try:
        idle = measure_idle_timeout(base_url, verify=verify, api_key=api_key, max_idle=max_idle)
        expiry = Limits().keepalive_expiry
        if idle is None:
            findings.append(
                CheckFinding(
                    "keepalive",
                    "ok",
                    f"idle connections kept for more than {max_idle:.1f} s",
                    None,
                    f"keepalive_expiry={expiry:g} s (the default) is safe",
                )
            )
        elif idle <= 0.05:
            findings.append(
                CheckFinding(
                    "keepalive",
                    "warn",
                    "the server closes the connection after each response",
                    0.0,
                    "no keep-alive: every request pays TCP (and TLS) set-up; enable "
                    "keep-alive on the server or its proxy",
                )
            )
        else:
            safe = idle > expiry + 0.25
            suggestion = max(0.5, math.floor((idle - 0.5) * 2) / 2)
            findings.append(
                CheckFinding(
                    "keepalive",
                    "ok" if safe else "warn",
                    f"the server closes idle connections after {idle:.2f} s",
                    round(idle, 3),
                    f"keepalive_expiry={expiry:g} s (the default) is below it: safe"
                    if safe
                    else f"set Limits(keepalive_expiry={suggestion:g}) (below the server's "
                    f"{idle:.1f} s), or reused sockets fail with 'Server disconnected'",
                )
            )
    except OSError as exc:
        findings.append(CheckFinding("keepalive", "warn", f"keep-alive probe failed: {exc}"))

    # ---- latency sample (the pooled client, as an application would use it)
    say("latency")
    findings.append(_latency_sample(base_url, api_key, verify, model, samples))
    return CheckReport(endpoint_label(base_url), model, findings)


def _first_vector(body: bytes) -> np.ndarray[Any, np.dtype[np.float32]] | None:
    try:
        item = orjson.loads(body)["data"][0]["embedding"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return None
    if isinstance(item, list):
        return np.asarray(item, dtype=np.float32)
    return None


def _probe_batch_limit(
    post: Callable[..., Any], bound: int, url: str, api_key: str | None
) -> CheckFinding:
    sizes = [s for s in (8, 32, 64, 128, 256, 512, 1024, 2048) if s <= bound] or [bound]
    passages = corpus(max(sizes))
    largest_ok = 1
    for size in sizes:
        try:
            resp = post([p[:200] for p in passages[:size]])
        except httpx.HTTPError as exc:
            return CheckFinding(
                "batch_limit",
                "warn",
                f"batch of {size} texts failed: {exc}",
                largest_ok,
                f"use batch_size <= {largest_ok}",
            )
        if resp.status_code >= 400:
            err = error_from_response(resp.status_code, resp.content, url=url, secret=api_key)
            limit = parse_batch_limit(err.message)
            if limit is not None:
                return CheckFinding(
                    "batch_limit",
                    "warn" if limit < 32 else "ok",
                    f"the server accepts at most {limit} texts per request",
                    limit,
                    f"set batch_size={limit} (the client also learns it from the error)"
                    if limit < 32
                    else "batch_size=32 (the default) fits",
                )
            return CheckFinding(
                "batch_limit",
                "warn",
                f"{size} texts refused ({resp.status_code}: {err.message[:120]}); "
                f"{largest_ok} accepted",
                largest_ok,
                f"use batch_size <= {largest_ok}",
            )
        largest_ok = size
    return CheckFinding(
        "batch_limit",
        "ok",
        f"{largest_ok} texts per request accepted (probe bound)",
        largest_ok,
        "batch_size=32 (the default) fits",
    )


def _latency_sample(
    base_url: str, api_key: str | None, verify: bool | str, model: str, samples: int
) -> CheckFinding:
    cfg = EmbeddingConfig(base_url=base_url, api_key=api_key, verify=verify, model=model)
    client = EmbeddingClient(cfg)
    pool.close_all()
    times: list[float] = []
    try:
        for i in range(max(2, samples + 1)):
            started = time.perf_counter()
            client.embed_query_array(corpus(samples + 1)[i])
            times.append((time.perf_counter() - started) * 1000.0)
    except QwenEmbedError as exc:
        return CheckFinding("latency", "fail", f"embedding through the client failed: {exc}")
    finally:
        pool.close_all()  # leave no idle connection behind
    cold, warm = times[0], times[1:]
    p50 = float(np.median(warm))
    value = {
        "cold_ms": round(cold, 2),
        "p50_ms": round(p50, 2),
        "min_ms": round(min(warm), 2),
        "max_ms": round(max(warm), 2),
    }
    advice = None
    if cold > p50 * 1.5 and cold - p50 > 5:
        advice = (
            f"a new connection costs {cold - p50:.0f} ms more than a reused one: "
            "share one client per process (this library does)"
        )
    return CheckFinding(
        "latency",
        "ok",
        f"single-text query: first {cold:.1f} ms (new connection), then p50 {p50:.1f} ms "
        f"(min {min(warm):.1f}, max {max(warm):.1f}) over {len(warm)} requests",
        value,
        advice,
    )
