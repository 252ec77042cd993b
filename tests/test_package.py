"""The package's front door: exports, lazy adapters, no framework at import time."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
                assert f"pip install 'qwen-embed-plugins[{extra}]'" in str(exc), str(exc)
            else:
                raise SystemExit(f'{attr} imported without its framework')
        print('ok')
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_http_library_matches_openai_major() -> None:
    import openai

    from qwen_embed_plugins import _http

    major = int(openai.__version__.split(".")[0])
    assert ("httpx2" if major >= 3 else "httpx") == _http.HTTP_LIBRARY
    client = q.EmbeddingClient(base_url="http://127.0.0.1:9/v1")
    from qwen_embed_plugins import pool

    http_client = pool.get_sync_client(client.config.pool_key)
    assert type(http_client).__module__.split(".")[0] == _http.HTTP_LIBRARY
    # the SDK accepts the pool's SDK-facing client (a subclass of the same library's
    # Client: openai 3.x accepts only httpx2 clients)
    sdk_http = client.openai_client()._client
    assert isinstance(sdk_http, pool.SDKHTTPClient)
    assert isinstance(sdk_http, type(http_client))


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
