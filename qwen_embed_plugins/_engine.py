"""The I/O-free call engine: every decision of an embedding call, written once.

An embedding call is planned (``protocol.plan_batches``), then each batch runs as a
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

from . import pool, servers
from ._learn import Learning
from ._run import Call, Flow, Part, Send, Sleep
from .balance import RETEST_EVERY_MAX, Endpoint, Replica, ReplicaState, endpoint_for
from .config import (
    EmbeddingConfig,
    OnError,
    RequestBody,
    RequestHeaders,
    insecure_key_target,
    known_model_dims,
)
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
    scrub,
)
from .protocol import (
    bad_rows,
    decode_rows,
    encode_request,
    estimate_tokens,
    parse_body,
    size_errors,
)
from .retry import (
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
from .transport import Reply, Request

__all__ = ["Engine"]

_log = logging.getLogger("qwen_embed_plugins")

_EOS = "<|endoftext|>"
_MAX_RESPONSE_FLOOR = 1 << 20
_BYTES_PER_VALUE = 32  # a float in JSON: "-0.012345678901234567," is 22; room to spare
_DIM_GUESS = 8192
_CONTROL_TEXT = "hello"  # a control request's input: any server embeds it
_CONTROL_WAIT_MAX = 1.0  # seconds: the longest wait between control requests in an outage


class _Split(Exception):
    """The chosen replica accepts fewer texts (or tokens) per request than this batch."""

    def __init__(self, count: int | None = None, tokens: int | None = None) -> None:
        super().__init__()
        self.count = count
        self.tokens = tokens


@dataclass
class _Bisection:
    since: float  # monotonic time the bisected batch failed
    ok: int = 0
    max_ok: int = 0
    ok_on: dict[Replica, int] = field(default_factory=dict)  # replica -> largest piece
    failed_leaves: int = 0
    input_failed: bool = False


# --------------------------------------------------------------------------- the engine


class Engine(Learning):
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
        self._gates: dict[str, Any] = {}
        self._insecure_warned = False
        self.append_eos = config.append_eos is True

    def adaptive_gate(self, replica: Replica) -> Any:
        """The adaptive concurrency gate of ``replica`` when ``max_concurrency="auto"``
        (``adaptive.gate_for``), else ``None``."""
        if self.config.max_concurrency != "auto":
            return None
        gate = self._gates.get(replica.url)
        if gate is None:
            from .adaptive import gate_for

            cap = self.config.limits.max_connections_per_process
            gate = self._gates[replica.url] = gate_for(replica.key, cap=cap)
        return gate

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
        if self.secret is not None and not self._insecure_warned:
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
            error.args = (
                f"{error.args[0]} (OpenAI-compatible servers usually serve under /v1: "
                f"try base_url='{replica.label}/v1')",
            )
        return error

    def _observe(
        self, replica: Replica, state: ReplicaState, reply: Reply, payload: object
    ) -> None:
        if self.fixed is None and (state.profile is None or state.profile is servers.GENERIC):
            found = servers.identify_response(reply.headers, payload)
            if found is not None:
                state.profile, state.source = found.profile, found.source
            elif state.profile is None:
                state.profile, state.source = servers.GENERIC, "answers of a generic server"

    def _unreachable(self, error: QwenEmbedError, call: Call) -> QwenEmbedError:
        """``error``, saying that no request reached the endpoint (when so) and how to
        check it; such an error ends the call."""
        if self.endpoint.unreached(error, call.started, self.config.retry.wait_for_server):
            call.stop = True
            error._server_wide = True  # type: ignore[attr-defined]
        return error

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
        ``(rows n x dim, squared norms, bad rows, replica, state)``."""
        policy = self.config.retry
        rs = RetryState(policy=policy, started=call.started, deadline=call.deadline)
        avoid: Replica | None = None
        failed_on: dict[Replica, QwenEmbedError] = {}  # where this batch failed, maybe their fault
        pin: Replica | None = None  # the float retry of a base64 500 goes to the same replica
        multi = len(self.endpoint.replicas) > 1
        force_float = False
        tried_float = False
        tried_bare = bare_now = False
        moved_prefix = False
        previous: QwenEmbedError | None = None  # the last attempt's error
        attempt = 0
        while True:
            attempt += 1
            replica = pin if pin is not None else self.endpoint.choose(list(failed_on) or avoid)
            pin = None
            probe = replica.probing  # chosen as the probe of an ejected replica
            try:
                state = replica.state(self.model)
                profile = self.profile(replica, state)
            except BaseException:
                if probe:
                    replica.probing = False  # not sent: another request may probe it
                raise
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
                if probe:
                    replica.probing = False  # not sent: another request may probe it
                raise _Split(count=limit)
            tokens = state.token_limit or self.config.max_batch_tokens
            if (
                tokens is not None
                and len(texts) > 1
                and sum(estimate_tokens(t) for t in texts) > tokens
            ):
                if probe:
                    replica.probing = False
                raise _Split(tokens=tokens)
            try:
                fmt, dims = self.wire(state, profile)
                if force_float:
                    fmt = "float"
                bare = bare_now or (len(texts) == 1 and state.bare_input is True)
                bare_now = False
                request = self._request(replica, state, texts, fmt, dims, call, bare)
            except BaseException:
                if probe:
                    replica.probing = False
                raise
            metrics = replica.metrics
            replica.begin()
            metrics.request_started()
            started = time.perf_counter()
            outcome = "cancelled"
            status: int | None = None
            error: QwenEmbedError | None = None
            fresh = True
            answered = 0.0
            try:
                try:
                    reply: Reply = yield Send(replica, request)
                except QwenEmbedError as exc:
                    error = exc
                    fresh = bool(getattr(exc, "fresh", True))
                    outcome = type(exc).__name__
                else:
                    answered = time.perf_counter()  # before decoding: the server's time
                    fresh = reply.fresh
                    status = reply.status
                    replica.answered = True
                    if reply.status >= 300:
                        error = self.status_error(reply, replica, profile)
                        outcome = type(error).__name__
                    else:
                        try:
                            payload = parse_body(reply.body)
                            self._observe(replica, state, reply, payload)
                            rows, sq = decode_rows(payload, indices)
                        except ResponseError as exc:
                            exc.url = exc.url or replica.label
                            if exc.args:  # it may quote the body: never the key
                                exc.args = (scrub(str(exc.args[0]), *self.secrets),)
                            error = exc
                            outcome = "rejected"
                        else:
                            outcome = "ok"
                            replica.succeeded(time.perf_counter() - started)
                            replica.recovered()
                            self._learn_bare(state, replica, bare, len(texts))
                            for other, why in failed_on.items():
                                if other is not replica:  # it failed where this one did not
                                    self.endpoint.failed(other, why, health=True)
                            if fmt == "base64":
                                state.base64_ok = True
                            elif force_float:
                                self._no_base64(
                                    state, replica, "failed with base64 but not with float"
                                )
                            if state.native_dim is None and dims is None:
                                state.native_dim = int(rows.shape[1])
                            if reply.http_version == "HTTP/2" and replica.key.http2:
                                pool.h2c_succeeded(replica.key)
                            self._check_usage(replica, state, texts, indices, payload)
                            if state.limit_inferred:
                                self._limit_held(replica, state, len(texts), retest)
                            return rows, sq, bad_rows(sq), replica, state, dims
            finally:
                replica.end()
                if probe:
                    replica.probing = False
                if retest and outcome == "cancelled":
                    state.retesting = False
                elapsed = time.perf_counter() - started
                metrics.request_finished(outcome, elapsed, len(texts) if outcome == "ok" else 0)
                if outcome == "ok" or error is not None:
                    self._sized(state, len(texts), (answered or started + elapsed) - started, error)
                if _log.isEnabledFor(logging.DEBUG):
                    _log.debug(
                        "POST %s texts=%d status=%s %.1f ms attempt=%d",
                        replica.label,
                        len(texts),
                        outcome if status is None else status,  # no HTTP status: the error
                        elapsed * 1000.0,
                        attempt,
                    )
            # ---- a failed attempt
            if error is None:  # cannot happen
                raise RuntimeError("internal error: error is None")
            self.endpoint.failed(replica, error)
            error = previous = _cause(error, previous, call)
            if retest:
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
                and not (multi and isinstance(error, ServerError))
            ):
                replica.succeeded(time.perf_counter() - started)  # it answered: alive
            if (
                isinstance(error, TransportError)
                and fresh
                and not error.refused
                and pool.h2c_fallback(replica.key)
            ):
                attempt = 0
                continue  # the server does not speak h2c: resend over HTTP/1.1 at once
            if (
                isinstance(error, NotFoundError)
                and not moved_prefix
                and state.url_override is None
                and replica.url.endswith("/v1")
                and error.message.strip() == "Not Found"
            ):
                # Infinity started without --url-prefix behind a /v1 base URL answers
                # FastAPI's 404 {"detail": "Not Found"}: its routes are at the root.
                moved_prefix = True
                state.url_override = f"{replica.url[: -len('/v1')]}/embeddings"
                state.profile, state.source = (
                    servers.PROFILES["infinity"],
                    "404 under /v1 (Infinity without --url-prefix)",
                )
                attempt = 0
                continue
            if isinstance(error, BadRequestError) and self._adapt(error, fmt, dims, state, replica):
                attempt = 0  # a new request (other options): its first try
                continue
            if force_float:
                force_float = False  # float failed too: base64 is not the cause
            elif not tried_float and self._float_may_help(error, fmt, state, multi):
                tried_float = force_float = True  # does float work where base64 failed?
                pin = replica  # on the same replica
                if classify(error) != "outage":
                    continue  # at once; an outage status: after its backoff, below
            if not tried_bare and self._try_bare(error, texts, state, bare):
                tried_bare = bare_now = True  # does the text go through as a bare string?
                pin = replica
                continue
            if (
                multi
                and replica_suspect(error)
                and (fresh or rs.stale_resent or not isinstance(error, NetworkError))
            ):
                failed_on.setdefault(replica, error)
                now = time.monotonic()
                left = call.remaining()
                if (left is None or left > 0) and any(
                    r not in failed_on and r.available(now) for r in self.endpoint.replicas
                ):
                    replica.retried(error, 0.0)
                    continue  # the batch may be fine: resend it on another replica at once
            if (
                (bisectable or bisecting)
                and maybe_input(error)
                and (fresh or rs.stale_resent or not isinstance(error, NetworkError))
                and (
                    rs.attempts >= 1
                    or bisecting
                    or classify(error) == "fatal"
                    or len(failed_on) >= 2
                )
            ):
                # failed again (a transient fault rarely repeats): one of the inputs,
                # or the batch's size, is the likelier cause: bisect (or, for a single
                # text, it is that text's error)
                error._replica = replica  # type: ignore[attr-defined]
                raise error
            delay = rs.next_delay(error, now=time.monotonic(), fresh_connection=fresh)
            delay = self.endpoint.first_contact(
                error, call.started, delay, self.config.retry.wait_for_server
            )
            if delay is None:
                error._replica = replica  # type: ignore[attr-defined]
                if multi and classify(error) != "fatal":
                    self.endpoint.name_failures(error)
                raise self._unreachable(error, call)
            if classify(error) == "outage" and len(self.endpoint.replicas) > 1:
                avoid = replica
                if any(
                    r is not replica and r.available(time.monotonic())
                    for r in self.endpoint.replicas
                ):
                    delay = 0.0  # another replica can take it now
            replica.retried(error, delay)
            if delay > 0:
                yield Sleep(delay)

    def batch_flow(
        self,
        call: Call,
        texts: Sequence[str],
        indices: Sequence[int],
        bis: _Bisection | None = None,
    ) -> Flow:
        """One batch to its ``Part``: splits, bisection and per-input failures."""
        part = Part()
        since = bis.since if bis is not None else time.monotonic()
        try:
            rows, sq, bad, replica, state, dims = yield from self.request_flow(
                call, texts, indices, bisectable=len(texts) > 1, bisecting=bis is not None
            )
        except _Split as split:
            if split.count is not None:
                runs = [
                    (i, min(i + split.count, len(texts))) for i in range(0, len(texts), split.count)
                ]
            else:
                from .protocol import split_by_tokens

                sizes = [estimate_tokens(t) for t in texts]
                runs = split_by_tokens(sizes, 0, len(texts), split.tokens, len(texts))
                if len(runs) == 1:
                    runs = [(0, len(texts) // 2), (len(texts) // 2, len(texts))]
            for start, stop in runs:
                sub = yield from self.batch_flow(call, texts[start:stop], indices[start:stop], bis)
                part.merge(sub, start)
            return part
        except BatchTooLargeError as exc:
            if len(texts) > 1:
                # Learn the stated (or halved) limit, then send the same texts again:
                # the replica's limit now splits them (``_Split``).
                self._learn_limit(exc, texts, getattr(exc, "_replica", None))
                return (yield from self.batch_flow(call, texts, indices, bis))
            return self._input_failed(call, part, 0, indices[0], exc, bis)
        except QwenEmbedError as exc:
            if len(texts) > 1 and maybe_input(exc):
                named = named_position(exc, len(texts))
                if named is not None:
                    return (yield from self._without(call, texts, indices, named, exc, bis))
                return (yield from self._bisect(call, texts, indices, exc, bis))
            if len(texts) != 1 or not input_error(exc):
                raise
            if not ambiguous(exc):
                return self._input_failed(call, part, 0, indices[0], exc, bis)
            if bis is not None:
                bis.input_failed = True  # not a batch that failed for its size
            try:
                found = yield from self._once_more(call, texts, indices, exc, since)
            except QwenEmbedError as again:
                if getattr(again, "_server_wide", False) or not input_error(again):
                    raise
                return self._input_failed(call, part, 0, indices[0], again, bis)
            rows, sq, bad, replica, state, dims = found
        call.last_ok = time.monotonic()
        if bis is not None:
            bis.ok += len(texts)
            bis.max_ok = max(bis.max_ok, len(texts))
            bis.ok_on[replica] = max(bis.ok_on.get(replica, 0), len(texts))
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

    def _bisect(
        self,
        call: Call,
        texts: Sequence[str],
        indices: Sequence[int],
        first: QwenEmbedError,
        bis: _Bisection | None,
    ) -> Flow:
        top = bis is None
        if bis is None:
            bis = _Bisection(since=time.monotonic())
            replica = getattr(first, "_replica", None)
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
            replica = getattr(first, "_replica", None)
            took = bis.ok_on.get(replica, 0) if replica is not None else 0
            if replica is not None and took:
                state = replica.state(self.model)
                state.size_failures.append(took)
                if len(state.size_failures) < 2:
                    return part  # once could be chance: wait for a second batch to say so
                if state.batch_limit is None or took < state.batch_limit:
                    state.batch_limit = took
                    state.limit_inferred = True  # retested later: it may have been a spell
                    state.ok_since_limit = 0
                    replica.metrics.fallback("batch_limit")
                    _log.warning(
                        "%s failed a batch of %d texts (%s) but took batches of %d: "
                        "sending at most %d texts per request from now on",
                        replica.label,
                        len(texts),
                        type(first).__name__,
                        took,
                        took,
                    )
        return part

    def _without(
        self,
        call: Call,
        texts: Sequence[str],
        indices: Sequence[int],
        named: int,
        exc: QwenEmbedError,
        bis: _Bisection | None,
    ) -> Flow:
        """The server named the bad input: fail it, send the others."""
        part = Part()
        if isinstance(exc, BadRequestError):
            exc.index = indices[named]
            exc.args = (f"{exc.args[0]} [input index {exc.index} of this call]",)
        self._input_failed(call, part, named, indices[named], exc, bis)
        if call.stop:
            return part
        for start, stop in ((0, named), (named + 1, len(texts))):
            if start < stop:
                sub = yield from self.batch_flow(call, texts[start:stop], indices[start:stop], bis)
                part.merge(sub, start)
        return part

    def _once_more(
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
        (``_control``); then the text is sent once more. Returns ``request_flow``'s
        result when it goes through; raises what it failed with the second time (the
        input's fault: the server worked just before)."""
        if call.last_ok < since:
            yield from self._control(call, indices[0], exc)
        replica = getattr(exc, "_replica", None)
        if replica is not None:
            replica.metrics.fallback("resent_alone")
        return (
            yield from self.request_flow(call, texts, indices, bisectable=False, bisecting=True)
        )

    def _control(self, call: Call, index: int, exc: QwenEmbedError) -> Flow:
        """Before blaming input ``index`` for ``exc`` (an answer that could be the
        server's as well as the input's) with no success since it was sent: send a
        known-good text with the same options. It succeeds -> returns (the input may be
        the cause). It fails too -> the server is down whatever the input: an outage,
        retried with backoff until the call's deadline; then (or at once, for a failure
        that is not retryable) ``exc`` is raised without an input index, in both
        ``on_error`` modes."""
        replica = getattr(exc, "_replica", None)
        if replica is not None:
            replica.metrics.fallback("control_requests")
        rs = RetryState(policy=self.config.retry, started=call.started, deadline=call.deadline)
        while True:
            try:
                yield from self.request_flow(
                    call, [_CONTROL_TEXT], [index], bisectable=False, bisecting=True
                )
            except QwenEmbedError as control:
                failed = control
            else:
                call.last_ok = time.monotonic()
                return
            if getattr(failed, "_server_wide", False):
                break  # fails fast (a server never reached), or failed already
            delay = rs.next_delay(failed, now=time.monotonic(), fresh_connection=True, outage=True)
            if delay is None:
                break
            delay = min(delay, _CONTROL_WAIT_MAX)  # a tiny probe: the job resumes soon after
            where = getattr(failed, "_replica", None) or replica
            if where is not None:
                where.retried(failed, delay)
            yield Sleep(delay)
        if failed is not exc and getattr(failed, "_server_wide", False):
            raise failed
        note = (
            " (a control request with a known-good text failed too "
            f"({type(failed).__name__}): the server fails whatever the input)"
        )
        if exc.args and note not in str(exc.args[0]):
            exc.args = (f"{exc.args[0]}{note}", *exc.args[1:])
        call.stop = True
        exc._server_wide = True  # type: ignore[attr-defined]
        raise exc

    def _input_failed(
        self,
        call: Call,
        part: Part,
        offset: int,
        index: int,
        exc: QwenEmbedError,
        bis: _Bisection | None,
    ) -> Part:
        """Input ``index`` cannot be embedded: raise (``"raise"``) or record it."""
        if bis is not None:
            bis.failed_leaves += 1
            bis.input_failed = True
        _pin(exc, index)
        if call.on_error == "raise":
            call.stop = True
            call.lowest = index if call.lowest is None else min(call.lowest, index)
            raise exc
        call.failures[index] = exc
        part.failed[offset] = exc
        _log.warning("skipping input index %d: %s", index, exc)
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


def _pin(exc: QwenEmbedError, index: int) -> None:
    """Give ``exc`` the caller's input index (and say it in the message once)."""
    current = getattr(exc, "index", None)
    if current is None:
        exc.index = index  # type: ignore[attr-defined]
    text = str(exc.args[0]) if exc.args else ""
    if (
        isinstance(exc, HTTPStatusError | ResponseError | TransportError)
        and "input index" not in text
    ):
        exc.args = (f"{text} [input index {index} of this call]",)


def _cause(error: QwenEmbedError, previous: QwenEmbedError | None, call: Call) -> QwenEmbedError:
    """The error to act on: a retry that the call's deadline cut short (a timeout with no
    time left) says nothing new: the failure it retried is the cause."""
    left = call.remaining()
    if previous is None or left is None or left > 0.01:
        return error
    return previous if isinstance(error, TimeoutException) else error
