"""Shared pieces of the test server: constants, settings, deterministic vectors, checks.

Imports only the standard library, numpy and orjson.
"""

from __future__ import annotations

import functools
import hashlib
import http
import math
import os
import zlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import orjson

LOOPBACK: Final = "127.0.0.1"
DEFAULT_MODEL: Final = "Qwen/Qwen3-Embedding-0.6B"
DEFAULT_DIM: Final = 1024
#: About Qwen3-Embedding's 32k-token context at ~4 characters per token.
DEFAULT_MAX_INPUT_CHARS: Final = 131_072
#: SGLang's answer (HTTP 503) when its waiting queue is full.
QUEUE_FULL_MESSAGE: Final = "The request queue is full."
#: Ollama's answer (HTTP 500) to a document whose embedding came out NaN: the default body
#: of a ``poison`` rule.
NAN_ERROR_BODY: Final = b'{"error":"json: unsupported value: NaN"}'
#: Default wording of a ``token_cap`` refusal (``{cap}`` and ``{n}`` are filled in).
TOKEN_CAP_MESSAGE: Final = "Too many tokens in batch. Max is {cap} got {n}"  # noqa: S105
#: A ``token_cap`` wording that states no number (for clients that must find the cap).
TOKEN_CAP_MESSAGE_UNSTATED: Final = "Too many tokens in batch."  # noqa: S105
#: Qwen3's end-of-text token, which Qwen3-Embedding pools; and its id.
EOS_TOKEN: Final = "<|endoftext|>"  # noqa: S105
EOS_TOKEN_ID: Final = 151643
#: What a llama.cpp server that does not append EOS (``append_eos=False``) embeds in
#: place of the missing token: its vector for ``text`` is that of ``text + NO_EOS_SUFFIX``.
NO_EOS_SUFFIX: Final = "\x00<no-eos>"
_ADMIN_PREFIX: Final = "/_testing/"
_BACKLOG: Final = 2048
_GRACEFUL_SHUTDOWN: Final = 3.0  # seconds a stopping server waits for requests in flight
_DISCONNECT_WAIT: Final = 5.0  # seconds the app waits for a dropped connection to go away
_MODULE: Final = "qwen_embed_tooling.testing"
_Vector = npt.NDArray[np.float32]
_Scope = MutableMapping[str, Any]
_Message = MutableMapping[str, Any]
_Receive = Callable[[], Awaitable[_Message]]
_Send = Callable[[_Message], Awaitable[None]]


# --------------------------------------------------------------------------------------
# Deterministic embeddings
# --------------------------------------------------------------------------------------

_SEED_PREFIX: Final = b"qwen-embed-plugins/testing/v1\x00"


@functools.lru_cache(maxsize=4096)
def _vector(text: str, dim: int, dimensions: int | None) -> _Vector:
    """The cached, read-only vector behind `expected_embedding`."""
    if dimensions is not None:
        full = _vector(text, dim, None)[:dimensions].astype(np.float64)
    else:
        raw = hashlib.shake_256(_SEED_PREFIX + text.encode("utf-8", "surrogatepass")).digest(
            4 * dim
        )
        full = np.frombuffer(raw, dtype="<u4").astype(np.float64) * (2.0 / 2**32) - 1.0
    norm = float(np.sqrt(np.dot(full, full)))
    if norm > 0.0:
        full /= norm
    out = full.astype("<f4")
    out.setflags(write=False)
    return out


def _check_dims(dim: int, dimensions: int | None) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be a positive int, got {dim!r}")
    if dimensions is not None and (
        isinstance(dimensions, bool)
        or not isinstance(dimensions, int)
        or not 1 <= dimensions <= dim
    ):
        raise ValueError(f"dimensions must be an int in 1..{dim} (dim), got {dimensions!r}")


def expected_embedding(
    text: str, dim: int = DEFAULT_DIM, *, dimensions: int | None = None
) -> npt.NDArray[np.float32]:
    """The vector `EmbeddingServer` returns for ``text``.

    Args:
        text: the input text, exactly as sent (a query instruction prefix is part of it).
        dim: the server's full vector size (``EmbeddingServer(dim=...)``), in components.
        dimensions: the ``dimensions`` asked for in the request (matryoshka servers only):
            the first ``dimensions`` components of the full vector, L2-renormalised.
            ``None`` means the full vector.

    Returns:
        A new float32 array of shape ``(dimensions or dim,)`` with unit L2 norm, derived
        from SHAKE-256 of the UTF-8 text: the same text always gives the same vector.

    Raises:
        TypeError: ``text`` is not a str.
        ValueError: ``dim`` is not positive, or ``dimensions`` is not in ``1..dim``.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    _check_dims(dim, dimensions)
    return _vector(text, dim, dimensions).copy()


def expected_embeddings(
    texts: Iterable[str], dim: int = DEFAULT_DIM, *, dimensions: int | None = None
) -> npt.NDArray[np.float32]:
    """The vectors `EmbeddingServer` returns for ``texts``, in input order.

    Returns:
        A float32 array of shape ``(n, dimensions or dim)``; row ``i`` is
        ``expected_embedding(texts[i], dim, dimensions=dimensions)``.

    Raises:
        TypeError: an item is not a str.
        ValueError: as for `expected_embedding`.
    """
    _check_dims(dim, dimensions)
    rows: list[_Vector] = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] must be a str, got {type(text).__name__}")
        rows.append(_vector(text, dim, dimensions))
    if not rows:
        return np.empty((0, dimensions or dim), dtype=np.float32)
    return np.stack(rows)


def count_tokens(text: str) -> int:
    """The server's token count for ``text``: ``ceil(len(text) / 4)`` (characters, not a
    tokenizer; ``len`` counts code points). Every token limit, token cap, truncation and
    ``usage`` figure of the test servers uses it (Infinity's ``usage`` counts characters,
    as Infinity does)."""
    return (len(text) + 3) // 4


def _truncate(text: str, max_tokens: int) -> str:
    """``text`` cut to its first ``max_tokens`` tokens (by `count_tokens`)."""
    return text[: 4 * max_tokens]


def _number(name: str, value: Any, *, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= minimum:
        raise ValueError(f"{name} must be a number >= {minimum:g}, got {value!r}")
    return float(value)


def _integer(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _seconds_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _body_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, Mapping | list):
        return orjson.dumps(value)
    raise ValueError(f"body must be bytes, str, a dict or a list, got {type(value).__name__}")


@dataclass(frozen=True)
class _Settings:
    """Everything that shapes a server's answers; JSON-safe so a child process gets it."""

    model: str = DEFAULT_MODEL
    dim: int = DEFAULT_DIM
    matryoshka: bool = False
    keep_alive_timeout: float = 5.0
    latency: float = 0.0
    max_input_chars: int | None = DEFAULT_MAX_INPUT_CHARS
    max_batch: int | None = None
    max_requests_per_connection: int | None = None
    api_key: str | None = field(default=None, repr=False)
    tls: bool = False
    http2: bool = False
    dialect: str = "sglang"
    received_limit: int = 1000
    url_prefix: str | None = None
    max_input_tokens: int | None = None
    report_usage: bool = True
    append_eos: bool = True
    goaway_after: int | None = None
    goaway_mode: str = "graceful"
    h2_only: bool = False
    server_model: tuple[dict[str, Any], ...] = ()
    tls_hostnames: tuple[str, ...] = ()
    model_names: tuple[str, ...] = ()  # names answered besides `model`; () accepts any


@dataclass(frozen=True)
class _Reply:
    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()
    content_type: bytes = b"application/json"


@dataclass(frozen=True)
class _EmbedRequest:
    texts: list[str]
    base64: bool
    dimensions: int | None
    one_item_list: bool = False  # ``input`` was a list of one text (not a bare string)


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def _json_reply(status: int, data: Any, headers: tuple[tuple[bytes, bytes], ...] = ()) -> _Reply:
    return _Reply(status, orjson.dumps(data), headers)


def _tokens(request: _EmbedRequest) -> int:
    return sum(count_tokens(text) for text in request.texts)


def _request_id(prefix: str = "") -> str:
    return prefix + hashlib.sha256(os.urandom(8)).hexdigest()[:32]


def _install_hint(package: str) -> str:
    # static: this package imports nothing of the core (qwen_embed_plugins._install_command)
    return (
        f"EmbeddingServer needs {package}, a dependency of qwen-embed-tooling (no release "
        "on PyPI: in a checkout, pip install -e ./tooling; elsewhere, pip install "
        '"qwen-embed-tooling @ file:///path/to/qwen-embed-plugins/tooling")'
    )


@dataclass(frozen=True)
class _TLSFiles:
    """PEM files of a throw-away CA and a certificate for 127.0.0.1 / localhost."""

    ca: str
    chain: str
    key: str

    @classmethod
    def create(cls, directory: str, hostnames: Sequence[str] = ()) -> _TLSFiles:
        try:
            import trustme
        except ImportError as exc:
            raise ImportError(_install_hint("trustme")) from exc
        ca = trustme.CA()
        cert = ca.issue_cert(LOOPBACK, "localhost", *hostnames)
        files = cls(
            ca=os.path.join(directory, "ca.pem"),
            chain=os.path.join(directory, "server-chain.pem"),
            key=os.path.join(directory, "server-key.pem"),
        )
        ca.cert_pem.write_to_path(files.ca)
        cert.private_key_pem.write_to_path(files.key)
        for i, blob in enumerate(cert.cert_chain_pems):
            blob.write_to_path(files.chain, append=i > 0)
        return files


# shared by the hostile servers (HTTP/1.1 and HTTP/2)
_PREFIX: Final = b'{"object":"list","data":['


def _transform(value: str, transform: str) -> str:
    """``value`` (an ``Authorization`` header) as `echo_auth`'s ``transform`` asks."""
    if transform == "upper":
        return value.upper()
    if transform == "lower":
        return value.lower()
    if transform == "truncate":
        return value[:-4]
    if transform == "bare":
        return value.removeprefix("Bearer ").removeprefix("bearer ")
    return value


@functools.lru_cache(maxsize=2)
def _gzip_bomb(inflated: int) -> bytes:
    """One gzip member inflating to ``inflated`` bytes (a JSON prefix, then spaces), at
    about 1 KB per MiB: after a full flush, deflate encodes each identical MiB block to
    identical bytes, so the body repeats one compressed block; the trailer is computed."""
    block = b" " * (1 << 20)
    blocks = max(1, math.ceil((inflated - len(_PREFIX)) / len(block)))
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    start = compressor.compress(_PREFIX)
    first = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
    repeat = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
    end = compressor.flush(zlib.Z_FINISH)[:-8]  # the final empty block, without trailer
    crc = zlib.crc32(_PREFIX)
    for _ in range(blocks):
        crc = zlib.crc32(block, crc)
    size = (len(_PREFIX) + blocks * len(block)) & 0xFFFFFFFF
    trailer = crc.to_bytes(4, "little") + size.to_bytes(4, "little")
    return start + first + repeat * (blocks - 1) + end + trailer
