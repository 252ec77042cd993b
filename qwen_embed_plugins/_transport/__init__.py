"""The transport layer: one contract above the backends, each backend on its library's
public API. ``_pool`` builds its transports from here, and the engine, the runner and the
client speak the contract through the names re-exported here.

The modules, each importing only modules listed above it (and ``_config``, ``errors``,
``_metrics``, ``_server_text``, ``_state``; ``_sdk`` also ``_pool``), so the layer has no
import circle:

- ``_http``: the HTTP library of this install (``httpx``, or ``httpx2`` under openai
  3.x) and what both httpx backends share (``Limits``, timeouts bounded by the time left);
- ``_exceptions``: the one exception map, a table per backend walked by ``translate``
  (httpx/h2, ``http.client`` / ``ssl`` / ``socket``, aiohttp -> the library's errors);
- ``_contract``: ``Request -> Reply``, the body caps (received and decoded), the total
  time budget, ``check_status``, ``failure`` / ``mapped`` (errors raised with no chain to
  the backend's exception), ``ProcessGate``,
  ``ssl_context``, ``quiet_header_loggers``;
- ``_http11``: the blocking HTTP/1.1 backend (the stdlib's ``http.client``);
- ``_sync_http``: ``SyncTransport``, the blocking transport of one pool: HTTP/1.1 on
  ``_http11``, HTTP/2 and h2c on an ``httpx.Client``;
- ``_async_http``: ``AsyncTransport``, the transport of one pool on one event loop:
  ``aiohttp`` for HTTP/1.1, an ``httpx.AsyncClient`` for HTTP/2;
- ``_sdk``: the openai SDK on the pools (one public ``httpx`` transport class per mode);
  it reaches the transports through ``_pool``, so this ``__init__`` does not import it.

The choice of backend per pool: sync or async is the caller's (``_pool.sync_transport``
/ ``_pool.async_transport``); HTTP/1.1 or HTTP/2 is the pool key's (``http2``, and the
cleartext h2c fallback), made inside ``SyncTransport`` / ``AsyncTransport``.
"""

from __future__ import annotations

from ._async_http import AsyncTransport, QuietFlag
from ._contract import ProcessGate, Reply, Request, Retired
from ._sync_http import SyncTransport

__all__ = [
    "AsyncTransport",
    "ProcessGate",
    "QuietFlag",
    "Reply",
    "Request",
    "Retired",
    "SyncTransport",
]
