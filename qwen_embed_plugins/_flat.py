"""The flat settings (``_settings.SETTINGS``) to and from an ``EmbeddingConfig``.

The core clients (``EmbeddingClient(max_retries=2, read_timeout=30)``), Ray's
``embed_dataset`` and both framework adapters take the same flat names; this module is
where they become (``config_from``) and come back from (``flat_value``) the core
config, by each setting's declared place in it (``Setting.into``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from ._config import EmbeddingConfig
from ._settings import SETTING, closest
from .errors import ConfigError

__all__ = ["CONFIG_FIELDS", "check_names", "config_from", "flat_value"]

CONFIG_FIELDS: Final = frozenset(field.name for field in dataclasses.fields(EmbeddingConfig))
"""``EmbeddingConfig``'s own fields: the core clients take them next to the flat names."""


def _retries(retries: Any) -> int | None:
    """``max_retries`` checked under its flat name (``RetryConfig.max_retries``)."""
    if retries is None:
        return None
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 99:
        raise ConfigError(f"max_retries must be an integer in [0, 99], got {retries!r}")
    return retries


# A flat setting checked or converted on its way (to, from) the core.
_CONVERT: Final[dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]]] = {
    "max_retries": (_retries, lambda retries: retries),
}


def check_names(owner: str, names: Iterable[str], known: Iterable[str]) -> None:
    """Refuse a name that is not in ``known``, naming the closest accepted one.

    Raises:
        ConfigError: ``"{owner}: unknown parameter 'api_base'; did you mean 'base_url'?"``
    """
    accepted = set(known)
    for name in names:
        if name in accepted:
            continue
        match = closest(name, accepted)
        hint = f"; did you mean {match!r}?" if match else " (docs/api.md lists the settings)"
        raise ConfigError(f"{owner}: unknown parameter {name!r}{hint}")


def config_from(
    settings: Mapping[str, Any],
    *,
    base: EmbeddingConfig | None = None,
    owner: str = "EmbeddingConfig",
) -> EmbeddingConfig:
    """The ``EmbeddingConfig`` of ``settings``: ``EmbeddingConfig`` fields and flat
    names (``read_timeout``, ``max_retries``, ``max_connections``, ...) alike, applied to
    ``base`` (as ``base.replace``) or to a new config (settings not given: from the
    environment, else their defaults). A flat name sets its attribute of the part given
    with it (``timeout=Timeouts(...), read_timeout=5`` changes the read timeout only).

    Raises:
        ConfigError: an unknown name (naming the closest accepted one), or a value out of
            range (naming the setting).
    """
    check_names(owner, settings, CONFIG_FIELDS | set(SETTING))
    top = {name: value for name, value in settings.items() if name in CONFIG_FIELDS}
    parts: dict[str, dict[str, Any]] = {}
    for name, value in settings.items():
        setting = SETTING.get(name)
        if setting is None or setting.part is None:
            continue
        to_core = _CONVERT[name][0] if name in _CONVERT else None
        parts.setdefault(setting.part, {})[setting.attribute] = to_core(value) if to_core else value
    config = base.replace(**top) if base is not None else EmbeddingConfig(**top)
    if not parts:
        return config
    return config.replace(
        **{part: getattr(config, part).replace(**changes) for part, changes in parts.items()}
    )


def flat_value(config: EmbeddingConfig, name: str) -> Any:
    """Flat setting ``name`` as ``config`` holds it (the inverse of ``config_from``)."""
    setting = SETTING[name]
    holder = getattr(config, setting.part) if setting.part else config
    value = getattr(holder, setting.attribute)
    return _CONVERT[name][1](value) if name in _CONVERT else value
