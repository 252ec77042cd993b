"""Helpers of the ``qwen-embed`` tests: run the CLI in-process or as a real process,
wait on conditions (never on sleeps), and read what a job left on disk."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from click.testing import CliRunner, Result

from qwen_embed_plugins.cli import get_command

GUARD = 120.0
"""Seconds a wait may last before the test fails (a guard, not an assertion on time)."""


def run(*args: str) -> Result:
    """``qwen-embed ARGS`` in-process (click's CliRunner)."""
    return CliRunner().invoke(get_command(), list(args), catch_exceptions=False)


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = GUARD) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


# Installed in the child before the CLI runs: when the module named by
# QWEN_EMBED_TEST_PAUSE_IMPORT is about to be imported, print a line and block on stdin,
# so the test can signal the process while it is importing that module.
_PAUSE_HOOK = """
import importlib.abc, os, sys
class _Pause(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == os.environ.get("QWEN_EMBED_TEST_PAUSE_IMPORT"):
            sys.meta_path.remove(self)
            sys.stdout.write("IMPORTING " + name + "\\n")
            sys.stdout.flush()
            sys.stdin.readline()
        return None
sys.meta_path.insert(0, _Pause())
"""


class CliProcess:
    """``qwen-embed ARGS`` as a real process (the console entry point ``main()``).

    Its stdout and stderr are read by threads into queues, so a test can wait for a
    readiness line without blocking on a pipe.
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        pause_import: str | None = None,
        new_session: bool = False,
        cwd: str | Path | None = None,
    ) -> None:
        env = dict(os.environ)
        env.pop("COLUMNS", None)
        # As a terminal would start it: a shell's background job (CI, `cmd &`) starts
        # children with SIGINT ignored, and Python keeps an ignored SIGINT ignored.
        code = (
            "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from qwen_embed_plugins.cli import main; main()"
        )
        if pause_import is not None:
            env["QWEN_EMBED_TEST_PAUSE_IMPORT"] = pause_import
            code = _PAUSE_HOOK + code
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            text=True,
            start_new_session=new_session,
        )
        self.stdout_lines: list[str] = []
        self.stderr_lines: list[str] = []
        self._queues: dict[str, queue.Queue[str | None]] = {}
        self._threads = [
            self._reader("stdout", self.proc.stdout, self.stdout_lines),
            self._reader("stderr", self.proc.stderr, self.stderr_lines),
        ]

    def _reader(self, name: str, stream: IO[str] | None, lines: list[str]) -> threading.Thread:
        q: queue.Queue[str | None] = queue.Queue()
        self._queues[name] = q

        def read() -> None:
            assert stream is not None
            for line in stream:
                lines.append(line)
                q.put(line)
            q.put(None)

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        return thread

    def wait_for_line(self, text: str, stream: str = "stdout", timeout: float = GUARD) -> str:
        """The first line of ``stream`` containing ``text`` (fails if the process ends
        first or after ``timeout`` s)."""
        q = self._queues[stream]
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line with {text!r} on {stream}") from None
            if line is None:
                raise AssertionError(
                    f"the process ended (status {self.proc.wait()}) before {text!r} on "
                    f"{stream}; stderr: {''.join(self.stderr_lines)}"
                )
            if text in line:
                return line

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the process."""
        self.proc.send_signal(signum)

    def finish(self, timeout: float = GUARD) -> tuple[int, str, str]:
        """Wait for the end: ``(status, stdout, stderr)``."""
        status = self.proc.wait(timeout)
        for thread in self._threads:
            thread.join(timeout)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        return status, "".join(self.stdout_lines), "".join(self.stderr_lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.finish()


def journal_batches(path: Path) -> set[int]:
    """The batches an embed job's journal lists as written (complete lines only)."""
    lines = path.read_bytes().split(b"\n")[1:-1]  # the last one is "" or torn
    done = set()
    for line in lines:
        parts = line.split()
        if len(parts) == 2:
            done.add(int(parts[0]))
    return done


def received_batches(received: list[list[Any]], batch_size: int) -> list[int]:
    """The batch of each request the server received, for inputs ``"text {i}"``."""
    return [int(str(batch[0]).rsplit(" ", 1)[1]) // batch_size for batch in received]


def numbered_texts(path: Path, n: int, *, jsonl: bool = False) -> list[str]:
    """Write ``n`` distinct texts ``"text {i}"`` to ``path``, one per line."""
    import orjson

    texts = [f"text {i}" for i in range(n)]
    with path.open("wb") as fh:
        for i, text in enumerate(texts):
            if jsonl:
                fh.write(orjson.dumps({"id": i, "text": text}) + b"\n")
            else:
                fh.write(text.encode() + b"\n")
    return texts
