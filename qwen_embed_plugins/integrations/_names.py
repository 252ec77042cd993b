"""The stock adapters' parameter names on this library's adapters, and what a skipped
text gets in their place.

``Stock`` says how an adapter treats the names of the stock class it replaces
(``OpenAIEmbeddings``, ``OpenAIEmbedding`` / ``OpenAILikeEmbedding``): aliases with the
same meaning, values accepted because they ask for what the adapter always does, and
names refused with a hint naming the replacement (``REFUSED_HINTS``); ``resolve_names``
applies it to constructor keywords. docs/migration.md's table lists them, and
tests/test_migration.py checks it against the stock classes installed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from pydantic import SecretStr

from .._config import EmbeddingConfig, NotGiven, timeouts_of
from .._flat import flat_value
from .._results import EmbeddingList
from .._settings import SETTING, closest
from ..errors import ConfigError

__all__ = [
    "REFUSED_HINTS",
    "TIMEOUT",
    "TIMEOUT_FIELDS",
    "Stock",
    "resolve_names",
    "zero_filled",
]


def _flat_value(config: EmbeddingConfig, name: str) -> Any:
    """Flat setting ``name`` of ``config``, as the adapters' field holds it."""
    if name == "api_key":
        if config.key_function is not None:
            return config.key_function
        key = config.api_key_value()
        return None if key is None else SecretStr(key)
    value = flat_value(config, name)
    if name == "base_url" and isinstance(value, tuple):
        return list(value)
    if name == "proxy" and isinstance(value, NotGiven):
        return None
    return value


TIMEOUT_FIELDS: Final = {
    "connect": "connect_timeout",
    "read": "read_timeout",
    "write": "write_timeout",
    "pool": "pool_timeout",
    "total": "total_timeout",
}
"""The flat fields a stock ``timeout=`` sets, by ``Timeouts`` attribute."""

TIMEOUT: Final = "timeout"
"""The alias target of the stock ``timeout`` names: the five ``TIMEOUT_FIELDS``, set as
the core ``timeout=`` sets them (``_config.timeouts_of``)."""


def _timeout_fields(value: Any) -> dict[str, Any]:
    """The flat timeout fields of a stock ``timeout=`` value (``timeouts_of``: a number,
    ``None``, ``httpx.Timeout``, a ``(connect, read)`` tuple)."""
    timeouts = timeouts_of(value)
    return {field: getattr(timeouts, part) for part, field in TIMEOUT_FIELDS.items()}


class Stock:
    """How an adapter treats the parameter names of the stock adapter it replaces.

    Attributes:
        aliases: stock name -> this adapter's field, with the same meaning (``TIMEOUT``:
            the five timeout fields, as the core's ``timeout=`` sets them).
        harmless: stock name -> the values accepted (they ask for what this adapter
            always does; any other value is refused with the hint in ``REFUSED_HINTS``).
        refused: stock name -> why it has no equivalent here and what to use instead.

    A name of ``REFUSED_HINTS`` given as ``None`` (its stock default: "not asked for")
    is accepted and ignored.
    """

    def __init__(
        self,
        aliases: Mapping[str, str],
        *,
        harmless: Mapping[str, tuple[object, ...]] | None = None,
        refused: Mapping[str, str] | None = None,
    ) -> None:
        self.aliases = dict(aliases)
        self.harmless = dict(harmless or {})
        self.refused = dict(refused or {})


_NO_TOKENIZER = (
    "no tokenizer is used here: texts are sent as strings, never tiktoken ids; "
    "max_text_chars bounds a text (characters), max_batch_tokens a request"
)
_SHARED_POOL = (
    "requests go through the process-wide shared pool; set max_connections, verify, proxy, "
    "http2 or the *_timeout fields instead"
)
REFUSED_HINTS: Final[dict[str, str]] = {
    "embedding_ctx_length": _NO_TOKENIZER,
    "tiktoken_model_name": _NO_TOKENIZER,
    "allowed_special": _NO_TOKENIZER,
    "disallowed_special": _NO_TOKENIZER,
    "check_embedding_ctx_length": _NO_TOKENIZER,
    "tiktoken_enabled": _NO_TOKENIZER,
    "http_client": _SHARED_POOL,
    "http_async_client": _SHARED_POOL,
    "async_http_client": _SHARED_POOL,
    "client": _SHARED_POOL,
    "async_client": _SHARED_POOL,
    "reuse_client": "clients are always reused: they are handles on the shared pool",
    "skip_empty": "an empty or whitespace-only text raises InputError naming its index "
    "before anything is sent; pass on_error='skip' to give such texts (and texts the "
    "server refuses) a zero vector instead",
    "class_name": "LlamaIndex's serialisation tag of a dump of another class: load it with "
    "that class",
    "retry_min_seconds": "backoff is built in (capped exponential, full jitter); bound a "
    "call with deadline= (seconds) and max_retries=",
    "retry_max_seconds": "backoff is built in (capped exponential, full jitter); bound a "
    "call with deadline= (seconds) and max_retries=",
    "default_query": "URL query parameters are not sent; use headers= or extra_body=",
    "organization": "OpenAI organisations do not apply; if a gateway wants a header, pass headers=",
    "openai_organization": "OpenAI organisations do not apply; if a gateway wants a "
    "header, pass headers=",
    "mode": "OpenAIEmbedding's mode picks among OpenAI's own model names; here the model "
    "is model_name, and queries get the query_instruction",
    "deployment": "Azure OpenAI is not supported",
    "api_version": "Azure OpenAI is not supported",
    "openai_api_version": "Azure OpenAI is not supported",
    "openai_api_type": "Azure OpenAI is not supported",
}
"""Stock parameters (``OpenAIEmbeddings``, ``OpenAIEmbedding``) with no equivalent here,
and what to use instead."""


def resolve_names(
    owner: str, data: dict[str, Any], fields: Iterable[str], stock: Stock
) -> dict[str, Any]:
    """``data`` (constructor keywords) with stock aliases renamed to this adapter's fields,
    and a ``config=`` (``EmbeddingConfig``) spread over the fields not given.

    Raises:
        ConfigError: an alias given together with its field (or another alias of it);
            a stock parameter with no equivalent (with a hint); any other unknown name
            ("did you mean ..." naming the closest accepted name); a ``config`` that is
            not an ``EmbeddingConfig``.
    """
    known = set(fields)
    out: dict[str, Any] = {}
    source: dict[str, str] = {}
    for name, value in data.items():
        target = name
        if name == "config":
            continue
        if name not in known:
            if name in stock.aliases:
                target = stock.aliases[name]
            elif name in stock.harmless and value in stock.harmless[name]:
                continue
            elif name in stock.harmless:
                only = " or ".join(f"{name}={v!r}" for v in stock.harmless[name])
                raise ConfigError(
                    f"{owner}: only {only} is accepted (what this adapter always does): "
                    f"{REFUSED_HINTS[name]}"
                )
            elif name in REFUSED_HINTS and value is None:
                continue  # the stock default of every refused name: it asks for nothing
            elif name in REFUSED_HINTS:
                hint = REFUSED_HINTS[name]
                raise ConfigError(f"{owner}: parameter {name!r} is not supported: {hint}")
            else:
                raise ConfigError(_unknown(owner, name, known, stock))
        if target in out:
            raise ConfigError(f"{owner}: pass either {source[target]!r} or {name!r}, not both")
        out[target] = value
        source[target] = name
    if TIMEOUT in out:  # a per-phase field given with it overrides its part
        for field, seconds in _timeout_fields(out.pop(TIMEOUT)).items():
            out.setdefault(field, seconds)
    config = data.get("config")
    if config is not None:
        if not isinstance(config, EmbeddingConfig):
            raise ConfigError(
                f"{owner}: config must be an EmbeddingConfig, got {type(config).__name__}"
            )
        for name in SETTING:
            target = name if name in known else stock.aliases[name]
            if target not in out:  # a flat field given overrides the config's value
                out[target] = _flat_value(config, name)
    return out


def _unknown(owner: str, name: str, known: set[str], stock: Stock) -> str:
    match = closest(name, known | set(stock.aliases) | {"config"})
    if match is None:
        return f"{owner}: unknown parameter {name!r} (docs/migration.md lists the accepted ones)"
    field = stock.aliases.get(match)
    also = f" (an alias of {field!r})" if field else ""
    if field == TIMEOUT:
        also = " (sets every *_timeout field)"
    return f"{owner}: unknown parameter {name!r}; did you mean {match!r}{also}?"


# --------------------------------------------------------------------------- on_error="skip"


def zero_filled(rows: EmbeddingList, known_dim: int) -> EmbeddingList:
    """An ``on_error="skip"`` result as LangChain and LlamaIndex need it: one vector per
    text, so stores and pipelines stay aligned with their documents. A skipped text's
    slot holds a zero vector of the call's size (it scores 0 under cosine and dot
    product, never above a real match); ``.errors`` names each skipped index.

    Raises:
        QwenEmbedError: the first skipped input's error (lowest index), when no text
            was embedded and the size is unknown (no ``dimensions``, a model of unknown
            size).
    """
    if not rows.errors:
        return rows
    dim = next((len(row) for row in rows if row is not None), known_dim)
    if not dim:
        raise rows.errors[min(rows.errors)]
    zero = [0.0] * dim
    return EmbeddingList([zero if row is None else row for row in rows], rows.errors)
