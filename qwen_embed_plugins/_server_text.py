"""What servers say, as text: error bodies, stated limits, request ids, and the
scrubbing of credentials from anything a server sends back; URLs with credentials
(``redact_url``, the secret ``ProxyURL``).

Pure functions with no I/O, used by ``errors.error_from_response`` (which builds the
exceptions) and by the tools. Re-exported by ``errors``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal
from urllib.parse import urlsplit, urlunsplit

import orjson

__all__ = [
    "LimitUnit",
    "ProxyURL",
    "StatedLimit",
    "context_refusal",
    "endpoint_label",
    "has_credentials",
    "parse_batch_limit",
    "parse_error_body",
    "parse_token_limit",
    "redact_url",
    "response_request_id",
    "scrub",
    "stated_limit",
]


def endpoint_label(url: str) -> str:
    """``url`` reduced to scheme://host[:port]/path: no user info, query or fragment.

    Used everywhere a URL reaches a message, a log line or a metric label.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid url>"
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:  # out of range or not a number: shown as written, never dropped
        netloc = parts.netloc.rpartition("@")[2]
    else:
        netloc = f"{host}:{port}" if port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def redact_url(url: str) -> str:
    """``url`` with the credentials of its user info hidden: ``http://user:***@host:port``
    (a user name alone, often a token, becomes ``***``); unchanged without user info."""
    try:
        parts = urlsplit(url)
        user, password = parts.username, parts.password
    except ValueError:
        return "<invalid url>"
    if user is None and password is None:
        return url
    shown = "***" if password is None else f"{user}:***"
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{shown}@{host}").geturl()


def has_credentials(url: str) -> bool:
    """Whether ``url`` holds user info (``user:password@``)."""
    return "@" in url.partition("://")[2].partition("/")[0]


_BEARER = re.compile(r"(?i)\b(bearer|basic|token)(\s+|%20|\+)([^\s\"',;&<>]{4,})")
_SECRET_RUN = re.compile(r"[A-Za-z0-9_\-.~+/=:]{6,}")
_MIN_ECHO = 8  # characters: a shorter piece of a key identifies nothing


def _overlap(token: str, secret: str) -> tuple[int, int] | None:
    """The span of ``token`` holding the longest piece of ``secret`` (case-insensitive)
    when that piece is long enough to matter, else ``None``."""
    t, k = token.lower(), secret.lower()
    need = min(_MIN_ECHO, len(k))
    if k in t:
        i = t.index(k)
        return i, i + len(k)
    best: tuple[int, int] | None = None
    # longest common substring, dynamic programming: tokens and keys are short
    prev = [0] * (len(k) + 1)
    longest = 0
    for i in range(1, len(t) + 1):
        cur = [0] * (len(k) + 1)
        ti = t[i - 1]
        for j in range(1, len(k) + 1):
            if ti == k[j - 1]:
                cur[j] = prev[j - 1] + 1
                if cur[j] > longest:
                    longest = cur[j]
                    best = (i - longest, i)
        prev = cur
    return best if longest >= need else None


def scrub(text: str, *secrets: str | None) -> str:
    """``text`` with credentials replaced by ``***``.

    Removes every ``Bearer``/``Basic``/``token`` value, and every echo of each secret:
    exact, with its case changed, or truncated (any run of at least 8 characters of the
    key, or the whole key when shorter). Applied to every server-supplied string
    (bodies, header values, request ids) before it reaches an exception, a log line or
    CLI output.
    """
    if not text:
        return text
    text = _BEARER.sub(lambda m: f"{m.group(1)}{m.group(2)}***", text)
    keys = [k for k in secrets if k and len(k) >= 4]
    if not keys:
        return text
    for key in keys:
        if key in text:
            text = text.replace(key, "***")

    def mask(match: re.Match[str]) -> str:
        token = match.group(0)
        for key in keys:
            while True:
                span = _overlap(token, key)
                if span is None:
                    break
                token = token[: span[0]] + "***" + token[span[1] :]
        return token

    return _SECRET_RUN.sub(mask, text)


def parse_error_body(body: bytes | str | None) -> tuple[str, Any]:
    """Extract ``(message, code)`` from an error body of any supported server.

    Returns the raw text (truncated to 500 characters) when the body is not one of the
    known JSON shapes, and ``""`` for an empty body.
    """
    if not body:
        return "", None
    raw = body if isinstance(body, str) else body.decode("utf-8", "replace")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.strip()[:500], None
    if isinstance(data, Mapping):
        err = data.get("error")
        if isinstance(err, Mapping):  # OpenAI / vLLM / DashScope / llama.cpp
            return str(err.get("message") or err), err.get("code") or err.get("type")
        if isinstance(err, str):  # TEI / Ollama
            return err, data.get("error_type")
        if "message" in data:  # SGLang flat, SiliconFlow {code, message}
            return str(data["message"]), data.get("code")
        detail = data.get("detail")
        if detail is not None:  # FastAPI / Infinity
            if isinstance(detail, list):
                parts = []
                for item in detail:
                    if isinstance(item, Mapping):
                        loc = ".".join(str(p) for p in item.get("loc", ()))
                        parts.append(f"{loc}: {item.get('msg', item)}" if loc else str(item))
                    else:
                        parts.append(str(item))
                return "; ".join(parts), None
            return str(detail), None
    return raw.strip()[:500], None


_BATCH_LIMIT_PATTERNS = (
    re.compile(r"maximum allowed batch size (?:is )?(\d+)", re.I),  # TEI, SiliconFlow
    re.compile(r"should not be larger than (\d+)", re.I),  # DashScope
    re.compile(r"input: List should have at most (\d+) items", re.I),  # Infinity (FastAPI 422)
    re.compile(r"(?:batch|input)[^.]*?(?:at most|no more than|<=|maximum(?: of)?) (\d+)", re.I),
    re.compile(r"(?:max(?:imum)?|limit)[ _]?(?:batch|inputs?)[^\d]{0,20}(\d+)", re.I),
)
_BATCH_WORDS = re.compile(
    r"batch|too many (?:inputs|texts)|number of (?:inputs|texts)|input: List should have at most",
    re.I,
)
_CONTEXT_WORDS = re.compile(
    r"context length|maximum context|too long|exceeds? the max|max(?:imum)?[_ ]model[_ ]len"
    r"|input (?:tokens|length)|token limit|must have less than"
    # llama.cpp / llama-box: "prefill 744 tokens exceed n_ctx_per_seq", "decoding
    # exceeds the available context size", "input is too large to process, please
    # increase the physical batch size", "input prompt is too big compared to KV size"
    r"|n_ctx|context (?:size|window)|too (?:large|big) to process|compared to KV",
    re.I,
)


def context_refusal(message: str) -> bool:
    """Whether ``message`` says an input is longer than the model's context (any
    server's wording: OpenAI's "maximum context length", llama-box's "exceed
    n_ctx_per_seq", TEI's "must have less than 512 tokens", ...)."""
    return _CONTEXT_WORDS.search(message) is not None


LimitUnit = Literal["texts", "tokens", "bytes", "characters"]


@dataclass(frozen=True, slots=True)
class StatedLimit:
    """A limit a server states in a refusal (``stated_limit``).

    Attributes:
        unit: what it counts: ``"texts"`` (items, instances, inputs per request),
            ``"tokens"``, ``"bytes"`` (of the request body) or ``"characters"``.
        value: the most it accepts, in ``unit``.
        per_input: it is about one input (a context length: "per input", "n_ctx"),
            not about the request as a whole.
    """

    unit: LimitUnit
    value: int
    per_input: bool = False


_NUMBER = r"(\d[\d,]*)"
# a limit word, up to four filler words, then the number: "at most 1024", "maximum
# allowed batch size 32", "exceeds the limit: 4194304", "> 8192", "Max is 16384"
_LIMIT_AFTER = re.compile(
    r"(?:at most|no more than|not (?:be )?(?:larger|greater|more) than|up to|"
    r"max(?:imum)?|limit|allowed|exceed(?:s|ed|ing)?|greater than|larger than|over|<=?|>=?)"
    r"(?:\s*:?\s*(?:[a-z_()]+|is|of|the))?(?:\s+(?:[a-z_()]+)){0,3}\s*:?\s*" + _NUMBER,
    re.I,
)
# the number, then the limit word: "250 instance(s) is allowed", "96 texts maximum"
_LIMIT_BEFORE = re.compile(
    _NUMBER + r"\s*(?:[a-z_()]+\s*){0,2}(?:is |are )?(?:the )?(?:allowed|max(?:imum)?\b|limit)",
    re.I,
)
_UNIT_WORDS: tuple[tuple[LimitUnit, re.Pattern[str]], ...] = (
    ("bytes", re.compile(r"\bbytes?\b|\b[kmg]i?b\b|payload|request body|entity", re.I)),
    ("characters", re.compile(r"\bchar(?:acter)?s?\b", re.I)),
    ("tokens", re.compile(r"\btokens?\b", re.I)),
    (
        "texts",
        re.compile(
            r"\b(?:items?|instances?|instance\(s\)|inputs?|texts?|documents?|sentences?|"
            r"strings?|elements?|entries|list)\b",
            re.I,
        ),
    ),
)
_BATCH_WORD = re.compile(r"\bbatch", re.I)  # texts, when no other unit is named
_SCALE = re.compile(r"\s*([kmg])(i?)b\b", re.I)  # "5 MB", "4MiB"
_PER_INPUT = re.compile(
    r"\b(?:per|each|every|single) (?:input|text|item|sequence|document|string|sentence)\b",
    re.I,
)


def stated_limit(message: str) -> StatedLimit | None:
    """The limit a refusal states, in any wording: the number after a limit word ("at
    most 1024 items", "exceeds the limit: 4194304 bytes", "> 8192") or before one ("250
    instance(s) is allowed"), and the unit nearest to it (texts, tokens, bytes,
    characters; ``None`` when the message names none). A context-length wording or
    "per input" makes it a per-input limit.

    The caller checks the number against what it sent (a limit is below it).
    """
    found = _LIMIT_AFTER.search(message) or _LIMIT_BEFORE.search(message)
    if found is None:
        return None
    value = int(found.group(1).replace(",", ""))
    if value <= 0:
        return None
    where = found.start(1)
    scale = _SCALE.match(message, found.end(1))
    if scale is not None:  # "5 MB": decimal units, "4 MiB": binary ones
        power = "kmg".index(scale.group(1).lower()) + 1
        value *= (1024 if scale.group(2) else 1000) ** power
    best: tuple[int, LimitUnit] | None = None if scale is None else (-1, "bytes")
    for unit, words in _UNIT_WORDS:
        for word in words.finditer(message):
            distance = min(abs(word.start() - where), abs(word.end() - where))
            if best is None or distance < best[0]:
                best = (distance, unit)
    if best is None and _BATCH_WORD.search(message):
        best = (0, "texts")
    if best is None:
        return None
    per_input = _PER_INPUT.search(message) is not None or context_refusal(message)
    return StatedLimit(best[1], value, per_input)


def parse_batch_limit(message: str) -> int | None:
    """The server's maximum texts per request stated in ``message``, if any.

    Recognises TEI ("batch size 64 > maximum allowed batch size 32"), DashScope
    ("batch size is invalid, it should not be larger than 10") and similar wordings.
    """
    if not _BATCH_WORDS.search(message):
        return None
    for pattern in _BATCH_LIMIT_PATTERNS:
        match = pattern.search(message)
        if match:
            limit = int(match.group(1))
            return limit if limit > 0 else None
    return None


_TOKEN_WORDS = re.compile(
    r"tokens?\b[^.]{0,40}\b(?:in|per|of)\s+(?:the\s+|this\s+)?(?:batch|request)"
    r"|(?:batch|request)[^.]{0,40}\btokens?\b|too many tokens|total tokens|max_batch_tokens",
    re.I,
)
_TOKEN_LIMIT_PATTERNS = (
    re.compile(r"max(?:imum)?\s+is\s+(\d[\d,]*)", re.I),  # "Max is 16384 got 29000"
    re.compile(r"max(?:imum)?\s+(?:of\s+)?(\d[\d,]*)\s+tokens", re.I),  # "max 300000 tokens"
    re.compile(r"(\d[\d,]*)\s+tokens\s+per\s+(?:request|batch)", re.I),
    re.compile(r"(?:limit|max(?:imum)?)[^\d]{0,30}(\d[\d,]*)", re.I),
)


def parse_token_limit(message: str) -> tuple[bool, int | None]:
    """Whether ``message`` refuses a request for its total tokens, and the cap it states.

    Recognises wordings such as "Too many tokens in batch. Max is 16384 got 29000"
    (TEI-style), "Requested 320000 tokens, max 300000 tokens per request" (OpenAI) and
    "total tokens of the batch exceed ...". A per-text context-length refusal ("This
    model's maximum context length is 8192 tokens") is not one.

    Returns:
        ``(is_token_cap, cap or None)``.
    """
    if not _TOKEN_WORDS.search(message) or "context length" in message.lower():
        return False, None
    for pattern in _TOKEN_LIMIT_PATTERNS:
        match = pattern.search(message)
        if match:
            value = int(match.group(1).replace(",", ""))
            if value > 0:
                return True, value
    return True, None


_REQUEST_ID_HEADERS = (
    "x-request-id",
    "request-id",
    "x-dashscope-request-id",
    "x-siliconcloud-trace-id",
)


def response_request_id(
    headers: Mapping[str, str] | None,
    body: bytes | str | None = None,
    *,
    secret: str | tuple[str, ...] | None,
) -> str | None:
    """The server's request id (``x-request-id`` and similar headers, or a body's
    ``request_id``), scrubbed of credentials (``secret``: the API key, or every secret of
    the request) and cut to 128 characters; ``None`` if absent."""
    request_id: Any = None
    if headers is not None:
        for name in _REQUEST_ID_HEADERS:
            if headers.get(name):
                request_id = headers[name]
                break
    if request_id is None and body:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            data = None
        if isinstance(data, Mapping):
            request_id = data.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        return None
    return scrub(request_id, *(secret if isinstance(secret, tuple) else (secret,)))[:128]


class ProxyURL:
    """A proxy URL with credentials (``http://user:password@host:port``), held as a secret.

    ``repr`` and ``str`` show it redacted (``http://user:***@host:port``). Pickling does
    NOT carry the password: an unpickled ``ProxyURL`` takes the URL from the first of
    ``QWEN_EMBED_PROXY``, ``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY`` (either case) of
    the process it lands in that names the same proxy and user; without one it keeps
    the redacted URL (the proxy then refuses it: 407). ``copy``/``deepcopy`` keep it.
    """

    __slots__ = ("_value", "redacted")

    def __init__(self, value: str) -> None:
        self._value = value
        self.redacted = redact_url(value)

    def get_secret_value(self) -> str:
        """The URL with its credentials. Call only where the proxy is dialled."""
        return self._value

    def __repr__(self) -> str:
        return f"ProxyURL({self.redacted!r})"

    def __str__(self) -> str:
        return self.redacted

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProxyURL) and other._value == self._value

    def __hash__(self) -> int:
        return hash(("ProxyURL", self._value))

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_proxy_from_env, (self.redacted,))

    def in_environment(self) -> bool:
        """Whether an unpickled copy gets this URL back here (see above)."""
        return _proxy_from_env(self.redacted) == self

    def __copy__(self) -> ProxyURL:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ProxyURL:
        return self


_PROXY_VARIABLES: Final = ("QWEN_EMBED_PROXY", "HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY")


def _proxy_from_env(redacted: str) -> ProxyURL:
    for name in _PROXY_VARIABLES:
        for variable in (name, name.lower()):
            value = (os.environ.get(variable) or "").strip()
            if value and redact_url(value) == redacted:
                return ProxyURL(value)
    return ProxyURL(redacted)
