"""Hostile servers: bounded memory and time, nothing secret echoed back, every malformed
answer a ResponseError. Each case runs against `HostileServer` (loopback, bounded loops);
memory is the process's peak RSS delta, time is guarded only against hangs (the
assertions are on the error raised)."""

from __future__ import annotations

import asyncio
import logging
import resource
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import qwen_embed_plugins as q
from qwen_embed_tooling.testing import HostileServer, expected_embeddings

KEY = "sk-hostile-0123456789abcdef"
ONCE = q.RetryConfig(max_attempts=1)
MIB = 1 << 20


def peak_rss() -> int:
    """This process's peak resident set, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.fixture
def hostile() -> Iterator[HostileServer]:
    with HostileServer() as server:
        try:
            yield server
        finally:  # the pools' idle connections go first: the server's stop need not wait
            q.close_all()


# --------------------------------------------------------------------------- size


@pytest.mark.parametrize("kind", ["huge_content_length", "endless_chunked", "gzip_bomb"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_oversized_bodies_end_in_a_response_error_with_bounded_memory(
    hostile: HostileServer, kind: str, mode: str
) -> None:
    hostile.set(kind, on="embeddings")
    before = peak_rss()
    if mode == "sync":
        client = q.EmbeddingClient(base_url=hostile.base_url, retry=ONCE)
        with pytest.raises(q.ResponseError, match="cap") as info:
            client.embed_documents(["a", "b"])
    else:
        aclient = q.AsyncEmbeddingClient(base_url=hostile.base_url, retry=ONCE)
        with pytest.raises(q.ResponseError, match="cap") as info:
            asyncio.run(aclient.embed_documents(["a", "b"]))
    grown = peak_rss() - before
    assert grown < 128 * MIB, f"{kind}: peak RSS grew {grown / MIB:.0f} MiB"
    assert "max_response_bytes" in str(info.value)


def test_the_cap_is_a_setting(hostile: HostileServer) -> None:
    hostile.set("ok")
    small = q.EmbeddingClient(base_url=hostile.base_url, max_response_bytes=4096, retry=ONCE)
    with pytest.raises(q.ResponseError, match="4,096 bytes"):
        small.embed_documents(["a", "b", "c"])  # 3 x 1024 floats: over 4 KiB


def test_the_models_probe_is_bounded_in_size_and_time(hostile: HostileServer) -> None:
    """The one ``GET /models`` probe (``qwen-embed check``'s, on the library's
    transport): the cap, also after gzip decoding, and the probes' one deadline."""
    import time

    from qwen_embed_plugins.cli._probe import PROBE_MAX_BYTES, Probes

    def probes(budget: float) -> Probes:
        deadline = time.monotonic() + budget
        return Probes(hostile.base_url, api_key=KEY, verify=True, deadline=deadline, budget=budget)

    before = peak_rss()
    for kind in ("endless_chunked", "gzip_bomb"):
        hostile.set(kind, on="models")
        with probes(30.0) as http, pytest.raises(q.ResponseError, match=f"{PROBE_MAX_BYTES:,}"):
            http.get_models(hostile.base_url)
    assert peak_rss() - before < 64 * MIB
    hostile.set("trickle", on="models", interval=0.2, headers=True)
    with probes(1.0) as http, pytest.raises(q.ReadTimeout, match=r"--timeout of 1 s"):
        http.get_models(hostile.base_url)  # a trickled head too: not a read timeout


@pytest.mark.parametrize(
    ("kind", "params", "error"),
    [
        ("trickle", {"headers": True, "interval": 0.2}, "--timeout"),
        ("silent", {}, "--timeout"),
        ("interim", {"status": 103}, "interim"),
        ("status_line", {"line": "HTTP/1.1 600 Beyond"}, "malformed status"),
    ],
)
def test_the_keepalive_probe_is_bounded_by_the_checks_deadline(
    hostile: HostileServer, kind: str, params: dict[str, object], error: str
) -> None:
    """``qwen-embed check``'s keep-alive probe (the one on ``http.client`` directly): a
    trickled head or a silent server ends at the check's deadline, and neither a 1xx nor
    a malformed status is taken for the answer whose connection it then watches."""
    import time

    from qwen_embed_plugins.cli._probe import measure_idle_timeout

    hostile.set(kind, on="models", **params)
    with pytest.raises(OSError, match=error):
        measure_idle_timeout(
            hostile.base_url, api_key=KEY, max_idle=30.0, deadline=time.monotonic() + 1.0
        )


def test_the_keepalive_probe_names_the_deadline_when_its_watchdog_runs_late(
    hostile: HostileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a loaded machine the socket's own timeout (the time left) can fire before the
    watchdog's thread runs: the probe still says the check's --timeout ran out, not a
    bare "timed out" (seen in CI with two CPU burners beside the suite)."""
    import threading
    import time
    import types

    from qwen_embed_plugins.cli import _probe

    def late_timer(interval: float, function: Any) -> threading.Timer:
        return threading.Timer(interval + 30.0, function)  # a watchdog scheduled late

    monkeypatch.setattr(
        _probe, "threading", types.SimpleNamespace(Event=threading.Event, Timer=late_timer)
    )
    hostile.set("silent", on="models")
    with pytest.raises(OSError, match="--timeout"):
        _probe.measure_idle_timeout(
            hostile.base_url, api_key=KEY, max_idle=30.0, deadline=time.monotonic() + 1.0
        )


# --------------------------------------------------------------------------- time


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_trickling_body_is_cut_by_the_total_deadline(hostile: HostileServer, mode: str) -> None:
    """One byte every 0.2 s beats a 3 s read timeout forever; the call's 2 s deadline
    still ends it (a total timer, not only the per-read timeout)."""
    hostile.set("trickle", on="embeddings", interval=0.2)
    settings = {
        "base_url": hostile.base_url,
        "timeout": q.Timeouts(read=3.0),
        "retry": q.RetryConfig(max_attempts=1, query_deadline=2.0),
    }
    if mode == "sync":
        with pytest.raises(q.ReadTimeout, match="in all"):
            q.EmbeddingClient(**settings).embed_query("slow")  # type: ignore[arg-type]
    else:
        client = q.AsyncEmbeddingClient(**settings)  # type: ignore[arg-type]
        with pytest.raises(q.ReadTimeout, match="in all"):
            asyncio.run(client.embed_query("slow"))


def test_total_timeout_per_exchange(hostile: HostileServer) -> None:
    hostile.set("trickle", on="embeddings", interval=0.2, headers=True)
    client = q.EmbeddingClient(
        base_url=hostile.base_url, timeout=q.Timeouts(read=3.0, total=1.5), retry=ONCE
    )
    with pytest.raises(q.ReadTimeout, match="in all"):
        client.embed_documents(["x"])


# --------------------------------------------------------------------------- secrets


@pytest.mark.parametrize("transform", ["exact", "upper", "lower", "truncate", "bare"])
@pytest.mark.parametrize("where", ["body", "header"])
def test_an_echoed_key_is_scrubbed_everywhere(
    hostile: HostileServer, caplog: pytest.LogCaptureFixture, transform: str, where: str
) -> None:
    caplog.set_level(logging.DEBUG, logger="qwen_embed_plugins")
    hostile.set("echo_auth", on="embeddings", transform=transform, where=where, status=500)
    client = q.EmbeddingClient(
        base_url=hostile.base_url,
        api_key=KEY,
        # every request fails (the control too): an outage, retried until this deadline
        retry=q.RetryConfig(max_attempts=2, backoff_initial=0.01, query_deadline=1.0),
    )
    with pytest.raises(q.QwenEmbedError) as info:
        client.embed_query("who am i")
    shown = [
        str(info.value),
        repr(info.value),
        "".join(traceback.format_exception(info.value)),
        caplog.text,
        repr(getattr(info.value, "request_id", "")),
        repr(vars(info.value)),
    ]
    secret_bits = {KEY, KEY.upper(), KEY.lower(), KEY[:-4], KEY[3:]}
    for text in shown:
        for bit in secret_bits:
            assert bit not in text, (transform, where, text[:300])


SDK_MODES = ["openai_client", "async_openai_client"]


def _sdk_call(hostile: HostileServer, mode: str) -> BaseException:
    """One embedding call through the openai SDK on the library's pool; its exception."""
    settings = {"base_url": hostile.base_url, "api_key": KEY, "retry": ONCE}
    try:
        if mode == "openai_client":
            sdk = q.EmbeddingClient(**settings).openai_client()  # type: ignore[arg-type]
            sdk.embeddings.create(input=["sdk"], model="m")
        else:
            asdk = q.AsyncEmbeddingClient(**settings).openai_client()  # type: ignore[arg-type]
            asyncio.run(asdk.embeddings.create(input=["sdk"], model="m"))
    except Exception as exc:
        return exc
    raise AssertionError("the call succeeded against a 500")


@pytest.mark.parametrize("transform", ["exact", "upper", "lower", "truncate", "bare"])
@pytest.mark.parametrize("mode", SDK_MODES)
def test_a_key_echoed_in_a_response_header_is_scrubbed_before_the_sdk_logs_it(
    hostile: HostileServer, caplog: pytest.LogCaptureFixture, transform: str, mode: str
) -> None:
    """``openai._base_client`` logs ``x-request-id`` at DEBUG: the SDK bridge hands it
    response headers already scrubbed, so no logger (all at DEBUG) records the key."""
    caplog.set_level(logging.DEBUG)
    hostile.set("echo_auth", on="embeddings", transform=transform, where="header")
    exc = _sdk_call(hostile, mode)
    import openai

    assert isinstance(exc, openai.InternalServerError)
    assert exc.status_code == 500
    assert exc.request_id is not None
    assert "***" in exc.request_id
    logged = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("request_id: ") and "***" in m for m in logged), logged
    secret_bits = {KEY, KEY.upper(), KEY.lower(), KEY[:-4], KEY[3:]}
    for text in [*logged, caplog.text, str(exc), repr(vars(exc))]:
        for bit in secret_bits:
            assert bit not in text, (transform, mode, text[:300])


# --------------------------------------------------------------------------- shapes


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("redirect", "redirect"),
        ("error_200", "error while processing your request"),
        ("nested", "flat list of numbers"),
        ("string_components", "str values"),
        ("bool_components", "bool values"),
        ("html", "not valid JSON"),
    ],
)
def test_every_malformed_answer_is_a_response_error(
    hostile: HostileServer, kind: str, words: str
) -> None:
    hostile.set(kind, on="embeddings")
    client = q.EmbeddingClient(base_url=hostile.base_url, retry=ONCE)
    with pytest.raises(q.ResponseError) as info:
        client.embed_documents(["a", "b"])
    assert words in str(info.value), str(info.value)
    if kind == "redirect":
        assert hostile.stats()["paths"].get("/redirected", 0) == 0  # never followed


@pytest.mark.parametrize("delay", [0.0, 0.05])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_stray_response_is_never_taken_for_the_next_answer(
    hostile: HostileServer, delay: float, mode: str
) -> None:
    """After a valid answer the server writes a second, unrequested one on the same
    keep-alive connection (in the same write, or 50 ms later while the connection is
    idle in the pool): the next call must get its own vectors, not the stray's. (A stray
    that arrives after the next request was sent cannot be told from its answer in
    HTTP/1.1; the guarantee is that a connection with unread bytes is never reused.)"""
    hostile.set("stray_response", on="embeddings", delay=delay)
    client = q.EmbeddingClient(base_url=hostile.base_url, retry=q.RetryConfig(backoff_initial=0.01))
    aclient = q.AsyncEmbeddingClient(client.config)

    def texts_of(i: int) -> list[str]:
        return [f"{mode} call {i} text {j}" for j in range(3)]

    if mode == "sync":
        for i in range(4):
            got = client.embed_documents(texts_of(i))
            np.testing.assert_allclose(got, expected_embeddings(texts_of(i)), atol=1e-6)
            hostile.wait_for("stray_sent", i + 1)  # the stray is on the idle connection
        return

    async def run() -> None:
        for i in range(4):
            got = await aclient.embed_documents(texts_of(i))
            np.testing.assert_allclose(got, expected_embeddings(texts_of(i)), atol=1e-6)
            await asyncio.to_thread(hostile.wait_for, "stray_sent", i + 1)

    asyncio.run(run())


def test_a_key_echoed_in_a_non_json_200_is_scrubbed(hostile: HostileServer) -> None:
    hostile.set("echo_auth", on="embeddings", transform="exact", where="body", status=None)
    client = q.EmbeddingClient(base_url=hostile.base_url, api_key=KEY, retry=ONCE)
    with pytest.raises(q.ResponseError, match="not valid JSON") as info:
        client.embed_query("echo")
    assert KEY not in "".join(traceback.format_exception(info.value))
