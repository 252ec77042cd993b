"""``qwen-embed check`` against the real Infinity server (it took 38 s there: an ascending
series of batches of long passages through MiniLM, then the keep-alive probe's idle wait
after everything else). The time is recorded in the run's figures, not asserted."""

from __future__ import annotations

import time
from typing import Any

from qwen_embed_plugins.cli._check import check_server

MINILM = "all-MiniLM-L6-v2"


def test_check_against_infinity_minilm(realserver: Any, figures: dict[str, Any]) -> None:
    started = time.perf_counter()
    report = check_server(realserver.base_url, model=MINILM)
    figures["qwen-embed check, MiniLM on Infinity, seconds"] = round(
        time.perf_counter() - started, 1
    )
    found = {f.name: f for f in report.findings}
    assert report.ok, [(f.name, f.status, f.summary) for f in report.findings]
    assert found["embedding"].value == {"dim": 384, "norm": 1.0}
    assert found["batch_limit"].value == 128  # Infinity takes 2,048: the probe's bound
    idle = found["keepalive"].value
    assert isinstance(idle, float)
    assert 4.5 <= idle <= 6.0  # Infinity's (uvicorn's) 5 s
    assert report.server is not None
    assert report.server.name == "infinity"
