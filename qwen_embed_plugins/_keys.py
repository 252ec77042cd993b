"""The API key objects: ``Secret`` (a fixed key), ``KeyFunction`` (a callable called for
each request) and ``MissingKey``, and how a pickle refers to a key without holding it.

No key, no callable and no result of one ever shows in a ``repr``, a log or an error. A
pickle of a key holds a token (never the key) naming the key object in this process's registry
(``_KEYS``): found again in the same process or in one forked from it after the key was
made; anywhere else ``QWEN_EMBED_API_KEY`` is read, and without it every request raises
``ConfigError`` naming that fix before anything is sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import os
import secrets
import weakref
from collections.abc import Callable
from typing import Any, Final

from ._settings import SETTING
from .errors import ConfigError

__all__ = [
    "ENV_API_KEY",
    "KeyFunction",
    "MissingKey",
    "Secret",
    "checked_api_key",
    "key_text",
    "key_token",
    "recall_key",
    "restored_key",
]

ENV_API_KEY: Final = str(SETTING["api_key"].env)


_KEYS: Final[weakref.WeakValueDictionary[str, Any]] = weakref.WeakValueDictionary()
"""Every live key of this process by its token (a ``KeyFunction``, or the ``_Held``
value every ``Secret`` of the same key shares): what a pickle of a key holds instead of
the key. A process forked from this one inherits the objects and this registry, so an
unpickled key is found there again; any other process (spawned, another machine, a
later run) does not have it."""

_SALT: Final = secrets.token_bytes(32)
"""This process's random salt of a fixed key's token (inherited by forked children);
never leaves the process, so a token tells nothing about the key."""


class _Held:
    """A fixed key's value, shared by every live ``Secret`` of it (registered in
    ``_KEYS`` while one lives)."""

    __slots__ = ("__weakref__", "value")

    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return "_Held('**********')"


def _held(value: str) -> tuple[str, _Held]:
    """The token of fixed key ``value`` and its registered ``_Held``."""
    token = key_token(value)
    held = _KEYS.get(token)
    if not isinstance(held, _Held):
        held = _KEYS[token] = _Held(value)
    return token, held


def key_token(value: str) -> str:
    """The token of fixed key ``value`` in this process (see ``_SALT``)."""
    return hmac.new(_SALT, value.encode(), hashlib.sha256).hexdigest()[:32]


def recall_key(token: str | None) -> Secret | KeyFunction | None:
    """The live key named ``token`` in this process (the same process, or one forked
    from it while the key was alive), or ``None``."""
    found = None if token is None else _KEYS.get(token)
    if isinstance(found, _Held):
        return Secret(found.value)
    return found if isinstance(found, KeyFunction) else None


def restored_key(token: str | None, had_key: bool, from_env: bool) -> Secret | KeyFunction | None:
    """The key of an unpickled copy: the original (``recall_key``); else, if the copy
    had a key or reads the environment anyway (``from_env``), ``QWEN_EMBED_API_KEY``
    from this process's environment; else, if it had a key, a ``KeyFunction`` of
    ``MissingKey`` that refuses every request (never one sent without the key given);
    else ``None``."""
    found = recall_key(token)
    if found is not None:
        return found
    if had_key or from_env:
        found = _secret_from_env()
    if found is None and had_key:
        found = KeyFunction(MissingKey())
    return found


def _key_from_pickle(token: str) -> Secret | KeyFunction | None:
    """An unpickled ``Secret`` or ``KeyFunction`` (``restored_key``)."""
    return restored_key(token, had_key=True, from_env=True)


class Secret:
    """A secret string (the API key) that never shows itself.

    ``repr`` and ``str`` print ``'**********'``. Pickling does NOT carry the value, only a
    token naming this object in this process (``_KEYS``; a hash of the key keyed by a
    random per-process salt, which never leaves the process): unpickled in the same
    process or in a process forked from it after the key was made (LlamaIndex's
    ``IngestionPipeline.arun(num_workers=N)`` on Linux), the key is found again; anywhere
    else (a spawned process, another machine) ``QWEN_EMBED_API_KEY`` is read from that
    process's environment, and without it every request raises ``ConfigError`` naming
    that fix before anything is sent. A pickle file never holds a key.
    """

    __slots__ = ("_held", "_token", "_value")

    def __init__(self, value: str) -> None:
        self._value = value
        self._token, self._held = _held(value)  # registered while this Secret lives

    def get_secret_value(self) -> str:
        """The secret itself. Call only where it is sent (the Authorization header)."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('**********')"

    def __str__(self) -> str:
        return "**********"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(("Secret", self._value))

    @property
    def token(self) -> str:
        """The random name of this key in this process (what a pickle holds)."""
        return self._token

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_key_from_pickle, (self._token,))

    # copy/deepcopy stay in the process: keep the value (without these, deepcopy would
    # go through __reduce__).
    def __copy__(self) -> Secret:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Secret:
        return self


def _secret_from_env() -> Secret | None:
    value = os.environ.get(ENV_API_KEY)
    return Secret(value) if value else None


class MissingKey:
    """The key of an instance unpickled where the key it had cannot be found (see
    ``Secret``): calling it raises ``ConfigError`` naming the fix."""

    def __call__(self) -> str:
        raise ConfigError(
            "the API key given in code did not reach this process: keys are never "
            "pickled, and this process was not forked from the one holding it (e.g. "
            "LlamaIndex's IngestionPipeline.run(num_workers=N) starts its workers with "
            f"'spawn'); set {ENV_API_KEY} in the environment of the process that starts "
            "the workers (they inherit it), or run without worker processes; nothing was "
            "sent"
        )

    def __repr__(self) -> str:
        return "MissingKey()"


class KeyFunction:
    """An API key read from a callable for each request (a rotating token).

    ``function`` is a ``Callable[[], str]`` or ``Callable[[], Awaitable[str]]``, called
    once per HTTP request (retries, splits and probes included), so a rotated key is
    used at once; the pool is not keyed by it. As with ``langchain-openai``: a sync
    callable is called directly on the sync path and in the event loop's default
    executor on the async path; an async callable serves the async path only (the sync
    path raises ``ConfigError``). Neither the callable nor its results show in a
    ``repr``, a log or an error; a pickle holds a random token only (as ``Secret``).
    """

    __slots__ = ("__weakref__", "_function", "_is_async", "_recent", "_token")

    def __init__(self, function: Callable[[], Any]) -> None:
        self._function = function
        self._is_async = inspect.iscoroutinefunction(function) or (
            inspect.iscoroutinefunction(getattr(function, "__call__", None))  # noqa: B004
        )
        self._recent: tuple[str, ...] = ()
        self._token = secrets.token_hex(16)
        _KEYS[self._token] = self

    @property
    def function(self) -> Callable[[], Any]:
        """The callable given as ``api_key``."""
        return self._function

    @property
    def token(self) -> str:
        """The random name of this key in this process (what a pickle holds)."""
        return self._token

    def recent(self) -> tuple[str, ...]:
        """The last few keys it gave (this process only): scrubbed from what servers send
        back and from logs, like a fixed key."""
        return self._recent

    def resolve(self) -> str:
        """The key for one request on the sync path.

        Raises:
            ConfigError: an async callable (the sync path cannot await it), or the
                callable raised or did not return a non-empty ``str``; nothing is sent.
        """
        if self._is_async:
            raise ConfigError(_ASYNC_ONLY)
        value = self._call()
        if inspect.isawaitable(value):
            if inspect.iscoroutine(value):
                value.close()  # never awaited: no "coroutine was never awaited" warning
            raise ConfigError(_ASYNC_ONLY)
        return self._checked(value)

    async def aresolve(self) -> str:
        """The key for one request on the async path (a sync callable runs in the
        running loop's default executor, as ``langchain-openai`` does).

        Raises:
            ConfigError: as ``resolve``, for an async callable too.
        """
        if self._is_async:
            value = self._call()
        else:
            value = await asyncio.get_running_loop().run_in_executor(None, self._call)
        if inspect.isawaitable(value):
            try:
                value = await value
            except ConfigError:
                raise
            except Exception as exc:
                raise ConfigError(_raised(exc)) from exc
        return self._checked(value)

    def _call(self) -> Any:
        try:
            return self._function()
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(_raised(exc)) from exc

    def _checked(self, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            shown = "an empty str" if isinstance(value, str) else type(value).__name__
            raise ConfigError(
                f"api_key: the key callable returned {shown}, not a non-empty str; nothing was sent"
            )
        found = key_text(value)
        if found not in self._recent:
            self._recent = (*self._recent[-(_RECENT_KEYS - 1) :], found)
        return found

    def __repr__(self) -> str:
        return "KeyFunction(<callable>)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeyFunction) and (
            other._function is self._function or bool(other._function == self._function)
        )

    def __hash__(self) -> int:
        try:
            return hash(("KeyFunction", self._function))
        except TypeError:  # an unhashable callable object: equal ones still hash alike
            return hash("KeyFunction")

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_key_from_pickle, (self._token,))

    def __copy__(self) -> KeyFunction:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> KeyFunction:
        return self


_RECENT_KEYS: Final = 4
_ASYNC_ONLY: Final = (
    "api_key is an async callable, which the sync methods cannot await: use the async "
    "ones (aembed_documents / aembed_query, AsyncEmbeddingClient), or give a str or a "
    "sync callable; nothing was sent"
)


def _raised(exc: BaseException) -> str:
    return (
        f"api_key: the key callable raised {type(exc).__name__}; nothing was sent (its "
        "error is chained as the cause)"
    )


def checked_api_key(value: str) -> Secret | None:
    """``key_text(value)`` as a ``Secret``, ``None`` if empty."""
    value = key_text(value)
    return Secret(value) if value else None


def key_text(value: str) -> str:
    """Strip surrounding whitespace (a key read from a file ends with a newline) and refuse
    keys an HTTP header cannot carry. The message never shows the key."""
    value = value.strip()
    if value and (
        not value.isascii() or not value.isprintable() or any(c.isspace() for c in value)
    ):
        raise ConfigError(
            "api_key contains whitespace, control or non-ASCII characters inside it, which "
            "an HTTP Authorization header cannot carry; check how the key was read"
        )
    return value
