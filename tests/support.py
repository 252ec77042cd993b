"""Helpers shared by test modules (importable by name, unlike ``conftest``: several
conftest modules exist below tests/)."""

from __future__ import annotations


def forget_learned(base_url: str) -> None:
    """Forget what this process learned about the server at ``base_url`` (batch and token
    limits, dialect, base64; its health is reset before every test by
    ``_fresh_replica_health``). A new server can get the port of an earlier test's
    server, whose learned limits would otherwise apply to it."""
    from qwen_embed_plugins import balance

    for replica in list(balance._replicas.values()):
        if replica.url == base_url:
            with replica._lock:
                replica.states.clear()
                replica.last_error = None
