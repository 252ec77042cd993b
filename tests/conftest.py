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
