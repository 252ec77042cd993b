"""Float JSON vs base64 responses, for 1024-dimensional vectors.

Side by side in one run against the loopback server in a child process (plain HTTP):
``EmbeddingClient`` with ``encoding_format="float"`` vs ``"base64"``, and the openai SDK
(one shared ``openai.OpenAI``) with ``encoding_format="float"`` vs its default (base64,
decoded by the SDK). Batches of 1 and 32 texts, one request at a time, so the client
CPU per vector is clean. Response size per vector is measured on the wire (the body
length of the same request in each format). Medians of ``--repeats``.

    python bench/encoding.py [--quick] [--requests N] [--repeats R]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import openai
import orjson
from _common import command_line, environment, markdown_table, median, save

from qwen_embed_plugins import EmbeddingClient, close_all
from qwen_embed_plugins._corpus import corpus
from qwen_embed_plugins._transport._http import httpx
from qwen_embed_tooling.testing import EmbeddingServer

CLIENTS = ("ours_base64", "ours_float", "sdk_base64", "sdk_float")


def make(name: str, base_url: str, model: str) -> tuple[Callable[[list[str]], Any], Any]:
    if name.startswith("ours"):
        fmt = name.split("_")[1]
        client = EmbeddingClient(
            base_url=base_url, model=model, encoding_format=fmt, batch_size=2048
        )
        return client.embed_documents, close_all
    sdk = openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    if name == "sdk_float":

        def call(texts: list[str]) -> Any:
            resp = sdk.embeddings.create(input=texts, model=model, encoding_format="float")
            return [d.embedding for d in resp.data]
    else:

        def call(texts: list[str]) -> Any:
            resp = sdk.embeddings.create(input=texts, model=model)
            return [d.embedding for d in resp.data]

    return call, sdk.close


def measure(name: str, srv: Any, texts: list[str], batch: int, requests: int) -> dict[str, float]:
    call, close = make(name, srv.base_url, srv.model)
    chunks = [texts[(i * batch) % len(texts) :][:batch] for i in range(requests)]
    chunks = [c if len(c) == batch else texts[:batch] for c in chunks]
    for c in chunks[:3]:
        call(c)
    cpu0, t0 = time.process_time(), time.perf_counter()
    for c in chunks:
        out = call(c)
        assert len(out) == batch
        assert len(out[0]) == srv.dim
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    close()
    vectors = batch * requests
    return {
        "cpu_ms_per_vector": cpu * 1000 / vectors,
        "texts_per_s": vectors / wall,
        "ms_per_request": wall * 1000 / requests,
    }


def wire_bytes(srv: Any, texts: list[str], fmt: str) -> float:
    with httpx.Client() as client:
        body = orjson.dumps({"input": texts, "model": srv.model, "encoding_format": fmt})
        resp = client.post(
            f"{srv.base_url}/embeddings", content=body, headers={"Content-Type": "application/json"}
        )
        resp.raise_for_status()
        return len(resp.content) / len(texts)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, default=None, help="per client and batch")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    requests = args.requests or (30 if args.quick else 150)
    repeats = args.repeats or (1 if args.quick else 5)
    texts = corpus(2000)
    env = environment()
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    with EmbeddingServer(process=True, dim=1024) as srv:
        sizes = {fmt: wire_bytes(srv, texts[:32], fmt) for fmt in ("float", "base64")}
        for r in range(repeats):
            order = CLIENTS[r % 4 :] + CLIENTS[: r % 4]
            for batch in (1, 32):
                for name in order:
                    runs.setdefault(f"batch{batch}", {}).setdefault(name, []).append(
                        measure(
                            name,
                            srv,
                            texts,
                            batch,
                            requests if batch == 1 else max(5, requests // 4),
                        )
                    )
    summary = {
        phase: {name: {k: median([x[k] for x in rs]) for k in rs[0]} for name, rs in per.items()}
        for phase, per in runs.items()
    }
    out = {
        "benchmark": "encoding",
        "command": command_line(),
        "environment": env,
        "requests": requests,
        "repeats": repeats,
        "bytes_per_vector": sizes,
        "summary": summary,
        "runs": runs,
    }
    save("encoding", out, args.json_path)
    print(render(out))
    return out


def render(result: dict[str, Any]) -> str:
    sizes = result["bytes_per_vector"]
    rows = []
    for phase, per in result["summary"].items():
        base = per["ours_base64"]["cpu_ms_per_vector"]
        for name in CLIENTS:
            m = per[name]
            fmt = name.split("_")[1]
            rows.append(
                [
                    name,
                    phase.replace("batch", ""),
                    fmt,
                    sizes[fmt],
                    m["cpu_ms_per_vector"],
                    f"{m['cpu_ms_per_vector'] / base:.1f}x",
                    m["texts_per_s"],
                    m["ms_per_request"],
                ]
            )
    headers = [
        "client",
        "texts/request",
        "format",
        "bytes/vector",
        "client CPU ms/vector",
        "CPU vs ours_base64",
        "texts/s",
        "ms/request",
    ]
    ratio = sizes["float"] / sizes["base64"]
    return (
        f"### float JSON vs base64, 1024-dim vectors (median of {result['repeats']})\n\n"
        f"`{result['command']}`\n\nbase64 bodies are {ratio:.2f}x smaller than float "
        f"JSON ({sizes['base64']:,.0f} vs {sizes['float']:,.0f} bytes per vector).\n\n"
        + markdown_table(headers, rows)
        + "\n"
    )


if __name__ == "__main__":
    main()
