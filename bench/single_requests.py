"""Single-text requests: latency, throughput and client CPU per request.

Side by side in one run, against the loopback server in a child process (plain HTTP,
no emulated RTT: this isolates what the CLIENT costs):

- ``naive_sdk``: a new ``openai.OpenAI()`` per request (the seed's client);
- ``shared_sdk``: one shared ``openai.OpenAI()`` (the SDK's own pool);
- ``ours_sync``: ``EmbeddingClient.embed_query``;
- ``ours_async``: ``AsyncEmbeddingClient.embed_query``;
- ``raw_sync`` / ``raw_async``: the floor, the same HTTP library with no SDK and no
  checks: ``client.post`` of a pre-built orjson body, ``orjson.loads``, base64 ->
  ``numpy.frombuffer`` -> list of floats (what ``embed_query`` returns).

Every client sends the same bytes (Qwen query instruction included, base64). Two
phases: sequential (one request at a time: latency and CPU per request) and
concurrent (``--concurrency`` threads or tasks: throughput). Client CPU is
``time.process_time()`` of this process (all threads); the server runs elsewhere.
Medians of ``--repeats`` runs; mode order rotates between repeats.

    python bench/single_requests.py [--quick] [--requests N] [--repeats R]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import openai
import orjson
from _common import command_line, environment, markdown_table, median, save

from qwen_embed_plugins import (
    DEFAULT_QUERY_TASK,
    AsyncEmbeddingClient,
    EmbeddingClient,
    close_all,
    format_query,
)
from qwen_embed_plugins._corpus import corpus
from qwen_embed_plugins._transport._http import httpx
from qwen_embed_tooling.testing import EmbeddingServer

MODES = ("naive_sdk", "shared_sdk", "ours_sync", "ours_async", "raw_sync", "raw_async")
ASYNC = {"ours_async", "raw_async"}


def _decode(content: bytes) -> list[float]:
    item = orjson.loads(content)["data"][0]["embedding"]
    return np.frombuffer(base64.b64decode(item), dtype="<f4").tolist()  # type: ignore[no-any-return]


class Clients:
    """One factory per mode; ``sync(mode)`` / ``async_(mode)`` give ``call(text)``."""

    def __init__(self, base_url: str, model: str) -> None:
        self.base_url = base_url
        self.model = model
        self.url = f"{base_url}/embeddings"
        self.headers = {"Content-Type": "application/json"}

    def body(self, text: str) -> bytes:
        return orjson.dumps({"input": [text], "model": self.model, "encoding_format": "base64"})

    def sync(self, mode: str) -> tuple[Callable[[str], Any], Callable[[], None]]:
        if mode == "naive_sdk":

            def naive(text: str) -> Any:
                client = openai.OpenAI(base_url=self.base_url, api_key="EMPTY")
                try:
                    return client.embeddings.create(input=[text], model=self.model)
                finally:
                    client.close()

            return naive, lambda: None
        if mode == "shared_sdk":
            sdk = openai.OpenAI(base_url=self.base_url, api_key="EMPTY", max_retries=0)
            return (lambda text: sdk.embeddings.create(input=[text], model=self.model)), sdk.close
        if mode == "ours_sync":
            ours = EmbeddingClient(base_url=self.base_url, model=self.model)
            task = DEFAULT_QUERY_TASK
            # embed_query adds the instruction itself: strip ours to send identical bytes
            prefix = len(format_query("", task))
            return (lambda text: ours.embed_query(text[prefix:])), close_all
        if mode == "raw_sync":
            raw = httpx.Client()

            def raw_call(text: str) -> list[float]:
                resp = raw.post(self.url, content=self.body(text), headers=self.headers)
                resp.raise_for_status()
                return _decode(resp.content)

            return raw_call, raw.close
        raise ValueError(mode)

    def async_(self, mode: str) -> tuple[Callable[[str], Any], Callable[[], Any]]:
        """Must be called inside the running loop."""
        if mode == "ours_async":
            ours = AsyncEmbeddingClient(base_url=self.base_url, model=self.model)
            prefix = len(format_query("", DEFAULT_QUERY_TASK))

            async def ours_call(text: str) -> Any:
                return await ours.embed_query(text[prefix:])

            async def noop() -> None:
                return None

            return ours_call, noop
        if mode == "raw_async":
            raw = httpx.AsyncClient()

            async def raw_call(text: str) -> list[float]:
                resp = await raw.post(self.url, content=self.body(text), headers=self.headers)
                resp.raise_for_status()
                return _decode(resp.content)

            return raw_call, raw.aclose
        raise ValueError(mode)


def run_mode(clients: Clients, mode: str, texts: list[str], concurrency: int) -> dict[str, Any]:
    """Send ``len(texts)`` requests (after 5 warm-up ones); measure wall, CPU, latency."""
    latencies: list[float] = []
    n = len(texts)
    if mode in ASYNC:

        async def main() -> tuple[float, float]:
            call, close = clients.async_(mode)
            for t in texts[:5]:
                await call(t)
            counter = itertools.count()

            async def worker() -> None:
                while (i := next(counter)) < n:
                    t0 = time.perf_counter()
                    await call(texts[i])
                    latencies.append(time.perf_counter() - t0)

            cpu0, wall0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            await close()
            return wall, cpu

        wall, cpu = asyncio.run(main())
    else:
        call, close = clients.sync(mode)
        for t in texts[:5]:
            call(t)
        counter = itertools.count()
        lock = threading.Lock()

        def worker() -> None:
            mine = []
            while (i := next(counter)) < n:
                t0 = time.perf_counter()
                call(texts[i])
                mine.append(time.perf_counter() - t0)
            with lock:
                latencies.extend(mine)

        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        close()
    close_all()
    ms = np.asarray(latencies) * 1000.0
    return {
        "requests": n,
        "req_per_s": n / wall,
        "cpu_ms_per_request": cpu * 1000.0 / n,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, 1 repeat")
    parser.add_argument("--requests", type=int, default=None, help="per mode and phase")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    n = args.requests or (120 if args.quick else 400)
    repeats = args.repeats or (1 if args.quick else 5)
    texts = [format_query(t, DEFAULT_QUERY_TASK) for t in corpus(n)]
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {
        phase: {m: [] for m in MODES} for phase in ("sequential", "concurrent")
    }
    env = environment()
    with EmbeddingServer(process=True) as srv:
        clients = Clients(srv.base_url, srv.model)
        for r in range(repeats):
            order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
            for phase, conc in (("sequential", 1), ("concurrent", args.concurrency)):
                for mode in order:
                    # the naive client costs ~20-60 ms CPU per request: a quarter of n
                    count = max(20, n // 4) if mode == "naive_sdk" else n
                    raw[phase][mode].append(run_mode(clients, mode, texts[:count], conc))
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for phase, per_mode in raw.items():
        summary[phase] = {
            mode: {k: median([run[k] for run in runs]) for k in runs[0]}
            for mode, runs in per_mode.items()
        }
    result = {
        "benchmark": "single_requests",
        "command": command_line(),
        "environment": env,
        "requests": n,
        "repeats": repeats,
        "concurrency": args.concurrency,
        "summary": summary,
        "runs": raw,
    }
    save("single_requests", result, args.json_path)
    print(render(result))
    return result


def render(result: dict[str, Any]) -> str:
    s = result["summary"]
    seq, conc = s["sequential"], s["concurrent"]
    floor = {
        "sync": seq["raw_sync"]["cpu_ms_per_request"],
        "async": seq["raw_async"]["cpu_ms_per_request"],
    }
    rows = []
    for mode in MODES:
        kind = "async" if mode in ASYNC else "sync"
        rows.append(
            [
                mode,
                seq[mode]["p50_ms"],
                seq[mode]["req_per_s"],
                round(seq[mode]["cpu_ms_per_request"], 3),
                f"{seq[mode]['cpu_ms_per_request'] / floor[kind]:.2f}x raw_{kind}",
                conc[mode]["req_per_s"],
                round(conc[mode]["cpu_ms_per_request"], 3),
                f"{conc[mode]['req_per_s'] / conc['naive_sdk']['req_per_s']:.1f}x",
            ]
        )
    c = result["concurrency"]
    headers = [
        "client",
        "p50 ms (seq)",
        "req/s (seq)",
        "CPU ms/req (seq)",
        "CPU vs floor",
        f"req/s (x{c})",
        f"CPU ms/req (x{c})",
        f"req/s vs naive (x{c})",
    ]
    return (
        f"### Single-text requests ({result['requests']} per mode and phase, "
        f"median of {result['repeats']})\n\n`{result['command']}`\n\n"
        + markdown_table(headers, rows)
        + "\n"
    )


if __name__ == "__main__":
    main()
