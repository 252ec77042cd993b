"""What ``check_server`` returns: a ``CheckReport`` of ``CheckFinding``s (one per probe)
and the ``ServerIdentity`` it detected; ``to_dict()`` is the ``--json`` shape
(``CHECK_SCHEMA``); ``library_notes`` collects the library's WARNING lines into its
``notes``. Plain data: the probes are in ``_check``, the table in ``_output``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Final, Literal

__all__ = [
    "CHECK_SCHEMA",
    "CheckFinding",
    "CheckReport",
    "ServerIdentity",
    "library_notes",
]

CHECK_SCHEMA: Final = "qwen-embed-check/1"
"""``schema`` field of ``CheckReport.to_dict()`` (fields may be added without a bump)."""


@dataclass(frozen=True)
class CheckFinding:
    """One probe's outcome.

    Attributes:
        name: ``health``, ``models``, ``embedding``, ``base64``, ``dimensions``,
            ``batch_limit``, ``http2``, ``keepalive``, ``latency``, ``truncation``,
            ``eos`` (llama.cpp).
        status: ``"ok"``, ``"warn"`` (works, but needs a setting), ``"fail"`` or
            ``"info"``.
        summary: one line for people.
        value: the measured value (JSON-ready), e.g. the dimension or timeout seconds.
        advice: what to do about it, or ``None``.
    """

    name: str
    status: Literal["ok", "warn", "fail", "info"]
    summary: str
    value: Any = None
    advice: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class ServerIdentity:
    """Which server software answers, as the client detected it.

    Attributes:
        name: the ``server=`` name (``sglang``, ``vllm``, ``tei``, ``infinity``,
            ``ollama``, ``llamacpp``, ``dashscope``, ``siliconflow``; ``openai``: not
            recognised).
        title: human name, e.g. ``"Text Embeddings Inference"``.
        source: the evidence, e.g. ``"GET /models: owned_by 'vllm'"``.
    """

    name: str
    title: str
    source: str

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class CheckReport:
    """``check_server``'s findings (``to_dict()`` is the ``--json`` shape).

    Attributes:
        base_url: the endpoint's label (the URL without credentials).
        model: the model probed.
        findings: one per probe, in the order they ran.
        server: the server software detected, or ``None``.
        notes: the library's WARNING log lines during the check (e.g. a truncated
            input, a fallback the client learned), each once, in order.
    """

    base_url: str
    model: str | None
    findings: list[CheckFinding]
    server: ServerIdentity | None = None
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """No finding failed."""
        return all(f.status != "fail" for f in self.findings)

    def finding(self, name: str) -> CheckFinding:
        """The finding called ``name``.

        Raises:
            KeyError: no such finding.
        """
        for f in self.findings:
            if f.name == name:
                return f
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """``schema``, ``base_url``, ``model``, ``server`` (``None`` when not
        identified), ``ok``, ``findings`` (a list of dicts) and ``notes`` (a list of
        strings)."""
        return {
            "schema": CHECK_SCHEMA,
            "base_url": self.base_url,
            "model": self.model,
            "server": None if self.server is None else self.server.to_dict(),
            "ok": self.ok,
            "findings": [f.to_dict() for f in self.findings],
            "notes": list(self.notes),
        }


class _Notes(logging.Handler):
    """Collects the messages of the library's WARNING records, each once."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = record.getMessage()
        except Exception:
            self.handleError(record)
            return
        if line not in self.lines:
            self.lines.append(line)


@contextmanager
def library_notes() -> Iterator[list[str]]:
    """The library's WARNING messages while the block runs (the list fills as they come)."""
    logger = logging.getLogger("qwen_embed_plugins")
    handler = _Notes()
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
