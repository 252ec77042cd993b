"""``QwenPooledEmbeddings`` (LangChain) against the real loopback ``EmbeddingServer``.

The server's vectors are deterministic stand-ins (SHAKE-256 of the exact text sent), so
a retrieval hit is asserted with a query equal to a document's text and
``query_instruction=None``; the instruction itself is checked on the wire.
"""

from __future__ import annotations

import asyncio
import copy
import json
import multiprocessing
import os
import pickle
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from pydantic import SecretStr, ValidationError

import qwen_embed_plugins as q
from qwen_embed_plugins.integrations.langchain import QwenPooledEmbeddings
from qwen_embed_tooling.testing import EmbeddingServer, expected_embedding, expected_embeddings

DOCS_MD = Path(__file__).resolve().parent.parent / "docs" / "langchain.md"
SECRET = "sk-test-0123456789abcdef"

CORPUS = [
    "Qwen3-Embedding maps text to 1024-dimensional vectors.",
    "uvicorn closes idle keep-alive connections after five seconds.",
    "HTTP/2 multiplexes many requests over one TCP connection.",
    "A circuit breaker fails fast when an endpoint keeps failing.",
    "Matryoshka embeddings can be truncated to fewer dimensions.",
    "LangChain retrievers return the documents closest to a query.",
]


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("QWEN_EMBED_API_KEY", "QWEN_EMBED_BASE_URL", "QWEN_EMBED_MODEL"):
        monkeypatch.delenv(name, raising=False)


def query_text(text: str) -> str:
    return q.format_query(text, q.DEFAULT_QUERY_TASK)


def opened(label: str) -> int:
    row = q.pool_stats().get(label)
    return 0 if row is None else int(row["connections_opened"])


# ----------------------------------------------------------------------------- basics


def test_vectors_and_instruction_on_the_wire(srv: EmbeddingServer) -> None:
    emb = QwenPooledEmbeddings(base_url=srv.base_url, batch_size=2, max_concurrency=1)
    docs = emb.embed_documents(CORPUS[:3])
    query = emb.embed_query("how long do idle connections live?")
    assert len(docs) == 3
    assert all(len(v) == 1024 for v in docs)
    assert all(isinstance(x, float) for x in docs[0])
    np.testing.assert_allclose(docs, expected_embeddings(CORPUS[:3]), rtol=0, atol=1e-6)
    np.testing.assert_allclose(
        query, expected_embedding(query_text("how long do idle connections live?")), atol=1e-6
    )
    # documents raw in batches of 2, the query with Qwen's instruction (no space after
    # "Query:")
    assert srv.received == [
        CORPUS[0:2],
        CORPUS[2:3],
        [
            "Instruct: Given a web search query, retrieve relevant passages that answer "
            "the query\nQuery:how long do idle connections live?"
        ],
    ]


async def test_async_is_native_and_matches_sync(srv: EmbeddingServer) -> None:
    emb = QwenPooledEmbeddings(base_url=srv.base_url, batch_size=2, max_concurrency=3)
    label = emb.config.endpoint
    docs = await emb.aembed_documents(CORPUS)
    query = await emb.aembed_query("async query")
    np.testing.assert_allclose(docs, expected_embeddings(CORPUS), atol=1e-6)
    np.testing.assert_allclose(query, expected_embedding(query_text("async query")), atol=1e-6)
    assert srv.requests == 4  # 3 batches + 1 query
    # served by this event loop's pooled async client, not a thread running sync code
    assert q.pool_stats()[label]["async_clients"] >= 1


def test_empty_input_sends_nothing(srv: EmbeddingServer) -> None:
    emb = QwenPooledEmbeddings(base_url=srv.base_url)
    assert emb.embed_documents([]) == []
    assert asyncio.run(emb.aembed_documents([])) == []
    assert srv.requests == 0


def test_invalid_text_raises_input_error_before_sending(srv: EmbeddingServer) -> None:
    emb = QwenPooledEmbeddings(base_url=srv.base_url)
    with pytest.raises(q.InputError) as info:
        emb.embed_documents(["fine", "   "])
    assert info.value.index == 1
    assert srv.requests == 0


def test_iterables_accepted_and_non_collections_rejected(srv: EmbeddingServer) -> None:
    """A generator is embedded like a list (it has no len(): it used to raise a bare
    TypeError); None or a number is an InputError naming the type; nothing is sent."""
    emb = QwenPooledEmbeddings(base_url=srv.base_url)
    for bad, words in ((None, "got None"), (5, "got int")):
        with pytest.raises(q.InputError, match=words):
            emb.embed_documents(bad)  # type: ignore[arg-type]
        with pytest.raises(q.InputError, match=words):
            asyncio.run(emb.aembed_documents(bad))  # type: ignore[arg-type]
    assert srv.requests == 0
    texts = ["first text", "second text"]
    want = emb.embed_documents(texts)
    assert emb.embed_documents(t for t in texts) == want  # type: ignore[arg-type]
    assert asyncio.run(emb.aembed_documents(iter(texts))) == want  # type: ignore[arg-type]
    assert emb.embed_documents(t for t in []) == []  # type: ignore[arg-type]


def test_dimensions_and_model_copy_update(srv: EmbeddingServer) -> None:
    emb = QwenPooledEmbeddings(base_url=srv.base_url)
    assert len(emb.embed_query("x")) == 1024
    # the server refuses `dimensions` (no matryoshka): the core slices client-side
    short = emb.model_copy(update={"dimensions": 64})
    assert short._cache is not emb._cache  # each keeps its own client cache
    vec = short.embed_documents(["sliced"])[0]
    assert len(vec) == 64
    np.testing.assert_allclose(np.linalg.norm(vec), 1.0, atol=1e-5)
    assert short.config.dimensions == 64
    assert emb.config.dimensions is None
    # plain assignment is picked up too
    emb.batch_size = 1
    emb.embed_documents(["a", "b"])
    assert sorted(srv.received[-2:]) == [["a"], ["b"]]  # concurrent: any order


# ------------------------------------------------------------------ fields and config


@pytest.mark.unit
def test_every_field_is_documented_with_its_unit_or_values() -> None:
    fields = QwenPooledEmbeddings.model_fields
    assert QwenPooledEmbeddings.model_config.get("extra") == "forbid"
    for name, info in fields.items():
        assert info.description, f"field {name} has no docstring"
    units = {
        "batch_size": "texts",
        "max_concurrency": "flight",
        "max_connections": "connections",
        "keepalive_expiry": "seconds",
        "connect_timeout": "seconds",
        "read_timeout": "seconds",
        "write_timeout": "seconds",
        "pool_timeout": "seconds",
        "dimensions": "dimensions",
        "max_text_chars": "characters",
    }
    for name, unit in units.items():
        assert unit in str(fields[name].description).lower(), (name, fields[name].description)
    doc = QwenPooledEmbeddings.__doc__ or ""
    for section in (
        "Setup:",
        "Key init args",
        "Instantiate:",
        "Embed single text:",
        "Embed multiple texts:",
        "Async:",
    ):
        assert section in doc
    assert "__SAMPLE" not in doc  # the sample output was filled in


@pytest.mark.unit
def test_defaults_are_the_core_defaults() -> None:
    emb = QwenPooledEmbeddings(base_url="http://127.0.0.1:9/v1")
    assert emb.config == q.EmbeddingConfig(base_url="http://127.0.0.1:9/v1", api_key=None)


@pytest.mark.unit
def test_fields_map_one_to_one_onto_the_core_config(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not read until a TLS connection is made")
    emb = QwenPooledEmbeddings(
        base_url="https://gpu-box.invalid:30000/v1/",
        api_key=SECRET,
        model="Qwen/Qwen3-Embedding-4B",
        dimensions=512,
        query_instruction="Given a question, retrieve code",
        batch_size=16,
        max_concurrency=2,
        encoding_format="float",
        normalize=False,
        max_text_chars=1000,
        connect_timeout=1.0,
        read_timeout=None,
        write_timeout=3.0,
        pool_timeout=4.0,
        max_retries=0,
        max_connections=7,
        max_keepalive_connections=3,
        keepalive_expiry=2.5,
        http2=True,
        verify=str(ca),
    )
    assert emb.config == q.EmbeddingConfig(
        base_url="https://gpu-box.invalid:30000/v1",
        api_key=SECRET,
        model="Qwen/Qwen3-Embedding-4B",
        dimensions=512,
        query_instruction="Given a question, retrieve code",
        batch_size=16,
        max_concurrency=2,
        encoding_format="float",
        normalize=False,
        max_text_chars=1000,
        timeout=q.Timeouts(connect=1.0, read=None, write=3.0, pool=4.0),
        limits=q.Limits(max_connections=7, max_keepalive_connections=3, keepalive_expiry=2.5),
        http2=True,
        verify=str(ca),
        retry=q.RetryConfig(max_retries=0),
    )


@pytest.mark.unit
def test_env_fallbacks_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="QWEN_EMBED_BASE_URL"):
        QwenPooledEmbeddings()
    monkeypatch.setenv("QWEN_EMBED_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("QWEN_EMBED_API_KEY", SECRET)
    emb = QwenPooledEmbeddings()
    assert emb.base_url == "http://127.0.0.1:9/v1"
    assert isinstance(emb.api_key, SecretStr)
    assert emb.api_key.get_secret_value() == SECRET
    with pytest.raises(ValidationError, match="did you mean 'chunk_size'"):
        QwenPooledEmbeddings(chunk_sise=10)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match=r"batch_size must be in \[1, 2048\]"):
        QwenPooledEmbeddings(batch_size=0)
    with pytest.raises(ValidationError, match="max_connections"):
        QwenPooledEmbeddings(max_connections=0)


@pytest.mark.unit
def test_the_key_never_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    emb = QwenPooledEmbeddings(base_url="http://127.0.0.1:9/v1", api_key=SECRET)
    assert emb.api_key is not None
    assert emb.api_key.get_secret_value() == SECRET
    assert SECRET not in repr(emb)
    assert SECRET not in str(emb)
    # model_dump() keeps the SecretStr object (masked when printed), JSON dumps mask it
    dumped = emb.model_dump()
    assert isinstance(dumped["api_key"], SecretStr)
    assert SECRET not in str(dumped)
    assert emb.model_dump(mode="json")["api_key"] == "**********"
    assert SECRET not in emb.model_dump_json()
    assert SECRET not in repr(emb.config)
    assert SECRET.encode() not in pickle.dumps(emb)
    assert SECRET.encode() not in pickle.dumps(emb, protocol=0)
    # a validation error does not echo the inputs (which hold the key)
    with pytest.raises(ValidationError) as info:
        QwenPooledEmbeddings(base_url="http://127.0.0.1:9/v1", api_key=SECRET, batch_size=0)
    assert SECRET not in str(info.value)
    assert SECRET not in repr(info.value.errors())
    assert SECRET not in info.value.json()


# ------------------------------------------------------------ pool sharing and copies


def test_constructing_opens_nothing_and_instances_share_one_pool() -> None:
    with EmbeddingServer() as srv:  # its own port: a pool no other test touched
        _share_one_pool(srv)


def _share_one_pool(srv: EmbeddingServer) -> None:
    label = q.EmbeddingConfig(base_url=srv.base_url).endpoint
    before = opened(label)
    instances = [
        QwenPooledEmbeddings(
            base_url=srv.base_url, batch_size=1 + i, model=f"model-{i % 3}", max_concurrency=1
        )
        for i in range(10)
    ]
    assert srv.connections_opened == 0
    assert opened(label) == before
    # different batching and model settings, the same transport: one pool key
    assert len({e.config.pool_key for e in instances}) == 1
    for e in instances:
        e.embed_documents(["shared", "pool"])
    assert srv.requests == 10 + 1  # batch_size 1 sends 2 requests, the others 1
    # sequential calls from ten instances reuse one keep-alive connection
    assert srv.connections_opened == 1
    assert opened(label) - before == 1
    assert q.pool_stats()[label]["sync_clients"] == 1


def test_deepcopy_and_pickle_keep_fields_and_reattach(
    srv: EmbeddingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    emb = QwenPooledEmbeddings(base_url=srv.base_url, api_key=SECRET, batch_size=3)
    emb.embed_documents(["warm"])  # clients built and a connection open
    warm = srv.connections_opened  # 0 or 1: the pool may hold one from an earlier test

    clone = copy.deepcopy(emb)
    assert clone == emb
    assert clone is not emb
    assert clone.api_key is not None
    assert clone.api_key.get_secret_value() == SECRET
    assert clone.config.pool_key == emb.config.pool_key  # same pool in this process
    assert clone.embed_documents(["warm"]) == emb.embed_documents(["warm"])
    assert srv.connections_opened == warm  # the copy reused the shared connection

    # unpickled in this process: the key given, found here (it never travelled: the
    # pickle holds a token); whatever QWEN_EMBED_API_KEY says (once no instance holds
    # the key, as in another process, it is read from there: tests/test_adapters.py)
    data = pickle.dumps(emb)
    assert SECRET.encode() not in data
    restored = pickle.loads(data)
    assert restored.api_key is not None
    assert restored.api_key.get_secret_value() == SECRET
    assert restored.batch_size == 3
    assert restored.base_url == srv.base_url
    monkeypatch.setenv("QWEN_EMBED_API_KEY", "sk-worker-env")
    restored = pickle.loads(pickle.dumps(emb))
    assert restored.api_key is not None
    assert restored.api_key.get_secret_value() == SECRET
    # an instance without a key stays without one
    keyless = QwenPooledEmbeddings(base_url=srv.base_url, api_key=None)
    assert pickle.loads(pickle.dumps(keyless)).api_key is None
    np.testing.assert_allclose(
        restored.embed_documents(["after pickle"]),
        expected_embeddings(["after pickle"]),
        atol=1e-6,
    )


def test_api_key_reaches_a_protected_server(monkeypatch: pytest.MonkeyPatch) -> None:
    with EmbeddingServer(api_key=SECRET) as protected:
        monkeypatch.setenv("QWEN_EMBED_API_KEY", SECRET)
        emb = QwenPooledEmbeddings(base_url=protected.base_url)  # key from the environment
        assert len(emb.embed_query("authorised")) == 1024
        denied = QwenPooledEmbeddings(base_url=protected.base_url, api_key="sk-wrong")
        with pytest.raises(q.AuthenticationError) as info:
            denied.embed_query("refused")
        assert "sk-wrong" not in str(info.value)
        assert SECRET not in str(info.value)


def test_asyncio_run_twice_on_one_instance(srv: EmbeddingServer) -> None:
    emb = QwenPooledEmbeddings(base_url=srv.base_url, batch_size=2)
    label = emb.config.endpoint
    first = asyncio.run(emb.aembed_documents(CORPUS[:4]))
    second = asyncio.run(emb.aembed_documents(CORPUS[:4]))
    third = asyncio.run(emb.aembed_query("again"))
    assert first == second
    np.testing.assert_allclose(first, expected_embeddings(CORPUS[:4]), atol=1e-6)
    np.testing.assert_allclose(third, expected_embedding(query_text("again")), atol=1e-6)
    # each loop's client was closed with its loop: none left behind
    assert q.pool_stats()[label]["async_clients"] == 0


def _spawn_worker(payload: bytes) -> dict[str, Any]:
    """Runs in a spawned process: unpickle, embed sync and async, report back."""
    emb = pickle.loads(payload)
    docs = emb.embed_documents(["spawned one", "spawned two"])
    query = asyncio.run(emb.aembed_query("spawned query"))
    label = emb.config.endpoint
    return {
        "docs": docs,
        "query": query,
        "key": None if emb.api_key is None else emb.api_key.get_secret_value(),
        "pid": os.getpid(),
        "opened": q.pool_stats()[label]["connections_opened"],
    }


def test_pickled_instance_in_a_spawn_worker(
    srv: EmbeddingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    emb = QwenPooledEmbeddings(base_url=srv.base_url, api_key="sk-parent-only")
    emb.embed_documents(["parent warms its pool"])
    warm = srv.connections_opened  # 0 or 1: the pool may hold one from an earlier test
    payload = pickle.dumps(emb)
    assert b"sk-parent-only" not in payload
    monkeypatch.setenv("QWEN_EMBED_API_KEY", "sk-inherited")  # spawn children inherit it
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as workers:
        result = workers.apply(_spawn_worker, (payload,))
    assert result["pid"] != os.getpid()
    assert result["key"] == "sk-inherited"
    np.testing.assert_allclose(
        result["docs"], expected_embeddings(["spawned one", "spawned two"]), atol=1e-6
    )
    np.testing.assert_allclose(
        result["query"], expected_embedding(query_text("spawned query")), atol=1e-6
    )
    # the child built its own pool: its sync and async clients opened one socket each
    assert result["opened"] == 2
    assert srv.connections_opened == warm + 2


# ------------------------------------------------------------------------ progress


def _progress_frames(err: str, total: int) -> list[int]:
    return [int(n) for n in re.findall(rf"(\d+)/{total}\b", err)]


def test_progress_bar_advances_per_batch_sync(
    srv: EmbeddingServer, capsys: pytest.CaptureFixture[str]
) -> None:
    texts = [f"progress {i}" for i in range(10)]
    emb = QwenPooledEmbeddings(
        base_url=srv.base_url, batch_size=4, max_concurrency=1, show_progress=True
    )
    emb.embed_documents(texts)
    frames = _progress_frames(capsys.readouterr().err, 10)
    assert sorted(set(frames)) == [0, 4, 8, 10]
    assert frames[-1] == 10
    # no bar for queries, none when show_progress is off
    emb.embed_query("no bar")
    QwenPooledEmbeddings(base_url=srv.base_url).embed_documents(texts)
    assert "Embedding" not in capsys.readouterr().err


async def test_progress_bar_advances_per_batch_async(
    srv: EmbeddingServer, capsys: pytest.CaptureFixture[str]
) -> None:
    texts = [f"async progress {i}" for i in range(9)]
    emb = QwenPooledEmbeddings(
        base_url=srv.base_url, batch_size=3, max_concurrency=3, show_progress=True
    )
    await emb.aembed_documents(texts)
    err = capsys.readouterr().err
    assert "Embedding" in err
    # three batches finish in any order: 0, 3, 6, 9
    assert sorted(set(_progress_frames(err, 9))) == [0, 3, 6, 9]


@pytest.mark.unit
def test_show_progress_without_tqdm_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # makes the import fail
    from qwen_embed_plugins import _install_command

    command = _install_command("langchain")
    with pytest.raises(ImportError, match=re.escape(command)):
        QwenPooledEmbeddings(base_url="http://127.0.0.1:9/v1", show_progress=True)
    QwenPooledEmbeddings(base_url="http://127.0.0.1:9/v1")  # not needed without the bar


# ----------------------------------------------------------------- retrieval chains


def _format_docs(docs: list[Document]) -> str:
    return "\n\n".join(d.page_content for d in docs)


def _rag_chain(retriever: Any) -> Any:
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from this context:\n{context}"), ("human", "{question}")]
    )
    return {
        "context": retriever | RunnableLambda(_format_docs),
        "question": RunnablePassthrough(),
    } | prompt


def _documents() -> list[Document]:
    return [Document(page_content=t, metadata={"id": i}) for i, t in enumerate(CORPUS)]


async def test_retrieval_chain_in_memory_vector_store(srv: EmbeddingServer) -> None:
    # query_instruction=None: the stand-in server's vectors are hashes of the exact text
    # sent, so a query equal to a document's text is that document's nearest neighbour.
    emb = QwenPooledEmbeddings(base_url=srv.base_url, batch_size=4, query_instruction=None)
    store = await InMemoryVectorStore.afrom_documents(_documents(), emb)
    retriever = store.as_retriever(search_kwargs={"k": 1})
    chain = _rag_chain(retriever)

    target = CORPUS[3]
    value = chain.invoke(target)  # sync path
    system, human = value.to_messages()
    assert system.content == f"Answer from this context:\n{target}"
    assert human.content == target
    value = await chain.ainvoke(CORPUS[4])  # async path (aembed_query)
    assert value.to_messages()[0].content.endswith(CORPUS[4])
    hits = await retriever.ainvoke(CORPUS[1])
    assert [d.metadata["id"] for d in hits] == [1]


def test_retrieval_chain_qdrant_local_mode(srv: EmbeddingServer) -> None:
    from langchain_qdrant import QdrantVectorStore

    emb = QwenPooledEmbeddings(base_url=srv.base_url, batch_size=4, query_instruction=None)
    store = QdrantVectorStore.from_documents(
        _documents(), emb, location=":memory:", collection_name="qwen_docs"
    )
    try:
        retriever = store.as_retriever(search_kwargs={"k": 2})
        chain = _rag_chain(retriever)
        for i, target in enumerate(CORPUS):
            hits = retriever.invoke(target)
            assert hits[0].page_content == target
            assert hits[0].metadata["id"] == i
            # the nearest other document is far below an exact match
            assert len(hits) == 2
            assert hits[1].page_content != target
        context = chain.invoke(CORPUS[5]).to_messages()[0].content
        assert context.startswith(f"Answer from this context:\n{CORPUS[5]}\n\n")
        # langchain-qdrant embeds "dummy_text" to learn the vector size, then the
        # documents went raw in batches of 4 (any order); each query raw too
        assert srv.received[0] == ["dummy_text"]
        assert sorted(srv.received[1:3]) == sorted([CORPUS[:4], CORPUS[4:]])
        assert srv.received[3:] == [[t] for t in CORPUS] + [[CORPUS[5]]]
    finally:
        store.client.close()


def test_chain_sends_the_instruction_for_queries_only(srv: EmbeddingServer) -> None:
    emb = QwenPooledEmbeddings(base_url=srv.base_url, batch_size=10)  # default instruction
    store = InMemoryVectorStore.from_documents(_documents(), emb)
    chain = _rag_chain(store.as_retriever(search_kwargs={"k": 2}))
    chain.invoke("Which server closes idle connections?")
    assert srv.received == [
        CORPUS,  # documents: raw, one batch
        [
            "Instruct: Given a web search query, retrieve relevant passages that answer the "
            "query\nQuery:Which server closes idle connections?"
        ],
    ]
    # and the stored vectors are exactly the server's for the raw texts
    stored = [store.store[k]["vector"] for k in store.store]
    np.testing.assert_allclose(
        sorted(map(tuple, stored)), sorted(map(tuple, expected_embeddings(CORPUS))), atol=1e-6
    )


# ------------------------------------------------------- 20 instances x 500 documents


INSTANCES = 20
DOCS_EACH = 500
OUR_MAX_CONNECTIONS = 8


def _corpus(k: int) -> list[str]:
    return [f"instance {k} document {i}: some passage text" for i in range(DOCS_EACH)]


async def _ours(srv: EmbeddingServer) -> dict[str, Any]:
    instances = [
        QwenPooledEmbeddings(
            base_url=srv.base_url, batch_size=32, max_connections=OUR_MAX_CONNECTIONS
        )
        for _ in range(INSTANCES)
    ]
    label = instances[0].config.endpoint
    before = opened(label)
    srv.reset_counters()
    started = time.perf_counter()
    results = await asyncio.gather(
        *(e.aembed_documents(_corpus(k)) for k, e in enumerate(instances))
    )
    elapsed = time.perf_counter() - started
    for k in (0, INSTANCES - 1):  # spot-check values (all 10,000 cost too much to hash)
        np.testing.assert_allclose(results[k][:5], expected_embeddings(_corpus(k)[:5]), atol=1e-6)
    assert all(len(r) == DOCS_EACH for r in results)
    return {
        "server": srv.connections_opened,
        "pool_stats": opened(label) - before,
        "requests": srv.requests,
        "seconds": elapsed,
    }


async def _openai_embeddings(srv: EmbeddingServer) -> dict[str, Any]:
    from langchain_openai import OpenAIEmbeddings

    instances = [
        OpenAIEmbeddings(
            model=q.DEFAULT_MODEL,
            base_url=srv.base_url,
            api_key=SecretStr("x"),
            check_embedding_ctx_length=False,
            chunk_size=32,
        )
        for _ in range(INSTANCES)
    ]
    srv.reset_counters()
    started = time.perf_counter()
    try:
        results = await asyncio.gather(
            *(e.aembed_documents(_corpus(k)) for k, e in enumerate(instances))
        )
        elapsed = time.perf_counter() - started
        np.testing.assert_allclose(results[0][:5], expected_embeddings(_corpus(0)[:5]), atol=1e-5)
    finally:
        for e in instances:
            await e.async_client._client.close()
            e.client._client.close()
    return {"server": srv.connections_opened, "requests": srv.requests, "seconds": elapsed}


@pytest.mark.slow  # ~25-50 s on a loaded 2-core machine; CI runs it
async def test_twenty_instances_share_a_bounded_pool(srv: EmbeddingServer) -> None:
    ours = await _ours(srv)
    theirs = await _openai_embeddings(srv)
    print(
        f"\n{INSTANCES} instances x {DOCS_EACH} documents via aembed_documents "
        f"(asyncio.gather), batch 32:\n"
        f"  QwenPooledEmbeddings(max_connections={OUR_MAX_CONNECTIONS}): "
        f"{ours['server']} TCP connections (server count), {ours['pool_stats']} "
        f"(pool_stats), {ours['requests']} requests, {ours['seconds']:.2f} s\n"
        f"  OpenAIEmbeddings(check_embedding_ctx_length=False): {theirs['server']} TCP "
        f"connections (server count), {theirs['requests']} requests, "
        f"{theirs['seconds']:.2f} s"
    )
    assert ours["requests"] == INSTANCES * -(-DOCS_EACH // 32)
    assert 1 <= ours["server"] <= OUR_MAX_CONNECTIONS
    assert ours["pool_stats"] == ours["server"]
    # one pool per OpenAIEmbeddings instance: at least one connection each
    assert theirs["requests"] == ours["requests"]
    assert theirs["server"] >= INSTANCES


# ------------------------------------------------------------------------ the docs


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.S | re.M)


def test_docs_snippets_run_against_the_loopback_server(
    srv: EmbeddingServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocks = _python_blocks(DOCS_MD.read_text(encoding="utf-8"))
    assert blocks, "docs/langchain.md has no python block"
    monkeypatch.setenv("QWEN_EMBED_BASE_URL", srv.base_url)
    namespace: dict[str, Any] = {"__name__": "docs_langchain"}
    for block in blocks:
        exec(compile(block, str(DOCS_MD), "exec"), namespace)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["1024", "Human: Context:", "3 1024"]
    # query, two documents (one batch), chain query, three async documents (one batch)
    assert srv.requests == 4
    assert srv.received[1] == [
        "Paris is the capital of France.",
        "Berlin is the capital of Germany.",
    ]
    assert srv.received[0][0].startswith("Instruct: ")


def test_class_docstring_sample_output_is_real(srv: EmbeddingServer) -> None:
    doc = QwenPooledEmbeddings.__doc__ or ""
    samples = [json.loads(m) for m in re.findall(r"^\s*(\[-?\d\.\d+, .*\])$", doc, re.M)]
    assert len(samples) == 3  # query, documents, async query
    embed = QwenPooledEmbeddings(base_url=srv.base_url)
    assert embed.embed_query("The meaning of life is 42")[:3] == samples[0]
    vectors = embed.embed_documents(["Document 1...", "Document 2..."])
    assert vectors[0][:3] == samples[1]
    assert asyncio.run(embed.aembed_query("The meaning of life is 42"))[:3] == samples[2]


def test_assignment_is_checked_and_rolled_back(srv: EmbeddingServer) -> None:
    emb = QwenPooledEmbeddings(base_url=srv.base_url)
    with pytest.raises(q.ConfigError, match="batch_size"):
        emb.batch_size = 0
    assert emb.batch_size == "auto"
    emb.batch_size = 8
    assert emb.config.batch_size == 8
