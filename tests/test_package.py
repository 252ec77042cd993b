"""The package's front door: exports, lazy adapters, no framework at import time."""

from __future__ import annotations

import functools
import pathlib
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import qwen_embed_plugins as q

pytestmark = pytest.mark.unit  # no server, no socket


def test_all_is_exactly_the_public_api() -> None:
    public = {
        name
        for name in dir(q)
        if not name.startswith("_")
        and name not in {"annotations", "TYPE_CHECKING", "Any"}
        and not isinstance(getattr(q, name, None), type(sys))  # submodules
    }
    lazy = {"QwenPooledEmbeddings", "QwenPooledEmbedding"}
    assert set(q.__all__) == (public | lazy | {"__version__"})


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_import_loads_no_framework() -> None:
    result = _run(
        """
        import sys
        import openai  # openai 2.x itself imports click and rich
        before = set(sys.modules)
        import qwen_embed_plugins
        loaded = [m for m in set(sys.modules) - before if m.split('.')[0] in
                  ('langchain_core', 'llama_index', 'click', 'rich', 'uvicorn', 'starlette',
                   'tqdm', 'prometheus_client')]
        assert not loaded, loaded
        print('ok')
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_missing_extra_names_the_install_line() -> None:
    result = _run(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('langchain_core', 'llama_index'):
                    raise ModuleNotFoundError(f"No module named {name!r}")
        sys.meta_path.insert(0, Block())
        import qwen_embed_plugins
        for attr, extra in (('QwenPooledEmbeddings', 'langchain'),
                            ('QwenPooledEmbedding', 'llama-index')):
            try:
                getattr(qwen_embed_plugins, attr)
            except ImportError as exc:
                command = qwen_embed_plugins._install_command(extra)
                assert str(exc).endswith(command), str(exc)
                assert f"[{extra}]" in command, command
            else:
                raise SystemExit(f'{attr} imported without its framework')
        print('ok')
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_http_library_matches_openai_major() -> None:
    import openai

    from qwen_embed_plugins._transport import _http

    major = int(openai.__version__.split(".")[0])
    assert ("httpx2" if major >= 3 else "httpx") == _http.HTTP_LIBRARY
    client = q.EmbeddingClient(base_url="http://127.0.0.1:9/v1")
    from qwen_embed_plugins._transport import _sdk

    # the SDK's HTTP client is the matching library's Client over the library's own
    # transport class (openai 3.x accepts only httpx2 clients): built without error
    assert issubclass(_sdk.SDKTransport, _http.httpx.BaseTransport)
    assert issubclass(_sdk.AsyncSDKTransport, _http.httpx.AsyncBaseTransport)
    assert client.openai_client().max_retries == 0


def test_only_http_module_imports_the_http_library() -> None:
    import pathlib

    root = pathlib.Path(q.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if path.name in ("_http.py", "testing.py", "_relay.py"):
            continue
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith(("import httpx", "from httpx")):
                offenders.append(f"{path.name}: {stripped}")
    assert not offenders


# ------------------------------------------------------------------- dependency hygiene

# Runtime groups: what the package's modules may import. The tool extras (test, docs,
# lint) are for developing the package and are not imported by it.
_RUNTIME_GROUPS = ("langchain", "llama-index", "cli", "prometheus", "ray", "otel")
# Imported but rightly not declared by this project:
_NOT_DECLARED = {
    "httpx2": "the HTTP library of openai 3.x, which requires it; _http.py imports it only "
    "when openai 3.x is installed",
}
# Declared but never imported by name:
_NOT_IMPORTED = {
    "h2": "HTTP/2 support of httpx/httpx2 (http2=True); they import it",
}


def _requirement_name(spec: str) -> str:
    import re

    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    assert name, spec
    return re.sub(r"[-_.]+", "-", name.group(1)).lower()


def _declared() -> dict[str, set[str]]:
    """Normalised distribution names per group ("core" and each runtime extra)."""
    import pathlib
    import tomllib

    pyproject = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    groups = {"core": {_requirement_name(s) for s in project["dependencies"]}}
    extras = project["optional-dependencies"]
    for group in _RUNTIME_GROUPS:
        groups[group] = {_requirement_name(s) for s in extras[group]}
    return groups


def _imported_top_level_modules(
    root: pathlib.Path | None = None, own: str = "qwen_embed_plugins"
) -> dict[str, set[str]]:
    """Third-party top-level module -> files of the package importing it (``import``,
    ``from ... import`` and ``importlib.import_module("...")`` with a literal name)."""
    import ast

    root = root or pathlib.Path(q.__file__).parent
    found: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and not node.args[0].value.startswith(".")
            ):
                names = [node.args[0].value]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != own:
                    found.setdefault(top, set()).add(str(path.relative_to(root)))
    return found


def test_declared_dependencies_match_the_imports() -> None:
    """Every third-party module the package imports comes from a distribution that
    pyproject.toml declares (core or a runtime extra), and every declared runtime
    distribution is imported somewhere (or is listed above with the reason)."""
    from importlib.metadata import packages_distributions

    declared = _declared()
    all_declared = set().union(*declared.values())
    providers = packages_distributions()
    imported = _imported_top_level_modules()
    undeclared = {}
    used: set[str] = set()
    for module, files in sorted(imported.items()):
        if module in _NOT_DECLARED:
            continue
        dists = {_requirement_name(d) for d in providers.get(module, [])}
        assert dists, f"{module} (imported by {sorted(files)}) is not installed"
        if dists & all_declared:
            used |= dists & all_declared
        else:
            undeclared[module] = (sorted(dists), sorted(files))
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    unused = all_declared - used - set(_NOT_IMPORTED)
    assert not unused, f"declared but never imported by the package: {sorted(unused)}"


def test_the_tooling_declares_what_it_imports() -> None:
    """tooling/pyproject.toml (qwen-embed-tooling) declares every third-party
    distribution its package imports (the library's ``cli`` extra brings click and rich),
    and imports every one it declares."""
    import tomllib
    from importlib.metadata import packages_distributions

    import qwen_embed_tooling

    root = pathlib.Path(__file__).resolve().parents[1]
    tooling = tomllib.loads((root / "tooling" / "pyproject.toml").read_text(encoding="utf-8"))
    declared = {_requirement_name(spec) for spec in tooling["project"]["dependencies"]}
    assert "qwen-embed-plugins" in declared
    via_library = _declared()["cli"]
    providers = packages_distributions()
    imported = _imported_top_level_modules(
        pathlib.Path(qwen_embed_tooling.__file__).parent, "qwen_embed_tooling"
    )
    undeclared, used = {}, set()
    for module, files in sorted(imported.items()):
        dists = {_requirement_name(d) for d in providers.get(module, [])}
        if module == "qwen_embed_plugins":
            dists = {"qwen-embed-plugins"}
        assert dists, f"{module} (imported by {sorted(files)}) is not installed"
        if dists & (declared | via_library):
            used |= dists & declared
        else:
            undeclared[module] = (sorted(dists), sorted(files))
    assert not undeclared, f"imported but not declared in tooling/pyproject.toml: {undeclared}"
    assert declared - used == set(), f"declared but never imported: {sorted(declared - used)}"


# ------------------------------------------------ install lines (no release on PyPI)


class _Recorded:
    """A distribution whose ``direct_url.json`` (PEP 610) is ``text``."""

    def __init__(self, text: str | None) -> None:
        self.text = text

    def read_text(self, name: str) -> str | None:
        assert name == "direct_url.json"
        return self.text


@pytest.mark.parametrize(
    ("recorded", "command"),
    [
        (
            '{"url": "file:///src/qwen%20embed", "dir_info": {"editable": true}}',
            'pip install -e "/src/qwen embed[cli]"',
        ),
        (
            '{"url": "file:///src/qwen-embed-plugins", "dir_info": {}}',
            'pip install "qwen-embed-plugins[cli] @ file:///src/qwen-embed-plugins"',
        ),
        (
            '{"url": "https://git.example.org/qep.git", '
            '"vcs_info": {"vcs": "git", "commit_id": "abc"}}',
            'pip install "qwen-embed-plugins[cli] @ git+https://git.example.org/qep.git"',
        ),
        (
            None,  # installed from a wheel or an index: nothing recorded
            'pip install "qwen-embed-plugins[cli] @ file:///path/to/qwen-embed-plugins" '
            "(a checkout of this repository; there is no release on PyPI yet)",
        ),
    ],
    ids=["editable checkout", "checkout", "git", "unknown"],
)
def test_install_lines_name_where_this_copy_came_from(
    monkeypatch: pytest.MonkeyPatch, recorded: str | None, command: str
) -> None:
    """The missing-extra messages print a command that works today: never the bare
    `pip install 'qwen-embed-plugins[cli]'`, which fails (no release on PyPI)."""
    import importlib.metadata

    import qwen_embed_plugins

    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: _Recorded(recorded))
    assert qwen_embed_plugins._install_command("cli") == command


def test_no_printed_install_line_needs_a_release() -> None:
    """Every install line in the code, the docs and README installs from a checkout."""
    root = Path(__file__).resolve().parent.parent
    bare = re.compile(r"pip install ['\"]qwen-embed-plugins\[[a-z,-]+\]['\"]")
    files = [root / "README.md", *root.glob("docs/*.md"), *root.glob("qwen_embed_plugins/**/*.py")]
    offenders = [
        f"{path.relative_to(root)}:{text[: m.start()].count(chr(10)) + 1}"
        for path in files
        for text in [path.read_text(encoding="utf-8")]
        for m in bare.finditer(text)
    ]
    assert not offenders, offenders


# ------------------------------------------------------------------- the public surface

# The public modules: the front door, the exception tree, one entry module per framework,
# Ray Data and the command line. ``integrations`` only holds the two entry modules.
PUBLIC_MODULES = frozenset(
    {
        "qwen_embed_plugins",
        "qwen_embed_plugins.errors",
        "qwen_embed_plugins.integrations",
        "qwen_embed_plugins.integrations.langchain",
        "qwen_embed_plugins.integrations.llama_index",
        "qwen_embed_plugins.ray",
        "qwen_embed_plugins.cli",
    }
)


@functools.cache
def _package_modules() -> frozenset[str]:
    root = Path(q.__file__).parent
    modules = set()
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules.add(".".join(parts))
    return frozenset(modules)


def _is_private(dotted: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))


def test_the_public_modules_are_the_front_door_errors_and_one_per_framework() -> None:
    """Every other module is private (its name, or a package above it, starts with ``_``):
    users import from the front door, so the internals can move (issue 19, Deliver 7)."""
    public = {m for m in _package_modules() if not _is_private(m)}
    assert public == PUBLIC_MODULES, sorted(public ^ PUBLIC_MODULES)
    import ast

    namespace = Path(q.__file__).parent / "integrations" / "__init__.py"
    body = ast.parse(namespace.read_text(encoding="utf-8")).body
    assert all(isinstance(n, ast.Expr) for n in body), "integrations/ holds no API of its own"


# ``from X import names`` (parenthesised or not), ``import X``, mkdocstrings' ``::: X``
_DOC_REFERENCE = re.compile(
    r"(?<![\w.])(?:from\s+(?P<module>qwen_embed_plugins[\w.]*)\s+import\s+"
    r"(?P<names>\([^)]*\)|[\w ,]+)"
    r"|import\s+(?P<imported>qwen_embed_plugins[\w.]*)"
    r"|^:::\s+(?P<documented>qwen_embed_plugins[\w.]*))",
    re.MULTILINE,
)


def _resolves(module: str, attributes: str) -> bool:
    import importlib

    target: object = importlib.import_module(module)
    for name in attributes.split("."):
        if not hasattr(target, name):
            return False
        target = getattr(target, name)
    return True


def private_doc_references(text: str, exported: set[str]) -> list[str]:
    """``line: what`` for each import or API-reference entry of ``text`` that reaches a
    private module or name, or a front-door name missing from ``__all__``."""
    found = []
    for m in _DOC_REFERENCE.finditer(text):
        line = text[: m.start()].count("\n") + 1
        dotted = m.group("module") or m.group("imported") or m.group("documented")
        names = [
            n.split(" as ")[0].strip()
            for n in (m.group("names") or "").strip("()").replace("\n", " ").split(",")
            if n.strip()
        ]
        module, rest = dotted, ""
        if m.group("documented"):  # an object: its module is the longest known prefix
            while module not in _package_modules() and "." in module:
                module, _, last = module.rpartition(".")
                rest = f"{last}.{rest}" if rest else last
        if (
            _is_private(dotted)
            or any(_is_private(n) for n in names)
            or module not in PUBLIC_MODULES
            or (rest and not _resolves(module, rest))
        ):
            found.append(f"{line}: {m.group(0).strip()}")
        elif dotted == "qwen_embed_plugins":
            missing = [n for n in names if n not in exported and n not in {"errors", "ray"}]
            found += [f"{line}: {n} is not in qwen_embed_plugins.__all__" for n in missing]
    return found


def test_docs_and_readme_use_only_the_public_surface() -> None:
    """README.md and docs/*.md import (and the API reference documents) public paths
    only: ``from qwen_embed_plugins import prometheus_collector``, never
    ``qwen_embed_plugins._metrics``; what they import from the front door is exported."""
    root = Path(__file__).resolve().parent.parent
    found = [
        f"{path.relative_to(root)}:{where}"
        for path in [root / "README.md", *sorted(root.glob("docs/*.md"))]
        for where in private_doc_references(path.read_text(encoding="utf-8"), set(q.__all__))
    ]
    assert not found, "\n".join(found)


def test_the_docs_check_finds_them() -> None:
    pkg = "qwen_embed_plugins"  # the old public paths, spelled so that no rename rewrites them
    text = (
        "from qwen_embed_plugins import EmbeddingClient, prometheus_collector\n"
        "from qwen_embed_plugins._metrics import prometheus_collector\n"
        "from qwen_embed_plugins import (\n    EmbeddingClient,\n    _install_command,\n)\n"
        'python -c "from qwen_embed_plugins.cli._corpus import corpus"\n'
        "import qwen_embed_plugins._pool as pool\n"
        "::: qwen_embed_plugins.EmbeddingConfig\n"
        "::: qwen_embed_plugins._config.Limits\n"
        "from qwen_embed_plugins import pool_metrics\n"
        "the `qwen_embed_plugins._servers` module, in prose\n"
        f"from {pkg}.config import Limits\n"  # no such public module
        "::: qwen_embed_plugins.errors.ConfigError\n"
        "from qwen_embed_plugins.integrations.langchain import QwenPooledEmbeddings\n"
        f"::: {pkg}.metrics.prometheus_collector\n"
    )
    found = private_doc_references(text, set(q.__all__))
    assert [f.split(":")[0] for f in found] == ["2", "3", "7", "8", "10", "11", "13", "16"], found
