"""The SGLang dialect: the base class every other server's dialect overrides."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import orjson

from ._common import (
    QUEUE_FULL_MESSAGE,
    _EmbedRequest,
    _phrase,
    _Reply,
    _Settings,
    _Vector,
    _vector,
    count_tokens,
)


class SGLangDialect:
    """How SGLang's OpenAI-compatible server answers: paths, validation, bodies, errors.

    `EmbeddingServer` asks its dialect for every answer, so another server's behaviour
    (vLLM, TEI, Infinity, Ollama, llama.cpp, DashScope, SiliconFlow) is a subclass that
    overrides the class attributes and the methods that differ, registered under
    `SGLangDialect.name` in ``DIALECTS``. Messages follow SGLang's
    ``serving_embedding.py`` / ``tokenizer_manager.py``; where SGLang's message does not
    name the offending input, this one adds its index.
    """

    name: ClassVar[str] = "sglang"
    #: The OpenAI API root under the server's URL (`EmbeddingServer.base_url`).
    base_path: str = "/v1"
    embeddings_path: str = "/v1/embeddings"
    #: Other paths answering like ``embeddings_path`` (TEI also serves ``/embeddings``).
    extra_embeddings_paths: ClassVar[frozenset[str]] = frozenset()
    models_path: str | None = "/v1/models"
    health_path: ClassVar[str] = "/health"
    #: Most texts per request when ``EmbeddingServer(max_batch=None)``.
    default_max_batch: ClassVar[int | None] = None
    #: Connection cap when ``EmbeddingServer(max_requests_per_connection=None)``.
    default_max_requests_per_connection: ClassVar[int | None] = None
    #: uvicorn adds ``server: uvicorn`` (servers that do not run on uvicorn say False).
    uvicorn_server_header: ClassVar[bool] = True
    #: Headers added to every answer.
    common_headers: ClassVar[tuple[tuple[bytes, bytes], ...]] = ()
    #: Status and message of an overloaded server (SGLang: 503, the queue is full).
    overload_status: ClassVar[int] = 503
    overload_message: ClassVar[str] = QUEUE_FULL_MESSAGE
    #: Paths that need no API key.
    public_paths: ClassVar[frozenset[str]] = frozenset({"/health", "/health_generate"})
    #: Other paths whose answer needs the request body (`route_body`).
    body_paths: ClassVar[frozenset[str]] = frozenset()
    #: Whether the real server names the input index in its context-length message.
    names_context_index: ClassVar[bool] = False

    def __init__(self, settings: _Settings) -> None:
        self.settings = settings

    # ---- error bodies ----------------------------------------------------------------
    def error(self, status: int, message: str, *, err_type: str = "BadRequestError") -> _Reply:
        """SGLang's flat ``ErrorResponse``: object, message, type, param, code."""
        body = {
            "object": "error",
            "message": message,
            "type": err_type,
            "param": None,
            "code": status,
        }
        return _Reply(status, orjson.dumps(body))

    def status_error(self, status: int, message: str | None) -> _Reply:
        """An error raised as ``HTTPException`` (SGLang: ``type`` is the status as text)."""
        if message is None:
            message = self.overload_message if status == self.overload_status else _phrase(status)
        return self.error(status, message, err_type=str(status))

    def request_error(self, message: str) -> _Reply:
        """A body that failed request-model validation (FastAPI ``RequestValidationError``)."""
        return self.error(400, message, err_type="Bad Request")

    def unauthorized(self) -> _Reply:
        return _Reply(401, b'{"error":"Unauthorized"}')

    def not_found(self) -> _Reply:
        return _Reply(404, b'{"detail":"Not Found"}')

    def method_not_allowed(self) -> _Reply:
        return _Reply(405, b'{"detail":"Method Not Allowed"}')

    # ---- validation messages ---------------------------------------------------------
    def msg_empty(self) -> str:
        return "Input cannot be empty"

    def msg_blank(self, index: int | None) -> str:
        if index is None:
            return "Input cannot be empty or whitespace only"
        return f"Input at index {index} cannot be empty or whitespace only"

    def msg_not_string(self, index: int, item: Any) -> str:
        return (
            "All items in input list must be strings "
            f"(item at index {index} is {type(item).__name__})"
        )

    def msg_too_long(self, index: int, length: int, limit: int) -> str:
        return (
            f"The input at index {index} ({length} characters) is longer than the model's "
            f"context length ({limit} characters)."
        )

    def msg_batch_too_large(self, size: int, limit: int) -> str:
        return f"Batch size {size} is larger than the maximum batch size {limit}."

    def too_long(self, index: int, length: int, limit: int) -> _Reply:
        """The answer to an input longer than ``max_input_chars``."""
        return self.error(400, self.msg_too_long(index, length, limit))

    def batch_too_large(self, size: int, limit: int) -> _Reply:
        """The answer to more inputs than the batch limit."""
        return self.error(400, self.msg_batch_too_large(size, limit))

    def msg_context(self, tokens: int, limit: int) -> str:
        """The real server's words for a text over the context length, in tokens."""
        return (
            f"The input ({tokens} tokens) is longer than the model's context length "
            f"({limit} tokens)."
        )

    def context_error(self, status: int, message: str, index: int) -> _Reply:
        """The context-length answer built from the (index-named) message."""
        return self.error(status, message)

    context_status: ClassVar[int] = 400

    def context_length(
        self, index: int, tokens: int, limit: int, name_index: bool | None = None
    ) -> _Reply:
        """The answer to input ``index`` having ``tokens`` tokens, over ``limit``: the real
        server's status and wording; ``name_index`` (None: `names_context_index`) adds
        `` (input index N)`` where the real wording has no index."""
        message = self.msg_context(tokens, limit)
        if (self.names_context_index if name_index is None else name_index) and (
            not self.names_context_index
        ):
            message = f"{message} (input index {index})"
        return self.context_error(self.context_status, message, index)

    @property
    def max_batch(self) -> int | None:
        """The batch limit in force (``max_batch`` or the dialect's default)."""
        if self.settings.max_batch is not None:
            return self.settings.max_batch
        return self.default_max_batch

    def route(self, method: str, path: str) -> _Reply | None:
        """Answers of other endpoints (``/info``, ``/props``...); ``None``: not one."""
        return None

    def route_body(self, method: str, path: str, body: bytes) -> _Reply:
        """Answers of the `body_paths` endpoints (e.g. llama.cpp's ``/tokenize``)."""
        return self.not_found()

    def dump(self, data: dict[str, Any]) -> bytes:
        """Serialise a 200 embeddings body (without ``usage`` when the server is built
        with ``report_usage=False``)."""
        if not self.settings.report_usage:
            data.pop("usage", None)
        return orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY)

    def encoding(self, value: Any) -> _Reply | bool:
        """Validate ``encoding_format``: whether to answer base64, or the error answer."""
        if value is None:
            value = "float"
        if value not in ("float", "base64"):
            return self.request_error(f"encoding_format must be 'float' or 'base64', got {value!r}")
        return bool(value == "base64")

    def vector(self, text: str, dimensions: int | None) -> _Vector:
        """The vector answered for ``text`` (with the request's ``dimensions``)."""
        return _vector(text, self.settings.dim, dimensions)

    def response_headers(self, request: _EmbedRequest) -> tuple[tuple[bytes, bytes], ...]:
        """Headers of a 200 embeddings answer."""
        return ()

    def msg_no_matryoshka(self) -> str:
        return (
            f"Model '{self.settings.model}' does not support matryoshka representation, "
            "changing output dimensions will lead to poor results."
        )

    # ---- requests --------------------------------------------------------------------
    def parse(self, body: bytes) -> tuple[list[Any] | None, _EmbedRequest | _Reply]:
        """Validate an embeddings request body.

        Returns:
            The raw inputs as a list (for the `EmbeddingServer.received` log; ``None`` when
            the body has no ``input``) and either the request or the error answer.
        """
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            return None, self.request_error(f"JSON decode error: {exc}")
        if not isinstance(payload, dict):
            return None, self.request_error("Input should be a valid dictionary or object")
        if "input" not in payload:
            return None, self.request_error("Field required: input")
        raw = payload["input"]
        logged = list(raw) if isinstance(raw, list) else [raw]
        texts = self._texts(raw)
        if isinstance(texts, _Reply):
            return logged, texts
        encoding = self.encoding(payload.get("encoding_format"))
        if isinstance(encoding, _Reply):
            return logged, encoding
        dimensions = payload.get("dimensions")
        if dimensions is not None:
            checked = self._dimensions(dimensions)
            if isinstance(checked, _Reply):
                return logged, checked
        limit = self.settings.max_input_chars
        if limit is not None:
            for i, text in enumerate(texts):
                if len(text) > limit:
                    return logged, self.too_long(i, len(text), limit)
        limit = self.settings.max_input_tokens
        if limit is not None:
            for i, text in enumerate(texts):
                if (tokens := count_tokens(text)) > limit:
                    return logged, self.context_length(i, tokens, limit)
        max_batch = self.max_batch
        if max_batch is not None and len(texts) > max_batch:
            return logged, self.batch_too_large(len(texts), max_batch)
        one_item_list = isinstance(raw, list) and len(raw) == 1
        return logged, _EmbedRequest(texts, encoding, dimensions, one_item_list)

    def _texts(self, raw: Any) -> list[str] | _Reply:
        if isinstance(raw, str):
            if not raw.strip():
                return self.error(400, self.msg_empty() if not raw else self.msg_blank(None))
            return [raw]
        if not isinstance(raw, list):
            return self.request_error(
                f"Input should be a string or a list of strings, got {type(raw).__name__}"
            )
        if not raw:
            return self.error(400, self.msg_empty())
        for i, item in enumerate(raw):
            if not isinstance(item, str):
                return self.error(400, self.msg_not_string(i, item))
            if not item.strip():
                return self.error(400, self.msg_blank(i))
        return raw

    def _dimensions(self, dimensions: Any) -> _Reply | None:
        if not self.settings.matryoshka:
            return self.error(400, self.msg_no_matryoshka())
        if isinstance(dimensions, bool) or not isinstance(dimensions, int):
            return self.request_error(f"dimensions should be a valid integer, got {dimensions!r}")
        if dimensions < 1:
            return self.error(400, "Requested dimensions must be greater than 0")
        if dimensions > self.settings.dim:
            limit = self.settings.dim
            return self.error(
                400, f"Provided dimensions are greater than max embedding dimension: {limit}"
            )
        return None

    # ---- answers ---------------------------------------------------------------------
    def embeddings(
        self, request: _EmbedRequest, vectors: Sequence[_Vector], *, nan_literal: bool = False
    ) -> bytes:
        """The 200 body: ``{"object": "list", "data": [...], "model", "usage"}``."""
        data = self.embedding_items(request, vectors, nan_literal=nan_literal)
        tokens = sum(count_tokens(text) for text in request.texts)
        return self.dump(
            {
                "object": "list",
                "data": data,
                "model": self.settings.model,
                "usage": {
                    "prompt_tokens": tokens,
                    "total_tokens": tokens,
                    "completion_tokens": 0,
                    "prompt_tokens_details": None,
                },
            }
        )

    def embedding_items(
        self, request: _EmbedRequest, vectors: Sequence[_Vector], *, nan_literal: bool = False
    ) -> list[dict[str, Any]]:
        """The ``data`` items: ``{"object": "embedding", "index", "embedding"}``."""
        data: list[dict[str, Any]] = []
        for i, vector in enumerate(vectors):
            embedding: Any
            if request.base64:
                embedding = base64.b64encode(vector.tobytes()).decode("ascii")
            elif nan_literal and bool(np.isnan(vector).any()):
                embedding = orjson.Fragment(json.dumps(vector.tolist()).encode("ascii"))
            else:
                embedding = vector
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        return data

    def models(self) -> _Reply:
        """``GET /v1/models``: OpenAI's list shape, as SGLang fills it."""
        card = {
            "id": self.settings.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": self.settings.model,
            "max_model_len": 32768,
        }
        return _Reply(200, orjson.dumps({"object": "list", "data": [card]}))
