"""The I/O-free call engine: every decision of an embedding call, written once.

An embedding call is planned (``_protocol.plan_batches``), then each batch runs as a
*flow*: a generator that yields operations — ``Send`` (perform this HTTP exchange on
this replica) and ``Sleep`` (wait this long) — and receives their results. The sync
client runs flows with blocking I/O (``run_sync``), the async client with awaits
(``run_async``); nothing else differs between them (as httpx's ``BaseClient`` and
tenacity's ``BaseRetrying.iter`` share their logic).

A batch flow decides:

- which replica gets the request (``balance``), and resends a failed request at once on
  another replica;
- retries (``retry``: outages until the call's deadline, other failures
  ``max_attempts`` times, stale keep-alive and refused HTTP/2 streams at once); a
  connection failure while no replica has ever answered only within
  ``RetryConfig.wait_for_server`` (a wrong URL fails fast, naming it);
- adaptations learned per replica: base64 -> float (on a refusal, or a 5xx a float
  retry does not reproduce), client-side ``dimensions``, a batch or token limit stated
  in a refusal, a bare string ``input`` for a server refusing one-item lists, a missing
  ``/v1`` prefix (Infinity), h2c -> HTTP/1.1;
- bisection: a batch that fails in a way one input can cause (500, a connection
  dropped after the request was sent, a 400 that names no input) is split and the
  halves resent until the failing input(s) are isolated; every other text is embedded,
  and the error names the caller's index. A single text is blamed only when it fails
  again after the server was seen working (a control request shows it; a control that
  fails too is an outage, waited out until the deadline). A batch whose every half
  succeeds failed for its size: the replica's batch limit is learned;
- what reaches the caller: ``on_error="raise"`` raises the first bad input's error
  (the lowest index), ``"skip"`` leaves ``None`` in its slot and reports the error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _pool as pool
from . import _servers as servers
from ._adaptive import gate_for
from ._balance import RETEST_EVERY_MAX, Endpoint, Replica, ReplicaState, endpoint_for
from ._bisect import Bisecting, _Bisection
from ._config import (
    EmbeddingConfig,
    OnError,
    RequestBody,
    RequestHeaders,
    RetryConfig,
    insecure_key_target,
    known_model_dims,
)
from ._learn import Learning
from ._protocol import (
    bad_rows,
    decode_rows,
    encode_request,
    estimate_tokens,
    parse_body,
    size_errors,
    split_by_tokens,
)
from ._retry import (
    RetryState,
    ambiguous,
    classify,
    input_error,
    is_health_failure,
    maybe_input,
    named_position,
    parse_retry_after,
    replica_suspect,
)
from ._run import Call, Flow, Part, Send, Sleep
from ._server_text import scrub
from ._transport import Reply, Request
from .errors import (
    BadRequestError,
    BatchTooLargeError,
    ConfigError,
    ErrorContext,
    HTTPStatusError,
    NetworkError,
    NotFoundError,
    QwenEmbedError,
    ResponseError,
    ServerError,
    TimeoutException,
    TransportError,
    error_from_response,
)

__all__ = ["Engine"]

_log = logging.getLogger("qwen_embed_plugins")

_EOS = "<|endoftext|>"
_MAX_RESPONSE_FLOOR = 1 << 20
_BYTES_PER_VALUE = 32  # a float in JSON: "-0.012345678901234567," is 22; room to spare
_DIM_GUESS = 8192


class _Split(Exception):
    """The chosen replica accepts fewer texts (or tokens) per request than this batch."""

    def __init__(self, count: int | None = None, tokens: int | None = None) -> None:
        super().__init__()
        self.count = count
        self.tokens = tokens


@dataclass(slots=True)
class _Retry:
    """What the attempts of one ``request_flow`` have tried and learned so far."""

    policy: RetryConfig
    started: float  # the call's, monotonic
    deadline: float | None  # the call's, in seconds
    multi: bool  # the endpoint has more than one replica
    avoid: Replica | None = None  # the replica an outage just failed on
    failed_on: dict[Replica, QwenEmbedError] = field(default_factory=dict)  # maybe theirs
    pin: Replica | None = None  # a float or bare-string trial goes to the same replica
    force_float: bool = False
    tried_float: bool = False
    tried_bare: bool = False
    bare_now: bool = False
    moved_prefix: bool = False
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

    def failed(self, error: QwenEmbedError, outcome: str, fresh: bool) -> None:
        self.error, self.outcome, self.fresh = error, outcome, fresh


# --------------------------------------------------------------------------- the engine


class Engine(Learning, Bisecting):
    """The decisions of one client's calls (one per client; replicas are shared)."""

    def __init__(self, config: EmbeddingConfig) -> None:
        self.config = config
        self.model: str = config.model or ""
        self._api_key = config.api_key  # a Secret: never shown by repr or vars()
        self.endpoint: Endpoint = endpoint_for(config)
        self.timeouts = config.timeouts
        self.headers = _Headers(self._api_key, config.headers)
        if isinstance(config.extra_body, RequestBody):
            config.extra_body.check()  # a secret field withheld from a pickle
        self.fixed = None if config.server == "auto" else servers.get_profile(str(config.server))
        self._contexts: dict[str, ErrorContext] = {}
        self._insecure_warned = False
        self.append_eos = config.append_eos is True

    def adaptive_gate(self, replica: Replica) -> Any:
        """The adaptive concurrency gate of ``replica`` when ``max_concurrency="auto"``
        (``_adaptive.gate_for``), else ``None``. Looked up in the process state on every
        call (one dict look-up), never kept here: after ``reset()`` or a fork, a client
        made before gets the new gate, not the one whose learned limit was forgotten."""
        if self.config.max_concurrency != "auto":
            return None
        return gate_for(replica.key, cap=self.config.limits.max_connections_per_process)

    @property
    def secret(self) -> str | None:
        """The API key (for the SDK); ``None`` without one."""
        return self.config.api_key_value()

    @property
    def secrets(self) -> tuple[str, ...]:
        """Every secret a request carries (the API key, the credential-like header
        and ``extra_body`` field values): scrubbed from anything the server sends back."""
        key, headers, body = self.secret, self.config.headers, self.config.extra_body
        found: tuple[str, ...] = () if key is None else (key,)
        if isinstance(headers, RequestHeaders):
            found += headers.secret_values()
        if isinstance(body, RequestBody):
            found += body.secret_values()
        return found

    # ---------------------------------------------------------------- per replica

    def ctx(self, replica: Replica) -> ErrorContext:
        found = self._contexts.get(replica.url)
        if found is None:
            t = self.timeouts
            found = self._contexts[replica.url] = ErrorContext(
                url=replica.label,
                secret=self._api_key,
                headers=self.config.headers,
                body=self.config.extra_body,
                connect=t.connect,
                read=t.read,
                write=t.write,
                pool=t.pool,
                total=t.total,
                max_connections=self.config.limits.max_connections,
            )
        return found

    def profile(self, replica: Replica, state: ReplicaState) -> servers.ServerProfile:
        if self.fixed is not None:
            return self.fixed
        if state.profile is None:
            found = servers.identify_url(replica.url)
            if found is not None:
                state.profile, state.source = found.profile, found.source
        profile = state.profile
        return servers.GENERIC if profile is None else profile

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

    def wire(self, state: ReplicaState, profile: servers.ServerProfile) -> tuple[str, int | None]:
        """(``encoding_format``, ``dimensions`` to send) for this replica now."""
        fmt: str = self.config.encoding_format
        if fmt == "auto":
            fmt = "float" if state.base64_ok is False or not profile.base64 else "base64"
        want = self.config.dimensions
        if want is None or state.dimensions_ok is False:
            return fmt, None
        native = state.native_dim or known_model_dims(self.model)
        if native is not None and want >= native:
            return fmt, None  # the full size: nothing to ask for
        return fmt, servers.wire_dimensions(profile, want, self.model)

    def batch_limits(self) -> tuple[int | None, int | None]:
        """The (texts, tokens) per request a plan can respect up front: the most capable
        replica's known limits (server profiles, learned limits); a batch sent to a more
        limited replica is split there."""
        counts: list[int | None] = []
        token_caps: list[int | None] = []
        configured = self.config.max_batch_tokens
        for replica in self.endpoint.replicas:
            state = replica.state(self.model)
            learned = None if state.retest_due() else state.batch_limit
            limits = [x for x in (learned, self.profile(replica, state).batch_limit) if x]
            counts.append(min(limits) if limits else None)
            caps = [x for x in (state.token_limit, configured) if x]
            token_caps.append(min(caps) if caps else None)
        count = None if None in counts else max(c for c in counts if c is not None)
        tokens = None if None in token_caps else max(t for t in token_caps if t is not None)
        return count, tokens

    def max_bytes(self, texts: int, state: ReplicaState) -> int:
        if self.config.max_response_bytes is not None:
            return self.config.max_response_bytes
        dim = state.native_dim or _DIM_GUESS
        return max(_MAX_RESPONSE_FLOOR, texts * dim * _BYTES_PER_VALUE + 65_536)

    def new_call(self, *, query: bool, on_error: OnError = "raise") -> Call:
        """Start a call: fails fast (``CircuitOpenError``) while the endpoint is down."""
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.endpoint.check_open()
        retry = self.config.retry
        deadline = retry.query_deadline if query else retry.deadline
        if not self._insecure_warned and self.secret is not None:
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

    # ---------------------------------------------------------------- requests

    def _request(
        self,
        replica: Replica,
        state: ReplicaState,
        texts: Sequence[str],
        fmt: str,
        dims: int | None,
        call: Call,
        bare: bool = False,
    ) -> Request:
        if self.append_eos:
            texts = [t if t.endswith(_EOS) else t + _EOS for t in texts]
        body = encode_request(  # with EmbeddingConfig.extra_body merged in
            texts[0] if bare else texts,
            model=self.model,
            encoding_format=fmt,
            dimensions=dims,
            extra=self.config.extra_body,
        )
        total = self.timeouts.total
        left = call.remaining()
        if left is not None:
            left = max(left, 0.001)
            total = left if total is None else min(total, left)
        url = state.url_override or f"{replica.url}/embeddings"
        return Request(
            "POST",
            url,
            body,
            self.headers,
            self.timeouts,
            total,
            self.max_bytes(len(texts), state),
            self.ctx(replica),
        )

    def status_error(
        self, reply: Reply, replica: Replica, profile: servers.ServerProfile
    ) -> HTTPStatusError | ResponseError:
        status = reply.status
        if 300 <= status < 400:
            where = scrub(reply.headers.get("location", ""), *self.secrets)[:200]
            return ResponseError(
                f"{replica.label} answered HTTP {status} (redirect to {where or '?'}); "
                "redirects are not followed, so that the API key never goes elsewhere: "
                "fix base_url",
                url=replica.label,
            )
        error = error_from_response(
            status,
            reply.body,
            url=f"{replica.url}/embeddings",
            headers=reply.headers,
            retry_after=parse_retry_after(reply.headers),
            secret=self.secrets,
        )
        error = servers.refine_error(profile, error)
        if status == 404 and not replica.url.endswith("/v1"):
            error = error.with_context(
                note=" (OpenAI-compatible servers usually serve under /v1: "
                f"try base_url='{replica.label}/v1')"
            )
        return error

    def _observe(
        self, replica: Replica, state: ReplicaState, reply: Reply, payload: object
    ) -> None:
        """Identify the server from a good answer (no fixed ``server=``, no profile
        found yet or only the generic one): ``_interpret`` calls it then only."""
        found = servers.identify_response(reply.headers, payload)
        if found is not None:
            state.profile, state.source = found.profile, found.source
        elif state.profile is None:
            state.profile, state.source = servers.GENERIC, "answers of a generic server"

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
    ) -> Flow:
        """Send one batch until it is answered, with retries (within a bisection, a
        failure one input may cause is not retried: its batch already showed it twice);
        returns
        ``(rows n x dim, squared norms, bad rows, replica, state, dimensions sent)``.

        Each attempt: the replica and its limits (``_attempt``: raises ``_Split`` for a
        batch above them), the exchange and what its reply says (``_interpret``), then
        for a failure what it teaches (``_learn_failure``), whether other options
        (``_new_options``) or another trial on the same replica (``_same_replica_trial``)
        may help, and else the next step (``_next_step``): resend, back off, bisect or
        fail."""
        run = _Retry(
            self.config.retry, call.started, call.deadline, len(self.endpoint.replicas) > 1
        )
        while True:
            run.attempt += 1
            replica = run.pin if run.pin is not None else self._choose(run)
            run.pin = None
            probe = replica.probing  # chosen as the probe of an ejected replica
            now: _Attempt | None = None
            try:
                now = self._attempt(run, replica, call, texts)
                replica.begin()
                replica.metrics.request_started()
                now.started, now.sent = time.perf_counter(), True
                try:
                    reply: Reply = yield Send(replica, now.request)
                except QwenEmbedError as exc:
                    now.failed(exc, type(exc).__name__, bool(getattr(exc, "fresh", True)))
                else:
                    decoded = self._interpret(now, reply, indices)
                    if decoded is not None:
                        return self._succeeded(run, now, reply, texts, indices, *decoded)
            finally:
                if now is not None and now.sent:
                    self._account(now, len(texts), run.attempt)
                if probe:
                    replica.probing = False  # sent or not: another request may probe it
            error = now.error
            if error is None:  # cannot happen
                raise RuntimeError("internal error: error is None")
            self.endpoint.failed(replica, error)
            error = run.previous = _cause(error, run.previous, call)
            self._learn_failure(run, now, error)
            if self._new_options(run, now, error) or self._same_replica_trial(
                run, now, error, texts
            ):
                continue
            delay = self._next_step(run, now, error, call, bisectable or bisecting, bisecting)
            replica.retried(error, delay)
            if delay > 0:
                yield Sleep(delay)

    # ------------------------------------------------ request_flow's decisions

    def _choose(self, run: _Retry) -> Replica:
        """The replica for the next attempt: not one this batch failed on (nor the one an
        outage just avoided) while another is available (``Endpoint.choose``)."""
        failed_on = run.failed_on
        return self.endpoint.choose(list(failed_on) if failed_on else run.avoid)

    def _attempt(self, run: _Retry, replica: Replica, call: Call, texts: Sequence[str]) -> _Attempt:
        """The next attempt on ``replica``: its limits (``_limits``), the options it takes
        (``wire``, base64 -> float and bare-string trials) and the request."""
        state = replica.state(self.model)
        profile = self.profile(replica, state)
        retest = self._limits(replica, state, profile, texts)
        fmt, dims = self.wire(state, profile)
        if run.force_float:
            fmt = "float"
        bare = run.bare_now or (len(texts) == 1 and state.bare_input is True)
        run.bare_now = False
        request = self._request(replica, state, texts, fmt, dims, call, bare)
        return _Attempt(replica, state, profile, retest, fmt, dims, bare, request)

    def _limits(
        self,
        replica: Replica,
        state: ReplicaState,
        profile: servers.ServerProfile,
        texts: Sequence[str],
    ) -> bool:
        """The batch and token limits of ``replica`` for this batch: raises ``_Split``
        when ``texts`` exceed them; returns whether this batch retests an inferred
        batch limit (sent whole, above it)."""
        limit = state.batch_limit
        retest = False
        if limit is not None and len(texts) > limit and state.retest_due():
            with replica._lock:
                retest = state.retest_due()
                state.retesting = retest
            if retest:
                limit = None  # this batch retests the inferred limit
        if profile.batch_limit is not None and (limit is None or profile.batch_limit < limit):
            limit = profile.batch_limit
        if limit is not None and len(texts) > limit:
            raise _Split(count=limit)
        tokens = state.token_limit or self.config.max_batch_tokens
        if tokens is not None and len(texts) > 1 and sum(map(estimate_tokens, texts)) > tokens:
            raise _Split(tokens=tokens)
        return retest

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
            error = self.status_error(reply, replica, now.profile)
            now.failed(error, type(error).__name__, reply.fresh)
            return None
        try:
            payload = parse_body(reply.body)
            if self.fixed is None and (state.profile is None or state.profile is servers.GENERIC):
                self._observe(replica, state, reply, payload)
            rows, sq = decode_rows(payload, indices)
        except ResponseError as exc:
            # its message may quote the body: the new error's is built without the key
            error = exc.with_context(url=exc.url or replica.label, secrets=self.secrets)
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
        replica.succeeded(time.perf_counter() - now.started)
        replica.recovered()
        self._learn_bare(state, replica, now.bare, len(texts))
        for other, why in run.failed_on.items():
            if other is not replica:  # it failed where this one did not
                self.endpoint.failed(other, why, health=True)
        if now.fmt == "base64":
            state.base64_ok = True
        elif run.force_float:
            self._no_base64(state, replica, "failed with base64 but not with float")
        if state.native_dim is None and now.dims is None:
            state.native_dim = int(rows.shape[1])
        if reply.http_version == "HTTP/2" and replica.key.http2:
            pool.h2c_succeeded(replica.key)
        self._check_usage(replica, state, texts, indices, payload)
        if state.limit_inferred:
            self._limit_held(replica, state, len(texts), now.retest)
        return rows, sq, bad_rows(sq), replica, state, now.dims

    def _account(self, now: _Attempt, texts: int, attempt: int) -> None:
        """An exchange ended (answered, failed or cancelled): the replica's in-flight
        count, metrics, the batch sizer, the DEBUG line."""
        replica, state, outcome = now.replica, now.state, now.outcome
        replica.end()
        if now.retest and outcome == "cancelled":
            state.retesting = False
        elapsed = time.perf_counter() - now.started
        replica.metrics.request_finished(outcome, elapsed, texts if outcome == "ok" else 0)
        if outcome == "ok" or now.error is not None:
            took = (now.answered or now.started + elapsed) - now.started
            self._sized(state, texts, took, now.error)
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
        holds (the batch is then sent again in pieces: ``_Split``); an HTTP error that is
        no sign of ill health shows the replica alive."""
        replica, state = now.replica, now.state
        if now.retest:
            state.retesting = False
            state.ok_since_limit = 0
            state.retest_every = min(state.retest_every * 2, RETEST_EVERY_MAX)
            if state.batch_limit is not None:
                _log.info(
                    "%s still fails batches above %d texts (%s); retesting after %d requests",
                    replica.label,
                    state.batch_limit,
                    type(error).__name__,
                    state.retest_every,
                )
                raise _Split(count=state.batch_limit)  # sent again in pieces
        if (
            isinstance(error, HTTPStatusError)
            and not is_health_failure(error)
            and not (run.multi and isinstance(error, ServerError))
        ):
            replica.succeeded(time.perf_counter() - now.started)  # it answered: alive

    def _new_options(self, run: _Retry, now: _Attempt, error: QwenEmbedError) -> bool:
        """Whether ``error`` asks for the same texts with other options, resent at once
        as a new request: HTTP/1.1 for a server that does not speak h2c, the root path
        for Infinity without ``--url-prefix``, float or no ``dimensions`` for a 400
        refusing them (``_adapt``)."""
        replica, state = now.replica, now.state
        if (
            isinstance(error, TransportError)
            and now.fresh
            and not error.refused
            and pool.h2c_fallback(replica.key)
        ):
            run.attempt = 0
            return True  # the server does not speak h2c: resend over HTTP/1.1 at once
        if (
            isinstance(error, NotFoundError)
            and not run.moved_prefix
            and state.url_override is None
            and replica.url.endswith("/v1")
            and error.message.strip() == "Not Found"
        ):
            # Infinity started without --url-prefix behind a /v1 base URL answers
            # FastAPI's 404 {"detail": "Not Found"}: its routes are at the root.
            run.moved_prefix = True
            state.url_override = f"{replica.url[: -len('/v1')]}/embeddings"
            state.profile, state.source = (
                servers.PROFILES["infinity"],
                "404 under /v1 (Infinity without --url-prefix)",
            )
            run.attempt = 0
            return True
        if isinstance(error, BadRequestError) and self._adapt(
            error, now.fmt, now.dims, state, replica
        ):
            run.attempt = 0  # a new request (other options): its first try
            return True
        return False

    def _same_replica_trial(
        self, run: _Retry, now: _Attempt, error: QwenEmbedError, texts: Sequence[str]
    ) -> bool:
        """Whether to try once more on the same replica, at once, with float (a 5xx to
        base64: ``_float_may_help``) or a bare string (a refused one-item list:
        ``_try_bare``). An outage status tried with float waits its backoff first
        (``False``, the replica pinned)."""
        state, replica = now.state, now.replica
        if run.force_float:
            run.force_float = False  # float failed too: base64 is not the cause
        elif not run.tried_float and self._float_may_help(error, now.fmt, state, run.multi):
            run.tried_float = run.force_float = True  # does float work where base64 failed?
            run.pin = replica  # on the same replica
            if classify(error) != "outage":
                return True  # at once; an outage status: after its backoff
        if not run.tried_bare and self._try_bare(error, texts, state, now.bare):
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
            if self._other_replica_free(run, call):
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
        delay = run.rs.next_delay(error, now=time.monotonic(), fresh_connection=now.fresh)
        delay = self.endpoint.first_contact(
            error, call.started, delay, self.config.retry.wait_for_server
        )
        if delay is None:
            error = error.with_context(replica=replica.label, attempts=run.attempt)
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
        bis: _Bisection | None = None,
    ) -> Flow:
        """One batch to its ``Part``: splits, bisection and per-input failures."""
        since = bis.since if bis is not None else time.monotonic()
        try:
            found = yield from self.request_flow(
                call, texts, indices, bisectable=len(texts) > 1, bisecting=bis is not None
            )
        except _Split as split:
            part = Part()
            for start, stop in _split_runs(split, texts):
                sub = yield from self.batch_flow(call, texts[start:stop], indices[start:stop], bis)
                part.merge(sub, start)
            return part
        except BatchTooLargeError as exc:
            if len(texts) > 1:
                # Learn the stated (or halved) limit, then send the same texts again:
                # the replica's limit now splits them (``_Split``).
                self._learn_limit(exc, texts, self.endpoint.replica_of(exc))
                return (yield from self.batch_flow(call, texts, indices, bis))
            return self._input_failed(call, Part(), 0, indices[0], exc, bis)
        except QwenEmbedError as exc:
            if len(texts) > 1 and maybe_input(exc):
                named = named_position(exc, len(texts))
                if named is not None:
                    return (yield from self._without(call, texts, indices, named, exc, bis))
                return (yield from self._bisect(call, texts, indices, exc, bis))
            found = yield from self._single_failed(call, texts, indices, exc, bis, since)
            if isinstance(found, Part):
                return found
        return (yield from self._delivered(call, indices, bis, *found))

    def _single_failed(
        self,
        call: Call,
        texts: Sequence[str],
        indices: Sequence[int],
        exc: QwenEmbedError,
        bis: _Bisection | None,
        since: float,
    ) -> Flow:
        """A batch that cannot be bisected failed with ``exc``: re-raised unless it is a
        single text's error; that text's failed ``Part``, or (an error the server may
        have caused whatever the input: ``_once_more``) ``request_flow``'s result."""
        if len(texts) != 1 or not input_error(exc):
            raise exc
        if not ambiguous(exc):
            return self._input_failed(call, Part(), 0, indices[0], exc, bis)
        if bis is not None:
            bis.input_failed = True  # not a batch that failed for its size
        try:
            return (yield from self._once_more(call, texts, indices, exc, since))
        except QwenEmbedError as again:
            if again in call.server_errors or not input_error(again):
                raise
            return self._input_failed(call, Part(), 0, indices[0], again, bis)

    def _delivered(
        self,
        call: Call,
        indices: Sequence[int],
        bis: _Bisection | None,
        rows: Any,
        sq: Any,
        bad: dict[int, str],
        replica: Replica,
        state: ReplicaState,
        dims: int | None,
    ) -> Flow:
        """A batch answered: its vectors checked (sizes, bad rows) and finished
        (``_finish``) into a ``Part``; the llama.cpp EOS check once per replica."""
        part = Part()
        call.last_ok = time.monotonic()
        count = len(indices)
        if bis is not None:
            bis.ok += count
            bis.max_ok = max(bis.max_ok, count)
            bis.ok_on[replica] = max(bis.ok_on.get(replica, 0), count)
        if wrong := size_errors(rows, indices, replica.label, self.model, dims, self.config, call):
            for row, err in enumerate(wrong):  # one size per call; "raise": the first raises
                self._input_failed(call, part, row, indices[row], err, None)
            return part
        rows = self._finish(rows, sq, dims, bad, state, replica)
        part.pieces.append((0, rows))
        for row, reason in bad.items():
            err = ResponseError(
                f"embedding for input index {indices[row]} {reason}",
                index=indices[row],
                url=replica.label,
            )
            self._input_failed(call, part, row, indices[row], err, None)
        if (
            state.profile is servers.PROFILES["llamacpp"]
            and not state.eos_checked
            and self.config.append_eos is None
        ):
            yield from self._eos_check(call, replica, state)
        return part


# --------------------------------------------------------------------------- helpers


class _Headers(Mapping[str, str]):
    """The request headers of a client: its own, the configured ``headers`` (a secret one
    withheld from a pickle raises ``ConfigError`` here), and ``Authorization`` built from
    the ``Secret`` only when the transport reads it. No secret appears in a ``repr``."""

    __slots__ = ("_base", "_extra", "_key")

    def __init__(self, key: Any, extra: Mapping[str, str] | None = None) -> None:
        self._key, self._extra = key, extra
        own = {"Content-Type": "application/json", "Accept": "application/json"}
        self._base = own if extra is None else {**extra, **own}  # never the same names

    def _all(self) -> dict[str, str]:
        if self._key is None:
            return self._base
        return {**self._base, "Authorization": f"Bearer {self._key.get_secret_value()}"}

    def __getitem__(self, name: str) -> str:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._base) + (self._key is not None)

    def __repr__(self) -> str:
        shown = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._key is not None:
            shown["Authorization"] = "Bearer **********"
        return f"_Headers({shown!r}, {self._extra!r})"  # RequestHeaders masks its secrets


def _split_runs(split: _Split, texts: Sequence[str]) -> list[tuple[int, int]]:
    """The ``(start, stop)`` pieces of ``texts`` within the limit ``split`` names: at most
    ``split.count`` texts, or about ``split.tokens`` estimated tokens (halves when the
    token split cannot cut it)."""
    n = len(texts)
    if split.count is not None:
        return [(i, min(i + split.count, n)) for i in range(0, n, split.count)]
    runs = split_by_tokens([estimate_tokens(t) for t in texts], 0, n, split.tokens, n)
    return runs if len(runs) > 1 else [(0, n // 2), (n // 2, n)]


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
