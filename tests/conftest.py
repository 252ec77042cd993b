"""Shared pytest fixtures and the suite's ordering. Keep this file small and generic:
several people add to it.

* ``unit`` tests (no server, no socket) run first; a ``unit`` test that opens or binds an
  internet socket fails (``_no_network_in_unit_tests``).
* ``openai_major``: the tests whose outcome can depend on the installed openai major (and
  so on ``httpx`` vs ``httpx2``): the SDK transports (``openai_client()``), the HTTP/2
  backend and the stock openai-based adapters. ``scripts/test.sh`` runs the whole suite
  under openai 3.x and only these again under openai 2.x. A test is marked by the rule
  in ``_depends_on_openai_major`` (its own source, its parameters, its fixtures), or
  explicitly with ``@pytest.mark.openai_major``.
* ``wait_until``: wait for a condition (a request arrived, a connection closed) instead of
  sleeping for a guessed time.
"""

from __future__ import annotations

import inspect
import re
import socket
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from qwen_embed_tooling.testing import EmbeddingServer

SERVER_FIXTURES = frozenset({"embedding_server", "server", "srv", "realserver"})
"""Fixtures that start a server: a ``unit`` test may not use them."""

WAIT_GUARD_S = 120.0
"""How long ``wait_until`` waits before failing: a guard against a hang, not a speed
requirement (a condition that holds after 0.01 s on an idle machine may take seconds on a
loaded one)."""


# What in a test's own source reaches the SDK transports, the HTTP/2 backend or the stock
# openai-based adapters: the code whose behaviour the openai/httpx major can change.
_MAJOR_SOURCE = re.compile(
    r"openai_client\(|http2\s*=\s*True|\bimport openai\b|\bopenai\.|\bAsyncOpenAI\b|"
    r"OpenAIEmbeddings?\b|OpenAILikeEmbedding\b|h2_only"
)
# ... or a parameter id / fixture name naming such a path (``sdk_async``, ``h2_sync``, ``h2``)
_MAJOR_WORD = re.compile(r"(?:^|[^a-z0-9])(sdk|h2c?|http2|openai)(?:[^a-z0-9]|$)", re.IGNORECASE)


def _depends_on_openai_major(item: pytest.Item) -> bool:
    """Whether ``item`` can depend on the installed openai major (see the module docstring)."""
    if item.get_closest_marker("openai_major") is not None:
        return True
    function = getattr(item, "function", None)
    if function is not None:
        try:
            if _MAJOR_SOURCE.search(inspect.getsource(function)):
                return True
        except (OSError, TypeError):  # no source (a generated test): decide by the rest
            pass
    callspec = getattr(item, "callspec", None)
    if callspec is not None and _MAJOR_WORD.search(callspec.id):
        return True
    return any(_MAJOR_WORD.search(name) for name in getattr(item, "fixturenames", ()))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the ``openai_major`` tests, and run the ``unit`` tests first (a stable sort: the
    order within each group is kept)."""
    for item in items:
        if item.get_closest_marker("openai_major") is None and _depends_on_openai_major(item):
            item.add_marker(pytest.mark.openai_major)
    items.sort(key=lambda item: item.get_closest_marker("unit") is None)


@pytest.fixture(autouse=True)
def _no_network_in_unit_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``unit`` may not connect or bind an IPv4/IPv6 socket."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    servers = sorted(set(request.fixturenames) & SERVER_FIXTURES)
    if servers:
        pytest.fail(f"a test marked 'unit' uses server fixtures {servers}", pytrace=False)
    real_connect, real_connect_ex, real_bind = (
        socket.socket.connect,
        socket.socket.connect_ex,
        socket.socket.bind,
    )

    def guard(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(sock: socket.socket, *args: Any) -> Any:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.close()  # the test fails anyway; no unclosed-socket warning on top
                raise AssertionError(
                    f"a test marked 'unit' used the network ({real.__name__}{args!r}); "
                    "drop the marker or the network use"
                )
            return real(sock, *args)

        return call

    mp = pytest.MonkeyPatch()
    mp.setattr(socket.socket, "connect", guard(real_connect))
    mp.setattr(socket.socket, "connect_ex", guard(real_connect_ex))
    mp.setattr(socket.socket, "bind", guard(real_bind))
    try:
        yield
    finally:
        mp.undo()


def _wait_until(predicate: Callable[[], object], what: str, *, guard: float = WAIT_GUARD_S) -> None:
    """Poll ``predicate`` every 10 ms until it is true; fail naming ``what`` if it is still
    false after ``guard`` seconds."""
    deadline = time.monotonic() + guard
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"still waiting for {what} after {guard:.0f} s", pytrace=False)
        time.sleep(0.01)


@pytest.fixture(scope="session")
def wait_until() -> Callable[..., None]:
    """``wait_until(predicate, what)``: block until ``predicate()`` is true (polled every
    10 ms). It never asserts how long that took; after ``WAIT_GUARD_S`` seconds it fails
    the test naming ``what`` (a hang guard). In an async test call it through
    ``await asyncio.to_thread(wait_until, ...)``."""
    return _wait_until


@pytest.fixture(autouse=True)
def _fresh_state() -> None:
    """Each test starts from a clean process state (``qwen_embed_plugins.reset()``): no
    pool, no replica health, no learned limit, no gate, no metrics. A server started by
    this test can get the port, hence the URL, of an earlier test's server; module-scoped
    servers keep running (their clients reopen connections lazily)."""
    import qwen_embed_plugins as q

    q.reset()


@pytest.fixture(scope="module")
def poisoned_port() -> int:
    """The port of a gone server that left process state behind, set up (module scope)
    before the per-test ``reset()``, as an earlier test of the session would: a learned
    limit of 2 texts per request, and the connections and requests of its URL counted.
    A test that starts its server on this port (``EmbeddingServer(port=...)``) inherits
    none of it only if the reset works."""
    import qwen_embed_plugins as q
    from qwen_embed_tooling.testing import EmbeddingServer

    with EmbeddingServer(max_batch=2) as gone:
        client = q.EmbeddingClient(base_url=gone.base_url, batch_size=10)
        client.embed_documents([f"poison {i}" for i in range(12)])
        gone.reset_counters()
        client.embed_documents(["learned 1", "learned 2", "learned 3", "learned 4"])
        assert gone.requests == 2, "the limit was not learned: the fixture poisons nothing"
        return gone.port


@pytest.fixture
def embedding_server() -> Iterator[EmbeddingServer]:
    """A started default `EmbeddingServer` (SGLang dialect, HTTP/1.1 on uvicorn, 1024-dim
    vectors, 5 s keep-alive) on a free 127.0.0.1 port, closed after the test."""
    from qwen_embed_tooling.testing import EmbeddingServer

    with EmbeddingServer() as server:
        yield server


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddingServer]:
    """A default `EmbeddingServer` shared by the tests of one module (saves start-ups)."""
    from qwen_embed_tooling.testing import EmbeddingServer

    with EmbeddingServer() as shared:
        yield shared


@pytest.fixture
def srv(server: EmbeddingServer) -> Iterator[EmbeddingServer]:
    """The module's server with zeroed counters and no faults pending, for one test."""
    server.reset_counters()
    server.clear_faults()
    yield server
    server.clear_faults()
