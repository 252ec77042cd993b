"""What is learned about a replica's server, in one place: the facts (``ReplicaState``,
one per replica and model) and the decisions that learn and apply them.

The server's profile (``profile``, ``identify``); the options a request is sent with
(``wire``); base64 and ``dimensions`` refusals (``adapt``); a 5xx only for base64 (float
tried: ``float_may_help``, ``no_base64``); a one-item ``input`` list refused (a bare
string tried: ``try_bare``, ``learn_bare``); Infinity's routes at the root
(``learn_root_path``); MRL slicing and normalisation, with ``dimensions`` ignored
(``finish``); silent truncation (``usage``: ``check_usage``); the llama.cpp
``<|endoftext|>`` check (``eos_probe``, ``eos_answer``); the batch caps a refusal
teaches (``learn_stated_limit``, ``learn_cap``, ``learn_refused_size``,
``learn_inferred_limit``), kept in ``_batching.BatchState`` (``ReplicaState.batch``).

Plain functions: the engine (``_engine.Engine``) calls them with what they need, the
replica's state among it; no I/O here.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from . import _servers as servers
from ._batching import BatchState, ReplicaView, text_bytes
from ._config import EmbeddingConfig, known_model_dims
from ._protocol import (
    FloatArray,
    estimate_tokens,
    normalize_rows,
    truncation_suspects,
    usage_prompt_tokens,
)
from ._retry import BACKEND_STATUS, classify
from ._server_text import LimitUnit
from .errors import (
    AuthenticationError,
    BadRequestError,
    BatchTooLargeError,
    ContextLengthError,
    HTTPStatusError,
    NotFoundError,
    QwenEmbedError,
    RateLimitError,
    ResponseError,
    ServerError,
)

__all__ = [
    "ReplicaState",
    "Stripped",
    "adapt",
    "check_usage",
    "eos_answer",
    "eos_probe",
    "finish",
    "float_may_help",
    "identify",
    "kept_stripped",
    "learn_bare",
    "learn_cap",
    "learn_inferred_limit",
    "learn_refused_size",
    "learn_root_path",
    "learn_stated_limit",
    "no_base64",
    "no_dimensions",
    "profile",
    "strip_fields",
    "try_bare",
    "undo_stripped",
    "wire",
]

_log = logging.getLogger("qwen_embed_plugins")

_BASE64_REFUSED = re.compile(r"base64|encoding[_ ]format", re.I)
_DIMENSIONS_REFUSED = re.compile(r"dimension|matryoshka|mrl", re.I)
_UNKNOWN_FIELD = re.compile(
    r"extra (?:fields?|inputs?|keys?|param\w*) (?:are |is )?not (?:permitted|allowed)"
    r"|(?:unknown|unrecognized|unrecognised|unexpected|unsupported) "
    r"(?:request )?(?:field|param\w*|argument|key|propert\w*)"
    r"|additional propert\w* (?:are |is )?not allowed|not a valid (?:field|param\w*)",
    re.I,
)
_EOS_ID = 151643  # Qwen2/Qwen3 <|endoftext|> (qwen.tiktoken / tokenizer_config.json)
_MAX_WARNINGS = 5
_BODY_ROOM = 512  # bytes of a request body besides its texts (model, fields, brackets)


@dataclass
class ReplicaState:
    """What the process has learned about one replica's server for one model.

    Attributes:
        base64_ok: ``False`` once the server refused (or broke on) base64; ``True``
            once a base64 answer decoded.
        dimensions_ok: ``False`` once the server refused or ignored ``dimensions``.
        native_dim: the model's full vector size as the server returned it.
        profile: the server profile identified from its answers (``None``: not yet).
        source: how ``profile`` was found (for ``servers.Detection``).
        eos_checked: whether the ``<|endoftext|>`` check ran (llama.cpp only).
        url_override: the embeddings URL to use instead of ``{base_url}/embeddings``.
        bare_input: ``True`` once the server refused a one-item ``input`` list but took
            the text as a bare string (one-text requests are then sent that way);
            ``False`` once it took a one-item list.
        warned: the one-off warnings already logged for it.
        batch: its batch and token limits, and the batch size found from its latencies
            (``_batching.BatchState``).
    """

    base64_ok: bool | None = None
    dimensions_ok: bool | None = None
    native_dim: int | None = None
    profile: Any = None
    source: str = ""
    eos_checked: bool = False
    url_override: str | None = None
    bare_input: bool | None = None
    warned: set[str] = field(default_factory=set)
    batch: BatchState = field(default_factory=BatchState)


# --------------------------------------------------------------------------- options


def profile(state: ReplicaState, url: str) -> servers.ServerProfile:
    """The server profile of the replica at base URL ``url``: the one identified so far
    (from the URL itself at first: ``servers.identify_url``), else the generic one."""
    if state.profile is None:
        found = servers.identify_url(url)
        if found is not None:
            state.profile, state.source = found.profile, found.source
    found_profile = state.profile
    return servers.GENERIC if found_profile is None else found_profile


def wire(
    config: EmbeddingConfig, model: str, state: ReplicaState, profile: servers.ServerProfile
) -> tuple[str, int | None]:
    """(``encoding_format``, ``dimensions`` to send) for this replica now; float is
    sent without the field (``_protocol.encode_request``), and a field set to ``None``
    in ``extra_body`` is never sent."""
    fmt: str = config.encoding_format
    extra = config.extra_body or {}
    if "encoding_format" in extra:  # None there: the field is never sent (float)
        fmt = "float"
    elif fmt == "auto":
        fmt = "float" if state.base64_ok is False or not profile.base64 else "base64"
    want = config.dimensions
    if want is None or state.dimensions_ok is False or "dimensions" in extra:
        return fmt, None  # "dimensions": None in extra_body: never sent (sliced here)
    native = state.native_dim or known_model_dims(model)
    if native is not None and want >= native:
        return fmt, None  # the full size: nothing to ask for
    return fmt, servers.wire_dimensions(profile, want, model)


def adapt(
    config: EmbeddingConfig,
    exc: BadRequestError,
    fmt: str,
    dims: int | None,
    state: ReplicaState,
    replica: ReplicaView,
) -> bool:
    """Learn from a 4xx that the server refuses base64 or ``dimensions``, or a field
    it does not know (``_UNKNOWN_FIELD``: "extra fields not permitted", "Extra inputs
    are not permitted", ...; the ``encoding_format`` field goes first, as float is the
    API's default and is sent without it); ``True`` when the request should be resent
    with other options. Learned once per replica and logged once: a request in flight
    meanwhile is resent with what was learned, unlogged."""
    message = exc.message
    names_dims = _DIMENSIONS_REFUSED.search(message) is not None
    unknown = _UNKNOWN_FIELD.search(message) is not None
    names_format = _BASE64_REFUSED.search(message) is not None
    if (
        fmt == "base64"
        and config.encoding_format == "auto"
        and (names_format or (unknown and not names_dims))
    ):
        no_base64(state, replica, "refused encoding_format=base64")
        return True
    if dims is not None and (names_dims or unknown):
        no_dimensions(state, replica, f"rejected dimensions={dims}")
        return True
    return False


def no_dimensions(state: ReplicaState, replica: ReplicaView, why: str) -> None:
    """The replica refuses ``dimensions`` (``why``): sliced and renormalised here from
    now on (logged once)."""
    if state.dimensions_ok is not False:
        state.dimensions_ok = False
        replica.metrics.fallback("client_side_dimensions")
        _log.warning("%s %s; slicing and renormalising client-side", replica.label, why)


@dataclass(frozen=True, slots=True)
class Stripped:
    """The fields the client adds on its own that a control request left out
    (``strip_fields``), and the replica's options before."""

    base64: bool
    dims: int | None
    before: tuple[bool | None, bool | None]


def strip_fields(
    config: EmbeddingConfig, model: str, state: ReplicaState, url: str
) -> Stripped | None:
    """Leave out of the replica's requests, on trial, every field the client adds on its
    own (``encoding_format=base64`` in the ``"auto"`` mode, ``dimensions``): a server
    that refused a control request with them, in whatever words, may take one without
    them. ``None`` when no such field is sent. Kept (``kept_stripped``) or undone
    (``undo_stripped``) by what the next control request shows."""
    fmt, dims = wire(config, model, state, profile(state, url))
    base64 = fmt == "base64" and config.encoding_format == "auto"
    if not base64 and dims is None:
        return None
    stripped = Stripped(base64, dims, (state.base64_ok, state.dimensions_ok))
    if base64:
        state.base64_ok = False
    if dims is not None:
        state.dimensions_ok = False
    return stripped


def undo_stripped(state: ReplicaState, stripped: Stripped) -> None:
    """The control request failed without the fields too: they were not the cause."""
    state.base64_ok, state.dimensions_ok = stripped.before


def kept_stripped(state: ReplicaState, replica: ReplicaView, stripped: Stripped) -> None:
    """The control request went through without the fields: learned for the replica
    (one WARNING; which of two fields was refused is not tried apart)."""
    state.base64_ok, state.dimensions_ok = stripped.before
    fields, now = [], []
    if stripped.base64 and state.base64_ok is not False:
        state.base64_ok = False
        replica.metrics.fallback("float_encoding")
        fields.append("encoding_format=base64")
        now.append("float, without the field")
    if stripped.dims is not None and state.dimensions_ok is not False:
        state.dimensions_ok = False
        replica.metrics.fallback("client_side_dimensions")
        fields.append(f"dimensions={stripped.dims}")
        now.append("dimensions sliced and renormalised client-side")
    if fields:
        _log.warning(
            "%s refused requests with %s, whatever the input, and took one without: %s from now on",
            replica.label,
            " and ".join(fields),
            "; ".join(now),
        )


def float_may_help(
    config: EmbeddingConfig, error: QwenEmbedError, fmt: str, state: ReplicaState, multi: bool
) -> bool:
    """Whether to try float on the same replica after ``error``: a 5xx (or TEI's 424)
    to a base64 request, on a replica not yet seen to answer base64 (a gateway that
    fails decoding base64 answers 502 ``upstream_decode_error``). An outage status
    with other replicas: the batch goes to another one instead."""
    if not isinstance(error, ServerError) or fmt != "base64":
        return False
    if config.encoding_format != "auto" or state.base64_ok is not None:
        return False
    return not (multi and classify(error) == "outage")


def no_base64(state: ReplicaState, replica: ReplicaView, why: str) -> None:
    """The replica fails base64 (``why``): float from now on (logged once)."""
    if state.base64_ok is not False:
        state.base64_ok = False
        replica.metrics.fallback("float_encoding")
        _log.warning("%s %s; using float from now on", replica.label, why)


def try_bare(
    error: QwenEmbedError,
    texts: Sequence[str],
    state: ReplicaState,
    bare: bool,
    *,
    control_first: bool = False,
) -> bool:
    """Whether to resend a one-text request with ``input`` as a bare string: its
    one-item list was refused (a 500 or a 4xx; SGLang 0.4.6 fails ``["text"]`` but
    embeds ``"text"``) by a server not yet seen to take one-item lists, or one that
    was learned to need bare strings while this request was in flight.
    ``control_first``: a 4xx waits for a control request to show the server working
    (``Bisector.single_failed`` then sends the bare string)."""
    if len(texts) != 1 or bare or state.bare_input is False:
        return False
    if state.bare_input is True:
        return True  # learned meanwhile (this request was in flight): resend as learned
    if isinstance(error, ServerError):
        return error.status in BACKEND_STATUS
    return (
        not control_first
        and isinstance(error, HTTPStatusError)
        and not isinstance(
            error,
            AuthenticationError
            | NotFoundError
            | RateLimitError
            | BatchTooLargeError
            | ContextLengthError,
        )
    )


def learn_bare(state: ReplicaState, replica: ReplicaView, bare: bool, texts: int) -> None:
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


def learn_root_path(error: QwenEmbedError, url: str, state: ReplicaState) -> bool:
    """Whether ``error`` (to the replica at base URL ``url``) is Infinity started without
    ``--url-prefix`` behind a ``/v1`` base URL: FastAPI's 404 ``{"detail": "Not Found"}``,
    its routes at the root. Then its embeddings URL and profile are learned and the
    request is resent there (``True``)."""
    if not (
        isinstance(error, NotFoundError)
        and state.url_override is None
        and url.endswith("/v1")
        and error.message.strip() == "Not Found"
    ):
        return False
    state.url_override = f"{url[: -len('/v1')]}/embeddings"
    state.profile, state.source = (
        servers.PROFILES["infinity"],
        "404 under /v1 (Infinity without --url-prefix)",
    )
    return True


# --------------------------------------------------------------------------- batch caps


def learn_stated_limit(
    batch: BatchState, replica: ReplicaView, exc: BatchTooLargeError, texts: Sequence[str]
) -> None:
    """``replica`` refused ``texts`` for their size (``exc``, a wording recognised as a
    batch or token refusal): learn the limit it stated (in tokens or texts), or half the
    batch when it stated none; kept for good."""
    if exc.tokens:
        learn_cap(batch, replica, "tokens", exc.token_limit, texts)
    else:
        learn_cap(batch, replica, "texts", exc.limit, texts)


def learn_cap(
    batch: BatchState,
    replica: ReplicaView,
    unit: LimitUnit,
    stated: int | None,
    texts: Sequence[str],
) -> bool:
    """``replica`` refused ``texts`` for their size, stating ``stated`` (``None``: no
    number) in ``unit`` (``_server_text.stated_limit``): learn a cap below what was sent
    (the stated one when it is below, else half of what was sent), kept for good and
    logged once; ``True`` when the replica's caps now split ``texts``. A byte limit
    caps the request body (its texts' ``text_bytes``, less a margin for the rest of
    the body), a character limit the texts' size likewise, a token limit the
    estimated tokens (``estimate_tokens``, with a margin: estimates are not exact)."""
    if unit == "texts":
        sent = len(texts)
        cap = stated if stated is not None and stated < sent else max(1, sent // 2)
        if batch.limit is not None and cap >= batch.limit:
            return len(texts) > batch.limit
        batch.limit, batch.limit_inferred = cap, False  # stated (or refused): for good
        replica.metrics.fallback("batch_limit")
        _log.warning(
            "%s accepts at most %d texts per request; splitting batches", replica.label, cap
        )
        return True
    if unit == "tokens":
        sent = sum(estimate_tokens(t) for t in texts)
        cap = stated if stated and stated < sent else sent // 2
        cap = max(1, int(cap * 0.9))
        if batch.token_limit is not None and cap >= batch.token_limit:
            return sent > batch.token_limit
        batch.token_limit = cap
        replica.metrics.fallback("token_limit")
        _log.warning(
            "%s accepts at most %s tokens per request; splitting batches at about %d "
            "estimated tokens",
            replica.label,
            stated or "fewer",
            cap,
        )
        return True
    sent = sum(text_bytes(t) for t in texts)
    room = stated
    if stated is not None and unit == "bytes":  # the body's other fields take some room
        room = stated - min(_BODY_ROOM, stated // 10)
    cap = room if room is not None and 0 < room < sent else sent // 2
    cap = max(1, int(cap * 0.9))  # JSON escapes: a margin
    if batch.size_limit is not None and cap >= batch.size_limit:
        return sent > batch.size_limit
    batch.size_limit = cap
    replica.metrics.fallback("size_limit")
    _log.warning(
        "%s accepts at most %s %s per request; splitting batches at about %d bytes of text",
        replica.label,
        stated or "fewer",
        unit,
        cap,
    )
    return True


def learn_refused_size(batch: BatchState, replica: ReplicaView, took: int, sent: int) -> None:
    """A batch of ``sent`` texts that ``replica`` refused (a 4xx, its limit unstated)
    went through in pieces, the largest of ``took`` texts: it refuses batches of that
    size; at most ``took`` texts per request from now on, logged once. Retested like an
    inferred limit (``_batching.BatchState.limit_inferred``): a one-off refusal does not
    cap the replica for good."""
    if batch.limit is not None and took >= batch.limit:
        return
    batch.limit, batch.limit_inferred, batch.ok_since_limit = took, True, 0
    replica.metrics.fallback("batch_limit")
    _log.warning(
        "%s refused a batch of %d texts but took batches of %d: sending at most %d "
        "texts per request from now on",
        replica.label,
        sent,
        took,
        took,
    )


def learn_inferred_limit(
    batch: BatchState, replica: ReplicaView, took: int, sent: int, error: QwenEmbedError
) -> None:
    """A batch of ``sent`` texts that ``replica`` dropped (``error``) went through in
    pieces, the largest it took of ``took`` texts: the batch failed for its size (a
    server that drops requests above some size, e.g. out of memory). The second time
    (once could be chance), ``took`` becomes the replica's inferred limit, retested
    later (it may have been a spell)."""
    batch.size_failures.append(took)
    if len(batch.size_failures) < 2:
        return  # once could be chance: wait for a second batch to say so
    if batch.limit is None or took < batch.limit:
        batch.limit = took
        batch.limit_inferred = True  # retested later: it may have been a spell
        batch.ok_since_limit = 0
        replica.metrics.fallback("batch_limit")
        _log.warning(
            "%s failed a batch of %d texts (%s) but took batches of %d: "
            "sending at most %d texts per request from now on",
            replica.label,
            sent,
            type(error).__name__,
            took,
            took,
        )


# --------------------------------------------------------------------------- answers


def identify(state: ReplicaState, headers: Mapping[str, str], payload: object) -> None:
    """Identify the server from a good answer (its ``headers`` and decoded ``payload``),
    when no fixed ``server=`` is set and no profile or only the generic one was found."""
    found = servers.identify_response(headers, payload)
    if found is not None:
        state.profile, state.source = found.profile, found.source
    elif state.profile is None:
        state.profile, state.source = servers.GENERIC, "answers of a generic server"


def finish(
    config: EmbeddingConfig,
    arr: FloatArray,
    sq: FloatArray,
    sent_dims: int | None,
    bad: dict[int, str],
    state: ReplicaState,
    replica: ReplicaView,
) -> FloatArray:
    """Apply MRL ``dimensions`` and normalisation to a decoded batch (``n x dim``)."""
    want = config.dimensions
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
    if want is not None or config.normalize:
        arr, _ = normalize_rows(arr, want, squared_norms=sq)
    return arr


def check_usage(
    replica: ReplicaView,
    state: ReplicaState,
    texts: Sequence[str],
    indices: Sequence[int],
    payload: object,
) -> None:
    """Warn (at most ``_MAX_WARNINGS`` times per replica) about each input the server
    probably truncated: its ``usage`` reports far fewer tokens than estimated."""
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


def eos_probe(url: str) -> tuple[str, bytes]:
    """llama.cpp's tokenizer request for the replica at base URL ``url``: (its URL, its
    body), a probe tokenised with ``add_special`` (``eos_answer`` reads the reply)."""
    root = url[: -len("/v1")] if url.endswith("/v1") else url
    return f"{root}/tokenize", orjson.dumps({"content": "probe", "add_special": True})


def eos_answer(replica: ReplicaView, status: int, body: bytes) -> None:
    """Warn once when llama.cpp's answer to ``eos_probe`` shows that the server does not
    append ``<|endoftext|>`` (the token Qwen3-Embedding pools); any other answer says
    nothing."""
    if status != 200:
        return
    try:
        tokens = orjson.loads(body).get("tokens")
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
