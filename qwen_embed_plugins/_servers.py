"""Server profiles: what each OpenAI-compatible embedding server does differently.

One frozen `ServerProfile` per server people run Qwen3-Embedding on (``sglang``,
``vllm``, ``tei``, ``infinity``, ``ollama``, ``llamacpp``, ``dashscope``,
``siliconflow``) plus ``openai``, the generic fallback. A profile knows the server's path
prefix, its batch limit, whether it accepts ``encoding_format="base64"``, what it does
with ``dimensions``, its error body shape, its overload status and its idle keep-alive.

The client knows the profile of each server (replica) once per process, unless
``EmbeddingConfig(server=...)`` names it, without spending a request on it:

1. from the base URL alone: DashScope (``*.aliyuncs.com`` or a ``/compatible-mode/``
   path) and SiliconFlow (``api.siliconflow.cn`` / ``.com``) (`identify_url`);
2. otherwise from the server's first answer (`identify_response`): headers (llama.cpp's
   ``Server``, TEI's ``x-compute-*``, SiliconFlow's and DashScope's ids) and the 200
   body (vLLM's ``embd-`` ids, Infinity's ``infinity-`` ids, SGLang's usage fields).
   What matters for the wire (a batch limit, base64, ``dimensions``, a missing ``/v1``
   prefix) is learned from the answers themselves, so the first request never waits
   for a probe. Ollama's answers are the generic OpenAI shape: it is served with the
   generic profile, which behaves the same for it.

A tool may spend one bounded request, ``GET /models`` (``qwen-embed check``'s probe), and
read ``owned_by`` and the shape of a 404 with `identify_models`.

Sources of each fact are given next to the profile (server source file or docs).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal
from urllib.parse import urlsplit

import orjson

from ._config import SERVER_NAMES, known_model_dims
from .errors import ConfigError, HTTPStatusError, OverloadedError, RateLimitError

__all__ = [
    "PROFILES",
    "SERVER_NAMES",
    "Detection",
    "DimensionsMode",
    "ServerProfile",
    "get_profile",
    "identify_models",
    "identify_response",
    "identify_url",
    "refine_error",
    "wire_dimensions",
]

DimensionsMode = Literal["send", "client", "fixed"]
"""What the client does with ``dimensions`` for a server:

* ``"send"``: send it; the server honours it (vectors of that size), or refuses it with
  a 400 (then the client slices client-side from then on);
* ``"client"``: the server ignores it: do not send it, slice and renormalise locally;
* ``"fixed"``: the server accepts only a fixed list of sizes: send the smallest allowed
  size >= the one asked, then slice and renormalise locally.
"""


@dataclass(frozen=True, slots=True)
class ServerProfile:
    """What one server does, as the client needs to know it. Frozen and hashable.

    Attributes:
        name: the ``server=`` name (one of `SERVER_NAMES`).
        title: human name, e.g. ``"Text Embeddings Inference"``.
        api_prefix: the path of the OpenAI API under the server root by default
            (``"/v1"``; ``""`` for Infinity without ``--url-prefix``;
            ``"/compatible-mode/v1"`` for DashScope).
        batch_limit: most texts per request (``None``: no count limit).
        base64: the server accepts ``encoding_format="base64"``.
        dimensions: what the client does with MRL ``dimensions`` (`DimensionsMode`).
        renormalizes: vectors of a server-side ``dimensions`` come back unit length.
        allowed_dimensions: for ``"fixed"``: ``(model-name suffix, sizes)`` pairs,
            matched case-insensitively against the end of the model name; the pair with
            suffix ``""`` is the default.
        error_shape: the error body shape: ``"flat"`` (``{"message", ...}``),
            ``"nested"`` (``{"error": {"message", ...}}``), ``"code_message"``
            (``{"code": int, "message"}``) or ``"detail"`` (FastAPI).
        overload_status: the HTTP status the server answers when overloaded (``None``:
            it has no such answer); a 429 of a server whose overload status is 429 is
            an overload, raised as ``OverloadedError``.
        idle_timeout: seconds the server keeps an idle keep-alive connection
            (``None``: no limit).
        max_requests_per_connection: the server closes a connection after this many
            requests (``None``: never).
        sources: where these facts come from.
    """

    name: str
    title: str
    api_prefix: str = "/v1"
    batch_limit: int | None = None
    base64: bool = True
    dimensions: DimensionsMode = "send"
    renormalizes: bool = True
    allowed_dimensions: tuple[tuple[str, tuple[int, ...]], ...] = field(default=(), repr=False)
    error_shape: str = "nested"
    overload_status: int | None = None
    idle_timeout: float | None = 5.0
    max_requests_per_connection: int | None = None
    sources: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def allowed_sizes(self, model: str) -> tuple[int, ...]:
        """The ``dimensions`` values the server accepts for ``model`` (``"fixed"`` mode),
        capped at the model's full size when it is a known Qwen3-Embedding model."""
        lowered = model.lower().rstrip("/")
        sizes: tuple[int, ...] = ()
        for suffix, values in self.allowed_dimensions:
            if suffix and lowered.endswith(suffix):
                sizes = values
                break
        else:
            for suffix, values in self.allowed_dimensions:
                if not suffix:
                    sizes = values
        full = known_model_dims(model)
        return tuple(s for s in sizes if full is None or s <= full)


_UVICORN = "uvicorn's default timeout_keep_alive=5 s (uvicorn/config.py)"

PROFILES: Final[dict[str, ServerProfile]] = {
    "openai": ServerProfile(
        name="openai",
        title="generic OpenAI-compatible server",
        sources=("OpenAI embeddings API reference: 2048 inputs per request",),
    ),
    # SGLang: python/sglang/srt/entrypoints/http_server.py (routes /v1/embeddings,
    # /v1/models, /server_info, /health); openai_api/serving_embedding.py and
    # protocol.py (flat ErrorResponse {"object": "error", "message", "type", "param",
    # "code"}); 503 "The request queue is full." when --max-queued-requests is reached
    # (managers/tokenizer_manager.py); dimensions refused with 400 unless the model is
    # matryoshka (--json-model-override-args '{"is_matryoshka": true}'); served by uvicorn.
    "sglang": ServerProfile(
        name="sglang",
        title="SGLang",
        error_shape="flat",
        overload_status=503,
        sources=(
            "sglang srt/entrypoints/http_server.py",
            "srt/entrypoints/openai/protocol.py",
            _UVICORN,
        ),
    ),
    # vLLM: vllm/entrypoints/openai/protocol.py ErrorResponse {"error": ErrorInfo{message,
    # type, param, code}} (older releases: flat like SGLang); ModelCard owned_by="vllm";
    # 'Model "X" does not support matryoshka representation, changing output dimensions
    # will lead to poor results.' (400) unless --hf-overrides '{"is_matryoshka": true}'
    # (docs/models/pooling_models.md); served by uvicorn.
    "vllm": ServerProfile(
        name="vllm",
        title="vLLM",
        error_shape="nested",
        sources=("vllm entrypoints/openai/protocol.py", "docs/models/pooling_models.md", _UVICORN),
    ),
    # TEI: router/src/http/server.rs: routes /embeddings and /v1/embeddings, /info,
    # /health (no /v1/models); "batch size N > maximum allowed batch size M" with
    # M = --max-client-batch-size (default 32, docs/source/en/cli_arguments.md), as
    # ErrorType::Validation -> 413; Overloaded -> 429 "Model is overloaded"; Tokenizer ->
    # 422; Empty -> 400; the OpenAI route's error body is flat {"message", "code",
    # "type"}; OpenAICompatRequest (router/src/http/types.rs) has input, model, user,
    # encoding_format (float | base64) and no dimensions, which serde ignores; the
    # vectors are normalised. Served by axum::serve (hyper), no idle timeout set.
    "tei": ServerProfile(
        name="tei",
        title="Text Embeddings Inference",
        batch_limit=32,
        dimensions="client",
        error_shape="flat",
        overload_status=429,
        idle_timeout=None,
        sources=(
            "text-embeddings-inference router/src/http/server.rs",
            "router/src/http/types.rs",
            "router/src/lib.rs (Info, ErrorType)",
        ),
    ),
    # Infinity: libs/infinity_emb/infinity_emb/infinity_server.py: routes /embeddings,
    # /models under --url-prefix (default ""), /health always at the root; owned_by
    # "infinity"; 429 when the engine queue is overloaded; inputs limited to
    # INFINITY_MAX_CLIENT_BATCH_SIZE=2048 per request (pydantic conlist -> 422);
    # `dimensions` slices the vector WITHOUT renormalising (verified on 0.0.78 by
    # tests/realserver); served by uvicorn.
    "infinity": ServerProfile(
        name="infinity",
        title="Infinity",
        api_prefix="",
        batch_limit=2048,
        renormalizes=False,
        error_shape="nested",
        overload_status=429,
        sources=(
            "infinity_emb infinity_server.py, fastapi_schemas/pymodels.py",
            "tests/realserver/test_infinity.py (0.0.78)",
            _UVICORN,
        ),
    ),
    # Ollama: server/sched.go ErrMaxQueue "server busy, please try again.  maximum
    # pending requests exceeded" -> 503 (OLLAMA_MAX_QUEUE, default 512); the OpenAI
    # middleware (openai/openai.go) answers {"error": {"message", "type", "param",
    # "code"}} and lists models with owned_by "library"; /api/version; `dimensions`
    # truncates and renormalises below the model's size and is ignored at or above it;
    # Go net/http server: no idle timeout.
    "ollama": ServerProfile(
        name="ollama",
        title="Ollama",
        error_shape="nested",
        overload_status=503,
        idle_timeout=None,
        sources=("ollama server/sched.go", "openai/openai.go", "server/routes.go"),
    ),
    # llama.cpp: tools/server/server.cpp: /v1/models owned_by "llamacpp" with "meta"
    # (n_embd ...), /health {"status": "ok"}, /props, errors {"error": {"code",
    # "message", "type"}}, 503 "Loading model" (unavailable_error); `dimensions` is not
    # read; older builds return un-normalised vectors and ignore encoding_format (newer
    # ones normalise, embd_normalize=2, and honour base64: the client copes with both);
    # cpp-httplib: keep-alive 5 s and at most 100 requests per connection
    # (CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND / _MAX_COUNT).
    "llamacpp": ServerProfile(
        name="llamacpp",
        title="llama.cpp server",
        dimensions="client",
        renormalizes=False,
        error_shape="nested",
        overload_status=503,
        idle_timeout=5.0,
        max_requests_per_connection=100,
        sources=("llama.cpp tools/server/server.cpp, utils.hpp", "cpp-httplib httplib.h"),
    ),
    # DashScope (Alibaba Cloud Model Studio) compatible mode: base URL
    # https://dashscope(-intl).aliyuncs.com/compatible-mode/v1; text-embedding-v4
    # (Qwen3-Embedding series): dimensions 2048, 1536, 1024 (default), 768, 512, 256,
    # 128, 64; text-embedding-v3: 1024, 768, 512, 256, 128, 64; at most 10 inputs per
    # request ("batch size is invalid, it should not be larger than 10"); "Only float is
    # supported" for encoding_format; errors {"error": {...}, "request_id"}.
    "dashscope": ServerProfile(
        name="dashscope",
        title="Alibaba Cloud DashScope (compatible mode)",
        api_prefix="/compatible-mode/v1",
        batch_limit=10,
        base64=False,
        dimensions="fixed",
        allowed_dimensions=(
            ("text-embedding-v3", (64, 128, 256, 512, 768, 1024)),
            ("", (64, 128, 256, 512, 768, 1024, 1536, 2048)),
        ),
        error_shape="nested",
        overload_status=None,
        idle_timeout=None,
        sources=(
            "help.aliyun.com model-studio text-embedding-synchronous-api",
            "docs.qwencloud.com api-reference/text-embedding/openai-embedding",
        ),
    ),
    # SiliconFlow: https://api.siliconflow.cn/v1 (and .com); errors {"code", "message",
    # "data"}; Qwen/Qwen3-Embedding-* accept a fixed list of dimensions; at most 64
    # inputs per request (the figure; not found in public docs).
    "siliconflow": ServerProfile(
        name="siliconflow",
        title="SiliconFlow",
        batch_limit=64,
        dimensions="fixed",
        allowed_dimensions=(
            ("qwen3-embedding-8b", (64, 128, 256, 512, 768, 1024, 2048, 4096)),
            ("qwen3-embedding-4b", (64, 128, 256, 512, 768, 1024, 2048, 2560)),
            ("qwen3-embedding-0.6b", (64, 128, 256, 512, 768, 1024)),
        ),
        error_shape="code_message",
        overload_status=None,
        idle_timeout=None,
        sources=("docs.siliconflow.cn api-reference/embeddings/create-embeddings",),
    ),
}
"""Every profile by ``server=`` name."""

GENERIC: Final = PROFILES["openai"]


def get_profile(name: str) -> ServerProfile:
    """The profile called ``name``.

    Raises:
        ConfigError: unknown name (the message lists the known ones).
    """
    try:
        return PROFILES[name]
    except KeyError:
        raise ConfigError(
            f"unknown server {name!r}; expected 'auto' or one of {', '.join(SERVER_NAMES)}"
        ) from None


@dataclass(frozen=True, slots=True)
class Detection:
    """The result of detecting an endpoint's server.

    Attributes:
        profile: the `ServerProfile` used.
        source: how it was found, e.g. ``"GET /v1/models: owned_by 'vllm'"``.
        embeddings_url: the embeddings URL to use instead of ``{base_url}/embeddings``
            (Infinity started without ``--url-prefix`` behind a ``/v1`` base URL), or
            ``None``.
    """

    profile: ServerProfile
    source: str
    embeddings_url: str | None = None


# --------------------------------------------------------------------------- pure


def wire_dimensions(profile: ServerProfile, want: int | None, model: str) -> int | None:
    """The ``dimensions`` value to send for ``want`` (``None``: send none).

    Raises:
        ConfigError: the server has a fixed list of sizes and ``want`` is above all of
            them (for ``model``).
    """
    if want is None or profile.dimensions == "client":
        return None
    if profile.dimensions == "send":
        return want
    sizes = profile.allowed_sizes(model)
    if not sizes:
        return None
    bigger = [s for s in sizes if s >= want]
    if not bigger:
        raise ConfigError(
            f"{profile.title} serves {model} with dimensions in {list(sizes)}; "
            f"dimensions={want} is above all of them"
        )
    return min(bigger)


def identify_url(base_url: str) -> Detection | None:
    """A detection from the base URL alone (no request), or ``None``."""
    parts = urlsplit(base_url)
    host = (parts.hostname or "").lower()
    if (
        host.endswith("dashscope.aliyuncs.com")
        or host.endswith("dashscope-intl.aliyuncs.com")
        or "/compatible-mode/" in f"{parts.path}/"
    ):
        return Detection(PROFILES["dashscope"], f"base URL {host}{parts.path}")
    if host in ("api.siliconflow.cn", "api.siliconflow.com"):
        return Detection(PROFILES["siliconflow"], f"base URL host {host}")
    return None


def _header(headers: Mapping[str, str] | None, name: str) -> str:
    if headers is None:
        return ""
    value = headers.get(name)
    return value if isinstance(value, str) else ""


def _json(body: bytes | str | None) -> Any:
    if not body:
        return None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def _by_headers(headers: Mapping[str, str] | None) -> tuple[str, str] | None:
    server = _header(headers, "server").lower()
    if "llama.cpp" in server:
        return "llamacpp", f"Server header {server!r}"
    if _header(headers, "x-siliconcloud-trace-id"):
        return "siliconflow", "x-siliconcloud-trace-id header"
    if _header(headers, "x-compute-type"):
        return "tei", "x-compute-type header"
    if _header(headers, "x-dashscope-request-id"):
        return "dashscope", "x-dashscope-request-id header"
    return None


_OWNERS: Final = {
    "sglang": "sglang",
    "vllm": "vllm",
    "llamacpp": "llamacpp",
    "infinity": "infinity",
    "library": "ollama",
    "ollama": "ollama",
}


def identify_models(
    status: int,
    headers: Mapping[str, str] | None,
    body: bytes | str | None,
    *,
    base_url: str,
) -> Detection:
    """Read the answer to ``GET {base_url}/models``; always returns a detection
    (generic when nothing is recognised)."""
    found = _by_headers(headers)
    if found is not None:
        return Detection(PROFILES[found[0]], f"GET /models: {found[1]}")
    data = _json(body)
    if status == 200 and isinstance(data, Mapping):
        cards = data.get("data")
        if isinstance(cards, list):
            for card in cards:
                if not isinstance(card, Mapping):
                    continue
                owner = str(card.get("owned_by") or "").lower()
                if owner in _OWNERS:
                    return Detection(PROFILES[_OWNERS[owner]], f"GET /models: owned_by {owner!r}")
                if "capabilities" in card and "backend" in card:
                    return Detection(PROFILES["infinity"], "GET /models: Infinity model card")
        return Detection(GENERIC, "GET /models: no known owned_by")
    if status == 404:
        path = urlsplit(base_url).path.rstrip("/")
        if isinstance(data, Mapping) and data.get("detail") == "Not Found" and path.endswith("/v1"):
            # A FastAPI server without /v1 routes: Infinity started without --url-prefix.
            root = base_url.rstrip("/")[: -len("/v1")]
            return Detection(
                PROFILES["infinity"],
                "GET /v1/models: FastAPI 404 (Infinity without --url-prefix)",
                embeddings_url=f"{root}/embeddings",
            )
        if not body:
            # axum's empty 404: TEI has no /models route (router/src/http/server.rs).
            return Detection(PROFILES["tei"], "GET /models: empty 404 (TEI has no /models)")
    return Detection(GENERIC, f"GET /models: HTTP {status}")


def identify_response(headers: Mapping[str, str] | None, payload: Any = None) -> Detection | None:
    """A detection from an embedding answer (free: no extra request), or ``None``.

    Reads the headers (llama.cpp's ``Server``, TEI's ``x-compute-*``, SiliconFlow's and
    DashScope's ids) and the 200 body: vLLM's ``id`` (``embd-...``), Infinity's
    (``infinity-...``), SGLang's ``usage`` (``completion_tokens`` and
    ``prompt_tokens_details`` with no ``id``). Ollama's answer is the generic OpenAI
    shape: it is served with the generic profile, which behaves the same for it.
    """
    found = _by_headers(headers)
    if found is not None:
        return Detection(PROFILES[found[0]], f"response {found[1]}")
    if not isinstance(payload, Mapping):
        return None
    ident = payload.get("id")
    if isinstance(ident, str):
        if ident.startswith("embd-"):
            return Detection(PROFILES["vllm"], "response id 'embd-...'")
        if ident.startswith("infinity-"):
            return Detection(PROFILES["infinity"], "response id 'infinity-...'")
    usage = payload.get("usage")
    if (
        ident is None
        and isinstance(usage, Mapping)
        and "completion_tokens" in usage
        and "prompt_tokens_details" in usage
    ):
        return Detection(PROFILES["sglang"], "response usage fields (SGLang UsageInfo)")
    return None


_OVERLOAD_WORDS: Final = re.compile(r"overload|busy|queue is full|capacity", re.I)


def refine_error(profile: ServerProfile, error: HTTPStatusError) -> HTTPStatusError:
    """Map a server's overload answer to ``OverloadedError`` whatever its status (TEI and
    Infinity answer 429 when their queue is full: not a rate limit)."""
    if (
        isinstance(error, RateLimitError)
        and profile.overload_status == 429
        and _OVERLOAD_WORDS.search(error.message or "")
    ):
        refined = OverloadedError(
            str(error),
            status=error.status,
            url=error.url,
            request_id=error.request_id,
            retry_after=error.retry_after,
            server_message=error.message,
        )
        return refined
    return error
