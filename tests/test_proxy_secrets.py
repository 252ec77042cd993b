"""Issue 20, case 6: proxy credentials (and ``user:password@`` in a base URL) are secrets.

A request goes through the loopback authenticating proxy with ``proxy=
"http://user:password@host:port"`` (sync, async, the SDK path, both adapters), and then
every repr, dump, pickle, log record (DEBUG, every logger), metric and error is searched
for the password. The URL shown is redacted: ``http://user:***@host:port``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins import QwenPooledEmbedding, QwenPooledEmbeddings
from qwen_embed_plugins._config import redact_url
from qwen_embed_tooling.testing import EmbeddingServer, LoopbackProxy, expected_embeddings

ALIAS = "embeddings.proxied.test"  # a host only the proxy reaches (never resolved)
USER = "svc-embed"
PASSWORD = "pr0xy-Pa55w0rd-7731"


@contextlib.contextmanager
def _behind_proxy() -> Iterator[tuple[EmbeddingServer, LoopbackProxy, str, str]]:
    """A server reachable only through an authenticating proxy: (server, proxy, base URL,
    proxy URL with credentials)."""
    with (
        EmbeddingServer() as srv,
        LoopbackProxy(aliases=(ALIAS,), auth=(USER, PASSWORD)) as proxy,
    ):
        try:
            authed = proxy.url.replace("http://", f"http://{USER}:{PASSWORD}@")
            yield srv, proxy, f"http://{ALIAS}:{srv.port}/v1", authed
        finally:
            q.close_all()


def _no_password(*things: object) -> None:
    for thing in things:
        text = thing if isinstance(thing, str) else repr(thing)
        if isinstance(thing, bytes):
            assert PASSWORD.encode() not in thing
        assert PASSWORD not in text, text


def _records_clean(caplog: pytest.LogCaptureFixture) -> None:
    assert caplog.records  # DEBUG of every logger was captured
    for record in caplog.records:
        _no_password(record.getMessage(), record.args, record.exc_text or "")


def _show(url: str) -> str:
    return url.replace(f":{PASSWORD}@", ":***@")


def test_requests_go_through_the_proxy_and_the_password_shows_nowhere(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)  # the root logger: third-party loggers included
    with _behind_proxy() as (srv, proxy, remote, authed):
        client = q.EmbeddingClient(base_url=remote, proxy=authed, trust_env=False)
        aclient = q.AsyncEmbeddingClient(client.config)
        sdk = client.openai_client()
        langchain = QwenPooledEmbeddings(base_url=remote, proxy=authed, trust_env=False)
        llama = QwenPooledEmbedding(base_url=remote, proxy=authed, trust_env=False)
        texts = ["through the proxy", "with credentials"]
        np.testing.assert_array_equal(
            client.embed_documents_array(texts), expected_embeddings(texts)
        )
        got = asyncio.run(aclient.embed_documents(texts))
        np.testing.assert_array_equal(np.asarray(got, np.float32), expected_embeddings(texts))
        sdk_answer = sdk.embeddings.create(input=["sdk"], model=q.DEFAULT_MODEL)
        assert len(sdk_answer.data[0].embedding) == 1024
        assert len(langchain.embed_query("lc")) == 1024
        assert len(asyncio.run(langchain.aembed_documents(["lc async"]))[0]) == 1024
        assert len(llama.get_text_embedding("li")) == 1024
        assert len(asyncio.run(llama.aget_query_embedding("li async"))) == 1024
        assert proxy.stats()["auth_failures"] == 0
        assert proxy.requests == srv.requests == 7
        assert set(proxy.targets) == {f"{ALIAS}:{srv.port}"}

        # the core: config, client, pool key, pickles, metrics
        shown = _show(authed)
        assert shown in repr(client.config)
        assert repr(client.config.proxy) == f"ProxyURL({shown!r})"
        assert str(client.config.proxy) == shown
        _no_password(
            repr(client.config),
            str(client.config),
            repr(client),
            repr(client.config.pool_key),
            pickle.dumps(client),
            pickle.dumps(aclient),
            pickle.dumps(client.config),
            q.stats(),
            q.pool_stats(),
        )
        # both adapters: repr, str, model_dump, model_dump_json, pickle (and LlamaIndex's
        # to_dict / to_json / event payload)
        for adapter in (langchain, llama):
            assert adapter.model_dump()["proxy"] == shown
            _no_password(
                repr(adapter),
                str(adapter),
                adapter.model_dump(),
                adapter.model_dump_json(),
                pickle.dumps(adapter),
            )
        _no_password(llama.to_dict(), llama.to_json(), llama.to_payload())
        # assigning a new proxy keeps it hidden too
        langchain.proxy = authed
        llama.proxy = authed
        _no_password(repr(langchain), repr(llama), langchain.model_dump_json())
    _records_clean(caplog)


def test_a_refused_password_fails_without_showing_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "wr0ng-Pa55w0rd-1234"
    with _behind_proxy() as (srv, proxy, remote, authed):
        bad = authed.replace(PASSWORD, wrong)
        fast = q.RetryConfig(max_attempts=1, deadline=5.0, query_deadline=5.0)
        errors: list[BaseException] = []
        with pytest.raises(q.QwenEmbedError) as info:
            q.EmbeddingClient(base_url=remote, proxy=bad, trust_env=False, retry=fast).embed_query(
                "x"
            )
        errors.append(info.value)
        with pytest.raises(q.QwenEmbedError) as ainfo:
            asyncio.run(
                q.AsyncEmbeddingClient(
                    base_url=remote, proxy=bad, trust_env=False, retry=fast
                ).embed_query("x")
            )
        errors.append(ainfo.value)
        assert proxy.stats()["auth_failures"] >= 2
        assert srv.requests == 0
    for error in errors:
        chain: list[BaseException] = []
        current: BaseException | None = error
        while current is not None and len(chain) < 10:
            chain.append(current)
            current = current.__cause__ or current.__context__
        for exc in chain:
            assert wrong not in str(exc)
            assert wrong not in repr(exc)
        assert wrong.encode() not in pickle.dumps(error)
    for record in caplog.records:
        assert wrong not in record.getMessage()


def test_an_unreachable_proxy_fails_without_showing_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = f"http://{USER}:{PASSWORD}@127.0.0.1:{port}"
    fast = q.RetryConfig(max_attempts=1, deadline=1.0, query_deadline=1.0)
    remote = f"http://{ALIAS}:8000/v1"
    errors: list[BaseException] = []
    for make in (
        lambda: q.EmbeddingClient(base_url=remote, proxy=dead, retry=fast).embed_query("x"),
        lambda: asyncio.run(
            q.AsyncEmbeddingClient(base_url=remote, proxy=dead, retry=fast).embed_query("x")
        ),
    ):
        with pytest.raises(q.TransportError) as info:
            make()
        errors.append(info.value)
    for error in errors:
        current: BaseException | None = error
        while current is not None:
            _no_password(str(current), current.args)
            current = current.__cause__ or current.__context__
        _no_password(pickle.dumps(error))
    _records_clean(caplog)


def test_pickles_take_the_password_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Like the API key: a pickle holds no proxy password; the unpickled copy takes the
    proxy URL from QWEN_EMBED_PROXY (or HTTP(S)_PROXY) when it names the same proxy and
    user, else keeps the redacted URL, which the proxy refuses."""
    with _behind_proxy() as (_srv, proxy, remote, authed):
        client = q.EmbeddingClient(base_url=remote, proxy=authed, trust_env=False)
        langchain = QwenPooledEmbeddings(base_url=remote, proxy=authed, trust_env=False)
        llama = QwenPooledEmbedding(base_url=remote, proxy=authed, trust_env=False)
        frozen = [pickle.dumps(x) for x in (client, langchain, llama)]
        for data in frozen:
            assert PASSWORD.encode() not in data

        monkeypatch.setenv("QWEN_EMBED_PROXY", authed)
        thawed: list[Any] = [pickle.loads(data) for data in frozen]
        assert thawed[0].config.proxy == client.config.proxy
        assert len(thawed[0].embed_query("again")) == 1024
        assert len(thawed[1].embed_query("again lc")) == 1024
        assert len(thawed[2].get_query_embedding("again li")) == 1024
        assert proxy.stats()["auth_failures"] == 0

        monkeypatch.delenv("QWEN_EMBED_PROXY")
        monkeypatch.setenv("HTTP_PROXY", authed)  # the standard variable serves too
        assert pickle.loads(frozen[0]).config.proxy == client.config.proxy

        monkeypatch.delenv("HTTP_PROXY")
        orphan = pickle.loads(frozen[0])
        assert str(orphan.config.proxy) == _show(authed)
        fast = q.RetryConfig(max_attempts=1, deadline=5.0, query_deadline=5.0)
        with pytest.raises(q.QwenEmbedError):
            q.EmbeddingClient(orphan.config, retry=fast).embed_query("refused")
        assert proxy.stats()["auth_failures"] >= 1


def test_environment_proxy_with_credentials_is_not_shown(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with _behind_proxy() as (_srv, proxy, remote, authed):
        monkeypatch.setenv("HTTP_PROXY", authed)
        monkeypatch.delenv("NO_PROXY", raising=False)
        client = q.EmbeddingClient(base_url=remote)
        assert len(client.embed_query("from the environment")) == 1024
        assert proxy.requests == 1
        assert proxy.stats()["auth_failures"] == 0
        _no_password(repr(client.config), repr(client.config.pool_key), pickle.dumps(client))
        monkeypatch.setenv("QWEN_EMBED_PROXY", authed)
        from_env = q.EmbeddingConfig(base_url=remote)
        assert isinstance(from_env.proxy, q.ProxyURL)
        _no_password(repr(from_env))
    _records_clean(caplog)


@pytest.mark.parametrize(
    "base_url",
    [
        f"http://{USER}:{PASSWORD}@gpu-box:30000/v1",
        f"http://gpu-a:30000/v1,http://{USER}:{PASSWORD}@gpu-b:30000/v1",
        f"http://{PASSWORD}@gpu-box:30000/v1",
    ],
)
def test_credentials_in_a_base_url_are_refused_without_showing_them(
    base_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    failures: list[BaseException] = []
    for make in (
        lambda: q.EmbeddingConfig(base_url=base_url),
        lambda: q.EmbeddingClient(base_url=base_url),
        lambda: QwenPooledEmbeddings(base_url=base_url),
        lambda: QwenPooledEmbedding(base_url=base_url),
    ):
        with pytest.raises(ValueError, match="credentials") as info:
            make()
        failures.append(info.value)
    monkeypatch.setenv("QWEN_EMBED_BASE_URL", base_url)
    for make in (q.EmbeddingConfig, QwenPooledEmbeddings, QwenPooledEmbedding):
        with pytest.raises(ValueError, match="credentials") as info:
            make()
        failures.append(info.value)
    for exc in failures:
        _no_password(str(exc), repr(exc))
        if hasattr(exc, "errors"):  # pydantic's ValidationError keeps the inputs
            _no_password(exc.errors())


def test_redaction_rules() -> None:
    assert redact_url("http://u:p@h:1") == "http://u:***@h:1"
    assert redact_url("http://token@h:1/x") == "http://***@h:1/x"
    assert redact_url("http://h:1") == "http://h:1"
    plain = q.EmbeddingConfig(base_url="http://gpu:1/v1", proxy="http://proxy:3128")
    assert plain.proxy == "http://proxy:3128"  # nothing secret: kept as given
