"""API keys: a callable key called for each request (issue 32.1), a key given in code
in LlamaIndex's worker processes (issue 30.6), credential headers by common names
(issue 31.6).

What each request carried is read at a loopback `RecordingServer` (its
``Authorization`` header); HTTP/2 at an h2-only `EmbeddingServer` that takes one key.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from recording_server import RecordingServer

import qwen_embed_plugins as q
from qwen_embed_plugins import AsyncEmbeddingClient, EmbeddingClient, EmbeddingConfig
from qwen_embed_plugins._config import is_secret_header
from qwen_embed_plugins.integrations.langchain import QwenPooledEmbeddings
from qwen_embed_plugins.integrations.llama_index import QwenPooledEmbedding
from qwen_embed_tooling.testing import EmbeddingServer

UNUSED_URL = "http://127.0.0.1:9/v1"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("QWEN_EMBED_API_KEY", "QWEN_EMBED_BASE_URL", "QWEN_EMBED_MODEL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def rec() -> Iterator[RecordingServer]:
    with RecordingServer() as server:
        yield server


class Rotating:
    """A key provider whose key changes at every call: ``rk-<tag>-0``, ``-1``, ..."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.calls = 0

    def __call__(self) -> str:
        key = f"rk-{self.tag}-{self.calls}"
        self.calls += 1
        return key

    async def acall(self) -> str:
        return self()

    def given(self) -> list[str]:
        return [f"Bearer rk-{self.tag}-{i}" for i in range(self.calls)]


def _sent(rec: RecordingServer) -> list[str | None]:
    return [r.headers.get("authorization") for r in rec.received]


def _one_pool(base_url: str) -> None:
    label = base_url
    row = q.pool_stats()[label]
    assert row["pools"] == 1, row  # the key is not part of the pool key


# ----------------------------------------------------------------------- callable keys


def test_a_sync_callable_is_called_for_each_request(rec: RecordingServer) -> None:
    key = Rotating("sync")
    config = EmbeddingConfig(base_url=rec.base_url, api_key=key, batch_size=1, max_concurrency=1)
    client = EmbeddingClient(config)
    client.embed_documents(["a", "b", "c"])
    client.embed_query("q")
    assert key.calls == 4
    assert _sent(rec) == key.given()  # each request carried the key of its own call
    _one_pool(rec.base_url)
    assert q.pool_stats()[rec.base_url]["connections_opened"] == 1  # one keep-alive socket
    assert "rk-" not in repr(config)
    assert "Rotating" not in repr(config)
    assert "rk-" not in repr(client)


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_the_async_client_awaits_or_runs_the_callable_per_request(
    rec: RecordingServer, kind: str
) -> None:
    key = Rotating(kind)
    function: Callable[[], Any] = key.acall if kind == "async" else key
    config = EmbeddingConfig(
        base_url=rec.base_url, api_key=function, batch_size=1, max_concurrency=1
    )
    client = AsyncEmbeddingClient(config)

    async def main() -> None:
        await client.embed_documents(["a", "b"])
        await client.embed_query("q")

    asyncio.run(main())
    assert key.calls == 3
    assert sorted(_sent(rec)) == sorted(key.given())  # requests may run concurrently
    _one_pool(rec.base_url)


def test_a_rotated_key_is_used_at_once_over_http2() -> None:
    """An h2-only server that takes one key: the callable's wrong key is refused, the
    rotated one is taken by the next call of the same client, on the same pool."""
    keys = ["rk-h2-wrong", "rk-h2-good", "rk-h2-good"]
    calls: list[str] = []

    def key() -> str:
        calls.append(keys[len(calls)])
        return calls[-1]

    with EmbeddingServer(http2=True, h2_only=True, api_key="rk-h2-good") as server:
        config = EmbeddingConfig(
            base_url=server.base_url, api_key=key, http2=True, retry=q.RetryConfig(max_attempts=1)
        )
        client = EmbeddingClient(config)
        with pytest.raises(q.AuthenticationError) as info:
            client.embed_query("refused")
        assert "rk-h2-wrong" not in "".join(traceback.format_exception(info.value))
        assert len(client.embed_query("taken")) == server.dim
        assert asyncio.run(AsyncEmbeddingClient(config).embed_query("taken")) is not None
        assert calls == keys
        assert server.requests == 3
        assert server.stats()["faults_applied"].get("h1_refused", 0) == 0  # HTTP/2 only
        assert q.pool_stats()[server.base_url]["pools"] == 1


def test_openai_client_calls_the_key_per_request(rec: RecordingServer) -> None:
    key = Rotating("sdk")
    config = EmbeddingConfig(base_url=rec.base_url, api_key=key)
    sdk = EmbeddingClient(config).openai_client()
    sdk.embeddings.create(input=["a"], model="m")
    sdk.embeddings.create(input=["b"], model="m")
    asdk = AsyncEmbeddingClient(config).openai_client()
    asyncio.run(asdk.embeddings.create(input=["c"], model="m"))
    assert sorted(_sent(rec)) == sorted(key.given()) == [f"Bearer rk-sdk-{i}" for i in range(3)]


@pytest.mark.parametrize("name", ["api_key", "openai_api_key"])
def test_langchain_takes_a_callable_key(rec: RecordingServer, name: str) -> None:
    key = Rotating("lc")
    emb = QwenPooledEmbeddings(
        base_url=rec.base_url, batch_size=1, max_concurrency=1, **{name: key}
    )
    emb.embed_documents(["a", "b"])
    asyncio.run(emb.aembed_query("q"))
    assert sorted(_sent(rec)) == sorted(key.given())  # requests may run concurrently
    assert key.calls == 3
    _one_pool(rec.base_url)
    for shown in (repr(emb), str(emb.model_dump()), emb.model_dump_json(), repr(emb.config)):
        assert "rk-" not in shown
        assert "Rotating" not in shown
    data = pickle.dumps(emb)
    assert b"rk-lc" not in data
    assert b"Rotating" not in data
    assert pickle.loads(data).api_key is emb.api_key  # found again in this process


def test_llama_index_takes_a_callable_key(rec: RecordingServer) -> None:
    key = Rotating("li")
    model = QwenPooledEmbedding(base_url=rec.base_url, embed_batch_size=1, api_key=key)
    model.get_text_embedding_batch(["a", "b"])
    asyncio.run(model.aget_query_embedding("q"))
    assert sorted(_sent(rec)) == sorted(key.given())  # requests may run concurrently
    assert key.calls == 3
    _one_pool(rec.base_url)
    for shown in (repr(model), str(model.to_dict()), model.to_json()):
        assert "rk-" not in shown
        assert "Rotating" not in shown
    data = pickle.dumps(model)
    assert b"rk-li" not in data
    assert b"Rotating" not in data


def test_an_async_callable_on_the_sync_path_is_refused_before_sending(
    rec: RecordingServer,
) -> None:
    """As ``langchain-openai``: an async key serves the async methods only."""
    key = Rotating("a")
    for target in (
        lambda: EmbeddingClient(base_url=rec.base_url, api_key=key.acall).embed_query("x"),
        lambda: QwenPooledEmbeddings(base_url=rec.base_url, api_key=key.acall).embed_query("x"),
        lambda: QwenPooledEmbedding(base_url=rec.base_url, api_key=key.acall).get_text_embedding(
            "x"
        ),
    ):
        with pytest.raises(q.ConfigError, match="async callable, which the sync methods cannot"):
            target()
    assert rec.received == []
    assert key.calls == 0


class _Boom(Exception):
    pass


def _raises() -> str:
    raise _Boom("token service down")


@pytest.mark.parametrize(
    ("function", "message"),
    [
        (_raises, "the key callable raised _Boom; nothing was sent"),
        (lambda: None, "returned NoneType, not a non-empty str"),
        (lambda: b"rk-bytes", "returned bytes, not a non-empty str"),
        (lambda: "  ", "returned an empty str"),
        (lambda: "rk bad", "whitespace, control or non-ASCII"),
    ],
)
@pytest.mark.parametrize("path", ["sync", "async"])
def test_a_callable_that_fails_is_a_clear_error(
    rec: RecordingServer, function: Callable[[], Any], message: str, path: str
) -> None:
    config = EmbeddingConfig(base_url=rec.base_url, api_key=function)

    def call() -> object:
        if path == "sync":
            return EmbeddingClient(config).embed_documents(["x", "y"])
        return asyncio.run(AsyncEmbeddingClient(config).embed_documents(["x", "y"]))

    with pytest.raises(q.ConfigError, match=message) as info:
        call()
    assert rec.received == []
    if function is _raises:
        assert isinstance(info.value.__cause__, _Boom)  # the provider's own error, chained


def test_a_rotated_key_echoed_by_the_server_is_scrubbed(caplog: pytest.LogCaptureFixture) -> None:
    """A server quoting the request's headers in its error: every key the callable gave
    is scrubbed from the error, its traceback, its pickle and the logs."""
    caplog.set_level(logging.DEBUG)
    key = Rotating("echo")
    with RecordingServer(echo="error", status=401) as server:
        config = EmbeddingConfig(base_url=server.base_url, api_key=key)
        for call in (
            lambda: EmbeddingClient(config).embed_query("x"),
            lambda: asyncio.run(AsyncEmbeddingClient(config).embed_query("x")),
        ):
            with pytest.raises(q.AuthenticationError) as info:
                call()
            shown = [
                str(info.value),
                repr(info.value),
                "".join(traceback.format_exception(info.value)),
                pickle.dumps(info.value).decode("latin-1"),
            ]
            assert all("rk-echo" not in text for text in shown)
    assert key.calls == 2
    assert "rk-echo" not in caplog.text


def test_ray_refuses_a_callable_key() -> None:
    qray = pytest.importorskip("qwen_embed_plugins.ray")
    with pytest.raises(q.ConfigError, match="api_key as a callable cannot reach Ray workers"):
        qray.embed_dataset(None, base_url=UNUSED_URL, api_key=Rotating("ray"))


# ----------------------------------------------------------------------- credential headers

SECRET_HEADERS = [
    # named in issue 31
    "Ocp-Apim-Subscription-Key",
    "x-functions-key",
    "Authorization",
    "Proxy-Authorization",
    "Cookie",
    "api-key",
    # members the issue did not name
    "X-Api-Key",
    "x-goog-api-key",
    "X-Gateway-Key",
    "apikey",
    "X-Auth-Token",
    "Private-Token",
    "x-amz-security-token",
    "X-Client-Secret",
    "X-Vault-Secret",
    "X-Subscription-Token",
    "X-Session-Id",
    "X-Signature",
    "X-Password",
]
PLAIN_HEADERS = ["X-Tenant", "X-Request-Id", "User-Agent", "X-Model-Route", "OpenAI-Beta"]


@pytest.mark.unit
def test_credential_headers_are_known_by_their_common_names() -> None:
    assert [h for h in SECRET_HEADERS if not is_secret_header(h)] == []
    assert [h for h in SECRET_HEADERS if not is_secret_header(h.upper())] == []
    assert [h for h in PLAIN_HEADERS if is_secret_header(h)] == []


@pytest.mark.unit
def test_credential_header_values_never_in_repr_or_pickle() -> None:
    headers = {name: f"zzval{i}zz" for i, name in enumerate(SECRET_HEADERS)}
    headers.pop("Authorization")  # refused with api_key; shown below without one
    headers.update({name: f"plain-{name.lower()}" for name in PLAIN_HEADERS})
    config = EmbeddingConfig(base_url=UNUSED_URL, api_key="sk-hdr", headers=headers)
    keyless = EmbeddingConfig(base_url=UNUSED_URL, headers={"Authorization": "Basic zzvalbasiczz"})
    adapters = (
        QwenPooledEmbeddings(base_url=UNUSED_URL, default_headers=headers),
        QwenPooledEmbedding(base_url=UNUSED_URL, default_headers=headers),
    )
    texts = [repr(config), repr(keyless), *(repr(a) for a in adapters)]
    texts += [str(a.model_dump()) for a in adapters]
    blobs = [pickle.dumps(config), pickle.dumps(keyless), *(pickle.dumps(a) for a in adapters)]
    texts += [blob.decode("latin-1") for blob in blobs]
    for text in texts:
        assert "zzval" not in text
    assert all(f"plain-{name.lower()}" in repr(config) for name in PLAIN_HEADERS)
    assert pickle.loads(pickle.dumps(config)).headers.withheld() == [
        name for name in headers if is_secret_header(name)
    ]


# ----------------------------------------------------------------------- worker processes

WORKER_KEY = "sk-ingestion-workers-5c1e"


def _pipeline(base_url: str, api_key: Any) -> Any:
    from llama_index.core.ingestion import IngestionPipeline

    model = QwenPooledEmbedding(base_url=base_url, api_key=api_key, embed_batch_size=2)
    return IngestionPipeline(transformations=[model], disable_cache=True)


def _nodes() -> list[Any]:
    from llama_index.core.schema import TextNode

    return [TextNode(text=f"chunk {i}", id_=f"n{i}") for i in range(8)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["str", "callable"])
def test_a_key_in_code_reaches_forked_ingestion_workers(kind: str) -> None:
    """Issue 30.6: ``IngestionPipeline.arun(num_workers=2)`` starts its workers with the
    platform's default start method (``fork`` on Linux before Python 3.14): the key given
    in code reaches them (found in the registry the fork inherited), the pickle holds no
    key. Where the default is not ``fork``, every request refuses first (no request
    without the key)."""
    import multiprocessing

    key = WORKER_KEY if kind == "str" else (lambda: WORKER_KEY)
    with EmbeddingServer(api_key=WORKER_KEY) as server:
        pipeline = _pipeline(server.base_url, key)
        if multiprocessing.get_start_method() == "fork":
            out = asyncio.run(pipeline.arun(nodes=_nodes(), num_workers=2))
            assert sorted(n.id_ for n in out) == [f"n{i}" for i in range(8)]
            assert all(len(n.embedding) == server.dim for n in out)
            assert server.stats()["responses"].get("401", 0) == 0
        else:
            with pytest.raises(q.ConfigError, match="set QWEN_EMBED_API_KEY"):
                asyncio.run(pipeline.arun(nodes=_nodes(), num_workers=2))
            assert server.requests == 0


@pytest.mark.slow
def test_spawned_ingestion_workers_refuse_before_sending(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``IngestionPipeline.run(num_workers=2)`` always spawns its workers, which inherit
    no memory: with the key given in code and no ``QWEN_EMBED_API_KEY``, the call raises
    the library's ``ConfigError`` naming that variable, and no request is sent; with the
    variable set (the fix it names), the workers use it."""
    with EmbeddingServer(api_key=WORKER_KEY) as server:
        pipeline = _pipeline(server.base_url, WORKER_KEY)
        with pytest.raises(q.ConfigError, match="set QWEN_EMBED_API_KEY") as info:
            pipeline.run(nodes=_nodes(), num_workers=2)
        assert WORKER_KEY not in "".join(traceback.format_exception(info.value))
        assert server.requests == 0
        monkeypatch.setenv("QWEN_EMBED_API_KEY", WORKER_KEY)
        out = pipeline.run(nodes=_nodes(), num_workers=2)
        assert all(len(n.embedding) == server.dim for n in out)
        assert server.stats()["responses"].get("401", 0) == 0


def test_a_callable_key_over_plain_http_warns_or_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The plain-HTTP rule of a fixed key holds for a callable one: ``insecure_key=
    "error"`` refuses it at once, ``"warn"`` logs once when a call starts."""
    remote = "http://192.0.2.1:9/v1"  # TEST-NET-1: never reached (the call fails first)
    with pytest.raises(q.ConfigError, match="plain HTTP"):
        EmbeddingConfig(base_url=remote, api_key=Rotating("http"), insecure_key="error")
    caplog.set_level(logging.WARNING, logger="qwen_embed_plugins")
    key = Rotating("http")
    client = EmbeddingClient(
        EmbeddingConfig(
            base_url=remote,
            api_key=key.acall,  # async: the sync call refuses before any connection
            proxy=None,
            trust_env=False,
        )
    )
    with pytest.raises(q.ConfigError, match="async callable"):
        client.embed_query("x")
    assert "the API key goes over plain HTTP" in caplog.text
    assert "rk-http" not in caplog.text
