"""The core client against a real loopback server (issue 2's suite)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import pickle
import threading
import time
import uuid
from typing import Any

import numpy as np
import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins import _pool as pool
from qwen_embed_tooling.testing import EmbeddingServer, expected_embedding

TEXTS_1000 = [f"passage number {i}: the quick brown fox {i * 7919 % 1000}" for i in range(1000)]


def expected(texts: list[str], dim: int = 1024) -> np.ndarray:
    return np.stack([expected_embedding(t, dim) for t in texts])


def endpoint_stats(client: q.EmbeddingClient | q.AsyncEmbeddingClient) -> dict[str, int]:
    return q.pool_stats()[client.config.endpoint]


def test_1000_texts_in_input_order(srv: EmbeddingServer) -> None:
    client = q.EmbeddingClient(base_url=srv.base_url, batch_size=32, max_concurrency=4)
    before = endpoint_stats(client) if client.config.endpoint in q.pool_stats() else None
    vectors = client.embed_documents(TEXTS_1000)
    assert len(vectors) == 1000
    assert all(len(v) == 1024 for v in vectors)
    np.testing.assert_array_equal(np.asarray(vectors, dtype=np.float32), expected(TEXTS_1000))
    assert srv.requests == 32  # ceil(1000 / 32)
    assert srv.texts == 1000
    # batches were sent concurrently over at most max_connections connections
    assert 1 <= srv.connections_opened <= client.config.limits.max_connections
    stats = endpoint_stats(client)
    opened = stats["connections_opened"] - (before["connections_opened"] if before else 0)
    assert opened == srv.connections_opened


def test_numpy_variants_and_query(srv: EmbeddingServer) -> None:
    client = q.EmbeddingClient(base_url=srv.base_url)
    arr = client.embed_documents_array(["alpha", "beta"])
    assert arr.dtype == np.float32
    assert arr.shape == (2, 1024)
    query = client.embed_query_array("what is alpha?")
    assert query.shape == (1024,)
    sent = q.format_query("what is alpha?", q.DEFAULT_QUERY_TASK)
    assert sent == (
        "Instruct: Given a web search query, retrieve relevant passages that answer the query"
        "\nQuery:what is alpha?"
    )
    np.testing.assert_array_equal(query, expected_embedding(sent))
    assert srv.received[-1] == [sent]
    assert srv.received[-2] == ["alpha", "beta"]  # documents go raw


def test_query_instruction_none_sends_raw(srv: EmbeddingServer) -> None:
    client = q.EmbeddingClient(base_url=srv.base_url, query_instruction=None)
    np.testing.assert_array_equal(client.embed_query_array("raw"), expected_embedding("raw"))
    assert srv.received[-1] == ["raw"]


def test_duplicates_sent_once_and_order_kept(srv: EmbeddingServer) -> None:
    client = q.EmbeddingClient(base_url=srv.base_url, batch_size=2)
    texts = ["a b", "c d", "a b", "e f", "c d", "a b"]
    arr = client.embed_documents_array(texts)
    np.testing.assert_array_equal(arr, expected(texts))
    assert srv.texts == 3


def test_twenty_clients_share_one_pool(srv: EmbeddingServer) -> None:
    limits = q.Limits(max_connections=5)
    clients = [
        q.EmbeddingClient(base_url=srv.base_url, limits=limits, batch_size=8, max_concurrency=8)
        for _ in range(20)
    ]
    keys = {c.config.pool_key for c in clients}
    assert len(keys) == 1
    label = clients[0].config.endpoint
    sync_before = q.pool_stats().get(label, {}).get("sync_clients", 0)
    retries_before = q.stats().get(label, {}).get("retries", 0)
    texts = TEXTS_1000[:200]
    errors: list[BaseException] = []

    def work(c: q.EmbeddingClient) -> None:
        try:
            np.testing.assert_array_equal(c.embed_documents_array(texts), expected(texts))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    # every batch exactly once over at most 5 connections, none replaced: requests wait
    # for a pool slot before httpcore's pool (pool._GatedTransport), so its races under
    # thread contention (closing a connection another thread is about to use; "[Errno 9]
    # Bad file descriptor" with httpcore 1.0.9) never happen
    assert q.stats()[label]["retries"] == retries_before
    assert srv.requests == 20 * 25
    assert 1 <= srv.connections_opened <= 5
    assert q.pool_stats()[label]["sync_clients"] == sync_before + 1  # 20 clients, 1 pool


def test_threads_wait_in_front_of_the_pool_and_time_out_there(wait_until: Any) -> None:
    """Over HTTP/1.1 at most max_connections requests are inside httpx's pool at once
    (pool._GatedTransport); the others wait for a slot, up to Timeouts.pool."""
    with EmbeddingServer() as slow:
        # the holder's request is answered only when the server stops (a delay fault ends
        # at once then): it holds the only slot for as long as this test needs
        slow.inject("delay", seconds=600.0)
        client = q.EmbeddingClient(
            base_url=slow.base_url,
            limits=q.Limits(max_connections=1),
            timeout=q.Timeouts(pool=0.2),
            retry=q.RetryConfig(max_attempts=1),
        )
        outcome: list[object] = []

        def hold() -> None:
            try:
                outcome.append(client.embed_query("holds the only slot"))
            except q.QwenEmbedError as exc:
                outcome.append(exc)

        holder = threading.Thread(target=hold)
        holder.start()
        wait_until(lambda: slow.requests == 1, "the holder's request to reach the server")
        t0 = time.monotonic()
        with pytest.raises(q.PoolTimeout, match=r"within 0\.2 s.*max_connections=1"):
            client.embed_query("waits for the slot")
        waited = time.monotonic() - t0
        # it gave up after the pool timeout, while the holder was still waiting for its
        # answer (not after the holder finished)
        assert waited >= 0.2
        assert outcome == []
        assert holder.is_alive()
        assert slow.requests == 1  # the one that timed out never reached the server
        slow.close_connections()  # ends the holder's exchange: it fails, freeing its slot
        holder.join()
        # the dropped connection was not its text's fault: a control request (on a new
        # connection: the old one was closed under it) showed the server working, and
        # the text, sent once more, went through
        (held,) = outcome
        assert isinstance(held, list), held
        assert slow.requests == 3
        sent = slow.requests
        # the slot came back: the next call goes through
        assert len(client.embed_query("after")) == 1024
        assert slow.requests == sent + 1
        assert slow.connections_opened == 2


def test_pool_slot_released_after_errors(srv: EmbeddingServer) -> None:
    """A request that fails (reset connection, HTTP error) gives its slot back; with one
    slot, a leak would make the next call wait out the pool timeout."""
    client = q.EmbeddingClient(
        base_url=srv.base_url,
        limits=q.Limits(max_connections=1),
        timeout=q.Timeouts(pool=1.0),
        retry=q.RetryConfig(max_attempts=1),
    )
    srv.inject("reset")
    with pytest.raises(q.QwenEmbedError):
        client.embed_query("reset mid-body")
    srv.poison("rejected", substring=True, status=400, message="rejected on purpose")
    with pytest.raises(q.BadRequestError):
        client.embed_query("rejected")
    srv.clear_rules()
    srv.inject("malformed", count=2)  # the query and its control request
    with pytest.raises(q.QwenEmbedError):
        client.embed_query("malformed body")
    for i in range(5):  # a leaked slot: PoolTimeout here (max_attempts=1)
        assert len(client.embed_query(f"fine {i}")) == 1024


def test_constructing_opens_nothing(srv: EmbeddingServer) -> None:
    for _ in range(10):
        q.EmbeddingClient(base_url=srv.base_url, batch_size=7)
        q.AsyncEmbeddingClient(base_url=srv.base_url)
    assert srv.connections_opened == 0
    assert srv.requests == 0


def test_asyncio_run_50_times_on_one_client(srv: EmbeddingServer) -> None:
    client = q.AsyncEmbeddingClient(base_url=srv.base_url)
    want = expected(["one", "two"])
    for _ in range(50):
        got = asyncio.run(client.embed_documents_array(["one", "two"]))
        np.testing.assert_array_equal(got, want)
    # each finished loop closed its own client: none left open
    assert q.pool_stats()[client.config.endpoint]["async_clients"] == 0


def test_eight_threads_each_with_own_loop(srv: EmbeddingServer) -> None:
    client = q.AsyncEmbeddingClient(base_url=srv.base_url, batch_size=4)
    texts = TEXTS_1000[:40]
    want = expected(texts)
    results: list[np.ndarray] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            loop = asyncio.new_event_loop()
            try:
                for _ in range(3):
                    results.append(loop.run_until_complete(client.embed_documents_array(texts)))
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 24
    for r in results:
        np.testing.assert_array_equal(r, want)


async def test_async_batches_bounded_concurrency(srv: EmbeddingServer) -> None:
    client = q.AsyncEmbeddingClient(
        base_url=srv.base_url, batch_size=10, max_concurrency=3, limits=q.Limits(max_connections=3)
    )
    texts = TEXTS_1000[:300]
    np.testing.assert_array_equal(await client.embed_documents_array(texts), expected(texts))
    assert srv.requests == 30
    assert srv.connections_opened <= 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_child_embeds_and_parent_still_works(srv: EmbeddingServer) -> None:
    client = q.EmbeddingClient(base_url=srv.base_url)
    want = expected(["parent", "child"])
    np.testing.assert_array_equal(client.embed_documents_array(["parent"]), want[:1])
    parent_client = pool.sync_transport(client.config.pool_key)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must not reuse the parent's sockets
        code = 1
        try:
            child_http = pool.sync_transport(client.config.pool_key)
            arr = client.embed_documents_array(["child"])
            ok = child_http is not parent_client and np.array_equal(arr, want[1:])
            code = 0 if ok else 2
        finally:
            os.write(write_fd, bytes([code]))
            os._exit(code)
    os.close(write_fd)
    _, status = os.waitpid(pid, 0)
    code = os.read(read_fd, 1)
    os.close(read_fd)
    assert os.waitstatus_to_exitcode(status) == 0, code
    np.testing.assert_array_equal(client.embed_documents_array(["parent", "child"]), want)


def test_idle_past_server_keepalive_then_embed(wait_until: Any) -> None:
    # The server closes idle connections after 0.3 s; this client keeps them 30 s
    # (the common bad advice), so the next request meets a connection the server closed.
    with EmbeddingServer(keep_alive_timeout=0.3) as srv:
        client = q.EmbeddingClient(base_url=srv.base_url, limits=q.Limits(keepalive_expiry=30.0))
        client.embed_documents(["first"])
        wait_until(
            lambda: srv.stats()["connections_active"] == 0,
            "the server to close the idle connection (keep-alive 0.3 s)",
        )
        np.testing.assert_array_equal(
            client.embed_documents_array(["second"]), expected(["second"])
        )
        assert srv.connections_opened == 2


@pytest.mark.unit
def test_default_keepalive_is_below_uvicorn_idle_timeout() -> None:
    assert q.Limits().keepalive_expiry < 5.0


def test_base64_and_float_identical(srv: EmbeddingServer) -> None:
    texts = TEXTS_1000[:50]
    b64 = q.EmbeddingClient(base_url=srv.base_url, encoding_format="base64")
    flt = q.EmbeddingClient(base_url=srv.base_url, encoding_format="float")
    np.testing.assert_array_equal(
        b64.embed_documents_array(texts), flt.embed_documents_array(texts)
    )
    np.testing.assert_array_equal(b64.embed_documents_array(texts), expected(texts))


def test_dimensions_fallback_slices_and_renormalises() -> None:
    with EmbeddingServer(matryoshka=False) as srv:
        client = q.EmbeddingClient(base_url=srv.base_url, dimensions=256)
        texts = ["mrl one", "mrl two", "mrl three"]
        got = client.embed_documents_array(texts)
        full = expected(texts)[:, :256]
        want = full / np.linalg.norm(full, axis=1, keepdims=True)
        assert got.shape == (3, 256)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
        # learned once: the second call sends no `dimensions` and needs one request
        srv.reset_counters()
        client.embed_documents_array(["mrl four"])
        assert srv.requests == 1


def test_dimensions_sent_when_server_supports_mrl() -> None:
    with EmbeddingServer(matryoshka=True) as srv:
        client = q.EmbeddingClient(base_url=srv.base_url, dimensions=128)
        got = client.embed_documents_array(["m1", "m2"])
        want = np.stack([expected_embedding(t, 1024, dimensions=128) for t in ["m1", "m2"]])
        np.testing.assert_allclose(got, want, atol=1e-6)
        assert srv.requests == 1


@pytest.mark.parametrize(
    ("bad", "index", "words"),
    [
        (["ok", ""], 1, "empty"),
        (["ok", "fine", "   \n\t"], 2, "whitespace"),
        (["ok", None], 1, "None"),
        ([3, "ok"], 0, "int"),
        (["ok", "x" * 10_000_000], 1, "characters"),
        ("a single string", None, "single str"),
        ([["nested"]], 0, "list"),
        ([b"bytes"], 0, "bytes"),
        (["ok", "a\ud800b"], 1, "surrogate"),
        ({"a", "b"}, None, "ordered"),
    ],
)
def test_bad_input_names_the_index_and_sends_nothing(
    srv: EmbeddingServer, bad: object, index: int | None, words: str
) -> None:
    client = q.EmbeddingClient(base_url=srv.base_url)
    with pytest.raises(q.InputError) as info:
        client.embed_documents(bad)  # type: ignore[arg-type]
    assert info.value.index == index
    if index is not None:
        assert f"index {index}" in str(info.value)
    assert words in str(info.value)
    assert srv.requests == 0


@pytest.mark.parametrize("bad", ["", "  ", None, 42])
def test_bad_query(srv: EmbeddingServer, bad: object) -> None:
    client = q.EmbeddingClient(base_url=srv.base_url)
    with pytest.raises(q.InputError):
        client.embed_query(bad)  # type: ignore[arg-type]
    assert srv.requests == 0


async def test_bad_input_async(srv: EmbeddingServer) -> None:
    client = q.AsyncEmbeddingClient(base_url=srv.base_url)
    with pytest.raises(q.InputError) as info:
        await client.embed_documents(["fine", "\n"])
    assert info.value.index == 1
    assert srv.requests == 0


SECRET = "sk-test-SECRET-9f8e7d6c5b4a"


def test_api_key_never_leaks(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with EmbeddingServer(api_key=SECRET) as srv:
        good = q.EmbeddingClient(base_url=srv.base_url, api_key=SECRET)
        assert len(good.embed_query("hello")) == 1024
        wrong = q.EmbeddingClient(base_url=srv.base_url, api_key=SECRET + "-wrong")
        with pytest.raises(q.AuthenticationError) as info:
            wrong.embed_query("hello")
        texts = [
            repr(good),
            str(good),
            repr(good.config),
            str(good.config),
            repr(good.config.pool_key),
            str(info.value),
            repr(info.value),
            repr(info.value.__dict__),
            caplog.text,
            repr(q.pool_stats()),
            repr(q.stats()),
        ]
        for text in texts:
            assert SECRET not in text
        assert info.value.status == 401
        blob = pickle.dumps(good)
        assert SECRET.encode() not in blob
        assert SECRET.encode() not in pickle.dumps(good.config)


async def test_clients_with_other_keys_on_one_async_pool_each_send_their_own() -> None:
    """The event-loop transport keeps the request headers it built for the last client
    that used it: two clients sharing one pool (the key is no part of the pool key),
    called in turn, still each send their own key."""
    once = q.RetryConfig(max_attempts=1)
    with EmbeddingServer(api_key=SECRET) as srv:
        good = q.AsyncEmbeddingClient(base_url=srv.base_url, api_key=SECRET, retry=once)
        wrong = q.AsyncEmbeddingClient(base_url=srv.base_url, api_key=SECRET + "-wrong", retry=once)
        assert good.config.pool_key == wrong.config.pool_key
        for turn in range(3):
            assert len(await good.embed_query(f"hello {turn}")) == 1024
            with pytest.raises(q.AuthenticationError):
                await wrong.embed_query(f"hello {turn}")
        assert pool.async_transport(good.config.pool_key) is pool.async_transport(
            wrong.config.pool_key
        )


async def test_async_read_timeout_shorter_than_the_deadline_still_applies() -> None:
    """The event-loop transport leaves out a read timeout only when the call's deadline
    ends the exchange first; a shorter one still ends a silent server's answer, also
    after a first call built the transport's timeouts."""
    with EmbeddingServer() as srv:
        client = q.AsyncEmbeddingClient(
            base_url=srv.base_url,
            timeout=q.Timeouts(read=0.2),
            retry=q.RetryConfig(max_attempts=1, query_deadline=600.0),
        )
        assert len(await client.embed_query("fast")) == 1024
        srv.inject("delay", seconds=600.0)  # ended when the server stops, below
        with pytest.raises(q.ReadTimeout, match=r"Timeouts\.read"):
            await client.embed_query("slow")


def test_pickle_rereads_key_from_environment(
    srv: EmbeddingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pickle holds no key: unpickled while the key lives in this process (or one
    forked from it), the key given; once gone (as in another process), the
    environment's; without one, a key that refuses every request (issue 30.6)."""
    given = f"sk-client-{uuid.uuid4().hex}"  # held by no other instance
    client = q.EmbeddingClient(base_url=srv.base_url, api_key=given)
    monkeypatch.setenv("QWEN_EMBED_API_KEY", "from-env-key")
    data = pickle.dumps(client)
    assert given.encode() not in data
    assert pickle.loads(data).config.api_key_value() == given
    base_url = client.config.base_url
    del client
    gc.collect()
    clone = pickle.loads(data)
    assert clone.config.api_key_value() == "from-env-key"
    assert clone.config.base_url == base_url
    monkeypatch.delenv("QWEN_EMBED_API_KEY")
    lost = pickle.loads(data)
    assert lost.config.api_key_value() is None
    before = srv.requests
    with pytest.raises(q.ConfigError, match="set QWEN_EMBED_API_KEY"):
        lost.embed_query("never sent")
    assert srv.requests == before


def test_openai_sdk_shares_the_pool(srv: EmbeddingServer) -> None:
    client = q.EmbeddingClient(base_url=srv.base_url, limits=q.Limits(max_connections=2))
    sdk = client.openai_client()
    assert sdk.max_retries == 0
    before = q.pool_stats()[client.config.endpoint]["connections_opened"]
    for _ in range(5):
        got = sdk.embeddings.create(input=["sdk text"], model="m")
        np.testing.assert_allclose(got.data[0].embedding, expected(["sdk text"])[0], atol=1e-6)
    opened = q.pool_stats()[client.config.endpoint]["connections_opened"] - before
    assert opened == srv.connections_opened <= 1
    sdk.close()  # closes nothing shared
    assert len(client.embed_query("pool still open")) == 1024
    assert srv.connections_opened <= 1  # the same connection, still open


async def test_async_openai_sdk_on_loop_pool(srv: EmbeddingServer) -> None:
    client = q.AsyncEmbeddingClient(base_url=srv.base_url)
    sdk = client.openai_client()
    assert sdk.max_retries == 0
    got = await sdk.embeddings.create(input=["x1"], model="m")
    np.testing.assert_allclose(got.data[0].embedding, expected(["x1"])[0], atol=1e-6)
    await sdk.close()  # closes nothing shared
    np.testing.assert_array_equal(await client.embed_documents_array(["x1"]), expected(["x1"]))
    assert srv.connections_opened == 1


def test_close_all_then_reuse(srv: EmbeddingServer) -> None:
    client = q.EmbeddingClient(base_url=srv.base_url)
    client.embed_query("before close")
    q.close_all()
    assert q.pool_stats()[client.config.endpoint]["sync_clients"] == 0
    assert len(client.embed_query("after close")) == 1024


async def test_aclose_all(srv: EmbeddingServer) -> None:
    client = q.AsyncEmbeddingClient(base_url=srv.base_url)
    await client.embed_query("one")
    await q.aclose_all()
    assert q.pool_stats()[client.config.endpoint]["async_clients"] == 0
    assert len(await client.embed_query("two")) == 1024


@pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")
def test_loops_closed_by_hand_do_not_leak_connections(
    srv: EmbeddingServer, wait_until: Any
) -> None:
    # loop.close() without shutdown_asyncgens(): the pool cannot close that loop's client
    # inside it, so it releases it at the next lookup (or reaper pass): the sockets close
    # at once, and asyncio reports the transports ("unclosed transport", filtered here)
    # when garbage collection takes them.
    import gc

    from qwen_embed_plugins import _pool as pool

    client = q.AsyncEmbeddingClient(base_url=srv.base_url)
    for i in range(30):
        loop = asyncio.new_event_loop()
        loop.run_until_complete(client.embed_query(f"manual loop {i}"))
        loop.close()
    del loop
    pool.reap_idle()  # the last loop's pool too, so that its garbage is collected here
    gc.collect()
    # the server sees every one of them close
    wait_until(
        lambda: srv.stats()["connections_active"] == 0,
        "the closed loops' connections to close",
    )
    assert srv.connections_opened == 30


def test_server_rejection_names_the_callers_index(srv: EmbeddingServer) -> None:
    # the server blames a position within one request; the error names the caller's index
    client = q.EmbeddingClient(base_url=srv.base_url, batch_size=2, max_text_chars=None)
    texts = ["a", "a", "b", "c", "d", "x" * 200_000, "e"]
    with pytest.raises(q.BadRequestError) as info:
        client.embed_documents(texts)
    assert info.value.index == 5
    assert "input index 5" in str(info.value)


def test_wrong_base_url_errors_say_what_to_do(srv: EmbeddingServer) -> None:
    no_v1 = q.EmbeddingClient(base_url=srv.url, retry=q.RetryConfig(max_attempts=1))
    with pytest.raises(q.NotFoundError, match="/v1"):
        no_v1.embed_query("where?")
    tls_to_plain = q.EmbeddingClient(
        base_url=srv.base_url.replace("http://", "https://"),
        retry=q.RetryConfig(max_attempts=1),
    )
    with pytest.raises(q.ConnectError, match="plain HTTP"):
        tls_to_plain.embed_query("tls?")


def test_every_error_survives_pickling_with_its_attributes() -> None:
    """Errors cross process boundaries (multiprocessing, LlamaIndex's num_workers): every
    class of the tree pickles, keyword-only attributes included."""
    import inspect

    from qwen_embed_plugins import errors

    classes = [
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, q.QwenEmbedError)
    ]
    assert len(classes) >= 20
    for cls in classes:
        params = {  # the keyword arguments of every __init__ along the MRO (**kwargs chains)
            name
            for klass in cls.__mro__
            if "__init__" in vars(klass)
            for name in inspect.signature(vars(klass)["__init__"]).parameters
        }
        kwargs = {
            name: value
            for name, value in {
                "status": 503,
                "url": "http://127.0.0.1:1/v1",
                "index": 7,
                "retry_in": 1.5,
                "retry_after": 2.0,
                "request_id": "req-1",
                "server_message": "busy",
                "limit": 10,
                "replica": "http://127.0.0.1:1/v1",
                "attempts": 3,
            }.items()
            if name in params
        }
        error = cls("what went wrong", **kwargs)
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is cls
        assert str(back) == str(error)
        assert back.__dict__ == error.__dict__, cls


def test_server_error_from_a_pool_worker_reaches_the_parent(srv: EmbeddingServer) -> None:
    """A 401 raised in a multiprocessing worker arrives as AuthenticationError (before,
    HTTPStatusError could not be unpickled and Pool.map waited forever)."""
    import multiprocessing

    srv.inject_status(401, count=1)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as workers:
        result = workers.map_async(_embed_in_worker, [srv.base_url])
        with pytest.raises(q.AuthenticationError) as info:
            result.get(timeout=60)
    assert info.value.status == 401


def _embed_in_worker(base_url: str) -> list[list[float]]:
    client = q.EmbeddingClient(base_url=base_url, retry=q.RetryConfig(max_attempts=1))
    return client.embed_documents(["needs a key"])


def test_kept_sdk_object_survives_close_all_and_fork(srv: EmbeddingServer) -> None:
    """An ``openai_client()`` kept by the user keeps working after ``close_all()`` and in
    a forked child, where it uses the child's own sockets (it used to send on the
    parent's socket: "Invalid HTTP request received" on the server)."""
    client = q.EmbeddingClient(base_url=srv.base_url, limits=q.Limits(max_connections=1))
    sdk = client.openai_client()
    assert len(sdk.embeddings.create(input=["p"], model="m").data) == 1
    q.close_all()
    assert len(sdk.embeddings.create(input=["after close_all"], model="m").data) == 1
    before = srv.connections_opened
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child process
        ok = 0
        try:
            for i in range(50):
                ok += len(sdk.embeddings.create(input=[f"child {i}"], model="m").data)
        finally:
            os._exit(0 if ok == 50 else 1)
    for i in range(50):
        assert len(sdk.embeddings.create(input=[f"parent {i}"], model="m").data) == 1
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert srv.connections_opened == before + 1  # the child's own connection
    assert srv.requests >= 102


def test_kept_sdk_object_falls_back_from_h2c(srv: EmbeddingServer) -> None:
    """``http2=True`` on http:// against an HTTP/1.1-only server: the SDK object switches
    the endpoint to HTTP/1.1 itself (before, every SDK call failed until the library's
    own path happened to switch it)."""
    client = q.EmbeddingClient(base_url=srv.base_url, http2=True)
    sdk = client.openai_client()
    for i in range(3):
        assert len(sdk.embeddings.create(input=[f"h2c {i}"], model="m").data) == 1
    np.testing.assert_array_equal(client.embed_documents_array(["s1"]), expected(["s1"]))


def test_one_async_sdk_object_on_many_event_loops(srv: EmbeddingServer) -> None:
    client = q.AsyncEmbeddingClient(base_url=srv.base_url)

    async def call(text: str) -> int:
        return len((await client.openai_client().embeddings.create(input=[text], model="m")).data)

    sdks = set()
    for i in range(3):
        assert asyncio.run(call(f"loop {i}")) == 1
        sdks.add(id(client.openai_client()))
    assert len(sdks) == 1


def test_a_context_length_error_tells_the_servers_index_from_the_callers() -> None:
    """Call index 6 is batch-local index 2 of the second batch of four: the message gives
    both, and says which is which."""
    texts = [f"text {i}" for i in range(8)]
    texts[6] = "x" * 50
    with EmbeddingServer(max_input_chars=20) as server:
        client = q.EmbeddingClient(base_url=server.base_url, batch_size=4, max_concurrency=1)
        with pytest.raises(q.ContextLengthError) as info:
            client.embed_documents(texts)
    q.close_all()
    text = str(info.value)
    assert info.value.index == 6
    assert "[input index 6 of this call]" in text
    assert "at index 2 " in text  # the server's own words
    assert "the server's index 2 counts within the batch it was sent, not within the call" in text
