"""Starting and stopping the test servers: `stop` is quiet (no CancelledError traceback,
no ERROR record, even with client connections still open), and a server that fails to
start says why (its own error, or that it did not start), never that it did not stop."""

from __future__ import annotations

import http.client
import logging
import threading
from collections.abc import Iterator

import httpx
import pytest

from qwen_embed_tooling.testing import EmbeddingServer, HostileServer, _app

NOISE = ("Traceback", "CancelledError", "Exception in callback")


def assert_quiet(capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    out, err = capfd.readouterr()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    for text in (out, err, caplog.text):
        for word in NOISE:
            assert word not in text, text[-2000:]


def test_a_hostile_server_stops_quietly_with_an_idle_keep_alive_connection(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """The idle connection's handler outlives the stop grace and is cancelled: it ends
    without asyncio's "Exception in callback ... CancelledError" traceback."""
    caplog.set_level(logging.DEBUG)
    server = HostileServer(dim=8).start()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", "/v1/models")
        answer = conn.getresponse()
        assert answer.status == 200
        answer.read()  # the connection stays open, idle, between requests
        server.stop()
    finally:
        conn.close()
    assert server.stats()["connections_active"] == 0
    assert_quiet(capfd, caplog)


@pytest.mark.parametrize("tls", [False, True], ids=["h2c", "tls"])
def test_an_http2_embedding_server_stops_quietly_with_a_connection_open(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, tls: bool
) -> None:
    """hypercorn's connection tasks are cancelled at shutdown; the ERROR asyncio logs for
    them (Python 3.11) is dropped, and only that."""
    caplog.set_level(logging.DEBUG)
    server = EmbeddingServer(http2=True, tls=tls).start()
    verify = server.ssl_context() if tls else False
    client = httpx.Client(base_url=server.base_url, verify=verify, http1=False, http2=True)
    try:
        for _ in range(2):
            r = client.post("/embeddings", json={"input": ["a"], "model": server.model})
            assert r.status_code == 200
            assert r.http_version == "HTTP/2"
        server.close()
    finally:
        client.close()
    assert_quiet(capfd, caplog)


MODES = {
    "uvicorn": {},
    "hypercorn": {"http2": True},
    "raw_h2": {"http2": True, "goaway_after": 2},
}


@pytest.mark.parametrize("mode", MODES)
def test_a_startup_failure_is_reported_with_its_cause(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    def fail(self: object) -> None:
        raise OSError("no such device: the start-up check failed")

    monkeypatch.setattr(_app._EmbeddingApp, "begin_run", fail)
    server = EmbeddingServer(**MODES[mode])  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="failed to start: OSError") as info:
        server.start()
    assert "start-up check failed" in str(info.value)
    assert "did not stop" not in str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    assert not server.running


@pytest.fixture
def stuck_start(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Server start-up blocks (in the server's own thread) until the event is set."""
    release = threading.Event()
    real = _app._EmbeddingApp.begin_run

    def blocked(self: _app._EmbeddingApp) -> None:
        release.wait(60)
        real(self)

    monkeypatch.setattr(_app._EmbeddingApp, "begin_run", blocked)
    yield release
    release.set()  # the thread then sees the stop start() asked for, and ends


@pytest.mark.parametrize("mode", MODES)
def test_a_startup_that_never_completes_is_reported_as_such(
    stuck_start: threading.Event, mode: str
) -> None:
    server = EmbeddingServer(startup_timeout=0.3, **MODES[mode])  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"did not start within 0\.3 s") as info:
        server.start()
    assert "did not stop" not in str(info.value)
    assert not server.running
