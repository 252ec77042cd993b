"""The openai SDK on the shared pools: one public ``httpx.BaseTransport`` /
``httpx.AsyncBaseTransport`` per mode whose ``handle_request`` sends through the
library's transport contract (``_contract.Request -> Reply``).

``openai_client()`` is ``openai.OpenAI(http_client=httpx.Client(transport=SDKTransport(
...)), max_retries=0)`` (``AsyncOpenAI`` / ``httpx.AsyncClient`` / ``AsyncSDKTransport``
for the async client). Each SDK request therefore gets what every other request of the
library gets, written once in ``_contract`` and the backends: the endpoint's pool and
process gate, the response size cap (received and after decoding), one total time
budget (``Timeouts.total`` and ``RetryConfig.deadline``, whichever is sooner; the SDK's
own ``timeout=`` is ignored), connections with unread bytes never reused, and the response's
header names and values and body scrubbed of the secrets (the API key, credential-like header
values) before the SDK sees them (it logs ``x-request-id`` and quotes an error body in
``APIStatusError``). The transport looks the pool up on each request, so an SDK object
kept by the user keeps working after ``close_all()``, in a forked child, on every event
loop, and after the cleartext HTTP/2 -> HTTP/1.1 fallback (which it triggers itself).

A failure raises the ``httpx`` exception nearest to the library's error, chained from it
(``from``): the SDK wraps only ``httpx`` request errors. A timeout thus reaches the
caller as ``openai.APITimeoutError``, any other failure (the size cap included) as
``openai.APIConnectionError``; the library's error is the ``__cause__`` of its
``__cause__``.

``openai`` is imported only here, and only when an SDK object is asked for: it is a large
import.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, cast

import orjson

from .. import _pool as pool
from .._config import EmbeddingConfig
from .._protocol import decode_checked, parse_body
from .._server_text import scrub
from ..errors import (
    ConnectError,
    ConnectTimeout,
    ErrorContext,
    NetworkError,
    PoolTimeout,
    QwenEmbedError,
    RemoteProtocolError,
    ResponseError,
    TimeoutException,
    TransportError,
    WriteTimeout,
)
from ._contract import Reply, Request, Retired, sdk_cap
from ._http import httpx

__all__ = ["AsyncSDKTransport", "SDKTransport", "async_openai", "sync_openai"]

_NO_KEY = "EMPTY"  # the api_key given to the SDK when there is none
# Request headers the transport contract sets itself (framing, target).
_DROPPED_REQUEST = frozenset({"host", "content-length", "transfer-encoding", "connection"})
# Response headers that described the body as it was on the wire (it is decoded here).
_DROPPED_RESPONSE = frozenset({"content-encoding", "content-length", "transfer-encoding"})


class _Exchanges:
    """What the two SDK transports share: how an ``httpx.Request`` of the SDK becomes a
    ``Request`` of the library, and a ``Reply`` an ``httpx.Response``."""

    __slots__ = ("cap", "config", "ctx", "secret", "total")

    def __init__(self, config: EmbeddingConfig, secret: str | None) -> None:
        self.config = config
        self.secret = secret
        t = config.timeouts
        deadline = config.retry.deadline
        total = t.total
        if deadline is not None:
            total = deadline if total is None else min(total, deadline)
        self.total = total
        self.cap = config.max_response_bytes
        self.ctx = ErrorContext(
            url=config.pool_key.label,
            secret=None if config.key_function is not None else config.api_key,
            connect=t.connect,
            read=t.read,
            write=t.write,
            pool=t.pool,
            total=self.total,
            max_connections=config.limits.max_connections,
            headers=config.headers,
            body=config.extra_body,
        )

    def request(self, request: Any, body: bytes) -> Request:
        headers = {
            k: v for k, v in request.headers.multi_items() if k.lower() not in _DROPPED_REQUEST
        }
        cap = self.cap if self.cap is not None else sdk_cap(body)
        ctx = self.ctx
        if self.config.key_function is not None:  # this request's key, scrubbed too
            ctx = replace(ctx, secret=_request_secret(request))
        return Request(
            request.method,
            str(request.url),
            body,
            headers,
            self.config.timeouts,
            self.total,
            cap,
            ctx,
        )

    def response(self, reply: Reply, request: Any) -> Any:
        """The ``httpx.Response`` the SDK reads for ``reply``, scrubbed.

        Raises:
            httpx.DecodingError: a 2xx answer to ``POST .../embeddings`` that the codec
                refuses (``_refused_answer``); the SDK raises it as
                ``openai.APIConnectionError``, chained from it, itself chained from the
                scrubbed ``ResponseError``.
        """
        secrets = (_request_secret(request), *self.ctx.secrets())  # credential-like headers too
        refused = _refused_answer(request, reply)
        if refused is not None:  # a fresh, scrubbed copy: no server bytes in its chain
            clean = ResponseError(scrub(str(refused), *secrets), index=refused.index)
            raise _as_httpx(clean, request) from clean
        headers = [  # names too: a server may echo a secret as a header's name
            (scrub(k, *secrets), scrub(v, *secrets))
            for k, v in reply.headers.items()
            if k.lower() not in _DROPPED_RESPONSE
        ]
        if reply.http_version == "HTTP/2" and self.config.http2:
            pool.h2c_succeeded(self.config.pool_key)
        return httpx.Response(  # no reason phrase: httpx gives the standard one
            status_code=reply.status,
            headers=headers,
            content=_scrubbed_body(reply.status, reply.body, secrets),
            request=request,
            extensions={"http_version": reply.http_version.encode("ascii")},
        )

    def resend(self, exc: TransportError, first: bool) -> bool:
        """Whether a failed SDK request is sent again at once: on the pool's next
        transport after a cleartext HTTP/2 attempt the server did not speak (nothing of
        an answer received: a broken HTTP/2 answer shows it does)."""
        if not first or not exc.fresh or exc.refused or exc.received:
            return False
        return pool.h2c_fallback(self.config.pool_key)


def _as_httpx(exc: QwenEmbedError, request: Any) -> Exception:
    """The ``httpx`` exception the SDK turns into its own for a library error (it wraps
    only ``httpx`` request errors): a timeout as the ``httpx`` timeout of the same kind
    (``openai.APITimeoutError``), any other failure as the nearest ``httpx.RequestError``
    (``openai.APIConnectionError``); the caller chains it ``from`` the library's error."""
    kind: Any = httpx.TransportError
    if isinstance(exc, TimeoutException):
        kind = httpx.ReadTimeout
        if isinstance(exc, PoolTimeout):
            kind = httpx.PoolTimeout
        elif isinstance(exc, ConnectTimeout):
            kind = httpx.ConnectTimeout
        elif isinstance(exc, WriteTimeout):
            kind = httpx.WriteTimeout
    elif isinstance(exc, ConnectError):
        kind = httpx.ConnectError
    elif isinstance(exc, RemoteProtocolError):
        kind = httpx.RemoteProtocolError
    elif isinstance(exc, NetworkError):
        kind = httpx.ReadError
    elif isinstance(exc, ResponseError):  # over the size cap, a corrupt encoding
        kind = httpx.DecodingError
    error: Exception = kind(str(exc), request=request)
    return error


def _input_count(body: bytes) -> int | None:
    """The number of inputs an embeddings request body asks for (a string or one list of
    token ids: 1), or ``None`` when the body does not say (not JSON, no ``input``)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    given = doc.get("input") if isinstance(doc, dict) else None
    if isinstance(given, str):
        return 1
    if not isinstance(given, list) or not given:
        return None
    if all(isinstance(x, int) and not isinstance(x, bool) for x in given):
        return 1
    return len(given)


def _refused_answer(request: Any, reply: Reply) -> ResponseError | None:
    """The codec's refusal of a 2xx answer to ``POST .../embeddings`` (``None``: none,
    or another request): the same checks as the library's own calls (``decode_checked``:
    JSON, a ``data`` list with one vector per input, indexes, one size, flat numbers or
    base64, no NaN/Inf or all-zero vector, ``{"error": ...}`` in a 200)."""
    if request.method != "POST" or not request.url.path.endswith("/embeddings"):
        return None
    if not 200 <= reply.status < 300:
        return None
    count = _input_count(request.content)
    if count is None:
        return None
    try:
        decode_checked(parse_body(reply.body), range(count))
    except ResponseError as exc:
        return exc
    return None


def _scrubbed_body(status: int, body: bytes, secrets: tuple[str | None, ...]) -> bytes:
    """``body`` with every echo of ``secrets`` scrubbed (``errors.scrub``) before the SDK
    sees it (it quotes an error body in ``APIStatusError`` and keeps a success body's
    extra fields). An error body is scrubbed as text. A success body is scrubbed only
    when it holds a secret (exact or case-changed), field by field as JSON, the vectors
    (``data[i].embedding``) left as they are: a base64 vector may hold a short key's
    letters by chance."""
    keys = [k for k in secrets if k and len(k) >= 4]
    if not body or not keys:
        return body
    if not 200 <= status < 300:
        return scrub(body.decode("utf-8", "replace"), *keys).encode("utf-8")
    lowered = body.lower()
    if not any(k.lower().encode("utf-8", "replace") in lowered for k in keys):
        return body
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return scrub(body.decode("utf-8", "replace"), *keys).encode("utf-8")

    def clean(value: Any, vector: bool = False) -> Any:
        if vector:
            return value
        if isinstance(value, str):
            return scrub(value, *keys)
        if isinstance(value, list):
            return [clean(v) for v in value]
        if isinstance(value, dict):
            return {clean(k): clean(v, k == "embedding") for k, v in value.items()}
        return value

    return orjson.dumps(clean(doc))


def _request_secret(request: Any) -> str | None:
    """The API key a request of the SDK carries (its ``Authorization`` value without the
    scheme), or ``None`` (no header, or the ``"EMPTY"`` placeholder sent without a key)."""
    value = request.headers.get("authorization")
    if not value:
        return None
    scheme, _, rest = value.strip().partition(" ")
    secret = rest.strip() or scheme
    return None if secret == _NO_KEY else secret


class SDKTransport(httpx.BaseTransport):
    """The ``httpx.BaseTransport`` of ``openai_client()``: each request goes through the
    endpoint's current blocking transport (``pool.sync_transport``). ``close()`` closes
    nothing: the pool is shared (see ``close_all()``)."""

    def __init__(self, config: EmbeddingConfig, secret: str | None) -> None:
        self.exchanges = _Exchanges(config, secret)

    def handle_request(self, request: Any) -> Any:
        ex = self.exchanges
        req = ex.request(request, request.read())
        key = ex.config.pool_key
        for first in (True, False):
            try:
                try:
                    reply = pool.sync_transport(key).send(req)
                except Retired:  # closed under us (close_all, reaper): on the new one
                    reply = pool.sync_transport(key).send(req)
            except QwenEmbedError as exc:
                if isinstance(exc, TransportError) and ex.resend(exc, first):
                    continue
                raise _as_httpx(exc, request) from exc
            return ex.response(reply, request)
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        """Nothing to close (the pool is shared; see ``close_all()``)."""


class AsyncSDKTransport(httpx.AsyncBaseTransport):
    """The ``httpx.AsyncBaseTransport`` of the async ``openai_client()``: each request
    goes through the running event loop's transport of the endpoint
    (``pool.async_transport``), so one SDK object works on every loop. ``aclose()``
    closes nothing."""

    def __init__(self, config: EmbeddingConfig, secret: str | None) -> None:
        self.exchanges = _Exchanges(config, secret)

    async def handle_async_request(self, request: Any) -> Any:
        ex = self.exchanges
        req = ex.request(request, await request.aread())
        key = ex.config.pool_key
        for first in (True, False):
            try:
                try:
                    reply = await pool.async_transport(key).send(req)
                except Retired:
                    reply = await pool.async_transport(key).send(req)
            except QwenEmbedError as exc:
                if isinstance(exc, TransportError) and ex.resend(exc, first):
                    continue
                raise _as_httpx(exc, request) from exc
            return ex.response(reply, request)
        raise AssertionError("unreachable")  # pragma: no cover

    async def aclose(self) -> None:
        """Nothing to close (the pool is shared; see ``aclose_all()``)."""


def sync_openai(config: EmbeddingConfig, *, api_key: str | Callable[[], str] | None) -> Any:
    """An ``openai.OpenAI`` on ``config``'s pool, SDK retries off (``max_retries=0``),
    sending ``config.headers`` with every request (``api_key``: the key, or a callable
    the SDK calls for each request)."""
    import openai

    fixed = api_key if isinstance(api_key, str) else None
    client = httpx.Client(transport=SDKTransport(config, fixed), trust_env=False)
    return openai.OpenAI(
        api_key=api_key or _NO_KEY,
        base_url=config.replicas[0],
        http_client=cast(Any, client),
        max_retries=0,
        default_headers=dict(config.headers) if config.headers else None,
    )


def async_openai(
    config: EmbeddingConfig, *, api_key: str | Callable[[], Awaitable[str]] | None
) -> Any:
    """An ``openai.AsyncOpenAI`` on ``config``'s pools, SDK retries off, sending
    ``config.headers`` with every request (``api_key``: the key, or an async callable
    the SDK awaits for each request)."""
    import openai

    fixed = api_key if isinstance(api_key, str) else None
    client = httpx.AsyncClient(transport=AsyncSDKTransport(config, fixed), trust_env=False)
    return openai.AsyncOpenAI(
        api_key=api_key or _NO_KEY,
        base_url=config.replicas[0],
        http_client=cast(Any, client),
        max_retries=0,
        default_headers=dict(config.headers) if config.headers else None,
    )
