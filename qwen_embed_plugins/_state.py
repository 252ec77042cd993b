"""The process state: everything the library keeps per process, in one object.

``STATE`` holds the shared pools (per pool key, with their async transports per event
loop), the replicas and endpoints with what was learned about them (health, batch and
token limits, dialect), the per-endpoint metrics, the TLS contexts, and the threads that
serve them (the pool reaper, the executor carrying concurrent sync batches). The modules
that use a part keep its logic; the dicts live here, so that one fork hook, one close
and one ``reset`` see all of it.

- **fork**: one ``os.register_at_fork`` hook. The child never touches its parent's
  sockets (each pool drops its transports, kept referenced so that no finaliser closes
  them), gets fresh locks, no threads (rebuilt lazily), and no request in flight; what
  was learned about the servers is kept.
- **close**: ``STATE.close()`` closes every pool (``_pool.close_all``); at interpreter
  exit too.
- **reset**: ``reset()`` closes the pools and forgets everything learned (public, from
  the front door: ``qwen_embed_plugins.reset``).

This module imports nothing from the package (its registries' values are typed ``Any``
here, and where they are used): the objects it holds know how to drop their own
resources (``after_fork_in_child``, ``close``, ``at_exit``, ``forget``).
"""

from __future__ import annotations

import atexit
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ssl
    from concurrent.futures import ThreadPoolExecutor

__all__ = ["STATE", "ProcessState", "reset"]


@dataclass(eq=False)
class ProcessState:
    """The library's process-wide state (one instance: ``STATE``). Registries are read
    without the lock (single dict look-ups) and filled under it."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    # _pool.py: one entry per pool key (sync transport, async transports per loop)
    entries: dict[Any, Any] = field(default_factory=dict)
    # _pool.py: the fixed per-process connection gates, by (base URL, slots)
    slot_gates: dict[tuple[str, int], Any] = field(default_factory=dict)
    # _pool.py: slots out of ``entries`` whose live loop still owns their transport
    detached: dict[int, Any] = field(default_factory=dict)
    # transports of a parent process or given up: kept referenced, never finalised here
    abandoned: list[Any] = field(default_factory=list)
    # _balance.py: servers and what was learned about them; endpoints of replica lists
    replicas: dict[Any, Any] = field(default_factory=dict)
    endpoints: dict[Any, Any] = field(default_factory=dict)
    # _metrics.py: counters per endpoint label; endpoints of several replicas
    metrics: dict[str, Any] = field(default_factory=dict)
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # _contract.py: every secret sent through an HTTP library that logs (httpx, httpcore),
    # scrubbed from those libraries' log records; kept by reset() and in a forked child
    # (clients made before still send them). Replaced, never mutated: read without the lock
    log_secrets: tuple[str, ...] = ()
    # transport.py: one SSL context per (verify, http2, cleartext), built under ssl_lock
    # (possibly on a client's background thread: _contract.prepare_ssl_contexts)
    ssl_contexts: dict[tuple[bool | str, bool, bool], ssl.SSLContext] = field(default_factory=dict)
    ssl_lock: threading.Lock = field(default_factory=threading.Lock)
    ssl_pending: set[tuple[bool | str, bool, bool]] = field(default_factory=set)
    # threads, started on first use
    reaper: threading.Thread | None = None
    executor: ThreadPoolExecutor | None = None

    def close(self, *, exiting: bool = False) -> None:
        """Close every pool (see ``_pool.close_all``); ``exiting``: at interpreter exit,
        the pools of loops that will not run again are abandoned (sockets closed
        directly, quietly)."""
        with self.lock:
            entries = list(self.entries.values())
        for entry in entries:
            entry.close(exiting=exiting)
        if exiting:
            for slot in list(self.detached.values()):
                slot.at_exit()

    def reset(self) -> None:
        """``reset()``: close the pools, then forget the rest (see the module function)."""
        self.close()
        with self.lock:
            replicas = list(self.replicas.values())
            metrics = list(self.metrics.values())
            self.entries.clear()
            self.slot_gates.clear()
            self.replicas.clear()
            self.endpoints.clear()
            self.metrics.clear()
            self.groups.clear()
        # A client made before still holds these objects: they forget too.
        for replica in replicas:
            replica.forget()
        for m in metrics:
            m.reset()

    def after_fork_in_child(self) -> None:
        """The one fork hook (``os.register_at_fork(after_in_child=...)``)."""
        # A lock held by another thread at fork time would stay locked in the child;
        # threads do not exist in the child (started again on first use).
        self.lock = threading.RLock()
        self.ssl_lock = threading.Lock()
        self.ssl_pending.clear()  # their threads are not in the child
        self.reaper = self.executor = None
        self.slot_gates.clear()
        for m in self.metrics.values():
            m.after_fork_in_child()
        for entry in self.entries.values():
            entry.after_fork_in_child()
        for slot in list(self.detached.values()):
            slot.after_fork_in_child()
        for replica in self.replicas.values():
            replica.after_fork_in_child()  # its locks, its probe's gate, its retry budget
        for endpoint in self.endpoints.values():
            endpoint.hedges.after_fork_in_child()


STATE = ProcessState()
"""The library's state in this process."""


def reset() -> None:
    """Forget everything this process learned about servers, and close its pools.

    Closes every shared pool (as ``close_all()``: sync pools now, async pools inside
    their own event loop, or directly if that loop is closed) and forgets the pools,
    the replicas and their health (ejections, failure streaks, open circuits), what was
    learned about each server (batch and token limits, dialect, vector encoding), and the
    metrics (``stats()`` and ``pool_stats()`` start empty). SSL contexts are kept (they
    depend on settings only), and so are the secrets scrubbed from the HTTP libraries' log
    records (clients made before still send them).

    Call it in tests (before each test: a server started by a test can get the port, and
    so the URL, of an earlier test's server) and after redeploying a server behind the
    same URL (a new version may accept larger batches than the old one). Clients made
    before keep working (they reopen connections on their next request, the replica
    state they hold is cleared too); a call in flight finishes on its connection.
    Raises nothing.
    """
    STATE.reset()


os.register_at_fork(after_in_child=lambda: STATE.after_fork_in_child())
atexit.register(lambda: STATE.close(exiting=True))
