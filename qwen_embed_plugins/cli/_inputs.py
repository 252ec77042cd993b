"""The input reader of ``qwen-embed embed`` and ``qwen-embed bench --texts``.

An input file holds one record per line: a text, or with a ``.jsonl`` / ``.ndjson``
suffix a JSON object with a ``"text"`` string (and an optional ``"id"``, passed through).
A line ends with ``\\n`` (a ``\\r`` before it is dropped); a UTF-8 byte order mark at the
start of the file is dropped. Blank records (empty or whitespace-only text) are skipped
and reported through ``on_blank``.

The file is read as bytes and each line decoded on its own, so an error names the
true line (and column) of a bad byte, and the reader knows the byte offset of every
record: ``embed`` uses it to hash exactly the bytes it embedded and to notice an input
that changes while it runs (``Fingerprint``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

__all__ = [
    "Fingerprint",
    "Record",
    "is_jsonl",
    "iter_records",
    "iter_texts",
    "load_texts",
    "new_digest",
]

_BOM = b"\xef\xbb\xbf"
_READ_BUFFER = 1 << 20  # bytes


def is_jsonl(path: str | Path) -> bool:
    """``path`` holds JSON lines (by its suffix: ``.jsonl`` or ``.ndjson``)."""
    return Path(path).suffix.lower() in (".jsonl", ".ndjson")


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
