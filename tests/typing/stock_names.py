"""Type-checked, never run: the stock adapters' parameter names are constructor keywords
for a type checker (issue 22). ``mypy`` (strict, pyproject.toml) checks this file with
the library; a misspelled name and an alias read as an attribute must stay errors (the
``type: ignore`` comments fail as unused under ``warn_unused_ignores`` if they are not).
"""

from __future__ import annotations

from qwen_embed_plugins.integrations.langchain import QwenPooledEmbeddings
from qwen_embed_plugins.integrations.llama_index import QwenPooledEmbedding

URL = "http://127.0.0.1:9/v1"

langchain = QwenPooledEmbeddings(
    base_url=URL,
    chunk_size=16,
    timeout=30.0,
    default_headers={"X-Tenant": "acme"},
    model_kwargs={"truncate_prompt_tokens": 64},
    show_progress_bar=False,
)
langchain_too = QwenPooledEmbeddings(
    openai_api_key="sk-x",
    openai_api_base=URL,
    request_timeout=30,
    check_embedding_ctx_length=False,
    tiktoken_enabled=False,
    skip_empty=False,
)
llama_index = QwenPooledEmbedding(
    base_url=URL,
    embed_batch_size=16,
    timeout=30.0,
    default_headers={"X-Tenant": "acme"},
    additional_kwargs={"truncate_prompt_tokens": 64},
)
llama_index_too = QwenPooledEmbedding(api_base=URL, model="m", batch_size=8, reuse_client=True)

misspelled = QwenPooledEmbeddings(chunk_sise=16)  # type: ignore[call-arg]
wrong_type = QwenPooledEmbedding(timeout="30")  # type: ignore[arg-type]
not_an_attribute = langchain.chunk_size  # type: ignore[attr-defined]
