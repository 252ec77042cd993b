"""Exceptions raised by qwen-embed-plugins (a backend's exceptions become these in one
place: ``_transport._exceptions.translate``).

The tree:

```text
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
    └── ServerError             5xx (and TEI's 424 backend error): the server failed
        └── OverloadedError     503 (SGLang "request queue is full", Ollama busy)
```

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar

from ._server_text import (
    _CONTEXT_WORDS,
    endpoint_label,
    parse_batch_limit,
    parse_error_body,
    parse_token_limit,
    response_request_id,
    scrub,
)

__all__ = [
    "AuthenticationError",
    "BadRequestError",
    "BatchTooLargeError",
    "CircuitOpenError",
    "ConfigError",
    "ConnectError",
    "ConnectTimeout",
    "ContextLengthError",
    "ErrorContext",
    "HTTPStatusError",
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
    "ServerError",
    "TimeoutException",
    "TransportError",
    "WriteTimeout",
]


_E = TypeVar("_E", bound="QwenEmbedError")


class QwenEmbedError(Exception):
    """Base class of every error this library raises.

    Attributes:
        index: the caller's input index this error belongs to (``None``: no single
            input is at fault).
        replica: the replica (endpoint label: scheme, host, port, path) the failing
            request went to, when one did.
        attempts: the requests made for the failing batch, this one included, when
            the error ended a batch.

    An error is built once with its context: a layer that adds some (an input index,
    a note) builds a new error of the same type (``with_context``) and never changes
    one already built. Every error pickles with its message and attributes (a
    ``multiprocessing`` or ``concurrent.futures`` worker can raise it to its parent); the
    chained cause and the traceback are not pickled, as for any exception.
    """

    def __init__(
        self,
        message: str,
        *,
        index: int | None = None,
        replica: str | None = None,
        attempts: int | None = None,
    ) -> None:
        super().__init__(message)
        self.index = index
        self.replica = replica
        self.attempts = attempts

    def with_context(
        self,
        *,
        note: str = "",
        secrets: Sequence[str] = (),
        after: BaseException | None = None,
        **fields: Any,
    ) -> Self:
        """A new error of this type: this one's attributes with ``fields`` replaced
        (``index``, ``replica``, ``attempts``, ``url``: attributes it has), ``note``
        appended to its message and every one of ``secrets`` scrubbed from that message.
        It keeps this one's ``__cause__``, ``__context__`` and traceback; ``after``: the
        exception that ended the retries of this one, as its ``__context__``. This error
        is left as it is.

        Raises:
            TypeError: a field this error does not have.
        """
        unknown = set(fields).difference(vars(self))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field {sorted(unknown)}")
        message = scrub(f"{self}{note}", *secrets) if secrets else f"{self}{note}"
        error = _rebuild_error(type(self), (message,), {**vars(self), **fields})
        # still its construction (nothing else holds it yet): the chain and the
        # traceback of the error it replaces
        error.__cause__ = self.__cause__
        error.__context__ = after or self.__context__
        error.__suppress_context__ = self.__suppress_context__
        return error.with_traceback(self.__traceback__)

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's default pickling calls ``cls(*args)``, which fails for subclasses
        # with keyword-only arguments (``HTTPStatusError(status=...)``): a pool worker's
        # error then never reaches the parent and ``Pool.map`` waits forever.
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        return _rebuild_error, (type(self), self.args, state)


def _rebuild_error(cls: type[_E], args: tuple[Any, ...], state: dict[str, Any]) -> _E:
    """An error of ``cls`` with message ``args`` and attributes ``state`` (unpickling,
    ``with_context``): built whole, before anything else holds it."""
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

    def __init__(self, message: str, *, index: int | None = None, **context: Any) -> None:
        super().__init__(message, index=index, **context)


class CircuitOpenError(QwenEmbedError):
    """The endpoint's circuit breaker is open after repeated health failures.

    New calls fail at once (no request is sent) until ``retry_in`` seconds have passed
    and a probe request succeeds. Only signals of endpoint ill health open it: connect
    errors, timeouts, 502/503/504 (never 4xx, 429, local pool waits or one input's 500).

    Attributes:
        url: the endpoint (or, with replicas, the endpoint's replicas, comma-separated).
        retry_in: seconds until the next probe is allowed.
        last_error: the failure that opened (or kept open) the breaker: its status,
            message and request id are in this error's text; it is also the
            ``__cause__`` when raised. With replicas, ``failures`` maps each replica to its
            last failure.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        retry_in: float = 0.0,
        last_error: QwenEmbedError | None = None,
        failures: dict[str, QwenEmbedError] | None = None,
        **context: Any,
    ) -> None:
        super().__init__(message, **context)
        self.url = url
        self.retry_in = retry_in
        self.last_error = last_error
        self.failures = dict(failures or {})


class ResponseError(QwenEmbedError):
    """A 2xx response that cannot be used: malformed JSON, wrong item count, missing
    index, mixed dimensions, NaN/Inf or all-zero vectors.

    Attributes:
        index: the caller's input index the bad item belongs to, when known.
        url: the endpoint that answered.
        server_message: the server's own words, when the answer carried them (a 200
            whose body is an error object); ``None`` otherwise.
        max_bytes: the response size cap (bytes: ``max_response_bytes``, or the default
            for the batch) the answer went over, when that is the failure; ``None``
            otherwise. Such an answer is the server's fault, not the batch's: it is
            neither split nor retried.
    """

    def __init__(
        self,
        message: str,
        *,
        index: int | None = None,
        url: str | None = None,
        server_message: str | None = None,
        max_bytes: int | None = None,
        **context: Any,
    ) -> None:
        super().__init__(message, index=index, **context)
        self.url = url
        self.server_message = server_message
        self.max_bytes = max_bytes


class TransportError(QwenEmbedError):
    """No usable HTTP response was received.

    Attributes:
        url: the endpoint (scheme, host, port, path; never credentials).
        sent: whether the request may have reached the server (``False``: it failed
            while connecting or waiting for a pooled connection, so nothing was sent).
        refused: an HTTP/2 stream the server refused before processing it (GOAWAY with
            a lower ``last_stream_id``, or ``REFUSED_STREAM``): safe to resend at once
            and not a sign of ill health.
        received: whether part of a response had arrived (a body that trickled in too
            slowly, or broke off).
        fresh: whether the exchange ran on a connection opened for it (``False``: on a
            reused keep-alive connection, which the server may have closed as it was
            reused: resent once at once).
    """

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        sent: bool = True,
        refused: bool = False,
        received: bool = False,
        fresh: bool = True,
        **context: Any,
    ) -> None:
        super().__init__(message, **context)
        self.url = url
        self.sent = sent
        self.refused = refused
        self.received = received
        self.fresh = fresh


class ConnectError(TransportError):
    """The TCP or TLS connection could not be established (refused, DNS, certificate,
    proxy). Nothing was sent."""

    def __init__(self, message: str, *, url: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("sent", False)
        super().__init__(message, url=url, **kwargs)


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
    """Connecting (TCP + TLS) took longer than ``Timeouts.connect`` seconds. Nothing was
    sent."""

    def __init__(self, message: str, *, url: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("sent", False)
        super().__init__(message, url=url, **kwargs)


class ReadTimeout(TimeoutException):
    """The server sent nothing for ``Timeouts.read`` seconds, or the whole exchange took
    longer than ``Timeouts.total`` (a body trickling in) or the call's deadline."""


class WriteTimeout(TimeoutException):
    """Sending the request body took longer than ``Timeouts.write`` seconds."""


class PoolTimeout(TimeoutException):
    """No pooled connection became free within ``Timeouts.pool`` seconds: the process
    queued more requests than ``Limits.max_connections``. A local condition, never a
    sign of the endpoint's ill health."""

    def __init__(self, message: str, *, url: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("sent", False)
        super().__init__(message, url=url, **kwargs)


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
        **context: Any,
    ) -> None:
        super().__init__(message, **context)
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


class ContextLengthError(BadRequestError):
    """A text is longer than the model's context window (e.g. 32,768 tokens for
    Qwen3-Embedding; source: the model card). Shorten or split the text."""


class BatchTooLargeError(BadRequestError):
    """The request held more texts, or more tokens in all, than the server accepts.

    The client splits the batch and resends it, learning the limit; this error reaches
    the caller only when a single text is already too large for the token cap.

    Attributes:
        limit: the server's maximum texts per request, when its message states it.
        token_limit: the server's maximum tokens per request, when the refusal was about
            tokens and its message states the cap.
        tokens: the refusal was about the total tokens of the request (not the count).
    """

    def __init__(
        self,
        message: str,
        *,
        limit: int | None = None,
        token_limit: int | None = None,
        tokens: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(message, **kwargs)
        self.limit = limit
        self.token_limit = token_limit
        self.tokens = tokens or token_limit is not None


class AuthenticationError(HTTPStatusError):
    """401 or 403: missing or wrong API key."""


class NotFoundError(HTTPStatusError):
    """404: wrong base URL path or unknown model name."""


class RateLimitError(HTTPStatusError):
    """429: too many requests; retried with backoff, honouring ``Retry-After``."""


class ServerError(HTTPStatusError):
    """5xx: the server failed (500, 502, 504, ...); retried with backoff. A 500 that
    bisection pins to one input is that input's error (``.index``)."""


class OverloadedError(ServerError):
    """503: the server is overloaded (SGLang "The request queue is full.")."""


# --------------------------------------------------------------------------- building errors

# An input position a server names in a refusal ("the input at index 3", "input[3]"):
# counted within the request it got, one batch of the call (the engine's rule too).
SERVER_POSITION = re.compile(r"\b(?:index|input|item)\s*(?:at\s+(?:index\s+)?)?\[?(\d+)\]?", re.I)


def error_from_response(
    status: int,
    body: bytes | str | None,
    *,
    url: str,
    headers: Mapping[str, str] | None = None,
    retry_after: float | None = None,
    secret: str | tuple[str, ...] | None = None,
) -> HTTPStatusError:
    """Build the right ``HTTPStatusError`` subclass for an HTTP error response.

    Args:
        status: HTTP status code (>= 400).
        body: the raw response body.
        url: the request URL (reduced by ``endpoint_label``).
        headers: response headers, for the request id.
        retry_after: seconds from ``Retry-After``, already parsed by the caller.
        secret: the API key (or every secret of the request: the key and the
            credential-like header values), scrubbed from the server's text.
    """
    message, code = parse_error_body(body)
    message = scrub(message, *(secret if isinstance(secret, tuple) else (secret,)))
    label = endpoint_label(url)
    request_id = response_request_id(headers, body, secret=secret)
    shown = message or "(empty body)"
    text = f"HTTP {status} from {label}: {shown}"
    position = SERVER_POSITION.search(message) if status in (400, 413, 422) else None
    if position:
        # the caller's input index is added by the engine ("[input index N of this call]")
        text += (
            f" (the server's index {position.group(1)} counts within the batch it was sent,"
            " not within the call)"
        )
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
    if status in (400, 413, 422):
        is_tokens, token_limit = parse_token_limit(message)
        if is_tokens:
            return BatchTooLargeError(text, token_limit=token_limit, tokens=True, **kwargs)
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
    if status >= 500 or status == 424:  # 424: TEI's "Backend error" (the model failed)
        return ServerError(text, **kwargs)
    return HTTPStatusError(text, **kwargs)


# --------------------------------------------------------------------------- context


@dataclass(frozen=True, slots=True)
class ErrorContext:
    """What a translated error says about where it happened (no credentials).

    Attributes:
        url: the endpoint label (``endpoint_label``).
        secret: the API key, scrubbed from every text.
        connect, read, write, pool, total: the timeouts in force, in seconds.
        max_connections: the pool's connection limit (connections).
        headers: the configured request headers (``_extras.RequestHeaders``): the values
            of the credential-like ones are scrubbed from every text too.
        body: the configured ``extra_body`` (``_extras.RequestBody``): the values of its
            credential-like fields are scrubbed from every text too.
    """

    url: str
    secret: Any = field(default=None, repr=False)  # a config.Secret (or None)
    connect: float | None = None
    read: float | None = None
    write: float | None = None
    pool: float | None = None
    total: float | None = None
    max_connections: int | None = None
    headers: Any = field(default=None, repr=False)  # an _extras.RequestHeaders (or None)
    body: Any = field(default=None, repr=False)  # a config.RequestBody (or None)

    def key(self) -> str | None:
        """The API key to scrub from texts (``None``: no key)."""
        secret = self.secret
        if secret is None or isinstance(secret, str):
            return secret
        value: str = secret.get_secret_value()
        return value

    def secrets(self) -> tuple[str, ...]:
        """Every secret to scrub from texts: the API key and the credential-like header
        and body field values."""
        key = self.key()
        found: tuple[str, ...] = () if key is None else (key,)
        for extras in (self.headers, self.body):
            if extras is not None:
                found = (*found, *extras.secret_values())
        return found


def pool_timeout_error(ctx: ErrorContext) -> PoolTimeout:
    """The ``PoolTimeout`` for a request that waited ``ctx.pool`` seconds (or the time
    left of its deadline) for a connection."""
    return PoolTimeout(
        f"no free connection to {ctx.url} within {ctx.pool} s (Timeouts.pool; "
        f"Limits.max_connections={ctx.max_connections}) or the call's deadline: more "
        "requests were queued in this process than the pool carries",
        url=ctx.url,
    )


def total_timeout_error(
    ctx: ErrorContext, seconds: float | None, *, received: bool = False, fresh: bool = True
) -> ReadTimeout:
    """The error for an exchange cut by its total time budget (``Timeouts.total`` or the
    call's deadline, whichever came first)."""
    shown = "?" if seconds is None else f"{seconds:.3g}"
    return ReadTimeout(
        f"the exchange with {ctx.url} took longer than {shown} s in all (Timeouts.total or "
        "the call's deadline): the response was too slow to arrive",
        url=ctx.url,
        received=received,
        fresh=fresh,
    )
