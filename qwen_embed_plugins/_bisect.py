"""Failures one input may cause: ``Bisector``, the flows that find the failing input(s)
of a batch, built by ``_engine.Engine`` with the flows it recurses into.

A batch that fails in a way one input can cause (500, a connection dropped after the
request was sent, a context-length refusal), or that the server refused whatever its
wording (a 4xx, an answer that does not fit it: ``_retry.refusal``, once a control
request shows the server working), is split and the halves resent until the failing
input(s) are isolated (``bisect``); a refused batch whose every piece then goes through
teaches the replica's cap (``_learn.learn_refused_size``); a 400 naming its input fails
that one and sends the others (``without``). A single text is blamed only when it fails again after
the server was seen working (``once_more``: a control request shows it, ``control``; a
control that fails too is an outage, waited out until the deadline). A batch whose every
half succeeds failed for its size: the replica's batch limit is learned
(``_learn.learn_inferred_limit``). What reaches the caller (``input_failed``):
``on_error="raise"`` raises the first bad input's error (the lowest index), ``"skip"``
leaves ``None`` in its slot and reports the error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ._balance import Endpoint, Replica
from ._config import EmbeddingConfig
from ._learn import (
    Stripped,
    kept_stripped,
    learn_cap,
    learn_inferred_limit,
    learn_refused_size,
    profile,
    strip_fields,
    try_bare,
    undo_stripped,
    wire,
)
from ._retry import RetryState, ambiguous, input_error, refusal
from ._run import Call, Flow, Part, Sleep
from ._server_text import context_refusal, stated_limit
from .errors import (
    BadRequestError,
    ContextLengthError,
    HTTPStatusError,
    NetworkError,
    QwenEmbedError,
    ResponseError,
    TransportError,
)

__all__ = ["Bisection", "Bisector", "input_failed"]

_log = logging.getLogger("qwen_embed_plugins")

_CONTROL_TEXT = "hello"  # a control request's input: any server embeds it
_CONTROL_WAIT_MAX = 1.0  # seconds: the longest wait between control requests in an outage
_CONTROL_NOTE = (
    " (a control request with a known-good text failed too ({}): the server fails "
    "whatever the input)"
)
_UNPROVEN_NOTE = (
    " (max_retries={} leaves no request for a control: nothing shows the server working "
    "since, so no input is blamed)"
)


@dataclass
class Bisection:
    """What the pieces of one bisected batch have shown so far."""

    since: float  # monotonic time the bisected batch failed
    ok: int = 0
    max_ok: int = 0
    ok_on: dict[Replica, int] = field(default_factory=dict)  # replica -> largest piece
    failed_leaves: int = 0
    input_failed: bool = False


class BatchFlow(Protocol):
    """``Engine.batch_flow``: one batch to its ``Part``."""

    def __call__(
        self,
        call: Call,
        texts: Sequence[str],
        indices: Sequence[int],
        bis: Bisection | None = None,
    ) -> Flow: ...


class RequestFlow(Protocol):
    """``Engine.request_flow``: one batch sent until it is answered."""

    def __call__(
        self,
        call: Call,
        texts: Sequence[str],
        indices: Sequence[int],
        *,
        bisectable: bool,
        bisecting: bool = False,
        control: bool = False,
        bare: bool = False,
        pin: Replica | None = None,
    ) -> Flow: ...


class Bisector:
    """The flows that isolate the failing input(s) of a batch (see the module
    docstring), for one engine: they send their pieces through ``batch_flow`` and
    ``request_flow``, on ``endpoint``'s replicas, for ``model``, with ``config``."""

    def __init__(
        self,
        batch_flow: BatchFlow,
        request_flow: RequestFlow,
        endpoint: Endpoint,
        model: str,
        config: EmbeddingConfig,
    ) -> None:
        self.batch_flow = batch_flow
        self.request_flow = request_flow
        self.endpoint = endpoint
        self.model = model
        self.config = config
        self.retry = config.retry

    def bisect(
        self,
        call: Call,
        texts: Sequence[str],
        indices: Sequence[int],
        first: QwenEmbedError,
        bis: Bisection | None,
    ) -> Flow:
        """``texts`` failed with ``first``, which one input may cause: each half sent
        again (``batch_flow``, which bisects further), their ``Part`` merged."""
        top = bis is None
        if bis is None:
            bis = Bisection(since=time.monotonic())
            replica = self.endpoint.replica_of(first)
            if replica is not None:
                replica.metrics.fallback("bisections")
        part = Part()
        mid = len(texts) // 2
        for start, stop in ((0, mid), (mid, len(texts))):
            sub = yield from self.batch_flow(call, texts[start:stop], indices[start:stop], bis)
            part.merge(sub, start)
            if call.stop and call.lowest is not None and indices[0] > call.lowest:
                break  # raising anyway, for a lower index than any here
        if (
            top
            and isinstance(first, NetworkError)
            and not bis.input_failed
            and bis.max_ok
            and not call.stop
        ):
            # Every piece went through: the batch failed for its size (a server that
            # drops requests above some size, e.g. out of memory). Learn the limit, for
            # the replica that dropped it and only from pieces that same replica took
            # (pieces another replica answered say nothing about this one's size).
            replica = self.endpoint.replica_of(first)
            took = bis.ok_on.get(replica, 0) if replica is not None else 0
            if replica is not None and took:
                batch = replica.state(self.model).batch
                learn_inferred_limit(batch, replica, took, len(texts), first)
        elif (
            top
            and isinstance(first, HTTPStatusError)
            and refusal(first)
            and not bis.input_failed
            and bis.max_ok
            and not call.stop
        ):
            # Refused whole (a 4xx), taken in pieces (a limit the server did not state):
            # a refusal is no spell, so the largest piece is the replica's cap at once.
            replica = self.endpoint.replica_of(first)
            took = bis.ok_on.get(replica, 0) if replica is not None else bis.max_ok
            for target in [replica] if replica is not None else self.endpoint.replicas:
                if took:
                    learn_refused_size(target.state(self.model).batch, target, took, len(texts))
        return part

    def without(
        self,
        call: Call,
        texts: Sequence[str],
        indices: Sequence[int],
        named: int,
        exc: QwenEmbedError,
        bis: Bisection | None,
    ) -> Flow:
        """The server named the bad input: fail it, send the others."""
        part = Part()
        if isinstance(exc, BadRequestError):
            index = indices[named]
            exc = exc.with_context(index=index, note=f" [input index {index} of this call]")
        input_failed(call, part, named, indices[named], exc, bis)
        if call.stop:
            return part
        for start, stop in ((0, named), (named + 1, len(texts))):
            if start < stop:
                sub = yield from self.batch_flow(call, texts[start:stop], indices[start:stop], bis)
                part.merge(sub, start)
        return part

    def once_more(
        self,
        call: Call,
        texts: Sequence[str],
        indices: Sequence[int],
        exc: QwenEmbedError,
        since: float,
    ) -> Flow:
        """A single text failed in a way the server may have caused whatever the input
        (``exc``: a 500, a 424, a dropped connection, a 400 naming no input). Unless the
        server has been seen to work since, a control request waits for it to work
        (``control``); then the text is sent once more. Returns ``request_flow``'s
        result when it goes through; raises what it failed with the second time (the
        input's fault: the server worked just before)."""
        if call.last_ok < since:
            yield from self.control(call, indices[0], exc)
        replica = self.endpoint.replica_of(exc)
        if replica is not None:
            replica.metrics.fallback("resent_alone")
        return (
            yield from self.request_flow(call, texts, indices, bisectable=False, bisecting=True)
        )

    def _unproven(self, call: Call, exc: QwenEmbedError) -> QwenEmbedError:
        """``exc`` of a single text as the call's error, no input blamed: an explicit
        ``max_retries`` leaves no request for a control, and nothing shows the server
        working since the text was sent (a server failing everything would otherwise
        have every input blamed, or skipped)."""
        error = exc.with_context(note=_UNPROVEN_NOTE.format(self.retry.max_retries), index=None)
        call.stop = True
        call.server_errors.add(error)
        return error

    def _left(self, exc: QwenEmbedError) -> int | None:
        """Requests an explicit ``max_retries`` leaves a single text after the ones
        ``exc`` ended (``None``: no such bound)."""
        bound = self.retry.max_retries
        return None if bound is None else max(0, bound + 1 - (exc.attempts or 1))

    def _resend(
        self,
        call: Call,
        texts: Sequence[str],
        indices: Sequence[int],
        bis: Bisection | None,
        *,
        bare: bool,
    ) -> Flow:
        """A single refused text, the server seen working, sent once more: as a bare
        string (``bare``: refused as a one-item list), or with the options a control
        request just taught. ``request_flow``'s result (a bare string learned for the
        replica), or that text's failed ``Part`` (final)."""
        try:
            return (
                yield from self.request_flow(
                    call, texts, indices, bisectable=False, bisecting=True, bare=bare
                )
            )
        except QwenEmbedError as again:
            if again in call.server_errors or not input_error(again):
                raise
            return input_failed(call, Part(), 0, indices[0], again, bis)

    def control(self, call: Call, index: int, exc: QwenEmbedError) -> Flow:
        """Before blaming input ``index`` for ``exc`` (an answer that could be the
        server's as well as the input's) with no success since it was sent: send a
        known-good text with the same options, to the replica that refused (a refusal;
        any replica otherwise). It succeeds -> returns ``False`` (the input may be the
        cause), or ``True`` when a refusal's replica was taught other options meanwhile
        (by another request: the caller resends the same texts with them). Refused too
        (a 4xx, in any words) while the client adds fields of its own
        (``encoding_format=base64``, ``dimensions``): sent once more without them
        (``strip_fields``; both out and it succeeds: once more with base64 back,
        ``_which``); it succeeds -> learned for the replica, returns ``True`` (the
        fields were the cause: the caller resends the same texts). It fails
        -> the server is down whatever the input: an outage, retried with backoff until
        the call's deadline; then (or at once, for a failure that is not retryable)
        ``exc`` is raised without an input index, in both ``on_error`` modes. The
        replica is then down: one request at a time probes it (``Replica.went_down``),
        so the control's retries wait for the probe's verdict."""
        replica = self.endpoint.replica_of(exc)
        if replica is not None:
            replica.metrics.fallback("control_requests")
        rs = RetryState(policy=self.retry, started=call.started, deadline=call.deadline)
        stripped: tuple[Replica, Stripped] | None = None
        tried_without = False
        # a refusal is the refusing replica's to check (another may take what it refuses)
        pin = replica if refusal(exc) else None
        options = self._options(replica)  # another flow may teach the replica meanwhile
        while True:
            try:
                found = yield from self._control_request(
                    call, index, stripped[0] if stripped is not None else pin
                )
            except QwenEmbedError as control:
                failed = control
            else:
                call.last_ok = time.monotonic()
                call.ok_on.add(found[3].label)  # (rows, norms, bad, replica, ...)
                if stripped is not None:
                    kept = yield from self._which(call, index, *stripped)
                    kept_stripped(stripped[0].state(self.model), stripped[0], kept)
                    return True
                # taught other options meanwhile: the failure may be the old options'
                return refusal(exc) and self._options(replica) != options
            if stripped is not None:  # refused without the fields too: not their fault
                undo_stripped(stripped[0].state(self.model), stripped[1])
                stripped = None
            elif not tried_without and isinstance(failed, HTTPStatusError) and refusal(failed):
                tried_without = True
                stripped = self._strip(self.endpoint.replica_of(failed) or replica)
                if stripped is not None:
                    continue  # the same control without the client's own fields
            if failed in call.server_errors:
                break  # fails fast (a server never reached), or failed already
            if self.retry.max_retries is not None:
                break  # an explicit bound: the control's own attempts were all it gets
            delay = rs.next_delay(failed, now=time.monotonic(), fresh_connection=True, outage=True)
            if delay is None:
                break
            delay = min(delay, _CONTROL_WAIT_MAX)  # a tiny probe: the job resumes soon after
            where = self.endpoint.replica_of(failed) or replica
            if where is None:
                yield Sleep(delay)
                continue
            if len(self.endpoint.replicas) > 1:
                where.retried(failed, delay, bound=rs.bound())
                yield Sleep(delay)
                continue
            # fails whatever the input: down, its probe paces the retries
            where.went_down(failed.with_context(note=_CONTROL_NOTE.format(type(failed).__name__)))
            where.retried(failed, 0.0, bound=rs.bound())
        if failed is not exc and failed in call.server_errors:
            raise failed
        note = _CONTROL_NOTE.format(type(failed).__name__)
        error = exc if note in str(exc) else exc.with_context(note=note)
        call.stop = True
        call.server_errors.add(error)
        raise error

    def _control_request(self, call: Call, index: int, pin: Replica | None) -> Flow:
        """One control request (the known-good text, for input ``index``), first to
        ``pin`` when given: ``request_flow``'s result."""
        return self.request_flow(
            call, [_CONTROL_TEXT], [index], bisectable=False, bisecting=True, control=True, pin=pin
        )

    def _which(self, call: Call, index: int, where: Replica, fields: Stripped) -> Flow:
        """A control went through on ``where`` without base64 and ``dimensions`` both:
        one more with base64 back tells whether ``dimensions`` alone was refused. The
        ``Stripped`` to keep (``dimensions`` alone when that one goes through)."""
        if not fields.base64 or fields.dims is None:
            return fields
        state = where.state(self.model)
        state.base64_ok = fields.before[0]  # base64 again, still no dimensions
        try:
            yield from self._control_request(call, index, where)
        except QwenEmbedError:
            state.base64_ok = False
            return fields
        return Stripped(False, fields.dims, fields.before)

    def _unchecked(self, call: Call, exc: QwenEmbedError) -> bool:
        """Nothing shows the replica that refused (``exc``) working in this call: no
        request of the call succeeded on it (any replica, when it is not known)."""
        replica = self.endpoint.replica_of(exc)
        if replica is None:
            return call.last_ok == float("-inf")
        return replica.label not in call.ok_on

    def _options(self, replica: Replica | None) -> tuple[str, int | None] | None:
        """The ``encoding_format`` and ``dimensions`` ``replica`` is sent now."""
        if replica is None:
            return None
        state = replica.state(self.model)
        return wire(self.config, self.model, state, profile(state, replica.url))

    def _strip(self, replica: Replica | None) -> tuple[Replica, Stripped] | None:
        """Leave the fields the client adds out of ``replica``'s requests, on trial
        (``strip_fields``); ``None`` when it sends none."""
        if replica is None:
            return None
        fields = strip_fields(self.config, self.model, replica.state(self.model), replica.url)
        return None if fields is None else (replica, fields)

    def refused(
        self,
        call: Call,
        texts: Sequence[str],
        indices: Sequence[int],
        exc: QwenEmbedError,
        bis: Bisection | None,
    ) -> Flow:
        """The server refused a batch of several texts (``exc``: a 4xx, or an answer
        that does not fit the batch: ``refusal``), whatever its wording. A limit it
        states below what was sent (``stated_limit``: texts, tokens, bytes, characters)
        is learned for the replica and the same texts sent again within it; otherwise,
        once a control request shows the server working (``control``; a
        control refused too fails the call with the server's message), the batch is
        bisected until the refused texts stand alone (``bisect``)."""
        # the server's own words only (never this library's message about its answer)
        said = (
            exc.message
            if isinstance(exc, HTTPStatusError)
            else (exc.server_message or "")
            if isinstance(exc, ResponseError)
            else ""
        )
        stated = stated_limit(said)
        if stated is not None and stated.unit == "texts" and stated.value >= len(texts):
            stated = None  # not this batch's count: the number is about something else
        if stated is not None and not stated.per_input:
            replica = self.endpoint.replica_of(exc)
            split = False
            for target in [replica] if replica is not None else self.endpoint.replicas:
                batch = target.state(self.model).batch
                split |= learn_cap(batch, target, stated.unit, stated.value, texts)
            if split:  # the replica's cap now splits the texts (``_batching.Split``)
                return (yield from self.batch_flow(call, texts, indices, bis))
        if self._unchecked(call, exc) and (yield from self.control(call, indices[0], exc)):
            # refused for the fields the client adds: the same texts, without them
            return (yield from self.batch_flow(call, texts, indices, bis))
        return (yield from self.bisect(call, texts, indices, exc, bis))

    def single_failed(
        self,
        call: Call,
        texts: Sequence[str],
        indices: Sequence[int],
        exc: QwenEmbedError,
        bis: Bisection | None,
        since: float,
    ) -> Flow:
        """A batch that cannot be bisected failed with ``exc``: re-raised unless it is a
        single text's error; that text's failed ``Part``, or (an error the server may
        have caused whatever the input: ``once_more``; a refused one-item list taken as
        a bare string) ``request_flow``'s result. An explicit ``max_retries`` bounds the
        text's requests, control and bare-string form included (``_left``)."""
        if len(texts) != 1 or not input_error(exc):
            raise exc
        left = self._left(exc)
        if isinstance(exc, HTTPStatusError) and refusal(exc):
            # a 4xx (its bare-string form refused too, when tried): final. A refusal
            # naming nothing with nothing succeeded in this call: a control request first
            # (refused too: the server's message, no index), then the bare string
            # (``request_flow`` tried it at once otherwise); never sent again.
            if ambiguous(exc) and self._unchecked(call, exc) and left == 0:
                raise self._unproven(call, exc)
            if ambiguous(exc) and self._unchecked(call, exc) and left != 0:
                if bis is not None:
                    bis.input_failed = True
                replica = self.endpoint.replica_of(exc)
                state = replica.state(self.model) if replica is not None else None
                untried = state is not None and state.bare_input is None
                if (yield from self.control(call, indices[0], exc)):
                    # refused for the fields the client adds: the text, without them
                    return (yield from self._resend(call, texts, indices, bis, bare=False))
                if (
                    untried
                    and state is not None
                    and (left is None or left > 1)
                    and try_bare(exc, texts, state, False)
                ):
                    return (yield from self._resend(call, texts, indices, bis, bare=True))
            return input_failed(call, Part(), 0, indices[0], exc, bis)
        if not ambiguous(exc):
            return input_failed(call, Part(), 0, indices[0], exc, bis)
        if bis is not None:
            bis.input_failed = True  # not a batch that failed for its size
        if left is not None and left < 2:  # no room for a control request and a resend
            if call.last_ok < since:  # nothing shows the server working since
                if left == 0:
                    raise self._unproven(call, exc)
                yield from self.control(call, indices[0], exc)  # fails: the server's error
            return input_failed(call, Part(), 0, indices[0], exc, bis)
        try:
            return (yield from self.once_more(call, texts, indices, exc, since))
        except QwenEmbedError as again:
            if again in call.server_errors or not input_error(again):
                raise
            return input_failed(call, Part(), 0, indices[0], again, bis)


def input_failed(
    call: Call,
    part: Part,
    offset: int,
    index: int,
    exc: QwenEmbedError,
    bis: Bisection | None,
) -> Part:
    """Input ``index`` cannot be embedded: raise (``"raise"``) or record it."""
    if bis is not None:
        bis.failed_leaves += 1
        bis.input_failed = True
    exc = _pinned(exc, index)
    if call.on_error == "raise":
        call.stop = True
        call.lowest = index if call.lowest is None else min(call.lowest, index)
        raise exc
    call.failures[index] = exc
    part.failed[offset] = exc
    _log.warning("skipping input index %d: %s", index, exc)
    return part


def _pinned(exc: QwenEmbedError, index: int) -> QwenEmbedError:
    """``exc`` with the caller's input index (said in its message once): a new error, or
    ``exc`` when it has both already; a ``ContextLengthError`` (of the same status and
    fields) when the server's message says the input is over the model's context in any
    wording (``context_refusal``: llama-box's 400 and 500 among them; a per-input limit
    it states: ``stated_limit``)."""
    said = exc.message if isinstance(exc, HTTPStatusError) else ""
    stated = stated_limit(said)
    if (
        isinstance(exc, HTTPStatusError)
        and not isinstance(exc, ContextLengthError)
        and (context_refusal(said) or (stated is not None and stated.per_input))
    ):
        typed = ContextLengthError(str(exc), status=exc.status, server_message=exc.message)
        typed.__dict__.update(vars(exc))
        typed.__cause__, typed.__context__ = exc.__cause__, exc.__context__
        exc = typed.with_traceback(exc.__traceback__)
    note = (
        f" [input index {index} of this call]"
        if isinstance(exc, HTTPStatusError | ResponseError | TransportError)
        and "input index" not in str(exc)
        else ""
    )
    if exc.index is None:
        return exc.with_context(note=note, index=index)
    return exc.with_context(note=note) if note else exc
