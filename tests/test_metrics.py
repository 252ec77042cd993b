"""Metrics: the Prometheus export equals what the server counted."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import qwen_embed_plugins as q
from qwen_embed_plugins.metrics import prometheus_collector
from qwen_embed_plugins.testing import EmbeddingServer

SECRET = "sk-prom-SECRET-123456"


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_prometheus_counters_equal_server_counts(caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.DEBUG)
    registry = CollectorRegistry()
    registry.register(prometheus_collector())
    with EmbeddingServer(api_key=SECRET) as srv:
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
