"""The one-text fast path of the response decoder (queries) checks exactly what the batch
path checks, and returns the same rows."""

from __future__ import annotations

import base64

import numpy as np
import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins._protocol import bad_rows, decode_rows, normalize_rows

pytestmark = pytest.mark.unit


def _b64(values: list[float]) -> str:
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()


@pytest.mark.parametrize("encoded", [True, False])
def test_one_row_equals_the_batch_path(encoded: bool) -> None:
    rng = np.random.default_rng(7)
    vecs = rng.standard_normal((2, 16)).astype(np.float32)
    items = [
        {"index": i, "embedding": _b64(v.tolist()) if encoded else v.tolist()}
        for i, v in enumerate(vecs)
    ]
    one, sq1 = decode_rows({"data": items[:1]}, [5])
    two, sq2 = decode_rows({"data": items}, [5, 6])
    assert one.shape == (1, 16)
    assert one.dtype == np.float32
    np.testing.assert_array_equal(one[0], two[0])
    assert sq1[0] == sq2[0]
    assert normalize_rows(one, squared_norms=sq1)[0].tolist() == [
        normalize_rows(two, squared_norms=sq2)[0][0].tolist()
    ]


@pytest.mark.parametrize(
    ("vector", "reason"),
    [
        ([0.0, 0.0, 0.0], "is all zeros"),
        ([float("nan"), 1.0, 0.0], "contains NaN or Inf"),
        ([float("inf"), 1.0, 0.0], "contains NaN or Inf"),
        ([None, 1.0, 0.0], "contains NaN or Inf"),  # NaN sent as null
    ],
)
def test_one_bad_row_is_reported(vector: list[float | None], reason: str) -> None:
    _, sq = decode_rows({"data": [{"index": 0, "embedding": vector}]}, [3])
    assert bad_rows(sq) == {0: reason}


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ({"index": 1, "embedding": [1.0]}, "index 1, outside 0..0"),
        ({"index": True, "embedding": [1.0]}, "index True"),
        ({"index": "0", "embedding": [1.0]}, "index '0'"),
        ({"index": 0.0, "embedding": [1.0]}, "index 0.0"),
        ({"index": 0, "embedding": []}, "input index 9 is empty"),
        ({"index": 0, "embedding": [[1.0, 2.0]]}, "input index 9 holds list"),
        ({"index": 0, "embedding": ["1.0"]}, "input index 9 holds str"),
        ({"index": 0, "embedding": "not base64!"}, "not valid base64"),
        ("just a string", "data[0] is"),
    ],
)
def test_one_malformed_row_is_refused(item: object, message: str) -> None:
    with pytest.raises(q.ResponseError, match=message.replace("[", r"\[")):
        decode_rows({"data": [item]}, [9])


def test_one_row_count_mismatch_is_refused() -> None:
    with pytest.raises(q.ResponseError, match="2 embeddings for 1 inputs"):
        decode_rows({"data": [{"embedding": [1.0]}, {"embedding": [1.0]}]}, [0])


def test_one_row_is_renormalised_only_when_off_unit_length() -> None:
    unit = np.asarray([[0.6, 0.8]], dtype=np.float32)
    out, changed = normalize_rows(unit)
    assert not changed
    assert out is unit
    off = np.asarray([[3.0, 4.0]], dtype=np.float32)
    out, changed = normalize_rows(off)
    assert changed
    np.testing.assert_allclose(out, [[0.6, 0.8]], rtol=1e-6)
