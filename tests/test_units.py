"""I/O-free parts: config validation, codec, error parsing, retry maths, breaker."""

from __future__ import annotations

import base64
import email.utils
import random
import socket

import numpy as np
import orjson
import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins import _batching as batching
from qwen_embed_plugins import _protocol as protocol
from qwen_embed_plugins import _retry as retry
from qwen_embed_plugins import errors
from qwen_embed_plugins._config import EmbeddingConfig, Limits, RetryConfig, Timeouts

pytestmark = pytest.mark.unit  # no server, no socket

# ----------------------------------------------------------------------------- config


def test_config_is_frozen_and_hashable() -> None:
    a = EmbeddingConfig(base_url="http://h:1/v1/")
    b = EmbeddingConfig(base_url="http://h:1/v1")
    assert a == b
    assert hash(a) == hash(b)
    assert a.base_url == "http://h:1/v1"
    with pytest.raises(AttributeError):
        a.batch_size = 3  # type: ignore[misc]
    # batching settings do not change the pool key; transport settings do
    assert a.replace(batch_size=7).pool_key == a.pool_key
    assert a.replace(limits=Limits(max_connections=3)).pool_key != a.pool_key


def test_base_url_required_and_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QWEN_EMBED_BASE_URL", raising=False)
    with pytest.raises(q.ConfigError, match="base_url is required"):
        EmbeddingConfig()
    monkeypatch.setenv("QWEN_EMBED_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("QWEN_EMBED_BATCH_SIZE", "64")
    cfg = EmbeddingConfig.from_env(dimensions=256)
    assert cfg.base_url == "http://127.0.0.1:9/v1"
    assert cfg.batch_size == 64
    assert cfg.dimensions == 256
    monkeypatch.setenv("QWEN_EMBED_BATCH_SIZE", "lots")
    with pytest.raises(q.ConfigError, match="QWEN_EMBED_BATCH_SIZE"):
        EmbeddingConfig.from_env()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 5000}, "batch_size"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"encoding_format": "json"}, "encoding_format"),
        ({"dimensions": 16}, "dimensions"),  # Qwen3 MRL starts at 32
        ({"dimensions": 2048}, "dimensions"),  # 0.6B is 1024 wide
        ({"model": "Qwen/Qwen3-Embedding-8B", "dimensions": 5000}, "dimensions"),
        ({"base_url": "ftp://x/v1"}, "base_url"),
        ({"base_url": "http://user:pw@host/v1"}, "credentials"),
        ({"verify": "/no/such/ca.pem"}, "verify"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict[str, object], field: str | None) -> None:
    kwargs.setdefault("base_url", "http://127.0.0.1:9/v1")
    with pytest.raises(q.ConfigError) as info:
        EmbeddingConfig(**kwargs)  # type: ignore[arg-type]
    if field:
        assert field in str(info.value)


def _removal_error(make: object, **settings: object) -> q.ConfigError:
    """The ``ConfigError`` that building ``make(**settings)`` raised: directly, or (the
    LangChain adapter, a pydantic model) inside pydantic's ``ValidationError``."""
    from pydantic import ValidationError

    with pytest.raises((q.ConfigError, ValidationError)) as info:
        make(base_url="http://127.0.0.1:9/v1", **settings)  # type: ignore[operator]
    if isinstance(info.value, q.ConfigError):
        return info.value
    (error,) = info.value.errors()
    cause = error.get("ctx", {}).get("error")
    assert isinstance(cause, q.ConfigError), info.value
    return cause


_SURFACES = {
    "config": lambda: EmbeddingConfig,
    "client": lambda: q.EmbeddingClient,
    "async_client": lambda: q.AsyncEmbeddingClient,
    "langchain": lambda: q.QwenPooledEmbeddings,
    "llama_index": lambda: q.QwenPooledEmbedding,
}


@pytest.mark.parametrize("surface", list(_SURFACES))
@pytest.mark.parametrize("given", ["argument", "env"])
def test_max_concurrency_auto_was_removed_on_every_surface(
    surface: str, given: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make = _SURFACES[surface]()
    monkeypatch.delenv("QWEN_EMBED_MAX_CONCURRENCY", raising=False)
    if given == "env":
        monkeypatch.setenv("QWEN_EMBED_MAX_CONCURRENCY", " Auto ")
        error = _removal_error(make)
    else:
        error = _removal_error(make, max_concurrency="auto")
    message = str(error)
    assert 'max_concurrency="auto"' in message
    assert "QWEN_EMBED_MAX_CONCURRENCY" in message
    assert "removed" in message
    assert "integer" in message  # what to give instead
    assert "default 4" in message
    # an integer still works, and the default is 4
    monkeypatch.delenv("QWEN_EMBED_MAX_CONCURRENCY", raising=False)
    for settings, want in (({"max_concurrency": 3}, 3), ({}, 4)):
        built = make(base_url="http://127.0.0.1:9/v1", **settings)
        config = built if isinstance(built, EmbeddingConfig) else getattr(built, "config", None)
        value = built.max_concurrency if config is None else config.max_concurrency
        assert value == want


@pytest.mark.parametrize(
    "value",
    ["http://a:1/v1;http://b:2/v1", "http://a:1/v1; http://b:2/v1", "http://a:1/v1 http://b:2/v1"],
)
def test_replica_urls_joined_by_anything_but_a_comma_are_refused(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """urlsplit takes "http://a:1/v1;http://b:2/v1" for one URL (path "/v1;http://b..."):
    refused when configured, naming the comma, from the argument and the environment."""
    with pytest.raises(q.ConfigError, match="comma") as info:
        EmbeddingConfig(base_url=value)
    assert isinstance(info.value, ValueError)
    monkeypatch.setenv("QWEN_EMBED_BASE_URL", value)
    with pytest.raises(q.ConfigError, match="separate replica URLs with a comma"):
        EmbeddingConfig.from_env()
    with pytest.raises(q.ConfigError, match="QWEN_EMBED_BASE_URL"):
        q.EmbeddingClient()
    joined = EmbeddingConfig(base_url="http://a:1/v1,http://b:2/v1")
    assert joined.base_url == ("http://a:1/v1", "http://b:2/v1")


def test_api_key_is_stripped_and_checked_without_showing_it() -> None:
    cfg = EmbeddingConfig(base_url="http://h/v1", api_key="sk-FILE-KEY-1234\n")
    assert cfg.api_key_value() == "sk-FILE-KEY-1234"
    assert EmbeddingConfig(base_url="http://h/v1", api_key="  ").api_key is None
    for bad in ("sk-IN SIDE-99", "sk-NEW\nLINE-99", "sk-ÜMLAUT-99", "sk-CTRL\x01-99"):
        with pytest.raises(q.ConfigError, match="api_key") as info:
            EmbeddingConfig(base_url="http://h/v1", api_key=bad)
        assert bad not in str(info.value)
        assert bad.strip() not in repr(info.value)


def test_limits_and_timeouts_validate() -> None:
    with pytest.raises(q.ConfigError, match="max_keepalive_connections"):
        Limits(max_connections=2, max_keepalive_connections=3)
    with pytest.raises(q.ConfigError, match=r"Timeouts\.read"):
        Timeouts(read=-1)
    with pytest.raises(q.ConfigError, match="max_attempts"):
        RetryConfig(max_attempts=0)
    # issue 30 item 5: a number bounds every phase and the exchange in all (the total
    # used to stay at its 120 s default)
    assert EmbeddingConfig(base_url="http://h/v1", timeout=3).timeout == Timeouts(
        connect=3, read=3, write=3, pool=3, total=3
    )
    assert (
        EmbeddingConfig(
            base_url="http://h/v1", dimensions=4096, model="Qwen/Qwen3-Embedding-8B"
        ).dimensions
        == 4096
    )


def test_not_given_is_distinct_from_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QWEN_EMBED_API_KEY", "env-key-1234")
    assert EmbeddingConfig(base_url="http://h/v1").api_key_value() == "env-key-1234"
    assert EmbeddingConfig(base_url="http://h/v1", api_key=None).api_key is None
    assert repr(q.NOT_GIVEN) == "NOT_GIVEN"
    assert not q.NOT_GIVEN


# ----------------------------------------------------------------------------- protocol


def test_format_query_has_no_space_after_query() -> None:
    assert protocol.format_query("x", "Task") == "Instruct: Task\nQuery:x"
    assert protocol.format_query("x", None) == "x"


def test_plan_batches_dedupes_and_keeps_order() -> None:
    plan = batching.plan_batches(["a", "b", "a", "c", "d", "b"], 3)
    assert plan.unique == ["a", "b", "c", "d"]
    assert plan.first_index == [0, 1, 3, 4]
    assert plan.batches == [(0, 3), (3, 4)]
    assert plan.positions is not None
    assert plan.positions.tolist() == [0, 1, 0, 2, 3, 1]
    assert batching.plan_batches(["x", "y"], 8).positions is None


def test_encode_request_is_explicit() -> None:
    body = orjson.loads(protocol.encode_request(["t"], model="m", encoding_format="base64"))
    assert body == {"input": ["t"], "model": "m", "encoding_format": "base64"}
    body = orjson.loads(
        protocol.encode_request(["t"], model="m", encoding_format="float", dimensions=64)
    )
    assert body["dimensions"] == 64


def _payload(
    vectors: list[np.ndarray], *, b64: bool = True, order: list[int] | None = None
) -> bytes:
    order = order if order is not None else list(range(len(vectors)))
    data = []
    for i in order:
        v = vectors[i].astype("<f4")
        emb = base64.b64encode(v.tobytes()).decode() if b64 else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return orjson.dumps({"object": "list", "data": data})


def _unit(seed: int, dim: int = 8) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(dim).astype(np.float32)
    return v / np.linalg.norm(v)


def test_decode_sorts_by_index_base64_and_float() -> None:
    vecs = [_unit(i) for i in range(5)]
    for b64 in (True, False):
        arr = protocol.decode_embeddings(
            _payload(vecs, b64=b64, order=[3, 1, 4, 0, 2]), [10, 11, 12, 13, 14]
        )
        np.testing.assert_array_equal(arr, np.stack(vecs))


@pytest.mark.parametrize(
    ("mutate", "words", "index"),
    [
        (lambda d: d["data"].pop(), "4 embeddings for 5 inputs", None),
        (lambda d: d["data"][1].__setitem__("index", 0), "appears twice", None),
        (lambda d: d["data"][1].__setitem__("index", 9), "outside", None),
        (lambda d: d["data"][2].__setitem__("embedding", [0.0] * 8), "all zeros", 12),
        (lambda d: d["data"][3].__setitem__("embedding", [float("nan")] + [0.1] * 7), "NaN", 13),
        (lambda d: d["data"][4].__setitem__("embedding", [0.5] * 7), "dimensions", 14),
        (lambda d: d["data"][0].__setitem__("embedding", "***"), "base64", 10),
        (lambda d: d["data"][0].__setitem__("embedding", None), "expected a list", 10),
        (lambda d: d.pop("data"), "no 'data'", None),
    ],
)
def test_decode_checks_name_the_input_index(mutate, words: str, index: int | None) -> None:  # type: ignore[no-untyped-def]
    payload = orjson.loads(_payload([_unit(i) for i in range(5)], b64=False))
    mutate(payload)
    with pytest.raises(q.ResponseError) as info:
        protocol.decode_payload(payload, [10, 11, 12, 13, 14])
    assert words in str(info.value)
    assert info.value.index == index


def test_decode_checks_inf_tiny_and_which_bad_row_is_named() -> None:
    tiny = np.full(8, 1e-45, dtype=np.float32)  # smallest subnormals: not all zeros
    inf = _unit(1).copy()
    inf[3] = np.inf
    zero = np.zeros(8, dtype=np.float32)
    huge = np.full(8, 3e38, dtype=np.float32)  # squares overflow float32, not float64
    arr, sq = protocol.decode_checked(orjson.loads(_payload([_unit(0), tiny, huge])), [5, 6, 7])
    assert sq[1] > 0.0
    fixed, changed = protocol.normalize_rows(arr, squared_norms=sq)
    assert changed
    np.testing.assert_allclose(np.linalg.norm(fixed, axis=1), 1.0, atol=1e-6)
    np.testing.assert_array_equal(fixed[0], _unit(0))  # unit rows untouched
    with pytest.raises(q.ResponseError, match="input index 21 contains NaN or Inf"):
        protocol.decode_payload(orjson.loads(_payload([_unit(0), inf])), [20, 21])
    # a zero row before a NaN row: the NaN/Inf row is named first (as always)
    with pytest.raises(q.ResponseError, match="input index 32 contains NaN or Inf") as info:
        protocol.decode_payload(orjson.loads(_payload([_unit(0), zero, inf])), [30, 31, 32])
    assert info.value.index == 32
    with pytest.raises(q.ResponseError, match="input index 31 is all zeros"):
        protocol.decode_payload(orjson.loads(_payload([_unit(0), zero])), [30, 31])


def test_decode_rejects_non_json() -> None:
    with pytest.raises(q.ResponseError, match="not valid JSON"):
        protocol.decode_embeddings(b"<html>oops</html>", [0])


def test_normalize_rows_slices_and_renormalises_only_when_needed() -> None:
    unit = np.stack([_unit(1, 16), _unit(2, 16)])
    same, changed = protocol.normalize_rows(unit.copy())
    assert not changed
    np.testing.assert_array_equal(same, unit)  # bit-for-bit
    sliced, changed = protocol.normalize_rows(unit.copy(), 4)
    assert changed
    assert sliced.shape == (2, 4)
    np.testing.assert_allclose(np.linalg.norm(sliced, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(
        sliced, unit[:, :4] / np.linalg.norm(unit[:, :4], axis=1, keepdims=True), atol=1e-7
    )


@pytest.mark.parametrize("dim", [8, 1024, 4096])
@pytest.mark.parametrize("scale", [1.0, 1.00009, 0.99991, 1.00011, 0.99989, 0.5, 0.0])
def test_one_row_norm_decides_as_the_batch_norms_do(dim: int, scale: float) -> None:
    """A single answer's squared norm (a float32 estimate when it is surely inside the
    unit-length band) leads to the same vector as the batch path's float64 norms: left
    bit for bit, renormalised, or reported as unusable."""
    rng = np.random.default_rng(dim)
    vec = rng.standard_normal(dim).astype(np.float32)
    vec = (vec / np.linalg.norm(vec) * scale).astype(np.float32)
    item = {"index": 0, "embedding": base64.b64encode(vec.tobytes()).decode()}
    one, sq_one = protocol.decode_rows({"data": [item]}, [0])
    two, sq_two = protocol.decode_rows({"data": [item, {**item, "index": 1}]}, [0, 1])
    bad = protocol.bad_rows(sq_one)
    assert bad == {k: v for k, v in protocol.bad_rows(sq_two).items() if k == 0}
    assert bool(bad) == (scale == 0.0)
    if not bad:
        alone, changed_alone = protocol.normalize_rows(one.copy(), squared_norms=sq_one)
        batch, changed_batch = protocol.normalize_rows(two.copy(), squared_norms=sq_two)
        assert changed_alone == changed_batch == (scale not in (1.0, 1.00009, 0.99991))
        np.testing.assert_array_equal(alone[0], batch[0])


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("status", "body", "cls", "message"),
    [
        (
            400,
            {
                "object": "error",
                "message": "Input at index 2 is empty",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
            q.BadRequestError,
            "Input at index 2 is empty",
        ),  # SGLang flat
        (
            400,
            {
                "error": {
                    "message": "This model's maximum context length is 8192 tokens",
                    "type": "BadRequestError",
                    "code": 400,
                }
            },
            q.ContextLengthError,
            "maximum context length",
        ),  # vLLM nested
        (
            413,
            {"error": "batch size 64 > maximum allowed batch size 32", "error_type": "Validation"},
            q.BatchTooLargeError,
            "maximum allowed",
        ),  # TEI
        (503, {"error": "server busy, please try again."}, q.OverloadedError, "busy"),  # Ollama
        (
            413,
            {
                "code": 20042,
                "message": "input batch size 100 > maximum allowed batch size 64",
                "data": None,
            },
            q.BatchTooLargeError,
            "batch size",
        ),  # SiliconFlow
        (
            422,
            {"detail": [{"loc": ["body", "input"], "msg": "field required", "type": "missing"}]},
            q.BadRequestError,
            "body.input: field required",
        ),
        (
            400,
            {
                "error": {
                    "message": "batch size is invalid, it should not be larger than 10.",
                    "type": "InvalidParameter",
                }
            },
            q.BatchTooLargeError,
            "larger than 10",
        ),
        (
            404,
            {"error": {"message": "The model `x` does not exist."}},
            q.NotFoundError,
            "does not exist",
        ),
        (429, {"error": {"message": "Rate limit"}}, q.RateLimitError, "Rate limit"),
        (401, {"error": {"message": "Invalid API key"}}, q.AuthenticationError, "Invalid"),
        (500, b"Internal Server Error", q.ServerError, "Internal Server Error"),
        (
            503,
            {"object": "error", "message": "The request queue is full."},
            q.OverloadedError,
            "queue is full",
        ),
    ],
)
def test_error_bodies_of_every_server(status: int, body: object, cls: type, message: str) -> None:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    exc = errors.error_from_response(
        status, raw, url="http://u:p@h:8/v1/embeddings?k=1", headers={"x-request-id": "r1"}
    )
    assert type(exc) is cls
    assert exc.status == status
    assert message in exc.message
    assert exc.request_id == "r1"
    assert "u:p" not in str(exc)
    assert "k=1" not in str(exc)


@pytest.mark.parametrize(
    ("status", "message", "position"),
    [
        (400, "The input at index 1 (50 characters) is longer than the model's context", "1"),
        (400, "Input at index 2 is empty", "2"),
        (413, "input[3] is too long for the model", "3"),
        (400, "This model's maximum context length is 8192 tokens", None),
        (500, "input 4 crashed the worker", None),
    ],
)
def test_a_position_the_server_names_is_marked_as_within_the_batch_sent(
    status: int, message: str, position: str | None
) -> None:
    """The engine appends the caller's index ("[input index N of this call]"); the server's
    own index counts within the batch it got, and the message says so."""
    exc = errors.error_from_response(
        status, orjson.dumps({"error": {"message": message}}), url="http://h/v1"
    )
    note = (
        f"(the server's index {position} counts within the batch it was sent, not within the call)"
    )
    if position is None:
        assert "the server's index" not in str(exc)
    else:
        assert note in str(exc)
    assert exc.message == message  # the server's text itself is kept as it came


def test_batch_limit_parsing() -> None:
    assert errors.parse_batch_limit("batch size 64 > maximum allowed batch size 32") == 32
    assert errors.parse_batch_limit("batch size is invalid, it should not be larger than 10.") == 10
    assert errors.parse_batch_limit("context too long") is None


def test_scrub_removes_secret() -> None:
    assert errors.scrub("bad key sk-abcdef", "sk-abcdef") == "bad key ***"


def test_exception_tree() -> None:
    assert issubclass(q.ReadTimeout, q.TimeoutException)
    assert issubclass(q.TimeoutException, TimeoutError)
    assert issubclass(q.InputError, ValueError)
    assert issubclass(q.RemoteProtocolError, q.NetworkError)
    assert issubclass(q.ContextLengthError, q.BadRequestError)
    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, q.QwenEmbedError)
            assert name in (errors.__doc__ or "")


# ----------------------------------------------------------------------------- retry


def test_retry_after_parsing() -> None:
    assert retry.parse_retry_after({"retry-after": "3"}) == 3.0
    assert retry.parse_retry_after({"retry-after-ms": "250"}) == 0.25
    when = email.utils.formatdate(1_000_010.0, usegmt=True)
    assert retry.parse_retry_after({"retry-after": when}, now=1_000_000.0) == 10.0
    assert retry.parse_retry_after({"retry-after": "soon"}) is None
    assert retry.parse_retry_after({}) is None


@pytest.mark.parametrize(
    "headers",
    [
        {"retry-after": "0"},
        {"retry-after": "-5"},
        {"retry-after": "NaN"},
        {"retry-after": "inf"},
        {"retry-after": "soon"},
        {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"},  # in the past
        {"retry-after-ms": "0"},
        {"retry-after-ms": "-100"},
        {"retry-after-ms": "nan", "retry-after": "0"},
    ],
)
def test_a_useless_retry_after_says_nothing(headers: dict[str, str]) -> None:
    """Zero, negative, NaN, infinite, nonsense or past: ``None`` (the normal backoff
    applies), never 0."""
    assert retry.parse_retry_after(headers) is None


class _Top(random.Random):
    """Full jitter at its top: every backoff is its cap."""

    def uniform(self, a: float, b: float) -> float:
        return b


def test_retry_after_lengthens_the_backoff_and_never_shortens_it() -> None:
    policy = RetryConfig(backoff_initial=0.5, backoff_max=4.0, retry_after_max=30.0)
    state = retry.RetryState(policy=policy, started=0.0, deadline=None)
    waits = [
        state.next_delay(
            _server_error(429, retry_after=ra), now=0.0, fresh_connection=True, rng=_Top()
        )
        for ra in (None, 0.1, 3.0, 99.0)
    ]
    assert waits == [0.5, 1.0, 3.0, 30.0]  # backoff 0.5, 1 (> 0.1), then the server's


def test_a_transient_failure_is_retried_as_an_outage_when_the_server_is_down() -> None:
    """``outage=True`` (a control request failed too): a 500 is retried until the
    deadline, not ``max_attempts`` times."""
    policy = RetryConfig(max_attempts=2, deadline=None)
    state = retry.RetryState(policy=policy, started=0.0)
    error = _server_error(500)
    for _ in range(50):
        assert state.next_delay(error, now=0.0, fresh_connection=True, outage=True) is not None
    assert state.next_delay(error, now=0.0, fresh_connection=True) is not None
    assert state.next_delay(error, now=0.0, fresh_connection=True) is None  # max_attempts


def test_backoff_full_jitter_capped() -> None:
    policy = RetryConfig(backoff_initial=0.5, backoff_max=4.0)
    rng = random.Random(7)
    for attempt in range(10):
        cap = min(4.0, 0.5 * 2**attempt)
        for _ in range(50):
            assert 0.0 <= retry.backoff_delay(attempt, policy, rng) <= cap


def _server_error(status: int, retry_after: float | None = None) -> q.HTTPStatusError:
    return errors.error_from_response(status, b"{}", url="http://h/v1", retry_after=retry_after)


def test_what_is_retried() -> None:
    for status in (408, 424, 429, 500, 502, 503, 504):
        assert retry.retry_reason(_server_error(status)) == f"status_{status}"
    for status in (400, 401, 403, 404, 413, 422):
        assert retry.retry_reason(_server_error(status)) is None
    assert retry.retry_reason(q.ResponseError("nan")) is None
    assert retry.retry_reason(q.RemoteProtocolError("x")) == "disconnected"
    assert retry.retry_reason(q.ConnectTimeout("x")) == "connecttimeout"


def _waits(
    errors: list[Exception], policy: RetryConfig, *, attempt_seconds: float = 0.0, seed: int = 1
) -> tuple[list[float], float, bool]:
    """``RetryState`` as the engine uses it, on a fake clock: each attempt fails with the
    next error (the last one repeats) and takes ``attempt_seconds``. Returns the waits
    asked for, the time spent, and whether it gave up (``next_delay`` returned None)."""
    state = retry.RetryState(policy=policy, started=0.0)
    rng = random.Random(seed)
    now, waits = 0.0, []
    for n in range(1000):
        now += attempt_seconds
        delay = state.next_delay(
            errors[min(n, len(errors) - 1)], now=now, fresh_connection=True, rng=rng
        )
        if delay is None:
            return waits, now, True
        waits.append(delay)
        now += delay
    return waits, now, False


def test_retry_waits_backoff_and_retry_after_capped() -> None:
    policy = RetryConfig(max_attempts=4, retry_after_max=30.0, deadline=None)
    errors = [
        _server_error(503),
        _server_error(429, retry_after=2.5),
        _server_error(429, retry_after=999.0),
        _server_error(400),
    ]
    waits, _, gave_up = _waits(errors, policy)
    assert gave_up
    assert len(waits) == 3
    assert 0 <= waits[0] <= 0.25
    assert waits[1] == 2.5  # Retry-After honoured
    assert waits[2] == 30.0  # capped at retry_after_max


def test_retry_gives_up_at_once_on_400_and_after_max_attempts_on_500() -> None:
    assert _waits([_server_error(400)], RetryConfig()) == ([], 0.0, True)
    waits, _, gave_up = _waits([_server_error(500)], RetryConfig(max_attempts=3))
    assert gave_up
    assert len(waits) == 2  # 3 attempts: not an outage, max_attempts applies


def test_outage_is_retried_until_the_deadline_not_max_attempts() -> None:
    policy = RetryConfig(max_attempts=3, deadline=60.0, backoff_initial=1.0, backoff_max=4.0)
    waits, spent, gave_up = _waits([_server_error(503)], policy)
    assert gave_up
    assert len(waits) + 1 > 3  # an outage: the deadline applies, not max_attempts
    assert spent <= 60.0
    # max_attempts=1: retries off, outages included
    assert _waits([_server_error(503)], RetryConfig(max_attempts=1)) == ([], 0.0, True)


def test_deadline_stops_retries() -> None:
    policy = RetryConfig(max_attempts=50, deadline=20.0)
    waits, spent, gave_up = _waits(
        [_server_error(503, retry_after=5.0)], policy, attempt_seconds=4.0
    )
    assert gave_up
    assert waits
    # no wait crosses the deadline; only the last attempt itself (4 s) may run past it
    assert 20.0 < spent <= 20.0 + 4.0


def test_stale_connection_resent_at_once_only_once() -> None:
    state = retry.RetryState(policy=RetryConfig(), started=0.0)
    state.attempts = 1
    err = q.RemoteProtocolError("Server disconnected without sending a response")
    assert state.next_delay(err, now=0.0, fresh_connection=False) == 0.0
    state.attempts = 2
    second = state.next_delay(err, now=0.0, fresh_connection=False, rng=random.Random(3))
    assert second is not None
    # on a fresh connection a disconnect is a real failure: backoff from the start
    other = retry.RetryState(policy=RetryConfig(backoff_initial=1.0), started=0.0)
    other.attempts = 1
    assert other.next_delay(err, now=0.0, fresh_connection=True, rng=random.Random(5)) != 0.0


def test_refused_streams_never_exhaust_the_attempts_only_the_deadline() -> None:
    """A refused HTTP/2 stream was never processed: resent at once up to
    ``MAX_REFUSED_RESENDS`` times, then with the outage backoff until the deadline; never
    counted against ``max_attempts`` (600 concurrent calls to a server sending GOAWAY
    every few streams may see one request refused many times)."""
    err = q.RemoteProtocolError("GOAWAY", sent=True, refused=True)
    policy = RetryConfig(max_attempts=2, backoff_initial=0.5, backoff_max=2.0, deadline=20.0)
    waits, spent, gave_up = _waits([err], policy)
    assert waits[: retry.MAX_REFUSED_RESENDS] == [0.0] * retry.MAX_REFUSED_RESENDS
    assert len(waits) > retry.MAX_REFUSED_RESENDS + 5  # far past max_attempts
    assert any(w > 0.0 for w in waits[retry.MAX_REFUSED_RESENDS :])  # backed off
    assert gave_up  # the deadline ends it, not a count
    assert spent <= 20.0
    state = retry.RetryState(policy=policy, started=0.0)
    for _ in range(retry.MAX_REFUSED_RESENDS + 3):
        state.next_delay(err, now=0.0, fresh_connection=True)
    assert state.attempts == 0


# ----------------------------------------------------------------------------- the suite


def test_unit_tests_cannot_use_the_network() -> None:
    """tests/conftest.py guards every ``unit`` test: a connect or bind fails it."""
    with pytest.raises(AssertionError, match="marked 'unit' used the network"):
        socket.create_connection(("127.0.0.1", 9), timeout=1)
    with (
        socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock,
        pytest.raises(AssertionError, match="marked 'unit' used the network"),
    ):
        sock.bind(("127.0.0.1", 0))
