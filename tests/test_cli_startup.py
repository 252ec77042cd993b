"""``qwen-embed --help`` loads click and the command modules, nothing heavy: what it
imports is checked (in a fresh interpreter), not how long it takes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

import qwen_embed_plugins

# Run in a fresh interpreter: prints the modules the command loaded beyond those of
# `import qwen_embed_plugins`, so the CLI's own imports show apart from the package's.
_CHILD = """
import json, sys
{stub}
import qwen_embed_plugins
before = set(sys.modules)
from qwen_embed_plugins.cli import main
try:
    main({args!r})
except SystemExit as exc:
    assert exc.code == 0, exc.code
print("MODULES " + json.dumps(sorted(set(sys.modules) - before)))
"""

# The package __init__ replaced by an empty module: what the CLI costs by itself, once
# `import qwen_embed_plugins` is light.
_STUB = """
import types
_m = types.ModuleType("qwen_embed_plugins")
_m.__path__ = [{path!r}]
sys.modules["qwen_embed_plugins"] = _m
"""

HEAVY = (
    "numpy",
    "rich",
    "httpx",
    "httpx2",
    "openai",
    "orjson",
    "qwen_embed_plugins._client",
    "qwen_embed_tooling.testing",
    "qwen_embed_tooling.bench.run",
    "qwen_embed_plugins.cli._check",
    "qwen_embed_plugins.cli._output",
    "qwen_embed_plugins.cli._embed_job",
)


def loaded(args: list[str], *, stub: bool) -> list[str]:
    path = str(Path(qwen_embed_plugins.__file__).parent)
    code = _CHILD.format(stub=_STUB.format(path=path) if stub else "", args=args)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("MODULES "))
    modules: list[str] = orjson.loads(line.removeprefix("MODULES "))
    return modules


@pytest.mark.parametrize(
    "args",
    [["--help"], ["bench", "--help"], ["check", "--help"], ["embed", "--help"], ["--version"]],
)
@pytest.mark.parametrize("stub", [False, True])
def test_help_imports_nothing_heavy(args: list[str], stub: bool) -> None:
    modules = loaded(args, stub=stub)
    heavy = [m for m in modules if m.split(".")[0] in HEAVY or m in HEAVY]
    assert heavy == []
    assert "click" in modules
    assert "qwen_embed_tooling.cli.bench" in modules  # the commands are real modules
