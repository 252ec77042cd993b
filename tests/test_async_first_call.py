"""The first async call of a process imports nothing: the event-loop transport's HTTP
library (aiohttp) is loaded when the async-capable object is built, not on the event
loop inside its first call (where it blocked every other task and made a fresh
process's async call slower than the sync one). A sync-only core client never loads it.

Each case runs in a fresh interpreter (a module once imported stays imported) against
the test's loopback server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from qwen_embed_tooling.testing import EmbeddingServer

_CHILD = """
import asyncio, json, sys
base_url, kind = sys.argv[1], sys.argv[2]
if kind == "core_async":
    from qwen_embed_plugins import AsyncEmbeddingClient
    obj = AsyncEmbeddingClient(base_url=base_url)
    call = lambda texts: asyncio.run(obj.embed_documents(texts))
elif kind == "langchain":
    from qwen_embed_plugins import QwenPooledEmbeddings
    obj = QwenPooledEmbeddings(base_url=base_url)
    call = lambda texts: asyncio.run(obj.aembed_documents(texts))
elif kind == "llama_index":
    from qwen_embed_plugins import QwenPooledEmbedding
    obj = QwenPooledEmbedding(base_url=base_url)
    call = lambda texts: asyncio.run(obj.aget_text_embedding_batch(texts))
else:
    from qwen_embed_plugins import EmbeddingClient
    obj = EmbeddingClient(base_url=base_url)
    call = obj.embed_documents
built = set(sys.modules)
rows = call(["alpha", "beta", "gamma"])
print(json.dumps({
    "rows": len(rows),
    "dim": len(rows[0]),
    "loaded_when_built": "aiohttp" in built,
    "imported_by_call": sorted(
        m for m in set(sys.modules) - built if m.split(".")[0] in ("aiohttp", "yarl")
    ),
}))
"""


def _run(base_url: str, kind: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, base_url, kind],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,  # outer guard only
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("kind", ["core_async", "langchain", "llama_index"])
def test_first_async_call_imports_no_http_library(
    embedding_server: EmbeddingServer, kind: str
) -> None:
    got = _run(embedding_server.base_url, kind)
    assert got["rows"] == 3
    assert got["dim"] == 1024
    assert got["loaded_when_built"] is True
    assert got["imported_by_call"] == []
    assert embedding_server.requests >= 1  # the call really went to the server


def test_sync_core_client_never_loads_aiohttp(embedding_server: EmbeddingServer) -> None:
    got = _run(embedding_server.base_url, "core_sync")
    assert got["rows"] == 3
    assert got["loaded_when_built"] is False
    assert got["imported_by_call"] == []
