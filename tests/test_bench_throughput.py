"""bench/throughput.py runs end to end in its quick mode and writes a report of the
documented shape. Speeds are not judged: a quick run on a loaded CI machine is not a
benchmark (docs/benchmarks.md has the real run)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "throughput.py"

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.xdist_group("bench_throughput"),  # the module's one bench run, in one worker
]

OURS = {"ours_langchain", "ours_langchain_async", "ours_llamaindex", "ours_llamaindex_async"}
CLIENTS = {
    *OURS,
    "langchain_openai",
    "langchain_openai_async",
    "llamaindex_openai_like",
    "llamaindex_openai_like_async",
    "capacity",
}


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def _quick(out: Path, *args: str) -> tuple[str, dict[str, Any]]:
    """Run ``throughput.py --quick ARGS --json OUT``: (its printed tables, its report)."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", *args, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return proc.stdout, data


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    printed, data = _quick(tmp_path_factory.mktemp("bench") / "throughput.json")
    assert "ours / capacity" in printed  # the markdown table was printed
    return data


def test_report_shape(report: dict[str, Any]) -> None:
    assert report["benchmark"] == "throughput"
    assert report["rounds"] == 1
    assert report["environment"]["load_avg_at_start"] is not None
    assert report["environment"]["load_avg_at_end"] is not None
    assert [r["server"] for r in report["results"]] == ["constant"]
    result = report["results"][0]
    assert set(result["rows"]) == CLIENTS
    for name, row in result["rows"].items():
        assert _positive(row["texts_per_s"]), name
        assert len(row["runs"]) == report["rounds"], name
        assert row["requests"] >= 1, name
        assert all(isinstance(g, int) and g >= 0 for g in row["gc_full_passes"]), name
    assert set(result["capacity_setting"]) == {"batch", "in_flight"}
    assert result["capacity_grid"]


def test_ratios_for_every_one_of_ours(report: dict[str, Any]) -> None:
    ratios = report["results"][0]["ratios"]
    assert set(ratios) == OURS
    for name, values in ratios.items():
        want = {"vs_best_stock", "vs_capacity", "vs_capacity_per_round"} | (
            {"vs_own_sync"} if name.endswith("_async") else set()
        )
        assert set(values) == want, name
        assert all(_positive(v) for v in values.values()), name


def test_sizes_compare_ours_async_with_ours_sync(tmp_path: Path) -> None:
    printed, data = _quick(tmp_path / "sizes.json", "--sizes", "20,50")
    assert "async / sync" in printed
    assert data["benchmark"] == "throughput-sizes"
    assert [s["texts"] for s in data["sizes"]] == [20, 50]
    for size in data["sizes"]:
        assert set(size["texts_per_s"]) == OURS
        assert all(_positive(v) for v in size["texts_per_s"].values())
        assert set(size["async_vs_sync"]) == {"ours_langchain", "ours_llamaindex"}
        assert all(_positive(v) for v in size["async_vs_sync"].values())
        assert set(size["gc_full_passes"]) == OURS


def test_no_worker_collects_inside_its_timed_call(server: Any) -> None:
    """Every client's timed call, the ideal client's included, runs no full garbage
    collection of its own: with the automatic collector off, the only full passes are
    explicit ones. (The ideal client once ran ``_harness.run_sync``, whose collection
    before its own clock fell inside the call: its capacity was understated.)"""
    workers = sorted(CLIENTS)
    code = (
        "import gc, json, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'bench')!r})\n"
        "import throughput\n"
        "gc.disable()\n"
        f"print(json.dumps({{w: throughput.embed_once(w, {server.base_url!r}, "
        f"{server.model!r}, 40, 8, 2)['gc_full_passes'] for w in {workers!r}}}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    passes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert passes == dict.fromkeys(workers, 0)
