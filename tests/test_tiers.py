"""The suite's own tiers and their machinery: the rule that marks the ``openai_major``
tests (tests/conftest.py), scripts/selects.py (what a ``-m`` expression needs set up), and
pytest-xdist's ``xdist_group`` (the Ray, real-server and docs-site tests each share one
worker's expensive set-up), which a pytest upgrade broke once without a word."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
CONFTEST = ROOT / "tests" / "conftest.py"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("expr", "marker", "needed"),
    [
        ("unit", "realserver", False),
        ("unit", "browser", False),
        ("not realserver", "realserver", False),
        ("not slow", "realserver", True),  # a realserver test that is not slow
        ("realserver and not slow", "realserver", True),
        ("unit or realserver", "realserver", True),
        ("vllm", "realserver", False),
        ("", "realserver", True),
        ("(unit", "realserver", True),  # unreadable: counts as "could select"
    ],
)
def test_selects_decides_what_a_marker_expression_needs(
    expr: str, marker: str, needed: bool
) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "selects.py"), expr, marker], check=False
    )
    assert done.returncode == (0 if needed else 1), (expr, marker)


def test_the_openai_major_rule_marks_the_sdk_and_http2_tests(pytester: pytest.Pytester) -> None:
    """The suite's collection hook (tests/conftest.py) on a file of sample tests: ``-m
    openai_major`` selects those whose source, parameters or fixtures reach the SDK, the
    HTTP/2 backend or a stock openai-based adapter, and the explicitly marked one."""
    pytester.makeconftest(
        f"""
        import importlib.util

        spec = importlib.util.spec_from_file_location("suite_conftest", {str(CONFTEST)!r})
        suite = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(suite)
        pytest_collection_modifyitems = suite.pytest_collection_modifyitems
        """
    )
    pytester.makeini(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
        "markers =\n    openai_major: x\n    unit: x\n"
    )
    pytester.makepyfile(
        """
        import pytest

        def test_sync_only(server):
            client = EmbeddingClient(base_url=server.base_url)

        def test_sdk(server):
            EmbeddingClient(base_url=server.base_url).openai_client()

        def test_h2(server):
            EmbeddingClient(base_url=server.base_url, http2=True)

        def test_stock(server):
            OpenAIEmbeddings(base_url=server.base_url)

        @pytest.mark.parametrize("path", ["sync", "h2_sync", "sdk_async"])
        def test_paths(path):
            pass

        def test_h2_fixture(h2_server):
            pass

        @pytest.mark.openai_major
        def test_explicit():
            pass

        @pytest.fixture
        def server(): ...

        @pytest.fixture
        def h2_server(): ...
        """
    )
    result = pytester.runpytest_subprocess(
        "--collect-only", "-q", "-m", "openai_major", "-p", "no:cacheprovider"
    )
    selected = {line.split("::", 1)[1] for line in result.outlines if "::" in line}
    assert selected == {
        "test_sdk",
        "test_h2",
        "test_stock",
        "test_paths[h2_sync]",
        "test_paths[sdk_async]",
        "test_h2_fixture",
        "test_explicit",
    }, result.outlines


def test_an_xdist_group_runs_in_one_worker(pytester: pytest.Pytester) -> None:
    """``--dist loadgroup`` (scripts/test.sh) keeps a group's tests in one worker: with 3
    workers and 6 tests of one group, exactly one worker runs them all."""
    pytester.makepyfile(
        """
        import os

        import pytest

        @pytest.mark.xdist_group("shared")
        @pytest.mark.parametrize("i", range(6))
        def test_grouped(i):
            with open("workers.txt", "a") as out:
                out.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
        """
    )
    result = pytester.runpytest_subprocess(
        "-n", "3", "--dist", "loadgroup", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=6)
    workers = (pytester.path / "workers.txt").read_text().split()
    assert len(workers) == 6
    assert len(set(workers)) == 1, f"the group was split across workers {sorted(set(workers))}"
