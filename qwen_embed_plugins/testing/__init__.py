"""A real OpenAI-compatible embedding server on 127.0.0.1, for tests, demos and benchmarks.

`EmbeddingServer` runs a real HTTP server stack on a real loopback socket (uvicorn for
HTTP/1.1, as SGLang, vLLM and Infinity do; hypercorn when HTTP/2 is asked for) and
answers ``POST /v1/embeddings`` the way SGLang does. Its vectors are deterministic unit
vectors derived from the text, so a test can assert exact values with
`expected_embedding` / `expected_embeddings`::

    from qwen_embed_plugins.testing import EmbeddingServer, expected_embeddings

    with EmbeddingServer() as server:              # random free port on 127.0.0.1
        client = make_client(base_url=server.base_url)
        vectors = client.embed_documents(["a", "b"])
        assert numpy.array_equal(vectors, expected_embeddings(["a", "b"]))
        assert server.connections_opened == 1      # TCP connections accepted, counted for real

What it offers (all traffic stays on 127.0.0.1; the host cannot be changed):

* Endpoints: ``POST /v1/embeddings`` (``input`` a string or a list of strings;
  ``encoding_format`` ``"float"`` (default) or ``"base64"`` (little-endian float32);
  ``dimensions`` refused with 400 unless ``matryoshka=True``, then the first
  ``dimensions`` components, L2-renormalised), ``GET /v1/models``, ``GET /health``.
  Errors use SGLang's flat body
  ``{"object": "error", "message": ..., "type": "BadRequestError", "param": null, "code": 400}``.
* Production-like transport: the idle keep-alive timeout (5 s by default, like
  uvicorn-based servers), HTTPS with a throw-away CA (``tls=True``, via ``trustme``),
  HTTP/2 by ALPN and cleartext h2c (``http2=True``), a bearer API key, a per-request
  latency, input length and batch limits, and a cap on requests per connection (like
  llama.cpp, which closes a connection after 100 requests).
* Counters: TCP connections accepted (counted in the listening socket's ``accept()``,
  not estimated), connections open now, embedding requests, texts embedded, peak
  concurrent requests, answers by status, faults applied, and a bounded log of the
  inputs received (`EmbeddingServer.received`), e.g. to check the query instruction
  that reached the server.
* Fault injection, scripted (`EmbeddingServer.inject`) or seeded-random
  (`EmbeddingServer.set_random_faults`): a status code with optional ``Retry-After`` /
  ``retry-after-ms`` (presets for 429 and SGLang's 503 "The request queue is full."), a
  connection closed without an answer, a TCP reset (before or in the middle of the
  body), a delay (to trigger read timeouts), malformed JSON, one vector too few, a NaN,
  an all-zero vector; plus `EmbeddingServer.close_connections`, `EmbeddingServer.stop`
  / `EmbeddingServer.start` and `EmbeddingServer.restart` on the same port.
* ``process=True`` runs the server in a child process (so a benchmark client does not
  share the GIL with it); counters and faults then travel over a pipe.
* ``python -m qwen_embed_plugins.testing --port 30000 [--tls] [--http2] [--latency S]``
  runs it in the foreground; counters are also served at ``GET /_testing/stats``.

Fault kinds (`Fault.make` / `EmbeddingServer.inject` parameters in brackets):

==============  ==========================================================================
``status``      answer ``status`` (default 500) with SGLang's error body [``status``,
                ``message``, ``body``, ``retry_after`` (seconds or an HTTP date),
                ``retry_after_ms``, ``headers``]
``close``       close the connection (FIN) without any answer
``reset``       reset the connection (RST) after ``after_bytes`` bytes of the body (default:
                half of it; 0: before any answer byte), ``pause`` seconds after them
``delay``       wait ``seconds`` (default 1.0) before answering normally
``malformed``   answer 200 with a body that is not valid JSON [``body``]
``wrong_count`` answer ``drop`` (default 1) vectors fewer than the inputs
``nan``         put a NaN in the vector at ``index`` (default 0); float bodies carry it
                as ``null`` (as orjson-based SGLang does) or, with ``literal=True``, as
                the non-standard token ``NaN`` (as Python's ``json`` does)
``zero``        make the vector at ``index`` (default 0) all zeros
==============  ==========================================================================

A fault is consumed by the next embedding request that passes authentication, in
arrival order. ``close`` and ``reset`` act on the whole TCP connection (with HTTP/2, on
every stream it carries). Vector faults (``wrong_count``, ``nan``, ``zero``) do nothing
to a request answered with an error.

This module imports only the standard library, numpy and orjson at import time; the
server libraries (uvicorn, hypercorn, trustme) are imported when a server starts and
come with the ``testing`` extra: ``pip install "qwen-embed-plugins[testing]"``.
"""

from __future__ import annotations

from ._cli import main
from ._common import (
    DEFAULT_DIM,
    DEFAULT_MAX_INPUT_CHARS,
    DEFAULT_MODEL,
    QUEUE_FULL_MESSAGE,
    expected_embedding,
    expected_embeddings,
)
from ._dialect import SGLangDialect
from ._dialects import (
    DIALECTS,
    DashScopeDialect,
    InfinityDialect,
    LlamaCppDialect,
    OllamaDialect,
    SiliconFlowDialect,
    TEIDialect,
    VLLMDialect,
)
from ._faults import FAULT_KINDS, SOAK_FAULTS, Fault, FaultKind, FaultSpec
from ._server import EmbeddingServer

__all__ = [
    "DEFAULT_DIM",
    "DEFAULT_MAX_INPUT_CHARS",
    "DEFAULT_MODEL",
    "DIALECTS",
    "FAULT_KINDS",
    "QUEUE_FULL_MESSAGE",
    "SOAK_FAULTS",
    "DashScopeDialect",
    "EmbeddingServer",
    "Fault",
    "FaultKind",
    "FaultSpec",
    "InfinityDialect",
    "LlamaCppDialect",
    "OllamaDialect",
    "SGLangDialect",
    "SiliconFlowDialect",
    "TEIDialect",
    "VLLMDialect",
    "expected_embedding",
    "expected_embeddings",
    "main",
]
