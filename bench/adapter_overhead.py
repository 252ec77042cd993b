"""What each adapter adds per query over the core client: client CPU per query, side by side.

One query at a time, sync, against the loopback ``EmbeddingServer`` (HTTP/1.1, in a child
process, 1,024-dim vectors), every variant on the same warm pool:

- ``core``: ``EmbeddingClient.embed_query``;
- ``langchain``: ``QwenPooledEmbeddings.embed_query``;
- ``llama_index``: ``QwenPooledEmbedding.get_query_embedding`` (LlamaIndex's base method:
  dispatcher span and events, callback manager, ``to_payload``, then our hook);
- ``llama_index_hook``: ``QwenPooledEmbedding._get_query_embedding`` (our hook, with the
  instrumentation span LlamaIndex wraps every subclass's hook in, without the base
  method around it);
- ``llama_index_bare``: a minimal ``BaseEmbedding`` subclass whose hooks call the core
  client and nothing else: LlamaIndex's own per-query cost, so ``llama_index`` minus
  ``llama_index_bare`` is what our adapter adds.

Client CPU is ``getrusage`` user + system of this process around the measured loop;
variants run in an order rotated each round; medians over rounds, and each variant's
median per-round ratio to ``core``. ``--profile VARIANT`` prints a cProfile of that
variant's loop instead (cumulative time, top 40).

    python bench/adapter_overhead.py [--rounds 7] [--queries 300] [--profile llama_index]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import cpu_seconds, rotated  # noqa: E402

VARIANTS = ("core", "langchain", "llama_index", "llama_index_hook", "llama_index_bare")


def variants(base_url: str, model: str) -> dict[str, Callable[[str], Any]]:
    from qwen_embed_plugins import EmbeddingClient, QwenPooledEmbedding, QwenPooledEmbeddings

    core = EmbeddingClient(base_url=base_url, model=model)
    lc = QwenPooledEmbeddings(base_url=base_url, model=model)
    li = QwenPooledEmbedding(base_url=base_url, model_name=model)
    bare = _bare_llama_index(core)
    return {
        "core": core.embed_query,
        "langchain": lc.embed_query,
        "llama_index": li.get_query_embedding,
        "llama_index_hook": li._get_query_embedding,  # our own hook (this package's)
        "llama_index_bare": bare.get_query_embedding,
    }


def _bare_llama_index(core: Any) -> Any:
    """A ``BaseEmbedding`` whose four hooks call ``core`` directly (no adapter)."""
    from llama_index.core.base.embeddings.base import BaseEmbedding

    class Bare(BaseEmbedding):
        def _get_query_embedding(self, query: str) -> list[float]:
            return core.embed_query(query)  # type: ignore[no-any-return]

        def _get_text_embedding(self, text: str) -> list[float]:
            return core.embed_documents([text])[0]  # type: ignore[no-any-return]

        async def _aget_query_embedding(self, query: str) -> list[float]:
            raise NotImplementedError

    return Bare(model_name="bare")


def loop(fn: Callable[[str], Any], texts: list[str]) -> float:
    """CPU microseconds per query of ``fn`` over ``texts``."""
    cpu0 = cpu_seconds()
    for t in texts:
        fn(t)
    return (cpu_seconds() - cpu0) * 1e6 / len(texts)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--profile", choices=VARIANTS, default=None)
    args = parser.parse_args(argv)

    from qwen_embed_tooling.testing import EmbeddingServer

    texts = [f"which passage answers question number {i}?" for i in range(args.queries)]
    with EmbeddingServer(process=True) as srv:
        fns = variants(srv.base_url, srv.model)
        for fn in fns.values():  # warm every path (imports, pool, dialect)
            for t in texts[:20]:
                fn(t)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for t in texts:
                fns[args.profile](t)
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
            return {}
        runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            for v in rotated(list(VARIANTS), r):
                runs[v].append(loop(fns[v], texts))
    med = {v: statistics.median(x) for v, x in runs.items()}
    ratio = {
        v: statistics.median(a / b for a, b in zip(runs[v], runs["core"], strict=True))
        for v in VARIANTS
    }
    print(
        f"client CPU per query, sync, one at a time, {args.queries} queries x "
        f"{args.rounds} rounds (medians)\n"
    )
    print("| variant | CPU us/query | / core | + us over core |")
    print("| --- | ---: | ---: | ---: |")
    for v in VARIANTS:
        print(f"| {v} | {med[v]:.0f} | {ratio[v]:.2f}x | {med[v] - med['core']:+.0f} |")
    return {"runs": runs, "median": med, "ratio": ratio}


if __name__ == "__main__":
    main()
