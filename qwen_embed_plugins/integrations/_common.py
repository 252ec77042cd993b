"""The flat settings both framework adapters take, and their core client, defined once.

LangChain and LlamaIndex users set plain fields (``max_connections=8``,
``read_timeout=30``), not nested objects. Both adapters inherit them from the pydantic
mixin ``FlatSettings``, with the one client cache, rebuild and pickling logic; each
field's default, environment variable and description come from its declaration in
``_settings.SETTINGS``, and ``build_config`` turns the fields into the core
``EmbeddingConfig`` (``_flat.config_from``, as the core clients do with the same
names). A field not given takes its ``QWEN_EMBED_*`` environment variable (the one
resolver, ``_config.env_setting``) or its default, or the value of a
``config=EmbeddingConfig(...)`` given with it.
"""

from __future__ import annotations

import copy
import logging
import pickle
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Final, Literal, NamedTuple, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    InstanceOf,
    ModelWrapValidatorHandler,
    PlainSerializer,
    PlainValidator,
    PrivateAttr,
    SecretStr,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    WrapValidator,
    model_validator,
)

from .._client import AsyncEmbeddingClient, EmbeddingClient, load_async_library, prepare_tls
from .._config import (
    NOT_GIVEN,
    EmbeddingConfig,
    EncodingFormat,
    KeyFunction,
    ProxyURL,
    RequestBody,
    RequestHeaders,
    RetryConfig,
    env_setting,
    is_removed_concurrency,
    request_body,
    request_headers,
)
from .._flat import config_from
from .._keys import Secret, key_token, restored_key
from .._server_text import has_credentials, redact_url
from .._settings import SETTING
from ..errors import ConfigError
from ._names import Stock, resolve_names

__all__ = [
    "NO_EXTRAS",
    "ClientCache",
    "Clients",
    "ExtraBodyField",
    "Extras",
    "FlatSettings",
    "HeadersField",
    "KeyFunctionSetting",
    "ProxySetting",
    "build_config",
    "coerce",
    "describe",
    "env_default",
    "extras_of",
    "mask_inputs",
    "mask_proxy",
    "setting",
    "wrap_key",
]

_log = logging.getLogger("qwen_embed_plugins")


def mask_proxy(value: Any) -> Any:
    """A ``proxy`` value as an adapter holds it: a URL with credentials
    (``user:password@``) becomes a ``ProxyURL`` (shown redacted, never pickled)."""
    if isinstance(value, str) and has_credentials(value):
        return ProxyURL(value)
    return value


def mask_inputs(data: Any) -> None:
    """Hide URL credentials (proxy, refused ``base_url`` ones) in an adapter's input, in
    place: pydantic's ``ValidationError.errors()`` keeps the input."""
    if not isinstance(data, dict):
        return
    for name in ("proxy", "openai_proxy"):  # ours, LangChain's stock name
        if name in data:
            data[name] = mask_proxy(data[name])
    base = data.get("base_url")
    if isinstance(base, str) and any(has_credentials(url) for url in base.split(",")):
        data["base_url"] = ",".join(redact_url(url) for url in base.split(","))
    elif isinstance(base, list | tuple) and any(
        isinstance(url, str) and has_credentials(url) for url in base
    ):
        data["base_url"] = [redact_url(url) if isinstance(url, str) else url for url in base]


def _shown_proxy(value: Any) -> Any:
    return value.redacted if isinstance(value, ProxyURL) else value


ProxySetting = Annotated[
    InstanceOf[ProxyURL] | str | None,
    BeforeValidator(mask_proxy),
    PlainSerializer(_shown_proxy),  # model_dump / JSON / to_dict: the redacted URL
    WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "null"}]}),
]
"""The type of both adapters' ``proxy`` field: a URL, held as a ``ProxyURL`` when it
has credentials; dumped redacted (``http://user:***@host:port``)."""


def describe(name: str, also: str = "") -> str:
    """The description of setting ``name``'s field: its declared doc line and
    environment variable (``_settings.SETTINGS``), then ``also``."""
    declared = SETTING[name]
    env = f" Env: {declared.env}." if declared.env else ""
    return f"{declared.doc}{env}{also}"


def _to_core_if_removed(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A field validator: the removed ``max_concurrency="auto"`` is passed on unchecked,
    so that the core config refuses it with its own ``ConfigError`` (the message says
    what to give instead), like any value out of range; anything else is validated
    (``handler``)."""
    return value if is_removed_concurrency(value) else handler(value)


def env_default(name: str) -> Callable[[], Any]:
    """A default factory for field ``name``: its environment variable, else its default."""
    declared = SETTING[name]
    if declared.env is None:
        return lambda: declared.default
    if name == "base_url":

        def base_url() -> Any:
            value = env_setting("base_url")
            if isinstance(value, str) and "," in value:
                return [part.strip() for part in value.split(",") if part.strip()]
            return value

        return base_url
    return lambda: env_setting(name)


def setting(name: str) -> Any:
    """The pydantic ``Field`` of flat setting ``name``, the same in both adapters: its
    default (environment first) and description, as declared in ``_settings``."""
    from pydantic import Field

    if name == "proxy":  # None: "from the environment", read by the core config
        return Field(default=None, description=describe(name))
    return Field(default_factory=env_default(name), description=describe(name))


class Extras(NamedTuple):
    """The parts of a ``config=`` that no flat field holds (the defaults without one).

    Attributes:
        retry: its ``RetryConfig``: backoff and circuit breaker (``max_retries``,
            ``deadline`` and ``query_deadline`` come from the flat fields).
        max_response_bytes: its largest response body, in bytes.
        no_proxy: it said ``proxy=None``, "never a proxy" (the flat ``proxy=None``
            means "from the environment").
    """

    retry: RetryConfig = RetryConfig()
    max_response_bytes: int | None = None
    no_proxy: bool = False


NO_EXTRAS: Final = Extras()


def wrap_key(value: Any) -> Any:
    """An ``api_key`` value as an adapter holds it: a ``str`` as ``SecretStr`` (``""`` as
    ``None``), a callable (sync or async, called for each request) as a
    ``KeyFunction`` (its ``repr`` shows nothing of it), anything else unchanged."""
    if isinstance(value, str):
        return SecretStr(value) if value else None
    if callable(value) and not isinstance(value, SecretStr | KeyFunction):
        return KeyFunction(value)
    return value


KeyFunctionSetting = Annotated[
    InstanceOf[KeyFunction],
    PlainSerializer(lambda _: "**********", when_used="json"),
    WithJsonSchema({"type": "string", "writeOnly": True}),
]
"""A callable ``api_key`` as an adapter's field holds it (``wrap_key``): a
``KeyFunction``, dumped to JSON as the mask, as a ``SecretStr`` is."""


def build_config(
    values: Mapping[str, Any], *, api_key: str | KeyFunction | None, extras: Extras = NO_EXTRAS
) -> EmbeddingConfig:
    """The core ``EmbeddingConfig`` of an adapter's flat field ``values`` (by the
    settings' names) and the ``extras`` of the ``config=`` it was given.

    Raises:
        ConfigError: a value is out of range (the message names the field).
    """
    flat = {name: values[name] for name in SETTING if name in values}
    flat["api_key"] = api_key
    # None: from the environment (trust_env), unless the config= said "no proxy"
    flat["proxy"] = values.get("proxy") or (None if extras.no_proxy else NOT_GIVEN)
    if isinstance(flat.get("base_url"), list):
        flat["base_url"] = tuple(flat["base_url"])
    core = {"retry": extras.retry, "max_response_bytes": extras.max_response_bytes}
    return config_from({**core, **flat})  # the flat retry settings apply to extras.retry


def extras_of(config: EmbeddingConfig) -> Extras:
    """The parts of ``config`` that no flat field holds."""
    return Extras(config.retry, config.max_response_bytes, config.proxy is None)


# --------------------------------------------------------------------------- headers and body


def _headers_in(value: object) -> RequestHeaders | None:
    return request_headers(value)


def _body_in(value: object) -> RequestBody | None:
    return request_body(value)


def _headers_out(value: RequestHeaders | None) -> dict[str, str] | None:
    return None if value is None else value.masked()


def _body_out(value: RequestBody | None) -> dict[str, Any] | None:
    return None if value is None else value.masked()


def coerce(name: str, value: Any) -> Any:
    """``value`` of field ``name`` as stored: a ``str`` ``api_key`` as ``SecretStr``
    (``""`` as ``None``), ``headers`` as ``RequestHeaders`` and ``extra_body`` as
    ``RequestBody`` (for assignment and ``model_copy(update=...)``, which skip
    validation), anything else unchanged.

    Raises:
        ConfigError: an invalid ``headers`` or ``extra_body``.
    """
    if name == "api_key":  # kept masked in repr and dumps
        return wrap_key(value)
    if name == "headers":
        return request_headers(value)
    if name == "extra_body":
        return request_body(value)
    if name == "proxy":
        return mask_proxy(value)
    return value


HeadersField = Annotated[
    Mapping[str, str] | None,
    PlainValidator(_headers_in, json_schema_input_type=dict[str, str] | None),
    PlainSerializer(_headers_out),
]
"""An adapter's ``headers`` field: stored as the core ``RequestHeaders`` (secret values
masked in ``repr`` and dumps, never pickled)."""

ExtraBodyField = Annotated[
    Mapping[str, Any] | None,
    PlainValidator(_body_in, json_schema_input_type=dict[str, Any] | None),
    PlainSerializer(_body_out),
]
"""An adapter's ``extra_body`` field: stored as the core ``RequestBody`` (values of
credential-like fields masked in ``repr`` and dumps, never pickled)."""


# --------------------------------------------------------------------------- the shared fields


class Clients(NamedTuple):
    """The effective config of one set of field values, and its core clients (built on
    first use)."""

    fingerprint: tuple[Any, ...]
    config: EmbeddingConfig
    sync: EmbeddingClient | None
    async_: AsyncEmbeddingClient | None


class ClientCache:
    """An adapter's ``Clients`` (a cache of its fields) and the ``Extras`` of the
    ``config=`` it was given (state).

    Compares equal to any cache with the same extras, so two adapters with equal fields
    are equal. A copy or a pickle holds the extras only: the copy or the unpickled
    instance builds its config and clients again on first use, on the pool of the
    process it is in (clients and pools are never pickled).
    """

    __slots__ = ("current", "extras", "per_call")

    def __init__(self, extras: Extras = NO_EXTRAS) -> None:
        self.extras = extras
        self.current: Clients | None = None
        self.per_call: Clients | None = None  # the last call's own settings, if any

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClientCache) and other.extras == self.extras

    def __hash__(self) -> int:
        return hash(self.extras)

    def __reduce__(self) -> tuple[type[ClientCache], tuple[Extras]]:
        return (ClientCache, (self.extras,))

    def __copy__(self) -> ClientCache:
        return ClientCache(self.extras)

    def __deepcopy__(self, memo: dict[int, Any]) -> ClientCache:
        return ClientCache(self.extras)


class FlatSettings(BaseModel):
    """The flat settings both framework adapters take, declared once, and their core
    client: the mixin of ``QwenPooledEmbeddings`` and ``QwenPooledEmbedding``.

    The fields map onto the core ``EmbeddingConfig`` (``config`` is the effective one).
    ``config=EmbeddingConfig(...)`` is accepted next to them: the fields not given take
    its values (not the environment's), and a field given too overrides the config's
    value, as ``EmbeddingConfig.replace`` would. Its parts with no field
    (``max_response_bytes``, the retry backoff and circuit breaker settings, an explicit
    ``proxy=None``) are kept by copies and pickles, not by ``model_dump()`` /
    ``to_dict()``.

    The core clients are built from the fields on first use and rebuilt after a field
    changed; assigning a field checks the new settings at once (rolled back and raised
    if invalid). Pickles hold the fields (not one that cannot be pickled, which takes
    its default), never the API key, the clients or a pool; the unpickled instance
    reads ``QWEN_EMBED_API_KEY`` from its own environment (see each adapter).

    Adapters set ``_model_field`` / ``_batch_field`` (their names for ``model`` /
    ``batch_size``), declare ``api_key``, and set ``_key_from_env``.
    """

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        # A validation error must not echo the inputs: they may hold the API key.
        hide_input_in_errors=True,
    )

    _model_field: ClassVar[str]
    _batch_field: ClassVar[str]
    _stock: ClassVar[Stock]
    """The stock adapter's parameter names (aliases, refused names)."""
    _key_from_env: ClassVar[Literal["always", "if_it_had_one"]]
    """An unpickled instance reads ``QWEN_EMBED_API_KEY``: always, or only if the
    pickled one had a key."""

    # The declared settings (``_settings.SETTINGS``: default, environment variable and
    # description come from there through ``setting``), all but the three each adapter
    # declares its own way (``api_key``, ``model``, ``batch_size``). Written out so that
    # type checkers see them (pydantic's ``dataclass_transform`` signature);
    # tests/test_settings.py checks they are exactly the declared ones, with their types.

    # ------------------------------------------------------------------ endpoint

    base_url: str | list[str] | None = setting("base_url")

    # ------------------------------------------------------------------ embedding

    dimensions: int | None = setting("dimensions")
    query_instruction: str | None = setting("query_instruction")
    max_batch_tokens: int | None = setting("max_batch_tokens")
    max_concurrency: Annotated[int, WrapValidator(_to_core_if_removed)] = setting("max_concurrency")
    encoding_format: EncodingFormat = setting("encoding_format")
    normalize: bool = setting("normalize")
    max_text_chars: int | None = setting("max_text_chars")
    append_eos: bool | None = setting("append_eos")

    # ------------------------------------------------------------------ timeouts and retries

    connect_timeout: float | None = setting("connect_timeout")
    read_timeout: float | None = setting("read_timeout")
    write_timeout: float | None = setting("write_timeout")
    pool_timeout: float | None = setting("pool_timeout")
    total_timeout: float | None = setting("total_timeout")
    max_retries: int | None = setting("max_retries")
    deadline: float | None = setting("deadline")
    query_deadline: float | None = setting("query_deadline")

    # ------------------------------------------------------------------ pool

    max_connections: int = setting("max_connections")
    max_keepalive_connections: int | None = setting("max_keepalive_connections")
    keepalive_expiry: float = setting("keepalive_expiry")
    max_connections_per_process: int | None = setting("max_connections_per_process")

    # ------------------------------------------------------------------ transport

    http2: bool = setting("http2")
    verify: bool | str = setting("verify")
    proxy: ProxySetting = setting("proxy")
    trust_env: bool = setting("trust_env")
    insecure_key: Literal["warn", "error", "allow"] = setting("insecure_key")
    hedge: bool = setting("hedge")
    server: str = setting("server")

    # ------------------------------------------------------------------ per request

    headers: HeadersField = setting("headers")
    extra_body: ExtraBodyField = setting("extra_body")

    _cache: ClientCache = PrivateAttr(default_factory=ClientCache)

    # ------------------------------------------------------------------ config=

    @model_validator(mode="wrap")
    @classmethod
    def _keep_config_extras(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        """Keep the parts of a ``config=`` that no field holds. (The adapter's own
        ``mode="before"`` validator, which pydantic runs inside this one, spreads the
        rest over the fields with ``resolve_names``.)"""
        given = data.get("config") if isinstance(data, dict) else None
        model = handler(data)
        if isinstance(given, EmbeddingConfig):
            model._cache = ClientCache(extras_of(given))
        return model

    # ------------------------------------------------------------------ the core config

    @classmethod
    def _config_names(cls) -> tuple[str, ...]:
        """The fields the core config is built from."""
        return (*_SHARED_FIELDS, "api_key", cls._model_field, cls._batch_field)

    def _fingerprint(self) -> tuple[Any, ...]:
        fields = self.__dict__
        return tuple(fields.get(name) for name in self._config_names())

    def _key(self) -> str | KeyFunction | None:
        key = self.__dict__.get("api_key")
        if isinstance(key, SecretStr):
            key = key.get_secret_value()
        return key or None

    def _build_config(self) -> EmbeddingConfig:
        values = dict(self.__dict__)
        values["model"] = values[self._model_field]
        values["batch_size"] = values[self._batch_field]
        return build_config(values, api_key=self._key(), extras=self._cache.extras)

    def _refresh(self) -> Clients:
        """Build (so check) the core config of the current fields and cache it; record
        the resolved base URL and model in the fields, so that dumps are
        self-contained.

        Raises:
            ConfigError: a field holds an invalid value.
        """
        config = self._build_config()
        # an adapter serves async calls too: load their HTTP library now, not on the
        # event loop inside the first one (nor inside the first sync call, which builds
        # the async client with the sync one)
        load_async_library()
        prepare_tls(config)  # the first request's TLS set-up, in the background
        # __dict__ directly: no __setattr__ (it would refresh again)
        base = config.base_url
        self.__dict__["base_url"] = list(base) if isinstance(base, tuple) else base
        self.__dict__[self._model_field] = config.model
        current = self._cache.current = Clients(self._fingerprint(), config, None, None)
        return current

    def _clients(self) -> Clients:
        """The config and both core clients for the current field values.

        Rebuilt when a field changed by a path that skips ``__setattr__``
        (``model_copy(update=...)``, ``model_construct``) and after copying or
        unpickling; clients are cheap handles on the shared pool.
        """
        current = self._cache.current
        if current is None or current.fingerprint != self._fingerprint():
            current = self._refresh()
        if current.sync is None or current.async_ is None:
            current = self._cache.current = current._replace(
                sync=EmbeddingClient(current.config),
                async_=AsyncEmbeddingClient(current.config),
            )
        return current

    def _clients_with(self, settings: Mapping[str, Any]) -> Clients:
        """The clients of the effective config with ``settings`` (``EmbeddingConfig``
        fields and flat names) applied, for one call; the last such set is kept for the
        next call with the same settings. Without settings, ``_clients()``.

        Raises:
            ConfigError: an unknown name, a value out of range.
        """
        if not settings:
            return self._clients()
        config = config_from(settings, base=self.config, owner=type(self).__name__)
        last = self._cache.per_call
        if last is not None and last.config == config:
            return last
        built = Clients((), config, EmbeddingClient(config), AsyncEmbeddingClient(config))
        self._cache.per_call = built
        return built

    @property
    def config(self) -> EmbeddingConfig:
        """The effective core ``EmbeddingConfig`` (frozen; its ``pool_key`` selects the
        shared pool): the fields, and the parts of a ``config=`` no field holds.

        Raises:
            ConfigError: a field changed by a path that skips assignment
                (``model_copy(update=...)``, ``model_construct``) holds an invalid value.
        """
        current = self._cache.current
        if current is None or current.fingerprint != self._fingerprint():
            current = self._refresh()
        return current.config

    def __setattr__(self, name: str, value: Any) -> None:
        """Assigning a field checks the new settings at once (rolled back if invalid), as
        the constructor does, instead of failing on the next call; a stock adapter's name
        sets its field (``embeddings.chunk_size = 64``)."""
        if not (
            name.startswith("_") or name in type(self).model_fields or hasattr(type(self), name)
        ):
            # a stock alias (renamed), a harmless stock value (nothing to do), or a name
            # refused with a hint, as by the constructor
            renamed = self._renamed({name: value})
            if len(renamed) != 1:  # none (a harmless value) or several (timeout=)
                for field, field_value in renamed.items():
                    setattr(self, field, field_value)
                return
            ((name, value),) = renamed.items()
        if name not in self._config_names():
            super().__setattr__(name, value)
            return
        value = coerce(name, value)
        old = getattr(self, name)
        super().__setattr__(name, value)
        try:
            self._refresh()
        except Exception:
            super().__setattr__(name, old)
            raise

    # ------------------------------------------------------------------ copying

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """Pydantic's ``model_copy``, with the stock adapter's names in ``update``
        renamed to their fields, ``api_key`` / ``headers`` / ``extra_body`` stored as the
        masked, validated types (``update`` skips validation); the copy has its own
        client cache.

        Raises:
            ConfigError: an unknown name in ``update`` ("did you mean ..."), an alias
                given with its field, ``config`` (give it to the constructor), an invalid
                ``headers`` or ``extra_body``.
        """
        if update:
            renamed = self._renamed(update)
            update = {name: coerce(name, value) for name, value in renamed.items()}
        return super().model_copy(update=update, deep=deep)

    @classmethod
    def _renamed(cls, update: Mapping[str, Any]) -> dict[str, Any]:
        """``update`` (names set after construction) with the stock aliases renamed to
        their fields, as the constructor renames them."""
        if "config" in update:
            raise ConfigError(
                f"{cls.__name__}: config= is taken by the constructor only; pass the "
                "fields to change, or build a new instance with config="
            )
        return resolve_names(cls.__name__, dict(update), cls.model_fields, cls._stock)

    def __copy__(self) -> Self:
        """A shallow copy (also ``model_copy``) with its own client cache."""
        clone = super().__copy__()
        clone._cache = copy.copy(self._cache)
        return clone

    # ------------------------------------------------------------------ pickling

    def __getstate__(self) -> dict[Any, Any]:
        """The fields without the API key and without clients (see the class docstring):
        for a key, only its token in this process (``_keys``), so that a copy unpickled
        here or in a process forked from this one (LlamaIndex's worker processes under
        ``fork``) finds it again.

        A field that cannot be pickled (e.g. a LlamaIndex callback handler holding a
        lock) is left out, with a warning, and takes its default in the copy, as
        LlamaIndex's ``BaseComponent`` does, but without deleting it from this instance.
        """
        owner = type(self).__name__
        fields: dict[str, Any] = {}
        for name, value in self.__dict__.items():
            if name == "api_key":
                continue
            try:
                pickle.dumps(value)
            except Exception:  # any failure means "not picklable"
                _log.warning("%s: not pickling the field %r", owner, name)
                continue
            fields[name] = value
        key = self._key()
        token = None
        if isinstance(key, KeyFunction):
            token = key.token
        elif key is not None:
            token = key_token(key)  # the token of every live copy of this key
        return {"fields": fields, "had_key": key is not None, "key": token, "cache": self._cache}

    def __setstate__(self, state: dict[Any, Any]) -> None:
        """Through ``__init__`` (as LlamaIndex's ``BaseComponent`` does), so the settings
        are checked again. The API key is the original when this process holds it (the
        same process, or forked from it); else ``QWEN_EMBED_API_KEY`` from this
        process's environment; else, if the pickled instance had a key, every request
        raises ``ConfigError`` naming that fix before anything is sent."""
        fields = dict(state["fields"])
        key = restored_key(state.get("key"), bool(state["had_key"]), self._key_from_env == "always")
        fields["api_key"] = key.get_secret_value() if isinstance(key, Secret) else key
        self.__init__(**fields)  # type: ignore[misc]
        self._cache = state["cache"]
        self._refresh()


_SHARED_FIELDS: Final[tuple[str, ...]] = tuple(FlatSettings.model_fields)
