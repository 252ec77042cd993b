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
  ``max_attempts`` times, stale keep-alive and refused HTTP/2 streams at once);
- adaptations learned per replica: base64 -> float (on a refusal, or a 5xx a float
  retry does not reproduce), client-side ``dimensions``, a batch or token limit stated
  in a refusal, a missing ``/v1`` prefix (Infinity), h2c -> HTTP/1.1;
- bisection: a batch that fails in a way one input can cause (500, a connection
  dropped after the request was sent, a 400 that names no input) is split and the
  halves resent until the failing input(s) are isolated; every other text is embedded,
  and the error names the caller's index. A batch whose every half succeeds failed for
  its size: the replica's batch limit is learned;
- what reaches the caller: ``on_error="raise"`` raises the first bad input's error
  (the lowest index), ``"skip"`` leaves ``None`` in its slot and reports the error.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import pool, servers
from ._learn import Learning
from ._run import Call, Flow, Part, Send, Sleep
from .balance import RETEST_EVERY, RETEST_EVERY_MAX, Endpoint, Replica, ReplicaState, endpoint_for
from .config import EmbeddingConfig, OnError, insecure_key_target, known_model_dims
from .errors import (
    BadRequestError,
    BatchTooLargeError,
    ConfigError,
    ContextLengthError,
    ErrorContext,
    HTTPStatusError,
    NetworkError,
    NotFoundError,
    QwenEmbedError,
    ResponseError,
    ServerError,
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
)
from .retry import RetryState, classify, is_health_failure, parse_retry_after, retry_reason
from .transport import Reply, Request

__all__ = ["Engine"]

_log = logging.getLogger("qwen_embed_plugins")

_BASE64_REFUSED = re.compile(r"base64|encoding[_ ]format", re.I)
_DIMENSIONS_REFUSED = re.compile(r"dimension|matryoshka|mrl", re.I)
_SERVER_POSITION = re.compile(r"\b(?:index|input|item)\s*(?:at\s+(?:index\s+)?)?\[?(\d+)\]?", re.I)
_EOS = "<|endoftext|>"
_EOS_ID = 151643  # Qwen2/Qwen3 <|endoftext|> (qwen.tiktoken / tokenizer_config.json)
_MAX_RESPONSE_FLOOR = 1 << 20
_BYTES_PER_VALUE = 32  # a float in JSON: "-0.012345678901234567," is 22; room to spare
_DIM_GUESS = 8192
_CONTROL_TEXT = "hello"  # a control request's input: any server embeds it
_MAX_WARNINGS = 5


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
        self.headers = _Headers(self._api_key)
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
        """The API key (for scrubbing and the SDK); ``None`` without one."""
        return self.config.api_key_value()

    # ---------------------------------------------------------------- per replica

    def ctx(self, replica: Replica) -> ErrorContext:
        found = self._contexts.get(replica.url)
        if found is None:
            t = self.timeouts
            found = self._contexts[replica.url] = ErrorContext(
                url=replica.label,
                secret=self._api_key,
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
    ) -> Request:
        if self.append_eos:
            texts = [t if t.endswith(_EOS) else t + _EOS for t in texts]
        body = encode_request(texts, model=self.model, encoding_format=fmt, dimensions=dims)
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
            where = scrub(reply.headers.get("location", ""), self.secret)[:200]
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
            secret=self.secret,
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

    def _on_retry(self, replica: Replica, exc: QwenEmbedError, delay: float) -> None:
        reason = retry_reason(exc) or "unknown"
        stale = delay == 0.0 and isinstance(exc, NetworkError) and not exc.refused
        replica.metrics.retry(reason, stale=stale)
        _log.warning("retrying %s after %s in %.3f s: %s", replica.label, reason, delay, exc)

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
        moved_prefix = False
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
                request = self._request(replica, state, texts, fmt, dims, call)
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
                                exc.args = (scrub(str(exc.args[0]), self.secret),)
                            error = exc
                            outcome = "rejected"
                        else:
                            outcome = "ok"
                            replica.succeeded(time.perf_counter() - started)
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
            if (
                isinstance(error, ServerError)
                and error.status == 500
                and fmt == "base64"
                and self.config.encoding_format == "auto"
                and state.base64_ok is None
                and not tried_float
            ):
                tried_float = force_float = True  # does float work where base64 failed?
                pin = replica  # on the same replica
                continue
            if force_float:
                force_float = False  # float failed too: base64 is not the cause
            if (
                multi
                and _replica_suspect(error)
                and (fresh or rs.stale_resent or not isinstance(error, NetworkError))
            ):
                failed_on.setdefault(replica, error)
                now = time.monotonic()
                left = call.remaining()
                if (left is None or left > 0) and any(
                    r not in failed_on and r.available(now) for r in self.endpoint.replicas
                ):
                    self._on_retry(replica, error, 0.0)
                    continue  # the batch may be fine: resend it on another replica at once
            if (
                (bisectable or bisecting)
                and _maybe_input(error)
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
            if delay is None:
                error._replica = replica  # type: ignore[attr-defined]
                if multi and classify(error) != "fatal":
                    self._name_every_replica(error)
                raise error
            if classify(error) == "outage" and len(self.endpoint.replicas) > 1:
                avoid = replica
                if any(
                    r is not replica and r.available(time.monotonic())
                    for r in self.endpoint.replicas
                ):
                    delay = 0.0  # another replica can take it now
            self._on_retry(replica, error, delay)
            if delay > 0:
                yield Sleep(delay)

    def _limit_held(self, replica: Replica, state: ReplicaState, texts: int, retest: bool) -> None:
        """A request succeeded on a replica with an inferred batch limit."""
        if not retest:
            state.ok_since_limit += 1
            return
        _log.info(
            "%s took a batch of %d texts above its inferred limit of %s: limit lifted",
            replica.label,
            texts,
            state.batch_limit,
        )
        state.batch_limit = None
        state.limit_inferred = False
        state.size_failures.clear()
        state.retesting = False
        state.ok_since_limit = 0
        state.retest_every = RETEST_EVERY
        replica.metrics.fallback("batch_limit_lifted")

    def _name_every_replica(self, error: QwenEmbedError) -> None:
        """Say in ``error`` what every replica of the endpoint last failed with."""
        failures = {r.label: r.last_error for r in self.endpoint.replicas if r.last_error}
        if failures:
            said = "; ".join(f"{label}: {err}" for label, err in failures.items())
            error.args = (f"{error.args[0]} (every replica failed; last failures: {said})",)
            error.failures = failures  # type: ignore[attr-defined]

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
            if len(texts) > 1 and _maybe_input(exc):
                named = _named_position(exc, len(texts))
                if named is not None:
                    return (yield from self._without(call, texts, indices, named, exc, bis))
                return (yield from self._bisect(call, texts, indices, exc, bis))
            if len(texts) == 1 and _input_error(exc):
                if _ambiguous(exc) and call.last_ok < since:
                    yield from self._control(call, indices[0], exc)
                return self._input_failed(call, part, 0, indices[0], exc, bis)
            raise
        call.last_ok = time.monotonic()
        if bis is not None:
            bis.ok += len(texts)
            bis.max_ok = max(bis.max_ok, len(texts))
            bis.ok_on[replica] = max(bis.ok_on.get(replica, 0), len(texts))
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

    def _control(self, call: Call, index: int, exc: QwenEmbedError) -> Flow:
        """Before blaming input ``index`` for ``exc`` (an answer that could be the
        server's as well as the input's: a 500, a dropped connection, a 400 naming no
        input) with no success since it was sent: send a known-good text with the same
        options once. It succeeds -> the input is the cause (returns); it fails -> the
        server is, whatever the input: ``exc`` is raised without an input index, in
        both ``on_error`` modes."""
        replica = getattr(exc, "_replica", None)
        if replica is not None:
            replica.metrics.fallback("control_requests")
        try:
            yield from self.request_flow(
                call, [_CONTROL_TEXT], [index], bisectable=False, bisecting=True
            )
        except QwenEmbedError as control:
            failed: QwenEmbedError | None = control
        else:
            failed = None
        if failed is None:
            call.last_ok = time.monotonic()
            return
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
    """The request headers of a client: the ``Authorization`` value is built from the
    ``Secret`` only when the transport reads it, and never appears in a ``repr``."""

    __slots__ = ("_base", "_key")

    def __init__(self, key: Any) -> None:
        self._key = key
        self._base = {"Content-Type": "application/json", "Accept": "application/json"}

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
        shown = dict(self._base)
        if self._key is not None:
            shown["Authorization"] = "Bearer **********"
        return f"_Headers({shown!r})"


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


def _replica_suspect(exc: BaseException) -> bool:
    """A failure the replica may have caused rather than the batch: worth one resend on
    another replica before anything else (connection errors and drops, timeouts, 5xx)."""
    if isinstance(exc, ServerError):
        return True
    return isinstance(exc, TransportError) and classify(exc) in ("outage", "transient")


def _maybe_input(exc: BaseException) -> bool:
    """A failure of a multi-text batch that one of its inputs may have caused."""
    if isinstance(exc, BatchTooLargeError):
        return False
    if isinstance(exc, ServerError):
        return exc.status == 500
    if isinstance(exc, ContextLengthError):
        return True
    if isinstance(exc, BadRequestError):
        # a 400 naming a position in the request is that input's; others are the
        # request's own (a wrong model name, a bad parameter): not bisected
        return _SERVER_POSITION.search(exc.message) is not None
    if isinstance(exc, TransportError):
        return isinstance(exc, NetworkError) and exc.sent and not exc.refused and not exc.received
    return False


def _input_error(exc: BaseException) -> bool:
    """A failure of a single-text request that belongs to that input."""
    if isinstance(exc, ServerError):
        return exc.status == 500
    if isinstance(exc, BadRequestError):
        return True
    if isinstance(exc, ResponseError):
        return exc.index is not None
    return isinstance(exc, NetworkError) and exc.sent and not exc.refused and not exc.received


def _ambiguous(exc: BaseException) -> bool:
    """A single input's failure that the server may have caused whatever the input."""
    if isinstance(exc, ServerError | NetworkError):
        return True
    return (
        isinstance(exc, BadRequestError)
        and not isinstance(exc, ContextLengthError | BatchTooLargeError)
        and _SERVER_POSITION.search(exc.message) is None
    )


def _named_position(exc: QwenEmbedError, count: int) -> int | None:
    if not isinstance(exc, BadRequestError):
        return None
    match = _SERVER_POSITION.search(exc.message)
    if match and int(match.group(1)) < count:
        return int(match.group(1))
    return None
