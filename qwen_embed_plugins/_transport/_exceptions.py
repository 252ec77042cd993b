"""The one exception map: what a backend raised becomes the library's error here and
nowhere else (as httpx's ``map_httpcore_exceptions`` maps httpcore's).

``translate`` knows the exceptions of ``httpx``/``httpx2`` (and the ``h2`` exceptions
that escape it), of ``http.client`` / ``ssl`` / ``socket`` and of ``aiohttp``, each by
its public type; ``_contract.failure`` / ``mapped`` call it for every backend and raise
the result ``from`` the original. Every text taken from the original is scrubbed of the
API key and the credential-like header values (``ErrorContext.secrets``) first; errors
are built once, with how far the exchange got (``fresh``, ``received``) as fields.

Signals are read from public types and documented attributes, never from messages:
``h2`` exceptions by ``isinstance(exc, h2.exceptions.H2Error)``; a refused HTTP/2 stream
by the ``h2.events.StreamReset`` (``error_code == ErrorCodes.REFUSED_STREAM``) or
``h2.events.ConnectionTerminated`` that httpcore raises its ``RemoteProtocolError``
with, found on the exception chain (``_refused``); TLS hints by the ``ssl`` error on the
chain (``SSLCertVerificationError``; ``SSLError.reason``, OpenSSL's reason mnemonic),
aiohttp's wrapped through its public ``os_error`` / ``certificate_error``.

Two readings are not documented by the backend, both bounded: that httpcore puts h2's
event in its exception's ``args`` (if it stopped, a refused stream would be retried as a
plain protocol error, within ``max_attempts``, instead of resent at once;
``tests/test_backend_signals.py`` fails); and, for an ``h2`` exception that escaped
httpx (read after a GOAWAY), h2's text ``ConnectionState.CLOSED``, the only mark h2
gives of a connection its state machine has closed (if it changed, the same bounded
fallback).
"""

from __future__ import annotations

from typing import Any

from .._server_text import scrub
from ..errors import (
    ConnectError,
    ConnectTimeout,
    ErrorContext,
    NetworkError,
    QwenEmbedError,
    ReadTimeout,
    RemoteProtocolError,
    TransportError,
    WriteTimeout,
    pool_timeout_error,
)

__all__ = ["certificate_failure", "translate"]


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it was raised from (``__cause__``, else ``__context__``), and
    the ``os_error`` / ``certificate_error`` an aiohttp connector error carries (public
    properties): at most 8, where a backend's typed original is found (httpx raises
    its errors ``from`` httpcore's, which raises them ``from`` the ``ssl`` / ``h2``
    ones)."""
    found: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo and len(found) < 8:
        item = todo.pop(0)
        if item is None or any(item is seen for seen in found):
            continue
        found.append(item)
        for name in ("os_error", "certificate_error"):
            inner = getattr(item, name, None)
            if isinstance(inner, BaseException):
                todo.append(inner)
        todo.append(item.__cause__ or item.__context__)
    return found


def _refused(exc: BaseException) -> bool:
    """An HTTP/2 answer that means "not processed, send it again", recognised by h2's
    public event types that httpcore raises its ``RemoteProtocolError`` with (as its
    argument; httpx raises its own ``from`` it): GOAWAY (``h2.events.ConnectionTerminated``)
    or RST_STREAM with ``h2.errors.ErrorCodes.REFUSED_STREAM`` (``StreamReset``; RFC 9113
    section 8.7)."""
    import h2.errors
    import h2.events

    for item in _chain(exc):
        for arg in item.args:
            if isinstance(arg, h2.events.ConnectionTerminated):
                return True
            if (
                isinstance(arg, h2.events.StreamReset)
                and arg.error_code == h2.errors.ErrorCodes.REFUSED_STREAM
            ):
                return True
    return False


def certificate_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (any backend's) comes from a failed TLS certificate verification
    (an ``ssl.SSLCertVerificationError`` on its chain)."""
    import ssl

    return any(isinstance(item, ssl.SSLCertVerificationError) for item in _chain(exc))


def _tls_hint(exc: BaseException, text: str, label: str) -> ConnectError | None:
    """A hint for a TLS failure, from the documented attributes of the ``ssl`` error
    found in ``exc``'s chain (``SSLCertVerificationError``; ``SSLError.reason``, the
    OpenSSL reason mnemonic)."""
    import ssl

    for item in _chain(exc):
        if isinstance(item, ssl.SSLCertVerificationError):
            return ConnectError(
                f"TLS certificate verification failed for {label}: {text}. Pass "
                "verify='/path/to/ca-bundle.pem' for a private CA",
                url=label,
            )
        # aiohttp's ClientConnectorSSLError is an SSLError without a reason of its own:
        # the ssl error it wraps (``os_error``) comes next in the chain
        if getattr(item, "reason", None) == "WRONG_VERSION_NUMBER" and isinstance(
            item, ssl.SSLError
        ):
            return ConnectError(
                f"TLS handshake with {label} failed: the server answers plain HTTP; use an "
                f"http:// base_url ({text})",
                url=label,
            )
    return None


def translate(
    exc: BaseException,
    ctx: ErrorContext,
    *,
    backend: str,
    stage: str = "read",
    proxy: bool = False,
    fresh: bool = True,
    received: bool = False,
) -> QwenEmbedError:
    """The library error for an exception an HTTP backend raised: the one map from
    ``httpx``/``httpx2`` (and the ``h2`` exceptions that escape it), ``http.client`` /
    ``ssl`` / ``socket`` and ``aiohttp`` to this tree (as httpx maps httpcore's
    in ``map_httpcore_exceptions``). The caller raises the result ``from exc``
    (``_contract.mapped`` does, for every backend).

    Args:
        exc: what the backend raised.
        ctx: how the error describes the endpoint; its key is scrubbed from every text.
        backend: ``"httpx"``, ``"aiohttp"`` or ``"stdlib"`` (``http.client``, ``ssl``,
            ``socket``): whose exception it is (a builtin ``ValueError`` means different
            things in each).
        stage: how far the exchange got, for exceptions that carry no stage of their own
            (the builtin ``TimeoutError``/``OSError``): ``"connect"`` (TCP, TLS, proxy
            tunnel: nothing sent), ``"write"`` or ``"read"``.
        proxy: the connection goes through a proxy (a connect failure is the proxy's).
        fresh: the exchange ran on a connection opened for it.
        received: part of the response had arrived.
    """
    if isinstance(exc, QwenEmbedError):
        return exc
    marks: dict[str, Any] = {"fresh": fresh, "received": received}
    import h2.exceptions

    if isinstance(exc, h2.exceptions.H2Error):
        return _from_h2(exc, ctx, marks)
    if backend == "aiohttp":
        return _from_aiohttp(exc, ctx, marks)
    if backend == "httpx":
        return _from_httpx(exc, ctx, marks)
    return _from_stdlib(exc, ctx, marks, stage=stage, proxy=proxy)


def _from_h2(exc: BaseException, ctx: ErrorContext, marks: dict[str, Any]) -> NetworkError:
    """An ``h2`` exception that escaped the HTTP library: a frame arrived on a
    connection h2's state machine considers closed (after a GOAWAY), so the stream was
    not answered: resend it (``refused``)."""
    text = scrub(str(exc), *ctx.secrets())
    refused = "ConnectionState.CLOSED" in text
    return NetworkError(
        f"the HTTP/2 connection to {ctx.url} failed: {text[:200]}",
        url=ctx.url,
        refused=refused,
        **marks,
    )


def _from_httpx(exc: BaseException, ctx: ErrorContext, marks: dict[str, Any]) -> TransportError:
    from ._http import httpx

    label = ctx.url
    text = scrub(str(exc), *ctx.secrets()) or type(exc).__name__
    if isinstance(exc, httpx.ConnectTimeout):
        return ConnectTimeout(
            f"connecting to {label} took longer than {ctx.connect} s (Timeouts.connect)",
            url=label,
            **marks,
        )
    if isinstance(exc, httpx.ReadTimeout):
        return ReadTimeout(
            f"{label} sent nothing for {ctx.read} s (Timeouts.read)", url=label, **marks
        )
    if isinstance(exc, httpx.WriteTimeout):
        return WriteTimeout(
            f"sending to {label} took longer than {ctx.write} s (Timeouts.write)",
            url=label,
            **marks,
        )
    if isinstance(exc, httpx.PoolTimeout):
        return pool_timeout_error(ctx)
    if isinstance(exc, httpx.ProxyError):
        return ConnectError(f"the proxy for {label} failed: {text}", url=label, **marks)
    if isinstance(exc, httpx.ConnectError):
        return _tls_hint(exc, text, label) or ConnectError(
            f"cannot connect to {label}: {text}", url=label, **marks
        )
    if isinstance(exc, httpx.RemoteProtocolError):
        refused = _refused(exc)
        what = "refused the HTTP/2 stream" if refused else "closed the connection"
        return RemoteProtocolError(f"{label} {what}: {text}", url=label, refused=refused, **marks)
    if isinstance(exc, httpx.LocalProtocolError):
        # The connection's protocol state refused the request (an HTTP/2 connection that
        # received GOAWAY, a frame h2's state machine rejects): it was not answered.
        return NetworkError(
            f"the connection to {label} could not carry the request: {text}",
            url=label,
            refused=True,
            **marks,
        )
    if isinstance(exc, httpx.NetworkError | httpx.ProtocolError):
        return NetworkError(f"connection to {label} broke: {text}", url=label, **marks)
    if isinstance(exc, httpx.TooManyRedirects | httpx.UnsupportedProtocol | httpx.InvalidURL):
        return TransportError(f"request to {label} failed: {text}", url=label, sent=False)
    if not isinstance(exc, httpx.HTTPError):
        # raised through httpx unwrapped: httpcore's ``int()`` of a malformed HTTP/2
        # ``:status`` (ValueError), and the like: the server's answer was not HTTP
        return RemoteProtocolError(
            f"{label} sent a malformed answer: {type(exc).__name__}: {text[:200]}",
            url=label,
            **marks,
        )
    return TransportError(f"request to {label} failed: {text}", url=label, **marks)


def _from_stdlib(
    exc: BaseException,
    ctx: ErrorContext,
    marks: dict[str, Any],
    *,
    stage: str,
    proxy: bool,
) -> TransportError:
    import http.client

    label = ctx.url
    text = scrub(str(exc), *ctx.secrets()) or type(exc).__name__
    if isinstance(exc, TimeoutError) and stage == "connect":
        what = "connecting to the proxy of" if proxy else "connecting to"
        return ConnectTimeout(
            f"{what} {label} took longer than {ctx.connect} s (Timeouts.connect)",
            url=label,
            **marks,
        )
    if isinstance(exc, TimeoutError) and stage == "write":
        return WriteTimeout(
            f"sending to {label} took longer than {ctx.write} s (Timeouts.write)",
            url=label,
            **marks,
        )
    if isinstance(exc, TimeoutError):
        return ReadTimeout(
            f"{label} sent nothing for {ctx.read} s (Timeouts.read)", url=label, **marks
        )
    if stage == "connect":
        hint = _tls_hint(exc, text, label)
        if hint is not None:
            return hint
        if proxy:
            return ConnectError(f"the proxy for {label} failed: {text}", url=label, **marks)
        return ConnectError(f"cannot connect to {label}: {text}", url=label, **marks)
    if isinstance(exc, http.client.RemoteDisconnected):
        return RemoteProtocolError(
            f"{label} closed the connection: Server disconnected without sending a response",
            url=label,
            **marks,
        )
    if isinstance(exc, http.client.HTTPException):
        return RemoteProtocolError(f"{label} sent a broken response: {text}", url=label, **marks)
    if isinstance(exc, OSError):
        when = "sending the request" if stage == "write" else "reading the response"
        return NetworkError(f"connection to {label} broke while {when}: {text}", url=label, **marks)
    if isinstance(exc, ValueError | UnicodeError):
        return TransportError(f"request to {label} failed: {text}", url=label, sent=False)
    return TransportError(f"request to {label} failed: {text}", url=label, **marks)


def _from_aiohttp(exc: BaseException, ctx: ErrorContext, marks: dict[str, Any]) -> TransportError:
    import aiohttp

    label = ctx.url
    text = scrub(str(exc), *ctx.secrets()) or type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return ConnectTimeout(
            f"connecting to {label} took longer than {ctx.connect} s (Timeouts.connect)",
            url=label,
            **marks,
        )
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return ReadTimeout(
            f"{label} sent nothing for {ctx.read} s (Timeouts.read)", url=label, **marks
        )
    if isinstance(exc, aiohttp.ClientProxyConnectionError | aiohttp.ClientHttpProxyError):
        return ConnectError(f"the proxy for {label} failed: {text}", url=label, **marks)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return _tls_hint(exc, text, label) or ConnectError(
            f"cannot connect to {label}: {text}", url=label, **marks
        )
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return RemoteProtocolError(
            f"{label} closed the connection: Server disconnected without sending a response",
            url=label,
            **marks,
        )
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ClientResponseError):
        return RemoteProtocolError(f"{label} sent a broken response: {text}", url=label, **marks)
    if isinstance(exc, aiohttp.ClientOSError | aiohttp.ClientConnectionError):
        return NetworkError(f"connection to {label} broke: {text}", url=label, **marks)
    if isinstance(exc, aiohttp.InvalidURL):
        return TransportError(f"request to {label} failed: {text}", url=label, sent=False)
    return TransportError(f"request to {label} failed: {text}", url=label, **marks)
