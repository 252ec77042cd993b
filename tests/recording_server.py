"""A loopback embedding server that records what each request carried (headers and JSON
body), for tests of what the client sends. ``EmbeddingServer`` keeps only the inputs.

It answers ``POST .../embeddings`` like an OpenAI-compatible server (float lists, or
base64 when asked), with `expected_embedding` vectors, over HTTP/1.1 keep-alive.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

import numpy as np
import orjson

from qwen_embed_tooling.testing import expected_embeddings


class Received:
    """One request: ``headers`` (names lower-cased) and ``body`` (the decoded JSON)."""

    def __init__(self, headers: dict[str, str], body: dict[str, Any]) -> None:
        self.headers = headers
        self.body = body

    def __repr__(self) -> str:
        return f"Received({self.headers!r}, {self.body!r})"


class RecordingServer:
    """``with RecordingServer() as srv: ...``; ``srv.base_url``, ``srv.received``.

    ``echo`` makes it a server that repeats what it was sent: ``"error"`` answers every
    request with HTTP ``status`` whose JSON error body quotes every request header (name
    and value) and the request body, and whose ``x-request-id`` quotes the headers;
    ``"ok"`` answers with the embeddings and quotes the headers in an extra body field
    and in ``x-request-id``; ``"status_line"`` answers with a malformed status line
    quoting them. ``refuse(body)`` returns ``(status, JSON document)`` for a request to
    refuse (a gateway's refusal in its own words), or ``None`` to answer it.
    """

    def __init__(
        self,
        *,
        dim: int = 1024,
        echo: str | None = None,
        status: int = 400,
        refuse: Callable[[dict[str, Any]], tuple[int, object] | None] | None = None,
    ) -> None:
        self.dim = dim
        self.received: list[Received] = []
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                raw = self.rfile.read(length)
                body = orjson.loads(raw)
                headers = {k.lower(): v for k, v in self.headers.items()}
                with owner._lock:
                    owner.received.append(Received(headers, body))
                quoted = "; ".join(f"{k}={v}" for k, v in self.headers.items())
                if echo == "status_line":
                    self.wfile.write(f"HTTP/1.1 2x0 {quoted}\r\nContent-Length: 0\r\n\r\n".encode())
                    self.close_connection = True
                    return
                if echo == "error":
                    said = raw.decode("utf-8", "replace")
                    message = {"message": f"request refused; it carried {quoted}; body {said}"}
                    self._send(status, {"error": message}, {"x-request-id": quoted})
                    return
                if not self.path.endswith("/embeddings"):
                    self._send(404, {"error": {"message": "not found"}})
                    return
                refused = refuse(body) if refuse is not None else None
                if refused is not None:  # a gateway's refusal of this body, as scripted
                    self._send(refused[0], refused[1])
                    return
                texts = body["input"]
                vectors = expected_embeddings(texts, owner.dim)
                data = []
                for i, row in enumerate(vectors):
                    if body.get("encoding_format") == "base64":
                        little = row.astype("<f4").tobytes()
                        emb: Any = base64.b64encode(little).decode("ascii")
                    else:
                        emb = row.astype(np.float64).tolist()
                    data.append({"object": "embedding", "index": i, "embedding": emb})
                # no "usage": token counts are not what these tests are about
                doc: dict[str, Any] = {"object": "list", "data": data, "model": body.get("model")}
                if echo == "ok":
                    doc["note"] = f"served; it carried {quoted}"
                    self._send(200, doc, {"x-request-id": quoted})
                    return
                self._send(200, doc)

            def _send(self, status: int, doc: object, extra: dict[str, str] | None = None) -> None:
                payload = orjson.dumps(doc)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                for name, value in (extra or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}/v1"

    def __enter__(self) -> RecordingServer:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def last(self) -> Received:
        with self._lock:
            return self.received[-1]

    def all(self) -> list[Received]:
        with self._lock:
            return list(self.received)
