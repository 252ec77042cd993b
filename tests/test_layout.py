"""The package's layout: the core imports no tooling (CLI, benchmarks, test server) and no
framework, and no module grows past 900 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import qwen_embed_plugins

ROOT = Path(qwen_embed_plugins.__file__).parent
CORE = sorted(p for p in ROOT.glob("*.py") if p.name not in ("ray.py",))
TOOLING = ("cli", "_bench", "testing", "integrations", "ray")
FRAMEWORKS = ("langchain_core", "llama_index", "ray", "pydantic", "click", "rich")

pytestmark = pytest.mark.unit


def _imports(path: Path) -> set[str]:
    """The modules ``path`` imports (absolute names; relative ones made absolute)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = "qwen_embed_plugins"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = node.module or ""
                out.add(f"{package}.{base}" if base else package)
                if not base:
                    out.update(f"{package}.{alias.name}" for alias in node.names)
            elif node.module:
                out.add(node.module)
    return out


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_the_core_imports_no_tooling_and_no_framework(path: Path) -> None:
    imported = _imports(path)
    if path.name == "__init__.py":  # the front door resolves the adapters lazily
        imported = {m for m in imported if not m.startswith("qwen_embed_plugins.integrations")}
    tooling = {
        m
        for m in imported
        for t in TOOLING
        if m == f"qwen_embed_plugins.{t}" or m.startswith(f"qwen_embed_plugins.{t}.")
    }
    frameworks = {m for m in imported if m.split(".")[0] in FRAMEWORKS}
    assert not tooling, f"{path.name} imports {sorted(tooling)}"
    assert not frameworks, f"{path.name} imports {sorted(frameworks)}"


def test_no_module_above_900_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 900
    }
    assert not long, long
