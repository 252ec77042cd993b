"""The LlamaIndex adapter ``QwenPooledEmbedding`` against the loopback EmbeddingServer.

Real LlamaIndex objects throughout (Settings, VectorStoreIndex, IngestionPipeline,
SentenceSplitter, CallbackManager, the instrumentation dispatcher); no mocks.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_index.core
import numpy as np
import openai
import pytest
from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.callbacks import CallbackManager, CBEventType, LlamaDebugHandler
from llama_index.core.callbacks.schema import EventPayload
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.instrumentation import get_dispatcher  # type: ignore[attr-defined]
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.embedding import (
    EmbeddingEndEvent,
    EmbeddingStartEvent,
)
from llama_index.core.instrumentation.span_handlers import SimpleSpanHandler
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import MetadataMode
from pydantic import Field, ValidationError

import qwen_embed_plugins as q
from qwen_embed_plugins import (
    DEFAULT_QUERY_TASK,
    ConfigError,
    InputError,
    Limits,
    Timeouts,
    close_all,
    format_query,
    pool_stats,
)
from qwen_embed_plugins.integrations.llama_index import QwenPooledEmbedding
from qwen_embed_tooling.testing import EmbeddingServer, expected_embedding, expected_embeddings

API_KEY_ENV = "QWEN_EMBED_API_KEY"
SECRET = "k-test-secret-4711"

TOPICS = [
    "The red fox jumps over the lazy dog.",
    "Tokyo is the capital of Japan.",
    "Photosynthesis turns light into chemical energy.",
    "The Treaty of Westphalia was signed in 1648.",
    "Rust guarantees memory safety without a garbage collector.",
    "Mount Kilimanjaro is the highest mountain in Africa.",
    "A sonnet has fourteen lines.",
    "Espresso is brewed by forcing hot water through coffee grounds.",
]


@pytest.fixture(scope="module", autouse=True)
def _tiktoken_offline() -> Iterator[None]:
    """LlamaIndex's splitters need tiktoken's cl100k_base; LlamaIndex ships it but points
    TIKTOKEN_CACHE_DIR at it only while loading, so spawned ingestion workers would try
    to download it (see docs/llamaindex.md). Point the environment at the bundled copy."""
    folder = Path(llama_index.core.__file__).parent / "_static" / "tiktoken_cache"
    assert folder.is_dir(), folder
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", str(folder))
        yield


@pytest.fixture
def model(srv: EmbeddingServer) -> QwenPooledEmbedding:
    return QwenPooledEmbedding(base_url=srv.base_url, embed_batch_size=8)


@pytest.fixture
def settings_restored() -> Iterator[None]:
    saved = Settings._embed_model
    try:
        yield
    finally:
        Settings._embed_model = saved


def as_array(vectors: Any) -> np.ndarray:
    return np.asarray(vectors, dtype=np.float32)


def query_vector(text: str, task: str | None = DEFAULT_QUERY_TASK) -> np.ndarray:
    return expected_embedding(format_query(text, task))


def sent_texts(srv: EmbeddingServer) -> list[str]:
    return [text for batch in srv.received for text in batch]


# --------------------------------------------------------------------------- conformance
# Mirrors langchain-tests' EmbeddingsIntegrationTests (embed_query, embed_documents and
# their async twins) for LlamaIndex's four public calls, and checks the exact vectors.


class TestConformance:
    def test_get_query_embedding(self, model: QwenPooledEmbedding, srv: EmbeddingServer) -> None:
        embedding_1 = model.get_query_embedding("foo")
        assert isinstance(embedding_1, list)
        assert all(isinstance(x, float) for x in embedding_1)
        embedding_2 = model.get_query_embedding("bar")
        assert len(embedding_1) == len(embedding_2) == srv.dim
        np.testing.assert_array_equal(as_array(embedding_1), query_vector("foo"))
        np.testing.assert_array_equal(as_array(embedding_2), query_vector("bar"))
        assert model.get_query_embedding("foo") == embedding_1  # consistent
        # queries carry the Qwen instruction, documents do not
        assert srv.received[0] == [format_query("foo", DEFAULT_QUERY_TASK)]

    async def test_aget_query_embedding(
        self, model: QwenPooledEmbedding, srv: EmbeddingServer
    ) -> None:
        embedding_1 = await model.aget_query_embedding("foo")
        assert isinstance(embedding_1, list)
        assert all(isinstance(x, float) for x in embedding_1)
        embedding_2 = await model.aget_query_embedding("bar")
        assert len(embedding_1) == len(embedding_2) == srv.dim
        np.testing.assert_array_equal(as_array(embedding_1), query_vector("foo"))
        np.testing.assert_array_equal(as_array(embedding_2), query_vector("bar"))
        assert await model.aget_query_embedding("foo") == embedding_1
        assert srv.received[0] == [format_query("foo", DEFAULT_QUERY_TASK)]

    def test_get_text_embedding_batch(
        self, model: QwenPooledEmbedding, srv: EmbeddingServer
    ) -> None:
        documents = ["foo", "bar", "baz"]
        embeddings = model.get_text_embedding_batch(documents)
        assert len(embeddings) == len(documents)
        assert all(isinstance(e, list) for e in embeddings)
        assert all(isinstance(x, float) for e in embeddings for x in e)
        assert all(len(e) == srv.dim for e in embeddings)
        np.testing.assert_array_equal(as_array(embeddings), expected_embeddings(documents))
        assert srv.received == [documents]  # one request, sent raw

    async def test_aget_text_embedding_batch(
        self, model: QwenPooledEmbedding, srv: EmbeddingServer
    ) -> None:
        documents = ["foo", "bar", "baz"]
        embeddings = await model.aget_text_embedding_batch(documents)
        assert len(embeddings) == len(documents)
        assert all(isinstance(e, list) for e in embeddings)
        assert all(isinstance(x, float) for e in embeddings for x in e)
        assert all(len(e) == srv.dim for e in embeddings)
        np.testing.assert_array_equal(as_array(embeddings), expected_embeddings(documents))
        assert srv.received == [documents]

    def test_single_text(self, model: QwenPooledEmbedding, srv: EmbeddingServer) -> None:
        vector = model.get_text_embedding("foo")
        np.testing.assert_array_equal(as_array(vector), expected_embedding("foo"))
        assert asyncio.run(model.aget_text_embedding("foo")) == vector
        assert srv.received == [["foo"], ["foo"]]

    def test_batches_order_and_consistency(
        self, model: QwenPooledEmbedding, srv: EmbeddingServer
    ) -> None:
        texts = [f"passage {i}: {'lorem ' * (i % 5)}ipsum" for i in range(50)]
        texts[40] = texts[3]  # a repeat in another batch
        vectors = model.get_text_embedding_batch(texts)
        np.testing.assert_array_equal(as_array(vectors), expected_embeddings(texts))
        assert vectors[40] == vectors[3]
        assert srv.requests == 7  # ceil(50 / embed_batch_size=8): real batches
        assert all(len(batch) <= 8 for batch in srv.received)
        srv.reset_counters()
        avectors = asyncio.run(model.aget_text_embedding_batch(texts))
        assert avectors == vectors
        assert srv.requests == 7

    def test_invalid_text_raises_input_error(
        self, model: QwenPooledEmbedding, srv: EmbeddingServer
    ) -> None:
        with pytest.raises(InputError):
            model.get_text_embedding("   ")
        with pytest.raises(InputError):
            asyncio.run(model.aget_text_embedding_batch(["ok", ""]))
        assert srv.requests == 0


# --------------------------------------------------------------------------- idioms


@pytest.mark.unit
def test_lazy_import_and_class_name() -> None:
    assert q.QwenPooledEmbedding is QwenPooledEmbedding
    assert QwenPooledEmbedding.class_name() == "QwenPooledEmbedding"


def test_constructing_opens_nothing() -> None:
    base_url = "http://127.0.0.1:9/llama-construct/v1"  # nothing listens there; unique
    model = QwenPooledEmbedding(base_url=base_url)
    clone = pickle.loads(pickle.dumps(model))
    assert clone.config == model.config
    assert model.config.endpoint not in pool_stats()


@pytest.mark.unit
def test_fields_map_onto_the_core_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QWEN_EMBED_BASE_URL", "http://127.0.0.1:9/v1/")
    monkeypatch.setenv(API_KEY_ENV, SECRET)
    model = QwenPooledEmbedding(
        model_name="Qwen/Qwen3-Embedding-4B",
        dimensions=256,
        query_instruction=None,
        embed_batch_size=7,
        max_concurrency=3,
        encoding_format="float",
        read_timeout=12.5,
        max_connections=5,
        http2=True,
    )
    cfg = model.config
    assert cfg.base_url == model.base_url == "http://127.0.0.1:9/v1"  # env, normalised
    assert cfg.api_key_value() == SECRET
    assert (cfg.model, cfg.dimensions, cfg.query_instruction) == (
        "Qwen/Qwen3-Embedding-4B",
        256,
        None,
    )
    assert (cfg.batch_size, cfg.max_concurrency, cfg.encoding_format) == (7, 3, "float")
    assert cfg.timeout == Timeouts(read=12.5)
    assert cfg.limits == Limits(max_connections=5)
    # the same flat settings, the same names, as the LangChain adapter; model= and
    # batch_size= are accepted for LlamaIndex's model_name / embed_batch_size
    same = QwenPooledEmbedding(model="Qwen/Qwen3-Embedding-4B", batch_size=7)
    assert (same.model_name, same.embed_batch_size) == ("Qwen/Qwen3-Embedding-4B", 7)
    assert cfg.http2 is True
    # assignment rebuilds the config, and a bad value is refused and rolled back
    model.embed_batch_size = 11
    assert model.config.batch_size == 11
    with pytest.raises(ConfigError, match="max_concurrency"):
        model.max_concurrency = 0
    assert model.max_concurrency == 3
    assert model.config.max_concurrency == 3
    model.api_key = "another-key-0042"
    assert model.config.api_key_value() == "another-key-0042"
    assert "another-key-0042" not in repr(model)
    # model_copy(update=...) skips __setattr__: the copy still gets its own config
    copy = model.model_copy(update={"embed_batch_size": 5})
    assert copy.config.batch_size == 5
    assert model.config.batch_size == 11


@pytest.mark.unit
def test_invalid_settings() -> None:
    with pytest.raises(ConfigError, match="base_url"):
        QwenPooledEmbedding(base_url="ftp://example.org")
    with pytest.raises(ConfigError, match="dimensions"):
        QwenPooledEmbedding(base_url="http://127.0.0.1:9/v1", dimensions=4096)
    with pytest.raises(ValidationError, match="embed_batch_size") as refused:
        QwenPooledEmbedding(base_url="http://127.0.0.1:9/v1", api_key=SECRET, batch_size=0)
    assert SECRET[-6:] not in str(refused.value)  # inputs are not echoed
    with pytest.raises(ValidationError, match="no_such_field"):
        QwenPooledEmbedding(base_url="http://127.0.0.1:9/v1", no_such_field=1)  # type: ignore[call-arg]


@pytest.mark.unit
def test_to_dict_round_trip_never_holds_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    model = QwenPooledEmbedding(
        base_url="http://127.0.0.1:9/v1",
        api_key=SECRET,
        dimensions=256,
        query_instruction="Given a question, retrieve passages that answer it",
        embed_batch_size=7,
        max_concurrency=3,
        read_timeout=12.5,
        max_connections=5,
        keepalive_expiry=2.0,
        verify=False,
        encoding_format="float",
    )
    data = model.to_dict()
    text = model.to_json()
    for rendering in (text, repr(model), str(model), repr(data), str(model.to_payload())):
        assert SECRET not in rendering
    assert "api_key" not in data
    assert data["class_name"] == "QwenPooledEmbedding"
    assert json.loads(text) == data
    back = QwenPooledEmbedding.from_dict(data)
    assert back.api_key is None
    assert back.config == model.config.replace(api_key=None)
    assert QwenPooledEmbedding.from_json(text).config == back.config
    monkeypatch.setenv(API_KEY_ENV, SECRET)  # a copy re-reads the key from its environment
    assert QwenPooledEmbedding.from_dict(data).config == model.config


def test_pickle_drops_the_key_and_reattaches_to_the_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with EmbeddingServer(api_key=SECRET) as ksrv:
        monkeypatch.setenv(API_KEY_ENV, SECRET)
        model = QwenPooledEmbedding(base_url=ksrv.base_url)
        first = model.get_text_embedding("before pickling")
        blob = pickle.dumps(model)
        assert SECRET.encode() not in blob
        clone = pickle.loads(blob)
        assert clone.config == model.config  # the key came back from the environment
        vector = clone.get_text_embedding("after pickling")
        np.testing.assert_array_equal(as_array(vector), expected_embedding("after pickling"))
        assert first == model.get_text_embedding("before pickling")
        row = pool_stats()[model.config.endpoint]
        assert row["sync_clients"] == 1
        assert ksrv.connections_opened == 1  # the clone reused the original's connection
        # without the variable, unpickled in this process while the key lives: the clone
        # has it (never in the pickle; a forked worker finds it the same way, issue 30.6;
        # once no instance holds it: tests/test_adapters.py)
        monkeypatch.delenv(API_KEY_ENV)
        kept = pickle.loads(blob)
        assert kept.config.api_key_value() == SECRET
        kept.get_text_embedding("still keyed")  # the server takes SECRET only


@pytest.mark.unit
def test_pickling_skips_unpicklable_fields_without_touching_the_original() -> None:
    class LockedHandler(LlamaDebugHandler):
        def __init__(self) -> None:
            super().__init__()
            self.lock = threading.Lock()  # cannot be pickled

    manager = CallbackManager([LockedHandler()])
    model = QwenPooledEmbedding(base_url="http://127.0.0.1:9/v1", callback_manager=manager)
    clone = pickle.loads(pickle.dumps(model))
    assert model.callback_manager is manager  # LlamaIndex's BaseComponent deletes it
    assert clone.callback_manager.handlers == []
    assert clone.config == model.config


def test_callback_and_instrumentation_events_fire(srv: EmbeddingServer) -> None:
    class Collector(BaseEventHandler):
        events: list[BaseEvent] = Field(default_factory=list)

        def handle(self, event: BaseEvent, **kwargs: Any) -> None:
            if isinstance(event, EmbeddingStartEvent | EmbeddingEndEvent):
                self.events.append(event)

    debug = LlamaDebugHandler()
    model = QwenPooledEmbedding(
        base_url=srv.base_url, embed_batch_size=4, callback_manager=CallbackManager([debug])
    )
    collector = Collector()
    spans = SimpleSpanHandler()
    root = get_dispatcher()
    root.add_event_handler(collector)
    root.add_span_handler(spans)
    texts = [f"event text {i}" for i in range(10)]  # 3 batches of <= 4
    try:
        model.get_text_embedding_batch(texts)
        asyncio.run(model.aget_text_embedding_batch(texts))
        model.get_query_embedding("a query")
        asyncio.run(model.aget_query_embedding("a query"))
    finally:
        root.event_handlers.remove(collector)
        root.span_handlers.remove(spans)

    # CallbackManager: one EMBEDDING event pair per batch and per query
    pairs = debug.get_event_pairs(CBEventType.EMBEDDING)
    assert len(pairs) == 3 + 3 + 1 + 1
    chunks = [(pair[1].payload or {})[EventPayload.CHUNKS] for pair in pairs]
    assert [c for batch in chunks[0:3] for c in batch] == texts
    assert [c for batch in chunks[3:6] for c in batch] == texts
    assert chunks[6:] == [["a query"], ["a query"]]
    # instrumentation: start and end events with a credential-free model payload
    starts = [e for e in collector.events if isinstance(e, EmbeddingStartEvent)]
    ends = [e for e in collector.events if isinstance(e, EmbeddingEndEvent)]
    assert len(starts) == len(ends) == 8
    model_dict = starts[0].model_dict
    assert model_dict is not None
    assert model_dict["class_name"] == "QwenPooledEmbedding"
    assert model_dict["base_url"] == model.config.endpoint
    assert "api_key" not in model_dict
    ended = [c for e in ends[0:3] for c in e.chunks]
    assert ended == texts
    np.testing.assert_array_equal(
        as_array([v for e in ends[0:3] for v in e.embeddings]), expected_embeddings(texts)
    )
    # spans of the public methods
    names = [span.id_.split("-")[0] for span in spans.completed_spans]
    for public in (
        "get_text_embedding_batch",
        "aget_text_embedding_batch",  # one span, though the override calls super()
        "get_query_embedding",
        "aget_query_embedding",
    ):
        assert names.count(f"QwenPooledEmbedding.{public}") == 1, public
    assert not spans.dropped_spans


# --------------------------------------------------------------------------- LlamaIndex


def test_settings_vector_index_and_retriever(srv: EmbeddingServer, settings_restored: None) -> None:
    # The server's vectors are hashes of the text: only an identical text is similar.
    # With query_instruction=None a query equal to a node's text must retrieve it.
    Settings.embed_model = QwenPooledEmbedding(base_url=srv.base_url, query_instruction=None)
    index = VectorStoreIndex.from_documents([Document(text=t) for t in TOPICS])
    assert sorted(sent_texts(srv)) == sorted(TOPICS)  # one node per short document
    retriever = index.as_retriever(similarity_top_k=2)
    for i in (0, 5, 7):
        hits = retriever.retrieve(TOPICS[i])
        assert hits[0].node.get_content() == TOPICS[i]
        assert hits[0].score == pytest.approx(1.0, abs=1e-5)
        assert hits[1].score is not None
        assert hits[1].score < 0.3
    hits = asyncio.run(retriever.aretrieve(TOPICS[3]))
    assert hits[0].node.get_content() == TOPICS[3]


def test_index_sends_instruction_with_queries_only(
    srv: EmbeddingServer, settings_restored: None
) -> None:
    Settings.embed_model = QwenPooledEmbedding(base_url=srv.base_url)
    index = VectorStoreIndex.from_documents([Document(text=t) for t in TOPICS])
    assert sorted(sent_texts(srv)) == sorted(TOPICS)  # documents raw
    srv.reset_counters()
    question = "Which city is the capital of Japan?"
    index.as_retriever(similarity_top_k=1).retrieve(question)
    assert srv.received == [[f"Instruct: {DEFAULT_QUERY_TASK}\nQuery:{question}"]]


def test_ingestion_pipeline_with_two_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    # Spawned workers unpickle the embed model: they must reach the loopback server,
    # find tiktoken offline, and take the API key from the environment (never pickled).
    documents = [
        Document(
            text=" ".join(
                f"Document {d} sentence {s} talks about subject {d * 10 + s}." for s in range(40)
            )
        )
        for d in range(4)
    ]

    def pipeline(base_url: str) -> IngestionPipeline:
        return IngestionPipeline(
            transformations=[
                SentenceSplitter(chunk_size=64, chunk_overlap=0),
                QwenPooledEmbedding(base_url=base_url, embed_batch_size=8),
            ]
        )

    with EmbeddingServer(api_key=SECRET) as ksrv:
        monkeypatch.setenv(API_KEY_ENV, SECRET)
        parallel = pipeline(ksrv.base_url).run(documents=documents, num_workers=2)
        sent_by_workers = sorted(sent_texts(ksrv))
        ksrv.reset_counters()
        serial = pipeline(ksrv.base_url).run(documents=documents)

    texts = [n.get_content(metadata_mode=MetadataMode.EMBED) for n in serial]
    assert len(serial) > len(documents)
    assert [n.get_content(metadata_mode=MetadataMode.EMBED) for n in parallel] == texts
    assert sent_by_workers == sorted(texts)  # the workers did the embedding
    np.testing.assert_array_equal(
        as_array([n.embedding for n in parallel]), as_array([n.embedding for n in serial])
    )
    np.testing.assert_array_equal(
        as_array([n.embedding for n in serial]), expected_embeddings(texts)
    )


def test_ingestion_pipeline_rerun_with_a_docstore_embeds_only_what_changed(
    srv: EmbeddingServer,
) -> None:
    """A re-run whose docstore holds every document hands the embed model an empty
    list: stock embeddings return [] (ours raised InputError), sync and async."""
    from llama_index.core.storage.docstore import SimpleDocumentStore
    from llama_index.core.vector_stores import SimpleVectorStore

    model = QwenPooledEmbedding(base_url=srv.base_url)
    docs = [Document(text=text, id_=str(i)) for i, text in enumerate(TOPICS[:3])]
    pipeline = IngestionPipeline(
        transformations=[model], docstore=SimpleDocumentStore(), vector_store=SimpleVectorStore()
    )
    assert len(pipeline.run(documents=docs)) == 3
    srv.reset_counters()
    assert pipeline.run(documents=docs) == []
    assert asyncio.run(pipeline.arun(documents=docs)) == []
    assert srv.requests == 0
    assert model.get_text_embedding_batch([]) == []
    assert asyncio.run(model.aget_text_embedding_batch([])) == []
    docs[2] = Document(text="A haiku has three lines.", id_="2")
    (changed,) = pipeline.run(documents=docs)
    assert srv.received == [["A haiku has three lines."]]
    np.testing.assert_array_equal(
        as_array(changed.embedding), expected_embedding("A haiku has three lines.")
    )


# --------------------------------------------------------------------------- async, pool


def test_asyncio_run_twice_on_one_instance(model: QwenPooledEmbedding) -> None:
    texts = [f"loop text {i}" for i in range(20)]
    first = asyncio.run(model.aget_text_embedding_batch(texts))
    second = asyncio.run(model.aget_text_embedding_batch(texts))
    query = asyncio.run(model.aget_query_embedding("loop query"))
    assert first == second
    np.testing.assert_array_equal(as_array(first), expected_embeddings(texts))
    np.testing.assert_array_equal(as_array(query), query_vector("loop query"))


@pytest.mark.slow  # ~25-50 s on a loaded 2-core machine; CI runs it
def test_async_fan_out_is_bounded_vs_openai_like(srv: EmbeddingServer) -> None:
    from llama_index.embeddings.openai_like import (  # type: ignore[import-untyped]
        OpenAILikeEmbedding,
    )

    texts = [f"text number {i} for the fan-out test" for i in range(2000)]
    expected = expected_embeddings(texts)
    ours = QwenPooledEmbedding(base_url=srv.base_url, embed_batch_size=32, max_concurrency=4)
    vectors = asyncio.run(ours.aget_text_embedding_batch(texts))
    ours_stats = srv.stats()
    np.testing.assert_array_equal(as_array(vectors), expected)

    srv.reset_counters()

    async def stock_run() -> list[list[float]]:
        # The SDK's default async HTTP client, passed in only so that it is closed
        # afterwards (left to the SDK, its 63 sockets outlive the loop).
        async with openai.DefaultAsyncHttpxClient() as http_client:
            stock = OpenAILikeEmbedding(
                model_name=srv.model,
                api_base=srv.base_url,
                api_key="unused",
                embed_batch_size=32,
                async_http_client=http_client,
            )
            vectors: list[list[float]] = await stock.aget_text_embedding_batch(texts)
            return vectors

    stock_vectors = asyncio.run(stock_run())
    stock_stats = srv.stats()
    np.testing.assert_allclose(as_array(stock_vectors), expected, atol=1e-6)

    print(
        "\n2,000 texts through aget_text_embedding_batch (embed_batch_size=32, 63 batches):\n"
        f"  QwenPooledEmbedding (max_concurrency=4, max_connections=20): "
        f"connections={ours_stats['connections_opened']} "
        f"peak_in_flight={ours_stats['max_in_flight']} requests={ours_stats['requests']}\n"
        f"  OpenAILikeEmbedding: connections={stock_stats['connections_opened']} "
        f"peak_in_flight={stock_stats['max_in_flight']} requests={stock_stats['requests']}"
    )
    assert ours_stats["requests"] == 63
    assert ours_stats["connections_opened"] <= ours.max_connections
    assert ours_stats["connections_opened"] <= ours.max_concurrency
    assert ours_stats["max_in_flight"] <= ours.max_concurrency
    assert stock_stats["requests"] >= 63  # its own retries may add some


def test_langchain_and_llamaindex_share_one_pool(srv: EmbeddingServer) -> None:
    from qwen_embed_plugins.integrations.langchain import QwenPooledEmbeddings

    close_all()  # start from no open client, whatever earlier tests left
    llama = QwenPooledEmbedding(base_url=srv.base_url)
    chain = QwenPooledEmbeddings(base_url=srv.base_url)
    assert llama.config.pool_key == chain.config.pool_key

    assert llama.get_text_embedding("shared pool") == chain.embed_documents(["shared pool"])[0]
    assert llama.get_query_embedding("shared") == chain.embed_query("shared")

    async def both_async() -> None:
        assert await llama.aget_query_embedding("a") == await chain.aembed_query("a")
        assert await llama.aget_text_embedding_batch(["b"]) == await chain.aembed_documents(["b"])
        row = pool_stats()[llama.config.endpoint]
        assert row["async_clients"] == 1  # one AsyncClient for this loop, shared

    asyncio.run(both_async())
    rows = [label for label in pool_stats() if label == llama.config.endpoint]
    assert len(rows) == 1
    assert pool_stats()[llama.config.endpoint]["sync_clients"] == 1
    # sequential sync calls of both adapters reused one connection; the loop opened one
    assert srv.connections_opened == 2


def test_events_and_spans_carry_batch_size_and_timing() -> None:
    """What an observer of LlamaIndex's standard events and spans sees per batch: the
    batch size (number of chunks) and timing, with real handlers and a server that takes
    LATENCY seconds per request."""
    latency = 0.1

    class Collector(BaseEventHandler):
        events: list[BaseEvent] = Field(default_factory=list)

        def handle(self, event: BaseEvent, **kwargs: Any) -> None:
            if isinstance(event, EmbeddingStartEvent | EmbeddingEndEvent):
                self.events.append(event)

    class BatchSpans(SimpleSpanHandler):
        """SimpleSpanHandler (start, end, duration) that also keeps each span's batch."""

        sizes: dict[str, int] = Field(default_factory=dict)

        def new_span(self, id_: str, bound_args: Any, *args: Any, **kwargs: Any) -> Any:
            arguments = bound_args.arguments
            if "texts" in arguments:
                self.sizes[id_] = len(arguments["texts"])
            elif "query" in arguments or "text" in arguments:
                self.sizes[id_] = 1
            return super().new_span(id_, bound_args, *args, **kwargs)

    def named(name: str) -> list[Any]:
        found = [s for s in spans.completed_spans if s.id_.split("-")[0] == name]
        return sorted(found, key=lambda s: s.start_time)

    texts = [f"timed text {i}" for i in range(10)]  # batches of 4, 4, 2
    collector, spans, debug = Collector(), BatchSpans(), LlamaDebugHandler()
    root = get_dispatcher()
    with EmbeddingServer(latency=latency) as slow:
        model = QwenPooledEmbedding(
            base_url=slow.base_url,
            embed_batch_size=4,
            max_concurrency=2,
            callback_manager=CallbackManager([debug]),
        )
        root.add_event_handler(collector)
        root.add_span_handler(spans)
        try:
            model.get_text_embedding_batch(texts)
            sync_events = list(collector.events)
            sync_pairs = debug.get_event_pairs(CBEventType.EMBEDDING)
            sync_time = debug.get_event_time_info(CBEventType.EMBEDDING)
            debug.flush_event_logs()
            collector.events.clear()
            asyncio.run(model.aget_text_embedding_batch(texts))
            model.get_query_embedding("a timed query")
        finally:
            root.event_handlers.remove(collector)
            root.span_handlers.remove(spans)
        assert slow.requests == 3 + 3 + 1
    assert not spans.dropped_spans

    # Instrumentation events (sync): start/end per batch; the end names the chunks
    assert [type(e) for e in sync_events] == [EmbeddingStartEvent, EmbeddingEndEvent] * 3
    starts, ends = sync_events[0::2], sync_events[1::2]
    assert [len(e.chunks) for e in ends] == [4, 4, 2]  # type: ignore[attr-defined]
    # the sync call keeps a window of 2 batches on the wire (as the core client does):
    # the first batch's event waits for its answer, the next ones' answers are already
    # on their way when LlamaIndex asks for them
    assert ends[0].timestamp > starts[0].timestamp
    # Instrumentation events (async): LlamaIndex starts every batch, then ends them all
    # after gathering, so the events time the call (two rounds: window of 2)
    async_ends = [e for e in collector.events if isinstance(e, EmbeddingEndEvent)]
    assert [len(e.chunks) for e in async_ends] == [4, 4, 2, 1]  # + the query
    first_start = collector.events[0].timestamp
    assert (async_ends[2].timestamp - first_start).total_seconds() >= 2 * latency

    # CallbackManager (CBEventType.EMBEDDING): chunks per batch, and LlamaIndex's timing
    assert [len((p[1].payload or {})[EventPayload.CHUNKS]) for p in sync_pairs] == [4, 4, 2]
    assert sync_time.total_count == 3

    # Spans: one per HTTP request, a child of the public call's span, holding the batch
    (sync_call,) = named("QwenPooledEmbedding.get_text_embedding_batch")
    sync_requests = named("QwenPooledEmbedding._get_text_embeddings")
    assert [spans.sizes[s.id_] for s in sync_requests] == [4, 4, 2]
    assert {s.parent_id for s in sync_requests} == {sync_call.id_}
    assert sync_call.duration >= 2 * latency  # three batches, two at a time
    (async_call,) = named("QwenPooledEmbedding.aget_text_embedding_batch")
    async_requests = named("QwenPooledEmbedding._aembed_batch")
    assert sorted(spans.sizes[s.id_] for s in async_requests) == [2, 4, 4]
    assert {s.parent_id for s in async_requests} == {async_call.id_}
    assert all(s.duration >= latency for s in async_requests)
    # the window holds 2 requests: the third span starts when one of the first two ends
    # (it times the request, not the wait for a slot)
    first_two_end = min(s.end_time for s in async_requests[:2])
    assert async_requests[2].start_time >= first_two_end
    assert async_call.duration >= 2 * latency
    (query_request,) = named("QwenPooledEmbedding._get_query_embedding")
    assert spans.sizes[query_request.id_] == 1
    assert query_request.duration >= latency
