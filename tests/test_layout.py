"""The package's layout, read from the source (every module's AST):

- the core imports no tooling (CLI, frameworks) and no framework;
- the library never imports the tooling distribution (``qwen_embed_tooling``);
- no module imports a private name (``_x``) of a third-party package, nor reaches one
  through a third-party module (``httpx._config``);
- no import circles inside the library (every import counts: module level, inside a
  function, under ``TYPE_CHECKING``);
- no module of the library or the tooling grows past 800 lines.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import sys
import tokenize
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


MAX_LINES = 800
"""The longest module of either package, in lines (issue 29): a longer one is split by
concern (``_policy`` out of ``_config``, ``_check_report`` out of ``cli._check``)."""


def test_no_module_above_800_lines() -> None:
    """Every module of the library and of the tooling (``qwen_embed_tooling``)."""
    long = {
        str(p.relative_to(REPO)): n
        for p in SOURCES
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
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


# --------------------------------------------------------------------------- true docstrings

REPO = ROOT.parent
TOOLING_ROOT = REPO / "tooling" / TOOLING_PACKAGE
PACKAGES = {PACKAGE: ROOT, TOOLING_PACKAGE: TOOLING_ROOT}
SOURCES = sorted([*ROOT.rglob("*.py"), *TOOLING_ROOT.rglob("*.py")])

# A dotted name of either package, as prose writes it: `qwen_embed_plugins.ray.embed_files`.
_DOTTED = re.compile(rf"\b(?:{PACKAGE}|{TOOLING_PACKAGE})(?:\.[A-Za-z_]\w*)+")
# A quoted `module.member` (``_engine.Engine``, ``config.Secret``): checked when
# ``module`` is one of the packages' modules or a renamed one (``config`` for ``_config``).
_QUOTED = re.compile(r"`+(_?[a-z]\w*)\.([A-Za-z_]\w*)")
# A path of this repository: a root document (README.md, CHANGELOG.md, DESIGN.md), a page
# of the flat docs/ folder, or a file under one of the repository's folders. Other
# projects' paths have a subfolder in docs/ (vLLM's docs/models/pooling_models.md), or
# their project is named just before them (``documented by httpcore (docs/extensions.md)``).
_REPO_PATH = re.compile(
    r"(?<![\w/.-])(?:[A-Z][A-Z_-]+\.md"
    r"|docs/[\w.-]+\.md"
    r"|(?:bench|scripts|tests|tooling|qwen_embed_plugins|\.ci)/[\w./-]*\w)(?![\w/-])"
)
# A bare file name (``pool.py``): stale when the module was renamed (``_pool.py`` beside
# the file that names it) and no other project is named just before it (vLLM's
# ``protocol.py``).
_BARE_PY = re.compile(r"(?<![\w/.-])(_?[a-z]\w*)\.py\b")
_UPSTREAM = re.compile(
    r"\b(?:httpx|httpcore|aiohttp|vllm|sglang|tei|infinity|ollama|llama\.cpp|langchain|"
    r"llamaindex|uvicorn|hypercorn)\b",
    re.IGNORECASE,
)
# A measured result: a ratio (``~20x faster``, ``3.4x the naive client``), a time or rate
# with "~" (``~3 ms of CPU``), a rate with decimals (``2.1 req/s``), a signed change
# (``latency +50%``). Units and defaults of parameters (``timeout: seconds``, ``default
# 5 s``, ``rate: 10 req/s``, ``0.3: 30%``) match none of them.
_MEASURED = re.compile(
    r"\b\d+(?:\.\d+)?x (?:faster|slower|the|of|larger|smaller|more|less|fewer)\b"
    r"|~\s?\d[\d,.]*(?:-\d[\d,.]*)?\s?(?:ms|us|µs|s|req/s|texts/s)\b"
    r"|\b\d[\d,]*\.\d+\s?(?:req/s|requests/s|texts/s|rows/s)\b"
    r"|(?<!\w)[+-]\d+(?:\.\d+)?%"
)


def prose(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of every docstring (module, class, function, attribute) and every
    comment of ``path``."""
    source = path.read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            yield node.lineno, node.value.value
    block: list[str] = []  # a comment of consecutive lines is one text
    start = last = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line = token.start[0]
        if block and line != last + 1:
            yield start, "\n".join(block)
            block = []
        if not block:
            start = line
        block.append(token.string)
        last = line
    if block:
        yield start, "\n".join(block)


def _module_path(dotted: str) -> Path | None:
    """The source file of module ``dotted`` of either package, or ``None``."""
    top, *rest = dotted.split(".")
    base = PACKAGES[top].joinpath(*rest)
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _top_names(path: Path) -> set[str]:
    """The names module ``path`` defines or imports at its top level (``if``/``try``
    blocks included), and those its ``__all__`` lists (lazy attributes)."""
    names: set[str] = set()
    body = list(ast.parse(path.read_text(encoding="utf-8")).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                value = node.value
                if isinstance(value, ast.List | ast.Tuple):
                    names.update(e.value for e in value.elts if isinstance(e, ast.Constant))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.If | ast.Try):
            body.extend(node.body)
            body.extend(node.orelse)
            if isinstance(node, ast.Try):
                body.extend(node.finalbody)
                for handler in node.handlers:
                    body.extend(handler.body)
    return names


def _class_names(path: Path, cls: str) -> set[str] | None:
    """The names class ``cls`` of module ``path`` defines in its body, or ``None`` when
    ``cls`` is not a class there."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            found: set[str] = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    found.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    found.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    found.update(t.id for t in item.targets if isinstance(t, ast.Name))
            return found
    return None


def dotted_problem(dotted: str) -> str | None:
    """Why ``qwen_embed_plugins.x.y`` names nothing (``None`` when it names a module, a
    member of one, or a member of a class of one)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_path(".".join(parts[:cut]))
        if path is None:
            continue
        rest = parts[cut:]
        if not rest:
            return None
        if rest[0] not in _top_names(path):
            return f"{'.'.join(parts[:cut])} has no {rest[0]}"
        if len(rest) > 1:
            members = _class_names(path, rest[0])
            if members is not None and rest[1] not in members:
                return f"{'.'.join(parts[: cut + 1])} has no {rest[1]}"
        return None
    return "no such module"


def _modules_by_stem() -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for path in SOURCES:
        stem = path.parent.name if path.name == "__init__.py" else path.stem
        found.setdefault(stem, []).append(path)
    return found


def quoted_problem(module: str, member: str, by_stem: Mapping[str, list[Path]]) -> str | None:
    """Why a quoted ``module.member`` is stale: ``module`` was renamed (``config`` is now
    ``_config``, which has ``member``), or no module named ``module`` has ``member``."""
    if importlib.util.find_spec(module) is not None:
        return None  # a module outside the packages (``ray.init``, ``http.client``)
    if module in by_stem:
        if any(member in _top_names(p) for p in by_stem[module]):
            return None
        if any(_module_path_of(p, member) for p in by_stem[module]):
            return None
        return f"no module {module} has {member}"
    renamed = by_stem.get(f"_{module}", [])
    if any(member in _top_names(p) for p in renamed):
        return f"{module} is now _{module}"
    return None  # not a module reference (``config.model``: an attribute)


def _module_path_of(package_init: Path, member: str) -> bool:
    """``member`` is a submodule of the package whose ``__init__.py`` is ``package_init``."""
    if package_init.name != "__init__.py":
        return False
    folder = package_init.parent
    return (folder / f"{member}.py").is_file() or (folder / member / "__init__.py").is_file()


_ALIAS = re.compile(r"^from \.+[\w.]* import (_\w+) as (\w+)$", re.M)


def stale_references(path: Path, by_stem: Mapping[str, list[Path]]) -> list[str]:
    """``line: what`` for each name or path in ``path``'s docstrings and comments that does
    not exist (see ``dotted_problem``, ``quoted_problem``, ``_REPO_PATH``)."""
    found: list[str] = []
    # ``from . import _learn as learn``: in this file ``learn.X`` is that module's name
    aliases = set(_ALIAS.findall(path.read_text(encoding="utf-8")))
    for line, text in prose(path):
        for match in _DOTTED.finditer(text):
            if (problem := dotted_problem(match.group())) is not None:
                found.append(f"{line}: {match.group()} ({problem})")
        for match in _QUOTED.finditer(text):
            if match.group(1) in PACKAGES:
                continue  # a dotted name: checked above
            if (f"_{match.group(1)}", match.group(1)) in aliases:
                continue  # the module's name as this file imports it
            if (problem := quoted_problem(*match.groups(), by_stem)) is not None:
                found.append(f"{line}: {match.group().lstrip('`')} ({problem})")
        for match in _REPO_PATH.finditer(text):
            before = text[max(0, match.start() - 150) : match.start()]
            if "/" in match.group() and _UPSTREAM.search(before):
                continue  # another project's file
            if not (REPO / match.group()).exists():
                found.append(f"{line}: {match.group()} (not in the repository)")
        for match in _BARE_PY.finditer(text):
            name = match.group(1)
            before = text[max(0, match.start() - 150) : match.start()]
            if (
                not (path.parent / f"{name}.py").exists()
                and (path.parent / f"_{name}.py").exists()
                and not _UPSTREAM.search(before)
            ):
                found.append(f"{line}: {name}.py (now _{name}.py)")
    return found


def measured_figures(path: Path) -> list[str]:
    """``line: figure`` for each measured result in ``path``'s docstrings and comments."""
    return [
        f"{line}: {match.group()}"
        for line, text in prose(path)
        for match in _MEASURED.finditer(text)
    ]


_SOURCE_IDS = [str(p.relative_to(REPO)) for p in SOURCES]


@pytest.mark.parametrize("name", _SOURCE_IDS)
def test_docstrings_name_only_what_exists(name: str) -> None:
    """Every ``qwen_embed_plugins...`` / ``qwen_embed_tooling...`` name, quoted
    ``module.member`` and repository path (``README.md``, ``docs/x.md``, ``bench/x.py``)
    in a docstring or comment of the two packages exists."""
    assert not [p for p in (REPO / "docs").iterdir() if p.is_dir()], "docs/ is flat"
    found = stale_references(REPO / name, _modules_by_stem())
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("name", _SOURCE_IDS)
def test_no_benchmark_figure_in_a_docstring(name: str) -> None:
    """Measured results belong in docs/benchmarks.md, where their run is described."""
    found = measured_figures(REPO / name)
    assert found == [], "\n".join(found)


def test_the_docstring_checks_find_them(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        '"""The client (``_engine.Engine``, ``_engine.NoSuchFlow``); see DESIGN.md.\n\n'
        "Keys never pickled (``config.Secret``); ``config.model`` is an attribute.\n"
        "``qwen_embed_plugins.ray.embed_files``, ``qwen_embed_plugins.ray.no_such``,\n"
        "``qwen_embed_plugins.cli.check``, `qwen_embed_tooling.testing.EmbeddingServer`,\n"
        "docs/benchmarks.md, docs/nowhere.md, bench/compare.py, bench/gone.py, vLLM's\n"
        "docs/models/pooling_models.md, httpcore's docs/extensions.md; ``ray.init``.\n"
        '"""\n'
        "# SIMD base64: ~20x faster than binascii; the SDK costs ~3 ms of CPU per call\n"
        "# (see engine.py and _engine.py; SGLang's openai_api/\n"
        "# protocol.py is not ours)\n"
        "TIMEOUT = 5.0\n"
        '"""Seconds (default 5 s); tolerance 0.3 (30%); 2.1 req/s seen; latency +50%;\n'
        '3.4x the naive client; a 4x4 grid; max 10 req/s is the setting."""\n',
        encoding="utf-8",
    )
    for renamed in ("_engine.py", "_protocol.py"):  # modules beside the probe
        (tmp_path / renamed).write_text("", encoding="utf-8")
    stale = [f.split(" (")[0] for f in stale_references(probe, _modules_by_stem())]
    assert stale == [
        "1: qwen_embed_plugins.ray.no_such",
        "1: qwen_embed_plugins.cli.check",
        "1: _engine.NoSuchFlow",
        "1: config.Secret",
        "1: DESIGN.md",
        "1: docs/nowhere.md",
        "1: bench/gone.py",
        "9: engine.py",
    ]
    figures = [f.split(": ", 1)[1] for f in measured_figures(probe)]
    assert figures == ["2.1 req/s", "+50%", "3.4x the", "20x faster", "~3 ms"]
