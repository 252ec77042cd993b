"""``qwen-embed check`` keeps its own budgets: each ``GET`` probe (``/health``,
``/models``, the HTTP/2 probe, the keep-alive probe's request) ends within its own
budget (``PROBE_BUDGET``, 10 s; injected short here), whatever the server does, not at
the check's ``--timeout`` (300 s by default). The HTTP/2 probe meets every non-HTTP/2
answer to the h2c preface: an HTTP/1.1 response on a connection held open (which h2
reads as the head of a huge frame and waits for), silence, garbage and a close."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from qwen_embed_plugins import errors
from qwen_embed_plugins.cli._check import check_server
from qwen_embed_plugins.cli._probe import Probes, measure_idle_timeout, probe_http2
from qwen_embed_tooling.testing import EmbeddingServer

BUDGET = 0.5  # seconds: the probes' own budget in these tests
DEADLINE = 120.0  # seconds: the check's --timeout here; reaching it is the failure
H1_ANSWER = b"HTTP/1.1 505 HTTP Version Not Supported\r\nContent-Length: 0\r\n\r\n"
PREFACE = b"PRI * HTTP/2.0"


class OddServer:
    """A loopback TCP server: a connection opening with the h2c preface gets ``answer``
    (an HTTP/1.1 response, garbage, nothing, or a close) and is held open until the
    server stops; any other connection is relayed to ``upstream`` (``host, port``) when
    given, else answered like the preface."""

    def __init__(self, answer: bytes | None, upstream: tuple[str, int] | None = None) -> None:
        self.answer = answer
        self.upstream = upstream
        self.stopped = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            first = conn.recv(65536)
            if self.upstream is not None and not first.startswith(PREFACE):
                self._relay(conn, first)
                return
            if self.answer is None:  # a close without a byte
                conn.close()
                return
            conn.sendall(self.answer)
            self.stopped.wait()  # held open (b"": silence)

    def _relay(self, conn: socket.socket, first: bytes) -> None:
        assert self.upstream is not None
        up = socket.create_connection(self.upstream)
        self.conns.append(up)
        up.sendall(first)

        def pump(src: socket.socket, dst: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while data := src.recv(65536):
                    dst.sendall(data)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        threading.Thread(target=pump, args=(up, conn), daemon=True).start()
        pump(conn, up)

    def stop(self) -> None:
        self.stopped.set()
        self.sock.close()
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.close()


@contextlib.contextmanager
def odd_server(
    answer: bytes | None, upstream: tuple[str, int] | None = None
) -> Iterator[OddServer]:
    server = OddServer(answer, upstream)
    try:
        yield server
    finally:
        server.stop()


ANSWERS = {"http11_response": H1_ANSWER, "silence": b"", "garbage": b"\xff" * 64, "close": None}


@pytest.mark.parametrize("answer", list(ANSWERS), ids=list(ANSWERS))
def test_the_http2_probe_ends_within_its_own_budget(answer: str) -> None:
    with odd_server(ANSWERS[answer]) as server:
        deadline = time.monotonic() + DEADLINE
        got = probe_http2(server.base_url, timeout=BUDGET, deadline=deadline)
        assert got is None  # no HTTP/2 here
        assert time.monotonic() < deadline  # its budget ended it, not the check's


def test_a_get_probe_that_gets_no_answer_names_its_own_budget() -> None:
    with odd_server(b"") as server:
        deadline = time.monotonic() + DEADLINE
        with Probes(
            server.base_url, api_key=None, verify=True, deadline=deadline, budget=DEADLINE
        ) as probes:
            with pytest.raises(errors.TimeoutException, match=r"its own budget of 0\.5 s"):
                probes.get_models(server.base_url, within=BUDGET)
            with pytest.raises(errors.TimeoutException, match=r"its own budget of 0\.5 s"):
                probes.send("GET", f"http://127.0.0.1:{server.port}/health", within=BUDGET)
        assert time.monotonic() < deadline


def test_the_keepalive_request_ends_within_its_own_budget() -> None:
    with odd_server(b"") as server:
        deadline = time.monotonic() + DEADLINE
        with pytest.raises(OSError, match=r"its own budget of 0\.5 s"):
            measure_idle_timeout(server.base_url, max_idle=0.5, deadline=deadline, budget=BUDGET)
        assert time.monotonic() < deadline


def test_the_check_gets_past_an_http11_answer_to_the_h2c_preface(
    embedding_server: EmbeddingServer,
) -> None:
    """The server of the finding: HTTP/1.1 works (relayed to a real embedding server),
    the h2c preface gets an HTTP/1.1 response on a connection held open. The check
    reports "HTTP/1.1 only" within the probe's budget instead of spending --timeout."""
    upstream = ("127.0.0.1", int(embedding_server.base_url.rsplit(":", 1)[1].split("/")[0]))
    with odd_server(H1_ANSWER, upstream) as server:
        started = time.monotonic()
        report = check_server(
            server.base_url,
            max_idle=0.2,
            batch_probe_max=2,
            samples=1,
            timeout=DEADLINE,
            probe_budget=BUDGET,
        )
        findings = {f.name: f for f in report.findings}
        assert findings["embedding"].status == "ok", report.to_dict()
        assert findings["http2"].summary == "HTTP/1.1 only", findings["http2"]
        assert time.monotonic() < started + DEADLINE
