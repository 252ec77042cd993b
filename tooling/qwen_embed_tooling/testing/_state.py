"""Shared server state: connection registry, counters, received log, fault queue; and the
counting listening socket."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ._common import _BACKLOG, LOOPBACK
from ._faults import Fault, Rule


class _Conn:
    """One accepted TCP connection, as the app sees it."""

    __slots__ = ("in_flight", "peer", "requests", "sock")

    def __init__(self, sock: _ConnSocket, peer: tuple[str, int]) -> None:
        self.sock = sock
        self.peer = peer
        self.requests = 0  # requests received on this connection (any path but /_testing/)
        self.in_flight = 0  # embedding requests being answered now

    def drop(self, *, reset: bool) -> None:
        """End the connection from under the server: FIN, or RST when ``reset``.

        Shutting the read side makes the event loop see end-of-file, so the server closes
        the transport itself (no file descriptor is closed behind its back); with
        ``SO_LINGER`` 0 that close sends a reset instead of a FIN.
        """
        with contextlib.suppress(OSError):
            if reset:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.sock.shutdown(socket.SHUT_RD)
            else:
                self.sock.shutdown(socket.SHUT_RDWR)


class _State:
    """Counters, the received log, the connection registry, the fault queue and rules.

    Shared by the server's event-loop thread and callers' threads, hence the lock; the
    condition ``changed`` is notified whenever a counter or gauge moves (`wait_for`).
    """

    #: Counters and gauges `wait_for` can wait on.
    WAITABLE = frozenset(
        {
            "connections_opened",
            "connections_active",
            "requests",
            "received_count",
            "texts",
            "in_flight",
        }
    )

    def __init__(self, received_limit: int) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.conns: dict[tuple[str, int], _Conn] = {}
        self.faults: deque[Fault] = deque()
        self.rules: list[Rule] = []
        self.random_rate = 0.0
        self.random_kinds: tuple[Fault, ...] = ()
        self.rng = random.Random(0)  # noqa: S311 -- seeded fault draws, not cryptography
        self.received: deque[list[Any]] = deque(maxlen=received_limit)
        self.in_flight = 0  # not a counter: reset_counters() keeps it
        self._zero()

    def _zero(self) -> None:
        self.connections_opened = 0
        self.requests = 0
        self.received_count = 0  # requests whose inputs were logged (not capped)
        self.texts = 0
        self.max_in_flight = self.in_flight
        self.responses: dict[str, int] = {}
        self.faults_applied: dict[str, int] = {}
        self.received.clear()

    # ---- connections (called from the server loop) ----------------------------------
    def connection_accepted(self, sock: _ConnSocket, addr: Any) -> None:
        peer = (str(addr[0]), int(addr[1]))
        with self.lock:
            self.connections_opened += 1
            self.conns[peer] = _Conn(sock, peer)
            self.changed.notify_all()
        sock._qe_state = self
        sock._qe_peer = peer

    def connection_closed(self, sock: _ConnSocket) -> None:
        with self.lock:
            conn = self.conns.get(sock._qe_peer)
            if conn is not None and conn.sock is sock:
                del self.conns[sock._qe_peer]
                self.changed.notify_all()

    def lookup(self, client: Any) -> _Conn | None:
        if not client:
            return None
        with self.lock:
            return self.conns.get((str(client[0]), int(client[1])))

    # ---- requests (called from the server loop) -------------------------------------
    def request_started(self, conn: _Conn | None) -> None:
        with self.lock:
            self.requests += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            if conn is not None:
                conn.in_flight += 1
            self.changed.notify_all()

    def record(self, outcome: str, texts: int = 0) -> None:
        """Count an answer; called before its last byte leaves, so a client that has
        seen the answer also sees it counted."""
        with self.lock:
            self.responses[outcome] = self.responses.get(outcome, 0) + 1
            self.texts += texts
            self.changed.notify_all()

    def request_finished(self, conn: _Conn | None) -> None:
        with self.lock:
            self.in_flight -= 1
            if conn is not None:
                conn.in_flight -= 1
            self.changed.notify_all()

    def log_received(self, inputs: list[Any]) -> None:
        with self.lock:
            self.received.append(inputs)
            self.received_count += 1
            self.changed.notify_all()

    def take_fault(self) -> Fault | None:
        with self.lock:
            if self.faults:
                return self.faults.popleft()
            if self.random_kinds and self.rng.random() < self.random_rate:
                return self.rng.choice(self.random_kinds)
            return None

    def active_rules(self) -> tuple[Rule, ...]:
        """The rules in force, in the order added (windows that ended are dropped)."""
        with self.lock:
            if any(r.kind == "window" for r in self.rules):
                now = time.monotonic()
                self.rules = [r for r in self.rules if r.kind != "window" or r.until > now]
            return tuple(self.rules)

    def wait_for(self, counter: str, n: int, timeout: float, *, at_most: bool = False) -> int:
        """Block until ``counter`` is >= ``n`` (``at_most``: <= ``n``); return its value.

        Raises:
            ValueError: not a counter of `WAITABLE`.
            TimeoutError: not reached within ``timeout`` seconds.
        """
        if counter not in self.WAITABLE:
            raise ValueError(
                f"cannot wait on {counter!r}; one of {', '.join(sorted(self.WAITABLE))}"
            )

        def value() -> int:
            return (
                len(self.conns) if counter == "connections_active" else int(getattr(self, counter))
            )

        with self.changed:
            if not self.changed.wait_for(
                lambda: value() <= n if at_most else value() >= n, timeout
            ):
                raise TimeoutError(
                    f"{counter} is {value()}, not {'<=' if at_most else '>='} {n}, "
                    f"after {timeout:g} s"
                )
            return value()

    def fault_applied(self, kind: str) -> None:
        with self.lock:
            self.faults_applied[kind] = self.faults_applied.get(kind, 0) + 1

    # ---- commands (from EmbeddingServer, the child-process pipe, or /_testing/) ------
    def command(self, name: str, args: Mapping[str, Any]) -> Any:
        """Run a JSON-in, JSON-out control command; see `EmbeddingServer` for meanings."""
        if name == "stats":
            return self.stats(bool(args.get("received", False)))
        if name == "received":
            with self.lock:
                return [list(item) for item in self.received]
        if name == "reset":
            with self.lock:
                self._zero()
            return None
        if name == "inject":
            fault = Fault.from_dict(args["fault"])
            with self.lock:
                self.faults.extend([fault] * int(args.get("count", 1)))
            return None
        if name == "random_faults":
            kinds = tuple(Fault.from_dict(item) for item in args.get("kinds", ()))
            with self.lock:
                self.random_rate = float(args["rate"])
                self.random_kinds = kinds
                self.rng = random.Random(args.get("seed", 0))  # noqa: S311 -- as above
            return None
        if name == "clear_faults":
            with self.lock:
                self.faults.clear()
                self.random_rate = 0.0
                self.random_kinds = ()
                self.rules.clear()
            return None
        if name == "add_rule":
            rule = Rule.from_dict(args["rule"])
            if rule.kind == "window":  # the window starts now, on this process's clock
                rule = replace(rule, until=time.monotonic() + rule.seconds)
            with self.lock:
                self.rules.append(rule)
            return None
        if name == "clear_rules":
            with self.lock:
                self.rules.clear()
            return None
        if name == "wait":
            return self.wait_for(
                str(args["counter"]),
                int(args["n"]),
                float(args.get("timeout", 10.0)),
                at_most=bool(args.get("at_most", False)),
            )
        if name == "close_connections":
            idle_only = bool(args.get("idle_only", False))
            with self.lock:
                targets = [c for c in self.conns.values() if not idle_only or c.in_flight == 0]
            for conn in targets:
                conn.drop(reset=bool(args.get("reset", False)))
            return len(targets)
        raise ValueError(f"unknown command {name!r}")

    def stats(self, with_received: bool = False) -> dict[str, Any]:
        with self.lock:
            data: dict[str, Any] = {
                "connections_opened": self.connections_opened,
                "connections_active": len(self.conns),
                "requests": self.requests,
                "received_count": self.received_count,
                "texts": self.texts,
                "in_flight": self.in_flight,
                "max_in_flight": self.max_in_flight,
                "responses": dict(self.responses),
                "faults_applied": dict(self.faults_applied),
                "faults_pending": len(self.faults),
                "random_fault_rate": self.random_rate,
                "rules": [
                    r.kind for r in self.rules if r.kind != "window" or r.until > time.monotonic()
                ],
            }
            if with_received:
                data["received"] = [list(item) for item in self.received]
            return data


# --------------------------------------------------------------------------------------
# Counting sockets
# --------------------------------------------------------------------------------------


class _ConnSocket(socket.socket):
    """An accepted connection that tells the registry when the server closes it."""

    _qe_state: _State | None = None
    _qe_peer: tuple[str, int] = ("", 0)

    def close(self) -> None:
        state, self._qe_state = self._qe_state, None
        if state is not None:
            state.connection_closed(self)
        super().close()


class _ListenSocket(socket.socket):
    """The listening socket: every connection the server accepts passes through here.

    asyncio's selector loop calls ``sock.accept()`` on the socket it serves, so counting
    here counts real TCP connections, whatever the HTTP stack (uvicorn or hypercorn).
    """

    _qe_state: _State | None = None

    def accept(self) -> tuple[socket.socket, Any]:
        conn, addr = super().accept()
        try:
            tracked = _ConnSocket(conn.family, conn.type, conn.proto, conn.detach())
        except BaseException:
            conn.close()
            raise
        if self._qe_state is not None:
            self._qe_state.connection_accepted(tracked, addr)
        return tracked, addr


def _listen(port: int, state: _State) -> _ListenSocket:
    # proto=IPPROTO_TCP, not 0: accepted sockets inherit it, and asyncio sets TCP_NODELAY
    # only on sockets whose proto is IPPROTO_TCP. Without it every response whose
    # headers and body are written separately stalls for the peer's delayed-ACK timer
    # (Nagle + delayed ACK).
    sock = _ListenSocket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        if os.name == "posix":  # rebind a port whose old connections are in TIME_WAIT
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(_BACKLOG)
    except BaseException:
        sock.close()
        raise
    sock._qe_state = state
    return sock
