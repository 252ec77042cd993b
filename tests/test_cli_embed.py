"""``qwen-embed embed`` in-process (CliRunner) against a real loopback server: output
formats, a resumable job after a failure, and the safety of INPUT and OUTPUT."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from cli_support import journal_batches, numbered_texts, received_batches, run, wait_until

from qwen_embed_tooling.testing import EmbeddingServer, expected_embedding


@pytest.fixture(scope="module")
def shared() -> Iterator[EmbeddingServer]:
    with EmbeddingServer(received_limit=100_000) as srv:
        yield srv


@pytest.fixture
def server(shared: EmbeddingServer) -> Iterator[EmbeddingServer]:
    shared.clear_faults()
    shared.reset_counters()
    yield shared
    shared.clear_faults()


def embed(server: EmbeddingServer, src: Path, out: Path, *args: str) -> tuple[int, str]:
    """``qwen-embed embed`` with batches of 4, one request at a time unless ``args``
    say otherwise; returns the exit status and stderr."""
    result = run(
        "embed",
        "--base-url",
        server.base_url,
        *("--batch-size", "4", "--concurrency", "1"),
        *args,
        str(src),
        str(out),
    )
    return result.exit_code, result.stderr


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --------------------------------------------------------------------------- formats


def test_jsonl_index_is_the_0_based_line_index_of_the_record(
    server: EmbeddingServer, tmp_path: Path
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('\n{"text": "a", "id": "x"}\n\n{"text": " "}\n{"text": "b"}\n')
    out = tmp_path / "out.jsonl"
    code, err = embed(server, src, out)
    assert code == 0, err
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    lines = src.read_text().split("\n")
    assert [r["index"] for r in rows] == [1, 4]
    for row in rows:  # the help's promise: INPUT's lines[index] is the record
        assert orjson.loads(lines[row["index"]])["text"] in ("a", "b")
    assert rows[0]["id"] == "x"
    assert "id" not in rows[1]
    np.testing.assert_allclose(rows[1]["embedding"], expected_embedding("b"), atol=1e-6)
    assert files(tmp_path) == ["in.jsonl", "out.jsonl"]


def test_concurrent_batches_land_in_input_order(server: EmbeddingServer, tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    texts = numbered_texts(src, 203)
    out = tmp_path / "out.npy"
    server.inject("delay", seconds=2.0)  # the first batch is answered after later ones
    code, err = embed(server, src, out, "--concurrency", "6")
    assert code == 0, err
    np.testing.assert_allclose(np.load(out), np.stack([expected_embedding(t) for t in texts]))
    assert server.stats()["max_in_flight"] > 1
    assert sorted(received_batches(server.received, 4)) == list(range(51))


# --------------------------------------------------------------------------- resume


@pytest.mark.parametrize("suffix", [".npy", ".jsonl"])
def test_resume_after_a_failure_sends_only_the_missing_batches(
    server: EmbeddingServer, tmp_path: Path, suffix: str
) -> None:
    src = tmp_path / "in.txt"
    numbered_texts(src, 50)  # 13 batches of 4 (the last of 2)
    reference = tmp_path / f"reference{suffix}"
    code, err = embed(server, src, reference)
    assert code == 0, err
    server.reset_counters()
    out = tmp_path / f"out{suffix}"
    out.write_bytes(b"old")
    server.inject("delay", seconds=0.0, count=5)
    server.inject_status(404, message="no")  # the 6th request fails (not retried)
    code, err = embed(server, src, out, "--resume")
    assert code == 1
    assert "5 of 50 texts embedded and kept" not in err  # batches are 4 texts
    assert "20 of 50 texts embedded and kept in" in err
    assert out.read_bytes() == b"old"
    journal = tmp_path / f".out{suffix}.resume"
    assert journal_batches(journal) == {0, 1, 2, 3, 4}
    assert (tmp_path / f".out{suffix}.part").exists()
    server.reset_counters()
    code, err = embed(server, src, out, "--resume")
    assert code == 0, err
    assert out.read_bytes() == reference.read_bytes()  # byte-identical
    assert sorted(received_batches(server.received, 4)) == list(range(5, 13))
    assert server.stats()["texts"] == 50 - 20  # nothing re-sent
    assert "20 of them from the interrupted run" in err
    assert files(tmp_path) == sorted(["in.txt", out.name, reference.name])


def test_resume_resends_a_batch_whose_rows_were_damaged(
    server: EmbeddingServer, tmp_path: Path
) -> None:
    src = tmp_path / "in.txt"
    texts = numbered_texts(src, 20)  # 5 batches
    out = tmp_path / "out.npy"
    server.inject("delay", seconds=0.0, count=3)
    server.inject_status(404, message="no")
    assert embed(server, src, out, "--resume")[0] == 1
    part = tmp_path / ".out.npy.part"
    journal = tmp_path / ".out.npy.resume"
    assert journal_batches(journal) == {0, 1, 2}
    header = len(part.read_bytes()) - 3 * 4 * 1024 * 4  # 3 batches of 4 rows written
    with part.open("r+b") as fh:  # flip a byte of batch 1 (a lost page, a bad sector)
        fh.seek(header + 4 * 1024 * 4 + 17)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with journal.open("ab") as fh:  # and a torn last entry (killed mid-write)
        fh.write(b"3 0000")
    server.reset_counters()
    code, err = embed(server, src, out, "--resume")
    assert code == 0, err
    assert sorted(received_batches(server.received, 4)) == [1, 3, 4]
    np.testing.assert_allclose(np.load(out), np.stack([expected_embedding(t) for t in texts]))


def _interrupted_job(server: EmbeddingServer, tmp_path: Path) -> tuple[Path, Path]:
    src = tmp_path / "in.txt"
    numbered_texts(src, 20)
    out = tmp_path / "out.npy"
    server.inject("delay", seconds=0.0)
    server.inject_status(404, message="no")
    assert embed(server, src, out, "--resume")[0] == 1
    return src, out


def test_resume_refuses_changed_input(server: EmbeddingServer, tmp_path: Path) -> None:
    src, out = _interrupted_job(server, tmp_path)
    with src.open("ab") as fh:
        fh.write(b"one more line\n")
    code, err = embed(server, src, out, "--resume")
    assert code == 2
    assert "cannot resume: the input's content changed" in err
    assert "delete" in err


def test_resume_refuses_changed_settings(server: EmbeddingServer, tmp_path: Path) -> None:
    src, out = _interrupted_job(server, tmp_path)
    code, err = embed(server, src, out, "--resume", "--query")
    assert code == 2
    assert "cannot resume: the settings differ" in err
    assert "query_instruction: None -> 'Given a web search query" in err
    code, err = embed(server, src, out, "--resume", "--batch-size", "8")
    assert code == 2
    assert "batch_size: 4 -> 8" in err
    # concurrency does not change the bytes: allowed
    code, err = embed(server, src, out, "--resume", "--concurrency", "3")
    assert code == 0, err


def test_a_run_without_resume_does_not_clobber_a_resumable_one(
    server: EmbeddingServer, tmp_path: Path
) -> None:
    src, out = _interrupted_job(server, tmp_path)
    before = (tmp_path / ".out.npy.part").read_bytes()
    code, err = embed(server, src, out)
    assert code == 2
    assert "has an interrupted resumable run" in err
    assert "pass --resume" in err
    assert (tmp_path / ".out.npy.part").read_bytes() == before


def test_a_second_job_on_the_same_output_is_refused(
    server: EmbeddingServer, tmp_path: Path
) -> None:
    import fcntl

    src = tmp_path / "in.txt"
    numbered_texts(src, 8)
    out = tmp_path / "out.npy"
    with (tmp_path / ".out.npy.part").open("wb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # as a running job holds it
        code, err = embed(server, src, out)
    assert code == 1
    assert "another qwen-embed embed is writing" in err
    assert server.requests == 0
    assert not out.exists()


# --------------------------------------------------------------------------- safety


@pytest.mark.parametrize(
    "how", ["same path", "same path, a text file", "symlink", "hardlink", "symlinked dir"]
)
def test_output_that_is_the_input_is_refused(
    server: EmbeddingServer, tmp_path: Path, how: str
) -> None:
    # `embed in.txt in.txt` is told that OUTPUT is INPUT (not that .txt is no output suffix)
    src = tmp_path / ("in.txt" if how.endswith("text file") else "in.jsonl")
    src.write_text('{"text": "keep me"}\n')
    original = src.read_bytes()
    if how.startswith("same path"):
        out = src
    elif how == "symlink":
        out = tmp_path / "out.jsonl"
        out.symlink_to(src)
    elif how == "hardlink":
        out = tmp_path / "out.jsonl"
        os.link(src, out)
    else:
        (tmp_path / "alias").symlink_to(tmp_path)
        out = tmp_path / "alias" / "in.jsonl"
    code, err = embed(server, src, out)
    assert code == 2
    assert "is the input file" in err
    assert "refusing to overwrite the input" in err
    assert src.read_bytes() == original
    assert server.requests == 0


# --------------------------------------------------------------------------- deadline


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_a_server_nobody_listens_on_ends_the_run_naming_the_url(tmp_path: Path) -> None:
    """The library's rule for a server never reached (``wait_for_server``, 2 s by
    default), whatever --deadline: the URL named, ``qwen-embed check`` suggested, one
    line for the outage (retries are not printed)."""
    src = tmp_path / "in.txt"
    src.write_text("one\ntwo\n")
    out = tmp_path / "out.npy"
    base_url = f"http://127.0.0.1:{closed_port()}/v1"
    result = run("embed", "--base-url", base_url, str(src), str(out))
    assert result.exit_code == 1
    assert f"cannot connect to {base_url}: " in result.stderr
    assert "Connection refused" in result.stderr
    # OUTPUT never existed: nothing was "left as it was"
    assert f"; nothing written to {out}" in result.stderr
    assert "left as it was" not in result.stderr
    assert f"qwen-embed check --base-url {base_url}" in result.stderr
    assert "_Conn" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) <= 2, lines  # the outage's start, then the error
    assert sum(line.startswith("error: ") for line in lines) == 1, lines
    assert not out.exists()
    assert files(tmp_path) == ["in.txt"]


def test_an_outage_prints_one_line_not_one_per_retry(
    server: EmbeddingServer, tmp_path: Path
) -> None:
    """503s for a while: the run completes; stderr has one line for the outage (its
    start), none per retry, and none for its end (the progress shows it)."""
    src = tmp_path / "in.txt"
    src.write_text("one\ntwo\n")
    out = tmp_path / "out.npy"
    server.inject_overloaded(count=6)
    code, err = embed(server, src, out)
    assert code == 0, err
    outage = [line for line in err.splitlines() if "failed (status_503)" in line]
    assert len(outage) == 1, err
    assert outage[0].startswith("qwen-embed: ")
    assert "retrying http" not in err
    assert "answered again" not in err


def test_deadline_is_an_option_in_seconds_with_its_default() -> None:
    result = run("embed", "--help")
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "--deadline SECONDS" in text
    assert "in seconds" in text
    assert "default: 300" in text
    assert "--wait-for-server SECONDS" in text
    bad = run("embed", "--base-url", "http://127.0.0.1:9/v1", "--deadline", "0", "a", "b")
    assert bad.exit_code == 2


def test_wait_for_server_carries_a_job_started_before_its_server(tmp_path: Path) -> None:
    """--wait-for-server: the job starts before its server and completes once it is up."""
    src = tmp_path / "in.txt"
    src.write_text("one\ntwo\n")
    out = tmp_path / "out.npy"
    port = closed_port()
    outcome: list[Any] = []
    url = f"http://127.0.0.1:{port}/v1"
    args = ("embed", "--base-url", url, "--wait-for-server", "120", str(src), str(out))
    worker = threading.Thread(target=lambda: outcome.append(run(*args)))
    worker.start()
    wait_until(lambda: _refused(url) >= 2, "the job to meet the missing server twice")
    with EmbeddingServer(port=port):
        worker.join(120)
    (result,) = outcome
    assert result.exit_code == 0, result.stderr
    assert np.array_equal(np.load(out), np.stack([expected_embedding(t) for t in ("one", "two")]))


def _refused(url: str) -> int:
    from qwen_embed_plugins._state import STATE

    replicas = [r for r in list(STATE.replicas.values()) if r.url == url]
    return sum(r.metrics.snapshot()["requests_by_outcome"].get("ConnectError", 0) for r in replicas)


def test_a_slow_first_answer_is_not_cut(tmp_path: Path) -> None:
    """The server answers after a second: the run waits for it (one request)."""
    src = tmp_path / "in.txt"
    src.write_text("one\ntwo\n")
    out = tmp_path / "out.npy"
    with EmbeddingServer(latency=1.0) as slow:
        code, err = embed(slow, src, out, "--deadline", "60")
        assert code == 0, err
        assert slow.requests == 1
    assert np.array_equal(np.load(out), np.stack([expected_embedding(t) for t in ("one", "two")]))


def test_bad_utf8_is_reported_on_its_true_line(server: EmbeddingServer, tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    lines = [f"line {i} " + "x" * (i % 200) for i in range(1, 5001)]
    data = "\n".join(lines).encode() + b"\n"
    at = data.index(b"line 3000 ")
    src.write_bytes(data[:at] + b"caf\xe9 " + data[at:])  # a Latin-1 byte on line 3,000
    code, err = embed(server, src, tmp_path / "out.npy")
    assert code == 1
    assert f"{src}:3000: not UTF-8 text (byte 0xe9 at byte 4 of the line" in err
    assert server.requests == 0


@pytest.mark.parametrize("change", ["rewritten", "same size and mtime", "replaced", "removed"])
def test_input_changed_during_the_run_writes_nothing(tmp_path: Path, change: str) -> None:
    with EmbeddingServer() as server:  # its own: the held request outlives the test
        _input_changed_during_the_run(server, tmp_path, change)


def _input_changed_during_the_run(server: EmbeddingServer, tmp_path: Path, change: str) -> None:
    src = tmp_path / "in.txt"
    numbered_texts(src, 12)
    out = tmp_path / "out.npy"
    out.write_bytes(b"old")
    server.inject("delay", seconds=0.0)
    server.inject("delay", seconds=60.0)  # the 2nd request is held while INPUT changes

    def meddle() -> None:
        wait_until(lambda: server.requests == 2 and server.stats()["in_flight"] == 1, "request 2")
        st = src.stat()
        if change == "rewritten":
            src.write_text("".join(f"TEXT {i}\n" for i in range(12)))
        elif change == "same size and mtime":
            src.write_bytes(src.read_bytes().replace(b"text 9", b"text X"))
            os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
        elif change == "replaced":
            other = tmp_path / "new.txt"
            other.write_bytes(src.read_bytes())
            os.replace(other, src)
        else:
            src.unlink()
        server.close_connections()  # let the held request go: the client sends it again

    thread = threading.Thread(target=meddle)
    thread.start()
    code, err = embed(server, src, out)
    thread.join()
    assert code == 1
    assert f"{src} changed while it was being embedded" in err
    assert out.read_bytes() == b"old"
    assert files(tmp_path) == sorted(["out.npy"] + ([] if change == "removed" else ["in.txt"]))


# --------------------------------------------------------------------------- memory


# Run as the CLI process: at exit, write the peak RSS of this process (VmHWM, reset by
# exec, unlike ru_maxrss, which keeps the forking parent's peak) to $RSS_OUT.
_PEAK_RSS_MAIN = """
import atexit, os
def _peak():
    with open("/proc/self/status") as fh, open(os.environ["RSS_OUT"], "w") as out:
        out.write(next(line for line in fh if line.startswith("VmHWM")).split()[1])
atexit.register(_peak)
from qwen_embed_plugins.cli import main
main()
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_peak_rss_is_flat_from_10k_to_100k_texts(tmp_path: Path) -> None:
    """The job holds only the batches in flight: 10x the texts, the same peak RSS."""
    import subprocess
    import sys

    from qwen_embed_plugins._corpus import corpus

    peak: dict[int, int] = {}
    with EmbeddingServer(process=True) as srv:
        for n in (10_000, 100_000):
            src = tmp_path / f"in{n}.txt"
            src.write_text("".join(text + "\n" for text in corpus(n)), encoding="utf-8")
            out = tmp_path / f"out{n}.npy"
            report = tmp_path / "peak"
            cli = [sys.executable, "-c", _PEAK_RSS_MAIN, "embed", "--base-url", srv.base_url]
            done = subprocess.run(
                [*cli, str(src), str(out)],
                capture_output=True,
                text=True,
                env={**os.environ, "RSS_OUT": str(report)},
            )
            assert done.returncode == 0, done.stderr
            assert np.load(out, mmap_mode="r").shape == (n, 1024)
            out.unlink()
            peak[n] = int(report.read_text())  # KiB
    # 100k x 1024 float32 is 400 MB: none of it may stay in memory
    assert peak[100_000] <= peak[10_000] + 16 * 1024, peak
