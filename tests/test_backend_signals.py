"""What the library reads from its backends to classify an exchange, checked against the
backends as installed, on real loopback servers: so that a backend upgrade that stops
giving a signal fails here, loudly, instead of silently weakening a guarantee.

- a refused HTTP/2 stream (RST_STREAM ``REFUSED_STREAM``, GOAWAY) is recognised by h2's
  public event types carried by httpcore's ``RemoteProtocolError``, never by its text;
- TLS hints come from the ``ssl`` error's documented attributes (``SSLCertVerificationError``,
  ``SSLError.reason``) found in the exception chain, on every path;
- the sync HTTP/2 deadline (``_http.TimeLeft``) needs httpcore to look the ``timeout``
  request extension up before each read (not once per request).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins._transport._exceptions import translate
from qwen_embed_plugins._transport._http import TimeLeft, httpx
from qwen_embed_plugins.errors import ErrorContext
from qwen_embed_tooling.testing import EmbeddingServer, HostileServer

GUARD = 45.0  # seconds: the hostile server's own bound; only a hang reaches it
BODY = b'{"input": ["x"], "model": "m"}'
HEADERS = {"content-type": "application/json"}


def _ctx(url: str) -> ErrorContext:
    return ErrorContext(url=url, connect=5.0, read=5.0, write=5.0)


# --------------------------------------------------------------------------- refused streams


ROUNDS = 5


def _four_concurrent_posts(url: str, failures: list[BaseException]) -> None:
    """Four POSTs at once on one prior-knowledge h2 connection (``http1=False``); the
    httpx errors they raise go to ``failures``."""
    start = threading.Barrier(4)
    with httpx.Client(http1=False, http2=True, trust_env=False) as client:

        def post() -> None:
            start.wait()
            try:
                client.post(url, content=BODY, headers=HEADERS)
            except httpx.HTTPError as exc:
                failures.append(exc)

        threads = [threading.Thread(target=post) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(GUARD)


def test_a_refused_http2_stream_is_recognised_by_h2_event_type() -> None:
    """One stream per connection is answered (slowly); the streams sent beside it are
    reset with REFUSED_STREAM, then GOAWAY follows: each translated error says
    ``refused`` (resend at once). httpcore raises ``RemoteProtocolError`` with h2's
    ``StreamReset`` event (httpcore 1.x) or ``LocalProtocolError`` from h2's
    ``StreamClosedError`` (httpcore2); if it stopped giving either, this fails."""
    with EmbeddingServer(
        http2=True, h2_only=True, goaway_after=1, goaway_mode="refuse", dim=8, latency=1.0
    ) as srv:
        url = f"{srv.base_url}/embeddings"
        failures: list[BaseException] = []
        # httpcore's pool may resend a refused stream on a new connection itself (when the
        # GOAWAY it read first says the stream was not processed), so a refusal can end in
        # a success (seen on a loaded machine, openai 2.x: all of one round's refusals):
        # rounds until one refusal reaches the caller, at most ROUNDS
        for _ in range(ROUNDS):
            srv.reset_counters()
            failures.clear()
            _four_concurrent_posts(url, failures)
            refused = srv.stats()["faults_applied"].get("refused_stream", 0)
            assert refused >= 1, "no stream was refused: nothing was classified"
            assert len(failures) <= refused, (failures, refused)  # each one a refusal
            if failures:
                break
        assert failures, f"httpcore resent every refused stream in {ROUNDS} rounds"
        for exc in failures:
            assert isinstance(exc, httpx.RemoteProtocolError | httpx.LocalProtocolError)
            error = translate(exc, _ctx(srv.base_url), backend="httpx")
            assert isinstance(error, q.NetworkError), repr(error)
            assert error.refused, (repr(exc), repr(exc.__cause__))


def test_a_protocol_error_without_an_h2_event_is_not_refused() -> None:
    exc = httpx.RemoteProtocolError("Server disconnected")
    error = translate(exc, _ctx("http://127.0.0.1:1"), backend="httpx")
    assert isinstance(error, q.NetworkError)
    assert not error.refused


# --------------------------------------------------------------------------- TLS hints

PATHS = ["sync", "async", "h2_sync", "h2_async"]


def _embed(path: str, base_url: str, **extra: Any) -> BaseException:
    retry = q.RetryConfig(max_attempts=1, deadline=20.0, query_deadline=20.0)
    opts: dict[str, Any] = {"base_url": base_url, "retry": retry, **extra}
    if path.startswith("h2_"):
        opts["http2"] = True
    try:
        if path.endswith("async"):
            asyncio.run(q.AsyncEmbeddingClient(**opts).embed_query("tls?"))
        else:
            q.EmbeddingClient(**opts).embed_query("tls?")
    except Exception as exc:
        return exc
    raise AssertionError(f"{path}: the call succeeded")


@pytest.fixture
def collect() -> Iterator[None]:
    yield
    q.close_all()
    # the loopback server (not the client) leaks its side of a refused handshake
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")
@pytest.mark.parametrize("path", PATHS)
def test_tls_hints_come_from_the_ssl_errors_attributes(path: str, collect: None) -> None:
    """An unknown CA (``SSLCertVerificationError``) and a plain-HTTP server behind an
    ``https://`` URL (``SSLError.reason == "WRONG_VERSION_NUMBER"``) each get their hint,
    on every path (each backend chains the ``ssl`` error differently)."""
    with EmbeddingServer(tls=True, http2=path.startswith("h2_")) as srv:
        error = _embed(path, srv.base_url)
        assert isinstance(error, q.ConnectError), repr(error)
        assert "certificate verification failed" in str(error), str(error)
        assert "verify='/path/to/ca-bundle.pem'" in str(error)
    with EmbeddingServer() as plain:
        error = _embed(path, plain.base_url.replace("http://", "https://"))
        assert isinstance(error, q.ConnectError), repr(error)
        assert "the server answers plain HTTP" in str(error), str(error)


@pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")
def test_check_suggests_a_ca_only_for_a_certificate_failure(collect: None) -> None:
    """``qwen-embed check``'s health probe suggests ``--ca`` when the certificate
    failed verification (the ``ssl`` error on httpx's chain), not for a refused
    connection."""
    from qwen_embed_plugins.cli._check import check_server

    with EmbeddingServer(tls=True) as srv:
        health = check_server(srv.base_url, samples=1).finding("health")
        assert health.status == "fail"
        assert "--ca" in str(health.advice), health
        port = srv.port
    gone = check_server(f"https://127.0.0.1:{port}/v1", samples=1).finding("health")
    assert gone.status == "fail"
    assert gone.advice is not None
    assert "--ca" not in gone.advice, gone


# --------------------------------------------------------------------------- TimeLeft


class _Recording(TimeLeft):
    """``TimeLeft`` that counts the lookups of the read timeout."""

    def __init__(self, timeouts: dict[str, float | None], deadline: float) -> None:
        super().__init__(timeouts, deadline)
        self.reads = 0

    def get(self, key: str, default: float | None = None) -> float | None:  # type: ignore[override]
        if key == "read":
            self.reads += 1
        return super().get(key, default)


def test_httpcore_looks_the_timeout_up_before_each_http2_read() -> None:
    """The sync HTTP/2 deadline (``TimeLeft``) holds only while httpcore looks the
    ``timeout`` request extension up before each read: a head trickled one byte per
    0.3 s, with a 30 s read timeout and 1.5 s left, must end in httpx's ``ReadTimeout``
    (not run on until the server's own bound, ``GUARD``) after several lookups."""
    with HostileServer(max_seconds=GUARD, http2=True) as hostile:
        hostile.set("trickle", on="embeddings", headers=True, interval=0.3)
        timeouts = _Recording(
            {"connect": 30.0, "read": 30.0, "write": 30.0, "pool": 30.0}, time.monotonic() + 1.5
        )
        assert hostile.ca_cert_path is not None
        context = ssl.create_default_context(cafile=hostile.ca_cert_path)
        with httpx.Client(verify=context, http2=True, trust_env=False) as c:
            request = c.build_request(
                "POST",
                f"{hostile.base_url}/embeddings",
                content=BODY,
                headers=HEADERS,
                extensions={"timeout": timeouts},
            )
            with pytest.raises(httpx.ReadTimeout):
                c.send(request)
        assert timeouts.reads >= 2, timeouts.reads  # per read, not once per request
        assert hostile.stats()["trickled"] < GUARD / 0.3 / 2


# --------------------------------------------------------------------------- logs


def test_http_library_log_records_are_scrubbed_whatever_their_wording(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every secret sent through httpx is scrubbed from the httpx/httpcore records by
    their formatted message: a record of a wording httpcore does not use today (or
    with the key in another argument of httpx's line) is scrubbed too, not let
    through; the records themselves are kept."""
    from qwen_embed_plugins._transport._http import HTTP_LIBRARY

    key = "sk-backend-signals-0123456789abcdef"
    core = "httpcore2" if HTTP_LIBRARY == "httpx2" else "httpcore"
    caplog.set_level(logging.DEBUG)
    with EmbeddingServer(http2=True, h2_only=True) as srv:
        client = q.EmbeddingClient(base_url=srv.base_url, api_key=key, http2=True)
        assert len(client.embed_query("logged")) == srv.dim
    logging.getLogger(f"{core}.http2").debug("a future wording: %s", f"x-echo={key.upper()}")
    logging.getLogger(f"{core}.http11").debug("receive_response_headers.complete %r", key)
    logging.getLogger(HTTP_LIBRARY).info('HTTP Request: %s %s "%s"', key[:12] + key[12:], 1, 2)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("a future wording: x-echo=***") for m in messages), messages
    assert any(m.startswith("HTTP Request: ***") for m in messages), messages
    assert any(r.name == HTTP_LIBRARY for r in caplog.records[:-1]), "no record of the call"
    for text in messages:
        assert key.lower() not in text.lower(), text
        assert key[3:15] not in text, text


# --------------------------------------------------------------------------- the table


@pytest.mark.unit
@pytest.mark.parametrize("backend", ["httpx", "stdlib", "aiohttp"])
def test_no_row_of_the_exception_table_is_shadowed(backend: str) -> None:
    """Each row of a backend's table can match: no earlier row matches every exception
    it does under every condition it has (its types within the earlier row's, and no
    condition of the earlier row that the later one lacks), so that none is dead."""
    from qwen_embed_plugins._transport._exceptions import _table

    rows = _table(backend)
    assert rows[-1].types == (BaseException,)  # the table ends in a catch-all
    for i, row in enumerate(rows):
        for earlier in rows[:i]:
            covers = all(issubclass(t, earlier.types) for t in row.types)
            looser = (
                (earlier.stage is None or earlier.stage == row.stage)
                and (earlier.proxy is None or earlier.proxy == row.proxy)
                and (earlier.when is None or earlier.when is row.when)
            )
            assert not (covers and looser), (backend, i, row, earlier)


@pytest.mark.unit
def test_a_backend_failure_is_raised_with_no_chain() -> None:
    """``mapped``: what the backend raised (quoting the server's bytes, here a status
    line holding a key, raised from a ``ValueError`` that quotes it too) becomes the
    library's error with no ``__cause__`` and no ``__context__``: a formatted traceback
    shows neither."""
    import http.client
    import traceback

    from qwen_embed_plugins._transport._contract import Progress, Request, mapped

    key = "sk-chain-0123456789abcdef"
    req = Request("POST", "http://127.0.0.1:1/v1", b"", {}, q.Timeouts(), None, 1, _ctx("x"))
    progress = Progress(None)
    progress.stage = "read"

    def exchange() -> None:
        with mapped(req, progress, "stdlib") as block:
            try:
                raise ValueError(f"invalid literal: {key!r}")
            except ValueError as exc:
                raise http.client.BadStatusLine(f"HTTP/1.1 {key}") from exc
        block.check()

    with pytest.raises(q.RemoteProtocolError) as info:
        exchange()
    error = info.value
    assert error.__cause__ is None
    assert error.__context__ is None
    assert "BadStatusLine" not in "".join(traceback.format_exception(error))
