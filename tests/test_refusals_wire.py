"""Gateway refusals through a real loopback server (issue 30 items 1-4): the wordings
found in the field (LiteLLM, Vertex through LiteLLM, Gemini, llama-box, Jina), each on
the sync and async clients and an adapter. The decisions themselves (and the members
the issue did not name) are tested on the scripted engine: tests/test_refusals.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest
from recording_server import RecordingServer

import qwen_embed_plugins as q
from qwen_embed_plugins.integrations.langchain import QwenPooledEmbeddings
from qwen_embed_plugins.integrations.llama_index import QwenPooledEmbedding
from qwen_embed_tooling.testing import expected_embeddings

FAST = q.RetryConfig(backoff_initial=0.01, backoff_max=0.02)
Refuse = Callable[[dict[str, Any]], "tuple[int, object] | None"]
TEXTS = [f"gateway passage {i} " + "lorem " * 15 for i in range(20)]  # ~110 bytes each


def items_over(cap: int, status: int, template: str, **fields: Any) -> Refuse:
    """Refuse a request of more than ``cap`` texts as a gateway words it (``status``,
    the message ``template`` and more ``fields`` of its error object)."""

    def refuse(body: dict[str, Any]) -> tuple[int, object] | None:
        n = len(body["input"]) if isinstance(body["input"], list) else 1
        if n <= cap:
            return None
        return status, {"error": {"message": template.format(cap=cap, n=n), **fields}}

    return refuse


def bytes_over(cap: int) -> Refuse:
    """Gemini's OpenAI endpoint: a request body over ``cap`` bytes."""

    def refuse(body: dict[str, Any]) -> tuple[int, object] | None:
        if len(orjson.dumps(body)) <= cap:
            return None
        message = f"Request payload size exceeds the limit: {cap} bytes."
        return 400, {"error": {"code": 400, "message": message, "status": "INVALID_ARGUMENT"}}

    return refuse


MEMBERS = {
    # OpenAI relayed by LiteLLM
    "litellm-422": items_over(
        8, 422, "Value should have at most {cap} items after validation, not {n}"
    ),
    # Vertex AI through LiteLLM: ``code`` as a string
    "vertex-400": items_over(
        5, 400, "{cap} instance(s) is allowed per prediction. Actual: {n}", code="400"
    ),
    "gemini-bytes": bytes_over(2000),
}


def embed(kind: str, url: str, texts: list[str], **settings: Any) -> Any:
    """``texts`` embedded through ``kind``: the sync or async client, or an adapter."""
    if kind == "sync":
        return q.EmbeddingClient(base_url=url, retry=FAST, **settings).embed_documents(texts)
    if kind == "async":
        client = q.AsyncEmbeddingClient(base_url=url, retry=FAST, **settings)
        return asyncio.run(client.embed_documents(texts))
    if kind == "langchain":
        return QwenPooledEmbeddings(base_url=url, **settings).embed_documents(texts)
    return QwenPooledEmbedding(base_url=url, **settings).get_text_embedding_batch(texts)


@pytest.mark.parametrize("kind", ["sync", "async", "langchain", "llama_index"])
@pytest.mark.parametrize("member", sorted(MEMBERS))
def test_a_stated_limit_in_a_gateways_words_is_learned(member: str, kind: str) -> None:
    """A batch of 20 refused with a limit stated in the gateway's words: every text
    embedded, the later requests within the limit, and the next call refused no more."""
    with RecordingServer(refuse=MEMBERS[member]) as rec:
        got = embed(kind, rec.base_url, TEXTS, batch_size=20)
        np.testing.assert_allclose(np.asarray(got), expected_embeddings(TEXTS), atol=1e-6)
        first = rec.all()
        assert len(first[0].body["input"]) == 20  # refused
        assert all(MEMBERS[member](r.body) is None for r in first[1:])  # within the limit
        assert len(first) <= 1 + 20 // 2  # learned at once: no bisection
        more = [f"{t} again" for t in TEXTS]
        embed(kind, rec.base_url, more, batch_size=20)
        assert all(MEMBERS[member](r.body) is None for r in rec.all()[len(first) :])


def llama_box(body: dict[str, Any]) -> tuple[int, object] | None:
    """llama-box's 400 for a chunk over the context of one sequence."""
    texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
    if not any(t.startswith("LONG") for t in texts):
        return None
    message = (
        "Illegal param: prefill 744 tokens exceed n_ctx_per_seq, try increasing total "
        "context size, adjusting RoPE, enabling context shifting, reducing parallel or "
        "reducing prefill tokens"
    )
    error = {"code": 400, "message": message, "type": "invalid_request_error"}
    return 400, {"error": error, "detail": message}


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_llama_box_one_long_chunk_is_skipped_alone(kind: str) -> None:
    """16 chunks, one too long for llama-box: under ``on_error="skip"`` the 15 others are
    embedded and the long one is a ``ContextLengthError`` naming its index."""
    chunks = [f"chunk {i}" for i in range(16)]
    chunks[11] = "LONG " + "words " * 600
    with RecordingServer(refuse=llama_box) as rec:
        if kind == "sync":
            client: Any = q.EmbeddingClient(base_url=rec.base_url, retry=FAST, batch_size=16)
            result = client.embed_documents_array(chunks, on_error="skip")
        else:
            client = q.AsyncEmbeddingClient(base_url=rec.base_url, retry=FAST, batch_size=16)
            result = asyncio.run(client.embed_documents_array(chunks, on_error="skip"))
        assert list(result.errors) == [11]
        error = result.errors[11]
        assert isinstance(error, q.ContextLengthError)
        assert error.index == 11
        kept = [c for i, c in enumerate(chunks) if i != 11]
        rows = np.delete(result.vectors, 11, axis=0)
        np.testing.assert_allclose(rows, expected_embeddings(kept), atol=1e-6)


def jina(code: int) -> Refuse:
    """Jina's API (400) and a strict gateway (422): the ``encoding_format`` field refused."""

    def refuse(body: dict[str, Any]) -> tuple[int, object] | None:
        if "encoding_format" not in body:
            return None
        if code == 400:
            return 400, {"detail": "extra fields not permitted: ['encoding_format']"}
        detail = [
            {"type": "extra_forbidden", "loc": ["body", "encoding_format"], "msg": "Extra "
             "inputs are not permitted", "input": body["encoding_format"]}
        ]  # fmt: skip
        return 422, {"detail": detail}

    return refuse


@pytest.mark.parametrize("kind", ["sync", "async", "llama_index"])
@pytest.mark.parametrize("code", [400, 422])
def test_a_server_refusing_encoding_format_gets_float_without_it(code: int, kind: str) -> None:
    """Base64 first (the default): the field refused once, then float without the field
    for the replica; ``encoding_format="float"`` never sends it."""
    with RecordingServer(refuse=jina(code)) as rec:
        for _ in range(2):
            got = embed(kind, rec.base_url, TEXTS[:3])
            np.testing.assert_allclose(np.asarray(got), expected_embeddings(TEXTS[:3]), atol=1e-6)
        assert ["encoding_format" in r.body for r in rec.all()] == [True, False, False]
    with RecordingServer(refuse=jina(code)) as rec:
        embed(kind, rec.base_url, TEXTS[:3], encoding_format="float")
        assert ["encoding_format" in r.body for r in rec.all()] == [False]


def generic_base64_refusal(body: dict[str, Any]) -> tuple[int, object] | None:
    """A gateway answering a bare "Bad Request" to any request asking for base64."""
    if body.get("encoding_format") != "base64":
        return None
    return 400, {"error": {"message": "Bad Request"}}


@pytest.mark.parametrize("kind", ["sync", "async", "langchain", "llama_index"])
def test_batches_in_flight_pick_up_a_field_lesson_on_first_contact(kind: str) -> None:
    """16 texts in batches of 2, four in flight on first contact, base64 refused in words
    naming nothing: every batch is refused once, one control request without the
    field teaches the replica (one lesson), and the batches refused meanwhile are sent
    again with it, never bisected (no batch cap is learned from them): every vector,
    and the next call sends float batches of 2 at once."""
    texts = [f"doc {i}" for i in range(16)]
    batch = {"chunk_size": 2} if kind == "langchain" else {"batch_size": 2}
    if kind == "llama_index":
        batch = {"embed_batch_size": 2}
    with RecordingServer(refuse=generic_base64_refusal) as rec:
        got = embed(kind, rec.base_url, texts, **batch)
        np.testing.assert_allclose(np.asarray(got), expected_embeddings(texts), atol=1e-6)
        first = len(rec.all())
        assert first <= 8 + 4 + 8  # each batch refused once, a few controls, each resent
        more = [f"{t} again" for t in texts]
        embed(kind, rec.base_url, more, **batch)
        later = rec.all()[first:]
        assert all("encoding_format" not in r.body for r in later)
        assert sorted(len(r.body["input"]) for r in later) == [2] * 8


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_field_refused_by_one_replica_is_learned_for_that_one(kind: str) -> None:
    """Two replicas, only one refusing base64 in words naming nothing: the control
    request goes to the replica that refused (the other would take it and the texts
    would be blamed); it learns float, the other keeps base64; every vector."""
    texts = [f"doc {i}" for i in range(12)]
    with (
        RecordingServer(refuse=generic_base64_refusal) as strict,
        RecordingServer() as plain,
    ):
        urls = [strict.base_url, plain.base_url]
        for _ in range(2):
            got = embed(kind, urls, texts, batch_size=4)
            np.testing.assert_allclose(np.asarray(got), expected_embeddings(texts), atol=1e-6)
        assert all(r.body.get("encoding_format") == "base64" for r in plain.all())
        refused = [r for r in strict.all() if r.body.get("encoding_format") == "base64"]
        assert 1 <= len(refused) <= 4  # the batches in flight before the lesson (+ a control)
