"""The embedding caches users already use keep working over the adapters.

LangChain ``CacheBackedEmbeddings`` (``langchain-classic``) over `QwenPooledEmbeddings`,
with an ``InMemoryByteStore`` and a ``LocalFileStore``; LlamaIndex ``IngestionPipeline``
with an ``IngestionCache`` over `QwenPooledEmbedding`. A second run of the same documents
sends 0 requests to the loopback server (its own request counter); queries are sent each
time unless a query cache is asked for.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qwen_embed_plugins import DEFAULT_QUERY_TASK, format_query
from qwen_embed_tooling.testing import EmbeddingServer, expected_embedding, expected_embeddings

if os.environ.get("CI"):  # CI installs the test extra: a missing package must fail there
    import langchain_classic  # noqa: F401
else:
    pytest.importorskip("langchain_classic", reason="needs langchain-classic")

pytest.importorskip("llama_index.core")  # the llama-index extra (part of the test extra)

DOCS = [f"document {i}: " + "the quick brown fox " * (1 + i % 4) for i in range(100)]


def _query_vector(text: str, dim: int) -> np.ndarray:
    return expected_embedding(format_query(text, DEFAULT_QUERY_TASK), dim)


# ----------------------------------------------------------------------------- LangChain


def _lc_cached(srv: EmbeddingServer, store: Any, **kwargs: Any) -> Any:
    from langchain_classic.embeddings import CacheBackedEmbeddings

    from qwen_embed_plugins import QwenPooledEmbeddings

    underlying = QwenPooledEmbeddings(base_url=srv.base_url, batch_size=16)
    # sha256 keys: LangChain's default sha1 encoder warns (and is not collision-resistant).
    return CacheBackedEmbeddings.from_bytes_store(
        underlying, store, namespace=underlying.model, key_encoder="sha256", **kwargs
    )


def test_langchain_in_memory_store_second_run_sends_nothing(srv: EmbeddingServer) -> None:
    from langchain_core.stores import InMemoryByteStore

    embedder = _lc_cached(srv, InMemoryByteStore())
    first = embedder.embed_documents(DOCS)
    assert srv.requests == 7  # 100 texts in requests of 16
    second = embedder.embed_documents(DOCS)
    assert srv.requests == 7  # all from the cache
    np.testing.assert_array_equal(np.asarray(first, dtype=np.float32), expected_embeddings(DOCS))
    assert second == first


async def test_langchain_file_store_survives_a_new_process_worth_of_objects(
    srv: EmbeddingServer, tmp_path: Path
) -> None:
    from langchain_classic.storage import LocalFileStore

    first = await _lc_cached(srv, LocalFileStore(tmp_path)).aembed_documents(DOCS)
    sent = srv.requests
    assert sent == 7
    # New adapter, new store object on the same folder: what a second run of a script sees.
    again = _lc_cached(srv, LocalFileStore(tmp_path))
    assert again.embed_documents(DOCS) == first
    assert await again.aembed_documents(DOCS[:10]) == first[:10]
    assert srv.requests == sent
    # A new document costs one request; the cached ones none.
    more = again.embed_documents([*DOCS[:50], "a brand new document"])
    assert srv.requests == sent + 1
    np.testing.assert_array_equal(
        np.asarray(more[-1], dtype=np.float32), expected_embedding("a brand new document")
    )


def test_langchain_queries_are_sent_each_time_by_default(srv: EmbeddingServer) -> None:
    from langchain_core.stores import InMemoryByteStore

    embedder = _lc_cached(srv, InMemoryByteStore())
    one = embedder.embed_query("where is the fox?")
    two = embedder.embed_query("where is the fox?")
    assert srv.requests == 2
    assert one == two
    np.testing.assert_array_equal(
        np.asarray(one, dtype=np.float32), _query_vector("where is the fox?", srv.dim)
    )


async def test_langchain_query_cache_when_asked_in_its_own_store(
    srv: EmbeddingServer,
) -> None:
    from langchain_core.stores import InMemoryByteStore

    embedder = _lc_cached(srv, InMemoryByteStore(), query_embedding_cache=InMemoryByteStore())
    embedder.embed_documents(["where is the fox?"])  # a document with the query's text
    assert srv.requests == 1
    first = embedder.embed_query("where is the fox?")
    again = await embedder.aembed_query("where is the fox?")
    assert srv.requests == 2  # the query sent once, then served from its cache
    assert again == first
    # Its own store: the query vector (with the Qwen instruction), not the document's.
    np.testing.assert_array_equal(
        np.asarray(first, dtype=np.float32), _query_vector("where is the fox?", srv.dim)
    )


def test_langchain_query_cache_true_shares_keys_with_documents(srv: EmbeddingServer) -> None:
    """The pitfall the docs warn about: ``query_embedding_cache=True`` reuses the document
    store with the same keys, so a query whose text was embedded as a document gets the
    document's vector (no Qwen query instruction). Give queries their own store."""
    from langchain_core.stores import InMemoryByteStore

    embedder = _lc_cached(srv, InMemoryByteStore(), query_embedding_cache=True)
    embedder.embed_documents(["where is the fox?"])
    vector = embedder.embed_query("where is the fox?")
    assert srv.requests == 1  # the query was never sent
    np.testing.assert_array_equal(
        np.asarray(vector, dtype=np.float32), expected_embedding("where is the fox?")
    )


# ----------------------------------------------------------------------------- LlamaIndex


@pytest.fixture
def offline_tiktoken(monkeypatch: pytest.MonkeyPatch) -> None:
    """LlamaIndex's splitters count tokens with tiktoken; point it at the copy LlamaIndex
    ships (no download on this offline machine)."""
    import llama_index.core

    folder = Path(llama_index.core.__file__).parent / "_static" / "tiktoken_cache"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(folder))


def _pipeline(srv: EmbeddingServer, cache: Any) -> Any:
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter

    from qwen_embed_plugins import QwenPooledEmbedding

    embed = QwenPooledEmbedding(base_url=srv.base_url, embed_batch_size=16)
    return IngestionPipeline(
        transformations=[SentenceSplitter(chunk_size=64, chunk_overlap=0), embed], cache=cache
    )


def _documents() -> list[Any]:
    from llama_index.core import Document

    return [Document(text=t, id_=f"doc-{i}") for i, t in enumerate(DOCS)]


@pytest.mark.usefixtures("offline_tiktoken")
def test_llama_index_ingestion_cache_second_run_sends_nothing(
    srv: EmbeddingServer, tmp_path: Path
) -> None:
    from llama_index.core.ingestion import IngestionCache

    pipeline = _pipeline(srv, IngestionCache())
    nodes = pipeline.run(documents=_documents())
    sent = srv.requests
    assert sent == -(-len(nodes) // 16)  # ceil(nodes / 16) requests, one per batch
    texts = [n.get_content(metadata_mode="embed") for n in nodes]
    np.testing.assert_array_equal(
        np.asarray([n.embedding for n in nodes], dtype=np.float32), expected_embeddings(texts)
    )
    again = pipeline.run(documents=_documents())
    assert srv.requests == sent
    assert [n.embedding for n in again] == [n.embedding for n in nodes]
    # Persisted and loaded by a new pipeline with a new adapter: still no request.
    pipeline.persist(str(tmp_path))
    fresh = _pipeline(srv, IngestionCache())
    fresh.load(str(tmp_path))
    reloaded = fresh.run(documents=_documents())
    assert srv.requests == sent
    assert [n.embedding for n in reloaded] == [n.embedding for n in nodes]


@pytest.mark.usefixtures("offline_tiktoken")
async def test_llama_index_ingestion_cache_async_run(srv: EmbeddingServer) -> None:
    from llama_index.core.ingestion import IngestionCache

    pipeline = _pipeline(srv, IngestionCache())
    nodes = await pipeline.arun(documents=_documents())
    sent = srv.requests
    assert sent > 0
    again = await pipeline.arun(documents=_documents())
    assert srv.requests == sent
    assert [n.embedding for n in again] == [n.embedding for n in nodes]


def test_llama_index_queries_are_sent_each_time_by_default(srv: EmbeddingServer) -> None:
    from qwen_embed_plugins import QwenPooledEmbedding

    embed = QwenPooledEmbedding(base_url=srv.base_url)
    one = embed.get_query_embedding("where is the fox?")
    two = embed.get_query_embedding("where is the fox?")
    assert srv.requests == 2
    assert one == two
    np.testing.assert_array_equal(
        np.asarray(one, dtype=np.float32), _query_vector("where is the fox?", srv.dim)
    )


def test_llama_index_embeddings_cache_when_asked(srv: EmbeddingServer) -> None:
    from llama_index.core.storage.kvstore import SimpleKVStore

    from qwen_embed_plugins import QwenPooledEmbedding

    embed = QwenPooledEmbedding(base_url=srv.base_url, embeddings_cache=SimpleKVStore())
    first = embed.get_query_embedding("where is the fox?")
    again = embed.get_query_embedding("where is the fox?")
    assert srv.requests == 1
    assert again == first
    np.testing.assert_array_equal(
        np.asarray(first, dtype=np.float32), _query_vector("where is the fox?", srv.dim)
    )


def test_llama_index_embeddings_cache_keeps_queries_apart_from_documents(
    srv: EmbeddingServer,
) -> None:
    from llama_index.core.storage.kvstore import SimpleKVStore

    from qwen_embed_plugins import QwenPooledEmbedding

    embed = QwenPooledEmbedding(base_url=srv.base_url, embeddings_cache=SimpleKVStore())
    embed.get_text_embedding("where is the fox?")
    query = embed.get_query_embedding("where is the fox?")
    np.testing.assert_array_equal(
        np.asarray(query, dtype=np.float32), _query_vector("where is the fox?", srv.dim)
    )
