"""A failure that could be the server's or the input's (a 500, a dropped connection, a
400 naming no input) is blamed on an input only when the text fails again after the
server has been seen to work: a control request with a known-good text shows it (when no
other request has since); a control that fails too is an outage, retried until the
call's deadline."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins import _balance as balance
from qwen_embed_tooling.testing import EmbeddingServer, expected_embeddings

FAST = q.RetryConfig(backoff_initial=0.01, backoff_max=0.05, max_attempts=2)
SHORT = FAST.replace(deadline=1.0, query_deadline=1.0)  # for a server that never recovers
TEXTS = [f"control passage {i}" for i in range(32)]


def _fallbacks(client: q.EmbeddingClient | q.AsyncEmbeddingClient) -> dict[str, int]:
    replica = balance.endpoint_for(client.config).replicas[0]
    return dict(replica.metrics.snapshot().get("fallbacks", {}))


@pytest.mark.parametrize("count", [1, 2, 3, 32])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_server_failing_everything_blames_no_input(
    embedding_server: EmbeddingServer, count: int, on_error: str
) -> None:
    """Every request answered 500: an outage (retried until the deadline), then the call
    raises the server's error, with no input index, in both modes (a skip-mode call
    never returns placeholder vectors for it)."""
    embedding_server.inject_status(500, count=10_000, message="CUDA error: device-side assert")
    client = q.EmbeddingClient(base_url=embedding_server.base_url, batch_size=32, retry=SHORT)
    with pytest.raises(q.ServerError) as info:
        client.embed_documents(TEXTS[:count], on_error=on_error)  # type: ignore[arg-type]
    assert info.value.index is None, info.value
    assert "input index" not in str(info.value)
    assert "control request" in str(info.value)
    assert "CUDA error" in str(info.value)


@pytest.mark.parametrize("action", ["close", "status"])
def test_a_server_dropping_everything_blames_no_input_async(
    embedding_server: EmbeddingServer, action: str
) -> None:
    if action == "close":
        embedding_server.inject("close", count=10_000)
    else:
        embedding_server.inject_status(500, count=10_000)
    client = q.AsyncEmbeddingClient(base_url=embedding_server.base_url, retry=SHORT)
    with pytest.raises(q.QwenEmbedError) as info:
        asyncio.run(client.embed_query("what is pooling?"))
    assert getattr(info.value, "index", None) is None, info.value


def test_a_poisoned_single_text_is_still_named(embedding_server: EmbeddingServer) -> None:
    """The control request succeeds: the single text is the cause and is named; one
    control request was sent, counted in the metrics."""
    embedding_server.poison(TEXTS[0])
    client = q.EmbeddingClient(base_url=embedding_server.base_url, retry=FAST)
    with pytest.raises(q.ServerError) as info:
        client.embed_documents(TEXTS[:1])
    assert info.value.index == 0
    assert "input index 0" in str(info.value)
    assert _fallbacks(client).get("control_requests") == 1
    skipped = client.embed_documents(TEXTS[:1], on_error="skip")
    assert list(skipped.errors) == [0]


def test_a_poisoned_first_text_of_a_batch_costs_one_control(
    embedding_server: EmbeddingServer,
) -> None:
    """The first piece of a bisection fails before any piece succeeded: one control,
    then the other 31 vectors exactly."""
    embedding_server.poison(TEXTS[0])
    embedding_server.poison(TEXTS[1])
    embedding_server.poison(TEXTS[2])
    client = q.EmbeddingClient(base_url=embedding_server.base_url, batch_size=32, retry=FAST)
    skipped = client.embed_documents_array(TEXTS, on_error="skip")
    assert sorted(skipped.errors) == [0, 1, 2]
    np.testing.assert_array_equal(skipped.vectors[3:], expected_embeddings(TEXTS[3:]))
    assert _fallbacks(client).get("control_requests") == 1
    with pytest.raises(q.ServerError) as info:
        client.embed_documents(TEXTS)
    assert info.value.index == 0


def test_a_bad_parameter_400_on_one_text_is_not_the_input(
    embedding_server: EmbeddingServer,
) -> None:
    """A 400 about the request (not an input) for a one-text call: not pinned on it."""
    embedding_server.inject_status(
        400, count=10_000, message="parameter 'user' is not supported by this deployment"
    )
    client = q.EmbeddingClient(base_url=embedding_server.base_url, retry=FAST)
    with pytest.raises(q.BadRequestError) as info:
        client.embed_query("hello there")
    assert info.value.index is None
    assert "not supported" in str(info.value)
