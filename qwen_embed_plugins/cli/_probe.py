"""Raw HTTP probes of ``check_server`` (and of the tooling's ``run_bench``).

``bounded_get`` is the library's one ``GET /models`` probe: at most ``PROBE_MAX_BYTES``
read (as received) and ``PROBE_BUDGET`` seconds in all: each connect, read (of a
trickled head too), write and pool wait within the time left (``transport.TimeLeft``).

These talk to a server below the client on purpose (one plain request, its status and
body as sent), so they use the HTTP library directly (``_http``, the one module that
chooses it) or the standard library. They never raise for an HTTP or transport failure
of the probe itself: callers get ``None`` / empty results or the status to report.
Errors a caller must raise come from the client, the one translation boundary.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import orjson

if TYPE_CHECKING:
    from ..errors import HTTPStatusError

__all__ = [
    "Answer",
    "api_root",
    "bounded_get",
    "discover_models",
    "get_models",
    "get_models_response",
    "headers",
    "measure_idle_timeout",
    "models_in",
    "probe_http2",
    "ssl_context",
    "status_error",
]


def ssl_context(verify: bool | str) -> ssl.SSLContext:
    """An SSL context: ``False`` verifies nothing, a path trusts that CA bundle,
    ``True`` trusts certifi's roots (what httpx and openai load) or the system's."""
    if verify is False:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    if isinstance(verify, str):
        return ssl.create_default_context(cafile=verify)
    try:
        import certifi
    except ImportError:  # pragma: no cover - httpx depends on certifi
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=certifi.where())


def headers(api_key: str | None, *, json_body: bool = True) -> dict[str, str]:
    """Request headers of a probe (``Authorization`` only when a key is given)."""
    out = {"User-Agent": "qwen-embed-check"}
    if json_body:
        out["Content-Type"] = "application/json"
    if api_key:
        out["Authorization"] = f"Bearer {api_key}"
    return out


def api_root(base_url: str) -> str:
    """``base_url`` without a trailing ``/v1`` (the server root, where ``/health`` is)."""
    parts = urlsplit(base_url)
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def status_error(
    status: int, body: bytes, *, url: str, headers: Any = None, secret: str | None = None
) -> HTTPStatusError:
    """The library's exception for an HTTP error answer (message parsed from any of the
    servers' error body shapes, the API key scrubbed), to report, not to raise."""
    # errors.error_from_response is the library's one translation of error bodies;
    # it is not part of the package's front door, so it is imported here only.
    from ..errors import error_from_response

    return error_from_response(status, body, url=url, headers=headers, secret=secret)


def _models_in(body: bytes) -> list[str] | None:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    cards = data.get("data") if isinstance(data, dict) else None
    if not isinstance(cards, list):
        return None
    return [str(m["id"]) for m in cards if isinstance(m, dict) and "id" in m]


PROBE_BUDGET = 10.0
"""Seconds a probe's answer may take in all (a trickling body cannot hold it longer)."""
PROBE_MAX_BYTES = 1 << 20
"""The largest probe answer read, in bytes (an endless or huge body is cut)."""


class Answer:
    """A probe's answer, read within ``PROBE_BUDGET`` seconds and ``PROBE_MAX_BYTES``."""

    def __init__(self, status_code: int, headers: Any, content: bytes, http_version: str):
        self.status_code = status_code
        self.headers = headers
        self.content = content
        self.http_version = http_version


def bounded_get(
    http: Any,
    url: str,
    request_headers: dict[str, str],
    *,
    budget: float = PROBE_BUDGET,
    cap: int = PROBE_MAX_BYTES,
) -> Answer:
    """``GET url`` on ``http`` (an HTTP library client), reading the body as a stream
    within ``cap`` bytes (as received: a compressed body is not inflated) and ``budget``
    seconds in all.

    Raises:
        the HTTP library's ``HTTPError``: no answer, or the answer broke a bound.
    """
    from .._transport._http import TimeLeft, httpx

    deadline = time.monotonic() + budget
    request_headers = {**request_headers, "Accept-Encoding": "identity"}
    request = http.build_request("GET", url, headers=request_headers)
    # each connect, read (of the head too), write and pool wait within the time left
    request.extensions["timeout"] = TimeLeft(httpx.Timeout(budget).as_dict(), deadline)
    with contextlib.closing(http.send(request, stream=True)) as resp:
        chunks: list[bytes] = []
        size = 0
        for chunk in resp.iter_raw():
            size += len(chunk)
            if size > cap:
                raise httpx.RemoteProtocolError(f"the answer of {url} is larger than {cap} bytes")
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout(f"the answer of {url} took longer than {budget} s")
            chunks.append(chunk)
        return Answer(resp.status_code, resp.headers, b"".join(chunks), resp.http_version)


def get_models(http: Any, base_url: str, api_key: str | None) -> tuple[int, list[str] | None]:
    """``GET {base_url}/models`` on ``http`` (an HTTP library client): the status and
    the model ids (``None`` when the body is not an OpenAI model list).

    Raises:
        the HTTP library's ``HTTPError``: no answer.
    """
    resp = get_models_response(http, base_url, api_key)
    return int(resp.status_code), _models_in(resp.content) if resp.status_code < 400 else None


def get_models_response(http: Any, base_url: str, api_key: str | None) -> Any:
    """The raw answer to ``GET {base_url}/models`` on ``http`` (status, headers, body).

    Raises:
        the HTTP library's ``HTTPError``: no answer.
    """
    return bounded_get(http, f"{base_url.rstrip('/')}/models", headers(api_key, json_body=False))


def models_in(resp: Any) -> list[str] | None:
    """The model ids of a ``GET /models`` answer (``None``: not an OpenAI model list)."""
    return _models_in(resp.content) if resp.status_code < 400 else None


def discover_models(
    base_url: str, *, verify: bool | str = True, api_key: str | None = None, timeout: float = 10.0
) -> list[str]:
    """Model ids listed by ``GET {base_url}/models``; empty when the server lists none,
    answers an error or cannot be reached (the first real request reports that)."""
    from .._transport._http import httpx

    try:
        with httpx.Client(verify=ssl_context(verify), timeout=timeout) as http:
            status, models = get_models(http, base_url, api_key)
    except httpx.HTTPError:
        return []
    return (models or []) if status < 400 else []


def probe_http2(
    base_url: str, *, verify: bool | str = True, api_key: str | None = None, timeout: float = 10.0
) -> str | None:
    """The HTTP version a client asking for HTTP/2 gets: ``"HTTP/2"`` or ``"HTTP/1.1"``.

    Over ``https://`` h2 is offered by ALPN (the server picks). Over ``http://`` a
    prior-knowledge h2c request is tried; ``None`` means it failed (no h2c).
    """
    from .._transport._http import httpx

    cleartext = base_url.startswith("http://")
    kwargs: dict[str, Any] = {"http2": True, "timeout": timeout}
    if cleartext:
        kwargs["http1"] = False
    else:
        kwargs["verify"] = ssl_context(verify)
    try:
        with httpx.Client(**kwargs) as client:
            resp = bounded_get(
                client, f"{base_url.rstrip('/')}/models", headers(api_key, json_body=False)
            )
            return str(resp.http_version)
    except httpx.HTTPError:
        return None


def _shut(sock: socket.socket | None) -> None:
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def measure_idle_timeout(
    base_url: str,
    *,
    verify: bool | str = True,
    api_key: str | None = None,
    max_idle: float = 6.5,
) -> float | None:
    """Seconds after which the server closes an idle keep-alive connection.

    Opens one HTTP/1.1 connection, makes one request (``GET /models``), then waits up
    to ``max_idle`` seconds for the server to close it, and returns the idle time at
    which it did (``0.0``: the server closed it with the answer; ``None``: still open
    after ``max_idle``, or an answer larger than ``PROBE_MAX_BYTES`` or slower than
    ``PROBE_BUDGET`` seconds, which is not read to its end).

    Raises:
        OSError: the connection could not be made, or the answer broke off or is not
            HTTP.
    """
    import http.client

    parts = urlsplit(base_url)
    host = parts.hostname or "127.0.0.1"
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(
            host, parts.port or 443, context=ssl_context(verify), timeout=10.0
        )
    else:
        conn = http.client.HTTPConnection(host, parts.port or 80, timeout=10.0)
    try:
        budget = time.monotonic() + PROBE_BUDGET
        conn.request(
            "GET", f"{parts.path.rstrip('/')}/models", headers=headers(api_key, json_body=False)
        )
        # as bounded_get: PROBE_BUDGET in all, a trickled head included (http.client
        # bounds each read only: at the budget a watchdog shuts the socket down, which
        # ends a blocked read), and the cap
        watchdog = threading.Timer(PROBE_BUDGET, _shut, (conn.sock,))
        watchdog.start()
        try:
            resp = conn.getresponse()
            size = 0
            while chunk := resp.read1(65536):
                size += len(chunk)
                if size > PROBE_MAX_BYTES or time.monotonic() > budget:
                    return None
        except http.client.HTTPException as exc:  # the answer broke off or is malformed
            raise OSError(f"the answer to GET /models is not HTTP ({type(exc).__name__})") from None
        finally:
            watchdog.cancel()
        if time.monotonic() > budget:
            return None
        if resp.will_close:
            return 0.0
        sock = conn.sock
        if sock is None:  # pragma: no cover - http.client keeps it open when not will_close
            return 0.0
        idle_from = time.monotonic()
        deadline = idle_from + max_idle
        sock.setblocking(False)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            readable, _, _ = select.select([sock], [], [], left)
            if not readable:
                continue
            try:
                sock.recv(1)
            except ssl.SSLWantReadError:  # a TLS record with no data (session ticket)
                continue
            except (ssl.SSLError, OSError):
                pass
            # EOF, or unsolicited bytes on an idle HTTP/1.1 connection: closing
            return time.monotonic() - idle_from
    finally:
        conn.close()
