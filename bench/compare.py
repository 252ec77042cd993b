"""Issue 14's table, side by side: ours and every peer in one run, interleaved rounds.

Rows (``--only ROW``, repeatable):

``single_sync``
    One text per request, sync, one at a time: client CPU per request of
    ``EmbeddingClient.embed_query`` and ``embed_documents([text])`` vs raw httpx
    (httpx2 with openai 3.x), one shared ``openai.OpenAI``, and the stdlib floor
    (``http.client`` keep-alive + orjson).
``single_async``
    One text per request, async, at concurrency 1 / 16 / 128 (tasks on one loop):
    ``AsyncEmbeddingClient.embed_query`` vs raw httpx ``AsyncClient`` and raw aiohttp (one
    ``ClientSession``).
``https_rtt``
    HTTPS through a relay adding a 40 ms round trip, 200 single queries at concurrency 16:
    ours async (16 tasks), ours sync on 16 threads, raw aiohttp, raw httpx async.
    ``cold``: each round starts with no connection (pools closed, a new aiohttp session),
    so TCP + TLS set-up is in it; ``warm``: the same 200 again on the warmed pool.
``batch_sync``
    Batches of 32 and of 128 texts per request, sync, one at a time: CPU per text of
    ``embed_documents`` (lists), ``embed_documents_array`` (float32 array), raw httpx,
    the stdlib floor (lists, and array), the SDK.
``bulk``
    10,000 texts (``--texts``), server answering after 20 ms: LangChain
    ``QwenPooledEmbeddings.embed_documents`` vs ``OpenAIEmbeddings(
    check_embedding_ctx_length=False)``; LlamaIndex ``QwenPooledEmbedding.
    get_text_embedding_batch`` vs ``OpenAILikeEmbedding``; core ``embed_documents_array``
    and ``embed_documents``. Each variant in a fresh subprocess (its own peak RSS,
    ``ru_maxrss``): texts/s, CPU per text, peak RSS, TCP connections the server accepted.

How: the server is ``qwen_embed_tooling.testing.EmbeddingServer(process=True)`` (uvicorn,
SGLang dialect, 1,024-dim base64 vectors) in its own process; client CPU is
``getrusage(RUSAGE_SELF)`` user+sys of the client process around the measured loop only
(after warm-up); every variant runs once per round, in an order rotated each round;
tables show medians over rounds and ratios ours / peer. Every client's first answer is
checked against the server's known vector. All pools are limited to 20 connections (the
library's default).

    python bench/compare.py [--quick] [--rounds N] [--json out.json] [--only ROW ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _harness as h  # noqa: E402
import _peers as p  # noqa: E402

from qwen_embed_plugins import DEFAULT_QUERY_TASK, format_query  # noqa: E402
from qwen_embed_plugins._corpus import corpus  # noqa: E402
from qwen_embed_tooling.testing import EmbeddingServer, expected_embedding  # noqa: E402

ROWS = ("single_sync", "single_async", "https_rtt", "batch_sync", "bulk")
RESULTS = HERE / "results"

# per-round sizes: (full, quick)
SIZES = {
    "single": (400, 60),
    "async": (600, 96),
    "rtt": (200, 64),
    "batch32": (100, 12),
    "batch128": (40, 6),
    "bulk": (10_000, 1_000),
    "warmup": (20, 5),
}


def size(name: str, quick: bool) -> int:
    return SIZES[name][1 if quick else 0]


# ============================================================================ servers


@contextlib.contextmanager
def server(**kwargs: Any) -> Iterator[EmbeddingServer]:
    """A loopback server in a child process; idle connections kept 60 s (the benchmark
    must not measure reconnects of clients sitting out a round)."""
    kwargs.setdefault("keep_alive_timeout", 60.0)
    with EmbeddingServer(process=True, **kwargs) as srv:
        yield srv


def relay_class() -> Any:
    """The RTT relay of the tooling (``qwen_embed_tooling.bench.relay``)."""
    for name in ("qwen_embed_tooling.bench.relay",):
        with contextlib.suppress(ImportError):
            module = __import__(name, fromlist=["Relay"])
            return module.Relay
    raise ImportError("no RTT relay found (qwen_embed_tooling.bench.relay)")


def check(name: str, result: Any, text: str) -> None:
    """The first vector a client returned is the server's vector for ``text``."""
    got = p.first_row(result)
    want = expected_embedding(text)
    if got.shape != want.shape or not np.allclose(got, want, atol=1e-5):
        raise AssertionError(f"{name}: wrong vector for {text[:40]!r}")


def queries(n: int) -> list[tuple[str, str]]:
    """``(raw query, query as sent with the Qwen instruction)`` pairs."""
    return [(t, format_query(t, DEFAULT_QUERY_TASK)) for t in corpus(n)]


def phase_result(
    runs: dict[str, list[dict[str, float]]], reference: str, metric: str
) -> dict[str, Any]:
    summary = {v: h.summarise(s) for v, s in runs.items()}
    ref = summary[reference][metric]
    ratios = {v: (ref / s[metric] if s[metric] else None) for v, s in summary.items()}
    return {
        "reference": reference,
        "metric": metric,
        "summary": summary,
        "ours_over_peer": ratios,
        "runs": runs,
    }


# ============================================================================ row 1


def row_single_sync(t: p.Target, rounds: int, quick: bool) -> dict[str, Any]:
    pairs = queries(size("single", quick) + size("warmup", quick))
    warm, pairs = pairs[: size("warmup", quick)], pairs[size("warmup", quick) :]
    variants: dict[str, tuple[Any, bool]] = {
        "ours_embed_query": (p.ours_sync(t, "embed_query"), True),
        "ours_embed_documents_1": (p.ours_sync(t, "embed_documents"), False),
        f"raw_{p.HTTP_LIBRARY}": (p.httpx_sync(t), False),
        "openai_sdk": (p.sdk_sync(t), False),
        "stdlib_keepalive": (p.stdlib_sync(t), False),
    }
    items = {v: [[raw if q else sent] for raw, sent in pairs] for v, (_, q) in variants.items()}
    for v, ((call, _), q) in variants.items():
        for raw, sent in warm:
            check(v, call([raw if q else sent]), sent)
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in h.rotated(list(variants), r):
            runs[v].append(h.run_sync(variants[v][0][0], items[v]).to_dict())
    for (_, close), _ in variants.values():
        close()
    return {
        "title": "single text, sync, concurrency 1: client CPU per request",
        "phases": {"c1": phase_result(runs, "ours_embed_query", "cpu_us_per_request")},
    }


# ============================================================================ row 2


def row_single_async(t: p.Target, rounds: int, quick: bool) -> dict[str, Any]:
    levels = (1, 16, 128)
    n = size("async", quick)
    pairs = queries(n)

    async def body() -> dict[str, Any]:
        from qwen_embed_plugins import aclose_all

        variants: dict[str, tuple[Any, bool]] = {
            "ours_async_embed_query": (p.ours_async(t, "embed_query"), True),
            f"raw_{p.HTTP_LIBRARY}_async": (p.httpx_async(t), False),
            "raw_aiohttp": (p.aiohttp_raw(t), False),
        }
        items = {v: [[raw if q else sent] for raw, sent in pairs] for v, (_, q) in variants.items()}
        for v, ((call, _), _q) in variants.items():
            check(v, await call(items[v][0]), pairs[0][1])
            # warm every connection the highest level will use
            await h.run_async(call, items[v][: 4 * p.POOL_LIMIT], p.POOL_LIMIT)
        runs: dict[int, dict[str, list[dict[str, float]]]] = {
            c: {v: [] for v in variants} for c in levels
        }
        for r in range(rounds):
            for c in levels:
                for v in h.rotated(list(variants), r):
                    sample = await h.run_async(variants[v][0][0], items[v], c)
                    runs[c][v].append(sample.to_dict())
        for (_, aclose), _q in variants.values():
            await aclose()
        await aclose_all()
        return {
            f"c{c}": phase_result(runs[c], "ours_async_embed_query", "cpu_us_per_request")
            for c in levels
        }

    return {
        "title": "single text, async, concurrency 1 / 16 / 128: client CPU per request",
        "phases": asyncio.run(body()),
    }


# ============================================================================ row 3


def row_https_rtt(rounds: int, quick: bool, rtt_ms: float = 40.0) -> dict[str, Any]:
    from qwen_embed_plugins import EmbeddingClient, aclose_all, close_all

    relay_cls = relay_class()
    n = size("rtt", quick)
    conc = 16
    pairs = queries(n)
    with (
        server(tls=True) as srv,
        relay_cls(("127.0.0.1", srv.port), rtt=rtt_ms / 1000.0, process=True) as relay,
    ):
        t = p.Target(f"https://localhost:{relay.port}/v1", srv.model, srv.ca_cert_path)
        raw_items = [[raw] for raw, _ in pairs]
        sent_items = [[sent] for _, sent in pairs]
        names = ("ours_async", "ours_sync_16_threads", "raw_aiohttp", f"raw_{p.HTTP_LIBRARY}_async")
        runs: dict[str, dict[str, list[dict[str, float]]]] = {
            ph: {v: [] for v in names} for ph in ("cold", "warm")
        }

        def record(phase: str, v: str, sample: h.Sample, opened: int) -> None:
            d = sample.to_dict()
            d["connections_opened_server"] = opened
            runs[phase][v].append(d)

        # the library detects the server once per endpoint and process (GET /models):
        # done here, before the rounds, so every cold round measures connection set-up
        # + requests only, as for the peers
        ours = EmbeddingClient(**p.ours_kwargs(t))
        check("ours_sync", ours.embed_query(pairs[0][0]), pairs[0][1])
        close_all()

        async def run_async_variant(v: str) -> tuple[h.Sample, int, h.Sample, int]:
            if v == "ours_async":
                await aclose_all()
                call, aclose = p.ours_async(t, "embed_query")
                items = raw_items
            elif v == "raw_aiohttp":
                call, aclose = p.aiohttp_raw(t)
                items = sent_items
            else:
                call, aclose = p.httpx_async(t)
                items = sent_items
            base = srv.connections_opened
            cold = await h.run_async(call, items, conc)
            mid = srv.connections_opened
            warm = await h.run_async(call, items, conc)
            end = srv.connections_opened
            check(v, await call(items[0]), pairs[0][1])
            await aclose()
            if v == "ours_async":
                await aclose_all()
            return cold, mid - base, warm, end - mid

        for r in range(rounds):
            for v in h.rotated(list(names), r):
                if v == "ours_sync_16_threads":
                    close_all()
                    call, _ = p.ours_sync(t, "embed_query")
                    base = srv.connections_opened
                    cold = h.run_sync(call, raw_items, conc)
                    mid = srv.connections_opened
                    warm = h.run_sync(call, raw_items, conc)
                    end = srv.connections_opened
                    close_all()
                    cold_opened, warm_opened = mid - base, end - mid
                else:
                    cold, cold_opened, warm, warm_opened = asyncio.run(run_async_variant(v))
                record("cold", v, cold, cold_opened)
                record("warm", v, warm, warm_opened)
    phases = {ph: phase_result(runs[ph], "ours_async", "cpu_us_per_request") for ph in runs}
    for ph in phases.values():  # throughput ratios too
        s = ph["summary"]
        ref = s["ours_async"]["req_per_s"]
        ph["ours_req_per_s_over_peer"] = {v: ref / x["req_per_s"] for v, x in s.items()}
    return {
        "title": f"HTTPS + {rtt_ms:g} ms RTT, {n} single queries, concurrency {conc}",
        "phases": phases,
    }


# ============================================================================ row 4


def row_batch_sync(t: p.Target, rounds: int, quick: bool) -> dict[str, Any]:
    phases: dict[str, Any] = {}
    for batch, key in ((32, "batch32"), (128, "batch128")):
        n = size(key, quick)
        texts = corpus(batch * (n + 2))
        batches = [texts[i * batch : (i + 1) * batch] for i in range(n + 2)]
        warm, batches = batches[:2], batches[2:]
        variants = {
            "ours_embed_documents": p.ours_sync(t, "embed_documents", batch_size=batch),
            "ours_embed_documents_array": p.ours_sync(t, "embed_documents_array", batch_size=batch),
            f"raw_{p.HTTP_LIBRARY}": p.httpx_sync(t),
            "stdlib_keepalive": p.stdlib_sync(t),
            "stdlib_keepalive_array": p.stdlib_sync(t, p.decode_array),
            "openai_sdk": p.sdk_sync(t),
        }
        for v, (call, _) in variants.items():
            for b in warm:
                check(v, call(b), b[0])
        runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
        for r in range(rounds):
            for v in h.rotated(list(variants), r):
                runs[v].append(h.run_sync(variants[v][0], batches, texts_per_item=batch).to_dict())
        for _, close in variants.values():
            close()
        phases[key] = phase_result(runs, "ours_embed_documents", "cpu_us_per_text")
    return {"title": "batch of 32 and of 128, sync: client CPU per text", "phases": phases}


# ============================================================================ row 5

BULK = (
    "ours_langchain",
    "langchain_openai",
    "ours_llamaindex",
    "llamaindex_openai_like",
    "ours_core_array",
    "ours_core_list",
)


def bulk_embed(variant: str, base_url: str, model: str) -> Callable[[list[str]], Any]:
    """Build the client (outside the measurement) and return the embedding call."""
    if variant == "ours_langchain":
        from qwen_embed_plugins import QwenPooledEmbeddings

        return QwenPooledEmbeddings(base_url=base_url, model=model).embed_documents
    if variant == "langchain_openai":
        from langchain_openai import OpenAIEmbeddings

        return OpenAIEmbeddings(
            model=model, base_url=base_url, api_key="EMPTY", check_embedding_ctx_length=False
        ).embed_documents
    if variant == "ours_llamaindex":
        from qwen_embed_plugins import QwenPooledEmbedding

        return QwenPooledEmbedding(base_url=base_url, model_name=model).get_text_embedding_batch
    if variant == "llamaindex_openai_like":
        from llama_index.embeddings.openai_like import OpenAILikeEmbedding

        return OpenAILikeEmbedding(
            model_name=model, api_base=base_url, api_key="EMPTY"
        ).get_text_embedding_batch
    if variant in ("ours_core_array", "ours_core_list"):
        from qwen_embed_plugins import EmbeddingClient

        client = EmbeddingClient(base_url=base_url, model=model)
        return client.embed_documents_array if variant.endswith("array") else client.embed_documents
    raise ValueError(variant)


def bulk_worker(variant: str, base_url: str, model: str, n: int) -> None:
    """Runs in the subprocess: build, embed ``n`` texts once, check, print one JSON line."""
    texts = corpus(n)
    embed = bulk_embed(variant, base_url, model)
    rss_before = h.peak_rss_mib()
    cpu0, wall0 = h.cpu_seconds(), time.perf_counter()
    result = embed(texts)
    wall, cpu = time.perf_counter() - wall0, h.cpu_seconds() - cpu0
    peak = h.peak_rss_mib()
    rows = len(result)
    for i in (0, n // 2, n - 1):
        check(variant, [result[i]], texts[i])
    del result
    print(
        json.dumps(
            {
                "variant": variant,
                "texts": n,
                "rows": rows,
                "wall_s": wall,
                "cpu_s": cpu,
                "texts_per_s": n / wall,
                "cpu_us_per_text": cpu * 1e6 / n,
                "peak_rss_mib": peak,
                "peak_rss_before_mib": rss_before,
            }
        )
    )


def row_bulk(rounds: int, quick: bool, texts: int | None, latency_ms: float) -> dict[str, Any]:
    n = texts or size("bulk", quick)
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in BULK}
    with server(latency=latency_ms / 1000.0) as srv:
        env = {k: v for k, v in os.environ.items() if not k.startswith("QWEN_EMBED_")}
        for r in range(rounds):
            for v in h.rotated(list(BULK), r):
                before = srv.connections_opened
                proc = subprocess.run(
                    [
                        sys.executable,
                        str(Path(__file__).resolve()),
                        "--worker",
                        v,
                        "--base-url",
                        srv.base_url,
                        "--model",
                        srv.model,
                        "--texts",
                        str(n),
                    ],
                    capture_output=True,
                    text=True,
                    check=False,
                    env=env,
                    timeout=1800,
                )
                if proc.returncode != 0:
                    raise RuntimeError(f"bulk worker {v} failed:\n{proc.stderr[-3000:]}")
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
                d = json.loads(line)
                d.pop("variant")
                d["connections_opened_server"] = srv.connections_opened - before
                runs[v].append(d)
                print(f"  bulk {v}: {d['texts_per_s']:.0f} texts/s", file=sys.stderr, flush=True)
    pairs = {
        "langchain": ("ours_langchain", "langchain_openai"),
        "llamaindex": ("ours_llamaindex", "llamaindex_openai_like"),
        "core array vs core list": ("ours_core_array", "ours_core_list"),
        "core array vs langchain_openai": ("ours_core_array", "langchain_openai"),
    }
    summary = {v: h.summarise(s) for v, s in runs.items()}
    ratios = {}
    for name, (ours, peer) in pairs.items():
        a, b = summary[ours], summary[peer]
        ratios[name] = {
            "ours": ours,
            "peer": peer,
            "texts_per_s": a["texts_per_s"] / b["texts_per_s"],
            "cpu_per_text_peer_over_ours": b["cpu_us_per_text"] / a["cpu_us_per_text"],
            "peak_rss_ours_over_peer": a["peak_rss_mib"] / b["peak_rss_mib"],
        }
    return {
        "title": f"{n:,} texts, {latency_ms:g} ms server latency, each variant in its own process",
        "texts": n,
        "server_latency_ms": latency_ms,
        "phases": {
            "bulk": {"summary": summary, "pairs": ratios, "runs": runs, "metric": "texts_per_s"}
        },
    }


# ============================================================================ report


def _label(v: str) -> str:
    return v.replace("_", " ")


def _us(x: float) -> str:
    return f"{x:,.0f} us"


def issue_table(result: dict[str, Any]) -> str:
    """Issue 14's table, this run's medians: ours, and each peer with ours ÷ peer."""
    rows = result["rows"]
    lines = []

    def peers(ph: dict[str, Any], metric: str, skip: tuple[str, ...] = ()) -> str:
        ref = ph["reference"]
        return "; ".join(
            f"{_label(v)} {_us(s[metric])} (ours {ph['summary'][ref][metric] / s[metric]:.2f}x)"
            for v, s in ph["summary"].items()
            if v != ref and v not in skip
        )

    if "single_sync" in rows:
        ph = rows["single_sync"]["phases"]["c1"]
        m = "cpu_us_per_request"
        lines.append(
            [
                "single text, sync, c=1: client CPU per request",
                f"{_us(ph['summary']['ours_embed_query'][m])} (embed_documents of 1: "
                f"{_us(ph['summary']['ours_embed_documents_1'][m])})",
                peers(ph, m, ("ours_embed_documents_1",)),
            ]
        )
    if "single_async" in rows:
        phs = rows["single_async"]["phases"]
        m = "cpu_us_per_request"
        ref = "ours_async_embed_query"
        names = [v for v in phs["c1"]["summary"] if v != ref]
        lines.append(
            [
                "single text, async, c=1 / 16 / 128: client CPU per request",
                " / ".join(f"{phs[c]['summary'][ref][m]:,.0f}" for c in phs) + " us",
                "; ".join(
                    f"{_label(v)} "
                    + " / ".join(f"{phs[c]['summary'][v][m]:,.0f}" for c in phs)
                    + " us (ours "
                    + " / ".join(f"{phs[c]['ours_over_peer'][v]:.2f}x" for c in phs)
                    + ")"
                    for v in names
                ),
            ]
        )
    if "https_rtt" in rows:
        ph = rows["https_rtt"]["phases"]["cold"]
        s = ph["summary"]
        lines.append(
            [
                rows["https_rtt"]["title"] + " (cold)",
                f"{s['ours_async']['req_per_s']:.0f} req/s, "
                f"{s['ours_async']['cpu_us_per_request'] / 1000:.2f} ms CPU/req",
                "; ".join(
                    f"{_label(v)} {x['req_per_s']:.0f} req/s at "
                    f"{x['cpu_us_per_request'] / 1000:.2f} ms CPU/req"
                    for v, x in s.items()
                    if v != "ours_async"
                ),
            ]
        )
    if "batch_sync" in rows:
        for key, ph in rows["batch_sync"]["phases"].items():
            m = "cpu_us_per_text"
            s = ph["summary"]
            lines.append(
                [
                    f"batch of {key[5:]}, sync, CPU per text",
                    f"{_us(s['ours_embed_documents'][m])} (array path "
                    f"{_us(s['ours_embed_documents_array'][m])})",
                    peers(ph, m, ("ours_embed_documents_array",))
                    + "; array path vs stdlib array floor "
                    + f"{s['ours_embed_documents_array'][m] / s['stdlib_keepalive_array'][m]:.2f}x",
                ]
            )
    if "bulk" in rows:
        row = rows["bulk"]
        s = row["phases"]["bulk"]["summary"]

        def cell(v: str) -> str:
            x = s[v]
            return (
                f"{x['texts_per_s']:,.0f} texts/s, {x['cpu_us_per_text']:.0f} us/text, "
                f"peak RSS {x['peak_rss_mib']:.0f} MiB, {x['connections_opened_server']:.0f} conns"
            )

        n = f"{row['texts']:,} texts, {row['server_latency_ms']:g} ms server"
        for ours, peer, what in (
            ("ours_langchain", "langchain_openai", "LangChain embed_documents"),
            ("ours_llamaindex", "llamaindex_openai_like", "LlamaIndex get_text_embedding_batch"),
            ("ours_core_array", "ours_core_list", "core embed_documents_array"),
        ):
            a, b = s[ours], s[peer]
            lines.append(
                [
                    f"{n}: {what}",
                    cell(ours),
                    f"{_label(peer)} {cell(peer)} (ours {a['texts_per_s'] / b['texts_per_s']:.2f}x "
                    f"texts/s, {b['cpu_us_per_text'] / a['cpu_us_per_text']:.2f}x less CPU/text)",
                ]
            )
    return h.markdown_table(["workload", "ours", "peers in the same run"], lines) + "\n"


def render(result: dict[str, Any]) -> str:
    out = [
        f"### Side-by-side harness (issue 14): {'quick' if result['quick'] else 'full'} run\n",
        f"`{result['command']}` — {result['rounds']} interleaved rounds, medians; "
        f"load average at start {result['environment']['load_avg_at_start']}.\n",
        issue_table(result),
    ]
    rows = result["rows"]
    if "single_sync" in rows:
        ph = rows["single_sync"]["phases"]["c1"]
        out.append(_cpu_table(rows["single_sync"]["title"], {"c=1": ph}, "cpu_us_per_request"))
    if "single_async" in rows:
        out.append(
            _cpu_table(
                rows["single_async"]["title"],
                {k.replace("c", "c="): v for k, v in rows["single_async"]["phases"].items()},
                "cpu_us_per_request",
            )
        )
    if "https_rtt" in rows:
        row = rows["https_rtt"]
        lines = [f"**{row['title']}**\n"]
        headers = [
            "phase",
            "variant",
            "ours async ÷ this, req/s",
            "ours async ÷ this, CPU",
            "req/s",
            "CPU us/req",
            "p50 ms",
            "p95 ms",
            "conns (server)",
        ]
        body = []
        for phase, ph in row["phases"].items():
            for v, s in ph["summary"].items():
                body.append(
                    [
                        phase,
                        _label(v),
                        f"{ph['ours_req_per_s_over_peer'][v]:.2f}x",
                        f"{ph['ours_over_peer'][v]:.2f}x",
                        s["req_per_s"],
                        s["cpu_us_per_request"],
                        s["p50_ms"],
                        s["p95_ms"],
                        s["connections_opened_server"],
                    ]
                )
        lines.append(h.markdown_table(headers, body))
        out.append("\n".join(lines) + "\n")
    if "batch_sync" in rows:
        out.append(
            _cpu_table(
                rows["batch_sync"]["title"],
                {k.replace("batch", "batch "): v for k, v in rows["batch_sync"]["phases"].items()},
                "cpu_us_per_text",
            )
        )
    if "bulk" in rows:
        row = rows["bulk"]
        ph = row["phases"]["bulk"]
        lines = [f"**{row['title']}**\n"]
        for name, pr in ph["pairs"].items():
            lines.append(
                f"- {name}: {_label(pr['ours'])} vs {_label(pr['peer'])}: "
                f"**{pr['texts_per_s']:.2f}x texts/s**, "
                f"{pr['cpu_per_text_peer_over_ours']:.2f}x less CPU per text, "
                f"peak RSS {pr['peak_rss_ours_over_peer']:.2f}x"
            )
        lines.append("")
        headers = [
            "variant",
            "texts/s",
            "CPU us/text",
            "peak RSS MiB",
            "RSS before MiB",
            "wall s",
            "conns (server)",
        ]
        body = [
            [
                _label(v),
                s["texts_per_s"],
                s["cpu_us_per_text"],
                s["peak_rss_mib"],
                s["peak_rss_before_mib"],
                s["wall_s"],
                s["connections_opened_server"],
            ]
            for v, s in ph["summary"].items()
        ]
        lines.append(h.markdown_table(headers, body))
        out.append("\n".join(lines) + "\n")
    return "\n".join(out)


def _cpu_table(title: str, phases: dict[str, dict[str, Any]], metric: str) -> str:
    unit = "request" if metric.endswith("request") else "text"
    lines = [f"**{title}**\n"]
    for phase, ph in phases.items():
        ref = ph["reference"]
        peers = [v for v in ph["summary"] if v != ref]
        ratio_text = ", ".join(f"{ph['ours_over_peer'][v]:.2f}x {_label(v)}" for v in peers)
        lines.append(f"- {phase}: {_label(ref)} = {ratio_text} (CPU per {unit})")
    lines.append("")
    headers = ["phase", "variant", "ours ÷ this (CPU)", f"CPU us/{unit}", "req/s", "p50 ms"]
    body = []
    for phase, ph in phases.items():
        for v, s in ph["summary"].items():
            body.append(
                [
                    phase,
                    _label(v),
                    f"{ph['ours_over_peer'][v]:.2f}x",
                    s[metric],
                    s["req_per_s"],
                    s["p50_ms"],
                ]
            )
    lines.append(h.markdown_table(headers, body))
    return "\n".join(lines) + "\n"


# ============================================================================ main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI): ~1-2 minutes")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument("--json", dest="json_path", default=None, help="where to write JSON")
    parser.add_argument("--only", action="append", choices=ROWS, help="run only these rows")
    parser.add_argument("--texts", type=int, default=None, help="bulk row: texts (10,000)")
    parser.add_argument("--bulk-latency-ms", type=float, default=20.0)
    parser.add_argument("--rtt-ms", type=float, default=40.0)
    parser.add_argument("--markdown", default=None, help="also write the tables here")
    # internal: the bulk row's subprocess
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--base-url", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        bulk_worker(args.worker, args.base_url, args.model, args.texts)
        return {}
    rounds = args.rounds or (1 if args.quick else 3)
    selected = args.only or list(ROWS)
    result: dict[str, Any] = {
        "benchmark": "compare",
        "schema": "qwen-embed-compare/1",
        "command": h.command_line(),
        "quick": args.quick,
        "rounds": rounds,
        "environment": h.environment(),
        "http_library": p.HTTP_LIBRARY,
        "pool_limit": p.POOL_LIMIT,
        "rows": {},
    }
    started = time.perf_counter()
    if any(r in selected for r in ("single_sync", "single_async", "batch_sync")):
        with server() as srv:
            t = p.Target(srv.base_url, srv.model)
            for name, fn in (
                ("single_sync", row_single_sync),
                ("single_async", row_single_async),
                ("batch_sync", row_batch_sync),
            ):
                if name in selected:
                    print(f"row {name} ...", file=sys.stderr, flush=True)
                    result["rows"][name] = fn(t, rounds, args.quick)
    if "https_rtt" in selected:
        print("row https_rtt ...", file=sys.stderr, flush=True)
        result["rows"]["https_rtt"] = row_https_rtt(rounds, args.quick, args.rtt_ms)
    if "bulk" in selected:
        print("row bulk ...", file=sys.stderr, flush=True)
        result["rows"]["bulk"] = row_bulk(rounds, args.quick, args.texts, args.bulk_latency_ms)
    result["seconds"] = time.perf_counter() - started
    result["rows"] = {r: result["rows"][r] for r in ROWS if r in result["rows"]}
    out = Path(args.json_path) if args.json_path else RESULTS / "compare.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    text = render(result)
    if args.markdown:
        Path(args.markdown).write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {out} ({result['seconds']:.0f} s)", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
