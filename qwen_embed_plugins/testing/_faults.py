"""Scripted faults (`Fault`, consumed one per request) and how they spoil vectors."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Final, Literal, TypeAlias, cast, get_args

import numpy as np

from ._common import _body_bytes, _integer, _number, _seconds_text, _Vector

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
