"""The one exception map: what a backend raised becomes the library's error here and
nowhere else (as httpx's ``map_httpcore_exceptions`` maps httpcore's).

The map is one table per backend (``_table``): ``httpx``/``httpx2``, ``http.client`` /
``ssl`` / ``socket`` (``"stdlib"``) and ``aiohttp``, each row a backend exception type ->
the library's error class, its message and how far the exchange got (``_Rule``), after
the rows every backend shares (the ``h2`` exceptions that escape httpx). ``translate``
walks the table of the backend, first matching row wins; ``_contract.failure`` /
``mapped`` call it for every backend.

Every text taken from the original is scrubbed of the API key and the credential-like
header values (``ErrorContext.secrets``) first; errors are built once, with how far the
exchange got (``fresh``, ``received``) as fields. The original itself is never chained to
the library's error (``_contract.Mapped``): a backend's exception quotes the server's bytes
as they came (a status line, a chunk-size line, a header line), and a formatted
traceback prints every exception of the chain. What the chain tells is read here, before
it is dropped.

Signals are read from public types and documented attributes, never from messages:
``h2`` exceptions by ``isinstance(exc, h2.exceptions.H2Error)``; a refused HTTP/2 stream
by the ``h2.events.StreamReset`` (``error_code == ErrorCodes.REFUSED_STREAM``) or
``h2.events.ConnectionTerminated`` that httpcore raises its ``RemoteProtocolError``
with, found on the exception chain (``_refused``); TLS hints by the ``ssl`` error on the
chain (``SSLCertVerificationError``; ``SSLError.reason``, OpenSSL's reason mnemonic),
aiohttp's wrapped through its public ``os_error`` / ``certificate_error``.

Three readings are not documented by the backend, each bounded: that httpcore puts h2's
event in its exception's ``args`` (if it stopped, a refused stream would be retried as a
plain protocol error, within ``max_attempts``, instead of resent at once;
``tests/test_backend_signals.py`` fails); and, for an ``h2`` exception that escaped
httpx (read after a GOAWAY), h2's text ``ConnectionState.CLOSED``, the only mark h2
gives of a connection its state machine has closed (if it changed, the same bounded
fallback); and that httpcore raises its ``LocalProtocolError`` with (or from) the h2
``ProtocolError`` of a frame h2 rejected (``_rejected_answer``; if it stopped, a
malformed HTTP/2 head would be taken for a refused stream again, resent until the
deadline; ``tests/test_hostile_paths.py``, a malformed HTTP/2 header, fails).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._server_text import scrub
from ..errors import (
    ConnectError,
    ConnectTimeout,
    ErrorContext,
    NetworkError,
    PoolTimeout,
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


def _h2_closed(exc: BaseException) -> bool:
    """An ``h2`` exception that escaped the HTTP library because a frame arrived on a
    connection h2's state machine considers closed (after a GOAWAY): the stream was not
    answered."""
    return "ConnectionState.CLOSED" in str(exc)


def _rejected_answer(exc: BaseException) -> bool:
    """h2 rejected a frame the server sent (an ``h2.exceptions.ProtocolError`` that
    httpcore raised its ``LocalProtocolError`` with or from), neither a stream the
    server reset (``StreamClosedError``: a refused stream under httpcore2) nor a
    connection h2 holds closed (``_h2_closed``)."""
    import h2.exceptions

    for item in _chain(exc):
        for found in (item, *item.args):
            if isinstance(found, h2.exceptions.StreamClosedError) or (
                isinstance(found, BaseException) and _h2_closed(found)
            ):
                return False
    return any(
        isinstance(found, h2.exceptions.ProtocolError)
        for item in _chain(exc)
        for found in (item, *item.args)
    )


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


# --------------------------------------------------------------------------- the table

_CONNECT = "connecting to {label} took longer than {connect} s (Timeouts.connect)"
_READ = "{label} sent nothing for {read} s (Timeouts.read)"
_WRITE = "sending to {label} took longer than {write} s (Timeouts.write)"
_PROXY = "the proxy for {label} failed: {text}"
_CANNOT = "cannot connect to {label}: {text}"
_CLOSED = "{label} closed the connection: Server disconnected without sending a response"
_BROKEN = "{label} sent a broken response: {text}"
_FAILED = "request to {label} failed: {text}"


@dataclass(frozen=True, slots=True)
class _Rule:
    """One row of the exception table: an exception of ``types`` (under the conditions
    given) becomes ``error(message)``.

    Attributes:
        types: the backend's exception types the row matches.
        error: the library's error class (``PoolTimeout``: ``pool_timeout_error``).
        message: its text, a ``str.format`` template over ``label`` (the endpoint),
            ``text`` (the original's scrubbed text), ``short`` (its first 200
            characters), ``name`` (the original's type name) and ``connect`` / ``read``
            / ``write`` (the timeouts, seconds).
        stage: only at this stage of the exchange (``"connect"``, ``"write"``): for the
            builtin exceptions, which carry none of their own.
        proxy: only through a proxy (``True``) or without one (``False``).
        when: only if this holds for the original (a signal read from its chain).
        tls: a TLS failure on the chain gives its hint instead (``_tls_hint``).
        sent: the request may have reached the server (``False``: nothing was sent).
        refused: the server refused the request before processing it: resend.
        answered: a response head arrived (``received``), though not a valid one.
    """

    types: tuple[type[BaseException], ...]
    error: type[TransportError]
    message: str
    stage: str | None = None
    proxy: bool | None = None
    when: Callable[[BaseException], bool] | None = None
    tls: bool = False
    sent: bool = True
    refused: bool = False
    answered: bool = False

    def matches(self, exc: BaseException, stage: str, proxy: bool) -> bool:
        return (
            isinstance(exc, self.types)
            and (self.stage is None or self.stage == stage)
            and (self.proxy is None or self.proxy == proxy)
            and (self.when is None or self.when(exc))
        )


def _shared() -> list[_Rule]:
    """The rows every backend's table starts with."""
    import h2.exceptions

    h2_error = (h2.exceptions.H2Error,)
    h2_failed = "the HTTP/2 connection to {label} failed: {short}"
    return [
        _Rule(h2_error, NetworkError, h2_failed, when=_h2_closed, refused=True),
        _Rule(h2_error, NetworkError, h2_failed),
    ]


def _httpx_rows() -> list[_Rule]:
    from ._http import httpx

    return [
        _Rule((httpx.ConnectTimeout,), ConnectTimeout, _CONNECT),
        _Rule((httpx.ReadTimeout,), ReadTimeout, _READ),
        _Rule((httpx.WriteTimeout,), WriteTimeout, _WRITE),
        _Rule((httpx.PoolTimeout,), PoolTimeout, ""),
        _Rule((httpx.ProxyError,), ConnectError, _PROXY),
        _Rule((httpx.ConnectError,), ConnectError, _CANNOT, tls=True),
        _Rule(
            (httpx.RemoteProtocolError,),
            RemoteProtocolError,
            "{label} refused the HTTP/2 stream: {text}",
            when=_refused,
            refused=True,
        ),
        _Rule(
            (httpx.RemoteProtocolError,),
            RemoteProtocolError,
            "{label} closed the connection: {text}",
        ),
        # h2 rejected what the server sent while the response was awaited (a malformed
        # header such as a non-numeric ``content-length``), on a connection no GOAWAY
        # closed: the server answered, not in HTTP (refused at once, not resent)
        _Rule(
            (httpx.LocalProtocolError,),
            RemoteProtocolError,
            "{label} sent a malformed answer: {text}",
            stage="read",
            when=_rejected_answer,
            answered=True,
        ),
        # The connection's protocol state refused the request (an HTTP/2 connection
        # that received GOAWAY, a frame h2's state machine rejects): it was not answered.
        _Rule(
            (httpx.LocalProtocolError,),
            NetworkError,
            "the connection to {label} could not carry the request: {text}",
            refused=True,
        ),
        _Rule(
            (httpx.NetworkError, httpx.ProtocolError),
            NetworkError,
            "connection to {label} broke: {text}",
        ),
        _Rule(
            (httpx.TooManyRedirects, httpx.UnsupportedProtocol, httpx.InvalidURL),
            TransportError,
            _FAILED,
            sent=False,
        ),
        _Rule((httpx.HTTPError,), TransportError, _FAILED),
        # raised through httpx unwrapped: httpcore's ``int()`` of a malformed HTTP/2
        # ``:status`` (``ValueError``), and the like: the server answered, not in HTTP
        # (refused at once, as ``check_status`` refuses a status out of range)
        _Rule(
            (BaseException,),
            RemoteProtocolError,
            "{label} sent a malformed answer: {name}: {short}",
            answered=True,
        ),
    ]


def _stdlib_rows() -> list[_Rule]:
    import http.client

    took = " took longer than {connect} s (Timeouts.connect)"
    return [
        _Rule(
            (TimeoutError,),
            ConnectTimeout,
            "connecting to the proxy of {label}" + took,
            stage="connect",
            proxy=True,
        ),
        _Rule((TimeoutError,), ConnectTimeout, _CONNECT, stage="connect"),
        _Rule((TimeoutError,), WriteTimeout, _WRITE, stage="write"),
        _Rule((TimeoutError,), ReadTimeout, _READ),
        _Rule((BaseException,), ConnectError, _PROXY, stage="connect", proxy=True, tls=True),
        _Rule((BaseException,), ConnectError, _CANNOT, stage="connect", tls=True),
        _Rule((http.client.RemoteDisconnected,), RemoteProtocolError, _CLOSED),
        _Rule((http.client.HTTPException,), RemoteProtocolError, _BROKEN),
        _Rule(
            (OSError,),
            NetworkError,
            "connection to {label} broke while sending the request: {text}",
            stage="write",
        ),
        _Rule(
            (OSError,),
            NetworkError,
            "connection to {label} broke while reading the response: {text}",
        ),
        _Rule((ValueError, UnicodeError), TransportError, _FAILED, sent=False),
        _Rule((BaseException,), TransportError, _FAILED),
    ]


def _aiohttp_rows() -> list[_Rule]:
    import aiohttp

    return [
        _Rule((aiohttp.ConnectionTimeoutError,), ConnectTimeout, _CONNECT),
        _Rule((aiohttp.ServerTimeoutError,), ReadTimeout, _READ),
        _Rule(
            (aiohttp.ClientProxyConnectionError, aiohttp.ClientHttpProxyError), ConnectError, _PROXY
        ),
        _Rule((aiohttp.ClientConnectorError,), ConnectError, _CANNOT, tls=True),
        _Rule((aiohttp.ServerDisconnectedError,), RemoteProtocolError, _CLOSED),
        _Rule(
            (aiohttp.ClientPayloadError, aiohttp.ClientResponseError), RemoteProtocolError, _BROKEN
        ),
        _Rule(
            (aiohttp.ClientOSError, aiohttp.ClientConnectionError),
            NetworkError,
            "connection to {label} broke: {text}",
        ),
        _Rule((aiohttp.InvalidURL,), TransportError, _FAILED, sent=False),
        _Rule((BaseException,), TransportError, _FAILED),
    ]


_ROWS: dict[str, Callable[[], list[_Rule]]] = {
    "httpx": _httpx_rows,
    "stdlib": _stdlib_rows,
    "aiohttp": _aiohttp_rows,
}
_TABLES: dict[str, tuple[_Rule, ...]] = {}


def _table(backend: str) -> tuple[_Rule, ...]:
    """The rows for ``backend``, built on first use (each imports its backend)."""
    table = _TABLES.get(backend)
    if table is None:
        table = _TABLES[backend] = (*_shared(), *_ROWS[backend]())
    return table


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
    in ``map_httpcore_exceptions``): the first row of the backend's table that matches.
    The caller raises the result with no chain (``_contract.Mapped`` does, for every
    backend).

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

    Raises:
        KeyError: an unknown ``backend``.
    """
    if isinstance(exc, QwenEmbedError):
        return exc
    rule = next(r for r in _table(backend) if r.matches(exc, stage, proxy))
    label = ctx.url
    if rule.error is PoolTimeout:
        return pool_timeout_error(ctx)
    text = scrub(str(exc), *ctx.secrets()) or type(exc).__name__
    if rule.tls:
        hint = _tls_hint(exc, text, label)
        if hint is not None:
            return hint
    message = rule.message.format(
        label=label,
        text=text,
        short=text[:200],
        name=type(exc).__name__,
        connect=ctx.connect,
        read=ctx.read,
        write=ctx.write,
    )
    marks: dict[str, Any] = {"sent": False}
    if rule.sent:
        marks = {"fresh": fresh, "received": received or rule.answered, "refused": rule.refused}
    return rule.error(message, url=label, **marks)
