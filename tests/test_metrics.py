"""Metrics: the Prometheus export equals what the server counted."""

from __future__ import annotations

import logging
import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import qwen_embed_plugins as q
from qwen_embed_plugins._metrics import (
    prometheus_collector,
)
from qwen_embed_tooling.testing import EmbeddingServer

SECRET = "sk-prom-SECRET-123456"


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_prometheus_counters_equal_server_counts(caplog) -> None:  # type: ignore[no-untyped-def]
    _prometheus_counters_equal_server_counts(caplog, port=0)


def test_prometheus_counters_on_a_port_an_earlier_server_taught(  # type: ignore[no-untyped-def]
    caplog, poisoned_port: int
) -> None:
    """CI once ran the test above on the port of an earlier test's server, whose learned
    batch limit this process kept: 20 requests instead of 11."""
    _prometheus_counters_equal_server_counts(caplog, port=poisoned_port)


def _prometheus_counters_equal_server_counts(caplog: pytest.LogCaptureFixture, port: int) -> None:
    caplog.set_level(logging.DEBUG)
    registry = CollectorRegistry()
    registry.register(prometheus_collector())
    with EmbeddingServer(api_key=SECRET, port=port) as srv:
        client = q.EmbeddingClient(base_url=srv.base_url, api_key=SECRET, batch_size=10)
        q.reset_metrics()
        srv.inject_status(503)
        client.embed_documents([f"prom {i}" for i in range(95)])
        q.close_all()
        text = generate_latest(registry).decode()
        assert SECRET not in text
        assert SECRET not in caplog.text
        samples = _samples(registry)
        endpoint = client.config.endpoint

        def value(name: str, **labels: str) -> float:
            key = tuple(sorted({"endpoint": endpoint, **labels}.items()))
            return samples[(name, key)]

        ok = value("qwen_embed_requests_total", outcome="ok")
        failed = value("qwen_embed_requests_total", outcome="OverloadedError")
        assert ok + failed == srv.requests == 11
        assert failed == 1
        assert value("qwen_embed_connections_opened_total") == srv.connections_opened
        assert value("qwen_embed_texts_total") == 95 == srv.texts
        assert value("qwen_embed_retries_total", reason="status_503") == 1
        assert value("qwen_embed_request_duration_seconds_count") == 11
        assert value("qwen_embed_in_flight_requests") == 0


def _request_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "qwen_embed_plugins"
        and r.levelno == logging.DEBUG
        and r.getMessage().startswith("POST ")
    ]


def test_debug_line_per_request_with_attempt_and_warnings_without_secrets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="qwen_embed_plugins")
    fast_retry = q.RetryConfig(backoff_initial=0.01, backoff_max=0.02)
    with EmbeddingServer(api_key=SECRET, max_batch=2) as srv:
        client = q.EmbeddingClient(
            base_url=srv.base_url, api_key=SECRET, batch_size=2, retry=fast_retry
        )
        label = client.config.endpoint
        # a retry after an injected 503 whose message echoes the key
        srv.inject_status(503, message=f"queue full for key {SECRET}")
        client.embed_documents(["first", "second"])
        first, second = _request_lines(caplog)
        assert re.fullmatch(
            rf"POST {re.escape(label)} texts=2 status=503 \d+\.\d ms attempt=1", first
        )
        assert re.fullmatch(
            rf"POST {re.escape(label)} texts=2 status=200 \d+\.\d ms attempt=2", second
        )
        retries = [r.getMessage() for r in caplog.records if r.msg.startswith("retrying")]
        assert len(retries) == 1
        assert retries[0].startswith(f"retrying {label} after status_503 in ")
        assert "queue full for key ***" in retries[0]  # the server's echo, scrubbed
        assert {r.levelno for r in caplog.records if r.msg.startswith("retrying")} == {
            logging.DEBUG
        }
        # WARNINGs: the outage episode's start (with what failed) and end; the 503 was
        # to base64 and the retry in float went through: float from now on
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 3, warnings
        assert warnings[0].startswith(f"{label} failed (status_503); retrying")
        assert "queue full for key ***" in warnings[0]
        assert sum("using float from now on" in w for w in warnings) == 1
        assert sum(w.startswith(f"{label} answered again after ") for w in warnings) == 1
        assert all(SECRET not in w for w in warnings)

        # a connection closed without an answer: no HTTP status, the error class instead
        caplog.clear()
        srv.inject("close")
        client.embed_query("a query")
        lines = _request_lines(caplog)
        assert [line.split(" status=")[1].split(" ")[0] for line in lines] == [
            "RemoteProtocolError",
            "200",
        ]
        assert [line.rsplit(" ", 1)[1] for line in lines] == ["attempt=1", "attempt=2"]

        # fallbacks: the server refuses `dimensions`, and states its batch limit
        caplog.clear()
        mrl = q.EmbeddingClient(
            base_url=srv.base_url, api_key=SECRET, dimensions=256, batch_size=8, retry=fast_retry
        )
        assert len(mrl.embed_documents([f"text {i}" for i in range(5)])[0]) == 256
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("dimensions=256; slicing and renormalising client-side" in w for w in warnings)
        assert any("accepts at most 2 texts per request; splitting batches" in w for w in warnings)
        # every first try of a new request is attempt 1, fallback resends included
        assert {line.rsplit(" ", 1)[1] for line in _request_lines(caplog)} == {"attempt=1"}
    assert SECRET not in caplog.text
    assert all(SECRET not in str(r.args) for r in caplog.records)


def test_a_smooth_request_logs_nothing_above_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="qwen_embed_plugins")
    with EmbeddingServer() as srv:
        q.EmbeddingClient(base_url=srv.base_url).embed_query("quiet")
    assert not [r for r in caplog.records if r.name == "qwen_embed_plugins"]
