"""What the engine learns from a server's answers, and how it applies it: base64 and
``dimensions`` refusals, a 5xx only for base64 (float tried), a one-item ``input`` list
refused (a bare string tried), batch and token limits, MRL slicing and normalisation, silent
truncation (``usage``), and the llama.cpp ``<|endoftext|>`` check. A mixin of
``_engine.Engine`` (its state lives on the replicas: ``_balance.ReplicaState``)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from ._balance import RETEST_EVERY, Endpoint, Replica, ReplicaState
from ._config import EmbeddingConfig, Timeouts
from ._protocol import (
    FloatArray,
    estimate_tokens,
    normalize_rows,
    truncation_suspects,
    usage_prompt_tokens,
)
from ._retry import BACKEND_STATUS, classify
from ._run import Send
from ._transport import Request
from .errors import (
    AuthenticationError,
    BadRequestError,
    BatchTooLargeError,
    ContextLengthError,
    HTTPStatusError,
    NotFoundError,
    PoolTimeout,
    QwenEmbedError,
    RateLimitError,
    ResponseError,
    ServerError,
    TimeoutException,
)

if TYPE_CHECKING:
    from ._run import Call, Flow

__all__ = ["Learning"]

_log = logging.getLogger("qwen_embed_plugins")

_BASE64_REFUSED = re.compile(r"base64|encoding[_ ]format", re.I)
_DIMENSIONS_REFUSED = re.compile(r"dimension|matryoshka|mrl", re.I)
_EOS_ID = 151643  # Qwen2/Qwen3 <|endoftext|> (qwen.tiktoken / tokenizer_config.json)
_MAX_WARNINGS = 5
_ONE_WAVE = 8
"""A ``batch_size="auto"`` call whose texts fill the window with batches of at most this
many times the sizer's start (8 x 32 = 256 texts) is sent in one wave of them; a longer
call starts the growth of a replica that has decided nothing yet at that size (see
``auto_batch_size``)."""


class Learning:
    """The learning half of ``Engine`` (see the module docstring)."""

    config: EmbeddingConfig
    model: str
    timeouts: Timeouts
    headers: Any
    endpoint: Endpoint

    def ctx(self, replica: Replica) -> Any:  # provided by Engine
        raise NotImplementedError

    def batch_limits(self) -> tuple[int | None, int | None]:  # provided by Engine
        raise NotImplementedError

    def _adapt(
        self,
        exc: BadRequestError,
        fmt: str,
        dims: int | None,
        state: ReplicaState,
        replica: Replica,
    ) -> bool:
        """Learn from a 400 that the server refuses base64 or ``dimensions``; ``True``
        when the request should be resent with other options."""
        message = exc.message
        if (
            fmt == "base64"
            and self.config.encoding_format == "auto"
            and _BASE64_REFUSED.search(message)
        ):
            self._no_base64(state, replica, "refused encoding_format=base64")
            return True
        if dims is not None and _DIMENSIONS_REFUSED.search(message):
            state.dimensions_ok = False
            replica.metrics.fallback("client_side_dimensions")
            _log.warning(
                "%s rejected dimensions=%d; slicing and renormalising client-side",
                replica.label,
                dims,
            )
            return True
        return False

    def _float_may_help(
        self, error: QwenEmbedError, fmt: str, state: ReplicaState, multi: bool
    ) -> bool:
        """Whether to try float on the same replica after ``error``: a 5xx (or TEI's 424)
        to a base64 request, on a replica not yet seen to answer base64 (a gateway that
        fails decoding base64 answers 502 ``upstream_decode_error``). An outage status
        with other replicas: the batch goes to another one instead."""
        if not isinstance(error, ServerError) or fmt != "base64":
            return False
        if self.config.encoding_format != "auto" or state.base64_ok is not None:
            return False
        return not (multi and classify(error) == "outage")

    def _try_bare(
        self, error: QwenEmbedError, texts: Sequence[str], state: ReplicaState, bare: bool
    ) -> bool:
        """Whether to resend a one-text request with ``input`` as a bare string: its
        one-item list was refused (a 500 or a 4xx; SGLang 0.4.6 fails ``["text"]`` but
        embeds ``"text"``) by a server not yet seen to take one-item lists."""
        if len(texts) != 1 or bare or state.bare_input is not None:
            return False
        if isinstance(error, ServerError):
            return error.status in BACKEND_STATUS
        return isinstance(error, HTTPStatusError) and not isinstance(
            error,
            AuthenticationError
            | NotFoundError
            | RateLimitError
            | BatchTooLargeError
            | ContextLengthError,
        )

    def _learn_bare(self, state: ReplicaState, replica: Replica, bare: bool, texts: int) -> None:
        """A request succeeded: learn whether the replica needs a bare string."""
        if texts != 1 or state.bare_input is not None:
            return
        state.bare_input = bare
        if bare:
            replica.metrics.fallback("bare_string_input")
            _log.warning(
                "%s refused a one-item input list but took the text as a bare string; "
                "sending one-text requests that way from now on",
                replica.label,
            )

    def _no_base64(self, state: ReplicaState, replica: Replica, why: str) -> None:
        if state.base64_ok is not False:
            state.base64_ok = False
            replica.metrics.fallback("float_encoding")
            _log.warning("%s %s; using float from now on", replica.label, why)

    def _learn_limit(
        self, exc: BatchTooLargeError, texts: Sequence[str], replica: Replica | None
    ) -> None:
        targets = [replica] if replica is not None else list(self.endpoint.replicas)
        for target in targets:
            state = target.state(self.model)
            if exc.tokens:
                sent = sum(estimate_tokens(t) for t in texts)
                cap = exc.token_limit if exc.token_limit and exc.token_limit < sent else sent // 2
                cap = max(1, int(cap * 0.9))  # estimates are not exact: keep a margin
                if state.token_limit is None or cap < state.token_limit:
                    state.token_limit = cap
                    target.metrics.fallback("token_limit")
                    _log.warning(
                        "%s accepts at most %s tokens per request; splitting batches at "
                        "about %d estimated tokens",
                        target.label,
                        exc.token_limit or "fewer",
                        cap,
                    )
            else:
                limit = exc.limit if exc.limit is not None and exc.limit < len(texts) else None
                limit = limit or max(1, len(texts) // 2)
                if state.batch_limit is None or limit < state.batch_limit:
                    state.batch_limit = limit
                    state.limit_inferred = False  # stated (or refused): kept for good
                    target.metrics.fallback("batch_limit")
                    _log.warning(
                        "%s accepts at most %d texts per request; splitting batches",
                        target.label,
                        limit,
                    )

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

    def auto_batch_size(self, remaining: int, window: int) -> int:
        """The texts to put in the next batch of a ``batch_size="auto"`` call that has
        ``remaining`` texts left and up to ``window`` batches in flight.

        The largest size a replica's ``BatchSizer`` asks for now; but when a window's
        share of ``remaining`` is smaller, that share (not below the sizer's start), so
        the last batches of a call still fill the window; and when the share is larger
        but within ``_ONE_WAVE`` x the start (and below any size a replica refused), the
        share: a call that fits in one wave of moderate batches goes in one wave. A longer
        call starts the growth of a replica that has decided nothing yet at that one-wave
        size (``BatchSizer.leap``; at most the known or learned limit on texts per
        request), not at the start: its first round trips then carry ``_ONE_WAVE`` times
        the texts. Not under a limit on tokens per request, nor under a text limit at or
        below the start: batches cut below the level would leave the sizer blind. Known
        and learned limits are applied by the caller."""
        size = 0
        start = 1
        bound = 1 << 30
        sizers = [replica.state(self.model).sizer for replica in self.endpoint.replicas]
        for sizer in sizers:
            size = max(size, sizer.size(sizer.wants(remaining, window)))
            start = max(start, sizer.start)
            bound = min(bound, sizer.bound)
        share = -(-remaining // max(1, window))
        if share <= size:
            return max(1, min(size, max(start, share)))
        wave = min(_ONE_WAVE * start, bound)
        if share <= wave:
            return share
        count, tokens = self.batch_limits()
        if tokens is not None or (count is not None and count <= start):
            return size  # batches cut below the level would leave the sizer blind
        wave = wave if count is None else min(wave, count)
        return max([size, *(sizer.leap(wave) for sizer in sizers)])

    def _sized(
        self, state: ReplicaState, texts: int, seconds: float, error: QwenEmbedError | None
    ) -> None:
        """Feed an answered request to the replica's ``BatchSizer`` (``batch_size="auto"``
        only): its latency, or the overload (429, 503, a timeout) or refused size (413,
        422, a token cap) it met."""
        if self.config.batch_size != "auto":
            return
        if error is None:
            state.sizer.observe(texts, seconds)
        elif isinstance(error, BatchTooLargeError):
            state.sizer.observe(texts, seconds, too_large=True)
        elif (isinstance(error, HTTPStatusError) and error.status in (429, 503)) or (
            isinstance(error, TimeoutException) and not isinstance(error, PoolTimeout)
        ):
            state.sizer.observe(texts, seconds, overload=True)

    def _finish(
        self,
        arr: FloatArray,
        sq: FloatArray,
        sent_dims: int | None,
        bad: dict[int, str],
        state: ReplicaState,
        replica: Replica,
    ) -> FloatArray:
        """Apply MRL ``dimensions`` and normalisation to a decoded batch (``n x dim``)."""
        want = self.config.dimensions
        if want is not None:
            if arr.shape[1] < want:
                raise ResponseError(
                    f"{replica.label} returned {arr.shape[1]}-dimensional vectors, fewer than "
                    f"dimensions={want}",
                    url=replica.label,
                )
            if (
                arr.shape[1] > want
                and sent_dims is not None
                and arr.shape[1] != sent_dims
                and state.dimensions_ok is not False
            ):
                state.dimensions_ok = False
                state.native_dim = int(arr.shape[1])
                replica.metrics.fallback("client_side_dimensions")
                _log.warning(
                    "%s ignored dimensions=%d (returned %d); slicing client-side",
                    replica.label,
                    want,
                    arr.shape[1],
                )
        if bad:
            arr = arr.copy() if not arr.flags.writeable else arr
            for row in bad:
                arr[row] = np.nan
                sq[row] = 1.0
        if want is not None or self.config.normalize:
            arr, _ = normalize_rows(arr, want, squared_norms=sq)
        return arr

    def _check_usage(
        self,
        replica: Replica,
        state: ReplicaState,
        texts: Sequence[str],
        indices: Sequence[int],
        payload: object,
    ) -> None:
        reported = usage_prompt_tokens(payload)
        if reported is None:
            return
        # no text is suspect while the report is at least half of the estimates
        # (``truncation_suspects``): for one text, its estimate; for a batch, first an
        # upper bound of theirs (``estimate_tokens`` <= characters + 1 per text)
        if len(texts) == 1:
            if reported * 2 >= estimate_tokens(texts[0]):
                return
        elif reported * 2 >= sum(map(len, texts)) + len(texts):
            return
        estimates = [estimate_tokens(t) for t in texts]
        for pos, estimate, cap in truncation_suspects(estimates, reported):
            replica.metrics.fallback("truncated_input")
            warned = sum(1 for w in state.warned if w.startswith("trunc:"))
            if warned < _MAX_WARNINGS:
                state.warned.add(f"trunc:{indices[pos]}:{time.monotonic()}")
                capped = f" (a cap of {cap} tokens)" if cap else ""
                _log.warning(
                    "%s probably truncated input index %d: about %d tokens estimated, the "
                    "server reported %d for its request%s; its vector covers only the start",
                    replica.label,
                    indices[pos],
                    estimate,
                    reported,
                    capped,
                )

    def _eos_check(self, call: Call, replica: Replica, state: ReplicaState) -> Flow:
        """llama.cpp: check once whether the server appends ``<|endoftext|>`` (the token
        Qwen3-Embedding pools) by tokenising a probe with ``add_special``."""
        state.eos_checked = True
        root = replica.url[: -len("/v1")] if replica.url.endswith("/v1") else replica.url
        body = orjson.dumps({"content": "probe", "add_special": True})
        t = self.timeouts
        request = Request(
            "POST",
            f"{root}/tokenize",
            body,
            self.headers,
            t,
            min(t.total or 5.0, 5.0),
            1 << 20,
            self.ctx(replica),
        )
        try:
            reply = yield Send(replica, request)
        except QwenEmbedError:
            return
        if reply.status != 200:
            return
        try:
            tokens = orjson.loads(reply.body).get("tokens")
        except (orjson.JSONDecodeError, AttributeError):
            return
        if isinstance(tokens, list) and tokens and tokens[-1] != _EOS_ID:
            replica.metrics.fallback("eos_missing")
            _log.warning(
                "%s does not append <|endoftext|> to inputs; Qwen3-Embedding pools that "
                "last token, so its vectors are degraded. Set append_eos=True to add it "
                "client-side (or start llama.cpp with the model's EOS setting)",
                replica.label,
            )
