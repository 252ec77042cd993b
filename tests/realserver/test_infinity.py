"""End to end against a real Infinity 0.0.78 server on the CPU (issue 9, item 2).

The server (``scripts/realserver.py``, started by ``conftest.py``) serves two models:

* ``all-MiniLM-L6-v2`` with real weights: retrieval results mean something;
* ``qwen-embed-test/Qwen3-Embedding-tiny``: a tiny random-weight model in Qwen3-Embedding's
  architecture and layout (real Qwen vocabulary, last-token pooling, left padding,
  ``<|endoftext|>`` appended, the query prompt in its sentence-transformers config). Its
  vectors are meaningless, so they are checked for exact agreement with what
  sentence-transformers computes locally for the same files, never for semantics.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qwen_embed_plugins as q

pytestmark = pytest.mark.realserver

QWEN = "qwen-embed-test/Qwen3-Embedding-tiny"
MINILM = "all-MiniLM-L6-v2"
QWEN_DIM = 64  # the tiny stand-in's hidden size
MINILM_DIM = 384
TOLERANCE = 1e-5  # max abs difference, server (through our client) vs local s-t
SERVER_KEEPALIVE_S = 5.0  # uvicorn's timeout_keep_alive, measured on Infinity 0.0.78


@pytest.fixture(autouse=True)
def _fresh_pools() -> Iterator[None]:
    """Each test starts and ends with no pooled connection (counters are per endpoint)."""
    q.close_all()
    yield
    q.close_all()


def endpoint_row(base_url: str) -> dict[str, int]:
    label = q.EmbeddingConfig(base_url=base_url).endpoint
    row = q.pool_stats().get(label)
    keys = ("connections_opened", "requests", "stale_retries", "retries", "texts")
    return {k: int(row[k]) if row else 0 for k in keys}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


def max_abs(a: Any, b: Any) -> float:
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


def record_parity(figures: dict[str, Any], name: str, diff: float) -> None:
    key = "parity max abs diff"
    figures.setdefault(key, {})[name] = f"{diff:.3g}"


def qwen_config(realserver: Any, **kw: Any) -> q.EmbeddingConfig:
    return q.EmbeddingConfig(base_url=realserver.base_url, model=QWEN, **kw)


def minilm_config(realserver: Any, **kw: Any) -> q.EmbeddingConfig:
    return q.EmbeddingConfig(
        base_url=realserver.base_url, model=MINILM, query_instruction=None, **kw
    )


# --------------------------------------------------------------------------- premises


def test_server_is_up_with_both_models(realserver: Any) -> None:
    status, _ = realserver.get("/health")
    assert status == 200
    status, body = realserver.get("/v1/models")
    assert status == 200
    names = {m["id"] for m in json.loads(body)["data"]}
    assert names == {QWEN, MINILM}


def test_infinity_slices_dimensions_without_renormalising(realserver: Any) -> None:
    """The premise of the client's renormalisation: the raw server answer is NOT unit."""
    status, full = realserver.post_embeddings(
        {"model": QWEN, "input": ["hello world"], "encoding_format": "float"}
    )
    assert status == 200
    status, cut = realserver.post_embeddings(
        {"model": QWEN, "input": ["hello world"], "encoding_format": "float", "dimensions": 32}
    )
    assert status == 200
    v_full = np.asarray(full["data"][0]["embedding"], dtype=np.float32)
    v_cut = np.asarray(cut["data"][0]["embedding"], dtype=np.float32)
    assert v_full.shape == (QWEN_DIM,)
    assert v_cut.shape == (32,)
    assert abs(float(np.linalg.norm(v_full)) - 1.0) < 1e-5
    np.testing.assert_array_equal(v_cut, v_full[:32])
    assert abs(float(np.linalg.norm(v_cut)) - 1.0) > 1e-3


SAME_TEXT_ATOL = 1e-6
"""Two vectors of the same text computed in one batch may differ in the last float32 bits
(the rows go through batched matrix products whose summation order depends on the row and
the padding; seen: ~2e-8). float32 has a 1.2e-7 spacing at 1.0; the components of a unit
vector are below 1, so 1e-6 is ~8 units in the last place, while a different text moves
the vector by far more (``test_infinity_strips_surrounding_whitespace`` checks > 1e-3)."""


def test_infinity_strips_surrounding_whitespace(realserver: Any) -> None:
    """Infinity strips leading/trailing whitespace from each input (pydantic
    ``strip_whitespace=True``): documented, and the reason the parity texts have none."""
    status, a = realserver.post_embeddings(
        {
            "model": QWEN,
            "input": ["hello world", "  hello world \n", "hello world!"],
            "encoding_format": "float",
        }
    )
    assert status == 200
    plain, padded, other = (np.asarray(d["embedding"], dtype=np.float32) for d in a["data"])
    assert max_abs(plain, padded) <= SAME_TEXT_ATOL  # the same text once stripped
    assert max_abs(plain, other) > 1e-3  # the bound tells different texts apart


# --------------------------------------------------------------------------- parity


def test_parity_documents_and_queries_sync(
    realserver: Any,
    reference: dict[str, np.ndarray],
    corpus: dict[str, Any],
    figures: dict[str, Any],
) -> None:
    client = q.EmbeddingClient(qwen_config(realserver))
    docs = client.embed_documents(corpus["qwen_docs"])
    assert len(docs) == len(corpus["qwen_docs"])
    assert all(len(v) == QWEN_DIM for v in docs)
    d_docs = max_abs(docs, reference["qwen_docs"])
    queries = [client.embed_query(t) for t in corpus["qwen_queries"]]
    d_queries = max_abs(queries, reference["qwen_queries"])
    many = client.embed_queries(corpus["qwen_queries"])
    d_many = max_abs(many, reference["qwen_queries"])
    record_parity(
        figures,
        "tiny Qwen3 EmbeddingClient[codec] docs/query",
        max(d_docs, d_queries, d_many),
    )
    # the openai SDK on the same pool (openai_client) gets the same document vectors
    sdk = client.openai_client()
    answer = sdk.embeddings.create(input=corpus["qwen_docs"], model=client.config.model)
    d_sdk = max_abs([d.embedding for d in answer.data], reference["qwen_docs"])
    record_parity(figures, "tiny Qwen3 EmbeddingClient.openai_client() docs", d_sdk)
    assert d_sdk <= TOLERANCE
    assert d_docs <= TOLERANCE
    assert d_queries <= TOLERANCE
    assert d_many <= TOLERANCE
    # The query instruction really changed the vectors (not a no-op).
    assert max_abs(client.embed_documents(corpus["qwen_queries"]), queries) > 1e-3


async def test_parity_documents_and_queries_async(
    realserver: Any,
    reference: dict[str, np.ndarray],
    corpus: dict[str, Any],
    figures: dict[str, Any],
) -> None:
    client = q.AsyncEmbeddingClient(qwen_config(realserver))
    docs = await client.embed_documents(corpus["qwen_docs"])
    queries = await asyncio.gather(*(client.embed_query(t) for t in corpus["qwen_queries"]))
    d_docs = max_abs(docs, reference["qwen_docs"])
    d_queries = max_abs(queries, reference["qwen_queries"])
    record_parity(figures, "tiny Qwen3 AsyncEmbeddingClient docs/query", max(d_docs, d_queries))
    assert d_docs <= TOLERANCE
    assert d_queries <= TOLERANCE


def test_parity_minilm(
    realserver: Any,
    reference: dict[str, np.ndarray],
    corpus: dict[str, Any],
    figures: dict[str, Any],
) -> None:
    client = q.EmbeddingClient(minilm_config(realserver))
    docs = client.embed_documents_array(corpus["minilm_docs"])
    assert docs.shape == (len(corpus["minilm_docs"]), MINILM_DIM)
    d_docs = max_abs(docs, reference["minilm_docs"])
    # query_instruction=None: a query is sent raw, so it equals the document vector
    d_query = max_abs(
        client.embed_query_array(corpus["minilm_docs"][0]), reference["minilm_docs"][0]
    )
    record_parity(figures, "MiniLM EmbeddingClient docs/query", max(d_docs, d_query))
    assert d_docs <= TOLERANCE
    assert d_query <= TOLERANCE
    # real weights: the known similarity of the sentence-transformers model card
    assert float(docs[0] @ docs[1]) == pytest.approx(0.755, abs=0.01)
    assert abs(float(docs[0] @ docs[2])) < 0.2


# --------------------------------------------------------------------------- codec


@pytest.mark.parametrize("model", [QWEN, MINILM])
def test_base64_and_float_identical(
    realserver: Any,
    corpus: dict[str, Any],
    model: str,
) -> None:
    texts = corpus["qwen_docs"][:20]
    instruction = q.DEFAULT_QUERY_TASK if model == QWEN else None
    b64 = q.EmbeddingClient(
        base_url=realserver.base_url,
        model=model,
        encoding_format="base64",
        query_instruction=instruction,
    )
    flt = q.EmbeddingClient(
        base_url=realserver.base_url,
        model=model,
        encoding_format="float",
        query_instruction=instruction,
    )
    a = b64.embed_documents_array(texts)
    b = flt.embed_documents_array(texts)
    assert a.dtype == np.float32
    assert b.dtype == np.float32
    np.testing.assert_array_equal(a, b)
    # and on the wire: Infinity's base64 is little-endian float32, bit-identical
    _, raw_b = realserver.post_embeddings(
        {"model": model, "input": texts[:3], "encoding_format": "base64"}
    )
    _, raw_f = realserver.post_embeddings(
        {"model": model, "input": texts[:3], "encoding_format": "float"}
    )
    for rb, rf in zip(raw_b["data"], raw_f["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(rb["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.asarray(rf["embedding"], dtype=np.float32))


@pytest.mark.parametrize("dims", [32, 48])
def test_dimensions_come_back_unit_length(
    realserver: Any,
    reference: dict[str, np.ndarray],
    corpus: dict[str, Any],
    figures: dict[str, Any],
    dims: int,
) -> None:
    client = q.EmbeddingClient(qwen_config(realserver, dimensions=dims))
    got = client.embed_documents_array(corpus["qwen_docs"])
    assert got.shape == (len(corpus["qwen_docs"]), dims)
    norms = np.linalg.norm(got.astype(np.float64), axis=1)
    assert np.abs(norms - 1.0).max() <= 1e-5, norms
    want = reference["qwen_docs"][:, :dims].astype(np.float64)
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    diff = max_abs(got, want)
    record_parity(figures, f"tiny Qwen3 dimensions={dims} vs slice+renormalise", diff)
    assert diff <= TOLERANCE
    query = client.embed_query_array(corpus["qwen_queries"][0])
    assert query.shape == (dims,)
    assert abs(float(np.linalg.norm(query)) - 1.0) <= 1e-5


async def test_dimensions_async(realserver: Any, corpus: dict[str, Any]) -> None:
    client = q.AsyncEmbeddingClient(qwen_config(realserver, dimensions=32))
    got = await client.embed_documents_array(corpus["qwen_docs"][:10])
    assert got.shape == (10, 32)
    assert np.abs(np.linalg.norm(got, axis=1) - 1.0).max() <= 1e-5


# --------------------------------------------------------------------------- keep-alive


def _no_socket_established(realserver: Any, tcp_count: Any) -> Callable[[], bool]:
    """A predicate for ``wait_until``: true once three readings in a row find no
    ESTABLISHED socket of this process to the server (one reading of the kernel's table
    can miss a socket while other sockets come and go)."""
    zeros = [0]

    def none_left() -> bool:
        zeros[0] = zeros[0] + 1 if tcp_count(realserver.port, states=("01",)) == 0 else 0
        return zeros[0] >= 3

    return none_left


def test_idle_past_server_keepalive_default_limits(
    realserver: Any, tcp_count: Any, wait_until: Any
) -> None:
    """Default keep-alive expiry (4 s) is below Infinity's 5 s: idle past the server's
    keep-alive (until it has closed its side), then embed."""
    client = q.EmbeddingClient(qwen_config(realserver))
    assert client.config.limits.keepalive_expiry < SERVER_KEEPALIVE_S
    client.embed_documents(["before the pause"])
    before = endpoint_row(realserver.base_url)
    time.sleep(SERVER_KEEPALIVE_S)  # the premise: idle at least the server's keep-alive
    # ... and until the server has closed its side (ours is then in CLOSE_WAIT)
    wait_until(_no_socket_established(realserver, tcp_count), "Infinity's keep-alive close")
    client.embed_documents(["after the pause"])  # no error
    d = delta(before, endpoint_row(realserver.base_url))
    assert d["requests"] == 1
    assert d["connections_opened"] == 1  # the expired socket was replaced, not reused
    assert d["retries"] == 0


def test_idle_past_server_keepalive_long_client_expiry(
    realserver: Any,
    tcp_count: Any,
    wait_until: Any,
    figures: dict[str, Any],
) -> None:
    """A client keeping idle sockets longer (30 s) than the server (5 s) — the classic
    "Server disconnected without sending a response" set-up — still gets no error: the
    closed socket is either detected and replaced, or the request is resent once."""
    client = q.EmbeddingClient(qwen_config(realserver, limits=q.Limits(keepalive_expiry=30.0)))
    client.embed_documents(["before the pause"])
    before = endpoint_row(realserver.base_url)
    time.sleep(SERVER_KEEPALIVE_S)  # the premise: idle at least the server's keep-alive
    # ... and until Infinity has closed its side: our socket, kept 30 s, sits in CLOSE_WAIT
    wait_until(
        _no_socket_established(realserver, tcp_count),
        "Infinity to close the idle connection (its keep-alive is 5 s)",
    )
    vectors = client.embed_documents(["after the pause", "and one more"])
    assert len(vectors) == 2
    d = delta(before, endpoint_row(realserver.base_url))
    figures["keep-alive: idle past the server's close, keepalive_expiry=30"] = (
        f"connections_opened +{d['connections_opened']}, stale_retries +{d['stale_retries']}"
    )
    assert d["connections_opened"] + d["stale_retries"] >= 1
    assert d["retries"] == 0 or d["stale_retries"] >= 1


async def test_idle_past_server_keepalive_async(
    realserver: Any, tcp_count: Any, wait_until: Any
) -> None:
    """The same on the async pool, with the default and a too-long keep-alive expiry."""
    for expiry in (4.0, 30.0):
        client = q.AsyncEmbeddingClient(
            qwen_config(realserver, limits=q.Limits(keepalive_expiry=expiry))
        )
        await client.embed_documents(["before the pause"])
        before = endpoint_row(realserver.base_url)
        await asyncio.sleep(SERVER_KEEPALIVE_S)  # idle at least the server's keep-alive
        await asyncio.to_thread(
            wait_until,
            _no_socket_established(realserver, tcp_count),
            f"Infinity's keep-alive close (client expiry {expiry} s)",
        )
        assert len(await client.embed_documents(["after the pause"])) == 1
        d = delta(before, endpoint_row(realserver.base_url))
        assert d["connections_opened"] + d["stale_retries"] >= 1, expiry
        await q.aclose_all()


# --------------------------------------------------------------------------- errors


def test_fastapi_422_becomes_bad_request_with_server_message(
    realserver: Any,
    figures: dict[str, Any],
) -> None:
    """Infinity caps each input at 122,880 characters (8192 * 15) by validation: a
    longer text passes the client's own 262,144-character check and gets FastAPI's 422
    ``{"detail": [...]}``."""
    client = q.EmbeddingClient(qwen_config(realserver))
    before = endpoint_row(realserver.base_url)
    with pytest.raises(q.BadRequestError) as info:
        client.embed_documents(["ok", "word " * 26_000])
    exc = info.value
    figures["Infinity 422 (text > 122880 chars) ->"] = f"{type(exc).__name__}: {exc.message[:120]}"
    assert exc.status == 422
    assert "at most 122880 characters" in exc.message
    assert "at most 122880 characters" in str(exc)
    d = delta(before, endpoint_row(realserver.base_url))
    assert d["retries"] == 0  # 4xx is never retried


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_unknown_model_400_with_server_message(realserver: Any, flavour: str) -> None:
    """With two models served, Infinity answers an unknown name with 400 (nested OpenAI
    error body) naming the models it has."""
    cfg = q.EmbeddingConfig(base_url=realserver.base_url, model="no-such-model")
    if flavour == "sync":
        call = lambda: q.EmbeddingClient(cfg).embed_documents(["hello"])  # noqa: E731
    else:
        call = lambda: asyncio.run(  # noqa: E731
            q.AsyncEmbeddingClient(cfg).embed_documents(["hello"])
        )
    before = endpoint_row(realserver.base_url)
    with pytest.raises(q.BadRequestError) as info:
        call()
    exc = info.value
    assert exc.status == 400
    assert "no-such-model" in exc.message
    assert "not found" in exc.message
    assert QWEN in exc.message  # Infinity lists the available names
    assert not isinstance(exc, q.BatchTooLargeError | q.ContextLengthError)
    assert delta(before, endpoint_row(realserver.base_url))["retries"] == 0


# --------------------------------------------------------------------------- pool limits
#
# "Within the pool limit" is checked on this process's own sockets to the server: at no
# sample do more than ``max_connections`` of them stand ESTABLISHED (``tcp_count`` counts
# only the sockets this process holds: other processes, other test runs and other users of
# the server are never counted). ``pool_stats()["connections_opened"]`` counts
# every TCP connect over the run; it is checked against the sockets seen, not against the
# limit: a pooled connection that the server closes (Infinity drops a connection idle for
# 5 s, which happens when this process is starved of CPU for a few seconds on a loaded
# machine) is replaced by a new one, so a correct pool can open more connections over a
# run than it ever holds at once (measured: 40 opened, never more than 20 open, after a
# 6 s stall of the event loop). Pool waits are unbounded (``Timeouts(pool=None)``):
# requests queue for a connection by design here, and how long they queue depends only on
# how busy the machine is.

NO_POOL_TIMEOUT = q.Timeouts(pool=None)


class PeakSampler:
    """Samples this process's ESTABLISHED sockets to the server every 20 ms in a thread;
    ``peak`` is the most seen at once."""

    def __init__(self, count: Callable[[], int]) -> None:
        self.peak = 0
        self._count = count
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._count())
            self._stop.wait(0.02)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._count())


def _no_connection_left(realserver: Any, tcp_count: Any, wait_until: Any) -> None:
    """Start from no ESTABLISHED socket of ours to the server (an earlier test's idle
    connections are closed by the server's keep-alive within 5 s)."""
    q.close_all()
    wait_until(
        _no_socket_established(realserver, tcp_count),
        "no connection of this process left open to the server",
    )


def _check_within_limit(d: dict[str, int], peak: int, limit: int, what: str = "") -> None:
    assert peak >= 1, (what, d, peak)  # the sampler saw the run's connections
    assert peak <= limit, (what, d, peak)
    # every socket seen was opened during the run and counted by the client
    assert d["connections_opened"] >= peak, (what, d, peak)


TEXTS_5000 = [
    f"text {i}: a sentence about item {i * 7919 % 5000} for the pool test" for i in range(5000)
]


def test_20_clients_5000_texts_threads_stay_within_pool_limit(
    realserver: Any,
    tcp_count: Any,
    wait_until: Any,
    figures: dict[str, Any],
) -> None:
    cfg = qwen_config(realserver, timeout=NO_POOL_TIMEOUT)  # default max_connections=20
    limit = cfg.limits.max_connections
    _no_connection_left(realserver, tcp_count, wait_until)
    clients = [q.EmbeddingClient(cfg) for _ in range(20)]
    chunks = [TEXTS_5000[i::20] for i in range(20)]
    before = endpoint_row(realserver.base_url)
    t0 = time.monotonic()
    with PeakSampler(lambda: tcp_count(realserver.port)) as sampler, ThreadPoolExecutor(20) as ex:
        results = list(ex.map(lambda c, t: c.embed_documents_array(t), clients, chunks))
    seconds = time.monotonic() - t0
    d = delta(before, endpoint_row(realserver.base_url))
    figures["20 sync clients x 250 texts (threads)"] = (
        f"{seconds:.1f} s, connections_opened {d['connections_opened']} (limit {limit}), "
        f"peak open {sampler.peak}, requests {d['requests']}"
    )
    assert all(r.shape == (250, QWEN_DIM) for r in results)
    _check_within_limit(d, sampler.peak, limit)
    assert d["texts"] == 5000
    # one shared pool (`pools`: its entry; `sync_clients` would race the idle reaper, which
    # may close a transport idle past its keep-alive expiry on a loaded machine)
    assert q.pool_stats()[cfg.endpoint]["pools"] == 1


async def test_20_async_clients_5000_texts_stay_within_small_pool_limit(
    realserver: Any,
    tcp_count: Any,
    wait_until: Any,
    figures: dict[str, Any],
) -> None:
    limit = 6
    cfg = qwen_config(
        realserver,
        limits=q.Limits(max_connections=limit, max_keepalive_connections=limit),
        timeout=NO_POOL_TIMEOUT,
    )
    await asyncio.to_thread(_no_connection_left, realserver, tcp_count, wait_until)
    clients = [q.AsyncEmbeddingClient(cfg) for _ in range(20)]
    chunks = [TEXTS_5000[i::20] for i in range(20)]
    before = endpoint_row(realserver.base_url)
    t0 = time.monotonic()
    with PeakSampler(lambda: tcp_count(realserver.port)) as sampler:
        results = await asyncio.gather(
            *(c.embed_documents_array(t) for c, t in zip(clients, chunks, strict=True))
        )
    seconds = time.monotonic() - t0
    d = delta(before, endpoint_row(realserver.base_url))
    figures["20 async clients x 250 texts (one loop)"] = (
        f"{seconds:.1f} s, connections_opened {d['connections_opened']} (limit {limit}), "
        f"peak open {sampler.peak}"
    )
    assert all(r.shape == (250, QWEN_DIM) for r in results)
    _check_within_limit(d, sampler.peak, limit)
    assert d["texts"] == 5000
    assert q.pool_stats()[cfg.endpoint]["async_clients"] == 1
    await q.aclose_all()


# --------------------------------------------------------------------------- adapters


def langchain_embeddings(realserver: Any, model: str = QWEN, **kw: Any) -> Any:
    from qwen_embed_plugins.integrations.langchain import QwenPooledEmbeddings

    if model == MINILM:
        kw.setdefault("query_instruction", None)
    return QwenPooledEmbeddings(base_url=realserver.base_url, model=model, **kw)


def llama_index_embedding(realserver: Any, model: str = QWEN, **kw: Any) -> Any:
    from qwen_embed_plugins.integrations.llama_index import QwenPooledEmbedding

    if model == MINILM:
        kw.setdefault("query_instruction", None)
    return QwenPooledEmbedding(base_url=realserver.base_url, model_name=model, **kw)


def test_parity_langchain(
    realserver: Any,
    reference: dict[str, np.ndarray],
    corpus: dict[str, Any],
    figures: dict[str, Any],
) -> None:
    emb = langchain_embeddings(realserver)
    d_docs = max_abs(emb.embed_documents(corpus["qwen_docs"]), reference["qwen_docs"])
    d_query = max_abs(
        [emb.embed_query(t) for t in corpus["qwen_queries"]], reference["qwen_queries"]
    )

    async def both() -> tuple[Any, Any]:
        docs = await emb.aembed_documents(corpus["qwen_docs"])
        qs = await asyncio.gather(*(emb.aembed_query(t) for t in corpus["qwen_queries"]))
        return docs, qs

    adocs, aqueries = asyncio.run(both())
    d_adocs = max_abs(adocs, reference["qwen_docs"])
    d_aquery = max_abs(aqueries, reference["qwen_queries"])
    record_parity(
        figures,
        "tiny Qwen3 LangChain embed_documents/embed_query (+async)",
        max(d_docs, d_query, d_adocs, d_aquery),
    )
    assert max(d_docs, d_query, d_adocs, d_aquery) <= TOLERANCE


def test_parity_llama_index(
    realserver: Any,
    reference: dict[str, np.ndarray],
    corpus: dict[str, Any],
    figures: dict[str, Any],
) -> None:
    emb = llama_index_embedding(realserver)
    d_docs = max_abs(emb.get_text_embedding_batch(corpus["qwen_docs"]), reference["qwen_docs"])
    d_one = max_abs(emb.get_text_embedding(corpus["qwen_docs"][1]), reference["qwen_docs"][1])
    d_query = max_abs(
        [emb.get_query_embedding(t) for t in corpus["qwen_queries"]], reference["qwen_queries"]
    )

    async def both() -> tuple[Any, Any]:
        docs = await emb.aget_text_embedding_batch(corpus["qwen_docs"])
        qs = await asyncio.gather(*(emb.aget_query_embedding(t) for t in corpus["qwen_queries"]))
        return docs, qs

    adocs, aqueries = asyncio.run(both())
    d_adocs = max_abs(adocs, reference["qwen_docs"])
    d_aquery = max_abs(aqueries, reference["qwen_queries"])
    worst = max(d_docs, d_one, d_query, d_adocs, d_aquery)
    record_parity(figures, "tiny Qwen3 LlamaIndex text/query embedding (+async)", worst)
    assert worst <= TOLERANCE


def _retrieval_corpus(corpus: dict[str, Any]) -> tuple[list[str], list[str], list[int]]:
    """Passages (distractors with the 10 right ones spread among them), queries, and
    the index of each query's right passage."""
    passages = list(corpus["distractors"])
    answers = []
    for n, (_, passage) in enumerate(corpus["pairs"]):
        at = (n * 37 + 11) % (len(passages) + 1)
        passages.insert(at, passage)
    for _, passage in corpus["pairs"]:
        answers.append(passages.index(passage))
    return passages, [qq for qq, _ in corpus["pairs"]], answers


@pytest.mark.slow  # ~25-50 s on a loaded 2-core machine; CI runs it
def test_retrieval_langchain_in_memory_vector_store(
    realserver: Any,
    corpus: dict[str, Any],
    figures: dict[str, Any],
) -> None:
    from langchain_core.vectorstores import InMemoryVectorStore

    passages, queries, answers = _retrieval_corpus(corpus)
    assert len(passages) >= 210
    emb = langchain_embeddings(realserver, MINILM)
    store = InMemoryVectorStore.from_texts(
        passages, embedding=emb, ids=[f"p{i}" for i in range(len(passages))]
    )
    retriever = store.as_retriever(search_kwargs={"k": 3})
    hits = 0
    for query, answer in zip(queries, answers, strict=True):
        found = retriever.invoke(query)
        hits += found[0].id == f"p{answer}"

    async def ahits() -> int:
        found = await asyncio.gather(*(retriever.ainvoke(qq) for qq in queries))
        return sum(f[0].id == f"p{a}" for f, a in zip(found, answers, strict=True))

    async_hits = asyncio.run(ahits())
    figures["retrieval hit rate @1, LangChain InMemoryVectorStore (MiniLM)"] = (
        f"{hits}/{len(queries)} sync, {async_hits}/{len(queries)} async, "
        f"among {len(passages)} passages"
    )
    assert hits == len(queries)
    assert async_hits == len(queries)


@pytest.mark.slow  # ~25-50 s on a loaded 2-core machine; CI runs it
def test_retrieval_llama_index_vector_store_index(
    realserver: Any,
    corpus: dict[str, Any],
    figures: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import llama_index.core
    from llama_index.core import Document, Settings, VectorStoreIndex

    # LlamaIndex's splitter counts tokens with tiktoken's cl100k_base, bundled with it;
    # point tiktoken at the bundled copy so that nothing is ever fetched (no internet).
    bundled = Path(llama_index.core.__file__).parent / "_static" / "tiktoken_cache"
    if bundled.is_dir():
        monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(bundled))
    passages, queries, answers = _retrieval_corpus(corpus)
    previous = Settings._embed_model  # restore the global afterwards
    Settings.embed_model = llama_index_embedding(realserver, MINILM)
    try:
        index = VectorStoreIndex.from_documents(
            [Document(text=p, id_=f"p{i}") for i, p in enumerate(passages)]
        )
        retriever = index.as_retriever(similarity_top_k=3)
        hits = 0
        for query, answer in zip(queries, answers, strict=True):
            found = retriever.retrieve(query)
            hits += found[0].node.ref_doc_id == f"p{answer}"

        async def ahits() -> int:
            found = await asyncio.gather(*(retriever.aretrieve(qq) for qq in queries))
            return sum(f[0].node.ref_doc_id == f"p{a}" for f, a in zip(found, answers, strict=True))

        async_hits = asyncio.run(ahits())
    finally:
        Settings._embed_model = previous
    figures["retrieval hit rate @1, LlamaIndex VectorStoreIndex (MiniLM)"] = (
        f"{hits}/{len(queries)} sync, {async_hits}/{len(queries)} async, "
        f"among {len(passages)} passages"
    )
    assert hits == len(queries)
    assert async_hits == len(queries)


def test_20_langchain_instances_5000_texts_within_pool_limit(
    realserver: Any,
    tcp_count: Any,
    wait_until: Any,
    figures: dict[str, Any],
) -> None:
    """20 LangChain instances for one endpoint share one pool: 5,000 texts from 20 threads,
    then 5,000 through ``aembed_documents`` on one event loop, each phase within the
    pool's connection limit (the default, 20)."""
    instances = [langchain_embeddings(realserver, pool_timeout=None) for _ in range(20)]
    limit = q.Limits().max_connections
    chunks = [TEXTS_5000[i::20] for i in range(20)]
    label = q.EmbeddingConfig(base_url=realserver.base_url).endpoint

    def sync_phase() -> list[Any]:
        with ThreadPoolExecutor(20) as ex:
            return list(ex.map(lambda e, t: e.embed_documents(t), instances, chunks))

    async def async_phase() -> list[Any]:
        results = await asyncio.gather(
            *(e.aembed_documents(t) for e, t in zip(instances, chunks, strict=True))
        )
        assert q.pool_stats()[label]["async_clients"] == 1
        return list(results)

    report = []
    for name, phase in (("sync", sync_phase), ("async", lambda: asyncio.run(async_phase()))):
        _no_connection_left(realserver, tcp_count, wait_until)
        before = endpoint_row(realserver.base_url)
        with PeakSampler(lambda: tcp_count(realserver.port)) as sampler:
            results = phase()
        if name == "sync":
            assert q.pool_stats()[label]["sync_clients"] == 1
        d = delta(before, endpoint_row(realserver.base_url))
        report.append(
            f"{name}: connections_opened {d['connections_opened']}, peak open {sampler.peak}"
        )
        assert all(len(r) == 250 for r in results)
        assert d["texts"] == 5000
        _check_within_limit(d, sampler.peak, limit, name)
    figures["20 LangChain instances x 250 texts"] = f"limit {limit}; " + "; ".join(report)


def test_20_llama_index_instances_5000_texts_within_pool_limit(
    realserver: Any,
    tcp_count: Any,
    wait_until: Any,
    figures: dict[str, Any],
) -> None:
    """20 LlamaIndex instances x 250 texts through ``aget_text_embedding_batch`` on one
    loop: LlamaIndex starts every batch at once (each call keeps ``max_concurrency`` in
    flight), so ~80 requests queue for 6 connections; they wait as long as it takes."""
    limit = 6
    instances = [
        llama_index_embedding(
            realserver,
            max_connections=limit,
            max_keepalive_connections=limit,
            pool_timeout=None,
        )
        for _ in range(20)
    ]
    chunks = [TEXTS_5000[i::20] for i in range(20)]
    _no_connection_left(realserver, tcp_count, wait_until)
    before = endpoint_row(realserver.base_url)

    async def run_async() -> list[Any]:
        return await asyncio.gather(
            *(e.aget_text_embedding_batch(t) for e, t in zip(instances, chunks, strict=True))
        )

    with PeakSampler(lambda: tcp_count(realserver.port)) as sampler:
        results = asyncio.run(run_async())
    d = delta(before, endpoint_row(realserver.base_url))
    figures["20 LlamaIndex instances x 250 texts, async (LlamaIndex fires all batches)"] = (
        f"connections_opened {d['connections_opened']} (limit {limit}), peak open {sampler.peak}"
    )
    assert all(len(r) == 250 for r in results)
    assert d["texts"] == 5000
    _check_within_limit(d, sampler.peak, limit)
