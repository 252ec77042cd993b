#!/usr/bin/env python3
"""``selects.py EXPR MARKER``: exit 0 if pytest's ``-m EXPR`` could select a test marked
``MARKER`` (alone, or also marked ``slow``), 1 if it cannot (scripts/test.sh: set up
Infinity and Chromium only when a selected test needs them).

``EXPR`` follows pytest's marker grammar: marker names, ``and``, ``or``, ``not`` and
parentheses. Standard library only (it runs before any venv exists); an expression it
cannot read counts as "could select"."""

from __future__ import annotations

import re
import sys

OPERATORS = frozenset({"and", "or", "not", "(", ")"})


def selects(expr: str, markers: set[str]) -> bool:
    """Whether ``expr`` holds for a test that carries exactly ``markers``."""
    tokens = re.findall(r"\(|\)|[^\s()]+", expr)
    words = [t if t in OPERATORS else str(t in markers) for t in tokens]
    # only True, False, and, or, not and parentheses reach eval
    return bool(eval(" ".join(words), {"__builtins__": {}}))  # noqa: S307


def main(argv: list[str]) -> int:
    expr, marker = argv
    if not expr.strip():
        return 0
    try:
        hit = selects(expr, {marker}) or selects(expr, {marker, "slow"})
    except SyntaxError:
        return 0
    return 0 if hit else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
