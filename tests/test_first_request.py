"""What a client prepares before its first request (issue 32 item 5), without sockets:
the SSL context of an ``https://`` endpoint is built on a background thread when the
client or adapter is built, and the LlamaIndex adapter's event payload is not worked
out again on every call."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import certifi
import pytest

from qwen_embed_plugins import AsyncEmbeddingClient, EmbeddingClient, QwenPooledEmbedding
from qwen_embed_plugins._state import STATE

pytestmark = pytest.mark.unit


def _join_tls_threads() -> None:
    for thread in threading.enumerate():
        if thread.name == "qwen-embed-tls":
            thread.join()


def _bundle(tmp_path: Path, text: str | None = None) -> str:
    """A CA bundle path of this test only (its own key among the cached contexts)."""
    path = tmp_path / "bundle.pem"
    if text is None:
        shutil.copyfile(certifi.where(), path)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("cls", [EmbeddingClient, AsyncEmbeddingClient, QwenPooledEmbedding])
def test_building_a_client_prepares_the_tls_context_of_each_https_replica(
    tmp_path: Path, cls: type
) -> None:
    ca = _bundle(tmp_path)
    urls = ["https://a.invalid/v1", "https://b.invalid/v1"]
    assert not [k for k in STATE.ssl_contexts if k[0] == ca]
    model = {"model_name": "m"} if cls is QwenPooledEmbedding else {"model": "m"}
    cls(base_url=urls, verify=ca, **model)
    _join_tls_threads()
    # one context per setting, shared by both replicas; nothing was connected
    assert [k for k in STATE.ssl_contexts if k[0] == ca] == [(ca, False, False)]


def test_clients_built_at_once_share_one_build(tmp_path: Path) -> None:
    # a bundle that takes a while to load (certifi's roots 30 times): the clients below
    # are built while the first build runs, and must not start builds of their own
    ca = _bundle(tmp_path, Path(certifi.where()).read_text(encoding="utf-8") * 30)
    before = {t.ident for t in threading.enumerate()}
    for _ in range(50):
        EmbeddingClient(base_url="https://a.invalid/v1", model="m", verify=ca)
    started = [t for t in threading.enumerate() if t.ident not in before]
    assert len([t for t in started if t.name == "qwen-embed-tls"]) <= 1
    _join_tls_threads()
    assert (ca, False, False) in STATE.ssl_contexts
    assert not STATE.ssl_pending


def test_a_cleartext_endpoint_starts_no_thread(tmp_path: Path) -> None:
    before = {t.ident for t in threading.enumerate()}
    EmbeddingClient(base_url="http://127.0.0.1:9/v1", model="m", verify=_bundle(tmp_path))
    started = [t for t in threading.enumerate() if t.ident not in before]
    assert not [t for t in started if t.name == "qwen-embed-tls"]


def test_a_bundle_that_fails_to_load_is_left_to_the_first_request(tmp_path: Path) -> None:
    # not PEM: the background build fails quietly (no thread exception: pytest would
    # report one), builds nothing, and the request path raises where the caller sees it
    ca = _bundle(tmp_path, "not a certificate\n")
    seen: list[BaseException | None] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: seen.append(args.exc_value)
    try:
        EmbeddingClient(base_url="https://a.invalid/v1", model="m", verify=ca)
        _join_tls_threads()
    finally:
        threading.excepthook = previous
    assert seen == []
    assert not [k for k in STATE.ssl_contexts if k[0] == ca]


def test_the_llama_index_payload_follows_the_endpoint() -> None:
    model = QwenPooledEmbedding(base_url="http://127.0.0.1:9/v1/", model_name="m")
    assert model.to_payload()["base_url"] == "http://127.0.0.1:9/v1"
    assert model.to_payload() == model.to_payload()
    model.base_url = "http://127.0.0.1:10/v1"
    assert model.to_payload()["base_url"] == "http://127.0.0.1:10/v1"
    # a path that skips assignment (the copy shares the memo of the original)
    copy = model.model_copy(update={"base_url": "http://127.0.0.1:11/v1"})
    assert copy.to_payload()["base_url"] == "http://127.0.0.1:11/v1"
    assert model.to_payload()["base_url"] == "http://127.0.0.1:10/v1"
    assert copy.to_payload()["base_url"] == copy.config.endpoint
