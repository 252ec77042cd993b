"""Corpora: the one loader of ``qwen-embed embed``, ``qwen_embed_plugins.ray.embed_files``,
``qwen-embed bench`` / ``check`` and ``bench/``.

**Line files** (``qwen-embed embed``, ``qwen-embed bench --texts``): one record per line:
a text, or with a ``.jsonl`` / ``.ndjson`` suffix a JSON object with a ``"text"`` string
(and an optional ``"id"``, passed through). A line ends with ``\\n`` (a ``\\r`` before it
is dropped); a UTF-8 byte order mark at the start of the file is dropped. Blank records
(empty or whitespace-only text) are skipped and reported through ``on_blank``. The file is
read as bytes and each line decoded on its own, so an error names the file and the true
line of a bad byte, and the reader sees every byte in order: ``embed`` uses that to hash
exactly the bytes it embedded and to notice an input that changes while it runs
(``Fingerprint``).

**Dataset files** (``embed_files`` on Ray Data, ``qwen-embed embed --ray``): Parquet or
JSON Lines files, or folders of them, read by Ray Data itself; `dataset_files` resolves
the paths and tells the format from the suffixes, before Ray starts.

**The sample** (`corpus`): real English passages from ``pydoc_data.topics``, which ships
with every Python, so benchmarks, probes and tests have thousands of distinct texts of
realistic lengths at hand with no download.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import orjson

from .errors import ConfigError

__all__ = [
    "DATASET_FORMATS",
    "JSONL_SUFFIXES",
    "Fingerprint",
    "Record",
    "corpus",
    "dataset_files",
    "is_jsonl",
    "iter_records",
    "iter_texts",
    "load_texts",
    "new_digest",
]

JSONL_SUFFIXES: Final = (".jsonl", ".ndjson")
"""Suffixes of a line file read as JSON Lines (any other suffix: one text per line);
also the JSON Lines output suffixes of ``qwen-embed embed``."""
DATASET_FORMATS: Final = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".json": "jsonl",
}
"""Suffix -> format of a dataset file. Not `JSONL_SUFFIXES`: Ray Data's JSON reader
lists ``.json`` and ``.jsonl`` files of a folder (not ``.ndjson``), while a line file
named ``.json`` has always been read as text lines."""

_BOM = b"\xef\xbb\xbf"
_READ_BUFFER = 1 << 20  # bytes


def is_jsonl(path: str | Path) -> bool:
    """``path`` holds JSON lines (by its suffix: ``.jsonl`` or ``.ndjson``)."""
    return Path(path).suffix.lower() in JSONL_SUFFIXES


@dataclass(frozen=True, slots=True)
class Record:
    """One non-blank record of an input file.

    Attributes:
        line: its line number (1-based, as editors and ``grep -n`` count).
        text: the text (JSONL: the ``"text"`` field).
        id: the JSONL ``"id"`` field, or ``None``.
    """

    line: int
    text: str
    id: Any = None


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What identifies a file's state on disk: device, inode, size (bytes), mtime (ns)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Fingerprint:
        """The fingerprint of a ``stat`` result."""
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def change(self, now: Fingerprint) -> str | None:
        """What differs in ``now`` (for a message), or ``None`` when nothing does."""
        if (now.dev, now.ino) != (self.dev, self.ino):
            return "the file was replaced by another one"
        if now.size != self.size:
            return f"its size changed from {self.size:,} to {now.size:,} bytes"
        if now.mtime_ns != self.mtime_ns:
            return "it was modified (its modification time changed)"
        return None


def _decode(raw: bytes, path: Path, number: int) -> str:
    line = raw[:-1] if raw.endswith(b"\n") else raw
    if line.endswith(b"\r"):
        line = line[:-1]
    if number == 1 and line.startswith(_BOM):
        line = line[len(_BOM) :]
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = line[exc.start]
        raise ValueError(
            f"{path}:{number}: not UTF-8 text (byte 0x{bad:02x} at byte {exc.start + 1} of "
            f"the line: {exc.reason})"
        ) from None


def iter_records(
    path: str | Path,
    *,
    on_blank: Callable[[int], None] | None = None,
    digest: Any = None,
) -> Iterator[Record]:
    """Stream the non-blank records of ``path`` in order.

    Args:
        path: the input file.
        on_blank: called with the 1-based line number of each blank record skipped.
        digest: a ``hashlib`` object updated with every byte read, in order (so after
            the last record it holds the hash of the whole file).

    Raises:
        ValueError: a line is not UTF-8, or a JSONL line is not an object with a
            string ``"text"`` (the message names the file and line).
        OSError: the file cannot be read.
    """
    path = Path(path)
    jsonl = is_jsonl(path)
    with path.open("rb", buffering=_READ_BUFFER) as fh:
        for number, raw in enumerate(fh, start=1):
            if digest is not None:
                digest.update(raw)
            text = _decode(raw, path, number)
            ident = None
            if jsonl and text.strip():
                try:
                    obj = orjson.loads(text)
                except orjson.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not valid JSON: {exc}") from None
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    raise ValueError(f'{path}:{number}: expected an object with a "text" string')
                text = obj["text"]
                ident = obj.get("id")
            if not text.strip():
                if on_blank is not None:
                    on_blank(number)
                continue
            yield Record(number, text, ident)


def iter_texts(
    path: str | Path, *, on_blank: Callable[[int], None] | None = None
) -> Iterator[tuple[int, str, Any]]:
    """Stream ``(line_index, text, id)`` of the non-blank records of ``path``;
    ``line_index`` counts lines from 0 (line number - 1), ``on_blank`` gets it too.

    Raises:
        ValueError, OSError: see ``iter_records``.
    """
    blank = None if on_blank is None else (lambda number: on_blank(number - 1))
    for rec in iter_records(path, on_blank=blank):
        yield rec.line - 1, rec.text, rec.id


def load_texts(path: str | Path) -> list[str]:
    """All non-blank texts of ``path`` (see ``iter_records``), in order."""
    return [rec.text for rec in iter_records(path)]


def new_digest() -> Any:
    """The content hash ``embed`` keeps of its input (BLAKE2b, 16 bytes)."""
    return hashlib.blake2b(digest_size=16)


# --------------------------------------------------------------------------- dataset files


def dataset_files(
    input: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    input_format: str | None = None,
) -> tuple[list[str], str]:
    """The paths and the format of a dataset input, checked before Ray starts.

    Args:
        input: a file, a folder of files, or a list of them (local paths, or URIs such
            as ``s3://...`` that Ray can read on a cluster).
        input_format: ``"parquet"`` or ``"jsonl"``; ``None``: from the suffixes of the
            files (of a folder: of the files in it), which must all name one format.

    Returns:
        ``(paths, format)``: local paths made absolute (Ray's workers do not share the
        driver's current directory), URIs as given.

    Raises:
        ConfigError: no path, an unknown ``input_format``, URIs without
            ``input_format``, or suffixes naming no format or two.
        FileNotFoundError: a local path does not exist (the message lists them).
    """
    raw = [input] if isinstance(input, str | os.PathLike) else list(input)
    names = [os.fspath(p) for p in raw]
    paths = [p if "://" in p else os.path.abspath(p) for p in names]
    if not paths:
        raise ConfigError("embed_files: no input paths given")
    local = [p for p in paths if "://" not in p]
    missing = [p for p in local if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"input not found: {', '.join(missing)}")
    if input_format is None and len(local) != len(paths):
        raise ConfigError("embed_files: pass input_format= for URI inputs")
    if input_format is not None:
        if input_format not in ("parquet", "jsonl"):
            raise ConfigError(f"input_format must be 'parquet' or 'jsonl', got {input_format!r}")
        return paths, input_format
    found: set[str] = set()
    for path in paths:
        p = Path(path)
        files = [c for c in p.iterdir() if c.is_file()] if p.is_dir() else [p]
        found.update(
            DATASET_FORMATS[c.suffix.lower()] for c in files if c.suffix.lower() in DATASET_FORMATS
        )
    if len(found) != 1:
        raise ConfigError(
            f"cannot tell the input format of {paths} from the file names "
            "(.parquet, .jsonl, .json); pass input_format='parquet' or 'jsonl'"
        )
    return paths, found.pop()


# --------------------------------------------------------------------------- the sample

_WS = re.compile(r"\s+")
_PARAGRAPH = re.compile(r"\n\s*\n")
_SENTENCE = re.compile(r"(?<=[.!?:])\s+(?=[A-Z\"'(])")
_sample: list[str] | None = None


def _build_sample() -> list[str]:
    from pydoc_data.topics import topics

    seen: dict[str, None] = {}
    # 1. paragraphs of the Python language reference, as written
    for key in sorted(topics):
        for para in _PARAGRAPH.split(topics[key]):
            text = _WS.sub(" ", para).strip()
            if 40 <= len(text) <= 2000:
                seen.setdefault(text, None)
    # 2. overlapping windows of 2..10 consecutive sentences (how RAG chunkers cut text)
    flat = _WS.sub(" ", "\n\n".join(topics[k] for k in sorted(topics)))
    sentences = [s.strip() for s in _SENTENCE.split(flat) if len(s.strip()) >= 20]
    for width in range(2, 11):
        for start in range(0, len(sentences) - width + 1):
            text = " ".join(sentences[start : start + width])
            if len(text) <= 2000:
                seen.setdefault(text, None)
    return list(seen)


def corpus(n: int | None = None, *, unique: bool = False) -> list[str]:
    """Real English passages from ``pydoc_data.topics`` (ships with every Python).

    First the paragraphs of the language reference (about 1,600, median ~150
    characters), then overlapping windows of 2..10 consecutive sentences, all distinct
    and at most 2,000 characters: about 20,000 distinct texts in all.

    Args:
        n: how many texts (``None``: all of them). Beyond the distinct ones the list
            repeats from the start.
        unique: raise instead of repeating.

    Returns:
        ``n`` texts (a new list).

    Raises:
        ValueError: ``unique=True`` and fewer than ``n`` distinct texts exist.
    """
    global _sample
    if _sample is None:
        _sample = _build_sample()
    texts = _sample
    if n is None:
        return list(texts)
    if n > len(texts):
        if unique:
            raise ValueError(f"the corpus has {len(texts)} distinct texts, {n} asked")
        return [texts[i % len(texts)] for i in range(n)]
    return texts[:n]
