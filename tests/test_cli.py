"""The ``qwen-embed`` command line, in-process (click's CliRunner), against real servers.

Every subcommand runs against the loopback ``EmbeddingServer``; ``bench`` also with no
URL (it then starts its own server in a child process, with HTTPS and the delaying
relay), as a first run on a fresh machine does.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from click.testing import CliRunner, Result

from qwen_embed_plugins import DEFAULT_QUERY_TASK, _install_command, format_query, reset_metrics
from qwen_embed_plugins._corpus import corpus, iter_texts
from qwen_embed_plugins.cli import get_command, main
from qwen_embed_plugins.cli._app import TOOLING_HINT
from qwen_embed_tooling.bench.relay import Relay
from qwen_embed_tooling.bench.results import MODES
from qwen_embed_tooling.testing import EmbeddingServer, expected_embedding


def run(*args: str) -> Result:
    result = CliRunner().invoke(get_command(), list(args), catch_exceptions=False)
    return result


def as_json(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return orjson.loads(result.stdout)


def bench_url(base_url: str, *modes: str, args: tuple[str, ...] = ()) -> Result:
    """``qwen-embed bench`` against ``base_url``: 8 requests per mode, 2 at a time."""
    chosen = [arg for mode in modes for arg in ("--mode", mode)]
    return run(
        "bench", "--base-url", base_url, "--requests", "8", "--concurrency", "2", *chosen, *args
    )


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddingServer]:
    with EmbeddingServer(keep_alive_timeout=2.0, max_batch=64) as srv:
        yield srv


# --------------------------------------------------------------------------- main


def test_missing_extra_prints_install_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "click", None)  # as if click were not installed
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert _install_command("cli") in err
    assert "[cli]" in err
    assert "click" in err


def test_main_runs_the_group(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name in ("bench", "check", "embed", "serve"):
        assert name in out


def test_bench_and_serve_are_the_tooling_commands_found_by_entry_point() -> None:
    from qwen_embed_tooling.cli import bench, serve

    group = get_command()
    assert group.commands["bench"] is bench
    assert group.commands["serve"] is serve


# A child interpreter without the tooling: "absent" as if no distribution registered the
# entry-point group; "broken" as if it were registered but its modules could not load.
_WITHOUT_TOOLING = """
import sys
import importlib.metadata as md
if {how!r} == "absent":
    every = md.entry_points
    md.entry_points = lambda **kw: md.EntryPoints(
        p for p in every(**kw) if p.group != "qwen_embed.commands"
    )
else:
    sys.modules["qwen_embed_tooling"] = None
from qwen_embed_plugins.cli import main
main({args!r})
"""


@pytest.mark.parametrize("how", ["absent", "broken"])
@pytest.mark.parametrize("command", ["bench", "serve"])
def test_a_tooling_command_without_the_tooling_says_how_to_install_it(
    command: str, how: str
) -> None:
    code = _WITHOUT_TOOLING.format(how=how, args=[command, "--port", "0"])
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 1, proc.stderr
    assert f"qwen-embed {command} comes with the tooling package" in proc.stderr
    assert TOOLING_HINT in proc.stderr
    assert "Traceback" not in proc.stderr
    listing = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TOOLING.format(how=how, args=["--help"])],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert f"{command} " in listing.stdout  # still listed, with its install note
    assert "needs qwen-embed-tooling" in listing.stdout


# --------------------------------------------------------------------------- bench


def test_bench_without_url_starts_local_https_server_with_rtt() -> None:
    requests, concurrency, pool = 6, 3, 4
    result = run(
        "bench",
        "--requests",
        str(requests),
        "--concurrency",
        str(concurrency),
        "--rtt-ms",
        "10",
        "--pool-size",
        str(pool),
        "--batch-size",
        "4",
        "--json",
    )
    data = as_json(result)
    assert data["schema"] == "qwen-embed-bench/1"
    assert data["local_server"] is True
    assert data["tls"] is True
    assert data["rtt_ms"] == 10
    assert data["dim"] == 1024
    modes = {m["mode"]: m for m in data["modes"]}
    assert list(modes) == list(MODES)
    for name, m in modes.items():
        assert m["skipped"] is None, (name, m["skipped"])  # the local server offers h2
        assert m["errors"] == 0, (name, m["error_sample"])
        assert m["requests"] == requests
        # client-side count == what the server accepted: counted, not estimated
        assert m["connections_opened"] == m["connections_server"], name
        assert m["p50_ms"] <= m["p95_ms"] <= m["p99_ms"]
        # every request pays at least the emulated 10 ms round trip
        assert m["p50_ms"] >= 10.0, name
        assert m["requests_per_s"] > 0
        assert m["cpu_ms_per_request"] > 0
        assert m["ratio_vs_naive"] > 0
    naive = modes["naive"]
    assert naive["connections_opened"] >= requests  # one connection per request
    assert naive["texts"] == requests
    assert naive["ratio_vs_naive"] == 1.0
    for name in ("pooled_threads", "pooled_async", "pooled_batched"):
        assert 1 <= modes[name]["connections_opened"] <= min(concurrency, pool), name
    h2 = modes["pooled_async_http2"]
    assert h2["http_version"] == "HTTP/2"
    assert h2["connections_opened"] == 1  # every stream multiplexed on one connection
    assert modes["pooled_batched"]["texts"] == requests * 4
    # a new connection per request (TCP + TLS: two extra emulated round trips)
    assert naive["p50_ms"] >= 30.0


def test_bench_table_against_url(server: EmbeddingServer) -> None:
    result = bench_url(server.base_url, "naive", "pooled_threads", "pooled_async_http2")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "(a) naive" in out
    assert "(b) pooled sync" in out
    assert "x (a)" in out
    assert "1.0x" in out
    # uvicorn speaks no h2c: the HTTP/2 mode says why it did not run
    assert "skipped: the server does not offer HTTP/2" in out


def test_bench_json_counts_connections_for_a_remote_server(server: EmbeddingServer) -> None:
    before = server.connections_opened
    data = as_json(
        bench_url(
            server.base_url,
            "naive",
            "pooled_async",
            args=("--json", "--texts", str(Path(__file__))),
        )
    )
    naive, pooled = data["modes"]
    assert data["local_server"] is False
    assert naive["connections_opened"] == 8
    assert naive["connections_server"] is None
    assert 1 <= pooled["connections_opened"] <= 2
    # the server saw at least what the client counted (plus warm-up and probes)
    assert server.connections_opened - before >= 8 + pooled["connections_opened"]
    assert data["texts_source"].endswith("test_cli.py")


def test_bench_usage_errors() -> None:
    result = run("bench", "--base-url", "http://127.0.0.1:9/v1", "--rtt-ms", "5")
    assert result.exit_code == 2
    assert "local server only" in result.output


def test_bench_unreachable_server_exits_1() -> None:
    port = _free_port()
    result = run("bench", "--base-url", f"http://127.0.0.1:{port}/v1", "--requests", "1")
    assert result.exit_code == 1
    assert "error:" in result.output
    # --json: still one JSON document on stdout, saying what failed (another port: in
    # this process the first one's circuit breaker is open now, as it should be)
    port = _free_port()
    result = run("bench", "--base-url", f"http://127.0.0.1:{port}/v1", "--requests", "1", "--json")
    assert result.exit_code == 1
    data = orjson.loads(result.stdout)
    assert data["schema"] == "qwen-embed-bench/1"
    assert data["ok"] is False
    assert data["error_type"] == "ConnectError"
    assert str(port) in data["error"]


# --------------------------------------------------------------------------- check


def test_check_json_findings(server: EmbeddingServer) -> None:
    data = as_json(run("check", "--base-url", server.base_url, "--json", "--max-idle", "4"))
    assert data["schema"] == "qwen-embed-check/1"
    assert data["ok"] is True
    assert data["model"] == server.model
    found = {f["name"]: f for f in data["findings"]}
    assert list(found) == [
        "health",
        "models",
        "embedding",
        "base64",
        "dimensions",
        "batch_limit",
        "http2",
        "keepalive",
        "latency",
        "truncation",
    ]
    assert found["health"]["status"] == "ok"
    assert found["models"]["value"] == [server.model]
    assert found["embedding"]["value"]["dim"] == 1024
    assert found["base64"]["status"] == "ok"
    # SGLang without the matryoshka override refuses `dimensions`
    assert found["dimensions"]["status"] == "warn"
    assert "is_matryoshka" in found["dimensions"]["advice"]
    assert found["batch_limit"]["value"] == 64
    assert found["http2"]["value"] is False
    # the server closes idle connections after 2 s: measured, and advice to stay below
    idle = found["keepalive"]["value"]
    assert 1.8 <= idle <= 3.0
    assert found["keepalive"]["status"] == "warn"
    assert "keepalive_expiry=" in found["keepalive"]["advice"]
    latency = found["latency"]["value"]
    assert 0 < latency["min_ms"] <= latency["p50_ms"] <= latency["max_ms"]


def test_check_table_matryoshka_and_https() -> None:
    with EmbeddingServer(matryoshka=True, tls=True, http2=True) as srv:
        result = run(
            "check", "--base-url", srv.base_url, "--ca", srv.ca_cert_path, "--max-idle", "1"
        )
        assert result.exit_code == 0, result.output
        data = as_json(
            run(
                "check",
                "--base-url",
                srv.base_url,
                "--ca",
                srv.ca_cert_path,
                "--max-idle",
                "1",
                "--json",
            )
        )
    out = result.stdout
    for name in ("health", "dimensions", "keepalive", "http2", "latency"):
        assert name in out
    found = {f["name"]: f for f in data["findings"]}
    assert found["dimensions"]["status"] == "ok"
    assert found["http2"]["value"] is True
    assert found["keepalive"]["value"] is None  # 5 s > the 1 s we waited
    assert found["batch_limit"]["value"] == 128  # no limit up to the probe bound


def test_check_unreachable_fails() -> None:
    port = _free_port()
    result = run("check", "--base-url", f"http://127.0.0.1:{port}/v1", "--json")
    assert result.exit_code == 1
    data = orjson.loads(result.stdout)
    assert data["ok"] is False
    assert data["findings"][0]["name"] == "health"
    assert data["findings"][0]["status"] == "fail"


# --------------------------------------------------------------------------- embed


def test_embed_lines_to_npy_streams_in_chunks(server: EmbeddingServer, tmp_path: Path) -> None:
    texts = corpus(11)
    src = tmp_path / "in.txt"
    src.write_text(texts[0] + "\n\n" + "\n".join(texts[1:]) + "\n", encoding="utf-8")
    out = tmp_path / "out.npy"
    server.reset_counters()
    result = run(
        "embed",
        "--base-url",
        server.base_url,
        "--chunk-size",
        "4",
        "--batch-size",
        "3",
        str(src),
        str(out),
    )
    assert result.exit_code == 0, result.output
    arr = np.load(out)
    assert arr.shape == (11, 1024)
    assert arr.dtype == np.float32
    expected = np.stack([expected_embedding(t) for t in texts])
    np.testing.assert_allclose(arr, expected, rtol=0, atol=1e-6)
    # 11 texts in batches of 3 (3, 3, 3, 2), at most one chunk of 4 texts in flight
    assert server.requests == 4
    assert [len(batch) for batch in server.received] == [3, 3, 3, 2]


def test_embed_jsonl_queries_to_jsonl(server: EmbeddingServer, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    rows = [{"id": "a", "text": "what is a tuple"}, {"text": "how do generators work"}]
    src.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    out = tmp_path / "out.jsonl"
    result = run("embed", "--base-url", server.base_url, "--query", str(src), str(out))
    assert result.exit_code == 0, result.output
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [line["index"] for line in lines] == [0, 1]
    assert lines[0]["id"] == "a"
    assert "id" not in lines[1]
    for row, line in zip(rows, lines, strict=True):
        want = expected_embedding(format_query(row["text"], DEFAULT_QUERY_TASK))
        np.testing.assert_allclose(line["embedding"], want, rtol=0, atol=1e-6)


def test_embed_rejects_unknown_output(server: EmbeddingServer, tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("hello\n", encoding="utf-8")
    result = run("embed", "--base-url", server.base_url, str(src), str(tmp_path / "o.csv"))
    assert result.exit_code == 2


def _embed_small_chunks(base_url: str, src: Path, out: Path, *args: str) -> Result:
    """``qwen-embed embed`` one request per chunk of 2 texts, one at a time."""
    return run(
        "embed",
        "--base-url",
        base_url,
        *("--chunk-size", "2", "--batch-size", "2", "--concurrency", "1", *args),
        str(src),
        str(out),
    )


@pytest.mark.parametrize("suffix", [".npy", ".jsonl"])
@pytest.mark.parametrize("existing", [False, True])
def test_embed_failed_run_leaves_the_output_as_it_was(
    server: EmbeddingServer, tmp_path: Path, suffix: str, existing: bool
) -> None:
    src = tmp_path / "in.txt"
    src.write_text("".join(f"line {i}\n" for i in range(6)), encoding="utf-8")
    out = tmp_path / f"out{suffix}"
    if existing:
        out.write_bytes(b"the previous good output")
    server.clear_faults()
    server.inject("delay", seconds=0.0)  # the first chunk is embedded (and written)...
    server.inject_status(404, message="no")  # ...the second fails: not retried
    result = _embed_small_chunks(server.base_url, src, out)
    assert result.exit_code == 1, result.output
    assert "error:" in result.stderr
    if existing:
        assert out.read_bytes() == b"the previous good output"
    else:
        assert not out.exists()  # no rows of zeros standing in for texts never embedded
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["in.txt"] + ([out.name] if existing else [])
    )  # and no temporary file left behind
    # the same command, the server healthy again: OUTPUT is replaced, complete
    server.clear_faults()
    result = _embed_small_chunks(server.base_url, src, out)
    assert result.exit_code == 0, result.output
    want = np.stack([expected_embedding(f"line {i}") for i in range(6)])
    if suffix == ".npy":
        got = np.load(out)
    else:
        got = np.array([orjson.loads(line)["embedding"] for line in out.read_bytes().splitlines()])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", out.name]


@pytest.mark.parametrize("query", [False, True])
def test_embed_bad_record_is_named_by_file_and_line_before_any_request(
    server: EmbeddingServer, tmp_path: Path, query: bool
) -> None:
    src = tmp_path / "in.txt"
    # records 0-4 on lines 1-5, a blank line 6, the overlong text on line 7 (record 5,
    # at position 1 of the third chunk of 2)
    lines = [f"line {i}" for i in range(5)] + ["", "z" * 300_000, "after"]
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.npy"
    server.reset_counters()
    result = _embed_small_chunks(server.base_url, src, out, *(["--query"] if query else []))
    assert result.exit_code == 1, result.output
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: {src}:7: the text is 300,"), error
    assert "above max_text_chars=262,144" in error
    assert "index" not in error  # no position inside a streaming chunk
    assert server.requests == 0  # found while counting, before anything was sent
    assert not out.exists()


def test_embed_notes_skipped_blank_records(server: EmbeddingServer, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"text":"a","id":1}\n{"text":"   ","id":2}\n{"text":"b","id":3}\n')
    out = tmp_path / "out.jsonl"
    result = run("embed", "--base-url", server.base_url, str(src), str(out))
    assert result.exit_code == 0, result.output
    assert "skipped 1 blank record (line 2)" in result.stderr
    assert "embedded 2 texts" in result.stderr
    assert [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()] == [1, 3]
    # plain text: blank lines between records, before the first and at the end
    src = tmp_path / "in.txt"
    src.write_text("\n \na\n\t\nb\r\n\n\n\n", encoding="utf-8")
    result = run("embed", "--base-url", server.base_url, str(src), str(tmp_path / "o.npy"))
    assert result.exit_code == 0, result.output
    assert "skipped 6 blank records (lines 1, 2, 4, 6, 7, ...)" in result.stderr
    assert np.load(tmp_path / "o.npy").shape == (2, 1024)
    # none blank: no notice
    src.write_text("a\nb", encoding="utf-8")
    result = run("embed", "--base-url", server.base_url, str(src), str(tmp_path / "o.npy"))
    assert result.exit_code == 0, result.output
    assert "blank record" not in result.stderr


# --------------------------------------------------------------------------- serve


def test_serve_runs_for_a_duration() -> None:
    result = run("serve", "--port", "0", "--duration", "0.3", "--latency", "0.01")
    assert result.exit_code == 0, result.output
    assert "Serving Qwen/Qwen3-Embedding-0.6B (1024-dim) at http://127.0.0.1:" in result.stdout


# --------------------------------------------------------------------------- input, relay


def test_corpus_is_real_distinct_text() -> None:
    texts = corpus(10_000, unique=True)
    assert len(set(texts)) == 10_000
    assert all(20 <= len(t) <= 2000 for t in texts)
    assert sum(" the " in t for t in texts) > 5_000  # English prose, not synthetic
    assert corpus(3) == texts[:3]


def test_iter_texts_skips_blank_records(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("a\n\n  \nb\n", encoding="utf-8")
    assert [(n, t) for n, t, _ in iter_texts(path)] == [(0, "a"), (3, "b")]
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"txt": 1}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"t\.jsonl:1"):
        list(iter_texts(bad))


@pytest.mark.parametrize("process", [False, True])
def test_relay_delays_each_direction_and_the_handshake(process: bool) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, Relay(listener.getsockname()[:2], rtt=0.05, process=process) as relay:
        started = time.perf_counter()
        client = socket.create_connection(("127.0.0.1", relay.port))
        upstream, _ = listener.accept()
        with client, upstream:
            client.sendall(b"ping")
            assert upstream.recv(16) == b"ping"
            first = time.perf_counter() - started  # handshake rtt + rtt/2
            upstream.sendall(b"pong")
            assert client.recv(16) == b"pong"
            t0 = time.perf_counter()
            client.sendall(b"x")
            assert upstream.recv(16) == b"x"
            upstream.sendall(b"y")
            assert client.recv(16) == b"y"
            round_trip = time.perf_counter() - t0
            client.shutdown(socket.SHUT_WR)
            assert upstream.recv(16) == b""  # EOF is relayed too
    assert first >= 0.075
    assert round_trip >= 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- --metrics


def test_bench_metrics_json_equals_what_the_server_counted() -> None:
    with EmbeddingServer() as srv:
        reset_metrics()  # a port seen earlier in this process would carry old counts
        # --model: no /models discovery, so every request the server sees is the client's
        data = as_json(
            bench_url(
                srv.base_url,
                "pooled_threads",
                "pooled_batched",
                args=("--batch-size", "3", "--model", srv.model, "--metrics", "--json"),
            )
        )
        served = srv.stats()
    assert list(data["metrics"]) == [data["base_url"]]  # the endpoint label, nothing else
    snap = data["metrics"][data["base_url"]]
    # one warm-up request, then 8 per mode
    assert snap["requests"] == served["requests"] == 1 + 8 + 8
    assert snap["requests_by_outcome"] == {"ok": 17}
    assert snap["texts"] == served["texts"] == 1 + 8 + 8 * 3
    assert snap["connections_opened"] == served["connections_opened"]
    per_mode = sum(m["connections_opened"] for m in data["modes"])
    assert snap["connections_opened"] == 1 + per_mode  # + the warm-up's connection
    assert snap["retries"] == snap["stale_retries"] == snap["in_flight"] == 0
    assert snap["batch_size"]["count"] == 17
    assert snap["batch_size"]["sum"] == 1 + 8 + 8 * 3
    latency = snap["latency_seconds"]
    assert latency["buckets"][-1] == ["+Inf", 17]  # JSON has no infinity: Prometheus' name
    assert 0 < latency["sum"] < 17 * 5.0


def test_bench_prints_the_metrics_table_after_its_own(server: EmbeddingServer) -> None:
    result = bench_url(server.base_url, "pooled_threads", args=("--metrics",))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.index("(b) pooled sync") < out.index("client metrics of this process")
    assert server.base_url.rstrip("/") in out.split("client metrics of this process")[1]
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in _rows(out)}
    assert re.fullmatch(r"\d+ \(ok \d+\)", rows["requests"]), rows["requests"]
    assert int(rows["TCP connections opened"]) >= 1


def test_check_metrics_table_and_json() -> None:
    with EmbeddingServer() as srv:
        reset_metrics()
        table = run("check", "--base-url", srv.base_url, "--max-idle", "0.5", "--metrics")
        reset_metrics()
        data = as_json(
            run("check", "--base-url", srv.base_url, "--max-idle", "0.5", "--metrics", "--json")
        )
        plain = as_json(run("check", "--base-url", srv.base_url, "--max-idle", "0.5", "--json"))
    assert table.exit_code == 0, table.output
    out = table.stdout
    label = data["base_url"]
    assert "client metrics of this process (qwen_embed_plugins.stats()):" in out
    assert label in out
    # the latency sample (11 single-text requests, one after another, on one connection)
    # and the truncation probe (one request of two texts, on a new connection)
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in _rows(out)}
    assert rows["requests"] == "12 (ok 12)"
    assert rows["texts embedded"] == "13"
    assert rows["texts per request (mean)"] == "1.1"
    assert rows["TCP connections opened"] == "2"  # the probe after the sample's close_all
    assert rows["retries"] == "0"
    assert rows["latency p50 / p95 / p99 ms"].startswith("<= ")
    snap = data["metrics"][label]
    assert snap["requests"] == 12
    assert snap["connections_opened"] == 2
    assert "metrics" not in plain  # only with --metrics
    assert [f["name"] for f in plain["findings"]] == [f["name"] for f in data["findings"]]


def test_metrics_of_an_endpoint_the_client_never_reached() -> None:
    port = _free_port()
    result = run("check", "--base-url", f"http://127.0.0.1:{port}/v1", "--json", "--metrics")
    assert result.exit_code == 1
    assert orjson.loads(result.stdout)["metrics"] == {}
    result = run("check", "--base-url", f"http://127.0.0.1:{port}/v1", "--metrics")
    assert "metrics: no request of this process went through the client" in result.stdout


def _rows(table: str) -> list[str]:
    """The body rows of the last rich table in ``table`` with two cells."""
    return [line for line in table.splitlines() if line.count("│") == 3]


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        ("notext.jsonl", b'{"id": 1}\n', 'expected an object with a "text" string'),
        ("broken.jsonl", b"{not json\n", "not valid JSON"),
        ("latin1.txt", b"ok\ncaf\xe9\n", "not UTF-8"),
    ],
)
def test_bench_bad_texts_file_is_a_message_not_a_traceback(
    tmp_path: Path, name: str, content: bytes, words: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    result = run("bench", "--base-url", "http://127.0.0.1:9/v1", "--texts", str(path))
    assert result.exit_code == 2
    assert words in result.output
    assert f"{name}:" in result.output
    assert "Traceback" not in result.output
