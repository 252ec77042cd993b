"""docs/vector-stores.md against a real model: every block runs against Infinity serving
all-MiniLM-L6-v2 (``model="all-MiniLM-L6-v2"`` in the blocks) and prints exactly the
passages the page says it retrieves. (tests/test_docs.py runs the same blocks against the
loopback server, whose vectors mean nothing: there only the flows are checked.)"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from qwen_embed_plugins import close_all

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "vector-stores.md"


def _docs_runner() -> ModuleType:
    """tests/test_docs.py, which parses and runs the docs' blocks (loaded by path: this
    folder is not a package)."""
    spec = importlib.util.spec_from_file_location("_docs_runner", ROOT / "tests" / "test_docs.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


DOCS = _docs_runner()
SNIPPETS = [s for s in DOCS._snippets(PAGE) if s.not_run is None]


def test_the_page_has_its_blocks() -> None:
    assert len(SNIPPETS) >= 6, [s.id for s in SNIPPETS]


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: s.id)
def test_vector_store_block_retrieves_with_minilm(
    snippet: Any, realserver: Any, figures: dict[str, Any]
) -> None:
    started = time.perf_counter()
    try:
        printed = DOCS.run_snippet(snippet, realserver.base_url)
    finally:
        close_all()
    figures[f"docs {snippet.id} (MiniLM), seconds"] = round(time.perf_counter() - started, 1)
    DOCS._assert_documented_output(snippet, printed)
