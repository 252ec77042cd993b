"""Real input text for benchmarks and probes: passages of Python's own documentation.

``pydoc_data.topics`` ships with every Python, so a first run on a fresh machine (and
every test) has thousands of distinct English passages of realistic lengths at hand,
with no download.
"""

from __future__ import annotations

import re

__all__ = ["corpus"]

_WS = re.compile(r"\s+")
_PARAGRAPH = re.compile(r"\n\s*\n")
_SENTENCE = re.compile(r"(?<=[.!?:])\s+(?=[A-Z\"'(])")
_cache: list[str] | None = None


def _build() -> list[str]:
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
    global _cache
    if _cache is None:
        _cache = _build()
    texts = _cache
    if n is None:
        return list(texts)
    if n > len(texts):
        if unique:
            raise ValueError(f"the corpus has {len(texts)} distinct texts, {n} asked")
        return [texts[i % len(texts)] for i in range(n)]
    return texts[:n]
