"""LangChain's standard embeddings suites (``langchain-tests``, pinned) for
``QwenPooledEmbeddings``; the integration suite runs against the loopback server.

No standard test is overridden or skipped: ``test_no_overrides_DO_NOT_OVERRIDE`` (part
of each suite) checks that.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from langchain_tests.integration_tests import EmbeddingsIntegrationTests
from langchain_tests.unit_tests import EmbeddingsUnitTests

from qwen_embed_plugins.integrations.langchain import QwenPooledEmbeddings
from qwen_embed_tooling.testing import EmbeddingServer

# Constructing an instance opens nothing, so the unit suite needs no server: nothing
# listens on this port and nothing ever connects to it.
UNUSED_URL = "http://127.0.0.1:9/v1"


class TestQwenPooledEmbeddingsUnit(EmbeddingsUnitTests):
    pytestmark = pytest.mark.unit  # constructs instances only: nothing connects

    @property
    def embeddings_class(self) -> type[QwenPooledEmbeddings]:
        return QwenPooledEmbeddings

    @property
    def embedding_model_params(self) -> dict[str, Any]:
        return {"base_url": UNUSED_URL}

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        return (
            {
                "QWEN_EMBED_API_KEY": "sk-from-env",
                "QWEN_EMBED_BASE_URL": UNUSED_URL,
                "QWEN_EMBED_MODEL": "Qwen/Qwen3-Embedding-4B",
            },
            {"dimensions": 256},
            {
                "api_key": "sk-from-env",
                "base_url": UNUSED_URL,
                "model": "Qwen/Qwen3-Embedding-4B",
                "dimensions": 256,
            },
        )


# one xdist worker for the class: its server fixture counts every test's requests
@pytest.mark.xdist_group("langchain_standard")
class TestQwenPooledEmbeddingsIntegration(EmbeddingsIntegrationTests):
    base_url: str = ""

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _loopback_server(cls) -> Iterator[None]:
        with EmbeddingServer() as srv:
            cls.base_url = srv.base_url
            yield
            # every standard test really went over the wire
            assert srv.requests == 8  # 2 queries + 2 batches of 2, sync and async

    @property
    def embeddings_class(self) -> type[QwenPooledEmbeddings]:
        return QwenPooledEmbeddings

    @property
    def embedding_model_params(self) -> dict[str, Any]:
        assert self.base_url, "the loopback server fixture did not run"
        return {"base_url": self.base_url, "batch_size": 2}
