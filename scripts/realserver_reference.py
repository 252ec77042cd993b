"""Local sentence-transformers reference vectors for the models the real server serves.

Runs INSIDE the Infinity venv made by ``scripts/realserver.py`` (torch and
sentence-transformers live there, never in the project's venvs); start it through
``python scripts/realserver.py reference --input JOBS.json --out DIR``, which passes the
model folders. The project's tests compare the server's vectors, received through the
project's client, against these files.

``JOBS.json``::

    {"jobs": [
        {"name": "qwen_docs", "model": "qwen", "texts": ["..."]},
        {"name": "qwen_queries", "model": "qwen", "texts": ["..."], "prompt_name": "query"},
        {"name": "minilm_docs", "model": "minilm", "texts": ["..."]}
    ]}

For each job it writes ``DIR/NAME.npy`` (float32, shape (len(texts), dim)): exactly
``SentenceTransformer(model_dir).encode(texts, prompt_name=...)``, normalised as the
model's own ``Normalize`` module does (MiniLM's pipeline normalises too). It also writes
``DIR/reference.json`` with the versions used.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--qwen-model", required=True)
    parser.add_argument("--minilm-model", required=True)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    import numpy as np
    import sentence_transformers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(0)
    jobs = json.loads(args.input.read_text(encoding="utf-8"))["jobs"]
    paths = {"qwen": args.qwen_model, "minilm": args.minilm_model}
    models: dict[str, SentenceTransformer] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {
        "torch": torch.__version__,
        "sentence_transformers": sentence_transformers.__version__,
        "transformers": transformers.__version__,
        "jobs": {},
    }
    for job in jobs:
        key = job["model"]
        if key not in models:
            models[key] = SentenceTransformer(
                paths.get(key, key), device="cpu", local_files_only=True
            )
        kwargs = {}
        if job.get("prompt_name"):
            kwargs["prompt_name"] = job["prompt_name"]
        vectors = models[key].encode(
            list(job["texts"]),
            batch_size=args.batch_size,
            convert_to_numpy=True,
            show_progress_bar=False,
            **kwargs,
        )
        vectors = np.asarray(vectors, dtype=np.float32)
        np.save(args.out / f"{job['name']}.npy", vectors)
        summary["jobs"][job["name"]] = {
            "model": key,
            "shape": list(vectors.shape),
            "prompt_name": job.get("prompt_name"),
        }
    (args.out / "reference.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
