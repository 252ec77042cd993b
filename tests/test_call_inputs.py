"""Issue 20, cases 7, 8 and 9: what a call does with its inputs before anything is sent.

* Empty batches return ``[]`` (arrays: ``(0, dim)`` when the size is known without asking
  the server, else ``(0, 0)``) without a request, on every path: the core clients (sync,
  async, list, array, queries), LangChain, LlamaIndex and a real LlamaIndex
  ``IngestionPipeline`` with a docstore run twice over unchanged documents.
* ``on_error="skip"`` covers texts refused before sending (empty, whitespace-only, too
  long for ``max_text_chars``, not a str): ``None`` in their slot, the error by index,
  the other texts embedded.
* The default query instruction goes only to Qwen3-Embedding models (by name: hub
  names, server paths, Ollama tags); other models get raw queries unless
  ``query_instruction`` is set; the choice is logged once per model at INFO. Checked on
  what the server received.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import llama_index.core
import numpy as np
import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins import _protocol as protocol
from qwen_embed_tooling.testing import EmbeddingServer, expected_embedding, expected_embeddings

QWEN = "Qwen/Qwen3-Embedding-0.6B"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(autouse=True)
def _tiktoken_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """LlamaIndex's splitters load tiktoken's cl100k_base from the copy LlamaIndex ships
    (REAL-SERVERS.md: offline, TIKTOKEN_CACHE_DIR must point at it)."""
    folder = Path(llama_index.core.__file__).parent / "_static" / "tiktoken_cache"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(folder))


# --------------------------------------------------------------------------- empty batches


@pytest.mark.parametrize(
    ("model", "dimensions", "dim"),
    [(QWEN, None, 1024), (QWEN, 256, 256), ("acme/house-embedder", None, 0)],
)
def test_empty_batches_sync_and_async_send_nothing(
    srv: EmbeddingServer, model: str, dimensions: int | None, dim: int
) -> None:
    kw: dict[str, Any] = {"base_url": srv.base_url, "model": model, "dimensions": dimensions}
    client = q.EmbeddingClient(**kw)
    aclient = q.AsyncEmbeddingClient(**kw)
    assert client.embed_documents([]) == []
    assert client.embed_documents(iter([])) == []
    assert client.embed_queries([]) == []
    skipped = client.embed_documents([], on_error="skip")
    assert isinstance(skipped, q.EmbeddingList)
    assert skipped == []
    assert skipped.errors == {}
    arr = client.embed_documents_array([])
    assert arr.shape == (0, dim)
    assert arr.dtype == np.float32
    result = client.embed_documents_array((), on_error="skip")
    assert result.vectors.shape == (0, dim)
    assert result.errors == {}
    assert len(result.ok) == 0

    async def run() -> list[Any]:
        return [
            await aclient.embed_documents([]),
            await aclient.embed_queries([]),
            await aclient.embed_documents([], on_error="skip"),
            await aclient.embed_documents_array([]),
            await aclient.embed_documents_array([], on_error="skip"),
        ]

    docs, queries, askipped, aarr, aresult = asyncio.run(run())
    assert docs == []
    assert queries == []
    assert askipped == []
    assert askipped.errors == {}
    assert aarr.shape == (0, dim)
    assert aresult.vectors.shape == (0, dim)
    assert srv.requests == 0


def test_empty_batches_in_langchain(srv: EmbeddingServer) -> None:
    from qwen_embed_plugins import QwenPooledEmbeddings

    emb = QwenPooledEmbeddings(base_url=srv.base_url)
    assert emb.embed_documents([]) == []
    assert asyncio.run(emb.aembed_documents([])) == []
    assert srv.requests == 0


def test_empty_batches_in_llama_index(srv: EmbeddingServer) -> None:
    from qwen_embed_plugins import QwenPooledEmbedding

    emb = QwenPooledEmbedding(base_url=srv.base_url)
    assert emb.get_text_embedding_batch([]) == []
    assert asyncio.run(emb.aget_text_embedding_batch([])) == []
    assert srv.requests == 0


@pytest.mark.parametrize("run_async", [False, True])
def test_ingestion_pipeline_with_docstore_runs_twice_and_on_nothing(
    srv: EmbeddingServer, run_async: bool
) -> None:
    """The second run over unchanged documents embeds nothing (the docstore has them):
    LlamaIndex calls the embed model with an empty list, which must give ``[]``."""
    from llama_index.core import Document
    from llama_index.core.ingestion import DocstoreStrategy, IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.storage.docstore import SimpleDocumentStore

    from qwen_embed_plugins import QwenPooledEmbedding

    pipeline = IngestionPipeline(
        transformations=[
            SentenceSplitter(chunk_size=64, chunk_overlap=0),
            QwenPooledEmbedding(base_url=srv.base_url, embed_batch_size=4),
        ],
        docstore=SimpleDocumentStore(),
        docstore_strategy=DocstoreStrategy.DUPLICATES_ONLY,  # no vector store here
    )
    documents = [
        Document(text=f"Document {i}. " + "A sentence about the sea. " * 20, id_=f"doc-{i}")
        for i in range(3)
    ]

    def run(docs: list[Any]) -> list[Any]:
        if run_async:
            return asyncio.run(pipeline.arun(documents=docs))
        return pipeline.run(documents=docs)

    first = run(documents)
    assert first
    assert all(len(node.embedding) == 1024 for node in first)
    sent, requests = srv.texts, srv.requests
    assert 0 < sent <= len(first)  # identical chunks are sent once
    assert run(documents) == []  # unchanged: nothing to embed
    assert run([]) == []
    assert (srv.texts, srv.requests) == (sent, requests)  # nothing more was sent


# --------------------------------------------------------------------------- skip before sending


BAD = {1: "", 3: "   \n\t", 5: "x" * 2_000, 6: None}


def _mixed() -> list[Any]:
    texts: list[Any] = [f"good text {i}" for i in range(8)]
    for index, bad in BAD.items():
        texts[index] = bad
    return texts


def _check_skipped(rows: list[Any], errors: dict[int, Any], texts: list[Any]) -> None:
    assert sorted(errors) == sorted(BAD)
    for index, err in errors.items():
        assert isinstance(err, q.InputError)
        assert err.index == index
        assert f"index {index}" in str(err)
        assert rows[index] is None
    good = [i for i in range(len(texts)) if i not in BAD]
    np.testing.assert_array_equal(
        np.asarray([rows[i] for i in good], dtype=np.float32),
        expected_embeddings([texts[i] for i in good]),
    )


def test_skip_covers_inputs_refused_before_sending_sync(
    srv: EmbeddingServer, caplog: pytest.LogCaptureFixture
) -> None:
    client = q.EmbeddingClient(base_url=srv.base_url, max_text_chars=1_000, batch_size=2)
    texts = _mixed()
    with caplog.at_level(logging.WARNING, logger="qwen_embed_plugins"):
        result = client.embed_documents(texts, on_error="skip")
    _check_skipped(list(result), result.errors, texts)
    assert sum("cannot be sent" in r.getMessage() for r in caplog.records) == 1
    assert sorted(t for batch in srv.received for t in batch) == sorted(
        t for i, t in enumerate(texts) if i not in BAD
    )
    arr = client.embed_documents_array(texts, on_error="skip")
    assert arr.vectors.shape == (8, 1024)
    assert list(np.flatnonzero(~arr.ok)) == sorted(BAD)
    assert np.isnan(arr.vectors[sorted(BAD)]).all()
    _check_skipped(
        [None if not ok else row for ok, row in zip(arr.ok, arr.vectors, strict=True)],
        arr.errors,
        texts,
    )
    # "raise" still refuses the call before anything is sent, naming the first index
    srv.reset_counters()
    with pytest.raises(q.InputError) as info:
        client.embed_documents(texts)
    assert info.value.index == 1
    assert srv.requests == 0


def test_skip_with_every_input_refused_and_with_server_failures(srv: EmbeddingServer) -> None:
    client = q.EmbeddingClient(base_url=srv.base_url, batch_size=2)
    result = client.embed_documents(["", " "], on_error="skip")
    assert list(result) == [None, None]
    assert sorted(result.errors) == [0, 1]
    arr = client.embed_documents_array(["", " "], on_error="skip")
    assert arr.vectors.shape == (2, 1024)
    assert not arr.ok.any()
    assert srv.requests == 0
    # a text the server refuses, after one refused before sending: both by their index
    srv.poison("poisoned text")
    texts = ["fine a", "", "poisoned text", "fine b", "fine a"]
    result = client.embed_documents(texts, on_error="skip")
    assert sorted(result.errors) == [1, 2]
    assert result.errors[2].index == 2
    assert "index 2" in str(result.errors[2])
    assert isinstance(result.errors[1], q.InputError)
    assert result[0] == result[4] == expected_embedding("fine a").tolist()
    assert result[3] == expected_embedding("fine b").tolist()


def test_skip_covers_inputs_refused_before_sending_async(srv: EmbeddingServer) -> None:
    client = q.AsyncEmbeddingClient(base_url=srv.base_url, max_text_chars=1_000, batch_size=2)
    texts = _mixed()

    async def run() -> tuple[Any, Any]:
        return (
            await client.embed_documents(texts, on_error="skip"),
            await client.embed_documents_array(texts, on_error="skip"),
        )

    result, arr = asyncio.run(run())
    _check_skipped(list(result), result.errors, texts)
    assert list(np.flatnonzero(~arr.ok)) == sorted(BAD)


# --------------------------------------------------------------------------- query instruction


@pytest.mark.parametrize(
    "model",
    [
        QWEN,
        "/models/Qwen3-Embedding-8B",
        "qwen3-embedding:8b",
        "dengcao/Qwen3-Embedding-4B:Q5_K_M",
        "Qwen3-Embedding-0.6B-Q8_0.gguf",
    ],
)
def test_qwen3_names_get_the_instruction(model: str) -> None:
    assert q.EmbeddingConfig(base_url="http://127.0.0.1:1/v1", model=model).query_task == (
        q.DEFAULT_QUERY_TASK
    )


@pytest.mark.parametrize(
    "model", [MINILM, "BAAI/bge-m3", "nomic-embed-text", "Qwen/Qwen3-8B", "text-embedding-3-small"]
)
def test_other_models_get_raw_queries(model: str) -> None:
    cfg = q.EmbeddingConfig(base_url="http://127.0.0.1:1/v1", model=model)
    assert cfg.query_instruction == "auto"
    assert cfg.query_task is None
    explicit = cfg.replace(query_instruction="Find the passage")
    assert explicit.query_task == "Find the passage"
    assert cfg.replace(model=QWEN).query_task == q.DEFAULT_QUERY_TASK  # resolved per model


def _received_query(srv: EmbeddingServer) -> str:
    (batch,) = srv.received[-1:]
    (text,) = batch
    return str(text)


@pytest.mark.parametrize(
    ("model", "setting", "sent"),
    [
        (QWEN, {}, f"Instruct: {q.DEFAULT_QUERY_TASK}\nQuery:who wrote it?"),
        (MINILM, {}, "who wrote it?"),
        (
            MINILM,
            {"query_instruction": "Find the author"},
            "Instruct: Find the author\nQuery:who wrote it?",
        ),
        (QWEN, {"query_instruction": None}, "who wrote it?"),
    ],
)
def test_what_the_server_receives_core_and_adapters(
    srv: EmbeddingServer, model: str, setting: dict[str, Any], sent: str
) -> None:
    from qwen_embed_plugins import QwenPooledEmbedding, QwenPooledEmbeddings

    query = "who wrote it?"
    client = q.EmbeddingClient(base_url=srv.base_url, model=model, **setting)
    aclient = q.AsyncEmbeddingClient(base_url=srv.base_url, model=model, **setting)
    langchain = QwenPooledEmbeddings(base_url=srv.base_url, model=model, **setting)
    llama = QwenPooledEmbedding(base_url=srv.base_url, model_name=model, **setting)
    calls = [
        lambda: client.embed_query(query),
        lambda: client.embed_queries([query])[0],
        lambda: asyncio.run(aclient.embed_query(query)),
        lambda: langchain.embed_query(query),
        lambda: asyncio.run(langchain.aembed_query(query)),
        lambda: llama.get_query_embedding(query),
        lambda: asyncio.run(llama.aget_query_embedding(query)),
    ]
    for call in calls:
        vector = call()
        assert _received_query(srv) == sent
        np.testing.assert_array_equal(
            np.asarray(vector, dtype=np.float32), expected_embedding(sent)
        )
    # documents are always raw
    client.embed_documents([query])
    assert _received_query(srv) == query


def test_the_choice_is_logged_once_per_model(caplog: pytest.LogCaptureFixture) -> None:
    models = ["acme/once-embedder", "/srv/models/Qwen3-Embedding-4B"]
    for model in models:
        protocol._instruction_logged.discard(model)
    with caplog.at_level(logging.INFO, logger="qwen_embed_plugins"):
        for _ in range(3):
            for model in models:
                cfg = q.EmbeddingConfig(base_url="http://127.0.0.1:1/v1", model=model)
                cfg.query_task  # noqa: B018 - resolving it must not log again
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    raw = [line for line in lines if "acme/once-embedder" in line]
    qwen = [line for line in lines if "Qwen3-Embedding-4B" in line]
    assert len(raw) == 1
    assert "raw" in raw[0]
    assert len(qwen) == 1
    assert "Instruct:" in qwen[0]
    # an explicit instruction is no choice to log
    protocol._instruction_logged.discard("acme/explicit")
    with caplog.at_level(logging.INFO, logger="qwen_embed_plugins"):
        q.EmbeddingConfig(
            base_url="http://127.0.0.1:1/v1", model="acme/explicit", query_instruction=None
        )
    assert not any("acme/explicit" in r.getMessage() for r in caplog.records)
