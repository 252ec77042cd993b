"""A drop-in for the stock adapters (issue 22): ``headers=`` / ``extra_body=`` in the core,
the stock parameter names on both adapters, "did you mean" for any other name, and
secret header values kept out of reprs, dumps, pickles, logs and errors.

What the client sends is read at a loopback `RecordingServer` (headers and body of each
request); the core's own fields (``input``, ``model``, ``encoding_format``) are checked
there too.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from llama_index.core.bridge.pydantic import ValidationError as LlamaValidationError
from pydantic import ValidationError
from recording_server import Received, RecordingServer

import qwen_embed_plugins as q
from qwen_embed_plugins import AsyncEmbeddingClient, ConfigError, EmbeddingClient, EmbeddingConfig
from qwen_embed_plugins.integrations.langchain import QwenPooledEmbeddings
from qwen_embed_plugins.integrations.llama_index import QwenPooledEmbedding
from qwen_embed_tooling.testing import EmbeddingServer, expected_embedding

GATEWAY_SECRET = "gw-secret-7f3a9c0e11"
TOKEN_SECRET = "tok-secret-55aa0b1c"
HEADERS = {"X-Tenant": "acme", "X-Api-Key": GATEWAY_SECRET, "X-Auth-Token": TOKEN_SECRET}
BODY = {"truncate_prompt_tokens": 64, "options": {"num_ctx": 8192}, "user": "u-1"}
TEXTS = ["alpha one", "beta two", "gamma three", "delta four", "epsilon five"]
UNUSED_URL = "http://127.0.0.1:9/v1"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("QWEN_EMBED_API_KEY", "QWEN_EMBED_BASE_URL", "QWEN_EMBED_MODEL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def rec() -> Iterator[RecordingServer]:
    with RecordingServer() as server:
        yield server


def _carried(seen: Received, *, model: str = q.DEFAULT_MODEL) -> None:
    """``seen`` carried the configured headers and body fields, and the client's own."""
    assert seen.headers["x-tenant"] == "acme"
    assert seen.headers["x-api-key"] == GATEWAY_SECRET
    assert seen.headers["x-auth-token"] == TOKEN_SECRET
    assert seen.headers["content-type"] == "application/json"
    for key, value in BODY.items():
        assert seen.body[key] == value
    assert seen.body["model"] == model
    assert seen.body["encoding_format"] in ("base64", "float")
    assert isinstance(seen.body["input"], list)
    assert seen.body["input"]


def _no_secret(text: str) -> None:
    assert GATEWAY_SECRET not in text
    assert TOKEN_SECRET not in text


# --------------------------------------------------------------------------- core


def test_core_sends_headers_and_extra_body_sync_and_async(rec: RecordingServer) -> None:
    config = EmbeddingConfig(
        base_url=rec.base_url, api_key="sk-core-key-1", headers=HEADERS, extra_body=BODY
    )
    vectors = EmbeddingClient(config).embed_documents(TEXTS)
    assert vectors[0] == pytest.approx(expected_embedding(TEXTS[0]).tolist(), abs=1e-6)
    EmbeddingClient(config).embed_query("where?")

    async def run() -> None:
        client = AsyncEmbeddingClient(config)
        await client.embed_documents(TEXTS[:2])
        await client.embed_query("async where?")

    asyncio.run(run())
    seen = rec.all()
    assert len(seen) == 4
    for one in seen:
        _carried(one)
        assert one.headers["authorization"] == "Bearer sk-core-key-1"
    assert seen[0].body["input"] == TEXTS
    assert seen[1].body["input"] == [q.format_query("where?", q.DEFAULT_QUERY_TASK)]


def test_openai_client_sends_the_configured_headers(rec: RecordingServer) -> None:
    """``openai_client()``, sync and async: the SDK sends the configured headers (the
    body holds what the caller gives ``embeddings.create``, ``extra_body`` included)."""
    config = EmbeddingConfig(base_url=rec.base_url, headers=HEADERS)
    sdk = EmbeddingClient(config).openai_client()
    sdk.embeddings.create(
        input=TEXTS[:2], model=q.DEFAULT_MODEL, encoding_format="float", extra_body=dict(BODY)
    )

    async def run() -> None:
        asdk = AsyncEmbeddingClient(config).openai_client()
        await asdk.embeddings.create(
            input=TEXTS[:3], model=q.DEFAULT_MODEL, encoding_format="float", extra_body=dict(BODY)
        )

    asyncio.run(run())
    assert len(rec.all()) == 2
    for one in rec.all():
        _carried(one)


def test_authorization_header_without_api_key_is_sent_as_given(rec: RecordingServer) -> None:
    config = EmbeddingConfig(base_url=rec.base_url, headers={"Authorization": "Basic dXNlcjpwdw=="})
    EmbeddingClient(config).embed_documents(["x"])
    assert rec.last().headers["authorization"] == "Basic dXNlcjpwdw=="
    assert "dXNlcjpwdw" not in repr(config)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["Content-Type", "accept", "Content-Length", "Host"])
def test_headers_the_client_sets_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match=f"'{name}' is set by the client itself"):
        EmbeddingConfig(base_url=UNUSED_URL, headers={name: "x"})


@pytest.mark.unit
def test_authorization_header_and_api_key_together_are_refused() -> None:
    with pytest.raises(ConfigError, match="'Authorization' given together with an API key") as info:
        EmbeddingConfig(base_url=UNUSED_URL, api_key="sk-a1b2c3d4", headers={"authorization": "x"})
    assert "sk-a1b2c3d4" not in str(info.value)


@pytest.mark.parametrize("make", [EmbeddingConfig, QwenPooledEmbeddings, QwenPooledEmbedding])
def test_authorization_header_with_a_key_from_the_environment_says_where_it_came_from(
    make: Any, rec: RecordingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key read from ``QWEN_EMBED_API_KEY`` conflicts with a gateway's ``Authorization``
    header: the message names the variable and the way out (``api_key=None``), which
    sends the header alone."""
    monkeypatch.setenv("QWEN_EMBED_API_KEY", "sk-from-env-0123")
    basic = {"Authorization": "Basic dXNlcjpwYXNz"}
    with pytest.raises(ValueError, match="QWEN_EMBED_API_KEY when api_key is not given") as info:
        make(base_url=rec.base_url, headers=basic)
    assert "api_key=None sends this header alone" in str(info.value)
    assert "sk-from-env-0123" not in str(info.value)
    made = make(base_url=rec.base_url, headers=basic, api_key=None)
    if isinstance(made, EmbeddingConfig):
        EmbeddingClient(made).embed_documents(["x"])
    elif isinstance(made, QwenPooledEmbeddings):
        made.embed_documents(["x"])
    else:
        made.get_text_embedding("x")
    assert rec.last().headers["authorization"] == basic["Authorization"]


@pytest.mark.unit
def test_bad_header_values_are_refused_without_showing_secrets() -> None:
    with pytest.raises(ConfigError, match="line break") as info:
        EmbeddingConfig(base_url=UNUSED_URL, headers={"X-Api-Key": GATEWAY_SECRET + "\r\nX: y"})
    _no_secret(str(info.value))
    with pytest.raises(ConfigError, match="not a valid HTTP header name"):
        EmbeddingConfig(base_url=UNUSED_URL, headers={"bad name": "x"})
    with pytest.raises(ConfigError, match="same header"):
        EmbeddingConfig(base_url=UNUSED_URL, headers={"X-A": "1", "x-a": "2"})


@pytest.mark.unit
@pytest.mark.parametrize("key", ["input", "model", "encoding_format", "dimensions"])
def test_extra_body_cannot_override_the_clients_fields(key: str) -> None:
    with pytest.raises(ConfigError, match=f"extra_body: '{key}' is written by the client"):
        EmbeddingConfig(base_url=UNUSED_URL, extra_body={key: "x"})
    with pytest.raises(ValidationError, match=f"'{key}' is written by the client"):
        QwenPooledEmbeddings(base_url=UNUSED_URL, model_kwargs={key: "x"})
    with pytest.raises(LlamaValidationError, match=f"'{key}' is written by the client"):
        QwenPooledEmbedding(base_url=UNUSED_URL, additional_kwargs={key: "x"})


@pytest.mark.unit
def test_extra_body_must_be_json() -> None:
    with pytest.raises(ConfigError, match="JSON-serialisable"):
        EmbeddingConfig(base_url=UNUSED_URL, extra_body={"x": object()})


@pytest.mark.unit
def test_headers_and_body_are_frozen_hashable_and_do_not_split_the_pool() -> None:
    body = {"options": {"num_ctx": 1}}
    plain = EmbeddingConfig(base_url=UNUSED_URL)
    given = EmbeddingConfig(base_url=UNUSED_URL, headers=HEADERS, extra_body=body)
    body["options"]["num_ctx"] = 2  # the caller's dict is copied, not kept
    assert given.extra_body == {"options": {"num_ctx": 1}}
    assert given.pool_key == plain.pool_key
    assert hash(given) == hash(
        EmbeddingConfig(
            base_url=UNUSED_URL, headers=HEADERS, extra_body={"options": {"num_ctx": 1}}
        )
    )
    assert given != plain
    assert given.replace(batch_size=8).headers == given.headers


def test_headers_do_not_split_the_pool_on_the_wire(rec: RecordingServer) -> None:
    label = EmbeddingConfig(base_url=rec.base_url).pool_key.label
    before = q.pool_stats().get(label, {}).get("connections_opened", 0)
    EmbeddingClient(EmbeddingConfig(base_url=rec.base_url)).embed_documents(["a"])
    EmbeddingClient(
        EmbeddingConfig(base_url=rec.base_url, headers={"X-Tenant": "b"})
    ).embed_documents(["b"])
    EmbeddingClient(
        EmbeddingConfig(base_url=rec.base_url, extra_body={"user": "c"})
    ).embed_documents(["c"])
    assert q.pool_stats()[label]["connections_opened"] - before == 1
    assert [r.headers.get("x-tenant") for r in rec.all()] == [None, "b", None]


@pytest.mark.unit
def test_secret_headers_never_in_repr_or_pickle() -> None:
    config = EmbeddingConfig(base_url=UNUSED_URL, headers=HEADERS)
    _no_secret(repr(config))
    _no_secret(str(config.headers))
    assert "acme" in repr(config)  # the other headers are shown
    data = pickle.dumps(config)
    _no_secret(data.decode("latin-1"))
    copy = pickle.loads(data)
    assert copy.headers.withheld() == ["X-Api-Key", "X-Auth-Token"]
    with pytest.raises(ConfigError, match="'X-Api-Key' looks like a credential, so it was not"):
        EmbeddingClient(copy)


def test_secret_headers_never_in_errors_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    """A server that refuses the request (401): the error and the log hold no secret."""
    caplog.set_level(logging.DEBUG)
    with EmbeddingServer(api_key="the-servers-key") as server:
        config = EmbeddingConfig(base_url=server.base_url, headers=HEADERS)
        with pytest.raises(q.QwenEmbedError) as info:
            EmbeddingClient(config).embed_documents(["x"])
    _no_secret(str(info.value))
    _no_secret(repr(info.value))
    _no_secret(caplog.text)


def _call(path: str, url: str, **settings: Any) -> Callable[[], object]:
    """One embedding call with the secret ``HEADERS`` on ``path``."""
    if path == "langchain":
        emb = QwenPooledEmbeddings(base_url=url, default_headers=HEADERS, **settings)
        return lambda: emb.embed_documents(["x"])
    if path == "llama_index":
        model = QwenPooledEmbedding(base_url=url, default_headers=HEADERS, **settings)
        return lambda: model.get_text_embedding_batch(["x"])
    config = EmbeddingConfig(
        base_url=url,
        headers=HEADERS,
        http2=path.startswith("h2"),
        retry=q.RetryConfig(
            max_attempts=settings.get("max_retries", 0) + 1, deadline=settings.get("deadline", 30)
        ),
    )
    if path.endswith("async"):
        return lambda: asyncio.run(AsyncEmbeddingClient(config).embed_documents(["x"]))
    return lambda: EmbeddingClient(config).embed_documents(["x"])


def _scrubbed(exc: BaseException, logs: str) -> None:
    """No secret header value in the error, its traceback, its pickle, or the logs."""
    for text in (str(exc), repr(exc), repr(vars(exc)), logs):
        _no_secret(text)
    _no_secret("".join(traceback.format_exception(exc)))
    _no_secret(pickle.dumps(exc).decode("latin-1"))


@pytest.mark.parametrize("path", ["sync", "async", "langchain", "llama_index"])
def test_secret_header_values_echoed_in_an_error_answer_are_scrubbed(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that quotes every request header in its error body and in
    ``x-request-id``: the values of the secret ones (like the API key) are scrubbed from
    the error, its request id and the retry log lines; the others are kept."""
    caplog.set_level(logging.DEBUG)
    with RecordingServer(echo="error", status=500) as server:
        # a server failing every request (the control one too) is down: retried until
        # the deadline, then its error is raised
        # (the adapters' max_retries, given, would bound each request whatever the cause:
        # left unset there, as max_attempts=2 in the core config, the outage is waited out)
        bounds: dict[str, Any] = {"deadline": 3}
        if path in ("sync", "async"):
            bounds["max_retries"] = 1
        call = _call(path, server.base_url, **bounds)
        with pytest.raises(q.ServerError) as info:
            call()
    error = info.value
    assert "retrying" in caplog.text  # a retry line quoting the error was logged
    assert "X-Tenant=acme" in str(error)  # the echo reached the error
    assert error.request_id is not None
    assert "X-Tenant=acme" in error.request_id
    assert "X-Tenant=acme" in caplog.text
    _scrubbed(error, caplog.text)


@pytest.mark.parametrize("path", ["h2-sync", "h2-async"])
def test_secret_header_values_echoed_over_http2_are_scrubbed(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The same over HTTP/2 (h2c), with a server that sends the values back in its error
    message for the one input it refuses (a control request shows the server working, so
    the input is at fault)."""
    caplog.set_level(logging.DEBUG, logger="qwen_embed_plugins")
    with EmbeddingServer(http2=True) as server:
        server.poison(
            "x", status=400, message=f"refused X-Api-Key {GATEWAY_SECRET} for X-Tenant acme"
        )
        with pytest.raises(q.BadRequestError) as info:
            _call(path, server.base_url)()
    assert "for X-Tenant acme" in str(info.value)
    assert info.value.index == 0
    _scrubbed(info.value, caplog.text)


@pytest.mark.parametrize("path", ["sync", "async"])
def test_secret_header_values_echoed_in_a_malformed_status_line_are_scrubbed(path: str) -> None:
    """A broken answer quoting the request headers in its status line: the transport's
    error text is scrubbed of the secret header values (the error's own text; the
    chained exception of the HTTP library is not this library's)."""
    with (
        RecordingServer(echo="status_line") as server,
        pytest.raises(q.RemoteProtocolError) as info,
    ):
        _call(path, server.base_url)()
    assert "2x0" in str(info.value)  # the status line reached the error
    _no_secret(str(info.value))
    _no_secret(repr(info.value))


SDK_KEY = "sk-sdk-key-5e6f7a8b9c"


def _sdk_clean(*texts: str) -> None:
    for text in texts:
        _no_secret(text)
        assert SDK_KEY not in text
        assert SDK_KEY.upper() not in text


def _sdk_create(path: str, url: str) -> Any:
    """One ``embeddings.create`` through ``openai_client()`` (sync or async) with the API
    key and the secret ``HEADERS``; the SDK's answer or its exception."""
    config = EmbeddingConfig(base_url=url, api_key=SDK_KEY, headers=HEADERS)

    async def run() -> Any:
        sdk = AsyncEmbeddingClient(config).openai_client()
        return await sdk.embeddings.create(input=["x"], model=q.DEFAULT_MODEL)

    if path == "async":
        return asyncio.run(run())
    sdk = EmbeddingClient(config).openai_client()
    return sdk.embeddings.create(input=["x"], model=q.DEFAULT_MODEL)


@pytest.mark.parametrize("path", ["sync", "async"])
def test_openai_client_error_text_echoing_the_key_is_scrubbed(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``openai_client()``: a server quoting every request header (``Authorization`` with
    the API key, the secret headers) in its error body and its ``x-request-id``. The
    SDK's ``APIStatusError`` (its message, ``body``, ``response`` text and headers,
    ``request_id``) and the SDK's logs hold none of them; the other values are kept."""
    import openai

    caplog.set_level(logging.DEBUG)
    with (
        RecordingServer(echo="error", status=500) as server,
        pytest.raises(openai.APIStatusError) as info,
    ):
        _sdk_create(path, server.base_url)
    error = info.value
    assert error.status_code == 500
    assert "x-tenant=acme" in str(error).lower()  # the echo reached the SDK's message
    assert "x-tenant=acme" in (error.request_id or "").lower()
    _sdk_clean(
        str(error),
        repr(error.body),
        error.response.text,
        repr(error.response.headers.multi_items()),
        str(error.request_id),
        caplog.text,
    )


@pytest.mark.parametrize("path", ["sync", "async"])
def test_openai_client_success_echoing_the_key_is_scrubbed(path: str) -> None:
    """The same server answering 200 with the headers quoted in an extra body field and
    in ``x-request-id``: the SDK's response object shows neither secret, and the vector
    (base64, the SDK's default) is intact."""
    with RecordingServer(echo="ok") as server:
        answer = _sdk_create(path, server.base_url)
    assert answer.data[0].embedding == pytest.approx(expected_embedding("x").tolist(), abs=1e-6)
    dumped = answer.model_dump_json()
    assert "x-tenant=acme" in dumped.lower()
    _sdk_clean(dumped, repr(answer))


BODY_SECRET = "body-secret-3c4d5e6f70"
NESTED_SECRET = "nested-tok-8a9b0c1d2e"
SECRET_BODY = {
    "truncate_prompt_tokens": 64,
    "api_key": BODY_SECRET,
    "options": {"num_ctx": 8192, "accessToken": NESTED_SECRET},
}


def _no_body_secret(text: str) -> None:
    assert BODY_SECRET not in text
    assert NESTED_SECRET not in text


@pytest.mark.unit
def test_secret_extra_body_fields_never_in_repr_or_pickle() -> None:
    """``extra_body`` values under credential-like names (any depth, any case) are
    masked in ``repr``; a pickle withholds them and a client built from the copy asks
    for them again, naming the field; the other fields travel."""
    config = EmbeddingConfig(base_url=UNUSED_URL, extra_body=SECRET_BODY)
    _no_body_secret(repr(config))
    assert "'truncate_prompt_tokens': 64" in repr(config)
    assert "'num_ctx': 8192" in repr(config)
    assert config.extra_body is not None
    assert dict(config.extra_body) == SECRET_BODY  # the values themselves are kept
    data = pickle.dumps(config)
    _no_body_secret(data.decode("latin-1"))
    copy = pickle.loads(data)
    assert copy.extra_body.withheld() == ["api_key", "options.accessToken"]
    with pytest.raises(ConfigError, match="'api_key' looks like a credential, so it was not"):
        EmbeddingClient(copy)
    with pytest.raises(ConfigError, match=r"'options\.accessToken' looks like a credential"):
        copy.extra_body["options"]
    fine = copy.replace(extra_body=SECRET_BODY)
    assert dict(fine.extra_body) == SECRET_BODY
    with pytest.raises(ConfigError, match="holds the mask"):
        EmbeddingConfig(base_url=UNUSED_URL, extra_body=config.extra_body.masked())
    plain = EmbeddingConfig(base_url=UNUSED_URL, extra_body={"max_tokens": 5, "keep_alive": 1})
    assert pickle.loads(pickle.dumps(plain)).extra_body == {"max_tokens": 5, "keep_alive": 1}


def _body_call(path: str, url: str) -> Callable[[], object]:
    """One embedding call with ``SECRET_BODY`` on ``path`` (no retries)."""
    if path == "langchain":
        emb = QwenPooledEmbeddings(base_url=url, model_kwargs=SECRET_BODY, max_retries=0)
        return lambda: emb.embed_documents(["x"])
    if path == "llama_index":
        model = QwenPooledEmbedding(base_url=url, additional_kwargs=SECRET_BODY, max_retries=0)
        return lambda: model.get_text_embedding_batch(["x"])
    retry = q.RetryConfig(max_attempts=1, deadline=30)
    config = EmbeddingConfig(base_url=url, extra_body=SECRET_BODY, retry=retry)
    if path == "async":
        return lambda: asyncio.run(AsyncEmbeddingClient(config).embed_documents(["x"]))
    return lambda: EmbeddingClient(config).embed_documents(["x"])


@pytest.mark.parametrize("path", ["sync", "async", "langchain", "llama_index"])
def test_secret_extra_body_fields_echoed_in_an_error_are_scrubbed(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A server quoting the request body in its error (HTTP 400): the secret field
    values are sent, and scrubbed from the error, its pickle and the logs; the other
    fields are kept."""
    caplog.set_level(logging.DEBUG)
    with (
        RecordingServer(echo="error", status=400) as server,
        pytest.raises(q.QwenEmbedError) as info,
    ):
        _body_call(path, server.base_url)()
    sent = server.all()[0].body
    assert sent["api_key"] == BODY_SECRET
    assert sent["options"]["accessToken"] == NESTED_SECRET
    error = info.value
    assert "truncate_prompt_tokens" in str(error)  # the echo reached the error
    for text in (str(error), repr(error), repr(vars(error)), caplog.text):
        _no_body_secret(text)
    _no_body_secret("".join(traceback.format_exception(error)))
    _no_body_secret(pickle.dumps(error).decode("latin-1"))


def test_openai_client_scrubs_secret_extra_body_fields_from_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``openai_client()`` of a config with secret ``extra_body`` fields: a server
    quoting them back has them scrubbed from the SDK's error (the caller passes the
    body fields to ``embeddings.create`` itself)."""
    import openai

    caplog.set_level(logging.DEBUG)
    config = EmbeddingConfig(base_url=UNUSED_URL, extra_body=SECRET_BODY)
    with RecordingServer(echo="error", status=400) as server:
        sdk = EmbeddingClient(config.replace(base_url=server.base_url)).openai_client()
        with pytest.raises(openai.BadRequestError) as info:
            sdk.embeddings.create(input=["x"], model="m", extra_body=SECRET_BODY)
    assert "truncate_prompt_tokens" in str(info.value)
    # openai 2.x logs the caller's own request options (its extra_body) at DEBUG before
    # sending: that is the caller's input, not a server's answer
    logs = [r.getMessage() for r in caplog.records if "Request options" not in r.getMessage()]
    for text in (str(info.value), repr(info.value.body), info.value.response.text, *logs):
        _no_body_secret(text)


@pytest.mark.unit
@pytest.mark.parametrize("adapter", ["langchain", "llama_index"])
def test_adapters_mask_secret_extra_body_fields(adapter: str) -> None:
    """``model_kwargs`` / ``additional_kwargs`` / ``extra_body`` with credential-like
    fields: masked in repr and dumps (JSON included), withheld from pickles (a copy
    asks for them again), refused back as the mask."""
    if adapter == "langchain":
        emb: Any = QwenPooledEmbeddings(base_url=UNUSED_URL, model_kwargs=SECRET_BODY)
        error: Any = ValidationError
    else:
        emb = QwenPooledEmbedding(base_url=UNUSED_URL, additional_kwargs=SECRET_BODY)
        error = LlamaValidationError
    assert dict(emb.config.extra_body) == SECRET_BODY
    dumps = [repr(emb), str(emb.model_dump()), emb.model_dump_json()]
    if adapter == "llama_index":
        dumps += [emb.to_json(), str(emb.to_dict())]
    for text in dumps:
        _no_body_secret(text)
        assert "truncate_prompt_tokens" in text
    data = pickle.dumps(emb)
    _no_body_secret(data.decode("latin-1"))
    copy = pickle.loads(data)
    with pytest.raises(ConfigError, match="'api_key' looks like a credential"):
        copy.embed_query("x") if adapter == "langchain" else copy.get_query_embedding("x")
    with pytest.raises(error, match="holds the mask"):
        type(emb).model_validate_json(emb.model_dump_json())
    emb.extra_body = {"password": BODY_SECRET}  # assignment: stored masked too
    _no_body_secret(repr(emb))
    _no_body_secret(pickle.dumps(emb).decode("latin-1"))


# --------------------------------------------------------------------------- LangChain


def _langchain(url: str, **extra: Any) -> QwenPooledEmbeddings:
    return QwenPooledEmbeddings(
        base_url=url,
        chunk_size=2,
        default_headers=HEADERS,
        model_kwargs=BODY,
        **extra,
    )


def test_langchain_stock_names_reach_the_wire_sync_and_async(rec: RecordingServer) -> None:
    emb = _langchain(rec.base_url, timeout=42.5)
    assert emb.batch_size == 2
    assert emb.config.timeouts.total == 42.5
    emb.embed_documents(TEXTS)
    emb.embed_query("q")
    asyncio.run(emb.aembed_documents(TEXTS))
    asyncio.run(emb.aembed_query("q2"))
    seen = rec.all()
    assert sorted(len(r.body["input"]) for r in seen) == [1, 1, 1, 1, 2, 2, 2, 2]  # chunk_size
    for one in seen:
        _carried(one)


@pytest.mark.unit
def test_langchain_aliases_map_onto_fields() -> None:
    emb = QwenPooledEmbeddings(
        openai_api_base=UNUSED_URL,
        openai_api_key="sk-lc-key-1",
        request_timeout=7,
        show_progress_bar=True,
        check_embedding_ctx_length=False,  # what the adapter always does: accepted
        tiktoken_enabled=False,
        skip_empty=False,
    )
    assert emb.base_url == UNUSED_URL
    assert emb.api_key is not None
    assert emb.api_key.get_secret_value() == "sk-lc-key-1"
    assert emb.total_timeout == 7
    assert emb.config.timeouts.total == 7
    assert emb.show_progress is True
    assert QwenPooledEmbeddings(base_url=UNUSED_URL, timeout=None).config.timeouts.total is None


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"chunk_sise": 4}, "unknown parameter 'chunk_sise'; did you mean 'chunk_size'"),
        ({"batch_sise": 4}, "unknown parameter 'batch_sise'; did you mean 'batch_size'"),
        (
            {"max_conections": 4},
            "unknown parameter 'max_conections'; did you mean 'max_connections'",
        ),
        ({"chunk_size": 4, "batch_size": 8}, "pass either 'chunk_size' or 'batch_size'"),
        ({"timeout": 1, "request_timeout": 2}, "pass either 'timeout' or 'request_timeout'"),
        ({"timeout": (1, "2")}, "timeout: item 1 must be a number of seconds or None"),
        ({"timeout": "30"}, "timeout must be a number of seconds, None, httpx.Timeout"),
        ({"http_client": object()}, "'http_client' is not supported: requests go through"),
        ({"embedding_ctx_length": 100}, "no tokenizer is used here"),
        ({"check_embedding_ctx_length": True}, "only check_embedding_ctx_length=False"),
        ({"skip_empty": True}, "only skip_empty=False is accepted"),
        ({"openai_api_type": "azure"}, "Azure OpenAI is not supported"),
        ({"zzz": 1}, "unknown parameter 'zzz'"),
    ],
)
def test_langchain_unknown_names_get_a_hint(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        QwenPooledEmbeddings(base_url=UNUSED_URL, **kwargs)
    assert message in str(info.value)
    assert "Extra inputs are not permitted" not in str(info.value)
    with pytest.raises(ValidationError, match="did you mean 'chunk_size'"):
        QwenPooledEmbeddings.model_validate({"base_url": UNUSED_URL, "chunk_sise": 4})


@pytest.mark.unit
def test_langchain_secret_headers_never_in_repr_dump_or_pickle() -> None:
    emb = _langchain(UNUSED_URL)
    for text in (repr(emb), str(emb.model_dump()), emb.model_dump_json(), repr(emb.config)):
        _no_secret(text)
        assert "acme" in text
    assert emb.model_dump()["headers"]["X-Api-Key"] == "**********"
    _no_secret(pickle.dumps(emb).decode("latin-1"))
    copy = pickle.loads(pickle.dumps(emb))
    assert copy.headers["X-Tenant"] == "acme"
    with pytest.raises(ConfigError, match="'X-Api-Key' looks like a credential"):
        copy.embed_documents(["x"])
    with pytest.raises(ValidationError, match="holds the mask"):  # a dump is not a config
        QwenPooledEmbeddings(**emb.model_dump())


# --------------------------------------------------------------------------- LlamaIndex


def _llama(url: str, **extra: Any) -> QwenPooledEmbedding:
    return QwenPooledEmbedding(
        base_url=url,
        embed_batch_size=2,
        default_headers=HEADERS,
        additional_kwargs=BODY,
        **extra,
    )


def test_llama_index_stock_names_reach_the_wire_sync_and_async(rec: RecordingServer) -> None:
    emb = _llama(rec.base_url, timeout=33.0, reuse_client=True)
    assert emb.config.timeouts.total == 33.0
    assert emb.config.batch_size == 2
    emb.get_text_embedding_batch(TEXTS)
    emb.get_query_embedding("q")

    async def run() -> None:
        await emb.aget_text_embedding_batch(TEXTS)
        await emb.aget_query_embedding("q2")

    asyncio.run(run())
    seen = rec.all()
    assert sorted(len(r.body["input"]) for r in seen) == [1, 1, 1, 1, 2, 2, 2, 2]
    for one in seen:
        _carried(one)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"embed_batchsize": 4},
            "unknown parameter 'embed_batchsize'; did you mean 'embed_batch_size'",
        ),
        ({"additional_kwarg": {}}, "did you mean 'additional_kwargs' (an alias of 'extra_body')"),
        (
            {"batch_size": 4, "embed_batch_size": 8},
            "pass either 'batch_size' or 'embed_batch_size'",
        ),
        ({"timeout": "60"}, "timeout must be a number of seconds, None, httpx.Timeout"),
        ({"api_version": "2024-01-01"}, "Azure OpenAI is not supported"),
        ({"reuse_client": False}, "only reuse_client=True"),
        ({"async_http_client": object()}, "'async_http_client' is not supported"),
    ],
)
def test_llama_index_unknown_names_get_a_hint(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(LlamaValidationError) as info:
        QwenPooledEmbedding(base_url=UNUSED_URL, **kwargs)
    assert message in str(info.value)
    assert "Extra inputs are not permitted" not in str(info.value)


@pytest.mark.unit
def test_llama_index_secret_headers_never_in_repr_dump_or_pickle() -> None:
    emb = _llama(UNUSED_URL)
    for text in (repr(emb), emb.to_json(), str(emb.to_dict()), str(emb.model_dump())):
        _no_secret(text)
        assert "acme" in text
    _no_secret(pickle.dumps(emb).decode("latin-1"))
    copy = pickle.loads(pickle.dumps(emb))
    assert copy.config.extra_body == BODY
    with pytest.raises(ConfigError, match="'X-Api-Key' looks like a credential"):
        copy.get_text_embedding("x")
    with pytest.raises(LlamaValidationError, match="holds the mask"):
        QwenPooledEmbedding.from_dict(emb.to_dict())


@pytest.mark.unit
@pytest.mark.parametrize("adapter", [QwenPooledEmbeddings, QwenPooledEmbedding])
def test_assignment_and_model_copy_keep_secret_headers_masked(adapter: Any) -> None:
    """Assignment and ``model_copy(update=...)`` skip pydantic's validation: the headers
    are still stored masked, and checked."""
    emb = adapter(base_url=UNUSED_URL)
    emb.headers = HEADERS
    copy = emb.model_copy(update={"headers": {"X-Api-Key": GATEWAY_SECRET + "-2"}})
    for one in (emb, copy):
        _no_secret(repr(one))
        _no_secret(pickle.dumps(one).decode("latin-1"))
    assert copy.config.headers["X-Api-Key"] == GATEWAY_SECRET + "-2"
    emb.extra_body = {"user": "u"}
    assert emb.config.extra_body == {"user": "u"}
    with pytest.raises(ConfigError, match="'model' is written by the client"):
        emb.extra_body = {"model": "other"}
    with pytest.raises(ConfigError, match="set by the client itself"):
        emb.model_copy(update={"headers": {"Content-Type": "text/plain"}})
