"""The wire codec of ``/v1/embeddings``, with no I/O.

- Qwen3-Embedding query formatting (``Instruct: {task}\\nQuery:{text}``);
- input validation whose errors name the caller's index;
- the token estimate a batching plan uses (the plan itself: ``_batching``);
- request bodies (``encoding_format`` for base64 only: float is the API's default);
- response decoding (items put in ``index`` order, base64 little-endian float32 via
  numpy, float lists) and checks on every vector;
- MRL post-processing (slice to ``dimensions`` and L2-renormalise).

Everything here is pure and shared by the sync and async clients.
"""

from __future__ import annotations

import binascii
import functools
import logging
import math
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import orjson

from .errors import InputError, ResponseError

_log = logging.getLogger("qwen_embed_plugins")

__all__ = [
    "DEFAULT_QUERY_TASK",
    "QWEN3_EMBEDDING_DIMS",
    "FloatArray",
    "bad_rows",
    "decode_checked",
    "decode_embeddings",
    "decode_payload",
    "decode_rows",
    "default_query_instruction",
    "encode_request",
    "estimate_tokens",
    "format_query",
    "is_qwen3_embedding",
    "known_model_dims",
    "normalize_rows",
    "screen_texts",
    "size_errors",
    "size_problem",
    "truncation_suspects",
    "usage_prompt_tokens",
    "validate_texts",
]

FloatArray = npt.NDArray[np.float32]

_NUMBER_TYPES = frozenset({float, int})

DEFAULT_QUERY_TASK: Final = (
    "Given a web search query, retrieve relevant passages that answer the query"
)
"""Qwen3-Embedding's default retrieval task (source: the Qwen3-Embedding model card and
its ``config_sentence_transformers.json`` query prompt)."""

QWEN3_EMBEDDING_DIMS: Final[dict[str, int]] = {
    "qwen3-embedding-0.6b": 1024,
    "qwen3-embedding-4b": 2560,
    "qwen3-embedding-8b": 4096,
}
"""Full vector size per Qwen3-Embedding model (source: the model cards). MRL allows any
``dimensions`` from 32 up to this size."""


_QWEN3_EMBEDDING = re.compile(r"qwen3[-_ ]?embedding", re.IGNORECASE)
# the size tag right after the family name: "-0.6B", "_4b", ":8b", then the end or a
# separator (":Q5_K_M", "-GGUF", "-q8_0"), never more digits ("-4b2")
_QWEN3_SIZE = re.compile(r"qwen3[-_ ]?embedding[-_:]?(0\.6b|4b|8b)(?![0-9a-z])", re.IGNORECASE)


def is_qwen3_embedding(model: str) -> bool:
    """Whether the model name identifies a Qwen3-Embedding model: a hub name
    (``Qwen/Qwen3-Embedding-0.6B``), a path as SGLang and vLLM report it
    (``/models/Qwen3-Embedding-8B``), an Ollama tag (``qwen3-embedding:8b``,
    ``dengcao/Qwen3-Embedding-4B:Q5_K_M``), a GGUF file name."""
    return _QWEN3_EMBEDDING.search(model) is not None


@functools.lru_cache(maxsize=256)
def known_model_dims(model: str) -> int | None:
    """Full vector size of a Qwen3-Embedding model whose name states its size (hub name,
    path, Ollama tag: see ``is_qwen3_embedding``), else ``None``."""
    found = _QWEN3_SIZE.search(model)
    if found is None:
        return None
    return QWEN3_EMBEDDING_DIMS[f"qwen3-embedding-{found.group(1).lower()}"]


_instruction_logged: set[str] = set()
_instruction_lock = threading.Lock()


def default_query_instruction(model: str) -> str | None:
    """The query instruction ``query_instruction="auto"`` gives ``model``:
    ``DEFAULT_QUERY_TASK`` for a Qwen3-Embedding model (``is_qwen3_embedding``), ``None``
    (raw queries) for any other. The choice is logged once per model per process (INFO)."""
    task = DEFAULT_QUERY_TASK if is_qwen3_embedding(model) else None
    if model not in _instruction_logged:
        with _instruction_lock:
            first = model not in _instruction_logged
            _instruction_logged.add(model)
        if first:
            if task is None:
                _log.info(
                    "model %r is not a Qwen3-Embedding model by its name: queries are sent "
                    "raw (set query_instruction to give them an instruction)",
                    model,
                )
            else:
                _log.info(
                    "model %r is a Qwen3-Embedding model: queries are sent as "
                    "'Instruct: {task}\\nQuery:{text}' with the default retrieval task "
                    "(query_instruction=None sends them raw)",
                    model,
                )
    return task


try:  # SIMD base64, faster than binascii (docs/benchmarks.md, bench/profile_paths.py)
    from pybase64 import b64decode as _pybase64_decode

    def _b64decode(text: str) -> bytes:
        return _pybase64_decode(text, validate=True)

except ImportError:  # pragma: no cover - pybase64 is a dependency; stay correct without it

    def _b64decode(text: str) -> bytes:
        return binascii.a2b_base64(text, strict_mode=True)


_NORM_TOLERANCE = 1e-4
_SQ_LOW = (1.0 - _NORM_TOLERANCE) ** 2
_SQ_HIGH = (1.0 + _NORM_TOLERANCE) ** 2


def format_query(text: str, task: str | None) -> str:
    """A query as Qwen3-Embedding expects it: ``Instruct: {task}\\nQuery:{text}``.

    No space follows ``Query:`` (source: the Qwen3-Embedding model card's
    ``get_detailed_instruct`` and its sentence-transformers query prompt). With
    ``task=None`` the text is returned unchanged (for non-Qwen models).
    """
    if task is None:
        return text
    return f"Instruct: {task}\nQuery:{text}"


def _describe(value: object) -> str:
    return "None" if value is None else type(value).__name__


def validate_text(text: object, index: int | None, *, max_chars: int | None) -> str:
    """Check one text; return it unchanged.

    Raises:
        InputError: ``text`` is not a ``str``, is empty or whitespace only (embedding
            servers such as SGLang and vLLM reject it), or is longer than
            ``max_chars`` characters. The message names ``index``.
    """
    where = "the text" if index is None else f"text at index {index}"
    if not isinstance(text, str):
        raise InputError(f"{where} is {_describe(text)}; expected str", index=index)
    if not text or text.isspace():
        raise InputError(
            f"{where} is empty or whitespace-only; embedding servers reject it "
            "(filter such texts out before embedding)",
            index=index,
        )
    if not text.isascii():  # isascii() is O(1) in CPython; only non-ASCII text pays
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InputError(
                f"{where} is not valid Unicode: an unpaired surrogate at character "
                f"{exc.start} (decode its source with errors='replace')",
                index=index,
            ) from None
    if max_chars is not None and len(text) > max_chars:
        raise InputError(
            f"{where} is {len(text):,} characters, above max_text_chars={max_chars:,}; "
            "split it into chunks first",
            index=index,
        )
    return text


def validate_texts(texts: object, *, max_chars: int | None) -> list[str]:
    """Check a batch of texts; return them as a list (``[]`` for an empty batch).

    Accepts any sequence or iterable of ``str`` (not a single ``str``, not bytes, not a
    mapping, not a set).

    Raises:
        InputError: the input is not a list of texts, or one text is invalid (see
            ``validate_text``); ``.index`` names the first bad text.
    """
    items, rejected = screen_texts(texts, max_chars=max_chars)
    if rejected:
        raise next(iter(rejected.values()))
    return items


def screen_texts(
    texts: object, *, max_chars: int | None, first: int = 0
) -> tuple[list[str], dict[int, InputError]]:
    """Check a batch of texts without stopping at the first bad one (``first``: the
    caller's index of ``texts[0]``, named by the errors).

    Returns:
        ``(items, rejected)``: every input as a list (``n`` items), and the index ->
        ``InputError`` of each text that cannot be sent (see ``validate_text``), in
        index order; empty when all are fine.

    Raises:
        InputError: the input as a whole is not a list of texts (a single ``str``,
            bytes, a mapping, a set, not iterable).
    """
    if isinstance(texts, str | bytes | bytearray):
        raise InputError(
            f"expected a list of texts, got a single {type(texts).__name__}; "
            "wrap it in a list or use embed_query()"
        )
    if isinstance(texts, Mapping) or not isinstance(texts, Iterable):
        raise InputError(f"expected a list of texts, got {_describe(texts)}")
    if isinstance(texts, AbstractSet):
        raise InputError(
            f"expected an ordered list of texts, got a {_describe(texts)}: its order is "
            "arbitrary, so vectors could not be matched to texts; pass a list"
        )
    items = list(texts)
    rejected: dict[int, InputError] = {}
    for i, text in enumerate(items):
        try:
            validate_text(text, first + i, max_chars=max_chars)
        except InputError as exc:
            rejected[i] = exc
    return items, rejected


def estimate_tokens(text: str) -> int:
    """A cheap, tokenizer-free estimate of ``text``'s token count: UTF-8 bytes / 4,
    rounded up, at least 1 (about 4 characters per token for English, and about one
    token per CJK character, for Qwen's byte-level BPE). The exact figure comes from the
    server's ``usage`` when it reports one."""
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return max(1, (size + 3) // 4)


def encode_request(
    texts: Sequence[str] | str,
    *,
    model: str,
    encoding_format: str,
    dimensions: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> bytes:
    """The JSON body of one ``POST /embeddings``, with the fields of ``extra``
    (``EmbeddingConfig.extra_body``) merged in; the client's own fields (``input``,
    ``model``, ``encoding_format``, ``dimensions``) always win. ``encoding_format`` is
    sent for base64 only (float is the API's default: a server that refuses the field
    still takes the request); a client field set to ``None`` in ``extra`` is not sent.
    ``texts`` as a ``str``: ``input`` is that bare string (for servers that refuse a
    one-item list)."""
    body: dict[str, Any] = {
        **(extra or {}),
        "input": texts if isinstance(texts, str) else list(texts),
        "model": model,
    }
    if encoding_format != "float":
        body["encoding_format"] = encoding_format
    else:
        body.pop("encoding_format", None)
    if dimensions is not None:
        body["dimensions"] = dimensions
    else:
        body.pop("dimensions", None)
    return orjson.dumps(body)


def _vector(item: Mapping[str, Any], row: int, where: int) -> FloatArray:
    emb = item.get("embedding")
    if isinstance(emb, str):
        try:
            raw = _b64decode(emb)
        except (binascii.Error, ValueError) as exc:
            raise ResponseError(
                f"embedding for input index {where} is not valid base64", index=where
            ) from exc
        if len(raw) % 4:
            raise ResponseError(
                f"embedding for input index {where} has {len(raw)} bytes, not a whole "
                "number of float32 values",
                index=where,
            )
        return np.frombuffer(raw, dtype="<f4")
    if isinstance(emb, list):
        kinds = {type(x) for x in emb}
        if type(None) in kinds and kinds <= _NUMBER_TYPES | {type(None)}:
            # NaN and Inf have no JSON spelling: servers send them as null
            return np.asarray([np.nan if x is None else x for x in emb], dtype=np.float32)
        if not kinds <= _NUMBER_TYPES:
            bad = sorted(t.__name__ for t in kinds - _NUMBER_TYPES)
            raise ResponseError(
                f"embedding for input index {where} holds {', '.join(bad)} values; expected "
                "a flat list of numbers",
                index=where,
            )
        return np.asarray(emb, dtype=np.float32)
    raise ResponseError(
        f"embedding for input index {where} is {_describe(emb)}; expected a list of "
        "floats or a base64 string",
        index=where,
    )


def decode_embeddings(body: bytes, input_indices: Sequence[int]) -> FloatArray:
    """Parse a raw response body and decode it with ``decode_payload``.

    Raises:
        ResponseError: the body is not JSON, or see ``decode_payload``.
    """
    return decode_payload(parse_body(body), input_indices)


def parse_body(body: bytes) -> object:
    """The JSON value of a response body.

    Raises:
        ResponseError: the body is not JSON (the message quotes its first 80 bytes).
    """
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        snippet = body[:80].decode("utf-8", "replace")
        raise ResponseError(f"response is not valid JSON (starts with {snippet!r})") from exc


def decode_payload(payload: object, input_indices: Sequence[int]) -> FloatArray:
    """Decode and check one parsed response for a batch.

    Args:
        payload: the parsed JSON response (``{"data": [{"index", "embedding"}, ...]}``).
        input_indices: for each text of the batch, in order, the caller's index (used
            in error messages). Its length is the number of texts sent.

    Returns:
        float32 array, ``len(input_indices) x dim``, row ``i`` for the batch's text ``i``.

    Raises:
        ResponseError: no ``data`` list; wrong item count; an index missing,
            duplicated or out of range; unequal dimensions; NaN/Inf or an all-zero
            vector. The message names the caller's input index when one is at fault.
    """
    return decode_checked(payload, input_indices)[0]


def decode_checked(payload: object, input_indices: Sequence[int]) -> tuple[FloatArray, FloatArray]:
    """``decode_payload`` that also returns each row's squared L2 norm (float64, ``n``),
    computed once for the NaN/zero checks and reused by ``normalize_rows``."""
    out, sq = decode_rows(payload, input_indices)
    bad = bad_rows(sq)
    if bad:
        row, reason = next(iter(bad.items()))
        raise ResponseError(
            f"embedding for input index {input_indices[row]} {reason}",
            index=input_indices[row],
        )
    return out, sq


def decode_rows(payload: object, input_indices: Sequence[int]) -> tuple[FloatArray, FloatArray]:
    """Decode one parsed response into ``n x dim`` float32 rows (in batch order) and their
    squared norms, checking its structure; unusable rows (NaN, zero) are left for
    ``bad_rows`` to report, so one bad vector does not cost the others.

    Raises:
        ResponseError: no ``data`` list (the server's message when it sent an error);
            wrong item count; an index missing, duplicated or out of range; unequal
            dimensions; a vector that is not a flat list of numbers or base64.
    """
    count = len(input_indices)
    data = payload.get("data") if isinstance(payload, Mapping) else None
    if not isinstance(data, list):
        if isinstance(payload, Mapping) and payload.get("error") is not None:
            from ._server_text import parse_error_body

            message, _ = parse_error_body(orjson.dumps({"error": payload["error"]}))
            raise ResponseError(
                f"the server answered 200 with an error instead of embeddings: {message[:300]}",
                server_message=message,
            )
        raise ResponseError("response has no 'data' list of embeddings")
    if len(data) != count:
        raise ResponseError(
            f"server returned {len(data)} embeddings for {count} inputs "
            f"(inputs {input_indices[0]}..{input_indices[-1]})"
        )
    if count == 1:  # one text (queries): no batch bookkeeping, one numpy call for the norm
        item = data[0]
        if not isinstance(item, Mapping):
            raise ResponseError(f"data[0] is {_describe(item)}; expected an object")
        row = item.get("index", 0)
        if isinstance(row, bool) or not isinstance(row, int) or row != 0:
            raise ResponseError(f"data[0] has index {row!r}, outside 0..0")
        vec = _vector(item, 0, input_indices[0])
        if vec.size == 0:
            raise ResponseError(
                f"embedding for input index {input_indices[0]} is empty", index=input_indices[0]
            )
        return vec.reshape(1, -1), np.array([_squared_norm(vec)])
    out: FloatArray | None = None
    filled = bytearray(count)
    for pos, item in enumerate(data):
        if not isinstance(item, Mapping):
            raise ResponseError(f"data[{pos}] is {_describe(item)}; expected an object")
        row = item.get("index", pos)
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < count:
            raise ResponseError(f"data[{pos}] has index {row!r}, outside 0..{count - 1}")
        if filled[row]:
            raise ResponseError(
                f"index {row} (input index {input_indices[row]}) appears twice in the response"
            )
        vec = _vector(item, row, input_indices[row])
        if out is None:
            if vec.size == 0:
                raise ResponseError(
                    f"embedding for input index {input_indices[row]} is empty",
                    index=input_indices[row],
                )
            out = np.empty((count, vec.size), dtype=np.float32)
        elif vec.size != out.shape[1]:
            raise ResponseError(
                f"embedding for input index {input_indices[row]} has {vec.size} dimensions, "
                f"others have {out.shape[1]}",
                index=input_indices[row],
            )
        out[row] = vec
        filled[row] = 1
    if out is None:  # cannot happen: count >= 1 and every row filled (no duplicates)
        raise RuntimeError("internal error: out is None")
    return out, _squared_norms(out)


def size_problem(
    got: int,
    *,
    model: str,
    native: int | None,
    asked: int | None,
    call_size: Callable[[int], int],
) -> str | None:
    """Why vectors of ``got`` dimensions (as decoded, before any MRL slicing) do not
    belong in a call, or ``None`` when they do.

    Every vector of a call has one size: a model whose size is known (``native``)
    answers ``native`` or the ``asked`` MRL size; any other model answers what the
    call's first answer had (``call_size(got)`` returns that size). With ``asked`` and an
    unknown model, a larger answer is sliced to ``asked`` (a smaller one is refused
    elsewhere), so the call's size is ``asked``.

    A base64 payload decoded as float32 that is half the expected size is called out
    (float16 values sent as base64: garbage, not a shorter vector).
    """
    if native is not None:
        if got in (native, asked):
            return None
        expected = native if asked is None else asked
        want = f"{model} vectors have {native} dimensions" + (
            f" ({asked} with dimensions={asked})" if asked is not None else ""
        )
    elif asked is not None:
        return None
    else:
        expected = call_size(got)
        if got == expected:
            return None
        want = f"the call's other vectors have {expected} dimensions"
    if got * 2 in (expected, native):
        want += "; half that size: the server may send float16 values where float32 are due"
    return want


def size_errors(
    rows: FloatArray,
    indices: Sequence[int],
    label: str,
    model: str,
    sent: int | None,
    config: Any,
    call: Any,
) -> list[ResponseError]:
    """The errors of a batch whose vectors (``rows``, ``n x got`` as decoded) have a size
    that does not belong in the call (``size_problem``), one per input, naming the
    replica (``label``) and the caller's index; ``[]`` when the size is right.

    Args:
        sent: the ``dimensions`` sent on the wire (servers that take only some sizes get
            the next one up), or ``None``.
        config: the call's ``EmbeddingConfig`` (``dimensions``).
        call: the ``_run.Call`` (its ``agree_dim`` keeps the call's first size).
    """
    got = int(rows.shape[1])
    if got == sent:
        return []  # the size the request asked for (then sliced to ``dimensions``)
    problem = size_problem(
        got,
        model=model,
        native=known_model_dims(model),
        asked=config.dimensions,
        call_size=call.agree_dim,
    )
    if problem is None:
        return []
    return [
        ResponseError(
            f"embedding for input index {index} from {label} has {got} dimensions: {problem}",
            index=index,
            url=label,
        )
        for index in indices
    ]


def bad_rows(squared_norms: FloatArray) -> dict[int, str]:
    """Rows that are unusable, by row, with the reason ("contains NaN or Inf", "is all
    zeros"), from their squared norms (``decode_rows``). Empty when all are fine."""
    sq = squared_norms
    if len(sq) == 1:
        value = float(sq[0])
        if 0.0 < value < math.inf:
            return {}
        return {0: "is all zeros" if value == 0.0 else "contains NaN or Inf"}
    # One pass gives every check: a row with NaN/Inf has a NaN/Inf squared norm, an
    # all-zero row exactly 0 (float64: the smallest float32 squared is still > 0).
    if ((sq > 0.0) & (sq < np.inf)).all():
        return {}
    out: dict[int, str] = {}  # NaN/Inf rows first (the likelier server fault), then zeros
    for row in np.flatnonzero(~np.isfinite(sq)):
        out[int(row)] = "contains NaN or Inf"
    for row in np.flatnonzero(sq == 0.0):
        out[int(row)] = "is all zeros"
    return out


_F32_UNIT = 2.0**-24  # float32's unit roundoff


def _squared_norm(vec: FloatArray) -> float:
    """One vector's squared L2 norm in float64, the same einsum reduction as
    ``_squared_norms`` on its one row; except for a vector whose float32 dot product
    puts it inside the unit-length band whatever the rounding (a float32 sum of ``n``
    squares is within ``n*u / (1 - n*u)`` of the true one, ``u = 2**-24``): that
    estimate is returned, since all that is read of such a norm is that it is in the
    band (``bad_rows``: finite and > 0; ``normalize_rows``: the row is left as it is)."""
    n = vec.size
    bound = n * _F32_UNIT
    if bound < 0.001:  # up to ~16,000 values: the common, normalised answer
        quick = float(np.dot(vec, vec))
        err = bound / (1.0 - bound) + 1e-12  # + float64's own error in the exact path
        if _SQ_LOW * (1.0 + err) <= quick <= _SQ_HIGH * (1.0 - err):
            return quick
    return float(np.einsum("i,i->", vec, vec, dtype=np.float64))


def _squared_norms(arr: FloatArray) -> FloatArray:
    """Row-wise squared L2 norms in float64 (``n``)."""
    sq: FloatArray = np.einsum("ij,ij->i", arr, arr, dtype=np.float64)
    return sq


def normalize_rows(
    arr: FloatArray, dimensions: int | None = None, *, squared_norms: FloatArray | None = None
) -> tuple[FloatArray, bool]:
    """Slice rows to ``dimensions`` (MRL) and L2-renormalise rows whose norm is not 1.

    Rows already of unit length (within 1e-4) are left bit-for-bit unchanged.

    Args:
        arr: ``n x dim`` float32.
        dimensions: keep the first ``dimensions`` components (``None``: all).
        squared_norms: the rows' squared norms if already known (``decode_checked``);
            ignored when slicing.

    Returns:
        ``(array, changed)``: the ``n x dimensions`` array and whether anything was
        sliced or rescaled.
    """
    changed = False
    if dimensions is not None and arr.shape[1] > dimensions:
        arr = np.ascontiguousarray(arr[:, :dimensions])
        changed = True
        squared_norms = None
    sq = _squared_norms(arr) if squared_norms is None else squared_norms
    if len(sq) == 1 and _SQ_LOW <= float(sq[0]) <= _SQ_HIGH:
        return arr, changed
    # |norm - 1| > tol, compared on the squares (no square root unless rescaling)
    off = (sq < _SQ_LOW) | (sq > _SQ_HIGH)
    if off.any():
        if not arr.flags.writeable:
            arr = arr.copy()
        arr[off] = (arr[off] / np.sqrt(sq[off])[:, None]).astype(np.float32)
        changed = True
    return arr, changed


ROUND_TOKEN_CAPS: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
"""Context caps servers truncate inputs at (model and server defaults)."""


def usage_prompt_tokens(payload: object) -> int | None:
    """``usage.prompt_tokens`` (else ``total_tokens``) of a response, when it is an
    integer; ``None`` when the server reports no usage."""
    usage = payload.get("usage") if isinstance(payload, Mapping) else None
    if not isinstance(usage, Mapping):
        return None
    for name in ("prompt_tokens", "total_tokens"):
        value = usage.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def truncation_suspects(
    estimates: Sequence[int], reported: int
) -> list[tuple[int, int, int | None]]:
    """Texts a server probably truncated, from the tokens it reported for the request.

    A request's reported tokens far below (under half) the estimate means some text was
    cut. With a batch, the cut is found by the round cap ``C`` (``ROUND_TOKEN_CAPS``)
    that explains the total (``sum(min(estimate, C))`` within 15%); a single text is
    suspect on its own.

    Returns:
        ``(position in the request, estimated tokens, cap or None)`` per suspect.
    """
    total = sum(estimates)
    if not estimates or reported * 2 >= total:
        return []
    for cap in ROUND_TOKEN_CAPS:
        capped = sum(min(e, cap) for e in estimates)
        if abs(capped - reported) <= max(0.15 * reported, 2 * len(estimates)):
            return [(pos, e, cap) for pos, e in enumerate(estimates) if e > cap]
    if len(estimates) == 1:
        return [(0, estimates[0], reported if reported in ROUND_TOKEN_CAPS else None)]
    return []
