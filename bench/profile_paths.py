"""Where a request's client CPU goes: profiles of the library's hot paths vs the floors.

Three views, each against the loopback server in a child process:

1. ``decode``: what turning a response body into vectors costs, per text, measured with
   ``timeit`` on real bodies (batch 1 / 32 / 128, 1,024-dim base64): ``orjson.loads``,
   ``base64.b64decode`` of every vector, joining them + ``numpy.frombuffer`` (the array),
   the float64 squared norms (``einsum``) + the finite / zero check the library does,
   the renormalisation, and ``ndarray.tolist()`` (the lists LangChain / LlamaIndex want).
   ``pybase64.b64decode`` is measured too when installed (the ``bench`` extra).
2. ``cprofile``: deterministic profiles of N calls of ``EmbeddingClient.embed_query`` /
   ``embed_documents`` of 32 / ``embed_documents_array`` of 128, raw httpx (httpx2) and
   the stdlib, and of ``AsyncEmbeddingClient.embed_query`` at concurrency 16 vs raw httpx
   async and raw aiohttp: Python function calls per request, and self CPU time per
   request grouped by package. The profiler's clock is ``time.thread_time`` (CPU time of
   the calling thread: every workload here runs on one thread), so time the thread
   spends waiting for the server, or preempted by it on a loaded machine, is not
   counted; a wall-clock profile (cProfile's default, or a sampler such as pyinstrument)
   books that wait on ``socket.send``/``recv`` and misleads. cProfile inflates call-heavy
   code; read the call counts and the shares, not the absolute times.

    python bench/profile_paths.py [--quick] [--json PATH] [--top N]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import cProfile
import json
import pstats
import sys
import time
import timeit
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _harness as h  # noqa: E402
import _peers as p  # noqa: E402
from compare import check, queries, server  # noqa: E402

from qwen_embed_plugins._corpus import corpus  # noqa: E402


def group_of(filename: str, name: str) -> str:
    """A package-level bucket for a profiled function."""
    f = filename.replace("\\", "/")
    if filename == "~" or filename.startswith("<"):
        n = name
        if any(w in n for w in ("recv_into", "'recv'", "select", "poll", "acquire")):
            return "socket recv / select / lock (C)"
        if "tolist" in n:
            return "numpy: tolist"
        if "orjson" in n or "loads" in n or "dumps" in n:
            return "orjson"
        if "a2b_base64" in n or "b2a_base64" in n:
            return "base64 (C)"
        if "numpy" in n or "einsum" in n or "ndarray" in n or "frombuffer" in n:
            return "numpy (C)"
        if "ssl" in n.lower() or "_SSLSocket" in n:
            return "ssl (C)"
        if "socket" in n or "sendall" in n or "'send'" in n:
            return "socket send (C)"
        return "builtins"
    for key in (
        "qwen_embed_plugins/",
        "httpx2/",
        "httpcore2/",
        "httpx/",
        "httpcore/",
        "h11/",
        "h2/",
        "anyio/",
        "sniffio/",
        "aiohttp/",
        "yarl/",
        "multidict/",
        "openai/",
        "numpy/",
        "urllib3/",
        "asyncio/",
        "concurrent/",
    ):
        if key in f:
            mod = f.split(key, 1)[1].rsplit(".", 1)[0].replace("/", ".")
            top = key.rstrip("/")
            if top == "qwen_embed_plugins":
                return f"qwen_embed_plugins.{mod}"
            return top
    base = f.rsplit("/", 1)[-1]
    if base in ("ssl.py", "socket.py", "selectors.py"):
        return f"stdlib {base[:-3]}"
    if "http/client.py" in f:
        return "stdlib http.client"
    if base == "base64.py":
        return "base64"
    if "/bench/" in f:
        return "benchmark loop"
    return f"stdlib/other ({base})"


# ============================================================================ decode


def _time_per_text(
    steps: dict[str, Callable[[], Any]],
    batch: int,
    quick: bool,
    pairs: dict[str, tuple[str, str]] | None = None,
    repeats: int | None = None,
) -> dict[str, float]:
    """Microseconds per text of each step: the best of ``repeats`` ``timeit`` runs, the
    steps interleaved (every repeat times each step once, in a rotated order), so load
    from other processes hits all steps alike. ``pairs``: ``name -> (a, b)`` adds the
    median over repeats of ``time(a) / time(b)`` measured in the same repeat (robust on a
    loaded machine, where the best-of times of separate steps drift)."""
    repeats = repeats or (5 if quick else 21)
    number = max(3, (1000 if quick else 8000) // (batch * 10))
    samples: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(repeats):
        for name in h.rotated(names, r):
            samples[name].append(timeit.timeit(steps[name], number=number))
    out = {name: min(samples[name]) / number / batch * 1e6 for name in names}
    for label, (a, b) in (pairs or {}).items():
        out[label] = h.median(x / y for x, y in zip(samples[a], samples[b], strict=True))
    return out


def _decode_steps(raw: bytes, batch: int, pyb64: Any) -> dict[str, Callable[[], Any]]:
    data = orjson.loads(raw)["data"]
    vecs = [base64.b64decode(d["embedding"]) for d in data]
    arr = np.frombuffer(b"".join(vecs), dtype="<f4").reshape(batch, -1)
    steps: dict[str, Callable[[], Any]] = {
        "orjson.loads(body)": lambda: orjson.loads(raw),
        "b64decode every vector": lambda: [base64.b64decode(d["embedding"]) for d in data],
        "a2b_base64(strict_mode=True) every vector": lambda: [
            binascii.a2b_base64(d["embedding"], strict_mode=True) for d in data
        ],
        "join + frombuffer + reshape": lambda: np.frombuffer(b"".join(vecs), dtype="<f4").reshape(
            batch, -1
        ),
        "np.empty + row copies (float32)": lambda: _row_copies(vecs, batch),
        "squared norms, float64 einsum": lambda: _sq_norms(arr),
        "finite + zero check on norms": lambda: _finite_check(_sq_norms(arr)),
        "renormalise rows (divide)": lambda: arr / np.sqrt(_sq_norms(arr))[:, None],
        "ndarray.tolist()": lambda: arr.tolist(),
    }
    if pyb64 is not None:
        steps["pybase64.b64decode every vector"] = lambda: [pyb64(d["embedding"]) for d in data]
    return steps


def decode_costs(t: p.Target, quick: bool) -> dict[str, Any]:
    """Per-text microseconds of each decode step, on real response bodies."""
    call, close = p.stdlib_sync(t, p.decode_none)
    try:
        from pybase64 import b64decode as pyb64
    except ImportError:
        pyb64 = None
    out: dict[str, Any] = {}
    for batch in (1, 32, 128):
        raw = call(corpus(batch))
        pairs = {
            "ratio: tolist / b64decode (paired)": ("ndarray.tolist()", "b64decode every vector")
        }
        if pyb64 is not None:
            pairs["ratio: pybase64 / b64decode (paired)"] = (
                "pybase64.b64decode every vector",
                "b64decode every vector",
            )
        row = _time_per_text(_decode_steps(raw, batch, pyb64), batch, quick, pairs)
        row["body bytes per text"] = len(raw) / batch
        out[f"batch{batch}"] = row
    close()
    return out


def _row_copies(vecs: list[bytes], n: int) -> np.ndarray:
    arr = np.empty((n, len(vecs[0]) // 4), dtype=np.float32)
    for i, v in enumerate(vecs):
        arr[i] = np.frombuffer(v, dtype="<f4")
    return arr


def _sq_norms(arr: np.ndarray) -> np.ndarray:
    a64 = arr.astype(np.float64)
    return np.einsum("ij,ij->i", a64, a64)


def _finite_check(sq: np.ndarray) -> bool:
    return bool(np.isfinite(sq).all() and (sq > 0).all())


def _library_steps(lib: dict[str, Any], texts: list[str], raw: bytes) -> dict[str, Any]:
    batch = len(texts)
    idx = list(range(batch))
    arr, sq = lib["decode_checked"](lib["parse_body"](raw), idx)
    return {
        "validate_texts": lambda: lib["validate_texts"](texts, max_chars=262_144),
        "plan_batches": lambda: lib["plan_batches"](texts, 128),
        "encode_request (orjson.dumps)": lambda: lib["encode_request"](
            texts, model="m", encoding_format="base64"
        ),
        "parse_body (orjson.loads)": lambda: lib["parse_body"](raw),
        "parse_body + decode_checked": lambda: lib["decode_checked"](lib["parse_body"](raw), idx),
        "normalize_rows (given norms)": lambda: lib["normalize_rows"](arr, squared_norms=sq),
        "tolist": lambda: arr.tolist(),
        "floor decode (b64decode+join+frombuffer)": lambda: p.decode_array(raw, batch),
    }


def library_steps(t: p.Target, quick: bool) -> dict[str, Any]:
    """Per-text microseconds of today's library steps (``qwen_embed_plugins._protocol``,
    ``_batching.plan_batches``) on real bodies, with ``timeit``. These are internals:
    when their names or signatures change, this section records why it was skipped
    instead of failing."""
    try:
        from qwen_embed_plugins import _batching as batching
        from qwen_embed_plugins import _protocol as protocol
    except ImportError as exc:
        return {"skipped": f"internals moved: {exc}"}
    names = (
        "decode_checked",
        "encode_request",
        "normalize_rows",
        "parse_body",
        "validate_texts",
    )
    missing = [n for n in names if not hasattr(protocol, n)]
    if not hasattr(batching, "plan_batches"):
        missing.append("plan_batches")
    if missing:
        return {"skipped": f"internals moved: {', '.join(missing)}"}
    lib = {n: getattr(protocol, n) for n in names}
    lib["plan_batches"] = batching.plan_batches
    call, close = p.stdlib_sync(t, p.decode_none)
    out: dict[str, Any] = {}
    try:
        for batch in (1, 32, 128):
            texts = corpus(batch)
            steps = _library_steps(lib, texts, call(texts))
            out[f"batch{batch}"] = _time_per_text(
                steps,
                batch,
                quick,
                {
                    "ratio: decode_checked path / floor decode (paired)": (
                        "parse_body + decode_checked",
                        "floor decode (b64decode+join+frombuffer)",
                    )
                },
            )
    except (TypeError, ValueError) as exc:
        return {"skipped": f"internals changed: {exc}"}
    finally:
        close()
    return out


# ============================================================================ workloads


Workload = tuple[Callable[[list[str]], Any], Callable[[], None], int, bool]


def sync_workloads(t: p.Target) -> dict[str, Workload]:
    """name -> (call, close, batch, raw query?)"""
    return {
        "ours embed_query": (*p.ours_sync(t, "embed_query"), 1, True),
        f"raw {p.HTTP_LIBRARY} (1 text)": (*p.httpx_sync(t), 1, False),
        "stdlib (1 text)": (*p.stdlib_sync(t), 1, False),
        "ours embed_documents (32)": (*p.ours_sync(t, "embed_documents"), 32, False),
        f"raw {p.HTTP_LIBRARY} (32, lists)": (*p.httpx_sync(t), 32, False),
        "stdlib (32, lists)": (*p.stdlib_sync(t), 32, False),
        "ours embed_documents_array (128)": (
            *p.ours_sync(t, "embed_documents_array", batch_size=128),
            128,
            False,
        ),
        "stdlib (128, array)": (*p.stdlib_sync(t, p.decode_array), 128, False),
    }


def _items(batch: int, raw_query: bool, n: int) -> list[list[str]]:
    if batch == 1:
        return [[raw if raw_query else sent] for raw, sent in queries(n)]
    texts = corpus(batch * n)
    return [texts[i * batch : (i + 1) * batch] for i in range(n)]


def cprofile_sync(t: p.Target, n: int, top: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (call, close, batch, rq) in sync_workloads(t).items():
        count = max(10, n // max(1, batch // 8))
        items = _items(batch, rq, count)
        for it in items[:3]:
            call(it)
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        for it in items:
            call(it)
        prof.disable()
        close()
        out[name] = _digest(pstats.Stats(prof), count, top)
    return out


def cprofile_async(t: p.Target, n: int, top: int) -> dict[str, Any]:
    out: dict[str, Any] = {}

    async def body() -> None:
        from qwen_embed_plugins import aclose_all

        pairs = queries(n)
        for name, (factory, rq) in {
            "ours async embed_query (c=16)": (lambda: p.ours_async(t, "embed_query"), True),
            f"raw {p.HTTP_LIBRARY} async (c=16)": (lambda: p.httpx_async(t), False),
            "raw aiohttp (c=16)": (lambda: p.aiohttp_raw(t), False),
        }.items():
            call, aclose = factory()
            items = [[raw if rq else sent] for raw, sent in pairs]
            check(name, await call(items[0]), pairs[0][1])
            await h.run_async(call, items[:64], 16)
            prof = cProfile.Profile(time.thread_time)
            prof.enable()
            await h.run_async(call, items, 16, collect=False)
            prof.disable()
            await aclose()
            out[name] = _digest(pstats.Stats(prof), len(items), top)
        await aclose_all()

    asyncio.run(body())
    return out


def _attributed_group(key: tuple[str, int, str], stats: dict[Any, Any]) -> dict[str, float]:
    """Self time of ``key`` split by group: a C builtin's time goes to its callers' groups
    (pstats keeps, per caller, the callee time spent on behalf of that caller)."""
    filename, _line, fname = key
    _cc, _nc, tt, _ct, callers = stats[key]
    own = group_of(filename, fname)
    if not (filename == "~" or filename.startswith("<")) or not callers:
        return {own: tt}
    out: dict[str, float] = defaultdict(float)
    total = sum(v[2] for v in callers.values()) or 1.0
    for caller, v in callers.items():
        cg = group_of(caller[0], caller[2])
        # keep the C functions that are the work itself under their own name
        if own in ("base64 (C)", "numpy: tolist", "orjson", "socket send (C)", "ssl (C)") or (
            own.startswith("socket recv")
        ):
            cg = own
        elif cg == "base64":
            cg = "base64 (C)"
        out[cg] += tt * v[2] / total
    return out


def _digest(stats: pstats.Stats, count: int, top: int) -> dict[str, Any]:
    raw = stats.stats  # type: ignore[attr-defined]
    groups: dict[str, float] = defaultdict(float)
    attributed: dict[str, float] = defaultdict(float)
    funcs = []
    total_calls = 0
    for key, (_cc, nc, tt, _ct, _callers) in raw.items():
        filename, line, fname = key
        total_calls += nc
        g = group_of(filename, fname)
        groups[g] += tt
        for ag, v in _attributed_group(key, raw).items():
            attributed[ag] += v
        funcs.append((tt, nc, g, f"{Path(filename).name}:{line}:{fname}"))
    busy = sum(groups.values())
    funcs.sort(reverse=True)
    library = sum(v for k, v in attributed.items() if k.startswith("qwen_embed_plugins"))
    return {
        "requests": count,
        "python_calls_per_request": total_calls / count,
        "busy_us_per_request": busy * 1e6 / count,
        "library_share": library / busy if busy else 0.0,
        "groups_us_per_request": {
            k: v * 1e6 / count for k, v in sorted(groups.items(), key=lambda kv: -kv[1])
        },
        "groups_share_of_busy": {
            k: v / busy for k, v in sorted(groups.items(), key=lambda kv: -kv[1])
        },
        "attributed_share_of_busy": {
            k: v / busy for k, v in sorted(attributed.items(), key=lambda kv: -kv[1])
        },
        "top_self": [
            {
                "function": f,
                "group": g,
                "self_us_per_request": tt * 1e6 / count,
                "calls_per_request": nc / count,
            }
            for tt, nc, g, f in funcs
        ][:top],
        "top_library": [
            {
                "function": f,
                "self_us_per_request": tt * 1e6 / count,
                "calls_per_request": nc / count,
            }
            for tt, nc, g, f in funcs
            if g.startswith("qwen_embed_plugins")
        ][:top],
    }


# ============================================================================ report


def render(result: dict[str, Any], top: int) -> str:
    lines = [f"### Profiles (`{result['command']}`)\n"]
    dec = result["decode"]
    steps = [k for k in dec["batch1"] if k != "body bytes per text"]
    lines.append(
        "**decode steps, us per text (timeit, best of 21, steps interleaved; "
        "ratios: paired medians)**\n"
    )
    lines.append(
        h.markdown_table(
            ["step", "batch 1", "batch 32", "batch 128"],
            [[s] + [dec[b][s] for b in ("batch1", "batch32", "batch128")] for s in steps],
        )
    )
    lines.append("")
    lib = result.get("library_steps", {})
    if lib and "skipped" not in lib:
        names = list(lib["batch1"])
        lines.append("**today's library steps, us per text (timeit on real bodies)**\n")
        lines.append(
            h.markdown_table(
                ["step", "batch 1", "batch 32", "batch 128"],
                [[s] + [lib[b][s] for b in ("batch1", "batch32", "batch128")] for s in names],
            )
        )
        lines.append("")
    elif lib:
        lines.append(f"library steps: {lib['skipped']}\n")
    lines.append("**cProfile (thread CPU clock): calls and CPU per request, by package**\n")
    for name, d in result["cprofile"].items():
        groups = ", ".join(
            f"{g} {v * 100:.0f}%"
            for g, v in list(d["attributed_share_of_busy"].items())[:9]
            if v >= 0.01
        )
        lines.append(
            f"- {name}: {d['python_calls_per_request']:.0f} Python calls/request, "
            f"{d['busy_us_per_request']:.0f} us CPU/request under the profiler; "
            f"qwen_embed_plugins {d['library_share'] * 100:.0f}%; {groups}"
        )
    lines.append("")
    for name, d in result["cprofile"].items():
        if not name.startswith("ours") and "aiohttp" not in name:
            continue
        lines.append(f"**top self CPU time, {name} (cProfile, us/request)**\n")
        lines.append(
            h.markdown_table(
                ["function", "group", "self us/req", "calls/req"],
                [
                    [f["function"], f["group"], f["self_us_per_request"], f["calls_per_request"]]
                    for f in d["top_self"][:top]
                ],
            )
        )
        lines.append("")
        if d.get("top_library"):
            lines.append(f"**the library's own functions, {name} (cProfile, us/request)**\n")
            lines.append(
                h.markdown_table(
                    ["function", "self us/req", "calls/req"],
                    [
                        [f["function"], f["self_us_per_request"], f["calls_per_request"]]
                        for f in d["top_library"][:top]
                    ],
                )
            )
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args(argv)
    n = args.requests or (100 if args.quick else 1000)
    result: dict[str, Any] = {
        "benchmark": "profile_paths",
        "command": h.command_line(),
        "environment": h.environment(),
        "http_library": p.HTTP_LIBRARY,
    }
    started = time.perf_counter()
    with server() as srv:
        t = p.Target(srv.base_url, srv.model)
        print("decode ...", file=sys.stderr, flush=True)
        result["decode"] = decode_costs(t, args.quick)
        print("library steps ...", file=sys.stderr, flush=True)
        result["library_steps"] = library_steps(t, args.quick)
        print("cprofile ...", file=sys.stderr, flush=True)
        result["cprofile"] = cprofile_sync(t, n, args.top)
        print("cprofile async ...", file=sys.stderr, flush=True)
        result["cprofile"].update(cprofile_async(t, n, args.top))
    result["seconds"] = time.perf_counter() - started
    out = Path(args.json_path) if args.json_path else HERE / "results" / "profile_paths.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    text = render(result, args.top)
    if args.markdown:
        Path(args.markdown).write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {out} ({result['seconds']:.0f} s)", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
