"""The docs' parameter tables, generated from the settings' declaration
(``qwen_embed_plugins._settings.SETTINGS``).

Each table stands in a docs page between ``<!-- settings-table: SURFACE -->`` and
``<!-- /settings-table -->``; SURFACE is ``core`` (every setting: the core clients, Ray,
the adapters), ``langchain`` or ``llamaindex`` (that adapter's field names and stock
aliases). ``python -m qwen_embed_tooling.settings_docs`` rewrites them in place;
``--check`` only says which are stale (exit status 1). ``tests/test_settings.py``
compares every table with what this module renders.
"""

from __future__ import annotations

import re
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from qwen_embed_plugins._settings import SETTINGS, Setting
from qwen_embed_plugins.integrations._names import TIMEOUT, TIMEOUT_FIELDS

__all__ = ["PAGES", "main", "render", "stale_tables", "tables", "update"]

PAGES: Final = ("api.md", "langchain.md", "llamaindex.md")
"""The docs pages (under ``docs/``) that hold settings tables."""

_BLOCK = re.compile(
    r"(<!-- settings-table: (?P<surface>\w+) -->\n)(?P<table>.*?)(<!-- /settings-table -->)",
    re.DOTALL,
)


def _type_text(kind: Any) -> str:
    """``kind`` as the docs show it: each member of a union in its own code span."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        return " \\| ".join(_type_text(member) for member in typing.get_args(kind))
    if typing.get_origin(kind) is typing.Literal:
        return " \\| ".join(f'`"{value}"`' for value in typing.get_args(kind))
    if kind is type(None):
        return "`None`"
    if isinstance(kind, type):
        return f"`{kind.__name__}`"
    text = str(kind).replace("typing.", "").replace("collections.abc.", "")
    return f"`{text}`"


# A word that Markdown would read as markup (a URL, *auth*): a code span.
_CODE_LIKE = re.compile(r"[^\s(),;]*(?:\*|://)[^\s(),;]*")


def _markdown(text: str) -> str:
    """A doc line as a table cell: URL-like and starred words as code; ``|``, ``<`` and
    ``>`` escaped in the rest (a pipe in a code span splits a GitHub table cell)."""
    parts = _CODE_LIKE.sub(lambda match: f"`{match.group(0)}`", text).split("`")
    escaped = (
        part.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;") for part in parts[::2]
    )
    parts[::2] = escaped
    return "`".join(parts)


def _value_text(value: Any) -> str:
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def _aliases(surface: str) -> Mapping[str, str]:
    """The stock names an adapter accepts, by the setting they set (a setting's field
    renamed by the adapter is named by its setting)."""
    if surface == "langchain":
        from qwen_embed_plugins.integrations.langchain import QwenPooledEmbeddings

        stock = QwenPooledEmbeddings._stock
    elif surface == "llamaindex":
        from qwen_embed_plugins.integrations.llama_index import QwenPooledEmbedding

        stock = QwenPooledEmbedding._stock
    else:
        return {}
    renamed = _renamed(surface)
    back = {field: name for name, field in renamed.items()}
    found: dict[str, list[str]] = {}
    for alias, field in stock.aliases.items():
        # a stock timeout= sets every *_timeout field, as the core's timeout= does
        for each in TIMEOUT_FIELDS.values() if field == TIMEOUT else (back.get(field, field),):
            found.setdefault(each, []).append(f"`{alias}`")
    also = " (sets every `*_timeout` field)"
    return {
        name: ", ".join(names) + (also if name in TIMEOUT_FIELDS.values() else "")
        for name, names in found.items()
    }


def _renamed(surface: str) -> Mapping[str, str]:
    """Setting -> the adapter's field name, where it differs."""
    if surface == "llamaindex":
        return {"model": "model_name", "batch_size": "embed_batch_size"}
    return {}


def _row(setting: Setting, surface: str, aliases: Mapping[str, str]) -> str:
    name = _renamed(surface).get(setting.name, setting.name)
    env = f"`{setting.env}`" if setting.env else ""
    meaning = _markdown(setting.doc)
    if setting.name in aliases:
        meaning += f" Alias: {aliases[setting.name]}."
    cells = [f"`{name}`", _type_text(setting.type), _value_text(setting.default), env]
    if surface == "core":
        cli = f"`{setting.cli}`" if setting.cli else ""
        into = f"`{setting.into or setting.name}`"
        cells += [cli, into]
    return "| " + " | ".join([*cells, meaning]) + " |"


def render(surface: str) -> str:
    """The markdown table of ``surface`` (``core``, ``langchain``, ``llamaindex``)."""
    if surface == "core":
        head = "| setting | type | default | env | CLI | `EmbeddingConfig` | meaning |"
        rule = "|---|---|---|---|---|---|---|"
    else:
        head = "| field | type | default | env | meaning |"
        rule = "|---|---|---|---|---|"
    aliases = _aliases(surface)
    rows = [_row(setting, surface, aliases) for setting in SETTINGS]
    return "\n".join([head, rule, *rows]) + "\n"


def update(text: str) -> str:
    """``text`` (a docs page) with every settings table rendered afresh."""

    def fill(match: re.Match[str]) -> str:
        return match.group(1) + render(match.group("surface")) + match.group(4)

    return _BLOCK.sub(fill, text)


def tables(text: str) -> dict[str, str]:
    """The settings tables of ``text`` (a docs page), by surface, as written."""
    return {m.group("surface"): m.group("table") for m in _BLOCK.finditer(text)}


def stale_tables(docs: Path) -> list[str]:
    """The pages under ``docs`` whose settings tables differ from the declaration."""
    return [page for page in PAGES if (text := (docs / page).read_text()) != update(text)]


def main(argv: list[str] | None = None) -> int:
    """Rewrite the settings tables of the docs (``--check``: report stale ones only)."""
    args = sys.argv[1:] if argv is None else argv
    docs = Path(__file__).resolve().parents[2] / "docs"
    stale = stale_tables(docs)
    if "--check" in args:
        for page in stale:
            print(f"docs/{page}: settings table out of date", file=sys.stderr)
        return 1 if stale else 0
    for page in stale:
        path = docs / page
        path.write_text(update(path.read_text()))
        print(f"docs/{page}: settings table rewritten")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
