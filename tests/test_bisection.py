"""One bad input never sinks its batch: bisection, on_error, token budgets, base64
fallback, usage and <|endoftext|> checks — against the loopback server's rules."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins import _balance as balance
from qwen_embed_plugins import _batching as batching
from qwen_embed_plugins import _learn as learn
from qwen_embed_tooling.testing import (
    EOS_TOKEN,
    NO_EOS_SUFFIX,
    TOKEN_CAP_MESSAGE_UNSTATED,
    EmbeddingServer,
    count_tokens,
    expected_embedding,
    expected_embeddings,
)


@pytest.fixture
def srv(embedding_server: EmbeddingServer) -> EmbeddingServer:
    """A fresh server per test: what a test teaches the client about a server (a batch
    or token limit, no base64) must not carry into the next."""
    return embedding_server


TEXTS = [f"passage {i}: a quiet text about item {i * 37 % 101}" for i in range(64)]
FAST = q.RetryConfig(backoff_initial=0.01, backoff_max=0.05)


def replica_state(client: q.EmbeddingClient | q.AsyncEmbeddingClient) -> learn.ReplicaState:
    return balance.endpoint_for(client.config).replicas[0].state(str(client.config.model))


@pytest.mark.parametrize("action", ["status", "nan", "close", "reset"])
def test_one_poisonous_text_costs_only_itself(srv: EmbeddingServer, action: str) -> None:
    """A 500 / NaN / dropped connection caused by one text of a 32-text batch: the other
    63 texts are embedded exactly, the error names the caller's index, and the breaker
    never opens."""
    poison = TEXTS[37]
    srv.poison(poison, action=action)
    client = q.EmbeddingClient(base_url=srv.base_url, batch_size=32, retry=FAST)
    with pytest.raises(q.QwenEmbedError) as info:
        client.embed_documents(TEXTS)
    assert getattr(info.value, "index", None) == 37, info.value
    assert "input index 37" in str(info.value)

    skipped = client.embed_documents(TEXTS, on_error="skip")
    assert isinstance(skipped, q.EmbeddingList)
    assert list(skipped.errors) == [37]
    assert skipped[37] is None
    good = [i for i in range(64) if i != 37]
    np.testing.assert_allclose(
        [skipped[i] for i in good], expected_embeddings([TEXTS[i] for i in good]), atol=1e-6
    )
    assert balance.endpoint_for(client.config).opened == 0
    # bisection, not repetition: far fewer requests than 4 tries of every piece
    assert srv.requests < 40


def test_skip_array_and_async(srv: EmbeddingServer) -> None:
    srv.poison(TEXTS[3])
    srv.poison(TEXTS[60])
    aclient = q.AsyncEmbeddingClient(base_url=srv.base_url, batch_size=16, retry=FAST)
    result = asyncio.run(aclient.embed_documents_array(TEXTS, on_error="skip"))
    assert isinstance(result, q.EmbeddingResult)
    assert sorted(result.errors) == [3, 60]
    assert np.isnan(result.vectors[[3, 60]]).all()
    assert result.ok.sum() == 62
    np.testing.assert_array_equal(
        result.vectors[result.ok],
        expected_embeddings([t for i, t in enumerate(TEXTS) if i not in (3, 60)]),
    )


def test_raise_names_the_first_poisonous_index(srv: EmbeddingServer) -> None:
    for i in (50, 9, 33):
        srv.poison(TEXTS[i])
    client = q.EmbeddingClient(base_url=srv.base_url, batch_size=8, max_concurrency=4, retry=FAST)
    with pytest.raises(q.ServerError) as info:
        client.embed_documents(TEXTS)
    assert info.value.index == 9


def test_a_batch_too_big_for_the_server_is_split_and_its_size_learned(
    srv: EmbeddingServer,
) -> None:
    """A server that drops every batch over 8 texts (out of memory): all 64 vectors, and
    after two batches have shown it, 8 texts per request from then on."""
    srv.drop_batches_over(8)
    client = q.EmbeddingClient(base_url=srv.base_url, batch_size=32, max_concurrency=1, retry=FAST)
    np.testing.assert_allclose(client.embed_documents(TEXTS), expected_embeddings(TEXTS), atol=1e-6)
    assert replica_state(client).batch.limit == 8
    srv.reset_counters()
    client.embed_documents([f"again {i}" for i in range(32)])
    assert max(len(b) for b in srv.received) <= 8
    assert set(srv.stats()["responses"]) == {"200"}


def test_context_length_in_a_batch_names_the_text(srv: EmbeddingServer) -> None:
    srv.limit_input_tokens(50, name_index=False)  # the server does not say which
    texts = list(TEXTS[:20])
    texts[13] = "long " * 100
    client = q.EmbeddingClient(base_url=srv.base_url, batch_size=20, retry=FAST)
    with pytest.raises(q.ContextLengthError) as info:
        client.embed_documents(texts)
    assert info.value.index == 13
    skipped = client.embed_documents(texts, on_error="skip")
    assert list(skipped.errors) == [13]


@pytest.mark.parametrize("stated", [True, False])
def test_token_cap_per_request_splits_and_is_learned(srv: EmbeddingServer, stated: bool) -> None:
    """40 texts of ~700 tokens against a 16,384-token cap per request: split by tokens,
    every vector exact, and later calls respect the learned cap at once."""
    if stated:
        srv.cap_batch_tokens(16_384)
    else:
        srv.cap_batch_tokens(16_384, message=TOKEN_CAP_MESSAGE_UNSTATED)
    texts = [f"{i} " + "lorem ipsum dolor sit amet " * 100 for i in range(40)]  # ~700 tokens
    assert 650 < count_tokens(texts[0]) < 750
    client = q.EmbeddingClient(base_url=srv.base_url, batch_size=40, retry=FAST)
    np.testing.assert_allclose(client.embed_documents(texts), expected_embeddings(texts), atol=1e-6)
    cap = replica_state(client).batch.token_limit
    assert cap is not None
    assert cap <= 16_384
    srv.reset_counters()
    more = [t + " more" for t in texts]
    client.embed_documents(more)
    assert set(srv.stats()["responses"]) == {"200"}  # no refusal once learned
    # one text alone over the cap is that text's error
    srv.cap_batch_tokens(100)
    with pytest.raises(q.BatchTooLargeError) as info:
        client.embed_documents(["short", "x " * 400])
    assert info.value.index == 1


def test_base64_that_breaks_the_server_falls_back_to_float(
    srv: EmbeddingServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="qwen_embed_plugins")
    srv.fail_base64()  # 500 for base64, float works
    client = q.EmbeddingClient(base_url=srv.base_url, retry=FAST)
    np.testing.assert_allclose(
        client.embed_documents(TEXTS[:10]), expected_embeddings(TEXTS[:10]), atol=1e-6
    )
    assert replica_state(client).base64_ok is False
    client.embed_documents(TEXTS[10:20])
    assert srv.stats()["responses"].get("500") == 1  # remembered: base64 never again
    warnings = [r.getMessage() for r in caplog.records if "float" in r.getMessage()]
    assert len(warnings) == 1


def test_silent_truncation_is_reported(
    srv: EmbeddingServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="qwen_embed_plugins")
    srv.truncate_inputs(2048)
    long_text = "word " * 4800  # ~6,000 tokens
    client = q.EmbeddingClient(base_url=srv.base_url)
    client.embed_documents(["short one", long_text, "short two"])
    messages = [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()]
    assert len(messages) == 1
    assert "input index 1" in messages[0]
    assert "2048" in messages[0]
    snap = q.stats()[client.config.endpoint]
    assert snap["fallbacks"].get("truncated_input", 0) >= 1


def test_llamacpp_without_eos_is_reported_and_append_eos_fixes_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="qwen_embed_plugins")
    with EmbeddingServer(dialect="llamacpp", append_eos=False) as srv:
        plain = q.EmbeddingClient(base_url=srv.base_url)
        got = plain.embed_documents(["hello"])[0]
        np.testing.assert_allclose(got, expected_embedding("hello" + NO_EOS_SUFFIX), atol=1e-6)
        warned = [r.getMessage() for r in caplog.records if "<|endoftext|>" in r.getMessage()]
        assert len(warned) == 1
        assert "append_eos=True" in warned[0]
        plain.embed_documents(["again"])  # checked once per server
        assert len([r for r in caplog.records if "<|endoftext|>" in r.getMessage()]) == 1
        fixed = q.EmbeddingClient(base_url=srv.base_url, append_eos=True)
        np.testing.assert_allclose(
            fixed.embed_documents(["hello"])[0], expected_embedding("hello"), atol=1e-6
        )
        assert EOS_TOKEN == "<|endoftext|>"
    caplog.clear()
    with EmbeddingServer(dialect="llamacpp", append_eos=True) as good:
        q.EmbeddingClient(base_url=good.base_url).embed_documents(["hello"])
        assert not [r for r in caplog.records if "<|endoftext|>" in r.getMessage()]


def test_an_inferred_batch_limit_is_retested_and_lifted(srv: EmbeddingServer) -> None:
    """A limit inferred from dropped batches (the server said nothing) is not kept for
    good: after 50 successful requests one batch above it is tried; while the server
    still drops it the batch is split (every vector exact) and the next retest waits
    twice as long; once the server takes it the limit is lifted."""
    srv.drop_batches_over(8)
    client = q.EmbeddingClient(base_url=srv.base_url, batch_size=32, max_concurrency=1, retry=FAST)
    np.testing.assert_array_equal(client.embed_documents_array(TEXTS), expected_embeddings(TEXTS))
    state = replica_state(client)
    assert state.batch.limit == 8
    assert state.batch.limit_inferred
    calls = 0
    while state.batch.retest_every == batching.RETEST_EVERY:  # the server still drops them
        batch = [f"held {calls} {i}" for i in range(32)]
        np.testing.assert_array_equal(
            client.embed_documents_array(batch), expected_embeddings(batch)
        )
        calls += 1
        assert calls < 100, "no retest after 50 requests"
    assert state.batch.limit == 8
    assert state.batch.limit_inferred
    assert state.batch.retest_every == 2 * batching.RETEST_EVERY

    srv.clear_rules()  # the spell is over: the server takes big batches again
    srv.reset_counters()
    calls = 0
    while state.batch.limit is not None:
        batch = [f"lifted {calls} {i}" for i in range(32)]
        np.testing.assert_array_equal(
            client.embed_documents_array(batch), expected_embeddings(batch)
        )
        calls += 1
        assert calls < 200, "the limit was never lifted"
    assert max(len(b) for b in srv.received) == 32
    snap = balance.endpoint_for(client.config).replicas[0].metrics.snapshot()
    assert snap["fallbacks"].get("batch_limit_lifted") == 1
    srv.reset_counters()
    client.embed_documents([f"whole {i}" for i in range(32)])
    assert [len(b) for b in srv.received] == [32]


def test_a_stated_batch_limit_is_kept() -> None:
    """A limit the server stated (a 400 naming its maximum batch size) is never retested:
    200 requests later no batch above it has been sent."""
    with EmbeddingServer(max_batch=5) as limited:
        client = q.EmbeddingClient(
            base_url=limited.base_url, batch_size=20, max_concurrency=1, retry=FAST
        )
        for call in range(30):
            batch = [f"stated {call} {i}" for i in range(40)]
            np.testing.assert_array_equal(
                client.embed_documents_array(batch), expected_embeddings(batch)
            )
        state = replica_state(client)
        assert state.batch.limit == 5
        assert not state.batch.limit_inferred
        assert limited.stats()["responses"].get("400") == 1  # said once, kept since
