"""Exceptions raised by qwen-embed-plugins, and the one place they are translated.

The tree::

    QwenEmbedError
    ├── ConfigError                 (also ValueError) a setting is out of range
    ├── InputError                  (also ValueError) a text is invalid; ``.index``
    ├── CircuitOpenError            the endpoint failed repeatedly; failing fast
    ├── ResponseError               the server answered 2xx but the body is unusable;
    │                               ``.index`` names the input when one is at fault
    ├── TransportError              no usable HTTP response
    │   ├── ConnectError            TCP / TLS connection could not be made
    │   ├── NetworkError            the connection broke while sending or reading
    │   │   └── RemoteProtocolError the server closed without a (complete) response
    │   └── TimeoutException        (also builtins.TimeoutError)
    │       ├── ConnectTimeout
    │       ├── ReadTimeout
    │       ├── WriteTimeout
    │       └── PoolTimeout         no pooled connection became free in time
    └── HTTPStatusError             an HTTP error status; ``.status``, ``.message``,
        │                           ``.request_id``, ``.url``, ``.retry_after``
        ├── BadRequestError         400 / 413 / 422
        │   ├── ContextLengthError  a text is longer than the model's context
        │   └── BatchTooLargeError  too many texts in one request; ``.limit``
        ├── AuthenticationError     401 / 403
        ├── NotFoundError           404 (wrong path or model name)
        ├── RateLimitError          429
        └── ServerError             5xx: the server failed
            └── OverloadedError     503 (SGLang "request queue is full", Ollama busy)

Error bodies are parsed in every shape the supported servers use: flat SGLang
(``{"object": "error", "message": ...}``), nested OpenAI / vLLM / DashScope
(``{"error": {"message": ...}}``), TEI and Ollama (``{"error": "..."}``), SiliconFlow
(``{"code": 20042, "message": ...}``) and FastAPI / Infinity (``{"detail": ...}``).

No message, ``repr`` or attribute of these exceptions holds the API key: URLs are
reduced to scheme, host, port and path, and the key is scrubbed from server text.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson

__all__ = [
    "AuthenticationError",
    "BadRequestError",
    "BatchTooLargeError",
    "CircuitOpenError",
    "ConfigError",
    "ConnectError",
    "ConnectTimeout",
    "ContextLengthError",
    "InputError",
    "NetworkError",
    "NotFoundError",
    "OverloadedError",
    "PoolTimeout",
    "QwenEmbedError",
    "RateLimitError",
    "ReadTimeout",
    "RemoteProtocolError",
    "ResponseError",
    "HTTPStatusError",
    "ServerError",
    "TimeoutException",
    "TransportError",
    "WriteTimeout",
    "endpoint_label",
    "error_from_response",
    "parse_batch_limit",
    "parse_error_body",
    "scrub",
]


class QwenEmbedError(Exception):
    """Base class of every error this library raises.

    Every error pickles with its message and attributes (a ``multiprocessing`` or
    ``concurrent.futures`` worker can raise it to its parent); the chained cause and the
    traceback are not pickled, as for any exception.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's default pickling calls ``cls(*args)``, which fails for subclasses
        # with keyword-only arguments (``HTTPStatusError(status=...)``): a pool worker's
        # error then never reaches the parent and ``Pool.map`` waits forever.
        return _rebuild_error, (type(self), self.args, dict(self.__dict__))


def _rebuild_error(
    cls: type[QwenEmbedError], args: tuple[Any, ...], state: dict[str, Any]
) -> QwenEmbedError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class ConfigError(QwenEmbedError, ValueError):
    """A setting is missing or out of range. The message names the field and the range."""


class InputError(QwenEmbedError, ValueError):
    """An input text is invalid; nothing was sent.

    Attributes:
        index: position of the offending text in the caller's list (``None`` when the
            whole input is at fault, e.g. an empty list or a non-list).
    """

    def __init__(self, message: str, *, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


class CircuitOpenError(QwenEmbedError):
    """The endpoint's circuit breaker is open after repeated failures.

    Calls fail at once (no request is sent) until ``retry_in`` seconds have passed and
    a probe request succeeds.
    """

    def __init__(self, message: str, *, url: str | None = None, retry_in: float = 0.0):
        super().__init__(message)
        self.url = url
        self.retry_in = retry_in


class ResponseError(QwenEmbedError):
    """A 2xx response that cannot be used: malformed JSON, wrong item count, missing
    index, mixed dimensions, NaN/Inf or all-zero vectors.

    Attributes:
        index: the caller's input index the bad item belongs to, when known.
    """

    def __init__(self, message: str, *, index: int | None = None, url: str | None = None):
        super().__init__(message)
        self.index = index
        self.url = url


class TransportError(QwenEmbedError):
    """No usable HTTP response was received.

    Attributes:
        url: the endpoint (scheme, host, port, path; never credentials).
    """

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url


class ConnectError(TransportError):
    """The TCP or TLS connection could not be established (refused, DNS, certificate)."""


class NetworkError(TransportError):
    """The connection broke while the request or the response was in transit."""


class RemoteProtocolError(NetworkError):
    """The server closed the connection without sending a (complete) response.

    On a reused keep-alive connection this is the classic symptom of a client keeping
    idle sockets longer than the server's idle timeout.
    """


class TimeoutException(TransportError, builtins.TimeoutError):
    """A timeout expired; subclasses say which one (see ``Timeouts`` in the config)."""


class ConnectTimeout(TimeoutException):
    """Connecting (TCP + TLS) took longer than ``Timeouts.connect`` seconds."""


class ReadTimeout(TimeoutException):
    """The server sent nothing for ``Timeouts.read`` seconds."""


class WriteTimeout(TimeoutException):
    """Sending the request body took longer than ``Timeouts.write`` seconds."""


class PoolTimeout(TimeoutException):
    """No pooled connection became free within ``Timeouts.pool`` seconds."""


class HTTPStatusError(QwenEmbedError):
    """The server answered with an HTTP error status.

    Attributes:
        status: the HTTP status code.
        message: the server's own message, parsed from its error body.
        request_id: the server's request id (``x-request-id`` and similar), if any.
        url: the endpoint (no credentials, no query string).
        retry_after: seconds the server asked us to wait (``Retry-After``), if any.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int,
        url: str | None = None,
        request_id: str | None = None,
        retry_after: float | None = None,
        server_message: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = server_message if server_message is not None else message
        self.url = url
        self.request_id = request_id
        self.retry_after = retry_after


class BadRequestError(HTTPStatusError):
    """400, 413 or 422: the server rejected the request itself; never retried.

    Attributes:
        index: the caller's input index the server blamed, when it can be told (the
            batch held one text, or the server named a position within the request).
    """

    index: int | None = None


class ContextLengthError(BadRequestError):
    """A text is longer than the model's context window (e.g. 32,768 tokens for
    Qwen3-Embedding; source: the model card). Shorten or split the text."""


class BatchTooLargeError(BadRequestError):
    """The request held more texts than the server accepts.

    Attributes:
        limit: the server's maximum texts per request, when its message states it.
    """

    def __init__(self, message: str, *, limit: int | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.limit = limit


class AuthenticationError(HTTPStatusError):
    """401 or 403: missing or wrong API key."""


class NotFoundError(HTTPStatusError):
    """404: wrong base URL path or unknown model name."""


class RateLimitError(HTTPStatusError):
    """429: too many requests; retried with backoff, honouring ``Retry-After``."""


class ServerError(HTTPStatusError):
    """5xx: the server failed (500, 502, 504, ...); retried with backoff. A 500 that
    bisection pins to one input is that input's error (``.index``)."""

    index: int | None = None


class OverloadedError(ServerError):
    """503: the server is overloaded (SGLang "The request queue is full.")."""


# --------------------------------------------------------------------------- helpers


def endpoint_label(url: str) -> str:
    """``url`` reduced to scheme://host[:port]/path: no user info, query or fragment.

    Used everywhere a URL reaches a message, a log line or a metric label.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid url>"
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = f"{host}:{port}" if port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def scrub(text: str, *secrets: str | None) -> str:
    """Return ``text`` with every non-empty secret replaced by ``***``."""
    for secret in secrets:
        if secret and len(secret) >= 4 and secret in text:
            text = text.replace(secret, "***")
    return text


def parse_error_body(body: bytes | str | None) -> tuple[str, Any]:
    """Extract ``(message, code)`` from an error body of any supported server.

    Returns the raw text (truncated to 500 characters) when the body is not one of the
    known JSON shapes, and ``""`` for an empty body.
    """
    if not body:
        return "", None
    raw = body if isinstance(body, str) else body.decode("utf-8", "replace")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.strip()[:500], None
    if isinstance(data, Mapping):
        err = data.get("error")
        if isinstance(err, Mapping):  # OpenAI / vLLM / DashScope / llama.cpp
            return str(err.get("message") or err), err.get("code") or err.get("type")
        if isinstance(err, str):  # TEI / Ollama
            return err, data.get("error_type")
        if "message" in data:  # SGLang flat, SiliconFlow {code, message}
            return str(data["message"]), data.get("code")
        detail = data.get("detail")
        if detail is not None:  # FastAPI / Infinity
            if isinstance(detail, list):
                parts = []
                for item in detail:
                    if isinstance(item, Mapping):
                        loc = ".".join(str(p) for p in item.get("loc", ()))
                        parts.append(f"{loc}: {item.get('msg', item)}" if loc else str(item))
                    else:
                        parts.append(str(item))
                return "; ".join(parts), None
            return str(detail), None
    return raw.strip()[:500], None


_BATCH_LIMIT_PATTERNS = (
    re.compile(r"maximum allowed batch size (?:is )?(\d+)", re.I),  # TEI, SiliconFlow
    re.compile(r"should not be larger than (\d+)", re.I),  # DashScope
    re.compile(r"input: List should have at most (\d+) items", re.I),  # Infinity (FastAPI 422)
    re.compile(r"(?:batch|input)[^.]*?(?:at most|no more than|<=|maximum(?: of)?) (\d+)", re.I),
    re.compile(r"(?:max(?:imum)?|limit)[ _]?(?:batch|inputs?)[^\d]{0,20}(\d+)", re.I),
)
_BATCH_WORDS = re.compile(
    r"batch|too many (?:inputs|texts)|number of (?:inputs|texts)|input: List should have at most",
    re.I,
)
_CONTEXT_WORDS = re.compile(
    r"context length|maximum context|too long|exceeds? the max|max(?:imum)?[_ ]model[_ ]len"
    r"|input (?:tokens|length)|token limit|must have less than",
    re.I,
)


def parse_batch_limit(message: str) -> int | None:
    """The server's maximum texts per request stated in ``message``, if any.

    Recognises TEI ("batch size 64 > maximum allowed batch size 32"), DashScope
    ("batch size is invalid, it should not be larger than 10") and similar wordings.
    """
    if not _BATCH_WORDS.search(message):
        return None
    for pattern in _BATCH_LIMIT_PATTERNS:
        match = pattern.search(message)
        if match:
            limit = int(match.group(1))
            return limit if limit > 0 else None
    return None


_REQUEST_ID_HEADERS = (
    "x-request-id",
    "request-id",
    "x-dashscope-request-id",
    "x-siliconcloud-trace-id",
)


def error_from_response(
    status: int,
    body: bytes | str | None,
    *,
    url: str,
    headers: Mapping[str, str] | None = None,
    retry_after: float | None = None,
    secret: str | None = None,
) -> HTTPStatusError:
    """Build the right ``HTTPStatusError`` subclass for an HTTP error response.

    Args:
        status: HTTP status code (>= 400).
        body: the raw response body.
        url: the request URL (reduced by ``endpoint_label``).
        headers: response headers, for the request id.
        retry_after: seconds from ``Retry-After``, already parsed by the caller.
        secret: the API key, scrubbed from the server's text.
    """
    message, code = parse_error_body(body)
    message = scrub(message, secret)
    label = endpoint_label(url)
    request_id = None
    if headers is not None:
        for name in _REQUEST_ID_HEADERS:
            if headers.get(name):
                request_id = headers[name]
                break
    if request_id is None and body:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            data = None
        if isinstance(data, Mapping) and isinstance(data.get("request_id"), str):
            request_id = data["request_id"]
    shown = message or "(empty body)"
    text = f"HTTP {status} from {label}: {shown}"
    if request_id:
        text += f" (request id {request_id})"
    kwargs: dict[str, Any] = {
        "status": status,
        "url": label,
        "request_id": request_id,
        "retry_after": retry_after,
        "server_message": message,
    }
    limit = parse_batch_limit(message)
    if status == 413 and limit is None and _CONTEXT_WORDS.search(message):
        # TEI answers every validation error with 413, a too-long input included
        # ("`inputs` must have less than 512 tokens"; router/src/http/server.rs).
        return ContextLengthError(text, **kwargs)
    if status == 413 or (status in (400, 422) and (limit is not None or code == 20042)):
        return BatchTooLargeError(text, limit=limit, **kwargs)
    if status in (400, 422):
        if _CONTEXT_WORDS.search(message):
            return ContextLengthError(text, **kwargs)
        return BadRequestError(text, **kwargs)
    if status in (401, 403):
        return AuthenticationError(text, **kwargs)
    if status == 404:
        return NotFoundError(text, **kwargs)
    if status == 429:
        return RateLimitError(text, **kwargs)
    if status == 503:
        return OverloadedError(text, **kwargs)
    if status >= 500:
        return ServerError(text, **kwargs)
    return HTTPStatusError(text, **kwargs)
