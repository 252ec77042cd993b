"""A real OpenAI-compatible embedding server on 127.0.0.1, for tests, demos and benchmarks.

`EmbeddingServer` runs a real HTTP server stack on a real loopback socket (uvicorn for
HTTP/1.1, as SGLang, vLLM and Infinity do; hypercorn when HTTP/2 is asked for) and
answers ``POST /v1/embeddings`` the way SGLang does. Its vectors are deterministic unit
vectors derived from the text, so a test can assert exact values with
`expected_embedding` / `expected_embeddings`::

    from qwen_embed_tooling.testing import EmbeddingServer, expected_embeddings

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
* ``python -m qwen_embed_tooling.testing --port 30000 [--tls] [--http2] [--latency S]``
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

Rules (`EmbeddingServer.add_rule`, `Rule`) are persistent and deterministic: each applies
to every matching request until `EmbeddingServer.clear_rules`. Token figures are
`count_tokens` (``ceil(chars / 4)``).

================== =====================================================================
``poison``         a batch holding a poisonous text -> 500 (Ollama's NaN body), NaN in
                   its vector, or a dropped connection (`EmbeddingServer.poison`)
``drop_over``      batches of more than N texts -> connection dropped
                   (`EmbeddingServer.drop_batches_over`)
``token_cap``      more than N tokens in one request -> 400 "Too many tokens in batch. Max
                   is N got M" (`EmbeddingServer.cap_batch_tokens`)
``context_length`` a text over N tokens -> the dialect's context-length answer
                   (`EmbeddingServer.limit_input_tokens`)
``base64_error``   ``encoding_format="base64"`` -> 500 (`EmbeddingServer.fail_base64`)
``one_item_list``  ``input`` a list of one text -> 500; a bare string works (SGLang 0.4.6;
                   `EmbeddingServer.refuse_one_item_lists`)
``truncate``       each text silently cut to N tokens; ``usage`` tells
                   (`EmbeddingServer.truncate_inputs`)
``window``         every request -> 429 (or 503) for T seconds (`EmbeddingServer.status_window`)
================== =====================================================================

Also here: server models for benchmarks (`GPULike`, `SlowStart`, `RateLimited`,
`HeavyTail`, `DynamicBatching`: ``EmbeddingServer(server_model=...)``); a raw HTTP/2
server that sends GOAWAY or REFUSED_STREAM after N streams and speaks only h2 (``goaway_after``,
``h2_only``); `EmbeddingServer.kill` (a crash) and `EmbeddingServer.wait_for_requests`
(wait without sleeping); llama.cpp's ``/tokenize`` and ``append_eos``; `LoopbackProxy`, a
counting forward proxy that reaches only 127.0.0.1; `HostileServer`, which breaks HTTP
framing and JSON on purpose (`HOSTILE_KINDS`).

This package imports only the standard library, numpy and orjson at import time; the
server libraries (uvicorn, hypercorn, trustme; h2 for the raw HTTP/2 server) are imported
when a server starts and are dependencies of this distribution, ``qwen-embed-tooling``
(from a source checkout: ``pip install -e ./tooling``).
"""

from __future__ import annotations

from ._cli import main
from ._common import (
    DEFAULT_DIM,
    DEFAULT_MAX_INPUT_CHARS,
    DEFAULT_MODEL,
    EOS_TOKEN,
    EOS_TOKEN_ID,
    NAN_ERROR_BODY,
    NO_EOS_SUFFIX,
    QUEUE_FULL_MESSAGE,
    TOKEN_CAP_MESSAGE,
    TOKEN_CAP_MESSAGE_UNSTATED,
    count_tokens,
    expected_embedding,
    expected_embeddings,
)
from ._dialect import SGLangDialect
from ._dialects import (
    DIALECTS,
    InfinityDialect,
    LlamaCppDialect,
    OllamaDialect,
    TEIDialect,
    VLLMDialect,
)
from ._faults import (
    FAULT_KINDS,
    RULE_KINDS,
    SOAK_FAULTS,
    Fault,
    FaultKind,
    FaultSpec,
    Rule,
    RuleKind,
)
from ._hosted import DashScopeDialect, SiliconFlowDialect
from ._hostile import HOSTILE_KINDS, HostileServer
from ._models import DynamicBatching, GPULike, HeavyTail, RateLimited, ServerModel, SlowStart
from ._proxy import LoopbackProxy
from ._server import EmbeddingServer

__all__ = [
    "DEFAULT_DIM",
    "DEFAULT_MAX_INPUT_CHARS",
    "DEFAULT_MODEL",
    "DIALECTS",
    "EOS_TOKEN",
    "EOS_TOKEN_ID",
    "FAULT_KINDS",
    "HOSTILE_KINDS",
    "NAN_ERROR_BODY",
    "NO_EOS_SUFFIX",
    "QUEUE_FULL_MESSAGE",
    "RULE_KINDS",
    "SOAK_FAULTS",
    "TOKEN_CAP_MESSAGE",
    "TOKEN_CAP_MESSAGE_UNSTATED",
    "DashScopeDialect",
    "DynamicBatching",
    "EmbeddingServer",
    "Fault",
    "FaultKind",
    "FaultSpec",
    "GPULike",
    "HeavyTail",
    "HostileServer",
    "InfinityDialect",
    "LlamaCppDialect",
    "LoopbackProxy",
    "OllamaDialect",
    "RateLimited",
    "Rule",
    "RuleKind",
    "SGLangDialect",
    "ServerModel",
    "SiliconFlowDialect",
    "SlowStart",
    "TEIDialect",
    "VLLMDialect",
    "count_tokens",
    "expected_embedding",
    "expected_embeddings",
    "main",
]
