"""Server dialects (issue 7): every server profile against `EmbeddingServer(dialect=...)`.

The conformance suite runs, for each of the eight dialects, through the core clients
(sync and async) and both adapters (LangChain ``QwenPooledEmbeddings``, LlamaIndex
``QwenPooledEmbedding``): exact vectors in input order, batch limits respected from the
first request (server-side request log), ``dimensions`` always unit length and equal to
slice + renormalise, errors mapped with the server's message, detection, ``server=``.
Then unit tests of the detection functions.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins import _pool as pool
from qwen_embed_plugins import _servers as servers
from qwen_embed_plugins.errors import (
    BadRequestError,
    ContextLengthError,
    HTTPStatusError,
    OverloadedError,
    RateLimitError,
)
from qwen_embed_plugins.integrations.langchain import QwenPooledEmbeddings
from qwen_embed_plugins.integrations.llama_index import QwenPooledEmbedding
from qwen_embed_tooling.testing import (
    DIALECTS,
    EmbeddingServer,
    expected_embedding,
    expected_embeddings,
)

NAMES = list(DIALECTS)
TEXTS = [f"passage {i}: the quick brown fox {i * 7919 % 997}" for i in range(150)]
QUERY = "where does the fox live?"
LIMITS = {"tei": 32, "infinity": 2048, "dashscope": 10, "siliconflow": 64}
# What a 429/503 of the server's own overload answer becomes.
OVERLOAD = {
    "sglang": (503, OverloadedError),
    "vllm": (503, OverloadedError),
    "ollama": (503, OverloadedError),
    "llamacpp": (503, OverloadedError),
    "tei": (429, OverloadedError),
    "infinity": (429, OverloadedError),
    "dashscope": (429, RateLimitError),
    "siliconflow": (429, RateLimitError),
}
NO_RETRY = q.RetryConfig(max_attempts=1, circuit_failure_threshold=0)


# Servers recognised only from their answers (no /models probe before the first request):
# their batch limit is learned from the first refusal instead of applied up front.
LEARNED_LIMIT = {"tei", "siliconflow"}
# Answers indistinguishable from a generic OpenAI-compatible server's (same behaviour).
SEEN_AS = {"ollama": "openai"}


def batches_ok(srv: EmbeddingServer, limit: int | None, refusals: int = 0) -> list[int]:
    responses = srv.stats()["responses"]
    refused = sum(n for status, n in responses.items() if status != "200")
    assert refused <= refusals, responses
    sizes = [len(batch) for batch in srv.received]
    if limit is not None:  # only the refused requests may be over the limit
        assert sum(1 for size in sizes if size > limit) <= refused, sizes
    return sizes


def close(a: Any, b: np.ndarray) -> None:
    np.testing.assert_allclose(np.asarray(a, dtype=np.float32), b, rtol=0, atol=2e-6)


def unit(rows: Any) -> None:
    norms = np.linalg.norm(np.asarray(rows, dtype=np.float64), axis=-1)
    np.testing.assert_allclose(norms, 1.0, atol=1e-5)


@pytest.fixture(scope="module", params=NAMES)
def module_server(request: pytest.FixtureRequest) -> Iterator[EmbeddingServer]:
    with EmbeddingServer(dialect=request.param) as srv:
        yield srv
    q.close_all()


@pytest.fixture
def untaught(module_server: EmbeddingServer) -> EmbeddingServer:
    """The module's server with zeroed counters and no faults; the process knows nothing
    of it (``reset()`` before each test)."""
    module_server.clear_faults()
    module_server.reset_counters()
    return module_server


@pytest.fixture
def srv(untaught: EmbeddingServer) -> EmbeddingServer:
    """The module's server, its batch limit already known to the process (as after the
    first call of a long-running one) where it is learned from a refusal; counters
    zeroed after that lesson."""
    if untaught.dialect in LEARNED_LIMIT:
        teacher = q.EmbeddingClient(base_url=untaught.base_url, batch_size=100, max_concurrency=1)
        teacher.embed_documents(TEXTS[:100])
        untaught.reset_counters()
    return untaught


def probes(key: Any) -> list[str]:
    """Requests other than embeddings sent through the sync pool of ``key`` (a spy on
    the shared transport's ``send``, which every request of the pool goes through)."""
    seen: list[str] = []
    transport = pool.sync_transport(key)
    send = transport.send

    def spy(req: Any) -> Any:
        if not req.url.endswith("/embeddings"):
            seen.append(f"{req.method} {req.url}")
        return send(req)

    transport.send = spy  # type: ignore[method-assign]
    return seen


# --------------------------------------------------------------------------- core clients


def test_sync_client_vectors_limits_detection(untaught: EmbeddingServer) -> None:
    srv = untaught  # the limit is learned here
    client = q.EmbeddingClient(base_url=srv.base_url, batch_size=100, max_concurrency=2)
    vectors = client.embed_documents(TEXTS)
    close(vectors, expected_embeddings(TEXTS))
    learned = srv.dialect in LEARNED_LIMIT
    sizes = batches_ok(srv, LIMITS.get(srv.dialect), refusals=2 if learned else 0)
    limit = min(100, LIMITS.get(srv.dialect, 100))
    if not learned:
        assert len(sizes) == math.ceil(len(TEXTS) / limit)  # the limit applied up front
    assert client.server is not None
    assert client.server.profile.name == SEEN_AS.get(srv.dialect, srv.dialect)
    query = client.embed_query(QUERY)
    close(query, expected_embedding(q.format_query(QUERY, q.DEFAULT_QUERY_TASK)))
    unit(vectors)


async def test_async_client_vectors_limits(untaught: EmbeddingServer) -> None:
    srv = untaught  # the limit is learned here
    client = q.AsyncEmbeddingClient(base_url=srv.base_url, batch_size=100, max_concurrency=3)
    vectors = await client.embed_documents(TEXTS[::-1])
    close(vectors, expected_embeddings(TEXTS[::-1]))
    batches_ok(srv, LIMITS.get(srv.dialect), refusals=3 if srv.dialect in LEARNED_LIMIT else 0)
    assert client.server is not None
    assert client.server.profile.name == SEEN_AS.get(srv.dialect, srv.dialect)
    query = await client.embed_query_array(QUERY)
    close(query, expected_embedding(q.format_query(QUERY, q.DEFAULT_QUERY_TASK)))


@pytest.mark.parametrize("dimensions", [32, 100, 256])
def test_dimensions_unit_and_equal_to_slice(srv: EmbeddingServer, dimensions: int) -> None:
    client = q.EmbeddingClient(base_url=srv.base_url, dimensions=dimensions, batch_size=64)
    texts = TEXTS[:40]
    arr = client.embed_documents_array(texts)
    assert arr.shape == (40, dimensions)
    unit(arr)
    close(arr, expected_embeddings(texts, dimensions=dimensions))
    responses = srv.stats()["responses"]
    if srv.dialect in ("sglang", "vllm"):  # no matryoshka override: refused once, then local
        assert responses.get("400", 0) <= 1
    else:  # every other server: handled from its profile, never a refused request
        assert set(responses) == {"200"}, responses


async def test_dimensions_async(srv: EmbeddingServer) -> None:
    client = q.AsyncEmbeddingClient(base_url=srv.base_url, dimensions=64)
    arr = await client.embed_documents_array(TEXTS[:12])
    unit(arr)
    close(arr, expected_embeddings(TEXTS[:12], dimensions=64))


def test_overload_error_mapped_with_server_message(srv: EmbeddingServer) -> None:
    status, kind = OVERLOAD[srv.dialect]
    dialect = DIALECTS[srv.dialect]
    client = q.EmbeddingClient(base_url=srv.base_url, retry=NO_RETRY)
    client.embed_documents(["warm-up"])  # detection done
    srv.inject("status", status=status)
    with pytest.raises(HTTPStatusError) as info:
        client.embed_documents(["overloaded"])
    assert type(info.value) is kind
    assert info.value.status == status
    expected = dialect.overload_message
    if srv.dialect == "vllm":
        expected = "Service Unavailable"
    assert info.value.message == expected


async def test_stated_batch_limit_learned(srv: EmbeddingServer) -> None:
    with EmbeddingServer(dialect=srv.dialect, max_batch=5) as small:
        client = q.AsyncEmbeddingClient(base_url=small.base_url, batch_size=12, max_concurrency=1)
        vectors = await client.embed_documents(TEXTS[:30])
        close(vectors, expected_embeddings(TEXTS[:30]))
        sizes = [len(b) for b in small.received]
        assert sizes[-1] <= 5
        errors = {k: v for k, v in small.stats()["responses"].items() if k != "200"}
        assert sum(errors.values()) == 1, errors  # one refused request, then split


def test_bad_request_keeps_server_message(srv: EmbeddingServer) -> None:
    client = q.EmbeddingClient(base_url=srv.base_url, retry=NO_RETRY, max_text_chars=None)
    client.embed_documents(["warm-up"])
    too_long = "x" * 140_000
    if srv.dialect == "llamacpp":  # a 500 there ("increase the physical batch size")
        with pytest.raises(HTTPStatusError) as info:
            client.embed_documents([too_long])
        assert info.value.status == 500
        assert "physical batch size" in info.value.message
        return
    with pytest.raises(BadRequestError) as info:
        client.embed_documents([too_long])
    assert info.value.message
    assert info.value.status in (400, 413, 422)
    if srv.dialect == "tei":
        assert isinstance(info.value, ContextLengthError)
        assert info.value.status == 413


# --------------------------------------------------------------------------- adapters


def test_langchain_adapter(srv: EmbeddingServer) -> None:
    embed = QwenPooledEmbeddings(base_url=srv.base_url, batch_size=100)
    docs = TEXTS[:90]
    close(embed.embed_documents(docs), expected_embeddings(docs))
    close(embed.embed_query(QUERY), expected_embedding(q.format_query(QUERY, q.DEFAULT_QUERY_TASK)))
    batches_ok(srv, LIMITS.get(srv.dialect))


async def test_langchain_adapter_async(srv: EmbeddingServer) -> None:
    embed = QwenPooledEmbeddings(base_url=srv.base_url, batch_size=100, dimensions=128)
    docs = TEXTS[10:80]
    vectors = await embed.aembed_documents(docs)
    close(vectors, expected_embeddings(docs, dimensions=128))
    query = await embed.aembed_query(QUERY)
    close(query, expected_embedding(q.format_query(QUERY, q.DEFAULT_QUERY_TASK), dimensions=128))
    unit([*vectors, query])
    sizes = [len(b) for b in srv.received]
    assert max(sizes) <= LIMITS.get(srv.dialect, 100)


def test_llama_index_adapter(srv: EmbeddingServer) -> None:
    embed = QwenPooledEmbedding(base_url=srv.base_url, embed_batch_size=100)
    docs = TEXTS[:120]
    close(embed.get_text_embedding_batch(docs), expected_embeddings(docs))
    batches_ok(srv, LIMITS.get(srv.dialect))


async def test_llama_index_adapter_async(srv: EmbeddingServer) -> None:
    embed = QwenPooledEmbedding(base_url=srv.base_url, embed_batch_size=50, dimensions=200)
    query = await embed.aget_query_embedding(QUERY)
    close(query, expected_embedding(q.format_query(QUERY, q.DEFAULT_QUERY_TASK), dimensions=200))
    vectors = await embed.aget_text_embedding_batch(TEXTS[:60])
    close(vectors, expected_embeddings(TEXTS[:60], dimensions=200))
    unit(vectors)


# --------------------------------------------------------------------------- detection


def test_detection_costs_no_request() -> None:
    """The server is identified from its first answer: no probe before (or after) it."""
    with EmbeddingServer(dialect="vllm") as srv:
        client = q.EmbeddingClient(base_url=srv.base_url)
        seen = probes(client.config.pool_key)
        assert client.server is None  # nothing sent yet
        for _ in range(3):
            q.EmbeddingClient(base_url=srv.base_url).embed_documents(["a", "b"])
        QwenPooledEmbeddings(base_url=srv.base_url).embed_query("c")
        assert seen == []
        assert srv.requests == 4
        found = client.server
        assert found is not None
        assert found.profile.name == "vllm"
        assert "embd-" in found.source


def test_server_setting_skips_detection_and_applies_profile() -> None:
    with EmbeddingServer() as srv:  # SGLang, but told it is TEI
        client = q.EmbeddingClient(base_url=srv.base_url, server="tei", batch_size=100)
        seen = probes(client.config.pool_key)
        client.embed_documents(TEXTS[:70])
        assert seen == []
        assert sorted(len(b) for b in srv.received) == [6, 32, 32]  # sent concurrently
        assert client.server is not None
        assert client.server.source == "server= setting"
        lc = QwenPooledEmbeddings(base_url=srv.base_url, server="dashscope", batch_size=100)
        assert lc.config.server == "dashscope"
        li = QwenPooledEmbedding(base_url=srv.base_url, server="siliconflow")
        assert li.config.server == "siliconflow"
    with pytest.raises(q.ConfigError, match="server"):
        q.EmbeddingConfig(base_url="http://h/v1", server="triton")


def test_infinity_without_prefix_behind_v1_base_url() -> None:
    with EmbeddingServer(dialect="infinity") as srv:
        assert srv.base_url == srv.url  # Infinity serves /embeddings at the root
        client = q.EmbeddingClient(base_url=srv.url + "/v1")  # the common mistake
        close(client.embed_documents(["x", "y"]), expected_embeddings(["x", "y"]))
        assert client.server is not None
        assert client.server.embeddings_url == srv.url + "/embeddings"
    with EmbeddingServer(dialect="infinity", url_prefix="/v1") as srv:
        client = q.EmbeddingClient(base_url=srv.base_url)
        close(client.embed_documents(["x"]), expected_embeddings(["x"]))
        assert client.server is not None
        assert client.server.embeddings_url is None


def test_llamacpp_raw_answers_are_unnormalised_and_float() -> None:
    with EmbeddingServer(dialect="llamacpp") as srv:
        raw = httpx.post(
            f"{srv.base_url}/embeddings",
            json={"input": ["abc"], "model": "m", "encoding_format": "base64", "dimensions": 8},
        )
        emb = raw.json()["data"][0]["embedding"]
        assert isinstance(emb, list)
        assert len(emb) == 1024
        assert abs(float(np.linalg.norm(emb)) - 1.0) > 1e-3
        assert raw.headers["server"] == "llama.cpp"
        vec = q.EmbeddingClient(base_url=srv.base_url).embed_documents(["abc"])[0]
        close(vec, expected_embedding("abc"))


def test_dashscope_refuses_base64_and_client_never_sends_it() -> None:
    with EmbeddingServer(dialect="dashscope") as srv:
        raw = httpx.post(
            f"{srv.base_url}/embeddings",
            json={"input": ["a"], "model": "m", "encoding_format": "base64"},
        )
        assert raw.status_code == 400
        assert "only float" in raw.json()["error"]["message"]
        raw = httpx.post(
            f"{srv.base_url}/embeddings", json={"input": ["a"], "model": "m", "dimensions": 100}
        )
        assert raw.status_code == 400
        client = q.EmbeddingClient(base_url=srv.base_url, dimensions=100)
        close(client.embed_documents(["a", "b"]), expected_embeddings(["a", "b"], dimensions=100))
        assert set(srv.stats()["responses"]) == {"400", "200"}
        assert srv.stats()["responses"]["400"] == 2  # only the two raw requests above
        with pytest.raises(q.ConfigError, match="above all"):
            q.EmbeddingClient(
                base_url=srv.base_url, model="text-embedding-v3", dimensions=1500
            ).embed_documents(["a"])


def test_response_model_may_be_a_path() -> None:
    with EmbeddingServer(model="/data/models/Qwen3-Embedding-0.6B") as srv:
        client = q.EmbeddingClient(base_url=srv.base_url, model="Qwen/Qwen3-Embedding-0.6B")
        close(client.embed_documents(["p"]), expected_embeddings(["p"]))


def test_the_models_probe_reads_owned_by(srv: EmbeddingServer) -> None:
    import time

    from qwen_embed_plugins.cli._probe import Probes

    deadline = time.monotonic() + 30.0
    with Probes(srv.base_url, api_key=None, verify=True, deadline=deadline, budget=30.0) as http:
        answer = http.get_models(srv.base_url)
    found = servers.identify_models(
        answer.status, answer.headers, answer.body, base_url=srv.base_url
    )
    expected = {"ollama": "ollama", "tei": "tei"}.get(srv.dialect, srv.dialect)
    if srv.dialect not in ("dashscope", "siliconflow"):  # on loopback: no URL to go by
        assert found.profile.name == expected, found.source


# --------------------------------------------------------------------------- units


@pytest.mark.parametrize(
    ("status", "headers", "body", "base", "name"),
    [
        (200, {}, b'{"data":[{"id":"m","owned_by":"sglang"}]}', "http://h/v1", "sglang"),
        (200, {}, b'{"data":[{"id":"m","owned_by":"vllm"}]}', "http://h/v1", "vllm"),
        (
            200,
            {},
            b'{"data":[{"id":"qwen3-embedding:0.6b","owned_by":"library"}]}',
            "http://h/v1",
            "ollama",
        ),
        (200, {}, b'{"data":[{"id":"m","owned_by":"llamacpp"}]}', "http://h/v1", "llamacpp"),
        (200, {"server": "llama.cpp"}, b"{}", "http://h/v1", "llamacpp"),
        (200, {}, b'{"data":[{"id":"m","owned_by":"infinity"}]}', "http://h", "infinity"),
        (200, {"x-siliconcloud-trace-id": "t"}, b'{"data":[]}', "http://h/v1", "siliconflow"),
        (404, {}, b"", "http://h/v1", "tei"),
        (404, {}, b'{"detail":"Not Found"}', "http://h/v1", "infinity"),
        (404, {}, b"404 page not found", "http://h/v1", "openai"),
        (200, {}, b'{"data":[{"id":"m","owned_by":"someone"}]}', "http://h/v1", "openai"),
        (500, {}, b"oops", "http://h/v1", "openai"),
    ],
)
@pytest.mark.unit
def test_identify_models(
    status: int, headers: dict[str, str], body: bytes, base: str, name: str
) -> None:
    found = servers.identify_models(status, headers, body, base_url=base)
    assert found.profile.name == name
    if name == "infinity" and status == 404:
        assert found.embeddings_url == "http://h/embeddings"


@pytest.mark.unit
def test_identify_url() -> None:
    ds = servers.identify_url("https://dashscope-intl.aliyuncs.com/compatible-mode/v1")
    assert ds is not None
    assert ds.profile.name == "dashscope"
    sf = servers.identify_url("https://api.siliconflow.cn/v1")
    assert sf is not None
    assert sf.profile.name == "siliconflow"
    assert servers.identify_url("http://gpu-box:30000/v1") is None
    tei_resp = servers.identify_response(httpx.Headers({"x-compute-type": "gpu+optimized"}))
    assert tei_resp is not None
    assert tei_resp.profile.name == "tei"
    assert servers.identify_response(httpx.Headers({"server": "uvicorn"})) is None


@pytest.mark.unit
def test_wire_dimensions_rules() -> None:
    p = servers.PROFILES
    assert servers.wire_dimensions(p["sglang"], 100, "Qwen/Qwen3-Embedding-0.6B") == 100
    assert servers.wire_dimensions(p["llamacpp"], 100, "m") is None
    assert servers.wire_dimensions(p["tei"], 100, "m") is None
    assert servers.wire_dimensions(p["dashscope"], 100, "text-embedding-v4") == 128
    assert servers.wire_dimensions(p["dashscope"], 1500, "text-embedding-v4") == 1536
    assert servers.wire_dimensions(p["dashscope"], 512, "text-embedding-v3") == 512
    assert servers.wire_dimensions(p["siliconflow"], 2100, "Qwen/Qwen3-Embedding-4B") == 2560
    assert servers.wire_dimensions(p["siliconflow"], 100, "BAAI/bge-m3") is None
    assert p["siliconflow"].allowed_sizes("Qwen/Qwen3-Embedding-0.6B")[-1] == 1024
    with pytest.raises(q.ConfigError):
        servers.wire_dimensions(p["siliconflow"], 1100, "Qwen/Qwen3-Embedding-0.6B")
    assert servers.wire_dimensions(p["vllm"], None, "m") is None
    with pytest.raises(q.ConfigError, match="unknown server"):
        servers.get_profile("triton")


@pytest.mark.unit
def test_refine_error_overload_vs_rate_limit() -> None:
    err = RateLimitError("HTTP 429", status=429, server_message="Model is overloaded")
    refined = servers.refine_error(servers.PROFILES["tei"], err)
    assert type(refined) is OverloadedError
    assert refined.status == 429
    assert refined.message == "Model is overloaded"
    assert servers.refine_error(servers.PROFILES["dashscope"], err) is err
    limit = RateLimitError("HTTP 429", status=429, server_message="Too many requests")
    assert servers.refine_error(servers.PROFILES["tei"], limit) is limit


@pytest.mark.unit
def test_profiles_facts() -> None:
    p = servers.PROFILES
    assert set(p) == set(servers.SERVER_NAMES)
    assert {n: p[n].batch_limit for n in LIMITS} == LIMITS
    assert p["dashscope"].base64 is False
    assert [n for n in p if p[n].overload_status == 503] == ["sglang", "ollama", "llamacpp"]
    assert p["tei"].overload_status == p["infinity"].overload_status == 429
    assert p["llamacpp"].max_requests_per_connection == 100
    assert p["ollama"].idle_timeout is None
    assert p["sglang"].idle_timeout == 5.0
    assert p["infinity"].api_prefix == ""
    assert p["infinity"].renormalizes is False
    for profile in p.values():
        assert profile.sources, profile.name
