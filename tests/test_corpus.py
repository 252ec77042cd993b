"""The corpus loader (``qwen_embed_plugins._corpus``): what makes a dataset input of
``embed_files`` (the Ray job's files), checked before Ray starts, and the one sample
of real text that the CLI's probes and ``bench/`` share."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from qwen_embed_plugins import ConfigError
from qwen_embed_plugins._corpus import DATASET_FORMATS, JSONL_SUFFIXES, corpus, dataset_files

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_a_folder_or_files_of_one_format_resolve_to_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.parquet").write_bytes(b"")
    (folder / "b.pq").write_bytes(b"")
    (folder / "README").write_text("not data", encoding="utf-8")  # no suffix: ignored
    monkeypatch.chdir(tmp_path)
    assert dataset_files("corpus") == ([str(folder)], "parquet")
    (tmp_path / "x.json").write_text("{}\n", encoding="utf-8")
    (tmp_path / "y.jsonl").write_text("{}\n", encoding="utf-8")
    assert dataset_files(["x.json", Path("y.jsonl")]) == (
        [str(tmp_path / "x.json"), str(tmp_path / "y.jsonl")],
        "jsonl",
    )
    assert dataset_files("x.json", "parquet") == ([str(tmp_path / "x.json")], "parquet")


def test_bad_dataset_inputs_are_named(tmp_path: Path) -> None:
    (tmp_path / "a.parquet").write_bytes(b"")
    (tmp_path / "b.jsonl").write_text("{}\n", encoding="utf-8")
    (tmp_path / "c.ndjson").write_text("{}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="no input paths"):
        dataset_files([])
    with pytest.raises(FileNotFoundError, match=r"gone\.parquet"):
        dataset_files([tmp_path / "a.parquet", tmp_path / "gone.parquet"])
    with pytest.raises(ConfigError, match="cannot tell the input format"):
        dataset_files(tmp_path)  # two formats in one folder
    with pytest.raises(ConfigError, match="cannot tell the input format"):
        dataset_files(tmp_path / "c.ndjson")  # Ray Data's JSON reader skips .ndjson
    with pytest.raises(ConfigError, match="input_format= for URI inputs"):
        dataset_files("s3://bucket/corpus/")
    assert dataset_files("s3://bucket/corpus/", "jsonl") == (["s3://bucket/corpus/"], "jsonl")
    with pytest.raises(ConfigError, match="'parquet' or 'jsonl', got 'csv'"):
        dataset_files(tmp_path / "a.parquet", "csv")


def test_line_and_dataset_suffixes_differ_only_as_documented() -> None:
    jsonl = {s for s, f in DATASET_FORMATS.items() if f == "jsonl"}
    assert set(JSONL_SUFFIXES) - jsonl == {".ndjson"}
    assert jsonl - set(JSONL_SUFFIXES) == {".json"}


def test_the_sample_repeats_only_when_asked() -> None:
    everything = corpus()
    assert corpus(len(everything) + 2)[-2:] == everything[:2]
    with pytest.raises(ValueError, match="distinct texts"):
        corpus(len(everything) + 1, unique=True)


def test_bench_has_no_copy_of_the_loader() -> None:
    """``bench/`` takes its texts from the library: no bench module builds its own
    sample from ``pydoc_data`` (the copy that ``_harness.py`` held)."""
    copies = [
        path.name
        for path in sorted(BENCH.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pydoc_data")
    ]
    assert copies == []
