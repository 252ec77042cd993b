"""Fault, rule and wait controls of `EmbeddingServer` (a mixin: every method is a JSON
command to the serving state, so it works the same in thread and child-process mode)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._common import QUEUE_FULL_MESSAGE, TOKEN_CAP_MESSAGE, _integer, _number
from ._faults import SOAK_FAULTS, Fault, FaultSpec, Rule, _as_fault


class _ServerControls:
    """Faults (one request each), rules (every request until cleared) and waits."""

    def _command(
        self, name: str, args: Mapping[str, Any] | None = None, *, timeout: float = 30.0
    ) -> Any:
        raise NotImplementedError

    # ---- faults ------------------------------------------------------------------------
    def inject(self, kind: str, *, count: int = 1, **params: Any) -> None:
        """Apply the fault ``kind`` to the next ``count`` embedding requests.

        See the module docstring and `Fault` for kinds and ``params``. Scripted faults
        run before random ones (`set_random_faults`).

        Raises:
            ValueError: unknown kind, bad count, or a parameter out of range.
            TypeError: a parameter the kind does not take.
        """
        _integer("count", count, minimum=1)
        fault = Fault.make(kind, **params)
        self._command("inject", {"fault": fault.to_dict(), "count": count})

    def inject_status(
        self,
        status: int,
        *,
        count: int = 1,
        message: str | None = None,
        retry_after: float | str | None = None,
        retry_after_ms: float | None = None,
    ) -> None:
        """Answer the next ``count`` embedding requests with ``status`` and SGLang's error
        body; ``retry_after`` (seconds or an HTTP date) and ``retry_after_ms`` set those
        headers."""
        self.inject(
            "status",
            count=count,
            status=status,
            message=message,
            retry_after=retry_after,
            retry_after_ms=retry_after_ms,
        )

    def inject_rate_limit(
        self,
        *,
        count: int = 1,
        retry_after: float | str | None = None,
        retry_after_ms: float | None = None,
    ) -> None:
        """429 Too Many Requests for the next ``count`` embedding requests."""
        self.inject_status(429, count=count, retry_after=retry_after, retry_after_ms=retry_after_ms)

    def inject_overloaded(self, *, count: int = 1, retry_after: float | str | None = None) -> None:
        """SGLang's overload answer, 503 "The request queue is full.", for the next
        ``count`` embedding requests."""
        self.inject_status(503, count=count, message=QUEUE_FULL_MESSAGE, retry_after=retry_after)

    def set_random_faults(
        self, rate: float, kinds: Sequence[FaultSpec] = SOAK_FAULTS, *, seed: int = 0
    ) -> None:
        """Give each embedding request (with no scripted fault pending) probability
        ``rate`` of one fault drawn uniformly from ``kinds``.

        The draws come from ``random.Random(seed)`` in arrival order, so a run with the
        same requests in the same order meets the same faults. ``kinds`` items are fault
        kinds, ``(kind, params)`` pairs or `Fault` objects; the default is `SOAK_FAULTS`.
        ``rate=0`` switches random faults off.

        Raises:
            ValueError: ``rate`` outside 0..1, empty ``kinds``, or a bad fault.
        """
        if not 0.0 <= _number("rate", rate) <= 1.0:
            raise ValueError(f"rate must be in 0..1, got {rate!r}")
        faults = [_as_fault(spec) for spec in kinds]
        if rate > 0.0 and not faults:
            raise ValueError("kinds must name at least one fault")
        self._command(
            "random_faults",
            {"rate": float(rate), "kinds": [f.to_dict() for f in faults], "seed": seed},
        )

    def clear_faults(self) -> None:
        """Drop pending scripted faults and switch random faults off."""
        self._command("clear_faults")

    def close_connections(self, *, idle_only: bool = False, reset: bool = False) -> int:
        """Close open client connections now (FIN, no answer), as a server sweeping idle
        keep-alive connections does; with ``idle_only`` spare those with a request in
        flight; with ``reset`` send RST instead of FIN. Returns how many connections were
        closed."""
        args = {"idle_only": idle_only, "reset": reset}
        return int(self._command("close_connections", args))

    # ---- rules: persistent, deterministic misbehaviour ----------------------------------
    def add_rule(self, kind: str, **params: Any) -> None:
        """Apply the rule ``kind`` to every embedding request from now until `clear_rules`
        (or `clear_faults`); see `Rule` for ``params``. Rules act before scripted and
        random faults. Token figures are `count_tokens` (``ceil(chars / 4)``).

        Kinds (each also has a method below): ``poison`` (`poison`), ``drop_over``
        (`drop_batches_over`), ``token_cap`` (`cap_batch_tokens`), ``context_length``
        (`limit_input_tokens`), ``base64_error`` (`fail_base64`), ``one_item_list``
        (`refuse_one_item_lists`), ``truncate`` (`truncate_inputs`), ``window``
        (`status_window`). A request is checked in the order window, truncate,
        drop_over, poison, token_cap, context_length, base64_error, one_item_list; the
        first that answers wins. Each application is counted in
        ``stats()["faults_applied"][kind]``.

        Raises:
            ValueError: unknown kind, a missing parameter, or one out of range.
            TypeError: a parameter the kind does not take.
        """
        rule = Rule.make(kind, **params)
        self._command("add_rule", {"rule": rule.to_dict()})

    def clear_rules(self) -> None:
        """Remove every rule (scripted and random faults stay)."""
        self._command("clear_rules")

    def poison(
        self,
        text: str,
        *,
        substring: bool = False,
        action: str = "status",
        status: int = 500,
        body: bytes | str | Mapping[str, Any] | None = None,
        message: str | None = None,
        literal: bool = False,
    ) -> None:
        """Make ``text`` poisonous: every request whose batch holds it (equal to it, or
        containing it with ``substring=True``) fails deterministically, whatever else the
        batch holds, until the rule is cleared.

        Args:
            text: the poisonous text.
            substring: match texts that contain ``text``.
            action: ``"status"``: answer ``status`` with ``body`` (default Ollama's
                ``{"error":"json: unsupported value: NaN"}``; with ``message`` and no
                ``body``, the dialect's error body); ``"nan"``: answer 200 with a NaN in
                each poisoned input's vector (``null`` in float JSON, ``NaN`` with
                ``literal=True``, NaN bits in base64); ``"close"`` / ``"reset"``: drop the
                connection without an answer.
            status: the status of ``action="status"`` (default 500).
        """
        self.add_rule(
            "poison",
            text=text,
            substring=substring,
            action=action,
            status=status,
            body=body,
            message=message,
            literal=literal,
        )

    def drop_batches_over(self, max_texts: int, *, action: str = "close") -> None:
        """Drop the connection without an answer (``"close"``: FIN; ``"reset"``: RST) for
        every request with more than ``max_texts`` texts, as a server that runs out of
        memory on big batches does; smaller batches are answered."""
        self.add_rule("drop_over", max_texts=max_texts, action=action)

    def cap_batch_tokens(
        self, max_tokens: int, *, message: str = TOKEN_CAP_MESSAGE, status: int = 400
    ) -> None:
        """Refuse every request whose texts hold more than ``max_tokens`` tokens in total
        (`count_tokens` each) with ``status`` and ``message`` in the dialect's error
        body. ``message`` is a template: ``{cap}`` -> ``max_tokens``, ``{n}`` -> the
        request's tokens; the default says "Too many tokens in batch. Max is 16384 got
        29000"; `TOKEN_CAP_MESSAGE_UNSTATED` states no number."""
        self.add_rule("token_cap", max_tokens=max_tokens, message=message, status=status)

    def limit_input_tokens(self, max_tokens: int, *, name_index: bool | None = None) -> None:
        """Refuse every request holding a text of more than ``max_tokens`` tokens with the
        dialect's context-length answer for the first such text (status and wording as
        the real server: SGLang/vLLM/Ollama/DashScope 400, TEI/SiliconFlow 413, Infinity
        422 with the index in ``loc``, llama.cpp 500). ``name_index=True`` adds
        ``(input index N)`` to wordings that have no index; ``None``: as the real server.
        (The constructor's ``max_input_tokens`` does the same from the start.)"""
        self.add_rule("context_length", max_tokens=max_tokens, name_index=name_index)

    def fail_base64(self, *, status: int = 500, message: str | None = None) -> None:
        """Answer ``status`` (default 500, the dialect's error body) to every request that
        asks ``encoding_format="base64"``; float requests are answered normally."""
        self.add_rule("base64_error", status=status, message=message)

    def refuse_one_item_lists(self, *, status: int = 500, message: str | None = None) -> None:
        """Answer ``status`` (default 500, the dialect's error body) to every request whose
        ``input`` is a list of one text, and embed the same text sent as a bare string
        (``"input": "text"``), as SGLang 0.4.6 does."""
        self.add_rule("one_item_list", status=status, message=message)

    def truncate_inputs(self, max_tokens: int) -> None:
        """Silently cut every text to its first ``max_tokens`` tokens (``4 * max_tokens``
        characters) before embedding it: the vector is that of the cut text and
        ``usage.prompt_tokens`` counts the cut texts, so a client comparing ``usage``
        with its own estimate can tell (a 6,000-token text reports 2,048 with
        ``max_tokens=2048``)."""
        self.add_rule("truncate", max_tokens=max_tokens)

    def status_window(
        self,
        seconds: float,
        *,
        status: int = 429,
        message: str | None = None,
        retry_after: float | str | None = None,
    ) -> None:
        """Answer every embedding request with ``status`` (default 429; 503 for an
        unavailable window) and the dialect's error body for the next ``seconds``
        seconds, on the serving process's clock, then answer normally again (the rule
        then ends by itself). No ``Retry-After`` unless ``retry_after`` is given."""
        self.add_rule(
            "window", seconds=seconds, status=status, message=message, retry_after=retry_after
        )

    # ---- waiting on the server, without sleeping ----------------------------------------
    def wait_for(
        self, counter: str, n: int, *, timeout: float = 10.0, at_most: bool = False
    ) -> int:
        """Block until the counter or gauge ``counter`` (``"requests"``,
        ``"received_count"``, ``"in_flight"``, ``"texts"``, ``"connections_opened"``,
        ``"connections_active"``; see `stats`) is at least ``n`` (``at_most=True``: at
        most ``n``), on a condition the server notifies: no polling, no sleep. Returns
        the value reached.

        Raises:
            TimeoutError: not reached within ``timeout`` seconds.
            ValueError: an unknown counter.
        """
        _number("timeout", timeout)
        args = {"counter": counter, "n": int(n), "timeout": timeout, "at_most": at_most}
        return int(self._command("wait", args, timeout=timeout + 30.0))

    def wait_for_requests(self, n: int, *, timeout: float = 10.0) -> int:
        """Block until ``n`` embedding requests have arrived since the last
        `reset_counters` (counted when a request starts, before its body is read):
        "the request has arrived", without sleeping. Returns the count. To wait until
        their inputs are in `received`, use ``wait_for("received_count", n)``.

        Raises:
            TimeoutError: fewer arrived within ``timeout`` seconds.
        """
        return self.wait_for("requests", n, timeout=timeout)

    def wait_for_in_flight(self, n: int, *, timeout: float = 10.0) -> int:
        """Block until at least ``n`` embedding requests are being answered at once (held
        by ``latency``, a ``delay`` fault or a server model). Returns the gauge.

        Raises:
            TimeoutError: not reached within ``timeout`` seconds.
        """
        return self.wait_for("in_flight", n, timeout=timeout)
