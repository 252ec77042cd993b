"""Endpoint URLs: a base URL (or replica list) normalised and checked, and the network
facts the config and the engine ask of a URL (loopback, clear-text key, the
environment's proxy)."""

from __future__ import annotations

import ipaddress
import urllib.request
from typing import Final
from urllib.parse import urlsplit

from ._server_text import endpoint_label
from ._settings import SETTING
from .errors import ConfigError

__all__ = ["environment_proxy", "insecure_key_target", "is_loopback", "normalise_base_url"]

ENV_BASE_URL: Final = SETTING["base_url"].env


def _normalise_one_url(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            "base_url is required: pass base_url='http://host:port/v1' (or a list of "
            f"replica URLs) or set {ENV_BASE_URL}; there is deliberately no default endpoint"
        )
    url = value.strip().rstrip("/")
    if ";" in url or any(c.isspace() for c in url):
        # "http://a:1/v1;http://b:2/v1" parses as one URL whose path holds the other
        raise ConfigError(
            f"base_url (or {ENV_BASE_URL}) holds ';' or whitespace, which a base URL may not "
            "contain here; separate replica URLs with a comma "
            "('http://a:8000/v1,http://b:8000/v1') or pass a list"
        )
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ConfigError(f"base_url is not a valid URL: {endpoint_label(url)}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"base_url must be an http:// or https:// URL with a host, got {endpoint_label(url)!r}"
        )
    if parts.username or parts.password:
        raise ConfigError(
            "base_url must not contain credentials (user:password@); pass api_key instead"
        )
    if parts.query or parts.fragment:
        raise ConfigError("base_url must not contain a query string or fragment")
    if url.endswith("/embeddings"):
        url = url[: -len("/embeddings")]
    return url


def normalise_base_url(value: object) -> str | tuple[str, ...]:
    """One URL, or the sorted, de-duplicated tuple of several replica URLs."""
    if isinstance(value, str) and "," in value:
        value = [part for part in value.split(",") if part.strip()]
    if isinstance(value, list | tuple):
        urls = sorted({_normalise_one_url(v) for v in value})
        if not urls:
            raise ConfigError("base_url: the list of replica URLs is empty")
        return urls[0] if len(urls) == 1 else tuple(urls)
    return _normalise_one_url(value)


def _host(url: str) -> str:
    try:
        return (urlsplit(url).hostname or "").lower()
    except ValueError:
        return ""


def is_loopback(url: str) -> bool:
    """Whether ``url``'s host is a loopback address (``localhost``, 127.0.0.0/8, ::1)."""
    host = _host(url)
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def insecure_key_target(url: str) -> bool:
    """Whether a key sent to ``url`` would cross a network in clear text (``http://`` to
    a host that is not loopback)."""
    return url.startswith("http://") and not is_loopback(url)


def environment_proxy(url: str) -> str | None:
    """The proxy the environment gives for ``url`` (``HTTP_PROXY``, ``HTTPS_PROXY``,
    ``ALL_PROXY``, lower-case too; ``NO_PROXY`` honoured), as httpx and requests read
    them; ``None`` for none. Loopback hosts are never proxied."""
    if is_loopback(url):
        return None
    proxies = urllib.request.getproxies_environment()
    scheme = urlsplit(url).scheme
    proxy = proxies.get(scheme) or proxies.get("all")
    if not proxy:
        return None
    parts = urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port is not None:
        netloc = f"{netloc}:{parts.port}"
    if urllib.request.proxy_bypass_environment(netloc, proxies):  # type: ignore[attr-defined]
        return None
    if "://" not in proxy:
        proxy = f"http://{proxy}"
    return proxy
