"""One table of hostile-server cases, each run on every request path: the library's sync
and async clients and ``openai_client()`` sync and async (all over HTTP/1.1 against
`HostileServer`, or a raw socket where the case is below HTTP), and the HTTP/2 paths
where the HTTP/2 test server can play the case. A case holds only when it holds on
every path.

Deadline cases use a 2 s deadline and assert the error type; the wall time is guarded
only against hangs (``GUARD``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import qwen_embed_plugins as q
from qwen_embed_tooling.testing import EmbeddingServer, HostileServer, expected_embeddings

KEY = "sk-hostile-paths-0123456789abcdef"
DEADLINE = 2.0
GUARD = 45.0  # seconds: far above every deadline here; only a hang reaches it
PATHS = ("sync", "async", "sdk_sync", "sdk_async")
TEXTS = ["alpha", "beta"]


def settings(base_url: str, deadline: float, **extra: Any) -> dict[str, Any]:
    retry = q.RetryConfig(max_attempts=1, deadline=deadline, query_deadline=deadline)
    return {"base_url": base_url, "api_key": KEY, "retry": retry, **extra}


def call(
    path: str, base_url: str, texts: list[str] = TEXTS, deadline: float = DEADLINE, **extra: Any
) -> Any:
    """Embed ``texts`` on ``path``; the vectors (n x dim array) or the exception."""
    opts = settings(base_url, deadline, **extra)
    try:
        if path == "sync":
            return q.EmbeddingClient(**opts).embed_documents_array(texts)
        if path == "async":
            aclient = q.AsyncEmbeddingClient(**opts)
            return asyncio.run(aclient.embed_documents_array(texts))
        if path == "sdk_sync":
            sdk = q.EmbeddingClient(**opts).openai_client()
            got = sdk.embeddings.create(input=texts, model="m")
        else:
            asdk = q.AsyncEmbeddingClient(**opts).openai_client()
            got = asyncio.run(asdk.embeddings.create(input=texts, model="m"))
        if isinstance(got, str):  # the SDK returns a non-JSON 200 body as it is
            return got
        return np.asarray([d.embedding for d in got.data], dtype=np.float32)
    except Exception as exc:
        return exc


def library_error(path: str, outcome: Any) -> BaseException:
    """The library's error behind ``outcome``: on the SDK paths the ``__cause__`` of the
    ``httpx`` error the SDK wrapped (an HTTP error status is the SDK's own error)."""
    assert isinstance(outcome, BaseException), f"{path}: expected a failure, got vectors"
    if path.startswith("sdk"):
        import openai

        assert isinstance(outcome, openai.APIError), (path, outcome)
        if isinstance(outcome, openai.APIStatusError):
            return outcome
        cause = outcome.__cause__
        if cause is not None and not isinstance(cause, q.QwenEmbedError):
            cause = cause.__cause__  # a timeout: httpx's, from the library's
        assert isinstance(cause, q.QwenEmbedError), (path, repr(outcome), repr(cause))
        return cause
    return outcome


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    result = fn()
    return result, time.monotonic() - started


@pytest.fixture
def hostile() -> Iterator[HostileServer]:
    with HostileServer(max_seconds=GUARD) as server:
        yield server
    q.close_all()


def no_secret(texts: list[str]) -> None:
    bits = {KEY, KEY.upper(), KEY.lower(), KEY[:-4], KEY[3:]}
    for text in texts:
        for bit in bits:
            assert bit not in text, text[:300]


# --------------------------------------------------------------------------- the deadline

SLOW = [
    ("trickle", {"headers": True, "interval": 0.5}),  # the head, byte by byte
    ("trickle", {"headers": False, "interval": 0.5}),  # the body
    ("trickle_chunked", {"part": "size", "interval": 0.5}),
    ("trickle_chunked", {"part": "trailer", "interval": 0.5}),
    ("silent", {}),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("kind", "params"), SLOW, ids=[f"{k}-{p}" for k, p in SLOW])
def test_a_slow_answer_ends_at_the_deadline(
    hostile: HostileServer, path: str, kind: str, params: dict[str, Any]
) -> None:
    hostile.set(kind, on="embeddings", **params)
    outcome, took = timed(lambda: call(path, hostile.base_url))
    error = library_error(path, outcome)
    assert isinstance(error, q.TimeoutException), (path, repr(error))
    assert took < GUARD


@pytest.mark.parametrize("path", PATHS)
def test_a_server_that_never_reads_ends_at_the_deadline(path: str) -> None:
    """Slow write: the server accepts and never reads a ~13 MB request."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        texts = [chr(97 + i % 26) * 200_000 for i in range(64)]
        outcome, took = timed(
            lambda: call(
                path,
                url,
                texts,
                batch_size=64,
                max_concurrency=1,
                timeout=q.Timeouts(write=60.0, read=60.0),
            )
        )
        error = library_error(path, outcome)
        assert isinstance(error, q.TimeoutException), (path, repr(error))
        assert took < GUARD
    finally:
        stop.set()
        thread.join()
        for sock in held:
            sock.close()
        listener.close()
        q.close_all()


@pytest.mark.parametrize("path", PATHS)
def test_a_connect_that_hangs_ends_at_the_deadline(path: str) -> None:
    """Slow connect: a listening socket whose backlog is full (SYNs are not answered)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):  # fill the accept queue; later connects hang
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        outcome, took = timed(lambda: call(path, url, timeout=q.Timeouts(connect=60.0)))
        error = library_error(path, outcome)
        assert isinstance(error, q.TimeoutException | q.ConnectError), (path, repr(error))
        assert took < GUARD
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
        q.close_all()


@pytest.mark.parametrize("path", PATHS)
def test_a_wait_for_the_pool_ends_at_the_deadline(hostile: HostileServer, path: str) -> None:
    """One connection, held by a silent answer: the next call waits for the pool no
    longer than its deadline (the pool timeout is far longer)."""
    hostile.set("silent", on="embeddings")
    # one connection for the process (every thread and event loop), the pool timeout
    # far longer than the deadline
    limits = q.Limits(max_connections=1, max_connections_per_process=1)
    extra = {"limits": limits, "timeout": q.Timeouts(pool=60.0, read=60.0)}
    # the holder keeps the connection longer than the caller's whole deadline
    holder = threading.Thread(
        target=call, args=("sync", hostile.base_url), kwargs={**extra, "deadline": 4 * DEADLINE}
    )
    holder.start()
    try:
        hostile.wait_for("requests", 1)  # the holder's request is at the server
        outcome, took = timed(lambda: call(path, hostile.base_url, **extra))
        error = library_error(path, outcome)
        assert isinstance(error, q.TimeoutException), (path, repr(error))
        assert took < GUARD
    finally:
        holder.join(GUARD)


# --------------------------------------------------------------------------- size


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["huge_content_length", "endless_chunked", "gzip_bomb"])
def test_an_oversized_body_ends_in_a_response_error(
    hostile: HostileServer, path: str, kind: str
) -> None:
    hostile.set(kind, on="embeddings")
    # not a deadline case: time enough for the server to build its bomb
    error = library_error(path, call(path, hostile.base_url, deadline=GUARD))
    assert isinstance(error, q.ResponseError), (path, repr(error))
    assert "max_response_bytes" in str(error)


# --------------------------------------------------------------------------- framing


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("status", [100, 102, 103])
def test_an_interim_answer_is_never_taken_for_the_final_one(
    hostile: HostileServer, path: str, status: int
) -> None:
    """A 1xx before the answer: the call returns its own vectors or fails with a
    transport error, and the next call on the pool returns its own (never the answer
    left on the socket)."""
    hostile.set("interim", on="embeddings", status=status)
    first = call(path, hostile.base_url)
    if isinstance(first, BaseException):
        assert isinstance(library_error(path, first), q.TransportError), (path, repr(first))
    else:
        np.testing.assert_allclose(first, expected_embeddings(TEXTS), atol=1e-6)
    hostile.set("ok")
    again = ["gamma", "delta"]
    second = call(path, hostile.base_url, again)
    assert not isinstance(second, BaseException), (path, repr(second))
    np.testing.assert_allclose(second, expected_embeddings(again), atol=1e-6)


BAD_STATUS = ["HTTP/1.1 099 Odd", "HTTP/1.1 000 Zero", "HTTP/1.1 -200 OK", "HTTP/1.1 abc OK"]
BAD_STATUS += ["HTTP/1.1", "HTTP/1.1 600 Beyond", "SPDY/3 200 OK"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("line", BAD_STATUS)
def test_a_malformed_or_missing_status_is_a_transport_error(
    hostile: HostileServer, path: str, line: str
) -> None:
    hostile.set("status_line", on="embeddings", line=line)
    error = library_error(path, call(path, hostile.base_url))
    assert isinstance(error, q.TransportError), (path, repr(error))


@pytest.mark.parametrize("path", PATHS)
def test_a_dropped_connection_is_a_transport_error(hostile: HostileServer, path: str) -> None:
    hostile.set("drop", on="embeddings")
    error = library_error(path, call(path, hostile.base_url))
    assert isinstance(error, q.TransportError), (path, repr(error))


# --------------------------------------------------------------------------- secrets


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("where", ["status", "header", "content_encoding", "body"])
def test_a_key_echoed_anywhere_never_reaches_an_error_or_a_log(
    hostile: HostileServer, caplog: pytest.LogCaptureFixture, path: str, where: str
) -> None:
    caplog.set_level(logging.DEBUG)
    hostile.set("echo_auth", on="embeddings", where=where, transform="exact")
    outcome = call(path, hostile.base_url)
    texts = [caplog.text]
    if isinstance(outcome, BaseException):  # the chain: the library's error included
        texts += [repr(outcome), "".join(traceback.format_exception(outcome))]
        texts.append(repr(vars(outcome)))
    else:  # the SDK returns a 200 text body as its answer (not an error)
        assert path.startswith("sdk"), (path, where)
        assert where == "body", (path, where)
    no_secret(texts)


# --------------------------------------------------------------------------- HTTP/2


H2_PATHS = ("sync", "async", "sdk_sync", "sdk_async")


@pytest.fixture(scope="module")
def h2_server() -> Iterator[EmbeddingServer]:
    with EmbeddingServer(tls=True, http2=True) as srv:
        yield srv
    q.close_all()


@pytest.mark.parametrize("path", H2_PATHS)
def test_http2_silent_answer_ends_at_the_deadline(h2_server: EmbeddingServer, path: str) -> None:
    h2_server.inject("delay", seconds=20.0)
    try:
        opts = {"http2": True, "verify": str(h2_server.ca_cert_path)}
        outcome, took = timed(lambda: call(path, h2_server.base_url, **opts))
        error = library_error(path, outcome)
        assert isinstance(error, q.TimeoutException), (path, repr(error))
        assert took < GUARD
    finally:
        h2_server.clear_faults()


@pytest.mark.parametrize("path", H2_PATHS)
def test_http2_debug_logs_never_show_the_key(
    h2_server: EmbeddingServer, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    """Every logger at DEBUG (``hpack`` included, whose DEBUG records hold whole header
    blocks, encoded and decoded): neither the key nor its HPACK encoding appears."""
    import hpack

    caplog.set_level(logging.DEBUG)
    for name in ("hpack", "hpack.hpack", "hpack.table", "h2", "httpcore", "httpx"):
        caplog.set_level(logging.DEBUG, logger=name)
    opts = {"http2": True, "verify": str(h2_server.ca_cert_path)}
    got = call(path, h2_server.base_url, **opts)
    assert not isinstance(got, BaseException), (path, repr(got))
    encoded = hpack.Encoder().encode([(b"authorization", f"Bearer {KEY}".encode())])
    literal = hpack.Encoder().encode([(b"authorization", f"Bearer {KEY}".encode())], huffman=False)
    text = caplog.text
    no_secret([text])
    for form in (encoded, literal, encoded[2:], literal[2:]):
        assert repr(form)[2:-1] not in text
        assert form.hex() not in text
