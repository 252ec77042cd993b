"""OpenTelemetry spans (``_tracing``, the ``otel`` extra), exported to the SDK's
``InMemorySpanExporter``: one ``embeddings {model}`` span per call (GenAI conventions)
with one ``POST`` child per HTTP exchange, parented to the caller's current span, on the
sync, async and HTTP/2 paths, both adapters, a LangChain retrieval chain and a
LlamaIndex ingestion pipeline; texts, vectors and the key never recorded; without a
provider (or without the API) nothing is built.

The tracer provider is process-wide and set once: its sampler records only while a test
of this module holds the ``spans`` fixture, so the other tests of an xdist worker that
ran this module pay one non-recording span start per call and export nothing.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Sampler, SamplingResult
from opentelemetry.trace import SpanKind, StatusCode

import qwen_embed_plugins as q
from qwen_embed_tooling.testing import EmbeddingServer

MODEL = "Qwen/Qwen3-Embedding-0.6B"
KEY = "sk-tracing-secret-0123456789"
FAST = q.RetryConfig(backoff_initial=0.01, backoff_max=0.05)


class _Switch(Sampler):
    """Records while ``on`` (a test of this module is running), else drops."""

    on = False

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        return (ALWAYS_ON if self.on else ALWAYS_OFF).should_sample(*args, **kwargs)

    def get_description(self) -> str:
        return "test switch"


_SWITCH = _Switch()
_EXPORTER = InMemorySpanExporter()


def _install() -> None:
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider(sampler=_SWITCH)
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
    assert trace.get_tracer_provider().sampler is _SWITCH


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The exporter, empty, recording for this test only."""
    _install()
    _EXPORTER.clear()
    _SWITCH.on = True
    try:
        yield _EXPORTER
    finally:
        _SWITCH.on = False
        _EXPORTER.clear()


TRACER = trace.get_tracer("tests.test_tracing")


def _calls(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name.startswith("embeddings")]


def _requests(exporter: InMemorySpanExporter, call: ReadableSpan) -> list[ReadableSpan]:
    """The ``POST`` children of ``call``, in start order."""
    assert call.context is not None
    found = [
        s
        for s in exporter.get_finished_spans()
        if s.name == "POST" and s.parent is not None and s.parent.span_id == call.context.span_id
    ]
    return sorted(found, key=lambda s: s.start_time or 0)


def _under(span: ReadableSpan, parent: ReadableSpan) -> bool:
    assert parent.context is not None
    return span.parent is not None and span.parent.span_id == parent.context.span_id


def _check_call(span: ReadableSpan, srv: EmbeddingServer, texts: int) -> None:
    """The GenAI conventions' attributes of a successful call of ``texts`` texts."""
    a = span.attributes or {}
    assert span.name == f"embeddings {MODEL}"
    assert span.kind is SpanKind.CLIENT
    assert span.status.status_code is StatusCode.UNSET
    assert a["gen_ai.operation.name"] == "embeddings"
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.response.model"] == srv.model
    assert a["server.address"] == "127.0.0.1"
    assert a["server.port"] == srv.port
    assert a["gen_ai.provider.name"] == "sglang"  # identified from its answer
    assert a["gen_ai.embeddings.dimension.count"] == srv.dim
    assert tuple(a["gen_ai.request.encoding_formats"]) == ("base64",)
    assert isinstance(a["gen_ai.usage.input_tokens"], int)
    assert a["gen_ai.usage.input_tokens"] >= texts  # the server counts tokens per text
    assert a["qwen_embed.texts"] == texts
    assert "error.type" not in a


def _no_secrets(exporter: InMemorySpanExporter, texts: Sequence[str]) -> None:
    """No attribute or event of any span holds a text, the key or a vector."""
    for span in exporter.get_finished_spans():
        values = [str(v) for v in (span.attributes or {}).values()]
        values += [str(e.attributes) for e in span.events] + [span.name]
        values.append(str(span.status.description))
        for value in values:
            assert KEY not in value
            assert "Bearer" not in value
            for t in texts:
                assert t not in value, (span.name, value)


# --------------------------------------------------------------------------- paths


def test_sync_call_is_a_genai_span_with_its_request_as_child(
    spans: InMemorySpanExporter, srv: EmbeddingServer
) -> None:
    texts = ["tracing-text-alpha", "tracing-text-beta", "tracing-text-gamma"]
    client = q.EmbeddingClient(base_url=srv.base_url, model=MODEL, api_key=KEY)
    with TRACER.start_as_current_span("app") as app:
        client.embed_documents(texts)
    (call,) = _calls(spans)
    assert isinstance(app, ReadableSpan)
    assert _under(call, app)
    _check_call(call, srv, 3)
    (req,) = _requests(spans, call)
    a = req.attributes or {}
    assert req.kind is SpanKind.CLIENT
    assert a["http.request.method"] == "POST"
    assert a["url.full"] == f"{srv.base_url}/embeddings"
    assert a["server.port"] == srv.port
    assert a["http.response.status_code"] == 200
    assert a["network.protocol.version"] == "1.1"
    assert a["qwen_embed.request.texts"] == 3
    assert "http.request.resend_count" not in a
    _no_secrets(spans, texts)


async def test_async_calls_nest_under_the_callers_span(
    spans: InMemorySpanExporter, srv: EmbeddingServer
) -> None:
    client = q.AsyncEmbeddingClient(base_url=srv.base_url, model=MODEL, batch_size=2)
    with TRACER.start_as_current_span("app") as app:
        await client.embed_documents(["one", "two", "three", "four", "five"])
        await client.embed_query("a question")
    calls = _calls(spans)
    assert len(calls) == 2
    assert isinstance(app, ReadableSpan)
    assert all(_under(c, app) for c in calls)
    docs = next(c for c in calls if (c.attributes or {})["qwen_embed.texts"] == 5)
    _check_call(docs, srv, 5)
    assert len(_requests(spans, docs)) == 3  # batches of 2: three requests, one span each


async def test_concurrent_async_calls_keep_their_own_parents(
    spans: InMemorySpanExporter, srv: EmbeddingServer
) -> None:
    client = q.AsyncEmbeddingClient(base_url=srv.base_url, model=MODEL)

    async def under(name: str) -> None:
        with TRACER.start_as_current_span(name):
            await client.embed_query(name)

    await asyncio.gather(under("first"), under("second"))
    parents = {s.context.span_id: s.name for s in spans.get_finished_spans() if s.context}
    for call in _calls(spans):
        assert call.parent is not None
        assert parents[call.parent.span_id] in ("first", "second")
    assert len({c.parent.span_id for c in _calls(spans) if c.parent}) == 2


@pytest.mark.parametrize("path", ["sync", "async"])
def test_http2_requests_say_protocol_2(spans: InMemorySpanExporter, path: str) -> None:
    with EmbeddingServer(http2=True) as srv:
        if path == "sync":
            q.EmbeddingClient(base_url=srv.base_url, model=MODEL, http2=True).embed_query("h2")
        else:
            client = q.AsyncEmbeddingClient(base_url=srv.base_url, model=MODEL, http2=True)
            asyncio.run(client.embed_query("h2"))
    (call,) = _calls(spans)
    versions = [
        (r.attributes or {}).get("network.protocol.version") for r in _requests(spans, call)
    ]
    assert versions[-1] == "2"


def test_a_retry_is_two_child_spans(spans: InMemorySpanExporter, srv: EmbeddingServer) -> None:
    srv.inject_status(503, count=1)
    client = q.EmbeddingClient(base_url=srv.base_url, model=MODEL, retry=FAST)
    client.embed_query("retried")
    (call,) = _calls(spans)
    assert call.status.status_code is StatusCode.UNSET
    first, second = _requests(spans, call)
    assert (first.attributes or {})["http.response.status_code"] == 503
    assert (first.attributes or {})["error.type"] == "503"
    assert first.status.status_code is StatusCode.ERROR
    assert (second.attributes or {})["http.response.status_code"] == 200
    assert (second.attributes or {})["http.request.resend_count"] == 1
    assert "error.type" not in (second.attributes or {})


def test_requests_to_replicas_name_their_server(
    spans: InMemorySpanExporter, srv: EmbeddingServer
) -> None:
    """An endpoint of two replicas: the call span names no server (it has two), each
    request span names the replica it went to."""
    with EmbeddingServer() as other:
        client = q.EmbeddingClient(
            base_url=[srv.base_url, other.base_url], model=MODEL, batch_size=1
        )
        client.embed_documents([f"replica-text-{i}" for i in range(8)])
        assert srv.requests > 0
        assert other.requests > 0
    (call,) = _calls(spans)
    assert "server.address" not in (call.attributes or {})
    ports = [(r.attributes or {})["server.port"] for r in _requests(spans, call)]
    assert len(ports) == 8
    assert set(ports) == {srv.port, other.port}


def test_a_failed_call_has_error_type(spans: InMemorySpanExporter, srv: EmbeddingServer) -> None:
    srv.inject_status(401, count=10)
    client = q.EmbeddingClient(base_url=srv.base_url, model=MODEL, api_key=KEY, retry=FAST)
    with pytest.raises(q.AuthenticationError):
        client.embed_documents(["refused-text-1", "refused-text-2"])
    (call,) = _calls(spans)
    assert call.status.status_code is StatusCode.ERROR
    assert (call.attributes or {})["error.type"] == "qwen_embed_plugins.errors.AuthenticationError"
    (req,) = _requests(spans, call)
    assert (req.attributes or {})["error.type"] == "401"
    _no_secrets(spans, ["refused-text-1", "refused-text-2"])


def test_connection_refused_request_names_the_exception(
    spans: InMemorySpanExporter, poisoned_port: int
) -> None:
    base = f"http://127.0.0.1:{poisoned_port}/v1"
    client = q.EmbeddingClient(base_url=base, model=MODEL, retry=FAST.replace(wait_for_server=0))
    with pytest.raises(q.TransportError):
        client.embed_query("nobody listens")
    (call,) = _calls(spans)
    error = str((call.attributes or {})["error.type"])
    assert error.startswith("qwen_embed_plugins.errors.")
    for req in _requests(spans, call):
        assert str((req.attributes or {})["error.type"]).startswith("qwen_embed_plugins.errors.")


# --------------------------------------------------------------------------- adapters


def test_langchain_retrieval_chain_nests_the_embedding_spans(
    spans: InMemorySpanExporter, srv: EmbeddingServer
) -> None:
    """LangChain emits no OpenTelemetry spans itself: the chain runs under a span the
    application opens; the store's and the retriever's embedding calls nest there."""
    from langchain_core.documents import Document
    from langchain_core.runnables import RunnableLambda
    from langchain_core.vectorstores import InMemoryVectorStore

    from qwen_embed_plugins.integrations.langchain import QwenPooledEmbeddings

    emb = QwenPooledEmbeddings(base_url=srv.base_url, model=MODEL, api_key=KEY)
    docs = ["pooled clients reuse sockets", "qwen3 has an instruction", "ray embeds corpora"]
    store = InMemoryVectorStore.from_documents([Document(page_content=d) for d in docs], emb)
    chain = store.as_retriever(search_kwargs={"k": 1}) | RunnableLambda(
        lambda found: found[0].page_content
    )
    with TRACER.start_as_current_span("ingest") as ingest:
        store.add_texts(["one more document"])
    with TRACER.start_as_current_span("chain") as run:
        assert chain.invoke("what reuses sockets?") in docs
    calls = _calls(spans)
    assert isinstance(ingest, ReadableSpan)
    assert isinstance(run, ReadableSpan)
    assert [c for c in calls if _under(c, ingest)]
    (query,) = [c for c in calls if _under(c, run)]
    assert (query.attributes or {})["qwen_embed.texts"] == 1
    _no_secrets(spans, [*docs, "what reuses sockets?", "one more document"])


async def test_langchain_async_retriever_nests(
    spans: InMemorySpanExporter, srv: EmbeddingServer
) -> None:
    from langchain_core.vectorstores import InMemoryVectorStore

    from qwen_embed_plugins.integrations.langchain import QwenPooledEmbeddings

    emb = QwenPooledEmbeddings(base_url=srv.base_url, model=MODEL)
    store = await InMemoryVectorStore.afrom_texts(["a doc", "another doc"], emb)
    with TRACER.start_as_current_span("chain") as run:
        await store.as_retriever().ainvoke("which doc?")
    assert isinstance(run, ReadableSpan)
    assert [c for c in _calls(spans) if _under(c, run)]


def test_llama_index_ingestion_nests_the_embedding_spans(
    spans: InMemorySpanExporter, srv: EmbeddingServer
) -> None:
    """LlamaIndex's own instrumentation (``llama_index.core.instrumentation``) sends its
    spans to LlamaIndex span handlers, not to OpenTelemetry (that bridge is a separate
    package, not installed here): the pipeline runs under a span the application opens."""
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter

    from qwen_embed_plugins.integrations.llama_index import QwenPooledEmbedding

    embed = QwenPooledEmbedding(base_url=srv.base_url, model_name=MODEL, api_key=KEY)
    texts = ["A long document about pooling. " * 20, "Another about Ray Data. " * 20]
    pipeline = IngestionPipeline(
        transformations=[SentenceSplitter(chunk_size=64, chunk_overlap=8), embed]
    )
    with TRACER.start_as_current_span("ingestion") as ingest:
        nodes = pipeline.run(documents=[Document(text=t) for t in texts])
    assert nodes
    assert all(n.embedding for n in nodes)
    with TRACER.start_as_current_span("query") as query:
        index = VectorStoreIndex(nodes, embed_model=embed)
        index.as_retriever(similarity_top_k=1).retrieve("which talks about Ray?")
    assert isinstance(ingest, ReadableSpan)
    assert isinstance(query, ReadableSpan)
    calls = _calls(spans)
    batch = [c for c in calls if _under(c, ingest)]
    assert batch
    assert sum((c.attributes or {})["qwen_embed.texts"] for c in batch) == len(nodes)
    assert [c for c in calls if _under(c, query)]
    _no_secrets(spans, ["A long document about pooling.", "which talks about Ray?"])


async def test_llama_index_async_query_nests(
    spans: InMemorySpanExporter, srv: EmbeddingServer
) -> None:
    from qwen_embed_plugins.integrations.llama_index import QwenPooledEmbedding

    embed = QwenPooledEmbedding(base_url=srv.base_url, model_name=MODEL)
    with TRACER.start_as_current_span("query") as query:
        await embed.aget_query_embedding("async question")
        await embed.aget_text_embedding_batch(["x", "y"])
    assert isinstance(query, ReadableSpan)
    calls = _calls(spans)
    assert len(calls) == 2
    assert all(_under(c, query) for c in calls)


# --------------------------------------------------------------------------- off


@pytest.mark.unit
def test_no_span_is_built_while_nothing_records() -> None:
    """With the provider's sampler dropping (as with no provider), a call gets no trace
    object: its requests build no attribute."""
    from qwen_embed_plugins._run import Call
    from qwen_embed_plugins._tracing import start_call, traced

    _install()
    assert not _SWITCH.on
    client = q.EmbeddingClient(base_url="http://127.0.0.1:9/v1", model=MODEL)
    call = Call(started=0.0, deadline=None)
    start_call(client._engine, call, 1)
    assert call.trace is None
    with traced(call):
        pass


_WITHOUT = """
import sys
{block}
from qwen_embed_plugins import EmbeddingClient, _tracing
from qwen_embed_plugins._run import Call
from qwen_embed_tooling.testing import EmbeddingServer

with EmbeddingServer() as srv:
    client = EmbeddingClient(base_url=srv.base_url)
    assert len(client.embed_query("hello")) == srv.dim
    call = Call(started=0.0, deadline=None)
    _tracing.start_call(client._engine, call, 1)
    assert call.trace is None
    # a parent from another process (as a Ray actor gets it): still nothing to record
    parent = {{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}
    with _tracing.attached(parent):
        _tracing.start_call(client._engine, call, 1)
        assert call.trace is None
        assert len(client.embed_query("hello")) == srv.dim
print("{label}", sys.modules.get("opentelemetry") is not None)
"""


@pytest.mark.parametrize(
    ("block", "label", "imported"),
    [
        ("sys.modules['opentelemetry'] = None  # the extra not installed", "absent", "False"),
        ("", "default", "True"),  # the API installed, its default (no-op) provider
    ],
)
def test_without_the_extra_or_a_provider_calls_work_and_trace_nothing(
    block: str, label: str, imported: str
) -> None:
    code = textwrap.dedent(_WITHOUT.format(block=block, label=label))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [label, imported]


# --------------------------------------------------------------------------- Ray


def _ray_worker_exports_spans() -> None:
    """The Ray workers' ``worker_process_setup_hook`` (pickled by value): their tracer
    provider writes each finished span as one JSON line to ``$QWEN_EMBED_TEST_SPANS``."""
    import os

    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    out = open(os.environ["QWEN_EMBED_TEST_SPANS"], "a", buffering=1)  # noqa: SIM115
    provider = TracerProvider()
    exporter = ConsoleSpanExporter(out=out, formatter=lambda s: s.to_json(indent=None) + "\n")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)


@pytest.mark.ray
@pytest.mark.xdist_group("ray")  # one local Ray instance at a time, in one xdist worker
@pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")
def test_ray_actor_calls_are_children_of_the_drivers_span(
    spans: InMemorySpanExporter, srv: EmbeddingServer, tmp_path: Path
) -> None:
    """The driver's current span travels to the actors (W3C headers); the calls they
    make, exported by their own process's provider, are its children."""
    import json

    ray = pytest.importorskip("ray", reason="needs the [ray] extra")
    from ray import cloudpickle

    from qwen_embed_plugins.ray import embed_dataset

    written = tmp_path / "spans.jsonl"
    if ray.is_initialized():  # pragma: no cover - a previous module left one running
        ray.shutdown()
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={
                "worker_process_setup_hook": _ray_worker_exports_spans,
                "env_vars": {"QWEN_EMBED_TEST_SPANS": str(written), "RAY_USAGE_STATS_ENABLED": "0"},
            },
        )
        ray.data.DataContext.get_current().enable_progress_bars = False
        texts = [f"ray-row-{i}" for i in range(40)]
        with TRACER.start_as_current_span("job") as job:
            ds = ray.data.from_items([{"text": t} for t in texts])
            rows = embed_dataset(ds, base_url=srv.base_url, model=MODEL).take_all()
        assert len(rows) == len(texts)
    finally:
        ray.shutdown()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert job.context is not None
    found = [json.loads(line) for line in written.read_text(encoding="utf-8").splitlines()]
    calls = [s for s in found if s["name"] == f"embeddings {MODEL}"]
    assert calls
    for call in calls:
        assert call["context"]["trace_id"] == f"0x{job.context.trace_id:032x}"
        assert call["parent_id"] == f"0x{job.context.span_id:016x}"
        assert call["attributes"]["gen_ai.operation.name"] == "embeddings"
    ids = {c["context"]["span_id"] for c in calls}
    posts = [s for s in found if s["name"] == "POST"]
    assert posts
    assert all(p["parent_id"] in ids for p in posts)
    assert sum(c["attributes"]["qwen_embed.texts"] for c in calls) == len(texts)
    for line in written.read_text(encoding="utf-8").splitlines():
        assert "ray-row-" not in line


# --------------------------------------------------------------------------- the docs

DOC = Path(__file__).resolve().parent.parent / "docs" / "tracing.md"
RUN_HERE = "<!-- run-by: tests/test_tracing.py -->"


def _doc_blocks() -> list[tuple[int, str]]:
    """The ```python blocks of docs/tracing.md marked to run here: each sets the
    process-wide tracer provider, so each runs in a fresh process."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == RUN_HERE and lines[i + 1].strip() == "```python":
            end = lines.index("```", i + 2)
            blocks.append((i + 2, "\n".join(lines[i + 2 : end]) + "\n"))
            i = end
        i += 1
    return blocks


def test_docs_have_the_two_pipelines() -> None:
    blocks = [code for _, code in _doc_blocks()]
    assert len(blocks) == 2
    assert "langchain" in blocks[0]
    assert "llama_index" in blocks[1]


@pytest.mark.parametrize(("line", "code"), _doc_blocks(), ids=lambda v: str(v)[:12])
def test_docs_block_runs(line: int, code: str, srv: EmbeddingServer, tmp_path: Path) -> None:
    """Each marked block runs in a fresh interpreter against a loopback server
    (placeholder hosts rewritten, as tests/test_docs.py does); every
    ``print(...)  # text`` comment must match a printed line, in order."""
    import os
    import re

    source = re.sub(r"https?://[A-Za-z0-9.\-]+(?::\d+)?/v1\b", srv.base_url, code)
    script = tmp_path / f"tracing_md_{line}.py"
    script.write_text(source, encoding="utf-8")
    env = {**os.environ, "QWEN_EMBED_BASE_URL": srv.base_url}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=False, env=env
    )
    assert out.returncode == 0, out.stderr
    assert srv.requests > 0
    printed = iter(s.strip() for s in out.stdout.splitlines())
    for want in re.findall(r"^\s*print\(.*\)\s+#\s*(.+?)\s*$", code, re.M):
        assert any(s == want for s in printed), (want, out.stdout)
