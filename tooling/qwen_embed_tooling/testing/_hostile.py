"""`HostileServer`: an embedding server that breaks HTTP and JSON on purpose.

uvicorn will not misbehave at the framing level, so this one writes its answers on raw
asyncio streams. It answers ``POST .../embeddings`` and ``GET .../models`` (any prefix)
like an OpenAI-compatible server with `expected_embeddings` vectors, except that the
requests chosen by ``on`` get the behaviour ``kind`` (see `HOSTILE_KINDS`). Every loop is
bounded (``max_seconds``, ``max_bytes``), everything stays on 127.0.0.1, and `stop`
ends all connections.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import tempfile
import time
import weakref
from collections.abc import Mapping
from typing import Any, Final

import numpy as np
import orjson

from ._common import (
    _PREFIX,
    DEFAULT_DIM,
    DEFAULT_MODEL,
    LOOPBACK,
    _gzip_bomb,
    _integer,
    _number,
    _transform,
    expected_embeddings,
)
from ._loop import _Counters, _LoopServer, header, parse_head, read_head

#: Every behaviour of `HostileServer`, with its parameters and defaults.
HOSTILE_KINDS: Final[dict[str, dict[str, Any]]] = {
    "ok": {},
    "huge_content_length": {"declared": 2 * 1024**3},
    "endless_chunked": {"chunk": 65536},
    "gzip_bomb": {"inflated": 1280 * 1024**2},
    "trickle": {"interval": 1.0, "headers": False},
    "echo_auth": {"transform": "exact", "where": "body", "status": None},
    "redirect": {"status": 307, "location": None},
    "error_200": {
        "message": "The server had an error while processing your request.",
        "type": "server_error",
        "code": None,
    },
    "nested": {},
    "string_components": {},
    "bool_components": {},
    "html": {},
    "stray_response": {"delay": 0.0},
    "silent": {},
    "drop": {},
    "interim": {"status": 103},
    "status_line": {"line": "HTTP/1.1 099 Odd", "code": "099"},
    "trickle_chunked": {"interval": 1.0, "part": "size"},
    "truncated_encoding": {"encoding": "gzip"},
}
_TRANSFORMS: Final = ("exact", "upper", "lower", "truncate", "bare")
_ECHO_PLACES: Final = (
    "body",
    "header",
    "both",
    "status",
    "content_encoding",
    "status_line",
    "chunk_size",
    "header_line",
)
_ENCODINGS: Final = ("gzip", "deflate")
_HTML: Final = (
    b"<!DOCTYPE html><html><head><title>502 Bad Gateway</title></head>"
    b"<body><h1>502 Bad Gateway</h1><p>The upstream server is not responding.</p></body></html>"
)
_MAX_REQUEST_BODY: Final = 64 * 1024 * 1024
_ERROR: Final = b'{"error":{"message":"internal error","type":"server_error","code":null}}'
_IDLE: Final = 30.0  # seconds a connection may stay idle between requests
_COUNTERS: Final = (
    "connections_opened",
    "connections_active",
    "requests",
    "bytes_sent",
    "stray_sent",
    "trickled",
)


class HostileServer:
    """A loopback server whose answers are hostile in one chosen way.

    Args:
        kind: the behaviour, a key of `HOSTILE_KINDS` (default ``"ok"``: plain valid
            answers). ``params`` are its parameters:

            * ``huge_content_length`` [``declared`` = 2 GiB]: 200 declaring
              ``Content-Length: declared``, then a JSON prefix and spaces written as fast
              as the client reads, until the client closes (or the bounds).
            * ``endless_chunked`` [``chunk`` = 65536 bytes]: 200 ``Transfer-Encoding:
              chunked`` whose chunks never end (a JSON prefix, then spaces).
            * ``gzip_bomb`` [``inflated`` = 1.25 GiB]: 200 ``Content-Encoding: gzip``
              with a ~1 KB-per-MiB body (about 1.3 MB) that inflates to ``inflated`` bytes
              (a JSON prefix, then spaces): one valid gzip member.
            * ``trickle`` [``interval`` = 1.0 s, ``headers`` = False]: a valid answer
              written 1 byte per ``interval`` seconds (the body only; with ``headers``
              the status line and headers too).
            * ``echo_auth`` [``transform`` = ``"exact"`` | ``"upper"`` | ``"lower"`` |
              ``"truncate"`` (all but the last 4 characters) | ``"bare"`` (the value
              after ``Bearer ``); ``where`` = ``"body"`` | ``"header"`` | ``"both"``;
              ``status``]: echo the request's ``Authorization`` value, transformed, in a
              non-JSON ``text/plain`` body and/or an ``x-request-id`` header; status 200
              when the body echoes, else 500 with a JSON error body (``status``
              overrides).
            * ``redirect`` [``status`` = 307 (301, 302, 303, 307, 308), ``location``]:
              answer with ``Location`` (default: this server's ``/redirected`` + the
              path, where a valid answer waits: ``stats()["paths"]`` shows whether a
              client followed).
            * ``error_200`` [``message``, ``type``, ``code``]: 200 with
              ``{"error": {"message", "type", "code"}}``.
            * ``nested``: each ``embedding`` is ``[[...]]`` (a list in a list).
            * ``string_components`` / ``bool_components``: components as strings
              (``"0.0123"``) / booleans.
            * ``html``: 200 ``text/html`` page.
            * ``stray_response`` [``delay`` = 0.0 s]: a valid answer, then (after
              ``delay``; 0: in the same write) a second complete 200 answer nobody asked
              for, holding as many vectors for the texts ``"stray 0"``, ``"stray 1"``...
              (`expected_embeddings` of them), once per connection: the next request on
              that socket would read it.
            * ``silent``: read the request, never answer (until ``max_seconds``).
            * ``drop``: read the request, close the connection without a byte.
            * ``interim`` [``status`` = 103]: an interim answer (``100``-``199``, with a
              ``Link`` header) before the valid final one.
            * ``status_line`` [``line`` = ``"HTTP/1.1 099 Odd"``, ``code`` = ``"099"``]:
              the valid answer's headers and body after this status line instead
              (missing, malformed or out-of-range codes); over HTTP/2 with ``:status``
              = ``code`` (``None``: no ``:status`` at all).
            * ``trickle_chunked`` [``interval`` = 1.0 s, ``part`` = ``"size"`` |
              ``"trailer"``]: the valid answer with a chunked body whose chunk-size line
              (or trailer section) is written 1 byte per ``interval`` seconds.
            * ``truncated_encoding`` [``encoding`` = ``"gzip"`` | ``"deflate"``]: the
              valid answer compressed so, cut at half its compressed length (before
              the stream's end), with a ``Content-Length`` that matches the cut body.
            ``echo_auth``'s ``where`` also takes ``"status"`` (the value as the reason
            phrase of a 500), ``"content_encoding"`` (a 200 whose ``Content-Encoding``
            is the value), ``"status_line"`` (the value in place of the status code:
            ``HTTP/1.1 <value>``), ``"chunk_size"`` (a chunked 500 whose chunk-size line
            is the value) and ``"header_line"`` (a line of the head that is the value
            alone, no colon).

        http2: speak HTTP/2 only, over TLS (ALPN ``h2``) with a throw-away CA
            (`ca_cert_path`; needs ``trustme``): every kind in its HTTP/2 form (see
            ``_hostile_h2``).
        on: which requests behave so: ``"all"`` (default), ``"embeddings"``,
            ``"models"`` or ``"health"`` (``GET /health``, ``qwen-embed check``'s first
            probe); the others get valid answers.
        port: TCP port; 0 (default) picks a free one.
        host: the loopback address to listen on (``127.x.y.z``; default 127.0.0.1): two
            servers on one port and two addresses stand for an endpoint whose name
            moves from one address to another.
        dim: vector size of valid answers.
        model: model name of valid answers.
        max_seconds: longest time one answer may take (streams stop there), seconds.
        max_bytes: most bytes one answer may write.
        startup_timeout: seconds to wait for the server to start or stop.

    Counters (`stats`): ``connections_opened``, ``connections_active``, ``requests``,
    ``bytes_sent``, ``stray_sent``, ``trickled`` (bytes written one at a time), ``paths``
    (request path -> count) and ``kinds`` (behaviour applied -> count).

    Raises:
        ValueError: an unknown kind or parameter, or one out of range.
    """

    def __init__(
        self,
        kind: str = "ok",
        *,
        on: str = "all",
        http2: bool = False,
        port: int = 0,
        host: str = LOOPBACK,
        dim: int = DEFAULT_DIM,
        model: str = DEFAULT_MODEL,
        max_seconds: float = 60.0,
        max_bytes: int = 8 * 1024**3,
        startup_timeout: float = 10.0,
        **params: Any,
    ) -> None:
        _integer("port", port, minimum=0)
        if not isinstance(host, str) or not host.startswith("127."):
            raise ValueError(f"host must be a loopback address 127.x.y.z, got {host!r}")
        self.dim = _integer("dim", dim, minimum=1)
        self.model = model
        self.max_seconds = _number("max_seconds", max_seconds, minimum=0.001)
        self.max_bytes = _integer("max_bytes", max_bytes, minimum=1)
        self._timeout = _number("startup_timeout", startup_timeout, minimum=0.001)
        self.kind = "ok"
        self.on = "all"
        self.params: dict[str, Any] = {}
        self.set(kind, on=on, **params)
        self._counters = _Counters(_COUNTERS, ("paths", "kinds"))
        self.http2 = bool(http2)
        self._tls_dir: tempfile.TemporaryDirectory[str] | None = None
        self._tls: Any = None
        context: ssl.SSLContext | None = None
        if self.http2:
            from ._common import _TLSFiles

            self._tls_dir = tempfile.TemporaryDirectory(prefix="qwen-embed-hostile-")
            self._tls = _TLSFiles.create(self._tls_dir.name)
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(self._tls.chain, self._tls.key)
            context.set_alpn_protocols(["h2"])
            self._finalizer = weakref.finalize(self, self._tls_dir.cleanup)
        self._server = _LoopServer(
            "HostileServer", self._handle, self._counters, port, ssl_context=context, host=host
        )

    def set(self, kind: str, *, on: str = "all", **params: Any) -> None:
        """Switch to behaviour ``kind`` (for requests that arrive from now on).

        Raises:
            ValueError: an unknown kind, target or parameter.
        """
        if kind not in HOSTILE_KINDS:
            raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(HOSTILE_KINDS)}")
        if on not in ("all", "embeddings", "models", "health"):
            raise ValueError(f"on must be 'all', 'embeddings', 'models' or 'health', got {on!r}")
        defaults = HOSTILE_KINDS[kind]
        for name in params:
            if name not in defaults:
                allowed = ", ".join(defaults) or "none"
                raise ValueError(f"{kind} takes no parameter {name!r}; allowed: {allowed}")
        merged = {**defaults, **params}
        if kind == "echo_auth":
            if merged["transform"] not in _TRANSFORMS:
                raise ValueError(f"transform must be one of {', '.join(_TRANSFORMS)}")
            if merged["where"] not in _ECHO_PLACES:
                raise ValueError(f"where must be one of {', '.join(_ECHO_PLACES)}")
        if kind == "interim" and not 100 <= merged["status"] <= 199:
            raise ValueError("interim status must be 100-199")
        if kind == "truncated_encoding" and merged["encoding"] not in _ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(_ENCODINGS)}")
        if kind == "trickle_chunked" and merged["part"] not in ("size", "trailer"):
            raise ValueError("part must be 'size' or 'trailer'")
        if kind == "redirect" and merged["status"] not in (301, 302, 303, 307, 308):
            raise ValueError("redirect status must be 301, 302, 303, 307 or 308")
        for name in ("declared", "chunk", "inflated"):
            if name in merged:
                _integer(name, merged[name], minimum=1)
        for name in ("interval", "delay"):
            if name in merged:
                _number(name, merged[name])
        self.kind, self.on, self.params = kind, on, merged

    # ---- lifecycle and counters ------------------------------------------------------------
    def start(self) -> HostileServer:
        """Start serving (no-op when running) and return ``self``."""
        self._server.start(self._timeout)
        return self

    def stop(self) -> None:
        """Stop: close the listener and every connection (streams end at once)."""
        self._server.stop(self._timeout)

    close = stop

    def __enter__(self) -> HostileServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The TCP port on 127.0.0.1 (known after `start`)."""
        return self._server.port

    @property
    def url(self) -> str:
        """``http://<host>:<port>`` (``https://`` with ``http2``)."""
        return f"{'https' if self.http2 else 'http'}://{self._server.host}:{self.port}"

    @property
    def ca_cert_path(self) -> str | None:
        """The PEM file of the CA that signed the certificate (``http2``), else None."""
        return None if self._tls is None else str(self._tls.ca)

    @property
    def base_url(self) -> str:
        """``url + "/v1"``."""
        return f"{self.url}/v1"

    def stats(self) -> dict[str, Any]:
        """A snapshot of the counters (see the class doc) since `reset_counters`."""
        return self._counters.snapshot()

    def reset_counters(self) -> None:
        """Zero the counters."""
        self._counters.reset()

    def wait_for(
        self, counter: str, n: int, *, timeout: float = 10.0, at_most: bool = False
    ) -> int:
        """Block until ``counter`` (``requests``, ``connections_opened``,
        ``connections_active``, ``bytes_sent``, ``stray_sent``) is >= ``n`` (``at_most``:
        <= ``n``); returns its value.

        Raises:
            TimeoutError: not reached within ``timeout`` seconds.
        """
        return self._counters.wait_for(counter, n, timeout, at_most=at_most)

    def __repr__(self) -> str:
        return f"HostileServer({self.url if self.port else '<unbound>'}, kind={self.kind!r})"

    # ---- serving -----------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.http2:
            from ._hostile_h2 import serve_h2

            await serve_h2(self, reader, writer)
            return
        strayed = False
        while not self._server.stopping():
            head = await read_head(reader, _IDLE)
            if head is None:
                return
            line, headers = parse_head(head)
            if line == "PRI * HTTP/2.0":  # an h2c preface: HTTP/1.1 only, so close
                return
            method, _, rest = line.partition(" ")
            target = rest.rpartition(" ")[0] or rest
            body = await _read_body(reader, headers)
            self._counters.add("requests")
            path = target.split("?", 1)[0]
            self._counters.add("paths", key=path)
            kind, params = self.kind, self.params
            redirected = path.startswith("/redirected/")
            if redirected or not self._targets(path):
                kind, params = "ok", {}
            self._counters.add("kinds", key=kind)
            keep = await self._answer(kind, params, method, path, headers, body, writer)
            if kind == "stray_response" and not strayed and keep:
                strayed = True
                await self._stray(body, writer, params["delay"])
            if not keep:
                return

    def _targets(self, path: str) -> bool:
        if self.on == "embeddings":
            return path.endswith("/embeddings")
        if self.on == "models":
            return path.endswith("/models")
        if self.on == "health":
            return path.endswith("/health")
        return True

    async def _write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        self._counters.add("bytes_sent", len(data))
        await writer.drain()

    def _valid(self, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        """A valid answer for ``path``: (status, JSON document)."""
        if path.endswith("/models"):
            card = {"id": self.model, "object": "model", "created": 0, "owned_by": "hostile"}
            return 200, {"object": "list", "data": [card]}
        if not path.endswith("/embeddings"):
            return 404, {"error": {"message": "Not Found", "type": "not_found", "code": 404}}
        texts, b64 = _inputs(body)
        if texts is None:
            return 400, {"error": {"message": "bad input", "type": "invalid_request_error"}}
        vectors = expected_embeddings(texts, self.dim)
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": base64.b64encode(v.tobytes()).decode() if b64 else v.tolist(),
            }
            for i, v in enumerate(vectors)
        ]
        tokens = sum((len(t) + 3) // 4 for t in texts)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return 200, {"object": "list", "data": data, "model": self.model, "usage": usage}

    async def _answer(
        self,
        kind: str,
        params: Mapping[str, Any],
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Write one answer; False when the connection must end after it."""
        status, doc = self._valid(path.removeprefix("/redirected"), body)
        if kind in ("nested", "string_components", "bool_components") and "data" in doc:
            for item in doc["data"]:
                vector = item["embedding"]
                if isinstance(vector, str):  # base64 asked: decode to spoil the list form
                    vector = _floats(vector)
                item["embedding"] = (
                    [vector]
                    if kind == "nested"
                    else [str(x) for x in vector]
                    if kind == "string_components"
                    else [x > 0 for x in vector]
                )
        if kind in ("ok", "nested", "string_components", "bool_components", "stray_response"):
            await self._write(writer, _response(status, orjson.dumps(doc)))
            return True
        if kind == "error_200":
            error = {"message": params["message"], "type": params["type"], "code": params["code"]}
            await self._write(writer, _response(200, orjson.dumps({"error": error})))
            return True
        if kind == "html":
            await self._write(writer, _response(200, _HTML, "text/html; charset=utf-8"))
            return True
        if kind == "redirect":
            location = params["location"] or f"{self.url}/redirected{path}"
            extra = (("Location", location),)
            await self._write(writer, _response(params["status"], b"{}", extra=extra))
            return True
        if kind == "echo_auth":
            return await self._echo(params, headers, writer)
        if kind == "gzip_bomb":
            blob = _gzip_bomb(params["inflated"])
            extra = (("Content-Encoding", "gzip"),)
            await self._write(writer, _response(200, blob, extra=extra))
            return True
        if kind == "trickle":
            return await self._trickle(_response(status, orjson.dumps(doc)), params, writer)
        if kind == "silent":
            deadline = time.monotonic() + self.max_seconds
            while time.monotonic() < deadline and not self._server.stopping():  # noqa: ASYNC110
                await asyncio.sleep(0.05)  # as the other answers' loops: bounded, stoppable
            return False
        if kind == "drop":
            return False
        if kind == "interim":
            hint = f"HTTP/1.1 {params['status']} Early\r\nLink: </style.css>\r\n\r\n"
            await self._write(writer, hint.encode() + _response(status, orjson.dumps(doc)))
            return True
        if kind == "status_line":
            data = _response(status, orjson.dumps(doc))
            rest = data[data.index(b"\r\n") :]
            await self._write(writer, params["line"].encode("latin-1") + rest)
            return False
        if kind == "trickle_chunked":
            return await self._trickle_chunked(status, orjson.dumps(doc), params, writer)
        if kind == "truncated_encoding":
            cut = truncated(orjson.dumps(doc), params["encoding"])
            extra = (("Content-Encoding", params["encoding"]),)
            await self._write(writer, _response(status, cut, extra=extra))
            return True
        await self._stream(kind, params, writer)
        return False

    async def _trickle_chunked(
        self, status: int, body: bytes, params: Mapping[str, Any], writer: asyncio.StreamWriter
    ) -> bool:
        head = _head(status, "application/json", (("Transfer-Encoding", "chunked"),))
        size_line = f"{len(body):x}\r\n".encode()
        trailer = b"X-Trailer: " + b"t" * 64 + b"\r\n\r\n"
        if params["part"] == "size":
            await self._write(writer, head)
            slow, rest = size_line, body + b"\r\n0\r\n\r\n"
        else:
            await self._write(writer, head + size_line + body + b"\r\n0\r\n")
            slow, rest = trailer, b""
        deadline = time.monotonic() + self.max_seconds
        for i in range(len(slow)):
            if time.monotonic() >= deadline or self._server.stopping():
                return False
            await self._write(writer, slow[i : i + 1])
            self._counters.add("trickled")
            await asyncio.sleep(params["interval"])
        if rest:
            await self._write(writer, rest)
        return True

    async def _echo(
        self,
        params: Mapping[str, Any],
        headers: list[tuple[str, str]],
        writer: asyncio.StreamWriter,
    ) -> bool:
        value = _transform(header(headers, "authorization") or "", params["transform"])
        where = params["where"]
        if where == "status":
            error = {"error": {"message": "internal error", "type": "server_error", "code": None}}
            data = _response(500, orjson.dumps(error))
            line = f"HTTP/1.1 500 {value}".encode("latin-1", "replace")
            await self._write(writer, line + data[data.index(b"\r\n") :])
            return True
        if where == "content_encoding":
            encoding = (("Content-Encoding", value),)
            await self._write(writer, _response(200, b'{"object":"list"}', extra=encoding))
            return True
        if where in ("status_line", "chunk_size", "header_line"):
            line = value.encode("latin-1", "replace") + b"\r\n"
            data = _response(500, _ERROR)
            split = data.index(b"\r\n") + 2
            if where == "status_line":  # ``HTTP/1.1 <value>``: no status code
                data = b"HTTP/1.1 " + line + data[split:]
            elif where == "header_line":  # a line of the head without a colon
                data = data[:split] + line + data[split:]
            else:  # a chunked body whose chunk-size line is the value
                data = _head(500, "application/json", (("Transfer-Encoding", "chunked"),))
                data += line + _ERROR + b"\r\n0\r\n\r\n"
            await self._write(writer, data)
            return False
        in_body = where in ("body", "both")
        status = params["status"] or (200 if in_body else 500)
        extra = (("x-request-id", value),) if where in ("header", "both") else ()
        if in_body:
            text = f"upstream error: unexpected credentials {value}\n".encode("latin-1", "replace")
            await self._write(writer, _response(status, text, "text/plain", extra=extra))
        else:
            error = {"error": {"message": "internal error", "type": "server_error", "code": None}}
            await self._write(writer, _response(status, orjson.dumps(error), extra=extra))
        return True

    async def _trickle(
        self, data: bytes, params: Mapping[str, Any], writer: asyncio.StreamWriter
    ) -> bool:
        split = data.index(b"\r\n\r\n") + 4
        if not params["headers"]:
            await self._write(writer, data[:split])
            data = data[split:]
        deadline = time.monotonic() + self.max_seconds
        for i in range(len(data)):
            if time.monotonic() >= deadline or self._server.stopping():
                return False
            await self._write(writer, data[i : i + 1])
            self._counters.add("trickled")
            await asyncio.sleep(params["interval"])
        return True

    async def _stream(
        self, kind: str, params: Mapping[str, Any], writer: asyncio.StreamWriter
    ) -> None:
        """huge_content_length / endless_chunked: write until the client goes away or a
        bound (``max_seconds``, ``max_bytes``, ``declared``) is reached."""
        if kind == "huge_content_length":
            limit = min(params["declared"], self.max_bytes)
            head = _head(200, "application/json", (("Content-Length", str(params["declared"])),))
        else:
            limit = self.max_bytes
            head = _head(200, "application/json", (("Transfer-Encoding", "chunked"),))
        await self._write(writer, head)
        size = params.get("chunk", 65536)
        filler = b" " * size
        deadline = time.monotonic() + self.max_seconds
        sent = 0
        first = True
        while sent < limit and time.monotonic() < deadline and not self._server.stopping():
            piece = _PREFIX if first else filler[: limit - sent]
            first = False
            sent += len(piece)
            if kind == "endless_chunked":
                piece = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
            await self._write(writer, piece)

    async def _stray(self, body: bytes, writer: asyncio.StreamWriter, delay: float) -> None:
        texts, _ = _inputs(body)
        count = len(texts) if texts else 1
        vectors = expected_embeddings([f"stray {i}" for i in range(count)], self.dim)
        data = [
            {"object": "embedding", "index": i, "embedding": v.tolist()}
            for i, v in enumerate(vectors)
        ]
        doc = {"object": "list", "data": data, "model": self.model}
        if delay > 0.0:
            await asyncio.sleep(delay)
        await self._write(writer, _response(200, orjson.dumps(doc)))
        self._counters.add("stray_sent")


def truncated(body: bytes, encoding: str) -> bytes:
    """``body`` compressed with ``encoding`` (``"gzip"``, ``"deflate"``: zlib-wrapped),
    cut at half its compressed length: before the stream's end marker."""
    import gzip
    import zlib

    whole = gzip.compress(body) if encoding == "gzip" else zlib.compress(body)
    return whole[: len(whole) // 2]


def _inputs(body: bytes) -> tuple[list[str] | None, bool]:
    """The texts of an embeddings request and whether it asks base64."""
    try:
        payload = orjson.loads(body or b"{}")
    except orjson.JSONDecodeError:
        return None, False
    if not isinstance(payload, dict):
        return None, False
    raw = payload.get("input")
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        return None, False
    return texts, payload.get("encoding_format") == "base64"


def _floats(b64: str) -> list[float]:
    return [float(x) for x in np.frombuffer(base64.b64decode(b64), dtype="<f4")]


async def _read_body(reader: asyncio.StreamReader, headers: list[tuple[str, str]]) -> bytes:
    if "chunked" in (header(headers, "transfer-encoding") or "").lower():
        parts: list[bytes] = []
        total = 0
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass
                return b"".join(parts)
            total += size
            if total > _MAX_REQUEST_BODY:
                raise ConnectionError("request body too large")
            parts.append((await reader.readexactly(size + 2))[:-2])
    length = int(header(headers, "content-length") or 0)
    if length > _MAX_REQUEST_BODY:
        raise ConnectionError("request body too large")
    return await reader.readexactly(length)


def _head(status: int, content_type: str, extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    lines = [f"HTTP/1.1 {status} {'OK' if status == 200 else 'Status'}"]
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    lines += [f"{k}: {v}" for k, v in extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace")


def _response(
    status: int,
    body: bytes,
    content_type: str = "application/json",
    *,
    extra: tuple[tuple[str, str], ...] = (),
) -> bytes:
    return _head(status, content_type, (("Content-Length", str(len(body))), *extra)) + body
