"""Rules, outage windows, crashes, waits, server models and llama.cpp's tokenizer of
`qwen_embed_tooling.testing.EmbeddingServer`, checked with plain httpx clients (never the
project's own client): these tests pin down what the server does on cue."""

from __future__ import annotations

import base64
import json
import math
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from qwen_embed_tooling.testing import (
    EOS_TOKEN,
    EOS_TOKEN_ID,
    NAN_ERROR_BODY,
    NO_EOS_SUFFIX,
    QUEUE_FULL_MESSAGE,
    RULE_KINDS,
    TOKEN_CAP_MESSAGE_UNSTATED,
    EmbeddingServer,
    GPULike,
    HeavyTail,
    RateLimited,
    Rule,
    SlowStart,
    count_tokens,
    expected_embedding,
    expected_embeddings,
)

GOOD = ["alpha", "beta", "gamma", "delta"]


def embed(client: httpx.Client, texts: Any, **body: Any) -> httpx.Response:
    return client.post("/embeddings", json={"input": texts, "model": "m", **body})


def rows(response: httpx.Response) -> list[Any]:
    return [item["embedding"] for item in response.json()["data"]]


def as_array(response: httpx.Response) -> np.ndarray:
    out = []
    for emb in rows(response):
        if isinstance(emb, str):
            out.append(np.frombuffer(base64.b64decode(emb), dtype="<f4"))
        else:
            out.append(np.asarray([np.nan if x is None else x for x in emb], dtype=np.float32))
    return np.stack(out)


@pytest.fixture
def client(srv: EmbeddingServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.base_url, timeout=30.0) as c:
        yield c


# ---- poison: one input fails every batch that holds it --------------------------------


def test_poison_answers_500_with_ollamas_nan_body_for_every_batch_holding_it(
    srv: EmbeddingServer, client: httpx.Client
) -> None:
    srv.poison("poisonous")
    for _ in range(3):  # deterministic: the same batch fails every time, not once
        r = embed(client, [*GOOD, "poisonous"])
        assert r.status_code == 500
        assert r.content == NAN_ERROR_BODY == b'{"error":"json: unsupported value: NaN"}'
    r = embed(client, GOOD)  # the other texts are fine on their own
    assert r.status_code == 200
    assert np.array_equal(as_array(r), expected_embeddings(GOOD))
    assert embed(client, ["not poisonous"]).status_code == 200  # exact match by default
    stats = srv.stats()
    assert stats["faults_applied"] == {"poison": 3}
    assert stats["responses"] == {"500": 3, "200": 2}
    assert stats["rules"] == ["poison"]


def test_poison_by_substring_with_a_custom_status_and_message(
    srv: EmbeddingServer, client: httpx.Client
) -> None:
    srv.poison("BAD", substring=True, status=502, message="upstream model crashed")
    r = embed(client, ["fine", "a BAD one"])
    assert r.status_code == 502
    assert r.json()["message"] == "upstream model crashed"  # in the dialect's error body
    assert embed(client, ["fine", "bad"]).status_code == 200  # case-sensitive
    srv.clear_rules()
    assert embed(client, ["a BAD one"]).status_code == 200
    assert srv.stats()["rules"] == []


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_poison_nan_spoils_only_the_poisoned_vectors(
    srv: EmbeddingServer, client: httpx.Client, encoding: str
) -> None:
    srv.poison("nan me", action="nan")
    texts = ["a", "nan me", "b", "nan me"]
    r = embed(client, texts, encoding_format=encoding)
    assert r.status_code == 200
    got = as_array(r)
    want = expected_embeddings(texts)
    for i in (0, 2):
        assert np.array_equal(got[i], want[i])
    for i in (1, 3):
        assert np.isnan(got[i]).sum() == 1
        assert np.array_equal(np.nan_to_num(got[i]), np.where(np.isnan(got[i]), 0, want[i]))
    if encoding == "float":
        assert rows(r)[1][512] is None  # orjson writes NaN as null
    assert srv.stats()["faults_applied"] == {"poison": 1}


def test_poison_nan_literal_writes_the_non_standard_token(
    srv: EmbeddingServer, client: httpx.Client
) -> None:
    srv.poison("x", action="nan", literal=True)
    r = embed(client, ["x"])
    assert b"NaN" in r.content
    assert math.isnan(json.loads(r.content)["data"][0]["embedding"][512])


@pytest.mark.parametrize("action", ["close", "reset"])
def test_poison_drops_the_connection(
    srv: EmbeddingServer, client: httpx.Client, action: str
) -> None:
    srv.poison("boom", action=action)
    for _ in range(2):
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            embed(client, ["ok", "boom"])
    assert embed(client, ["ok"]).status_code == 200
    stats = srv.stats()
    assert stats["responses"] == {action: 2, "200": 1}
    assert stats["connections_opened"] == 3


# ---- big batches dropped, token caps, context length, base64 --------------------------


def test_batches_over_n_texts_are_dropped_every_time(
    srv: EmbeddingServer, client: httpx.Client
) -> None:
    srv.drop_batches_over(8)
    texts = [f"t{i}" for i in range(9)]
    for _ in range(2):
        with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
            embed(client, texts)
    r = embed(client, texts[:8])
    assert np.array_equal(as_array(r), expected_embeddings(texts[:8]))
    assert srv.stats()["faults_applied"] == {"drop_over": 2}


def test_token_cap_states_the_cap_and_the_count(srv: EmbeddingServer, client: httpx.Client) -> None:
    srv.cap_batch_tokens(16)
    texts = ["x" * 40, "y" * 25]  # 10 + 7 tokens
    assert sum(count_tokens(t) for t in texts) == 17
    r = embed(client, texts)
    assert r.status_code == 400
    assert r.json()["message"] == "Too many tokens in batch. Max is 16 got 17"
    assert embed(client, texts[:1]).status_code == 200
    assert embed(client, ["x" * 64]).status_code == 200  # exactly 16 tokens
    assert srv.stats()["faults_applied"] == {"token_cap": 1}


def test_token_cap_without_a_number_and_in_another_dialect() -> None:
    with (
        EmbeddingServer(dialect="vllm") as server,
        httpx.Client(base_url=server.base_url) as c,
    ):
        server.cap_batch_tokens(4, message=TOKEN_CAP_MESSAGE_UNSTATED, status=413)
        r = embed(c, ["a" * 20])
        assert r.status_code == 413
        assert r.json()["error"]["message"] == "Too many tokens in batch."


# status and whether the index is named, as each real server does (infinity: in `loc`)
CONTEXT = {
    "sglang": (400, False),
    "vllm": (400, False),
    "tei": (413, False),
    "infinity": (422, True),
    "ollama": (400, False),
    "llamacpp": (500, False),
    "dashscope": (400, False),
    "siliconflow": (413, False),
}


@pytest.mark.parametrize("dialect", list(CONTEXT))
def test_context_length_in_tokens_for_a_multi_text_batch(dialect: str) -> None:
    status, names_index = CONTEXT[dialect]
    texts = ["short", "also short", "z" * 81, "w" * 400]  # index 2: 21 tokens > 20
    with (
        EmbeddingServer(dialect=dialect) as server,
        httpx.Client(base_url=server.base_url) as c,
    ):
        server.limit_input_tokens(20)
        r = embed(c, texts)
        assert r.status_code == status, r.text
        if names_index:
            assert r.json()["detail"][0]["loc"] == ["body", "input", 2]
        assert "input index" not in r.text  # the real wording, without an index
        if dialect in ("sglang", "vllm", "tei", "siliconflow", "llamacpp"):
            assert "21" in r.text  # the text's tokens
        assert embed(c, texts[:2]).status_code == 200
        server.clear_rules()
        server.limit_input_tokens(20, name_index=True)
        named = embed(c, texts)
        assert named.status_code == status
        if not names_index:
            assert "(input index 2)" in named.text
        assert server.stats()["faults_applied"] == {"context_length": 2}


def test_max_input_tokens_setting_refuses_from_the_start() -> None:
    with (
        EmbeddingServer(max_input_tokens=5) as server,
        httpx.Client(base_url=server.base_url) as c,
    ):
        r = embed(c, ["a", "b" * 21])
        assert r.status_code == 400
        assert r.json()["message"] == (
            "The input (6 tokens) is longer than the model's context length (5 tokens)."
        )
        assert embed(c, ["b" * 20]).status_code == 200


def test_base64_requests_fail_while_float_works(srv: EmbeddingServer, client: httpx.Client) -> None:
    srv.fail_base64()
    for _ in range(2):
        r = embed(client, GOOD, encoding_format="base64")
        assert r.status_code == 500
        assert r.json()["message"] == "Internal Server Error"
    r = embed(client, GOOD, encoding_format="float")
    assert np.array_equal(as_array(r), expected_embeddings(GOOD))
    assert embed(client, GOOD).status_code == 200  # float is the default
    assert srv.stats()["faults_applied"] == {"base64_error": 2}


def test_one_item_lists_fail_while_a_bare_string_works(
    srv: EmbeddingServer, client: httpx.Client
) -> None:
    """SGLang 0.4.6: ``input: ["text"]`` -> 500, ``input: "text"`` -> 200; longer lists
    are embedded."""
    srv.refuse_one_item_lists()
    assert embed(client, ["one"]).status_code == 500
    r = embed(client, "one")
    assert np.array_equal(as_array(r), expected_embeddings(["one"]))
    assert embed(client, GOOD).status_code == 200
    assert srv.stats()["faults_applied"] == {"one_item_list": 1}


# ---- usage and silent truncation ------------------------------------------------------


def test_usage_reports_tokens_and_silent_truncation_shows_in_it(
    srv: EmbeddingServer, client: httpx.Client
) -> None:
    long = "0123456789" * 2400  # 24,000 characters: 6,000 tokens
    r = embed(client, [long])
    assert r.json()["usage"]["prompt_tokens"] == r.json()["usage"]["total_tokens"] == 6000
    srv.truncate_inputs(2048)
    r = embed(client, [long, "short"])
    assert r.json()["usage"]["prompt_tokens"] == 2048 + 2
    assert np.array_equal(as_array(r)[0], expected_embedding(long[: 4 * 2048]))
    assert np.array_equal(as_array(r)[1], expected_embedding("short"))  # untouched
    assert srv.received[-1] == [long, "short"]  # the log keeps what was sent
    assert srv.stats()["faults_applied"] == {"truncate": 1}


def test_usage_can_be_left_out() -> None:
    with EmbeddingServer(report_usage=False) as server, httpx.Client(base_url=server.base_url) as c:
        body = embed(c, ["a"]).json()
        assert "usage" not in body
        assert len(body["data"]) == 1


# ---- outage windows --------------------------------------------------------------------


def wait_until_status(c: httpx.Client, status: int, limit: float = 60.0) -> list[int]:
    """Send requests until one answers ``status``; the statuses seen, in order."""
    seen: list[int] = []
    deadline = time.monotonic() + limit
    while not seen or seen[-1] != status:
        assert time.monotonic() < deadline, f"no {status} within {limit} s: {seen[-5:]}"
        seen.append(embed(c, ["w"]).status_code)
        time.sleep(0.02)
    return seen


@pytest.mark.parametrize(("status", "message"), [(429, "Too Many Requests"), (503, None)])
def test_status_window_answers_every_request_then_ends(
    srv: EmbeddingServer, client: httpx.Client, status: int, message: str | None
) -> None:
    before = time.monotonic()
    srv.status_window(1.0, status=status)
    seen = wait_until_status(client, 200)
    if time.monotonic() - before < 1.0:  # surely inside the window: it was refused
        assert seen[0] == status
    assert set(seen[:-1]) <= {status}
    windowed = [embed(client, ["b"]) for _ in range(2)]  # after the window: normal
    assert [r.status_code for r in windowed] == [200, 200]
    assert srv.stats()["faults_applied"].get("window", 0) == len(seen) - 1
    assert srv.stats()["rules"] == []  # an ended window removes itself
    srv.status_window(60.0, status=status)  # a long one, to look at its answer
    r = embed(client, ["a"])
    assert r.status_code == status
    assert "retry-after" not in r.headers
    assert r.json()["message"] == (message or QUEUE_FULL_MESSAGE)


def test_status_window_in_a_child_process_with_retry_after() -> None:
    with (
        EmbeddingServer(process=True) as server,
        httpx.Client(base_url=server.base_url) as c,
    ):
        server.status_window(60.0, retry_after=2)
        r = embed(c, ["a"])
        assert (r.status_code, r.headers["retry-after"]) == (429, "2")
        server.clear_rules()
        before = time.monotonic()
        server.status_window(1.0)
        seen = wait_until_status(c, 200)
        if time.monotonic() - before < 1.0:
            assert seen[0] == 429


# ---- crashes and restarts on the same port, waits without sleeping ---------------------


@pytest.mark.parametrize("process", [False, True])
def test_killed_server_restarts_on_the_same_port(process: bool) -> None:
    with EmbeddingServer(process=process) as server:
        port, pid = server.port, server.pid
        with httpx.Client(base_url=server.base_url) as c:
            assert embed(c, ["before"]).status_code == 200
            server.kill()
            assert not server.running
            with pytest.raises((httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)):
                embed(c, ["while down"])
            server.start()
            assert server.port == port
            assert (server.pid != pid) == process  # a new child process after a kill
            r = embed(c, ["after"])
            assert np.array_equal(as_array(r), expected_embeddings(["after"]))
            server.restart(downtime=0.2)
            assert server.port == port
            assert embed(c, ["after restart"]).status_code == 200


def test_wait_for_requests_and_in_flight_block_until_the_request_arrives() -> None:
    with EmbeddingServer(process=True) as server:
        server.inject("delay", seconds=60)  # held until the server stops
        statuses: list[Any] = []

        def call() -> None:
            try:
                with httpx.Client(base_url=server.base_url, timeout=120) as c:
                    statuses.append(embed(c, ["held"]).status_code)
            except httpx.HTTPError as exc:
                statuses.append(type(exc).__name__)

        worker = threading.Thread(target=call)
        worker.start()
        assert server.wait_for_requests(1, timeout=60) == 1
        assert server.wait_for_in_flight(1, timeout=60) == 1
        assert server.wait_for("received_count", 1, timeout=60) == 1  # body read, logged
        assert server.received == [["held"]]
        with pytest.raises(TimeoutError, match="requests is 1, not >= 2"):
            server.wait_for_requests(2, timeout=0.2)
        server.stop()  # ends the delay: the held request's connection is closed
        worker.join(60)
        assert statuses == ["RemoteProtocolError"]


def test_rules_are_validated_and_listed() -> None:
    assert set(RULE_KINDS) == {
        "poison",
        "drop_over",
        "token_cap",
        "context_length",
        "base64_error",
        "one_item_list",
        "truncate",
        "window",
    }
    with pytest.raises(ValueError, match="needs text"):
        Rule.make("poison")
    with pytest.raises(ValueError, match="action must be one of"):
        Rule.make("drop_over", max_texts=2, action="nan")
    with pytest.raises(TypeError, match="takes no parameter 'text'"):
        Rule.make("token_cap", max_tokens=3, text="x")
    with pytest.raises(ValueError, match="unknown rule kind"):
        Rule.make("nope")
    rule = Rule.make("poison", text="x", body=b"\x00raw")
    assert Rule.from_dict(json.loads(json.dumps(rule.to_dict()))) == rule


def test_rules_work_in_child_process_mode_and_over_the_admin_endpoint() -> None:
    with (
        EmbeddingServer(process=True) as server,
        httpx.Client(base_url=server.base_url) as c,
    ):
        server.poison("p")
        assert embed(c, ["a", "p"]).status_code == 500
        admin = f"{server.url}/_testing"
        r = c.post(f"{admin}/rule", json={"kind": "drop_over", "params": {"max_texts": 1}})
        assert r.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            embed(c, ["a", "b"])
        assert server.stats()["rules"] == ["poison", "drop_over"]
        server.clear_faults()  # clears rules too
        assert embed(c, ["a", "p"]).status_code == 200


# ---- server models (benchmarks) ------------------------------------------------------------


@pytest.mark.parametrize("process", [False, True])
def test_rate_limited_model_answers_429_past_the_bucket(process: bool) -> None:
    model = RateLimited(rate=0.1, burst=2)
    with (
        EmbeddingServer(server_model=model, process=process) as server,
        httpx.Client(base_url=server.base_url) as c,
    ):
        answers = [embed(c, ["r"]) for _ in range(5)]
        statuses = [r.status_code for r in answers]
        assert statuses[:2] == [200, 200]
        limited = [r for r in answers if r.status_code == 429]
        assert limited  # all 3 more would need 3 refills at 0.1/s: 30 s
        assert all(int(r.headers["retry-after"]) >= 1 for r in limited)
        assert server.stats()["faults_applied"] == {"rate_limit": len(limited)}
    with (
        EmbeddingServer(server_model=RateLimited(rate=0.1, burst=1, retry_after=False)) as server,
        httpx.Client(base_url=server.base_url) as c,
    ):
        answers = [embed(c, ["r"]) for _ in range(3)]
        assert answers[0].status_code == 200
        assert any(r.status_code == 429 for r in answers)
        assert all("retry-after" not in r.headers for r in answers)


def _hold(server: EmbeddingServer, out: list[Any]) -> threading.Thread:
    def call() -> None:
        try:
            with httpx.Client(base_url=server.base_url, timeout=120) as c:
                out.append(embed(c, ["slot"]).status_code)
        except httpx.HTTPError as exc:
            out.append(type(exc).__name__)

    worker = threading.Thread(target=call)
    worker.start()
    return worker


@pytest.mark.parametrize("process", [False, True])
def test_gpu_like_model_queues_then_answers_queue_full(process: bool) -> None:
    model = GPULike(slots=1, base=60.0, queue_limit=1)  # a batch takes a minute
    with EmbeddingServer(server_model=model, process=process) as server:
        out: list[Any] = []
        first = _hold(server, out)
        server.wait_for_in_flight(1, timeout=60)
        second = _hold(server, out)  # waits in the queue
        server.wait_for_in_flight(2, timeout=60)
        with httpx.Client(base_url=server.base_url) as c:
            r = embed(c, ["third"])
        assert r.status_code == 503
        assert r.json()["message"] == QUEUE_FULL_MESSAGE
        assert server.stats()["faults_applied"] == {"queue_full": 1}
        server.stop()  # ends the minute-long batches
        first.join(60)
        second.join(60)
        assert out == ["RemoteProtocolError", "RemoteProtocolError"]


def test_gpu_like_model_serves_every_request_within_its_slots() -> None:
    model = GPULike(slots=2, base=0.001, per_token=0.0001, queue_limit=100)
    with (
        EmbeddingServer(server_model=model) as server,
        httpx.Client(base_url=server.base_url) as c,
    ):
        texts = [f"text {i}" * 10 for i in range(8)]
        assert np.array_equal(as_array(embed(c, texts)), expected_embeddings(texts))
        assert server.stats()["max_in_flight"] == 1


def test_slow_start_model_grows_its_slots_after_the_ramp() -> None:
    model = SlowStart(slots=2, start_slots=1, ramp=1.0, base=60.0, queue_limit=0)
    before = time.monotonic()  # the ramp starts between these two instants
    with EmbeddingServer(server_model=model) as server:
        started = time.monotonic()
        out: list[Any] = []
        workers = [_hold(server, out)]
        server.wait_for_in_flight(1, timeout=60)
        try:
            with httpx.Client(base_url=server.base_url, timeout=5.0) as c:
                cold: int | None = embed(c, ["cold"]).status_code
        except httpx.ReadTimeout:  # only when the ramp ended first (a very slow machine)
            cold = None
        if time.monotonic() - before < 1.0:  # surely still one slot: the second is refused
            assert cold == 503
        time.sleep(max(0.0, started + 1.1 - time.monotonic()))  # let the ramp finish
        workers.append(_hold(server, out))  # now a second slot exists
        server.wait_for_in_flight(2, timeout=60)
        server.stop()
        for worker in workers:
            worker.join(60)
        assert out == ["RemoteProtocolError", "RemoteProtocolError"]


def test_heavy_tail_model_slows_one_request_in_every_k_seeded() -> None:
    model = HeavyTail(base=0.001, every=3, factor=2.0, seed=7)
    rng = random.Random(7)
    expected_slow = sum(rng.random() < 1 / 3 for _ in range(30))
    with (
        EmbeddingServer(server_model=[model], process=True) as server,
        httpx.Client(base_url=server.base_url) as c,
    ):
        for i in range(30):
            assert embed(c, [f"q{i}"]).status_code == 200
        assert server.stats()["faults_applied"] == {"heavy_tail": expected_slow}
        assert 0 < expected_slow < 30


def test_server_models_are_validated() -> None:
    with pytest.raises(ValueError, match="slots"):
        GPULike(slots=0)
    with pytest.raises(ValueError, match="start_slots"):
        SlowStart(slots=2, start_slots=3)
    with pytest.raises(ValueError, match="every"):
        HeavyTail(every=0)
    with pytest.raises(ValueError, match="server_model"):
        EmbeddingServer(server_model=["gpu"])  # type: ignore[list-item]


# ---- llama.cpp: /tokenize and the end-of-text token ----------------------------------------


def normalised(response: httpx.Response) -> np.ndarray:
    got = as_array(response).astype(np.float64)
    return got / np.linalg.norm(got, axis=1, keepdims=True)


@pytest.mark.parametrize("append_eos", [True, False])
def test_llamacpp_tokenize_and_whether_the_server_appends_eos(append_eos: bool) -> None:
    with (
        EmbeddingServer(dialect="llamacpp", append_eos=append_eos) as server,
        httpx.Client(base_url=server.url) as c,
    ):
        plain = c.post("/tokenize", json={"content": "hello world"}).json()["tokens"]
        assert len(plain) == count_tokens("hello world") == 3
        assert all(0 <= t < EOS_TOKEN_ID for t in plain)
        special = c.post("/tokenize", json={"content": "hello world", "add_special": True})
        assert special.json()["tokens"] == plain + ([EOS_TOKEN_ID] if append_eos else [])
        parsed = c.post("/tokenize", json={"content": f"hello world{EOS_TOKEN}"}).json()
        assert parsed["tokens"] == [*plain, EOS_TOKEN_ID]  # special tokens are parsed
        pieces = c.post("/tokenize", json={"content": "abcdef", "with_pieces": True}).json()
        assert [p["piece"] for p in pieces["tokens"]] == ["abcd", "ef"]
        assert c.post("/tokenize", json={"nope": 1}).status_code == 400

        v1 = httpx.Client(base_url=server.base_url)
        bare = embed(v1, ["abc"])
        with_eos = embed(v1, [f"abc{EOS_TOKEN}"])
        assert not np.allclose(normalised(bare), normalised(with_eos))  # observable
        want_bare = "abc" if append_eos else "abc" + NO_EOS_SUFFIX
        want_eos = f"abc{EOS_TOKEN}" if append_eos else "abc"
        assert np.allclose(normalised(bare)[0], expected_embedding(want_bare), atol=1e-6)
        assert np.allclose(normalised(with_eos)[0], expected_embedding(want_eos), atol=1e-6)
        v1.close()


def test_append_eos_is_a_llamacpp_setting() -> None:
    with pytest.raises(ValueError, match="append_eos"):
        EmbeddingServer(append_eos=False)
    with pytest.raises(ValueError, match="http2=True"):
        EmbeddingServer(goaway_after=3)
