"""The HTTP probes of ``check_server`` (and of the tooling's ``run_bench``).

Every probe but one is an exchange on the library's own transport (``_transport``:
``Request -> Reply`` on a ``SyncTransport`` of the probe's own, never the shared pool),
so the CLI has the guarantees of every other path, implemented once there: the body
cap while streaming and after decoding (a gzip bomb is cut), the total time budget of
each exchange (connect, write, pool wait and every read within the time left, a
trickled head or chunk framing included: the transport's watchdog), no reuse of a
socket with bytes left, 1xx answers never taken for the final one, malformed status
codes refused, errors translated once and the API key scrubbed from them. ``Probes``
holds the check's one deadline: each exchange gets the time left of it.

The one exception is ``measure_idle_timeout``: it must watch its own idle socket for
the server's close, which no transport shows, so it speaks the stdlib's ``http.client``
(the library's HTTP/1.1 backend) directly, within the same deadline (connect timeout,
a watchdog at the deadline) and cap, refusing a status that is not a final answer.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import orjson

from .._config import EmbeddingConfig, Limits, Timeouts
from .._metrics import EndpointMetrics
from .._server_text import scrub
from .._transport import Reply, Request, SyncTransport
from .._transport._contract import sdk_cap, ssl_context
from ..errors import ErrorContext, QwenEmbedError, ReadTimeout, TimeoutException
from ._check_report import CheckFinding

if TYPE_CHECKING:
    from ..errors import HTTPStatusError

__all__ = [
    "CHECK_TIMEOUT",
    "PROBE_BUDGET",
    "PROBE_MAX_BYTES",
    "Background",
    "Probes",
    "api_root",
    "discover_models",
    "headers",
    "measure_idle_timeout",
    "models_in",
    "probe_http2",
    "status_error",
]

CHECK_TIMEOUT = 300.0
"""Seconds a whole ``qwen-embed check`` may take by default (``--timeout``)."""
PROBE_MAX_BYTES = 1 << 20
"""The largest answer to a ``GET`` probe, in bytes (as received and decoded)."""
PROBE_BUDGET = 10.0
"""Seconds each ``GET`` probe (``/health``, ``/models``, the HTTP/2 probe, the keep-alive
probe's request) may take, within the check's ``--timeout``: a server that answers the
h2c preface with HTTP/1.1 bytes, or not at all, costs this, not the whole check."""


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


def models_in(reply: Reply, secret: str | None = None) -> list[str] | None:
    """The model ids of a ``GET /models`` answer (``None``: an error status or not an
    OpenAI model list), ``secret`` scrubbed from each (a server may echo the key)."""
    if reply.status >= 400:
        return None
    try:
        data = orjson.loads(reply.body)
    except orjson.JSONDecodeError:
        return None
    cards = data.get("data") if isinstance(data, dict) else None
    if not isinstance(cards, list):
        return None
    return [scrub(str(m["id"]), secret) for m in cards if isinstance(m, dict) and "id" in m]


class Probes:
    """The check's HTTP exchanges with one server, on a transport of their own (the
    library's ``SyncTransport``: HTTP/1.1 on ``http.client``, HTTP/2 on httpx), all
    within one deadline.

    Args:
        base_url: the API root (``.../v1``); every probe URL is on its host and port.
        api_key: bearer token (sent, and scrubbed from every error), or ``None``.
        verify: TLS verification (``True``, ``False`` or a CA bundle path).
        deadline: the ``time.monotonic()`` by which every exchange must have ended.
        budget: the seconds that deadline stands for, as errors name it.
        http2: negotiate HTTP/2 (ALPN; prior-knowledge h2c over ``http://``).

    Raises:
        ConfigError: a malformed ``base_url``, or ``verify`` naming a missing CA file.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        verify: bool | str,
        deadline: float,
        budget: float,
        http2: bool = False,
    ) -> None:
        cfg = EmbeddingConfig(
            base_url=base_url, verify=verify, http2=http2, limits=Limits(max_connections=4)
        )
        key = cfg.pool_key
        self.label = key.label
        self.deadline = deadline
        self.budget = budget
        self._key = api_key
        cleartext = key.base_url.startswith("http://")
        self._transport = SyncTransport(key, EndpointMetrics(key.label), h2c=http2 and cleartext)
        self._ctx = ErrorContext(url=key.label, secret=api_key, total=budget, max_connections=4)
        # each exchange: only the time left bounds its connect, write, pool wait and reads
        self._timeouts = Timeouts(connect=None, read=None, write=None, pool=None, total=None)

    def __enter__(self) -> Probes:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the probes' connections."""
        self._transport.close()

    def left(self) -> float:
        """Seconds left before the deadline (``<= 0``: none)."""
        return self.deadline - time.monotonic()

    def out_of_time(
        self, what: str, cut: Exception | None = None, own: float | None = None
    ) -> TimeoutException:
        """The error of a probe the check's deadline (or ``own``, the probe's own budget
        in seconds, when that was the shorter) cut (``cut``: the transport's timeout,
        whose type it keeps) or left no time for."""
        kind = type(cut) if isinstance(cut, TimeoutException) else ReadTimeout
        bound = (
            f"its own budget of {own:g} s"
            if own is not None
            else f"the check's --timeout of {self.budget:g} s in all"
        )
        return kind(f"{what} to {self.label} did not end within {bound}", url=self.label)

    def send(
        self,
        method: str,
        url: str,
        body: bytes = b"",
        *,
        cap: int | None = None,
        within: float | None = None,
    ) -> Reply:
        """One exchange (``GET`` without a body, ``POST`` with a JSON ``body``), within
        the time left (and ``within`` seconds, when given) and ``cap`` bytes of answer
        (default: ``PROBE_MAX_BYTES`` for a ``GET``; for a ``POST`` the client's cap for
        that many inputs).

        Raises:
            QwenEmbedError: no complete answer (the library's translated, scrubbed
                error; ``ReadTimeout`` naming ``--timeout``, or the probe's own budget,
                when the one that was shorter cut it).
        """
        what = f"{method} {urlsplit(url).path or '/'}"
        left = self.left()
        if left <= 0.001:
            raise self.out_of_time(what)
        own = within if within is not None and within < left else None
        if own is not None:
            left = own
        if cap is None:
            cap = sdk_cap(body) if body else PROBE_MAX_BYTES
        request = Request(
            method,
            url,
            body,
            headers(self._key, json_body=bool(body)),
            self._timeouts,
            left,
            cap,
            self._ctx,
        )
        try:
            return self._transport.send(request)
        except QwenEmbedError as exc:
            # every phase's own timeout is off (``_timeouts``): a timeout is the deadline's
            # (whether the transport's timer or the clock read here ends first)
            if isinstance(exc, TimeoutError):
                raise self.out_of_time(what, exc, own) from exc
            raise

    def get_models(self, base_url: str, *, within: float | None = PROBE_BUDGET) -> Reply:
        """The answer to ``GET {base_url}/models`` (the library's one ``GET /models``
        probe; ``base_url`` on this server), within ``within`` seconds and the time left.

        Raises:
            QwenEmbedError: no complete answer.
        """
        return self.send("GET", f"{base_url.rstrip('/')}/models", within=within)


def discover_models(
    base_url: str, *, verify: bool | str = True, api_key: str | None = None, timeout: float = 10.0
) -> list[str]:
    """Model ids listed by ``GET {base_url}/models`` within ``timeout`` seconds; empty
    when the server lists none, answers an error or cannot be reached (the first real
    request reports that)."""
    try:
        with Probes(
            base_url,
            api_key=api_key,
            verify=verify,
            deadline=time.monotonic() + timeout,
            budget=timeout,
        ) as probes:
            return models_in(probes.get_models(base_url), api_key) or []
    except QwenEmbedError:
        return []


def probe_http2(
    base_url: str,
    *,
    verify: bool | str = True,
    api_key: str | None = None,
    timeout: float = PROBE_BUDGET,
    deadline: float | None = None,
) -> str | None:
    """The HTTP version a client asking for HTTP/2 gets: ``"HTTP/2"`` or ``"HTTP/1.1"``,
    within ``timeout`` seconds (and by ``deadline``, a ``time.monotonic()`` value, when
    that is sooner).

    Over ``https://`` h2 is offered by ALPN (the server picks). Over ``http://`` a
    prior-knowledge h2c request is tried; ``None`` means it failed (no h2c: an HTTP/1.1
    answer to the preface, garbage, a close, or silence until the bound).
    """
    budget = timeout if deadline is None else min(timeout, max(deadline - time.monotonic(), 0.0))
    try:
        with Probes(
            base_url,
            api_key=api_key,
            verify=verify,
            deadline=time.monotonic() + budget,
            budget=budget,
            http2=True,
        ) as probes:
            return probes.get_models(base_url).http_version
    except QwenEmbedError:
        return None


class Background:
    """The probe ``fn(*args)`` (finding ``name``) on a daemon thread, with its own
    sockets; `result` waits for its finding."""

    def __init__(self, name: str, fn: Callable[..., CheckFinding], *args: Any) -> None:
        self._name = name
        self._out: list[CheckFinding] = []

        def run() -> None:
            try:
                self._out.append(fn(*args))
            except Exception as exc:  # a probe never raises: its failure is a finding
                self._out.append(CheckFinding(name, "warn", f"{name} probe failed: {exc}"))

        self._thread = threading.Thread(target=run, name=f"qwen-embed-check-{name}", daemon=True)
        self._thread.start()

    def result(self) -> CheckFinding:
        self._thread.join()
        return self._out[0]


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
    deadline: float | None = None,
    budget: float = PROBE_BUDGET,
) -> float | None:
    """Seconds after which the server closes an idle keep-alive connection.

    Opens one HTTP/1.1 connection, makes one request (``GET /models``), then waits up
    to ``max_idle`` seconds for the server to close it, and returns the idle time at
    which it did (``0.0``: the server closed it with the answer; ``None``: still open
    after ``max_idle``, or an answer larger than ``PROBE_MAX_BYTES``, which is not read
    to its end). The request (connect to the answer's end) takes at most ``budget``
    seconds; the whole probe, the idle wait included, ends by ``deadline`` (a
    ``time.monotonic()`` value; default: ``CHECK_TIMEOUT`` seconds from now): the
    connect timeout is the time the request has, and a watchdog shuts the socket down
    when it is over (a trickled head included).

    Raises:
        OSError: the connection could not be made, the answer broke off, is not HTTP or
            not a final answer (a 1xx, a malformed status), or the deadline passed
            first.
    """
    import http.client

    if deadline is None:
        deadline = time.monotonic() + CHECK_TIMEOUT
    left = deadline - time.monotonic()
    if left <= 0.001:
        raise OSError("no time left for the keep-alive probe (the check's --timeout)")
    own = budget < left  # the request's own budget is the sooner bound
    bound = f"its own budget of {budget:g} s" if own else "the check's --timeout"
    left = min(left, budget)
    parts = urlsplit(base_url)
    host = parts.hostname or "127.0.0.1"
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        context = ssl_context(verify, http2=False, cleartext=False)
        conn = http.client.HTTPSConnection(host, parts.port or 443, context=context, timeout=left)
    else:
        conn = http.client.HTTPConnection(host, parts.port or 80, timeout=left)
    expired = threading.Event()

    def shut() -> None:  # the watchdog: at the deadline, end whatever blocks
        expired.set()
        _shut(conn.sock)

    watchdog = threading.Timer(left, shut)
    watchdog.daemon = True
    watchdog.start()
    try:
        try:
            conn.connect()
            if expired.is_set():  # the watchdog fired while connecting: no socket to shut
                raise OSError("connect ended at the deadline")
            conn.request(
                "GET", f"{parts.path.rstrip('/')}/models", headers=headers(api_key, json_body=False)
            )
            resp = conn.getresponse()
            if not 200 <= resp.status <= 599:
                what = "an interim (1xx)" if 100 <= resp.status <= 199 else "a malformed"
                raise OSError(f"GET /models answered with {what} status ({resp.status})")
            size = 0
            while chunk := resp.read1(65536):
                size += len(chunk)
                if size > PROBE_MAX_BYTES:
                    return None
        except (http.client.HTTPException, OSError) as exc:
            # the socket's own timeout is the time left too: on a loaded machine it can
            # fire before the watchdog's thread runs; either way the deadline has passed
            if expired.is_set() or isinstance(exc, TimeoutError):
                raise OSError(
                    f"GET /models did not end within {bound} (keep-alive probe)"
                ) from None
            if isinstance(exc, http.client.HTTPException):  # broke off or malformed
                raise OSError(
                    f"the answer to GET /models is not HTTP ({type(exc).__name__})"
                ) from None
            raise
        finally:
            watchdog.cancel()
        if resp.will_close:
            return 0.0
        sock = conn.sock
        if sock is None:  # pragma: no cover - http.client keeps it open when not will_close
            return 0.0
        idle_from = time.monotonic()
        until = min(idle_from + max_idle, deadline)
        sock.setblocking(False)
        while True:
            wait = until - time.monotonic()
            if wait <= 0:
                if until < idle_from + max_idle:
                    raise OSError(
                        f"the check's --timeout ran out after {until - idle_from:.1f} s of "
                        "the keep-alive wait"
                    )
                return None
            readable, _, _ = select.select([sock], [], [], wait)
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
        watchdog.cancel()
        conn.close()
