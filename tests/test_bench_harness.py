"""The side-by-side benchmark harness (bench/compare.py) runs end to end in its quick mode.

This checks that the harness completes against real loopback servers and writes a JSON
document with every row of issue 14's table, every variant in it, and sane numbers. It
does not judge speed: the numbers of a quick run on a loaded CI machine are not a
benchmark (docs/benchmarks.md has the real runs).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPARE = ROOT / "bench" / "compare.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.xdist_group("bench_harness"),  # the module's one bench run, in one worker
]

EXPECTED: dict[str, dict[str, set[str]]] = {
    "single_sync": {
        "c1": {
            "ours_embed_query",
            "ours_embed_documents_1",
            "openai_sdk",
            "stdlib_keepalive",
        }
    },
    "single_async": {c: {"ours_async_embed_query", "raw_aiohttp"} for c in ("c1", "c16", "c128")},
    "https_rtt": {
        ph: {"ours_async", "ours_sync_16_threads", "raw_aiohttp"} for ph in ("cold", "warm")
    },
    "batch_sync": {
        b: {
            "ours_embed_documents",
            "ours_embed_documents_array",
            "stdlib_keepalive",
            "stdlib_keepalive_array",
            "openai_sdk",
        }
        for b in ("batch32", "batch128")
    },
    "bulk": {
        "bulk": {
            "ours_langchain",
            "langchain_openai",
            "ours_llamaindex",
            "llamaindex_openai_like",
            "ours_core_array",
            "ours_core_list",
        }
    },
}


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "compare.json"
    proc = subprocess.run(
        [sys.executable, str(COMPARE), "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Side-by-side harness" in proc.stdout
    data: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return data


def test_every_row_and_variant_is_present(quick_run: dict[str, Any]) -> None:
    assert quick_run["schema"] == "qwen-embed-compare/1"
    assert quick_run["quick"] is True
    assert set(quick_run["rows"]) == set(EXPECTED)
    raw_httpx = f"raw_{quick_run['http_library']}"
    for row, phases in EXPECTED.items():
        got = quick_run["rows"][row]["phases"]
        assert set(got) == set(phases), row
        for phase, variants in phases.items():
            names = set(got[phase]["summary"])
            assert variants <= names, (row, phase, variants - names)
            if row in ("single_sync", "batch_sync"):
                assert raw_httpx in names, (row, phase)
            if row in ("single_async", "https_rtt"):
                assert f"{raw_httpx}_async" in names, (row, phase)


def test_numbers_are_measured(quick_run: dict[str, Any]) -> None:
    rows = quick_run["rows"]
    for row in ("single_sync", "single_async", "batch_sync", "https_rtt"):
        for phase, ph in rows[row]["phases"].items():
            for variant, s in ph["summary"].items():
                for key in ("cpu_us_per_request", "cpu_us_per_text", "req_per_s", "p50_ms"):
                    assert _positive(s[key]), (row, phase, variant, key, s[key])
                # every round measured as many requests as the row asked for
                runs = ph["runs"][variant]
                assert len(runs) == quick_run["rounds"]
                assert all(r["requests"] == runs[0]["requests"] > 0 for r in runs)
            for variant, r in ph["ours_over_peer"].items():
                assert _positive(r), (row, phase, variant)
    bulk = rows["bulk"]
    for variant, s in bulk["phases"]["bulk"]["summary"].items():
        assert s["rows"] == bulk["texts"], variant
        for key in ("texts_per_s", "cpu_us_per_text", "peak_rss_mib", "wall_s"):
            assert _positive(s[key]), (variant, key)
        assert s["peak_rss_mib"] >= s["peak_rss_before_mib"]
        assert s["connections_opened_server"] >= 1
    # HTTPS through the relay: the cold phase opened connections, the warm phase reused
    # them: 16 callers never need more than 16 connections in the two phases together
    rtt = rows["https_rtt"]["phases"]
    for variant, cold_runs in rtt["cold"]["runs"].items():
        warm_runs = rtt["warm"]["runs"][variant]
        for cold, warm in zip(cold_runs, warm_runs, strict=True):
            assert cold["connections_opened_server"] >= 1, variant
            opened = cold["connections_opened_server"] + warm["connections_opened_server"]
            assert opened <= 16, (variant, opened)


def test_default_json_path_is_bench_results() -> None:
    """Without --json the harness writes bench/results/compare.json (documented)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import compare
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert compare.RESULTS == ROOT / "bench" / "results"
    assert set(compare.ROWS) == set(EXPECTED)
