"""The clients the library is measured against, and the library through its public API.

Every client here sends the same request bytes to the same loopback server
(``{"input": [...], "model": ..., "encoding_format": "base64"}``), checks the status,
and decodes the base64 float32 vectors the same way (``orjson`` + ``base64`` +
``numpy.frombuffer``), so the difference between two of them is the HTTP stack, not
the codec. ``decode_list`` returns ``n x dim`` Python floats (what the LangChain /
LlamaIndex list API returns), ``decode_array`` a float32 ``n x dim`` array,
``decode_none`` just the body bytes (the transport floor).

A sync client is ``(call, close)`` with ``call(texts) -> result``; an async one is
``(call, aclose)`` with ``await call(texts)``. Connection limits are the library's
default (20) unless a factory is given another.

"raw httpx" is ``httpx2`` when the installed openai is 3.x and ``httpx`` otherwise,
the same rule as ``qwen_embed_plugins/_transport/_http.py``.
"""

from __future__ import annotations

import base64
import http.client
import re
import ssl
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import openai
import orjson

POOL_LIMIT = 20  # the library's default Limits.max_connections
TIMEOUT = 60.0  # seconds; every client gets one, nothing in the benchmark should need it

_OPENAI_MAJOR = int(m.group(1)) if (m := re.match(r"\D*(\d+)", openai.__version__)) else 2
if _OPENAI_MAJOR >= 3:
    import httpx2 as httpx
else:  # pragma: no cover - the openai 2.x venv
    import httpx  # type: ignore[no-redef]

HTTP_LIBRARY = httpx.__name__
HEADERS = {"Content-Type": "application/json"}

SyncCall = Callable[[list[str]], Any]
AsyncCall = Callable[[list[str]], Awaitable[Any]]


@dataclass(frozen=True)
class Target:
    """Where the server is: ``base_url`` like ``http://127.0.0.1:PORT/v1``."""

    base_url: str
    model: str
    ca_path: str | None = None  # the test CA for https (trustme)

    @property
    def url(self) -> str:
        return f"{self.base_url}/embeddings"

    @property
    def parts(self) -> tuple[str, str, int, str]:
        u = urlsplit(self.url)
        port = u.port or (443 if u.scheme == "https" else 80)
        return u.scheme, u.hostname or "127.0.0.1", port, u.path

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.ca_path is None:
            return None
        return ssl.create_default_context(cafile=self.ca_path)

    def verify(self) -> Any:
        """What to give httpx / the library as ``verify``."""
        return self.ssl_context() if self.ca_path else True


def body(texts: list[str], model: str) -> bytes:
    return orjson.dumps({"input": texts, "model": model, "encoding_format": "base64"})


def decode_array(content: bytes, n: int) -> np.ndarray:
    data = orjson.loads(content)["data"]
    if len(data) != n:
        raise RuntimeError(f"expected {n} vectors, got {len(data)}")
    if n == 1:
        return np.frombuffer(base64.b64decode(data[0]["embedding"]), dtype="<f4").reshape(1, -1)
    raw = b"".join([base64.b64decode(item["embedding"]) for item in data])
    return np.frombuffer(raw, dtype="<f4").reshape(n, -1)


def decode_list(content: bytes, n: int) -> list[list[float]]:
    out: list[list[float]] = decode_array(content, n).tolist()
    return out


def decode_none(content: bytes, n: int) -> bytes:
    return content


Decode = Callable[[bytes, int], Any]


def _check(status: int, content: bytes) -> None:
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {content[:200]!r}")


# ============================================================================ sync


def httpx_sync(t: Target, decode: Decode = decode_list, limit: int = POOL_LIMIT) -> Any:
    """``httpx.Client().post`` as a user writes it (default settings but the limit)."""
    client = httpx.Client(
        verify=t.verify(),
        timeout=TIMEOUT,
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
    )
    url, model = t.url, t.model

    def call(texts: list[str]) -> Any:
        r = client.post(url, content=body(texts, model), headers=HEADERS)
        _check(r.status_code, r.content)
        return decode(r.content, len(texts))

    return call, client.close


def httpx_transport_sync(t: Target, decode: Decode = decode_list, limit: int = POOL_LIMIT) -> Any:
    """``httpx.HTTPTransport.handle_request`` directly: no Client (no redirects, auth,
    cookies, event hooks, URL merging)."""
    transport = httpx.HTTPTransport(
        verify=t.verify(),
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
    )
    url = httpx.URL(t.url)
    model = t.model
    ext = {"timeout": {"connect": TIMEOUT, "read": TIMEOUT, "write": TIMEOUT, "pool": TIMEOUT}}
    _, host, port, _ = t.parts

    def call(texts: list[str]) -> Any:
        content = body(texts, model)
        req = httpx.Request(
            "POST",
            url,
            content=content,
            headers={
                "Host": f"{host}:{port}",
                "Content-Type": "application/json",
                "Content-Length": str(len(content)),
            },
            extensions=ext,
        )
        resp = transport.handle_request(req)
        try:
            data = resp.read()
        finally:
            resp.close()
        _check(resp.status_code, data)
        return decode(data, len(texts))

    return call, transport.close


def urllib3_pool(t: Target, decode: Decode = decode_list, limit: int = POOL_LIMIT) -> Any:
    """``urllib3.HTTP(S)ConnectionPool.urlopen`` (one host, blocking at ``limit``)."""
    import urllib3

    scheme, host, port, path = t.parts
    timeout = urllib3.Timeout(connect=TIMEOUT, read=TIMEOUT)
    pool: Any
    if scheme == "https":
        pool = urllib3.HTTPSConnectionPool(
            host, port, maxsize=limit, block=True, ssl_context=t.ssl_context(), timeout=timeout
        )
    else:
        pool = urllib3.HTTPConnectionPool(host, port, maxsize=limit, block=True, timeout=timeout)
    model = t.model

    def call(texts: list[str]) -> Any:
        r = pool.urlopen("POST", path, body=body(texts, model), headers=HEADERS, retries=1)
        data = r.data
        _check(r.status, data)
        return decode(data, len(texts))

    return call, pool.close


def urllib3_manager(t: Target, decode: Decode = decode_list, limit: int = POOL_LIMIT) -> Any:
    """``urllib3.PoolManager.request`` (what ``requests`` sits on)."""
    import urllib3

    kwargs: dict[str, Any] = {"maxsize": limit, "block": True}
    if t.ca_path:
        kwargs["ssl_context"] = t.ssl_context()
    manager = urllib3.PoolManager(timeout=urllib3.Timeout(connect=TIMEOUT, read=TIMEOUT), **kwargs)
    url, model = t.url, t.model

    def call(texts: list[str]) -> Any:
        r = manager.request("POST", url, body=body(texts, model), headers=HEADERS, retries=1)
        data = r.data
        _check(r.status, data)
        return decode(data, len(texts))

    return call, manager.clear


def stdlib_sync(t: Target, decode: Decode = decode_list, limit: int = POOL_LIMIT) -> Any:
    """``http.client`` keep-alive, one connection per thread (the floor)."""
    scheme, host, port, path = t.parts
    ctx = t.ssl_context()
    local = threading.local()
    model = t.model
    conns: list[http.client.HTTPConnection] = []
    reconnect = (
        http.client.RemoteDisconnected,
        http.client.CannotSendRequest,
        ConnectionResetError,
        BrokenPipeError,
    )

    def connection() -> http.client.HTTPConnection:
        c: http.client.HTTPConnection | None = getattr(local, "c", None)
        if c is None:
            if scheme == "https":
                c = http.client.HTTPSConnection(host, port, timeout=TIMEOUT, context=ctx)
            else:
                c = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
            local.c = c
            conns.append(c)
        return c

    def call(texts: list[str]) -> Any:
        content = body(texts, model)
        for attempt in (0, 1):
            c = connection()
            try:
                c.request("POST", path, content, HEADERS)
                r = c.getresponse()
                data = r.read()
            except reconnect:
                c.close()
                local.c = None
                if attempt:
                    raise
                continue
            if r.will_close:
                c.close()
                local.c = None
            _check(r.status, data)
            return decode(data, len(texts))
        raise AssertionError("unreachable")

    def close() -> None:
        for c in conns:
            c.close()

    return call, close


def sdk_sync(t: Target, decode: Decode | None = None, limit: int = POOL_LIMIT) -> Any:
    """One shared ``openai.OpenAI`` (the SDK's defaults: it asks for base64 and decodes it
    with numpy into lists)."""
    kwargs: dict[str, Any] = {}
    if t.ca_path:
        kwargs["http_client"] = openai.DefaultHttpxClient(verify=t.ssl_context())
    sdk = openai.OpenAI(base_url=t.base_url, api_key="EMPTY", max_retries=0, **kwargs)
    model = t.model

    def call(texts: list[str]) -> Any:
        resp = sdk.embeddings.create(input=texts, model=model)
        return [d.embedding for d in resp.data]

    return call, sdk.close


SYNC_PEERS: dict[str, Callable[..., Any]] = {
    "httpx": httpx_sync,
    "httpx_transport": httpx_transport_sync,
    "urllib3_pool": urllib3_pool,
    "urllib3_manager": urllib3_manager,
    "stdlib": stdlib_sync,
    "sdk": sdk_sync,
}


# ============================================================================ async


def httpx_async(
    t: Target, decode: Decode = decode_list, limit: int = POOL_LIMIT, *, tuned: bool = False
) -> Any:
    """``httpx.AsyncClient().post``; ``tuned``: ``trust_env=False``, a pre-built
    ``httpx.URL`` and pre-built headers, no event hooks (the defaults have none)."""
    client = httpx.AsyncClient(
        verify=t.verify(),
        timeout=TIMEOUT,
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
        trust_env=not tuned,
    )
    url: Any = httpx.URL(t.url) if tuned else t.url
    headers: Any = httpx.Headers(HEADERS) if tuned else HEADERS
    model = t.model

    async def call(texts: list[str]) -> Any:
        r = await client.post(url, content=body(texts, model), headers=headers)
        _check(r.status_code, r.content)
        return decode(r.content, len(texts))

    return call, client.aclose


def httpx_async_transport(t: Target, decode: Decode = decode_list, limit: int = POOL_LIMIT) -> Any:
    """``httpx.AsyncHTTPTransport.handle_async_request`` directly (no AsyncClient)."""
    transport = httpx.AsyncHTTPTransport(
        verify=t.verify(),
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
    )
    url = httpx.URL(t.url)
    model = t.model
    ext = {"timeout": {"connect": TIMEOUT, "read": TIMEOUT, "write": TIMEOUT, "pool": TIMEOUT}}
    _, host, port, _ = t.parts

    async def call(texts: list[str]) -> Any:
        content = body(texts, model)
        req = httpx.Request(
            "POST",
            url,
            content=content,
            headers={
                "Host": f"{host}:{port}",
                "Content-Type": "application/json",
                "Content-Length": str(len(content)),
            },
            extensions=ext,
        )
        resp = await transport.handle_async_request(req)
        try:
            data = await resp.aread()
        finally:
            await resp.aclose()
        _check(resp.status_code, data)
        return decode(data, len(texts))

    return call, transport.aclose


def httpx_aiohttp(t: Target, decode: Decode = decode_list, limit: int = POOL_LIMIT) -> Any:
    """``httpx.AsyncClient(transport=httpx_aiohttp AiohttpTransport)``: the transport the
    openai SDK offers as ``DefaultAioHttpClient`` (openai 3.x vendors the same code for
    httpx2). With httpx2 this is ``httpx_aiohttp.httpx2.AiohttpTransport`` (httpx-aiohttp
    >= 0.2 ships it); with httpx 0.28, ``httpx_aiohttp.AiohttpTransport``."""
    if HTTP_LIBRARY == "httpx2":
        from httpx_aiohttp.httpx2 import AiohttpTransport
    else:  # pragma: no cover - the openai 2.x venv
        from httpx_aiohttp import AiohttpTransport
    transport = AiohttpTransport(
        verify=t.ssl_context() or True,
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
    )
    client = httpx.AsyncClient(transport=transport, timeout=TIMEOUT)
    url = httpx.URL(t.url)
    model = t.model

    async def call(texts: list[str]) -> Any:
        r = await client.post(url, content=body(texts, model), headers=HEADERS)
        _check(r.status_code, r.content)
        return decode(r.content, len(texts))

    return call, client.aclose


class SocketCounter:
    """Counts sockets aiohttp creates through ``TCPConnector(socket_factory=...)`` (a
    public hook, aiohttp >= 3.12): no per-request cost, unlike a ``TraceConfig``."""

    def __init__(self) -> None:
        self.opened = 0

    def __call__(self, addr_info: Any) -> Any:
        import socket

        family, type_, proto, _canon, _addr = addr_info
        self.opened += 1
        return socket.socket(family=family, type=type_, proto=proto)


class ConnectionCounter:
    """aiohttp ``TraceConfig`` counting TCP connections opened (what the library counts)."""

    def __init__(self) -> None:
        import aiohttp

        self.opened = 0
        self.config = aiohttp.TraceConfig()
        self.config.on_connection_create_end.append(self._created)

    async def _created(self, session: Any, ctx: Any, params: Any) -> None:
        self.opened += 1


BODY_CAP = 256 * 1024 * 1024  # bytes; the guarded aiohttp variant refuses larger answers


def aiohttp_raw(
    t: Target,
    decode: Decode = decode_list,
    limit: int = POOL_LIMIT,
    *,
    trace: bool = False,
    guarded: bool = False,
    sockcount: bool = False,
) -> Any:
    """One ``aiohttp.ClientSession`` (must be called inside the running loop).

    ``trace``: a ``TraceConfig`` counting connections opened; ``sockcount``: a
    ``socket_factory`` counting them instead. ``guarded``: the features
    the library needs on top: a per-request ``ClientTimeout(total=..., sock_read=...)``
    and a streamed body read into a ``bytearray`` with a size cap (Content-Length checked
    first, then every chunk).
    """
    import aiohttp

    counter: Any = ConnectionCounter() if trace else None
    extra: dict[str, Any] = {}
    if sockcount:
        counter = SocketCounter()
        extra["socket_factory"] = counter
    connector = aiohttp.TCPConnector(limit=limit, ssl=t.ssl_context() or True, **extra)
    session = aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=TIMEOUT),
        trace_configs=[counter.config] if trace else None,
    )
    url = t.url
    model = t.model
    per_request = aiohttp.ClientTimeout(total=TIMEOUT, connect=TIMEOUT, sock_read=TIMEOUT)

    if not guarded:

        async def call(texts: list[str]) -> Any:
            async with session.post(url, data=body(texts, model), headers=HEADERS) as r:
                data = await r.read()
                _check(r.status, data)
            return decode(data, len(texts))

    else:

        async def call(texts: list[str]) -> Any:
            async with session.post(
                url, data=body(texts, model), headers=HEADERS, timeout=per_request
            ) as r:
                length = r.content_length
                if length is not None and length > BODY_CAP:
                    raise RuntimeError("body too large")
                buf = bytearray()
                async for chunk in r.content.iter_chunked(65536):
                    buf += chunk
                    if len(buf) > BODY_CAP:
                        raise RuntimeError("body too large")
                data = bytes(buf)
                _check(r.status, data)
            return decode(data, len(texts))

    call.counter = counter  # type: ignore[attr-defined]
    return call, session.close


def sdk_async(t: Target, decode: Decode | None = None, limit: int = POOL_LIMIT) -> Any:
    """One shared ``openai.AsyncOpenAI`` (must be called inside the running loop)."""
    kwargs: dict[str, Any] = {}
    if t.ca_path:
        kwargs["http_client"] = openai.DefaultAsyncHttpxClient(verify=t.ssl_context())
    sdk = openai.AsyncOpenAI(base_url=t.base_url, api_key="EMPTY", max_retries=0, **kwargs)
    model = t.model

    async def call(texts: list[str]) -> Any:
        resp = await sdk.embeddings.create(input=texts, model=model)
        return [d.embedding for d in resp.data]

    return call, sdk.close


# ============================================================================ ours


def ours_kwargs(t: Target, **extra: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"base_url": t.base_url, "model": t.model}
    if t.ca_path:
        kwargs["verify"] = t.ca_path
    kwargs.update(extra)
    return kwargs


def ours_sync(t: Target, method: str = "embed_documents", **extra: Any) -> Any:
    """``EmbeddingClient(...).<method>`` through the public API. ``embed_query`` takes the
    raw query (the client adds the Qwen instruction; callers pass the raw text)."""
    from qwen_embed_plugins import EmbeddingClient

    client = EmbeddingClient(**ours_kwargs(t, **extra))
    if method == "embed_query":
        fn = client.embed_query

        def call(texts: list[str]) -> Any:
            return fn(texts[0])

    else:
        call = getattr(client, method)
    return call, lambda: None


def ours_async(t: Target, method: str = "embed_documents", **extra: Any) -> Any:
    """``AsyncEmbeddingClient(...).<method>`` (must be called inside the running loop)."""
    from qwen_embed_plugins import AsyncEmbeddingClient

    client = AsyncEmbeddingClient(**ours_kwargs(t, **extra))
    if method == "embed_query":
        fn = client.embed_query

        async def call(texts: list[str]) -> Any:
            return await fn(texts[0])

    else:
        call = getattr(client, method)

    async def aclose() -> None:
        return None

    return call, aclose


def first_row(result: Any) -> np.ndarray:
    """Row 0 of any client's result (lists of floats, an array, a flat vector)."""
    arr = np.asarray(result, dtype=np.float32)
    return arr if arr.ndim == 1 else arr[0]
