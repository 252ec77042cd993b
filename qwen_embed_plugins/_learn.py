"""What is learned about a replica's server, in one place: the facts (``ReplicaState``,
one per replica and model) and the decisions that learn and apply them.

The server's profile (``profile``, ``identify``); the options a request is sent with
(``wire``); base64 and ``dimensions`` refusals (``adapt``); a 5xx only for base64 (float
tried: ``float_may_help``, ``no_base64``); a one-item ``input`` list refused (a bare
string tried: ``try_bare``, ``learn_bare``); Infinity's routes at the root
(``learn_root_path``); MRL slicing and normalisation, with ``dimensions`` ignored
(``finish``); silent truncation (``usage``: ``check_usage``); the llama.cpp
``<|endoftext|>`` check (``eos_probe``, ``eos_answer``). What is learned about batch
sizes is in ``_batching`` (``ReplicaState.batch``).

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
from ._batching import BatchState, ReplicaView
from ._config import EmbeddingConfig, known_model_dims
from ._protocol import (
    FloatArray,
    estimate_tokens,
    normalize_rows,
    truncation_suspects,
    usage_prompt_tokens,
)
from ._retry import BACKEND_STATUS, classify
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
    "adapt",
    "check_usage",
    "eos_answer",
    "eos_probe",
    "finish",
    "float_may_help",
    "identify",
    "learn_bare",
    "learn_root_path",
    "no_base64",
    "profile",
    "try_bare",
    "wire",
]

_log = logging.getLogger("qwen_embed_plugins")

_BASE64_REFUSED = re.compile(r"base64|encoding[_ ]format", re.I)
_DIMENSIONS_REFUSED = re.compile(r"dimension|matryoshka|mrl", re.I)
_EOS_ID = 151643  # Qwen2/Qwen3 <|endoftext|> (qwen.tiktoken / tokenizer_config.json)
_MAX_WARNINGS = 5


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
    """(``encoding_format``, ``dimensions`` to send) for this replica now."""
    fmt: str = config.encoding_format
    if fmt == "auto":
        fmt = "float" if state.base64_ok is False or not profile.base64 else "base64"
    want = config.dimensions
    if want is None or state.dimensions_ok is False:
        return fmt, None
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
    """Learn from a 400 that the server refuses base64 or ``dimensions``; ``True``
    when the request should be resent with other options."""
    message = exc.message
    if fmt == "base64" and config.encoding_format == "auto" and _BASE64_REFUSED.search(message):
        no_base64(state, replica, "refused encoding_format=base64")
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


def try_bare(error: QwenEmbedError, texts: Sequence[str], state: ReplicaState, bare: bool) -> bool:
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
