"""Failure policy, round 3 (issue 20): a server never reached fails fast; a burst of
server-wide failures is an outage; status families by meaning (TEI's 424, a 5xx only
for base64); a server refusing one-item lists; a ``Retry-After`` that never shortens the
backoff; one WARNING per outage episode. Each against a loopback server, sync and async,
and through both adapters."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins import _balance as balance
from qwen_embed_tooling.testing import EmbeddingServer, expected_embeddings

FAST = q.RetryConfig(backoff_initial=0.01, backoff_max=0.05)
TEXTS = [f"policy passage {i}" for i in range(640)]
VLLM_500 = (
    "TypeError: TextEncodeInput must be Union[TextInputSequence, "
    "Tuple[InputSequence, InputSequence]]"
)
TEI_424 = {"error": "Backend error: CUDA out of memory", "error_type": "Backend"}
Client = q.EmbeddingClient | q.AsyncEmbeddingClient


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def replica_of(client: Client) -> balance.Replica:
    return balance.endpoint_for(client.config).replicas[0]


def snapshot(client: Client) -> dict[str, Any]:
    return replica_of(client).metrics.snapshot()


def run(client: Client, method: str, *args: Any, **kwargs: Any) -> Any:
    """``client.method(*args)``, awaited for the async client."""
    result = getattr(client, method)(*args, **kwargs)
    if isinstance(client, q.AsyncEmbeddingClient):
        return asyncio.run(result)
    return result


@pytest.fixture(params=["sync", "async"])
def make_client(request: pytest.FixtureRequest) -> Callable[..., Client]:
    cls = q.EmbeddingClient if request.param == "sync" else q.AsyncEmbeddingClient
    return cls  # type: ignore[return-value]


# --------------------------------------------------------------------------- never reached


@pytest.mark.parametrize("method", ["embed_query", "embed_documents"])
def test_a_server_never_reached_fails_fast_naming_the_url(
    make_client: Callable[..., Client], method: str
) -> None:
    """A closed port: ``ConnectError`` within ``wait_for_server`` (not the 15 s / 300 s
    deadline), naming the URL and suggesting ``qwen-embed check``; a handful of attempts
    (the backoff within 2 s), not one per millisecond."""
    url = f"http://127.0.0.1:{closed_port()}/v1"
    client = make_client(base_url=url)
    before = snapshot(client)["requests"]
    texts = "a query" if method == "embed_query" else TEXTS
    with pytest.raises(q.ConnectError) as info:
        run(client, method, texts)
    message = str(info.value)
    assert url in message
    assert f"qwen-embed check --base-url {url}" in message
    assert "wait_for_server=2 s" in message
    assert "_Conn" not in message  # no internal class name
    attempts = snapshot(client)["requests"] - before
    assert 2 <= attempts <= 40, attempts


def test_a_server_that_answered_keeps_the_outage_budget(wait_until: Any) -> None:
    """The same closed port once the server has answered: retried past
    ``wait_for_server`` (here 0 s) until the server is back."""
    with EmbeddingServer() as srv:
        client = q.EmbeddingClient(
            base_url=srv.base_url, retry=FAST.replace(wait_for_server=0.0, deadline=120.0)
        )
        client.embed_documents(["first"])
        srv.stop()
        before = snapshot(client)["requests_by_outcome"].get("ConnectError", 0)
        result: list[Any] = []
        worker = threading.Thread(target=lambda: result.append(client.embed_documents(["x"])))
        worker.start()
        wait_until(
            lambda: snapshot(client)["requests_by_outcome"].get("ConnectError", 0) >= before + 3,
            "three refused connections",
        )
        srv.start()
        worker.join(120)
        assert result == [[expected_embeddings(["x"])[0].tolist()]]


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_wait_for_server_carries_a_job_started_before_its_server(
    wait_until: Any, flavour: str
) -> None:
    port = closed_port()
    retry = q.RetryConfig(wait_for_server=120.0, backoff_max=0.2)
    url = f"http://127.0.0.1:{port}/v1"
    client: Client = (
        q.EmbeddingClient(base_url=url, retry=retry)
        if flavour == "sync"
        else q.AsyncEmbeddingClient(base_url=url, retry=retry)
    )
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(run(client, "embed_query", "early")))
    worker.start()
    wait_until(
        lambda: snapshot(client)["requests_by_outcome"].get("ConnectError", 0) >= 2,
        "the job to meet the missing server twice",
    )
    with EmbeddingServer(port=port):
        worker.join(120)
    assert len(result) == 1
    assert len(result[0]) == 1024


def test_the_langchain_adapter_fails_fast_on_a_server_never_reached() -> None:
    from qwen_embed_plugins.integrations.langchain import QwenPooledEmbeddings

    url = f"http://127.0.0.1:{closed_port()}/v1"
    emb = QwenPooledEmbeddings(base_url=url)
    with pytest.raises(q.ConnectError, match="qwen-embed check"):
        emb.embed_documents(["a", "b"])
    with pytest.raises(q.ConnectError, match="qwen-embed check"):
        asyncio.run(emb.aembed_query("a"))


# --------------------------------------------------------------------------- bursts


@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("burst", [20, 300])
def test_a_burst_of_server_wide_500s_costs_time_not_the_job(
    embedding_server: EmbeddingServer,
    make_client: Callable[..., Client],
    on_error: str,
    burst: int,
) -> None:
    """vLLM answering every request 500 for a while (a burst of ``burst`` requests, on
    cue from the first request of the job): the control requests fail too, so it is an
    outage; the 640-text job completes with every vector, in both modes."""
    embedding_server.inject_status(500, count=burst, message=VLLM_500)
    client = make_client(base_url=embedding_server.base_url, retry=FAST)
    result = run(client, "embed_documents_array", TEXTS, on_error=on_error)
    vectors = result if on_error == "raise" else result.vectors
    if on_error == "skip":
        assert dict(result.errors) == {}
    np.testing.assert_array_equal(vectors, expected_embeddings(TEXTS))
    assert embedding_server.stats()["faults_applied"]["status"] == burst


def test_a_burst_through_the_langchain_adapter(embedding_server: EmbeddingServer) -> None:
    from qwen_embed_plugins.integrations.langchain import QwenPooledEmbeddings

    embedding_server.inject_status(500, count=60, message=VLLM_500)
    emb = QwenPooledEmbeddings(base_url=embedding_server.base_url)
    texts = TEXTS[:64]
    got = emb.embed_documents(texts)
    np.testing.assert_allclose(np.array(got), expected_embeddings(texts), rtol=1e-6)


def test_a_server_down_longer_than_the_deadline_blames_no_input(
    embedding_server: EmbeddingServer,
) -> None:
    embedding_server.inject_status(500, count=100_000, message=VLLM_500)
    client = q.EmbeddingClient(base_url=embedding_server.base_url, retry=FAST.replace(deadline=1.0))
    with pytest.raises(q.ServerError) as info:
        client.embed_documents(TEXTS[:8], on_error="skip")
    assert info.value.index is None
    assert "control request" in str(info.value)


def test_one_warning_when_an_outage_starts_and_one_when_it_ends(
    embedding_server: EmbeddingServer, caplog: pytest.LogCaptureFixture
) -> None:
    embedding_server.inject_status(500, count=40, message=VLLM_500)
    client = q.EmbeddingClient(base_url=embedding_server.base_url, retry=FAST, max_concurrency=1)
    with caplog.at_level(logging.DEBUG, logger="qwen_embed_plugins"):
        client.embed_documents(TEXTS[:64])
    ours = [r for r in caplog.records if r.name == "qwen_embed_plugins"]
    episodes = [getattr(r, "qwen_embed_episode", None) for r in ours]
    assert episodes.count("start") == 1
    assert episodes.count("end") == 1
    retries = [r for r in ours if r.getMessage().startswith("retrying ")]
    assert retries
    assert {r.levelno for r in retries} == {logging.DEBUG}
    (end,) = (r for r in ours if getattr(r, "qwen_embed_episode", None) == "end")
    assert end.levelno == logging.WARNING
    assert "answered again after" in end.getMessage()


# --------------------------------------------------------------------------- status families


def test_teis_424_backend_error_is_retried(make_client: Callable[..., Client]) -> None:
    with EmbeddingServer(dialect="tei") as srv:
        srv.inject("status", status=424, body=TEI_424)
        client = make_client(base_url=srv.base_url, retry=FAST)
        got = run(client, "embed_documents_array", TEXTS[:8])
        np.testing.assert_array_equal(got, expected_embeddings(TEXTS[:8]))
        assert srv.requests == 2


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_teis_424_on_one_input_is_bisected_to_it(
    make_client: Callable[..., Client], on_error: str
) -> None:
    with EmbeddingServer(dialect="tei") as srv:
        srv.poison(TEXTS[5], status=424, body=TEI_424)
        client = make_client(base_url=srv.base_url, retry=FAST)
        if on_error == "raise":
            with pytest.raises(q.ServerError) as info:
                run(client, "embed_documents_array", TEXTS[:8])
            assert info.value.status == 424
            assert info.value.index == 5
            assert "Backend error" in str(info.value)
            return
        result = run(client, "embed_documents_array", TEXTS[:8], on_error="skip")
        assert sorted(result.errors) == [5]
        keep = [i for i in range(8) if i != 5]
        np.testing.assert_array_equal(
            result.vectors[keep], expected_embeddings([TEXTS[i] for i in keep])
        )


@pytest.mark.parametrize("status", [502, 503, 504])
def test_a_5xx_only_for_base64_switches_to_float_once(
    embedding_server: EmbeddingServer,
    make_client: Callable[..., Client],
    status: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A gateway answering ``status`` ``upstream_decode_error`` to base64 only: one float
    retry of the same batch goes through, so the replica uses float from then on."""
    embedding_server.fail_base64(status=status, message="upstream_decode_error")
    client = make_client(base_url=embedding_server.base_url, retry=FAST, batch_size=8)
    with caplog.at_level(logging.WARNING, logger="qwen_embed_plugins"):
        got = run(client, "embed_documents_array", TEXTS[:32])
    np.testing.assert_array_equal(got, expected_embeddings(TEXTS[:32]))
    assert snapshot(client)["fallbacks"].get("float_encoding") == 1
    switched = [r for r in caplog.records if "using float from now on" in r.getMessage()]
    assert len(switched) == 1
    assert embedding_server.stats()["faults_applied"].get("base64_error", 0) <= 4


def test_the_llama_index_adapter_switches_to_float_on_a_base64_only_502(
    embedding_server: EmbeddingServer,
) -> None:
    from qwen_embed_plugins.integrations.llama_index import QwenPooledEmbedding

    embedding_server.fail_base64(status=502, message="upstream_decode_error")
    emb = QwenPooledEmbedding(base_url=embedding_server.base_url)
    got = emb.get_text_embedding_batch(TEXTS[:4])
    np.testing.assert_allclose(np.array(got), expected_embeddings(TEXTS[:4]), rtol=1e-6)


# --------------------------------------------------------------------------- one-item lists


def test_a_server_refusing_one_item_lists_gets_a_bare_string(
    embedding_server: EmbeddingServer, make_client: Callable[..., Client]
) -> None:
    """SGLang 0.4.6: 500 to ``["text"]``, 200 to ``"text"``: the query is resent once as
    a bare string, and the replica remembers (the next one-text calls cost one request)."""
    embedding_server.refuse_one_item_lists()
    client = make_client(base_url=embedding_server.base_url, retry=FAST)
    got = run(client, "embed_query", "what is pooling?")
    assert len(got) == 1024
    assert snapshot(client)["fallbacks"].get("bare_string_input") == 1
    sent = embedding_server.requests
    (doc,) = run(client, "embed_documents", ["one text"])
    np.testing.assert_array_equal(doc, expected_embeddings(["one text"])[0])
    run(client, "embed_query", "again")
    assert embedding_server.requests == sent + 2
    many = run(client, "embed_documents_array", TEXTS[:5])  # lists of more: as before
    np.testing.assert_array_equal(many, expected_embeddings(TEXTS[:5]))


def test_a_one_text_embed_documents_on_a_server_refusing_one_item_lists(
    embedding_server: EmbeddingServer, make_client: Callable[..., Client]
) -> None:
    embedding_server.refuse_one_item_lists()
    client = make_client(base_url=embedding_server.base_url, retry=FAST)
    got = run(client, "embed_documents_array", ["alone"])
    np.testing.assert_array_equal(got, expected_embeddings(["alone"]))


def test_the_control_request_is_sent_as_a_bare_string_too(
    embedding_server: EmbeddingServer, make_client: Callable[..., Client]
) -> None:
    """A poisoned one-text call on a server refusing one-item lists: the text fails in
    both forms; the control request fails as a list and goes through as a bare string,
    which shows the server working: the text is named."""
    embedding_server.refuse_one_item_lists()
    embedding_server.poison("poison")
    client = make_client(base_url=embedding_server.base_url, retry=FAST)
    result = run(client, "embed_documents_array", ["poison"], on_error="skip")
    assert sorted(result.errors) == [0]
    fallbacks = snapshot(client)["fallbacks"]
    assert fallbacks.get("control_requests") == 1
    assert fallbacks.get("bare_string_input") == 1
    assert len(run(client, "embed_query", "fine")) == 1024


def test_the_llama_index_adapter_on_a_server_refusing_one_item_lists(
    embedding_server: EmbeddingServer,
) -> None:
    from qwen_embed_plugins.integrations.llama_index import QwenPooledEmbedding

    embedding_server.refuse_one_item_lists()
    emb = QwenPooledEmbedding(base_url=embedding_server.base_url)
    assert len(emb.get_query_embedding("what is pooling?")) == 1024
    assert len(asyncio.run(emb.aget_text_embedding("one text"))) == 1024


# --------------------------------------------------------------------------- Retry-After


@pytest.mark.parametrize("retry_after", ["0", "-1", "NaN", "soon", "Wed, 21 Oct 2015 07:28:00 GMT"])
def test_a_useless_retry_after_never_shortens_the_backoff(
    embedding_server: EmbeddingServer, make_client: Callable[..., Client], retry_after: str
) -> None:
    """A 429 storm saying ``Retry-After: 0`` (or negative, NaN, nonsense, a past date):
    the normal backoff applies, so the storm costs a bounded number of requests (not
    thousands), each retry counted."""
    embedding_server.inject_rate_limit(count=100_000, retry_after=retry_after)
    client = make_client(
        base_url=embedding_server.base_url, retry=q.RetryConfig(query_deadline=2.0)
    )
    before = snapshot(client)
    # the storm's 429, or a timeout when the deadline cut the last attempt short
    with pytest.raises((q.RateLimitError, q.TimeoutException)):
        run(client, "embed_query", "storm")
    after = snapshot(client)
    sent = embedding_server.requests
    assert 2 <= sent <= 40, sent
    retried = after["retries_by_reason"].get("status_429", 0) - before["retries_by_reason"].get(
        "status_429", 0
    )
    assert retried == sent - 1
