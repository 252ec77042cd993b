"""The package's layout, read from the source (every module's AST):

- the core imports no tooling (CLI, frameworks) and no framework;
- the library never imports the tooling distribution (``qwen_embed_tooling``);
- no module imports a private name (``_x``) of a third-party package, nor reaches one
  through a third-party module (``httpx._config``);
- no import circles inside the library (every import counts: module level, inside a
  function, under ``TYPE_CHECKING``);
- no module grows past 1,000 lines.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

import qwen_embed_plugins

PACKAGE = "qwen_embed_plugins"
TOOLING_PACKAGE = "qwen_embed_tooling"
ROOT = Path(qwen_embed_plugins.__file__).parent
# the core: every module but the CLI, the framework adapters and Ray (subpackages included)
CORE = sorted(
    p
    for p in ROOT.rglob("*.py")
    if p.relative_to(ROOT).parts[0] not in ("cli", "integrations", "ray.py")
)
TOOLING = ("cli", "integrations", "ray")
FRAMEWORKS = ("langchain_core", "llama_index", "ray", "pydantic", "click", "rich")
pytestmark = pytest.mark.unit


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


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


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_core_imports_no_tooling_and_no_framework(path: Path) -> None:
    imported = _imports(path)
    if path == ROOT / "__init__.py":  # the front door resolves the adapters lazily
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


def test_no_module_above_1000_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 1000
    }
    assert not long, long


# --------------------------------------------------------------------------- imports


def _statements(name: str, path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """Every import of module ``name`` as ``(line, absolute module, imported names)``:
    ``import a.b`` gives ``("a.b", [])``, ``from .x import y`` ``("<package>.x", ["y"])``,
    ``importlib.import_module("a")`` with a literal name ``("a", [])``."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            yield node.lineno, module, [alias.name for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and not node.args[0].value.startswith(".")
        ):
            yield node.lineno, node.args[0].value, []


def _where(path: Path, line: int) -> str:
    shown = path.relative_to(ROOT.parent) if path.is_relative_to(ROOT.parent) else path
    return f"{shown}:{line}"


def _third_party(module: str) -> bool:
    top = module.split(".")[0]
    return bool(top) and top not in sys.stdlib_module_names and top != PACKAGE


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_third_party_names(name: str, path: Path) -> list[str]:
    """``path:line: what`` for each private name of a third-party package that module
    ``name`` imports (``from httpx._models import X``, ``from aiohttp import _x``,
    ``import urllib3._base``) or reaches through an imported third-party module
    (``httpx._config`` after ``import httpx`` or ``from ._http import httpx``)."""
    found: list[str] = []
    modules: set[str] = set()  # local names bound to third-party modules
    for line, module, names in _statements(name, path):
        where = _where(path, line)
        if _third_party(module):
            if any(_private(part) for part in module.split(".")):
                found.append(f"{where}: {module}")
            found.extend(f"{where}: {module}.{n}" for n in names if _private(n))
            if not names:
                modules.add(module.split(".")[0])
    # the HTTP library is chosen in _http and imported from there under its own name
    modules.update({"httpx", "httpx2"})
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            found.append(f"{_where(path, node.lineno)}: {ast.unparse(node)}")
    return found


def test_no_private_name_of_a_third_party_package_is_imported() -> None:
    """Only public APIs of the backends and frameworks (their private names change in
    any release). Private *attributes* of third-party objects (``loop._transports``)
    cannot be told from the AST without types: the transport rewrite removes those."""
    found = [f for name, path in MODULES.items() for f in private_third_party_names(name, path)]
    assert not found, "\n".join(found)


def test_the_private_name_check_finds_them(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import httpx\nimport urllib3._base_connection\nfrom aiohttp import _http_parser\n"
        "from h2._x import y\nfrom numpy import __version__, ndarray\nfrom ._http import httpx\n"
        "x = httpx._config\nimport os\nos._exit\n",
        encoding="utf-8",
    )
    found = [f.split(": ", 1)[1] for f in private_third_party_names(f"{PACKAGE}.probe", probe)]
    assert found == [
        "urllib3._base_connection",
        "aiohttp._http_parser",
        "h2._x",
        "httpx._config",
    ]


def test_the_library_never_imports_the_tooling() -> None:
    """The tooling (``qwen_embed_tooling``: test servers, bench, ``bench``/``serve``)
    imports the library, never the other way: the CLI finds the tooling's commands
    through the ``qwen_embed.commands`` entry points."""
    found = [
        f"{_where(path, line)}: {module}"
        for name, path in MODULES.items()
        for line, module, _ in _statements(name, path)
        if module.split(".")[0] == TOOLING_PACKAGE
    ]
    assert not found, "\n".join(found)


# --------------------------------------------------------------------------- circles


def import_graph() -> dict[str, set[str]]:
    """Module -> the library's modules it imports. ``from . import x`` is an edge to the
    submodule ``x`` (not to the package's ``__init__``); ``from . import Name`` to the
    ``__init__``. Parent packages run on import but are not edges (every module would
    otherwise import the front door)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        edges: set[str] = set()
        for _, module, names in _statements(name, path):
            submodules = {f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES}
            edges |= submodules
            if len(submodules) < len(names) or not names:
                edges.add(module)
        graph[name] = {m for m in edges if m in MODULES and m != name}
    return graph


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module
    (Tarjan's algorithm), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}
    assert circles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_at_all() -> None:
    assert circles(import_graph()) == []


# --------------------------------------------------------------------------- backends' privates

# The modules that drive a backend only through its public API (issue 19, Deliver 1):
# every module of the transport package.
PUBLIC_API_ONLY = tuple(
    sorted(str(p.relative_to(ROOT)) for p in (ROOT / "_transport").glob("*.py"))
)


def private_attribute_uses(source: str) -> list[str]:
    """Where ``source`` reads or assigns a private attribute (``_x``, not a dunder) of an
    object that is not its own: on anything but ``self``, or on ``self`` inside a class
    that derives from a third-party one (there ``self`` is the backend's object too);
    and every assignment to ``__class__``."""
    tree = ast.parse(source)
    found: list[str] = []

    def third_party_base(cls: ast.ClassDef) -> bool:
        # our own bases are bare names of this module; a dotted base (``aiohttp.X``) is not
        return any(isinstance(base, ast.Attribute) for base in cls.bases)

    def visit(node: ast.AST, foreign_self: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, third_party_base(child))
                continue
            if isinstance(child, ast.Attribute):
                name = child.attr
                on_self = isinstance(child.value, ast.Name) and child.value.id == "self"
                if name == "__class__" and isinstance(child.ctx, ast.Store):
                    found.append(f"line {child.lineno}: assigns __class__")
                elif (
                    name.startswith("_")
                    and not (name.startswith("__") and name.endswith("__"))
                    and (not on_self or foreign_self)
                ):
                    found.append(f"line {child.lineno}: .{name}")
            visit(child, foreign_self)

    visit(tree, False)
    return found


@pytest.mark.parametrize("name", PUBLIC_API_ONLY)
def test_backends_are_driven_through_their_public_api_only(name: str) -> None:
    """No reading or assigning of a private attribute of asyncio's, aiohttp's, httpx's
    or httpcore's objects (``connector._conns``, ``transport._sock``,
    ``loop._transports``...), and no ``__class__`` swap."""
    uses = private_attribute_uses((ROOT / name).read_text(encoding="utf-8"))
    assert uses == [], f"{name}: {uses}"


def test_the_private_attribute_check_finds_them() -> None:
    source = (
        "import aiohttp\n"
        "class Ours:\n"
        "    def f(self, connector, loop, wire):\n"
        "        self._mine = connector._conns\n"  # ours is fine, the connector's is not
        "        del loop._transports[3]\n"
        "        wire.__class__ = Ours\n"
        "        wire.__class__.__name__\n"  # a read of a dunder is fine
        "class Sub(aiohttp.TCPConnector):\n"
        "    def g(self):\n"
        "        return self._closed\n"  # self is aiohttp's object here
    )
    assert private_attribute_uses(source) == [
        "line 4: ._conns",
        "line 5: ._transports",
        "line 6: assigns __class__",
        "line 10: ._closed",
    ]
