"""Every ```python block of README.md and docs/*.md runs against a loopback server.

Each block is executed on its own (fresh namespace, ``__name__ != "__main__"``) with
``QWEN_EMBED_BASE_URL`` pointing at a fresh `EmbeddingServer`; URLs of placeholder hosts
ending in ``/v1`` (``http://gpu-box:30000/v1``, ``https://embed.example.org/v1``...) are
rewritten to the server's base URL. A ``print(...)  # text`` line documents its output:
the printed lines must contain every such ``text``, in order.

A block that cannot run is marked by the HTML comment ``<!-- not-run: reason -->`` on the
line before its fence; it is still compiled. docs/langchain.md is left to
tests/test_langchain.py, which runs its blocks and checks their output.

docs/vector-stores.md prints what a real model retrieves: here its blocks must run (the
flows work on meaningless vectors); their printed lines are checked against Infinity
serving all-MiniLM-L6-v2 by tests/realserver/test_vector_stores.py.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from qwen_embed_plugins import close_all
from qwen_embed_tooling.testing import EmbeddingServer

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Run (and checked line by line) by tests/test_langchain.py.
SNIPPETS_TESTED_ELSEWHERE = {ROOT / "docs" / "langchain.md": ROOT / "tests" / "test_langchain.py"}
# Printed lines are a real model's answers, checked by tests/realserver/test_vector_stores.py.
REAL_MODEL_OUTPUT = {ROOT / "docs" / "vector-stores.md"}
MAX_NOT_RUN = 0

_BLOCK = re.compile(
    r"(?:^<!--\s*not-run:\s*(?P<reason>.*?)\s*-->\n)?"
    r"(?:^<!--\s*run-by:\s*(?P<runner>\S+)\s*-->\n)?^```python\n(?P<code>.*?)^```",
    re.S | re.M,
)
_PLACEHOLDER_URL = re.compile(r"https?://[A-Za-z0-9.\-]+(?::\d+)?/v1\b")
_EXPECTED = re.compile(r"^\s*print\(.*\)\s+#\s*(?P<out>.+?)\s*$", re.M)


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int
    code: str
    not_run: str | None  # the reason, for a block marked not-run

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _snippets(path: Path) -> list[Snippet]:
    text = path.read_text(encoding="utf-8")
    out = []
    for m in _BLOCK.finditer(text):
        if m.group("runner"):  # run by that test module (e.g. it needs a Ray instance)
            runner = ROOT / m.group("runner")
            assert path.name in runner.read_text(encoding="utf-8"), (path, runner)
            continue
        line = text.count("\n", 0, m.start("code"))  # 1-based line of the ```python fence
        out.append(Snippet(path, line, m.group("code"), m.group("reason")))
    return out


ALL = [s for p in DOC_FILES if p not in SNIPPETS_TESTED_ELSEWHERE for s in _snippets(p)]
RUNNABLE = [s for s in ALL if s.not_run is None]


@pytest.fixture
def srv() -> Iterator[EmbeddingServer]:
    # A fresh server per block: a new port is a new endpoint label, so the counters a
    # snippet prints (requests, connections) start at zero.
    with EmbeddingServer() as server:
        yield server
    close_all()


@contextlib.contextmanager
def _restored_global_state() -> Iterator[None]:
    """Undo what snippets change process-wide: environment, LlamaIndex Settings, logging,
    Chroma's in-memory databases (one per process, so a block's ``create_collection``
    would find the previous block's)."""
    from llama_index.core import Settings

    environ = dict(os.environ)
    embed_model = Settings._embed_model
    logger = logging.getLogger("qwen_embed_plugins")
    level = logger.level
    root_handlers = list(logging.getLogger().handlers)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        Settings._embed_model = embed_model
        logger.setLevel(level)
        logging.getLogger().handlers[:] = root_handlers
        if "chromadb" in sys.modules:
            from chromadb.api.client import SharedSystemClient

            SharedSystemClient.clear_system_cache()


def run_snippet(snippet: Snippet, base_url: str) -> str:
    """Execute a block against ``base_url``; return what it printed."""
    code = _PLACEHOLDER_URL.sub(base_url, snippet.code)
    namespace: dict[str, Any] = {"__name__": "docs_snippet"}
    out = io.StringIO()
    with _restored_global_state(), contextlib.redirect_stdout(out):
        os.environ["QWEN_EMBED_BASE_URL"] = base_url
        exec(compile(code, snippet.id, "exec"), namespace)
    return out.getvalue()


def _assert_documented_output(snippet: Snippet, printed: str) -> None:
    lines = iter(line.strip() for line in printed.splitlines())
    for want in (m.group("out") for m in _EXPECTED.finditer(snippet.code)):
        assert any(line == want for line in lines), (
            f"{snippet.id}: expected a printed line {want!r} (in order); printed:\n{printed}"
        )


@pytest.mark.parametrize("snippet", RUNNABLE, ids=lambda s: s.id)
def test_snippet_runs(snippet: Snippet, srv: EmbeddingServer) -> None:
    printed = run_snippet(snippet, srv.base_url)
    if snippet.path not in REAL_MODEL_OUTPUT:
        _assert_documented_output(snippet, printed)


@pytest.mark.unit
def test_not_run_snippets_compile() -> None:
    for snippet in ALL:
        if snippet.not_run is not None:
            assert snippet.not_run, f"{snippet.id}: a not-run block must say why"
            compile(snippet.code, snippet.id, "exec")


@pytest.mark.unit
def test_snippet_inventory() -> None:
    files = {s.path for s in ALL}
    for name in ("README.md", "docs/index.md", "docs/metrics.md", "docs/errors.md"):
        assert ROOT / name in files, f"no python block found in {name}"
    assert len(ALL) - len(RUNNABLE) <= MAX_NOT_RUN, [s.id for s in ALL if s.not_run]
    for doc in REAL_MODEL_OUTPUT:
        text = doc.read_text(encoding="utf-8")
        assert _EXPECTED.search(text), f"{doc.name} prints nothing"
    for snippet in ALL:  # a print split over lines (ruff format) would go unchecked
        if snippet.path in REAL_MODEL_OUTPUT:
            calls = re.findall(r"^\s*print\(", snippet.code, re.M)
            checked = _EXPECTED.findall(snippet.code)
            assert len(calls) == len(checked), f"{snippet.id}: a print( without its output"
    for doc, test in SNIPPETS_TESTED_ELSEWHERE.items():
        assert _snippets(doc), f"{doc.name} has no python block"
        runner = test.read_text(encoding="utf-8")
        assert doc.name in runner, f"{test.name} no longer runs {doc.name}"


@pytest.mark.unit
def test_output_check_catches_a_wrong_comment() -> None:
    wrong = Snippet(ROOT / "README.md", 1, "print(1 + 1)  # 3\n", None)
    with pytest.raises(AssertionError, match="expected a printed line '3'"):
        _assert_documented_output(wrong, "2\n")


@pytest.mark.unit
def test_placeholder_hosts_are_rewritten() -> None:
    code = 'a = "http://gpu-box:30000/v1"\nb = "https://embed.example.org/v1"\n'
    assert _PLACEHOLDER_URL.sub("http://127.0.0.1:1/v1", code) == (
        'a = "http://127.0.0.1:1/v1"\nb = "http://127.0.0.1:1/v1"\n'
    )


# ------------------------------------------------------------- README facts that drift


def _readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def _pyproject_extras() -> set[str]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return set(project["optional-dependencies"])


@pytest.mark.unit
def test_readme_lists_every_extra_and_installs_only_real_ones() -> None:
    readme = _readme()
    section = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    table = set(re.findall(r"^\| `([a-z0-9-]+)` \| .+ \| .+ \|$", section, re.M))
    extras = _pyproject_extras()
    assert table == extras, f"README's extras table: {sorted(table)}; pyproject: {sorted(extras)}"
    install = r"qwen-embed-plugins\[([a-z0-9,-]+)\]|\"\.\[([a-z0-9,-]+)\]\""
    used = {
        name
        for group in re.findall(install, readme)
        for names in group
        for name in names.split(",")
        if name
    }
    assert used, "README installs no extra"
    assert used <= extras, f"README installs unknown extras {sorted(used - extras)}"


@pytest.mark.unit
def test_readme_serve_options_exist(capsys: pytest.CaptureFixture[str]) -> None:
    from qwen_embed_plugins.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    help_text = capsys.readouterr().out
    section = _readme().split("## A local server", 1)[1].split("\n## ", 1)[0]
    options = set(re.findall(r"^\| `(--[a-z0-9-]+)` \|", section, re.M))
    assert len(options) >= 5, options
    missing = sorted(o for o in options if o not in help_text)
    assert not missing, f"README documents serve options that do not exist: {missing}"


# The one-line conclusion of `qwen-embed bench` as README.md and docs/cli.md quote it
# (a line break may fall between any two words).
_CONCLUSION = re.compile(
    r"pooled\s+async:\s+(?P<ratio>\d+\.\d)x\s+the\s+naive\s+client's\s+req/s\s+"
    r"\((?P<pooled>[\d,]+)\s+vs\s+(?P<naive>[\d,]+)\),\s+"
    r"(?P<pooled_conns>\d+)\s+vs\s+(?P<naive_conns>\d+)\s+connections"
)


def test_the_quoted_bench_conclusions_are_what_a_default_run_prints() -> None:
    """issue 32: the conclusion README.md and docs/cli.md quote has the form a real run
    prints (a short one here, against a loopback server), its ratio is the quotient of
    the two rates it quotes, and its connections are a default run's: `--concurrency`
    (16) for the pooled client, one per request (`--requests`, 200) for the naive one
    (the old quote said 16 vs 60)."""
    from qwen_embed_tooling.bench.run import Target, run_bench
    from qwen_embed_tooling.cli.bench import bench

    defaults = {p.name: p.default for p in bench.params}
    requests, concurrency = defaults["n_requests"], defaults["concurrency"]
    quotes = [
        (path.relative_to(ROOT), m)
        for path in (ROOT / "README.md", ROOT / "docs" / "cli.md")
        for m in _CONCLUSION.finditer(path.read_text(encoding="utf-8"))
    ]
    assert len(quotes) >= 3, quotes  # README, cli.md's table example and its --json sample
    for where, m in quotes:
        pooled, naive = (int(m.group(g).replace(",", "")) for g in ("pooled", "naive"))
        ratio = float(m.group("ratio"))
        # the rates are rounded to units, the ratio (of the unrounded rates) to 0.1
        low, high = (pooled - 0.5) / (naive + 0.5), (pooled + 0.5) / (naive - 0.5)
        assert low - 0.05 <= ratio <= high + 0.05, (where, m.group(0))
        assert int(m.group("pooled_conns")) == concurrency, (where, m.group(0))
        assert int(m.group("naive_conns")) == requests, (where, m.group(0))

    with EmbeddingServer() as srv:
        result = run_bench(
            Target(srv.base_url, model=srv.model),
            requests=12,
            concurrency=3,
            modes=("naive", "pooled_async"),
            warmup=False,
        )
    line = result.conclusion()
    m = _CONCLUSION.fullmatch(line)
    assert m, line
    assert (m.group("pooled_conns"), m.group("naive_conns")) == ("3", "12"), line
