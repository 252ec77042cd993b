"""Shared pytest fixtures. Keep this file small and generic: several people add to it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from qwen_embed_plugins.testing import EmbeddingServer


@pytest.fixture
def embedding_server() -> Iterator[EmbeddingServer]:
    """A started default `EmbeddingServer` (SGLang dialect, HTTP/1.1 on uvicorn, 1024-dim
    vectors, 5 s keep-alive) on a free 127.0.0.1 port, closed after the test."""
    from qwen_embed_plugins.testing import EmbeddingServer

    with EmbeddingServer() as server:
        yield server


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddingServer]:
    """A default `EmbeddingServer` shared by the tests of one module (saves start-ups)."""
    from qwen_embed_plugins.testing import EmbeddingServer

    with EmbeddingServer() as shared:
        yield shared


@pytest.fixture
def srv(server: EmbeddingServer) -> Iterator[EmbeddingServer]:
    """The module's server with zeroed counters and no faults pending, for one test."""
    server.reset_counters()
    server.clear_faults()
    yield server
    server.clear_faults()
