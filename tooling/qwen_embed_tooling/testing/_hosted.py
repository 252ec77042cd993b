"""Hosted APIs' dialects: DashScope and SiliconFlow (sources in each docstring).

Each serves a fixed list of MRL sizes per model (``_fixed_sizes``). The self-hosted
servers' dialects are in ``_dialects``, whose ``DIALECTS`` registers all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from ._common import (
    _EmbedRequest,
    _json_reply,
    _phrase,
    _Reply,
    _request_id,
    _tokens,
    _Vector,
)
from ._dialect import SGLangDialect

__all__ = ["DashScopeDialect", "SiliconFlowDialect"]


def _fixed_sizes(table: tuple[tuple[str, tuple[int, ...]], ...], model: str, dim: int) -> list[int]:
    lowered = model.lower()
    for suffix, sizes in table:
        if not suffix or lowered.endswith(suffix):
            return [s for s in sizes if s <= dim]
    return []


class DashScopeDialect(SGLangDialect):
    """Alibaba Cloud DashScope (Model Studio) in OpenAI-compatible mode
    (https://help.aliyun.com/zh/model-studio/text-embedding-synchronous-api and
    docs.qwencloud.com .../openai-embedding).

    API root ``/compatible-mode/v1``. At most 10 inputs per request (text-embedding-v3 /
    v4); ``dimensions`` one of 2048, 1536, 1024 (default), 768, 512, 256, 128, 64 (capped
    at ``dim``), else 400; ``encoding_format`` "Only float is supported" (base64 -> 400).
    Errors ``{"error": {"message", "type", "param", "code"}, "id", "request_id"}``; 429 on
    rate limits. (Exact error wordings are modelled on reported answers, not on source.)
    """

    name: ClassVar[str] = "dashscope"

    def msg_context(self, tokens: int, limit: int) -> str:
        return (
            "<400> InternalError.Algo.InvalidParameter: Range of input length should be "
            f"[1, {limit}]"
        )

    base_path: str = "/compatible-mode/v1"
    embeddings_path: str = "/compatible-mode/v1/embeddings"
    models_path: str | None = "/compatible-mode/v1/models"
    overload_status: ClassVar[int] = 429
    overload_message: ClassVar[str] = "Requests rate limit exceeded, please try again later."
    default_max_batch: ClassVar[int | None] = 10
    uvicorn_server_header: ClassVar[bool] = False
    sizes: ClassVar[tuple[tuple[str, tuple[int, ...]], ...]] = (
        ("text-embedding-v3", (64, 128, 256, 512, 768, 1024)),
        ("", (64, 128, 256, 512, 768, 1024, 1536, 2048)),
    )

    def error(self, status: int, message: str, *, err_type: str = "") -> _Reply:
        code = {400: "invalid_parameter_error", 401: "invalid_api_key", 429: "limit_requests"}.get(
            status, "internal_error"
        )
        kind = "invalid_request_error" if status < 500 else "internal_error"
        rid = _request_id()
        return _json_reply(
            status,
            {
                "error": {"message": message, "type": kind, "param": None, "code": code},
                "id": rid,
                "request_id": rid,
            },
        )

    def _invalid(self, what: str, field_name: str) -> _Reply:
        return self.error(
            400, f"<400> InternalError.Algo.InvalidParameter: Value error, {what}: {field_name}"
        )

    def status_error(self, status: int, message: str | None) -> _Reply:
        if message is None:
            message = self.overload_message if status == 429 else _phrase(status)
        return self.error(status, message)

    def request_error(self, message: str) -> _Reply:
        return self._invalid(message, "input")

    def unauthorized(self) -> _Reply:
        return self.error(401, "Incorrect API key provided. ")

    def batch_too_large(self, size: int, limit: int) -> _Reply:
        return self._invalid(
            f"batch size is invalid, it should not be larger than {limit}.", "input.contents"
        )

    def encoding(self, value: Any) -> _Reply | bool:
        if value not in (None, "float"):
            return self._invalid(
                "encoding_format is invalid, only float is supported.", "encoding_format"
            )
        return False

    def _dimensions(self, dimensions: Any) -> _Reply | None:
        allowed = _fixed_sizes(self.sizes, self.settings.model, self.settings.dim)
        if dimensions not in allowed or isinstance(dimensions, bool):
            return self._invalid(
                f"dimension is invalid, it should be one of {allowed}.", "parameters.dimension"
            )
        return None

    def embeddings(
        self, request: _EmbedRequest, vectors: Sequence[_Vector], *, nan_literal: bool = False
    ) -> bytes:
        tokens = _tokens(request)
        return self.dump(
            {
                "data": self.embedding_items(request, vectors, nan_literal=nan_literal),
                "model": self.settings.model,
                "object": "list",
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "id": _request_id(),
            }
        )

    def models(self) -> _Reply:
        card = {"id": self.settings.model, "object": "model", "created": 0, "owned_by": "system"}
        return _json_reply(200, {"object": "list", "data": [card]})


class SiliconFlowDialect(SGLangDialect):
    """SiliconFlow (https://docs.siliconflow.cn/cn/api-reference/embeddings/create-embeddings).

    API root ``/v1``. Errors ``{"code": int, "message", "data": null}``; a request with
    more than 64 inputs gets 413 ``{"code": 20042, "message": "input batch size N >
    maximum allowed batch size 64"}``; ``dimensions`` must be one of the model's sizes
    (Qwen3-Embedding-8B: 64..4096, 4B: ..2560, 0.6B: 64, 128, 256, 512, 768, 1024), else
    400 (code 20015); base64 accepted; 401 answers the JSON string ``"Invalid token"``;
    responses carry ``x-siliconcloud-trace-id``. (The batch limit is the issue's figure;
    the wordings are modelled, not taken from source.)
    """

    name: ClassVar[str] = "siliconflow"
    context_status: ClassVar[int] = 413

    def msg_context(self, tokens: int, limit: int) -> str:
        return f"input must have less than {limit} tokens, got {tokens}"  # modelled

    overload_status: ClassVar[int] = 429
    overload_message: ClassVar[str] = "Request was rejected due to rate limiting."
    default_max_batch: ClassVar[int | None] = 64
    uvicorn_server_header: ClassVar[bool] = False
    common_headers: ClassVar[tuple[tuple[bytes, bytes], ...]] = (
        (b"x-siliconcloud-trace-id", b"ti_qwenembedplugins0000"),
    )
    sizes: ClassVar[tuple[tuple[str, tuple[int, ...]], ...]] = (
        ("qwen3-embedding-8b", (64, 128, 256, 512, 768, 1024, 2048, 4096)),
        ("qwen3-embedding-4b", (64, 128, 256, 512, 768, 1024, 2048, 2560)),
        ("qwen3-embedding-0.6b", (64, 128, 256, 512, 768, 1024)),
    )

    def error(self, status: int, message: str, *, err_type: str = "") -> _Reply:
        code = {400: 20015, 413: 20042, 429: 50603}.get(status, 50500)
        return _json_reply(status, {"code": code, "message": message, "data": None})

    def status_error(self, status: int, message: str | None) -> _Reply:
        if message is None:
            message = self.overload_message if status == 429 else _phrase(status)
        return self.error(status, message)

    def request_error(self, message: str) -> _Reply:
        return self.error(400, message)

    def unauthorized(self) -> _Reply:
        return _Reply(401, b'"Invalid token"')

    def batch_too_large(self, size: int, limit: int) -> _Reply:
        return self.error(413, f"input batch size {size} > maximum allowed batch size {limit}")

    def _dimensions(self, dimensions: Any) -> _Reply | None:
        allowed = _fixed_sizes(self.sizes, self.settings.model, self.settings.dim)
        if dimensions not in allowed or isinstance(dimensions, bool):
            return self.error(400, f"The parameter is invalid: dimensions must be in {allowed}")
        return None

    def embeddings(
        self, request: _EmbedRequest, vectors: Sequence[_Vector], *, nan_literal: bool = False
    ) -> bytes:
        tokens = _tokens(request)
        return self.dump(
            {
                "model": self.settings.model,
                "data": self.embedding_items(request, vectors, nan_literal=nan_literal),
                "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
            }
        )

    def models(self) -> _Reply:
        card = {"id": self.settings.model, "object": "model", "created": 0, "owned_by": ""}
        return _json_reply(200, {"object": "list", "data": [card]})
