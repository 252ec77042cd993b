"""The I/O-free call engine: every decision of an embedding call, written once.

An embedding call is planned (``batching.plan_batches``), then each batch runs as a
*flow*: a generator that yields operations — ``Send`` (perform this HTTP exchange on
this replica) and ``Sleep`` (wait this long) — and receives their results. The sync
client runs flows with blocking I/O (``run_sync``), the async client with awaits
(``run_async``); nothing else differs between them (as httpx's ``BaseClient`` and
tenacity's ``BaseRetrying.iter`` share their logic).

A batch flow decides:

- which replica gets the request (``balance``), and resends a failed request at once on
  another replica;
- retries (``retry``: outages until the call's deadline, other failures
  ``max_attempts`` times, stale keep-alive and refused HTTP/2 streams at once; an
  explicit ``max_retries`` bounds them all; retries to a replica that is up within its
  budget); a replica that is down takes one request at a time, its probe, and every
  other request waits for the probe's verdict (``Endpoint.wait_probe``); a
  connection failure while no replica has ever answered only within
  ``RetryConfig.wait_for_server`` (a wrong URL fails fast, naming it);
- adaptations learned per replica (each logged once): base64 -> float (on a refusal
  of it or of the field, or a 5xx a float retry does not reproduce), client-side
  ``dimensions``, a limit stated in a refusal in any wording (texts, tokens, bytes,
  characters: ``_server_text.stated_limit``), a bare string ``input`` for a server
  refusing one-item lists, a missing ``/v1`` prefix (Infinity), h2c -> HTTP/1.1;
- bisection: a batch that fails in a way one input can cause (500, a connection
  dropped after the request was sent, a context-length refusal), or that the server
  refused whatever its wording (any 4xx but the endpoint's own, an answer that does
  not fit it: ``_refused``, once a control request shows the server working), is split
  and the halves resent until the failing input(s) are isolated; every other text is
  embedded, and the error names the caller's index. A single text's 500 or dropped
  connection is blamed only when it fails again after the server was seen working (a
  control request shows it; a control that fails too is an outage, waited out until
  the deadline); its 4xx is final once its bare-string form is refused too. A batch
  whose every half succeeds failed for its size: the replica's batch limit is learned;
- what reaches the caller: ``on_error="raise"`` raises the first bad input's error
  (the lowest index), ``"skip"`` leaves ``None`` in its slot and reports the error.

``Engine`` holds a client's state and sequences the flows; the decisions are plain
functions and classes of their own modules, called with what they need: batch sizes
and limits (``_batching``), what is learned about a replica (``_learn``), the requests
and their error replies (``_requests``), bisection (``_bisect``), retries (``_retry``),
replica choice and health (``_balance``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _batching as batching
from . import _learn as learn
from . import _pool as pool
from . import _servers as servers
from ._balance import Endpoint, Replica, endpoint_for
from ._bisect import Bisection, Bisector, input_failed
from ._config import EmbeddingConfig, OnError, RetryConfig, insecure_key_target
from ._learn import ReplicaState
from ._protocol import bad_rows, decode_rows, parse_body, size_errors
from ._requests import Requests
from ._retry import (
    RetryState,
    ambiguous,
    classify,
    is_health_failure,
    maybe_input,
    named_position,
    refusal,
    replica_suspect,
)
from ._run import Call, Flow, Hold, Part, Send, Sleep
from ._tracing import RequestTrace
from ._transport import Reply, Request
from .errors import (
    BadRequestError,
    BatchTooLargeError,
    ConfigError,
    HTTPStatusError,
    NetworkError,
    QwenEmbedError,
    ResponseError,
    ServerError,
    TimeoutException,
    TransportError,
)

__all__ = ["Engine"]

_log = logging.getLogger("qwen_embed_plugins")


@dataclass(slots=True)
class _Retry:
    """What the attempts of one ``request_flow`` have tried and learned so far."""

    policy: RetryConfig
    started: float  # the call's, monotonic
    deadline: float | None  # the call's, in seconds
    multi: bool  # the endpoint has more than one replica
    avoid: Replica | None = None  # the replica an outage just failed on
    failed_on: dict[Replica, QwenEmbedError] = field(default_factory=dict)  # maybe theirs
    control: bool = False  # a control request: its one-item list teaches nothing
    pin: Replica | None = None  # a float or bare-string trial goes to the same replica
    force_float: bool = False
    tried_float: bool = False
    tried_bare: bool = False
    bare_now: bool = False
    moved_prefix: bool = False
    relearned: bool = False  # resent once with options another request taught meanwhile
    previous: QwenEmbedError | None = None  # the last attempt's error
    attempt: int = 0  # of the current request (options changed: counted from 1 again)
    _rs: RetryState | None = None

    @property
    def rs(self) -> RetryState:
        """The retries' state, built at the first failure (a batch answered at once
        needs none)."""
        rs = self._rs
        if rs is None:
            rs = self._rs = RetryState(
                policy=self.policy, started=self.started, deadline=self.deadline
            )
        return rs


@dataclass(slots=True)
class _Attempt:
    """One request of a batch: where it went, with which options, and how it went."""

    replica: Replica
    state: ReplicaState
    profile: servers.ServerProfile
    retest: bool  # the batch is above the replica's inferred limit, to retest it
    fmt: str
    dims: int | None
    bare: bool
    request: Request
    sent: bool = False
    started: float = 0.0  # perf_counter() when sent
    answered: float = 0.0  # perf_counter() when the reply arrived (0.0: none)
    outcome: str = "cancelled"  # for the metrics: "ok", "rejected" or the error's type
    status: int | None = None
    fresh: bool = True  # on a connection opened for it
    error: QwenEmbedError | None = None
    span: RequestTrace | None = None  # its OpenTelemetry span, when the call is traced

    def failed(self, error: QwenEmbedError, outcome: str, fresh: bool) -> None:
        self.error, self.outcome, self.fresh = error, outcome, fresh


# --------------------------------------------------------------------------- the engine


class Engine:
    """The decisions of one client's calls (one per client; replicas are shared)."""

    def __init__(self, config: EmbeddingConfig) -> None:
        self.config = config
        self.model: str = config.model or ""
        self.endpoint: Endpoint = endpoint_for(config)
        self.requests = Requests(config, self.model)
        self.fixed = None if config.server == "auto" else servers.get_profile(str(config.server))
        self._insecure_warned = False
        self.bisector = Bisector(
            self.batch_flow, self.request_flow, self.endpoint, self.model, config
        )

    # ---------------------------------------------------------------- per replica

    def profile(self, replica: Replica, state: ReplicaState) -> servers.ServerProfile:
        """The server profile of ``replica``: the ``server=`` setting, else what was
        learned about it (``learn.profile``)."""
        return self.fixed if self.fixed is not None else learn.profile(state, replica.url)

    def detection(self) -> servers.Detection | None:
        """The profile of the first replica and how it was found (``None``: not yet)."""
        replica = self.endpoint.replicas[0]
        state = replica.state(self.model)
        if self.fixed is not None:
            return servers.Detection(self.fixed, "server= setting", state.url_override)
        profile = self.profile(replica, state)
        if state.profile is None:
            return None
        return servers.Detection(profile, state.source, state.url_override)

    def batch_limits(self) -> tuple[int | None, int | None]:
        """The (texts, tokens) per request a plan can respect up front: the most capable
        replica's known limits (server profiles, learned limits; ``plan_limits``)."""
        known = []
        for replica in self.endpoint.replicas:
            state = replica.state(self.model)
            known.append((state.batch, self.profile(replica, state).batch_limit))
        return batching.plan_limits(known, self.config.max_batch_tokens)

    def auto_batch_size(self, remaining: int, window: int) -> int:
        """The texts to put in the next batch of a ``batch_size="auto"`` call with
        ``remaining`` texts left and up to ``window`` batches in flight, from every
        replica's sizer (``batching.auto_batch_size``)."""
        sizers = [replica.state(self.model).batch.sizer for replica in self.endpoint.replicas]
        return batching.auto_batch_size(sizers, remaining, window, self.batch_limits)

    def new_call(self, *, query: bool, on_error: OnError = "raise") -> Call:
        """Start a call: fails fast (``CircuitOpenError``) while the endpoint is down."""
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.endpoint.check_open()
        retry = self.config.retry
        deadline = retry.query_deadline if query else retry.deadline
        if not self._insecure_warned and self.config.api_key is not None:  # or a callable
            self._warn_insecure()
        return Call(started=time.monotonic(), deadline=deadline, on_error=on_error)

    def _warn_insecure(self) -> None:
        self._insecure_warned = True
        if self.config.insecure_key != "warn":
            return
        for replica in self.endpoint.replicas:
            state = replica.state(self.model)
            if insecure_key_target(replica.url) and "insecure" not in state.warned:
                state.warned.add("insecure")
                _log.warning(
                    "the API key goes over plain HTTP to %s, which is not a loopback "
                    "address: anyone on the path can read it (use https://, or "
                    "insecure_key='error' to refuse)",
                    replica.label,
                )

    def _unreachable(self, error: QwenEmbedError, call: Call) -> QwenEmbedError:
        """``error``, or (when no request reached the endpoint) a new error saying so and
        how to check it, which ends the call."""
        said = self.endpoint.unreached(error, call.started, self.config.retry.wait_for_server)
        if said is None:
            return error
        call.stop = True
        call.server_errors.add(said)
        return said

    # ---------------------------------------------------------------- flows

    def request_flow(
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
    ) -> Flow:
        """Send one batch until it is answered, with retries (within a bisection, a
        failure one input may cause is not retried: its batch already showed it twice;
        a ``control`` request that is refused (a 4xx) is not tried in other forms: the
        server refuses whatever the input; ``bare``: a single text sent as a bare string
        first, its one-item list refused; ``pin``: the replica of the first attempt);
        returns
        ``(rows n x dim, squared norms, bad rows, replica, state, dimensions sent)``.

        Each attempt: the replica and its limits (``_attempt``: raises
        ``batching.Split`` for a batch above them), the exchange and what its reply says
        (``_interpret``), then for a failure what it teaches (``_learn_failure``),
        whether other options (``_new_options``) or another trial on the same replica
        (``_same_replica_trial``) may help, and else the next step (``_next_step``):
        resend, back off, bisect or fail."""
        run = _Retry(
            self.config.retry, call.started, call.deadline, len(self.endpoint.replicas) > 1
        )
        run.control, run.tried_bare, run.bare_now = control, bare, bare
        run.pin = pin
        retrying: tuple[Replica, QwenEmbedError, float] | None = None  # counted once made
        while True:
            run.attempt += 1
            replica = run.pin if run.pin is not None else self._choose(run)
            run.pin = None
            probe = False  # chosen as the probe of an ejected replica
            now: _Attempt | None = None
            held = False  # this request probes the replica, down (its gate held)
            try:
                if self.endpoint.must_wait(replica):  # one request probes it, others wait
                    replica, held = yield from self.endpoint.wait_probe(
                        replica,
                        call.remaining,
                        self.config.retry,
                        self._outlasted(run, call),
                        Hold,
                        Sleep,
                    )
                probe = replica.probing
                now = self._attempt(run, replica, call, texts)
                if retrying is not None:
                    failed_on, why, waited = retrying
                    failed_on.retried(why, waited, bound=run.rs.bound())
                    retrying = None
                replica.begin()
                replica.metrics.request_started()
                now.started, now.sent = time.perf_counter(), True
                if call.trace is not None:
                    now.span = call.trace.request(now.request.url, now.fmt, len(texts), run.attempt)
                if run._rs is None:
                    replica.retries.seen()  # a first attempt: earns retries (``Budget``)
                try:
                    reply: Reply = yield Send(replica, now.request)
                except QwenEmbedError as exc:
                    now.failed(exc, type(exc).__name__, bool(getattr(exc, "fresh", True)))
                else:
                    decoded = self._interpret(now, reply, indices)
                    if decoded is not None:
                        return self._succeeded(run, now, reply, texts, indices, *decoded)
                if now.error is not None:
                    replica.alive(now.error)  # the probe's verdict, before the next one
            finally:
                if now is not None and now.sent:
                    self._account(now, len(texts), run.attempt)
                if probe:
                    replica.probing = False  # sent or not: another request may probe it
                if held:
                    replica.probed()
                    replica.release_gate()
            error = now.error
            if error is None:  # cannot happen
                raise RuntimeError("internal error: error is None")
            self.endpoint.failed(replica, error)
            if classify(error) == "outage" or is_health_failure(error):
                replica.went_down(error)  # whatever the request: probed, one at a time
            elif (
                not run.multi
                and run._rs is None
                and not bisecting
                and maybe_input(error)
                and replica_suspect(error)
            ):
                replica.suspect(error)  # a request's first failure; several in a row: down
            error = run.previous = _cause(error, run.previous, call)
            self._learn_failure(run, now, error)
            if self._new_options(run, now, error) or (
                not (control and refusal(error))
                and self._same_replica_trial(run, now, error, texts, call)
            ):
                continue
            delay = self._next_step(run, now, error, call, bisectable or bisecting, bisecting)
            retrying = (replica, error, delay)
            if delay > 0:
                yield Sleep(delay)

    # ------------------------------------------------ request_flow's decisions

    def _outlasted(self, run: _Retry, call: Call) -> Callable[[Replica], QwenEmbedError]:
        """``Endpoint.wait_probe``'s error for a call whose deadline passed."""
        return lambda replica: self._outage_outlasted(run, replica, call)

    def _outage_outlasted(self, run: _Retry, replica: Replica, call: Call) -> QwenEmbedError:
        """The error that ends a call whose deadline passed while ``replica`` was down:
        the failure that put it down (else this request's last one), saying so."""
        error = replica.down_error or run.previous
        if error is None:  # cannot happen: a replica goes down with its error
            raise RuntimeError("internal error: a replica down without an error")
        error = error.with_context(
            replica=replica.label,
            attempts=run.attempt - 1,
            note=f" (gave up: the call's deadline of {call.deadline:g} s is spent while "
            f"{replica.label} is down)",
        )
        if run.multi:  # what every replica last failed with, as ``_next_step`` says
            error = self.endpoint.name_failures(error)
        call.stop = True
        call.server_errors.add(error)
        return error

    def _choose(self, run: _Retry) -> Replica:
        """The replica for the next attempt: not one this batch failed on (nor the one an
        outage just avoided) while another is available (``Endpoint.choose``)."""
        failed_on = run.failed_on
        return self.endpoint.choose(list(failed_on) if failed_on else run.avoid)

    def _attempt(self, run: _Retry, replica: Replica, call: Call, texts: Sequence[str]) -> _Attempt:
        """The next attempt on ``replica``: its limits (``batching.check_limits``), the
        options it takes (``learn.wire``, base64 -> float and bare-string trials) and the
        request."""
        state = replica.state(self.model)
        profile = self.profile(replica, state)
        retest = batching.check_limits(
            state.batch, profile.batch_limit, self.config.max_batch_tokens, texts
        )
        fmt, dims = learn.wire(self.config, self.model, state, profile)
        if run.force_float:
            fmt = "float"
        bare = run.bare_now or (len(texts) == 1 and state.bare_input is True)
        run.bare_now = False
        request = self.requests.embeddings(replica, state, texts, fmt, dims, call, bare)
        return _Attempt(replica, state, profile, retest, fmt, dims, bare, request)

    def _interpret(
        self, now: _Attempt, reply: Reply, indices: Sequence[int]
    ) -> tuple[Any, Any, object] | None:
        """What ``reply`` says: ``(rows, squared norms, payload)`` for a good answer;
        ``None`` with the error recorded on ``now`` for a status or body that fails."""
        now.answered = time.perf_counter()  # before decoding: the server's time
        now.fresh = reply.fresh
        now.status = reply.status
        replica, state = now.replica, now.state
        replica.answered = True
        if reply.status >= 300:
            error = self.requests.status_error(reply, replica, now.profile)
            now.failed(error, type(error).__name__, reply.fresh)
            return None
        try:
            payload = parse_body(reply.body)
            if self.fixed is None and (state.profile is None or state.profile is servers.GENERIC):
                learn.identify(state, reply.headers, payload)
            rows, sq = decode_rows(payload, indices)
        except ResponseError as exc:
            # its message may quote the body: the new error's is built without the key
            error = exc.with_context(url=exc.url or replica.label, secrets=self.requests.secrets)
            now.failed(error, "rejected", reply.fresh)
            return None
        now.outcome = "ok"
        return rows, sq, payload

    def _succeeded(
        self,
        run: _Retry,
        now: _Attempt,
        reply: Reply,
        texts: Sequence[str],
        indices: Sequence[int],
        rows: Any,
        sq: Any,
        payload: object,
    ) -> tuple[Any, Any, dict[int, str], Replica, ReplicaState, int | None]:
        """Learn from a good answer (health, base64, bare strings, the native size, h2c,
        truncation, a retested limit); ``request_flow``'s result."""
        replica, state = now.replica, now.state
        replica.succeeded(time.perf_counter() - now.started, len(texts))
        replica.up()
        replica.recovered()
        if now.span is not None:
            now.span.answered(reply.http_version, payload, rows.shape[1])
        if now.bare or not run.control:  # a control's list says nothing of the text's
            learn.learn_bare(state, replica, now.bare, len(texts))
        for other, why in run.failed_on.items():
            if other is not replica:  # it failed where this one did not
                self.endpoint.failed(other, why, health=True)
        if now.fmt == "base64":
            state.base64_ok = True
        elif run.force_float:
            learn.no_base64(state, replica, "failed with base64 but not with float")
        if state.native_dim is None and now.dims is None:
            state.native_dim = int(rows.shape[1])
        if reply.http_version == "HTTP/2" and replica.key.http2:
            pool.h2c_succeeded(replica.key)
        learn.check_usage(replica, state, texts, indices, payload)
        batching.limit_held(state.batch, replica, len(texts), now.retest)
        return rows, sq, bad_rows(sq), replica, state, now.dims

    def _account(self, now: _Attempt, texts: int, attempt: int) -> None:
        """An exchange ended (answered, failed or cancelled): the replica's in-flight
        count, metrics, the batch sizer, the DEBUG line."""
        replica, state, outcome = now.replica, now.state, now.outcome
        replica.end()
        if now.retest and outcome == "cancelled":
            state.batch.retesting = False
        elapsed = time.perf_counter() - now.started
        replica.metrics.request_finished(outcome, elapsed, texts if outcome == "ok" else 0)
        if now.span is not None:
            now.span.end(outcome, now.status, now.error)
        if self.config.batch_size == "auto" and (outcome == "ok" or now.error is not None):
            took = (now.answered or now.started + elapsed) - now.started
            batching.observe_answer(state.batch.sizer, texts, took, now.error)
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug(
                "POST %s texts=%d status=%s %.1f ms attempt=%d",
                replica.label,
                texts,
                outcome if now.status is None else now.status,  # no HTTP status: the error
                elapsed * 1000.0,
                attempt,
            )

    def _learn_failure(self, run: _Retry, now: _Attempt, error: QwenEmbedError) -> None:
        """What a failed attempt teaches about its replica: a retested batch limit still
        holds (``batching.retest_failed``: the batch is then sent again in pieces); an
        HTTP error that is no sign of ill health shows the replica alive."""
        replica = now.replica
        if now.retest:
            batching.retest_failed(now.state.batch, replica, error)
        if (
            isinstance(error, HTTPStatusError)
            and not is_health_failure(error)
            and not (run.multi and isinstance(error, ServerError))
        ):
            replica.healthy()  # it answered: alive (an error's latency is not recorded)

    def _new_options(self, run: _Retry, now: _Attempt, error: QwenEmbedError) -> bool:
        """Whether ``error`` asks for the same texts with other options, resent at once
        as a new request: HTTP/1.1 for a server that does not speak h2c, the root path
        for Infinity without ``--url-prefix`` (``learn.learn_root_path``), float or no
        ``dimensions`` for a 400 refusing them (``learn.adapt``)."""
        replica, state = now.replica, now.state
        if (
            isinstance(error, TransportError)
            and now.fresh
            and not error.refused
            and not error.received  # a broken HTTP/2 answer is an h2c answer
            and pool.h2c_fallback(replica.key)
        ):
            run.attempt = 0
            return True  # the server does not speak h2c: resend over HTTP/1.1 at once
        if not run.moved_prefix and learn.learn_root_path(error, replica.url, state):
            run.moved_prefix = True
            run.attempt = 0
            return True
        if isinstance(error, BadRequestError) and learn.adapt(
            self.config, error, now.fmt, now.dims, state, replica
        ):
            run.attempt = 0  # a new request (other options): its first try
            return True
        if (
            refusal(error)
            and not run.relearned
            and not run.force_float
            and learn.wire(self.config, self.model, state, now.profile) != (now.fmt, now.dims)
        ):
            # refused with options another request has since taught the replica to leave
            # out (``learn.kept_stripped``, ``learn.adapt``): once more with the new ones
            run.relearned = True
            run.attempt = 0
            run.pin = replica
            return True
        return False

    def _same_replica_trial(
        self, run: _Retry, now: _Attempt, error: QwenEmbedError, texts: Sequence[str], call: Call
    ) -> bool:
        """Whether to try once more on the same replica, at once, with float (a 5xx to
        base64: ``learn.float_may_help``) or a bare string (a refused one-item list:
        ``learn.try_bare``; a 4xx naming nothing before anything succeeded in ``call``:
        after a control request, ``Bisector.single_failed``). An outage status tried
        with float waits its backoff first (``False``, the replica pinned). An explicit
        ``max_retries`` counts the float and bare-string trials as retries."""
        state, replica = now.state, now.replica
        bound = self.config.retry.max_retries
        if run.force_float:
            run.force_float = False  # float failed too: base64 is not the cause
        elif (
            not run.tried_float
            and learn.float_may_help(self.config, error, now.fmt, state, run.multi)
            and (bound is None or run.rs.failures < bound)
        ):
            run.tried_float = run.force_float = True  # does float work where base64 failed?
            run.pin = replica  # on the same replica
            if classify(error) != "outage":
                if bound is not None:
                    run.rs.failures += 1  # counted against max_retries, like any retry
                return True  # at once; an outage status: after its backoff (counted there)
        first = replica.label not in call.ok_on and refusal(error) and ambiguous(error)
        if (
            not run.tried_bare
            and learn.try_bare(error, texts, state, now.bare, control_first=first)
            and (bound is None or run.rs.failures < bound)
        ):
            if bound is not None:
                run.rs.failures += 1  # counted against max_retries, like any retry
            run.tried_bare = run.bare_now = True  # does the text go through as a string?
            run.pin = replica
            return True
        return False

    def _next_step(
        self,
        run: _Retry,
        now: _Attempt,
        error: QwenEmbedError,
        call: Call,
        bisectable: bool,
        bisecting: bool,
    ) -> float:
        """After a failure no other option helps: the wait before resending (``0.0``:
        at once, on another replica when one is free), or raise ``error`` to bisect the
        batch (or blame its single text) or to fail the call."""
        replica = now.replica
        usable = now.fresh or run.rs.stale_resent or not isinstance(error, NetworkError)
        if run.multi and replica_suspect(error) and usable:
            run.failed_on.setdefault(replica, error)
            if self._other_replica_free(run, call) and self.endpoint.retry_allowed(replica):
                return 0.0  # the batch may be fine: resend it on another replica at once
        if (
            bisectable
            and maybe_input(error)
            and usable
            and self._input_likelier(run, error, bisecting)
        ):
            # failed again (a transient fault rarely repeats): one of the inputs, or the
            # batch's size, is the likelier cause: bisect (or, for a single text, it is
            # that text's error)
            raise error.with_context(replica=replica.label, attempts=run.attempt)
        rs = run.rs
        delay = rs.next_delay(error, now=time.monotonic(), fresh_connection=now.fresh)
        delay = self.endpoint.first_contact(
            error, call.started, delay, self.config.retry.wait_for_server
        )
        if delay is not None and replica.down:
            delay = 0.0  # down: its probe paces the retries (``Endpoint.wait_probe``)
        elif delay and not self.endpoint.retry_allowed(replica):
            # over the replica's retry budget (process-wide): not retried
            rs.ended_by = "budget"
            delay = None
        if delay is None:
            error = error.with_context(
                replica=replica.label, attempts=run.attempt, note=self._bound_note(rs, replica)
            )
            if run.multi and classify(error) != "fatal":
                error = self.endpoint.name_failures(error)
            raise self._unreachable(error, call)
        if classify(error) == "outage" and run.multi:
            run.avoid = replica
            if any(
                r is not replica and r.available(time.monotonic()) for r in self.endpoint.replicas
            ):
                delay = 0.0  # another replica can take it now
        return delay

    @staticmethod
    def _bound_note(rs: RetryState, replica: Replica) -> str:
        """Which bound ended a request's retries, in words for its error (``""``: the
        failure was not retried)."""
        if rs.ended_by != "budget":
            return rs.ended()
        budget = replica.retries
        return (
            f" (not retried: the retry budget of {replica.label} is spent: "
            f"{budget.hedges} retries for {budget.queries} requests in the last "
            f"{budget.window:g} s; retries are capped at {budget.ratio:.0%} of requests "
            f"plus {budget.floor})"
        )

    def _other_replica_free(self, run: _Retry, call: Call) -> bool:
        """Whether a replica this batch has not failed on can take it now, in time."""
        left = call.remaining()
        if left is not None and left <= 0:
            return False
        t = time.monotonic()
        return any(r not in run.failed_on and r.available(t) for r in self.endpoint.replicas)

    @staticmethod
    def _input_likelier(run: _Retry, error: QwenEmbedError, bisecting: bool) -> bool:
        """Whether an input (or the batch's size) is now the likelier cause of a failure
        one input may cause than the server: it failed before (a transient fault rarely
        repeats), within a bisection, for good (fatal), or on two replicas."""
        return (
            run.rs.attempts >= 1
            or bisecting
            or classify(error) == "fatal"
            or len(run.failed_on) >= 2
        )

    def batch_flow(
        self,
        call: Call,
        texts: Sequence[str],
        indices: Sequence[int],
        bis: Bisection | None = None,
    ) -> Flow:
        """One batch to its ``Part``: splits, bisection and per-input failures."""
        since = bis.since if bis is not None else time.monotonic()
        try:
            found = yield from self.request_flow(
                call, texts, indices, bisectable=len(texts) > 1, bisecting=bis is not None
            )
        except batching.Split as split:
            part = Part()
            for start, stop in batching.split_runs(split, texts):
                sub = yield from self.batch_flow(call, texts[start:stop], indices[start:stop], bis)
                part.merge(sub, start)
            return part
        except BatchTooLargeError as exc:
            if len(texts) > 1 and (exc.tokens or exc.limit is not None):
                # Learn the stated (or, for tokens, halved) limit, then send the same
                # texts again: the replica's limit now splits them (``batching.Split``).
                self._learn_limit(exc, texts)
                return (yield from self.batch_flow(call, texts, indices, bis))
            if len(texts) > 1:  # too large, no number: a refused batch (``Bisector.refused``)
                return (yield from self.bisector.refused(call, texts, indices, exc, bis))
            return input_failed(call, Part(), 0, indices[0], exc, bis)
        except QwenEmbedError as exc:
            if exc in call.server_errors:
                raise  # it ends the call, whatever the input
            if len(texts) > 1 and maybe_input(exc):
                named = named_position(exc, len(texts))
                if named is not None:
                    return (yield from self.bisector.without(call, texts, indices, named, exc, bis))
                return (yield from self.bisector.bisect(call, texts, indices, exc, bis))
            if len(texts) > 1 and refusal(exc):
                return (yield from self.bisector.refused(call, texts, indices, exc, bis))
            found = yield from self.bisector.single_failed(call, texts, indices, exc, bis, since)
            if isinstance(found, Part):
                return found
        return (yield from self._delivered(call, indices, bis, *found))

    def _delivered(
        self,
        call: Call,
        indices: Sequence[int],
        bis: Bisection | None,
        rows: Any,
        sq: Any,
        bad: dict[int, str],
        replica: Replica,
        state: ReplicaState,
        dims: int | None,
    ) -> Flow:
        """A batch answered: its vectors checked (sizes, bad rows) and finished
        (``learn.finish``) into a ``Part``; the llama.cpp EOS check once per replica."""
        part = Part()
        call.last_ok = time.monotonic()
        call.ok_on.add(replica.label)
        count = len(indices)
        if bis is not None:
            bis.ok += count
            bis.max_ok = max(bis.max_ok, count)
            bis.ok_on[replica] = max(bis.ok_on.get(replica, 0), count)
        if wrong := size_errors(rows, indices, replica.label, self.model, dims, self.config, call):
            for row, err in enumerate(wrong):  # one size per call; "raise": the first raises
                input_failed(call, part, row, indices[row], err, None)
            return part
        rows = learn.finish(self.config, rows, sq, dims, bad, state, replica)
        part.pieces.append((0, rows))
        for row, reason in bad.items():
            err = ResponseError(
                f"embedding for input index {indices[row]} {reason}",
                index=indices[row],
                url=replica.label,
            )
            input_failed(call, part, row, indices[row], err, None)
        if (
            state.profile is servers.PROFILES["llamacpp"]
            and not state.eos_checked
            and self.config.append_eos is None
        ):
            yield from self._eos_check(replica, state)
        return part

    def _learn_limit(self, exc: BatchTooLargeError, texts: Sequence[str]) -> None:
        """The replica ``exc`` names (else every replica) refused ``texts`` for their
        size: learn its limit (``learn.learn_stated_limit``)."""
        replica = self.endpoint.replica_of(exc)
        for target in [replica] if replica is not None else self.endpoint.replicas:
            learn.learn_stated_limit(target.state(self.model).batch, target, exc, texts)

    def _eos_check(self, replica: Replica, state: ReplicaState) -> Flow:
        """llama.cpp: check once whether the server appends ``<|endoftext|>`` (the token
        Qwen3-Embedding pools) by tokenising a probe with ``add_special``
        (``learn.eos_answer``)."""
        state.eos_checked = True
        try:
            reply = yield Send(replica, self.requests.tokenize(replica))
        except QwenEmbedError:
            return
        learn.eos_answer(replica, reply.status, reply.body)


# --------------------------------------------------------------------------- helpers


def _cause(error: QwenEmbedError, previous: QwenEmbedError | None, call: Call) -> QwenEmbedError:
    """The error to act on: a retry that the call's deadline cut short (a timeout with no
    time left) says nothing new: the failure it retried (in an outage, the server's last
    answer) is the cause: a new error of its type, with the timeout as its
    ``__context__`` (why the retries stopped, shown in a traceback)."""
    left = call.remaining()
    if previous is None or left is None or left > 0.01:
        return error
    if not isinstance(error, TimeoutException):
        return error
    return previous.with_context(after=previous.__context__ or error)
