"""Transport candidates for the library's core, measured side by side before choosing.

Async (``--part async``): client CPU per single-text request at concurrency 1, 16 and 128,
over HTTP and HTTPS (loopback, no emulated RTT: this isolates the client), of

- ``ours_async``: ``AsyncEmbeddingClient.embed_query`` as it is today (the reference point);
- ``httpx_async``: raw ``httpx.AsyncClient.post`` (httpx2 under openai 3.x), defaults;
- ``httpx_async_tuned``: the same, ``trust_env=False``, pre-built ``URL`` and ``Headers``;
- ``httpx_async_transport``: ``AsyncHTTPTransport.handle_async_request`` directly (no
  ``AsyncClient``: what the transport itself costs);
- ``httpx_aiohttp``: ``AsyncClient(transport=httpx_aiohttp AiohttpTransport)`` (what
  ``openai.DefaultAioHttpClient`` is);
- ``aiohttp``: raw ``aiohttp.ClientSession.post`` + ``read()``;
- ``aiohttp_trace``: + a ``TraceConfig`` counting connections opened;
- ``aiohttp_guarded``: + a per-request ``ClientTimeout`` and a streamed body with a cap;
- ``aiohttp_full``: both (the features the library needs);
- ``aiohttp_full_sockcount``: the same, connections counted by a ``socket_factory``
  instead of a ``TraceConfig`` (no per-request hook).

Sync (``--part sync``): client CPU per request at batch 1, 32 and 128, over HTTP and HTTPS,
of the transports alone (body bytes, no decode): ``httpx`` (``Client.post``),
``httpx_transport`` (``HTTPTransport.handle_request``), ``urllib3_pool``
(``HTTPConnectionPool``), ``urllib3_manager`` (``PoolManager``), ``stdlib``
(``http.client`` keep-alive); the stdlib with the decode to an array and to lists (the
floors of ``embed_documents_array`` / ``embed_documents``); and ours
(``embed_query`` at batch 1, ``embed_documents`` and ``embed_documents_array``).

Every variant sends the same bytes, returns lists of floats (async) or what is named
(sync), and runs once per round in a rotated order; medians over rounds. All pools: 20
connections. JSON to ``bench/results/transports.json``.

    python bench/transports.py [--quick] [--rounds N] [--part async|sync] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _harness as h  # noqa: E402
import _peers as p  # noqa: E402
from compare import check, queries, server  # noqa: E402

from qwen_embed_plugins._corpus import corpus  # noqa: E402

ASYNC_LEVELS = (1, 16, 128)
SYNC_BATCHES = (1, 32, 128)


def async_variants(t: p.Target) -> dict[str, tuple[Any, bool]]:
    """name -> ((call, aclose), takes the raw query); built inside the running loop."""
    return {
        "ours_async": (p.ours_async(t, "embed_query"), True),
        "httpx_async": (p.httpx_async(t), False),
        "httpx_async_tuned": (p.httpx_async(t, tuned=True), False),
        "httpx_async_transport": (p.httpx_async_transport(t), False),
        "httpx_aiohttp": (p.httpx_aiohttp(t), False),
        "aiohttp": (p.aiohttp_raw(t), False),
        "aiohttp_trace": (p.aiohttp_raw(t, trace=True), False),
        "aiohttp_guarded": (p.aiohttp_raw(t, guarded=True), False),
        "aiohttp_full": (p.aiohttp_raw(t, trace=True, guarded=True), False),
        "aiohttp_full_sockcount": (p.aiohttp_raw(t, sockcount=True, guarded=True), False),
    }


def part_async(t: p.Target, rounds: int, n: int) -> dict[str, Any]:
    pairs = queries(n)

    async def body() -> dict[str, Any]:
        from qwen_embed_plugins import aclose_all

        variants = async_variants(t)
        items = {v: [[raw if q else sent] for raw, sent in pairs] for v, (_, q) in variants.items()}
        for v, ((call, _), _q) in variants.items():
            check(v, await call(items[v][0]), pairs[0][1])
            await h.run_async(call, items[v][: 4 * p.POOL_LIMIT], p.POOL_LIMIT)
        runs: dict[int, dict[str, list[dict[str, float]]]] = {
            c: {v: [] for v in variants} for c in ASYNC_LEVELS
        }
        for r in range(rounds):
            for c in ASYNC_LEVELS:
                for v in h.rotated(list(variants), r):
                    runs[c][v].append((await h.run_async(variants[v][0][0], items[v], c)).to_dict())
        counted = {
            v: call.counter.opened
            for v, ((call, _), _q) in variants.items()
            if getattr(call, "counter", None) is not None
        }
        for (_, aclose), _q in variants.values():
            await aclose()
        await aclose_all()
        out: dict[str, Any] = {}
        for c in ASYNC_LEVELS:
            summary = {v: h.summarise(s) for v, s in runs[c].items()}
            ref = summary["aiohttp"]["cpu_us_per_request"]
            out[f"c{c}"] = {
                "summary": summary,
                "cpu_over_aiohttp": {v: s["cpu_us_per_request"] / ref for v, s in summary.items()},
                "runs": runs[c],
            }
        out["connections_counted_by_trace"] = counted
        return out

    return asyncio.run(body())


def part_sync(t: p.Target, rounds: int, n_by_batch: dict[int, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for batch in SYNC_BATCHES:
        n = n_by_batch[batch]
        texts = corpus(batch * (n + 2))
        batches = [texts[i * batch : (i + 1) * batch] for i in range(n + 2)]
        warm, batches = batches[:2], batches[2:]
        variants: dict[str, Any] = {
            "httpx": p.httpx_sync(t, p.decode_none),
            "httpx_transport": p.httpx_transport_sync(t, p.decode_none),
            "urllib3_pool": p.urllib3_pool(t, p.decode_none),
            "urllib3_manager": p.urllib3_manager(t, p.decode_none),
            "stdlib": p.stdlib_sync(t, p.decode_none),
            "stdlib_decode_array": p.stdlib_sync(t, p.decode_array),
            "stdlib_decode_list": p.stdlib_sync(t, p.decode_list),
            "ours_embed_documents_array": p.ours_sync(
                t, "embed_documents_array", batch_size=max(batch, 1)
            ),
            "ours_embed_documents": p.ours_sync(t, "embed_documents", batch_size=max(batch, 1)),
        }
        items: dict[str, list[list[str]]] = {v: batches for v in variants}
        if batch == 1:
            variants["ours_embed_query"] = p.ours_sync(t, "embed_query")
            pairs = queries(n)
            items = {v: [[sent] for _, sent in pairs] for v in variants}
            items["ours_embed_query"] = [[raw] for raw, _ in pairs]
            warm = [[pairs[0][1]]]
        for v, (call, _) in variants.items():
            for b in warm:
                res = call(b if v != "ours_embed_query" else [queries(1)[0][0]])
                if not isinstance(res, bytes):
                    check(v, res, b[0])
        runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
        for r in range(rounds):
            for v in h.rotated(list(variants), r):
                sample = h.run_sync(variants[v][0], items[v], texts_per_item=batch)
                runs[v].append(sample.to_dict())
        for _, close in variants.values():
            close()
        summary = {v: h.summarise(s) for v, s in runs.items()}
        ref = summary["stdlib"]["cpu_us_per_request"]
        out[f"batch{batch}"] = {
            "summary": summary,
            "cpu_over_stdlib_bytes": {v: s["cpu_us_per_request"] / ref for v, s in summary.items()},
            "runs": runs,
        }
    return out


def render(result: dict[str, Any]) -> str:
    out = [
        f"### Transport candidates ({'quick' if result['quick'] else 'full'} run)\n",
        f"`{result['command']}` — {result['rounds']} interleaved rounds, medians; "
        f"load average at start {result['environment']['load_avg_at_start']}.\n",
    ]
    for scheme, part in result.get("async", {}).items():
        levels = [k for k in part if k[1:].isdigit()]
        headers = ["variant"]
        headers += [f"÷ aiohttp, {k.replace('c', 'c=')}" for k in levels]
        headers += [f"CPU us/req, {k.replace('c', 'c=')}" for k in levels]
        body = []
        for v in part[levels[0]]["summary"]:
            row: list[Any] = [v]
            row += [f"{part[k]['cpu_over_aiohttp'][v]:.2f}x" for k in levels]
            row += [part[k]["summary"][v]["cpu_us_per_request"] for k in levels]
            body.append(row)
        out.append(f"**async, single text, {scheme}: client CPU per request**\n")
        out.append(h.markdown_table(headers, body) + "\n")
    for scheme, part in result.get("sync", {}).items():
        batches = list(part)
        headers = ["variant"]
        headers += [f"÷ stdlib bytes, {b.replace('batch', 'batch ')}" for b in batches]
        headers += [f"CPU us/req, {b.replace('batch', 'batch ')}" for b in batches]
        headers += [f"CPU us/text, {b.replace('batch', 'batch ')}" for b in batches[1:]]
        body = []
        for v in part[batches[-1]]["summary"]:
            row = [v]
            row += [
                f"{part[b]['cpu_over_stdlib_bytes'][v]:.2f}x" if v in part[b]["summary"] else "-"
                for b in batches
            ]
            row += [
                part[b]["summary"][v]["cpu_us_per_request"] if v in part[b]["summary"] else None
                for b in batches
            ]
            row += [part[b]["summary"][v]["cpu_us_per_text"] for b in batches[1:]]
            body.append(row)
        if "ours_embed_query" in part[batches[0]]["summary"]:
            s = part[batches[0]]
            body.append(
                ["ours_embed_query", f"{s['cpu_over_stdlib_bytes']['ours_embed_query']:.2f}x"]
                + ["-"] * (len(batches) - 1)
                + [s["summary"]["ours_embed_query"]["cpu_us_per_request"]]
                + [None] * (2 * len(batches) - 2)
            )
        out.append(f"**sync transports, {scheme}: client CPU per request (batch 1, 32, 128)**\n")
        out.append(h.markdown_table(headers, body) + "\n")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument("--part", action="append", choices=("async", "sync"))
    parser.add_argument("--scheme", action="append", choices=("http", "https"))
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    parts = args.part or ["async", "sync"]
    schemes = args.scheme or ["http", "https"]
    result: dict[str, Any] = {
        "benchmark": "transports",
        "command": h.command_line(),
        "quick": args.quick,
        "rounds": rounds,
        "environment": h.environment(),
        "http_library": p.HTTP_LIBRARY,
        "pool_limit": p.POOL_LIMIT,
    }
    started = time.perf_counter()
    for scheme in schemes:
        with server(tls=scheme == "https") as srv:
            if scheme == "https":
                t = p.Target(f"https://localhost:{srv.port}/v1", srv.model, srv.ca_cert_path)
            else:
                t = p.Target(srv.base_url, srv.model)
            if "async" in parts:
                print(f"async {scheme} ...", file=sys.stderr, flush=True)
                result.setdefault("async", {})[scheme] = part_async(
                    t, rounds, 96 if args.quick else 600
                )
            if "sync" in parts:
                print(f"sync {scheme} ...", file=sys.stderr, flush=True)
                sizes = {1: 400, 32: 100, 128: 40} if not args.quick else {1: 60, 32: 12, 128: 6}
                result.setdefault("sync", {})[scheme] = part_sync(t, rounds, sizes)
    result["seconds"] = time.perf_counter() - started
    out = Path(args.json_path) if args.json_path else HERE / "results" / "transports.json"
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
