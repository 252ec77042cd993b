"""``python -m qwen_embed_tooling.testing``: run an `EmbeddingServer` in the foreground."""

import sys

from ._cli import main

sys.exit(main())
