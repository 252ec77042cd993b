"""The process-wide registry of shared pools: one per server (replica) and transport
settings.

Key: the frozen ``PoolKey`` of a config (base URL, limits, HTTP/2, TLS verification,
proxy) — never the adapter or client object, and never the API key or timeouts (they
travel with each request), so every client and adapter of a server shares the same
connections, whichever tenant's key it sends.

- **Sync**: one ``_transport.SyncTransport`` per key, shared by all threads.
- **Async**: a connection belongs to the event loop that opened it, so there is one
  ``_transport.AsyncTransport`` per (key, running loop). When ``asyncio.run()`` (or any
  runner that calls ``shutdown_asyncgens``) finishes a loop, that loop's transports are
  closed inside it. The registry holds loops and their transports weakly: the loop
  object itself owns its transports (an attribute on the loop; a strong reference here
  only for a loop that takes no attribute, such as uvloop's). A loop closed without
  ``shutdown_asyncgens`` releases its pool at the next lookup or reaper pass (its
  connections are released directly). A loop dropped without being closed at all is
  garbage-collected with its pools, and its connections are released then (the server
  sees them close), with no "Unclosed client session" / "Unclosed connector" message;
  asyncio itself reports such a loop and its transports (``_async_http``).
  ``asyncio.run()`` twice, Jupyter, pytest and threads with their own loops all work.
- **fork**: a child process never touches its parent's sockets: its pools drop their
  transports in the child (the fork hook of ``_state``) and rebuild them lazily.
- **Lazy**: nothing is opened until the first request. Creation is lock-guarded.
- **Lifetime**: a pool idle for longer than its keep-alive expiry holds only
  connections the server has closed or is about to close: a reaper thread closes such
  pools (they reopen on the next request), and pools of closed or collected loops. So
  10,000 per-tenant adapters hold no socket when idle. ``close_all()`` /
  ``aclose_all()`` close everything now; ``close_all()`` also runs at interpreter exit.
  ``reset()`` (``_state``) closes them and forgets every pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import threading
import time
import weakref
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from ._config import PoolKey
from ._metrics import EndpointMetrics, metrics_for
from ._state import STATE
from ._transport import AsyncTransport, ProcessGate, QuietFlag, SyncTransport

__all__ = [
    "aclose_all",
    "async_transport",
    "close_all",
    "h2c_fallback",
    "h2c_succeeded",
    "pool_metrics",
    "pool_stats",
    "reap_idle",
    "sync_transport",
]

_log = logging.getLogger("qwen_embed_plugins")

# The registries (entries, gates, detached slots, abandoned transports) and the reaper
# thread are in ``_state.STATE``. Transports abandoned in a forked child are kept
# referenced there so that garbage collection never runs their finalisers on sockets
# that are not theirs.

_OWNED = "_qwen_embed_transports"
"""The attribute of an event loop holding the transports opened on it (with their
parked sentinels), by slot token: the loop owns them, the registry only points at them."""

_tokens = itertools.count(1)

# ``STATE.detached``: slots out of the registry whose transport their (live) loop still
# owns, by token: a close scheduled by ``close_all``, an h2c transport given up. At
# interpreter exit those of loops that are not running are abandoned (closed directly).
# No lock: single dict operations only (the finaliser of a collected loop removes its
# slot from there).

REAP_INTERVAL = 1.0
"""Seconds between two passes of the reaper thread."""


_Held = tuple[AsyncTransport, AsyncGenerator[None, None] | None]


@dataclass(eq=False)
class _LoopSlot:
    """One pool's transport on one event loop. It points at the loop and the transport
    weakly: the loop owns the transport (``_OWNED``), so nothing here keeps a dropped
    loop alive. ``held`` is the fallback for a loop that takes no attribute."""

    loop_ref: weakref.ref[asyncio.AbstractEventLoop]
    transport_ref: weakref.ref[AsyncTransport]
    quiet: QuietFlag
    token: int = field(default_factory=lambda: next(_tokens))
    held: _Held | None = None
    finalizer: weakref.finalize[[_LoopSlot], asyncio.AbstractEventLoop] | None = None
    dead: bool = False

    @property
    def transport(self) -> AsyncTransport | None:
        """The transport, while its loop (or ``held``) still has it."""
        return self.transport_ref()

    def forget_loop(self) -> None:
        """The slot no longer needs to hear of its loop's collection."""
        finalizer, self.finalizer = self.finalizer, None
        if finalizer is not None:
            finalizer.detach()

    def at_exit(self) -> None:
        """At interpreter exit, for a detached slot: abandon it if its loop is closed,
        collected or not running (its scheduled close will never run)."""
        loop = self.loop_ref()
        if loop is None or loop.is_closed() or not loop.is_running():
            _abandon(self)

    def after_fork_in_child(self) -> None:
        """In a forked child: the parent's sockets are never closed here, not even by a
        sentinel or the finaliser of a loop copied into the child."""
        self.dead = True
        self.forget_loop()
        held = _disown(self)
        if held is not None:
            STATE.abandoned.append(held)


def _own(loop: asyncio.AbstractEventLoop, slot: _LoopSlot, held: _Held) -> None:
    """Give ``held`` (a transport and its sentinel) to ``loop`` to own."""
    owned: dict[int, _Held] | None = getattr(loop, _OWNED, None)
    if owned is None:
        owned = {}
        try:
            setattr(loop, _OWNED, owned)
        except (AttributeError, TypeError):  # uvloop: held here, as strongly as before
            slot.held = held
            return
    owned[slot.token] = held


def _disown(slot: _LoopSlot) -> _Held | None:
    """Take ``slot``'s transport and sentinel back from their loop (``None``: already
    taken by another close path, or gone with the loop)."""
    STATE.detached.pop(slot.token, None)
    held, slot.held = slot.held, None
    if held is None:
        owned: dict[int, _Held] | None = getattr(slot.loop_ref(), _OWNED, None)
        if owned is not None:
            held = owned.pop(slot.token, None)
    return held


def _loop_collected(slot: _LoopSlot) -> None:
    """Finaliser of a slot's loop, collected without being closed: its transports are
    collected with it (``QuietFlag``). Runs inside garbage collection, in any thread:
    takes no lock; the slot is purged later. It runs before any finaliser of the loop's
    garbage, so it shuts the connections' sockets down first (their server sees them
    close now)."""
    slot.dead = True
    slot.quiet.shutdown_sockets(loop_open=False)
    STATE.detached.pop(slot.token, None)


@dataclass
class _Entry:
    key: PoolKey
    metrics: EndpointMetrics
    gate: ProcessGate | None
    sync: SyncTransport | None = None
    loops: dict[int, _LoopSlot] = field(default_factory=dict)
    h2c_failed: bool = False
    h2c_ok: bool = False
    last_used: float = field(default_factory=time.monotonic)
    active: int = 0

    def close(self, *, exiting: bool) -> None:
        """``close_all`` for this pool (``exiting``: at interpreter exit)."""
        with STATE.lock:
            sync, self.sync = self.sync, None
            slots = list(self.loops.values())
            self.loops.clear()
        if sync is not None:
            sync.close()
        for slot in slots:
            _release(slot, exiting=exiting)

    def after_fork_in_child(self) -> None:
        """In a forked child: drop the parent's transports (kept referenced, never
        closed here) and in-flight counts; they are rebuilt lazily."""
        if self.sync is not None:
            STATE.abandoned.append(self.sync)
        self.sync = None
        for slot in self.loops.values():
            slot.after_fork_in_child()
        self.loops = {}
        self.gate = _gate(self.key)
        self.active = 0
        _ensure_reaper()

    @property
    def fingerprint(self) -> str:
        """A short stable digest of the pool's settings (never a credential)."""
        k = self.key
        raw = repr((k.base_url, k.limits, k.http2, k.verify, k.proxy is not None))
        return hashlib.sha256(raw.encode()).hexdigest()[:12]


def _gate(key: PoolKey) -> ProcessGate | None:
    slots = key.limits.max_connections_per_process
    if slots is None:
        return None
    gate_key = (key.base_url, slots)
    gate: ProcessGate | None = STATE.slot_gates.get(gate_key)
    if gate is None:
        gate = STATE.slot_gates[gate_key] = ProcessGate(slots)
    return gate


def _entry(key: PoolKey) -> _Entry:
    found: _Entry | None = STATE.entries.get(key)
    if found is not None:
        return found
    with STATE.lock:
        found = STATE.entries.get(key)
        if found is None:
            found = _Entry(key=key, metrics=metrics_for(key.label), gate=_gate(key))
            STATE.entries[key] = found
            _ensure_reaper()
        return found


def pool_metrics(key: PoolKey) -> EndpointMetrics:
    """The metrics of ``key``'s server (shared by every pool of that URL)."""
    return _entry(key).metrics


def _h2c(entry: _Entry) -> bool:
    key = entry.key
    return key.http2 and key.base_url.startswith("http://") and not entry.h2c_failed


def sync_transport(key: PoolKey) -> SyncTransport:
    """The shared blocking transport of ``key`` (created on first use; thread-safe)."""
    entry: _Entry = STATE.entries.get(key) or _entry(key)
    entry.last_used = time.monotonic()
    transport = entry.sync
    if transport is not None:
        return transport
    with STATE.lock:
        transport = entry.sync
        if transport is None:
            transport = SyncTransport(key, entry.metrics, h2c=_h2c(entry), gate=entry.gate)
            entry.sync = transport
        return transport


async def _loop_sentinel(entry: _Entry, slot: _LoopSlot) -> AsyncGenerator[None, None]:
    """Parked in the loop's async-generator registry; ``asyncio.run()`` finalises it
    (``shutdown_asyncgens``) before closing the loop, which closes the loop's pool."""
    try:
        yield
    finally:
        if not slot.dead:
            slot.dead = True
            with STATE.lock:
                for loop_id, kept in list(entry.loops.items()):
                    if kept is slot:
                        del entry.loops[loop_id]
        slot.forget_loop()
        # Unless another path (close_all, aclose_all, fork) took it already, the
        # transport is still the loop's: close it here, inside the loop.
        held = _disown(slot)
        if held is not None:
            await held[0].aclose()


def _abandon(slot: _LoopSlot) -> None:
    """Release a slot whose loop is closed or collected (or open but never to run
    again): its connections are shut down at once (the loop cannot close them; see
    ``AsyncTransport.abandon``)."""
    slot.dead = True
    slot.forget_loop()
    held = _disown(slot)
    transport = held[0] if held is not None else slot.transport
    if transport is not None:
        transport.abandon()
    loop = slot.loop_ref()
    slot.quiet.shutdown_sockets(loop_open=loop is not None and not loop.is_closed())
    if held is not None and held[1] is not None:
        # Finish the parked generator without awaiting (its loop is closed).
        with contextlib.suppress(StopIteration, RuntimeError, GeneratorExit):
            held[1].aclose().send(None)


def _purge_dead_loops(entry: _Entry) -> None:
    for loop_id, slot in list(entry.loops.items()):
        loop = slot.loop_ref()
        if loop is None or loop.is_closed():
            del entry.loops[loop_id]
            _abandon(slot)


def async_transport(key: PoolKey) -> AsyncTransport:
    """The transport of ``key`` for the running event loop.

    Raises:
        RuntimeError: called with no running event loop.
    """
    loop = asyncio.get_running_loop()
    entry: _Entry = STATE.entries.get(key) or _entry(key)
    entry.last_used = time.monotonic()
    slot = entry.loops.get(id(loop))
    if slot is not None and not slot.dead and slot.loop_ref() is loop:
        found = slot.transport
        if found is not None:
            return found
    with STATE.lock:
        _purge_dead_loops(entry)
        slot = entry.loops.get(id(loop))
        if slot is not None and not slot.dead and slot.loop_ref() is loop:
            found = slot.transport
            if found is not None:
                return found
        quiet = QuietFlag()
        transport = AsyncTransport(
            key, entry.metrics, h2c=_h2c(entry), gate=entry.gate, quiet=quiet
        )
        slot = _LoopSlot(
            loop_ref=weakref.ref(loop), transport_ref=weakref.ref(transport), quiet=quiet
        )
        sentinel = _loop_sentinel(entry, slot)
        # Start the generator synchronously: the running loop's firstiter hook registers
        # it, and it parks at its ``yield``. The loop owns it with the transport.
        with contextlib.suppress(StopIteration):
            sentinel.asend(None).send(None)
        _own(loop, slot, (transport, sentinel))
        finalizer = weakref.finalize(loop, _loop_collected, slot)
        finalizer.atexit = False
        slot.finalizer = finalizer
        entry.loops[id(loop)] = slot
        return transport


def h2c_succeeded(key: PoolKey) -> None:
    """Record that the server answered over cleartext HTTP/2: h2c is never given up for
    it afterwards (a later connection error is a connection error, not a refusal)."""
    entry = _entry(key)
    if not entry.h2c_ok:
        entry.h2c_ok = True


def h2c_fallback(key: PoolKey) -> bool:
    """Give up prior-knowledge h2c for ``key`` and use HTTP/1.1 from now on — only if the
    server never answered over h2c (so the failure shows it does not speak it).

    Returns ``True`` if this call switched (the caller should resend at once).
    """
    entry = _entry(key)
    if not _h2c(entry) or entry.h2c_ok:
        return False
    with STATE.lock:
        if entry.h2c_failed or entry.h2c_ok:
            return False
        entry.h2c_failed = True
        old, entry.sync = entry.sync, None
        slots = list(entry.loops.values())
        entry.loops.clear()
    if old is not None:
        STATE.abandoned.append(old)
    for slot in slots:
        # Left to its loop, which owns it: closed when the loop shuts down (or quietly
        # with the loop if it is dropped); requests still on it finish there.
        slot.dead = True
        STATE.detached[slot.token] = slot
    entry.metrics.fallback("h2c_to_http1")
    _log.warning("%s does not speak cleartext HTTP/2 (h2c); using HTTP/1.1 from now on", key.label)
    return True


# --------------------------------------------------------------------------- lifetime


def reap_idle(now: float | None = None) -> int:
    """Close sync pools idle for longer than their keep-alive expiry (plus one second),
    and release the pools of closed or collected event loops. Returns how many transports
    were closed. Run by the reaper thread every ``REAP_INTERVAL`` seconds."""
    now = time.monotonic() if now is None else now
    closed = 0
    with STATE.lock:
        entries = list(STATE.entries.values())
    for entry in entries:
        idle = now - entry.last_used
        limit = entry.key.limits.keepalive_expiry + 1.0
        with STATE.lock:
            for loop_id, slot in list(entry.loops.items()):
                loop = slot.loop_ref()
                # A live loop's pool is its own to expire (aiohttp closes idle
                # connections on the loop's timers); only dead loops are released here.
                if loop is None or loop.is_closed():
                    del entry.loops[loop_id]
                    _abandon(slot)
                    closed += 1
            sync = entry.sync
            if sync is not None and idle > limit and sync.idle():
                entry.sync = None
            else:
                sync = None
        if sync is not None:
            sync.close()
            closed += 1
    for slot in list(STATE.detached.values()):
        loop = slot.loop_ref()
        if loop is None or loop.is_closed():  # its scheduled close will never run
            _abandon(slot)
            closed += 1
    return closed


def _reaper_main() -> None:
    while True:
        time.sleep(REAP_INTERVAL)
        try:
            reap_idle()
        except Exception:  # never let the reaper die
            _log.debug("pool reaper failed", exc_info=True)


def _ensure_reaper() -> None:
    reaper = STATE.reaper
    if reaper is None or not reaper.is_alive():
        reaper = threading.Thread(target=_reaper_main, name="qwen-embed-reaper", daemon=True)
        STATE.reaper = reaper
        reaper.start()


def close_all() -> None:
    """Close every shared sync pool and release every async pool now.

    An async pool is closed inside its own event loop (scheduled there: at once if the
    loop is running, else when it next runs); if that loop never runs again and is
    dropped, or the interpreter exits, its connections are released when it is
    collected (no aiohttp "Unclosed ..." message). The connections of a closed loop's
    pool are released directly; a collected loop's pool went with it. Later calls simply open new
    connections; requests in flight on a closed pool are resent once on a new one (a
    close is never counted against the endpoint's health).

    At interpreter exit (it runs then too) the pool of a loop that is not running is
    abandoned at once instead: its connections are released directly.
    """
    STATE.close()


def _release(slot: _LoopSlot, *, exiting: bool) -> None:
    """``close_all`` for one async pool."""
    slot.dead = True
    loop = slot.loop_ref()
    transport = slot.transport
    if loop is not None and not loop.is_closed() and transport is not None:
        if exiting and not loop.is_running():
            _abandon(slot)  # the interpreter is exiting: it will not run again
            return
        # Close it inside its own loop: now if the loop is running, else the next time
        # it runs (its sockets belong to that loop's selector). Retired meanwhile: no
        # new request, and quiet if the loop never runs again.
        transport.retire()
        STATE.detached[slot.token] = slot
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_close_soon, slot)
            return
    _abandon(slot)


def _close_soon(slot: _LoopSlot) -> None:
    """On the slot's own loop: close its transport in a task (scheduled by
    ``close_all``)."""
    slot.forget_loop()
    held = _disown(slot)
    if held is not None:
        asyncio.ensure_future(held[0].aclose())  # noqa: RUF006 - fire and forget, by design


async def aclose_all() -> None:
    """Close every shared sync pool and this loop's async pools (awaiting them), and
    release the others (see ``close_all``)."""
    loop = asyncio.get_running_loop()
    with STATE.lock:
        entries = list(STATE.entries.values())
    mine: list[AsyncTransport] = []
    for entry in entries:
        with STATE.lock:
            slot = entry.loops.pop(id(loop), None)
        if slot is not None and slot.loop_ref() is loop:
            slot.dead = True
            slot.forget_loop()
            held = _disown(slot)
            if held is not None:
                mine.append(held[0])
        elif slot is not None:  # a stale slot of a collected loop with the same id
            _abandon(slot)
    for transport in mine:
        await transport.aclose()
    close_all()


def pool_stats() -> dict[str, dict[str, Any]]:
    """Per server (replica) label: the pools open now and the endpoint's counters.

    Each row: ``pools`` (pools with these URL's settings), ``fingerprints`` (a short
    digest of each pool's settings; never a credential), ``sync_clients`` and
    ``async_clients`` (transports open now), ``connections_opened``, ``requests``,
    ``in_flight``, ``stale_retries``, ``retries``, ``texts`` (counts since start or
    ``reset_metrics()``). Pools of one URL with different transport settings add up in
    its row. An endpoint of several replicas also gets a row, labelled with their
    comma-separated labels, holding their totals (``replicas`` lists them)."""
    with STATE.lock:
        entries = list(STATE.entries.values())
    out: dict[str, dict[str, Any]] = {}
    for entry in entries:
        label = entry.key.label
        row = out.setdefault(
            label, {"pools": 0, "fingerprints": [], "sync_clients": 0, "async_clients": 0}
        )
        row["pools"] += 1
        row["fingerprints"].append(entry.fingerprint)
        row["sync_clients"] += int(entry.sync is not None)
        row["async_clients"] += sum(
            1
            for s in entry.loops.values()
            if not s.dead and (loop := s.loop_ref()) is not None and not loop.is_closed()
        )
        snap = entry.metrics.snapshot()
        for name in (
            "connections_opened",
            "requests",
            "in_flight",
            "stale_retries",
            "retries",
            "texts",
        ):
            row[name] = snap[name]
    from ._metrics import stats

    for label, snap in stats().items():
        members = snap.get("replicas")
        if members and all(m in out for m in members):
            total: dict[str, Any] = {"replicas": list(members)}
            for name in ("pools", "sync_clients", "async_clients"):
                total[name] = sum(out[m][name] for m in members)
            total["fingerprints"] = [f for m in members for f in out[m]["fingerprints"]]
            for name in (
                "connections_opened",
                "requests",
                "in_flight",
                "stale_retries",
                "retries",
                "texts",
            ):
                total[name] = snap[name]
            out[label] = total
    return out
