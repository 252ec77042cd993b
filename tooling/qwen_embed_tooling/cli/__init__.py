"""``qwen-embed bench`` and ``qwen-embed serve``: commands the library's ``qwen-embed``
finds through the entry-point group ``qwen_embed.commands`` (see this distribution's
``pyproject.toml``). Each is a module-level click command importing only click and the
library's CLI options at module level, so ``qwen-embed --help`` stays light."""

from __future__ import annotations

from .bench import bench
from .serve import serve

__all__ = ["bench", "serve"]
