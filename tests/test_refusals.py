"""Refusals decided by what the server does, not by how it words them (issue 30 items
1-4 and 7), on the engine driven with scripted replies (no socket): a refused batch is
split until the refused texts stand alone; a limit stated in any wording caps later
batches; a field the client adds on its own can go; a single refused text is final after
at most two sends and one control request (sent first while nothing succeeded in the
call; an explicit ``max_retries`` bounds them all); each lesson is logged once per
replica."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from test_engine_script import FAST, Script, batch, engine, ok, rows_of, status

import qwen_embed_plugins as q
from qwen_embed_plugins._engine import Engine
from qwen_embed_plugins._run import Part, Send, run_async
from qwen_embed_plugins._server_text import stated_limit
from qwen_embed_plugins._transport import Reply, Request

pytestmark = pytest.mark.unit  # scripted replies: no server, no socket


def auto_engine(**settings: Any) -> Engine:
    """``engine()`` with the default ``encoding_format="auto"`` (base64 first)."""
    eng = engine(**settings)
    return Engine(eng.config.replace(encoding_format="auto"))


def sent(request: Request) -> list[str]:
    texts = orjson.loads(request.body)["input"]
    return [texts] if isinstance(texts, str) else texts


def refusing(
    bad: str, code: int, message: str, *, body: object | None = None
) -> Callable[[Request, int], Reply]:
    """Refuse (``code``, ``message``) every request holding ``bad``; answer the rest."""

    def answer(request: Request, n: int) -> Reply:
        if bad in sent(request):
            if body is not None:
                return Reply(code, {"content-type": "application/json"}, orjson.dumps(body), True)
            return status(code, message)
        return ok(request)

    return answer


# --------------------------------------------------------------------------- refused batch


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (400, "Bad Request"),
        (422, "validation failed"),
        (413, "Request Entity Too Large"),
        (409, "conflict in request"),
        (400, "Illegal param: prefill 744 tokens exceed n_ctx_per_seq"),  # llama-box
    ],
)
@pytest.mark.parametrize("where", [0, 9, 15])
def test_a_refused_batch_is_split_until_the_refused_text_is_alone(
    code: int, message: str, where: int
) -> None:
    """One refused text in a batch of 16, whatever the wording: the other 15 are
    embedded, the refused one fails alone with its index, within about 2*log2(16)
    extra requests (one control, a bare-string trial of the lone text)."""
    texts = [f"chunk {i}" for i in range(16)]
    texts[where] = "refused chunk"
    eng = engine()
    script = Script(refusing("refused chunk", code, message))
    part = script.run(batch(eng, eng.new_call(query=False, on_error="skip"), texts))
    assert list(part.failed) == [where]
    error = part.failed[where]
    assert isinstance(error, q.HTTPStatusError)
    assert error.status == code
    assert error.index == where
    assert f"input index {where}" in str(error)
    assert sorted(rows_of(part, 16)) == [i for i in range(16) if i != where]
    assert len(script.inputs) - 1 <= 2 * math.log2(16) + 2
    if "n_ctx" in message:
        assert isinstance(error, q.ContextLengthError)


def test_a_count_mismatch_is_a_refused_batch() -> None:
    """A gateway that drops a text it cannot embed (one embedding fewer than texts): the
    batch is split like a refused one; the dropped text fails alone with its index."""

    def answer(request: Request, n: int) -> Reply:
        reply = ok(request)
        texts = sent(request)
        if "dropped" not in texts:
            return reply
        doc = orjson.loads(reply.body)
        doc["data"] = [d for d, t in zip(doc["data"], texts, strict=True) if t != "dropped"]
        return Reply(200, reply.headers, orjson.dumps(doc), True)

    texts = [f"chunk {i}" for i in range(8)]
    texts[5] = "dropped"
    eng = engine()
    script = Script(answer)
    part = script.run(batch(eng, eng.new_call(query=False, on_error="skip"), texts))
    assert list(part.failed) == [5]
    assert isinstance(part.failed[5], q.ResponseError)
    assert part.failed[5].index == 5
    assert sorted(rows_of(part, 8)) == [0, 1, 2, 3, 4, 6, 7]


@pytest.mark.parametrize("code", [400, 422])
def test_a_server_refusing_everything_fails_after_two_requests(code: int) -> None:
    """A wrong model name: the batch and one control request, then the server's own
    message, with no input index (in both on_error modes)."""
    message = "The model `qwen3` does not exist on this gateway"
    eng = engine()
    script = Script(lambda request, n: status(code, message))
    with pytest.raises(q.HTTPStatusError) as info:
        script.run(batch(eng, eng.new_call(query=False, on_error="skip"), ["a", "b", "c"]))
    assert len(script.inputs) == 2
    assert script.inputs[1] == ["hello"]
    assert message in str(info.value)
    assert info.value.index is None


def test_a_refused_batch_whose_pieces_go_through_teaches_a_cap() -> None:
    """A batch refused with no number (a 413 from a proxy) whose pieces all go through:
    the largest piece taken is the replica's cap at once; the next call is split before
    anything is sent."""

    def answer(request: Request, n: int) -> Reply:
        if len(sent(request)) > 4:
            return status(413, "Request Entity Too Large")
        return ok(request)

    eng = engine()
    texts = [f"passage {i}" for i in range(8)]
    first = Script(answer)
    part = first.run(batch(eng, eng.new_call(query=False), texts))
    assert sorted(rows_of(part, 8)) == list(range(8))
    assert eng.endpoint.replicas[0].state(eng.model).batch.limit == 4
    again = Script(answer)
    again.run(batch(eng, eng.new_call(query=False), texts))
    assert again.sizes == [4, 4]


# --------------------------------------------------------------------------- stated limits


@pytest.mark.parametrize(
    ("code", "template", "cap"),
    [
        (422, "Value should have at most {cap} items after validation, not {n}", 8),  # LiteLLM
        (400, "{cap} instance(s) is allowed per prediction. Actual: {n}", 5),  # Vertex
        (400, "maximum {cap} texts per request", 6),
        (400, "batch size {n} exceeds max {cap}", 7),
        (413, "too many inputs: got {n}, the limit is {cap}", 3),
    ],
)
def test_a_stated_text_limit_caps_later_batches(code: int, template: str, cap: int) -> None:
    """A refusal stating how many texts a request may hold, in words the client was
    never taught: learned at once (no control, no bisection), the batch sent again in
    pieces of at most that many, and the next call split before anything is sent."""

    def answer(request: Request, n: int) -> Reply:
        size = len(sent(request))
        if size > cap:
            return status(code, template.format(cap=cap, n=size))
        return ok(request)

    eng = engine()
    texts = [f"passage {i}" for i in range(20)]
    first = Script(answer)
    part = first.run(batch(eng, eng.new_call(query=False), texts))
    assert sorted(rows_of(part, 20)) == list(range(20))
    assert first.sizes[0] == 20
    assert max(first.sizes[1:]) <= cap
    assert len(first.sizes) == 1 + math.ceil(20 / cap)
    again = Script(answer)
    again.run(batch(eng, eng.new_call(query=False), texts))
    assert max(again.sizes) <= cap


@pytest.mark.parametrize(
    ("message", "unit"),
    [
        ("Request payload size exceeds the limit: {cap} bytes", "bytes"),  # Gemini
        ("input too large: {n} characters > {cap}", "characters"),
        ("Requested {n} tokens, max {cap} tokens per request", "tokens"),
    ],
)
def test_a_stated_size_limit_caps_the_size_not_the_count(message: str, unit: str) -> None:
    """A byte, character or token limit stated in any wording: later requests are cut by
    size (a batch of short texts stays whole), not by a text count."""
    cap = 2000 if unit != "tokens" else 500

    def size_of(request: Request) -> int:
        if unit == "bytes":
            return len(request.body)
        chars = sum(len(t) for t in sent(request))
        return chars if unit == "characters" else math.ceil(chars / 4)

    refused: list[int] = []

    def answer(request: Request, n: int) -> Reply:
        if size_of(request) > cap:
            refused.append(n)
            return status(400, message.format(cap=cap, n=size_of(request)))
        return ok(request)

    eng = engine()
    long_texts = [f"{i} " + "x" * 196 for i in range(30)]
    first = Script(answer)
    part = first.run(batch(eng, eng.new_call(query=False), long_texts))
    assert sorted(rows_of(part, 30)) == list(range(30))
    assert refused == [1]  # the first request only: the rest are cut by size
    short = Script(answer)
    short.run(batch(eng, eng.new_call(query=False), [f"s{i}" for i in range(30)]))
    assert short.sizes == [30]  # a size cap, not a count cap


def test_a_limit_stated_in_a_200_error_body_caps_later_batches() -> None:
    """A gateway answering 200 with an error object that states a limit: the server's
    own words are read as a refusal's are (the batch resent in pieces within it)."""

    def answer(request: Request, n: int) -> Reply:
        size = len(sent(request))
        if size > 4:
            body = {"error": {"message": f"maximum 4 texts per request, got {size}"}}
            return Reply(200, {"content-type": "application/json"}, orjson.dumps(body), True)
        return ok(request)

    eng = engine()
    script = Script(answer)
    part = script.run(batch(eng, eng.new_call(query=False), [f"t{i}" for i in range(10)]))
    assert sorted(rows_of(part, 10)) == list(range(10))
    assert script.sizes == [10, 4, 4, 2]


@pytest.mark.parametrize("count", [1, 2, 8])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_an_answer_over_the_size_cap_is_not_a_refusal(count: int, on_error: str) -> None:
    """An answer larger than ``max_response_bytes`` (the transport stops reading it) is
    the server's fault, not the batch's: never split, no control request, no limit
    learned from the numbers in the library's own message; the call fails with it, in
    both ``on_error`` modes (no input is skipped for it)."""
    too_big = q.ResponseError(
        "the response of http://127.0.0.1:9/v1 is larger than the cap of 1,048,576 bytes "
        "(as received); raise max_response_bytes if it is legitimate",
        url="http://127.0.0.1:9/v1",
        max_bytes=1 << 20,
    )
    eng = engine()
    script = Script(lambda request, n: too_big)
    texts = [f"t{i}" for i in range(count)]
    with pytest.raises(q.ResponseError) as caught:
        script.run(batch(eng, eng.new_call(query=False, on_error=on_error), texts))
    assert caught.value.max_bytes == 1 << 20
    assert "max_response_bytes" in str(caught.value)
    assert script.sizes == [count]
    state = eng.endpoint.replicas[0].state(eng.model).batch
    assert state.limit is None


def test_a_per_input_limit_is_that_inputs_context_error() -> None:
    """ "max 512 tokens per input": no cap on batches; the long text fails alone as a
    ContextLengthError with its index."""
    texts = ["short"] * 3 + ["y" * 4000] + ["short too"]
    eng = engine()
    script = Script(refusing("y" * 4000, 400, "max 512 tokens per input"))
    part = script.run(batch(eng, eng.new_call(query=False, on_error="skip"), texts))
    assert list(part.failed) == [3]
    assert isinstance(part.failed[3], q.ContextLengthError)
    assert eng.endpoint.replicas[0].state(eng.model).batch.limit is None


@pytest.mark.parametrize(
    ("message", "unit", "value", "per_input"),
    [
        ("Value should have at most 1024 items after validation, not 1260", "texts", 1024, 0),
        ("250 instance(s) is allowed per prediction. Actual: 512", "texts", 250, 0),
        ("Request payload size exceeds the limit: 4194304 bytes", "bytes", 4194304, 0),
        ("maximum 96 texts per request", "texts", 96, 0),
        ("batch size 300 exceeds max 256", "texts", 256, 0),
        ("input too large: 9000 characters > 8192", "characters", 8192, 0),
        ("max 8192 tokens per input", "tokens", 8192, 1),
        ("Too many tokens in batch. Max is 16384 got 29000", "tokens", 16384, 0),
        ("the list has 3000 elements but at most 2048 are allowed", "texts", 2048, 0),
        ("request body too large: 5 MB limit", "bytes", 5_000_000, 0),
        ("This model's maximum context length is 8192 tokens", "tokens", 8192, 1),
    ],
)
def test_stated_limits_in_any_wording(message: str, unit: str, value: int, per_input: int) -> None:
    found = stated_limit(message)
    assert found is not None
    assert (found.unit, found.value, found.per_input) == (unit, value, bool(per_input))


@pytest.mark.parametrize(
    "message", ["Bad Request", "The model `x` does not exist.", "invalid input at index 3"]
)
def test_no_limit_where_none_is_stated(message: str) -> None:
    assert stated_limit(message) is None


# --------------------------------------------------------------------------- fields


def test_float_is_sent_without_the_field() -> None:
    eng = engine()  # encoding_format="float"
    bodies: list[dict[str, Any]] = []

    def answer(request: Request, n: int) -> Reply:
        bodies.append(orjson.loads(request.body))
        return ok(request)

    Script(answer).run(batch(eng, eng.new_call(query=False), ["a", "b"]))
    assert "encoding_format" not in bodies[0]


@pytest.mark.parametrize(
    ("code", "body"),
    [
        (400, {"error": {"message": "extra fields not permitted: ['encoding_format']"}}),  # Jina
        (
            422,
            {
                "detail": [
                    {"loc": ["body", "encoding_format"], "msg": "Extra inputs are not permitted"}
                ]
            },
        ),
        (400, {"error": {"message": "Unrecognized request argument supplied: encoding_format"}}),
    ],
)
def test_a_refused_encoding_format_falls_back_to_float_without_it(
    code: int, body: object, caplog: pytest.LogCaptureFixture
) -> None:
    """The default base64-first mode on a server that refuses the field itself: resent
    at once as float without the field, learned for the replica, logged once."""
    bodies: list[dict[str, Any]] = []

    def answer(request: Request, n: int) -> Reply:
        doc = orjson.loads(request.body)
        bodies.append(doc)
        if "encoding_format" in doc:
            return Reply(code, {"content-type": "application/json"}, orjson.dumps(body), True)
        return ok(request)

    eng = auto_engine()
    with caplog.at_level(logging.WARNING, logger="qwen_embed_plugins"):
        for _ in range(2):
            part = Script(answer).run(batch(eng, eng.new_call(query=False), ["a", "b"]))
            assert sorted(rows_of(part, 2)) == [0, 1]
    assert [("encoding_format" in b) for b in bodies] == [True, False, False]
    assert len([r for r in caplog.records if "float" in r.getMessage()]) == 1


GENERIC = [(400, "Bad Request"), (422, "Unprocessable Entity"), (400, "invalid request")]


def refusing_field(
    name: str, code: int, message: str, bodies: list[dict[str, Any]]
) -> Callable[[Request, int], Reply]:
    """Refuse (``code``, ``message``: words naming nothing) every request that carries
    field ``name``; answer the rest. Each body is kept in ``bodies``."""

    def answer(request: Request, n: int) -> Reply:
        doc = orjson.loads(request.body)
        bodies.append(doc)
        return status(code, message) if name in doc else ok(request)

    return answer


@pytest.mark.parametrize(("code", "message"), GENERIC)
@pytest.mark.parametrize("name", ["encoding_format", "dimensions"])
def test_a_field_refused_in_words_naming_nothing_goes(
    name: str, code: int, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway that refuses ``encoding_format=base64`` (or ``dimensions``) with words
    naming nothing: the batch and a control request are refused, a control request
    without the fields the client adds goes through (with both out: one more with
    base64 back tells that ``dimensions`` alone was refused), so the batch is sent again
    without the refused one (4 requests; 5 for ``dimensions``) and every vector comes
    back; learned for the replica (one WARNING naming that field alone), the next call
    sends it no more, and keeps base64 when only ``dimensions`` was refused."""
    bodies: list[dict[str, Any]] = []
    eng = auto_engine(dimensions=2) if name == "dimensions" else auto_engine()
    answer = refusing_field(name, code, message, bodies)
    with caplog.at_level(logging.WARNING, logger="qwen_embed_plugins"):
        part = Script(answer).run(batch(eng, eng.new_call(query=False), ["a", "b", "c"]))
        again = Script(answer).run(batch(eng, eng.new_call(query=False), ["d", "e"]))
    assert sorted(rows_of(part, 3)) == [0, 1, 2]
    assert sorted(rows_of(again, 2)) == [0, 1]
    inputs = [b["input"] for b in bodies]
    lessons = [r.getMessage() for r in caplog.records if "took one without" in r.getMessage()]
    assert len(lessons) == 1
    if name == "dimensions":  # sliced client-side; base64 kept
        assert rows_of(part, 3)[0].shape == (2,)
        hello, first, second = ["hello"], ["a", "b", "c"], ["d", "e"]
        assert inputs == [first, hello, hello, hello, first, second]
        assert [name in b for b in bodies] == [True, True, False, False, False, False]
        formats = [b.get("encoding_format") for b in bodies]
        assert formats == ["base64", "base64", None, "base64", "base64", "base64"]
        assert "dimensions=2" in lessons[0]
        assert "encoding_format" not in lessons[0]
        return
    assert inputs == [["a", "b", "c"], ["hello"], ["hello"], ["a", "b", "c"], ["d", "e"]]
    assert [name in b for b in bodies] == [True, True, False, False, False]
    assert "encoding_format=base64" in lessons[0]


@pytest.mark.parametrize("name", ["encoding_format", "dimensions"])
def test_a_single_text_refused_for_a_field_is_sent_again_without_it(name: str) -> None:
    """One text, its field refused with words naming nothing, nothing succeeded yet: the
    text, the control with and without the fields, then the text without them (never
    taken for a refused one-item list: no bare-string trial)."""
    bodies: list[dict[str, Any]] = []
    eng = auto_engine(dimensions=2) if name == "dimensions" else auto_engine()
    part = Script(refusing_field(name, 400, "Bad Request", bodies)).run(
        batch(eng, eng.new_call(query=False, on_error="skip"), ["x"])
    )
    assert not part.failed
    assert sorted(rows_of(part, 1)) == [0]
    controls = [["hello"]] * (3 if name == "dimensions" else 2)  # + base64 back, for dims
    assert [b["input"] for b in bodies] == [["x"], *controls, ["x"]]
    assert eng.endpoint.replicas[0].state(eng.model).bare_input is not True


def test_a_server_refusing_everything_keeps_the_fields() -> None:
    """A wrong model name while the client sends base64 and ``dimensions``: the batch,
    a control request with and one without those fields, then the server's own
    message with no index (3 requests); nothing is learned, so the next call sends
    the fields again."""
    bodies: list[dict[str, Any]] = []

    def answer(request: Request, n: int) -> Reply:
        bodies.append(orjson.loads(request.body))
        return status(400, "The model `qwen3` does not exist on this gateway")

    eng = auto_engine(dimensions=2)
    for texts in (["a", "b"], ["x"]):
        bodies.clear()
        with pytest.raises(q.BadRequestError) as info:
            Script(answer).run(batch(eng, eng.new_call(query=False), texts))
        assert info.value.index is None
        assert "does not exist" in str(info.value)
        assert [b["input"] for b in bodies] == [texts, ["hello"], ["hello"]]
        assert [sorted(b) for b in bodies][-1] == ["input", "model"]
        assert "encoding_format" in bodies[0]
        assert "dimensions" in bodies[0]


def test_extra_body_none_drops_a_field_the_client_adds() -> None:
    """``extra_body={"encoding_format": None, "dimensions": None}``: neither is ever sent
    (float vectors; ``dimensions`` applied client-side)."""
    bodies: list[dict[str, Any]] = []

    def answer(request: Request, n: int) -> Reply:
        bodies.append(orjson.loads(request.body))
        return ok(request)

    eng = auto_engine(
        dimensions=2,
        extra_body={"encoding_format": None, "dimensions": None, "user": "me"},
    )
    part = Script(answer).run(batch(eng, eng.new_call(query=False), ["a", "b"]))
    assert bodies[0] == {"input": ["a", "b"], "model": "script-model", "user": "me"}
    assert rows_of(part, 2)[0].shape == (2,)
    with pytest.raises(q.ConfigError, match="'input'"):
        engine(extra_body={"input": None})


# --------------------------------------------------------------------------- single text


def test_a_single_refused_text_is_final_after_its_bare_form() -> None:
    """``["x"]`` -> 400, control ``["hello"]`` -> 200, ``"x"`` -> 400: the text's error,
    with its index; never sent a third time."""
    eng = engine()
    script = Script(refusing("x", 400, "input rejected by policy"))
    part = script.run(batch(eng, eng.new_call(query=True, on_error="skip"), ["x"]))
    assert script.inputs == [["x"], ["hello"], "x"]
    assert isinstance(part.failed[0], q.BadRequestError)
    assert part.failed[0].index == 0


@pytest.mark.parametrize("on_error", ["skip", "raise"])
@pytest.mark.parametrize("code", [400, 422])
def test_a_server_refusing_everything_fails_a_single_text_after_two_requests(
    code: int, on_error: str
) -> None:
    """A wrong model name, one text: the text and one control request (no bare-string
    trial: the server works for nothing), then the server's own message, no index."""
    message = "The model `qwen3` does not exist on this gateway"
    eng = engine()
    script = Script(lambda request, n: status(code, message))
    with pytest.raises(q.HTTPStatusError) as info:
        script.run(batch(eng, eng.new_call(query=False, on_error=on_error), ["x"]))
    assert script.inputs == [["x"], ["hello"]]
    assert message in str(info.value)
    assert info.value.index is None


def test_a_one_item_list_refused_but_a_bare_string_taken_is_learned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``["x"]`` -> 400, control ``["hello"]`` -> 200, ``"x"`` -> 200: embedded and
    learned for the replica (one WARNING); the next single text goes as a string."""

    def answer(request: Request, n: int) -> Reply:
        doc = orjson.loads(request.body)["input"]
        return status(400, "input rejected") if doc == ["x"] or doc == ["y"] else ok(request)

    eng = engine()
    script = Script(answer)
    call = eng.new_call(query=False, on_error="skip")
    with caplog.at_level(logging.WARNING, logger="qwen_embed_plugins"):
        part = script.run(batch(eng, call, ["x"]))
        again = script.run(batch(eng, call, ["y"]))
    assert script.inputs == [["x"], ["hello"], "x", "y"]
    assert rows_of(part, 1).keys() == {0}
    assert rows_of(again, 1).keys() == {0}
    assert not part.failed
    assert not again.failed
    assert len([r for r in caplog.records if "bare string" in r.getMessage()]) == 1


def test_a_single_refused_text_after_a_success_costs_one_request() -> None:
    """The server was seen working in this call and takes one-item lists: the refused
    text is final at its first refusal."""
    eng = engine()
    script = Script(refusing("x", 400, "input rejected by policy"))
    call = eng.new_call(query=False, on_error="skip")
    script.run(batch(eng, call, ["fine"]))
    part = script.run(batch(eng, call, ["x"]))
    assert script.inputs == [["fine"], ["x"]]
    assert part.failed[0].index == 0


def test_max_retries_bounds_a_single_texts_requests_in_an_outage() -> None:
    """``max_retries=2``, a server answering 500 to everything: the single text's
    requests, bare-string trial included, stop at 3 (no resend); nothing shows the
    server working, so the text is not blamed (not skipped): the call fails with the
    server's error, no index, saying the bound."""
    eng = engine(q.RetryConfig(backoff_initial=0.01, backoff_max=0.02, max_retries=2))
    script = Script(lambda request, n: status(500, "backend down"))
    with pytest.raises(q.ServerError) as info:
        script.run(batch(eng, eng.new_call(query=False, on_error="skip"), ["x"]))
    assert len(script.inputs) <= 3
    assert info.value.index is None
    assert "max_retries=2" in str(info.value)


@pytest.mark.parametrize("bound", [0, 1, 2])
def test_max_retries_counts_the_float_trial_of_a_base64_request(bound: int) -> None:
    """The default base64-first mode, one text, a server answering 500 to everything:
    the float trial counts against ``max_retries`` like the bare-string trial, so the
    text gets at most ``max_retries + 1`` requests in all."""
    eng = Engine(
        engine(
            q.RetryConfig(backoff_initial=0.01, backoff_max=0.02, max_retries=bound)
        ).config.replace(encoding_format="auto")
    )
    script = Script(lambda request, n: status(500, "backend down"))
    with pytest.raises(q.ServerError) as info:
        script.run(batch(eng, eng.new_call(query=False, on_error="skip"), ["x"]))
    assert len(script.inputs) == bound + 1
    assert info.value.index is None


@pytest.mark.parametrize("bound", [0, 1, 2])
def test_max_retries_never_blames_every_input_of_a_server_failing_everything(bound: int) -> None:
    """A batch of 8 on a server answering 500 to everything, ``on_error="skip"``: with
    any explicit bound the call fails with the server's error (no index), never with
    every input skipped as its own failure; at most 2 requests of each piece, 3 for
    the last text and its control."""
    eng = engine(q.RetryConfig(backoff_initial=0.01, backoff_max=0.02, max_retries=bound))
    script = Script(lambda request, n: status(500, "backend down"))
    with pytest.raises(q.ServerError) as info:
        script.run(batch(eng, eng.new_call(query=False, on_error="skip"), list("abcdefgh")))
    assert info.value.index is None
    assert len(script.inputs) <= 2 * 4 + 3


@pytest.mark.parametrize("bound", [0, 1])
def test_max_retries_still_isolates_a_text_failing_after_others_succeeded(bound: int) -> None:
    """The same bound, one text of 8 failing with 500 after other pieces went through
    (the server seen working): that text alone is skipped, the rest embedded."""

    def answer(request: Request, n: int) -> Reply:
        return status(500, "boom") if "t5" in sent(request) else ok(request)

    eng = engine(q.RetryConfig(backoff_initial=0.01, backoff_max=0.02, max_retries=bound))
    script = Script(answer)
    texts = [f"t{i}" for i in range(8)]
    part = script.run(batch(eng, eng.new_call(query=False, on_error="skip"), texts))
    assert list(part.failed) == [5]
    assert sorted(rows_of(part, 8)) == [0, 1, 2, 3, 4, 6, 7]


@pytest.mark.parametrize(("bound", "sent"), [(0, [["x"]]), (1, [["x"], ["hello"]])])
def test_max_retries_bounds_a_single_refused_texts_control_and_bare_form(
    bound: int, sent: list[Any]
) -> None:
    """An explicit ``max_retries`` counts the control request and the bare-string form
    of a refused single text: at most ``max_retries + 1`` requests. With room for the
    control (which goes through): the text's error; with none (``max_retries=0``),
    nothing shows the server working: the call fails with its error, no index."""
    eng = engine(q.RetryConfig(backoff_initial=0.01, backoff_max=0.02, max_retries=bound))
    script = Script(refusing("x", 400, "input rejected by policy"))
    if bound == 0:
        with pytest.raises(q.BadRequestError) as info:
            script.run(batch(eng, eng.new_call(query=False, on_error="skip"), ["x"]))
        assert info.value.index is None
        assert script.inputs == sent
        return
    part = script.run(batch(eng, eng.new_call(query=False, on_error="skip"), ["x"]))
    assert script.inputs == sent
    assert isinstance(part.failed[0], q.BadRequestError)
    assert part.failed[0].index == 0


def test_a_single_refused_text_after_a_batch_costs_two_requests() -> None:
    """The server was seen working in this call (a batch of two), one-item lists not
    yet: the refused text and its bare-string form, final; no control request."""
    eng = engine()
    script = Script(refusing("x", 400, "input rejected by policy"))
    call = eng.new_call(query=False, on_error="skip")
    script.run(batch(eng, call, ["fine", "good"]))
    part = script.run(batch(eng, call, ["x"]))
    assert script.inputs == [["fine", "good"], ["x"], "x"]
    assert isinstance(part.failed[0], q.BadRequestError)
    assert part.failed[0].index == 0


def test_llama_box_500_context_wording_is_a_context_length_error() -> None:
    """llama-box's 500 for an over-long input: bisected (it may be the server's), then
    that text's ``ContextLengthError`` (status 500) under ``on_error="skip"``."""
    texts = [f"chunk {i}" for i in range(8)]
    texts[2] = "too long"
    message = "input is too large to process. increase the physical batch size"
    eng = engine()
    part = Script(refusing("too long", 500, message)).run(
        batch(eng, eng.new_call(query=False, on_error="skip"), texts)
    )
    assert list(part.failed) == [2]
    error = part.failed[2]
    assert isinstance(error, q.ContextLengthError)
    assert (error.status, error.index) == (500, 2)


# --------------------------------------------------------------------------- one lesson


@pytest.mark.parametrize(
    ("message", "lesson"),
    [
        ("this model does not support the dimensions parameter", "dimensions"),
        ("Value should have at most 2 items after validation, not 4", "texts per request"),
        ("list index out of range", "bare string"),  # SGLang 0.4.6: 500 to ["text"]
    ],
)
def test_one_line_and_one_refusal_per_request_in_flight(
    message: str, lesson: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Three batches in flight when the server refuses each (``dimensions``, a batch
    cap, a one-item list): one WARNING for the replica, one refused request per batch
    in flight."""
    eng = engine(FAST, dimensions=2)
    refused: list[Any] = []
    gate = asyncio.Event()
    arrived = 0

    async def send(op: Send) -> Reply:
        nonlocal arrived
        doc = orjson.loads(op.request.body)
        arrived += 1
        if arrived == 3:
            gate.set()
        await gate.wait()  # every batch is in flight before any answer
        if lesson == "bare string" and isinstance(doc["input"], list):
            refused.append(doc)
            return status(500, message)
        if ("dimensions" in doc and lesson == "dimensions") or (
            lesson == "texts per request" and len(doc["input"]) > 2
        ):
            refused.append(doc)
            return status(400, message)
        return ok(op.request)

    size = 1 if lesson == "bare string" else 4

    async def main() -> list[Part]:
        call = eng.new_call(query=False)
        flows = [batch(eng, call, [f"b{k} t{i}" for i in range(size)]) for k in range(3)]
        return list(await asyncio.gather(*(run_async(f, send) for f in flows)))

    with caplog.at_level(logging.WARNING, logger="qwen_embed_plugins"):
        parts = asyncio.run(main())
    assert all(sorted(rows_of(p, size)) == list(range(size)) for p in parts)
    assert len(refused) == 3
    assert len([r for r in caplog.records if lesson in r.getMessage()]) == 1
