"""What recording metrics costs: client CPU per request with metrics on vs off.

Side by side in one run and one process, against loopback servers in child processes
(plain HTTP, no emulated RTT: the client's own cost is what is measured):

- ``on``: an endpoint with the default ``EndpointMetrics`` (what every user gets);
- ``off``: an endpoint whose metrics object is ``NoMetrics`` (below), whose updates are
  no-ops (the library has no switch: the script puts it in the library's registry of
  metrics objects before the endpoint's first use);
- ``on_again``: a second ``EndpointMetrics`` endpoint, an A/A control: its difference
  to ``on`` is the noise floor of the measurement.

Each has its own server (the switch is per endpoint, and the endpoint label includes
the port). The modes are interleaved request by request, so all three run under the same
conditions of a shared machine: request ``i`` is sent by each mode in turn (the order
rotates with ``i``), one at a time, through ``EmbeddingClient.embed_query`` (sync) or
``AsyncEmbeddingClient.embed_query`` (async, one event loop), and each call's client CPU
is ``time.process_time()`` around it (this process, all threads; the servers run
elsewhere). A repeat is ``--requests`` requests per mode after 20 warm-up ones; tables
show medians over ``--repeats`` repeats, and the median of the per-repeat ratios. A
micro-benchmark of the two calls every request makes (``request_started`` +
``request_finished``) gives the cost of recording without the noise of a whole request.

    python bench/metrics_overhead.py [--quick] [--requests N] [--repeats R]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import timeit
from typing import Any

from _common import command_line, environment, markdown_table, median, save

from qwen_embed_plugins import AsyncEmbeddingClient, EmbeddingClient, close_all, stats
from qwen_embed_plugins._corpus import corpus
from qwen_embed_plugins._metrics import EndpointMetrics, metrics_for
from qwen_embed_plugins._state import STATE
from qwen_embed_tooling.testing import EmbeddingServer

MODES = ("on", "off", "on_again")
PATHS = ("sync", "async")
WARMUP = 20


class NoMetrics(EndpointMetrics):
    """An ``EndpointMetrics`` that records nothing: every update is a no-op."""

    def connection_opened(self) -> None:
        pass

    def request_started(self) -> None:
        pass

    def request_finished(self, outcome: str, seconds: float, texts: int) -> None:
        pass

    def retry(self, reason: str, *, stale: bool = False) -> None:
        pass

    def fallback(self, kind: str) -> None:
        pass


def _start(mode: str) -> EmbeddingServer:
    """A server whose endpoint gets ``NoMetrics`` (mode ``off``) or ``EndpointMetrics``."""
    srv = EmbeddingServer(process=True).start()
    if mode == "off":  # the library's own registry (a benchmark's privilege), before first use
        label = _label(srv)
        STATE.metrics[label] = NoMetrics(label)
    # the endpoint's metrics object is made now, on first use, and sticks
    EmbeddingClient(base_url=srv.base_url).embed_query("warm-up")
    close_all()
    return srv


def _sync_repeat(urls: dict[str, str], texts: list[str]) -> dict[str, float]:
    """CPU seconds per mode for ``len(texts)`` requests each, interleaved."""
    clients = {mode: EmbeddingClient(base_url=url) for mode, url in urls.items()}
    for t in texts[:WARMUP]:
        for client in clients.values():
            client.embed_query(t)
    cpu = dict.fromkeys(urls, 0.0)
    for i, t in enumerate(texts):
        for mode in MODES[i % 3 :] + MODES[: i % 3]:
            c0 = time.process_time()
            clients[mode].embed_query(t)
            cpu[mode] += time.process_time() - c0
    close_all()
    return cpu


def _async_repeat(urls: dict[str, str], texts: list[str]) -> dict[str, float]:
    """The async twin of ``_sync_repeat`` (one event loop, one request at a time)."""

    async def main() -> dict[str, float]:
        clients = {mode: AsyncEmbeddingClient(base_url=url) for mode, url in urls.items()}
        for t in texts[:WARMUP]:
            for client in clients.values():
                await client.embed_query(t)
        cpu = dict.fromkeys(urls, 0.0)
        for i, t in enumerate(texts):
            for mode in MODES[i % 3 :] + MODES[: i % 3]:
                c0 = time.process_time()
                await clients[mode].embed_query(t)
                cpu[mode] += time.process_time() - c0
        return cpu

    return asyncio.run(main())


def micro(number: int = 200_000) -> dict[str, float]:
    """Nanoseconds per request of the two metric calls every request makes."""
    out = {}
    for name, m in (("on", EndpointMetrics("micro-on")), ("off", NoMetrics("micro-off"))):

        def one(m: EndpointMetrics = m) -> None:
            m.request_started()
            m.request_finished("ok", 0.0007, 1)

        best = min(timeit.repeat(one, number=number, repeat=5))
        out[name] = best / number * 1e9
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and repeats")
    parser.add_argument("--requests", type=int, default=None, help="per mode, path and repeat")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    n = args.requests or (300 if args.quick else 2000)
    repeats = args.repeats or (3 if args.quick else 9)
    texts = corpus(n)
    env = environment()
    servers = {mode: _start(mode) for mode in MODES}
    try:
        kinds = {mode: type(metrics_for(_label(srv))).__name__ for mode, srv in servers.items()}
        assert kinds == {
            "on": "EndpointMetrics",
            "off": "NoMetrics",
            "on_again": "EndpointMetrics",
        }, kinds
        urls = {mode: srv.base_url for mode, srv in servers.items()}
        runs: dict[str, dict[str, list[float]]] = {p: {m: [] for m in MODES} for p in PATHS}
        for _ in range(repeats):
            for path in PATHS:
                repeat = _sync_repeat if path == "sync" else _async_repeat
                for mode, cpu in repeat(urls, texts).items():
                    runs[path][mode].append(cpu * 1e6 / n)  # us per request
        recorded = {mode: stats()[_label(srv)]["requests"] for mode, srv in servers.items()}
        served = {mode: srv.requests for mode, srv in servers.items()}
    finally:
        for srv in servers.values():
            srv.close()
    # the switch did what it says: "off" recorded nothing, "on" recorded every request
    assert recorded["off"] == 0, recorded
    assert recorded["on"] == served["on"], (recorded, served)
    summary = {path: {mode: median(v) for mode, v in per.items()} for path, per in runs.items()}
    paired = {
        path: {
            "on_vs_off": median([a / b - 1 for a, b in zip(per["on"], per["off"], strict=True)]),
            "control_vs_on": median(
                [a / b - 1 for a, b in zip(per["on_again"], per["on"], strict=True)]
            ),
        }
        for path, per in runs.items()
    }
    result = {
        "benchmark": "metrics_overhead",
        "command": command_line(),
        "environment": env,
        "requests": n,
        "repeats": repeats,
        "summary_us_per_request": summary,
        "paired_ratios": paired,
        "micro_ns_per_request": micro(),
        "recorded_requests": recorded,
        "served_requests": served,
        "runs_us_per_request": runs,
    }
    save("metrics_overhead", result, args.json_path)
    print(render(result))
    return result


def _label(srv: EmbeddingServer) -> str:
    return EmbeddingClient(base_url=srv.base_url).config.endpoint


def render(result: dict[str, Any]) -> str:
    s = result["summary_us_per_request"]
    paired = result["paired_ratios"]
    rows = []
    for path in PATHS:
        on, off, again = s[path]["on"], s[path]["off"], s[path]["on_again"]
        rows.append(
            [
                path,
                round(off, 1),
                round(on, 1),
                round(again, 1),
                f"{paired[path]['on_vs_off']:+.1%}",
                f"{paired[path]['control_vs_on']:+.1%}",
            ]
        )
    micro_ns = result["micro_ns_per_request"]
    cost = micro_ns["on"] - micro_ns["off"]
    lines = [
        f"### Metrics overhead ({result['requests']} single-text requests per mode and "
        f"path, median of {result['repeats']})",
        "",
        f"`{result['command']}`",
        "",
        markdown_table(
            [
                "path",
                "CPU us/req, metrics off",
                "CPU us/req, metrics on",
                "CPU us/req, on (A/A control)",
                "on vs off (paired)",
                "noise: control vs on (paired)",
            ],
            rows,
        ),
        "",
        f"Micro-benchmark: `request_started` + `request_finished` cost "
        f"{micro_ns['on']:.0f} ns per request with `EndpointMetrics`, "
        f"{micro_ns['off']:.0f} ns with `NoMetrics`: recording costs {cost:.0f} ns, "
        + ", ".join(
            f"{cost / 1000 / s[path]['off']:.2%} of the {path} path's {s[path]['off']:.0f} us"
            for path in PATHS
        )
        + ".",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
