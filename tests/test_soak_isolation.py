"""The failure-isolation soak (issue 13): 20,000 texts, one poisonous input per 1,000, 5%
transient faults, a 5 s server restart and a 3 s 429 window in the middle.

With ``on_error="skip"`` every good text is embedded exactly, the poisonous ones are
reported by index, and the breaker never opens; with ``"raise"`` the first poisonous
index is named. The figures are printed (``-s``) for the record."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins import _balance as balance
from qwen_embed_tooling.testing import EmbeddingServer, expected_embeddings

pytestmark = pytest.mark.slow

N = 20_000
TEXTS = [f"soak document {i}: {'lorem ipsum ' * (1 + i % 7)}" for i in range(N)]
POISONED = list(range(437, N, 1000))  # one per 1,000


def wait_until(condition: object, what: str, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_soak_skip_embeds_every_good_text_through_a_restart_and_a_429_window() -> None:
    with EmbeddingServer(latency=0.002) as srv:
        for i in POISONED:
            srv.poison(TEXTS[i])
        srv.set_random_faults(0.05, seed=13)
        client = q.EmbeddingClient(base_url=srv.base_url, batch_size=32, max_concurrency=4)
        before = q.stats().get(client.config.endpoint, {})
        result: dict[str, object] = {}
        marks: dict[str, float] = {}

        def run() -> None:
            started = time.monotonic()
            try:
                result["out"] = client.embed_documents_array(TEXTS, on_error="skip")
            except BaseException as exc:
                result["error"] = exc
            marks["seconds"] = time.monotonic() - started

        worker = threading.Thread(target=run)
        worker.start()
        wait_until(lambda: srv.stats()["texts"] >= N // 3, "a third of the texts")
        t0 = time.monotonic()
        srv.restart(downtime=5.0)  # rules and random faults survive the restart
        marks["restart_at"] = t0
        wait_until(lambda: srv.stats()["texts"] >= (2 * N) // 3, "two thirds of the texts")
        srv.status_window(3.0, status=429)
        worker.join()
        assert "error" not in result, result.get("error")
        out = result["out"]
        assert isinstance(out, q.EmbeddingResult)
        assert sorted(out.errors) == POISONED
        good = [i for i in range(N) if i not in set(POISONED)]
        np.testing.assert_array_equal(
            out.vectors[good], expected_embeddings([TEXTS[i] for i in good])
        )
        assert np.isnan(out.vectors[POISONED]).all()
        assert balance.endpoint_for(client.config).opened == 0
        snap = q.stats()[client.config.endpoint]
        stats = srv.stats()
        retries = snap["retries"] - before.get("retries", 0)
        bisections = snap["fallbacks"].get("bisections", 0) - before.get("fallbacks", {}).get(
            "bisections", 0
        )
        print(
            f"\nsoak: texts={N} poisoned={len(POISONED)} skipped={sorted(out.errors)[:3]}..."
            f" faults={sum(stats['faults_applied'].values())} ({stats['faults_applied']})"
            f" bisections={bisections} retries={retries} requests={stats['requests']}"
            f" breaker_opens={balance.endpoint_for(client.config).opened}"
            f" seconds={marks['seconds']:.1f} (with a 5 s restart and a 3 s 429 window)"
        )


def test_soak_raise_names_the_first_poisonous_index() -> None:
    with EmbeddingServer(latency=0.002) as srv:
        for i in POISONED:
            srv.poison(TEXTS[i])
        srv.set_random_faults(0.05, seed=14)
        client = q.EmbeddingClient(base_url=srv.base_url, batch_size=32, max_concurrency=4)
        with pytest.raises(q.ServerError) as info:
            client.embed_documents_array(TEXTS[:5000])
        assert info.value.index == POISONED[0]
        assert f"input index {POISONED[0]}" in str(info.value)
