"""Issue 32 item 1 / issue 30 item 5: the adapters are drop-ins for the stock classes
down to the call, and ``timeout=`` means one thing everywhere.

- docs/migration.md's table is checked against the signatures of the stock classes
  installed (``OpenAIEmbeddings``, ``OpenAIEmbedding``, ``OpenAILikeEmbedding``): every
  stock keyword, at construction or per call, is listed and is either accepted or
  refused with a hint (never "unknown parameter").
- A LangChain app and a LlamaIndex app written for the stock classes run unchanged but
  for the class, per-call arguments included, against a loopback server; the stock
  classes run the same code against the same server and get the same document vectors.
- ``on_error="skip"``: empty and refused texts get a zero vector in a real vector store
  and a real ``IngestionPipeline``.
- ``timeout=``: a number, ``httpx.Timeout`` or a tuple, the same in the core and both
  adapters, never shortened by a default; short timeouts against a stalling server on
  the sync, async and adapter paths.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_openai import OpenAIEmbeddings
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.ingestion import IngestionPipeline
from llama_index.embeddings.openai import OpenAIEmbedding
from llama_index.embeddings.openai_like import OpenAILikeEmbedding
from recording_server import RecordingServer

import qwen_embed_plugins as q
from qwen_embed_plugins.integrations._names import REFUSED_HINTS
from qwen_embed_plugins.integrations.langchain import PER_CALL, QwenPooledEmbeddings
from qwen_embed_plugins.integrations.llama_index import QwenPooledEmbedding
from qwen_embed_tooling.testing import EmbeddingServer

ROOT = Path(__file__).resolve().parents[1]
UNUSED_URL = "http://127.0.0.1:9/v1"
MODEL = "Qwen/Qwen3-Embedding-0.6B"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("QWEN_EMBED_API_KEY", "QWEN_EMBED_BASE_URL", "QWEN_EMBED_MODEL"):
        monkeypatch.delenv(name, raising=False)
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_API_BASE"):
        monkeypatch.delenv(name, raising=False)


# --------------------------------------------------------------------------- the stock names


def _pydantic_names(cls: type[Any]) -> dict[str, Any]:
    """Every keyword a pydantic class takes (fields and their aliases), with its default."""
    names: dict[str, Any] = {}
    for name, info in cls.model_fields.items():
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        names[name] = default
        if info.alias:
            names[info.alias] = default
    return names


def _init_names(cls: type[Any]) -> dict[str, Any]:
    """The named parameters of ``cls.__init__`` with their defaults (``None`` if none)."""
    names = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        names[name] = None if param.default is param.empty else param.default
    return names


STOCK: dict[str, dict[str, Any]] = {
    "LangChain": _pydantic_names(OpenAIEmbeddings),
    "LlamaIndex": {
        **_pydantic_names(OpenAIEmbedding),
        **_init_names(OpenAIEmbedding),
        **_pydantic_names(OpenAILikeEmbedding),
        **_init_names(OpenAILikeEmbedding),
    },
}
OURS: dict[str, type[Any]] = {"LangChain": QwenPooledEmbeddings, "LlamaIndex": QwenPooledEmbedding}

# The stock per-call keywords: embed_documents' named parameters and what its **kwargs
# reach, the SDK's embeddings.create.
CREATE = {
    name
    for name in inspect.signature(openai.resources.embeddings.Embeddings.create).parameters
    if name not in ("self", "input")
}
PER_CALL_STOCK = {
    name
    for method in ("embed_documents", "aembed_documents", "embed_query", "aembed_query")
    for name, p in inspect.signature(getattr(OpenAIEmbeddings, method)).parameters.items()
    if name not in ("self", "texts", "text") and p.kind is not p.VAR_KEYWORD
} | CREATE


def _table_rows(heading: str) -> list[list[str]]:
    """The rows of the first table under ``heading`` in docs/migration.md."""
    text = (ROOT / "docs" / "migration.md").read_text(encoding="utf-8")
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[1:]]


def _listed(adapter: str) -> set[str]:
    listed: set[str] = set()
    for row in _table_rows("Parameters"):
        if row[1] in (adapter, "both"):
            listed.update(re.findall(r"`([a-z_]+)`", row[0]))
    return listed


@pytest.mark.unit
def test_the_stock_signatures_are_read() -> None:
    """The names this module checks come from the installed classes (a guard against
    an empty set passing every check below)."""
    assert {"chunk_size", "model_kwargs", "request_timeout", "api_version"} <= set(
        STOCK["LangChain"]
    )
    assert {"mode", "api_base", "api_version", "reuse_client", "model_name"} <= set(
        STOCK["LlamaIndex"]
    )
    assert {"chunk_size", "dimensions", "user", "extra_headers", "timeout"} <= PER_CALL_STOCK


@pytest.mark.unit
@pytest.mark.parametrize("adapter", ["LangChain", "LlamaIndex"])
def test_every_stock_keyword_is_in_the_migration_table(adapter: str) -> None:
    missing = set(STOCK[adapter]) - _listed(adapter)
    assert not missing, f"docs/migration.md does not list {adapter} parameters {sorted(missing)}"


@pytest.mark.unit
def test_every_stock_per_call_keyword_is_in_the_migration_table() -> None:
    listed = {
        n
        for row in _table_rows("Per-call arguments (LangChain)")
        for n in re.findall(r"`([a-z_]+)`", row[0])
    }
    assert PER_CALL_STOCK - listed == set()
    assert PER_CALL | {"chunk_size"} >= PER_CALL_STOCK


def _construct(adapter: str, name: str, value: Any) -> Any:
    cls = OURS[adapter]
    base = "api_base" if adapter == "LlamaIndex" and name == "base_url" else "base_url"
    kwargs = {name: value}
    if name not in ("base_url", "openai_api_base", "api_base"):
        kwargs[base] = UNUSED_URL
    return cls(**kwargs)


@pytest.mark.unit
@pytest.mark.parametrize("adapter", ["LangChain", "LlamaIndex"])
def test_every_stock_keyword_at_its_stock_default_is_accepted_or_refused_with_a_hint(
    adapter: str,
) -> None:
    """Each stock keyword, given its stock default (what a copied constructor call most
    often holds): accepted, or refused with the hint of REFUSED_HINTS naming the
    replacement; never "unknown parameter" or pydantic's bare "Extra inputs"."""
    for name, default in STOCK[adapter].items():
        value = UNUSED_URL if name in ("base_url", "openai_api_base", "api_base") else default
        if name in ("model", "model_name") and not isinstance(value, str):
            value = MODEL
        try:
            _construct(adapter, name, value)
        except ValueError as exc:
            message = str(exc)
            assert name in REFUSED_HINTS, (name, message)
            assert REFUSED_HINTS[name] in message, (name, message)
            assert "unknown parameter" not in message
            assert "Extra inputs" not in message


@pytest.mark.unit
@pytest.mark.parametrize("adapter", ["LangChain", "LlamaIndex"])
def test_the_table_says_what_the_adapter_does(adapter: str) -> None:
    """A name the table calls "refused" is refused (with its hint) for a value that asks
    for something; every other name listed is accepted."""
    samples = {"deployment": "emb", "api_version": "2024-01-01", "openai_api_version": "v"}
    for row in _table_rows("Parameters"):
        if row[1] not in (adapter, "both") or row[0] == "anything else":
            continue
        for name in re.findall(r"`([a-z_]+)`", row[0]):
            if row[2] == "refused":
                value = samples.get(name, object())
                with pytest.raises(ValueError, match=re.escape(REFUSED_HINTS[name])):
                    _construct(adapter, name, value)
            else:
                assert (
                    name in OURS[adapter].model_fields
                    or name in OURS[adapter]._stock.aliases
                    or (name in OURS[adapter]._stock.harmless)
                ), name


@pytest.mark.unit
def test_llama_index_takes_the_model_first_mode_and_api_version_none() -> None:
    from llama_index.embeddings.openai import OpenAIEmbeddingMode

    emb = QwenPooledEmbedding(
        "my-model",
        api_base=UNUSED_URL,
        mode=OpenAIEmbeddingMode.TEXT_SEARCH_MODE,
        api_version=None,
        http_client=None,
    )
    assert emb.model_name == emb.config.model == "my-model"
    assert QwenPooledEmbedding("m", api_base=UNUSED_URL, mode="similarity").model_name == "m"
    with pytest.raises(ValueError, match="only mode='similarity' or mode='text_search'"):
        QwenPooledEmbedding("m", api_base=UNUSED_URL, mode="code")
    with pytest.raises(ValueError, match="Azure OpenAI is not supported"):
        QwenPooledEmbedding("m", api_base=UNUSED_URL, api_version="2024-01-01")
    with pytest.raises(ValueError, match="pass either 'model_name' or 'model'"):
        QwenPooledEmbedding("m", model="n", api_base=UNUSED_URL)


@pytest.mark.unit
def test_langchain_per_call_names_are_refused_with_a_hint() -> None:
    emb = QwenPooledEmbeddings(base_url=UNUSED_URL)
    with pytest.raises(q.ConfigError, match="extra_query is not supported: URL query"):
        emb.embed_documents(["a"], extra_query={"v": "1"})
    with pytest.raises(q.ConfigError, match="did you mean 'chunk_size'"):
        emb.embed_documents(["a"], chunk_sise=2)
    with pytest.raises(q.ConfigError, match="unknown per-call argument 'zzz'") as unknown:
        emb.embed_query("a", zzz=1)
    assert "extra_query" not in str(unknown.value)  # refused: not listed as accepted
    assert "chunk_size" in str(unknown.value)
    with pytest.raises(q.ConfigError, match="batch_size"):
        emb.embed_documents(["a"], chunk_size=5000)  # out of range, as at construction


# --------------------------------------------------------------------------- OPENAI_* variables


@pytest.mark.unit
@pytest.mark.parametrize("build", [QwenPooledEmbeddings, QwenPooledEmbedding, q.EmbeddingClient])
def test_openai_variables_alone_are_named_as_not_read(
    build: Callable[[], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    key = "sk-openai-real-key-123456"
    monkeypatch.setenv("OPENAI_API_KEY", key)
    monkeypatch.setenv("OPENAI_BASE_URL", "http://gpu-box:30000/v1")
    with pytest.raises(ValueError, match="base_url is required") as info:
        build()
    message = str(info.value)
    assert "base_url is required" in message
    assert "OPENAI_BASE_URL, OPENAI_API_KEY are set but deliberately not read" in message
    assert "QWEN_EMBED_BASE_URL" in message
    assert "QWEN_EMBED_API_KEY" in message
    assert key not in message
    monkeypatch.delenv("OPENAI_API_KEY")
    monkeypatch.delenv("OPENAI_BASE_URL")
    with pytest.raises(ValueError, match="base_url is required") as plain:
        build()
    assert "OPENAI" not in str(plain.value)


# --------------------------------------------------------------------------- timeout=


@pytest.mark.unit
def test_timeout_number_bounds_every_phase_and_the_total_and_no_default_cuts_it() -> None:
    config = q.EmbeddingConfig(base_url=UNUSED_URL, timeout=500)
    assert config.timeouts == q.Timeouts(connect=500, read=500, write=500, pool=500, total=500)
    assert config.retry.deadline == 500
    assert config.retry.query_deadline == 500
    client = q.EmbeddingClient(base_url=UNUSED_URL, timeout=500)
    assert client.config.timeouts == config.timeouts
    assert client.config.retry == config.retry
    # an explicit deadline is kept; a short timeout leaves the default deadlines alone
    kept = q.EmbeddingClient(base_url=UNUSED_URL, timeout=500, deadline=30)
    assert kept.config.retry.deadline == 30
    short = q.EmbeddingConfig(base_url=UNUSED_URL, timeout=5)
    assert (short.retry.deadline, short.retry.query_deadline) == (300.0, 15.0)
    unlimited = q.EmbeddingConfig(base_url=UNUSED_URL, timeout=None)
    assert unlimited.timeouts.total is None
    assert unlimited.retry.query_deadline is None


@pytest.mark.unit
@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (
            httpx.Timeout(60.0, connect=5.0),
            q.Timeouts(connect=5.0, read=60.0, write=60.0, pool=60.0, total=185.0),
        ),
        ((3.0, 40.0), q.Timeouts(connect=3.0, read=40.0, write=40.0, pool=40.0, total=123.0)),
        ((1.0, 2.0, 3.0, 4.0), q.Timeouts(connect=1.0, read=2.0, write=3.0, pool=4.0, total=10.0)),
        (
            httpx.Timeout(None, connect=2.0),
            q.Timeouts(connect=2.0, read=None, write=None, pool=None, total=None),
        ),
    ],
)
def test_timeout_takes_httpx_timeout_and_tuples_everywhere(
    given: Any, expected: q.Timeouts
) -> None:
    assert q.EmbeddingConfig(base_url=UNUSED_URL, timeout=given).timeouts == expected
    assert q.AsyncEmbeddingClient(base_url=UNUSED_URL, timeout=given).config.timeouts == expected
    lc = QwenPooledEmbeddings(base_url=UNUSED_URL, request_timeout=given)
    assert lc.config.timeouts == expected
    assert QwenPooledEmbedding(api_base=UNUSED_URL, timeout=given).config.timeouts == expected


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["30", (1.0,), (1.0, "2"), True, [1.0, 2.0]])
def test_timeout_of_another_type_is_refused_by_every_surface(bad: Any) -> None:
    with pytest.raises(q.ConfigError, match="timeout"):
        q.EmbeddingConfig(base_url=UNUSED_URL, timeout=bad)
    with pytest.raises(ValueError, match="timeout"):
        QwenPooledEmbeddings(base_url=UNUSED_URL, timeout=bad)
    with pytest.raises(ValueError, match="timeout"):
        QwenPooledEmbedding(api_base=UNUSED_URL, timeout=bad)


@pytest.fixture
def stalling() -> Iterator[EmbeddingServer]:
    """A server whose every request stalls (answered only when the server stops)."""
    with EmbeddingServer() as server:
        for _ in range(8):
            server.inject("delay", seconds=600.0)
        yield server


STALL_SURFACES = [
    "sync",
    "async",
    "langchain",
    "langchain-async",
    "llama-index",
    "llama-index-async",
]


def _stalled_call(surface: str, url: str, timeout: Any) -> None:
    settings: dict[str, Any] = {"max_retries": 0}
    if surface == "sync":
        q.EmbeddingClient(base_url=url, timeout=timeout, **settings).embed_documents(["a"])
    elif surface == "async":
        client = q.AsyncEmbeddingClient(base_url=url, timeout=timeout, **settings)
        asyncio.run(client.embed_documents(["a"]))
    elif surface.startswith("langchain"):
        lc = QwenPooledEmbeddings(base_url=url, **settings)
        if surface.endswith("async"):
            asyncio.run(lc.aembed_documents(["a"], timeout=timeout))  # per call
        else:
            QwenPooledEmbeddings(base_url=url, timeout=timeout, **settings).embed_documents(["a"])
    else:
        li = QwenPooledEmbedding(api_base=url, timeout=timeout, **settings)
        if surface.endswith("async"):
            asyncio.run(li.aget_text_embedding_batch(["a"]))
        else:
            li.get_text_embedding_batch(["a"])


@pytest.mark.parametrize("surface", STALL_SURFACES)
@pytest.mark.parametrize("timeout", [0.3, (2.0, 0.3), httpx.Timeout(0.3)])
def test_a_short_timeout_ends_a_stalled_request_on_every_surface(
    stalling: EmbeddingServer, surface: str, timeout: Any
) -> None:
    with pytest.raises(q.ReadTimeout) as info:
        _stalled_call(surface, stalling.base_url, timeout)
    # the 0.3 s given ended it (read phase or total), not a default of another size
    assert "0.3 s" in str(info.value), str(info.value)
    assert stalling.requests == 1  # max_retries=0: one request, cut by the timeout


# --------------------------------------------------------------------------- per-call arguments


def test_langchain_per_call_arguments_reach_the_wire_sync_and_async() -> None:
    with RecordingServer() as rec:
        emb = QwenPooledEmbeddings(
            base_url=rec.base_url, default_headers={"X-Tenant": "acme"}, model_kwargs={"a": 1}
        )
        texts = ["one", "two", "three", "four", "five"]
        per_call = {
            "model": "other-model",
            "dimensions": 64,
            "encoding_format": "float",
            "user": "u-7",
            "extra_headers": {"X-Call": "c1"},
            "extra_body": {"b": 2},
            "timeout": 30,
        }
        vectors = emb.embed_documents(texts, chunk_size=2, **per_call)
        assert [len(v) for v in vectors] == [64] * 5
        sent = rec.all()
        assert sorted(len(r.body["input"]) for r in sent) == [1, 2, 2]  # concurrent
        assert any(r.body.get("dimensions") == 64 for r in sent)
        for r in sent:
            assert r.body["model"] == "other-model"
            # the recording server ignores `dimensions` (1024 back): the client learns that
            # from the first answer and slices client-side, so later requests may omit it
            assert r.body.get("dimensions", 64) == 64
            assert "encoding_format" not in r.body  # float: the API default, not sent
            assert (r.body["user"], r.body["a"], r.body["b"]) == ("u-7", 1, 2)
            assert (r.headers["x-tenant"], r.headers["x-call"]) == ("acme", "c1")
        # the next call without arguments has the instance's own settings again
        emb.embed_documents(texts)
        plain = rec.all()[3:]
        assert all(r.body["model"] == MODEL and "user" not in r.body for r in plain)
        assert all("x-call" not in r.headers for r in plain)
        assert len(plain) == 1  # batch_size="auto": one request

        async def run() -> None:
            await emb.aembed_documents(texts, chunk_size=4, user="u-async")
            await emb.aembed_query("q?", model="query-model", dimensions=32)

        asyncio.run(run())
        tail = rec.all()[4:]
        assert sorted(len(r.body["input"]) for r in tail[:2]) == [1, 4]
        assert tail[2].body["input"] == ["q?"]  # not a Qwen3 model: sent raw
        assert {r.body["user"] for r in tail[:2]} == {"u-async"}
        assert (tail[2].body["model"], tail[2].body["dimensions"]) == ("query-model", 32)
        assert len(emb.embed_query("q?", user="u-q")) == 1024
        assert rec.all()[-1].body["user"] == "u-q"


# --------------------------------------------------------------------------- on_error="skip"


def test_langchain_skip_gives_empty_and_refused_texts_a_zero_vector_in_a_vector_store(
    srv: EmbeddingServer,
) -> None:
    srv.poison("a refused text")
    try:
        emb = QwenPooledEmbeddings(base_url=srv.base_url, on_error="skip")
        texts = ["Paris is in France.", "", "a refused text", "Tokyo is in Japan.", "   "]
        store = InMemoryVectorStore(embedding=emb)
        store.add_texts(texts)  # one vector per text, in order
        found = store.similarity_search("Tokyo is in Japan.", k=1)
        assert found[0].page_content == "Tokyo is in Japan."
        vectors = emb.embed_documents(texts)
        assert sorted(vectors.errors) == [1, 2, 4]  # type: ignore[attr-defined]
        assert all(len(v) == 1024 for v in vectors)
        assert [any(v) for v in vectors] == [True, False, False, True, False]
        # per call, and raising by default
        strict = QwenPooledEmbeddings(base_url=srv.base_url)
        assert len(strict.embed_documents(texts, on_error="skip")) == 5
        with pytest.raises(q.InputError, match="index 1"):
            strict.embed_documents(texts)

        async def run() -> list[list[float]]:
            return await emb.aembed_documents(texts)

        assert [any(v) for v in asyncio.run(run())] == [True, False, False, True, False]
    finally:
        srv.clear_rules()


def test_llama_index_skip_in_an_ingestion_pipeline(srv: EmbeddingServer) -> None:
    srv.poison("a refused text")
    try:
        emb = QwenPooledEmbedding(api_base=srv.base_url, on_error="skip", embed_batch_size=2)
        docs = [Document(text=t) for t in ["Paris is in France.", "", "a refused text", "Tokyo."]]
        nodes = IngestionPipeline(transformations=[emb]).run(documents=docs)
        assert [any(n.embedding or []) for n in nodes] == [True, False, False, True]
        assert all(len(n.embedding or []) == 1024 for n in nodes)
        anodes = asyncio.run(IngestionPipeline(transformations=[emb]).arun(documents=docs))
        assert [any(n.embedding or []) for n in anodes] == [True, False, False, True]
        strict = QwenPooledEmbedding(api_base=srv.base_url)
        with pytest.raises(q.InputError, match="index 1"):
            IngestionPipeline(transformations=[strict]).run(documents=docs)
    finally:
        srv.clear_rules()


# --------------------------------------------------------------------------- the apps


def langchain_app(embeddings_class: type[Any], base_url: str) -> dict[str, Any]:
    """A LangChain app written for ``OpenAIEmbeddings``: only the class changes. Its key
    rotates: a callable, called for each request (as langchain-openai 1.x calls it)."""
    keys: list[str] = []

    def rotating_key() -> str:
        keys.append(f"sk-rotating-{len(keys)}")
        return keys[-1]

    embeddings = embeddings_class(
        model=MODEL,
        base_url=base_url,
        api_key=rotating_key,
        check_embedding_ctx_length=False,
        chunk_size=2,
        timeout=30,
        max_retries=2,
        default_headers={"X-Tenant": "acme"},
        model_kwargs={"user": "rag-app"},
    )
    texts = ["Paris is the capital of France.", "Tokyo is the capital of Japan.", "Rome."]
    store = InMemoryVectorStore.from_texts(texts, embedding=embeddings)
    retriever = store.as_retriever(search_kwargs={"k": 1})
    hits = retriever.invoke("Tokyo is the capital of Japan.")
    per_call = embeddings.embed_documents(texts, chunk_size=1, user="per-call")
    query = embeddings.embed_query("capital of Japan?", user="per-call")

    async def run() -> tuple[list[list[float]], list[float]]:
        return (
            await embeddings.aembed_documents(texts, chunk_size=3),
            await embeddings.aembed_query("capital of Japan?"),
        )

    adocs, aquery = asyncio.run(run())
    return {
        "hits": [d.page_content for d in hits],
        "docs": per_call,
        "adocs": adocs,
        "q": query,
        "aq": aquery,
        "keys": len(keys),
    }


def llama_index_app(embed_class: type[Any], base_url: str) -> dict[str, Any]:
    """A LlamaIndex app written for ``OpenAILikeEmbedding``: only the class changes."""
    embed_model = embed_class(
        MODEL,
        api_base=base_url,
        api_key="fake",
        embed_batch_size=2,
        timeout=30.0,
        max_retries=2,
        default_headers={"X-Tenant": "acme"},
        additional_kwargs={"user": "rag-app"},
        reuse_client=True,
    )
    docs = [Document(text=t) for t in ["Paris is in France.", "Tokyo is in Japan.", "Rome."]]
    nodes = IngestionPipeline(transformations=[embed_model]).run(documents=docs)
    index = VectorStoreIndex(nodes, embed_model=embed_model)
    hits = index.as_retriever(similarity_top_k=1).retrieve("Tokyo is in Japan.")
    batch = embed_model.get_text_embedding_batch([d.text for d in docs])
    abatch = asyncio.run(embed_model.aget_text_embedding_batch([d.text for d in docs]))
    return {"nodes": [n.embedding for n in nodes], "batch": batch, "abatch": abatch, "hits": hits}


def _stock_run(app: Callable[[type[Any], str], dict[str, Any]], cls: type[Any], url: str) -> Any:
    """``app`` with a stock class. Their async openai clients leave their sockets open
    when ``asyncio.run`` closes the loop: collected here, their ResourceWarning ignored
    (this library's adapters run under the suite's warnings-as-errors)."""
    result = app(cls, url)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    return result


def test_a_langchain_app_for_the_stock_class_runs_unchanged(srv: EmbeddingServer) -> None:
    stock = _stock_run(langchain_app, OpenAIEmbeddings, srv.base_url)
    stock_requests = srv.requests
    srv.reset_counters()
    ours = langchain_app(QwenPooledEmbeddings, srv.base_url)
    assert srv.requests > 0
    assert stock_requests > 0
    # the stock query is sent raw, so it finds its own text; ours gets the Qwen3
    # instruction (a different vector from this test server), so it finds some text
    assert stock["hits"] == ["Tokyo is the capital of Japan."]
    assert len(ours["hits"]) == 1
    for key in ("docs", "adocs"):  # documents: the same vectors
        np.testing.assert_allclose(ours[key], stock[key], atol=1e-6)
    assert len(ours["q"]) == len(ours["aq"]) == len(stock["q"])
    assert stock["keys"] >= 1
    assert ours["keys"] == srv.requests  # the rotating key: called once per request


def test_a_llama_index_app_for_the_stock_class_runs_unchanged(srv: EmbeddingServer) -> None:
    stock = _stock_run(llama_index_app, OpenAILikeEmbedding, srv.base_url)
    ours = llama_index_app(QwenPooledEmbedding, srv.base_url)
    for key in ("nodes", "batch", "abatch"):
        np.testing.assert_allclose(ours[key], stock[key], atol=1e-6)
    assert [h.node.get_content() for h in stock["hits"]] == ["Tokyo is in Japan."]
    assert len(ours["hits"]) == 1  # the query gets the Qwen3 instruction here
