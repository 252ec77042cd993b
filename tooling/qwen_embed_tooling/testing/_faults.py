"""Scripted faults (`Fault`, consumed one per request), persistent rules (`Rule`, applied
to every request until cleared) and how they spoil vectors."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal, TypeAlias, cast, get_args

import numpy as np

from ._common import (
    NAN_ERROR_BODY,
    TOKEN_CAP_MESSAGE,
    _body_bytes,
    _integer,
    _number,
    _seconds_text,
    _truncate,
    _Vector,
    count_tokens,
)

FaultKind = Literal["status", "close", "reset", "delay", "malformed", "wrong_count", "nan", "zero"]
#: Every fault kind `EmbeddingServer.inject` accepts.
FAULT_KINDS: Final[tuple[str, ...]] = get_args(FaultKind)
_FAULT_PARAMS: Final[dict[str, frozenset[str]]] = {
    "status": frozenset({"status", "message", "body", "retry_after", "retry_after_ms", "headers"}),
    "close": frozenset(),
    "reset": frozenset({"after_bytes", "pause"}),
    "delay": frozenset({"seconds"}),
    "malformed": frozenset({"body"}),
    "wrong_count": frozenset({"drop"}),
    "nan": frozenset({"index", "literal"}),
    "zero": frozenset({"index"}),
}
_MALFORMED_BODY: Final = (
    b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,'
)


@dataclass(frozen=True)
class Fault:
    """One scripted misbehaviour of `EmbeddingServer`; build it with `Fault.make`.

    Each field is used by the kinds named after it; the others keep their defaults.

    Attributes:
        kind: one of `FAULT_KINDS`.
        status: ``status``: the HTTP status code (200..599).
        message: ``status``: the error message (default: SGLang's queue-full message for
            503, the status phrase otherwise).
        body: ``status``, ``malformed``: the exact body bytes (replaces the default).
        retry_after: ``status``: the ``Retry-After`` header value (seconds or HTTP date).
        retry_after_ms: ``status``: the ``retry-after-ms`` header value (milliseconds).
        headers: ``status``: extra response headers.
        after_bytes: ``reset``: body bytes sent before the reset (``None``: half; 0: none,
            not even the status line).
        pause: ``reset``: seconds between the last byte sent and the reset.
        seconds: ``delay``: seconds to wait before answering.
        drop: ``wrong_count``: how many vectors to leave out (from the end).
        index: ``nan``, ``zero``: the input index whose vector is spoiled (clamped to the
            last one).
        literal: ``nan``: write ``NaN`` instead of ``null`` in float bodies.
    """

    kind: FaultKind
    status: int = 500
    message: str | None = None
    body: bytes | None = None
    retry_after: str | None = None
    retry_after_ms: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    after_bytes: int | None = None
    pause: float = 0.05
    seconds: float = 1.0
    drop: int = 1
    index: int = 0
    literal: bool = False

    @classmethod
    def make(cls, kind: str, **params: Any) -> Fault:
        """Validate ``params`` for ``kind`` and build the fault.

        Raises:
            ValueError: unknown kind, or a parameter out of range.
            TypeError: a parameter the kind does not take.
        """
        if kind not in _FAULT_PARAMS:
            raise ValueError(
                f"unknown fault kind {kind!r}; expected one of {', '.join(FAULT_KINDS)}"
            )
        allowed = _FAULT_PARAMS[kind]
        for name in params:
            if name not in allowed:
                raise TypeError(
                    f"fault {kind!r} takes no parameter {name!r}; "
                    f"allowed: {', '.join(sorted(allowed)) or 'none'}"
                )
        values: dict[str, Any] = {}
        if "status" in params:
            values["status"] = _integer("status", params["status"], minimum=200)
            if values["status"] > 599:
                raise ValueError(f"status must be in 200..599, got {params['status']!r}")
        if params.get("message") is not None:
            if not isinstance(params["message"], str):
                raise ValueError("message must be a str")
            values["message"] = params["message"]
        if params.get("body") is not None:
            values["body"] = _body_bytes(params["body"])
        if params.get("retry_after") is not None:
            value = params["retry_after"]
            values["retry_after"] = (
                value if isinstance(value, str) else _seconds_text(_number("retry_after", value))
            )
        if params.get("retry_after_ms") is not None:
            values["retry_after_ms"] = _seconds_text(
                _number("retry_after_ms", params["retry_after_ms"])
            )
        if params.get("headers") is not None:
            values["headers"] = tuple((str(k), str(v)) for k, v in dict(params["headers"]).items())
        if params.get("after_bytes") is not None:
            values["after_bytes"] = _integer("after_bytes", params["after_bytes"], minimum=0)
        if "pause" in params:
            values["pause"] = _number("pause", params["pause"])
        if "seconds" in params:
            values["seconds"] = _number("seconds", params["seconds"])
        if "drop" in params:
            values["drop"] = _integer("drop", params["drop"], minimum=1)
        if "index" in params:
            values["index"] = _integer("index", params["index"], minimum=0)
        if "literal" in params:
            values["literal"] = bool(params["literal"])
        return cls(kind=cast(FaultKind, kind), **values)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe form (``body`` as base64), the inverse of `Fault.from_dict`."""
        data = asdict(self)
        data["body"] = None if self.body is None else base64.b64encode(self.body).decode("ascii")
        data["headers"] = [list(pair) for pair in self.headers]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Fault:
        """Rebuild a fault from `Fault.to_dict` output."""
        values = dict(data)
        if values.get("body") is not None:
            values["body"] = base64.b64decode(values["body"])
        values["headers"] = tuple((str(k), str(v)) for k, v in values.get("headers", ()))
        return cls(**values)


FaultSpec: TypeAlias = str | Fault | tuple[str, Mapping[str, Any]]


def _as_fault(spec: FaultSpec) -> Fault:
    if isinstance(spec, Fault):
        return spec
    if isinstance(spec, str):
        return Fault.make(spec)
    kind, params = spec
    return Fault.make(kind, **params)


#: Transient faults a correct client recovers from by retrying: the default mix of
#: `EmbeddingServer.set_random_faults`.
SOAK_FAULTS: Final[tuple[Fault, ...]] = (
    Fault.make("status", status=429, retry_after_ms=5),
    Fault.make("status", status=503),
    Fault.make("close"),
    Fault.make("reset"),
    Fault.make("reset", after_bytes=0),
)


def _spoil(fault: Fault, vectors: list[_Vector]) -> tuple[list[_Vector], bool]:
    if fault.kind == "wrong_count":
        return vectors[: max(0, len(vectors) - fault.drop)], False
    index = min(fault.index, len(vectors) - 1)
    spoiled = list(vectors)
    if fault.kind == "nan":
        bad = vectors[index].copy()
        bad[len(bad) // 2] = np.nan
        spoiled[index] = bad
        return spoiled, fault.literal
    spoiled[index] = np.zeros_like(vectors[index])
    return spoiled, False


# --------------------------------------------------------------------------------------
# Rules: persistent, deterministic behaviours (until cleared), checked on every request
# --------------------------------------------------------------------------------------

RuleKind = Literal[
    "poison",
    "drop_over",
    "token_cap",
    "context_length",
    "base64_error",
    "one_item_list",
    "truncate",
    "window",
]
#: Every rule kind `EmbeddingServer.add_rule` accepts.
RULE_KINDS: Final[tuple[str, ...]] = get_args(RuleKind)
_RULE_PARAMS: Final[dict[str, frozenset[str]]] = {
    "poison": frozenset({"text", "substring", "action", "status", "body", "message", "literal"}),
    "drop_over": frozenset({"max_texts", "action"}),
    "token_cap": frozenset({"max_tokens", "message", "status"}),
    "context_length": frozenset({"max_tokens", "name_index"}),
    "base64_error": frozenset({"status", "message", "body"}),
    "one_item_list": frozenset({"status", "message", "body"}),
    "truncate": frozenset({"max_tokens"}),
    "window": frozenset({"seconds", "status", "message", "retry_after"}),
}
_RULE_REQUIRED: Final[dict[str, str]] = {
    "poison": "text",
    "drop_over": "max_texts",
    "token_cap": "max_tokens",
    "context_length": "max_tokens",
    "truncate": "max_tokens",
    "window": "seconds",
}
_RULE_STATUS: Final = {
    "poison": 500,
    "token_cap": 400,
    "base64_error": 500,
    "one_item_list": 500,
    "window": 429,
}
_RULE_ACTIONS: Final = {
    "poison": ("status", "nan", "close", "reset"),
    "drop_over": ("close", "reset"),
}


@dataclass(frozen=True)
class Rule:
    """A persistent misbehaviour of `EmbeddingServer`: it applies to every embedding
    request it matches until `EmbeddingServer.clear_rules` (or ``clear_faults``); build it
    with `Rule.make`. Token figures use `count_tokens` (``ceil(chars / 4)``).

    Attributes:
        kind: one of `RULE_KINDS`.
        text: ``poison``: the poisonous text.
        substring: ``poison``: match texts that contain ``text`` (default: equal to it).
        action: ``poison``: ``"status"`` (answer ``status`` with ``body``), ``"nan"`` (200,
            NaN in the poisoned inputs' vectors), ``"close"`` or ``"reset"`` (drop the
            connection); ``drop_over``: ``"close"`` or ``"reset"``.
        status: the answer's status (poison 500, token_cap 400, base64_error 500,
            one_item_list 500, window 429).
        body: ``poison``, ``base64_error``, ``one_item_list``: exact body bytes.
            poison's default is Ollama's ``{"error":"json: unsupported value: NaN"}``
            unless ``message`` is given.
        message: the error message, in the dialect's error body; ``token_cap``: a template
            where ``{cap}`` and ``{n}`` become the cap and the request's tokens.
        literal: ``poison`` with ``action="nan"``: write ``NaN``, not ``null``.
        max_texts: ``drop_over``: the largest batch answered; bigger ones are dropped.
        max_tokens: ``token_cap``: most tokens in one request; ``context_length``: most
            tokens in one text; ``truncate``: tokens kept of each text.
        name_index: ``context_length``: name the input index in the message (``None``: as
            the dialect's real server does).
        seconds: ``window``: how long the window lasts, from when it is added.
        retry_after: ``window``: the ``Retry-After`` value (none by default).
        until: ``window``: its end on the serving process's ``time.monotonic()`` clock
            (set by the server when the rule is added).
    """

    kind: RuleKind
    text: str = ""
    substring: bool = False
    action: str = ""
    status: int = 0
    body: bytes | None = None
    message: str | None = None
    literal: bool = False
    max_texts: int = 0
    max_tokens: int = 0
    name_index: bool | None = None
    seconds: float = 0.0
    retry_after: str | None = None
    until: float = 0.0

    @classmethod
    def make(cls, kind: str, **params: Any) -> Rule:
        """Validate ``params`` for ``kind`` and build the rule.

        Raises:
            ValueError: unknown kind, a missing required parameter, or one out of range.
            TypeError: a parameter the kind does not take.
        """
        if kind not in _RULE_PARAMS:
            raise ValueError(f"unknown rule kind {kind!r}; expected one of {', '.join(RULE_KINDS)}")
        allowed = _RULE_PARAMS[kind]
        for name in params:
            if name not in allowed:
                names = ", ".join(sorted(allowed))
                raise TypeError(f"rule {kind!r} takes no parameter {name!r}; allowed: {names}")
        required = _RULE_REQUIRED.get(kind)
        if required is not None and params.get(required) is None:
            raise ValueError(f"rule {kind!r} needs {required}=")
        values: dict[str, Any] = {"status": _RULE_STATUS.get(kind, 0)}
        actions = _RULE_ACTIONS.get(kind)
        if actions is not None:
            action = params.get("action") or actions[0]
            if action not in actions:
                raise ValueError(f"action must be one of {', '.join(actions)}, got {action!r}")
            values["action"] = action
        if "text" in params:
            if not isinstance(params["text"], str) or not params["text"]:
                raise ValueError("text must be a non-empty str")
            values["text"] = params["text"]
        if "substring" in params:
            values["substring"] = bool(params["substring"])
        if params.get("status") is not None:
            values["status"] = _integer("status", params["status"], minimum=200)
            if values["status"] > 599:
                raise ValueError(f"status must be in 200..599, got {params['status']!r}")
        if params.get("message") is not None:
            if not isinstance(params["message"], str):
                raise ValueError("message must be a str")
            values["message"] = params["message"]
        if params.get("body") is not None:
            values["body"] = _body_bytes(params["body"])
        elif kind == "poison" and values.get("message") is None:
            values["body"] = NAN_ERROR_BODY
        if kind == "token_cap" and values.get("message") is None:
            values["message"] = TOKEN_CAP_MESSAGE
        if "literal" in params:
            values["literal"] = bool(params["literal"])
        if "max_texts" in params:
            values["max_texts"] = _integer("max_texts", params["max_texts"], minimum=1)
        if "max_tokens" in params:
            values["max_tokens"] = _integer("max_tokens", params["max_tokens"], minimum=1)
        if params.get("name_index") is not None:
            values["name_index"] = bool(params["name_index"])
        if "seconds" in params:
            values["seconds"] = _number("seconds", params["seconds"])
        if params.get("retry_after") is not None:
            value = params["retry_after"]
            values["retry_after"] = (
                value if isinstance(value, str) else _seconds_text(_number("retry_after", value))
            )
        return cls(kind=cast(RuleKind, kind), **values)

    def matches(self, text: str) -> bool:
        """``poison``: whether ``text`` is poisonous."""
        return self.text in text if self.substring else text == self.text

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe form (``body`` as base64), the inverse of `Rule.from_dict`."""
        data = asdict(self)
        data["body"] = None if self.body is None else base64.b64encode(self.body).decode("ascii")
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Rule:
        """Rebuild a rule from `Rule.to_dict` output."""
        values = dict(data)
        if values.get("body") is not None:
            values["body"] = base64.b64decode(values["body"])
        return cls(**values)


@dataclass
class _Verdict:
    """What the rules decided for one request: a terminal rule (answer or drop) and the
    index it names, or the texts to embed (truncated) and the inputs to spoil with NaN."""

    texts: list[str]
    rule: Rule | None = None
    index: int | None = None
    tokens: int = 0
    nan: list[int] = field(default_factory=list)
    nan_literal: bool = False


def _judge(
    rules: Sequence[Rule], texts: list[str], base64_asked: bool, one_item_list: bool = False
) -> _Verdict:
    """Apply the request rules (all but ``window``) to a valid request, in this order:
    ``truncate`` (rewrites the texts), ``drop_over``, ``poison``, ``token_cap``,
    ``context_length``, ``base64_error``, ``one_item_list`` (the request's ``input`` was
    a list of one text); the first that answers wins."""
    for rule in rules:
        if rule.kind == "truncate":
            texts = [_truncate(t, rule.max_tokens) for t in texts]
    verdict = _Verdict(texts)
    by_kind = {kind: [r for r in rules if r.kind == kind] for kind in RULE_KINDS}
    for rule in by_kind["drop_over"]:
        if len(texts) > rule.max_texts:
            return _Verdict(texts, rule)
    for rule in by_kind["poison"]:
        hits = [i for i, text in enumerate(texts) if rule.matches(text)]
        if not hits:
            continue
        if rule.action != "nan":
            return _Verdict(texts, rule, hits[0])
        verdict.nan.extend(hits)
        verdict.nan_literal = verdict.nan_literal or rule.literal
    tokens = [count_tokens(t) for t in texts]
    for rule in by_kind["token_cap"]:
        if sum(tokens) > rule.max_tokens:
            return _Verdict(texts, rule, None, sum(tokens))
    for rule in by_kind["context_length"]:
        for i, n in enumerate(tokens):
            if n > rule.max_tokens:
                return _Verdict(texts, rule, i, n)
    for rule in by_kind["base64_error"]:
        if base64_asked:
            return _Verdict(texts, rule)
    for rule in by_kind["one_item_list"]:
        if one_item_list:
            return _Verdict(texts, rule)
    verdict.nan = sorted(set(verdict.nan))
    return verdict


def _spoil_nan(vectors: list[_Vector], indexes: Sequence[int]) -> list[_Vector]:
    """``vectors`` with a NaN in the middle component of each of ``indexes``."""
    spoiled = list(vectors)
    for index in indexes:
        bad = vectors[index].copy()
        bad[len(bad) // 2] = np.nan
        spoiled[index] = bad
    return spoiled
