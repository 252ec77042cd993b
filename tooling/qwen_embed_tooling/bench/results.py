"""Mode names and result objects of ``qwen-embed bench``.

Standard library only: the CLI imports this module to build its ``--help`` (the mode
choices) without loading numpy, the HTTP library or the client.

Times are in milliseconds (``*_ms``), rates per second (``*_per_s``), CPU time in
milliseconds per request.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final, Literal

__all__ = [
    "BENCH_SCHEMA",
    "MODES",
    "MODE_LABELS",
    "MODE_SHORT_LABELS",
    "BenchResult",
    "ModeName",
    "ModeResult",
]

BENCH_SCHEMA: Final = "qwen-embed-bench/1"
"""``schema`` field of ``BenchResult.to_dict()``; bumped if a field changes meaning
(fields may be added without a bump)."""

ModeName = Literal[
    "naive", "pooled_threads", "pooled_async", "pooled_async_http2", "pooled_batched"
]
MODES: Final[tuple[ModeName, ...]] = (
    "naive",
    "pooled_threads",
    "pooled_async",
    "pooled_async_http2",
    "pooled_batched",
)
"""Every benchmark mode, in the order they run."""

MODE_LABELS: Final[dict[str, str]] = {
    "naive": "(a) naive: new openai.OpenAI per request",
    "pooled_threads": "(b) pooled sync, shared client, threads",
    "pooled_async": "(c) pooled async",
    "pooled_async_http2": "(d) pooled async, HTTP/2",
    "pooled_batched": "(e) pooled + batched embed_documents",
}
"""What each mode does, as the wide table and ``--json`` (``label``) show it."""

MODE_SHORT_LABELS: Final[dict[str, str]] = {
    "naive": "(a) naive",
    "pooled_threads": "(b) pooled sync",
    "pooled_async": "(c) pooled async",
    "pooled_async_http2": "(d) async HTTP/2",
    "pooled_batched": "(e) batched",
}
"""The narrow table's mode column."""

# The pooled single-text modes the conclusion compares with the naive client, by
# preference: the async client is what web apps (LangChain/LlamaIndex ``aembed_*``) use.
_CONCLUSION_ORDER: Final = ("pooled_async", "pooled_threads", "pooled_async_http2")


@dataclass(frozen=True)
class ModeResult:
    """One mode's measurements (field names are stable: ``--json`` prints them).

    Attributes:
        mode: one of ``MODES``.
        label: a human description.
        skipped: why the mode did not run, else ``None`` (then numbers are zero/None).
        requests: HTTP requests made (calls; each carries ``texts / requests`` texts).
        texts: texts embedded successfully.
        errors: calls that raised.
        seconds: wall time of the mode (s).
        requests_per_s, texts_per_s: successful requests / texts per wall second.
        p50_ms, p95_ms, p99_ms, mean_ms: per-call latency (ms; successful calls,
            including client set-up for the naive mode).
        connections_opened: TCP connections the client opened (counted from connect
            events of the HTTP library).
        connections_server: connections the local server accepted during the mode
            (``None`` for a remote server).
        cpu_ms_per_request: CPU time of the client process per request (ms; all
            threads; the local server and relay run in other processes).
        http_version: the protocol the mode used.
        ratio_vs_naive: ``texts_per_s`` divided by the naive mode's (per text; the
            same as per request for the one-text modes).
        error_sample: the first error message, if any.
    """

    mode: str
    label: str
    skipped: str | None = None
    requests: int = 0
    texts: int = 0
    errors: int = 0
    seconds: float = 0.0
    requests_per_s: float = 0.0
    texts_per_s: float = 0.0
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    mean_ms: float | None = None
    connections_opened: int | None = None
    connections_server: int | None = None
    cpu_ms_per_request: float | None = None
    http_version: str | None = None
    ratio_vs_naive: float | None = None
    error_sample: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class BenchResult:
    """A whole ``run_bench`` run (see ``to_dict`` for the JSON shape)."""

    base_url: str
    local_server: bool
    tls: bool
    rtt_ms: float | None
    requests: int
    concurrency: int
    batch_size: int
    pool_max_connections: int
    naive_trust: str
    model: str
    dim: int | None
    texts_source: str
    http_library: str
    openai_version: str
    python: str
    modes: list[ModeResult]

    def mode(self, name: str) -> ModeResult:
        """The result of mode ``name``.

        Raises:
            KeyError: no such mode in this run.
        """
        for m in self.modes:
            if m.mode == name:
                return m
        raise KeyError(name)

    def _ran(self, name: str) -> ModeResult | None:
        for m in self.modes:
            if m.mode == name and m.skipped is None and m.requests_per_s > 0:
                return m
        return None

    def conclusion(self) -> str:
        """One line: the pooled client's requests/s against the naive client's, as
        measured in this run, and the connections each opened; in the form ``pooled async:
        <ratio>x the naive client's req/s (<pooled> vs <naive>), <n> vs <m> connections``."""
        naive = self._ran("naive")
        pooled = next((m for m in map(self._ran, _CONCLUSION_ORDER) if m is not None), None)
        if pooled is None:
            return "no pooled single-text mode ran: nothing to compare"
        name = MODE_SHORT_LABELS[pooled.mode].split(" ", 1)[1]
        if naive is None:
            return (
                f"{name}: {_rate(pooled.requests_per_s)} req/s; the naive client did not "
                "run (add --mode naive to compare)"
            )
        ratio = pooled.requests_per_s / naive.requests_per_s
        line = (
            f"{name}: {ratio:.1f}x the naive client's req/s "
            f"({_rate(pooled.requests_per_s)} vs {_rate(naive.requests_per_s)})"
        )
        if pooled.connections_opened is not None and naive.connections_opened is not None:
            line += f", {pooled.connections_opened} vs {naive.connections_opened} connections"
        return line

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: ``schema``, every field (``modes`` a list of dicts) and
        ``conclusion`` (the one-line summary)."""
        out: dict[str, Any] = {"schema": BENCH_SCHEMA}
        out.update(asdict(self))
        out["conclusion"] = self.conclusion()
        return out


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 else f"{value:.1f}"
