"""``qwen-embed`` as a real process receiving real signals.

Every signal is sent once the process is known to be where the test wants it: blocked
importing a module (an import hook prints a line and waits), or with a request held by
the loopback server (its in-flight counter says so). No test sleeps and hopes, and none
signals its own process: a timer in the test process races the CLI on a loaded machine
(that is how the old in-process Ctrl-C test got exit 0 instead of 1).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cli_support import (
    CliProcess,
    journal_batches,
    numbered_texts,
    received_batches,
    run,
    wait_until,
)

from qwen_embed_tooling.testing import EmbeddingServer, expected_embedding

_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
_WORDS = {
    signal.SIGINT: "interrupted (Ctrl-C)",
    signal.SIGTERM: "terminated (SIGTERM)",
    signal.SIGHUP: "hung up (SIGHUP)",
}


@pytest.fixture
def server() -> Iterator[EmbeddingServer]:
    with EmbeddingServer(received_limit=100_000) as srv:
        yield srv


def embed_process(server: EmbeddingServer, src: Path, out: Path, *args: str) -> CliProcess:
    return CliProcess(
        [
            "embed",
            "--base-url",
            server.base_url,
            *("--batch-size", "4", "--concurrency", "1"),
            *args,
            str(src),
            str(out),
        ]
    )


def one_line(stderr: str) -> str:
    """The only non-blank line of ``stderr`` (fails if there are more)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


# --------------------------------------------------------------------------- imports


@pytest.mark.parametrize(
    "module",
    [
        "qwen_embed_plugins.cli._app",  # the command group, imported by main()
        "rich.console",  # a heavy import inside a command body
    ],
)
def test_ctrl_c_while_importing_exits_130_in_one_line(tmp_path: Path, module: str) -> None:
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    proc = CliProcess(
        ["embed", "--base-url", "http://127.0.0.1:9/v1", str(src), str(tmp_path / "o.npy")],
        pause_import=module,
    )
    proc.wait_for_line(f"IMPORTING {module}")
    proc.signal(signal.SIGINT)
    status, _, stderr = proc.finish()
    assert status == 130
    assert one_line(stderr) == "qwen-embed: interrupted (Ctrl-C)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


# --------------------------------------------------------------------------- embed


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_mid_run_leaves_output_as_it_was_and_no_temporary_file(
    server: EmbeddingServer, tmp_path: Path, signum: int
) -> None:
    src = tmp_path / "in.txt"
    numbered_texts(src, 12)
    out = tmp_path / "out.npy"
    out.write_bytes(b"the previous good output")
    server.inject("delay", seconds=0.0)
    server.inject("delay", seconds=60.0)  # the 2nd request is held until the signal
    proc = embed_process(server, src, out)
    wait_until(lambda: server.requests == 2 and server.stats()["in_flight"] == 1, "request 2")
    proc.signal(signum)
    status, _, stderr = proc.finish()
    assert status == _STATUS[signum]
    assert one_line(stderr) == f"qwen-embed: {_WORDS[signum]}; {out} left as it was"
    assert out.read_bytes() == b"the previous good output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.npy"]


def test_sigterm_with_resume_keeps_the_job_and_the_rerun_completes_it(
    server: EmbeddingServer, tmp_path: Path
) -> None:
    src = tmp_path / "in.txt"
    texts = numbered_texts(src, 12)
    out = tmp_path / "out.npy"
    server.inject("delay", seconds=0.0)
    server.inject("delay", seconds=60.0)
    proc = embed_process(server, src, out, "--resume")
    wait_until(lambda: server.requests == 2 and server.stats()["in_flight"] == 1, "request 2")
    proc.signal(signal.SIGTERM)
    status, _, stderr = proc.finish()
    assert status == 143
    assert one_line(stderr) == (
        f"qwen-embed: terminated (SIGTERM); 4 of 12 texts embedded and kept in "
        f"{tmp_path / '.out.npy.part'}: run the same command to continue"
    )
    server.clear_faults()
    server.reset_counters()
    status, _, stderr = embed_process(server, src, out, "--resume").finish()
    assert status == 0, stderr
    assert sorted(received_batches(server.received, 4)) == [1, 2]
    np.testing.assert_allclose(np.load(out), np.stack([expected_embedding(t) for t in texts]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.npy"]


def _sigkill_and_resume(server: EmbeddingServer, tmp_path: Path, n: int, suffix: str) -> None:
    """An uninterrupted run, then the same job SIGKILLed mid-run and resumed: the same
    bytes, and the resumed run sends exactly the batches the killed one did not write."""
    batch = 32
    src = tmp_path / ("in.jsonl" if suffix == ".jsonl" else "in.txt")
    numbered_texts(src, n, jsonl=suffix == ".jsonl")
    args = ("--batch-size", str(batch), "--concurrency", "4")
    reference = tmp_path / f"reference{suffix}"
    status, _, stderr = embed_process(server, src, reference, *args).finish()
    assert status == 0, stderr
    batches = -(-n // batch)
    server.reset_counters()
    out = tmp_path / f"out{suffix}"
    # a third of the batches go through, then one is held: the job cannot end before
    # the kill, while the other requests in flight keep going
    held = batches // 3
    server.inject("delay", seconds=0.0, count=held)
    server.inject("delay", seconds=600.0)
    proc = embed_process(server, src, out, "--resume", *args)
    wait_until(
        lambda: server.requests > held + 2 and server.stats()["in_flight"] >= 1,
        "the held request and two more",
    )
    proc.proc.kill()
    proc.finish()
    written = journal_batches(tmp_path / f".{out.name}.resume")
    assert 0 < len(written) < batches
    # requests of the killed run that the server was still answering would otherwise be
    # counted after the reset below (only the held one may stay: its delay is 600 s)
    wait_until(lambda: server.stats()["in_flight"] <= 1, "the killed run's other requests to end")
    server.reset_counters()
    status, _, stderr = embed_process(server, src, out, "--resume", *args).finish()
    assert status == 0, stderr
    assert out.read_bytes() == reference.read_bytes()  # byte-identical
    sent = received_batches(server.received, batch)
    assert sorted(sent) == sorted(set(range(batches)) - written)  # none twice, none done
    assert server.requests == batches - len(written)
    missing = [b for b in range(batches) if b not in written]
    assert server.stats()["texts"] == sum(min(batch, n - b * batch) for b in missing)


@pytest.mark.parametrize("suffix", [".npy", ".jsonl"])
def test_sigkill_then_resume_gives_the_same_bytes(
    server: EmbeddingServer, tmp_path: Path, suffix: str
) -> None:
    _sigkill_and_resume(server, tmp_path, 3_000, suffix)


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".npy", ".jsonl"])
def test_sigkill_then_resume_100k_texts(
    server: EmbeddingServer, tmp_path: Path, suffix: str
) -> None:
    _sigkill_and_resume(server, tmp_path, 100_000, suffix)


# --------------------------------------------------------------------------- bench, serve


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ctrl_c_in_a_terminal_stops_bench_and_its_helper_processes(tmp_path: Path) -> None:
    # A terminal's Ctrl-C reaches the whole foreground process group: the CLI, the
    # local server's process and the relay's. Only the CLI may answer, in one line.
    proc = CliProcess(
        ["bench", "--requests", "100000", "--rtt-ms", "5", "--mode", "pooled_threads"],
        new_session=True,
    )
    proc.wait_for_line("measuring", stream="stderr")
    pgid = os.getpgid(proc.proc.pid)
    os.killpg(pgid, signal.SIGINT)
    status, stdout, stderr = proc.finish()
    assert status == 130
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == "qwen-embed: interrupted (Ctrl-C)"
    assert stdout == ""
    wait_until(lambda: not _group_alive(pgid), "the helper processes to exit")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_serve_stops_on_a_signal(signum: int) -> None:
    proc = CliProcess(["serve", "--port", "0"])
    line = proc.wait_for_line("Serving ")
    url = line.split(" at ", 1)[1].strip()
    result = run("check", "--base-url", url, "--max-idle", "0.5", "--json")
    assert result.exit_code == 0, result.output
    proc.signal(signum)
    status, _, stderr = proc.finish()
    assert status == _STATUS[signum]
    # (the server's own log lines come before: uvicorn names the h2c probe of check)
    assert stderr.splitlines()[-1] == f"qwen-embed: {_WORDS[signum]}"
    assert "Traceback" not in stderr


def test_a_killed_bench_leaves_no_helper_process_behind() -> None:
    # SIGKILL gives the CLI no chance to stop its children: they notice on their own
    # (their stdin, a pipe from the CLI, reaches end of file) and exit.
    proc = CliProcess(
        ["bench", "--requests", "100000", "--rtt-ms", "5", "--mode", "pooled_threads"],
        new_session=True,
    )
    proc.wait_for_line("measuring", stream="stderr")
    pgid = os.getpgid(proc.proc.pid)
    proc.signal(signal.SIGKILL)
    assert proc.finish()[0] == -signal.SIGKILL
    wait_until(lambda: not _group_alive(pgid), "the helper processes to exit")
