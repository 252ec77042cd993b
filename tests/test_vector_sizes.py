"""Issue 20, cases 5 and 11: every vector of a call has one size, the size of a known
model (native or the ``dimensions`` asked).

Against real loopback servers: two replicas serving 768-d and 1024-d vectors, one server
whose size changes in the middle of a call (a rolling update: from the second batch on
it answers another size), and a server that sends float16 values as base64 (decoded as
float32 they look like a vector of half the size). Sync and async, list and numpy paths,
``on_error="raise"`` and ``"skip"``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import orjson
import pytest

import qwen_embed_plugins as q
from qwen_embed_tooling.testing import EmbeddingServer, expected_embedding, expected_embeddings

QWEN = "Qwen/Qwen3-Embedding-0.6B"  # 1024 dimensions
OTHER = "acme/house-embedder"  # a model whose size the client does not know


def _texts(n: int, tag: str) -> list[str]:
    return [f"{tag} passage {i} about topic {i % 17}" for i in range(n)]


def _label(server: EmbeddingServer) -> str:
    return q.EmbeddingConfig(base_url=server.base_url).endpoint


@contextlib.contextmanager
def _replicas(model: str) -> Iterator[tuple[EmbeddingServer, EmbeddingServer]]:
    """Two replicas of one endpoint, one serving 768-d vectors and one 1024-d (latency so
    that concurrent batches spread over both)."""
    with (
        EmbeddingServer(model=model, dim=768, latency=0.02) as small,
        EmbeddingServer(model=model, dim=1024, latency=0.02) as large,
    ):
        yield small, large


def _client(cls: Any, servers: tuple[EmbeddingServer, ...], model: str, **kw: Any) -> Any:
    base_url = ",".join(s.base_url for s in servers)  # the comma-separated replica list
    kw.setdefault("batch_size", 4)
    kw.setdefault("max_concurrency", 4)
    return cls(base_url=base_url, model=model, **kw)


def _body(texts: list[str], dim: int, *, float16: bool = False) -> bytes:
    """An answer for ``texts`` with ``dim``-d vectors: float lists, or (``float16``)
    base64 of little-endian float16 values, as a server misconfigured to half
    precision sends them."""
    rows = expected_embeddings(texts, dim)
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": (
                base64.b64encode(row.astype("<f2").tobytes()).decode("ascii")
                if float16
                else row.tolist()
            ),
        }
        for i, row in enumerate(rows)
    ]
    return orjson.dumps({"object": "list", "data": data, "model": QWEN})


# --------------------------------------------------------------------------- replicas


@pytest.mark.parametrize("path", ["list", "array"])
def test_replicas_of_different_sizes_raise_naming_the_replica_and_index(path: str) -> None:
    with _replicas(QWEN) as (small, large):
        client = _client(q.EmbeddingClient, (small, large), QWEN)
        texts = _texts(64, "mixed")
        embed = client.embed_documents if path == "list" else client.embed_documents_array
        with pytest.raises(q.ResponseError) as info:
            embed(texts)
        assert small.texts > 0  # the 768-d replica answered some batches
        err = info.value
        assert err.url == _label(small)
        assert isinstance(err.index, int)
        assert 0 <= err.index < len(texts)
        assert f"input index {err.index}" in str(err)
        assert _label(small) in str(err)
        assert "768 dimensions" in str(err)
        assert "1024" in str(err)
        assert not isinstance(err, q.InputError)


@pytest.mark.parametrize("path", ["list", "array"])
def test_replicas_of_different_sizes_skip_the_wrong_rows(path: str) -> None:
    with _replicas(QWEN) as (small, large):
        client = _client(q.EmbeddingClient, (small, large), QWEN)
        texts = _texts(64, "skip")
        if path == "list":
            result = client.embed_documents(texts, on_error="skip")
            rows = list(result)
            errors = result.errors
            ok = [i for i, row in enumerate(rows) if row is not None]
            vectors = np.asarray([rows[i] for i in ok], dtype=np.float32)
        else:
            arr_result = client.embed_documents_array(texts, on_error="skip")
            assert arr_result.vectors.shape == (64, 1024)
            errors = arr_result.errors
            ok = [i for i in range(64) if arr_result.ok[i]]
            vectors = arr_result.vectors[ok]
            assert np.isnan(arr_result.vectors[~arr_result.ok]).all()
        assert small.texts > 0
        assert large.texts > 0
        assert len(errors) == small.texts  # every row the 768-d replica answered
        assert len(ok) == large.texts == 64 - len(errors)
        np.testing.assert_array_equal(vectors, expected_embeddings([texts[i] for i in ok]))
        for index, err in errors.items():
            assert isinstance(err, q.ResponseError)
            assert err.index == index
            assert err.url == _label(small)
            assert "768 dimensions" in str(err)


def test_replicas_of_different_sizes_async_list_and_array() -> None:
    with _replicas(QWEN) as (small, large):
        client = _client(q.AsyncEmbeddingClient, (small, large), QWEN)
        texts = _texts(64, "async")

        async def run() -> tuple[Any, Any, BaseException, BaseException]:
            skipped = await client.embed_documents(texts, on_error="skip")
            skipped_arr = await client.embed_documents_array(texts, on_error="skip")
            errors: list[BaseException] = []
            for coro in (client.embed_documents(texts), client.embed_documents_array(texts)):
                try:
                    await coro
                except BaseException as exc:
                    errors.append(exc)
            return skipped, skipped_arr, errors[0], errors[1]

        skipped, skipped_arr, raised_list, raised_arr = asyncio.run(run())
        assert skipped.errors
        assert all(len(row) == 1024 for row in skipped if row is not None)
        assert skipped_arr.vectors.shape == (64, 1024)
        assert skipped_arr.errors
        for err in (raised_list, raised_arr):
            assert isinstance(err, q.ResponseError), repr(err)  # never a bare ValueError
            assert err.url == _label(small)
            assert isinstance(err.index, int)


def test_unknown_model_replicas_keep_the_first_size_of_the_call() -> None:
    """A model whose size the client does not know: the call's first answer sets the
    size; answers of another size fail their rows."""
    with _replicas(OTHER) as (small, large):
        client = _client(q.EmbeddingClient, (small, large), OTHER)
        texts = _texts(64, "unknown")
        result = client.embed_documents(texts, on_error="skip")
        sizes = {len(row) for row in result if row is not None}
        assert len(sizes) == 1  # one size for the whole call
        (size,) = sizes
        assert result.errors
        wrong = small if size == 1024 else large
        for err in result.errors.values():
            assert err.url == _label(wrong)
            assert f"other vectors have {size} dimensions" in str(err)
        with pytest.raises(q.ResponseError, match="other vectors have"):
            client.embed_documents_array(texts)


# --------------------------------------------------------------------------- rolling update


def _rolling(server: EmbeddingServer, texts: list[str], size: int) -> Callable[[int], None]:
    """A progress callback that, once the first batch (4 texts) is in, makes the server
    answer every later batch with ``size``-d vectors (a rolling update mid-call)."""
    batches = [texts[i : i + 4] for i in range(4, len(texts), 4)]

    def progress(done: int) -> None:
        if batches:
            for batch in batches:
                server.inject("malformed", body=_body(batch, size))
            batches.clear()

    return progress


@pytest.mark.parametrize(("model", "words"), [(QWEN, "vectors have 1024"), (OTHER, "other")])
def test_a_server_changing_size_mid_call_sync(
    embedding_server: EmbeddingServer, model: str, words: str
) -> None:
    srv = embedding_server
    client = q.EmbeddingClient(base_url=srv.base_url, model=model, batch_size=4, max_concurrency=1)
    texts = _texts(12, f"rolling {model}")
    with pytest.raises(q.ResponseError) as info:
        client.embed_documents(texts, progress=_rolling(srv, texts, 768))
    assert info.value.index == 4  # the first text of the first batch after the change
    assert info.value.url == _label(srv)
    assert words in str(info.value)
    assert "768 dimensions" in str(info.value)
    srv.clear_faults()

    texts = _texts(12, f"rolling skip {model}")
    result = client.embed_documents_array(
        texts, on_error="skip", progress=_rolling(srv, texts, 768)
    )
    assert result.vectors.shape == (12, 1024)
    assert sorted(result.errors) == list(range(4, 12))
    np.testing.assert_array_equal(result.vectors[:4], expected_embeddings(texts[:4]))


def test_a_server_changing_size_mid_call_async(embedding_server: EmbeddingServer) -> None:
    srv = embedding_server
    client = q.AsyncEmbeddingClient(
        base_url=srv.base_url, model=QWEN, batch_size=4, max_concurrency=1
    )
    texts = _texts(12, "rolling async")

    async def run() -> tuple[BaseException | None, Any]:
        raised = None
        try:
            await client.embed_documents_array(texts, progress=_rolling(srv, texts, 768))
        except BaseException as exc:
            raised = exc
        srv.clear_faults()
        again = _texts(12, "rolling async skip")
        skipped = await client.embed_documents(
            again, on_error="skip", progress=_rolling(srv, again, 768)
        )
        return raised, skipped

    raised, skipped = asyncio.run(run())
    assert isinstance(raised, q.ResponseError)
    assert raised.index == 4
    assert sorted(skipped.errors) == list(range(4, 12))
    assert all(row is None for row in skipped[4:])
    assert all(len(row) == 1024 for row in skipped[:4])


# --------------------------------------------------------------------------- float16


def test_float16_base64_is_an_error_not_a_shorter_vector(
    embedding_server: EmbeddingServer,
) -> None:
    srv = embedding_server
    client = q.EmbeddingClient(base_url=srv.base_url, model=QWEN, encoding_format="base64")
    srv.inject("malformed", body=_body(["q"], 1024, float16=True))
    with pytest.raises(q.ResponseError) as info:
        client.embed_query("what is float16?")
    message = str(info.value)
    assert "512 dimensions" in message
    assert "1024" in message
    assert "float16" in message
    assert info.value.url == _label(srv)

    texts = ["half one", "half two", "half three"]
    srv.inject("malformed", body=_body(texts, 1024, float16=True))
    with pytest.raises(q.ResponseError, match="float16"):
        client.embed_documents_array(texts)
    srv.inject("malformed", body=_body(texts, 1024, float16=True))
    result = client.embed_documents(texts, on_error="skip")
    assert list(result) == [None, None, None]
    assert sorted(result.errors) == [0, 1, 2]
    # with MRL dimensions asked, half the native size is not taken for a vector to slice
    sliced = q.EmbeddingClient(
        base_url=srv.base_url, model=QWEN, encoding_format="base64", dimensions=256
    )
    srv.inject("malformed", body=_body(texts, 1024, float16=True))
    with pytest.raises(q.ResponseError, match="512 dimensions"):
        sliced.embed_documents(texts)
    # a healthy answer still goes through
    np.testing.assert_array_equal(
        client.embed_query_array("fine"),
        expected_embedding(q.format_query("fine", q.DEFAULT_QUERY_TASK)),
    )


def test_float16_base64_async(embedding_server: EmbeddingServer) -> None:
    srv = embedding_server
    client = q.AsyncEmbeddingClient(base_url=srv.base_url, model=QWEN, encoding_format="base64")
    texts = ["a half", "b half"]

    async def run() -> list[BaseException]:
        errors: list[BaseException] = []
        srv.inject("malformed", body=_body(["q"], 1024, float16=True))
        try:
            await client.embed_query("async half")
        except BaseException as exc:
            errors.append(exc)
        srv.inject("malformed", body=_body(texts, 1024, float16=True))
        try:
            await client.embed_documents_array(texts)
        except BaseException as exc:
            errors.append(exc)
        return errors

    errors = asyncio.run(run())
    assert len(errors) == 2
    for err in errors:
        assert isinstance(err, q.ResponseError), repr(err)
        assert "512 dimensions" in str(err)
        assert "float16" in str(err)
