"""The process state and ``qwen_embed_plugins.reset()``, against loopback servers.

A server started on the port of an earlier, gone server has the same URL, so the same
replica, pool and metrics row: without ``reset()`` it inherits what the process learned
about the old one (here a batch limit of 4 texts, and the old connections' counters).
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Callable
from typing import Any

import pytest

import qwen_embed_plugins as q
from qwen_embed_tooling.testing import EmbeddingServer

TEXTS = [f"state text {i}" for i in range(20)]
PATHS = ["sync", "async", "langchain", "llama_index"]


def _embedder(path: str, base_url: str) -> Callable[[list[str]], Any]:
    """``embed(texts)`` through ``path``, 10 texts per request (one object: it keeps its
    clients, as an application's would across ``reset()``)."""
    if path == "sync":
        return q.EmbeddingClient(base_url=base_url, batch_size=10).embed_documents
    if path == "async":
        client = q.AsyncEmbeddingClient(base_url=base_url, batch_size=10)
        return lambda texts: asyncio.run(client.embed_documents(texts))
    if path == "langchain":
        pytest.importorskip("langchain_core")
        return q.QwenPooledEmbeddings(base_url=base_url, batch_size=10).embed_documents
    pytest.importorskip("llama_index.core")
    return q.QwenPooledEmbedding(base_url=base_url, embed_batch_size=10).get_text_embedding_batch


@pytest.fixture
def noise(capfd: pytest.CaptureFixture[str]) -> Callable[[], list[str]]:
    """``noise()``: output lines about an unclosed object or an exception ignored in a
    finaliser (warnings fail the test by themselves: ``filterwarnings = error``)."""

    def found() -> list[str]:
        gc.collect()
        out, err = capfd.readouterr()
        return [
            line
            for line in (out + err).splitlines()
            if "unclosed" in line.lower() or "exception ignored" in line.lower()
        ]

    return found


def test_reset_is_public() -> None:
    assert "reset" in q.__all__


@pytest.mark.parametrize("path", PATHS)
def test_a_server_on_a_reused_port_starts_clean_after_reset(path: str) -> None:
    with EmbeddingServer(max_batch=4) as old:
        port = old.port
        _embedder(path, old.base_url)(TEXTS)  # learns: at most 4 texts per request
    with EmbeddingServer(port=port) as new:
        embed = _embedder(path, new.base_url)
        label = q.EmbeddingConfig(base_url=new.base_url).endpoint
        embed(TEXTS)
        # the hazard: the new server is sent the old one's limit
        assert max(len(batch) for batch in new.received) <= 4
        assert q.stats()[label]["requests"] > new.requests

        q.reset()
        assert label not in q.pool_stats()
        assert label not in q.stats()
        new.reset_counters()
        _embedder(path, new.base_url)(TEXTS)  # a new object
        assert [len(batch) for batch in new.received] == [10, 10]
        assert q.pool_stats()[label]["requests"] == new.requests == 2
        assert q.pool_stats()[label]["connections_opened"] == new.connections_opened
        assert q.stats()[label]["texts"] == new.texts == len(TEXTS)
        new.reset_counters()
        embed(TEXTS)  # an object made before reset() forgot the limit too
        assert [len(batch) for batch in new.received] == [10, 10]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_reset_in_a_forked_child_leaves_the_parents_connection(
    srv: EmbeddingServer, wait_until: Callable[..., None], noise: Callable[[], list[str]]
) -> None:
    client = q.EmbeddingClient(base_url=srv.base_url)
    client.embed_query("parent before")
    assert srv.connections_opened == 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        ok = False
        try:
            q.reset()
            ok = len(client.embed_query("child")) == srv.dim
            q.reset()
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"1"
    assert srv.connections_opened == 2  # the child's own connection
    client.embed_query("parent after")  # on the parent's connection, untouched
    assert srv.connections_opened == 2
    q.reset()
    wait_until(lambda: srv.connections_active == 0, "the parent's pool closed")
    assert noise() == []


async def test_reset_on_a_running_loop_closes_its_pool_inside_it(
    srv: EmbeddingServer, wait_until: Callable[..., None], noise: Callable[[], list[str]]
) -> None:
    client = q.AsyncEmbeddingClient(base_url=srv.base_url)
    await client.embed_documents(TEXTS)
    assert srv.connections_active >= 1
    q.reset()  # from the loop's own thread, while it runs
    await asyncio.to_thread(
        wait_until, lambda: srv.connections_active == 0, "the loop's pool closed"
    )
    opened = srv.connections_opened
    assert len(await client.embed_query("after")) == srv.dim  # reopened lazily
    assert srv.connections_opened == opened + 1
    q.reset()
    await asyncio.to_thread(wait_until, lambda: srv.connections_active == 0, "the new pool closed")
    assert noise() == []


# asyncio reports the transports of a loop closed with them open ("unclosed transport",
# see tests/test_dropped_loops.py): the user's loop, not ours to silence
@pytest.mark.filterwarnings("ignore:unclosed transport:ResourceWarning")
def test_reset_after_the_loop_closed_closes_its_sockets(
    srv: EmbeddingServer, wait_until: Callable[..., None], noise: Callable[[], list[str]]
) -> None:
    client = q.AsyncEmbeddingClient(base_url=srv.base_url)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(client.embed_documents(TEXTS))
    finally:
        loop.close()  # without shutdown_asyncgens: its pool is still registered
    q.reset()
    wait_until(lambda: srv.connections_active == 0, "the closed loop's sockets closed")
    assert q.pool_stats() == {}
    assert len(asyncio.run(client.embed_query("after"))) == srv.dim
    wait_until(lambda: srv.connections_active == 0, "asyncio.run's pool closed")
    assert noise() == []


def test_reset_between_module_server_tests_keeps_the_server_usable(srv: EmbeddingServer) -> None:
    client = q.EmbeddingClient(base_url=srv.base_url)
    for _ in range(3):
        assert len(client.embed_query("again")) == srv.dim
        q.reset()
    assert srv.requests == 3
