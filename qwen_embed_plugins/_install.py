"""The install lines printed when an optional part is missing (no release on PyPI yet)."""

from __future__ import annotations

from importlib import metadata

__all__ = ["install_command"]

_CHECKOUT_URL = "file:///path/to/qwen-embed-plugins"


def install_command(extra: str) -> str:
    """The pip command that adds ``extra`` to this installation (``"tooling"``: the
    ``qwen-embed-tooling`` distribution in the checkout's ``tooling/`` folder). There is
    no release on PyPI: it installs from where this copy came from, as pip recorded it
    (PEP 610 ``direct_url.json``: ``pip install -e "/checkout[extra]"`` for an editable
    install, ``pip install "qwen-embed-plugins[extra] @ URL"`` otherwise), else from a
    checkout whose path the user fills in."""
    import json
    from urllib.parse import unquote, urlsplit

    try:
        recorded = metadata.distribution("qwen-embed-plugins").read_text("direct_url.json")
        origin = json.loads(recorded or "null")
    except (metadata.PackageNotFoundError, ValueError):
        origin = None
    url = origin.get("url") if isinstance(origin, dict) else None
    tooling = extra == "tooling"
    name, suffix = ("qwen-embed-tooling", "") if tooling else ("qwen-embed-plugins", f"[{extra}]")
    if isinstance(url, str) and isinstance(origin, dict):
        vcs = origin.get("vcs_info")
        if isinstance(vcs, dict) and vcs.get("vcs"):
            where = f"{vcs['vcs']}+{url}" + ("#subdirectory=tooling" if tooling else "")
            return f'pip install "{name}{suffix} @ {where}"'
        url = url.rstrip("/") + ("/tooling" if tooling else "")
        editable = isinstance(origin.get("dir_info"), dict) and origin["dir_info"].get("editable")
        if editable and url.startswith("file://"):
            return f'pip install -e "{unquote(urlsplit(url).path)}{suffix}"'
        return f'pip install "{name}{suffix} @ {url}"'
    where = _CHECKOUT_URL + ("/tooling" if tooling else "")
    return (
        f'pip install "{name}{suffix} @ {where}" (a checkout of this repository; there is '
        "no release on PyPI yet)"
    )
