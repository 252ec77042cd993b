"""Per-request extras of a config: ``EmbeddingConfig.headers`` and ``extra_body``.

Both are frozen and hashable (part of the config), and neither is part of the pool key:
they travel with each request, so they never split a pool. Credential-like header values
and body fields never show in a ``repr``, a dump or a pickle.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any, Final

import orjson

from .errors import ConfigError

__all__ = [
    "DROPPABLE_BODY_KEYS",
    "RESERVED_BODY_KEYS",
    "RequestBody",
    "RequestHeaders",
    "is_secret_field",
    "is_secret_header",
    "request_body",
    "request_headers",
]


_SECRET_HEADER = re.compile(
    r"auth|cookie|key|token|secret|passw|credential|bearer|signature|session", re.I
)
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_CLIENT_HEADERS: Final = frozenset(
    {
        "accept",
        "accept-encoding",
        "connection",
        "content-length",
        "content-type",
        "host",
        "te",
        "transfer-encoding",
        "upgrade",
    }
)
RESERVED_BODY_KEYS: Final = frozenset({"input", "model", "encoding_format", "dimensions"})
DROPPABLE_BODY_KEYS: Final = frozenset({"encoding_format", "dimensions"})
"""The client's own body fields that ``extra_body`` may drop with ``None``."""
"""Request body fields the client writes itself: ``extra_body`` may not hold them."""
_MASK: Final = "**********"


def is_secret_header(name: str) -> bool:
    """Whether header ``name`` looks like a credential: a name holding (in any case)
    ``auth`` (``Authorization``, ``Proxy-Authorization``, ``X-Auth-...``), ``cookie``,
    ``key`` (``api-key``, ``X-Api-Key``, Azure API Management's
    ``Ocp-Apim-Subscription-Key``, Azure Functions' ``x-functions-key``, any ``*-key``),
    ``token``, ``secret``, ``passw``, ``credential``, ``bearer``, ``signature`` or
    ``session``. The one rule for headers: its value is hidden from reprs, dumps,
    pickles, logs, metrics and errors (a harmless header caught by it, e.g.
    ``Idempotency-Key``, is only masked and re-asked for after a pickle)."""
    return _SECRET_HEADER.search(name) is not None


class _Withheld:
    """A secret header value that was not pickled (see ``RequestHeaders``)."""

    def __repr__(self) -> str:
        return "<withheld>"

    def __reduce__(self) -> str:
        return "_WITHHELD"


_WITHHELD: Final = _Withheld()


class RequestHeaders(Mapping[str, str]):
    """``EmbeddingConfig.headers``: extra request headers, immutable and hashable.

    Values of credential-like headers (``is_secret_header``) show as ``'**********'``
    in ``repr`` and ``masked()``, and are never pickled: an unpickled copy knows their
    names only, and a client built from it raises ``ConfigError`` asking for them
    again (rather than sending a request a gateway would refuse).
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, str | _Withheld]) -> None:
        self._items = dict(items)

    def __getitem__(self, name: str) -> str:
        value = self._items[name]
        if isinstance(value, _Withheld):
            raise ConfigError(
                f"header {name!r} looks like a credential, so it was not pickled or "
                "serialised; pass headers= with its value again in this process"
            )
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RequestHeaders):
            return other._items == self._items
        return isinstance(other, Mapping) and dict(other) == self._items

    def __hash__(self) -> int:
        return hash(
            tuple((k, repr(v) if isinstance(v, _Withheld) else v) for k, v in self._items.items())
        )

    def withheld(self) -> list[str]:
        """The names of secret headers whose values were not pickled."""
        return [k for k, v in self._items.items() if isinstance(v, _Withheld)]

    def secret_values(self) -> tuple[str, ...]:
        """The values of the credential-like headers held here (not the withheld ones):
        scrubbed, like the API key, from anything a server sends back."""
        return tuple(
            v for k, v in self._items.items() if is_secret_header(k) and isinstance(v, str)
        )

    def masked(self) -> dict[str, str]:
        """The headers with every secret value replaced by ``'**********'``."""
        return {k: _MASK if is_secret_header(k) else str(v) for k, v in self._items.items()}

    def __repr__(self) -> str:
        return f"RequestHeaders({self.masked()!r})"

    def __reduce__(self) -> tuple[Any, tuple[dict[str, str | _Withheld]]]:
        kept = {k: _WITHHELD if is_secret_header(k) else v for k, v in self._items.items()}
        return (RequestHeaders, (kept,))

    # copy/deepcopy stay in the process: keep the values
    def __copy__(self) -> RequestHeaders:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> RequestHeaders:
        return self


def request_headers(value: object, *, api_key: bool = False) -> RequestHeaders | None:
    """``value`` (a mapping of header names to values, or ``None``) as ``RequestHeaders``.

    Raises:
        ConfigError: a name or value an HTTP header cannot carry; a header the client
            sets itself (``Content-Type``, ``Accept``, ``Content-Length``, ``Host``, ...);
            the same name twice in different case; ``Authorization`` together with an
            ``api_key`` (pass the key one way). Messages never show a secret value.
    """
    if value is None:
        return None
    if isinstance(value, RequestHeaders):
        items: Mapping[str, Any] = value._items
    elif isinstance(value, Mapping):
        items = value
    else:
        raise ConfigError(
            f"headers must be a mapping of names to values, got {type(value).__name__}"
        )
    seen: dict[str, str] = {}
    for name, item in items.items():
        if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
            raise ConfigError(f"headers: {name!r} is not a valid HTTP header name")
        lowered = name.lower()
        if lowered in seen:
            raise ConfigError(f"headers: {seen[lowered]!r} and {name!r} are the same header")
        seen[lowered] = name
        if lowered in _CLIENT_HEADERS:
            raise ConfigError(
                f"headers: {name!r} is set by the client itself (the JSON request body and "
                "its framing) and cannot be overridden"
            )
        if lowered == "authorization" and api_key:
            raise ConfigError(
                "headers: 'Authorization' given together with an API key (api_key=, or "
                "QWEN_EMBED_API_KEY when api_key is not given); pass the credential one way "
                "(api_key= sends 'Authorization: Bearer <key>'; api_key=None sends this "
                "header alone)"
            )
        if isinstance(item, _Withheld):
            continue
        if item == _MASK and is_secret_header(name):
            raise ConfigError(
                f"headers: {name!r} holds the mask {_MASK!r} of a dumped secret, not its "
                "value; pass the real value"
            )
        shown = "(hidden)" if is_secret_header(name) else repr(item)
        if not isinstance(item, str):
            raise ConfigError(
                f"headers: the value of {name!r} must be a str, got {type(item).__name__}"
            )
        if not item.isascii() or any(c in item for c in "\r\n\x00") or not item.strip():
            raise ConfigError(
                f"headers: the value of {name!r} {shown} is empty, not ASCII, or holds a line "
                "break, which an HTTP header cannot carry"
            )
    return RequestHeaders(
        {k: v if isinstance(v, _Withheld) else v.strip() for k, v in items.items()}
    )


def is_secret_field(name: str) -> bool:
    """Whether ``extra_body`` field ``name`` (at any depth) holds a credential: a name
    with a word ``auth*``, ``api_key`` / ``apikey``, ``token``, ``secret``, ``password``,
    ``credential(s)``, ``cookie`` or ``bearer`` (case-insensitive; ``-``, ``_``, ``.``
    and camelCase separate words, so ``access_token`` and ``apiKey`` are secret and
    ``max_tokens`` is not). Its value is hidden like a secret header's."""
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
    return _SECRET_FIELD.search(words) is not None


_SECRET_FIELD = re.compile(
    r"(?:^|[-_. ])(?:auth[a-z]*|api[-_]?key|access[-_]?key|token|secret|password|passwd"
    r"|credentials?|cookie|bearer)(?:$|[-_. ])"
)


def _secret_parts(items: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """``(path, value)`` of each value held under a credential-like field name."""
    if isinstance(items, dict):
        for key, value in items.items():
            if is_secret_field(key):
                yield (*path, key), value
            else:
                yield from _secret_parts(value, (*path, key))
    elif isinstance(items, list):
        for i, value in enumerate(items):
            yield from _secret_parts(value, (*path, str(i)))


def _strings(value: Any) -> Iterator[str]:
    """The strings (and numbers, as text) inside a JSON value."""
    if isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif value is not None and not isinstance(value, bool):
        yield str(value)


def _masked(items: Any) -> Any:
    """A copy of ``items`` with every value under a credential-like name as the mask."""
    if isinstance(items, dict):
        return {k: _MASK if is_secret_field(k) else _masked(v) for k, v in items.items()}
    if isinstance(items, list):
        return [_masked(v) for v in items]
    return items


class RequestBody(Mapping[str, Any]):
    """``EmbeddingConfig.extra_body``: extra JSON fields of every request body, immutable
    and hashable (by their canonical JSON).

    Values under credential-like field names (``is_secret_field``, at any depth) show as
    ``'**********'`` in ``repr`` and ``masked()``, and are never pickled: an unpickled
    copy raises ``ConfigError`` naming the field when read (a client built from it asks
    for the value again).
    """

    __slots__ = ("_items", "_json", "_withheld")

    def __init__(self, items: Mapping[str, Any], withheld: tuple[str, ...] = ()) -> None:
        try:
            self._json = orjson.dumps(dict(items), option=orjson.OPT_SORT_KEYS)
        except TypeError as exc:
            raise ConfigError(f"extra_body must be JSON-serialisable: {exc}") from None
        self._items: dict[str, Any] = orjson.loads(self._json)  # a deep, private copy
        self._withheld = withheld

    def __getitem__(self, name: str) -> Any:
        self.check(name)
        return self._items[name]

    def check(self, name: str | None = None) -> None:
        """Raise ``ConfigError`` if a secret value (of field ``name``, or of any field)
        was withheld from the pickle this copy came from."""
        for dotted in self._withheld:
            if name is None or dotted.split(".", 1)[0] == name:
                raise ConfigError(
                    f"extra_body field {dotted!r} looks like a credential, so it was not "
                    "pickled or serialised; pass extra_body= with its value again in this "
                    "process"
                )

    def withheld(self) -> list[str]:
        """The dotted names of secret fields whose values were not pickled."""
        return list(self._withheld)

    def secret_values(self) -> tuple[str, ...]:
        """The values under credential-like names (their strings): scrubbed, like the
        API key, from anything a server sends back."""
        if self._withheld:
            return ()
        return tuple(s for _, value in _secret_parts(self._items) for s in _strings(value))

    def masked(self) -> dict[str, Any]:
        """The fields with every secret value replaced by ``'**********'``."""
        masked: dict[str, Any] = _masked(self._items)
        return masked

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RequestBody):
            return other._json == self._json and other._withheld == self._withheld
        return not self._withheld and isinstance(other, Mapping) and dict(other) == self._items

    def __hash__(self) -> int:
        return hash((self._json, self._withheld))

    def __repr__(self) -> str:
        return f"RequestBody({self.masked()!r})"

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any], tuple[str, ...]]]:
        withheld = {*self._withheld, *(".".join(p) for p, _ in _secret_parts(self._items))}
        return (RequestBody, (self.masked(), tuple(sorted(withheld))))

    # copy/deepcopy stay in the process: keep the values
    def __copy__(self) -> RequestBody:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> RequestBody:
        return self


def request_body(value: object) -> RequestBody | None:
    """``value`` (a mapping of JSON fields, or ``None``) as ``RequestBody``.

    Raises:
        ConfigError: not a mapping with ``str`` keys, not JSON-serialisable, or it holds
            a field the client writes itself (``input``, ``model``, ``encoding_format``,
            ``dimensions``; the message names it), except ``encoding_format`` or
            ``dimensions`` set to ``None``: that field is then never sent.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"extra_body must be a mapping of JSON fields, got {type(value).__name__}"
        )
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"extra_body: field names must be str, got {key!r}")
        if key in DROPPABLE_BODY_KEYS and value[key] is None:
            continue  # the client never sends that field (``EmbeddingConfig.extra_body``)
        if key in RESERVED_BODY_KEYS:
            hint = " (use dimensions=)" if key == "dimensions" else ""
            raise ConfigError(
                f"extra_body: {key!r} is written by the client itself and cannot be "
                f"overridden{hint}"
            )
    if isinstance(value, RequestBody):
        return value  # one with a withheld secret raises when a client is built from it
    for path, item in _secret_parts(dict(value)):
        if item == _MASK:
            raise ConfigError(
                f"extra_body: {'.'.join(path)!r} holds the mask {_MASK!r} of a dumped "
                "secret, not its value; pass the real value"
            )
    return RequestBody(value)
