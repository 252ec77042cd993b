"""``qwen-embed bench``'s table fits 100 columns with every figure visible, and ends with
a one-line conclusion stating the pooled-vs-naive ratio it measured."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator

import orjson
import pytest
from cli_support import run
from rich.console import Console

from qwen_embed_plugins.cli._output import fmt
from qwen_embed_tooling.bench.results import MODE_SHORT_LABELS, MODES, BenchResult, ModeResult
from qwen_embed_tooling.bench.run import Target, run_bench
from qwen_embed_tooling.cli._output import bench_renderables, fmt_int
from qwen_embed_tooling.testing import EmbeddingServer


@pytest.fixture(scope="module")
def measured() -> Iterator[BenchResult]:
    """A real run of every mode against a loopback server (a few errors included)."""
    with EmbeddingServer(keep_alive_timeout=2.0) as srv:
        srv.inject_status(400, message="refused on purpose", count=1)
        yield run_bench(
            Target(srv.base_url, model=srv.model), requests=12, concurrency=3, warmup=False
        )


def render(result: BenchResult, width: int = 100, *, wide: bool = False) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, highlight=False)
    for item in bench_renderables(result, wide=wide):
        console.print(item)
    return buf.getvalue()


def figures(m: ModeResult) -> list[str]:
    """What the narrow table must show for a mode, as it formats them."""
    return [
        fmt(m.requests_per_s),
        fmt(m.texts_per_s),
        fmt(m.p50_ms),
        fmt(m.p99_ms),
        fmt_int(m.connections_opened),
        fmt(m.cpu_ms_per_request, 2),
        str(m.errors),
        "-" if m.ratio_vs_naive is None else f"{m.ratio_vs_naive:.1f}x",
    ]


def assert_fits(text: str, result: BenchResult, width: int = 100) -> None:
    lines = text.splitlines()
    assert max(map(len, lines)) <= width
    assert "…" not in text  # rich's ellipsis: a cut figure
    for m in result.modes:
        if m.skipped:
            continue
        key = MODE_SHORT_LABELS[m.mode].split()[0]  # "(a)" .. "(e)"
        row = next(line for line in lines if line.lstrip().startswith(key))
        cells = row.split()
        for figure in figures(m):
            assert figure in cells, (m.mode, figure, row)


def test_table_fits_100_columns_with_every_figure(measured: BenchResult) -> None:
    assert [m.mode for m in measured.modes] == list(MODES)
    assert sum(m.errors for m in measured.modes) == 1  # the errors column is shown
    text = render(measured)
    assert_fits(text, measured)
    assert "errors" in text
    # uvicorn offers no h2c: the HTTP/2 mode says why it did not run
    assert "skipped: the server does not offer HTTP/2" in text


def test_the_last_line_is_the_measured_conclusion(measured: BenchResult) -> None:
    last = render(measured).rstrip().splitlines()[-1]
    naive, pooled = measured.mode("naive"), measured.mode("pooled_async")
    ratio = pooled.requests_per_s / naive.requests_per_s

    def rate(value: float) -> str:  # whole numbers from 10 up
        return f"{value:,.0f}" if value >= 10 else f"{value:.1f}"

    assert last == (
        f"pooled async: {ratio:.1f}x the naive client's req/s "
        f"({rate(pooled.requests_per_s)} vs {rate(naive.requests_per_s)}), "
        f"{pooled.connections_opened} vs {naive.connections_opened} connections"
    )
    assert measured.to_dict()["conclusion"] == last


def test_worst_case_figures_still_fit() -> None:
    big = ModeResult(
        mode="pooled_batched",
        label="x",
        requests=99_999,
        texts=9_999_999,
        errors=99_999,
        requests_per_s=99_999.9,
        texts_per_s=9_999_999.0,
        p50_ms=99_999.0,
        p95_ms=99_999.0,
        p99_ms=99_999.0,
        connections_opened=99_999,
        cpu_ms_per_request=999.99,
        ratio_vs_naive=9_999.99,
    )
    modes = [ModeResult(**{**big.to_dict(), "mode": name, "label": name}) for name in MODES]
    result = BenchResult(
        base_url="https://a-rather-long-host-name.example.internal:30000/v1",
        local_server=False,
        tls=True,
        rtt_ms=None,
        requests=99_999,
        concurrency=1024,
        batch_size=2048,
        pool_max_connections=1024,
        naive_trust="default",
        model="Qwen/Qwen3-Embedding-8B",
        dim=4096,
        texts_source="x",
        http_library="httpx2",
        openai_version="3",
        python="3.11",
        modes=modes,
    )
    assert_fits(render(result), result)


def test_wide_shows_every_field(measured: BenchResult) -> None:
    text = render(measured, width=200, wide=True)
    for name in ("p95 ms", "mean ms", "errors", "HTTP", "(a) naive: new openai.OpenAI per request"):
        assert name in text
    assert max(map(len, text.splitlines())) <= 200


def test_cli_table_and_json_end_with_the_conclusion(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    with EmbeddingServer() as srv:
        args = ["bench", "--base-url", srv.base_url, "--requests", "6", "--concurrency", "2"]
        args += ["--mode", "naive", "--mode", "pooled_threads"]
        table = run(*args)
        data = orjson.loads(run(*args, "--json").stdout)
    assert table.exit_code == 0, table.output
    lines = table.stdout.rstrip().splitlines()
    assert max(map(len, lines)) <= 100
    assert re.fullmatch(
        r"pooled sync: \d+\.\dx the naive client's req/s \([\d,.]+ vs [\d,.]+\), "
        r"\d+ vs 6 connections",
        lines[-1],
    ), lines[-1]
    assert re.fullmatch(r"pooled sync: \d+\.\dx .*, \d+ vs 6 connections", data["conclusion"]), (
        data["conclusion"]
    )
    only_pooled = run("bench", "--base-url", "http://127.0.0.1:9/v1", "--help")
    assert "--wide" in only_pooled.stdout
