"""The one module that imports the HTTP library.

openai 2.x is built on ``httpx``; openai 3.x on ``httpx2``, an API-identical fork whose
client types are the only ones openai 3.x accepts as ``http_client=``. This module picks
the library that matches the installed openai major version (the same rule as
``langchain_openai/_compat.py``) and re-exports it as ``httpx``. Every other module gets
the HTTP library from here and nowhere else.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import openai

__all__ = ["HTTP_LIBRARY", "OPENAI_MAJOR", "httpx"]


def _openai_major() -> int:
    match = re.match(r"\D*(\d+)", str(getattr(openai, "__version__", "")))
    return int(match.group(1)) if match else 2


OPENAI_MAJOR: int = _openai_major()

if TYPE_CHECKING:
    import httpx
elif OPENAI_MAJOR >= 3:
    import httpx2 as httpx
else:
    import httpx

HTTP_LIBRARY: str = httpx.__name__
"""``"httpx"`` or ``"httpx2"``: the library in use, for reports and the benchmark."""
