"""The openai SDK on the shared pools: ``openai.OpenAI`` / ``openai.AsyncOpenAI`` whose
HTTP client sends through the endpoint's pool.

``openai`` is imported only here, and only when an SDK object is asked for
(``openai_client()`` or ``use_sdk=True``): importing it costs ~1.7 s of CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import orjson

from . import pool
from ._http import httpx
from .config import RESERVED_BODY_KEYS, PoolKey
from .errors import ErrorContext, QwenEmbedError, from_sdk, scrub
from .transport import Reply

__all__ = ["AsyncSDKHTTPClient", "SDKHTTPClient", "async_openai", "sdk_reply", "sync_openai"]

# Errors that mean "no HTTP exchange happened" on a cleartext HTTP/2 attempt: the server
# does not speak h2c (prior knowledge) and dropped the connection.
_H2C_FAILURES = (httpx.RemoteProtocolError, httpx.ConnectError, httpx.ReadError, httpx.WriteError)
_NO_KEY = "EMPTY"  # the api_key given to the SDK when there is none


class _NoTransport(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """The transport of an SDK-facing client: never used (its ``send`` goes to the pool)."""

    def handle_request(self, request: Any) -> Any:
        raise RuntimeError("requests of this client go through the shared pool")

    async def handle_async_request(self, request: Any) -> Any:
        raise RuntimeError("requests of this client go through the shared pool")


def _request_secret(request: Any) -> str | None:
    """The API key a request of the SDK carries (its ``Authorization`` value without the
    scheme), or ``None`` (no header, or the ``"EMPTY"`` placeholder sent without a key)."""
    value = request.headers.get("authorization")
    if not value:
        return None
    scheme, _, rest = value.strip().partition(" ")
    secret = rest.strip() or scheme
    return None if secret == _NO_KEY else secret


def scrub_response_headers(response: Any, request: Any) -> Any:
    """``response`` with every header value scrubbed of the request's API key (exact,
    case-changed or truncated echoes, and any ``Bearer``/``Basic``/``token`` value; see
    ``errors.scrub``), before the SDK sees it: ``openai._base_client`` logs the
    ``x-request-id`` value at DEBUG and keeps it on its exceptions (``request_id``)."""
    secret = _request_secret(request)
    items = response.headers.multi_items()
    cleaned = [(name, scrub(value, secret)) for name, value in items]
    if cleaned != items:
        response.headers = httpx.Headers(cleaned)
    return response


class SDKHTTPClient(httpx.Client):
    """The ``httpx.Client`` handed to ``openai.OpenAI``: a stable handle on the pool's
    *current* transport.

    Each ``send`` goes through ``pool.sync_transport(key)`` (gated like every request of
    the pool), so an SDK object kept by the user keeps working after ``close_all()``, in a
    forked child (which gets its own sockets) and after the cleartext HTTP/2 -> HTTP/1.1
    fallback (which this client also triggers, resending once). ``close()`` does nothing:
    the shared pool is not the SDK object's to close.
    """

    def __init__(self, key: PoolKey) -> None:
        super().__init__(transport=_NoTransport(), trust_env=False)
        self._pool_key = key

    def send(self, request: Any, **kwargs: Any) -> Any:
        try:
            response = pool.sync_transport(self._pool_key).send_httpx(request, **kwargs)
        except _H2C_FAILURES:
            if not pool.h2c_fallback(self._pool_key):
                raise
            response = pool.sync_transport(self._pool_key).send_httpx(request, **kwargs)
        return scrub_response_headers(response, request)

    def close(self) -> None:
        """Nothing to close (the pool is shared; see ``close_all()``)."""


class AsyncSDKHTTPClient(httpx.AsyncClient):
    """The ``httpx.AsyncClient`` handed to ``openai.AsyncOpenAI``: each ``send`` goes
    through the running loop's pool (its aiohttp session, or its HTTP/2 client), so one
    SDK object works on any event loop, after ``close_all()`` and after the h2c fallback.
    ``aclose()`` does nothing."""

    def __init__(self, key: PoolKey) -> None:
        super().__init__(transport=_NoTransport(), trust_env=False)
        self._pool_key = key

    async def send(self, request: Any, **kwargs: Any) -> Any:
        try:
            response = await pool.async_transport(self._pool_key).send_httpx(request, **kwargs)
        except _H2C_FAILURES:
            if not pool.h2c_fallback(self._pool_key):
                raise
            response = await pool.async_transport(self._pool_key).send_httpx(request, **kwargs)
        return scrub_response_headers(response, request)

    async def aclose(self) -> None:
        """Nothing to close (the pool is shared; see ``aclose_all()``)."""


def sync_openai(
    key: PoolKey,
    *,
    base_url: str,
    api_key: str | None,
    headers: Mapping[str, str] | None = None,
) -> Any:
    """An ``openai.OpenAI`` on ``key``'s pool, SDK retries off (``max_retries=0``),
    sending ``headers`` (``EmbeddingConfig.headers``) with every request."""
    import openai

    return openai.OpenAI(
        api_key=api_key or _NO_KEY,
        base_url=base_url,
        http_client=cast(Any, SDKHTTPClient(key)),
        max_retries=0,
        default_headers=dict(headers) if headers else None,
    )


def async_openai(
    key: PoolKey,
    *,
    base_url: str,
    api_key: str | None,
    headers: Mapping[str, str] | None = None,
) -> Any:
    """An ``openai.AsyncOpenAI`` on ``key``'s pools, SDK retries off, sending
    ``headers`` with every request."""
    import openai

    return openai.AsyncOpenAI(
        api_key=api_key or _NO_KEY,
        base_url=base_url,
        http_client=cast(Any, AsyncSDKHTTPClient(key)),
        max_retries=0,
        default_headers=dict(headers) if headers else None,
    )


def sdk_kwargs(model: str, body: bytes) -> dict[str, Any]:
    """The ``embeddings.create`` arguments equivalent to a request body of ours."""
    data = orjson.loads(body)
    kwargs: dict[str, Any] = {"input": data["input"], "model": model}
    # Without encoding_format the SDK asks for base64 and decodes it itself.
    if data.get("encoding_format") == "float":
        kwargs["encoding_format"] = "float"
    if data.get("dimensions") is not None:
        kwargs["dimensions"] = data["dimensions"]
    extra = {k: v for k, v in data.items() if k not in RESERVED_BODY_KEYS}
    if extra:  # EmbeddingConfig.extra_body
        kwargs["extra_body"] = extra
    return kwargs


def sdk_reply(raw: Any) -> Reply:
    """The answer of ``embeddings.with_raw_response.create`` as the ``Reply`` the engine
    decodes: the SDK built and sent the request; the body is read by this package's
    codec, so a malformed answer (``{"error": ...}`` in a 200, booleans or strings as
    components) is refused with the same ``ResponseError`` as on the codec path rather
    than coerced by the SDK's models."""
    http = raw.http_response
    return Reply(status=http.status_code, headers=http.headers, body=http.content, fresh=True)


class SDKError(Exception):
    """The scrubbed text of an openai SDK exception: the ``__cause__`` of the library error
    raised for it, so a traceback never prints a server echo of the key."""


def translate(exc: BaseException, ctx: ErrorContext, status_error: Any) -> QwenEmbedError:
    """An SDK failure as this library's error (see ``errors.from_sdk``), chained to a
    scrubbed copy of the SDK exception (raise it ``from error.__cause__``)."""
    error = from_sdk(exc, ctx, status_error=status_error)
    cause = SDKError(f"{type(exc).__module__}.{type(exc).__name__}: {scrub(str(exc), ctx.key())}")
    error.__cause__ = cause
    return error
