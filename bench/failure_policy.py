"""Figures of the failure policy (issue 20), with default settings.

- time to fail on a dead port (a loopback port nothing listens on): ``embed_query`` and
  a 640-text ``embed_documents``, sync and async (``RetryConfig.wait_for_server``: 2 s);
- what a burst of server-wide 500s (vLLM's ``TypeError: TextEncodeInput ...``) costs a
  640-text ``embed_documents``: the job with no burst, with a 1 s and a 5 s burst (a
  ``status_window`` rule started with the job), sync and async; every vector checked.

    python bench/failure_policy.py [--repeats R]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import qwen_embed_plugins as q
from qwen_embed_tooling.testing import EmbeddingServer, expected_embeddings

TEXTS = [f"burst passage {i}" for i in range(640)]
VLLM_500 = (
    "TypeError: TextEncodeInput must be Union[TextInputSequence, "
    "Tuple[InputSequence, InputSequence]]"
)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _call(client: Any, method: str, arg: Any) -> Any:
    result = getattr(client, method)(arg)
    return asyncio.run(result) if asyncio.iscoroutine(result) else result


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    try:
        out: Any = fn()
    except q.QwenEmbedError as exc:
        out = exc
    return time.perf_counter() - started, out


def dead_port(repeats: int) -> None:
    print("time to fail on a dead port (median of", repeats, "runs)")
    for flavour, cls in (("sync", q.EmbeddingClient), ("async", q.AsyncEmbeddingClient)):
        for method, arg in (("embed_query", "a query"), ("embed_documents", TEXTS)):
            times = []
            for _ in range(repeats):
                client = cls(base_url=f"http://127.0.0.1:{_closed_port()}/v1")
                seconds, out = _timed(lambda c=client, m=method, a=arg: _call(c, m, a))
                assert isinstance(out, q.ConnectError), out
                times.append(seconds)
            print(
                f"  {flavour:5} {method:16} {statistics.median(times):6.2f} s  "
                f"({type(out).__name__}: ...{str(out)[-60:]})"
            )


def burst(repeats: int) -> None:
    print("a 640-text embed_documents under a burst of server-wide 500s (median)")
    expected = expected_embeddings(TEXTS)
    for flavour, cls in (("sync", q.EmbeddingClient), ("async", q.AsyncEmbeddingClient)):
        for seconds in (0.0, 1.0, 5.0):
            times = []
            for _ in range(repeats):
                with EmbeddingServer() as srv:
                    client = cls(base_url=srv.base_url)
                    if seconds:
                        srv.status_window(seconds, status=500, message=VLLM_500)
                    took, out = _timed(lambda c=client: _call(c, "embed_documents_array", TEXTS))
                    assert not isinstance(out, Exception), out
                    np.testing.assert_array_equal(out, expected)
                    times.append(took)
            print(
                f"  {flavour:5} burst {seconds:3.0f} s: job took {statistics.median(times):6.2f} s"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dead_port(args.repeats)
    burst(args.repeats)


if __name__ == "__main__":
    main()
