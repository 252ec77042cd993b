"""``openai_client()`` refuses what the codec path refuses: a 2xx answer to
``POST /embeddings`` that is not JSON (an HTML page included), has no ``data`` list, the
wrong number of vectors, a malformed vector, a NaN/Inf or all-zero vector, or carries
``{"error": ...}`` ends in an ``openai.APIError`` (``APIConnectionError``, chained from
``httpx.DecodingError``, chained from the library's scrubbed ``ResponseError``), never
in vectors returned without a check or a bare ``AttributeError``; sync and async, on the
installed openai major (the suite runs these on openai 2.x too)."""

from __future__ import annotations

import asyncio
import base64
import traceback
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

import qwen_embed_plugins as q
from qwen_embed_tooling.testing import EmbeddingServer, HostileServer

KEY = "sk-sdk-answers-0123456789abcdef"
ONCE = q.RetryConfig(max_attempts=1)
MODES = ("sdk_sync", "sdk_async")
TEXTS = ["alpha", "beta"]
DIM = 1024  # the model's size: the codec path checks it before NaN and zero vectors
UNIT = [1.0] + [0.0] * (DIM - 1)
ZERO = [0.0] * DIM


def _item(embedding: object, index: int = 0) -> dict[str, Any]:
    return {"object": "embedding", "index": index, "embedding": embedding}


def _body(*items: object, **extra: Any) -> bytes:
    return orjson.dumps({"object": "list", "data": list(items), "model": "m", **extra})


# Bodies of a 200 (application/json) to a request for TEXTS, each one the codec refuses:
# (id, body, the words its ResponseError holds).
ONE_FOR_TWO = _body(_item([1.0, 0.0]))
MALFORMED: list[tuple[str, bytes, str]] = [
    ("not_json", b"<html><body>oops</body></html>", "not valid JSON"),
    ("truncated_json", b'{"data": [{"embedding": [0.1', "not valid JSON"),
    ("empty_body", b"", "not valid JSON"),
    ("json_list", b"[]", "no 'data' list"),
    ("json_string", b'"embeddings"', "no 'data' list"),
    ("data_null", b'{"data": null}', "no 'data' list"),
    ("data_object", b'{"data": {"embedding": [1.0]}}', "no 'data' list"),
    ("error_in_200", b'{"error": {"message": "model crashed", "type": "x"}}', "model crashed"),
    ("one_for_two", ONE_FOR_TWO, "1 embeddings for 2 inputs"),
    ("three_for_two", _body(_item([1.0]), _item([1.0], 1), _item([1.0], 2)), "3 embeddings"),
    ("item_not_object", _body(_item([1.0]), [1.0, 0.0]), "expected an object"),
    ("index_twice", _body(_item([1.0, 0.0]), _item([0.0, 1.0])), "appears twice"),
    ("index_out_of_range", _body(_item([1.0]), _item([1.0], 5)), "outside 0..1"),
    ("nested", _body(_item([[1.0, 0.0]]), _item([[0.0, 1.0]], 1)), "flat list of numbers"),
    ("strings", _body(_item(["1.0"]), _item(["0.5"], 1)), "str values"),
    ("bools", _body(_item([True]), _item([False], 1)), "bool values"),
    ("missing_embedding", _body({"index": 0}, {"index": 1}), "expected a list"),
    ("bad_base64", _body(_item("!!!notbase64"), _item("AAAAAA==", 1)), "not valid base64"),
    ("sizes_differ", _body(_item([1.0, 0.0]), _item([1.0, 0.0, 0.0], 1)), "dimensions"),
    ("empty_vector", _body(_item([]), _item([], 1)), "is empty"),
    ("zero_vector", _body(_item(ZERO), _item(UNIT, 1)), "zero"),
    ("null_component", _body(_item([None, *UNIT[1:]]), _item(UNIT, 1)), "NaN"),
]


@pytest.fixture(scope="module")
def answers() -> Iterator[EmbeddingServer]:
    with EmbeddingServer() as server:
        yield server


def sdk_call(mode: str, base_url: str, **extra: Any) -> Any:
    """``embeddings.create(input=TEXTS)`` through ``openai_client()``: the response or
    the exception raised (whose formatted traceback never holds the key)."""
    opts = {"base_url": base_url, "api_key": KEY, "retry": ONCE, **extra}
    try:
        if mode == "sdk_sync":
            return (
                q.EmbeddingClient(**opts).openai_client().embeddings.create(input=TEXTS, model="m")
            )
        asdk = q.AsyncEmbeddingClient(**opts).openai_client()
        return asyncio.run(asdk.embeddings.create(input=TEXTS, model="m"))
    except Exception as exc:
        failure = exc
    assert KEY not in "".join(traceback.format_exception(failure))
    return failure


def refused(outcome: Any) -> q.ResponseError:
    """The library's ``ResponseError`` behind the SDK's ``APIConnectionError``."""
    import openai

    assert isinstance(outcome, openai.APIConnectionError), repr(outcome)
    middle = outcome.__cause__
    assert middle is not None
    assert type(middle).__name__ == "DecodingError", repr(middle)
    cause = middle.__cause__
    assert isinstance(cause, q.ResponseError), repr(cause)
    assert cause.__cause__ is None  # a scrubbed copy: nothing of the server's below it
    return cause


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("body", "words"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_openai_client_refuses_a_malformed_200_as_the_codec_does(
    answers: EmbeddingServer, mode: str, body: bytes, words: str
) -> None:
    answers.clear_faults()
    # the codec path refuses it: the reference (an answer that does not fit a batch is a
    # refused batch, checked with a control request: the fault repeats for every request)
    answers.inject("malformed", body=body, count=8)
    with pytest.raises(q.ResponseError) as codec:
        q.EmbeddingClient(base_url=answers.base_url, retry=ONCE).embed_documents(TEXTS)
    answers.clear_faults()
    answers.inject("malformed", body=body)
    error = refused(sdk_call(mode, answers.base_url))
    assert words in str(error), str(error)
    # "one_for_two" (one 2-number vector for two texts): the codec path's control request,
    # one text, gets a well-formed answer of the wrong size, which it names instead
    codec_words = "has 2 dimensions" if body == ONE_FOR_TWO else words
    assert codec_words in str(codec.value), str(codec.value)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("kind", "words"), [("wrong_count", "1 embeddings for 2"), ("nan", "NaN")])
def test_openai_client_refuses_the_vector_faults(
    answers: EmbeddingServer, mode: str, kind: str, words: str
) -> None:
    answers.clear_faults()
    answers.inject(kind)
    error = refused(sdk_call(mode, answers.base_url))
    assert words in str(error), str(error)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["html", "error_200", "nested", "string_components"])
def test_openai_client_refuses_the_hostile_malformed_answers(mode: str, kind: str) -> None:
    """An HTML page (``text/html``) raised a bare ``AttributeError`` in the SDK before."""
    with HostileServer() as hostile:
        hostile.set(kind, on="embeddings")
        try:
            refused(sdk_call(mode, hostile.base_url))
        finally:
            q.close_all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_openai_client_still_returns_good_answers(
    answers: EmbeddingServer, mode: str, encoding: str
) -> None:
    answers.clear_faults()
    opts = {"base_url": answers.base_url, "api_key": KEY}
    if mode == "sdk_sync":
        got = (
            q.EmbeddingClient(**opts)
            .openai_client()
            .embeddings.create(input=TEXTS, model="m", encoding_format=encoding)
        )
    else:
        asdk = q.AsyncEmbeddingClient(**opts).openai_client()
        got = asyncio.run(asdk.embeddings.create(input="one", model="m", encoding_format=encoding))
    for item in got.data:  # a base64 answer asked for explicitly: the SDK leaves it encoded
        vector = item.embedding
        size = len(base64.b64decode(vector)) // 4 if isinstance(vector, str) else len(vector)
        assert size == DIM
