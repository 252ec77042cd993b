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

__all__ = [
    "check_url_port",
    "environment_proxy",
    "insecure_key_target",
    "is_loopback",
    "normalise_base_url",
]

ENV_BASE_URL: Final = SETTING["base_url"].env

PORT_RANGE: Final = (1, 65535)
"""The ports a URL may name (0 is not a port a client can connect to)."""


def _port_text(netloc: str) -> str | None:
    """The port of ``netloc`` exactly as written (``None``: no ``:`` after the host;
    ``""``: a ``:`` with nothing after it). User info is ignored; an IPv6 literal's
    colons are inside its brackets."""
    hostport = netloc.rpartition("@")[2]
    if hostport.startswith("["):
        after = hostport.partition("]")[2]
        return after[1:] if after.startswith(":") else None
    if ":" not in hostport:
        return None
    return hostport.partition(":")[2]


def check_url_port(url: str, setting: str) -> None:
    """Refuse ``url`` unless the port it names (if any) is written as plain digits,
    without leading zeros, in 1..65535: a backend would otherwise refuse it with a bare
    ``ValueError``, drop it, or connect to the scheme's default port (80 for
    ``http://host:0``), sending the key there.

    Raises:
        ConfigError: naming ``setting``, the URL (no credentials) and the port as written.
    """
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ConfigError(f"{setting} is not a valid URL: {endpoint_label(url)}") from exc
    port = _port_text(parts.netloc)
    if port is None:
        return
    low, high = PORT_RANGE
    if (
        not (port.isascii() and port.isdigit())
        or port.startswith("0")
        or not low <= int(port) <= high
    ):
        shown = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"  # as written
        raise ConfigError(
            f"{setting}: the port of {shown!r} must be a number from {low} to "
            f"{high} written in plain digits (no sign, spaces or leading zeros), got {port!r}"
        )


def _normalise_one_url(value: object, setting: str = "base_url") -> str:
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
        raise ConfigError(f"{setting} is not a valid URL: {endpoint_label(url)}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"{setting} must be an http:// or https:// URL with a host, got {endpoint_label(url)!r}"
        )
    check_url_port(url, setting)
    if parts.username or parts.password:
        raise ConfigError(
            f"{setting} must not contain credentials (user:password@); pass api_key instead"
        )
    if parts.query or parts.fragment:
        raise ConfigError(f"{setting} must not contain a query string or fragment")
    if url.endswith("/embeddings"):
        url = url[: -len("/embeddings")]
    return url


def normalise_base_url(value: object) -> str | tuple[str, ...]:
    """One URL, or the sorted, de-duplicated tuple of several replica URLs."""
    if isinstance(value, str) and "," in value:
        value = [part for part in value.split(",") if part.strip()]
    if isinstance(value, list | tuple):
        named = len(value) > 1  # each replica by its index in the list given
        urls = sorted(
            {
                _normalise_one_url(v, f"base_url[{i}]" if named else "base_url")
                for i, v in enumerate(value)
            }
        )
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
    """Whether ``url``'s host is a loopback address: an address in 127.0.0.0/8, ``::1``,
    or the name ``localhost`` itself. No other name is trusted by its spelling: a
    ``*.localhost`` name may resolve anywhere (a hosts file, a resolver), and the
    library does not resolve names here, so it gets the plain-HTTP key warning (and
    ``insecure_key="error"``) and the configured proxy like any other host."""
    host = _host(url).removesuffix(".")
    if host == "localhost":
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
    them; ``None`` for none. Loopback hosts are never proxied.

    Raises:
        ConfigError: the environment's proxy URL names a port outside 1..65535.
    """
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
    check_url_port(proxy, f"proxy (from the environment's {scheme.upper()}_PROXY or ALL_PROXY)")
    return proxy
