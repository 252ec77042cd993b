"""What the two framework adapters share, tested on both: the flat fields declared once
(``FlatSettings``), ``config=EmbeddingConfig(...)`` next to them, and the one client
cache / rebuild / pickle helper.

The wire is read at the loopback ``RecordingServer`` (headers and body of each request).
"""

from __future__ import annotations

import asyncio
import copy
import gc
import io
import pickle
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import SecretStr, ValidationError
from recording_server import RecordingServer

import qwen_embed_plugins as q
from qwen_embed_plugins.integrations._common import FlatSettings
from qwen_embed_plugins.integrations.langchain import QwenPooledEmbeddings
from qwen_embed_plugins.integrations.llama_index import QwenPooledEmbedding

SECRET = "sk-adapters-0123456789"
GATEWAY_SECRET = "gw-adapters-9f8e7d6c"
UNUSED_URL = "http://127.0.0.1:9/v1"
ADAPTERS = [QwenPooledEmbeddings, QwenPooledEmbedding]
Adapter = QwenPooledEmbeddings | QwenPooledEmbedding


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("QWEN_EMBED_API_KEY", "QWEN_EMBED_BASE_URL", "QWEN_EMBED_MODEL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def rec() -> Iterator[RecordingServer]:
    with RecordingServer() as server:
        yield server


def _embed_all(emb: Adapter, texts: list[str]) -> None:
    """Documents and a query, sync and async, through the adapter's own API."""
    if isinstance(emb, QwenPooledEmbeddings):
        emb.embed_documents(texts)
        emb.embed_query("q")
        asyncio.run(emb.aembed_documents(texts))
        asyncio.run(emb.aembed_query("q"))
        return

    async def run() -> None:
        await emb.aget_text_embedding_batch(texts)
        await emb.aget_query_embedding("q")

    emb.get_text_embedding_batch(texts)
    emb.get_query_embedding("q")
    asyncio.run(run())


def _config(base_url: str, **changes: Any) -> q.EmbeddingConfig:
    """A config with every part away from its default (including the parts no flat
    field holds)."""
    settings: dict[str, Any] = {
        "base_url": base_url,
        "api_key": SECRET,
        "model": "Qwen/Qwen3-Embedding-4B",
        "dimensions": 256,
        "query_instruction": "Given a question, find code",
        "batch_size": 2,
        "max_batch_tokens": 5000,
        "max_concurrency": 3,
        "encoding_format": "float",
        "normalize": False,
        "max_text_chars": 9000,
        "append_eos": False,
        "max_response_bytes": 1 << 20,
        "timeout": q.Timeouts(connect=1.5, read=7.0, write=3.0, pool=4.0, total=9.0),
        "limits": q.Limits(
            max_connections=6,
            max_keepalive_connections=2,
            keepalive_expiry=1.5,
            max_connections_per_process=9,
        ),
        "retry": q.RetryConfig(
            max_retries=1, max_attempts=2, backoff_initial=0.01, backoff_max=0.02, deadline=50.0
        ),
        "http2": False,
        "proxy": None,
        "trust_env": False,
        "insecure_key": "allow",
        "hedge": True,
        "server": "vllm",
        "headers": {"X-Tenant": "acme", "X-Api-Key": GATEWAY_SECRET},
        "extra_body": {"user": "u-7"},
    }
    settings.update(changes)
    return q.EmbeddingConfig(**settings)


# ----------------------------------------------------------------------- declared once


@pytest.mark.unit
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_the_flat_fields_are_declared_once(adapter: type[Adapter]) -> None:
    shared = FlatSettings.model_fields
    fields = adapter.model_fields
    assert set(shared) <= set(fields)
    for name, info in shared.items():
        assert fields[name].description == info.description, name
        assert fields[name].annotation == info.annotation, name
    own = {"model", "batch_size"} if adapter is QwenPooledEmbeddings else set()
    own |= {"model_name", "embed_batch_size"} if adapter is QwenPooledEmbedding else set()
    assert own <= set(fields)
    assert {"model", "model_name"} & set(fields) == {"model", "model_name"} & own


@pytest.mark.unit
def test_every_shared_field_has_a_docstring_whose_default_is_the_real_one() -> None:
    emb = QwenPooledEmbeddings(base_url=UNUSED_URL)
    documented = 0
    for name, info in FlatSettings.model_fields.items():
        assert info.description, f"{name} has no docstring"
        match = re.search(r"\(default ([\d.,]+|None|True|False)\b", info.description)
        if match is None:
            continue
        text = match.group(1).replace(",", "")
        expected = {"None": None, "True": True, "False": False}.get(text, text)
        value = getattr(emb, name)
        assert (str(value) if isinstance(expected, str) else value) == expected, name
        documented += 1
    assert documented >= 15


# ----------------------------------------------------------------------------- config=


@pytest.mark.unit
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_config_is_the_effective_config(
    adapter: type[Adapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the environment does not override a config's values (the config read it already)
    monkeypatch.setenv("QWEN_EMBED_BATCH_SIZE", "17")
    monkeypatch.setenv("QWEN_EMBED_MODEL", "from-the-environment")
    config = _config(UNUSED_URL)
    emb = adapter(config=config)
    assert emb.config == config
    assert emb.config.api_key_value() == SECRET
    assert emb.dimensions == 256
    assert emb.max_retries == 1
    assert emb.proxy is None
    assert emb.config.proxy is None  # "no proxy", not "from the environment"
    assert SECRET not in repr(emb)
    assert GATEWAY_SECRET not in repr(emb)
    assert emb.config == adapter(config=config, api_key=SECRET).config


@pytest.mark.unit
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_flat_field_given_with_config_overrides_it(adapter: type[Adapter]) -> None:
    config = _config(UNUSED_URL)
    emb = adapter(config=config, dimensions=128, read_timeout=2.0, max_retries=0, timeout=5.0)
    assert emb.config == config.replace(
        dimensions=128,
        # timeout=: every phase and the total; read_timeout= given too overrides its part
        timeout=q.Timeouts(connect=5.0, read=2.0, write=5.0, pool=5.0, total=5.0),
        retry=config.retry.replace(max_retries=0),
    )
    # the adapter's own names for model / batch size, and their aliases
    names = (
        {"model": "m-flat", "batch_size": 5}
        if adapter is QwenPooledEmbeddings
        else {"model_name": "m-flat", "embed_batch_size": 5}
    )
    for given in (names, {"model": "m-flat", "batch_size": 5}):
        other = adapter(config=config, **given)
        assert (other.config.model, other.config.batch_size) == ("m-flat", 5)
        assert other.config.max_response_bytes == config.max_response_bytes
    keyless = adapter(config=config, api_key=None)
    assert keyless.config == config.replace(api_key=None)


@pytest.mark.unit
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_config_must_be_an_embedding_config(adapter: type[Adapter]) -> None:
    with pytest.raises((q.ConfigError, ValidationError), match="config must be an EmbeddingConfig"):
        adapter(config={"base_url": UNUSED_URL})
    with pytest.raises((q.ConfigError, ValidationError), match="did you mean 'config'"):
        adapter(base_url=UNUSED_URL, confg=_config(UNUSED_URL))
    with pytest.raises((q.ConfigError, ValidationError), match="dimensions"):  # still checked
        adapter(config=_config(UNUSED_URL), dimensions=100_000)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_config_reaches_the_wire_sync_and_async(
    adapter: type[Adapter], rec: RecordingServer
) -> None:
    config = _config(rec.base_url, dimensions=None, model="m-config")
    emb = adapter(config=config, extra_body={"user": "u-flat"})
    _embed_all(emb, ["one", "two", "three", "four"])
    seen = rec.all()
    assert sorted(len(r.body["input"]) for r in seen) == [1, 1, 2, 2, 2, 2]  # batch_size=2
    for one in seen:
        assert one.body["model"] == "m-config"
        assert "encoding_format" not in one.body  # float: the API's default, not sent
        assert one.body["user"] == "u-flat"  # the flat field given overrides the config
        assert one.headers["authorization"] == f"Bearer {SECRET}"
        assert one.headers["x-tenant"] == "acme"
        assert one.headers["x-api-key"] == GATEWAY_SECRET
    queries = [r.body["input"][0] for r in seen if len(r.body["input"]) == 1]
    assert queries == [q.format_query("q", "Given a question, find code")] * 2


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_config_parts_without_a_field_apply_and_survive_copies_and_pickles(
    adapter: type[Adapter], rec: RecordingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``max_response_bytes`` has no flat field: a 3 x 1024-float answer is over 4 KiB."""
    config = _config(
        rec.base_url, dimensions=None, max_response_bytes=4096, batch_size=8, headers=None
    )
    monkeypatch.setenv("QWEN_EMBED_API_KEY", SECRET)
    emb = adapter(config=config)
    for one in (
        emb,
        copy.copy(emb),
        copy.deepcopy(emb),
        emb.model_copy(update={"dimensions": None}),
        pickle.loads(pickle.dumps(emb)),
    ):
        assert one.config == config
        embed = (
            one.embed_documents
            if isinstance(one, QwenPooledEmbeddings)
            else one.get_text_embedding_batch
        )
        with pytest.raises(q.ResponseError, match="4,096 bytes"):
            embed(["a", "b", "c"])
    # the flat fields alone do not hold it: a dump is the fields (documented)
    dumped = emb.model_dump(exclude={"api_key"})
    if isinstance(emb, QwenPooledEmbedding):
        dumped = {k: v for k, v in emb.to_dict().items() if k != "class_name"}
    assert adapter(**dumped).config.max_response_bytes is None


# --------------------------------------------------- the cache, rebuild and pickle helper


@pytest.mark.unit
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_clients_are_built_lazily_and_rebuilt_after_a_change(adapter: type[Adapter]) -> None:
    emb = adapter(base_url=UNUSED_URL)
    first = emb.config
    assert emb.config is first  # cached
    emb.dimensions = 64  # assignment: rebuilt and checked at once
    assert emb.config.dimensions == 64
    with pytest.raises(q.ConfigError, match="dimensions"):
        emb.dimensions = 5_000
    assert emb.dimensions == 64  # rolled back
    emb.api_key = SECRET  # a str is kept as a SecretStr on both adapters
    assert isinstance(emb.api_key, SecretStr)
    assert SECRET not in repr(emb)
    assert emb.config.api_key_value() == SECRET
    copied = emb.model_copy(update={"dimensions": 32})  # skips __setattr__: rebuilt on use
    assert copied.config.dimensions == 32
    assert emb.config.dimensions == 64


def _classes_in(blob: bytes) -> set[tuple[str, str]]:
    """The classes a pickle names (so: no client, engine, pool, socket or key type)."""
    found: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found.add((module, name))
            return super().find_class(module, name)

    Recorder(io.BytesIO(blob)).load()
    return found


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_pickles_hold_neither_the_key_nor_clients(
    adapter: type[Adapter], rec: RecordingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    emb = adapter(config=_config(rec.base_url, dimensions=None, model="Qwen/Qwen3-Embedding-0.6B"))
    _embed_all(emb, ["warm"])  # clients built, connections pooled
    blob = pickle.dumps(emb)
    assert SECRET.encode() not in blob
    assert GATEWAY_SECRET.encode() not in blob  # a credential-like header value
    llama_index_own = {  # BaseEmbedding's own field
        ("llama_index.core.callbacks.base", "CallbackManager"),
        ("collections", "defaultdict"),
        ("builtins", "list"),
    }
    assert _classes_in(blob) - llama_index_own == {
        (adapter.__module__, adapter.__name__),
        ("qwen_embed_plugins.integrations._common", "ClientCache"),
        ("qwen_embed_plugins.integrations._common", "Extras"),
        ("qwen_embed_plugins._policy", "RetryConfig"),
        ("qwen_embed_plugins._extras", "RequestHeaders"),
        ("qwen_embed_plugins._extras", "RequestBody"),
        ("qwen_embed_plugins._extras", "_WITHHELD"),  # the header value left out
    }
    # deepcopy stays in the process: it keeps the key (SecretStr semantics)
    deep = copy.deepcopy(emb)
    assert deep.config == emb.config
    assert deep.config.api_key_value() == SECRET


@pytest.mark.unit
def test_the_key_an_unpickled_instance_has() -> None:
    """Issue 30.6, on both: unpickled while the key lives in this process (or in one
    forked from it), the copy has the key given in code; once no instance holds it (as
    in another process), the environment's key; without one, every request raises
    ``ConfigError`` naming ``QWEN_EMBED_API_KEY`` before anything is sent (never a
    request without the key). A LangChain instance without a key stays without one, a
    LlamaIndex one always reads the environment (as its ``from_dict`` does)."""
    with pytest.MonkeyPatch.context() as env:
        for adapter in ADAPTERS:
            given = f"sk-gone-{uuid.uuid4().hex}"  # held by no other instance
            keyed = adapter(base_url=UNUSED_URL, api_key=given)
            keyless = adapter(base_url=UNUSED_URL, api_key=None)
            env.delenv("QWEN_EMBED_API_KEY", raising=False)
            data = pickle.dumps(keyed)
            assert given.encode() not in data
            assert pickle.loads(data).config.api_key_value() == given
            del keyed
            gc.collect()
            lost = pickle.loads(data)
            assert lost.config.api_key_value() is None
            with pytest.raises(q.ConfigError, match="set QWEN_EMBED_API_KEY") as info:
                _embed_one(lost)
            assert "nothing was sent" in str(info.value)
            env.setenv("QWEN_EMBED_API_KEY", "sk-worker-env")
            again = pickle.loads(data)
            assert again.config.api_key_value() == "sk-worker-env"
            restored = pickle.loads(pickle.dumps(keyless)).config.api_key_value()
            assert restored == (None if adapter is QwenPooledEmbeddings else "sk-worker-env")


# ----------------------------------------------------------------------- names after construction

# Each adapter's stock names for batch size, total timeout, headers and extra body.
_STOCK_NAMES = {
    QwenPooledEmbeddings: ("chunk_size", "timeout", "default_headers", "model_kwargs"),
    QwenPooledEmbedding: ("batch_size", "timeout", "default_headers", "additional_kwargs"),
}


def _embed_one(emb: Adapter) -> None:
    if isinstance(emb, QwenPooledEmbeddings):
        emb.embed_documents(["a", "b", "c"])
    else:
        emb.get_text_embedding_batch(["a", "b", "c"])


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_model_copy_and_assignment_take_the_stock_names(
    adapter: type[Adapter], rec: RecordingServer
) -> None:
    """``model_copy(update=...)`` and assignment skip pydantic's validation: a stock name
    there sets its field (it used to be stored as a stray attribute and ignored, or
    refused by pydantic without a hint)."""
    batch, timeout, headers, body = _STOCK_NAMES[adapter]
    emb = adapter(base_url=rec.base_url)
    copied = emb.model_copy(update={batch: 2, timeout: 7.5, headers: {"X-Tenant": "acme"}})
    assert copied.config.batch_size == 2
    assert copied.config.timeouts.total == 7.5
    assert not set(copied.__dict__) - set(type(copied).model_fields)  # no stray names
    _embed_one(copied)
    assert sorted(len(r.body["input"]) for r in rec.all()) == [1, 2]
    assert {r.headers.get("x-tenant") for r in rec.all()} == {"acme"}
    setattr(emb, batch, 1)
    setattr(emb, body, {"user": "u-9"})
    assert emb.config.batch_size == 1
    _embed_one(emb)
    assert [len(r.body["input"]) for r in rec.all()[2:]] == [1, 1, 1]
    assert {r.body.get("user") for r in rec.all()[2:]} == {"u-9"}
    # the constructor's checks: unknown names, an alias with its field, harmless values
    with pytest.raises(q.ConfigError, match="did you mean 'default_headers'"):
        emb.model_copy(update={"default_header": {}})
    with pytest.raises(q.ConfigError, match="did you mean"):
        emb.timeuot = 3  # type: ignore[union-attr]
    # timeout= sets every phase and the total; a *_timeout field given with it wins
    both = emb.model_copy(update={timeout: 1, "total_timeout": 2})
    assert both.config.timeouts == q.Timeouts(connect=1, read=1, write=1, pool=1, total=2)
    own = "batch_size" if isinstance(emb, QwenPooledEmbeddings) else "embed_batch_size"
    with pytest.raises(q.ConfigError, match=f"pass either '{own}' or '{batch}'"):
        emb.model_copy(update={own: 1, batch: 2})
    with pytest.raises(q.ConfigError, match="config= is taken by the constructor only"):
        emb.model_copy(update={"config": q.EmbeddingConfig(base_url=rec.base_url)})
    with pytest.raises(q.ConfigError, match="not supported: requests go through"):
        emb.http_client = object()  # type: ignore[union-attr]


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_an_api_key_given_to_model_copy_stays_masked(
    adapter: type[Adapter], rec: RecordingServer, caplog: pytest.LogCaptureFixture
) -> None:
    """``model_copy(update={"api_key": "..."})`` stored the key as a plain ``str``: shown
    by ``repr`` and ``model_dump()``, and ``model_dump_json()`` failed."""
    emb = adapter(base_url=rec.base_url).model_copy(update={"api_key": SECRET})
    assert isinstance(emb.api_key, SecretStr)
    for text in (repr(emb), str(emb.model_dump()), emb.model_dump_json()):
        assert SECRET not in text
    assert SECRET.encode() not in pickle.dumps(emb)
    _embed_one(emb)
    assert rec.last().headers["authorization"] == f"Bearer {SECRET}"


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_max_retries_out_of_range_is_named(adapter: type[Adapter]) -> None:
    """The message names ``max_retries`` as given (not the core's ``max_attempts``)."""
    for value in (-1, 100):
        with pytest.raises(
            ValueError, match=rf"max_retries must be an integer in \[0, 99\], got {value}"
        ):
            adapter(base_url=UNUSED_URL, max_retries=value)


def test_llama_index_model_dump_builds_the_model_again(rec: RecordingServer) -> None:
    """LlamaIndex's ``model_dump()`` adds ``class_name``: ``QwenPooledEmbedding(**dump)``
    and ``model_validate(dump)`` accept it, as the stock ``OpenAILikeEmbedding`` does (it
    was refused as an unknown parameter); another class's tag is refused with a hint."""
    emb = QwenPooledEmbedding(
        base_url=rec.base_url, embed_batch_size=2, headers={"X-Tenant": "acme"}
    )
    dump = emb.model_dump()
    assert dump["class_name"] == "QwenPooledEmbedding"
    for again in (QwenPooledEmbedding(**dump), QwenPooledEmbedding.model_validate(dump)):
        assert again.config == emb.config
        again.get_text_embedding_batch(["a", "b", "c"])
    assert sorted(len(r.body["input"]) for r in rec.all()) == [1, 1, 2, 2]
    assert {r.headers.get("x-tenant") for r in rec.all()} == {"acme"}
    with pytest.raises(ValueError, match="'class_name' is not supported: LlamaIndex's"):
        QwenPooledEmbedding(**{**dump, "class_name": "OpenAIEmbedding"})


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_default_batch_call_reaches_the_client_whole(adapter: type[Adapter], mode: str) -> None:
    """With the defaults (``batch_size="auto"``, 4 in flight) a batch call hands its whole
    list to the core client, sync and async alike: 400 texts go out as one wave of 4
    requests of 100 (the client's cut for a call that fits one wave), not in LangChain's
    or LlamaIndex's own chunks (LlamaIndex's stock default, 10 texts per batch, would be
    40 requests), and never more than ``max_concurrency`` at once."""
    from qwen_embed_tooling.testing import EmbeddingServer, expected_embeddings

    texts = [f"whole call text {i}" for i in range(400)]
    with EmbeddingServer(latency=0.02) as srv:
        emb = adapter(base_url=srv.base_url)
        if isinstance(emb, QwenPooledEmbeddings):
            rows = (
                emb.embed_documents(texts)
                if mode == "sync"
                else asyncio.run(emb.aembed_documents(texts))
            )
        elif mode == "sync":
            rows = emb.get_text_embedding_batch(texts)
        else:
            rows = asyncio.run(emb.aget_text_embedding_batch(texts))
        stats = srv.stats()
        sizes = sorted(len(inputs) for inputs in srv.received)
    assert len(rows) == len(texts)
    assert rows[7] == pytest.approx(expected_embeddings([texts[7]])[0].tolist(), abs=1e-6)
    assert sizes == [100, 100, 100, 100]
    assert 1 <= stats["max_in_flight"] <= 4
