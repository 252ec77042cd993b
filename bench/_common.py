"""Shared helpers of the benchmark scripts (not a public API).

Every script measures ratios side by side in ONE run, on loopback, against the
``EmbeddingServer`` in a child process (so the server never shares the client's GIL,
and the client's CPU time is its own), and reports medians of repeated runs.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openai

from qwen_embed_plugins._transport._http import HTTP_LIBRARY

RESULTS = Path(__file__).resolve().parent / "results"


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def environment() -> dict[str, Any]:
    """What the numbers were measured on."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "python": platform.python_version(),
        "openai": openai.__version__,
        "http_library": HTTP_LIBRARY,
        "cpus": os.cpu_count(),
        "load_1min_at_start": round(load, 2) if load is not None else None,
        "platform": platform.platform(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def command_line() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]])


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) < 10:
            return f"{value:.3g}"
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; numbers right-aligned."""

    def cell(v: Any) -> str:
        return v if isinstance(v, str) else fmt(v)

    body = [[cell(v) for v in row] for row in rows]
    numeric = re.compile(r"^[-+]?[\d,.]+(x| / [\d,.]+)?$|^-$")
    align = [
        "---:" if body and all(numeric.match(r[i]) for r in body) else "---"
        for i in range(len(headers))
    ]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def save(name: str, data: dict[str, Any], path: str | None) -> Path:
    """Write ``data`` as JSON to ``path`` (default ``bench/results/<name>.json``)."""
    out = Path(path) if path else RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return out


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (Linux: ru_maxrss KiB)."""
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024.0 if sys.platform != "darwin" else kib / (1024.0 * 1024.0)


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) used so far by process ``pid`` (Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks
